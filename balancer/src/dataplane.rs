//! Loading, attaching and reading the XDP program (filled in by the dataplane work).

//! The demo inference worker (filled in by the mock-worker work).

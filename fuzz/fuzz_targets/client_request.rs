//! A client's bytes as the server's fast path reads them: the request head
//! (httparse, the plain-request rules, `Content-Length`), then the request
//! built over the frozen head, or the bytes left to hyper.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|wire: &[u8]| {
    balancer::fuzzing::client_request(wire);
});

//! A worker's answer as the fast path reads it: the response head, then the
//! body's framing (Content-Length, chunk sizes and extensions, trailers).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|wire: &[u8]| {
    balancer::fuzzing::worker_response(wire);
});

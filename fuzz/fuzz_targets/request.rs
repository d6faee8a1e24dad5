//! Request path, method and body: routing, model extraction, body rewrites.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&[u8], &str, &[u8])| {
    let (method, path, body) = input;
    balancer::fuzzing::request(method, path, body);
});

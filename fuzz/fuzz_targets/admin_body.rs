//! Admin API bodies: worker specs and resilience patches.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    balancer::fuzzing::admin_body(body);
});

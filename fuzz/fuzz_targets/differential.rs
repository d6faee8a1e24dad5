//! The fast path and the fast client against hyper on the same bytes: the
//! input is split at its first NUL into a client's bytes and a worker's.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let (client, worker) = match input.iter().position(|&b| b == 0) {
        Some(at) => (&input[..at], &input[at + 1..]),
        None => (input, &[][..]),
    };
    balancer::fuzzing::differential(client, worker);
});

//! The `--config` file's text.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    balancer::fuzzing::config_toml(text);
});

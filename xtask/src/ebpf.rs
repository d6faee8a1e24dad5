//! Building and linting the XDP program with the nightly toolchain.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, ensure};

use crate::shell::{run, with_cargo_bin};
use crate::workspace_root;

const TARGET: &str = "bpfel-unknown-none";

/// Where the build puts the object, which is also the first place the
/// agent looks for it.
pub fn object_path() -> PathBuf {
    workspace_root().join("target/bpfel-unknown-none/release/balancer-ebpf")
}

/// Builds the eBPF object and returns its path.
pub fn build() -> Result<PathBuf> {
    run(&mut nightly_cargo("build"))?;
    let object = object_path();
    ensure!(
        object.is_file(),
        "the build succeeded but {} is missing",
        object.display()
    );
    eprintln!("eBPF object: {}", object.display());
    Ok(object)
}

/// Clippy on the eBPF crate, for the target it is really built for.
pub fn clippy() -> Result<()> {
    run(nightly_cargo("clippy").args(["--", "-D", "warnings"]))
}

/// `cargo +nightly <subcommand>` for the eBPF crate, run from its folder with
/// a clean environment.
fn nightly_cargo(subcommand: &str) -> Command {
    let mut command = with_cargo_bin("cargo");
    command
        .args([
            "+nightly",
            subcommand,
            "-Z",
            "build-std=core",
            "--target",
            TARGET,
        ])
        .arg("--release")
        .current_dir(workspace_root().join("balancer-ebpf"));
    scrub_outer_cargo_env(&mut command);
    command
}

/// Removes what the outer `cargo xtask` (or the user's shell) set for a
/// host build: a pinned toolchain, host RUSTFLAGS or wrappers, a target dir
/// elsewhere than where the agent looks, `cargo run`'s package variables.
/// Any of them would break or misplace the nightly cross build.
pub fn scrub_outer_cargo_env(command: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if let Some(key) = key.to_str()
            && leaks_into_nested_build(key)
        {
            command.env_remove(key);
        }
    }
}

fn leaks_into_nested_build(key: &str) -> bool {
    // Registry, network and terminal settings are the user's and harmless.
    const KEPT_PREFIXES: [&str; 5] = [
        "CARGO_HOME",
        "CARGO_NET_",
        "CARGO_HTTP_",
        "CARGO_REGISTRIES_",
        "CARGO_TERM_",
    ];
    const EXACT: [&str; 8] = [
        "CARGO",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTDOC",
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
        "RUSTUP_TOOLCHAIN",
    ];
    if KEPT_PREFIXES.iter().any(|prefix| key.starts_with(prefix)) {
        return false;
    }
    EXACT.contains(&key) || key.starts_with("CARGO_") || key.starts_with("__CARGO")
}

#[cfg(test)]
mod tests {
    use super::leaks_into_nested_build;

    #[test]
    fn outer_build_settings_are_scrubbed() {
        for key in [
            "CARGO",
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_TARGET_DIR",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_BUILD_TARGET",
            "RUSTFLAGS",
            "RUSTC_WRAPPER",
            "RUSTUP_TOOLCHAIN",
        ] {
            assert!(leaks_into_nested_build(key), "{key} should be removed");
        }
    }

    #[test]
    fn user_settings_are_kept() {
        for key in [
            "CARGO_HOME",
            "CARGO_NET_OFFLINE",
            "CARGO_HTTP_PROXY",
            "CARGO_TERM_COLOR",
            "PATH",
            "HOME",
            "RUSTUP_HOME",
        ] {
            assert!(!leaks_into_nested_build(key), "{key} should be kept");
        }
    }
}

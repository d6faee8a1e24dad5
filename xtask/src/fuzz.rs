//! `cargo xtask fuzz`: every cargo-fuzz target in `fuzz/` for a bounded
//! time each (nightly, libFuzzer). Installs cargo-fuzz when it is missing.
//! A crash fails the run and leaves its input under `fuzz/artifacts/`.

use std::path::Path;

use anyhow::{Context, Result};

use crate::shell::{cargo, run};

/// The targets, as `fuzz/Cargo.toml` names them.
const TARGETS: [&str; 6] = [
    "request",
    "config_toml",
    "admin_body",
    "worker_response",
    "client_request",
    "differential",
];

pub fn fuzz(root: &Path, seconds: u64, only: Option<&str>) -> Result<()> {
    if let Some(name) = only
        && !TARGETS.contains(&name)
    {
        anyhow::bail!("no fuzz target {name:?} (targets: {})", TARGETS.join(", "));
    }
    let installed = cargo()
        .args(["+nightly", "fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        run(cargo().args(["install", "cargo-fuzz", "--locked"]))
            .context("installing cargo-fuzz")?;
    }
    for target in TARGETS.into_iter().filter(|t| only.is_none_or(|o| o == *t)) {
        eprintln!("==> fuzz {target} for {seconds}s");
        run(cargo()
            .args(["+nightly", "fuzz", "run", target, "--"])
            .arg(format!("-max_total_time={seconds}"))
            .current_dir(root))
        .with_context(|| format!("fuzz target {target} failed (see fuzz/artifacts/{target})"))?;
    }
    Ok(())
}

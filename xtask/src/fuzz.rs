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
        // New inputs go to the (ignored) corpus folder; the committed seeds,
        // where a target has them, start it from well-formed exchanges.
        let mut fuzz = cargo();
        fuzz.args(["+nightly", "fuzz", "run", target]);
        let seeds = root.join("fuzz/seeds").join(target);
        if seeds.is_dir() {
            let corpus = root.join("fuzz/corpus").join(target);
            std::fs::create_dir_all(&corpus).context("creating the fuzz corpus folder")?;
            fuzz.arg(corpus).arg(seeds);
        }
        run(fuzz
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .current_dir(root))
        .with_context(|| format!("fuzz target {target} failed (see fuzz/artifacts/{target})"))?;
    }
    Ok(())
}

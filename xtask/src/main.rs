//! Developer entry points for the balancer workspace (`cargo xtask ...`).

mod bench;
mod dist;
mod ebpf;
mod fuzz;
mod setup;
mod shell;

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail, ensure};
use clap::{Parser, Subcommand};

use crate::shell::{cargo, run};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Developer entry points for the balancer workspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Check and install what building and testing need: the nightly
    /// toolchain with rust-src, bpf-linker, and (as root) Debian packages.
    /// Idempotent.
    Setup,
    /// Build the XDP program into
    /// target/bpfel-unknown-none/release/balancer-ebpf.
    BuildEbpf {
        /// Release is the only profile built: unoptimised eBPF code fails
        /// the kernel verifier. The flag is accepted so the command reads
        /// like cargo's.
        #[arg(long)]
        release: bool,
    },
    /// Build everything and start the gateway (`balancer launch`) with
    /// three demo workers, unless --worker-urls is given.
    Run {
        /// Arguments for `balancer launch`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Benchmarks on loopback (release builds).
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
    /// A bounded (about 20 s) chaos run: demo workers behind the gateway
    /// turn slow, answer empty completions, truncate streams and answer 429
    /// in bursts; prints how fast each was isolated and how many client
    /// requests failed, and fails when a fault goes uncaught, the 429 worker
    /// is isolated, or too many requests fail.
    Chaos {
        /// Run the same faults under the default breaker flags and only
        /// print what they catch.
        #[arg(long)]
        defaults: bool,
    },
    /// Run every cargo-fuzz target (request bodies and paths, the config
    /// file, admin bodies, workers' answers, client heads, and the
    /// differential test of the HTTP/1.1 paths against hyper) for a bounded
    /// time each; nightly.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
        /// Only this target (e.g. `differential`).
        #[arg(long)]
        target: Option<String>,
    },
    /// Build the Debian package (target/debian/balancer_<version>_<arch>.deb):
    /// binary, eBPF object, units, example configuration, manual pages,
    /// completions, dashboard and alerts. The release build takes about 9
    /// minutes from scratch.
    Dist {
        /// `dev` packages the debug build in seconds, to check the
        /// packaging; never ship it.
        #[arg(long, value_enum, default_value_t = dist::Profile::Release)]
        profile: dist::Profile,
        /// Then install it on this host (as root), check it as CI does
        /// (files, `balancer --version`, the eBPF object it finds, the admin
        /// token, `systemd-analyze verify`), and purge it.
        #[arg(long)]
        check: bool,
    },
    /// What CI runs: setup, formatting, eBPF build, clippy, all tests, the
    /// Debian package (of the debug build) installed and checked, the chaos
    /// run.
    Test {
        /// Parallel test threads; the tests wait on I/O far more than they
        /// compute, but timing-sensitive ones suffer on a crowded CPU.
        #[arg(long, default_value_t = 4)]
        test_threads: usize,
    },
}

fn main() -> ExitCode {
    match dispatch(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("\nxtask: FAILED: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(task: Task) -> Result<()> {
    match task {
        Task::Setup => setup::run(setup::Scope::Everything),
        Task::BuildEbpf { release: _ } => ebpf::build().map(|_| ()),
        Task::Run { args } => run_gateway(args),
        Task::Bench { which } => bench::bench(which),
        Task::Chaos { defaults } => chaos(defaults),
        Task::Dist { profile, check } => {
            let package = dist::build(profile)?;
            if check {
                dist::install_and_check(&package)?;
            }
            Ok(())
        }
        Task::Test { test_threads } => test(test_threads),
        Task::Fuzz { seconds, target } => fuzz::fuzz(workspace_root(), seconds, target.as_deref()),
    }
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(|dir| workspace_root().join(dir))
        .unwrap_or_else(|| workspace_root().join("target"))
}

fn run_gateway(args: Vec<OsString>) -> Result<()> {
    // The gateway works without the XDP program (L7 only), so toolchain or
    // eBPF build trouble is reported but does not stop it.
    let object = match setup::run(setup::Scope::Toolchain).and_then(|()| ebpf::build()) {
        Ok(object) => Some(object),
        Err(error) => {
            eprintln!("xtask: WARNING: no eBPF object ({error:#}); continuing in L7-only mode");
            None
        }
    };

    run(cargo()
        .args(["build", "--package", "balancer", "--bin", "balancer"])
        .current_dir(workspace_root()))?;

    let binary = target_dir().join("debug/balancer");
    let mut launch = Command::new(&binary);
    launch.arg("launch");
    if !args.iter().any(|arg| is_flag(arg, "--worker-urls")) {
        launch.args(["--demo-workers", "3"]);
    }
    launch.args(&args);
    let mut shown = shell::display(&launch);
    if let Some(object) = object {
        shown = format!("BALANCER_EBPF_OBJECT={} {shown}", object.display());
        launch.env("BALANCER_EBPF_OBJECT", object);
    }
    eprintln!("$ {shown}");
    // exec, so signals (Ctrl-C) and the exit status are the gateway's own.
    let error = launch.exec();
    Err(error).with_context(|| format!("starting {}", binary.display()))
}

/// `arg` is `flag` or `flag=value`.
fn is_flag(arg: &OsString, flag: &str) -> bool {
    arg.to_str().is_some_and(|arg| {
        arg == flag
            || arg
                .strip_prefix(flag)
                .is_some_and(|rest| rest.starts_with('='))
    })
}

/// The chaos example, in the debug profile `cargo test` has built already
/// (a release build would add minutes to CI).
fn chaos(defaults: bool) -> Result<()> {
    let mut chaos = cargo();
    chaos
        .args(["run", "--package", "balancer", "--example", "chaos"])
        .current_dir(workspace_root());
    if defaults {
        chaos.args(["--", "--defaults"]);
    }
    run(&mut chaos)
}

fn test(test_threads: usize) -> Result<()> {
    let steps: [(&str, &dyn Fn() -> Result<()>); 8] = [
        ("setup", &|| setup::run(setup::Scope::Everything)),
        ("cargo fmt --check", &|| {
            run(cargo()
                .args(["fmt", "--all", "--", "--check"])
                .current_dir(workspace_root()))
        }),
        ("build-ebpf", &|| ebpf::build().map(|_| ())),
        ("clippy (eBPF, nightly)", &ebpf::clippy),
        ("clippy (workspace)", &|| {
            run(cargo()
                .args([
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ])
                .current_dir(workspace_root()))
        }),
        ("cargo test --workspace", &|| {
            let before = pinned_balancer_state();
            // The restart test runs the agent binary as a process of its own.
            run(cargo()
                .args(["build", "--package", "balancer", "--bin", "balancer"])
                .current_dir(workspace_root()))?;
            run(cargo()
                .args(["test", "--workspace", "--", "--test-threads"])
                .arg(test_threads.to_string())
                .env("BALANCER_EBPF_OBJECT", ebpf::object_path())
                .current_dir(workspace_root()))?;
            // Tests pin XDP state under bpffs; every one must remove what it
            // pinned, whatever happened.
            let left: Vec<String> = pinned_balancer_state()
                .into_iter()
                .filter(|p| !before.contains(p))
                .collect();
            ensure!(
                left.is_empty(),
                "the tests left pinned XDP state behind: {left:?}"
            );
            Ok(())
        }),
        // The debug build the tests just made: a release build would add
        // about 9 minutes, and the packaging is the same for both.
        ("Debian package: build, install, check, purge", &|| {
            let started = std::time::Instant::now();
            let package = dist::build(dist::Profile::Dev)?;
            dist::install_and_check(&package)?;
            println!(
                "dist: the package step took {:.0} s",
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }),
        ("chaos run (about 20 s)", &|| chaos(false)),
    ];
    let total = steps.len();
    for (number, (name, step)) in steps.iter().enumerate() {
        println!("\n==> [{}/{total}] {name}", number + 1);
        if let Err(error) = step() {
            bail!("step [{}/{total}] {name}: {error:#}", number + 1);
        }
    }
    println!("\n==> all {total} steps passed");
    Ok(())
}

/// Entries of the BPF filesystem that look like the balancer's.
fn pinned_balancer_state() -> Vec<String> {
    std::fs::read_dir("/sys/fs/bpf")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with("balancer"))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_urls_flag_is_recognised_in_both_spellings() {
        assert!(is_flag(&"--worker-urls".into(), "--worker-urls"));
        assert!(is_flag(&"--worker-urls=http://a:1".into(), "--worker-urls"));
        assert!(!is_flag(&"--worker-urls-file".into(), "--worker-urls"));
        assert!(!is_flag(&"--port".into(), "--worker-urls"));
    }
}

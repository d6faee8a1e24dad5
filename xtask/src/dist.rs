//! `cargo xtask dist`: the Debian package, and the check CI runs on it.
//!
//! Builds the binary and the eBPF object, lets the binary write its manual
//! pages and shell completions into `target/<profile>/dist/`, and hands
//! the rest to cargo-deb, configured by `[package.metadata.deb]` in
//! balancer/Cargo.toml (what goes where). The check installs the package on
//! this host as an operator would, looks at the result, and purges it. This
//! module owns `target/<profile>/dist/` and the installed package during the
//! check; it does not touch the sources or the units.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use clap::ValueEnum;

use crate::shell::{capture, cargo, run, stdout_of, with_cargo_bin};
use crate::{ebpf, setup, target_dir, workspace_root};

/// Which build goes into the package.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// The release build (fat LTO: about 9 minutes from scratch on 2 cores).
    Release,
    /// The debug build the tests use: seconds, for checking the packaging
    /// itself (CI), never for shipping.
    Dev,
}

impl Profile {
    /// The folder under `target/` cargo builds this profile into.
    fn dir(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Dev => "debug",
        }
    }
}

/// What an installed package must hold (besides the units, checked by
/// `systemd-analyze verify`).
const INSTALLED_FILES: [&str; 12] = [
    "/usr/bin/balancer",
    "/usr/lib/balancer/balancer-ebpf",
    "/etc/balancer/balancer.toml",
    "/usr/share/man/man1/balancer.1",
    "/usr/share/man/man1/balancer-launch.1",
    "/usr/share/bash-completion/completions/balancer",
    "/usr/share/zsh/vendor-completions/_balancer",
    "/usr/share/fish/vendor_completions.d/balancer.fish",
    "/usr/share/balancer/grafana/balancer.json",
    "/usr/share/balancer/prometheus/alerts.yml",
    "/usr/share/doc/balancer/README.md",
    // The README links it relatively: the link resolves where it is installed.
    "/usr/share/doc/balancer/docs/performance.md",
];

const UNITS: [&str; 3] = [
    "balancer.service",
    "balancer-l7.service",
    "balancer-register@.service",
];

/// Builds the package and returns its path.
pub fn build(profile: Profile) -> Result<PathBuf> {
    setup::packaging_tool()?;
    let object = ebpf::build()?;
    let mut build = cargo();
    build
        .args(["build", "--package", "balancer", "--bin", "balancer"])
        .current_dir(workspace_root());
    if profile == Profile::Release {
        build.arg("--release");
    }
    run(&mut build)?;

    let out = target_dir().join(profile.dir());
    let binary = out.join("balancer");
    let dist = out.join("dist");
    if dist.exists() {
        std::fs::remove_dir_all(&dist).with_context(|| format!("emptying {}", dist.display()))?;
    }
    std::fs::create_dir_all(dist.join("completions"))?;
    std::fs::copy(&object, dist.join("balancer-ebpf"))
        .with_context(|| format!("copying {}", object.display()))?;
    run(Command::new(&binary).arg("man").arg(dist.join("man")))?;
    for (shell, file) in [
        ("bash", "balancer"),
        ("zsh", "_balancer"),
        ("fish", "balancer.fish"),
    ] {
        let script = stdout_of(Command::new(&binary).args(["completions", shell]))?;
        std::fs::write(dist.join("completions").join(file), script + "\n")?;
    }

    let mut deb = with_cargo_bin("cargo");
    deb.args(["deb", "--package", "balancer", "--no-build"])
        .current_dir(workspace_root());
    if profile == Profile::Dev {
        // The debug binary is 180 MB of mostly debug info; the check needs
        // none of it, and xz over all of it would take minutes.
        deb.args(["--profile", "dev", "--strip", "--fast"]);
    }
    let shown = crate::shell::display(&deb);
    eprintln!("$ {shown}");
    let output = capture(&mut deb)?;
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    ensure!(
        output.status.success(),
        "`{shown}` failed ({})",
        output.status
    );
    // cargo-deb prints the package's path, and nothing else, on stdout.
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    ensure!(
        path.is_file(),
        "`{shown}` did not name the package it wrote"
    );
    println!("package: {}", path.display());
    Ok(path)
}

/// Installs `package` on this host (root only), checks it as an operator
/// would, and purges it again whatever the outcome.
pub fn install_and_check(package: &Path) -> Result<()> {
    // SAFETY: geteuid cannot fail and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        println!("dist: SKIPPED installing {}: not root", package.display());
        return Ok(());
    }
    let installed = capture(Command::new("dpkg-query").args(["-W", "balancer"]))?;
    if installed.status.success() {
        bail!(
            "a balancer package is installed on this host already; the check installs and \
             purges its own: `dpkg --purge balancer` first"
        );
    }
    let started = Instant::now();
    run(Command::new("dpkg").arg("-i").arg(package))?;
    let checked = check_installed().and_then(|()| check_upgrade(package));
    let purged = run(Command::new("dpkg").args(["--purge", "balancer"]));
    checked?;
    purged?;
    println!(
        "dist: installed, checked and purged in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The configuration file as the package installs it.
const CONFIG: &str = "/etc/balancer/balancer.toml";
/// The admin token postinst creates.
const ADMIN_TOKEN: &str = "/etc/balancer/admin-token";

/// An upgrade over an operator's changes, as the README's Operations
/// section describes it: the package installed again over an edited
/// configuration keeps the edit and the admin token, and the installed
/// binary accepts the installed configuration (`--check-config`).
fn check_upgrade(package: &Path) -> Result<()> {
    const EDIT: &str = "\n# edited by the operator\n";
    let mut edited =
        std::fs::read_to_string(CONFIG).with_context(|| format!("reading {CONFIG}"))?;
    edited.push_str(EDIT);
    std::fs::write(CONFIG, &edited).with_context(|| format!("editing {CONFIG}"))?;
    let token = std::fs::read(ADMIN_TOKEN).with_context(|| format!("reading {ADMIN_TOKEN}"))?;
    run(Command::new("dpkg").arg("-i").arg(package))?;
    ensure!(
        std::fs::read_to_string(CONFIG)? == edited,
        "the upgrade did not keep the edited {CONFIG}"
    );
    ensure!(
        std::fs::read(ADMIN_TOKEN)? == token,
        "the upgrade replaced {ADMIN_TOKEN}"
    );
    let checked = stdout_of(
        Command::new("/usr/bin/balancer")
            .args(["launch", "--config", CONFIG, "--check-config"])
            .env_remove("BALANCER_EBPF_OBJECT"),
    )?;
    ensure!(
        checked.starts_with("balancer: configuration OK"),
        "`balancer launch --config {CONFIG} --check-config` says `{checked}`"
    );
    println!("dist: upgraded over an edited configuration: kept; {checked}");
    Ok(())
}

fn check_installed() -> Result<()> {
    for file in INSTALLED_FILES {
        ensure!(
            Path::new(file).is_file(),
            "the package did not install {file}"
        );
    }
    let version = stdout_of(Command::new("/usr/bin/balancer").arg("--version"))?;
    ensure!(
        version == format!("balancer {}", env!("CARGO_PKG_VERSION")),
        "`balancer --version` says `{version}`"
    );
    println!("dist: {version}");

    let token = std::fs::metadata(ADMIN_TOKEN)
        .context("postinst did not create /etc/balancer/admin-token")?;
    use std::os::unix::fs::PermissionsExt;
    ensure!(
        token.permissions().mode() & 0o777 == 0o600 && token.len() == 65,
        "/etc/balancer/admin-token: mode {:o}, {} bytes; expected 0600 and 64 hex digits",
        token.permissions().mode() & 0o777,
        token.len()
    );

    // The installed binary must load the installed object, not one the
    // environment or this source tree points at.
    let object = stdout_of(
        Command::new("/usr/bin/balancer")
            .args(["l4", "object"])
            .env_remove("BALANCER_EBPF_OBJECT"),
    )?;
    ensure!(
        object == "/usr/lib/balancer/balancer-ebpf",
        "the installed binary would load {object}"
    );
    println!("dist: eBPF object {object}");

    let mut verify = Command::new("systemd-analyze");
    verify.arg("verify");
    for unit in UNITS {
        verify.arg(Path::new("/usr/lib/systemd/system").join(unit));
    }
    let shown = crate::shell::display(&verify);
    let output = capture(&mut verify)?;
    let report = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.success() && report.trim().is_empty(),
        "`{shown}`: {}",
        report.trim()
    );
    println!("dist: {shown}: clean");
    Ok(())
}

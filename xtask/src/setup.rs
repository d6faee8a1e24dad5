//! `cargo xtask setup`: the toolchain recipe of /work/shared/TOOLCHAIN.md,
//! made idempotent, plus the Debian packages the tests use.
//!
//! Every step prints one line ending in `ok`, `installing ...` (followed by
//! the step's line again once done) or `FAILED: <why and what to do>`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::ebpf::scrub_outer_cargo_env;
use crate::shell::{capture, display, stdout_of, with_cargo_bin};

/// The bpf-linker release that builds against the nightly's LLVM here.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// The cargo-deb release `cargo xtask dist` packages with (installs with
/// `--locked` on the workspace's rust-version).
const CARGO_DEB_VERSION: &str = "3.8.0";

/// Debian packages that building the agent needs: etcd-client compiles
/// etcd's protos with `protoc` at build time, and they import Google's
/// well-known types, which come with libprotobuf-dev (only a recommendation
/// of protobuf-compiler, and recommendations are not installed here).
/// `cargo xtask run` installs these too.
const BUILD_PACKAGES: [&str; 2] = ["protobuf-compiler", "libprotobuf-dev"];

/// Debian packages the tests and benchmarks call, besides the build's.
const TEST_PACKAGES: [&str; 10] = [
    "iproute2",
    "ethtool",
    "bpftool",
    "nftables",
    "wrk",
    "iputils-ping",
    // The discovery tests start their own etcd (the packaged service is not used).
    "etcd-server",
    "etcd-client",
    // systemd-analyze, for the units (tests/tests/deploy.rs and the
    // package check).
    "systemd",
    // promtool, for the alert rules (tests/tests/dashboards.rs); nothing
    // starts the server itself.
    "prometheus",
];

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// What building the eBPF object needs (the `run` fast path).
    Toolchain,
    /// The toolchain and the system packages.
    Everything,
}

pub fn run(scope: Scope) -> Result<()> {
    let mut failed = Vec::new();
    if let Err(error) = toolchain() {
        failed.push(format!("{error:#}"));
    }
    let packages = match scope {
        Scope::Toolchain => BUILD_PACKAGES.to_vec(),
        Scope::Everything => [&BUILD_PACKAGES[..], &TEST_PACKAGES[..]].concat(),
    };
    if let Err(error) = install_packages(&packages) {
        failed.push(format!("{error:#}"));
    }
    if scope == Scope::Everything
        && let Err(error) = packaging_tool()
    {
        failed.push(format!("{error:#}"));
    }
    if !failed.is_empty() {
        bail!("setup incomplete: {}", failed.join("; "));
    }
    Ok(())
}

/// The Debian packages a build of the agent needs (`bench` builds it
/// without the rest of the setup).
pub fn build_packages() -> Result<()> {
    install_packages(&BUILD_PACKAGES)
}

/// Each step needs the previous one, so the first failure ends the chain.
fn toolchain() -> Result<()> {
    step("nightly toolchain", nightly)?;
    step("rust-src for nightly", rust_src)?;
    let llvm = step("LLVM symlinks for bpf-linker", llvm_links)?;
    step(&format!("bpf-linker {BPF_LINKER_VERSION}"), || {
        bpf_linker(&llvm)
    })?;
    Ok(())
}

/// What a step did when it succeeded.
enum Done<T> {
    AlreadyThere(T),
    Installed(T),
}

/// Runs one step and prints its line(s).
fn step<T>(name: &str, work: impl FnOnce() -> Result<Done<T>>) -> Result<T> {
    match work() {
        Ok(Done::AlreadyThere(value)) => {
            println!("setup: {name}: ok");
            Ok(value)
        }
        Ok(Done::Installed(value)) => {
            println!("setup: {name}: ok (installed)");
            Ok(value)
        }
        Err(error) => {
            println!("setup: {name}: FAILED: {error:#}");
            Err(error.context(format!("setup step `{name}`")))
        }
    }
}

fn installing(name: &str, command: &Command) {
    println!("setup: {name}: installing ({})", display(command));
}

fn nightly() -> Result<Done<()>> {
    let list = stdout_of(rustup().args(["toolchain", "list"]))
        .context("rustup is needed to manage toolchains; install it from https://rustup.rs")?;
    if list.lines().any(|line| line.starts_with("nightly")) {
        return Ok(Done::AlreadyThere(()));
    }
    let mut install = rustup();
    install.args(["toolchain", "install", "nightly", "--profile", "minimal"]);
    installing("nightly toolchain", &install);
    crate::shell::run(&mut install).context("check network access to static.rust-lang.org")?;
    Ok(Done::Installed(()))
}

fn rust_src() -> Result<Done<()>> {
    let installed =
        stdout_of(rustup().args(["component", "list", "--toolchain", "nightly", "--installed"]))?;
    if installed.lines().any(|line| line.starts_with("rust-src")) {
        return Ok(Done::AlreadyThere(()));
    }
    let mut add = rustup();
    add.args(["component", "add", "rust-src", "--toolchain", "nightly"]);
    installing("rust-src for nightly", &add);
    crate::shell::run(&mut add).context("check network access to static.rust-lang.org")?;
    Ok(Done::Installed(()))
}

/// The nightly's libLLVM and the folder bpf-linker is built against.
struct Llvm {
    /// `LLVM_PREFIX` for building bpf-linker; its `lib` holds the links.
    prefix: PathBuf,
    /// Major version, which picks bpf-linker's `llvm-N` feature.
    major: u32,
}

/// bpf-linker links against the nightly's own libLLVM, found through a
/// folder holding two links to it: `libLLVM.so` for the build and the
/// library's SONAME for the loader at run time (through the binary's
/// RUNPATH, so the folder must stay).
fn llvm_links() -> Result<Done<Llvm>> {
    let sysroot = stdout_of(with_cargo_bin("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let lib = Path::new(&sysroot).join("lib");
    let library = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("libLLVM.so."))
        })
        .with_context(|| {
            format!(
                "no libLLVM.so.* in {}; reinstall nightly with `rustup toolchain install nightly`",
                lib.display()
            )
        })?;
    let soname = library.file_name().expect("found by file name").to_owned();
    let major = llvm_major(&soname.to_string_lossy())?;

    let home = std::env::var_os("HOME").context("HOME is not set")?;
    let prefix = PathBuf::from(home).join(".cache/rust-llvm");
    let dir = prefix.join("lib");
    let links = [dir.join("libLLVM.so"), dir.join(&soname)];
    let llvm = Llvm { prefix, major };
    if links
        .iter()
        .all(|link| std::fs::read_link(link).is_ok_and(|to| to == library))
    {
        return Ok(Done::AlreadyThere(llvm));
    }

    println!(
        "setup: LLVM symlinks for bpf-linker: installing (links in {} to {})",
        dir.display(),
        library.display()
    );
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for link in &links {
        // A stale link (older nightly) or a copy is replaced.
        if link.symlink_metadata().is_ok() {
            std::fs::remove_file(link).with_context(|| format!("removing {}", link.display()))?;
        }
        std::os::unix::fs::symlink(&library, link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(Done::Installed(llvm))
}

/// `libLLVM.so.22.1-rust-1.97.0-nightly` -> 22.
fn llvm_major(soname: &str) -> Result<u32> {
    soname
        .strip_prefix("libLLVM.so.")
        .and_then(|rest| rest.split(['.', '-']).next())
        .and_then(|major| major.parse().ok())
        .with_context(|| format!("cannot read the LLVM version from {soname}"))
}

fn bpf_linker(llvm: &Llvm) -> Result<Done<()>> {
    let expected = format!("bpf-linker {BPF_LINKER_VERSION}");
    if bpf_linker_version().is_ok_and(|version| version == expected) {
        return Ok(Done::AlreadyThere(()));
    }

    let mut install = with_cargo_bin("cargo");
    install
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
        .args(["--no-default-features", "--features"])
        .arg(format!("llvm-{}", llvm.major))
        .arg("--force")
        .env("LLVM_PREFIX", &llvm.prefix);
    scrub_outer_cargo_env(&mut install);
    installing(&format!("bpf-linker {BPF_LINKER_VERSION}"), &install);
    crate::shell::run(&mut install)?;

    match bpf_linker_version() {
        Ok(version) if version == expected => Ok(Done::Installed(())),
        Ok(version) => bail!("installed, but `bpf-linker --version` says `{version}`"),
        Err(error) => Err(error.context(
            "installed, but it does not start (is the libLLVM link folder intact? \
             rerun `cargo xtask setup`)",
        )),
    }
}

/// What `cargo xtask dist` needs beyond a build: cargo-deb.
pub fn packaging_tool() -> Result<()> {
    step(&format!("cargo-deb {CARGO_DEB_VERSION}"), cargo_deb)
}

fn cargo_deb() -> Result<Done<()>> {
    let expected = format!("cargo-deb {CARGO_DEB_VERSION}");
    let installed = stdout_of(with_cargo_bin("cargo-deb").arg("--version"));
    if installed.is_ok_and(|version| version == expected) {
        return Ok(Done::AlreadyThere(()));
    }
    let mut install = with_cargo_bin("cargo");
    install.args([
        "install",
        "cargo-deb",
        "--locked",
        "--version",
        CARGO_DEB_VERSION,
        "--force",
    ]);
    scrub_outer_cargo_env(&mut install);
    installing(&expected, &install);
    crate::shell::run(&mut install)?;
    Ok(Done::Installed(()))
}

fn bpf_linker_version() -> Result<String> {
    // Run on its own, without the toolchain's lib on LD_LIBRARY_PATH, which
    // is how rustc starts it too.
    stdout_of(
        with_cargo_bin("bpf-linker")
            .arg("--version")
            .env_remove("LD_LIBRARY_PATH"),
    )
}

fn rustup() -> Command {
    with_cargo_bin("rustup")
}

fn install_packages(packages: &[&'static str]) -> Result<()> {
    let name = "Debian packages";
    step(name, || {
        let missing = missing_packages(packages)?;
        if missing.is_empty() {
            return Ok(Done::AlreadyThere(()));
        }
        // SAFETY: geteuid cannot fail and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            bail!(
                "missing {}; run `sudo apt-get install {}` or rerun `cargo xtask setup` as root",
                missing.join(" "),
                missing.join(" ")
            );
        }
        let mut update = Command::new("apt-get");
        update
            .arg("update")
            .env("DEBIAN_FRONTEND", "noninteractive");
        installing(name, &update);
        crate::shell::run(&mut update)?;
        let mut install = Command::new("apt-get");
        install
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive");
        installing(name, &install);
        crate::shell::run(&mut install)?;
        let still_missing = missing_packages(packages)?;
        if !still_missing.is_empty() {
            bail!("still missing after apt-get: {}", still_missing.join(" "));
        }
        Ok(Done::Installed(()))
    })
}

fn missing_packages(packages: &[&'static str]) -> Result<Vec<&'static str>> {
    let mut missing = Vec::new();
    for &package in packages {
        let output = capture(
            Command::new("dpkg-query").args(["--show", "--showformat=${db:Status-Status}", package]),
        )
        .context("dpkg-query not found: this step knows only Debian-based systems; install the packages' tools by hand")?;
        if !(output.status.success() && output.stdout == b"installed") {
            missing.push(package);
        }
    }
    Ok(missing)
}

#[cfg(test)]
mod tests {
    use super::llvm_major;

    #[test]
    fn llvm_major_comes_from_the_library_name() {
        assert_eq!(
            llvm_major("libLLVM.so.22.1-rust-1.97.0-nightly").unwrap(),
            22
        );
        assert_eq!(llvm_major("libLLVM.so.23-rust-1.99.0-nightly").unwrap(), 23);
        assert!(llvm_major("libLLVM-22.so").is_err());
    }
}

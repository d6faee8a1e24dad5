//! Helpers shared by the end-to-end tests, one module per concern: the
//! in-process gateway harness ([`gateway`]), the `balancer` binary as a
//! process with its log lines ([`agent`]), and a worker that records what
//! it receives ([`capture`]), a real etcd ([`etcd`]), raw frames ([`packet`]),
//! network namespaces ([`netns`]) and runtimes inside them ([`ns_runtime`]),
//! L4 services written straight into the maps ([`l4`]), raw HTTP/1.1
//! exchanges ([`http1`]), a worker that answers by script, byte for byte
//! ([`scripted`]), the namespace topologies of both forwarding modes
//! ([`topology`]), and the namespace scenario both modes pass with what the
//! namespace tests drive a gateway with ([`l4e2e`]), and certificates and
//! TLS peers ([`tls`]). Helpers never assert on
//! behalf of a test they do not know; they return what they saw.
pub mod agent;
pub mod capture;
pub mod etcd;
pub mod gateway;

use std::path::PathBuf;

/// The eBPF object for tests that load the XDP program, or `None` after
/// printing why the calling test is skipped.
///
/// Those tests need root (loading programs, creating namespaces) and a
/// built object. Without root they skip. Without the object they skip too,
/// except under CI (env `CI` set), where a missing object means the pipeline
/// forgot `cargo xtask build-ebpf` and the test fails.
pub fn ebpf_prerequisites() -> Option<PathBuf> {
    if !root_prerequisite("needs root to load eBPF programs and create network namespaces") {
        return None;
    }
    match balancer_dataplane::locate_object(None) {
        Ok(object) => Some(object),
        Err(error) if std::env::var_os("CI").is_some() => {
            panic!("CI is set and the eBPF object is missing: {error}")
        }
        Err(error) => {
            skip(&error.to_string());
            None
        }
    }
}

/// Whether the calling test may go on as root; when not, prints loudly why
/// it is skipped (`needs`).
pub fn root_prerequisite(needs: &str) -> bool {
    let root = is_root();
    if !root {
        skip(needs);
    }
    root
}

/// Whether this process runs as root: `/proc/self` belongs to the
/// effective user, which avoids an `unsafe` call to `geteuid`.
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn skip(reason: &str) {
    eprintln!("\n*** SKIPPED: {reason} ***\n");
}
pub mod http1;
pub mod l4;
pub mod l4e2e;
pub mod netns;
pub mod ns_runtime;
pub mod packet;
pub mod scripted;
pub mod tls;
pub mod topology;

/// The `balancer` binary, for tests that run the agent as a process; `flag`
/// is one of `balancer launch` that the test needs, so that a stale binary
/// fails with a clear error rather than an unknown-flag exit.
///
/// This crate uses `balancer` as a library, so Cargo sets no
/// `CARGO_BIN_EXE_balancer` for its tests; the binary is where a build of
/// the workspace (or `cargo build -p balancer`) puts it: beside the `deps`
/// folder this test runs from (`target/<profile>/`). `cargo xtask test`
/// builds it first.
pub fn balancer_binary(flag: &str) -> anyhow::Result<PathBuf> {
    use anyhow::{Context, ensure};
    use std::path::Path;
    let exe = std::env::current_exe().context("locating the test executable")?;
    let beside = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("balancer"));
    let fallback = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/balancer");
    let binary = beside
        .into_iter()
        .chain([fallback])
        .find(|path| path.is_file())
        .context(
            "no balancer binary beside the test executable or in target/debug: build it \
             first (`cargo build -p balancer --bin balancer`)",
        )?;
    let help = netns::run(
        binary.to_str().context("non-UTF-8 binary path")?,
        &["launch", "--help"],
    )?;
    ensure!(
        help.contains(flag),
        "{} predates {flag}: rebuild it (`cargo build -p balancer --bin balancer`)",
        binary.display()
    );
    Ok(binary)
}

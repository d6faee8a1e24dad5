//! End-to-end tests of L4 starts that fail: they leave nothing pinned, and
//! `balancer l4 status` says when nothing is attached. Root only (bpffs,
//! namespaces); each test pins under a bpffs folder of its own, removed on
//! every way out, and works in a namespace of its own.

use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use balancer::config::GatewayConfig;
use balancer_core::clock::MonotonicClock;
use balancer_core::registry::{Registry, RegistryConfig};
use balancer_dataplane::XdpMode;
use balancer_dataplane::pin::{self, PinDir};
use balancer_dataplane::status;
use balancer_dataplane::steering::{ForwardMode, L4Config, Steering};
use balancer_tests::netns::Namespaces;
use balancer_tests::ns_runtime::NsRuntime;
use balancer_tests::{balancer_binary, ebpf_prerequisites, root_prerequisite};

/// A bpffs folder of the test's own, removed (with everything pinned in
/// it) when dropped.
struct Pins(PathBuf);

impl Pins {
    fn new(test: &str) -> Result<Self> {
        let dir = PathBuf::from(format!(
            "/sys/fs/bpf/balancer-test-{}-{test}",
            std::process::id()
        ));
        pin::ensure_bpffs(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = status::detach_all(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `balancer l4 status` of `dir`.
fn l4_status(binary: &Path, dir: &Path) -> Result<String> {
    let out = Command::new(binary)
        .args(["l4", "status", "--bpffs-dir"])
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .context("running balancer l4 status")?;
    ensure!(out.status.success(), "l4 status: {}", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_start_on_a_missing_interface_pins_nothing_and_status_says_nothing_is_attached() -> Result<()> {
    if !root_prerequisite("needs root to pin under bpffs") {
        return Ok(());
    }
    let binary = balancer_binary("--bpffs-dir")?;
    let pins = Pins::new("noiface")?;
    let out = Command::new(&binary)
        .args(["launch", "--port", "0", "--prometheus-port", "0"])
        .args(["--admin-port", "0", "--worker-urls", "http://127.0.0.1:9"])
        .args([
            "--xdp-iface",
            "balancer-none0",
            "--l4-service",
            "10.0.0.1:80",
        ])
        .arg("--bpffs-dir")
        .arg(&pins.0)
        .stdin(Stdio::null())
        .output()
        .context("running balancer launch")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "started: {stderr}");
    ensure!(
        stderr.contains("no network interface \"balancer-none0\""),
        "{stderr}"
    );
    ensure!(
        pin::state_dirs(&pins.0).is_empty(),
        "the failed start pinned {:?}",
        pin::state_dirs(&pins.0)
    );
    let report = l4_status(&binary, &pins.0)?;
    ensure!(report.starts_with("nothing attached"), "{report}");

    // What a start that failed before this check left: maps, no link.
    let leftover = PinDir::new(&pins.0, "local", &["eth9".into()]);
    std::fs::create_dir_all(leftover.root().join("maps-x"))?;
    let report = l4_status(&binary, &pins.0)?;
    ensure!(
        report.starts_with("nothing attached: no XDP or TC link"),
        "{report}"
    );
    ensure!(report.contains("local-eth9"), "{report}");
    Ok(())
}

#[test]
fn a_start_that_fails_after_pinning_removes_what_it_pinned() -> Result<()> {
    let Some(_object) = ebpf_prerequisites() else {
        return Ok(());
    };
    let pins = Pins::new("attach")?;
    let namespaces = Namespaces::create("bl4start", 1)?;
    let runtime = NsRuntime::new(namespaces.name(0))?;
    let config = L4Config {
        ifaces: vec!["lo".into()],
        // Loopback has no driver XDP: the attach fails once the maps are
        // pinned.
        xdp_mode: XdpMode::Driver,
        mode: ForwardMode::Local,
        services: vec![SocketAddrV4::new([10, 0, 0, 1].into(), 80).into()],
        table_size: 251,
        conntrack_size: 1024,
        bpffs_dir: Some(pins.0.clone()),
        detach_on_exit: false,
        signal_interval: Duration::from_secs(1),
    };
    let started = runtime.run(async move {
        let defaults = GatewayConfig::default();
        let registry = Registry::new(
            RegistryConfig {
                breaker: defaults.breaker,
                health: defaults.health,
                hash_rings: false,
                max_open_percent: defaults.max_open_percent,
                removed_grace: defaults.removed_worker_grace,
            },
            Arc::new(MonotonicClock::new()),
        );
        Steering::start(&config, registry).map(drop)
    })?;
    let error = started.expect_err("driver XDP attached to loopback");
    ensure!(
        error.to_string().contains("attach"),
        "not the attach that failed: {error}"
    );
    ensure!(
        pin::state_dirs(&pins.0).is_empty(),
        "left pinned: {:?}",
        pin::state_dirs(&pins.0)
    );
    drop(runtime);
    namespaces.delete()?;
    Ok(())
}

//! Local mode end to end: the gateway (`balancer launch --xdp-iface ...
//! --l4-mode local`) and three demo workers in one namespace, clients in
//! another, connecting to a service address that exists nowhere but in the
//! XDP program. Worker B is isolated through real L7 failures and through
//! failing health checks; see `balancer_tests::l4e2e`. Once with an IPv4
//! service and workers, once with IPv6 ones.
//!
//! Addresses are inside the two namespaces the test creates; nothing is sent
//! anywhere else.

use std::sync::{Mutex, PoisonError};

use anyhow::{Result, ensure};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4e2e::{self, Scenario};
use balancer_tests::netns::run;
use balancer_tests::topology::{FRONT_IF, Family, Layout, Mode, Topology};

#[test]
fn local_mode_steers_around_isolated_ipv4_workers() {
    steers_around_isolated_workers(Family::V4);
}

#[test]
fn local_mode_steers_around_isolated_ipv6_workers() {
    steers_around_isolated_workers(Family::V6);
}

/// In a topology of addresses `10.77.0.0/16` or `fd00:0:77::/48`.
fn steers_around_isolated_workers(family: Family) {
    // The gateway finds the object the same way the check does.
    if ebpf_prerequisites().is_none() {
        return;
    }
    // One family at a time: `attachments` counts TC links system-wide.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    Topology::run("bt-l4loc", Layout::new(Mode::Local, family, 77), exercise)
        .unwrap_or_else(|error| panic!("{error:#}"));
}

fn exercise(topology: &Topology) -> Result<()> {
    let host = topology.balancer();
    let (_, tcx_before) = attachments(host)?;
    let outcome = l4e2e::run_gateway(
        topology,
        |_, _| {},
        |gateway| {
            let (xdp, tcx) = attachments(host)?;
            ensure!(xdp, "no XDP program on {FRONT_IF} after start");
            ensure!(tcx > tcx_before, "no TC egress link after start");
            Scenario::new(topology, gateway.driver, gateway.workers, gateway.clock).run()
        },
    );
    let (xdp, tcx) = attachments(host)?;
    ensure!(!xdp, "XDP program still on {FRONT_IF} after shutdown");
    ensure!(
        tcx == tcx_before,
        "TC egress link still there after shutdown"
    );
    outcome
}

/// Whether `ip link` shows an XDP program on the interface, and how many
/// TCX links exist. TC egress programs attach through TCX links, which
/// neither `ip link` nor this bpftool's `net show` list; its `link show`
/// lists them (system-wide) as type 11.
fn attachments(ns: &str) -> Result<(bool, usize)> {
    let link = run("ip", &["-n", ns, "link", "show", "dev", FRONT_IF])?;
    let xdp = link
        .split_whitespace()
        .any(|word| word.starts_with("xdp") || word.starts_with("prog/xdp"));
    let links = run("bpftool", &["link", "show"])?;
    let tcx = links.lines().filter(|l| l.contains("type 11 ")).count();
    Ok((xdp, tcx))
}

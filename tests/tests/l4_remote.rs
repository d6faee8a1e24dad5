//! Remote mode end to end: the gateway (`balancer launch --xdp-iface ...
//! --l4-mode remote`) in a balancer namespace that routes between a client
//! namespace and three worker namespaces, one demo worker each. XDP on the
//! balancer's interfaces forwards connections to the workers and their
//! replies back to the client, redirecting between veths; worker B is
//! isolated through real L7 failures and through failing health checks (see
//! `balancer_tests::l4e2e`). Once with an IPv4 service and workers, once
//! with IPv6 ones.
//!
//! Addresses are inside the five namespaces the test creates; nothing is
//! sent anywhere else.

use anyhow::{Context, Result, ensure};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4e2e::{self, Scenario};
use balancer_tests::netns::run;
use balancer_tests::topology::{Family, Layout, Mode, Topology};

#[test]
fn remote_mode_steers_around_isolated_ipv4_workers() {
    steers_around_isolated_workers(Family::V4);
}

#[test]
fn remote_mode_steers_around_isolated_ipv6_workers() {
    steers_around_isolated_workers(Family::V6);
}

/// In a topology of addresses `10.78.0.0/16` or `fd00:0:78::/48`.
fn steers_around_isolated_workers(family: Family) {
    // The gateway finds the object the same way the check does.
    if ebpf_prerequisites().is_none() {
        return;
    }
    Topology::run("bt-l4rem", Layout::new(Mode::Remote, family, 78), exercise)
        .unwrap_or_else(|error| panic!("{error:#}"));
}

fn exercise(topology: &Topology) -> Result<()> {
    let ifaces = topology.layout.mode.ifaces();
    let outcome = l4e2e::run_gateway(
        topology,
        |_, _| {},
        |gateway| {
            let steering = gateway.driver.gw.steering().context("no dataplane")?;
            let attached = steering.interfaces();
            ensure!(attached.len() == ifaces.len(), "attached to {attached:?}");
            let scenario = Scenario::new(topology, gateway.driver, gateway.workers, gateway.clock);
            scenario.run().and_then(|()| redirected(&scenario))
        },
    );
    for iface in &ifaces {
        let link = run(
            "ip",
            &["-n", topology.balancer(), "link", "show", "dev", iface],
        )?;
        ensure!(
            !link.contains("prog/xdp"),
            "XDP program still on {iface} after shutdown"
        );
    }
    outcome
}

/// Steered packets went out by XDP redirect: the ones left to the kernel
/// (no cached or resolvable next hop yet) are a handful of first packets.
fn redirected(scenario: &Scenario) -> Result<()> {
    let metrics = scenario.driver.metrics()?;
    let outcome = |name: &str| metrics.outcome(name);
    let steered = outcome("new_flow")? + outcome("established")? + outcome("reply")?;
    let unresolved = outcome("unresolved")?;
    eprintln!("steered {steered} packets, {unresolved} of them left to the kernel to forward");
    ensure!(outcome("reply")? > 0.0, "no reply restored by XDP");
    ensure!(
        unresolved < steered / 100.0,
        "{unresolved} of {steered} steered packets were not redirected"
    );
    Ok(())
}

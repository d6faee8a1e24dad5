//! Local mode end to end: the gateway (`balancer launch --xdp-iface ...
//! --l4-mode local`) and three demo workers in one namespace, clients in
//! another, connecting to a service address that exists nowhere but in the
//! XDP program. Worker B is isolated through real L7 failures and through
//! failing health checks; see `balancer_tests::l4e2e`.
//!
//! Addresses are inside the two namespaces the test creates; nothing is sent
//! anywhere else.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use balancer::gateway::Gateway;
use balancer_core::clock::ManualClock;
use balancer_dataplane::steering::ForwardMode;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4e2e::{self, Scenario};
use balancer_tests::netns::{Namespaces, run};
use balancer_tests::ns_runtime::NsRuntime;

const IFACE: &str = "lb0";
const CLIENT_IF: &str = "cl0";
const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 77, 100, 1), 80);

#[test]
fn local_mode_steers_around_isolated_workers() {
    // The gateway finds the object the same way the check does.
    if ebpf_prerequisites().is_none() {
        return;
    }
    let namespaces = Namespaces::create("bt-l4loc", 2).expect("creating namespaces");
    let outcome = exercise(namespaces.name(0), namespaces.name(1));
    let deleted = namespaces.delete();
    outcome.unwrap_or_else(|error| panic!("{error:#}"));
    deleted.expect("deleting the namespaces");
}

fn topology(client: &str, host: &str) -> Result<()> {
    run(
        "ip",
        &[
            "link", "add", IFACE, "netns", host, "type", "veth", "peer", "name", CLIENT_IF,
            "netns", client,
        ],
    )?;
    for (ns, iface, ip) in [(host, IFACE, HOST_IP), (client, CLIENT_IF, CLIENT_IP)] {
        run(
            "ip",
            &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", iface],
        )?;
        run("ip", &["-n", ns, "link", "set", iface, "up"])?;
        // Full checksums in every frame: offloaded (partial) ones would let
        // wrong checksum arithmetic go unnoticed.
        run(
            "ip",
            &["netns", "exec", ns, "ethtool", "-K", iface, "tx", "off"],
        )?;
    }
    // The service address is routed to the balancer's host, which owns it
    // only in the XDP program.
    run(
        "ip",
        &[
            "-n",
            client,
            "route",
            "add",
            &format!("{}/32", VIP.ip()),
            "via",
            &HOST_IP.to_string(),
        ],
    )?;
    Ok(())
}

fn exercise(client: &str, host: &str) -> Result<()> {
    topology(client, host)?;
    let runtime = NsRuntime::new(host)?;
    let workers = ["a", "b", "c"]
        .into_iter()
        .map(|name| runtime.worker(SocketAddr::from((HOST_IP, 0)), name))
        .collect::<Result<Vec<_>>>()?;

    let urls: Vec<String> = workers.iter().map(|w| w.url()).collect();
    let mut config = l4e2e::gateway_config(&urls);
    config.l4 = Some(l4e2e::l4_config(
        vec![IFACE.to_owned()],
        ForwardMode::Local,
        vec![VIP],
    ));
    let clock = Arc::new(ManualClock::new());
    let (_, tcx_before) = attachments(host)?;
    let gw = runtime
        .run(Gateway::start_with_clock(config, clock.clone()))?
        .context("starting the gateway")?;
    let (xdp, tcx) = attachments(host)?;
    ensure!(xdp, "no XDP program on {IFACE} after start");
    ensure!(tcx > tcx_before, "no TC egress link after start");

    let scenario = Scenario {
        client_ns: client,
        vip: VIP.into(),
        balancer: &runtime,
        gw: &gw,
        workers: &workers,
        clock: &clock,
    };
    let outcome = scenario.run();

    runtime.run(gw.shutdown())?;
    let (xdp, tcx) = attachments(host)?;
    ensure!(!xdp, "XDP program still on {IFACE} after shutdown");
    ensure!(
        tcx == tcx_before,
        "TC egress link still there after shutdown"
    );
    for worker in workers {
        runtime.run(worker.shutdown())?;
    }
    drop(runtime);
    outcome
}

/// Whether `ip link` shows an XDP program on the interface, and how many
/// TCX links exist. TC egress programs attach through TCX links, which
/// neither `ip link` nor this bpftool's `net show` list; its `link show`
/// lists them (system-wide) as type 11.
fn attachments(ns: &str) -> Result<(bool, usize)> {
    let link = run("ip", &["-n", ns, "link", "show", "dev", IFACE])?;
    let xdp = link
        .split_whitespace()
        .any(|word| word.starts_with("xdp") || word.starts_with("prog/xdp"));
    let links = run("bpftool", &["link", "show"])?;
    let tcx = links.lines().filter(|l| l.contains("type 11 ")).count();
    Ok((xdp, tcx))
}

//! Remote mode end to end: the gateway (`balancer launch --xdp-iface ...
//! --l4-mode remote`) in a balancer namespace that routes between a client
//! namespace and three worker namespaces, one demo worker each. XDP on the
//! balancer's interfaces forwards connections to the workers and their
//! replies back to the client, redirecting between veths; worker B is
//! isolated through real L7 failures and through failing health checks (see
//! `balancer_tests::l4e2e`).
//!
//! Addresses are inside the five namespaces the test creates; nothing is
//! sent anywhere else.

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

const CLIENT_IF: &str = "cl0";
const FRONT_IF: &str = "lbc";
const WORKER_IF: &str = "wk0";
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 2);
const FRONT_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 1);
const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 78, 100, 1), 80);
const WORKERS: usize = 3;

/// The balancer's interface toward worker `i` (counting from 1).
fn back_if(i: usize) -> String {
    format!("lbw{i}")
}

#[test]
fn remote_mode_steers_around_isolated_workers() {
    // The gateway finds the object the same way the check does.
    if ebpf_prerequisites().is_none() {
        return;
    }
    // 0: client, 1: balancer, 2..: workers.
    let namespaces = Namespaces::create("bt-l4rem", 2 + WORKERS).expect("creating namespaces");
    let names: Vec<String> = (0..2 + WORKERS)
        .map(|i| namespaces.name(i).to_owned())
        .collect();
    let outcome = exercise(&names);
    let deleted = namespaces.delete();
    outcome.unwrap_or_else(|error| panic!("{error:#}"));
    deleted.expect("deleting the namespaces");
}

fn ns_exec(ns: &str, args: &[&str]) -> Result<String> {
    let mut all = vec!["netns", "exec", ns];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// A veth between two namespaces, addressed and up, with full checksums
/// on transmit (offloaded ones would hide wrong checksum arithmetic) and
/// GRO on receive: a frame XDP redirects into a veth is only delivered when
/// the far end runs NAPI.
fn link(a: (&str, &str, Ipv4Addr), b: (&str, &str, Ipv4Addr)) -> Result<()> {
    run(
        "ip",
        &[
            "link", "add", a.1, "netns", a.0, "type", "veth", "peer", "name", b.1, "netns", b.0,
        ],
    )?;
    for (ns, iface, ip) in [a, b] {
        run(
            "ip",
            &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", iface],
        )?;
        run("ip", &["-n", ns, "link", "set", iface, "up"])?;
        ns_exec(ns, &["ethtool", "-K", iface, "tx", "off", "gro", "on"])?;
    }
    Ok(())
}

fn worker_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 78, i as u8, 2)
}

fn topology(names: &[String]) -> Result<()> {
    let (client, balancer) = (names[0].as_str(), names[1].as_str());
    // The balancer routes, and sees replies from the VIP, which it does not
    // own, arriving from the workers' side.
    for setting in [
        "net.ipv4.ip_forward=1",
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ] {
        ns_exec(balancer, &["sysctl", "-qw", setting])?;
    }
    link(
        (client, CLIENT_IF, CLIENT_IP),
        (balancer, FRONT_IF, FRONT_IP),
    )?;
    run(
        "ip",
        &[
            "-n",
            client,
            "route",
            "add",
            &format!("{}/32", VIP.ip()),
            "via",
            &FRONT_IP.to_string(),
        ],
    )?;
    for i in 1..=WORKERS {
        let worker = names[1 + i].as_str();
        let gateway = Ipv4Addr::new(10, 78, i as u8, 1);
        link(
            (balancer, &back_if(i), gateway),
            (worker, WORKER_IF, worker_ip(i)),
        )?;
        // Replies go back through the balancer, which restores the VIP.
        run(
            "ip",
            &[
                "-n",
                worker,
                "route",
                "add",
                "default",
                "via",
                &gateway.to_string(),
            ],
        )?;
    }
    Ok(())
}

fn exercise(names: &[String]) -> Result<()> {
    topology(names)?;
    let (client, balancer) = (names[0].as_str(), names[1].as_str());
    let worker_runtimes = (1..=WORKERS)
        .map(|i| NsRuntime::new(&names[1 + i]))
        .collect::<Result<Vec<_>>>()?;
    let workers = worker_runtimes
        .iter()
        .zip(["a", "b", "c"])
        .enumerate()
        .map(|(i, (runtime, name))| runtime.worker(SocketAddr::from((worker_ip(i + 1), 0)), name))
        .collect::<Result<Vec<_>>>()?;

    let runtime = NsRuntime::new(balancer)?;
    let urls: Vec<String> = workers.iter().map(|w| w.url()).collect();
    let mut config = l4e2e::gateway_config(&urls);
    let ifaces = std::iter::once(FRONT_IF.to_owned())
        .chain((1..=WORKERS).map(back_if))
        .collect();
    config.l4 = Some(l4e2e::l4_config(ifaces, ForwardMode::Remote, vec![VIP]));
    let clock = Arc::new(ManualClock::new());
    let gw = runtime
        .run(Gateway::start_with_clock(config, clock.clone()))?
        .context("starting the gateway")?;
    let ifaces = gw.steering().context("no dataplane")?.interfaces();
    ensure!(ifaces.len() == 1 + WORKERS, "attached to {ifaces:?}");

    let scenario = Scenario {
        client_ns: client,
        vip: VIP.into(),
        balancer: &runtime,
        gw: &gw,
        workers: &workers,
        clock: &clock,
    };
    let outcome = scenario.run().and_then(|()| redirected(&scenario));

    runtime.run(gw.shutdown())?;
    for iface in std::iter::once(FRONT_IF.to_owned()).chain((1..=WORKERS).map(back_if)) {
        let link = run("ip", &["-n", balancer, "link", "show", "dev", &iface])?;
        ensure!(
            !link.contains("prog/xdp"),
            "XDP program still on {iface} after shutdown"
        );
    }
    for (worker, runtime) in workers.into_iter().zip(&worker_runtimes) {
        runtime.run(worker.shutdown())?;
    }
    outcome
}

/// Steered packets went out by XDP redirect: the ones left to the kernel
/// (no cached or resolvable next hop yet) are a handful of first packets.
fn redirected(scenario: &Scenario) -> Result<()> {
    let outcome = |name: &str| {
        scenario.metric(&format!(
            "balancer_l4_outcome_packets_total{{outcome=\"{name}\"}}"
        ))
    };
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

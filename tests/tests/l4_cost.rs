//! Per-packet cost of L4 steering, measured by the kernel through
//! BPF_PROG_TEST_RUN (`cargo xtask bench l4` runs this; it is ignored in
//! normal test runs because it takes a while and wants a quiet machine).
//!
//! Each case runs one frame `REPEAT` times, `ROUNDS` times over, and reports
//! the median of the rounds' averages. The test run feeds the program its own
//! output, so every case is a fixed point: the service is the backend's own
//! address with that backend as its only member, and the TTL is kept, so the
//! rewritten frame is the frame again. The per-path counters prove that the
//! runs took the path the case is named after.
//!
//! A fixed point hides one cost: "new flow" repeats a SYN of one connection,
//! whose table entries exist after the first run and are rewritten in place
//! (which is what a retransmitted SYN costs). A connection's real first SYN
//! inserts two fresh entries instead. "Fresh entries evicting others" runs
//! the SYN against a connection table of one entry, where each of the two
//! inserts misses and evicts the other: an upper bound, since a large full
//! table evicts in batches of 128 and most of its inserts take a free node.
//!
//! Remote mode runs inside a namespace with real routes and neighbours
//! (`Router`), arriving on its client-facing interface, so the next-hop
//! lookups are the real ones. With env `BALANCER_L4_COST_OUT` set, the
//! medians are also written there as `name<TAB>nanoseconds` lines.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use balancer_common::l4::Outcome;
use balancer_dataplane::XdpAction;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4::{Router, Steered};
use balancer_tests::netns;
use balancer_tests::packet;

const REPEAT: u32 = 1_000_000;
const ROUNDS: usize = 5;
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 1, 2), 40_000);
const BACKEND: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 11), 8000);

struct Case {
    name: &'static str,
    frame: Vec<u8>,
    /// The outcome every run but the first must count (`None`: a packet
    /// that is not TCP counts none).
    outcome: Option<Outcome>,
    action: XdpAction,
}

fn cases(remote: bool) -> Vec<Case> {
    let forwarded = if remote {
        XdpAction::Redirect
    } else {
        XdpAction::Pass
    };
    let elsewhere = SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 50), 9999);
    let service_port_elsewhere = SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 50), BACKEND.port());
    vec![
        Case {
            name: "known flow",
            frame: packet::tcp_frame(CLIENT, BACKEND, packet::TCP_ACK),
            outcome: Some(Outcome::Established),
            action: forwarded,
        },
        Case {
            name: "new flow",
            frame: packet::tcp_frame(CLIENT, BACKEND, packet::TCP_SYN),
            outcome: Some(Outcome::NewFlow),
            action: forwarded,
        },
        Case {
            name: "pass-through (TCP, other port)",
            frame: packet::tcp_frame(CLIENT, elsewhere, packet::TCP_ACK),
            outcome: Some(Outcome::NotService),
            action: XdpAction::Pass,
        },
        Case {
            name: "pass-through (TCP, service port, other host)",
            frame: packet::tcp_frame(CLIENT, service_port_elsewhere, packet::TCP_ACK),
            outcome: Some(Outcome::NotService),
            action: XdpAction::Pass,
        },
        Case {
            name: "pass-through (UDP)",
            frame: packet::udp_frame(CLIENT, elsewhere, b"0123456789"),
            outcome: None,
            action: XdpAction::Pass,
        },
    ]
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Median nanoseconds per run of each case.
fn measure(steered: &Steered, cases: &[Case], ifindex: Option<u32>) -> Result<Vec<f64>> {
    let mut medians = Vec::new();
    for case in cases {
        let mut rounds = Vec::new();
        for _ in 0..ROUNDS {
            let before = steered.maps.outcomes()?;
            let run = steered.dataplane.test_run(&case.frame, REPEAT, ifindex)?;
            let moved = steered.maps.outcomes()?.since(&before);
            ensure!(
                run.action == case.action,
                "{}: {:?}, expected {:?}",
                case.name,
                run.action,
                case.action
            );
            ensure!(
                moved.get(Outcome::ConntrackFull) == 0,
                "{}: the connection table refused entries: {moved:?}",
                case.name
            );
            if let Some(outcome) = case.outcome {
                // The first run of "known flow" creates the entry.
                ensure!(
                    moved.get(outcome) >= u64::from(REPEAT - 1),
                    "{}: took other paths: {moved:?}",
                    case.name
                );
            }
            rounds.push(run.duration.as_secs_f64() * 1e9);
        }
        medians.push(median(rounds));
    }
    Ok(medians)
}

fn report(rows: &[(String, f64)]) -> Result<()> {
    let mut table =
        format!("\nper-packet cost, BPF_PROG_TEST_RUN, median of {ROUNDS} x {REPEAT} runs:\n");
    for (name, ns) in rows {
        writeln!(table, "  {name:<58} {ns:>6.1} ns")?;
    }
    eprintln!("{table}");
    if let Some(path) = std::env::var_os("BALANCER_L4_COST_OUT") {
        let lines: String = rows
            .iter()
            .map(|(name, ns)| format!("{name}\t{ns:.1}\n"))
            .collect();
        std::fs::write(&path, lines).context("writing BALANCER_L4_COST_OUT")?;
    }
    Ok(())
}

#[test]
#[ignore = "a benchmark: run by `cargo xtask bench l4`"]
fn per_packet_cost() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let (ns, router) = Router::create("bt-l4cost", *CLIENT.ip(), &[*BACKEND.ip()])
        .expect("creating the namespace");
    let measured = netns::run_in(
        ns.name(0),
        Duration::from_secs(600),
        move || -> Result<_> {
            let mut rows = Vec::new();
            let from_client = Some(router.client_if);

            let remote = Steered::load(&object, BACKEND, &[BACKEND], true)?;
            remote.maps.set_keep_ttl(true)?;
            let remote_cases = cases(true);
            for (case, ns) in remote_cases
                .iter()
                .zip(measure(&remote, &remote_cases, from_client)?)
            {
                rows.push((format!("remote, {}", case.name), ns));
            }
            // What caching the next hop saves: the same with a route and
            // neighbour lookup on every packet.
            remote.maps.set_generation(0)?;
            let uncached = measure(&remote, &remote_cases[..2], from_client)?;
            for (case, ns) in remote_cases.iter().zip(uncached) {
                rows.push((
                    format!("remote, {}, next hop looked up per packet", case.name),
                    ns,
                ));
            }
            drop(remote);

            // Fresh inserts: a table of one entry, so that each of the two
            // inserts of a new flow misses and evicts the other.
            let tiny = Steered::load_sized(&object, BACKEND, &[BACKEND], true, 1)?;
            tiny.maps.set_keep_ttl(true)?;
            let fresh = measure(&tiny, &remote_cases[1..2], from_client)?;
            rows.push((
                "remote, new flow, fresh entries evicting others".to_owned(),
                fresh[0],
            ));
            drop(tiny);

            let local = Steered::load(&object, BACKEND, &[BACKEND], false)?;
            let local_cases = cases(false);
            for (case, ns) in
                local_cases
                    .iter()
                    .zip(measure(&local, &local_cases[..2], from_client)?)
            {
                rows.push((format!("local, {}", case.name), ns));
            }
            Ok(rows)
        },
    );
    let deleted = ns.delete();
    let rows = measured
        .and_then(|inner| inner)
        .unwrap_or_else(|error| panic!("{error:#}"));
    deleted.expect("deleting the namespace");
    report(&rows).expect("reporting");
}

//! Per-packet cost of L4 steering, measured by the kernel through
//! BPF_PROG_TEST_RUN (`cargo xtask bench l4` runs this; it is ignored in
//! normal test runs because it takes a while and wants a quiet machine).
//!
//! Each case runs one frame `REPEAT` times, `ROUNDS` times over (a round
//! runs every case once), and reports the median of the rounds' averages.
//! The test run feeds the program its own output, so every case is a
//! fixed point: the service is the backend's own address with that backend
//! as its only member, and the TTL is kept, so the rewritten frame is the
//! frame again. The per-path counters prove that the runs took the path
//! the case is named after.
//!
//! "Known flow" is an established connection (its handshake is run first,
//! so the entries are in the established table). A fixed point hides one
//! cost: "retransmitted SYN" repeats a SYN of one connection, whose entries
//! exist after the first run and stand. A connection's real first SYN
//! writes a fresh entry instead (a way of the handshake table, `SYNS`):
//! "new flow" runs rounds of SYNs of distinct four-tuples, once each,
//! averages the kernel's per-run times in each round (the true first-SYN
//! cost) and reports the median of the rounds. A run of one starts the SYN path's code and the maps' own data
//! cold, which a SYN flood would keep warm: "new flow, SYN path warm" takes
//! off the single-run overhead of that path measured on a retransmitted
//! SYN, where "new flow" takes off only the harness's, measured on a
//! pass-through frame. The harness floor (an ARP frame,
//! which the program passes after its first check) is measured in the same
//! run, so each figure can be read against it.
//!
//! Remote mode runs inside a namespace with real routes and neighbours
//! (`Router`, one per address family), arriving on its client-facing interface, so the next-hop
//! lookups are the real ones. With env `BALANCER_L4_COST_OUT` set, the
//! medians are also written there as `name<TAB>nanoseconds` lines.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use balancer_common::l4::Outcome;
use balancer_dataplane::XdpAction;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4::{Router, Steered};
use balancer_tests::packet::{self, Tcp};

const REPEAT: u32 = 1_000_000;
const ROUNDS: usize = 7;
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 1, 2), 40_000);
const BACKEND: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 11), 8000);

/// What the cases need of an address family: its endpoints and frames.
trait Family: Copy + PartialEq + Into<SocketAddr> + 'static {
    /// Before the case's name in a row ("local{ROW}, known flow").
    const ROW: &'static str;
    const CLIENT: Self;
    const BACKEND: Self;
    /// A host beside the backend, on `port`.
    fn elsewhere(port: u16) -> Self;
    /// The `i`th client of the new-flow case, each four-tuple distinct.
    fn fresh_client(i: u32) -> Self;
    fn tcp(src: Self, dst: Self, flags: u8, seq: u32, ack: u32) -> Vec<u8>;
    fn udp(src: Self, dst: Self, payload: &[u8]) -> Vec<u8>;
}

impl Family for SocketAddrV4 {
    const ROW: &'static str = "";
    const CLIENT: Self = CLIENT;
    const BACKEND: Self = BACKEND;
    fn elsewhere(port: u16) -> Self {
        SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 50), port)
    }
    fn fresh_client(i: u32) -> Self {
        SocketAddrV4::new(
            Ipv4Addr::new(10, 98, (i >> 8) as u8, i as u8),
            1024 + (i % 60_000) as u16,
        )
    }
    fn tcp(src: Self, dst: Self, flags: u8, seq: u32, ack: u32) -> Vec<u8> {
        Tcp::new(src, dst, flags, seq, ack).frame()
    }
    fn udp(src: Self, dst: Self, payload: &[u8]) -> Vec<u8> {
        packet::udp_frame(src, dst, payload)
    }
}

/// A host of the router's backend prefix (2001:db8:99:2::/64).
const fn v6(last: u16, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(
        Ipv6Addr::new(0x2001, 0xdb8, 0x99, 2, 0, 0, 0, last),
        port,
        0,
        0,
    )
}

impl Family for SocketAddrV6 {
    const ROW: &'static str = " v6";
    const CLIENT: Self = SocketAddrV6::new(
        Ipv6Addr::new(0x2001, 0xdb8, 0x99, 1, 0, 0, 0, 2),
        40_000,
        0,
        0,
    );
    const BACKEND: Self = v6(0x11, 8000);
    fn elsewhere(port: u16) -> Self {
        v6(0x50, port)
    }
    fn fresh_client(i: u32) -> Self {
        SocketAddrV6::new(
            Ipv6Addr::new(0xfd98, 0, 0, 0, 0, 0, (i >> 16) as u16, i as u16),
            1024 + (i % 60_000) as u16,
            0,
            0,
        )
    }
    fn tcp(src: Self, dst: Self, flags: u8, seq: u32, ack: u32) -> Vec<u8> {
        packet::tcp6_frame(src, dst, flags, seq, ack, &[])
    }
    fn udp(src: Self, dst: Self, payload: &[u8]) -> Vec<u8> {
        packet::udp6_frame(src, dst, payload)
    }
}

struct Case {
    name: &'static str,
    frame: Vec<u8>,
    /// The outcome every run but the first must count (`None`: a packet
    /// that is not TCP counts none).
    outcome: Option<Outcome>,
    action: XdpAction,
}

/// The floor every figure stands on: the test harness around one run, and
/// the program's first exit (an ARP frame is counted and passed after the
/// Ethernet header). Reported beside the others so that each run's figures
/// can be read against its own floor.
const HARNESS_FLOOR: &str = "harness floor (ARP frame: the program's first exit)";
const ETHER_TYPE_ARP: u16 = 0x0806;

fn cases<F: Family>(remote: bool) -> Vec<Case> {
    let forwarded = if remote {
        XdpAction::Redirect
    } else {
        XdpAction::Pass
    };
    let elsewhere = F::elsewhere(9999);
    let service_port_elsewhere = F::elsewhere(F::BACKEND.into().port());
    let ack = |to| F::tcp(F::CLIENT, to, packet::TCP_ACK, 0, 0);
    vec![
        Case {
            name: "known flow",
            frame: handshake::<F>()[2].clone(),
            outcome: Some(Outcome::Established),
            action: forwarded,
        },
        Case {
            name: "retransmitted SYN",
            frame: handshake::<F>()[0].clone(),
            outcome: Some(Outcome::NewFlow),
            action: forwarded,
        },
        Case {
            name: "pass-through (TCP, other port)",
            frame: ack(elsewhere),
            outcome: Some(Outcome::NotService),
            action: XdpAction::Pass,
        },
        Case {
            name: "pass-through (TCP, service port, other host)",
            frame: ack(service_port_elsewhere),
            outcome: Some(Outcome::NotService),
            action: XdpAction::Pass,
        },
        Case {
            name: "pass-through (UDP)",
            frame: F::udp(F::CLIENT, elsewhere, b"0123456789"),
            outcome: None,
            action: XdpAction::Pass,
        },
        Case {
            name: HARNESS_FLOOR,
            frame: packet::ethernet(ETHER_TYPE_ARP, &[0; 28]),
            outcome: None,
            action: XdpAction::Pass,
        },
    ]
}

/// SYN, SYN-ACK, ACK of one connection (the service is the backend's own
/// address, so every frame is a fixed point of the rewrite).
fn handshake<F: Family>() -> [Vec<u8>; 3] {
    let (client, backend) = (F::CLIENT, F::BACKEND);
    [
        F::tcp(client, backend, packet::TCP_SYN, 1, 0),
        F::tcp(backend, client, packet::TCP_SYN | packet::TCP_ACK, 100, 2),
        F::tcp(client, backend, packet::TCP_ACK, 2, 101),
    ]
}

/// Runs the handshake so that the connection is established.
fn establish<F: Family>(
    steered: &Steered<F>,
    from_client: Option<u32>,
    from_backend: Option<u32>,
    remote: bool,
) -> Result<()> {
    let [syn, syn_ack, ack] = handshake::<F>();
    steered.dataplane.test_run(&syn, 1, from_client)?;
    if remote {
        steered.dataplane.test_run(&syn_ack, 1, from_backend)?;
    } else {
        steered.dataplane.test_run_egress(&syn_ack)?;
    }
    steered.dataplane.test_run(&ack, 1, from_client)?;
    let promoted = steered.maps.outcomes()?.get(Outcome::Promoted);
    ensure!(
        promoted == 1,
        "the handshake did not establish the connection"
    );
    Ok(())
}

/// Fresh SYNs per round of [`first_syn`], which runs `ROUNDS` rounds.
const FRESH: u32 = 15_000;

/// What a SYN's first run costs, two ways (nanoseconds; medians of the
/// rounds).
struct FirstSyn {
    /// `FRESH` SYNs of distinct four-tuples, once each, less the harness
    /// overhead of a single run measured on a pass-through frame.
    cold: f64,
    /// The same single runs less the SYN path's own single-run overhead:
    /// a retransmitted SYN takes that path (the same lookups and code,
    /// without the write), so its single-run average against its
    /// million-run average is what one run alone adds to that path (the
    /// harness, and the caches the code and the maps' own data start cold
    /// in, which a SYN flood keeps warm). What is left is the write and
    /// the memory the new entry touches.
    warm: f64,
}

/// Average kernel time of one run of `frame`, `FRESH` runs of one each,
/// and its million-run average.
fn single_and_spread<F: Family>(
    steered: &Steered<F>,
    frame: &[u8],
    ifindex: Option<u32>,
) -> Result<(f64, f64)> {
    let mut single = Duration::ZERO;
    for _ in 0..FRESH {
        single += steered.dataplane.test_run(frame, 1, ifindex)?.duration;
    }
    let spread = steered.dataplane.test_run(frame, REPEAT, ifindex)?.duration;
    Ok((
        single.as_secs_f64() * 1e9 / f64::from(FRESH),
        spread.as_secs_f64() * 1e9,
    ))
}

/// Average kernel time of a SYN's first run: in each of `ROUNDS` rounds,
/// `FRESH` SYNs of distinct four-tuples (new ones every round), once each,
/// into a table with room for all of them; the median of the rounds, as
/// for the other cases, so that a burst of the VM's other work moves one
/// round and not the figure.
///
/// A run of one repetition also times the kernel's test harness around it
/// (timer setup, and a clock whose resolution is not far from the cost
/// itself), which a million repetitions spread thin. That overhead is
/// measured in each round on a pass-through frame the same way, one run at
/// a time, against the same frame's million-run average, and taken off
/// ([`FirstSyn::cold`]); and on a retransmitted SYN, for
/// [`FirstSyn::warm`].
fn first_syn<F: Family>(steered: &Steered<F>, ifindex: Option<u32>) -> Result<FirstSyn> {
    let udp = F::udp(F::CLIENT, F::elsewhere(9999), b"0123456789");
    let rounds = ROUNDS as u32;
    // A four-tuple of its own, so that the case's established connection
    // is left as it is: after its first run, every run is a retransmission.
    let retransmitted = F::tcp(
        F::fresh_client(FRESH * rounds),
        F::BACKEND,
        packet::TCP_SYN,
        1,
        0,
    );
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let (single, spread) = single_and_spread(steered, &udp, ifindex)?;
        let overhead = (single - spread).max(0.0);
        let (syn_single, syn_spread) = single_and_spread(steered, &retransmitted, ifindex)?;
        let syn_overhead = (syn_single - syn_spread).max(0.0);

        let before = steered.maps.outcomes()?;
        let mut total = Duration::ZERO;
        for i in round * FRESH..(round + 1) * FRESH {
            let frame = F::tcp(F::fresh_client(i), F::BACKEND, packet::TCP_SYN, i, 0);
            total += steered.dataplane.test_run(&frame, 1, ifindex)?.duration;
        }
        let moved = steered.maps.outcomes()?.since(&before);
        ensure!(
            moved.get(Outcome::NewFlow) == u64::from(FRESH)
                && moved.get(Outcome::ConntrackFull) == 0,
            "fresh SYNs took other paths: {moved:?}"
        );
        let per_run = total.as_secs_f64() * 1e9 / f64::from(FRESH);
        eprintln!(
            "first SYN, round {round}: {per_run:.1} ns per single run, less {overhead:.1} ns \
             of harness ({single:.1} ns single vs {spread:.1} ns spread on a pass-through \
             frame), or less {syn_overhead:.1} ns ({syn_single:.1} vs {syn_spread:.1} ns on a \
             retransmitted SYN)"
        );
        cold.push(per_run - overhead);
        warm.push(per_run - syn_overhead);
    }
    Ok(FirstSyn {
        cold: median(cold),
        warm: median(warm),
    })
}

/// The rows of a [`first_syn`] measurement, named after `mode`.
fn first_syn_rows(mode: &str, syn: &FirstSyn, rows: &mut Vec<(String, f64)>) {
    rows.push((format!("{mode}, new flow"), syn.cold));
    rows.push((format!("{mode}, new flow, SYN path warm"), syn.warm));
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Median nanoseconds per run of each case. A round runs every case once,
/// so that a burst of the shared VM's other work lands on several cases'
/// rounds, one each, rather than on every round of one case.
fn measure<F: Family>(
    steered: &Steered<F>,
    cases: &[Case],
    ifindex: Option<u32>,
) -> Result<Vec<f64>> {
    let mut rounds = vec![Vec::new(); cases.len()];
    for _ in 0..ROUNDS {
        for (case, rounds) in cases.iter().zip(&mut rounds) {
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
                ensure!(
                    moved.get(outcome) >= u64::from(REPEAT - 1),
                    "{}: took other paths: {moved:?}",
                    case.name
                );
            }
            rounds.push(run.duration.as_secs_f64() * 1e9);
        }
    }
    Ok(rounds.into_iter().map(median).collect())
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

/// Local mode's rows of family `F`: its first `count` cases (the forwarded
/// ones, and with IPv6 the pass-through that walks the IPv6 program), and a
/// new flow.
fn local<F: Family>(
    object: &std::path::Path,
    from_client: Option<u32>,
    count: usize,
    rows: &mut Vec<(String, f64)>,
) -> Result<()> {
    let local = Steered::load_sized(object, F::BACKEND, &[F::BACKEND], false, 1 << 20)?;
    establish(&local, from_client, None, false)?;
    let cases = cases::<F>(false);
    for (case, ns) in cases
        .iter()
        .zip(measure(&local, &cases[..count], from_client)?)
    {
        rows.push((format!("local{}, {}", F::ROW, case.name), ns));
    }
    first_syn_rows(
        &format!("local{}", F::ROW),
        &first_syn(&local, from_client)?,
        rows,
    );
    Ok(())
}

/// Remote mode's rows of family `F`, in `router`'s namespace: every case
/// (the harness floor named after the family), a new flow into a large
/// table and into a full small one, and a known flow whose next hop is
/// looked up per packet.
fn remote<F: Family>(
    object: &std::path::Path,
    router: &Router,
    rows: &mut Vec<(String, f64)>,
) -> Result<()> {
    let (from_client, from_backend) = (Some(router.client_if), Some(router.backend_if));
    let mode = format!("remote{}", F::ROW);
    let remote = Steered::load_sized(object, F::BACKEND, &[F::BACKEND], true, 1 << 20)?;
    remote.maps.set_keep_ttl(true)?;
    establish(&remote, from_client, from_backend, true)?;
    let cases = cases::<F>(true);
    for (case, ns) in cases.iter().zip(measure(&remote, &cases, from_client)?) {
        let name = if case.name == HARNESS_FLOOR {
            format!("{HARNESS_FLOOR}{}", F::ROW)
        } else {
            format!("{mode}, {}", case.name)
        };
        rows.push((name, ns));
    }
    first_syn_rows(&mode, &first_syn(&remote, from_client)?, rows);
    // The same into the small tables of a 1,024-entry connection table,
    // whose handshake table (16,384 ways) the rounds fill: every SYN takes
    // the oldest way of its set, in memory that fits in cache.
    let small = Steered::load_sized(object, F::BACKEND, &[F::BACKEND], true, 1024)?;
    small.maps.set_keep_ttl(true)?;
    rows.push((
        format!("{mode}, new flow, full small table"),
        first_syn(&small, from_client)?.cold,
    ));
    drop(small);
    // What caching the next hop saves: the same with a route and neighbour
    // lookup on every packet.
    remote.maps.set_generation(0)?;
    let uncached = measure(&remote, &cases[..1], from_client)?;
    rows.push((
        format!("{mode}, known flow, next hop looked up per packet"),
        uncached[0],
    ));
    Ok(())
}

/// Runs `measure` in a router namespace of family `F`'s addresses.
fn in_router<F: Family>(
    prefix: &str,
    measure: impl FnOnce(Router) -> Result<Vec<(String, f64)>> + Send + 'static,
) -> Vec<(String, f64)> {
    let ip = |addr: F| Into::<SocketAddr>::into(addr).ip();
    Router::run(
        prefix,
        ip(F::CLIENT),
        &[ip(F::BACKEND)],
        Duration::from_secs(600),
        measure,
    )
}

#[test]
#[ignore = "a benchmark: run by `cargo xtask bench l4`"]
fn per_packet_cost() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let object6 = object.clone();
    let mut rows = in_router::<SocketAddrV4>("bt-l4cost", move |router| {
        let mut rows = Vec::new();
        let from_client = Some(router.client_if);
        remote::<SocketAddrV4>(&object, &router, &mut rows)?;
        local::<SocketAddrV4>(&object, from_client, 2, &mut rows)?;
        // IPv6 local mode: the same cases, through the tail-called IPv6
        // program, and the pass-through that walks it.
        local::<SocketAddrV6>(&object, from_client, 3, &mut rows)?;
        Ok(rows)
    });
    // IPv6 remote mode needs its own routes and neighbours.
    rows.extend(in_router::<SocketAddrV6>("bt-l4cost6", move |router| {
        let mut rows = Vec::new();
        remote::<SocketAddrV6>(&object6, &router, &mut rows)?;
        Ok(rows)
    }));
    report(&rows).expect("reporting");
}

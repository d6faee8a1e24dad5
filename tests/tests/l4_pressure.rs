//! The XDP datapath under hostile traffic, in both forwarding modes, end to
//! end: the gateway (with L4 steering and a small connection table) and three
//! demo workers, clients in a namespace of their own, forged packets sent
//! from there through a raw socket.
//!
//! - A SYN flood of several times the connection table's size, from spoofed
//!   addresses, leaves established keep-alive connections on the worker
//!   they were on, one of them on a worker isolated by its breaker, and
//!   their connection entries in place: the flood only churns the embryonic
//!   table.
//! - A churn of short connections through a tiny connection table
//!   (`--l4-conntrack-size 256`) resets none of them: each completes on the
//!   worker its SYN was steered to, and no handshake's entries are evicted
//!   by the other connections' before it completes.
//! - Resets forged far outside the sequence window of a live connection are
//!   counted as ignored (`rst_ignored`) and close nothing: the connection
//!   keeps working, also after the close grace period would have made its
//!   entries stale. A reset with the connection's exact next sequence number
//!   does close it, which shows the forged ones were well formed.
//!
//! Each runs in both modes, with an IPv4 service and workers and with IPv6
//! ones. Every address is inside the namespaces the test creates (two in
//! local mode, five in remote mode), and every forged packet is sent inside
//! them; nothing is sent anywhere else.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use balancer_common::l4::{CLOSE_GRACE, CLOSED_SHIFT};
use balancer_mock_worker::MockWorker;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::http1::{self, Answer};
use balancer_tests::l4e2e::{self, Driver, Metrics, NewConnections};
use balancer_tests::netns;
use balancer_tests::packet::{self, TCP_RST, TCP_SYN};
use balancer_tests::topology::{Family, Layout, Mode, Topology};

/// Entries of the established-connection table; the embryonic one gets a
/// quarter of that.
const CONNTRACK_SIZE: u32 = 2048;
/// The smallest connection table the churn test runs with.
const SMALL_TABLE: u32 = 256;
/// Short connections of the churn, opened by `CHURN_CLIENTS` threads at once.
const CHURN: usize = 2_000;
const CHURN_CLIENTS: usize = 8;
/// The longest the churn may take.
const CHURN_TIME: Duration = Duration::from_secs(60);
/// SYNs of the flood: four times the connection table.
const FLOOD: usize = 4 * CONNTRACK_SIZE as usize;
/// The longest the flood may take.
const FLOOD_TIME: Duration = Duration::from_secs(5);
/// The flood goes out in bursts of this many SYNs with a short pause after
/// each, so that the receiving veth's ring (256 frames, drained by NAPI)
/// does not overflow and every SYN reaches the XDP program.
const BURST: usize = 64;
const PAUSE: Duration = Duration::from_micros(200);
/// Spoofed flood sources: hosts `.100` to `.199` of the client's subnet
/// (none of which exists), from source port 20000 up.
const SPOOF_FIRST: u8 = 100;
const SPOOF_HOSTS: usize = 100;
const FLOOD_PORT: u16 = 20_000;
/// Keep-alive connections held across the flood.
const LONG_LIVED: usize = 5;
/// Bound of every wait.
const BOUND: Duration = Duration::from_secs(10);

// From linux/tcp.h; the libc crate has the option names but not these
// values.
const TCP_REPAIR_ON: libc::c_int = 1;
const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
const TCP_SEND_QUEUE: libc::c_int = 2;

#[test]
fn local_ipv4_syn_flood_keeps_established_connections() {
    with_gateway(
        Mode::Local,
        Family::V4,
        CONNTRACK_SIZE,
        syn_flood_keeps_connections,
    );
}

#[test]
fn local_ipv6_syn_flood_keeps_established_connections() {
    with_gateway(
        Mode::Local,
        Family::V6,
        CONNTRACK_SIZE,
        syn_flood_keeps_connections,
    );
}

#[test]
fn remote_ipv4_syn_flood_keeps_established_connections() {
    with_gateway(
        Mode::Remote,
        Family::V4,
        CONNTRACK_SIZE,
        syn_flood_keeps_connections,
    );
}

#[test]
fn remote_ipv6_syn_flood_keeps_established_connections() {
    with_gateway(
        Mode::Remote,
        Family::V6,
        CONNTRACK_SIZE,
        syn_flood_keeps_connections,
    );
}

#[test]
fn local_ipv4_out_of_window_rst_leaves_connection_open() {
    with_gateway(
        Mode::Local,
        Family::V4,
        CONNTRACK_SIZE,
        out_of_window_rst_is_ignored,
    );
}

#[test]
fn local_ipv6_out_of_window_rst_leaves_connection_open() {
    with_gateway(
        Mode::Local,
        Family::V6,
        CONNTRACK_SIZE,
        out_of_window_rst_is_ignored,
    );
}

#[test]
fn remote_ipv4_out_of_window_rst_leaves_connection_open() {
    with_gateway(
        Mode::Remote,
        Family::V4,
        CONNTRACK_SIZE,
        out_of_window_rst_is_ignored,
    );
}

#[test]
fn remote_ipv6_out_of_window_rst_leaves_connection_open() {
    with_gateway(
        Mode::Remote,
        Family::V6,
        CONNTRACK_SIZE,
        out_of_window_rst_is_ignored,
    );
}

#[test]
fn local_ipv4_small_table_churn_resets_no_handshake() {
    with_gateway(
        Mode::Local,
        Family::V4,
        SMALL_TABLE,
        churn_completes_every_handshake,
    );
}

#[test]
fn local_ipv6_small_table_churn_resets_no_handshake() {
    with_gateway(
        Mode::Local,
        Family::V6,
        SMALL_TABLE,
        churn_completes_every_handshake,
    );
}

#[test]
fn remote_ipv4_small_table_churn_resets_no_handshake() {
    with_gateway(
        Mode::Remote,
        Family::V4,
        SMALL_TABLE,
        churn_completes_every_handshake,
    );
}

#[test]
fn remote_ipv6_small_table_churn_resets_no_handshake() {
    with_gateway(
        Mode::Remote,
        Family::V6,
        SMALL_TABLE,
        churn_completes_every_handshake,
    );
}

// ---------------------------------------------------------------------------
// The three properties.

/// Property 1: established connections survive a SYN flood past the
/// connection table's size, on their worker, isolated or not.
fn syn_flood_keeps_connections(env: &Env) -> Result<()> {
    env.driver.ready(BOUND)?;
    let layout = env.layout;
    let vip = layout.vip();
    let (mut long, served) = l4e2e::long_lived(env.client_ns, vip, LONG_LIVED, env.workers, BOUND)?;
    eprintln!(
        "[{:?}] long-lived connections on workers {served:?}",
        layout.mode
    );

    // The worker of the first connection is isolated; its connections must
    // stay with it.
    let isolated = served[0];
    env.isolate(isolated)?;
    let isolated_url = env.workers[isolated].url();
    let before = env.driver.metrics()?;

    let mode = layout.mode;
    let (sent, took) = netns::run_in(env.client_ns, FLOOD_TIME + BOUND, move || {
        syn_flood(layout, FLOOD)
    })??;
    let new_flows = |m: &Metrics| m.outcome("new_flow");
    let min_flows = before.outcome("new_flow")? + f64::from(3 * CONNTRACK_SIZE);
    env.wait("the flood's SYNs counted", || {
        Ok(new_flows(&env.driver.metrics()?)? >= min_flows)
    })
    .with_context(|| format!("{sent} SYNs sent"))?;
    let flooded = env.driver.metrics()?;
    eprintln!(
        "[{mode:?}] flood: {sent} SYNs in {took:?}; {}",
        flooded.outcomes_since(&before)?
    );
    ensure!(
        flooded.worker_counter("connections", &isolated_url)?
            == before.worker_counter("connections", &isolated_url)?,
        "the isolated worker {isolated} was given new connections by the flood"
    );

    l4e2e::still_served(&mut long, &served, env.workers, "after the flood")?;
    let after = env.driver.metrics()?;
    eprintln!(
        "[{mode:?}] after the flood, one request per connection: {}",
        after.outcomes_since(&flooded)?
    );
    // Had the flood evicted any of their entries, their packets would have
    // been recovered (or an entry rebuilt from its peer), even if they then
    // reached the same worker through the table.
    for outcome in ["recovered", "peer_restored", "conntrack_full"] {
        let delta = after.outcome(outcome)? - flooded.outcome(outcome)?;
        ensure!(
            delta == 0.0,
            "{delta} {outcome} packets on the long-lived connections after the flood: \
             their entries did not survive it"
        );
    }
    ensure!(
        after.outcome("established")? > flooded.outcome("established")?,
        "the long-lived connections' packets were not steered as established"
    );
    ensure!(
        after.worker_counter("packets", &isolated_url)?
            > flooded.worker_counter("packets", &isolated_url)?,
        "no packet steered to the isolated worker {isolated}"
    );

    // New connections still open, and avoid the isolated worker.
    let fresh = netns::run_in(env.client_ns, BOUND, move || http1::new_connections(vip, 3))??;
    for answer in &fresh {
        let i = env.served_by(answer)?;
        ensure!(
            i != isolated,
            "the isolated worker {isolated} got a new connection"
        );
    }
    Ok(())
}

/// Property 2: resets far outside the window of a live connection are
/// counted as ignored and leave it working, for longer than the close grace.
fn out_of_window_rst_is_ignored(env: &Env) -> Result<()> {
    env.driver.ready(BOUND)?;
    let mode = env.layout.mode;
    let vip = env.layout.vip();
    let mut stream = netns::run_in(env.client_ns, BOUND, move || http1::connect(vip))??;
    let worker = env.served_by(&http1::chat(&mut stream, false)?)?;
    let client = stream.local_addr()?;

    // The client's next sequence number, exactly: the connection is idle,
    // so it is also where the backend's window starts. The window is at
    // most 2^30 (scaled; the datapath checks against the unscaled field,
    // at most 2^16), so each of these is far outside it, ahead of it and
    // behind it, for the datapath and for the worker's stack alike.
    let next = next_seq(&stream)?;
    let forged = [
        next.wrapping_add(1 << 31),
        next.wrapping_add(1 << 30),
        next.wrapping_sub(1 << 30),
    ];
    let before = env.driver.metrics()?;
    inject_resets(env.client_ns, client, vip, &forged)?;
    let ignored = before.outcome("rst_ignored")? + forged.len() as f64;
    env.wait("the forged resets counted as ignored", || {
        Ok(env.driver.metrics()?.outcome("rst_ignored")? >= ignored)
    })?;
    let answer = http1::chat(&mut stream, false).context("the request right after the resets")?;
    ensure!(
        env.served_by(&answer)? == worker,
        "the connection moved after the resets"
    );
    let after = env.driver.metrics()?;
    eprintln!(
        "[{mode:?}] {} forged resets at {forged:x?} (next sequence {next:#x}): {}",
        forged.len(),
        after.outcomes_since(&before)?
    );
    ensure!(
        after.outcome("rst_ignored")? == ignored,
        "rst_ignored went from {} to {}, expected {ignored}",
        before.outcome("rst_ignored")?,
        after.outcome("rst_ignored")?
    );

    // A reset the datapath took for real would have closed both entries,
    // and past the grace the reply entry would no longer restore the
    // service address: the connection would hang.
    let grace = Duration::from_nanos(u64::from(CLOSE_GRACE) << CLOSED_SHIFT);
    std::thread::sleep(grace + Duration::from_millis(800));
    let answer = http1::chat(&mut stream, false)
        .with_context(|| format!("the request {grace:?} and more after the resets"))?;
    ensure!(
        env.served_by(&answer)? == worker,
        "the connection moved after the close grace"
    );

    // Control: the same forgery with the exact next sequence number is a
    // valid reset, and the connection is gone.
    let next = next_seq(&stream)?;
    let counted = env.driver.metrics()?.outcome("rst_ignored")?;
    inject_resets(env.client_ns, client, vip, &[next])?;
    let closed = http1::chat(&mut stream, false);
    match &closed {
        Ok(answer) => eprintln!("[{mode:?}] after a reset at exactly {next:#x}: {answer:?}"),
        Err(error) => eprintln!("[{mode:?}] after a reset at exactly {next:#x}: {error:#}"),
    }
    ensure!(
        closed.is_err(),
        "a reset with the exact next sequence number {next:#x} did not close the \
         connection, so the forged ones prove nothing"
    );
    ensure!(
        env.driver.metrics()?.outcome("rst_ignored")? == counted,
        "the valid reset was counted as ignored"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Forged packets.

/// Sends `count` SYNs to the service from distinct spoofed addresses and
/// ports of the client's subnet (not the client's own, so that no live
/// connection's four-tuple is hit and no host answers the SYN-ACKs); returns
/// how many went out and how long that took. Runs in the client's
/// namespace.
fn syn_flood(layout: Layout, count: usize) -> Result<(usize, Duration)> {
    let vip = layout.vip();
    let socket = RawSocket::open(vip.ip())?;
    let start = Instant::now();
    let mut sent = 0;
    while sent < count {
        ensure!(
            start.elapsed() < FLOOD_TIME,
            "only {sent} of {count} SYNs sent within {FLOOD_TIME:?}"
        );
        let host = SPOOF_FIRST + (sent % SPOOF_HOSTS) as u8;
        let port = FLOOD_PORT + (sent / SPOOF_HOSTS) as u16;
        let src = SocketAddr::new(layout.host(host), port);
        match socket.send(&packet::tcp_packet(src, vip, TCP_SYN, 1), vip.ip()) {
            Ok(()) => {
                sent += 1;
                if sent % BURST == 0 {
                    std::thread::sleep(PAUSE);
                }
            }
            Err(error) if error.raw_os_error() == Some(libc::ENOBUFS) => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(error) => return Err(error).context("sending a SYN"),
        }
    }
    Ok((sent, start.elapsed()))
}

/// Sends a reset from `client` to `vip` for each sequence number, from the
/// client's namespace.
fn inject_resets(ns: &str, client: SocketAddr, vip: SocketAddr, seqs: &[u32]) -> Result<()> {
    let packets: Vec<Vec<u8>> = seqs
        .iter()
        .map(|&seq| packet::tcp_packet(client, vip, TCP_RST, seq))
        .collect();
    netns::run_in(ns, BOUND, move || -> Result<()> {
        let socket = RawSocket::open(vip.ip())?;
        for packet in &packets {
            socket.send(packet, vip.ip()).context("sending a reset")?;
        }
        Ok(())
    })?
}

/// A raw socket of one family that sends whole IP packets, header included
/// (`IPPROTO_RAW` implies `IP_HDRINCL`, and does the same for IPv6),
/// whatever their source address. It sends in the namespace it was opened
/// in.
struct RawSocket(OwnedFd);

impl RawSocket {
    /// A socket for packets to `dst`'s family.
    #[allow(unsafe_code)]
    fn open(dst: IpAddr) -> Result<Self> {
        let family = if dst.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        // SAFETY: socket(2) takes no pointers.
        let fd = unsafe {
            libc::socket(
                family,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_RAW,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening a raw socket");
        }
        // SAFETY: a descriptor socket(2) just returned, owned by nothing else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Sends one IP packet to its destination address `dst`.
    #[allow(unsafe_code)]
    fn send(&self, packet: &[u8], dst: IpAddr) -> io::Result<()> {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = match dst {
            IpAddr::V4(ip) => {
                // SAFETY: sockaddr_storage is large and aligned enough for
                // any socket address.
                let v4 = unsafe { &mut *(&raw mut addr).cast::<libc::sockaddr_in>() };
                v4.sin_family = libc::AF_INET as libc::sa_family_t;
                v4.sin_addr.s_addr = u32::from_ne_bytes(ip.octets());
                size_of::<libc::sockaddr_in>()
            }
            IpAddr::V6(ip) => {
                // SAFETY: as above.
                let v6 = unsafe { &mut *(&raw mut addr).cast::<libc::sockaddr_in6>() };
                v6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                v6.sin6_addr.s6_addr = ip.octets();
                size_of::<libc::sockaddr_in6>()
            }
        };
        // SAFETY: `packet` and `addr` are live for the call, and the lengths
        // passed are theirs.
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&raw const addr).cast(),
                len as libc::socklen_t,
            )
        };
        match usize::try_from(n) {
            Ok(n) if n == packet.len() => Ok(()),
            Ok(n) => Err(io::Error::other(format!(
                "sent {n} of {} bytes",
                packet.len()
            ))),
            Err(_) => Err(io::Error::last_os_error()),
        }
    }
}

/// The sequence number of the next byte the client sends on `stream` (the
/// kernel's `write_seq`), read through TCP repair mode (root only), which
/// is left again without a window probe. `stream` must be idle: nothing
/// unsent or unacknowledged.
#[allow(unsafe_code)]
fn next_seq(stream: &TcpStream) -> Result<u32> {
    let fd = stream.as_raw_fd();
    let set = |option: libc::c_int, value: libc::c_int| -> io::Result<()> {
        // SAFETY: `value` is a live c_int and its size is what is passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_TCP,
                option,
                (&raw const value).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    set(libc::TCP_REPAIR, TCP_REPAIR_ON).context("entering TCP repair mode")?;
    let read = set(libc::TCP_REPAIR_QUEUE, TCP_SEND_QUEUE).and_then(|()| {
        let mut seq: u32 = 0;
        let mut len = size_of::<u32>() as libc::socklen_t;
        // SAFETY: `seq` and `len` are live and describe 4 writable bytes.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_TCP,
                libc::TCP_QUEUE_SEQ,
                (&raw mut seq).cast(),
                &mut len,
            )
        };
        if rc == 0 {
            Ok(seq)
        } else {
            Err(io::Error::last_os_error())
        }
    });
    let left = set(libc::TCP_REPAIR, TCP_REPAIR_OFF_NO_WP);
    let seq = read.context("reading the send queue's sequence number")?;
    left.context("leaving TCP repair mode")?;
    Ok(seq)
}

/// Property 3: with a connection table of `SMALL_TABLE` entries, `CHURN`
/// short connections (one request each, `CHURN_CLIENTS` at a time, so the
/// table turns over many times) all complete, each on the worker its SYN
/// was steered to, and every worker's SYN-ACK found its handshake's entries
/// (the kernel counted the handshake established): no handshake was
/// evicted by the others' churn before it completed.
fn churn_completes_every_handshake(env: &Env) -> Result<()> {
    env.driver.ready(BOUND)?;
    let mode = env.layout.mode;
    let connections = NewConnections {
        vip: env.layout.vip(),
        connect_timeout: BOUND,
        io_timeout: BOUND,
    };
    let before = env.driver.metrics()?;
    let started = Instant::now();
    let clients: Vec<_> = (0..CHURN_CLIENTS)
        .map(|_| {
            let ns = env.client_ns.to_owned();
            std::thread::spawn(move || {
                netns::run_in(&ns, CHURN_TIME, move || {
                    connections.tally(CHURN / CHURN_CLIENTS, 0)
                })
            })
        })
        .collect();
    let mut answered = vec![0.0; env.workers.len()];
    let mut failures = Vec::new();
    for client in clients {
        let tally = client
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        for (i, worker) in env.workers.iter().enumerate() {
            answered[i] += tally.of(worker.name()) as f64;
        }
        if tally.failed > 0 {
            failures.push(tally.to_string());
        }
    }
    let took = started.elapsed();
    let total: f64 = answered.iter().sum();
    ensure!(
        failures.is_empty() && total == CHURN as f64,
        "{total} of {CHURN} connections answered; failed: {failures:?}"
    );
    // The handshake counters reach the metrics at the agent's next read.
    let delta = |m: &Metrics, i: usize, counter: &dyn Fn(&Metrics, &str) -> Result<f64>| {
        let url = env.workers[i].url();
        Ok::<_, anyhow::Error>(counter(m, &url)? - counter(&before, &url)?)
    };
    let established = |m: &Metrics, url: &str| m.handshakes(url, "established");
    let steered = |m: &Metrics, url: &str| m.worker_counter("connections", url);
    env.wait("every handshake counted", || {
        let m = env.driver.metrics()?;
        let counted: Result<Vec<f64>> = (0..answered.len())
            .map(|i| delta(&m, i, &established))
            .collect();
        Ok(counted?.iter().sum::<f64>() >= total)
    })?;
    let after = env.driver.metrics()?;
    eprintln!(
        "[{mode:?}] churn of {CHURN} connections through a table of {SMALL_TABLE}: \
         answered by worker {answered:?} in {took:?}; {}",
        after.outcomes_since(&before)?
    );
    for (i, &answers) in answered.iter().enumerate() {
        let syns = delta(&after, i, &steered)?;
        let handshakes = delta(&after, i, &established)?;
        ensure!(
            syns == answers && handshakes == answers,
            "worker {i}: {answers} connections answered, {syns} SYNs steered to it, \
             {handshakes} of its handshakes found their entries"
        );
    }
    let full = after.outcome("conntrack_full")? - before.outcome("conntrack_full")?;
    ensure!(full == 0.0, "{full} entries refused during the churn");
    Ok(())
}

// ---------------------------------------------------------------------------
// The gateway, its workers and the metrics.

/// Runs `test` against a gateway in `mode` steering a service of `family`,
/// in namespaces created for it and deleted afterwards whatever happened.
fn with_gateway(mode: Mode, family: Family, conntrack_size: u32, test: fn(&Env) -> Result<()>) {
    if ebpf_prerequisites().is_none() {
        return;
    }
    Topology::run("bt-l4pr", Layout::new(mode, family, 87), |topology| {
        start_and_run(topology, conntrack_size, test)
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
}

fn start_and_run(
    topology: &Topology,
    conntrack_size: u32,
    test: fn(&Env) -> Result<()>,
) -> Result<()> {
    let layout = topology.layout;
    // On the manual clock the breaker's open timeout never passes: an
    // isolated worker stays so.
    l4e2e::run_gateway(
        topology,
        |_, l4| l4.conntrack_size = conntrack_size,
        |gateway| {
            let env = Env {
                layout,
                client_ns: topology.client(),
                driver: gateway.driver,
                workers: gateway.workers,
            };
            let started = Instant::now();
            let outcome = test(&env);
            eprintln!("[{:?}] test body took {:?}", layout.mode, started.elapsed());
            outcome
        },
    )
}

struct Env<'a> {
    layout: Layout,
    client_ns: &'a str,
    driver: Driver<'a>,
    workers: &'a [MockWorker],
}

impl Env<'_> {
    /// Which worker gave `answer`; it must be a success.
    fn served_by(&self, answer: &Answer) -> Result<usize> {
        l4e2e::served_by(self.workers, answer)
    }

    /// Isolates worker `i` through its breaker (see [`Driver::isolate`]).
    fn isolate(&self, i: usize) -> Result<()> {
        let (sent, delay) = self.driver.isolate(i, &self.workers[i], BOUND)?;
        eprintln!(
            "[{:?}] worker {i}'s breaker opened after {sent} requests, isolated in the kernel {delay:?} later",
            self.layout.mode
        );
        Ok(())
    }

    fn wait(&self, what: &str, done: impl FnMut() -> Result<bool>) -> Result<()> {
        l4e2e::wait(what, BOUND, done)
    }
}

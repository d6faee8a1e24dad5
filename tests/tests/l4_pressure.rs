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
//! - Resets forged far outside the sequence window of a live connection are
//!   counted as ignored (`rst_ignored`) and close nothing: the connection
//!   keeps working, also after the close grace period would have made its
//!   entries stale. A reset with the connection's exact next sequence number
//!   does close it, which shows the forged ones were well formed.
//!
//! Every address is inside the namespaces the test creates (two in local
//! mode, five in remote mode), and every forged packet is sent inside them;
//! nothing is sent anywhere else.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use balancer::gateway::Gateway;
use balancer_common::l4::{BackendState, CLOSE_GRACE, CLOSED_SHIFT};
use balancer_core::breaker::State;
use balancer_core::clock::ManualClock;
use balancer_core::registry::Worker;
use balancer_dataplane::steering::ForwardMode;
use balancer_mock_worker::{Fault, MockWorker};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::http1::{self, Answer};
use balancer_tests::l4e2e;
use balancer_tests::netns::{self, Namespaces, run};
use balancer_tests::ns_runtime::NsRuntime;
use balancer_tests::packet::{self, Ipv4, PROTO_TCP, TCP_SYN};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Entries of the established-connection table; the embryonic one gets a
/// quarter of that.
const CONNTRACK_SIZE: u32 = 2048;
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
const TCP_RST: u8 = 0x04;
const WORKERS: usize = 3;
const NAMES: [&str; WORKERS] = ["a", "b", "c"];

// From linux/tcp.h; the libc crate has the option names but not these
// values.
const TCP_REPAIR_ON: libc::c_int = 1;
const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
const TCP_SEND_QUEUE: libc::c_int = 2;

#[test]
fn local_syn_flood_keeps_established_connections() {
    let Some(_) = ebpf_prerequisites() else {
        return;
    };
    with_gateway(Mode::Local, syn_flood_keeps_connections).unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn remote_syn_flood_keeps_established_connections() {
    let Some(_) = ebpf_prerequisites() else {
        return;
    };
    with_gateway(Mode::Remote, syn_flood_keeps_connections).unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn local_out_of_window_rst_leaves_connection_open() {
    let Some(_) = ebpf_prerequisites() else {
        return;
    };
    with_gateway(Mode::Local, out_of_window_rst_is_ignored).unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn remote_out_of_window_rst_leaves_connection_open() {
    let Some(_) = ebpf_prerequisites() else {
        return;
    };
    with_gateway(Mode::Remote, out_of_window_rst_is_ignored).unwrap_or_else(|e| panic!("{e:#}"));
}

// ---------------------------------------------------------------------------
// The two properties.

/// Property 1: established connections survive a SYN flood past the
/// connection table's size, on their worker, isolated or not.
fn syn_flood_keeps_connections(env: &Env) -> Result<()> {
    env.ready()?;
    let vip = env.mode.vip();
    let mut long = netns::run_in(env.client_ns, BOUND, move || -> Result<Vec<TcpStream>> {
        (0..LONG_LIVED)
            .map(|_| http1::connect(vip.into()))
            .collect()
    })??;
    let mut served = Vec::new();
    for (i, stream) in long.iter_mut().enumerate() {
        let answer = http1::chat(stream, false).with_context(|| format!("connection {i}"))?;
        served.push(
            env.served_by(&answer)
                .with_context(|| format!("connection {i}"))?,
        );
    }
    eprintln!(
        "[{:?}] long-lived connections on workers {served:?}",
        env.mode
    );

    // The worker of the first connection is isolated; its connections must
    // stay with it.
    let isolated = served[0];
    env.isolate(isolated)?;
    let isolated_url = env.workers[isolated].url();
    let before = env.metrics()?;

    let mode = env.mode;
    let (sent, took) = netns::run_in(env.client_ns, FLOOD_TIME + BOUND, move || {
        syn_flood(mode, FLOOD)
    })??;
    let new_flows = |m: &Metrics| m.outcome("new_flow");
    let min_flows = before.outcome("new_flow")? + f64::from(3 * CONNTRACK_SIZE);
    env.wait("the flood's SYNs counted", || {
        Ok(new_flows(&env.metrics()?)? >= min_flows)
    })
    .with_context(|| format!("{sent} SYNs sent"))?;
    let flooded = env.metrics()?;
    eprintln!(
        "[{mode:?}] flood: {sent} SYNs in {took:?}; {}",
        flooded.outcomes_since(&before)?
    );
    ensure!(
        flooded.worker("connections", &isolated_url)?
            == before.worker("connections", &isolated_url)?,
        "the isolated worker {isolated} was given new connections by the flood"
    );

    for (i, stream) in long.iter_mut().enumerate() {
        let answer = http1::chat(stream, false)
            .with_context(|| format!("connection {i} (worker {}) after the flood", served[i]))?;
        let now = env.served_by(&answer)?;
        ensure!(
            now == served[i],
            "connection {i} moved from worker {} to worker {now} during the flood",
            served[i]
        );
    }
    let after = env.metrics()?;
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
        after.worker("packets", &isolated_url)? > flooded.worker("packets", &isolated_url)?,
        "no packet steered to the isolated worker {isolated}"
    );

    // New connections still open, and avoid the isolated worker.
    let fresh = netns::run_in(env.client_ns, BOUND, move || {
        http1::new_connections(vip.into(), 3)
    })??;
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
    env.ready()?;
    let mode = env.mode;
    let vip = mode.vip();
    let mut stream = netns::run_in(env.client_ns, BOUND, move || http1::connect(vip.into()))??;
    let worker = env.served_by(&http1::chat(&mut stream, false)?)?;
    let SocketAddr::V4(client) = stream.local_addr()? else {
        bail!("an IPv4 connection has a non-IPv4 local address");
    };

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
    let before = env.metrics()?;
    inject_resets(env.client_ns, client, vip, &forged)?;
    let ignored = before.outcome("rst_ignored")? + forged.len() as f64;
    env.wait("the forged resets counted as ignored", || {
        Ok(env.metrics()?.outcome("rst_ignored")? >= ignored)
    })?;
    let answer = http1::chat(&mut stream, false).context("the request right after the resets")?;
    ensure!(
        env.served_by(&answer)? == worker,
        "the connection moved after the resets"
    );
    let after = env.metrics()?;
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
    let counted = env.metrics()?.outcome("rst_ignored")?;
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
        env.metrics()?.outcome("rst_ignored")? == counted,
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
fn syn_flood(mode: Mode, count: usize) -> Result<(usize, Duration)> {
    let socket = RawSocket::open()?;
    let vip = mode.vip();
    let start = Instant::now();
    let mut sent = 0;
    while sent < count {
        ensure!(
            start.elapsed() < FLOOD_TIME,
            "only {sent} of {count} SYNs sent within {FLOOD_TIME:?}"
        );
        let host = SPOOF_FIRST + (sent % SPOOF_HOSTS) as u8;
        let port = FLOOD_PORT + (sent / SPOOF_HOSTS) as u16;
        let src = SocketAddrV4::new(mode.host(host), port);
        let segment = packet::tcp(src, vip, TCP_SYN);
        match socket.send(&Ipv4::new(*src.ip(), *vip.ip(), PROTO_TCP).packet(&segment)) {
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
fn inject_resets(ns: &str, client: SocketAddrV4, vip: SocketAddrV4, seqs: &[u32]) -> Result<()> {
    let packets: Vec<Vec<u8>> = seqs
        .iter()
        .map(|&seq| {
            let segment = with_seq(packet::tcp(client, vip, TCP_RST), client, vip, seq);
            Ipv4::new(*client.ip(), *vip.ip(), PROTO_TCP).packet(&segment)
        })
        .collect();
    netns::run_in(ns, BOUND, move || -> Result<()> {
        let socket = RawSocket::open()?;
        for packet in &packets {
            socket.send(packet).context("sending a reset")?;
        }
        Ok(())
    })?
}

/// `segment` (built by [`packet::tcp`]) with sequence number `seq` and its
/// checksum recomputed.
fn with_seq(mut segment: Vec<u8>, src: SocketAddrV4, dst: SocketAddrV4, seq: u32) -> Vec<u8> {
    segment[4..8].copy_from_slice(&seq.to_be_bytes());
    segment[16..18].copy_from_slice(&[0, 0]);
    let mut pseudo = Vec::with_capacity(12 + segment.len());
    pseudo.extend_from_slice(&src.ip().octets());
    pseudo.extend_from_slice(&dst.ip().octets());
    pseudo.extend_from_slice(&[0, PROTO_TCP]);
    pseudo.extend_from_slice(&(segment.len() as u16).to_be_bytes());
    pseudo.extend_from_slice(&segment);
    let mut sum: u32 = pseudo
        .chunks(2)
        .map(|pair| u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    segment[16..18].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    segment
}

/// A raw IPv4 socket that sends whole packets, header included
/// (`IPPROTO_RAW` implies `IP_HDRINCL`), whatever their source address.
/// It sends in the namespace it was opened in.
struct RawSocket(OwnedFd);

impl RawSocket {
    #[allow(unsafe_code)]
    fn open() -> Result<Self> {
        // SAFETY: socket(2) takes no pointers.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_RAW,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening a raw IPv4 socket");
        }
        // SAFETY: a descriptor socket(2) just returned, owned by nothing else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Sends one IPv4 packet to its destination address.
    #[allow(unsafe_code)]
    fn send(&self, packet: &[u8]) -> io::Result<()> {
        let dst = [packet[16], packet[17], packet[18], packet[19]];
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(dst),
            },
            sin_zero: [0; 8],
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
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
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

// ---------------------------------------------------------------------------
// The gateway, its workers and the metrics.

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Gateway and workers in one namespace, the client in another.
    Local,
    /// Client, balancer (routing) and one namespace per worker.
    Remote,
}

impl Mode {
    fn forward(self) -> ForwardMode {
        match self {
            Self::Local => ForwardMode::Local,
            Self::Remote => ForwardMode::Remote,
        }
    }

    fn net(self) -> u8 {
        match self {
            Self::Local => 87,
            Self::Remote => 88,
        }
    }

    /// Host `host` of the client's subnet.
    fn host(self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), 0, host)
    }

    fn client_ip(self) -> Ipv4Addr {
        self.host(2)
    }

    /// The balancer's address on the client's link.
    fn front_ip(self) -> Ipv4Addr {
        self.host(1)
    }

    fn vip(self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, self.net(), 100, 1), 80)
    }

    /// Remote mode: worker `i` (from 1) and the balancer's side of its link.
    fn worker_ip(self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), i as u8, 2)
    }

    fn worker_gateway(self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), i as u8, 1)
    }

    fn namespaces(self) -> usize {
        match self {
            Self::Local => 2,
            Self::Remote => 2 + WORKERS,
        }
    }
}

const CLIENT_IF: &str = "cl0";
/// The balancer's interface toward the client.
const FRONT_IF: &str = "lbc";
/// A worker's interface toward the balancer (remote mode).
const WORKER_IF: &str = "wk0";

/// The balancer's interface toward worker `i` (remote mode, from 1).
fn back_if(i: usize) -> String {
    format!("lbw{i}")
}

fn ns_exec(ns: &str, args: &[&str]) -> Result<String> {
    let mut all = vec!["netns", "exec", ns];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// A veth between two namespaces, addressed and up, with full checksums on
/// transmit and GRO on receive (a frame XDP redirects into a veth is only
/// delivered when the far end runs NAPI).
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

/// The links and routes of `mode` between `names` (0: client, 1: balancer,
/// then the workers' namespaces in remote mode); the topologies of
/// `l4_local.rs` and `l4_remote.rs`.
fn topology(mode: Mode, names: &[String]) -> Result<()> {
    let (client, balancer) = (names[0].as_str(), names[1].as_str());
    if let Mode::Remote = mode {
        // The balancer routes, and sees replies from the VIP, which it does
        // not own, arriving from the workers' side.
        for setting in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            ns_exec(balancer, &["sysctl", "-qw", setting])?;
        }
    }
    link(
        (client, CLIENT_IF, mode.client_ip()),
        (balancer, FRONT_IF, mode.front_ip()),
    )?;
    run(
        "ip",
        &[
            "-n",
            client,
            "route",
            "add",
            &format!("{}/32", mode.vip().ip()),
            "via",
            &mode.front_ip().to_string(),
        ],
    )?;
    if let Mode::Remote = mode {
        for i in 1..=WORKERS {
            let worker = names[1 + i].as_str();
            link(
                (balancer, &back_if(i), mode.worker_gateway(i)),
                (worker, WORKER_IF, mode.worker_ip(i)),
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
                    &mode.worker_gateway(i).to_string(),
                ],
            )?;
        }
    }
    Ok(())
}

/// Runs `test` against a gateway in `mode`, in namespaces created for it
/// and deleted afterwards whatever happened.
fn with_gateway(mode: Mode, test: fn(&Env) -> Result<()>) -> Result<()> {
    let prefix = match mode {
        Mode::Local => "bt-l4prl",
        Mode::Remote => "bt-l4prr",
    };
    let namespaces =
        Namespaces::create(prefix, mode.namespaces()).context("creating namespaces")?;
    let names: Vec<String> = (0..mode.namespaces())
        .map(|i| namespaces.name(i).to_owned())
        .collect();
    let outcome = start_and_run(mode, &names, test);
    let deleted = namespaces.delete();
    outcome?;
    deleted
}

fn start_and_run(mode: Mode, names: &[String], test: fn(&Env) -> Result<()>) -> Result<()> {
    topology(mode, names)?;
    // Remote mode: one runtime per worker namespace; local mode: the
    // workers share the gateway's.
    let worker_runtimes = names[2..]
        .iter()
        .map(|ns| NsRuntime::new(ns))
        .collect::<Result<Vec<_>>>()?;
    let runtime = NsRuntime::new(&names[1])?;
    let workers = NAMES
        .iter()
        .enumerate()
        .map(|(i, name)| match mode {
            Mode::Local => runtime.worker(SocketAddr::from((mode.front_ip(), 0)), name),
            Mode::Remote => {
                worker_runtimes[i].worker(SocketAddr::from((mode.worker_ip(i + 1), 0)), name)
            }
        })
        .collect::<Result<Vec<_>>>()?;

    let urls: Vec<String> = workers.iter().map(|w| w.url()).collect();
    let mut config = l4e2e::gateway_config(&urls);
    let ifaces = match mode {
        Mode::Local => vec![FRONT_IF.to_owned()],
        Mode::Remote => std::iter::once(FRONT_IF.to_owned())
            .chain((1..=WORKERS).map(back_if))
            .collect(),
    };
    let mut l4 = l4e2e::l4_config(ifaces, mode.forward(), vec![mode.vip()]);
    l4.conntrack_size = CONNTRACK_SIZE;
    config.l4 = Some(l4);
    // The breaker's open timeout never passes: an isolated worker stays so.
    let clock = Arc::new(ManualClock::new());
    let gw = runtime
        .run(Gateway::start_with_clock(config, clock))?
        .context("starting the gateway")?;

    let env = Env {
        mode,
        client_ns: &names[0],
        balancer: &runtime,
        gw: &gw,
        workers: &workers,
    };
    let started = Instant::now();
    let outcome = test(&env);
    eprintln!("[{mode:?}] test body took {:?}", started.elapsed());

    let stopped = runtime.run(gw.shutdown());
    let mut workers_stopped = Ok(());
    for (i, worker) in workers.into_iter().enumerate() {
        let runtime = match mode {
            Mode::Local => &runtime,
            Mode::Remote => &worker_runtimes[i],
        };
        workers_stopped = workers_stopped.and(runtime.run(worker.shutdown()));
    }
    outcome?;
    stopped.context("stopping the gateway")?;
    workers_stopped.context("stopping the workers")
}

struct Env<'a> {
    mode: Mode,
    client_ns: &'a str,
    /// The runtime the gateway runs on, in the balancer's namespace.
    balancer: &'a NsRuntime,
    gw: &'a Gateway,
    workers: &'a [MockWorker],
}

impl Env<'_> {
    /// Waits until the gateway knows every worker's models and the kernel
    /// has every worker routable.
    fn ready(&self) -> Result<()> {
        self.wait("models learned", || {
            Ok(self
                .gw
                .registry
                .fleet()
                .workers
                .iter()
                .all(|w| !w.models().is_empty()))
        })?;
        for i in 0..self.workers.len() {
            self.wait_kernel_state(i, BackendState::Routable)?;
        }
        Ok(())
    }

    /// Which worker gave `answer`; it must be a success.
    fn served_by(&self, answer: &Answer) -> Result<usize> {
        ensure!(answer.status == 200, "answer {answer:?}");
        self.workers
            .iter()
            .position(|w| w.name() == answer.worker)
            .with_context(|| format!("unexpected answer {answer:?}"))
    }

    /// Opens worker `i`'s breaker with real L7 failures, clears the fault
    /// (only the breaker holds the worker back then) and waits until the
    /// kernel has it isolated.
    fn isolate(&self, i: usize) -> Result<()> {
        self.workers[i].set_fault(Fault {
            status: Some(500),
            ..Fault::default()
        });
        let opened = (|| -> Result<usize> {
            let mut sent = 0;
            while self.worker(i)?.breaker.state() != State::Open {
                ensure!(
                    sent < 60,
                    "worker {i}'s breaker still {:?} after {sent} requests",
                    self.worker(i)?.breaker.state()
                );
                self.gateway_chat()?;
                sent += 1;
            }
            Ok(sent)
        })();
        self.workers[i].clear_fault();
        let sent = opened?;
        let start = Instant::now();
        self.wait_kernel_state(i, BackendState::Isolated)?;
        eprintln!(
            "[{:?}] worker {i}'s breaker opened after {sent} requests, isolated in the kernel {:?} later",
            self.mode,
            start.elapsed()
        );
        Ok(())
    }

    fn worker(&self, i: usize) -> Result<Arc<Worker>> {
        self.gw
            .registry
            .fleet()
            .get(&self.workers[i].url())
            .cloned()
            .with_context(|| format!("worker {i} is not registered"))
    }

    /// One chat completion through the L7 gateway.
    fn gateway_chat(&self) -> Result<u16> {
        let uri = format!("http://{}/v1/chat/completions", self.gw.addr);
        self.balancer.run(async move {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let request = http::Request::post(uri)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(http1::CHAT.as_bytes())))?;
            let response = tokio::time::timeout(BOUND, client.request(request)).await??;
            let status = response.status().as_u16();
            response.into_body().collect().await?;
            Ok::<_, anyhow::Error>(status)
        })?
    }

    /// The gateway's metrics, as exposed.
    fn metrics(&self) -> Result<Metrics> {
        let uri = format!("http://{}/metrics", self.gw.metrics_addr);
        let text = self.balancer.run(async move {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let response = tokio::time::timeout(BOUND, client.get(uri.parse()?)).await??;
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, anyhow::Error>(String::from_utf8_lossy(&body).into_owned())
        })??;
        Ok(Metrics(text))
    }

    /// Waits until the kernel's map holds `state` for worker `i`.
    fn wait_kernel_state(&self, i: usize, state: BackendState) -> Result<()> {
        let steering = self.gw.steering().context("no dataplane")?;
        let worker = self.worker(i)?;
        self.wait(
            &format!("worker {i} {} in the kernel", state.name()),
            || Ok(steering.backend_state(&worker)? == Some(state)),
        )
    }

    fn wait(&self, what: &str, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
        let deadline = Instant::now() + BOUND;
        while !done()? {
            if Instant::now() > deadline {
                bail!("timed out after {BOUND:?} waiting for: {what}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

/// One scrape of the gateway's metrics.
struct Metrics(String);

impl Metrics {
    /// The value of one series (name and labels as exposed).
    fn get(&self, series: &str) -> Result<f64> {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .with_context(|| format!("no {series} in the metrics"))
    }

    /// Packets of one L4 outcome.
    fn outcome(&self, name: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_l4_outcome_packets_total{{outcome=\"{name}\"}}"
        ))
    }

    /// One of a worker's L4 counters (`balancer_l4_worker_<what>_total`).
    fn worker(&self, what: &str, url: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_l4_worker_{what}_total{{worker=\"{url}\"}}"
        ))
    }

    /// The outcomes that moved since `earlier`, for the log.
    fn outcomes_since(&self, earlier: &Metrics) -> Result<String> {
        let mut moved = Vec::new();
        for name in [
            "new_flow",
            "established",
            "reply",
            "promoted",
            "recovered",
            "peer_restored",
            "rst_ignored",
            "conntrack_full",
            "unresolved",
            "no_backend",
            "not_service",
        ] {
            let delta = self.outcome(name)? - earlier.outcome(name)?;
            if delta != 0.0 {
                moved.push(format!("{name} +{delta}"));
            }
        }
        Ok(moved.join(", "))
    }
}

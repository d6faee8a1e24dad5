//! Path MTU discovery through the balancer, end to end, for both
//! families: a link on the way is narrower than the sender's (1400 bytes
//! for IPv4, IPv6's minimum of 1280 for IPv6, against 1500), so the MSS
//! the far end advertises promises segments that do not fit, and the
//! transfer completes only if the sender's kernel learns the path MTU for
//! the address it sends to from an ICMP error that matches its socket.
//!
//! - Remote mode, the balancer's own interfaces narrower (its next hop):
//!   the XDP program answers itself (ICMP fragmentation needed, ICMPv6
//!   packet too big: outcome `frag_needed`), quoting the packet as it
//!   arrived. Narrow toward the workers, the client uploads a large body
//!   and its route to the service learns the MTU; narrow toward the
//!   client, a worker streams a large answer and its route to the client
//!   learns it (the answer quotes worker → client, as the worker sent it).
//!   Without the answer the segment goes to the kernel, whose own error
//!   quotes the rewritten packet, which matches no socket of the sender:
//!   the transfer stalls (these four tests fail with the answer taken out
//!   of `l4::send`).
//! - Both modes, a narrow link behind a router on the client's side (the
//!   client's namespace routes for a client behind it): the router's error
//!   about a worker's large answer goes to the service address, and the
//!   balancer translates it for the worker (outcome `icmp`), whose route to
//!   the client learns the MTU (these four tests fail with ICMP passed
//!   untranslated).
//!
//! A veth delivers nothing larger than its receiving end's MTU, so in each
//! test the far end of the narrow link sends only small segments (ACKs, a
//! short request or answer); that is what a narrow hop right behind the
//! balancer looks like to both ends. And a veth delivers what XDP sends
//! back out of it (`XDP_TX`, as the answers leave) only once its peer's
//! NAPI runs for some other reason, unless the peer runs an XDP program of
//! its own (the kernel's `veth_xdp_flush` kicks the peer only then; a
//! redirect into a veth needs GRO only): the answers waited in the
//! client's queue until the next ordinary frame reached it, which in an
//! upload stalled for good. So the client's and the workers' ends run a
//! program that passes everything ([`pass_everything`]), as a NIC puts
//! `XDP_TX` frames on the wire. Addresses are inside the namespaces each
//! test creates; nothing is sent anywhere else.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4e2e::{self, Driver};
use balancer_tests::netns::{self, Namespaces};
use balancer_tests::topology::{
    CLIENT_IF, FRONT_IF, Family, Layout, Mode, NAMES, Topology, WORKER_IF, WORKERS, back_if, link,
    ns_exec,
};

/// How long a transfer may take, path MTU discovery included.
const TRANSFER_BOUND: Duration = Duration::from_secs(10);
/// Waiting for the gateway's workers to become routable.
const READY_BOUND: Duration = Duration::from_secs(20);
/// Words of the uploaded prompt ("w ", 2 bytes each): 256 KiB.
const UPLOAD_WORDS: usize = 128 * 1024;
/// Tokens of the streamed answer, one SSE event each (the demo worker's
/// cap): some 700 KB.
const DOWNLOAD_TOKENS: usize = 4096;

#[test]
fn remote_mode_ipv4_client_learns_the_mtu_of_a_narrow_link_toward_the_workers() {
    path_mtu(Mode::Remote, Family::V4, Narrow::Workers);
}

#[test]
fn remote_mode_ipv6_client_learns_the_mtu_of_a_narrow_link_toward_the_workers() {
    path_mtu(Mode::Remote, Family::V6, Narrow::Workers);
}

#[test]
fn remote_mode_ipv4_worker_learns_the_mtu_of_a_narrow_link_toward_the_client() {
    path_mtu(Mode::Remote, Family::V4, Narrow::Client);
}

#[test]
fn remote_mode_ipv6_worker_learns_the_mtu_of_a_narrow_link_toward_the_client() {
    path_mtu(Mode::Remote, Family::V6, Narrow::Client);
}

#[test]
fn local_mode_ipv4_worker_learns_the_mtu_behind_the_clients_router() {
    path_mtu(Mode::Local, Family::V4, Narrow::BehindRouter);
}

#[test]
fn local_mode_ipv6_worker_learns_the_mtu_behind_the_clients_router() {
    path_mtu(Mode::Local, Family::V6, Narrow::BehindRouter);
}

#[test]
fn remote_mode_ipv4_worker_learns_the_mtu_behind_the_clients_router() {
    path_mtu(Mode::Remote, Family::V4, Narrow::BehindRouter);
}

#[test]
fn remote_mode_ipv6_worker_learns_the_mtu_behind_the_clients_router() {
    path_mtu(Mode::Remote, Family::V6, Narrow::BehindRouter);
}

/// Where the narrow link is, and so who sends the segments that do not
/// fit, and who answers them.
#[derive(Clone, Copy, Debug)]
enum Narrow {
    /// The balancer's interfaces toward the workers (remote mode): the
    /// client uploads, the balancer answers it.
    Workers,
    /// The balancer's interface toward the client (remote mode): a worker
    /// answers at length, the balancer answers the worker.
    Client,
    /// The link from the client's namespace, which routes, to a client
    /// behind it ([`behind_router`]): a worker answers at length, the
    /// router's error goes to the service address, and the balancer
    /// translates it for the worker (outcome `icmp`).
    BehindRouter,
}

/// The subnet of the link between the router and the client behind it
/// (the router host 1, the client host 2).
const BEHIND: u8 = 50;
/// The router's interface toward the client behind it, and that client's.
const ROUTER_IF: &str = "rt0";
const BEHIND_IF: &str = "bh0";

/// The narrow MTU of a family: below the far end's 1500, and for IPv6 its
/// minimum, which every IPv6 link carries.
fn narrow_mtu(family: Family) -> u32 {
    match family {
        Family::V4 => 1400,
        Family::V6 => 1280,
    }
}

/// In a topology of addresses `10.79.0.0/16` or `fd00:0:79::/48`.
fn path_mtu(mode: Mode, family: Family, narrow: Narrow) {
    // The gateway finds the object the same way the check does.
    if ebpf_prerequisites().is_none() {
        return;
    }
    let layout = Layout::new(mode, family, 79);
    Topology::run("bt-l4mtu", layout, |topology| exercise(topology, narrow))
        .unwrap_or_else(|error| panic!("{mode:?} mode, {family:?}, narrow {narrow:?}: {error:#}"));
}

fn exercise(topology: &Topology, narrow: Narrow) -> Result<()> {
    let layout = topology.layout;
    let mtu = narrow_mtu(layout.family);
    let narrowed: Vec<String> = match narrow {
        Narrow::Workers => (1..=WORKERS).map(back_if).collect(),
        Narrow::Client => vec![FRONT_IF.to_owned()],
        Narrow::BehindRouter => Vec::new(),
    };
    for iface in &narrowed {
        set_mtu(topology.balancer(), iface, mtu)?;
    }
    let behind = match narrow {
        Narrow::BehindRouter => Some(behind_router(topology, mtu)?),
        Narrow::Workers | Narrow::Client => None,
    };

    // Detached when these close, at the end of the test.
    let mut passing = Vec::new();
    for (ns, iface) in std::iter::once((topology.client(), CLIENT_IF)).chain(
        (0..WORKERS)
            .filter(|_| layout.mode == Mode::Remote)
            .map(|i| (topology.worker_ns(i), WORKER_IF)),
    ) {
        let name = iface.to_owned();
        let link = netns::run_in(ns, READY_BOUND, move || pass_everything(&name))?
            .with_context(|| format!("an XDP program on {iface} in {ns}"))?;
        passing.push(link);
    }

    let client = behind.as_ref().map_or(topology.client(), |ns| ns.name(0));
    let outcome = l4e2e::run_gateway(
        topology,
        |_, _| {},
        |gateway| {
            let driver = gateway.driver;
            driver
                .ready(READY_BOUND)
                .and_then(|()| transfer_and_check(topology, client, narrow, mtu, &driver))
        },
    );
    drop(passing);
    let deleted = behind.map_or(Ok(()), Namespaces::delete);
    outcome?;
    deleted
}

/// A namespace behind the topology's client namespace, which routes for
/// it (both families): the router's end of their link at `mtu`, the far
/// end at 1500, so the client behind advertises the larger MSS. The
/// balancer and the client behind route to each other through the router.
/// Deleted when dropped.
fn behind_router(topology: &Topology, mtu: u32) -> Result<Namespaces> {
    let (layout, router) = (topology.layout, topology.client());
    let namespaces = Namespaces::create("bt-l4mtub", 1)?;
    let behind = namespaces.name(0);
    for setting in ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"] {
        ns_exec(router, &["sysctl", "-qw", setting])?;
    }
    link(
        (behind, BEHIND_IF, BEHIND, 2),
        (router, ROUTER_IF, BEHIND, 1),
        layout.net,
    )?;
    set_mtu(router, ROUTER_IF, mtu)?;
    let family = match layout.family {
        Family::V4 => "-4",
        Family::V6 => "-6",
    };
    let via = layout.addr(BEHIND, 1).to_string();
    ns_exec(
        behind,
        &["ip", family, "route", "add", "default", "via", &via],
    )?;
    let (to, via) = (
        layout.addr(BEHIND, 2).to_string(),
        layout.client_ip().to_string(),
    );
    ns_exec(
        topology.balancer(),
        &["ip", family, "route", "add", &to, "via", &via],
    )?;
    Ok(namespaces)
}

fn set_mtu(ns: &str, iface: &str, mtu: u32) -> Result<()> {
    let mtu = mtu.to_string();
    ns_exec(ns, &["ip", "link", "set", "dev", iface, "mtu", &mtu])?;
    Ok(())
}

/// The transfer from `client` (a namespace) and what it must have taught
/// its sender.
fn transfer_and_check(
    topology: &Topology,
    client: &str,
    narrow: Narrow,
    mtu: u32,
    driver: &Driver,
) -> Result<()> {
    let layout = topology.layout;
    let vip = layout.vip();
    // Who sends the large segments, and toward which address its route
    // must learn the MTU (the worker's namespace is known once it answered).
    let learned = |worker: usize| -> (String, String) {
        match narrow {
            Narrow::Workers => (topology.client().to_owned(), vip.ip().to_string()),
            Narrow::Client => (
                topology.worker_ns(worker).to_owned(),
                layout.client_ip().to_string(),
            ),
            Narrow::BehindRouter => (
                topology.worker_ns(worker).to_owned(),
                layout.addr(BEHIND, 2).to_string(),
            ),
        }
    };
    let senders: BTreeSet<(String, String)> = (0..WORKERS).map(learned).collect();
    for (ns, to) in senders {
        let route = route_get(&ns, &to)?;
        ensure!(
            !route.contains(" mtu "),
            "{ns} knows a path MTU toward {to} before any transfer: {route}"
        );
    }

    let request = match narrow {
        Narrow::Workers => upload_request(),
        Narrow::Client | Narrow::BehindRouter => download_request(),
    };
    let started = Instant::now();
    // A little longer than the exchange's own bound, whose error says more.
    let answer = netns::run_in(client, TRANSFER_BOUND + Duration::from_secs(2), move || {
        exchange(vip, &request)
    })??;
    let took = started.elapsed();
    let worker = NAMES
        .iter()
        .position(|name| answer.worker == *name)
        .with_context(|| format!("answered by an unknown worker: {:?}", answer.worker))?;
    match narrow {
        Narrow::Workers => {
            let expected = format!("\"prompt_tokens\":{UPLOAD_WORDS},");
            ensure!(
                answer.body.contains(&expected),
                "the worker did not count the whole upload: {}",
                answer.body
            );
        }
        Narrow::Client | Narrow::BehindRouter => {
            let events = answer.body.matches("data: {").count();
            ensure!(
                events == DOWNLOAD_TOKENS
                    && answer.body.contains("data: [DONE]")
                    && answer
                        .body
                        .contains(&format!("\"completion_tokens\":{DOWNLOAD_TOKENS},")),
                "incomplete stream: {events} of {DOWNLOAD_TOKENS} events"
            );
        }
    }
    eprintln!(
        "{narrow:?}: {} bytes sent, {} received in {took:?} (worker {})",
        answer.sent,
        answer.body.len(),
        answer.worker
    );

    let (ns, to) = learned(worker);
    let route = route_get(&ns, &to)?;
    ensure!(
        route.contains(&format!(" mtu {mtu} ")),
        "{ns}'s route toward {to} did not learn the MTU {mtu}: {route}"
    );

    let metrics = driver.metrics()?;
    let outcome = |name: &str| metrics.outcome(name);
    // The balancer's own answers, or the router's errors it translated.
    let (counted, what) = match narrow {
        Narrow::Workers | Narrow::Client => ("frag_needed", "answered as too big"),
        Narrow::BehindRouter => ("icmp", "router errors translated"),
    };
    let (handled, unresolved) = (outcome(counted)?, outcome("unresolved")?);
    let steered = outcome("new_flow")? + outcome("established")? + outcome("reply")?;
    eprintln!(
        "{handled} {what}, {steered} packets steered, {unresolved} of them left to the kernel"
    );
    ensure!(handled > 0.0, "none {what} (outcome {counted})");
    ensure!(
        unresolved < steered / 100.0,
        "{unresolved} of {steered} steered packets were not redirected"
    );
    Ok(())
}

/// `ip route get` of `to` in namespace `ns`, on one line.
fn route_get(ns: &str, to: &str) -> Result<String> {
    let text = ns_exec(ns, &["ip", "-o", "route", "get", to])?;
    Ok(format!("{} ", text.trim()))
}

/// A completion whose prompt is [`UPLOAD_WORDS`] words; the worker answers
/// with how many it counted.
fn upload_request() -> Vec<u8> {
    let prompt = "w ".repeat(UPLOAD_WORDS);
    post(&format!(
        r#"{{"model":"demo-model","prompt":"{prompt}","max_tokens":1}}"#
    ))
}

/// A short request for a streamed completion of [`DOWNLOAD_TOKENS`] tokens.
fn download_request() -> Vec<u8> {
    post(&format!(
        r#"{{"model":"demo-model","prompt":"hi","max_tokens":{DOWNLOAD_TOKENS},"stream":true}}"#
    ))
}

fn post(body: &str) -> Vec<u8> {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: vip\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// What came back on one connection.
struct Answer {
    /// Bytes of the request.
    sent: usize,
    /// The `x-mock-worker` header.
    worker: String,
    /// Everything after the head (chunked framing included).
    body: String,
}

/// Sends `request` on a new connection to `vip` and reads until the worker
/// closes it, within [`TRANSFER_BOUND`] in all.
fn exchange(vip: SocketAddr, request: &[u8]) -> Result<Answer> {
    let deadline = Instant::now() + TRANSFER_BOUND;
    let mut stream = TcpStream::connect_timeout(&vip, TRANSFER_BOUND)
        .with_context(|| format!("connecting to {vip}"))?;
    stream.set_write_timeout(Some(TRANSFER_BOUND))?;
    stream.write_all(request).context("sending the request")?;
    let mut received = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let read = if left.is_zero() {
            Err(ErrorKind::TimedOut.into())
        } else {
            stream.set_read_timeout(Some(left))?;
            stream.read(&mut buf)
        };
        match read {
            Ok(0) => break,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            // See `balancer_tests::http1::chat`: signals interrupt reads.
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                bail!(
                    "{} bytes received within {TRANSFER_BOUND:?}, the answer goes on",
                    received.len()
                );
            }
            Err(e) => {
                return Err(e).with_context(|| format!("after {} bytes", received.len()));
            }
        }
    }
    let text = String::from_utf8(received).context("the answer is not UTF-8")?;
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("no complete head in {text:?}");
    };
    ensure!(
        head.starts_with("HTTP/1.1 200 "),
        "not a 200: {head:?} {body:?}"
    );
    let worker = head
        .lines()
        .find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case("x-mock-worker")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    Ok(Answer {
        sent: request.len(),
        worker,
        body: body.to_owned(),
    })
}

/// Attaches an XDP program that passes every frame (in the driver's mode)
/// to `iface` of the calling thread's namespace; it stays attached while
/// the returned link is open.
#[allow(unsafe_code)]
fn pass_everything(iface: &str) -> Result<OwnedFd> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_LINK_CREATE: libc::c_long = 28;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    const BPF_XDP: u32 = 37;
    const XDP_PASS: u8 = 2;
    /// The head of `bpf_attr` for `BPF_PROG_LOAD` (no padding).
    #[repr(C)]
    #[derive(Default)]
    struct ProgLoad {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
        prog_name: [u8; 16],
        prog_ifindex: u32,
        expected_attach_type: u32,
    }
    /// The head of `bpf_attr` for `BPF_LINK_CREATE`.
    #[repr(C)]
    struct LinkCreate {
        prog_fd: u32,
        target_ifindex: u32,
        attach_type: u32,
        flags: u32,
    }
    // r0 = XDP_PASS; exit.
    let insns = [
        u64::from_le_bytes([0xb7, 0, 0, 0, XDP_PASS, 0, 0, 0]),
        u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0]),
    ];
    let license = c"GPL";
    let load = ProgLoad {
        prog_type: BPF_PROG_TYPE_XDP,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type: BPF_XDP,
        ..ProgLoad::default()
    };
    // SAFETY: `load` is whole, and its pointers outlive the call.
    let prog = unsafe { bpf(BPF_PROG_LOAD, &load) }.context("loading")?;
    let name = CString::new(iface)?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    ensure!(ifindex != 0, "no interface {iface}");
    let create = LinkCreate {
        prog_fd: std::os::fd::AsRawFd::as_raw_fd(&prog) as u32,
        target_ifindex: ifindex,
        attach_type: BPF_XDP,
        // The device's own mode: native on a veth.
        flags: 0,
    };
    // SAFETY: `create` is whole and holds no pointers. The link holds the
    // program from here.
    unsafe { bpf(BPF_LINK_CREATE, &create) }.context("attaching")
}

/// The `bpf` system call `cmd` with `attr`: the descriptor it returns.
///
/// # Safety
/// `attr` is a whole, initialised head of `bpf_attr` for `cmd` (no
/// padding), and its pointers are valid for the call.
#[allow(unsafe_code)]
unsafe fn bpf<T>(cmd: libc::c_long, attr: &T) -> Result<OwnedFd> {
    // SAFETY: the caller's promise; the size passed is `attr`'s own.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *const T, size_of::<T>()) };
    ensure!(fd >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: the kernel just returned this descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

//! The XDP program attached through the agent's own loader to a veth inside
//! a private network namespace, with real traffic from a second namespace.
//!
//! Every address used here exists only inside the two namespaces the test
//! creates; nothing is sent anywhere else.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use balancer_common::Verdict;
use balancer_dataplane::{Dataplane, DataplaneError, VerdictCounts, XdpMode};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::netns::{self, Namespaces, run};

/// The interface the program is attached to (in the first namespace) and
/// its peer (in the second).
const XDP_IF: &str = "lb0";
const PEER_IF: &str = "peer0";
const SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 1);
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 2);
// Loading verifies every program (over a million instructions together),
// which a loaded machine (a CI run's parallel tests) stretches past 10 s.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

#[test]
fn attached_program_counts_real_traffic_and_detaches_cleanly() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let namespaces = Namespaces::create("bt-xdp", 2).expect("creating namespaces");
    let names = [namespaces.name(0).to_owned(), namespaces.name(1).to_owned()];

    let outcome = exercise(&object, &names[0], &names[1]);
    let deleted = namespaces.delete();
    outcome.unwrap_or_else(|error| panic!("{error:#}"));
    deleted.expect("deleting the namespaces");
    for name in &names {
        assert!(
            !netns::exists(name).expect("listing namespaces"),
            "namespace {name} still exists after cleanup"
        );
    }
}

fn exercise(object: &std::path::Path, server_ns: &str, client_ns: &str) -> Result<()> {
    connect_veth(server_ns, client_ns)?;

    let object = object.to_owned();
    let (mut dataplane, mode) = netns::run_in(server_ns, STEP_TIMEOUT, move || -> Result<_> {
        let mut dataplane = Dataplane::load(&object)?;
        let missing = dataplane.attach("missing0", XdpMode::Auto);
        ensure!(
            matches!(missing, Err(DataplaneError::Attach { .. })) && dataplane.attached().is_none(),
            "attaching to a missing interface: {missing:?}"
        );
        let mode = dataplane.attach(XDP_IF, XdpMode::Auto)?;
        Ok((dataplane, mode))
    })?
    .context("loading and attaching through Dataplane")?;
    // veth supports native XDP, so Auto must not have fallen back.
    ensure!(mode == XdpMode::Driver, "attached in {mode:?} mode");
    ensure!(
        xdp_shown(server_ns)?,
        "`ip link` shows no XDP program on {XDP_IF} after attach"
    );

    let before = dataplane.verdict_counts()?;
    send_traffic(server_ns, client_ns)?;
    let moved = wait_for_counts(&dataplane, &before)?;
    eprintln!("verdict deltas: {moved:?}");
    // The handshake's SYN, then at least its ACK, the data and the FIN.
    ensure!(moved.get(Verdict::TcpSyn) >= 1, "no SYN counted: {moved:?}");
    ensure!(
        moved.get(Verdict::TcpOther) >= 3,
        "too few other TCP segments: {moved:?}"
    );
    ensure!(
        moved.get(Verdict::PassNotTcp) >= 1,
        "UDP datagram not counted: {moved:?}"
    );
    // ARP resolution of the server's address, at the latest for the SYN.
    ensure!(
        moved.get(Verdict::PassNotIpv4) >= 1,
        "ARP not counted: {moved:?}"
    );
    for verdict in [
        Verdict::PassTruncated,
        Verdict::PassMalformed,
        Verdict::PassFragment,
    ] {
        ensure!(
            moved.get(verdict) == 0,
            "unexpected {}: {moved:?}",
            verdict.name()
        );
    }

    // Netlink-based detach resolves the interface in the calling thread's
    // namespace, so detach from inside the server namespace too.
    let dataplane = netns::run_in(server_ns, STEP_TIMEOUT, move || {
        dataplane.detach().map(|()| dataplane)
    })??;
    ensure!(dataplane.attached().is_none(), "still marked attached");
    ensure!(
        !xdp_shown(server_ns)?,
        "`ip link` still shows an XDP program on {XDP_IF} after detach"
    );
    drop(dataplane);
    Ok(())
}

/// `--xdp-mode auto` on an interface whose driver has no native XDP (the
/// namespace's loopback; this kernel has no dummy driver): the program
/// runs in generic mode, as `ip link` shows
/// (`xdpgeneric`); `--xdp-mode driver` there is refused.
#[test]
fn auto_mode_falls_back_to_generic_where_the_driver_has_no_native_xdp() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let namespaces = Namespaces::create("bt-xdpgen", 1).expect("creating the namespace");
    let ns = namespaces.name(0).to_owned();
    let outcome = (|| -> Result<()> {
        let (mut dataplane, refused, mode) = netns::run_in(&ns, STEP_TIMEOUT, move || {
            let mut dataplane = Dataplane::load(&object)?;
            let refused = dataplane.attach("lo", XdpMode::Driver).is_err();
            let mode = dataplane.attach("lo", XdpMode::Auto)?;
            anyhow::Ok((dataplane, refused, mode))
        })??;
        ensure!(refused, "native mode attached on the loopback");
        ensure!(mode == XdpMode::Skb, "auto attached in {mode:?} mode");
        let link = run("ip", &["-n", &ns, "link", "show", "dev", "lo"])?;
        ensure!(link.contains("xdpgeneric"), "`ip link` shows: {link}");
        netns::run_in(&ns, STEP_TIMEOUT, move || dataplane.detach())??;
        let link = run("ip", &["-n", &ns, "link", "show", "dev", "lo"])?;
        ensure!(!link.contains("xdp"), "still attached: {link}");
        Ok(())
    })();
    let deleted = namespaces.delete();
    outcome.unwrap_or_else(|error| panic!("{error:#}"));
    deleted.expect("deleting the namespace");
}

fn connect_veth(server_ns: &str, client_ns: &str) -> Result<()> {
    run(
        "ip",
        &[
            "link", "add", XDP_IF, "netns", server_ns, "type", "veth", "peer", "name", PEER_IF,
            "netns", client_ns,
        ],
    )?;
    for (ns, iface, ip) in [
        (server_ns, XDP_IF, SERVER_IP),
        (client_ns, PEER_IF, CLIENT_IP),
    ] {
        run(
            "ip",
            &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", iface],
        )?;
        run("ip", &["-n", ns, "link", "set", iface, "up"])?;
    }
    Ok(())
}

/// Whether `ip link` reports an XDP program on the interface: an attached
/// one shows up as an `xdp`/`xdpgeneric` flag and a `prog/xdp id N` line.
fn xdp_shown(ns: &str) -> Result<bool> {
    let link = run("ip", &["-n", ns, "link", "show", "dev", XDP_IF])?;
    Ok(link
        .split_whitespace()
        .any(|word| word.starts_with("xdp") || word.starts_with("prog/xdp")))
}

/// A TCP echo exchange and a UDP datagram from the client namespace to the
/// server namespace, all of it crossing the veth the program sits on.
fn send_traffic(server_ns: &str, client_ns: &str) -> Result<()> {
    let (listener, udp_server) = netns::run_in(server_ns, STEP_TIMEOUT, || -> Result<_> {
        Ok((
            TcpListener::bind((SERVER_IP, 0))?,
            UdpSocket::bind((SERVER_IP, 0))?,
        ))
    })??;
    let tcp_addr = listener.local_addr()?;
    let udp_addr = udp_server.local_addr()?;
    let echo = std::thread::spawn(move || echo_once(listener));

    let reply = netns::run_in(client_ns, STEP_TIMEOUT, move || -> Result<Vec<u8>> {
        let mut stream = TcpStream::connect_timeout(&tcp_addr, IO_TIMEOUT)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.write_all(b"ping")?;
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply)?;

        let udp = UdpSocket::bind(SocketAddrV4::new(CLIENT_IP, 0))?;
        udp.send_to(b"datagram", udp_addr)?;
        Ok(reply)
    })??;
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    ensure!(reply == b"ping", "echo returned {reply:?}");

    udp_server.set_read_timeout(Some(IO_TIMEOUT))?;
    let mut buf = [0; 16];
    let (len, from) = udp_server
        .recv_from(&mut buf)
        .context("receiving the datagram")?;
    ensure!(
        &buf[..len] == b"datagram" && from.ip() == IpAddr::V4(CLIENT_IP),
        "unexpected datagram {:?} from {from}",
        &buf[..len]
    );
    Ok(())
}

fn echo_once(listener: TcpListener) -> Result<()> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    bail!("no connection within {IO_TIMEOUT:?}");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(error) => return Err(error.into()),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    let mut request = Vec::new();
    stream.read_to_end(&mut request)?;
    stream.write_all(&request)?;
    Ok(())
}

/// Counters after the traffic, waiting briefly for the last segments
/// (the final ACK can trail the client's return).
fn wait_for_counts(dataplane: &Dataplane, before: &VerdictCounts) -> Result<VerdictCounts> {
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let moved = dataplane.verdict_counts()?.since(before);
        let complete = moved.get(Verdict::TcpSyn) >= 1
            && moved.get(Verdict::TcpOther) >= 3
            && moved.get(Verdict::PassNotTcp) >= 1
            && moved.get(Verdict::PassNotIpv4) >= 1;
        if complete || Instant::now() > deadline {
            return Ok(moved);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

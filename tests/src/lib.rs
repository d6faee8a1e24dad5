//! Helpers shared by the end-to-end tests.

pub mod gateway;

use std::path::PathBuf;

/// The eBPF object for tests that load the XDP program, or `None` after
/// printing why the calling test is skipped.
///
/// Those tests need root (loading programs, creating namespaces) and a
/// built object. Without root they skip. Without the object they skip too,
/// except under CI (env `CI` set), where a missing object means the pipeline
/// forgot `cargo xtask build-ebpf` and the test fails.
pub fn ebpf_prerequisites() -> Option<PathBuf> {
    // SAFETY: geteuid cannot fail and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        skip("needs root to load eBPF programs and create network namespaces");
        return None;
    }
    match balancer::dataplane::locate_object(None) {
        Ok(object) => Some(object),
        Err(error) if std::env::var_os("CI").is_some() => {
            panic!("CI is set and the eBPF object is missing: {error}")
        }
        Err(error) => {
            skip(&error.to_string());
            None
        }
    }
}

fn skip(reason: &str) {
    eprintln!("\n*** SKIPPED: {reason} ***\n");
}

/// Builders for the raw frames fed to `BPF_PROG_TEST_RUN`.
///
/// Checksums are computed properly even where the current program does not
/// look at them, so the same frames keep working once it rewrites packets.
pub mod packet {
    use std::net::{Ipv4Addr, SocketAddrV4};

    pub const ETHERTYPE_IPV4: u16 = 0x0800;
    pub const ETHERTYPE_ARP: u16 = 0x0806;
    pub const ETHERTYPE_IPV6: u16 = 0x86dd;
    pub const PROTO_TCP: u8 = 6;
    pub const PROTO_UDP: u8 = 17;
    pub const TCP_FIN: u8 = 0x01;
    pub const TCP_SYN: u8 = 0x02;
    pub const TCP_ACK: u8 = 0x10;
    /// Offset of the IPv4 header in an Ethernet frame.
    pub const IPV4_OFFSET: usize = 14;
    /// IPv4 "more fragments" flag, in the flags/fragment-offset field.
    pub const MORE_FRAGMENTS: u16 = 0x2000;

    /// An Ethernet II frame between two fixed locally administered MACs.
    pub fn ethernet(ether_type: u16, payload: &[u8]) -> Vec<u8> {
        let mut frame = Vec::with_capacity(IPV4_OFFSET + payload.len());
        frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]);
        frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]);
        frame.extend_from_slice(&ether_type.to_be_bytes());
        frame.extend_from_slice(payload);
        frame
    }

    /// An IPv4 header, written out around a transport payload by [`Ipv4::packet`].
    #[derive(Clone, Debug)]
    pub struct Ipv4 {
        pub src: Ipv4Addr,
        pub dst: Ipv4Addr,
        pub protocol: u8,
        /// Flags and fragment offset (in 8-byte units), as on the wire.
        pub flags_fragment: u16,
        /// Options, padded by the caller to a multiple of 4 bytes.
        pub options: Vec<u8>,
    }

    impl Ipv4 {
        pub fn new(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8) -> Self {
            Self {
                src,
                dst,
                protocol,
                flags_fragment: 0,
                options: Vec::new(),
            }
        }

        pub fn packet(&self, payload: &[u8]) -> Vec<u8> {
            assert!(self.options.len().is_multiple_of(4) && self.options.len() <= 40);
            let header_len = 20 + self.options.len();
            let total_len = u16::try_from(header_len + payload.len()).expect("packet fits IPv4");
            let mut packet = Vec::with_capacity(usize::from(total_len));
            packet.push(0x40 | (header_len / 4) as u8);
            packet.push(0);
            packet.extend_from_slice(&total_len.to_be_bytes());
            packet.extend_from_slice(&0x1234u16.to_be_bytes());
            packet.extend_from_slice(&self.flags_fragment.to_be_bytes());
            packet.push(64);
            packet.push(self.protocol);
            packet.extend_from_slice(&[0, 0]);
            packet.extend_from_slice(&self.src.octets());
            packet.extend_from_slice(&self.dst.octets());
            packet.extend_from_slice(&self.options);
            let checksum = internet_checksum(&packet, 0);
            packet[10..12].copy_from_slice(&checksum.to_be_bytes());
            packet.extend_from_slice(payload);
            packet
        }
    }

    /// A TCP segment without payload or options.
    pub fn tcp(src: SocketAddrV4, dst: SocketAddrV4, flags: u8) -> Vec<u8> {
        let mut segment = Vec::with_capacity(20);
        segment.extend_from_slice(&src.port().to_be_bytes());
        segment.extend_from_slice(&dst.port().to_be_bytes());
        segment.extend_from_slice(&1u32.to_be_bytes());
        let ack = if flags & TCP_ACK != 0 { 1u32 } else { 0 };
        segment.extend_from_slice(&ack.to_be_bytes());
        segment.push(5 << 4);
        segment.push(flags);
        segment.extend_from_slice(&64240u16.to_be_bytes());
        segment.extend_from_slice(&[0, 0, 0, 0]);
        let checksum = transport_checksum(*src.ip(), *dst.ip(), PROTO_TCP, &segment);
        segment[16..18].copy_from_slice(&checksum.to_be_bytes());
        segment
    }

    pub fn udp(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
        let len = u16::try_from(8 + payload.len()).expect("datagram fits UDP");
        let mut datagram = Vec::with_capacity(usize::from(len));
        datagram.extend_from_slice(&src.port().to_be_bytes());
        datagram.extend_from_slice(&dst.port().to_be_bytes());
        datagram.extend_from_slice(&len.to_be_bytes());
        datagram.extend_from_slice(&[0, 0]);
        datagram.extend_from_slice(payload);
        let checksum = transport_checksum(*src.ip(), *dst.ip(), PROTO_UDP, &datagram);
        datagram[6..8].copy_from_slice(&checksum.to_be_bytes());
        datagram
    }

    /// A whole Ethernet + IPv4 + TCP frame.
    pub fn tcp_frame(src: SocketAddrV4, dst: SocketAddrV4, flags: u8) -> Vec<u8> {
        let ip = Ipv4::new(*src.ip(), *dst.ip(), PROTO_TCP);
        ethernet(ETHERTYPE_IPV4, &ip.packet(&tcp(src, dst, flags)))
    }

    /// A whole Ethernet + IPv4 + UDP frame.
    pub fn udp_frame(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
        let ip = Ipv4::new(*src.ip(), *dst.ip(), PROTO_UDP);
        ethernet(ETHERTYPE_IPV4, &ip.packet(&udp(src, dst, payload)))
    }

    /// The TCP/UDP ports of an IPv4 frame, as (source, destination).
    pub fn endpoints(frame: &[u8]) -> (SocketAddrV4, SocketAddrV4) {
        let ip = &frame[IPV4_OFFSET..];
        let l4 = &ip[usize::from(ip[0] & 0x0f) * 4..];
        let addr = |at: usize| Ipv4Addr::new(ip[at], ip[at + 1], ip[at + 2], ip[at + 3]);
        let port = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
        (
            SocketAddrV4::new(addr(12), port(0)),
            SocketAddrV4::new(addr(16), port(2)),
        )
    }

    /// The IPv4 TTL of a frame.
    pub fn ttl(frame: &[u8]) -> u8 {
        frame[IPV4_OFFSET + 8]
    }

    /// Whether both the IPv4 header checksum and the TCP checksum of a
    /// TCP frame verify (sum to zero with the checksum included).
    pub fn checksums_verify(frame: &[u8]) -> bool {
        let ip = &frame[IPV4_OFFSET..];
        let header_len = usize::from(ip[0] & 0x0f) * 4;
        let total_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        let (src, dst) = endpoints(frame);
        internet_checksum(&ip[..header_len], 0) == 0
            && transport_checksum(*src.ip(), *dst.ip(), ip[9], &ip[header_len..total_len]) == 0
    }

    fn transport_checksum(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, segment: &[u8]) -> u16 {
        let mut pseudo = Vec::with_capacity(12);
        pseudo.extend_from_slice(&src.octets());
        pseudo.extend_from_slice(&dst.octets());
        pseudo.push(0);
        pseudo.push(protocol);
        let len = u16::try_from(segment.len()).expect("segment fits IPv4");
        pseudo.extend_from_slice(&len.to_be_bytes());
        internet_checksum(segment, sum_words(&pseudo))
    }

    /// RFC 1071 checksum of `data`, continuing from a partial `sum`.
    fn internet_checksum(data: &[u8], sum: u32) -> u16 {
        let mut sum = sum + sum_words(data);
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    fn sum_words(data: &[u8]) -> u32 {
        data.chunks(2)
            .map(|pair| u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)])))
            .sum()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn ipv4_header_checksum_verifies() {
            let packet = Ipv4::new(
                Ipv4Addr::new(192, 0, 2, 1),
                Ipv4Addr::new(192, 0, 2, 2),
                PROTO_TCP,
            )
            .packet(&[]);
            // Summing a header that includes its own checksum gives zero.
            assert_eq!(internet_checksum(&packet, 0), 0);
        }

        #[test]
        fn tcp_checksum_verifies() {
            let src = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40000);
            let dst = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 80);
            let segment = tcp(src, dst, TCP_SYN);
            assert_eq!(
                transport_checksum(*src.ip(), *dst.ip(), PROTO_TCP, &segment),
                0
            );
        }
    }
}

/// Network namespaces for tests: created with unique names, removed on
/// every exit path, with a bounded wait on everything that touches them.
pub mod netns {
    use std::fs::File;
    use std::os::fd::AsRawFd;
    use std::process::{Command, Stdio};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, bail};

    /// How long a single `ip`/`ethtool` invocation may take.
    const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

    /// Network namespaces that are deleted when the value is dropped.
    pub struct Namespaces {
        names: Vec<String>,
    }

    impl Namespaces {
        /// Creates `count` namespaces named `<prefix>-<pid>-<n>-<i>`, with
        /// `lo` up in each.
        pub fn create(prefix: &str, count: usize) -> Result<Self> {
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let batch = NEXT.fetch_add(1, Ordering::Relaxed);
            let mut namespaces = Self { names: Vec::new() };
            for i in 0..count {
                let name = format!("{prefix}-{}-{batch}-{i}", std::process::id());
                run("ip", &["netns", "add", &name])?;
                // Pushed right away so a failure below still deletes it.
                namespaces.names.push(name.clone());
                run("ip", &["-n", &name, "link", "set", "lo", "up"])?;
            }
            Ok(namespaces)
        }

        pub fn name(&self, index: usize) -> &str {
            &self.names[index]
        }

        /// Deletes the namespaces now, reporting failures (dropping the
        /// value does the same but can only print them).
        pub fn delete(mut self) -> Result<()> {
            let names = std::mem::take(&mut self.names);
            let mut failures = Vec::new();
            for name in &names {
                if let Err(error) = run("ip", &["netns", "del", name]) {
                    failures.push(format!("{error:#}"));
                }
            }
            if !failures.is_empty() {
                bail!("deleting namespaces: {}", failures.join("; "));
            }
            Ok(())
        }
    }

    impl Drop for Namespaces {
        fn drop(&mut self) {
            for name in &self.names {
                if let Err(error) = run("ip", &["netns", "del", name]) {
                    eprintln!("cleanup: {error:#}");
                }
            }
        }
    }

    /// Whether a namespace of that name is registered (`ip netns list`).
    pub fn exists(name: &str) -> Result<bool> {
        let listing = run("ip", &["netns", "list"])?;
        Ok(listing
            .lines()
            .any(|line| line.split_whitespace().next() == Some(name)))
    }

    /// Runs `f` on a new thread that has joined namespace `name`, and
    /// returns its result, or fails after `timeout`.
    ///
    /// Sockets opened inside `f` stay in that namespace wherever they are
    /// used afterwards, so `f` can hand them back.
    pub fn run_in<T, F>(name: &str, timeout: Duration, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let path = format!("/var/run/netns/{name}");
        let namespace = File::open(&path).with_context(|| format!("opening {path}"))?;
        let (done, result) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("netns-{name}"))
            .spawn(move || {
                // SAFETY: setns on a valid namespace fd only changes this
                // thread's network namespace.
                if unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    let _ = done.send(Err(std::io::Error::last_os_error()));
                    return;
                }
                let _ = done.send(Ok(f()));
            })
            .context("spawning a namespace thread")?;
        match result.recv_timeout(timeout) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(error).with_context(|| format!("entering namespace {name}")),
            Err(_) => bail!("work in namespace {name} did not finish within {timeout:?}"),
        }
    }

    /// Runs a command to completion within a fixed timeout and returns its
    /// stdout; a non-zero exit or a timeout is an error carrying stderr.
    pub fn run(program: &str, args: &[&str]) -> Result<String> {
        let shown = format!("{program} {}", args.join(" "));
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!("starting `{shown}` (is it installed? `cargo xtask setup`)")
            })?;
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        while child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("`{shown}` did not finish within {COMMAND_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The outputs of these commands are small enough to sit in the pipe
        // buffers until the process has exited.
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!(
                "`{shown}` failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}

/// An L4 service programmed straight into the maps, the way the agent
/// would, for tests and benchmarks that drive the programs through
/// `BPF_PROG_TEST_RUN` without a registry.
pub mod l4 {
    use std::net::SocketAddrV4;
    use std::path::Path;

    use std::net::Ipv4Addr;

    use anyhow::{Context, Result};
    use balancer::dataplane::l4::{ServiceState, backend_at};
    use balancer::dataplane::maglev::{self, Member};
    use balancer::dataplane::{Dataplane, L4Maps, LoadOptions};
    use balancer_common::l4::{
        BackendState, FLAG_REMOTE, PORT_REPLY_EGRESS, PORT_REPLY_INGRESS, PORT_SERVICE,
    };

    use crate::netns::{Namespaces, run};

    /// A small prime: tables stay quick to write, and Maglev's shares are
    /// still within a few percent for a handful of backends.
    pub const TABLE_SIZE: u32 = 1009;

    /// One service at `vip` over `backends` (backend `i` in slot `i`).
    pub struct Steered {
        pub dataplane: Dataplane,
        pub maps: L4Maps,
        pub service: ServiceState,
        pub backends: Vec<SocketAddrV4>,
        states: Vec<BackendState>,
    }

    impl Steered {
        pub fn load(
            object: &Path,
            vip: SocketAddrV4,
            backends: &[SocketAddrV4],
            remote: bool,
        ) -> Result<Self> {
            Self::load_sized(object, vip, backends, remote, 1 << 16)
        }

        /// [`Steered::load`] with a connection table of `conntrack_size`.
        pub fn load_sized(
            object: &Path,
            vip: SocketAddrV4,
            backends: &[SocketAddrV4],
            remote: bool,
            conntrack_size: u32,
        ) -> Result<Self> {
            let mut dataplane = Dataplane::load_with(
                object,
                LoadOptions {
                    table_size: TABLE_SIZE,
                    services: 1,
                    conntrack_size,
                },
            )
            .context("loading the programs")?;
            let maps = dataplane.take_l4_maps()?;
            maps.set_generation(1)?;
            let service = maps.add_service(vip, 0, if remote { FLAG_REMOTE } else { 0 })?;
            maps.set_port_bits(vip.port(), PORT_SERVICE)?;
            let reply = if remote {
                PORT_REPLY_INGRESS
            } else {
                PORT_REPLY_EGRESS
            };
            for (i, backend) in backends.iter().enumerate() {
                // A backend on the service's port shares its bits.
                let bits = if backend.port() == vip.port() {
                    PORT_SERVICE | reply
                } else {
                    reply
                };
                maps.set_port_bits(backend.port(), bits)?;
                maps.set_backend_state(i as u32, *backend, BackendState::Routable)?;
            }
            let mut steered = Self {
                dataplane,
                maps,
                service,
                backends: backends.to_vec(),
                states: vec![BackendState::Routable; backends.len()],
            };
            steered.rebuild()?;
            Ok(steered)
        }

        /// Flips backend `i`'s state bit only, leaving the table stale, as
        /// the agent does right after a transition.
        pub fn set_state(&mut self, i: usize, state: BackendState) -> Result<()> {
            self.states[i] = state;
            self.maps
                .set_backend_state(i as u32, self.backends[i], state)?;
            Ok(())
        }

        /// Rebuilds the table over the routable backends, as the agent's
        /// table thread does after a transition.
        pub fn rebuild(&mut self) -> Result<()> {
            let members: Vec<Member> = (0..self.backends.len())
                .filter(|&i| self.states[i] == BackendState::Routable)
                .map(|i| {
                    let b = backend_at(self.backends[i], BackendState::Routable);
                    Member {
                        index: i as u32,
                        key: maglev::member_key(b.addr, b.port),
                    }
                })
                .collect();
            let table = maglev::build(&members, TABLE_SIZE);
            let all: Vec<u32> = (0..self.backends.len() as u32).collect();
            self.maps.update_service(&mut self.service, &all, &table)?;
            Ok(())
        }

        /// Which backend `addr` is.
        pub fn backend_of(&self, addr: SocketAddrV4) -> Option<usize> {
            self.backends.iter().position(|b| *b == addr)
        }
    }

    /// A namespace standing in for a balancer host in remote mode, for test
    /// runs whose route lookups must be real: the client-facing veth `lbc`
    /// (10.99.1.1/24) and the backend-facing one `lbw` (10.99.2.1/24) are
    /// the two ends of one pair, and the client and backends exist only as
    /// permanent neighbour entries. Forwarding is on.
    pub struct Router {
        pub client_if: u32,
        pub backend_if: u32,
        pub client_if_mac: [u8; 6],
        pub backend_if_mac: [u8; 6],
    }

    impl Router {
        pub const CLIENT_IF: &str = "lbc";
        pub const BACKEND_IF: &str = "lbw";
        pub const CLIENT_MAC: [u8; 6] = [0x02, 0xcc, 0, 0, 0, 0x02];
        pub const BACKEND_MAC: [u8; 6] = [0x02, 0xbb, 0, 0, 0, 0x0b];

        /// The namespace (deleted when dropped) and its interfaces. `client`
        /// must be in 10.99.1.0/24 and `backends` in 10.99.2.0/24.
        pub fn create(
            prefix: &str,
            client: Ipv4Addr,
            backends: &[Ipv4Addr],
        ) -> Result<(Namespaces, Router)> {
            let ns = Namespaces::create(prefix, 1)?;
            let name = ns.name(0).to_owned();
            let ip = |args: &[&str]| {
                let mut all = vec!["-n", name.as_str()];
                all.extend_from_slice(args);
                run("ip", &all)
            };
            let mac = |bytes: [u8; 6]| bytes.map(|b| format!("{b:02x}")).join(":");
            let (client_if, backend_if) = (Self::CLIENT_IF, Self::BACKEND_IF);
            ip(&[
                "link", "add", client_if, "type", "veth", "peer", "name", backend_if,
            ])?;
            ip(&["addr", "add", "10.99.1.1/24", "dev", client_if])?;
            ip(&["addr", "add", "10.99.2.1/24", "dev", backend_if])?;
            for iface in [client_if, backend_if] {
                ip(&["link", "set", iface, "up"])?;
            }
            let neighbour = |addr: Ipv4Addr, lladdr: [u8; 6], dev: &str| {
                let (addr, lladdr) = (addr.to_string(), mac(lladdr));
                ip(&[
                    "neigh",
                    "replace",
                    &addr,
                    "lladdr",
                    &lladdr,
                    "dev",
                    dev,
                    "nud",
                    "permanent",
                ])
            };
            neighbour(client, Self::CLIENT_MAC, client_if)?;
            for backend in backends {
                neighbour(*backend, Self::BACKEND_MAC, backend_if)?;
            }
            run(
                "ip",
                &[
                    "netns",
                    "exec",
                    &name,
                    "sysctl",
                    "-qw",
                    "net.ipv4.ip_forward=1",
                ],
            )?;
            let router = Router {
                client_if: ifindex(&name, client_if)?,
                backend_if: ifindex(&name, backend_if)?,
                client_if_mac: link_mac(&name, client_if)?,
                backend_if_mac: link_mac(&name, backend_if)?,
            };
            Ok((ns, router))
        }
    }

    /// The index of interface `iface` in namespace `ns`.
    pub fn ifindex(ns: &str, iface: &str) -> Result<u32> {
        let text = run("ip", &["-n", ns, "-o", "link", "show", "dev", iface])?;
        text.split(':')
            .next()
            .and_then(|n| n.trim().parse().ok())
            .with_context(|| format!("no ifindex in {text:?}"))
    }

    /// The MAC address of interface `iface` in namespace `ns`.
    pub fn link_mac(ns: &str, iface: &str) -> Result<[u8; 6]> {
        let text = run("ip", &["-n", ns, "-o", "link", "show", "dev", iface])?;
        let word = text
            .split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .with_context(|| format!("no MAC in {text:?}"))?;
        let mut mac = [0; 6];
        for (slot, part) in mac.iter_mut().zip(word.split(':')) {
            *slot = u8::from_str_radix(part, 16)?;
        }
        Ok(mac)
    }
}

/// Raw HTTP/1.1 exchanges with a worker through the XDP path: plain
/// blocking sockets, so that a test controls exactly which TCP connection
/// each request takes.
pub mod http1 {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    use anyhow::{Context, Result, bail};

    pub const CHAT: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#;
    const IO_TIMEOUT: Duration = Duration::from_secs(5);

    /// What came back: the status and the `x-mock-worker` header (which
    /// worker answered).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Answer {
        pub status: u16,
        pub worker: String,
    }

    /// Opens a connection to `addr`.
    pub fn connect(addr: SocketAddr) -> Result<TcpStream> {
        let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(stream)
    }

    /// One chat completion on `stream`; `close` asks the server to close the
    /// connection after it.
    pub fn chat(stream: &mut TcpStream, close: bool) -> Result<Answer> {
        let connection = if close { "close" } else { "keep-alive" };
        write!(
            stream,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: vip\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: {connection}\r\n\r\n{CHAT}",
            CHAT.len()
        )?;
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte)? == 0 {
                bail!(
                    "connection closed inside the response head: {:?}",
                    String::from_utf8_lossy(&head)
                );
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        let status = head
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
            .with_context(|| format!("not an HTTP/1.1 response: {head:?}"))?;
        let header = |name: &str| {
            head.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                key.eq_ignore_ascii_case(name)
                    .then(|| value.trim().to_owned())
            })
        };
        let length: usize = header("content-length")
            .context("no content-length")?
            .parse()?;
        let mut body = vec![0; length];
        stream.read_exact(&mut body)?;
        Ok(Answer {
            status,
            worker: header("x-mock-worker").unwrap_or_default(),
        })
    }

    /// `count` requests, each on a new connection (`Connection: close`).
    pub fn new_connections(addr: SocketAddr, count: usize) -> Result<Vec<Answer>> {
        (0..count)
            .map(|i| {
                let mut stream = connect(addr)?;
                chat(&mut stream, true).with_context(|| format!("connection {i} to {addr}"))
            })
            .collect()
    }
}

/// A tokio runtime whose threads live in a network namespace: everything it
/// runs (listeners, connections) is inside it.
pub mod ns_runtime {
    use std::future::Future;
    use std::net::SocketAddr;
    use std::time::Duration;

    use anyhow::{Context, Result};
    use balancer::mock_worker::{MockWorker, MockWorkerConfig};
    use tokio::runtime::Runtime;

    use crate::netns;

    /// The longest a test waits for one task on a namespace's runtime.
    pub const RUN_BOUND: Duration = Duration::from_secs(120);

    pub struct NsRuntime {
        runtime: Option<Runtime>,
    }

    impl NsRuntime {
        /// Builds the runtime on a thread inside `ns`: its worker threads are
        /// started from there and stay in that namespace.
        pub fn new(ns: &str) -> Result<Self> {
            let runtime = netns::run_in(ns, Duration::from_secs(10), || {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
            })??;
            Ok(Self {
                runtime: Some(runtime),
            })
        }

        /// Runs `future` on the runtime's threads (not the caller's, which
        /// may be in another namespace) and waits for it, for at most
        /// [`RUN_BOUND`].
        pub fn run<F>(&self, future: F) -> Result<F::Output>
        where
            F: Future + Send + 'static,
            F::Output: Send + 'static,
        {
            let runtime = self.runtime.as_ref().expect("runtime present until drop");
            let task = runtime.spawn(future);
            runtime
                .block_on(async { tokio::time::timeout(RUN_BOUND, task).await })
                .with_context(|| {
                    format!("task on the namespace's runtime took over {RUN_BOUND:?}")
                })?
                .context("task on the namespace's runtime")
        }

        /// A demo worker listening on `addr` inside the namespace.
        pub fn worker(&self, addr: SocketAddr, name: &str) -> Result<MockWorker> {
            let config = MockWorkerConfig::named(name);
            self.run(MockWorker::spawn(addr, config))?
                .with_context(|| format!("starting worker {name} on {addr}"))
        }
    }

    impl Drop for NsRuntime {
        fn drop(&mut self) {
            if let Some(runtime) = self.runtime.take() {
                // Bounded: a stuck task must not hang the test's cleanup.
                runtime.shutdown_timeout(Duration::from_secs(5));
            }
        }
    }
}

/// The namespace scenario both forwarding modes must pass: connections to
/// the service spread over three workers; worker B isolated by real L7
/// failures (its breaker) and then by failing health checks, each time
/// getting no new connection while an established one keeps working, and
/// getting new ones again once it recovers.
pub mod l4e2e {
    use std::net::{SocketAddr, TcpStream};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, bail, ensure};
    use balancer::breaker::State;
    use balancer::clock::ManualClock;
    use balancer::gateway::Running;
    use balancer::health::Health;
    use balancer::mock_worker::{Fault, MockWorker};
    use balancer::worker::Worker;
    use balancer_common::l4::BackendState;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    use crate::http1::{self, Answer};
    use crate::netns;
    use crate::ns_runtime::NsRuntime;

    /// The worker that fails.
    pub const B: usize = 1;
    /// New connections per round.
    pub const CONNECTIONS: usize = 300;
    /// Breaker open timeout the scenario's gateway runs with; the test moves
    /// its manual clock past it.
    pub const CB_TIMEOUT_SECS: u64 = 30;
    const BOUND: Duration = Duration::from_secs(20);

    /// Gateway flags the scenario relies on (besides the L4 ones): round
    /// robin so that B sees L7 traffic, a breaker that opens after three
    /// failures and closes after one good trial, fast health checks.
    pub fn gateway_flags() -> Vec<String> {
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--prometheus-port",
            "0",
            "--admin-port",
            "0",
            "--policy",
            "round_robin",
            "--cb-failure-threshold",
            "3",
            "--cb-success-threshold",
            "1",
            "--cb-timeout-duration-secs",
            "30",
            "--retry-max-retries",
            "3",
            "--retry-initial-backoff-ms",
            "1",
            "--retry-max-backoff-ms",
            "5",
            "--health-check-interval-secs",
            "1",
            "--health-check-timeout-secs",
            "1",
            "--health-failure-threshold",
            "2",
            "--health-success-threshold",
            "2",
            "--l4-table-size",
            "1009",
            "--l4-conntrack-size",
            "65536",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    pub struct Scenario<'a> {
        /// Where clients connect from.
        pub client_ns: &'a str,
        pub vip: SocketAddr,
        /// The runtime the gateway runs on, in the balancer's namespace.
        pub balancer: &'a NsRuntime,
        pub gw: &'a Running,
        pub workers: &'a [MockWorker],
        pub clock: &'a ManualClock,
    }

    impl Scenario<'_> {
        pub fn run(&self) -> Result<()> {
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
            let got = self.connections()?;
            eprintln!("all routable: {got:?}");
            for (i, &n) in got.iter().enumerate() {
                ensure!(
                    n >= CONNECTIONS / 5,
                    "worker {i} got {n} of {CONNECTIONS}: {got:?}"
                );
            }
            self.breaker_isolates_b().context("breaker")?;
            self.health_isolates_b().context("health")?;
            self.metrics_show_l4()
        }

        /// Real L7 requests through the gateway until B's breaker reaches
        /// `state`; returns how many it took.
        fn chat_until_b_is(&self, state: State) -> Result<usize> {
            let mut sent = 0;
            while self.worker(B)?.breaker.state() != state {
                ensure!(
                    sent < 60,
                    "B's breaker still {:?} after {sent} requests",
                    self.worker(B)?.breaker.state()
                );
                self.gateway_chat()?;
                sent += 1;
            }
            Ok(sent)
        }

        fn breaker_isolates_b(&self) -> Result<()> {
            let mut long = self.long_lived_on_b()?;
            self.workers[B].set_fault(Fault {
                status: Some(500),
                ..Fault::default()
            });
            let sent = self.chat_until_b_is(State::Open)?;
            let opened = Instant::now();
            self.wait_kernel_state(B, BackendState::Isolated)?;
            eprintln!(
                "breaker opened after {sent} L7 requests; kernel isolated B {:?} later",
                opened.elapsed()
            );
            // Only the breaker holds B back from here on.
            self.workers[B].clear_fault();
            self.b_gets_nothing_but_keeps_its_connection(&mut long)?;

            self.clock.advance(Duration::from_secs(CB_TIMEOUT_SECS + 1));
            self.chat_until_b_is(State::Closed)?;
            self.wait_kernel_state(B, BackendState::Routable)?;
            self.b_gets_some_again()
        }

        fn health_isolates_b(&self) -> Result<()> {
            let mut long = self.long_lived_on_b()?;
            self.workers[B].set_fault(Fault {
                health_status: Some(503),
                ..Fault::default()
            });
            self.wait("B demoted", || {
                Ok(self.worker(B)?.health() == Health::NotReady)
            })?;
            self.wait_kernel_state(B, BackendState::Isolated)?;
            self.b_gets_nothing_but_keeps_its_connection(&mut long)?;
            self.workers[B].clear_fault();
            self.wait("B promoted", || {
                Ok(self.worker(B)?.health() == Health::Ready)
            })?;
            self.wait_kernel_state(B, BackendState::Routable)?;
            self.b_gets_some_again()
        }

        fn b_gets_nothing_but_keeps_its_connection(&self, long: &mut TcpStream) -> Result<()> {
            let before = self.counters();
            let got = self.connections()?;
            eprintln!("B isolated: {got:?}");
            ensure!(
                got[B] == 0,
                "B got {} new connections while isolated: {got:?}",
                got[B]
            );
            ensure!(
                self.counters()[B] == before[B],
                "B's own counter moved while isolated"
            );
            let answer = http1::chat(long, false).context("the long-lived connection to B")?;
            ensure!(
                answer == self.answer_of(B),
                "the long-lived connection got {answer:?}"
            );
            ensure!(
                self.counters()[B] == before[B] + 1,
                "B did not serve the long-lived connection"
            );
            Ok(())
        }

        fn b_gets_some_again(&self) -> Result<()> {
            let got = self.connections()?;
            eprintln!("B routable again: {got:?}");
            ensure!(
                got[B] >= CONNECTIONS / 5,
                "B got only {} new connections after recovering: {got:?}",
                got[B]
            );
            Ok(())
        }

        fn metrics_show_l4(&self) -> Result<()> {
            let url = self.workers[B].url();
            let connections = format!("balancer_l4_worker_connections_total{{worker=\"{url}\"}}");
            ensure!(self.metric(&connections)? > 0.0);
            ensure!(self.metric("balancer_l4_outcome_packets_total{outcome=\"new_flow\"}")? > 0.0);
            // Open, half-open: at least two transitions changed B's bit.
            ensure!(
                self.metric("balancer_dataplane_sync_seconds_count")? >= 2.0,
                "sync histogram"
            );
            let state = format!("balancer_l4_worker_state{{worker=\"{url}\"}}");
            ensure!(self.metric(&state)? == 1.0);
            Ok(())
        }

        /// The value of one series (name and labels as exposed) on the
        /// gateway's metrics endpoint.
        pub fn metric(&self, series: &str) -> Result<f64> {
            let text = self.get(format!("http://{}/metrics", self.gw.metrics_addr))?;
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
                .with_context(|| format!("no {series} in the metrics"))
        }

        fn worker(&self, i: usize) -> Result<Arc<Worker>> {
            self.gw
                .registry
                .fleet()
                .get(&self.workers[i].url())
                .cloned()
                .with_context(|| format!("worker {i} is not registered"))
        }

        fn counters(&self) -> Vec<u64> {
            self.workers
                .iter()
                .map(|w| w.stats().inference_requests)
                .collect()
        }

        fn answer_of(&self, i: usize) -> Answer {
            Answer {
                status: 200,
                worker: self.workers[i].name().to_owned(),
            }
        }

        /// New connections to the service from the client namespace, as
        /// counted per worker by the answers, which must agree with the
        /// workers' own counters.
        fn connections(&self) -> Result<Vec<usize>> {
            let before = self.counters();
            let vip = self.vip;
            let answers = netns::run_in(self.client_ns, BOUND, move || {
                http1::new_connections(vip, CONNECTIONS)
            })??;
            let mut got = vec![0; self.workers.len()];
            for answer in &answers {
                let i = (0..self.workers.len())
                    .find(|&i| *answer == self.answer_of(i))
                    .with_context(|| format!("unexpected answer {answer:?}"))?;
                got[i] += 1;
            }
            let after = self.counters();
            for i in 0..got.len() {
                ensure!(
                    after[i] - before[i] == got[i] as u64,
                    "worker {i} counted {} requests, answers say {}",
                    after[i] - before[i],
                    got[i]
                );
            }
            Ok(got)
        }

        /// A keep-alive connection through the service that landed on B.
        fn long_lived_on_b(&self) -> Result<TcpStream> {
            let (vip, b) = (self.vip, self.answer_of(B));
            netns::run_in(self.client_ns, BOUND, move || -> Result<TcpStream> {
                for _ in 0..100 {
                    let mut stream = http1::connect(vip)?;
                    if http1::chat(&mut stream, false)? == b {
                        return Ok(stream);
                    }
                }
                bail!("100 connections and none went to B")
            })?
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

        fn get(&self, uri: String) -> Result<String> {
            self.balancer.run(async move {
                let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
                let response = tokio::time::timeout(BOUND, client.get(uri.parse()?)).await??;
                let body = response.into_body().collect().await?.to_bytes();
                Ok::<_, anyhow::Error>(String::from_utf8_lossy(&body).into_owned())
            })?
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
                    bail!("timed out waiting for: {what}");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        }
    }
}

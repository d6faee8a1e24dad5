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

//! Types shared by the kernel-side XDP program and the userspace agent.
//!
//! Everything here is `#[repr(C)]` with explicit-width fields and no implicit
//! padding, because both sides read the same bytes out of eBPF maps.
#![no_std]

pub mod l4;

/// Name of the XDP program inside the eBPF object (the `#[xdp]` function).
pub const PROGRAM_NAME: &str = "balancer";

/// Name of the per-CPU `u64` array that counts packets per [`Verdict`].
pub const VERDICTS_MAP: &str = "VERDICTS";

/// How the XDP program classified a packet while parsing it: every packet
/// is counted under exactly one verdict.
///
/// The discriminant is the packet's index in the `VERDICTS` map, so values
/// are append-only: renumbering would make an agent misread counters of an
/// object built from a different revision. What L4 steering then did with a
/// TCP packet is counted separately, under an [`l4::Outcome`], so that the
/// verdicts keep meaning "what the packet is" whether or not services exist.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Neither IPv4 nor IPv6 (ARP, stacked VLAN tags, other
    /// encapsulations, ...): the kernel's business. A single 802.1Q tag is
    /// looked through. (The name is older than IPv6 steering.)
    PassNotIpv4 = 0,
    /// A header the program needs runs past the end of the frame.
    PassTruncated = 1,
    /// An IP header that cannot be right (IPv4: bad version, IHL below 5;
    /// IPv6: bad version).
    PassMalformed = 2,
    /// A fragment (IPv4, or IPv6 with a fragment header): only the first
    /// one carries ports, so steering by five-tuple is impossible and the
    /// kernel reassembles.
    PassFragment = 3,
    /// IP but not TCP, nor ICMP, nor an ICMPv6 error (neighbour discovery,
    /// router advertisements and the other informational ICMPv6 messages
    /// included: they pass untouched).
    PassNotTcp = 4,
    /// A TCP SYN without ACK: the first packet of a new connection, where the
    /// steering decision will be made.
    TcpSyn = 5,
    /// Any other TCP segment, which will follow its connection's decision.
    TcpOther = 6,
    /// ICMP, or an ICMPv6 error: errors quoting a steered connection are
    /// translated and sent to its endpoint, everything else passes.
    Icmp = 7,
    /// IPv6 with an extension header (hop-by-hop, routing, destination
    /// options, authentication, ...) before the transport header: passed
    /// to the kernel untouched, never walked.
    PassExtHeader = 8,
}

impl Verdict {
    /// Number of verdicts, which is also the size of the `VERDICTS` map.
    pub const COUNT: usize = 9;

    /// Every verdict, in index order.
    pub const ALL: [Self; Self::COUNT] = [
        Self::PassNotIpv4,
        Self::PassTruncated,
        Self::PassMalformed,
        Self::PassFragment,
        Self::PassNotTcp,
        Self::TcpSyn,
        Self::TcpOther,
        Self::Icmp,
        Self::PassExtHeader,
    ];

    /// The verdict's slot in the `VERDICTS` map.
    pub const fn index(self) -> u32 {
        self as u32
    }

    /// A stable snake_case name, used for metric labels and log lines.
    pub const fn name(self) -> &'static str {
        match self {
            Self::PassNotIpv4 => "pass_not_ipv4",
            Self::PassTruncated => "pass_truncated",
            Self::PassMalformed => "pass_malformed",
            Self::PassFragment => "pass_fragment",
            Self::PassNotTcp => "pass_not_tcp",
            Self::TcpSyn => "tcp_syn",
            Self::TcpOther => "tcp_other",
            Self::Icmp => "icmp",
            Self::PassExtHeader => "pass_ext_header",
        }
    }
}

// `ALL` is written out by hand; make sure it stays in index order and complete.
const _: () = {
    let mut i = 0;
    while i < Verdict::COUNT {
        assert!(Verdict::ALL[i].index() as usize == i);
        i += 1;
    }
};

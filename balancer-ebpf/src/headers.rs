//! Wire formats of the headers the program reads.
//!
//! Multi-byte fields are kept as big-endian byte arrays, so the NAT
//! rewrite can patch bytes and checksums without swapping. The structs
//! have alignment 2: every header of a frame starts at an even offset (an
//! Ethernet header is 14 bytes, a VLAN tag 4, IPv4 options come in 4-byte
//! words, an ICMP header is 8), and the frame itself at an even address.
//! Knowing that, the compiler reads and writes the 16- and 32-bit fields
//! in halfwords where alignment 1 cost a byte load or store per byte and
//! the shifts that join them (the BPF target has no unaligned access; an
//! IPv6 known flow's program ran about 10% faster with it).

use balancer_common::l4::Addr6;

#[repr(C, align(2))]
pub struct EthHdr {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    pub ether_type: [u8; 2],
}

impl EthHdr {
    pub const LEN: usize = size_of::<Self>();
    pub const ETHER_TYPE_IPV4: u16 = 0x0800;
    pub const ETHER_TYPE_IPV6: u16 = 0x86dd;
    /// 802.1Q: one VLAN tag follows, then the real EtherType.
    pub const ETHER_TYPE_VLAN: u16 = 0x8100;

    #[inline(always)]
    pub fn ether_type(&self) -> u16 {
        u16::from_be_bytes(self.ether_type)
    }

    /// Sets both MAC addresses, given as [`NextHop`] holds them, with six
    /// halfword stores.
    ///
    /// [`NextHop`]: balancer_common::l4::NextHop
    #[inline(always)]
    pub fn set_macs(&mut self, dst: [u16; 3], src: [u16; 3]) {
        store_halves(&mut self.dst, dst);
        store_halves(&mut self.src, src);
    }
}

/// An 802.1Q tag: the VLAN id and priority, then the encapsulated
/// EtherType.
#[repr(C, align(2))]
pub struct VlanHdr {
    pub tci: [u8; 2],
    pub ether_type: [u8; 2],
}

impl VlanHdr {
    pub const LEN: usize = size_of::<Self>();
}

#[repr(C, align(2))]
pub struct Ipv4Hdr {
    pub version_ihl: u8,
    pub tos: u8,
    pub tot_len: [u8; 2],
    pub id: [u8; 2],
    pub frag_off: [u8; 2],
    pub ttl: u8,
    pub protocol: u8,
    pub check: [u8; 2],
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
}

impl Ipv4Hdr {
    pub const MIN_LEN: usize = size_of::<Self>();
    pub const PROTO_TCP: u8 = 6;
    pub const PROTO_ICMP: u8 = 1;
    pub const DONT_FRAGMENT: u16 = 0x4000;
    const MORE_FRAGMENTS: u16 = 0x2000;
    const FRAGMENT_OFFSET: u16 = 0x1fff;

    #[inline(always)]
    pub fn version(&self) -> u8 {
        self.version_ihl >> 4
    }

    /// Header length in bytes, options included.
    #[inline(always)]
    pub fn header_len(&self) -> usize {
        usize::from(self.version_ihl & 0x0f) * 4
    }

    #[inline(always)]
    pub fn total_len(&self) -> u16 {
        u16::from_be_bytes(self.tot_len)
    }

    #[inline(always)]
    pub fn dont_fragment(&self) -> bool {
        u16::from_be_bytes(self.frag_off) & Self::DONT_FRAGMENT != 0
    }

    /// True for every piece of a fragmented datagram, the first included.
    #[inline(always)]
    pub fn is_fragment(&self) -> bool {
        u16::from_be_bytes(self.frag_off) & (Self::MORE_FRAGMENTS | Self::FRAGMENT_OFFSET) != 0
    }
}

#[repr(C, align(2))]
pub struct Ipv6Hdr {
    /// Version, traffic class and flow label.
    pub vtc_flow: [u8; 4],
    pub payload_len: [u8; 2],
    pub next_header: u8,
    pub hop_limit: u8,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
}

impl Ipv6Hdr {
    pub const LEN: usize = size_of::<Self>();
    pub const NEXT_FRAGMENT: u8 = 44;
    pub const NEXT_ICMPV6: u8 = 58;

    #[inline(always)]
    pub fn version(&self) -> u8 {
        self.vtc_flow[0] >> 4
    }

    /// The source address, as [`Addr6`] words.
    #[inline(always)]
    pub fn src6(&self) -> Addr6 {
        load6(&self.saddr)
    }

    /// The destination address, as [`Addr6`] words.
    #[inline(always)]
    pub fn dst6(&self) -> Addr6 {
        load6(&self.daddr)
    }

    #[inline(always)]
    pub fn set_src6(&mut self, addr: Addr6) {
        store6(&mut self.saddr, addr);
    }

    #[inline(always)]
    pub fn set_dst6(&mut self, addr: Addr6) {
        store6(&mut self.daddr, addr);
    }

    /// Whether `next` is an extension header (RFC 8200 and the IANA
    /// list: hop-by-hop, routing, destination options, ESP, AH, mobility,
    /// HIP, shim6, experiments), the fragment header aside.
    #[inline(always)]
    pub fn is_extension(next: u8) -> bool {
        matches!(next, 0 | 43 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254)
    }
}

#[repr(C, align(2))]
pub struct TcpHdr {
    pub source: [u8; 2],
    pub dest: [u8; 2],
    pub seq: [u8; 4],
    pub ack_seq: [u8; 4],
    pub data_offset: u8,
    pub flags: u8,
    pub window: [u8; 2],
    pub check: [u8; 2],
    pub urg_ptr: [u8; 2],
}

impl TcpHdr {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const ACK: u8 = 0x10;
    /// Offset of `check` in the header.
    pub const CHECK_OFFSET: usize = 16;

    /// What connection tracking needs of the segment; `ip_payload` is the
    /// segment's length (what follows the IP header).
    #[inline(always)]
    pub fn segment(&self, ip_payload: u32) -> Segment {
        let header = u32::from(self.data_offset >> 4) * 4;
        let mut len = ip_payload.saturating_sub(header);
        // SYN and FIN each take a sequence number.
        if self.flags & Self::SYN != 0 {
            len += 1;
        }
        if self.flags & Self::FIN != 0 {
            len += 1;
        }
        Segment {
            flags: self.flags,
            seq: u32::from_be_bytes(self.seq),
            ack: u32::from_be_bytes(self.ack_seq),
            window: u32::from(u16::from_be_bytes(self.window)),
            len,
        }
    }
}

/// The parts of a TCP segment connection tracking looks at, in host order.
#[derive(Clone, Copy)]
pub struct Segment {
    pub flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub window: u32,
    /// Sequence space the segment takes: payload, plus one each for SYN
    /// and FIN.
    pub len: u32,
}

impl Segment {
    #[inline(always)]
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    #[inline(always)]
    pub fn is_syn_ack(&self) -> bool {
        self.flags & (TcpHdr::SYN | TcpHdr::ACK) == TcpHdr::SYN | TcpHdr::ACK
    }
}

/// An ICMP or ICMPv6 header; `rest` is the type-specific word (the next-hop
/// MTU of "fragmentation needed" sits in its second half, ICMPv6 "packet
/// too big" takes all of it).
#[repr(C, align(2))]
pub struct IcmpHdr {
    pub kind: u8,
    pub code: u8,
    pub check: [u8; 2],
    pub rest: [u8; 4],
}

impl IcmpHdr {
    pub const LEN: usize = size_of::<Self>();
    pub const DEST_UNREACHABLE: u8 = 3;
    pub const TIME_EXCEEDED: u8 = 11;
    pub const PARAMETER_PROBLEM: u8 = 12;
    /// Destination unreachable, code 4.
    pub const FRAG_NEEDED: u8 = 4;

    /// ICMPv6 (RFC 4443) types, same header layout.
    pub const V6_DEST_UNREACHABLE: u8 = 1;
    pub const V6_PACKET_TOO_BIG: u8 = 2;
    pub const V6_TIME_EXCEEDED: u8 = 3;
    pub const V6_PARAMETER_PROBLEM: u8 = 4;

    /// An error message, which quotes the packet it is about.
    #[inline(always)]
    pub fn is_error(&self) -> bool {
        matches!(
            self.kind,
            Self::DEST_UNREACHABLE | Self::TIME_EXCEEDED | Self::PARAMETER_PROBLEM
        )
    }

    /// An ICMPv6 error about a packet that could not be delivered or
    /// processed, which quotes it (neighbour discovery, echo and every
    /// other informational message are not).
    #[inline(always)]
    pub fn is_error6(&self) -> bool {
        matches!(
            self.kind,
            Self::V6_DEST_UNREACHABLE
                | Self::V6_PACKET_TOO_BIG
                | Self::V6_TIME_EXCEEDED
                | Self::V6_PARAMETER_PROBLEM
        )
    }
}

/// The first eight bytes of a TCP header: all an ICMP error must quote.
#[repr(C, align(2))]
pub struct TcpPorts {
    pub source: [u8; 2],
    pub dest: [u8; 2],
    pub seq: [u8; 4],
}

/// An address field of an [`Ipv6Hdr`] as the native-order words of its
/// bytes ([`Addr6`], what the maps hold), read as eight 16-bit loads: the
/// field sits at an even offset of a header of alignment 2, where a byte
/// array's sixteen byte loads, and the shifts that join them, cost three
/// times the instructions (every steered IPv6 packet reads two addresses
/// and writes one).
#[inline(always)]
fn load6(field: &[u8; 16]) -> Addr6 {
    let halves = field.as_ptr().cast::<u16>();
    let word = |i: usize| {
        // SAFETY: halves 2i and 2i+1 lie inside `field`, which is 2-aligned
        // (an even offset of a 2-aligned header, asserted below).
        let [a, b] = unsafe { [halves.add(2 * i).read(), halves.add(2 * i + 1).read()] };
        let ([a0, a1], [b0, b1]) = (a.to_ne_bytes(), b.to_ne_bytes());
        u32::from_ne_bytes([a0, a1, b0, b1])
    };
    [word(0), word(1), word(2), word(3)]
}

/// Writes `addr` into an address field of an [`Ipv6Hdr`] as eight 16-bit
/// stores (see [`load6`]).
#[inline(always)]
fn store6(field: &mut [u8; 16], addr: Addr6) {
    let mut halves = [0u16; 8];
    for (i, word) in addr.iter().enumerate() {
        let [a0, a1, b0, b1] = word.to_ne_bytes();
        halves[2 * i] = u16::from_ne_bytes([a0, a1]);
        halves[2 * i + 1] = u16::from_ne_bytes([b0, b1]);
    }
    store_halves(field, halves);
}

/// Writes `halves` over a header field of `2 * N` bytes, a halfword store
/// each. Every caller passes a field at an even offset of a header of
/// alignment 2 (asserted below), so the stores are aligned.
#[inline(always)]
fn store_halves<const B: usize, const N: usize>(field: &mut [u8; B], halves: [u16; N]) {
    const { assert!(B == 2 * N) };
    let to = field.as_mut_ptr().cast::<u16>();
    for (i, half) in halves.into_iter().enumerate() {
        // SAFETY: half `i` lies inside the field (`B == 2 * N`), which is
        // 2-aligned (its callers' fields, asserted below).
        unsafe { to.add(i).write(half) };
    }
}

impl Ipv4Hdr {
    /// Offset of `check` in the header.
    pub const CHECK_OFFSET: usize = 10;
    /// Offset of `saddr` in the header.
    pub const SADDR_OFFSET: usize = 12;
}

const _: () = {
    assert!(EthHdr::LEN == 14);
    assert!(VlanHdr::LEN == 4);
    assert!(IcmpHdr::LEN == 8);
    assert!(size_of::<TcpPorts>() == 8);
    assert!(Ipv4Hdr::MIN_LEN == 20);
    assert!(Ipv6Hdr::LEN == 40);
    assert!(size_of::<TcpHdr>() == 20);
    assert!(align_of::<Ipv6Hdr>() == 2 && align_of::<EthHdr>() == 2);
    assert!(core::mem::offset_of!(EthHdr, src) % 2 == 0);
    assert!(core::mem::offset_of!(Ipv6Hdr, saddr) % 2 == 0);
    assert!(core::mem::offset_of!(Ipv6Hdr, daddr) % 2 == 0);
};

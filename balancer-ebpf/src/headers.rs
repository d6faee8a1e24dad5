//! Wire formats of the headers the program reads.
//!
//! Multi-byte fields are kept as big-endian byte arrays: the structs then
//! have alignment 1, so they can sit at any offset in the frame (IPv4
//! options move the TCP header), and the NAT rewrite can patch bytes and
//! checksums without swapping.

#[repr(C)]
pub struct EthHdr {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    pub ether_type: [u8; 2],
}

impl EthHdr {
    pub const LEN: usize = size_of::<Self>();
    pub const ETHER_TYPE_IPV4: u16 = 0x0800;

    #[inline(always)]
    pub fn ether_type(&self) -> u16 {
        u16::from_be_bytes(self.ether_type)
    }
}

#[repr(C)]
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

    /// True for every piece of a fragmented datagram, the first included.
    #[inline(always)]
    pub fn is_fragment(&self) -> bool {
        u16::from_be_bytes(self.frag_off) & (Self::MORE_FRAGMENTS | Self::FRAGMENT_OFFSET) != 0
    }
}

#[repr(C)]
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

    /// A SYN-ACK: the server's answer that opens a connection.
    #[inline(always)]
    pub fn is_syn_ack(&self) -> bool {
        self.flags & (Self::SYN | Self::ACK) == Self::SYN | Self::ACK
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
    assert!(Ipv4Hdr::MIN_LEN == 20);
    assert!(size_of::<TcpHdr>() == 20);
};

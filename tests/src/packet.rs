//! Builders for the raw frames fed to `BPF_PROG_TEST_RUN` (and for the
//! packets the namespace tests forge through raw sockets).
//!
//! Checksums are computed properly even where the current program does not
//! look at them, so the same frames keep working once it rewrites packets.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

pub const ETHERTYPE_IPV4: u16 = 0x0800;
pub const ETHERTYPE_ARP: u16 = 0x0806;
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_ICMPV6: u8 = 58;
/// IPv6 next header: hop-by-hop options.
pub const IPV6_HOP_BY_HOP: u8 = 0;
/// ICMPv6 neighbour solicitation.
pub const ICMPV6_NEIGHBOR_SOLICITATION: u8 = 135;
/// ICMPv6 error types (RFC 4443).
pub const ICMPV6_DEST_UNREACHABLE: u8 = 1;
pub const ICMPV6_PACKET_TOO_BIG: u8 = 2;
pub const ICMPV6_TIME_EXCEEDED: u8 = 3;
pub const ICMPV6_PARAMETER_PROBLEM: u8 = 4;
/// The minimum IPv6 MTU, which bounds an ICMPv6 error with its quote.
pub const IPV6_MIN_MTU: usize = 1280;
/// Where the IPv6 header starts in an untagged frame.
pub const IPV6_OFFSET: usize = 14;
/// The fixed IPv6 header's length.
pub const IPV6_HEADER_LEN: usize = 40;
pub const ETHERTYPE_VLAN: u16 = 0x8100;
pub const ETHERTYPE_QINQ: u16 = 0x88a8;
/// IPv4 "don't fragment" flag.
pub const DONT_FRAGMENT: u16 = 0x4000;
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

/// An Ethernet frame with one 802.1Q tag (VLAN `vid`) around `ether_type`.
pub fn vlan_ethernet(outer: u16, vid: u16, ether_type: u16, payload: &[u8]) -> Vec<u8> {
    let mut inner = Vec::with_capacity(4 + payload.len());
    inner.extend_from_slice(&vid.to_be_bytes());
    inner.extend_from_slice(&ether_type.to_be_bytes());
    inner.extend_from_slice(payload);
    ethernet(outer, &inner)
}

/// An IPv4 header, written out around a transport payload by [`Ipv4::packet`].
#[derive(Clone, Debug)]
pub struct Ipv4 {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub protocol: u8,
    pub ttl: u8,
    pub tos: u8,
    pub id: u16,
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
            ttl: 64,
            tos: 0,
            id: 0x1234,
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
        packet.push(self.tos);
        packet.extend_from_slice(&total_len.to_be_bytes());
        packet.extend_from_slice(&self.id.to_be_bytes());
        packet.extend_from_slice(&self.flags_fragment.to_be_bytes());
        packet.push(self.ttl);
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

/// A TCP segment with the sequence numbers, window and payload of one's
/// choosing (no options).
#[derive(Clone, Debug)]
pub struct Tcp {
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub window: u16,
    pub payload: Vec<u8>,
}

impl Tcp {
    pub fn new(src: SocketAddrV4, dst: SocketAddrV4, flags: u8, seq: u32, ack: u32) -> Self {
        Self {
            src,
            dst,
            flags,
            seq,
            ack,
            window: 64240,
            payload: Vec::new(),
        }
    }

    pub fn segment(&self) -> Vec<u8> {
        let mut segment = Vec::with_capacity(20 + self.payload.len());
        segment.extend_from_slice(&self.src.port().to_be_bytes());
        segment.extend_from_slice(&self.dst.port().to_be_bytes());
        segment.extend_from_slice(&self.seq.to_be_bytes());
        segment.extend_from_slice(&self.ack.to_be_bytes());
        segment.push(5 << 4);
        segment.push(self.flags);
        segment.extend_from_slice(&self.window.to_be_bytes());
        segment.extend_from_slice(&[0, 0, 0, 0]);
        segment.extend_from_slice(&self.payload);
        let checksum = transport_checksum(
            (*self.src.ip()).into(),
            (*self.dst.ip()).into(),
            PROTO_TCP,
            &segment,
        );
        segment[16..18].copy_from_slice(&checksum.to_be_bytes());
        segment
    }

    /// The IPv4 packet carrying the segment.
    pub fn ip(&self) -> Vec<u8> {
        Ipv4::new(*self.src.ip(), *self.dst.ip(), PROTO_TCP).packet(&self.segment())
    }

    /// The Ethernet frame carrying the segment.
    pub fn frame(&self) -> Vec<u8> {
        ethernet(ETHERTYPE_IPV4, &self.ip())
    }
}

/// The fixed IPv6 header, written out around a payload by [`Ipv6::packet`]
/// (no flow label).
#[derive(Clone, Debug)]
pub struct Ipv6 {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub next_header: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

impl Ipv6 {
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8) -> Self {
        Self {
            src,
            dst,
            next_header,
            hop_limit: 64,
            traffic_class: 0,
        }
    }

    /// The header, then `payload` (extension headers, if any, and the
    /// upper layer's data).
    pub fn packet(&self, payload: &[u8]) -> Vec<u8> {
        let payload_len = u16::try_from(payload.len()).expect("payload fits IPv6");
        let mut packet = Vec::with_capacity(IPV6_HEADER_LEN + payload.len());
        let class = self.traffic_class;
        packet.extend_from_slice(&[0x60 | class >> 4, class << 4, 0, 0]);
        packet.extend_from_slice(&payload_len.to_be_bytes());
        packet.push(self.next_header);
        packet.push(self.hop_limit);
        packet.extend_from_slice(&self.src.octets());
        packet.extend_from_slice(&self.dst.octets());
        packet.extend_from_slice(payload);
        packet
    }
}

/// An IPv6 packet with hop limit 64: the fixed header with `next_header`,
/// then `payload` (extension headers, if any, and the upper layer's data).
pub fn ipv6_packet(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, payload: &[u8]) -> Vec<u8> {
    Ipv6::new(src, dst, next_header).packet(payload)
}

/// An ICMPv6 message from `src` to `dst` of `kind` and `code`, with `rest`
/// as its type-specific word and `body` after it (an error's quote), its
/// checksum over the IPv6 pseudo-header (RFC 4443, 2.3).
pub fn icmp6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    body: &[u8],
) -> Vec<u8> {
    let mut message = vec![kind, code, 0, 0];
    message.extend_from_slice(&rest);
    message.extend_from_slice(body);
    let checksum = transport_checksum(src.into(), dst.into(), PROTO_ICMPV6, &message);
    message[2..4].copy_from_slice(&checksum.to_be_bytes());
    message
}

/// The Ethernet frame of an [`icmp6`] message (hop limit `hop_limit`).
pub fn icmp6_frame(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    hop_limit: u8,
    (kind, code, rest): (u8, u8, [u8; 4]),
    body: &[u8],
) -> Vec<u8> {
    let mut ip = Ipv6::new(src, dst, PROTO_ICMPV6);
    ip.hop_limit = hop_limit;
    ethernet(
        ETHERTYPE_IPV6,
        &ip.packet(&icmp6(src, dst, kind, code, rest, body)),
    )
}

/// A TCP segment between IPv6 endpoints (no options), its checksum over
/// the IPv6 pseudo-header.
pub fn tcp6(
    src: SocketAddrV6,
    dst: SocketAddrV6,
    flags: u8,
    seq: u32,
    ack: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut segment = Vec::with_capacity(20 + payload.len());
    segment.extend_from_slice(&src.port().to_be_bytes());
    segment.extend_from_slice(&dst.port().to_be_bytes());
    segment.extend_from_slice(&seq.to_be_bytes());
    segment.extend_from_slice(&ack.to_be_bytes());
    segment.push(5 << 4);
    segment.push(flags);
    segment.extend_from_slice(&64240u16.to_be_bytes());
    segment.extend_from_slice(&[0, 0, 0, 0]);
    segment.extend_from_slice(payload);
    let checksum = transport_checksum((*src.ip()).into(), (*dst.ip()).into(), PROTO_TCP, &segment);
    segment[16..18].copy_from_slice(&checksum.to_be_bytes());
    segment
}

/// The Ethernet frame of [`tcp6`].
pub fn tcp6_frame(
    src: SocketAddrV6,
    dst: SocketAddrV6,
    flags: u8,
    seq: u32,
    ack: u32,
    payload: &[u8],
) -> Vec<u8> {
    let segment = tcp6(src, dst, flags, seq, ack, payload);
    ethernet(
        ETHERTYPE_IPV6,
        &ipv6_packet(*src.ip(), *dst.ip(), PROTO_TCP, &segment),
    )
}

/// The TCP endpoints of an untagged IPv6 frame without extension headers,
/// as (source, destination).
pub fn endpoints6(frame: &[u8]) -> (SocketAddrV6, SocketAddrV6) {
    let ip = &frame[IPV6_OFFSET..];
    let l4 = &ip[IPV6_HEADER_LEN..];
    let port = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
    (
        SocketAddrV6::new(ipv6_at(ip, 8), port(0), 0, 0),
        SocketAddrV6::new(ipv6_at(ip, 24), port(2), 0, 0),
    )
}

/// Whether the TCP (or UDP, or ICMPv6) checksum of an untagged IPv6 frame
/// without extension headers verifies, over the pseudo-header of the
/// frame's own addresses (IPv6 has no header checksum).
pub fn checksum6_verifies(frame: &[u8]) -> bool {
    let ip = &frame[IPV6_OFFSET..];
    let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let segment = &ip[IPV6_HEADER_LEN..IPV6_HEADER_LEN + payload_len];
    transport_checksum(
        ipv6_at(ip, 8).into(),
        ipv6_at(ip, 24).into(),
        ip[6],
        segment,
    ) == 0
}

fn ipv6_at(ip: &[u8], at: usize) -> Ipv6Addr {
    let octets: [u8; 16] = ip[at..at + 16].try_into().expect("16 bytes");
    Ipv6Addr::from(octets)
}

/// An ICMP error message of `kind` and `code` quoting `quoted` (an IPv4
/// header and at least eight bytes of what follows), with `rest` as its
/// type-specific word.
pub fn icmp_error(kind: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> Vec<u8> {
    let mut message = vec![kind, code, 0, 0];
    message.extend_from_slice(&rest);
    message.extend_from_slice(quoted);
    let checksum = internet_checksum(&message, 0);
    message[2..4].copy_from_slice(&checksum.to_be_bytes());
    message
}

/// Whether the IPv4 header checksum and the ICMP checksum of an ICMP frame
/// (IPv4 header at `l3`) verify.
pub fn icmp_checksums_verify(frame: &[u8], l3: usize) -> bool {
    let ip = &frame[l3..];
    let header_len = usize::from(ip[0] & 0x0f) * 4;
    let total_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    internet_checksum(&ip[..header_len], 0) == 0
        && internet_checksum(&ip[header_len..total_len], 0) == 0
}

/// The IP packet, of the endpoints' family, of a TCP segment without
/// payload or options, with sequence number `seq` and no acknowledgment.
pub fn tcp_packet(src: SocketAddr, dst: SocketAddr, flags: u8, seq: u32) -> Vec<u8> {
    match (src, dst) {
        (SocketAddr::V4(src), SocketAddr::V4(dst)) => Tcp::new(src, dst, flags, seq, 0).ip(),
        (SocketAddr::V6(src), SocketAddr::V6(dst)) => {
            let segment = tcp6(src, dst, flags, seq, 0, &[]);
            ipv6_packet(*src.ip(), *dst.ip(), PROTO_TCP, &segment)
        }
        _ => panic!("TCP between two families: {src} to {dst}"),
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
    let checksum = transport_checksum((*src.ip()).into(), (*dst.ip()).into(), PROTO_TCP, &segment);
    segment[16..18].copy_from_slice(&checksum.to_be_bytes());
    segment
}

/// A UDP datagram between endpoints of either family, its checksum over
/// that family's pseudo-header.
pub fn udp<A: Into<SocketAddr>>(src: A, dst: A, payload: &[u8]) -> Vec<u8> {
    let (src, dst): (SocketAddr, SocketAddr) = (src.into(), dst.into());
    let len = u16::try_from(8 + payload.len()).expect("datagram fits UDP");
    let mut datagram = Vec::with_capacity(usize::from(len));
    datagram.extend_from_slice(&src.port().to_be_bytes());
    datagram.extend_from_slice(&dst.port().to_be_bytes());
    datagram.extend_from_slice(&len.to_be_bytes());
    datagram.extend_from_slice(&[0, 0]);
    datagram.extend_from_slice(payload);
    let checksum = transport_checksum(src.ip(), dst.ip(), PROTO_UDP, &datagram);
    datagram[6..8].copy_from_slice(&checksum.to_be_bytes());
    datagram
}

/// A whole Ethernet + IPv6 + UDP frame.
pub fn udp6_frame(src: SocketAddrV6, dst: SocketAddrV6, payload: &[u8]) -> Vec<u8> {
    let datagram = udp(src, dst, payload);
    ethernet(
        ETHERTYPE_IPV6,
        &ipv6_packet(*src.ip(), *dst.ip(), PROTO_UDP, &datagram),
    )
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
    checksums_verify_at(frame, IPV4_OFFSET)
}

/// [`checksums_verify`] for a frame whose IPv4 header is at `l3`.
pub fn checksums_verify_at(frame: &[u8], l3: usize) -> bool {
    let ip = &frame[l3..];
    let header_len = usize::from(ip[0] & 0x0f) * 4;
    let total_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    internet_checksum(&ip[..header_len], 0) == 0
        && transport_checksum(src.into(), dst.into(), ip[9], &ip[header_len..total_len]) == 0
}

/// The TCP/UDP checksum of `segment` between `src` and `dst`, over the
/// pseudo-header of their family (RFC 793, RFC 8200: the same words but
/// for the addresses' length).
fn transport_checksum(src: IpAddr, dst: IpAddr, protocol: u8, segment: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(40);
    for addr in [src, dst] {
        match addr {
            IpAddr::V4(ip) => pseudo.extend_from_slice(&ip.octets()),
            IpAddr::V6(ip) => pseudo.extend_from_slice(&ip.octets()),
        }
    }
    let len = u32::try_from(segment.len()).expect("segment fits");
    pseudo.extend_from_slice(&len.to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, protocol]);
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

/// An IPv6 socket address from its eight segments, in a `const`.
pub const fn v6(segments: [u16; 8], port: u16) -> std::net::SocketAddrV6 {
    let [a, b, c, d, e, f, g, h] = segments;
    std::net::SocketAddrV6::new(std::net::Ipv6Addr::new(a, b, c, d, e, f, g, h), port, 0, 0)
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
            transport_checksum((*src.ip()).into(), (*dst.ip()).into(), PROTO_TCP, &segment),
            0
        );
    }
}

//! What differs between IPv4 and IPv6 steering, behind one trait: the IP
//! header's wire format and the family's maps. Steering ([`crate::l4`]),
//! connection tracking ([`crate::conntrack`]) and the TC egress program
//! ([`crate::egress`]) are written once, generic over [`Family`], and
//! monomorphised for each (so the IPv4 code is what it was before IPv6).
//!
//! This module knows headers and map names; it decides nothing.

use aya_ebpf::bindings::{BPF_F_PSEUDO_HDR, bpf_fib_lookup as FibParams};
use aya_ebpf::maps::{Array, HashMap, LruHashMap, PerCpuArray};
use aya_ebpf::programs::{TcContext, XdpContext};
use balancer_common::l4::{
    Addr, Addr6, Backend, Flow, FlowKey, NextHop, Service, ServiceKey, SoleService, SynSet,
};

use crate::csum;
use crate::headers::{IcmpHdr, Ipv4Hdr, Ipv6Hdr};
use crate::icmp;
use crate::icmp6;
use crate::l4::Scratch;
use crate::maps;

/// One address family: its header and its maps.
pub trait Family: 'static {
    type Addr: Addr;
    type Hdr: IpHeader<Addr = Self::Addr>;
    fn services() -> &'static HashMap<ServiceKey<Self::Addr>, Service>;
    fn sole_services() -> &'static Array<SoleService<Self::Addr>>;
    fn backends() -> &'static Array<Backend<Self::Addr>>;
    fn next_hops() -> &'static Array<NextHop<Self::Addr>>;
    fn client_hops() -> &'static LruHashMap<Self::Addr, NextHop<Self::Addr>>;
    fn conns() -> &'static LruHashMap<FlowKey<Self::Addr>, Flow<Self::Addr>>;
    fn embryonic() -> &'static LruHashMap<FlowKey<Self::Addr>, Flow<Self::Addr>>;
    /// Handshakes the backend has not answered yet (`SYNS`).
    fn syns() -> &'static Array<SynSet<Self::Addr>>;
    /// Where steering keeps its largest locals: a per-CPU slot, because on
    /// the stack they would push the call chain past the verifier's 512
    /// bytes (steering is inlined into the parser, whose frame it shares).
    fn scratch() -> &'static PerCpuArray<Scratch<Self::Addr>>;
}

/// An IP header as steering reads and rewrites it.
pub trait IpHeader {
    type Addr: Addr;
    /// Offset of the source address in the header (the TC program stores
    /// there).
    const SADDR_OFFSET: usize;
    fn src(&self) -> Self::Addr;
    fn dst(&self) -> Self::Addr;
    /// Sets the source, updating the header's own checksum if it has one.
    fn set_src(&mut self, addr: Self::Addr);
    /// Sets the destination, likewise.
    fn set_dst(&mut self, addr: Self::Addr);
    /// Bytes after the IP header: the TCP segment.
    fn l4_len(&self) -> u32;
    /// The whole packet, what a next hop's MTU limits.
    fn l3_len(&self) -> u32;
    /// The TTL or hop limit.
    fn hops(&self) -> u8;
    /// Decrements the TTL or hop limit (and the checksum with it).
    fn decrement_hops(&mut self);
    /// The TCP checksum `check` after the address `old` in its
    /// pseudo-header became `new`.
    fn csum_addr(check: u16, old: Self::Addr, new: Self::Addr) -> u16;
    /// Fills a `bpf_fib_lookup` block for a packet like this one to `dst`.
    fn fib(&self, params: &mut FibParams, dst: Self::Addr);
    /// Remote mode, a packet whose TTL would expire, or (`mtu` nonzero)
    /// that is larger than the next hop's MTU and may not be fragmented:
    /// the answer, sent by the program itself, or `None` when the family
    /// leaves it to the kernel (the packet is then rewritten and passed).
    /// (IPv6 asks the ICMPv6 program, see [`icmp6::ANSWER`].)
    fn answer(ctx: &XdpContext, l3: usize, mtu: u32) -> Option<u32>;
    /// Whether a packet larger than the next hop's MTU may be fragmented
    /// on the way (by the kernel).
    fn may_fragment(&self) -> bool;
    /// TC egress: updates the checksums in the socket buffer for a source
    /// address going from `old` to `new` (the helpers handle partial
    /// checksums, which a locally sent segment carries).
    fn tc_csum(
        ctx: &TcContext,
        l3: usize,
        tcp_check: usize,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), i64>;
}

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

pub struct V4;
pub struct V6;

impl Family for V4 {
    type Addr = u32;
    type Hdr = Ipv4Hdr;
    #[inline(always)]
    fn services() -> &'static HashMap<ServiceKey, Service> {
        &maps::SERVICES
    }
    #[inline(always)]
    fn sole_services() -> &'static Array<SoleService> {
        &maps::SOLE_SERVICES
    }
    #[inline(always)]
    fn backends() -> &'static Array<Backend> {
        &maps::BACKENDS
    }
    #[inline(always)]
    fn next_hops() -> &'static Array<NextHop> {
        &maps::NEXT_HOPS
    }
    #[inline(always)]
    fn client_hops() -> &'static LruHashMap<u32, NextHop> {
        &maps::CLIENT_HOPS
    }
    #[inline(always)]
    fn conns() -> &'static LruHashMap<FlowKey, Flow> {
        &maps::CONNS
    }
    #[inline(always)]
    fn embryonic() -> &'static LruHashMap<FlowKey, Flow> {
        &maps::EMBRYONIC
    }
    #[inline(always)]
    fn syns() -> &'static Array<SynSet> {
        &maps::SYNS
    }
    #[inline(always)]
    fn scratch() -> &'static PerCpuArray<Scratch<u32>> {
        &maps::SCRATCH4
    }
}

impl Family for V6 {
    type Addr = Addr6;
    type Hdr = Ipv6Hdr;
    #[inline(always)]
    fn services() -> &'static HashMap<ServiceKey<Addr6>, Service> {
        &maps::SERVICES6
    }
    #[inline(always)]
    fn sole_services() -> &'static Array<SoleService<Addr6>> {
        &maps::SOLE_SERVICES6
    }
    #[inline(always)]
    fn backends() -> &'static Array<Backend<Addr6>> {
        &maps::BACKENDS6
    }
    #[inline(always)]
    fn next_hops() -> &'static Array<NextHop<Addr6>> {
        &maps::NEXT_HOPS6
    }
    #[inline(always)]
    fn client_hops() -> &'static LruHashMap<Addr6, NextHop<Addr6>> {
        &maps::CLIENT_HOPS6
    }
    #[inline(always)]
    fn conns() -> &'static LruHashMap<FlowKey<Addr6>, Flow<Addr6>> {
        &maps::CONNS6
    }
    #[inline(always)]
    fn embryonic() -> &'static LruHashMap<FlowKey<Addr6>, Flow<Addr6>> {
        &maps::EMBRYONIC6
    }
    #[inline(always)]
    fn syns() -> &'static Array<SynSet<Addr6>> {
        &maps::SYNS6
    }
    #[inline(always)]
    fn scratch() -> &'static PerCpuArray<Scratch<Addr6>> {
        &maps::SCRATCH6
    }
}

impl IpHeader for Ipv4Hdr {
    type Addr = u32;
    const SADDR_OFFSET: usize = Ipv4Hdr::SADDR_OFFSET;

    #[inline(always)]
    fn src(&self) -> u32 {
        u32::from_ne_bytes(self.saddr)
    }
    #[inline(always)]
    fn dst(&self) -> u32 {
        u32::from_ne_bytes(self.daddr)
    }
    #[inline(always)]
    fn set_src(&mut self, addr: u32) {
        self.check = csum::replace4(u16::from_ne_bytes(self.check), self.src(), addr).to_ne_bytes();
        self.saddr = addr.to_ne_bytes();
    }
    #[inline(always)]
    fn set_dst(&mut self, addr: u32) {
        self.check = csum::replace4(u16::from_ne_bytes(self.check), self.dst(), addr).to_ne_bytes();
        self.daddr = addr.to_ne_bytes();
    }
    #[inline(always)]
    fn l4_len(&self) -> u32 {
        u32::from(self.total_len()).saturating_sub(self.header_len() as u32)
    }
    #[inline(always)]
    fn l3_len(&self) -> u32 {
        u32::from(self.total_len())
    }
    #[inline(always)]
    fn hops(&self) -> u8 {
        self.ttl
    }
    #[inline(always)]
    fn decrement_hops(&mut self) {
        let word = u16::from_ne_bytes([self.ttl, self.protocol]);
        self.ttl -= 1;
        let check = csum::replace2(
            u16::from_ne_bytes(self.check),
            word,
            u16::from_ne_bytes([self.ttl, self.protocol]),
        );
        self.check = check.to_ne_bytes();
    }
    #[inline(always)]
    fn csum_addr(check: u16, old: u32, new: u32) -> u16 {
        csum::replace4(check, old, new)
    }
    #[inline(always)]
    fn fib(&self, params: &mut FibParams, dst: u32) {
        params.family = AF_INET;
        params.__bindgen_anon_2.tos = self.tos;
        params.__bindgen_anon_3.ipv4_src = self.src();
        params.__bindgen_anon_4.ipv4_dst = dst;
    }
    #[inline(always)]
    fn answer(ctx: &XdpContext, l3: usize, mtu: u32) -> Option<u32> {
        Some(if mtu == 0 {
            icmp::answer(ctx, l3, icmp::TIME_EXCEEDED, 0)
        } else {
            icmp::answer(ctx, l3, icmp::FRAG_NEEDED, mtu)
        })
    }
    #[inline(always)]
    fn may_fragment(&self) -> bool {
        !self.dont_fragment()
    }
    #[inline(always)]
    fn tc_csum(
        ctx: &TcContext,
        l3: usize,
        tcp_check: usize,
        old: u32,
        new: u32,
    ) -> Result<(), i64> {
        let pseudo = u64::from(BPF_F_PSEUDO_HDR);
        ctx.l4_csum_replace(tcp_check, u64::from(old), u64::from(new), pseudo | 4)?;
        ctx.l3_csum_replace(
            l3 + Ipv4Hdr::CHECK_OFFSET,
            u64::from(old),
            u64::from(new),
            4,
        )
    }
}

impl IpHeader for Ipv6Hdr {
    type Addr = Addr6;
    const SADDR_OFFSET: usize = 8;

    #[inline(always)]
    fn src(&self) -> Addr6 {
        self.src6()
    }
    #[inline(always)]
    fn dst(&self) -> Addr6 {
        self.dst6()
    }
    // No header checksum: the addresses are covered by the transport's.
    #[inline(always)]
    fn set_src(&mut self, addr: Addr6) {
        self.set_src6(addr);
    }
    #[inline(always)]
    fn set_dst(&mut self, addr: Addr6) {
        self.set_dst6(addr);
    }
    #[inline(always)]
    fn l4_len(&self) -> u32 {
        // Packets with extension headers are passed before steering, so
        // the payload is the segment.
        u32::from(u16::from_be_bytes(self.payload_len))
    }
    #[inline(always)]
    fn l3_len(&self) -> u32 {
        Ipv6Hdr::LEN as u32 + self.l4_len()
    }
    #[inline(always)]
    fn hops(&self) -> u8 {
        self.hop_limit
    }
    #[inline(always)]
    fn decrement_hops(&mut self) {
        self.hop_limit -= 1;
    }
    #[inline(always)]
    fn csum_addr(check: u16, old: Addr6, new: Addr6) -> u16 {
        csum::replace_words(check, old, new)
    }
    #[inline(always)]
    fn fib(&self, params: &mut FibParams, dst: Addr6) {
        // The flow label stays 0: the kernel only hashes it for multipath
        // routes, and a per-backend cache could not keep it anyway.
        params.family = AF_INET6;
        params.__bindgen_anon_3.ipv6_src = self.src();
        params.__bindgen_anon_4.ipv6_dst = dst;
    }
    // Answered by the ICMPv6 program (it does not fit into IPv6
    // steering's), which `balancer6` tail-calls on `icmp6::ANSWER`.
    #[inline(always)]
    fn answer(_ctx: &XdpContext, l3: usize, mtu: u32) -> Option<u32> {
        let kind = if mtu == 0 {
            IcmpHdr::V6_TIME_EXCEEDED
        } else {
            IcmpHdr::V6_PACKET_TOO_BIG
        };
        icmp6::ask(l3, u32::from(kind), mtu);
        Some(icmp6::ANSWER)
    }
    #[inline(always)]
    fn may_fragment(&self) -> bool {
        // IPv6 routers never fragment.
        false
    }
    #[inline(always)]
    fn tc_csum(
        ctx: &TcContext,
        _l3: usize,
        tcp_check: usize,
        old: Addr6,
        new: Addr6,
    ) -> Result<(), i64> {
        let pseudo = u64::from(BPF_F_PSEUDO_HDR);
        for i in 0..4 {
            ctx.l4_csum_replace(tcp_check, u64::from(old[i]), u64::from(new[i]), pseudo | 4)?;
        }
        Ok(())
    }
}

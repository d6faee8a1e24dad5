//! ICMP, both ways (Katran's `handle_icmp` and `send_icmp_too_big`, for a
//! NAT datapath):
//!
//! - [`steer`]: an ICMP error about a steered connection (fragmentation
//!   needed, unreachable, time exceeded, parameter problem) quotes the
//!   packet as it travelled past a router, which is the translated one. It
//!   is translated back and sent to the endpoint that can use it: an error
//!   about a reply (quoting service → client) goes to the connection's
//!   backend with the quote's source set to the backend; an error about a
//!   forwarded packet (quoting client → backend, remote mode) goes on to the
//!   client with the quote's destination set to the service. Without that,
//!   path MTU discovery fails and connections stall on large segments.
//! - [`answer`]: remote mode answers a packet it cannot forward (TTL about
//!   to expire, larger than the next hop's MTU with DF set) with the ICMP
//!   error a router sends, quoting the packet as it arrived.
//!
//! Only quotes with a plain 20-byte IPv4 header are handled; anything else
//! passes untouched. The quoted TCP checksum is left as it was (receivers
//! match quotes by addresses and ports and do not verify it). ICMPv6 is
//! [`crate::icmp6`]'s, which shares the forwarding and framing below.

use aya_ebpf::EbpfContext as _;

use aya_ebpf::bindings::xdp_action;
use aya_ebpf::helpers::generated::{bpf_xdp_adjust_head, bpf_xdp_adjust_tail};
use aya_ebpf::programs::XdpContext;
use balancer_common::l4::{FLAG_REMOTE, FlowKey, Outcome, PORT_REPLY_INGRESS, PORT_SERVICE};

use crate::conntrack;
use crate::csum;
use crate::family::{Family, IpHeader, V4};
use crate::header;
use crate::headers::{EthHdr, IcmpHdr, Ipv4Hdr, TcpPorts, VlanHdr};
use crate::l4::{HopCache, SCRATCH_XDP, Scratch, emit, next_hop};
use crate::maps::{SCRATCH4, outcome, port_has};

/// ICMP type and code of "time exceeded in transit".
pub const TIME_EXCEEDED: (u8, u8) = (IcmpHdr::TIME_EXCEEDED, 0);
/// ICMP type and code of "fragmentation needed and DF set".
pub const FRAG_NEEDED: (u8, u8) = (IcmpHdr::DEST_UNREACHABLE, IcmpHdr::FRAG_NEEDED);

/// What a quote holds: a plain IPv4 header and the first eight bytes of TCP.
const QUOTE: usize = Ipv4Hdr::MIN_LEN + size_of::<TcpPorts>();

/// Handles an ICMP packet whose IPv4 header starts at `l3` (validated by
/// the parser). A subprogram of its own: inlined, its frame would add to
/// the parser's, which holds IPv4 steering (a call chain's frames share 512
/// bytes).
#[inline(never)]
pub fn steer(ctx: &XdpContext, l3: usize, tagged: bool) -> u32 {
    let Some(ip) = header::<Ipv4Hdr>(ctx, l3) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: `header` checked the bounds; the frame is not resized below.
    let ip = unsafe { &mut *ip };
    let at = l3 + ip.header_len();
    let (Some(icmp), Some(inner), Some(ports)) = (
        header::<IcmpHdr>(ctx, at),
        header::<Ipv4Hdr>(ctx, at + IcmpHdr::LEN),
        header::<TcpPorts>(ctx, at + IcmpHdr::LEN + Ipv4Hdr::MIN_LEN),
    ) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: as above, all three inside the frame.
    let (icmp, inner, ports) = unsafe { (&mut *icmp, &mut *inner, &mut *ports) };
    if !icmp.is_error() || inner.version_ihl != 0x45 || inner.protocol != Ipv4Hdr::PROTO_TCP {
        return xdp_action::XDP_PASS;
    }
    // Either way, the quote reversed is the key of the connection's entry
    // in the direction the quoted packet did not go.
    // In this CPU's scratch slot, not this frame: the parser's, which this
    // one adds to, holds IPv4 steering.
    let Some(scratch) = SCRATCH4.get_ptr_mut(SCRATCH_XDP) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's slot, which nothing else uses during this run.
    let (key, found) = unsafe {
        Scratch::key(
            scratch,
            FlowKey::tcp(
                u32::from_ne_bytes(inner.daddr),
                u16::from_ne_bytes(ports.dest),
                u32::from_ne_bytes(inner.saddr),
                u16::from_ne_bytes(ports.source),
            ),
        )
    };
    if port_has(u16::from_be_bytes(ports.source), PORT_SERVICE)
        && conntrack::find::<V4>(key, false, found)
    {
        // SAFETY: `find` wrote it.
        let flow = unsafe { found.assume_init() };
        // About a reply (service -> client): to the backend.
        outcome(Outcome::Icmp);
        let outer_old = u32::from_ne_bytes(ip.daddr);
        ip.check = csum::replace4(u16::from_ne_bytes(ip.check), outer_old, flow.addr).to_ne_bytes();
        ip.daddr = flow.addr.to_ne_bytes();
        requote(icmp, inner, ports, End::Source, flow.addr, flow.port);
        if flow.flags & FLAG_REMOTE == 0 {
            return xdp_action::XDP_PASS;
        }
        return relay::<V4>(ctx, ip, flow.addr, HopCache::Backend(flow.backend), tagged);
    }
    if port_has(u16::from_be_bytes(ports.dest), PORT_REPLY_INGRESS)
        && conntrack::find::<V4>(key, true, found)
    {
        // SAFETY: `find` wrote it.
        let flow = unsafe { found.assume_init() };
        // About a forwarded packet (client -> backend): on to the client,
        // quoting the service it connected to.
        outcome(Outcome::Icmp);
        requote(icmp, inner, ports, End::Destination, flow.addr, flow.port);
        let client = u32::from_ne_bytes(ip.daddr);
        return relay::<V4>(ctx, ip, client, HopCache::Client(client), tagged);
    }
    xdp_action::XDP_PASS
}

/// Which end of the quoted packet a translation rewrites.
#[derive(Clone, Copy)]
pub(crate) enum End {
    Source,
    Destination,
}

/// Rewrites one end of the quote to `addr`:`port`, updating the quoted
/// IPv4 checksum and the ICMP checksum over both changes (the quoted TCP
/// checksum is left as it was, see the module doc).
#[inline(always)]
fn requote(
    icmp: &mut IcmpHdr,
    inner: &mut Ipv4Hdr,
    ports: &mut TcpPorts,
    end: End,
    addr: u32,
    port: u16,
) {
    let (old_addr, old_port) = match end {
        End::Source => (
            u32::from_ne_bytes(inner.saddr),
            u16::from_ne_bytes(ports.source),
        ),
        End::Destination => (
            u32::from_ne_bytes(inner.daddr),
            u16::from_ne_bytes(ports.dest),
        ),
    };
    let old_check = u16::from_ne_bytes(inner.check);
    let check = csum::replace4(old_check, old_addr, addr);
    inner.check = check.to_ne_bytes();
    match end {
        End::Source => {
            inner.saddr = addr.to_ne_bytes();
            ports.source = port.to_ne_bytes();
        }
        End::Destination => {
            inner.daddr = addr.to_ne_bytes();
            ports.dest = port.to_ne_bytes();
        }
    }
    let sum = csum::replace4(u16::from_ne_bytes(icmp.check), old_addr, addr);
    let sum = csum::replace2(sum, old_check, check);
    icmp.check = csum::replace2(sum, old_port, port).to_ne_bytes();
}

/// Forwards a translated ICMP error toward `dst`. An error is never
/// answered with another one: whatever cannot be forwarded here (no next
/// hop, TTL or hop limit, size, a VLAN tag) goes to the kernel.
#[inline(always)]
pub(crate) fn relay<F: Family>(
    ctx: &XdpContext,
    ip: &mut F::Hdr,
    dst: F::Addr,
    cache: HopCache<F::Addr>,
    tagged: bool,
) -> u32 {
    if tagged || ip.hops() <= 1 {
        return xdp_action::XDP_PASS;
    }
    match next_hop::<F>(ctx, ip, dst, cache) {
        Some(hop) if ip.l3_len() <= hop.mtu => emit(ctx, ip, &hop),
        _ => xdp_action::XDP_PASS,
    }
}

/// Turns the packet (IPv4 header at `l3`) into the ICMP error `kind` back
/// to its sender, quoting its IPv4 header and first eight bytes of TCP as
/// they arrived, and sends it out where it came in. `mtu` goes into
/// "fragmentation needed". A packet that cannot be quoted (IPv4 options)
/// passes to the kernel untouched.
#[inline(never)]
pub fn answer(ctx: &XdpContext, l3: usize, kind: (u8, u8), mtu: u32) -> u32 {
    Failed::action(build(ctx, l3, kind, mtu))
}

/// Why no answer was built: the frame is as it was, or already cut.
pub(crate) enum Failed {
    Untouched,
    Reshaped,
}
use Failed::{Reshaped, Untouched};

impl Failed {
    /// What becomes of a packet whose answer was (`Ok`) or was not built.
    #[inline(always)]
    pub(crate) fn action(built: Result<(), Failed>) -> u32 {
        match built {
            Ok(()) => xdp_action::XDP_TX,
            Err(Untouched) => xdp_action::XDP_PASS,
            // Half reshaped: nothing anyone could use.
            Err(Reshaped) => xdp_action::XDP_DROP,
        }
    }
}

fn build(ctx: &XdpContext, l3: usize, (kind, code): (u8, u8), mtu: u32) -> Result<(), Failed> {
    let ip = header::<Ipv4Hdr>(ctx, l3).ok_or(Untouched)?;
    // SAFETY: bounds-checked just above.
    if unsafe { (*ip).version_ihl } != 0x45 || ctx.data() + l3 + QUOTE > ctx.data_end() {
        return Err(Untouched);
    }

    // Keep exactly the quote, then make room for the new headers in front
    // of it. Nothing is saved first: the old link header and the quote are
    // still in the frame afterwards, just further in, and are read from
    // there (the stack frames of a call chain share 512 bytes).
    let grow = Ipv4Hdr::MIN_LEN + IcmpHdr::LEN;
    let shrink = (l3 + QUOTE) as i32 - (ctx.data_end() - ctx.data()) as i32;
    // SAFETY: plain helper calls on this program's context; every packet
    // pointer taken before is dead from here on.
    unsafe {
        if shrink < 0 && bpf_xdp_adjust_tail(ctx.as_ptr() as *mut _, shrink) != 0 {
            return Err(Untouched);
        }
        if bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -(grow as i32)) != 0 {
            return Err(Reshaped);
        }
    }
    let start = ctx.data();
    if start + grow + l3 + QUOTE > ctx.data_end() || l3 > EthHdr::LEN + VlanHdr::LEN {
        return Err(Reshaped);
    }
    // Layout now: [grow bytes][old link header: l3][quote], and the answer
    // is [link header: l3][IPv4][ICMP][quote]: the quote is already in place.
    // SAFETY (all accesses below): inside [start, start + grow + l3 +
    // QUOTE), checked just above.
    unsafe { reverse_link(start, grow, l3, EthHdr::ETHER_TYPE_IPV4) };
    let quote = unsafe { &*((start + l3 + grow) as *const Ipv4Hdr) };
    let (their_addr, our_addr) = (quote.saddr, quote.daddr);
    let ip = unsafe { &mut *((start + l3) as *mut Ipv4Hdr) };
    ip.version_ihl = 0x45;
    // Internetwork control, as routers send their errors.
    ip.tos = 0xc0;
    ip.tot_len = ((grow + QUOTE) as u16).to_be_bytes();
    ip.id = [0; 2];
    ip.frag_off = [0; 2];
    ip.ttl = 64;
    ip.protocol = Ipv4Hdr::PROTO_ICMP;
    ip.check = [0; 2];
    ip.saddr = our_addr;
    ip.daddr = their_addr;
    ip.check = checksum(start + l3, Ipv4Hdr::MIN_LEN).to_ne_bytes();
    let icmp = unsafe { &mut *((start + l3 + Ipv4Hdr::MIN_LEN) as *mut IcmpHdr) };
    icmp.kind = kind;
    icmp.code = code;
    icmp.check = [0; 2];
    let mtu = (mtu.min(u32::from(u16::MAX)) as u16).to_be_bytes();
    icmp.rest = [0, 0, mtu[0], mtu[1]];
    icmp.check = checksum(start + l3 + Ipv4Hdr::MIN_LEN, IcmpHdr::LEN + QUOTE).to_ne_bytes();
    Ok(())
}

/// Writes the link header of an answer at `start`, where
/// `bpf_xdp_adjust_head` made `grow` bytes of room in front of the old link
/// header (`l3` bytes: Ethernet, and one 802.1Q tag unless `l3` is
/// [`EthHdr::LEN`]): back to the sender (the MACs swapped), on the same
/// VLAN, carrying `ether_type`. The old header is read whole before
/// anything is written (the new IP header will overwrite it).
///
/// # Safety
/// `[start, start + grow + l3 + 2)` lies inside the frame, and `grow` is at
/// least `l3`.
#[inline(always)]
pub(crate) unsafe fn reverse_link(start: usize, grow: usize, l3: usize, ether_type: u16) {
    // SAFETY (all accesses): the caller's promise.
    let old_eth = unsafe { &*((start + grow) as *const EthHdr) };
    let (their_mac, our_mac) = (old_eth.src, old_eth.dst);
    let tci = unsafe { (*((start + grow + EthHdr::LEN) as *const VlanHdr)).tci };
    let eth = unsafe { &mut *(start as *mut EthHdr) };
    eth.dst = their_mac;
    eth.src = our_mac;
    if l3 != EthHdr::LEN {
        eth.ether_type = EthHdr::ETHER_TYPE_VLAN.to_be_bytes();
        let vlan = unsafe { &mut *((start + EthHdr::LEN) as *mut VlanHdr) };
        vlan.tci = tci;
        vlan.ether_type = ether_type.to_be_bytes();
    } else {
        eth.ether_type = ether_type.to_be_bytes();
    }
}

/// The Internet checksum of `len` bytes (even, constant at each call) at
/// `at`, in the packet's byte order.
#[inline(always)]
fn checksum(at: usize, len: usize) -> u16 {
    let mut sum = 0u32;
    let mut i = 0;
    while i < len {
        // SAFETY: the callers checked that [at, at + len) is in the frame.
        let word = unsafe { core::ptr::read_unaligned((at + i) as *const u16) };
        sum += u32::from(word);
        i += 2;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

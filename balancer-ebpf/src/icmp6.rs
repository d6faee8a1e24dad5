//! ICMPv6, both ways, in an XDP program of its own (`balancer_icmp6`),
//! tail-called through `ICMP6_PROGRAM`: by `balancer` for an ICMPv6 error
//! that arrives, by `balancer6` for a packet remote mode answers. IPv6
//! steering alone takes most of the verifier's million instructions per
//! program, so none of this fits into `balancer6`.
//!
//! - [`translate`]: an ICMPv6 error (destination unreachable, packet too
//!   big, time exceeded, parameter problem) about a steered connection is
//!   translated and delivered as [`crate::icmp`] does for IPv4: one about a
//!   reply (quoting service → client) goes to the connection's backend with
//!   the quote's source set to the backend; one about a forwarded packet
//!   (quoting client → backend, remote mode) goes on to the client with the
//!   quote's destination set to the service. The ICMPv6 checksum covers a
//!   pseudo-header with the outer addresses, so it is updated for the outer
//!   destination as well as for the quote (incrementally). Without this,
//!   path MTU discovery fails through the balancer.
//! - [`answer`]: remote mode answers a packet it cannot forward the way an
//!   IPv6 router does (routers never fragment): a hop limit about to expire
//!   with Time Exceeded (type 3, code 0), a packet larger than the next
//!   hop's MTU with Packet Too Big (type 2, the MTU in its word). The
//!   answer quotes as much of the packet as it arrived as fits in the
//!   minimum IPv6 MTU (RFC 4443, 2.4 (c)), comes from the address the
//!   packet was sent to (the service's, for a client's packet), as IPv4's
//!   answers do, and leaves where the packet came in.
//!
//! Quotes whose IPv6 header is followed by an extension header (anything
//! but TCP) pass untouched, as extension headers do in steering; the quoted
//! TCP checksum is left as it was (receivers match quotes by addresses and
//! ports). Every ICMPv6 message that is not an error (neighbour discovery,
//! router advertisements, echo) is passed by the parser before the tail
//! call and never gets here.
//!
//! The caller says what to do in this CPU's slot of `ICMP6_CALL` ([`Call`]),
//! written just before the tail call. The kernel allows tail calls only
//! from a program's main body while the object carries no BTF, so IPv6
//! steering (a subprogram) asks for an answer with [`ask`] and returns
//! [`ANSWER`], on which `balancer6` makes the call. This module owns that
//! hand-off and the ICMPv6 wire format; connection state is [`conntrack`]'s
//! (read only here), next hops [`crate::l4`]'s.

use aya_ebpf::EbpfContext as _;
use core::mem::MaybeUninit;

use aya_ebpf::bindings::xdp_action;
use aya_ebpf::helpers::generated::{bpf_xdp_adjust_head, bpf_xdp_adjust_tail};
use aya_ebpf::programs::XdpContext;
use balancer_common::l4::{
    Addr6, FLAG_REMOTE, Flow, FlowKey, Outcome, PORT_REPLY_INGRESS, PORT_SERVICE, PROTO_TCP,
};

use crate::conntrack;
use crate::csum;
use crate::family::{IpHeader, V6};
use crate::header;
use crate::headers::{EthHdr, IcmpHdr, Ipv6Hdr, TcpPorts, VlanHdr};
use crate::icmp::{End, Failed, relay, reverse_link};
use crate::l4::HopCache;
use crate::maps::{ICMP6_CALL, ICMP6_PROGRAM, outcome, port_has};

/// What the program is asked to do with the packet in the frame.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Call {
    /// Where the IPv6 header starts (after an 802.1Q tag, if any).
    l3: u32,
    /// [`TRANSLATE`], or the ICMPv6 type to answer the packet with.
    task: u32,
    /// Packet Too Big: the next hop's MTU.
    mtu: u32,
}

/// [`Call::task`]: the packet is an ICMPv6 error to translate.
pub const TRANSLATE: u32 = 0;

/// What IPv6 steering returns for a packet the ICMPv6 program is to answer
/// ([`ask`]): not an XDP action, `balancer6` makes the tail call on it.
pub const ANSWER: u32 = 0x100;

/// The most of a packet an answer quotes: what fits in the minimum IPv6
/// MTU after the answer's own IPv6 and ICMPv6 headers.
const MAX_QUOTE: usize = 1280 - Ipv6Hdr::LEN - IcmpHdr::LEN;

/// Says what the ICMPv6 program is to do with the packet (IPv6 header at
/// `l3`): `task` is [`TRANSLATE`], or an ICMPv6 type to answer with (`mtu`
/// for Packet Too Big). [`call`] follows in the same program run, on this
/// CPU.
#[inline(always)]
pub fn ask(l3: usize, task: u32, mtu: u32) {
    if let Some(call) = ICMP6_CALL.get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a successful lookup; nothing else
        // runs on this CPU until the ICMPv6 program has read it.
        unsafe {
            *call = Call {
                l3: l3 as u32,
                task,
                mtu,
            }
        };
    }
}

/// Tail-calls the ICMPv6 program (after [`ask`]). Returns only if it is
/// not there: the caller passes the packet to the kernel untouched.
#[inline(always)]
pub fn call(ctx: &XdpContext) {
    // SAFETY: a tail call with this program's own context; it returns only
    // when it did not happen.
    unsafe { ICMP6_PROGRAM.tail_call(ctx, 0) };
}

/// The program's body: does what its caller asked in `ICMP6_CALL`.
#[inline(always)]
pub fn run(ctx: &XdpContext) -> u32 {
    let Some(&Call { l3, task, mtu }) = ICMP6_CALL.get(0) else {
        return xdp_action::XDP_PASS;
    };
    // Masked first, so the verifier sees a bound on the frame offset.
    let l3 = (l3 & 0x1f) as usize;
    if l3 != EthHdr::LEN && l3 != EthHdr::LEN + VlanHdr::LEN {
        return xdp_action::XDP_PASS;
    }
    if task == TRANSLATE {
        translate(ctx, l3)
    } else {
        answer(ctx, l3, task as u8, mtu)
    }
}

/// Translates the ICMPv6 error whose IPv6 header is at `l3` (an error, as
/// the parser checked) if it is about a steered connection.
#[inline(always)]
fn translate(ctx: &XdpContext, l3: usize) -> u32 {
    let at = l3 + Ipv6Hdr::LEN;
    let (Some(ip), Some(icmp), Some(inner), Some(ports)) = (
        header::<Ipv6Hdr>(ctx, l3),
        header::<IcmpHdr>(ctx, at),
        header::<Ipv6Hdr>(ctx, at + IcmpHdr::LEN),
        header::<TcpPorts>(ctx, at + IcmpHdr::LEN + Ipv6Hdr::LEN),
    ) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: all four inside the frame, checked just above; the frame is
    // not resized below.
    let (ip, icmp, inner, ports) = unsafe { (&mut *ip, &mut *icmp, &mut *inner, &mut *ports) };
    if inner.version() != 6 || inner.next_header != PROTO_TCP {
        return xdp_action::XDP_PASS;
    }
    // Either way, the quote reversed is the key of the connection's entry
    // in the direction the quoted packet did not go.
    let key = FlowKey::tcp(
        inner.dst(),
        u16::from_ne_bytes(ports.dest),
        inner.src(),
        u16::from_ne_bytes(ports.source),
    );
    let tagged = l3 != EthHdr::LEN;

    let mut found = MaybeUninit::<Flow<Addr6>>::uninit();
    if port_has(u16::from_be_bytes(ports.source), PORT_SERVICE)
        && conntrack::find::<V6>(&key, false, &mut found)
    {
        // SAFETY: `find` wrote it.
        let flow = unsafe { found.assume_init() };
        // About a reply (service -> client): to the backend, whose address
        // the pseudo-header then carries.
        outcome(Outcome::Icmp);
        let check = Ipv6Hdr::csum_addr(u16::from_ne_bytes(icmp.check), ip.dst(), flow.addr);
        icmp.check = check.to_ne_bytes();
        ip.set_dst(flow.addr);
        requote(icmp, inner, ports, End::Source, flow.addr, flow.port);
        if flow.flags & FLAG_REMOTE == 0 {
            return xdp_action::XDP_PASS;
        }
        return relay::<V6>(ctx, ip, flow.addr, HopCache::Backend(flow.backend), tagged);
    }
    if port_has(u16::from_be_bytes(ports.dest), PORT_REPLY_INGRESS)
        && conntrack::find::<V6>(&key, true, &mut found)
    {
        // SAFETY: `find` wrote it.
        let flow = unsafe { found.assume_init() };
        // About a forwarded packet (client -> backend): on to the client,
        // quoting the service it connected to.
        outcome(Outcome::Icmp);
        requote(icmp, inner, ports, End::Destination, flow.addr, flow.port);
        let client = ip.dst();
        return relay::<V6>(ctx, ip, client, HopCache::Client(client), tagged);
    }
    xdp_action::XDP_PASS
}

/// Rewrites one end of the quote to `addr`:`port` and updates the ICMPv6
/// checksum for both changes (the quoted TCP checksum is left as it was,
/// see the module doc).
#[inline(always)]
fn requote(
    icmp: &mut IcmpHdr,
    inner: &mut Ipv6Hdr,
    ports: &mut TcpPorts,
    end: End,
    addr: Addr6,
    port: u16,
) {
    let (old_addr, old_port) = match end {
        End::Source => (inner.src(), u16::from_ne_bytes(ports.source)),
        End::Destination => (inner.dst(), u16::from_ne_bytes(ports.dest)),
    };
    match end {
        End::Source => {
            inner.set_src(addr);
            ports.source = port.to_ne_bytes();
        }
        End::Destination => {
            inner.set_dst(addr);
            ports.dest = port.to_ne_bytes();
        }
    }
    let sum = Ipv6Hdr::csum_addr(u16::from_ne_bytes(icmp.check), old_addr, addr);
    icmp.check = csum::replace2(sum, old_port, port).to_ne_bytes();
}

/// Turns the packet (IPv6 header at `l3`) into the ICMPv6 error `kind`
/// back to its sender (`mtu` in its word) and sends it out where it came
/// in (steering counted it).
#[inline(always)]
fn answer(ctx: &XdpContext, l3: usize, kind: u8, mtu: u32) -> u32 {
    Failed::action(build(ctx, l3, kind, mtu))
}

fn build(ctx: &XdpContext, l3: usize, kind: u8, mtu: u32) -> Result<(), Failed> {
    let ip = header::<Ipv6Hdr>(ctx, l3).ok_or(Failed::Untouched)?;
    let frame = ctx.data_end() - ctx.data();
    // SAFETY: bounds-checked just above.
    let stated = Ipv6Hdr::LEN + usize::from(u16::from_be_bytes(unsafe { (*ip).payload_len }));
    // The packet as it arrived: a frame may carry padding past it.
    let quote = stated.min(frame - l3).min(MAX_QUOTE);

    // Keep the quote, then make room for the new headers in front of it;
    // the old link header and the quote are read where they then are (see
    // `icmp::build`, which does the same for IPv4).
    let grow = Ipv6Hdr::LEN + IcmpHdr::LEN;
    let shrink = (l3 + quote) as i32 - frame as i32;
    // SAFETY: plain helper calls on this program's context; every packet
    // pointer taken before is dead from here on.
    unsafe {
        if shrink < 0 && bpf_xdp_adjust_tail(ctx.as_ptr() as *mut _, shrink) != 0 {
            return Err(Failed::Untouched);
        }
        if bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -(grow as i32)) != 0 {
            return Err(Failed::Reshaped);
        }
    }
    let start = ctx.data();
    if start + grow + l3 + Ipv6Hdr::LEN > ctx.data_end() {
        return Err(Failed::Reshaped);
    }
    // Layout now: [grow bytes][old link header: l3][quote], and the answer
    // is [link header: l3][IPv6][ICMPv6][quote].
    // SAFETY (all accesses below): inside [start, start + grow + l3 + 40),
    // checked just above; the quote's addresses are read before the new
    // IPv6 header is written (they do not overlap, the old link header
    // does, and `reverse_link` reads it first).
    unsafe { reverse_link(start, grow, l3, EthHdr::ETHER_TYPE_IPV6) };
    let quoted = unsafe { &*((start + grow + l3) as *const Ipv6Hdr) };
    let (their_addr, our_addr) = (quoted.src(), quoted.dst());
    let ip = unsafe { &mut *((start + l3) as *mut Ipv6Hdr) };
    // Version 6, traffic class "network control" (as routers send their
    // errors; IPv4's answers say the same), no flow label.
    ip.vtc_flow = [0x6c, 0, 0, 0];
    let len = ((IcmpHdr::LEN + quote) as u16).to_be_bytes();
    ip.payload_len = len;
    ip.next_header = Ipv6Hdr::NEXT_ICMPV6;
    ip.hop_limit = 64;
    ip.set_src(our_addr);
    ip.set_dst(their_addr);
    let icmp = unsafe { &mut *((start + l3 + Ipv6Hdr::LEN) as *mut IcmpHdr) };
    icmp.kind = kind;
    icmp.code = 0;
    icmp.check = [0; 2];
    icmp.rest = mtu.to_be_bytes();
    // The pseudo-header (RFC 8200, 8.1): both addresses, the length as 32
    // bits and the next header as 32 bits, in the packet's byte order.
    let pseudo = words(our_addr)
        + words(their_addr)
        + u32::from(u16::from_ne_bytes(len))
        + u32::from(u16::from_ne_bytes([0, Ipv6Hdr::NEXT_ICMPV6]));
    let message =
        sum(ctx, start + l3 + Ipv6Hdr::LEN, IcmpHdr::LEN + quote).ok_or(Failed::Reshaped)?;
    icmp.check = csum::fold(pseudo + message).to_ne_bytes();
    Ok(())
}

/// The 16-bit words of an address, summed.
#[inline(always)]
fn words(addr: Addr6) -> u32 {
    addr.iter().map(|w| (w & 0xffff) + (w >> 16)).sum()
}

/// The unfolded one's-complement sum of the `len` bytes at `at` (at most
/// an answer's ICMPv6 message; an odd last byte is padded with zero), or
/// `None` if they run past the frame.
#[inline(always)]
fn sum(ctx: &XdpContext, at: usize, len: usize) -> Option<u32> {
    const MAX: usize = IcmpHdr::LEN + MAX_QUOTE;
    let len = len.min(MAX);
    let mut sum = 0u32;
    for i in 0..MAX / 2 {
        let offset = 2 * i;
        if offset + 2 > len {
            break;
        }
        let p = at + offset;
        if p + 2 > ctx.data_end() {
            return None;
        }
        // SAFETY: inside the frame, checked just above.
        sum += u32::from(unsafe { core::ptr::read_unaligned(p as *const u16) });
    }
    if len % 2 == 1 {
        let p = at + len - 1;
        if p + 1 > ctx.data_end() {
            return None;
        }
        // SAFETY: inside the frame, checked just above.
        sum += u32::from(u16::from_ne_bytes([unsafe { *(p as *const u8) }, 0]));
    }
    Some(sum)
}

//! The balancer's XDP programs, and the TC program that goes with them.
//!
//! `balancer` (XDP) parses Ethernet (with at most one 802.1Q tag) / IPv4 or
//! IPv6 / TCP (or ICMP, or an ICMPv6 error) and counts every packet under
//! one [`Verdict`] in the per-CPU `VERDICTS` array; a TCP packet then goes
//! through L4 steering ([`l4`]), an ICMP one through [`icmp`], which count
//! what they did under an `Outcome`. IPv6 TCP is steered by `balancer6`,
//! which `balancer` tail-calls once it has counted the segment and found
//! that its ports may be a service's, as for IPv4: one program could not hold both families
//! within the verifier's limits (measured: 512 bytes of stack for a call
//! chain, a million instructions walked per program). ICMPv6 errors, and
//! the answers remote mode sends to IPv6 packets it cannot forward, are
//! `balancer_icmp6`'s ([`icmp6`]), tail-called by both.
//! `balancer_egress` (TC egress, local mode) restores the service address on
//! the replies of local backends ([`egress`]). Connection state is
//! [`conntrack`]'s.
//!
//! The crate only means something for `bpfel-unknown-none`; on the host it
//! builds to a binary that says so, which keeps `cargo test --workspace` and
//! `cargo clippy --workspace` working.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// `atomic` uses the atomic intrinsics the target's library types lack.
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

mod atomic;
mod conntrack;
mod csum;
mod egress;
mod family;
mod headers;
mod icmp;
mod icmp6;
mod l4;
mod maps;

use aya_ebpf::{
    bindings::xdp_action,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use aya_log_ebpf::debug;
use balancer_common::Verdict;
use balancer_common::l4::{Outcome, PORT_REPLY_INGRESS, PORT_SERVICE};
use family::{Family, V4, V6};
use headers::{EthHdr, IcmpHdr, Ipv4Hdr, Ipv6Hdr, TcpHdr, VlanHdr};
use l4::TcpPacket;

// Inlined into the entry point the macro makes, which LLVM stops doing by
// itself once steering is inlined here: a tail call may not be made from a
// subprogram. (The same for `balancer6`.)
#[xdp]
#[inline(always)]
pub fn balancer(ctx: XdpContext) -> u32 {
    // Fail open: when this program cannot do its job the packet still gets
    // to the kernel, which is where it would have gone without us.
    dispatch::<false>(&ctx)
}

/// IPv6 TCP, tail-called by `balancer`: the same parser, in a program of
/// its own, because the verifier's limits (512 bytes of stack for a call
/// chain, a million instructions walked) do not hold both families'
/// steering in one.
#[xdp]
#[inline(always)]
pub fn balancer6(ctx: XdpContext) -> u32 {
    let action = dispatch::<true>(&ctx);
    if action != icmp6::ANSWER {
        return action;
    }
    // Remote mode answers the packet (hop limit, MTU): steering says so
    // and the call is made here, where nothing can make it a subprogram's.
    icmp6::call(&ctx);
    // No ICMPv6 program: the packet goes to the kernel as it came.
    xdp_action::XDP_PASS
}

/// ICMPv6 errors about steered connections, and remote mode's answers to
/// IPv6 packets it cannot forward: tail-called by `balancer` and
/// `balancer6`, which say what to do ([`icmp6::run`]).
#[xdp]
pub fn balancer_icmp6(ctx: XdpContext) -> u32 {
    icmp6::run(&ctx)
}

#[classifier]
pub fn balancer_egress(ctx: TcContext) -> i32 {
    egress::restore(&ctx)
}

/// Counts the packet under its verdict and hands TCP and ICMP to steering;
/// IPv6 TCP to `balancer6` unless this is it (`IPV6_HERE`).
/// (It dispatches itself rather than returning what it parsed: LLVM turns
/// an enum of parsed headers into code the verifier rejects.)
#[inline(always)]
fn dispatch<const IPV6_HERE: bool>(ctx: &XdpContext) -> u32 {
    // SAFETY (the dereferences below): `header` checked that each header
    // lies inside the frame, and nothing writes the frame during parsing.
    let Some(eth) = header::<EthHdr>(ctx, 0).map(|p| unsafe { &*p }) else {
        debug!(ctx, "frame shorter than an Ethernet header");
        return pass(Verdict::PassTruncated);
    };
    let (l3, tagged, ether_type) = match eth.ether_type() {
        // One 802.1Q tag (GPU nodes often sit on VLANs); stacked tags and
        // other encapsulations are the kernel's.
        EthHdr::ETHER_TYPE_VLAN => {
            let Some(vlan) = header::<VlanHdr>(ctx, EthHdr::LEN).map(|p| unsafe { &*p }) else {
                return pass(Verdict::PassTruncated);
            };
            (
                EthHdr::LEN + VlanHdr::LEN,
                true,
                u16::from_be_bytes(vlan.ether_type),
            )
        }
        other => (EthHdr::LEN, false, other),
    };
    match ether_type {
        // `balancer6` only ever gets IPv6 TCP; without this arm its
        // verification would walk the IPv4 paths too.
        _ if IPV6_HERE && ether_type != EthHdr::ETHER_TYPE_IPV6 => xdp_action::XDP_PASS,
        EthHdr::ETHER_TYPE_IPV4 => ipv4(ctx, l3, tagged),
        EthHdr::ETHER_TYPE_IPV6 => ipv6::<IPV6_HERE>(ctx, l3, tagged),
        _ => pass(Verdict::PassNotIpv4),
    }
}

/// Counts `verdict` and lets the packet through.
#[inline(always)]
fn pass(verdict: Verdict) -> u32 {
    maps::bump(&maps::VERDICTS, verdict.index());
    xdp_action::XDP_PASS
}

/// An IPv4 packet at `l3`.
#[inline(always)]
fn ipv4(ctx: &XdpContext, l3: usize, tagged: bool) -> u32 {
    let Some(ip_ptr) = header::<Ipv4Hdr>(ctx, l3) else {
        debug!(ctx, "IPv4 header runs past the frame");
        return pass(Verdict::PassTruncated);
    };
    // SAFETY: as in `dispatch`.
    let ip = unsafe { &*ip_ptr };
    let header_len = ip.header_len();
    if ip.version() != 4 || header_len < Ipv4Hdr::MIN_LEN {
        debug!(
            ctx,
            "bad IPv4 header: version {}, header length {}",
            ip.version(),
            header_len
        );
        return pass(Verdict::PassMalformed);
    }
    // Before the protocol check: a later fragment carries no transport
    // header at all, whatever protocol it belongs to.
    if ip.is_fragment() {
        return pass(Verdict::PassFragment);
    }
    if ip.protocol == Ipv4Hdr::PROTO_ICMP {
        maps::bump(&maps::VERDICTS, Verdict::Icmp.index());
        return icmp::steer(ctx, l3, tagged);
    }
    if ip.protocol != Ipv4Hdr::PROTO_TCP {
        return pass(Verdict::PassNotTcp);
    }
    tcp::<V4, false>(ctx, ip_ptr, l3, l3 + header_len, tagged)
}

/// An IPv6 packet at `l3`. Extension headers are not walked: a packet with
/// any (hop-by-hop, routing, destination options, ...) is the kernel's, and
/// so is a fragment. An ICMPv6 error goes to `balancer_icmp6`; every other
/// ICMPv6 message (neighbour discovery and router advertisements among
/// them) passes untouched, decided here.
#[inline(always)]
fn ipv6<const HERE: bool>(ctx: &XdpContext, l3: usize, tagged: bool) -> u32 {
    let Some(ip_ptr) = header::<Ipv6Hdr>(ctx, l3) else {
        debug!(ctx, "IPv6 header runs past the frame");
        return pass(Verdict::PassTruncated);
    };
    // SAFETY: as in `dispatch`.
    let ip = unsafe { &*ip_ptr };
    if ip.version() != 6 {
        return pass(Verdict::PassMalformed);
    }
    match ip.next_header {
        // `balancer` counted the segment before the tail call.
        Ipv4Hdr::PROTO_TCP if HERE => tcp::<V6, true>(ctx, ip_ptr, l3, l3 + Ipv6Hdr::LEN, tagged),
        Ipv4Hdr::PROTO_TCP => {
            let Some(tcp_ptr) = header::<TcpHdr>(ctx, l3 + Ipv6Hdr::LEN) else {
                debug!(ctx, "TCP header runs past the frame");
                return pass(Verdict::PassTruncated);
            };
            // SAFETY: as in `dispatch`.
            let tcp = unsafe { &*tcp_ptr };
            count_tcp(is_syn(tcp));
            // Most TCP is for nothing steered: as for IPv4, two array reads
            // decide that before the tail call, which costs more than they.
            if port_marks::<V6>(tcp) == 0 {
                maps::outcome(Outcome::NotService);
                return xdp_action::XDP_PASS;
            }
            // SAFETY: a tail call with this program's own context; it
            // returns only when it did not happen.
            unsafe { maps::IPV6_PROGRAM.tail_call(ctx, 0) };
            // No IPv6 program (the agent puts it in after loading): the
            // packet is not steered.
            maps::outcome(Outcome::NotService);
            xdp_action::XDP_PASS
        }
        Ipv6Hdr::NEXT_ICMPV6 if !HERE => {
            let Some(icmp) = header::<IcmpHdr>(ctx, l3 + Ipv6Hdr::LEN) else {
                return pass(Verdict::PassTruncated);
            };
            // SAFETY: as in `dispatch`.
            if !unsafe { &*icmp }.is_error6() {
                return pass(Verdict::PassNotTcp);
            }
            maps::bump(&maps::VERDICTS, Verdict::Icmp.index());
            icmp6::ask(l3, icmp6::TRANSLATE, 0);
            icmp6::call(ctx);
            // No ICMPv6 program: the error goes to the kernel as it is.
            xdp_action::XDP_PASS
        }
        Ipv6Hdr::NEXT_FRAGMENT => pass(Verdict::PassFragment),
        next if Ipv6Hdr::is_extension(next) => pass(Verdict::PassExtHeader),
        _ => pass(Verdict::PassNotTcp),
    }
}

/// A TCP segment at `l4` of an IP packet of family `F` at `l3`: counted as
/// a SYN or not (unless `COUNTED`: the program that tail-called this one
/// did), then steered if its ports say it may be a service's.
#[inline(always)]
fn tcp<F: Family, const COUNTED: bool>(
    ctx: &XdpContext,
    ip: *mut F::Hdr,
    l3: usize,
    l4: usize,
    tagged: bool,
) -> u32 {
    let Some(tcp_ptr) = header::<TcpHdr>(ctx, l4) else {
        debug!(ctx, "TCP header runs past the frame");
        return pass(Verdict::PassTruncated);
    };
    // SAFETY: as in `dispatch`.
    let tcp = unsafe { &*tcp_ptr };
    let syn = is_syn(tcp);
    // What is learnt goes into one word at once: across the three map
    // lookups below, the context, both header pointers and this word fit
    // the four registers a call preserves, so this frame spills nothing
    // (it counts toward the 512 bytes of the chain into steering).
    let mut marks = TcpPacket::<F>::with_l3(l3);
    if syn {
        marks |= TcpPacket::<F>::SYN;
    }
    if tagged {
        marks |= TcpPacket::<F>::TAGGED;
    }
    if !COUNTED {
        count_tcp(syn);
    }
    // Most TCP is for nothing steered: two array reads decide that here,
    // before the call into steering.
    let ports = port_marks::<F>(tcp);
    if ports == 0 {
        maps::outcome(Outcome::NotService);
        return xdp_action::XDP_PASS;
    }
    l4::steer::<F>(ctx.ctx, ip, tcp_ptr, marks | ports)
}

/// Whether `tcp` opens a connection. A SYN-ACK answers a connection
/// someone else opened, so it is not where a new steering decision belongs.
#[inline(always)]
fn is_syn(tcp: &TcpHdr) -> bool {
    tcp.flags & TcpHdr::SYN != 0 && tcp.flags & TcpHdr::ACK == 0
}

/// Counts a TCP segment under its verdict.
#[inline(always)]
fn count_tcp(syn: bool) {
    let verdict = if syn {
        Verdict::TcpSyn
    } else {
        Verdict::TcpOther
    };
    maps::bump(&maps::VERDICTS, verdict.index());
}

/// The marks `tcp`'s ports earn (`TO_SERVICE`, `FROM_BACKEND`); none: the
/// segment is for nothing steered.
#[inline(always)]
fn port_marks<F: Family>(tcp: &TcpHdr) -> u32 {
    let mut marks = 0;
    if maps::port_has(u16::from_be_bytes(tcp.dest), PORT_SERVICE) {
        marks |= TcpPacket::<F>::TO_SERVICE;
    }
    if maps::port_has(u16::from_be_bytes(tcp.source), PORT_REPLY_INGRESS) {
        marks |= TcpPacket::<F>::FROM_BACKEND;
    }
    marks
}

/// A pointer to the `T` at `offset` bytes into the frame, if all of it lies
/// inside (a raw pointer, because steering writes through it later).
///
/// The headers are byte arrays (alignment 1), so any offset is fine, and
/// the explicit `data_end` comparison is what the verifier needs to see
/// before it allows the read.
#[inline(always)]
pub(crate) fn header<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let start = ctx.data() + offset;
    if start + size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some(start as *mut T)
}

// The kernel refuses GPL-only helpers (bpf_fib_lookup among them, which the
// L4 forwarding path needs) to programs without a GPL-compatible license.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!(
        "balancer-ebpf is the XDP program, not a host binary: build it with \
         `cargo xtask build-ebpf`; the balancer agent loads it"
    );
    std::process::exit(2);
}

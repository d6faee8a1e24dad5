//! The balancer's XDP program, and the TC program that goes with it.
//!
//! `balancer` (XDP) parses Ethernet (with at most one 802.1Q tag) / IPv4 /
//! TCP or ICMP and counts every packet under one [`Verdict`] in the per-CPU
//! `VERDICTS` array; a TCP packet then goes through L4 steering ([`l4`]), an
//! ICMP one through [`icmp`], which count what they did under an `Outcome`.
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
mod headers;
mod icmp;
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
use headers::{EthHdr, Ipv4Hdr, TcpHdr, VlanHdr};
use l4::TcpPacket;

#[xdp]
pub fn balancer(ctx: XdpContext) -> u32 {
    // Fail open: when this program cannot do its job the packet still gets
    // to the kernel, which is where it would have gone without us.
    dispatch(&ctx)
}

#[classifier]
pub fn balancer_egress(ctx: TcContext) -> i32 {
    egress::restore(&ctx)
}

/// Counts the packet under its verdict and hands TCP and ICMP to steering.
/// (It dispatches itself rather than returning what it parsed: LLVM turns
/// an enum of parsed headers into code the verifier rejects.)
fn dispatch(ctx: &XdpContext) -> u32 {
    let pass = |verdict: Verdict| {
        maps::bump(&maps::VERDICTS, verdict.index());
        xdp_action::XDP_PASS
    };
    // SAFETY (the dereferences below): `header` checked that each header
    // lies inside the frame, and nothing writes the frame during parsing.
    let Some(eth) = header::<EthHdr>(ctx, 0).map(|p| unsafe { &*p }) else {
        debug!(ctx, "frame shorter than an Ethernet header");
        return pass(Verdict::PassTruncated);
    };
    let (l3, tagged) = match eth.ether_type() {
        EthHdr::ETHER_TYPE_IPV4 => (EthHdr::LEN, false),
        // One 802.1Q tag (GPU nodes often sit on VLANs); stacked tags and
        // other encapsulations are the kernel's.
        EthHdr::ETHER_TYPE_VLAN => {
            let Some(vlan) = header::<VlanHdr>(ctx, EthHdr::LEN).map(|p| unsafe { &*p }) else {
                return pass(Verdict::PassTruncated);
            };
            if u16::from_be_bytes(vlan.ether_type) != EthHdr::ETHER_TYPE_IPV4 {
                return pass(Verdict::PassNotIpv4);
            }
            (EthHdr::LEN + VlanHdr::LEN, true)
        }
        _ => return pass(Verdict::PassNotIpv4),
    };

    let Some(ip_ptr) = header::<Ipv4Hdr>(ctx, l3) else {
        debug!(ctx, "IPv4 header runs past the frame");
        return pass(Verdict::PassTruncated);
    };
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

    let Some(tcp_ptr) = header::<TcpHdr>(ctx, l3 + header_len) else {
        debug!(ctx, "TCP header runs past the frame");
        return pass(Verdict::PassTruncated);
    };
    let tcp = unsafe { &*tcp_ptr };
    // A SYN-ACK answers a connection someone else opened, so it is not
    // where a new steering decision belongs.
    let syn = tcp.flags & TcpHdr::SYN != 0 && tcp.flags & TcpHdr::ACK == 0;
    let verdict = if syn {
        Verdict::TcpSyn
    } else {
        Verdict::TcpOther
    };
    maps::bump(&maps::VERDICTS, verdict.index());
    // Most TCP is for nothing steered: two array reads decide that here,
    // before the call into steering.
    let to_service = maps::port_has(u16::from_be_bytes(tcp.dest), PORT_SERVICE);
    let from_backend = maps::port_has(u16::from_be_bytes(tcp.source), PORT_REPLY_INGRESS);
    if !to_service && !from_backend {
        maps::outcome(Outcome::NotService);
        return xdp_action::XDP_PASS;
    }
    let packet = TcpPacket {
        ip: ip_ptr,
        tcp: tcp_ptr,
        syn,
        l3,
        tagged,
        to_service,
        from_backend,
    };
    l4::steer(ctx, &packet)
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

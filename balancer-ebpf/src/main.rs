//! The balancer's XDP program, and the TC program that goes with it.
//!
//! `balancer` (XDP) parses Ethernet / IPv4 / TCP and counts every packet
//! under one [`Verdict`] in the per-CPU `VERDICTS` array; a TCP packet then
//! goes through L4 steering ([`l4`]), which counts what it did under an
//! `Outcome`. `balancer_egress` (TC egress, local mode) restores the service
//! address on the replies of local backends ([`egress`]).
//!
//! The crate only means something for `bpfel-unknown-none`; on the host it
//! builds to a binary that says so, which keeps `cargo test --workspace` and
//! `cargo clippy --workspace` working.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

mod csum;
mod egress;
mod headers;
mod l4;
mod maps;

use aya_ebpf::{
    bindings::xdp_action,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use aya_log_ebpf::debug;
use balancer_common::Verdict;
use headers::{EthHdr, Ipv4Hdr, TcpHdr};
use l4::TcpPacket;

#[xdp]
pub fn balancer(ctx: XdpContext) -> u32 {
    // Fail open: when this program cannot do its job the packet still gets
    // to the kernel, which is where it would have gone without us.
    let (verdict, tcp) = classify(&ctx);
    maps::bump(&maps::VERDICTS, verdict.index());
    match tcp {
        Some(packet) => l4::steer(&ctx, &packet),
        None => xdp_action::XDP_PASS,
    }
}

#[classifier]
pub fn balancer_egress(ctx: TcContext) -> i32 {
    egress::restore(&ctx)
}

/// The packet's verdict, and for TCP the headers steering works on.
fn classify(ctx: &XdpContext) -> (Verdict, Option<TcpPacket>) {
    // SAFETY (the dereferences below): `header` checked that each header
    // lies inside the frame, and nothing writes the frame during parsing.
    let Some(eth) = header::<EthHdr>(ctx, 0).map(|p| unsafe { &*p }) else {
        debug!(ctx, "frame shorter than an Ethernet header");
        return (Verdict::PassTruncated, None);
    };
    if eth.ether_type() != EthHdr::ETHER_TYPE_IPV4 {
        return (Verdict::PassNotIpv4, None);
    }

    let Some(ip_ptr) = header::<Ipv4Hdr>(ctx, EthHdr::LEN) else {
        debug!(ctx, "IPv4 header runs past the frame");
        return (Verdict::PassTruncated, None);
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
        return (Verdict::PassMalformed, None);
    }
    // Before the protocol check: a later fragment carries no transport
    // header at all, whatever protocol it belongs to.
    if ip.is_fragment() {
        return (Verdict::PassFragment, None);
    }
    if ip.protocol != Ipv4Hdr::PROTO_TCP {
        return (Verdict::PassNotTcp, None);
    }

    let Some(tcp_ptr) = header::<TcpHdr>(ctx, EthHdr::LEN + header_len) else {
        debug!(ctx, "TCP header runs past the frame");
        return (Verdict::PassTruncated, None);
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
    let packet = TcpPacket {
        ip: ip_ptr,
        tcp: tcp_ptr,
        syn,
    };
    (verdict, Some(packet))
}

/// A pointer to the `T` at `offset` bytes into the frame, if all of it lies
/// inside (a raw pointer, because steering writes through it later).
///
/// The headers are byte arrays (alignment 1), so any offset is fine, and
/// the explicit `data_end` comparison is what the verifier needs to see
/// before it allows the read.
#[inline(always)]
fn header<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
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

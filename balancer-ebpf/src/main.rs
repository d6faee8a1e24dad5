//! The balancer's XDP program.
//!
//! It parses Ethernet / IPv4 / TCP and counts every packet under one
//! [`Verdict`] in the per-CPU `VERDICTS` array. For now every packet goes on
//! to the kernel (`XDP_PASS`); the L4 steering work hooks in where a TCP
//! packet has been classified, with the parsed headers at hand.
//!
//! The crate only means something for `bpfel-unknown-none`; on the host it
//! builds to a binary that says so, which keeps `cargo test --workspace` and
//! `cargo clippy --workspace` working.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

mod headers;

use aya_ebpf::{
    bindings::xdp_action, macros::map, macros::xdp, maps::PerCpuArray, programs::XdpContext,
};
use aya_log_ebpf::debug;
use balancer_common::Verdict;
use headers::{EthHdr, Ipv4Hdr, TcpHdr};

// Userspace finds maps and programs by their symbol names, which
// balancer_common::{VERDICTS_MAP, PROGRAM_NAME} spell out for it.
#[map]
static VERDICTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Verdict::COUNT as u32, 0);

#[xdp]
pub fn balancer(ctx: XdpContext) -> u32 {
    // Fail open: this program only ever adds a fast path in front of the
    // kernel, so when it cannot do its job the packet still gets through.
    try_balancer(&ctx).unwrap_or(xdp_action::XDP_PASS)
}

fn try_balancer(ctx: &XdpContext) -> Result<u32, ()> {
    let verdict = classify(ctx);
    count(verdict)?;
    Ok(xdp_action::XDP_PASS)
}

fn count(verdict: Verdict) -> Result<(), ()> {
    let counter = VERDICTS.get_ptr_mut(verdict.index()).ok_or(())?;
    // SAFETY: the pointer comes from a successful map lookup and the slot is
    // this CPU's own, so nothing else writes it while the program runs.
    unsafe { *counter += 1 };
    Ok(())
}

fn classify(ctx: &XdpContext) -> Verdict {
    let Some(eth) = header::<EthHdr>(ctx, 0) else {
        debug!(ctx, "frame shorter than an Ethernet header");
        return Verdict::PassTruncated;
    };
    if eth.ether_type() != EthHdr::ETHER_TYPE_IPV4 {
        return Verdict::PassNotIpv4;
    }

    let Some(ip) = header::<Ipv4Hdr>(ctx, EthHdr::LEN) else {
        debug!(ctx, "IPv4 header runs past the frame");
        return Verdict::PassTruncated;
    };
    let header_len = ip.header_len();
    if ip.version() != 4 || header_len < Ipv4Hdr::MIN_LEN {
        debug!(
            ctx,
            "bad IPv4 header: version {}, header length {}",
            ip.version(),
            header_len
        );
        return Verdict::PassMalformed;
    }
    // Before the protocol check: a later fragment carries no transport
    // header at all, whatever protocol it belongs to.
    if ip.is_fragment() {
        return Verdict::PassFragment;
    }
    if ip.protocol != Ipv4Hdr::PROTO_TCP {
        return Verdict::PassNotTcp;
    }

    let Some(tcp) = header::<TcpHdr>(ctx, EthHdr::LEN + header_len) else {
        debug!(ctx, "TCP header runs past the frame");
        return Verdict::PassTruncated;
    };
    // A SYN-ACK answers a connection someone else opened, so it is not
    // where a new steering decision belongs.
    if tcp.flags & TcpHdr::SYN != 0 && tcp.flags & TcpHdr::ACK == 0 {
        Verdict::TcpSyn
    } else {
        Verdict::TcpOther
    }
}

/// The `T` at `offset` bytes into the frame, if all of it lies inside.
///
/// The headers are byte arrays (alignment 1), so any offset is fine, and
/// the explicit `data_end` comparison is what the verifier needs to see
/// before it allows the read.
#[inline(always)]
fn header<T>(ctx: &XdpContext, offset: usize) -> Option<&T> {
    let start = ctx.data() + offset;
    if start + size_of::<T>() > ctx.data_end() {
        return None;
    }
    // SAFETY: the bounds check above keeps the whole `T` inside the frame,
    // which stays mapped and unmodified for the rest of this run.
    Some(unsafe { &*(start as *const T) })
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

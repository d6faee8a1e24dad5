//! Local mode, TC egress: a local backend answers from its own address and
//! port; before the answer leaves, it gets the service's back, so the client
//! sees the address it connected to (IPv4 and IPv6 alike).
//!
//! Unlike XDP, TC has checksum helpers, and they are needed: a locally sent
//! segment usually carries a partial checksum (`CHECKSUM_PARTIAL`, the
//! device or the stack completes it later), which only the helpers update
//! correctly. Reads go through `bpf_skb_load_bytes`, which also works when
//! the headers are not in the linear part of the buffer.

use aya_ebpf::bindings::TC_ACT_OK;
use aya_ebpf::helpers::generated::bpf_skb_load_bytes;
use aya_ebpf::programs::TcContext;
use balancer_common::l4::{FlowKey, Outcome, PORT_REPLY_EGRESS};

use crate::conntrack;
use crate::family::{Family, IpHeader, V4, V6};
use crate::headers::{EthHdr, Ipv4Hdr, Ipv6Hdr, TcpHdr, VlanHdr};
use crate::l4::{SCRATCH_EGRESS, Scratch};
use crate::maps::{SCRATCH6, backend_stats, outcome, port_has};

pub fn restore(ctx: &TcContext) -> i32 {
    // Whatever goes wrong, the packet leaves as it is: this program only
    // ever undoes the XDP program's rewrite.
    let _ = try_restore(ctx);
    TC_ACT_OK
}

fn try_restore(ctx: &TcContext) -> Result<(), i64> {
    let eth: EthHdr = ctx.load(0)?;
    // A VLAN tag is in the frame only without transmit VLAN offload;
    // with it, the tag is metadata and the frame looks untagged.
    let (l3, ether_type) = match eth.ether_type() {
        EthHdr::ETHER_TYPE_VLAN => {
            let vlan: VlanHdr = ctx.load(EthHdr::LEN)?;
            (
                EthHdr::LEN + VlanHdr::LEN,
                u16::from_be_bytes(vlan.ether_type),
            )
        }
        other => (EthHdr::LEN, other),
    };
    match ether_type {
        EthHdr::ETHER_TYPE_IPV4 => {
            let ip: Ipv4Hdr = ctx.load(l3)?;
            let header_len = ip.header_len();
            if ip.version() != 4
                || header_len < Ipv4Hdr::MIN_LEN
                || ip.is_fragment()
                || ip.protocol != Ipv4Hdr::PROTO_TCP
            {
                return Ok(());
            }
            restore_family::<V4>(ctx, l3, &ip, l3 + header_len)
        }
        EthHdr::ETHER_TYPE_IPV6 => restore_ipv6(ctx, l3),
        _ => Ok(()),
    }
}

/// An IPv6 packet at `l3`: its header read into this CPU's scratch slot,
/// not onto the stack (every call chain shares 512 bytes, and the header
/// and its copies would take a third of them). Extension headers (and
/// fragments) are left alone, as on ingress.
#[inline(never)]
fn restore_ipv6(ctx: &TcContext, l3: usize) -> Result<(), i64> {
    let scratch = SCRATCH6.get_ptr_mut(SCRATCH_EGRESS).ok_or(0)?;
    // SAFETY: this CPU's slot, which nothing else uses while this program
    // runs here; the helper writes exactly the header's size into it.
    let ip = unsafe {
        let ip = Scratch::ipv6(scratch);
        let rc = bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            l3 as u32,
            ip.as_mut_ptr().cast(),
            size_of::<Ipv6Hdr>() as u32,
        );
        if rc != 0 {
            return Err(rc);
        }
        ip.assume_init_ref()
    };
    if ip.version() != 6 || ip.next_header != Ipv4Hdr::PROTO_TCP {
        return Ok(());
    }
    restore_family::<V6>(ctx, l3, ip, l3 + Ipv6Hdr::LEN)
}

/// Restores the service address on a TCP segment of family `F` whose IP
/// header `ip` is at `l3` and TCP header at `tcp_offset`, if it is the
/// reply of a steered connection. A subprogram per family, so that the
/// two families' frames do not add up (a call chain's frames share 512
/// bytes).
#[inline(never)]
fn restore_family<F: Family>(
    ctx: &TcContext,
    l3: usize,
    ip: &F::Hdr,
    tcp_offset: usize,
) -> Result<(), i64> {
    let tcp: TcpHdr = ctx.load(tcp_offset)?;
    if !port_has(u16::from_be_bytes(tcp.source), PORT_REPLY_EGRESS) {
        return Ok(());
    }
    let src_addr = ip.src();
    let src_port = u16::from_ne_bytes(tcp.source);
    let scratch = F::scratch().get_ptr_mut(SCRATCH_EGRESS).ok_or(0)?;
    // SAFETY: as in `l4::steer`.
    let (key, seg, found) = unsafe {
        Scratch::init(
            scratch,
            FlowKey::tcp(src_addr, src_port, ip.dst(), u16::from_ne_bytes(tcp.dest)),
            tcp.segment(ip.l4_len()),
        )
    };
    if !conntrack::reply::<F>(key, seg, found) {
        return Ok(());
    }
    // SAFETY: `reply` wrote it.
    let flow = unsafe { found.assume_init_ref() };

    let tcp_check = tcp_offset + TcpHdr::CHECK_OFFSET;
    F::Hdr::tc_csum(ctx, l3, tcp_check, src_addr, flow.addr)?;
    ctx.l4_csum_replace(tcp_check, u64::from(src_port), u64::from(flow.port), 2)?;
    ctx.store(l3 + F::Hdr::SADDR_OFFSET, &flow.addr, 0)?;
    ctx.store(tcp_offset, &flow.port, 0)?;

    outcome(Outcome::Reply);
    if let Some(stats) = backend_stats(flow.backend) {
        stats.reply_packets += 1;
        stats.reply_bytes += u64::from(ctx.len());
    }
    Ok(())
}

//! Local mode, TC egress: a local backend answers from its own address and
//! port; before the answer leaves, it gets the service's back, so the client
//! sees the address it connected to.
//!
//! Unlike XDP, TC has checksum helpers, and they are needed: a locally sent
//! segment usually carries a partial checksum (`CHECKSUM_PARTIAL`, the
//! device or the stack completes it later), which only the helpers update
//! correctly. Reads go through `bpf_skb_load_bytes`, which also works when
//! the headers are not in the linear part of the buffer.

use core::mem::MaybeUninit;

use aya_ebpf::bindings::{BPF_F_PSEUDO_HDR, TC_ACT_OK};
use aya_ebpf::programs::TcContext;
use balancer_common::l4::{Flow, FlowKey, Outcome, PORT_REPLY_EGRESS};

use crate::conntrack;
use crate::headers::{EthHdr, Ipv4Hdr, TcpHdr, VlanHdr};
use crate::maps::{backend_stats, outcome, port_has};

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
    let l3 = match eth.ether_type() {
        EthHdr::ETHER_TYPE_IPV4 => EthHdr::LEN,
        EthHdr::ETHER_TYPE_VLAN => {
            let vlan: VlanHdr = ctx.load(EthHdr::LEN)?;
            if u16::from_be_bytes(vlan.ether_type) != EthHdr::ETHER_TYPE_IPV4 {
                return Ok(());
            }
            EthHdr::LEN + VlanHdr::LEN
        }
        _ => return Ok(()),
    };
    let ip: Ipv4Hdr = ctx.load(l3)?;
    let header_len = ip.header_len();
    if ip.version() != 4
        || header_len < Ipv4Hdr::MIN_LEN
        || ip.is_fragment()
        || ip.protocol != Ipv4Hdr::PROTO_TCP
    {
        return Ok(());
    }
    let tcp_offset = l3 + header_len;
    let tcp: TcpHdr = ctx.load(tcp_offset)?;
    if !port_has(u16::from_be_bytes(tcp.source), PORT_REPLY_EGRESS) {
        return Ok(());
    }
    let src_addr = u32::from_ne_bytes(ip.saddr);
    let src_port = u16::from_ne_bytes(tcp.source);
    let key = FlowKey::tcp(
        src_addr,
        src_port,
        u32::from_ne_bytes(ip.daddr),
        u16::from_ne_bytes(tcp.dest),
    );
    let payload = u32::from(ip.total_len()).saturating_sub(header_len as u32);
    let mut found = MaybeUninit::<Flow>::uninit();
    if !conntrack::reply(&key, &tcp.segment(payload), &mut found) {
        return Ok(());
    }
    // SAFETY: `reply` wrote it.
    let flow = unsafe { found.assume_init() };

    let tcp_check = tcp_offset + TcpHdr::CHECK_OFFSET;
    let pseudo = u64::from(BPF_F_PSEUDO_HDR);
    ctx.l4_csum_replace(
        tcp_check,
        u64::from(src_addr),
        u64::from(flow.addr),
        pseudo | 4,
    )?;
    ctx.l4_csum_replace(tcp_check, u64::from(src_port), u64::from(flow.port), 2)?;
    ctx.l3_csum_replace(
        l3 + Ipv4Hdr::CHECK_OFFSET,
        u64::from(src_addr),
        u64::from(flow.addr),
        4,
    )?;
    ctx.store(l3 + Ipv4Hdr::SADDR_OFFSET, &flow.addr, 0)?;
    ctx.store(tcp_offset, &flow.port, 0)?;

    outcome(Outcome::Reply);
    if let Some(stats) = backend_stats(flow.backend) {
        stats.reply_packets += 1;
        stats.reply_bytes += u64::from(ctx.len());
    }
    Ok(())
}

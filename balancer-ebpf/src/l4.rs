//! L4 steering in XDP: new connections to a virtual service get a routable
//! backend from the service's Maglev table, packets of known connections
//! follow their entry in the connection table, and in remote mode replies
//! get the service address back before they are forwarded to the client.
//!
//! Order of the checks, cheapest first, so that traffic nothing is steered on
//! pays two array reads: the `PORTS` bits of the destination and source
//! ports; then the connection table (known flows skip the service lookup);
//! then the service.

use aya_ebpf::EbpfContext as _;
use aya_ebpf::bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibParams, xdp_action};
use aya_ebpf::helpers::generated::{bpf_fib_lookup, bpf_redirect};

use aya_ebpf::programs::XdpContext;
use balancer_common::l4::{
    Backend, BackendState, FLAG_FIN_BACKEND, FLAG_FIN_CLIENT, FLAG_REMOTE, FLAG_REPLY, Flow,
    FlowKey, MAX_PROBES, MAX_SERVICE_BACKENDS, NextHop, Outcome, PORT_REPLY_INGRESS, PORT_SERVICE,
    PROTO_TCP, Service, ServiceKey, flow_hash, probe_hash,
};

use crate::csum;
use crate::headers::{EthHdr, Ipv4Hdr, TcpHdr};
use crate::maps::{
    BACKENDS, CLIENT_HOPS, CONFIG, CONNS, MAGLEV, NEXT_HOPS, SERVICE_BACKENDS, SERVICES,
    backend_stats, note_close, outcome, port_has, service_stats, stale,
};

/// A parsed IPv4/TCP packet, bounds-checked by the parser.
pub struct TcpPacket {
    pub ip: *mut Ipv4Hdr,
    pub tcp: *mut TcpHdr,
    /// SYN without ACK: the client opens a connection.
    pub syn: bool,
}

const AF_INET: u8 = 2;

/// Where [`forward`] finds and keeps the next hop toward the destination.
enum HopCache {
    /// Toward backend slot `index` (`NEXT_HOPS`).
    Backend(u32),
    /// Toward a client (`CLIENT_HOPS`, keyed by its address).
    Client(u32),
}

pub fn steer(ctx: &XdpContext, packet: &TcpPacket) -> u32 {
    // SAFETY: the parser checked that both headers lie inside the frame, and
    // nothing in this program run resizes it.
    let (ip, tcp) = unsafe { (&mut *packet.ip, &mut *packet.tcp) };
    let key = || {
        FlowKey::tcp(
            u32::from_ne_bytes(ip.saddr),
            u16::from_ne_bytes(tcp.source),
            u32::from_ne_bytes(ip.daddr),
            u16::from_ne_bytes(tcp.dest),
        )
    };

    if port_has(u16::from_be_bytes(tcp.dest), PORT_SERVICE) {
        let key = key();
        // A SYN always gets a fresh decision: a client reusing a port for a
        // new connection must not inherit a backend that has been isolated
        // since, and a retransmitted SYN lands on the same backend anyway
        // while the table is unchanged.
        if !packet.syn
            && let Some(flow) = CONNS.get_ptr(key)
        {
            // SAFETY: a successful lookup; the copy is taken at once, so an
            // LRU eviction racing with us cannot change it underneath.
            let flow = unsafe { *flow };
            if flow.flags & FLAG_REPLY == 0 {
                return established(ctx, ip, tcp, &key, &flow);
            }
        }
        if let Some(service) = SERVICES.get_ptr(ServiceKey::tcp(key.dst_addr, key.dst_port)) {
            // SAFETY: as above.
            let service = unsafe { *service };
            return new_flow(ctx, ip, tcp, &key, &service);
        }
    }
    if port_has(u16::from_be_bytes(tcp.source), PORT_REPLY_INGRESS) {
        let key = key();
        if let Some(flow) = CONNS.get_ptr(key) {
            // SAFETY: as for the forward lookup.
            let flow = unsafe { *flow };
            if flow.flags & FLAG_REPLY != 0 {
                if !stale(&flow, tcp.is_syn_ack()) {
                    return reply(ctx, ip, tcp, &key, &flow);
                }
                // Not ours any more: the packet passes untouched.
                let _ = CONNS.remove(key);
            }
        }
    }
    outcome(Outcome::NotService);
    xdp_action::XDP_PASS
}

fn established(
    ctx: &XdpContext,
    ip: &mut Ipv4Hdr,
    tcp: &mut TcpHdr,
    key: &FlowKey,
    flow: &Flow,
) -> u32 {
    outcome(Outcome::Established);
    if tcp.flags & (TcpHdr::FIN | TcpHdr::RST) != 0 {
        let reply = FlowKey::tcp(flow.addr, flow.port, key.src_addr, key.src_port);
        let fin = if tcp.flags & TcpHdr::FIN != 0 {
            FLAG_FIN_CLIENT
        } else {
            0
        };
        note_close(*key, reply, fin, tcp.flags & TcpHdr::RST != 0);
    }
    let len = frame_len(ctx);
    if let Some(stats) = service_stats(flow.service) {
        stats.packets += 1;
        stats.bytes += len;
    }
    if let Some(stats) = backend_stats(flow.backend) {
        stats.packets += 1;
        stats.bytes += len;
    }
    rewrite_dst(ip, tcp, flow.addr, flow.port);
    deliver(ctx, ip, flow.flags, flow.backend)
}

fn new_flow(
    ctx: &XdpContext,
    ip: &mut Ipv4Hdr,
    tcp: &mut TcpHdr,
    key: &FlowKey,
    service: &Service,
) -> u32 {
    let hash = flow_hash(key.src_addr, key.src_port, key.dst_addr, key.dst_port);
    let Some((index, backend)) = pick(service, hash) else {
        outcome(Outcome::NoBackend);
        if let Some(stats) = service_stats(service.index) {
            stats.no_backend += 1;
        }
        return xdp_action::XDP_PASS;
    };

    let remote = service.flags & FLAG_REMOTE;
    let forward = Flow {
        addr: backend.addr,
        port: backend.port,
        _pad: 0,
        flags: remote,
        service: service.index,
        backend: index,
        closed: 0,
    };
    // The reply entry is keyed the way the backend's answers arrive.
    let reply_key = FlowKey::tcp(backend.addr, backend.port, key.src_addr, key.src_port);
    let reply = Flow {
        addr: key.dst_addr,
        port: key.dst_port,
        _pad: 0,
        flags: remote | FLAG_REPLY,
        service: service.index,
        backend: index,
        closed: 0,
    };
    if !remember(key, &forward) || !remember(&reply_key, &reply) {
        outcome(Outcome::ConntrackFull);
    }

    outcome(Outcome::NewFlow);
    let len = frame_len(ctx);
    if let Some(stats) = service_stats(service.index) {
        stats.packets += 1;
        stats.bytes += len;
        stats.connections += 1;
    }
    if let Some(stats) = backend_stats(index) {
        stats.packets += 1;
        stats.bytes += len;
        stats.connections += 1;
    }
    rewrite_dst(ip, tcp, backend.addr, backend.port);
    deliver(ctx, ip, remote, index)
}

/// Stores `flow` under `key`. An entry that is already there (a
/// retransmitted SYN, a client reusing its port) is overwritten in place:
/// replacing an LRU entry costs a node allocation and a free, several times
/// a lookup. Packets of one connection arrive on one CPU (RSS), so nothing
/// reads the entry while it is half-written.
#[inline(always)]
fn remember(key: &FlowKey, flow: &Flow) -> bool {
    match CONNS.get_ptr_mut(key) {
        Some(entry) => {
            // SAFETY: a successful lookup of a value of this type.
            unsafe { *entry = *flow };
            true
        }
        None => CONNS.insert(key, flow, 0).is_ok(),
    }
}

/// A routable backend for a new connection with flow hash `hash`.
///
/// The table holds only backends that were routable when the agent built
/// it; one isolated since then is skipped by trying more slots, each with a
/// fresh hash, so its connections spread evenly over the others. After
/// [`MAX_PROBES`] misses the service's whole backend list is scanned, so a
/// routable backend is found whenever one exists.
#[inline(always)]
fn pick(service: &Service, hash: u64) -> Option<(u32, Backend)> {
    if service.table_size != 0 {
        let size = u64::from(service.table_size);
        for probe in 0..MAX_PROBES {
            let slot = (probe_hash(hash, probe) % size) as u32;
            if let Some(&index) = MAGLEV.get(service.table_offset.wrapping_add(slot))
                && let Some(backend) = routable(index)
            {
                return Some((index, backend));
            }
        }
    }
    let count = service.backend_count.min(MAX_SERVICE_BACKENDS);
    if count == 0 {
        return None;
    }
    let start = (hash % u64::from(count)) as u32;
    let base = service.index.wrapping_mul(MAX_SERVICE_BACKENDS);
    for i in 0..MAX_SERVICE_BACKENDS {
        if i >= count {
            break;
        }
        let mut position = start + i;
        if position >= count {
            position -= count;
        }
        if let Some(&index) = SERVICE_BACKENDS.get(base.wrapping_add(position))
            && let Some(backend) = routable(index)
        {
            return Some((index, backend));
        }
    }
    None
}

#[inline(always)]
fn routable(index: u32) -> Option<Backend> {
    BACKENDS
        .get(index)
        .filter(|b| b.state == BackendState::Routable as u32)
        .copied()
}

/// Remote mode: a backend's answer gets the service as its source and goes
/// on to the client.
fn reply(ctx: &XdpContext, ip: &mut Ipv4Hdr, tcp: &mut TcpHdr, key: &FlowKey, flow: &Flow) -> u32 {
    outcome(Outcome::Reply);
    if tcp.flags & (TcpHdr::FIN | TcpHdr::RST) != 0 {
        let forward = FlowKey::tcp(key.dst_addr, key.dst_port, flow.addr, flow.port);
        let fin = if tcp.flags & TcpHdr::FIN != 0 {
            FLAG_FIN_BACKEND
        } else {
            0
        };
        note_close(forward, *key, fin, tcp.flags & TcpHdr::RST != 0);
    }
    if let Some(stats) = backend_stats(flow.backend) {
        stats.reply_packets += 1;
        stats.reply_bytes += frame_len(ctx);
    }
    rewrite_src(ip, tcp, flow.addr, flow.port);
    let client = u32::from_ne_bytes(ip.daddr);
    forward(ctx, ip, HopCache::Client(client), flow.backend)
}

/// Local mode hands the rewritten packet to the stack; remote mode forwards
/// it to the backend's host.
#[inline(always)]
fn deliver(ctx: &XdpContext, ip: &mut Ipv4Hdr, flags: u32, backend: u32) -> u32 {
    if flags & FLAG_REMOTE == 0 {
        return xdp_action::XDP_PASS;
    }
    forward(ctx, ip, HopCache::Backend(backend), backend)
}

/// The forwarding step: sends the (already rewritten) packet to the next
/// hop toward its destination, as a router would. This is the one place an
/// encapsulating mode would replace.
///
/// The next hop comes from `cache`, which the program fills from
/// `bpf_fib_lookup` (that costs more than the rest of the fast path) and
/// the agent invalidates by moving `Config::generation` on. Without a usable
/// next hop the packet goes to the kernel, which routes it and resolves the
/// neighbour for the next packets. `backend` is whose counters it goes on.
fn forward(ctx: &XdpContext, ip: &mut Ipv4Hdr, cache: HopCache, backend: u32) -> u32 {
    if ip.ttl <= 1 {
        outcome(Outcome::TtlExpired);
        return xdp_action::XDP_PASS;
    }
    let dst_addr = u32::from_ne_bytes(ip.daddr);
    let config = CONFIG.get(0).copied().unwrap_or_default();
    let generation = config.generation;
    let cached = match cache {
        HopCache::Backend(index) => NEXT_HOPS.get_ptr_mut(index),
        HopCache::Client(addr) => CLIENT_HOPS.get_ptr_mut(addr),
    };
    // SAFETY: a successful lookup; concurrent writers store the same
    // lookup result.
    let cached = cached.map(|p| unsafe { &mut *p });
    let hop = match cached {
        Some(hop) if generation != 0 && hop.generation == generation && hop.addr == dst_addr => {
            *hop
        }
        cached => {
            let Some(found) = fib_lookup(ctx, ip) else {
                outcome(Outcome::Unresolved);
                if let Some(stats) = backend_stats(backend) {
                    stats.unresolved += 1;
                }
                return xdp_action::XDP_PASS;
            };
            let hop = NextHop {
                generation,
                addr: dst_addr,
                ..found
            };
            match (cached, cache) {
                (Some(slot), _) => *slot = hop,
                // A full table evicts its least recently used client; if
                // even that fails, the next reply looks up again.
                (None, HopCache::Client(addr)) => {
                    let _ = CLIENT_HOPS.insert(addr, hop, 0);
                }
                (None, HopCache::Backend(_)) => {}
            }
            hop
        }
    };

    if config.keep_ttl == 0 {
        let word = u16::from_ne_bytes([ip.ttl, ip.protocol]);
        ip.ttl -= 1;
        let check = csum::replace2(
            u16::from_ne_bytes(ip.check),
            word,
            u16::from_ne_bytes([ip.ttl, ip.protocol]),
        );
        ip.check = check.to_ne_bytes();
    }

    let start = ctx.data();
    if start + EthHdr::LEN > ctx.data_end() {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: bounds-checked just above.
    let eth = unsafe { &mut *(start as *mut EthHdr) };
    eth.dst = hop.dst_mac;
    eth.src = hop.src_mac;
    if hop.ifindex as usize == ctx.ingress_ifindex() {
        xdp_action::XDP_TX
    } else {
        // SAFETY: a plain helper call; it only records where the frame goes.
        unsafe { bpf_redirect(hop.ifindex, 0) as u32 }
    }
}

/// The egress interface and MAC addresses toward the packet's destination.
fn fib_lookup(ctx: &XdpContext, ip: &Ipv4Hdr) -> Option<NextHop> {
    // SAFETY: an all-zero `bpf_fib_lookup` is its documented empty input.
    let mut params: FibParams = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = PROTO_TCP;
    params.__bindgen_anon_1.tot_len = u16::from_be_bytes(ip.tot_len);
    params.__bindgen_anon_2.tos = ip.tos;
    params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(ip.saddr);
    params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(ip.daddr);
    params.ifindex = ctx.ingress_ifindex() as u32;
    // SAFETY: `params` is a valid, initialised struct of the size passed.
    let rc = unsafe { bpf_fib_lookup(ctx.as_ptr(), &mut params, size_of::<FibParams>() as i32, 0) };
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        return None;
    }
    Some(NextHop {
        ifindex: params.ifindex,
        dst_mac: params.dmac,
        src_mac: params.smac,
        ..NextHop::default()
    })
}

fn rewrite_dst(ip: &mut Ipv4Hdr, tcp: &mut TcpHdr, addr: u32, port: u16) {
    let old_addr = u32::from_ne_bytes(ip.daddr);
    let old_port = u16::from_ne_bytes(tcp.dest);
    ip.check = csum::replace4(u16::from_ne_bytes(ip.check), old_addr, addr).to_ne_bytes();
    // The TCP checksum covers the addresses through the pseudo-header.
    let check = csum::replace4(u16::from_ne_bytes(tcp.check), old_addr, addr);
    tcp.check = csum::replace2(check, old_port, port).to_ne_bytes();
    ip.daddr = addr.to_ne_bytes();
    tcp.dest = port.to_ne_bytes();
}

fn rewrite_src(ip: &mut Ipv4Hdr, tcp: &mut TcpHdr, addr: u32, port: u16) {
    let old_addr = u32::from_ne_bytes(ip.saddr);
    let old_port = u16::from_ne_bytes(tcp.source);
    ip.check = csum::replace4(u16::from_ne_bytes(ip.check), old_addr, addr).to_ne_bytes();
    let check = csum::replace4(u16::from_ne_bytes(tcp.check), old_addr, addr);
    tcp.check = csum::replace2(check, old_port, port).to_ne_bytes();
    ip.saddr = addr.to_ne_bytes();
    tcp.source = port.to_ne_bytes();
}

#[inline(always)]
fn frame_len(ctx: &XdpContext) -> u64 {
    (ctx.data_end() - ctx.data()) as u64
}

//! L4 steering in XDP: a SYN to a virtual service gets a routable backend
//! from the service's Maglev table, packets of known connections follow
//! their entry ([`conntrack`]), a mid-flow packet of a connection nothing
//! knows goes to the live backend its hash gives (so a connection on an
//! isolated or draining backend stays there), and in remote mode replies get
//! the service address back before they are forwarded to the client.
//!
//! Order of the checks, cheapest first, so that traffic nothing is steered on
//! pays two array reads: the `PORTS` bits of the destination and source
//! ports (read by the parser, before it calls in here); then the
//! established table (known flows skip the service lookup); then the
//! service; then the embryonic table.
//!
//! This module rewrites and forwards; it leaves what a connection's entries
//! mean to [`conntrack`] and the wire formats to [`crate::headers`].

use core::mem::MaybeUninit;

use aya_ebpf::EbpfContext as _;
use aya_ebpf::bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibParams, xdp_action};
use aya_ebpf::helpers::generated::{
    bpf_check_mtu, bpf_fib_lookup, bpf_ktime_get_coarse_ns, bpf_redirect,
};
use aya_ebpf::programs::XdpContext;
use balancer_common::l4::{
    Backend, BackendState, FLAG_RECOVERED, FLAG_REMOTE, FLAG_SEQ, Flow, FlowKey, LIST_TRIES,
    MAX_PROBES, MAX_SERVICE_BACKENDS, NextHop, Outcome, PROTO_TCP, Service, ServiceKey, flow_hash,
    mix64, probe_hash,
};

use crate::atomic;
use crate::conntrack;
use crate::csum;
use crate::headers::{EthHdr, Ipv4Hdr, Segment, TcpHdr};
use crate::icmp;
use crate::maps::{
    BACKENDS, CLIENT_HOPS, CONFIG, FIB_SCRATCH, MAGLEV, NEXT_HOPS, SERVICE_BACKENDS, SERVICES,
    TRIALS, backend_stats, outcome, service_stats,
};

/// A parsed IPv4/TCP packet, bounds-checked by the parser.
pub struct TcpPacket {
    pub ip: *mut Ipv4Hdr,
    pub tcp: *mut TcpHdr,
    /// SYN without ACK: the client opens a connection.
    pub syn: bool,
    /// Where the IPv4 header starts (after an 802.1Q tag, if any).
    pub l3: usize,
    /// The frame carries an 802.1Q tag.
    pub tagged: bool,
    /// The destination port has `PORT_SERVICE` set.
    pub to_service: bool,
    /// The source port has `PORT_REPLY_INGRESS` set.
    pub from_backend: bool,
}

const AF_INET: u8 = 2;

/// Where [`transmit`] finds and keeps the next hop toward the destination.
#[derive(Clone, Copy)]
pub enum HopCache {
    /// Toward backend slot `index` (`NEXT_HOPS`).
    Backend(u32),
    /// Toward a client (`CLIENT_HOPS`, keyed by its address).
    Client(u32),
}

/// How a steered packet leaves: [`send`]'s instructions (one argument, as
/// BPF functions take at most five).
#[derive(Clone, Copy)]
struct Delivery {
    rewrite: Rewrite,
    /// The entry's or service's flags ([`FLAG_REMOTE`]).
    flags: u32,
    cache: HopCache,
    /// Whose counters a forwarding failure goes on.
    backend: u32,
}

impl Delivery {
    /// Client to service, rewritten to `flow`'s backend.
    #[inline(always)]
    fn forward(flow: &Flow, backend: u32, flags: u32) -> Self {
        Self {
            rewrite: Rewrite::Dst(flow.addr, flow.port),
            flags,
            cache: HopCache::Backend(backend),
            backend,
        }
    }
}

impl Default for Delivery {
    fn default() -> Self {
        Self {
            rewrite: Rewrite::Dst(0, 0),
            flags: 0,
            cache: HopCache::Backend(0),
            backend: 0,
        }
    }
}

/// The NAT rewrite a packet gets.
#[derive(Clone, Copy)]
enum Rewrite {
    /// Client to service: the destination becomes the backend.
    Dst(u32, u16),
    /// Backend to client: the source becomes the service.
    Src(u32, u16),
}

// A subprogram of its own, like `icmp::steer`, so that the parser's frame
// and the two steering frames do not add up (a call chain's frames share
// 512 bytes).
#[inline(never)]
pub fn steer(ctx: &XdpContext, packet: &TcpPacket) -> u32 {
    // SAFETY: the parser checked that both headers lie inside the frame, and
    // nothing in this program run resizes it before the last use.
    let (ip, tcp) = unsafe { (&mut *packet.ip, &mut *packet.tcp) };
    let key = || {
        FlowKey::tcp(
            u32::from_ne_bytes(ip.saddr),
            u16::from_ne_bytes(tcp.source),
            u32::from_ne_bytes(ip.daddr),
            u16::from_ne_bytes(tcp.dest),
        )
    };
    let segment = |ip: &Ipv4Hdr, tcp: &TcpHdr| {
        let payload = u32::from(ip.total_len()).saturating_sub(ip.header_len() as u32);
        tcp.segment(payload)
    };

    if packet.to_service {
        let key = key();
        let seg = segment(ip, tcp);
        // A SYN always gets a fresh decision: a client reusing a port for a
        // new connection must not inherit a backend that has been isolated
        // since.
        let mut found = MaybeUninit::<Flow>::uninit();
        if !packet.syn && conntrack::established(&key, &seg, &mut found) {
            // SAFETY: `established` wrote it.
            return known(ctx, packet, unsafe { found.assume_init_ref() });
        }
        // The service before the embryonic table: traffic to the service
        // port of another address pays one lookup less.
        if let Some(service) = SERVICES.get_ptr(ServiceKey::tcp(key.dst_addr, key.dst_port)) {
            // SAFETY: a successful lookup, copied at once.
            let service = unsafe { *service };
            if !packet.syn && conntrack::handshaking(&key, &seg, &mut found) {
                // SAFETY: `handshaking` wrote it.
                return known(ctx, packet, unsafe { found.assume_init_ref() });
            }
            let mut how = Delivery::default();
            if !admit(ctx, &key, &service, &seg, &mut how) {
                return xdp_action::XDP_PASS;
            }
            return send(ctx, packet, &how);
        }
    }
    if packet.from_backend {
        let key = key();
        let mut found = MaybeUninit::<Flow>::uninit();
        if conntrack::reply(&key, &segment(ip, tcp), &mut found) {
            // SAFETY: `reply` wrote it.
            let flow = unsafe { found.assume_init() };
            // A backend's answer gets the service as its source and goes
            // on to the client.
            outcome(Outcome::Reply);
            if let Some(stats) = backend_stats(flow.backend) {
                stats.reply_packets += 1;
                stats.reply_bytes += frame_len(ctx);
            }
            let how = Delivery {
                rewrite: Rewrite::Src(flow.addr, flow.port),
                flags: flow.flags,
                cache: HopCache::Client(key.dst_addr),
                backend: flow.backend,
            };
            return send(ctx, packet, &how);
        }
    }
    outcome(Outcome::NotService);
    xdp_action::XDP_PASS
}

/// A client packet of a connection a table knows: to its backend.
#[inline(always)]
fn known(ctx: &XdpContext, packet: &TcpPacket, flow: &Flow) -> u32 {
    outcome(Outcome::Established);
    count_forward(ctx, flow.service, flow.backend, false);
    send(
        ctx,
        packet,
        &Delivery::forward(flow, flow.backend, flow.flags),
    )
}

/// A backend for a packet to `service` that no connection entry covers,
/// its entries, and how it leaves (in `how`); false when the service has no
/// backend for it (counted, the packet passes).
///
/// - A SYN opens a new connection: a routable backend, embryonic entries.
/// - Any other packet belongs to a connection neither table knows (evicted,
///   or older than the agent): the live backend at the flow's first table
///   slot, whatever its state, since that is where the connection went
///   while the table was as it is (a routable one if that slot is empty).
///   Resets get no entries; everything else embryonic ones that the
///   backend's answer confirms.
///
/// A subprogram of its own, so that its entries are not on the stack frame
/// `send` is called from (a call chain's frames share 512 bytes).
#[inline(always)]
fn admit(
    ctx: &XdpContext,
    key: &FlowKey,
    service: &Service,
    seg: &Segment,
    how: &mut Delivery,
) -> bool {
    let hash = flow_hash(key.src_addr, key.src_port, key.dst_addr, key.dst_port);
    let syn = seg.has(TcpHdr::SYN) && !seg.has(TcpHdr::ACK);
    let chosen = if syn {
        pick(service, hash)
    } else {
        live_at(service, hash).or_else(|| pick(service, hash))
    };
    let Some((index, backend)) = chosen else {
        outcome(Outcome::NoBackend);
        if let Some(stats) = service_stats(service.index) {
            stats.no_backend += 1;
        }
        return false;
    };
    let remote = service.flags & FLAG_REMOTE;
    let mut flow = Flow {
        addr: backend.addr,
        port: backend.port,
        _pad: 0,
        flags: remote | FLAG_SEQ,
        service: service.index,
        backend: index,
        closed: 0,
        seq: seg.seq.wrapping_add(seg.len),
        ack: 0,
        window: seg.window,
        checked: 0,
    };
    if syn {
        conntrack::forget(key);
        conntrack::open(key, &flow);
        outcome(Outcome::NewFlow);
    } else {
        if !seg.has(TcpHdr::RST) {
            flow.flags |= FLAG_RECOVERED;
            flow.ack = seg.ack;
            conntrack::open(key, &flow);
        }
        outcome(Outcome::Recovered);
    }
    count_forward(ctx, service.index, index, syn);
    *how = Delivery::forward(&flow, index, remote);
    true
}

#[inline(always)]
fn count_forward(ctx: &XdpContext, service: u32, backend: u32, connection: bool) {
    let len = frame_len(ctx);
    let connection = u64::from(connection);
    if let Some(stats) = service_stats(service) {
        stats.packets += 1;
        stats.bytes += len;
        stats.connections += connection;
    }
    if let Some(stats) = backend_stats(backend) {
        stats.packets += 1;
        stats.bytes += len;
        stats.connections += connection;
    }
}

/// A routable backend for a new connection with flow hash `hash`.
///
/// The table holds every live backend (routable, isolated or draining); a
/// slot whose backend is not routable is skipped by trying more slots, each
/// with a fresh hash, so its connections spread evenly over the others.
/// After [`MAX_PROBES`] misses the service's list of routable backends is
/// used, so a routable backend is found whenever one exists (once the agent
/// has rewritten the list after the last transition).
#[inline(always)]
fn pick(service: &Service, hash: u64) -> Option<(u32, Backend)> {
    if service.table_size != 0 {
        let size = u64::from(service.table_size);
        for probe in 0..MAX_PROBES {
            let slot = (probe_hash(hash, probe) % size) as u32;
            if let Some(&index) = MAGLEV.get(service.table_offset.wrapping_add(slot))
                && let Some(backend) = backend(index, hash, true)
            {
                return Some((index, backend));
            }
        }
    }
    let count = service.backend_count.min(MAX_SERVICE_BACKENDS);
    if count == 0 {
        return None;
    }
    let start = hash % u64::from(count);
    for i in 0..LIST_TRIES {
        let position = ((start + u64::from(i)) % u64::from(count)) as u32;
        if let Some(&index) = SERVICE_BACKENDS.get(service.list_offset.wrapping_add(position))
            && let Some(backend) = backend(index, hash, true)
        {
            return Some((index, backend));
        }
    }
    None
}

/// The live backend at the flow's first table slot, if any.
#[inline(always)]
fn live_at(service: &Service, hash: u64) -> Option<(u32, Backend)> {
    if service.table_size == 0 {
        return None;
    }
    let slot = (hash % u64::from(service.table_size)) as u32;
    let index = *MAGLEV.get(service.table_offset.wrapping_add(slot))?;
    backend(index, hash, false).map(|b| (index, b))
}

/// Backend `index` if it may take a new connection with flow hash `hash`
/// (`routable`), or if it is live (otherwise).
///
/// Routable backends always may; a degraded one takes its share of the
/// connections that pick it (by the hash, so a retransmitted SYN gets the
/// same answer); a half-open one takes a few trial connections per second.
#[inline(always)]
fn backend(index: u32, hash: u64, routable: bool) -> Option<Backend> {
    let backend = BACKENDS.get(index)?;
    let state = backend.state;
    let usable = if !routable {
        state != BackendState::Unused as u32
    } else if state == BackendState::Routable as u32 {
        true
    } else if state == BackendState::Degraded as u32 {
        mix64(hash ^ DEGRADED_SALT) % 100 < u64::from(backend.share)
    } else if state == BackendState::Trial as u32 {
        trial(index, backend.share)
    } else {
        false
    };
    usable.then_some(*backend)
}

/// Mixed into the flow hash for the degraded share, so the share is not
/// correlated with the table slot the same hash chose.
const DEGRADED_SALT: u64 = 0x5bd1_e995_5bd1_e995;

/// Takes one of a half-open backend's trial connections of this second, if
/// any is left. CPUs race on the window's reset, which at worst lets a few
/// more trials through in the second it turns.
#[inline(always)]
fn trial(index: u32, per_second: u32) -> bool {
    let Some(slot) = TRIALS.get_ptr_mut(index) else {
        return false;
    };
    // SAFETY: a helper without arguments.
    let second = (unsafe { bpf_ktime_get_coarse_ns() } >> 30) as u32;
    // SAFETY: a successful lookup of a shared array slot; the count is
    // updated atomically, the window's start by whoever sees it stale.
    unsafe {
        if (*slot).second != second {
            (*slot).second = second;
            (*slot).count = 0;
        }
        if (*slot).count >= per_second.max(1) {
            return false;
        }
        atomic::add(&raw mut (*slot).count, 1);
    }
    true
}

/// Rewrites the packet and sends it on: local mode hands it to the stack;
/// remote mode forwards it to the next hop toward its new destination.
///
/// Remote mode decides before rewriting, so that what it answers itself
/// quotes the packet as it was sent: a TTL about to expire gets ICMP time
/// exceeded, a packet larger than the next hop's MTU with DF set gets ICMP
/// fragmentation needed (without DF the kernel fragments it). Without a
/// usable next hop, or for a VLAN-tagged frame, the rewritten packet goes to
/// the kernel to forward.
// A function of its own (a BPF subprogram), not inlined into its four
// callers: the verifier then walks its paths far fewer times.
#[inline(always)]
fn send(ctx: &XdpContext, packet: &TcpPacket, how: &Delivery) -> u32 {
    let Delivery {
        rewrite,
        flags,
        cache,
        backend,
    } = *how;
    // SAFETY: as in `steer`; every path below that resizes the frame
    // returns without touching these again.
    let (ip, tcp) = unsafe { (&mut *packet.ip, &mut *packet.tcp) };
    if flags & FLAG_REMOTE == 0 {
        apply(ip, tcp, rewrite);
        return xdp_action::XDP_PASS;
    }
    if ip.ttl <= 1 {
        outcome(Outcome::TtlExpired);
        return icmp::answer(ctx, packet.l3, icmp::TIME_EXCEEDED, 0);
    }
    let dst = match rewrite {
        Rewrite::Dst(addr, _) => addr,
        Rewrite::Src(..) => u32::from_ne_bytes(ip.daddr),
    };
    let hop = if packet.tagged {
        None
    } else {
        next_hop(ctx, ip, dst, cache)
    };
    let Some(hop) = hop else {
        apply(ip, tcp, rewrite);
        unresolved(backend);
        return xdp_action::XDP_PASS;
    };
    if u32::from(ip.total_len()) > hop.mtu {
        if ip.dont_fragment() {
            outcome(Outcome::FragNeeded);
            return icmp::answer(ctx, packet.l3, icmp::FRAG_NEEDED, hop.mtu);
        }
        apply(ip, tcp, rewrite);
        unresolved(backend);
        return xdp_action::XDP_PASS;
    }
    apply(ip, tcp, rewrite);
    emit(ctx, ip, &hop)
}

fn unresolved(backend: u32) {
    outcome(Outcome::Unresolved);
    if let Some(stats) = backend_stats(backend) {
        stats.unresolved += 1;
    }
}

/// Decrements the TTL (unless configured not to), sets the MACs of `hop`
/// and sends the frame there.
#[inline(always)]
pub fn emit(ctx: &XdpContext, ip: &mut Ipv4Hdr, hop: &NextHop) -> u32 {
    let keep_ttl = CONFIG.get(0).is_some_and(|c| c.keep_ttl != 0);
    if !keep_ttl {
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

/// The next hop toward `dst`, from `cache` when it holds a whole entry of
/// the current generation for that address, otherwise looked up with
/// `bpf_fib_lookup` (that costs more than the rest of the fast path) and
/// cached. `None` when the kernel has no usable route or neighbour yet: the
/// packet then goes to the kernel, which resolves it for the next ones.
///
/// Entries are written by this program on any CPU while others read them,
/// so a reader copies the entry and checks its `check` field: a torn copy
/// fails it and counts as a miss.
#[inline(always)]
pub fn next_hop(ctx: &XdpContext, ip: &Ipv4Hdr, dst: u32, cache: HopCache) -> Option<NextHop> {
    let generation = CONFIG.get(0).map_or(0, |c| c.generation);
    // A raw pointer (null for none) rather than an `Option` kept across the
    // lookup below: LLVM spills the payload of a `None` as an undefined
    // register, which the verifier refuses to read.
    let slot = match cache {
        HopCache::Backend(index) => NEXT_HOPS.get_ptr_mut(index),
        HopCache::Client(addr) => CLIENT_HOPS.get_ptr_mut(addr),
    }
    .unwrap_or(core::ptr::null_mut());
    if !slot.is_null() {
        // SAFETY: a successful lookup; a volatile copy so the check covers
        // exactly the bytes used.
        let cached = unsafe { core::ptr::read_volatile(slot) };
        if generation != 0
            && cached.generation == generation
            && cached.addr == dst
            && cached.is_whole()
        {
            return Some(cached);
        }
    }
    let mut hop = NextHop::default();
    if !fib_lookup(ctx, ip, dst, &mut hop) {
        return None;
    }
    hop.generation = generation;
    hop.addr = dst;
    hop.check = hop.checksum();
    if !slot.is_null() {
        // SAFETY: a successful lookup; a concurrent reader of the half-
        // written value fails its check.
        unsafe { core::ptr::write_volatile(slot, hop) };
    } else if let HopCache::Client(addr) = cache {
        // A full table evicts its least recently used client; if even that
        // fails, the next reply looks up again.
        let _ = CLIENT_HOPS.insert(addr, hop, 0);
    }
    Some(hop)
}

/// Fills `hop` with the egress interface, MAC addresses and MTU toward
/// `dst`; whether the kernel knows them. Not inlined (it is the slow path),
/// hence the out-parameter: a subprogram may not return a pointer into its
/// caller's stack, which is how LLVM returns a struct.
#[inline(never)]
fn fib_lookup(ctx: &XdpContext, ip: &Ipv4Hdr, dst: u32, hop: &mut NextHop) -> bool {
    let Some(params) = FIB_SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a successful lookup; nothing else uses it
    // while this program runs here.
    let params = unsafe { &mut *params };
    // SAFETY: an all-zero `bpf_fib_lookup` is its documented empty input.
    *params = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = PROTO_TCP;
    // No length: the MTU is checked per packet against the cached hop, so
    // the lookup must not fail on this packet's size.
    params.__bindgen_anon_2.tos = ip.tos;
    params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(ip.saddr);
    params.__bindgen_anon_4.ipv4_dst = dst;
    params.ifindex = ctx.ingress_ifindex() as u32;
    // SAFETY: `params` is a valid, initialised struct of the size passed.
    let rc = unsafe { bpf_fib_lookup(ctx.as_ptr(), params, size_of::<FibParams>() as i32, 0) };
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        return false;
    }
    let mut mtu: u32 = 0;
    // SAFETY: `mtu` is a valid u32 for the helper to fill; with length 0 it
    // only reports the device's MTU.
    let rc = unsafe { bpf_check_mtu(ctx.as_ptr(), params.ifindex, &mut mtu, 0, 0) };
    if rc < 0 || mtu == 0 {
        return false;
    }
    hop.ifindex = params.ifindex;
    hop.dst_mac = params.dmac;
    hop.src_mac = params.smac;
    hop.mtu = mtu;
    true
}

#[inline(always)]
fn apply(ip: &mut Ipv4Hdr, tcp: &mut TcpHdr, rewrite: Rewrite) {
    match rewrite {
        Rewrite::Dst(addr, port) => {
            let (old_addr, old_port) = (u32::from_ne_bytes(ip.daddr), u16::from_ne_bytes(tcp.dest));
            patch(ip, tcp, old_addr, addr, old_port, port);
            ip.daddr = addr.to_ne_bytes();
            tcp.dest = port.to_ne_bytes();
        }
        Rewrite::Src(addr, port) => {
            let (old_addr, old_port) =
                (u32::from_ne_bytes(ip.saddr), u16::from_ne_bytes(tcp.source));
            patch(ip, tcp, old_addr, addr, old_port, port);
            ip.saddr = addr.to_ne_bytes();
            tcp.source = port.to_ne_bytes();
        }
    }
}

/// Updates both checksums for an address and port change; the TCP one
/// covers the addresses through the pseudo-header.
#[inline(always)]
fn patch(ip: &mut Ipv4Hdr, tcp: &mut TcpHdr, old_addr: u32, addr: u32, old_port: u16, port: u16) {
    ip.check = csum::replace4(u16::from_ne_bytes(ip.check), old_addr, addr).to_ne_bytes();
    let check = csum::replace4(u16::from_ne_bytes(tcp.check), old_addr, addr);
    tcp.check = csum::replace2(check, old_port, port).to_ne_bytes();
}

#[inline(always)]
fn frame_len(ctx: &XdpContext) -> u64 {
    (ctx.data_end() - ctx.data()) as u64
}

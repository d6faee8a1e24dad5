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
//! service (an array read on a port one service has to itself, else a hash
//! lookup); then the embryonic table.
//!
//! This module rewrites and forwards; it leaves what a connection's entries
//! mean to [`conntrack`] and the wire formats to [`crate::headers`].

use core::mem::MaybeUninit;

use aya_ebpf::EbpfContext as _;
use aya_ebpf::bindings::{
    BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibParams, xdp_action, xdp_md,
};
use aya_ebpf::helpers::generated::{
    bpf_check_mtu, bpf_fib_lookup, bpf_ktime_get_coarse_ns, bpf_redirect,
};
use aya_ebpf::programs::XdpContext;
use balancer_common::l4::{
    Backend, BackendState, FLAG_RECOVERED, FLAG_REMOTE, FLAG_SEQ, Flow, FlowKey, LIST_TRIES,
    MAX_PROBES, MAX_SERVICE_BACKENDS, NextHop, Outcome, PROTO_TCP, Service, ServiceKey, flow_hash,
    mac_halves, mix64, probe_hash, sole_of,
};

use crate::atomic;
use crate::conntrack;
use crate::csum;
use crate::family::{Family, IpHeader};
use crate::headers::{EthHdr, Ipv6Hdr, Segment, TcpHdr};
use crate::maps::{
    CONFIG, FIB_SCRATCH, MAGLEV, SERVICE_BACKENDS, TRIALS, backend_stats, outcome, port_bits,
    service_stats,
};

/// A parsed IP/TCP packet of family `F`, bounds-checked by the parser.
pub struct TcpPacket<F: Family> {
    pub ip: *mut F::Hdr,
    pub tcp: *mut TcpHdr,
    /// Where the IP header starts (after an 802.1Q tag, if any).
    pub l3: usize,
    /// What the parser found out: the `TcpPacket::*` mark bits, and `l3`
    /// above them. (One word, so that [`steer`] takes the packet as four
    /// scalar arguments and the parser keeps few values across its map
    /// lookups: a struct passed by reference, or spilled registers, would
    /// sit in the parser's stack frame, which counts toward the 512 bytes
    /// of the call chain.)
    pub marks: u32,
}

impl<F: Family> TcpPacket<F> {
    /// SYN without ACK: the client opens a connection.
    pub const SYN: u32 = 1;
    /// The frame carries an 802.1Q tag.
    pub const TAGGED: u32 = 2;
    /// The destination port has `PORT_SERVICE` set.
    pub const TO_SERVICE: u32 = 4;
    /// The source port has `PORT_REPLY_INGRESS` set.
    pub const FROM_BACKEND: u32 = 8;

    /// The marks word with `l3` (at most a few dozen bytes) above the bits.
    #[inline(always)]
    pub fn with_l3(l3: usize) -> u32 {
        (l3 as u32 & 0xff) << 8
    }

    /// `l3` from a marks word; masked, so the verifier knows its bounds.
    #[inline(always)]
    fn l3_of(marks: u32) -> usize {
        ((marks >> 8) & 0xff) as usize
    }

    #[inline(always)]
    fn has(&self, mark: u32) -> bool {
        self.marks & mark != 0
    }
}

/// Where [`next_hop`] finds and keeps the next hop toward the destination.
#[derive(Clone, Copy)]
pub enum HopCache<A> {
    /// Toward backend slot `index` (`NEXT_HOPS`).
    Backend(u32),
    /// Toward a client (`CLIENT_HOPS`, keyed by its address).
    Client(A),
}

/// How a steered packet leaves: [`send`]'s instructions (one argument, as
/// BPF functions take at most five).
#[derive(Clone, Copy)]
struct Delivery<A> {
    rewrite: Rewrite<A>,
    /// The entry's or service's flags ([`FLAG_REMOTE`]).
    flags: u32,
    cache: HopCache<A>,
    /// Whose counters a forwarding failure goes on.
    backend: u32,
}

impl<A: Copy> Delivery<A> {
    /// Client to service, rewritten to `flow`'s backend.
    #[inline(always)]
    fn forward(flow: &Flow<A>, backend: u32, flags: u32) -> Self {
        Self {
            rewrite: Rewrite::Dst(flow.addr, flow.port),
            flags,
            cache: HopCache::Backend(backend),
            backend,
        }
    }
}

impl<A: Default> Default for Delivery<A> {
    fn default() -> Self {
        Self {
            rewrite: Rewrite::Dst(A::default(), 0),
            flags: 0,
            cache: HopCache::Backend(0),
            backend: 0,
        }
    }
}

/// The largest per-packet locals of steering, kept in this CPU's slot of a
/// per-CPU array instead of on the stack ([`Family::scratch`]). A program
/// run owns the slot from start to end: nothing else runs on its CPU
/// meanwhile.
pub struct Scratch<A> {
    key: FlowKey<A>,
    seg: Segment,
    found: MaybeUninit<Flow<A>>,
    /// The TC program's copy of an IPv6 header.
    ipv6: MaybeUninit<Ipv6Hdr>,
}

/// The scratch slot of the XDP program; the TC program has its own, in
/// case one ever runs inside the other on a CPU.
pub const SCRATCH_XDP: u32 = 0;
pub const SCRATCH_EGRESS: u32 = 1;

impl<A: Copy> Scratch<A> {
    /// Room for an IPv6 header.
    ///
    /// # Safety
    /// As for [`Scratch::init`].
    #[inline(always)]
    pub unsafe fn ipv6<'a>(scratch: *mut Self) -> &'a mut MaybeUninit<Ipv6Hdr> {
        // SAFETY: the caller's promise.
        unsafe { &mut (*scratch).ipv6 }
    }

    /// Writes `key` into `scratch` and returns it with the slot for the
    /// entry found (a lookup without a segment: ICMP's).
    ///
    /// # Safety
    /// As for [`Scratch::init`].
    #[inline(always)]
    pub unsafe fn key<'a>(
        scratch: *mut Self,
        key: FlowKey<A>,
    ) -> (&'a FlowKey<A>, &'a mut MaybeUninit<Flow<A>>) {
        // SAFETY: the caller's promise; written before it is referenced.
        unsafe {
            (&raw mut (*scratch).key).write(key);
            (&(*scratch).key, &mut (*scratch).found)
        }
    }

    /// Writes `key` and `seg` into `scratch` and returns them with the
    /// slot for the entry found.
    ///
    /// # Safety
    /// `scratch` is valid for writes and used by nothing else until the
    /// references are dropped: a local, or this CPU's slot of a per-CPU
    /// map during one program run (nothing else runs on the CPU meanwhile).
    #[inline(always)]
    pub unsafe fn init<'a>(
        scratch: *mut Self,
        key: FlowKey<A>,
        seg: Segment,
    ) -> (&'a FlowKey<A>, &'a Segment, &'a mut MaybeUninit<Flow<A>>) {
        // SAFETY: the caller's promise; both are written before the
        // references to them are taken.
        unsafe {
            (&raw mut (*scratch).key).write(key);
            (&raw mut (*scratch).seg).write(seg);
            (&(*scratch).key, &(*scratch).seg, &mut (*scratch).found)
        }
    }
}

/// The NAT rewrite a packet gets.
#[derive(Clone, Copy)]
enum Rewrite<A> {
    /// Client to service: the destination becomes the backend.
    Dst(A, u16),
    /// Backend to client: the source becomes the service.
    Src(A, u16),
}

/// Steers a TCP segment whose ports may be a service's, inlined into the
/// parser of each family's program (a call would cost the known flow a few
/// nanoseconds, and the verifier walks a subprogram once per call site
/// anyway: inlined, `balancer6` verifies in half the instructions).
#[inline(always)]
pub fn steer<F: Family>(ctx: *mut xdp_md, ip: *mut F::Hdr, tcp: *mut TcpHdr, marks: u32) -> u32 {
    let ctx = &XdpContext::new(ctx);
    let packet = &TcpPacket::<F> {
        ip,
        tcp,
        l3: TcpPacket::<F>::l3_of(marks),
        marks,
    };
    // SAFETY: the parser checked that both headers lie inside the frame, and
    // nothing in this program run resizes it before the last use.
    let (ip, tcp) = unsafe { (&mut *packet.ip, &mut *packet.tcp) };
    let Some(scratch) = F::scratch().get_ptr_mut(SCRATCH_XDP) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: `scratch` is this CPU's map slot.
    let (key, seg, found) = unsafe {
        Scratch::init(
            scratch,
            FlowKey::tcp(
                ip.src(),
                u16::from_ne_bytes(tcp.source),
                ip.dst(),
                u16::from_ne_bytes(tcp.dest),
            ),
            tcp.segment(ip.l4_len()),
        )
    };

    if packet.has(TcpPacket::<F>::TO_SERVICE) {
        // A SYN always gets a fresh decision: a client reusing a port for a
        // new connection must not inherit a backend that has been isolated
        // since.
        if !packet.has(TcpPacket::<F>::SYN)
            && let Some(flow) = conntrack::established::<F>(key, seg)
        {
            return known(ctx, packet, flow);
        }
        // The service before the embryonic table: traffic to the service
        // port of another address pays one lookup less.
        if let Some(service) = service::<F>(key) {
            if !packet.has(TcpPacket::<F>::SYN) && conntrack::handshaking::<F>(key, seg, found) {
                // SAFETY: `handshaking` wrote it.
                return known(ctx, packet, unsafe { found.assume_init_ref() });
            }
            let mut how = Delivery::default();
            if !admit::<F>(ctx, key, &service, seg, &mut how) {
                return xdp_action::XDP_PASS;
            }
            return send(ctx, packet, &how);
        }
    }
    if packet.has(TcpPacket::<F>::FROM_BACKEND) && conntrack::reply::<F>(key, seg, found) {
        // SAFETY: `reply` wrote it.
        let flow = unsafe { found.assume_init_ref() };
        // A backend's answer gets the service as its source and goes on to
        // the client.
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
    outcome(Outcome::NotService);
    xdp_action::XDP_PASS
}

/// The service `key` is addressed to, if any. On a port one service of
/// the family has to itself (its `PORTS` entry names it:
/// `balancer_common::l4::port_sole`), the copy in the `SOLE_SERVICES` slot
/// it names decides: two array reads, which the verifier inlines, where the
/// hash lookup is a call into the kernel. (The agent writes a service's
/// other slot and then repoints the field, so the slot read here is whole.)
#[inline(always)]
fn service<F: Family>(key: &FlowKey<F::Addr>) -> Option<Service> {
    let sole = sole_of::<F::Addr>(port_bits(u16::from_be(key.dst_port)));
    if sole == 0 {
        // SAFETY: a successful lookup, copied at once.
        F::services()
            .get_ptr(ServiceKey::tcp(key.dst_addr, key.dst_port))
            .map(|service| unsafe { *service })
    } else {
        F::sole_services()
            .get(sole - 1)
            .filter(|sole| sole.key.addr == key.dst_addr && sole.key.port == key.dst_port)
            .map(|sole| sole.service)
    }
}

/// A client packet of a connection a table knows: to its backend.
#[inline(always)]
fn known<F: Family>(ctx: &XdpContext, packet: &TcpPacket<F>, flow: &Flow<F::Addr>) -> u32 {
    outcome(Outcome::Established);
    count_forward(ctx, flow.service, flow.backend, false);
    send(
        ctx,
        packet,
        &Delivery::forward(flow, flow.backend, flow.flags),
    )
}

/// A backend for a packet to `service` that no connection entry covers,
/// its entries, and how it leaves (in `how`); false when the
/// service has no backend for it (counted, the packet passes).
///
/// - A SYN opens a new connection: a routable backend, embryonic entries.
/// - Any other packet belongs to a connection neither table knows (evicted,
///   or older than the agent): the live backend at the flow's first table
///   slot, whatever its state, since that is where the connection went
///   while the table was as it is (a routable one if that slot is empty).
///   Resets get no entries; everything else embryonic ones that the
///   backend's answer confirms.
#[inline(always)]
fn admit<F: Family>(
    ctx: &XdpContext,
    key: &FlowKey<F::Addr>,
    service: &Service,
    seg: &Segment,
    how: &mut Delivery<F::Addr>,
) -> bool {
    let hash = flow_hash(key.src_addr, key.src_port, key.dst_addr, key.dst_port);
    let syn = seg.has(TcpHdr::SYN) && !seg.has(TcpHdr::ACK);
    let chosen = if syn {
        pick::<F>(service, hash)
    } else {
        live_at::<F>(service, hash).or_else(|| pick::<F>(service, hash))
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
        conntrack::open::<F>(key, &flow);
        outcome(Outcome::NewFlow);
    } else {
        if !seg.has(TcpHdr::RST) {
            flow.flags |= FLAG_RECOVERED;
            flow.ack = seg.ack;
            conntrack::recover::<F>(key, &flow);
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
fn pick<F: Family>(service: &Service, hash: u64) -> Option<(u32, Backend<F::Addr>)> {
    if service.table_size != 0 {
        let size = u64::from(service.table_size);
        for probe in 0..MAX_PROBES {
            let slot = (probe_hash(hash, probe) % size) as u32;
            if let Some(&index) = MAGLEV.get(service.table_offset.wrapping_add(slot))
                && let Some(backend) = backend::<F>(index, hash, true)
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
            && let Some(backend) = backend::<F>(index, hash, true)
        {
            return Some((index, backend));
        }
    }
    None
}

/// The live backend at the flow's first table slot, if any.
#[inline(always)]
fn live_at<F: Family>(service: &Service, hash: u64) -> Option<(u32, Backend<F::Addr>)> {
    if service.table_size == 0 {
        return None;
    }
    let slot = (hash % u64::from(service.table_size)) as u32;
    let index = *MAGLEV.get(service.table_offset.wrapping_add(slot))?;
    backend::<F>(index, hash, false).map(|b| (index, b))
}

/// Backend `index` if it may take a new connection with flow hash `hash`
/// (`routable`), or if it is live (otherwise).
///
/// Routable backends always may; a degraded one takes its share of the
/// connections that pick it (by the hash, so a retransmitted SYN gets the
/// same answer); a half-open one takes a few trial connections per second.
#[inline(always)]
fn backend<F: Family>(index: u32, hash: u64, routable: bool) -> Option<Backend<F::Addr>> {
    let backend = F::backends().get(index)?;
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
/// quotes the packet as it was sent: an IPv4 TTL about to expire gets ICMP
/// time exceeded, a packet larger than the next hop's MTU with DF set gets
/// ICMP fragmentation needed (without DF the kernel fragments it); IPv6
/// gets ICMPv6 time exceeded and packet too big (from the ICMPv6 program,
/// see [`crate::icmp6::ANSWER`]). Without a usable next hop, and for a
/// VLAN-tagged frame, the rewritten packet goes to the kernel to forward.
#[inline(always)]
fn send<F: Family>(ctx: &XdpContext, packet: &TcpPacket<F>, how: &Delivery<F::Addr>) -> u32 {
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
        apply::<F>(ip, tcp, rewrite);
        return xdp_action::XDP_PASS;
    }
    if ip.hops() <= 1 {
        if let Some(action) = F::Hdr::answer(ctx, packet.l3, 0) {
            outcome(Outcome::TtlExpired);
            return action;
        }
        apply::<F>(ip, tcp, rewrite);
        unresolved(backend);
        return xdp_action::XDP_PASS;
    }
    let dst = match rewrite {
        Rewrite::Dst(addr, _) => addr,
        Rewrite::Src(..) => ip.dst(),
    };
    let hop = if packet.has(TcpPacket::<F>::TAGGED) {
        None
    } else {
        next_hop::<F>(ctx, ip, dst, cache)
    };
    let Some(hop) = hop else {
        apply::<F>(ip, tcp, rewrite);
        unresolved(backend);
        return xdp_action::XDP_PASS;
    };
    if ip.l3_len() > hop.mtu {
        if !ip.may_fragment()
            && let Some(action) = F::Hdr::answer(ctx, packet.l3, hop.mtu)
        {
            outcome(Outcome::FragNeeded);
            return action;
        }
        apply::<F>(ip, tcp, rewrite);
        unresolved(backend);
        return xdp_action::XDP_PASS;
    }
    apply::<F>(ip, tcp, rewrite);
    emit(ctx, ip, &hop)
}

fn unresolved(backend: u32) {
    outcome(Outcome::Unresolved);
    if let Some(stats) = backend_stats(backend) {
        stats.unresolved += 1;
    }
}

/// Decrements the TTL or hop limit (unless configured not to), sets the
/// MACs of `hop` and sends the frame there.
#[inline(always)]
pub fn emit<H: IpHeader>(ctx: &XdpContext, ip: &mut H, hop: &NextHop<H::Addr>) -> u32 {
    let keep_ttl = CONFIG.get(0).is_some_and(|c| c.keep_ttl != 0);
    if !keep_ttl {
        ip.decrement_hops();
    }

    let start = ctx.data();
    if start + EthHdr::LEN > ctx.data_end() {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: bounds-checked just above.
    let eth = unsafe { &mut *(start as *mut EthHdr) };
    eth.set_macs(hop.dst_mac, hop.src_mac);
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
pub fn next_hop<F: Family>(
    ctx: &XdpContext,
    ip: &F::Hdr,
    dst: F::Addr,
    cache: HopCache<F::Addr>,
) -> Option<NextHop<F::Addr>> {
    let generation = CONFIG.get(0).map_or(0, |c| c.generation);
    // A raw pointer (null for none) rather than an `Option` kept across the
    // lookup below: LLVM spills the payload of a `None` as an undefined
    // register, which the verifier refuses to read.
    let slot = match cache {
        HopCache::Backend(index) => F::next_hops().get_ptr_mut(index),
        HopCache::Client(addr) => F::client_hops().get_ptr_mut(addr),
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
        let _ = F::client_hops().insert(addr, hop, 0);
    }
    Some(hop)
}

/// Fills `hop` with the egress interface, MAC addresses and MTU toward
/// `dst`; whether the kernel knows them. Not inlined (it is the slow path),
/// hence the out-parameter: a subprogram may not return a pointer into its
/// caller's stack, which is how LLVM returns a struct.
#[inline(never)]
fn fib_lookup<H: IpHeader>(
    ctx: &XdpContext,
    ip: &H,
    dst: H::Addr,
    hop: &mut NextHop<H::Addr>,
) -> bool {
    let Some(params) = FIB_SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a successful lookup; nothing else uses it
    // while this program runs here.
    let params = unsafe { &mut *params };
    // SAFETY: an all-zero `bpf_fib_lookup` is its documented empty input.
    *params = unsafe { core::mem::zeroed() };
    params.l4_protocol = PROTO_TCP;
    // No length: the MTU is checked per packet against the cached hop, so
    // the lookup must not fail on this packet's size.
    ip.fib(params, dst);
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
    hop.dst_mac = mac_halves(params.dmac);
    hop.src_mac = mac_halves(params.smac);
    hop.mtu = mtu;
    true
}

/// Rewrites the address (the IP header updates its own checksum, if it has
/// one) and the port, and updates the TCP checksum, which covers the
/// addresses through the pseudo-header.
#[inline(always)]
fn apply<F: Family>(ip: &mut F::Hdr, tcp: &mut TcpHdr, rewrite: Rewrite<F::Addr>) {
    match rewrite {
        Rewrite::Dst(addr, port) => {
            let (old_addr, old_port) = (ip.dst(), u16::from_ne_bytes(tcp.dest));
            patch::<F>(tcp, old_addr, addr, old_port, port);
            ip.set_dst(addr);
            tcp.dest = port.to_ne_bytes();
        }
        Rewrite::Src(addr, port) => {
            let (old_addr, old_port) = (ip.src(), u16::from_ne_bytes(tcp.source));
            patch::<F>(tcp, old_addr, addr, old_port, port);
            ip.set_src(addr);
            tcp.source = port.to_ne_bytes();
        }
    }
}

#[inline(always)]
fn patch<F: Family>(tcp: &mut TcpHdr, old_addr: F::Addr, addr: F::Addr, old_port: u16, port: u16) {
    let check = F::Hdr::csum_addr(u16::from_ne_bytes(tcp.check), old_addr, addr);
    tcp.check = csum::replace2(check, old_port, port).to_ne_bytes();
}

#[inline(always)]
fn frame_len(ctx: &XdpContext) -> u64 {
    (ctx.data_end() - ctx.data()) as u64
}

//! Maps and values of L4 steering: virtual services, their backends, the
//! consistent-hash tables, the connection table and the counters.
//!
//! Addresses and ports inside map keys and values are kept in network byte
//! order, exactly as they sit in the packet: the program copies them without
//! swapping and the checksum updates work on the raw bytes. [`addr_be`] and
//! [`port_be`] convert from userspace values. Only the index of the [`PORTS`]
//! array is a port in host order (it is an array index).
//!
//! Layouts are `#[repr(C)]` with explicit padding fields: hash-map keys are
//! compared byte by byte, so no byte of a key may be left uninitialised.
//!
//! Both families use the same types, generic over the address ([`Addr`]:
//! `u32` for IPv4, the default, and [`Addr6`] for IPv6), and the same
//! program code; each family has its own services, backend addresses,
//! next hops and connection tables (the `*6` maps), while everything indexed
//! by a service or backend slot (Maglev tables, routable lists, counters,
//! trials) is shared: a slot belongs to one family.

/// The `#[classifier]` program that restores the service address on replies
/// that local workers send (local mode, TC egress).
pub const EGRESS_PROGRAM_NAME: &str = "balancer_egress";

/// The `#[xdp]` program that steers IPv6 TCP: the XDP program tail-calls it
/// through [`IPV6_PROGRAM`], so that each family's steering has a program
/// of its own to pass the verifier in (512 bytes of stack for a call chain,
/// a million instructions walked per program).
pub const IPV6_PROGRAM_NAME: &str = "balancer6";
/// Program array of one entry: [`IPV6_PROGRAM_NAME`], put there by the
/// agent once it is loaded.
pub const IPV6_PROGRAM: &str = "IPV6_PROGRAM";
/// The `#[xdp]` program that handles ICMPv6 errors about steered
/// connections and, in remote mode, answers what IPv6 cannot forward (hop
/// limit, MTU): both XDP programs tail-call it through [`ICMP6_PROGRAM`].
pub const ICMP6_PROGRAM_NAME: &str = "balancer_icmp6";
/// Program array of one entry: [`ICMP6_PROGRAM_NAME`], put there by the
/// agent once it is loaded.
pub const ICMP6_PROGRAM: &str = "ICMP6_PROGRAM";

/// `ServiceKey` → [`Service`] (hash).
pub const SERVICES: &str = "SERVICES";
/// Slot → [`SoleService`] (array of [`SOLE_SLOTS`], two per service
/// index): the key and entry of an IPv4 service that has its port to
/// itself, where a SYN to that port ([`port_sole`]) finds it with an array
/// read instead of a hash lookup (which costs a call into the kernel;
/// array reads are inlined).
pub const SOLE_SERVICES: &str = "SOLE_SERVICES";
/// Backend index → [`Backend`] (array of [`MAX_BACKENDS`]).
pub const BACKENDS: &str = "BACKENDS";
/// Backend index → [`NextHop`] toward the backend (array, remote mode).
pub const NEXT_HOPS: &str = "NEXT_HOPS";
/// Client address → [`NextHop`] toward the client (LRU hash, remote mode:
/// where replies go). Per address rather than per connection, so that all
/// of a client's connections share one lookup.
pub const CLIENT_HOPS: &str = "CLIENT_HOPS";
/// The Maglev tables of every service, as backend indices (flat `u32` array;
/// a service's table is the slice at [`Service::table_offset`]).
pub const MAGLEV: &str = "MAGLEV";
/// The routable backends of every service: two lists of
/// [`MAX_SERVICE_BACKENDS`] backend indices per service (the one in use, at
/// [`Service::list_offset`], and the next, written whole before the service
/// is switched to it). The fallback when no probe of the table finds a
/// routable backend; the agent rewrites it on every change of routability
/// (`u32` array).
pub const SERVICE_BACKENDS: &str = "SERVICE_BACKENDS";
/// [`FlowKey`] → [`Flow`] (LRU hash): both directions of every established
/// connection.
pub const CONNS: &str = "CONNS";
/// [`FlowKey`] → [`Flow`] (LRU hash): both directions of connections that
/// have not proven themselves yet (a SYN whose handshake has not completed,
/// a mid-flow packet nothing knew). Floods of SYNs or stray ACKs churn this
/// table only; an entry moves to [`CONNS`] once the handshake completes (the
/// client acknowledges the backend's SYN-ACK) or, for a mid-flow packet, once
/// the backend answers with something other than a reset.
pub const EMBRYONIC: &str = "EMBRYONIC";
/// [`SynSet`] array: the handshakes of SYNs the backend has not answered
/// yet, by a hash of their reply key, [`SYN_WAYS`] to a set. A SYN writes
/// its reply entry here rather than into [`EMBRYONIC`], which it reaches
/// when the backend answers (its SYN-ACK, or the reset that refuses it):
/// a slot write instead of an LRU insert, so a SYN (a SYN flood's packet)
/// costs no LRU node, no lock and no eviction.
pub const SYNS: &str = "SYNS";
/// [`SYNS`] of IPv6 connections ([`SynSet<Addr6>`]).
pub const SYNS6: &str = "SYNS6";
/// The global (patched at load) that holds the number of sets of
/// [`SYNS`] and [`SYNS6`] less one: the mask of a reply key's hash.
pub const SYN_SET_MASK: &str = "SYN_SET_MASK";
/// Port (host order) → [`PORT_SERVICE`] | [`PORT_REPLY_INGRESS`] |
/// [`PORT_REPLY_EGRESS`] bits, and per family the service the port
/// belongs to alone ([`port_sole`]) (`u32` array of 65536): lets the
/// program skip the hash lookups for traffic on ports nothing is steered
/// on, and the service lookup on a port one service has to itself.
pub const PORTS: &str = "PORTS";
/// Index 0 → [`Config`] (array of 1).
pub const CONFIG: &str = "CONFIG";
/// Service index → [`ServiceStats`] (per-CPU array of [`MAX_SERVICES`]).
pub const SERVICE_STATS: &str = "SERVICE_STATS";
/// Backend index → [`BackendStats`] (per-CPU array of [`MAX_BACKENDS`]).
pub const BACKEND_STATS: &str = "BACKEND_STATS";
/// Backend index → [`Trial`] (array of [`MAX_BACKENDS`]).
pub const TRIALS: &str = "TRIALS";
/// [`Outcome`] → packets (per-CPU `u64` array of [`Outcome::COUNT`]).
pub const OUTCOMES: &str = "OUTCOMES";

/// Services the maps have room for.
pub const MAX_SERVICES: u32 = 64;
/// Backends the maps have room for, all services together.
pub const MAX_BACKENDS: u32 = 256;
/// Backends one service's list has room for: all of them.
pub const MAX_SERVICE_BACKENDS: u32 = MAX_BACKENDS;
/// Maglev table size in production: a prime, so every skip value of the
/// permutation visits every slot, and about 100 times the backends a service
/// can have, which keeps each backend's share within about 1% of even.
pub const DEFAULT_TABLE_SIZE: u32 = 65_537;
/// Connections (both directions) the LRU connection table holds by default.
pub const DEFAULT_CONNTRACK_SIZE: u32 = 262_144;
/// Map flags of the two connection tables: `BPF_F_NO_COMMON_LRU`, an LRU
/// list per CPU. With the one shared list, each CPU holds back a batch of
/// free entries (up to 128) and refills it by evicting as many at once, so
/// a small table loses live connections to others' churn; per CPU, batches
/// are 4 entries and eviction follows each CPU's recency closely. (Each CPU
/// gets an equal part of the entries and evicts only from it.)
pub const CONNTRACK_MAP_FLAGS: u32 = 2;
/// Table slots a new connection tries (a fresh hash each) before falling
/// back to the service's list of routable backends: enough that a table
/// with a few isolated backends almost never needs the list.
pub const MAX_PROBES: u32 = 8;
/// Entries of the routable list a new connection tries, from the one its
/// hash gives: more than one only matters in the microseconds between a
/// state bit flipping and the agent rewriting the list.
pub const LIST_TRIES: u32 = 4;

/// [`SERVICES`] of IPv6 services ([`ServiceKey<Addr6>`]).
pub const SERVICES6: &str = "SERVICES6";
/// [`BACKENDS`] of IPv6 backends ([`Backend<Addr6>`], same slots: a slot
/// is in use in one of the two).
pub const BACKENDS6: &str = "BACKENDS6";
/// [`NEXT_HOPS`] toward IPv6 backends.
pub const NEXT_HOPS6: &str = "NEXT_HOPS6";
/// [`CLIENT_HOPS`] of IPv6 clients.
pub const CLIENT_HOPS6: &str = "CLIENT_HOPS6";
/// [`CONNS`] of IPv6 connections ([`FlowKey<Addr6>`] → [`Flow<Addr6>`]).
pub const CONNS6: &str = "CONNS6";
/// [`EMBRYONIC`] of IPv6 connections.
pub const EMBRYONIC6: &str = "EMBRYONIC6";
/// [`SOLE_SERVICES`] of IPv6 services.
pub const SOLE_SERVICES6: &str = "SOLE_SERVICES6";

/// `PORTS` bit: some service listens on this destination port.
pub const PORT_SERVICE: u32 = 1;
/// `PORTS` bit: some remote backend sends replies from this source port,
/// and they come back through the XDP program.
pub const PORT_REPLY_INGRESS: u32 = 2;
/// `PORTS` bit: some local backend sends replies from this source port, and
/// they leave through the TC egress program.
pub const PORT_REPLY_EGRESS: u32 = 4;
/// The `PORTS` bits above: what the agent marks ports with, as opposed to
/// the sole-service fields ([`port_sole`]), which follow the services.
pub const PORT_MARKS: u32 = PORT_SERVICE | PORT_REPLY_INGRESS | PORT_REPLY_EGRESS;

/// Slots of [`SOLE_SERVICES`]: two per service (`2 * index` and
/// `2 * index + 1`), the copy packets may be reading and the one the agent
/// writes next, as the Maglev tables are switched.
pub const SOLE_SLOTS: u32 = 2 * MAX_SERVICES;

/// The `PORTS` field of family `A` that says the port's only service of
/// that family has its copy in [`SOLE_SERVICES`] slot `slot`: slot + 1 in
/// the byte at [`Addr::SOLE_SHIFT`] (0: no service, or more than one).
pub const fn port_sole<A: Addr>(slot: u32) -> u32 {
    // Every slot + 1 fits the field's byte.
    const { assert!(SOLE_SLOTS < 0xff) };
    (slot + 1) << A::SOLE_SHIFT
}

/// The `PORTS` bits of family `A`'s sole-service field.
pub const fn sole_mask<A: Addr>() -> u32 {
    0xff << A::SOLE_SHIFT
}

/// The slot + 1 of the copy of the only service of family `A` that the
/// `PORTS` bits `bits` name, 0 if none.
#[inline(always)]
pub const fn sole_of<A: Addr>(bits: u32) -> u32 {
    (bits & sole_mask::<A>()) >> A::SOLE_SHIFT
}

/// [`Service::flags`] and [`Flow::flags`]: forward to a backend on another
/// host (rewrite, then redirect) instead of passing up to a local one.
pub const FLAG_REMOTE: u32 = 1;
/// [`Flow::flags`]: the entry is the reply direction (backend → client).
pub const FLAG_REPLY: u32 = 2;
/// [`Flow::flags`]: the client sent a FIN (set in both entries).
pub const FLAG_FIN_CLIENT: u32 = 4;
/// [`Flow::flags`]: the backend sent a FIN (set in both entries).
pub const FLAG_FIN_BACKEND: u32 = 8;
/// [`Flow::flags`]: [`Flow::seq`], [`Flow::ack`] and [`Flow::window`] hold
/// what the entry's sender last sent (for a reply entry in [`EMBRYONIC`]:
/// the backend's SYN-ACK has been seen).
pub const FLAG_SEQ: u32 = 16;
/// [`Flow::flags`]: made for a mid-flow packet of a connection no table
/// knew (evicted, or older than the agent); it moves to [`CONNS`] when the
/// backend answers with anything but a reset.
pub const FLAG_RECOVERED: u32 = 32;

/// [`Flow::closed`] counts in units of 2^20 ns (about a millisecond).
pub const CLOSED_SHIFT: u32 = 20;
/// How long after a connection closed its reply entry still restores
/// (about two seconds): enough for the last ACK and a retransmitted FIN,
/// short enough that a later connection on the same addresses and ports
/// that did not come through the balancer is not mistaken for it.
pub const CLOSE_GRACE: u32 = 2_000;

/// `IPPROTO_TCP`.
pub const PROTO_TCP: u8 = 6;

/// An address as it sits in a packet, in the maps' keys and values: IPv4
/// (`u32`) or IPv6 ([`Addr6`]).
pub trait Addr: Copy + Default + Eq + core::hash::Hash + core::fmt::Debug + 'static {
    /// Where the family's sole-service field sits in `PORTS` ([`port_sole`]).
    const SOLE_SHIFT: u32;
    /// 32 bits of the address, for hashes and checks: the IPv4 address
    /// itself (so IPv4 hashes are what they were before IPv6), an IPv6
    /// address's words folded.
    fn fold(self) -> u32;
}

impl Addr for u32 {
    const SOLE_SHIFT: u32 = 8;
    #[inline(always)]
    fn fold(self) -> u32 {
        self
    }
}

/// An IPv6 address as it sits in a packet: four words, each read in native
/// order from the packet's bytes (like an IPv4 [`addr_be`]), so the program
/// copies and checksums them without swapping.
pub type Addr6 = [u32; 4];

impl Addr for Addr6 {
    const SOLE_SHIFT: u32 = 16;
    #[inline(always)]
    fn fold(self) -> u32 {
        // Rotated so that equal words in different places do not cancel
        // (clients of one /64 differ in the last two only).
        self[0] ^ self[1].rotate_left(8) ^ self[2].rotate_left(16) ^ self[3].rotate_left(24)
    }
}

/// An IPv4 address as it sits in a packet.
pub const fn addr_be(octets: [u8; 4]) -> u32 {
    u32::from_ne_bytes(octets)
}

/// An IPv6 address as it sits in a packet.
pub const fn addr6_be(octets: [u8; 16]) -> Addr6 {
    let o = octets;
    [
        u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
        u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
        u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
        u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
    ]
}

/// The octets of an IPv6 address as it sits in a packet.
pub const fn addr6_octets(addr: Addr6) -> [u8; 16] {
    let (a, b, c, d) = (
        addr[0].to_ne_bytes(),
        addr[1].to_ne_bytes(),
        addr[2].to_ne_bytes(),
        addr[3].to_ne_bytes(),
    );
    [
        a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2],
        d[3],
    ]
}

/// A port as it sits in a packet.
pub const fn port_be(port: u16) -> u16 {
    port.to_be()
}

/// A virtual service: destination address, port and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceKey<A = u32> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

impl<A: Addr> ServiceKey<A> {
    pub const fn tcp(addr: A, port: u16) -> Self {
        Self {
            addr,
            port,
            proto: PROTO_TCP,
            _pad: 0,
        }
    }
}

/// What the program needs to pick a backend for a new connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service {
    /// Slot in `SERVICE_STATS`.
    pub index: u32,
    /// Where the service's current Maglev table starts in `MAGLEV`. The agent
    /// writes a new table next to the current one and then moves this, so a
    /// lookup never sees a half-written table.
    pub table_offset: u32,
    /// Slots of the current table; 0 when the service has no live backend.
    pub table_size: u32,
    /// Entries in the service's current routable list.
    pub backend_count: u32,
    /// [`FLAG_REMOTE`] or 0.
    pub flags: u32,
    /// Where the service's current backend list starts in
    /// `SERVICE_BACKENDS` (switched like `table_offset`).
    pub list_offset: u32,
}

/// A service's key and entry, in a slot of [`SOLE_SERVICES`]: the
/// program checks the key against the packet's destination before it uses
/// the entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SoleService<A = u32> {
    pub key: ServiceKey<A>,
    pub service: Service,
}

/// Whether a backend may take connections. Every state but `Unused` is
/// "live": the backend is in the service's Maglev table, and a mid-flow
/// packet of a connection the tables lost still goes to it, so a
/// connection on an isolated or draining backend is not moved.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendState {
    /// The slot holds no backend.
    #[default]
    Unused = 0,
    /// New connections may go here.
    Routable = 1,
    /// Breaker open or health NotReady: existing connections stay, new ones
    /// go elsewhere.
    Isolated = 2,
    /// Being removed: existing connections stay, new ones go elsewhere.
    Draining = 3,
    /// Breaker half-open: at most [`Backend::share`] new connections per
    /// second (about; `TRIALS` counts them), the trial.
    Trial = 4,
    /// Breaker degraded: [`Backend::share`] percent of the new connections
    /// that pick it.
    Degraded = 5,
}

impl BackendState {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Unused => "unused",
            Self::Routable => "routable",
            Self::Isolated => "isolated",
            Self::Draining => "draining",
            Self::Trial => "trial",
            Self::Degraded => "degraded",
        }
    }

    /// The state behind a raw value read from the map.
    pub const fn from_raw(raw: u32) -> Self {
        match raw {
            1 => Self::Routable,
            2 => Self::Isolated,
            3 => Self::Draining,
            4 => Self::Trial,
            5 => Self::Degraded,
            _ => Self::Unused,
        }
    }
}

/// One backend: where its connections go, and whether new ones may.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend<A = u32> {
    pub addr: A,
    pub port: u16,
    pub _pad: u16,
    /// A [`BackendState`] as `u32`: the agent flips it with one map write.
    pub state: u32,
    /// [`BackendState::Trial`]: new connections per second;
    /// [`BackendState::Degraded`]: percent of new connections. Unused
    /// otherwise.
    pub share: u32,
}

/// Where to send a frame for one destination: the egress interface and the
/// MAC addresses `bpf_fib_lookup` found, cached so that only the first
/// packet (per backend, or per client) pays for the lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHop<A = u32> {
    pub ifindex: u32,
    /// [`Config::generation`] when the entry was filled; the entry is stale
    /// once the agent moves the generation on (0 never matches).
    pub generation: u32,
    /// The destination the entry was resolved for: a backend slot that is
    /// reused for another backend must not inherit its predecessor's hop.
    pub addr: A,
    /// The MAC addresses, as three native-order halfwords of their bytes
    /// ([`mac_halves`]): the program reads and writes them a halfword at a
    /// time, where byte arrays cost a load, a spill and a store per byte.
    pub dst_mac: [u16; 3],
    pub src_mac: [u16; 3],
    /// The egress interface's MTU: larger packets are not redirected.
    pub mtu: u32,
    /// [`NextHop::check`] of the other fields, written last: entries are
    /// filled by the program on any CPU while others read them, and a read
    /// that does not match its check is a torn one, treated as a miss.
    pub check: u32,
}

impl<A: Addr> NextHop<A> {
    /// The value [`NextHop::check`] must hold: a mix of every other field,
    /// never 0, so that an all-zero entry (unused, or cleared by the agent)
    /// never validates.
    #[inline(always)]
    pub fn checksum(&self) -> u32 {
        let mac = |m: [u16; 3]| {
            let ([a, b], [c, d]) = (m[0].to_ne_bytes(), m[1].to_ne_bytes());
            u32::from_ne_bytes([a, b, c, d]) ^ u32::from(m[2]).rotate_left(16)
        };
        // Each field rotated differently, so that fields from two different
        // entries rarely combine into a valid check; one multiply to mix.
        let folded = self.ifindex
            ^ self.generation.rotate_left(7)
            ^ self.addr.fold().rotate_left(13)
            ^ self.mtu.rotate_left(19)
            ^ mac(self.dst_mac).rotate_left(23)
            ^ mac(self.src_mac).rotate_left(29);
        folded.wrapping_mul(0x9e37_79b1) | 1
    }

    /// Whether the entry is whole (not torn by a concurrent write).
    #[inline(always)]
    pub fn is_whole(&self) -> bool {
        self.check == self.checksum()
    }
}

/// A MAC address as [`NextHop`] holds it: three halfwords, each of two of
/// its bytes in the order a frame holds them.
#[inline(always)]
pub const fn mac_halves(mac: [u8; 6]) -> [u16; 3] {
    [
        u16::from_ne_bytes([mac[0], mac[1]]),
        u16::from_ne_bytes([mac[2], mac[3]]),
        u16::from_ne_bytes([mac[4], mac[5]]),
    ]
}

/// Settings the agent changes at run time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Cached next hops of an older generation are looked up again; the agent
    /// moves it on periodically, so neighbour and route changes reach the
    /// fast path. 0 disables the cache.
    pub generation: u32,
    /// Nonzero: forward without decrementing the TTL. Off by default (a
    /// forwarding balancer is a router hop); the per-packet benchmark turns
    /// it on because `BPF_PROG_TEST_RUN` feeds the program its own output,
    /// which would otherwise run out of TTL long before a million runs.
    pub keep_ttl: u32,
}

/// Ways of a [`SynSet`]: a waiting handshake is overwritten only when
/// this many later SYNs with the same set all arrive before its backend
/// answers, so the churn of other connections does not reset it.
pub const SYN_WAYS: usize = 4;

/// One set of [`SYNS`]: up to [`SYN_WAYS`] reply entries of SYNs (as
/// [`EMBRYONIC`] would hold them). The tags and stamps come first, in one
/// cache line with the first way, so that choosing a way reads one line;
/// each way's key, entry and check lie together (an IPv6 way is 96 bytes,
/// two cache lines), so that writing or reading one touches no other way.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SynSet<A = u32> {
    /// Per way, [`SynSet::tag`] of its reply key; 0 for an empty way.
    pub tags: [u32; SYN_WAYS],
    /// Per way, when it was written (low 32 bits of jiffies): the oldest
    /// way is the one a new SYN takes.
    pub stamps: [u32; SYN_WAYS],
    pub ways: [SynWay<A>; SYN_WAYS],
}

/// One way of a [`SynSet`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SynWay<A = u32> {
    pub key: FlowKey<A>,
    pub flow: Flow<A>,
    /// [`SynSet::check`] of `key` and `flow`: SYNs on two CPUs may write
    /// one way at once, and a reader takes only a whole one.
    pub check: u32,
}

impl<A: Addr> SynSet<A> {
    /// The hash that places reply key `key` (its set is the low bits, its
    /// tag the high ones).
    #[inline(always)]
    pub fn hash(key: &FlowKey<A>) -> u64 {
        flow_hash(key.src_addr, key.src_port, key.dst_addr, key.dst_port)
    }

    /// The tag of a reply key of hash `hash`: never 0, which marks an
    /// empty way.
    #[inline(always)]
    pub fn tag(hash: u64) -> u32 {
        (hash >> 32) as u32 | 1
    }

    /// The way that holds reply key `key` (of hash `hash`, [`SynSet::hash`])
    /// whole: its tag, its key, and its check over both, if one does.
    #[inline(always)]
    pub fn way_of(&self, key: &FlowKey<A>, hash: u64) -> Option<usize> {
        let tag = Self::tag(hash);
        for w in 0..SYN_WAYS {
            let way = &self.ways[w];
            if self.tags[w] == tag && way.key == *key && way.check == Self::check(key, &way.flow) {
                return Some(w);
            }
        }
        None
    }

    /// The check of a way holding `key` and `flow`: each field that
    /// steers a packet, rotated differently, and one multiply to mix.
    #[inline(always)]
    pub fn check(key: &FlowKey<A>, flow: &Flow<A>) -> u32 {
        let folded = key.src_addr.fold()
            ^ key.dst_addr.fold().rotate_left(5)
            ^ ((u32::from(key.src_port) << 16) | u32::from(key.dst_port)).rotate_left(11)
            ^ flow.addr.fold().rotate_left(17)
            ^ ((u32::from(flow.port) << 16) ^ flow.flags).rotate_left(23)
            ^ flow.service.rotate_left(3)
            ^ flow.backend.rotate_left(13)
            ^ flow.ack.rotate_left(29);
        folded.wrapping_mul(0x9e37_79b1) | 1
    }
}

/// One direction of a TCP connection, as it arrives.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey<A = u32> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    // Scalars rather than an array: zeroing them is two stores, not a call
    // to `memset` in the program's hot path.
    pub _pad0: u8,
    pub _pad1: u16,
}

impl<A: Addr> FlowKey<A> {
    pub const fn tcp(src_addr: A, src_port: u16, dst_addr: A, dst_port: u16) -> Self {
        Self {
            src_addr,
            dst_addr,
            src_port,
            dst_port,
            proto: PROTO_TCP,
            _pad0: 0,
            _pad1: 0,
        }
    }
}

/// What to do with a packet of a known connection.
///
/// Forward entries (client → service) rewrite the destination to
/// `addr:port` (the backend); reply entries ([`FLAG_REPLY`], backend →
/// client) rewrite the source to `addr:port` (the service).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow<A = u32> {
    pub addr: A,
    pub port: u16,
    pub _pad: u16,
    /// [`FLAG_REMOTE`] | [`FLAG_REPLY`] | [`FLAG_FIN_CLIENT`] |
    /// [`FLAG_FIN_BACKEND`].
    pub flags: u32,
    pub service: u32,
    pub backend: u32,
    /// When the connection closed (both FINs, or a RST), in
    /// [`CLOSED_SHIFT`] units of `bpf_ktime_get_coarse_ns`; 0 while open.
    /// Entries are not deleted on close (the LRU reclaims them), so this is
    /// what keeps a closed connection's reply entry from rewriting the
    /// replies of a later, unrelated connection on the same four-tuple.
    pub closed: u32,
    /// The sender's next sequence number as seen (host order): the end of
    /// the furthest segment it sent. A reset carrying exactly this is the
    /// sender's own.
    pub seq: u32,
    /// The sender's last acknowledgement (host order): the next byte it
    /// expects, where the peer's in-window resets start. (A reply entry a
    /// SYN made, before the backend answers: the client's next sequence
    /// number, which the forward entry is made from.)
    pub ack: u32,
    /// The sender's last advertised window, unscaled: a lower bound of the
    /// real one, so the in-window test errs toward ignoring a reset.
    pub window: u32,
    /// When a packet of this entry last made sure the other direction's
    /// entry exists (the low 32 bits of the kernel's jiffies).
    pub checked: u32,
}

impl<A: Addr> Flow<A> {
    /// The other direction's key (`key` is this entry's): each entry holds
    /// what the other needs, so either can find, and restore, the other.
    #[inline(always)]
    pub fn peer_key(&self, key: &FlowKey<A>) -> FlowKey<A> {
        if self.flags & FLAG_REPLY == 0 {
            FlowKey::tcp(self.addr, self.port, key.src_addr, key.src_port)
        } else {
            FlowKey::tcp(key.dst_addr, key.dst_port, self.addr, self.port)
        }
    }

    /// [`Flow::peer_key`] and the other direction's entry.
    #[inline(always)]
    pub fn peer(&self, key: &FlowKey<A>) -> (FlowKey<A>, Flow<A>) {
        // Forward (client -> service, rewritten to backend `addr`): the
        // reply comes from the backend to the client and gets the service
        // back. Reply (backend -> client, restored to service `addr`): the
        // forward comes from the client to the service and goes to the
        // backend.
        let (peer_key, addr, port) = if self.flags & FLAG_REPLY == 0 {
            (
                FlowKey::tcp(self.addr, self.port, key.src_addr, key.src_port),
                key.dst_addr,
                key.dst_port,
            )
        } else {
            (
                FlowKey::tcp(key.dst_addr, key.dst_port, self.addr, self.port),
                key.src_addr,
                key.src_port,
            )
        };
        let kept = FLAG_REMOTE | FLAG_FIN_CLIENT | FLAG_FIN_BACKEND | FLAG_RECOVERED;
        let peer = Flow {
            addr,
            port,
            _pad: 0,
            flags: (self.flags & kept) | (!self.flags & FLAG_REPLY),
            service: self.service,
            backend: self.backend,
            closed: self.closed,
            seq: 0,
            ack: 0,
            window: 0,
            checked: 0,
        };
        (peer_key, peer)
    }
}

/// Per-service counters (per CPU; the agent sums them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// Client → service packets steered to a backend, and their bytes
    /// (Ethernet frame included).
    pub packets: u64,
    pub bytes: u64,
    /// New connections given a backend (SYNs only).
    pub connections: u64,
    /// Packets that found no routable backend and went to the local stack.
    pub no_backend: u64,
}

/// Per-backend counters (per CPU; the agent sums them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    pub packets: u64,
    pub bytes: u64,
    pub connections: u64,
    /// Replies restored to the service address.
    pub reply_packets: u64,
    pub reply_bytes: u64,
    /// Remote mode: no usable next hop (no route, neighbour unresolved), so
    /// the rewritten packet went to the kernel to forward.
    pub unresolved: u64,
    /// Handshakes the backend answered with a SYN-ACK.
    pub established: u64,
    /// SYNs the backend answered with a reset (nothing listening).
    pub refused: u64,
    /// SYNs the client sent again before any SYN-ACK came back.
    pub timeouts: u64,
    /// Resets the backend sent on established connections.
    pub resets: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of this CPU's latest
    /// established, refused or timed-out handshake: where the agent measures
    /// the delay from a kernel signal to the breaker transition it causes.
    pub last_signal_ns: u64,
}

/// Trial admissions of a backend in the current second (`TRIALS`, one per
/// backend slot, shared by all CPUs).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Trial {
    /// `bpf_ktime_get_coarse_ns() >> 30` (about a second) of the count.
    pub second: u32,
    pub count: u32,
}

/// What L4 steering did with a TCP packet (IPv4, not a fragment, whole TCP
/// header). Index into `OUTCOMES`; append-only like
/// [`Verdict`](crate::Verdict).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Neither for a service nor a reply of a steered connection: passed.
    NotService = 0,
    /// A new connection (a SYN) given a routable backend.
    NewFlow = 1,
    /// A packet of a known connection sent to its backend.
    Established = 2,
    /// For a service without any routable backend: passed to the local
    /// stack untouched.
    NoBackend = 3,
    /// A reply restored to the service address (XDP in remote mode, TC
    /// egress in local mode).
    Reply = 4,
    /// Remote mode: rewritten, but no next hop to redirect to, so passed for
    /// the kernel to route (and resolve the neighbour).
    Unresolved = 5,
    /// Remote mode: TTL (IPv6: hop limit) would expire on forwarding;
    /// answered with ICMP (ICMPv6) time exceeded, quoting the packet as the
    /// client sent it.
    TtlExpired = 6,
    /// A table refused an entry: the packet is still steered, and the next
    /// one of its connection tries again.
    ConntrackFull = 7,
    /// A mid-flow packet of a connection no table knew, sent to the live
    /// backend the table gives its hash (isolated and draining ones
    /// included: that is where the connection was).
    Recovered = 8,
    /// A reset outside the tracked sequence window: passed on to the
    /// endpoint (whose stack decides), but it closes nothing here.
    RstIgnored = 9,
    /// One direction of a connection was missing from the table and was
    /// rebuilt from the other.
    PeerRestored = 10,
    /// An ICMP or ICMPv6 error about a steered connection, translated and
    /// sent to the endpoint of the connection it quotes.
    Icmp = 11,
    /// Remote mode: larger than the next hop's MTU with DF set (IPv6:
    /// always); answered with ICMP fragmentation needed (ICMPv6 packet too
    /// big).
    FragNeeded = 12,
    /// An entry of a connection whose handshake completed (or whose backend
    /// answered) moved to the established table.
    Promoted = 13,
}

impl Outcome {
    pub const COUNT: usize = 14;

    pub const ALL: [Self; Self::COUNT] = [
        Self::NotService,
        Self::NewFlow,
        Self::Established,
        Self::NoBackend,
        Self::Reply,
        Self::Unresolved,
        Self::TtlExpired,
        Self::ConntrackFull,
        Self::Recovered,
        Self::RstIgnored,
        Self::PeerRestored,
        Self::Icmp,
        Self::FragNeeded,
        Self::Promoted,
    ];

    pub const fn index(self) -> u32 {
        self as u32
    }

    pub const fn name(self) -> &'static str {
        match self {
            Self::NotService => "not_service",
            Self::NewFlow => "new_flow",
            Self::Established => "established",
            Self::NoBackend => "no_backend",
            Self::Reply => "reply",
            Self::Unresolved => "unresolved",
            Self::TtlExpired => "ttl_expired",
            Self::ConntrackFull => "conntrack_full",
            Self::Recovered => "recovered",
            Self::RstIgnored => "rst_ignored",
            Self::PeerRestored => "peer_restored",
            Self::Icmp => "icmp",
            Self::FragNeeded => "frag_needed",
            Self::Promoted => "promoted",
        }
    }
}

const _: () = {
    let mut i = 0;
    while i < Outcome::COUNT {
        assert!(Outcome::ALL[i].index() as usize == i);
        i += 1;
    }
    // The sizes both sides must agree on, without hidden padding.
    assert!(size_of::<ServiceKey>() == 8);
    assert!(size_of::<Service>() == 24);
    assert!(size_of::<Backend>() == 16);
    assert!(size_of::<NextHop>() == 32);
    assert!(size_of::<FlowKey>() == 16);
    assert!(size_of::<Flow>() == 40);
    assert!(size_of::<ServiceStats>() == 32);
    assert!(size_of::<BackendStats>() == 88);
    assert!(size_of::<Trial>() == 8);
    assert!(size_of::<ServiceKey<Addr6>>() == 20);
    assert!(size_of::<Backend<Addr6>>() == 28);
    assert!(size_of::<NextHop<Addr6>>() == 44);
    assert!(size_of::<FlowKey<Addr6>>() == 40);
    assert!(size_of::<Flow<Addr6>>() == 52);
};

/// The hash the program spreads new connections with: MurmurHash3's 64-bit
/// finaliser over the four-tuple (IPv6 addresses folded to 32 bits first).
/// A few multiplications, and every input bit moves every output bit, which
/// Maglev's `hash % size` needs.
#[inline(always)]
pub fn flow_hash<A: Addr>(src_addr: A, src_port: u16, dst_addr: A, dst_port: u16) -> u64 {
    let addrs = (u64::from(src_addr.fold()) << 32) | u64::from(dst_addr.fold());
    let ports = (u64::from(src_port) << 16) | u64::from(dst_port);
    mix64(addrs ^ mix64(ports ^ 0x9e37_79b9_7f4a_7c15))
}

/// The hash of the `probe`th table slot to try (0 is the flow hash itself).
#[inline(always)]
pub fn probe_hash(hash: u64, probe: u32) -> u64 {
    if probe == 0 {
        hash
    } else {
        mix64(hash.wrapping_add(u64::from(probe).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
    }
}

#[inline(always)]
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY (all): plain #[repr(C)] integers and byte arrays with explicit
    // padding fields, so every bit pattern is valid and no byte is padding.
    // The address types (`u32`, `[u32; 4]`) are 4-aligned words, so the
    // layouts are the same for both (the size assertions above check it).
    unsafe impl<A: Addr + aya::Pod> aya::Pod for ServiceKey<A> {}
    unsafe impl aya::Pod for Service {}
    unsafe impl<A: Addr + aya::Pod> aya::Pod for SoleService<A> {}
    unsafe impl<A: Addr + aya::Pod> aya::Pod for Backend<A> {}
    unsafe impl<A: Addr + aya::Pod> aya::Pod for NextHop<A> {}
    unsafe impl aya::Pod for Config {}
    unsafe impl<A: Addr + aya::Pod> aya::Pod for FlowKey<A> {}
    unsafe impl<A: Addr + aya::Pod> aya::Pod for Flow<A> {}
    unsafe impl<A: Addr + aya::Pod> aya::Pod for SynSet<A> {}
    unsafe impl<A: Addr + aya::Pod> aya::Pod for SynWay<A> {}
    unsafe impl aya::Pod for ServiceStats {}
    unsafe impl aya::Pod for BackendStats {}
    unsafe impl aya::Pod for Trial {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A way found by its key and check only when whole: an entry of
    /// another connection under this key (two CPUs' writes mixed), or a
    /// tag of another key, is no way of it.
    #[test]
    fn a_syn_way_is_found_only_whole() {
        let key = FlowKey::tcp(0x0b02_630a, 8000, 0x0201_630a, 40_000);
        let flow = Flow {
            addr: 0x6400_630a,
            port: 80,
            flags: FLAG_REPLY,
            ack: 1001,
            ..Flow::default()
        };
        let hash = SynSet::hash(&key);
        let mut set = SynSet::default();
        set.tags[2] = SynSet::<u32>::tag(hash);
        set.ways[2] = SynWay {
            key,
            flow,
            check: SynSet::check(&key, &flow),
        };
        assert_eq!(set.way_of(&key, hash), Some(2));
        set.ways[2].flow.addr = 0x6500_630a;
        assert_eq!(set.way_of(&key, hash), None, "a torn entry");
        set.ways[2].flow = flow;
        set.ways[2].flow.ack = 2002;
        assert_eq!(set.way_of(&key, hash), None, "another handshake's number");
        set.ways[2].flow = flow;
        set.tags[2] ^= 2;
        assert_eq!(set.way_of(&key, hash), None, "another tag");
    }

    const DST: [u8; 6] = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];
    const SRC: [u8; 6] = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee];

    fn hop() -> NextHop {
        let mut hop = NextHop {
            ifindex: 7,
            generation: 3,
            addr: u32::from_ne_bytes([10, 99, 2, 11]),
            dst_mac: mac_halves(DST),
            src_mac: mac_halves(SRC),
            mtu: 1500,
            check: 0,
        };
        hop.check = hop.checksum();
        hop
    }

    #[test]
    fn mac_halves_keep_the_bytes_in_frame_order() {
        let mut bytes = [0u8; 6];
        for (i, half) in mac_halves(DST).into_iter().enumerate() {
            bytes[2 * i..2 * i + 2].copy_from_slice(&half.to_ne_bytes());
        }
        assert_eq!(bytes, DST);
    }

    /// Entries written by a build that kept the MAC addresses as bytes
    /// still validate after an upgrade (no route lookup for every cached
    /// next hop at once).
    #[test]
    fn the_check_is_the_one_byte_wise_addresses_gave() {
        let mac = |m: [u8; 6]| {
            u32::from_ne_bytes([m[0], m[1], m[2], m[3]])
                ^ u32::from(u16::from_ne_bytes([m[4], m[5]])).rotate_left(16)
        };
        let hop = hop();
        let folded = hop.ifindex
            ^ hop.generation.rotate_left(7)
            ^ hop.addr.fold().rotate_left(13)
            ^ hop.mtu.rotate_left(19)
            ^ mac(DST).rotate_left(23)
            ^ mac(SRC).rotate_left(29);
        assert_eq!(hop.check, folded.wrapping_mul(0x9e37_79b1) | 1);
    }

    #[test]
    fn a_next_hop_torn_in_a_mac_address_fails_its_check() {
        let whole = hop();
        assert!(whole.is_whole());
        for i in 0..3 {
            let mut torn = whole;
            torn.dst_mac[i] ^= 0x0100;
            assert!(!torn.is_whole(), "destination half {i}");
            let mut torn = whole;
            torn.src_mac[i] ^= 0x0001;
            assert!(!torn.is_whole(), "source half {i}");
        }
        assert!(!NextHop::<u32>::default().is_whole());
    }
}

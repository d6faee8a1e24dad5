//! Every map of the object, and the counter helpers. Userspace finds the
//! maps by these symbol names, which `balancer_common` spells out for it;
//! the agent resizes the large ones (`MAGLEV`, `CONNS`, `EMBRYONIC`) at
//! load time to what its flags ask for. What the connection tables mean is
//! [`crate::conntrack`]'s business.

use crate::icmp6::Call;
use crate::l4::Scratch;
use aya_ebpf::Global;
use aya_ebpf::bindings::bpf_fib_lookup as FibParams;
use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, LruHashMap, PerCpuArray, ProgramArray};
use balancer_common::Verdict;
use balancer_common::l4::{
    Addr6, Backend, BackendStats, CONNTRACK_MAP_FLAGS, Config, DEFAULT_CONNTRACK_SIZE,
    DEFAULT_TABLE_SIZE, Flow, FlowKey, MAX_BACKENDS, MAX_SERVICE_BACKENDS, MAX_SERVICES, NextHop,
    Outcome, SOLE_SLOTS, SYN_WAYS, Service, ServiceKey, ServiceStats, SoleService, SynSet, Trial,
};

#[map]
pub static VERDICTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Verdict::COUNT as u32, 0);

#[map]
pub static OUTCOMES: PerCpuArray<u64> = PerCpuArray::with_max_entries(Outcome::COUNT as u32, 0);

#[map]
pub static SERVICES: HashMap<ServiceKey, Service> = HashMap::with_max_entries(MAX_SERVICES, 0);

#[map]
pub static SOLE_SERVICES: Array<SoleService> = Array::with_max_entries(SOLE_SLOTS, 0);

#[map]
pub static BACKENDS: Array<Backend> = Array::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static NEXT_HOPS: Array<NextHop> = Array::with_max_entries(MAX_BACKENDS, 0);

/// One entry per client with a connection in flight is plenty; the agent
/// sizes it with the connection table.
#[map]
pub static CLIENT_HOPS: LruHashMap<u32, NextHop> =
    LruHashMap::with_max_entries(DEFAULT_CONNTRACK_SIZE / 2, 0);

/// Two tables (current and next) of one service at production size; the
/// agent sets the real size at load.
#[map]
pub static MAGLEV: Array<u32> = Array::with_max_entries(2 * DEFAULT_TABLE_SIZE, 0);

/// Two lists per service (current and next).
#[map]
pub static SERVICE_BACKENDS: Array<u32> =
    Array::with_max_entries(MAX_SERVICES * 2 * MAX_SERVICE_BACKENDS, 0);

#[map]
pub static CONNS: LruHashMap<FlowKey, Flow> =
    LruHashMap::with_max_entries(DEFAULT_CONNTRACK_SIZE, CONNTRACK_MAP_FLAGS);

/// Sized by the agent with the connection table (a quarter of it, with a
/// floor: `LoadOptions::EMBRYONIC_MIN` in the dataplane crate).
#[map]
pub static EMBRYONIC: LruHashMap<FlowKey, Flow> =
    LruHashMap::with_max_entries(DEFAULT_CONNTRACK_SIZE / 4, CONNTRACK_MAP_FLAGS);

/// Sets of the handshake tables at the default connection table size (the
/// agent sets the real number at load, with [`SYN_SET_MASK`]): as many
/// ways as `EMBRYONIC` has entries.
const DEFAULT_SYN_SETS: u32 = DEFAULT_CONNTRACK_SIZE / 4 / SYN_WAYS as u32;

#[map]
pub static SYNS: Array<SynSet> = Array::with_max_entries(DEFAULT_SYN_SETS, 0);

/// The number of sets of `SYNS` and `SYNS6` less one (a power of two less
/// one), patched by the agent at load (`balancer_common::l4::SYN_SET_MASK`);
/// read-only data, so the verifier knows it.
#[unsafe(no_mangle)]
pub static SYN_SET_MASK: Global<u32> = Global::new(DEFAULT_SYN_SETS - 1);

// The IPv6 family's maps, sized like the IPv4 ones (the agent resizes the
// connection tables to the same flags). The agent keeps them in step with
// its workers and services.

#[map]
pub static SERVICES6: HashMap<ServiceKey<Addr6>, Service> =
    HashMap::with_max_entries(MAX_SERVICES, 0);

#[map]
pub static SOLE_SERVICES6: Array<SoleService<Addr6>> = Array::with_max_entries(SOLE_SLOTS, 0);

#[map]
pub static BACKENDS6: Array<Backend<Addr6>> = Array::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static NEXT_HOPS6: Array<NextHop<Addr6>> = Array::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static CLIENT_HOPS6: LruHashMap<Addr6, NextHop<Addr6>> =
    LruHashMap::with_max_entries(DEFAULT_CONNTRACK_SIZE / 2, 0);

#[map]
pub static CONNS6: LruHashMap<FlowKey<Addr6>, Flow<Addr6>> =
    LruHashMap::with_max_entries(DEFAULT_CONNTRACK_SIZE, CONNTRACK_MAP_FLAGS);

#[map]
pub static EMBRYONIC6: LruHashMap<FlowKey<Addr6>, Flow<Addr6>> =
    LruHashMap::with_max_entries(DEFAULT_CONNTRACK_SIZE / 4, CONNTRACK_MAP_FLAGS);

#[map]
pub static SYNS6: Array<SynSet<Addr6>> = Array::with_max_entries(DEFAULT_SYN_SETS, 0);

/// The IPv6 steering program, tail-called by the XDP program
/// (`balancer_common::l4::IPV6_PROGRAM`).
#[map]
pub static IPV6_PROGRAM: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// The ICMPv6 program (`balancer_common::l4::ICMP6_PROGRAM`), tail-called
/// by both XDP programs; an array of its own rather than a second entry of
/// `IPV6_PROGRAM`, whose pinned one-entry copy an upgraded agent adopts.
#[map]
pub static ICMP6_PROGRAM: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// What the ICMPv6 program is asked to do, written by its caller just
/// before the tail call (per-run scratch, like `FIB_SCRATCH`).
#[map]
pub static ICMP6_CALL: PerCpuArray<Call> = PerCpuArray::with_max_entries(1, 0);

#[map]
pub static PORTS: Array<u32> = Array::with_max_entries(65_536, 0);

#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

#[map]
pub static SERVICE_STATS: PerCpuArray<ServiceStats> =
    PerCpuArray::with_max_entries(MAX_SERVICES, 0);

#[map]
pub static BACKEND_STATS: PerCpuArray<BackendStats> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static TRIALS: Array<Trial> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Scratch space for `bpf_fib_lookup`'s parameter block: 64 bytes the
/// program's stack (512 bytes for a whole call chain) cannot spare.
#[map]
pub static FIB_SCRATCH: PerCpuArray<FibParams> = PerCpuArray::with_max_entries(1, 0);

/// Where IPv6 steering keeps its largest locals (see [`Scratch`]): on the
/// stack they would take bytes the call chain's 512 cannot spare.
#[map]
pub static SCRATCH6: PerCpuArray<Scratch<Addr6>> = PerCpuArray::with_max_entries(2, 0);

/// The same for IPv4 (and its ICMP subprogram): steering is inlined into
/// the parser's frame, which the ICMP subprogram's frame adds to.
#[map]
pub static SCRATCH4: PerCpuArray<Scratch<u32>> = PerCpuArray::with_max_entries(2, 0);

/// Adds one to a per-CPU `u64` counter.
#[inline(always)]
pub fn bump(counters: &PerCpuArray<u64>, index: u32) {
    if let Some(counter) = counters.get_ptr_mut(index) {
        // SAFETY: the pointer comes from a successful map lookup and the slot
        // is this CPU's own, so nothing else writes it while the program runs.
        unsafe { *counter += 1 };
    }
}

/// Adds one to the counter of an L4 outcome.
#[inline(always)]
pub fn outcome(outcome: Outcome) {
    bump(&OUTCOMES, outcome.index());
}

/// This CPU's counters of a service, if the index is in range.
#[inline(always)]
pub fn service_stats(index: u32) -> Option<&'static mut ServiceStats> {
    // SAFETY: per-CPU slot of a successful lookup: only this program run on
    // this CPU touches it, and map values live as long as the map.
    SERVICE_STATS.get_ptr_mut(index).map(|p| unsafe { &mut *p })
}

/// This CPU's counters of a backend, if the index is in range.
#[inline(always)]
pub fn backend_stats(index: u32) -> Option<&'static mut BackendStats> {
    // SAFETY: as for `service_stats`.
    BACKEND_STATS.get_ptr_mut(index).map(|p| unsafe { &mut *p })
}

/// The `PORTS` entry of `port` (host order).
#[inline(always)]
pub fn port_bits(port: u16) -> u32 {
    PORTS.get(u32::from(port)).copied().unwrap_or(0)
}

/// Whether `port` (host order) has any of `bits` set in `PORTS`.
#[inline(always)]
pub fn port_has(port: u16, bits: u32) -> bool {
    port_bits(port) & bits != 0
}

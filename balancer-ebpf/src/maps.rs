//! Every map of the object. Userspace finds them by these symbol names,
//! which `balancer_common` spells out for it; the agent resizes the large
//! ones (`MAGLEV`, `CONNS`) at load time to what its flags ask for.

use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;
use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, LruHashMap, PerCpuArray};
use balancer_common::Verdict;
use balancer_common::l4::{
    Backend, BackendStats, CLOSE_GRACE, CLOSED_SHIFT, Config, DEFAULT_CONNTRACK_SIZE,
    DEFAULT_TABLE_SIZE, FLAG_FIN_BACKEND, FLAG_FIN_CLIENT, Flow, FlowKey, MAX_BACKENDS,
    MAX_SERVICE_BACKENDS, MAX_SERVICES, NextHop, Outcome, Service, ServiceKey, ServiceStats,
};

#[map]
pub static VERDICTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Verdict::COUNT as u32, 0);

#[map]
pub static OUTCOMES: PerCpuArray<u64> = PerCpuArray::with_max_entries(Outcome::COUNT as u32, 0);

#[map]
pub static SERVICES: HashMap<ServiceKey, Service> = HashMap::with_max_entries(MAX_SERVICES, 0);

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

#[map]
pub static SERVICE_BACKENDS: Array<u32> =
    Array::with_max_entries(MAX_SERVICES * MAX_SERVICE_BACKENDS, 0);

#[map]
pub static CONNS: LruHashMap<FlowKey, Flow> =
    LruHashMap::with_max_entries(DEFAULT_CONNTRACK_SIZE, 0);

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

/// The time in [`Flow::closed`] units; never 0, which means "open".
#[inline(always)]
fn now_closed_units() -> u32 {
    // SAFETY: a helper without arguments.
    let ns = unsafe { bpf_ktime_get_coarse_ns() };
    ((ns >> CLOSED_SHIFT) as u32).max(1)
}

/// Records, in both entries of a connection, a FIN from one side (`fin` is
/// [`FLAG_FIN_CLIENT`], [`FLAG_FIN_BACKEND`] or 0) or a RST. With FINs from
/// both sides, or a RST, the connection counts as closed from now.
///
/// Only FIN and RST packets get here, so the fast path pays one flags test.
pub fn note_close(forward: FlowKey, reply: FlowKey, fin: u32, rst: bool) {
    let now = now_closed_units();
    let both = FLAG_FIN_CLIENT | FLAG_FIN_BACKEND;
    for key in [forward, reply] {
        if let Some(entry) = CONNS.get_ptr_mut(key) {
            // SAFETY: a successful lookup; racing writers (the other
            // direction's program on another CPU) only add bits or set the
            // same close time.
            let entry = unsafe { &mut *entry };
            entry.flags |= fin;
            if entry.closed == 0 && (rst || entry.flags & both == both) {
                entry.closed = now;
            }
        }
    }
}

/// Whether a reply entry belongs to a connection that has closed and must
/// no longer rewrite anything: its grace period is over, or the packet is
/// a SYN-ACK, which opens a new connection this balancer did not steer (a
/// SYN it steered would have reset the entry).
#[inline(always)]
pub fn stale(flow: &Flow, syn_ack: bool) -> bool {
    flow.closed != 0 && (syn_ack || now_closed_units().wrapping_sub(flow.closed) > CLOSE_GRACE)
}

/// Whether `port` (host order) has any of `bits` set in `PORTS`.
#[inline(always)]
pub fn port_has(port: u16, bits: u32) -> bool {
    PORTS.get(u32::from(port)).is_some_and(|b| b & bits != 0)
}

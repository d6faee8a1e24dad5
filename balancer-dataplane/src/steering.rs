//! The agent side of L4 steering: keeps the kernel's maps in step with the
//! worker registry.
//!
//! Two paths, so the urgent one never waits for the slow one:
//! - The event task follows [`Registry::subscribe`]. A breaker transition,
//!   health change, drain, addition or removal rewrites the worker's backend
//!   entry (its state bit) at once: one map write, microseconds after the
//!   transition. From then on the program skips the worker for new
//!   connections.
//! - The table thread rewrites each service's list of routable backends
//!   (the program's fallback when its table probes find none) and, when
//!   workers were added or removed, its Maglev table over the live backends
//!   (isolated and draining ones stay in it, so that a connection the
//!   kernel's tables lost still finds its backend), coalescing bursts of
//!   changes, writing next to what is in use and switching last. In remote
//!   mode it also moves the next-hop cache generation on every second, so
//!   the program looks routes and neighbours up again.
//!
//! Each worker takes one backend slot for as long as it is registered;
//! established connections keep their backend whatever its state, since
//! their entries in the connection table carry its address.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use balancer_common::Verdict;
use balancer_common::l4::{
    BackendState, BackendStats, FLAG_REMOTE, MAX_BACKENDS, PORT_REPLY_EGRESS, PORT_REPLY_INGRESS,
    PORT_SERVICE, ServiceStats,
};
use tokio::sync::broadcast::error::RecvError;

use crate::l4::{L4Maps, ServiceState};
use crate::maglev::{self, Member};
use crate::pin::PinDir;
use crate::{Dataplane, DataplaneError, LoadOptions, XdpMode, locate_object};
use balancer_core::breaker::{FailureReason, Outcome as BreakerOutcome, State as BreakerState};
use balancer_core::error_chain;
use balancer_core::health::Health;
use balancer_core::metrics::{Histogram, MetricsSource, Writer};
use balancer_core::registry::{Registry, Worker, WorkerEvent};

/// How steered packets reach the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardMode {
    /// Workers run on this host, listening on an address other than
    /// loopback (the rewritten packet still arrives on the interface): XDP
    /// rewrites the destination and passes the packet up the local stack; a
    /// TC egress program on the same interfaces gives replies the service
    /// address back.
    Local,
    /// Workers run on other hosts that route their replies back through
    /// this one: XDP rewrites the destination and redirects the frame to the
    /// next hop; replies arriving here get the service address back and are
    /// redirected to the client. Needs `net.ipv4.ip_forward=1` (and
    /// `net.ipv6.conf.all.forwarding=1` for IPv6 services).
    Remote,
}

impl ForwardMode {
    /// Both modes, as `--l4-mode` lists them.
    pub const ALL: [ForwardMode; 2] = [ForwardMode::Local, ForwardMode::Remote];

    pub fn as_str(self) -> &'static str {
        match self {
            ForwardMode::Local => "local",
            ForwardMode::Remote => "remote",
        }
    }
}

impl std::str::FromStr for ForwardMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown L4 mode {s:?} (local, remote)"))
    }
}

/// What `balancer launch --xdp-iface ...` asks of the dataplane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L4Config {
    /// Interfaces to attach to: where clients' packets arrive and, in
    /// remote mode, where the workers' replies arrive too.
    pub ifaces: Vec<String>,
    pub xdp_mode: XdpMode,
    pub mode: ForwardMode,
    /// Virtual services, IPv4 or IPv6; each is balanced over every worker
    /// of its address family.
    pub services: Vec<SocketAddr>,
    /// Slots of each Maglev table (a prime).
    pub table_size: u32,
    /// Entries of the connection table.
    pub conntrack_size: u32,
    /// Where maps and links are pinned (`None`: nothing is, and the
    /// datapath goes with the agent).
    pub bpffs_dir: Option<PathBuf>,
    /// With pins: detach and remove them when the agent stops, instead of
    /// leaving the datapath running for the next start to adopt.
    pub detach_on_exit: bool,
    /// How often the workers' handshake counters are read (and, with
    /// `--cb-l4-signals`, charged to their breakers).
    pub signal_interval: Duration,
}

/// How long a worker found in adopted maps but no longer configured stays
/// draining (its established connections keep flowing) before its slot is
/// freed.
const ORPHAN_DRAIN: Duration = Duration::from_secs(600);

/// Slot ids of adopted backends no configured worker claimed.
const ORPHAN_PREFIX: &str = "adopted:";

/// How often remote mode makes the program look next hops up again.
const NEXT_HOP_REFRESH: Duration = Duration::from_secs(1);

/// The running L4 dataplane. Dropping it (or [`Steering::stop`]) stops the
/// sync and detaches the programs.
pub struct Steering {
    shared: Arc<Shared>,
    events: tokio::task::JoinHandle<()>,
    requests: mpsc::Sender<Request>,
    table_thread: Option<JoinHandle<()>>,
}

/// What the table thread is asked to do.
enum Request {
    Rebuild,
    /// Sent by [`Steering::stop`]: an aborted event task still holds a
    /// sender until its runtime gets round to dropping it, so a closed
    /// channel cannot be the signal.
    Stop,
}

impl Steering {
    /// Loads and programs the dataplane from the registry's current fleet,
    /// attaches it, and starts following the registry. Needs a tokio
    /// runtime; interfaces are looked up in the calling thread's network
    /// namespace.
    ///
    /// Privileges and interfaces are checked before anything is created. A
    /// start that fails later removes the pinned state it created, so that
    /// `balancer l4 status` never shows the remains of a start that did not
    /// happen; state an earlier agent pinned stays for the next start.
    pub fn start(config: &L4Config, registry: Arc<Registry>) -> Result<Self, DataplaneError> {
        crate::preflight::check(&config.ifaces)?;
        let object = locate_object(None)?;
        let pins = config
            .bpffs_dir
            .as_ref()
            .map(|dir| PinDir::new(dir, config.mode.as_str(), &config.ifaces));
        let created = pins.clone().filter(|p| !p.root().exists());
        Self::start_pinned(config, registry, &object, pins).inspect_err(|error| {
            let Some(created) = created else { return };
            // The dataplane is gone by now: with its links unpinned the
            // programs detach.
            match created.remove() {
                Ok(()) => tracing::info!(
                    pins = %created.root().display(),
                    error = %error_chain(error),
                    "L4 start failed; removed the pinned state it created"
                ),
                Err(cleanup) => tracing::warn!(
                    pins = %created.root().display(),
                    error = %error_chain(&cleanup),
                    "L4 start failed, and removing the pinned state it created failed too"
                ),
            }
        })
    }

    fn start_pinned(
        config: &L4Config,
        registry: Arc<Registry>,
        object: &std::path::Path,
        pins: Option<PinDir>,
    ) -> Result<Self, DataplaneError> {
        let services = u32::try_from(config.services.len()).unwrap_or(u32::MAX);
        let mut dataplane = Dataplane::load_pinned(
            object,
            LoadOptions {
                table_size: config.table_size,
                services,
                conntrack_size: config.conntrack_size,
            },
            pins,
        )?;
        dataplane.set_detach_on_exit(config.detach_on_exit);
        let maps = dataplane.take_l4_maps()?;
        let flags = match config.mode {
            ForwardMode::Local => 0,
            ForwardMode::Remote => FLAG_REMOTE,
        };
        // What an earlier agent left in adopted maps: its backends keep
        // their slots, and services are rewritten into the table halves
        // the program is not using.
        let adopted = maps.live_backends()?;
        let mut states = Vec::new();
        for (index, addr) in config.services.iter().enumerate() {
            states.push(maps.add_service(*addr, index as u32, flags)?);
        }
        maps.retain_services(&states)?;
        // Subscribed before the first sync, so no change slips in between.
        let events = registry.subscribe();
        let shared = Arc::new(Shared {
            maps,
            mode: config.mode,
            labels: config.services.iter().map(ToString::to_string).collect(),
            services: Mutex::new(states),
            slots: Mutex::new(Slots {
                adopted: adopted
                    .iter()
                    .map(|(index, addr)| (*addr, *index))
                    .collect(),
                ..Slots::default()
            }),
            members: Mutex::new(Vec::new()),
            built: AtomicBool::new(false),
            ports: Mutex::new(HashMap::new()),
            sync_delay: Histogram::new(SYNC_BUCKETS),
            signal_interval: config.signal_interval,
            signals: Mutex::new(HashMap::new()),
            signal_delay: Histogram::new(SIGNAL_BUCKETS),
            registry: registry.clone(),
            dataplane: Mutex::new(None),
        });
        shared.maps.set_generation(1)?;
        for addr in &config.services {
            shared.mark_port(addr.port(), PORT_SERVICE)?;
        }
        shared.resync();
        shared.orphan_unclaimed();
        shared.rebuild();

        // Egress first: in local mode a steered connection's replies must
        // find the restoring program already in place.
        if config.mode == ForwardMode::Local {
            for iface in &config.ifaces {
                dataplane.attach_egress(iface)?;
            }
        }
        for iface in &config.ifaces {
            dataplane.attach(iface, config.xdp_mode)?;
        }
        dataplane.retire_other_layouts();
        *lock(&shared.dataplane) = Some(dataplane);

        let (requests, received) = mpsc::channel();
        let table_thread = {
            let shared = shared.clone();
            // In the runtime's context: a transition a kernel signal causes
            // here arms the breaker's state timer, which is a tokio task
            // (without it, an open breaker of a worker with no L7 traffic
            // would never go half-open).
            let runtime = tokio::runtime::Handle::current();
            std::thread::Builder::new()
                .name("l4-tables".into())
                .spawn(move || {
                    let _runtime = runtime.enter();
                    table_loop(&shared, &received)
                })
                .map_err(DataplaneError::TableThread)?
        };
        let events = tokio::spawn(event_loop(shared.clone(), events, requests.clone()));
        tracing::info!(
            ifaces = ?config.ifaces,
            mode = ?config.mode,
            services = ?config.services,
            "L4 steering running"
        );
        Ok(Self {
            shared,
            events,
            requests,
            table_thread: Some(table_thread),
        })
    }

    /// The dataplane's Prometheus series, for the agent's exposition.
    pub fn metrics(&self) -> Arc<dyn MetricsSource> {
        self.shared.clone()
    }

    /// The state bit the kernel holds for `worker`, if it has a backend slot.
    pub fn backend_state(&self, worker: &Worker) -> Result<Option<BackendState>, DataplaneError> {
        let slot = lock(&self.shared.slots)
            .by_worker
            .get(&worker.id)
            .map(|s| (s.index, s.addr));
        slot.map(|(index, addr)| self.shared.maps.backend_state(index, addr))
            .transpose()
    }

    /// The interfaces the XDP program is attached to, with their modes.
    pub fn interfaces(&self) -> Vec<(String, XdpMode)> {
        lock(&self.shared.dataplane)
            .as_ref()
            .map(|d| d.interfaces().map(|(i, m)| (i.to_owned(), m)).collect())
            .unwrap_or_default()
    }

    /// Stops following the registry and detaches the programs.
    pub fn stop(mut self) -> Result<(), DataplaneError> {
        self.halt()
    }

    fn halt(&mut self) -> Result<(), DataplaneError> {
        self.events.abort();
        if let Some(thread) = self.table_thread.take() {
            // Waits for at most the rebuild in progress.
            let _ = self.requests.send(Request::Stop);
            let _ = thread.join();
        }
        // Detached (unless pinned and kept) but still loaded: the metrics
        // source may outlive us and keeps reading the counters until it
        // goes too.
        match lock(&self.shared.dataplane).as_mut() {
            Some(dataplane) => dataplane.release(),
            None => Ok(()),
        }
    }
}

impl Drop for Steering {
    fn drop(&mut self) {
        if let Err(error) = self.halt() {
            tracing::warn!(error = %error_chain(&error), "detaching the L4 dataplane on drop");
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A worker's backend slot.
#[derive(Debug, Clone)]
struct Slot {
    index: u32,
    addr: SocketAddr,
    url: Arc<str>,
    state: BackendState,
    /// `Backend::share` as written.
    share: u32,
}

/// What the kernel is told of `worker`: its state bit and, for a trial or
/// degraded breaker, the share of new connections it may take.
///
/// A half-open worker takes `--cb-half-open-max-inflight` new connections
/// per second (1 without a limit), fewer when the probe interval spaces
/// them further; a degraded one `--cb-degraded-traffic-pct` percent.
fn l4_state(worker: &Worker) -> (BackendState, u32) {
    if worker.is_draining() {
        return (BackendState::Draining, 0);
    }
    if worker.health() != Health::Ready {
        return (BackendState::Isolated, 0);
    }
    let settings = worker.breaker.settings();
    match worker.breaker.state() {
        BreakerState::Closed => (BackendState::Routable, 0),
        BreakerState::Open => (BackendState::Isolated, 0),
        BreakerState::HalfOpen => {
            let mut per_second = settings.half_open_max_inflight.max(1);
            let interval = settings.half_open_probe_interval.as_millis();
            if let Some(spaced) = 1000u128.checked_div(interval) {
                per_second = per_second.min(u32::try_from(spaced).unwrap_or(u32::MAX).max(1));
            }
            (BackendState::Trial, per_second)
        }
        BreakerState::Degraded => (
            BackendState::Degraded,
            settings.degraded.map_or(100, |d| d.traffic_pct),
        ),
    }
}

/// Whether new connections may go to a backend in `state` (all of them or
/// a share): what the routable list holds.
fn admits(state: BackendState) -> bool {
    matches!(
        state,
        BackendState::Routable | BackendState::Trial | BackendState::Degraded
    )
}

#[derive(Default)]
struct Slots {
    by_worker: HashMap<String, Slot>,
    /// Slots an earlier agent used, by address, until a worker claims them
    /// or they are orphaned ([`Shared::orphan_unclaimed`]).
    adopted: HashMap<SocketAddr, u32>,
    /// When each orphan slot (id `adopted:ADDR`) started draining.
    orphans: HashMap<String, Instant>,
    /// Freed slots, reused oldest first so that a slot stays unused as long
    /// as possible after its backend left.
    free: VecDeque<u32>,
    /// Slots never used so far start here.
    next: u32,
}

impl Slots {
    /// A slot for a backend at `addr`: the one it had in adopted maps, else
    /// a fresh one (never one an adopted backend still holds).
    fn allocate(&mut self, addr: SocketAddr) -> Option<(u32, bool)> {
        if let Some(index) = self.adopted.remove(&addr) {
            return Some((index, true));
        }
        while self.next < MAX_BACKENDS {
            self.next += 1;
            let index = self.next - 1;
            if !self.adopted.values().any(|&i| i == index) {
                return Some((index, false));
            }
        }
        self.free.pop_front().map(|i| (i, false))
    }
}

struct Shared {
    maps: L4Maps,
    mode: ForwardMode,
    /// `VIP:PORT` of each service slot, for metric labels.
    labels: Vec<String>,
    services: Mutex<Vec<ServiceState>>,
    slots: Mutex<Slots>,
    /// The live backends the current Maglev tables were built over.
    members: Mutex<Vec<Member>>,
    /// Whether every service's table has been written since the last
    /// failure (or since the start).
    built: AtomicBool,
    /// `PORTS` mark bits as written (`set_port_bits` writes only those;
    /// the sole-service fields beside them are `L4Maps`' own).
    ports: Mutex<HashMap<u16, u32>>,
    /// Delay from a breaker transition to the map write that made the
    /// kernel follow it, in the registry clock's time.
    sync_delay: Histogram,
    /// How often the handshake counters are read.
    signal_interval: Duration,
    /// Handshake counters (established, refused, timeouts) as last read,
    /// by worker id.
    signals: Mutex<HashMap<String, [u64; 3]>>,
    /// Delay from the latest handshake the kernel counted for a worker to
    /// the transition its charge caused (`dataplane_signal_seconds`).
    signal_delay: Histogram,
    registry: Arc<Registry>,
    /// Set once the programs are attached; kept here so the metrics source
    /// can read the verdict counters.
    dataplane: Mutex<Option<Dataplane>>,
}

impl Shared {
    fn reply_bit(&self) -> u32 {
        match self.mode {
            ForwardMode::Local => PORT_REPLY_EGRESS,
            ForwardMode::Remote => PORT_REPLY_INGRESS,
        }
    }

    /// Adds `bit` to the `PORTS` entry of `port`. Bits are never taken away
    /// while the agent runs: connections to a backend that has left may
    /// still be open, and their replies still need restoring.
    fn mark_port(&self, port: u16, bit: u32) -> Result<(), DataplaneError> {
        let mut ports = lock(&self.ports);
        let bits = match ports.entry(port) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            // Adopted maps may hold bits an earlier agent set.
            std::collections::hash_map::Entry::Vacant(entry) => {
                entry.insert(self.maps.port_bits(port)?)
            }
        };
        if *bits & bit == 0 {
            self.maps.set_port_bits(port, *bits | bit)?;
            *bits |= bit;
        }
        Ok(())
    }

    /// Brings `worker`'s backend entry up to date. Returns whether its
    /// routability changed (the routable lists need rewriting) and whether
    /// anything was written.
    fn upsert(&self, worker: &Worker) -> Result<Change, DataplaneError> {
        let Some(addr) = worker.address.resolve() else {
            tracing::warn!(
                worker = %worker.url,
                "not steering L4 connections to a worker whose address does not resolve"
            );
            return Ok(Change::default());
        };
        let (state, share) = l4_state(worker);
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots.by_worker.get_mut(&worker.id) {
            if (slot.state, slot.share) == (state, share) {
                return Ok(Change::default());
            }
            self.maps
                .set_backend_share(slot.index, slot.addr, state, share)?;
            let was = slot.state;
            slot.state = state;
            slot.share = share;
            tracing::debug!(worker = %worker.url, from = was.name(), to = state.name(), share, "L4 backend state");
            // The table lists every live backend and stays; the routable
            // list follows the state bit.
            return Ok(Change {
                written: true,
                rebuild: admits(was) != admits(state),
            });
        }
        let Some((index, adopted)) = slots.allocate(addr) else {
            tracing::warn!(worker = %worker.url, "no free L4 backend slot (max {MAX_BACKENDS})");
            return Ok(Change::default());
        };
        // The reply bit before the backend exists: its first connection's
        // replies must already be recognised.
        self.mark_port(addr.port(), self.reply_bit())?;
        if !adopted {
            self.maps.reset_backend_stats(index)?;
        }
        self.maps.set_backend_share(index, addr, state, share)?;
        slots.by_worker.insert(
            worker.id.clone(),
            Slot {
                index,
                addr,
                url: worker.url.clone(),
                state,
                share,
            },
        );
        tracing::info!(worker = %worker.url, slot = index, state = state.name(), "L4 backend added");
        Ok(Change {
            written: true,
            rebuild: true,
        })
    }

    /// Frees `worker`'s slot: no new connection goes there from now on.
    fn release(&self, worker: &Worker) -> Result<bool, DataplaneError> {
        let mut slots = lock(&self.slots);
        let Some(slot) = slots.by_worker.remove(&worker.id) else {
            return Ok(false);
        };
        self.maps
            .set_backend_state(slot.index, slot.addr, BackendState::Unused)?;
        slots.free.push_back(slot.index);
        tracing::info!(worker = %worker.url, slot = slot.index, "L4 backend removed");
        Ok(true)
    }

    /// Makes every slot match the registry: at start, and after the event
    /// task fell behind and lost events.
    fn resync(&self) {
        let fleet = self.registry.fleet();
        for worker in &fleet.workers {
            if let Err(error) = self.upsert(worker) {
                tracing::warn!(worker = %worker.url, error = %error_chain(&error), "L4 sync");
            }
        }
        let gone: Vec<String> = lock(&self.slots)
            .by_worker
            .keys()
            .filter(|id| !id.starts_with(ORPHAN_PREFIX))
            .filter(|id| fleet.workers.iter().all(|w| &w.id != *id))
            .cloned()
            .collect();
        let mut slots = lock(&self.slots);
        for id in gone {
            if let Some(slot) = slots.by_worker.remove(&id) {
                if let Err(error) =
                    self.maps
                        .set_backend_state(slot.index, slot.addr, BackendState::Unused)
                {
                    tracing::warn!(worker = %slot.url, error = %error_chain(&error), "L4 sync");
                }
                slots.free.push_back(slot.index);
            }
        }
    }

    /// Reads each worker's handshake counters and, for workers with
    /// `--cb-l4-signals`, charges what changed since the last read to their
    /// breakers: an established handshake is a success, a refused or
    /// timed-out one a failure (`l4_refused`, `l4_timeout`). Within one
    /// read, successes go first, so a read with any failure ends on one.
    /// The first read of a worker only takes the counters as they are.
    fn read_signals(&self) {
        let clock = self.registry.clock();
        let slots: Vec<(String, u32)> = lock(&self.slots)
            .by_worker
            .iter()
            .filter(|(id, _)| !id.starts_with(ORPHAN_PREFIX))
            .map(|(id, slot)| (id.clone(), slot.index))
            .collect();
        let fleet = self.registry.fleet();
        let mut seen = lock(&self.signals);
        seen.retain(|id, _| slots.iter().any(|(s, _)| s == id));
        for (id, index) in slots {
            let Ok(stats) = self.maps.backend_stats(index) else {
                continue;
            };
            let counts = [stats.established, stats.refused, stats.timeouts];
            let Some(previous) = seen.insert(id.clone(), counts) else {
                continue;
            };
            let Some(worker) = fleet.workers.iter().find(|w| w.id == id) else {
                continue;
            };
            if !worker.classifier().l4_signals() {
                continue;
            }
            let delta = |i: usize| {
                counts[i]
                    .saturating_sub(previous[i])
                    .min(MAX_SIGNALS_PER_READ)
            };
            let before = worker.breaker.state();
            let charges = [
                (delta(0), BreakerOutcome::Success),
                (delta(1), BreakerOutcome::Failure(FailureReason::L4Refused)),
                (delta(2), BreakerOutcome::Failure(FailureReason::L4Timeout)),
            ];
            for (count, outcome) in charges {
                for _ in 0..count {
                    worker.breaker.observe(outcome, clock.as_ref());
                }
            }
            if worker.breaker.state() != before
                && let Some(now) = monotonic_ns()
            {
                // From the latest handshake the kernel counted for the
                // worker (its clock is CLOCK_MONOTONIC too).
                self.signal_delay
                    .observe_nanos(now.saturating_sub(stats.last_signal_ns));
            }
        }
    }

    /// Backends of adopted maps that no configured worker claimed (they
    /// left while no agent ran) drain: no new connections, established ones
    /// keep flowing, and their slots are freed after [`ORPHAN_DRAIN`].
    fn orphan_unclaimed(&self) {
        let mut slots = lock(&self.slots);
        let unclaimed: Vec<(SocketAddr, u32)> = slots.adopted.drain().collect();
        for (addr, index) in unclaimed {
            if let Err(error) = self
                .maps
                .set_backend_state(index, addr, BackendState::Draining)
            {
                tracing::warn!(%addr, error = %error_chain(&error), "draining an adopted backend");
                continue;
            }
            let id = format!("{ORPHAN_PREFIX}{addr}");
            tracing::warn!(%addr, slot = index, "backend of the adopted datapath is no longer configured: draining it");
            slots.orphans.insert(id.clone(), Instant::now());
            slots.by_worker.insert(
                id,
                Slot {
                    index,
                    addr,
                    url: Arc::from(format!("adopted {addr}")),
                    state: BackendState::Draining,
                    share: 0,
                },
            );
        }
    }

    /// Frees the slots of orphans that drained for [`ORPHAN_DRAIN`];
    /// whether any was.
    fn release_drained_orphans(&self) -> bool {
        let mut slots = lock(&self.slots);
        let expired: Vec<String> = slots
            .orphans
            .iter()
            .filter(|(_, since)| since.elapsed() >= ORPHAN_DRAIN)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            slots.orphans.remove(id);
            if let Some(slot) = slots.by_worker.remove(id) {
                if let Err(error) =
                    self.maps
                        .set_backend_state(slot.index, slot.addr, BackendState::Unused)
                {
                    tracing::warn!(worker = %slot.url, error = %error_chain(&error), "L4 sync");
                }
                slots.free.push_back(slot.index);
                tracing::info!(worker = %slot.url, "drained adopted backend removed");
            }
        }
        !expired.is_empty()
    }

    /// Writes every service's list of routable backends and, when the set
    /// of live backends (routable, isolated or draining) changed, a Maglev
    /// table over them. A slot's state bit decides whether a new connection
    /// may take it, and a mid-flow packet the connection tables lost still
    /// finds an isolated or draining backend in the table: a breaker
    /// transition changes a state bit and the list, never the table. A
    /// service's list and table hold the backends of its address family
    /// only.
    fn rebuild(&self) {
        let started = Instant::now();
        // Each slot with whether it is IPv6.
        let (routable, mut members): (Vec<(u32, bool)>, Vec<Tagged>) = {
            let slots = lock(&self.slots);
            let mut routable: Vec<(u32, bool)> = slots
                .by_worker
                .values()
                .filter(|s| admits(s.state))
                .map(|s| (s.index, s.addr.is_ipv6()))
                .collect();
            routable.sort_unstable();
            let members = slots
                .by_worker
                .values()
                .map(|s| {
                    let member = Member {
                        index: s.index,
                        key: maglev::member_key(s.addr),
                    };
                    (member, s.addr.is_ipv6())
                })
                .collect();
            (routable, members)
        };
        members.sort_unstable_by_key(|(m, _)| m.index);
        let mut built = lock(&self.members);
        let all: Vec<Member> = members.iter().map(|(m, _)| *m).collect();
        let rebuild = *built != all || !self.built.swap(true, Ordering::Relaxed);
        // One table and one list per family, each over that family's
        // backends.
        let of_family = |v6: bool| {
            let routable: Vec<u32> = routable
                .iter()
                .filter(|(_, f)| *f == v6)
                .map(|(i, _)| *i)
                .collect();
            let table = rebuild.then(|| {
                let members: Vec<Member> = members
                    .iter()
                    .filter(|(_, f)| *f == v6)
                    .map(|(m, _)| *m)
                    .collect();
                maglev::build(&members, self.maps.table_size())
            });
            (routable, table)
        };
        let families = [of_family(false), of_family(true)];
        let mut services = lock(&self.services);
        for service in services.iter_mut() {
            let (routable, table) = &families[usize::from(service.addr().is_ipv6())];
            if let Err(error) = self
                .maps
                .update_service(service, routable, table.as_deref())
            {
                // Build the table again next time: this service may lack it.
                self.built.store(false, Ordering::Relaxed);
                tracing::warn!(service = %service.addr(), error = %error_chain(&error), "writing the Maglev table");
            }
        }
        if rebuild {
            *built = all;
        }
        tracing::debug!(
            live = built.len(),
            routable = routable.len(),
            table_rebuilt = rebuild,
            took = ?started.elapsed(),
            "L4 backend lists written"
        );
    }
}

/// A table member and whether it is IPv6.
type Tagged = (Member, bool);

#[derive(Debug, Default, Clone, Copy)]
struct Change {
    written: bool,
    rebuild: bool,
}

async fn event_loop(
    shared: Arc<Shared>,
    mut events: tokio::sync::broadcast::Receiver<WorkerEvent>,
    rebuilds: mpsc::Sender<Request>,
) {
    loop {
        let event = match events.recv().await {
            Ok(event) => event,
            Err(RecvError::Lagged(missed)) => {
                tracing::warn!(missed, "L4 sync fell behind the registry; resynchronising");
                shared.resync();
                let _ = rebuilds.send(Request::Rebuild);
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        let (worker, transition_at) = match &event {
            WorkerEvent::Added(w) | WorkerEvent::Draining(w) | WorkerEvent::Health(w, _) => {
                (w, None)
            }
            WorkerEvent::Breaker(w, t) => (w, Some(t.at)),
            WorkerEvent::Removed(w) => {
                match shared.release(w) {
                    Ok(true) => {
                        let _ = rebuilds.send(Request::Rebuild);
                    }
                    Ok(false) => {}
                    Err(error) => {
                        tracing::warn!(worker = %w.url, error = %error_chain(&error), "L4 sync");
                    }
                }
                continue;
            }
        };
        if !worker.address.is_resolved() {
            // A host name: DNS blocks, so it is looked up off the runtime.
            let w = worker.clone();
            let _ = tokio::task::spawn_blocking(move || w.address.resolve()).await;
        }
        match shared.upsert(worker) {
            Ok(change) => {
                if let (true, Some(at)) = (change.written, transition_at) {
                    let now = shared.registry.clock().now();
                    shared.sync_delay.observe_nanos(now.saturating_sub(at));
                }
                if change.rebuild {
                    let _ = rebuilds.send(Request::Rebuild);
                }
            }
            Err(error) => {
                tracing::warn!(worker = %worker.url, error = %error_chain(&error), "L4 sync");
            }
        }
    }
}

/// Rebuilds tables on request (coalescing the requests that queued up
/// meanwhile) and, in remote mode, moves the next-hop generation on.
fn table_loop(shared: &Shared, requests: &mpsc::Receiver<Request>) {
    let mut generation = 1u32;
    let mut refresh_at = Instant::now() + NEXT_HOP_REFRESH;
    let mut signals_at = Instant::now() + shared.signal_interval;
    loop {
        let wait = refresh_at
            .min(signals_at)
            .saturating_duration_since(Instant::now());
        match requests.recv_timeout(wait) {
            Ok(Request::Rebuild) => {
                let mut stop = false;
                while let Ok(request) = requests.try_recv() {
                    stop |= matches!(request, Request::Stop);
                }
                if stop {
                    return;
                }
                shared.rebuild();
            }
            Ok(Request::Stop) => return,
            Err(RecvTimeoutError::Timeout) => {
                let now = Instant::now();
                if now >= signals_at {
                    signals_at = now + shared.signal_interval;
                    shared.read_signals();
                }
                if now < refresh_at {
                    continue;
                }
                refresh_at = now + NEXT_HOP_REFRESH;
                if shared.release_drained_orphans() {
                    shared.rebuild();
                }
                if shared.mode == ForwardMode::Remote {
                    // 0 would turn the cache off.
                    generation = generation.checked_add(1).unwrap_or(1);
                    if let Err(error) = shared.maps.set_generation(generation) {
                        tracing::warn!(error = %error_chain(&error), "refreshing next hops");
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds, the clock `bpf_ktime_get_ns` reads.
fn monotonic_ns() -> Option<u64> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (rc == 0).then(|| now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64)
}

/// Handshake outcomes charged to one breaker per signal read at most: a
/// bound on the work of one read, far above what a worker's backlog makes
/// in an interval.
const MAX_SIGNALS_PER_READ: u64 = 10_000;

/// Seconds; the delay from the kernel counting a handshake to the breaker
/// transition it caused: at most a read interval plus the read.
const SIGNAL_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// Seconds; the interesting range of the breaker-to-map delay is
/// microseconds to a millisecond.
const SYNC_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.1,
    1.0,
];

impl MetricsSource for Shared {
    fn render(&self, w: &mut Writer<'_>) {
        if let Some(dataplane) = lock(&self.dataplane).as_ref()
            && let Ok(verdicts) = dataplane.verdict_counts()
        {
            w.family(
                "l4_verdict_packets_total",
                "counter",
                "Packets the XDP program saw, by how they parsed.",
            );
            for verdict in Verdict::ALL {
                w.sample(
                    "l4_verdict_packets_total",
                    &[("verdict", verdict.name())],
                    verdicts.get(verdict) as f64,
                );
            }
        }
        if let Ok(outcomes) = self.maps.outcomes() {
            w.family(
                "l4_outcome_packets_total",
                "counter",
                "TCP packets by what steering did: steered (new_flow, established, reply) or passed to the kernel and why.",
            );
            for (outcome, n) in outcomes.iter() {
                w.sample(
                    "l4_outcome_packets_total",
                    &[("outcome", outcome.name())],
                    n as f64,
                );
            }
        }
        self.render_services(w);
        self.render_backends(w);
        w.family(
            "dataplane_sync_seconds",
            "histogram",
            "Delay from a breaker transition to the XDP map write that makes new connections follow it.",
        );
        self.sync_delay.render(w, "dataplane_sync_seconds", &[]);
        self.signal_delay.render(w, "dataplane_signal_seconds", &[]);
    }
}

/// A counter family read from per-slot stats: name, help, field.
type Family<S> = (&'static str, &'static str, fn(&S) -> u64);

impl Shared {
    fn render_services(&self, w: &mut Writer<'_>) {
        let stats: Vec<_> = (0..self.labels.len() as u32)
            .filter_map(|i| Some((&self.labels[i as usize], self.maps.service_stats(i).ok()?)))
            .collect();
        let families: [Family<ServiceStats>; 3] = [
            (
                "l4_service_packets_total",
                "Client packets steered to a backend.",
                |s| s.packets,
            ),
            (
                "l4_service_bytes_total",
                "Bytes of those packets, Ethernet header included.",
                |s| s.bytes,
            ),
            (
                "l4_service_connections_total",
                "Connections given a backend.",
                |s| s.connections,
            ),
        ];
        for (name, help, value) in families {
            w.family(name, "counter", help);
            for (label, s) in &stats {
                w.sample(name, &[("service", label)], value(s) as f64);
            }
        }
        w.family(
            "l4_service_drops_total",
            "counter",
            "Service packets not steered, by reason; they went to the local stack.",
        );
        for (label, s) in &stats {
            w.sample(
                "l4_service_drops_total",
                &[("service", label), ("reason", "no_backend")],
                s.no_backend as f64,
            );
        }
    }

    fn render_backends(&self, w: &mut Writer<'_>) {
        let mut slots: Vec<Slot> = lock(&self.slots).by_worker.values().cloned().collect();
        slots.sort_by_key(|s| s.index);
        let stats: Vec<_> = slots
            .iter()
            .filter_map(|s| Some((s, self.maps.backend_stats(s.index).ok()?)))
            .collect();
        w.family(
            "l4_worker_state",
            "gauge",
            "The worker's state bit in the kernel: 1 routable, 2 isolated (breaker open or not ready), 3 draining, 4 trial (half-open: a few new connections per second), 5 degraded (a share of new connections).",
        );
        for slot in &slots {
            w.sample(
                "l4_worker_state",
                &[("worker", &slot.url)],
                f64::from(slot.state as u32),
            );
        }
        let families: [Family<BackendStats>; 5] = [
            (
                "l4_worker_packets_total",
                "Client packets steered to the worker.",
                |s| s.packets,
            ),
            (
                "l4_worker_bytes_total",
                "Bytes of those packets, Ethernet header included.",
                |s| s.bytes,
            ),
            (
                "l4_worker_connections_total",
                "New connections steered to the worker.",
                |s| s.connections,
            ),
            (
                "l4_worker_reply_packets_total",
                "Replies of the worker given the service address back.",
                |s| s.reply_packets,
            ),
            (
                "l4_worker_reply_bytes_total",
                "Bytes of those replies.",
                |s| s.reply_bytes,
            ),
        ];
        for (name, help, value) in families {
            w.family(name, "counter", help);
            for (slot, s) in &stats {
                w.sample(name, &[("worker", &slot.url)], value(s) as f64);
            }
        }
        w.family(
            "l4_worker_handshakes_total",
            "counter",
            "Handshakes the datapath saw, by outcome: forwarded (SYNs sent to the worker), established (its SYN-ACK), refused (a reset answering the SYN), timeout (the SYN sent again before any SYN-ACK), reset (a reset from the worker on an established connection).",
        );
        for (slot, s) in &stats {
            for (outcome, value) in [
                ("forwarded", s.connections),
                ("established", s.established),
                ("refused", s.refused),
                ("timeout", s.timeouts),
                ("reset", s.resets),
            ] {
                w.sample(
                    "l4_worker_handshakes_total",
                    &[("worker", &slot.url), ("outcome", outcome)],
                    value as f64,
                );
            }
        }
        w.family(
            "l4_worker_drops_total",
            "counter",
            "Packets for the worker not forwarded by XDP, by reason; they went to the kernel to route.",
        );
        for (slot, s) in &stats {
            w.sample(
                "l4_worker_drops_total",
                &[("worker", &slot.url), ("reason", "unresolved")],
                s.unresolved as f64,
            );
        }
    }
}

//! The worker registry: which workers exist, and each one's live state.
//!
//! Owns the per-worker breaker, health tracker, draining flag and in-flight
//! count, and an immutable [`Fleet`] snapshot that the request path reads
//! without a lock (`arc_swap`). Mutations (add, remove, override) build a new
//! snapshot under a registry mutex that the request path never takes. It
//! publishes every change as a [`WorkerEvent`] and runs the one timer a
//! breaker needs (the end of an open or degraded period), so that an idle
//! worker recovers on time. It does no network I/O: probing and proxying
//! belong to the agent, kernel maps to the dataplane. Its metric series live
//! in its `metrics` submodule, next to the state they read.

mod metrics;
mod recent;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
// Model names are looked up on every request; the keys are the models
// workers declare, not a client's.
use foldhash::HashMap;
use tokio::sync::broadcast;

use crate::breaker::{
    Breaker, Classifier, OpenGate, Outcome, RequestCharges, State, Ticket, Transition,
    TransitionObserver,
};
use crate::clock::{Clock, Nanos, nanos};
use crate::health::{Health, HealthChange, HealthThresholds, HealthTracker};
use crate::load::{LoadCell, ReportedLoad};
use crate::metrics::Histogram;
use crate::ring::{Ring, ring_points};
use crate::spec::{BreakerDefaults, Resilience, SpecError, WorkerAddress, WorkerSpec};

/// Something the dataplane and other subscribers react to.
#[derive(Debug, Clone)]
pub enum WorkerEvent {
    /// Joined the fleet.
    Added(Arc<Worker>),
    /// Stopped taking new traffic; in-flight requests continue.
    Draining(Arc<Worker>),
    /// Left the fleet; its `worker_cb_state` gauge now reads -1.
    Removed(Arc<Worker>),
    /// Its breaker changed state.
    Breaker(Arc<Worker>, Transition),
    /// It was demoted or promoted.
    Health(Arc<Worker>, HealthChange),
}

/// One worker and its live state.
pub struct Worker {
    /// Registry-assigned id (`w1`, `w2`, ...), never reused while the registry lives.
    pub id: String,
    /// Normalised base URL ([`WorkerAddress::base`]): unique in the fleet, and the `worker` label
    /// of its series.
    pub url: Arc<str>,
    /// Where to connect: the authority the proxy uses and the socket address the dataplane steers
    /// to.
    pub address: WorkerAddress,
    /// The spec's labels, as the admin API shows them.
    pub labels: BTreeMap<String, String>,
    /// This worker's circuit breaker.
    pub breaker: Breaker,
    /// This worker's points on a consistent-hash ring, computed once.
    pub ring_points: Box<[u64]>,
    models: ArcSwap<Vec<String>>,
    classifier: ArcSwap<Classifier>,
    resilience: Mutex<Resilience>,
    ready: AtomicBool,
    health: Mutex<HealthTracker>,
    draining: AtomicBool,
    /// Out of the fleet: its transitions (from attempts still in flight)
    /// reach no subscriber and arm no timer.
    removed: AtomicBool,
    inflight: AtomicU32,
    selected: AtomicU64,
    /// Its 5xx answers, by status (500..=599): which error a failing
    /// worker gives (`worker_server_errors_total`).
    server_errors: Box<[AtomicU64; 100]>,
    /// Time to first byte of the attempts that went through.
    pub ttfb: Histogram,
    recent: recent::Recent,
    /// The load it reports on its own `/metrics`, when a monitor scrapes it.
    load: LoadCell,
    /// Background tasks (the prober) that must stop with the worker.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// The timer that ends the current open or degraded period; replaced
    /// (the old one aborted) whenever the deadline may have moved.
    timer: Mutex<Option<tokio::task::AbortHandle>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("id", &self.id)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Selectable for a new request: Ready, not draining, and its breaker
    /// allows it. This is the document's "both gates" table.
    #[inline]
    pub fn is_eligible(&self, clock: &dyn Clock) -> bool {
        self.ready.load(Ordering::Acquire)
            && !self.draining.load(Ordering::Acquire)
            && self.breaker.is_available(clock)
    }

    /// Whether the XDP dataplane may steer new connections here.
    pub fn is_routable(&self) -> bool {
        self.ready.load(Ordering::Acquire)
            && !self.draining.load(Ordering::Acquire)
            && self.breaker.state() != State::Open
    }

    /// Whether `model` is among the models it serves.
    #[inline]
    pub fn serves(&self, model: &str) -> bool {
        self.models.load().iter().any(|m| m == model)
    }

    /// The models it serves: the spec's, or those learned with [`Registry::learn_models`]; empty
    /// while unknown.
    pub fn models(&self) -> Arc<Vec<String>> {
        self.models.load_full()
    }

    /// Its status classifier, per-worker overrides applied.
    #[inline]
    pub fn classifier(&self) -> Classifier {
        **self.classifier.load()
    }

    /// Its `resilience` overrides, with every patch merged in.
    pub fn resilience(&self) -> Resilience {
        self.resilience.lock().unwrap().clone()
    }

    /// Its health status, from probes or [`Registry::force_ready`].
    pub fn health(&self) -> Health {
        self.health.lock().unwrap().status()
    }

    /// Whether it drains: it takes no new requests while in-flight ones finish.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Attempts in flight to it now: the live [`Attempt`]s.
    #[inline]
    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// The load every load-aware policy compares, the one place it is read:
    /// the requests it has (reported by the worker while the report is fresh,
    /// else its attempts in flight), plus 64 (`recent::FAILURE_LOAD`) times the
    /// share of its recent attempts that failed, so that a worker failing
    /// fast (and so with few requests in flight) does not look idle.
    #[inline]
    pub fn load(&self, now: Nanos) -> u32 {
        let failing = self.recent.failure_rate(now);
        let penalty = if failing == 0.0 {
            0
        } else {
            (failing * recent::FAILURE_LOAD).round() as u32
        };
        // The requests it reports (waiting plus running) where the report is
        // fresh, never below the gateway's in-flight count (between two
        // scrapes the requests just sent to it count); else that count.
        let inflight = self.inflight();
        let requests = self
            .reported_load(now)
            .map_or(inflight, |r| r.requests().max(inflight));
        requests.saturating_add(penalty)
    }

    /// Its recent average time to first byte (first token for streams), as
    /// the gateway measured it; `None` without a sample in the last 30 s.
    #[inline]
    pub fn recent_ttfb(&self, now: Nanos) -> Option<Duration> {
        self.recent.ttfb(now)
    }

    /// Records the time to first byte of an attempt that went through: the
    /// `worker_ttfb` histogram and the recent average.
    pub fn observe_ttfb(&self, ttfb: Duration, now: Nanos) {
        self.ttfb.observe(ttfb);
        self.recent.record_ttfb(ttfb, now);
    }

    /// The queue and cache occupancy it reported, while the report is fresh
    /// (see [`crate::load`]); `None` when nothing scrapes it or the last good
    /// scrape is more than three intervals old.
    #[inline]
    pub fn reported_load(&self, now: Nanos) -> Option<ReportedLoad> {
        self.load.current(now)
    }

    /// Whether it reports more waiting requests than
    /// `--worker-overload-waiting-requests` (in a fresh report): selection
    /// then gives it a request only when no other candidate can take one.
    #[inline]
    pub fn is_overloaded(&self, clock: &dyn Clock) -> bool {
        self.load.is_overloaded(|| clock.now())
    }

    /// Its load report's state: the monitor writes it, the series read it.
    pub fn load_cell(&self) -> &LoadCell {
        &self.load
    }

    /// Requests started on it since it was added (`worker_selected_total`).
    pub fn selected_total(&self) -> u64 {
        self.selected.load(Ordering::Relaxed)
    }

    /// Counts a 5xx answer of this worker; other statuses are not counted
    /// here (the breaker's outcomes count them).
    #[inline]
    pub fn server_error(&self, status: u16) {
        if let Some(count) = status
            .checked_sub(500)
            .and_then(|i| self.server_errors.get(usize::from(i)))
        {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The 5xx answers counted so far, by status.
    pub fn server_errors(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        (500u16..).zip(self.server_errors.iter().map(|c| c.load(Ordering::Relaxed)))
    }

    /// Admits one attempt through the breaker, or says no (open, a full
    /// half-open trial, a degraded worker's share spent). An admitted
    /// attempt counts in flight until it is dropped.
    #[inline]
    pub fn try_attempt(self: &Arc<Self>, clock: &dyn Clock) -> Option<Attempt> {
        let ticket = self.breaker.admit(clock)?;
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.selected.fetch_add(1, Ordering::Relaxed);
        Some(Attempt {
            worker: self.clone(),
            ticket: Some(ticket),
        })
    }

    /// Ties a background task (the prober) to the worker so that [`Registry::remove`]
    /// aborts it; prunes finished tasks.
    pub fn add_task(&self, task: tokio::task::AbortHandle) {
        let mut tasks = self.tasks.lock().unwrap();
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }
}

/// One attempt of a request on a worker: it holds the breaker's admission
/// until an outcome is recorded, and counts in the worker's in-flight gauge
/// until it is dropped (after the response's last byte).
///
/// However the attempt ends without an outcome (the client disconnects or
/// resets the stream, the future is dropped at an `.await`, a timeout, a
/// panic), dropping it gives a half-open probe slot back and records
/// nothing: a client's departure is never charged to a worker and never
/// leaks the trial's slots.
#[derive(Debug)]
pub struct Attempt {
    worker: Arc<Worker>,
    ticket: Option<Ticket>,
}

impl Attempt {
    /// The worker this attempt went to.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// Whether no outcome was recorded yet.
    pub fn is_pending(&self) -> bool {
        self.ticket.is_some()
    }

    /// Records the attempt's outcome on the worker's breaker through the
    /// request's `charges` (one failure per worker and state epoch per
    /// request). Only the first call records; later ones do nothing.
    pub fn record(&mut self, charges: &mut RequestCharges, outcome: Outcome, clock: &dyn Clock) {
        if let Some(ticket) = self.ticket.take() {
            if outcome != Outcome::Ignored {
                let failed = matches!(outcome, Outcome::Failure(_));
                self.worker.recent.record_outcome(failed, clock.now());
            }
            charges.record(&self.worker.breaker, ticket, outcome, clock);
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.worker.breaker.cancel(ticket);
        }
        self.worker.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An immutable view of the fleet, swapped whole on every change.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Every worker, draining ones included, in the order they were added.
    pub workers: Vec<Arc<Worker>>,
    by_model: HashMap<String, Vec<Arc<Worker>>>,
    /// Every worker names its models (none has yet to be learned, or
    /// declares none): only then can a model no worker names be refused.
    all_declare: bool,
    with_rings: bool,
    /// Built by the first request that needs them, so a burst of fleet
    /// changes (start-up, models being learned) sorts no ring it discards.
    rings: std::sync::OnceLock<Rings>,
}

#[derive(Debug, Default)]
struct Rings {
    by_model: HashMap<String, Ring>,
    all: Ring,
}

impl Fleet {
    /// The workers a request for `model` may go to, with the hash ring over
    /// them when consistent hashing is on. A model no worker declares goes to
    /// the whole fleet: a worker whose models are not known yet (or a client
    /// that names a model alias) should not turn into a 404.
    pub fn candidates(&self, model: Option<&str>) -> (&[Arc<Worker>], Option<&Ring>) {
        let rings = self.with_rings.then(|| {
            self.rings.get_or_init(|| Rings {
                by_model: self
                    .by_model
                    .iter()
                    .map(|(m, ws)| (m.clone(), Ring::build(ws.iter().map(|w| &*w.ring_points))))
                    .collect(),
                all: Ring::build(self.workers.iter().map(|w| &*w.ring_points)),
            })
        });
        match model.and_then(|m| self.by_model.get_key_value(m)) {
            Some((m, workers)) => (workers, rings.and_then(|r| r.by_model.get(m))),
            None => (&self.workers, rings.map(|r| &r.all)),
        }
    }

    /// The worker whose id or normalised URL is `id_or_url`.
    pub fn get(&self, id_or_url: &str) -> Option<&Arc<Worker>> {
        self.workers
            .iter()
            .find(|w| w.id == id_or_url || *w.url == *id_or_url)
    }

    /// Whether some worker declares `model` (in its spec or its `/v1/models`).
    pub fn declares(&self, model: &str) -> bool {
        self.by_model.contains_key(model)
    }

    /// Whether no worker could serve `model`: every worker names its models
    /// and none names this one. A worker whose models are not known (not
    /// learned yet, or it lists none) may serve any, as before models were
    /// declared.
    pub fn none_serves(&self, model: &str) -> bool {
        self.all_declare && !self.declares(model)
    }

    fn build(workers: Vec<Arc<Worker>>, with_rings: bool) -> Self {
        let mut by_model: HashMap<String, Vec<Arc<Worker>>> = HashMap::default();
        for w in &workers {
            for m in w.models().iter() {
                by_model.entry(m.clone()).or_default().push(w.clone());
            }
        }
        let all_declare = !workers.is_empty() && workers.iter().all(|w| !w.models().is_empty());
        Self {
            workers,
            by_model,
            all_declare,
            with_rings,
            rings: std::sync::OnceLock::new(),
        }
    }
}

/// Registry-wide settings fixed at start.
#[derive(Debug, Clone, Copy)]
pub struct RegistryConfig {
    /// Breaker settings from the flags; each worker's overrides win over them.
    pub breaker: BreakerDefaults,
    /// Probe thresholds of every worker's health tracker.
    pub health: HealthThresholds,
    /// Keep consistent-hash rings over the fleet (`consistent_hash` policy).
    pub hash_rings: bool,
    /// `--cb-max-open-percent`: at most this share of a model's workers is
    /// isolated by breakers at once (100: no limit, the document).
    pub max_open_percent: u32,
    /// `--removed-worker-grace-secs`: how long a removed worker's
    /// `worker_cb_state` reads -1 before its series goes.
    pub removed_grace: Duration,
}

/// `--removed-worker-grace-secs` by default: long enough for a scrape
/// interval or two and an alert's `for:` to see the -1.
pub const DEFAULT_REMOVED_GRACE: Duration = Duration::from_secs(600);

/// Removed workers remembered (for their -1) at most; past it the oldest is
/// forgotten early, so pod churn cannot grow the registry without bound.
pub const MAX_REMOVED: usize = 1024;

/// Why a registry call could not be applied. Nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The spec or patch failed validation.
    #[error(transparent)]
    Invalid(#[from] SpecError),
    /// The normalised URL is already in the fleet, or twice in one batch.
    #[error("a worker with url {0} already exists")]
    Duplicate(String),
    /// No worker has this id or URL.
    #[error("no worker {0}")]
    NotFound(String),
}

/// The live fleet: lock-free reads of the current [`Fleet`], serialised mutations, and a
/// [`WorkerEvent`] stream.
pub struct Registry {
    fleet: ArcSwap<Fleet>,
    /// Serialises mutations; never taken on the request path.
    write: Mutex<()>,
    config: RegistryConfig,
    clock: Arc<dyn Clock>,
    next_id: AtomicU64,
    /// Removed workers' URLs and when they were removed, oldest first.
    removed: Mutex<VecDeque<(Arc<str>, Nanos)>>,
    events: broadcast::Sender<WorkerEvent>,
}

impl Registry {
    /// An empty registry; `clock` drives its breakers and their timers.
    pub fn new(config: RegistryConfig, clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            fleet: ArcSwap::from_pointee(Fleet::default()),
            write: Mutex::new(()),
            config,
            clock,
            next_id: AtomicU64::new(1),
            removed: Mutex::new(VecDeque::new()),
            events: broadcast::channel(1024).0,
        })
    }

    /// The current fleet snapshot, read without a lock; later changes do not show in it.
    #[inline]
    pub fn fleet(&self) -> arc_swap::Guard<Arc<Fleet>> {
        self.fleet.load()
    }

    /// The clock its breakers and timers run on.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Transitions, health changes and fleet changes, as they happen.
    pub fn subscribe(&self) -> broadcast::Receiver<WorkerEvent> {
        self.events.subscribe()
    }

    /// URLs of workers removed less than the grace period ago, whose
    /// breaker gauge reads -1; older ones are forgotten here.
    pub fn removed_urls(&self) -> Vec<Arc<str>> {
        let now = self.clock.now();
        let grace = nanos(self.config.removed_grace);
        let mut removed = self.removed.lock().unwrap();
        while let Some((url, _)) = removed
            .front()
            .filter(|(_, at)| now.saturating_sub(*at) >= grace)
        {
            tracing::debug!(worker = %url, "removed worker forgotten: its series go");
            removed.pop_front();
        }
        removed.iter().map(|(url, _)| url.clone()).collect()
    }

    /// Adds one worker: [`Registry::add_all`] with a single spec.
    pub fn add(self: &Arc<Self>, spec: &WorkerSpec) -> Result<Arc<Worker>, RegistryError> {
        let mut added = self.add_all(std::slice::from_ref(spec))?;
        Ok(added.remove(0))
    }

    /// Adds one worker to a serving fleet, NotReady until its first passing
    /// probe ([`HealthTracker::joining`]): for workers that will be probed,
    /// about which nothing is known yet.
    pub fn add_joining(self: &Arc<Self>, spec: &WorkerSpec) -> Result<Arc<Worker>, RegistryError> {
        let mut added = self.add_specs(std::slice::from_ref(spec), true)?;
        Ok(added.remove(0))
    }

    /// Adds several workers as one change: all of them or, when any spec is
    /// invalid or a duplicate, none. The fleet snapshot (and its hash rings)
    /// is rebuilt once, not once per worker.
    pub fn add_all(
        self: &Arc<Self>,
        specs: &[WorkerSpec],
    ) -> Result<Vec<Arc<Worker>>, RegistryError> {
        self.add_specs(specs, false)
    }

    /// [`Registry::add_all`]; `joining` workers start NotReady.
    fn add_specs(
        self: &Arc<Self>,
        specs: &[WorkerSpec],
        joining: bool,
    ) -> Result<Vec<Arc<Worker>>, RegistryError> {
        let addresses = specs
            .iter()
            .map(WorkerSpec::validate)
            .collect::<Result<Vec<_>, _>>()?;
        let _write = self.write.lock().unwrap();
        let fleet = self.fleet.load_full();
        let mut seen: std::collections::HashSet<&str> =
            fleet.workers.iter().map(|w| &*w.url).collect();
        if let Some(dup) = addresses.iter().find(|a| !seen.insert(&a.base)) {
            return Err(RegistryError::Duplicate(dup.base.clone()));
        }
        let added: Vec<_> = specs
            .iter()
            .zip(addresses)
            .map(|(spec, address)| self.build_worker(spec, address, joining))
            .collect();
        let mut removed = self.removed.lock().unwrap();
        removed.retain(|(u, _)| !added.iter().any(|w| w.url == *u));
        drop(removed);
        let mut workers = fleet.workers.clone();
        workers.extend(added.iter().cloned());
        self.publish(workers);
        for worker in &added {
            tracing::info!(worker = %worker.url, id = %worker.id, "worker added");
            let _ = self.events.send(WorkerEvent::Added(worker.clone()));
        }
        Ok(added)
    }

    fn build_worker(
        self: &Arc<Self>,
        spec: &WorkerSpec,
        address: WorkerAddress,
        joining: bool,
    ) -> Arc<Worker> {
        let health = if joining {
            HealthTracker::joining(self.config.health)
        } else {
            HealthTracker::new(Health::Ready, self.config.health)
        };
        let (settings, classifier) = self.config.breaker.resolve(&spec.resilience);
        let id = format!("w{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        let url: Arc<str> = address.base.clone().into();
        let worker = Arc::new_cyclic(|me: &Weak<Worker>| {
            let observer = Arc::new(BreakerEvents {
                worker: me.clone(),
                events: self.events.clone(),
                clock: self.clock.clone(),
            });
            Worker {
                id,
                url: url.clone(),
                ring_points: ring_points(&url),
                address,
                labels: spec.labels.clone(),
                breaker: Breaker::new(url.clone(), settings, Some(observer)),
                models: ArcSwap::from_pointee(spec.model.iter().cloned().collect()),
                classifier: ArcSwap::from_pointee(classifier),
                resilience: Mutex::new(spec.resilience.clone()),
                ready: AtomicBool::new(health.status() == Health::Ready),
                health: Mutex::new(health),
                draining: AtomicBool::new(false),
                removed: AtomicBool::new(false),
                inflight: AtomicU32::new(0),
                selected: AtomicU64::new(0),
                server_errors: Box::new(std::array::from_fn(|_| AtomicU64::new(0))),
                ttfb: Histogram::default(),
                recent: recent::Recent::default(),
                load: LoadCell::default(),
                tasks: Mutex::new(Vec::new()),
                timer: Mutex::new(None),
            }
        });
        if self.config.max_open_percent < 100 {
            worker.breaker.set_open_gate(Arc::new(EjectionGate {
                registry: Arc::downgrade(self),
                worker: Arc::downgrade(&worker),
                max_percent: self.config.max_open_percent,
            }));
        }
        worker
    }

    /// Applies a `resilience` patch (fields it sets win). Invalid patches
    /// change nothing.
    pub fn patch_resilience(
        &self,
        id: &str,
        patch: &Resilience,
    ) -> Result<Arc<Worker>, RegistryError> {
        self.update_resilience(id, patch, |current| current.merged(patch))
    }

    /// Replaces a worker's `resilience` block whole (a discovery source's
    /// new value: fields it no longer sets fall back to the defaults).
    pub fn set_resilience(
        &self,
        id: &str,
        resilience: &Resilience,
    ) -> Result<Arc<Worker>, RegistryError> {
        self.update_resilience(id, resilience, |_| resilience.clone())
    }

    fn update_resilience(
        &self,
        id: &str,
        given: &Resilience,
        next: impl FnOnce(&Resilience) -> Resilience,
    ) -> Result<Arc<Worker>, RegistryError> {
        given.validate()?;
        let _write = self.write.lock().unwrap();
        let worker = self
            .fleet()
            .get(id)
            .cloned()
            .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
        let mut current = worker.resilience.lock().unwrap();
        let merged = next(&current);
        let (settings, classifier) = self.config.breaker.resolve(&merged);
        worker.breaker.set_settings(settings);
        worker.classifier.store(Arc::new(classifier));
        *current = merged;
        drop(current);
        // A new `cb_timeout_secs` moves the end of an open period: the timer
        // must wake at the new deadline, not the old one.
        if matches!(worker.breaker.state(), State::Open | State::Degraded) {
            arm_state_timer(&worker, &self.clock);
        }
        tracing::info!(worker = %worker.url, "resilience overrides updated");
        Ok(worker)
    }

    /// Records the models a worker reported, when its spec named none.
    pub fn learn_models(&self, worker: &Worker, models: Vec<String>) {
        let _write = self.write.lock().unwrap();
        if *worker.models.load_full() == models {
            return;
        }
        worker.models.store(Arc::new(models));
        let workers = self.fleet.load().workers.clone();
        self.publish(workers);
    }

    /// Stops new traffic to a worker. Returns it so the caller can wait for
    /// its in-flight requests before [`Registry::remove`].
    pub fn drain(&self, id: &str) -> Result<Arc<Worker>, RegistryError> {
        let worker = self
            .fleet()
            .get(id)
            .cloned()
            .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
        if !worker.draining.swap(true, Ordering::AcqRel) {
            tracing::info!(worker = %worker.url, "worker draining");
            let _ = self.events.send(WorkerEvent::Draining(worker.clone()));
        }
        Ok(worker)
    }

    /// Takes the worker out of the fleet, aborts its background tasks and publishes
    /// [`WorkerEvent::Removed`]; from then on its `worker_cb_state` reads -1. Does nothing when it
    /// is not in the fleet.
    pub fn remove(&self, worker: &Arc<Worker>) {
        let _write = self.write.lock().unwrap();
        let fleet = self.fleet.load_full();
        let workers: Vec<_> = fleet
            .workers
            .iter()
            .filter(|w| !Arc::ptr_eq(w, worker))
            .cloned()
            .collect();
        if workers.len() == fleet.workers.len() {
            return;
        }
        // Attempts still in flight may move its breaker: nobody is told.
        worker.removed.store(true, Ordering::Release);
        for task in worker.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
        if let Some(timer) = worker.timer.lock().unwrap().take() {
            timer.abort();
        }
        self.publish(workers);
        {
            let mut removed = self.removed.lock().unwrap();
            if removed.len() == MAX_REMOVED
                && let Some((oldest, _)) = removed.pop_front()
            {
                tracing::debug!(worker = %oldest, "removed worker forgotten early: {MAX_REMOVED} removed workers are remembered at most");
            }
            removed.push_back((worker.url.clone(), self.clock.now()));
        }
        tracing::info!(worker = %worker.url, "worker removed");
        let _ = self.events.send(WorkerEvent::Removed(worker.clone()));
    }

    /// Feeds a probe result to the worker's health tracker; a promotion puts
    /// its open breaker on trial.
    /// `probe` says what the probe found (`status 503`, `connection
    /// refused`, ...) in the transition's log line.
    pub fn observe_health(
        &self,
        worker: &Arc<Worker>,
        passed: bool,
        probe: &dyn std::fmt::Display,
    ) -> Option<HealthChange> {
        let change = worker.health.lock().unwrap().observe(passed);
        self.apply_health(worker, change, probe);
        change
    }

    /// Puts a worker back to Ready by another path than probes (an operator,
    /// or health checks being disabled).
    pub fn force_ready(&self, worker: &Arc<Worker>) -> Option<HealthChange> {
        let change = worker.health.lock().unwrap().force_ready();
        self.apply_health(worker, change, &"forced");
        change
    }

    fn apply_health(
        &self,
        worker: &Arc<Worker>,
        change: Option<HealthChange>,
        probe: &dyn std::fmt::Display,
    ) {
        let Some(change) = change else { return };
        match change {
            HealthChange::Demoted => {
                worker.ready.store(false, Ordering::Release);
                // While NotReady, an open circuit waits for the promotion.
                worker.breaker.hold_open(true);
                tracing::warn!(worker = %worker.url, probe = %probe, "worker demoted to not_ready");
            }
            HealthChange::Promoted => {
                worker.ready.store(true, Ordering::Release);
                tracing::info!(worker = %worker.url, probe = %probe, "worker promoted to ready");
                worker.breaker.hold_open(false);
                worker.breaker.promote(&*self.clock);
            }
        }
        let _ = self
            .events
            .send(WorkerEvent::Health(worker.clone(), change));
    }

    fn publish(&self, workers: Vec<Arc<Worker>>) {
        self.fleet
            .store(Arc::new(Fleet::build(workers, self.config.hash_rings)));
    }
}

/// `--cb-max-open-percent` for one worker: it may open only while, in every
/// model group it serves (the whole fleet when it declares none), the
/// circuits already open plus its own stay within the share. Concurrent
/// openings in one group may each see the other as still closed, so the
/// bound can be passed by the few breakers that open in the same instant.
struct EjectionGate {
    registry: Weak<Registry>,
    worker: Weak<Worker>,
    max_percent: u32,
}

impl OpenGate for EjectionGate {
    fn may_open(&self) -> bool {
        let (Some(registry), Some(me)) = (self.registry.upgrade(), self.worker.upgrade()) else {
            return true;
        };
        let fleet = registry.fleet();
        let models = me.models();
        let within = |group: &[Arc<Worker>]| {
            let open = group
                .iter()
                .filter(|w| !Arc::ptr_eq(w, &me) && w.breaker.state() == State::Open)
                .count();
            // Like Envoy, one isolation is always allowed, however small
            // the group: a share below one worker must not disable breakers.
            open == 0 || (open + 1) * 100 <= self.max_percent as usize * group.len()
        };
        if models.is_empty() {
            return within(&fleet.workers);
        }
        models.iter().all(|m| within(fleet.candidates(Some(m)).0))
    }
}

/// The breaker observer of one worker: forwards transitions to subscribers and
/// arms the open-timeout timer, so a worker that takes no requests (idle, or
/// reached only through XDP) still leaves the open state on time.
struct BreakerEvents {
    worker: Weak<Worker>,
    events: broadcast::Sender<WorkerEvent>,
    clock: Arc<dyn Clock>,
}

impl TransitionObserver for BreakerEvents {
    fn on_transition(&self, t: &Transition) {
        let Some(worker) = self.worker.upgrade() else {
            return;
        };
        if worker.removed.load(Ordering::Acquire) {
            return;
        }
        // Open and degraded states end on a deadline that traffic may never
        // check; a timer makes sure they end on time.
        if matches!(t.to, State::Open | State::Degraded) {
            arm_state_timer(&worker, &self.clock);
        }
        let _ = self.events.send(WorkerEvent::Breaker(worker, *t));
    }
}

/// (Re)starts the timer that ends `worker`'s open or degraded period,
/// aborting the previous one. Needs a tokio runtime and a clock with real
/// deadlines; with a manual clock, tests move time themselves.
fn arm_state_timer(worker: &Arc<Worker>, clock: &Arc<dyn Clock>) {
    let (Ok(runtime), Some(_)) = (
        tokio::runtime::Handle::try_current(),
        clock.deadline(clock.now()),
    ) else {
        return;
    };
    let task = runtime.spawn(state_timer(Arc::downgrade(worker), clock.clone()));
    if let Some(old) = worker.timer.lock().unwrap().replace(task.abort_handle()) {
        old.abort();
    }
}

async fn state_timer(worker: Weak<Worker>, clock: Arc<dyn Clock>) {
    loop {
        let Some(deadline) = worker
            .upgrade()
            .and_then(|w| w.breaker.poll(&*clock))
            .and_then(|at| clock.deadline(at))
        else {
            return;
        };
        tokio::time::sleep_until(deadline.into()).await;
    }
}

//! The per-worker circuit breaker: a pure state machine.
//!
//! Owns the closed / open / half-open states (plus the optional degraded
//! state of the LLM-aware options), their counters and the rules of
//! the gateway document (per-request failure counting, half-open trials,
//! readmission on promotion). It takes time from an injected [`Clock`], does no
//! I/O, and knows nothing about HTTP beyond the [`Outcome`] it is handed: the
//! proxy classifies, the health checker promotes, the metrics layer reads
//! [`Breaker::snapshot`] at scrape time, and subscribers learn about every
//! transition through a [`TransitionObserver`].
//!
//! # Concurrency
//! The request path (`admit`, `record` in the closed state) is a handful of
//! atomic operations on this breaker alone: no global lock, no allocation.
//! State, half-open in-flight count and an epoch share one `AtomicU64`, so an
//! admission decision and a probe-slot reservation are one CAS. Transitions
//! are rare and take this breaker's own mutex, which makes each of them happen
//! exactly once however many threads race to it.

mod classify;
mod window;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use classify::{
    BodyRules, Classifier, DEFAULT_CAPACITY_CODES, DEFAULT_FAILURE_CODES, FailureReason, GrpcCode,
    Outcome, StatusSet, grpc_to_http,
};
use window::Window;

use crate::clock::{Clock, Nanos, nanos};

/// A breaker's state, with the numbering of the `worker_cb_state` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum State {
    /// Requests flow; failures count toward the failure threshold. Gauge value 0.
    Closed = 0,
    /// No requests until the open timeout passes or a promotion to Ready. Gauge value 1.
    Open = 1,
    /// On trial: `success_threshold` successes close it (or degrade it, when the degraded state is
    /// on), one failure reopens it. Gauge value 2.
    HalfOpen = 2,
    /// After a successful trial, with `--cb-degraded-traffic-pct`: takes a
    /// share of its traffic until `--cb-degraded-duration-secs` pass without
    /// a failure. Gauge value 3.
    Degraded = 3,
}

impl State {
    /// Every state in gauge order, which is also the index order of [`Snapshot::transitions`].
    pub const ALL: [State; 4] = [State::Closed, State::Open, State::HalfOpen, State::Degraded];
    const COUNT: usize = Self::ALL.len();

    /// The `snake_case` name used in log events and the `from` / `to` metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
            State::Degraded => "degraded",
        }
    }

    /// The value of the `worker_cb_state` gauge.
    pub fn gauge(self) -> i64 {
        self as i64
    }

    fn from_bits(bits: u64) -> State {
        match bits & STATE_MASK {
            0 => State::Closed,
            1 => State::Open,
            2 => State::HalfOpen,
            _ => State::Degraded,
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a transition happened; logged and handed to observers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransitionReason {
    /// Closed → open: the failure threshold was reached.
    FailureThreshold,
    /// Open → half-open: the open timeout passed.
    OpenTimeout,
    /// Open → half-open: the worker was promoted back to Ready.
    Promotion,
    /// Half-open → closed: the success threshold was reached.
    TrialSucceeded,
    /// Half-open → open: a trial request failed.
    TrialFailed,
    /// Degraded → closed: the degraded period passed without a failure.
    DegradedElapsed,
    /// Degraded → open: a request failed while degraded.
    DegradedFailure,
    /// Closed → open: a quorum of balancer replicas holds open verdicts on
    /// the worker (`--fleet-verdicts`); see [`Breaker::fleet_open`].
    Fleet,
    /// Open → half-open: the quorum that opened the circuit cleared, or this
    /// replica lost touch with it for longer than its lease.
    FleetCleared,
}

impl TransitionReason {
    /// The `snake_case` name logged as a transition's `reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransitionReason::FailureThreshold => "failure_threshold",
            TransitionReason::OpenTimeout => "open_timeout",
            TransitionReason::Promotion => "promotion",
            TransitionReason::TrialSucceeded => "trial_succeeded",
            TransitionReason::TrialFailed => "trial_failed",
            TransitionReason::DegradedElapsed => "degraded_elapsed",
            TransitionReason::DegradedFailure => "degraded_failure",
            TransitionReason::Fleet => "fleet",
            TransitionReason::FleetCleared => "fleet_cleared",
        }
    }
}

/// One state change, as observers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// The state left.
    pub from: State,
    /// The state entered.
    pub to: State,
    /// What caused the move.
    pub reason: TransitionReason,
    /// When it happened by the breaker's clock, in nanoseconds.
    pub at: Nanos,
}

/// Told about every transition, in order, while the breaker's transition lock
/// is held: implementations must be quick and must not call back into the
/// same breaker's mutating methods.
pub trait TransitionObserver: Send + Sync {
    /// Called once per transition, after the new state is stored and before the transition lock is
    /// released.
    fn on_transition(&self, transition: &Transition);
}

/// Consulted before a closed circuit opens: `--cb-max-open-percent` keeps a
/// model's fleet from being isolated beyond a share. Denied, the circuit
/// stays closed and keeps counting; the next failure asks again.
pub trait OpenGate: Send + Sync {
    /// Whether this breaker may open now.
    fn may_open(&self) -> bool;
}

/// Failure counting over a time window instead of consecutive failures (an
/// option beyond the document, off by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSettings {
    /// The span failures are counted over (`--cb-window-duration-secs`).
    pub duration: Duration,
    /// Fewer calls than this in the window never open the circuit, so one
    /// failure on an idle worker is not a 100% failure rate.
    pub min_calls: u32,
}

/// The degraded state between a successful trial and closing (an option
/// beyond the document, off by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DegradedSettings {
    /// Share of the traffic it would otherwise get, in percent (1..=100).
    pub traffic_pct: u32,
    /// How long it must go without a failure to close.
    pub duration: Duration,
}

/// The tunables of one breaker, after flags and per-worker overrides are merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Failed requests that open the circuit (`u32::MAX`: never).
    pub failure_threshold: u32,
    /// Consecutive half-open successes that close it.
    pub success_threshold: u32,
    /// How long it stays open before a trial.
    pub open_timeout: Duration,
    /// At most this many requests in flight to a half-open worker; 0 means no
    /// limit, as in the document.
    pub half_open_max_inflight: u32,
    /// `None`: consecutive failures (the document). `Some`: failures within a window.
    pub window: Option<WindowSettings>,
    /// `None`: a successful trial closes the circuit (the document).
    pub degraded: Option<DegradedSettings>,
    /// Half-open admits at most one request per interval, so the trial is
    /// spread in time; zero means no spacing (the document).
    pub half_open_probe_interval: Duration,
}

impl Default for Settings {
    /// The document's defaults.
    fn default() -> Self {
        Self {
            failure_threshold: 10,
            success_threshold: 3,
            open_timeout: Duration::from_secs(60),
            half_open_max_inflight: 0,
            window: None,
            degraded: None,
            half_open_probe_interval: Duration::ZERO,
        }
    }
}

/// Proof that a request was admitted, to be handed back exactly once: with
/// its outcome to [`Breaker::record`], or without one to [`Breaker::cancel`].
/// It remembers the state epoch it was admitted in (only outcomes of that
/// epoch decide a transition) and whether it holds one of the limited
/// half-open probe slots, so the slot is returned exactly once. Neither
/// `Copy` nor `Clone`: a ticket cannot be handed back twice. The request path
/// holds it inside `registry::Attempt`, which cancels it when dropped.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket must be handed back through Breaker::record or Breaker::cancel"]
pub struct Ticket {
    epoch: u32,
    probe: bool,
}

/// The largest `--cb-half-open-max-inflight`: the in-flight count shares a
/// word with the state and the epoch, and has 24 bits of it.
pub const MAX_HALF_OPEN_INFLIGHT: u32 = 0x00ff_ffff;

/// A consistent-enough copy of a breaker's counters, for metrics and the admin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The state as stored: an open circuit whose timeout has passed still reads open until
    /// something polls it.
    pub state: State,
    /// Failures since the last success: the document's trip counter. Kept when the circuit opens,
    /// reset by any other transition and by a promotion.
    pub consecutive_failures: u32,
    /// Successes since the last failure or transition; in half-open, the trial's progress toward
    /// the success threshold.
    pub consecutive_successes: u32,
    /// Successes recorded since the breaker was created
    /// (`worker_cb_outcomes_total{outcome="success"}`).
    pub successes: u64,
    /// Indexed like [`FailureReason::ALL`].
    pub failures: [u64; FailureReason::ALL.len()],
    /// `transitions[from][to]`, indexed by `State as usize`.
    pub transitions: [[u64; State::COUNT]; State::COUNT],
    /// Open → half-open moves caused by a promotion back to Ready
    /// (`worker_cb_health_readmissions_total`).
    pub health_readmissions: u64,
    /// Half-open probe slots held now; always 0 without a `half_open_max_inflight` limit.
    pub half_open_inflight: u32,
    /// When the circuit leaves the open state by timeout, if it is open.
    pub open_until: Option<Nanos>,
    /// Whether the degraded state is configured (its transitions are then
    /// published).
    pub degraded_enabled: bool,
    /// Whether the current open period was started by the fleet's quorum
    /// ([`Breaker::fleet_open`]): it ends with the quorum, not on a timeout.
    pub fleet_opened: bool,
}

impl Snapshot {
    /// Failures of every reason (`worker_cb_outcomes_total{outcome="failure"}`).
    pub fn failures_total(&self) -> u64 {
        self.failures.iter().sum()
    }

    /// Transitions of every kind since the breaker was created.
    pub fn transitions_total(&self) -> u64 {
        self.transitions.iter().flatten().sum()
    }
}

// Layout of `Breaker::word`: state | half-open in-flight << 8 | epoch << 32.
const STATE_MASK: u64 = 0xff;
const INFLIGHT_ONE: u64 = 1 << 8;
const INFLIGHT_MASK: u64 = 0x00ff_ffff << 8;
const EPOCH_SHIFT: u32 = 32;

fn epoch_of(word: u64) -> u32 {
    (word >> EPOCH_SHIFT) as u32
}

fn inflight_of(word: u64) -> u32 {
    ((word & INFLIGHT_MASK) >> 8) as u32
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One worker's circuit breaker.
pub struct Breaker {
    id: u64,
    name: Arc<str>,
    word: AtomicU64,
    consecutive_failures: AtomicU32,
    consecutive_successes: AtomicU32,
    opened_at: AtomicU64,
    /// When the current degraded period started.
    degraded_since: AtomicU64,
    /// The earliest moment the next spaced half-open probe may go.
    next_probe_at: AtomicU64,
    /// Checks made while degraded; every check whose index crosses a
    /// multiple of 100/pct passes, which gives exactly pct% of them.
    degraded_checks: AtomicU64,

    failure_threshold: AtomicU32,
    success_threshold: AtomicU32,
    open_timeout: AtomicU64,
    half_open_max_inflight: AtomicU32,
    windowed: AtomicBool,
    degraded_pct: AtomicU32,
    degraded_duration: AtomicU64,
    probe_interval: AtomicU64,

    successes: AtomicU64,
    failures: [AtomicU64; FailureReason::ALL.len()],
    transitions: [[AtomicU64; State::COUNT]; State::COUNT],
    readmissions: AtomicU64,
    /// The last failure recorded, for the log line of an opening: the
    /// reason's index, and for `Status` the worker's status in bits 8..24
    /// (see [`Breaker::note_failed_status`]).
    last_failure: AtomicU32,
    /// The worker is NotReady: an open circuit waits for the promotion
    /// instead of its timeout, so the promotion is the one move to half-open.
    held_open: AtomicBool,
    /// The current open period was started by the fleet's quorum: no timeout
    /// ends it, [`Breaker::fleet_release`] does. Written only under the
    /// transition lock, so it always describes the current open period.
    fleet_held: AtomicBool,

    /// Serialises transitions (and the optional window), never taken by a
    /// closed-state admission or a plain success.
    transition_lock: Mutex<Option<Window>>,
    observer: Option<Arc<dyn TransitionObserver>>,
    gate: std::sync::OnceLock<Arc<dyn OpenGate>>,
}

impl std::fmt::Debug for Breaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker")
            .field("name", &self.name)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl Breaker {
    /// A closed breaker. `name` (the worker URL) labels its log events.
    pub fn new(
        name: impl Into<Arc<str>>,
        settings: Settings,
        observer: Option<Arc<dyn TransitionObserver>>,
    ) -> Self {
        let breaker = Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name: name.into(),
            word: AtomicU64::new(State::Closed as u64),
            consecutive_failures: AtomicU32::new(0),
            consecutive_successes: AtomicU32::new(0),
            opened_at: AtomicU64::new(0),
            degraded_since: AtomicU64::new(0),
            next_probe_at: AtomicU64::new(0),
            degraded_checks: AtomicU64::new(0),
            failure_threshold: AtomicU32::new(0),
            success_threshold: AtomicU32::new(0),
            open_timeout: AtomicU64::new(0),
            half_open_max_inflight: AtomicU32::new(0),
            windowed: AtomicBool::new(false),
            degraded_pct: AtomicU32::new(0),
            degraded_duration: AtomicU64::new(0),
            probe_interval: AtomicU64::new(0),
            successes: AtomicU64::new(0),
            failures: Default::default(),
            transitions: Default::default(),
            readmissions: AtomicU64::new(0),
            last_failure: AtomicU32::new(0),
            held_open: AtomicBool::new(false),
            fleet_held: AtomicBool::new(false),
            transition_lock: Mutex::new(None),
            observer,
            gate: std::sync::OnceLock::new(),
        };
        breaker.set_settings(settings);
        breaker
    }

    /// The worker URL this breaker was created for; it labels the log events.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Applies new tunables (a per-worker override changed). The state and
    /// counters stay; a lowered threshold takes effect at the next failure.
    pub fn set_settings(&self, s: Settings) {
        let mut window = self.lock();
        self.failure_threshold
            .store(s.failure_threshold.max(1), Ordering::Relaxed);
        self.success_threshold
            .store(s.success_threshold.max(1), Ordering::Relaxed);
        self.open_timeout
            .store(nanos(s.open_timeout), Ordering::Relaxed);
        // Clamped so that the count can never carry into the epoch bits;
        // configuration refuses larger values before they get here.
        self.half_open_max_inflight.store(
            s.half_open_max_inflight.min(MAX_HALF_OPEN_INFLIGHT),
            Ordering::Relaxed,
        );
        let (pct, duration) = s
            .degraded
            .map_or((0, 0), |d| (d.traffic_pct.clamp(1, 100), nanos(d.duration)));
        self.degraded_pct.store(pct, Ordering::Relaxed);
        self.degraded_duration.store(duration, Ordering::Relaxed);
        self.probe_interval
            .store(nanos(s.half_open_probe_interval), Ordering::Relaxed);
        let same_window = window.as_ref().map(Window::settings) == s.window;
        if !same_window {
            *window = s.window.map(Window::new);
        }
        self.windowed.store(s.window.is_some(), Ordering::Relaxed);
    }

    /// The tunables in force, as clamped by [`Breaker::set_settings`]: thresholds at least 1, the
    /// degraded share within 1..=100.
    pub fn settings(&self) -> Settings {
        Settings {
            failure_threshold: self.failure_threshold.load(Ordering::Relaxed),
            success_threshold: self.success_threshold.load(Ordering::Relaxed),
            open_timeout: Duration::from_nanos(self.open_timeout.load(Ordering::Relaxed)),
            half_open_max_inflight: self.half_open_max_inflight.load(Ordering::Relaxed),
            window: self.lock().as_ref().map(Window::settings),
            degraded: match self.degraded_pct.load(Ordering::Relaxed) {
                0 => None,
                pct => Some(DegradedSettings {
                    traffic_pct: pct,
                    duration: Duration::from_nanos(self.degraded_duration.load(Ordering::Relaxed)),
                }),
            },
            half_open_probe_interval: Duration::from_nanos(
                self.probe_interval.load(Ordering::Relaxed),
            ),
        }
    }

    /// The current state, without moving an expired open circuit: use
    /// [`Breaker::is_available`] or [`Breaker::poll`] for that.
    #[inline]
    pub fn state(&self) -> State {
        State::from_bits(self.word.load(Ordering::Acquire))
    }

    /// Whether selection may pick this worker now. Moves an open circuit whose
    /// timeout has passed to half-open (the document's "next check of the
    /// worker's state"). Reserves nothing: call [`Breaker::admit`] on the
    /// worker finally chosen.
    #[inline]
    pub fn is_available(&self, clock: &dyn Clock) -> bool {
        loop {
            let word = self.word.load(Ordering::Acquire);
            match State::from_bits(word) {
                State::Closed => return true,
                State::HalfOpen => {
                    let max = self.half_open_max_inflight.load(Ordering::Relaxed);
                    return (max == 0 || inflight_of(word) < max) && self.probe_due(clock);
                }
                State::Open => {
                    if !self.try_leave_open(word, clock) {
                        return false;
                    }
                }
                // Eligible: the traffic share is applied once per admission
                // ([`Breaker::admit`]), however many times a policy checks.
                State::Degraded => {
                    if !self.try_leave_degraded(word, clock) {
                        return true;
                    }
                }
            }
        }
    }

    /// Admits one request, or says no. In half-open with a probe limit this
    /// takes one of the limited slots.
    #[inline]
    pub fn admit(&self, clock: &dyn Clock) -> Option<Ticket> {
        loop {
            let word = self.word.load(Ordering::Acquire);
            let ticket = Ticket {
                epoch: epoch_of(word),
                probe: false,
            };
            match State::from_bits(word) {
                State::Closed => return Some(ticket),
                State::HalfOpen => {
                    let max = self.half_open_max_inflight.load(Ordering::Relaxed);
                    if max == 0 {
                        return self.take_probe_slot(clock).then_some(ticket);
                    }
                    if inflight_of(word) >= max || !self.probe_due(clock) {
                        return None;
                    }
                    // The in-flight slot first, the interval's probe second:
                    // a lost compare-and-swap then costs a retry, never the
                    // interval's probe.
                    if self
                        .word
                        .compare_exchange_weak(
                            word,
                            word + INFLIGHT_ONE,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        )
                        .is_ok()
                    {
                        if self.take_probe_slot(clock) {
                            return Some(Ticket {
                                probe: true,
                                ..ticket
                            });
                        }
                        self.release_probe(ticket.epoch);
                        return None;
                    }
                }
                State::Open => {
                    if !self.try_leave_open(word, clock) {
                        return None;
                    }
                }
                // The share is taken here, once per admission, so that every
                // policy gives a degraded worker the same share of requests.
                State::Degraded => {
                    if !self.try_leave_degraded(word, clock) {
                        return self.degraded_share().then_some(ticket);
                    }
                }
            }
        }
    }

    /// Records what an admitted request did and gives its ticket back.
    #[inline]
    /// Every outcome counts in the totals; only one of the epoch the ticket
    /// was admitted in moves the state machine, so a long stream admitted
    /// while closed cannot close a half-open circuit that no trial request
    /// passed, nor reopen one.
    pub fn record(&self, ticket: Ticket, outcome: Outcome, clock: &dyn Clock) {
        if ticket.probe {
            self.release_probe(ticket.epoch);
        }
        match outcome {
            Outcome::Success => self.on_success(ticket.epoch, clock),
            Outcome::Failure(reason) => self.on_failure(reason, ticket.epoch, clock),
            Outcome::Ignored => {}
        }
    }

    /// Records an outcome nobody was admitted for: what the XDP datapath saw
    /// a connection's handshake do. It counts like a request admitted now
    /// (in half-open, an established handshake is a trial that passed; the
    /// datapath admitted it under its own trial share).
    pub fn observe(&self, outcome: Outcome, clock: &dyn Clock) {
        let epoch = epoch_of(self.word.load(Ordering::Acquire));
        match outcome {
            Outcome::Success => self.on_success(epoch, clock),
            Outcome::Failure(reason) => self.on_failure(reason, epoch, clock),
            Outcome::Ignored => {}
        }
    }

    /// The status of the failed answer about to be recorded, so that an
    /// opening can say which status tripped it. Called on failures only:
    /// successes do not pay for it.
    pub fn note_failed_status(&self, status: u16) {
        self.last_failure.store(
            (u32::from(status) << 8) | FailureReason::Status as u32,
            Ordering::Relaxed,
        );
    }

    /// The last failure, as an opening logs it: `status 503`, `connect`,
    /// `timeout`, ...
    fn last_failure(&self) -> String {
        let word = self.last_failure.load(Ordering::Relaxed);
        let reason = FailureReason::ALL
            .get((word & 0xff) as usize)
            .copied()
            .unwrap_or(FailureReason::Status);
        match (reason, word >> 8) {
            (FailureReason::Status, status) if status != 0 => format!("status {status}"),
            (reason, _) => reason.as_str().to_owned(),
        }
    }

    /// Gives back a ticket whose request ended without an outcome (the
    /// client left, the attempt was cancelled): its probe slot is returned
    /// and nothing is recorded.
    pub fn cancel(&self, ticket: Ticket) {
        if ticket.probe {
            self.release_probe(ticket.epoch);
        }
    }

    /// Installs the gate consulted before a closed circuit opens (once; later
    /// calls are ignored). Without one, the threshold alone decides.
    pub fn set_open_gate(&self, gate: Arc<dyn OpenGate>) {
        let _ = self.gate.set(gate);
    }

    fn may_open(&self) -> bool {
        self.gate.get().is_none_or(|g| g.may_open())
    }

    /// Holds an open circuit open until [`Breaker::promote`] while the worker
    /// is NotReady (`true`), or lets the open timeout run again (`false`).
    /// The health gate excludes the worker either way; holding makes the
    /// promotion, not the timer, the move to half-open, as the reference
    /// gateway shows it.
    pub fn hold_open(&self, held: bool) {
        self.held_open.store(held, Ordering::Release);
    }

    /// Moves an expired open circuit to half-open, and otherwise says when it
    /// will expire. The agent's timer calls this so that a worker nobody sends
    /// requests to (an L4-only or idle one) does not stay isolated forever.
    pub fn poll(&self, clock: &dyn Clock) -> Option<Nanos> {
        let word = self.word.load(Ordering::Acquire);
        match State::from_bits(word) {
            // Held open: the promotion (or the fleet's release) ends it, no
            // timer needs to run.
            State::Open if self.held_open.load(Ordering::Acquire) || self.is_fleet_held() => None,
            State::Open if !self.try_leave_open(word, clock) => Some(self.open_until()),
            State::Degraded if !self.try_leave_degraded(word, clock) => Some(self.degraded_until()),
            _ => None,
        }
    }

    /// The worker was promoted back to Ready. An open circuit goes on trial at
    /// once; a closed one forgets the failures of the outage. The caller makes
    /// sure a promotion is a real NotReady → Ready move, so each one starts at
    /// most one trial.
    pub fn promote(&self, clock: &dyn Clock) {
        let word = self.word.load(Ordering::Acquire);
        match State::from_bits(word) {
            // The fleet's quorum still holds the worker open: the release,
            // not the promotion, ends it.
            State::Open if self.is_fleet_held() => {}
            State::Open => {
                self.transition(
                    word,
                    State::HalfOpen,
                    TransitionReason::Promotion,
                    clock.now(),
                );
            }
            State::Closed => {
                let _guard = self.lock();
                if State::from_bits(self.word.load(Ordering::Acquire)) == State::Closed {
                    self.consecutive_failures.store(0, Ordering::Release);
                }
            }
            State::HalfOpen | State::Degraded => {}
        }
    }

    /// Reads the counters for metrics and the admin API, without moving any state (an expired open
    /// circuit stays open).
    pub fn snapshot(&self) -> Snapshot {
        let word = self.word.load(Ordering::Acquire);
        let state = State::from_bits(word);
        Snapshot {
            state,
            consecutive_failures: self.consecutive_failures.load(Ordering::Acquire),
            consecutive_successes: self.consecutive_successes.load(Ordering::Acquire),
            successes: self.successes.load(Ordering::Relaxed),
            failures: std::array::from_fn(|i| self.failures[i].load(Ordering::Relaxed)),
            transitions: std::array::from_fn(|f| {
                std::array::from_fn(|t| self.transitions[f][t].load(Ordering::Relaxed))
            }),
            health_readmissions: self.readmissions.load(Ordering::Relaxed),
            half_open_inflight: inflight_of(word),
            open_until: (state == State::Open).then(|| self.open_until()),
            degraded_enabled: self.degraded_pct.load(Ordering::Relaxed) != 0,
            fleet_opened: state == State::Open && self.is_fleet_held(),
        }
    }

    /// Opens a closed circuit because a quorum of balancer replicas holds the
    /// worker open (`--fleet-verdicts`), with reason [`TransitionReason::Fleet`].
    /// Such an open period has no timeout: it lasts until
    /// [`Breaker::fleet_release`]. A circuit in any other state is this
    /// replica's own evidence and is left alone; `--cb-max-open-percent`
    /// bounds fleet isolations as it bounds any other. Returns whether it
    /// opened.
    pub fn fleet_open(&self, clock: &dyn Clock) -> bool {
        let word = self.word.load(Ordering::Acquire);
        State::from_bits(word) == State::Closed
            && self.may_open()
            && self.transition(word, State::Open, TransitionReason::Fleet, clock.now())
    }

    /// The quorum that opened the circuit cleared: a fleet-opened circuit
    /// goes on trial ([`TransitionReason::FleetCleared`]) and closes by the
    /// usual success threshold. While the worker is NotReady it waits for the
    /// promotion instead, as any open circuit does. Returns whether it moved.
    pub fn fleet_release(&self, clock: &dyn Clock) -> bool {
        let word = self.word.load(Ordering::Acquire);
        if State::from_bits(word) != State::Open || !self.is_fleet_held() {
            return false;
        }
        if self.held_open.load(Ordering::Acquire) {
            let _guard = self.lock();
            if self.word.load(Ordering::Acquire) == word {
                self.fleet_held.store(false, Ordering::Release);
            }
            return false;
        }
        self.transition(
            word,
            State::HalfOpen,
            TransitionReason::FleetCleared,
            clock.now(),
        )
    }

    fn is_fleet_held(&self) -> bool {
        self.fleet_held.load(Ordering::Acquire)
    }

    /// A process-unique id, for per-request bookkeeping ([`RequestCharges`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn open_until(&self) -> Nanos {
        self.opened_at
            .load(Ordering::Acquire)
            .saturating_add(self.open_timeout.load(Ordering::Relaxed))
    }

    fn degraded_until(&self) -> Nanos {
        self.degraded_since
            .load(Ordering::Acquire)
            .saturating_add(self.degraded_duration.load(Ordering::Relaxed))
    }

    /// Like [`Breaker::try_leave_open`], for the end of a degraded period.
    fn try_leave_degraded(&self, word: u64, clock: &dyn Clock) -> bool {
        let now = clock.now();
        if now < self.degraded_until() {
            return false;
        }
        self.transition(word, State::Closed, TransitionReason::DegradedElapsed, now);
        true
    }

    fn degraded_share(&self) -> bool {
        let pct = u64::from(self.degraded_pct.load(Ordering::Relaxed));
        let n = self.degraded_checks.fetch_add(1, Ordering::Relaxed);
        (n + 1) * pct / 100 > n * pct / 100
    }

    /// Whether a spaced half-open probe may go now (always, without spacing).
    fn probe_due(&self, clock: &dyn Clock) -> bool {
        self.probe_interval.load(Ordering::Relaxed) == 0
            || clock.now() >= self.next_probe_at.load(Ordering::Acquire)
    }

    /// Claims the next spaced probe; exactly one caller wins each interval.
    fn take_probe_slot(&self, clock: &dyn Clock) -> bool {
        let interval = self.probe_interval.load(Ordering::Relaxed);
        if interval == 0 {
            return true;
        }
        let now = clock.now();
        self.next_probe_at
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |next| {
                (now >= next).then(|| now.saturating_add(interval))
            })
            .is_ok()
    }

    /// Returns true when the circuit left the open state (by this call or a
    /// concurrent one), false while it must stay open.
    fn try_leave_open(&self, word: u64, clock: &dyn Clock) -> bool {
        let now = clock.now();
        if now < self.open_until() || self.held_open.load(Ordering::Acquire) || self.is_fleet_held()
        {
            return false;
        }
        self.transition(word, State::HalfOpen, TransitionReason::OpenTimeout, now);
        true
    }

    fn release_probe(&self, epoch: u32) {
        // A transition since admission reset the count and bumped the epoch;
        // the slot this ticket held no longer exists.
        let _ = self
            .word
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (epoch_of(w) == epoch && inflight_of(w) > 0).then(|| w - INFLIGHT_ONE)
            });
    }

    fn on_success(&self, epoch: u32, clock: &dyn Clock) {
        self.successes.fetch_add(1, Ordering::Relaxed);
        let word = self.word.load(Ordering::Acquire);
        if epoch_of(word) != epoch {
            return;
        }
        // Skip the store when already zero: the common case stays a read of a
        // shared cache line rather than a write to it.
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Release);
        }
        let successes = saturating_increment(&self.consecutive_successes);
        match State::from_bits(word) {
            State::HalfOpen => {
                if successes >= self.success_threshold.load(Ordering::Relaxed) {
                    let to = if self.degraded_pct.load(Ordering::Relaxed) == 0 {
                        State::Closed
                    } else {
                        State::Degraded
                    };
                    self.transition(word, to, TransitionReason::TrialSucceeded, clock.now());
                }
            }
            State::Closed if self.windowed.load(Ordering::Relaxed) => {
                let now = clock.now();
                if let Some(w) = self.lock().as_mut() {
                    w.record(now, false);
                }
            }
            State::Closed | State::Open | State::Degraded => {}
        }
    }

    fn on_failure(&self, reason: FailureReason, epoch: u32, clock: &dyn Clock) {
        self.failures[reason as usize].fetch_add(1, Ordering::Relaxed);
        if reason != FailureReason::Status {
            self.last_failure.store(reason as u32, Ordering::Relaxed);
        }
        let word = self.word.load(Ordering::Acquire);
        if epoch_of(word) != epoch {
            return;
        }
        self.consecutive_successes.store(0, Ordering::Release);
        let failures = saturating_increment(&self.consecutive_failures);
        match State::from_bits(word) {
            State::Closed => {
                let threshold = self.failure_threshold.load(Ordering::Relaxed);
                let now = clock.now();
                let trip = if self.windowed.load(Ordering::Relaxed) {
                    self.lock()
                        .as_mut()
                        .is_some_and(|w| w.record(now, true).trips(threshold))
                } else {
                    failures >= threshold
                };
                if trip && self.may_open() {
                    self.transition(word, State::Open, TransitionReason::FailureThreshold, now);
                }
            }
            State::HalfOpen => {
                self.transition(
                    word,
                    State::Open,
                    TransitionReason::TrialFailed,
                    clock.now(),
                );
            }
            State::Degraded => {
                self.transition(
                    word,
                    State::Open,
                    TransitionReason::DegradedFailure,
                    clock.now(),
                );
            }
            State::Open => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Window>> {
        // Nothing under this lock can panic halfway through an update, so a
        // poisoned lock still guards consistent data.
        self.transition_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Moves from the state in `expected` to `to`, unless another thread got
    /// there first (the state or epoch in `word` changed). Returns whether
    /// this call made the transition.
    fn transition(&self, expected: u64, to: State, reason: TransitionReason, now: Nanos) -> bool {
        let mut window = self.lock();
        let current = self.word.load(Ordering::Acquire);
        if current & !INFLIGHT_MASK != expected & !INFLIGHT_MASK {
            return false;
        }
        let from = State::from_bits(current);
        // Counter resets of the reference gateway: a new state starts its own
        // run, except that opening keeps the failure run that caused it.
        match to {
            State::Closed | State::HalfOpen | State::Degraded => {
                self.consecutive_failures.store(0, Ordering::Release);
                self.consecutive_successes.store(0, Ordering::Release);
                if let Some(w) = window.as_mut() {
                    w.clear();
                }
                // A fresh trial may probe at once; a degraded period starts
                // its own clock.
                self.next_probe_at.store(now, Ordering::Release);
                self.degraded_since.store(now, Ordering::Release);
            }
            State::Open => {
                self.consecutive_successes.store(0, Ordering::Release);
                self.opened_at.store(now, Ordering::Release);
            }
        }
        // Only the fleet's own opening is held by the fleet: any other move
        // (a trial that failed after the quorum cleared, a timeout) is this
        // replica's evidence again.
        self.fleet_held
            .store(reason == TransitionReason::Fleet, Ordering::Release);
        let next = (u64::from(epoch_of(current).wrapping_add(1)) << EPOCH_SHIFT) | to as u64;
        self.word.store(next, Ordering::Release);
        self.transitions[from as usize][to as usize].fetch_add(1, Ordering::Relaxed);
        if reason == TransitionReason::Promotion {
            self.readmissions.fetch_add(1, Ordering::Relaxed);
        }
        if to == State::Open {
            // What an operator asks first: why, and until when.
            let trial = if self.held_open.load(Ordering::Acquire) {
                "when the worker passes its health checks again".to_owned()
            } else {
                format!(
                    "in {} s",
                    Duration::from_nanos(self.open_timeout.load(Ordering::Relaxed)).as_secs()
                )
            };
            tracing::warn!(
                worker = %self.name,
                from = from.as_str(),
                to = to.as_str(),
                reason = reason.as_str(),
                failures = self.consecutive_failures.load(Ordering::Acquire),
                last_failure = %self.last_failure(),
                trial = %trial,
                "circuit breaker opened"
            );
        } else {
            tracing::info!(
                worker = %self.name,
                from = from.as_str(),
                to = to.as_str(),
                reason = reason.as_str(),
                "circuit breaker transition"
            );
        }
        if let Some(observer) = &self.observer {
            observer.on_transition(&Transition {
                from,
                to,
                reason,
                at: now,
            });
        }
        drop(window);
        true
    }
}

/// Adds one to a run counter, stopping at `u32::MAX` instead of wrapping (a
/// run that long happens with `--disable-circuit-breaker`); returns the new
/// value.
#[inline]
fn saturating_increment(counter: &AtomicU32) -> u32 {
    // One `fetch_add` on the hot path rather than a compare-and-swap loop;
    // the rare wrap is undone at once (a reader may glimpse a small value in
    // between, never a panic or a lasting wrap).
    let previous = counter.fetch_add(1, Ordering::AcqRel);
    if previous == u32::MAX {
        counter.store(u32::MAX, Ordering::Release);
    }
    previous.saturating_add(1)
}

/// Per-request failure accounting: however many attempts of one request fail
/// on the same worker within one state epoch, that worker is charged one
/// failure. A retry that lands on the same worker after a transition (closed,
/// then half-open) is charged again: "any failure reopens it". The retry loop
/// keeps one of these per request and records through it.
#[derive(Debug, Default)]
pub struct RequestCharges {
    charged: Vec<(u64, u32)>,
}

impl RequestCharges {
    /// Records `outcome` on `breaker`, downgrading a repeated failure of this
    /// request on the same breaker to no sample. Allocates only on a request's
    /// first failure.
    pub fn record(
        &mut self,
        breaker: &Breaker,
        ticket: Ticket,
        outcome: Outcome,
        clock: &dyn Clock,
    ) {
        let key = (breaker.id(), ticket.epoch);
        let outcome = match outcome {
            Outcome::Failure(_) if self.charged.contains(&key) => Outcome::Ignored,
            Outcome::Failure(_) => {
                self.charged.push(key);
                outcome
            }
            other => other,
        };
        breaker.record(ticket, outcome, clock);
    }
}

#[cfg(test)]
mod tests;

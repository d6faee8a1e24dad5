//! One test per rule of the gateway document, a property test against a
//! reference model, and a concurrency test. Time only moves through
//! `ManualClock`.

use std::sync::Mutex as StdMutex;
use std::sync::atomic::AtomicUsize;

use proptest::prelude::*;

use super::*;
use crate::clock::ManualClock;

const SECOND: Duration = Duration::from_secs(1);

fn settings(failure: u32, success: u32, timeout_secs: u64) -> Settings {
    Settings {
        failure_threshold: failure,
        success_threshold: success,
        open_timeout: Duration::from_secs(timeout_secs),
        ..Settings::default()
    }
}

/// A ticket as a request admitted in the breaker's current state holds it
/// (without taking a probe slot).
fn inflight(b: &Breaker) -> Ticket {
    Ticket {
        epoch: epoch_of(b.word.load(Ordering::Acquire)),
        probe: false,
    }
}

fn fail(b: &Breaker, c: &ManualClock) {
    b.record(inflight(b), Outcome::Failure(FailureReason::Status), c);
}

fn succeed(b: &Breaker, c: &ManualClock) {
    b.record(inflight(b), Outcome::Success, c);
}

#[derive(Default)]
struct Recorder(StdMutex<Vec<Transition>>);

impl TransitionObserver for Recorder {
    fn on_transition(&self, t: &Transition) {
        self.0.lock().unwrap().push(*t);
    }
}

impl Recorder {
    fn moves(&self) -> Vec<(State, State, TransitionReason)> {
        let seen = self.0.lock().unwrap();
        seen.iter().map(|t| (t.from, t.to, t.reason)).collect()
    }
}

fn open_breaker(failure: u32, success: u32, timeout_secs: u64) -> (Breaker, ManualClock) {
    let clock = ManualClock::new();
    let b = Breaker::new("http://w", settings(failure, success, timeout_secs), None);
    for _ in 0..failure {
        fail(&b, &clock);
    }
    assert_eq!(b.state(), State::Open);
    (b, clock)
}

#[test]
fn defaults_are_the_documents() {
    let s = Settings::default();
    assert_eq!(
        (s.failure_threshold, s.success_threshold, s.open_timeout),
        (10, 3, Duration::from_secs(60))
    );
    assert_eq!((s.half_open_max_inflight, s.window), (0, None));
}

#[test]
fn closed_failed_request_increments_consecutive_failures() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(5, 1, 1), None);
    for n in 1..=4 {
        fail(&b, &clock);
        assert_eq!(b.snapshot().consecutive_failures, n);
        assert_eq!(b.state(), State::Closed);
    }
}

#[test]
fn closed_success_resets_consecutive_failures_to_zero() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(3, 1, 1), None);
    fail(&b, &clock);
    fail(&b, &clock);
    succeed(&b, &clock);
    assert_eq!(b.snapshot().consecutive_failures, 0);
    fail(&b, &clock);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Closed, "the success broke the run");
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
}

#[test]
fn closed_opens_when_consecutive_failures_reach_threshold() {
    for threshold in [1, 2, 3, 10] {
        let (b, _) = open_breaker(threshold, 3, 60);
        let snap = b.snapshot();
        assert_eq!(snap.consecutive_failures, threshold);
        assert_eq!(snap.transitions[0][1], 1);
    }
}

#[test]
fn per_request_counting_charges_one_failure_per_request_per_worker() {
    let clock = ManualClock::new();
    let a = Breaker::new("a", settings(3, 1, 60), None);
    let b = Breaker::new("b", settings(3, 1, 60), None);
    // Two requests, each failing five attempts on `a` and one on `b`.
    for _ in 0..2 {
        let mut charges = RequestCharges::default();
        for _ in 0..5 {
            let t = a.admit(&clock).unwrap();
            charges.record(&a, t, Outcome::Failure(FailureReason::Status), &clock);
        }
        let t = b.admit(&clock).unwrap();
        charges.record(&b, t, Outcome::Failure(FailureReason::Connect), &clock);
    }
    assert_eq!(a.snapshot().consecutive_failures, 2);
    assert_eq!(a.snapshot().failures_total(), 2);
    assert_eq!(b.snapshot().consecutive_failures, 2);
    assert_eq!(
        a.state(),
        State::Closed,
        "ten failed attempts, two failed requests"
    );
}

#[test]
fn per_request_counting_still_records_successes_after_a_failure() {
    let clock = ManualClock::new();
    let a = Breaker::new("a", settings(3, 1, 60), None);
    let mut charges = RequestCharges::default();
    charges.record(
        &a,
        inflight(&a),
        Outcome::Failure(FailureReason::Status),
        &clock,
    );
    charges.record(&a, inflight(&a), Outcome::Success, &clock);
    let snap = a.snapshot();
    assert_eq!(
        (
            snap.successes,
            snap.failures_total(),
            snap.consecutive_failures
        ),
        (1, 1, 0)
    );
}

#[test]
fn open_worker_is_not_selectable() {
    let (b, clock) = open_breaker(2, 1, 60);
    assert!(!b.is_available(&clock));
    assert_eq!(b.admit(&clock), None);
    clock.advance(59 * SECOND);
    assert!(!b.is_available(&clock));
    assert_eq!(b.state(), State::Open);
}

#[test]
fn open_moves_to_half_open_on_first_check_after_timeout() {
    let recorder = Arc::new(Recorder::default());
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(1, 2, 30), Some(recorder.clone()));
    fail(&b, &clock);
    clock.advance(30 * SECOND);
    assert_eq!(b.state(), State::Open, "nothing checked yet");
    assert!(b.is_available(&clock));
    assert_eq!(b.state(), State::HalfOpen);
    assert_eq!(
        recorder.moves(),
        vec![
            (
                State::Closed,
                State::Open,
                TransitionReason::FailureThreshold
            ),
            (State::Open, State::HalfOpen, TransitionReason::OpenTimeout),
        ]
    );
    assert_eq!(
        b.snapshot().health_readmissions,
        0,
        "a timeout is not a readmission"
    );
}

#[test]
fn open_timeout_is_driven_by_poll_without_traffic() {
    let (b, clock) = open_breaker(1, 1, 10);
    let deadline = b.poll(&clock).expect("open circuits report their deadline");
    assert_eq!(deadline, nanos(10 * SECOND));
    clock.set(deadline - 1);
    assert_eq!(b.poll(&clock), Some(deadline));
    clock.set(deadline);
    assert_eq!(b.poll(&clock), None);
    assert_eq!(b.state(), State::HalfOpen);
}

#[test]
fn half_open_takes_traffic_unthrottled() {
    let (b, clock) = open_breaker(1, 3, 1);
    clock.advance(SECOND);
    let tickets: Vec<_> = (0..100).map(|_| b.admit(&clock)).collect();
    assert!(tickets.iter().all(Option::is_some));
    assert_eq!(b.state(), State::HalfOpen);
}

#[test]
fn half_open_closes_after_success_threshold_consecutive_successes() {
    let (b, clock) = open_breaker(1, 3, 1);
    clock.advance(SECOND);
    assert!(b.is_available(&clock));
    succeed(&b, &clock);
    succeed(&b, &clock);
    assert_eq!(b.state(), State::HalfOpen);
    assert_eq!(b.snapshot().consecutive_successes, 2);
    succeed(&b, &clock);
    assert_eq!(b.state(), State::Closed);
    let snap = b.snapshot();
    assert_eq!(
        (snap.consecutive_failures, snap.consecutive_successes),
        (0, 0)
    );
}

#[test]
fn half_open_any_failure_reopens_for_a_full_timeout() {
    let (b, clock) = open_breaker(1, 3, 20);
    clock.advance(20 * SECOND);
    assert!(b.is_available(&clock));
    succeed(&b, &clock);
    succeed(&b, &clock);
    b.record(
        inflight(&b),
        Outcome::Failure(FailureReason::Timeout),
        &clock,
    );
    assert_eq!(b.state(), State::Open);
    clock.advance(19 * SECOND);
    assert!(
        !b.is_available(&clock),
        "the timeout started over at the failure"
    );
    clock.advance(SECOND);
    assert!(b.is_available(&clock));
    assert_eq!(b.snapshot().transitions[2][1], 1);
}

#[test]
fn half_open_pushback_records_nothing_and_cannot_close() {
    let (b, clock) = open_breaker(1, 1, 1);
    clock.advance(SECOND);
    assert!(b.is_available(&clock));
    let before = b.snapshot();
    for _ in 0..10 {
        b.record(inflight(&b), Outcome::Ignored, &clock);
    }
    assert_eq!(b.state(), State::HalfOpen);
    assert_eq!(b.snapshot(), before);
}

#[test]
fn pushback_records_nothing_in_closed_state() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(2, 1, 1), None);
    fail(&b, &clock);
    let before = b.snapshot();
    b.record(inflight(&b), Outcome::Ignored, &clock);
    assert_eq!(
        b.snapshot(),
        before,
        "not a success: the failure run continues"
    );
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
}

#[test]
fn promotion_moves_open_to_half_open_at_once_and_counts_a_readmission() {
    let recorder = Arc::new(Recorder::default());
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(1, 2, 60), Some(recorder.clone()));
    fail(&b, &clock);
    clock.advance(SECOND);
    b.promote(&clock);
    assert_eq!(b.state(), State::HalfOpen);
    assert_eq!(b.snapshot().health_readmissions, 1);
    assert_eq!(
        recorder.moves()[1],
        (State::Open, State::HalfOpen, TransitionReason::Promotion)
    );
    // The trial is the timeout's trial: success threshold closes it ...
    succeed(&b, &clock);
    succeed(&b, &clock);
    assert_eq!(b.state(), State::Closed);
}

#[test]
fn promotion_trial_failure_reopens_for_a_full_timeout() {
    let (b, clock) = open_breaker(1, 2, 60);
    b.promote(&clock);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
    clock.advance(59 * SECOND);
    assert!(!b.is_available(&clock));
    clock.advance(SECOND);
    assert!(b.is_available(&clock));
    assert_eq!(b.snapshot().health_readmissions, 1);
}

#[test]
fn promotion_resets_the_failure_count_of_a_closed_circuit() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(3, 1, 60), None);
    fail(&b, &clock);
    fail(&b, &clock);
    b.promote(&clock);
    assert_eq!(b.snapshot().consecutive_failures, 0);
    fail(&b, &clock);
    assert_eq!(
        b.state(),
        State::Closed,
        "the outage's failures are forgotten"
    );
    assert_eq!(b.snapshot().health_readmissions, 0);
}

#[test]
fn promotion_of_a_half_open_circuit_changes_nothing() {
    let (b, clock) = open_breaker(1, 3, 1);
    clock.advance(SECOND);
    assert!(b.is_available(&clock));
    succeed(&b, &clock);
    let before = b.snapshot();
    b.promote(&clock);
    assert_eq!(b.snapshot(), before);
}

#[test]
fn disable_circuit_breaker_never_opens_but_still_counts() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(u32::MAX, 3, 60), None);
    for _ in 0..10_000 {
        fail(&b, &clock);
    }
    assert_eq!(b.state(), State::Closed);
    assert_eq!(b.snapshot().failures_total(), 10_000);
}

#[test]
fn per_worker_override_thresholds_and_timeout_apply() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(10, 3, 60), None);
    b.set_settings(settings(2, 1, 5));
    fail(&b, &clock);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
    clock.advance(5 * SECOND);
    assert!(b.is_available(&clock));
    succeed(&b, &clock);
    assert_eq!(b.state(), State::Closed);
}

#[test]
fn half_open_max_inflight_limits_concurrent_probes() {
    let clock = ManualClock::new();
    let s = Settings {
        half_open_max_inflight: 1,
        ..settings(1, 2, 1)
    };
    let b = Breaker::new("w", s, None);
    fail(&b, &clock);
    clock.advance(SECOND);
    let probe = b.admit(&clock).expect("one probe");
    assert!(!b.is_available(&clock), "the only slot is taken");
    assert_eq!(b.admit(&clock), None);
    b.record(probe, Outcome::Success, &clock);
    let probe = b.admit(&clock).expect("the slot came back");
    b.record(probe, Outcome::Success, &clock);
    assert_eq!(b.state(), State::Closed);
    // Closed admits without limit.
    assert!((0..5).all(|_| b.admit(&clock).is_some()));
}

#[test]
fn half_open_probe_slot_of_an_older_epoch_is_not_returned_twice() {
    let clock = ManualClock::new();
    let s = Settings {
        half_open_max_inflight: 1,
        ..settings(1, 1, 1)
    };
    let b = Breaker::new("w", s, None);
    fail(&b, &clock);
    clock.advance(SECOND);
    let stale = b.admit(&clock).unwrap();
    fail(&b, &clock); // reopens: the slot count restarts
    clock.advance(SECOND);
    let fresh = b.admit(&clock).unwrap();
    b.record(stale, Outcome::Ignored, &clock);
    assert_eq!(
        b.snapshot().half_open_inflight,
        1,
        "the stale ticket freed nothing"
    );
    assert_eq!(b.admit(&clock), None);
    b.record(fresh, Outcome::Ignored, &clock);
    assert_eq!(b.snapshot().half_open_inflight, 0);
}

#[test]
fn window_mode_opens_on_failures_within_the_window() {
    let clock = ManualClock::new();
    let s = Settings {
        window: Some(WindowSettings {
            duration: Duration::from_secs(10),
            min_calls: 4,
        }),
        ..settings(3, 1, 5)
    };
    let b = Breaker::new("w", s, None);
    // Failures interleaved with successes still count inside the window.
    fail(&b, &clock);
    succeed(&b, &clock);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Closed);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
}

#[test]
fn window_mode_forgets_failures_older_than_the_window() {
    let clock = ManualClock::new();
    let s = Settings {
        window: Some(WindowSettings {
            duration: Duration::from_secs(10),
            min_calls: 1,
        }),
        ..settings(3, 1, 5)
    };
    let b = Breaker::new("w", s, None);
    fail(&b, &clock);
    fail(&b, &clock);
    clock.advance(11 * SECOND);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Closed);
    fail(&b, &clock);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
}

#[test]
fn window_mode_needs_the_minimum_number_of_calls() {
    let clock = ManualClock::new();
    let s = Settings {
        window: Some(WindowSettings {
            duration: Duration::from_secs(10),
            min_calls: 5,
        }),
        ..settings(2, 1, 5)
    };
    let b = Breaker::new("w", s, None);
    for _ in 0..4 {
        fail(&b, &clock);
    }
    assert_eq!(b.state(), State::Closed);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
}

#[test]
fn every_transition_is_counted_and_observed_once() {
    let recorder = Arc::new(Recorder::default());
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(1, 1, 1), Some(recorder.clone()));
    for _ in 0..3 {
        fail(&b, &clock); // closed -> open
        clock.advance(SECOND);
        b.poll(&clock); // open -> half-open
        succeed(&b, &clock); // half-open -> closed
    }
    let snap = b.snapshot();
    assert_eq!(snap.transitions_total(), 9);
    assert_eq!(recorder.moves().len(), 9);
    assert_eq!(snap.transitions[0][1], 3);
    assert_eq!(snap.transitions[1][2], 3);
    assert_eq!(snap.transitions[2][0], 3);
}

#[test]
fn concurrent_checks_make_exactly_one_open_to_half_open_per_timeout() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 200;
    let clock = Arc::new(ManualClock::new());
    let recorder = Arc::new(Recorder::default());
    let b = Arc::new(Breaker::new("w", settings(3, 2, 1), Some(recorder.clone())));
    let barrier = Arc::new(std::sync::Barrier::new(THREADS));
    let admitted = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let (b, clock, barrier, admitted) =
                (b.clone(), clock.clone(), barrier.clone(), admitted.clone());
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    barrier.wait();
                    // Every thread drives the breaker open, ...
                    for _ in 0..3 {
                        b.record(
                            inflight(&b),
                            Outcome::Failure(FailureReason::Status),
                            &*clock,
                        );
                    }
                    barrier.wait();
                    if i == 0 {
                        clock.advance(SECOND);
                    }
                    barrier.wait();
                    // ... and all race to move it to half-open at once.
                    if b.admit(&*clock).is_some() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    barrier.wait();
                    if round % 2 == 0 {
                        b.record(inflight(&b), Outcome::Success, &*clock);
                        b.record(inflight(&b), Outcome::Success, &*clock);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let snap = b.snapshot();
    let observed = recorder.moves();
    assert_eq!(
        snap.transitions_total() as usize,
        observed.len(),
        "no lost or doubled events"
    );
    assert_eq!(
        snap.transitions[1][2] as usize, ROUNDS,
        "one open→half-open per timeout"
    );
    assert_eq!(admitted.load(Ordering::Relaxed), ROUNDS * THREADS);
    // The observed sequence is a valid walk of the state machine.
    for pair in observed.windows(2) {
        assert_eq!(pair[0].1, pair[1].0, "events arrive in state order");
    }
}

#[test]
fn concurrent_outcomes_lose_no_counts() {
    let clock = Arc::new(ManualClock::new());
    let b = Arc::new(Breaker::new("w", settings(u32::MAX, 3, 60), None));
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let (b, clock) = (b.clone(), clock.clone());
            std::thread::spawn(move || {
                for n in 0..10_000 {
                    let t = b.admit(&*clock).unwrap();
                    let o = if (n + i) % 3 == 0 {
                        Outcome::Failure(FailureReason::Status)
                    } else {
                        Outcome::Success
                    };
                    b.record(t, o, &*clock);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let snap = b.snapshot();
    assert_eq!(snap.successes + snap.failures_total(), 40_000);
}

fn degraded(pct: u32, secs: u64) -> Settings {
    Settings {
        degraded: Some(DegradedSettings {
            traffic_pct: pct,
            duration: Duration::from_secs(secs),
        }),
        ..settings(1, 2, 5)
    }
}

fn to_degraded(b: &Breaker, clock: &ManualClock) {
    fail(b, clock);
    clock.advance(5 * SECOND);
    assert!(b.is_available(clock));
    succeed(b, clock);
    succeed(b, clock);
    assert_eq!(b.state(), State::Degraded);
}

#[test]
fn degraded_follows_a_successful_trial_and_closes_after_its_period() {
    let recorder = Arc::new(Recorder::default());
    let clock = ManualClock::new();
    let b = Breaker::new("w", degraded(25, 30), Some(recorder.clone()));
    to_degraded(&b, &clock);
    assert_eq!(State::Degraded.gauge(), 3);
    clock.advance(29 * SECOND);
    assert_eq!(
        b.poll(&clock),
        Some(nanos(35 * SECOND)),
        "degraded reports its end"
    );
    clock.advance(SECOND);
    assert_eq!(b.poll(&clock), None);
    assert_eq!(b.state(), State::Closed);
    assert_eq!(
        recorder.moves()[2..],
        [
            (
                State::HalfOpen,
                State::Degraded,
                TransitionReason::TrialSucceeded
            ),
            (
                State::Degraded,
                State::Closed,
                TransitionReason::DegradedElapsed
            ),
        ]
    );
    assert!(b.snapshot().degraded_enabled);
}

#[test]
fn degraded_failure_reopens_the_circuit() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", degraded(50, 30), None);
    to_degraded(&b, &clock);
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
    assert_eq!(
        b.snapshot().transitions[State::Degraded as usize][State::Open as usize],
        1
    );
}

#[test]
fn degraded_admits_its_share_of_admissions_not_of_checks() {
    for pct in [10, 25, 50, 90] {
        let clock = ManualClock::new();
        let b = Breaker::new("w", degraded(pct, 3600), None);
        to_degraded(&b, &clock);
        let admitted = (0..1000)
            .filter(|_| b.admit(&clock).map(|t| b.cancel(t)).is_some())
            .count();
        assert_eq!(admitted, pct as usize * 10, "{pct}%");
        // Eligibility checks spend no share: a policy may check any number
        // of times per request.
        assert!((0..10).all(|_| b.is_available(&clock)));
    }
}

#[test]
fn half_open_probe_interval_spreads_the_trial_in_time() {
    let clock = ManualClock::new();
    let s = Settings {
        half_open_probe_interval: Duration::from_millis(500),
        ..settings(1, 3, 5)
    };
    let b = Breaker::new("w", s, None);
    fail(&b, &clock);
    clock.advance(5 * SECOND);
    assert!(b.admit(&clock).is_some(), "the first probe goes at once");
    assert!(!b.is_available(&clock));
    assert_eq!(b.admit(&clock), None);
    clock.advance(Duration::from_millis(499));
    assert_eq!(b.admit(&clock), None);
    clock.advance(Duration::from_millis(1));
    assert!(b.admit(&clock).is_some());
    assert_eq!(b.admit(&clock), None);
}

#[test]
fn slow_successes_are_failures_with_reason_slow() {
    let c = Classifier::default().with_slow_ttfb(Some(Duration::from_millis(1000)));
    assert_eq!(
        c.body_rules()
            .with_latency(Outcome::Success, Duration::from_millis(999)),
        Outcome::Success
    );
    assert_eq!(
        c.body_rules()
            .with_latency(Outcome::Success, Duration::from_millis(1001)),
        Outcome::Failure(FailureReason::Slow)
    );
    assert_eq!(
        c.body_rules().with_latency(Outcome::Ignored, SECOND * 9),
        Outcome::Ignored
    );
    let off = Classifier::default();
    assert_eq!(
        off.body_rules().with_latency(Outcome::Success, SECOND * 60),
        Outcome::Success
    );
}

// ---- property test against a reference model ----

/// What a request does to the breaker: admitted now, then ended later (in
/// any order with other requests) with an outcome or cancelled without one.
#[derive(Debug, Clone)]
enum Op {
    /// A request asks for admission; admitted ones join the bag in flight.
    Admit,
    /// The in-flight request at this index (modulo the bag) ends so.
    Success(usize),
    Failure(usize),
    Pushback(usize),
    /// The client left: the ticket is handed back without an outcome.
    Cancel(usize),
    Advance(u64),
    Promote,
    Poll,
    Check,
    Override(u32, u32, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::Admit),
        4 => any::<usize>().prop_map(Op::Success),
        4 => any::<usize>().prop_map(Op::Failure),
        1 => any::<usize>().prop_map(Op::Pushback),
        2 => any::<usize>().prop_map(Op::Cancel),
        3 => (0u64..8_000).prop_map(Op::Advance),
        1 => Just(Op::Promote),
        1 => Just(Op::Poll),
        2 => Just(Op::Check),
        1 => (1u32..5, 1u32..4, 1u64..6).prop_map(|(f, s, t)| Op::Override(f, s, t)),
    ]
}

/// The half-open in-flight limit the model runs with.
const MODEL_MAX_INFLIGHT: u32 = 2;

/// A request in flight, as the model sees it.
#[derive(Debug, Clone, Copy)]
struct ModelTicket {
    epoch: u64,
    probe: bool,
}

/// The document's rules written as plainly as possible, plus epochs (only
/// an outcome admitted in the current state decides) and the half-open
/// in-flight limit (a slot comes back once, on outcome or cancellation).
#[derive(Debug)]
struct Model {
    state: State,
    epoch: u64,
    inflight: u32,
    cf: u32,
    cs: u32,
    opened_at: u64,
    failure_threshold: u32,
    success_threshold: u32,
    timeout_ms: u64,
    transitions: [[u64; 4]; 4],
    readmissions: u64,
    successes: u64,
    failures: u64,
}

impl Model {
    fn new() -> Self {
        Self {
            state: State::Closed,
            epoch: 0,
            inflight: 0,
            cf: 0,
            cs: 0,
            opened_at: 0,
            failure_threshold: 3,
            success_threshold: 2,
            timeout_ms: 2000,
            transitions: [[0; 4]; 4],
            readmissions: 0,
            successes: 0,
            failures: 0,
        }
    }

    fn go(&mut self, to: State, now_ms: u64) {
        self.transitions[self.state as usize][to as usize] += 1;
        match to {
            State::Closed | State::HalfOpen | State::Degraded => (self.cf, self.cs) = (0, 0),
            State::Open => (self.cs, self.opened_at) = (0, now_ms),
        }
        self.state = to;
        self.epoch += 1;
        self.inflight = 0;
    }

    fn check(&mut self, now_ms: u64) {
        if self.state == State::Open && now_ms >= self.opened_at + self.timeout_ms {
            self.go(State::HalfOpen, now_ms);
        }
    }

    fn admit(&mut self, now_ms: u64) -> Option<ModelTicket> {
        self.check(now_ms);
        match self.state {
            State::Open => None,
            State::HalfOpen if self.inflight >= MODEL_MAX_INFLIGHT => None,
            State::HalfOpen => {
                self.inflight += 1;
                Some(ModelTicket {
                    epoch: self.epoch,
                    probe: true,
                })
            }
            _ => Some(ModelTicket {
                epoch: self.epoch,
                probe: false,
            }),
        }
    }

    fn release(&mut self, t: ModelTicket) {
        if t.probe && t.epoch == self.epoch {
            self.inflight -= 1;
        }
    }

    fn success(&mut self, t: ModelTicket, now_ms: u64) {
        self.release(t);
        self.successes += 1;
        if t.epoch != self.epoch {
            return;
        }
        self.cf = 0;
        self.cs += 1;
        if self.state == State::HalfOpen && self.cs >= self.success_threshold {
            self.go(State::Closed, now_ms);
        }
    }

    fn failure(&mut self, t: ModelTicket, now_ms: u64) {
        self.release(t);
        self.failures += 1;
        if t.epoch != self.epoch {
            return;
        }
        self.cs = 0;
        self.cf += 1;
        match self.state {
            State::Closed if self.cf >= self.failure_threshold => self.go(State::Open, now_ms),
            State::HalfOpen => self.go(State::Open, now_ms),
            _ => {}
        }
    }

    fn promote(&mut self, now_ms: u64) {
        match self.state {
            State::Open => {
                self.readmissions += 1;
                self.go(State::HalfOpen, now_ms);
            }
            State::Closed => self.cf = 0,
            State::HalfOpen | State::Degraded => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn breaker_matches_reference_model(ops in proptest::collection::vec(op(), 1..200)) {
        let clock = ManualClock::new();
        let b = Breaker::new(
            "w",
            Settings { half_open_max_inflight: MODEL_MAX_INFLIGHT, ..settings(3, 2, 2) },
            None,
        );
        let mut m = Model::new();
        // Requests in flight: the breaker's tickets beside the model's.
        let mut bag: Vec<(Ticket, ModelTicket)> = Vec::new();
        let mut now_ms = 0;
        for op in &ops {
            match *op {
                Op::Admit => {
                    let real = b.admit(&clock);
                    let model = m.admit(now_ms);
                    prop_assert_eq!(real.is_some(), model.is_some(), "admission");
                    if let (Some(r), Some(t)) = (real, model) {
                        prop_assert_eq!(u64::from(r.epoch), t.epoch & u64::from(u32::MAX));
                        prop_assert_eq!(r.probe, t.probe);
                        bag.push((r, t));
                    }
                }
                Op::Success(i) | Op::Failure(i) | Op::Pushback(i) | Op::Cancel(i) => {
                    if bag.is_empty() {
                        continue;
                    }
                    let (real, model) = bag.swap_remove(i % bag.len());
                    match *op {
                        Op::Success(_) => {
                            b.record(real, Outcome::Success, &clock);
                            m.success(model, now_ms);
                        }
                        Op::Failure(_) => {
                            b.record(real, Outcome::Failure(FailureReason::Status), &clock);
                            m.failure(model, now_ms);
                        }
                        Op::Pushback(_) => {
                            b.record(real, Outcome::Ignored, &clock);
                            m.release(model);
                        }
                        _ => {
                            b.cancel(real);
                            m.release(model);
                        }
                    }
                }
                Op::Advance(ms) => {
                    now_ms += ms;
                    clock.advance(Duration::from_millis(ms));
                }
                Op::Promote => {
                    b.promote(&clock);
                    m.promote(now_ms);
                }
                Op::Poll => {
                    b.poll(&clock);
                    m.check(now_ms);
                }
                Op::Check => {
                    let available = b.is_available(&clock);
                    m.check(now_ms);
                    let expected = match m.state {
                        State::Open => false,
                        State::HalfOpen => m.inflight < MODEL_MAX_INFLIGHT,
                        _ => true,
                    };
                    prop_assert_eq!(available, expected);
                }
                Op::Override(f, s, t) => {
                    b.set_settings(Settings {
                        half_open_max_inflight: MODEL_MAX_INFLIGHT,
                        ..settings(f, s, t)
                    });
                    (m.failure_threshold, m.success_threshold, m.timeout_ms) = (f, s, t * 1000);
                }
            }
            let snap = b.snapshot();
            prop_assert_eq!(snap.state, m.state);
            prop_assert_eq!(snap.half_open_inflight, m.inflight, "probe slots");
            prop_assert_eq!(snap.consecutive_failures, m.cf);
            prop_assert_eq!(snap.consecutive_successes, m.cs);
            prop_assert_eq!(snap.transitions, m.transitions);
            prop_assert_eq!(snap.health_readmissions, m.readmissions);
            prop_assert_eq!(snap.successes, m.successes);
            prop_assert_eq!(snap.failures_total(), m.failures);
        }
    }
}

// ---- cancellation, epochs and edges ----

fn half_open_with_limit(max: u32) -> (Breaker, ManualClock) {
    let clock = ManualClock::new();
    let s = Settings {
        half_open_max_inflight: max,
        ..settings(1, 3, 1)
    };
    let b = Breaker::new("w", s, None);
    fail(&b, &clock);
    clock.advance(SECOND);
    assert!(b.is_available(&clock));
    (b, clock)
}

#[test]
fn ticket_cancelled_without_outcome_returns_its_probe_slot_and_records_nothing() {
    let (b, clock) = half_open_with_limit(1);
    let before = b.snapshot();
    for _ in 0..10 {
        // A client that disconnects before its worker answers.
        let probe = b.admit(&clock).expect("the slot is free again");
        assert!(!b.is_available(&clock), "the only slot is taken");
        b.cancel(probe);
    }
    assert_eq!(b.snapshot(), before, "no sample, no leaked slot");
    assert_eq!(b.state(), State::HalfOpen);
}

#[test]
fn outcome_admitted_in_an_older_epoch_counts_but_decides_nothing() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(1, 1, 1), None);
    // Long streams admitted while closed.
    let (ok, bad) = (b.admit(&clock).unwrap(), b.admit(&clock).unwrap());
    fail(&b, &clock);
    clock.advance(SECOND);
    assert!(b.is_available(&clock));
    assert_eq!(b.state(), State::HalfOpen);
    b.record(ok, Outcome::Success, &clock);
    assert_eq!(b.state(), State::HalfOpen, "no trial request passed yet");
    b.record(bad, Outcome::Failure(FailureReason::Status), &clock);
    assert_eq!(b.state(), State::HalfOpen, "nor did one fail");
    let snap = b.snapshot();
    assert_eq!(
        (snap.successes, snap.failures_total()),
        (1, 2),
        "totals keep both"
    );
    let trial = b.admit(&clock).unwrap();
    b.record(trial, Outcome::Success, &clock);
    assert_eq!(
        b.state(),
        State::Closed,
        "the trial's own success closes it"
    );
}

#[test]
fn retry_on_the_same_worker_after_a_transition_is_charged_again() {
    let clock = ManualClock::new();
    let b = Breaker::new("w", settings(1, 2, 1), None);
    let mut charges = RequestCharges::default();
    // Charged while closed (and opening the circuit) ...
    let t = b.admit(&clock).unwrap();
    charges.record(&b, t, Outcome::Failure(FailureReason::Status), &clock);
    assert_eq!(b.state(), State::Open);
    clock.advance(SECOND);
    // ... then retried onto the now half-open worker, failing there.
    let t = b.admit(&clock).expect("half-open admits");
    charges.record(&b, t, Outcome::Failure(FailureReason::Status), &clock);
    assert_eq!(b.state(), State::Open, "any failure reopens it");
    assert_eq!(b.snapshot().transitions[2][1], 1);
}

#[test]
fn consecutive_counters_saturate_instead_of_overflowing() {
    let clock = ManualClock::new();
    // `--disable-circuit-breaker`: the threshold is u32::MAX.
    let b = Breaker::new("w", settings(u32::MAX, 1, 1), None);
    b.consecutive_failures
        .store(u32::MAX - 1, Ordering::Relaxed);
    for _ in 0..3 {
        fail(&b, &clock);
    }
    assert_eq!(b.snapshot().consecutive_failures, u32::MAX);
    assert_eq!(
        b.state(),
        State::Open,
        "the maximum is reached, not wrapped"
    );
    let b = Breaker::new("w", settings(3, 1, 1), None);
    b.consecutive_successes.store(u32::MAX, Ordering::Relaxed);
    succeed(&b, &clock);
    assert_eq!(b.snapshot().consecutive_successes, u32::MAX);
}

#[test]
fn half_open_max_inflight_cannot_spill_into_the_epoch_bits() {
    let b = Breaker::new(
        "w",
        Settings {
            half_open_max_inflight: u32::MAX,
            ..settings(1, 1, 1)
        },
        None,
    );
    assert_eq!(b.settings().half_open_max_inflight, MAX_HALF_OPEN_INFLIGHT);
    assert_eq!(
        u64::from(MAX_HALF_OPEN_INFLIGHT) * INFLIGHT_ONE,
        INFLIGHT_MASK & !(INFLIGHT_ONE - 1),
        "the largest count fills the field exactly"
    );
}

#[test]
fn losing_the_inflight_race_keeps_the_intervals_probe() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 3000;
    let clock = Arc::new(ManualClock::new());
    let s = Settings {
        half_open_max_inflight: 2,
        half_open_probe_interval: Duration::from_millis(100),
        ..settings(1, u32::MAX, 1)
    };
    let b = Arc::new(Breaker::new("w", s, None));
    fail(&b, &clock);
    clock.advance(SECOND);
    assert!(b.is_available(&*clock));
    let barrier = Arc::new(std::sync::Barrier::new(THREADS + 1));
    let probes = Arc::new(StdMutex::new(Vec::<Ticket>::new()));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (b, clock, barrier, probes) =
                (b.clone(), clock.clone(), barrier.clone(), probes.clone());
            std::thread::spawn(move || {
                for _ in 0..ROUNDS {
                    barrier.wait();
                    if let Some(t) = b.admit(&*clock) {
                        probes.lock().unwrap().push(t);
                    }
                    barrier.wait();
                }
            })
        })
        .collect();
    for round in 0..ROUNDS {
        clock.advance(Duration::from_millis(100));
        // Last round's probe ends while the others race for this one, so
        // their compare-and-swap on the state word can lose.
        let previous = probes.lock().unwrap().pop();
        barrier.wait();
        if let Some(t) = previous {
            b.record(t, Outcome::Ignored, &*clock);
        }
        barrier.wait();
        assert_eq!(
            probes.lock().unwrap().len(),
            1,
            "round {round}: exactly one probe per interval"
        );
    }
    for h in handles {
        h.join().unwrap();
    }
    for t in probes.lock().unwrap().drain(..) {
        b.cancel(t);
    }
    assert_eq!(b.snapshot().half_open_inflight, 0);
}

#[test]
fn held_open_circuit_waits_for_the_promotion_not_the_timeout() {
    let (b, clock) = open_breaker(1, 1, 1);
    b.hold_open(true);
    clock.advance(10 * SECOND);
    assert!(
        !b.is_available(&clock),
        "NotReady: the timer does not readmit"
    );
    assert_eq!(b.poll(&clock), None, "no timer needs to run");
    assert_eq!(b.state(), State::Open);
    b.hold_open(false);
    b.promote(&clock);
    assert_eq!(b.state(), State::HalfOpen);
    assert_eq!(b.snapshot().health_readmissions, 1, "the promotion did it");
}

#[test]
fn observed_handshakes_move_the_breaker_like_requests() {
    let clock = ManualClock::new();
    let b = Breaker::new("http://w", settings(3, 2, 5), None);
    // Closed: refused and timed-out handshakes count toward the threshold,
    // each under its own reason; an established one ends the run.
    b.observe(Outcome::Failure(FailureReason::L4Refused), &clock);
    b.observe(Outcome::Success, &clock);
    b.observe(Outcome::Failure(FailureReason::L4Refused), &clock);
    b.observe(Outcome::Failure(FailureReason::L4Timeout), &clock);
    assert_eq!(b.state(), State::Closed);
    b.observe(Outcome::Failure(FailureReason::L4Refused), &clock);
    assert_eq!(b.state(), State::Open);
    let snap = b.snapshot();
    assert_eq!(snap.failures[FailureReason::L4Refused as usize], 3);
    assert_eq!(snap.failures[FailureReason::L4Timeout as usize], 1);
    assert_eq!(snap.successes, 1);

    // Half-open: established handshakes are trials that passed (no probe
    // slot is taken: the datapath bounds the trials itself) ...
    clock.advance(5 * SECOND);
    assert!(b.poll(&clock).is_none());
    assert_eq!(b.state(), State::HalfOpen);
    b.observe(Outcome::Success, &clock);
    b.observe(Outcome::Success, &clock);
    assert_eq!(b.state(), State::Closed);
    assert_eq!(b.snapshot().half_open_inflight, 0);

    // ... and one refused handshake in half-open reopens.
    for _ in 0..3 {
        b.observe(Outcome::Failure(FailureReason::L4Timeout), &clock);
    }
    clock.advance(5 * SECOND);
    b.poll(&clock);
    assert_eq!(b.state(), State::HalfOpen);
    b.observe(Outcome::Failure(FailureReason::L4Refused), &clock);
    assert_eq!(b.state(), State::Open);
}

#[test]
fn fleet_open_holds_past_the_timeout_and_releases_to_half_open() {
    let clock = ManualClock::new();
    let seen = Arc::new(Recorder::default());
    let b = Breaker::new("http://w", settings(10, 2, 5), Some(seen.clone()));
    assert!(b.fleet_open(&clock));
    assert_eq!(b.state(), State::Open);
    assert!(b.snapshot().fleet_opened);
    // Its own timeout does not end a fleet isolation, and no timer runs.
    clock.advance(60 * SECOND);
    assert!(!b.is_available(&clock));
    assert!(b.admit(&clock).is_none());
    assert_eq!(b.poll(&clock), None);
    assert_eq!(b.state(), State::Open);
    // Nor does a promotion back to Ready.
    b.promote(&clock);
    assert_eq!(b.state(), State::Open);

    assert!(b.fleet_release(&clock));
    assert_eq!(b.state(), State::HalfOpen);
    assert!(!b.snapshot().fleet_opened);
    assert!(!b.fleet_release(&clock), "released once");
    succeed(&b, &clock);
    succeed(&b, &clock);
    assert_eq!(b.state(), State::Closed, "the usual success threshold");
    assert_eq!(
        seen.moves(),
        vec![
            (State::Closed, State::Open, TransitionReason::Fleet),
            (State::Open, State::HalfOpen, TransitionReason::FleetCleared),
            (
                State::HalfOpen,
                State::Closed,
                TransitionReason::TrialSucceeded
            ),
        ]
    );
    assert_eq!(
        b.snapshot().transitions[State::Closed as usize][State::Open as usize],
        1
    );
}

#[test]
fn fleet_never_overrides_the_replicas_own_verdict() {
    // Open by its own failures: the fleet neither reopens nor releases it,
    // and its own timeout still runs.
    let (b, clock) = open_breaker(1, 1, 5);
    assert!(!b.fleet_open(&clock));
    assert!(!b.snapshot().fleet_opened);
    assert!(!b.fleet_release(&clock));
    assert_eq!(b.state(), State::Open);
    clock.advance(5 * SECOND);
    assert!(b.is_available(&clock));
    assert_eq!(b.state(), State::HalfOpen);
    // Half-open on its own trial: left alone too.
    assert!(!b.fleet_open(&clock));
    assert_eq!(b.state(), State::HalfOpen);
}

#[test]
fn a_failed_trial_after_the_fleet_release_is_own_evidence() {
    let clock = ManualClock::new();
    let b = Breaker::new("http://w", settings(10, 2, 5), None);
    assert!(b.fleet_open(&clock));
    assert!(b.fleet_release(&clock));
    fail(&b, &clock);
    assert_eq!(b.state(), State::Open);
    assert!(!b.snapshot().fleet_opened, "reopened by its own trial");
    // Its own open period ends on its own timeout.
    clock.advance(5 * SECOND);
    assert!(b.is_available(&clock));
    assert_eq!(b.state(), State::HalfOpen);
}

#[test]
fn fleet_release_of_a_not_ready_worker_waits_for_the_promotion() {
    let clock = ManualClock::new();
    let b = Breaker::new("http://w", settings(10, 1, 5), None);
    assert!(b.fleet_open(&clock));
    b.hold_open(true);
    assert!(!b.fleet_release(&clock));
    assert_eq!(b.state(), State::Open);
    assert!(!b.snapshot().fleet_opened, "no longer the fleet's");
    b.hold_open(false);
    b.promote(&clock);
    assert_eq!(b.state(), State::HalfOpen);
}

#[test]
fn fleet_open_is_bounded_by_the_open_gate_like_any_opening() {
    struct Deny;
    impl OpenGate for Deny {
        fn may_open(&self) -> bool {
            false
        }
    }
    let clock = ManualClock::new();
    let b = Breaker::new("http://w", settings(10, 1, 5), None);
    b.set_open_gate(Arc::new(Deny));
    assert!(!b.fleet_open(&clock));
    assert_eq!(b.state(), State::Closed);
}

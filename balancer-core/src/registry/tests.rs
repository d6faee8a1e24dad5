//! The registry's rules that need more than one layer: attempts and their
//! breaker tickets, health and the breaker, the open-period timer.

use std::time::Duration;

use super::*;
use crate::breaker::{FailureReason, Settings};
use crate::clock::{ManualClock, Nanos, nanos};

const SECOND: Duration = Duration::from_secs(1);

fn registry(settings: Settings, clock: Arc<dyn Clock>) -> (Arc<Registry>, Arc<Worker>) {
    let registry = Registry::new(
        RegistryConfig {
            breaker: BreakerDefaults {
                settings,
                ..BreakerDefaults::default()
            },
            health: HealthThresholds {
                failure: 1,
                success: 1,
            },
            hash_rings: false,
            max_open_percent: 100,
            removed_grace: DEFAULT_REMOVED_GRACE,
        },
        clock,
    );
    let worker = registry
        .add(&WorkerSpec::from_url("http://127.0.0.1:9"))
        .unwrap();
    (registry, worker)
}

fn fail(w: &Arc<Worker>, clock: &dyn Clock) {
    let mut a = w.try_attempt(clock).expect("admitted");
    a.record(
        &mut RequestCharges::default(),
        Outcome::Failure(FailureReason::Status),
        clock,
    );
}

#[tokio::test]
async fn attempt_dropped_mid_send_returns_its_probe_slot_and_records_nothing() {
    let clock = Arc::new(ManualClock::new());
    let settings = Settings {
        failure_threshold: 1,
        open_timeout: SECOND,
        half_open_max_inflight: 1,
        ..Settings::default()
    };
    let (_registry, w) = registry(settings, clock.clone());
    fail(&w, &*clock);
    clock.advance(SECOND);
    assert!(w.breaker.is_available(&*clock), "on trial");
    let before = w.breaker.snapshot();
    for _ in 0..5 {
        let attempt = w.try_attempt(&*clock).expect("the trial's slot is free");
        // The upstream send that never answers, and a client that leaves:
        // the request's future is dropped at its `.await`.
        let send = tokio::spawn(async move {
            let _held = attempt;
            std::future::pending::<()>().await;
        });
        tokio::task::yield_now().await;
        assert_eq!(w.breaker.snapshot().half_open_inflight, 1);
        assert_eq!(w.inflight(), 1);
        send.abort();
        assert!(send.await.unwrap_err().is_cancelled());
        assert_eq!(w.breaker.snapshot().half_open_inflight, 0, "slot returned");
        assert_eq!(w.inflight(), 0);
    }
    let after = w.breaker.snapshot();
    assert_eq!(after, before, "nothing recorded, still half-open");
    assert_eq!(after.state, State::HalfOpen);
}

/// Time as tokio's paused clock tells it, with real deadlines, so the
/// registry's timers run on virtual time that the test advances.
#[derive(Debug)]
struct PausedClock {
    origin: tokio::time::Instant,
}

impl Clock for PausedClock {
    fn now(&self) -> Nanos {
        nanos(self.origin.elapsed())
    }

    fn deadline(&self, at: Nanos) -> Option<std::time::Instant> {
        Some((self.origin + Duration::from_nanos(at)).into_std())
    }
}

#[tokio::test(start_paused = true)]
async fn changing_cb_timeout_rearms_the_open_timer() {
    let clock = Arc::new(PausedClock {
        origin: tokio::time::Instant::now(),
    });
    let settings = Settings {
        failure_threshold: 1,
        open_timeout: 60 * SECOND,
        ..Settings::default()
    };
    let (registry, w) = registry(settings, clock.clone());
    fail(&w, &*clock);
    assert_eq!(w.breaker.state(), State::Open);
    let shorter = Resilience {
        cb_timeout_secs: Some(5),
        ..Resilience::default()
    };
    registry.patch_resilience(&w.id, &shorter).unwrap();
    tokio::time::advance(6 * SECOND).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        w.breaker.state(),
        State::HalfOpen,
        "the timer woke at the new deadline, with no request to check it"
    );
}

#[test]
fn not_ready_worker_reaches_half_open_only_through_its_promotion() {
    let clock = Arc::new(ManualClock::new());
    let settings = Settings {
        failure_threshold: 1,
        open_timeout: SECOND,
        ..Settings::default()
    };
    let (registry, w) = registry(settings, clock.clone());
    fail(&w, &*clock);
    assert_eq!(
        registry.observe_health(&w, false, &"status 503"),
        Some(HealthChange::Demoted)
    );
    clock.advance(10 * SECOND);
    assert_eq!(w.breaker.poll(&*clock), None);
    assert_eq!(w.breaker.state(), State::Open, "the timer waits for health");
    assert_eq!(
        registry.observe_health(&w, true, &"passed"),
        Some(HealthChange::Promoted)
    );
    let snap = w.breaker.snapshot();
    assert_eq!(snap.state, State::HalfOpen);
    assert_eq!(snap.health_readmissions, 1, "the promotion readmitted it");
    assert_eq!(snap.transitions[1][2], 1, "one move to half-open");
}

/// `n` workers of model `m` that open at their first failure, under
/// `--cb-max-open-percent max_open_percent`, each sent one failure.
fn isolate_all(n: u8, max_open_percent: u32) -> Vec<Arc<Worker>> {
    let clock = Arc::new(ManualClock::new());
    let registry = Registry::new(
        RegistryConfig {
            breaker: BreakerDefaults {
                settings: Settings {
                    failure_threshold: 1,
                    ..Settings::default()
                },
                ..BreakerDefaults::default()
            },
            health: HealthThresholds {
                failure: 1,
                success: 1,
            },
            hash_rings: false,
            max_open_percent,
            removed_grace: DEFAULT_REMOVED_GRACE,
        },
        clock.clone(),
    );
    let specs: Vec<_> = (1..=n)
        .map(|i| WorkerSpec {
            model: Some("m".into()),
            ..WorkerSpec::from_url(&format!("http://127.0.0.{i}:8000"))
        })
        .collect();
    let workers = registry.add_all(&specs).unwrap();
    for w in &workers {
        fail(w, &*clock);
    }
    workers
}

fn open_count(workers: &[Arc<Worker>]) -> usize {
    workers
        .iter()
        .filter(|w| w.breaker.state() == State::Open)
        .count()
}

#[test]
fn max_open_percent_keeps_a_share_of_the_fleet_out_of_isolation() {
    let workers = isolate_all(4, 50);
    assert_eq!(
        open_count(&workers),
        2,
        "half of the model's four workers at most"
    );
    let held = &workers[3];
    assert_eq!(
        held.breaker.snapshot().consecutive_failures,
        1,
        "still counting"
    );
}

#[test]
fn one_isolation_is_always_allowed_however_small_the_share() {
    let workers = isolate_all(3, 10);
    assert_eq!(open_count(&workers), 1, "10% of three workers is still one");
}

#[test]
fn credentials_never_show_in_messages_even_without_a_scheme() {
    for url in [
        "user:pw@127.0.0.1:8000",
        "ftp://user:pw@h",
        "http://user:pw@h/path",
    ] {
        let error = WorkerAddress::parse(url).unwrap_err().to_string();
        assert!(!error.contains("pw"), "{error}");
    }
}

#[test]
fn escaped_credentials_are_decoded_for_the_worker() {
    let address = WorkerAddress::parse("http://u:p%2Fw%40x@127.0.0.1:8000").unwrap();
    // base64("u:p/w@x")
    assert_eq!(address.basic_auth.unwrap().expose(), "Basic dTpwL3dAeA==");
    assert_eq!(address.base, "http://127.0.0.1:8000");
}

#[test]
fn validating_a_worker_url_does_no_dns_lookup() {
    let literal = WorkerAddress::parse("http://[::1]:8000").unwrap();
    assert!(literal.is_resolved());
    assert_eq!(literal.resolve(), Some("[::1]:8000".parse().unwrap()));
    let named = WorkerAddress::parse("http://localhost:8000").unwrap();
    assert!(!named.is_resolved(), "no lookup while validating");
    assert_eq!(named.resolve().map(|a| a.port()), Some(8000));
    assert!(named.is_resolved(), "kept after the first lookup");
}

#[test]
fn https_workers_default_to_port_443_and_keep_their_scheme() {
    let address = WorkerAddress::parse("https://u:p@127.0.0.1").unwrap();
    assert!(address.is_tls());
    assert_eq!(address.base, "https://127.0.0.1");
    assert_eq!(address.resolve(), Some("127.0.0.1:443".parse().unwrap()));
    let plain = WorkerAddress::parse("http://127.0.0.1").unwrap();
    assert!(!plain.is_tls());
    assert_eq!(plain.resolve(), Some("127.0.0.1:80".parse().unwrap()));
    let error = WorkerAddress::parse("ftp://127.0.0.1")
        .unwrap_err()
        .to_string();
    assert!(error.contains("http:// or https://"), "{error}");
}

/// The `worker_cb_state` lines of a scrape.
fn cb_state_series(registry: &Registry) -> Vec<String> {
    let mut out = String::new();
    crate::metrics::MetricsSource::render(
        registry,
        &mut crate::metrics::Writer::new(&mut out, "b"),
    );
    out.lines()
        .filter(|l| l.starts_with("b_worker_cb_state{"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_removed_workers_series_go_after_the_grace_period() {
    let clock = Arc::new(ManualClock::new());
    let (registry, worker) = registry(Settings::default(), clock.clone());
    registry.remove(&worker);
    let removed = vec![r#"b_worker_cb_state{worker="http://127.0.0.1:9"} -1"#.to_owned()];
    assert_eq!(cb_state_series(&registry), removed);
    clock.advance(DEFAULT_REMOVED_GRACE - SECOND);
    assert_eq!(
        cb_state_series(&registry),
        removed,
        "kept for the grace period"
    );
    clock.advance(SECOND);
    assert!(cb_state_series(&registry).is_empty(), "gone after it");
    assert!(registry.removed_urls().is_empty(), "and forgotten");
}

#[test]
fn removed_workers_are_remembered_up_to_a_bound_the_oldest_forgotten_first() {
    let clock = Arc::new(ManualClock::new());
    let (registry, first) = registry(Settings::default(), clock.clone());
    registry.remove(&first);
    // Pod churn: a new address each time, all within the grace period.
    for port in 10..10 + MAX_REMOVED as u16 {
        let worker = registry
            .add(&WorkerSpec::from_url(&format!("http://127.0.0.1:{port}")))
            .unwrap();
        registry.remove(&worker);
    }
    let remembered = registry.removed_urls();
    assert_eq!(remembered.len(), MAX_REMOVED);
    assert!(
        !remembered.iter().any(|u| &**u == "http://127.0.0.1:9"),
        "the oldest went first"
    );
    assert_eq!(cb_state_series(&registry).len(), MAX_REMOVED);
}

#[test]
fn an_empty_model_is_refused_naming_the_field() {
    for model in ["", "  "] {
        let spec = WorkerSpec {
            model: Some(model.into()),
            ..WorkerSpec::from_url("http://127.0.0.1:9")
        };
        assert_eq!(spec.validate().unwrap_err().field, "model", "{model:?}");
    }
    let unnamed = WorkerSpec::from_url("http://127.0.0.1:9");
    assert!(
        unnamed.validate().is_ok(),
        "no model: learned from the worker"
    );
}

#[test]
fn a_model_is_refusable_only_once_every_worker_names_its_models() {
    let clock = Arc::new(ManualClock::new());
    let (registry, first) = registry(Settings::default(), clock);
    let second = registry
        .add(&WorkerSpec::from_url("http://127.0.0.1:10"))
        .unwrap();
    // Nothing learned yet: any worker may serve any model.
    assert!(!registry.fleet().none_serves("m"));
    registry.learn_models(&first, vec!["m".to_owned()]);
    assert!(
        !registry.fleet().none_serves("other"),
        "the second worker's models are not known"
    );
    registry.learn_models(&second, vec!["n".to_owned()]);
    let fleet = registry.fleet();
    assert!(fleet.none_serves("other"));
    assert!(!fleet.none_serves("m") && !fleet.none_serves("n"));
}

#[test]
fn a_workers_5xx_answers_are_counted_by_status() {
    let (registry, worker) = registry(Settings::default(), Arc::new(ManualClock::new()));
    worker.server_error(503);
    worker.server_error(503);
    worker.server_error(599);
    worker.server_error(429);
    worker.server_error(200);
    let mut out = String::new();
    crate::metrics::MetricsSource::render(
        &*registry,
        &mut crate::metrics::Writer::new(&mut out, "b"),
    );
    let series: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("b_worker_server_errors_total{"))
        .collect();
    let line = |status: u16, n: u64| {
        format!(
            r#"b_worker_server_errors_total{{worker="http://127.0.0.1:9",status="{status}"}} {n}"#
        )
    };
    assert_eq!(
        series,
        [
            line(500, 0),
            line(502, 0),
            line(503, 2),
            line(504, 0),
            line(599, 1)
        ]
    );
}

#[test]
fn each_model_of_a_worker_has_its_join_series() {
    let (registry, worker) = registry(Settings::default(), Arc::new(ManualClock::new()));
    registry.learn_models(&worker, vec!["m1".to_owned(), "m2".to_owned()]);
    let mut out = String::new();
    crate::metrics::MetricsSource::render(
        &*registry,
        &mut crate::metrics::Writer::new(&mut out, "b"),
    );
    let series: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("b_worker_models{"))
        .collect();
    assert_eq!(
        series,
        [
            r#"b_worker_models{worker="http://127.0.0.1:9",model="m1"} 1"#,
            r#"b_worker_models{worker="http://127.0.0.1:9",model="m2"} 1"#,
        ]
    );
}

//! One scrape of the same five per-worker families over 64 workers, written
//! by hand with the agent's `Writer` against the `prometheus` crate: the
//! state lives in the workers' atomics, so the crate's path copies it into
//! its metric families at scrape time and then encodes them. A third row is
//! the registry's whole exposition, for scale.
//!
//! `cargo bench -p balancer-core --bench exposition` (or `cargo xtask bench breaker`).

use std::hint::black_box;
use std::sync::Arc;

use balancer_core::breaker::{FailureReason, Outcome, Settings};
use balancer_core::clock::ManualClock;
use balancer_core::health::HealthThresholds;
use balancer_core::metrics::{MetricsSource, Writer};
use balancer_core::registry::{DEFAULT_REMOVED_GRACE, Registry, RegistryConfig};
use balancer_core::spec::{BreakerDefaults, WorkerSpec};
use criterion::{Criterion, criterion_group, criterion_main};
use prometheus::{Encoder, GaugeVec, IntCounterVec, Opts, TextEncoder};

const WORKERS: usize = 64;

fn fleet() -> Arc<Registry> {
    let clock = Arc::new(ManualClock::new());
    let registry = Registry::new(
        RegistryConfig {
            breaker: BreakerDefaults {
                settings: Settings::default(),
                ..BreakerDefaults::default()
            },
            health: HealthThresholds {
                failure: 3,
                success: 2,
            },
            hash_rings: false,
            max_open_percent: 100,
            removed_grace: DEFAULT_REMOVED_GRACE,
        },
        clock.clone(),
    );
    let specs: Vec<_> = (0..WORKERS)
        .map(|i| WorkerSpec::from_url(&format!("http://10.0.{}.{}:8000", i / 250, i % 250)))
        .collect();
    for w in registry.add_all(&specs).expect("valid") {
        for outcome in [Outcome::Success, Outcome::Failure(FailureReason::Status)] {
            let t = w.breaker.admit(&*clock).expect("closed");
            w.breaker.record(t, outcome, &*clock);
        }
    }
    registry
}

/// The same series through the `prometheus` crate: families registered
/// once, values copied in from the breakers on every scrape.
struct Crate {
    registry: prometheus::Registry,
    state: GaugeVec,
    outcomes: IntCounterVec,
    failures: IntCounterVec,
    consecutive: GaugeVec,
    inflight: GaugeVec,
}

impl Crate {
    fn new() -> Self {
        let registry = prometheus::Registry::new();
        let gauge = |name: &str, labels: &[&str]| {
            let g = GaugeVec::new(Opts::new(name, "help"), labels).unwrap();
            registry.register(Box::new(g.clone())).unwrap();
            g
        };
        let counter = |name: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, "help"), labels).unwrap();
            registry.register(Box::new(c.clone())).unwrap();
            c
        };
        Self {
            state: gauge("p_worker_cb_state", &["worker"]),
            outcomes: counter("p_worker_cb_outcomes_total", &["worker", "outcome"]),
            failures: counter("p_worker_cb_failures_total", &["worker", "reason"]),
            consecutive: gauge("p_worker_cb_consecutive_failures", &["worker"]),
            inflight: gauge("p_worker_requests_inflight", &["worker"]),
            registry,
        }
    }

    fn scrape(&self, fleet: &Registry) -> String {
        for w in &fleet.fleet().workers {
            let s = w.breaker.snapshot();
            let url = &*w.url;
            self.state
                .with_label_values(&[url])
                .set(s.state.gauge() as f64);
            let ok = self.outcomes.with_label_values(&[url, "success"]);
            ok.inc_by(s.successes - ok.get());
            let bad = self.outcomes.with_label_values(&[url, "failure"]);
            bad.inc_by(s.failures_total() - bad.get());
            for reason in FailureReason::ALL {
                let c = self.failures.with_label_values(&[url, reason.as_str()]);
                c.inc_by(s.failures[reason as usize] - c.get());
            }
            self.consecutive
                .with_label_values(&[url])
                .set(f64::from(s.consecutive_failures));
            self.inflight
                .with_label_values(&[url])
                .set(f64::from(w.inflight()));
        }
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .unwrap();
        String::from_utf8(buf).unwrap()
    }
}

/// The same five families as [`Crate`], through the agent's writer.
fn by_hand(fleet: &Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let mut w = Writer::new(&mut out, "p");
    let fleet = fleet.fleet();
    let snaps: Vec<_> = fleet
        .workers
        .iter()
        .map(|wk| (wk, wk.breaker.snapshot()))
        .collect();
    w.family("worker_cb_state", "gauge", "help");
    for (wk, s) in &snaps {
        w.sample(
            "worker_cb_state",
            &[("worker", &wk.url)],
            s.state.gauge() as f64,
        );
    }
    w.family("worker_cb_outcomes_total", "counter", "help");
    for (wk, s) in &snaps {
        for (outcome, n) in [("success", s.successes), ("failure", s.failures_total())] {
            w.sample(
                "worker_cb_outcomes_total",
                &[("worker", &wk.url), ("outcome", outcome)],
                n as f64,
            );
        }
    }
    w.family("worker_cb_failures_total", "counter", "help");
    for (wk, s) in &snaps {
        for reason in FailureReason::ALL {
            w.sample(
                "worker_cb_failures_total",
                &[("worker", &wk.url), ("reason", reason.as_str())],
                s.failures[reason as usize] as f64,
            );
        }
    }
    w.family("worker_cb_consecutive_failures", "gauge", "help");
    for (wk, s) in &snaps {
        w.sample(
            "worker_cb_consecutive_failures",
            &[("worker", &wk.url)],
            f64::from(s.consecutive_failures),
        );
    }
    w.family("worker_requests_inflight", "gauge", "help");
    for (wk, _) in &snaps {
        w.sample(
            "worker_requests_inflight",
            &[("worker", &wk.url)],
            f64::from(wk.inflight()),
        );
    }
    out
}

fn bench(c: &mut Criterion) {
    let registry = fleet();
    c.bench_function("scrape 5 families x 64 workers/hand-written writer", |b| {
        b.iter(|| black_box(by_hand(&registry)))
    });
    let via_crate = Crate::new();
    c.bench_function("scrape 5 families x 64 workers/prometheus crate", |b| {
        b.iter(|| black_box(via_crate.scrape(&registry)))
    });
    c.bench_function("scrape 64 workers/whole registry exposition", |b| {
        b.iter(|| {
            let mut out = String::with_capacity(64 * 1024);
            registry.render(&mut Writer::new(&mut out, "p"));
            black_box(out)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

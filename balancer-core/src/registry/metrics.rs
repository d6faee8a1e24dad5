//! The registry's series: per-worker breaker state, transitions, outcomes and
//! failure reasons, health, draining, in-flight, selections, first-byte
//! latency and the load the workers report (queue, cache, scrapes, sheds), read at scrape time from the workers' own atomics so the request
//! path pays nothing for them and a scrape never disagrees with the state
//! machine. Counter series are published at zero from the moment a worker
//! exists, because dashboards take `increase()` over them. Reads only.

use crate::breaker::{FailureReason, Snapshot, State};
use crate::health::Health;
use crate::load::ReportedLoad;
use crate::metrics::{MetricsSource, Writer};

use super::Registry;

/// The breaker transitions that can happen, published at zero.
const TRANSITIONS: [(State, State); 4] = [
    (State::Closed, State::Open),
    (State::Open, State::HalfOpen),
    (State::HalfOpen, State::Closed),
    (State::HalfOpen, State::Open),
];
/// Published too when the degraded state is on.
const DEGRADED_TRANSITIONS: [(State, State); 3] = [
    (State::HalfOpen, State::Degraded),
    (State::Degraded, State::Closed),
    (State::Degraded, State::Open),
];

impl MetricsSource for Registry {
    fn render(&self, w: &mut Writer<'_>) {
        let registry = self;
        let fleet = registry.fleet();
        let snaps: Vec<_> = fleet
            .workers
            .iter()
            .map(|wk| (wk, wk.breaker.snapshot()))
            .collect();

        w.family(
        "worker_cb_state",
        "gauge",
        "Circuit breaker state: 0 closed, 1 open, 2 half-open, 3 degraded; -1 for a grace period after the worker is removed.",
    );
        for (wk, s) in &snaps {
            w.sample(
                "worker_cb_state",
                &[("worker", &wk.url)],
                s.state.gauge() as f64,
            );
        }
        for url in registry.removed_urls() {
            w.sample("worker_cb_state", &[("worker", &url)], -1.0);
        }

        w.family(
            "worker_cb_transitions_total",
            "counter",
            "Circuit breaker state transitions.",
        );
        for (wk, s) in &snaps {
            let extra: &[(State, State)] = if s.degraded_enabled {
                &DEGRADED_TRANSITIONS
            } else {
                &[]
            };
            for &(from, to) in TRANSITIONS.iter().chain(extra) {
                w.sample(
                    "worker_cb_transitions_total",
                    &[
                        ("worker", &wk.url),
                        ("from", from.as_str()),
                        ("to", to.as_str()),
                    ],
                    s.transitions[from as usize][to as usize] as f64,
                );
            }
        }

        w.family(
            "worker_cb_outcomes_total",
            "counter",
            "Recorded outcomes; capacity pushback records nothing.",
        );
        for (wk, s) in &snaps {
            w.sample(
                "worker_cb_outcomes_total",
                &[("worker", &wk.url), ("outcome", "success")],
                s.successes as f64,
            );
            w.sample(
                "worker_cb_outcomes_total",
                &[("worker", &wk.url), ("outcome", "failure")],
                s.failures_total() as f64,
            );
        }

        w.family(
            "worker_cb_failures_total",
            "counter",
            "Recorded failures by reason.",
        );
        for (wk, s) in &snaps {
            for reason in FailureReason::ALL {
                w.sample(
                    "worker_cb_failures_total",
                    &[("worker", &wk.url), ("reason", reason.as_str())],
                    s.failures[reason as usize] as f64,
                );
            }
        }

        type Gauge = (&'static str, &'static str, fn(&Snapshot) -> f64);
        let gauges: [Gauge; 2] = [
            (
                "worker_cb_consecutive_failures",
                "Current consecutive-failure count.",
                |s| f64::from(s.consecutive_failures),
            ),
            (
                "worker_cb_consecutive_successes",
                "Current consecutive-success count.",
                |s| f64::from(s.consecutive_successes),
            ),
        ];
        for (name, help, value) in gauges {
            w.family(name, "gauge", help);
            for (wk, s) in &snaps {
                w.sample(name, &[("worker", &wk.url)], value(s));
            }
        }

        w.family(
            "worker_cb_health_readmissions_total",
            "counter",
            "Open circuits moved to half-open by a promotion back to Ready.",
        );
        for (wk, s) in &snaps {
            w.sample(
                "worker_cb_health_readmissions_total",
                &[("worker", &wk.url)],
                s.health_readmissions as f64,
            );
        }

        w.family(
            "worker_health",
            "gauge",
            "1 when the worker is Ready, 0 when NotReady.",
        );
        for wk in &fleet.workers {
            let ready = wk.health() == Health::Ready;
            w.sample(
                "worker_health",
                &[("worker", &wk.url)],
                f64::from(u8::from(ready)),
            );
        }
        w.family(
            "worker_draining",
            "gauge",
            "1 while the worker drains before removal.",
        );
        for wk in &fleet.workers {
            w.sample(
                "worker_draining",
                &[("worker", &wk.url)],
                f64::from(u8::from(wk.is_draining())),
            );
        }
        w.family(
            "worker_requests_inflight",
            "gauge",
            "Attempts in flight to the worker.",
        );
        for wk in &fleet.workers {
            w.sample(
                "worker_requests_inflight",
                &[("worker", &wk.url)],
                f64::from(wk.inflight()),
            );
        }
        w.family(
            "worker_ttfb_seconds",
            "histogram",
            "Time to first byte (first chunk of a stream) of attempts that went through.",
        );
        for wk in &fleet.workers {
            wk.ttfb
                .render(w, "worker_ttfb_seconds", &[("worker", &wk.url)]);
        }
        w.family(
            "worker_models",
            "gauge",
            "1 for each model a worker serves: join it on `worker` to group any worker series by model (e.g. every worker of a model open).",
        );
        for wk in &fleet.workers {
            for model in wk.models().iter() {
                w.sample(
                    "worker_models",
                    &[("worker", &wk.url), ("model", model)],
                    1.0,
                );
            }
        }
        w.family(
            "worker_server_errors_total",
            "counter",
            "The worker's 5xx answers, by status (500, 502, 503 and 504 published from zero; others once seen).",
        );
        for wk in &fleet.workers {
            for (status, count) in wk.server_errors() {
                if count > 0 || matches!(status, 500 | 502 | 503 | 504) {
                    w.sample(
                        "worker_server_errors_total",
                        &[("worker", &wk.url), ("status", &status.to_string())],
                        count as f64,
                    );
                }
            }
        }
        w.family(
            "worker_selected_total",
            "counter",
            "Attempts sent to the worker.",
        );
        for wk in &fleet.workers {
            w.sample(
                "worker_selected_total",
                &[("worker", &wk.url)],
                wk.selected_total() as f64,
            );
        }
        render_load(registry, w);
    }
}

/// The load the workers report (`--load-monitor-interval-ms`): gauges only
/// for a fresh report, so a stale value never reads as current; the scrape
/// and shed counters from the moment a worker exists.
fn render_load(registry: &Registry, w: &mut Writer<'_>) {
    let fleet = registry.fleet();
    let now = registry.clock().now();
    let reports: Vec<_> = fleet
        .workers
        .iter()
        .map(|wk| (wk, wk.reported_load(now)))
        .collect();
    w.family(
        "worker_load_reported",
        "gauge",
        "1 while the worker's own load report is fresh and used, 0 while its load is the gateway's in-flight count.",
    );
    for (wk, report) in &reports {
        w.sample(
            "worker_load_reported",
            &[("worker", &wk.url)],
            f64::from(u8::from(report.is_some())),
        );
    }
    type Gauge = (&'static str, &'static str, fn(&ReportedLoad) -> Option<f64>);
    let gauges: [Gauge; 3] = [
        (
            "worker_reported_requests_waiting",
            "Requests waiting in the worker's queue, as it reports them.",
            |l| Some(f64::from(l.waiting)),
        ),
        (
            "worker_reported_requests_running",
            "Requests running on the worker, as it reports them.",
            |l| Some(f64::from(l.running)),
        ),
        (
            "worker_reported_kv_cache_usage",
            "The worker's KV-cache occupancy from 0 to 1, as it reports it.",
            |l| l.cache_usage,
        ),
    ];
    for (name, help, value) in gauges {
        w.family(name, "gauge", help);
        for (wk, report) in &reports {
            if let Some(v) = report.as_ref().and_then(value) {
                w.sample(name, &[("worker", &wk.url)], v);
            }
        }
    }
    w.family(
        "worker_load_scrapes_total",
        "counter",
        "Scrapes of the worker's /metrics for its load, by outcome; none of them touches its breaker.",
    );
    for (wk, _) in &reports {
        for (outcome, count) in wk.load_cell().scrapes() {
            w.sample(
                "worker_load_scrapes_total",
                &[("worker", &wk.url), ("outcome", outcome)],
                count as f64,
            );
        }
    }
    w.family(
        "worker_overload_sheds_total",
        "counter",
        "Requests sent to another worker because this one reported more waiting requests than --worker-overload-waiting-requests.",
    );
    for (wk, _) in &reports {
        w.sample(
            "worker_overload_sheds_total",
            &[("worker", &wk.url)],
            wk.load_cell().sheds() as f64,
        );
    }
}

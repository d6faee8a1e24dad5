//! The registry's series: per-worker breaker state, transitions, outcomes and
//! failure reasons, health, draining, in-flight, selections and first-byte
//! latency, read at scrape time from the workers' own atomics so the request
//! path pays nothing for them and a scrape never disagrees with the state
//! machine. Counter series are published at zero from the moment a worker
//! exists, because dashboards take `increase()` over them. Reads only.

use crate::breaker::{FailureReason, Snapshot, State};
use crate::health::Health;
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
    }
}

//! Prometheus metrics: what is counted on the request path, and the text the
//! metrics listener serves.
//!
//! Owns the gateway-wide counters and histograms. Per-worker and breaker
//! series are not counted here: they are read at scrape time straight from the
//! workers' own atomics (breaker snapshots, in-flight counts), so the request
//! path pays nothing extra for them and a scrape can never disagree with the
//! state machine. Series that dashboards take `increase()` over are published
//! at zero from the moment a worker exists.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus::{Encoder, Histogram, HistogramOpts, TextEncoder};

use crate::admission::Admission;
use crate::breaker::{FailureReason, State};
use crate::error::ErrorCode;
use crate::tokens::Tokens;
use crate::worker::Registry;

/// Gateway-wide counters, bumped on the request path with plain atomics.
pub struct GatewayStats {
    prefix: String,
    upstream: Box<[AtomicU64]>,
    gateway: [AtomicU64; ErrorCode::ALL.len()],
    retries: AtomicU64,
    retries_exhausted: AtomicU64,
    /// `--fallback-model` pairs and how often each was taken.
    fallbacks: Vec<(String, String, AtomicU64)>,
    pub request_duration: Histogram,
    pub ttfb: Histogram,
    histograms: prometheus::Registry,
    /// The XDP dataplane's series, when it runs.
    dataplane: OnceLock<Arc<dyn MetricsSource>>,
}

/// Series kept outside the gateway (the XDP dataplane's kernel counters),
/// read at scrape time and written under the gateway's prefix.
pub trait MetricsSource: Send + Sync {
    fn render(&self, w: &mut Writer<'_>);
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

impl GatewayStats {
    pub fn new(prefix: &str, fallbacks: &[(String, String)]) -> anyhow::Result<Self> {
        let histogram = |name: &str, help: &str| {
            Histogram::with_opts(
                HistogramOpts::new(format!("{prefix}_{name}"), help)
                    .buckets(LATENCY_BUCKETS.to_vec()),
            )
        };
        let request_duration = histogram(
            "http_request_duration_seconds",
            "Time from request arrival to the last byte of the response.",
        )?;
        let ttfb = histogram(
            "http_ttfb_seconds",
            "Time from request arrival to the response headers.",
        )?;
        let histograms = prometheus::Registry::new();
        histograms.register(Box::new(request_duration.clone()))?;
        histograms.register(Box::new(ttfb.clone()))?;
        Ok(Self {
            prefix: prefix.to_owned(),
            upstream: (0..600).map(|_| AtomicU64::new(0)).collect(),
            gateway: Default::default(),
            retries: AtomicU64::new(0),
            retries_exhausted: AtomicU64::new(0),
            fallbacks: fallbacks
                .iter()
                .map(|(f, t)| (f.clone(), t.clone(), AtomicU64::new(0)))
                .collect(),
            request_duration,
            ttfb,
            histograms,
            dataplane: OnceLock::new(),
        })
    }

    /// Adds the dataplane's series to every scrape (once; later calls are
    /// ignored).
    pub fn set_dataplane(&self, source: Arc<dyn MetricsSource>) {
        let _ = self.dataplane.set(source);
    }

    /// A worker's response reached the client.
    #[inline]
    pub fn upstream_response(&self, status: u16) {
        if let Some(c) = self.upstream.get(usize::from(status)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The gateway answered by itself.
    #[inline]
    pub fn gateway_response(&self, code: ErrorCode) {
        self.gateway[code as usize].fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub fn retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    pub fn fallback(&self, from: &str, to: &str) {
        if let Some((_, _, n)) = self.fallbacks.iter().find(|(f, t, _)| f == from && t == to) {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[inline]
    pub fn retries_exhausted(&self) {
        self.retries_exhausted.fetch_add(1, Ordering::Relaxed);
    }

    /// The whole exposition: gateway series, per-worker and breaker series,
    /// admission.
    pub fn render(
        &self,
        registry: &Registry,
        admission: Option<&Admission>,
        tokens: &Tokens,
    ) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let mut w = Writer {
            out: &mut out,
            prefix: &self.prefix,
        };
        self.render_gateway(&mut w);
        self.render_llm(&mut w, tokens);
        render_workers(&mut w, registry);
        if let Some(a) = admission {
            render_admission(&mut w, a);
        }
        if let Some(dataplane) = self.dataplane.get() {
            dataplane.render(&mut w);
        }
        let mut buf = Vec::new();
        if TextEncoder::new()
            .encode(&self.histograms.gather(), &mut buf)
            .is_ok()
        {
            out.push_str(&String::from_utf8_lossy(&buf));
        }
        out
    }

    fn render_llm(&self, w: &mut Writer<'_>, tokens: &Tokens) {
        w.family(
            "fallbacks_total",
            "counter",
            "Requests sent to a fallback model.",
        );
        for (from, to, n) in &self.fallbacks {
            w.sample(
                "fallbacks_total",
                &[("from", from), ("to", to)],
                n.load(Ordering::Relaxed) as f64,
            );
        }
        let models = tokens.snapshot();
        let mut names: Vec<_> = models.keys().collect();
        names.sort();
        w.family(
            "tokens_total",
            "counter",
            "Tokens reported in responses' usage, by kind.",
        );
        for m in &names {
            let t = &models[*m];
            for (kind, v) in [("prompt", &t.prompt), ("completion", &t.completion)] {
                w.sample(
                    "tokens_total",
                    &[("model", m), ("kind", kind)],
                    v.load(Ordering::Relaxed) as f64,
                );
            }
        }
        w.family(
            "token_budget_exceeded_total",
            "counter",
            "Requests that found their model's token budget spent.",
        );
        for m in names
            .iter()
            .filter(|m| models[**m].budget_limit().is_some())
        {
            w.sample(
                "token_budget_exceeded_total",
                &[("model", m)],
                models[*m].budget_exceeded.load(Ordering::Relaxed) as f64,
            );
        }
    }

    fn render_gateway(&self, w: &mut Writer<'_>) {
        w.family(
            "http_responses_total",
            "counter",
            "Responses sent to clients, by status; source is worker or gateway, code the gateway's error code.",
        );
        for (status, c) in self.upstream.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n > 0 {
                let status = status.to_string();
                w.sample(
                    "http_responses_total",
                    &[("status", &status), ("source", "worker"), ("code", "")],
                    n as f64,
                );
            }
        }
        for code in ErrorCode::ALL {
            let status = code.status().as_u16().to_string();
            w.sample(
                "http_responses_total",
                &[
                    ("status", &status),
                    ("source", "gateway"),
                    ("code", code.as_str()),
                ],
                self.gateway[code as usize].load(Ordering::Relaxed) as f64,
            );
        }
        w.family("retries_total", "counter", "Attempts after the first.");
        w.sample(
            "retries_total",
            &[],
            self.retries.load(Ordering::Relaxed) as f64,
        );
        w.family(
            "retries_exhausted_total",
            "counter",
            "Requests whose every attempt failed.",
        );
        w.sample(
            "retries_exhausted_total",
            &[],
            self.retries_exhausted.load(Ordering::Relaxed) as f64,
        );
    }
}

/// A latency histogram on plain atomics, cheap enough to keep one per worker
/// and observe on the request path.
#[derive(Debug)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            buckets: Default::default(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }
}

impl LatencyHistogram {
    #[inline]
    pub fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, w: &mut Writer<'_>, name: &str, labels: &[(&str, &str)]) {
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (i, bound) in LATENCY_BUCKETS.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let le = bound.to_string();
            let mut l = labels.to_vec();
            l.push(("le", &le));
            w.sample(&bucket, &l, cumulative as f64);
        }
        let count = self.count() as f64;
        let mut l = labels.to_vec();
        l.push(("le", "+Inf"));
        w.sample(&bucket, &l, count);
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        w.sample(&format!("{name}_sum"), labels, sum);
        w.sample(&format!("{name}_count"), labels, count);
    }
}

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

fn render_workers(w: &mut Writer<'_>, registry: &Registry) {
    let fleet = registry.fleet();
    let snaps: Vec<_> = fleet
        .workers
        .iter()
        .map(|wk| (wk, wk.breaker.snapshot()))
        .collect();

    w.family(
        "worker_cb_state",
        "gauge",
        "Circuit breaker state: 0 closed, 1 open, 2 half-open, 3 degraded; -1 after the worker is removed.",
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

    type Gauge = (
        &'static str,
        &'static str,
        fn(&crate::breaker::Snapshot) -> f64,
    );
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
        let ready = wk.health() == crate::health::Health::Ready;
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

fn render_admission(w: &mut Writer<'_>, a: &Admission) {
    let s = a.stats();
    for (name, help, v) in [
        (
            "admission_limit",
            "--max-concurrent-requests.",
            s.limit as f64,
        ),
        (
            "admission_inflight",
            "Admitted requests in flight.",
            s.inflight as f64,
        ),
        (
            "admission_queue_depth",
            "Requests waiting for admission.",
            s.queued as f64,
        ),
    ] {
        w.family(name, "gauge", help);
        w.sample(name, &[], v);
    }
    w.family(
        "admission_rejections_total",
        "counter",
        "Requests shed by admission control.",
    );
    w.sample(
        "admission_rejections_total",
        &[("reason", "queue_full")],
        s.rejected_queue_full as f64,
    );
    w.sample(
        "admission_rejections_total",
        &[("reason", "queue_timeout")],
        s.rejected_queue_timeout as f64,
    );
}

/// Writes the Prometheus text format; every name gets the `--metrics-prefix`.
pub struct Writer<'a> {
    out: &'a mut String,
    prefix: &'a str,
}

impl Writer<'_> {
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let p = self.prefix;
        let _ = writeln!(
            self.out,
            "# HELP {p}_{name} {help}\n# TYPE {p}_{name} {kind}"
        );
    }

    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        let _ = write!(self.out, "{}_{name}", self.prefix);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"");
                for c in v.chars() {
                    match c {
                        '\\' => self.out.push_str("\\\\"),
                        '"' => self.out.push_str("\\\""),
                        '\n' => self.out.push_str("\\n"),
                        c => self.out.push(c),
                    }
                }
                self.out.push('"');
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

//! The request path's own series: responses by status and source, retries,
//! fallbacks, request and first-byte latency.
//!
//! Bumped with plain atomics on the request path and read at scrape time
//! through [`MetricsSource`]. Per-worker and breaker series are the
//! registry's, not these.

use std::sync::atomic::{AtomicU64, Ordering};

use balancer_core::metrics::{Histogram, MetricsSource, Writer};

use super::answer::ErrorCode;

/// Gateway-wide counters, bumped on the request path with plain atomics.
pub struct GatewayStats {
    upstream: Box<[AtomicU64]>,
    gateway: [AtomicU64; ErrorCode::ALL.len()],
    retries: AtomicU64,
    retries_exhausted: AtomicU64,
    /// `--fallback-model` pairs and how often each was taken.
    fallbacks: Vec<(String, String, AtomicU64)>,
    pub request_duration: Histogram,
    pub ttfb: Histogram,
}

impl GatewayStats {
    pub fn new(fallbacks: &[(String, String)]) -> Self {
        Self {
            upstream: (0..600).map(|_| AtomicU64::new(0)).collect(),
            gateway: Default::default(),
            retries: AtomicU64::new(0),
            retries_exhausted: AtomicU64::new(0),
            fallbacks: fallbacks
                .iter()
                .map(|(f, t)| (f.clone(), t.clone(), AtomicU64::new(0)))
                .collect(),
            request_duration: Histogram::default(),
            ttfb: Histogram::default(),
        }
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

    fn render_fallbacks(&self, w: &mut Writer<'_>) {
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

impl MetricsSource for GatewayStats {
    fn render(&self, w: &mut Writer<'_>) {
        self.render_gateway(w);
        self.render_fallbacks(w);
        for (name, help, h) in [
            (
                "http_request_duration_seconds",
                "Time from request arrival to the last byte of the response.",
                &self.request_duration,
            ),
            (
                "http_ttfb_seconds",
                "Time from request arrival to the response headers.",
                &self.ttfb,
            ),
        ] {
            w.family(name, "histogram", help);
            h.render(w, name, &[]);
        }
    }
}

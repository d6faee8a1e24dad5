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
    /// By route (inference, other) and status class (1xx to 5xx): a
    /// fixed ten histograms, whatever the traffic.
    request_duration: [[Histogram; STATUS_CLASSES.len()]; ROUTES.len()],
    pub ttfb: Histogram,
}

/// The `route` label of `http_request_duration_seconds`: the generative
/// routes (chat, completions, generate) and all others.
const ROUTES: [&str; 2] = ["inference", "other"];
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

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
            request_duration: Default::default(),
            ttfb: Histogram::default(),
        }
    }

    /// A relayed response ended, `elapsed` after the request arrived.
    #[inline]
    pub fn request_done(&self, inference: bool, status: u16, elapsed: std::time::Duration) {
        let route = usize::from(!inference);
        let class = usize::from(status / 100).clamp(1, STATUS_CLASSES.len()) - 1;
        self.request_duration[route][class].observe(elapsed);
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
        let name = "http_request_duration_seconds";
        w.family(
            name,
            "histogram",
            "Time from request arrival to the last byte of a worker's response, by route (inference or other) and status class.",
        );
        for (route, classes) in ROUTES.iter().zip(&self.request_duration) {
            for (class, h) in STATUS_CLASSES.iter().zip(classes) {
                h.render(w, name, &[("route", route), ("status_class", class)]);
            }
        }
        w.family(
            "http_ttfb_seconds",
            "histogram",
            "Time from request arrival to the response headers.",
        );
        self.ttfb.render(w, "http_ttfb_seconds", &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_durations_are_split_by_route_and_status_class() {
        let stats = GatewayStats::new(&[]);
        stats.request_done(true, 503, std::time::Duration::from_millis(3));
        stats.request_done(false, 200, std::time::Duration::from_millis(1));
        stats.request_done(false, 204, std::time::Duration::from_millis(1));
        let mut out = String::new();
        stats.render(&mut Writer::new(&mut out, "b"));
        let count = |route: &str, class: &str| {
            let wanted = format!(
                "b_http_request_duration_seconds_count{{route=\"{route}\",status_class=\"{class}\"}} "
            );
            out.lines()
                .find_map(|l| l.strip_prefix(&wanted))
                .unwrap_or_else(|| panic!("no {wanted} in {out}"))
                .to_owned()
        };
        assert_eq!(count("inference", "5xx"), "1");
        assert_eq!(count("other", "2xx"), "2");
        assert_eq!(count("inference", "2xx"), "0", "every pair from zero");
    }
}

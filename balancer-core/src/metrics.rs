//! Metric primitives: the one histogram type, the Prometheus text writer, and
//! the trait through which each layer publishes its own series.
//!
//! Owns no series. The module that counts owns its series and implements
//! [`MetricsSource`] next to the state it reads (the registry for workers and
//! breakers, admission, tokens, the agent's gateway counters, the dataplane's
//! kernel counters); the agent's exposition only concatenates sources under
//! the `--metrics-prefix`. Nothing here may depend on any other module of the
//! crate.
//!
//! The text format is written by hand rather than through the `prometheus`
//! crate: every series here is read from atomics the hot path already keeps,
//! at scrape time, so there is no registry to mirror them into, and writing
//! straight into one `String` measured faster than building the crate's
//! metric families and encoding them (`cargo bench -p balancer-core --bench
//! exposition`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Series kept by one layer, read at scrape time and written under the
/// gateway's prefix.
pub trait MetricsSource: Send + Sync {
    /// Appends this source's families and samples to `w`.
    fn render(&self, w: &mut Writer<'_>);
}

/// Seconds: request and first-byte latencies, from a millisecond to ten minutes.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// A histogram on plain atomics, cheap enough to keep one per worker and
/// observe on the request path.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Default for Histogram {
    /// A latency histogram ([`LATENCY_BUCKETS`]).
    fn default() -> Self {
        Self::new(LATENCY_BUCKETS)
    }
}

impl Histogram {
    /// A histogram over `bounds`, upper bucket bounds in seconds, ascending.
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Records one duration, saturating at `u64::MAX` nanoseconds.
    #[inline]
    pub fn observe(&self, d: Duration) {
        self.observe_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Records one duration in nanoseconds; past the last bound it counts only in `+Inf`, `_sum`
    /// and `_count`.
    #[inline]
    pub fn observe_nanos(&self, nanos: u64) {
        let secs = nanos as f64 / 1e9;
        if let Some(i) = self.bounds.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Records a plain value in the unit of the bounds (a share, a count)
    /// rather than a duration.
    #[inline]
    pub fn observe_value(&self, v: f64) {
        self.observe_nanos((v.max(0.0) * 1e9) as u64);
    }

    /// Observations recorded so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The `_bucket`, `_sum` and `_count` samples of `name` (no family line).
    pub fn render(&self, w: &mut Writer<'_>, name: &str, labels: &[(&str, &str)]) {
        let bucket = format!("{name}_bucket");
        let bucket_sample = |w: &mut Writer<'_>, le: &str, value: f64| {
            let mut l = labels.to_vec();
            l.push(("le", le));
            w.sample(&bucket, &l, value);
        };
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(self.buckets.iter()) {
            cumulative += n.load(Ordering::Relaxed);
            bucket_sample(w, &bound.to_string(), cumulative as f64);
        }
        let count = self.count() as f64;
        bucket_sample(w, "+Inf", count);
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        w.sample(&format!("{name}_sum"), labels, sum);
        w.sample(&format!("{name}_count"), labels, count);
    }
}

/// Writes the Prometheus text format; every name gets the `--metrics-prefix`.
pub struct Writer<'a> {
    out: &'a mut String,
    prefix: &'a str,
}

impl<'a> Writer<'a> {
    /// A writer appending to `out`; every name is written as `{prefix}_{name}`.
    pub fn new(out: &'a mut String, prefix: &'a str) -> Self {
        Self { out, prefix }
    }

    /// Writes the `# HELP` and `# TYPE` lines of a family; `kind` is `counter`, `gauge` or
    /// `histogram`.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let p = self.prefix;
        let _ = writeln!(
            self.out,
            "# HELP {p}_{name} {help}\n# TYPE {p}_{name} {kind}"
        );
    }

    /// Writes one sample line, escaping backslashes, quotes and newlines in label values.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_is_in_seconds() {
        static BOUNDS: [f64; 2] = [0.001, 0.01];
        let h = Histogram::new(&BOUNDS);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let mut out = String::new();
        h.render(&mut Writer::new(&mut out, "p"), "d", &[("worker", "a\"b")]);
        assert_eq!(
            out,
            "p_d_bucket{worker=\"a\\\"b\",le=\"0.001\"} 1\n\
             p_d_bucket{worker=\"a\\\"b\",le=\"0.01\"} 2\n\
             p_d_bucket{worker=\"a\\\"b\",le=\"+Inf\"} 3\n\
             p_d_sum{worker=\"a\\\"b\"} 1.0055\n\
             p_d_count{worker=\"a\\\"b\"} 3\n"
        );
    }
}

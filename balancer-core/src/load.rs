//! Load reported by the workers themselves: their Prometheus exposition
//! parsed into queue and cache occupancy, and how long a report stays usable.
//!
//! Owns the exposition parser for the engines' own series (vLLM's
//! `vllm:num_requests_waiting`, `vllm:num_requests_running`,
//! `vllm:kv_cache_usage_perc`; SGLang's `sglang:num_queue_reqs`,
//! `sglang:num_running_reqs`, `sglang:token_usage`), and each worker's
//! [`LoadCell`]: the last report, its freshness on the injected clock, the
//! scrape outcomes and the overload sheds. It does no I/O (the agent's load
//! monitor fetches `/metrics` and hands the text here) and it never touches a
//! breaker: a scrape that fails changes where a worker's load is read from,
//! nothing else.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;

use crate::clock::{Nanos, nanos};

/// The largest exposition a scrape reads: a vLLM server's is tens of KiB
/// (one histogram per model and engine), so 1 MiB leaves room for many
/// engines and still bounds what a broken or hostile worker can make the
/// gateway hold.
pub const MAX_EXPOSITION_BYTES: usize = 1 << 20;

/// A report stays usable for this many scrape intervals after the scrape
/// that produced it; then the gateway's own in-flight count takes over.
pub const FRESH_INTERVALS: u32 = 3;

/// Queue and cache occupancy as a worker reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReportedLoad {
    /// Requests queued, not yet running (summed over the engines reported).
    pub waiting: u32,
    /// Requests running (summed over the engines reported).
    pub running: u32,
    /// KV-cache occupancy from 0 to 1 (the fullest engine); `None` when the
    /// worker does not report it.
    pub cache_usage: Option<f64>,
}

impl ReportedLoad {
    /// Requests the worker holds: waiting plus running.
    pub fn requests(&self) -> u32 {
        self.waiting.saturating_add(self.running)
    }
}

/// Why an exposition gave no load. The previous report is kept.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LoadParseError {
    /// Larger than [`MAX_EXPOSITION_BYTES`].
    #[error("the exposition is larger than {limit} bytes")]
    TooLarge {
        /// The bound that was passed.
        limit: usize,
    },
    /// Not the Prometheus text format.
    #[error("the exposition is malformed: {0}")]
    Malformed(String),
    /// A load series holds a value that is not a finite, non-negative number.
    #[error("{series} has the value {value:?}")]
    BadValue {
        /// The series' name.
        series: String,
        /// Its value as written.
        value: String,
    },
    /// Neither engine's queue series is in it.
    #[error("no vLLM or SGLang queue series in the exposition")]
    NoLoadSeries,
}

/// What a series adds to the report.
#[derive(Clone, Copy)]
enum Field {
    Waiting,
    Running,
    CacheUsage,
}

/// The engines' series, by name. `vllm:gpu_cache_usage_perc` is the name
/// vLLM used before v0.10 for the same fraction.
const SERIES: [(&str, Field); 7] = [
    ("vllm:num_requests_waiting", Field::Waiting),
    ("vllm:num_requests_running", Field::Running),
    ("vllm:kv_cache_usage_perc", Field::CacheUsage),
    ("vllm:gpu_cache_usage_perc", Field::CacheUsage),
    ("sglang:num_queue_reqs", Field::Waiting),
    ("sglang:num_running_reqs", Field::Running),
    ("sglang:token_usage", Field::CacheUsage),
];

/// Reads a worker's queue and cache occupancy from its `/metrics` text.
///
/// Every engine (the `engine` label of a data-parallel vLLM, one series per
/// `model_name`) adds its queue; the cache usage is the fullest engine's.
/// Other series are parsed (the whole text must be well-formed) and ignored.
pub fn parse_exposition(text: &str) -> Result<ReportedLoad, LoadParseError> {
    if text.len() > MAX_EXPOSITION_BYTES {
        return Err(LoadParseError::TooLarge {
            limit: MAX_EXPOSITION_BYTES,
        });
    }
    // The crate refuses an empty page; for the gateway it is a page without
    // the series, like any other.
    if text.trim().is_empty() {
        return Err(LoadParseError::NoLoadSeries);
    }
    let scrape = prom_text_format_parser::Scrape::parse(text)
        .map_err(|e| LoadParseError::Malformed(parse_error(&e)))?;
    let (mut waiting, mut running, mut cache_usage) = (None::<f64>, None::<f64>, None::<f64>);
    for metric in &scrape.metrics {
        let Some(&(_, field)) = SERIES.iter().find(|(name, _)| *name == metric.name) else {
            continue;
        };
        for sample in &metric.samples {
            // The crate keeps the number as written; reading it here turns a
            // token it let through into an error instead of its panic.
            let written = sample.value.value.as_str();
            let value = written
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| LoadParseError::BadValue {
                    series: metric.name.clone(),
                    value: written.to_owned(),
                })?;
            match field {
                Field::Waiting => *waiting.get_or_insert(0.0) += value,
                Field::Running => *running.get_or_insert(0.0) += value,
                Field::CacheUsage => {
                    cache_usage = Some(cache_usage.map_or(value, |c: f64| c.max(value)));
                }
            }
        }
    }
    if waiting.is_none() && running.is_none() {
        return Err(LoadParseError::NoLoadSeries);
    }
    // Gauges of request counts are whole numbers; a float cast saturates.
    let count = |v: Option<f64>| v.unwrap_or(0.0).round() as u32;
    Ok(ReportedLoad {
        waiting: count(waiting),
        running: count(running),
        cache_usage: cache_usage.map(|c| c.min(1.0)),
    })
}

/// The crate's error in one short line: where the text went wrong, without
/// the worker's text itself (its message quotes the offending line, whose
/// length the worker chooses).
fn parse_error(e: &prom_text_format_parser::ScrapeParseError) -> String {
    use prom_text_format_parser::ScrapeParseError as E;
    let line = match e {
        E::Parse(message) => message.lines().next().unwrap_or_default().to_owned(),
        E::Collect(errors) => errors.first().map_or_else(String::new, |m| {
            format!("line {}: {}", m.line_no.start + 1, m.error)
        }),
    };
    if line.is_empty() {
        return "not the Prometheus text format".to_owned();
    }
    line.chars().take(200).collect()
}

/// How one scrape ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ScrapeOutcome {
    /// The worker reported its load.
    Ok(ReportedLoad),
    /// The request failed, the status was not 2xx, or the text gave no load.
    Error,
    /// No complete answer within the scrape timeout.
    Timeout,
}

impl ScrapeOutcome {
    /// Its index in [`LoadCell::scrapes`].
    fn slot(&self) -> usize {
        match self {
            ScrapeOutcome::Ok(_) => 0,
            ScrapeOutcome::Error => 1,
            ScrapeOutcome::Timeout => 2,
        }
    }
}

#[derive(Debug)]
struct Stamped {
    load: ReportedLoad,
    at: Nanos,
}

/// Overload threshold meaning "off".
const NO_THRESHOLD: u32 = u32::MAX;

/// One worker's reported load: the last report and when it came, read
/// without a lock by the request path; written by the worker's monitor task
/// once per scrape.
#[derive(Debug)]
pub struct LoadCell {
    report: ArcSwapOption<Stamped>,
    /// How long a report stays usable; 0 while nothing monitors the worker.
    max_age: AtomicU64,
    /// `--worker-overload-waiting-requests`; [`NO_THRESHOLD`] when off.
    overload_waiting: AtomicU32,
    /// Whether the last scrape left a usable report: the one bit behind the
    /// "load source" log events, so each change logs once.
    reported: AtomicBool,
    scrapes: [AtomicU64; 3],
    sheds: AtomicU64,
}

impl Default for LoadCell {
    fn default() -> Self {
        Self {
            report: ArcSwapOption::empty(),
            max_age: AtomicU64::new(0),
            overload_waiting: AtomicU32::new(NO_THRESHOLD),
            reported: AtomicBool::new(false),
            scrapes: Default::default(),
            sheds: AtomicU64::new(0),
        }
    }
}

impl LoadCell {
    /// Starts monitoring: reports are scraped every `interval` and a worker
    /// reporting more than `overload_waiting` queued requests is overloaded.
    pub fn configure(&self, interval: Duration, overload_waiting: Option<u32>) {
        self.max_age.store(
            nanos(interval).saturating_mul(u64::from(FRESH_INTERVALS)),
            Ordering::Relaxed,
        );
        self.overload_waiting
            .store(overload_waiting.unwrap_or(NO_THRESHOLD), Ordering::Relaxed);
    }

    /// Records one scrape. A failed one keeps the last report, which
    /// [`LoadCell::current`] serves until it is [`FRESH_INTERVALS`] intervals
    /// old. `worker` names the worker in the log events.
    pub fn record(&self, worker: &str, outcome: ScrapeOutcome, now: Nanos) {
        self.scrapes[outcome.slot()].fetch_add(1, Ordering::Relaxed);
        if let ScrapeOutcome::Ok(load) = outcome {
            self.report.store(Some(Arc::new(Stamped { load, at: now })));
        }
        let fresh = self.current(now).is_some();
        if self.reported.swap(fresh, Ordering::Relaxed) != fresh {
            if fresh {
                tracing::info!(worker, "worker load read from its own report");
            } else {
                tracing::warn!(
                    worker,
                    "worker load report stale, using the gateway's in-flight count"
                );
            }
        }
    }

    /// The last report while it is fresh: at most [`FRESH_INTERVALS`]
    /// intervals old.
    #[inline]
    pub fn current(&self, now: Nanos) -> Option<ReportedLoad> {
        let max_age = self.max_age.load(Ordering::Relaxed);
        let guard = self.report.load();
        let stamped = guard.as_ref()?;
        (now.saturating_sub(stamped.at) <= max_age).then_some(stamped.load)
    }

    /// Whether the worker reports more requests waiting than the overload
    /// threshold, in a fresh report. Costs one atomic load while the
    /// threshold is off.
    #[inline]
    pub fn is_overloaded(&self, now: impl FnOnce() -> Nanos) -> bool {
        let threshold = self.overload_waiting.load(Ordering::Relaxed);
        threshold != NO_THRESHOLD && self.current(now()).is_some_and(|l| l.waiting > threshold)
    }

    /// Counts one request sent elsewhere because this worker was overloaded.
    pub fn note_shed(&self) {
        self.sheds.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests sent elsewhere because this worker was overloaded.
    pub fn sheds(&self) -> u64 {
        self.sheds.load(Ordering::Relaxed)
    }

    /// Scrapes so far by outcome, labelled as in `worker_load_scrapes_total`.
    pub fn scrapes(&self) -> [(&'static str, u64); 3] {
        let count = |slot: usize| self.scrapes[slot].load(Ordering::Relaxed);
        [("ok", count(0)), ("error", count(1)), ("timeout", count(2))]
    }
}

#[cfg(test)]
mod tests;

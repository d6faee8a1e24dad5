//! Background load scrapes: each worker's own `/metrics`, read for its queue
//! and cache occupancy (`--load-monitor-interval-ms`).
//!
//! Owns the I/O around `balancer_core::load`: one `GET /metrics` per
//! interval on the health prober's client, bounded in bytes
//! ([`MAX_EXPOSITION_BYTES`]) and in time (the interval), its text handed to
//! the core's parser and the outcome to the worker's [`LoadCell`]. It never
//! records on a breaker and never changes the fleet: a worker whose scrape
//! fails only has its load read from the gateway's in-flight count again,
//! three intervals later.
//!
//! [`LoadCell`]: balancer_core::load::LoadCell

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};

use balancer_core::clock::Clock;
use balancer_core::load::{MAX_EXPOSITION_BYTES, ReportedLoad, ScrapeOutcome, parse_exposition};
use balancer_core::registry::Worker;

use super::probe::{ProbeClient, Prober, get};

/// `--load-monitor-interval-ms`, `--worker-overload-waiting-requests`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadMonitorConfig {
    /// How often each worker's `/metrics` is read, and the bound on one read;
    /// `None`: never (loads are the gateway's in-flight counts).
    pub interval: Option<Duration>,
    /// A worker reporting more requests waiting than this takes no new
    /// request while another candidate can; `None`: no such limit.
    pub overload_waiting: Option<u32>,
}

/// The default interval. An inference engine's queue moves on the scale of
/// one prefill (tens to hundreds of milliseconds) and a decode step, so a
/// report much older than half a second says little about the next
/// request; a vLLM `/metrics` page is tens of KiB, so two reads a second per
/// worker cost the worker and the gateway next to nothing; and the three
/// intervals a failed worker's report survives end after 1.5 s, before
/// a client's retry would notice.
pub const DEFAULT_LOAD_MONITOR_INTERVAL: Duration = Duration::from_millis(500);

impl Default for LoadMonitorConfig {
    fn default() -> Self {
        Self {
            interval: Some(DEFAULT_LOAD_MONITOR_INTERVAL),
            overload_waiting: None,
        }
    }
}

/// Starts and runs each worker's load scrapes.
#[derive(Clone)]
pub struct LoadMonitor {
    client: ProbeClient,
    clock: Arc<dyn Clock>,
    config: LoadMonitorConfig,
}

impl LoadMonitor {
    /// Scrapes over `prober`'s client (the same TLS client and pool as the
    /// health probes); the reports are stamped on `clock`.
    pub fn new(prober: &Prober, clock: Arc<dyn Clock>, config: LoadMonitorConfig) -> Self {
        Self {
            client: prober.client(),
            clock,
            config,
        }
    }

    /// Scrapes `worker` every interval until it is removed; does nothing
    /// when monitoring is off.
    pub fn spawn(&self, worker: &Arc<Worker>) {
        let Some(interval) = self.config.interval else {
            return;
        };
        worker
            .load_cell()
            .configure(interval, self.config.overload_waiting);
        let (this, weak) = (self.clone(), Arc::downgrade(worker));
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            // A slow scrape delays the next one instead of bunching them.
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(worker) = weak.upgrade() else { return };
                let outcome = this.scrape(&worker, interval).await;
                worker
                    .load_cell()
                    .record(&worker.url, outcome, this.clock.now());
            }
        });
        worker.add_task(task.abort_handle());
    }

    /// One `GET /metrics`, answered 2xx within `timeout`, at most
    /// [`MAX_EXPOSITION_BYTES`], and holding the engine's queue series.
    async fn scrape(&self, worker: &Worker, timeout: Duration) -> ScrapeOutcome {
        let read = async {
            let request =
                get(&worker.address, "/metrics").ok_or("the worker URL makes no request")?;
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| format!("request failed: {e}"))?;
            if !response.status().is_success() {
                return Err(format!("status {}", response.status()));
            }
            let body = Limited::new(response.into_body(), MAX_EXPOSITION_BYTES)
                .collect()
                .await
                .map_err(|e| format!("body: {e}"))?
                .to_bytes();
            let text = std::str::from_utf8(&body).map_err(|_| "the page is not UTF-8")?;
            parse_exposition(text).map_err(|e| e.to_string())
        };
        let result: Result<Result<ReportedLoad, String>, _> =
            tokio::time::timeout(timeout, read).await;
        match result {
            Ok(Ok(load)) => ScrapeOutcome::Ok(load),
            Ok(Err(reason)) => {
                tracing::debug!(worker = %worker.url, %reason, "load scrape failed");
                ScrapeOutcome::Error
            }
            Err(_) => {
                tracing::debug!(worker = %worker.url, ?timeout, "load scrape timed out");
                ScrapeOutcome::Timeout
            }
        }
    }
}

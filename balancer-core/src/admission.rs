//! Admission control: at most `--max-concurrent-requests` requests run at once,
//! the rest wait in a bounded FIFO queue for at most `--queue-timeout-secs`.
//!
//! Owns the permits and the queue. A shed is the gateway's own answer (429
//! `admission_queue_full`, 503 `admission_queue_timeout`): it never reaches a
//! worker and so never touches a breaker. The permit travels with the response
//! body and is released after its last byte.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::{MetricsSource, Writer};

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// The queue already held `queue_size` requests (the agent answers 429 `admission_queue_full`).
    QueueFull,
    /// No permit came within `queue_timeout` (the agent answers 503 `admission_queue_timeout`).
    QueueTimeout,
}

/// Admission limits, from `--max-concurrent-requests`, `--queue-size` and `--queue-timeout-secs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests running at once (`--max-concurrent-requests`).
    pub max_concurrent: usize,
    /// Requests that may wait for a permit; one more is shed with [`Shed::QueueFull`]
    /// (`--queue-size`).
    pub queue_size: usize,
    /// Longest wait in the queue before [`Shed::QueueTimeout`] (`--queue-timeout-secs`).
    pub queue_timeout: Duration,
}

/// The concurrency limit, its bounded FIFO wait queue, and the shed counters.
#[derive(Debug)]
pub struct Admission {
    permits: Arc<Semaphore>,
    config: AdmissionConfig,
    waiting: AtomicUsize,
    queue_full: AtomicU64,
    queue_timeout: AtomicU64,
}

/// Held for the whole life of an admitted request, response body included.
#[derive(Debug)]
pub struct Permit(#[allow(dead_code)] OwnedSemaphorePermit);

/// Counters for the metrics layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionStats {
    /// The concurrency limit (`admission_limit`).
    pub limit: usize,
    /// Permits held now (`admission_inflight`).
    pub inflight: usize,
    /// Requests waiting for a permit now (`admission_queue_depth`).
    pub queued: usize,
    /// Requests shed with [`Shed::QueueFull`] since start.
    pub rejected_queue_full: u64,
    /// Requests shed with [`Shed::QueueTimeout`] since start.
    pub rejected_queue_timeout: u64,
}

/// Leaves the queue however the wait ends (admitted, timed out, or the
/// client went away and the future was dropped).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    /// Admission with all `max_concurrent` permits free and an empty queue.
    pub fn new(config: AdmissionConfig) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(config.max_concurrent)),
            config,
            waiting: AtomicUsize::new(0),
            queue_full: AtomicU64::new(0),
            queue_timeout: AtomicU64::new(0),
        }
    }

    /// Takes a permit at once when one is free; otherwise waits in the queue for at most
    /// `queue_timeout`, or is shed at once when the queue is full.
    pub async fn admit(&self) -> Result<Permit, Shed> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Ok(Permit(p));
        }
        // Reserve a queue slot first, so the queue never exceeds its size even
        // when many requests arrive at once.
        let reserved = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < self.config.queue_size).then_some(w + 1)
            });
        if reserved.is_err() {
            self.queue_full.fetch_add(1, Ordering::Relaxed);
            return Err(Shed::QueueFull);
        }
        let _slot = Waiting(&self.waiting);
        match tokio::time::timeout(
            self.config.queue_timeout,
            self.permits.clone().acquire_owned(),
        )
        .await
        {
            Ok(Ok(p)) => Ok(Permit(p)),
            // The semaphore is never closed; treat it like a timeout anyway.
            Ok(Err(_)) | Err(_) => {
                self.queue_timeout.fetch_add(1, Ordering::Relaxed);
                Err(Shed::QueueTimeout)
            }
        }
    }

    /// The limit, current occupancy and shed counters, for the `admission_*` series.
    pub fn stats(&self) -> AdmissionStats {
        AdmissionStats {
            limit: self.config.max_concurrent,
            inflight: self.config.max_concurrent - self.permits.available_permits(),
            queued: self.waiting.load(Ordering::Acquire),
            rejected_queue_full: self.queue_full.load(Ordering::Relaxed),
            rejected_queue_timeout: self.queue_timeout.load(Ordering::Relaxed),
        }
    }

    /// Seconds a shed client should wait before retrying.
    pub fn retry_after_secs(&self) -> u64 {
        self.config.queue_timeout.as_secs().clamp(1, 60)
    }
}

impl MetricsSource for Admission {
    fn render(&self, w: &mut Writer<'_>) {
        let s = self.stats();
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max: usize, queue: usize, timeout_ms: u64) -> Arc<Admission> {
        Arc::new(Admission::new(AdmissionConfig {
            max_concurrent: max,
            queue_size: queue,
            queue_timeout: Duration::from_millis(timeout_ms),
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn full_queue_sheds_with_queue_full() {
        let a = admission(2, 1, 60_000);
        let _p1 = a.admit().await.unwrap();
        let _p2 = a.admit().await.unwrap();
        let queued = tokio::spawn({
            let a = a.clone();
            async move { a.admit().await.map(|_| ()) }
        });
        tokio::task::yield_now().await;
        assert_eq!(a.stats().queued, 1);
        assert_eq!(a.admit().await.unwrap_err(), Shed::QueueFull);
        assert_eq!(a.stats().rejected_queue_full, 1);
        drop(_p1);
        assert_eq!(queued.await.unwrap(), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_past_the_timeout_sheds_with_queue_timeout() {
        let a = admission(1, 4, 500);
        let _p = a.admit().await.unwrap();
        assert_eq!(a.admit().await.unwrap_err(), Shed::QueueTimeout);
        assert_eq!(a.stats().queued, 0, "the slot is given back");
        assert_eq!(a.stats().rejected_queue_timeout, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn queue_is_fifo() {
        let a = admission(1, 3, 60_000);
        let first = a.admit().await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (a, order) = (a.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let p = a.admit().await.unwrap();
                order.lock().unwrap().push(i);
                drop(p);
            }));
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
    }
}

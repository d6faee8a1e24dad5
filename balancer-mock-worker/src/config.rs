//! How a worker presents itself ([`MockWorkerConfig`]) and how it misbehaves
//! ([`Fault`]): the fault spec, its validation, and the lock-free matching
//! that decides which `/v1/*` request and which `/health` check a fault hits.
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module is at the bottom: plain data and arithmetic on atomics. It
//! must not do I/O, touch a socket, a body or a counter, or depend on any
//! other module of this crate but `prefix_cache` (whose engine settings it
//! carries): callers ask it whether a fault applies and act
//! on the answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::StatusCode;
use serde::{Deserialize, Serialize};

use crate::prefix_cache::EngineConfig;

/// How a worker instance presents itself.
#[derive(Debug, Clone)]
pub struct MockWorkerConfig {
    /// Value of the `x-mock-worker` header. Empty means `mock-<bound port>`,
    /// which keeps several demo workers distinguishable without bookkeeping.
    pub name: String,
    /// Model id reported by `/v1/models` and echoed in completions.
    pub model: String,
    /// Delay before each generated token (fault `token_delay_ms` overrides it).
    pub token_delay: Duration,
    /// Tokens generated when the request has no `max_tokens`.
    pub default_tokens: u64,
    /// Upper bound applied to the request's `max_tokens`.
    pub max_tokens_cap: u64,
    /// The simulated engine: prefix cache, prefill time, slots (off by default).
    pub engine: EngineConfig,
}

impl Default for MockWorkerConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            model: "demo-model".to_owned(),
            token_delay: Duration::ZERO,
            default_tokens: 8,
            max_tokens_cap: 4096,
            engine: EngineConfig::default(),
        }
    }
}

impl MockWorkerConfig {
    /// A default config with the given worker name.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }
}

/// The fault spec of the control API (`POST /_mock/fault`). All fields are
/// optional; a new spec replaces the previous one.
///
/// `count` and `every` select which `/v1/*` requests the inference fields
/// (`status`, `latency_ms`, `drop`, `stall_after_chunks`,
/// `truncate_after_chunks`, `token_delay_ms`, `completion_tokens`,
/// `without_usage`) apply to; `health_status` is not
/// subject to them. A non-streaming response counts as one chunk, so the stall
/// and truncate faults cut it in the middle of its body (the `Content-Length`
/// promises more than is sent).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// Answer matching requests with this status and an OpenAI error body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Apply to the next N matching requests only; absent means always.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// Match only every Nth `/v1/*` request (the Nth, 2Nth, ... since the fault was set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<u64>,
    /// Delay before the response headers (or before dropping the connection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// Close the connection without answering.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drop: bool,
    /// Send K SSE chunks, then send nothing more while keeping the connection open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_after_chunks: Option<u64>,
    /// Send K SSE chunks, then close the connection mid-body (no `[DONE]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate_after_chunks: Option<u64>,
    /// Seconds for a `Retry-After` header on `status` and `health_status` answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
    /// What `/health` answers while this fault is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_status: Option<u16>,
    /// Per-token delay for matching requests, overriding the configured one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_delay_ms: Option<u64>,
    /// Answer completions with exactly N completion tokens (0: an empty
    /// completion), streamed or not, whatever the request asked for: a
    /// worker that answers 200 but not an answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    /// Leave the `usage` object out of completions, so a reader must count
    /// the text itself.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub without_usage: bool,
}

/// Why a [`Fault`] was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid fault: {0}")]
pub struct InvalidFault(String);

impl Fault {
    /// Checks the rules the HTTP control API enforces (it answers 400 otherwise).
    pub fn validate(&self) -> Result<(), InvalidFault> {
        let bad = |msg: &str| Err(InvalidFault(msg.to_owned()));
        // 1xx cannot be a final response and hyper refuses to send one.
        let valid_status = |s: Option<u16>| s.is_none_or(|s| (200..=599).contains(&s));
        if !valid_status(self.status) {
            return bad("status must be within 200..=599");
        }
        if !valid_status(self.health_status) {
            return bad("health_status must be within 200..=599");
        }
        if self.every == Some(0) {
            return bad("every must be at least 1");
        }
        if self.stall_after_chunks.is_some() && self.truncate_after_chunks.is_some() {
            return bad("stall_after_chunks and truncate_after_chunks are exclusive");
        }
        if self.drop
            && (self.status.is_some()
                || self.stall_after_chunks.is_some()
                || self.truncate_after_chunks.is_some())
        {
            return bad("drop excludes status, stall_after_chunks and truncate_after_chunks");
        }
        Ok(())
    }

    fn affects_inference(&self) -> bool {
        self.status.is_some()
            || self.latency_ms.is_some()
            || self.drop
            || self.stall_after_chunks.is_some()
            || self.truncate_after_chunks.is_some()
            || self.token_delay_ms.is_some()
            || self.completion_tokens.is_some()
            || self.without_usage
    }
}

/// A fault plus the per-spec progress of `count` and `every`, so replacing the
/// spec restarts both.
pub(crate) struct FaultState {
    pub(crate) spec: Fault,
    inference: bool,
    remaining: AtomicU64,
    seen: AtomicU64,
}

impl FaultState {
    pub(crate) fn new(spec: Fault) -> Self {
        FaultState {
            inference: spec.affects_inference(),
            remaining: AtomicU64::new(spec.count.unwrap_or(u64::MAX)),
            seen: AtomicU64::new(0),
            spec,
        }
    }

    /// Decides whether this fault hits the current `/v1/*` request, consuming
    /// one unit of `count` if it does.
    pub(crate) fn take_inference(&self) -> Option<Applied> {
        if !self.inference {
            return None;
        }
        if let Some(every) = self.spec.every {
            let n = self.seen.fetch_add(1, Ordering::Relaxed) + 1;
            if !n.is_multiple_of(every) {
                return None;
            }
        }
        if self.spec.count.is_some()
            && self
                .remaining
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                .is_err()
        {
            return None;
        }
        Some(Applied::from_spec(&self.spec))
    }

    /// What `/health` answers instead of 200, and its `Retry-After`; `count`
    /// and `every` do not apply.
    pub(crate) fn health(&self) -> Option<(StatusCode, Option<u64>)> {
        let status = StatusCode::from_u16(self.spec.health_status?).ok()?;
        if status == StatusCode::OK {
            return None;
        }
        Some((status, self.spec.retry_after))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CutKind {
    Stall,
    Truncate,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Cut {
    pub(crate) after_chunks: u64,
    pub(crate) kind: CutKind,
}

/// The inference part of a fault, copied out so no `ArcSwap` guard is held across awaits.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Applied {
    pub(crate) latency: Option<Duration>,
    pub(crate) drop: bool,
    pub(crate) status: Option<StatusCode>,
    pub(crate) retry_after: Option<u64>,
    pub(crate) cut: Option<Cut>,
    pub(crate) token_delay: Option<Duration>,
    pub(crate) completion_tokens: Option<u64>,
    pub(crate) without_usage: bool,
}

impl Applied {
    fn from_spec(f: &Fault) -> Self {
        let cut = match (f.stall_after_chunks, f.truncate_after_chunks) {
            (Some(k), _) => Some(Cut {
                after_chunks: k,
                kind: CutKind::Stall,
            }),
            (None, Some(k)) => Some(Cut {
                after_chunks: k,
                kind: CutKind::Truncate,
            }),
            (None, None) => None,
        };
        Applied {
            latency: f.latency_ms.map(Duration::from_millis),
            drop: f.drop,
            // validate() keeps this in range; a 500 fallback beats a panic on the request path.
            status: f
                .status
                .map(|s| StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)),
            retry_after: f.retry_after,
            cut,
            token_delay: f.token_delay_ms.map(Duration::from_millis),
            completion_tokens: f.completion_tokens,
            without_usage: f.without_usage,
        }
    }
}

#[cfg(test)]
mod tests {
    use http::header::RETRY_AFTER;
    use http::{Method, StatusCode};

    use super::Fault;
    use crate::test_support::*;

    #[tokio::test]
    async fn every_nth_request() {
        let w = worker("w-every").await;
        w.set_fault(Fault {
            status: Some(500),
            every: Some(3),
            ..Fault::default()
        });
        let mut statuses = Vec::new();
        for _ in 0..6 {
            statuses.push(chat(&w, CHAT).await.status.as_u16());
        }
        assert_eq!(statuses, [200, 200, 500, 200, 200, 500]);
        assert_eq!(w.stats().faults_applied, 2);

        // With a count, only the first N of the selected requests are hit.
        w.set_fault(Fault {
            status: Some(429),
            every: Some(2),
            count: Some(1),
            ..Fault::default()
        });
        let mut statuses = Vec::new();
        for _ in 0..6 {
            statuses.push(chat(&w, CHAT).await.status.as_u16());
        }
        assert_eq!(statuses, [200, 429, 200, 200, 200, 200]);
    }

    #[tokio::test]
    async fn health_fault_is_independent() {
        let w = worker("w-health").await;
        w.set_fault(Fault {
            health_status: Some(503),
            retry_after: Some(3),
            ..Fault::default()
        });
        let a = call(&w, Method::GET, "/health", "").await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(a.headers[RETRY_AFTER], "3");
        assert!(a.json()["error"]["message"].is_string());
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::OK);
        assert_eq!(w.stats().faults_applied, 1);
        w.clear_fault();
        assert_eq!(
            call(&w, Method::GET, "/health", "").await.status,
            StatusCode::OK
        );
    }
}

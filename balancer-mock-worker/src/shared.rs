//! [`Shared`], the state every connection of one worker shares (its identity,
//! counters, current fault and completion settings); the counters themselves
//! ([`Counters`] and their snapshot, [`MockStats`]); and the helpers every
//! handler answers through: the `x-mock-worker` header, OpenAI-style error
//! bodies, injected fault answers and the bounded read of a request body.
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module uses only `config` (the fault state it stores) and `body`
//! (the body of its responses). It must not depend on `control`, `routes`,
//! `server` or `cli`: it must not know which path answers what (that is
//! `routes` and `control`), nor how connections are accepted or closed (that
//! is `server`). Everything here is read on the request path of a proxy
//! benchmark, so it must stay lock-free: counters are plain relaxed atomics
//! and the fault is read through an `ArcSwap`.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};

use crate::body::MockBody;
use crate::config::{Applied, Fault, FaultState, MockWorkerConfig};
use crate::prefix_cache::Engine;

/// Header carried by every response so tests can tell workers apart.
pub const WORKER_HEADER: &str = "x-mock-worker";

/// Request bodies above this are answered with 413; inference prompts in the
/// demo are tiny, and an unbounded buffer would let a bad client eat memory.
const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

pub(crate) const JSON: &str = "application/json";

pub(crate) type Resp = Response<MockBody>;

/// A snapshot of the worker's counters (also the body of `GET /_mock/stats`).
///
/// Control API calls (`/_mock/*`) are not counted, so polling the stats does not
/// disturb them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MockStats {
    /// Every non-control request, including 404s.
    pub requests: u64,
    /// Requests under `/v1/`.
    pub inference_requests: u64,
    /// `/health` requests.
    pub health_checks: u64,
    /// Requests a fault was applied to (inference faults and `health_status`).
    pub faults_applied: u64,
    /// Connections open right now; a gauge, so a reset leaves it alone.
    pub open_connections: u64,
    /// Prompt tokens looked up in the prefix cache (0 while it is off).
    #[serde(default)]
    pub prefix_cache_query_tokens: u64,
    /// Of those, the tokens found cached.
    #[serde(default)]
    pub prefix_cache_hit_tokens: u64,
}

/// The live counters behind [`MockStats`], bumped on the request path.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) requests: AtomicU64,
    pub(crate) inference_requests: AtomicU64,
    pub(crate) health_checks: AtomicU64,
    pub(crate) faults_applied: AtomicU64,
    pub(crate) open_connections: AtomicU64,
}

impl Counters {
    pub(crate) fn snapshot(&self, engine: &Engine) -> MockStats {
        let tokens = engine.tokens();
        MockStats {
            prefix_cache_query_tokens: tokens.query_tokens,
            prefix_cache_hit_tokens: tokens.hit_tokens,
            requests: self.requests.load(Ordering::Relaxed),
            inference_requests: self.inference_requests.load(Ordering::Relaxed),
            health_checks: self.health_checks.load(Ordering::Relaxed),
            faults_applied: self.faults_applied.load(Ordering::Relaxed),
            open_connections: self.open_connections.load(Ordering::Relaxed),
        }
    }

    /// Zeroes the counters, but not the `open_connections` gauge.
    pub(crate) fn reset(&self) {
        for c in [
            &self.requests,
            &self.inference_requests,
            &self.health_checks,
            &self.faults_applied,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

pub(crate) struct Shared {
    pub(crate) name: String,
    name_header: HeaderValue,
    pub(crate) model: Arc<str>,
    pub(crate) token_delay: Duration,
    pub(crate) default_tokens: u64,
    pub(crate) max_tokens_cap: u64,
    pub(crate) models_body: Bytes,
    /// `GET /v1/models/{its model}`: the one entry of [`Shared::models_body`].
    pub(crate) card_body: Bytes,
    pub(crate) stats: Counters,
    pub(crate) fault: ArcSwapOption<FaultState>,
    pub(crate) next_id: AtomicU64,
    pub(crate) engine: Arc<Engine>,
}

impl Shared {
    pub(crate) fn new(cfg: MockWorkerConfig, addr: SocketAddr) -> io::Result<Self> {
        let name = if cfg.name.is_empty() {
            format!("mock-{}", addr.port())
        } else {
            cfg.name
        };
        let name_header = HeaderValue::from_str(&name).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("worker name {name:?} is not a valid header value"),
            )
        })?;
        let card = serde_json::json!({
            "id": cfg.model,
            "object": "model",
            "created": 0,
            "owned_by": "mock-worker",
        });
        let card_body = serde_json::to_vec(&card).map_err(io::Error::other)?;
        let models_body = serde_json::to_vec(&serde_json::json!({
            "object": "list",
            "data": [card],
        }))
        .map_err(io::Error::other)?;
        Ok(Shared {
            name,
            name_header,
            model: cfg.model.into(),
            token_delay: cfg.token_delay,
            default_tokens: cfg.default_tokens,
            max_tokens_cap: cfg.max_tokens_cap,
            models_body: models_body.into(),
            card_body: card_body.into(),
            stats: Counters::default(),
            fault: ArcSwapOption::empty(),
            next_id: AtomicU64::new(1),
            engine: Arc::new(Engine::new(cfg.engine)),
        })
    }

    /// Replaces the fault; the caller has validated it.
    pub(crate) fn set_fault(&self, spec: Fault) {
        self.fault.store(Some(Arc::new(FaultState::new(spec))));
    }

    pub(crate) fn clear_fault(&self) {
        self.fault.store(None);
    }

    /// Clears the fault and zeroes the counters.
    pub(crate) fn reset(&self) {
        self.clear_fault();
        self.stats.reset();
        self.engine.reset_counters();
    }

    /// Decides whether the current fault hits this `/v1/*` request, consuming
    /// one unit of `count` if it does.
    pub(crate) fn take_inference_fault(&self) -> Option<Applied> {
        let guard = self.fault.load();
        let applied = guard.as_ref()?.take_inference()?;
        bump(&self.stats.faults_applied);
        Some(applied)
    }

    pub(crate) fn health_fault(&self) -> Option<(StatusCode, Option<u64>)> {
        let guard = self.fault.load();
        let hit = guard.as_ref()?.health()?;
        bump(&self.stats.faults_applied);
        Some(hit)
    }

    pub(crate) fn respond(
        &self,
        status: StatusCode,
        content_type: &'static str,
        body: MockBody,
    ) -> Resp {
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        h.insert(
            HeaderName::from_static(WORKER_HEADER),
            self.name_header.clone(),
        );
        resp
    }

    pub(crate) fn json(&self, status: StatusCode, body: impl Into<Bytes>) -> Resp {
        self.respond(status, JSON, MockBody::full(body.into()))
    }

    pub(crate) fn json_value<T: Serialize>(&self, status: StatusCode, value: &T) -> Resp {
        match serde_json::to_vec(value) {
            Ok(v) => self.json(status, v),
            Err(e) => self.error(
                StatusCode::INTERNAL_SERVER_ERROR,
                &e.to_string(),
                "internal",
            ),
        }
    }

    pub(crate) fn error(&self, status: StatusCode, message: &str, code: &str) -> Resp {
        let body = ErrorBody {
            error: ErrorDetail {
                message,
                kind: error_type(status),
                param: None,
                code,
            },
        };
        // Serializing borrowed strs into a Vec cannot fail.
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        self.json(status, bytes)
    }

    pub(crate) fn injected_error(&self, status: StatusCode, retry_after: Option<u64>) -> Resp {
        let msg = format!(
            "mock worker {}: injected fault status {}",
            self.name,
            status.as_u16()
        );
        let mut resp = self.error(status, &msg, "injected_fault");
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 => "timeout_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "api_error",
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

pub(crate) enum ReadError {
    TooLarge,
    Broken,
}

/// Reads a whole request body, up to [`MAX_BODY_BYTES`].
pub(crate) async fn read_body(body: Incoming) -> Result<Bytes, ReadError> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(ReadError::TooLarge),
        Err(_) => Err(ReadError::Broken),
    }
}

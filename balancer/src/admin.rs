//! The admin API, on its own listener (never the public port).
//!
//! It must not reach the request path or the dataplane directly: the
//! registry's events carry its changes to them.
//!
//! `POST /workers`, `GET /workers`, `GET /workers/{id}`, `PATCH /workers/{id}`
//! (the `resilience` block) and `DELETE /workers/{id}` (drain, then remove).
//! Owns request parsing and the JSON views; every change goes through the
//! registry, which applies a change whole or not at all, so a request that is
//! rejected changes nothing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use serde::Deserialize;
use serde_json::{Value, json};

use balancer_core::breaker::FailureReason;
use balancer_core::registry::{Registry, RegistryError, Worker};
use balancer_core::spec::{Resilience, WorkerSpec};

use crate::bodies::Inbound;
use crate::fleet::FleetVerdicts;
use crate::proxy::{ErrorCode, ResponseBody, error_response};

/// Called for each worker the API adds.
pub type OnAdded = Box<dyn Fn(&Arc<Worker>) + Send + Sync>;

/// What the admin handlers need besides the registry.
pub struct Admin {
    pub registry: Arc<Registry>,
    pub token: Option<String>,
    /// Spawns the background tasks of a worker added through the API.
    pub on_added: OnAdded,
    /// How long `DELETE` waits for in-flight requests before removing anyway.
    pub drain_timeout: Duration,
    /// Workers are probed (no `--disable-health-check`): one added here is
    /// NotReady until its first passing probe. Unprobed, it starts Ready,
    /// as nothing would ever promote it.
    pub probed: bool,
    /// With `--fleet-verdicts`: the replicas holding open verdicts.
    pub fleet: Option<Arc<FleetVerdicts>>,
}

const MAX_BODY: usize = 1 << 20;

fn respond(status: StatusCode, body: Value) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::new(Full::new(Bytes::from(body.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(code: ErrorCode, message: &str) -> Response<ResponseBody> {
    error_response::<Full<Bytes>>(code, message, None).map(ResponseBody::new)
}

/// `PATCH /workers/{id}` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Patch {
    resilience: Resilience,
}

impl Admin {
    pub async fn handle(self: Arc<Self>, req: Request<Inbound>) -> Response<ResponseBody> {
        if let Some(token) = &self.token {
            let presented = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !presented.is_some_and(|p| constant_time_eq(p.as_bytes(), token.as_bytes())) {
                return error(
                    ErrorCode::Unauthorized,
                    "missing or wrong admin bearer token",
                );
            }
        }
        let path = req.uri().path().trim_end_matches('/').to_owned();
        let method = req.method().clone();
        let id = path.strip_prefix("/workers/").map(str::to_owned);
        match (method, path.as_str(), id) {
            (Method::GET, "/workers", _) => self.list(),
            (Method::POST, "/workers", _) => match read_json::<WorkerSpec>(req).await {
                Ok(spec) => self.add(spec),
                Err(r) => r,
            },
            (Method::GET, _, Some(id)) => match self.registry.fleet().get(&id) {
                Some(w) => respond(StatusCode::OK, self.view(w)),
                None => not_found(&id),
            },
            (Method::PATCH, _, Some(id)) => match read_json::<Patch>(req).await {
                Ok(p) => match self.registry.patch_resilience(&id, &p.resilience) {
                    Ok(w) => respond(StatusCode::OK, self.view(&w)),
                    Err(e) => registry_error(e),
                },
                Err(r) => r,
            },
            // The drain runs in its own task: an admin client that
            // disconnects mid-drain does not leave the worker half removed.
            (Method::DELETE, _, Some(id)) => {
                let this = self.clone();
                match tokio::spawn(async move { this.delete(&id).await }).await {
                    Ok(response) => response,
                    Err(_) => error(ErrorCode::NotFound, "the removal did not complete"),
                }
            }
            _ => error(ErrorCode::NotFound, "no such admin endpoint"),
        }
    }

    fn list(&self) -> Response<ResponseBody> {
        let fleet = self.registry.fleet();
        let workers: Vec<Value> = fleet.workers.iter().map(|w| self.view(w)).collect();
        respond(StatusCode::OK, json!({ "workers": workers }))
    }

    fn add(&self, spec: WorkerSpec) -> Response<ResponseBody> {
        let added = if self.probed {
            self.registry.add_joining(&spec)
        } else {
            self.registry.add(&spec)
        };
        match added {
            Ok(w) => {
                (self.on_added)(&w);
                respond(StatusCode::CREATED, self.view(&w))
            }
            Err(e) => registry_error(e),
        }
    }

    async fn delete(&self, id: &str) -> Response<ResponseBody> {
        let worker = match self.registry.drain(id) {
            Ok(w) => w,
            Err(e) => return registry_error(e),
        };
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        while worker.inflight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let abandoned = worker.inflight();
        self.registry.remove(&worker);
        respond(
            StatusCode::OK,
            json!({ "removed": worker.id, "url": &*worker.url, "abandoned_inflight": abandoned }),
        )
    }

    fn view(&self, w: &Worker) -> Value {
        let s = w.breaker.snapshot();
        let settings = w.breaker.settings();
        let classifier = w.classifier();
        let now = self.registry.clock().now();
        let failures: serde_json::Map<String, Value> = FailureReason::ALL
            .iter()
            .map(|r| (r.as_str().to_owned(), json!(s.failures[*r as usize])))
            .collect();
        let mut view = json!({
            "id": w.id,
            "url": &*w.url,
            "models": *w.models(),
            "labels": w.labels,
            "health": w.health().as_str(),
            "draining": w.is_draining(),
            "inflight": w.inflight(),
            "selected_total": w.selected_total(),
            "breaker": {
                "state": s.state.as_str(),
                "consecutive_failures": s.consecutive_failures,
                "consecutive_successes": s.consecutive_successes,
                "successes": s.successes,
                "failures": failures,
                "transitions": s.transitions_total(),
                "health_readmissions": s.health_readmissions,
                "half_open_inflight": s.half_open_inflight,
                "open_remaining_secs": s.open_until.map(|t| (t.saturating_sub(now)) as f64 / 1e9),
            },
            "resilience": w.resilience(),
            "effective": {
                "cb_failure_threshold": settings.failure_threshold,
                "cb_success_threshold": settings.success_threshold,
                "cb_timeout_secs": settings.open_timeout.as_secs_f64(),
                "capacity_status_codes": classifier.capacity_codes(),
                "retryable_status_codes": classifier.failure_codes(),
                "cb_slow_ttfb_ms": classifier.slow_ttfb().map(|d| d.as_millis()),
                "cb_stream_failures": classifier.stream_failures(),
                "cb_min_completion_tokens": classifier.min_completion_tokens(),
                "cb_l4_signals": classifier.l4_signals(),
            },
        });
        if let Some(fleet) = &self.fleet {
            view["fleet_verdicts"] = json!(fleet.holders(w));
        }
        view
    }
}

/// Compares a presented token with the configured one in time that does not
/// depend on where they differ, so the token cannot be guessed byte by byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(!x);
    }
    diff == 0
}

fn not_found(id: &str) -> Response<ResponseBody> {
    error(ErrorCode::NotFound, &format!("no worker {id}"))
}

fn registry_error(e: RegistryError) -> Response<ResponseBody> {
    match e {
        RegistryError::NotFound(id) => not_found(&id),
        RegistryError::Duplicate(_) => respond(
            StatusCode::CONFLICT,
            json!({"error": {"message": e.to_string(), "type": "invalid_request_error", "code": "duplicate_worker"}}),
        ),
        RegistryError::Invalid(spec) => respond(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": spec.to_string(), "type": "invalid_request_error",
                             "code": "invalid_request", "param": spec.field}}),
        ),
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Inbound>,
) -> Result<T, Response<ResponseBody>> {
    let bytes = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| error(ErrorCode::InvalidRequest, &format!("cannot read body: {e}")))?
        .to_bytes();
    // The path to the value that failed (`resilience.cb_failure_threshold`),
    // which serde_json's own errors leave out for a value of the wrong type.
    let mut json = serde_json::Deserializer::from_slice(&bytes);
    serde_path_to_error::deserialize(&mut json).map_err(|e| {
        let field = e.path().to_string();
        let message = match field.as_str() {
            "." => format!("invalid JSON body: {}", e.inner()),
            _ => format!("invalid JSON body: {field}: {}", e.inner()),
        };
        let param = (field != ".").then_some(field);
        respond(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": message, "type": "invalid_request_error",
                             "code": "invalid_request", "param": param}}),
        )
    })
}

//! The request path, as named phases.
//!
//! Owns one request's life from arrival to the response headers, in this
//! order: the gateway's own endpoints and admission ([`Proxy::handle`]),
//! reading the body ([`body`]), finding the model and the routing key and
//! taking fallbacks ([`route`]), the attempt and retry loop with one breaker
//! charge per worker per request ([`attempt`]), then the worker's body
//! ([`relay`]). The gateway's own answers live in [`answer`], the background
//! health and model probes in [`probe`], the path's own series in [`stats`]. It may read the registry and record
//! on breakers; it never changes the fleet.

mod answer;
mod attempt;
mod body;
mod probe;
mod relay;
mod route;
mod stats;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HeaderName;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use balancer_core::admission::{Admission, Shed};
use balancer_core::clock::Clock;
use balancer_core::registry::Registry;
use balancer_core::ring::hash_key;
use balancer_core::selection::Selector;
use balancer_core::tokens::Tokens;

pub use answer::{ErrorCode, error_response};
pub use attempt::RetryPolicy;
pub use probe::{HealthCheckConfig, Prober};
pub use relay::BoxError;
pub use stats::GatewayStats;

use answer::json_response;
use body::{RequestBody, read_body};
use route::{Outgoing, forward_headers, request_model};

/// Names the fallback a response took: `requested->served`.
pub const FALLBACK_HEADER: &str = "x-balancer-fallback";

/// The body type of every response the gateway sends.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;
/// The body type of every request the gateway sends to a worker.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;
/// A connection pool to the workers. Each serving thread has its own, so a
/// request and its upstream connection are polled on the same thread and no
/// lock or wake-up crosses threads on the request path.
pub type UpstreamClient = Client<HttpConnector, UpstreamBody>;

/// What the request path is told at start.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    pub retry: RetryPolicy,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub stream_idle_timeout: Duration,
    pub max_replay_body: usize,
    pub routing_key_header: HeaderName,
    /// `--fallback-model MODEL=OTHER`, validated free of cycles.
    pub fallbacks: HashMap<String, String>,
}

/// The request path shared by every serving thread.
pub struct Proxy {
    registry: Arc<Registry>,
    selector: Selector,
    config: ProxyConfig,
    admission: Option<Arc<Admission>>,
    stats: Arc<GatewayStats>,
    tokens: Arc<Tokens>,
    clock: Arc<dyn Clock>,
}

impl Proxy {
    pub fn new(
        registry: Arc<Registry>,
        selector: Selector,
        config: ProxyConfig,
        admission: Option<Arc<Admission>>,
        stats: Arc<GatewayStats>,
        tokens: Arc<Tokens>,
    ) -> Self {
        let clock = registry.clock().clone();
        Self {
            registry,
            selector,
            config,
            admission,
            stats,
            tokens,
            clock,
        }
    }

    pub fn tokens(&self) -> &Arc<Tokens> {
        &self.tokens
    }

    /// A new connection pool to the workers, for one serving thread.
    pub fn client(&self) -> UpstreamClient {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(self.config.connect_timeout));
        connector.set_nodelay(true);
        Client::builder(TokioExecutor::new())
            // A request is never resent behind the retry loop's back.
            .retry_canceled_requests(false)
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector)
    }

    pub fn admission(&self) -> Option<&Admission> {
        self.admission.as_deref()
    }

    pub fn stats(&self) -> &Arc<GatewayStats> {
        &self.stats
    }

    pub async fn handle(
        &self,
        client: &UpstreamClient,
        req: Request<Incoming>,
    ) -> Response<ResponseBody> {
        let started = Instant::now();
        if req.method() == Method::GET {
            match req.uri().path() {
                "/health" | "/liveness" => {
                    return json_response(StatusCode::OK, serde_json::json!({"status": "ok"}));
                }
                "/readiness" => return self.readiness(),
                _ => {}
            }
        }
        let permit = match &self.admission {
            None => None,
            Some(a) => match a.admit().await {
                Ok(p) => Some(p),
                Err(shed) => {
                    let (code, msg) = match shed {
                        Shed::QueueFull => {
                            (ErrorCode::AdmissionQueueFull, "the admission queue is full")
                        }
                        Shed::QueueTimeout => (
                            ErrorCode::AdmissionQueueTimeout,
                            "the request waited too long for admission",
                        ),
                    };
                    return self.gateway_error(code, msg, Some(a.retry_after_secs()));
                }
            },
        };
        let (parts, body) = req.into_parts();
        let body = match read_body(body, self.config.max_replay_body).await {
            Ok(b) => b,
            Err(e) => {
                return self.gateway_error(
                    ErrorCode::InvalidRequest,
                    &format!("could not read the request body: {e}"),
                    None,
                );
            }
        };
        let model = match &body {
            RequestBody::Replayable(bytes) => match request_model(&parts.headers, bytes) {
                Ok(m) => m,
                Err(msg) => return self.gateway_error(ErrorCode::InvalidRequest, &msg, None),
            },
            RequestBody::Streaming(..) => None,
        };
        let key = parts
            .headers
            .get(&self.config.routing_key_header)
            .map(|v| hash_key(v.as_bytes()));
        let headers = forward_headers(parts.headers);
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let mut request = Outgoing {
            method: parts.method,
            path,
            headers,
            model,
            key,
            fallback_from: None,
        };
        let mut body = Some(body);
        while let Some(wait) = request
            .model
            .as_deref()
            .and_then(|m| self.tokens.budget_exceeded(m, self.clock.now()))
        {
            if !self.take_fallback(&mut request, &mut body) {
                let model = request.model.as_deref().unwrap_or_default();
                return self.gateway_error(
                    ErrorCode::TokenBudgetExceeded,
                    &format!("the token budget of model {model:?} is spent for this minute"),
                    Some(wait),
                );
            }
        }
        let body = body.expect("a request body is only ever swapped for another");
        self.attempts(client, request, body, permit, started).await
    }

    fn readiness(&self) -> Response<ResponseBody> {
        let fleet = self.registry.fleet();
        let healthy = fleet.workers.iter().filter(|w| w.is_routable()).count();
        let total = fleet.workers.len();
        let (status, word) = if healthy > 0 {
            (StatusCode::OK, "ready")
        } else {
            (StatusCode::SERVICE_UNAVAILABLE, "not_ready")
        };
        json_response(
            status,
            serde_json::json!({"status": word, "healthy_workers": healthy, "total_workers": total}),
        )
    }
}

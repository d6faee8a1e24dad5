//! The request path, as named phases.
//!
//! Owns one request's life from arrival to the response headers, in this
//! order: the gateway's own endpoints and admission ([`Lane::handle`]),
//! reading the body ([`body`]), finding the model and the routing key and
//! taking fallbacks ([`route`], with [`scan`] reading the common body's
//! model in one pass, and [`prompt`] the prompt under `cache_aware`), the
//! attempt and retry loop with one breaker charge per worker per request ([`attempt`], its timeouts on the thread's
//! kept timers in [`deadline`]), then the worker's body
//! ([`relay`]). The gateway's own answers live in [`answer`] (what it says
//! about models in [`models`]), the background
//! health and model probes in [`probe`] and the workers' load scrapes in
//! [`load_monitor`], the path's own series in [`stats`]. It may read the registry and record
//! on breakers; it never changes the fleet.

mod access;
mod answer;
mod attempt;
mod body;
mod deadline;
mod edge;
mod json_check;
mod load_monitor;
mod models;
mod probe;
mod prompt;
mod relay;
mod route;
mod scan;
mod stats;

use std::borrow::Cow;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HeaderName;
use http::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use balancer_core::admission::{Admission, Shed};
use balancer_core::clock::Clock;
use balancer_core::registry::Registry;
use balancer_core::ring::hash_key;
use balancer_core::selection::{Policy, Selector};
use balancer_core::tokens::{Allowance, ModelTokens, Tokens};

pub use crate::bodies::{BoxError, Inbound, ResponseBody, UpstreamBody};
pub use answer::{ErrorCode, error_response};
pub use attempt::RetryPolicy;
pub use body::BufferBudget;
pub(crate) use edge::Forwarded;
pub use edge::Routes;
pub use load_monitor::{DEFAULT_LOAD_MONITOR_INTERVAL, LoadMonitor, LoadMonitorConfig};
pub use probe::{HealthCheckConfig, Prober, served_models};
pub use stats::GatewayStats;

use crate::h1::H1Pool;
use crate::server::Peer;
use crate::tls::{WorkerConnector, WorkerTls};
use crate::wire::Headers;
use answer::json_response;
use body::{BodyError, BodyLimits, RequestBody, read_body};
use edge::{Route, request_id};
use route::{
    MAX_MODEL_LEN, Outgoing, inference_model, model_in_prefix, request_model, with_usage_requested,
};

/// How long an idle connection to a worker is kept for the next request.
const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Names the fallback a response took: `requested->served`.
pub const FALLBACK_HEADER: &str = "x-balancer-fallback";

/// The connection pools to the workers. Each serving thread has its own, so
/// a request and its upstream connection are polled on the same thread and
/// no lock or wake-up crosses threads on the request path.
pub struct UpstreamClient {
    /// The fast path: bodies the gateway holds whole, to workers at a known
    /// address.
    h1: H1Pool,
    /// Everything else: streamed request bodies, host names not resolved
    /// yet.
    hyper: Client<WorkerConnector, UpstreamBody>,
    /// The attempts' request timeouts.
    timers: deadline::Timers,
}

/// What the request path is told at start.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    pub retry: RetryPolicy,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub stream_idle_timeout: Duration,
    pub max_replay_body: usize,
    pub routing_key_header: HeaderName,
    /// `--request-id-headers`: never empty; the first names a made id.
    pub request_id_headers: Vec<HeaderName>,
    /// `--access-log`: one `access` event per request.
    pub access_log: bool,
    /// `--fallback-model MODEL=OTHER`, validated free of cycles.
    pub fallbacks: HashMap<String, String>,
    /// The routes forwarded: the defaults plus `--allow-path`.
    pub routes: Routes,
    /// `--max-payload-size`: the largest request body, in bytes.
    pub max_payload: u64,
    /// `--stream-body-stall-timeout-secs`: a request body silent this long
    /// gets 408.
    pub body_stall_timeout: Duration,
    /// `--max-buffered-bytes-total`: bytes all kept request bodies may hold.
    pub buffered_bytes_total: usize,
    /// `--trusted-proxy-hops`: proxies in front whose `X-Forwarded-For` is kept.
    pub trusted_proxy_hops: u32,
    /// `--route-undeclared-models`: a model no worker declares goes to any
    /// worker rather than getting 404 `model_not_found`.
    pub route_undeclared_models: bool,
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
    body_limits: BodyLimits,
    /// How `https://` workers are dialled, shared by every pool.
    worker_tls: Arc<WorkerTls>,
    /// When the gateway started, in Unix seconds: the `created` of the
    /// models it lists.
    started_unix: u64,
}

impl Proxy {
    pub fn new(
        registry: Arc<Registry>,
        selector: Selector,
        config: ProxyConfig,
        admission: Option<Arc<Admission>>,
        stats: Arc<GatewayStats>,
        tokens: Arc<Tokens>,
        worker_tls: Arc<WorkerTls>,
    ) -> Self {
        let clock = registry.clock().clone();
        let body_limits = BodyLimits {
            max_payload: config.max_payload,
            max_buffered: config.max_replay_body,
            stall: config.body_stall_timeout,
            budget: BufferBudget::new(config.buffered_bytes_total),
        };
        Self {
            body_limits,
            registry,
            selector,
            config,
            admission,
            stats,
            tokens,
            clock,
            worker_tls,
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    pub fn tokens(&self) -> &Arc<Tokens> {
        &self.tokens
    }

    /// New connection pools to the workers, for one serving thread.
    fn client(&self) -> UpstreamClient {
        UpstreamClient {
            h1: H1Pool::new(
                self.config.connect_timeout,
                UPSTREAM_IDLE_TIMEOUT,
                self.worker_tls.clone(),
            ),
            hyper: Client::builder(TokioExecutor::new())
                // A request is never resent behind the retry loop's back.
                .retry_canceled_requests(false)
                .pool_idle_timeout(UPSTREAM_IDLE_TIMEOUT)
                .build(self.worker_tls.connector(self.config.connect_timeout)),
            timers: deadline::Timers::default(),
        }
    }

    pub fn admission(&self) -> Option<&Admission> {
        self.admission.as_deref()
    }

    pub fn stats(&self) -> &Arc<GatewayStats> {
        &self.stats
    }

    /// The counters a response's tokens go to. They carry the model's name
    /// when a worker declares it or the configuration names it, `other`
    /// otherwise, so a client cannot grow the metrics by inventing names.
    pub(crate) fn model_tokens(&self, model: &str) -> Arc<ModelTokens> {
        // Counters exist only for the budgeted models and under names found
        // known when first counted: one lookup for every model but a new
        // one.
        if let Some(tokens) = self.tokens.existing(model) {
            return tokens;
        }
        let known = self.registry.fleet().declares(model)
            || self
                .config
                .fallbacks
                .iter()
                .any(|(from, to)| from == model || to == model);
        self.tokens.counters(if known { model } else { "other" })
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

/// What the request path does with an untrusted method, path and body
/// before any worker is involved; see [`crate::fuzzing`].
pub(crate) fn fuzz_request_body(method: &Method, path: &str, body: &Bytes) {
    let _ = Routes::new(&["/x/*".to_owned()]).route(method, path);
    let _ = inference_model(body);
    let _ = request_model(&Headers::default(), body);
    let _ = with_usage_requested(body);
    let _ = route::with_model(body, "m");
}

/// One serving thread's way through the request path: the shared [`Proxy`]
/// and the thread's own connection pools.
pub struct Lane {
    proxy: Arc<Proxy>,
    client: UpstreamClient,
}

impl Lane {
    pub fn new(proxy: Arc<Proxy>) -> Self {
        let client = proxy.client();
        Self { proxy, client }
    }

    /// One request, phase by phase: the gateway's own endpoints, the edge
    /// (route and method), the body under its bounds, the model, admission,
    /// token budgets and fallbacks, then the attempts.
    ///
    /// Boxed: the future is large (~4 KiB, mostly room for later states).
    /// Unboxed it would be copied at every hand-over on its way into
    /// hyper's dispatcher, and it would be part of every connection's task,
    /// idle ones too (10,000 idle connections took 14.3 KiB each instead of
    /// 3.3). The box is allocated before the future is built, so the
    /// compiler writes the new future's few fields (the request, 312 bytes
    /// of them) straight into it: `Box::pin(future)` builds it on the stack
    /// and copies it, and each closure between the caller and this block
    /// copies the request once more. An async block, not an async
    /// function: a function's future keeps each argument twice (as passed,
    /// and as the local it becomes), where a block uses what it captured in
    /// place.
    pub fn handle(
        self: Arc<Self>,
        mut req: Request<Inbound>,
        peer: Peer,
    ) -> Pin<Box<impl Future<Output = Response<ResponseBody>> + Send + 'static>> {
        let slot = Box::new_uninit();
        Box::into_pin(Box::write(slot, async move {
            let proxy = &*self.proxy;
            let started = Instant::now();
            // The gateway's own endpoints; HEAD answers as GET, without
            // the body (hyper sends none for HEAD).
            let own = matches!(*req.method(), Method::GET | Method::HEAD);
            match req.uri().path() {
                "/health" | "/liveness" if own => {
                    return json_response(StatusCode::OK, serde_json::json!({"status": "ok"}));
                }
                "/readiness" if own => return proxy.readiness(),
                "/health" | "/liveness" | "/readiness" => {
                    return proxy.method_not_allowed("GET, HEAD");
                }
                _ => {}
            }
            let mut card = None;
            let (path, inference) = match proxy.config.routes.route(req.method(), req.uri().path())
            {
                Route::Inference(path) => (Cow::Borrowed(path), true),
                Route::ModelList => return proxy.model_list(),
                Route::ModelCard { path, id } => {
                    if proxy.refuses_model(&id) {
                        return proxy.model_not_found(&id);
                    }
                    card = Some(id);
                    (Cow::Owned(path), false)
                }
                Route::Forward(path) => (Cow::Owned(path), false),
                Route::MethodNotAllowed(allow) => return proxy.method_not_allowed(allow),
                Route::NotFound => {
                    return proxy.gateway_error(
                        ErrorCode::NotFound,
                        "this gateway forwards no such route",
                        None,
                    );
                }
                Route::BadPath => {
                    return proxy.gateway_error(
                        ErrorCode::InvalidRequest,
                        "the request path is malformed",
                        None,
                    );
                }
            };
            let proto = if peer.tls { "https" } else { "http" };
            // The request's parts are used where they lie in this future
            // (taken piece by piece), not moved out of it whole: each move
            // of a value this size is a copy into lines of memory the request
            // had not touched yet.
            // The fast path's fields as they came, or hyper's map: both are
            // read through one view.
            let headers = Headers {
                map: std::mem::take(req.headers_mut()),
                raw: req.body_mut().take_fields(),
            };
            // Only with `--request-id-headers` (or `--access-log`): an id
            // looked up, made, forwarded and returned costs ~1,400
            // instructions a request, 6% of the whole path.
            let names = &proxy.config.request_id_headers;
            let id = (!names.is_empty()).then(|| request_id(&headers, names));
            // Only with the flag: the default path builds nothing for it.
            let access = proxy.config.access_log.then(|| access::Record {
                method: req.method().clone(),
                path: req.uri().path().to_owned(),
                request_id: id
                    .as_ref()
                    .map_or(http::HeaderValue::from_static("-"), |id| id.value.clone()),
                started,
            });
            // A labelled block, not an inner async block: an inner future
            // would be built and then moved whole (its ~4 KiB) into this one.
            let mut response = 'answer: {
                // RFC 9112 3.2: an HTTP/1.1 request names exactly one host (as
                // nginx holds it); HTTP/2 names it in `:authority`.
                if req.version() == http::Version::HTTP_11
                    && headers.get_all(&http::header::HOST).take(2).count() != 1
                {
                    break 'answer proxy.gateway_error(
                        ErrorCode::InvalidRequest,
                        "an HTTP/1.1 request must carry exactly one Host header",
                        None,
                    );
                }
                // Read before admission, under the stall deadline: a client that
                // sends half a body never holds a permit.
                let mut body =
                    match read_body(&headers.map, req.body_mut(), &proxy.body_limits).await {
                        Ok(b) => b,
                        Err(e) => break 'answer proxy.body_error(&e),
                    };
                let model = match &mut body {
                    RequestBody::Replayable(bytes, _) if inference => inference_model(bytes),
                    RequestBody::Replayable(bytes, _) => request_model(&headers, bytes),
                    // Past the buffered limit only the prefix is here: an inference
                    // body must name its model there to be routed by it.
                    RequestBody::Streaming(prefix, rest) if inference => {
                        if let Err(e) = rest.check_json(prefix) {
                            break 'answer proxy.body_error(&BodyError::Invalid(e));
                        }
                        match model_in_prefix(&prefix.concat()) {
                            Some(m) if m.len() > MAX_MODEL_LEN => Err(format!(
                                "the model name is longer than {MAX_MODEL_LEN} bytes"
                            )),
                            Some(m) => Ok(Some(m)),
                            None => {
                                break 'answer proxy.gateway_error(
                                ErrorCode::PayloadTooLarge,
                                "an inference body larger than --max-buffered-request-bytes must name its model within that many bytes",
                                None,
                            );
                            }
                        }
                    }
                    RequestBody::Streaming(..) => Ok(None),
                };
                let model = match model {
                    // A model card goes to a worker serving that model.
                    Ok(m) => card.or(m),
                    Err(msg) => {
                        break 'answer proxy.gateway_error(ErrorCode::InvalidRequest, &msg, None);
                    }
                };
                // Refused before admission: only a model with a fallback goes
                // on, to take it below.
                if let Some(m) = model.as_deref()
                    && proxy.refuses_model(m)
                    && !proxy.config.fallbacks.contains_key(m)
                {
                    break 'answer proxy.model_not_found(m);
                }
                let permit = match &proxy.admission {
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
                            break 'answer proxy.gateway_error(
                                code,
                                msg,
                                Some(a.retry_after_secs()),
                            );
                        }
                    },
                };
                // Only consistent hashing routes by key: other policies are spared
                // the lookup of a custom header name (hashed byte by byte).
                let key = (proxy.selector.policy() == Policy::ConsistentHash)
                    .then(|| headers.get(&proxy.config.routing_key_header))
                    .flatten()
                    .map(hash_key);
                let prompt = match &body {
                    RequestBody::Replayable(bytes, _)
                        if inference && proxy.selector.policy() == Policy::CacheAware =>
                    {
                        prompt::prompt_text(bytes)
                    }
                    _ => None,
                };
                let mut headers = Forwarded::new(
                    headers,
                    peer.addr.ip(),
                    proto,
                    proxy.config.trusted_proxy_hops,
                );
                if let Some(id) = &id
                    && id.made
                {
                    headers = headers.with_request_id(id.name.clone(), id.value.clone());
                }
                let path = match req.uri().query() {
                    Some(query) => Cow::Owned(format!("{path}?{query}")),
                    None => path,
                };
                let mut request = Outgoing {
                    method: req.method().clone(),
                    path,
                    headers,
                    model,
                    key,
                    fallback_from: None,
                    prompt,
                };
                let mut body = Some(body);
                // An undeclared model with a fallback takes it now: any worker
                // would answer the undeclared one as its own. Without
                // fallbacks the check before admission said all there is.
                while let Some(model) = request.model.as_deref()
                    && !proxy.config.fallbacks.is_empty()
                    && proxy.refuses_model(model)
                {
                    if !proxy.take_fallback(&mut request, body.as_mut()) {
                        let model = request.model.clone().unwrap_or_default();
                        break 'answer proxy.model_not_found(&model);
                    }
                }
                let mut budgeted = false;
                while let Some(model) = request.model.as_deref() {
                    match proxy.tokens.allowance(model, || proxy.clock.now()) {
                        Allowance::Unbudgeted => break,
                        Allowance::Within => {
                            budgeted = true;
                            break;
                        }
                        Allowance::Spent(wait) => {
                            if !proxy.take_fallback(&mut request, body.as_mut()) {
                                let model = request.model.as_deref().unwrap_or_default();
                                break 'answer proxy.gateway_error(
                                    ErrorCode::TokenBudgetExceeded,
                                    &format!(
                                        "the token budget of model {model:?} is spent for this minute"
                                    ),
                                    Some(wait),
                                );
                            }
                        }
                    }
                }
                // A budget counts streamed tokens only if the worker reports them.
                if budgeted
                    && let Some(RequestBody::Replayable(bytes, _)) = &mut body
                    && let Some(asking) = with_usage_requested(bytes)
                {
                    *bytes = asking;
                }
                proxy
                    .attempts(&self.client, &mut request, &mut body, permit, started)
                    .await
            };
            // Every answer from here on carries the id, the gateway's own
            // too, so a client can quote it.
            if let Some(id) = id {
                response.body_mut().set_request_id(id.name, id.value);
            }
            match access {
                Some(record) => record.attach(response),
                None => response,
            }
        }))
    }
}

//! The request path: admission, worker selection, attempts and retries.
//!
//! Owns one request's life from arrival to the response headers: it reads
//! (and, within a limit, keeps) the body, finds the model, admits, selects a
//! worker per attempt, classifies each attempt's outcome for that worker's
//! breaker (one charge per worker per request), retries with backoff, and
//! hands the chosen response to [`crate::relay`] for the body. It may read the
//! registry and record on breakers; it never changes the fleet.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::admission::{Admission, Permit, Shed};
use crate::breaker::{FailureReason, Outcome, RequestCharges};
use crate::clock::Clock;
use crate::config::RetryPolicy;
use crate::error::{ErrorCode, error_chain, error_response};
use crate::metrics::GatewayStats;
use crate::relay::{BoxError, Completion, RelayBody};
use crate::selection::{Selector, hash_key};
use crate::tokens::Tokens;
use crate::worker::{Registry, Worker};

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

/// Statuses after which an attempt is retried. Deliberately not the
/// per-worker failure list: the document says `retryable_status_codes` does
/// not change which responses the gateway retries.
const RETRY_STATUSES: [u16; 6] = [408, 429, 500, 502, 503, 504];

/// Headers that describe one hop, not the message.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

#[derive(Debug, Clone)]
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

pub struct Proxy {
    registry: Arc<Registry>,
    selector: Selector,
    config: ProxyConfig,
    admission: Option<Admission>,
    stats: Arc<GatewayStats>,
    tokens: Arc<Tokens>,
    clock: Arc<dyn Clock>,
}

/// The request body as the attempts see it.
enum RequestBody {
    /// Small enough to keep: every attempt sends a copy.
    Replayable(Bytes),
    /// Too large to keep: the prefix read so far and the rest, for one attempt.
    Streaming(Vec<Bytes>, Incoming),
}

fn boxed<B>(body: B) -> UnsyncBoxBody<Bytes, BoxError>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

fn json_response(status: StatusCode, body: serde_json::Value) -> Response<ResponseBody> {
    let mut r = Response::new(boxed(Full::new(Bytes::from(body.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// How an attempt ended, when it did not produce a response to relay.
enum AttemptError {
    Timeout,
    Unreachable(String),
}

impl Proxy {
    pub fn new(
        registry: Arc<Registry>,
        selector: Selector,
        config: ProxyConfig,
        admission: Option<Admission>,
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
        self.admission.as_ref()
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

    /// The retry loop.
    async fn attempts(
        &self,
        client: &UpstreamClient,
        mut req: Outgoing,
        body: RequestBody,
        permit: Option<Permit>,
        started: Instant,
    ) -> Response<ResponseBody> {
        let mut charges = RequestCharges::default();
        let mut tried: Vec<u64> = Vec::new();
        let (max_attempts, mut body) = match body {
            RequestBody::Replayable(b) => (
                self.config.retry.max_attempts,
                Some(RequestBody::Replayable(b)),
            ),
            streaming => (1, Some(streaming)),
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let last = attempt >= max_attempts;
            let Some((worker, ticket)) = self.select(&req, &tried) else {
                if self.take_fallback(&mut req, &mut body) {
                    // Finding no worker was not an attempt.
                    attempt -= 1;
                    continue;
                }
                return self.no_available_workers(req.model.as_deref());
            };
            let attempt_started = Instant::now();
            tried.push(worker.breaker.id());
            let guard = worker.start_request();
            let upstream_body = match body.take() {
                Some(RequestBody::Replayable(b)) => {
                    body = Some(RequestBody::Replayable(b.clone()));
                    boxed(Full::new(b))
                }
                Some(RequestBody::Streaming(prefix, rest)) => chain(prefix, rest),
                None => unreachable!("a streaming body gets exactly one attempt"),
            };
            let classifier = worker.classifier();
            let send = self.send(client, &worker, &req, upstream_body);
            // `None` once the ticket was handed back to the breaker.
            let mut ticket = Some(ticket);
            let result = match classifier.slow_ttfb() {
                None => send.await,
                Some(budget) => {
                    tokio::pin!(send);
                    tokio::select! {
                        r = &mut send => r,
                        () = tokio::time::sleep(budget) => {
                            // Slow is already certain: charge it now, so the
                            // breaker reacts at the budget rather than when
                            // the worker finally answers. The answer still
                            // goes to the client.
                            if let Some(t) = ticket.take() {
                                let slow = Outcome::Failure(FailureReason::Slow);
                                charges.record(&worker.breaker, t, slow, &*self.clock);
                            }
                            send.await
                        }
                    }
                }
            };
            let failure = match result {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let outcome = classifier.classify(status);
                    let retryable = RETRY_STATUSES.contains(&status);
                    if retryable && !last {
                        let retry_after = retry_after(response.headers());
                        if let Some(t) = ticket {
                            charges.record(&worker.breaker, t, outcome, &*self.clock);
                        }
                        drop(response);
                        self.stats.retry();
                        tokio::time::sleep(self.config.retry.backoff(attempt, retry_after)).await;
                        continue;
                    }
                    if retryable {
                        self.stats.retries_exhausted();
                    }
                    self.stats.ttfb.observe(started.elapsed().as_secs_f64());
                    self.stats.upstream_response(status);
                    let pending = match ticket {
                        Some(t) if outcome == Outcome::Success => Some((t, charges)),
                        Some(t) => {
                            charges.record(&worker.breaker, t, outcome, &*self.clock);
                            None
                        }
                        None => None,
                    };
                    let completion = Completion {
                        guard,
                        pending,
                        permit,
                        started,
                        attempt_started,
                        headers_after: attempt_started.elapsed(),
                        classifier,
                        tokens: req.model.clone().map(|m| (self.tokens.clone(), m)),
                        stats: self.stats.clone(),
                        clock: self.clock.clone(),
                    };
                    let fallback = req
                        .fallback_from
                        .as_ref()
                        .zip(req.model.as_ref())
                        .map(|(from, to)| format!("{from}->{to}"));
                    return self.relay(response, completion, fallback);
                }
                Err(e) => e,
            };
            let reason = match failure {
                AttemptError::Timeout => FailureReason::Timeout,
                AttemptError::Unreachable(_) => FailureReason::Connect,
            };
            if let Some(t) = ticket {
                charges.record(&worker.breaker, t, Outcome::Failure(reason), &*self.clock);
            }
            drop(guard);
            if !last {
                self.stats.retry();
                tokio::time::sleep(self.config.retry.backoff(attempt, None)).await;
                continue;
            }
            self.stats.retries_exhausted();
            return match failure {
                AttemptError::Timeout => self.gateway_error(
                    ErrorCode::UpstreamTimeout,
                    "the worker did not answer within the request timeout",
                    None,
                ),
                AttemptError::Unreachable(e) => self.gateway_error(
                    ErrorCode::UpstreamUnreachable,
                    &format!("the worker could not be reached: {e}"),
                    None,
                ),
            };
        }
    }

    /// Switches a request to its model's fallback model: the body's `model`
    /// is rewritten and the response will name the fallback. Only a body kept
    /// for replay can be rewritten.
    fn take_fallback(&self, req: &mut Outgoing, body: &mut Option<RequestBody>) -> bool {
        let Some(from) = req.model.as_deref() else {
            return false;
        };
        let Some(to) = self.config.fallbacks.get(from) else {
            return false;
        };
        let Some(RequestBody::Replayable(bytes)) = body.as_ref() else {
            return false;
        };
        let Some(rewritten) = with_model(bytes, to) else {
            return false;
        };
        tracing::debug!(from, to, "model fallback");
        self.stats.fallback(from, to);
        req.fallback_from.get_or_insert_with(|| from.to_owned());
        req.model = Some(to.clone());
        *body = Some(RequestBody::Replayable(rewritten));
        true
    }

    /// Picks an eligible worker and reserves its breaker admission. A lost
    /// race for a limited half-open slot just moves on to another worker.
    fn select(
        &self,
        req: &Outgoing,
        tried: &[u64],
    ) -> Option<(Arc<Worker>, crate::breaker::Ticket)> {
        let fleet = self.registry.fleet();
        let (candidates, ring) = fleet.candidates(req.model.as_deref());
        // Copied only when a race for a limited half-open slot is lost.
        let mut skip = std::borrow::Cow::Borrowed(tried);
        for _ in 0..4 {
            let worker = self
                .selector
                .select(candidates, ring, req.key, &skip, &*self.clock)?;
            if let Some(ticket) = worker.breaker.admit(&*self.clock) {
                return Some((worker, ticket));
            }
            skip.to_mut().push(worker.breaker.id());
        }
        None
    }

    async fn send(
        &self,
        client: &UpstreamClient,
        worker: &Worker,
        req: &Outgoing,
        body: UpstreamBody,
    ) -> Result<Response<Incoming>, AttemptError> {
        let uri = Uri::builder()
            .scheme("http")
            .authority(worker.address.authority.clone())
            .path_and_query(req.path.as_str())
            .build()
            .map_err(|e| AttemptError::Unreachable(e.to_string()))?;
        let mut upstream = Request::new(body);
        *upstream.method_mut() = req.method.clone();
        *upstream.uri_mut() = uri;
        *upstream.headers_mut() = req.headers.clone();
        match tokio::time::timeout(self.config.request_timeout, client.request(upstream)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) => Err(AttemptError::Unreachable(error_chain(&e))),
            Err(_) => Err(AttemptError::Timeout),
        }
    }

    fn relay(
        &self,
        response: Response<Incoming>,
        completion: Completion,
        fallback: Option<String>,
    ) -> Response<ResponseBody> {
        let (mut parts, body) = response.into_parts();
        if let Some(v) = fallback.and_then(|f| HeaderValue::try_from(f).ok()) {
            parts.headers.insert(FALLBACK_HEADER, v);
        }
        for h in HOP_BY_HOP {
            parts.headers.remove(h);
        }
        parts.headers.remove(HeaderName::from_static("keep-alive"));
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        if sse {
            // The relay may append an error event to a cut stream.
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        let relay = RelayBody::new(body, sse, self.config.stream_idle_timeout, completion);
        Response::from_parts(parts, boxed(relay))
    }

    fn gateway_error(
        &self,
        code: ErrorCode,
        message: &str,
        retry_after: Option<u64>,
    ) -> Response<ResponseBody> {
        self.stats.gateway_response(code);
        error_response::<Full<Bytes>>(code, message, retry_after).map(boxed)
    }

    /// 503 `no_available_workers`, with `Retry-After` set to when the first
    /// open circuit among the model's workers goes on trial.
    fn no_available_workers(&self, model: Option<&str>) -> Response<ResponseBody> {
        let fleet = self.registry.fleet();
        let (candidates, _) = fleet.candidates(model);
        let now = self.clock.now();
        let soonest = candidates
            .iter()
            .filter_map(|w| w.breaker.snapshot().open_until)
            .min()
            .map(|at| {
                Duration::from_nanos(at.saturating_sub(now))
                    .as_secs_f64()
                    .ceil() as u64
            });
        let message = match model {
            Some(m) => format!("no available workers for model {m:?}"),
            None => "no available workers".to_owned(),
        };
        self.gateway_error(
            ErrorCode::NoAvailableWorkers,
            &message,
            Some(soonest.unwrap_or(1).max(1)),
        )
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

/// What every attempt of one request sends.
struct Outgoing {
    method: Method,
    path: String,
    headers: HeaderMap,
    model: Option<String>,
    key: Option<u64>,
    /// The model the client asked for, when a fallback replaced it.
    fallback_from: Option<String>,
}

/// `body` with its `model` replaced, if it is a JSON object.
fn with_model(body: &Bytes, model: &str) -> Option<Bytes> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value
        .as_object_mut()?
        .insert("model".to_owned(), model.into());
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

fn forward_headers(mut headers: HeaderMap) -> HeaderMap {
    for h in HOP_BY_HOP {
        headers.remove(h);
    }
    headers.remove(HeaderName::from_static("keep-alive"));
    // The worker's authority comes from the URI; hyper sets Host from it.
    headers.remove(header::HOST);
    // The body may be rewritten (a fallback's model); hyper sets the length
    // of the body actually sent.
    headers.remove(header::CONTENT_LENGTH);
    headers
}

fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let secs: f64 = headers
        .get(header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}

async fn read_body(mut body: Incoming, limit: usize) -> Result<RequestBody, hyper::Error> {
    let mut buf = BytesMut::new();
    let mut parts = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if buf.len() + data.len() > limit {
            parts.push(buf.freeze());
            parts.push(data);
            return Ok(RequestBody::Streaming(parts, body));
        }
        buf.extend_from_slice(&data);
    }
    Ok(RequestBody::Replayable(buf.freeze()))
}

/// The prefix already read, then the rest of the client's body.
fn chain(prefix: Vec<Bytes>, rest: Incoming) -> UpstreamBody {
    boxed(Chained {
        prefix: prefix.into(),
        rest,
    })
}

struct Chained {
    prefix: std::collections::VecDeque<Bytes>,
    rest: Incoming,
}

impl hyper::body::Body for Chained {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.prefix.pop_front() {
            Some(chunk) => std::task::Poll::Ready(Some(Ok(Frame::data(chunk)))),
            None => std::pin::Pin::new(&mut self.rest).poll_frame(cx),
        }
    }
}

/// The `model` of a JSON body. A body that claims to be JSON and is not gets
/// a 400 here rather than a worker's error, and records nothing.
fn request_model(headers: &HeaderMap, body: &Bytes) -> Result<Option<String>, String> {
    #[derive(serde::Deserialize)]
    struct ModelOnly {
        #[serde(default)]
        model: Option<serde_json::Value>,
    }
    let declared_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.contains("json"));
    let looks_json = body.first() == Some(&b'{');
    if body.is_empty() || !(declared_json || looks_json) {
        return Ok(None);
    }
    match serde_json::from_slice::<ModelOnly>(body) {
        Ok(ModelOnly {
            model: Some(serde_json::Value::String(m)),
        }) => Ok(Some(m)),
        Ok(_) => Ok(None),
        Err(e) if declared_json => Err(format!("the request body is not valid JSON: {e}")),
        Err(_) => Ok(None),
    }
}

//! The demo inference worker: an OpenAI-compatible HTTP/1.1 server that
//! misbehaves on command.
//!
//! This module owns the fake worker used by the unit and end-to-end tests, the
//! demo (`cargo xtask run`, `balancer mock-worker`) and the proxy benchmarks. It
//! answers `GET /health`, `GET /v1/models`, `POST /v1/chat/completions` and
//! `POST /v1/completions` (plain JSON and `stream: true` SSE), and exposes a
//! control API under `/_mock/` to inject faults (error statuses, latency,
//! dropped connections, stalled or truncated streams, failing health checks)
//! and to read request counters.
//!
//! It is a test and demo fixture only: the gateway's request path must never
//! depend on it, and it must not reach into the gateway's state (breakers,
//! routing, eBPF maps). It only talks HTTP to whoever connects to it. Because a
//! proxy benchmark measures the balancer *through* this worker, the request
//! path stays lock-free: counters are atomics and the fault spec is read
//! through an `ArcSwap`.
//!
//! Fault semantics, in the order they are applied to a `/v1/*` request that a
//! fault matches (see [`Fault`]): `latency_ms`, then `drop`, then `status`,
//! else a normal answer, slowed by `token_delay_ms` and cut by
//! `stall_after_chunks` / `truncate_after_chunks`. `health_status` is
//! independent: it only changes `/health` and ignores `count` and `every`.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, Sleep};

/// Header carried by every response so tests can tell workers apart.
pub const WORKER_HEADER: &str = "x-mock-worker";

/// Request bodies above this are answered with 413; inference prompts in the
/// demo are tiny, and an unbounded buffer would let a bad client eat memory.
const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

const JSON: &str = "application/json";
const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// Deterministic "generated" text: the worker cycles through these, one per token.
const WORDS: [&str; 8] = [
    "Lorem",
    " ipsum",
    " dolor",
    " sit",
    " amet",
    ",",
    " consectetur",
    " adipiscing",
];

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
}

impl Default for MockWorkerConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            model: "demo-model".to_owned(),
            token_delay: Duration::ZERO,
            default_tokens: 8,
            max_tokens_cap: 4096,
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
/// `truncate_after_chunks`, `token_delay_ms`) apply to; `health_status` is not
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
    }
}

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
}

/// A running worker. Dropping it stops it too, without waiting.
pub struct MockWorker {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl fmt::Debug for MockWorker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockWorker")
            .field("name", &self.shared.name)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MockWorker {
    /// Binds `listen` (port 0 picks a free port) and serves in the background.
    pub async fn spawn(listen: SocketAddr, cfg: MockWorkerConfig) -> io::Result<MockWorker> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(cfg, addr)?);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, shared.clone(), shutdown_rx));
        Ok(MockWorker {
            addr,
            shared,
            shutdown,
            task: Some(task),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL; a wildcard listen address is reported as loopback so the URL is dialable.
    pub fn url(&self) -> String {
        let mut addr = self.addr;
        if addr.ip().is_unspecified() {
            addr.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        format!("http://{addr}")
    }

    /// The value of this worker's `x-mock-worker` header.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn stats(&self) -> MockStats {
        self.shared.stats.snapshot()
    }

    /// The fault currently set, if any.
    pub fn fault(&self) -> Option<Fault> {
        self.shared.fault.load().as_ref().map(|f| f.spec.clone())
    }

    /// Same as `POST /_mock/fault`.
    ///
    /// # Panics
    /// If `fault` fails [`Fault::validate`]: an invalid fault is a bug in the calling test.
    pub fn set_fault(&self, fault: Fault) {
        if let Err(e) = fault.validate() {
            panic!("MockWorker::set_fault: {e}");
        }
        self.shared.set_fault(fault);
    }

    /// Same as `DELETE /_mock/fault`.
    pub fn clear_fault(&self) {
        self.shared.fault.store(None);
    }

    /// Same as `POST /_mock/reset`: zeroes the counters and clears the fault.
    pub fn reset(&self) {
        self.shared.reset();
    }

    /// Stops accepting, closes every connection (stalled ones included) and waits for that.
    pub async fn shutdown(mut self) {
        self.shutdown.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for MockWorker {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

/// `balancer mock-worker`: run one demo worker in the foreground.
#[derive(Debug, Clone, clap::Args)]
pub struct MockWorkerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Value of the x-mock-worker response header [default: mock-<port>].
    #[arg(long)]
    pub name: Option<String>,
    /// Model id served.
    #[arg(long, default_value = "demo-model")]
    pub model: String,
    /// Delay before each generated token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub token_delay_ms: u64,
}

/// Serves until ctrl-c or SIGTERM.
pub async fn run(args: MockWorkerArgs) -> anyhow::Result<()> {
    let cfg = MockWorkerConfig {
        name: args.name.unwrap_or_default(),
        model: args.model,
        token_delay: Duration::from_millis(args.token_delay_ms),
        ..MockWorkerConfig::default()
    };
    let worker = MockWorker::spawn(args.listen, cfg)
        .await
        .with_context(|| format!("mock worker: cannot listen on {}", args.listen))?;
    tracing::info!(
        name = worker.name(),
        addr = %worker.addr(),
        model = %worker.shared.model,
        "mock worker listening"
    );
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for ctrl-c")?,
        _ = sigterm.recv() => {}
    }
    tracing::info!(name = worker.name(), "mock worker shutting down");
    worker.shutdown().await;
    Ok(())
}

// ---------------------------------------------------------------------------
// Shared state

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    inference_requests: AtomicU64,
    health_checks: AtomicU64,
    faults_applied: AtomicU64,
    open_connections: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> MockStats {
        MockStats {
            requests: self.requests.load(Ordering::Relaxed),
            inference_requests: self.inference_requests.load(Ordering::Relaxed),
            health_checks: self.health_checks.load(Ordering::Relaxed),
            faults_applied: self.faults_applied.load(Ordering::Relaxed),
            open_connections: self.open_connections.load(Ordering::Relaxed),
        }
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A fault plus the per-spec progress of `count` and `every`, so replacing the
/// spec restarts both.
struct FaultState {
    spec: Fault,
    inference: bool,
    remaining: AtomicU64,
    seen: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CutKind {
    Stall,
    Truncate,
}

#[derive(Debug, Clone, Copy)]
struct Cut {
    after_chunks: u64,
    kind: CutKind,
}

/// The inference part of a fault, copied out so no `ArcSwap` guard is held across awaits.
#[derive(Debug, Clone, Copy, Default)]
struct Applied {
    latency: Option<Duration>,
    drop: bool,
    status: Option<StatusCode>,
    retry_after: Option<u64>,
    cut: Option<Cut>,
    token_delay: Option<Duration>,
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
        }
    }
}

struct Shared {
    name: String,
    name_header: HeaderValue,
    model: Arc<str>,
    token_delay: Duration,
    default_tokens: u64,
    max_tokens_cap: u64,
    models_body: Bytes,
    stats: Counters,
    fault: ArcSwapOption<FaultState>,
    next_id: AtomicU64,
}

impl Shared {
    fn new(cfg: MockWorkerConfig, addr: SocketAddr) -> io::Result<Self> {
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
        let models_body = serde_json::to_vec(&serde_json::json!({
            "object": "list",
            "data": [{
                "id": cfg.model,
                "object": "model",
                "created": 0,
                "owned_by": "mock-worker",
            }],
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
            stats: Counters::default(),
            fault: ArcSwapOption::empty(),
            next_id: AtomicU64::new(1),
        })
    }

    fn set_fault(&self, spec: Fault) {
        let state = FaultState {
            inference: spec.affects_inference(),
            remaining: AtomicU64::new(spec.count.unwrap_or(u64::MAX)),
            seen: AtomicU64::new(0),
            spec,
        };
        self.fault.store(Some(Arc::new(state)));
    }

    fn reset(&self) {
        self.fault.store(None);
        let s = &self.stats;
        for c in [
            &s.requests,
            &s.inference_requests,
            &s.health_checks,
            &s.faults_applied,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// Decides whether the current fault hits this `/v1/*` request, consuming
    /// one unit of `count` if it does.
    fn take_inference_fault(&self) -> Option<Applied> {
        let guard = self.fault.load();
        let state = guard.as_ref()?;
        if !state.inference {
            return None;
        }
        if let Some(every) = state.spec.every {
            let n = state.seen.fetch_add(1, Ordering::Relaxed) + 1;
            if n % every != 0 {
                return None;
            }
        }
        if state.spec.count.is_some()
            && state
                .remaining
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                .is_err()
        {
            return None;
        }
        bump(&self.stats.faults_applied);
        Some(Applied::from_spec(&state.spec))
    }

    fn health_fault(&self) -> Option<(StatusCode, Option<u64>)> {
        let guard = self.fault.load();
        let spec = &guard.as_ref()?.spec;
        let status = StatusCode::from_u16(spec.health_status?).ok()?;
        if status == StatusCode::OK {
            return None;
        }
        bump(&self.stats.faults_applied);
        Some((status, spec.retry_after))
    }

    fn respond(&self, status: StatusCode, content_type: &'static str, body: MockBody) -> Resp {
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

    fn json(&self, status: StatusCode, body: impl Into<Bytes>) -> Resp {
        self.respond(status, JSON, MockBody::full(body.into()))
    }

    fn json_value<T: Serialize>(&self, status: StatusCode, value: &T) -> Resp {
        match serde_json::to_vec(value) {
            Ok(v) => self.json(status, v),
            Err(e) => self.error(
                StatusCode::INTERNAL_SERVER_ERROR,
                &e.to_string(),
                "internal",
            ),
        }
    }

    fn error(&self, status: StatusCode, message: &str, code: &str) -> Resp {
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

    fn injected_error(&self, status: StatusCode, retry_after: Option<u64>) -> Resp {
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

// ---------------------------------------------------------------------------
// Connections

type Resp = Response<MockBody>;

/// Returned by the service to make hyper close the connection without writing a response.
#[derive(Debug)]
struct DropConnection;

impl fmt::Display for DropConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("mock worker: connection dropped on purpose")
    }
}

impl std::error::Error for DropConnection {}

/// Decrements the gauge however the connection task ends, aborts included.
struct OpenConnection(Arc<Shared>);

impl OpenConnection {
    fn new(shared: Arc<Shared>) -> Self {
        bump(&shared.stats.open_connections);
        Self(shared)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0
            .stats
            .open_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut builder = http1::Builder::new();
    // Idle pooled connections of the balancer must not be cut under it: that
    // would show up as spurious upstream errors in breaker tests.
    builder.keep_alive(true).header_read_timeout(None);
    let builder = Arc::new(builder);
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            // An error means the MockWorker is gone: stop as well.
            r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { break },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    let guard = OpenConnection::new(shared.clone());
                    conns.spawn(serve_connection(stream, builder.clone(), guard));
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning on accept.
                    tracing::warn!(error = %e, "mock worker: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    drop(listener);
    // Aborting (rather than draining) is what makes stalled streams end on shutdown.
    conns.shutdown().await;
}

async fn serve_connection(stream: TcpStream, builder: Arc<http1::Builder>, conn: OpenConnection) {
    // Token-sized SSE writes must leave immediately, not wait for Nagle.
    let _ = stream.set_nodelay(true);
    let abort = Arc::new(AtomicBool::new(false));
    let io = TokioIo::new(AbortOnFlush {
        inner: stream,
        abort: abort.clone(),
    });
    let shared = conn.0.clone();
    let svc = service_fn(move |req| handle(shared.clone(), abort.clone(), req));
    // Errors here are either our own drop/truncate faults or clients going away.
    let _ = builder.serve_connection(io, svc).await;
    drop(conn);
}

/// The truncate fault needs the chunks before the cut to reach the client and
/// the connection to die right after. A body error would make hyper discard
/// what it still buffers, so instead the body arms this flag and goes quiet:
/// hyper only calls `poll_flush` on the transport once its buffer is written
/// out, and failing that call aborts the connection at exactly that point.
struct AbortOnFlush {
    inner: TcpStream,
    abort: Arc<AtomicBool>,
}

impl AsyncRead for AbortOnFlush {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for AbortOnFlush {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.abort.load(Ordering::Acquire) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "mock worker: response truncated on purpose",
            )));
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

// ---------------------------------------------------------------------------
// Request handling

async fn handle(
    shared: Arc<Shared>,
    abort: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Result<Resp, DropConnection> {
    let path = req.uri().path();
    if path.starts_with("/_mock/") {
        return Ok(control(&shared, req).await);
    }
    bump(&shared.stats.requests);
    if path == "/health" {
        bump(&shared.stats.health_checks);
        return Ok(health(&shared, req.method()));
    }
    if path.starts_with("/v1/") {
        return inference(&shared, abort, req).await;
    }
    Ok(shared.error(StatusCode::NOT_FOUND, "unknown path", "not_found"))
}

fn health(shared: &Shared, method: &Method) -> Resp {
    if method != Method::GET {
        return shared.error(
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET",
            "method_not_allowed",
        );
    }
    match shared.health_fault() {
        Some((status, retry_after)) => shared.injected_error(status, retry_after),
        None => shared.json(StatusCode::OK, Bytes::from_static(br#"{"status":"ok"}"#)),
    }
}

enum ReadError {
    TooLarge,
    Broken,
}

async fn read_body(body: Incoming) -> Result<Bytes, ReadError> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(ReadError::TooLarge),
        Err(_) => Err(ReadError::Broken),
    }
}

async fn inference(
    shared: &Shared,
    abort: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Result<Resp, DropConnection> {
    bump(&shared.stats.inference_requests);
    let (parts, body) = req.into_parts();
    let body = match read_body(body).await {
        Ok(b) => b,
        Err(ReadError::TooLarge) => {
            return Ok(shared.error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request body too large",
                "body_too_large",
            ));
        }
        // The client is gone or sent a broken body; there is nobody to answer.
        Err(ReadError::Broken) => return Err(DropConnection),
    };
    let fault = shared.take_inference_fault().unwrap_or_default();
    if let Some(latency) = fault.latency {
        tokio::time::sleep(latency).await;
    }
    if fault.drop {
        return Err(DropConnection);
    }
    if let Some(status) = fault.status {
        let resp = shared.injected_error(status, fault.retry_after);
        return Ok(cut_response(resp, fault.cut, abort));
    }
    let token_delay = fault.token_delay.unwrap_or(shared.token_delay);
    let kind = match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/v1/models") => None,
        (&Method::POST, "/v1/chat/completions") => Some(Kind::Chat),
        (&Method::POST, "/v1/completions") => Some(Kind::Text),
        (_, "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
            let resp = shared.error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
                "method_not_allowed",
            );
            return Ok(cut_response(resp, fault.cut, abort));
        }
        _ => {
            let resp = shared.error(StatusCode::NOT_FOUND, "unknown path", "not_found");
            return Ok(cut_response(resp, fault.cut, abort));
        }
    };
    let resp = match kind {
        None => shared.json(StatusCode::OK, shared.models_body.clone()),
        Some(kind) => generate(shared, kind, &body, token_delay).await,
    };
    Ok(cut_response(resp, fault.cut, abort))
}

fn cut_response(resp: Resp, cut: Option<Cut>, abort: Arc<AtomicBool>) -> Resp {
    match cut {
        None => resp,
        Some(cut) => resp.map(|body| body.cut(cut, abort)),
    }
}

#[derive(Deserialize)]
struct InferenceRequest {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<Value>,
}

#[derive(Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: Option<Value>,
}

fn parse_inference(body: &[u8]) -> Result<InferenceRequest, String> {
    // serde would also accept a JSON array positionally; OpenAI bodies are objects.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err("request body must be a JSON object".to_owned());
    }
    serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))
}

/// A cheap, deterministic stand-in for a tokenizer: whitespace-separated words,
/// and one token per element of a pre-tokenized prompt.
fn count_prompt_tokens(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.split_whitespace().count() as u64,
        Value::Number(_) => 1,
        Value::Array(items) => items.iter().map(count_prompt_tokens).sum(),
        Value::Object(map) => map.get("text").map_or(0, count_prompt_tokens),
        Value::Null | Value::Bool(_) => 0,
    }
}

async fn generate(shared: &Shared, kind: Kind, body: &[u8], token_delay: Duration) -> Resp {
    let req = match parse_inference(body) {
        Ok(r) => r,
        Err(msg) => return shared.error(StatusCode::BAD_REQUEST, &msg, "invalid_json"),
    };
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let tokens = requested.map_or(shared.default_tokens, |n| n.min(shared.max_tokens_cap));
    let prompt_tokens = match kind {
        Kind::Chat => req
            .messages
            .iter()
            .flatten()
            .filter_map(|m| m.content.as_ref())
            .map(count_prompt_tokens)
            .sum(),
        Kind::Text => req.prompt.as_ref().map_or(0, count_prompt_tokens),
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let gen_ = Generation {
        kind,
        id: format!("{}{id}", kind.id_prefix()),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: shared.model.clone(),
        tokens,
        prompt_tokens,
        finish_reason: if requested.is_some() {
            "length"
        } else {
            "stop"
        },
    };
    if req.stream == Some(true) {
        let mut resp = shared.respond(
            StatusCode::OK,
            "text/event-stream",
            MockBody::sse(SseStream::new(gen_, token_delay)),
        );
        resp.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return resp;
    }
    if !token_delay.is_zero() {
        let total = token_delay.saturating_mul(u32::try_from(tokens).unwrap_or(u32::MAX));
        tokio::time::sleep(total).await;
    }
    shared.json(StatusCode::OK, gen_.full_body())
}

// ---------------------------------------------------------------------------
// Control API

async fn control(shared: &Shared, req: Request<Incoming>) -> Resp {
    let (parts, body) = req.into_parts();
    match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/_mock/stats") => {
            shared.json_value(StatusCode::OK, &shared.stats.snapshot())
        }
        (&Method::GET, "/_mock/fault") => {
            let guard = shared.fault.load();
            shared.json_value(StatusCode::OK, &guard.as_ref().map(|f| &f.spec))
        }
        (&Method::POST, "/_mock/fault") => {
            let body = match read_body(body).await {
                Ok(b) => b,
                Err(_) => {
                    return shared.error(
                        StatusCode::BAD_REQUEST,
                        "unreadable body",
                        "invalid_body",
                    );
                }
            };
            let fault = serde_json::from_slice::<Fault>(&body)
                .map_err(|e| format!("invalid fault JSON: {e}"))
                .and_then(|f| f.validate().map(|()| f).map_err(|e| e.to_string()));
            match fault {
                Ok(fault) => {
                    let resp = shared.json_value(StatusCode::OK, &fault);
                    shared.set_fault(fault);
                    resp
                }
                Err(msg) => shared.error(StatusCode::BAD_REQUEST, &msg, "invalid_fault"),
            }
        }
        (&Method::DELETE, "/_mock/fault") => {
            shared.fault.store(None);
            shared.json(StatusCode::OK, Bytes::from_static(b"null"))
        }
        (&Method::POST, "/_mock/reset") => {
            shared.reset();
            shared.json_value(StatusCode::OK, &shared.stats.snapshot())
        }
        (_, "/_mock/stats" | "/_mock/fault" | "/_mock/reset") => shared.error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed",
            "method_not_allowed",
        ),
        _ => shared.error(StatusCode::NOT_FOUND, "unknown control path", "not_found"),
    }
}

// ---------------------------------------------------------------------------
// Response generation

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-mock",
            Kind::Text => "cmpl-mock",
        }
    }
}

struct Generation {
    kind: Kind,
    id: String,
    created: u64,
    model: Arc<str>,
    tokens: u64,
    prompt_tokens: u64,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
struct Completion<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [C; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessageOut<'a>,
    finish_reason: &'a str,
}

#[derive(Serialize)]
struct ChatMessageOut<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    content: &'a str,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
}

impl Generation {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.tokens,
            total_tokens: self.prompt_tokens + self.tokens,
        }
    }

    fn token(i: u64) -> &'static str {
        WORDS[(i % WORDS.len() as u64) as usize]
    }

    /// SSE chunks: one per token, and at least one so the usage has a carrier.
    fn chunks(&self) -> u64 {
        self.tokens.max(1)
    }

    fn full_body(&self) -> Vec<u8> {
        let text: String = (0..self.tokens).map(Self::token).collect();
        let usage = Some(self.usage());
        let (id, model) = (self.id.as_str(), &*self.model);
        let out = match self.kind {
            Kind::Chat => serde_json::to_vec(&Completion {
                id,
                object: "chat.completion",
                created: self.created,
                model,
                choices: [ChatChoice {
                    index: 0,
                    message: ChatMessageOut {
                        role: "assistant",
                        content: &text,
                    },
                    finish_reason: self.finish_reason,
                }],
                usage,
            }),
            Kind::Text => serde_json::to_vec(&Completion {
                id,
                object: "text_completion",
                created: self.created,
                model,
                choices: [TextChoice {
                    index: 0,
                    text: &text,
                    logprobs: None,
                    finish_reason: Some(self.finish_reason),
                }],
                usage,
            }),
        };
        out.unwrap_or_default()
    }

    /// The SSE event for chunk `i` (`0..chunks()`); the last one carries
    /// `finish_reason` and `usage`.
    fn chunk_event(&self, i: u64) -> Bytes {
        let last = i + 1 == self.chunks();
        let content = if i < self.tokens { Self::token(i) } else { "" };
        let finish_reason = last.then_some(self.finish_reason);
        let usage = last.then(|| self.usage());
        let (id, model) = (self.id.as_str(), &*self.model);
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(b"data: ");
        let written = match self.kind {
            Kind::Chat => serde_json::to_writer(
                &mut out,
                &Completion {
                    id,
                    object: "chat.completion.chunk",
                    created: self.created,
                    model,
                    choices: [ChatChunkChoice {
                        index: 0,
                        delta: ChatDelta {
                            role: (i == 0).then_some("assistant"),
                            content,
                        },
                        finish_reason,
                    }],
                    usage,
                },
            ),
            Kind::Text => serde_json::to_writer(
                &mut out,
                &Completion {
                    id,
                    object: "text_completion",
                    created: self.created,
                    model,
                    choices: [TextChoice {
                        index: 0,
                        text: content,
                        logprobs: None,
                        finish_reason,
                    }],
                    usage,
                },
            ),
        };
        debug_assert!(written.is_ok());
        out.extend_from_slice(b"\n\n");
        out.into()
    }
}

// ---------------------------------------------------------------------------
// Response bodies

/// The one body type of the service, so that faults can be applied to any
/// response without boxing.
struct MockBody(BodyInner);

enum BodyInner {
    Full(Option<Bytes>),
    /// A fixed-length body cut after `first`: the `Content-Length` still promises `len`.
    Partial {
        first: Option<Bytes>,
        len: u64,
        cut: CutKind,
        abort: Arc<AtomicBool>,
    },
    Sse(Box<SseStream>),
}

impl MockBody {
    fn full(bytes: Bytes) -> Self {
        MockBody(BodyInner::Full(Some(bytes)))
    }

    fn sse(stream: SseStream) -> Self {
        MockBody(BodyInner::Sse(Box::new(stream)))
    }

    fn cut(self, cut: Cut, abort: Arc<AtomicBool>) -> Self {
        match self.0 {
            BodyInner::Full(bytes) => {
                let bytes = bytes.unwrap_or_default();
                let len = bytes.len() as u64;
                let first = bytes.slice(..bytes.len() / 2);
                MockBody(BodyInner::Partial {
                    first: (!first.is_empty()).then_some(first),
                    len,
                    cut: cut.kind,
                    abort,
                })
            }
            BodyInner::Sse(mut s) => {
                s.cut = Some((cut, abort));
                MockBody(BodyInner::Sse(s))
            }
            partial @ BodyInner::Partial { .. } => MockBody(partial),
        }
    }
}

/// Stops producing data. For a truncation, arming the flag makes the
/// transport fail its next flush (see [`AbortOnFlush`]). No waker is kept on
/// purpose: nothing will ever make the body ready again, and the connection
/// task is aborted on shutdown.
fn go_quiet(cut: CutKind, abort: &AtomicBool) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
    if cut == CutKind::Truncate {
        abort.store(true, Ordering::Release);
    }
    Poll::Pending
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().0 {
            BodyInner::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            BodyInner::Partial {
                first, cut, abort, ..
            } => match first.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => go_quiet(*cut, abort),
            },
            BodyInner::Sse(s) => s.poll_next(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            BodyInner::Full(bytes) => bytes.is_none(),
            BodyInner::Partial { .. } => false,
            BodyInner::Sse(s) => s.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            BodyInner::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            BodyInner::Partial { len, .. } => SizeHint::with_exact(*len),
            BodyInner::Sse(_) => SizeHint::default(),
        }
    }
}

/// Generates SSE events lazily so a long stream costs no task and no buffer.
struct SseStream {
    generation: Generation,
    emitted: u64,
    done: bool,
    token_delay: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    sleeping: bool,
    cut: Option<(Cut, Arc<AtomicBool>)>,
}

impl SseStream {
    fn new(generation: Generation, token_delay: Duration) -> Self {
        SseStream {
            generation,
            emitted: 0,
            done: false,
            token_delay,
            sleep: None,
            sleeping: false,
            cut: None,
        }
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        // Checked before [DONE] too, so a cut at or past the last chunk still withholds it.
        if let Some((cut, abort)) = &self.cut
            && self.emitted >= cut.after_chunks.min(self.generation.chunks())
        {
            return go_quiet(cut.kind, abort);
        }
        if self.emitted < self.generation.chunks() {
            if !self.token_delay.is_zero() {
                let deadline = Instant::now() + self.token_delay;
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if !self.sleeping {
                    sleep.as_mut().reset(deadline);
                    self.sleeping = true;
                }
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleeping = false;
            }
            let event = self.generation.chunk_event(self.emitted);
            self.emitted += 1;
            return Poll::Ready(Some(Ok(Frame::data(event))));
        }
        self.done = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(DONE_EVENT)))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;
    use http_body_util::Full;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::timeout;

    /// Generous bound for anything that should be instant on loopback.
    const T: Duration = Duration::from_secs(5);

    async fn worker(name: &str) -> MockWorker {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        MockWorker::spawn(addr, MockWorkerConfig::named(name))
            .await
            .expect("spawn mock worker")
    }

    struct Answer {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    }

    impl Answer {
        fn json(&self) -> Value {
            serde_json::from_slice(&self.body).expect("JSON body")
        }
    }

    async fn call(w: &MockWorker, method: Method, path: &str, body: &str) -> Answer {
        timeout(T, async {
            let stream = TcpStream::connect(w.addr()).await.unwrap();
            let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header(http::header::HOST, "mock")
                .header(CONTENT_TYPE, JSON)
                .body(Full::new(Bytes::from(body.to_owned())))
                .unwrap();
            let resp = tx.send_request(req).await.unwrap();
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            Answer {
                status: parts.status,
                headers: parts.headers,
                body,
            }
        })
        .await
        .expect("request timed out")
    }

    async fn chat(w: &MockWorker, body: &str) -> Answer {
        call(w, Method::POST, "/v1/chat/completions", body).await
    }

    const CHAT: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"say hi to me"}],"max_tokens":3}"#;
    const CHAT_STREAM: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"say hi"}],"max_tokens":4,"stream":true}"#;

    fn raw_post(path: &str, body: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    /// Sends a raw request and reads until EOF or a socket error, whichever comes first.
    async fn raw_until_closed(w: &MockWorker, request: &str) -> (Vec<u8>, Option<io::Error>) {
        timeout(T, async {
            let mut s = TcpStream::connect(w.addr()).await.unwrap();
            s.write_all(request.as_bytes()).await.unwrap();
            let mut out = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) => return (out, None),
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                    Err(e) => return (out, Some(e)),
                }
            }
        })
        .await
        .expect("the worker kept the connection open")
    }

    /// The JSON payloads of an SSE body, with `[DONE]` kept as a plain string.
    fn sse_events(body: &[u8]) -> Vec<String> {
        let text = std::str::from_utf8(body).unwrap();
        assert!(
            text.ends_with("\n\n"),
            "events end with a blank line: {text:?}"
        );
        text.split_terminator("\n\n")
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not a data event: {e:?}"))
                    .to_owned()
            })
            .collect()
    }

    fn count(haystack: &[u8], needle: &str) -> usize {
        haystack
            .windows(needle.len())
            .filter(|w| *w == needle.as_bytes())
            .count()
    }

    #[tokio::test]
    async fn chat_completion_shape() {
        let w = worker("w-shape").await;
        let a = chat(&w, CHAT).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.headers[WORKER_HEADER], "w-shape");
        assert_eq!(a.headers[CONTENT_TYPE], JSON);
        let v = a.json();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["model"], "demo-model");
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], "Lorem ipsum dolor");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["prompt_tokens"], 4);
        assert_eq!(v["usage"]["completion_tokens"], 3);
        assert_eq!(v["usage"]["total_tokens"], 7);

        // No max_tokens: the default length, a natural stop.
        let v = chat(&w, r#"{"messages":[]}"#).await.json();
        assert_eq!(v["usage"]["completion_tokens"], 8);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        // max_tokens is capped.
        let v = chat(&w, r#"{"messages":[],"max_tokens":1000000}"#)
            .await
            .json();
        assert_eq!(v["usage"]["completion_tokens"], 4096);
    }

    #[tokio::test]
    async fn text_completion_and_models_shape() {
        let w = worker("w-text").await;
        let a = call(
            &w,
            Method::POST,
            "/v1/completions",
            r#"{"prompt":"a b","max_tokens":2}"#,
        )
        .await;
        assert_eq!(a.status, StatusCode::OK);
        let v = a.json();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], "Lorem ipsum");
        assert_eq!(v["usage"]["prompt_tokens"], 2);
        assert_eq!(v["usage"]["total_tokens"], 4);

        let a = call(&w, Method::GET, "/v1/models", "").await;
        assert_eq!(a.status, StatusCode::OK);
        let v = a.json();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["id"], "demo-model");
        assert_eq!(v["data"][0]["object"], "model");

        let a = call(&w, Method::GET, "/health", "").await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.json(), serde_json::json!({"status": "ok"}));
        assert_eq!(a.headers[WORKER_HEADER], "w-text");
    }

    #[tokio::test]
    async fn chat_stream_shape() {
        let w = worker("w-stream").await;
        let a = chat(&w, CHAT_STREAM).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.headers[CONTENT_TYPE], "text/event-stream");
        assert_eq!(a.headers[WORKER_HEADER], "w-stream");
        let events = sse_events(&a.body);
        assert_eq!(events.len(), 5, "4 token chunks and [DONE]: {events:?}");
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..4]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(text, "Lorem ipsum dolor sit");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        for c in &chunks[..3] {
            assert_eq!(c["object"], "chat.completion.chunk");
            assert!(c.get("usage").is_none());
            assert!(c["choices"][0]["finish_reason"].is_null());
        }
        let last = &chunks[3];
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"]["prompt_tokens"], 2);
        assert_eq!(last["usage"]["completion_tokens"], 4);
        assert_eq!(last["usage"]["total_tokens"], 6);
    }

    #[tokio::test]
    async fn text_stream_shape() {
        let w = worker("w-tstream").await;
        let a = call(
            &w,
            Method::POST,
            "/v1/completions",
            r#"{"prompt":["x y", "z"],"max_tokens":2,"stream":true}"#,
        )
        .await;
        let events = sse_events(&a.body);
        assert_eq!(events.len(), 3);
        assert_eq!(events[2], "[DONE]");
        let last: Value = serde_json::from_str(&events[1]).unwrap();
        assert_eq!(last["object"], "text_completion");
        assert_eq!(last["choices"][0]["text"], " ipsum");
        assert_eq!(last["usage"]["prompt_tokens"], 3);
        assert_eq!(last["usage"]["completion_tokens"], 2);
    }

    #[tokio::test]
    async fn bad_requests() {
        let w = worker("w-bad").await;
        for body in ["{not json", "[1,2]", r#"{"max_tokens":-1}"#, ""] {
            let a = chat(&w, body).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "body {body:?}");
            let v = a.json();
            assert!(v["error"]["message"].is_string());
            assert_eq!(v["error"]["type"], "invalid_request_error");
            assert_eq!(v["error"]["code"], "invalid_json");
        }
        let a = call(&w, Method::GET, "/nope", "").await;
        assert_eq!(a.status, StatusCode::NOT_FOUND);
        assert!(a.json()["error"]["message"].is_string());
        assert_eq!(
            call(&w, Method::GET, "/v1/nope", "").await.status,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            call(&w, Method::GET, "/v1/chat/completions", "")
                .await
                .status,
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            call(&w, Method::GET, "/_mock/nope", "").await.status,
            StatusCode::NOT_FOUND
        );
    }

    #[tokio::test]
    async fn status_fault_with_count_and_retry_after() {
        let w = worker("w-status").await;
        w.set_fault(Fault {
            status: Some(503),
            count: Some(2),
            retry_after: Some(7),
            ..Fault::default()
        });
        for _ in 0..2 {
            let a = chat(&w, CHAT).await;
            assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(a.headers[RETRY_AFTER], "7");
            assert_eq!(a.headers[WORKER_HEADER], "w-status");
            let v = a.json();
            assert_eq!(v["error"]["type"], "server_error");
            assert_eq!(v["error"]["code"], "injected_fault");
        }
        let a = chat(&w, CHAT).await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(a.headers.get(RETRY_AFTER).is_none());
        // The spent fault does not touch health.
        assert_eq!(
            call(&w, Method::GET, "/health", "").await.status,
            StatusCode::OK
        );
        let s = w.stats();
        assert_eq!(s.faults_applied, 2);
        assert_eq!(s.inference_requests, 3);
    }

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
    async fn latency_fault() {
        let w = worker("w-latency").await;
        w.set_fault(Fault {
            latency_ms: Some(150),
            count: Some(1),
            ..Fault::default()
        });
        let started = std::time::Instant::now();
        let a = chat(&w, CHAT).await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(
            started.elapsed() >= Duration::from_millis(150),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(w.stats().faults_applied, 1);
    }

    #[tokio::test]
    async fn token_delay_fault() {
        let w = worker("w-tokdelay").await;
        w.set_fault(Fault {
            token_delay_ms: Some(30),
            ..Fault::default()
        });
        let started = std::time::Instant::now();
        let a = chat(&w, CHAT_STREAM).await;
        assert_eq!(sse_events(&a.body).len(), 5);
        assert!(
            started.elapsed() >= Duration::from_millis(120),
            "{:?}",
            started.elapsed()
        );
        let started = std::time::Instant::now();
        chat(&w, CHAT).await;
        assert!(
            started.elapsed() >= Duration::from_millis(90),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn drop_fault_closes_without_answer() {
        let w = worker("w-drop").await;
        w.set_fault(Fault {
            drop: true,
            count: Some(1),
            ..Fault::default()
        });
        let (bytes, _err) = raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT)).await;
        assert!(
            bytes.is_empty(),
            "got {:?}",
            String::from_utf8_lossy(&bytes)
        );
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::OK);
        let s = w.stats();
        assert_eq!((s.inference_requests, s.faults_applied), (2, 1));
    }

    #[tokio::test]
    async fn truncate_fault_aborts_mid_stream() {
        let w = worker("w-trunc").await;
        w.set_fault(Fault {
            truncate_after_chunks: Some(2),
            ..Fault::default()
        });
        let (bytes, _err) =
            raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT_STREAM)).await;
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert_eq!(count(&bytes, "data: {"), 2, "{text}");
        assert_eq!(count(&bytes, "[DONE]"), 0, "{text}");
        assert!(
            !text.ends_with("0\r\n\r\n"),
            "the chunked body must not terminate: {text}"
        );

        // A cut past the last token chunk still withholds [DONE].
        w.set_fault(Fault {
            truncate_after_chunks: Some(100),
            ..Fault::default()
        });
        let (bytes, _err) =
            raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT_STREAM)).await;
        assert_eq!(count(&bytes, "data: {"), 4);
        assert_eq!(count(&bytes, "[DONE]"), 0);

        // An HTTP client sees a broken body, not a short one.
        let stream = TcpStream::connect(w.addr()).await.unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::post("/v1/chat/completions")
            .header(http::header::HOST, "mock")
            .body(Full::new(Bytes::from_static(CHAT_STREAM.as_bytes())))
            .unwrap();
        let resp = timeout(T, tx.send_request(req)).await.unwrap().unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let collected = timeout(T, resp.into_body().collect()).await.unwrap();
        assert!(collected.is_err(), "truncated body must fail to collect");
    }

    #[tokio::test]
    async fn truncate_fault_on_plain_response() {
        let w = worker("w-trunc-plain").await;
        w.set_fault(Fault {
            truncate_after_chunks: Some(0),
            count: Some(1),
            ..Fault::default()
        });
        let (bytes, _err) = raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT)).await;
        let text = String::from_utf8_lossy(&bytes);
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(!body.is_empty() && body.len() < len, "{text}");
    }

    #[tokio::test]
    async fn stall_fault_keeps_connection_open() {
        let w = worker("w-stall").await;
        w.set_fault(Fault {
            stall_after_chunks: Some(2),
            ..Fault::default()
        });
        let mut s = TcpStream::connect(w.addr()).await.unwrap();
        s.write_all(raw_post("/v1/chat/completions", CHAT_STREAM).as_bytes())
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        timeout(T, async {
            while count(&got, "data: {") < 2 {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed early");
                got.extend_from_slice(&buf[..n]);
            }
        })
        .await
        .expect("the first chunks never came");
        // Nothing more arrives, and the connection is not closed either.
        let more = timeout(Duration::from_millis(300), s.read(&mut buf)).await;
        assert!(more.is_err(), "expected silence, got {more:?}");
        assert_eq!(count(&got, "data: {"), 2);
        assert_eq!(w.stats().open_connections, 1);
        // Shutdown must not hang on the stalled stream, and it closes it.
        timeout(T, w.shutdown()).await.expect("shutdown hung");
        let n = timeout(T, s.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0);
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

    #[tokio::test]
    async fn stats_count_and_reset() {
        let w = worker("w-stats").await;
        // Several requests on one keep-alive connection.
        let stream = TcpStream::connect(w.addr()).await.unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        for path in ["/health", "/health", "/v1/models", "/missing"] {
            let req = Request::get(path)
                .header(http::header::HOST, "mock")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = timeout(T, tx.send_request(req)).await.unwrap().unwrap();
            timeout(T, resp.into_body().collect())
                .await
                .unwrap()
                .unwrap();
        }
        chat(&w, CHAT).await;
        let s = w.stats();
        assert_eq!(s.requests, 5);
        assert_eq!(s.health_checks, 2);
        assert_eq!(s.inference_requests, 2);
        assert_eq!(s.faults_applied, 0);
        assert!(s.open_connections >= 1, "{s:?}");

        // The control API is not counted, and reports the same numbers.
        let a = call(&w, Method::GET, "/_mock/stats", "").await;
        let over_http: MockStats = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(
            (
                over_http.requests,
                over_http.health_checks,
                over_http.inference_requests
            ),
            (5, 2, 2)
        );

        w.set_fault(Fault {
            status: Some(500),
            ..Fault::default()
        });
        w.reset();
        assert!(w.fault().is_none());
        let s = w.stats();
        assert_eq!(
            (s.requests, s.health_checks, s.inference_requests),
            (0, 0, 0)
        );
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::OK);
    }

    #[tokio::test]
    async fn control_api_over_http() {
        let w = worker("w-ctl").await;
        for bad in [
            "",
            "{",
            r#"{"stauts":500}"#,
            r#"{"every":0}"#,
            r#"{"status":99}"#,
            r#"{"drop":true,"status":500}"#,
            r#"{"stall_after_chunks":1,"truncate_after_chunks":1}"#,
        ] {
            let a = call(&w, Method::POST, "/_mock/fault", bad).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{bad:?}");
            assert!(a.json()["error"]["message"].is_string());
        }
        assert!(w.fault().is_none());

        let a = call(
            &w,
            Method::POST,
            "/_mock/fault",
            r#"{"status":502,"count":1}"#,
        )
        .await;
        assert_eq!(a.status, StatusCode::OK);
        let expected = Fault {
            status: Some(502),
            count: Some(1),
            ..Fault::default()
        };
        assert_eq!(w.fault(), Some(expected.clone()));
        let current: Option<Fault> =
            serde_json::from_slice(&call(&w, Method::GET, "/_mock/fault", "").await.body).unwrap();
        assert_eq!(current, Some(expected));
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::BAD_GATEWAY);

        // A POST replaces the fault, DELETE clears it.
        call(&w, Method::POST, "/_mock/fault", r#"{"status":500}"#).await;
        assert_eq!(
            chat(&w, CHAT).await.status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            call(&w, Method::DELETE, "/_mock/fault", "").await.status,
            StatusCode::OK
        );
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::OK);

        let a = call(&w, Method::POST, "/_mock/reset", "").await;
        assert_eq!(a.status, StatusCode::OK);
        let s: MockStats =
            serde_json::from_slice(&call(&w, Method::GET, "/_mock/stats", "").await.body).unwrap();
        assert_eq!(
            (s.requests, s.inference_requests, s.faults_applied),
            (0, 0, 0)
        );
    }

    #[tokio::test]
    async fn url_and_default_name() {
        let w = MockWorker::spawn("0.0.0.0:0".parse().unwrap(), MockWorkerConfig::default())
            .await
            .unwrap();
        let port = w.addr().port();
        assert_eq!(w.url(), format!("http://127.0.0.1:{port}"));
        assert_eq!(w.name(), format!("mock-{port}"));
        w.shutdown().await;
    }

    /// Serves a worker for load tests, e.g.
    /// `MOCK_WORKER_BENCH_SECS=30 cargo test --release -p balancer --lib mock_worker::tests::serve_for_benchmark -- --ignored --nocapture`
    /// (listens on `MOCK_WORKER_BENCH_ADDR`, default 127.0.0.1:18080).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "serves for a while; run by hand for benchmarks"]
    async fn serve_for_benchmark() {
        let addr = std::env::var("MOCK_WORKER_BENCH_ADDR")
            .unwrap_or_else(|_| "127.0.0.1:18080".to_owned())
            .parse()
            .unwrap();
        let secs = std::env::var("MOCK_WORKER_BENCH_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30);
        let w = MockWorker::spawn(addr, MockWorkerConfig::named("bench"))
            .await
            .unwrap();
        println!("mock worker on {} for {secs}s", w.url());
        tokio::time::sleep(Duration::from_secs(secs)).await;
        println!("{:?}", w.stats());
        w.shutdown().await;
    }
}

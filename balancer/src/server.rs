//! Accepting connections: one HTTP listener loop shared by the gateway, the
//! metrics and the admin listeners, with the bounds an untrusted client
//! meets and graceful shutdown.
//!
//! Owns sockets and connection tasks only: the connection cap (at the cap,
//! accept waits), the even spread of a public port's connections over the
//! serving threads ([`spread`]), the time a request head may take (the header-read
//! timeout, which also closes a keep-alive connection whose next head
//! stalls), the idle timeout of a connection with nothing in flight, the
//! send timeout of a client that stops reading, HTTP/2 keep-alive pings, the
//! TLS handshake of an HTTPS listener (within the header-read timeout, in
//! the connection's own task so a slow one holds up no other), and the peer
//! each request is handed with ([`Peer`]). An HTTP/1.1 connection starts on
//! the fast path ([`fast`]), which serves plain requests itself and hands
//! the connection to hyper at the first that is not; HTTP/2 goes to hyper
//! at once. What a request means is the handler's business; the
//! certificates are [`crate::tls`]'s.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_util::either::Either;

use crate::bodies::{BoxError, Inbound, ResponseBody};
use crate::tls::ServingTls;

mod fast;
mod spread;

pub use spread::{Member, members};

pub(crate) use fast::read_request;

/// The client, handed to the handler with each request (a value, not an
/// extension: extensions cost a map and a box per request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The connection is TLS.
    pub tls: bool,
}

/// The bounds every connection of a listener meets.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// `--header-read-timeout-secs`: a request head (the first, or the next
    /// one on a keep-alive connection) must arrive within this.
    pub header_read_timeout: Duration,
    /// `--idle-connection-timeout-secs`: a connection with no request in
    /// flight (an open response stream counts) is closed after this.
    pub idle_timeout: Duration,
    /// `--send-timeout-secs`: a client that accepts no byte of the response
    /// for this long is disconnected.
    pub send_timeout: Duration,
    /// `--http2-keepalive-interval-secs`: HTTP/2 pings on an idle
    /// connection; an unanswered ping closes it.
    pub http2_keepalive: Duration,
    /// `--max-connections`, shared by every serving thread of the listener.
    pub connections: Arc<Semaphore>,
    /// The handler takes a plain request's header fields as they came,
    /// from its body ([`Inbound::take_fields`]), so the fast path builds no
    /// map for them: the gateway's proxy does. Off, every request's map
    /// holds its headers, as hyper's do.
    pub raw_fields: bool,
}

impl ConnectionLimits {
    /// Limits allowing `max_connections` connections at once.
    pub fn new(
        header_read_timeout: Duration,
        idle_timeout: Duration,
        send_timeout: Duration,
        http2_keepalive: Duration,
        max_connections: usize,
    ) -> Self {
        Self {
            header_read_timeout,
            idle_timeout,
            send_timeout,
            http2_keepalive,
            connections: Arc::new(Semaphore::new(max_connections)),
            raw_fields: false,
        }
    }
}

/// Where a serving loop's connections come from: its socket and, when it is
/// one of several threads serving a public port, the connections the others
/// hand it ([`spread`]).
#[derive(Debug)]
pub struct Listener {
    socket: TcpListener,
    spread: Option<Member>,
}

impl From<TcpListener> for Listener {
    fn from(socket: TcpListener) -> Self {
        Self {
            socket,
            spread: None,
        }
    }
}

/// A connection to serve on this thread.
#[derive(Debug)]
struct Accepted {
    stream: TcpStream,
    peer: SocketAddr,
    /// Its place under `--max-connections`.
    permit: OwnedSemaphorePermit,
    /// Its place in this thread's count, with a spread.
    seat: Option<spread::Seat>,
}

impl Listener {
    /// `socket`, one thread's share of a port, spread with the others.
    pub fn spread(socket: TcpListener, member: Member) -> Self {
        Self {
            socket,
            spread: Some(member),
        }
    }

    /// The next connection to serve here; `None` once shutdown is asked.
    async fn next(
        &mut self,
        limits: &ConnectionLimits,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Option<Accepted> {
        let Self { socket, spread } = self;
        loop {
            let handed = async {
                match spread {
                    Some(member) => member.handed().await,
                    None => std::future::pending().await,
                }
            };
            let (stream, peer) = tokio::select! {
                accepted = socket.accept() => match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of file descriptors and the like: back off
                        // instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                handed = handed => match handed {
                    Ok(accepted) => return Some(accepted),
                    Err(e) => {
                        tracing::warn!(error = %e, "a handed-over connection cannot be served");
                        continue;
                    }
                },
                _ = stopped(shutdown) => return None,
            };
            // At the cap, this connection waits unserved (and this thread
            // accepts no other) until one closes. The permit is taken after
            // accept: the serving threads' sockets share one cap, and a
            // thread holding a permit while its own queue is empty would
            // starve the others.
            let permit = tokio::select! {
                permit = limits.connections.clone().acquire_owned() => permit.ok()?,
                _ = stopped(shutdown) => return None,
            };
            let accepted = Accepted {
                stream,
                peer,
                permit,
                seat: None,
            };
            let Some(member) = spread else {
                return Some(accepted);
            };
            match member.place(accepted) {
                Ok(Some(here)) => return Some(here),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "an accepted connection cannot be handed over")
                }
            }
        }
    }
}

/// Serves `handler` on `listener` (over TLS with `tls`) until `shutdown`
/// flips to true, then lets open connections finish their requests for at
/// most `grace`.
pub async fn serve<H, F>(
    listener: impl Into<Listener>,
    handler: H,
    limits: ConnectionLimits,
    tls: Option<Arc<ServingTls>>,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) where
    H: Fn(Request<Inbound>, Peer) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ResponseBody>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Without a timer hyper's timeouts do nothing.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.http2_keepalive)
        .keep_alive_timeout(limits.http2_keepalive);
    // After the fast path answered a request, a connection is HTTP/1's:
    // hyper's own HTTP/1 server, as the auto builder sniffs for HTTP/2's
    // preface at whatever bytes it is handed first.
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let http1 = Arc::new(http1);
    let builder = Arc::new(builder);
    let mut listener = listener.into();
    while let Some(Accepted {
        stream,
        peer,
        permit,
        seat,
    }) = listener.next(&limits, &mut shutdown).await
    {
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let handler = handler.clone();
        let in_service = activity.clone();
        let client = Peer {
            addr: peer,
            tls: tls.is_some(),
        };
        let for_hyper = handler.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            let busy = Busy::new(&in_service);
            let fut = for_hyper(req.map(Inbound::Streamed), client);
            async move {
                let (mut parts, mut body) = fut.await.into_parts();
                // Hyper writes from the map alone: the worker's fields go
                // into it.
                if let Err(refused) = body.take_fields().append_to(&mut parts.headers) {
                    tracing::warn!(header = %refused.0, "a worker's header dropped");
                }
                if let Some((name, value)) = body.take_request_id() {
                    parts.headers.insert(name, value);
                }
                // In flight until the response body is done or dropped.
                let body = InFlight { body, _busy: busy }.boxed_unsync();
                Ok::<_, Infallible>(Response::from_parts(parts, body))
            }
        });
        let watched = Watched {
            inner: stream,
            activity: activity.clone(),
        };
        let (builder, http1) = (builder.clone(), http1.clone());
        let (watcher, tls) = (graceful.watcher(), tls.clone());
        let (idle, send) = (limits.idle_timeout, limits.send_timeout);
        let header_read = limits.header_read_timeout;
        let raw_fields = limits.raw_fields;
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let serving = async {
                // The socket, or TLS over it; the watchdog sees the socket's
                // writes either way.
                let mut transport = match tls {
                    None => Either::Left(watched),
                    Some(tls) => match tls.accept(watched, header_read).await {
                        Ok(stream) => Either::Right(Box::new(stream)),
                        Err(why) => {
                            tracing::debug!(%peer, reason = why.as_str(), "TLS handshake failed");
                            return;
                        }
                    },
                };
                // HTTP/1.1 starts on the fast path; HTTP/2 (by ALPN here, by
                // its preface there) and the unusual go to hyper.
                let h2 = matches!(&transport, Either::Right(tls) if tls.get_ref().1.alpn_protocol() == Some(b"h2"));
                let (read, http1_only) = if h2 {
                    (Bytes::new(), false)
                } else {
                    activity.await_heads(true);
                    let fast = fast::Fast::new(&mut transport, raw_fields);
                    match fast.serve(&handler, client, &activity, &shutdown).await {
                        fast::End::Closed => return,
                        fast::End::HandOver { read, http1_only } => {
                            activity.await_heads(false);
                            (read, http1_only)
                        }
                    }
                };
                let io = TokioIo::new(fast::Prefixed::new(read, transport));
                // How a connection ended is the client's business.
                if http1_only {
                    let _ = watcher.watch(http1.serve_connection(io, service)).await;
                } else {
                    let conn = builder.serve_connection_with_upgrades(io, service);
                    let _ = watcher.watch(conn.into_owned()).await;
                }
            };
            let watching = pin!(watchdog(&activity, idle, send, header_read));
            let watching = OwnWakes::new(watching);
            tokio::select! {
                biased;
                _ = serving => {}
                why = watching => {
                    tracing::debug!(%peer, why, "connection closed by the gateway");
                }
            }
            drop((permit, seat));
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_secs = grace.as_secs(),
            "connections still open after the grace period"
        );
    }
}

/// Resolves once the shutdown flag is set (or its sender is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// What a connection did last, for its watchdog.
#[derive(Debug)]
struct Activity {
    origin: Instant,
    /// Milliseconds since `origin` when the last request ended, or the
    /// wait for a first head began (accept counts as one). Raw bytes do not
    /// count: HTTP/2 pings would keep an idle connection alive forever.
    last: AtomicU64,
    /// Whether a request head is awaited whenever nothing is in flight:
    /// while the fast path serves, the header-read timeout is the
    /// watchdog's, so waiting for a head arms no timer of its own. Off under
    /// hyper, which keeps its own.
    heads: AtomicBool,
    /// Milliseconds since `origin` since which a write waits on the client;
    /// `NOT_BLOCKED` while writes go through.
    blocked_since: AtomicU64,
    /// Requests whose response is not finished.
    inflight: AtomicUsize,
}

const NOT_BLOCKED: u64 = u64::MAX;

impl Activity {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            last: AtomicU64::new(0),
            heads: AtomicBool::new(false),
            blocked_since: AtomicU64::new(NOT_BLOCKED),
            inflight: AtomicUsize::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// From now on (`true`), the next head must arrive within the
    /// header-read timeout whenever nothing is in flight; or no longer
    /// (`false`, the connection is hyper's).
    fn await_heads(&self, on: bool) {
        if on {
            self.last.store(self.now(), Ordering::Release);
        }
        self.heads.store(on, Ordering::Release);
    }
}

/// Ends when the connection must be closed: the client accepted nothing for
/// the send timeout, nothing was in flight for the idle timeout, or (on the
/// fast path) no head came within the header-read timeout of the wait's
/// start. It wakes at least once per header-read timeout, so a wait for a
/// head that begins while it sleeps is still cut on time.
async fn watchdog(
    activity: &Activity,
    idle: Duration,
    send: Duration,
    header_read: Duration,
) -> &'static str {
    let millis = |d: Duration| d.as_millis() as u64;
    let (idle, send, header_read) = (millis(idle), millis(send), millis(header_read));
    loop {
        let now = activity.now();
        let blocked = activity.blocked_since.load(Ordering::Acquire);
        let mut wait = idle.min(send).min(header_read);
        if blocked != NOT_BLOCKED {
            let stuck = now.saturating_sub(blocked);
            if stuck >= send {
                return "send timeout: the client stopped reading";
            }
            wait = wait.min(send - stuck);
        }
        if activity.inflight.load(Ordering::Acquire) == 0 {
            let quiet = now.saturating_sub(activity.last.load(Ordering::Acquire));
            if activity.heads.load(Ordering::Acquire) {
                if quiet >= header_read {
                    return "header-read timeout";
                }
                wait = wait.min(header_read - quiet);
            }
            if quiet >= idle {
                return "idle timeout";
            }
            wait = wait.min(idle - quiet);
        }
        tokio::time::sleep(Duration::from_millis(wait.max(10))).await;
    }
}

/// A future polled only when it asked to be: by its own waker, or on its
/// first poll. The watchdog shares its connection's task, which wakes a few
/// times per request for the sockets; polling the watchdog's timer on each
/// of those wakes (re-registering its waker every time) cost more than the
/// rest of the wake.
struct OwnWakes<F> {
    future: F,
    flag: Arc<WakeFlag>,
    /// The flag, as the waker the inner future is polled with.
    waker: Waker,
    /// The task's waker last handed to the flag.
    task: Option<Waker>,
}

/// Set by the inner future's waker, which then wakes the task.
struct WakeFlag {
    woken: AtomicBool,
    task: std::sync::Mutex<Option<Waker>>,
}

impl Wake for WakeFlag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        let task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(task) = &*task {
            task.wake_by_ref();
        }
    }
}

impl<F: Future + Unpin> OwnWakes<F> {
    fn new(future: F) -> Self {
        let flag = Arc::new(WakeFlag {
            // The first poll runs it.
            woken: AtomicBool::new(true),
            task: std::sync::Mutex::new(None),
        });
        Self {
            future,
            waker: Waker::from(flag.clone()),
            flag,
            task: None,
        }
    }
}

impl<F: Future + Unpin> Future for OwnWakes<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        if !this.task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
            let task = cx.waker().clone();
            *this
                .flag
                .task
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(task.clone());
            this.task = Some(task);
        }
        if !this.flag.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        Pin::new(&mut this.future).poll(&mut Context::from_waker(&this.waker))
    }
}

/// Counts a request in flight on its connection until dropped.
struct Busy(Arc<Activity>);

impl Busy {
    fn new(activity: &Arc<Activity>) -> Self {
        // `last` is read only while nothing is in flight, so the quiet
        // time starts when the last request ends: no clock read here.
        activity.inflight.fetch_add(1, Ordering::AcqRel);
        Self(activity.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let activity = &self.0;
        activity.last.store(activity.now(), Ordering::Release);
        activity.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until it ends.
struct InFlight {
    body: ResponseBody,
    _busy: Busy,
}

impl Body for InFlight {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The socket, with write progress noted for the watchdog.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl Watched {
    fn note_write(&self, poll: &Poll<io::Result<usize>>) {
        let activity = &self.activity;
        match poll {
            Poll::Pending => {
                let _ = activity.blocked_since.compare_exchange(
                    NOT_BLOCKED,
                    activity.now(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            Poll::Ready(_) => {
                activity.blocked_since.store(NOT_BLOCKED, Ordering::Release);
            }
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note_write(&poll);
        poll
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note_write(&poll);
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_client_that_stops_reading_is_cut_at_the_send_timeout() {
        let activity = Activity::new();
        activity.inflight.store(1, Ordering::Release);
        activity
            .blocked_since
            .store(activity.now(), Ordering::Release);
        let started = Instant::now();
        let why = watchdog(&activity, MINUTE, 5 * Duration::from_secs(1), MINUTE).await;
        assert_eq!(why, "send timeout: the client stopped reading");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(5) && took < Duration::from_secs(6),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_with_nothing_in_flight_is_cut_at_the_idle_timeout() {
        let activity = Activity::new();
        let started = Instant::now();
        assert_eq!(
            watchdog(&activity, MINUTE, MINUTE, 2 * MINUTE).await,
            "idle timeout"
        );
        assert!(started.elapsed() >= MINUTE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_awaited_on_the_fast_path_is_cut_at_the_header_read_timeout() {
        let activity = Activity::new();
        // A request ends 20 s in: the next head is awaited from then on,
        // however long the watchdog was asleep.
        let watching = watchdog(&activity, 10 * MINUTE, 10 * MINUTE, MINUTE);
        let mut watching = std::pin::pin!(watching);
        activity.await_heads(true);
        activity.inflight.store(1, Ordering::Release);
        let served = tokio::time::timeout(Duration::from_secs(20), watching.as_mut()).await;
        assert!(
            served.is_err(),
            "nothing is cut while a request is in flight"
        );
        activity.inflight.store(0, Ordering::Release);
        activity.last.store(activity.now(), Ordering::Release);
        let started = Instant::now();
        assert_eq!(watching.await, "header-read timeout");
        let took = started.elapsed();
        assert!(
            took >= MINUTE && took < MINUTE + Duration::from_secs(1),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_hyper_serves_keeps_only_the_idle_timeout() {
        let activity = Activity::new();
        activity.await_heads(true);
        activity.await_heads(false);
        let started = Instant::now();
        assert_eq!(
            watchdog(&activity, 3 * MINUTE, 3 * MINUTE, MINUTE).await,
            "idle timeout"
        );
        assert!(started.elapsed() >= 3 * MINUTE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_behind_own_wakes_is_polled_on_its_own_wakes_only() {
        let polls = std::cell::Cell::new(0);
        let mut timer = pin!(tokio::time::sleep(Duration::from_secs(1)));
        let inner = std::future::poll_fn(|cx| {
            polls.set(polls.get() + 1);
            timer.as_mut().poll(cx)
        });
        let inner = pin!(inner);
        let mut gated = OwnWakes::new(inner);
        // The task is polled ten times for other reasons: the inner future
        // only on the first.
        for _ in 0..10 {
            let poll = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut gated).poll(cx))).await;
            assert!(poll.is_pending());
            tokio::task::yield_now().await;
        }
        assert_eq!(polls.get(), 1);
        // Its timer's wake gets it polled again, and its output through.
        gated.await;
        assert_eq!(polls.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_stream_that_the_client_reads_is_never_idle() {
        let activity = Activity::new();
        activity.inflight.store(1, Ordering::Release);
        let watched =
            tokio::time::timeout(10 * MINUTE, watchdog(&activity, MINUTE, MINUTE, MINUTE)).await;
        assert!(watched.is_err(), "still open after ten idle timeouts");
    }
}

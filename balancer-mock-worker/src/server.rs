//! The running worker: [`MockWorker`] (spawn, inspect, set faults, stop; a
//! drop stops it too), the accept loop, serving one HTTP/1.1 connection, the
//! `open_connections` gauge and [`AbortOnFlush`], the transport wrapper that
//! turns an armed truncation into a connection abort.
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module owns sockets and tasks only; it uses `config`, `shared` and
//! `routes` (the service of every connection) and must not depend on `cli`.
//! It must not decide what a request is answered (that is `routes`) or how a
//! fault matches (that is `config`), and on shutdown it aborts connections
//! rather than draining them, so a stalled stream can never hold it up.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::config::{Fault, MockWorkerConfig};
use crate::routes::handle;
use crate::shared::{MockStats, Shared, bump};

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

    /// The model id this worker serves.
    pub(crate) fn model(&self) -> &str {
        &self.shared.model
    }

    pub fn stats(&self) -> MockStats {
        self.shared.stats.snapshot(&self.shared.engine)
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
        self.shared.clear_fault();
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
pub(crate) struct AbortOnFlush {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::MockWorker;
    use crate::config::MockWorkerConfig;

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
    /// `MOCK_WORKER_BENCH_SECS=30 cargo test --release -p balancer-mock-worker --lib server::tests::serve_for_benchmark -- --ignored --nocapture`
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

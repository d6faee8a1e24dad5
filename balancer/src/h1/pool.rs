//! Idle keep-alive connections to workers, for one serving thread.
//!
//! Owns the connections between requests: a new one within the connect
//! timeout, the most recently used idle one first, none kept past the idle
//! timeout or after the worker closed it. The lock is per serving thread,
//! so it is never contended, and taken twice per request (out and back in).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::net::TcpStream;

use super::{H1Error, READ_CHUNK};

/// Idle connections kept per worker; more are closed when they come back.
const MAX_IDLE_PER_WORKER: usize = 256;

/// A connection idle at least this long is checked for the worker's close
/// before reuse. Sooner, no worker's keep-alive timeout (seconds, in every
/// server of note) can have closed it, and the check would cost a read per
/// request under load; a close that races anyway is retried unseen
/// ([`super::H1Pool::send`]).
const CHECK_AFTER: Duration = Duration::from_millis(500);

/// A connection to a worker and what was read from it but not used yet.
pub(crate) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) addr: SocketAddr,
    pub(super) buf: BytesMut,
    /// It carried a request before: a failure before any answer may be the
    /// worker's keep-alive timeout, not the worker.
    pub(super) reused: bool,
}

impl Conn {
    /// Whether the worker left the idle connection alone. The reactor's
    /// readiness answers without a syscall when nothing arrived; when
    /// something did (or a finished response left the readiness set), one
    /// read tells an end or stray bytes from nothing.
    fn alive(&self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        match self.stream.poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            Poll::Ready(Ok(())) => {
                let mut probe = [0u8; 1];
                matches!(
                    self.stream.try_read(&mut probe),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
                )
            }
        }
    }
}

/// The pool of one serving thread.
#[derive(Clone)]
pub struct H1Pool(Arc<Inner>);

struct Inner {
    idle: Mutex<HashMap<SocketAddr, Vec<(Conn, Instant)>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

impl H1Pool {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self(Arc::new(Inner {
            idle: Mutex::new(HashMap::new()),
            connect_timeout,
            idle_timeout,
        }))
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Vec<(Conn, Instant)>>> {
        self.0.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used live idle connection to `addr`.
    pub(super) fn checkout(&self, addr: SocketAddr) -> Option<Conn> {
        let mut idle = self.idle();
        let list = idle.get_mut(&addr)?;
        while let Some((mut conn, since)) = list.pop() {
            let idle = since.elapsed();
            if idle < self.0.idle_timeout && (idle < CHECK_AFTER || conn.alive()) {
                conn.reused = true;
                return Some(conn);
            }
        }
        None
    }

    /// A connection whose response was read to its end, back for the next
    /// request.
    pub(super) fn checkin(&self, conn: Conn) {
        if !conn.buf.is_empty() {
            // Bytes past the response: nothing to pipeline, so the
            // connection's framing is off. Closed.
            return;
        }
        let timeout = self.0.idle_timeout;
        let mut idle = self.idle();
        let list = idle.entry(conn.addr).or_default();
        // The oldest are at the front: drop those past the idle timeout.
        let expired = list
            .iter()
            .take_while(|(_, since)| since.elapsed() >= timeout)
            .count();
        list.drain(..expired);
        if list.len() < MAX_IDLE_PER_WORKER {
            list.push((conn, Instant::now()));
        }
    }

    /// A new connection to `addr`, within the connect timeout.
    pub(super) async fn connect(&self, addr: SocketAddr) -> Result<Conn, H1Error> {
        let timeout = self.0.connect_timeout;
        let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => return Err(H1Error::Connect { addr, source }),
            Err(_) => return Err(H1Error::ConnectTimeout { addr, timeout }),
        };
        let _ = stream.set_nodelay(true);
        Ok(Conn {
            stream,
            addr,
            buf: BytesMut::with_capacity(READ_CHUNK),
            reused: false,
        })
    }

    /// Idle connections held, over every worker.
    #[cfg(test)]
    pub(super) fn idle_count(&self) -> usize {
        self.idle().values().map(Vec::len).sum()
    }
}

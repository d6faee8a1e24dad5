//! Idle keep-alive connections to workers, for one serving thread.
//!
//! Owns the connections between requests: a new one within the connect
//! timeout, the most recently used idle one first, none kept past the idle
//! timeout, after the worker closed it, or with a byte the worker sent
//! unasked (a second response, a late body after a 204): such bytes would
//! be read as the next client's answer. The lock is per serving thread,
//! so it is never contended, and taken twice per request (out and back in).

use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Waker};
use std::time::Duration;

use bytes::BytesMut;
// Keyed by worker address, looked up twice per request.
use foldhash::HashMap;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;
use tokio_util::io::poll_read_buf;

use super::{H1Error, READ_CHUNK};
use crate::tls::WorkerTls;

/// Idle connections kept per worker; more are closed when they come back.
const MAX_IDLE_PER_WORKER: usize = 256;

/// A connection to a worker: plain, or TLS for `https://` workers.
pub(crate) type Stream = Either<TcpStream, Box<TlsStream<TcpStream>>>;

/// What the pool keys connections by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(super) addr: SocketAddr,
    pub(super) tls: bool,
}

/// A connection to a worker and what was read from it but not used yet.
pub(crate) struct Conn {
    pub(super) stream: Stream,
    pub(super) key: Key,
    pub(super) buf: BytesMut,
    /// It carried a request before: a failure before any answer may be the
    /// worker's keep-alive timeout, not the worker.
    pub(super) reused: bool,
}

impl Conn {
    fn tcp(&self) -> &TcpStream {
        match &self.stream {
            Either::Left(tcp) => tcp,
            Either::Right(tls) => tls.get_ref().0,
        }
    }

    /// Whether the worker left the idle connection alone: nothing arrived
    /// on it since its last response ended. Asked of the kernel itself (one
    /// `recv` with `MSG_PEEK`, which a non-blocking socket answers at once),
    /// not of the reactor's readiness, which lags behind bytes the kernel
    /// already holds: hyper's client learns the same from its connection
    /// task, which reads while idle and fails on any byte. On a TLS
    /// connection bytes may be the worker's session tickets, so they are
    /// read through the stream, which takes tickets in and yields only
    /// data (or the end).
    fn alive(&mut self) -> bool {
        let mut probe = [MaybeUninit::<u8>::uninit(); 1];
        match socket2::SockRef::from(self.tcp()).peek(&mut probe) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            // The end, or an error: gone.
            Ok(0) | Err(_) => return false,
            Ok(_) if matches!(self.stream, Either::Left(_)) => return false,
            Ok(_) => {}
        }
        let mut cx = Context::from_waker(Waker::noop());
        self.buf.reserve(READ_CHUNK);
        poll_read_buf(Pin::new(&mut self.stream), &mut cx, &mut self.buf).is_pending()
            && self.buf.is_empty()
    }
}

/// The pool of one serving thread.
#[derive(Clone)]
pub struct H1Pool(Arc<Inner>);

type Idle = HashMap<Key, Vec<(Conn, Instant)>>;

struct Inner {
    idle: Mutex<Idle>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// The handshake of `https://` workers, shared with hyper's client.
    tls: Arc<WorkerTls>,
}

impl H1Pool {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration, tls: Arc<WorkerTls>) -> Self {
        Self(Arc::new(Inner {
            idle: Mutex::new(HashMap::default()),
            connect_timeout,
            idle_timeout,
            tls,
        }))
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.0.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used live idle connection for `key`.
    pub(super) fn checkout(&self, key: Key) -> Option<Conn> {
        let mut idle = self.idle();
        let list = idle.get_mut(&key)?;
        while let Some((mut conn, since)) = list.pop() {
            if since.elapsed() < self.0.idle_timeout && conn.alive() {
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
        let now = Instant::now();
        let mut idle = self.idle();
        let list = idle.entry(conn.key).or_default();
        // The oldest are at the front: drop those past the idle timeout.
        let expired = list
            .iter()
            .take_while(|(_, since)| now.duration_since(*since) >= timeout)
            .count();
        list.drain(..expired);
        if list.len() < MAX_IDLE_PER_WORKER {
            list.push((conn, now));
        }
    }

    /// A new connection for `key`, TCP and (for TLS) the handshake with the
    /// worker at `authority` within the connect timeout.
    pub(super) async fn connect(&self, key: Key, authority: &str) -> Result<Conn, H1Error> {
        let (addr, timeout) = (key.addr, self.0.connect_timeout);
        let started = Instant::now();
        let deadline = started + timeout;
        let tcp = match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => return Err(H1Error::Connect { addr, source }),
            Err(_) => return Err(H1Error::ConnectTimeout { addr, timeout }),
        };
        let _ = tcp.set_nodelay(true);
        let stream = if key.tls {
            let tls = self.0.tls.handshake(authority, tcp, deadline).await;
            Either::Right(Box::new(tls.map_err(H1Error::Tls)?))
        } else {
            Either::Left(tcp)
        };
        self.0
            .tls
            .stats()
            .worker_connected(key.tls, started.elapsed());
        Ok(Conn {
            stream,
            key,
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

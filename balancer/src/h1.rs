//! The HTTP/1.1 client of the fast path: requests to plain-HTTP workers
//! written and read by the request's own task, over a pool of keep-alive
//! connections kept per serving thread.
//!
//! Why not hyper's client here: its connection lives in a task of its own,
//! so every request and every body chunk crosses a channel and a wake-up
//! between that task and the request's, and a streamed body reaches the
//! client one chunk per write. Here the response body reads the socket
//! itself ([`H1Body`]) when the server polls it, so whatever one read
//! returns (many SSE events at once, under load) is handed on before the
//! body goes pending, and the server writes it in one go.
//!
//! Owns connections, the request head's encoding, the response head's
//! parsing (httparse, bounded in size and header count) and the body's
//! framing (`Content-Length`, chunked, or until close). It knows nothing of
//! breakers, retries, routes or which client headers are forwarded (the
//! proxy hands it a [`ForwardedFields`]): an error is returned for the
//! attempt loop to classify. `https://` workers take it too, over the same TLS client
//! configuration as hyper's (sessions resumed per worker); streamed request
//! bodies and host names that are not resolved yet take hyper's client.

mod body;
mod pool;

use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{Method, Response, StatusCode, Version};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio_util::io::poll_read_buf;

use crate::bodies::BoxError;
use crate::wire::{Field, RawFields, decimal, parse_length, put_header};

pub use body::H1Body;
pub use pool::H1Pool;

use body::Framing;
use pool::{Conn, Key, Stream};

/// The largest response head read from a worker.
const MAX_HEAD: usize = 64 * 1024;
/// The most headers in a worker's response head.
const MAX_HEADERS: usize = 100;
/// What one read asks the kernel for, at least.
const READ_CHUNK: usize = 16 * 1024;

/// Why a request to a worker failed; the attempt loop decides what it
/// means for the worker.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    #[error("connecting to {addr}: {source}")]
    Connect { addr: SocketAddr, source: io::Error },
    #[error("connecting to {addr}: no answer within {timeout:?}")]
    ConnectTimeout { addr: SocketAddr, timeout: Duration },
    #[error("{0}")]
    Tls(BoxError),
    #[error("the worker's connection failed: {0}")]
    Io(#[from] io::Error),
    #[error("the worker closed the connection before answering")]
    Closed,
    #[error("the worker's response head is malformed: {0}")]
    Malformed(String),
    #[error("the worker's response head is larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
}

/// The fields the fast client writes after `Host`. Which of the client's
/// headers go to the worker is the proxy's decision (its `Forwarded`); this
/// client only writes them, and knows nothing of the proxy.
pub(crate) trait ForwardedFields {
    /// How many fields the client sent: sizes the head's buffer.
    fn count(&self) -> usize;
    /// Whether the client sent `Authorization`: a worker URL's credentials
    /// are added only when it did not.
    fn has_authorization(&self) -> bool;
    /// Writes every forwarded field into `out`, one `name: value` line each.
    fn put(&self, out: &mut BytesMut);
}

/// The request as the proxy has it: nothing is copied into a new map.
pub(crate) struct H1Request<'a> {
    pub method: &'a Method,
    /// Path and query.
    pub path: &'a str,
    /// `host[:port]` of the worker, for `Host` (and the TLS server name).
    pub authority: &'a str,
    /// The worker is `https://`.
    pub tls: bool,
    /// The headers to forward (hop-by-hop ones, `Host` and
    /// `Content-Length` left out by it).
    pub headers: &'a (dyn ForwardedFields + Sync),
    /// `Authorization` to add when the headers have none.
    pub authorization: Option<&'a str>,
    pub body: Bytes,
}

impl H1Request<'_> {
    /// The request head, into `out`.
    fn encode(&self, out: &mut BytesMut) {
        out.reserve(256 + self.headers.count() * 48);
        out.put_slice(self.method.as_str().as_bytes());
        out.put_u8(b' ');
        out.put_slice(self.path.as_bytes());
        out.put_slice(b" HTTP/1.1\r\nhost: ");
        out.put_slice(self.authority.as_bytes());
        out.put_slice(b"\r\n");
        self.headers.put(out);
        if let Some(auth) = self.authorization
            && !self.headers.has_authorization()
        {
            put_header(out, b"authorization", auth.as_bytes());
        }
        // A body-less GET carries no length, as hyper sends it.
        if !self.body.is_empty() || !matches!(*self.method, Method::GET | Method::HEAD) {
            let mut digits = [0; 20];
            let length = decimal(self.body.len() as u64, &mut digits);
            put_header(out, b"content-length", length);
        }
        out.put_slice(b"\r\n");
    }
}

impl H1Pool {
    /// Sends `request` to the worker at `addr`, on a pooled connection when
    /// one is idle; returns when the response head is in.
    ///
    /// A pooled connection that turns out closed while the request is
    /// written (the worker's keep-alive timeout raced this request) is
    /// replaced by a new one, once: that is the pool's doing, not the
    /// worker's failure. Nothing is sent again once the request is written.
    pub(crate) async fn send(
        &self,
        addr: SocketAddr,
        request: &H1Request<'_>,
    ) -> Result<Response<H1Body>, H1Error> {
        let key = Key {
            addr,
            tls: request.tls,
        };
        if let Some(conn) = self.checkout(key) {
            match exchange(conn, request).await {
                Err(Stale) => {}
                Ok(result) => return result.map(|(parts, conn)| self.response(parts, conn)),
            }
        }
        // Boxed: a connect (and its TLS handshake) is a large future, needed
        // only when no pooled connection is there; unboxed, every request's
        // future would carry its size.
        let conn = Box::pin(self.connect(key, request.authority)).await?;
        match exchange(conn, request).await {
            Err(Stale) => Err(H1Error::Closed),
            Ok(result) => result.map(|(parts, conn)| self.response(parts, conn)),
        }
    }

    fn response(&self, head: Head, conn: Conn) -> Response<H1Body> {
        let body = H1Body::new(conn, head.framing, head.fields, self.clone());
        Response::from_parts(head.parts, body)
    }
}

/// The buffer a request head is encoded into, kept by the serving thread
/// between writes so that a head costs no allocation. Taken for one write
/// and given back when it is dropped; a write that starts while another
/// holds it gets a fresh one (the last one given back stays).
struct Scratch(BytesMut);

/// A head buffer that grew past this is not kept.
const SCRATCH_KEPT: usize = 16 * 1024;

thread_local! {
    static SCRATCH: std::cell::Cell<Option<BytesMut>> = const { std::cell::Cell::new(None) };
}

impl Scratch {
    fn take() -> Self {
        Self(SCRATCH.take().unwrap_or_default())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.0.capacity() <= SCRATCH_KEPT {
            self.0.clear();
            SCRATCH.set(Some(std::mem::take(&mut self.0)));
        }
    }
}

/// A reused connection was closed before it took the request.
struct Stale;

/// A parsed response head: status and version in `parts`, whose map stays
/// empty; the fields to relay as they came; the body's framing.
struct Head {
    parts: http::response::Parts,
    fields: RawFields,
    framing: Framing,
}

type Exchanged = Result<(Head, Conn), H1Error>;

/// Writes the request and reads the response head. `Err(Stale)` when a
/// reused connection ended before the request could be written. An async
/// block, as the request path's are: an async function keeps its moved-in
/// connection twice.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn would keep its moved-in arguments twice"
)]
fn exchange(
    mut conn: Conn,
    request: &H1Request<'_>,
) -> impl Future<Output = Result<Exchanged, Stale>> {
    async move {
        let reused = conn.reused;
        let stale = |e: &H1Error| reused && conn_ended_early(e);
        // The head is encoded for this write alone (again for a second
        // connection after a stale one): its buffer goes back to the thread
        // before the answer is awaited, which for a model can take seconds.
        let written = {
            let mut head = Scratch::take();
            request.encode(&mut head.0);
            write_all(&mut conn.stream, &head.0, &request.body).await
        };
        if let Err(e) = written {
            let e = H1Error::Io(e);
            return if stale(&e) { Err(Stale) } else { Ok(Err(e)) };
        }
        // Once the request is written the worker may have read it and
        // acted on it: whatever happens next is the retry loop's to judge,
        // never a silent second send (hyper's `retry_canceled_requests`
        // resends only what was never written either).
        match read_head(&mut conn, request.method).await {
            Err(e) => Ok(Err(e)),
            Ok(head) => Ok(Ok((head, conn))),
        }
    }
}

/// Whether `error` is a connection that ended (rather than a worker that
/// answered wrong).
fn conn_ended_early(error: &H1Error) -> bool {
    match error {
        H1Error::Closed => true,
        H1Error::Io(e) => matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
}

/// Writes the head and the body, vectored (one syscall on a plain
/// connection when the socket takes it all), then flushes (TLS).
async fn write_all(stream: &mut Stream, head: &[u8], body: &[u8]) -> io::Result<()> {
    let total = head.len() + body.len();
    let mut written = 0;
    while written < total {
        let n = if written < head.len() {
            let slices = [IoSlice::new(&head[written..]), IoSlice::new(body)];
            poll_fn(|cx| Pin::new(&mut *stream).poll_write_vectored(cx, &slices)).await?
        } else {
            let slices = [IoSlice::new(&body[written - head.len()..])];
            poll_fn(|cx| Pin::new(&mut *stream).poll_write_vectored(cx, &slices)).await?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        written += n;
    }
    stream.flush().await
}

/// Reads more of the connection into its buffer; `Ok(0)` at the end.
async fn fill(conn: &mut Conn) -> io::Result<usize> {
    conn.buf.reserve(READ_CHUNK);
    poll_fn(|cx| poll_read_buf(Pin::new(&mut conn.stream), cx, &mut conn.buf)).await
}

/// Reads and parses the response head (skipping `1xx` interim answers);
/// the body's first bytes stay in the buffer.
async fn read_head(conn: &mut Conn, method: &Method) -> Result<Head, H1Error> {
    loop {
        if let Some(parsed) = parse_head(&mut conn.buf, method)? {
            return Ok(parsed);
        }
        if conn.buf.len() >= MAX_HEAD {
            return Err(H1Error::HeadTooLarge);
        }
        if fill(conn).await? == 0 {
            return Err(H1Error::Closed);
        }
    }
}

/// A complete response head at the start of `buf`, taken out of it; `None`
/// when more bytes are needed. Interim `1xx` heads are dropped.
fn parse_head(buf: &mut BytesMut, method: &Method) -> Result<Option<Head>, H1Error> {
    loop {
        // Uninitialised: zeroing 100 headers costs more than parsing a
        // worker's usual five.
        let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut parsed,
            buf,
            &mut headers,
        ) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(H1Error::Malformed(e.to_string())),
        };
        let code = parsed.code.unwrap_or(0);
        let status =
            StatusCode::from_u16(code).map_err(|_| H1Error::Malformed(format!("status {code}")))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            // This client never asks for an upgrade (`Upgrade` is
            // hop-by-hop and not forwarded): what would follow is not
            // HTTP, and a worker that switches unasked answered wrong.
            return Err(H1Error::Malformed(
                "101 to a request that asked no upgrade".to_owned(),
            ));
        }
        if status.is_informational() {
            let _ = buf.split_to(len);
            continue;
        }
        // At the size of the head, and kept as it is.
        let mut fields = Vec::with_capacity(parsed.headers.len());
        // Any Transfer-Encoding, and whether its last coding is chunked
        // (RFC 9112 6.3: only then does chunked frame the body).
        let (mut coded, mut chunked) = (false, false);
        let mut length = None;
        let http10 = parsed.version == Some(0);
        // HTTP/1.0 closes unless it asks to keep the connection.
        let (mut close, mut keep) = (false, false);
        // Headers the worker's `Connection` names describe its hop only
        // (RFC 9110 7.6.1); almost always none.
        let mut named: Vec<Vec<u8>> = Vec::new();
        for h in parsed.headers.iter() {
            let (name, value) = (h.name.as_bytes(), h.value);
            if name.eq_ignore_ascii_case(b"date") {
                // The gateway dates its own answer, as nginx does: one
                // header less to copy into a map and out again.
                continue;
            }
            // The framing headers describe this hop only: read here, and
            // left out of the map the relay would strip them from.
            if name.eq_ignore_ascii_case(b"transfer-encoding") {
                coded = true;
                chunked = value
                    .rsplit(|&b| b == b',')
                    .next()
                    .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
                continue;
            } else if name.eq_ignore_ascii_case(b"connection") {
                for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        keep = true;
                    } else if !token.is_empty() {
                        named.push(token.to_ascii_lowercase());
                    }
                }
                continue;
            } else if name.eq_ignore_ascii_case(b"keep-alive") {
                continue;
            } else if name.eq_ignore_ascii_case(b"content-length") {
                let n = parse_length(value.trim_ascii())
                    .ok_or_else(|| H1Error::Malformed("content-length".to_owned()))?;
                if length.is_some_and(|l| l != n) {
                    return Err(H1Error::Malformed("two content-lengths".to_owned()));
                }
                length = Some(n);
            }
            fields.push(Field::of(buf, h));
        }
        close |= http10 && !keep;
        if coded && http10 {
            // RFC 9112 6.1: an HTTP/1.0 message has no transfer coding;
            // hyper's client refuses it too.
            return Err(H1Error::Malformed(
                "transfer-encoding in an HTTP/1.0 response".to_owned(),
            ));
        }
        // Kept as they came, sharing the head's bytes: no map is built and
        // nothing is copied until the writer's head.
        let mut fields = RawFields::new(buf.split_to(len).freeze(), fields);
        if !named.is_empty() {
            fields.remove_where(|name| named.iter().any(|n| name.eq_ignore_ascii_case(n)));
        }
        let bodiless = *method == Method::HEAD
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        if coded {
            // Transfer-Encoding wins over a Content-Length (RFC 9112 6.3),
            // which frames nothing then and is not relayed; a response that
            // carried both is not trusted with the connection again.
            fields.remove_where(|name| name.eq_ignore_ascii_case(b"content-length"));
            close |= length.is_some();
        }
        let framing = if bodiless {
            Framing::empty(close)
        } else if chunked {
            Framing::chunked(close)
        } else if coded {
            // A coding other than chunked last: the body runs to the close.
            Framing::until_close()
        } else if let Some(n) = length {
            Framing::sized(n, close)
        } else {
            Framing::until_close()
        };
        let mut response = Response::new(());
        *response.status_mut() = status;
        *response.version_mut() = Version::HTTP_11;
        let (parts, ()) = response.into_parts();
        return Ok(Some(Head {
            parts,
            fields,
            framing,
        }));
    }
}

/// What the fast client makes of a worker's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answered {
    pub status: StatusCode,
    pub body: Vec<u8>,
    /// The connection would go back to the pool.
    pub reusable: bool,
}

/// A worker's answer as bytes, read as the fast client reads it: the head,
/// then the body under its framing, the worker closing after `wire` only
/// if the body runs to the close. `None` where the client fails the
/// exchange. The fuzz targets' entry ([`crate::fuzzing::worker_response`],
/// the differential test); it must only return.
pub(crate) fn read_answer(wire: &[u8]) -> Option<Answered> {
    let mut buf = BytesMut::from(wire);
    let mut head = parse_head(&mut buf, &Method::POST).ok()??;
    let mut data = Vec::new();
    let by_framing = loop {
        match body::decode(&mut head.framing, &mut buf, true).ok()? {
            body::Step::Data(bytes) => data.extend_from_slice(&bytes),
            body::Step::End => break true,
            // Only a body that runs to the close ends at the worker's end.
            body::Step::More if head.framing.runs_to_close() => break false,
            body::Step::More => return None,
        }
    };
    Some(Answered {
        status: head.parts.status,
        body: data,
        // As [`H1Body`] and the pool decide: the framing ended it, the
        // worker did not ask to close, and nothing came after it.
        reusable: by_framing && head.framing.keeps_connection() && buf.is_empty(),
    })
}

#[cfg(test)]
mod tests;

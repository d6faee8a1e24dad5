//! The HTTP/1.1 fast path of a connection: plain requests read, handed to
//! the handler and answered by the connection's own loop, with no
//! dispatcher between the socket and the handler.
//!
//! Owns what "plain" means and the wire format of those exchanges. A plain
//! request is HTTP/1.1, `GET`, `POST`, `PUT`, `DELETE` or `PATCH` to an
//! origin-form target, its head (httparse) at most [`MAX_HEAD`] bytes and
//! [`MAX_HEADERS`] headers, framed by at most one all-digit
//! `Content-Length` and free of `Transfer-Encoding`, `Expect` and
//! `Upgrade`, and its whole body is already read when its head is. The
//! first request that is not plain, and everything after it on its
//! connection, goes to hyper with the bytes read so far ([`End::HandOver`]):
//! the rules of the unusual (400 and 431, `100-continue`, chunked and slow
//! uploads and their stall timeout, HTTP/1.0, HTTP/2, upgrades) stay
//! hyper's. Framing is never ambiguous between the two parsers: a request
//! either has one plain `Content-Length` or hyper reads it.
//!
//! The loop keeps hyper's behaviour towards clients: the header-read
//! timeout (for the first head and every next one, enforced by the
//! connection's watchdog, so that waiting for a head arms no timer), a
//! client that closes while its request is in flight cancels it (hyper's
//! default, no half-close), responses framed by `Content-Length` when their size is
//! known and chunked otherwise, each frame written as soon as the body has
//! nothing more ready (streams go out frame by frame, and the socket's
//! backpressure holds the body), `Date` added, a broken body aborting the
//! connection, and graceful shutdown between requests. What a request means
//! stays the handler's; the idle and send timeouts stay the watchdog's.
//!
//! One bound differs from hyper alone: a connection handed over mid-head
//! (a head past [`MAX_HEAD`], say) gets hyper's header-read timeout afresh,
//! so that head may take up to twice the timeout; HTTP/2's preface is bound
//! by the watchdog's idle timeout, as hyper's version sniffing has none.

use std::future::{Future, poll_fn};
use std::io;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;

use super::{Activity, Busy, Peer, stopped};
use crate::bodies::{BoxError, Inbound, ResponseBody};
use crate::wire::{Field, RawFields, decimal, header_map, hex, parse_length, put_header};

/// The largest head the fast path parses; a larger one goes to hyper,
/// which answers 431 past its own limit.
const MAX_HEAD: usize = 16 * 1024;
/// The most headers the fast path parses; more go to hyper.
const MAX_HEADERS: usize = 64;
/// The largest request (head and body) the fast path holds; a larger one
/// streams through hyper.
const MAX_REQUEST: usize = 256 * 1024;
/// What the read buffer grows by, and the spare room below which it grows.
const READ_CHUNK: usize = 8 * 1024;
const MIN_SPARE: usize = 1024;
/// The first read of a connection, on the stack.
const FIRST_READ: usize = 512;
/// Response bytes gathered before they are written even though the body
/// has more ready, and the frame size past which a frame is written
/// straight from its own buffer rather than copied.
const WRITE_BATCH: usize = 64 * 1024;
const COPY_LIMIT: usize = 16 * 1024;
/// The write buffer's capacity past which it is given back after a
/// response, so that a keep-alive connection does not keep what one large
/// exchange grew.
const OUT_KEPT: usize = 2 * COPY_LIMIT;

/// How the fast path left a connection.
pub(super) enum End {
    /// Closed, or to be closed: nothing more is read from it.
    Closed,
    /// A request that is not plain: hyper serves the connection from here,
    /// starting with these bytes; HTTP/1 alone once the fast path answered
    /// a request (HTTP/2's preface is a connection's first bytes or
    /// nothing, as hyper alone holds it).
    HandOver { read: Bytes, http1_only: bool },
}

/// One connection's fast path.
pub(super) struct Fast<'a, IO> {
    io: &'a mut IO,
    /// Read from the client, not yet consumed.
    buf: BytesMut,
    /// The response bytes not yet written.
    out: BytesMut,
    /// The client has closed its side. What it sent before is still
    /// served; it is gone once that is used up (hyper's rule).
    eof: bool,
    /// Requests carry their header fields as they came, with no map built
    /// ([`ConnectionLimits::raw_fields`](super::ConnectionLimits)).
    raw_fields: bool,
    /// A request was answered on this connection.
    served: bool,
}

impl<'a, IO> Fast<'a, IO>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    pub(super) fn new(io: &'a mut IO, raw_fields: bool) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
            out: BytesMut::new(),
            eof: false,
            raw_fields,
            served: false,
        }
    }

    /// Serves plain requests until the connection ends or a request that is
    /// not plain arrives.
    pub(super) async fn serve<H, F>(
        mut self,
        handler: &H,
        peer: Peer,
        activity: &Arc<Activity>,
        shutdown: &watch::Receiver<bool>,
    ) -> End
    where
        H: Fn(Request<Inbound>, Peer) -> F,
        F: Future<Output = Response<ResponseBody>>,
    {
        // Waits for shutdown for the connection's whole life: registered
        // once, not once per request.
        let mut watching = shutdown.clone();
        let mut stopping = pin!(stopped(&mut watching));
        loop {
            // The next plain request. How long it may take is the
            // watchdog's header-read timeout: waiting here arms no timer.
            // Inline rather than a future of its own, and what it yields is
            // the request's shape (88 bytes), not the request: a request is
            // built where it is handed over, as each move of one is a copy
            // of its 312 bytes.
            let plain = loop {
                match self.buffered() {
                    Some(Next::Plain(plain)) => break plain,
                    Some(Next::Unusual) => return self.hand_over(),
                    Some(Next::Closed) => return End::Closed,
                    None => {
                        if !self.read_head(stopping.as_mut()).await {
                            return End::Closed;
                        }
                    }
                }
            };
            let close = plain.close;
            let Some(request) = self.take(plain) else {
                return self.hand_over();
            };
            let busy = Busy::new(activity);
            let Some(mut response) = self.answer(handler(request, peer)).await else {
                // The client left: dropping the handler's future cancels the
                // request.
                return End::Closed;
            };
            let close = close || *shutdown.borrow();
            // Lent, not moved: a move into `respond`'s future, then out of
            // it into parts, were two copies of the response's 184 bytes.
            let wrote = self.respond(&mut response, close).await;
            drop(response);
            drop(busy);
            if !wrote || close {
                let _ = self.io.shutdown().await;
                return End::Closed;
            }
            self.served = true;
            self.trim();
        }
    }

    fn hand_over(self) -> End {
        End::HandOver {
            read: self.buf.freeze(),
            http1_only: self.served,
        }
    }

    /// Gives back what one large exchange grew: between requests a
    /// connection keeps at most a small write buffer and, when nothing is
    /// left to read, a read buffer of a chunk or two.
    fn trim(&mut self) {
        if self.out.capacity() > OUT_KEPT {
            self.out = BytesMut::new();
        }
        if self.buf.is_empty() && self.buf.capacity() > 2 * READ_CHUNK {
            self.buf = BytesMut::new();
        }
    }

    /// What comes next if what is read tells (a plain request is all
    /// read), `None` while more of a head is needed. Not async: the header
    /// slots live on the stack only while a head is scanned, not in every
    /// waiting connection's future.
    fn buffered(&mut self) -> Option<Next> {
        match scan(&self.buf) {
            Scan::Unusual => Some(Next::Unusual),
            Scan::Plain(plain) if self.buf.len() >= plain.len() => Some(Next::Plain(plain)),
            Scan::Plain(_) => {
                // The body has not all come with the head. What the socket
                // holds already is taken; if that is not enough, hyper reads
                // the rest under the body's stall timeout.
                if !self.drain_ready() {
                    return Some(Next::Closed);
                }
                Some(match scan(&self.buf) {
                    Scan::Plain(plain) if self.buf.len() >= plain.len() => Next::Plain(plain),
                    _ => Next::Unusual,
                })
            }
            Scan::Partial if self.buf.len() >= MAX_HEAD => Some(Next::Unusual),
            Scan::Partial => None,
        }
    }

    /// Room for the next read. Grown only when little is left: the buffer
    /// is shared with the previous requests' header values, and growing it
    /// while they live would copy it.
    fn spare(&mut self) {
        if self.buf.capacity() - self.buf.len() < MIN_SPARE {
            self.buf.reserve(READ_CHUNK);
        }
    }

    /// Reads more of a head; false when the connection is over: the client
    /// closed it, or the gateway is shutting down and no request has begun.
    async fn read_head(&mut self, mut stopping: Pin<&mut impl Future<Output = ()>>) -> bool {
        // A connection that has sent nothing yet holds no buffer: an idle
        // one costs only its socket and task. Its first bytes are read on
        // the stack.
        let fresh = self.buf.capacity() == 0;
        if !fresh {
            self.spare();
        }
        let idle = self.buf.is_empty();
        let Self { io, buf, .. } = self;
        poll_fn(|cx| {
            let read = if fresh {
                let mut first = [MaybeUninit::<u8>::uninit(); FIRST_READ];
                let mut first = ReadBuf::uninit(&mut first);
                Pin::new(&mut **io).poll_read(cx, &mut first).map_ok(|()| {
                    let read = first.filled();
                    if !read.is_empty() {
                        buf.reserve(READ_CHUNK);
                        buf.put_slice(read);
                    }
                    read.len()
                })
            } else {
                poll_read_buf(Pin::new(&mut **io), cx, buf)
            };
            match read {
                Poll::Ready(Ok(n)) => return Poll::Ready(n > 0),
                Poll::Ready(Err(_)) => return Poll::Ready(false),
                Poll::Pending => {}
            }
            if idle && stopping.as_mut().poll(cx).is_ready() {
                return Poll::Ready(false);
            }
            Poll::Pending
        })
        .await
    }

    /// Takes what the socket already holds, up to [`MAX_REQUEST`]; false
    /// when the client closed or failed.
    fn drain_ready(&mut self) -> bool {
        !self.client_gone(&mut Context::from_waker(std::task::Waker::noop()))
    }

    /// Whether the client is gone: its connection failed, or it closed its
    /// side and nothing it sent before is left to serve (a client that
    /// pipelines and half-closes still gets the answers to what it sent
    /// first, as from hyper). Reads what it sent meanwhile (pipelined
    /// requests), up to [`MAX_REQUEST`]; past that nothing more is read
    /// until this request is answered.
    fn client_gone(&mut self, cx: &mut Context<'_>) -> bool {
        while !self.eof && self.buf.len() < MAX_REQUEST {
            self.spare();
            match poll_read_buf(Pin::new(&mut *self.io), cx, &mut self.buf) {
                Poll::Ready(Ok(0)) => self.eof = true,
                Poll::Ready(Err(_)) => return true,
                Poll::Ready(Ok(_)) => {}
                Poll::Pending => return false,
            }
        }
        self.eof && self.buf.is_empty()
    }

    /// The request scanned as `plain`, taken out of the buffer. Values
    /// share the buffer: nothing is copied. `None` when it is not valid
    /// after all (a header value or the target): the buffer is whole
    /// again, for hyper to answer it from its first byte.
    fn take(&mut self, plain: Plain) -> Option<Request<Inbound>> {
        let head = self.buf.split_to(plain.head).freeze();
        let body = self.buf.split_to(plain.body).freeze();
        let request = build(&head, plain, body.clone(), self.raw_fields);
        if request.is_none() {
            let mut whole = BytesMut::with_capacity(head.len() + body.len() + self.buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(&body);
            whole.extend_from_slice(&self.buf);
            self.buf = whole;
        }
        request
    }

    /// The handler's response, or `None` if the client left first.
    async fn answer<F>(&mut self, handling: F) -> Option<Response<ResponseBody>>
    where
        F: Future<Output = Response<ResponseBody>>,
    {
        let mut handling = pin!(handling);
        poll_fn(|cx| {
            if let Poll::Ready(response) = handling.as_mut().poll(cx) {
                return Poll::Ready(Some(response));
            }
            if self.client_gone(cx) {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await
    }

    /// Writes `response`; false when the connection cannot carry another
    /// one (the client left, the body broke, or its length was wrong).
    async fn respond(&mut self, response: &mut Response<ResponseBody>, close: bool) -> bool {
        // A final 1xx (a worker's unasked 101 through hyper's client): what
        // follows it is no longer HTTP, so none of it is relayed and the
        // connection ends after the head, as hyper's server ends it.
        let switched = response.status().is_informational();
        let mut framing = self.head(response, close || switched);
        let body = response.body_mut();
        if switched {
            let _ = self.flush().await;
            return false;
        }
        loop {
            let step = poll_fn(|cx| match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(frame) => Poll::Ready(Step::Frame(frame)),
                // Whatever is gathered goes out before the body is awaited:
                // a stream reaches the client frame by frame.
                Poll::Pending if !self.out.is_empty() => Poll::Ready(Step::Flush),
                Poll::Pending if self.client_gone(cx) => Poll::Ready(Step::Gone),
                Poll::Pending => Poll::Pending,
            })
            .await;
            match step {
                Step::Flush => {
                    if self.flush().await.is_err() {
                        return false;
                    }
                }
                Step::Gone => return false,
                Step::Frame(None) => break,
                Step::Frame(Some(Err(_))) => {
                    // As hyper does: what was sent stands, and the
                    // connection is cut so the client sees the body end
                    // unfinished.
                    let _ = self.flush().await;
                    return false;
                }
                Step::Frame(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data()
                        && self.data(&mut framing, data).await.is_err()
                    {
                        return false;
                    }
                    if body.is_end_stream() {
                        break;
                    }
                    if self.out.len() >= WRITE_BATCH && self.flush().await.is_err() {
                        return false;
                    }
                }
            }
        }
        let whole = match framing {
            Framing::Chunked => {
                self.out.put_slice(b"0\r\n\r\n");
                true
            }
            Framing::Sized(left) => left == 0,
            Framing::Empty => true,
        };
        self.flush().await.is_ok() && whole
    }

    /// The response head, into `out`; the framing its body takes.
    fn head(&mut self, response: &Response<ResponseBody>, close: bool) -> Framing {
        let (status, headers, body) = (&response.status(), response.headers(), response.body());
        let out = &mut self.out;
        out.reserve(128 + (headers.len() + body.fields().len()) * 64);
        out.put_slice(b"HTTP/1.1 ");
        out.put_slice(status.as_str().as_bytes());
        out.put_u8(b' ');
        out.put_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
        out.put_slice(b"\r\n");
        let bodiless = status.is_informational()
            || *status == StatusCode::NO_CONTENT
            || *status == StatusCode::NOT_MODIFIED;
        // RFC 9110 8.6: never on a 1xx or 204 (a 304's names the
        // representation, and passes).
        let lengthless = status.is_informational() || *status == StatusCode::NO_CONTENT;
        let mut framing = None;
        // The worker's fields as they came, then the map: the same rules
        // for both.
        let relayed = body.fields().iter();
        let mapped = headers
            .iter()
            .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes()));
        for (name, value) in relayed.chain(mapped) {
            let length = name.eq_ignore_ascii_case(b"content-length");
            if (lengthless && length)
                || name.eq_ignore_ascii_case(b"transfer-encoding")
                || name.eq_ignore_ascii_case(b"connection")
            {
                // Framing and the connection's fate are this loop's.
                continue;
            }
            if length && !bodiless {
                let Some(n) = parse_length(value) else {
                    // A length that is no number frames nothing: chunked.
                    continue;
                };
                if framing.is_some() {
                    continue;
                }
                framing = Some(Framing::Sized(n));
            }
            put_header(out, name, value);
        }
        if let Some((name, value)) = body.request_id()
            && !headers.contains_key(name)
            && !body.fields().contains(name.as_str())
        {
            put_header(out, name.as_str().as_bytes(), value.as_bytes());
        }
        if !headers.contains_key(header::DATE) && !body.fields().contains("date") {
            out.put_slice(b"date: ");
            put_date(out);
            out.put_slice(b"\r\n");
        }
        let framing = match framing {
            _ if bodiless => Framing::Empty,
            Some(sized) => sized,
            None => match body.size_hint().exact() {
                Some(n) => {
                    put_header(out, b"content-length", decimal(n, &mut [0; 20]));
                    Framing::Sized(n)
                }
                None => {
                    out.put_slice(b"transfer-encoding: chunked\r\n");
                    Framing::Chunked
                }
            },
        };
        if close {
            out.put_slice(b"connection: close\r\n");
        }
        out.put_slice(b"\r\n");
        framing
    }

    /// A frame of the body, under its framing. A body longer than its
    /// `Content-Length` is cut there (the connection then closes).
    async fn data(&mut self, framing: &mut Framing, mut data: Bytes) -> io::Result<()> {
        match framing {
            Framing::Empty => Ok(()),
            Framing::Sized(left) => {
                if data.len() as u64 > *left {
                    // Longer than its length: what fits goes out, then the
                    // connection closes, as its framing is lost.
                    data.truncate(*left as usize);
                    *left = 0;
                    self.put(data).await?;
                    self.flush().await?;
                    return Err(io::Error::other("a body longer than its Content-Length"));
                }
                *left -= data.len() as u64;
                self.put(data).await
            }
            Framing::Chunked if data.is_empty() => Ok(()),
            Framing::Chunked => {
                let mut size = [0; 16];
                self.out.put_slice(hex(data.len(), &mut size));
                self.out.put_slice(b"\r\n");
                self.put(data).await?;
                self.out.put_slice(b"\r\n");
                Ok(())
            }
        }
    }

    /// Body bytes: copied after what is gathered, or (a large frame) written
    /// from their own buffer once the gathered bytes are out.
    async fn put(&mut self, mut data: Bytes) -> io::Result<()> {
        if data.len() <= COPY_LIMIT {
            self.out.put_slice(&data);
            return Ok(());
        }
        self.flush().await?;
        while data.has_remaining() {
            let n = self.io.write(&data).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            data.advance(n);
        }
        Ok(())
    }

    async fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.io.write_all(&self.out).await?;
            self.out.clear();
        }
        self.io.flush().await
    }
}

/// What the fast path found next on a connection.
enum Next {
    /// A plain request, all read.
    Plain(Plain),
    Unusual,
    Closed,
}

/// What the response loop does next.
enum Step {
    Frame(Option<Result<Frame<Bytes>, BoxError>>),
    Flush,
    Gone,
}

/// How a response body is framed on the wire.
enum Framing {
    /// No body (204, 304, 1xx): frames are dropped.
    Empty,
    /// `Content-Length`: the bytes still owed.
    Sized(u64),
    Chunked,
}

/// A plain request's shape, found by [`scan`].
struct Plain {
    /// Head bytes, through the blank line.
    head: usize,
    /// Body bytes (its `Content-Length`).
    body: usize,
    method: Method,
    target: Range<usize>,
    /// Where its headers sit in the head.
    fields: Vec<Field>,
    /// The client asked to close after this request.
    close: bool,
}

impl Plain {
    fn len(&self) -> usize {
        self.head + self.body
    }
}

enum Scan {
    Plain(Plain),
    /// More bytes are needed to tell.
    Partial,
    /// Not plain: hyper's.
    Unusual,
}

/// Whether `buf` starts with a plain request head, and where its parts are.
fn scan(buf: &[u8]) -> Scan {
    if buf.is_empty() {
        return Scan::Partial;
    }
    // Uninitialised: zeroing the slots costs more than parsing the few
    // headers a request has.
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let head = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut parsed,
        buf,
        &mut slots,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Scan::Partial,
        // Malformed, too many headers, HTTP/2's preface: hyper's to answer.
        Err(_) => return Scan::Unusual,
    };
    if head > MAX_HEAD || parsed.version != Some(1) {
        return Scan::Unusual;
    }
    let method = match parsed.method.unwrap_or_default() {
        "GET" => Method::GET,
        "POST" => Method::POST,
        "PUT" => Method::PUT,
        "DELETE" => Method::DELETE,
        "PATCH" => Method::PATCH,
        _ => return Scan::Unusual,
    };
    let path = parsed.path.unwrap_or_default();
    if !path.starts_with('/') {
        return Scan::Unusual;
    }
    let mut length = None;
    let mut close = false;
    // Allocated once the head is whole, at its size: the list goes on with
    // the request as it is.
    let mut fields = Vec::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let (name, value) = (h.name.as_bytes(), h.value);
        if name.eq_ignore_ascii_case(b"content-length") {
            match parse_length(value) {
                Some(n) if length.is_none() => length = Some(n),
                // Two lengths, or one that is not plain digits.
                _ => return Scan::Unusual,
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding")
            || name.eq_ignore_ascii_case(b"expect")
            || name.eq_ignore_ascii_case(b"upgrade")
        {
            return Scan::Unusual;
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"upgrade") {
                    return Scan::Unusual;
                }
            }
        }
        fields.push(Field::of(buf, h));
    }
    let body = match length {
        Some(n) if n > (MAX_REQUEST - head) as u64 => return Scan::Unusual,
        Some(n) => n as usize,
        None => 0,
    };
    let at = crate::wire::span(buf, path.as_bytes()).0 as usize;
    Scan::Plain(Plain {
        head,
        body,
        method,
        target: at..at + path.len(),
        fields,
        close,
    })
}

/// The request from its frozen head; `None` when its target or a header
/// is not valid for `http`'s types (hyper then answers it). With
/// `raw_fields` the headers stay fields in the body and the map is empty:
/// httparse checked them by `http`'s rules, so none is refused later.
fn build(head: &Bytes, plain: Plain, body: Bytes, raw_fields: bool) -> Option<Request<Inbound>> {
    let uri = target_uri(head, plain.target)?;
    let (headers, body) = if raw_fields {
        let raw = RawFields::new(head.clone(), plain.fields);
        (HeaderMap::new(), Inbound::with_fields(body, raw))
    } else {
        (header_map(head, &plain.fields).ok()?, Inbound::whole(body))
    };
    let mut request = Request::new(body);
    *request.method_mut() = plain.method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    Some(request)
}

/// A client's bytes as the fast path reads them: whether it takes them as
/// a plain request, and then the request it hands on, the lengths of its
/// head and body, and whether the connection closes after it.
/// The fuzz targets' entry ([`crate::fuzzing::client_request`], the
/// differential test); it must only return.
pub(crate) fn read_request(wire: &[u8]) -> Option<(Request<Inbound>, usize, usize, bool)> {
    let Scan::Plain(plain) = scan(wire) else {
        return None;
    };
    let whole = wire.get(..plain.len())?;
    let (head_len, body_len, close) = (plain.head, plain.body, plain.close);
    let head = Bytes::copy_from_slice(&whole[..head_len]);
    let body = Bytes::copy_from_slice(&whole[head_len..]);
    let request = build(&head, plain, body, false)?;
    Some((request, head_len, body_len, close))
}

/// The request target as a `Uri`. The last one parsed on this thread is
/// kept: clients send the same target over and over (`/v1/chat/completions`),
/// and checking it byte by byte again cost more than the rest of the
/// request's building. A hit compares the bytes and clones the `Uri`.
fn target_uri(head: &Bytes, target: Range<usize>) -> Option<Uri> {
    use std::cell::RefCell;
    thread_local! {
        static LAST: RefCell<Option<Uri>> = const { RefCell::new(None) };
    }
    let bytes = head.get(target)?;
    LAST.with_borrow_mut(|last| {
        if let Some(uri) = last.as_ref()
            && uri.path_and_query().map(|p| p.as_str().as_bytes()) == Some(bytes)
        {
            return Some(uri.clone());
        }
        // Its own copy when kept: a slice of the head would hold the
        // connection's read buffer.
        let uri = Uri::from_maybe_shared(Bytes::copy_from_slice(bytes)).ok()?;
        *last = Some(uri.clone());
        Some(uri)
    })
}

/// The `Date` value, formatted once a second per thread.
fn put_date(out: &mut BytesMut) {
    use std::cell::RefCell;
    thread_local! {
        static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, text)| {
        if *at != secs {
            let formatted = httpdate::fmt_http_date(now);
            // Always 29 bytes (IMF-fixdate); anything else is not cached.
            if let Ok(fixed) = <[u8; 29]>::try_from(formatted.as_bytes()) {
                *text = fixed;
                *at = secs;
            } else {
                out.put_slice(formatted.as_bytes());
                return;
            }
        }
        out.put_slice(text);
    });
}

/// The bytes the fast path read, then the connection: what hyper serves
/// after a hand-over.
pub(super) struct Prefixed<IO> {
    prefix: Bytes,
    io: IO,
}

impl<IO> Prefixed<IO> {
    pub(super) fn new(prefix: Bytes, io: IO) -> Self {
        Self { prefix, io }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Prefixed<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.prefix.is_empty() {
            return Pin::new(&mut self.io).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining());
        buf.put_slice(&self.prefix[..n]);
        self.prefix.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Prefixed<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;

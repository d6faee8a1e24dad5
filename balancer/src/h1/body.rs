//! A worker's response body, read from the socket by whoever polls it.
//!
//! Owns the body's framing: a `Content-Length`, chunked coding (sizes,
//! extensions and trailers bounded), or the rest of the connection. Every
//! frame is the bytes one read brought, without a copy; all that is
//! already buffered is handed on before the body waits for the socket. At
//! the end the connection goes back to its pool, unless the worker asked
//! to close it; a body dropped before its end closes it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use tokio_util::io::poll_read_buf;

use super::pool::{Conn, H1Pool};
use super::{H1Error, READ_CHUNK};
use crate::bodies::BoxError;
use crate::wire::RawFields;

/// The longest chunk-size line or trailer line accepted.
const MAX_LINE: usize = 4096;
/// The most trailer bytes accepted (they are read and dropped).
const MAX_TRAILERS: usize = 16 * 1024;
/// The most trailer fields accepted: hyper's client refuses more than its
/// header count limit (100).
const MAX_TRAILER_FIELDS: usize = 100;

/// How the body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Framing {
    kind: Kind,
    /// The worker asked to close the connection after this response.
    close: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sized(u64),
    /// Chunked, at this point of a chunk.
    Chunked(Chunk),
    UntilClose,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// This much chunk data left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines (so many bytes and fields so far)
    /// up to an empty line.
    Trailers { bytes: usize, fields: usize },
}

impl Framing {
    pub(super) fn empty(close: bool) -> Self {
        Self {
            kind: Kind::Done,
            close,
        }
    }

    pub(super) fn sized(length: u64, close: bool) -> Self {
        Self {
            kind: if length == 0 {
                Kind::Done
            } else {
                Kind::Sized(length)
            },
            close,
        }
    }

    pub(super) fn chunked(close: bool) -> Self {
        Self {
            kind: Kind::Chunked(Chunk::Size),
            close,
        }
    }

    /// Whether the connection may carry another request after this body.
    pub(super) fn keeps_connection(&self) -> bool {
        !self.close
    }

    /// Whether the body ends only when the worker closes.
    pub(super) fn runs_to_close(&self) -> bool {
        self.kind == Kind::UntilClose
    }

    pub(super) fn until_close() -> Self {
        Self {
            kind: Kind::UntilClose,
            close: true,
        }
    }
}

/// What the buffer yields next.
pub(super) enum Step {
    Data(Bytes),
    /// More bytes are needed.
    More,
    End,
}

/// Decodes what `buf` holds under `kind`: the next data, or that more is
/// needed, or the end. Framing bytes (chunk sizes, CRLFs, trailers) are
/// consumed on the way; with `data` false, decoding stops before any data
/// (as if more were needed).
pub(super) fn decode(
    framing: &mut Framing,
    buf: &mut BytesMut,
    data: bool,
) -> Result<Step, H1Error> {
    let kind = &mut framing.kind;
    loop {
        match kind {
            Kind::Done => return Ok(Step::End),
            Kind::Sized(_) | Kind::UntilClose | Kind::Chunked(Chunk::Data(_)) if !data => {
                return Ok(Step::More);
            }
            Kind::Sized(left) => {
                if buf.is_empty() {
                    return Ok(Step::More);
                }
                let data = take_counted(left, buf);
                if *left == 0 {
                    *kind = Kind::Done;
                }
                return Ok(Step::Data(data));
            }
            Kind::UntilClose => {
                if buf.is_empty() {
                    return Ok(Step::More);
                }
                return Ok(Step::Data(buf.split().freeze()));
            }
            Kind::Chunked(chunk) => match chunk {
                Chunk::Size => {
                    let Some(line) = take_line(buf)? else {
                        return Ok(Step::More);
                    };
                    let size = chunk_size(&line)?;
                    *chunk = if size == 0 {
                        Chunk::Trailers {
                            bytes: 0,
                            fields: 0,
                        }
                    } else {
                        Chunk::Data(size)
                    };
                }
                Chunk::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Step::More);
                    }
                    let data = take_counted(left, buf);
                    if *left == 0 {
                        *chunk = Chunk::DataEnd;
                    }
                    return Ok(Step::Data(data));
                }
                Chunk::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Step::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(H1Error::Malformed("no CRLF after a chunk".to_owned()));
                    }
                    buf.advance(2);
                    *chunk = Chunk::Size;
                }
                Chunk::Trailers { bytes, fields } => {
                    let Some(line) = take_line(buf)? else {
                        return Ok(Step::More);
                    };
                    if line.is_empty() {
                        *kind = Kind::Done;
                        return Ok(Step::End);
                    }
                    *bytes += line.len() + 2;
                    *fields += 1;
                    if *bytes > MAX_TRAILERS || *fields > MAX_TRAILER_FIELDS {
                        return Err(H1Error::Malformed("trailers too large".to_owned()));
                    }
                    trailer_field(&line)?;
                }
            },
        }
    }
}

/// Checks a trailer line as hyper's client does (it parses trailers as
/// header fields and fails the body on one that is not): one field, a
/// valid name and value, no bare CR or LF. Trailers are read and dropped.
fn trailer_field(line: &[u8]) -> Result<(), H1Error> {
    let bad = || H1Error::Malformed("a trailer field".to_owned());
    if line.iter().any(|&b| b == b'\r' || b == b'\n') {
        return Err(bad());
    }
    let mut field = Vec::with_capacity(line.len() + 4);
    field.extend_from_slice(line);
    field.extend_from_slice(b"\r\n\r\n");
    let mut parsed = [httparse::EMPTY_HEADER; 1];
    match httparse::parse_headers(&field, &mut parsed) {
        Ok(httparse::Status::Complete((_, [header])))
            if http::HeaderName::from_bytes(header.name.as_bytes()).is_ok()
                && http::HeaderValue::from_bytes(header.value).is_ok() =>
        {
            Ok(())
        }
        _ => Err(bad()),
    }
}

/// A CRLF-terminated line taken from the front of `buf` (without the
/// CRLF); `None` while incomplete.
fn take_line(buf: &mut BytesMut) -> Result<Option<BytesMut>, H1Error> {
    match buf.windows(2).position(|w| w == b"\r\n") {
        Some(end) if end <= MAX_LINE => {
            let line = buf.split_to(end);
            buf.advance(2);
            Ok(Some(line))
        }
        Some(_) => Err(H1Error::Malformed("a chunk line is too long".to_owned())),
        None if buf.len() > MAX_LINE => {
            Err(H1Error::Malformed("a chunk line is too long".to_owned()))
        }
        None => Ok(None),
    }
}

/// As much of `buf` as `left` still allows, counted off `left`: the data
/// of a sized body or of one chunk.
fn take_counted(left: &mut u64, buf: &mut BytesMut) -> Bytes {
    let take = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
    *left -= take as u64;
    buf.split_to(take).freeze()
}

/// The size of a chunk-size line, read as hyper reads it: hex digits
/// first (no sign, no leading space), then optional spaces or tabs, then
/// the end or `;` and extensions (ignored), with no bare CR or LF.
fn chunk_size(line: &[u8]) -> Result<u64, H1Error> {
    let bad = || H1Error::Malformed("a chunk size".to_owned());
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let (hex, rest) = line.split_at(digits);
    let rest = rest.trim_ascii_start();
    let whitespace = line.len() - digits - rest.len();
    let tail_ok = rest.is_empty() || rest[0] == b';';
    if hex.is_empty()
        || !tail_ok
        || line[digits..digits + whitespace]
            .iter()
            .any(|&b| b != b' ' && b != b'\t')
        || line.iter().any(|&b| b == b'\r' || b == b'\n')
    {
        return Err(bad());
    }
    hex.iter()
        .try_fold(0u64, |size, &b| {
            let digit = char::from(b).to_digit(16).map(u64::from);
            size.checked_mul(16)?.checked_add(digit?)
        })
        .ok_or_else(bad)
}

/// A worker's response body on a fast-path connection.
pub struct H1Body {
    /// `None` once the body ended (the connection went back or closed).
    conn: Option<Conn>,
    framing: Framing,
    /// The head's fields, for the relay to take.
    fields: RawFields,
    pool: H1Pool,
    /// A framing error [`H1Body::settle`] found, for the next poll.
    broken: Option<H1Error>,
}

impl H1Body {
    pub(super) fn new(conn: Conn, framing: Framing, fields: RawFields, pool: H1Pool) -> Self {
        let mut body = Self {
            conn: Some(conn),
            framing,
            fields,
            pool,
            broken: None,
        };
        body.settle();
        body
    }

    /// The response head's header fields, as the worker sent them (less
    /// the framing ones and `Date`).
    pub(crate) fn fields(&self) -> &RawFields {
        &self.fields
    }

    /// The fields, taken out for the response the gateway sends.
    pub(crate) fn take_fields(&mut self) -> RawFields {
        std::mem::take(&mut self.fields)
    }

    /// Consumes framing bytes already buffered (a last chunk's CRLF, the
    /// final zero chunk, trailers), so that a body whose end is in the
    /// buffer says so at once and its connection is free for the next
    /// request.
    fn settle(&mut self) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        match decode(&mut self.framing, &mut conn.buf, false) {
            Ok(Step::End) => self.finish(),
            Ok(_) => {}
            Err(e) => self.broken = Some(e),
        }
    }

    /// The body ended: the connection goes back to the pool, unless it must
    /// close.
    fn finish(&mut self) {
        if let Some(conn) = self.conn.take()
            && !self.framing.close
        {
            self.pool.checkin(conn);
        }
    }

    fn fail(&mut self, error: H1Error) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.conn = None;
        self.framing.kind = Kind::Done;
        Poll::Ready(Some(Err(error.into())))
    }
}

impl Body for H1Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(e) = this.broken.take() {
                return this.fail(e);
            }
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match decode(&mut this.framing, &mut conn.buf, true) {
                Ok(Step::Data(data)) => {
                    this.settle();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Step::End) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Err(e) => return this.fail(e),
                Ok(Step::More) => {}
            }
            // Nothing buffered: read what the connection has.
            conn.buf.reserve(READ_CHUNK);
            match poll_read_buf(Pin::new(&mut conn.stream), cx, &mut conn.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) if this.framing.kind == Kind::UntilClose => {
                    this.framing.kind = Kind::Done;
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Poll::Ready(Ok(0)) => return this.fail(H1Error::Closed),
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return this.fail(e.into()),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() || self.framing.kind == Kind::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing.kind {
            Kind::Sized(left) => SizeHint::with_exact(left),
            Kind::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

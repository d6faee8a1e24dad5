//! The body types every HTTP layer of the agent carries: what clients send,
//! what the gateway answers with and what it sends to workers. A leaf: the
//! server, the proxy and the admin API all name these, so none of them
//! depends on another for them.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Body, Frame, SizeHint};

use crate::wire::RawFields;

/// Any error a body may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response the gateway sends, with the worker's header
/// fields when they are relayed as they came: the response's map then holds
/// only what the gateway adds, and an HTTP/1.1 writer copies the fields out
/// without a map built for them (a writer that needs one merges them in).
pub struct ResponseBody {
    inner: Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>,
    fields: RawFields,
    /// The request id to send with the head, whichever writer writes it:
    /// boxed, so a response without one stays small, and kept out of the
    /// head's map, which the fast path would otherwise have to allocate.
    request_id: Option<Box<(HeaderName, HeaderValue)>>,
}

impl ResponseBody {
    pub fn new<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self::relayed(Box::pin(body.map_err(Into::into)), RawFields::default())
    }

    /// `body`, under the worker's `fields`. Boxed by the caller, where it
    /// is built: a body this large is moved once, into its box.
    pub(crate) fn relayed<B>(body: Pin<Box<B>>, fields: RawFields) -> Self
    where
        B: Body<Data = Bytes, Error = BoxError> + Send + 'static,
    {
        Self {
            inner: body,
            fields,
            request_id: None,
        }
    }

    /// The same body wrapped by `f` (the access log's), the fields kept.
    pub(crate) fn wrap(
        self,
        f: impl FnOnce(
            Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>,
        ) -> Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>,
    ) -> Self {
        Self {
            inner: f(self.inner),
            fields: self.fields,
            request_id: self.request_id,
        }
    }

    /// Sends `name: value` with the head (the request id).
    pub(crate) fn set_request_id(&mut self, name: HeaderName, value: HeaderValue) {
        self.request_id = Some(Box::new((name, value)));
    }

    /// The request id to send with the head, if any.
    pub(crate) fn request_id(&self) -> Option<&(HeaderName, HeaderValue)> {
        self.request_id.as_deref()
    }

    /// The request id, taken out (for a writer that puts it in the map).
    pub(crate) fn take_request_id(&mut self) -> Option<(HeaderName, HeaderValue)> {
        self.request_id.take().map(|b| *b)
    }

    /// The worker's fields relayed as they came (none for the gateway's own
    /// answers).
    pub(crate) fn fields(&self) -> &RawFields {
        &self.fields
    }

    /// The fields, taken out (for a writer that merges them into the map).
    pub(crate) fn take_fields(&mut self) -> RawFields {
        std::mem::take(&mut self.fields)
    }
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("fields", &self.fields)
            .finish_non_exhaustive()
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.inner.as_mut().poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The body type of every request the gateway sends to a worker.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// A client's request body, as every handler takes it: hyper's, or whole
/// when the server's HTTP/1.1 fast path read it along with its head.
#[derive(Debug)]
pub enum Inbound {
    Streamed(hyper::body::Incoming),
    /// The body: `None` once taken, or when the request had no body. Then
    /// the head's fields, for a handler that takes them as they came (the
    /// request's map is empty then); none when the map holds them.
    Whole(Option<Bytes>, RawFields),
}

impl Inbound {
    /// A body read whole; an empty one is no frame at all.
    pub fn whole(bytes: Bytes) -> Self {
        Self::with_fields(bytes, RawFields::default())
    }

    /// [`Inbound::whole`], carrying the head's `fields`.
    pub(crate) fn with_fields(bytes: Bytes, fields: RawFields) -> Self {
        Inbound::Whole((!bytes.is_empty()).then_some(bytes), fields)
    }

    /// The body, taken out: an empty one is left.
    pub(crate) fn take(&mut self) -> Self {
        std::mem::replace(self, Self::Whole(None, RawFields::default()))
    }

    /// The head's fields as they came, taken out: none from hyper, nor when
    /// the request's map holds them.
    pub(crate) fn take_fields(&mut self) -> RawFields {
        match self {
            Inbound::Whole(_, fields) => std::mem::take(fields),
            Inbound::Streamed(_) => RawFields::default(),
        }
    }
}

impl hyper::body::Body for Inbound {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Inbound::Streamed(body) => std::pin::Pin::new(body).poll_frame(cx),
            Inbound::Whole(bytes, _) => {
                std::task::Poll::Ready(bytes.take().map(|b| Ok(hyper::body::Frame::data(b))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Inbound::Streamed(body) => body.is_end_stream(),
            Inbound::Whole(bytes, _) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            Inbound::Streamed(body) => body.size_hint(),
            Inbound::Whole(bytes, _) => {
                hyper::body::SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

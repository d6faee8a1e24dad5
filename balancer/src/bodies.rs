//! The body types every HTTP layer of the agent carries: what clients send,
//! what the gateway answers with and what it sends to workers. A leaf: the
//! server, the proxy and the admin API all name these, so none of them
//! depends on another for them.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;

/// Any error a body may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response the gateway sends.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// The body type of every request the gateway sends to a worker.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// A client's request body, as every handler takes it: hyper's, or whole
/// when the server's HTTP/1.1 fast path read it along with its head.
#[derive(Debug)]
pub enum Inbound {
    Streamed(hyper::body::Incoming),
    /// `None` once taken, or when the request had no body.
    Whole(Option<Bytes>),
}

impl Inbound {
    /// A body read whole; an empty one is no frame at all.
    pub fn whole(bytes: Bytes) -> Self {
        Inbound::Whole((!bytes.is_empty()).then_some(bytes))
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
            Inbound::Whole(bytes) => {
                std::task::Poll::Ready(bytes.take().map(|b| Ok(hyper::body::Frame::data(b))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Inbound::Streamed(body) => body.is_end_stream(),
            Inbound::Whole(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            Inbound::Streamed(body) => body.size_hint(),
            Inbound::Whole(bytes) => {
                hyper::body::SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

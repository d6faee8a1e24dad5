//! Phase: the request body.
//!
//! Owns reading the client's body: kept whole for replay up to the replay
//! limit, otherwise the prefix read so far chained to the rest for a single
//! attempt. Knows nothing of workers or breakers.

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Frame, Incoming};

use super::{BoxError, UpstreamBody};

/// The request body as the attempts see it.
pub(crate) enum RequestBody {
    /// Small enough to keep: every attempt sends a copy.
    Replayable(Bytes),
    /// Too large to keep: the prefix read so far and the rest, for one attempt.
    Streaming(Vec<Bytes>, Incoming),
}

/// Any body as the boxed type requests and responses carry.
pub(crate) fn boxed<B>(body: B) -> UnsyncBoxBody<Bytes, BoxError>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

pub(crate) async fn read_body(
    mut body: Incoming,
    limit: usize,
) -> Result<RequestBody, hyper::Error> {
    let mut buf = BytesMut::new();
    let mut parts = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if buf.len() + data.len() > limit {
            parts.push(buf.freeze());
            parts.push(data);
            return Ok(RequestBody::Streaming(parts, body));
        }
        buf.extend_from_slice(&data);
    }
    Ok(RequestBody::Replayable(buf.freeze()))
}

/// The prefix already read, then the rest of the client's body.
pub(crate) fn chain(prefix: Vec<Bytes>, rest: Incoming) -> UpstreamBody {
    boxed(Chained {
        prefix: prefix.into(),
        rest,
    })
}

struct Chained {
    prefix: std::collections::VecDeque<Bytes>,
    rest: Incoming,
}

impl hyper::body::Body for Chained {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.prefix.pop_front() {
            Some(chunk) => std::task::Poll::Ready(Some(Ok(Frame::data(chunk)))),
            None => std::pin::Pin::new(&mut self.rest).poll_frame(cx),
        }
    }
}

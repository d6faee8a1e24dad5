//! Phase: the request body.
//!
//! Owns reading the client's body under its bounds: `--max-payload-size`
//! (refused at once from `Content-Length`, or as soon as the body passes
//! it), `--stream-body-stall-timeout-secs` (a body that sends nothing for
//! that long), `--max-buffered-request-bytes` (bodies up to it are kept
//! whole for replay; larger ones are the prefix read so far chained to the
//! rest, for a single attempt) and the process-wide budget of kept bytes.
//! A fault of the client's body found while it streams to a worker is
//! recorded in its [`ClientFault`], so the attempt loop answers for the
//! client and charges no worker. Knows nothing of workers or breakers.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http::header::CONTENT_LENGTH;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Frame;
use tokio::time::{Instant, Sleep};

use super::json_check::{JsonCheck, JsonError};
use super::{BoxError, Inbound, UpstreamBody};

/// What a client's body did wrong; never a worker's fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BodyError {
    /// Past `--max-payload-size`.
    TooLarge,
    /// Nothing for `--stream-body-stall-timeout-secs`.
    Stalled,
    /// The client aborted the upload (reset, malformed chunking).
    Aborted,
    /// The process-wide budget of kept bodies is spent.
    OverBudget,
    /// A streamed inference body is not one JSON object with one plain
    /// top-level `model` (found by the time it ends).
    Invalid(JsonError),
}

/// How a streamed body is doing, for the attempt loop: its fault, and
/// whether it has all arrived (until then, slowness is the client's).
#[derive(Debug, Default)]
pub(crate) struct ClientProgress {
    fault: OnceLock<BodyError>,
    done: AtomicBool,
}

impl ClientProgress {
    /// The body's fault, if it broke a bound or broke off.
    pub(crate) fn fault(&self) -> Option<&BodyError> {
        self.fault.get()
    }

    /// Whether the whole body has arrived.
    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

/// Shared between a streamed body and the attempt loop.
pub(crate) type ClientFault = Arc<ClientProgress>;

/// The bounds of every request body.
#[derive(Debug, Clone)]
pub(crate) struct BodyLimits {
    pub(crate) max_payload: u64,
    pub(crate) max_buffered: usize,
    pub(crate) stall: Duration,
    pub(crate) budget: Arc<BufferBudget>,
}

/// Bytes all kept (replayable) bodies may hold at once, process-wide.
#[derive(Debug)]
pub struct BufferBudget {
    limit: usize,
    used: AtomicUsize,
}

impl BufferBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes held now by kept bodies.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// A share of the [`BufferBudget`], returned when the body it accounts for
/// is dropped (after the request's last attempt).
#[derive(Debug)]
pub(crate) struct Lease {
    budget: Arc<BufferBudget>,
    bytes: usize,
}

impl Lease {
    fn new(budget: &Arc<BufferBudget>) -> Self {
        Self {
            budget: budget.clone(),
            bytes: 0,
        }
    }

    /// Takes `n` more bytes, or says no without taking any.
    fn grow(&mut self, n: usize) -> bool {
        let budget = &self.budget;
        let taken = budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&u| u <= budget.limit)
            })
            .is_ok();
        if taken {
            self.bytes += n;
        }
        taken
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The request body as the attempts see it.
pub(crate) enum RequestBody {
    /// Small enough to keep: every attempt sends a copy. The lease holds
    /// its bytes in the process-wide budget; it moves with the body (a
    /// rewritten body keeps it), so it needs no count of its own.
    Replayable(
        Bytes,
        #[cfg_attr(
            not(test),
            expect(dead_code, reason = "held, never read: dropping it returns the bytes")
        )]
        Lease,
    ),
    /// Too large to keep: the prefix read so far and the rest, for one attempt.
    Streaming(Vec<Bytes>, ClientBody),
}

/// Any body as the boxed type requests and responses carry.
pub(crate) fn boxed<B>(body: B) -> UnsyncBoxBody<Bytes, BoxError>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// Reads the client's body within `limits`: whole when it fits the replay
/// limit, otherwise up to there (the rest streams to the worker).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: &mut Inbound,
    limits: &BodyLimits,
) -> Result<RequestBody, BodyError> {
    // A body the server read whole with its head is kept as it came (it
    // shares the connection's read buffer): no copy and no frame loop.
    // Only one larger than the replay buffer streams on, as any other.
    if let Inbound::Whole(whole, _) = body {
        let data = whole.take().unwrap_or_default();
        if data.len() as u64 > limits.max_payload {
            return Err(BodyError::TooLarge);
        }
        if data.len() <= limits.max_buffered {
            let mut lease = Lease::new(&limits.budget);
            if !lease.grow(data.len()) {
                return Err(BodyError::OverBudget);
            }
            return Ok(RequestBody::Replayable(data, lease));
        }
        *whole = Some(data);
    }
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_payload) {
        return Err(BodyError::TooLarge);
    }
    let mut lease = Lease::new(&limits.budget);
    let mut buf = BytesMut::new();
    loop {
        // A body usually comes with its head: the stall timer is armed only
        // when a frame is not already there, which spares a timer
        // registration and its removal on almost every request.
        let mut next = body.frame();
        let frame = match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut next).poll(cx))).await
        {
            Poll::Ready(frame) => frame,
            Poll::Pending => match tokio::time::timeout(limits.stall, next).await {
                Err(_) => return Err(BodyError::Stalled),
                Ok(frame) => frame,
            },
        };
        let frame = match frame {
            None => break,
            Some(Err(_)) => return Err(BodyError::Aborted),
            Some(Ok(frame)) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if (buf.len() + data.len()) as u64 > limits.max_payload {
            return Err(BodyError::TooLarge);
        }
        if buf.len() + data.len() > limits.max_buffered {
            // The prefix stays in memory until it is sent: it keeps its
            // share of the budget until then.
            if !lease.grow(data.len()) {
                return Err(BodyError::OverBudget);
            }
            let read = (buf.len() + data.len()) as u64;
            let rest = ClientBody::new(body.take(), limits, read, lease);
            return Ok(RequestBody::Streaming(vec![buf.freeze(), data], rest));
        }
        if !lease.grow(data.len()) {
            return Err(BodyError::OverBudget);
        }
        buf.extend_from_slice(&data);
    }
    Ok(RequestBody::Replayable(buf.freeze(), lease))
}

/// The rest of a client's body as it streams to a worker, still under the
/// payload and stall bounds; a fault ends it with an error and is recorded
/// in [`ClientBody::fault`].
pub(crate) struct ClientBody {
    inner: Inbound,
    read: u64,
    max_payload: u64,
    stall: Duration,
    idle: Pin<Box<Sleep>>,
    fault: ClientFault,
    /// An inference body's JSON, checked as it passes.
    json: Option<Box<JsonCheck>>,
    /// The budget share of the prefix read before streaming began.
    _lease: Lease,
}

impl ClientBody {
    fn new(inner: Inbound, limits: &BodyLimits, read: u64, lease: Lease) -> Self {
        Self {
            inner,
            read,
            max_payload: limits.max_payload,
            stall: limits.stall,
            idle: Box::pin(tokio::time::sleep(limits.stall)),
            fault: ClientFault::default(),
            json: None,
            _lease: lease,
        }
    }

    /// Holds the body to the inference rule ([`JsonCheck`]): the prefix
    /// already read is checked now, the rest as it streams, and the body
    /// fails before its last bytes leave if the whole is not one object.
    pub(crate) fn check_json(&mut self, prefix: &[Bytes]) -> Result<(), JsonError> {
        let mut check = Box::<JsonCheck>::default();
        prefix.iter().try_for_each(|chunk| check.feed(chunk))?;
        self.json = Some(check);
        Ok(())
    }

    /// Where this body's fault will be recorded.
    pub(crate) fn fault(&self) -> ClientFault {
        self.fault.clone()
    }

    fn fail(&self, error: BodyError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let message = format!("client request body: {error:?}");
        let _ = self.fault.fault.set(error);
        Poll::Ready(Some(Err(message.into())))
    }
}

impl hyper::body::Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let end = this.inner.is_end_stream();
                if let Some(data) = frame.data_ref() {
                    this.read += data.len() as u64;
                    if this.read > this.max_payload {
                        return this.fail(BodyError::TooLarge);
                    }
                    if let Some(json) = this.json.as_mut()
                        && let Err(e) = json
                            .feed(data)
                            .and_then(|()| if end { json.finish() } else { Ok(()) })
                    {
                        return this.fail(BodyError::Invalid(e));
                    }
                }
                if end {
                    this.fault.done.store(true, Ordering::Release);
                }
                let deadline = Instant::now() + this.stall;
                this.idle.as_mut().reset(deadline);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => this.fail(BodyError::Aborted),
            Poll::Ready(None) => {
                if let Some(Err(e)) = this.json.as_ref().map(|json| json.finish()) {
                    return this.fail(BodyError::Invalid(e));
                }
                this.fault.done.store(true, Ordering::Release);
                Poll::Ready(None)
            }
            Poll::Pending => match this.idle.as_mut().poll(cx) {
                Poll::Ready(()) => this.fail(BodyError::Stalled),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// The prefix already read, then the rest of the client's body.
pub(crate) fn chain(prefix: Vec<Bytes>, rest: ClientBody) -> UpstreamBody {
    boxed(Chained {
        prefix: prefix.into(),
        rest,
    })
}

struct Chained {
    prefix: VecDeque<Bytes>,
    rest: ClientBody,
}

impl hyper::body::Body for Chained {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.prefix.pop_front() {
            Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
            None => Pin::new(&mut self.rest).poll_frame(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    fn bounds(max_payload: u64, max_buffered: usize, budget: usize) -> BodyLimits {
        BodyLimits {
            max_payload,
            max_buffered,
            stall: Duration::from_secs(1),
            budget: BufferBudget::new(budget),
        }
    }

    async fn read(body: &'static [u8], limits: &BodyLimits) -> Result<RequestBody, BodyError> {
        let mut body = Inbound::whole(Bytes::from_static(body));
        read_body(&HeaderMap::new(), &mut body, limits).await
    }

    #[tokio::test]
    async fn a_whole_body_is_kept_as_it_came_under_the_bounds() {
        let limits = bounds(100, 10, 100);
        let sent = Bytes::from_static(b"{\"a\":1}");
        let mut whole = Inbound::whole(sent.clone());
        let body = read_body(&HeaderMap::new(), &mut whole, &limits).await;
        let Ok(RequestBody::Replayable(kept, lease)) = body else {
            panic!("a small whole body is replayable");
        };
        assert_eq!(kept.as_ptr(), sent.as_ptr(), "not copied");
        assert_eq!(limits.budget.used(), 7);
        drop(lease);
        assert_eq!(limits.budget.used(), 0);
        let empty = read(b"", &limits).await;
        assert!(matches!(empty, Ok(RequestBody::Replayable(b, _)) if b.is_empty()));

        assert!(matches!(
            read(b"0123456789abcdef", &bounds(15, 100, 100)).await,
            Err(BodyError::TooLarge)
        ));
        assert!(matches!(
            read(b"0123456789", &bounds(100, 100, 9)).await,
            Err(BodyError::OverBudget)
        ));
    }

    #[tokio::test]
    async fn a_whole_body_past_the_replay_buffer_streams_on_whole() {
        let limits = bounds(100, 4, 100);
        let Ok(RequestBody::Streaming(prefix, rest)) = read(b"0123456789", &limits).await else {
            panic!("past the replay buffer, a body streams");
        };
        let mut sent: Vec<u8> = prefix.concat();
        sent.extend_from_slice(&rest.collect().await.unwrap().to_bytes());
        assert_eq!(sent, b"0123456789");
    }
}

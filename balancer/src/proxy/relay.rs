//! Phase: relaying a worker's response to the client.
//!
//! Owns what happens between the response headers and the last byte: frames
//! pass through as they arrive (never buffered whole), an idle gap longer than
//! the stream idle timeout cuts the stream, and when the body ends or breaks,
//! the attempt's outcome is recorded on the worker's breaker (the status
//! decides, unless `--cb-stream-failures` charges a cut as `stall` or
//! `broken`, or `--cb-min-completion-tokens` finds a completion that ended
//! too short and charges it as `quality`); a body dropped by a departing
//! client records nothing. Then the
//! admission permit and in-flight count are released.
//! A cut SSE stream ends with an SSE `error` event and never with
//! `data: [DONE]`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::{Instant, Sleep};

use balancer_core::admission::Permit;
use balancer_core::breaker::{BodyRules, FailureReason, Outcome, RequestCharges};
use balancer_core::clock::Clock;
use balancer_core::quality::{QualityScan, Verdict};
use balancer_core::registry::Attempt;
use balancer_core::tokens::{ModelTokens, find_usage};
use http::header::{self, HeaderName, HeaderValue};
use http::{Response, StatusCode};

use super::answer::sse_error_event;
use super::edge::{is_hop_by_hop, is_hop_by_hop_name, strip};
use super::stats::GatewayStats;
use super::{BoxError, FALLBACK_HEADER, Proxy, ResponseBody};
use crate::h1::H1Body;
use crate::wire::{RawFields, first_value};

/// Everything that must happen exactly once when a response ends.
pub struct Completion {
    /// The attempt: still pending when its status was a success, so the
    /// body decides; recorded at header time otherwise. In flight until the
    /// last byte.
    pub attempt: Attempt,
    /// The request's breaker charges, for the body's outcome.
    pub charges: RequestCharges,
    #[expect(
        dead_code,
        reason = "held, never read: dropping it releases the admission slot"
    )]
    pub permit: Option<Permit>,
    pub started: std::time::Instant,
    /// When the attempt that produced this response was sent.
    pub attempt_started: std::time::Instant,
    /// How long after `attempt_started` the response headers came.
    pub headers_after: Duration,
    /// The worker's rules for the body phase.
    pub rules: BodyRules,
    /// The counters of the request's model (by its metrics label), where
    /// the response's tokens count.
    pub tokens: Option<Arc<ModelTokens>>,
    pub stats: Arc<GatewayStats>,
    pub clock: Arc<dyn Clock>,
    /// For `http_request_duration_seconds`: a generative route, and the
    /// status the client got.
    pub inference: bool,
    pub status: u16,
}

impl Completion {
    /// `first_byte`: time to the first body chunk for streams (the first
    /// token), the headers otherwise.
    /// `short`: the body ended as a completion too short for the quality
    /// rule; a slow first byte is charged before it.
    fn finish(mut self, outcome: Outcome, first_byte: Duration, tail: &Tail, short: bool) {
        let worker = self.attempt.worker().clone();
        let outcome = if outcome == Outcome::Success {
            worker.observe_ttfb(first_byte, self.clock.now());
            if let (Some(tokens), Some(usage)) = (&self.tokens, tail.usage()) {
                tokens.record(usage, self.clock.now());
            }
            match self.rules.with_latency(outcome, first_byte) {
                Outcome::Success if short => Outcome::Failure(FailureReason::Quality),
                outcome => outcome,
            }
        } else {
            outcome
        };
        self.attempt
            .record(&mut self.charges, outcome, &*self.clock);
        self.stats
            .request_done(self.inference, self.status, self.started.elapsed());
        // `attempt` and `permit` drop here: in-flight count and admission slot
        // are released after the last byte.
    }
}

/// The last two chunks of a body, kept by reference (no copy) because the
/// `usage` object sits at the end: in the final chunk of a JSON body, in the
/// one before `data: [DONE]` of a stream.
#[derive(Default)]
struct Tail {
    enabled: bool,
    previous: Option<Bytes>,
    last: Option<Bytes>,
}

impl Tail {
    fn push(&mut self, data: &Bytes) {
        if self.enabled {
            self.previous = self.last.replace(data.clone());
        }
    }

    fn usage(&self) -> Option<balancer_core::tokens::Usage> {
        let (previous, last) = (self.previous.as_deref(), self.last.as_deref());
        last.and_then(find_usage)
            .or_else(|| previous.and_then(find_usage))
            // Split across the two chunks: rare, so only then are they joined.
            .or_else(|| find_usage(&[previous?, last?].concat()))
    }
}

/// A worker's response, boxed where its head is read: on its way to the
/// relay it passes out of the client's future, the request timeout, the
/// attempt and the retry loop, and unboxed each of those moves was a copy
/// of its 352 bytes.
pub type WorkerResponse = Box<Response<WorkerBody>>;

/// A worker's response body, from either client.
#[expect(
    clippy::large_enum_variant,
    reason = "the fast client's body is the common one; boxing it would allocate once per request"
)]
pub enum WorkerBody {
    Hyper(Incoming),
    H1(H1Body),
}

impl WorkerBody {
    /// The fields the fast client kept as they came; hyper's client put
    /// them all in the response's map.
    pub(crate) fn fields(&self) -> Option<&RawFields> {
        match self {
            WorkerBody::H1(b) => Some(b.fields()),
            WorkerBody::Hyper(_) => None,
        }
    }
}

impl Body for WorkerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            WorkerBody::Hyper(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|frame| frame.map(|r| r.map_err(Into::into))),
            WorkerBody::H1(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            WorkerBody::Hyper(b) => b.is_end_stream(),
            WorkerBody::H1(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            WorkerBody::Hyper(b) => b.size_hint(),
            WorkerBody::H1(b) => b.size_hint(),
        }
    }
}

pub struct RelayBody {
    inner: WorkerBody,
    /// Armed only when the worker keeps the body waiting: most responses
    /// are whole in their first frames and never need a timer.
    idle: Option<Pin<Box<Sleep>>>,
    /// When the stream counts as stalled: the idle timeout after the worker
    /// was first waited for since its last frame (or its head). Set when a
    /// wait begins, so a body whole in its first frame reads no clock.
    deadline: Option<Instant>,
    idle_timeout: Duration,
    sse: bool,
    done: bool,
    first_chunk: Option<Duration>,
    tail: Tail,
    /// The quality rule's scan, only when the body is judged.
    quality: Option<Box<QualityScan>>,
    completion: Option<Completion>,
}

impl RelayBody {
    /// Boxed where it is built: `Box::new` of a struct literal can write
    /// the fields into the allocation, where a body built first and then
    /// boxed is a copy of its 560 bytes.
    pub fn boxed(
        inner: WorkerBody,
        sse: bool,
        idle_timeout: Duration,
        completion: Completion,
    ) -> Pin<Box<Self>> {
        Box::pin(Self {
            inner,
            idle: None,
            deadline: None,
            idle_timeout,
            sse,
            done: false,
            first_chunk: None,
            tail: Tail {
                enabled: completion.tokens.is_some(),
                ..Tail::default()
            },
            quality: completion
                .rules
                .quality()
                .map(|rule| Box::new(rule.scan(sse))),
            completion: Some(completion),
        })
    }

    fn complete(&mut self, outcome: Outcome) {
        self.complete_judged(outcome, false);
    }

    /// The body ended as the worker meant it to: a success, unless the
    /// quality rule finds the completion too short.
    fn complete_ended(&mut self) {
        let short = match self.quality.take().map(|scan| scan.verdict()) {
            Some(Verdict::Short { tokens }) => {
                if let Some(c) = &self.completion {
                    tracing::debug!(worker = %c.attempt.worker().url, tokens, "completion too short");
                }
                true
            }
            _ => false,
        };
        self.complete_judged(Outcome::Success, short);
    }

    fn complete_judged(&mut self, outcome: Outcome, short: bool) {
        if let Some(c) = self.completion.take() {
            let first_byte = match self.first_chunk {
                Some(d) if self.sse => d,
                _ => c.headers_after,
            };
            c.finish(outcome, first_byte, &self.tail, short);
        }
    }

    /// The idle timer, set to the current deadline.
    fn idle_timer(&mut self) -> Pin<&mut Sleep> {
        let idle_timeout = self.idle_timeout;
        let deadline = *self
            .deadline
            .get_or_insert_with(|| Instant::now() + idle_timeout);
        let timer = self
            .idle
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        timer.as_mut()
    }

    fn observe_chunk(&mut self, data: &Bytes) {
        // Only a stream's first byte is its first chunk's; anything else's
        // is its head's, known already.
        if self.sse
            && self.first_chunk.is_none()
            && let Some(c) = &self.completion
        {
            self.first_chunk = Some(c.attempt_started.elapsed());
        }
        self.tail.push(data);
        if let Some(scan) = &mut self.quality {
            scan.push(data);
        }
    }

    /// Ends a stream that broke: an SSE error event for event streams, an
    /// error (which aborts the chunked body) for anything else.
    fn cut(
        &mut self,
        reason: FailureReason,
        code: &str,
        message: &str,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // The status was a success (anything else was recorded at header
        // time): it stands, unless `--cb-stream-failures` charges the cut.
        let outcome = self.completion.as_ref().map_or(Outcome::Ignored, |c| {
            c.rules.classify_cut(Outcome::Success, reason)
        });
        // Taken before `complete` gives the attempt back.
        let worker = self
            .completion
            .as_ref()
            .map(|c| c.attempt.worker().url.clone());
        self.complete(outcome);
        tracing::warn!(
            worker = %worker.as_deref().unwrap_or("-"),
            code,
            message,
            "upstream stream cut"
        );
        self.done = true;
        if self.sse {
            Poll::Ready(Some(Ok(Frame::data(sse_error_event(code, message)))))
        } else {
            Poll::Ready(Some(Err(message.to_owned().into())))
        }
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.observe_chunk(data);
                }
                if this.inner.is_end_stream() {
                    // A sized body is over with its last frame, and hyper
                    // will not poll again to see the end.
                    this.complete_ended();
                    this.done = true;
                } else {
                    this.deadline = None;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => this.cut(
                FailureReason::Broken,
                "upstream_stream_broken",
                &format!("the worker's response broke off: {e}"),
            ),
            Poll::Ready(None) => {
                this.complete_ended();
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => match this.idle_timer().poll(cx) {
                Poll::Ready(()) => this.cut(
                    FailureReason::Stall,
                    "upstream_stream_stalled",
                    "the worker sent nothing within the stream idle timeout",
                ),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        // An SSE stream may grow by the error event; promise nothing for it.
        if self.sse {
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        // The client went away before the end: not the worker's doing.
        self.complete(Outcome::Ignored);
    }
}
impl Proxy {
    pub(crate) fn relay(
        &self,
        response: WorkerResponse,
        completion: Completion,
        fallback: Option<String>,
    ) -> Response<ResponseBody> {
        let (mut parts, mut body) = (*response).into_parts();
        // The fast client's fields go out as they came; hyper's client
        // fills the map.
        let mut fields = match &mut body {
            WorkerBody::H1(b) => b.take_fields(),
            WorkerBody::Hyper(_) => RawFields::default(),
        };
        if let Some(v) = fallback.and_then(|f| HeaderValue::try_from(f).ok()) {
            parts.headers.insert(FALLBACK_HEADER, v);
        }
        // The fast client read the framing and `Connection` of its fields
        // already; hyper's leaves them in the map. A length beside a
        // transfer coding frames nothing (hyper read the body by the
        // coding), the names `Connection` lists are this hop's (RFC 9110
        // 7.6.1), and a 204 has no length (RFC 9110 8.6): the same rules
        // whichever side serves the client.
        if parts.headers.contains_key(header::TRANSFER_ENCODING)
            || parts.status == StatusCode::NO_CONTENT
        {
            parts.headers.remove(header::CONTENT_LENGTH);
            fields.remove_where(|name| name.eq_ignore_ascii_case(b"content-length"));
        }
        let named: Vec<HeaderName> = parts
            .headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        strip(&mut parts.headers, |name| {
            is_hop_by_hop(name) || named.contains(name)
        });
        fields.remove_where(is_hop_by_hop_name);
        let sse = first_value(&fields, &parts.headers, &header::CONTENT_TYPE)
            .is_some_and(|ct| ct.starts_with(b"text/event-stream"));
        if sse {
            // The relay may append an error event to a cut stream.
            parts.headers.remove(header::CONTENT_LENGTH);
            fields.remove_where(|name| name.eq_ignore_ascii_case(b"content-length"));
        }
        let relay = RelayBody::boxed(body, sse, self.config.stream_idle_timeout, completion);
        Response::from_parts(parts, ResponseBody::relayed(relay, fields))
    }
}

//! The response bodies: [`MockBody`], the one body type of the service, and
//! [`SseStream`], which paces a completion's SSE events by the token delay.
//! Both implement the stall and truncate cuts: stop after K chunks and go
//! quiet, arming the connection's abort flag for a truncation.
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module uses only `config` (the [`Cut`] it is handed) and
//! `generation` (the [`Generation`] it streams); it must not depend on
//! `shared` or anything above it. It must not decide what is generated (it
//! asks the [`Generation`] for chunk `i`) nor whether a fault applies (it is
//! handed an already resolved [`Cut`]), and it must not close the connection
//! itself: a body error would make hyper discard what it still buffers, which
//! is why a truncation only arms the flag that `server`'s transport wrapper
//! acts on.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::config::{Cut, CutKind};
use crate::generation::Generation;

const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// The one body type of the service, so that faults can be applied to any
/// response without boxing.
pub(crate) struct MockBody(BodyInner);

enum BodyInner {
    Full(Option<Bytes>),
    /// A fixed-length body cut after `first`: the `Content-Length` still promises `len`.
    Partial {
        first: Option<Bytes>,
        len: u64,
        cut: CutKind,
        abort: Arc<AtomicBool>,
    },
    Sse(Box<SseStream>),
}

impl MockBody {
    pub(crate) fn full(bytes: Bytes) -> Self {
        MockBody(BodyInner::Full(Some(bytes)))
    }

    pub(crate) fn sse(stream: SseStream) -> Self {
        MockBody(BodyInner::Sse(Box::new(stream)))
    }

    /// This body, cut as `cut` says; `abort` is the connection's truncation flag.
    pub(crate) fn cut(self, cut: Cut, abort: Arc<AtomicBool>) -> Self {
        match self.0 {
            BodyInner::Full(bytes) => {
                let bytes = bytes.unwrap_or_default();
                let len = bytes.len() as u64;
                let first = bytes.slice(..bytes.len() / 2);
                MockBody(BodyInner::Partial {
                    first: (!first.is_empty()).then_some(first),
                    len,
                    cut: cut.kind,
                    abort,
                })
            }
            BodyInner::Sse(mut s) => {
                s.cut = Some((cut, abort));
                MockBody(BodyInner::Sse(s))
            }
            partial @ BodyInner::Partial { .. } => MockBody(partial),
        }
    }
}

/// Stops producing data. For a truncation, arming the flag makes the
/// transport fail its next flush (`server`'s `AbortOnFlush`). No waker is
/// kept on purpose: nothing will ever make the body ready again, and the
/// connection task is aborted on shutdown.
fn go_quiet(cut: CutKind, abort: &AtomicBool) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
    if cut == CutKind::Truncate {
        abort.store(true, Ordering::Release);
    }
    Poll::Pending
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().0 {
            BodyInner::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            BodyInner::Partial {
                first, cut, abort, ..
            } => match first.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => go_quiet(*cut, abort),
            },
            BodyInner::Sse(s) => s.poll_next(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            BodyInner::Full(bytes) => bytes.is_none(),
            BodyInner::Partial { .. } => false,
            BodyInner::Sse(s) => s.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            BodyInner::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            BodyInner::Partial { len, .. } => SizeHint::with_exact(*len),
            BodyInner::Sse(_) => SizeHint::default(),
        }
    }
}

/// Generates SSE events lazily so a long stream costs no task and no buffer.
pub(crate) struct SseStream {
    generation: Generation,
    emitted: u64,
    done: bool,
    token_delay: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    sleeping: bool,
    cut: Option<(Cut, Arc<AtomicBool>)>,
}

impl SseStream {
    pub(crate) fn new(generation: Generation, token_delay: Duration) -> Self {
        SseStream {
            generation,
            emitted: 0,
            done: false,
            token_delay,
            sleep: None,
            sleeping: false,
            cut: None,
        }
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        // Checked before [DONE] too, so a cut at or past the last chunk still withholds it.
        if let Some((cut, abort)) = &self.cut
            && self.emitted >= cut.after_chunks.min(self.generation.chunks())
        {
            return go_quiet(cut.kind, abort);
        }
        if self.emitted < self.generation.chunks() {
            if !self.token_delay.is_zero() {
                let deadline = Instant::now() + self.token_delay;
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if !self.sleeping {
                    sleep.as_mut().reset(deadline);
                    self.sleeping = true;
                }
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleeping = false;
            }
            let event = self.generation.chunk_event(self.emitted);
            self.emitted += 1;
            return Poll::Ready(Some(Ok(Frame::data(event))));
        }
        self.done = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(DONE_EVENT)))))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{Request, StatusCode};
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::time::timeout;

    use crate::config::Fault;
    use crate::test_support::*;

    #[tokio::test]
    async fn truncate_fault_aborts_mid_stream() {
        let w = worker("w-trunc").await;
        w.set_fault(Fault {
            truncate_after_chunks: Some(2),
            ..Fault::default()
        });
        let (bytes, _err) =
            raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT_STREAM)).await;
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert_eq!(count(&bytes, "data: {"), 2, "{text}");
        assert_eq!(count(&bytes, "[DONE]"), 0, "{text}");
        assert!(
            !text.ends_with("0\r\n\r\n"),
            "the chunked body must not terminate: {text}"
        );

        // A cut past the last token chunk still withholds [DONE].
        w.set_fault(Fault {
            truncate_after_chunks: Some(100),
            ..Fault::default()
        });
        let (bytes, _err) =
            raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT_STREAM)).await;
        assert_eq!(count(&bytes, "data: {"), 4);
        assert_eq!(count(&bytes, "[DONE]"), 0);

        // An HTTP client sees a broken body, not a short one.
        let stream = TcpStream::connect(w.addr()).await.unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::post("/v1/chat/completions")
            .header(http::header::HOST, "mock")
            .body(Full::new(Bytes::from_static(CHAT_STREAM.as_bytes())))
            .unwrap();
        let resp = timeout(T, tx.send_request(req)).await.unwrap().unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let collected = timeout(T, resp.into_body().collect()).await.unwrap();
        assert!(collected.is_err(), "truncated body must fail to collect");
    }

    #[tokio::test]
    async fn truncate_fault_on_plain_response() {
        let w = worker("w-trunc-plain").await;
        w.set_fault(Fault {
            truncate_after_chunks: Some(0),
            count: Some(1),
            ..Fault::default()
        });
        let (bytes, _err) = raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT)).await;
        let text = String::from_utf8_lossy(&bytes);
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(!body.is_empty() && body.len() < len, "{text}");
    }

    #[tokio::test]
    async fn stall_fault_keeps_connection_open() {
        let w = worker("w-stall").await;
        w.set_fault(Fault {
            stall_after_chunks: Some(2),
            ..Fault::default()
        });
        let mut s = TcpStream::connect(w.addr()).await.unwrap();
        s.write_all(raw_post("/v1/chat/completions", CHAT_STREAM).as_bytes())
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        timeout(T, async {
            while count(&got, "data: {") < 2 {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed early");
                got.extend_from_slice(&buf[..n]);
            }
        })
        .await
        .expect("the first chunks never came");
        // Nothing more arrives, and the connection is not closed either.
        let more = timeout(Duration::from_millis(300), s.read(&mut buf)).await;
        assert!(more.is_err(), "expected silence, got {more:?}");
        assert_eq!(count(&got, "data: {"), 2);
        assert_eq!(w.stats().open_connections, 1);
        // Shutdown must not hang on the stalled stream, and it closes it.
        timeout(T, w.shutdown()).await.expect("shutdown hung");
        let n = timeout(T, s.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0);
    }
}

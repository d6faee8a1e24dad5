//! The access log (`--access-log`): one `access` event per request in the
//! log stream (JSON with `--log-json`), written when its response has been
//! sent whole or abandoned: method, path, model, status, the worker that
//! answered, attempts, time to the response head, duration, request id.
//!
//! Owns the per-request record and the body that logs it at its end. Built
//! only when the flag is on: with it off the request path neither allocates
//! nor formats anything for it. It reads what the other phases hand it (the
//! attempts phase leaves [`Served`] in the response's extensions) and never
//! changes a response beyond wrapping its body.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Response};
use hyper::body::{Body, Frame, SizeHint};

use super::{BoxError, ResponseBody};

/// What the attempts phase knows of a request it answered (in the
/// response's extensions, with `--access-log` only).
#[derive(Clone)]
pub(crate) struct Served {
    /// The last worker tried (its normalised URL, without credentials).
    pub(crate) worker: Option<Arc<str>>,
    pub(crate) attempts: u32,
    pub(crate) model: Option<String>,
}

/// One request's line, before its end is known.
pub(crate) struct Record {
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) request_id: HeaderValue,
    pub(crate) started: Instant,
}

impl Record {
    /// `response` with a body that logs this record when it ends.
    pub(crate) fn attach(self, mut response: Response<ResponseBody>) -> Response<ResponseBody> {
        let served = response.extensions_mut().remove::<Served>();
        let line = Line {
            record: self,
            status: response.status().as_u16(),
            served,
            head_after: Instant::now(),
        };
        response.map(|body| {
            body.wrap(|inner| {
                Box::pin(Logged {
                    inner,
                    line: Some(line),
                    complete: false,
                })
            })
        })
    }
}

struct Line {
    record: Record,
    status: u16,
    served: Option<Served>,
    head_after: Instant,
}

impl Line {
    fn log(&self, complete: bool) {
        let r = &self.record;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let served = self.served.as_ref();
        tracing::info!(
            target: "access",
            method = %r.method,
            path = %r.path,
            model = %served.and_then(|s| s.model.as_deref()).unwrap_or("-"),
            status = self.status,
            worker = %served.and_then(|s| s.worker.as_deref()).unwrap_or("-"),
            attempts = served.map_or(0, |s| s.attempts),
            ttfb_ms = ms(self.head_after - r.started),
            duration_ms = ms(r.started.elapsed()),
            request_id = %r.request_id.to_str().unwrap_or("-"),
            complete,
            "access"
        );
    }
}

/// The response body, logging its line once: at its end, or when it is
/// dropped before (the client left; `complete=false`).
struct Logged {
    inner: Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>,
    line: Option<Line>,
    complete: bool,
}

impl Body for Logged {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = self.inner.as_mut().poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.complete = true;
            if let Some(line) = self.line.take() {
                line.log(true);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        if let Some(line) = self.line.take() {
            // A body known to be empty is never polled to its end.
            line.log(self.complete || self.inner.is_end_stream());
        }
    }
}

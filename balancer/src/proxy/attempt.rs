//! Phase: attempts and retries.
//!
//! Owns the retry loop of one request: an attempt per selected worker, each
//! outcome classified for that worker's breaker (one charge per worker per
//! request, through `RequestCharges`), backoff with jitter and the worker's
//! `Retry-After`, and the hand-over of the chosen response to the relay. A
//! gateway answer (no worker, exhausted retries) records nothing.

use std::pin::pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header;
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use smallvec::SmallVec;

use balancer_core::admission::Permit;
use balancer_core::breaker::{FailureReason, Outcome, RequestCharges};
use balancer_core::error_chain;
use balancer_core::quality::requested_tokens;
use balancer_core::registry::{Attempt, Worker};

use super::access::Served;
use super::answer::ErrorCode;
use super::body::{BodyError, ClientFault, RequestBody, boxed, chain};
use super::edge::is_generative;
use super::relay::Completion;
use super::relay::{WorkerBody, WorkerResponse};
use super::route::Outgoing;
use super::{BoxError, Proxy, ResponseBody, UpstreamBody, UpstreamClient};
use crate::h1::H1Request;
use crate::wire::{RawFields, first_value};

/// Retry schedule, from the `--retry-*` flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub multiplier: f64,
    pub jitter: f64,
}

impl RetryPolicy {
    /// The wait before attempt `attempt + 1` (attempt counts from 1), with
    /// jitter; a worker's `Retry-After` wins when it is longer, capped at the
    /// maximum backoff.
    pub fn backoff(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exp = self.multiplier.powi(attempt.saturating_sub(1) as i32);
        let base = (self.initial_backoff.as_secs_f64() * exp).min(self.max_backoff.as_secs_f64());
        let spread = if self.jitter > 0.0 {
            rand::Rng::random_range(&mut rand::rng(), -self.jitter..=self.jitter)
        } else {
            0.0
        };
        let wait = Duration::from_secs_f64((base * (1.0 + spread)).max(0.0));
        match retry_after {
            Some(ra) if ra > wait => ra.min(self.max_backoff),
            _ => wait,
        }
    }
}

/// Statuses after which an attempt is retried. Deliberately not the
/// per-worker failure list: the document says `retryable_status_codes` does
/// not change which responses the gateway retries.
const RETRY_STATUSES: [u16; 6] = [408, 429, 500, 502, 503, 504];

/// An attempt's request body: whole (kept for replay), or streamed from
/// the client.
enum Payload {
    Whole(Bytes),
    Streamed(UpstreamBody),
}

/// How an attempt ended, when it did not produce a response to relay. The
/// cause is logged, never shown to the client.
enum AttemptError {
    Timeout,
    Unreachable,
}

impl Proxy {
    /// The retry loop. `req` and `body` are borrowed rather than moved in
    /// (a move is a copy of their bytes into the new future), and the loop
    /// is an async block over its arguments rather than an async function:
    /// a function's future keeps a moved-in argument's bytes for its whole
    /// life, next to the local it becomes, and this future is part of every
    /// request's. A streamed `body` is taken by its one attempt.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn would keep its moved-in arguments twice"
    )]
    pub(crate) fn attempts(
        &self,
        client: &UpstreamClient,
        req: &mut Outgoing,
        body: &mut Option<RequestBody>,
        permit: Option<Permit>,
        started: Instant,
    ) -> impl Future<Output = Response<ResponseBody>> {
        async move {
            let mut charges = RequestCharges::default();
            // Inline for the usual few attempts: no allocation per request.
            let mut tried: SmallVec<[u64; 4]> = SmallVec::new();
            // A streamed body's faults are the client's: found there, an
            // attempt's failure is answered for the client and charged to no one.
            let fault = match &body {
                Some(RequestBody::Streaming(_, rest)) => Some(rest.fault()),
                _ => None,
            };
            let max_attempts = match body {
                Some(RequestBody::Streaming(..)) => 1,
                _ => self.config.retry.max_attempts,
            };
            let mut attempt = 0;
            loop {
                attempt += 1;
                let last = attempt >= max_attempts;
                let Some(mut admitted) = self.select(req, &tried) else {
                    if self.take_fallback(req, body.as_mut()) {
                        // Finding no worker was not an attempt.
                        attempt -= 1;
                        continue;
                    }
                    let answer = self.no_available_workers(req.model.as_deref());
                    return self.served(answer, None, attempt - 1, req);
                };
                let worker = admitted.worker().clone();
                let attempt_started = Instant::now();
                tried.push(worker.breaker.id());
                let payload = match body {
                    Some(RequestBody::Replayable(b, _)) => Payload::Whole(b.clone()),
                    _ => match body.take() {
                        Some(RequestBody::Streaming(prefix, rest)) => {
                            Payload::Streamed(chain(prefix, rest))
                        }
                        _ => unreachable!("a streaming body gets exactly one attempt"),
                    },
                };
                let classifier = worker.classifier();
                let result = match classifier.slow_ttfb() {
                    // Awaited where it is made: a future this size is not moved.
                    None => {
                        self.send(client, &worker, req, payload, attempt_started)
                            .await
                    }
                    // Boxed: the budget's race is rare (the option is off by
                    // default) and would otherwise widen every request's future.
                    Some(budget) => {
                        let send = self.send(client, &worker, req, payload, attempt_started);
                        let watched = self.send_watched(
                            send,
                            budget,
                            &mut admitted,
                            &mut charges,
                            fault.as_ref(),
                        );
                        Box::pin(watched).await
                    }
                };
                let failure = match result {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let outcome = classifier.classify(status);
                        if status >= 500 {
                            worker.server_error(status);
                        }
                        if outcome == Outcome::Failure(FailureReason::Status) {
                            worker.breaker.note_failed_status(status);
                        }
                        let retryable = RETRY_STATUSES.contains(&status);
                        if retryable && !last {
                            let retry_after = retry_after(&response);
                            admitted.record(&mut charges, outcome, &*self.clock);
                            drop(admitted);
                            drop(response);
                            self.stats.retry();
                            tokio::time::sleep(self.config.retry.backoff(attempt, retry_after))
                                .await;
                            continue;
                        }
                        if retryable {
                            self.stats.retries_exhausted();
                        }
                        let headers_at = Instant::now();
                        self.stats.ttfb.observe(headers_at - started);
                        self.stats.upstream_response(status);
                        // A success waits for the body; anything else is decided
                        // by the status.
                        if outcome != Outcome::Success {
                            admitted.record(&mut charges, outcome, &*self.clock);
                        }
                        let mut rules = classifier.body_rules();
                        if rules.judges_quality() {
                            // Only a 2xx completion of a generative route is
                            // judged; with the option off no body is read.
                            let judged = outcome == Outcome::Success
                                && (200..300).contains(&status)
                                && is_generative(&req.path);
                            let asked = if judged {
                                requested(body.as_ref())
                            } else {
                                None
                            };
                            rules = rules.judging(judged, asked);
                        }
                        let completion = Completion {
                            attempt: admitted,
                            charges,
                            permit,
                            started,
                            attempt_started,
                            headers_after: headers_at - attempt_started,
                            rules,
                            tokens: req.model.as_deref().map(|m| self.model_tokens(m)),
                            stats: self.stats.clone(),
                            clock: self.clock.clone(),
                            inference: is_generative(&req.path),
                            status,
                        };
                        let fallback = req
                            .fallback_from
                            .as_ref()
                            .zip(req.model.as_ref())
                            .map(|(from, to)| format!("{from}->{to}"));
                        let relayed = self.relay(response, completion, fallback);
                        return self.served(relayed, Some(&worker), attempt, req);
                    }
                    Err(e) => e,
                };
                if let Some(error) = fault.as_ref().and_then(|f| f.fault()) {
                    // The client's body broke its bounds or broke off: the
                    // attempt is dropped unrecorded, the answer is the client's.
                    drop(admitted);
                    return self.body_error(error);
                }
                if matches!(failure, AttemptError::Timeout)
                    && fault.as_ref().is_some_and(|f| !f.is_done())
                {
                    // The request timeout ran out while the client was still
                    // sending its body: the client's doing, not the worker's.
                    drop(admitted);
                    return self.body_error(&BodyError::Stalled);
                }
                let reason = match failure {
                    AttemptError::Timeout => FailureReason::Timeout,
                    AttemptError::Unreachable => FailureReason::Connect,
                };
                // Recorded as the 502 or 504 the gateway answers for it.
                let outcome = classifier.classify_no_response(reason);
                admitted.record(&mut charges, outcome, &*self.clock);
                drop(admitted);
                if !last {
                    self.stats.retry();
                    tokio::time::sleep(self.config.retry.backoff(attempt, None)).await;
                    continue;
                }
                self.stats.retries_exhausted();
                let answer = match failure {
                    AttemptError::Timeout => self.gateway_error(
                        ErrorCode::UpstreamTimeout,
                        "the worker did not answer within the request timeout",
                        None,
                    ),
                    AttemptError::Unreachable => self.gateway_error(
                        ErrorCode::UpstreamUnreachable,
                        "the worker could not be reached, or its connection broke",
                        None,
                    ),
                };
                return self.served(answer, Some(&worker), attempt, req);
            }
        }
    }

    /// `response`, with what the access log says of it when that is on.
    fn served(
        &self,
        mut response: Response<ResponseBody>,
        worker: Option<&Worker>,
        attempts: u32,
        req: &Outgoing,
    ) -> Response<ResponseBody> {
        if self.config.access_log {
            response.extensions_mut().insert(Served {
                worker: worker.map(|w| w.url.clone()),
                attempts,
                model: req.model.clone(),
            });
        }
        response
    }

    /// `send` under the slow time-to-first-byte budget: past it, slowness
    /// is certain and is charged now, so the breaker reacts at the budget
    /// rather than when the worker finally answers. The answer still goes
    /// to the client. Unless the client is still uploading: then the wait
    /// is the client's pace, not the worker's.
    async fn send_watched(
        &self,
        send: impl Future<Output = Result<WorkerResponse, AttemptError>>,
        budget: Duration,
        admitted: &mut Attempt,
        charges: &mut RequestCharges,
        fault: Option<&ClientFault>,
    ) -> Result<WorkerResponse, AttemptError> {
        tokio::pin!(send);
        tokio::select! {
            r = &mut send => r,
            () = tokio::time::sleep(budget) => {
                if fault.is_none_or(|f| f.is_done()) {
                    let slow = Outcome::Failure(FailureReason::Slow);
                    admitted.record(charges, slow, &*self.clock);
                }
                send.await
            }
        }
    }

    /// One attempt's request, until the response head: on the fast path
    /// when the worker's address is known and the body is whole, through
    /// hyper's client otherwise. Either way within the
    /// request timeout; any failure before the head is `Unreachable`. An
    /// async block, as [`Proxy::attempts`] is.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn would keep its moved-in arguments twice"
    )]
    fn send(
        &self,
        client: &UpstreamClient,
        worker: &Worker,
        req: &Outgoing,
        payload: Payload,
        started: Instant,
    ) -> impl Future<Output = Result<WorkerResponse, AttemptError>> {
        async move {
            // From the attempt's own start: no second clock read.
            let deadline = started + self.config.request_timeout;
            let address = &worker.address;
            let fast = match &payload {
                Payload::Whole(_) if address.is_resolved() => address.resolve(),
                _ => None,
            };
            // Pinned where it is built: moved into the timeout, a future this
            // size would be copied twice more.
            let sending = pin!(async {
                match (fast, payload) {
                    (Some(addr), Payload::Whole(body)) => {
                        let request = H1Request {
                            method: &req.method,
                            path: &req.path,
                            authority: address.authority.as_str(),
                            tls: address.is_tls(),
                            headers: &req.headers,
                            authorization: address.basic_auth.as_ref().map(|a| a.expose()),
                            body,
                        };
                        let response = client.h1.send(addr, &request).await?;
                        Ok::<_, BoxError>(Box::new(response.map(WorkerBody::H1)))
                    }
                    (_, payload) => {
                        let body = match payload {
                            Payload::Whole(body) => boxed(Full::new(body)),
                            Payload::Streamed(body) => body,
                        };
                        // Boxed for the same reason as a fast-path connect:
                        // hyper's request future is large and off the fast path.
                        let response = Box::pin(self.send_hyper(client, worker, req, body)).await?;
                        Ok(Box::new(response.map(WorkerBody::Hyper)))
                    }
                }
            });
            match client.timers.within(deadline.into(), sending).await {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(e)) => {
                    tracing::debug!(worker = %worker.url, error = %error_chain(&*e), "attempt failed");
                    Err(AttemptError::Unreachable)
                }
                Err(_) => Err(AttemptError::Timeout),
            }
        }
    }

    /// [`Proxy::send`] through hyper's client.
    async fn send_hyper(
        &self,
        client: &UpstreamClient,
        worker: &Worker,
        req: &Outgoing,
        body: UpstreamBody,
    ) -> Result<Response<Incoming>, BoxError> {
        let uri = Uri::builder()
            .scheme(worker.address.scheme.clone())
            .authority(worker.address.authority.clone())
            .path_and_query(&*req.path)
            .build()
            .inspect_err(|e| {
                tracing::warn!(worker = %worker.url, error = %e, "cannot build the worker URI");
            })?;
        let mut upstream = Request::new(body);
        *upstream.method_mut() = req.method.clone();
        *upstream.uri_mut() = uri;
        *upstream.headers_mut() = req.headers.to_map();
        if let Some(auth) = &worker.address.basic_auth
            && !req.headers.client().contains(&header::AUTHORIZATION)
            && let Ok(value) = http::HeaderValue::from_str(auth.expose())
        {
            upstream.headers_mut().insert(header::AUTHORIZATION, value);
        }
        Ok(client.hyper.request(upstream).await?)
    }
}

/// The completion limit the request asked for, when its body is here
/// whole; a streamed body's is unknown, and its completion is judged
/// without the exemption.
fn requested(body: Option<&RequestBody>) -> Option<u64> {
    match body? {
        RequestBody::Replayable(bytes, _) => requested_tokens(bytes),
        RequestBody::Streaming(..) => None,
    }
}

fn retry_after(response: &Response<WorkerBody>) -> Option<Duration> {
    let none = RawFields::default();
    let raw = response.body().fields().unwrap_or(&none);
    let value = first_value(raw, response.headers(), &header::RETRY_AFTER)?;
    let secs: f64 = std::str::from_utf8(value).ok()?.trim().parse().ok()?;
    // Clamped before conversion: a worker's `Retry-After: 1e20` must not
    // panic the gateway, and the backoff caps it further anyway.
    (secs.is_finite() && secs >= 0.0)
        .then(|| Duration::from_secs_f64(secs.min(MAX_RETRY_AFTER_SECS)))
}

/// The longest `Retry-After` taken from a worker, in seconds.
const MAX_RETRY_AFTER_SECS: f64 = 3600.0;

//! What each path answers: [`handle`] routes a request to the control API,
//! `/health` or the `/v1/*` endpoints, counts it, applies the current fault to
//! it in the documented order (`latency_ms`, then `drop`, then `status`, else
//! a normal answer slowed by `token_delay_ms` and cut by
//! `stall_after_chunks` / `truncate_after_chunks`), and turns a completion
//! into a JSON or SSE response.
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module decides *whether and how* a request misbehaves; it may use
//! every module below it but must not depend on `server` or `cli`. It must
//! not build completion payloads (that is `generation`), implement the cut
//! itself (that is `body`) or touch the connection (that is `server`, which
//! turns [`DropConnection`] into a closed socket and an armed abort flag into
//! a connection abort).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, HeaderValue};
use http::{Method, Request, StatusCode};
use hyper::body::Incoming;

use crate::body::{MockBody, SseStream};
use crate::config::{Applied, Cut};
use crate::control::control;
use crate::generation::{CompletionRequest, Kind};
use crate::shared::{ReadError, Resp, Shared, bump, read_body};

/// Returned by the service to make hyper close the connection without writing a response.
#[derive(Debug)]
pub(crate) struct DropConnection;

impl fmt::Display for DropConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("mock worker: connection dropped on purpose")
    }
}

impl std::error::Error for DropConnection {}

/// The service of every connection. `abort` is the connection's truncation
/// flag, which the body arms and the server's transport acts on.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    abort: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Result<Resp, DropConnection> {
    let path = req.uri().path();
    if path.starts_with("/_mock/") {
        return Ok(control(&shared, req).await);
    }
    // The engine's own series: like the control API, never counted, so a
    // gateway scraping the load does not move the request counters.
    if path == "/metrics" && req.method() == Method::GET {
        let text = shared.engine.metrics(&shared.model);
        return Ok(shared.respond(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            MockBody::full(text.into()),
        ));
    }
    bump(&shared.stats.requests);
    if path == "/health" {
        bump(&shared.stats.health_checks);
        return Ok(health(&shared, req.method()));
    }
    if path.starts_with("/v1/") {
        return inference(&shared, abort, req).await;
    }
    Ok(shared.error(StatusCode::NOT_FOUND, "unknown path", "not_found"))
}

fn health(shared: &Shared, method: &Method) -> Resp {
    if method != Method::GET {
        return shared.error(
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET",
            "method_not_allowed",
        );
    }
    match shared.health_fault() {
        Some((status, retry_after)) => shared.injected_error(status, retry_after),
        None => shared.json(StatusCode::OK, Bytes::from_static(br#"{"status":"ok"}"#)),
    }
}

async fn inference(
    shared: &Shared,
    abort: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Result<Resp, DropConnection> {
    bump(&shared.stats.inference_requests);
    let (parts, body) = req.into_parts();
    let body = match read_body(body).await {
        Ok(b) => b,
        Err(ReadError::TooLarge) => {
            return Ok(shared.error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request body too large",
                "body_too_large",
            ));
        }
        // The client is gone or sent a broken body; there is nobody to answer.
        Err(ReadError::Broken) => return Err(DropConnection),
    };
    let fault = shared.take_inference_fault().unwrap_or_default();
    if let Some(latency) = fault.latency {
        tokio::time::sleep(latency).await;
    }
    if fault.drop {
        return Err(DropConnection);
    }
    if let Some(status) = fault.status {
        let resp = shared.injected_error(status, fault.retry_after);
        return Ok(cut_response(resp, fault.cut, abort));
    }
    let token_delay = fault.token_delay.unwrap_or(shared.token_delay);
    if parts.method == Method::GET
        && let Some(id) = parts.uri.path().strip_prefix("/v1/models/")
    {
        let resp = if *id == *shared.model {
            shared.json(StatusCode::OK, shared.card_body.clone())
        } else {
            shared.error(StatusCode::NOT_FOUND, "no such model", "model_not_found")
        };
        return Ok(cut_response(resp, fault.cut, abort));
    }
    let kind = match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/v1/models") => None,
        (&Method::POST, "/v1/chat/completions") => Some(Kind::Chat),
        (&Method::POST, "/v1/completions") => Some(Kind::Text),
        (_, "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
            let resp = shared.error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
                "method_not_allowed",
            );
            return Ok(cut_response(resp, fault.cut, abort));
        }
        _ => {
            let resp = shared.error(StatusCode::NOT_FOUND, "unknown path", "not_found");
            return Ok(cut_response(resp, fault.cut, abort));
        }
    };
    let resp = match kind {
        None => shared.json(StatusCode::OK, shared.models_body.clone()),
        Some(kind) => generate(shared, kind, &body, token_delay, &fault).await,
    };
    Ok(cut_response(resp, fault.cut, abort))
}

/// Answers a `POST /v1/chat/completions` or `POST /v1/completions` body;
/// the fault may fix its length and leave out its usage.
async fn generate(
    shared: &Shared,
    kind: Kind,
    body: &[u8],
    token_delay: Duration,
    fault: &Applied,
) -> Resp {
    let mut req =
        match CompletionRequest::parse(kind, body, shared.default_tokens, shared.max_tokens_cap) {
            Ok(r) => r,
            Err(msg) => return shared.error(StatusCode::BAD_REQUEST, &msg, "invalid_json"),
        };
    if let Some(n) = fault.completion_tokens {
        req.tokens = n;
    }
    // The engine's queue and prefill come before the first token; a streamed
    // answer frees its slot once its headers go, a whole one after its decode.
    let (_slot, _lookup) = shared.engine.prefill(body).await;
    let (stream, tokens) = (req.stream, req.tokens);
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let mut gen_ = req.into_generation(id, shared.model.clone());
    if fault.without_usage {
        gen_ = gen_.without_usage();
    }
    if stream {
        let mut resp = shared.respond(
            StatusCode::OK,
            "text/event-stream",
            MockBody::sse(SseStream::new(gen_, token_delay)),
        );
        resp.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return resp;
    }
    if !token_delay.is_zero() {
        let total = token_delay.saturating_mul(u32::try_from(tokens).unwrap_or(u32::MAX));
        tokio::time::sleep(total).await;
    }
    shared.json(StatusCode::OK, gen_.full_body())
}

fn cut_response(resp: Resp, cut: Option<Cut>, abort: Arc<AtomicBool>) -> Resp {
    match cut {
        None => resp,
        Some(cut) => resp.map(|body| body.cut(cut, abort)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::header::RETRY_AFTER;
    use http::{Method, StatusCode};
    use serde_json::Value;

    use crate::config::Fault;
    use crate::shared::WORKER_HEADER;
    use crate::test_support::*;

    #[tokio::test]
    async fn bad_requests() {
        let w = worker("w-bad").await;
        for body in ["{not json", "[1,2]", r#"{"max_tokens":-1}"#, ""] {
            let a = chat(&w, body).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "body {body:?}");
            let v = a.json();
            assert!(v["error"]["message"].is_string());
            assert_eq!(v["error"]["type"], "invalid_request_error");
            assert_eq!(v["error"]["code"], "invalid_json");
        }
        let a = call(&w, Method::GET, "/nope", "").await;
        assert_eq!(a.status, StatusCode::NOT_FOUND);
        assert!(a.json()["error"]["message"].is_string());
        assert_eq!(
            call(&w, Method::GET, "/v1/nope", "").await.status,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            call(&w, Method::GET, "/v1/chat/completions", "")
                .await
                .status,
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            call(&w, Method::GET, "/_mock/nope", "").await.status,
            StatusCode::NOT_FOUND
        );
    }

    #[tokio::test]
    async fn short_answer_fault_streamed_and_not_with_and_without_usage() {
        let w = worker("w-short").await;
        w.set_fault(Fault {
            completion_tokens: Some(0),
            every: Some(2),
            ..Fault::default()
        });
        // Every second answer is empty, whatever `max_tokens` asked for.
        let full = chat(&w, CHAT).await.json();
        assert_eq!(full["usage"]["completion_tokens"], 3);
        let empty = chat(&w, CHAT).await.json();
        assert_eq!(empty["choices"][0]["message"]["content"], "");
        assert_eq!(empty["usage"]["completion_tokens"], 0);

        w.set_fault(Fault {
            completion_tokens: Some(1),
            without_usage: true,
            ..Fault::default()
        });
        let one = chat(&w, CHAT).await.json();
        assert_eq!(one["choices"][0]["message"]["content"], "Lorem");
        assert!(one.get("usage").is_none(), "{one}");
        let streamed = chat(&w, CHAT_STREAM).await;
        let events = sse_events(&streamed.body);
        assert_eq!(events.len(), 2, "one token, then [DONE]: {events:?}");
        let last: Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(last["choices"][0]["delta"]["content"], "Lorem");
        assert!(last.get("usage").is_none(), "{last}");

        w.set_fault(Fault {
            completion_tokens: Some(0),
            ..Fault::default()
        });
        let streamed = chat(&w, CHAT_STREAM).await;
        let events = sse_events(&streamed.body);
        let only: Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(only["choices"][0]["delta"]["content"], "");
        assert_eq!(only["usage"]["completion_tokens"], 0);
        let text = complete(&w, r#"{"model":"demo-model","prompt":"hi","max_tokens":5}"#)
            .await
            .json();
        assert_eq!(text["choices"][0]["text"], "");
    }

    #[tokio::test]
    async fn status_fault_with_count_and_retry_after() {
        let w = worker("w-status").await;
        w.set_fault(Fault {
            status: Some(503),
            count: Some(2),
            retry_after: Some(7),
            ..Fault::default()
        });
        for _ in 0..2 {
            let a = chat(&w, CHAT).await;
            assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(a.headers[RETRY_AFTER], "7");
            assert_eq!(a.headers[WORKER_HEADER], "w-status");
            let v = a.json();
            assert_eq!(v["error"]["type"], "server_error");
            assert_eq!(v["error"]["code"], "injected_fault");
        }
        let a = chat(&w, CHAT).await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(a.headers.get(RETRY_AFTER).is_none());
        // The spent fault does not touch health.
        assert_eq!(
            call(&w, Method::GET, "/health", "").await.status,
            StatusCode::OK
        );
        let s = w.stats();
        assert_eq!(s.faults_applied, 2);
        assert_eq!(s.inference_requests, 3);
    }

    #[tokio::test]
    async fn latency_fault() {
        let w = worker("w-latency").await;
        w.set_fault(Fault {
            latency_ms: Some(150),
            count: Some(1),
            ..Fault::default()
        });
        let started = std::time::Instant::now();
        let a = chat(&w, CHAT).await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(
            started.elapsed() >= Duration::from_millis(150),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(w.stats().faults_applied, 1);
    }

    #[tokio::test]
    async fn token_delay_fault() {
        let w = worker("w-tokdelay").await;
        w.set_fault(Fault {
            token_delay_ms: Some(30),
            ..Fault::default()
        });
        let started = std::time::Instant::now();
        let a = chat(&w, CHAT_STREAM).await;
        assert_eq!(sse_events(&a.body).len(), 5);
        assert!(
            started.elapsed() >= Duration::from_millis(120),
            "{:?}",
            started.elapsed()
        );
        let started = std::time::Instant::now();
        chat(&w, CHAT).await;
        assert!(
            started.elapsed() >= Duration::from_millis(90),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn drop_fault_closes_without_answer() {
        let w = worker("w-drop").await;
        w.set_fault(Fault {
            drop: true,
            count: Some(1),
            ..Fault::default()
        });
        let (bytes, _err) = raw_until_closed(&w, &raw_post("/v1/chat/completions", CHAT)).await;
        assert!(
            bytes.is_empty(),
            "got {:?}",
            String::from_utf8_lossy(&bytes)
        );
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::OK);
        let s = w.stats();
        assert_eq!((s.inference_requests, s.faults_applied), (2, 1));
    }
}

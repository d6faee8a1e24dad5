//! Helpers shared by the unit tests of every module: a worker on a free
//! loopback port, one-shot HTTP calls, raw socket requests and SSE parsing.
//!
//! Test-only code (compiled under `cfg(test)`), above the whole layering
//! (`config`, `generation`, `body`, `shared`, `control`, `routes`, `server`,
//! `cli`): only the `tests` modules may use it, no production module may
//! depend on it. It uses `config`, `server` and `shared` (the worker handle,
//! its config and the header constants) and drives workers only from the
//! outside, over TCP, the way the gateway and the end-to-end tests do.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::config::MockWorkerConfig;
use crate::server::MockWorker;
use crate::shared::JSON;

/// Generous bound for anything that should be instant on loopback.
pub(crate) const T: Duration = Duration::from_secs(5);

pub(crate) async fn worker(name: &str) -> MockWorker {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    MockWorker::spawn(addr, MockWorkerConfig::named(name))
        .await
        .expect("spawn mock worker")
}

pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Answer {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

pub(crate) async fn call(w: &MockWorker, method: Method, path: &str, body: &str) -> Answer {
    timeout(T, async {
        let stream = TcpStream::connect(w.addr()).await.unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, "mock")
            .header(CONTENT_TYPE, JSON)
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        let resp = tx.send_request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    })
    .await
    .expect("request timed out")
}

pub(crate) async fn chat(w: &MockWorker, body: &str) -> Answer {
    call(w, Method::POST, "/v1/chat/completions", body).await
}

pub(crate) async fn complete(w: &MockWorker, body: &str) -> Answer {
    call(w, Method::POST, "/v1/completions", body).await
}

pub(crate) const CHAT: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"say hi to me"}],"max_tokens":3}"#;
pub(crate) const CHAT_STREAM: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"say hi"}],"max_tokens":4,"stream":true}"#;

pub(crate) fn raw_post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends a raw request and reads until EOF or a socket error, whichever comes first.
pub(crate) async fn raw_until_closed(
    w: &MockWorker,
    request: &str,
) -> (Vec<u8>, Option<io::Error>) {
    timeout(T, async {
        let mut s = TcpStream::connect(w.addr()).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) => return (out, None),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) => return (out, Some(e)),
            }
        }
    })
    .await
    .expect("the worker kept the connection open")
}

/// The JSON payloads of an SSE body, with `[DONE]` kept as a plain string.
pub(crate) fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(
        text.ends_with("\n\n"),
        "events end with a blank line: {text:?}"
    );
    text.split_terminator("\n\n")
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"))
                .to_owned()
        })
        .collect()
}

pub(crate) fn count(haystack: &[u8], needle: &str) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle.as_bytes())
        .count()
}

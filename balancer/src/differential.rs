//! The hand-written HTTP/1.1 paths held to hyper on the same bytes.
//!
//! Owns the comparison behind the `differential` fuzz target and its
//! proptest: a client's bytes read by the fast path ([`read_request`]) and
//! by hyper's server, a worker's bytes read by the fast client
//! ([`read_answer`]) and by hyper's client, each over an in-memory pipe on
//! a paused clock (a wait for bytes that never come ends at once, and
//! nothing depends on the machine's speed). The rule is one-sided: ours may
//! refuse what hyper takes, or close a connection hyper would keep, but it
//! may never take what hyper refuses, read a message differently, or keep
//! a connection hyper would not. Touches no socket and no gateway state.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use crate::h1::{Answered, read_answer};
use crate::server::read_request;

/// Long enough for anything in memory; on the paused clock it costs nothing.
const WAIT: Duration = Duration::from_secs(5);

/// Compares both sides; `Err` says how ours is laxer than hyper.
pub fn compare(client: &[u8], worker: &[u8]) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        compare_request(client).await?;
        compare_answer(worker).await
    })
}

/// A client's bytes: what the fast path takes as a plain request, hyper's
/// server must read as the same request, and close the connection after it
/// if the fast path would.
async fn compare_request(wire: &[u8]) -> Result<(), String> {
    let Some((ours, head_len, body_len, close)) = read_request(wire) else {
        // Not plain: hyper serves it in the gateway too.
        return Ok(());
    };
    let (mut client, server) = tokio::io::duplex(1 << 20);
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let seen = seen_tx.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.map(|b| b.to_bytes());
            let _ = seen.send((parts, body));
            Ok::<_, std::convert::Infallible>(Response::new(Empty::<Bytes>::new()))
        }
    });
    let serving = tokio::spawn(
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(server), service),
    );
    client.write_all(wire).await.map_err(|e| e.to_string())?;
    let Ok(Some((parts, body))) = tokio::time::timeout(WAIT, seen_rx.recv()).await else {
        serving.abort();
        return Err(format!(
            "the fast path took a request hyper did not: {wire:?}"
        ));
    };
    let body = body.map_err(|e| format!("hyper failed the body the fast path took: {e}"))?;
    let same = parts.method == ours.method()
        && parts.uri == *ours.uri()
        && parts.version == ours.version()
        && parts.headers.len() == ours.headers().len()
        && body.len() == body_len;
    if !same {
        serving.abort();
        return Err(format!(
            "read differently: fast path {} {} ({} headers, {body_len} body bytes), \
             hyper {} {} ({} headers, {} body bytes)",
            ours.method(),
            ours.uri(),
            ours.headers().len(),
            parts.method,
            parts.uri,
            parts.headers.len(),
            body.len()
        ));
    }
    // Whether hyper keeps the connection after its answer: a closed one
    // reads to its end.
    let mut answer = Vec::new();
    let ended = tokio::time::timeout(WAIT, client.read_to_end(&mut answer))
        .await
        .is_ok();
    serving.abort();
    // Bytes after the first request are hyper's next one, and may close the
    // connection for their own sake.
    let pipelined = wire.len() > head_len + body_len;
    if ended && !close && !pipelined {
        return Err(format!(
            "hyper closes after a request the fast path keeps: {wire:?}"
        ));
    }
    Ok(())
}

/// A worker's bytes: what the fast client reads as an answer, hyper's
/// client must read as the same status and body; a connection the fast
/// client would pool, hyper's must keep.
async fn compare_answer(wire: &[u8]) -> Result<(), String> {
    let Some(ours) = read_answer(wire) else {
        // Refused, or failed mid-body: never laxer than hyper.
        return Ok(());
    };
    let theirs = hyper_answer(wire).await;
    let laxer = match &theirs {
        None => true,
        Some(t) => t.status != ours.status || t.body != ours.body || (ours.reusable && !t.reusable),
    };
    if laxer {
        return Err(format!(
            "worker answer {wire:?}: the fast client read {ours:?}, hyper {theirs:?}"
        ));
    }
    Ok(())
}

/// What hyper's client makes of `wire` as the answer to a POST: the worker
/// closes its side only when hyper waits for more (a body to the close, or
/// an incomplete message, which then fails).
async fn hyper_answer(wire: &[u8]) -> Option<Answered> {
    let (client, mut worker) = tokio::io::duplex(1 << 20);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client))
        .await
        .ok()?;
    let conn = tokio::spawn(conn);
    let request = Request::post("/v1/chat/completions")
        .header("host", "worker")
        .body(Full::new(Bytes::from_static(b"{}")))
        .ok()?;
    let sending = sender.send_request(request);
    tokio::pin!(sending);
    // The worker answers once it has read the request, as a worker does.
    let mut read = Vec::new();
    while !read.ends_with(b"\r\n\r\n{}") {
        let mut chunk = [0u8; 1024];
        tokio::select! {
            n = worker.read(&mut chunk) => read.extend_from_slice(&chunk[..n.ok().filter(|&n| n > 0)?]),
            _ = &mut sending => return None,
        }
    }
    worker.write_all(wire).await.ok()?;
    let mut closed = false;
    let response = match tokio::time::timeout(WAIT, &mut sending).await {
        Ok(response) => response.ok()?,
        Err(_) => {
            close(&mut worker, &mut closed).await;
            tokio::time::timeout(WAIT, &mut sending).await.ok()?.ok()?
        }
    };
    let status = response.status();
    let mut body = response.into_body();
    let mut data = Vec::new();
    loop {
        match tokio::time::timeout(WAIT, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(bytes) = frame.into_data() {
                    data.extend_from_slice(&bytes);
                }
            }
            Ok(Some(Err(_))) => return None,
            Ok(None) => break,
            Err(_) if closed => return None,
            Err(_) => close(&mut worker, &mut closed).await,
        }
    }
    // Let the connection settle (it reads on while idle: a stray byte
    // fails it), then ask whether it takes another request.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let reusable = !closed
        && !conn.is_finished()
        && tokio::time::timeout(WAIT, sender.ready())
            .await
            .is_ok_and(|ready| ready.is_ok());
    conn.abort();
    Some(Answered {
        status,
        body: data,
        reusable,
    })
}

async fn close(worker: &mut DuplexStream, closed: &mut bool) {
    let _ = worker.shutdown().await;
    *closed = true;
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn the_issues_worker_answers_agree_with_hyper_or_are_stricter() {
        for wire in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"[..],
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ncontent-length: 5\r\n\r\nhello world",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, identity\r\ncontent-length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n 5 \r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\nlate body",
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecret",
            b"HTTP/1.1 200 OK\r\n\r\nto the close",
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
            // The fuzzer's first finding: a trailer that is no field.
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;e=1\r\nhello\r\n0\r\nx\0\0\0\x001\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nx-t: 1\r\n\r\n",
        ] {
            compare(b"", wire).unwrap();
        }
    }

    #[test]
    fn the_issues_client_requests_agree_with_hyper() {
        for wire in [
            &b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-length: 2\r\n\r\n{}"[..],
            b"GET /v1/models HTTP/1.1\r\nhost: g\r\nconnection: close\r\n\r\n",
            b"GET /v1/models HTTP/1.1\r\nhost: g\r\n\r\nPRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"GET / HTTP/1.1\r\nhost: g\r\nx_forwarded_for: 1.2.3.4\r\n\r\n",
        ] {
            compare(wire, b"").unwrap();
        }
    }

    #[test]
    fn hyper_is_read_right_by_the_harness() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let reusable = |wire: &'static [u8]| {
            runtime
                .block_on(hyper_answer(wire))
                .map(|a| (a.status.as_u16(), a.body, a.reusable))
        };
        assert_eq!(
            reusable(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"),
            Some((200, b"hello".to_vec(), true))
        );
        assert_eq!(
            reusable(b"HTTP/1.1 204 No Content\r\n\r\nlate"),
            Some((204, Vec::new(), false))
        );
        assert_eq!(
            reusable(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"),
            Some((200, b"ok".to_vec(), false))
        );
        assert_eq!(
            reusable(b"HTTP/1.1 200 OK\r\n\r\nto the end"),
            Some((200, b"to the end".to_vec(), false))
        );
        assert_eq!(
            reusable(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort"),
            None
        );
    }

    /// A worker's answer: a status line, a few framing and other headers in
    /// their odd spellings, then body pieces (chunk lines, data, stray
    /// bytes).
    fn answer() -> impl Strategy<Value = String> {
        let status = prop::sample::select(vec![
            "HTTP/1.1 200 OK\r\n",
            "HTTP/1.0 200 OK\r\n",
            "HTTP/1.1 204 No Content\r\n",
            "HTTP/1.1 304 Not Modified\r\n",
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n",
            "HTTP/1.1 503 Busy\r\n",
        ]);
        let header = prop::sample::select(vec![
            "content-length: 5\r\n",
            "content-length: 0\r\n",
            "Content-Length: 05\r\n",
            "content-length: 5, 5\r\n",
            "content-length: +5\r\n",
            "transfer-encoding: chunked\r\n",
            "Transfer-Encoding: gzip\r\n",
            "transfer-encoding: gzip, chunked\r\n",
            "transfer-encoding: chunked, identity\r\n",
            "connection: close\r\n",
            "connection: keep-alive\r\n",
            "connection: x-hop\r\n",
            "x-hop: 1\r\n",
        ]);
        let body = prop::sample::select(vec![
            "5\r\n",
            "+5\r\n",
            " 5\r\n",
            "5 \r\n",
            "5;e=1\r\n",
            "0\r\n\r\n",
            "hello",
            "hello\r\n",
            "\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecret",
        ]);
        (
            status,
            prop::collection::vec(header, 0..4),
            prop::collection::vec(body, 0..6),
        )
            .prop_map(|(s, h, b)| format!("{s}{}\r\n{}", h.concat(), b.concat()))
    }

    /// A client's request: a request line, headers, a body, maybe more.
    fn request() -> impl Strategy<Value = String> {
        let line = prop::sample::select(vec![
            "GET /v1/models HTTP/1.1\r\n",
            "POST /v1/chat/completions HTTP/1.1\r\n",
            "PUT /v1/chat/completions HTTP/1.1\r\n",
            "POST /v1/models/x%2Fy HTTP/1.1\r\n",
            "GET /v1/models HTTP/1.0\r\n",
            "POST http://g/v1/chat/completions HTTP/1.1\r\n",
        ]);
        let header = prop::sample::select(vec![
            "host: g\r\n",
            "Host: h\r\n",
            "content-length: 2\r\n",
            "content-length: 02\r\n",
            "content-length: 2, 2\r\n",
            "transfer-encoding: chunked\r\n",
            "connection: close\r\n",
            "connection: keep-alive, x-hop\r\n",
            "x_under: 1\r\n",
            "x: \t v \r\n",
            "x:y\r\n",
            " folded\r\n",
        ]);
        let tail = prop::sample::select(vec![
            "",
            "{}",
            "{}PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            "GET / HTTP/1.1\r\nhost: g\r\n\r\n",
        ]);
        (line, prop::collection::vec(header, 0..4), tail)
            .prop_map(|(l, h, t)| format!("{l}{}\r\n{t}", h.concat()))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the bytes, the fast path and the fast client are never
        /// laxer than hyper.
        #[test]
        fn never_laxer_than_hyper(
            client in request(),
            worker in answer(),
        ) {
            if let Err(why) = compare(client.as_bytes(), worker.as_bytes()) {
                prop_assert!(false, "{}", why);
            }
        }
    }
}

//! End-to-end tests that hold the gateway's hand-written HTTP/1.1 paths
//! (the fast path serving clients, the fast client to workers) to hyper's
//! behaviour, with raw sockets on both sides: stray worker bytes never
//! reach another client, a request the worker read is never sent twice,
//! framing as hyper reads it, hop-by-hop headers, a 204's length, the
//! edge's `Host`, header-name and path rules, HTTP/2 after HTTP/1.1, and
//! streamed bodies checked as one JSON object. Every wait is bounded.

use std::time::Duration;

use balancer_tests::capture::{Answer, CaptureWorker};
use balancer_tests::gateway::{BOUND, CHAT, harness_with_urls, quiet};
use balancer_tests::scripted::{Reply, ScriptedWorker};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A plain chat request, as the fast path takes it.
fn plain(extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n{extra}\r\n{CHAT}",
        CHAT.len()
    )
}

/// The same request chunked: hyper serves it (the fast path hands it over).
fn chunked(extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\n{extra}\r\n{:x}\r\n{CHAT}\r\n0\r\n\r\n",
        CHAT.len()
    )
}

/// A response read off a raw socket: its head (lower case) and body.
struct Got {
    head: String,
    body: Vec<u8>,
}

impl Got {
    fn status(&self) -> u16 {
        self.head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k == name).then(|| v.trim())
        })
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `request` on `s` and reads one response (by its length, its
/// chunks, or to the close).
async fn exchange(s: &mut TcpStream, request: &str) -> Got {
    s.write_all(request.as_bytes()).await.unwrap();
    tokio::time::timeout(BOUND, read_response(s))
        .await
        .expect("an answer in time")
}

async fn read_response(s: &mut TcpStream) -> Got {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "closed inside a head: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let mut rest = buf[end..].to_vec();
    let got = Got {
        head,
        body: Vec::new(),
    };
    let length = got
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok());
    let body = if got.status() == 204 || got.status() == 304 {
        Vec::new()
    } else if let Some(n) = length {
        while rest.len() < n {
            let k = s.read(&mut chunk).await.unwrap();
            assert!(k > 0, "closed inside a body");
            rest.extend_from_slice(&chunk[..k]);
        }
        rest.truncate(n);
        rest
    } else if got.header("transfer-encoding") == Some("chunked") {
        let mut body = Vec::new();
        loop {
            while !rest.windows(2).any(|w| w == b"\r\n") {
                let k = s.read(&mut chunk).await.unwrap();
                assert!(k > 0, "closed inside a chunk");
                rest.extend_from_slice(&chunk[..k]);
            }
            let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16)
                .unwrap();
            rest.drain(..eol + 2);
            while rest.len() < size + 2 {
                let k = s.read(&mut chunk).await.unwrap();
                assert!(k > 0, "closed inside a chunk");
                rest.extend_from_slice(&chunk[..k]);
            }
            if size == 0 {
                break body;
            }
            body.extend_from_slice(&rest[..size]);
            rest.drain(..size + 2);
        }
    } else {
        let _ = s.read_to_end(&mut rest).await;
        rest
    };
    Got { body, ..got }
}

async fn connect(addr: std::net::SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.unwrap()
}

fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test]
async fn a_workers_unasked_bytes_never_reach_another_client() {
    for late in ["response", "body after 204"] {
        let script: fn(usize, &str) -> Reply = if late == "response" {
            |n, _| Reply {
                answer: ok(&format!("answer-{n}")),
                stray: if n == 0 {
                    ok("someone-elses-secret")
                } else {
                    Vec::new()
                },
                close: false,
            }
        } else {
            |n, _| match n {
                0 => Reply {
                    answer: b"HTTP/1.1 204 No Content\r\n\r\n".to_vec(),
                    stray: b"late body of the 204".to_vec(),
                    close: false,
                },
                n => Reply::answer(ok(&format!("answer-{n}"))),
            }
        };
        let worker = ScriptedWorker::start(script).await;
        // One serving thread: one pool, so connections can be counted.
        let h = harness_with_urls(&[worker.url()], |c| {
            quiet(c);
            c.serving_threads = 1;
        })
        .await;
        let before = worker.connections();
        let first = exchange(&mut connect(h.gw.addr).await, &plain("")).await;
        assert!(
            first.status() == 200 || first.status() == 204,
            "{late}: {}",
            first.head
        );
        // The stray bytes land while the worker's connection idles.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for n in 1..4 {
            let next = exchange(&mut connect(h.gw.addr).await, &plain("")).await;
            assert_eq!(next.status(), 200, "{late}: {}", next.head);
            assert_eq!(
                next.text(),
                format!("answer-{n}"),
                "{late}: another client's bytes"
            );
        }
        assert_eq!(worker.requests(), 4, "{late}: a request ran twice");
        assert_eq!(
            worker.connections() - before,
            2,
            "{late}: the tainted connection was not dropped, or a clean one was"
        );
        h.stop().await;
    }
}

#[tokio::test]
async fn a_request_the_worker_read_is_never_sent_again_behind_the_retry_loop() {
    // The second request is read whole and the connection closed unanswered.
    let worker = ScriptedWorker::start(|n, _| match n {
        1 => Reply::default(),
        n => Reply::answer(ok(&format!("answer-{n}"))),
    })
    .await;
    let h = harness_with_urls(&[worker.url()], |c| {
        quiet(c);
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    let mut s = connect(h.gw.addr).await;
    assert_eq!(exchange(&mut s, &plain("")).await.status(), 200);
    let second = exchange(&mut s, &plain("")).await;
    assert_eq!(second.status(), 502, "{}", second.head);
    assert_eq!(worker.requests(), 2, "the worker got the POST twice");
    h.stop().await;
}

#[tokio::test]
async fn response_framing_and_hop_headers_are_read_as_hyper_reads_them() {
    // A coding other than chunked, with a length that frames nothing.
    let gzip = ScriptedWorker::start(|_, _| Reply {
        answer: b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ncontent-length: 5\r\n\r\nhello world, all of it"
            .to_vec(),
        stray: Vec::new(),
        close: true,
    })
    .await;
    let h = harness_with_urls(&[gzip.url()], quiet).await;
    for request in [plain(""), chunked("")] {
        let got = exchange(&mut connect(h.gw.addr).await, &request).await;
        assert_eq!(got.status(), 200, "{}", got.head);
        assert_eq!(got.text(), "hello world, all of it", "{}", got.head);
        assert_ne!(got.header("content-length"), Some("5"), "{}", got.head);
    }
    h.stop().await;

    // Names the worker's Connection lists, and a 204's length: not relayed,
    // whichever side serves the client.
    let worker = ScriptedWorker::start(|n, _| {
        Reply::answer(if n % 2 == 0 {
            b"HTTP/1.1 200 OK\r\nconnection: x-secret\r\nx-secret: hop\r\nx-kept: 1\r\ncontent-length: 2\r\n\r\nok".to_vec()
        } else {
            b"HTTP/1.1 204 No Content\r\ncontent-length: 7\r\n\r\n".to_vec()
        })
    })
    .await;
    let h = harness_with_urls(&[worker.url()], quiet).await;
    for request in [plain(""), chunked("")] {
        let mut s = connect(h.gw.addr).await;
        let got = exchange(&mut s, &request).await;
        assert_eq!(got.header("x-kept"), Some("1"), "{}", got.head);
        assert_eq!(got.header("x-secret"), None, "{}", got.head);
        let got = exchange(&mut s, &request).await;
        assert_eq!(got.status(), 204, "{}", got.head);
        assert_eq!(got.header("content-length"), None, "{}", got.head);
    }
    h.stop().await;
}

#[tokio::test]
async fn http2_is_not_spoken_after_http1_on_one_connection() {
    let worker = ScriptedWorker::start(|n, _| Reply::answer(ok(&format!("answer-{n}")))).await;
    let h = harness_with_urls(&[worker.url()], quiet).await;
    let mut s = connect(h.gw.addr).await;
    assert_eq!(exchange(&mut s, &plain("")).await.status(), 200);
    // The preface, SETTINGS, and a HEADERS frame for POST /v1/chat/completions
    // (HPACK: :method POST, :scheme http, :path /v1/chat/completions literal).
    let mut h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    h2.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let path = b"/v1/chat/completions";
    let mut block = vec![0x83, 0x86, 0x04, path.len() as u8];
    block.extend_from_slice(path);
    block.extend_from_slice(&[0x01, 0x02, b'g', b'w']);
    h2.extend_from_slice(&[0, 0, block.len() as u8, 1, 0x05, 0, 0, 0, 1]);
    h2.extend_from_slice(&block);
    s.write_all(&h2).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut rest)).await;
    assert!(
        !rest.starts_with(&[0, 0]) || rest.len() < 9 || rest[3] != 4,
        "the gateway answered HTTP/2 SETTINGS: {rest:?}"
    );
    assert_eq!(
        worker.requests(),
        1,
        "the HTTP/2 request reached the worker"
    );
    h.stop().await;
}

#[tokio::test]
async fn the_edge_holds_hosts_underscores_and_encoded_slashes() {
    let worker = CaptureWorker::start(Answer::default()).await;
    let h = harness_with_urls(&[worker.url()], quiet).await;
    let before = worker.heads().len();
    let no_host = format!(
        "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{CHAT}",
        CHAT.len()
    );
    let two_hosts = plain("host: other\r\n");
    for (what, request) in [("no host", no_host), ("two hosts", two_hosts)] {
        let got = exchange(&mut connect(h.gw.addr).await, &request).await;
        assert_eq!(got.status(), 400, "{what}: {}", got.head);
    }
    let got = exchange(
        &mut connect(h.gw.addr).await,
        "GET /v1/models/..%2F..%2Fflush_cache HTTP/1.1\r\nhost: gw\r\n\r\n",
    )
    .await;
    assert_eq!(got.status(), 404, "{}", got.head);
    assert_eq!(
        worker.heads().len(),
        before,
        "refused requests reached the worker"
    );
    let got = exchange(
        &mut connect(h.gw.addr).await,
        &plain("X_Forwarded_For: 10.9.9.9\r\nx_secret_role: admin\r\nx-kept: 1\r\n"),
    )
    .await;
    assert_eq!(got.status(), 200, "{}", got.head);
    let head = worker.heads().pop().unwrap().to_ascii_lowercase();
    assert!(head.contains("x-kept: 1"), "{head}");
    assert!(
        !head.contains("x_forwarded_for") && !head.contains("10.9.9.9"),
        "{head}"
    );
    assert!(!head.contains("x_secret_role"), "{head}");
    h.stop().await;
}

#[tokio::test]
async fn a_streamed_body_cannot_name_its_model_twice() {
    let worker = CaptureWorker::start(Answer::default()).await;
    let h = harness_with_urls(&[worker.url()], |c| {
        quiet(c);
        c.proxy.max_replay_body = 64;
    })
    .await;
    let pad = "x".repeat(200);
    let before = worker.heads().len();
    for body in [
        format!(r#"{{"model":"demo-model","pad":"{pad}","model":"premium"}}"#),
        format!(r#"{{"model":"demo-model","pad":"{pad}","mod\u0065l":"premium"}}"#),
        format!(r#"{{"model":"demo-model","pad":"{pad}"}} trailing"#),
        format!(r#"{{"mod\u0065l":"premium","model":"demo-model","pad":"{pad}"}}"#),
    ] {
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let got = exchange(&mut connect(h.gw.addr).await, &request).await;
        assert_eq!(got.status(), 400, "{body}: {} {}", got.head, got.text());
        assert!(got.text().contains("invalid_request"), "{}", got.text());
    }
    // A whole streamed body that is one object with one model passes.
    let body = format!(r#"{{"model":"demo-model","pad":"{pad}"}}"#);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let got = exchange(&mut connect(h.gw.addr).await, &request).await;
    assert_eq!(got.status(), 200, "{}", got.text());
    assert!(worker.heads().len() > before);
    h.stop().await;
}

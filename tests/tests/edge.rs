//! End-to-end tests of the public edge, as a hostile client meets it: routes
//! that never reach a worker, slow and huge bodies, abandoned uploads,
//! forged forwarding headers, hostile worker answers, cardinality, admin.
//! Wire-level behaviour is driven with raw sockets, every wait is bounded.

use std::time::{Duration, Instant};

use balancer_core::admission::AdmissionConfig;
use balancer_core::breaker::State;
use balancer_mock_worker::Fault;
use balancer_tests::capture::{Answer, CaptureWorker};
use balancer_tests::gateway::{BOUND, CHAT, eventually, harness, harness_with_urls, quiet};
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `head` (and `body`) on a fresh connection; returns the stream.
async fn raw(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s
}

/// Reads until the peer closes (or `BOUND`); returns what arrived.
async fn read_all(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one response head and its status.
async fn status_of(s: &mut TcpStream) -> u16 {
    let mut buf = vec![0u8; 8192];
    let n = tokio::time::timeout(BOUND, s.read(&mut buf))
        .await
        .expect("an answer in time")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn only_inference_and_model_routes_reach_a_worker() {
    let h = harness(&["a"], quiet).await;
    let before = h.workers[0].stats().requests;
    for (method, path) in [
        (Method::GET, "/_mock/stats"),
        (Method::POST, "/_mock/fault"),
        (Method::POST, "/flush_cache"),
        (Method::POST, "/v1/chat%2Fcompletions"),
    ] {
        let r = h.call(h.gw.addr, method, path, "{}", &[]).await;
        assert_eq!(
            (r.status, r.code().as_str()),
            (StatusCode::NOT_FOUND, "not_found"),
            "{path}"
        );
    }
    for method in [Method::PUT, Method::DELETE, Method::TRACE] {
        let r = h
            .call(h.gw.addr, method.clone(), "/v1/chat/completions", CHAT, &[])
            .await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method}");
        // Exactly what the route takes: GET is 405 there too.
        assert_eq!(r.headers["allow"], "POST");
    }
    let r = h
        .call(h.gw.addr, Method::GET, "/v1/chat/completions", "", &[])
        .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.headers["allow"], "POST");
    let r = h
        .call(h.gw.addr, Method::POST, "/v1/models/demo-model", "{}", &[])
        .await;
    assert_eq!(r.headers["allow"], "GET");
    assert_eq!(
        h.workers[0].stats().requests,
        before,
        "the worker saw none of it"
    );
    // A path that normalises to a route is that route.
    let r = h
        .call(
            h.gw.addr,
            Method::POST,
            "//v1/./chat//completions",
            CHAT,
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h.call(h.gw.addr, Method::GET, "/v1/models", "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    h.stop().await;
}

#[tokio::test]
async fn allow_path_adds_a_route() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.proxy.routes = balancer::proxy::Routes::new(&["/_mock/*".to_owned()]);
    })
    .await;
    let r = h
        .call(h.gw.addr, Method::GET, "/_mock/stats", "", &[])
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    h.stop().await;
}

#[tokio::test]
async fn slowloris_connections_are_closed_at_the_header_read_timeout() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.connections.header_read_timeout = Duration::from_secs(1);
    })
    .await;
    let started = Instant::now();
    let mut s = raw(
        h.gw.addr,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n",
        b"",
    )
    .await;
    let got = read_all(&mut s).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "closed after {took:?}: {got:?}"
    );
    h.stop().await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_idle_timeout() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.connections.idle_timeout = Duration::from_secs(1);
    })
    .await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        CHAT.len()
    );
    let mut s = raw(h.gw.addr, &head, CHAT.as_bytes()).await;
    assert_eq!(status_of(&mut s).await, 200);
    let started = Instant::now();
    let rest = read_all(&mut s).await;
    assert!(rest.is_empty(), "{rest}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "closed when idle"
    );
    h.stop().await;
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_holds_no_admission_permit() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.proxy.body_stall_timeout = Duration::from_secs(1);
        c.admission = Some(AdmissionConfig {
            max_concurrent: 1,
            queue_size: 0,
            queue_timeout: Duration::from_secs(1),
        });
    })
    .await;
    let mut stalled = raw(
        h.gw.addr,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n",
        b"{\"model\":",
    )
    .await;
    // While that body stalls, the only permit is free for others.
    let r = h.chat(CHAT).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(status_of(&mut stalled).await, 408);
    assert_eq!(h.breaker(0).failures_total(), 0);
    h.stop().await;
}

#[tokio::test]
async fn oversized_bodies_get_413_and_never_reach_a_worker() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.proxy.max_payload = 1000;
    })
    .await;
    let before = h.workers[0].stats().requests;
    let started = Instant::now();
    let mut s = raw(
        h.gw.addr,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000000\r\n\r\n",
        b"",
    )
    .await;
    assert_eq!(status_of(&mut s).await, 413);
    assert!(started.elapsed() < Duration::from_secs(2), "at once");
    let chunk = format!("7d0\r\n{}\r\n", "x".repeat(2000));
    let mut s = raw(
        h.gw.addr,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n",
        chunk.as_bytes(),
    )
    .await;
    assert_eq!(status_of(&mut s).await, 413);
    assert_eq!(h.workers[0].stats().requests, before);
    h.stop().await;
}

#[tokio::test]
async fn an_abandoned_upload_is_not_charged_to_the_worker() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.breaker.settings.failure_threshold = 1;
        c.proxy.max_replay_body = 1024;
    })
    .await;
    for _ in 0..3 {
        let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n";
        let s = raw(h.gw.addr, head, &vec![b' '; 64 * 1024]).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(s);
    }
    eventually("uploads ended", || {
        std::future::ready(h.gw.registry.fleet().workers[0].inflight() == 0)
    })
    .await;
    let a = h.breaker(0);
    assert_eq!(
        a.failures_total(),
        0,
        "a client's abort is nobody's failure"
    );
    assert_eq!(a.state, State::Closed);
    h.stop().await;
}

#[tokio::test]
async fn forwarded_headers_are_the_gateways_and_connection_named_headers_are_stripped() {
    let worker = CaptureWorker::start(Answer::default()).await;
    let h = harness_with_urls(&[worker.url()], quiet).await;
    let r = h
        .call(
            h.gw.addr,
            Method::POST,
            "/v1/chat/completions",
            CHAT,
            &[
                ("x-forwarded-for", "6.6.6.6"),
                ("connection", "x-secret"),
                ("x-secret", "1"),
                ("proxy-connection", "x-other"),
                ("x-other", "1"),
                ("x-kept", "1"),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let head = worker
        .heads()
        .pop()
        .expect("forwarded")
        .to_ascii_lowercase();
    assert!(head.contains("x-forwarded-for: 127.0.0.1\r\n"), "{head}");
    assert!(head.contains("x-forwarded-proto: http"), "{head}");
    assert!(head.contains("x-kept: 1"), "{head}");
    for gone in ["x-secret", "x-other", "proxy-connection", "6.6.6.6"] {
        assert!(!head.contains(gone), "{gone} in {head}");
    }
    h.stop().await;
}

#[tokio::test]
async fn a_hostile_retry_after_is_clamped_and_error_bodies_name_the_gateways_reason() {
    let worker = CaptureWorker::start(Answer {
        status: 503,
        headers: vec![("retry-after".into(), "1e20".into())],
        body: "{}".into(),
    })
    .await;
    let h = harness_with_urls(&[worker.url()], |c| {
        quiet(c);
        c.proxy.retry.max_attempts = 2;
    })
    .await;
    let r = h.chat(CHAT).await;
    assert_eq!(
        r.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the worker's last answer"
    );
    assert_eq!(worker.heads().len(), 2, "retried after a clamped wait");
    assert_eq!(
        h.chat(CHAT).await.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "still serving"
    );
    h.stop().await;
}

#[tokio::test]
async fn an_unreachable_worker_is_answered_with_the_gateways_reason_only() {
    // Port 1 on loopback: nothing listens, connections are refused.
    let h = harness_with_urls(&["http://127.0.0.1:1".to_owned()], |c| {
        quiet(c);
        c.workers[0].model = Some("demo-model".into());
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    let r = h.chat(CHAT).await;
    assert_eq!(r.code(), "upstream_unreachable", "{}", r.text());
    let text = r.text().to_ascii_lowercase();
    for leak in ["hyper", "error trying", "refused", "os error"] {
        assert!(!text.contains(leak), "{leak} in {text}");
    }
    h.stop().await;
}

#[tokio::test]
async fn model_names_are_bounded_and_invented_ones_add_no_series() {
    let h = harness(&["a"], |c| {
        quiet(c);
        // Invented models reach a worker, and still add no series.
        c.proxy.route_undeclared_models = true;
    })
    .await;
    for i in 0..5 {
        let body = format!(r#"{{"model":"invented-{i}","messages":[]}}"#);
        assert_eq!(h.chat(&body).await.status, StatusCode::OK);
    }
    let m = h.metrics().await;
    assert!(!m.contains("invented-"), "no label per invented model");
    let long = format!(r#"{{"model":"{}","messages":[]}}"#, "m".repeat(300));
    let r = h.chat(&long).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::BAD_REQUEST, "invalid_request")
    );
    // JSON whatever the content type says, leading whitespace included.
    let r = h
        .call(
            h.gw.addr,
            Method::POST,
            "/v1/chat/completions",
            &format!("  \n{CHAT}"),
            &[("content-type", "text/plain")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let r = h
        .call(
            h.gw.addr,
            Method::POST,
            "/v1/chat/completions",
            "model=x",
            &[("content-type", "text/plain")],
        )
        .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::BAD_REQUEST, "invalid_request")
    );
    h.stop().await;
}

#[tokio::test]
async fn at_the_connection_cap_accept_waits() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.connections.max_connections = 1;
    })
    .await;
    let first = TcpStream::connect(h.gw.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        CHAT.len()
    );
    let mut second = raw(h.gw.addr, &head, CHAT.as_bytes()).await;
    let mut buf = [0u8; 64];
    let waited = tokio::time::timeout(Duration::from_millis(500), second.read(&mut buf)).await;
    assert!(waited.is_err(), "no answer while the only slot is taken");
    drop(first);
    assert_eq!(status_of(&mut second).await, 200);
    h.stop().await;
}

#[tokio::test]
async fn worker_credentials_never_show_and_are_sent_to_the_worker() {
    let worker = CaptureWorker::start(Answer::default()).await;
    let url = format!("http://user:s3cret@{}", worker.addr);
    let h = harness_with_urls(&[url], quiet).await;
    assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    let head = worker.heads().pop().unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("authorization: basic dxnlcjpzm2nyzxq="),
        "{head}"
    );
    let shown = format!(
        "{}{}",
        h.metrics().await,
        h.admin(Method::GET, "/workers", "").await.text()
    );
    assert!(
        !shown.contains("s3cret") && !shown.contains("user:"),
        "{shown}"
    );
    h.stop().await;
}

#[tokio::test]
async fn an_admin_delete_completes_when_its_client_leaves() {
    let h = harness(&["a"], quiet).await;
    h.workers[0].set_fault(Fault {
        latency_ms: Some(500),
        ..Fault::default()
    });
    let id = h.gw.registry.fleet().workers[0].id.clone();
    let slow = {
        let body = CHAT.to_owned();
        let addr = h.gw.addr;
        tokio::spawn(async move {
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            let mut s = raw(addr, &head, body.as_bytes()).await;
            status_of(&mut s).await
        })
    };
    eventually("a request in flight on A", || {
        std::future::ready(h.gw.registry.fleet().workers[0].inflight() > 0)
    })
    .await;
    let s = raw(
        h.gw.admin_addr,
        &format!("DELETE /workers/{id} HTTP/1.1\r\nhost: x\r\n\r\n"),
        b"",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(s);
    eventually("A removed", || {
        std::future::ready(h.gw.registry.fleet().get(&id).is_none())
    })
    .await;
    assert_eq!(slow.await.unwrap(), 200, "the drained request finished");
    h.stop().await;
}

#[tokio::test]
async fn a_client_that_stops_reading_is_disconnected_at_the_send_timeout() {
    // A response far larger than the socket buffers between the two.
    let worker = CaptureWorker::start(Answer {
        body: "x".repeat(32 << 20),
        ..Answer::default()
    })
    .await;
    let h = harness_with_urls(&[worker.url()], |c| {
        quiet(c);
        c.connections.send_timeout = Duration::from_secs(1);
    })
    .await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        CHAT.len()
    );
    let mut s = raw(h.gw.addr, &head, CHAT.as_bytes()).await;
    assert_eq!(status_of(&mut s).await, 200);
    // The client reads nothing more, and keeps its socket open.
    eventually("the relay released when the client was cut", || {
        std::future::ready(h.gw.registry.fleet().workers[0].inflight() == 0)
    })
    .await;
    let snapshot = h.gw.registry.fleet().workers[0].breaker.snapshot();
    assert_eq!(snapshot.failures_total(), 0, "the client's doing");
    drop(s);
    h.stop().await;
}

#[tokio::test]
async fn a_worker_answer_past_the_head_bound_is_a_bad_gateway_and_the_next_request_is_served() {
    // 70 KiB of headers: past the 64 KiB the fast path reads of a head.
    let worker = CaptureWorker::start(Answer {
        status: 200,
        headers: vec![("x-huge".into(), "a".repeat(70 * 1024))],
        body: "{}".into(),
    })
    .await;
    let h = harness_with_urls(&[worker.url()], |c| {
        quiet(c);
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    for _ in 0..2 {
        let r = h.chat(CHAT).await;
        assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
        assert_eq!(r.code(), "upstream_unreachable");
    }
    assert_eq!(worker.heads().len(), 2, "each attempt reached the worker");
    h.stop().await;
}

#[tokio::test]
async fn the_gateways_own_endpoints_answer_head_like_get_without_a_body() {
    let h = harness(&["a"], quiet).await;
    for path in ["/health", "/liveness", "/readiness"] {
        let get = h.call(h.gw.addr, Method::GET, path, "", &[]).await;
        let head = h.call(h.gw.addr, Method::HEAD, path, "", &[]).await;
        assert_eq!(head.status, get.status, "{path}");
        assert_eq!(head.status, StatusCode::OK, "{path}");
        assert_eq!(head.headers["content-type"], "application/json", "{path}");
        assert!(head.body.is_empty(), "{path}: {}", head.text());
        let put = h.call(h.gw.addr, Method::PUT, path, "", &[]).await;
        assert_eq!(put.status, StatusCode::METHOD_NOT_ALLOWED, "{path}");
        assert_eq!(put.headers["allow"], "GET, HEAD", "{path}");
    }
    h.stop().await;
}

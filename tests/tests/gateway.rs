//! End-to-end tests of the L7 gateway against demo workers on loopback.
//!
//! Each test starts its own gateway (ports picked by the OS) on a
//! `ManualClock`, so open timeouts move only when a test advances the clock.
//! Health probes are real I/O and are awaited with short, bounded polls.

use std::sync::Arc;
use std::time::{Duration, Instant};

use balancer_core::admission::AdmissionConfig;
use balancer_core::breaker::{FailureReason, State};
use balancer_core::selection::Policy;
use balancer_mock_worker::Fault;
use balancer_tests::gateway::{BOUND, CHAT, STREAM, always, eventually, harness, quiet};
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn failing_worker_opens_after_threshold_failed_requests_then_recovers() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.breaker.settings.failure_threshold = 3;
        c.breaker.settings.success_threshold = 2;
        c.breaker.settings.open_timeout = Duration::from_secs(30);
        c.policy = Policy::RoundRobin;
    })
    .await;
    let base = h.served(0);
    h.workers[0].set_fault(always(500));
    for _ in 0..12 {
        let r = h.chat(CHAT).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "retries hide A's failures: {}",
            r.text()
        );
    }
    let a = h.breaker(0);
    assert_eq!(a.state, State::Open);
    assert_eq!(a.failures_total(), 3, "three failed requests opened it");
    assert_eq!(
        h.served(0) - base,
        3,
        "A saw exactly the three requests that opened it"
    );

    // Open: A receives nothing until the timeout.
    for _ in 0..10 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    assert_eq!(h.served(0) - base, 3);

    // Fixed and past the timeout: half-open, then closed after two successes.
    h.workers[0].clear_fault();
    h.clock.advance(Duration::from_secs(30));
    for _ in 0..6 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    let a = h.breaker(0);
    assert_eq!(a.state, State::Closed);
    assert_eq!(a.transitions[0][1], 1);
    assert_eq!(a.transitions[1][2], 1);
    assert_eq!(a.transitions[2][0], 1);
    assert!(h.served(0) - base > 3);
    let m = h.metrics().await;
    let url = h.workers[0].url();
    assert!(
        m.contains(&format!(
            "balancer_worker_cb_transitions_total{{worker=\"{url}\",from=\"closed\",to=\"open\"}} 1"
        )),
        "{m}"
    );
    h.stop().await;
}

#[tokio::test]
async fn pushback_429_is_retried_elsewhere_and_leaves_the_breaker_alone() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.breaker.settings.failure_threshold = 1;
        c.policy = Policy::RoundRobin;
    })
    .await;
    let base = h.served(0);
    h.workers[0].set_fault(always(429));
    for _ in 0..10 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    assert!(h.served(0) - base >= 5, "A was tried");
    let a = h.breaker(0);
    assert_eq!(a.state, State::Closed);
    assert_eq!(
        (a.successes, a.failures_total(), a.transitions_total()),
        (0, 0, 0)
    );
    let m = h.metrics().await;
    let url = h.workers[0].url();
    assert!(m.contains(&format!(
        "balancer_worker_cb_outcomes_total{{worker=\"{url}\",outcome=\"success\"}} 0"
    )));
    assert!(m.contains(&format!(
        "balancer_worker_cb_outcomes_total{{worker=\"{url}\",outcome=\"failure\"}} 0"
    )));
    h.stop().await;
}

/// The statuses the README says are retried (408, 429, 500, 502, 503, 504)
/// are retried on the other worker; any other status is the client's
/// answer, tried once.
#[tokio::test]
async fn retryable_statuses_are_retried_on_another_worker_and_others_are_returned() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.breaker.settings.failure_threshold = u32::MAX;
        c.policy = Policy::RoundRobin;
    })
    .await;
    const CHATS: u64 = 4;
    for status in [408, 500, 502, 503, 504] {
        h.workers[0].set_fault(always(status));
        let (a, b) = (h.served(0), h.served(1));
        for _ in 0..CHATS {
            assert_eq!(h.chat(CHAT).await.status, StatusCode::OK, "{status}");
        }
        assert!(h.served(0) > a, "{status}: A was tried");
        assert_eq!(h.served(1) - b, CHATS, "{status}: B answered every chat");
    }
    for status in [400, 404, 501] {
        h.workers[0].set_fault(always(status));
        let (a, b) = (h.served(0), h.served(1));
        let mut passed_on = 0;
        for _ in 0..CHATS {
            if h.chat(CHAT).await.status.as_u16() == status {
                passed_on += 1;
            }
        }
        let tried = h.served(0) - a;
        assert!(tried > 0, "{status}: A was tried");
        assert_eq!(passed_on, tried, "{status}: each of A's answers returned");
        assert_eq!(h.served(1) - b, CHATS - tried, "{status}: never retried");
    }
    h.stop().await;
}

#[tokio::test]
async fn client_errors_are_successes_and_no_response_is_a_failure() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.proxy.retry.max_attempts = 1;
        c.proxy.request_timeout = Duration::from_secs(1);
    })
    .await;
    for status in [400, 404] {
        h.workers[0].set_fault(always(status));
        assert_eq!(h.chat(CHAT).await.status.as_u16(), status);
    }
    assert_eq!(h.breaker(0).successes, 2);

    h.workers[0].set_fault(Fault {
        drop: true,
        ..Fault::default()
    });
    let r = h.chat(CHAT).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::BAD_GATEWAY, "upstream_unreachable")
    );
    assert_eq!(h.breaker(0).failures[FailureReason::Connect as usize], 1);

    h.workers[0].set_fault(Fault {
        latency_ms: Some(3000),
        ..Fault::default()
    });
    let r = h.chat(CHAT).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout")
    );
    assert_eq!(h.breaker(0).failures[FailureReason::Timeout as usize], 1);
    h.stop().await;
}

#[tokio::test]
async fn every_breaker_open_means_503_no_available_workers() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.breaker.settings.failure_threshold = 2;
        c.breaker.settings.open_timeout = Duration::from_secs(45);
    })
    .await;
    h.workers[0].set_fault(always(500));
    h.workers[1].set_fault(always(503));
    let mut last = None;
    for _ in 0..4 {
        let r = h.chat(CHAT).await;
        if r.code() == "no_available_workers" {
            last = Some(r);
            break;
        }
    }
    let r = last.expect("all breakers open within four requests");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h.breaker(0).state, State::Open);
    assert_eq!(h.breaker(1).state, State::Open);

    let before = (h.served(0), h.served(1), h.breaker(0), h.breaker(1));
    let r = h.chat(CHAT).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "no_available_workers")
    );
    let retry_after: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=45).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(
        (h.served(0), h.served(1), h.breaker(0), h.breaker(1)),
        before,
        "the shed recorded nothing"
    );
    h.stop().await;
}

#[tokio::test]
async fn health_gate_and_promotion_readmit_an_open_breaker_at_once() {
    let h = harness(&["a", "b"], |c| {
        c.health_check.interval = Duration::from_secs(1);
        c.health.failure = 1;
        c.health.success = 1;
        c.breaker.settings.failure_threshold = 2;
        c.breaker.settings.open_timeout = Duration::from_secs(600);
        c.policy = Policy::RoundRobin;
        c.proxy.retry.initial_backoff = Duration::from_millis(1);
        c.proxy.retry.max_backoff = Duration::from_millis(5);
    })
    .await;
    let worker_a =
        h.gw.registry
            .fleet()
            .get(&h.workers[0].url())
            .unwrap()
            .clone();

    // Failing health takes A out of routing, whatever its breaker says.
    h.workers[0].set_fault(Fault {
        health_status: Some(503),
        ..Fault::default()
    });
    eventually("A demoted", || {
        std::future::ready(worker_a.health() == balancer_core::health::Health::NotReady)
    })
    .await;
    let served = h.served(0);
    for _ in 0..6 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    assert_eq!(h.served(0), served, "a NotReady worker gets no traffic");

    // Back to Ready, then open A's breaker through real failures.
    h.workers[0].clear_fault();
    eventually("A promoted", || {
        std::future::ready(worker_a.health() == balancer_core::health::Health::Ready)
    })
    .await;
    h.workers[0].set_fault(always(500));
    for _ in 0..6 {
        h.chat(CHAT).await;
    }
    assert_eq!(h.breaker(0).state, State::Open);
    assert_eq!(
        h.breaker(0).health_readmissions,
        0,
        "the first promotion found a closed circuit"
    );

    // An outage and a recovery: the promotion puts the open breaker on trial
    // without the 600 s timeout (the clock never moves in this test).
    h.workers[0].set_fault(Fault {
        status: Some(500),
        health_status: Some(503),
        ..Fault::default()
    });
    eventually("A demoted again", || {
        std::future::ready(worker_a.health() == balancer_core::health::Health::NotReady)
    })
    .await;
    h.workers[0].clear_fault();
    eventually("A promoted again", || {
        std::future::ready(worker_a.health() == balancer_core::health::Health::Ready)
    })
    .await;
    let a = h.breaker(0);
    assert_eq!(a.state, State::HalfOpen);
    assert_eq!(a.health_readmissions, 1);
    let m = h.metrics().await;
    let url = h.workers[0].url();
    assert!(
        m.contains(&format!(
            "balancer_worker_cb_health_readmissions_total{{worker=\"{url}\"}} 1"
        )),
        "{m}"
    );
    h.stop().await;
}

fn strip_volatile(body: &str) -> String {
    // The mock stamps `created` with the wall clock and numbers its ids.
    body.split(',')
        .filter(|part| !part.contains("\"created\"") && !part.contains("\"id\""))
        .collect::<Vec<_>>()
        .join(",")
}

#[tokio::test]
async fn streams_are_relayed_as_sent() {
    let h = harness(&["a"], |c| {
        quiet(c);
    })
    .await;
    let direct = h
        .call(
            h.workers[0].addr(),
            Method::POST,
            "/v1/chat/completions",
            STREAM,
            &[],
        )
        .await;
    let through = h.chat(STREAM).await;
    assert_eq!(through.status, StatusCode::OK);
    assert_eq!(
        through.headers["content-type"],
        direct.headers["content-type"]
    );
    assert_eq!(
        strip_volatile(&through.text()),
        strip_volatile(&direct.text())
    );
    assert!(through.text().ends_with("data: [DONE]\n\n"));
    assert_eq!(h.breaker(0).successes, 1);
    h.stop().await;
}

#[tokio::test]
async fn a_stalled_2xx_stream_ends_with_an_sse_error_and_is_charged_only_with_cb_stream_failures() {
    for stream_failures in [false, true] {
        let h = harness(&["a"], |c| {
            quiet(c);
            c.proxy.stream_idle_timeout = Duration::from_secs(1);
            c.proxy.retry.max_attempts = 1;
            c.breaker.stream_failures = stream_failures;
        })
        .await;
        h.workers[0].set_fault(Fault {
            stall_after_chunks: Some(2),
            ..Fault::default()
        });
        let started = Instant::now();
        let r = h.chat(STREAM).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "cut within the idle timeout"
        );
        let text = r.text();
        assert_eq!(text.matches("data: {\"id\"").count(), 2, "{text}");
        assert!(text.contains("event: error"), "{text}");
        assert!(text.contains("upstream_stream_stalled"), "{text}");
        assert!(
            !text.contains("[DONE]"),
            "a cut stream never looks complete"
        );
        let a = h.breaker(0);
        if stream_failures {
            assert_eq!(a.failures[FailureReason::Stall as usize], 1);
            assert_eq!(a.successes, 0);
        } else {
            assert_eq!(a.failures_total(), 0, "the status decides: 200");
            assert_eq!(a.successes, 1);
        }
        h.stop().await;
    }
}

#[tokio::test]
async fn a_truncated_2xx_stream_is_charged_as_broken_only_with_cb_stream_failures() {
    for stream_failures in [false, true] {
        let h = harness(&["a"], |c| {
            quiet(c);
            c.proxy.retry.max_attempts = 1;
            c.breaker.stream_failures = stream_failures;
        })
        .await;
        h.workers[0].set_fault(Fault {
            truncate_after_chunks: Some(2),
            ..Fault::default()
        });
        let text = h.chat(STREAM).await.text();
        assert!(text.contains("upstream_stream_broken"), "{text}");
        assert!(!text.contains("[DONE]"), "{text}");
        let a = h.breaker(0);
        let broken = a.failures[FailureReason::Broken as usize];
        assert_eq!(
            (broken, a.successes),
            if stream_failures { (1, 0) } else { (0, 1) }
        );
        h.stop().await;
    }
}

#[tokio::test]
async fn clients_that_leave_before_the_answer_leak_no_half_open_slot() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.proxy.retry.max_attempts = 1;
        c.breaker.settings.failure_threshold = 1;
        c.breaker.settings.success_threshold = 1;
        c.breaker.settings.half_open_max_inflight = 1;
    })
    .await;
    h.workers[0].set_fault(always(500));
    h.chat(CHAT).await;
    assert_eq!(h.breaker(0).state, State::Open);
    h.clock.advance(Duration::from_secs(60));
    h.workers[0].set_fault(Fault {
        latency_ms: Some(5_000),
        ..Fault::default()
    });
    for round in 0..3 {
        let mut s = tokio::net::TcpStream::connect(h.gw.addr).await.unwrap();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHAT}",
            CHAT.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        eventually("the trial request holds the only slot", || {
            std::future::ready(h.breaker(0).half_open_inflight == 1)
        })
        .await;
        // The client leaves before the worker answers.
        drop(s);
        eventually("the slot comes back", || {
            std::future::ready(h.breaker(0).half_open_inflight == 0)
        })
        .await;
        let a = h.breaker(0);
        assert_eq!(a.state, State::HalfOpen, "round {round}");
        assert_eq!((a.successes, a.failures_total()), (0, 1), "nothing charged");
    }
    h.workers[0].clear_fault();
    let r = h.chat(CHAT).await;
    assert_eq!(r.status, StatusCode::OK, "the trial still admits");
    assert_eq!(h.breaker(0).state, State::Closed);
    h.stop().await;
}

#[tokio::test]
async fn a_client_disconnect_closes_the_upstream_connection() {
    let h = harness(&["a"], |c| {
        quiet(c);
    })
    .await;
    h.workers[0].set_fault(Fault {
        token_delay_ms: Some(100),
        ..Fault::default()
    });
    let body = r#"{"model":"demo-model","stream":true,"max_tokens":200,"messages":[]}"#;
    // The prober's pooled keep-alive connection may still be open.
    let base = h.workers[0].stats().open_connections;
    let mut s = tokio::net::TcpStream::connect(h.gw.addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(BOUND, s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    eventually("upstream connection open", || {
        std::future::ready(h.workers[0].stats().open_connections > base)
    })
    .await;
    drop(s);
    eventually("upstream connection closed", || {
        std::future::ready(h.workers[0].stats().open_connections == base)
    })
    .await;
    let a = h.breaker(0);
    assert_eq!(
        (a.successes, a.failures_total()),
        (0, 0),
        "a departed client is nobody's failure"
    );
    h.stop().await;
}

#[tokio::test]
async fn admission_sheds_the_fourth_concurrent_request_with_429() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.admission = Some(AdmissionConfig {
            max_concurrent: 2,
            queue_size: 1,
            queue_timeout: Duration::from_secs(60),
        });
    })
    .await;
    h.workers[0].set_fault(Fault {
        latency_ms: Some(1500),
        ..Fault::default()
    });
    let h = Arc::new(h);
    let mut running = Vec::new();
    for _ in 0..3 {
        let h = h.clone();
        running.push(tokio::spawn(async move { h.chat(CHAT).await.status }));
    }
    eventually("two admitted, one queued", || {
        let s = h.gw.proxy.admission().unwrap().stats();
        std::future::ready(s.inflight == 2 && s.queued == 1)
    })
    .await;
    let r = h.chat(CHAT).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "admission_queue_full")
    );
    assert!(r.headers.contains_key("retry-after"));
    for t in running {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    let a = h.breaker(0);
    assert_eq!(
        (a.successes, a.failures_total()),
        (3, 0),
        "the shed touched no breaker"
    );
    Arc::into_inner(h).unwrap().stop().await;
}

#[tokio::test]
async fn a_request_queued_past_the_queue_timeout_gets_503_and_never_reaches_a_worker() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.admission = Some(AdmissionConfig {
            max_concurrent: 1,
            queue_size: 1,
            queue_timeout: Duration::from_millis(200),
        });
    })
    .await;
    h.workers[0].set_fault(Fault {
        latency_ms: Some(1500),
        ..Fault::default()
    });
    let h = Arc::new(h);
    let running = {
        let h = h.clone();
        tokio::spawn(async move { h.chat(CHAT).await.status })
    };
    eventually("one admitted", || {
        std::future::ready(h.gw.proxy.admission().unwrap().stats().inflight == 1)
    })
    .await;
    let served = h.served(0);
    let waited = Instant::now();
    let r = h.chat(CHAT).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "admission_queue_timeout")
    );
    assert!(r.headers.contains_key("retry-after"));
    let waited = waited.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_millis(1400),
        "shed after {waited:?}, not at the queue timeout"
    );
    assert_eq!(running.await.unwrap(), StatusCode::OK);
    assert_eq!(h.served(0), served, "the shed request reached no worker");
    let a = h.breaker(0);
    assert_eq!(
        (a.successes, a.failures_total()),
        (1, 0),
        "no breaker charged"
    );
    Arc::into_inner(h).unwrap().stop().await;
}

#[tokio::test]
async fn malformed_json_gets_400_and_records_nothing() {
    let h = harness(&["a"], |c| {
        quiet(c);
    })
    .await;
    let base = h.served(0);
    let r = h.chat("{not json").await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::BAD_REQUEST, "invalid_request")
    );
    assert_eq!(h.served(0), base);
    assert_eq!(h.breaker(0).successes, 0);
    h.stop().await;
}

#[tokio::test]
async fn admin_api_adds_inspects_overrides_and_drains() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
    })
    .await;
    // Start with only A registered; B is added through the API.
    let b_url = h.workers[1].url();
    let b = h.gw.registry.fleet().get(&b_url).unwrap().clone();
    h.gw.registry.remove(&b);

    let bad = [
        r#"{"url":"http://127.0.0.1:1","resilience":{"cb_failure_threshold":0}}"#,
        r#"{"url":"ftp://nowhere"}"#,
        r#"{"url":"http://127.0.0.1:1","colour":"red"}"#,
        r#"{"url":"#,
    ];
    for body in bad {
        let r = h.admin(Method::POST, "/workers", body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text());
    }
    assert_eq!(
        h.gw.registry.fleet().workers.len(),
        1,
        "rejected bodies changed nothing"
    );

    let spec = format!(
        r#"{{"url":"{b_url}","model":"demo-model","labels":{{"gpu":"h100"}},"resilience":{{"cb_failure_threshold":1}}}}"#
    );
    let r = h.admin(Method::POST, "/workers", &spec).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(r.json()["effective"]["cb_failure_threshold"], 1);
    let dup = h.admin(Method::POST, "/workers", &spec).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);

    let list = h.admin(Method::GET, "/workers", "").await.json();
    assert_eq!(list["workers"].as_array().unwrap().len(), 2);

    let r = h
        .admin(
            Method::PATCH,
            &format!("/workers/{id}"),
            r#"{"resilience":{"capacity_status_codes":[429,503]}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(
        r.json()["effective"]["capacity_status_codes"],
        serde_json::json!([429, 503])
    );
    assert_eq!(
        r.json()["effective"]["cb_failure_threshold"],
        1,
        "earlier override kept"
    );
    let r = h
        .admin(
            Method::PATCH,
            &format!("/workers/{id}"),
            r#"{"resilience":{"cb_timeout_secs":0}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["param"], "resilience.cb_timeout_secs");
    let view = h
        .admin(Method::GET, &format!("/workers/{id}"), "")
        .await
        .json();
    assert_eq!(
        view["resilience"],
        serde_json::json!({"capacity_status_codes":[429,503],"cb_failure_threshold":1})
    );

    // 503 is now pushback for B: it records nothing and does not open.
    h.workers[1].set_fault(always(503));
    h.workers[0].set_fault(always(404));
    for _ in 0..4 {
        h.chat(CHAT).await;
    }
    let view = h
        .admin(Method::GET, &format!("/workers/{id}"), "")
        .await
        .json();
    assert_eq!(view["breaker"]["state"], "closed");
    assert_eq!(view["breaker"]["failures"]["status"], 0);

    // Delete drains: a slow request in flight on B finishes first.
    h.workers[0].set_fault(always(500));
    h.workers[1].set_fault(Fault {
        latency_ms: Some(700),
        ..Fault::default()
    });
    let h = Arc::new(h);
    let slow = {
        let h = h.clone();
        tokio::spawn(async move {
            h.call(h.gw.addr, Method::POST, "/v1/chat/completions", CHAT, &[])
                .await
                .status
        })
    };
    let worker_b = h.gw.registry.fleet().get(&id).unwrap().clone();
    eventually("request in flight on B", || {
        std::future::ready(worker_b.inflight() == 1)
    })
    .await;
    let r = h.admin(Method::DELETE, &format!("/workers/{id}"), "").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json()["abandoned_inflight"], 0);
    assert_eq!(
        slow.await.unwrap(),
        StatusCode::OK,
        "the in-flight request finished"
    );
    assert_eq!(
        h.admin(Method::GET, &format!("/workers/{id}"), "")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    let m = h.metrics().await;
    assert!(
        m.contains(&format!(
            "balancer_worker_cb_state{{worker=\"{b_url}\"}} -1"
        )),
        "{m}"
    );
    Arc::into_inner(h).unwrap().stop().await;
}

#[tokio::test]
async fn admin_token_is_required_when_set() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.admin_token = Some("s3cret".to_owned());
    })
    .await;
    let r = h.admin(Method::GET, "/workers", "").await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    let r = h
        .call(
            h.gw.admin_addr,
            Method::GET,
            "/workers",
            "",
            &[("authorization", "Bearer s3cret")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    h.stop().await;
}

#[tokio::test]
async fn metrics_prefix_smg_gives_the_reference_names() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.metrics_prefix = "smg".to_owned();
    })
    .await;
    h.chat(CHAT).await;
    let m = h.metrics().await;
    let url = h.workers[0].url();
    for series in [
        format!("smg_worker_cb_state{{worker=\"{url}\"}} 0"),
        format!("smg_worker_cb_outcomes_total{{worker=\"{url}\",outcome=\"success\"}} 1"),
        format!("smg_worker_cb_consecutive_failures{{worker=\"{url}\"}} 0"),
        format!("smg_worker_cb_consecutive_successes{{worker=\"{url}\"}} 1"),
        format!("smg_worker_cb_health_readmissions_total{{worker=\"{url}\"}} 0"),
    ] {
        assert!(m.contains(&series), "missing {series}\n{m}");
    }
    assert!(!m.contains("balancer_"), "every name carries the prefix");
    h.stop().await;
}

#[tokio::test]
async fn readiness_reflects_routable_workers() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.breaker.settings.failure_threshold = 1;
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    let ready = h.call(h.gw.addr, Method::GET, "/readiness", "", &[]).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(
        ready.json(),
        serde_json::json!({"status":"ready","healthy_workers":1,"total_workers":1})
    );
    h.workers[0].set_fault(always(500));
    h.chat(CHAT).await;
    let r = h.call(h.gw.addr, Method::GET, "/readiness", "", &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        h.call(h.gw.addr, Method::GET, "/liveness", "", &[])
            .await
            .status,
        StatusCode::OK
    );
    h.stop().await;
}

#[tokio::test]
async fn a_body_over_the_replay_limit_gets_a_single_attempt() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.proxy.max_replay_body = 64;
        c.policy = Policy::RoundRobin;
    })
    .await;
    let (a0, b0) = (h.served(0), h.served(1));
    h.workers[0].set_fault(always(500));
    h.workers[1].set_fault(always(500));
    let big = format!(
        r#"{{"model":"demo-model","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(4096)
    );
    let r = h.chat(&big).await;
    assert_eq!(
        r.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "no retry: the worker's answer"
    );
    assert_eq!(
        h.served(0) - a0 + h.served(1) - b0,
        1,
        "exactly one attempt"
    );
    // A small body is kept and retried on the other worker.
    h.workers[1].clear_fault();
    let r = h.chat(CHAT).await;
    assert_eq!(r.status, StatusCode::OK);
    h.stop().await;
}

#[tokio::test]
async fn worker_retry_after_sets_the_wait_before_the_next_attempt() {
    let h = harness(&["a"], |c| {
        c.proxy.retry.initial_backoff = Duration::from_millis(1);
        c.proxy.retry.max_backoff = Duration::from_millis(5000);
        c.health_check.enabled = false;
    })
    .await;
    h.workers[0].set_fault(Fault {
        status: Some(503),
        count: Some(1),
        retry_after: Some(1),
        ..Fault::default()
    });
    let started = Instant::now();
    let r = h.chat(CHAT).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "the retry after the pushback succeeded"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited for Retry-After"
    );
    h.stop().await;
}

#[tokio::test]
async fn shutdown_lets_in_flight_requests_finish() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.shutdown_grace = Duration::from_secs(5);
    })
    .await;
    h.workers[0].set_fault(Fault {
        latency_ms: Some(600),
        ..Fault::default()
    });
    // A raw connection, so the harness itself can be taken apart below.
    let addr = h.gw.addr;
    let inflight = tokio::spawn(async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{CHAT}",
            CHAT.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut response = String::new();
        s.read_to_string(&mut response).await.unwrap();
        response
    });
    let worker = h.gw.registry.fleet().workers[0].clone();
    eventually("request in flight", || {
        std::future::ready(worker.inflight() == 1)
    })
    .await;
    let (gw, workers) = (h.gw, h.workers);
    let stopping = tokio::spawn(gw.shutdown());
    let response = inflight.await.unwrap();
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "finished during shutdown: {response}"
    );
    assert!(response.contains("chat.completion"));
    tokio::time::timeout(BOUND, stopping)
        .await
        .unwrap()
        .unwrap();
    for w in workers {
        w.shutdown().await;
    }
}

/// The worker's own headers reach the client on both server paths: the
/// fast path writes the fields as they came, hyper (here for HTTP/1.0)
/// gets them merged into its map. Hop-by-hop ones and the worker's `Date`
/// stay behind; the gateway dates the answer itself.
#[tokio::test]
async fn the_workers_headers_reach_the_client_on_both_server_paths() {
    let h = harness(&["a"], quiet).await;
    for version in ["HTTP/1.1", "HTTP/1.0"] {
        let mut s = tokio::net::TcpStream::connect(h.gw.addr).await.unwrap();
        let req = format!(
            "POST /v1/chat/completions {version}\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{CHAT}",
            CHAT.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(BOUND, s.read_to_end(&mut answer))
            .await
            .expect("the answer within the bound")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer).to_ascii_lowercase();
        let head = answer.split("\r\n\r\n").next().unwrap();
        assert!(head.contains(" 200 "), "{version}: {head}");
        assert!(
            head.contains("\r\nx-mock-worker: a\r\n"),
            "{version}: {head}"
        );
        assert!(
            head.contains("\r\ncontent-type: application/json"),
            "{version}: {head}"
        );
        assert_eq!(head.matches("\r\ndate: ").count(), 1, "{version}: {head}");
        assert_eq!(
            head.matches("\r\ncontent-length: ").count(),
            1,
            "{version}: {head}"
        );
    }
    h.stop().await;
}

//! End-to-end tests of the load the workers report: the gateway scrapes the
//! demo workers' vLLM-named `/metrics`, sheds from a worker whose queue is
//! past `--worker-overload-waiting-requests`, and a scrape that fails only
//! moves the worker's load back to the gateway's in-flight count, three
//! intervals later on the gateway's manual clock, never its breaker.

use std::net::SocketAddr;
use std::time::Duration;

use balancer_core::breaker::State;
use balancer_core::clock::Clock;
use balancer_core::selection::Policy;
use balancer_mock_worker::{EngineConfig, Fault, MockWorker, MockWorkerConfig};
use balancer_tests::capture::{Answer, CaptureWorker};
use balancer_tests::gateway::{CHAT, Harness, eventually, harness_with_urls, quiet};
use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Fast enough that a test sees reports within a few polls; the freshness of
/// a report is judged on the gateway's manual clock, which only the test moves.
const INTERVAL: Duration = Duration::from_millis(50);

async fn workers(engines: &[EngineConfig]) -> Vec<MockWorker> {
    let mut out = Vec::new();
    for (i, engine) in engines.iter().enumerate() {
        let config = MockWorkerConfig {
            engine: *engine,
            ..MockWorkerConfig::named(format!("w{i}"))
        };
        out.push(
            MockWorker::spawn(SocketAddr::from(([127, 0, 0, 1], 0)), config)
                .await
                .expect("mock worker"),
        );
    }
    out
}

fn metric(text: &str, name: &str, url: &str, extra: &str) -> Option<f64> {
    let prefix = format!("balancer_{name}{{worker=\"{url}\"{extra}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.parse().unwrap())
}

fn now(h: &Harness) -> u64 {
    h.clock.now()
}

#[tokio::test]
async fn an_overloaded_worker_sheds_to_another_without_a_failure() {
    // Worker 0 computes one request at a time; worker 1 has no queue.
    let one_slot = EngineConfig {
        slots: 1,
        ..EngineConfig::default()
    };
    let ws = workers(&[one_slot, EngineConfig::default()]).await;
    let urls: Vec<String> = ws.iter().map(MockWorker::url).collect();
    let mut h = harness_with_urls(&urls, |c| {
        quiet(c);
        c.policy = Policy::RoundRobin;
        c.load_monitor.interval = Some(INTERVAL);
        c.load_monitor.overload_waiting = Some(1);
    })
    .await;
    h.workers = ws;

    // Four answers of a second each sent to worker 0 directly (another
    // gateway's traffic, say): one runs, three wait, and more than one waits
    // for two seconds.
    h.workers[0].set_fault(Fault {
        token_delay_ms: Some(10),
        ..Fault::default()
    });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body =
        r#"{"model":"demo-model","max_tokens":100,"messages":[{"role":"user","content":"long"}]}"#;
    let mut busy = Vec::new();
    for _ in 0..4 {
        let request = http::Request::post(format!("{}/v1/chat/completions", urls[0]))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        let client = client.clone();
        busy.push(tokio::spawn(async move { client.request(request).await }));
    }
    let fleet = h.gw.registry.fleet();
    let loaded = fleet.workers[0].clone();
    eventually("worker 0 reports three waiting", || {
        std::future::ready(
            loaded
                .reported_load(now(&h))
                .is_some_and(|l| l.waiting == 3),
        )
    })
    .await;
    assert!(loaded.is_overloaded(&*h.clock));
    assert_eq!(loaded.load(now(&h)), 4, "waiting plus running");

    let before = (h.served(0), h.served(1));
    for _ in 0..10 {
        let r = h.chat(CHAT).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    }
    assert_eq!(h.served(0), before.0, "the overloaded worker got nothing");
    assert_eq!(h.served(1), before.1 + 10);
    let snapshot = h.breaker(0);
    assert_eq!(snapshot.state, State::Closed);
    assert_eq!(snapshot.failures_total(), 0, "a shed is no failure");

    let m = h.metrics().await;
    let sheds = metric(&m, "worker_overload_sheds_total", &urls[0], "").unwrap();
    // Round robin offered worker 0 every other request.
    assert!(sheds >= 4.0, "{sheds}\n{m}");
    let waiting = metric(&m, "worker_reported_requests_waiting", &urls[0], "").unwrap();
    assert!((2.0..=3.0).contains(&waiting), "{waiting}");
    assert_eq!(
        metric(&m, "worker_reported_requests_running", &urls[0], ""),
        Some(1.0)
    );
    assert_eq!(metric(&m, "worker_load_reported", &urls[0], ""), Some(1.0));

    // The queue drains: worker 0 takes requests again.
    h.workers[0].clear_fault();
    eventually("worker 0's queue drained", || {
        std::future::ready(
            loaded
                .reported_load(now(&h))
                .is_some_and(|l| l.waiting == 0),
        )
    })
    .await;
    for _ in 0..4 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    assert!(h.served(0) > before.0, "back in rotation");
    for task in busy {
        task.abort();
    }
    h.stop().await;
}

#[tokio::test]
async fn a_worker_whose_scrapes_fail_keeps_its_report_three_intervals_then_only_the_load_source_changes()
 {
    let ws = workers(&[EngineConfig::default(), EngineConfig::default()]).await;
    let urls: Vec<String> = ws.iter().map(MockWorker::url).collect();
    let mut h = harness_with_urls(&urls, |c| {
        quiet(c);
        c.policy = Policy::RoundRobin;
        c.load_monitor.interval = Some(INTERVAL);
    })
    .await;
    h.workers = ws;
    let fleet = h.gw.registry.fleet();
    let gone = fleet.workers[0].clone();
    eventually("worker 0 reports", || {
        std::future::ready(gone.reported_load(now(&h)).is_some())
    })
    .await;

    // Its /metrics stops answering (the whole worker is gone; no request is
    // sent to it, so only the scrapes can tell).
    let stopped = h.workers.remove(0);
    stopped.shutdown().await;
    let errors = |m: &str| {
        metric(
            m,
            "worker_load_scrapes_total",
            &urls[0],
            ",outcome=\"error\"",
        )
    };
    let base = errors(&h.metrics().await).unwrap();
    eventually("failed scrapes counted", || async {
        errors(&h.metrics().await).unwrap() >= base + 3.0
    })
    .await;
    // Within three intervals of the last good scrape, the last value holds.
    h.clock.advance(INTERVAL * 3);
    assert!(
        gone.reported_load(now(&h)).is_some(),
        "kept three intervals"
    );
    h.clock.advance(Duration::from_millis(1));
    assert_eq!(gone.reported_load(now(&h)), None, "then dropped");
    assert_eq!(gone.load(now(&h)), gone.inflight(), "the gateway's count");

    let snapshot = gone.breaker.snapshot();
    assert_eq!(snapshot.state, State::Closed, "scrapes never charge it");
    assert_eq!(snapshot.failures_total(), 0);
    assert_eq!(snapshot.successes, 0);
    let m = h.metrics().await;
    assert_eq!(metric(&m, "worker_load_reported", &urls[0], ""), Some(0.0));
    assert_eq!(
        metric(&m, "worker_reported_requests_waiting", &urls[0], ""),
        None,
        "a stale value is not shown as current"
    );
    // The clock moved for every worker: the one still answering is fresh
    // again at its next scrape.
    eventually("worker 1 reports again", || async {
        metric(&h.metrics().await, "worker_load_reported", &urls[1], "") == Some(1.0)
    })
    .await;
    h.stop().await;
}

#[tokio::test]
async fn a_worker_that_serves_but_whose_metrics_are_malformed_is_served_on_the_gateways_count() {
    // Answers every request, `/metrics` included, with `{}`: a 200 that is no
    // Prometheus text.
    let worker = CaptureWorker::start(Answer::default()).await;
    // Answers with 2 MiB: past the scrape's 1 MiB bound.
    let huge = CaptureWorker::start(Answer {
        body: "x".repeat(2 << 20),
        ..Answer::default()
    })
    .await;
    let h = harness_with_urls(&[worker.url(), huge.url()], |c| {
        quiet(c);
        c.load_monitor.interval = Some(INTERVAL);
    })
    .await;
    let url = h.gw.registry.fleet().workers[0].url.to_string();
    let huge_url = h.gw.registry.fleet().workers[1].url.to_string();
    let errors =
        |m: &str, url: &str| metric(m, "worker_load_scrapes_total", url, ",outcome=\"error\"");
    eventually("failed scrapes counted", || async {
        let m = h.metrics().await;
        errors(&m, &url).unwrap() >= 2.0 && errors(&m, &huge_url).unwrap() >= 2.0
    })
    .await;
    let m = h.metrics().await;
    assert_eq!(
        metric(
            &m,
            "worker_load_scrapes_total",
            &huge_url,
            ",outcome=\"ok\""
        ),
        Some(0.0),
        "an oversized page is a failed read"
    );
    // The first worker serves; the other is left out of rotation below by
    // draining it, so that only the first takes the requests.
    h.gw.registry.drain(&huge_url).unwrap();
    for _ in 0..5 {
        let r = h.chat(CHAT).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    }
    let w = h.gw.registry.fleet().workers[0].clone();
    assert_eq!(w.reported_load(now(&h)), None);
    let snapshot = w.breaker.snapshot();
    assert_eq!((snapshot.successes, snapshot.failures_total()), (5, 0));
    let m = h.metrics().await;
    assert_eq!(metric(&m, "worker_load_reported", &url, ""), Some(0.0));
    assert_eq!(
        metric(&m, "worker_load_scrapes_total", &url, ",outcome=\"ok\""),
        Some(0.0)
    );
    h.stop().await;
}

#[tokio::test]
async fn a_worker_that_never_answers_its_metrics_times_out_without_a_breaker_charge() {
    // Accepts connections and answers nothing: every scrape runs into the
    // interval's bound.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let h = balancer_tests::gateway::harness_unprobed(std::slice::from_ref(&url), |c| {
        quiet(c);
        c.load_monitor.interval = Some(INTERVAL);
    })
    .await;
    let timeouts = |m: &str| metric(m, "worker_load_scrapes_total", &url, ",outcome=\"timeout\"");
    eventually("timed-out scrapes counted", || async {
        timeouts(&h.metrics().await).unwrap() >= 2.0
    })
    .await;
    let w = h.gw.registry.fleet().workers[0].clone();
    assert_eq!(w.reported_load(now(&h)), None);
    let snapshot = w.breaker.snapshot();
    assert_eq!(snapshot.state, State::Closed);
    assert_eq!(
        (snapshot.successes, snapshot.failures_total()),
        (0, 0),
        "scrapes record nothing"
    );
    h.stop().await;
    silent.abort();
}

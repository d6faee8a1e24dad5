//! End-to-end tests of the admin API as an operator meets it: a body of the
//! wrong shape is refused naming the field, and a worker added at run time
//! takes no traffic, and is not reported ready, before a probe says so.

use std::net::SocketAddr;
use std::time::Duration;

use balancer_mock_worker::{Fault, MockWorker, MockWorkerConfig};
use balancer_tests::gateway::{CHAT, Harness, eventually, harness, quiet};
use http::{Method, StatusCode};

/// The admin's answer to a body it refuses: its `param`, after checking
/// the status and that the message names the field too.
async fn refused(h: &Harness, method: Method, path: &str, body: &str) -> String {
    let r = h.admin(method, path, body).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text());
    let error = &r.json()["error"];
    let param = error["param"].as_str().unwrap_or_default().to_owned();
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        !param.is_empty() && message.contains(&param),
        "{body}: {}",
        r.text()
    );
    param
}

#[tokio::test]
async fn a_value_of_the_wrong_type_is_refused_naming_its_field() {
    let h = harness(&["a"], quiet).await;
    let id = h.gw.registry.fleet().workers[0].id.clone();
    assert_eq!(
        refused(&h, Method::POST, "/workers", r#"{"url":5}"#).await,
        "url"
    );
    let nested = r#"{"url":"http://127.0.0.1:1","resilience":{"cb_failure_threshold":"three"}}"#;
    assert_eq!(
        refused(&h, Method::POST, "/workers", nested).await,
        "resilience.cb_failure_threshold"
    );
    let patch = r#"{"resilience":{"cb_timeout_secs":"soon"}}"#;
    assert_eq!(
        refused(&h, Method::PATCH, &format!("/workers/{id}"), patch).await,
        "resilience.cb_timeout_secs"
    );
    assert_eq!(h.gw.registry.fleet().workers.len(), 1, "nothing was added");
    h.stop().await;
}

async fn worker(name: &str) -> MockWorker {
    MockWorker::spawn(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        MockWorkerConfig::named(name),
    )
    .await
    .expect("mock worker")
}

/// `health` of the worker `id` as the admin API shows it.
async fn health(h: &Harness, id: &str) -> String {
    let view = h.admin(Method::GET, &format!("/workers/{id}"), "").await;
    view.json()["health"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn a_worker_added_at_run_time_is_not_ready_until_a_probe_passes() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.health_check.enabled = true;
        // One probe per worker within the test: the first is what counts.
        c.health_check.interval = Duration::from_secs(3600);
        c.health.success = 3;
    })
    .await;

    let sick = worker("sick").await;
    sick.set_fault(Fault {
        health_status: Some(503),
        ..Fault::default()
    });
    let body = format!(r#"{{"url":"{}"}}"#, sick.url());
    let added = h.admin(Method::POST, "/workers", &body).await;
    assert_eq!(added.status, StatusCode::CREATED, "{}", added.text());
    assert_eq!(added.json()["health"], "not_ready", "before any probe");
    let sick_id = added.json()["id"].as_str().unwrap().to_owned();
    eventually("the sick worker probed", || {
        std::future::ready(sick.stats().health_checks > 0)
    })
    .await;
    assert_eq!(health(&h, &sick_id).await, "not_ready");
    // Its `/v1/models` was asked for: that counts under /v1/ too.
    let before = sick.stats().inference_requests;
    for _ in 0..6 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    assert_eq!(
        sick.stats().inference_requests,
        before,
        "no traffic before a passing probe"
    );

    let fresh = worker("fresh").await;
    let body = format!(r#"{{"url":"{}"}}"#, fresh.url());
    let added = h.admin(Method::POST, "/workers", &body).await;
    assert_eq!(added.status, StatusCode::CREATED, "{}", added.text());
    let fresh_id = added.json()["id"].as_str().unwrap().to_owned();
    // One passing probe promotes it, whatever --health-success-threshold.
    eventually("the fresh worker ready", || async {
        health(&h, &fresh_id).await == "ready"
    })
    .await;
    let before = fresh.stats().inference_requests;
    for _ in 0..8 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    assert!(
        fresh.stats().inference_requests > before,
        "it takes traffic"
    );
    h.stop().await;
    sick.shutdown().await;
    fresh.shutdown().await;
}

#[tokio::test]
async fn without_probes_a_worker_added_at_run_time_is_ready_at_once() {
    let h = harness(&["a"], quiet).await;
    let fresh = worker("fresh").await;
    let body = format!(r#"{{"url":"{}"}}"#, fresh.url());
    let added = h.admin(Method::POST, "/workers", &body).await;
    assert_eq!(added.status, StatusCode::CREATED, "{}", added.text());
    assert_eq!(added.json()["health"], "ready", "nothing would promote it");
    h.stop().await;
    fresh.shutdown().await;
}

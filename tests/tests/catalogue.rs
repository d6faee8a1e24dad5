//! End-to-end tests of the model catalogue against demo workers of different
//! models: `GET /v1/models` as the union of the fleet's models,
//! `/v1/models/{id}` from a worker that serves the model, and requests
//! naming a model no worker declares.

use balancer_mock_worker::WORKER_HEADER;
use balancer_tests::gateway::{Harness, harness_with_models, quiet};
use http::{Method, StatusCode};

/// The ids `GET /v1/models` lists, each entry checked for the OpenAI shape.
async fn listed(h: &Harness) -> Vec<String> {
    let r = h.call(h.gw.addr, Method::GET, "/v1/models", "", &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list", "{v}");
    let data = v["data"].as_array().expect("a data array");
    data.iter()
        .map(|m| {
            assert_eq!(m["object"], "model", "{m}");
            assert!(m["created"].is_u64(), "{m}");
            assert!(m["owned_by"].is_string(), "{m}");
            m["id"].as_str().expect("an id").to_owned()
        })
        .collect()
}

/// Requests the workers saw, all of them.
fn seen(h: &Harness) -> u64 {
    h.workers.iter().map(|w| w.stats().requests).sum()
}

#[tokio::test]
async fn the_model_list_is_the_union_of_the_routable_workers_models_once_each() {
    let h = harness_with_models(&[("a", "alpha"), ("b", "beta"), ("c", "alpha")], quiet).await;
    let before = seen(&h);
    // One random worker's list would differ between calls.
    for _ in 0..6 {
        assert_eq!(listed(&h).await, ["alpha", "beta"]);
    }
    assert_eq!(seen(&h), before, "the gateway answers the list itself");
    let b =
        h.gw.registry
            .fleet()
            .get(&h.workers[1].url())
            .unwrap()
            .id
            .clone();
    h.gw.registry.drain(&b).unwrap();
    assert_eq!(
        listed(&h).await,
        ["alpha"],
        "a draining worker takes no traffic"
    );
    let r = h.call(h.gw.addr, Method::HEAD, "/v1/models", "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.is_empty(), "HEAD has no body: {}", r.text());
    h.stop().await;
}

#[tokio::test]
async fn a_model_card_comes_from_a_worker_serving_that_model() {
    let h = harness_with_models(&[("a", "alpha"), ("b", "beta")], quiet).await;
    for _ in 0..4 {
        let r = h
            .call(h.gw.addr, Method::GET, "/v1/models/beta", "", &[])
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.headers[WORKER_HEADER], "b");
        assert_eq!(r.json()["id"], "beta");
    }
    let before = seen(&h);
    let r = h
        .call(h.gw.addr, Method::GET, "/v1/models/gamma", "", &[])
        .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::NOT_FOUND, "model_not_found"),
        "{}",
        r.text()
    );
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert_eq!(seen(&h), before, "no worker was asked");
    h.stop().await;
}

const GAMMA: &str = r#"{"model":"gamma","messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test]
async fn a_model_no_worker_declares_is_refused_with_model_not_found() {
    let h = harness_with_models(&[("a", "alpha"), ("b", "beta")], quiet).await;
    let before = seen(&h);
    let r = h.chat(GAMMA).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::NOT_FOUND, "model_not_found"),
        "{}",
        r.text()
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gamma")
    );
    assert_eq!(
        seen(&h),
        before,
        "no worker answered gamma as its own model"
    );
    let m = h.metrics().await;
    assert!(
        m.lines()
            .any(|l| l.contains(r#"code="model_not_found""#) && l.ends_with(" 1")),
        "the refusal is counted once: {m}"
    );
    h.stop().await;
}

#[tokio::test]
async fn an_undeclared_model_takes_its_fallback() {
    let h = harness_with_models(&[("a", "alpha"), ("b", "beta")], |c| {
        quiet(c);
        c.proxy.fallbacks.insert("gamma".into(), "beta".into());
    })
    .await;
    let r = h.chat(GAMMA).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.headers[WORKER_HEADER], "b");
    assert_eq!(r.headers["x-balancer-fallback"], "gamma->beta");
    h.stop().await;
}

#[tokio::test]
async fn route_undeclared_models_sends_them_to_any_worker_as_before() {
    let h = harness_with_models(&[("a", "alpha")], |c| {
        quiet(c);
        c.proxy.route_undeclared_models = true;
    })
    .await;
    let r = h.chat(GAMMA).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.headers[WORKER_HEADER], "a");
    h.stop().await;
}

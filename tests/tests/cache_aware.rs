//! End-to-end tests of `--policy cache_aware` through the gateway in front of
//! demo workers: a conversation's prefix sticks to one worker, an isolated
//! worker's prefixes move elsewhere, and fallbacks and token budgets still
//! apply.

use balancer_core::breaker::State;
use balancer_core::selection::Policy;
use balancer_tests::gateway::{Harness, always, eventually, harness, harness_with_models, quiet};
use http::StatusCode;

/// The whole conversation so far, as a client resends it every turn.
fn conversation(user: usize, turns: usize) -> String {
    let system = format!(
        "You are assistant number {user}. Answer in full sentences and cite the manual. {}",
        "Context paragraph. ".repeat(20)
    );
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "and now?"}));
    serde_json::json!({"model": "demo-model", "max_tokens": 4, "messages": messages}).to_string()
}

/// Sends `body` and says which workers it reached (requests are
/// sequential): one, or several when it was retried.
async fn reached(h: &Harness, body: &str) -> Vec<usize> {
    let before: Vec<u64> = (0..h.workers.len()).map(|i| h.served(i)).collect();
    let r = h.chat(body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let after: Vec<u64> = (0..h.workers.len()).map(|i| h.served(i)).collect();
    (0..after.len()).filter(|&i| after[i] > before[i]).collect()
}

/// The one worker that served `body`, without a retry.
async fn served_by(h: &Harness, body: &str) -> usize {
    match reached(h, body).await[..] {
        [one] => one,
        ref several => panic!("retried over {several:?}"),
    }
}

#[tokio::test]
async fn each_conversation_sticks_to_one_worker_and_they_spread() {
    let h = harness(&["a", "b", "c", "d"], |c| {
        quiet(c);
        c.policy = Policy::CacheAware;
    })
    .await;
    let mut homes = Vec::new();
    for user in 0..8 {
        let home = served_by(&h, &conversation(user, 0)).await;
        for turn in 1..6 {
            assert_eq!(
                served_by(&h, &conversation(user, turn)).await,
                home,
                "user {user} turn {turn} left its worker"
            );
        }
        homes.push(home);
    }
    homes.sort();
    homes.dedup();
    assert!(homes.len() >= 3, "conversations piled on {homes:?}");
    let m = h.metrics().await;
    assert!(
        m.contains("balancer_routing_decisions_total{reason=\"cache_match\"} 40"),
        "{m}"
    );
    assert!(m.contains("balancer_worker_cached_bytes{worker="), "{m}");
    assert!(
        m.contains("balancer_routing_matched_fraction_count 48"),
        "{m}"
    );
    h.stop().await;
}

#[tokio::test]
async fn an_isolated_workers_prefixes_move_to_another_and_stay_there() {
    let h = harness(&["a", "b", "c"], |c| {
        quiet(c);
        c.policy = Policy::CacheAware;
        c.breaker.settings.failure_threshold = 1;
    })
    .await;
    let home = served_by(&h, &conversation(1, 0)).await;
    assert_eq!(served_by(&h, &conversation(1, 1)).await, home);
    let url = h.workers[home].url();
    let held = |m: &str| {
        m.lines()
            .find(|l| l.starts_with(&format!("balancer_worker_cached_bytes{{worker=\"{url}\"}}")))
            .map(str::to_owned)
    };
    assert!(held(&h.metrics().await).is_some());

    // Its breaker opens on the first failure; the retry goes elsewhere.
    h.workers[home].set_fault(always(500));
    let tried = reached(&h, &conversation(1, 2)).await;
    assert_eq!(tried.len(), 2, "{tried:?}");
    let moved = *tried.iter().find(|&&w| w != home).unwrap();
    assert_eq!(h.breaker(home).state, State::Open);
    // Its entries are dropped, and the conversation stays on its new worker.
    eventually("the open worker's entries dropped", || async {
        held(&h.metrics().await).is_none()
    })
    .await;
    for turn in 3..8 {
        assert_eq!(served_by(&h, &conversation(1, turn)).await, moved);
    }
    h.stop().await;
}

#[tokio::test]
async fn fallback_models_and_token_budgets_apply_under_cache_aware() {
    let h = harness_with_models(&[("big", "big-model"), ("small", "small-model")], |c| {
        quiet(c);
        c.policy = Policy::CacheAware;
        c.proxy
            .fallbacks
            .insert("big-model".to_owned(), "small-model".to_owned());
        c.token_budgets.push(("big-model".to_owned(), 5));
    })
    .await;
    let big = r#"{"model":"big-model","max_tokens":10,"messages":[{"role":"user","content":"a prompt long enough to be cached"}]}"#;
    let base = (h.served(0), h.served(1));
    let first = h.chat(big).await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.headers.contains_key("x-balancer-fallback"));
    // The big model's budget is spent: the same prompt goes to the fallback.
    let r = h.chat(big).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.headers["x-balancer-fallback"], "big-model->small-model");
    assert_eq!(r.json()["model"], "small-model");
    assert_eq!((h.served(0), h.served(1)), (base.0 + 1, base.1 + 1));
    h.stop().await;
}

#[tokio::test]
async fn a_removed_workers_prefixes_are_dropped_and_move_to_another() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.policy = Policy::CacheAware;
    })
    .await;
    let home = served_by(&h, &conversation(7, 0)).await;
    let url = h.workers[home].url();
    let row = format!("balancer_worker_cached_bytes{{worker=\"{url}\"}}");
    assert!(h.metrics().await.contains(&row));
    let id = h.gw.registry.fleet().get(&url).unwrap().id.clone();
    let r = h
        .admin(http::Method::DELETE, &format!("/workers/{id}"), "")
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    eventually("the removed worker's entries dropped", || async {
        !h.metrics().await.contains(&row)
    })
    .await;
    let other = 1 - home;
    for turn in 1..4 {
        assert_eq!(served_by(&h, &conversation(7, turn)).await, other);
    }
    h.stop().await;
}

#[tokio::test]
async fn a_slowed_workers_conversation_moves_to_a_faster_worker_and_stays() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.policy = Policy::CacheAware;
    })
    .await;
    // Conversations on both workers, so both have a recent time to first byte.
    let mut homes = Vec::new();
    for user in 0..6 {
        homes.push(served_by(&h, &conversation(user, 0)).await);
    }
    let slowed = homes[0];
    assert!(
        homes.contains(&(1 - slowed)),
        "all on one worker: {homes:?}"
    );
    h.workers[slowed].set_fault(balancer_mock_worker::Fault {
        latency_ms: Some(300),
        ..balancer_mock_worker::Fault::default()
    });
    // A few slow answers raise its average until the cache no longer pays
    // (with --disable-ttft-weighting it would stay there).
    let mut turn = 1;
    while served_by(&h, &conversation(0, turn)).await == slowed {
        turn += 1;
        assert!(turn <= 5, "still on the slowed worker after {turn} turns");
    }
    for more in turn + 1..turn + 4 {
        assert_eq!(served_by(&h, &conversation(0, more)).await, 1 - slowed);
    }
    let m = h.metrics().await;
    assert!(
        m.contains("balancer_routing_decisions_total{reason=\"slow\"} 1"),
        "{m}"
    );
    h.stop().await;
}

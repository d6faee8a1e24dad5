//! End-to-end tests of the LLM-aware options against demo workers: slow
//! first bytes, short completions, the degraded state, model fallbacks and
//! token budgets.

use std::sync::Arc;
use std::time::Duration;

use balancer_core::breaker::DegradedSettings;
use balancer_core::breaker::{FailureReason, State};
use balancer_core::selection::Policy;
use balancer_mock_worker::Fault;
use balancer_tests::gateway::{CHAT, STREAM, always, harness, harness_with_models, quiet};
use http::{Method, StatusCode};

#[tokio::test]
async fn a_worker_answering_200_in_3s_is_isolated_with_slow_ttfb() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.breaker.slow_ttfb = Some(Duration::from_millis(1000));
        c.breaker.settings.failure_threshold = 2;
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    h.workers[0].set_fault(Fault {
        latency_ms: Some(3000),
        ..Fault::default()
    });
    let h = Arc::new(h);
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move { h.chat(CHAT).await.status })
        })
        .collect();
    for s in slow {
        assert_eq!(
            s.await.unwrap(),
            StatusCode::OK,
            "slow answers still reach the client"
        );
    }
    let a = h.breaker(0);
    assert_eq!(a.state, State::Open);
    assert_eq!(a.failures[FailureReason::Slow as usize], 2);
    assert_eq!(a.successes, 0, "the late 200s were not successes");
    let r = h.chat(CHAT).await;
    assert_eq!(r.code(), "no_available_workers");
    let m = h.metrics().await;
    let url = h.workers[0].url();
    assert!(m.contains(&format!(
        "balancer_worker_cb_failures_total{{worker=\"{url}\",reason=\"slow\"}} 2"
    )));
    Arc::into_inner(h).unwrap().stop().await;
}

#[tokio::test]
async fn a_fast_worker_is_not_slow_and_its_ttfb_is_recorded() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.breaker.slow_ttfb = Some(Duration::from_millis(1000));
    })
    .await;
    for _ in 0..5 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    let a = h.breaker(0);
    assert_eq!((a.successes, a.failures_total()), (5, 0));
    let m = h.metrics().await;
    let url = h.workers[0].url();
    assert!(
        m.contains(&format!(
            "balancer_worker_ttfb_seconds_count{{worker=\"{url}\"}} 5"
        )),
        "{m}"
    );
    h.stop().await;
}

#[tokio::test]
async fn degraded_worker_gets_its_share_of_traffic() {
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.policy = Policy::RoundRobin;
        c.breaker.settings.failure_threshold = 1;
        c.breaker.settings.success_threshold = 1;
        c.breaker.settings.open_timeout = Duration::from_secs(10);
        c.breaker.settings.degraded = Some(DegradedSettings {
            traffic_pct: 25,
            duration: Duration::from_secs(3600),
        });
    })
    .await;
    h.workers[0].set_fault(Fault {
        status: Some(500),
        count: Some(1),
        ..Fault::default()
    });
    while h.breaker(0).state != State::Open {
        h.chat(CHAT).await;
    }
    h.clock.advance(Duration::from_secs(10));
    while h.breaker(0).state != State::Degraded {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    let (a0, b0) = (h.served(0), h.served(1));
    for _ in 0..2000 {
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    }
    // Round robin would give A half; degraded, A keeps 25% of that half.
    let share = (h.served(0) - a0) as f64 / 1000.0 * 100.0;
    assert!(
        (20.0..=30.0).contains(&share),
        "A got {share:.1}% of its usual traffic"
    );
    assert_eq!(h.served(0) - a0 + h.served(1) - b0, 2000);
    let m = h.metrics().await;
    let url = h.workers[0].url();
    assert!(m.contains(&format!("balancer_worker_cb_state{{worker=\"{url}\"}} 3")));
    assert!(m.contains(&format!(
        "balancer_worker_cb_transitions_total{{worker=\"{url}\",from=\"half_open\",to=\"degraded\"}} 1"
    )));
    h.stop().await;
}

#[tokio::test]
async fn fallback_is_taken_only_when_the_primary_has_no_eligible_worker() {
    let h = harness_with_models(&[("big", "big-model"), ("small", "small-model")], |c| {
        quiet(c);
        c.proxy
            .fallbacks
            .insert("big-model".to_owned(), "small-model".to_owned());
        c.breaker.settings.failure_threshold = 1;
    })
    .await;
    let big = r#"{"model":"big-model","messages":[{"role":"user","content":"hi"}]}"#;
    let r = h.chat(big).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        !r.headers.contains_key("x-balancer-fallback"),
        "the primary served it"
    );
    assert_eq!(r.json()["model"], "big-model");

    // A client error from the primary is the client's answer, never a fallback.
    h.workers[0].set_fault(always(400));
    let r = h.chat(big).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(!r.headers.contains_key("x-balancer-fallback"));

    // The primary's breaker opens: the request goes to the fallback model.
    h.workers[0].set_fault(always(500));
    let served_small = h.served(1);
    loop {
        let r = h.chat(big).await;
        if r.headers.contains_key("x-balancer-fallback") {
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(r.headers["x-balancer-fallback"], "big-model->small-model");
            assert_eq!(
                r.json()["model"],
                "small-model",
                "the body's model was rewritten"
            );
            break;
        }
        assert_eq!(h.breaker(0).state, State::Closed, "{}", r.text());
    }
    assert_eq!(h.breaker(0).state, State::Open);
    assert!(h.served(1) > served_small);
    let m = h.metrics().await;
    assert!(
        m.contains("balancer_fallbacks_total{from=\"big-model\",to=\"small-model\"} 1"),
        "{m}"
    );
    h.stop().await;
}

#[tokio::test]
async fn token_budget_is_enforced_within_one_request() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.token_budgets.push(("demo-model".to_owned(), 100));
    })
    .await;
    let body =
        r#"{"model":"demo-model","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#;
    let per_request = {
        let r = h.chat(body).await;
        r.json()["usage"]["total_tokens"].as_u64().unwrap()
    };
    let mut spent = per_request;
    let refused = loop {
        let r = h.chat(body).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            break r;
        }
        spent += r.json()["usage"]["total_tokens"].as_u64().unwrap();
        assert!(spent < 100 + 2 * per_request, "the budget was not enforced");
    };
    assert_eq!(refused.code(), "token_budget_exceeded");
    let wait: u64 = refused.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&wait));
    assert!(
        (100..100 + per_request).contains(&spent),
        "spent {spent} of 100"
    );
    let m = h.metrics().await;
    assert!(
        m.contains("balancer_token_budget_exceeded_total{model=\"demo-model\"} 1"),
        "{m}"
    );
    assert!(m.contains("balancer_tokens_total{model=\"demo-model\",kind=\"completion\"}"));
    h.stop().await;
}

#[tokio::test]
async fn streamed_usage_counts_against_the_budget() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.token_budgets.push(("demo-model".to_owned(), 20));
    })
    .await;
    let body = r#"{"model":"demo-model","stream":true,"max_tokens":12,"messages":[]}"#;
    assert_eq!(h.chat(body).await.status, StatusCode::OK);
    assert_eq!(h.chat(body).await.status, StatusCode::OK);
    let r = h.chat(body).await;
    assert_eq!(
        r.code(),
        "token_budget_exceeded",
        "the final chunk's usage was counted"
    );
    h.stop().await;
}

#[tokio::test]
async fn a_spent_budget_takes_the_fallback_model() {
    let h = harness_with_models(&[("big", "big-model"), ("small", "small-model")], |c| {
        quiet(c);
        c.token_budgets.push(("big-model".to_owned(), 5));
        c.proxy
            .fallbacks
            .insert("big-model".to_owned(), "small-model".to_owned());
    })
    .await;
    let big = r#"{"model":"big-model","max_tokens":10,"messages":[]}"#;
    assert!(
        !h.chat(big)
            .await
            .headers
            .contains_key("x-balancer-fallback")
    );
    let r = h.chat(big).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["x-balancer-fallback"], "big-model->small-model");
    h.stop().await;
}

#[tokio::test]
async fn a_slow_answer_trips_the_breaker_at_the_budget_not_at_the_answer() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.breaker.slow_ttfb = Some(Duration::from_millis(300));
        c.breaker.settings.failure_threshold = 1;
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    h.workers[0].set_fault(Fault {
        latency_ms: Some(3000),
        ..Fault::default()
    });
    let h = Arc::new(h);
    let request = {
        let h = h.clone();
        tokio::spawn(async move { h.chat(CHAT).await.status })
    };
    let started = std::time::Instant::now();
    balancer_tests::gateway::eventually("open at the budget", || {
        std::future::ready(h.breaker(0).state == State::Open)
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "opened after {:?}",
        started.elapsed()
    );
    assert!(!request.is_finished(), "the answer has not come yet");
    assert_eq!(
        request.await.unwrap(),
        StatusCode::OK,
        "and still reaches the client"
    );
    assert_eq!(h.breaker(0).failures_total(), 1, "charged once");
    Arc::into_inner(h).unwrap().stop().await;
}

/// 200s with empty completions, plain and streamed: charged as `quality`
/// and isolating the worker with `--cb-min-completion-tokens 1`, successes
/// without it (the gateway document's default). The client gets each answer.
#[tokio::test]
async fn empty_completions_open_the_breaker_only_with_min_completion_tokens() {
    for min in [None, Some(1)] {
        let h = harness(&["a"], |c| {
            quiet(c);
            c.breaker.min_completion_tokens = min;
            c.breaker.settings.failure_threshold = 3;
            c.proxy.retry.max_attempts = 1;
        })
        .await;
        h.workers[0].set_fault(Fault {
            completion_tokens: Some(0),
            ..Fault::default()
        });
        for body in [CHAT, STREAM, CHAT] {
            let r = h.chat(body).await;
            assert_eq!(r.status, StatusCode::OK, "the answer reaches the client");
            if body == STREAM {
                assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
            } else {
                assert_eq!(r.json()["choices"][0]["message"]["content"], "");
            }
        }
        let a = h.breaker(0);
        let url = h.workers[0].url();
        let m = h.metrics().await;
        if min.is_some() {
            assert_eq!(a.state, State::Open);
            assert_eq!(a.failures[FailureReason::Quality as usize], 3);
            assert_eq!(a.successes, 0);
            assert!(
                m.contains(&format!(
                    "balancer_worker_cb_failures_total{{worker=\"{url}\",reason=\"quality\"}} 3"
                )),
                "{m}"
            );
            assert_eq!(h.chat(CHAT).await.code(), "no_available_workers");
        } else {
            assert_eq!(a.state, State::Closed);
            assert_eq!((a.successes, a.failures_total()), (3, 0));
        }
        h.stop().await;
    }
}

/// Short is judged against what the request asked for; a worker that
/// answers in full never fails the rule; usage-less streams are counted by
/// their deltas; and the per-worker override, set through the admin API,
/// turns the rule on for one worker.
#[tokio::test]
async fn min_completion_tokens_spares_small_asks_and_full_answers_and_is_per_worker() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.breaker.min_completion_tokens = Some(2);
        c.breaker.settings.failure_threshold = 1;
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    // A full answer, streamed and not, without usage: counted from the text.
    h.workers[0].set_fault(Fault {
        without_usage: true,
        ..Fault::default()
    });
    assert_eq!(h.chat(STREAM).await.status, StatusCode::OK);
    assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    // One token, but one is all the request asked for.
    h.workers[0].set_fault(Fault {
        completion_tokens: Some(1),
        ..Fault::default()
    });
    let small =
        r#"{"model":"demo-model","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(h.chat(small).await.status, StatusCode::OK);
    let a = h.breaker(0);
    assert_eq!(
        (a.state, a.successes, a.failures_total()),
        (State::Closed, 3, 0)
    );
    // A stream cut before any token is judged by --cb-stream-failures
    // (off here), not by its length.
    h.workers[0].set_fault(Fault {
        truncate_after_chunks: Some(0),
        ..Fault::default()
    });
    assert_eq!(h.chat(STREAM).await.status, StatusCode::OK);
    let a = h.breaker(0);
    assert_eq!(
        (a.state, a.successes, a.failures_total()),
        (State::Closed, 4, 0)
    );
    // One token, streamed without usage, where six were asked for: short.
    h.workers[0].set_fault(Fault {
        completion_tokens: Some(1),
        without_usage: true,
        ..Fault::default()
    });
    assert_eq!(h.chat(STREAM).await.status, StatusCode::OK);
    let a = h.breaker(0);
    assert_eq!(a.state, State::Open);
    assert_eq!(a.failures[FailureReason::Quality as usize], 1);
    h.stop().await;

    // Off by flag, on for one worker through the admin API. Round robin:
    // both workers get some of the six chats (the default policy may send
    // all of them to one).
    let h = harness(&["a", "b"], |c| {
        quiet(c);
        c.breaker.settings.failure_threshold = 1;
        c.proxy.retry.max_attempts = 1;
        c.policy = Policy::RoundRobin;
    })
    .await;
    let list = h.admin(Method::GET, "/workers", "").await.json();
    let url = h.workers[1].url();
    let id = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == url.as_str())
        .expect("worker b listed")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = h
        .admin(
            Method::PATCH,
            &format!("/workers/{id}"),
            r#"{"resilience":{"cb_min_completion_tokens":1}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json()["effective"]["cb_min_completion_tokens"], 1);
    for w in &h.workers {
        w.set_fault(Fault {
            completion_tokens: Some(0),
            ..Fault::default()
        });
    }
    for _ in 0..6 {
        h.chat(CHAT).await;
    }
    assert_eq!(h.breaker(0).state, State::Closed);
    assert_eq!(h.breaker(1).state, State::Open);
    assert_eq!(h.breaker(1).failures[FailureReason::Quality as usize], 1);
    h.stop().await;
}

/// A request body streamed past the replay limit is not kept, so its
/// `max_tokens` is unknown: its short completion is judged without the
/// exemption, where the same ask kept whole is exempt.
#[tokio::test]
async fn a_streamed_request_body_is_judged_without_the_max_tokens_exemption() {
    let h = harness(&["a"], |c| {
        quiet(c);
        c.breaker.min_completion_tokens = Some(2);
        c.breaker.settings.failure_threshold = 1;
        c.proxy.max_replay_body = 256;
        c.proxy.retry.max_attempts = 1;
    })
    .await;
    h.workers[0].set_fault(Fault {
        completion_tokens: Some(1),
        ..Fault::default()
    });
    let ask = |content: &str| {
        format!(
            r#"{{"model":"demo-model","max_tokens":1,"messages":[{{"role":"user","content":"{content}"}}]}}"#
        )
    };
    assert_eq!(h.chat(&ask("hi")).await.status, StatusCode::OK);
    let a = h.breaker(0);
    assert_eq!(
        (a.state, a.successes),
        (State::Closed, 1),
        "kept whole: exempt"
    );
    let big = ask(&"x".repeat(4096));
    assert_eq!(h.chat(&big).await.status, StatusCode::OK);
    let a = h.breaker(0);
    assert_eq!(a.state, State::Open);
    assert_eq!(a.failures[FailureReason::Quality as usize], 1);
    h.stop().await;
}

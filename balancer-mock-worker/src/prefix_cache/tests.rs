use std::sync::Arc;

use super::*;

/// A chat body whose rendered prompt is `system` then `user`.
fn chat(system: &str, user: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
    }))
    .unwrap()
}

fn engine(blocks: usize) -> Engine {
    Engine::new(EngineConfig {
        cache_blocks: blocks,
        ..EngineConfig::default()
    })
}

#[test]
fn the_prompt_is_every_message_in_order_or_the_prompt_fields() {
    let p = prompt_text(&chat("be brief", "hi"));
    assert_eq!(p, "<|system|>\nbe brief\n<|user|>\nhi\n");
    let parts = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;
    assert_eq!(prompt_text(parts), "<|user|>\nab\n");
    assert_eq!(prompt_text(br#"{"prompt":"once upon"}"#), "once upon");
    assert_eq!(prompt_text(br#"{"input":["x","y"]}"#), "xy");
    assert_eq!(prompt_text(br#"{"text":"t"}"#), "t");
    assert_eq!(prompt_text(b"not json"), "");
}

#[test]
fn blocks_are_hashed_in_chain_and_a_partial_block_is_not_one() {
    let a = "a".repeat(BLOCK_BYTES * 2 + 10);
    let hashes = block_hashes(a.as_bytes());
    assert_eq!(hashes.len(), 2);
    // The same second block after a different first block hashes differently.
    let b = format!("{}{}", "b".repeat(BLOCK_BYTES), "a".repeat(BLOCK_BYTES));
    let other = block_hashes(b.as_bytes());
    assert_ne!(hashes[1], other[1]);
    assert_eq!(block_hashes(a.as_bytes()), hashes, "deterministic");
}

#[test]
fn a_shared_prefix_hits_up_to_the_first_different_block() {
    let e = engine(1024);
    let system = "s".repeat(BLOCK_BYTES * 10);
    let first = e.lookup(&chat(&system, "first question"));
    assert_eq!(first.hit_tokens, 0);
    let second = e.lookup(&chat(&system, "second question, another one"));
    // "<|system|>\n" (11 bytes) + 640 bytes of system prompt: 10 full blocks
    // in common, the 11th differs with the user's text.
    assert_eq!(second.hit_tokens, 10 * BLOCK_TOKENS as u64);
    assert_eq!(
        second.query_tokens,
        tokens(prompt_text(&chat(&system, "second question, another one")).len())
    );
    // Resending the whole conversation hits it all but the partial block.
    let again = e.lookup(&chat(&system, "second question, another one"));
    assert_eq!(
        again.hit_tokens,
        (again.query_tokens as usize / BLOCK_TOKENS * BLOCK_TOKENS) as u64
    );
    let totals = e.tokens();
    assert_eq!(
        totals.hit_tokens,
        first.hit_tokens + second.hit_tokens + again.hit_tokens
    );
}

#[test]
fn the_cache_is_bounded_and_evicts_the_least_recently_used() {
    let e = engine(8);
    let a = "a".repeat(BLOCK_BYTES * 6);
    let b = "b".repeat(BLOCK_BYTES * 6);
    e.lookup(a.as_bytes());
    e.lookup(br#"{"prompt":"x"}"#);
    assert_eq!(e.cached_blocks(), 0, "a body that is no JSON has no prompt");
    e.lookup(format!(r#"{{"prompt":"{a}"}}"#).as_bytes());
    e.lookup(format!(r#"{{"prompt":"{b}"}}"#).as_bytes());
    assert_eq!(e.cached_blocks(), 8);
    // a's first blocks went first: a no longer hits from its start.
    assert_eq!(
        e.lookup(format!(r#"{{"prompt":"{a}"}}"#).as_bytes())
            .hit_tokens,
        0
    );
}

#[test]
fn without_a_cache_nothing_hits_but_tokens_are_counted() {
    let e = engine(0);
    let body = chat(&"s".repeat(500), "q");
    e.lookup(&body);
    let l = e.lookup(&body);
    assert_eq!(l.hit_tokens, 0);
    assert!(l.query_tokens > 100);
}

#[tokio::test(start_paused = true)]
async fn uncached_tokens_cost_prefill_time_and_cached_ones_do_not() {
    let e = Arc::new(Engine::new(EngineConfig {
        cache_blocks: 1024,
        prefill_per_token: Duration::from_micros(100),
        slots: 0,
    }));
    let body = format!(r#"{{"prompt":"{}"}}"#, "p".repeat(BLOCK_BYTES * 100));
    let start = tokio::time::Instant::now();
    let (_slot, first) = e.prefill(body.as_bytes()).await;
    assert_eq!(first.query_tokens, 1600);
    assert_eq!(start.elapsed(), Duration::from_micros(100 * 1600));
    let start = tokio::time::Instant::now();
    let (_slot, second) = e.prefill(body.as_bytes()).await;
    assert_eq!(second.hit_tokens, 1600);
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn beyond_the_slots_requests_wait_and_the_metrics_show_the_queue() {
    let e = Arc::new(Engine::new(EngineConfig {
        cache_blocks: 0,
        prefill_per_token: Duration::from_millis(1),
        slots: 1,
    }));
    let (held, _) = e.prefill(br#"{"prompt":"x"}"#).await;
    let waiter = {
        let e = e.clone();
        tokio::spawn(async move { e.prefill(br#"{"prompt":"y"}"#).await.1 })
    };
    tokio::task::yield_now().await;
    let text = e.metrics("demo-model");
    assert!(
        text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"demo-model\"} 1.0"),
        "{text}"
    );
    assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"demo-model\"} 1.0"));
    drop(held);
    assert_eq!(waiter.await.unwrap().query_tokens, 1);
    let text = e.metrics("demo-model");
    assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"demo-model\"} 0.0"));
    assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"demo-model\"} 0.0"));
}

#[test]
fn the_metrics_are_the_prometheus_text_format_with_vllm_names() {
    let e = engine(4);
    e.lookup(format!(r#"{{"prompt":"{}"}}"#, "z".repeat(BLOCK_BYTES * 2)).as_bytes());
    e.lookup(format!(r#"{{"prompt":"{}"}}"#, "z".repeat(BLOCK_BYTES * 2)).as_bytes());
    let text = e.metrics("org/model \"x\"");
    for line in [
        "# TYPE vllm:kv_cache_usage_perc gauge",
        "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"org/model \\\"x\\\"\"} 0.5",
        "# TYPE vllm:prefix_cache_queries_total counter",
        "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"org/model \\\"x\\\"\"} 64.0",
        "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"org/model \\\"x\\\"\"} 32.0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line}\n{text}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_slowed_engine_takes_longer_per_uncached_token() {
    let e = Arc::new(Engine::new(EngineConfig {
        cache_blocks: 0,
        prefill_per_token: Duration::from_micros(100),
        slots: 0,
    }));
    e.set_prefill_per_token(Duration::from_micros(600));
    assert_eq!(e.prefill_per_token(), Duration::from_micros(600));
    let start = tokio::time::Instant::now();
    // Ten tokens: 6 ms (the paused clock counts whole milliseconds).
    let (_slot, l) = e
        .prefill(br#"{"prompt":"0123456789abcdef0123456789abcdef01234567"}"#)
        .await;
    assert_eq!(l.query_tokens, 10);
    assert_eq!(start.elapsed(), Duration::from_millis(6));
}

mod over_http {
    use http::{Method, StatusCode};

    use crate::config::MockWorkerConfig;
    use crate::server::MockWorker;
    use crate::test_support::call;

    use super::*;

    async fn demo_worker() -> MockWorker {
        let config = MockWorkerConfig {
            engine: EngineConfig {
                prefill_per_token: Duration::ZERO,
                ..EngineConfig::DEMO
            },
            ..MockWorkerConfig::named("w-engine")
        };
        MockWorker::spawn(std::net::SocketAddr::from(([127, 0, 0, 1], 0)), config)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn metrics_and_stats_show_the_cache_and_are_not_counted_as_requests() {
        let w = demo_worker().await;
        let body = String::from_utf8(chat(&"s".repeat(BLOCK_BYTES * 4), "q")).unwrap();
        for _ in 0..2 {
            let a = call(&w, Method::POST, "/v1/chat/completions", &body).await;
            assert_eq!(a.status, StatusCode::OK);
        }
        let m = call(&w, Method::GET, "/metrics", "").await;
        assert_eq!(m.status, StatusCode::OK);
        assert_eq!(m.headers["content-type"], "text/plain; version=0.0.4");
        let text = String::from_utf8_lossy(&m.body).into_owned();
        assert!(
            text.contains(
                "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"demo-model\"} 64.0"
            ),
            "{text}"
        );
        let s = w.stats();
        assert_eq!(
            (s.requests, s.inference_requests),
            (2, 2),
            "/metrics is not counted"
        );
        assert_eq!(s.prefix_cache_hit_tokens, 64);
        assert!(s.prefix_cache_query_tokens > 128);
        w.reset();
        assert_eq!(w.stats().prefix_cache_hit_tokens, 0);
    }

    #[tokio::test]
    async fn the_engine_speed_is_read_and_changed_and_bounded() {
        let w = demo_worker().await;
        let a = call(
            &w,
            Method::POST,
            "/_mock/engine",
            r#"{"prefill_us_per_token":600}"#,
        )
        .await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.json()["prefill_us_per_token"], 600);
        let a = call(&w, Method::GET, "/_mock/engine", "").await;
        assert_eq!(a.json()["prefill_us_per_token"], 600);
        for bad in [
            "",
            "{}",
            r#"{"prefill_us_per_token":-1}"#,
            r#"{"prefill_us_per_token":1000001}"#,
            r#"{"speed":1}"#,
        ] {
            let a = call(&w, Method::POST, "/_mock/engine", bad).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{bad:?}");
        }
        assert_eq!(
            call(&w, Method::GET, "/_mock/engine", "").await.json()["prefill_us_per_token"],
            600
        );
    }
}

#[tokio::test]
async fn an_engine_without_cache_or_prefill_reads_no_prompt() {
    let e = Arc::new(Engine::new(EngineConfig::default()));
    let (_slot, l) = e.prefill(&chat(&"s".repeat(500), "q")).await;
    assert_eq!((l.query_tokens, l.hit_tokens), (0, 0));
    assert_eq!(e.tokens().query_tokens, 0);
    assert!(
        e.metrics("m")
            .contains("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1.0")
    );
}

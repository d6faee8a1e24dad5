use super::*;
use crate::breaker::{Classifier, FailureReason};
use crate::spec::{BreakerDefaults, Resilience};

/// The verdict of a body sent in `chunks`, under a minimum of `min`.
fn judged(min: u32, sse: bool, chunks: &[&str]) -> Verdict {
    let mut scan = QualityRule::for_request(min, None)
        .expect("a rule")
        .scan(sse);
    for c in chunks {
        scan.push(&Bytes::copy_from_slice(c.as_bytes()));
    }
    scan.verdict()
}

fn chat(content: &str, usage: Option<u64>) -> String {
    let usage = usage.map_or(String::new(), |n| {
        format!(
            r#","usage":{{"prompt_tokens":3,"completion_tokens":{n},"total_tokens":{}}}"#,
            n + 3
        )
    });
    format!(
        r#"{{"id":"c","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":{},"tool_calls":[]}},"finish_reason":"stop"}}]{usage}}}"#,
        serde_json::to_string(content).unwrap()
    )
}

fn delta(content: &str) -> String {
    format!(
        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"finish_reason\":null}}]}}\n\n",
        serde_json::to_string(content).unwrap()
    )
}

const DONE: &str = "data: [DONE]\n\n";

#[test]
fn an_empty_completion_is_short() {
    assert_eq!(
        judged(1, false, &[&chat("", Some(0))]),
        Verdict::Short { tokens: 0 }
    );
    // Without usage, and with nothing at all in the body.
    assert_eq!(
        judged(1, false, &[&chat("", None)]),
        Verdict::Short { tokens: 0 }
    );
    assert_eq!(judged(1, false, &[]), Verdict::Short { tokens: 0 });
    assert_eq!(
        judged(1, true, &[DONE]),
        Verdict::Short { tokens: 0 },
        "a stream of no events"
    );
}

#[test]
fn usage_decides_when_present_and_the_text_otherwise() {
    // Usage says 1, whatever the text looks like.
    assert_eq!(
        judged(2, false, &[&chat("a long answer indeed", Some(1))]),
        Verdict::Short { tokens: 1 }
    );
    assert_eq!(judged(2, false, &[&chat("x", Some(2))]), Verdict::Passed);
    // No usage: 4 bytes per token, rounded up.
    assert_eq!(
        judged(2, false, &[&chat("Hi.", None)]),
        Verdict::Short { tokens: 1 }
    );
    assert_eq!(judged(2, false, &[&chat("Hello", None)]), Verdict::Passed);
    // Text completions and SGLang `/generate` bodies, without usage.
    let text = r#"{"choices":[{"index":0,"text":"","finish_reason":"stop"}]}"#;
    assert_eq!(judged(1, false, &[text]), Verdict::Short { tokens: 0 });
    let generate =
        r#"{"text":"Paris is the capital","meta_info":{"id":"x","finish_reason":{"type":"stop"}}}"#;
    assert_eq!(judged(5, false, &[generate]), Verdict::Passed);
    let generate = r#"{"text":"","meta_info":{"prompt_tokens":4,"completion_tokens":0}}"#;
    assert_eq!(judged(1, false, &[generate]), Verdict::Short { tokens: 0 });
}

#[test]
fn a_stream_counts_its_usage_chunk_when_it_has_one() {
    let usage =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n";
    // Two non-empty deltas, but the worker reports one token.
    let chunks = [delta("He").as_str(), &delta("llo"), usage, DONE].map(str::to_owned);
    let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
    assert_eq!(judged(2, true, &chunks), Verdict::Short { tokens: 1 });
    assert_eq!(judged(1, true, &chunks), Verdict::Passed);
}

#[test]
fn a_stream_without_usage_counts_its_non_empty_deltas() {
    let (a, empty, b) = (delta("Hello"), delta(""), delta(" world"));
    assert_eq!(
        judged(3, true, &[&a, &empty, &b, DONE]),
        Verdict::Short { tokens: 2 }
    );
    assert_eq!(judged(2, true, &[&a, &empty, &b, DONE]), Verdict::Passed);
    // Only empty deltas (the role chunk, the finish chunk): empty.
    assert_eq!(
        judged(1, true, &[&empty, &empty, DONE]),
        Verdict::Short { tokens: 0 }
    );
}

#[test]
fn events_split_across_chunks_are_read_whole() {
    let events = [delta("a"), delta("b"), delta("c")].concat() + DONE;
    for cut in [1, 7, 20, events.len() / 2, events.len() - 3] {
        let (x, y) = events.split_at(cut);
        assert_eq!(judged(3, true, &[x, y]), Verdict::Passed, "cut at {cut}");
        assert_eq!(
            judged(4, true, &[x, y]),
            Verdict::Short { tokens: 3 },
            "cut at {cut}"
        );
    }
    let body = chat("", Some(0));
    let (x, y) = body.split_at(body.len() / 2);
    assert_eq!(judged(1, false, &[x, y]), Verdict::Short { tokens: 0 });
}

#[test]
fn a_request_asking_for_fewer_tokens_than_the_minimum_is_exempt() {
    assert_eq!(QualityRule::for_request(2, Some(1)), None);
    assert!(QualityRule::for_request(2, Some(2)).is_some());
    assert!(QualityRule::for_request(2, None).is_some());
    assert_eq!(QualityRule::for_request(0, None), None, "0 is off");
    assert_eq!(
        requested_tokens(br#"{"model":"m","max_tokens":1}"#),
        Some(1)
    );
    assert_eq!(
        requested_tokens(br#"{"max_tokens":50,"max_completion_tokens":1}"#),
        Some(1),
        "max_completion_tokens is the newer name and wins"
    );
    assert_eq!(
        requested_tokens(br#"{"text":"hi","sampling_params":{"max_new_tokens":1}}"#),
        Some(1)
    );
    assert_eq!(requested_tokens(br#"{"model":"m"}"#), None);
    assert_eq!(requested_tokens(b"not json"), None);
    // Through the classifier's body rules, as the proxy asks.
    let rules = Classifier::default()
        .with_min_completion_tokens(Some(2))
        .body_rules();
    assert!(rules.judges_quality());
    assert_eq!(rules.judging(true, Some(1)).quality(), None);
    assert!(rules.judging(true, Some(16)).quality().is_some());
    assert!(rules.judging(true, None).quality().is_some());
    assert_eq!(
        rules.judging(false, None).quality(),
        None,
        "not a 2xx completion"
    );
    assert!(!Classifier::default().body_rules().judges_quality());
    assert_eq!(Classifier::default().body_rules().quality(), None);
}

#[test]
fn tool_calls_are_exempt() {
    let body = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"t","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":9,"completion_tokens":0}}"#;
    assert_eq!(judged(1, false, &[body]), Verdict::Passed);
    let streamed = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n";
    assert_eq!(judged(1, true, &[streamed, DONE]), Verdict::Passed);
    // An empty `tool_calls` list (vLLM sends one on every message) is no tool call.
    assert_eq!(
        judged(1, false, &[&chat("", None)]),
        Verdict::Short { tokens: 0 }
    );
}

#[test]
fn a_content_filter_refusal_is_exempt() {
    let body = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":""},"finish_reason":"content_filter"}],"usage":{"prompt_tokens":9,"completion_tokens":0}}"#;
    assert_eq!(judged(1, false, &[body]), Verdict::Passed);
    let last =
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"content_filter\"}]}\n\n";
    assert_eq!(judged(1, true, &[last, DONE]), Verdict::Passed);
}

#[test]
fn a_body_it_cannot_read_is_not_judged() {
    assert_eq!(judged(1, false, &["<html>oops</html>"]), Verdict::Passed);
    // Past the bound, a whole body is not kept, nor is an SSE line.
    let big = "x".repeat(MAX_SCANNED_BYTES + 1);
    assert_eq!(judged(1, false, &[&big]), Verdict::Passed);
    assert_eq!(judged(1, true, &[&big, DONE]), Verdict::Passed);
}

#[test]
fn the_per_worker_override_wins_over_the_flag_and_0_turns_it_off() {
    let defaults = BreakerDefaults {
        min_completion_tokens: Some(2),
        ..BreakerDefaults::default()
    };
    let (_, flag) = defaults.resolve(&Resilience::default());
    assert_eq!(flag.min_completion_tokens(), Some(2));
    let (_, raised) = defaults.resolve(&Resilience {
        cb_min_completion_tokens: Some(5),
        ..Resilience::default()
    });
    assert_eq!(raised.min_completion_tokens(), Some(5));
    let (_, off) = defaults.resolve(&Resilience {
        cb_min_completion_tokens: Some(0),
        ..Resilience::default()
    });
    assert_eq!(off.min_completion_tokens(), None);
    // On for one worker while the flag is off.
    let (_, one) = BreakerDefaults::default().resolve(&Resilience {
        cb_min_completion_tokens: Some(1),
        ..Resilience::default()
    });
    assert!(one.body_rules().judges_quality());
    // The override travels in specs as the other overrides do, and merges.
    let parsed: Resilience = serde_json::from_str(r#"{"cb_min_completion_tokens":3}"#).unwrap();
    assert_eq!(parsed.cb_min_completion_tokens, Some(3));
    assert_eq!(
        Resilience::default()
            .merged(&parsed)
            .cb_min_completion_tokens,
        Some(3)
    );
}

#[test]
fn quality_is_a_failure_reason_of_its_own() {
    assert_eq!(FailureReason::Quality.as_str(), "quality");
    assert!(FailureReason::ALL.contains(&FailureReason::Quality));
    assert_eq!(
        FailureReason::ALL[FailureReason::Quality as usize],
        FailureReason::Quality
    );
}

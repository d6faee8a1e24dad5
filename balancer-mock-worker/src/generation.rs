//! The OpenAI side of the worker: parsing a chat or text completion request
//! ([`CompletionRequest`]), counting its prompt tokens, and producing the
//! deterministic answer ([`Generation`]), either as one JSON body or as the
//! SSE events of a stream (with `usage` on the last chunk).
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module is at the bottom with `config` and depends on no other module
//! of this crate: it produces bytes, never a response. It must not know about
//! faults (it is handed no delay and never sees a cut; that is `routes` and
//! `body`), and it must not touch counters, the per-worker state or the
//! connection: the caller hands it the token limits, the completion id and
//! the model.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Deterministic "generated" text: the worker cycles through these, one per token.
const WORDS: [&str; 8] = [
    "Lorem",
    " ipsum",
    " dolor",
    " sit",
    " amet",
    ",",
    " consectetur",
    " adipiscing",
];

#[derive(Deserialize)]
struct InferenceRequest {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<Value>,
}

#[derive(Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: Option<Value>,
}

fn parse_inference(body: &[u8]) -> Result<InferenceRequest, String> {
    // serde would also accept a JSON array positionally; OpenAI bodies are objects.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err("request body must be a JSON object".to_owned());
    }
    serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))
}

/// A cheap, deterministic stand-in for a tokenizer: whitespace-separated words,
/// and one token per element of a pre-tokenized prompt.
fn count_prompt_tokens(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.split_whitespace().count() as u64,
        Value::Number(_) => 1,
        Value::Array(items) => items.iter().map(count_prompt_tokens).sum(),
        Value::Object(map) => map.get("text").map_or(0, count_prompt_tokens),
        Value::Null | Value::Bool(_) => 0,
    }
}

/// A completion request, parsed and sized but not yet given an id.
pub(crate) struct CompletionRequest {
    kind: Kind,
    /// `stream: true`: answer with SSE events rather than one JSON body.
    pub(crate) stream: bool,
    /// Completion tokens to generate.
    pub(crate) tokens: u64,
    prompt_tokens: u64,
    finish_reason: &'static str,
}

impl CompletionRequest {
    /// Parses a `POST /v1/chat/completions` or `POST /v1/completions` body;
    /// an error is the message of the 400 answer.
    pub(crate) fn parse(
        kind: Kind,
        body: &[u8],
        default_tokens: u64,
        max_tokens_cap: u64,
    ) -> Result<Self, String> {
        let req = parse_inference(body)?;
        let requested = req.max_completion_tokens.or(req.max_tokens);
        let tokens = requested.map_or(default_tokens, |n| n.min(max_tokens_cap));
        let prompt_tokens = match kind {
            Kind::Chat => req
                .messages
                .iter()
                .flatten()
                .filter_map(|m| m.content.as_ref())
                .map(count_prompt_tokens)
                .sum(),
            Kind::Text => req.prompt.as_ref().map_or(0, count_prompt_tokens),
        };
        Ok(CompletionRequest {
            kind,
            stream: req.stream == Some(true),
            tokens,
            prompt_tokens,
            finish_reason: if requested.is_some() {
                "length"
            } else {
                "stop"
            },
        })
    }

    /// The completion to produce, numbered `id` and created now.
    pub(crate) fn into_generation(self, id: u64, model: Arc<str>) -> Generation {
        Generation {
            kind: self.kind,
            id: format!("{}{id}", self.kind.id_prefix()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model,
            tokens: self.tokens,
            prompt_tokens: self.prompt_tokens,
            finish_reason: self.finish_reason,
            with_usage: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Text,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-mock",
            Kind::Text => "cmpl-mock",
        }
    }
}

/// One completion to produce: everything its body or its SSE events are made of.
pub(crate) struct Generation {
    kind: Kind,
    id: String,
    created: u64,
    model: Arc<str>,
    tokens: u64,
    prompt_tokens: u64,
    finish_reason: &'static str,
    /// Whether the body (or the last SSE event) carries `usage`.
    with_usage: bool,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
struct Completion<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [C; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessageOut<'a>,
    finish_reason: &'a str,
}

#[derive(Serialize)]
struct ChatMessageOut<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    content: &'a str,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
}

impl Generation {
    /// The same completion without its `usage` object.
    pub(crate) fn without_usage(self) -> Self {
        Self {
            with_usage: false,
            ..self
        }
    }

    fn usage(&self) -> Option<Usage> {
        self.with_usage.then(|| Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.tokens,
            total_tokens: self.prompt_tokens + self.tokens,
        })
    }

    fn token(i: u64) -> &'static str {
        WORDS[(i % WORDS.len() as u64) as usize]
    }

    /// SSE chunks: one per token, and at least one so the usage has a carrier.
    pub(crate) fn chunks(&self) -> u64 {
        self.tokens.max(1)
    }

    /// The envelope shared by every body and SSE chunk, around its one choice.
    fn completion<C>(
        &self,
        object: &'static str,
        choice: C,
        usage: Option<Usage>,
    ) -> Completion<'_, C> {
        Completion {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices: [choice],
            usage,
        }
    }

    /// The whole non-streaming JSON body.
    pub(crate) fn full_body(&self) -> Vec<u8> {
        let text: String = (0..self.tokens).map(Self::token).collect();
        let usage = self.usage();
        let out = match self.kind {
            Kind::Chat => serde_json::to_vec(&self.completion(
                "chat.completion",
                ChatChoice {
                    index: 0,
                    message: ChatMessageOut {
                        role: "assistant",
                        content: &text,
                    },
                    finish_reason: self.finish_reason,
                },
                usage,
            )),
            Kind::Text => serde_json::to_vec(&self.completion(
                "text_completion",
                TextChoice {
                    index: 0,
                    text: &text,
                    logprobs: None,
                    finish_reason: Some(self.finish_reason),
                },
                usage,
            )),
        };
        out.unwrap_or_default()
    }

    /// The SSE event for chunk `i` (`0..chunks()`); the last one carries
    /// `finish_reason` and `usage`.
    pub(crate) fn chunk_event(&self, i: u64) -> Bytes {
        let last = i + 1 == self.chunks();
        let content = if i < self.tokens { Self::token(i) } else { "" };
        let finish_reason = last.then_some(self.finish_reason);
        let usage = last.then(|| self.usage()).flatten();
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(b"data: ");
        let written = match self.kind {
            Kind::Chat => serde_json::to_writer(
                &mut out,
                &self.completion(
                    "chat.completion.chunk",
                    ChatChunkChoice {
                        index: 0,
                        delta: ChatDelta {
                            role: (i == 0).then_some("assistant"),
                            content,
                        },
                        finish_reason,
                    },
                    usage,
                ),
            ),
            Kind::Text => serde_json::to_writer(
                &mut out,
                &self.completion(
                    "text_completion",
                    TextChoice {
                        index: 0,
                        text: content,
                        logprobs: None,
                        finish_reason,
                    },
                    usage,
                ),
            ),
        };
        debug_assert!(written.is_ok());
        out.extend_from_slice(b"\n\n");
        out.into()
    }
}

#[cfg(test)]
mod tests {
    use http::header::CONTENT_TYPE;
    use http::{Method, StatusCode};
    use serde_json::Value;

    use crate::shared::{JSON, WORKER_HEADER};
    use crate::test_support::*;

    #[tokio::test]
    async fn chat_completion_shape() {
        let w = worker("w-shape").await;
        let a = chat(&w, CHAT).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.headers[WORKER_HEADER], "w-shape");
        assert_eq!(a.headers[CONTENT_TYPE], JSON);
        let v = a.json();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["model"], "demo-model");
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], "Lorem ipsum dolor");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["prompt_tokens"], 4);
        assert_eq!(v["usage"]["completion_tokens"], 3);
        assert_eq!(v["usage"]["total_tokens"], 7);

        // No max_tokens: the default length, a natural stop.
        let v = chat(&w, r#"{"messages":[]}"#).await.json();
        assert_eq!(v["usage"]["completion_tokens"], 8);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        // max_tokens is capped.
        let v = chat(&w, r#"{"messages":[],"max_tokens":1000000}"#)
            .await
            .json();
        assert_eq!(v["usage"]["completion_tokens"], 4096);
    }

    #[tokio::test]
    async fn text_completion_and_models_shape() {
        let w = worker("w-text").await;
        let a = complete(&w, r#"{"prompt":"a b","max_tokens":2}"#).await;
        assert_eq!(a.status, StatusCode::OK);
        let v = a.json();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], "Lorem ipsum");
        assert_eq!(v["usage"]["prompt_tokens"], 2);
        assert_eq!(v["usage"]["total_tokens"], 4);

        let a = call(&w, Method::GET, "/v1/models", "").await;
        assert_eq!(a.status, StatusCode::OK);
        let v = a.json();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["id"], "demo-model");
        assert_eq!(v["data"][0]["object"], "model");

        let a = call(&w, Method::GET, "/health", "").await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.json(), serde_json::json!({"status": "ok"}));
        assert_eq!(a.headers[WORKER_HEADER], "w-text");
    }

    #[tokio::test]
    async fn chat_stream_shape() {
        let w = worker("w-stream").await;
        let a = chat(&w, CHAT_STREAM).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.headers[CONTENT_TYPE], "text/event-stream");
        assert_eq!(a.headers[WORKER_HEADER], "w-stream");
        let events = sse_events(&a.body);
        assert_eq!(events.len(), 5, "4 token chunks and [DONE]: {events:?}");
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..4]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(text, "Lorem ipsum dolor sit");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        for c in &chunks[..3] {
            assert_eq!(c["object"], "chat.completion.chunk");
            assert!(c.get("usage").is_none());
            assert!(c["choices"][0]["finish_reason"].is_null());
        }
        let last = &chunks[3];
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"]["prompt_tokens"], 2);
        assert_eq!(last["usage"]["completion_tokens"], 4);
        assert_eq!(last["usage"]["total_tokens"], 6);
    }

    #[tokio::test]
    async fn text_stream_shape() {
        let w = worker("w-tstream").await;
        let a = complete(
            &w,
            r#"{"prompt":["x y", "z"],"max_tokens":2,"stream":true}"#,
        )
        .await;
        let events = sse_events(&a.body);
        assert_eq!(events.len(), 3);
        assert_eq!(events[2], "[DONE]");
        let last: Value = serde_json::from_str(&events[1]).unwrap();
        assert_eq!(last["object"], "text_completion");
        assert_eq!(last["choices"][0]["text"], " ipsum");
        assert_eq!(last["usage"]["prompt_tokens"], 3);
        assert_eq!(last["usage"]["completion_tokens"], 2);
    }
}

//! Phase: routing and the model.
//!
//! Owns what every attempt of a request sends ([`Outgoing`]): the model read
//! from the body, the routing key, the headers forwarded, and the switch to a
//! fallback model; and the choice of a worker with its breaker admission. It
//! reads the fleet and admits on breakers; it records no outcome.

use std::borrow::Cow;

use bytes::Bytes;
use http::Method;
use http::header;

use crate::wire::Headers;

use balancer_core::registry::Attempt;
use balancer_core::selection::Prompt;

use super::Proxy;
use super::body::RequestBody;
use super::edge::Forwarded;
use super::scan::{self, Found};

/// What every attempt of one request sends.
pub(crate) struct Outgoing {
    pub(crate) method: Method,
    /// The normalised path and the query: an inference route's is the
    /// route list's own spelling, borrowed.
    pub(crate) path: Cow<'static, str>,
    pub(crate) headers: Forwarded,
    pub(crate) model: Option<String>,
    pub(crate) key: Option<u64>,
    /// The model the client asked for, when a fallback replaced it.
    pub(crate) fallback_from: Option<String>,
    /// The rendered prompt, under `cache_aware` only ([`super::prompt`]).
    pub(crate) prompt: Option<Vec<u8>>,
}

impl Proxy {
    /// Switches a request to its model's fallback model: the body's `model`
    /// is rewritten and the response will name the fallback. Only a body kept
    /// for replay can be rewritten.
    pub(crate) fn take_fallback(&self, req: &mut Outgoing, body: Option<&mut RequestBody>) -> bool {
        let Some(from) = req.model.as_deref() else {
            return false;
        };
        let Some(to) = self.config.fallbacks.get(from) else {
            return false;
        };
        let Some(RequestBody::Replayable(bytes, _)) = body else {
            return false;
        };
        let Some(rewritten) = with_model(bytes, to) else {
            return false;
        };
        // A model name is bounded, so the rewritten body stays within a few
        // bytes of the lease's count: it keeps the lease.
        *bytes = rewritten;
        tracing::debug!(from, to, "model fallback");
        self.stats.fallback(from, to);
        req.fallback_from.get_or_insert_with(|| from.to_owned());
        req.model = Some(to.clone());
        true
    }

    /// Picks an eligible worker for the request's model and admits the
    /// attempt on its breaker.
    pub(crate) fn select(&self, req: &Outgoing, tried: &[u64]) -> Option<Attempt> {
        let fleet = self.registry.fleet();
        let (candidates, ring) = fleet.candidates(req.model.as_deref());
        // A model no worker declares shares one set of trees: a client's
        // invented names grow nothing.
        let prompt = req.prompt.as_deref().map(|text| Prompt {
            model: req
                .model
                .as_deref()
                .filter(|m| fleet.declares(m))
                .unwrap_or(""),
            text,
        });
        self.selector
            .attempt_prompt(candidates, ring, req.key, prompt, tried, &*self.clock)
    }
}

/// `body` with its `model` replaced, if it is a JSON object.
pub(crate) fn with_model(body: &Bytes, model: &str) -> Option<Bytes> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value
        .as_object_mut()?
        .insert("model".to_owned(), model.into());
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

/// The longest `model` a request may name: model ids are short, and a
/// long one is a client's attempt at a large label or key.
pub(crate) const MAX_MODEL_LEN: usize = 256;

#[derive(serde::Deserialize)]
struct ModelOnly {
    #[serde(default)]
    model: Option<serde_json::Value>,
}

fn named_model(parsed: ModelOnly) -> Result<Option<String>, String> {
    named(match parsed.model {
        Some(serde_json::Value::String(m)) => Some(m),
        _ => None,
    })
}

/// A model name within [`MAX_MODEL_LEN`].
fn named(model: Option<String>) -> Result<Option<String>, String> {
    match model {
        Some(m) if m.len() > MAX_MODEL_LEN => Err(format!(
            "the model name is longer than {MAX_MODEL_LEN} bytes"
        )),
        m => Ok(m),
    }
}

/// The `model` of an inference request, whose body must be a JSON object
/// whatever its `Content-Type` says: anything else is a 400 from the
/// gateway, never a worker's error.
pub(crate) fn inference_model(body: &Bytes) -> Result<Option<String>, String> {
    // The common body, answered in one pass; serde reads the rest.
    if let Some(found) = scan::model(body) {
        return named(match found {
            Found::Model(m) => Some(m.to_owned()),
            Found::NoModel => None,
        });
    }
    // A derived struct would also accept a JSON array; the body must be an object.
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err("the request body is not a JSON object".to_owned());
    }
    match serde_json::from_slice::<ModelOnly>(body) {
        Ok(parsed) => named_model(parsed),
        Err(e) => Err(format!("the request body is not a JSON object: {e}")),
    }
}

/// The top-level `model` string of a JSON object that begins with `prefix`
/// (an inference body past the buffered limit, whose rest streams on);
/// `None` when the prefix names no complete top-level `model` string.
pub(crate) fn model_in_prefix(prefix: &[u8]) -> Option<String> {
    fn string_end(b: &[u8], start: usize) -> Option<usize> {
        let mut i = start + 1;
        while i < b.len() {
            match b[i] {
                b'\\' => i += 2,
                b'"' => return Some(i),
                _ => i += 1,
            }
        }
        None
    }
    let skip_space = |mut i: usize| {
        while prefix.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    let (mut depth, mut expect_key, mut i) = (0usize, false, 0usize);
    while i < prefix.len() {
        match prefix[i] {
            b'"' => {
                let end = string_end(prefix, i)?;
                if depth == 1 && expect_key {
                    expect_key = false;
                    if &prefix[i..=end] == b"\"model\"" {
                        let colon = skip_space(end + 1);
                        if prefix.get(colon) != Some(&b':') {
                            return None;
                        }
                        let start = skip_space(colon + 1);
                        if prefix.get(start) != Some(&b'"') {
                            return None;
                        }
                        let value_end = string_end(prefix, start)?;
                        return serde_json::from_slice(&prefix[start..=value_end]).ok();
                    }
                }
                i = end + 1;
                continue;
            }
            b'{' => {
                depth += 1;
                expect_key = depth == 1;
            }
            b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            b',' if depth == 1 => expect_key = true,
            _ => {}
        }
        i += 1;
    }
    None
}

/// `body` asking the worker to end its stream with a `usage` chunk
/// (`stream_options.include_usage`), so a token budget counts streams too;
/// `None` when it is not a streamed JSON request or already asks.
pub(crate) fn with_usage_requested(body: &Bytes) -> Option<Bytes> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    if object.get("stream") != Some(&serde_json::Value::Bool(true)) {
        return None;
    }
    let options = object
        .entry("stream_options")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()?;
    if options.get("include_usage") == Some(&serde_json::Value::Bool(true)) {
        return None;
    }
    options.insert("include_usage".to_owned(), true.into());
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

/// The `model` of a JSON body. A body that claims to be JSON and is not gets
/// a 400 here rather than a worker's error, and records nothing.
pub(crate) fn request_model(headers: &Headers, body: &Bytes) -> Result<Option<String>, String> {
    let declared_json = headers
        .get(&header::CONTENT_TYPE)
        .is_some_and(|ct| ct.windows(4).any(|w| w == b"json"));
    let looks_json = body.first() == Some(&b'{');
    if body.is_empty() || !(declared_json || looks_json) {
        return Ok(None);
    }
    match serde_json::from_slice::<ModelOnly>(body) {
        Ok(parsed) => named_model(parsed),
        Err(e) if declared_json => Err(format!("the request body is not valid JSON: {e}")),
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_of_a_streamed_body_is_read_from_its_prefix() {
        for (prefix, model) in [
            (
                &br#"{"model":"m1","messages":[{"content":"x"#[..],
                Some("m1"),
            ),
            (
                br#" { "stream": true, "model" : "a\"b", "x": 1"#,
                Some("a\"b"),
            ),
            (
                br#"{"messages":[{"model":"inner"}],"model":"outer","#,
                Some("outer"),
            ),
            (br#"{"messages":[{"content":"\"model\":\"no\""}]"#, None),
            (br#"{"model":"cut"#, None),
            (br#"["model","m"]"#, None),
            (br#"{"model":7,"#, None),
        ] {
            assert_eq!(
                model_in_prefix(prefix).as_deref(),
                model,
                "{}",
                String::from_utf8_lossy(prefix)
            );
        }
    }

    #[test]
    fn an_inference_body_must_be_a_json_object() {
        assert!(inference_model(&Bytes::from_static(br#"["llama"]"#)).is_err());
        assert!(inference_model(&Bytes::from_static(b"model=x")).is_err());
        assert_eq!(
            inference_model(&Bytes::from_static(b"  {\"model\":\"m\"}"))
                .unwrap()
                .as_deref(),
            Some("m")
        );
    }
}

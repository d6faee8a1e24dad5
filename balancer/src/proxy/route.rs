//! Phase: routing and the model.
//!
//! Owns what every attempt of a request sends ([`Outgoing`]): the model read
//! from the body, the routing key, the headers forwarded, and the switch to a
//! fallback model; and the choice of a worker with its breaker admission. It
//! reads the fleet and admits on breakers; it records no outcome.

use bytes::Bytes;
use http::Method;
use http::header::{self, HeaderMap};

use balancer_core::registry::Attempt;

use super::Proxy;
use super::body::RequestBody;

/// What every attempt of one request sends.
pub(crate) struct Outgoing {
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
    pub(crate) model: Option<String>,
    pub(crate) key: Option<u64>,
    /// The model the client asked for, when a fallback replaced it.
    pub(crate) fallback_from: Option<String>,
}

impl Proxy {
    /// Switches a request to its model's fallback model: the body's `model`
    /// is rewritten and the response will name the fallback. Only a body kept
    /// for replay can be rewritten.
    pub(crate) fn take_fallback(&self, req: &mut Outgoing, body: &mut Option<RequestBody>) -> bool {
        let Some(from) = req.model.as_deref() else {
            return false;
        };
        let Some(to) = self.config.fallbacks.get(from) else {
            return false;
        };
        let Some(RequestBody::Replayable(bytes, lease)) = body.as_ref() else {
            return false;
        };
        let Some(rewritten) = with_model(bytes, to) else {
            return false;
        };
        // A model name is bounded, so the rewritten body stays within a few
        // bytes of the lease's count.
        let lease = lease.clone();
        tracing::debug!(from, to, "model fallback");
        self.stats.fallback(from, to);
        req.fallback_from.get_or_insert_with(|| from.to_owned());
        req.model = Some(to.clone());
        *body = Some(RequestBody::Replayable(rewritten, lease));
        true
    }

    /// Picks an eligible worker for the request's model and admits the
    /// attempt on its breaker.
    pub(crate) fn select(&self, req: &Outgoing, tried: &[u64]) -> Option<Attempt> {
        let fleet = self.registry.fleet();
        let (candidates, ring) = fleet.candidates(req.model.as_deref());
        self.selector
            .attempt(candidates, ring, req.key, tried, &*self.clock)
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
    match parsed.model {
        Some(serde_json::Value::String(m)) if m.len() > MAX_MODEL_LEN => Err(format!(
            "the model name is longer than {MAX_MODEL_LEN} bytes"
        )),
        Some(serde_json::Value::String(m)) => Ok(Some(m)),
        _ => Ok(None),
    }
}

/// The `model` of an inference request, whose body must be a JSON object
/// whatever its `Content-Type` says: anything else is a 400 from the
/// gateway, never a worker's error.
pub(crate) fn inference_model(body: &Bytes) -> Result<Option<String>, String> {
    match serde_json::from_slice::<ModelOnly>(body) {
        Ok(parsed) => named_model(parsed),
        Err(e) => Err(format!("the request body is not a JSON object: {e}")),
    }
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
pub(crate) fn request_model(headers: &HeaderMap, body: &Bytes) -> Result<Option<String>, String> {
    let declared_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.contains("json"));
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

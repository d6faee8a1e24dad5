//! Phase: routing and the model.
//!
//! Owns what every attempt of a request sends ([`Outgoing`]): the model read
//! from the body, the routing key, the headers forwarded, and the switch to a
//! fallback model; and the choice of a worker with its breaker admission. It
//! reads the fleet and admits on breakers; it records no outcome.

use bytes::Bytes;
use http::Method;
use http::header::{self, HeaderMap, HeaderName};

use balancer_core::registry::Attempt;

use super::Proxy;
use super::body::RequestBody;

/// Headers that describe one hop, not the message.
pub(crate) const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

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
        let Some(RequestBody::Replayable(bytes)) = body.as_ref() else {
            return false;
        };
        let Some(rewritten) = with_model(bytes, to) else {
            return false;
        };
        tracing::debug!(from, to, "model fallback");
        self.stats.fallback(from, to);
        req.fallback_from.get_or_insert_with(|| from.to_owned());
        req.model = Some(to.clone());
        *body = Some(RequestBody::Replayable(rewritten));
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
fn with_model(body: &Bytes, model: &str) -> Option<Bytes> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value
        .as_object_mut()?
        .insert("model".to_owned(), model.into());
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

pub(crate) fn forward_headers(mut headers: HeaderMap) -> HeaderMap {
    for h in HOP_BY_HOP {
        headers.remove(h);
    }
    headers.remove(HeaderName::from_static("keep-alive"));
    // The worker's authority comes from the URI; hyper sets Host from it.
    headers.remove(header::HOST);
    // The body may be rewritten (a fallback's model); hyper sets the length
    // of the body actually sent.
    headers.remove(header::CONTENT_LENGTH);
    headers
}

/// The `model` of a JSON body. A body that claims to be JSON and is not gets
/// a 400 here rather than a worker's error, and records nothing.
pub(crate) fn request_model(headers: &HeaderMap, body: &Bytes) -> Result<Option<String>, String> {
    #[derive(serde::Deserialize)]
    struct ModelOnly {
        #[serde(default)]
        model: Option<serde_json::Value>,
    }
    let declared_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.contains("json"));
    let looks_json = body.first() == Some(&b'{');
    if body.is_empty() || !(declared_json || looks_json) {
        return Ok(None);
    }
    match serde_json::from_slice::<ModelOnly>(body) {
        Ok(ModelOnly {
            model: Some(serde_json::Value::String(m)),
        }) => Ok(Some(m)),
        Ok(_) => Ok(None),
        Err(e) if declared_json => Err(format!("the request body is not valid JSON: {e}")),
        Err(_) => Ok(None),
    }
}

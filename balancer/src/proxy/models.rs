//! Phase: the model catalogue.
//!
//! Owns what the gateway itself says about models: `GET /v1/models` as the
//! union of the models its routable workers serve (each once, in the OpenAI
//! list shape), and the refusal of a request naming a model no worker
//! declares (404 `model_not_found`, unless `--route-undeclared-models`). It
//! reads the fleet; it never changes it, never picks a worker and records
//! on no breaker.

use std::collections::BTreeSet;

use http::StatusCode;

use super::answer::{ErrorCode, json_response};
use super::{Proxy, ResponseBody};

impl Proxy {
    /// `GET /v1/models`: every model a worker that may take traffic now
    /// (Ready, not draining, circuit not open) serves, sorted, once each.
    /// Workers know only model ids, so `created` is when this gateway
    /// started and `owned_by` names the gateway.
    pub(crate) fn model_list(&self) -> http::Response<ResponseBody> {
        let fleet = self.registry.fleet();
        let mut ids = BTreeSet::new();
        for worker in fleet.workers.iter().filter(|w| w.is_routable()) {
            ids.extend(worker.models().iter().cloned());
        }
        let data: Vec<_> = ids
            .into_iter()
            .map(|id| {
                serde_json::json!({
                    "id": id,
                    "object": "model",
                    "created": self.started_unix,
                    "owned_by": "balancer",
                })
            })
            .collect();
        json_response(
            StatusCode::OK,
            serde_json::json!({ "object": "list", "data": data }),
        )
    }

    /// Whether a request naming `model` is refused: every worker names its
    /// models (in its spec or its `/v1/models`), none names this one, and
    /// `--route-undeclared-models` is off. Any worker would otherwise answer
    /// it as its own model.
    pub(crate) fn refuses_model(&self, model: &str) -> bool {
        !self.config.route_undeclared_models && self.registry.fleet().none_serves(model)
    }

    /// 404 `model_not_found`, in the OpenAI error shape.
    pub(crate) fn model_not_found(&self, model: &str) -> http::Response<ResponseBody> {
        self.gateway_error(
            ErrorCode::ModelNotFound,
            &format!("no worker serves the model {model:?}"),
            None,
        )
    }
}

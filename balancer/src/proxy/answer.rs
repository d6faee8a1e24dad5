//! Phase: the gateway's own answers, in the OpenAI error shape.
//!
//! Owns the stable `code` strings and their statuses, the 503
//! `no_available_workers` answer and its `Retry-After`, and the counting of
//! every answer the gateway makes itself. These responses never come from a
//! worker, so nothing here may record on a breaker.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;

use super::body::BodyError;
use super::{Proxy, ResponseBody};

/// A gateway-made error, with its stable `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorCode {
    /// Every eligible worker is open, NotReady, draining or absent.
    NoAvailableWorkers,
    AdmissionQueueFull,
    AdmissionQueueTimeout,
    /// The last attempt got no response in time.
    UpstreamTimeout,
    /// The last attempt could not connect, or the connection broke.
    UpstreamUnreachable,
    InvalidRequest,
    NotFound,
    Unauthorized,
    /// The model's `--token-budget` is spent for this minute.
    TokenBudgetExceeded,
    /// The method is not allowed on that route.
    MethodNotAllowed,
    /// The body is larger than `--max-payload-size`.
    PayloadTooLarge,
    /// The body sent nothing for `--stream-body-stall-timeout-secs`.
    RequestTimeout,
    /// Kept request bodies already hold the process-wide budget.
    BodyBudgetExhausted,
    /// No worker declares the model the request names.
    ModelNotFound,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 14] = [
        ErrorCode::NoAvailableWorkers,
        ErrorCode::AdmissionQueueFull,
        ErrorCode::AdmissionQueueTimeout,
        ErrorCode::UpstreamTimeout,
        ErrorCode::UpstreamUnreachable,
        ErrorCode::InvalidRequest,
        ErrorCode::NotFound,
        ErrorCode::Unauthorized,
        ErrorCode::TokenBudgetExceeded,
        ErrorCode::MethodNotAllowed,
        ErrorCode::PayloadTooLarge,
        ErrorCode::RequestTimeout,
        ErrorCode::BodyBudgetExhausted,
        ErrorCode::ModelNotFound,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NoAvailableWorkers => "no_available_workers",
            ErrorCode::AdmissionQueueFull => "admission_queue_full",
            ErrorCode::AdmissionQueueTimeout => "admission_queue_timeout",
            ErrorCode::UpstreamTimeout => "upstream_timeout",
            ErrorCode::UpstreamUnreachable => "upstream_unreachable",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::TokenBudgetExceeded => "token_budget_exceeded",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::BodyBudgetExhausted => "body_budget_exhausted",
            ErrorCode::ModelNotFound => "model_not_found",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::NoAvailableWorkers
            | ErrorCode::AdmissionQueueTimeout
            | ErrorCode::BodyBudgetExhausted => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::AdmissionQueueFull | ErrorCode::TokenBudgetExceeded => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ErrorCode::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorCode::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            ErrorCode::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorCode::NotFound | ErrorCode::ModelNotFound => StatusCode::NOT_FOUND,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
        }
    }

    /// The OpenAI `type` field.
    fn kind(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest
            | ErrorCode::NotFound
            | ErrorCode::ModelNotFound
            | ErrorCode::MethodNotAllowed
            | ErrorCode::PayloadTooLarge
            | ErrorCode::RequestTimeout => "invalid_request_error",
            ErrorCode::Unauthorized => "authentication_error",
            ErrorCode::AdmissionQueueFull | ErrorCode::TokenBudgetExceeded => "rate_limit_error",
            _ => "service_unavailable",
        }
    }
}

/// `{"error":{"message","type","code"}}` as bytes.
pub fn error_body(code: ErrorCode, message: &str) -> Bytes {
    let body = serde_json::json!({
        "error": { "message": message, "type": code.kind(), "code": code.as_str() }
    });
    Bytes::from(body.to_string())
}

/// A complete error response; `retry_after` adds the header sheds carry.
pub fn error_response<B: From<Bytes>>(
    code: ErrorCode,
    message: &str,
    retry_after: Option<u64>,
) -> Response<B> {
    let mut response = Response::new(B::from(error_body(code, message)));
    *response.status_mut() = code.status();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(secs) = retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// An SSE event that ends a broken stream, so a client can tell a cut stream
/// from a complete one (which would end with `data: [DONE]`).
pub fn sse_error_event(code: &str, message: &str) -> Bytes {
    let data = serde_json::json!({
        "error": { "message": message, "type": "upstream_error", "code": code }
    });
    Bytes::from(format!("event: error\ndata: {data}\n\n"))
}

pub(crate) fn json_response(status: StatusCode, body: serde_json::Value) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::new(Full::new(Bytes::from(body.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

impl Proxy {
    /// 405, with the methods the route takes in `Allow`.
    pub(crate) fn method_not_allowed(&self, allow: &'static str) -> Response<ResponseBody> {
        let mut r = self.gateway_error(
            ErrorCode::MethodNotAllowed,
            &format!("this route takes {allow}"),
            None,
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        r
    }

    /// The answer to a client whose body broke a bound: the client's fault,
    /// recorded on no breaker.
    pub(crate) fn body_error(&self, error: &BodyError) -> Response<ResponseBody> {
        let (code, message) = match error {
            BodyError::TooLarge => (
                ErrorCode::PayloadTooLarge,
                "the request body is larger than --max-payload-size",
            ),
            BodyError::Stalled => (
                ErrorCode::RequestTimeout,
                "the request body sent nothing within --stream-body-stall-timeout-secs",
            ),
            BodyError::Aborted => (ErrorCode::InvalidRequest, "the request body broke off"),
            BodyError::Invalid(e) => {
                return self.gateway_error(ErrorCode::InvalidRequest, &e.to_string(), None);
            }
            BodyError::OverBudget => (
                ErrorCode::BodyBudgetExhausted,
                "the gateway holds as many request bodies as it may; retry shortly",
            ),
        };
        let retry_after = (*error == BodyError::OverBudget).then_some(1);
        self.gateway_error(code, message, retry_after)
    }

    pub(crate) fn gateway_error(
        &self,
        code: ErrorCode,
        message: &str,
        retry_after: Option<u64>,
    ) -> Response<ResponseBody> {
        self.stats.gateway_response(code);
        error_response::<Full<Bytes>>(code, message, retry_after).map(ResponseBody::new)
    }

    /// 503 `no_available_workers`, with `Retry-After` set to when the first
    /// open circuit among the model's workers goes on trial.
    pub(crate) fn no_available_workers(&self, model: Option<&str>) -> Response<ResponseBody> {
        let fleet = self.registry.fleet();
        let (candidates, _) = fleet.candidates(model);
        let now = self.clock.now();
        let soonest = candidates
            .iter()
            .filter_map(|w| w.breaker.snapshot().open_until)
            .min()
            .map(|at| {
                Duration::from_nanos(at.saturating_sub(now))
                    .as_secs_f64()
                    .ceil() as u64
            });
        let message = match model {
            Some(m) => format!("no available workers for model {m:?}"),
            None => "no available workers".to_owned(),
        };
        self.gateway_error(
            ErrorCode::NoAvailableWorkers,
            &message,
            Some(soonest.unwrap_or(1).max(1)),
        )
    }
}

//! The control API under `/_mock/`: read and reset the counters, set, read
//! and clear the fault, read and change the simulated engine's prefill speed.
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module uses only `config` (the [`Fault`] spec) and `shared` (the
//! per-worker state, its counters and its response helpers). It must not
//! depend on `routes`, `server` or `cli`, nor on how completions are
//! generated or bodies cut. Control calls must never be counted themselves
//! (polling the stats would disturb them), and it must not add a lock: the
//! state it reads and replaces is the request path's atomics and `ArcSwap`.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use hyper::body::Incoming;

use crate::config::Fault;
use crate::shared::{Resp, Shared, read_body};

/// `POST /_mock/engine`: the simulated engine's speed, changed mid-run.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineSpeed {
    prefill_us_per_token: u64,
}

/// A second per token: far slower than any engine, and bounded.
const MAX_PREFILL_US: u64 = 1_000_000;

fn engine_answer(shared: &Shared) -> Resp {
    let speed = EngineSpeed {
        prefill_us_per_token: shared.engine.prefill_per_token().as_micros() as u64,
    };
    shared.json_value(StatusCode::OK, &speed)
}

/// Answers a request under `/_mock/`.
pub(crate) async fn control(shared: &Shared, req: Request<Incoming>) -> Resp {
    let (parts, body) = req.into_parts();
    match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/_mock/stats") => {
            shared.json_value(StatusCode::OK, &shared.stats.snapshot(&shared.engine))
        }
        (&Method::GET, "/_mock/fault") => {
            let guard = shared.fault.load();
            shared.json_value(StatusCode::OK, &guard.as_ref().map(|f| &f.spec))
        }
        (&Method::POST, "/_mock/fault") => {
            let body = match read_body(body).await {
                Ok(b) => b,
                Err(_) => {
                    return shared.error(
                        StatusCode::BAD_REQUEST,
                        "unreadable body",
                        "invalid_body",
                    );
                }
            };
            let fault = serde_json::from_slice::<Fault>(&body)
                .map_err(|e| format!("invalid fault JSON: {e}"))
                .and_then(|f| f.validate().map(|()| f).map_err(|e| e.to_string()));
            match fault {
                Ok(fault) => {
                    let resp = shared.json_value(StatusCode::OK, &fault);
                    shared.set_fault(fault);
                    resp
                }
                Err(msg) => shared.error(StatusCode::BAD_REQUEST, &msg, "invalid_fault"),
            }
        }
        (&Method::DELETE, "/_mock/fault") => {
            shared.clear_fault();
            shared.json(StatusCode::OK, Bytes::from_static(b"null"))
        }
        (&Method::GET, "/_mock/engine") => engine_answer(shared),
        (&Method::POST, "/_mock/engine") => {
            let Ok(body) = read_body(body).await else {
                return shared.error(StatusCode::BAD_REQUEST, "unreadable body", "invalid_body");
            };
            match serde_json::from_slice::<EngineSpeed>(&body) {
                Ok(speed) if speed.prefill_us_per_token <= MAX_PREFILL_US => {
                    shared
                        .engine
                        .set_prefill_per_token(Duration::from_micros(speed.prefill_us_per_token));
                    engine_answer(shared)
                }
                Ok(_) => shared.error(
                    StatusCode::BAD_REQUEST,
                    &format!("prefill_us_per_token must be at most {MAX_PREFILL_US}"),
                    "invalid_engine",
                ),
                Err(e) => shared.error(
                    StatusCode::BAD_REQUEST,
                    &format!("invalid engine JSON: {e}"),
                    "invalid_engine",
                ),
            }
        }
        (&Method::POST, "/_mock/reset") => {
            shared.reset();
            shared.json_value(StatusCode::OK, &shared.stats.snapshot(&shared.engine))
        }
        (_, "/_mock/stats" | "/_mock/fault" | "/_mock/reset" | "/_mock/engine") => shared.error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed",
            "method_not_allowed",
        ),
        _ => shared.error(StatusCode::NOT_FOUND, "unknown control path", "not_found"),
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{Method, Request, StatusCode};
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpStream;
    use tokio::time::timeout;

    use crate::config::Fault;
    use crate::shared::MockStats;
    use crate::test_support::*;

    #[tokio::test]
    async fn stats_count_and_reset() {
        let w = worker("w-stats").await;
        // Several requests on one keep-alive connection.
        let stream = TcpStream::connect(w.addr()).await.unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        for path in ["/health", "/health", "/v1/models", "/missing"] {
            let req = Request::get(path)
                .header(http::header::HOST, "mock")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = timeout(T, tx.send_request(req)).await.unwrap().unwrap();
            timeout(T, resp.into_body().collect())
                .await
                .unwrap()
                .unwrap();
        }
        chat(&w, CHAT).await;
        let s = w.stats();
        assert_eq!(s.requests, 5);
        assert_eq!(s.health_checks, 2);
        assert_eq!(s.inference_requests, 2);
        assert_eq!(s.faults_applied, 0);
        assert!(s.open_connections >= 1, "{s:?}");

        // The control API is not counted, and reports the same numbers.
        let a = call(&w, Method::GET, "/_mock/stats", "").await;
        let over_http: MockStats = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(
            (
                over_http.requests,
                over_http.health_checks,
                over_http.inference_requests
            ),
            (5, 2, 2)
        );

        w.set_fault(Fault {
            status: Some(500),
            ..Fault::default()
        });
        w.reset();
        assert!(w.fault().is_none());
        let s = w.stats();
        assert_eq!(
            (s.requests, s.health_checks, s.inference_requests),
            (0, 0, 0)
        );
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::OK);
    }

    #[tokio::test]
    async fn control_api_over_http() {
        let w = worker("w-ctl").await;
        for bad in [
            "",
            "{",
            r#"{"stauts":500}"#,
            r#"{"every":0}"#,
            r#"{"status":99}"#,
            r#"{"drop":true,"status":500}"#,
            r#"{"stall_after_chunks":1,"truncate_after_chunks":1}"#,
        ] {
            let a = call(&w, Method::POST, "/_mock/fault", bad).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{bad:?}");
            assert!(a.json()["error"]["message"].is_string());
        }
        assert!(w.fault().is_none());

        let a = call(
            &w,
            Method::POST,
            "/_mock/fault",
            r#"{"status":502,"count":1}"#,
        )
        .await;
        assert_eq!(a.status, StatusCode::OK);
        let expected = Fault {
            status: Some(502),
            count: Some(1),
            ..Fault::default()
        };
        assert_eq!(w.fault(), Some(expected.clone()));
        let current: Option<Fault> =
            serde_json::from_slice(&call(&w, Method::GET, "/_mock/fault", "").await.body).unwrap();
        assert_eq!(current, Some(expected));
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::BAD_GATEWAY);

        // A POST replaces the fault, DELETE clears it.
        call(&w, Method::POST, "/_mock/fault", r#"{"status":500}"#).await;
        assert_eq!(
            chat(&w, CHAT).await.status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            call(&w, Method::DELETE, "/_mock/fault", "").await.status,
            StatusCode::OK
        );
        assert_eq!(chat(&w, CHAT).await.status, StatusCode::OK);

        let a = call(&w, Method::POST, "/_mock/reset", "").await;
        assert_eq!(a.status, StatusCode::OK);
        let s: MockStats =
            serde_json::from_slice(&call(&w, Method::GET, "/_mock/stats", "").await.body).unwrap();
        assert_eq!(
            (s.requests, s.inference_requests, s.faults_applied),
            (0, 0, 0)
        );
    }
}

//! An in-process gateway in front of demo workers on loopback, for the
//! end-to-end tests of the L7 path. The gateway runs on a `ManualClock`, so
//! open timeouts move only when a test advances it.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use balancer::config::GatewayConfig;
use balancer::gateway::Gateway;
use balancer_core::breaker::Snapshot;
use balancer_core::clock::ManualClock;
use balancer_mock_worker::{Fault, MockWorker, MockWorkerConfig};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub const BOUND: Duration = Duration::from_secs(10);

pub struct Harness {
    pub gw: Gateway,
    pub workers: Vec<MockWorker>,
    pub clock: Arc<ManualClock>,
    client: Client<HttpConnector, Full<Bytes>>,
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub const CHAT: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#;
pub const STREAM: &str = r#"{"model":"demo-model","stream":true,"max_tokens":6,"messages":[{"role":"user","content":"hi"}]}"#;

/// Fast retries, no probes nor load scrapes unless a test asks for them
/// (a test that counts what a worker received sees only its own requests).
pub fn quiet(c: &mut GatewayConfig) {
    c.proxy.retry.initial_backoff = Duration::from_millis(1);
    c.proxy.retry.max_backoff = Duration::from_millis(5);
    c.health_check.enabled = false;
    c.load_monitor.interval = None;
}

/// Demo workers named `names`, serving `demo-model`, behind a gateway that
/// `configure` adjusts.
pub async fn harness(names: &[&str], configure: impl FnOnce(&mut GatewayConfig)) -> Harness {
    let workers: Vec<_> = names.iter().map(|n| (*n, "demo-model")).collect();
    harness_with_models(&workers, configure).await
}

/// Demo workers `(name, model)` behind a gateway with the default
/// configuration, adjusted by `configure`, every listener on a free
/// loopback port.
pub async fn harness_with_models(
    specs: &[(&str, &str)],
    configure: impl FnOnce(&mut GatewayConfig),
) -> Harness {
    let mut workers = Vec::new();
    for (name, model) in specs {
        let config = MockWorkerConfig {
            model: (*model).to_owned(),
            ..MockWorkerConfig::named(*name)
        };
        let w = MockWorker::spawn(SocketAddr::from(([127, 0, 0, 1], 0)), config)
            .await
            .expect("mock worker");
        workers.push(w);
    }
    let urls: Vec<String> = workers.iter().map(MockWorker::url).collect();
    let mut h = harness_with_urls(&urls, configure).await;
    h.workers = workers;
    h
}

/// A gateway in front of workers at `urls` (any HTTP server, such as a
/// [`crate::capture::CaptureWorker`]); `Harness::workers` is empty.
pub async fn harness_with_urls(
    urls: &[String],
    configure: impl FnOnce(&mut GatewayConfig),
) -> Harness {
    let h = harness_unprobed(urls, configure).await;
    // Models are learned from /v1/models in the background; wait for them so
    // that model-based selection is what the tests exercise.
    let fleet_ready = || {
        h.gw.registry
            .fleet()
            .workers
            .iter()
            .all(|w| !w.models().is_empty())
    };
    eventually("models learned", || std::future::ready(fleet_ready())).await;
    h
}

/// [`harness_with_urls`] without waiting for the workers' models: for
/// workers that cannot answer.
pub async fn harness_unprobed(
    urls: &[String],
    configure: impl FnOnce(&mut GatewayConfig),
) -> Harness {
    let workers = Vec::new();
    let mut config = GatewayConfig::with_worker_urls(urls);
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.metrics_listen = config.listen;
    config.admin_listen = config.listen;
    configure(&mut config);
    let clock = Arc::new(ManualClock::new());
    let gw = Gateway::start_with_clock(config, clock.clone())
        .await
        .expect("gateway starts");
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    Harness {
        gw,
        workers,
        clock,
        client,
    }
}

pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + BOUND;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Harness {
    pub async fn call(
        &self,
        addr: SocketAddr,
        method: Method,
        path: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> Reply {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"))
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
        let resp = tokio::time::timeout(BOUND, self.client.request(req))
            .await
            .expect("bounded")
            .expect("gateway answers");
        let (parts, body) = resp.into_parts();
        let body = tokio::time::timeout(BOUND, body.collect())
            .await
            .expect("bounded")
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    pub async fn chat(&self, body: &str) -> Reply {
        self.call(
            self.gw.addr,
            Method::POST,
            "/v1/chat/completions",
            body,
            &[],
        )
        .await
    }

    pub async fn admin(&self, method: Method, path: &str, body: &str) -> Reply {
        self.call(self.gw.admin_addr, method, path, body, &[]).await
    }

    pub async fn metrics(&self) -> String {
        self.call(self.gw.metrics_addr, Method::GET, "/metrics", "", &[])
            .await
            .text()
    }

    pub fn breaker(&self, i: usize) -> Snapshot {
        let url = self.workers[i].url();
        self.gw
            .registry
            .fleet()
            .get(&url)
            .expect("worker registered")
            .breaker
            .snapshot()
    }

    pub fn served(&self, i: usize) -> u64 {
        self.workers[i].stats().inference_requests
    }

    pub async fn stop(self) {
        self.gw.shutdown().await;
        for w in self.workers {
            w.shutdown().await;
        }
    }
}

pub fn always(status: u16) -> Fault {
    Fault {
        status: Some(status),
        ..Fault::default()
    }
}

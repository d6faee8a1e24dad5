//! Background probes: each worker's health check and model discovery.
//!
//! Owns the I/O around the pure health state machine of `balancer-core`: one
//! `GET <endpoint>` per interval with a timeout, fed to the registry (which
//! turns a promotion into a breaker trial), and the worker's `/v1/models`
//! until its models are known. It never records on a breaker itself.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use balancer_core::registry::{Registry, Worker};
use balancer_core::spec::WorkerAddress;

use crate::tls::{WorkerConnector, WorkerTls, WorkerTlsConfig};

/// The client of the background reads: health probes, models, load scrapes.
pub(super) type ProbeClient = Client<WorkerConnector, Empty<Bytes>>;

/// How each worker's background task probes it.
#[derive(Clone)]
pub struct Prober {
    registry: Arc<Registry>,
    client: ProbeClient,
    config: HealthCheckConfig,
}

/// `--health-check-*`: how workers are probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheckConfig {
    /// Probes run at all (`--disable-health-check` turns them off; models
    /// are still learned).
    pub enabled: bool,
    pub endpoint: String,
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for HealthCheckConfig {
    /// The reference gateway's defaults.
    fn default() -> Self {
        Self {
            enabled: true,
            endpoint: "/health".to_owned(),
            interval: Duration::from_secs(60),
            timeout: Duration::from_secs(5),
        }
    }
}

impl Prober {
    /// Probes over `connector`: the same TLS client as the request path,
    /// so a probe meets a worker's certificate as a request does.
    pub fn new(
        registry: Arc<Registry>,
        config: HealthCheckConfig,
        connector: WorkerConnector,
    ) -> Self {
        Self {
            registry,
            client: Client::builder(TokioExecutor::new()).build(connector),
            config,
        }
    }

    /// Its client (a handle on the same pool), for the load scrapes.
    pub(super) fn client(&self) -> ProbeClient {
        self.client.clone()
    }

    /// Starts probing `worker` until it is removed.
    pub fn spawn(&self, worker: &Arc<Worker>) {
        let (this, weak) = (self.clone(), Arc::downgrade(worker));
        let task = tokio::spawn(async move {
            loop {
                let Some(worker) = weak.upgrade() else { return };
                if worker.models().is_empty()
                    && let Some(models) =
                        fetch_models(&this.client, &worker.address, this.config.timeout).await
                {
                    this.registry.learn_models(&worker, models);
                }
                if this.config.enabled {
                    let path = this.config.endpoint.clone();
                    let result = match get(&worker.address, &path) {
                        Some(request) => probe(&this.client, request, this.config.timeout).await,
                        None => ProbeResult::BadUri,
                    };
                    this.registry
                        .observe_health(&worker, result == ProbeResult::Passed, &result);
                } else if !worker.models().is_empty() {
                    return;
                }
                drop(worker);
                tokio::time::sleep(this.config.interval).await;
            }
        });
        worker.add_task(task.abort_handle());
    }
}

/// The model ids the worker at `address` reports on `/v1/models`, asked
/// once over a connection of its own (`balancer register` without
/// `--model`); `None` when it does not answer a non-empty list in time.
pub async fn served_models(address: &WorkerAddress, timeout: Duration) -> Option<Vec<String>> {
    let tls = Arc::new(WorkerTls::load(&WorkerTlsConfig::default(), Arc::default()).ok()?);
    let client = Client::builder(TokioExecutor::new()).build(tls.connector(timeout));
    fetch_models(&client, address, timeout).await
}

/// The model ids a worker reports on `/v1/models`; `None` unless it answers
/// a non-empty list within `timeout`.
async fn fetch_models(
    client: &ProbeClient,
    address: &WorkerAddress,
    timeout: Duration,
) -> Option<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Models {
        data: Vec<Model>,
    }
    #[derive(serde::Deserialize)]
    struct Model {
        id: String,
    }
    let request = get(address, "/v1/models")?;
    let fetch = async {
        let response = client.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = response.into_body().collect().await.ok()?.to_bytes();
        let models: Models = serde_json::from_slice(&body).ok()?;
        Some(models.data.into_iter().map(|m| m.id).collect::<Vec<_>>())
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .ok()
        .flatten()
        .filter(|m| !m.is_empty())
}

/// `GET path` on the worker at `address`, with the worker URL's credentials
/// if it has any.
pub(super) fn get(address: &WorkerAddress, path: &str) -> Option<http::Request<Empty<Bytes>>> {
    let mut request = http::Request::get(format!("{}{path}", address.base));
    if let Some(auth) = &address.basic_auth {
        request = request.header(http::header::AUTHORIZATION, auth.expose());
    }
    request.body(Empty::new()).ok()
}

/// One probe: the request must answer 2xx within `timeout`, body included.
async fn probe(
    client: &ProbeClient,
    request: http::Request<Empty<Bytes>>,
    timeout: Duration,
) -> ProbeResult {
    let attempt = async {
        let response = match client.request(request).await {
            Ok(response) => response,
            Err(error) => return ProbeResult::from_error(&error),
        };
        let status = response.status();
        if let Err(error) = response.into_body().collect().await {
            return ProbeResult::Failed(innermost(&error));
        }
        if status.is_success() {
            ProbeResult::Passed
        } else {
            ProbeResult::Status(status.as_u16())
        }
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or(ProbeResult::Timeout(timeout))
}

/// What one probe found, as the health transition it causes logs it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ProbeResult {
    Passed,
    /// The worker answered a status outside 2xx.
    Status(u16),
    /// Nothing listens at the worker's address.
    Refused,
    /// No whole answer within the probe timeout.
    Timeout(Duration),
    /// Any other transport failure: its innermost cause.
    Failed(String),
    /// The endpoint does not make a request URI with the worker's address.
    BadUri,
}

impl ProbeResult {
    fn from_error(error: &hyper_util::client::legacy::Error) -> Self {
        let mut source: Option<&dyn std::error::Error> = Some(error);
        while let Some(cause) = source {
            if let Some(io) = cause.downcast_ref::<std::io::Error>()
                && io.kind() == std::io::ErrorKind::ConnectionRefused
            {
                return ProbeResult::Refused;
            }
            source = cause.source();
        }
        ProbeResult::Failed(innermost(error))
    }
}

impl std::fmt::Display for ProbeResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeResult::Passed => f.write_str("passed"),
            ProbeResult::Status(status) => write!(f, "status {status}"),
            ProbeResult::Refused => f.write_str("connection refused"),
            ProbeResult::Timeout(after) => write!(f, "timeout after {} ms", after.as_millis()),
            ProbeResult::Failed(cause) => f.write_str(cause),
            ProbeResult::BadUri => f.write_str("the endpoint makes no valid URI"),
        }
    }
}

/// The deepest cause of `error`: the one that says what happened.
fn innermost(error: &(dyn std::error::Error + 'static)) -> String {
    let mut deepest = error;
    while let Some(cause) = deepest.source() {
        deepest = cause;
    }
    deepest.to_string()
}

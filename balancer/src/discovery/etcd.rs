//! Worker discovery through etcd (v3 API), and the registration sidecar.
//!
//! A worker is the key `<prefix>workers/<id>` whose value is JSON
//! `{"url", "model"?, "labels"?, "resilience"?}`, normally attached to a
//! lease its worker (or `balancer register`) keeps alive. The agent loads the
//! prefix, then watches it from the loaded revision; a put adds or updates,
//! a delete or lease expiry drains and removes. When etcd cannot be reached
//! nothing is removed: the last known set keeps serving, `discovery_up`
//! reads 0, and reconnection (backoff capped at 2 s) resyncs before watching
//! again. Owns the etcd client; applies changes only through
//! [`FleetUpdates`]. The sidecar given no model asks its worker's
//! `/v1/models` through [`crate::proxy::served_models`], nothing else.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};

use balancer_core::metrics::{MetricsSource, Writer};
use balancer_core::spec::{WorkerAddress, WorkerSpec};

use super::{Discovery, DiscoveryFuture, FleetUpdates};
use crate::proxy::served_models;

/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// HTTP/2 ping interval on the etcd connection while a watch or a lease
/// keep-alive is open. etcd refuses pings closer than its
/// `--grpc-keepalive-min-time` (5 s by default) and, after a few, closes the
/// connection; 10 s leaves room for that and is gRPC's own floor.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a ping may go unanswered before the connection counts as lost.
/// A silent etcd (host gone, network cut) is therefore noticed within
/// `KEEP_ALIVE_INTERVAL + KEEP_ALIVE_TIMEOUT` (15 s); one that closes its
/// connections (stopped, restarted) at once.
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long start-up waits for the first load before serving without it.
const INITIAL_LOAD: Duration = Duration::from_secs(3);

/// `--etcd-endpoints`, `--etcd-prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `http://host:port` of one or more etcd members.
    pub endpoints: Vec<String>,
    /// Every key this agent reads starts with it (default `/balancer/`).
    pub prefix: String,
}

impl EtcdConfig {
    /// Where the workers' keys live.
    pub fn workers_prefix(&self) -> String {
        format!("{}workers/", self.prefix)
    }
}

/// One load of the prefix.
struct Loaded {
    specs: Vec<(String, WorkerSpec)>,
    present: Vec<String>,
    revision: i64,
}

/// The etcd source.
pub struct EtcdDiscovery {
    config: EtcdConfig,
    up: AtomicBool,
}

impl EtcdDiscovery {
    pub fn new(config: EtcdConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            up: AtomicBool::new(false),
        })
    }

    fn set_up(&self, up: bool) {
        if self.up.swap(up, Ordering::AcqRel) != up {
            if up {
                tracing::info!(endpoints = ?self.config.endpoints, "etcd discovery connected");
            } else {
                tracing::warn!(endpoints = ?self.config.endpoints, "etcd discovery lost; keeping the last known workers");
            }
        }
    }

    /// The valid workers under the prefix now, every key present (valid or
    /// not), and the revision they are at.
    async fn load(&self, client: &mut Client) -> anyhow::Result<Loaded> {
        let prefix = self.config.workers_prefix();
        let response = client
            .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .context("loading the workers' keys")?;
        let revision = response.header().map_or(0, |h| h.revision());
        let specs = response
            .kvs()
            .iter()
            .filter_map(|kv| parse(kv.key(), kv.value()))
            .collect();
        let present = response
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect();
        Ok(Loaded {
            specs,
            present,
            revision,
        })
    }

    /// One connection's life: resync, then follow the watch until it ends.
    async fn session(&self, fleet: &FleetUpdates) -> anyhow::Result<()> {
        let mut client = connect(&self.config.endpoints).await?;
        let Loaded {
            specs,
            present,
            revision,
        } = self.load(&mut client).await?;
        fleet.resync(specs, &present);
        let prefix = self.config.workers_prefix();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = client
            .watch(prefix.as_str(), Some(options))
            .await
            .context("watching the workers' keys")?;
        self.set_up(true);
        while let Some(response) = stream.message().await.context("the watch broke")? {
            if response.canceled() {
                anyhow::bail!("etcd cancelled the watch: {}", response.cancel_reason());
            }
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                match event.event_type() {
                    EventType::Put => {
                        if let Some((key, spec)) = parse(kv.key(), kv.value()) {
                            fleet.upsert(&key, spec);
                        }
                    }
                    EventType::Delete => fleet.remove(&key),
                }
            }
        }
        anyhow::bail!("the watch ended")
    }
}

impl Discovery for EtcdDiscovery {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn initial(&self) -> DiscoveryFuture<'_, Vec<(String, WorkerSpec)>> {
        Box::pin(async move {
            let load = async {
                let mut client = connect(&self.config.endpoints).await?;
                self.load(&mut client).await
            };
            match tokio::time::timeout(INITIAL_LOAD, load).await {
                Ok(Ok(loaded)) => loaded.specs,
                Ok(Err(error)) => {
                    tracing::warn!(error = %reason(&error), "etcd not reachable at start; serving without its workers until it is");
                    Vec::new()
                }
                Err(_) => {
                    tracing::warn!(
                        "etcd did not answer at start; serving without its workers until it does"
                    );
                    Vec::new()
                }
            }
        })
    }

    fn series(self: Arc<Self>) -> Option<Arc<dyn MetricsSource>> {
        Some(self)
    }

    fn follow(self: Arc<Self>, fleet: Arc<FleetUpdates>) -> DiscoveryFuture<'static, ()> {
        Box::pin(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                let started = tokio::time::Instant::now();
                if let Err(error) = self.session(&fleet).await {
                    tracing::debug!(error = %reason(&error), "etcd session ended");
                }
                self.set_up(false);
                if started.elapsed() > MAX_BACKOFF * 5 {
                    backoff = Duration::from_millis(100);
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        })
    }
}

impl MetricsSource for EtcdDiscovery {
    fn render(&self, w: &mut Writer<'_>) {
        w.family(
            "discovery_up",
            "gauge",
            "1 while the discovery source (etcd) is connected and watched.",
        );
        w.sample(
            "discovery_up",
            &[("source", "etcd")],
            f64::from(u8::from(self.up.load(Ordering::Acquire))),
        );
    }
}

async fn connect(endpoints: &[String]) -> anyhow::Result<Client> {
    let options = ConnectOptions::new()
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT)
        // etcd also refuses pings on a connection without an open stream;
        // every long-lived connection here holds one (the watch, the lease
        // keep-alive).
        .with_keep_alive_while_idle(false);
    Client::connect(endpoints, Some(options))
        .await
        .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))
}

/// A worker key's value as a spec, or `None` after a log line naming the key.
fn parse(key: &[u8], value: &[u8]) -> Option<(String, WorkerSpec)> {
    let key = String::from_utf8_lossy(key).into_owned();
    let spec = match serde_json::from_slice::<WorkerSpec>(value) {
        Ok(spec) => spec,
        Err(error) => {
            tracing::warn!(key, %error, "ignoring a worker key: its value is not a worker spec");
            return None;
        }
    };
    if let Err(error) = spec.validate() {
        tracing::warn!(key, %error, "ignoring a worker key: invalid spec");
        return None;
    }
    Some((key, spec))
}

/// How long the worker's `/v1/models` may take to answer `register`.
const MODELS_TIMEOUT: Duration = Duration::from_secs(5);

/// The model `register` without one registers: the one the worker's
/// `/v1/models` names, asked every [`MAX_BACKOFF`] until it answers (a worker
/// may take minutes to load). A worker that serves several is registered
/// without one: balancers then learn its list from `/v1/models` themselves.
async fn served_model(address: &WorkerAddress) -> Option<String> {
    let mut waiting = false;
    loop {
        match served_models(address, MODELS_TIMEOUT).await {
            Some(mut models) if models.len() == 1 => {
                let model = models.remove(0);
                tracing::info!(worker = %address.base, model, "registering the model the worker serves");
                return Some(model);
            }
            Some(models) => {
                tracing::info!(worker = %address.base, ?models, "the worker serves several models: registering it without one (balancers learn them from its /v1/models)");
                return None;
            }
            None if !waiting => {
                tracing::info!(worker = %address.base, "no --model: waiting for the worker's /v1/models to name its model");
                waiting = true;
            }
            None => {}
        }
        tokio::time::sleep(MAX_BACKOFF).await;
    }
}

/// What `balancer register` keeps alive.
#[derive(Debug, Clone)]
pub struct Registration {
    pub etcd: EtcdConfig,
    pub id: String,
    pub spec: WorkerSpec,
    /// The lease's time to live; it is renewed every third of it.
    pub ttl: Duration,
}

/// Keeps `registration`'s key alive under a lease until `stop` resolves,
/// then revokes the lease (which deletes the key). Reconnects and registers
/// again when etcd goes away and comes back. A spec without a model first
/// gets the one the worker serves ([`served_model`]).
pub async fn register(
    mut registration: Registration,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let address = registration.spec.validate()?;
    tokio::pin!(stop);
    if registration.spec.model.is_none() {
        tokio::select! {
            model = served_model(&address) => registration.spec.model = model,
            () = &mut stop => return Ok(()),
        }
    }
    let key = format!("{}{}", registration.etcd.workers_prefix(), registration.id);
    let value = serde_json::to_string(&registration.spec)?;
    let ttl = i64::try_from(registration.ttl.as_secs())
        .unwrap_or(i64::MAX)
        .max(2);
    // Until the first registration there is nothing to lose: failing to
    // reach etcd then is "not registered yet", not "lost".
    let mut registered = false;
    loop {
        let session = async {
            let mut client = connect(&registration.etcd.endpoints).await?;
            let lease = client.lease_grant(ttl, None).await?.id();
            client
                .put(
                    key.as_str(),
                    value.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await?;
            tracing::info!(key, lease, ttl, "registered");
            registered = true;
            let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
            let renew = Duration::from_secs((ttl as u64 / 3).max(1));
            let kept: anyhow::Result<()> = async {
                loop {
                    tokio::time::sleep(renew).await;
                    keeper.keep_alive().await?;
                    match answers.message().await? {
                        Some(answer) if answer.ttl() > 0 => {}
                        _ => anyhow::bail!("the lease expired"),
                    }
                }
            }
            .await;
            Ok::<_, anyhow::Error>((client, lease, kept))
        };
        tokio::select! {
            result = session => {
                match result {
                    Ok((_, _, Err(error))) | Err(error) if registered => {
                        tracing::warn!(endpoints = ?registration.etcd.endpoints, error = %reason(&error), "registration lost; registering again");
                    }
                    Ok((_, _, Err(error))) | Err(error) => {
                        tracing::warn!(endpoints = ?registration.etcd.endpoints, error = %reason(&error), "cannot register yet; trying again");
                    }
                    Ok((_, _, Ok(()))) => {}
                }
                tokio::time::sleep(MAX_BACKOFF).await;
            }
            () = &mut stop => break,
        }
    }
    if !registered {
        return Ok(());
    }
    // Stopping: delete the key now rather than when the lease runs out. An
    // etcd that is away cannot hold the stop up (the lease ends the key
    // anyway), nor turn a clean stop into a failure.
    let deregister = async {
        let mut client = connect(&registration.etcd.endpoints).await?;
        client.delete(key.as_str(), None).await?;
        anyhow::Ok(())
    };
    match tokio::time::timeout(DEREGISTER_BOUND, deregister).await {
        Ok(Ok(())) => tracing::info!(key, "deregistered"),
        Ok(Err(error)) => tracing::warn!(
            key,
            error = %reason(&error),
            "could not deregister; the key goes when its lease expires (--ttl-secs {ttl})"
        ),
        Err(_) => tracing::warn!(
            key,
            "could not deregister within {DEREGISTER_BOUND:?}; the key goes when its lease expires (--ttl-secs {ttl})"
        ),
    }
    Ok(())
}

/// How long a stopping `register` tries to delete its key.
const DEREGISTER_BOUND: Duration = Duration::from_secs(3);

/// An etcd failure in one line: the gRPC status's message and its innermost
/// cause ("tcp connect error: Connection refused (os error 111)"), not the
/// status's rendering, which spells out tonic's nested error structures.
fn reason(error: &anyhow::Error) -> String {
    for cause in error.chain() {
        if let Some(etcd_client::Error::GRpcStatus(status)) = cause.downcast_ref() {
            let mut innermost = None;
            let mut next = std::error::Error::source(status);
            while let Some(cause) = next {
                innermost = Some(cause);
                next = cause.source();
            }
            return match innermost {
                Some(cause) => format!("{}: {cause}", status.message()),
                None => status.message().to_owned(),
            };
        }
    }
    format!("{error:#}")
}

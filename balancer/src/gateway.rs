//! Putting the agent together: listeners, workers and their background tasks.
//!
//! Owns start-up (binding every listener before serving, so a taken port
//! fails at start with the address named), the per-worker prober tasks, the
//! built-in demo workers of `--demo-workers`, and an orderly shutdown. The
//! request path itself lives in [`crate::proxy`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, header};
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin::Admin;
use crate::admission::Admission;
use crate::clock::{Clock, MonotonicClock};
use crate::config::LaunchArgs;
use crate::dataplane::steering::Steering;
use crate::health::probe;
use crate::metrics::GatewayStats;
use crate::mock_worker::{MockWorker, MockWorkerConfig};
use crate::proxy::{Proxy, ProxyConfig};
use crate::selection::{Policy, Selector};
use crate::server::serve;
use crate::tokens::Tokens;
use crate::worker::{Registry, RegistryConfig, Worker, WorkerSpec};

type ProbeClient = Client<HttpConnector, Empty<Bytes>>;

/// A running agent.
pub struct Running {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub registry: Arc<Registry>,
    pub proxy: Arc<Proxy>,
    pub demo_workers: Vec<MockWorker>,
    /// The XDP dataplane, with `--xdp-iface`.
    steering: Option<Steering>,
    shutdown: watch::Sender<bool>,
    listeners: JoinSet<()>,
    serving: Vec<std::thread::JoinHandle<()>>,
}

/// How each worker's background task probes it.
#[derive(Clone)]
struct Prober {
    registry: Arc<Registry>,
    client: ProbeClient,
    endpoint: String,
    interval: Duration,
    timeout: Duration,
    enabled: bool,
}

impl Prober {
    fn spawn(&self, worker: &Arc<Worker>) {
        let (this, weak) = (self.clone(), Arc::downgrade(worker));
        let task = tokio::spawn(async move {
            loop {
                let Some(worker) = weak.upgrade() else { return };
                if worker.models().is_empty()
                    && let Some(models) = this.fetch_models(&worker).await
                {
                    this.registry.learn_models(&worker, models);
                }
                if this.enabled {
                    let uri = format!("{}{}", worker.url, this.endpoint)
                        .parse()
                        .expect("a validated worker URL plus an absolute path");
                    let passed = probe(&this.client, &uri, this.timeout).await;
                    this.registry.observe_health(&worker, passed);
                } else if !worker.models().is_empty() {
                    return;
                }
                drop(worker);
                tokio::time::sleep(this.interval).await;
            }
        });
        worker.add_task(task.abort_handle());
    }

    /// The model ids a worker reports on `/v1/models`.
    async fn fetch_models(&self, worker: &Worker) -> Option<Vec<String>> {
        #[derive(serde::Deserialize)]
        struct Models {
            data: Vec<Model>,
        }
        #[derive(serde::Deserialize)]
        struct Model {
            id: String,
        }
        let uri = format!("{}/v1/models", worker.url).parse().ok()?;
        let fetch = async {
            let response = self.client.get(uri).await.ok()?;
            if !response.status().is_success() {
                return None;
            }
            let body = response.into_body().collect().await.ok()?.to_bytes();
            let models: Models = serde_json::from_slice(&body).ok()?;
            Some(models.data.into_iter().map(|m| m.id).collect::<Vec<_>>())
        };
        tokio::time::timeout(self.timeout, fetch)
            .await
            .ok()
            .flatten()
            .filter(|m| !m.is_empty())
    }
}

/// One listening socket per serving thread on the same address
/// (`SO_REUSEPORT`), so the kernel spreads connections over the threads
/// without a shared accept queue.
fn bind_reuseport(addr: SocketAddr, count: usize) -> anyhow::Result<Vec<std::net::TcpListener>> {
    let mut sockets = Vec::with_capacity(count);
    let mut at = addr;
    for _ in 0..count.max(1) {
        let listen = || -> std::io::Result<std::net::TcpListener> {
            let socket = if at.is_ipv4() {
                TcpSocket::new_v4()?
            } else {
                TcpSocket::new_v6()?
            };
            socket.set_reuseaddr(true)?;
            socket.set_reuseport(true)?;
            socket.set_nodelay(true)?;
            socket.bind(at)?;
            socket.listen(4096)?.into_std()
        };
        let listener = listen().with_context(|| format!("cannot listen for HTTP on {addr}"))?;
        // Port 0 picks a port once; the other threads join that one.
        at = listener.local_addr()?;
        sockets.push(listener);
    }
    Ok(sockets)
}

/// A thread with its own single-threaded runtime and its own upstream
/// connection pool: a request, its worker connection and its response body
/// are all polled here, the way an nginx worker process keeps its
/// connections, so no wake-up or pool lock crosses threads.
fn serving_thread(
    index: usize,
    socket: std::net::TcpListener,
    proxy: Arc<Proxy>,
    stop: watch::Receiver<bool>,
    grace: Duration,
) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a serving runtime")?;
    let thread = std::thread::Builder::new()
        .name(format!("balancer-http-{index}"))
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(socket) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "serving thread cannot use its socket");
                        return;
                    }
                };
                let client = proxy.client();
                let lane = Arc::new((proxy, client));
                let handler = move |req| {
                    let lane = lane.clone();
                    async move { lane.0.handle(&lane.1, req).await }
                };
                serve(listener, handler, stop, grace).await;
            });
        })
        .context("cannot start a serving thread")?;
    Ok(thread)
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for {what} on {addr}"))
}

/// Starts the agent: every listener bound, every worker added and probed.
pub async fn start(args: LaunchArgs) -> anyhow::Result<Running> {
    start_with_clock(args, Arc::new(MonotonicClock::new())).await
}

/// [`start`] with the clock the breakers run on; tests pass a `ManualClock`
/// to drive open timeouts without sleeping.
pub async fn start_with_clock(args: LaunchArgs, clock: Arc<dyn Clock>) -> anyhow::Result<Running> {
    let ignored = args.compat.ignored();
    if !ignored.is_empty() {
        tracing::warn!(flags = ?ignored, "reference gateway flags accepted but ignored here");
    }
    let registry = Registry::new(
        RegistryConfig {
            breaker: args.breaker.defaults(),
            health: args.health_thresholds(),
            hash_rings: args.policy == Policy::ConsistentHash,
        },
        clock,
    );
    let stats = Arc::new(GatewayStats::new(
        &args.metrics_prefix,
        &args.fallback_model,
    )?);
    let tokens = Arc::new(Tokens::new(&args.token_budget));

    let mut demo_workers = Vec::new();
    let mut specs = args.initial_workers();
    for i in 0..args.demo_workers {
        let w = MockWorker::spawn(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            MockWorkerConfig::named(format!("demo-{i}")),
        )
        .await
        .context("cannot start a demo worker")?;
        specs.push(WorkerSpec::from_url(&w.url()));
        demo_workers.push(w);
    }

    let prober = Prober {
        registry: registry.clone(),
        client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        endpoint: args.health_check_endpoint.clone(),
        interval: Duration::from_secs(args.health_check_interval_secs),
        timeout: Duration::from_secs(args.health_check_timeout_secs),
        enabled: !args.disable_health_check,
    };
    for worker in registry.add_all(&specs).context("invalid worker list")? {
        prober.spawn(&worker);
    }

    let steering = match args.l4_config() {
        Some(config) => {
            let steering = Steering::start(&config, registry.clone())
                .context("cannot start the XDP dataplane (--xdp-iface)")?;
            stats.set_dataplane(steering.metrics());
            Some(steering)
        }
        None => None,
    };

    let routing_key_header =
        HeaderName::try_from(args.routing_key_header.as_str()).with_context(|| {
            format!(
                "invalid value '{}' for '--routing-key-header'",
                args.routing_key_header
            )
        })?;
    let proxy = Arc::new(Proxy::new(
        registry.clone(),
        Selector::new(args.policy),
        ProxyConfig {
            retry: args.retry_policy(),
            request_timeout: Duration::from_secs(args.request_timeout_secs),
            connect_timeout: Duration::from_secs(args.connect_timeout_secs),
            stream_idle_timeout: Duration::from_secs(args.stream_idle_timeout_secs),
            max_replay_body: args.max_replay_body_bytes,
            routing_key_header,
            fallbacks: args.fallback_model.iter().cloned().collect(),
        },
        args.admission().map(Admission::new),
        stats,
        tokens,
    ));

    let threads = args.serving_threads();
    let main = bind_reuseport(args.listen_addr(), threads)?;
    let metrics = bind(args.metrics_addr(), "metrics").await?;
    let admin = bind(args.admin_addr(), "the admin API").await?;
    let (addr, metrics_addr, admin_addr) = (
        main[0].local_addr()?,
        metrics.local_addr()?,
        admin.local_addr()?,
    );

    let grace = Duration::from_secs(args.shutdown_grace_period_secs);
    let (shutdown, stop) = watch::channel(false);
    let mut listeners = JoinSet::new();
    let serving = main
        .into_iter()
        .enumerate()
        .map(|(i, socket)| serving_thread(i, socket, proxy.clone(), stop.clone(), grace))
        .collect::<anyhow::Result<Vec<_>>>()?;

    let (reg, p) = (registry.clone(), proxy.clone());
    listeners.spawn(serve(
        metrics,
        move |_req| {
            let text = p.stats().render(&reg, p.admission(), p.tokens());
            let mut r = Response::new(
                Full::new(Bytes::from(text))
                    .map_err(|never| match never {})
                    .boxed_unsync(),
            );
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            std::future::ready(r)
        },
        stop.clone(),
        Duration::from_secs(1),
    ));

    let admin_api = Arc::new(Admin {
        registry: registry.clone(),
        token: args.admin_token.clone(),
        on_added: Box::new(move |w| prober.spawn(w)),
        drain_timeout: grace,
    });
    listeners.spawn(serve(
        admin,
        move |req| admin_api.clone().handle(req),
        stop,
        Duration::from_secs(1),
    ));

    tracing::info!(%addr, %metrics_addr, %admin_addr, workers = specs.len(), policy = args.policy.as_str(), "balancer listening");
    Ok(Running {
        addr,
        metrics_addr,
        admin_addr,
        registry,
        proxy,
        demo_workers,
        steering,
        shutdown,
        listeners,
        serving,
    })
}

impl Running {
    /// The XDP dataplane, when `--xdp-iface` started one.
    pub fn steering(&self) -> Option<&Steering> {
        self.steering.as_ref()
    }

    /// Stops accepting, lets in-flight requests finish within the grace
    /// period, then stops the workers' tasks and the demo workers.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        while self.listeners.join_next().await.is_some() {}
        let serving = std::mem::take(&mut self.serving);
        let _ = tokio::task::spawn_blocking(move || {
            for thread in serving {
                let _ = thread.join();
            }
        })
        .await;
        if let Some(steering) = self.steering.take()
            && let Err(error) = steering.stop()
        {
            tracing::warn!(error = %anyhow::Error::from(error), "detaching the XDP dataplane");
        }
        for w in self.registry.fleet().workers.clone() {
            self.registry.remove(&w);
        }
        for w in self.demo_workers {
            w.shutdown().await;
        }
    }

    /// Runs until SIGINT or SIGTERM, then shuts down.
    pub async fn run_until_signal(self) -> anyhow::Result<()> {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down: finishing in-flight requests");
        self.shutdown().await;
        Ok(())
    }
}

//! Putting the agent together: listeners, workers and their background tasks.
//!
//! Owns start-up from a [`GatewayConfig`] (binding every listener before
//! serving, so a taken port fails at start with the address named), the
//! serving threads, the per-worker prober tasks, the metrics exposition's
//! sources, and an orderly shutdown. The request path itself lives in
//! [`crate::proxy`]; it never parses flags (that is [`crate::cli`]'s).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::{HeaderValue, Response, header};
use http_body_util::Full;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio::task::JoinSet;

use balancer_core::admission::Admission;
use balancer_core::clock::{Clock, MonotonicClock};
use balancer_core::metrics::MetricsSource;
use balancer_core::registry::{Registry, RegistryConfig, WorkerEvent};
use balancer_core::selection::{CacheAware, Policy, Selector};
use balancer_core::tokens::Tokens;
use balancer_dataplane::steering::Steering;

use crate::admin::Admin;
use crate::config::GatewayConfig;
use crate::discovery::etcd::EtcdDiscovery;
use crate::discovery::{Discovery, FleetUpdates, OnAdded, StaticList};
use crate::fleet::{FleetTask, FleetVerdicts};
use crate::metrics::Exposition;
use crate::proxy::{GatewayStats, Lane, LoadMonitor, Prober, Proxy, ResponseBody};
use crate::server::{ConnectionLimits, Listener, Member, members, serve};
use crate::tls::{ServingTls, TlsStats, WorkerTls};

/// Connections at once on the metrics and the admin listeners.
const OPERATOR_CONNECTIONS: usize = 256;

/// A running agent.
pub struct Gateway {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub registry: Arc<Registry>,
    pub proxy: Arc<Proxy>,
    /// The XDP dataplane, with `--xdp-iface`.
    steering: Option<Steering>,
    /// The discovery sources' follow tasks, and `cache_aware`'s upkeep.
    discovery: Vec<tokio::task::AbortHandle>,
    /// `--fleet-verdicts`: the replica's fleet side and its task.
    fleet: Option<(Arc<FleetVerdicts>, FleetTask)>,
    /// HTTPS on the public port (`--tls-cert-path`).
    serves_tls: bool,
    /// How long a shutdown lets in-flight requests finish.
    grace: Duration,
    shutdown: watch::Sender<bool>,
    listeners: JoinSet<()>,
    serving: Vec<std::thread::JoinHandle<()>>,
}

/// One listening socket per serving thread on the same address
/// (`SO_REUSEPORT`), so the threads share no accept queue; the kernel picks
/// a thread by a hash of the connection's addresses, and the threads even
/// out what it picked ([`crate::server::Member`]).
///
/// `SO_REUSEPORT` would also let a second agent (same user) join the port
/// silently and take half its connections. So the port is first claimed by a
/// socket without `SO_REUSEPORT`, which any other listener on it refuses;
/// the claim stays bound (not listening, which with `SO_REUSEADDR` on both
/// sides lets the threads' sockets join it) until they all listen, so no
/// other process can slip in between the check and the threads' binds.
fn bind_reuseport(
    addr: SocketAddr,
    count: usize,
    flag: &str,
) -> anyhow::Result<Vec<std::net::TcpListener>> {
    let socket = || {
        if addr.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }
    };
    let claim = socket()
        .and_then(|s| s.set_reuseaddr(true).map(|()| s))
        .with_context(|| format!("cannot listen for HTTP on {addr}"))?;
    claim.bind(addr).map_err(|e| in_use(e, addr, flag))?;
    // Port 0 picks a port once; the threads join that one.
    let at = claim.local_addr()?;
    let mut sockets = Vec::with_capacity(count);
    for _ in 0..count.max(1) {
        let listen = || -> std::io::Result<std::net::TcpListener> {
            let socket = socket()?;
            socket.set_reuseaddr(true)?;
            socket.set_reuseport(true)?;
            socket.set_nodelay(true)?;
            socket.bind(at)?;
            socket.listen(4096)?.into_std()
        };
        sockets.push(listen().with_context(|| format!("cannot listen for HTTP on {addr}"))?);
    }
    drop(claim);
    Ok(sockets)
}

/// A bind error, with the flag that chose the address when another process
/// holds it.
fn in_use(error: std::io::Error, addr: SocketAddr, flag: &str) -> anyhow::Error {
    if error.kind() == std::io::ErrorKind::AddrInUse {
        anyhow::anyhow!(
            "{flag} {}: address in use by another process ({addr})",
            addr.port()
        )
    } else {
        anyhow::Error::new(error).context(format!("cannot listen on {addr} ({flag})"))
    }
}

/// A thread with its own single-threaded runtime and its own upstream
/// connection pool: a request, its worker connection and its response body
/// are all polled here, the way an nginx worker process keeps its
/// connections, so no wake-up or pool lock crosses threads.
fn serving_thread(
    index: usize,
    // Its socket, and its part in spreading the port's connections.
    (socket, spread): (std::net::TcpListener, Member),
    proxy: Arc<Proxy>,
    limits: ConnectionLimits,
    tls: Option<Arc<ServingTls>>,
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
                let lane = Arc::new(Lane::new(proxy));
                // The request's future owns its lane, so no wrapper future
                // (and no copy into one) stands around it.
                let handler = move |req, peer| lane.clone().handle(req, peer);
                let listener = Listener::spread(listener, spread);
                serve(listener, handler, limits, tls, stop, grace).await;
            });
        })
        .context("cannot start a serving thread")?;
    Ok(thread)
}

async fn bind(addr: SocketAddr, flag: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| in_use(e, addr, flag))
}

/// The TLS of both edges, from the files `config` names.
fn load_tls(
    config: &GatewayConfig,
    stats: &Arc<TlsStats>,
) -> anyhow::Result<(WorkerTls, Option<Arc<ServingTls>>)> {
    let worker = WorkerTls::load(&config.worker_tls, stats.clone()).context(
        "cannot set up TLS to workers (--worker-ca-path, --client-cert-path, --client-key-path)",
    )?;
    let serving = match &config.tls {
        Some(files) => Some(ServingTls::load(files.clone(), stats.clone()).context(
            "cannot serve HTTPS (--tls-cert-path, --tls-key-path, --tls-client-ca-path)",
        )?),
        None => None,
    };
    Ok((worker, serving))
}

impl Gateway {
    /// What [`Gateway::start`] would refuse before binding a port, without
    /// binding one or loading the XDP program: the configuration, the TLS
    /// files, and with L4 on, that the eBPF object is found.
    pub fn check(config: &GatewayConfig) -> anyhow::Result<()> {
        config.validate()?;
        load_tls(config, &Arc::new(TlsStats::default()))?;
        if config.l4.is_some() {
            balancer_dataplane::locate_object(None)
                .context("cannot start the XDP dataplane (--xdp-iface)")?;
        }
        Ok(())
    }

    /// Starts the agent on the real clock: every listener bound, every
    /// worker added and probed.
    pub async fn start(config: GatewayConfig) -> anyhow::Result<Self> {
        Self::start_with_clock(config, Arc::new(MonotonicClock::new())).await
    }

    /// [`Gateway::start`] with the clock the breakers run on; tests pass a
    /// `ManualClock` to drive open timeouts without sleeping.
    pub async fn start_with_clock(
        config: GatewayConfig,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<Self> {
        let mut sources: Vec<Arc<dyn Discovery>> =
            vec![Arc::new(StaticList::new(config.workers.clone()))];
        if let Some(etcd) = &config.etcd {
            sources.push(EtcdDiscovery::new(etcd.clone()));
        }
        Self::start_with(config, clock, sources).await
    }

    /// The library entry point: the agent described by `config`, its workers
    /// from `sources` (each applied through its own [`FleetUpdates`]), its
    /// breakers on `clock`.
    pub async fn start_with(
        config: GatewayConfig,
        clock: Arc<dyn Clock>,
        sources: Vec<Arc<dyn Discovery>>,
    ) -> anyhow::Result<Self> {
        config.validate()?;
        let registry = Registry::new(
            RegistryConfig {
                breaker: config.breaker,
                health: config.health,
                hash_rings: config.policy == Policy::ConsistentHash,
                max_open_percent: config.max_open_percent,
                removed_grace: config.removed_worker_grace,
            },
            clock,
        );
        let mut fallbacks: Vec<(String, String)> = config
            .proxy
            .fallbacks
            .iter()
            .map(|(f, t)| (f.clone(), t.clone()))
            .collect();
        fallbacks.sort();
        let stats = Arc::new(GatewayStats::new(&fallbacks));
        let tokens = Arc::new(Tokens::new(&config.token_budgets));
        let admission = config.admission.map(|a| Arc::new(Admission::new(a)));

        let tls_stats = Arc::new(TlsStats::default());
        let (worker_tls, serving_tls) = load_tls(&config, &tls_stats)?;
        let worker_tls = Arc::new(worker_tls);
        let prober = Prober::new(
            registry.clone(),
            config.health_check.clone(),
            worker_tls.connector(config.health_check.timeout),
        );
        let monitor = LoadMonitor::new(&prober, registry.clock().clone(), config.load_monitor);
        let on_added: OnAdded = {
            let (prober, monitor) = (prober.clone(), monitor.clone());
            Arc::new(move |w| {
                prober.spawn(w);
                monitor.spawn(w);
            })
        };
        let mut discovery = Vec::new();
        let mut discovery_series = Vec::new();
        for source in sources {
            let fleet = Arc::new(FleetUpdates::new(
                registry.clone(),
                on_added.clone(),
                config.shutdown_grace,
            ));
            for (key, spec) in source.initial().await {
                fleet.upsert(&key, spec);
            }
            discovery_series.extend(source.clone().series());
            discovery.push(tokio::spawn(source.follow(fleet)).abort_handle());
        }

        let fleet = match (&config.fleet, &config.etcd) {
            (Some(fleet), Some(etcd)) => Some(
                FleetVerdicts::start(etcd.clone(), fleet.clone(), registry.clone())
                    .await
                    .context("cannot start fleet verdicts (--fleet-verdicts)")?,
            ),
            _ => None,
        };

        let steering = match &config.l4 {
            Some(l4) => Some(
                Steering::start(l4, registry.clone())
                    .context("cannot start the XDP dataplane (--xdp-iface)")?,
            ),
            None => None,
        };

        let mut sources: Vec<Arc<dyn MetricsSource>> = vec![
            stats.clone(),
            tokens.clone(),
            registry.clone(),
            tls_stats.clone(),
        ];
        if let Some(a) = &admission {
            sources.push(a.clone());
        }
        if let Some(s) = &steering {
            sources.push(s.metrics());
        }
        sources.extend(discovery_series);
        let selector = Selector::with_cache_aware(config.policy, config.cache_aware);
        if let Some(cache) = selector.cache_aware() {
            sources.push(cache.clone());
            discovery.extend(cache_upkeep(cache.clone(), &registry));
        }
        if let Some((f, _)) = &fleet {
            sources.push(f.clone());
        }
        let exposition = Arc::new(Exposition::new(&config.metrics_prefix, sources));

        let proxy = Arc::new(Proxy::new(
            registry.clone(),
            selector,
            config.proxy.clone(),
            admission,
            stats,
            tokens,
            worker_tls,
        ));

        let main = bind_reuseport(config.listen, config.serving_threads(), "--port")?;
        let metrics = bind(config.metrics_listen, "--prometheus-port").await?;
        let admin = bind(config.admin_listen, "--admin-port").await?;
        let (addr, metrics_addr, admin_addr) = (
            main[0].local_addr()?,
            metrics.local_addr()?,
            admin.local_addr()?,
        );

        let grace = config.shutdown_grace;
        let (shutdown, stop) = watch::channel(false);
        let mut listeners = JoinSet::new();
        let c = &config.connections;
        let public = ConnectionLimits {
            // The proxy reads and forwards a client's fields as they came.
            raw_fields: true,
            ..ConnectionLimits::new(
                c.header_read_timeout,
                c.idle_timeout,
                c.send_timeout,
                c.http2_keepalive,
                c.max_connections,
            )
        };
        // The operator's listeners: the same timeouts, a small cap.
        let operator = || {
            ConnectionLimits::new(
                c.header_read_timeout,
                c.idle_timeout,
                c.send_timeout,
                c.http2_keepalive,
                OPERATOR_CONNECTIONS,
            )
        };
        let spread = members(main.len());
        let serving = main
            .into_iter()
            .zip(spread)
            .enumerate()
            .map(|(i, share)| {
                serving_thread(
                    i,
                    share,
                    proxy.clone(),
                    public.clone(),
                    serving_tls.clone(),
                    stop.clone(),
                    grace,
                )
            })
            .collect::<anyhow::Result<Vec<_>>>()?;

        listeners.spawn(serve(
            metrics,
            move |_req, _peer| {
                let mut r = Response::new(ResponseBody::new(Full::new(Bytes::from(
                    exposition.render(),
                ))));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                std::future::ready(r)
            },
            operator(),
            None,
            stop.clone(),
            Duration::from_secs(1),
        ));

        let admin_api = Arc::new(Admin {
            registry: registry.clone(),
            token: config.admin_token.clone(),
            on_added: Box::new(move |w| {
                prober.spawn(w);
                monitor.spawn(w);
            }),
            drain_timeout: grace,
            probed: config.health_check.enabled,
            fleet: fleet.as_ref().map(|(f, _)| f.clone()),
        });
        listeners.spawn(serve(
            admin,
            move |req, _peer| admin_api.clone().handle(req),
            operator(),
            None,
            stop.clone(),
            Duration::from_secs(1),
        ));
        if let Some(tls) = serving_tls {
            listeners.spawn(tls.watch(stop).context("cannot handle SIGHUP")?);
        }

        let workers = registry.fleet().workers.len();
        tracing::info!(%addr, %metrics_addr, %admin_addr, workers, policy = config.policy.as_str(), "balancer listening");
        Ok(Self {
            addr,
            metrics_addr,
            admin_addr,
            registry,
            proxy,
            steering,
            discovery,
            fleet,
            serves_tls: config.tls.is_some(),
            grace,
            shutdown,
            listeners,
            serving,
        })
    }

    /// The XDP dataplane, when `--xdp-iface` started one.
    pub fn steering(&self) -> Option<&Steering> {
        self.steering.as_ref()
    }

    /// Stops accepting, lets in-flight requests finish within the grace
    /// period, then stops the workers' tasks.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        for task in &self.discovery {
            task.abort();
        }
        if let Some((fleet, task)) = self.fleet.take() {
            drop(task);
            fleet.revoke().await;
        }
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
    }

    /// Runs until SIGINT or SIGTERM, then shuts down, draining in-flight
    /// requests for up to the grace period; a second SIGINT or SIGTERM during
    /// the drain ends it at once ([`Stopped::Forced`]).
    /// SIGHUP reloads the TLS certificate (see [`ServingTls::watch`]);
    /// without TLS it changes nothing, rather than ending the process as
    /// its default action would.
    pub async fn run_until_signal(self) -> anyhow::Result<Stopped> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut hangup = signal(SignalKind::hangup())?;
        let first = loop {
            tokio::select! {
                _ = interrupt.recv() => break "SIGINT",
                _ = term.recv() => break "SIGTERM",
                _ = hangup.recv() => if !self.serves_tls {
                    tracing::info!("SIGHUP: nothing to reload without --tls-cert-path");
                },
            }
        };
        let registry = self.registry.clone();
        tracing::info!(
            signal = first,
            in_flight = in_flight(&registry),
            deadline_secs = self.grace.as_secs(),
            "shutting down: finishing in-flight requests (a second SIGINT or SIGTERM stops at once)"
        );
        let drained = self.shutdown();
        tokio::select! {
            () = drained => Ok(Stopped::Drained),
            _ = interrupt.recv() => Ok(forced(&registry, "SIGINT", SIGINT)),
            _ = term.recv() => Ok(forced(&registry, "SIGTERM", SIGTERM)),
        }
    }
}

/// How [`Gateway::run_until_signal`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Every in-flight request finished, or the grace period ran out.
    Drained,
    /// A second signal cut the drain short; carries that signal's number
    /// (the binary exits with 128 plus it, as a shell reports a process a
    /// signal ended).
    Forced(i32),
}

/// Requests in flight to workers now.
fn in_flight(registry: &Registry) -> u64 {
    registry
        .fleet()
        .workers
        .iter()
        .map(|w| u64::from(w.inflight()))
        .sum()
}

/// The signals' numbers (the same on every Unix this runs on).
const SIGINT: i32 = 2;
const SIGTERM: i32 = 15;

fn forced(registry: &Registry, name: &str, number: i32) -> Stopped {
    tracing::warn!(
        signal = name,
        abandoned = in_flight(registry),
        "second signal: stopping now, cutting the requests still in flight"
    );
    Stopped::Forced(number)
}

/// `cache_aware`'s two background tasks: eviction every
/// `--eviction-interval-secs`, and dropping a worker's prefix entries when
/// its breaker opens (its cache is presumed lost) or it leaves the fleet.
fn cache_upkeep(cache: Arc<CacheAware>, registry: &Registry) -> [tokio::task::AbortHandle; 2] {
    let interval = cache.config().eviction_interval;
    let evictor = {
        let cache = cache.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let cache = cache.clone();
                // The walk is bounded by --max-tree-size but not short.
                let held = tokio::task::spawn_blocking(move || cache.evict()).await;
                tracing::debug!(bytes = held.unwrap_or_default(), "prefix trees evicted");
            }
        })
    };
    let mut events = registry.subscribe();
    let forgetter = tokio::spawn(async move {
        loop {
            let worker = match events.recv().await {
                Ok(WorkerEvent::Removed(w)) => w,
                Ok(WorkerEvent::Breaker(w, t)) if t.to == balancer_core::breaker::State::Open => w,
                Ok(_) => continue,
                // Missed events may have been openings: a lagging subscriber
                // cannot tell which, and stale entries only cost a miss.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(missed = n, "cache_aware missed worker events");
                    continue;
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            };
            cache.forget(worker.breaker.id());
            tracing::info!(worker = %worker.url, "cache_aware dropped the worker's prefix entries");
        }
    });
    [evictor.abort_handle(), forgetter.abort_handle()]
}

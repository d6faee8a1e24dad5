//! The gateway's typed configuration.
//!
//! Owns [`GatewayConfig`], the plain description of one agent that
//! [`crate::gateway::start`] takes, with the reference gateway's defaults and
//! the checks that span several settings. It knows nothing of command lines
//! or files: [`crate::cli`] maps flags and TOML onto it, and tests build it
//! directly. Errors name the flag an operator would fix.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use http::HeaderName;

use balancer_common::l4::MAX_SERVICES;
use balancer_core::admission::AdmissionConfig;
use balancer_core::breaker::MAX_HALF_OPEN_INFLIGHT;
use balancer_core::health::HealthThresholds;
use balancer_core::registry::DEFAULT_REMOVED_GRACE;
use balancer_core::selection::{CacheAwareConfig, Policy};
use balancer_core::spec::{BreakerDefaults, WorkerAddress, WorkerSpec};
use balancer_dataplane::maglev::is_prime;
use balancer_dataplane::steering::L4Config;

use crate::discovery::etcd::EtcdConfig;
use crate::fleet::FleetConfig;
use crate::proxy::{HealthCheckConfig, LoadMonitorConfig, ProxyConfig, RetryPolicy, Routes};
use crate::tls::{ServingTlsConfig, WorkerTlsConfig};

/// Everything one agent is started with.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayConfig {
    /// The public HTTP port (`--host`, `--port`); port 0 picks one.
    pub listen: SocketAddr,
    /// The Prometheus listener (`--prometheus-host`, `--prometheus-port`).
    pub metrics_listen: SocketAddr,
    /// The admin API (`--admin-host`, `--admin-port`), never the public port.
    pub admin_listen: SocketAddr,
    /// `--admin-token`: required as `Authorization: Bearer` when set.
    pub admin_token: Option<String>,
    /// `--metrics-prefix`.
    pub metrics_prefix: String,
    /// The workers to start with (`--worker-urls`, `[[workers]]`).
    pub workers: Vec<WorkerSpec>,
    /// `--etcd-endpoints`, `--etcd-prefix`: workers discovered through etcd,
    /// beside `workers`.
    pub etcd: Option<EtcdConfig>,
    /// `--fleet-verdicts` and its settings: share breaker verdicts with the
    /// other replicas through `etcd`; `None`: no etcd traffic of its own.
    pub fleet: Option<FleetConfig>,
    /// `--policy`.
    pub policy: Policy,
    /// `--cache-threshold`, `--balance-*-threshold`, `--eviction-interval-secs`,
    /// `--max-tree-size`, `--disable-ttft-weighting` (`cache_aware` only).
    pub cache_aware: CacheAwareConfig,
    /// Timeouts, retries, replay limit, routing key and fallbacks.
    pub proxy: ProxyConfig,
    /// The `--cb-*` flags, before per-worker overrides.
    pub breaker: BreakerDefaults,
    /// `--cb-max-open-percent`: breakers never isolate more than this share
    /// of a model's workers at once (100: no limit, the document).
    pub max_open_percent: u32,
    /// `--health-*-threshold`.
    pub health: HealthThresholds,
    /// `--health-check-*`.
    pub health_check: HealthCheckConfig,
    /// `--load-monitor-interval-ms`, `--worker-overload-waiting-requests`.
    pub load_monitor: LoadMonitorConfig,
    /// `--max-concurrent-requests` and its queue; `None`: no admission limit.
    pub admission: Option<AdmissionConfig>,
    /// `--token-budget MODEL=TOKENS` per rolling minute.
    pub token_budgets: Vec<(String, u64)>,
    /// The XDP dataplane (`--xdp-iface`, `--l4-*`); `None`: L7 only.
    pub l4: Option<L4Config>,
    /// `--serving-threads`; 0 means one per core.
    pub serving_threads: usize,
    /// `--shutdown-grace-period-secs`.
    pub shutdown_grace: Duration,
    /// `--removed-worker-grace-secs`: a removed worker's series stay (its
    /// breaker state at -1) this long.
    pub removed_worker_grace: Duration,
    /// What a client connection may do (timeouts, the connection cap).
    pub connections: ConnectionConfig,
    /// `--tls-cert-path`, `--tls-key-path`, `--tls-client-ca-path`: HTTPS on
    /// the public port; `None`: plain HTTP.
    pub tls: Option<ServingTlsConfig>,
    /// `--worker-ca-path`, `--client-cert-path`, `--client-key-path`: how
    /// `https://` workers are trusted and what the gateway presents to them.
    pub worker_tls: WorkerTlsConfig,
}

/// The bounds of client connections on the public port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionConfig {
    /// `--header-read-timeout-secs`.
    pub header_read_timeout: Duration,
    /// `--idle-connection-timeout-secs`.
    pub idle_timeout: Duration,
    /// `--send-timeout-secs`.
    pub send_timeout: Duration,
    /// `--http2-keepalive-interval-secs`.
    pub http2_keepalive: Duration,
    /// `--max-connections`.
    pub max_connections: usize,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            http2_keepalive: Duration::from_secs(30),
            max_connections: 16384,
        }
    }
}

impl Default for GatewayConfig {
    /// The reference gateway's defaults: what `balancer launch` with no flag
    /// means (a test keeps the two in step).
    fn default() -> Self {
        let local = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        Self {
            listen: local(30000),
            metrics_listen: local(29000),
            admin_listen: local(29100),
            admin_token: None,
            metrics_prefix: "balancer".to_owned(),
            workers: Vec::new(),
            etcd: None,
            fleet: None,
            policy: Policy::PowerOfTwo,
            cache_aware: CacheAwareConfig::default(),
            proxy: ProxyConfig::default(),
            breaker: BreakerDefaults::default(),
            max_open_percent: 100,
            health: HealthThresholds {
                failure: 3,
                success: 2,
            },
            health_check: HealthCheckConfig::default(),
            load_monitor: LoadMonitorConfig::default(),
            admission: None,
            token_budgets: Vec::new(),
            l4: None,
            serving_threads: 0,
            shutdown_grace: Duration::from_secs(180),
            removed_worker_grace: DEFAULT_REMOVED_GRACE,
            connections: ConnectionConfig::default(),
            tls: None,
            worker_tls: WorkerTlsConfig::default(),
        }
    }
}

/// A configuration that cannot be started; nothing was started.
#[derive(Debug, thiserror::Error)]
#[error("invalid value for '{flag}': {message}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub message: String,
}

fn invalid(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        message: message.into(),
    }
}

impl GatewayConfig {
    /// A default configuration serving `urls`.
    pub fn with_worker_urls<S: AsRef<str>>(urls: &[S]) -> Self {
        Self {
            workers: urls
                .iter()
                .map(|u| WorkerSpec::from_url(u.as_ref()))
                .collect(),
            ..Self::default()
        }
    }

    /// The checks that span settings; each error names the flag to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let retry = &self.proxy.retry;
        if retry.initial_backoff > retry.max_backoff {
            return Err(invalid(
                "--retry-initial-backoff-ms",
                format!(
                    "{} ms is larger than --retry-max-backoff-ms {} ms",
                    retry.initial_backoff.as_millis(),
                    retry.max_backoff.as_millis()
                ),
            ));
        }
        let prefix = &self.metrics_prefix;
        if prefix.is_empty()
            || !prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
            || prefix.starts_with(|c: char| c.is_ascii_digit())
        {
            return Err(invalid(
                "--metrics-prefix",
                format!("'{prefix}': use letters, digits and '_'"),
            ));
        }
        let max_inflight = self.breaker.settings.half_open_max_inflight;
        if max_inflight > MAX_HALF_OPEN_INFLIGHT {
            return Err(invalid(
                "--cb-half-open-max-inflight",
                format!("{max_inflight}: at most {MAX_HALF_OPEN_INFLIGHT}"),
            ));
        }
        if !(1..=100).contains(&self.max_open_percent) {
            return Err(invalid(
                "--cb-max-open-percent",
                format!("{}: a percentage from 1 to 100", self.max_open_percent),
            ));
        }
        check_fallbacks(&self.proxy.fallbacks)?;
        match (
            &self.worker_tls.client_cert_path,
            &self.worker_tls.client_key_path,
        ) {
            (Some(_), None) => {
                return Err(invalid(
                    "--client-key-path",
                    "missing: --client-cert-path needs its key",
                ));
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "--client-cert-path",
                    "missing: --client-key-path needs its certificate",
                ));
            }
            _ => {}
        }
        if let Some(etcd) = &self.etcd {
            if etcd.endpoints.is_empty() {
                return Err(invalid("--etcd-endpoints", "no endpoint"));
            }
            for e in &etcd.endpoints {
                if !e.starts_with("http://") {
                    return Err(invalid(
                        "--etcd-endpoints",
                        format!("{e:?}: an http://host:port URL"),
                    ));
                }
            }
            if !etcd.prefix.starts_with('/') || !etcd.prefix.ends_with('/') {
                return Err(invalid(
                    "--etcd-prefix",
                    format!("{:?}: starts and ends with '/'", etcd.prefix),
                ));
            }
        }
        if let Some(fleet) = &self.fleet {
            if self.etcd.is_none() {
                return Err(invalid(
                    "--fleet-verdicts",
                    "needs --etcd-endpoints: the verdicts are shared through etcd",
                ));
            }
            FleetConfig::check_replica_id(&fleet.replica_id)
                .map_err(|m| invalid("--replica-id", m))?;
            if fleet.quorum == 0 {
                return Err(invalid("--fleet-quorum", "must be at least 1"));
            }
            if fleet.lease < Duration::from_secs(2) {
                return Err(invalid(
                    "--fleet-lease-secs",
                    "must be at least 2 (etcd's shortest lease)",
                ));
            }
        }
        if self.admin_token.is_none() && !self.admin_listen.ip().is_loopback() {
            return Err(invalid(
                "--admin-token",
                format!(
                    "the admin API on {} (not loopback) needs --admin-token or --admin-token-file",
                    self.admin_listen
                ),
            ));
        }
        if self.admin_token.as_ref().is_some_and(|t| t.is_empty()) {
            return Err(invalid("--admin-token", "the token is empty"));
        }
        let c = &self.connections;
        if c.max_connections == 0 {
            return Err(invalid("--max-connections", "must be at least 1"));
        }
        for (flag, d) in [
            ("--header-read-timeout-secs", c.header_read_timeout),
            ("--idle-connection-timeout-secs", c.idle_timeout),
            ("--send-timeout-secs", c.send_timeout),
            ("--http2-keepalive-interval-secs", c.http2_keepalive),
            (
                "--stream-body-stall-timeout-secs",
                self.proxy.body_stall_timeout,
            ),
        ] {
            if d.is_zero() {
                return Err(invalid(flag, "must be at least 1 second"));
            }
        }
        if let Some(l4) = &self.l4 {
            check_l4(l4)?;
        }
        let mut seen = std::collections::HashSet::new();
        for spec in &self.workers {
            if let Ok(address) = WorkerAddress::parse(&spec.url)
                && !seen.insert(address.base.clone())
            {
                return Err(invalid(
                    "--worker-urls",
                    format!("{} is listed twice", address.base),
                ));
            }
            spec.validate()
                .map_err(|e| invalid("--worker-urls", e.to_string()))?;
        }
        Ok(())
    }

    /// `serving_threads`, with 0 resolved to the number of cores.
    pub fn serving_threads(&self) -> usize {
        match self.serving_threads {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        }
    }

    /// Checks a worker URL the way the registry will.
    pub fn check_worker_url(url: &str) -> Result<(), ConfigError> {
        WorkerAddress::parse(url)
            .map(drop)
            .map_err(|e| invalid("--worker-urls", e.to_string()))
    }
}

/// Fallback chains are allowed, cycles are not.
fn check_fallbacks(fallbacks: &HashMap<String, String>) -> Result<(), ConfigError> {
    for start in fallbacks.keys() {
        let mut seen = vec![start.as_str()];
        let mut at = start.as_str();
        while let Some(next) = fallbacks.get(at) {
            let cycle = seen.contains(&next.as_str());
            seen.push(next);
            if cycle {
                return Err(invalid(
                    "--fallback-model",
                    format!("the chain {} is a cycle", seen.join(" -> ")),
                ));
            }
            at = next;
        }
    }
    Ok(())
}

fn check_l4(l4: &L4Config) -> Result<(), ConfigError> {
    if l4.ifaces.is_empty() || l4.services.is_empty() {
        return Err(invalid(
            if l4.ifaces.is_empty() {
                "--xdp-iface"
            } else {
                "--l4-service"
            },
            "--xdp-iface and --l4-service go together: steering needs an interface and at least one service",
        ));
    }
    if !is_prime(l4.table_size) {
        return Err(invalid(
            "--l4-table-size",
            format!(
                "'{}': Maglev needs a prime (65537, 251, ...)",
                l4.table_size
            ),
        ));
    }
    if l4.services.len() > MAX_SERVICES as usize {
        return Err(invalid(
            "--l4-service",
            format!("at most {MAX_SERVICES} services"),
        ));
    }
    for (i, service) in l4.services.iter().enumerate() {
        if l4.services[..i].contains(service) {
            return Err(invalid("--l4-service", format!("'{service}' given twice")));
        }
    }
    Ok(())
}

/// The routing key header of `consistent_hash` by default.
pub fn default_routing_key_header() -> HeaderName {
    HeaderName::from_static("x-session-id")
}

impl Default for ProxyConfig {
    /// The reference gateway's defaults.
    fn default() -> Self {
        Self {
            retry: RetryPolicy::default(),
            request_timeout: Duration::from_secs(1800),
            connect_timeout: Duration::from_secs(10),
            stream_idle_timeout: Duration::from_secs(300),
            max_replay_body: 8 << 20,
            routing_key_header: default_routing_key_header(),
            request_id_headers: Vec::new(),
            access_log: false,
            fallbacks: HashMap::new(),
            routes: Routes::default(),
            // The reference gateway's `--max-payload-size`.
            max_payload: 512 << 20,
            body_stall_timeout: Duration::from_secs(30),
            buffered_bytes_total: 1 << 30,
            trusted_proxy_hops: 0,
            route_undeclared_models: false,
        }
    }
}

impl Default for RetryPolicy {
    /// `--retry-*` defaults of the reference gateway.
    fn default() -> Self {
        Self {
            // `--retry-max-retries 5`: five retries after the first attempt.
            max_attempts: 6,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(30_000),
            multiplier: 1.5,
            jitter: 0.2,
        }
    }
}

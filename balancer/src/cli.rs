//! The gateway's command line and config file, mapped onto [`GatewayConfig`].
//!
//! Owns flag names, their defaults and per-flag validation; the checks that
//! span settings are [`GatewayConfig::validate`]'s. Names and defaults follow the
//! reference gateway (`smg launch`) so operators can reuse their flags. Every
//! flag can also come from a TOML file (`--config PATH`, keys are flag names
//! with `_` or `-`), and flags on the command line win. Bad values fail at
//! start with the flag and the value named.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, CommandFactory, Parser};

use balancer_common::l4::{DEFAULT_CONNTRACK_SIZE, DEFAULT_TABLE_SIZE};
use balancer_core::admission::AdmissionConfig;
use balancer_core::breaker::{DegradedSettings, MAX_HALF_OPEN_INFLIGHT, Settings, WindowSettings};
use balancer_core::health::HealthThresholds;
use balancer_core::registry::DEFAULT_REMOVED_GRACE;
use balancer_core::selection::{CacheAwareConfig, Policy};
use balancer_core::spec::{BreakerDefaults, WorkerSpec, redacted_url};
use balancer_dataplane::XdpMode;
use balancer_dataplane::steering::{ForwardMode, L4Config};
use http::HeaderName;

use crate::config::{ConnectionConfig, GatewayConfig};
use crate::discovery::etcd::{EtcdConfig, Registration};
use crate::fleet::FleetConfig;
use crate::proxy::{
    DEFAULT_LOAD_MONITOR_INTERVAL, HealthCheckConfig, LoadMonitorConfig, ProxyConfig, RetryPolicy,
    Routes,
};
use crate::tls::{ServingTlsConfig, WorkerTlsConfig};

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 1.0 => Ok(v),
        _ => Err(format!("{s} is not a number >= 1.0")),
    }
}

fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s} is not a number between 0 and 1")),
    }
}

/// A host flag's address: an IP address, or a name resolved once at start
/// (`localhost`); of a name's addresses, the first IPv4 one, as most
/// operators mean `localhost` to be 127.0.0.1.
fn host(s: &str) -> Result<IpAddr, String> {
    if let Ok(ip) = s.parse() {
        return Ok(ip);
    }
    let resolved: Vec<IpAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(s, 0))
        .map_err(|e| format!("{s} is neither an IP address nor a name that resolves: {e}"))?
        .map(|a| a.ip())
        .collect();
    resolved
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(resolved.first())
        .copied()
        .ok_or_else(|| format!("{s} resolves to no address"))
}

/// `--log-level`: a level, or a tracing filter whose every directive names
/// a level (`info,balancer=debug`). A bare word that is not a level would
/// otherwise be read as a target and silence everything else.
fn log_level(s: &str) -> Result<String, String> {
    let levels = "error, warn, info, debug, trace (or a filter such as info,balancer=debug)";
    for directive in s.split(',') {
        let level = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
        if level
            .trim()
            .parse::<tracing_subscriber::filter::LevelFilter>()
            .is_err()
        {
            return Err(format!("{directive:?} is not a level: use {levels}"));
        }
    }
    tracing_subscriber::EnvFilter::try_new(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("{e}: use {levels}"))
}

fn split_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not MODEL=VALUE")),
    }
}

fn model_budget(s: &str) -> Result<(String, u64), String> {
    let (model, tokens) = split_pair(s)?;
    match tokens.parse::<u64>() {
        Ok(n) if n > 0 => Ok((model, n)),
        _ => Err(format!(
            "{s:?}: the budget must be a positive number of tokens per minute"
        )),
    }
}

fn allowed_path(s: &str) -> Result<String, String> {
    Routes::check(s).map(|()| s.to_owned())
}

fn endpoint_path(s: &str) -> Result<String, String> {
    if s.starts_with('/') {
        Ok(s.to_owned())
    } else {
        Err(format!("{s:?} must start with '/'"))
    }
}

/// How the consecutive failure count is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FailureMode {
    /// Consecutive failed requests (the gateway document; the default).
    Consecutive,
    /// Failed requests within `--cb-window-duration-secs`, once at least
    /// `--cb-window-min-calls` requests were seen in the window.
    Window,
}

/// `balancer launch`: run the gateway.
#[derive(Debug, Clone, Parser)]
#[command(name = "balancer launch")]
pub struct LaunchArgs {
    /// TOML file with any of these flags as keys (`cb_failure_threshold = 5`)
    /// and `[[workers]]` tables (url, model, labels, resilience). Flags given
    /// on the command line win.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Address the HTTP gateway listens on (an IP address or a host name,
    /// resolved at start).
    #[arg(long, default_value = "127.0.0.1", value_parser = host)]
    pub host: IpAddr,
    /// Port of the HTTP gateway.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Worker base URLs (http://host:port).
    #[arg(long, num_args = 1.., value_name = "URL")]
    pub worker_urls: Vec<String>,
    /// Discover workers through etcd at these endpoints (http://host:port,
    /// comma-separated or repeated), beside --worker-urls.
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    pub etcd_endpoints: Vec<String>,
    /// The etcd key prefix; workers are `<PREFIX>workers/<id>`.
    #[arg(long, default_value = "/balancer/")]
    pub etcd_prefix: String,
    /// Share breaker verdicts with the other balancer replicas through etcd
    /// (needs --etcd-endpoints): a worker that --fleet-quorum live replicas
    /// hold open is isolated on every replica.
    #[arg(long)]
    pub fleet_verdicts: bool,
    /// This replica's id in etcd (A-Z a-z 0-9 . _ ~ -); default
    /// `<hostname>-<port>`. A start with an id a live replica holds fails.
    #[arg(long, value_name = "ID")]
    pub replica_id: Option<String>,
    /// Distinct live replicas whose open verdicts isolate a worker.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub fleet_quorum: u32,
    /// The lease of this replica's keys in etcd; out of touch longer than
    /// this, its fleet isolations end.
    #[arg(long, value_name = "S", default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub fleet_lease_secs: u64,
    /// Start N built-in demo workers on loopback and route to them
    /// (what `cargo xtask run` does).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub demo_workers: u16,
    /// Load-balancing policy: round_robin, random, power_of_two, least_load,
    /// cache_aware, consistent_hash.
    #[arg(long, default_value = "power_of_two")]
    pub policy: Policy,
    /// Header whose value is the routing key of `consistent_hash`.
    #[arg(long, default_value = "x-session-id")]
    pub routing_key_header: String,
    /// Headers that carry a request id, tried in order: the first present
    /// is kept; without any the gateway makes one and sends it as the first
    /// of these. The worker gets it and the client gets it back. Off when
    /// absent (`--access-log` alone turns it on with `x-request-id`): a
    /// client's id still reaches the worker as any header does.
    #[arg(long, num_args = 1.., value_name = "HEADER")]
    pub request_id_headers: Vec<String>,

    /// Address of the Prometheus metrics listener.
    #[arg(long, default_value = "127.0.0.1", value_parser = host)]
    pub prometheus_host: IpAddr,
    #[arg(long, default_value_t = 29000)]
    pub prometheus_port: u16,
    /// Prefix of every metric name (`smg` makes the reference gateway's
    /// dashboards and alerts work unchanged).
    #[arg(long, default_value = "balancer")]
    pub metrics_prefix: String,

    /// Address of the admin API (never served on the public port).
    #[arg(long, default_value = "127.0.0.1", value_parser = host)]
    pub admin_host: IpAddr,
    #[arg(long, default_value_t = 29100)]
    pub admin_port: u16,
    /// Require `Authorization: Bearer <TOKEN>` on the admin API. Required
    /// when the admin API listens on a non-loopback address.
    #[arg(long, env = "BALANCER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file (first line; systemd's
    /// `LoadCredential=` puts it under `$CREDENTIALS_DIRECTORY`).
    #[arg(long, value_name = "PATH", conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,

    /// Per-attempt timeout to the first response byte, in seconds.
    #[arg(long, default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout_secs: u64,
    /// Timeout for opening a connection to a worker, in seconds.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub connect_timeout_secs: u64,
    /// A streamed response that sends nothing for this long is cut (an SSE
    /// error event ends it, never `data: [DONE]`); a breaker failure only
    /// with `--cb-stream-failures`.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_idle_timeout_secs: u64,
    /// Request bodies up to this size are kept for replay on retries; larger
    /// ones stream to a single attempt.
    #[arg(long, alias = "max-replay-body-bytes", default_value_t = 8 << 20)]
    pub max_buffered_request_bytes: usize,
    /// Bytes all kept request bodies may hold at once; past it requests get
    /// 503 `body_budget_exhausted` instead of growing memory.
    #[arg(long, default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_buffered_bytes_total: u64,
    /// Largest request body, in bytes: 413 at once from `Content-Length`,
    /// or as soon as a chunked body passes it.
    #[arg(long, default_value_t = 512 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_payload_size: u64,
    /// A request body that sends nothing for this long gets 408.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_body_stall_timeout_secs: u64,
    /// A connection whose request head is not complete this long after
    /// accept (or after its previous response) is closed.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_read_timeout_secs: u64,
    /// A connection with no request in flight (an open stream counts) is
    /// closed after this long.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_connection_timeout_secs: u64,
    /// A client that accepts no byte of a response for this long is
    /// disconnected.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub send_timeout_secs: u64,
    /// HTTP/2 keep-alive ping interval; an unanswered ping closes the
    /// connection.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub http2_keepalive_interval_secs: u64,
    /// Client connections at once on the public port; at the cap, accept waits.
    #[arg(long, default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,
    /// Serve HTTPS on `--port` with this PEM certificate chain (leaf
    /// first); reloaded on SIGHUP and when the file changes.
    #[arg(long, value_name = "PATH", requires = "tls_key_path")]
    pub tls_cert_path: Option<PathBuf>,
    /// The PEM private key of `--tls-cert-path`.
    #[arg(long, value_name = "PATH", requires = "tls_cert_path")]
    pub tls_key_path: Option<PathBuf>,
    /// Callers must present a certificate signed by a CA of this PEM bundle.
    #[arg(long, value_name = "PATH", requires = "tls_cert_path")]
    pub tls_client_ca_path: Option<PathBuf>,
    /// How often the TLS files are checked for a change, in seconds; 0:
    /// only SIGHUP reloads them.
    #[arg(long, default_value_t = 2)]
    pub tls_watch_interval_secs: u64,
    /// Trust these PEM CA certificates for `https://` workers instead of the
    /// system's.
    #[arg(long, value_name = "PATH")]
    pub worker_ca_path: Option<PathBuf>,
    /// Present this PEM certificate chain to `https://` workers (mutual TLS).
    #[arg(long, value_name = "PATH", requires = "client_key_path")]
    pub client_cert_path: Option<PathBuf>,
    /// The PEM private key of `--client-cert-path`.
    #[arg(long, value_name = "PATH", requires = "client_cert_path")]
    pub client_key_path: Option<PathBuf>,
    /// Forward this route too (an exact normalised path, or a prefix ending
    /// in `/*`), for GET and POST. Repeatable. By default only the inference
    /// and model routes reach a worker.
    #[arg(long, value_name = "PATH", value_parser = allowed_path)]
    pub allow_path: Vec<String>,
    /// Breakers never isolate more than this percentage of a model's workers
    /// at once (Envoy's max ejection percent); a breaker past it stays
    /// closed. 100: no limit, as in the reference gateway.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub cb_max_open_percent: u32,
    /// Proxies in front of this gateway whose `X-Forwarded-For` is kept (the
    /// peer is appended); 0 replaces it with the peer.
    #[arg(long, default_value_t = 0)]
    pub trusted_proxy_hops: u32,
    /// Threads serving the HTTP port, each with its own runtime, socket and
    /// worker connections (0: one per core). Their client connections are
    /// kept even: a thread holding more than another hands a new one over.
    #[arg(long, default_value_t = 0)]
    pub serving_threads: usize,
    /// In-flight requests get this long to finish after SIGTERM.
    #[arg(long, default_value_t = 180)]
    pub shutdown_grace_period_secs: u64,
    /// A removed worker's series stay in /metrics (its breaker state at -1)
    /// this long, then go; 0 drops them at once.
    #[arg(long, default_value_t = DEFAULT_REMOVED_GRACE.as_secs())]
    pub removed_worker_grace_secs: u64,

    /// Log level (error, warn, info, debug, trace) or a tracing filter
    /// whose directives name levels (`info,balancer=debug`).
    #[arg(long, default_value = "info", value_parser = log_level)]
    pub log_level: String,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
    /// Log one line per request (target `access`): method, path, model,
    /// status, worker, attempts, time to the response head, duration,
    /// request id. Off: the request path does nothing for it.
    #[arg(long)]
    pub access_log: bool,

    /// Retries per request after the first attempt (0: none).
    #[arg(long, default_value_t = 5)]
    pub retry_max_retries: u32,
    #[arg(long, default_value_t = 50)]
    pub retry_initial_backoff_ms: u64,
    #[arg(long, default_value_t = 30000)]
    pub retry_max_backoff_ms: u64,
    #[arg(long, default_value_t = 1.5, value_parser = positive_f64)]
    pub retry_backoff_multiplier: f64,
    #[arg(long, default_value_t = 0.2, value_parser = fraction)]
    pub retry_jitter_factor: f64,
    /// One attempt per request.
    #[arg(long)]
    pub disable_retries: bool,

    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub health_check_interval_secs: u64,
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub health_check_timeout_secs: u64,
    #[arg(long, default_value = "/health", value_parser = endpoint_path)]
    pub health_check_endpoint: String,
    /// Consecutive failed probes that demote a worker to NotReady.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_failure_threshold: u32,
    /// Consecutive passing probes that promote it back to Ready.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_success_threshold: u32,
    #[arg(long)]
    pub disable_health_check: bool,

    /// Requests running at once; the rest queue (off when absent).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_concurrent_requests: Option<u64>,
    #[arg(long, default_value_t = 100)]
    pub queue_size: usize,
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub queue_timeout_secs: u64,

    /// MODEL=OTHER: when no worker serving MODEL is eligible (or MODEL's
    /// token budget is spent), the request goes to OTHER's workers with the
    /// body's `model` rewritten, and the response names the fallback in an
    /// `x-balancer-fallback` header. Repeatable; chains allowed, cycles refused.
    #[arg(long, value_name = "MODEL=OTHER", value_parser = split_pair)]
    pub fallback_model: Vec<(String, String)>,
    /// Send a request naming a model no worker declares to any worker (the
    /// behaviour before 404 `model_not_found`): for fleets of one model
    /// whose workers list none on `/v1/models`.
    #[arg(long)]
    pub route_undeclared_models: bool,
    /// MODEL=TOKENS: tokens per rolling minute (from the responses' `usage`).
    /// Past it, requests for MODEL take its fallback model, or get 429
    /// `token_budget_exceeded` with Retry-After. Repeatable.
    #[arg(long, value_name = "MODEL=TOKENS", value_parser = model_budget)]
    pub token_budget: Vec<(String, u64)>,

    /// Attach the XDP program to IFACE and steer new TCP connections of the
    /// `--l4-service`s over the workers at line rate, skipping workers whose
    /// breaker is open, that are not ready or that drain. Repeatable: in
    /// remote mode, name the interfaces where clients' packets and the
    /// workers' replies arrive. Without it nothing is attached and the
    /// gateway is L7 only. Needs root and the eBPF object
    /// (`cargo xtask build-ebpf`, or BALANCER_EBPF_OBJECT).
    #[arg(long, value_name = "IFACE")]
    pub xdp_iface: Vec<String>,
    /// How to attach the XDP program: auto (native, else generic), driver
    /// (native only), skb (generic).
    #[arg(long, default_value = "auto")]
    pub xdp_mode: XdpMode,
    /// VIP:PORT whose TCP connections are balanced over the workers of its
    /// address family (at the address and port of their URLs): IPv4
    /// `10.0.0.100:8000`, or IPv6 `[2001:db8::100]:8000` in local mode
    /// only so far. Repeatable.
    #[arg(long, value_name = "VIP:PORT")]
    pub l4_service: Vec<SocketAddr>,
    /// How steered packets reach the workers (NAT both ways, no tunnel).
    #[arg(long, default_value = "local")]
    pub l4_mode: ForwardMode,
    /// Slots of each service's Maglev table; must be prime, and about 100
    /// times the number of workers keeps their shares within 1% of even.
    #[arg(long, default_value_t = DEFAULT_TABLE_SIZE, value_parser = clap::value_parser!(u32).range(3..))]
    pub l4_table_size: u32,
    /// Entries of the LRU connection table (each connection takes two).
    #[arg(long, default_value_t = DEFAULT_CONNTRACK_SIZE, value_parser = clap::value_parser!(u32).range(64..))]
    pub l4_conntrack_size: u32,
    /// Where the XDP datapath's maps and links are pinned (bpffs, mounted
    /// if needed), one folder per interface set and mode. The datapath
    /// stays attached when the agent stops or crashes, and the next start
    /// adopts it: established connections and isolated workers carry over.
    #[arg(long, value_name = "DIR", default_value = balancer_dataplane::pin::DEFAULT_BPFFS_DIR)]
    pub bpffs_dir: PathBuf,
    /// Detach the datapath and remove its pins when the agent stops (every
    /// L4 connection through a service then breaks, as before pinning).
    #[arg(long)]
    pub l4_detach_on_exit: bool,
    /// How often the agent reads the handshake counters of the XDP datapath
    /// (`l4_worker_handshakes_total`, and the breakers with
    /// `--cb-l4-signals`).
    #[arg(long, value_name = "MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub l4_signal_interval_ms: u64,

    #[command(flatten)]
    pub breaker: BreakerArgs,

    #[command(flatten)]
    pub cache_aware: CacheAwareArgs,

    #[command(flatten)]
    pub load: LoadArgs,

    #[command(flatten)]
    pub compat: CompatArgs,

    /// Worker specs from the config file's `[[workers]]` tables.
    #[arg(skip)]
    pub worker_specs: Vec<WorkerSpec>,
}

/// Flags of the reference gateway that have no meaning here (start-up
/// waits, ...). They are accepted so that an existing
/// `smg launch` command line starts this gateway unchanged, and each one
/// given is named in a warning at start.
#[derive(Debug, Clone, Default, Args)]
pub struct CompatArgs {
    #[arg(long, hide = true)]
    pub worker_startup_timeout_secs: Option<String>,
    #[arg(long, hide = true)]
    pub worker_startup_check_interval: Option<String>,
    #[arg(long, hide = true)]
    pub log_dir: Option<String>,
    #[arg(long, hide = true, num_args = 1..)]
    pub cors_allowed_origins: Vec<String>,
}

impl CompatArgs {
    /// The flags given that this gateway ignores.
    pub fn ignored(&self) -> Vec<&'static str> {
        let single = [
            (
                "--worker-startup-timeout-secs",
                &self.worker_startup_timeout_secs,
            ),
            (
                "--worker-startup-check-interval",
                &self.worker_startup_check_interval,
            ),
            ("--log-dir", &self.log_dir),
        ];
        let lists = [("--cors-allowed-origins", &self.cors_allowed_origins)];
        single
            .into_iter()
            .filter(|(_, v)| v.is_some())
            .map(|(f, _)| f)
            .chain(
                lists
                    .into_iter()
                    .filter(|(_, v)| !v.is_empty())
                    .map(|(f, _)| f),
            )
            .collect()
    }
}

/// The flags of `--policy cache_aware`, with `smg launch`'s names and
/// defaults (smg 1.13.0).
#[derive(Debug, Clone, Args)]
pub struct CacheAwareArgs {
    /// cache_aware: the least share (0-1) of a prompt its best-matching
    /// worker must already hold to be sent it.
    #[arg(long, alias = "cache-match-threshold", default_value_t = 0.3, value_parser = fraction)]
    pub cache_threshold: f64,
    /// cache_aware: load is imbalanced when the most and least loaded
    /// candidates differ by more than this many requests ...
    #[arg(long, default_value_t = 64)]
    pub balance_abs_threshold: u32,
    /// ... and the most loaded carries more than this multiple of the least
    /// (at least 1.0); then the least loaded gets the request.
    #[arg(long, default_value_t = 1.5, value_parser = positive_f64)]
    pub balance_rel_threshold: f64,
    /// cache_aware: seconds between evictions of the prefix trees.
    #[arg(long, alias = "eviction-interval", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub eviction_interval_secs: u64,
    /// cache_aware: bytes of prompt text each model's prefix trees keep after
    /// an eviction, shared by all its workers (never more than twice that).
    #[arg(long, default_value_t = 1 << 26, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tree_size: u64,
    /// cache_aware: route by the prefix match alone, without weighing each
    /// worker's recent time to first token against it.
    #[arg(long)]
    pub disable_ttft_weighting: bool,
}

impl CacheAwareArgs {
    pub fn config(&self) -> CacheAwareConfig {
        CacheAwareConfig {
            cache_threshold: self.cache_threshold,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold: self.balance_rel_threshold,
            eviction_interval: Duration::from_secs(self.eviction_interval_secs),
            max_tree_size: usize::try_from(self.max_tree_size).unwrap_or(usize::MAX),
            ttft_weighting: !self.disable_ttft_weighting,
        }
    }
}

/// The workers' own load: `--load-monitor-interval-ms` and
/// `--worker-overload-waiting-requests`.
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// Read each worker's Prometheus `/metrics` this often for its queue and
    /// KV-cache occupancy (vLLM's and SGLang's series); the load-aware
    /// policies use it while it is at most three intervals old, else the
    /// gateway's in-flight count. Each read is bounded by the interval and
    /// 1 MiB, and a failed read never counts against the breaker. 0: off.
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_LOAD_MONITOR_INTERVAL.as_millis() as u64, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub load_monitor_interval_ms: u64,
    /// A worker reporting more than N requests waiting takes no new request
    /// while another candidate can (a shed, not a failure;
    /// `worker_overload_sheds_total`). Off when absent.
    #[arg(long, value_name = "N")]
    pub worker_overload_waiting_requests: Option<u32>,
}

impl LoadArgs {
    fn config(&self) -> LoadMonitorConfig {
        LoadMonitorConfig {
            interval: (self.load_monitor_interval_ms > 0)
                .then(|| Duration::from_millis(self.load_monitor_interval_ms)),
            overload_waiting: self.worker_overload_waiting_requests,
        }
    }
}

/// The `--cb-*` flags.
#[derive(Debug, Clone, Args)]
pub struct BreakerArgs {
    /// Failed requests that open a worker's circuit.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub cb_failure_threshold: u32,
    /// Consecutive half-open successes that close it.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub cb_success_threshold: u32,
    /// Seconds an open circuit waits before a half-open trial.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_timeout_duration_secs: u64,
    /// Window of `--cb-failure-mode window`; validated (> 0) and otherwise
    /// unused in the default consecutive mode, as in the reference gateway.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_window_duration_secs: u64,
    /// `consecutive` (default) or `window`.
    #[arg(long, value_enum, default_value_t = FailureMode::Consecutive)]
    pub cb_failure_mode: FailureMode,
    /// In window mode, fewer requests than this in the window never open the circuit.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub cb_window_min_calls: u32,
    /// At most N requests in flight to a half-open worker (0: no limit, as in
    /// the reference gateway; at most 16777215).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_HALF_OPEN_INFLIGHT)))]
    pub cb_half_open_max_inflight: u32,
    /// Charge a response body that breaks off or stalls (cut at
    /// `--stream-idle-timeout-secs`) as a breaker failure with reason
    /// `broken` or `stall`. Off: the status decides, as in the reference
    /// gateway (a 2xx is a success); the client still sees the cut.
    #[arg(long)]
    pub cb_stream_failures: bool,
    /// Charge the handshakes the XDP datapath sees: a steered SYN answered
    /// with a reset (`l4_refused`) or retransmitted before any SYN-ACK
    /// (`l4_timeout`) is a breaker failure, an established handshake a
    /// success, read every `--l4-signal-interval-ms`. For workers served
    /// through L4 services; off, only requests move the breaker, as in the
    /// reference gateway.
    #[arg(long)]
    pub cb_l4_signals: bool,
    /// Breakers never open (unless a worker sets its own cb_failure_threshold);
    /// outcomes are still counted.
    #[arg(long)]
    pub disable_circuit_breaker: bool,
    /// A response whose first byte (for a stream: its first chunk after the
    /// headers) comes later than this counts as a breaker failure with reason
    /// `slow`, even with a 2xx status. The response still reaches the client.
    /// Off when absent.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_slow_ttfb_ms: Option<u64>,
    /// After a successful half-open trial, keep the worker degraded: it gets
    /// about this percentage of the traffic it would otherwise get, a failure
    /// reopens the circuit, and `--cb-degraded-duration-secs` without one
    /// closes it (state gauge 3). Off when absent.
    #[arg(long, value_name = "PCT", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub cb_degraded_traffic_pct: Option<u32>,
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_degraded_duration_secs: u64,
    /// In half-open, admit at most one request per this many milliseconds,
    /// so the trial is spread in time rather than a burst (0: no spacing).
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub cb_half_open_probe_interval_ms: u64,
    /// A 2xx completion (chat, completions, SGLang `/generate`) with fewer
    /// than N completion tokens counts as a breaker failure with reason
    /// `quality`; the answer still reaches the client. Exempt: requests
    /// asking for fewer than N tokens, tool calls, `finish_reason:
    /// content_filter`. Off when absent.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub cb_min_completion_tokens: Option<u32>,
}

impl BreakerArgs {
    pub fn defaults(&self) -> BreakerDefaults {
        BreakerDefaults {
            settings: Settings {
                failure_threshold: self.cb_failure_threshold,
                success_threshold: self.cb_success_threshold,
                open_timeout: Duration::from_secs(self.cb_timeout_duration_secs),
                half_open_max_inflight: self.cb_half_open_max_inflight,
                window: (self.cb_failure_mode == FailureMode::Window).then(|| WindowSettings {
                    duration: Duration::from_secs(self.cb_window_duration_secs),
                    min_calls: self.cb_window_min_calls,
                }),
                degraded: self.cb_degraded_traffic_pct.map(|pct| DegradedSettings {
                    traffic_pct: pct,
                    duration: Duration::from_secs(self.cb_degraded_duration_secs),
                }),
                half_open_probe_interval: Duration::from_millis(
                    self.cb_half_open_probe_interval_ms,
                ),
            },
            disabled: self.disable_circuit_breaker,
            slow_ttfb: self.cb_slow_ttfb_ms.map(Duration::from_millis),
            stream_failures: self.cb_stream_failures,
            min_completion_tokens: self.cb_min_completion_tokens,
            l4_signals: self.cb_l4_signals,
        }
    }
}

impl LaunchArgs {
    /// Parses `balancer launch` arguments, merging `--config` underneath.
    pub fn parse_with_config(args: Vec<OsString>) -> anyhow::Result<Self> {
        let config_path = find_config_flag(&args);
        let mut merged = vec![OsString::from("balancer launch")];
        let mut specs = Vec::new();
        if let Some(path) = &config_path {
            let (flags, workers) = config_file_args(path, &args)?;
            merged.extend(flags);
            specs = workers;
        }
        merged.extend(args);
        let mut parsed = match LaunchArgs::try_parse_from(merged) {
            Ok(p) => p,
            Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => e.exit(),
            // The binary shows it as clap does (usage, exit 2).
            Err(e) => return Err(e.into()),
        };
        parsed.worker_specs = specs;
        parsed.to_config()?;
        Ok(parsed)
    }

    /// The typed configuration these flags describe, checked.
    pub fn to_config(&self) -> anyhow::Result<GatewayConfig> {
        for url in &self.worker_urls {
            GatewayConfig::check_worker_url(url)?;
        }
        let mut fallbacks = std::collections::HashMap::new();
        for (from, to) in &self.fallback_model {
            if fallbacks.insert(from.clone(), to.clone()).is_some() {
                bail!(
                    "invalid value '{from}={to}' for '--fallback-model': {from} already has a fallback"
                );
            }
        }
        let request_id_headers = self
            .request_id_headers
            .iter()
            .map(|name| {
                HeaderName::try_from(name.as_str()).with_context(|| {
                    format!("invalid value '{name}' for '--request-id-headers': not a header name")
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // The access log quotes an id: it brings the default name along.
        let request_id_headers = if request_id_headers.is_empty() && self.access_log {
            vec![HeaderName::from_static("x-request-id")]
        } else {
            request_id_headers
        };
        let routing_key_header = HeaderName::try_from(self.routing_key_header.as_str())
            .with_context(|| {
                format!(
                    "invalid value '{}' for '--routing-key-header'",
                    self.routing_key_header
                )
            })?;
        let mut workers: Vec<WorkerSpec> = self
            .worker_urls
            .iter()
            .map(|u| WorkerSpec::from_url(u))
            .collect();
        workers.extend(self.worker_specs.iter().cloned());
        let config = GatewayConfig {
            listen: SocketAddr::new(self.host, self.port),
            metrics_listen: SocketAddr::new(self.prometheus_host, self.prometheus_port),
            admin_listen: SocketAddr::new(self.admin_host, self.admin_port),
            admin_token: self.admin_token()?,
            metrics_prefix: self.metrics_prefix.clone(),
            workers,
            etcd: (!self.etcd_endpoints.is_empty()).then(|| EtcdConfig {
                endpoints: self.etcd_endpoints.clone(),
                prefix: self.etcd_prefix.clone(),
            }),
            fleet: self.fleet_config()?,
            policy: self.policy,
            cache_aware: self.cache_aware.config(),
            proxy: ProxyConfig {
                retry: RetryPolicy {
                    max_attempts: if self.disable_retries {
                        1
                    } else {
                        self.retry_max_retries.saturating_add(1)
                    },
                    initial_backoff: Duration::from_millis(self.retry_initial_backoff_ms),
                    max_backoff: Duration::from_millis(self.retry_max_backoff_ms),
                    multiplier: self.retry_backoff_multiplier,
                    jitter: self.retry_jitter_factor,
                },
                request_timeout: Duration::from_secs(self.request_timeout_secs),
                connect_timeout: Duration::from_secs(self.connect_timeout_secs),
                stream_idle_timeout: Duration::from_secs(self.stream_idle_timeout_secs),
                max_replay_body: self.max_buffered_request_bytes,
                routes: Routes::new(&self.allow_path),
                max_payload: self.max_payload_size,
                body_stall_timeout: Duration::from_secs(self.stream_body_stall_timeout_secs),
                buffered_bytes_total: usize::try_from(self.max_buffered_bytes_total)
                    .unwrap_or(usize::MAX),
                trusted_proxy_hops: self.trusted_proxy_hops,
                route_undeclared_models: self.route_undeclared_models,
                routing_key_header,
                request_id_headers,
                access_log: self.access_log,
                fallbacks,
            },
            breaker: self.breaker.defaults(),
            max_open_percent: self.cb_max_open_percent,
            health: HealthThresholds {
                failure: self.health_failure_threshold,
                success: self.health_success_threshold,
            },
            load_monitor: self.load.config(),
            health_check: HealthCheckConfig {
                enabled: !self.disable_health_check,
                endpoint: self.health_check_endpoint.clone(),
                interval: Duration::from_secs(self.health_check_interval_secs),
                timeout: Duration::from_secs(self.health_check_timeout_secs),
            },
            admission: self.max_concurrent_requests.map(|max| AdmissionConfig {
                max_concurrent: max as usize,
                queue_size: self.queue_size,
                queue_timeout: Duration::from_secs(self.queue_timeout_secs),
            }),
            token_budgets: self.token_budget.clone(),
            l4: self.l4_config()?,
            serving_threads: self.serving_threads,
            shutdown_grace: Duration::from_secs(self.shutdown_grace_period_secs),
            removed_worker_grace: Duration::from_secs(self.removed_worker_grace_secs),
            connections: ConnectionConfig {
                header_read_timeout: Duration::from_secs(self.header_read_timeout_secs),
                idle_timeout: Duration::from_secs(self.idle_connection_timeout_secs),
                send_timeout: Duration::from_secs(self.send_timeout_secs),
                http2_keepalive: Duration::from_secs(self.http2_keepalive_interval_secs),
                max_connections: usize::try_from(self.max_connections).unwrap_or(usize::MAX),
            },
            tls: self
                .tls_cert_path
                .clone()
                .zip(self.tls_key_path.clone())
                .map(|(cert_path, key_path)| ServingTlsConfig {
                    cert_path,
                    key_path,
                    client_ca_path: self.tls_client_ca_path.clone(),
                    watch_interval: (self.tls_watch_interval_secs > 0)
                        .then(|| Duration::from_secs(self.tls_watch_interval_secs)),
                }),
            worker_tls: WorkerTlsConfig {
                ca_path: self.worker_ca_path.clone(),
                client_cert_path: self.client_cert_path.clone(),
                client_key_path: self.client_key_path.clone(),
            },
        };
        config.validate()?;
        Ok(config)
    }

    /// `--fleet-verdicts` and its settings; the default replica id is
    /// `<hostname>-<port>`.
    fn fleet_config(&self) -> anyhow::Result<Option<FleetConfig>> {
        if !self.fleet_verdicts {
            return Ok(None);
        }
        let replica_id = match &self.replica_id {
            Some(id) => id.clone(),
            None => {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .context("reading the hostname for the default --replica-id")?;
                format!("{}-{}", host.trim(), self.port)
            }
        };
        Ok(Some(FleetConfig {
            replica_id,
            quorum: self.fleet_quorum as usize,
            lease: Duration::from_secs(self.fleet_lease_secs),
        }))
    }

    /// `--admin-token`, or the first line of `--admin-token-file`.
    fn admin_token(&self) -> anyhow::Result<Option<String>> {
        let Some(path) = &self.admin_token_file else {
            return Ok(self.admin_token.clone());
        };
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "invalid value '{}' for '--admin-token-file': cannot read it",
                path.display()
            )
        })?;
        let token = text.lines().next().unwrap_or_default().trim().to_owned();
        if token.is_empty() {
            bail!(
                "invalid value '{}' for '--admin-token-file': the file holds no token",
                path.display()
            );
        }
        Ok(Some(token))
    }

    /// What the XDP dataplane is to do; `None` without either L4 flag.
    fn l4_config(&self) -> anyhow::Result<Option<L4Config>> {
        if self.xdp_iface.is_empty() && self.l4_service.is_empty() {
            return Ok(None);
        }
        Ok(Some(L4Config {
            ifaces: self.xdp_iface.clone(),
            xdp_mode: self.xdp_mode,
            mode: self.l4_mode,
            services: self.l4_service.clone(),
            table_size: self.l4_table_size,
            conntrack_size: self.l4_conntrack_size,
            bpffs_dir: Some(self.bpffs_dir.clone()),
            detach_on_exit: self.l4_detach_on_exit,
            signal_interval: Duration::from_millis(self.l4_signal_interval_ms),
        }))
    }
}

fn find_config_flag(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let a = a.to_string_lossy();
        if a == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(p) = a.strip_prefix("--config=") {
            return Some(PathBuf::from(p));
        }
    }
    None
}

/// Turns a TOML config file into flags, plus its `[[workers]]` specs. Keys
/// the command line also sets are left out, so the command line wins even
/// for list flags, which would otherwise accumulate.
fn config_file_args(
    path: &Path,
    cli: &[OsString],
) -> anyhow::Result<(Vec<OsString>, Vec<WorkerSpec>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    config_text_args(&text, path, cli)
}

/// [`config_file_args`] on the file's text (the fuzzing entry point).
pub fn config_text_args(
    text: &str,
    path: &Path,
    cli: &[OsString],
) -> anyhow::Result<(Vec<OsString>, Vec<WorkerSpec>)> {
    let on_cli = |flag: &str| {
        cli.iter().any(|a| {
            let a = a.to_string_lossy();
            a.strip_prefix("--")
                .is_some_and(|rest| rest == flag || rest.starts_with(&format!("{flag}=")))
        })
    };
    let mut table: toml::Table = text
        .parse()
        .with_context(|| format!("config file {} is not valid TOML", path.display()))?;
    let workers = match table.remove("workers") {
        Some(v) => v
            .try_into::<Vec<WorkerSpec>>()
            .with_context(|| format!("config file {}: invalid [[workers]]", path.display()))?,
        None => Vec::new(),
    };
    let command = LaunchArgs::command();
    let mut flags = Vec::new();
    for (key, value) in table {
        let flag = key.replace('_', "-");
        let known = command
            .get_arguments()
            .any(|a| a.get_long() == Some(flag.as_str()));
        if !known || flag == "config" {
            bail!("config file {}: unknown key '{key}'", path.display());
        }
        if on_cli(&flag) {
            continue;
        }
        let scalar = |v: &toml::Value| -> anyhow::Result<String> {
            Ok(match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                other => bail!(
                    "config file {}: key '{key}' has an unsupported value {other}",
                    path.display()
                ),
            })
        };
        match &value {
            toml::Value::Boolean(true) => flags.push(format!("--{flag}").into()),
            toml::Value::Boolean(false) => {}
            // One flag per item: single-value list flags (`--fallback-model`)
            // take one value per occurrence.
            toml::Value::Array(items) => {
                for item in items {
                    flags.push(format!("--{flag}").into());
                    flags.push(scalar(item)?.into());
                }
            }
            v => {
                flags.push(format!("--{flag}").into());
                flags.push(scalar(v)?.into());
            }
        }
    }
    Ok((flags, workers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> anyhow::Result<LaunchArgs> {
        LaunchArgs::parse_with_config(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn defaults_match_the_reference_gateway() {
        let a = parse(&[]).unwrap();
        assert_eq!((a.port, a.prometheus_port), (30000, 29000));
        let d = a.breaker.defaults();
        assert_eq!(d.settings, Settings::default());
        assert!(!d.disabled);
        let c = a.to_config().unwrap();
        assert_eq!(c.proxy.retry.max_attempts, 6, "5 retries after the first");
        assert_eq!(a.request_timeout_secs, 1800);
        assert_eq!(a.policy, Policy::PowerOfTwo);
        assert!(c.admission.is_none());
    }

    #[test]
    fn no_flag_means_the_typed_default_configuration() {
        assert_eq!(
            parse(&[]).unwrap().to_config().unwrap(),
            GatewayConfig::default()
        );
    }

    #[test]
    fn reference_gateway_command_lines_start_unchanged() {
        let a = parse(&[
            "--policy",
            "cache_aware",
            "--cache-threshold",
            "0.5",
            "--worker-startup-timeout-secs",
            "30",
            "--cors-allowed-origins",
            "a",
            "b",
        ])
        .unwrap();
        assert_eq!(a.policy, Policy::CacheAware);
        assert_eq!(a.to_config().unwrap().cache_aware.cache_threshold, 0.5);
        assert_eq!(
            a.compat.ignored(),
            ["--worker-startup-timeout-secs", "--cors-allowed-origins"]
        );
    }

    #[test]
    fn fallback_chains_are_accepted_and_cycles_refused() {
        let a = parse(&[
            "--fallback-model",
            "big=mid",
            "--fallback-model",
            "mid=small",
        ])
        .unwrap();
        assert_eq!(a.fallback_model.len(), 2);
        let err = parse(&["--fallback-model", "a=b", "--fallback-model", "b=a"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--fallback-model") && err.contains("cycle"),
            "{err}"
        );
        let err = parse(&["--token-budget", "m=lots"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--token-budget") && err.contains("m=lots"),
            "{err}"
        );
    }

    #[test]
    fn bad_values_name_the_flag_and_the_value() {
        for (flag, value) in [
            ("--cb-failure-threshold", "0"),
            ("--cb-success-threshold", "0"),
            ("--cb-timeout-duration-secs", "0"),
            ("--cb-window-duration-secs", "0"),
            ("--retry-jitter-factor", "2"),
            ("--cb-half-open-max-inflight", "16777216"),
            ("--policy", "fastest"),
            ("--worker-urls", "ftp://x"),
        ] {
            let err = parse(&[flag, value]).unwrap_err();
            let msg = format!("{err:#}");
            assert!(
                msg.contains(flag) && msg.contains(value),
                "{flag} {value}: {msg}"
            );
        }
    }

    #[test]
    fn register_refuses_an_empty_model_naming_the_flag() {
        #[derive(Parser)]
        struct Register {
            #[command(flatten)]
            args: RegisterArgs,
        }
        let registration = |model: &[&str]| {
            let base = ["register", "--etcd-endpoints", "http://127.0.0.1:2379"];
            let rest = ["--id", "a", "--url", "http://127.0.0.1:8000"];
            let argv = base.iter().chain(&rest).chain(model);
            Register::try_parse_from(argv).unwrap().args.registration()
        };
        let error = format!("{:#}", registration(&["--model", ""]).unwrap_err());
        assert!(error.contains("'--model'"), "{error}");
        assert_eq!(
            registration(&["--model", "m"])
                .unwrap()
                .spec
                .model
                .as_deref(),
            Some("m")
        );
        // No model: `register` asks the worker.
        assert_eq!(registration(&[]).unwrap().spec.model, None);
    }

    #[test]
    fn removed_worker_grace_comes_from_the_flag_or_the_config_file() {
        let grace = |args: &[&str]| {
            parse(args)
                .unwrap()
                .to_config()
                .unwrap()
                .removed_worker_grace
        };
        assert_eq!(
            grace(&[]),
            Duration::from_secs(600),
            "ten minutes by default"
        );
        assert_eq!(grace(&["--removed-worker-grace-secs", "0"]), Duration::ZERO);
        let (args, _) =
            config_text_args("removed_worker_grace_secs = 45", Path::new("c.toml"), &[]).unwrap();
        let from_file: Vec<String> = args.iter().map(|a| a.to_string_lossy().into()).collect();
        let from_file: Vec<&str> = from_file.iter().map(String::as_str).collect();
        assert_eq!(grace(&from_file), Duration::from_secs(45));
    }

    #[test]
    fn cache_aware_flags_come_from_the_command_line_or_the_file() {
        let d = parse(&[]).unwrap().to_config().unwrap().cache_aware;
        assert_eq!(d, CacheAwareConfig::default());
        assert_eq!(
            (
                d.cache_threshold,
                d.balance_abs_threshold,
                d.balance_rel_threshold
            ),
            (0.3, 64, 1.5)
        );
        assert_eq!(
            (d.eviction_interval.as_secs(), d.max_tree_size),
            (60, 1 << 26)
        );
        let (flags, _) = config_text_args(
            "policy = \"cache_aware\"\ncache_threshold = 0.5\nbalance_abs_threshold = 8\n\
             balance_rel_threshold = 2.0\neviction_interval_secs = 5\nmax_tree_size = 4096\n\
             disable_ttft_weighting = true\n",
            Path::new("c.toml"),
            &[],
        )
        .unwrap();
        let mut args = vec![OsString::from("balancer launch")];
        args.extend(flags);
        let c = LaunchArgs::try_parse_from(args)
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.policy, Policy::CacheAware);
        assert_eq!(
            c.cache_aware,
            CacheAwareConfig {
                cache_threshold: 0.5,
                balance_abs_threshold: 8,
                balance_rel_threshold: 2.0,
                eviction_interval: Duration::from_secs(5),
                max_tree_size: 4096,
                ttft_weighting: false,
            }
        );
        assert!(parse(&["--cache-threshold", "1.5"]).is_err());
        assert!(parse(&["--balance-rel-threshold", "0.5"]).is_err());
    }

    #[test]
    fn config_file_fills_in_and_flags_win() {
        let dir = std::env::temp_dir().join(format!("balancer-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(
            &path,
            r#"
cb_failure_threshold = 4
cb-timeout-duration-secs = 7
worker_urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9003"]
disable_retries = true

[[workers]]
url = "http://127.0.0.1:9002"
model = "m"
resilience = { capacity_status_codes = [429, 503], cb_failure_threshold = 2 }
"#,
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let a = parse(&["--config", p, "--cb-failure-threshold", "6"]).unwrap();
        assert_eq!(a.breaker.cb_failure_threshold, 6, "the flag wins");
        let b = parse(&["--config", p, "--worker-urls", "http://127.0.0.1:9009"]).unwrap();
        assert_eq!(
            b.worker_urls,
            vec!["http://127.0.0.1:9009"],
            "a list flag replaces the file's list"
        );
        assert_eq!(a.breaker.cb_timeout_duration_secs, 7);
        assert!(a.disable_retries);
        let specs = a.to_config().unwrap().workers;
        assert_eq!(specs.len(), 3);
        assert_eq!(specs[2].resilience.cb_failure_threshold, Some(2));

        std::fs::write(&path, "cb_failure_treshold = 4\n").unwrap();
        let err = parse(&["--config", p]).unwrap_err().to_string();
        assert!(err.contains("cb_failure_treshold"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn min_completion_tokens_comes_from_the_flag_or_the_file_and_per_worker() {
        assert_eq!(parse(&[]).unwrap().breaker.cb_min_completion_tokens, None);
        assert!(
            parse(&["--cb-min-completion-tokens", "0"]).is_err(),
            "0 is not a minimum"
        );
        let a = parse(&["--cb-min-completion-tokens", "2"]).unwrap();
        assert_eq!(
            a.to_config().unwrap().breaker.min_completion_tokens,
            Some(2)
        );
        let path =
            std::env::temp_dir().join(format!("balancer-quality-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            r#"
cb_min_completion_tokens = 3

[[workers]]
url = "http://127.0.0.1:9002"
resilience = { cb_min_completion_tokens = 0 }
"#,
        )
        .unwrap();
        let config = parse(&["--config", path.to_str().unwrap()])
            .unwrap()
            .to_config()
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(config.breaker.min_completion_tokens, Some(3));
        let worker = &config.workers[0].resilience;
        assert_eq!(worker.cb_min_completion_tokens, Some(0));
        let (_, classifier) = config.breaker.resolve(worker);
        assert_eq!(
            classifier.min_completion_tokens(),
            None,
            "0 turns it off here"
        );
    }

    #[test]
    fn retry_max_retries_counts_the_retries_after_the_first_attempt() {
        let attempts = |args: &[&str]| parse(args).unwrap().to_config().unwrap().proxy.retry;
        assert_eq!(attempts(&["--retry-max-retries", "0"]).max_attempts, 1);
        assert_eq!(attempts(&["--retry-max-retries", "2"]).max_attempts, 3);
        assert_eq!(attempts(&["--disable-retries"]).max_attempts, 1);
    }

    #[test]
    fn a_log_level_that_is_not_a_level_is_refused() {
        for ok in [
            "info",
            "TRACE",
            "warn,balancer=debug",
            "balancer::proxy=trace",
        ] {
            assert_eq!(parse(&["--log-level", ok]).unwrap().log_level, ok);
        }
        for bad in ["verbose", "info,verbose", "balancer=loud"] {
            let err = parse(&["--log-level", bad]).unwrap_err().to_string();
            assert!(
                err.contains("--log-level") && err.contains("error, warn, info, debug, trace"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_host_may_be_a_name() {
        let a = parse(&["--host", "localhost", "--admin-host", "localhost"]).unwrap();
        assert!(a.host.is_loopback(), "{}", a.host);
        assert!(a.admin_host.is_loopback(), "{}", a.admin_host);
        assert_eq!(a.host, IpAddr::from([127, 0, 0, 1]), "IPv4 first");
        let err = parse(&["--host", "no-such-host.invalid"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--host"), "{err}");
    }

    #[test]
    fn an_admin_api_off_loopback_needs_a_token_which_a_file_can_hold() {
        let err = parse(&["--admin-host", "0.0.0.0"]).unwrap_err().to_string();
        assert!(err.contains("--admin-token"), "{err}");
        let path = std::env::temp_dir().join(format!("balancer-token-{}", std::process::id()));
        std::fs::write(&path, "s3cret\n").unwrap();
        let c = parse(&[
            "--admin-host",
            "0.0.0.0",
            "--admin-token-file",
            path.to_str().unwrap(),
        ])
        .unwrap()
        .to_config()
        .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(c.admin_token.as_deref(), Some("s3cret"));
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/balancer.toml");
        let args = parse(&["--config", example]).expect("deploy/balancer.toml parses");
        let config = args.to_config().expect("and validates");
        assert_eq!(config.workers.len(), 2);
        assert_eq!(
            config.workers[1].resilience.capacity_status_codes,
            Some(vec![429, 503])
        );
    }

    #[test]
    fn l4_flags_are_checked_together() {
        assert!(parse(&[]).unwrap().to_config().unwrap().l4.is_none());
        let a = parse(&[
            "--xdp-iface",
            "eth0",
            "--xdp-iface",
            "eth1",
            "--l4-service",
            "10.0.0.1:80",
            "--l4-mode",
            "remote",
            "--xdp-mode",
            "skb",
            "--l4-table-size",
            "251",
        ])
        .unwrap();
        let l4 = a.to_config().unwrap().l4.unwrap();
        assert_eq!(l4.ifaces, ["eth0", "eth1"]);
        assert_eq!(l4.mode, ForwardMode::Remote);
        assert_eq!(l4.xdp_mode, XdpMode::Skb);
        assert_eq!(l4.table_size, 251);
        assert_eq!(l4.services, ["10.0.0.1:80".parse::<SocketAddr>().unwrap()]);
        let dual = parse(&[
            "--xdp-iface",
            "eth0",
            "--l4-service",
            "10.0.0.1:80",
            "--l4-service",
            "[2001:db8::100]:8000",
        ])
        .unwrap();
        assert_eq!(
            dual.to_config().unwrap().l4.unwrap().services,
            [
                "10.0.0.1:80".parse::<SocketAddr>().unwrap(),
                "[2001:db8::100]:8000".parse().unwrap()
            ]
        );
        for (args, needle) in [
            (&["--xdp-iface", "eth0"][..], "--l4-service"),
            (&["--l4-service", "10.0.0.1:80"][..], "--xdp-iface"),
            (
                &[
                    "--xdp-iface",
                    "e",
                    "--l4-service",
                    "10.0.0.1:80",
                    "--l4-table-size",
                    "65536",
                ][..],
                "prime",
            ),
            (
                &[
                    "--xdp-iface",
                    "e",
                    "--l4-service",
                    "10.0.0.1:80",
                    "--l4-service",
                    "10.0.0.1:80",
                ][..],
                "twice",
            ),
            (&["--l4-mode", "tunnel"][..], "--l4-mode"),
            (
                &[
                    "--xdp-iface",
                    "e",
                    "--l4-service",
                    "[2001:db8::100]:8000",
                    "--l4-mode",
                    "remote",
                ][..],
                "--l4-mode local",
            ),
        ] {
            let err = format!("{:#}", parse(args).unwrap_err());
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }

    #[test]
    fn disable_circuit_breaker_keeps_per_worker_threshold() {
        let a = parse(&["--disable-circuit-breaker"]).unwrap();
        let d = a.breaker.defaults();
        let (s, _) = d.resolve(&Default::default());
        assert_eq!(s.failure_threshold, u32::MAX);
        let own = balancer_core::spec::Resilience {
            cb_failure_threshold: Some(3),
            ..Default::default()
        };
        assert_eq!(d.resolve(&own).0.failure_threshold, 3);
    }

    #[test]
    fn backoff_grows_caps_and_honours_retry_after() {
        let p = RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            multiplier: 2.0,
            jitter: 0.0,
        };
        assert_eq!(p.backoff(1, None), Duration::from_millis(100));
        assert_eq!(p.backoff(3, None), Duration::from_millis(400));
        assert_eq!(p.backoff(10, None), Duration::from_millis(1000));
        assert_eq!(
            p.backoff(1, Some(Duration::from_millis(500))),
            Duration::from_millis(500)
        );
        assert_eq!(
            p.backoff(1, Some(Duration::from_secs(60))),
            Duration::from_millis(1000)
        );
    }
    #[test]
    fn load_monitor_flags() {
        let c = parse(&[]).unwrap().to_config().unwrap();
        assert_eq!(
            c.load_monitor,
            LoadMonitorConfig {
                interval: Some(Duration::from_millis(500)),
                overload_waiting: None,
            }
        );
        let c = parse(&[
            "--load-monitor-interval-ms",
            "0",
            "--worker-overload-waiting-requests",
            "16",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(c.load_monitor.interval, None, "0 turns the scrapes off");
        assert_eq!(c.load_monitor.overload_waiting, Some(16));
        for bad in [
            ["--load-monitor-interval-ms", "600001"],
            ["--worker-overload-waiting-requests", "-1"],
        ] {
            assert!(parse(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn fleet_verdicts_need_etcd_and_come_from_flags_or_the_file() {
        let err = format!("{:#}", parse(&["--fleet-verdicts"]).unwrap_err());
        assert!(
            err.contains("--fleet-verdicts") && err.contains("--etcd-endpoints"),
            "{err}"
        );
        let etcd = ["--etcd-endpoints", "http://127.0.0.1:2379"];
        let off = parse(&etcd).unwrap().to_config().unwrap();
        assert_eq!(off.fleet, None, "off by default");

        let on = parse(&[etcd[0], etcd[1], "--fleet-verdicts", "--port", "8080"])
            .unwrap()
            .to_config()
            .unwrap()
            .fleet
            .expect("on");
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(on.replica_id, format!("{}-8080", host.trim()));
        assert_eq!((on.quorum, on.lease), (2, Duration::from_secs(10)));

        let path = std::env::temp_dir().join(format!("balancer-fleet-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            r#"
etcd_endpoints = ["http://127.0.0.1:2379"]
fleet_verdicts = true
replica_id = "lb-1"
fleet_quorum = 3
fleet_lease_secs = 4
"#,
        )
        .unwrap();
        let from_file = parse(&["--config", path.to_str().unwrap()]);
        std::fs::remove_file(&path).unwrap();
        let fleet = from_file.unwrap().to_config().unwrap().fleet.unwrap();
        assert_eq!(
            fleet,
            FleetConfig {
                replica_id: "lb-1".into(),
                quorum: 3,
                lease: Duration::from_secs(4),
            }
        );

        for (flag, value) in [
            ("--replica-id", "a/b"),
            ("--fleet-quorum", "0"),
            ("--fleet-lease-secs", "1"),
        ] {
            let err = parse(&[etcd[0], etcd[1], "--fleet-verdicts", flag, value])
                .and_then(|a| a.to_config())
                .unwrap_err();
            let msg = format!("{err:#}");
            assert!(
                msg.contains(flag) && msg.contains(value),
                "{flag} {value}: {msg}"
            );
        }
    }
}

/// `balancer register`: keep one worker registered in etcd under a lease
/// (a sidecar for nodes that cannot write etcd themselves).
#[derive(Debug, Clone, Args)]
pub struct RegisterArgs {
    /// etcd endpoints (http://host:port, comma-separated or repeated).
    #[arg(long, value_delimiter = ',', required = true, value_name = "URL")]
    pub etcd_endpoints: Vec<String>,
    /// The etcd key prefix the balancers watch.
    #[arg(long, default_value = "/balancer/")]
    pub etcd_prefix: String,
    /// The worker's id: its key is `<PREFIX>workers/<ID>`.
    #[arg(long)]
    pub id: String,
    /// The worker's base URL (http://host:port).
    #[arg(long)]
    pub url: String,
    /// The model it serves; when absent, the worker's /v1/models is asked
    /// (until it answers) and the model it serves is registered. Empty is
    /// refused.
    #[arg(long, env = "BALANCER_MODEL")]
    pub model: Option<String>,
    /// Lease time to live, in seconds (at least 2); renewed every third.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..))]
    pub ttl_secs: u64,
}

impl RegisterArgs {
    /// The registration these arguments describe, checked.
    pub fn registration(&self) -> anyhow::Result<Registration> {
        if self.id.is_empty() || self.id.contains('/') {
            bail!(
                "invalid value '{}' for '--id': a non-empty name without '/'",
                self.id
            );
        }
        let spec = WorkerSpec {
            model: self.model.clone(),
            ..WorkerSpec::from_url(&self.url)
        };
        spec.validate().map_err(|error| {
            let (value, flag) = if error.field == "model" {
                (spec.model.clone().unwrap_or_default(), "--model")
            } else {
                (redacted_url(&self.url), "--url")
            };
            anyhow::Error::new(error).context(format!("invalid value '{value}' for '{flag}'"))
        })?;
        Ok(Registration {
            etcd: EtcdConfig {
                endpoints: self.etcd_endpoints.clone(),
                prefix: self.etcd_prefix.clone(),
            },
            id: self.id.clone(),
            spec,
            ttl: Duration::from_secs(self.ttl_secs),
        })
    }
}

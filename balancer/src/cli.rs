//! The gateway's command line and config file, mapped onto [`GatewayConfig`].
//!
//! Owns flag names, their defaults, their help (grouped under [`heading`]s)
//! and per-flag validation; the checks that span settings are
//! [`GatewayConfig::validate`]'s. Names and defaults follow the reference
//! gateway (`smg launch`) so operators can reuse their flags. Every flag can
//! also come from a TOML file (`--config PATH`, keys are flag names with `_`
//! or `-`; [`file`](mod@file) reads and checks it), and flags on the command line win.
//! Bad values fail at start with the flag (or the file and key) and the
//! value named.

pub mod file;

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::builder::{PossibleValuesParser, TypedValueParser};
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
use file::ConfigFile;

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

/// The log filter a subcommand runs with: its `--log-level` when given
/// (on the command line or in the config file), else `RUST_LOG` when set,
/// else `default`. The explicit setting wins so that an environment (a
/// unit's `Environment=`) cannot override the configuration file.
pub fn log_filter(explicit: Option<&str>, rust_log: Option<&str>, default: &str) -> String {
    explicit
        .or(rust_log.filter(|f| !f.trim().is_empty()))
        .unwrap_or(default)
        .to_owned()
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

/// The groups of `balancer launch --help`, in the order they appear.
pub mod heading {
    pub const CONFIG: &str = "Configuration";
    pub const LISTENERS: &str = "Listeners";
    pub const WORKERS: &str = "Workers and discovery";
    pub const ROUTING: &str = "Routing";
    pub const CACHE_AWARE: &str = "Routing: the cache_aware policy";
    pub const TIMEOUTS: &str = "Timeouts";
    pub const RETRIES: &str = "Retries";
    pub const BREAKERS: &str = "Circuit breakers";
    pub const LLM: &str = "LLM options";
    pub const HEALTH: &str = "Health checks";
    pub const LIMITS: &str = "Admission and limits";
    pub const TLS: &str = "TLS";
    pub const L4: &str = "L4 steering (XDP)";
    pub const FLEET: &str = "Fleet";
    pub const OBSERVABILITY: &str = "Observability";
    /// All of them, in order.
    pub const ALL: [&str; 15] = [
        CONFIG,
        LISTENERS,
        WORKERS,
        ROUTING,
        CACHE_AWARE,
        TIMEOUTS,
        RETRIES,
        BREAKERS,
        LLM,
        HEALTH,
        LIMITS,
        TLS,
        L4,
        FLEET,
        OBSERVABILITY,
    ];
}

/// A flag taking one of `all`, by name (`name`), parsed back with its
/// `FromStr`: `--help` lists the names and a wrong one is refused with them.
fn one_of<T>(
    all: impl IntoIterator<Item = T>,
    name: fn(T) -> &'static str,
) -> impl TypedValueParser<Value = T>
where
    T: FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    PossibleValuesParser::new(all.into_iter().map(name)).try_map(|s| s.parse::<T>())
}

/// `balancer launch`: run the gateway.
///
/// Flags by group; `-h` gives one line each, `--help` the details. Every
/// flag can also be a key of the `--config` file.
#[derive(Debug, Clone, Parser)]
#[command(name = "balancer launch")]
pub struct LaunchArgs {
    /// TOML file whose keys are these flags' names; the command line wins
    ///
    /// Keys are flag names with `_` or `-` (`cb_failure_threshold = 5`), plus
    /// `[[workers]]` tables (url, model, labels, resilience). A flag given on
    /// the command line (or by its environment variable) replaces the file's
    /// key, lists included. Errors name the file and the key.
    #[arg(long, value_name = "PATH", help_heading = heading::CONFIG)]
    pub config: Option<PathBuf>,
    /// Check the flags and the file, print a summary and exit (0, or 2)
    ///
    /// Checks every value, how they combine, the TLS files and, with L4 on,
    /// that the eBPF object is found; binds no port and attaches nothing.
    /// Exits 0 printing a one-line summary, or 2 printing the error.
    #[arg(long, help_heading = heading::CONFIG)]
    pub check_config: bool,

    /// Address of the HTTP gateway (an IP address or a host name)
    ///
    /// A name is resolved once at start; of its addresses the first IPv4
    /// one is taken (`localhost` is 127.0.0.1).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1", value_parser = host, help_heading = heading::LISTENERS)]
    pub host: IpAddr,
    /// Port of the HTTP gateway
    #[arg(long, default_value_t = 30000, help_heading = heading::LISTENERS)]
    pub port: u16,
    /// Address of the Prometheus metrics listener (`/metrics`)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1", value_parser = host, help_heading = heading::LISTENERS)]
    pub prometheus_host: IpAddr,
    /// Port of the Prometheus metrics listener
    #[arg(long, value_name = "PORT", default_value_t = 29000, help_heading = heading::LISTENERS)]
    pub prometheus_port: u16,
    /// Address of the admin API (never served on the public port)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1", value_parser = host, help_heading = heading::LISTENERS)]
    pub admin_host: IpAddr,
    /// Port of the admin API
    #[arg(long, value_name = "PORT", default_value_t = 29100, help_heading = heading::LISTENERS)]
    pub admin_port: u16,
    /// Bearer token the admin API requires (none when absent, on loopback)
    ///
    /// Callers send `Authorization: Bearer <TOKEN>`. Required when the admin
    /// API listens on an address other than loopback.
    #[arg(long, value_name = "TOKEN", env = "BALANCER_ADMIN_TOKEN", hide_env_values = true, help_heading = heading::LISTENERS)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file's first line
    ///
    /// systemd's `LoadCredential=` puts it under `$CREDENTIALS_DIRECTORY`, as
    /// the shipped units do.
    #[arg(long, value_name = "PATH", conflicts_with = "admin_token", help_heading = heading::LISTENERS)]
    pub admin_token_file: Option<PathBuf>,
    /// Threads serving the HTTP port (0: one per core)
    ///
    /// Each has its own runtime, socket and worker connections. Their client
    /// connections are kept even: a thread holding more than another hands a
    /// new one over.
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = heading::LISTENERS)]
    pub serving_threads: usize,
    /// Proxies in front whose `X-Forwarded-For` is kept (0: replaced)
    ///
    /// With N > 0 the peer is appended to the header the client sent; with 0
    /// the header is replaced with the peer's address.
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = heading::LISTENERS)]
    pub trusted_proxy_hops: u32,
    /// Seconds in-flight requests get to finish after SIGTERM
    #[arg(long, value_name = "SECS", default_value_t = 180, help_heading = heading::LISTENERS)]
    pub shutdown_grace_period_secs: u64,

    /// Worker base URLs (http://host:port or https://, without /v1)
    #[arg(long, num_args = 1.., value_name = "URL", help_heading = heading::WORKERS)]
    pub worker_urls: Vec<String>,
    /// Discover workers through etcd at these endpoints (none when absent)
    ///
    /// http://host:port URLs, comma-separated or repeated; the workers found
    /// there are added to --worker-urls and the config file's.
    #[arg(long, value_delimiter = ',', value_name = "URL", help_heading = heading::WORKERS)]
    pub etcd_endpoints: Vec<String>,
    /// The etcd key prefix; workers are `<PREFIX>workers/<id>`
    #[arg(long, value_name = "PREFIX", default_value = "/balancer/", help_heading = heading::WORKERS)]
    pub etcd_prefix: String,
    /// Start N built-in demo workers on loopback and route to them
    ///
    /// What `cargo xtask run` does; for trying the gateway without GPUs.
    #[arg(long, default_value_t = 0, value_name = "N", help_heading = heading::WORKERS)]
    pub demo_workers: u16,
    /// Seconds a removed worker's series stay in /metrics (0: none)
    ///
    /// Its breaker state gauge reads -1 meanwhile, then its series go.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_REMOVED_GRACE.as_secs(), help_heading = heading::WORKERS)]
    pub removed_worker_grace_secs: u64,

    /// Load-balancing policy
    ///
    /// round_robin: the next worker in turn; random; power_of_two: the less
    /// loaded of two random workers; least_load: the least loaded;
    /// cache_aware: the worker most likely to hold the prompt's prefix,
    /// unless load is imbalanced (see its group below); consistent_hash: by
    /// the hash of --routing-key-header, round robin without one.
    #[arg(long, default_value = "power_of_two", value_parser = one_of(Policy::ALL, Policy::as_str), help_heading = heading::ROUTING)]
    pub policy: Policy,
    /// Header whose value is the routing key of `consistent_hash`
    #[arg(long, value_name = "HEADER", default_value = "x-session-id", help_heading = heading::ROUTING)]
    pub routing_key_header: String,
    /// Forward this route too (repeatable; GET and POST)
    ///
    /// An exact normalised path, or a prefix ending in `/*`. By default only
    /// the inference and model routes reach a worker.
    #[arg(long, value_name = "PATH", value_parser = allowed_path, help_heading = heading::ROUTING)]
    pub allow_path: Vec<String>,

    #[command(flatten)]
    pub load: LoadArgs,

    #[command(flatten)]
    pub cache_aware: CacheAwareArgs,

    /// Seconds per attempt until the worker's first response byte
    #[arg(long, value_name = "SECS", default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub request_timeout_secs: u64,
    /// Seconds to open a connection to a worker
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub connect_timeout_secs: u64,
    /// Seconds a streamed response may send nothing before it is cut
    ///
    /// An SSE error event ends it, never `data: [DONE]`; it is a breaker
    /// failure only with --cb-stream-failures.
    #[arg(long, value_name = "SECS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub stream_idle_timeout_secs: u64,
    /// Seconds a request body may send nothing before a 408
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub stream_body_stall_timeout_secs: u64,
    /// Seconds a client has to send a request head
    ///
    /// Counted from accept, or from the previous response; past it the
    /// connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub header_read_timeout_secs: u64,
    /// Seconds a client connection may stay idle before it is closed
    ///
    /// Idle: no request in flight (an open stream counts as one).
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub idle_connection_timeout_secs: u64,
    /// Seconds a client may accept no byte of a response before it is cut
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub send_timeout_secs: u64,
    /// Seconds between HTTP/2 keep-alive pings
    ///
    /// An unanswered ping closes the connection.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::TIMEOUTS)]
    pub http2_keepalive_interval_secs: u64,

    /// Retries per request after the first attempt (0: none)
    #[arg(long, value_name = "N", default_value_t = 5, help_heading = heading::RETRIES)]
    pub retry_max_retries: u32,
    /// Milliseconds before the first retry
    ///
    /// Each wait is this times --retry-backoff-multiplier per retry before,
    /// at most --retry-max-backoff-ms; a worker's longer `Retry-After`
    /// replaces it (within the same cap).
    #[arg(long, value_name = "MS", default_value_t = 50, help_heading = heading::RETRIES)]
    pub retry_initial_backoff_ms: u64,
    /// Milliseconds at most between two attempts
    #[arg(long, value_name = "MS", default_value_t = 30000, help_heading = heading::RETRIES)]
    pub retry_max_backoff_ms: u64,
    /// Factor the wait grows by per retry (at least 1.0)
    #[arg(long, value_name = "FACTOR", default_value_t = 1.5, value_parser = positive_f64, help_heading = heading::RETRIES)]
    pub retry_backoff_multiplier: f64,
    /// Random spread (0-1) of each wait: 0.2 is ±20%
    #[arg(long, value_name = "FRACTION", default_value_t = 0.2, value_parser = fraction, help_heading = heading::RETRIES)]
    pub retry_jitter_factor: f64,
    /// One attempt per request
    #[arg(long, help_heading = heading::RETRIES)]
    pub disable_retries: bool,

    #[command(flatten)]
    pub breaker: BreakerArgs,

    /// Most workers of a model (percent) breakers may isolate at once
    ///
    /// Envoy's max ejection percent: a breaker past it stays closed. 100: no
    /// limit, as in the reference gateway.
    #[arg(long, value_name = "PCT", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100), help_heading = heading::BREAKERS)]
    pub cb_max_open_percent: u32,

    /// MODEL=OTHER: OTHER's workers serve MODEL when none of MODEL's can
    ///
    /// When no worker serving MODEL is eligible (or MODEL's token budget is
    /// spent), the request goes to OTHER's workers with the body's `model`
    /// rewritten, and the response names the fallback in an
    /// `x-balancer-fallback` header. Repeatable; chains allowed, cycles
    /// refused.
    #[arg(long, value_name = "MODEL=OTHER", value_parser = split_pair, help_heading = heading::LLM)]
    pub fallback_model: Vec<(String, String)>,
    /// Send a request naming an undeclared model to any worker
    ///
    /// Instead of 404 `model_not_found`: for fleets of one model whose
    /// workers list none on `/v1/models`.
    #[arg(long, help_heading = heading::LLM)]
    pub route_undeclared_models: bool,
    /// MODEL=TOKENS: tokens per rolling minute for MODEL (none when absent)
    ///
    /// Counted from the responses' `usage`. Past it, requests for MODEL take
    /// its fallback model, or get 429 `token_budget_exceeded` with
    /// Retry-After. Repeatable.
    #[arg(long, value_name = "MODEL=TOKENS", value_parser = model_budget, help_heading = heading::LLM)]
    pub token_budget: Vec<(String, u64)>,

    /// Seconds between two health probes of a worker
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::HEALTH)]
    pub health_check_interval_secs: u64,
    /// Seconds a health probe may take
    #[arg(long, value_name = "SECS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::HEALTH)]
    pub health_check_timeout_secs: u64,
    /// Path the health probe GETs (a 2xx passes)
    #[arg(long, value_name = "PATH", default_value = "/health", value_parser = endpoint_path, help_heading = heading::HEALTH)]
    pub health_check_endpoint: String,
    /// Consecutive failed probes that demote a worker to NotReady
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..), help_heading = heading::HEALTH)]
    pub health_failure_threshold: u32,
    /// Consecutive passing probes that promote it back to Ready
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..), help_heading = heading::HEALTH)]
    pub health_success_threshold: u32,
    /// No health probes: no worker is demoted by one
    #[arg(long, help_heading = heading::HEALTH)]
    pub disable_health_check: bool,

    /// Requests running at once; the rest queue (no limit when absent)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::LIMITS)]
    pub max_concurrent_requests: Option<u64>,
    /// Requests that may wait for --max-concurrent-requests; past it, 429
    #[arg(long, value_name = "N", default_value_t = 100, help_heading = heading::LIMITS)]
    pub queue_size: usize,
    /// Seconds a request may wait in that queue before a 503
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::LIMITS)]
    pub queue_timeout_secs: u64,
    /// Client connections at once on the public port; at the cap, accept waits
    #[arg(long, value_name = "N", default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::LIMITS)]
    pub max_connections: u64,
    /// Largest request body, in bytes (413 past it)
    ///
    /// Refused at once from `Content-Length`, or as soon as a chunked body
    /// passes it.
    #[arg(long, value_name = "BYTES", default_value_t = 512 << 20, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::LIMITS)]
    pub max_payload_size: u64,
    /// Bytes of a request body kept for replay on retries
    ///
    /// Larger bodies stream to a single attempt.
    #[arg(long, value_name = "BYTES", alias = "max-replay-body-bytes", default_value_t = 8 << 20, help_heading = heading::LIMITS)]
    pub max_buffered_request_bytes: usize,
    /// Bytes all kept request bodies may hold at once
    ///
    /// Past it requests get 503 `body_budget_exhausted` instead of growing
    /// memory.
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(1..), help_heading = heading::LIMITS)]
    pub max_buffered_bytes_total: u64,

    /// Serve HTTPS on --port with this PEM certificate chain (leaf first)
    ///
    /// Reloaded on SIGHUP and when the file changes.
    #[arg(long, value_name = "PATH", requires = "tls_key_path", help_heading = heading::TLS)]
    pub tls_cert_path: Option<PathBuf>,
    /// The PEM private key of --tls-cert-path
    #[arg(long, value_name = "PATH", requires = "tls_cert_path", help_heading = heading::TLS)]
    pub tls_key_path: Option<PathBuf>,
    /// Require client certificates signed by a CA of this PEM bundle
    #[arg(long, value_name = "PATH", requires = "tls_cert_path", help_heading = heading::TLS)]
    pub tls_client_ca_path: Option<PathBuf>,
    /// Seconds between checks of the TLS files for a change (0: SIGHUP only)
    #[arg(long, value_name = "SECS", default_value_t = 2, help_heading = heading::TLS)]
    pub tls_watch_interval_secs: u64,
    /// Trust these PEM CA certificates for https:// workers (default: the system's)
    #[arg(long, value_name = "PATH", help_heading = heading::TLS)]
    pub worker_ca_path: Option<PathBuf>,
    /// Present this PEM certificate chain to https:// workers (mutual TLS)
    #[arg(long, value_name = "PATH", requires = "client_key_path", help_heading = heading::TLS)]
    pub client_cert_path: Option<PathBuf>,
    /// The PEM private key of --client-cert-path
    #[arg(long, value_name = "PATH", requires = "client_cert_path", help_heading = heading::TLS)]
    pub client_key_path: Option<PathBuf>,

    /// Attach the XDP program to IFACE (repeatable; L7 only when absent)
    ///
    /// New TCP connections of the --l4-service addresses are steered over the
    /// workers at line rate, skipping workers whose breaker is open, that are
    /// not ready or that drain. In remote mode, name the interfaces where
    /// clients' packets and the workers' replies arrive. Needs root (or the
    /// capabilities of deploy/balancer.service) and the eBPF object (`cargo
    /// xtask build-ebpf`, or BALANCER_EBPF_OBJECT).
    #[arg(long, value_name = "IFACE", help_heading = heading::L4)]
    pub xdp_iface: Vec<String>,
    /// How to attach the XDP program
    ///
    /// auto: native, else generic; driver: native only; skb: generic.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = one_of(XdpMode::ALL, XdpMode::as_str), help_heading = heading::L4)]
    pub xdp_mode: XdpMode,
    /// VIP:PORT whose TCP connections are balanced over the workers (repeatable)
    ///
    /// Over the workers of its address family, to the address and port of
    /// each worker's URL: IPv4 `10.0.0.100:8000`, or IPv6
    /// `[2001:db8::100]:8000`.
    #[arg(long, value_name = "VIP:PORT", help_heading = heading::L4)]
    pub l4_service: Vec<SocketAddr>,
    /// How steered packets reach the workers (NAT both ways, no tunnel)
    ///
    /// local: workers on this host; remote: workers on hosts that route their
    /// replies back through this one (needs net.ipv4.ip_forward=1, and
    /// net.ipv6.conf.all.forwarding=1 for IPv6 services).
    #[arg(long, value_name = "MODE", default_value = "local", value_parser = one_of(ForwardMode::ALL, ForwardMode::as_str), help_heading = heading::L4)]
    pub l4_mode: ForwardMode,
    /// Slots of each service's Maglev table (a prime)
    ///
    /// About 100 times the number of workers keeps their shares within 1% of
    /// even.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_TABLE_SIZE, value_parser = clap::value_parser!(u32).range(3..), help_heading = heading::L4)]
    pub l4_table_size: u32,
    /// Entries of the LRU connection table (each connection takes two)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_CONNTRACK_SIZE, value_parser = clap::value_parser!(u32).range(64..), help_heading = heading::L4)]
    pub l4_conntrack_size: u32,
    /// Where the XDP datapath's maps and links are pinned (bpffs)
    ///
    /// Mounted if needed; one folder per interface set and mode. The
    /// datapath stays attached when the agent stops or crashes, and the next
    /// start adopts it: established connections and isolated workers carry
    /// over.
    #[arg(long, value_name = "DIR", default_value = balancer_dataplane::pin::DEFAULT_BPFFS_DIR, help_heading = heading::L4)]
    pub bpffs_dir: PathBuf,
    /// Detach the datapath and remove its pins when the agent stops
    ///
    /// Every L4 connection through a service then breaks, as before pinning.
    #[arg(long, help_heading = heading::L4)]
    pub l4_detach_on_exit: bool,
    /// Milliseconds between reads of the datapath's handshake counters
    ///
    /// They feed `l4_worker_handshakes_total` and, with --cb-l4-signals, the
    /// breakers.
    #[arg(long, value_name = "MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=60_000), help_heading = heading::L4)]
    pub l4_signal_interval_ms: u64,

    /// Share breaker verdicts with the other replicas through etcd
    ///
    /// Needs --etcd-endpoints: a worker that --fleet-quorum live replicas
    /// hold open is isolated on every replica.
    #[arg(long, help_heading = heading::FLEET)]
    pub fleet_verdicts: bool,
    /// This replica's id in etcd (default: `<hostname>-<port>`)
    ///
    /// A-Z a-z 0-9 . _ ~ -. A start with an id a live replica holds fails.
    #[arg(long, value_name = "ID", help_heading = heading::FLEET)]
    pub replica_id: Option<String>,
    /// Distinct live replicas whose open verdicts isolate a worker
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024), help_heading = heading::FLEET)]
    pub fleet_quorum: u32,
    /// Seconds of this replica's etcd lease
    ///
    /// Out of touch longer than this, its fleet isolations end.
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..=3600), help_heading = heading::FLEET)]
    pub fleet_lease_secs: u64,

    /// Log level: error, warn, info, debug, trace or a filter (default: RUST_LOG, else info)
    ///
    /// A filter's directives name levels (`info,balancer=debug`). Without
    /// this flag (or key), RUST_LOG when set, else info; with it, RUST_LOG is
    /// ignored.
    #[arg(long, value_name = "LEVEL", value_parser = log_level, help_heading = heading::OBSERVABILITY)]
    pub log_level: Option<String>,
    /// Log as JSON lines (the access log included)
    #[arg(long, help_heading = heading::OBSERVABILITY)]
    pub log_json: bool,
    /// Log one line per request (target `access`)
    ///
    /// Method, path, model, status, worker, attempts, time to the response
    /// head, duration, request id. Off: the request path does nothing for it.
    #[arg(long, help_heading = heading::OBSERVABILITY)]
    pub access_log: bool,
    /// Headers carrying a request id, tried in order (off when absent)
    ///
    /// The first present is kept; without any the gateway makes one and
    /// sends it as the first of these. The worker gets it and the client gets
    /// it back. --access-log alone turns it on with `x-request-id`; off, a
    /// client's id still reaches the worker as any header does.
    #[arg(long, num_args = 1.., value_name = "HEADER", help_heading = heading::OBSERVABILITY)]
    pub request_id_headers: Vec<String>,
    /// Prefix of every metric name
    ///
    /// `smg` makes the reference gateway's dashboards and alerts work
    /// unchanged.
    #[arg(long, value_name = "PREFIX", default_value = "balancer", help_heading = heading::OBSERVABILITY)]
    pub metrics_prefix: String,

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
#[command(next_help_heading = heading::CACHE_AWARE)]
pub struct CacheAwareArgs {
    /// Least share (0-1) of a prompt the best-matching worker must hold
    ///
    /// Below it the request goes by load rather than to that worker.
    #[arg(long, value_name = "FRACTION", alias = "cache-match-threshold", default_value_t = 0.3, value_parser = fraction)]
    pub cache_threshold: f64,
    /// Requests between the most and least loaded that make load imbalanced
    ///
    /// Load is imbalanced when the most and least loaded candidates differ
    /// by more than this many requests and by more than
    /// --balance-rel-threshold; then the least loaded gets the request.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub balance_abs_threshold: u32,
    /// Multiple of the least load the most loaded must carry (at least 1.0)
    ///
    /// The second condition of an imbalance, beside --balance-abs-threshold.
    #[arg(long, value_name = "FACTOR", default_value_t = 1.5, value_parser = positive_f64)]
    pub balance_rel_threshold: f64,
    /// Seconds between evictions of the prefix trees
    #[arg(long, value_name = "SECS", alias = "eviction-interval", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub eviction_interval_secs: u64,
    /// Bytes of prompt text each model's prefix trees keep after an eviction
    ///
    /// Shared by all the model's workers; never more than twice that.
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 26, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tree_size: u64,
    /// Route by the prefix match alone, not weighed by time to first token
    ///
    /// By default each worker's recent time to first token is weighed
    /// against its prefix match.
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
#[command(next_help_heading = heading::ROUTING)]
pub struct LoadArgs {
    /// Milliseconds between reads of each worker's load (0: off)
    ///
    /// The worker's Prometheus `/metrics`, for its queue and KV-cache
    /// occupancy (vLLM's and SGLang's series); the load-aware policies use it
    /// while it is at most three intervals old, else the gateway's in-flight
    /// count. Each read is bounded by the interval and 1 MiB, and a failed
    /// read never counts against the breaker.
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_LOAD_MONITOR_INTERVAL.as_millis() as u64, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub load_monitor_interval_ms: u64,
    /// Skip a worker reporting more than N requests waiting (off when absent)
    ///
    /// It takes no new request while another candidate can: a shed, not a
    /// failure (`worker_overload_sheds_total`).
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
#[command(next_help_heading = heading::BREAKERS)]
pub struct BreakerArgs {
    /// Failed requests that open a worker's circuit
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub cb_failure_threshold: u32,
    /// Consecutive half-open successes that close it
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub cb_success_threshold: u32,
    /// Seconds an open circuit waits before a half-open trial
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_timeout_duration_secs: u64,
    /// Seconds of the window of `--cb-failure-mode window`
    ///
    /// Validated (> 0) and otherwise unused in the default consecutive mode,
    /// as in the reference gateway.
    #[arg(long, value_name = "SECS", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_window_duration_secs: u64,
    /// How failures are counted
    #[arg(long, value_name = "MODE", value_enum, default_value_t = FailureMode::Consecutive)]
    pub cb_failure_mode: FailureMode,
    /// In window mode, requests in the window needed before it can open
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub cb_window_min_calls: u32,
    /// Requests in flight to a half-open worker at most (0: no limit)
    ///
    /// 0, as in the reference gateway; at most 16777215.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_HALF_OPEN_INFLIGHT)))]
    pub cb_half_open_max_inflight: u32,
    /// Count a response body that breaks off or stalls as a failure
    ///
    /// A body cut at --stream-idle-timeout-secs or broken off is a breaker
    /// failure with reason `broken` or `stall`. Off: the status decides, as
    /// in the reference gateway (a 2xx is a success); the client still sees
    /// the cut.
    #[arg(long)]
    pub cb_stream_failures: bool,
    /// Count the handshakes the XDP datapath sees (L4 services)
    ///
    /// A steered SYN answered with a reset (`l4_refused`) or retransmitted
    /// before any SYN-ACK (`l4_timeout`) is a breaker failure, an established
    /// handshake a success, read every --l4-signal-interval-ms. Off, only
    /// requests move the breaker, as in the reference gateway.
    #[arg(long)]
    pub cb_l4_signals: bool,
    /// Breakers never open; outcomes are still counted
    ///
    /// A worker that sets its own cb_failure_threshold keeps its breaker.
    #[arg(long)]
    pub disable_circuit_breaker: bool,
    /// Milliseconds to a first byte past which a response is a failure (off when absent)
    ///
    /// For a stream: its first chunk after the headers. Such a response is a
    /// breaker failure with reason `slow`, even with a 2xx status; it still
    /// reaches the client.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_slow_ttfb_ms: Option<u64>,
    /// Percent of its traffic a recovered worker gets while degraded (off when absent)
    ///
    /// After a successful half-open trial the worker stays degraded: it gets
    /// about this percentage of the traffic it would otherwise get, a failure
    /// reopens the circuit, and --cb-degraded-duration-secs without one
    /// closes it (state gauge 3).
    #[arg(long, value_name = "PCT", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub cb_degraded_traffic_pct: Option<u32>,
    /// Seconds without a failure that end the degraded state
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub cb_degraded_duration_secs: u64,
    /// Milliseconds between half-open trial requests (0: no spacing)
    ///
    /// In half-open, at most one request per interval is admitted, so the
    /// trial is spread in time rather than a burst.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub cb_half_open_probe_interval_ms: u64,
    /// Fewer completion tokens than N in a 2xx is a failure (off when absent)
    ///
    /// A chat, completion or SGLang `/generate` answer with fewer than N
    /// completion tokens is a breaker failure with reason `quality`; the
    /// answer still reaches the client. Exempt: requests asking for fewer
    /// than N tokens, tool calls, `finish_reason: content_filter`.
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
    /// Parses `balancer launch` arguments, merging `--config` underneath
    /// (see [`file`](mod@file)), and checks the configuration they describe.
    pub fn parse_with_config(args: Vec<OsString>) -> anyhow::Result<Self> {
        let command = launch_command();
        let given = given_on_command_line(&command, &args);
        let mut merged = vec![OsString::from("balancer launch")];
        let mut file = None;
        if let Some(path) = given.as_ref().and_then(|m| m.get_one::<PathBuf>("config")) {
            let read = ConfigFile::read(path, &command)?;
            merged.extend(read.args_under(&command, given.as_ref()));
            file = Some(read);
        }
        merged.extend(args);
        let mut parsed = match LaunchArgs::try_parse_from(merged) {
            Ok(p) => p,
            Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => e.exit(),
            // The binary shows it as clap does (usage, exit 2).
            Err(e) => return Err(e.into()),
        };
        if let Some(file) = &mut file {
            parsed.worker_specs = std::mem::take(&mut file.workers);
        }
        if let Err(error) = parsed.to_config() {
            return Err(match &file {
                Some(file) => file.blame(&command, error, given.as_ref()),
                None => error,
            });
        }
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

/// The `--config` file's arguments for the flags `cli` leaves to it, and
/// its `[[workers]]` specs (also the fuzzing entry point).
pub fn config_text_args(
    text: &str,
    path: &Path,
    cli: &[OsString],
) -> anyhow::Result<(Vec<OsString>, Vec<WorkerSpec>)> {
    let command = launch_command();
    let file = ConfigFile::parse(text, path, &command)?;
    let given = given_on_command_line(&command, cli);
    Ok((file.args_under(&command, given.as_ref()), file.workers))
}

/// `balancer launch`'s flags, built (so that what each flag takes can be
/// read off it).
fn launch_command() -> clap::Command {
    let mut command = LaunchArgs::command();
    command.build();
    command
}

/// The command line parsed alone and leniently (a flag it requires may be
/// in the file): which flags it gives, and `--config`. `None` when it
/// cannot be read at all (`--help`); the full parse then says why.
fn given_on_command_line(command: &clap::Command, cli: &[OsString]) -> Option<clap::ArgMatches> {
    let argv = std::iter::once(OsString::from("balancer launch")).chain(cli.iter().cloned());
    command
        .clone()
        .ignore_errors(true)
        .try_get_matches_from(argv)
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ArgAction;

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

    /// The error `text` as a config file named `balancer.toml` gets.
    fn file_error(text: &str) -> String {
        let command = launch_command();
        ConfigFile::parse(text, Path::new("balancer.toml"), &command)
            .unwrap_err()
            .to_string()
    }

    /// `args` parsed with `text` as their `--config` file.
    fn parse_with_file(text: &str, args: &[&str]) -> anyhow::Result<LaunchArgs> {
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("balancer-file-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let mut argv = vec!["--config", path.to_str().unwrap()];
        argv.extend(args);
        let parsed = parse(&argv);
        std::fs::remove_file(&path).unwrap();
        parsed
    }

    #[test]
    fn config_file_errors_name_the_file_and_the_key() {
        for (text, expected) in [
            (
                r#"disable_retries = "yes""#,
                r#"balancer.toml: key 'disable_retries': expected a boolean, found string "yes""#,
            ),
            (
                "disable_retries = 1",
                "balancer.toml: key 'disable_retries': expected a boolean, found integer 1",
            ),
            (
                r#"port = "abc""#,
                "balancer.toml: key 'port': invalid value 'abc': invalid digit found in string",
            ),
            (
                "port = 70000",
                "balancer.toml: key 'port': invalid value '70000': 70000 is not in 0..=65535",
            ),
            (
                "port = [1, 2]",
                "balancer.toml: key 'port': expected a string or a number, found an array",
            ),
            (
                "log_json = [true]",
                "balancer.toml: key 'log_json': expected a boolean, found an array",
            ),
            (
                "worker_urls = [{ url = \"x\" }]",
                "balancer.toml: key 'worker_urls': expected an array of strings or numbers, \
                 found a table in it",
            ),
            (
                r#"cb_failure_mode = "sometimes""#,
                "balancer.toml: key 'cb_failure_mode': invalid value 'sometimes': \
                 possible values: consecutive, window",
            ),
            ("foo = 1", "balancer.toml: unknown key 'foo'"),
            (
                "cb_failure_treshold = 4",
                "balancer.toml: unknown key 'cb_failure_treshold' \
                 (did you mean 'cb_failure_threshold'?)",
            ),
            (
                "config = \"other.toml\"",
                "balancer.toml: unknown key 'config'",
            ),
            (
                "port = 1\nport-x = 2",
                "balancer.toml: unknown key 'port-x' (did you mean 'port'?)",
            ),
            (
                "cb_failure_threshold = 4\ncb-failure-threshold = 5",
                "balancer.toml: key 'cb_failure_threshold': 'cb-failure-threshold' sets it too",
            ),
            (
                "disable_retries = yes",
                "balancer.toml:1:19: invalid string; expected `\"`, `'`",
            ),
            (
                "[[workers]]\nurl = \"http://127.0.0.1:1\"\n[[workers]]\nurl = \"ftp://x\"",
                "balancer.toml: workers[1].url: \"ftp://x\": a worker URL starts with http:// or https://",
            ),
            (
                "[[workers]]\nurl = \"http://127.0.0.1:1\"\nresilience = { cb_timeout_secs = \"x\" }",
                "balancer.toml: workers[0].resilience.cb_timeout_secs: \
                 invalid type: string \"x\", expected u64",
            ),
            (
                "[[workers]]\nurl = \"http://127.0.0.1:1\"\nresilience = { cb_timeout_secs = 0 }",
                "balancer.toml: workers[0].resilience.cb_timeout_secs: must be at least 1",
            ),
            (
                "workers = 3",
                "balancer.toml: key 'workers': expected [[workers]] tables, found integer 3",
            ),
        ] {
            assert_eq!(file_error(text), expected, "{text}");
        }
    }

    /// Checks that span settings name flags; when the flag's value came
    /// from the file, the error names the file and the key instead.
    #[test]
    fn whole_configuration_errors_name_the_file_key_that_set_the_value() {
        let blamed = |text: &str, args: &[&str]| {
            let error = format!("{:#}", parse_with_file(text, args).unwrap_err());
            let file = error.split(": key '").next().unwrap().to_owned();
            (file.ends_with(".toml").then_some(()), error)
        };
        for (text, key) in [
            (
                "fleet_verdicts = true\netcd_endpoints = [\"http://127.0.0.1:2379\"]\nfleet_quorum = 0",
                "fleet_quorum",
            ),
            (
                "worker_urls = [\"http://127.0.0.1:8000/v1\"]",
                "worker_urls",
            ),
            ("fallback_model = [\"a=b\", \"b=a\"]", "fallback_model"),
        ] {
            let (named, error) = blamed(text, &[]);
            assert!(named.is_some(), "{text}: {error}");
            assert!(
                error.contains(&format!(": key '{key}': ")),
                "{text}: {error}"
            );
        }
        // The same value from the command line is the command line's.
        let (named, error) = blamed(
            "fleet_verdicts = true\netcd_endpoints = [\"http://127.0.0.1:2379\"]",
            &["--fleet-quorum", "0"],
        );
        assert!(named.is_none(), "{error}");
        assert!(error.contains("--fleet-quorum"), "{error}");
    }

    #[test]
    fn keys_whose_flags_exclude_each_other_are_refused_as_the_files() {
        let error =
            file_error("admin_token = \"t\"\nadmin_token_file = \"/etc/balancer/admin-token\"");
        assert!(
            error.starts_with("balancer.toml: keys '")
                && error.contains("'admin_token'")
                && error.contains("'admin_token_file'")
                && error.ends_with("cannot be used together"),
            "{error}"
        );
    }

    #[test]
    fn a_config_file_value_may_start_with_a_dash() {
        let c = parse_with_file("admin_token = \"-abc\"\nadmin_host = \"0.0.0.0\"", &[])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.admin_token.as_deref(), Some("-abc"));
    }

    #[test]
    fn the_command_line_wins_over_the_file_by_name_alias_or_conflict() {
        let file = "port = 8080\nmax_buffered_request_bytes = 1000\n\
                    worker_urls = [\"http://127.0.0.1:9001\", \"http://127.0.0.1:9002\"]\n\
                    allow_path = [\"/a\", \"/b\"]\nadmin_token = \"from-file\"";
        let a = parse_with_file(file, &[]).unwrap();
        assert_eq!((a.port, a.max_buffered_request_bytes), (8080, 1000));
        assert_eq!(a.worker_urls.len(), 2);
        assert_eq!(a.allow_path, ["/a", "/b"]);

        let token = std::env::temp_dir().join(format!("balancer-cli-token-{}", std::process::id()));
        std::fs::write(&token, "from-token-file\n").unwrap();
        let a = parse_with_file(
            file,
            &[
                "--port=9090",
                "--max-replay-body-bytes",
                "2000",
                "--worker-urls",
                "http://127.0.0.1:9003",
                "--allow-path",
                "/c",
                "--admin-token-file",
                token.to_str().unwrap(),
            ],
        );
        let config = a.as_ref().ok().map(LaunchArgs::to_config);
        std::fs::remove_file(&token).unwrap();
        let a = a.unwrap();
        assert_eq!(a.port, 9090, "a scalar");
        assert_eq!(a.max_buffered_request_bytes, 2000, "by the flag's alias");
        assert_eq!(a.worker_urls, ["http://127.0.0.1:9003"], "a list");
        assert_eq!(a.allow_path, ["/c"], "a repeated flag");
        assert_eq!(
            a.admin_token, None,
            "the file's token conflicts with the flag's file"
        );
        assert_eq!(
            config.unwrap().unwrap().admin_token.as_deref(),
            Some("from-token-file")
        );
    }

    #[test]
    fn an_explicit_log_level_wins_over_rust_log() {
        assert_eq!(log_filter(Some("debug"), Some("trace"), "info"), "debug");
        assert_eq!(log_filter(None, Some("trace"), "info"), "trace");
        assert_eq!(log_filter(None, Some(" "), "info"), "info");
        assert_eq!(log_filter(None, None, "warn"), "warn");
        let from_file = parse_with_file("log_level = \"warn\"", &[]).unwrap();
        assert_eq!(from_file.log_level.as_deref(), Some("warn"));
        assert_eq!(parse(&[]).unwrap().log_level, None);
    }

    /// The text of `--flag`'s entry in a rendered help: from its line to
    /// the next flag's.
    fn entry<'a>(help: &'a str, long: &str) -> &'a str {
        let start = help
            .find(&format!("      --{long} "))
            .or_else(|| help.find(&format!("      --{long}\n")))
            .unwrap_or_else(|| panic!("--{long} is not in the help"));
        let rest = &help[start + 6..];
        let end = rest.find("\n      --").unwrap_or(rest.len());
        &rest[..end]
    }

    #[test]
    fn help_is_grouped_and_every_flag_is_described_with_its_values() {
        let mut command = LaunchArgs::command();
        command.build();
        let short = command.render_help().to_string();
        let long = command.render_long_help().to_string();
        let mut from = 0;
        for heading in heading::ALL {
            let at = long[from..]
                .find(&format!("\n{heading}:\n"))
                .unwrap_or_else(|| panic!("{heading:?} missing or out of order"));
            from += at + 1;
            assert!(short.contains(&format!("\n{heading}:\n")), "-h: {heading}");
        }
        let mut enumerated = 0;
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.is_hide_set() || id == "help" {
                continue;
            }
            let help = arg.get_help().map(ToString::to_string);
            assert!(
                help.as_deref().is_some_and(|h| !h.is_empty()),
                "--{id} has no help"
            );
            assert!(!help.unwrap().contains('\n'), "--{id}: -h takes one line");
            assert!(
                arg.get_help_heading()
                    .is_some_and(|h| heading::ALL.contains(&h)),
                "--{id} is in no group"
            );
            let long_name = arg.get_long().unwrap();
            for (suffix, unit) in [("-secs", "SECS"), ("-ms", "MS")] {
                if long_name.ends_with(suffix) {
                    let names = arg.get_value_names().unwrap_or_default();
                    assert_eq!(names, [unit], "--{long_name} shows its unit");
                }
            }
            let values = arg.get_possible_values();
            if !values.is_empty() && !matches!(arg.get_action(), ArgAction::SetTrue) {
                enumerated += 1;
                for help in [&short, &long] {
                    let text = entry(help, long_name);
                    for value in &values {
                        assert!(text.contains(value.get_name()), "--{long_name}: {text}");
                    }
                }
            }
        }
        assert!(
            enumerated >= 4,
            "--policy, --xdp-mode, --l4-mode, --cb-failure-mode"
        );
        assert!(
            short.len() < long.len(),
            "-h is the summary of --help ({} and {} bytes)",
            short.len(),
            long.len()
        );
        assert!(entry(&long, "cb-stream-failures").contains("reason `broken`"));
        assert!(!entry(&short, "cb-stream-failures").contains("reason `broken`"));
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
            assert_eq!(
                parse(&["--log-level", ok]).unwrap().log_level.as_deref(),
                Some(ok)
            );
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
            "--l4-mode",
            "remote",
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

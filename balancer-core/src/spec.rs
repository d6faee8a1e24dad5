//! Worker specs: what an operator says about a worker.
//!
//! Owns [`WorkerSpec`] (URL, model, labels), the per-worker [`Resilience`]
//! overrides of the gateway document, their validation ([`SpecError`] names
//! the field), and [`BreakerDefaults`], which merges flags and overrides into
//! one breaker's [`Settings`] and [`Classifier`]. Pure data: it must not depend
//! on the registry's live state; its only I/O is resolving a worker's host
//! name, on demand ([`WorkerAddress::resolve`]), never while validating.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::breaker::{Classifier, DEFAULT_CAPACITY_CODES, DEFAULT_FAILURE_CODES, Settings};

/// The per-worker `resilience` block of the gateway document. Every field is
/// optional; a status list that is set replaces the default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resilience {
    /// Statuses that are capacity pushback and record nothing; replaces the default `[429]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_status_codes: Option<Vec<u16>>,
    /// Statuses that count as failures; replaces the default `[408, 429, 500, 502, 503, 504]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retryable_status_codes: Option<Vec<u16>>,
    /// Overrides `--cb-failure-threshold`, even under `--disable-circuit-breaker`; at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cb_failure_threshold: Option<u32>,
    /// Overrides `--cb-success-threshold` for this worker; at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cb_success_threshold: Option<u32>,
    /// Overrides `--cb-timeout-duration-secs`, the open timeout in seconds; at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cb_timeout_secs: Option<u64>,
    /// Overrides `--cb-slow-ttfb-ms` for this worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cb_slow_ttfb_ms: Option<u64>,
    /// Overrides `--cb-stream-failures` for this worker: a response body
    /// that breaks off or stalls is a failure instead of its status's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cb_stream_failures: Option<bool>,
    /// Overrides `--cb-min-completion-tokens` for this worker: a 2xx
    /// completion with fewer completion tokens is a `quality` failure; 0
    /// turns the rule off for this worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cb_min_completion_tokens: Option<u32>,
    /// Overrides `--cb-l4-signals` for this worker: handshakes the XDP
    /// datapath sees refused or timing out are failures, established ones
    /// successes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cb_l4_signals: Option<bool>,
}

/// A spec that cannot be applied; names the field and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {message}")]
pub struct SpecError {
    /// The offending field, as a path (`url`, `resilience.cb_timeout_secs`).
    pub field: String,
    /// What is wrong with its value.
    pub message: String,
}

impl SpecError {
    fn new(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: field.to_owned(),
            message: message.into(),
        }
    }
}

impl Resilience {
    /// Checks that status codes are in 100..=599 and thresholds and durations at least 1.
    pub fn validate(&self) -> Result<(), SpecError> {
        for (field, codes) in [
            (
                "resilience.capacity_status_codes",
                &self.capacity_status_codes,
            ),
            (
                "resilience.retryable_status_codes",
                &self.retryable_status_codes,
            ),
        ] {
            if let Some(bad) = codes.iter().flatten().find(|c| !(100..=599).contains(*c)) {
                return Err(SpecError::new(
                    field,
                    format!("{bad} is not an HTTP status (100-599)"),
                ));
            }
        }
        for (field, value) in [
            (
                "resilience.cb_failure_threshold",
                self.cb_failure_threshold.map(u64::from),
            ),
            (
                "resilience.cb_success_threshold",
                self.cb_success_threshold.map(u64::from),
            ),
            ("resilience.cb_timeout_secs", self.cb_timeout_secs),
            ("resilience.cb_slow_ttfb_ms", self.cb_slow_ttfb_ms),
        ] {
            if value == Some(0) {
                return Err(SpecError::new(field, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// `patch` over `self`: fields the patch sets win.
    pub fn merged(&self, patch: &Resilience) -> Resilience {
        Resilience {
            capacity_status_codes: patch
                .capacity_status_codes
                .clone()
                .or_else(|| self.capacity_status_codes.clone()),
            retryable_status_codes: patch
                .retryable_status_codes
                .clone()
                .or_else(|| self.retryable_status_codes.clone()),
            cb_failure_threshold: patch.cb_failure_threshold.or(self.cb_failure_threshold),
            cb_success_threshold: patch.cb_success_threshold.or(self.cb_success_threshold),
            cb_timeout_secs: patch.cb_timeout_secs.or(self.cb_timeout_secs),
            cb_slow_ttfb_ms: patch.cb_slow_ttfb_ms.or(self.cb_slow_ttfb_ms),
            cb_stream_failures: patch.cb_stream_failures.or(self.cb_stream_failures),
            cb_min_completion_tokens: patch
                .cb_min_completion_tokens
                .or(self.cb_min_completion_tokens),
            cb_l4_signals: patch.cb_l4_signals.or(self.cb_l4_signals),
        }
    }
}

/// What the flags say about every breaker, before per-worker overrides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BreakerDefaults {
    /// Breaker tunables from the `--cb-*` flags.
    pub settings: Settings,
    /// `--disable-circuit-breaker`: the failure threshold is raised to its
    /// maximum unless a worker sets its own.
    pub disabled: bool,
    /// `--cb-slow-ttfb-ms`.
    pub slow_ttfb: Option<Duration>,
    /// `--cb-stream-failures`: a broken or stalled response body is a
    /// failure; off, the status decides (the document).
    pub stream_failures: bool,
    /// `--cb-min-completion-tokens`: a 2xx completion with fewer
    /// completion tokens is a `quality` failure; `None` is off.
    pub min_completion_tokens: Option<u32>,
    /// `--cb-l4-signals`: the datapath's handshake observations move the
    /// breaker.
    pub l4_signals: bool,
}

impl BreakerDefaults {
    /// Merges a worker's overrides over these defaults into its breaker settings and classifier;
    /// unset status lists take the document's defaults.
    pub fn resolve(&self, r: &Resilience) -> (Settings, Classifier) {
        let base = self.settings;
        let default_failure = if self.disabled {
            u32::MAX
        } else {
            base.failure_threshold
        };
        let settings = Settings {
            failure_threshold: r.cb_failure_threshold.unwrap_or(default_failure),
            success_threshold: r.cb_success_threshold.unwrap_or(base.success_threshold),
            open_timeout: r
                .cb_timeout_secs
                .map_or(base.open_timeout, Duration::from_secs),
            ..base
        };
        let classifier = Classifier::new(
            r.capacity_status_codes
                .as_deref()
                .unwrap_or(DEFAULT_CAPACITY_CODES),
            r.retryable_status_codes
                .as_deref()
                .unwrap_or(DEFAULT_FAILURE_CODES),
        )
        .with_slow_ttfb(
            r.cb_slow_ttfb_ms
                .map(Duration::from_millis)
                .or(self.slow_ttfb),
        )
        .with_stream_failures(r.cb_stream_failures.unwrap_or(self.stream_failures))
        .with_min_completion_tokens(r.cb_min_completion_tokens.or(self.min_completion_tokens))
        .with_l4_signals(r.cb_l4_signals.unwrap_or(self.l4_signals));
        (settings, classifier)
    }
}

/// A worker as an operator describes it (`--worker-urls`, config file, or
/// `POST /workers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// `http://host[:port]` or `https://host[:port]`, without a path or query; [`WorkerSpec::validate`] normalises it into a
    /// [`WorkerAddress`].
    pub url: String,
    /// The model it serves; learned from its `/v1/models` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Free-form labels, shown by the admin API.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Overrides of the breaker flags and status lists for this worker.
    #[serde(default)]
    pub resilience: Resilience,
}

impl WorkerSpec {
    /// A spec with only a URL: no model, labels or overrides.
    pub fn from_url(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            ..Self::default()
        }
    }

    /// Checks the spec and splits its URL into the parts the proxy needs.
    /// An empty model is refused: no request names it, so the worker would
    /// never be chosen (leaving it out learns the worker's models instead).
    pub fn validate(&self) -> Result<WorkerAddress, SpecError> {
        if self.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err(SpecError::new(
                "model",
                "must not be empty (leave it out to learn the worker's models from its /v1/models)",
            ));
        }
        self.resilience.validate()?;
        WorkerAddress::parse(&self.url)
    }
}

/// Where a worker is: its normalised base URL and, when it resolves, its
/// socket address (the XDP dataplane steers to it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerAddress {
    /// `http://host[:port]` or `https://host[:port]` without a trailing
    /// slash and without any credentials: the worker's identity in the
    /// fleet, its metric label and what logs and the admin API show.
    pub base: String,
    /// `http` or `https`: whether the proxy speaks TLS to the worker.
    pub scheme: http::uri::Scheme,
    /// The `host[:port]` the proxy puts in request URIs.
    pub authority: http::uri::Authority,
    /// The worker's socket address (port 80, or 443 for `https`, when none
    /// is given), known at
    /// once for an IP literal; a host name is resolved on first use by
    /// [`WorkerAddress::resolve`], never while validating.
    socket: OnceLock<Option<SocketAddr>>,
    /// `user:password@` of the URL as an `Authorization: Basic` value, sent to
    /// the worker; never shown.
    pub basic_auth: Option<Secret>,
}

/// A credential: compared and cloned like a string, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The credential itself, for the one header it goes into.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// `user:password` as written in a URL, its escapes (`%2F` for `/`, `%40`
/// for `@`) decoded; a malformed escape stays as written.
fn percent_decoded(userinfo: &str) -> Vec<u8> {
    let bytes = userinfo.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| userinfo.get(i + 1..i + 3))
            .flatten()
            .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

/// `url` with any `user:password@` replaced by `***@`, for messages (with or
/// without a scheme). Every message or log field that shows a URL as an
/// operator wrote it goes through this.
pub fn redacted_url(url: &str) -> String {
    let Some(at) = url.rfind('@') else {
        return url.to_owned();
    };
    let start = url.find("://").map_or(0, |scheme| scheme + 3);
    if at < start {
        return url.to_owned();
    }
    format!("{}***{}", &url[..start], &url[at..])
}

/// 443 for `https`, 80 otherwise.
fn default_port(scheme: &http::uri::Scheme) -> u16 {
    if *scheme == http::uri::Scheme::HTTPS {
        443
    } else {
        80
    }
}

impl WorkerAddress {
    /// Whether [`WorkerAddress::resolve`] answers without a DNS lookup.
    pub fn is_resolved(&self) -> bool {
        self.socket.get().is_some()
    }

    /// The worker's socket address: an IP literal's at once, a host name's
    /// first resolution (kept). Resolving a name blocks on DNS: call it off
    /// the async runtime (`spawn_blocking`); `None` when the name does not
    /// resolve.
    pub fn resolve(&self) -> Option<SocketAddr> {
        *self.socket.get_or_init(|| {
            let port = self.port();
            (self.authority.host().trim_matches(['[', ']']), port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut addrs| addrs.next())
        })
    }

    /// The port the URL names, or its scheme's default.
    fn port(&self) -> u16 {
        self.authority
            .port_u16()
            .unwrap_or_else(|| default_port(&self.scheme))
    }

    /// Whether the proxy speaks TLS to this worker (`https://`).
    pub fn is_tls(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTPS
    }

    /// Parses and normalises an `http[s]://[user:password@]host[:port]` URL
    /// without any DNS lookup; other schemes, paths and queries are refused.
    /// Credentials are kept apart and redacted from every message.
    pub fn parse(url: &str) -> Result<Self, SpecError> {
        let shown = redacted_url(url);
        let bad = |m: &str| SpecError::new("url", format!("{shown:?}: {m}"));
        let uri: http::Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let scheme = match uri.scheme_str() {
            Some("http") => http::uri::Scheme::HTTP,
            Some("https") => http::uri::Scheme::HTTPS,
            _ => return Err(bad("a worker URL starts with http:// or https://")),
        };
        let full = uri.authority().cloned().ok_or_else(|| bad("no host"))?;
        if uri.path().trim_end_matches('/').ends_with("/v1") && uri.query().is_none() {
            // The usual slip: the OpenAI clients' base URL.
            return Err(bad(&format!(
                "a worker URL is scheme://host:port, without a path: drop the {} \
                 (requests keep theirs, /v1/chat/completions goes to the worker as it came)",
                uri.path()
            )));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(bad("a worker URL is scheme://host:port, without a path"));
        }
        let (userinfo, host_port) = match full.as_str().rsplit_once('@') {
            Some((user, host)) => (Some(user), host),
            None => (None, full.as_str()),
        };
        let authority: http::uri::Authority = host_port.parse().map_err(|_| bad("no host"))?;
        let port = authority
            .port_u16()
            .unwrap_or_else(|| default_port(&scheme));
        let socket = OnceLock::new();
        if let Ok(ip) = authority.host().trim_matches(['[', ']']).parse::<IpAddr>() {
            let _ = socket.set(Some(SocketAddr::new(ip, port)));
        }
        let basic_auth = userinfo.map(|u| {
            use base64::Engine as _;
            Secret(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(percent_decoded(u))
            ))
        });
        Ok(Self {
            base: format!("{scheme}://{authority}"),
            scheme,
            authority,
            socket,
            basic_auth,
        })
    }
}

//! Running one worker in the foreground from the command line:
//! [`MockWorkerArgs`] (the flags, shared by `balancer mock-worker` and the
//! `balancer-mock-worker` binary) and [`run`], which serves until ctrl-c or
//! SIGTERM.
//!
//! Layering (each module uses only those before it): `config`,
//! `generation`, `body`, `shared`, `control`, `routes`, `server`, `cli`.
//! This module is at the top, and no other module may depend on it. It only
//! translates flags into a [`MockWorkerConfig`] (`config`) and drives a
//! [`MockWorker`]'s lifetime (`server`). It must not install a tracing
//! subscriber or build a runtime (the binary that calls it does), nor reach
//! into the worker's internals beyond its handle.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;

use crate::config::MockWorkerConfig;
use crate::prefix_cache::EngineConfig;
use crate::server::MockWorker;

/// `balancer mock-worker`: run one demo worker in the foreground.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = FAULT_CONTROLS)]
pub struct MockWorkerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Value of the x-mock-worker response header [default: mock-<port>].
    #[arg(long)]
    pub name: Option<String>,
    /// Model id served.
    #[arg(long, default_value = "demo-model")]
    pub model: String,
    /// Delay before each generated token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub token_delay_ms: u64,
    /// Prompt blocks (16 tokens of ~4 bytes each) the simulated prefix cache
    /// holds, least recently used evicted first; 0: no cache. Off by default,
    /// like the prefill time and the slots, so that the proxy benchmarks
    /// measure a worker that answers at once; the demo workers of
    /// `balancer launch --demo-workers` run with 4096, 100 µs and 8.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub prefix_cache_blocks: usize,
    /// Prefill time of each prompt token not found in the cache, in
    /// microseconds: the time to first token a cache hit saves.
    #[arg(long, value_name = "US", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub prefill_us_per_token: u64,
    /// Requests computed at once; the others wait in the queue
    /// (`vllm:num_requests_waiting`). 0: no limit.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub slots: usize,
}

/// The control API, as `--help` shows it (the README's walkthrough uses it).
const FAULT_CONTROLS: &str = "\
Fault controls (HTTP, on the worker's own address; never counted themselves):
  POST   /_mock/fault   set a fault (JSON; answers it back, 400 naming the problem)
  GET    /_mock/fault   the fault in force (null when none)
  DELETE /_mock/fault   clear it
  GET    /_mock/stats   counters: requests, inference_requests, health_checks,
                        faults_applied, open_connections
  POST   /_mock/reset   clear the fault and zero the counters

Fault fields (all optional; they apply to /v1/* requests unless noted):
  status                  answer with this status and an OpenAI error body
  latency_ms              wait this long before the headers
  drop                    close the connection without answering (true)
  stall_after_chunks      stream K chunks, then stall with the connection open
  truncate_after_chunks   stream K chunks, then close mid-body
  token_delay_ms          per-token delay for matching requests
  completion_tokens       answer exactly N completion tokens (0: empty)
  without_usage           leave `usage` out of completions (true)
  retry_after             Retry-After seconds on `status` / `health_status`
  count                   apply to the next N matching requests only
  every                   apply to every Nth request only
  health_status           what GET /health answers (ignores count and every)

Example: make the worker fail until told otherwise, then recover it:
  curl -s localhost:8000/_mock/fault -d '{\"status\":503,\"health_status\":503}'
  curl -s -X DELETE localhost:8000/_mock/fault";

/// Serves until ctrl-c or SIGTERM.
pub async fn run(args: MockWorkerArgs) -> anyhow::Result<()> {
    let cfg = MockWorkerConfig {
        name: args.name.unwrap_or_default(),
        model: args.model,
        token_delay: Duration::from_millis(args.token_delay_ms),
        engine: EngineConfig {
            cache_blocks: args.prefix_cache_blocks,
            prefill_per_token: Duration::from_micros(args.prefill_us_per_token),
            slots: args.slots,
        },
        ..MockWorkerConfig::default()
    };
    let worker = MockWorker::spawn(args.listen, cfg)
        .await
        .with_context(|| format!("mock worker: cannot listen on {}", args.listen))?;
    tracing::info!(
        name = worker.name(),
        addr = %worker.addr(),
        model = %worker.model(),
        "mock worker listening"
    );
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for ctrl-c")?,
        _ = sigterm.recv() => {}
    }
    tracing::info!(name = worker.name(), "mock worker shutting down");
    worker.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Args;

    use super::*;
    use crate::config::Fault;

    #[test]
    fn the_help_documents_every_control_path_and_every_fault_field() {
        let help = MockWorkerArgs::augment_args(clap::Command::new("mock-worker"))
            .render_long_help()
            .to_string();
        for path in ["/_mock/fault", "/_mock/stats", "/_mock/reset"] {
            assert!(help.contains(path), "{path} undocumented");
        }
        // Every field set (no `..Default`): a new field fails to compile
        // here until it is documented too.
        let every = Fault {
            status: Some(503),
            count: Some(1),
            every: Some(1),
            latency_ms: Some(1),
            drop: true,
            stall_after_chunks: Some(1),
            truncate_after_chunks: Some(1),
            retry_after: Some(1),
            health_status: Some(503),
            token_delay_ms: Some(1),
            completion_tokens: Some(1),
            without_usage: true,
        };
        let fields = serde_json::to_value(every).unwrap();
        for field in fields.as_object().unwrap().keys() {
            assert!(
                help.lines()
                    .any(|l| l.trim_start().starts_with(field.as_str())),
                "fault field {field} undocumented"
            );
        }
    }
}

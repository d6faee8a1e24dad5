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

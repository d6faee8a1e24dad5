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
}

/// Serves until ctrl-c or SIGTERM.
pub async fn run(args: MockWorkerArgs) -> anyhow::Result<()> {
    let cfg = MockWorkerConfig {
        name: args.name.unwrap_or_default(),
        model: args.model,
        token_delay: Duration::from_millis(args.token_delay_ms),
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

//! The `balancer-mock-worker` binary: one demo inference worker in the
//! foreground, the same as `balancer mock-worker`.
//!
//! It only parses flags, sets up logging and a runtime, and hands over to
//! [`balancer_mock_worker::run`]; it must not hold any worker logic itself.

use anyhow::Context as _;
use clap::Parser;
use tracing_subscriber::EnvFilter;

use balancer_mock_worker::MockWorkerArgs;

/// Run the demo OpenAI-compatible worker that misbehaves on command.
#[derive(Parser)]
#[command(name = "balancer-mock-worker", version)]
struct Cli {
    #[command(flatten)]
    args: MockWorkerArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new("info"))
        .context("invalid log filter")?;
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(balancer_mock_worker::run(cli.args))
}

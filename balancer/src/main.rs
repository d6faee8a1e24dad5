//! The `balancer` binary: `balancer launch` runs the agent, `balancer
//! mock-worker` runs the demo inference worker.

use std::ffi::OsString;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use balancer::config::LaunchArgs;
use balancer::mock_worker::{self, MockWorkerArgs};

#[derive(Parser)]
#[command(
    name = "balancer",
    version,
    about = "An eBPF/XDP-assisted L4/L7 load balancer for GPU inference workers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (see `balancer launch --help`).
    #[command(disable_help_flag = true)]
    Launch {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Run the demo OpenAI-compatible worker that misbehaves on command.
    MockWorker(MockWorkerArgs),
}

fn init_logging(level: &str, json: bool) -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .with_context(|| format!("invalid value '{level}' for '--log-level'"))?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Launch { args } => {
            let args = LaunchArgs::parse_with_config(args)?;
            init_logging(&args.log_level, args.log_json)?;
            runtime.block_on(async {
                let running = balancer::gateway::start(args).await?;
                eprintln!(
                    "balancer: serving on http://{} (metrics http://{}/metrics, admin http://{}/workers)\n\
                     try: curl -s http://{}/v1/chat/completions -H 'content-type: application/json' \
                     -d '{{\"model\":\"demo-model\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'",
                    running.addr, running.metrics_addr, running.admin_addr, running.addr
                );
                running.run_until_signal().await
            })
        }
        Command::MockWorker(args) => {
            init_logging("info", false)?;
            runtime.block_on(mock_worker::run(args))
        }
    }
}

//! The `balancer` binary: `balancer launch` runs the agent, `balancer l4
//! status|detach` shows or removes the pinned XDP datapath, `balancer
//! mock-worker` runs the demo inference worker. The binary, not the agent
//! library, starts the demo workers of `--demo-workers`.

use std::ffi::OsString;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use balancer::cli::LaunchArgs;
use balancer::gateway::{Gateway, Stopped};

/// mimalloc rather than glibc's malloc: the request path allocates a few
/// dozen small, short-lived blocks per request across two serving threads,
/// which is the pattern its per-thread free lists are built for.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Keep one worker registered in etcd under a lease until SIGTERM (a
    /// sidecar for nodes that cannot write etcd themselves).
    Register(balancer::cli::RegisterArgs),
    /// The XDP datapath an agent left pinned (it keeps running across agent
    /// restarts): `status` shows it, `detach` removes it (for uninstall).
    L4 {
        #[command(subcommand)]
        command: L4Command,
    },
    /// Run the demo OpenAI-compatible worker that misbehaves on command.
    #[cfg(feature = "demo-workers")]
    MockWorker(balancer_mock_worker::MockWorkerArgs),
}

#[derive(Subcommand)]
enum L4Command {
    /// What is attached and where: links and their programs, map layout,
    /// services, backends and their state bits, next-hop generation,
    /// connection count.
    Status {
        #[arg(long, value_name = "DIR", default_value = balancer_dataplane::pin::DEFAULT_BPFFS_DIR)]
        bpffs_dir: std::path::PathBuf,
    },
    /// Detach the programs and remove every pinned map and link (every L4
    /// connection through a service breaks).
    Detach {
        #[arg(long, value_name = "DIR", default_value = balancer_dataplane::pin::DEFAULT_BPFFS_DIR)]
        bpffs_dir: std::path::PathBuf,
    },
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

/// `--demo-workers N`: N demo workers on loopback, added to the config's
/// workers. They stop when the returned handles are shut down.
#[cfg(feature = "demo-workers")]
async fn demo_workers(
    count: u16,
    config: &mut balancer::config::GatewayConfig,
) -> anyhow::Result<Vec<balancer_mock_worker::MockWorker>> {
    use balancer_mock_worker::{EngineConfig, MockWorker, MockWorkerConfig};
    let mut workers = Vec::new();
    for i in 0..count {
        let w = MockWorker::spawn(
            std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            // The demo's engine: prefix cache, prefill time and slots, so
            // routing for cache hits and load shows in `/metrics`.
            MockWorkerConfig {
                engine: EngineConfig::DEMO,
                ..MockWorkerConfig::named(format!("demo-{i}"))
            },
        )
        .await
        .context("cannot start a demo worker")?;
        config
            .workers
            .push(balancer_core::spec::WorkerSpec::from_url(&w.url()));
        workers.push(w);
    }
    Ok(workers)
}

/// `balancer launch`; a drain a second signal cut short exits at once with
/// 128 plus that signal's number (130 after SIGINT, 143 after SIGTERM).
async fn launch(args: LaunchArgs) -> anyhow::Result<()> {
    let ignored = args.compat.ignored();
    if !ignored.is_empty() {
        tracing::warn!(flags = ?ignored, "reference gateway flags accepted but ignored here");
    }
    #[cfg_attr(not(feature = "demo-workers"), allow(unused_mut))]
    let mut config = args.to_config()?;
    #[cfg(feature = "demo-workers")]
    let demo = demo_workers(args.demo_workers, &mut config).await?;
    #[cfg(not(feature = "demo-workers"))]
    if args.demo_workers > 0 {
        anyhow::bail!("--demo-workers needs a binary built with the `demo-workers` feature");
    }
    let gateway = Gateway::start(config).await?;
    eprintln!(
        "balancer: serving on http://{} (metrics http://{}/metrics, admin http://{}/workers)\n\
         try: curl -s http://{}/v1/chat/completions -H 'content-type: application/json' \
         -d '{{\"model\":\"demo-model\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'",
        gateway.addr, gateway.metrics_addr, gateway.admin_addr, gateway.addr
    );
    if let Stopped::Forced(signal) = gateway.run_until_signal().await? {
        // Not a return: dropping the runtime would wait for the serving
        // threads' drain this stop is meant to cut.
        std::process::exit(128 + signal);
    }
    #[cfg(feature = "demo-workers")]
    for w in demo {
        w.shutdown().await;
    }
    Ok(())
}

/// SIGINT or SIGTERM.
async fn signal() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r,
        _ = term.recv() => Ok(()),
    }
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
            runtime.block_on(launch(args))
        }
        Command::Register(args) => {
            init_logging("info", false)?;
            let registration = args.registration()?;
            runtime.block_on(balancer::discovery::etcd::register(registration, async {
                let _ = signal().await;
            }))
        }
        Command::L4 { command } => {
            init_logging("warn", false)?;
            match command {
                L4Command::Status { bpffs_dir } => {
                    print!("{}", balancer_dataplane::status::report(&bpffs_dir));
                    Ok(())
                }
                L4Command::Detach { bpffs_dir } => {
                    let removed = balancer_dataplane::status::detach_all(&bpffs_dir)
                        .with_context(|| format!("removing {}", bpffs_dir.display()))?;
                    if removed.is_empty() {
                        println!("nothing pinned under {}", bpffs_dir.display());
                    }
                    for name in removed {
                        println!("detached and removed {name}");
                    }
                    Ok(())
                }
            }
        }
        #[cfg(feature = "demo-workers")]
        Command::MockWorker(args) => {
            init_logging("info", false)?;
            runtime.block_on(balancer_mock_worker::run(args))
        }
    }
}

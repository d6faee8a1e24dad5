//! The `balancer` binary: `balancer launch` runs the agent, `balancer l4
//! status|detach` shows or removes the pinned XDP datapath, `balancer
//! mock-worker` runs the demo inference worker, `balancer completions` and
//! `balancer man` write what the Debian package installs. The binary, not
//! the agent library, starts the demo workers of `--demo-workers`, and only
//! the binary decides how an error is shown and which exit code it gets.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
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
    /// Print the shell completion script for SHELL (the package installs
    /// bash, zsh and fish ones), e.g.
    /// `balancer completions bash > /etc/bash_completion.d/balancer`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the manual pages (balancer.1 and one per subcommand, e.g.
    /// balancer-launch.1) into DIR.
    #[command(hide = true)]
    Man {
        #[arg(value_name = "DIR")]
        out_dir: PathBuf,
    },
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
    /// Print the path of the XDP program (eBPF object) `launch` would load
    /// ($BALANCER_EBPF_OBJECT, else the one beside an installed binary,
    /// /usr/lib/balancer/balancer-ebpf); fails when there is none.
    Object,
}

/// The whole command line as the manual pages and completions describe
/// it: `launch` takes its arguments raw (to merge them with the
/// configuration file), so its own flags are grafted in here.
fn documented_command() -> clap::Command {
    Cli::command().mut_subcommand("launch", |launch| {
        let about = launch.get_about().cloned();
        let mut full = LaunchArgs::command()
            .name("launch")
            .bin_name("balancer launch");
        if let Some(about) = about {
            full = full.about(about);
        }
        full
    })
}

/// `balancer man DIR`: balancer.1 and balancer-<subcommand>.1.
fn write_man_pages(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // `help` subcommands would get a page each, saying what the others say.
    let mut command = documented_command()
        .disable_help_subcommand(true)
        .mut_subcommand("l4", |l4| l4.disable_help_subcommand(true));
    command.build();
    clap_mangen::generate_to(command, dir)
        .with_context(|| format!("writing manual pages into {}", dir.display()))
}

/// Logging with `--log-level` (`explicit`), else RUST_LOG, else `default`
/// ([`balancer::cli::log_filter`]).
fn init_logging(explicit: Option<&str>, default: &str, json: bool) -> anyhow::Result<()> {
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = balancer::cli::log_filter(explicit, rust_log.as_deref(), default);
    let filter = EnvFilter::try_new(&filter).with_context(|| {
        let source = if explicit.is_some() {
            "'--log-level'"
        } else {
            "RUST_LOG"
        };
        format!("invalid value '{filter}' for {source}")
    })?;
    // Colour only for a person at a terminal: journald and log files get
    // plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
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

/// A configuration `launch` refused: a flag, a key of the config file, or
/// how they combine. It exits 2, as a flag clap refuses does.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct Refused(anyhow::Error);

/// `launch --check-config`: what `launch` would refuse before serving,
/// without serving. The flags and the file were checked on parsing.
fn check_config(args: &LaunchArgs) -> anyhow::Result<()> {
    let config = args.to_config().map_err(Refused)?;
    Gateway::check(&config).map_err(Refused)?;
    let workers = config.workers.len() + usize::from(args.demo_workers);
    let plural = if workers == 1 { "" } else { "s" };
    let discovery = if config.etcd.is_some() {
        " and etcd discovery"
    } else {
        ""
    };
    println!(
        "balancer: configuration OK ({workers} worker{plural}{discovery}, policy {})",
        config.policy.as_str()
    );
    Ok(())
}

/// Errors an operator caused (a flag, a file, a port) are shown as one
/// line with their causes, without a backtrace even under RUST_BACKTRACE
/// (that is for bugs, which panic and keep theirs). A configuration
/// refused exits 2 (a flag the parser refused is shown by clap itself, as
/// for every subcommand); a start that fails (a port in use) exits 1.
fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let (error, code) = match error.downcast::<Refused>() {
                Ok(Refused(error)) => (error, 2),
                Err(error) => (error, 1),
            };
            if let Some(usage) = error.downcast_ref::<clap::Error>() {
                usage.exit();
            }
            eprintln!("balancer: error: {error:#}");
            ExitCode::from(code)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Launch { args } => {
            let args = LaunchArgs::parse_with_config(args).map_err(Refused)?;
            if args.check_config {
                return check_config(&args);
            }
            init_logging(args.log_level.as_deref(), "info", args.log_json)?;
            runtime.block_on(launch(args))
        }
        Command::Register(args) => {
            init_logging(None, "info", false)?;
            let registration = args.registration()?;
            runtime.block_on(balancer::discovery::etcd::register(registration, async {
                let _ = signal().await;
            }))
        }
        Command::L4 { command } => {
            init_logging(None, "warn", false)?;
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
                L4Command::Object => {
                    println!("{}", balancer_dataplane::locate_object(None)?.display());
                    Ok(())
                }
            }
        }
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut documented_command(),
                "balancer",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Man { out_dir } => write_man_pages(&out_dir),
        #[cfg(feature = "demo-workers")]
        Command::MockWorker(args) => {
            init_logging(None, "info", false)?;
            runtime.block_on(balancer_mock_worker::run(args))
        }
    }
}

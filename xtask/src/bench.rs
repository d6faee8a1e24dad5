//! `cargo xtask bench ...`: load measured on loopback (`l7`, below) and
//! across network namespaces (`l4`, in [`l4`]), instructions per
//! request counted by callgrind (`instructions`, in [`instructions`]), and
//! prefix-cache hits and time to first token of a chat trace (`cache`, in
//! [`cache`]).
//!
//! `bench l7` drives wrk at four targets in front of the same two demo
//! workers: one worker directly (the ceiling), this gateway, nginx as a plain
//! reverse proxy (what any L7 proxy is compared with) and the reference
//! gateway `smg` from PyPI. nginx and smg are optional: when one cannot be
//! installed or started, a loud line says so and its row is left out.
//!
//! Fairness: the machine has 2 cores and nothing is pinned, so wrk (one
//! thread), the target and the two workers share both cores, for every
//! target alike. Each proxy may use both cores (tokio's one thread per core,
//! nginx `worker_processes 2`, smg's defaults). Every target gets the same
//! wrk settings and a warm-up, and rounds alternate the targets (each round
//! starting one further) so that noise from other work on the machine is
//! spread over all of them; the table shows medians over the rounds.
//!
//! The HTTPS row runs a second balancer and a TLS server of the same nginx
//! on one self-signed certificate (made here with rcgen), both proxying to
//! the workers in plain HTTP; wrk keeps its connections, so the row is the
//! cost of TLS records rather than handshakes.
//!
//! Every child is stopped by its PID when the bench ends, however it ends
//! (see [`Lab`]); Ctrl-C reaches them directly, as they share the terminal's
//! process group.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, Subcommand};

mod cache;
mod instructions;
mod l4;

use crate::shell::{cargo, display, run};
use crate::{target_dir, workspace_root};

#[derive(Subcommand)]
pub enum Which {
    /// HTTP requests per second and latency of a demo worker alone and
    /// behind this gateway, nginx and the reference gateway (smg).
    L7(L7),
    /// The XDP L4 path (root): per-packet cost through BPF_PROG_TEST_RUN,
    /// and new connections per second through XDP, nftables DNAT and
    /// straight to a worker, across network namespaces.
    L4(l4::L4),
    /// The breaker's hot path (admit + record, one and two threads) and
    /// worker selection at 8, 512 and 4096 workers (criterion).
    Breaker,
    /// User-space instructions per proxied request of this gateway and of
    /// nginx, counted by callgrind: steady where CPU time is noisy.
    Instructions(instructions::Instructions),
    /// Prefix-cache hit ratio and time to first token of a multi-turn chat
    /// trace over four demo workers, through round_robin, power_of_two,
    /// cache_aware and the reference gateway's cache_aware; steady, then
    /// with one worker slowed and another failing.
    Cache(cache::Cache),
    /// Fleet verdicts through a real etcd: failed requests served before
    /// every replica stopped sending to a failing worker, without and with
    /// `--fleet-verdicts` (debug profile, in-process replicas).
    Fleet,
}

#[derive(Args)]
pub struct L7 {
    /// Measured rounds; each runs every target once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=20))]
    rounds: u64,
    /// Seconds of load per target and round.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=60))]
    duration_secs: u64,
    /// Connections wrk keeps busy.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1000))]
    connections: u64,
}

pub fn bench(which: Which) -> Result<()> {
    match which {
        Which::L7(args) => l7(&args),
        Which::L4(args) => l4::l4(&args),
        Which::Instructions(args) => instructions::instructions(&args),
        Which::Cache(args) => cache::cache(&args),
        Which::Fleet => run(cargo()
            .args(["run", "--package", "balancer-tests", "--example", "fleet"])
            .current_dir(workspace_root())),
        Which::Breaker => run(cargo()
            .args([
                "bench",
                "--package",
                "balancer-core",
                "--bench",
                "breaker",
                "--bench",
                "selection",
                "--bench",
                "exposition",
            ])
            .current_dir(workspace_root())),
    }
}

const PATH: &str = "/v1/chat/completions";
const BODY: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#;
/// The streaming row's request: an SSE response of [`STREAM_CHUNKS`]
/// chunks (one per token; the demo worker sends them without delay).
const STREAM_BODY: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":50}"#;
const STREAM_CHUNKS: f64 = 50.0;
/// One of the two cores' worth of load generator; the servers get the rest.
const WRK_THREADS: u64 = 1;
/// Fills connection pools and caches before anything is counted.
const WARMUP_SECS: u64 = 1;
const READY_WITHIN: Duration = Duration::from_secs(30);
const INSTALL_WITHIN: Duration = Duration::from_secs(240);
/// How long a child gets to exit on SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// The row the ratios are relative to.
const GATEWAY: &str = "balancer";
/// The gateway under `--policy cache_aware` (the others run round robin).
const GATEWAY_CACHE_AWARE: &str = "cache_aware";
/// The gateway serving HTTPS, in the HTTPS row.
const GATEWAY_TLS: &str = "balancer https";
const NGINX_TLS: &str = "nginx https";

fn l7(args: &L7) -> Result<()> {
    let started = Instant::now();
    // Every process started here inherits this: the idle-connection
    // measurement holds 10,000 sockets at each end.
    raise_open_files_limit();
    let mut left_out = Vec::new();
    let wrk_binary = ensure_tool("wrk", "wrk")?;
    let nginx = ensure_tool("nginx", "nginx-light")
        .map_err(|error| unavailable(&mut left_out, "nginx", &error))
        .ok();
    let balancer = release_balancer()?;
    let smg = smg_launcher()
        .map_err(|error| unavailable(&mut left_out, "smg", &error))
        .ok();

    let mut lab = Lab::new()?;
    let wrk = Wrk::new(wrk_binary.clone(), &lab.dir, args.connections, "chat", BODY)?;
    let stream_wrk = Wrk::new(
        wrk_binary,
        &lab.dir,
        args.connections,
        "stream",
        STREAM_BODY,
    )?;

    let workers = lab.start_workers(&balancer)?;
    let urls = workers.map(|addr| format!("http://{addr}"));
    let mut targets = vec![Target::new(
        "worker (direct)",
        workers[0],
        lab.pid("worker1")?,
    )];

    let gateway = free_addr()?;
    lab.start(
        GATEWAY,
        &mut launch(&balancer, gateway, &urls, "round_robin")?,
    )?;
    lab.await_ready(GATEWAY, gateway)?;
    targets.push(Target::new(GATEWAY, gateway, lab.pid(GATEWAY)?));

    // The same gateway routing by prompt: the cost of the prefix trees.
    let cache_aware = free_addr()?;
    lab.start(
        GATEWAY_CACHE_AWARE,
        &mut launch(&balancer, cache_aware, &urls, "cache_aware")?,
    )?;
    lab.await_ready(GATEWAY_CACHE_AWARE, cache_aware)?;
    targets.push(Target::new(
        GATEWAY_CACHE_AWARE,
        cache_aware,
        lab.pid(GATEWAY_CACHE_AWARE)?,
    ));

    let certificate = Certificate::new(&lab.dir)?;
    let gateway_tls = free_addr()?;
    lab.start(
        GATEWAY_TLS,
        launch(&balancer, gateway_tls, &urls, "round_robin")?
            .arg("--tls-cert-path")
            .arg(&certificate.cert)
            .arg("--tls-key-path")
            .arg(&certificate.key),
    )?;
    lab.await_answer(GATEWAY_TLS, gateway_tls, post_status_tls)?;
    let mut https = vec![Target::tls(GATEWAY_TLS, gateway_tls, lab.pid(GATEWAY_TLS)?)];

    let mut nginx_stream = None;
    if let Some(nginx) = nginx {
        let addr = free_addr()?;
        // SSE through nginx as LLM gateways run it: unbuffered, each chunk
        // relayed as it comes (a server of its own, so the other row keeps
        // nginx's defaults).
        let stream_addr = free_addr()?;
        nginx_stream = Some(stream_addr);
        let tls_addr = free_addr()?;
        let conf = lab.dir.join("nginx.conf");
        let listen = NginxListen {
            plain: addr,
            stream: stream_addr,
            tls: tls_addr,
            certificate: &certificate,
        };
        fs::write(&conf, nginx_conf(&lab.dir, &listen, &workers))?;
        lab.start(
            "nginx",
            Command::new(nginx)
                .arg("-p")
                .arg(&lab.dir)
                .arg("-e")
                .arg(lab.dir.join("nginx-error.log"))
                .arg("-c")
                .arg(&conf)
                .args(["-g", "daemon off;"]),
        )?;
        optional(&mut lab, &mut targets, &mut left_out, "nginx", addr);
        if let Some(nginx) = targets.iter().find(|t| t.name == "nginx") {
            https.push(Target::tls(NGINX_TLS, tls_addr, nginx.pid));
        }
    }

    if let Some(smg) = smg {
        let addr = free_addr()?;
        lab.start("smg", &mut smg_command(&smg, addr, &urls, "round_robin")?)?;
        optional(&mut lab, &mut targets, &mut left_out, "smg", addr);
    }

    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let busy_before = other_cpu_use();
    eprintln!(
        "\nbench l7: POST {PATH} ({} byte JSON body); per target and round: \
         wrk -t{WRK_THREADS} -c{} -d{}s --latency; {} rounds after a {WARMUP_SECS}s warm-up",
        BODY.len(),
        args.connections,
        args.duration_secs,
        args.rounds,
    );
    eprintln!(
        "CPU: {cores} cores shared, unpinned, by wrk, the target and both demo workers; \
         busy with other work before the first round: {busy_before}\n"
    );

    for target in &targets {
        wrk.run(target, WARMUP_SECS)
            .with_context(|| format!("warming up {}", target.name))?;
    }
    let count = targets.len();
    for round in 0..args.rounds {
        for offset in 0..count {
            let target = &mut targets[(round as usize + offset) % count];
            let sample = measure(&wrk, target, args.duration_secs)?;
            eprintln!(
                "round {}/{}: {:<16} {:>9.0} req/s  p50 {:>8}  p99 {:>8}  CPU {:>6.1} us/req  errors {}",
                round + 1,
                args.rounds,
                target.name,
                sample.rps,
                show(sample.p50),
                show(sample.p99),
                sample.cpu_us,
                sample.errors,
            );
            target.samples.push(sample);
        }
    }

    // The streaming row: the gateway and nginx (unbuffered), alternating.
    let mut streams: Vec<Target> = targets
        .iter()
        .filter(|t| t.name == GATEWAY || t.name == "nginx")
        .map(|t| {
            let addr = if t.name == "nginx" {
                nginx_stream.unwrap_or(t.addr)
            } else {
                t.addr
            };
            Target::new(t.name, addr, t.pid)
        })
        .collect();
    let stream = Pass {
        label: "stream",
        unit: "chunk",
        rate: "chunks/s",
        per_request: STREAM_CHUNKS,
    };
    stream.alternate(&stream_wrk, &mut streams, args)?;
    // The HTTPS row: the gateway and nginx serving TLS, alternating.
    for target in &https {
        wrk.run(target, WARMUP_SECS)
            .with_context(|| format!("warming up {}", target.name))?;
    }
    let tls = Pass {
        label: "https",
        unit: "req",
        rate: "req/s",
        per_request: 1.0,
    };
    tls.alternate(&wrk, &mut https, args)?;

    let busy_after = other_cpu_use();
    let mut idle = Vec::new();
    for target in targets.iter().filter(|t| t.name != "worker (direct)") {
        match idle_rss(target) {
            Ok(line) => idle.push(line),
            Err(error) => idle.push(format!("{:<16} idle connections: {error:#}", target.name)),
        }
    }
    println!("\n{}", table(&targets));
    println!(
        "\n{}",
        stream.table(
            "streaming (SSE chunks per response, nginx with proxy_buffering off)",
            &streams
        )
    );
    println!(
        "\n{}",
        tls.table(
            "HTTPS (TLS 1.3, one ECDSA P-256 certificate; workers in plain HTTP)",
            &https
        )
    );
    println!(
        "\nmemory (resident set of the process tree) with {IDLE_CONNECTIONS} idle client \
         connections open:"
    );
    for line in &idle {
        println!("  {line}");
    }
    println!(
        "CPU busy with other work (which skews results): {busy_before} before the rounds, \
         {busy_after} after"
    );
    if !left_out.is_empty() {
        println!(
            "LEFT OUT (see the UNAVAILABLE lines above): {}",
            left_out.join(", ")
        );
    }
    eprintln!("bench l7 took {:.0}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// `balancer launch` on `addr` before `urls` with `policy`, its operator
/// listeners on free ports.
fn launch(balancer: &Path, addr: SocketAddr, urls: &[String], policy: &str) -> Result<Command> {
    let mut command = Command::new(balancer);
    command
        .arg("launch")
        .args(["--host", "127.0.0.1", "--port"])
        .arg(addr.port().to_string())
        .arg("--prometheus-port")
        .arg(free_addr()?.port().to_string())
        .arg("--admin-port")
        .arg(free_addr()?.port().to_string())
        .args(["--policy", policy, "--log-level", "warn", "--worker-urls"])
        .args(urls);
    Ok(command)
}

/// `smg launch` on `addr` before `urls` with `policy`, its metrics
/// listener on a free port.
fn smg_command(smg: &Path, addr: SocketAddr, urls: &[String], policy: &str) -> Result<Command> {
    let mut command = Command::new(smg);
    command
        .args(["launch", "--host", "127.0.0.1", "--port"])
        .arg(addr.port().to_string())
        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port"])
        .arg(free_addr()?.port().to_string())
        // Its default 180 s drain would outlast the stop's grace.
        .args(["--shutdown-grace-period-secs", "1"])
        .args(["--policy", policy, "--log-level", "warn", "--worker-urls"])
        .args(urls);
    Ok(command)
}

/// Builds the agent in release mode; returns the binary.
pub(crate) fn release_balancer() -> Result<PathBuf> {
    crate::setup::build_packages()?;
    run(cargo()
        .args([
            "build",
            "--release",
            "--package",
            "balancer",
            "--bin",
            "balancer",
        ])
        .current_dir(workspace_root()))?;
    Ok(target_dir().join("release/balancer"))
}

/// Adds a target that may fail to start, saying loudly when it does.
fn optional(
    lab: &mut Lab,
    targets: &mut Vec<Target>,
    left_out: &mut Vec<&'static str>,
    name: &'static str,
    addr: SocketAddr,
) {
    match lab.await_ready(name, addr).and_then(|()| lab.pid(name)) {
        Ok(pid) => targets.push(Target::new(name, addr, pid)),
        Err(error) => {
            unavailable(left_out, name, &error);
            // A half-started server would take CPU from the others.
            lab.stop(name);
        }
    }
}

fn unavailable(left_out: &mut Vec<&'static str>, name: &'static str, error: &anyhow::Error) {
    eprintln!("\n*** bench: {name} UNAVAILABLE, its row is left out: {error:#} ***\n");
    left_out.push(name);
}

struct Target {
    name: &'static str,
    addr: SocketAddr,
    /// The server's process, whose tree's CPU time each round charges to
    /// the requests it served.
    pid: u32,
    /// Served over HTTPS.
    tls: bool,
    samples: Vec<Sample>,
}

impl Target {
    fn new(name: &'static str, addr: SocketAddr, pid: u32) -> Self {
        Self {
            name,
            addr,
            pid,
            tls: false,
            samples: Vec::new(),
        }
    }

    fn tls(name: &'static str, addr: SocketAddr, pid: u32) -> Self {
        Self {
            tls: true,
            ..Self::new(name, addr, pid)
        }
    }

    fn median(&self, field: impl Fn(&Sample) -> f64) -> f64 {
        median(self.samples.iter().map(field).collect())
    }
}

/// What one wrk run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    rps: f64,
    p50: Duration,
    p99: Duration,
    /// Non-2xx answers and socket errors: a fast wrong answer is no result.
    errors: u64,
    /// User + system CPU of the target's process tree over the run, per
    /// request served, in microseconds (NaN until measured).
    cpu_us: f64,
}

fn table(targets: &[Target]) -> String {
    let gateway = targets.iter().find(|t| t.name == GATEWAY);
    let reference = gateway.map(|g| (g.median(|s| s.rps), g.median(|s| s.p99.as_secs_f64())));
    let mut out = format!(
        "{:<16} {:>10} {:>9} {:>9} {:>11} {:>12} {:>12} {:>7}  {}\n",
        "target",
        "req/s",
        "p50",
        "p99",
        "CPU us/req",
        "req/s ratio",
        "p99 ratio",
        "errors",
        "req/s per round"
    );
    for target in targets {
        let rps = target.median(|s| s.rps);
        let p50 = target.median(|s| s.p50.as_secs_f64());
        let p99 = target.median(|s| s.p99.as_secs_f64());
        let (rps_ratio, p99_ratio) =
            reference.map_or((f64::NAN, f64::NAN), |(r, l)| (rps / r, p99 / l));
        let rounds: Vec<String> = target
            .samples
            .iter()
            .map(|s| format!("{:.0}", s.rps))
            .collect();
        out.push_str(&format!(
            "{:<16} {:>10.0} {:>9} {:>9} {:>11.1} {:>11.2}x {:>11.2}x {:>7}  {}\n",
            target.name,
            rps,
            show(Duration::from_secs_f64(p50)),
            show(Duration::from_secs_f64(p99)),
            target.median(|s| s.cpu_us),
            rps_ratio,
            p99_ratio,
            target.samples.iter().map(|s| s.errors).sum::<u64>(),
            rounds.join(" "),
        ));
    }
    out.push_str(&format!(
        "(medians over the rounds; ratios are relative to {GATEWAY}: req/s above 1 is faster, \
         p99 above 1 is slower; CPU is user + system time of the target's process tree over \
         the run divided by the requests it served)"
    ));
    if let (Some(gateway), Some(cache)) = (
        gateway,
        targets.iter().find(|t| t.name == GATEWAY_CACHE_AWARE),
    ) {
        out.push_str(&format!(
            "\n{GATEWAY_CACHE_AWARE} / {GATEWAY} (round_robin): CPU per request {:.2}x (goal <= 1.15)",
            cache.median(|s| s.cpu_us) / gateway.median(|s| s.cpu_us),
        ));
    }
    if let (Some(gateway), Some(nginx)) = (gateway, targets.iter().find(|t| t.name == "nginx")) {
        let ratio = |f: &dyn Fn(&Sample) -> f64| gateway.median(f) / nginx.median(f);
        out.push_str(&format!(
            "\n{GATEWAY} / nginx: CPU per request {:.2}x (goal <= 1), req/s {:.2}x (goal >= 1), \
             p99 {:.2}x (goal <= 1)",
            ratio(&|s| s.cpu_us),
            ratio(&|s| s.rps),
            ratio(&|s| s.p99.as_secs_f64()),
        ));
    }
    out
}

/// One wrk run against `target`, with the CPU its process tree spent per
/// request served.
fn measure(wrk: &Wrk, target: &Target, secs: u64) -> Result<Sample> {
    let cpu_before = tree_cpu(target.pid);
    let mut sample = wrk
        .run(target, secs)
        .with_context(|| format!("measuring {}", target.name))?;
    let cpu = tree_cpu(target.pid).saturating_sub(cpu_before);
    let served = sample.rps * secs as f64;
    sample.cpu_us = cpu.as_secs_f64() * 1e6 / served.max(1.0);
    Ok(sample)
}

/// A pass of its own over a few targets (the streaming row, the HTTPS
/// row): rounds alternating the targets, and a table with the ratio of the
/// gateway to nginx.
struct Pass {
    label: &'static str,
    /// What is counted: `chunk`, `req`.
    unit: &'static str,
    /// Its rate: `chunks/s`, `req/s`.
    rate: &'static str,
    /// Units per request.
    per_request: f64,
}

impl Pass {
    fn alternate(&self, wrk: &Wrk, targets: &mut [Target], args: &L7) -> Result<()> {
        let count = targets.len();
        for round in 0..args.rounds {
            for offset in 0..count {
                let target = &mut targets[(round as usize + offset) % count];
                let sample = measure(wrk, target, args.duration_secs)?;
                eprintln!(
                    "{} round {}/{}: {:<16} {:>9.0} {}  CPU {:>6.2} us/{}  errors {}",
                    self.label,
                    round + 1,
                    args.rounds,
                    target.name,
                    sample.rps * self.per_request,
                    self.rate,
                    sample.cpu_us / self.per_request,
                    self.unit,
                    sample.errors,
                );
                target.samples.push(sample);
            }
        }
        Ok(())
    }

    /// The pass's table under `title`; the first target over the second.
    fn table(&self, title: &str, targets: &[Target]) -> String {
        let (unit, rate) = (self.unit, self.rate);
        let mut out = format!(
            "{title}:\n{:<16} {:>12} {:>13} {:>9} {:>7}\n",
            "target",
            rate,
            format!("CPU us/{unit}"),
            "p99",
            "errors"
        );
        for target in targets {
            out.push_str(&format!(
                "{:<16} {:>12.0} {:>13.2} {:>9} {:>7}\n",
                target.name,
                target.median(|s| s.rps) * self.per_request,
                target.median(|s| s.cpu_us) / self.per_request,
                show(Duration::from_secs_f64(
                    target.median(|s| s.p99.as_secs_f64())
                )),
                target.samples.iter().map(|s| s.errors).sum::<u64>(),
            ));
        }
        if let [gateway, nginx] = targets {
            let ratio = |f: &dyn Fn(&Sample) -> f64| gateway.median(f) / nginx.median(f);
            out.push_str(&format!(
                "{} / {}: {rate} {:.2}x, CPU per {unit} {:.2}x, p99 {:.2}x",
                gateway.name,
                nginx.name,
                ratio(&|s| s.rps),
                ratio(&|s| s.cpu_us),
                ratio(&|s| s.p99.as_secs_f64()),
            ));
        }
        out
    }
}

/// `root` and every process below it, from /proc.
fn process_tree(root: u32) -> Vec<u32> {
    // (pid, ppid) of every process.
    let processes: Vec<(u32, u32)> = fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|pid| Some((pid, proc_stat(pid)?.0)))
                .collect()
        })
        .unwrap_or_default();
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(processes.iter().filter(|p| p.1 == parent).map(|p| p.0));
        i += 1;
    }
    tree
}

/// The parent and user + system clock ticks of `pid` (threads included).
fn proc_stat(pid: u32) -> Option<(u32, u64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields count from after its
    // closing parenthesis.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

/// User + system CPU time of `root` and every process below it.
fn tree_cpu(root: u32) -> Duration {
    let ticks: u64 = process_tree(root)
        .into_iter()
        .filter_map(|pid| Some(proc_stat(pid)?.1))
        .sum();
    // SAFETY: sysconf reads a constant and touches no memory.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_secs_f64(ticks as f64 / per_second as f64)
}

/// Resident memory of `root` and every process below it, in bytes.
fn tree_rss(root: u32) -> u64 {
    process_tree(root)
        .into_iter()
        .filter_map(|pid| {
            let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .sum()
}

/// Idle client connections the memory measurement opens to each target.
const IDLE_CONNECTIONS: usize = 10_000;

/// Opens [`IDLE_CONNECTIONS`] connections to `target` that send nothing,
/// and says how the resident memory of its process tree grew.
fn idle_rss(target: &Target) -> Result<String> {
    let before = tree_rss(target.pid);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut open = Vec::with_capacity(IDLE_CONNECTIONS);
    while open.len() < IDLE_CONNECTIONS {
        ensure!(
            Instant::now() < deadline,
            "only {} connections opened within 60 s",
            open.len()
        );
        open.push(
            std::net::TcpStream::connect_timeout(&target.addr, Duration::from_secs(2))
                .with_context(|| format!("idle connection {}", open.len() + 1))?,
        );
    }
    // Accepted connections are set up by the server's own threads.
    std::thread::sleep(Duration::from_secs(1));
    let with = tree_rss(target.pid);
    drop(open);
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    Ok(format!(
        "{:<16} {:>8.1} MiB (idle: {:.1} MiB; {:.1} KiB per connection)",
        target.name,
        mib(with),
        mib(before),
        with.saturating_sub(before) as f64 / 1024.0 / IDLE_CONNECTIONS as f64,
    ))
}

/// Raises this process's open-files limit to its hard limit.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: both calls read or write only the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// How busy the CPUs are over one second while the bench itself is idle,
/// from /proc/stat: others' builds and tests share this machine.
fn other_cpu_use() -> String {
    // user nice system idle iowait irq softirq steal, in ticks since boot.
    let sample = || -> Option<(u64, u64)> {
        let stat = fs::read_to_string("/proc/stat").ok()?;
        let ticks: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        Some((ticks.iter().sum(), ticks.get(3)? + ticks.get(4)?))
    };
    let Some((total_before, idle_before)) = sample() else {
        return "unknown".into();
    };
    sleep(Duration::from_secs(1));
    match sample() {
        Some((total, idle)) if total > total_before => {
            let busy = 1.0 - (idle - idle_before) as f64 / (total - total_before) as f64;
            format!("{:.0}%", busy * 100.0)
        }
        _ => "unknown".into(),
    }
}

/// The middle value; the mean of the two middle ones for an even count.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[middle],
        _ => (values[middle - 1] + values[middle]) / 2.0,
    }
}

fn show(latency: Duration) -> String {
    let micros = latency.as_secs_f64() * 1e6;
    if micros < 1000.0 {
        format!("{micros:.0}us")
    } else {
        format!("{:.2}ms", micros / 1000.0)
    }
}

/// The load generator, set up the same for every target.
struct Wrk {
    binary: PathBuf,
    script: PathBuf,
    report: PathBuf,
    connections: u64,
}

impl Wrk {
    /// wrk posting `body` (its script named `name`).
    fn new(binary: PathBuf, dir: &Path, connections: u64, name: &str, body: &str) -> Result<Self> {
        let script = dir.join(format!("{name}.lua"));
        fs::write(
            &script,
            format!(
                "wrk.method = \"POST\"\n\
                 wrk.headers[\"Content-Type\"] = \"application/json\"\n\
                 wrk.body = '{body}'\n"
            ),
        )?;
        Ok(Self {
            binary,
            script,
            report: dir.join(format!("{name}.out")),
            connections,
        })
    }

    fn run(&self, target: &Target, secs: u64) -> Result<Sample> {
        let scheme = if target.tls { "https" } else { "http" };
        let mut command = Command::new(&self.binary);
        command
            .arg(format!("-t{WRK_THREADS}"))
            .arg(format!("-c{}", self.connections))
            .arg(format!("-d{secs}s"))
            .args(["--latency", "--timeout", "5s", "-s"])
            .arg(&self.script)
            .arg(format!("{scheme}://{}{PATH}", target.addr))
            .stdout(File::create(&self.report)?);
        bounded(&mut command, Duration::from_secs(secs + 15))?;
        let text = fs::read_to_string(&self.report)?;
        parse_wrk(&text).with_context(|| format!("reading wrk's report:\n{text}"))
    }
}

fn parse_wrk(report: &str) -> Result<Sample> {
    let (mut rps, mut p50, mut p99, mut errors) = (None, None, None, 0);
    for line in report.lines() {
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["Requests/sec:", value] => rps = Some(value.parse::<f64>()?),
            ["50%", value] => p50 = Some(parse_latency(value)?),
            ["99%", value] => p99 = Some(parse_latency(value)?),
            ["Non-2xx", "or", "3xx", "responses:", count] => errors += count.parse::<u64>()?,
            // "Socket errors: connect 0, read 0, write 0, timeout 0"
            ["Socket", "errors:", counts @ ..] => {
                for count in counts.iter().skip(1).step_by(2) {
                    errors += count.trim_end_matches(',').parse::<u64>()?;
                }
            }
            _ => {}
        }
    }
    Ok(Sample {
        cpu_us: f64::NAN,
        rps: rps.context("no Requests/sec line")?,
        p50: p50.context("no 50% line (was --latency given?)")?,
        p99: p99.context("no 99% line (was --latency given?)")?,
        errors,
    })
}

/// wrk's `310.47us`, `1.23ms`, `2.00s`, `1.50m`.
fn parse_latency(text: &str) -> Result<Duration> {
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .with_context(|| format!("no unit in {text:?}"))?;
    let (number, unit) = text.split_at(split);
    let nanos_per_unit = match unit {
        "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "m" => 60e9,
        "h" => 3600e9,
        _ => bail!("unknown unit in {text:?}"),
    };
    let number: f64 = number
        .parse()
        .with_context(|| format!("bad number in {text:?}"))?;
    // Rounded, as wrk's two decimals are often not exact in binary.
    Ok(Duration::from_nanos(
        (number * nanos_per_unit).round() as u64
    ))
}

/// The addresses nginx serves the rows on.
struct NginxListen<'a> {
    plain: SocketAddr,
    /// The streaming row's: unbuffered.
    stream: SocketAddr,
    /// The HTTPS row's.
    tls: SocketAddr,
    certificate: &'a Certificate,
}

fn nginx_conf(dir: &Path, listen: &NginxListen<'_>, workers: &[SocketAddr]) -> String {
    let (plain, stream_listen, tls) = (listen.plain, listen.stream, listen.tls);
    let (cert, key) = (
        listen.certificate.cert.display(),
        listen.certificate.key.display(),
    );
    let upstream = nginx_upstream(dir, workers);
    let dir = dir.display();
    format!(
        "worker_processes 2;
worker_rlimit_nofile 32768;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{
    worker_connections 16384;
}}
http {{
{upstream}
    server {{
        listen {plain};
        location / {{
{PROXY_TO_WORKERS}
        }}
    }}
    server {{
        listen {stream_listen};
        location / {{
{PROXY_TO_WORKERS}
            proxy_buffering off;
        }}
    }}
    server {{
        listen {tls} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{
{PROXY_TO_WORKERS}
        }}
    }}
}}
"
    )
}

/// What every nginx of the benches has in its `http` block: no access log,
/// temp paths in the scratch folder (so that nothing outside it is
/// written), and the demo workers as an upstream with idle connections kept.
fn nginx_upstream(dir: &Path, workers: &[SocketAddr]) -> String {
    let servers: String = workers
        .iter()
        .map(|addr| format!("        server {addr};\n"))
        .collect();
    let dir = dir.display();
    format!(
        "    access_log off;
    client_body_temp_path {dir}/nginx-body;
    proxy_temp_path {dir}/nginx-proxy;
    upstream workers {{
{servers}        keepalive 64;
    }}"
    )
}

/// A location's proxying to [`nginx_upstream`]: `Connection ""` with
/// HTTP/1.1 is what makes upstream keepalive work.
const PROXY_TO_WORKERS: &str = "            proxy_pass http://workers;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";";

/// The HTTPS row's self-signed certificate for 127.0.0.1, as PEM files in
/// the scratch folder.
struct Certificate {
    cert: PathBuf,
    key: PathBuf,
}

impl Certificate {
    fn new(dir: &Path) -> Result<Self> {
        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()])
            .context("making the HTTPS row's certificate")?;
        let (cert, key) = (dir.join("tls-cert.pem"), dir.join("tls-key.pem"));
        fs::write(&cert, made.cert.pem())?;
        fs::write(&key, made.signing_key.serialize_pem())?;
        Ok(Self { cert, key })
    }
}

/// The reference gateway's release the benches compare with.
const SMG_PACKAGE: &str = "smg==1.13.0";

/// The `smg` launcher from a venv under target/, installed on first use.
fn smg_launcher() -> Result<PathBuf> {
    let venv = target_dir().join("bench-venv");
    let smg = venv.join("bin/smg");
    if smg.is_file() && installed(&venv, SMG_PACKAGE) {
        return Ok(smg);
    }
    let python = venv.join("bin/python");
    if !python.is_file() {
        let mut command = Command::new("python3");
        command.args(["-m", "venv"]).arg(&venv);
        eprintln!("$ {}", display(&command));
        bounded(&mut command, Duration::from_secs(60))?;
    }
    let mut command = Command::new(python);
    command.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        SMG_PACKAGE,
    ]);
    eprintln!("$ {}", display(&command));
    bounded(&mut command, INSTALL_WITHIN)?;
    ensure!(
        smg.is_file(),
        "pip installed smg but {} is missing",
        smg.display()
    );
    Ok(smg)
}

/// Whether `venv` holds `package` (`name==version`) itself: an earlier
/// install of another version is replaced.
fn installed(venv: &Path, package: &str) -> bool {
    let dist_info = format!("{}.dist-info", package.replace("==", "-"));
    fs::read_dir(venv.join("lib")).is_ok_and(|pythons| {
        pythons.flatten().any(|python| {
            python
                .path()
                .join("site-packages")
                .join(&dist_info)
                .is_dir()
        })
    })
}

/// `binary` from PATH (or sbin, where nginx lives), installing the Debian
/// `package` when it is missing.
fn ensure_tool(binary: &str, package: &str) -> Result<PathBuf> {
    if let Some(path) = find_binary(binary) {
        return Ok(path);
    }
    eprintln!("bench: {binary} is missing; installing the Debian package {package}");
    let install = || {
        let mut command = Command::new("apt-get");
        command
            .args(["install", "--yes", "--quiet", package])
            .env("DEBIAN_FRONTEND", "noninteractive");
        eprintln!("$ {}", display(&command));
        bounded(&mut command, INSTALL_WITHIN)
    };
    if install().is_err() {
        // A stale or empty package index is the usual reason.
        let mut update = Command::new("apt-get");
        update.args(["update", "--quiet"]);
        eprintln!("$ {}", display(&update));
        bounded(&mut update, INSTALL_WITHIN)?;
        install()?;
    }
    find_binary(binary).with_context(|| format!("{package} is installed but {binary} is missing"))
}

fn find_binary(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

/// Runs `command` to completion within `limit`, killing it past that.
fn bounded(command: &mut Command, limit: Duration) -> Result<()> {
    let shown = display(command);
    let mut child = command
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting `{shown}`"))?;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            ensure!(status.success(), "`{shown}` failed ({status})");
            return Ok(());
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{shown}` took longer than {}s; killed", limit.as_secs());
        }
        sleep(Duration::from_millis(50));
    }
}

/// A loopback address nobody listens on right now. Another process may take
/// it before the server binds it; the server then fails to start, loudly.
fn free_addr() -> Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The status code of one chat completion request.
fn post_status(addr: SocketAddr) -> Result<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "POST {PATH} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
        BODY.len()
    )?;
    let mut head = [0; 12];
    stream.read_exact(&mut head)?;
    let head = String::from_utf8_lossy(&head);
    head.strip_prefix("HTTP/1.1 ")
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("not an HTTP/1.1 status line: {head:?}"))
}

/// [`post_status`] over HTTPS, through curl (the certificate is not
/// checked: it is the bench's own).
fn post_status_tls(addr: SocketAddr) -> Result<u16> {
    let output = Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(["-H", "Content-Type: application/json", "-d", BODY])
        .arg(format!("https://{addr}{PATH}"))
        .output()
        .context("running curl")?;
    let code = String::from_utf8_lossy(&output.stdout);
    code.trim()
        .parse()
        .with_context(|| format!("curl printed {code:?}"))
}

/// The scratch folder (wrk script, nginx config, logs) and the processes the
/// bench started. Dropping it stops them by PID and removes the folder, on
/// every way out: success, error or panic.
struct Lab {
    dir: PathBuf,
    procs: Vec<Proc>,
}

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Lab {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("balancer-bench-l7-{}", std::process::id()));
        // Left by an earlier run that had the same PID and was killed.
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir,
            procs: Vec::new(),
        })
    }

    /// Starts `command` with its output in `<name>.log`.
    fn start(&mut self, name: &str, command: &mut Command) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let file = File::create(&log)?;
        command
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        eprintln!("$ {}", display(command));
        let child = command
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.procs.push(Proc {
            name: name.to_owned(),
            child,
            log,
        });
        Ok(())
    }

    /// The two demo workers (`worker1`, `worker2`), answering; their
    /// addresses.
    fn start_workers(&mut self, balancer: &Path) -> Result<[SocketAddr; 2]> {
        let workers = [free_addr()?, free_addr()?];
        for (number, addr) in workers.iter().enumerate() {
            let name = format!("worker{}", number + 1);
            self.start(
                &name,
                Command::new(balancer)
                    .args(["mock-worker", "--model", "demo-model", "--listen"])
                    .arg(addr.to_string()),
            )?;
            self.await_ready(&name, *addr)?;
        }
        Ok(workers)
    }

    /// The PID of process `name`.
    fn pid(&self, name: &str) -> Result<u32> {
        self.procs
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.child.id())
            .with_context(|| format!("{name} was never started"))
    }

    /// Waits until the server `name` answers a chat completion on `addr`
    /// with 200.
    fn await_ready(&mut self, name: &str, addr: SocketAddr) -> Result<()> {
        self.await_answer(name, addr, post_status)
    }

    /// [`Lab::await_ready`], asking with `probe`.
    fn await_answer(
        &mut self,
        name: &str,
        addr: SocketAddr,
        probe: fn(SocketAddr) -> Result<u16>,
    ) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        let proc = self
            .procs
            .iter_mut()
            .find(|p| p.name == name)
            .with_context(|| format!("{name} was never started"))?;
        loop {
            let last = match probe(addr) {
                Ok(200) => return Ok(()),
                Ok(status) => format!("HTTP {status}"),
                Err(error) => format!("{error:#}"),
            };
            if let Some(status) = proc.child.try_wait()? {
                bail!(
                    "{name} exited ({status}) before answering 200 on {addr}; {}",
                    tail(&proc.log)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{name} did not answer 200 on {addr} within {}s (last: {last}); {}",
                    READY_WITHIN.as_secs(),
                    tail(&proc.log)
                );
            }
            sleep(Duration::from_millis(100));
        }
    }

    fn stop(&mut self, name: &str) {
        let (mut named, others) = std::mem::take(&mut self.procs)
            .into_iter()
            .partition(|p| p.name == name);
        self.procs = others;
        stop(&mut named);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        stop(&mut self.procs);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// SIGTERM first, so nginx takes its workers down with it and the gateways
/// exit cleanly; SIGKILL for whatever is still there after the grace period.
fn stop(procs: &mut [Proc]) {
    for proc in procs.iter_mut() {
        // Only a child not yet reaped is signalled: its PID cannot have been
        // reused by an unrelated process.
        if let Ok(None) = proc.child.try_wait()
            && let Ok(pid) = libc::pid_t::try_from(proc.child.id())
        {
            // SAFETY: kill(2) touches no memory of this process.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
    let deadline = Instant::now() + STOP_GRACE;
    for proc in procs.iter_mut() {
        while matches!(proc.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            sleep(Duration::from_millis(20));
        }
        if let Ok(None) = proc.child.try_wait() {
            eprintln!("bench: {} ignored SIGTERM; killing it", proc.name);
            let _ = proc.child.kill();
        }
        let _ = proc.child.wait();
    }
}

/// The end of a log, for error messages.
fn tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(20);
    if lines.is_empty() {
        format!("{} is empty", log.display())
    } else {
        format!("end of {}:\n{}", log.display(), lines[start..].join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "\
Running 5s test @ http://127.0.0.1:40001/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   310.47us  120.02us   9.87ms   91.20%
    Req/Sec    98.12k     3.01k  101.00k    80.00%
  Latency Distribution
     50%  280.00us
     75%  330.00us
     90%  410.00us
     99%    1.23ms
  488123 requests in 5.00s, 180.45MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:  97612.34
Transfer/sec:     36.08MB
";

    /// CPU time this thread has used so far.
    fn thread_cpu() -> Duration {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes only the timespec it is given.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
        assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
        Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
    }

    #[test]
    fn cpu_of_a_process_tree_counts_its_own_time() {
        // Spin for 100 ms of this thread's own CPU time, not of wall time:
        // on a loaded machine (the other tests run beside this one) a
        // wall-clock spin may be scheduled for a fraction of its length.
        let before = tree_cpu(std::process::id());
        let mine = thread_cpu();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut spin = 0u64;
        while thread_cpu() - mine < Duration::from_millis(100) {
            assert!(Instant::now() < deadline, "no 100 ms of CPU in 20 s");
            for _ in 0..10_000 {
                spin = std::hint::black_box(spin.wrapping_add(1));
            }
        }
        let spent = tree_cpu(std::process::id()).saturating_sub(before);
        // /proc counts in clock ticks (10 ms at the usual 100 Hz), so a
        // reading may trail by a tick at either end.
        assert!(
            spent >= Duration::from_millis(70),
            "{spent:?} counted for 100 ms of this thread's CPU"
        );
    }

    #[test]
    fn wrk_report_is_read() {
        let sample = parse_wrk(REPORT).unwrap();
        assert_eq!(sample.rps, 97612.34);
        assert_eq!(sample.p50, Duration::from_micros(280));
        assert_eq!(sample.p99, Duration::from_micros(1230));
        assert_eq!(sample.errors, 7);
    }

    #[test]
    fn a_report_without_latency_distribution_is_refused() {
        let without: String = REPORT
            .lines()
            .filter(|line| !line.contains('%') || line.contains("Stdev"))
            .map(|line| format!("{line}\n"))
            .collect();
        assert!(parse_wrk(&without).is_err());
    }

    #[test]
    fn latencies_in_every_unit() {
        assert_eq!(parse_latency("2.00s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_latency("1.50m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_latency("12us").unwrap(), Duration::from_micros(12));
        assert!(parse_latency("12").is_err());
        assert!(parse_latency("12ns").is_err());
    }

    #[test]
    fn the_pinned_reference_gateway_is_recognised_and_another_version_is_not() {
        let venv = std::env::temp_dir().join(format!("bench-venv-test-{}", std::process::id()));
        let site = venv.join("lib/python3.11/site-packages");
        fs::create_dir_all(site.join("smg-1.12.0.dist-info")).unwrap();
        assert!(!installed(&venv, "smg==1.13.0"));
        fs::create_dir_all(site.join("smg-1.13.0.dist-info")).unwrap();
        assert!(installed(&venv, "smg==1.13.0"));
        fs::remove_dir_all(&venv).unwrap();
        assert!(!installed(&venv, "smg==1.13.0"));
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}

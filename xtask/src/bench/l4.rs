//! `cargo xtask bench l4`: what the XDP L4 path costs and delivers.
//!
//! Two parts, in one run:
//! - Per-packet cost, measured by the kernel through `BPF_PROG_TEST_RUN`
//!   (1,000,000 runs, median of 7 rounds, inside a namespace with real
//!   routes): the ignored test `tests/tests/l4_cost.rs`, built in release
//!   and run with `--ignored`; it writes its medians to a file read here.
//! - New connections per second and request latency in a namespace topology
//!   (client, balancer, three workers, each in its own namespace; the
//!   balancer routes between them), with wrk sending `Connection: close`
//!   requests, so that every request is a new TCP connection, to three
//!   targets: the XDP service (`balancer launch --l4-mode remote`), an
//!   nftables DNAT service in the same balancer namespace (kube-proxy's
//!   nftables style: `numgen random mod 3 vmap` to one chain per endpoint),
//!   and one worker straight, routed through the balancer namespace by the
//!   kernel with no balancing at all. Rounds alternate the targets; the
//!   table shows medians and ratios to the XDP row.
//!
//! Everything runs inside namespaces this bench creates and deletes (on
//! every way out, see [`Topology`]); processes are stopped by PID ([`Lab`]).

use std::fmt::Write as _;
use std::fs::{self, File};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;

use super::{
    BODY, Lab, PATH, READY_WITHIN, Sample, WARMUP_SECS, WRK_THREADS, bounded, ensure_tool, median,
    other_cpu_use, parse_wrk, post_status, show,
};
use crate::shell::{cargo, run, stdout_of};
use crate::{ebpf, workspace_root};

#[derive(Args)]
pub struct L4 {
    /// Measured rounds of the topology part; each runs every target once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=20))]
    rounds: u64,
    /// Seconds of load per target and round.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=60))]
    duration_secs: u64,
    /// Connections wrk keeps busy (each request closes its connection).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1000))]
    connections: u64,
    /// Skip the per-packet cost part.
    #[arg(long)]
    skip_cost: bool,
}

/// Targets of the per-packet cost on the project's VM, by the case names
/// `l4_cost.rs` reports after the mode: each applies to every row that ends
/// in ", <case>" ("remote, known flow", "local, known flow"), so rows of
/// other modes or address families get the same target.
const COST_TARGETS: [(&str, f64); 4] = [
    ("known flow", 90.0),
    ("pass-through (TCP, other port)", 40.0),
    ("retransmitted SYN", 300.0),
    ("new flow", 500.0),
];

const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 79, 0, 2);
const FRONT_IP: Ipv4Addr = Ipv4Addr::new(10, 79, 0, 1);
/// The XDP service and the nftables one (on another port: XDP passes it
/// after two array reads instead of the hash lookups of a service port).
const XDP_VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 79, 100, 1), 80);
const NFT_VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 79, 100, 2), 8080);
const WORKER_PORT: u16 = 8000;
/// A second worker process in the first worker's namespace, the target of
/// "direct": conntrack is off for its port, so that path is plain routing.
const DIRECT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 79, 1, 2), 8001);
/// Conntrack's TIME_WAIT timeout in the balancer namespace (default 120 s):
/// at thousands of new connections per second, the default fills the
/// table within a few rounds and then measures drops instead of cost.
const CONNTRACK_TIME_WAIT_SECS: u32 = 10;
const WORKERS: usize = 3;
const XDP: &str = "XDP (remote mode)";

fn worker_addr(i: usize) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 79, i as u8, 2), WORKER_PORT)
}

pub fn l4(args: &L4) -> Result<()> {
    let started = Instant::now();
    // SAFETY: geteuid cannot fail and touches no memory.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "bench l4 needs root (XDP, network namespaces, nftables)"
    );
    let wrk = ensure_tool("wrk", "wrk")?;
    ensure_tool("nft", "nftables")?;
    ensure_tool("ethtool", "ethtool")?;
    let object = ebpf::build()?;
    let balancer = super::release_balancer()?;

    let cost = if args.skip_cost {
        None
    } else {
        Some(per_packet_cost(&object)?)
    };
    let (targets, steered) = topology_bench(args, &balancer, &object, &wrk)?;

    if let Some(cost) = &cost {
        println!("\n{}", cost_table(cost));
    }
    println!("\n{}", load_table(&targets, args));
    println!("{steered}");
    eprintln!("bench l4 took {:.0}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Runs `l4_cost.rs` and returns its rows (name, nanoseconds).
fn per_packet_cost(object: &Path) -> Result<Vec<(String, f64)>> {
    let out = std::env::temp_dir().join(format!("balancer-bench-l4-cost-{}", std::process::id()));
    run(cargo()
        .args([
            "test",
            "--release",
            "--package",
            "balancer-tests",
            "--test",
            "l4_cost",
            "--",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("BALANCER_EBPF_OBJECT", object)
        .env("BALANCER_L4_COST_OUT", &out)
        .current_dir(workspace_root()))?;
    let text = fs::read_to_string(&out).context("the cost test wrote no results")?;
    let _ = fs::remove_file(&out);
    text.lines()
        .map(|line| {
            let (name, ns) = line.split_once('\t').context("malformed cost line")?;
            Ok((name.to_owned(), ns.parse()?))
        })
        .collect()
}

fn cost_table(rows: &[(String, f64)]) -> String {
    let mut out = String::from(
        "per-packet cost (BPF_PROG_TEST_RUN, 1,000,000 runs, median of 7; `cargo xtask bench l4`)\n",
    );
    let (mut met, mut targeted) = (0, 0);
    for (name, ns) in rows {
        let target = cost_target(name)
            .map(|limit| {
                targeted += 1;
                let verdict = if *ns <= limit {
                    met += 1;
                    "pass"
                } else {
                    "FAIL"
                };
                format!("  target <= {limit:.0} ns: {verdict}")
            })
            .unwrap_or_default();
        let _ = writeln!(out, "  {name:<58} {ns:>6.1} ns{target}");
    }
    let _ = writeln!(
        out,
        "  targets met: {met} of {targeted} (each figure includes the harness floor)"
    );
    out.push_str(
        "  (\"new flow\": 7 rounds of 15,000 SYNs of distinct four-tuples, each run once, so\n   \
         every one writes a fresh entry; \"retransmitted SYN\" repeats one SYN, whose entry\n   \
         stands)",
    );
    out
}

/// The target of a row of the cost table, if its case has one.
fn cost_target(row: &str) -> Option<f64> {
    COST_TARGETS
        .iter()
        .find(|(case, _)| {
            row.strip_suffix(case)
                .is_some_and(|mode| mode.ends_with(", "))
        })
        .map(|&(_, limit)| limit)
}

struct Target {
    name: &'static str,
    addr: SocketAddr,
    samples: Vec<Sample>,
}

/// Sets up the topology, measures the three targets and returns them with a
/// line on what the XDP path counted.
fn topology_bench(
    args: &L4,
    balancer: &Path,
    object: &Path,
    wrk: &Path,
) -> Result<(Vec<Target>, String)> {
    // Dropped last: the processes go first (they live in the namespaces).
    let net = Topology::create()?;
    let dir = std::env::temp_dir().join(format!("balancer-bench-l4-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let mut lab = Lab {
        dir,
        procs: Vec::new(),
    };

    for i in 1..=WORKERS {
        lab.start(
            &format!("worker{i}"),
            net.exec(&net.worker(i))
                .arg(balancer)
                .args(["mock-worker", "--listen"])
                .arg(worker_addr(i).to_string()),
        )?;
    }
    lab.start(
        "direct",
        net.exec(&net.worker(1))
            .arg(balancer)
            .args(["mock-worker", "--listen"])
            .arg(DIRECT.to_string()),
    )?;
    net.nftables_service(&lab.dir)?;
    let gateway_metrics = SocketAddr::from(([127, 0, 0, 1], 29_400));
    let mut launch = net.exec(&net.balancer());
    launch
        .arg(balancer)
        .args(["launch", "--host", "127.0.0.1", "--port", "29300"])
        .args(["--prometheus-port", &gateway_metrics.port().to_string()])
        .args(["--admin-port", "29500", "--log-level", "warn"])
        .args(["--l4-mode", "remote", "--l4-service", &XDP_VIP.to_string()])
        // The bench's datapath goes with its agent: nothing stays pinned.
        .arg("--l4-detach-on-exit")
        .args(["--xdp-iface", Topology::FRONT_IF]);
    for i in 1..=WORKERS {
        launch.args(["--xdp-iface", &Topology::back_if(i)]);
    }
    launch.arg("--worker-urls");
    launch.args((1..=WORKERS).map(|i| format!("http://{}", worker_addr(i))));
    launch.env("BALANCER_EBPF_OBJECT", object);
    lab.start("balancer", &mut launch)?;

    let mut targets = vec![
        Target {
            name: XDP,
            addr: XDP_VIP.into(),
            samples: Vec::new(),
        },
        Target {
            name: "nftables DNAT",
            addr: NFT_VIP.into(),
            samples: Vec::new(),
        },
        Target {
            name: "worker (direct)",
            addr: DIRECT.into(),
            samples: Vec::new(),
        },
    ];
    for target in &targets {
        net.await_ready(&mut lab, target.addr)
            .with_context(|| format!("{} is not answering", target.name))?;
    }

    let script = lab.dir.join("chat-close.lua");
    fs::write(
        &script,
        format!(
            "wrk.method = \"POST\"\n\
             wrk.headers[\"Content-Type\"] = \"application/json\"\n\
             wrk.headers[\"Connection\"] = \"close\"\n\
             wrk.body = '{BODY}'\n"
        ),
    )?;
    let load = |addr: SocketAddr, secs: u64| -> Result<Sample> {
        let report = lab.dir.join("wrk.out");
        let mut command = net.exec(&net.client());
        command
            .arg(wrk)
            .arg(format!("-t{WRK_THREADS}"))
            .arg(format!("-c{}", args.connections))
            .arg(format!("-d{secs}s"))
            .args(["--latency", "--timeout", "5s", "-s"])
            .arg(&script)
            .arg(format!("http://{addr}{PATH}"))
            .stdout(File::create(&report)?);
        bounded(&mut command, Duration::from_secs(secs + 15))?;
        let text = fs::read_to_string(&report)?;
        parse_wrk(&text).with_context(|| format!("reading wrk's report:\n{text}"))
    };

    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let busy = other_cpu_use();
    eprintln!(
        "\nbench l4: POST {PATH} with Connection: close (a new TCP connection per request); \
         per target and round: wrk -t{WRK_THREADS} -c{} -d{}s --latency, run in the client \
         namespace; {} rounds after a {WARMUP_SECS}s warm-up",
        args.connections, args.duration_secs, args.rounds,
    );
    eprintln!(
        "CPU: {cores} cores shared, unpinned, by wrk, the balancer namespace's kernel work and \
         the workers; busy with other work before the first round: {busy}\n"
    );
    for target in &targets {
        load(target.addr, WARMUP_SECS).with_context(|| format!("warming up {}", target.name))?;
    }
    let count = targets.len();
    for round in 0..args.rounds as usize {
        for offset in 0..count {
            let target = &mut targets[(round + offset) % count];
            let sample = load(target.addr, args.duration_secs)
                .with_context(|| format!("measuring {}", target.name))?;
            eprintln!(
                "round {}/{}: {:<18} {:>8.0} conn/s  p50 {:>8}  p99 {:>8}  errors {}",
                round + 1,
                args.rounds,
                target.name,
                sample.rps,
                show(sample.p50),
                show(sample.p99),
                sample.errors,
            );
            target.samples.push(sample);
        }
    }
    let steered = net.steered(gateway_metrics)?;
    Ok((targets, steered))
}

fn load_table(targets: &[Target], args: &L4) -> String {
    let med = |t: &Target, f: fn(&Sample) -> f64| median(t.samples.iter().map(f).collect());
    let reference = &targets[0];
    let (ref_rps, ref_p50) = (
        med(reference, |s| s.rps),
        med(reference, |s| s.p50.as_secs_f64()),
    );
    let mut out = format!(
        "new connections per second and latency, {} rounds of {}s, wrk -c{} with Connection: close\n\
         {:<18} {:>9} {:>9} {:>9} {:>11} {:>11} {:>7}  {}\n",
        args.rounds,
        args.duration_secs,
        args.connections,
        "target",
        "conn/s",
        "p50",
        "p99",
        "conn/s ratio",
        "p50 ratio",
        "errors",
        "conn/s per round"
    );
    for target in targets {
        let rps = med(target, |s| s.rps);
        let p50 = med(target, |s| s.p50.as_secs_f64());
        let p99 = med(target, |s| s.p99.as_secs_f64());
        let rounds: Vec<String> = target
            .samples
            .iter()
            .map(|s| format!("{:.0}", s.rps))
            .collect();
        let _ = writeln!(
            out,
            "{:<18} {:>9.0} {:>9} {:>9} {:>11.2}x {:>10.2}x {:>7}  {}",
            target.name,
            rps,
            show(Duration::from_secs_f64(p50)),
            show(Duration::from_secs_f64(p99)),
            rps / ref_rps,
            p50 / ref_p50,
            target.samples.iter().map(|s| s.errors).sum::<u64>(),
            rounds.join(" ")
        );
    }
    out.push_str(&format!(
        "(medians over the rounds; ratios are relative to {XDP}: conn/s above 1 is faster, p50 \
         above 1 is slower; \"direct\" is one worker process routed through the balancer \
         namespace without balancing or conntrack; conntrack's TIME_WAIT timeout there is \
         {CONNTRACK_TIME_WAIT_SECS}s)"
    ));
    out
}

/// The bench's namespaces, deleted when dropped: `<prefix>-c` (client),
/// `-lb` (balancer) and `-w1`.. (workers). The balancer routes between the
/// client's /24 and one /24 per worker; the workers route back through it.
struct Topology {
    prefix: String,
    created: Vec<String>,
}

impl Topology {
    const FRONT_IF: &str = "lbc";

    fn back_if(i: usize) -> String {
        format!("lbw{i}")
    }

    fn client(&self) -> String {
        format!("{}-c", self.prefix)
    }

    fn balancer(&self) -> String {
        format!("{}-lb", self.prefix)
    }

    fn worker(&self, i: usize) -> String {
        format!("{}-w{i}", self.prefix)
    }

    fn create() -> Result<Self> {
        let mut net = Topology {
            prefix: format!("bl4-{}", std::process::id()),
            created: Vec::new(),
        };
        let names: Vec<String> = [net.client(), net.balancer()]
            .into_iter()
            .chain((1..=WORKERS).map(|i| net.worker(i)))
            .collect();
        for name in names {
            stdout_of(Command::new("ip").args(["netns", "add", &name]))?;
            net.created.push(name.clone());
            stdout_of(Command::new("ip").args(["-n", &name, "link", "set", "lo", "up"]))?;
        }
        let (client, balancer) = (net.client(), net.balancer());
        for setting in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            net.sh(&balancer, &["sysctl", "-qw", setting])?;
        }
        net.link(
            (&client, "cl0", CLIENT_IP),
            (&balancer, Self::FRONT_IF, FRONT_IP),
        )?;
        // The service addresses and the workers' networks, all behind the
        // balancer.
        let front = FRONT_IP.to_string();
        net.sh(
            &client,
            &["ip", "route", "add", "10.79.0.0/16", "via", &front],
        )?;
        for i in 1..=WORKERS {
            let gateway = Ipv4Addr::new(10, 79, i as u8, 1);
            let worker = net.worker(i);
            net.link(
                (&balancer, &Self::back_if(i), gateway),
                (&worker, "wk0", *worker_addr(i).ip()),
            )?;
            net.sh(
                &worker,
                &["ip", "route", "add", "default", "via", &gateway.to_string()],
            )?;
        }
        Ok(net)
    }

    /// A veth between two namespaces, addressed and up, with full checksums
    /// on transmit and GRO on receive (a frame XDP redirects into a veth is
    /// only delivered when the far end runs NAPI).
    fn link(&self, a: (&str, &str, Ipv4Addr), b: (&str, &str, Ipv4Addr)) -> Result<()> {
        stdout_of(Command::new("ip").args([
            "link", "add", a.1, "netns", a.0, "type", "veth", "peer", "name", b.1, "netns", b.0,
        ]))?;
        for (ns, iface, ip) in [a, b] {
            self.sh(
                ns,
                &["ip", "addr", "add", &format!("{ip}/24"), "dev", iface],
            )?;
            self.sh(ns, &["ip", "link", "set", iface, "up"])?;
            self.sh(ns, &["ethtool", "-K", iface, "tx", "off", "gro", "on"])?;
        }
        Ok(())
    }

    /// `ip netns exec <ns>`, ready for the program and its arguments.
    fn exec(&self, ns: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns]);
        command
    }

    fn sh(&self, ns: &str, args: &[&str]) -> Result<String> {
        stdout_of(self.exec(ns).args(args))
    }

    /// kube-proxy's nftables mode, reduced to one service: a random pick of
    /// one chain per endpoint, each DNATing to it; conntrack reverses it.
    /// Also turns conntrack off for the direct target, both ways.
    fn nftables_service(&self, dir: &Path) -> Result<()> {
        let mut rules = String::from("table ip bench {\n");
        let _ = writeln!(
            rules,
            "  chain raw {{\n    type filter hook prerouting priority raw; policy accept;\n    \
             ip daddr {0} tcp dport {1} notrack\n    ip saddr {0} tcp sport {1} notrack\n  }}",
            DIRECT.ip(),
            DIRECT.port()
        );
        for i in 1..=WORKERS {
            let _ = writeln!(
                rules,
                "  chain endpoint-{i} {{\n    meta l4proto tcp dnat to {}\n  }}",
                worker_addr(i)
            );
        }
        let picks: Vec<String> = (1..=WORKERS)
            .map(|i| format!("{} : goto endpoint-{i}", i - 1))
            .collect();
        let _ = writeln!(
            rules,
            "  chain service {{\n    numgen random mod {WORKERS} vmap {{ {} }}\n  }}",
            picks.join(", ")
        );
        let _ = writeln!(
            rules,
            "  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n    \
             ip daddr {} tcp dport {} goto service\n  }}\n}}",
            NFT_VIP.ip(),
            NFT_VIP.port()
        );
        let file = dir.join("bench.nft");
        fs::write(&file, rules)?;
        let balancer = self.balancer();
        self.sh(&balancer, &["nft", "-f", &file.to_string_lossy()])?;
        let time_wait =
            format!("net.netfilter.nf_conntrack_tcp_timeout_time_wait={CONNTRACK_TIME_WAIT_SECS}");
        self.sh(&balancer, &["sysctl", "-qw", &time_wait])?;
        Ok(())
    }

    /// Waits until a chat completion to `addr` from the client namespace is
    /// answered with 200, failing early if a started process has exited.
    fn await_ready(&self, lab: &mut Lab, addr: SocketAddr) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let last = match in_ns(&self.client(), move || post_status(addr)) {
                Ok(Ok(200)) => return Ok(()),
                Ok(Ok(status)) => format!("HTTP {status}"),
                Ok(Err(error)) | Err(error) => format!("{error:#}"),
            };
            for proc in &mut lab.procs {
                if let Some(status) = proc.child.try_wait()? {
                    bail!(
                        "{} exited ({status}); {}",
                        proc.name,
                        super::tail(&proc.log)
                    );
                }
            }
            if Instant::now() >= deadline {
                bail!("no 200 from {addr} within {READY_WITHIN:?} (last: {last})");
            }
            sleep(Duration::from_millis(100));
        }
    }

    /// What the XDP path counted, from the gateway's metrics: proof that
    /// its rows went through XDP and not the kernel's forwarding.
    fn steered(&self, metrics: SocketAddr) -> Result<String> {
        let text = in_ns(&self.balancer(), move || -> Result<String> {
            use std::io::{Read, Write};
            let mut stream =
                std::net::TcpStream::connect_timeout(&metrics, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(
                stream,
                "GET /metrics HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n"
            )?;
            let mut text = String::new();
            stream.read_to_string(&mut text)?;
            Ok(text)
        })??;
        let outcome = |name: &str| -> f64 {
            let series = format!("balancer_l4_outcome_packets_total{{outcome=\"{name}\"}}");
            text.lines()
                .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
                .unwrap_or(f64::NAN)
        };
        Ok(format!(
            "XDP path counted: {} new connections, {} packets of established ones, {} replies \
             restored, {} passed to the kernel unresolved",
            outcome("new_flow"),
            outcome("established"),
            outcome("reply"),
            outcome("unresolved")
        ))
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for name in self.created.drain(..) {
            if let Err(error) = stdout_of(Command::new("ip").args(["netns", "del", &name])) {
                eprintln!("bench: cleanup: {error:#}");
            }
        }
    }
}

/// Runs `f` on a thread that has joined namespace `ns`, for at most ten
/// seconds; sockets it opens live in that namespace.
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let path = PathBuf::from(format!("/var/run/netns/{ns}"));
    let namespace = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: setns on a valid namespace fd changes only this thread.
        if unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let _ = done.send(Err(std::io::Error::last_os_error()));
            return;
        }
        let _ = done.send(Ok(f()));
    });
    match result.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(error).with_context(|| format!("entering namespace {ns}")),
        Err(_) => bail!("work in namespace {ns} did not finish within 10s"),
    }
}

#[cfg(test)]
mod tests {
    use super::cost_target;

    #[test]
    fn targets_apply_to_their_case_in_every_mode() {
        assert_eq!(cost_target("remote, known flow"), Some(90.0));
        assert_eq!(cost_target("local, known flow"), Some(90.0));
        assert_eq!(cost_target("local, new flow"), Some(500.0));
        assert_eq!(cost_target("remote, retransmitted SYN"), Some(300.0));
        // Both families: the IPv6 rows say so after the mode.
        assert_eq!(cost_target("remote v6, known flow"), Some(90.0));
        assert_eq!(cost_target("local v6, new flow"), Some(500.0));
        assert_eq!(
            cost_target("remote v6, pass-through (TCP, other port)"),
            Some(40.0)
        );
        assert_eq!(
            cost_target("remote, pass-through (TCP, other port)"),
            Some(40.0)
        );
        // Variants of a case are not held to its target.
        assert_eq!(cost_target("remote, new flow, full small table"), None);
        assert_eq!(
            cost_target("remote, known flow, next hop looked up per packet"),
            None
        );
        assert_eq!(cost_target("remote, pass-through (UDP)"), None);
    }
}

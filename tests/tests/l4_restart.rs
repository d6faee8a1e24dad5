//! The pinned XDP datapath outlives its agent, in both forwarding modes, end
//! to end: the gateway (with L4 steering and `bpffs_dir` set, so that maps
//! and links are pinned and stay when it stops) and three demo workers,
//! clients in a namespace of their own. Five keep-alive connections are
//! held across every step, and must answer from the worker they started on
//! each time:
//!
//! - **Restart.** The agent stops (`Gateway::shutdown`): the program stays
//!   attached, the pins stay, and while no agent runs new connections still
//!   open (at least 99 of 100) and still avoid the worker isolated by its
//!   breaker before the stop (its state is in the pinned maps). The next
//!   agent adopts the maps (every backend keeps its slot, the counters carry
//!   over, the long-lived connections' entries are found in the table) and
//!   swaps the program in the pinned links in place.
//! - **Upgrade.** Stop and start again while a client opens connections the
//!   whole time: at least 99% of them succeed, and the links (same ids)
//!   now run a program with a new id.
//! - **Crash.** The agent as a process (`balancer launch`), killed with
//!   SIGKILL: nothing detaches, connections old and new keep working, and
//!   the next agent adopts what the killed one left.
//!
//! Finally `status::detach_all` removes the program from every interface
//! and the pin folder. Each test pins under a folder of its own
//! (`/sys/fs/bpf/balancer-test-<pid>-<mode>`, never the default one), and
//! removes it whatever happens. Every address is inside the namespaces the
//! test creates (two in local mode, five in remote mode).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use balancer::config::GatewayConfig;
use balancer::gateway::Gateway;
use balancer_common::l4::BackendState;
use balancer_core::breaker::State;
use balancer_core::clock::ManualClock;
use balancer_core::registry::Worker;
use balancer_dataplane::LoadOptions;
use balancer_dataplane::pin::{self, PinDir};
use balancer_dataplane::status;
use balancer_dataplane::steering::ForwardMode;
use balancer_mock_worker::{Fault, MockWorker};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::http1::{self, Answer};
use balancer_tests::l4e2e;
use balancer_tests::netns::{self, Namespaces, run};
use balancer_tests::ns_runtime::NsRuntime;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Keep-alive connections held across every step.
const LONG_LIVED: usize = 5;
/// New connections opened while no agent runs.
const FRESH: usize = 100;
/// Of which at most this many may fail (99% must succeed).
const FRESH_FAILURES: usize = 1;
/// Bound of every wait.
const BOUND: Duration = Duration::from_secs(10);
/// Timeouts of one new connection: connecting, and reading or writing.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the client keeps opening connections on each side of the gap
/// between two agents.
const AROUND_GAP: Duration = Duration::from_millis(300);
const WORKERS: usize = 3;
const NAMES: [&str; WORKERS] = ["a", "b", "c"];
/// The map sizes of [`l4e2e::l4_config`]; the agent process gets the same
/// so that it adopts the same maps.
const TABLE_SIZE: u32 = 1009;
const CONNTRACK_SIZE: u32 = 65536;
/// Listeners of the agent process, on loopback in the balancer's namespace.
const CHILD_PORT: u16 = 18_000;
const CHILD_METRICS_PORT: u16 = 18_001;
const CHILD_ADMIN_PORT: u16 = 18_002;

#[test]
fn local_pinned_datapath_survives_restart_upgrade_and_crash() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    restart_upgrade_crash(Mode::Local, &object).unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn remote_pinned_datapath_survives_restart_upgrade_and_crash() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    restart_upgrade_crash(Mode::Remote, &object).unwrap_or_else(|e| panic!("{e:#}"));
}

// ---------------------------------------------------------------------------
// The scenario.

impl Env<'_> {
    fn scenario(&self) -> Result<()> {
        let mode = self.mode;
        let step = Instant::now();
        ensure!(
            !self.pins.root().exists(),
            "{} exists before the first start",
            self.pins.root().display()
        );
        self.start("first start")?;
        self.ready()?;
        ensure!(
            self.maps_dir().is_dir(),
            "no pinned maps at {} after the first start",
            self.maps_dir().display()
        );
        let mut generation = self.links()?;
        self.attached(&generation)?;
        eprintln!("[{mode:?}] pinned links: {generation:?}");

        let vip = mode.vip();
        let mut long = netns::run_in(self.client_ns, BOUND, move || -> Result<Vec<TcpStream>> {
            (0..LONG_LIVED)
                .map(|_| http1::connect(vip.into()))
                .collect()
        })??;
        let mut served = Vec::new();
        for (i, stream) in long.iter_mut().enumerate() {
            let answer = http1::chat(stream, false).with_context(|| format!("connection {i}"))?;
            served.push(
                self.served_by(&answer)
                    .with_context(|| format!("connection {i}"))?,
            );
        }
        eprintln!("[{mode:?}] long-lived connections on workers {served:?}");
        // The worker of the first connection is isolated; with no agent
        // running, the pinned maps alone must keep new connections off it.
        let isolated = served[0];
        self.isolate(isolated)?;
        let slots = self.backends()?;
        let before_stop = self.metrics()?;
        eprintln!("[{mode:?}] set up in {:?}", step.elapsed());

        // Restart: the agent stops, the datapath stays.
        let step = Instant::now();
        self.stop()?;
        self.attached(&generation)
            .context("after the agent stopped")?;
        ensure!(
            self.links()? == generation,
            "the pinned links changed when the agent stopped"
        );
        self.status_command(isolated)?;
        self.keep_working(&mut long, &served, "with the agent stopped")?;
        let down = self.fresh_connections("with the agent stopped")?;
        ensure!(
            down.of(self.workers[isolated].name()) == 0,
            "the isolated worker {isolated} got {} new connections with the agent stopped: {down}",
            down.of(self.workers[isolated].name())
        );
        self.start("restart")?;
        let restarted = self.links()?;
        replaced(&generation, &restarted, "restart")?;
        generation = restarted;
        self.attached(&generation)?;
        let adopted = self.backends()?;
        ensure!(
            adopted
                .iter()
                .map(|(slot, (addr, _))| (slot, addr))
                .eq(slots.iter().map(|(slot, (addr, _))| (slot, addr))),
            "the backends' slots changed across the restart: {slots:?} before, {adopted:?} after"
        );
        let after_start = self.metrics()?;
        ensure!(
            after_start.outcome("new_flow")? >= before_stop.outcome("new_flow")? + down.ok() as f64,
            "the adopted counters lost connections: new_flow {} before the stop, {} new \
             connections while stopped, {} after the restart",
            before_stop.outcome("new_flow")?,
            down.ok(),
            after_start.outcome("new_flow")?
        );
        self.ready()?;
        self.keep_established(&mut long, &served, "after the restart")?;
        eprintln!("[{mode:?}] restart checked in {:?}", step.elapsed());

        // Upgrade: the program in the links replaced under load. Loading the
        // same object file again makes a new program in the kernel (a new
        // id), exactly what loading a newer build's object does: an upgrade
        // is a stop and a start of the new binary.
        let step = Instant::now();
        let load = Load::start(self.client_ns, vip);
        std::thread::sleep(AROUND_GAP);
        self.stop()?;
        std::thread::sleep(AROUND_GAP);
        self.start("upgrade")?;
        std::thread::sleep(AROUND_GAP);
        let during = load.finish()?;
        eprintln!("[{mode:?}] upgrade under load: {during}");
        ensure!(
            during.total() >= 20,
            "only {} connections attempted around the upgrade",
            during.total()
        );
        ensure!(
            during.failed * 100 <= during.total(),
            "more than 1% of the connections opened around the upgrade failed: {during}"
        );
        let upgraded = self.links()?;
        replaced(&generation, &upgraded, "upgrade")?;
        generation = upgraded;
        self.attached(&generation)?;
        self.ready()?;
        self.keep_established(&mut long, &served, "after the upgrade")?;
        eprintln!("[{mode:?}] upgrade checked in {:?}", step.elapsed());

        // Crash: an agent process, killed with SIGKILL.
        let step = Instant::now();
        self.stop()?;
        let mut agent = AgentProcess::spawn(self)?;
        let crashed = agent
            .wait_attached(self, &generation)
            .with_context(|| agent.log_tail())?;
        replaced(&generation, &crashed, "the agent process's start")?;
        generation = crashed;
        self.keep_working(&mut long, &served, "with the agent process running")?;
        let status = agent.kill()?;
        ensure!(
            status.signal() == Some(libc::SIGKILL),
            "the agent process ended with {status}, not by SIGKILL"
        );
        self.attached(&generation)
            .context("after the agent process was killed")?;
        ensure!(
            self.links()? == generation,
            "the pinned links changed when the agent process was killed"
        );
        self.keep_working(&mut long, &served, "after the agent process was killed")?;
        self.fresh_connections("after the agent process was killed")?;
        self.start("start after the crash")?;
        let adopted = self.links()?;
        replaced(&generation, &adopted, "start after the crash")?;
        generation = adopted;
        self.attached(&generation)?;
        self.ready()?;
        self.keep_established(&mut long, &served, "after the crash")?;
        self.fresh_connections("after the crash")?;
        agent.remove_log();
        eprintln!("[{mode:?}] crash checked in {:?}", step.elapsed());

        // Uninstall: detaching removes everything.
        self.stop()?;
        let removed = status::detach_all(self.dir).context("detach_all")?;
        ensure!(
            removed == [self.pins.name()],
            "detach_all removed {removed:?}"
        );
        for iface in self.mode.ifaces() {
            ensure!(
                self.xdp_program(&iface)?.is_none(),
                "XDP program still on {iface} after detach_all"
            );
        }
        for (pin, (link, _)) in &generation {
            ensure!(
                run("bpftool", &["link", "show", "id", &link.to_string()]).is_err(),
                "link {link} ({pin}) still exists after detach_all"
            );
        }
        ensure!(
            !self.dir.exists(),
            "{} still exists after detach_all",
            self.dir.display()
        );
        Ok(())
    }

    /// Every long-lived connection answers, from the worker it started on.
    fn keep_working(&self, long: &mut [TcpStream], served: &[usize], when: &str) -> Result<()> {
        for (i, stream) in long.iter_mut().enumerate() {
            let answer = http1::chat(stream, false).with_context(|| {
                format!("long-lived connection {i} (worker {}) {when}", served[i])
            })?;
            let now = self.served_by(&answer)?;
            ensure!(
                now == served[i],
                "long-lived connection {i} moved from worker {} to worker {now} {when}",
                served[i]
            );
        }
        Ok(())
    }

    /// [`Env::keep_working`], with the running agent's counters showing
    /// that their packets were found in the (adopted) connection table:
    /// none had to be steered again from the Maglev table.
    fn keep_established(&self, long: &mut [TcpStream], served: &[usize], when: &str) -> Result<()> {
        let before = self.metrics()?;
        self.keep_working(long, served, when)?;
        let after = self.metrics()?;
        for outcome in ["recovered", "peer_restored", "conntrack_full"] {
            let delta = after.outcome(outcome)? - before.outcome(outcome)?;
            ensure!(
                delta == 0.0,
                "{delta} {outcome} packets on the long-lived connections {when}: their \
                 entries were not in the adopted connection table ({})",
                after.outcomes_since(&before)?
            );
        }
        ensure!(
            after.outcome("established")? > before.outcome("established")?,
            "the long-lived connections' packets were not steered as established {when}"
        );
        Ok(())
    }

    /// [`FRESH`] new connections from the client, one request each: at
    /// most [`FRESH_FAILURES`] may fail.
    fn fresh_connections(&self, when: &str) -> Result<Tally> {
        let vip = self.mode.vip();
        let tally = netns::run_in(self.client_ns, BOUND * 6, move || {
            let mut tally = Tally::default();
            for _ in 0..FRESH {
                // Past the limit the step fails anyway; no need to wait for
                // every remaining timeout.
                if tally.failed > FRESH_FAILURES + 3 {
                    break;
                }
                tally.add(attempt(vip));
            }
            tally
        })?;
        eprintln!("[{:?}] {FRESH} new connections {when}: {tally}", self.mode);
        ensure!(
            tally.failed <= FRESH_FAILURES && tally.ok() + tally.failed >= FRESH,
            "new connections {when}: {tally}"
        );
        Ok(tally)
    }

    /// Runs `balancer l4 status` (the binary) on the pinned state, which
    /// must show every interface, the connections and the isolated worker.
    fn status_command(&self, isolated: usize) -> Result<()> {
        let binary = balancer_binary()?;
        let dir = self.dir.to_str().context("non-UTF-8 bpffs folder")?;
        let report = run(
            binary.to_str().context("non-UTF-8 binary path")?,
            &["l4", "status", "--bpffs-dir", dir],
        )?;
        eprintln!("[{:?}] balancer l4 status:\n{report}", self.mode);
        ensure!(
            report.contains(&self.pins.name()),
            "the status does not name {}",
            self.pins.name()
        );
        for iface in self.mode.ifaces() {
            ensure!(
                report.contains(&format!("XDP on {iface}:")),
                "the status does not mention XDP on {iface}"
            );
        }
        let established: usize = report
            .lines()
            .find_map(|line| {
                line.trim()
                    .strip_prefix("connections: ")?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .context("the status shows no connections")?;
        ensure!(
            established >= LONG_LIVED,
            "the status counts {established} established connections, expected at least \
             {LONG_LIVED}"
        );
        let addr = self.workers[isolated]
            .url()
            .trim_start_matches("http://")
            .to_owned();
        ensure!(
            report
                .lines()
                .any(|line| line.contains(&addr) && line.trim_end().ends_with("isolated")),
            "the status does not show the isolated worker {addr} as isolated"
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// What is pinned and attached.

/// Link id and program id of each pinned link, by pin name (`xdp-lbc`,
/// `tc-lbc`), as the kernel reports them.
type Links = BTreeMap<String, (u64, u64)>;

/// `after` holds the same links as `before` (the programs were replaced in
/// them, not attached anew), each running another program.
fn replaced(before: &Links, after: &Links, what: &str) -> Result<()> {
    ensure!(
        before.keys().eq(after.keys()),
        "the pinned links changed at the {what}: {before:?} before, {after:?} after"
    );
    for (pin, (link, program)) in before {
        let (new_link, new_program) = after[pin];
        ensure!(
            new_link == *link,
            "{pin} is link {new_link} after the {what}, link {link} before: the program was \
             attached anew instead of replaced in the pinned link"
        );
        ensure!(
            new_program != *program,
            "{pin} still runs program {program} after the {what}: not replaced"
        );
    }
    Ok(())
}

impl Env<'_> {
    fn maps_dir(&self) -> PathBuf {
        self.pins.maps_dir(&LoadOptions {
            table_size: TABLE_SIZE,
            services: 1,
            conntrack_size: CONNTRACK_SIZE,
        })
    }

    /// The pinned links, which must be one XDP link per interface (and a
    /// TC egress link per interface in local mode), with the maps of this
    /// build's layout and no other.
    fn links(&self) -> Result<Links> {
        let mut links = Links::new();
        for (path, _, _) in self.pins.links() {
            let shown = path.to_str().context("non-UTF-8 pin path")?;
            let json = run("bpftool", &["-j", "link", "show", "pinned", shown])?;
            let info: serde_json::Value =
                serde_json::from_str(&json).with_context(|| format!("bpftool said {json}"))?;
            let id = |key: &str| {
                info[key]
                    .as_u64()
                    .with_context(|| format!("no {key} for {shown}: {json}"))
            };
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            links.insert(name, (id("id")?, id("prog_id")?));
        }
        let mut expected = BTreeSet::new();
        for iface in self.mode.ifaces() {
            expected.insert(format!("xdp-{iface}"));
            if let Mode::Local = self.mode {
                expected.insert(format!("tc-{iface}"));
            }
        }
        ensure!(
            links.keys().cloned().collect::<BTreeSet<_>>() == expected,
            "pinned links {links:?}, expected {expected:?}"
        );
        let layouts = self.pins.layouts();
        ensure!(
            layouts == [self.maps_dir()],
            "pinned map folders {layouts:?}, expected only {} (a binary built from other \
             sources than this test pins another layout: rebuild it)",
            self.maps_dir().display()
        );
        Ok(links)
    }

    /// Each interface runs the XDP program of its pinned link.
    fn attached(&self, links: &Links) -> Result<()> {
        for iface in self.mode.ifaces() {
            let (_, program) = links[&format!("xdp-{iface}")];
            let shown = self.xdp_program(&iface)?;
            ensure!(
                shown == Some(program),
                "{iface} runs XDP program {shown:?}, its pinned link program {program}"
            );
        }
        Ok(())
    }

    /// The id of the XDP program on `iface`, as `ip link` shows it.
    fn xdp_program(&self, iface: &str) -> Result<Option<u64>> {
        let link = run(
            "ip",
            &["-n", self.balancer_ns, "link", "show", "dev", iface],
        )?;
        let words: Vec<&str> = link.split_whitespace().collect();
        let Some(at) = words
            .iter()
            .position(|w| w.starts_with("prog/xdp") || *w == "xdp" || *w == "xdpgeneric")
        else {
            return Ok(None);
        };
        let id = words[at..]
            .windows(2)
            .find_map(|pair| (pair[0] == "id").then(|| pair[1].parse().ok())?)
            .with_context(|| format!("no program id in {link:?}"))?;
        Ok(Some(id))
    }

    /// The backends in the pinned maps, by slot: address and state, as
    /// `status::report` shows them.
    fn backends(&self) -> Result<BTreeMap<u32, (String, String)>> {
        let report = status::report(self.dir);
        let backends: BTreeMap<u32, (String, String)> = report
            .lines()
            .filter_map(|line| {
                let (slot, rest) = line.trim().strip_prefix("backend ")?.split_once(": ")?;
                let (addr, state) = rest.split_once(' ')?;
                Some((slot.parse().ok()?, (addr.to_owned(), state.to_owned())))
            })
            .collect();
        ensure!(
            backends.len() == WORKERS,
            "{} backends pinned: {report}",
            backends.len()
        );
        Ok(backends)
    }
}

// ---------------------------------------------------------------------------
// New connections.

/// One new connection to `vip`, one request on it, short timeouts.
fn attempt(vip: SocketAddrV4) -> Result<Answer> {
    let mut stream = TcpStream::connect_timeout(&vip.into(), CONNECT_TIMEOUT)
        .with_context(|| format!("connecting to {vip}"))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let answer = http1::chat(&mut stream, true)?;
    ensure!(answer.status == 200, "answer {answer:?}");
    Ok(answer)
}

/// Outcomes of new connections: successes by worker name, failures.
#[derive(Default)]
struct Tally {
    by_worker: BTreeMap<String, usize>,
    failed: usize,
    errors: Vec<String>,
}

impl Tally {
    fn add(&mut self, outcome: Result<Answer>) {
        match outcome {
            Ok(answer) => *self.by_worker.entry(answer.worker).or_default() += 1,
            Err(error) => {
                self.failed += 1;
                if self.errors.len() < 3 {
                    self.errors.push(format!("{error:#}"));
                }
            }
        }
    }

    fn ok(&self) -> usize {
        self.by_worker.values().sum()
    }

    fn total(&self) -> usize {
        self.ok() + self.failed
    }

    fn of(&self, worker: &str) -> usize {
        self.by_worker.get(worker).copied().unwrap_or(0)
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} answered {:?}, {} failed",
            self.ok(),
            self.by_worker,
            self.failed
        )?;
        if !self.errors.is_empty() {
            write!(f, " (first errors: {})", self.errors.join("; "))?;
        }
        Ok(())
    }
}

/// A client opening new connections one after the other, from its
/// namespace, until told to stop (or dropped).
struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<Tally>>>,
}

impl Load {
    fn start(ns: &str, vip: SocketAddrV4) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let ns = ns.to_owned();
        let thread = std::thread::spawn(move || {
            netns::run_in(&ns, BOUND * 3, move || {
                let mut tally = Tally::default();
                while !flag.load(Ordering::Relaxed) {
                    tally.add(attempt(vip));
                }
                tally
            })
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> Result<Tally> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .context("the load was finished already")?
            .join()
            .map_err(|_| anyhow!("the load thread panicked"))?
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------
// The agent as a process.

/// The `balancer` binary, for the agent process and `balancer l4 status`.
///
/// This crate uses `balancer` as a library, so Cargo sets no
/// `CARGO_BIN_EXE_balancer` for its tests; the binary is where a build of
/// the workspace (or `cargo build -p balancer`) puts it: beside the `deps`
/// folder this test runs from (`target/<profile>/`).
fn balancer_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    let beside = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("balancer"));
    let fallback = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/balancer");
    let binary = beside
        .into_iter()
        .chain([fallback])
        .find(|path| path.is_file())
        .context(
            "no balancer binary beside the test executable or in target/debug: build it \
             first (`cargo build -p balancer --bin balancer`)",
        )?;
    let help = run(
        binary.to_str().context("non-UTF-8 binary path")?,
        &["launch", "--help"],
    )?;
    ensure!(
        help.contains("--bpffs-dir"),
        "{} predates --bpffs-dir: rebuild it (`cargo build -p balancer --bin balancer`)",
        binary.display()
    );
    Ok(binary)
}

/// `balancer launch` in the balancer's namespace, with the in-process
/// gateway's workers, service and map sizes, pinning in the same folder.
struct AgentProcess {
    child: Option<Child>,
    log: PathBuf,
}

impl AgentProcess {
    fn spawn(env: &Env) -> Result<Self> {
        let binary = balancer_binary()?;
        let log = std::env::temp_dir().join(format!(
            "balancer-l4-restart-{}-{}.log",
            std::process::id(),
            env.mode.forward().as_str()
        ));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        // `nsenter --net`, not `ip netns exec`: the latter also gives the
        // process a mount namespace of its own with a fresh /sys, where
        // /sys/fs/bpf is not the BPF filesystem the pins are on; the agent
        // would mount another one there and not find them. nsenter execs
        // the binary, so the child's pid is the agent's.
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net=/var/run/netns/{}", env.balancer_ns))
            .arg("--")
            .arg(&binary)
            .args(["launch", "--host", "127.0.0.1"])
            .args(["--port", &CHILD_PORT.to_string()])
            .args(["--prometheus-port", &CHILD_METRICS_PORT.to_string()])
            .args(["--admin-port", &CHILD_ADMIN_PORT.to_string()])
            .args(["--log-level", "info"])
            .args(["--l4-mode", env.mode.forward().as_str()])
            .args(["--l4-service", &env.mode.vip().to_string()])
            .args(["--l4-table-size", &TABLE_SIZE.to_string()])
            .args(["--l4-conntrack-size", &CONNTRACK_SIZE.to_string()])
            .arg("--bpffs-dir")
            .arg(env.dir);
        for iface in env.mode.ifaces() {
            command.args(["--xdp-iface", &iface]);
        }
        command
            .arg("--worker-urls")
            .args(env.workers.iter().map(MockWorker::url))
            .env("BALANCER_EBPF_OBJECT", env.object)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        eprintln!(
            "[{:?}] agent process {} started (log {})",
            env.mode,
            child.id(),
            log.display()
        );
        Ok(Self {
            child: Some(child),
            log,
        })
    }

    /// Waits until the process has replaced the programs in every pinned
    /// link and its metrics endpoint answers; returns the links.
    fn wait_attached(&mut self, env: &Env, before: &Links) -> Result<Links> {
        let started = Instant::now();
        let deadline = started + BOUND * 2;
        let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, CHILD_METRICS_PORT));
        loop {
            let child = self.child.as_mut().context("the agent process is gone")?;
            if let Some(status) = child.try_wait()? {
                bail!("the agent process exited early ({status})");
            }
            let links = env.links()?;
            let swapped = links
                .iter()
                .all(|(pin, (_, program))| before.get(pin).is_none_or(|(_, old)| old != program));
            if swapped && netns::run_in(env.balancer_ns, BOUND, move || http_get(metrics))?.is_ok()
            {
                eprintln!(
                    "[{:?}] agent process attached and serving after {:?}",
                    env.mode,
                    started.elapsed()
                );
                return Ok(links);
            }
            ensure!(
                Instant::now() < deadline,
                "the agent process did not take over the pinned links within {:?}: {links:?}",
                BOUND * 2
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL, then reaps the process; returns how it ended.
    fn kill(&mut self) -> Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("the agent process is gone")?;
        child.kill().context("killing the agent process")?;
        Ok(child.wait()?)
    }

    /// The end of the process's log, for an error's context.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "agent process log ({}), last lines:\n{}",
            self.log.display(),
            lines[lines.len().saturating_sub(30)..].join("\n")
        )
    }

    fn remove_log(&self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("{}", self.log_tail());
        }
    }
}

/// `GET /metrics` at `addr` (from the caller's namespace).
fn http_get(addr: SocketAddr) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    ensure!(
        text.starts_with("HTTP/1.1 200"),
        "metrics answered {text:.80}"
    );
    Ok(text)
}

// ---------------------------------------------------------------------------
// The topology (that of `l4_pressure.rs`, on subnets of its own).

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Gateway and workers in one namespace, the client in another.
    Local,
    /// Client, balancer (routing) and one namespace per worker.
    Remote,
}

impl Mode {
    fn forward(self) -> ForwardMode {
        match self {
            Self::Local => ForwardMode::Local,
            Self::Remote => ForwardMode::Remote,
        }
    }

    fn net(self) -> u8 {
        match self {
            Self::Local => 91,
            Self::Remote => 92,
        }
    }

    fn host(self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), 0, host)
    }

    fn client_ip(self) -> Ipv4Addr {
        self.host(2)
    }

    /// The balancer's address on the client's link.
    fn front_ip(self) -> Ipv4Addr {
        self.host(1)
    }

    fn vip(self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, self.net(), 100, 1), 80)
    }

    /// Remote mode: worker `i` (from 1) and the balancer's side of its link.
    fn worker_ip(self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), i as u8, 2)
    }

    fn worker_gateway(self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), i as u8, 1)
    }

    fn namespaces(self) -> usize {
        match self {
            Self::Local => 2,
            Self::Remote => 2 + WORKERS,
        }
    }

    /// The balancer's interfaces the program is attached to.
    fn ifaces(self) -> Vec<String> {
        match self {
            Self::Local => vec![FRONT_IF.to_owned()],
            Self::Remote => std::iter::once(FRONT_IF.to_owned())
                .chain((1..=WORKERS).map(back_if))
                .collect(),
        }
    }
}

const CLIENT_IF: &str = "cl0";
/// The balancer's interface toward the client.
const FRONT_IF: &str = "lbc";
/// A worker's interface toward the balancer (remote mode).
const WORKER_IF: &str = "wk0";

/// The balancer's interface toward worker `i` (remote mode, from 1).
fn back_if(i: usize) -> String {
    format!("lbw{i}")
}

fn ns_exec(ns: &str, args: &[&str]) -> Result<String> {
    let mut all = vec!["netns", "exec", ns];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// A veth between two namespaces, addressed and up, with full checksums on
/// transmit and GRO on receive (a frame XDP redirects into a veth is only
/// delivered when the far end runs NAPI).
fn link(a: (&str, &str, Ipv4Addr), b: (&str, &str, Ipv4Addr)) -> Result<()> {
    run(
        "ip",
        &[
            "link", "add", a.1, "netns", a.0, "type", "veth", "peer", "name", b.1, "netns", b.0,
        ],
    )?;
    for (ns, iface, ip) in [a, b] {
        run(
            "ip",
            &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", iface],
        )?;
        run("ip", &["-n", ns, "link", "set", iface, "up"])?;
        ns_exec(ns, &["ethtool", "-K", iface, "tx", "off", "gro", "on"])?;
    }
    Ok(())
}

/// The links and routes of `mode` between `names` (0: client, 1: balancer,
/// then the workers' namespaces in remote mode).
fn topology(mode: Mode, names: &[String]) -> Result<()> {
    let (client, balancer) = (names[0].as_str(), names[1].as_str());
    if let Mode::Remote = mode {
        // The balancer routes, and sees replies from the VIP, which it does
        // not own, arriving from the workers' side.
        for setting in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            ns_exec(balancer, &["sysctl", "-qw", setting])?;
        }
    }
    link(
        (client, CLIENT_IF, mode.client_ip()),
        (balancer, FRONT_IF, mode.front_ip()),
    )?;
    run(
        "ip",
        &[
            "-n",
            client,
            "route",
            "add",
            &format!("{}/32", mode.vip().ip()),
            "via",
            &mode.front_ip().to_string(),
        ],
    )?;
    if let Mode::Remote = mode {
        for i in 1..=WORKERS {
            let worker = names[1 + i].as_str();
            link(
                (balancer, &back_if(i), mode.worker_gateway(i)),
                (worker, WORKER_IF, mode.worker_ip(i)),
            )?;
            // Replies go back through the balancer, which restores the VIP.
            run(
                "ip",
                &[
                    "-n",
                    worker,
                    "route",
                    "add",
                    "default",
                    "via",
                    &mode.worker_gateway(i).to_string(),
                ],
            )?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Setup and cleanup.

/// Removes everything pinned under the folder when dropped, whatever
/// happened before (a clean run has removed it already).
struct PinGuard(PathBuf);

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Err(error) = status::detach_all(&self.0) {
            eprintln!("cleanup: detaching {}: {error}", self.0.display());
        }
    }
}

/// Runs the scenario in `mode` in namespaces created for it, pinning under
/// a folder of its own; the namespaces and the folder are removed whatever
/// happened.
fn restart_upgrade_crash(mode: Mode, object: &Path) -> Result<()> {
    let started = Instant::now();
    // Both tests may start at once: one of them mounts bpffs at
    // /sys/fs/bpf if it is not there yet, not both (a second mount would
    // hide the first one's pins).
    static MOUNT: Mutex<()> = Mutex::new(());
    {
        let _mounting = MOUNT.lock().unwrap_or_else(|e| e.into_inner());
        pin::ensure_bpffs(Path::new("/sys/fs/bpf")).context("mounting bpffs")?;
    }
    let dir = PathBuf::from(format!(
        "/sys/fs/bpf/balancer-test-{}-{}",
        std::process::id(),
        mode.forward().as_str()
    ));
    let prefix = match mode {
        Mode::Local => "bt-l4rsl",
        Mode::Remote => "bt-l4rsr",
    };
    let namespaces =
        Namespaces::create(prefix, mode.namespaces()).context("creating namespaces")?;
    // Dropped before the namespaces: the pins go first.
    let guard = PinGuard(dir.clone());
    status::detach_all(&dir).context("removing a stale pin folder")?;
    let names: Vec<String> = (0..mode.namespaces())
        .map(|i| namespaces.name(i).to_owned())
        .collect();
    let outcome = exercise(mode, &names, &dir, object);
    drop(guard);
    let deleted = namespaces.delete();
    eprintln!("[{mode:?}] took {:?}", started.elapsed());
    outcome?;
    deleted?;
    ensure!(
        !dir.exists(),
        "{} still exists after the test",
        dir.display()
    );
    Ok(())
}

fn exercise(mode: Mode, names: &[String], dir: &Path, object: &Path) -> Result<()> {
    topology(mode, names)?;
    // Remote mode: one runtime per worker namespace; local mode: the
    // workers share the gateway's.
    let worker_runtimes = names[2..]
        .iter()
        .map(|ns| NsRuntime::new(ns))
        .collect::<Result<Vec<_>>>()?;
    let runtime = NsRuntime::new(&names[1])?;
    let workers = NAMES
        .iter()
        .enumerate()
        .map(|(i, name)| match mode {
            Mode::Local => runtime.worker(SocketAddr::from((mode.front_ip(), 0)), name),
            Mode::Remote => {
                worker_runtimes[i].worker(SocketAddr::from((mode.worker_ip(i + 1), 0)), name)
            }
        })
        .collect::<Result<Vec<_>>>()?;

    let urls: Vec<String> = workers.iter().map(MockWorker::url).collect();
    let mut config = l4e2e::gateway_config(&urls);
    let mut l4 = l4e2e::l4_config(mode.ifaces(), mode.forward(), vec![mode.vip()]);
    ensure!(
        (l4.table_size, l4.conntrack_size) == (TABLE_SIZE, CONNTRACK_SIZE),
        "l4e2e::l4_config's map sizes changed; update TABLE_SIZE and CONNTRACK_SIZE"
    );
    l4.bpffs_dir = Some(dir.to_path_buf());
    l4.detach_on_exit = false;
    config.l4 = Some(l4);

    let env = Env {
        mode,
        client_ns: &names[0],
        balancer_ns: &names[1],
        balancer: &runtime,
        workers: &workers,
        config,
        dir,
        pins: PinDir::new(dir, mode.forward().as_str(), &mode.ifaces()),
        object,
        gw: RefCell::new(None),
    };
    let outcome = env.scenario();

    // Whatever gateway the scenario left running stops (its datapath
    // stays pinned, for the guard to remove).
    let stopped = match env.gw.borrow_mut().take() {
        Some(gw) => runtime.run(gw.shutdown()),
        None => Ok(()),
    };
    let mut workers_stopped = Ok(());
    for (i, worker) in workers.into_iter().enumerate() {
        let runtime = match mode {
            Mode::Local => &runtime,
            Mode::Remote => &worker_runtimes[i],
        };
        workers_stopped = workers_stopped.and(runtime.run(worker.shutdown()));
    }
    outcome?;
    stopped.context("stopping the gateway")?;
    workers_stopped.context("stopping the workers")
}

// ---------------------------------------------------------------------------
// The in-process gateway, its workers and the metrics.

struct Env<'a> {
    mode: Mode,
    client_ns: &'a str,
    balancer_ns: &'a str,
    /// The runtime the gateway runs on, in the balancer's namespace.
    balancer: &'a NsRuntime,
    workers: &'a [MockWorker],
    /// Every gateway starts with it: pinned under `dir`, left attached.
    config: GatewayConfig,
    dir: &'a Path,
    /// The folder of this mode and interfaces under `dir`.
    pins: PinDir,
    /// The eBPF object, for the agent process.
    object: &'a Path,
    /// The running gateway, if one runs.
    gw: RefCell<Option<Gateway>>,
}

impl Env<'_> {
    /// Starts a gateway (a fresh one: breakers closed, a new clock), which
    /// adopts whatever is pinned.
    fn start(&self, what: &str) -> Result<()> {
        ensure!(self.gw.borrow().is_none(), "a gateway runs already");
        let started = Instant::now();
        let clock = Arc::new(ManualClock::new());
        let gw = self
            .balancer
            .run(Gateway::start_with_clock(self.config.clone(), clock))?
            .with_context(|| format!("starting the gateway ({what})"))?;
        *self.gw.borrow_mut() = Some(gw);
        eprintln!(
            "[{:?}] gateway started ({what}) in {:?}",
            self.mode,
            started.elapsed()
        );
        Ok(())
    }

    /// Shuts the running gateway down; its datapath stays.
    fn stop(&self) -> Result<()> {
        let gw = self.gw.borrow_mut().take().context("no gateway runs")?;
        self.balancer.run(gw.shutdown())
    }

    fn gw<T>(&self, f: impl FnOnce(&Gateway) -> Result<T>) -> Result<T> {
        let gw = self.gw.borrow();
        f(gw.as_ref().context("no gateway runs")?)
    }

    /// Waits until the gateway knows every worker's models and the kernel
    /// has every worker routable.
    fn ready(&self) -> Result<()> {
        self.wait("models learned", || {
            self.gw(|gw| {
                Ok(gw
                    .registry
                    .fleet()
                    .workers
                    .iter()
                    .all(|w| !w.models().is_empty()))
            })
        })?;
        for i in 0..self.workers.len() {
            self.wait_kernel_state(i, BackendState::Routable)?;
        }
        Ok(())
    }

    /// Which worker gave `answer`; it must be a success.
    fn served_by(&self, answer: &Answer) -> Result<usize> {
        ensure!(answer.status == 200, "answer {answer:?}");
        self.workers
            .iter()
            .position(|w| w.name() == answer.worker)
            .with_context(|| format!("unexpected answer {answer:?}"))
    }

    /// Opens worker `i`'s breaker with real L7 failures, clears the fault
    /// (only the breaker holds the worker back then) and waits until the
    /// kernel has it isolated.
    fn isolate(&self, i: usize) -> Result<()> {
        self.workers[i].set_fault(Fault {
            status: Some(500),
            ..Fault::default()
        });
        let opened = (|| -> Result<usize> {
            let mut sent = 0;
            while self.worker(i)?.breaker.state() != State::Open {
                ensure!(
                    sent < 60,
                    "worker {i}'s breaker still {:?} after {sent} requests",
                    self.worker(i)?.breaker.state()
                );
                self.gateway_chat()?;
                sent += 1;
            }
            Ok(sent)
        })();
        self.workers[i].clear_fault();
        let sent = opened?;
        self.wait_kernel_state(i, BackendState::Isolated)?;
        eprintln!(
            "[{:?}] worker {i}'s breaker opened after {sent} requests; isolated in the kernel",
            self.mode
        );
        Ok(())
    }

    fn worker(&self, i: usize) -> Result<Arc<Worker>> {
        let url = self.workers[i].url();
        self.gw(|gw| {
            gw.registry
                .fleet()
                .get(&url)
                .cloned()
                .with_context(|| format!("worker {i} is not registered"))
        })
    }

    /// One chat completion through the L7 gateway.
    fn gateway_chat(&self) -> Result<u16> {
        let uri = self.gw(|gw| Ok(format!("http://{}/v1/chat/completions", gw.addr)))?;
        self.balancer.run(async move {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let request = http::Request::post(uri)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(http1::CHAT.as_bytes())))?;
            let response = tokio::time::timeout(BOUND, client.request(request)).await??;
            let status = response.status().as_u16();
            response.into_body().collect().await?;
            Ok::<_, anyhow::Error>(status)
        })?
    }

    /// The running gateway's metrics, as exposed.
    fn metrics(&self) -> Result<Metrics> {
        let uri = self.gw(|gw| Ok(format!("http://{}/metrics", gw.metrics_addr)))?;
        let text = self.balancer.run(async move {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let response = tokio::time::timeout(BOUND, client.get(uri.parse()?)).await??;
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, anyhow::Error>(String::from_utf8_lossy(&body).into_owned())
        })??;
        Ok(Metrics(text))
    }

    /// Waits until the kernel's map holds `state` for worker `i`.
    fn wait_kernel_state(&self, i: usize, state: BackendState) -> Result<()> {
        let worker = self.worker(i)?;
        self.wait(
            &format!("worker {i} {} in the kernel", state.name()),
            || {
                self.gw(|gw| {
                    let steering = gw.steering().context("no dataplane")?;
                    Ok(steering.backend_state(&worker)? == Some(state))
                })
            },
        )
    }

    fn wait(&self, what: &str, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
        let deadline = Instant::now() + BOUND;
        while !done()? {
            if Instant::now() > deadline {
                bail!("timed out after {BOUND:?} waiting for: {what}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

/// One scrape of the gateway's metrics.
struct Metrics(String);

impl Metrics {
    /// Packets of one L4 outcome.
    fn outcome(&self, name: &str) -> Result<f64> {
        let series = format!("balancer_l4_outcome_packets_total{{outcome=\"{name}\"}}");
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
            .with_context(|| format!("no {series} in the metrics"))
    }

    /// The outcomes that moved since `earlier`, for messages.
    fn outcomes_since(&self, earlier: &Metrics) -> Result<String> {
        let mut moved = Vec::new();
        for name in [
            "new_flow",
            "established",
            "reply",
            "recovered",
            "peer_restored",
            "conntrack_full",
            "unresolved",
            "no_backend",
        ] {
            let delta = self.outcome(name)? - earlier.outcome(name)?;
            if delta != 0.0 {
                moved.push(format!("{name} +{delta}"));
            }
        }
        Ok(moved.join(", "))
    }
}

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
//! (`/sys/fs/bpf/balancer-test-<pid>-<mode>-<family>`, never the default
//! one), and removes it whatever happens. Each mode runs once with an IPv4
//! service and workers, once with IPv6 ones. Every address is inside the
//! namespaces the test creates (two in local mode, five in remote mode).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use balancer::config::GatewayConfig;
use balancer::gateway::Gateway;
use balancer_core::clock::ManualClock;
use balancer_dataplane::LoadOptions;
use balancer_dataplane::pin::{self, PinDir};
use balancer_dataplane::status;
use balancer_mock_worker::MockWorker;
use balancer_tests::l4e2e::{self, Driver, Metrics, NewConnections, Tally};
use balancer_tests::netns::{self, run};
use balancer_tests::ns_runtime::NsRuntime;
use balancer_tests::topology::{Family, Layout, Mode, Topology, WORKERS};
use balancer_tests::{balancer_binary, ebpf_prerequisites};

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
/// The map sizes of [`l4e2e::l4_config`]; the agent process gets the same
/// so that it adopts the same maps.
const TABLE_SIZE: u32 = 1009;
const CONNTRACK_SIZE: u32 = 65536;
/// Listeners of the agent process, on loopback in the balancer's namespace.
const CHILD_PORT: u16 = 18_000;
const CHILD_METRICS_PORT: u16 = 18_001;
const CHILD_ADMIN_PORT: u16 = 18_002;

#[test]
fn local_pinned_ipv4_datapath_survives_restart_upgrade_and_crash() {
    restart_upgrade_crash(Mode::Local, Family::V4);
}

#[test]
fn local_pinned_ipv6_datapath_survives_restart_upgrade_and_crash() {
    restart_upgrade_crash(Mode::Local, Family::V6);
}

#[test]
fn remote_pinned_ipv4_datapath_survives_restart_upgrade_and_crash() {
    restart_upgrade_crash(Mode::Remote, Family::V4);
}

#[test]
fn remote_pinned_ipv6_datapath_survives_restart_upgrade_and_crash() {
    restart_upgrade_crash(Mode::Remote, Family::V6);
}

// ---------------------------------------------------------------------------
// The scenario.

impl Env<'_> {
    fn scenario(&self) -> Result<()> {
        let mode = self.layout.mode;
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

        let vip = self.layout.vip();
        let (mut long, served) =
            l4e2e::long_lived(self.client_ns, vip, LONG_LIVED, self.workers, BOUND)?;
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
        let load = self.connections().load(self.client_ns, 1, BOUND * 3);
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
        for iface in self.layout.mode.ifaces() {
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
        l4e2e::still_served(long, served, self.workers, when)
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

    /// New connections to the service from the client.
    fn connections(&self) -> NewConnections {
        NewConnections {
            vip: self.layout.vip(),
            connect_timeout: CONNECT_TIMEOUT,
            io_timeout: IO_TIMEOUT,
        }
    }

    /// [`FRESH`] new connections from the client, one request each: at
    /// most [`FRESH_FAILURES`] may fail.
    fn fresh_connections(&self, when: &str) -> Result<Tally> {
        let connections = self.connections();
        let tally = netns::run_in(self.client_ns, BOUND * 6, move || {
            connections.tally(FRESH, FRESH_FAILURES)
        })?;
        eprintln!(
            "[{:?}] {FRESH} new connections {when}: {tally}",
            self.layout.mode
        );
        ensure!(
            tally.failed <= FRESH_FAILURES && tally.ok() + tally.failed >= FRESH,
            "new connections {when}: {tally}"
        );
        Ok(tally)
    }

    /// Runs `balancer l4 status` (the binary) on the pinned state, which
    /// must show every interface, the connections and the isolated worker.
    fn status_command(&self, isolated: usize) -> Result<()> {
        let binary = balancer_binary("--bpffs-dir")?;
        let dir = self.dir.to_str().context("non-UTF-8 bpffs folder")?;
        let report = run(
            binary.to_str().context("non-UTF-8 binary path")?,
            &["l4", "status", "--bpffs-dir", dir],
        )?;
        eprintln!("[{:?}] balancer l4 status:\n{report}", self.layout.mode);
        ensure!(
            report.contains(&self.pins.name()),
            "the status does not name {}",
            self.pins.name()
        );
        for iface in self.layout.mode.ifaces() {
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
        for iface in self.layout.mode.ifaces() {
            expected.insert(format!("xdp-{iface}"));
            if let Mode::Local = self.layout.mode {
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
        for iface in self.layout.mode.ifaces() {
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
// The agent as a process.

/// `balancer launch` in the balancer's namespace, with the in-process
/// gateway's workers, service and map sizes, pinning in the same folder.
struct AgentProcess {
    child: Option<Child>,
    log: PathBuf,
}

impl AgentProcess {
    fn spawn(env: &Env) -> Result<Self> {
        let binary = balancer_binary("--bpffs-dir")?;
        let log = std::env::temp_dir().join(format!(
            "balancer-l4-restart-{}-{}-{}.log",
            std::process::id(),
            env.layout.mode.forward().as_str(),
            env.layout.family.as_str()
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
            .args(["--l4-mode", env.layout.mode.forward().as_str()])
            .args(["--l4-service", &env.layout.vip().to_string()])
            .args(["--l4-table-size", &TABLE_SIZE.to_string()])
            .args(["--l4-conntrack-size", &CONNTRACK_SIZE.to_string()])
            .arg("--bpffs-dir")
            .arg(env.dir);
        for iface in env.layout.mode.ifaces() {
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
            env.layout.mode,
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
                    env.layout.mode,
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

/// Runs the scenario in `mode` with a service and workers of `family`, in
/// namespaces created for it, pinning under a folder of its own; the
/// namespaces and the folder are removed whatever happened.
fn restart_upgrade_crash(mode: Mode, family: Family) {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    pinned_run(Layout::new(mode, family, 91), &object).unwrap_or_else(|e| panic!("{e:#}"));
}

fn pinned_run(layout: Layout, object: &Path) -> Result<()> {
    let (mode, family) = (layout.mode, layout.family);
    let started = Instant::now();
    // The tests may start at once: one of them mounts bpffs at
    // /sys/fs/bpf if it is not there yet, not both (a second mount would
    // hide the first one's pins).
    static MOUNT: Mutex<()> = Mutex::new(());
    {
        let _mounting = MOUNT.lock().unwrap_or_else(|e| e.into_inner());
        pin::ensure_bpffs(Path::new("/sys/fs/bpf")).context("mounting bpffs")?;
    }
    let dir = PathBuf::from(format!(
        "/sys/fs/bpf/balancer-test-{}-{}-{}",
        std::process::id(),
        mode.forward().as_str(),
        family.as_str()
    ));
    let outcome = Topology::run("bt-l4rs", layout, |topology| {
        // Dropped before the namespaces: the pins go first.
        let _guard = PinGuard(dir.clone());
        status::detach_all(&dir).context("removing a stale pin folder")?;
        exercise(topology, &dir, object)
    });
    eprintln!("[{mode:?} {family:?}] took {:?}", started.elapsed());
    outcome?;
    ensure!(
        !dir.exists(),
        "{} still exists after the test",
        dir.display()
    );
    Ok(())
}

fn exercise(topology: &Topology, dir: &Path, object: &Path) -> Result<()> {
    let layout = topology.layout;
    let mode = layout.mode;
    let runtimes = topology.runtimes()?;
    let workers = runtimes.start_workers()?;

    let urls: Vec<String> = workers.iter().map(MockWorker::url).collect();
    let config = l4e2e::l4_gateway_config(&urls, layout, |_, l4| {
        l4.bpffs_dir = Some(dir.to_path_buf());
        l4.detach_on_exit = false;
    });
    let sizes = config
        .l4
        .as_ref()
        .map(|l4| (l4.table_size, l4.conntrack_size));
    ensure!(
        sizes == Some((TABLE_SIZE, CONNTRACK_SIZE)),
        "l4e2e::l4_config's map sizes changed; update TABLE_SIZE and CONNTRACK_SIZE"
    );

    let env = Env {
        layout,
        client_ns: topology.client(),
        balancer_ns: topology.balancer(),
        balancer: &runtimes.balancer,
        workers: &workers,
        urls,
        config,
        dir,
        pins: PinDir::new(dir, mode.forward().as_str(), &mode.ifaces()),
        object,
        gw: RefCell::new(None),
    };
    let outcome = env.scenario();

    // Whatever gateway the scenario left running stops (its datapath
    // stays pinned, for the guard to remove).
    let gw = env.gw.borrow_mut().take();
    let stopped = runtimes.shutdown(gw, workers.into_iter().enumerate());
    outcome?;
    stopped
}

// ---------------------------------------------------------------------------
// The in-process gateway, its workers and the metrics.

struct Env<'a> {
    layout: Layout,
    client_ns: &'a str,
    balancer_ns: &'a str,
    /// The runtime the gateway runs on, in the balancer's namespace.
    balancer: &'a NsRuntime,
    workers: &'a [MockWorker],
    urls: Vec<String>,
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
            self.layout.mode,
            started.elapsed()
        );
        Ok(())
    }

    /// Shuts the running gateway down; its datapath stays.
    fn stop(&self) -> Result<()> {
        let gw = self.gw.borrow_mut().take().context("no gateway runs")?;
        self.balancer.run(gw.shutdown())
    }

    /// `f` with the running gateway.
    fn driver<T>(&self, f: impl FnOnce(Driver) -> Result<T>) -> Result<T> {
        let gw = self.gw.borrow();
        f(Driver::new(
            self.balancer,
            gw.as_ref().context("no gateway runs")?,
            &self.urls,
        ))
    }

    /// Waits until the gateway knows every worker's models and the kernel
    /// has every worker routable.
    fn ready(&self) -> Result<()> {
        self.driver(|driver| driver.ready(BOUND))
    }

    /// Isolates worker `i` through its breaker (see [`Driver::isolate`]).
    fn isolate(&self, i: usize) -> Result<()> {
        let (sent, _) = self.driver(|driver| driver.isolate(i, &self.workers[i], BOUND))?;
        eprintln!(
            "[{:?}] worker {i}'s breaker opened after {sent} requests; isolated in the kernel",
            self.layout.mode
        );
        Ok(())
    }

    /// The running gateway's metrics, as exposed.
    fn metrics(&self) -> Result<Metrics> {
        self.driver(|driver| driver.metrics())
    }
}

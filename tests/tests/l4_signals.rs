//! The kernel's handshake signals drive the breakers (`--cb-l4-signals`), in
//! both forwarding modes, end to end: the gateway (L4 steering, the real
//! clock, handshake counters read every 100 ms, health checks every 60 s so
//! that they play no part) and three demo workers, clients in a namespace of
//! their own opening plain TCP connections to the service with one small
//! HTTP request each. No request goes through the L7 gateway: whatever
//! moves worker B's breaker is what the datapath saw.
//!
//! - **Refused.** B stops listening, so its kernel answers SYNs with a
//!   reset. The datapath counts the refused handshakes and the breaker
//!   opens (failures `l4_refused`) within a second of the first refused
//!   connection; the kernel isolates B, and of the next 300 new
//!   connections at most 1% fail.
//! - **Recovery.** B listens again on the same address. Its breaker goes
//!   half-open when the open timeout passes, the kernel gives it a trial
//!   share (state 4), an established handshake closes the breaker and B is
//!   routable again, all within the open timeout and 2 s, with no request
//!   through the gateway.
//! - **Timeout.** An nftables rule in B's namespace drops the SYNs to its
//!   port: clients' SYNs go unanswered, their kernels send them again after
//!   a second, and the breaker opens on `l4_timeout` failures alone. The
//!   rule goes, and B recovers as above.
//!
//! Finally the delay histograms of the dataplane (`dataplane_sync_seconds`,
//! `dataplane_signal_seconds`) have observations. Every address is inside
//! the namespaces the test creates (two in local mode, five in remote
//! mode); nothing is pinned (`bpffs_dir: None`), and the gateway, the
//! workers, the nftables rule and the namespaces go on every exit path.
//! Each mode runs once with an IPv4 service and workers, once with IPv6
//! ones.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use balancer::gateway::Gateway;
use balancer_common::l4::BackendState;
use balancer_core::breaker::{FailureReason, Snapshot, State};
use balancer_core::registry::Worker;
use balancer_mock_worker::MockWorker;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4e2e::{self, Driver, Load, Metrics, NewConnections, Tally, poll_until};
use balancer_tests::netns;
use balancer_tests::topology::{Family, Layout, Mode, NAMES, Runtimes, Topology, ns_exec};

/// The worker whose handshakes fail.
const B: usize = 1;
/// Breaker settings: failures that open it, trial successes that close it,
/// how long it stays open, trial connections per second. Three trial
/// successes at one trial connection per second span two of the kernel's
/// one-second windows, so the kernel holds the trial state for a second or
/// more: long enough to be seen by a poll that a loaded machine may leave
/// unscheduled for a while (with one success the state lasted about a
/// signal interval, and a CI run missed it).
const FAILURE_THRESHOLD: u32 = 3;
const SUCCESS_THRESHOLD: u32 = 3;
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);
const TRIALS_PER_SECOND: u32 = 1;
/// How often the agent reads the handshake counters.
const SIGNAL_INTERVAL: Duration = Duration::from_millis(100);
/// The longest from the first refused connection to the open breaker.
const OPEN_WITHIN: Duration = Duration::from_secs(1);
/// The longest from the repair to a closed breaker and a routable worker:
/// the open timeout, the three trials (two windows), and slack.
const RECOVER_WITHIN: Duration = Duration::from_secs(OPEN_TIMEOUT.as_secs() + 4);
/// New connections once the breaker is open, and how many of them may fail.
const AFTER_OPEN: usize = 300;
const AFTER_OPEN_FAILURES: usize = AFTER_OPEN / 100;
/// New connections after a recovery, of which B must take some.
const AFTER_RECOVERY: usize = 60;
/// Concurrent clients while SYNs are dropped: each one soon waits on B.
const TIMEOUT_CLIENTS: usize = 8;
/// Timeouts of one new connection: connecting (long enough for the SYN to
/// be sent again, after a second), and reading or writing.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const IO_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound of every wait.
const BOUND: Duration = Duration::from_secs(10);
/// The nftables table that drops B's SYNs.
const NFT_TABLE: &str = "balancer_l4_signals";

#[test]
fn local_ipv4_handshake_signals_open_and_close_the_breaker() {
    with_gateway(Mode::Local, Family::V4);
}

#[test]
fn local_ipv6_handshake_signals_open_and_close_the_breaker() {
    with_gateway(Mode::Local, Family::V6);
}

#[test]
fn remote_ipv4_handshake_signals_open_and_close_the_breaker() {
    with_gateway(Mode::Remote, Family::V4);
}

#[test]
fn remote_ipv6_handshake_signals_open_and_close_the_breaker() {
    with_gateway(Mode::Remote, Family::V6);
}

// ---------------------------------------------------------------------------
// The scenario.

impl Env<'_> {
    fn scenario(&self) -> Result<()> {
        self.ready()?;
        let start = self.fresh(AFTER_RECOVERY, 0, "at the start")?;
        ensure!(
            start.failed == 0 && start.of(NAMES[B]) > 0,
            "new connections at the start: {start}"
        );
        self.refused().context("refused handshakes")?;
        self.recover("after the refused handshakes", || self.start_worker(B))
            .context("recovery after the refused handshakes")?;
        let rule = self.timeout().context("timed-out handshakes")?;
        self.recover("after the timed-out handshakes", || rule.remove())
            .context("recovery after the timed-out handshakes")?;
        self.histograms()
    }

    /// B stops listening: refused handshakes open its breaker within
    /// [`OPEN_WITHIN`] of the first one, and once the kernel isolates it at
    /// most 1% of new connections fail.
    fn refused(&self) -> Result<()> {
        let mode = self.layout.mode;
        let b = self.worker(B)?;
        let before = b.breaker.snapshot();
        ensure!(
            before.state == State::Closed,
            "B's breaker is {} before the test",
            before.state
        );
        let handshakes = self.metrics()?;
        self.stop_worker(B)?;

        let load = self.load(1);
        let opened = poll_until(BOUND, || Ok(b.breaker.state() == State::Open))?;
        let isolated = match opened {
            Some(_) => poll_until(BOUND, || self.kernel_state_is(&b, BackendState::Isolated))?,
            None => None,
        };
        let first_refused = load.first_refused();
        let tally = load.finish()?;
        let after = b.breaker.snapshot();
        let metrics = self.metrics()?;
        eprintln!(
            "[{mode:?}] refused: load while B was down: {tally}; B's handshakes {}; \
             breaker {}",
            metrics.handshakes_since(&handshakes, &self.driver.urls[B])?,
            breaker_since(&before, &after)
        );
        let opened = opened.with_context(|| {
            format!(
                "B's breaker is still {} {BOUND:?} after it stopped listening",
                after.state
            )
        })?;
        let isolated = isolated.with_context(|| {
            format!("B's breaker opened but the kernel did not isolate B within {BOUND:?}")
        })?;
        let first_refused = first_refused.context("no connection was refused")?;
        let delay = opened.saturating_duration_since(first_refused);
        eprintln!(
            "[{mode:?}] refused: breaker open {delay:?} after the first refused connection, \
             isolated in the kernel {:?} after that",
            isolated.saturating_duration_since(opened)
        );
        let refused = failures(&after, FailureReason::L4Refused)
            - failures(&before, FailureReason::L4Refused);
        ensure!(
            refused >= u64::from(FAILURE_THRESHOLD),
            "the breaker opened with {refused} l4_refused failures, below the threshold \
             {FAILURE_THRESHOLD}"
        );
        ensure!(
            moves(&after, State::Closed, State::Open) > moves(&before, State::Closed, State::Open),
            "no closed → open transition counted"
        );
        ensure!(
            delay <= OPEN_WITHIN,
            "the breaker opened {delay:?} after the first refused connection (at most \
             {OPEN_WITHIN:?})"
        );
        ensure!(
            metrics.cb_failures(&self.driver.urls[B], "l4_refused")?
                >= f64::from(FAILURE_THRESHOLD),
            "worker_cb_failures_total{{reason=\"l4_refused\"}} does not show the failures"
        );
        ensure!(
            metrics.worker_state(&self.driver.urls[B])? == f64::from(BackendState::Isolated as u32),
            "l4_worker_state of B is {} with its breaker open",
            metrics.worker_state(&self.driver.urls[B])?
        );

        let started = Instant::now();
        let tally = self.fresh(AFTER_OPEN, AFTER_OPEN_FAILURES, "with B's breaker open")?;
        eprintln!(
            "[{mode:?}] refused: {} of {AFTER_OPEN} new connections failed after the breaker \
             opened ({:?})",
            tally.failed,
            started.elapsed()
        );
        ensure!(
            tally.failed <= AFTER_OPEN_FAILURES && tally.total() >= AFTER_OPEN,
            "new connections with B's breaker open: {tally}"
        );
        Ok(())
    }

    /// An nftables rule drops B's SYNs: handshakes time out and open its
    /// breaker, on `l4_timeout` failures alone. Returns the rule, still in
    /// place.
    fn timeout(&self) -> Result<DropSyns> {
        let mode = self.layout.mode;
        let b = self.worker(B)?;
        let before = b.breaker.snapshot();
        ensure!(
            before.state == State::Closed,
            "B's breaker is {} before its SYNs are dropped",
            before.state
        );
        let handshakes = self.metrics()?;
        let rule = DropSyns::install(self.topology.worker_ns(B), self.addrs[B])?;

        let started = Instant::now();
        let load = self.load(TIMEOUT_CLIENTS);
        let opened = poll_until(BOUND, || Ok(b.breaker.state() == State::Open))?;
        let isolated = match opened {
            Some(_) => poll_until(BOUND, || self.kernel_state_is(&b, BackendState::Isolated))?,
            None => None,
        };
        let tally = load.finish()?;
        let after = b.breaker.snapshot();
        let metrics = self.metrics()?;
        eprintln!(
            "[{mode:?}] timeout: load while B's SYNs were dropped: {tally}; B's handshakes {}; \
             breaker {}; {}",
            metrics.handshakes_since(&handshakes, &self.driver.urls[B])?,
            breaker_since(&before, &after),
            rule.counted()
                .unwrap_or_else(|e| format!("reading the rule: {e:#}"))
        );
        let opened = opened.with_context(|| {
            format!(
                "B's breaker is still {} {BOUND:?} after its SYNs started being dropped",
                after.state
            )
        })?;
        let isolated = isolated.with_context(|| {
            format!("B's breaker opened but the kernel did not isolate B within {BOUND:?}")
        })?;
        eprintln!(
            "[{mode:?}] timeout: breaker open {:?} after the clients started, isolated in the \
             kernel {:?} after that",
            opened.saturating_duration_since(started),
            isolated.saturating_duration_since(opened)
        );
        let timeouts = failures(&after, FailureReason::L4Timeout)
            - failures(&before, FailureReason::L4Timeout);
        let refused = failures(&after, FailureReason::L4Refused)
            - failures(&before, FailureReason::L4Refused);
        ensure!(
            timeouts >= u64::from(FAILURE_THRESHOLD),
            "the breaker opened with {timeouts} l4_timeout failures, below the threshold \
             {FAILURE_THRESHOLD}"
        );
        ensure!(
            refused == 0 && after.failures_total() - before.failures_total() == timeouts,
            "failures other than l4_timeout while the SYNs were dropped: {}",
            breaker_since(&before, &after)
        );
        ensure!(
            moves(&after, State::Closed, State::Open) > moves(&before, State::Closed, State::Open),
            "no closed → open transition counted"
        );
        ensure!(
            metrics.cb_failures(&self.driver.urls[B], "l4_timeout")?
                >= f64::from(FAILURE_THRESHOLD),
            "worker_cb_failures_total{{reason=\"l4_timeout\"}} does not show the failures"
        );
        ensure!(
            tally.timed_out > 0,
            "no client connection timed out while B's SYNs were dropped: {tally}"
        );
        Ok(rule)
    }

    /// `repair` makes B answer handshakes again: B's breaker must go through
    /// half-open (the kernel's trial state) to closed, and B be routable,
    /// within [`RECOVER_WITHIN`], with clients opening connections the whole
    /// time; then B takes new connections again.
    fn recover(&self, what: &str, repair: impl FnOnce() -> Result<()>) -> Result<()> {
        let mode = self.layout.mode;
        let b = self.worker(B)?;
        let before = b.breaker.snapshot();
        ensure!(
            before.state != State::Closed,
            "B's breaker is closed before the repair"
        );
        repair()?;
        let repaired = Instant::now();
        let load = self.load(1);
        let mut trial: Option<Instant> = None;
        let mut kernel = Vec::new();
        let recovered = poll_until(BOUND, || {
            let state = self.kernel_state(&b)?;
            if kernel.last() != Some(&state) {
                kernel.push(state);
            }
            if state == Some(BackendState::Trial) && trial.is_none() {
                trial = Some(Instant::now());
            }
            Ok(b.breaker.state() == State::Closed && state == Some(BackendState::Routable))
        })?;
        let tally = load.finish()?;
        let after = b.breaker.snapshot();
        let shown: Vec<&str> = kernel
            .iter()
            .map(|s| s.map_or("none", BackendState::name))
            .collect();
        eprintln!(
            "[{mode:?}] recovery {what}: load {tally}; breaker {}; kernel states {shown:?}",
            breaker_since(&before, &after)
        );
        let recovered = recovered.with_context(|| {
            // An open circuit whose timeout passed but that nothing polled
            // reads open with its deadline behind it.
            let expired = after.open_until.map_or("-".to_owned(), |until| {
                let now = self.driver.gw.registry.clock().now();
                format!("{:?}", Duration::from_nanos(now.saturating_sub(until)))
            });
            format!(
                "B not back {BOUND:?} after the repair: breaker {} (its open timeout of \
                 {OPEN_TIMEOUT:?} expired {expired} ago, yet nothing moved it to half-open: \
                 with no request through the gateway only the agent's timer can), kernel \
                 states {shown:?}",
                after.state
            )
        })?;
        let took = recovered.saturating_duration_since(repaired);
        eprintln!(
            "[{mode:?}] recovery {what}: breaker closed and B routable {took:?} after the \
             repair; trial state seen {:?} after the repair",
            trial.map(|t| t.saturating_duration_since(repaired))
        );
        ensure!(
            moves(&after, State::Open, State::HalfOpen)
                > moves(&before, State::Open, State::HalfOpen),
            "no open → half-open transition counted"
        );
        ensure!(
            moves(&after, State::HalfOpen, State::Closed)
                > moves(&before, State::HalfOpen, State::Closed),
            "no half-open → closed transition counted"
        );
        ensure!(
            trial.is_some(),
            "the kernel never held B in the trial state; states seen: {shown:?}"
        );
        ensure!(
            took <= RECOVER_WITHIN,
            "B was back {took:?} after the repair (at most {RECOVER_WITHIN:?})"
        );
        let metrics = self.metrics()?;
        ensure!(
            metrics.worker_state(&self.driver.urls[B])? == f64::from(BackendState::Routable as u32),
            "l4_worker_state of B is {} after the recovery",
            metrics.worker_state(&self.driver.urls[B])?
        );
        for (from, to) in [("open", "half_open"), ("half_open", "closed")] {
            let series = format!(
                "balancer_worker_cb_transitions_total{{worker=\"{}\",from=\"{from}\",to=\"{to}\"}}",
                self.driver.urls[B]
            );
            ensure!(metrics.get(&series)? >= 1.0, "{series} shows no transition");
        }
        let fresh = self.fresh(AFTER_RECOVERY, 0, &format!("{what}, B back"))?;
        ensure!(
            fresh.failed == 0 && fresh.of(NAMES[B]) >= AFTER_RECOVERY / 12,
            "new connections once B was back ({what}): {fresh}"
        );
        Ok(())
    }

    /// Both delay histograms of the dataplane have observations.
    fn histograms(&self) -> Result<()> {
        let metrics = self.metrics()?;
        for name in ["dataplane_sync_seconds", "dataplane_signal_seconds"] {
            let count = metrics.get(&format!("balancer_{name}_count"))?;
            let sum = metrics.get(&format!("balancer_{name}_sum"))?;
            eprintln!(
                "[{:?}] {name}: count {count}, sum {sum} s, mean {:.6} s",
                self.layout.mode,
                if count > 0.0 { sum / count } else { 0.0 }
            );
            ensure!(count > 0.0, "{name} has no observation");
        }
        Ok(())
    }
}

fn failures(s: &Snapshot, reason: FailureReason) -> u64 {
    s.failures[reason as usize]
}

fn moves(s: &Snapshot, from: State, to: State) -> u64 {
    s.transitions[from as usize][to as usize]
}

/// What moved on a breaker between two snapshots, for the log.
fn breaker_since(before: &Snapshot, after: &Snapshot) -> String {
    let mut moved = vec![format!("{} → {}", before.state, after.state)];
    let successes = after.successes - before.successes;
    if successes > 0 {
        moved.push(format!("successes +{successes}"));
    }
    for reason in FailureReason::ALL {
        let n = failures(after, reason) - failures(before, reason);
        if n > 0 {
            moved.push(format!("{} +{n}", reason.as_str()));
        }
    }
    for from in State::ALL {
        for to in State::ALL {
            let n = moves(after, from, to) - moves(before, from, to);
            if n > 0 {
                moved.push(format!("{from}→{to} +{n}"));
            }
        }
    }
    moved.join(", ")
}

// ---------------------------------------------------------------------------
// SYNs dropped in the worker's namespace.

/// An nftables table in a namespace that drops TCP to one address and
/// port on input; removed when dropped, whatever happened.
struct DropSyns {
    ns: String,
    removed: Cell<bool>,
}

impl DropSyns {
    fn install(ns: &str, addr: SocketAddr) -> Result<Self> {
        // The guard first: a failure halfway still removes the table.
        let guard = Self {
            ns: ns.to_owned(),
            removed: Cell::new(false),
        };
        let (ip, port) = (addr.ip().to_string(), addr.port().to_string());
        let family = if addr.is_ipv4() { "ip" } else { "ip6" };
        nft(ns, &["add", "table", "inet", NFT_TABLE])?;
        nft(
            ns,
            &[
                "add", "chain", "inet", NFT_TABLE, "in", "{", "type", "filter", "hook", "input",
                "priority", "0", ";", "}",
            ],
        )?;
        nft(
            ns,
            &[
                "add", "rule", "inet", NFT_TABLE, "in", family, "daddr", &ip, "tcp", "dport",
                &port, "counter", "drop",
            ],
        )?;
        Ok(guard)
    }

    /// The rule's counter, for the log.
    fn counted(&self) -> Result<String> {
        let listing = nft(&self.ns, &["list", "table", "inet", NFT_TABLE])?;
        Ok(listing
            .lines()
            .find(|l| l.contains("drop"))
            .map_or_else(|| "no rule".to_owned(), |l| format!("rule `{}`", l.trim())))
    }

    fn remove(&self) -> Result<()> {
        nft(&self.ns, &["delete", "table", "inet", NFT_TABLE])?;
        self.removed.set(true);
        Ok(())
    }
}

impl Drop for DropSyns {
    fn drop(&mut self) {
        if self.removed.get() {
            return;
        }
        let listed = nft(&self.ns, &["list", "tables"]);
        if listed.is_ok_and(|l| l.contains(NFT_TABLE))
            && let Err(error) = nft(&self.ns, &["delete", "table", "inet", NFT_TABLE])
        {
            eprintln!("cleanup: {error:#}");
        }
    }
}

fn nft(ns: &str, args: &[&str]) -> Result<String> {
    let mut all = vec!["nft"];
    all.extend_from_slice(args);
    ns_exec(ns, &all)
}

// ---------------------------------------------------------------------------
// Setup and cleanup.

/// Runs the scenario in `mode` with a service and workers of `family`, in
/// namespaces created for it and deleted afterwards whatever happened.
fn with_gateway(mode: Mode, family: Family) {
    if ebpf_prerequisites().is_none() {
        return;
    }
    let started = Instant::now();
    let outcome = Topology::run("bt-l4sg", Layout::new(mode, family, 93), start_and_run);
    eprintln!("[{mode:?} {family:?}] took {:?}", started.elapsed());
    outcome.unwrap_or_else(|e| panic!("{e:#}"));
}

fn start_and_run(topology: &Topology) -> Result<()> {
    let layout = topology.layout;
    let mode = layout.mode;
    let runtimes = topology.runtimes()?;
    let workers = runtimes.start_workers()?;
    let addrs: Vec<SocketAddr> = workers.iter().map(MockWorker::addr).collect();
    let urls: Vec<String> = workers.iter().map(MockWorker::url).collect();
    let workers: Vec<Option<MockWorker>> = workers.into_iter().map(Some).collect();

    let config = l4e2e::l4_gateway_config(&urls, layout, |config, l4| {
        // Health checks play no part: only the kernel's signals move breakers.
        config.health_check.interval = Duration::from_secs(60);
        config.breaker.l4_signals = true;
        config.breaker.settings.failure_threshold = FAILURE_THRESHOLD;
        config.breaker.settings.success_threshold = SUCCESS_THRESHOLD;
        config.breaker.settings.open_timeout = OPEN_TIMEOUT;
        config.breaker.settings.half_open_max_inflight = TRIALS_PER_SECOND;
        l4.signal_interval = SIGNAL_INTERVAL;
        l4.bpffs_dir = None;
    });
    // The real clock: the breakers' open timeouts pass by themselves.
    let gw = match runtimes
        .balancer
        .run(Gateway::start(config))
        .and_then(|gw| gw)
    {
        Ok(gw) => gw,
        Err(error) => {
            stop_workers(&runtimes, workers);
            return Err(error.context("starting the gateway"));
        }
    };

    let env = Env {
        layout,
        topology,
        runtimes: &runtimes,
        driver: Driver::new(&runtimes.balancer, &gw, &urls),
        workers: RefCell::new(workers),
        addrs,
    };
    let started = Instant::now();
    let outcome = env.scenario();
    eprintln!("[{mode:?}] scenario took {:?}", started.elapsed());

    let workers = env.workers.into_inner();
    let stopped = runtimes.balancer.run(gw.shutdown());
    stop_workers(&runtimes, workers);
    outcome?;
    stopped.context("stopping the gateway")
}

/// Stops whatever workers run, on their runtimes; failures are reported on
/// stderr.
fn stop_workers(runtimes: &Runtimes, workers: Vec<Option<MockWorker>>) {
    let running = workers
        .into_iter()
        .enumerate()
        .filter_map(|(i, worker)| Some((i, worker?)));
    if let Err(error) = runtimes.stop_workers(running) {
        eprintln!("cleanup: {error:#}");
    }
}

struct Env<'a> {
    layout: Layout,
    topology: &'a Topology,
    runtimes: &'a Runtimes,
    /// The gateway, on its runtime in the balancer's namespace.
    driver: Driver<'a>,
    /// The demo workers; `None` while one is stopped.
    workers: RefCell<Vec<Option<MockWorker>>>,
    addrs: Vec<SocketAddr>,
}

impl Env<'_> {
    /// Stops demo worker `i`: nothing listens on its address any more.
    fn stop_worker(&self, i: usize) -> Result<()> {
        let worker = self.workers.borrow_mut()[i]
            .take()
            .with_context(|| format!("worker {i} is stopped already"))?;
        self.runtimes.worker(i).run(worker.shutdown())
    }

    /// Starts demo worker `i` again, on the address it had.
    fn start_worker(&self, i: usize) -> Result<()> {
        ensure!(
            self.workers.borrow()[i].is_none(),
            "worker {i} runs already"
        );
        let worker = self.runtimes.worker(i).worker(self.addrs[i], NAMES[i])?;
        ensure!(
            worker.url() == self.driver.urls[i],
            "worker {i} came back at {}, not {}",
            worker.url(),
            self.driver.urls[i]
        );
        self.workers.borrow_mut()[i] = Some(worker);
        Ok(())
    }

    /// Waits until the gateway knows every worker's models and the kernel
    /// has every worker routable.
    fn ready(&self) -> Result<()> {
        self.driver.ready(BOUND)
    }

    fn worker(&self, i: usize) -> Result<Arc<Worker>> {
        self.driver.worker(i)
    }

    /// The state bit the kernel holds for `worker`.
    fn kernel_state(&self, worker: &Worker) -> Result<Option<BackendState>> {
        self.driver.kernel_state(worker)
    }

    fn kernel_state_is(&self, worker: &Worker, state: BackendState) -> Result<bool> {
        Ok(self.kernel_state(worker)? == Some(state))
    }

    /// New connections to the service from the client.
    fn connections(&self) -> NewConnections {
        NewConnections {
            vip: self.layout.vip(),
            connect_timeout: CONNECT_TIMEOUT,
            io_timeout: IO_TIMEOUT,
        }
    }

    /// Clients opening new connections one after the other, from their
    /// namespace, until the load is finished (or dropped).
    fn load(&self, clients: usize) -> Load {
        self.connections()
            .load(self.topology.client(), clients, BOUND * 4)
    }

    /// `count` new connections from the client, one request each, one after
    /// the other; stops early once more than `limit` failed by a margin.
    fn fresh(&self, count: usize, limit: usize, when: &str) -> Result<Tally> {
        let started = Instant::now();
        let connections = self.connections();
        let tally = netns::run_in(self.topology.client(), BOUND * 4, move || {
            connections.tally(count, limit)
        })?;
        eprintln!(
            "[{:?}] {count} new connections {when}: {tally} ({:?})",
            self.layout.mode,
            started.elapsed()
        );
        Ok(tally)
    }

    /// The gateway's metrics, as exposed.
    fn metrics(&self) -> Result<Metrics> {
        self.driver.metrics()
    }
}

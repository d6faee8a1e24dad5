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

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use balancer::gateway::Gateway;
use balancer_common::l4::BackendState;
use balancer_core::breaker::{FailureReason, Snapshot, State};
use balancer_core::registry::Worker;
use balancer_dataplane::steering::ForwardMode;
use balancer_mock_worker::MockWorker;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::http1;
use balancer_tests::l4e2e;
use balancer_tests::netns::{self, Namespaces, run};
use balancer_tests::ns_runtime::NsRuntime;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const WORKERS: usize = 3;
const NAMES: [&str; WORKERS] = ["a", "b", "c"];
/// The worker whose handshakes fail.
const B: usize = 1;
/// Breaker settings: failures that open it, trial successes that close it,
/// how long it stays open, trial connections per second.
const FAILURE_THRESHOLD: u32 = 3;
const SUCCESS_THRESHOLD: u32 = 1;
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);
const TRIALS_PER_SECOND: u32 = 1;
/// How often the agent reads the handshake counters.
const SIGNAL_INTERVAL: Duration = Duration::from_millis(100);
/// The longest from the first refused connection to the open breaker.
const OPEN_WITHIN: Duration = Duration::from_secs(1);
/// The longest from the repair to a closed breaker and a routable worker.
const RECOVER_WITHIN: Duration = Duration::from_secs(OPEN_TIMEOUT.as_secs() + 2);
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
/// Bound of every wait, and the step of every polling loop.
const BOUND: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(1);
/// The nftables table that drops B's SYNs.
const NFT_TABLE: &str = "balancer_l4_signals";

#[test]
fn local_handshake_signals_open_and_close_the_breaker() {
    let Some(_) = ebpf_prerequisites() else {
        return;
    };
    with_gateway(Mode::Local).unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn remote_handshake_signals_open_and_close_the_breaker() {
    let Some(_) = ebpf_prerequisites() else {
        return;
    };
    with_gateway(Mode::Remote).unwrap_or_else(|e| panic!("{e:#}"));
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
        let mode = self.mode;
        let b = self.worker(B)?;
        let before = b.breaker.snapshot();
        ensure!(
            before.state == State::Closed,
            "B's breaker is {} before the test",
            before.state
        );
        let handshakes = self.metrics()?;
        self.stop_worker(B)?;

        let load = Load::start(self.client_ns, mode.vip(), 1);
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
            metrics.handshakes_since(&handshakes, &self.urls[B])?,
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
            metrics.cb_failures(&self.urls[B], "l4_refused")? >= f64::from(FAILURE_THRESHOLD),
            "worker_cb_failures_total{{reason=\"l4_refused\"}} does not show the failures"
        );
        ensure!(
            metrics.worker_state(&self.urls[B])? == f64::from(BackendState::Isolated as u32),
            "l4_worker_state of B is {} with its breaker open",
            metrics.worker_state(&self.urls[B])?
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
        let mode = self.mode;
        let b = self.worker(B)?;
        let before = b.breaker.snapshot();
        ensure!(
            before.state == State::Closed,
            "B's breaker is {} before its SYNs are dropped",
            before.state
        );
        let handshakes = self.metrics()?;
        let rule = DropSyns::install(&self.worker_ns[B], self.addrs[B])?;

        let started = Instant::now();
        let load = Load::start(self.client_ns, mode.vip(), TIMEOUT_CLIENTS);
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
            metrics.handshakes_since(&handshakes, &self.urls[B])?,
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
            metrics.cb_failures(&self.urls[B], "l4_timeout")? >= f64::from(FAILURE_THRESHOLD),
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
        let mode = self.mode;
        let b = self.worker(B)?;
        let before = b.breaker.snapshot();
        ensure!(
            before.state != State::Closed,
            "B's breaker is closed before the repair"
        );
        repair()?;
        let repaired = Instant::now();
        let load = Load::start(self.client_ns, mode.vip(), 1);
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
                let now = self.gw.registry.clock().now();
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
            metrics.worker_state(&self.urls[B])? == f64::from(BackendState::Routable as u32),
            "l4_worker_state of B is {} after the recovery",
            metrics.worker_state(&self.urls[B])?
        );
        for (from, to) in [("open", "half_open"), ("half_open", "closed")] {
            let series = format!(
                "balancer_worker_cb_transitions_total{{worker=\"{}\",from=\"{from}\",to=\"{to}\"}}",
                self.urls[B]
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
                self.mode,
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

/// Polls `done` every [`POLL`] for at most `bound`: when it first held, or
/// `None`.
fn poll_until(bound: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<Option<Instant>> {
    let deadline = Instant::now() + bound;
    loop {
        if done()? {
            return Ok(Some(Instant::now()));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        std::thread::sleep(POLL);
    }
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
                "add", "rule", "inet", NFT_TABLE, "in", "ip", "daddr", &ip, "tcp", "dport", &port,
                "counter", "drop",
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
    let mut all = vec!["netns", "exec", ns, "nft"];
    all.extend_from_slice(args);
    run("ip", &all)
}

// ---------------------------------------------------------------------------
// New connections.

/// What one new connection with one request did.
enum Attempt {
    /// Answered 200 by this worker.
    Answered(String),
    /// The handshake got a reset.
    Refused,
    /// The handshake got no answer within [`CONNECT_TIMEOUT`].
    TimedOut,
    Failed(String),
}

/// One new connection to `vip`, one request on it (`Connection: close`).
fn attempt(vip: SocketAddrV4) -> Attempt {
    let mut stream = match TcpStream::connect_timeout(&vip.into(), CONNECT_TIMEOUT) {
        Ok(stream) => stream,
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => return Attempt::Refused,
        Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => {
            return Attempt::TimedOut;
        }
        Err(e) => return Attempt::Failed(format!("connecting to {vip}: {e}")),
    };
    let timeouts = stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)));
    if let Err(e) = timeouts {
        return Attempt::Failed(format!("socket timeouts: {e}"));
    }
    match http1::chat(&mut stream, true) {
        Ok(answer) if answer.status == 200 => Attempt::Answered(answer.worker),
        Ok(answer) => Attempt::Failed(format!("answer {answer:?}")),
        Err(e) => Attempt::Failed(format!("{e:#}")),
    }
}

/// Outcomes of new connections.
#[derive(Default)]
struct Tally {
    by_worker: BTreeMap<String, usize>,
    refused: usize,
    timed_out: usize,
    /// Failures of every kind, refused and timed out included.
    failed: usize,
    first_refused: Option<Instant>,
    errors: Vec<String>,
}

impl Tally {
    fn add(&mut self, attempt: Attempt) {
        match attempt {
            Attempt::Answered(worker) => *self.by_worker.entry(worker).or_default() += 1,
            Attempt::Refused => {
                self.refused += 1;
                self.failed += 1;
                self.first_refused.get_or_insert_with(Instant::now);
            }
            Attempt::TimedOut => {
                self.timed_out += 1;
                self.failed += 1;
            }
            Attempt::Failed(error) => {
                self.failed += 1;
                if self.errors.len() < 3 {
                    self.errors.push(error);
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
            "{} answered {:?}, {} failed ({} refused, {} timed out)",
            self.ok(),
            self.by_worker,
            self.failed,
            self.refused,
            self.timed_out
        )?;
        if !self.errors.is_empty() {
            write!(f, ", other errors: {}", self.errors.join("; "))?;
        }
        Ok(())
    }
}

/// Clients opening new connections one after the other, from their
/// namespace, until told to stop (or dropped).
struct Load {
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    threads: Vec<std::thread::JoinHandle<Result<()>>>,
}

impl Load {
    fn start(ns: &str, vip: SocketAddrV4, clients: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let threads = (0..clients)
            .map(|_| {
                let (stop, tally, ns) = (stop.clone(), tally.clone(), ns.to_owned());
                std::thread::spawn(move || {
                    netns::run_in(&ns, BOUND * 4, move || {
                        while !stop.load(Ordering::Relaxed) {
                            let outcome = attempt(vip);
                            lock(&tally).add(outcome);
                        }
                    })
                })
            })
            .collect();
        Self {
            stop,
            tally,
            threads,
        }
    }

    fn first_refused(&self) -> Option<Instant> {
        lock(&self.tally).first_refused
    }

    fn finish(mut self) -> Result<Tally> {
        self.stop.store(true, Ordering::Relaxed);
        for thread in std::mem::take(&mut self.threads) {
            thread
                .join()
                .map_err(|_| anyhow!("a client thread panicked"))??;
        }
        Ok(std::mem::take(&mut *lock(&self.tally)))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// The topology (that of `l4_pressure.rs` and `l4_restart.rs`).

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
            Self::Local => 93,
            Self::Remote => 94,
        }
    }

    fn client_ip(self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), 0, 2)
    }

    /// The balancer's address on the client's link.
    fn front_ip(self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net(), 0, 1)
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

/// Runs the scenario in `mode`, in namespaces created for it and deleted
/// afterwards whatever happened.
fn with_gateway(mode: Mode) -> Result<()> {
    let started = Instant::now();
    let prefix = match mode {
        Mode::Local => "bt-l4sgl",
        Mode::Remote => "bt-l4sgr",
    };
    let namespaces =
        Namespaces::create(prefix, mode.namespaces()).context("creating namespaces")?;
    let names: Vec<String> = (0..mode.namespaces())
        .map(|i| namespaces.name(i).to_owned())
        .collect();
    let outcome = start_and_run(mode, &names);
    let deleted = namespaces.delete();
    eprintln!("[{mode:?}] took {:?}", started.elapsed());
    outcome?;
    deleted
}

fn start_and_run(mode: Mode, names: &[String]) -> Result<()> {
    topology(mode, names)?;
    // Remote mode: one runtime per worker namespace; local mode: the
    // workers share the gateway's.
    let worker_runtimes = names[2..]
        .iter()
        .map(|ns| NsRuntime::new(ns))
        .collect::<Result<Vec<_>>>()?;
    let runtime = NsRuntime::new(&names[1])?;
    let worker_ns: Vec<String> = (0..WORKERS)
        .map(|i| match mode {
            Mode::Local => names[1].clone(),
            Mode::Remote => names[2 + i].clone(),
        })
        .collect();
    let mut workers = Vec::new();
    for (i, name) in NAMES.iter().enumerate() {
        let worker = match mode {
            Mode::Local => runtime.worker(SocketAddr::from((mode.front_ip(), 0)), name),
            Mode::Remote => {
                worker_runtimes[i].worker(SocketAddr::from((mode.worker_ip(i + 1), 0)), name)
            }
        };
        match worker {
            Ok(worker) => workers.push(Some(worker)),
            Err(error) => {
                stop_workers(mode, &runtime, &worker_runtimes, workers);
                return Err(error);
            }
        }
    }
    let addrs: Vec<SocketAddr> = workers.iter().flatten().map(MockWorker::addr).collect();
    let urls: Vec<String> = workers.iter().flatten().map(MockWorker::url).collect();

    let mut config = l4e2e::gateway_config(&urls);
    // Health checks play no part: only the kernel's signals move breakers.
    config.health_check.interval = Duration::from_secs(60);
    config.breaker.l4_signals = true;
    config.breaker.settings.failure_threshold = FAILURE_THRESHOLD;
    config.breaker.settings.success_threshold = SUCCESS_THRESHOLD;
    config.breaker.settings.open_timeout = OPEN_TIMEOUT;
    config.breaker.settings.half_open_max_inflight = TRIALS_PER_SECOND;
    let mut l4 = l4e2e::l4_config(mode.ifaces(), mode.forward(), vec![mode.vip()]);
    l4.signal_interval = SIGNAL_INTERVAL;
    l4.bpffs_dir = None;
    config.l4 = Some(l4);
    // The real clock: the breakers' open timeouts pass by themselves.
    let gw = match runtime.run(Gateway::start(config)) {
        Ok(Ok(gw)) => gw,
        Ok(Err(error)) => {
            stop_workers(mode, &runtime, &worker_runtimes, workers);
            return Err(error.context("starting the gateway"));
        }
        Err(error) => {
            stop_workers(mode, &runtime, &worker_runtimes, workers);
            return Err(error.context("starting the gateway"));
        }
    };

    let env = Env {
        mode,
        client_ns: &names[0],
        worker_ns,
        balancer: &runtime,
        worker_runtimes: &worker_runtimes,
        gw: &gw,
        workers: RefCell::new(workers),
        addrs,
        urls,
    };
    let started = Instant::now();
    let outcome = env.scenario();
    eprintln!("[{mode:?}] scenario took {:?}", started.elapsed());

    let workers = env.workers.into_inner();
    let stopped = runtime.run(gw.shutdown());
    stop_workers(mode, &runtime, &worker_runtimes, workers);
    outcome?;
    stopped.context("stopping the gateway")
}

/// Stops whatever workers run, on their runtimes.
fn stop_workers(
    mode: Mode,
    balancer: &NsRuntime,
    worker_runtimes: &[NsRuntime],
    workers: Vec<Option<MockWorker>>,
) {
    for (i, worker) in workers.into_iter().enumerate() {
        let Some(worker) = worker else { continue };
        let runtime = match mode {
            Mode::Local => balancer,
            Mode::Remote => &worker_runtimes[i],
        };
        if let Err(error) = runtime.run(worker.shutdown()) {
            eprintln!("cleanup: stopping worker {i}: {error:#}");
        }
    }
}

struct Env<'a> {
    mode: Mode,
    client_ns: &'a str,
    /// The namespace each worker listens in (the balancer's in local mode).
    worker_ns: Vec<String>,
    /// The runtime the gateway runs on, in the balancer's namespace.
    balancer: &'a NsRuntime,
    /// Remote mode: the runtime of each worker's namespace.
    worker_runtimes: &'a [NsRuntime],
    gw: &'a Gateway,
    /// The demo workers; `None` while one is stopped.
    workers: RefCell<Vec<Option<MockWorker>>>,
    addrs: Vec<SocketAddr>,
    urls: Vec<String>,
}

impl Env<'_> {
    fn worker_runtime(&self, i: usize) -> &NsRuntime {
        match self.mode {
            Mode::Local => self.balancer,
            Mode::Remote => &self.worker_runtimes[i],
        }
    }

    /// Stops demo worker `i`: nothing listens on its address any more.
    fn stop_worker(&self, i: usize) -> Result<()> {
        let worker = self.workers.borrow_mut()[i]
            .take()
            .with_context(|| format!("worker {i} is stopped already"))?;
        self.worker_runtime(i).run(worker.shutdown())
    }

    /// Starts demo worker `i` again, on the address it had.
    fn start_worker(&self, i: usize) -> Result<()> {
        ensure!(
            self.workers.borrow()[i].is_none(),
            "worker {i} runs already"
        );
        let worker = self.worker_runtime(i).worker(self.addrs[i], NAMES[i])?;
        ensure!(
            worker.url() == self.urls[i],
            "worker {i} came back at {}, not {}",
            worker.url(),
            self.urls[i]
        );
        self.workers.borrow_mut()[i] = Some(worker);
        Ok(())
    }

    /// Waits until the gateway knows every worker's models and the kernel
    /// has every worker routable.
    fn ready(&self) -> Result<()> {
        let learned = poll_until(BOUND, || {
            Ok(self
                .gw
                .registry
                .fleet()
                .workers
                .iter()
                .all(|w| !w.models().is_empty()))
        })?;
        ensure!(learned.is_some(), "models not learned within {BOUND:?}");
        for i in 0..WORKERS {
            let worker = self.worker(i)?;
            let routable = poll_until(BOUND, || {
                self.kernel_state_is(&worker, BackendState::Routable)
            })?;
            ensure!(
                routable.is_some(),
                "worker {i} not routable in the kernel within {BOUND:?}"
            );
        }
        Ok(())
    }

    fn worker(&self, i: usize) -> Result<Arc<Worker>> {
        self.gw
            .registry
            .fleet()
            .get(&self.urls[i])
            .cloned()
            .with_context(|| format!("worker {i} is not registered"))
    }

    /// The state bit the kernel holds for `worker`.
    fn kernel_state(&self, worker: &Worker) -> Result<Option<BackendState>> {
        let steering = self.gw.steering().context("no dataplane")?;
        Ok(steering.backend_state(worker)?)
    }

    fn kernel_state_is(&self, worker: &Worker, state: BackendState) -> Result<bool> {
        Ok(self.kernel_state(worker)? == Some(state))
    }

    /// `count` new connections from the client, one request each, one after
    /// the other; stops early once more than `limit` failed by a margin.
    fn fresh(&self, count: usize, limit: usize, when: &str) -> Result<Tally> {
        let vip = self.mode.vip();
        let started = Instant::now();
        let tally = netns::run_in(self.client_ns, BOUND * 4, move || {
            let mut tally = Tally::default();
            for _ in 0..count {
                if tally.failed > limit + 3 {
                    break;
                }
                tally.add(attempt(vip));
            }
            tally
        })?;
        eprintln!(
            "[{:?}] {count} new connections {when}: {tally} ({:?})",
            self.mode,
            started.elapsed()
        );
        Ok(tally)
    }

    /// The gateway's metrics, as exposed.
    fn metrics(&self) -> Result<Metrics> {
        let uri = format!("http://{}/metrics", self.gw.metrics_addr);
        let text = self.balancer.run(async move {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let response = tokio::time::timeout(BOUND, client.get(uri.parse()?)).await??;
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, anyhow::Error>(String::from_utf8_lossy(&body).into_owned())
        })??;
        Ok(Metrics(text))
    }
}

/// One scrape of the gateway's metrics.
struct Metrics(String);

impl Metrics {
    /// The value of one series (name and labels as exposed).
    fn get(&self, series: &str) -> Result<f64> {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .with_context(|| format!("no {series} in the metrics"))
    }

    fn handshakes(&self, url: &str, outcome: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_l4_worker_handshakes_total{{worker=\"{url}\",outcome=\"{outcome}\"}}"
        ))
    }

    fn cb_failures(&self, url: &str, reason: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_worker_cb_failures_total{{worker=\"{url}\",reason=\"{reason}\"}}"
        ))
    }

    fn worker_state(&self, url: &str) -> Result<f64> {
        self.get(&format!("balancer_l4_worker_state{{worker=\"{url}\"}}"))
    }

    /// A worker's handshake counters that moved since `earlier`, for the log.
    fn handshakes_since(&self, earlier: &Metrics, url: &str) -> Result<String> {
        let mut moved = Vec::new();
        for outcome in ["forwarded", "established", "refused", "timeout", "reset"] {
            let delta = self.handshakes(url, outcome)? - earlier.handshakes(url, outcome)?;
            if delta != 0.0 {
                moved.push(format!("{outcome} +{delta}"));
            }
        }
        if moved.is_empty() {
            return Ok("none moved".to_owned());
        }
        Ok(moved.join(", "))
    }
}

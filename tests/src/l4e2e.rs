//! The namespace scenario both forwarding modes must pass ([`Scenario`]):
//! connections to the service spread over three workers; worker B isolated
//! by real L7 failures (its breaker) and then by failing health checks, each
//! time getting no new connection while an established one keeps working,
//! and getting new ones again once it recovers.
//!
//! And what every namespace test of the L4 datapath drives its gateway
//! with: the gateway's configuration, a [`Driver`] (L7 requests, metric
//! scrapes, the registry's and the kernel's view of a worker, isolation
//! through the breaker), the scraped [`Metrics`], keep-alive connections
//! held on their workers ([`long_lived`], [`still_served`]), new
//! connections counted by outcome ([`NewConnections`], [`Tally`], [`Load`])
//! and bounded polling ([`poll_until`], [`wait`]); and how such a test
//! starts its workers and gateway and stops them ([`run_gateway`]).

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use balancer::config::GatewayConfig;
use balancer::gateway::Gateway;
use balancer_common::l4::BackendState;
use balancer_core::breaker::State;
use balancer_core::clock::ManualClock;
use balancer_core::health::Health;
use balancer_core::health::HealthThresholds;
use balancer_core::registry::Worker;
use balancer_core::selection::Policy;
use balancer_dataplane::XdpMode;
use balancer_dataplane::steering::L4Config;
use balancer_mock_worker::{Fault, MockWorker};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::http1::{self, Answer};
use crate::netns;
use crate::ns_runtime::NsRuntime;
use crate::topology::{Layout, Topology};

/// The worker that fails.
pub const B: usize = 1;
/// New connections per round.
pub const CONNECTIONS: usize = 300;
/// Breaker open timeout the scenario's gateway runs with; the test moves
/// its manual clock past it.
pub const CB_TIMEOUT_SECS: u64 = 30;
const BOUND: Duration = Duration::from_secs(20);

/// The gateway the scenario relies on (besides the L4 settings): round
/// robin so that B sees L7 traffic, a breaker that opens after three
/// failures and closes after one good trial, fast health checks, no load
/// scrapes, the workers at `urls`, every listener on a free loopback port.
pub fn gateway_config(urls: &[String]) -> GatewayConfig {
    let mut config = GatewayConfig::with_worker_urls(urls);
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.metrics_listen = config.listen;
    config.admin_listen = config.listen;
    config.policy = Policy::RoundRobin;
    config.breaker.settings.failure_threshold = 3;
    config.breaker.settings.success_threshold = 1;
    config.breaker.settings.open_timeout = Duration::from_secs(CB_TIMEOUT_SECS);
    config.proxy.retry.max_attempts = 3;
    config.proxy.retry.initial_backoff = Duration::from_millis(1);
    config.proxy.retry.max_backoff = Duration::from_millis(5);
    config.health_check.interval = Duration::from_secs(1);
    config.health_check.timeout = Duration::from_secs(1);
    // The scenarios count the workers' connections and packets as their own
    // traffic makes them; the load a worker reports plays no part in L4.
    config.load_monitor.interval = None;
    config.health = HealthThresholds {
        failure: 2,
        success: 2,
    };
    config
}

/// The L4 part of the scenario's gateway: the service of `layout` steered
/// over the workers from the balancer's interfaces, in its mode.
pub fn l4_config(layout: Layout) -> L4Config {
    L4Config {
        ifaces: layout.mode.ifaces(),
        xdp_mode: XdpMode::Auto,
        mode: layout.mode.forward(),
        services: vec![layout.vip()],
        table_size: 1009,
        conntrack_size: 65536,
        // Nothing pinned: the test's datapath goes with its gateway.
        bpffs_dir: None,
        detach_on_exit: true,
        signal_interval: std::time::Duration::from_millis(100),
    }
}

/// The configuration of a namespace test's gateway: [`gateway_config`] for
/// the workers at `urls`, with [`l4_config`] of `layout` as its L4 part,
/// each as `adjust` changes them.
pub fn l4_gateway_config(
    urls: &[String],
    layout: Layout,
    adjust: impl FnOnce(&mut GatewayConfig, &mut L4Config),
) -> GatewayConfig {
    let mut config = gateway_config(urls);
    let mut l4 = l4_config(layout);
    adjust(&mut config, &mut l4);
    config.l4 = Some(l4);
    config
}

/// A gateway steering a topology's service over its demo workers, as
/// [`run_gateway`] hands it to a test.
pub struct Running<'a> {
    /// The gateway, on its runtime in the balancer's namespace.
    pub driver: Driver<'a>,
    /// The demo workers, worker `i` named `topology::NAMES[i]`.
    pub workers: &'a [MockWorker],
    /// The gateway's clock, which only the test moves: a breaker's open
    /// timeout never passes by itself.
    pub clock: &'a ManualClock,
}

/// Starts `topology`'s demo workers and a gateway over them on a manual
/// clock ([`l4_gateway_config`] with `adjust`), runs `test` against it, and
/// stops the gateway and the workers whatever happened (the workers also
/// when the gateway does not start); `test`'s error before theirs.
pub fn run_gateway<T>(
    topology: &Topology,
    adjust: impl FnOnce(&mut GatewayConfig, &mut L4Config),
    test: impl FnOnce(&Running) -> Result<T>,
) -> Result<T> {
    let runtimes = topology.runtimes()?;
    let workers = runtimes.start_workers()?;
    let urls: Vec<String> = workers.iter().map(MockWorker::url).collect();
    let config = l4_gateway_config(&urls, topology.layout, adjust);
    let clock = Arc::new(ManualClock::new());
    let started = runtimes
        .balancer
        .run(Gateway::start_with_clock(config, clock.clone()))
        .and_then(|gw| gw)
        .context("starting the gateway");
    let gw = match started {
        Ok(gw) => gw,
        Err(error) => {
            if let Err(stopping) = runtimes.stop_workers(workers.into_iter().enumerate()) {
                eprintln!("cleanup: {stopping:#}");
            }
            return Err(error);
        }
    };
    let outcome = test(&Running {
        driver: Driver::new(&runtimes.balancer, &gw, &urls),
        workers: &workers,
        clock: &clock,
    });
    let stopped = runtimes.shutdown(Some(gw), workers.into_iter().enumerate());
    let value = outcome?;
    stopped?;
    Ok(value)
}

pub struct Scenario<'a> {
    /// Where clients connect from.
    pub client_ns: &'a str,
    pub vip: SocketAddr,
    /// The gateway, on its runtime in the balancer's namespace.
    pub driver: Driver<'a>,
    pub workers: &'a [MockWorker],
    pub clock: &'a ManualClock,
}

impl<'a> Scenario<'a> {
    /// The scenario from `topology`'s client to its service.
    pub fn new(
        topology: &'a Topology,
        driver: Driver<'a>,
        workers: &'a [MockWorker],
        clock: &'a ManualClock,
    ) -> Self {
        Self {
            client_ns: topology.client(),
            vip: topology.layout.vip(),
            driver,
            workers,
            clock,
        }
    }

    pub fn run(&self) -> Result<()> {
        self.driver.ready(BOUND)?;
        let got = self.connections()?;
        eprintln!("all routable: {got:?}");
        for (i, &n) in got.iter().enumerate() {
            ensure!(
                n >= CONNECTIONS / 5,
                "worker {i} got {n} of {CONNECTIONS}: {got:?}"
            );
        }
        self.breaker_isolates_b().context("breaker")?;
        self.health_isolates_b().context("health")?;
        self.metrics_show_l4()
    }

    fn breaker_isolates_b(&self) -> Result<()> {
        self.breaker_holds_b_back(
            || {
                // Only the breaker holds B back once this returns.
                let (sent, delay) = self.driver.isolate(B, &self.workers[B], BOUND)?;
                eprintln!(
                    "breaker opened after {sent} L7 requests; kernel isolated B {delay:?} later"
                );
                Ok(())
            },
            || {
                self.clock.advance(Duration::from_secs(CB_TIMEOUT_SECS + 1));
                Ok(())
            },
        )
    }

    /// B's breaker opened by `open` (which returns once the kernel has B
    /// isolated), and let go by `release` (after which B's next L7 requests
    /// are its trial): while open, B gets no new connection through the
    /// service and keeps its established one; closed again by one good
    /// trial, it gets its share again.
    pub fn breaker_holds_b_back(
        &self,
        open: impl FnOnce() -> Result<()>,
        release: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut long = self.long_lived_on_b()?;
        open()?;
        self.b_gets_nothing_but_keeps_its_connection(&mut long)?;
        release()?;
        self.driver.chat_until(B, State::Closed)?;
        self.driver
            .wait_kernel_state(B, BackendState::Routable, BOUND)?;
        self.b_gets_some_again()
    }

    fn health_isolates_b(&self) -> Result<()> {
        let mut long = self.long_lived_on_b()?;
        self.workers[B].set_fault(Fault {
            health_status: Some(503),
            ..Fault::default()
        });
        wait("B demoted", BOUND, || {
            Ok(self.driver.worker(B)?.health() == Health::NotReady)
        })?;
        self.driver
            .wait_kernel_state(B, BackendState::Isolated, BOUND)?;
        self.b_gets_nothing_but_keeps_its_connection(&mut long)?;
        self.workers[B].clear_fault();
        wait("B promoted", BOUND, || {
            Ok(self.driver.worker(B)?.health() == Health::Ready)
        })?;
        self.driver
            .wait_kernel_state(B, BackendState::Routable, BOUND)?;
        self.b_gets_some_again()
    }

    fn b_gets_nothing_but_keeps_its_connection(&self, long: &mut TcpStream) -> Result<()> {
        let before = self.counters();
        let got = self.connections()?;
        eprintln!("B isolated: {got:?}");
        ensure!(
            got[B] == 0,
            "B got {} new connections while isolated: {got:?}",
            got[B]
        );
        ensure!(
            self.counters()[B] == before[B],
            "B's own counter moved while isolated"
        );
        let answer = http1::chat(long, false).context("the long-lived connection to B")?;
        ensure!(
            answer == self.answer_of(B),
            "the long-lived connection got {answer:?}"
        );
        ensure!(
            self.counters()[B] == before[B] + 1,
            "B did not serve the long-lived connection"
        );
        Ok(())
    }

    fn b_gets_some_again(&self) -> Result<()> {
        let got = self.connections()?;
        eprintln!("B routable again: {got:?}");
        ensure!(
            got[B] >= CONNECTIONS / 5,
            "B got only {} new connections after recovering: {got:?}",
            got[B]
        );
        Ok(())
    }

    fn metrics_show_l4(&self) -> Result<()> {
        let url = self.workers[B].url();
        let metrics = self.driver.metrics()?;
        ensure!(metrics.worker_counter("connections", &url)? > 0.0);
        ensure!(metrics.outcome("new_flow")? > 0.0);
        // Open, half-open: at least two transitions changed B's bit.
        ensure!(
            metrics.get("balancer_dataplane_sync_seconds_count")? >= 2.0,
            "sync histogram"
        );
        ensure!(metrics.worker_state(&url)? == 1.0);
        Ok(())
    }

    fn counters(&self) -> Vec<u64> {
        self.workers
            .iter()
            .map(|w| w.stats().inference_requests)
            .collect()
    }

    fn answer_of(&self, i: usize) -> Answer {
        Answer {
            status: 200,
            worker: self.workers[i].name().to_owned(),
        }
    }

    /// New connections to the service from the client namespace, as
    /// counted per worker by the answers, which must agree with the
    /// workers' own counters.
    fn connections(&self) -> Result<Vec<usize>> {
        let before = self.counters();
        let vip = self.vip;
        let answers = netns::run_in(self.client_ns, BOUND, move || {
            http1::new_connections(vip, CONNECTIONS)
        })??;
        let mut got = vec![0; self.workers.len()];
        for answer in &answers {
            let i = (0..self.workers.len())
                .find(|&i| *answer == self.answer_of(i))
                .with_context(|| format!("unexpected answer {answer:?}"))?;
            got[i] += 1;
        }
        let after = self.counters();
        for i in 0..got.len() {
            ensure!(
                after[i] - before[i] == got[i] as u64,
                "worker {i} counted {} requests, answers say {}",
                after[i] - before[i],
                got[i]
            );
        }
        Ok(got)
    }

    /// A keep-alive connection through the service that landed on B.
    fn long_lived_on_b(&self) -> Result<TcpStream> {
        let (vip, b) = (self.vip, self.answer_of(B));
        netns::run_in(self.client_ns, BOUND, move || -> Result<TcpStream> {
            for _ in 0..100 {
                let mut stream = http1::connect(vip)?;
                if http1::chat(&mut stream, false)? == b {
                    return Ok(stream);
                }
            }
            bail!("100 connections and none went to B")
        })?
    }
}

// ---------------------------------------------------------------------------
// Driving a running gateway.

/// A running gateway as a test drives it from outside its namespace.
#[derive(Clone, Copy)]
pub struct Driver<'a> {
    /// The runtime the gateway runs on, in the balancer's namespace.
    pub balancer: &'a NsRuntime,
    pub gw: &'a Gateway,
    /// The workers' URLs, in the order the test numbers them.
    pub urls: &'a [String],
}

impl<'a> Driver<'a> {
    pub fn new(balancer: &'a NsRuntime, gw: &'a Gateway, urls: &'a [String]) -> Self {
        Self { balancer, gw, urls }
    }

    /// Worker `i` as the gateway's registry holds it.
    pub fn worker(&self, i: usize) -> Result<Arc<Worker>> {
        self.gw
            .registry
            .fleet()
            .get(&self.urls[i])
            .cloned()
            .with_context(|| format!("worker {i} is not registered"))
    }

    /// The state the kernel's map holds for `worker`.
    pub fn kernel_state(&self, worker: &Worker) -> Result<Option<BackendState>> {
        let steering = self.gw.steering().context("no dataplane")?;
        Ok(steering.backend_state(worker)?)
    }

    /// Waits at most `bound` until the kernel's map holds `state` for
    /// worker `i`.
    pub fn wait_kernel_state(&self, i: usize, state: BackendState, bound: Duration) -> Result<()> {
        let worker = self.worker(i)?;
        wait(
            &format!("worker {i} {} in the kernel", state.name()),
            bound,
            || Ok(self.kernel_state(&worker)? == Some(state)),
        )
    }

    /// Waits (each step at most `bound`) until the gateway knows every
    /// worker's models and the kernel has every worker routable.
    pub fn ready(&self, bound: Duration) -> Result<()> {
        wait("models learned", bound, || {
            Ok(self
                .gw
                .registry
                .fleet()
                .workers
                .iter()
                .all(|w| !w.models().is_empty()))
        })?;
        for i in 0..self.urls.len() {
            self.wait_kernel_state(i, BackendState::Routable, bound)?;
        }
        Ok(())
    }

    /// One chat completion through the L7 gateway; its status.
    pub fn chat(&self) -> Result<u16> {
        let uri = format!("http://{}/v1/chat/completions", self.gw.addr);
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

    /// The body of a `GET` of `uri` from the balancer's namespace.
    pub fn get(&self, uri: String) -> Result<String> {
        self.balancer.run(async move {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let response = tokio::time::timeout(BOUND, client.get(uri.parse()?)).await??;
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, anyhow::Error>(String::from_utf8_lossy(&body).into_owned())
        })?
    }

    /// The gateway's metrics, as exposed.
    pub fn metrics(&self) -> Result<Metrics> {
        self.get(format!("http://{}/metrics", self.gw.metrics_addr))
            .map(Metrics)
    }

    /// Real L7 requests through the gateway until worker `i`'s breaker
    /// reaches `state` (at most 60); returns how many it took.
    pub fn chat_until(&self, i: usize, state: State) -> Result<usize> {
        let worker = self.worker(i)?;
        let mut sent = 0;
        while worker.breaker.state() != state {
            ensure!(
                sent < 60,
                "worker {i}'s breaker still {:?} after {sent} requests",
                worker.breaker.state()
            );
            self.chat()?;
            sent += 1;
        }
        Ok(sent)
    }

    /// Opens worker `i`'s breaker with real L7 failures (`mock` answers
    /// 500 meanwhile), clears the fault (only the breaker holds the worker
    /// back then) and waits at most `bound` until the kernel has it
    /// isolated. Returns the requests it took and how long the kernel took
    /// after the breaker opened.
    pub fn isolate(
        &self,
        i: usize,
        mock: &MockWorker,
        bound: Duration,
    ) -> Result<(usize, Duration)> {
        mock.set_fault(Fault {
            status: Some(500),
            ..Fault::default()
        });
        let opened = self.chat_until(i, State::Open);
        mock.clear_fault();
        let sent = opened?;
        let start = Instant::now();
        self.wait_kernel_state(i, BackendState::Isolated, bound)?;
        Ok((sent, start.elapsed()))
    }
}

/// One scrape of the gateway's metrics.
pub struct Metrics(pub String);

impl Metrics {
    /// The value of one series (name and labels as exposed).
    pub fn get(&self, series: &str) -> Result<f64> {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .with_context(|| format!("no {series} in the metrics"))
    }

    /// Packets of one L4 outcome.
    pub fn outcome(&self, name: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_l4_outcome_packets_total{{outcome=\"{name}\"}}"
        ))
    }

    /// One of a worker's L4 counters (`balancer_l4_worker_<what>_total`).
    pub fn worker_counter(&self, what: &str, url: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_l4_worker_{what}_total{{worker=\"{url}\"}}"
        ))
    }

    /// The state the kernel holds for a worker, as a number.
    pub fn worker_state(&self, url: &str) -> Result<f64> {
        self.get(&format!("balancer_l4_worker_state{{worker=\"{url}\"}}"))
    }

    /// A worker's handshakes of one outcome.
    pub fn handshakes(&self, url: &str, outcome: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_l4_worker_handshakes_total{{worker=\"{url}\",outcome=\"{outcome}\"}}"
        ))
    }

    /// A worker's breaker failures of one reason.
    pub fn cb_failures(&self, url: &str, reason: &str) -> Result<f64> {
        self.get(&format!(
            "balancer_worker_cb_failures_total{{worker=\"{url}\",reason=\"{reason}\"}}"
        ))
    }

    /// The L4 outcomes that moved since `earlier`, for messages.
    pub fn outcomes_since(&self, earlier: &Metrics) -> Result<String> {
        let names = [
            "new_flow",
            "established",
            "reply",
            "promoted",
            "recovered",
            "peer_restored",
            "rst_ignored",
            "conntrack_full",
            "unresolved",
            "no_backend",
            "not_service",
        ];
        Ok(self.moved_since(earlier, &names, Self::outcome)?.join(", "))
    }

    /// A worker's handshake counters that moved since `earlier`, for the
    /// log.
    pub fn handshakes_since(&self, earlier: &Metrics, url: &str) -> Result<String> {
        let names = ["forwarded", "established", "refused", "timeout", "reset"];
        let moved = self.moved_since(earlier, &names, |m, outcome| m.handshakes(url, outcome))?;
        if moved.is_empty() {
            return Ok("none moved".to_owned());
        }
        Ok(moved.join(", "))
    }

    /// `<name> +<delta>` for each of `names` whose `value` moved since
    /// `earlier`.
    fn moved_since(
        &self,
        earlier: &Metrics,
        names: &[&str],
        value: impl Fn(&Metrics, &str) -> Result<f64>,
    ) -> Result<Vec<String>> {
        let mut moved = Vec::new();
        for name in names {
            let delta = value(self, name)? - value(earlier, name)?;
            if delta != 0.0 {
                moved.push(format!("{name} +{delta}"));
            }
        }
        Ok(moved)
    }
}

// ---------------------------------------------------------------------------
// Keep-alive connections held on their workers.

/// Which of `workers` gave `answer`; it must be a success.
pub fn served_by(workers: &[MockWorker], answer: &Answer) -> Result<usize> {
    ensure!(answer.status == 200, "answer {answer:?}");
    workers
        .iter()
        .position(|w| w.name() == answer.worker)
        .with_context(|| format!("unexpected answer {answer:?}"))
}

/// `count` keep-alive connections to `vip` opened from namespace `ns`
/// (within `bound`), one request on each: the connections, and which of
/// `workers` answered on each.
pub fn long_lived(
    ns: &str,
    vip: SocketAddr,
    count: usize,
    workers: &[MockWorker],
    bound: Duration,
) -> Result<(Vec<TcpStream>, Vec<usize>)> {
    let mut long = netns::run_in(ns, bound, move || -> Result<Vec<TcpStream>> {
        (0..count).map(|_| http1::connect(vip)).collect()
    })??;
    let mut served = Vec::new();
    for (i, stream) in long.iter_mut().enumerate() {
        let answer = http1::chat(stream, false).with_context(|| format!("connection {i}"))?;
        served.push(served_by(workers, &answer).with_context(|| format!("connection {i}"))?);
    }
    Ok((long, served))
}

/// One more request on each of the [`long_lived`] connections, each of
/// which must be answered by the worker it started on (`served`).
pub fn still_served(
    long: &mut [TcpStream],
    served: &[usize],
    workers: &[MockWorker],
    when: &str,
) -> Result<()> {
    for (i, stream) in long.iter_mut().enumerate() {
        let answer = http1::chat(stream, false)
            .with_context(|| format!("long-lived connection {i} (worker {}) {when}", served[i]))?;
        let now = served_by(workers, &answer)?;
        ensure!(
            now == served[i],
            "long-lived connection {i} moved from worker {} to worker {now} {when}",
            served[i]
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// New connections.

/// New connections to a service, one request on each (`Connection:
/// close`), with timeouts short enough for a test to count the ones that
/// fail.
#[derive(Clone, Copy, Debug)]
pub struct NewConnections {
    pub vip: SocketAddr,
    /// How long a handshake may take.
    pub connect_timeout: Duration,
    /// How long a read or a write may take.
    pub io_timeout: Duration,
}

/// What one new connection with one request did.
pub enum Attempt {
    /// Answered 200 by this worker.
    Answered(String),
    /// The handshake got a reset.
    Refused,
    /// The handshake got no answer within the connect timeout.
    TimedOut,
    Failed(String),
}

impl NewConnections {
    /// One new connection, from the caller's namespace.
    pub fn attempt(self) -> Attempt {
        let vip = self.vip;
        let mut stream = match TcpStream::connect_timeout(&vip, self.connect_timeout) {
            Ok(stream) => stream,
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => return Attempt::Refused,
            Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => {
                return Attempt::TimedOut;
            }
            Err(e) => return Attempt::Failed(format!("connecting to {vip}: {e}")),
        };
        let timeouts = stream
            .set_read_timeout(Some(self.io_timeout))
            .and_then(|()| stream.set_write_timeout(Some(self.io_timeout)));
        if let Err(e) = timeouts {
            return Attempt::Failed(format!("socket timeouts: {e}"));
        }
        match http1::chat(&mut stream, true) {
            Ok(answer) if answer.status == 200 => Attempt::Answered(answer.worker),
            Ok(answer) => Attempt::Failed(format!("answer {answer:?}")),
            Err(e) => Attempt::Failed(format!("{e:#}")),
        }
    }

    /// `count` new connections one after the other, from the caller's
    /// namespace; stops early once more than `limit` failed by a margin
    /// (past the limit the caller fails anyway: no need to wait for every
    /// remaining timeout).
    pub fn tally(self, count: usize, limit: usize) -> Tally {
        let mut tally = Tally::default();
        for _ in 0..count {
            if tally.failed > limit + 3 {
                break;
            }
            tally.add(self.attempt());
        }
        tally
    }

    /// `clients` threads in namespace `ns`, each opening new connections
    /// one after the other until the load is finished (or dropped), for at
    /// most `bound`.
    pub fn load(self, ns: &str, clients: usize, bound: Duration) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let threads = (0..clients)
            .map(|_| {
                let (stop, tally, ns) = (stop.clone(), tally.clone(), ns.to_owned());
                std::thread::spawn(move || {
                    netns::run_in(&ns, bound, move || {
                        while !stop.load(Ordering::Relaxed) {
                            let outcome = self.attempt();
                            lock(&tally).add(outcome);
                        }
                    })
                })
            })
            .collect();
        Load {
            stop,
            tally,
            threads,
        }
    }
}

/// Outcomes of new connections.
#[derive(Default)]
pub struct Tally {
    pub by_worker: BTreeMap<String, usize>,
    pub refused: usize,
    pub timed_out: usize,
    /// Failures of every kind, refused and timed out included.
    pub failed: usize,
    pub first_refused: Option<Instant>,
    errors: Vec<String>,
}

impl Tally {
    pub fn add(&mut self, attempt: Attempt) {
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

    /// The answered ones.
    pub fn ok(&self) -> usize {
        self.by_worker.values().sum()
    }

    pub fn total(&self) -> usize {
        self.ok() + self.failed
    }

    /// The ones the worker of that name answered.
    pub fn of(&self, worker: &str) -> usize {
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

/// Clients opening new connections ([`NewConnections::load`]).
pub struct Load {
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    threads: Vec<std::thread::JoinHandle<Result<()>>>,
}

impl Load {
    /// When the first connection was refused, if one was.
    pub fn first_refused(&self) -> Option<Instant> {
        lock(&self.tally).first_refused
    }

    /// Stops the clients; what their connections did.
    pub fn finish(mut self) -> Result<Tally> {
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// Bounded polling.

/// Polls `done` every millisecond for at most `bound`: when it first held,
/// or `None`.
pub fn poll_until(
    bound: Duration,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<Option<Instant>> {
    let deadline = Instant::now() + bound;
    loop {
        if done()? {
            return Ok(Some(Instant::now()));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits at most `bound` until `done` holds; the error names `what`.
pub fn wait(what: &str, bound: Duration, done: impl FnMut() -> Result<bool>) -> Result<()> {
    poll_until(bound, done)?
        .map(drop)
        .with_context(|| format!("timed out after {bound:?} waiting for: {what}"))
}

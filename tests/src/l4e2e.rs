//! The namespace scenario both forwarding modes must pass: connections to
//! the service spread over three workers; worker B isolated by real L7
//! failures (its breaker) and then by failing health checks, each time
//! getting no new connection while an established one keeps working, and
//! getting new ones again once it recovers.

use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
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
use balancer_dataplane::steering::{ForwardMode, L4Config};
use balancer_mock_worker::{Fault, MockWorker};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::http1::{self, Answer};
use crate::netns;
use crate::ns_runtime::NsRuntime;

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
/// failures and closes after one good trial, fast health checks, the
/// workers at `urls`, every listener on a free loopback port.
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
    config.health = HealthThresholds {
        failure: 2,
        success: 2,
    };
    config
}

/// The L4 part of the scenario's gateway: `services` steered over the
/// workers from `ifaces` in `mode`.
pub fn l4_config(ifaces: Vec<String>, mode: ForwardMode, services: Vec<SocketAddrV4>) -> L4Config {
    L4Config {
        ifaces,
        xdp_mode: XdpMode::Auto,
        mode,
        services,
        table_size: 1009,
        conntrack_size: 65536,
        // Nothing pinned: the test's datapath goes with its gateway.
        bpffs_dir: None,
        detach_on_exit: true,
        signal_interval: std::time::Duration::from_millis(100),
    }
}

pub struct Scenario<'a> {
    /// Where clients connect from.
    pub client_ns: &'a str,
    pub vip: SocketAddr,
    /// The runtime the gateway runs on, in the balancer's namespace.
    pub balancer: &'a NsRuntime,
    pub gw: &'a Gateway,
    pub workers: &'a [MockWorker],
    pub clock: &'a ManualClock,
}

impl Scenario<'_> {
    pub fn run(&self) -> Result<()> {
        self.wait("models learned", || {
            Ok(self
                .gw
                .registry
                .fleet()
                .workers
                .iter()
                .all(|w| !w.models().is_empty()))
        })?;
        for i in 0..self.workers.len() {
            self.wait_kernel_state(i, BackendState::Routable)?;
        }
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

    /// Real L7 requests through the gateway until B's breaker reaches
    /// `state`; returns how many it took.
    fn chat_until_b_is(&self, state: State) -> Result<usize> {
        let mut sent = 0;
        while self.worker(B)?.breaker.state() != state {
            ensure!(
                sent < 60,
                "B's breaker still {:?} after {sent} requests",
                self.worker(B)?.breaker.state()
            );
            self.gateway_chat()?;
            sent += 1;
        }
        Ok(sent)
    }

    fn breaker_isolates_b(&self) -> Result<()> {
        let mut long = self.long_lived_on_b()?;
        self.workers[B].set_fault(Fault {
            status: Some(500),
            ..Fault::default()
        });
        let sent = self.chat_until_b_is(State::Open)?;
        let opened = Instant::now();
        self.wait_kernel_state(B, BackendState::Isolated)?;
        eprintln!(
            "breaker opened after {sent} L7 requests; kernel isolated B {:?} later",
            opened.elapsed()
        );
        // Only the breaker holds B back from here on.
        self.workers[B].clear_fault();
        self.b_gets_nothing_but_keeps_its_connection(&mut long)?;

        self.clock.advance(Duration::from_secs(CB_TIMEOUT_SECS + 1));
        self.chat_until_b_is(State::Closed)?;
        self.wait_kernel_state(B, BackendState::Routable)?;
        self.b_gets_some_again()
    }

    fn health_isolates_b(&self) -> Result<()> {
        let mut long = self.long_lived_on_b()?;
        self.workers[B].set_fault(Fault {
            health_status: Some(503),
            ..Fault::default()
        });
        self.wait("B demoted", || {
            Ok(self.worker(B)?.health() == Health::NotReady)
        })?;
        self.wait_kernel_state(B, BackendState::Isolated)?;
        self.b_gets_nothing_but_keeps_its_connection(&mut long)?;
        self.workers[B].clear_fault();
        self.wait("B promoted", || {
            Ok(self.worker(B)?.health() == Health::Ready)
        })?;
        self.wait_kernel_state(B, BackendState::Routable)?;
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
        let connections = format!("balancer_l4_worker_connections_total{{worker=\"{url}\"}}");
        ensure!(self.metric(&connections)? > 0.0);
        ensure!(self.metric("balancer_l4_outcome_packets_total{outcome=\"new_flow\"}")? > 0.0);
        // Open, half-open: at least two transitions changed B's bit.
        ensure!(
            self.metric("balancer_dataplane_sync_seconds_count")? >= 2.0,
            "sync histogram"
        );
        let state = format!("balancer_l4_worker_state{{worker=\"{url}\"}}");
        ensure!(self.metric(&state)? == 1.0);
        Ok(())
    }

    /// The value of one series (name and labels as exposed) on the
    /// gateway's metrics endpoint.
    pub fn metric(&self, series: &str) -> Result<f64> {
        let text = self.get(format!("http://{}/metrics", self.gw.metrics_addr))?;
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .with_context(|| format!("no {series} in the metrics"))
    }

    fn worker(&self, i: usize) -> Result<Arc<Worker>> {
        self.gw
            .registry
            .fleet()
            .get(&self.workers[i].url())
            .cloned()
            .with_context(|| format!("worker {i} is not registered"))
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

    /// One chat completion through the L7 gateway.
    fn gateway_chat(&self) -> Result<u16> {
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

    fn get(&self, uri: String) -> Result<String> {
        self.balancer.run(async move {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let response = tokio::time::timeout(BOUND, client.get(uri.parse()?)).await??;
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, anyhow::Error>(String::from_utf8_lossy(&body).into_owned())
        })?
    }

    /// Waits until the kernel's map holds `state` for worker `i`.
    fn wait_kernel_state(&self, i: usize, state: BackendState) -> Result<()> {
        let steering = self.gw.steering().context("no dataplane")?;
        let worker = self.worker(i)?;
        self.wait(
            &format!("worker {i} {} in the kernel", state.name()),
            || Ok(steering.backend_state(&worker)? == Some(state)),
        )
    }

    fn wait(&self, what: &str, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
        let deadline = Instant::now() + BOUND;
        while !done()? {
            if Instant::now() > deadline {
                bail!("timed out waiting for: {what}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

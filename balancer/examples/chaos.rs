//! A bounded chaos run against three demo workers behind the gateway
//! (`cargo xtask chaos`): one turns slow (every 20th response takes 5 s
//! longer), one answers 429 in bursts, one truncates streams. Prints, for each
//! fault, how long the breaker took to isolate the worker and how many client
//! requests failed, and checks that the 429 worker was never isolated.
//!
//! The gateway runs with the LLM-aware options the faults call for: a slow
//! first-byte budget and failures counted over a 10 s window.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use balancer::cli::LaunchArgs;
use balancer::gateway::Gateway;
use balancer_core::breaker::State;
use balancer_core::registry::WorkerEvent;
use balancer_mock_worker::{Fault, MockWorker, MockWorkerConfig};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const RUN: Duration = Duration::from_secs(20);
const CLIENTS: usize = 12;
const FAULTS_AT: Duration = Duration::from_secs(3);

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    failed_after_faults: AtomicU64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut workers = Vec::new();
    for name in ["slow", "pushback", "truncating"] {
        let w = MockWorker::spawn(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            MockWorkerConfig::named(name),
        )
        .await
        .context("demo worker")?;
        workers.push(w);
    }
    let mut argv: Vec<String> = [
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--admin-port",
        "0",
        "--log-level",
        "warn",
        "--policy",
        "round_robin",
        "--cb-failure-mode",
        "window",
        "--cb-window-duration-secs",
        "10",
        "--cb-window-min-calls",
        "5",
        "--cb-failure-threshold",
        "3",
        "--cb-timeout-duration-secs",
        "30",
        "--cb-slow-ttfb-ms",
        "2000",
        "--stream-idle-timeout-secs",
        "5",
        "--retry-initial-backoff-ms",
        "20",
        "--retry-max-backoff-ms",
        "200",
        "--disable-health-check",
        "--worker-urls",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend(workers.iter().map(MockWorker::url));
    let args = LaunchArgs::parse_with_config(argv.into_iter().map(Into::into).collect())?;
    let gateway = Gateway::start(args.to_config()?).await?;
    let url = format!("http://{}/v1/chat/completions", gateway.addr);

    // Timestamp every breaker opening as it happens.
    let mut events = gateway.registry.subscribe();
    let started = Instant::now();
    let opened = Arc::new(std::sync::Mutex::new(Vec::<(String, Duration)>::new()));
    let recorder = {
        let opened = opened.clone();
        tokio::spawn(async move {
            while let Ok(event) = events.recv().await {
                if let WorkerEvent::Breaker(w, t) = event
                    && t.to == State::Open
                {
                    opened
                        .lock()
                        .unwrap()
                        .push((w.url.to_string(), started.elapsed()));
                }
            }
        })
    };

    let tally = Arc::new(Tally::default());
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut load = Vec::new();
    for c in 0..CLIENTS {
        let (client, url, tally) = (client.clone(), url.clone(), tally.clone());
        load.push(tokio::spawn(async move {
            let mut n = 0u64;
            while started.elapsed() < RUN {
                n += 1;
                let stream = (n + c as u64).is_multiple_of(2);
                let body = format!(
                    r#"{{"model":"demo-model","stream":{stream},"max_tokens":8,"messages":[{{"role":"user","content":"hi"}}]}}"#
                );
                let req = http::Request::post(&url)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .expect("valid request");
                let ok = match tokio::time::timeout(Duration::from_secs(15), client.request(req)).await {
                    Ok(Ok(resp)) if resp.status().is_success() => {
                        match tokio::time::timeout(Duration::from_secs(15), resp.into_body().collect()).await {
                            Ok(Ok(b)) => {
                                let b = b.to_bytes();
                                !stream || b.ends_with(b"data: [DONE]\n\n")
                            }
                            _ => false,
                        }
                    }
                    _ => false,
                };
                if ok {
                    tally.ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    tally.failed.fetch_add(1, Ordering::Relaxed);
                    if started.elapsed() >= FAULTS_AT {
                        tally.failed_after_faults.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    tokio::time::sleep(FAULTS_AT).await;
    let fault_time = started.elapsed();
    workers[0].set_fault(Fault {
        latency_ms: Some(5000),
        every: Some(20),
        ..Fault::default()
    });
    workers[2].set_fault(Fault {
        truncate_after_chunks: Some(3),
        every: Some(2),
        ..Fault::default()
    });
    // 429 in bursts: 40 pushbacks, a pause, again, until the run ends.
    let pushback = tokio::spawn({
        let w = workers[1].url();
        let client = client.clone();
        async move {
            while started.elapsed() < RUN {
                let fault = r#"{"status":429,"count":40,"retry_after":1}"#;
                let req = http::Request::post(format!("{w}/_mock/fault"))
                    .body(Full::new(Bytes::from(fault)))
                    .expect("valid request");
                let _ = client.request(req).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    });
    for l in load {
        l.join_handle_or_abort().await;
    }
    pushback.abort();
    recorder.abort();

    let opened = opened.lock().unwrap().clone();
    let first_open = |w: &MockWorker| {
        opened
            .iter()
            .find(|(u, _)| *u == w.url())
            .map(|(_, at)| at.saturating_sub(fault_time))
    };
    let faults = [
        ("slow: every 20th response +5 s", &workers[0]),
        ("429 in bursts", &workers[1]),
        ("truncated streams (every 2nd)", &workers[2]),
    ];
    println!(
        "\nchaos run: {} s, {CLIENTS} clients, faults injected at {:.1} s",
        RUN.as_secs(),
        fault_time.as_secs_f64()
    );
    println!(
        "{:<34} {:>22} {:>10} {:>10}",
        "fault", "isolated after", "requests", "opens"
    );
    for (name, w) in faults {
        let isolated =
            first_open(w).map_or("never".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()));
        let opens = opened.iter().filter(|(u, _)| *u == w.url()).count();
        println!(
            "{name:<34} {isolated:>22} {:>10} {opens:>10}",
            w.stats().inference_requests
        );
    }
    let (ok, failed, after) = (
        tally.ok.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
        tally.failed_after_faults.load(Ordering::Relaxed),
    );
    println!("client requests: {ok} ok, {failed} failed ({after} after the faults began)");
    let pushback_isolated = first_open(&workers[1]).is_some();
    println!(
        "429 worker isolated: {}",
        if pushback_isolated {
            "YES (wrong)"
        } else {
            "never (correct)"
        }
    );
    gateway.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
    if pushback_isolated {
        bail!("the 429 worker was isolated: pushback must not trip the breaker");
    }
    Ok(())
}

trait JoinOrAbort {
    async fn join_handle_or_abort(self);
}

impl JoinOrAbort for tokio::task::JoinHandle<()> {
    async fn join_handle_or_abort(self) {
        let abort = self.abort_handle();
        if tokio::time::timeout(RUN + Duration::from_secs(20), self)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
}

//! A bounded chaos run (`cargo xtask chaos`): five demo workers behind the
//! gateway, one healthy and four given the faults of the LLM breaker
//! document, each into its own worker: latency (every 20th response 5 s
//! late), short answers (every second completion empty), truncated streams
//! (every second request cut after 3 chunks: the streams among them break
//! off), and 429s in bursts. Prints, per fault, how long the breaker took to
//! isolate the worker and how many client requests it failed.
//!
//! By default the gateway runs with the options each fault calls for
//! (`--cb-slow-ttfb-ms`, `--cb-min-completion-tokens`, `--cb-stream-failures`,
//! failures counted over a 10 s window), and the run fails (exit status 1)
//! when a fault worker is not isolated within 15 s of its fault, when the
//! 429 worker is isolated, or when more client requests fail than
//! [`failure_bound`]. With `--defaults` it runs the same faults under the
//! default breaker flags (the gateway document's semantics) and only prints
//! what they catch.
//!
//! It owns nothing but this run: every worker and the gateway are in this
//! process, all traffic is on loopback, and every loop is bounded by [`RUN`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use balancer::cli::LaunchArgs;
use balancer::gateway::Gateway;
use balancer_core::breaker::State;
use balancer_core::registry::WorkerEvent;
use balancer_mock_worker::{Fault, MockWorker, MockWorkerConfig, WORKER_HEADER};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// How long the clients send.
const RUN: Duration = Duration::from_secs(20);
const CLIENTS: usize = 12;
/// When the faults begin: the breakers have seen healthy traffic by then.
const FAULTS_AT: Duration = Duration::from_secs(3);
/// The document's test: a fault not isolated within this is missed.
const ISOLATION_BUDGET: Duration = Duration::from_secs(15);
/// A client's patience for a head, and again for a body.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);
/// `--cb-failure-threshold` of the run with options.
const FAILURE_THRESHOLD: u64 = 3;

/// The workers, in order: the healthy one first, then one per fault.
const WORKERS: [&str; 5] = ["steady", "slow", "short", "truncating", "pushback"];

/// Client requests the run may fail. Only the short-answer and the
/// truncated-stream faults fail a client request (a late answer still
/// arrives within the client's 15 s; a 429 is retried on another worker).
/// Each of those two workers fails at most the `FAILURE_THRESHOLD`
/// requests its breaker needs to see, plus, at the moment it opens, one
/// request in flight per client (the floor: those were already on the
/// worker and are answered by it).
fn failure_bound() -> u64 {
    2 * (FAILURE_THRESHOLD + CLIENTS as u64)
}

/// Client requests per serving worker (by its `x-mock-worker` name; the
/// last slot for answers no worker gave).
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: [AtomicU64; WORKERS.len() + 1],
}

impl Tally {
    fn fail(&self, worker: Option<&str>) {
        let slot = worker
            .and_then(|w| WORKERS.iter().position(|n| *n == w))
            .unwrap_or(WORKERS.len());
        self.failed[slot].fetch_add(1, Ordering::Relaxed);
    }

    fn failed(&self, slot: usize) -> u64 {
        self.failed[slot].load(Ordering::Relaxed)
    }

    fn failed_total(&self) -> u64 {
        (0..self.failed.len()).map(|s| self.failed(s)).sum()
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let defaults = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--defaults") => true,
        Some(other) => bail!("unknown argument {other:?} (only --defaults)"),
    };
    let mut workers = Vec::new();
    for name in WORKERS {
        let w = MockWorker::spawn(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            MockWorkerConfig::named(name),
        )
        .await
        .context("demo worker")?;
        workers.push(w);
    }
    // What bounds the run, in both modes: no semantics of the breaker.
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
        "--stream-idle-timeout-secs",
        "5",
        "--retry-initial-backoff-ms",
        "20",
        "--retry-max-backoff-ms",
        "200",
        "--disable-health-check",
    ]
    .map(str::to_owned)
    .to_vec();
    let threshold = FAILURE_THRESHOLD.to_string();
    let options = [
        "--cb-failure-mode",
        "window",
        "--cb-window-duration-secs",
        "10",
        "--cb-window-min-calls",
        "5",
        "--cb-failure-threshold",
        &threshold,
        "--cb-timeout-duration-secs",
        "30",
        "--cb-slow-ttfb-ms",
        "2000",
        "--cb-min-completion-tokens",
        "1",
        "--cb-stream-failures",
    ];
    if !defaults {
        argv.extend(options.map(str::to_owned));
    }
    argv.push("--worker-urls".to_owned());
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
                        .expect("not poisoned")
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
                match ask(&client, req, stream).await {
                    Ok(()) => {
                        tally.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(worker) => tally.fail(worker.as_deref()),
                }
            }
        }));
    }

    tokio::time::sleep(FAULTS_AT).await;
    let fault_time = started.elapsed();
    workers[1].set_fault(Fault {
        latency_ms: Some(5000),
        every: Some(20),
        ..Fault::default()
    });
    workers[2].set_fault(Fault {
        completion_tokens: Some(0),
        every: Some(2),
        ..Fault::default()
    });
    workers[3].set_fault(Fault {
        truncate_after_chunks: Some(3),
        every: Some(2),
        ..Fault::default()
    });
    // 429 in bursts: 40 pushbacks, a pause, again, until the run ends.
    let pushback = tokio::spawn({
        let w = workers[4].url();
        let client = client.clone();
        async move {
            while started.elapsed() < RUN {
                let fault = r#"{"status":429,"count":40,"retry_after":1}"#;
                let req = http::Request::post(format!("{w}/_mock/fault"))
                    .body(Full::new(Bytes::from(fault)))
                    .expect("valid request");
                let _ = tokio::time::timeout(CLIENT_TIMEOUT, client.request(req)).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    });
    for l in load {
        l.join_handle_or_abort().await;
    }
    pushback.abort();
    recorder.abort();

    let opened = opened.lock().expect("not poisoned").clone();
    let first_open = |w: &MockWorker| {
        opened
            .iter()
            .find(|(u, _)| *u == w.url())
            .map(|(_, at)| at.saturating_sub(fault_time))
    };
    // (what, worker, whether the run with options must isolate it)
    let faults = [
        ("latency: every 20th response +5 s", 1, true),
        ("short answers: every 2nd completion empty", 2, true),
        ("truncated streams: every 2nd request cut", 3, true),
        ("429 bursts: 40 at a time, every 2 s", 4, false),
        ("none (the healthy worker)", 0, false),
    ];
    println!(
        "\nchaos run{}: {} s, {CLIENTS} clients, faults injected at {:.1} s",
        if defaults {
            " with the default breaker flags"
        } else {
            ""
        },
        RUN.as_secs(),
        fault_time.as_secs_f64()
    );
    println!("\n| fault | isolated after | client requests failed | requests served |");
    println!("|---|---|---|---|");
    let mut problems = Vec::new();
    for (name, i, must_isolate) in faults {
        let w = &workers[i];
        let isolated = first_open(w);
        let shown = isolated.map_or("never".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()));
        println!(
            "| {name} | {shown} | {} | {} |",
            tally.failed(i),
            w.stats().inference_requests
        );
        match (must_isolate, isolated) {
            (true, Some(d)) if d <= ISOLATION_BUDGET => {}
            (true, _) => problems.push(format!(
                "{name}: not isolated within {} s of the fault",
                ISOLATION_BUDGET.as_secs()
            )),
            (false, Some(_)) => problems.push(format!("{name}: isolated, and must not be")),
            (false, None) => {}
        }
    }
    let (ok, failed) = (tally.ok.load(Ordering::Relaxed), tally.failed_total());
    println!(
        "\nclient requests: {ok} ok, {failed} failed ({} answered by the gateway itself)",
        tally.failed(WORKERS.len())
    );
    if failed > failure_bound() {
        problems.push(format!(
            "{failed} client requests failed, more than the bound of {}",
            failure_bound()
        ));
    }
    gateway.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
    if defaults {
        // What the run with options would refuse, shown, not enforced.
        println!("not a failure with the default flags; the run with options would fail on:");
        for p in &problems {
            println!("  {p}");
        }
        return Ok(());
    }
    println!(
        "expected: the three faults isolated within {} s, the 429 and healthy workers never, \
         at most {} client requests failed",
        ISOLATION_BUDGET.as_secs(),
        failure_bound()
    );
    if !problems.is_empty() {
        bail!("the chaos run failed:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// One request, read to its end: `Err` with the serving worker's name
/// (when one answered) if the client did not get a whole, non-empty answer.
async fn ask(
    client: &Client<HttpConnector, Full<Bytes>>,
    req: http::Request<Full<Bytes>>,
    stream: bool,
) -> Result<(), Option<String>> {
    let resp = match tokio::time::timeout(CLIENT_TIMEOUT, client.request(req)).await {
        Ok(Ok(resp)) => resp,
        _ => return Err(None),
    };
    let worker = resp
        .headers()
        .get(WORKER_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if !resp.status().is_success() {
        return Err(worker);
    }
    let body = match tokio::time::timeout(CLIENT_TIMEOUT, resp.into_body().collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        _ => return Err(worker),
    };
    if answered(&body, stream) {
        Ok(())
    } else {
        Err(worker)
    }
}

/// Whether a body is a whole completion with some text in it: a stream
/// that ends with `[DONE]` and has a non-empty delta, or a JSON completion
/// whose message is not empty.
fn answered(body: &[u8], stream: bool) -> bool {
    let content = |v: &serde_json::Value, at: &str| {
        v.pointer(at)
            .and_then(serde_json::Value::as_str)
            .is_some_and(|s| !s.is_empty())
    };
    if !stream {
        return serde_json::from_slice::<serde_json::Value>(body)
            .is_ok_and(|v| content(&v, "/choices/0/message/content"));
    }
    body.ends_with(b"data: [DONE]\n\n")
        && body
            .split(|&b| b == b'\n')
            .filter_map(|line| line.strip_prefix(b"data: "))
            .filter_map(|data| serde_json::from_slice::<serde_json::Value>(data).ok())
            .any(|v| content(&v, "/choices/0/delta/content"))
}

trait JoinOrAbort {
    async fn join_handle_or_abort(self);
}

impl JoinOrAbort for tokio::task::JoinHandle<()> {
    async fn join_handle_or_abort(self) {
        let abort = self.abort_handle();
        if tokio::time::timeout(RUN + 2 * CLIENT_TIMEOUT, self)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
}

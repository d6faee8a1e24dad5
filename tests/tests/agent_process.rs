//! The agent as an operator runs it: the real `balancer` binary, its every
//! log line and its exit status. Credentials in worker URLs never reach the
//! output; SIGTERM drains and a second SIGTERM stops at once. Each test
//! stops what it started (the agent by PID, demo workers in-process).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use balancer_mock_worker::{Fault, MockWorker, MockWorkerConfig};
use balancer_tests::agent::{AgentProcess, get};
use balancer_tests::balancer_binary;

const SECRET: &str = "s3cret";
const CHAT: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#;

async fn demo(name: &str) -> MockWorker {
    MockWorker::spawn(([127, 0, 0, 1], 0).into(), MockWorkerConfig::named(name))
        .await
        .unwrap()
}

/// `check` within `limit`, tried every 50 ms (blocking: the agent is
/// another process, the demo workers run on the runtime's other threads).
fn within(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends a chat completion on a new connection and returns it unread, so
/// the request stays in flight for as long as its worker takes.
fn send_chat(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{CHAT}",
        CHAT.len()
    )
    .unwrap();
    stream
}

/// The status line of what `stream` answered (until the server closes).
fn status_of(mut stream: TcpStream) -> String {
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.lines().next().unwrap_or_default().to_owned()
}

fn ready(agent: &AgentProcess, worker: &MockWorker) -> bool {
    let series = format!("balancer_worker_health{{worker=\"{}\"}} 1", worker.url());
    agent.metrics().is_ok_and(|m| m.contains(&series))
}

/// The JSON log events (`--log-json`) whose message contains `what`.
fn events(lines: &[String], what: &str) -> Vec<serde_json::Value> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(what))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_url_credentials_never_reach_the_output() {
    let binary = balancer_binary("--worker-urls").unwrap();
    let worker = demo("a").await;
    let with_secret = worker
        .url()
        .replacen("http://", &format!("http://alice:{SECRET}@"), 1);
    // Debug: every line the agent can print about a worker.
    let agent = AgentProcess::launch(
        &binary,
        &["--worker-urls", &with_secret, "--log-level", "debug"],
    )
    .unwrap();
    within(Duration::from_secs(10), "worker ready", || {
        ready(&agent, &worker)
    });
    assert!(status_of(send_chat(agent.addr)).contains(" 200 "));
    let metrics = agent.metrics().unwrap();
    let workers = get(agent.admin_addr, "/workers").unwrap();
    for (what, text) in [("metrics", &metrics), ("admin API", &workers)] {
        assert!(!text.contains(SECRET), "{what}: {text}");
    }
    agent.signal("TERM").unwrap();
    let (status, lines) = agent.wait(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}");
    let leaked: Vec<_> = lines.iter().filter(|l| l.contains(SECRET)).collect();
    assert!(leaked.is_empty(), "{leaked:#?}");
    // The static worker's key is logged, without its credentials.
    let shown = worker.url().replacen("http://", "http://***@", 1);
    assert!(
        lines.iter().any(|l| l.contains(&shown)),
        "no line shows {shown}: {lines:#?}"
    );

    // Refused URLs are named without their credentials too.
    for args in [
        vec![
            "launch",
            "--worker-urls",
            "http://alice:s3cret@127.0.0.1:1/v1",
        ],
        vec![
            "register",
            "--etcd-endpoints",
            "http://127.0.0.1:1",
            "--id",
            "a",
            "--model",
            "m",
            "--url",
            "ftp://alice:s3cret@127.0.0.1:1",
        ],
    ] {
        let refused = AgentProcess::spawn(&binary, &args).unwrap();
        let (status, lines) = refused.wait(Duration::from_secs(10)).unwrap();
        assert!(!status.success(), "{args:?} started");
        let flag = if args[0] == "launch" {
            "--worker-urls"
        } else {
            "--url"
        };
        assert!(
            lines.iter().any(|l| l.contains(flag) && l.contains("***@")),
            "{lines:#?}"
        );
        let leaked: Vec<_> = lines.iter().filter(|l| l.contains(SECRET)).collect();
        assert!(leaked.is_empty(), "{args:?}: {leaked:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_during_the_drain_stops_at_once_with_status_143() {
    let binary = balancer_binary("--shutdown-grace-period-secs").unwrap();
    let worker = demo("a").await;
    let agent = AgentProcess::launch(
        &binary,
        &[
            "--worker-urls",
            &worker.url(),
            "--shutdown-grace-period-secs",
            "60",
            "--log-json",
        ],
    )
    .unwrap();
    within(Duration::from_secs(10), "worker ready", || {
        ready(&agent, &worker)
    });
    // A request that would take 30 s, far past this test's bounds.
    worker.set_fault(Fault {
        latency_ms: Some(30_000),
        ..Default::default()
    });
    let slow = send_chat(agent.addr);
    let inflight = format!(
        "balancer_worker_requests_inflight{{worker=\"{}\"}} 1",
        worker.url()
    );
    within(Duration::from_secs(5), "the request in flight", || {
        agent.metrics().is_ok_and(|m| m.contains(&inflight))
    });

    agent.signal("TERM").unwrap();
    within(Duration::from_secs(5), "the drain logged", || {
        !events(&agent.lines(), "shutting down").is_empty()
    });
    let started = events(&agent.lines(), "shutting down").remove(0);
    assert_eq!(started["fields"]["in_flight"], 1, "{started}");
    assert_eq!(started["fields"]["deadline_secs"], 60, "{started}");
    assert_eq!(started["fields"]["signal"], "SIGTERM", "{started}");

    let second = Instant::now();
    agent.signal("TERM").unwrap();
    let (status, lines) = agent.wait(Duration::from_secs(5)).unwrap();
    assert!(second.elapsed() < Duration::from_secs(3), "stopped at once");
    assert_eq!(status.code(), Some(128 + 15), "{status}: {lines:#?}");
    let forced = events(&lines, "second signal");
    assert_eq!(forced.len(), 1, "{lines:#?}");
    assert_eq!(forced[0]["fields"]["abandoned"], 1);
    // The client sees its connection cut, not an answer.
    assert!(!status_of(slow).contains(" 200 "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sigint_with_nothing_in_flight_drains_and_exits_0() {
    let binary = balancer_binary("--shutdown-grace-period-secs").unwrap();
    let worker = demo("a").await;
    let agent =
        AgentProcess::launch(&binary, &["--worker-urls", &worker.url(), "--log-json"]).unwrap();
    agent.signal("INT").unwrap();
    let (status, lines) = agent.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(status.code(), Some(0), "{lines:#?}");
    let started = events(&lines, "shutting down");
    assert_eq!(started.len(), 1, "{lines:#?}");
    assert_eq!(started[0]["fields"]["in_flight"], 0);
    assert_eq!(started[0]["fields"]["deadline_secs"], 180, "the default");
    assert!(events(&lines, "second signal").is_empty());
}

/// `systemctl reload` without TLS: the SIGHUP is logged and changes
/// nothing (the default action of SIGHUP would end the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_without_tls_changes_nothing() {
    let binary = balancer_binary("--shutdown-grace-period-secs").unwrap();
    let worker = demo("a").await;
    let agent =
        AgentProcess::launch(&binary, &["--worker-urls", &worker.url(), "--log-json"]).unwrap();
    within(Duration::from_secs(10), "worker ready", || {
        ready(&agent, &worker)
    });
    let served = worker.stats().inference_requests;
    agent.signal("HUP").unwrap();
    within(Duration::from_secs(10), "the SIGHUP logged", || {
        !events(&agent.lines(), "SIGHUP").is_empty()
    });
    assert!(
        status_of(send_chat(agent.addr)).contains(" 200 "),
        "still serving after SIGHUP"
    );
    assert_eq!(worker.stats().inference_requests, served + 1);
    assert!(ready(&agent, &worker), "the worker kept its state");
    agent.signal("TERM").unwrap();
    let (status, lines) = agent.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(status.code(), Some(0), "{lines:#?}");
    let hups = events(&lines, "SIGHUP");
    assert_eq!(hups.len(), 1, "{lines:#?}");
    assert!(
        hups[0]["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("nothing to reload")),
        "{hups:#?}"
    );
}

//! End-to-end tests of what `balancer launch` logs, read from the process's
//! own output as an operator reads the journal: a breaker opening says why
//! and when the trial comes, a health demotion says what the probe found,
//! `--access-log` writes a line per request, in plain text without colour or
//! as JSON with `--log-json`. Every process is killed when its test ends, and every wait
//! is bounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use balancer_mock_worker::{Fault, MockWorker, MockWorkerConfig};
use balancer_tests::balancer_binary;

const BOUND: Duration = Duration::from_secs(10);

/// A `balancer launch` process (killed on drop) and its stdout, line by line.
struct Agent {
    child: Child,
    lines: Receiver<String>,
    port: u16,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Agent {
    fn start(args: &[&str]) -> Result<Self> {
        let binary = balancer_binary("--route-undeclared-models")?;
        let port = free_port()?;
        let mut child = Command::new(binary)
            .arg("launch")
            .args(["--port", &port.to_string()])
            .args(["--prometheus-port", &free_port()?.to_string()])
            .args(["--admin-port", &free_port()?.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting balancer launch")?;
        let stdout = child.stdout.take().context("stdout")?;
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Ok(Self { child, lines, port })
    }

    /// The first line (within [`BOUND`]) that contains every one of `parts`.
    fn line_with(&self, parts: &[&str]) -> Result<String> {
        let deadline = Instant::now() + BOUND;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .with_context(|| format!("no log line with {parts:?} in {BOUND:?}"))?;
            if parts.iter().all(|p| line.contains(p)) {
                return Ok(line);
            }
        }
    }

    /// `request` (whole, `connection: close`) sent to the agent; the answer.
    fn exchange(&self, request: &str) -> Option<String> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
        s.set_read_timeout(Some(BOUND)).ok()?;
        s.write_all(request.as_bytes()).ok()?;
        let mut got = String::new();
        s.read_to_string(&mut got).ok()?;
        Some(got)
    }

    /// Waits until the agent serves and knows the demo worker's model.
    fn wait_for_model(&self) -> Result<()> {
        let models = "GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        let deadline = Instant::now() + BOUND;
        while !self
            .exchange(models)
            .is_some_and(|a| a.contains("demo-model"))
        {
            ensure!(Instant::now() < deadline, "the model was not learned");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn chat(&self) -> Option<String> {
        self.chat_with("")
    }

    /// A chat request with `extra` header lines.
    fn chat_with(&self, extra: &str) -> Option<String> {
        let body = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#;
        self.exchange(&format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{extra}\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ))
    }
}

async fn worker() -> Result<MockWorker> {
    Ok(MockWorker::spawn(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        MockWorkerConfig::named("a"),
    )
    .await?)
}

/// Fails its chats with 500 until its breaker opens; the opening line.
async fn open_a_breaker(extra: &[&str]) -> Result<(String, String)> {
    let worker = worker().await?;
    let url = worker.url();
    let mut args = vec![
        "--worker-urls",
        &url,
        "--cb-failure-threshold",
        "2",
        "--cb-timeout-duration-secs",
        "7",
        "--retry-max-retries",
        "0",
    ];
    args.extend(extra);
    let agent = Agent::start(&args)?;
    agent.wait_for_model()?;
    worker.set_fault(Fault {
        status: Some(500),
        ..Fault::default()
    });
    for _ in 0..2 {
        let answer = agent.chat().context("no answer")?;
        ensure!(answer.starts_with("HTTP/1.1 500"), "{answer}");
    }
    let line = agent.line_with(&["circuit breaker opened"])?;
    drop(agent);
    worker.shutdown().await;
    Ok((line, url))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breaker_opening_says_why_and_when_the_trial_comes() -> Result<()> {
    let (line, url) = open_a_breaker(&[]).await?;
    for part in [
        &format!("worker={url}") as &str,
        "failures=2",
        "last_failure=status 500",
        "trial=in 7 s",
        "WARN",
    ] {
        ensure!(line.contains(part), "no {part:?} in {line}");
    }
    ensure!(!line.contains('\x1b'), "colour codes in a pipe: {line:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_log_json_the_opening_is_a_json_line_with_its_fields() -> Result<()> {
    let (line, url) = open_a_breaker(&["--log-json"]).await?;
    let event: serde_json::Value = serde_json::from_str(&line).context(line.clone())?;
    let fields = &event["fields"];
    ensure!(fields["worker"] == url.as_str(), "{line}");
    ensure!(fields["failures"] == 2, "{line}");
    ensure!(fields["last_failure"] == "status 500", "{line}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_demotion_says_what_the_probe_found() -> Result<()> {
    let failing = worker().await?;
    failing.set_fault(Fault {
        health_status: Some(503),
        ..Fault::default()
    });
    // Nothing listens on a port just freed.
    let absent = format!("http://127.0.0.1:{}", free_port()?);
    let failing_url = failing.url();
    let agent = Agent::start(&[
        "--worker-urls",
        &failing_url,
        &absent,
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
    ])?;
    let demoted = [
        agent.line_with(&["worker demoted to not_ready"])?,
        agent.line_with(&["worker demoted to not_ready"])?,
    ];
    let of = |url: &str| {
        demoted
            .iter()
            .find(|l| l.contains(&format!("worker={url} ")))
            .cloned()
            .unwrap_or_default()
    };
    ensure!(of(&failing_url).contains("probe=status 503"), "{demoted:?}");
    ensure!(
        of(&absent).contains("probe=connection refused"),
        "{demoted:?}"
    );
    drop(agent);
    failing.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_a_line_per_request_with_its_fields() -> Result<()> {
    let worker = worker().await?;
    let url = worker.url();
    let agent = Agent::start(&["--worker-urls", &url, "--access-log"])?;
    agent.wait_for_model()?;
    let answer = agent
        .chat_with("x-request-id: rid-42\r\n")
        .context("no answer")?;
    ensure!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let line = agent.line_with(&["request_id=rid-42"])?;
    for part in [
        "access:",
        "method=POST",
        "path=/v1/chat/completions",
        "model=demo-model",
        "status=200",
        &format!("worker={url}") as &str,
        "attempts=1",
        "ttfb_ms=",
        "duration_ms=",
        "complete=true",
    ] {
        ensure!(line.contains(part), "no {part:?} in {line}");
    }
    drop(agent);
    worker.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_log_json_the_access_line_is_json_and_without_the_flag_there_is_none() -> Result<()> {
    let worker = worker().await?;
    let url = worker.url();
    let agent = Agent::start(&["--worker-urls", &url, "--access-log", "--log-json"])?;
    agent.wait_for_model()?;
    agent
        .chat_with("x-request-id: rid-7\r\n")
        .context("no answer")?;
    let line = agent.line_with(&["rid-7"])?;
    let event: serde_json::Value = serde_json::from_str(&line).context(line.clone())?;
    ensure!(event["target"] == "access", "{line}");
    let fields = &event["fields"];
    ensure!(
        fields["status"] == 200 && fields["worker"] == url.as_str(),
        "{line}"
    );
    ensure!(
        fields["model"] == "demo-model" && fields["attempts"] == 1,
        "{line}"
    );
    drop(agent);

    // Off by default: the /v1/models polls and the chat log nothing.
    let mut agent = Agent::start(&["--worker-urls", &url])?;
    agent.wait_for_model()?;
    agent
        .chat_with("x-request-id: rid-8\r\n")
        .context("no answer")?;
    // Its output ends with it: every line it wrote, then the end.
    agent.child.kill()?;
    agent.child.wait()?;
    let logged: Vec<String> = agent.lines.iter().collect();
    ensure!(!logged.is_empty(), "the agent logged its start");
    ensure!(!logged.iter().any(|l| l.contains("access")), "{logged:?}");
    worker.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_names_its_worker() -> Result<()> {
    let worker = worker().await?;
    let url = worker.url();
    let agent = Agent::start(&["--worker-urls", &url])?;
    agent.wait_for_model()?;
    worker.set_fault(Fault {
        truncate_after_chunks: Some(2),
        ..Fault::default()
    });
    let body =
        r#"{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    agent.exchange(&format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    ));
    let line = agent.line_with(&["upstream stream cut"])?;
    ensure!(line.contains(&format!("worker={url}")), "{line}");
    drop(agent);
    worker.shutdown().await;
    Ok(())
}

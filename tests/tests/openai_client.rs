//! The official `openai` Python client through the gateway.
//!
//! It is what most users will point at the gateway, and it is stricter than
//! the hand-written checks in gateway.rs about what it parses: the JSON
//! shapes, SSE framing, `[DONE]`, usage in the final chunk.
//!
//! The client is pip-installed once into a venv under target/tmp and reused.
//! Without a python3 that can make a venv the test is skipped, or fails when
//! the environment variable CI is set.

use std::fs::{self, File, TryLockError};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use balancer::config::GatewayConfig;
use balancer::gateway::Gateway;
use balancer::tls::ServingTlsConfig;
use balancer_mock_worker::{MockWorker, MockWorkerConfig};
use balancer_tests::tls::{Ca, Leaf, Scratch};
use serde_json::Value;
use tokio::process::Command;
use tokio::time::Instant;

const VENV_WITHIN: Duration = Duration::from_secs(60);
const PIP_WITHIN: Duration = Duration::from_secs(180);
const SCRIPT_WITHIN: Duration = Duration::from_secs(60);
/// Long enough for another run holding the lock to finish an install.
const LOCK_WITHIN: Duration = Duration::from_secs(60 + 180 + 30);
const BOUND: Duration = Duration::from_secs(10);

/// Run as `python -c SCRIPT BASE_URL [CA_FILE]`; prints one JSON line for
/// the Rust side to check the exact values. With a CA file the client
/// trusts that CA alone (HTTPS).
const SCRIPT: &str = r#"
import json, sys
import openai

tls = {"http_client": openai.DefaultHttpxClient(verify=sys.argv[2])} if len(sys.argv) > 2 else {}
client = openai.OpenAI(base_url=sys.argv[1], api_key="x", max_retries=0, timeout=20.0, **tls)
messages = [{"role": "user", "content": "hi"}]

reply = client.chat.completions.create(model="demo-model", messages=messages, max_tokens=5)
choice = reply.choices[0]
assert choice.message.content, reply
assert choice.finish_reason, reply
assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0, reply.usage

stream = client.chat.completions.create(
    model="demo-model",
    messages=messages,
    max_tokens=4,
    stream=True,
    stream_options={"include_usage": True},
)
deltas, finish, usage, chunks = [], None, None, 0
for chunk in stream:
    chunks += 1
    for c in chunk.choices:
        if c.delta.content:
            deltas.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
    if chunk.usage:
        usage = chunk.usage
assert deltas, "no content deltas"
assert finish, "no finish_reason in any chunk"
assert usage is not None and usage.completion_tokens > 0, usage

print(json.dumps({
    "openai_version": openai.__version__,
    "role": choice.message.role,
    "content": choice.message.content,
    "finish_reason": choice.finish_reason,
    "usage": reply.usage.model_dump(),
    "stream_chunks": chunks,
    "stream_content": "".join(deltas),
    "stream_finish_reason": finish,
    "stream_usage": usage.model_dump(),
}))
"#;

#[tokio::test]
async fn openai_client_completes_and_streams_through_the_gateway() {
    completes_and_streams(None).await;
}

#[tokio::test]
async fn openai_client_completes_and_streams_over_https() {
    let dir = Scratch::new("openai").expect("scratch dir");
    let ca = Ca::new(&dir, "edge").expect("CA");
    let leaf = ca
        .issue(&dir, "gateway", &["127.0.0.1", "localhost"])
        .expect("certificate");
    completes_and_streams(Some((&ca, &leaf))).await;
}

/// The client's checks through a gateway before two demo workers, over
/// HTTPS with `tls` (the CA the client trusts, the gateway's certificate).
async fn completes_and_streams(tls: Option<(&Ca, &Leaf)>) {
    let Some(python) = client_python().await else {
        return;
    };

    let mut workers = Vec::new();
    for name in ["a", "b"] {
        let worker = MockWorker::spawn(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            MockWorkerConfig::named(name),
        )
        .await
        .expect("mock worker");
        workers.push(worker);
    }
    let urls: Vec<String> = workers.iter().map(MockWorker::url).collect();
    let mut config = GatewayConfig::with_worker_urls(&urls);
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.metrics_listen = config.listen;
    config.admin_listen = config.listen;
    config.health_check.enabled = false;
    config.tls = tls.map(|(_, leaf)| ServingTlsConfig {
        cert_path: leaf.cert.clone(),
        key_path: leaf.key.clone(),
        client_ca_path: None,
        watch_interval: None,
    });
    let gw = Gateway::start(config).await.expect("gateway starts");

    // Requests for "demo-model" are routed once the workers' /v1/models
    // answers are in, which the gateway fetches in the background.
    let deadline = Instant::now() + BOUND;
    while !gw
        .registry
        .fleet()
        .workers
        .iter()
        .all(|w| !w.models().is_empty())
    {
        assert!(Instant::now() < deadline, "models were not learned");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    workers.iter().for_each(MockWorker::reset);

    let mut script = Command::new(&python);
    script.arg("-c").arg(SCRIPT);
    match tls {
        Some((ca, _)) => script.arg(format!("https://{}/v1", gw.addr)).arg(&ca.pem),
        None => script.arg(format!("http://{}/v1", gw.addr)),
    };
    let output = bounded(&mut script, SCRIPT_WITHIN)
        .await
        .expect("the client script runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "client script failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    let line = stdout.lines().last().unwrap_or_default();
    let result: Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}\n{stderr}"));
    eprintln!("openai {}", result["openai_version"]);

    // The demo worker's text is deterministic, so the tokens can be checked
    // exactly, and max_tokens below the default ends both with "length".
    assert_eq!(result["role"], "assistant", "{result}");
    assert_eq!(result["content"], "Lorem ipsum dolor sit amet", "{result}");
    assert_eq!(result["finish_reason"], "length", "{result}");
    assert_usage(&result["usage"], 5);
    assert_eq!(result["stream_chunks"], 4, "{result}");
    assert_eq!(
        result["stream_content"], "Lorem ipsum dolor sit",
        "{result}"
    );
    assert_eq!(result["stream_finish_reason"], "length", "{result}");
    assert_usage(&result["stream_usage"], 4);

    // With retries off in the client, exactly two requests reached workers.
    let served: u64 = workers.iter().map(|w| w.stats().inference_requests).sum();
    assert_eq!(served, 2);

    gw.shutdown().await;
}

fn assert_usage(usage: &Value, completion_tokens: u64) {
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(prompt > 0, "{usage}");
    assert_eq!(usage["completion_tokens"], completion_tokens, "{usage}");
    assert_eq!(usage["total_tokens"], prompt + completion_tokens, "{usage}");
}

/// The venv's python with `openai` installed, or `None` after saying why the
/// test is skipped.
async fn client_python() -> Option<PathBuf> {
    if let Err(why) = venv_prerequisites().await {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set and the openai client cannot be installed: {why}"
        );
        eprintln!("\n*** SKIPPED: {why} ***\n");
        return None;
    }
    Some(install_client().await)
}

async fn venv_prerequisites() -> Result<(), String> {
    // Debian's python3 has no ensurepip without python3-venv, and `venv`
    // then fails half-way through.
    let output = bounded(
        Command::new("python3").args(["-c", "import venv, ensurepip"]),
        VENV_WITHIN,
    )
    .await
    .map_err(|e| format!("python3 cannot be run: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "python3 cannot create virtualenvs (Debian: apt-get install python3-venv): {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(())
}

/// Creates the shared venv unless an earlier run finished it. Runs of this
/// test in other processes (other people's, in the same target dir) take
/// turns through a file lock, and a marker written last tells a finished
/// venv from one that a killed run left half-made.
async fn install_client() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let venv = tmp.join("openai-venv");
    let python = venv.join("bin/python");
    let finished = venv.join(".openai-installed");
    fs::create_dir_all(tmp).expect("target/tmp");
    let lock = File::create(tmp.join("openai-venv.lock")).expect("lock file");
    let deadline = Instant::now() + LOCK_WITHIN;
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(TryLockError::WouldBlock) => {
                assert!(
                    Instant::now() < deadline,
                    "another run held {}/openai-venv.lock for over {LOCK_WITHIN:?}",
                    tmp.display()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(TryLockError::Error(e)) => panic!("locking the venv: {e}"),
        }
    }
    if !finished.is_file() {
        succeed(
            Command::new("python3")
                .args(["-m", "venv", "--clear"])
                .arg(&venv),
            VENV_WITHIN,
        )
        .await;
        succeed(
            Command::new(&python).args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "openai",
            ]),
            PIP_WITHIN,
        )
        .await;
        fs::write(&finished, "").expect("venv marker");
    }
    python
}

async fn succeed(command: &mut Command, limit: Duration) {
    let shown = format!("{:?}", command.as_std());
    let output = bounded(command, limit)
        .await
        .unwrap_or_else(|e| panic!("{shown}: {e}"));
    assert!(
        output.status.success(),
        "{shown} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs `command` to completion, killing it (by its PID, on drop) once
/// `limit` has passed.
async fn bounded(command: &mut Command, limit: Duration) -> io::Result<Output> {
    command.stdin(Stdio::null()).kill_on_drop(true);
    tokio::time::timeout(limit, command.output())
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no exit within {limit:?}"),
            ))
        })
}

//! End-to-end tests of `balancer launch` as a process, as an operator starts
//! it: ports another process holds, flag values refused or resolved at
//! start, config file keys refused, `--check-config`. Every process a test starts is killed when the test ends, however
//! it ends, and every wait is bounded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use balancer_mock_worker::{Fault, MockWorker, MockWorkerConfig};
use balancer_tests::balancer_binary;

const BOUND: Duration = Duration::from_secs(10);

/// A `balancer launch` process, killed on drop.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Agent {
    fn start(binary: &Path, args: &[String]) -> Result<Self> {
        let child = Command::new(binary)
            .arg("launch")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting balancer launch")?;
        Ok(Self(child))
    }

    /// Its exit status and what it wrote on stderr, once it exits within
    /// [`BOUND`]; an error if it is still running then.
    fn exit(mut self) -> Result<(ExitStatus, String)> {
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(status) = self.0.try_wait()? {
                let mut stderr = String::new();
                if let Some(mut pipe) = self.0.stderr.take() {
                    pipe.read_to_string(&mut stderr)?;
                }
                return Ok((status, stderr));
            }
            if Instant::now() > deadline {
                bail!("still running after {BOUND:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The flags of an agent on `port` (metrics and admin on free ports) in
/// front of `worker`.
fn flags(port: u16, worker: &MockWorker) -> Result<Vec<String>> {
    Ok([
        "--port",
        &port.to_string(),
        "--prometheus-port",
        &free_port()?.to_string(),
        "--admin-port",
        &free_port()?.to_string(),
        "--worker-urls",
        &worker.url(),
    ]
    .map(str::to_owned)
    .to_vec())
}

/// `request` (a whole HTTP/1.1 request, `connection: close`) sent to
/// `addr`; the whole answer.
fn exchange(addr: SocketAddr, request: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(BOUND)).ok()?;
    s.write_all(request.as_bytes()).ok()?;
    let mut got = String::new();
    s.read_to_string(&mut got).ok()?;
    Some(got)
}

/// The status line of `GET /health` on `addr`.
fn health(addr: SocketAddr) -> Option<String> {
    let got = exchange(
        addr,
        "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )?;
    got.lines().next().map(str::to_owned)
}

fn wait_serving(addr: SocketAddr, agent: &mut Agent) -> Result<()> {
    let deadline = Instant::now() + BOUND;
    while health(addr).is_none_or(|l| !l.contains(" 200 ")) {
        if let Some(status) = agent.0.try_wait()? {
            bail!("the agent exited: {status}");
        }
        ensure!(Instant::now() < deadline, "{addr} not serving in {BOUND:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

async fn worker() -> Result<MockWorker> {
    Ok(MockWorker::spawn(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        MockWorkerConfig::named("a"),
    )
    .await?)
}

#[tokio::test]
async fn a_second_agent_on_a_served_port_is_refused_naming_the_flag() -> Result<()> {
    let binary = balancer_binary("--route-undeclared-models")?;
    let worker = worker().await?;
    let port = free_port()?;
    let first_flags = flags(port, &worker)?;
    let mut first = Agent::start(&binary, &first_flags)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    wait_serving(addr, &mut first)?;

    let (status, stderr) = Agent::start(&binary, &flags(port, &worker)?)?.exit()?;
    ensure!(!status.success(), "the second agent started: {stderr}");
    let expected = format!("--port {port}: address in use by another process");
    ensure!(stderr.contains(&expected), "{stderr}");

    // The metrics port of the first, with a free public port.
    let metrics_port = &first_flags[3];
    let mut second = flags(free_port()?, &worker)?;
    second[3].clone_from(metrics_port);
    let (status, stderr) = Agent::start(&binary, &second)?.exit()?;
    ensure!(!status.success(), "the third agent started: {stderr}");
    let expected = format!("--prometheus-port {metrics_port}: address in use by another process");
    ensure!(stderr.contains(&expected), "{stderr}");

    ensure!(
        health(addr).is_some_and(|l| l.contains(" 200 ")),
        "the first agent still serves"
    );
    drop(first);
    worker.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_log_level_that_is_not_a_level_stops_the_start() -> Result<()> {
    let binary = balancer_binary("--route-undeclared-models")?;
    let worker = worker().await?;
    let mut args = flags(free_port()?, &worker)?;
    args.extend(["--log-level".to_owned(), "verbose".to_owned()]);
    let (status, stderr) = Agent::start(&binary, &args)?.exit()?;
    ensure!(!status.success(), "started with --log-level verbose");
    ensure!(
        stderr.contains("--log-level") && stderr.contains("error, warn, info, debug, trace"),
        "{stderr}"
    );
    worker.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn host_localhost_serves_on_loopback() -> Result<()> {
    let binary = balancer_binary("--route-undeclared-models")?;
    let worker = worker().await?;
    let port = free_port()?;
    let mut args = flags(port, &worker)?;
    args.extend(["--host".to_owned(), "localhost".to_owned()]);
    let mut agent = Agent::start(&binary, &args)?;
    wait_serving(SocketAddr::from(([127, 0, 0, 1], port)), &mut agent)?;
    drop(agent);
    worker.shutdown().await;
    Ok(())
}

// The demo worker answers on the runtime's other thread while this one
// waits on blocking sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_max_retries_counts_the_attempts_after_the_first() -> Result<()> {
    let binary = balancer_binary("--route-undeclared-models")?;
    let worker = worker().await?;
    let port = free_port()?;
    let mut args = flags(port, &worker)?;
    args.extend(
        [
            "--retry-max-retries",
            "1",
            "--retry-initial-backoff-ms",
            "1",
        ]
        .map(str::to_owned),
    );
    let mut agent = Agent::start(&binary, &args)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    wait_serving(addr, &mut agent)?;
    // Once the worker's model is known, only the chat reaches /v1/ there.
    let models = "GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
    let deadline = Instant::now() + BOUND;
    while !exchange(addr, models).is_some_and(|a| a.contains("demo-model")) {
        ensure!(Instant::now() < deadline, "the model was not learned");
        std::thread::sleep(Duration::from_millis(50));
    }
    worker.set_fault(Fault {
        status: Some(500),
        ..Fault::default()
    });
    let before = worker.stats().inference_requests;
    let body = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#;
    let chat = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = exchange(addr, &chat);
    ensure!(
        answer
            .as_deref()
            .is_some_and(|a| a.starts_with("HTTP/1.1 500")),
        "{answer:?}"
    );
    ensure!(
        worker.stats().inference_requests - before == 2,
        "the first attempt and one retry, not {}",
        worker.stats().inference_requests - before
    );
    drop(agent);
    worker.shutdown().await;
    Ok(())
}

/// `balancer launch ARGS` run to its exit (bounded), with RUST_BACKTRACE
/// set as a debugging operator might have it: exit code and stderr.
fn refused(args: &[&str]) -> Result<(Option<i32>, String)> {
    let binary = balancer_binary("--route-undeclared-models")?;
    let child = Command::new(binary)
        .arg("launch")
        .args(["--port", "0", "--prometheus-port", "0", "--admin-port", "0"])
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let (status, stderr) = Agent(child).exit()?;
    Ok((status.code(), stderr))
}

/// An operator's error: one line, the binary's prefix, no backtrace.
fn one_line(stderr: &str) -> Result<()> {
    ensure!(
        stderr.starts_with("balancer: error: ") && stderr.trim_end().lines().count() == 1,
        "not one line: {stderr}"
    );
    ensure!(!stderr.contains("acktrace"), "{stderr}");
    Ok(())
}

#[test]
fn a_launch_flag_error_is_clap_s_own_and_exits_2() -> Result<()> {
    let (code, stderr) = refused(&["--no-such-flag"])?;
    ensure!(code == Some(2), "exit {code:?}: {stderr}");
    ensure!(
        stderr.starts_with("error: unexpected argument '--no-such-flag' found")
            && stderr.contains("Usage: balancer launch")
            && !stderr.contains("Error:"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn a_worker_url_ending_in_v1_is_refused_with_the_fix_and_no_backtrace() -> Result<()> {
    let (code, stderr) = refused(&["--worker-urls", "http://127.0.0.1:8000/v1"])?;
    ensure!(
        code == Some(2),
        "a configuration refused: exit {code:?}: {stderr}"
    );
    one_line(&stderr)?;
    ensure!(
        stderr.contains("--worker-urls") && stderr.contains("drop the /v1"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn a_missing_tls_file_is_named_with_its_flags_once() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("balancer-absent-{}", std::process::id()));
    let path = |name: &str| dir.join(name).display().to_string();
    let (code, stderr) = refused(&[
        "--worker-urls",
        "http://127.0.0.1:8000",
        "--tls-cert-path",
        &path("cert.pem"),
        "--tls-key-path",
        &path("key.pem"),
    ])?;
    ensure!(code == Some(1), "exit {code:?}: {stderr}");
    one_line(&stderr)?;
    ensure!(
        stderr.contains("--tls-cert-path") && stderr.contains(&path("cert.pem")),
        "{stderr}"
    );
    ensure!(
        stderr.matches("No such file or directory").count() == 1,
        "the cause said twice: {stderr}"
    );

    let (code, stderr) = refused(&[
        "--worker-urls",
        "https://127.0.0.1:8000",
        "--worker-ca-path",
        &path("ca.pem"),
    ])?;
    ensure!(code == Some(1), "exit {code:?}: {stderr}");
    one_line(&stderr)?;
    ensure!(
        stderr.contains("--worker-ca-path") && stderr.contains(&path("ca.pem")),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn an_unreachable_etcd_is_logged_without_debug_structures() -> Result<()> {
    use std::io::BufRead;
    let binary = balancer_binary("--route-undeclared-models")?;
    let port = free_port()?;
    let child = Command::new(binary)
        .arg("launch")
        .args(["--port", &port.to_string()])
        .args(["--prometheus-port", &free_port()?.to_string()])
        .args(["--admin-port", &free_port()?.to_string()])
        // Nothing listens on a port just freed: connection refused.
        .args([
            "--etcd-endpoints",
            &format!("http://127.0.0.1:{}", free_port()?),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut agent = Agent(child);
    let stdout = agent.0.stdout.take().context("stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("etcd not reachable") && tx.send(line).is_err() {
                return;
            }
        }
    });
    let line = rx
        .recv_timeout(BOUND)
        .context("no 'etcd not reachable' line")?;
    drop(agent);
    ensure!(
        line.contains("Connection refused")
            && !line.contains("tonic::")
            && !line.contains("Os {")
            && !line.contains('\x1b'),
        "{line}"
    );
    Ok(())
}

/// `balancer launch --check-config ARGS` with `file` as `--config`: exit
/// code, stdout, stderr.
fn check_config(file: &str, args: &[&str]) -> Result<(Option<i32>, String, String)> {
    check_config_with(file, args, &[])
}

/// [`check_config`] with `env` set.
fn check_config_with(
    file: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<(Option<i32>, String, String)> {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let binary = balancer_binary("--check-config")?;
    let dir = std::env::temp_dir().join(format!("balancer-check-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("balancer.toml"), file)?;
    let out = Command::new(binary)
        .current_dir(&dir)
        .args(["launch", "--check-config", "--config", "balancer.toml"])
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .output();
    std::fs::remove_dir_all(&dir)?;
    let out = out?;
    Ok((
        out.status.code(),
        String::from_utf8(out.stdout)?,
        String::from_utf8(out.stderr)?,
    ))
}

#[test]
fn check_config_says_ok_and_binds_nothing() -> Result<()> {
    let port = free_port()?;
    // The port is held: a start would fail, a check does not bind it.
    let _held = TcpListener::bind(("127.0.0.1", port))?;
    let file = format!(
        "port = {port}\nadmin_token = \"-abc\"\nadmin_host = \"0.0.0.0\"\n\
         policy = \"least_load\"\n[[workers]]\nurl = \"http://127.0.0.1:8000\"\n"
    );
    let (code, stdout, stderr) = check_config(&file, &["--worker-urls", "http://127.0.0.1:8001"])?;
    ensure!(code == Some(0), "exit {code:?}: {stderr}");
    ensure!(
        stdout == "balancer: configuration OK (2 workers, policy least_load)\n",
        "{stdout:?}"
    );
    Ok(())
}

#[test]
fn check_config_refuses_a_bad_key_naming_the_file_and_exits_2() -> Result<()> {
    for (file, expected) in [
        (
            "disable_retries = \"yes\"\n",
            "balancer: error: balancer.toml: key 'disable_retries': expected a boolean, found string \"yes\"\n",
        ),
        (
            "port = \"abc\"\n",
            "balancer: error: balancer.toml: key 'port': invalid value 'abc': invalid digit found in string\n",
        ),
        (
            "prot = 1\n",
            "balancer: error: balancer.toml: unknown key 'prot' (did you mean 'port'?)\n",
        ),
    ] {
        let (code, stdout, stderr) = check_config(file, &[])?;
        ensure!(code == Some(2), "{file}: exit {code:?}: {stderr}");
        ensure!(stdout.is_empty() && stderr == expected, "{file}: {stderr}");
    }
    // A check of what only a start would see: the TLS files.
    let (code, _, stderr) = check_config(
        "tls_cert_path = \"/nonexistent/cert.pem\"\ntls_key_path = \"/nonexistent/key.pem\"\n",
        &[],
    )?;
    ensure!(code == Some(2), "exit {code:?}: {stderr}");
    one_line(&stderr)?;
    ensure!(stderr.contains("/nonexistent/cert.pem"), "{stderr}");
    // And, with L4 on, the eBPF object (found, not loaded).
    let (code, _, stderr) = check_config_with(
        "xdp_iface = [\"lo\"]\nl4_service = [\"10.0.0.1:80\"]\n",
        &[],
        &[("BALANCER_EBPF_OBJECT", "/nonexistent/balancer-ebpf")],
    )?;
    ensure!(code == Some(2), "exit {code:?}: {stderr}");
    one_line(&stderr)?;
    ensure!(
        stderr.contains("--xdp-iface") && stderr.contains("/nonexistent/balancer-ebpf"),
        "{stderr}"
    );
    Ok(())
}

/// `GET /workers` on the admin API at `addr` with `token`: the status line.
fn admin_status(addr: SocketAddr, token: &str) -> Option<String> {
    let answer = exchange(
        addr,
        &format!(
            "GET /workers HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n\
             connection: close\r\n\r\n"
        ),
    )?;
    answer.lines().next().map(str::to_owned)
}

#[tokio::test]
async fn the_environment_s_admin_token_wins_over_the_file_s() -> Result<()> {
    let binary = balancer_binary("--check-config")?;
    let worker = worker().await?;
    let port = free_port()?;
    let args = flags(port, &worker)?;
    let admin = SocketAddr::from(([127, 0, 0, 1], args[5].parse::<u16>()?));
    let file = std::env::temp_dir().join(format!("balancer-env-token-{}.toml", std::process::id()));
    std::fs::write(&file, "admin_token = \"from-file\"\n")?;
    let child = Command::new(binary)
        .arg("launch")
        .args(&args)
        .arg("--config")
        .arg(&file)
        .env("BALANCER_ADMIN_TOKEN", "from-env")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let mut agent = Agent(child?);
    let serving = wait_serving(SocketAddr::from(([127, 0, 0, 1], port)), &mut agent);
    std::fs::remove_file(&file)?;
    serving?;
    let with_env = admin_status(admin, "from-env");
    let with_file = admin_status(admin, "from-file");
    drop(agent);
    worker.shutdown().await;
    ensure!(
        with_env.as_deref().is_some_and(|l| l.contains(" 200 ")),
        "{with_env:?}"
    );
    ensure!(
        with_file.as_deref().is_some_and(|l| l.contains(" 401 ")),
        "{with_file:?}"
    );
    Ok(())
}

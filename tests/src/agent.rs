//! The `balancer` binary as a process of its own, for tests of what only the
//! real binary shows: its log lines, its signal handling and its exit
//! status. Every line it prints (stdout and stderr) is kept; the process is
//! stopped by its PID when dropped. Never asserts: it returns what it saw.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How long a started agent may take to listen, and a plain request or a
/// wait for its exit to answer.
const BOUND: Duration = Duration::from_secs(10);

/// A running `balancer` process.
pub struct AgentProcess {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    /// The public port, with [`AgentProcess::launch`].
    pub addr: SocketAddr,
    /// The metrics port, with [`AgentProcess::launch`].
    pub metrics_addr: SocketAddr,
    /// The admin API, with [`AgentProcess::launch`].
    pub admin_addr: SocketAddr,
}

/// A port free on loopback now.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl AgentProcess {
    /// `balancer <args>` with its output kept (any subcommand).
    pub fn spawn(binary: &Path, args: &[&str]) -> Result<Self> {
        Self::spawn_with(binary, args, None)
    }

    /// `balancer launch` on free loopback ports (public, metrics, admin),
    /// then `args`; returns once its metrics answer.
    pub fn launch(binary: &Path, args: &[&str]) -> Result<Self> {
        let (port, metrics, admin) = (free_port()?, free_port()?, free_port()?);
        let ports = [
            "launch".to_owned(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--prometheus-host".into(),
            "127.0.0.1".into(),
            "--prometheus-port".into(),
            metrics.to_string(),
            "--admin-port".into(),
            admin.to_string(),
        ];
        let mut all: Vec<&str> = ports.iter().map(String::as_str).collect();
        all.extend_from_slice(args);
        let agent = Self::spawn_with(binary, &all, Some([port, metrics, admin]))?;
        let deadline = Instant::now() + BOUND;
        while agent.metrics().is_err() {
            if Instant::now() > deadline {
                bail!(
                    "the agent did not serve its metrics within {BOUND:?}; it printed:\n{}",
                    agent.lines().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(agent)
    }

    fn spawn_with(binary: &Path, args: &[&str], ports: Option<[u16; 3]>) -> Result<Self> {
        let mut child = Command::new(binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} {}", binary.display(), args.join(" ")))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().context("stdout")?;
        let stderr = child.stderr.take().context("stderr")?;
        let readers = vec![keep(stdout, lines.clone()), keep(stderr, lines.clone())];
        let [port, metrics, admin] = ports.unwrap_or_default();
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Ok(Self {
            child,
            lines,
            readers,
            addr: loopback(port),
            metrics_addr: loopback(metrics),
            admin_addr: loopback(admin),
        })
    }

    /// Every line printed so far, both streams, in arrival order.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The process id, for signals.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`TERM`, `INT`, ...) with kill(1).
    pub fn signal(&self, signal: &str) -> Result<()> {
        let status = Command::new("kill")
            .args(["-s", signal, &self.pid().to_string()])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -s {signal} {} failed ({status})", self.pid());
        }
        Ok(())
    }

    /// Its exit status once it exits within `limit`, and every line it
    /// printed (read to the end).
    pub fn wait(mut self, limit: Duration) -> Result<(ExitStatus, Vec<String>)> {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() > deadline {
                bail!(
                    "still running after {limit:?}; it printed:\n{}",
                    self.lines().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for reader in std::mem::take(&mut self.readers) {
            let _ = reader.join();
        }
        Ok((status, self.lines()))
    }

    /// `GET /metrics`, the body.
    pub fn metrics(&self) -> Result<String> {
        get(self.metrics_addr, "/metrics")
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A thread that appends each line of `stream` to `lines`.
fn keep(
    stream: impl Read + Send + 'static,
    lines: Arc<Mutex<Vec<String>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { return };
            lines.lock().unwrap().push(line);
        }
    })
}

/// A plain `GET path` on a fresh connection; the body of a 200.
pub fn get(addr: SocketAddr, path: &str) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, BOUND)?;
    stream.set_read_timeout(Some(BOUND))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").context("no end of head")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {head}");
    }
    Ok(body.to_owned())
}

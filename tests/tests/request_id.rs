//! End-to-end: the request id of `--request-id-headers` goes from the client
//! to the worker and back, and a request without one gets one made by the
//! gateway, the same on both sides. The worker is a bare listener that
//! records the request heads it gets. Every process and thread a test starts
//! ends with it, and every wait is bounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use balancer_tests::balancer_binary;

const BOUND: Duration = Duration::from_secs(10);

/// A worker that answers `{}` to everything and keeps every request head.
struct Recorder {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let heads = Arc::new(Mutex::new(Vec::new()));
        let kept = heads.clone();
        // Ends with the test process; it only ever answers loopback.
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let kept = kept.clone();
                std::thread::spawn(move || serve(stream, &kept));
            }
        });
        Ok(Self { addr, heads })
    }

    /// The head of the latest chat completion request it got.
    fn chat_head(&self) -> Result<String> {
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(head) = self
                .heads
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find(|h| h.starts_with("post /v1/chat/completions"))
            {
                return Ok(head.clone());
            }
            ensure!(
                Instant::now() < deadline,
                "no chat request reached the worker"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Keep-alive HTTP/1.1: each request's head is recorded, its body skipped.
fn serve(stream: TcpStream, heads: &Mutex<Vec<String>>) {
    let _ = stream.set_read_timeout(Some(BOUND));
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        let length = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<u64>().ok())?
            })
            .unwrap_or(0);
        if std::io::copy(&mut (&mut reader).take(length), &mut std::io::sink()).is_err() {
            return;
        }
        heads.lock().unwrap().push(head.to_lowercase());
        let answer =
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// A `balancer launch` process, killed on drop.
struct Agent(Child, u16);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Agent {
    fn start(worker: SocketAddr, extra: &[&str]) -> Result<Self> {
        let port = free_port()?;
        let child = Command::new(balancer_binary("--request-id-headers")?)
            .arg("launch")
            .args(["--port", &port.to_string()])
            .args(["--prometheus-port", &free_port()?.to_string()])
            .args(["--admin-port", &free_port()?.to_string()])
            .args(["--worker-urls", &format!("http://{worker}")])
            .args(["--route-undeclared-models", "--disable-health-check"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting balancer launch")?;
        Ok(Self(child, port))
    }

    /// A chat request with `extra` header lines; the answer's head, once
    /// the agent serves (bounded).
    fn chat(&self, extra: &str) -> Result<String> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.1));
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{extra}\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let deadline = Instant::now() + BOUND;
        loop {
            if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                s.set_read_timeout(Some(BOUND))?;
                s.write_all(request.as_bytes())?;
                let mut got = String::new();
                s.read_to_string(&mut got)?;
                let head = got.split("\r\n\r\n").next().unwrap_or_default();
                return Ok(head.to_lowercase());
            }
            ensure!(Instant::now() < deadline, "the agent does not serve");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The value of header `name` (lower case) in a lower-cased head.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .map(str::trim)
}

#[test]
fn a_clients_request_id_reaches_the_worker_and_comes_back() -> Result<()> {
    let worker = Recorder::start()?;
    let agent = Agent::start(
        worker.addr,
        &["--request-id-headers", "x-request-id", "x-correlation-id"],
    )?;
    // The second header named: the first absent, this one is kept.
    let answer = agent.chat("x-correlation-id: abc-123\r\n")?;
    ensure!(answer.starts_with("http/1.1 200"), "{answer}");
    ensure!(
        header(&answer, "x-correlation-id") == Some("abc-123"),
        "{answer}"
    );
    let sent = worker.chat_head()?;
    ensure!(
        header(&sent, "x-correlation-id") == Some("abc-123"),
        "{sent}"
    );
    ensure!(header(&sent, "x-request-id").is_none(), "none made: {sent}");
    Ok(())
}

#[test]
fn a_request_without_an_id_gets_one_on_both_sides() -> Result<()> {
    let worker = Recorder::start()?;
    let agent = Agent::start(worker.addr, &["--request-id-headers", "x-request-id"])?;
    let answer = agent.chat("")?;
    let made = header(&answer, "x-request-id").context(answer.clone())?;
    ensure!(made.len() > 9 && made.contains('-'), "{made}");
    let sent = worker.chat_head()?;
    ensure!(header(&sent, "x-request-id") == Some(made), "{sent}");
    // The next one is another id.
    let again = agent.chat("")?;
    ensure!(
        header(&again, "x-request-id").is_some_and(|id| id != made),
        "{again}"
    );
    Ok(())
}

#[test]
fn without_the_flag_no_id_is_made_and_a_clients_passes_through() -> Result<()> {
    let worker = Recorder::start()?;
    let agent = Agent::start(worker.addr, &[])?;
    let answer = agent.chat("")?;
    ensure!(answer.starts_with("http/1.1 200"), "{answer}");
    ensure!(header(&answer, "x-request-id").is_none(), "made: {answer}");
    ensure!(
        header(&worker.chat_head()?, "x-request-id").is_none(),
        "made for the worker"
    );
    agent.chat("x-request-id: from-client\r\n")?;
    let sent = worker.chat_head()?;
    ensure!(
        header(&sent, "x-request-id") == Some("from-client"),
        "{sent}"
    );
    Ok(())
}

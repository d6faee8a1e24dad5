//! A raw HTTP/1.1 worker that answers by script, byte for byte: for the
//! tests that hold the gateway's hand-written HTTP/1.1 paths to hyper's
//! behaviour against buggy and hostile workers (stray responses, late
//! bodies, odd framing). It answers `GET /v1/models` with `demo-model`
//! itself, so the gateway learns its model; every other request goes to
//! the script. Counts connections and scripted requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the worker does with the `n`th scripted request (from 0).
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// Written at once; empty: the connection is closed without an answer
    /// (after the request was read in full).
    pub answer: Vec<u8>,
    /// Written 20 ms later, unasked.
    pub stray: Vec<u8>,
    /// Close the connection after the answer.
    pub close: bool,
}

impl Reply {
    pub fn answer(bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            answer: bytes.into(),
            ..Self::default()
        }
    }
}

/// A running scripted worker on loopback; stops when dropped.
pub struct ScriptedWorker {
    pub addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl ScriptedWorker {
    pub async fn start(script: fn(usize, &str) -> Reply) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (connections, requests) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (conns, reqs) = (connections.clone(), requests.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                conns.fetch_add(1, Ordering::SeqCst);
                let reqs = reqs.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let Some((head, len)) = read_request(&mut socket, &mut buf).await else {
                            return;
                        };
                        buf.drain(..len);
                        if head.starts_with("GET /v1/models ") {
                            let body = r#"{"object":"list","data":[{"id":"demo-model","object":"model"}]}"#;
                            let answer = format!(
                                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            if socket.write_all(answer.as_bytes()).await.is_err() {
                                return;
                            }
                            continue;
                        }
                        let n = reqs.fetch_add(1, Ordering::SeqCst);
                        let reply = script(n, &head);
                        if reply.answer.is_empty() {
                            return;
                        }
                        if socket.write_all(&reply.answer).await.is_err() {
                            return;
                        }
                        if !reply.stray.is_empty() {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            let _ = socket.write_all(&reply.stray).await;
                        }
                        if reply.close {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            connections,
            requests,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Scripted requests read so far (model listings not counted).
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for ScriptedWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The next request's head (as text) and its length with its body
/// (`Content-Length` or chunked); `None` when the connection ends.
async fn read_request(
    socket: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, usize)> {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let lower = head.to_ascii_lowercase();
            let length = lower
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            let body_end = match length {
                Some(n) => Some(end + 4 + n).filter(|&e| buf.len() >= e),
                None if lower.contains("transfer-encoding: chunked") => buf[end + 4..]
                    .windows(5)
                    .position(|w| w == b"0\r\n\r\n")
                    .map(|at| end + 4 + at + 5),
                None => Some(end + 4),
            };
            if let Some(total) = body_end {
                return Some((head, total));
            }
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

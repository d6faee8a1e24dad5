//! A raw HTTP/1.1 worker that records the request heads it receives and
//! answers with a fixed status, headers and body: for tests that must see
//! exactly what the gateway forwards (headers, paths), or that need a worker
//! answer the demo worker will not give (a hostile `Retry-After`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the capture worker answers to `/v1/*` requests.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Default for Answer {
    /// A small chat completion.
    fn default() -> Self {
        Self {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: r#"{"id":"c","object":"chat.completion","choices":[]}"#.into(),
        }
    }
}

/// A running capture worker on loopback; stops when dropped.
pub struct CaptureWorker {
    pub addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl CaptureWorker {
    /// Starts one that answers every `/v1/*` request with `answer`, and
    /// `GET /v1/models` with `demo-model`.
    pub async fn start(answer: Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (seen, answer) = (seen.clone(), answer.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let Some(end) = find(&buf, b"\r\n\r\n") else {
                            match socket.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        let length = content_length(&head);
                        while buf.len() < end + 4 + length {
                            match socket.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..end + 4 + length);
                        let models = head.starts_with("GET /v1/models ");
                        if !models {
                            seen.lock().unwrap().push(head);
                        }
                        let reply = if models {
                            let body = r#"{"object":"list","data":[{"id":"demo-model"}]}"#;
                            format!(
                                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            )
                        } else {
                            let mut r = format!("HTTP/1.1 {} X\r\n", answer.status);
                            for (k, v) in &answer.headers {
                                r.push_str(&format!("{k}: {v}\r\n"));
                            }
                            r.push_str(&format!(
                                "content-length: {}\r\n\r\n{}",
                                answer.body.len(),
                                answer.body
                            ));
                            r
                        };
                        if socket.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, heads, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The request heads received so far (not counting model discovery).
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

impl Drop for CaptureWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn content_length(head: &str) -> usize {
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

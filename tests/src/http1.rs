//! Raw HTTP/1.1 exchanges with a worker through the XDP path: plain
//! blocking sockets, so that a test controls exactly which TCP connection
//! each request takes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

pub const CHAT: &str = r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#;
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// What came back: the status and the `x-mock-worker` header (which
/// worker answered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub worker: String,
}

/// Opens a connection to `addr`.
pub fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(stream)
}

/// One chat completion on `stream`; `close` asks the server to close the
/// connection after it.
pub fn chat(stream: &mut TcpStream, close: bool) -> Result<Answer> {
    let connection = if close { "close" } else { "keep-alive" };
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: vip\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: {connection}\r\n\r\n{CHAT}",
        CHAT.len()
    )?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        // A read with a socket timeout returns EINTR whenever a signal
        // with a handler reaches the process, SA_RESTART or not (signal(7));
        // the tests' own runtimes install such handlers.
        let read = loop {
            match stream.read(&mut byte) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                read => break read?,
            }
        };
        if read == 0 {
            bail!(
                "connection closed inside the response head: {:?}",
                String::from_utf8_lossy(&head)
            );
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("not an HTTP/1.1 response: {head:?}"))?;
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    let length: usize = header("content-length")
        .context("no content-length")?
        .parse()?;
    let mut body = vec![0; length];
    stream.read_exact(&mut body)?;
    Ok(Answer {
        status,
        worker: header("x-mock-worker").unwrap_or_default(),
    })
}

/// `count` requests, each on a new connection (`Connection: close`).
pub fn new_connections(addr: SocketAddr, count: usize) -> Result<Vec<Answer>> {
    (0..count)
        .map(|i| {
            let mut stream = connect(addr)?;
            chat(&mut stream, true).with_context(|| format!("connection {i} to {addr}"))
        })
        .collect()
}

//! `cargo xtask bench instructions`: user-space instructions per proxied
//! request, counted by callgrind, for this gateway and for nginx, each
//! serving the same requests to the same two demo workers.
//!
//! Why a count beside `bench l7`'s CPU time: on a shared 2-core VM the CPU
//! time of one build moves by 20% between runs, while the count of
//! instructions does not move at all. It is the yardstick for a change to
//! the request path. It leaves out the kernel's share (the same syscalls for
//! both, see the module doc of `bench`) and the cost of cache misses, which
//! CPU time includes.
//!
//! Each server runs under `valgrind --tool=callgrind` with instrumentation
//! off; after a warm-up, instrumentation is switched on for exactly the
//! measured requests, then off, and that stretch is dumped and read. The
//! client is this process: one keep-alive connection, one request at a
//! time, so both servers see the same sequence of events.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use clap::Args;

use super::{
    BODY, Lab, PATH, PROXY_TO_WORKERS, ensure_tool, free_addr, launch, nginx_upstream,
    release_balancer,
};
use crate::shell::display;

#[derive(Args)]
pub struct Instructions {
    /// Requests counted per server (after a warm-up of a tenth as many).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=100_000))]
    requests: u64,
}

/// A server under callgrind, ready to be measured.
struct Counted {
    name: &'static str,
    addr: SocketAddr,
    /// callgrind's output file; dumps land beside it with a suffix.
    out: std::path::PathBuf,
}

pub fn instructions(args: &Instructions) -> Result<()> {
    let valgrind = ensure_tool("valgrind", "valgrind")?;
    let control = valgrind.with_file_name("callgrind_control");
    let balancer = release_balancer()?;
    let nginx = ensure_tool("nginx", "nginx-light")?;
    let mut lab = Lab::new()?;

    let workers = lab.start_workers(&balancer)?;
    let urls = workers.map(|addr| format!("http://{addr}"));

    let gateway = Counted {
        name: "balancer",
        addr: free_addr()?,
        out: lab.dir.join("balancer.callgrind"),
    };
    let launch = launch(&balancer, gateway.addr, &urls)?;
    let mut command = callgrind(&valgrind, &gateway.out);
    command.arg(launch.get_program()).args(launch.get_args());
    lab.start(gateway.name, &mut command)?;

    let proxy = Counted {
        name: "nginx",
        addr: free_addr()?,
        out: lab.dir.join("nginx.callgrind"),
    };
    let conf = lab.dir.join("nginx-counted.conf");
    fs::write(&conf, nginx_conf(&lab.dir, proxy.addr, &workers))?;
    let mut command = callgrind(&valgrind, &proxy.out);
    command
        .arg(&nginx)
        .arg("-p")
        .arg(&lab.dir)
        .arg("-e")
        .arg(lab.dir.join("nginx-error.log"))
        .arg("-c")
        .arg(&conf);
    lab.start(proxy.name, &mut command)?;

    let mut counts = Vec::new();
    for server in [&gateway, &proxy] {
        lab.await_ready(server.name, server.addr)?;
        let pid = lab.pid(server.name)?.to_string();
        let mut requests = Client::new(server.addr)?;
        requests.run(args.requests / 10)?;
        toggle(&control, &["--instr=on", &pid])?;
        requests.run(args.requests)?;
        toggle(&control, &["--instr=off", &pid])?;
        toggle(&control, &["--dump=measured", &pid])?;
        let total = dumped_total(&server.out)?;
        let per_request = total as f64 / args.requests as f64;
        eprintln!(
            "{}: {total} instructions over {} requests",
            server.name, args.requests
        );
        counts.push((server.name, per_request));
    }

    println!(
        "\nuser-space instructions per request (callgrind; POST {PATH}, {} byte body, \
         {} requests one at a time on one keep-alive connection):",
        BODY.len(),
        args.requests
    );
    for (name, per_request) in &counts {
        println!("  {name:<10} {:>8.0}", per_request);
    }
    let (balancer, nginx) = (counts[0].1, counts[1].1);
    println!("  ratio balancer / nginx: {:.2}x", balancer / nginx);
    Ok(())
}

/// `valgrind --tool=callgrind` writing to `out`, instrumentation off until
/// switched on.
fn callgrind(valgrind: &Path, out: &Path) -> Command {
    let mut command = Command::new(valgrind);
    command
        .args(["--tool=callgrind", "--instr-atstart=no"])
        .arg(format!("--callgrind-out-file={}", out.display()));
    command
}

/// One `callgrind_control` command; it waits for callgrind to carry it out.
fn toggle(control: &Path, args: &[&str]) -> Result<()> {
    let mut command = Command::new(control);
    command.args(args);
    let output = command
        .output()
        .with_context(|| format!("running {}", display(&command)))?;
    ensure!(
        output.status.success(),
        "`{}` failed: {}",
        display(&command),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// The instruction total of the dump beside `out` (`out.1`, written by
/// `--dump`).
fn dumped_total(out: &Path) -> Result<u64> {
    let dump = out.with_file_name(format!(
        "{}.1",
        out.file_name().context("no file name")?.to_string_lossy()
    ));
    let text = fs::read_to_string(&dump).with_context(|| format!("reading {}", dump.display()))?;
    total_of(&text).with_context(|| format!("no totals in {}", dump.display()))
}

/// The `totals:` (or, in older formats, `summary:`) line of a callgrind
/// file.
fn total_of(text: &str) -> Option<u64> {
    let line = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|n| n.trim().parse().ok())
    };
    line("totals:").or_else(|| line("summary:"))
}

/// nginx as one process (no master, one worker), so callgrind sees every
/// instruction of the proxy in the process it was started with.
fn nginx_conf(dir: &Path, listen: SocketAddr, workers: &[SocketAddr]) -> String {
    let upstream = nginx_upstream(dir, workers);
    let dir = dir.display();
    format!(
        "master_process off;
daemon off;
worker_processes 1;
pid {dir}/nginx-counted.pid;
error_log {dir}/nginx-error.log warn;
events {{
    worker_connections 1024;
}}
http {{
{upstream}
    # One client connection carries every request (nginx closes it after
    # 1,000 by default).
    keepalive_requests 1000000;
    server {{
        listen {listen};
        location / {{
{PROXY_TO_WORKERS}
        }}
    }}
}}
"
    )
}

/// A keep-alive connection sending the bench's chat completion, one at a
/// time. Under callgrind a request takes milliseconds: the timeouts are
/// generous.
struct Client {
    stream: BufReader<TcpStream>,
    request: Vec<u8>,
}

impl Client {
    fn new(addr: SocketAddr) -> Result<Self> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        stream.set_write_timeout(Some(Duration::from_secs(30)))?;
        let request = format!(
            "POST {PATH} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{BODY}",
            BODY.len()
        )
        .into_bytes();
        Ok(Self {
            stream: BufReader::new(stream),
            request,
        })
    }

    /// `count` requests, each answered 200 before the next is sent.
    fn run(&mut self, count: u64) -> Result<()> {
        for _ in 0..count {
            self.stream.get_mut().write_all(&self.request)?;
            read_response(&mut self.stream)?;
        }
        Ok(())
    }
}

/// Reads one response (sized or chunked); fails unless it is a 200.
fn read_response(stream: &mut impl BufRead) -> Result<()> {
    let mut line = String::new();
    stream.read_line(&mut line)?;
    ensure!(
        line.starts_with("HTTP/1.1 200"),
        "expected a 200, got {line:?}"
    );
    let (mut length, mut chunked) = (None, false);
    loop {
        line.clear();
        stream.read_line(&mut line)?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':').context("malformed header")?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>()?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        }
    }
    if chunked {
        loop {
            line.clear();
            stream.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim_end(), 16)?;
            let mut chunk = vec![0; size + 2];
            stream.read_exact(&mut chunk)?;
            if size == 0 {
                return Ok(());
            }
        }
    }
    let Some(length) = length else {
        bail!("a response with neither a length nor chunks");
    };
    let mut body = vec![0; length];
    stream.read_exact(&mut body)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callgrind_totals_are_read() {
        let dump =
            "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 0\ntotals: 41726229\n";
        assert_eq!(total_of(dump), Some(41_726_229));
        assert_eq!(total_of("events: Ir\nsummary: 7\n"), Some(7));
        assert_eq!(total_of("events: Ir\n"), None);
    }

    #[test]
    fn sized_and_chunked_responses_are_read_whole() {
        let sized = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhiHTTP/1.1 200 OK\r\n";
        let mut reader = &sized[..];
        read_response(&mut reader).unwrap();
        assert_eq!(reader, b"HTTP/1.1 200 OK\r\n");
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
        let mut reader = &chunked[..];
        read_response(&mut reader).unwrap();
        assert!(reader.is_empty());
        let refused = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n";
        assert!(read_response(&mut &refused[..]).is_err());
    }
}

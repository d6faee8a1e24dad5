//! `cargo xtask bench instructions`: user-space instructions per proxied
//! request, counted by callgrind, for this gateway and for nginx, each
//! serving the same requests to the same two demo workers.
//!
//! Why a count beside `bench l7`'s CPU time: on a shared 2-core VM the CPU
//! time of one build moves by 20% between runs, while the count of
//! instructions does not move at all. It is the yardstick for a change to
//! the request path. It leaves out the kernel's share (the same syscalls for
//! both, see the module doc of `bench`) and the cost of cache misses, which
//! CPU time includes. `--cache-sim` adds callgrind's simulated L1 misses
//! per request: with the instruction counts equal, they are what still
//! told the two apart (values moved from future to future are copies into
//! cold memory).
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
    /// Also simulate the caches (`--cache-sim=yes`) and print L1 misses
    /// per request: instruction fetches, data reads and data writes. At
    /// the same instruction count, misses are what separates CPU times.
    #[arg(long)]
    cache_sim: bool,
    /// Copy callgrind's dumps of the measured stretch into this folder, to
    /// read with `callgrind_annotate` (the lab's own folder goes at the end).
    #[arg(long, value_name = "DIR")]
    keep: Option<std::path::PathBuf>,
}

/// The simulated events printed with `--cache-sim`, and what they count.
const CACHE_EVENTS: [(&str, &str); 3] = [
    ("I1mr", "L1 instruction misses"),
    ("D1mr", "L1 data read misses"),
    ("D1mw", "L1 data write misses"),
];

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
    let launch = launch(&balancer, gateway.addr, &urls, "round_robin")?;
    let mut command = callgrind(&valgrind, &gateway.out, args.cache_sim);
    command.arg(launch.get_program()).args(launch.get_args());
    lab.start(gateway.name, &mut command)?;

    let proxy = Counted {
        name: "nginx",
        addr: free_addr()?,
        out: lab.dir.join("nginx.callgrind"),
    };
    let conf = lab.dir.join("nginx-counted.conf");
    fs::write(&conf, nginx_conf(&lab.dir, proxy.addr, &workers))?;
    let mut command = callgrind(&valgrind, &proxy.out, args.cache_sim);
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
        let totals = dumped_totals(&server.out)?;
        if let Some(keep) = &args.keep {
            keep_dumps(&server.out, keep)?;
        }
        let per_request = |event: &str| {
            let total = totals.iter().find(|(name, _)| name == event).map(|t| t.1);
            total.map(|n| n as f64 / args.requests as f64)
        };
        let instructions = per_request("Ir").context("callgrind counted no instructions")?;
        eprintln!(
            "{}: {:.0} instructions over {} requests",
            server.name,
            instructions * args.requests as f64,
            args.requests
        );
        let misses: Vec<f64> = if args.cache_sim {
            CACHE_EVENTS
                .iter()
                .map(|(event, _)| per_request(event).with_context(|| format!("no {event} count")))
                .collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        counts.push((server.name, instructions, misses));
    }

    println!(
        "\nuser-space instructions per request (callgrind; POST {PATH}, {} byte body, \
         {} requests one at a time on one keep-alive connection):",
        BODY.len(),
        args.requests
    );
    for (name, per_request, _) in &counts {
        println!("  {name:<10} {:>8.0}", per_request);
    }
    let ((_, balancer, gateway_misses), (_, nginx, proxy_misses)) = (&counts[0], &counts[1]);
    println!("  ratio balancer / nginx: {:.2}x", balancer / nginx);
    if args.cache_sim {
        println!("\nsimulated cache misses per request (the same requests):");
        println!(
            "  {:<24} {:>9} {:>9} {:>7}",
            "", "balancer", "nginx", "ratio"
        );
        for (((_, what), ours), theirs) in CACHE_EVENTS.iter().zip(gateway_misses).zip(proxy_misses)
        {
            println!(
                "  {what:<24} {ours:>9.0} {theirs:>9.0} {:>6.2}x",
                ours / theirs
            );
        }
    }
    Ok(())
}

/// `valgrind --tool=callgrind` writing to `out`, instrumentation off until
/// switched on; simulating the caches with `cache_sim`.
fn callgrind(valgrind: &Path, out: &Path, cache_sim: bool) -> Command {
    let mut command = Command::new(valgrind);
    command
        .args(["--tool=callgrind", "--instr-atstart=no"])
        .arg(format!("--callgrind-out-file={}", out.display()));
    if cache_sim {
        command.arg("--cache-sim=yes");
    }
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

/// The event totals of the dump beside `out` (`out.1`, written by
/// `--dump`), by event name.
fn dumped_totals(out: &Path) -> Result<Vec<(String, u64)>> {
    let dump = out.with_file_name(format!(
        "{}.1",
        out.file_name().context("no file name")?.to_string_lossy()
    ));
    let text = fs::read_to_string(&dump).with_context(|| format!("reading {}", dump.display()))?;
    totals_of(&text).with_context(|| format!("no totals in {}", dump.display()))
}

/// The `totals:` (or, in older formats, `summary:`) line of a callgrind
/// file, named by its `events:` line.
fn totals_of(text: &str) -> Option<Vec<(String, u64)>> {
    let line = |key: &str| text.lines().find_map(|l| l.strip_prefix(key));
    let events = line("events:")?.split_whitespace();
    let counts = line("totals:").or_else(|| line("summary:"))?;
    let counts: Vec<u64> = counts
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let totals: Vec<(String, u64)> = events.map(str::to_owned).zip(counts).collect();
    (!totals.is_empty()).then_some(totals)
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

/// Copies the dumps callgrind wrote beside `out` (`out.N` and the like)
/// into `keep`.
fn keep_dumps(out: &std::path::Path, keep: &std::path::Path) -> Result<()> {
    fs::create_dir_all(keep).with_context(|| format!("creating {}", keep.display()))?;
    let (dir, stem) = (
        out.parent().context("a dump's folder")?,
        out.file_name().context("a dump's name")?,
    );
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default();
        if name.to_string_lossy().starts_with(&*stem.to_string_lossy()) {
            fs::copy(&path, keep.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callgrind_totals_are_read_by_event() {
        let ir = |n: u64| Some(vec![("Ir".to_owned(), n)]);
        let dump =
            "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 0\ntotals: 41726229\n";
        assert_eq!(totals_of(dump), ir(41_726_229));
        assert_eq!(totals_of("events: Ir\nsummary: 7\n"), ir(7));
        assert_eq!(totals_of("events: Ir\n"), None);
        assert_eq!(totals_of("events: Ir\ntotals: x\n"), None);
        let simulated = "events: Ir Dr Dw I1mr D1mr D1mw\ntotals: 100 40 30 9 8 7\n";
        let totals = totals_of(simulated).unwrap();
        assert_eq!(totals.len(), 6);
        assert_eq!(totals[4], ("D1mr".to_owned(), 8));
        assert_eq!(totals[5], ("D1mw".to_owned(), 7));
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

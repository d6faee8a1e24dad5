//! `cargo xtask bench cache`: prefix-cache hits and time to first token of a
//! multi-turn chat workload, through this gateway's policies and the
//! reference gateway's `cache_aware`.
//!
//! The trace is deterministic: `--users` conversations in `--groups` groups,
//! each group sharing one long system prompt, `--turns` turns each, every
//! turn resending the whole conversation (system prompt, the earlier
//! questions and answers, the new question) as a streamed chat completion.
//! The defaults (48 system prompts of 10 kB, about 7,500 cache blocks in
//! all, 192 conversations) are far more than one demo worker's 4,096-block
//! cache holds and less than four hold: spreading every prompt over every
//! worker evicts, keeping each prompt on one worker does not. (With 32
//! prompts round robin still hit half the time, which left no room to show
//! a twofold gain.)
//! `--concurrency` clients run it closed-loop: each takes its users in turn
//! and sends a user's next turn only after the previous answer ended.
//!
//! Every target (`round_robin`, `power_of_two`, `cache_aware` of this
//! gateway, then smg's `cache_aware` when it can be installed from PyPI)
//! runs the trace twice, each time before four demo workers started fresh
//! (empty caches): as is, then with faults: a third into the trace worker 2
//! becomes six times slower at prefill (`POST /_mock/engine`), and two
//! thirds in worker 3 answers every request with 500 (`POST /_mock/fault`).
//! The workers run the demo engine of `balancer launch --demo-workers`
//! ([`ENGINE`]: a 4096-block prefix cache, 100 µs per uncached token, 8
//! slots).
//!
//! Reported per run: the aggregate prefix-cache hit ratio (hit tokens over
//! prompt tokens, from the workers' `/_mock/stats`), the time to first token
//! measured by the client (to the first SSE `data:` line), p50 and p99,
//! requests per second, each worker's share of the requests it received,
//! and the errors the client saw (a status other than 200, or a stream
//! without `[DONE]`).
//!
//! Processes are stopped by PID whichever way the bench ends ([`Lab`]);
//! traffic stays on loopback and every read is bounded.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;

use super::{Lab, PATH, free_addr, launch, median, release_balancer, smg_command, smg_launcher};
use crate::shell::{cargo, run};
use crate::{target_dir, workspace_root};

#[derive(Args)]
pub struct Cache {
    /// Conversations in the trace.
    #[arg(long, default_value_t = 192, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    users: u64,
    /// Groups of conversations sharing one system prompt.
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    groups: u64,
    /// Turns of each conversation.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=50))]
    turns: u64,
    /// Clients sending at once (closed loop).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=256))]
    concurrency: u64,
    /// Bytes of each group's system prompt (about 4 bytes a token).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(64..=200_000))]
    system_bytes: u64,
    /// Run the debug build of the agent (a quick smoke run while developing;
    /// its figures are not the release build's).
    #[arg(long)]
    debug: bool,
    /// Leave out the reference gateway (no PyPI install).
    #[arg(long)]
    no_smg: bool,
}

/// Demo workers per run.
const WORKERS: usize = 4;
/// The demo workers' engine flags: `EngineConfig::DEMO` of the demo worker.
const ENGINE: [&str; 6] = [
    "--prefix-cache-blocks",
    "4096",
    "--prefill-us-per-token",
    "100",
    "--slots",
    "8",
];
/// Worker 2's prefill per token once slowed: six times the demo's 100 µs.
const SLOW_PREFILL_US: u64 = 600;
/// Tokens each answer streams.
const ANSWER_TOKENS: u64 = 8;
/// One request's bound, from connect to the end of its stream.
const REQUEST_WITHIN: Duration = Duration::from_secs(60);

/// This gateway's policies, in the table's order.
const POLICIES: [&str; 3] = ["round_robin", "power_of_two", "cache_aware"];
const SMG: &str = "smg cache_aware";

pub fn cache(args: &Cache) -> Result<()> {
    let started = Instant::now();
    let balancer = if args.debug {
        debug_balancer()?
    } else {
        release_balancer()?
    };
    let smg = if args.no_smg {
        None
    } else {
        match smg_launcher() {
            Ok(smg) => Some(smg),
            Err(error) => {
                eprintln!(
                    "\n*** bench cache: smg UNAVAILABLE, its rows are left out: {error:#} ***\n"
                );
                None
            }
        }
    };
    let trace = Trace::new(args);
    eprintln!(
        "\nbench cache: {} users in {} groups ({} B system prompts), {} turns each, \
         {} requests, {} clients closed-loop, streamed, {ANSWER_TOKENS} tokens an answer; \
         {WORKERS} demo workers started fresh per run{}",
        args.users,
        args.groups,
        args.system_bytes,
        args.turns,
        trace.requests(),
        args.concurrency,
        if args.debug { "; DEBUG build" } else { "" },
    );

    let mut names: Vec<&str> = POLICIES.to_vec();
    if smg.is_some() {
        names.push(SMG);
    }
    let mut rows = [Vec::new(), Vec::new()];
    for (faults, rows) in [false, true].into_iter().zip(rows.iter_mut()) {
        for &name in &names {
            let row = run_target(&balancer, smg.as_deref(), name, &trace, args, faults)
                .with_context(|| format!("running the trace through {name}"))?;
            eprintln!("{}", row.line());
            rows.push(row);
        }
    }
    println!("\n{}", table("steady workers", &rows[0]));
    println!(
        "{}",
        table(
            "worker 2 six times slower a third in, worker 3 failing two thirds in",
            &rows[1]
        )
    );
    eprintln!("bench cache: {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Builds the agent in the dev profile; returns the binary.
fn debug_balancer() -> Result<PathBuf> {
    run(cargo()
        .args(["build", "--package", "balancer", "--bin", "balancer"])
        .current_dir(workspace_root()))?;
    Ok(target_dir().join("debug/balancer"))
}

/// One run: fresh workers, the target in front, the trace through it.
fn run_target(
    balancer: &Path,
    smg: Option<&Path>,
    name: &'static str,
    trace: &Trace,
    args: &Cache,
    faults: bool,
) -> Result<Row> {
    let mut lab = Lab::new()?;
    let mut workers = Vec::new();
    for i in 0..WORKERS {
        let addr = free_addr()?;
        let worker = format!("worker{}", i + 1);
        lab.start(
            &worker,
            Command::new(balancer)
                .args(["mock-worker", "--model", "demo-model"])
                .args(ENGINE)
                .arg("--listen")
                .arg(addr.to_string()),
        )?;
        lab.await_ready(&worker, addr)?;
        workers.push(addr);
    }
    let urls: Vec<String> = workers.iter().map(|a| format!("http://{a}")).collect();
    let addr = free_addr()?;
    let mut command = match (name, smg) {
        (SMG, Some(smg)) => smg_command(smg, addr, &urls, "cache_aware")?,
        (SMG, None) => bail!("smg is not installed"),
        (policy, _) => launch(balancer, addr, &urls, policy)?,
    };
    lab.start(name, &mut command)?;
    lab.await_ready(name, addr)?;
    // The readiness requests are no part of the trace.
    for w in &workers {
        http(*w, "POST", "/_mock/reset", "")?;
    }

    let done = AtomicUsize::new(0);
    let total = trace.requests();
    let fault_at = |n: usize| -> Result<()> {
        if !faults {
            return Ok(());
        }
        if n == total / 3 {
            let body = format!(r#"{{"prefill_us_per_token":{SLOW_PREFILL_US}}}"#);
            http(workers[1], "POST", "/_mock/engine", &body)?;
        } else if n == 2 * total / 3 {
            http(workers[2], "POST", "/_mock/fault", r#"{"status":500}"#)?;
        }
        Ok(())
    };
    let clients = args.concurrency as usize;
    let start = Instant::now();
    let results: Vec<Result<Vec<Outcome>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|client| {
                let (done, fault_at) = (&done, &fault_at);
                s.spawn(move || -> Result<Vec<Outcome>> {
                    let mut outcomes = Vec::new();
                    for user in (client..trace.users.len()).step_by(clients) {
                        for body in &trace.users[user] {
                            outcomes.push(request(addr, body));
                            fault_at(done.fetch_add(1, Ordering::Relaxed) + 1)?;
                        }
                    }
                    Ok(outcomes)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a client panicked")))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut outcomes = Vec::new();
    for r in results {
        outcomes.extend(r?);
    }

    let mut stats = Vec::new();
    for w in &workers {
        let text = http(*w, "GET", "/_mock/stats", "")?;
        stats.push(WorkerStats {
            requests: json_u64(&text, "inference_requests")?,
            query: json_u64(&text, "prefix_cache_query_tokens")?,
            hit: json_u64(&text, "prefix_cache_hit_tokens")?,
        });
    }
    let ttfb: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.ttft.map(|t| t.as_secs_f64()))
        .collect();
    let query: u64 = stats.iter().map(|s| s.query).sum();
    let hit: u64 = stats.iter().map(|s| s.hit).sum();
    let served: u64 = stats.iter().map(|s| s.requests).sum();
    Ok(Row {
        name,
        hit_ratio: if query == 0 {
            0.0
        } else {
            hit as f64 / query as f64
        },
        p50: quantile(&ttfb, 0.5),
        p99: quantile(&ttfb, 0.99),
        rps: outcomes.len() as f64 / elapsed.as_secs_f64(),
        shares: stats
            .iter()
            .map(|s| s.requests as f64 / served.max(1) as f64)
            .collect(),
        errors: outcomes.iter().filter(|o| !o.ok).count(),
    })
}

/// The trace: each user's request bodies, turn by turn.
struct Trace {
    users: Vec<Vec<String>>,
}

impl Trace {
    fn new(args: &Cache) -> Self {
        let mut words = Words(0x9e37_79b9_7f4a_7c15);
        let systems: Vec<String> = (0..args.groups)
            .map(|g| {
                format!(
                    "group {g} rules: {}",
                    words.text(args.system_bytes as usize)
                )
            })
            .collect();
        let users = (0..args.users)
            .map(|u| {
                let system = &systems[(u % args.groups) as usize];
                let mut messages = format!(r#"{{"role":"system","content":"{system}"}}"#);
                (0..args.turns)
                    .map(|t| {
                        let question = format!("user {u} turn {t}: {}", words.text(300));
                        write!(messages, r#",{{"role":"user","content":"{question}"}}"#).unwrap();
                        let body = format!(
                            r#"{{"model":"demo-model","stream":true,"max_tokens":{ANSWER_TOKENS},"messages":[{messages}]}}"#
                        );
                        // The answer the client keeps in the conversation.
                        let answer = words.text(200);
                        write!(messages, r#",{{"role":"assistant","content":"{answer}"}}"#)
                            .unwrap();
                        body
                    })
                    .collect()
            })
            .collect();
        Self { users }
    }

    fn requests(&self) -> usize {
        self.users.iter().map(Vec::len).sum()
    }
}

/// Deterministic lowercase text (no JSON escaping needed).
struct Words(u64);

impl Words {
    const VOCABULARY: [&'static str; 16] = [
        "model", "token", "cache", "prefix", "worker", "request", "answer", "context", "system",
        "prompt", "user", "turn", "latency", "queue", "block", "hash",
    ];

    fn text(&mut self, bytes: usize) -> String {
        let mut out = String::with_capacity(bytes + 16);
        while out.len() < bytes {
            // xorshift64: the same trace on every run and machine.
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            out.push_str(Self::VOCABULARY[(self.0 % 16) as usize]);
            out.push(' ');
        }
        out
    }
}

/// What the client saw of one request.
struct Outcome {
    ok: bool,
    /// To the first `data:` line of the stream.
    ttft: Option<Duration>,
}

/// One streamed chat completion, `Connection: close`, read to its end.
fn request(addr: SocketAddr, body: &str) -> Outcome {
    let start = Instant::now();
    let mut ttft = None;
    let result = (|| -> Result<bool> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(REQUEST_WITHIN))?;
        stream.set_write_timeout(Some(REQUEST_WITHIN))?;
        write!(
            stream,
            "POST {PATH} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut response = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                break;
            }
            response.extend_from_slice(&chunk[..n]);
            if ttft.is_none() && find(&response, b"data:").is_some() {
                ttft = Some(start.elapsed());
            }
            ensure!(
                start.elapsed() < REQUEST_WITHIN && response.len() < 16 << 20,
                "the answer did not end within its bounds"
            );
        }
        Ok(response.starts_with(b"HTTP/1.1 200") && find(&response, b"[DONE]").is_some())
    })();
    let ok = result.unwrap_or(false);
    Outcome {
        ok,
        ttft: if ok { ttft } else { None },
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One control request to a demo worker; its body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.take(1 << 20).read_to_string(&mut response)?;
    ensure!(
        response.starts_with("HTTP/1.1 200"),
        "{method} {path} on {addr}: {}",
        response.lines().next().unwrap_or("no answer")
    );
    Ok(response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned()))
}

/// A non-negative integer field of a flat JSON object.
fn json_u64(text: &str, key: &str) -> Result<u64> {
    let at = text
        .find(&format!("\"{key}\":"))
        .with_context(|| format!("no {key} in {text}"))?;
    let digits: String = text[at + key.len() + 3..]
        .chars()
        .skip_while(|c| c.is_whitespace())
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .with_context(|| format!("{key} is not a number in {text}"))
}

struct WorkerStats {
    requests: u64,
    query: u64,
    hit: u64,
}

/// One target's figures over one trace.
struct Row {
    name: &'static str,
    hit_ratio: f64,
    p50: f64,
    p99: f64,
    rps: f64,
    shares: Vec<f64>,
    errors: usize,
}

impl Row {
    fn line(&self) -> String {
        let shares: Vec<String> = self
            .shares
            .iter()
            .map(|s| format!("{:.0}%", s * 100.0))
            .collect();
        format!(
            "| {:<16} | {:>9.2} | {:>8.0} ms | {:>8.0} ms | {:>7.1} | {:<19} | {:>6} |",
            self.name,
            self.hit_ratio,
            self.p50 * 1e3,
            self.p99 * 1e3,
            self.rps,
            shares.join(" "),
            self.errors
        )
    }
}

fn table(title: &str, rows: &[Row]) -> String {
    let mut out = format!(
        "{title}\n| target           | hit ratio |  TTFT p50 |  TTFT p99 |   req/s | share w1 w2 w3 w4   | errors |\n\
         |---|---|---|---|---|---|---|\n"
    );
    for row in rows {
        out.push_str(&row.line());
        out.push('\n');
    }
    out
}

/// The `q` quantile (nearest rank) of `values`; NaN when empty.
fn quantile(values: &[f64], q: f64) -> f64 {
    if q == 0.5 {
        return median(values.to_vec());
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n => sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> Cache {
        Cache {
            users: 4,
            groups: 2,
            turns: 3,
            concurrency: 2,
            system_bytes: 200,
            debug: true,
            no_smg: true,
        }
    }

    #[test]
    fn the_trace_resends_the_whole_conversation_and_shares_system_prompts() {
        let trace = Trace::new(&args());
        assert_eq!(trace.requests(), 12);
        let user0 = &trace.users[0];
        // Each turn starts with the previous turn's whole prompt.
        for turn in 1..user0.len() {
            let previous = user0[turn - 1].strip_suffix("]}").unwrap();
            assert!(user0[turn].starts_with(previous), "turn {turn}");
        }
        // Users 0 and 2 share group 0's system prompt, user 1 has group 1's.
        let system = |body: &str| body.split(r#""role":"user""#).next().unwrap().to_owned();
        assert_eq!(system(&trace.users[0][0]), system(&trace.users[2][0]));
        assert_ne!(system(&trace.users[0][0]), system(&trace.users[1][0]));
        // Deterministic.
        assert_eq!(Trace::new(&args()).users, trace.users);
    }

    #[test]
    fn fields_and_quantiles_are_read() {
        let stats = r#"{"requests":12,"inference_requests":10,"prefix_cache_hit_tokens": 640}"#;
        assert_eq!(json_u64(stats, "inference_requests").unwrap(), 10);
        assert_eq!(json_u64(stats, "prefix_cache_hit_tokens").unwrap(), 640);
        assert!(json_u64(stats, "missing").is_err());
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&values, 0.99), 99.0);
        assert_eq!(quantile(&values, 0.5), 50.5);
        assert!(quantile(&[], 0.99).is_nan());
    }
}

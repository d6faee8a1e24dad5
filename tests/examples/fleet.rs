//! `cargo xtask bench fleet`: what sharing breaker verdicts saves.
//!
//! In-process replicas (debug profile, as the chaos run) in front of
//! two demo workers, the document's breaker defaults (threshold 10),
//! `round_robin`, retries on, a real etcd on loopback (`/usr/bin/etcd`).
//! Worker A answers 500 from the start; requests go to three replicas in
//! turn (evenly), then 6:3:1 (a replica that sees little traffic), then to
//! ten replicas evenly (the example) and with two busy ones, until
//! every replica stopped sending to A. Each spread runs without
//! `--fleet-verdicts`, with it (quorum 2, the default) and with
//! `--fleet-quorum 1`. Printed per run: the failed requests the fleet served
//! (A's request count), and with verdicts the time from the verdict that
//! formed the quorum (the quorum-th replica's own opening) to the last
//! replica's opening. Every process it starts stops with it; the load is
//! one request at a time, at most [`MAX_REQUESTS`] per run.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use balancer::discovery::etcd::EtcdConfig;
use balancer::fleet::FleetConfig;
use balancer_core::breaker::{State, TransitionReason};
use balancer_core::registry::WorkerEvent;
use balancer_mock_worker::{MockWorker, MockWorkerConfig};
use balancer_tests::etcd::Etcd;
use balancer_tests::gateway::{CHAT, Harness, always, harness_with_urls, quiet};
use http::StatusCode;

const MAX_REQUESTS: usize = 2000;

/// When each replica's breaker on A opened, and whether the fleet did it.
type Openings = Arc<Mutex<Vec<(usize, Instant, bool)>>>;

struct Run {
    failed: u64,
    client_errors: u64,
    quorum_to_last: Option<Duration>,
    fleet_opened: usize,
}

async fn run(etcd: &Etcd, prefix: &str, shares: &[usize], quorum: Option<usize>) -> Run {
    let spawn =
        |name: &str| MockWorker::spawn(([127, 0, 0, 1], 0).into(), MockWorkerConfig::named(name));
    let (a, b) = (spawn("a").await.unwrap(), spawn("b").await.unwrap());
    let urls = [a.url(), b.url()];
    let mut replicas: Vec<Harness> = Vec::new();
    for i in 0..shares.len() {
        let url = etcd.url();
        replicas.push(
            harness_with_urls(&urls, |c| {
                quiet(c);
                c.policy = balancer_core::selection::Policy::RoundRobin;
                if let Some(quorum) = quorum {
                    c.etcd = Some(EtcdConfig {
                        endpoints: vec![url],
                        prefix: prefix.to_owned(),
                    });
                    c.fleet = Some(FleetConfig {
                        replica_id: format!("r{i}"),
                        quorum,
                        lease: Duration::from_secs(10),
                    });
                }
            })
            .await,
        );
    }
    let openings: Openings = Arc::default();
    for (i, h) in replicas.iter().enumerate() {
        let mut events = h.gw.registry.subscribe();
        let (openings, a_url) = (openings.clone(), a.url());
        tokio::spawn(async move {
            while let Ok(event) = events.recv().await {
                if let WorkerEvent::Breaker(w, t) = event
                    && *w.url == *a_url
                    && t.to == State::Open
                {
                    let by_fleet = t.reason == TransitionReason::Fleet;
                    openings.lock().unwrap().push((i, Instant::now(), by_fleet));
                }
            }
        });
    }
    a.set_fault(always(500));
    let turn: Vec<usize> = (0..shares.len())
        .flat_map(|i| std::iter::repeat_n(i, shares[i]))
        .collect();
    let all_open = || {
        replicas
            .iter()
            .all(|h| h.gw.registry.fleet().get(&a.url()).unwrap().breaker.state() == State::Open)
    };
    let mut client_errors = 0;
    for n in 0..MAX_REQUESTS {
        if all_open() {
            break;
        }
        let reply = replicas[turn[n % turn.len()]].chat(CHAT).await;
        if reply.status != StatusCode::OK {
            client_errors += 1;
        }
    }
    // The last isolation may still be on its way through etcd.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !all_open() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let openings = openings.lock().unwrap().clone();
    let own: Vec<Instant> = openings.iter().filter(|o| !o.2).map(|o| o.1).collect();
    let last = openings.iter().map(|o| o.1).max();
    let run = Run {
        failed: a.stats().inference_requests,
        client_errors,
        quorum_to_last: match (quorum, last) {
            (Some(q), Some(last)) => own
                .get(q - 1)
                .map(|formed| last.saturating_duration_since(*formed)),
            _ => None,
        },
        fleet_opened: openings.iter().filter(|o| o.2).count(),
    };
    assert!(all_open(), "a replica never stopped sending to A");
    for h in replicas {
        h.stop().await;
    }
    a.shutdown().await;
    b.shutdown().await;
    run
}

#[tokio::main]
async fn main() {
    let Some(etcd) = Etcd::start() else {
        eprintln!("fleet bench: etcd is needed (cargo xtask setup installs it)");
        std::process::exit(1);
    };
    println!("fleet verdicts: threshold 10, worker A fails every request");
    println!(
        "{:<10} {:<16} {:>14} {:>14} {:>16} {:>22}",
        "replicas",
        "verdicts",
        "failed on A",
        "client errors",
        "fleet isolations",
        "quorum -> last"
    );
    let mut n = 0;
    let spreads: [(&str, &[usize]); 4] = [
        ("3 even", &[1, 1, 1]),
        ("3 6:3:1", &[6, 3, 1]),
        ("10 even", &[1; 10]),
        ("10 5:5:1..", &[5, 5, 1, 1, 1, 1, 1, 1, 1, 1]),
    ];
    for (name, shares) in spreads {
        for quorum in [None, Some(2), Some(1)] {
            n += 1;
            let r = run(&etcd, &format!("/bench{n}/"), shares, quorum).await;
            println!(
                "{:<10} {:<16} {:>14} {:>14} {:>16} {:>22}",
                name,
                quorum.map_or("off".to_owned(), |q| format!("quorum {q}")),
                r.failed,
                r.client_errors,
                r.fleet_opened,
                r.quorum_to_last.map_or("-".to_owned(), |d| format!(
                    "{:.1} ms",
                    d.as_secs_f64() * 1e3
                )),
            );
        }
    }
}

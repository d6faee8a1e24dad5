//! Worker selection cost against fleet size: every policy at 8, 512 and 4096
//! workers, with the whole fleet eligible and with half of it open; and
//! `cache_aware` for a 4 KiB prompt over 16 workers whose trees hold 256
//! conversations (match, breaker admission, insert; target: 2 us median),
//! alone and with a second thread routing prompts of the same shard.
//!
//! `cargo bench -p balancer-core --bench selection` (or `cargo xtask bench breaker`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use balancer_core::breaker::{FailureReason, Outcome, Settings};
use balancer_core::clock::{Clock, ManualClock};
use balancer_core::health::HealthThresholds;
use balancer_core::registry::{DEFAULT_REMOVED_GRACE, Registry, RegistryConfig};
use balancer_core::ring::hash_key;
use balancer_core::selection::{Policy, Prompt, Selector};
use balancer_core::spec::{BreakerDefaults, WorkerSpec};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

fn fleet(n: usize, clock: Arc<ManualClock>) -> Arc<Registry> {
    let registry = Registry::new(
        RegistryConfig {
            breaker: BreakerDefaults {
                settings: Settings {
                    failure_threshold: 1,
                    ..Settings::default()
                },
                disabled: false,
                slow_ttfb: None,
                stream_failures: false,
                min_completion_tokens: None,
                l4_signals: false,
            },
            health: HealthThresholds {
                failure: 3,
                success: 2,
            },
            hash_rings: true,
            max_open_percent: 100,
            removed_grace: DEFAULT_REMOVED_GRACE,
        },
        clock,
    );
    // Addresses are never dialled: selection only reads worker state.
    let specs: Vec<_> = (0..n)
        .map(|i| WorkerSpec::from_url(&format!("http://127.0.{}.{}:8000", i / 250, i % 250 + 1)))
        .collect();
    registry.add_all(&specs).unwrap();
    registry
}

fn bench(c: &mut Criterion) {
    let policies = [
        Policy::PowerOfTwo,
        Policy::RoundRobin,
        Policy::Random,
        Policy::ConsistentHash,
        Policy::LeastLoad,
    ];
    for open_half in [false, true] {
        let mut group = c.benchmark_group(if open_half {
            "select/half open"
        } else {
            "select/all eligible"
        });
        for n in [8, 512, 4096] {
            let clock = Arc::new(ManualClock::new());
            let registry = fleet(n, clock.clone());
            let fleet = registry.fleet();
            if open_half {
                for w in fleet.workers.iter().step_by(2) {
                    let t = w.breaker.admit(&*clock).unwrap();
                    w.breaker
                        .record(t, Outcome::Failure(FailureReason::Status), &*clock);
                }
            }
            let (candidates, ring) = fleet.candidates(None);
            let key = Some(hash_key(b"session-42"));
            for policy in policies {
                let selector = Selector::new(policy);
                group.bench_with_input(BenchmarkId::new(policy.as_str(), n), &n, |b, _| {
                    b.iter(|| {
                        black_box(selector.select(
                            candidates,
                            ring,
                            key,
                            &[],
                            &*clock as &dyn Clock,
                        ))
                    })
                });
            }
        }
        group.finish();
    }
}

fn cache_aware(c: &mut Criterion) {
    let clock = Arc::new(ManualClock::new());
    let registry = fleet(16, clock.clone());
    let fleet = registry.fleet();
    let (candidates, _) = fleet.candidates(None);
    let selector = Selector::new(Policy::CacheAware);
    // 16 system prompts of 2 KiB, 16 users each, 2 KiB of conversation.
    let prompts: Vec<Vec<u8>> = (0..256)
        .map(|i| {
            let system = format!("system {}: {}", i % 16, "be helpful and brief. ".repeat(93));
            let user = format!("user {i}: {}", "tell me more about it. ".repeat(89));
            let mut p = [system.as_bytes(), user.as_bytes()].concat();
            p.truncate(4096);
            p
        })
        .collect();
    let route = |text: &[u8]| {
        let prompt = Prompt { model: "m", text };
        selector.attempt_prompt(
            candidates,
            None,
            None,
            Some(prompt),
            &[],
            &*clock as &dyn Clock,
        )
    };
    for p in &prompts {
        drop(route(p));
    }
    let mut group = c.benchmark_group("select/cache_aware");
    let mut i = 0;
    group.bench_function("4KiB prompt, 16 workers", |b| {
        b.iter(|| {
            i = (i + 1) % prompts.len();
            black_box(route(&prompts[i]))
        })
    });
    // Contention: every prompt under one system prompt (one shard, one
    // lock) while a second thread routes the same ones without pause.
    let same: Vec<&[u8]> = prompts.iter().step_by(16).map(Vec::as_slice).collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut j = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                j = (j + 1) % same.len();
                drop(black_box(route(same[j])));
            }
        });
        group.bench_function("4KiB prompt, 16 workers, one shard, 2 threads", |b| {
            b.iter(|| {
                i = (i + 1) % same.len();
                black_box(route(same[i]))
            })
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(1)).warm_up_time(Duration::from_millis(300));
    targets = bench, cache_aware
}
criterion_main!(benches);

//! The breaker's request hot path: `admit` + `record` on one worker, alone and
//! with a second thread hammering the same breaker.
//!
//! `cargo bench -p balancer-core --bench breaker` (or `cargo xtask bench breaker`).

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use balancer_core::breaker::{Breaker, Outcome, Settings};
use balancer_core::clock::MonotonicClock;
use criterion::{Criterion, criterion_group, criterion_main};

fn hot_path(b: &Breaker, clock: &MonotonicClock) {
    let ticket = b.admit(clock).expect("closed");
    b.record(ticket, black_box(Outcome::Success), clock);
}

fn bench(c: &mut Criterion) {
    let clock = MonotonicClock::new();
    let breaker = Arc::new(Breaker::new("http://w", Settings::default(), None));

    c.bench_function("admit+record/1 thread", |bench| {
        bench.iter(|| hot_path(&breaker, &clock))
    });

    c.bench_function("admit+record/2 threads same worker", |bench| {
        bench.iter_custom(|iters| {
            let stop = Arc::new(AtomicBool::new(false));
            let other = {
                let (breaker, stop) = (breaker.clone(), stop.clone());
                std::thread::spawn(move || {
                    let clock = MonotonicClock::new();
                    while !stop.load(Ordering::Relaxed) {
                        hot_path(&breaker, &clock);
                    }
                })
            };
            let start = Instant::now();
            for _ in 0..iters {
                hot_path(&breaker, &clock);
            }
            let elapsed = start.elapsed();
            stop.store(true, Ordering::Relaxed);
            other.join().unwrap();
            elapsed
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);

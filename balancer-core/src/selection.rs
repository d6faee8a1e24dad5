//! Picking a worker for one attempt.
//!
//! Owns the load-balancing policies and the consistent-hash ring. It reads
//! worker state (eligibility, in-flight counts) and changes none of it. Every
//! policy first looks for an eligible worker the request has not tried yet,
//! and falls back to a tried one only when no other is eligible.
//!
//! Cost: random probes find an eligible worker in O(1) expected time while
//! most of the fleet is eligible; a full scan happens only when the probes
//! miss, i.e. when most candidates are out. `least_load` compares every
//! candidate up to 64 of them and a random sample of 16 beyond.

use std::cell::Cell;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

use crate::clock::Clock;
use crate::registry::{Attempt, Worker};
use crate::ring::Ring;

/// How many random probes a sampling policy makes before scanning.
const PROBES: usize = 8;
/// Up to this many candidates, `least_load` compares them all.
const EXACT_LEAST_LOAD: usize = 64;
/// Beyond that, it compares this many random ones.
const LEAST_LOAD_SAMPLE: usize = 16;

/// A load-balancing policy (`--policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The next eligible worker after a shared cursor.
    RoundRobin,
    /// A uniformly random eligible worker.
    Random,
    /// The less loaded (fewer in flight) of two random eligible workers; `cache_aware` selects it
    /// too.
    PowerOfTwo,
    /// The eligible worker with the fewest requests in flight; over more than 64 candidates, the
    /// least loaded of a random sample.
    LeastLoad,
    /// The first eligible worker clockwise from the routing key's hash on the ring; round robin for
    /// a request without a key.
    ConsistentHash,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "round_robin" => Policy::RoundRobin,
            "random" => Policy::Random,
            // The reference gateway's default: without a prefix cache tree
            // here, the load-aware policy is the closest match.
            "power_of_two" | "cache_aware" => Policy::PowerOfTwo,
            "least_load" => Policy::LeastLoad,
            "consistent_hash" => Policy::ConsistentHash,
            other => {
                return Err(format!(
                    "unknown policy {other:?} (round_robin, random, power_of_two, least_load, consistent_hash)"
                ));
            }
        })
    }
}

impl Policy {
    /// The name `--policy` accepts for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::PowerOfTwo => "power_of_two",
            Policy::LeastLoad => "least_load",
            Policy::ConsistentHash => "consistent_hash",
        }
    }
}

/// Workers one selection avoids: `tried` while another is eligible,
/// `refused` (their breaker said no to this request) always.
#[derive(Clone, Copy)]
struct Skip<'a> {
    tried: &'a [u64],
    refused: &'a [u64],
}

/// The round-robin position of one selection, drawn from the shared cursor
/// at most once however often the selection looks again (a fallback to
/// tried workers, a breaker refusing), and only by the policies that use it.
#[derive(Default)]
struct Turn(Cell<Option<usize>>);

impl Turn {
    fn take(&self, cursor: &AtomicUsize) -> usize {
        if let Some(start) = self.0.get() {
            return start;
        }
        let start = cursor.fetch_add(1, Ordering::Relaxed);
        self.0.set(Some(start));
        start
    }
}

/// The policy plus the little state it keeps (the round-robin cursor).
#[derive(Debug)]
pub struct Selector {
    policy: Policy,
    cursor: AtomicUsize,
}

impl Selector {
    /// A selector for `policy`, its round-robin cursor at the first candidate.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            cursor: AtomicUsize::new(0),
        }
    }

    /// The policy it applies.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Picks a worker among `candidates` for one attempt. `tried` lists the ids
    /// of workers this request already used (they are avoided while any other
    /// is eligible); `key` is the routing key's hash for consistent hashing.
    pub fn select(
        &self,
        candidates: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        tried: &[u64],
        clock: &dyn Clock,
    ) -> Option<Arc<Worker>> {
        let skip = Skip {
            tried,
            refused: &[],
        };
        self.select_excluding(candidates, ring, key, skip, &Turn::default(), clock)
            .map(|i| candidates[i].clone())
    }

    /// Picks a worker and admits the attempt on its breaker. A worker whose
    /// breaker refuses (a race for a limited half-open slot lost, a degraded
    /// worker's share spent) is excluded for this pick and another one is
    /// tried, so the degraded share is the same under every policy: one
    /// share decision per admitted attempt, however often a policy checked
    /// eligibility.
    pub fn attempt(
        &self,
        candidates: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        tried: &[u64],
        clock: &dyn Clock,
    ) -> Option<Attempt> {
        // Allocated only when a breaker refuses.
        let mut refused = Vec::new();
        // One round-robin turn for the whole request: a refusal must not
        // move the cursor on, or the refused worker would come first again.
        let turn = Turn::default();
        // Each refusal excludes one candidate, so this ends.
        loop {
            let skip = Skip {
                tried,
                refused: &refused,
            };
            let i = self.select_excluding(candidates, ring, key, skip, &turn, clock)?;
            if let Some(attempt) = candidates[i].try_attempt(clock) {
                return Some(attempt);
            }
            refused.push(candidates[i].breaker.id());
        }
    }

    /// `select`, never returning a worker in `refused`.
    fn select_excluding(
        &self,
        candidates: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        skip: Skip<'_>,
        turn: &Turn,
        clock: &dyn Clock,
    ) -> Option<usize> {
        let Skip { tried, refused } = skip;
        let eligible = |w: &Worker| w.is_eligible(clock) && !refused.contains(&w.breaker.id());
        let fresh = |w: &Worker| eligible(w) && !tried.contains(&w.breaker.id());
        if let Some(i) = self.pick_unloaded(candidates, ring, key, turn, &fresh, clock) {
            return Some(i);
        }
        if tried.is_empty() {
            return None;
        }
        self.pick_unloaded(candidates, ring, key, turn, &eligible, clock)
    }

    /// `pick` among the workers `ok` allows, leaving out those that report an
    /// overload (`--worker-overload-waiting-requests`) while another can take
    /// the request; a shed is counted once per pick, on the first overloaded
    /// worker passed over.
    fn pick_unloaded(
        &self,
        ws: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        turn: &Turn,
        ok: &dyn Fn(&Worker) -> bool,
        clock: &dyn Clock,
    ) -> Option<usize> {
        let passed_over: Cell<Option<u64>> = Cell::new(None);
        let unloaded = |w: &Worker| {
            let overloaded = w.is_overloaded(clock);
            if overloaded && passed_over.get().is_none() {
                passed_over.set(Some(w.breaker.id()));
            }
            !overloaded
        };
        match self.pick(ws, ring, key, turn, &|w| ok(w) && unloaded(w)) {
            Some(i) => {
                if let Some(id) = passed_over.get()
                    && let Some(shed) = ws.iter().find(|w| w.breaker.id() == id)
                {
                    shed.load_cell().note_shed();
                }
                Some(i)
            }
            None => self.pick(ws, ring, key, turn, ok),
        }
    }

    fn pick(
        &self,
        ws: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        turn: &Turn,
        ok: &dyn Fn(&Worker) -> bool,
    ) -> Option<usize> {
        let n = ws.len();
        if n == 0 {
            return None;
        }
        match self.policy {
            Policy::RoundRobin => scan_from(ws, turn.take(&self.cursor) % n, ok),
            Policy::Random => sample(ws, ok).or_else(|| scan_from(ws, random_index(n), ok)),
            Policy::PowerOfTwo => match sample(ws, ok) {
                None => scan_from(ws, random_index(n), ok),
                Some(first) => match sample(ws, ok) {
                    Some(second) if ws[second].inflight() < ws[first].inflight() => Some(second),
                    _ => Some(first),
                },
            },
            // Exact over a small fleet; over a large one, the least loaded of
            // a random sample, which stays O(1) and is close to exact.
            Policy::LeastLoad if n > EXACT_LEAST_LOAD => {
                let mut rng = rand::rng();
                (0..LEAST_LOAD_SAMPLE)
                    .map(|_| rng.random_range(0..n))
                    .filter(|&i| ok(&ws[i]))
                    .min_by_key(|&i| ws[i].inflight())
                    .or_else(|| least_loaded(ws, ok))
            }
            Policy::LeastLoad => least_loaded(ws, ok),
            Policy::ConsistentHash => match (ring, key) {
                (Some(ring), Some(key)) => ring.walk(key).find(|&i| ok(&ws[i])),
                // No routing key: spread like round robin.
                _ => scan_from(ws, turn.take(&self.cursor) % n, ok),
            },
        }
    }
}

fn random_index(n: usize) -> usize {
    rand::rng().random_range(0..n)
}

/// A few random probes; `None` when they all missed (the caller then scans).
fn sample(ws: &[Arc<Worker>], ok: &dyn Fn(&Worker) -> bool) -> Option<usize> {
    let mut rng = rand::rng();
    (0..PROBES)
        .map(|_| rng.random_range(0..ws.len()))
        .find(|&i| ok(&ws[i]))
}

fn least_loaded(ws: &[Arc<Worker>], ok: &dyn Fn(&Worker) -> bool) -> Option<usize> {
    (0..ws.len())
        .filter(|&i| ok(&ws[i]))
        .min_by_key(|&i| ws[i].inflight())
}

fn scan_from(ws: &[Arc<Worker>], start: usize, ok: &dyn Fn(&Worker) -> bool) -> Option<usize> {
    (start..ws.len()).chain(0..start).find(|&i| ok(&ws[i]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::{FailureReason, Outcome, Settings};
    use crate::clock::ManualClock;
    use crate::health::HealthThresholds;
    use crate::registry::{Registry, RegistryConfig};
    use crate::ring::hash_key;
    use crate::spec::{BreakerDefaults, WorkerSpec};

    const ALL: [Policy; 5] = [
        Policy::RoundRobin,
        Policy::Random,
        Policy::PowerOfTwo,
        Policy::LeastLoad,
        Policy::ConsistentHash,
    ];

    fn fleet(n: usize) -> (Arc<Registry>, Arc<ManualClock>) {
        fleet_with(
            n,
            Settings {
                failure_threshold: 1,
                ..Settings::default()
            },
        )
    }

    fn fleet_with(n: usize, settings: Settings) -> (Arc<Registry>, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new());
        let registry = Registry::new(
            RegistryConfig {
                breaker: BreakerDefaults {
                    settings,
                    disabled: false,
                    slow_ttfb: None,
                    stream_failures: false,
                    l4_signals: false,
                },
                health: HealthThresholds {
                    failure: 1,
                    success: 1,
                },
                hash_rings: true,
                max_open_percent: 100,
            },
            clock.clone(),
        );
        let specs: Vec<_> = (0..n)
            .map(|i| {
                WorkerSpec::from_url(&format!("http://127.0.{}.{}:8000", i / 250, i % 250 + 1))
            })
            .collect();
        registry.add_all(&specs).unwrap();
        (registry, clock)
    }

    fn open(w: &Worker, clock: &ManualClock) {
        let t = w.breaker.admit(clock).unwrap();
        w.breaker
            .record(t, Outcome::Failure(FailureReason::Status), clock);
    }

    #[test]
    fn every_policy_finds_the_one_eligible_worker_in_a_large_fleet() {
        let (registry, clock) = fleet(1000);
        let fleet = registry.fleet();
        for w in &fleet.workers[1..] {
            open(w, &clock);
        }
        let (candidates, ring) = fleet.candidates(None);
        for policy in ALL {
            let s = Selector::new(policy);
            let picked = s.select(candidates, ring, Some(7), &[], &*clock).unwrap();
            assert_eq!(picked.url, fleet.workers[0].url, "{policy:?}");
        }
    }

    #[test]
    fn no_policy_picks_an_open_worker_and_all_open_means_none() {
        let (registry, clock) = fleet(6);
        let fleet = registry.fleet();
        let (candidates, ring) = fleet.candidates(None);
        for w in fleet.workers.iter().step_by(2) {
            open(w, &clock);
        }
        for policy in ALL {
            let s = Selector::new(policy);
            for key in 0..200 {
                let w = s.select(candidates, ring, Some(key), &[], &*clock).unwrap();
                assert!(
                    w.breaker.state() != crate::breaker::State::Open,
                    "{policy:?}"
                );
            }
        }
        for w in fleet.workers.iter().skip(1).step_by(2) {
            open(w, &clock);
        }
        for policy in ALL {
            assert!(
                Selector::new(policy)
                    .select(candidates, ring, None, &[], &*clock)
                    .is_none()
            );
        }
    }

    #[test]
    fn untried_workers_come_first_and_tried_ones_are_the_fallback() {
        let (registry, clock) = fleet(3);
        let fleet = registry.fleet();
        let (candidates, ring) = fleet.candidates(None);
        let ids: Vec<u64> = fleet.workers.iter().map(|w| w.breaker.id()).collect();
        for policy in ALL {
            let s = Selector::new(policy);
            let w = s
                .select(candidates, ring, Some(1), &ids[..2], &*clock)
                .unwrap();
            assert_eq!(
                w.breaker.id(),
                ids[2],
                "{policy:?} prefers the untried worker"
            );
            let w = s.select(candidates, ring, Some(1), &ids, &*clock);
            assert!(w.is_some(), "{policy:?} falls back to a tried worker");
        }
    }

    #[test]
    fn consistent_hash_skips_an_open_worker_without_reshuffling_the_rest() {
        let (registry, clock) = fleet(5);
        let fleet = registry.fleet();
        let (candidates, ring) = fleet.candidates(None);
        let s = Selector::new(Policy::ConsistentHash);
        let before: Vec<_> = (0..500u64)
            .map(|k| {
                s.select(
                    candidates,
                    ring,
                    Some(hash_key(&k.to_le_bytes())),
                    &[],
                    &*clock,
                )
                .unwrap()
                .url
                .clone()
            })
            .collect();
        open(&fleet.workers[2], &clock);
        for (k, owner) in before.iter().enumerate() {
            let now = s
                .select(
                    candidates,
                    ring,
                    Some(hash_key(&(k as u64).to_le_bytes())),
                    &[],
                    &*clock,
                )
                .unwrap();
            if *owner != fleet.workers[2].url {
                assert_eq!(now.url, *owner, "key {k} moved although its worker is fine");
            } else {
                assert_ne!(now.url, *owner);
            }
        }
    }

    #[test]
    fn degraded_share_is_per_request_under_every_policy() {
        use crate::breaker::{DegradedSettings, RequestCharges};
        const PCT: u32 = 25;
        for policy in [
            Policy::PowerOfTwo,
            Policy::Random,
            Policy::RoundRobin,
            Policy::LeastLoad,
        ] {
            let (registry, clock) = fleet_with(
                1,
                Settings {
                    failure_threshold: 1,
                    success_threshold: 1,
                    open_timeout: std::time::Duration::from_secs(1),
                    degraded: Some(DegradedSettings {
                        traffic_pct: PCT,
                        duration: std::time::Duration::from_secs(3600),
                    }),
                    ..Settings::default()
                },
            );
            let w = registry.fleet().workers[0].clone();
            let mut charges = RequestCharges::default();
            let mut a = w.try_attempt(&*clock).unwrap();
            a.record(
                &mut charges,
                Outcome::Failure(FailureReason::Status),
                &*clock,
            );
            clock.advance(std::time::Duration::from_secs(1));
            let mut trial = w.try_attempt(&*clock).expect("half-open");
            trial.record(&mut RequestCharges::default(), Outcome::Success, &*clock);
            assert_eq!(w.breaker.state(), crate::breaker::State::Degraded);
            let selector = Selector::new(policy);
            let fleet = registry.fleet();
            let admitted = (0..1000)
                .filter(|_| {
                    selector
                        .attempt(&fleet.workers, None, None, &[], &*clock)
                        .is_some()
                })
                .count();
            assert!(
                admitted.abs_diff(PCT as usize * 10) <= 50,
                "{policy:?}: the only candidate got {admitted} of 1000, want {PCT}% ± 5"
            );
        }
    }
}

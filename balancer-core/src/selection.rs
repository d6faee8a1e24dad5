//! Picking a worker for one attempt.
//!
//! Owns the load-balancing policies and the consistent-hash ring. It reads
//! worker state (eligibility, in-flight counts) and changes none of it. Every
//! policy first looks for an eligible worker the request has not tried yet,
//! and falls back to a tried one only when no other is eligible.
//!
//! `cache_aware`'s prefix trees and rule live in its `cache_aware` submodule ([`CacheAware`]).
//!
//! Cost: random probes find an eligible worker in O(1) expected time while
//! most of the fleet is eligible; a full scan happens only when the probes
//! miss, i.e. when most candidates are out. `least_load` compares every
//! candidate up to 64 of them and a random sample of 16 beyond.

mod cache_aware;

pub use cache_aware::{CacheAware, CacheAwareConfig, Prompt, Reason};

use std::cell::Cell;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

use crate::clock::{Clock, Nanos};
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
    /// The less loaded ([`Worker::load`]) of two random eligible workers.
    PowerOfTwo,
    /// The least loaded ([`Worker::load`]) eligible worker; over more than 64 candidates, the
    /// least loaded of a random sample.
    LeastLoad,
    /// The eligible worker that probably holds the prompt's prefix in its cache, unless the load
    /// is out of balance ([`CacheAware`]).
    CacheAware,
    /// The first eligible worker clockwise from the routing key's hash on the ring; round robin for
    /// a request without a key.
    ConsistentHash,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.map(Policy::as_str).to_vec();
                format!("unknown policy {s:?} ({})", names.join(", "))
            })
    }
}

impl Policy {
    /// Every policy, in the order `--help` lists them.
    pub const ALL: [Policy; 6] = [
        Policy::RoundRobin,
        Policy::Random,
        Policy::PowerOfTwo,
        Policy::LeastLoad,
        Policy::CacheAware,
        Policy::ConsistentHash,
    ];

    /// The name `--policy` accepts for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::PowerOfTwo => "power_of_two",
            Policy::LeastLoad => "least_load",
            Policy::CacheAware => "cache_aware",
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

/// The policy plus the state it keeps (the round-robin cursor, the prefix
/// trees of `cache_aware`).
#[derive(Debug)]
pub struct Selector {
    policy: Policy,
    cursor: AtomicUsize,
    cache: Option<Arc<CacheAware>>,
}

impl Selector {
    /// A selector for `policy`, its round-robin cursor at the first candidate;
    /// `cache_aware` with its default settings.
    pub fn new(policy: Policy) -> Self {
        Self::with_cache_aware(policy, CacheAwareConfig::default())
    }

    /// A selector for `policy`; `cache` configures `cache_aware` and is
    /// unused by the other policies.
    pub fn with_cache_aware(policy: Policy, cache: CacheAwareConfig) -> Self {
        Self {
            policy,
            cursor: AtomicUsize::new(0),
            cache: (policy == Policy::CacheAware).then(|| Arc::new(CacheAware::new(cache))),
        }
    }

    /// The policy it applies.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The prefix trees, under `cache_aware`.
    pub fn cache_aware(&self) -> Option<&Arc<CacheAware>> {
        self.cache.as_ref()
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
        self.select_excluding(candidates, ring, key, None, skip, &Turn::default(), clock)
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
        self.attempt_prompt(candidates, ring, key, None, tried, clock)
    }

    /// [`Selector::attempt`] for a request whose prompt `cache_aware` routes
    /// by; the other policies ignore `prompt`. The chosen worker's entry for
    /// the prompt is inserted or refreshed once its breaker admitted it.
    pub fn attempt_prompt(
        &self,
        candidates: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        prompt: Option<Prompt<'_>>,
        tried: &[u64],
        clock: &dyn Clock,
    ) -> Option<Attempt> {
        let models = match (&self.cache, prompt) {
            (Some(cache), Some(p)) => Some((cache, p, cache.models(p.model))),
            _ => None,
        };
        let lookup = models
            .as_ref()
            .and_then(|(cache, p, models)| cache.lookup(*p, models, clock.now()));
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
            let i =
                self.select_excluding(candidates, ring, key, lookup.as_ref(), skip, &turn, clock)?;
            if let Some(attempt) = candidates[i].try_attempt(clock) {
                if let (Some(cache), Some(lookup)) = (&self.cache, &lookup) {
                    cache.chose(lookup, &candidates[i]);
                }
                return Some(attempt);
            }
            refused.push(candidates[i].breaker.id());
        }
    }

    /// `select`, never returning a worker in `refused`.
    #[expect(
        clippy::too_many_arguments,
        reason = "one selection's inputs, passed down unchanged"
    )]
    fn select_excluding(
        &self,
        candidates: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        lookup: Option<&cache_aware::Lookup<'_>>,
        skip: Skip<'_>,
        turn: &Turn,
        clock: &dyn Clock,
    ) -> Option<usize> {
        let Skip { tried, refused } = skip;
        let eligible = |w: &Worker| w.is_eligible(clock) && !refused.contains(&w.breaker.id());
        let fresh = |w: &Worker| eligible(w) && !tried.contains(&w.breaker.id());
        if let Some(i) = self.pick_unloaded(candidates, ring, key, lookup, turn, &fresh, clock) {
            return Some(i);
        }
        if tried.is_empty() {
            return None;
        }
        self.pick_unloaded(candidates, ring, key, lookup, turn, &eligible, clock)
    }

    /// `pick` among the workers `ok` allows, leaving out those that report an
    /// overload (`--worker-overload-waiting-requests`) while another can take
    /// the request; a shed is counted once per pick, on the first overloaded
    /// worker passed over.
    #[expect(
        clippy::too_many_arguments,
        reason = "one selection's inputs, passed down unchanged"
    )]
    fn pick_unloaded(
        &self,
        ws: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        lookup: Option<&cache_aware::Lookup<'_>>,
        turn: &Turn,
        ok: &dyn Fn(&Worker) -> bool,
        clock: &dyn Clock,
    ) -> Option<usize> {
        let now = clock.now();
        let passed_over: Cell<Option<u64>> = Cell::new(None);
        let unloaded = |w: &Worker| {
            let overloaded = w.is_overloaded(clock);
            if overloaded && passed_over.get().is_none() {
                passed_over.set(Some(w.breaker.id()));
            }
            !overloaded
        };
        match self.pick(ws, ring, key, lookup, turn, &|w| ok(w) && unloaded(w), now) {
            Some(i) => {
                if let Some(id) = passed_over.get()
                    && let Some(shed) = ws.iter().find(|w| w.breaker.id() == id)
                {
                    shed.load_cell().note_shed();
                    if let Some(lookup) = lookup {
                        lookup.shed();
                    }
                }
                Some(i)
            }
            None => self.pick(ws, ring, key, lookup, turn, ok, now),
        }
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "one selection's inputs, passed down unchanged"
    )]
    fn pick(
        &self,
        ws: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        lookup: Option<&cache_aware::Lookup<'_>>,
        turn: &Turn,
        ok: &dyn Fn(&Worker) -> bool,
        now: Nanos,
    ) -> Option<usize> {
        let n = ws.len();
        if n == 0 {
            return None;
        }
        match self.policy {
            Policy::RoundRobin => round_robin(ws, turn.take(&self.cursor) % n, ok),
            Policy::Random => sample(ws, ok).or_else(|| scan_from(ws, random_index(n), ok)),
            Policy::PowerOfTwo => match sample(ws, ok) {
                None => scan_from(ws, random_index(n), ok),
                Some(first) => match sample(ws, ok) {
                    Some(second) if ws[second].load(now) < ws[first].load(now) => Some(second),
                    _ => Some(first),
                },
            },
            Policy::CacheAware => match &self.cache {
                Some(cache) => cache.pick(ws, ok, lookup, now),
                None => least_loaded(ws, ok, now),
            },
            // Exact over a small fleet; over a large one, the least loaded of
            // a random sample, which stays O(1) and is close to exact.
            Policy::LeastLoad if n > EXACT_LEAST_LOAD => {
                let mut rng = rand::rng();
                (0..LEAST_LOAD_SAMPLE)
                    .map(|_| rng.random_range(0..n))
                    .filter(|&i| ok(&ws[i]))
                    .min_by_key(|&i| ws[i].load(now))
                    .or_else(|| least_loaded(ws, ok, now))
            }
            Policy::LeastLoad => least_loaded(ws, ok, now),
            Policy::ConsistentHash => match (ring, key) {
                (Some(ring), Some(key)) => ring.walk(key).find(|&i| ok(&ws[i])),
                // No routing key: spread like round robin.
                _ => round_robin(ws, turn.take(&self.cursor) % n, ok),
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

fn least_loaded(ws: &[Arc<Worker>], ok: &dyn Fn(&Worker) -> bool, now: Nanos) -> Option<usize> {
    (0..ws.len())
        .filter(|&i| ok(&ws[i]))
        .min_by_key(|&i| ws[i].load(now))
}

/// The worker at the cursor; when it cannot be taken, a random eligible one,
/// so its share spreads over the others instead of all going to the next.
fn round_robin(ws: &[Arc<Worker>], start: usize, ok: &dyn Fn(&Worker) -> bool) -> Option<usize> {
    if ok(&ws[start]) {
        return Some(start);
    }
    sample(ws, ok).or_else(|| scan_from(ws, random_index(ws.len()), ok))
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
    use crate::registry::{DEFAULT_REMOVED_GRACE, Registry, RegistryConfig};
    use crate::ring::hash_key;
    use crate::spec::{BreakerDefaults, WorkerSpec};

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
                    min_completion_tokens: None,
                    l4_signals: false,
                },
                health: HealthThresholds {
                    failure: 1,
                    success: 1,
                },
                hash_rings: true,
                max_open_percent: 100,
                removed_grace: DEFAULT_REMOVED_GRACE,
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
        for policy in Policy::ALL {
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
        for policy in Policy::ALL {
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
        for policy in Policy::ALL {
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
        for policy in Policy::ALL {
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
            Policy::CacheAware,
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
                    let prompt = Prompt {
                        model: "",
                        text: b"system: a long shared prompt",
                    };
                    selector
                        .attempt_prompt(&fleet.workers, None, None, Some(prompt), &[], &*clock)
                        .is_some()
                })
                .count();
            assert!(
                admitted.abs_diff(PCT as usize * 10) <= 50,
                "{policy:?}: the only candidate got {admitted} of 1000, want {PCT}% ± 5"
            );
        }
    }

    const SYSTEM: &[u8] = b"system: you are a helpful assistant who answers in French.\nuser: ";

    fn prompt(text: &[u8]) -> Option<Prompt<'_>> {
        Some(Prompt { model: "m", text })
    }

    /// One cache_aware choice for `text`, its attempt dropped at once.
    fn route(
        s: &Selector,
        ws: &[Arc<Worker>],
        text: &[u8],
        tried: &[u64],
        clock: &ManualClock,
    ) -> u64 {
        s.attempt_prompt(ws, None, None, prompt(text), tried, clock)
            .unwrap()
            .worker()
            .breaker
            .id()
    }

    #[test]
    fn cache_aware_sends_a_prefix_back_to_its_worker_and_a_new_one_to_the_least_cached() {
        let (registry, clock) = fleet(4);
        let ws = registry.fleet().workers.clone();
        let s = Selector::new(Policy::CacheAware);
        let first = route(&s, &ws, &[SYSTEM, b"hello"].concat(), &[], &clock);
        for turn in 0..20 {
            let text = [SYSTEM, b"hello", format!(" turn {turn}").as_bytes()].concat();
            assert_eq!(route(&s, &ws, &text, &[], &clock), first, "turn {turn}");
        }
        let cache = s.cache_aware().unwrap();
        assert_eq!(cache.decisions(Reason::CacheMatch), 20);
        // An unrelated prompt goes to a worker holding nothing yet.
        let other = route(&s, &ws, b"completely different text", &[], &clock);
        assert_ne!(other, first);
        assert_eq!(cache.decisions(Reason::LeastCached), 2);
        assert!(cache.cached(first) > SYSTEM.len() as u64);
    }

    #[test]
    fn cache_aware_never_picks_a_holder_its_breaker_refuses_and_forgets_an_opened_one() {
        let (registry, clock) = fleet_with(
            3,
            Settings {
                failure_threshold: 1,
                half_open_max_inflight: 1,
                open_timeout: std::time::Duration::from_secs(1),
                ..Settings::default()
            },
        );
        let ws = registry.fleet().workers.clone();
        let s = Selector::new(Policy::CacheAware);
        let text = [SYSTEM, b"question"].concat();
        let holder = route(&s, &ws, &text, &[], &clock);
        let w = ws.iter().find(|w| w.breaker.id() == holder).unwrap();
        // Open: none of its prefix's traffic; the agent drops its entries.
        open(w, &clock);
        for _ in 0..20 {
            assert_ne!(route(&s, &ws, &text, &[], &clock), holder);
        }
        s.cache_aware().unwrap().forget(holder);
        assert_eq!(s.cache_aware().unwrap().cached(holder), 0);
        // Half-open with its one trial slot taken: refused, another worker.
        clock.advance(std::time::Duration::from_secs(1));
        let trial = w.try_attempt(&*clock).expect("half-open trial");
        assert_eq!(w.breaker.state(), crate::breaker::State::HalfOpen);
        for _ in 0..20 {
            assert_ne!(route(&s, &ws, &text, &[], &clock), holder);
        }
        drop(trial);
        // Its slot free again, it may take the trial.
        let ids: Vec<u64> = ws
            .iter()
            .map(|w| w.breaker.id())
            .filter(|&i| i != holder)
            .collect();
        assert_eq!(route(&s, &ws, &text, &ids, &clock), holder);
    }

    #[test]
    fn cache_aware_retries_on_another_worker_while_one_is_eligible() {
        let (registry, clock) = fleet(3);
        let ws = registry.fleet().workers.clone();
        let s = Selector::new(Policy::CacheAware);
        let text = [SYSTEM, b"retry me"].concat();
        let first = route(&s, &ws, &text, &[], &clock);
        let second = route(&s, &ws, &text, &[first], &clock);
        assert_ne!(second, first);
        let third = route(&s, &ws, &text, &[first, second], &clock);
        assert!(![first, second].contains(&third));
        // All tried: the best of them again rather than nothing.
        assert!(
            s.attempt_prompt(
                &ws,
                None,
                None,
                prompt(&text),
                &[first, second, third],
                &*clock
            )
            .is_some()
        );
    }

    #[test]
    fn cache_aware_sends_to_the_least_loaded_when_load_is_imbalanced() {
        let (registry, clock) = fleet(2);
        let ws = registry.fleet().workers.clone();
        let s = Selector::new(Policy::CacheAware);
        let text = [SYSTEM, b"busy"].concat();
        let holder = route(&s, &ws, &text, &[], &clock);
        let w = ws.iter().find(|w| w.breaker.id() == holder).unwrap();
        let held: Vec<_> = (0..65).map(|_| w.try_attempt(&*clock).unwrap()).collect();
        assert_ne!(route(&s, &ws, &text, &[], &clock), holder);
        assert_eq!(s.cache_aware().unwrap().decisions(Reason::Balance), 1);
        drop(held);
        // Balanced again: both now hold the prefix, so a match decides.
        route(&s, &ws, &text, &[], &clock);
        assert_eq!(s.cache_aware().unwrap().decisions(Reason::CacheMatch), 1);
    }

    #[test]
    fn cache_aware_moves_a_prefix_off_a_worker_slow_enough_to_lose_its_benefit() {
        let (registry, clock) = fleet(2);
        let ws = registry.fleet().workers.clone();
        let text = [SYSTEM, b"slow"].concat();
        for weighting in [true, false] {
            let s = Selector::with_cache_aware(
                Policy::CacheAware,
                CacheAwareConfig {
                    ttft_weighting: weighting,
                    ..CacheAwareConfig::default()
                },
            );
            let holder = route(&s, &ws, &text, &[], &clock);
            for w in &ws {
                let ttfb = if w.breaker.id() == holder { 600 } else { 100 };
                w.observe_ttfb(std::time::Duration::from_millis(ttfb), clock.now());
            }
            let now = route(&s, &ws, &text, &[], &clock);
            assert_eq!(now != holder, weighting, "weighting {weighting}");
            // Twice as slow is worth its match: it keeps the prefix.
            if weighting {
                let s2 = Selector::new(Policy::CacheAware);
                let holder = route(&s2, &ws, &text, &[], &clock);
                let fast = ws.iter().find(|w| w.breaker.id() != holder).unwrap();
                let slow = ws.iter().find(|w| w.breaker.id() == holder).unwrap();
                for _ in 0..30 {
                    slow.observe_ttfb(std::time::Duration::from_millis(200), clock.now());
                    fast.observe_ttfb(std::time::Duration::from_millis(100), clock.now());
                }
                assert_eq!(route(&s2, &ws, &text, &[], &clock), holder);
            }
        }
    }

    #[test]
    fn load_aware_policies_do_not_favour_a_worker_that_fails_fast() {
        let (registry, clock) = fleet_with(
            2,
            Settings {
                failure_threshold: 1000,
                ..Settings::default()
            },
        );
        let ws = registry.fleet().workers.clone();
        let mut charges = crate::breaker::RequestCharges::default();
        for _ in 0..8 {
            let mut a = ws[0].try_attempt(&*clock).unwrap();
            a.record(
                &mut charges,
                Outcome::Failure(FailureReason::Status),
                &*clock,
            );
            charges = Default::default();
        }
        // The healthy worker is busier, yet preferred.
        let busy: Vec<_> = (0..3)
            .map(|_| ws[1].try_attempt(&*clock).unwrap())
            .collect();
        assert!(ws[0].load(clock.now()) > ws[1].load(clock.now()));
        for policy in [Policy::LeastLoad, Policy::PowerOfTwo] {
            let s = Selector::new(policy);
            let to_failing = (0..200)
                .filter(|_| s.select(&ws, None, None, &[], &*clock).unwrap().url == ws[0].url)
                .count();
            // Power of two draws the same worker twice a quarter of the time.
            assert!(
                to_failing <= 80,
                "{policy:?}: {to_failing} of 200 to the failing worker"
            );
        }
        drop(busy);
    }

    #[test]
    fn round_robin_spreads_an_open_workers_share_over_the_others() {
        let (registry, clock) = fleet(4);
        let ws = registry.fleet().workers.clone();
        open(&ws[1], &clock);
        let s = Selector::new(Policy::RoundRobin);
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            let w = s.select(&ws, None, None, &[], &*clock).unwrap();
            counts[ws.iter().position(|x| x.url == w.url).unwrap()] += 1;
        }
        assert_eq!(counts[1], 0);
        // Each gets a third (1333); handing the share to the next would give
        // worker 2 half (2000).
        for i in [0, 2, 3] {
            assert!(counts[i].abs_diff(1333) < 150, "{counts:?}");
        }
    }

    #[test]
    fn cache_aware_memory_stays_bounded_between_evictions_and_within_it_after() {
        let (registry, clock) = fleet(4);
        let ws = registry.fleet().workers.clone();
        let max = 64 * 1024;
        let s = Selector::with_cache_aware(
            Policy::CacheAware,
            CacheAwareConfig {
                max_tree_size: max,
                ..CacheAwareConfig::default()
            },
        );
        let cache = s.cache_aware().unwrap();
        for i in 0..4000 {
            let text = format!("{i:08} unique prompt {}", "padding ".repeat(16));
            route(&s, &ws, text.as_bytes(), &[], &clock);
            // Without a tick, a shard is cut back at twice its share.
            assert!(cache.size() <= 2 * max, "{} after {i}", cache.size());
        }
        assert!(cache.size() > max, "the test outgrew the bound");
        for w in &ws {
            let id = w.breaker.id();
            assert_eq!(
                cache.cached(id),
                cache.cached_in_trees(id),
                "inline evictions"
            );
        }
        assert!(cache.evict() <= max);
        assert!(cache.size() <= max);
        for w in &ws {
            let id = w.breaker.id();
            assert_eq!(
                cache.cached(id),
                cache.cached_in_trees(id),
                "the eviction tick"
            );
        }
        let held: u64 = ws.iter().map(|w| cache.cached(w.breaker.id())).sum();
        assert!(
            held >= max as u64 / 2,
            "each worker's share is counted: {held}"
        );
        // Removal drops a worker's entries everywhere.
        cache.forget(ws[0].breaker.id());
        assert_eq!(cache.cached(ws[0].breaker.id()), 0);
    }
}

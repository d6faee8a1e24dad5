//! `--policy cache_aware`: send a prompt to the worker that probably holds
//! its prefix in its KV cache, unless the load is out of balance or that
//! worker has become slow.
//!
//! Owns the prefix trees ([`PrefixTree`], one set per model, each split in
//! [`SHARDS`] trees by the prompt's head so serving threads rarely meet on a
//! lock and no lock is global), the rule that picks among the candidates the
//! breakers left, and its series. It reads worker state (load, recent time to
//! first byte) and changes none of it; the agent tells it when a worker's
//! entries must go ([`CacheAware::forget`]) and when to evict
//! ([`CacheAware::evict`]).
//!
//! The rule, per request, over the eligible candidates (the reference
//! gateway's, plus the time-to-first-byte weighing):
//! 1. load imbalanced (`max - min > balance_abs_threshold` and
//!    `max > min * balance_rel_threshold`): the least loaded (`balance`);
//! 2. else, when the longest match covers at least `cache_threshold` of the
//!    prompt: the worker with the least predicted time to first token, where
//!    a worker's prediction is its recent time to first byte times
//!    `CACHED_COST + (1 - CACHED_COST) * uncached / length`: the longest
//!    match (`cache_match`) unless another worker is predicted faster by
//!    more than 10 ms (`slow`);
//! 3. else the worker holding the least cached text (`least_cached`).
//!
//! Ties go to the less loaded, then to a random one, never to the first in
//! the list.

use std::collections::hash_map::Entry;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::ArcSwap;
use foldhash::HashMap;
use rand::Rng;

use crate::clock::Nanos;
use crate::metrics::{Histogram, MetricsSource, Writer};
use crate::prefix_tree::{Matches, PrefixTree, WorkerId};
use crate::registry::Worker;

/// Trees per model. A power of two; the prompt's head picks one.
pub const SHARDS: usize = 16;
/// The bytes of a prompt's head that pick its shard. Prompts sharing fewer
/// leading bytes are never matched with each other: 32 bytes are a handful
/// of tokens, less than one KV-cache block (16 tokens), and save nothing.
const SHARD_HEAD: usize = 32;
/// Beyond this many models, prompts share one set of trees: model names come
/// from clients, and a tree per invented name would be unbounded memory.
const MAX_MODELS: usize = 256;
/// Share of a full prefill's time to first token that a fully cached prompt
/// still costs (scheduling, the last block, the first decode step).
const CACHED_COST: f64 = 0.2;
/// A predicted gain in time to first token below this is noise (a
/// connection's set-up, a scheduler's tick), not worth a cache miss.
const MIN_GAIN_SECS: f64 = 0.010;
/// A shard past this multiple of its budget is evicted inline, so a burst
/// between two eviction ticks cannot outgrow memory.
const INLINE_EVICTION_FACTOR: usize = 2;

/// `--cache-threshold`, `--balance-*-threshold`, `--eviction-interval-secs`,
/// `--max-tree-size`, `--disable-ttft-weighting`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// The least share of the prompt the best holder must match to get it.
    pub cache_threshold: f64,
    /// Imbalanced when the most and least loaded differ by more than this ...
    pub balance_abs_threshold: u32,
    /// ... and the most loaded carries more than this multiple of the least.
    pub balance_rel_threshold: f64,
    /// How often the agent evicts down to `max_tree_size`.
    pub eviction_interval: Duration,
    /// Bytes each model's trees take at most after an eviction (text plus
    /// 64 per node; twice that at any time).
    pub max_tree_size: usize,
    /// Weigh each worker's recent time to first byte against its match.
    pub ttft_weighting: bool,
}

impl Default for CacheAwareConfig {
    /// `smg launch`'s defaults (smg 1.13.0).
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval: Duration::from_secs(60),
            max_tree_size: 1 << 26,
            ttft_weighting: true,
        }
    }
}

/// Why a worker was chosen (the `reason` label of `routing_decisions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The holder of the longest match.
    CacheMatch,
    /// Load out of balance: the least loaded.
    Balance,
    /// No match good enough: the worker holding the least.
    LeastCached,
    /// A match holder predicted slower than another candidate.
    Slow,
    /// The worker the rule chose reported an overload
    /// (`--worker-overload-waiting-requests`): another took the request.
    Overload,
}

impl Reason {
    const ALL: [Reason; 5] = [
        Reason::CacheMatch,
        Reason::Balance,
        Reason::LeastCached,
        Reason::Slow,
        Reason::Overload,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CacheMatch => "cache_match",
            Reason::Balance => "balance",
            Reason::LeastCached => "least_cached",
            Reason::Slow => "slow",
            Reason::Overload => "overload",
        }
    }
}

/// A request's prompt as routing sees it.
#[derive(Debug, Clone, Copy)]
pub struct Prompt<'a> {
    /// The trees' key: a model some worker declares, or `""`.
    pub model: &'a str,
    /// The rendered prompt text, already cut to the bytes that matter.
    pub text: &'a [u8],
}

/// One worker's cached bytes over every tree, kept beside its URL for the
/// series.
#[derive(Debug)]
struct Held {
    url: Arc<str>,
    bytes: AtomicU64,
}

type Shard = Mutex<PrefixTree>;
/// Each model's shards, by model name.
pub(super) type Models = HashMap<Box<str>, Arc<[Shard]>>;

/// The trees of `model` in `models`: its own, or past [`MAX_MODELS`] the
/// shared ones.
fn shards_of<'m>(models: &'m Models, model: &str) -> Option<&'m [Shard]> {
    match models.get(model) {
        Some(shards) => Some(shards),
        None if models.len() >= MAX_MODELS => models.get("").map(|s| &**s),
        None => None,
    }
}

/// The prefix trees, the rule and its counters; see the module documentation.
#[derive(Debug)]
pub struct CacheAware {
    config: CacheAwareConfig,
    models: ArcSwap<Models>,
    held: ArcSwap<HashMap<WorkerId, Arc<Held>>>,
    /// Serialises additions to `models` and `held` (a new model, a new
    /// worker): never taken for a known one.
    grow: Mutex<()>,
    decisions: [AtomicU64; Reason::ALL.len()],
    matched: Histogram,
}

/// Buckets of the matched share of a prompt.
const MATCHED_BUCKETS: &[f64] = &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0];

fn lock(shard: &Shard) -> MutexGuard<'_, PrefixTree> {
    // A panic mid-update leaves an approximate tree approximate.
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

/// What one request's selection knows about its prompt: the matches, read
/// once under the shard's lock.
#[derive(Debug)]
pub(super) struct Lookup<'a> {
    prompt: Prompt<'a>,
    shard: &'a Shard,
    matches: Matches,
    now: Nanos,
    reason: std::cell::Cell<Reason>,
}

impl CacheAware {
    /// Empty trees under `config`.
    pub fn new(config: CacheAwareConfig) -> Self {
        Self {
            config,
            models: ArcSwap::default(),
            held: ArcSwap::default(),
            grow: Mutex::new(()),
            decisions: Default::default(),
            matched: Histogram::new(MATCHED_BUCKETS),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &CacheAwareConfig {
        &self.config
    }

    /// The model map, holding trees for `model` (created on first use). The
    /// request borrows its shards from this guard: no shared reference count
    /// is touched per request.
    pub(super) fn models(&self, model: &str) -> arc_swap::Guard<Arc<Models>> {
        let models = self.models.load();
        if shards_of(&models, model).is_some() {
            return models;
        }
        drop(models);
        {
            let _grow = self.grow.lock().unwrap_or_else(|e| e.into_inner());
            let current = self.models.load();
            if shards_of(&current, model).is_none() {
                let mut next = Models::clone(&current);
                let key = if next.len() >= MAX_MODELS { "" } else { model };
                next.entry(key.into())
                    .or_insert_with(|| (0..SHARDS).map(|_| Mutex::default()).collect());
                self.models.store(Arc::new(next));
            }
        }
        self.models.load()
    }

    /// Reads the matches of `prompt` for one selection, in the trees
    /// `models` holds for its model.
    pub(super) fn lookup<'a>(
        &self,
        prompt: Prompt<'a>,
        models: &'a Models,
        now: Nanos,
    ) -> Option<Lookup<'a>> {
        let shards = shards_of(models, prompt.model)?;
        let head = &prompt.text[..prompt.text.len().min(SHARD_HEAD)];
        let mut h = foldhash::fast::FixedState::with_seed(0).build_hasher();
        h.write(head);
        let shard = &shards[h.finish() as usize % SHARDS];
        let mut matches = Matches::new();
        lock(shard).match_prefix(prompt.text, &mut matches);
        Some(Lookup {
            prompt,
            shard,
            matches,
            now,
            reason: std::cell::Cell::new(Reason::Balance),
        })
    }

    /// Records the choice of `worker` for the looked-up prompt: its entry
    /// is inserted or refreshed, the decision and matched share counted.
    pub(super) fn chose(&self, lookup: &Lookup<'_>, worker: &Worker) {
        let id = worker.breaker.id();
        let len = lookup.prompt.text.len();
        if len > 0 {
            let matched = lookup.matched(id);
            self.matched.observe_value(matched as f64 / len as f64);
        }
        self.decisions[lookup.reason.get() as usize].fetch_add(1, Ordering::Relaxed);
        if len == 0 {
            return;
        }
        let budget = self.config.max_tree_size / SHARDS;
        let mut tree = lock(lookup.shard);
        let before = tree.cached(id);
        tree.insert(lookup.prompt.text, id, lookup.now);
        let added = (tree.cached(id) - before) as u64;
        // Counted before an eviction settles what it frees.
        if added > 0 {
            self.add_held(worker, added);
        }
        if tree.footprint() > budget.saturating_mul(INLINE_EVICTION_FACTOR) {
            self.evict_shard(&mut tree, budget);
        }
    }

    /// Counts `bytes` more for `worker`, adding its entry on first use.
    fn add_held(&self, worker: &Worker, bytes: u64) {
        let id = worker.breaker.id();
        if let Some(h) = self.held.load().get(&id) {
            h.bytes.fetch_add(bytes, Ordering::Relaxed);
            return;
        }
        let _grow = self.grow.lock().unwrap_or_else(|e| e.into_inner());
        let mut held = HashMap::clone(&self.held.load());
        let h = match held.entry(id) {
            Entry::Occupied(e) => e.get().clone(),
            Entry::Vacant(e) => e
                .insert(Arc::new(Held {
                    url: worker.url.clone(),
                    bytes: AtomicU64::new(0),
                }))
                .clone(),
        };
        h.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.held.store(Arc::new(held));
    }

    /// Applies a shard's change in per-worker bytes to the totals.
    fn settle(&self, before: &[(WorkerId, usize)], tree: &PrefixTree) {
        let held = self.held.load();
        for &(w, was) in before {
            if let Some(h) = held.get(&w) {
                let freed = (was - tree.cached(w)) as u64;
                // Saturating: an insert racing with `forget` may have
                // counted into the entry `forget` dropped.
                let _ = h
                    .bytes
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                        Some(b.saturating_sub(freed))
                    });
            }
        }
    }

    fn evict_shard(&self, tree: &mut PrefixTree, budget: usize) {
        let before: Vec<_> = tree.holders().collect();
        tree.evict(budget);
        self.settle(&before, tree);
    }

    /// Evicts every tree down to its share of `max_tree_size`, least
    /// recently used leaves first (the agent calls it every
    /// `eviction_interval`). Returns the bytes all trees take after.
    pub fn evict(&self) -> usize {
        let budget = self.config.max_tree_size / SHARDS;
        let mut total = 0;
        for shards in self.models.load().values() {
            for shard in shards.iter() {
                let mut tree = lock(shard);
                self.evict_shard(&mut tree, budget);
                total += tree.footprint();
            }
        }
        total
    }

    /// Drops every entry of the worker with breaker id `id`: its breaker
    /// opened (a worker that failed has probably lost its cache) or it left.
    pub fn forget(&self, id: WorkerId) {
        for shards in self.models.load().values() {
            for shard in shards.iter() {
                lock(shard).remove_worker(id);
            }
        }
        if self.held.load().contains_key(&id) {
            let _grow = self.grow.lock().unwrap_or_else(|e| e.into_inner());
            let mut held = HashMap::clone(&self.held.load());
            held.remove(&id);
            self.held.store(Arc::new(held));
        }
    }

    /// Bytes all trees take: their text, shared prefixes counted once, plus
    /// a node's cost per node (what `max_tree_size` bounds).
    pub fn size(&self) -> usize {
        let models = self.models.load();
        models
            .values()
            .flat_map(|shards| shards.iter())
            .map(|shard| lock(shard).footprint())
            .sum()
    }

    /// The worker's bytes summed over the trees themselves, to check the
    /// running count against.
    #[cfg(test)]
    pub(super) fn cached_in_trees(&self, id: WorkerId) -> u64 {
        let models = self.models.load();
        models
            .values()
            .flat_map(|shards| shards.iter())
            .map(|shard| lock(shard).cached(id) as u64)
            .sum()
    }

    /// Bytes the worker with breaker id `id` holds over every tree.
    pub fn cached(&self, id: WorkerId) -> u64 {
        self.held
            .load()
            .get(&id)
            .map_or(0, |h| h.bytes.load(Ordering::Relaxed))
    }

    /// Decisions made for `reason` so far.
    pub fn decisions(&self, reason: Reason) -> u64 {
        self.decisions[reason as usize].load(Ordering::Relaxed)
    }

    /// The pick among `ws` (those `ok` lets through) for `lookup`'s prompt,
    /// or the least loaded without a prompt. Records the reason in `lookup`.
    pub(super) fn pick(
        &self,
        ws: &[Arc<Worker>],
        ok: &dyn Fn(&Worker) -> bool,
        lookup: Option<&Lookup<'_>>,
        now: Nanos,
    ) -> Option<usize> {
        let c = &self.config;
        let (mut min, mut max, mut any) = (u32::MAX, 0, false);
        for w in ws.iter().filter(|w| ok(w)) {
            let load = w.load(now);
            (min, max, any) = (min.min(load), max.max(load), true);
        }
        if !any {
            return None;
        }
        let least_loaded = || best_by(ws, ok, |w| (w.load(now), 0));
        let imbalanced = max - min > c.balance_abs_threshold
            && f64::from(max) > f64::from(min) * c.balance_rel_threshold;
        let lookup = match lookup {
            Some(l) if !imbalanced && !l.prompt.text.is_empty() => l,
            _ => {
                if let Some(l) = lookup {
                    l.reason.set(Reason::Balance);
                }
                return least_loaded();
            }
        };
        let len = lookup.prompt.text.len();
        // Longest match first; `best_by` minimises.
        let best = best_by(ws, ok, |w| {
            (usize::MAX - lookup.matched(w.breaker.id()), w.load(now))
        })?;
        let matched = lookup.matched(ws[best].breaker.id());
        if matched == 0 || (matched as f64) < c.cache_threshold * len as f64 {
            lookup.reason.set(Reason::LeastCached);
            return best_by(ws, ok, |w| (self.cached(w.breaker.id()), w.load(now)));
        }
        lookup.reason.set(Reason::CacheMatch);
        if !c.ttft_weighting {
            return Some(best);
        }
        let predicted = |w: &Worker, ttfb: f64| {
            let uncached = (len - lookup.matched(w.breaker.id())) as f64 / len as f64;
            ttfb * (CACHED_COST + (1.0 - CACHED_COST) * uncached)
        };
        // Workers without a recent sample are taken as the average of those
        // with one; without any sample there is nothing to weigh.
        let (mut sum, mut known) = (0.0, 0u32);
        for w in ws.iter().filter(|w| ok(w)) {
            if let Some(t) = w.recent_ttfb(now) {
                sum += t.as_secs_f64();
                known += 1;
            }
        }
        if known == 0 {
            return Some(best);
        }
        let mean = sum / f64::from(known);
        let ttfb = |w: &Worker| w.recent_ttfb(now).map_or(mean, |t| t.as_secs_f64());
        let best_time = predicted(&ws[best], ttfb(&ws[best]));
        let fastest = best_by(ws, ok, |w| {
            // Microseconds: an ordering key, finer than any TTFB moves.
            ((predicted(w, ttfb(w)) * 1e6) as u64, w.load(now))
        })?;
        if predicted(&ws[fastest], ttfb(&ws[fastest])) + MIN_GAIN_SECS < best_time {
            lookup.reason.set(Reason::Slow);
            return Some(fastest);
        }
        Some(best)
    }
}

impl Lookup<'_> {
    /// The choice passed over an overloaded worker: counted as `overload`.
    pub(super) fn shed(&self) {
        self.reason.set(Reason::Overload);
    }

    fn matched(&self, id: WorkerId) -> usize {
        self.matches.iter().find(|m| m.0 == id).map_or(0, |m| m.1)
    }
}

/// The index among `ws` passing `ok` with the least `key`; equal keys are
/// broken at random (reservoir sampling), so an idle fleet does not pin
/// the first worker.
fn best_by<K: Ord>(
    ws: &[Arc<Worker>],
    ok: &dyn Fn(&Worker) -> bool,
    key: impl Fn(&Worker) -> K,
) -> Option<usize> {
    let mut best: Option<(usize, K)> = None;
    let mut ties = 0u32;
    for (i, w) in ws.iter().enumerate().filter(|(_, w)| ok(w)) {
        let k = key(w);
        match &best {
            Some((_, b)) if k > *b => {}
            Some((_, b)) if k == *b => {
                ties += 1;
                if rand::rng().random_range(0..=ties) == 0 {
                    best = Some((i, k));
                }
            }
            _ => {
                best = Some((i, k));
                ties = 0;
            }
        }
    }
    best.map(|(i, _)| i)
}

impl MetricsSource for CacheAware {
    fn render(&self, w: &mut Writer<'_>) {
        w.family(
            "routing_decisions_total",
            "counter",
            "cache_aware choices by reason: cache_match, balance, least_cached, slow, overload.",
        );
        for r in Reason::ALL {
            w.sample(
                "routing_decisions_total",
                &[("reason", r.as_str())],
                self.decisions(r) as f64,
            );
        }
        w.family(
            "routing_matched_fraction",
            "histogram",
            "Share of each routed prompt the chosen worker already held, by the prefix tree.",
        );
        self.matched.render(w, "routing_matched_fraction", &[]);
        w.family(
            "routing_tree_bytes",
            "gauge",
            "Bytes all prefix trees take: their prompt text, shared prefixes once, plus 64 per node.",
        );
        w.sample("routing_tree_bytes", &[], self.size() as f64);
        w.family(
            "worker_cached_bytes",
            "gauge",
            "Bytes of prompt text the prefix trees hold for each worker.",
        );
        let held = self.held.load();
        let mut rows: Vec<_> = held.values().collect();
        rows.sort_by(|a, b| a.url.cmp(&b.url));
        for h in rows {
            w.sample(
                "worker_cached_bytes",
                &[("worker", &h.url)],
                h.bytes.load(Ordering::Relaxed) as f64,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_past_the_bound_share_one_set_of_trees() {
        let cache = CacheAware::new(CacheAwareConfig::default());
        for i in 0..MAX_MODELS + 50 {
            let model = format!("invented-{i}");
            let models = cache.models(&model);
            assert!(shards_of(&models, &model).is_some(), "{model}");
        }
        let models = cache.models.load();
        assert_eq!(models.len(), MAX_MODELS + 1);
        assert!(models.contains_key(""));
        assert!(std::ptr::eq(
            shards_of(&models, "invented-300").unwrap(),
            shards_of(&models, "invented-301").unwrap()
        ));
    }
}

//! The simulated inference engine: a prefix cache of prompt blocks, a fixed
//! number of compute slots with a queue, and the engine's vLLM-named
//! `/metrics`, so that routing for cache hits and load shows in the demo.
//!
//! Like vLLM's automatic prefix caching, a prompt (the chat messages rendered
//! in order, or `prompt`, `input`, `text`) is cut into blocks of
//! [`BLOCK_TOKENS`] tokens (approximated as [`CHARS_PER_TOKEN`] bytes each;
//! a partial last block is never cached), each block's hash chained to the
//! previous one, so a block hits only when the whole prefix before it is
//! cached too. Cached blocks live in a bounded LRU (`--prefix-cache-blocks`).
//! A request waits for a free slot (`--slots`), then is held in it for the
//! prefill of its uncached tokens (`--prefill-us-per-token` each).
//!
//! Layering (each module uses only those before it): `prefix_cache`,
//! `config`, `generation`, `body`, `shared`, `control`, `routes`, `server`,
//! `cli`. This module is at the bottom and depends on no other module of this
//! crate: it is handed the request body and answers with a slot held and
//! counts; it must not build responses, touch faults or the connection.

use std::fmt::Write as _;
use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of prompt text counted as one token.
pub const CHARS_PER_TOKEN: usize = 4;
/// Tokens per cache block (vLLM's default block size).
pub const BLOCK_TOKENS: usize = 16;
const BLOCK_BYTES: usize = CHARS_PER_TOKEN * BLOCK_TOKENS;

/// How the simulated engine caches and computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Blocks the prefix cache holds; 0: no cache.
    pub cache_blocks: usize,
    /// Prefill time of one uncached prompt token.
    pub prefill_per_token: Duration,
    /// Requests computed at once; the others wait. 0: no limit.
    pub slots: usize,
}

impl Default for EngineConfig {
    /// Off: no cache, no prefill time, no queue (what tests and the proxy
    /// benchmarks measure through).
    fn default() -> Self {
        Self {
            cache_blocks: 0,
            prefill_per_token: Duration::ZERO,
            slots: 0,
        }
    }
}

impl EngineConfig {
    /// The demo's engine: 100 µs per uncached token is the order of an 8B
    /// model's prefill on one GPU (~10k tokens/s), so a 2 KiB prompt takes
    /// 50 ms uncached and next to nothing cached; 4096 blocks (64k tokens)
    /// hold a few dozen long conversations, so a spread-out workload evicts
    /// and a cache-aware one does not; 8 slots make a queue under a burst.
    pub const DEMO: EngineConfig = EngineConfig {
        cache_blocks: 4096,
        prefill_per_token: Duration::from_micros(100),
        slots: 8,
    };
}

/// The fields of an inference body that make its prompt.
#[derive(Deserialize)]
struct PromptFields {
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    text: Option<Value>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Value>,
}

/// The prompt as the engine would tokenize it: each chat message's role and
/// text in order, or the `prompt`, `input` or `text` field. Unparseable
/// bodies have no prompt (the request is refused elsewhere).
pub fn prompt_text(body: &[u8]) -> String {
    let Ok(fields) = serde_json::from_slice::<PromptFields>(body) else {
        return String::new();
    };
    let mut out = String::new();
    for m in fields.messages.iter().flatten() {
        let _ = writeln!(out, "<|{}|>", m.role.as_deref().unwrap_or(""));
        if let Some(c) = &m.content {
            push_text(&mut out, c);
        }
        out.push('\n');
    }
    for v in [&fields.prompt, &fields.input, &fields.text]
        .into_iter()
        .flatten()
    {
        push_text(&mut out, v);
    }
    out
}

/// A string, the `text` of content parts, or the items of an array.
fn push_text(out: &mut String, v: &Value) {
    match v {
        Value::String(s) => out.push_str(s),
        Value::Number(n) => {
            let _ = write!(out, "{n} ");
        }
        Value::Array(items) => items.iter().for_each(|i| push_text(out, i)),
        Value::Object(map) => {
            if let Some(t) = map.get("text") {
                push_text(out, t);
            }
        }
        Value::Null | Value::Bool(_) => {}
    }
}

/// The chained hashes of the prompt's full blocks, in order.
pub fn block_hashes(prompt: &[u8]) -> Vec<u64> {
    // Fixed keys: the same prompt hashes the same in every worker and run.
    let state =
        std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
    let mut parent = 0u64;
    prompt
        .chunks_exact(BLOCK_BYTES)
        .map(|block| {
            let mut h = state.build_hasher();
            h.write_u64(parent);
            h.write(block);
            parent = h.finish();
            parent
        })
        .collect()
}

/// Tokens of a prompt of `len` bytes.
pub fn tokens(len: usize) -> u64 {
    len.div_ceil(CHARS_PER_TOKEN) as u64
}

/// What the engine did with one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Prompt tokens (vLLM's "queries" of the prefix cache).
    pub query_tokens: u64,
    /// Of those, the tokens found in the cache.
    pub hit_tokens: u64,
}

/// A request in a compute slot; the slot frees when it drops.
pub struct Slot {
    _permit: Option<OwnedSemaphorePermit>,
    _running: Running,
}

struct Running(std::sync::Arc<Engine>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One worker's engine: cache, slots, counters.
pub struct Engine {
    config: EngineConfig,
    /// The prefill time per token in nanoseconds: the config's, until
    /// `POST /_mock/engine` slows the engine down or speeds it up.
    prefill_nanos: AtomicU64,
    cache: Option<Mutex<lru::LruCache<u64, ()>>>,
    slots: Option<std::sync::Arc<Semaphore>>,
    waiting: AtomicU64,
    running: AtomicU64,
    query_tokens: AtomicU64,
    hit_tokens: AtomicU64,
}

impl Engine {
    /// An empty cache and free slots.
    pub fn new(config: EngineConfig) -> Self {
        Self {
            config,
            prefill_nanos: AtomicU64::new(
                u64::try_from(config.prefill_per_token.as_nanos()).unwrap_or(u64::MAX),
            ),
            cache: NonZeroUsize::new(config.cache_blocks)
                .map(|n| Mutex::new(lru::LruCache::new(n))),
            slots: (config.slots > 0).then(|| std::sync::Arc::new(Semaphore::new(config.slots))),
            waiting: AtomicU64::new(0),
            running: AtomicU64::new(0),
            query_tokens: AtomicU64::new(0),
            hit_tokens: AtomicU64::new(0),
        }
    }

    /// Waits for a slot, looks the prompt up (and caches its blocks), then
    /// spends the prefill of its uncached tokens. The returned slot is held
    /// until the caller drops it.
    pub async fn prefill(self: &std::sync::Arc<Self>, body: &[u8]) -> (Slot, Lookup) {
        let permit = match &self.slots {
            Some(slots) => {
                self.waiting.fetch_add(1, Ordering::Relaxed);
                let permit = slots.clone().acquire_owned().await.ok();
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                permit
            }
            None => None,
        };
        self.running.fetch_add(1, Ordering::Relaxed);
        let slot = Slot {
            _permit: permit,
            _running: Running(self.clone()),
        };
        // An engine without cache or prefill time (the default: tests and
        // the proxy benchmarks) reads no prompt at all.
        if self.cache.is_none() && self.prefill_nanos.load(Ordering::Relaxed) == 0 {
            return (
                slot,
                Lookup {
                    query_tokens: 0,
                    hit_tokens: 0,
                },
            );
        }
        let lookup = self.lookup(body);
        let uncached = lookup.query_tokens - lookup.hit_tokens;
        let prefill = Duration::from_nanos(
            self.prefill_nanos
                .load(Ordering::Relaxed)
                .saturating_mul(uncached),
        );
        if !prefill.is_zero() {
            tokio::time::sleep(prefill).await;
        }
        (slot, lookup)
    }

    /// Counts the prompt's tokens and its cached leading blocks, and caches
    /// all its full blocks as most recently used.
    pub fn lookup(&self, body: &[u8]) -> Lookup {
        let prompt = prompt_text(body);
        let query_tokens = tokens(prompt.len());
        let mut hit_tokens = 0;
        if let Some(cache) = &self.cache {
            let hashes = block_hashes(prompt.as_bytes());
            let mut cache = cache.lock().unwrap();
            // Prefix-closed: the first miss ends the hits.
            let hits = hashes.iter().take_while(|h| cache.get(h).is_some()).count();
            for h in &hashes[hits..] {
                cache.put(*h, ());
            }
            hit_tokens = (hits * BLOCK_TOKENS) as u64;
        }
        self.query_tokens.fetch_add(query_tokens, Ordering::Relaxed);
        self.hit_tokens.fetch_add(hit_tokens, Ordering::Relaxed);
        Lookup {
            query_tokens,
            hit_tokens,
        }
    }

    /// The prefill time of one uncached token now.
    pub fn prefill_per_token(&self) -> Duration {
        Duration::from_nanos(self.prefill_nanos.load(Ordering::Relaxed))
    }

    /// Changes the prefill time of one uncached token (a worker made slower
    /// mid-run); requests already in prefill keep theirs.
    pub fn set_prefill_per_token(&self, per_token: Duration) {
        self.prefill_nanos.store(
            u64::try_from(per_token.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Prompt tokens looked up so far, and of those the cached ones.
    pub fn tokens(&self) -> Lookup {
        Lookup {
            query_tokens: self.query_tokens.load(Ordering::Relaxed),
            hit_tokens: self.hit_tokens.load(Ordering::Relaxed),
        }
    }

    /// Zeroes the token counters (the cache keeps its blocks).
    pub fn reset_counters(&self) {
        self.query_tokens.store(0, Ordering::Relaxed);
        self.hit_tokens.store(0, Ordering::Relaxed);
    }

    /// Blocks cached now.
    pub fn cached_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.lock().unwrap().len())
    }

    /// The engine's series in the Prometheus text format, under vLLM's names.
    pub fn metrics(&self, model: &str) -> String {
        let usage = match self.config.cache_blocks {
            0 => 0.0,
            n => self.cached_blocks() as f64 / n as f64,
        };
        let tokens = self.tokens();
        let model = model
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let labels = format!("engine=\"0\",model_name=\"{model}\"");
        let series: [(&str, &str, &str, f64); 5] = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                self.running.load(Ordering::Relaxed) as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                self.waiting.load(Ordering::Relaxed) as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                usage,
            ),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prefix cache queries, in terms of number of queried tokens.",
                tokens.query_tokens as f64,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prefix cache hits, in terms of number of cached tokens.",
                tokens.hit_tokens as f64,
            ),
        ];
        let mut out = String::new();
        for (name, kind, help, value) in series {
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value:?}\n"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests;

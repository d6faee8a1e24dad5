//! Token accounting and per-model token budgets.
//!
//! Owns the tokens counted from the `usage` object of responses (the final
//! chunk of a stream, when the worker sends one) and the rolling one-minute
//! budgets of `--token-budget MODEL=TOKENS_PER_MINUTE`. The request path looks
//! a model up without a lock; the only lock is per budgeted model, taken once
//! per request to read or add to its minute.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use arc_swap::ArcSwap;
// Looked up several times per request by model name; the keys are the
// configured and declared models plus `other`, never a client's invention,
// so a fast hash is safe.
use foldhash::HashMap;
use memchr::memmem;

use crate::clock::Nanos;
use crate::metrics::{MetricsSource, Writer};

const SLOTS: usize = 60;
const SECOND: Nanos = 1_000_000_000;

/// Tokens reported by one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// `usage.prompt_tokens`; 0 when the body omits it.
    pub prompt: u64,
    /// `usage.completion_tokens`.
    pub completion: u64,
}

impl Usage {
    /// Prompt plus completion tokens: what a budget is charged.
    pub fn total(&self) -> u64 {
        self.prompt + self.completion
    }
}

/// Finds the last `usage` object in the tail of a response body (a JSON
/// completion or an SSE stream) and reads its two counts. Tolerant by design:
/// a body without usage yields `None` and is simply not counted.
pub fn find_usage(tail: &[u8]) -> Option<Usage> {
    // Bytes, not text: every key is ASCII, and a tail cut inside a UTF-8
    // character must still be read. The searchers are built once: building
    // one costs more than searching a chunk. The last `usage` is found
    // searching forward: the forward searcher is vectorised, the reverse
    // one is not, and a tail holds one `usage` or a few.
    static USAGE: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\"usage\""));
    static PROMPT: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\"prompt_tokens\""));
    static COMPLETION: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\"completion_tokens\""));
    let mut at = USAGE.find(tail)?;
    while let Some(next) = USAGE.find(&tail[at + 1..]) {
        at += 1 + next;
    }
    let object = &tail[at..];
    let number = |key: &memmem::Finder<'_>| -> Option<u64> {
        let rest = &object[key.find(object)? + key.needle().len()..];
        let rest = rest
            .trim_ascii_start()
            .strip_prefix(b":")?
            .trim_ascii_start();
        // Folded by hand: cheaper than text and `parse` for a few digits;
        // a count past u64 is no count.
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 {
            return None;
        }
        rest[..digits].iter().try_fold(0u64, |n, &b| {
            n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
        })
    };
    Some(Usage {
        prompt: number(&PROMPT).unwrap_or(0),
        completion: number(&COMPLETION)?,
    })
}

/// A rolling one-minute budget: 60 one-second slots.
#[derive(Debug)]
struct Budget {
    limit: u64,
    slots: Mutex<[(u64, u64); SLOTS]>,
}

impl Budget {
    fn used(slots: &[(u64, u64); SLOTS], second: u64) -> u64 {
        slots
            .iter()
            .filter(|(s, _)| *s + SLOTS as u64 > second && *s <= second)
            .map(|(_, t)| t)
            .sum()
    }

    /// `Some(seconds until enough tokens leave the window)` when spent.
    fn exceeded(&self, now: Nanos) -> Option<u64> {
        let second = now / SECOND + 1;
        let slots = self.slots.lock().unwrap();
        let mut used = Self::used(&slots, second);
        if used < self.limit {
            return None;
        }
        let mut live: Vec<_> = slots
            .iter()
            .filter(|(s, t)| *t > 0 && *s + SLOTS as u64 > second && *s <= second)
            .copied()
            .collect();
        live.sort_unstable();
        for (s, t) in live {
            used -= t;
            if used < self.limit {
                return Some(s + SLOTS as u64 - second);
            }
        }
        Some(SLOTS as u64)
    }

    fn add(&self, now: Nanos, tokens: u64) {
        // Second numbers start at 1 so that an empty slot (0) is never live.
        let second = now / SECOND + 1;
        let mut slots = self.slots.lock().unwrap();
        let slot = &mut slots[(second % SLOTS as u64) as usize];
        if slot.0 != second {
            *slot = (second, 0);
        }
        slot.1 += tokens;
    }
}

/// One model's counters.
#[derive(Debug, Default)]
pub struct ModelTokens {
    /// Prompt tokens recorded for the model (`tokens_total{kind="prompt"}`).
    pub prompt: AtomicU64,
    /// Completion tokens recorded for the model (`tokens_total{kind="completion"}`).
    pub completion: AtomicU64,
    /// Requests that found the model's budget spent (`token_budget_exceeded_total`).
    pub budget_exceeded: AtomicU64,
    budget: Option<Budget>,
}

impl ModelTokens {
    /// Adds one response's usage to the counters and, when the model has a
    /// budget, to the current second of its minute.
    pub fn record(&self, usage: Usage, now: Nanos) {
        self.prompt.fetch_add(usage.prompt, Ordering::Relaxed);
        self.completion
            .fetch_add(usage.completion, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            b.add(now, usage.total());
        }
    }

    /// The model's `--token-budget`, in tokens per rolling minute; `None` when it has none.
    pub fn budget_limit(&self) -> Option<u64> {
        self.budget.as_ref().map(|b| b.limit)
    }
}

/// What a model's token budget says of a new request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowance {
    /// The model has no `--token-budget`.
    Unbudgeted,
    /// Budgeted, with tokens left this minute.
    Within,
    /// Spent for this minute: seconds to wait (at least 1).
    Spent(u64),
}

/// Token counts for every model seen, and the budgets of some.
#[derive(Debug, Default)]
pub struct Tokens {
    models: ArcSwap<HashMap<String, Arc<ModelTokens>>>,
    insert: Mutex<()>,
}

impl Tokens {
    /// Counters for the budgeted models, given as `(model, tokens per minute)`; other models get
    /// counters when first recorded.
    pub fn new(budgets: &[(String, u64)]) -> Self {
        let models = budgets
            .iter()
            .map(|(m, limit)| {
                let tokens = ModelTokens {
                    budget: Some(Budget {
                        limit: *limit,
                        slots: Mutex::new([(0, 0); SLOTS]),
                    }),
                    ..ModelTokens::default()
                };
                (m.clone(), Arc::new(tokens))
            })
            .collect();
        Self {
            models: ArcSwap::from_pointee(models),
            insert: Mutex::new(()),
        }
    }

    /// `model`'s counters, created on first use. The caller holds them for
    /// a response and records on them when its usage is read: one lookup
    /// per request.
    pub fn counters(&self, model: &str) -> Arc<ModelTokens> {
        if let Some(t) = self.models.load().get(model) {
            return t.clone();
        }
        let _guard = self.insert.lock().unwrap();
        let current = self.models.load_full();
        if let Some(t) = current.get(model) {
            return t.clone();
        }
        let mut next = (*current).clone();
        let t = Arc::new(ModelTokens::default());
        next.insert(model.to_owned(), t.clone());
        self.models.store(Arc::new(next));
        t
    }

    /// The counters of `model` if it has any yet (it is budgeted, or was
    /// recorded under its own name before); no lock, no allocation.
    pub fn existing(&self, model: &str) -> Option<Arc<ModelTokens>> {
        self.models.load().get(model).cloned()
    }

    /// What `model`'s `--token-budget` says of a new request. `now` is read
    /// only for a budgeted model: the common, unbudgeted request reads no
    /// clock here.
    pub fn allowance(&self, model: &str, now: impl FnOnce() -> Nanos) -> Allowance {
        let models = self.models.load();
        let Some((t, budget)) = models
            .get(model)
            .and_then(|t| Some((t, t.budget.as_ref()?)))
        else {
            return Allowance::Unbudgeted;
        };
        match budget.exceeded(now()) {
            None => Allowance::Within,
            Some(wait) => {
                t.budget_exceeded.fetch_add(1, Ordering::Relaxed);
                Allowance::Spent(wait.max(1))
            }
        }
    }

    /// Every model's counters, for metrics: the counters stay live, but models first recorded later
    /// are not in the map.
    pub fn snapshot(&self) -> Arc<HashMap<String, Arc<ModelTokens>>> {
        self.models.load_full()
    }
}

impl MetricsSource for Tokens {
    fn render(&self, w: &mut Writer<'_>) {
        let models = self.snapshot();
        let mut names: Vec<_> = models.keys().collect();
        names.sort();
        w.family(
            "tokens_total",
            "counter",
            "Tokens reported in responses' usage, by kind.",
        );
        for m in &names {
            let t = &models[*m];
            for (kind, v) in [("prompt", &t.prompt), ("completion", &t.completion)] {
                w.sample(
                    "tokens_total",
                    &[("model", m), ("kind", kind)],
                    v.load(Ordering::Relaxed) as f64,
                );
            }
        }
        w.family(
            "token_budget_exceeded_total",
            "counter",
            "Requests that found their model's token budget spent.",
        );
        for m in names
            .iter()
            .filter(|m| models[**m].budget_limit().is_some())
        {
            w.sample(
                "token_budget_exceeded_total",
                &[("model", m)],
                models[*m].budget_exceeded.load(Ordering::Relaxed) as f64,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_the_final_sse_chunk() {
        let tail = br#"data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}

data: [DONE]

"#;
        assert_eq!(
            find_usage(tail),
            Some(Usage {
                prompt: 12,
                completion: 7
            })
        );
        assert_eq!(find_usage(b"data: [DONE]\n\n"), None);
    }

    #[test]
    fn usage_is_read_from_bytes_whatever_precedes_it() {
        // A chunk boundary can cut a UTF-8 character: the tail starts with
        // its last byte.
        let mut tail = vec![0x9f];
        tail.extend_from_slice(r#"é","usage": {"completion_tokens" : 3}}"#.as_bytes());
        assert_eq!(
            find_usage(&tail),
            Some(Usage {
                prompt: 0,
                completion: 3
            })
        );
        // The last usage object counts; a count past u64 is no count.
        let two = br#"{"usage":{"completion_tokens":1}} {"usage":{"completion_tokens":99999999999999999999}}"#;
        assert_eq!(find_usage(two), None);
        assert_eq!(find_usage(br#"{"usage":{"completion_tokens":}}"#), None);
        // Only counts after the last usage key count.
        let later = br#"{"usage":{"prompt_tokens":5,"completion_tokens":1}} {"usage":{"completion_tokens":2,"completion_tokens_details":{"reasoning_tokens":1}}}"#;
        assert_eq!(
            find_usage(later),
            Some(Usage {
                prompt: 0,
                completion: 2
            })
        );
        assert_eq!(find_usage(br#"{"completion_tokens":4}"#), None);
    }

    #[test]
    fn budget_is_enforced_over_a_rolling_minute() {
        let t = Tokens::new(&[("m".to_owned(), 100)]);
        let at = |s: u64| s * SECOND;
        assert_eq!(t.allowance("m", || at(0)), Allowance::Within);
        t.counters("m").record(
            Usage {
                prompt: 30,
                completion: 30,
            },
            at(0),
        );
        assert_eq!(t.allowance("m", || at(10)), Allowance::Within);
        t.counters("m").record(
            Usage {
                prompt: 20,
                completion: 20,
            },
            at(10),
        );
        // 100 spent: the first 60 leave the window at second 60.
        assert_eq!(t.allowance("m", || at(20)), Allowance::Spent(40));
        assert_eq!(t.allowance("m", || at(59)), Allowance::Spent(1));
        assert_eq!(t.allowance("m", || at(60)), Allowance::Within);
        assert_eq!(
            t.allowance("other", || unreachable!("no clock read without a budget")),
            Allowance::Unbudgeted,
            "no budget, no limit"
        );
        assert_eq!(t.snapshot()["m"].budget_exceeded.load(Ordering::Relaxed), 2);
    }
}

//! Token accounting and per-model token budgets.
//!
//! Owns the tokens counted from the `usage` object of responses (the final
//! chunk of a stream, when the worker sends one) and the rolling one-minute
//! budgets of `--token-budget MODEL=TOKENS_PER_MINUTE`. The request path looks
//! a model up without a lock; the only lock is per budgeted model, taken once
//! per request to read or add to its minute.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
// Looked up several times per request by model name; the keys are the
// configured and declared models plus `other`, never a client's invention,
// so a fast hash is safe.
use foldhash::HashMap;

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
    // character must still be read. The last `"usage"` is found from the
    // end, where it sits, by its `g` (a vectorised search for one byte, and
    // a byte that JSON's own punctuation and the usage object's keys never
    // hold); the object after it is then read in place.
    const KEY: &[u8] = b"\"usage\"";
    let mut end = tail.len();
    while let Some(g) = memchr::memrchr(b'g', &tail[..end]) {
        if g >= 4 && tail.get(g - 4..g + 3) == Some(KEY) {
            return usage_object(&tail[g + 3..]);
        }
        end = g;
    }
    None
}

/// `: { "key": value, ... }` with its two counts read; `None` when it is not
/// an object of counts (`null`, cut short, a count past u64, an escaped
/// key). Slices and byte searches, not a byte-at-a-time cursor: this runs
/// once per response.
fn usage_object(rest: &[u8]) -> Option<Usage> {
    let mut rest = past(past(rest, b':')?, b'{')?;
    let (mut prompt, mut completion) = (None, None);
    loop {
        rest = past(rest, b'"')?;
        let close = memchr::memchr(b'"', rest)?;
        let key = &rest[..close];
        if key.ends_with(b"\\") {
            return None;
        }
        rest = past(&rest[close + 1..], b':')?.trim_ascii_start();
        rest = match key {
            b"prompt_tokens" => count(rest, &mut prompt)?,
            b"completion_tokens" => count(rest, &mut completion)?,
            _ => skip_value(rest)?,
        }
        .trim_ascii_start();
        match rest.first()? {
            b',' => rest = &rest[1..],
            b'}' => break,
            _ => return None,
        }
    }
    Some(Usage {
        prompt: prompt.unwrap_or(0),
        completion: completion?,
    })
}

/// `rest` past its leading whitespace and then `want`.
fn past(rest: &[u8], want: u8) -> Option<&[u8]> {
    let rest = rest.trim_ascii_start();
    (rest.first() == Some(&want)).then(|| &rest[1..])
}

/// An unsigned count into `into`, folded by hand (cheaper than text and
/// `parse` for a few digits); a fraction or exponent after the digits is
/// passed over. What follows it is returned.
fn count<'a>(rest: &'a [u8], into: &mut Option<u64>) -> Option<&'a [u8]> {
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let n = rest[..digits].iter().try_fold(0u64, |n, &b| {
        n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })?;
    *into = Some(n);
    let more = rest[digits..]
        .iter()
        .take_while(|b| matches!(b, b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-'))
        .count();
    Some(&rest[digits + more..])
}

/// Any other value (a string, a literal, a number, or a nested object or
/// array such as `completion_tokens_details`); what follows it is returned.
fn skip_value(mut rest: &[u8]) -> Option<&[u8]> {
    let mut depth = 0usize;
    loop {
        match *rest.first()? {
            b',' | b'}' | b']' if depth == 0 => return Some(rest),
            b'"' => rest = skip_string(&rest[1..])?,
            b'{' | b'[' => {
                depth += 1;
                rest = &rest[1..];
            }
            b'}' | b']' => {
                depth -= 1;
                rest = &rest[1..];
            }
            _ => rest = &rest[1..],
        }
    }
}

/// Past the closing quote of a string whose opening quote was read.
fn skip_string(mut rest: &[u8]) -> Option<&[u8]> {
    loop {
        let at = memchr::memchr2(b'"', b'\\', rest)?;
        if rest[at] == b'"' {
            return Some(&rest[at + 1..]);
        }
        rest = rest.get(at + 2..)?;
    }
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
    fn usage_keys_are_read_inside_its_object_only() {
        // Details with strings holding braces and quotes, a fraction, and
        // key order reversed: vLLM's and OpenAI's shapes.
        let full = br#"{"id":"x","usage":{"completion_tokens":8.0,"prompt_tokens_details":{"note":"a}\"b","cached_tokens":[1,{"x":2}]},"prompt_tokens":21,"total_tokens":29}}"#;
        assert_eq!(
            find_usage(full),
            Some(Usage {
                prompt: 21,
                completion: 8
            })
        );
        // Counts outside the usage object are not its counts.
        assert_eq!(
            find_usage(br#"{"usage":{"total_tokens":4},"completion_tokens":4}"#),
            None
        );
        // A stream's `usage: null` chunks before the final one, and after.
        let stream = br#"data: {"usage":null}

data: {"usage":{"prompt_tokens":2,"completion_tokens":3}}

"#;
        assert_eq!(
            find_usage(stream),
            Some(Usage {
                prompt: 2,
                completion: 3
            })
        );
        assert_eq!(
            find_usage(br#"{"usage":{"completion_tokens":3}} {"usage":null}"#),
            None
        );
        // Cut short, or an escape as the last byte: no count, no panic.
        assert_eq!(find_usage(br#"{"usage":{"completion_tokens":3"#), None);
        assert_eq!(find_usage(br#"{"usage":{"k":""#), None);
    }

    proptest::proptest! {
        /// Whatever the bytes, reading them ends without a panic; and with
        /// no `"usage"` in them, a usage object appended is the one read.
        #[test]
        fn any_tail_is_read_without_panic(mut tail in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let _ = find_usage(&tail);
            tail.retain(|&b| b != b'"');
            tail.extend_from_slice(br#""usage" : {"x":[{}],"completion_tokens":5}"#);
            proptest::prop_assert_eq!(find_usage(&tail), Some(Usage { prompt: 0, completion: 5 }));
        }
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

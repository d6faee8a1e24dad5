//! Quality-shaped failures: a 2xx completion too short to be an answer.
//!
//! Owns the rule of `--cb-min-completion-tokens N` ([`QualityRule`]): which
//! requests it judges, and the scan of a response body ([`QualityScan`]) that
//! counts its completion tokens and finds its exemptions. The count is
//! `usage.completion_tokens` (or SGLang's `meta_info.completion_tokens`) when
//! the body carries one; otherwise it is approximated: in a stream, one token
//! per event whose delta or text is not empty (what vLLM and SGLang send); in
//! a whole body, one token per 4 bytes of the returned text (rounded
//! up). Exempt: a request that asked for fewer than N tokens, a completion
//! with tool calls, and `finish_reason: content_filter` (a refusal by policy
//! is the server working as designed).
//!
//! Pure: it is handed the bytes the relay forwards and never touches a
//! breaker, a clock or a connection. It reads bodies only when the option is
//! on for the worker, and every buffer it keeps is bounded
//! ([`MAX_SCANNED_BYTES`]); a body it cannot read is not judged.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::IgnoredAny;

/// The most bytes of a whole (non-streamed) body, or of one SSE line, kept
/// to be read. A body longer than this holds far more than any sensible
/// minimum of tokens and is not judged; a longer SSE line is not read.
pub const MAX_SCANNED_BYTES: usize = 256 * 1024;

/// The minimum a worker's 2xx completions must reach, for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QualityRule {
    min: u32,
}

impl QualityRule {
    /// The rule for a request that asked for at most `requested` completion
    /// tokens (`max_tokens`, `max_completion_tokens` or SGLang's
    /// `max_new_tokens`): `None` when it asked for fewer than `min`, since
    /// a short answer is then what it asked for, or when `min` is 0.
    pub fn for_request(min: u32, requested: Option<u64>) -> Option<Self> {
        (min > 0 && requested.is_none_or(|r| r >= u64::from(min))).then_some(Self { min })
    }

    /// A scan of the response body, an SSE stream or one JSON body.
    pub fn scan(self, sse: bool) -> QualityScan {
        QualityScan {
            min: u64::from(self.min),
            sse,
            pending: Vec::new(),
            chunks: Vec::new(),
            whole_len: 0,
            seen: Seen::default(),
            unreadable: false,
        }
    }
}

/// What a body showed so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Seen {
    /// The last `usage.completion_tokens` (or `meta_info.completion_tokens`).
    reported: Option<u64>,
    /// The approximate count: non-empty stream events, or whole-body text
    /// at 4 bytes per token.
    counted: u64,
    /// Bytes of SGLang `/generate` text; in its streams the text is
    /// cumulative, so the latest event's length is kept, not a sum.
    generate_bytes: u64,
    tool_calls: bool,
    content_filter: bool,
}

/// The judgement of one body, fed chunk by chunk as the relay forwards them.
#[derive(Debug)]
pub struct QualityScan {
    min: u64,
    sse: bool,
    /// A stream's partial last line, carried to the next chunk.
    pending: Vec<u8>,
    /// A whole body's chunks (shared with the relay, not copied), up to
    /// [`MAX_SCANNED_BYTES`].
    chunks: Vec<Bytes>,
    whole_len: usize,
    seen: Seen,
    /// Past a bound: the body is not judged.
    unreadable: bool,
}

/// What [`QualityScan::verdict`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// At least the minimum, or exempt, or unreadable: the status stands.
    Passed,
    /// Fewer completion tokens than the minimum: a `quality` failure.
    Short {
        /// The count the verdict was taken on.
        tokens: u64,
    },
}

impl QualityScan {
    /// Takes in the next chunk of the body.
    pub fn push(&mut self, chunk: &Bytes) {
        if self.unreadable {
            return;
        }
        if !self.sse {
            self.whole_len += chunk.len();
            if self.whole_len > MAX_SCANNED_BYTES {
                self.unreadable = true;
                self.chunks = Vec::new();
            } else {
                self.chunks.push(chunk.clone());
            }
            return;
        }
        let mut rest: &[u8] = chunk;
        while let Some(nl) = memchr::memchr(b'\n', rest) {
            let line = &rest[..nl];
            if self.pending.is_empty() {
                self.line(line);
            } else {
                let mut joined = std::mem::take(&mut self.pending);
                joined.extend_from_slice(line);
                self.line(&joined);
            }
            rest = &rest[nl + 1..];
        }
        if self.pending.len() + rest.len() > MAX_SCANNED_BYTES {
            self.unreadable = true;
            self.pending = Vec::new();
        } else {
            self.pending.extend_from_slice(rest);
        }
    }

    /// One SSE line: a `data:` event is read, anything else passed over.
    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            return;
        }
        if let Ok(event) = serde_json::from_slice::<Body<'_>>(data) {
            self.seen.take(&event, Counting::Events);
        }
    }

    /// The verdict once the body has ended.
    pub fn verdict(mut self) -> Verdict {
        if self.sse {
            let last = std::mem::take(&mut self.pending);
            self.line(&last);
        } else if !self.unreadable {
            let whole = match self.chunks.as_slice() {
                [one] => Cow::Borrowed(&one[..]),
                many => Cow::Owned(many.concat()),
            };
            if whole.trim_ascii().is_empty() {
                // A 200 with nothing in it is the emptiest completion.
                return self.judge();
            }
            match serde_json::from_slice::<Body<'_>>(&whole) {
                Ok(body) => self.seen.take(&body, Counting::Characters),
                Err(_) => return Verdict::Passed,
            }
        }
        if self.unreadable {
            return Verdict::Passed;
        }
        self.judge()
    }

    fn judge(&self) -> Verdict {
        let seen = &self.seen;
        if seen.tool_calls || seen.content_filter {
            return Verdict::Passed;
        }
        let tokens = seen
            .reported
            .unwrap_or(seen.counted + seen.generate_bytes.div_ceil(4));
        if tokens < self.min {
            Verdict::Short { tokens }
        } else {
            Verdict::Passed
        }
    }
}

/// How text is turned into a count when no usage is reported.
#[derive(Clone, Copy)]
enum Counting {
    /// A stream: one token per event with non-empty text.
    Events,
    /// A whole body: one token per 4 bytes of text.
    Characters,
}

impl Seen {
    fn take(&mut self, body: &Body<'_>, counting: Counting) {
        if let Some(n) = body
            .usage
            .as_ref()
            .and_then(|u| u.completion_tokens)
            .or_else(|| body.meta_info.as_ref().and_then(|m| m.completion_tokens))
        {
            self.reported = Some(n);
        }
        for choice in body.choices.iter().flatten() {
            if choice.finish_reason.as_deref() == Some("content_filter") {
                self.content_filter = true;
            }
            if choice.finish_reason.as_deref() == Some("tool_calls") {
                self.tool_calls = true;
            }
            let mut chars = choice.text.as_deref().map_or(0, str::len);
            for message in [&choice.message, &choice.delta].into_iter().flatten() {
                if message.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
                    || message.function_call.is_some()
                {
                    self.tool_calls = true;
                }
                chars += message.content.as_deref().map_or(0, str::len);
                chars += message.reasoning_content.as_deref().map_or(0, str::len);
            }
            self.count(chars, counting);
        }
        if let Some(text) = &body.text {
            // SGLang `/generate`: cumulative in a stream, so the latest wins.
            self.generate_bytes = text.len() as u64;
        }
    }

    fn count(&mut self, bytes: usize, counting: Counting) {
        self.counted += match counting {
            Counting::Events => u64::from(bytes > 0),
            // Bytes, not characters, rounded up: close enough for a
            // threshold of a few tokens, and never 0 for a non-empty text.
            Counting::Characters => (bytes as u64).div_ceil(4),
        };
    }
}

/// The parts of a completion (chat, text or SGLang `/generate`), a stream's
/// event or a whole body, that the rule reads; the rest is passed over.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(default, borrow)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(default)]
    usage: Option<UsageCount>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    meta_info: Option<UsageCount>,
}

#[derive(Deserialize)]
struct UsageCount {
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    message: Option<Message<'a>>,
    #[serde(default, borrow)]
    delta: Option<Message<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    function_call: Option<IgnoredAny>,
}

/// The completion limit a request body asks for: `max_completion_tokens`,
/// `max_tokens`, or SGLang's `sampling_params.max_new_tokens`; `None` when
/// it names none or is not a JSON object.
pub fn requested_tokens(body: &[u8]) -> Option<u64> {
    #[derive(Deserialize)]
    struct Limits {
        #[serde(default)]
        max_completion_tokens: Option<u64>,
        #[serde(default)]
        max_tokens: Option<u64>,
        #[serde(default)]
        sampling_params: Option<Sampling>,
    }
    #[derive(Deserialize)]
    struct Sampling {
        #[serde(default)]
        max_new_tokens: Option<u64>,
    }
    let limits: Limits = serde_json::from_slice(body).ok()?;
    limits
        .max_completion_tokens
        .or(limits.max_tokens)
        .or(limits.sampling_params.and_then(|s| s.max_new_tokens))
}

#[cfg(test)]
mod tests;

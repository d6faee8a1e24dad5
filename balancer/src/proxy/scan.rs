//! The top-level `model` of an inference body in one pass, without serde.
//!
//! Owns a scanner that checks a JSON object and finds its top-level
//! `model` string. It answers only when it is certain: it accepts a strict
//! subset of what serde_json accepts (strings checked for escapes, control
//! characters and UTF-8; plain numbers; nesting at most [`MAX_DEPTH`]) and
//! leaves everything else (an escaped key, a `model` that is not a plain
//! string, a second `model`, anything serde might read differently) to
//! serde. So a body is never accepted here that serde would refuse, and the
//! model found is the one serde would find. Knows nothing of routing.

/// Nesting deeper than this is left to serde (whose own limit is 128).
const MAX_DEPTH: usize = 64;

/// What the scanner found in a body that is a valid JSON object.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Found<'a> {
    /// The top-level `model` string (no escapes in it).
    Model(&'a str),
    /// No top-level `model`.
    NoModel,
}

/// The top-level `model` of `body`, a JSON object; `None` when the scanner
/// is not certain (malformed, or outside its subset): serde decides then.
pub(crate) fn model(body: &[u8]) -> Option<Found<'_>> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    if s.next()? != b'{' {
        return None;
    }
    let mut model = None;
    s.object(|s, key| {
        if key.contains(&b'\\') {
            return None;
        }
        if key != b"model" {
            return s.value(1);
        }
        // A second `model` is serde's error to give; anything but a plain
        // string is serde's to read.
        if model.is_some() || s.next()? != b'"' {
            return None;
        }
        let value = s.string()?;
        if value.contains(&b'\\') {
            return None;
        }
        model = Some(std::str::from_utf8(value).ok()?);
        Some(())
    })?;
    s.ws();
    if s.i != body.len() {
        return None;
    }
    Some(model.map_or(Found::NoModel, Found::Model))
}

/// The bytes of a string that are not plain text: its end, an escape, a
/// control character (refused), and the start of a non-ASCII character
/// (checked as UTF-8 at the end).
static SPECIAL: [bool; 256] = {
    let mut table = [false; 256];
    let mut c = 0;
    while c < 256 {
        table[c] = c == b'"' as usize || c == b'\\' as usize || c < 0x20 || c >= 0x80;
        c += 1;
    }
    table
};

/// Bytes of a string read one at a time before the word skip starts: the
/// keys and values of a request's other fields are shorter, and for them the
/// words cost more than they save.
const SHORT_RUN: usize = 16;

/// Whether eight bytes may hold a [`SPECIAL`] one: a quote, a backslash, a
/// control character or a non-ASCII byte. Never wrong when it says no (a
/// "yes" may be wrong: the byte loop then decides), so a string's plain run
/// is skipped a word at a time, as memchr does for one byte.
fn maybe_special(eight: [u8; 8]) -> bool {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES * 0x80;
    let w = u64::from_le_bytes(eight);
    // A byte below `n` sets its high bit in `v - n` (each byte of `v` under
    // 0x80); a byte equal to `c` is a zero byte of `w ^ c`.
    let below = |v: u64, n: u64| v.wrapping_sub(ONES * n) & !v & HIGH;
    let quote = below(w ^ (ONES * u64::from(b'"')), 1);
    let backslash = below(w ^ (ONES * u64::from(b'\\')), 1);
    (quote | backslash | below(w, 0x20) | (w & HIGH)) != 0
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// The rest of a string whose opening quote was read, raw (escapes
    /// checked, not decoded); the closing quote is consumed.
    fn string(&mut self) -> Option<&'a [u8]> {
        let start = self.i;
        let mut ascii = true;
        loop {
            // Most of a string is plain: skip to the next byte that means
            // something. Keys and model names end within a few bytes, found
            // by the byte loop; past those, a long run (a prompt's text) is
            // skipped eight bytes at a time while none of them can mean
            // something.
            let rest = self.b.get(self.i..)?;
            let special = |c: &u8| SPECIAL[usize::from(*c)];
            let short = rest.len().min(SHORT_RUN);
            self.i += match rest[..short].iter().position(special) {
                Some(at) => at,
                None => {
                    let long = &rest[short..];
                    let plain = long
                        .as_chunks::<8>()
                        .0
                        .iter()
                        .take_while(|&&eight| !maybe_special(eight))
                        .count()
                        * 8;
                    short + plain + long[plain..].iter().position(special)?
                }
            };
            let c = self.next()?;
            match c {
                b'"' => break,
                b'\\' => match self.next()? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                    b'u' => {
                        for _ in 0..4 {
                            if !self.next()?.is_ascii_hexdigit() {
                                return None;
                            }
                        }
                    }
                    _ => return None,
                },
                0..=0x1f => return None,
                0x80.. => ascii = false,
                _ => {}
            }
        }
        let raw = &self.b[start..self.i - 1];
        if !ascii {
            std::str::from_utf8(raw).ok()?;
        }
        Some(raw)
    }

    /// The members of an object whose `{` was read, through its `}`:
    /// `member` reads each value, handed the scanner and the raw key.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>) -> Option<()> {
        self.items(b'}', |s| {
            if s.next()? != b'"' {
                return None;
            }
            let key = s.string()?;
            s.ws();
            if s.next()? != b':' {
                return None;
            }
            s.ws();
            member(s, key)
        })
    }

    /// The comma-separated items of an object or array whose opening was
    /// read, through `close`: `item` reads each, from its first byte.
    fn items(&mut self, close: u8, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.ws();
        if self.peek()? == close {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            item(self)?;
            self.ws();
            match self.next()? {
                b',' => {}
                c if c == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// Skips one value at nesting `depth`.
    fn value(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.next()? {
            b'"' => self.string().map(drop),
            b'{' => self.object(|s, _| s.value(depth + 1)),
            b'[' => self.items(b']', |s| s.value(depth + 1)),
            b't' => self.literal(b"rue"),
            b'f' => self.literal(b"alse"),
            b'n' => self.literal(b"ull"),
            c @ (b'-' | b'0'..=b'9') => self.number(c),
            _ => None,
        }
    }

    fn literal(&mut self, rest: &[u8]) -> Option<()> {
        let end = self.i + rest.len();
        (self.b.get(self.i..end)? == rest).then(|| self.i = end)
    }

    /// A number whose first byte `first` was read: only the plain forms
    /// (`-`, integer digits without a leading zero, a fraction; no
    /// exponent), at most 15 digits, which every reader takes alike.
    fn number(&mut self, first: u8) -> Option<()> {
        let lead = if first == b'-' { self.next()? } else { first };
        let mut digits = 1;
        match lead {
            b'0' => {}
            b'1'..=b'9' => {
                while let Some(b'0'..=b'9') = self.peek() {
                    self.i += 1;
                    digits += 1;
                }
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            let start = self.i;
            while let Some(b'0'..=b'9') = self.peek() {
                self.i += 1;
            }
            if self.i == start {
                return None;
            }
            digits += self.i - start;
        }
        if digits > 15 || matches!(self.peek(), Some(b'e' | b'E')) {
            return None;
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What serde makes of `body`, as the route phase reads it.
    fn serde(body: &[u8]) -> Result<Option<String>, ()> {
        #[derive(serde::Deserialize)]
        struct ModelOnly {
            #[serde(default)]
            model: Option<serde_json::Value>,
        }
        let parsed: ModelOnly = serde_json::from_slice(body).map_err(drop)?;
        Ok(match parsed.model {
            Some(serde_json::Value::String(m)) => Some(m),
            _ => None,
        })
    }

    fn agrees(body: &[u8]) {
        if let Some(found) = model(body) {
            let expected = serde(body).unwrap_or_else(|()| {
                panic!(
                    "accepted what serde refuses: {:?}",
                    String::from_utf8_lossy(body)
                )
            });
            let found = match found {
                Found::Model(m) => Some(m.to_owned()),
                Found::NoModel => None,
            };
            assert_eq!(found, expected, "{:?}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn the_common_bodies_are_answered_here() {
        let cases: [(&str, Found<'_>); 5] = [
            (
                r#"{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}"#,
                Found::Model("demo-model"),
            ),
            (
                " {\n \"messages\": [{\"content\": \"a\\nb \\u00e9 \u{e9}\"}],\n \"model\" : \"m\", \"temperature\": 0.7, \"max_tokens\": 16, \"stream\": true, \"stop\": null }\n",
                Found::Model("m"),
            ),
            (r#"{}"#, Found::NoModel),
            (r#"{"prompt":"x","n":-1,"logprobs":false}"#, Found::NoModel),
            (r#"{"model":"é"}"#, Found::Model("é")),
        ];
        for (body, expected) in cases {
            assert_eq!(model(body.as_bytes()), Some(expected), "{body}");
            agrees(body.as_bytes());
        }
    }

    #[test]
    fn what_serde_reads_otherwise_or_refuses_is_left_to_it() {
        for body in [
            r#"{"model":"a","model":"b"}"#,
            r#"{"model":"a\u0062"}"#,
            r#"{"mod\u0065l":"a"}"#,
            r#"{"model":1e400}"#,
            r#"{"model":5}"#,
            r#"{"n":1e5}"#,
            r#"{"n":01}"#,
            r#"{"n":1.}"#,
            r#"{"n":12345678901234567890}"#,
            r#"{"a":"x\qy"}"#,
            "{\"a\":\"tab\there\"}",
            r#"{"a":tru}"#,
            r#"{"a":1,}"#,
            r#"{"a":1} x"#,
            r#"[{"model":"a"}]"#,
            r#"{"model":"a""#,
        ] {
            assert_eq!(model(body.as_bytes()), None, "{body}");
        }
        let deep = format!(
            "{{\"a\":{}1{}}}",
            "[".repeat(MAX_DEPTH),
            "]".repeat(MAX_DEPTH)
        );
        assert_eq!(model(deep.as_bytes()), None);
        assert_eq!(model(b"{\"a\":\"\xff\"}"), None, "invalid UTF-8");
    }

    #[test]
    fn a_word_with_any_special_byte_is_never_taken_for_plain() {
        for special in (0..=255u8).filter(|&c| SPECIAL[usize::from(c)]) {
            for at in 0..8 {
                let mut eight = *b"abcdefgh";
                eight[at] = special;
                assert!(maybe_special(eight), "{special:#x} at {at}");
            }
        }
        assert!(!maybe_special(*b"plain te"));
        assert!(!maybe_special(*b" !#[]~\x7f0"));
    }

    #[test]
    fn long_strings_are_read_past_each_word() {
        let text = "lorem ipsum dolor sit amet ".repeat(40);
        for tail in ["", "\\n", "\\u00e9", "é", "\\\"inner\\\""] {
            let body =
                format!(r#"{{"messages":[{{"content":"{text}{tail}{text}"}}],"model":"m"}}"#);
            assert_eq!(model(body.as_bytes()), Some(Found::Model("m")), "{tail}");
        }
        let control = format!("{{\"a\":\"{text}{}\",\"model\":\"m\"}}", '\u{1}');
        assert_eq!(model(control.as_bytes()), None);
    }

    proptest::proptest! {
        /// Bodies made of JSON's own pieces: whatever the scanner answers,
        /// serde answers the same.
        #[test]
        fn the_scanner_never_disagrees_with_serde(
            pieces in proptest::collection::vec(proptest::sample::select(vec![
                "{", "}", "[", "]", ",", ":", " ", "\n", "\"model\"", "\"m\"", "\"x\"",
                "\"a\\\"b\"", "\"\\u00e9\"", "\"\\q\"", "0", "-1", "1.5", "01", "1e3",
                "true", "false", "null", "nul", "\"é\"", "\"\t\"",
            ]), 0..24)
        ) {
            let body = pieces.concat();
            agrees(body.as_bytes());
            let object = format!("{{\"model\":\"m\",\"x\":{body}}}");
            agrees(object.as_bytes());
        }
    }
}

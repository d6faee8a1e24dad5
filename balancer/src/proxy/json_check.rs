//! A streamed inference body held to the rule a buffered one meets.
//!
//! Owns an incremental checker, fed the body's bytes as they pass, that
//! finds out by the body's end whether it is one JSON object (serde_json's
//! grammar: strings with their escapes, control characters and UTF-8
//! checked, numbers, literals, nesting at most [`MAX_DEPTH`]) with at most
//! one top-level `model` key, spelled without escapes. A buffered body
//! that breaks this gets 400 from the model scanner or serde; a body past
//! `--max-buffered-request-bytes` is routed by the first `model` of its
//! prefix, so without this check `{"model":"cheap",...,"model":"premium"}`
//! (or `"mod\u0065l"`) would be charged to one model and served, by a
//! worker that keeps the last key, as another. O(1) memory beyond the
//! nesting stack; knows nothing of routing or of the body's transport.

/// Nesting deeper than this is refused, as serde_json refuses it.
const MAX_DEPTH: usize = 128;

/// Why a streamed body is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum JsonError {
    #[error("the request body is not a JSON object")]
    Malformed,
    #[error("the request body nests deeper than {MAX_DEPTH} levels")]
    TooDeep,
    #[error("the request body names its top-level model more than once")]
    DuplicateModel,
    #[error("the request body spells its top-level model key with escapes")]
    EscapedModel,
}

/// Where the checker is in the grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the top-level `{`.
    Start,
    /// A value is due (after `:`, or `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value in a container: `,` or its close.
    CommaOrClose,
    /// Inside a string (a key when `key`).
    Str { key: bool },
    /// After a backslash in a string.
    Escape { key: bool },
    /// Inside `\uXXXX`: hex digits still due, the code so far.
    Unicode { key: bool, due: u8, code: u16 },
    /// Inside a number.
    Number(Num),
    /// Inside `true`, `false` or `null`: the bytes still due.
    Literal(&'static [u8]),
    /// After the top-level `}`: only whitespace.
    End,
}

/// JSON's number grammar, by what was read last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl Num {
    /// Whether a number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }

    fn next(self, b: u8) -> Option<Num> {
        Some(match (self, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, b'1'..=b'9') => Num::Int,
            (Num::Int, b'0'..=b'9') => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::Exp,
            (Num::Exp, b'+' | b'-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign | Num::ExpDigits, b'0'..=b'9') => Num::ExpDigits,
            _ => return None,
        })
    }
}

/// The checker. Feed it every byte of the body, in order, then
/// [`JsonCheck::finish`].
#[derive(Debug)]
pub(crate) struct JsonCheck {
    state: State,
    /// Open containers, `{` or `[`, outermost first.
    stack: Vec<u8>,
    /// Continuation bytes a UTF-8 character in a string still needs, and
    /// the range its next byte must fall in.
    utf8_due: u8,
    utf8_next: (u8, u8),
    /// A top-level key as decoded so far (only its first bytes matter:
    /// whether it is `model`), its length, and whether it used escapes.
    key: [u8; 5],
    key_len: usize,
    key_escaped: bool,
    /// Top-level `model` keys seen.
    models: u8,
}

impl Default for JsonCheck {
    fn default() -> Self {
        Self {
            state: State::Start,
            stack: Vec::new(),
            utf8_due: 0,
            utf8_next: (0x80, 0xBF),
            key: [0; 5],
            key_len: 0,
            key_escaped: false,
            models: 0,
        }
    }
}

impl JsonCheck {
    /// The next bytes of the body.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Result<(), JsonError> {
        bytes.iter().try_for_each(|&b| self.byte(b))
    }

    /// The body ended: whether it was one whole object.
    pub(crate) fn finish(&self) -> Result<(), JsonError> {
        if self.state == State::End {
            Ok(())
        } else {
            Err(JsonError::Malformed)
        }
    }

    fn byte(&mut self, b: u8) -> Result<(), JsonError> {
        let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        match self.state {
            State::Str { key } => self.string(b, key),
            State::Escape { key } => {
                let decoded = match b {
                    b'"' | b'\\' | b'/' => b,
                    b'b' => 0x08,
                    b'f' => 0x0C,
                    b'n' => b'\n',
                    b'r' => b'\r',
                    b't' => b'\t',
                    b'u' => {
                        self.state = State::Unicode {
                            key,
                            due: 4,
                            code: 0,
                        };
                        return Ok(());
                    }
                    _ => return Err(JsonError::Malformed),
                };
                self.key_byte(key, decoded, true);
                self.state = State::Str { key };
                Ok(())
            }
            State::Unicode { key, due, code } => {
                let digit = char::from(b).to_digit(16).ok_or(JsonError::Malformed)?;
                let code = code << 4 | digit as u16;
                if due > 1 {
                    self.state = State::Unicode {
                        key,
                        due: due - 1,
                        code,
                    };
                } else {
                    // Only whether a key reads `model` matters: anything
                    // outside ASCII makes it another key.
                    let decoded = u8::try_from(code).ok().filter(u8::is_ascii).unwrap_or(0xFF);
                    self.key_byte(key, decoded, true);
                    self.state = State::Str { key };
                }
                Ok(())
            }
            State::Number(num) => match num.next(b) {
                Some(next) => {
                    self.state = State::Number(next);
                    Ok(())
                }
                None if num.complete() => {
                    self.state = State::CommaOrClose;
                    self.byte(b)
                }
                None => Err(JsonError::Malformed),
            },
            State::Literal(rest) => {
                if rest.first() != Some(&b) {
                    return Err(JsonError::Malformed);
                }
                self.state = match &rest[1..] {
                    [] => State::CommaOrClose,
                    more => State::Literal(more),
                };
                Ok(())
            }
            _ if ws => Ok(()),
            State::Start => {
                if b != b'{' {
                    return Err(JsonError::Malformed);
                }
                self.open(b)
            }
            State::End => Err(JsonError::Malformed),
            State::Value => self.value(b),
            State::ValueOrClose => {
                if b == b']' {
                    self.close(b)
                } else {
                    self.value(b)
                }
            }
            State::KeyOrClose if b == b'}' => self.close(b),
            State::KeyOrClose | State::Key => {
                if b != b'"' {
                    return Err(JsonError::Malformed);
                }
                self.key_len = 0;
                self.key_escaped = false;
                self.state = State::Str { key: true };
                Ok(())
            }
            State::Colon => {
                if b != b':' {
                    return Err(JsonError::Malformed);
                }
                self.state = State::Value;
                Ok(())
            }
            State::CommaOrClose => match (b, self.stack.last()) {
                (b',', Some(b'{')) => {
                    self.state = State::Key;
                    Ok(())
                }
                (b',', Some(_)) => {
                    self.state = State::Value;
                    Ok(())
                }
                (b'}' | b']', _) => self.close(b),
                _ => Err(JsonError::Malformed),
            },
        }
    }

    /// A byte inside a string.
    fn string(&mut self, b: u8, key: bool) -> Result<(), JsonError> {
        if self.utf8_due > 0 {
            let (low, high) = self.utf8_next;
            if !(low..=high).contains(&b) {
                return Err(JsonError::Malformed);
            }
            self.utf8_due -= 1;
            self.utf8_next = (0x80, 0xBF);
            return Ok(());
        }
        match b {
            b'"' if key => {
                self.state = State::Colon;
                self.end_key()
            }
            b'"' => {
                self.state = State::CommaOrClose;
                Ok(())
            }
            b'\\' => {
                self.state = State::Escape { key };
                Ok(())
            }
            0x00..=0x1F => Err(JsonError::Malformed),
            0x20..=0x7F => {
                self.key_byte(key, b, false);
                Ok(())
            }
            _ => {
                // The first byte of a UTF-8 character: how many follow, and
                // the range of the next (no overlong forms, no surrogates,
                // nothing past U+10FFFF).
                let (due, next) = match b {
                    0xC2..=0xDF => (1, (0x80, 0xBF)),
                    0xE0 => (2, (0xA0, 0xBF)),
                    0xE1..=0xEC | 0xEE..=0xEF => (2, (0x80, 0xBF)),
                    0xED => (2, (0x80, 0x9F)),
                    0xF0 => (3, (0x90, 0xBF)),
                    0xF1..=0xF3 => (3, (0x80, 0xBF)),
                    0xF4 => (3, (0x80, 0x8F)),
                    _ => return Err(JsonError::Malformed),
                };
                self.utf8_due = due;
                self.utf8_next = next;
                self.key_byte(key, 0xFF, false);
                Ok(())
            }
        }
    }

    /// A decoded byte of a string: kept when it is part of a top-level key.
    fn key_byte(&mut self, key: bool, b: u8, escaped: bool) {
        if key && self.stack.len() == 1 {
            if let Some(slot) = self.key.get_mut(self.key_len) {
                *slot = b;
            }
            self.key_len += 1;
            self.key_escaped |= escaped;
        }
    }

    /// A key's closing quote: a top-level `model` is counted.
    fn end_key(&mut self) -> Result<(), JsonError> {
        if self.stack.len() != 1 || self.key_len != 5 || &self.key != b"model" {
            return Ok(());
        }
        if self.key_escaped {
            return Err(JsonError::EscapedModel);
        }
        self.models += 1;
        if self.models > 1 {
            return Err(JsonError::DuplicateModel);
        }
        Ok(())
    }

    /// The first byte of a value.
    fn value(&mut self, b: u8) -> Result<(), JsonError> {
        self.state = match b {
            b'{' | b'[' => return self.open(b),
            b'"' => State::Str { key: false },
            b'-' => State::Number(Num::Minus),
            b'0' => State::Number(Num::Zero),
            b'1'..=b'9' => State::Number(Num::Int),
            b't' => State::Literal(b"rue"),
            b'f' => State::Literal(b"alse"),
            b'n' => State::Literal(b"ull"),
            _ => return Err(JsonError::Malformed),
        };
        Ok(())
    }

    fn open(&mut self, b: u8) -> Result<(), JsonError> {
        if self.stack.len() >= MAX_DEPTH {
            return Err(JsonError::TooDeep);
        }
        self.stack.push(b);
        self.state = if b == b'{' {
            State::KeyOrClose
        } else {
            State::ValueOrClose
        };
        Ok(())
    }

    fn close(&mut self, b: u8) -> Result<(), JsonError> {
        let opened = self.stack.pop();
        let matches = matches!((opened, b), (Some(b'{'), b'}') | (Some(b'['), b']'));
        if !matches {
            return Err(JsonError::Malformed);
        }
        self.state = if self.stack.is_empty() {
            State::End
        } else {
            State::CommaOrClose
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn check(body: &[u8]) -> Result<(), JsonError> {
        let mut c = JsonCheck::default();
        c.feed(body)?;
        c.finish()
    }

    #[test]
    fn one_plain_model_passes_and_a_second_or_escaped_one_does_not() {
        for ok in [
            &br#"{"model":"m","messages":[{"role":"user","content":"hi \u00e9 \"x\""}]}"#[..],
            br#" {"stream" : true, "n": -1.5e+3, "x": null, "y": [false, {}, []], "model": "m"} "#,
            br#"{"nested":{"model":"a","model":"b"},"model":"m"}"#,
            br#"{"models":"a","mode":"b","model_x":1}"#,
            "{\"model\":\"mödel ✓ 😀\"}".as_bytes(),
            b"{}",
        ] {
            assert_eq!(check(ok), Ok(()), "{}", String::from_utf8_lossy(ok));
        }
        for (bad, why) in [
            (
                &br#"{"model":"cheap","pad":"x","model":"premium"}"#[..],
                JsonError::DuplicateModel,
            ),
            (br#"{"mod\u0065l":"premium"}"#, JsonError::EscapedModel),
            (
                br#"{"model":"a","mod\u0065l":"b"}"#,
                JsonError::EscapedModel,
            ),
            (br#"{"model":"a"} {"#, JsonError::Malformed),
            (br#"{"model":"a""#, JsonError::Malformed),
            (br#"{"a":01}"#, JsonError::Malformed),
            (br#"{"a":1.}"#, JsonError::Malformed),
            (br#"{"a":tru}"#, JsonError::Malformed),
            (br#"{"a":"\x"}"#, JsonError::Malformed),
            (b"{\"a\":\"\x01\"}", JsonError::Malformed),
            (b"{\"a\":\"\xC0\x80\"}", JsonError::Malformed),
            (b"{\"a\":\"\xED\xA0\x80\"}", JsonError::Malformed),
            (br#"{"a":[1,]}"#, JsonError::Malformed),
            (br#"{"a":1,}"#, JsonError::Malformed),
            (br#"{"a":[}"#, JsonError::Malformed),
            (br#"["model"]"#, JsonError::Malformed),
        ] {
            assert_eq!(check(bad), Err(why), "{}", String::from_utf8_lossy(bad));
        }
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert_eq!(check(deep.as_bytes()), Err(JsonError::TooDeep));
    }

    /// JSON-ish text: valid documents and near misses.
    fn jsonish() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("fals".to_owned()),
            "-?(0|[1-9][0-9]{0,3})(\\.[0-9]{1,3})?([eE][+-]?[0-9]{1,2})?",
            "-?0[0-9]",
            "\"([a-z é\\\\\"]|\\\\u00[0-7][0-9a-f]|\\\\[nt/])*\"",
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec(
                    (
                        prop_oneof![
                            Just("\"model\"".to_owned()),
                            Just("\"mod\\u0065l\"".to_owned()),
                            "\"[a-z]{0,6}\"",
                        ],
                        inner
                    ),
                    0..4
                )
                .prop_map(|v| {
                    let members: Vec<String> =
                        v.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        })
    }

    proptest! {
        /// The checker agrees with serde_json on whether a body is one JSON
        /// object, and finds a top-level `model` key written twice or with
        /// escapes exactly when serde would read one (however the body is
        /// cut into pieces).
        #[test]
        fn it_agrees_with_serde(body in jsonish(), cut in 0usize..64) {
            let mut c = JsonCheck::default();
            let bytes = body.as_bytes();
            let at = cut.min(bytes.len());
            let result = c.feed(&bytes[..at]).and_then(|()| c.feed(&bytes[at..])).and_then(|()| c.finish());
            let parsed = serde_json::from_slice::<serde_json::Value>(bytes);
            match &parsed {
                Ok(serde_json::Value::Object(_)) => {
                    // Count the top-level keys serde decodes to `model`,
                    // and whether each was written plainly.
                    let mut de = serde_json::Deserializer::from_slice(bytes);
                    let keys = top_level_keys(&mut de);
                    let models: Vec<&(String, bool)> =
                        keys.iter().filter(|(k, _)| k == "model").collect();
                    let expected = match models.as_slice() {
                        [] | [(_, false)] => Ok(()),
                        [(_, true), ..] => Err(JsonError::EscapedModel),
                        [_, (_, true), ..] => Err(JsonError::EscapedModel),
                        _ => Err(JsonError::DuplicateModel),
                    };
                    prop_assert_eq!(result, expected, "{}", body);
                }
                _ => prop_assert!(result.is_err(), "{} passed; serde: {:?}", body, parsed),
            }
        }
    }

    /// The top-level keys of an object as serde decodes them, each with
    /// whether its raw spelling held an escape (serde lends a key written
    /// plainly, and copies one it had to decode).
    fn top_level_keys(
        de: &mut serde_json::Deserializer<serde_json::de::SliceRead<'_>>,
    ) -> Vec<(String, bool)> {
        use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
        use std::fmt;
        struct Key;
        impl<'de> Visitor<'de> for Key {
            type Value = (String, bool);
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok((v.to_owned(), false))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok((v.to_owned(), true))
            }
        }
        impl<'de> DeserializeSeed<'de> for Key {
            type Value = (String, bool);
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_str(self)
            }
        }
        struct Keys;
        impl<'de> Visitor<'de> for Keys {
            type Value = Vec<(String, bool)>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut keys = Vec::new();
                while let Some(key) = map.next_key_seed(Key)? {
                    keys.push(key);
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
                Ok(keys)
            }
        }
        de.deserialize_map(Keys).unwrap_or_default()
    }
}

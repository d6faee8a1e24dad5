//! Phase: the prompt text `cache_aware` routes by.
//!
//! Owns rendering an inference body's prompt into the bytes the prefix trees
//! match: chat `messages` in order (`role`, `:`, the content's text, a
//! newline; content given as parts keeps its `text` parts), else `prompt`,
//! `input` or `text` (a string, or strings in a list). Only the first
//! [`MAX_PROMPT_BYTES`] are kept. It is called only under `cache_aware`, so
//! the other policies pay nothing; it reads the body and changes nothing, and
//! a body it cannot read gives no prompt (the request is then routed by load),
//! never an error: the model scan already answered malformed bodies.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;

/// The prompt bytes routing looks at. Two prompts sharing 32 KiB (about 8K
/// tokens) are the same conversation or system prompt for routing; what
/// follows would not change the choice, and the bound caps each request's
/// tree walk (a memory comparison of at most this much) and what one insert
/// can add to a tree.
pub(crate) const MAX_PROMPT_BYTES: usize = 32 * 1024;

#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(default, borrow)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default, borrow)]
    prompt: Option<Text<'a>>,
    #[serde(default, borrow)]
    input: Option<Text<'a>>,
    #[serde(default, borrow)]
    text: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default, borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Option<Text<'a>>,
}

/// A string, a list of strings or of `{"text": ...}` parts; anything else
/// (token ids, images) has no text.
#[derive(Deserialize)]
#[serde(untagged)]
enum Text<'a> {
    One(#[serde(borrow)] Cow<'a, str>),
    Many(#[serde(borrow)] Vec<Part<'a>>),
    Other(IgnoredAny),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Part<'a> {
    Plain(#[serde(borrow)] Cow<'a, str>),
    Object {
        #[serde(default, borrow)]
        text: Option<Cow<'a, str>>,
    },
    Other(IgnoredAny),
}

/// Appends up to the bound; `false` once it is reached.
fn push(out: &mut Vec<u8>, s: &str) -> bool {
    let room = MAX_PROMPT_BYTES - out.len();
    out.extend_from_slice(&s.as_bytes()[..s.len().min(room)]);
    out.len() < MAX_PROMPT_BYTES
}

fn push_text(out: &mut Vec<u8>, text: &Text<'_>) -> bool {
    match text {
        Text::One(s) => push(out, s),
        Text::Many(parts) => parts.iter().all(|p| match p {
            Part::Plain(s) | Part::Object { text: Some(s) } => push(out, s),
            _ => true,
        }),
        Text::Other(_) => true,
    }
}

/// The rendered prompt of an inference body, at most [`MAX_PROMPT_BYTES`];
/// `None` when it has none.
pub(crate) fn prompt_text(body: &[u8]) -> Option<Vec<u8>> {
    let fields: Fields<'_> = serde_json::from_slice(body).ok()?;
    let mut out = Vec::new();
    if let Some(messages) = &fields.messages {
        for m in messages {
            let more = push(&mut out, m.role.as_deref().unwrap_or(""))
                && push(&mut out, ":")
                && m.content.as_ref().is_none_or(|c| push_text(&mut out, c))
                && push(&mut out, "\n");
            if !more {
                break;
            }
        }
    } else if let Some(t) = [&fields.prompt, &fields.input, &fields.text]
        .into_iter()
        .flatten()
        .next()
    {
        push_text(&mut out, t);
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(body: &str) -> Option<String> {
        prompt_text(body.as_bytes()).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn chat_messages_render_in_order_with_their_roles() {
        let body = r#"{"model":"m","messages":[
            {"role":"system","content":"be \"brief\""},
            {"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{}}]},
            {"role":"assistant","content":null}]}"#;
        assert_eq!(
            text(body).as_deref(),
            Some("system:be \"brief\"\nuser:hi\nassistant:\n")
        );
    }

    #[test]
    fn completions_embeddings_and_text_fields_are_prompts() {
        assert_eq!(
            text(r#"{"prompt":"once upon"}"#).as_deref(),
            Some("once upon")
        );
        assert_eq!(text(r#"{"prompt":["a","b"]}"#).as_deref(), Some("ab"));
        assert_eq!(text(r#"{"input":"embed me"}"#).as_deref(), Some("embed me"));
        assert_eq!(text(r#"{"text":"gen"}"#).as_deref(), Some("gen"));
        assert_eq!(text(r#"{"prompt":[1,2,3]}"#), None);
        assert_eq!(text(r#"{"model":"m"}"#), None);
        assert_eq!(text("not json"), None);
    }

    #[test]
    fn a_long_prompt_is_cut_at_the_bound() {
        let long = "x".repeat(MAX_PROMPT_BYTES * 2);
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}},{{"role":"user","content":"more"}}]}}"#
        );
        let got = prompt_text(body.as_bytes()).unwrap();
        assert_eq!(got.len(), MAX_PROMPT_BYTES);
        assert!(got.starts_with(b"user:xxx"));
    }
}

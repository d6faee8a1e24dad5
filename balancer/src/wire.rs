//! HTTP/1.1 wire helpers shared by the server's fast path and the worker
//! client: where the parts of a parsed head sit, header maps built from a
//! frozen head without copying a value, header fields kept as they came (a
//! worker's answer, a client's plain request) so that they are relayed
//! without any map, one view over such fields and a map, and the number
//! formats of framing.
//!
//! Owns no I/O and no policy: which headers are allowed, and what a
//! malformed one means, is for the caller to say.

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Where one header's name and value sit in its head, as byte offsets.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Field {
    name: (u32, u32),
    value: (u32, u32),
}

impl Field {
    /// The field of `header`, parsed out of `head`.
    pub(crate) fn of(head: &[u8], header: &httparse::Header<'_>) -> Self {
        Self {
            name: span(head, header.name.as_bytes()),
            value: span(head, header.value),
        }
    }
}

/// Where `part`, a slice of `head` (or an empty slice), sits in it. An
/// empty part is (0, 0): its pointer need not point into `head`.
pub(crate) fn span(head: &[u8], part: &[u8]) -> (u32, u32) {
    if part.is_empty() {
        return (0, 0);
    }
    let at = (part.as_ptr() as usize).wrapping_sub(head.as_ptr() as usize);
    debug_assert!(at + part.len() <= head.len(), "a part outside its head");
    (at as u32, (at + part.len()) as u32)
}

/// A header that `http`'s types refuse.
#[derive(Debug)]
pub(crate) struct BadHeader(pub(crate) String);

/// The headers at `fields` of `head`: values share `head`'s bytes.
pub(crate) fn header_map(head: &Bytes, fields: &[Field]) -> Result<HeaderMap, BadHeader> {
    let mut map = HeaderMap::with_capacity(fields.len());
    for field in fields {
        let (name, value) = header(head, field)?;
        map.append(name, value);
    }
    Ok(map)
}

/// The header at `field` of `head`, in `http`'s types.
fn header(head: &Bytes, field: &Field) -> Result<(HeaderName, HeaderValue), BadHeader> {
    let name = &head[field.name.0 as usize..field.name.1 as usize];
    let name = HeaderName::from_bytes(name)
        .map_err(|_| BadHeader(format!("header name {:?}", String::from_utf8_lossy(name))))?;
    let value = head.slice(field.value.0 as usize..field.value.1 as usize);
    let value =
        HeaderValue::from_maybe_shared(value).map_err(|_| BadHeader(format!("value of {name}")))?;
    Ok((name, value))
}

/// Header fields kept as they came in a head, httparse-checked, so that an
/// HTTP/1.1 writer copies them out without building a map: names keep the
/// sender's spelling, values share the head's bytes. Small, as it
/// moves with every response: the list is one allocation, where a map took
/// two and one per unusual name.
#[derive(Debug, Clone, Default)]
pub struct RawFields {
    head: Bytes,
    fields: Vec<Field>,
}

impl RawFields {
    /// The fields at `fields` of `head`.
    pub(crate) fn new(head: Bytes, fields: Vec<Field>) -> Self {
        Self { head, fields }
    }

    /// The fields of `block` (header lines and the blank line), for tests.
    #[cfg(test)]
    pub(crate) fn parsed(block: &[u8]) -> Self {
        let head = Bytes::copy_from_slice(block);
        let mut parsed = [httparse::EMPTY_HEADER; 32];
        let httparse::Status::Complete(_) = httparse::parse_headers(&head, &mut parsed).unwrap()
        else {
            panic!("a complete block");
        };
        let fields: Vec<Field> = parsed
            .iter()
            .take_while(|h| !h.name.is_empty())
            .map(|h| Field::of(&head, h))
            .collect();
        Self::new(head.clone(), fields)
    }

    /// Every `(name, value)`, in the sender's order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields.iter().map(|f| {
            (
                &self.head[f.name.0 as usize..f.name.1 as usize],
                &self.head[f.value.0 as usize..f.value.1 as usize],
            )
        })
    }

    /// The first value of `name` (given in lower case), compared without
    /// regard to case.
    pub(crate) fn get(&self, name: &str) -> Option<&[u8]> {
        let wanted = name.as_bytes();
        let head = &self.head[..];
        self.fields.iter().find_map(|f| {
            let (start, end) = (f.name.0 as usize, f.name.1 as usize);
            // Lengths first, from the offsets: most names differ in length,
            // and no slice is cut for them.
            if end.wrapping_sub(start) != wanted.len()
                || !head.get(start..end)?.eq_ignore_ascii_case(wanted)
            {
                return None;
            }
            head.get(f.value.0 as usize..f.value.1 as usize)
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.fields.len()
    }

    /// Whether `name` (given in lower case) is among the fields.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Drops every field whose name `doomed` picks.
    pub(crate) fn remove_where(&mut self, doomed: impl Fn(&[u8]) -> bool) {
        let head = &self.head;
        self.fields
            .retain(|f| !doomed(&head[f.name.0 as usize..f.name.1 as usize]));
    }

    /// Every field in `http`'s types; a field `http` refuses is an error
    /// (httparse checked names and values by the same rules, so none is
    /// expected).
    pub(crate) fn typed(
        &self,
    ) -> impl Iterator<Item = Result<(HeaderName, HeaderValue), BadHeader>> + '_ {
        self.fields.iter().map(|field| header(&self.head, field))
    }

    /// Moves the fields into `map`, for a writer that takes a map (hyper's).
    /// A field `http` refuses is dropped and named in the error; httparse
    /// checked names and values by the same rules, so none is expected.
    pub(crate) fn append_to(&mut self, map: &mut HeaderMap) -> Result<(), BadHeader> {
        let mut refused = None;
        map.reserve(self.fields.len());
        for typed in self.typed() {
            match typed {
                Ok((name, value)) => {
                    map.append(name, value);
                }
                Err(e) => refused = Some(e),
            }
        }
        self.fields.clear();
        refused.map_or(Ok(()), Err)
    }
}

/// A message's headers as they were delivered: in hyper's map, as the fast
/// path's fields, or both. Lookups and iteration see both, the fields
/// first; names found in the fields keep the sender's spelling.
#[derive(Debug, Default)]
pub(crate) struct Headers {
    pub(crate) map: HeaderMap,
    pub(crate) raw: RawFields,
}

impl Headers {
    pub(crate) fn len(&self) -> usize {
        self.map.len() + self.raw.len()
    }

    /// The first value of `name`.
    pub(crate) fn get(&self, name: &HeaderName) -> Option<&[u8]> {
        first_value(&self.raw, &self.map, name)
    }

    /// Every value of `name`, in order.
    pub(crate) fn get_all<'a>(&'a self, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> {
        let raw = self
            .raw
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name.as_str().as_bytes()))
            .map(|(_, v)| v);
        raw.chain(self.map.get_all(name).iter().map(HeaderValue::as_bytes))
    }

    pub(crate) fn contains(&self, name: &HeaderName) -> bool {
        self.get(name).is_some()
    }

    /// Every `(name, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let map = self
            .map
            .iter()
            .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
        self.raw.iter().chain(map)
    }
}

/// The first value of `name` among a message's fields as they came, else in
/// its map: where one reads a header whichever way it was delivered.
pub(crate) fn first_value<'a>(
    raw: &'a RawFields,
    map: &'a HeaderMap,
    name: &HeaderName,
) -> Option<&'a [u8]> {
    match raw.get(name.as_str()) {
        Some(value) => Some(value),
        None => map.get(name).map(HeaderValue::as_bytes),
    }
}

impl From<HeaderMap> for Headers {
    fn from(map: HeaderMap) -> Self {
        Self {
            map,
            raw: RawFields::default(),
        }
    }
}

/// `name: value` and its CRLF, into `out`.
pub(crate) fn put_header(out: &mut BytesMut, name: &[u8], value: &[u8]) {
    out.put_slice(name);
    out.put_slice(b": ");
    out.put_slice(value);
    out.put_slice(b"\r\n");
}

/// A `Content-Length` value: ASCII digits only, no sign, no list, no
/// blanks.
pub(crate) fn parse_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() || value.len() > 18 {
        return None;
    }
    value.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

/// `n` in decimal, in `buf`.
pub(crate) fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// `n` in hexadecimal (a chunk size), in `buf`.
pub(crate) fn hex(mut n: usize, buf: &mut [u8; 16]) -> &[u8] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = DIGITS[n & 0xf];
        n >>= 4;
        if n == 0 {
            return &buf[at..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_of_fields_and_a_map_sees_both() {
        let mut map = HeaderMap::new();
        map.append("x-a", HeaderValue::from_static("3"));
        map.append("x-b", HeaderValue::from_static("4"));
        let headers = Headers {
            map,
            raw: RawFields::parsed(b"X-A: 1\r\nHost: h\r\nx-a: 2\r\n\r\n"),
        };
        let x_a = HeaderName::from_static("x-a");
        assert_eq!(headers.len(), 5);
        assert_eq!(headers.get(&x_a), Some(&b"1"[..]), "the fields first");
        assert_eq!(
            headers.get(&HeaderName::from_static("x-b")),
            Some(&b"4"[..])
        );
        assert!(headers.contains(&http::header::HOST));
        assert!(!headers.contains(&http::header::ACCEPT));
        let all: Vec<&[u8]> = headers.get_all(&x_a).collect();
        assert_eq!(all, [&b"1"[..], b"2", b"3"]);
        let names: Vec<&[u8]> = headers.iter().map(|(n, _)| n).collect();
        assert_eq!(names, [&b"X-A"[..], b"Host", b"x-a", b"x-a", b"x-b"]);
    }

    #[test]
    fn raw_fields_are_found_dropped_and_merged_into_a_map() {
        let mut fields =
            RawFields::parsed(b"Content-Type: text/plain\r\nX-Worker: a\r\nx-worker: b\r\n\r\n");
        assert_eq!(fields.len(), 3);
        assert_eq!(fields.get("content-type"), Some(&b"text/plain"[..]));
        assert_eq!(fields.get("x-worker"), Some(&b"a"[..]), "the first");
        assert!(!fields.contains("content-length"));
        fields.remove_where(|name| name.eq_ignore_ascii_case(b"content-type"));
        assert!(!fields.contains("content-type"));
        let mut map = HeaderMap::new();
        map.insert("x-gateway", HeaderValue::from_static("kept"));
        fields.append_to(&mut map).unwrap();
        assert_eq!(fields.len(), 0, "moved");
        let workers: Vec<_> = map.get_all("x-worker").iter().collect();
        assert_eq!(workers, ["a", "b"]);
        assert_eq!(map["x-gateway"], "kept");
    }

    #[test]
    fn lengths_are_plain_digits() {
        assert_eq!(parse_length(b"0"), Some(0));
        assert_eq!(parse_length(b"1234"), Some(1234));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1 ",
            b"1,1",
            b"0x10",
            b"9999999999999999999",
        ] {
            assert_eq!(parse_length(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn numbers_are_written_as_std_writes_them() {
        for n in [0u64, 7, 10, 255, 4096, 123_456_789, u64::MAX] {
            assert_eq!(decimal(n, &mut [0; 20]), n.to_string().as_bytes());
            let n = n as usize;
            assert_eq!(hex(n, &mut [0; 16]), format!("{n:x}").as_bytes());
        }
    }

    #[test]
    fn a_header_map_shares_its_head() {
        let head = Bytes::from_static(b"HTTP/1.1 200 OK\r\nX-A: one\r\nx-b:\r\n\r\n");
        let mut slots = [httparse::EMPTY_HEADER; 4];
        let mut parsed = httparse::Response::new(&mut slots);
        parsed.parse(&head).unwrap();
        let fields: Vec<Field> = parsed.headers.iter().map(|h| Field::of(&head, h)).collect();
        let map = header_map(&head, &fields).unwrap();
        assert_eq!(map["x-a"], "one");
        assert_eq!(map["x-b"], "");
        let bad = Bytes::from_static(b"x\x01y");
        let field = Field {
            name: (0, 1),
            value: (0, 3),
        };
        assert!(header_map(&bad, &[field]).is_err());
    }
}

//! HTTP/1.1 wire helpers shared by the server's fast path and the worker
//! client: where the parts of a parsed head sit, header maps built from a
//! frozen head without copying a value, and the number formats of framing.
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
        let name = &head[field.name.0 as usize..field.name.1 as usize];
        let name = HeaderName::from_bytes(name)
            .map_err(|_| BadHeader(format!("header name {:?}", String::from_utf8_lossy(name))))?;
        let value = head.slice(field.value.0 as usize..field.value.1 as usize);
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|_| BadHeader(format!("value of {name}")))?;
        map.append(name, value);
    }
    Ok(map)
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

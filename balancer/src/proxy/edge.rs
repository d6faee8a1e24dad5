//! Phase: the public edge.
//!
//! Owns what an untrusted client may ask of the workers: which routes are
//! forwarded (an allow-list over the normalised path) and with which
//! methods, and which of the client's headers reach a worker (the
//! hop-by-hop ones and those the client names in `Connection` or
//! `Proxy-Connection` do not; `X-Forwarded-For` and `-Proto` are the
//! gateway's, as Envoy sets them with no trusted hops), and the request id
//! (the client's, or one made here). Pure functions over the request head:
//! no I/O, no worker, no breaker.

use std::borrow::Cow;
use std::cell::RefCell;
use std::net::IpAddr;

use http::Method;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use bytes::BytesMut;

use crate::h1::ForwardedFields;
use crate::wire::{Headers, put_header};

/// Headers that describe one hop, not the message.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Inference routes: POST with a JSON body that names the model.
const INFERENCE_ROUTES: &[&str] = &[
    // OpenAI-compatible (vLLM, SGLang, TGI, llama.cpp).
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    // Cross-encoders and scoring (vLLM, SGLang, TEI).
    "/v1/rerank",
    "/rerank",
    "/v1/score",
    "/score",
    // Tokenizer endpoints (vLLM, SGLang): read-only and cheap.
    "/tokenize",
    "/detokenize",
    // SGLang's native generation API.
    "/generate",
];

/// The inference routes that generate a completion, judged by
/// `--cb-min-completion-tokens`. Embeddings, rerank, scores and the
/// tokenizer answer no completion: nothing there counts as short.
const GENERATIVE_ROUTES: &[&str] = &["/v1/chat/completions", "/v1/completions", "/generate"];

/// Whether an outgoing path (the route's spelling, then any query) is a
/// generative route's.
pub(crate) fn is_generative(path: &str) -> bool {
    // By length first, then bytes: it runs for every request (a search for
    // `?` cost ~200 instructions).
    let path = path.as_bytes();
    GENERATIVE_ROUTES.iter().any(|route| {
        let route = route.as_bytes();
        matches!(path.get(route.len()), None | Some(b'?')) && path.get(..route.len()) == Some(route)
    })
}

/// The model list, which the gateway answers itself: GET or HEAD.
const MODEL_LIST: &str = "/v1/models";
/// One model's card (`/v1/models/{id}`), from a worker serving it: GET.
const MODEL_CARD: &str = "/v1/models/";

/// What the edge makes of a request's method and path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    /// A JSON inference route: forwarded, its body must be a JSON object.
    /// One of a fixed list, so it borrows the list's spelling.
    Inference(&'static str),
    /// `GET /v1/models`: the union of the fleet's models, answered by the
    /// gateway.
    ModelList,
    /// `GET /v1/models/{id}`: forwarded to a worker that serves `id`.
    ModelCard { path: String, id: String },
    /// Any other allowed route: forwarded as it is.
    Forward(String),
    /// Allowed path, method not allowed there.
    MethodNotAllowed(&'static str),
    /// Not a route the gateway forwards.
    NotFound,
    /// The path could not be normalised (bad escape, climbs above the root).
    BadPath,
}

/// The routes the gateway forwards: the defaults above plus `--allow-path`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Routes {
    /// `--allow-path` values: exact paths, or prefixes ending in `/*`.
    extra: Vec<String>,
}

impl Routes {
    /// The default routes plus `extra` (`--allow-path`).
    pub fn new(extra: &[String]) -> Self {
        Self {
            extra: extra.to_vec(),
        }
    }

    /// Checks an `--allow-path` value: an absolute path, optionally ending
    /// in `/*` for a prefix.
    pub fn check(path: &str) -> Result<(), String> {
        // `/*` is the prefix of every path.
        let bare = match path.strip_suffix("/*") {
            Some("") => "/",
            Some(prefix) => prefix,
            None => path,
        };
        match normalize_path(bare) {
            Some(n) if n == bare => Ok(()),
            _ => Err(format!(
                "{path:?} is not a normalised absolute path (or a prefix ending in /*)"
            )),
        }
    }

    fn extra_allows(&self, path: &str) -> bool {
        self.extra
            .iter()
            .any(|allowed| match allowed.strip_suffix("/*") {
                Some(prefix) => path.starts_with(prefix) && path[prefix.len()..].starts_with('/'),
                None => allowed == path,
            })
    }

    /// Where `method path` goes. The `Allow` of a 405 lists exactly the
    /// methods that path takes.
    pub(crate) fn route(&self, method: &Method, path: &str) -> Route {
        let Some(path) = normalize_path(path) else {
            return Route::BadPath;
        };
        // An encoded `/` or `\` stays encoded, and matches no route: a
        // worker that decodes it before routing would see another path
        // (`/v1/models/..%2F..%2Fflush_cache`). Only a path with an escape
        // took the long way.
        if let Cow::Owned(decoded) = &path
            && (decoded.contains("%2F") || decoded.contains("%5C"))
        {
            return Route::NotFound;
        }
        if let Some(&route) = INFERENCE_ROUTES.iter().find(|&&r| r == path) {
            return if method == Method::POST {
                Route::Inference(route)
            } else {
                Route::MethodNotAllowed("POST")
            };
        }
        if path == MODEL_LIST {
            return if method == Method::GET || method == Method::HEAD {
                Route::ModelList
            } else {
                Route::MethodNotAllowed("GET, HEAD")
            };
        }
        if let Some(id) = path.strip_prefix(MODEL_CARD).filter(|id| !id.is_empty()) {
            return if method == Method::GET {
                Route::ModelCard {
                    id: id.to_owned(),
                    path: path.into_owned(),
                }
            } else {
                Route::MethodNotAllowed("GET")
            };
        }
        if self.extra_allows(&path) {
            // CONNECT, TRACE, PUT, DELETE, ... reach no worker anywhere.
            return if method == Method::GET || method == Method::POST {
                Route::Forward(path.into_owned())
            } else {
                Route::MethodNotAllowed("GET, POST")
            };
        }
        Route::NotFound
    }
}

/// The path as the allow-list and the worker see it: percent-escapes of
/// unreserved characters decoded, empty and `.` segments dropped, `..`
/// resolved (RFC 3986 §6.2.2). `None` for a path that is not absolute, has
/// a malformed escape or climbs above the root. Other escapes (an encoded
/// `/` among them) stay encoded, so they match no route.
pub(crate) fn normalize_path(path: &str) -> Option<Cow<'_, str>> {
    if !path.starts_with('/') {
        return None;
    }
    if is_clean(path) {
        return Some(Cow::Borrowed(path));
    }
    resolve(path).map(Cow::Owned)
}

/// The long way of [`normalize_path`]: escapes decoded, segments resolved.
fn resolve(path: &str) -> Option<String> {
    let decoded = decode_unreserved(path)?;
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop()?;
            }
            s => segments.push(s),
        }
    }
    Some(format!("/{}", segments.join("/")))
}

/// Whether an absolute path is already normal: no escape, no empty
/// segment, no trailing `/` (but the root), no segment starting with `.`
/// (a superset of `.` and `..`: such a path only takes the long way). One
/// pass over the bytes: it runs for every request.
fn is_clean(path: &str) -> bool {
    let bytes = path.as_bytes();
    if bytes.len() > 1 && bytes.ends_with(b"/") {
        return false;
    }
    // `contains` on bytes is a vectorised search; the pairs loop has no
    // state to carry from byte to byte.
    !bytes.contains(&b'%')
        && !bytes
            .windows(2)
            .any(|pair| pair[0] == b'/' && (pair[1] == b'/' || pair[1] == b'.'))
}

fn decode_unreserved(path: &str) -> Option<String> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = path.get(i + 1..i + 3)?;
            if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            let value = u8::from_str_radix(hex, 16).ok()?;
            if value.is_ascii_alphanumeric() || b"-._~".contains(&value) {
                out.push(char::from(value));
            } else {
                out.push('%');
                out.push_str(&hex.to_ascii_uppercase());
            }
            i += 3;
        } else {
            let c = path[i..].chars().next()?;
            out.push(c);
            i += c.len_utf8();
        }
    }
    Some(out)
}

/// The client's headers as a worker gets them, decided without editing
/// the client's map: hop-by-hop headers, those the client names in
/// `Connection` or `Proxy-Connection`, `Host` and `Content-Length` (set for
/// the hop to the worker) are left out; `X-Forwarded-For` is the peer (or,
/// behind `trusted_hops` trusted proxies, the peer appended to the chain
/// they sent) and `X-Forwarded-Proto` is `proto`, the scheme the client
/// spoke (kept as a trusted proxy set it).
pub(crate) struct Forwarded {
    headers: Headers,
    /// Headers named by `Connection` or `Proxy-Connection`; usually none.
    named: Vec<HeaderName>,
    forwarded_for: HeaderValue,
    /// `None` when a trusted proxy's `X-Forwarded-Proto` is kept.
    forwarded_proto: Option<HeaderValue>,
    /// A request id the gateway made (a client's own is among `headers`).
    /// Boxed: off by default, and every request's `Forwarded` is moved.
    request_id: Option<Box<(HeaderName, HeaderValue)>>,
}

impl Forwarded {
    pub(crate) fn new(
        headers: Headers,
        peer: IpAddr,
        proto: &'static str,
        trusted_hops: u32,
    ) -> Self {
        // One pass over the handful of headers present: two lookups by
        // name would hash both names (one of them custom) every request.
        let named = headers
            .iter()
            .filter(|(name, _)| {
                name.eq_ignore_ascii_case(b"connection")
                    || name.eq_ignore_ascii_case(b"proxy-connection")
            })
            .filter_map(|(_, v)| visible_ascii(v))
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        let proto = HeaderValue::from_static(proto);
        let (forwarded_for, forwarded_proto) = if trusted_hops == 0 {
            // Nothing the client says about itself is trusted: its values
            // are replaced.
            (peer_value(peer), Some(proto))
        } else {
            let kept = headers.contains(&X_FORWARDED_PROTO);
            (forwarded_chain(&headers, peer), (!kept).then_some(proto))
        };
        Self {
            headers,
            named,
            forwarded_for,
            forwarded_proto,
            request_id: None,
        }
    }

    /// Sends the request id the gateway made for a request without one.
    pub(crate) fn with_request_id(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.request_id = Some(Box::new((name, value)));
        self
    }

    /// The client's headers, whether or not they are forwarded.
    pub(crate) fn client(&self) -> &Headers {
        &self.headers
    }

    /// Whether the client's header `name` (in any case) stays behind.
    fn left_out(&self, name: &[u8]) -> bool {
        let is = |wanted: &[u8]| name.eq_ignore_ascii_case(wanted);
        is_hop_by_hop_name(name)
            // The worker's authority comes from its URL, and the body may
            // be rewritten (a fallback's model): the client's Host and
            // length are not the worker's.
            || is(b"host")
            || is(b"content-length")
            || is(b"x-forwarded-for")
            || (self.forwarded_proto.is_some() && is(b"x-forwarded-proto"))
            || self.named.iter().any(|n| is(n.as_str().as_bytes()))
            // CGI-style servers read `X_Forwarded_For` as `X-Forwarded-For`:
            // names with underscores are dropped, as nginx drops them by
            // default (`underscores_in_headers off`).
            || name.contains(&b'_')
    }

    /// Every header forwarded, the gateway's own last.
    pub(crate) fn each(&self, mut f: impl FnMut(&[u8], &[u8])) {
        for (name, value) in self.headers.iter() {
            if !self.left_out(name) {
                f(name, value);
            }
        }
        f(b"x-forwarded-for", self.forwarded_for.as_bytes());
        if let Some(proto) = &self.forwarded_proto {
            f(b"x-forwarded-proto", proto.as_bytes());
        }
        if let Some((name, value)) = self.request_id.as_deref() {
            f(name.as_str().as_bytes(), value.as_bytes());
        }
    }

    /// The forwarded headers as a map, for hyper's client.
    pub(crate) fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.headers.len() + 2);
        // The fast path's fields were checked by `http`'s rules when parsed.
        for (name, value) in self.headers.raw.typed().flatten() {
            if !self.left_out(name.as_str().as_bytes()) {
                map.append(name, value);
            }
        }
        for (name, value) in &self.headers.map {
            if !self.left_out(name.as_str().as_bytes()) {
                map.append(name.clone(), value.clone());
            }
        }
        map.append(X_FORWARDED_FOR, self.forwarded_for.clone());
        if let Some(proto) = &self.forwarded_proto {
            map.append(X_FORWARDED_PROTO, proto.clone());
        }
        if let Some((name, value)) = self.request_id.as_deref() {
            map.append(name.clone(), value.clone());
        }
        map
    }
}

impl ForwardedFields for Forwarded {
    fn count(&self) -> usize {
        self.headers.len()
    }

    fn has_authorization(&self) -> bool {
        self.headers.contains(&header::AUTHORIZATION)
    }

    fn put(&self, out: &mut BytesMut) {
        self.each(|name, value| put_header(out, name, value));
    }
}

/// The request's id: the value of the first of `names` the client sent
/// (a visible-ASCII value, else it is not an id), or a new one under the
/// first name; `made` says which. A made id is this thread's random prefix
/// and its count of ids, written without allocating but for the value.
/// Lower-case hex digits.
const HEX: &[u8; 16] = b"0123456789abcdef";

pub(crate) fn request_id(headers: &Headers, names: &[HeaderName]) -> RequestId {
    for name in names {
        if let Some(value) = headers.get(name).filter(|v| visible_ascii(v).is_some())
            && let Ok(value) = HeaderValue::from_bytes(value)
        {
            return RequestId {
                name: name.clone(),
                value,
                made: false,
            };
        }
    }
    thread_local! {
        static IDS: (u32, std::cell::Cell<u64>) =
            (rand::random(), std::cell::Cell::new(0));
    }
    let (prefix, count) = IDS.with(|(prefix, next)| {
        let count = next.get().wrapping_add(1);
        next.set(count);
        (*prefix, count)
    });
    // `{prefix:08x}-{count:x}` by hand: `write!` costs several hundred
    // instructions a request, this a few dozen.
    let mut buf = [0u8; 25];
    let mut len = 0;
    for shift in (0..8).rev() {
        buf[len] = HEX[(prefix >> (shift * 4)) as usize & 0xF];
        len += 1;
    }
    buf[len] = b'-';
    len += 1;
    let digits = (64 - count.leading_zeros()).div_ceil(4).max(1);
    for shift in (0..digits).rev() {
        buf[len] = HEX[(count >> (shift * 4)) as usize & 0xF];
        len += 1;
    }
    RequestId {
        name: names
            .first()
            .cloned()
            .unwrap_or(HeaderName::from_static("x-request-id")),
        value: shared_value(&buf[..len]),
        made: true,
    }
}

/// A header value of `text` (visible ASCII), cut from a buffer the thread
/// keeps: a made request id costs an allocation per few hundred requests,
/// not one each.
fn shared_value(text: &[u8]) -> HeaderValue {
    thread_local! {
        static SPARE: std::cell::RefCell<bytes::BytesMut> =
            std::cell::RefCell::new(bytes::BytesMut::new());
    }
    SPARE.with_borrow_mut(|spare| {
        if spare.capacity() - spare.len() < text.len() {
            *spare = bytes::BytesMut::with_capacity(8 * 1024);
        }
        spare.extend_from_slice(text);
        let bytes = spare.split_to(text.len()).freeze();
        HeaderValue::from_maybe_shared(bytes).expect("hex digits and a dash")
    })
}

/// See [`request_id`].
pub(crate) struct RequestId {
    pub(crate) name: HeaderName,
    pub(crate) value: HeaderValue,
    /// The gateway made it: the worker needs it added.
    pub(crate) made: bool,
}

/// Whether a header describes one hop rather than the message: the
/// standard ones, and `Proxy-Connection` and `Keep-Alive` of old clients.
pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || name == PROXY_CONNECTION || name == KEEP_ALIVE
}

/// [`is_hop_by_hop`] for a name as it came on the wire, in any case. By
/// length first: most names are no hop-by-hop name's length.
pub(crate) fn is_hop_by_hop_name(name: &[u8]) -> bool {
    let candidates: &[&[u8]] = match name.len() {
        2 => &[b"te"],
        7 => &[b"trailer", b"upgrade"],
        10 => &[b"connection", b"keep-alive"],
        16 => &[b"proxy-connection"],
        17 => &[b"transfer-encoding"],
        18 => &[b"proxy-authenticate"],
        19 => &[b"proxy-authorization"],
        _ => return false,
    };
    candidates.iter().any(|hop| name.eq_ignore_ascii_case(hop))
}

/// Removes every header `doomed` picks. A removal by name hashes the name
/// whether or not it is there, and a message carries a handful of headers:
/// one pass over the names present is cheaper than a removal per name that
/// might be.
pub(crate) fn strip(headers: &mut HeaderMap, doomed: impl Fn(&HeaderName) -> bool) {
    let present: Vec<HeaderName> = headers.keys().filter(|n| doomed(n)).cloned().collect();
    for name in present {
        headers.remove(name);
    }
}

const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// The peer's address as a header value, kept for the last peer this
/// serving thread saw: a connection's requests all come from one address,
/// and a comparison is cheaper than formatting it again.
fn peer_value(peer: IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: RefCell<Option<(IpAddr, HeaderValue)>> = const { RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((ip, value)) if *ip == peer => value.clone(),
        _ => {
            let value = ip_value(peer);
            *last = Some((peer, value.clone()));
            value
        }
    })
}

/// A header value as text when it is visible ASCII (and tabs), as
/// [`HeaderValue::to_str`] takes it.
fn visible_ascii(value: &[u8]) -> Option<&str> {
    let visible = value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b));
    visible.then(|| std::str::from_utf8(value).ok()).flatten()
}

/// A trusted proxy's `X-Forwarded-For` chain with the peer appended.
fn forwarded_chain(headers: &Headers, peer: IpAddr) -> HeaderValue {
    let name = X_FORWARDED_FOR;
    let chain: Vec<&str> = headers.get_all(&name).filter_map(visible_ascii).collect();
    let mut joined = chain.join(", ");
    if !joined.is_empty() {
        joined.push_str(", ");
    }
    joined.push_str(&peer.to_string());
    HeaderValue::try_from(joined).unwrap_or_else(|_| ip_value(peer))
}

/// The peer's address as a header value. IPv4, every request's case, is
/// written digit by digit: the formatting machinery costs more than the
/// rest of the header work.
fn ip_value(ip: IpAddr) -> HeaderValue {
    let IpAddr::V4(v4) = ip else {
        return HeaderValue::try_from(ip.to_string()).expect("an IP address is a header value");
    };
    let mut text = [0u8; 15];
    let mut len = 0;
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            text[len] = b'.';
            len += 1;
        }
        let digits = [octet / 100, octet / 10 % 10, octet % 10];
        let skip = if octet >= 100 {
            0
        } else if octet >= 10 {
            1
        } else {
            2
        };
        for d in &digits[skip..] {
            text[len] = b'0' + d;
            len += 1;
        }
    }
    HeaderValue::from_bytes(&text[..len]).expect("digits and dots are a header value")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::RawFields;

    #[test]
    fn a_request_id_is_the_first_named_header_present_or_a_new_one() {
        let names = [
            HeaderName::from_static("x-request-id"),
            HeaderName::from_static("x-trace-id"),
        ];
        let mut map = HeaderMap::new();
        map.insert("x-trace-id", HeaderValue::from_static("t-1"));
        let id = request_id(&map.into(), &names);
        assert_eq!(
            (id.name.as_str(), id.value.as_bytes(), id.made),
            ("x-trace-id", &b"t-1"[..], false)
        );

        let empty: Headers = HeaderMap::new().into();
        let (a, b) = (request_id(&empty, &names), request_id(&empty, &names));
        assert!(
            a.made && a.name == "x-request-id",
            "made under the first name"
        );
        assert_ne!(a.value, b.value, "each made id is new");
        let text = a.value.to_str().unwrap();
        let (prefix, count) = text.split_once('-').unwrap();
        assert!(
            prefix.len() == 8 && u32::from_str_radix(prefix, 16).is_ok(),
            "{text}"
        );
        let next = b.value.to_str().unwrap().split_once('-').unwrap().1;
        assert_eq!(
            u64::from_str_radix(next, 16).unwrap(),
            u64::from_str_radix(count, 16).unwrap() + 1,
            "{text}: the thread's count, in hex"
        );
        assert!(!count.starts_with('0') || count == "0", "{text}");
    }

    #[test]
    fn only_completion_routes_are_generative() {
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/generate",
            "/v1/chat/completions?x=1",
        ] {
            assert!(is_generative(path), "{path}");
        }
        for path in [
            "/v1/embeddings",
            "/v1/rerank",
            "/score",
            "/tokenize",
            "/v1/models",
            "/v1/chat/completions/x",
        ] {
            assert!(!is_generative(path), "{path}");
        }
    }

    #[test]
    fn wire_names_are_hop_by_hop_exactly_when_their_header_is() {
        let names = [
            "connection",
            "proxy-authenticate",
            "proxy-authorization",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "proxy-connection",
            "keep-alive",
            "content-type",
            "content-length",
            "x-trailer",
            "tea",
            "connections",
            "date",
        ];
        for name in names {
            let hop = is_hop_by_hop(&HeaderName::from_static(name));
            assert_eq!(is_hop_by_hop_name(name.as_bytes()), hop, "{name}");
            let upper = name.to_ascii_uppercase();
            assert_eq!(is_hop_by_hop_name(upper.as_bytes()), hop, "{upper}");
        }
        assert_eq!(
            names
                .iter()
                .filter(|n| is_hop_by_hop_name(n.as_bytes()))
                .count(),
            9
        );
    }

    #[test]
    fn paths_are_normalised_before_matching() {
        for (raw, normal) in [
            ("/v1/chat/completions", Some("/v1/chat/completions")),
            ("//v1//chat/./completions/", Some("/v1/chat/completions")),
            ("/v1/x/../chat/completions", Some("/v1/chat/completions")),
            ("/v1/%63hat/completions", Some("/v1/chat/completions")),
            ("/v1/chat%2Fcompletions", Some("/v1/chat%2Fcompletions")),
            ("/../etc/passwd", None),
            ("/v1/%zz", None),
            ("/v1/%+5", None),
            ("v1/models", None),
            ("/", Some("/")),
        ] {
            assert_eq!(normalize_path(raw).as_deref(), normal, "{raw}");
        }
    }

    proptest::proptest! {
        /// The short way never takes a path the long way would change.
        #[test]
        fn a_clean_path_is_its_own_normal_form(tail in "[/.a%2eF]{0,12}") {
            let path = format!("/{tail}");
            if is_clean(&path) {
                proptest::prop_assert_eq!(resolve(&path), Some(path.clone()));
            }
        }
    }

    #[test]
    fn only_inference_and_model_routes_are_forwarded_by_default() {
        let r = Routes::default();
        assert_eq!(
            r.route(&Method::POST, "/v1//chat/completions"),
            Route::Inference("/v1/chat/completions")
        );
        assert_eq!(
            r.route(&Method::GET, "/v1/models/org/llama"),
            Route::ModelCard {
                path: "/v1/models/org/llama".into(),
                id: "org/llama".into()
            }
        );
        assert_eq!(r.route(&Method::HEAD, "/v1/models"), Route::ModelList);
        // An encoded `/` or `\` matches no route, not even a model card.
        for path in [
            "/v1/models/..%2F..%2Fflush_cache",
            "/v1/models/..%2f..%2fflush_cache",
            "/v1/models/x%5C..%5Cflush_cache",
        ] {
            assert_eq!(r.route(&Method::GET, path), Route::NotFound, "{path}");
        }
        for path in [
            "/_mock/fault",
            "/flush_cache",
            "/start_profile",
            "/v1/chat%2Fcompletions",
        ] {
            assert_eq!(r.route(&Method::POST, path), Route::NotFound, "{path}");
        }
        assert_eq!(
            r.route(&Method::GET, "/v1/chat/completions"),
            Route::MethodNotAllowed("POST")
        );
        assert_eq!(
            r.route(&Method::POST, "/v1/models"),
            Route::MethodNotAllowed("GET, HEAD")
        );
        assert_eq!(
            r.route(&Method::HEAD, "/v1/models/x"),
            Route::MethodNotAllowed("GET")
        );
        for method in [Method::DELETE, Method::CONNECT, Method::TRACE, Method::PUT] {
            assert_eq!(
                r.route(&method, "/v1/chat/completions"),
                Route::MethodNotAllowed("POST")
            );
        }
        let extra = Routes::new(&["/metrics".into(), "/admin/*".into()]);
        assert_eq!(
            extra.route(&Method::GET, "/metrics"),
            Route::Forward("/metrics".into())
        );
        assert_eq!(
            extra.route(&Method::POST, "/admin/x"),
            Route::Forward("/admin/x".into())
        );
        assert_eq!(
            extra.route(&Method::PUT, "/admin/x"),
            Route::MethodNotAllowed("GET, POST")
        );
        assert_eq!(extra.route(&Method::GET, "/administrator"), Route::NotFound);
        assert!(Routes::check("/a/*").is_ok() && Routes::check("a").is_err());
    }

    #[test]
    fn peer_addresses_are_written_as_std_writes_them() {
        for ip in [
            "0.0.0.0",
            "9.10.99.100",
            "127.0.0.1",
            "255.255.255.255",
            "10.200.3.45",
            "::1",
            "2001:db8::8a2e:370:7334",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(ip_value(ip).to_str().unwrap(), ip.to_string());
        }
    }

    #[test]
    fn connection_named_headers_are_stripped_and_forwarded_for_is_the_peers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        h.insert("proxy-connection", HeaderValue::from_static("x-other"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("x-other", HeaderValue::from_static("1"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        h.insert(X_FORWARDED_FOR, HeaderValue::from_static("6.6.6.6"));
        let peer: IpAddr = "127.0.0.9".parse().unwrap();
        // As hyper delivers them (a map), and as the fast path does (the
        // fields as they came, in the client's spelling).
        let mut block = Vec::new();
        for (name, value) in &h {
            let name = name.as_str().to_ascii_uppercase();
            block.extend_from_slice(format!("{name}: ").as_bytes());
            block.extend_from_slice(value.as_bytes());
            block.extend_from_slice(b"\r\n");
        }
        block.extend_from_slice(b"\r\n");
        let deliveries = || {
            [
                Headers::from(h.clone()),
                Headers {
                    map: HeaderMap::new(),
                    raw: RawFields::parsed(&block),
                },
            ]
        };
        for (headers, trusted_headers) in deliveries().into_iter().zip(deliveries()) {
            let raw = headers.raw.len() > 0;
            let forwarded = Forwarded::new(headers, peer, "https", 0);
            let out = forwarded.to_map();
            for gone in ["x-secret", "x-other", "proxy-connection", "connection"] {
                assert!(!out.contains_key(gone), "{gone} (raw: {raw})");
            }
            assert!(out.contains_key("x-kept"));
            assert_eq!(
                out[X_FORWARDED_FOR], "127.0.0.9",
                "a forged chain is replaced"
            );
            assert_eq!(
                out[X_FORWARDED_PROTO], "https",
                "the scheme the client spoke"
            );
            // The fast client's writer sees the same headers.
            let mut written = Vec::new();
            forwarded.each(|name, value| {
                written.push((name.to_ascii_lowercase(), value.to_vec()));
            });
            let mapped: Vec<_> = out
                .iter()
                .map(|(n, v)| (n.as_str().as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect();
            assert_eq!(written, mapped, "raw: {raw}");
            let trusted = Forwarded::new(trusted_headers, peer, "http", 1).to_map();
            assert_eq!(trusted[X_FORWARDED_FOR], "6.6.6.6, 127.0.0.9");
            assert_eq!(trusted[X_FORWARDED_PROTO], "http", "none was sent to keep");
        }
        // The next peer of this thread is not taken for the last one.
        let other: IpAddr = "10.1.2.3".parse().unwrap();
        let out = Forwarded::new(h.into(), other, "http", 0).to_map();
        assert_eq!(out[X_FORWARDED_FOR], "10.1.2.3");
    }
}

//! The fast path over an in-memory pipe: what it answers itself, what it
//! hands to hyper (every byte read, in order), and how a response goes out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::HeaderValue;
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::*;

const TIMEOUT: Duration = Duration::from_secs(5);

fn peer() -> Peer {
    Peer {
        addr: "192.0.2.7:4000".parse().unwrap(),
        tls: false,
    }
}

/// The fast path serving one end of a pipe; the other end, the task, and
/// the shutdown switch.
fn start<H, F>(handler: H) -> (DuplexStream, JoinHandle<End>, watch::Sender<bool>)
where
    H: Fn(Request<Inbound>, Peer) -> F + Send + Sync + 'static,
    F: Future<Output = Response<ResponseBody>> + Send,
{
    start_with(handler, false)
}

/// [`start`], with requests carrying their fields as they came when
/// `raw_fields`.
fn start_with<H, F>(
    handler: H,
    raw_fields: bool,
) -> (DuplexStream, JoinHandle<End>, watch::Sender<bool>)
where
    H: Fn(Request<Inbound>, Peer) -> F + Send + Sync + 'static,
    F: Future<Output = Response<ResponseBody>> + Send,
{
    let (client, mut server) = tokio::io::duplex(1 << 20);
    let (stop, stopping) = watch::channel(false);
    let task = tokio::spawn(async move {
        let activity = Arc::new(Activity::new());
        Fast::new(&mut server, raw_fields)
            .serve(&handler, peer(), &activity, &stopping)
            .await
    });
    (client, task, stop)
}

fn text(body: impl Into<Bytes>) -> ResponseBody {
    ResponseBody::new(Full::new(body.into()))
}

/// Answers with the method, target, `x-test` header and body it was sent.
async fn echo(req: Request<Inbound>, peer: Peer) -> Response<ResponseBody> {
    assert_eq!(peer, self::peer());
    assert_eq!(req.version(), Version::HTTP_11);
    let (parts, body) = req.into_parts();
    assert!(
        matches!(body, Inbound::Whole(..)),
        "a plain request's body is whole"
    );
    let body = body.collect().await.unwrap().to_bytes();
    let test = parts
        .headers
        .get("x-test")
        .map_or("-", |v| v.to_str().unwrap());
    let said = format!(
        "{} {} {test} {}",
        parts.method,
        parts.uri,
        String::from_utf8_lossy(&body)
    );
    Response::new(text(said))
}

async fn read_to_end(client: &mut DuplexStream) -> String {
    let mut got = Vec::new();
    tokio::time::timeout(TIMEOUT, client.read_to_end(&mut got))
        .await
        .expect("the server closes")
        .unwrap();
    String::from_utf8(got).unwrap()
}

/// Reads until `until` has arrived; everything read.
async fn read_until(client: &mut DuplexStream, until: &str) -> String {
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains(until) {
        let mut chunk = [0; 4096];
        let n = tokio::time::timeout(TIMEOUT, client.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("{until:?} never came: {:?}", String::from_utf8_lossy(&got)))
            .unwrap();
        assert!(
            n > 0,
            "closed before {until:?}: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8(got).unwrap()
}

#[tokio::test]
async fn with_raw_fields_a_plain_request_carries_its_headers_as_they_came() {
    let handler = |req: Request<Inbound>, _: Peer| async move {
        let (parts, mut body) = req.into_parts();
        assert!(parts.headers.is_empty(), "no map is built");
        let said: Vec<String> = body
            .take_fields()
            .iter()
            .map(|(n, v)| {
                let (n, v) = (String::from_utf8_lossy(n), String::from_utf8_lossy(v));
                format!("{n}={v}")
            })
            .collect();
        let body = body.collect().await.unwrap().to_bytes();
        Response::new(text(format!(
            "{} {}",
            said.join(","),
            String::from_utf8_lossy(&body)
        )))
    };
    let (mut client, task, _stop) = start_with(handler, true);
    client
        .write_all(b"POST /x HTTP/1.1\r\nHost: h\r\nX-Test:  a b \r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
        .await
        .unwrap();
    let got = read_to_end(&mut client).await;
    assert!(
        got.ends_with("\r\n\r\nHost=h,X-Test=a b,Content-Length=2,Connection=close hi"),
        "{got}"
    );
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn pipelined_plain_requests_are_answered_in_order_and_close_is_honoured() {
    let (mut client, task, _stop) = start(echo);
    client
        .write_all(
            b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nx-test: one\r\n\r\n\
              POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n\
              X-Test: two\r\nConnection: close\r\n\r\nhello",
        )
        .await
        .unwrap();
    let got = read_to_end(&mut client).await;
    let first = got.find("GET /v1/models one ").expect(&got);
    let second = got
        .find("POST /v1/chat/completions?x=1 two hello")
        .expect(&got);
    assert!(first < second, "{got}");
    assert_eq!(got.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{got}");
    assert!(got.contains("content-length: 19\r\n"), "{got}");
    assert_eq!(got.matches("date: ").count(), 2, "{got}");
    assert_eq!(got.matches("connection: close\r\n").count(), 1, "{got}");
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn requests_that_are_not_plain_go_to_hyper_with_every_byte_read() {
    let many_headers: String = (0..MAX_HEADERS + 1)
        .map(|i| format!("x-h{i}: v\r\n"))
        .collect();
    let many = format!("GET / HTTP/1.1\r\n{many_headers}\r\n");
    let cases: [(&str, &[u8]); 14] = [
        (
            "chunked upload",
            b"POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        ),
        (
            "both framings",
            b"POST / HTTP/1.1\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
        (
            "two lengths",
            b"POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\nhello",
        ),
        ("signed length", b"POST / HTTP/1.1\r\ncontent-length: +5\r\n\r\nhello"),
        ("listed length", b"POST / HTTP/1.1\r\ncontent-length: 5, 5\r\n\r\nhello"),
        (
            "100-continue",
            b"POST / HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n",
        ),
        (
            "upgrade",
            b"GET /ws HTTP/1.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
        ),
        ("HTTP/1.0", b"GET / HTTP/1.0\r\n\r\n"),
        ("HEAD", b"HEAD / HTTP/1.1\r\n\r\n"),
        ("absolute form", b"GET http://gw/ HTTP/1.1\r\n\r\n"),
        ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("body still to come", b"POST / HTTP/1.1\r\ncontent-length: 10\r\n\r\nhello"),
        ("malformed", b"GET / HTTP/1.1\r\nbad header\r\n\r\n"),
        ("too many headers", many.as_bytes()),
    ];
    for (what, wire) in cases {
        // A plain request first: the hand-over starts after its answer.
        let (mut client, task, _stop) = start(echo);
        client
            .write_all(b"GET /first HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        client.write_all(wire).await.unwrap();
        read_until(&mut client, "GET /first - ").await;
        match tokio::time::timeout(TIMEOUT, task).await.unwrap().unwrap() {
            End::HandOver { read, http1_only } => {
                assert_eq!(read, wire, "{what}");
                assert!(
                    http1_only,
                    "{what}: HTTP/2 offered after an HTTP/1.1 answer"
                );
            }
            End::Closed => panic!("{what}: closed instead of handed over"),
        }
    }
}

#[tokio::test]
async fn a_head_past_the_fast_bound_is_handed_over_as_read() {
    let (mut client, task, _stop) = start(echo);
    let wire = format!("GET / HTTP/1.1\r\nx-big: {}\r\n\r\n", "a".repeat(MAX_HEAD));
    client.write_all(wire.as_bytes()).await.unwrap();
    match tokio::time::timeout(TIMEOUT, task).await.unwrap().unwrap() {
        End::HandOver { read, http1_only } => {
            assert!(!http1_only, "nothing was answered yet: hyper may sniff");
            assert!(read.len() >= MAX_HEAD);
            assert!(wire.as_bytes().starts_with(&read));
        }
        End::Closed => panic!("closed instead of handed over"),
    }
}

/// A body whose frames come from a channel; `Err` frames break it.
struct Frames(mpsc::Receiver<Result<Bytes, BoxError>>);

impl Body for Frames {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0
            .poll_recv(cx)
            .map(|frame| frame.map(|r| r.map(Frame::data)))
    }
}

/// Feeds a [`Frames`] body.
type Feed = mpsc::Sender<Result<Bytes, BoxError>>;

/// A handler answering with the body fed by the returned sender.
fn streaming() -> (
    impl Fn(Request<Inbound>, Peer) -> std::future::Ready<Response<ResponseBody>>,
    Feed,
) {
    let (tx, rx) = mpsc::channel(4);
    let rx = std::sync::Mutex::new(Some(rx));
    let handler = move |_: Request<Inbound>, _: Peer| {
        let rx = rx.lock().unwrap().take().expect("one request");
        std::future::ready(Response::new(ResponseBody::new(Frames(rx))))
    };
    (handler, tx)
}

#[tokio::test]
async fn a_stream_goes_out_chunked_frame_by_frame() {
    let (handler, frames) = streaming();
    let (mut client, task, _stop) = start(handler);
    client
        .write_all(b"GET /stream HTTP/1.1\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    frames.send(Ok(Bytes::from("data: 1\n\n"))).await.unwrap();
    // The first frame arrives before the second exists.
    let head = read_until(&mut client, "data: 1\n\n\r\n").await;
    assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
    assert!(head.ends_with("\r\n\r\n9\r\ndata: 1\n\n\r\n"), "{head}");
    frames
        .send(Ok(Bytes::from("data: [DONE]\n\n")))
        .await
        .unwrap();
    drop(frames);
    let rest = read_to_end(&mut client).await;
    assert_eq!(rest, "e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn a_body_that_breaks_ends_the_connection_without_its_last_chunk() {
    let (handler, frames) = streaming();
    let (mut client, task, _stop) = start(handler);
    client
        .write_all(b"GET /stream HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    frames.send(Ok(Bytes::from("partial"))).await.unwrap();
    frames
        .send(Err("the worker broke off".into()))
        .await
        .unwrap();
    let got = read_to_end(&mut client).await;
    assert!(got.ends_with("7\r\npartial\r\n"), "{got}");
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn a_body_longer_than_its_length_is_cut_there_and_the_connection_closed() {
    let (mut client, task, _stop) = start(|_, _| async {
        let mut response = Response::new(text("hello"));
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
        response
    });
    client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let got = read_to_end(&mut client).await;
    assert!(got.contains("content-length: 3\r\n"), "{got}");
    assert!(got.ends_with("\r\n\r\nhel"), "{got}");
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn no_content_carries_no_framing_and_the_connection_stays_open() {
    let (mut client, task, stop) = start(|_, _| async {
        let mut response = Response::new(text(""));
        *response.status_mut() = StatusCode::NO_CONTENT;
        // Not for a 204 (RFC 9110 8.6): dropped.
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        response
    });
    client
        .write_all(b"DELETE /x HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let got = read_until(&mut client, "\r\n\r\n").await;
    assert!(got.starts_with("HTTP/1.1 204 No Content\r\n"), "{got}");
    assert!(!got.contains("content-length"), "{got}");
    assert!(!got.contains("transfer-encoding"), "{got}");
    // Open for the next request until the gateway shuts down.
    assert!(!task.is_finished());
    stop.send(true).unwrap();
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn a_final_informational_answer_ends_the_connection_after_its_head() {
    // What would follow the 101 never ends (its feed stays open): none of
    // it may be awaited. The handler takes one request only.
    let (handler, _feed) = streaming();
    let (mut client, task, _stop) = start(move |req, peer| {
        let mut response = handler(req, peer).into_inner();
        *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        std::future::ready(response)
    });
    client
        .write_all(b"GET /x HTTP/1.1\r\n\r\nGET /y HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let got = read_to_end(&mut client).await;
    assert!(
        got.starts_with("HTTP/1.1 101 Switching Protocols\r\n"),
        "{got}"
    );
    assert!(got.ends_with("connection: close\r\n\r\n"), "{got}");
    assert_eq!(got.matches("HTTP/1.1").count(), 1, "{got}");
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn a_client_that_pipelines_and_half_closes_gets_its_first_answer() {
    let (mut client, task, _stop) = start(|req, peer| async move {
        // Not ready at the first poll, so the close is seen while answering.
        tokio::task::yield_now().await;
        echo(req, peer).await
    });
    client
        .write_all(b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    client.shutdown().await.unwrap();
    let got = read_to_end(&mut client).await;
    assert!(got.contains("GET /a - "), "{got}");
    // The last one is cancelled by the close, as hyper does (no half-close).
    assert_eq!(got.matches("HTTP/1.1 200 OK").count(), 1, "{got}");
    assert!(matches!(task.await.unwrap(), End::Closed));
}

#[tokio::test]
async fn a_kept_alive_connection_gives_back_what_a_large_exchange_grew() {
    let (_client, mut server) = tokio::io::duplex(64);
    let mut fast = Fast::new(&mut server, false);
    fast.out.reserve(WRITE_BATCH);
    fast.buf.reserve(MAX_REQUEST);
    fast.trim();
    assert_eq!(fast.out.capacity(), 0);
    assert_eq!(fast.buf.capacity(), 0, "the next read starts on the stack");
    // A small buffer, or one still holding a pipelined request, stays.
    fast.out.reserve(1024);
    fast.buf.reserve(MAX_REQUEST);
    fast.buf.put_slice(b"GET / HTTP/1.1\r\n");
    fast.trim();
    assert!(fast.out.capacity() >= 1024);
    assert!(fast.buf.capacity() >= MAX_REQUEST);
}

#[tokio::test]
async fn a_client_that_leaves_cancels_its_request() {
    let cancelled = Arc::new(AtomicBool::new(false));
    let seen = cancelled.clone();
    let (mut client, task, _stop) = start(move |_, _| {
        let guard = Flag(seen.clone());
        async move {
            let _guard = guard;
            std::future::pending::<Response<ResponseBody>>().await
        }
    });
    client
        .write_all(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .unwrap();
    tokio::task::yield_now().await;
    drop(client);
    let end = tokio::time::timeout(TIMEOUT, task).await.unwrap().unwrap();
    assert!(matches!(end, End::Closed));
    assert!(cancelled.load(Ordering::SeqCst), "the handler was dropped");
}

/// Sets its flag when dropped.
struct Flag(Arc<AtomicBool>);

impl Drop for Flag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(start_paused = true)]
async fn a_head_that_stalls_is_cut_at_the_header_read_timeout() {
    // As the server runs it: the fast path beside the connection's watchdog,
    // which owns the header-read timeout.
    let (mut client, mut server) = tokio::io::duplex(1 << 20);
    let (_stop, stopping) = watch::channel(false);
    let task = tokio::spawn(async move {
        let activity = Arc::new(Activity::new());
        activity.await_heads(true);
        let serving = Fast::new(&mut server, false).serve(&echo, peer(), &activity, &stopping);
        tokio::select! {
            _ = serving => "closed by the fast path",
            why = super::super::watchdog(&activity, TIMEOUT * 10, TIMEOUT * 10, TIMEOUT) => why,
        }
    });
    client
        .write_all(b"GET / HTTP/1.1\r\nconnection: keep-alive\r\n\r\nGET /next HT")
        .await
        .unwrap();
    read_until(&mut client, "GET / - ").await;
    let started = Instant::now();
    assert_eq!(task.await.unwrap(), "header-read timeout");
    let took = started.elapsed();
    assert!(
        took >= TIMEOUT - Duration::from_millis(20) && took < TIMEOUT * 2,
        "{took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_closes_a_connection_waiting_for_its_next_request() {
    let (mut client, task, stop) = start(echo);
    client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    read_until(&mut client, "GET / - ").await;
    stop.send(true).unwrap();
    let started = Instant::now();
    assert!(matches!(task.await.unwrap(), End::Closed));
    assert!(
        started.elapsed() < TIMEOUT,
        "closed at once, not at a timeout"
    );
}

proptest::proptest! {
    /// Heads made of HTTP's own pieces: the fast path takes one only when
    /// it is a plain request, and takes its body by its one length.
    #[test]
    fn the_fast_path_takes_only_plain_requests(
        pieces in proptest::collection::vec(proptest::sample::select(vec![
            "GET ", "POST ", "HEAD ", "/v1/x", "http://h/", " HTTP/1.1", " HTTP/1.0",
            "\r\n", "\n", "host: h", "content-length: 3", "Content-Length: 03",
            "content-length: +3", "transfer-encoding: chunked", "expect: 100-continue",
            "connection: close", "x: \x01", "x: y", ": v", "abc", "\r\n\r\n",
        ]), 0..16)
    ) {
        let wire = pieces.concat();
        if let Some((_, head, body, _)) = read_request(wire.as_bytes()) {
            // httparse skips empty lines before a request line, as hyper does.
            let head = wire[..head].trim_ascii_start().to_ascii_lowercase();
            proptest::prop_assert!(!head.contains("transfer-encoding"));
            proptest::prop_assert!(!head.contains("expect"));
            proptest::prop_assert!(head.starts_with("get /") || head.starts_with("post /"));
            proptest::prop_assert!(body == 0 || body == 3, "{body}");
        }
    }
}

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use http::{HeaderMap, HeaderValue, Method, header};
use http_body_util::BodyExt;
use hyper::body::Body as _;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::body::Framing;
use super::*;
use crate::proxy::Forwarded;
use crate::tls::{WorkerTls, WorkerTlsConfig};

const SECOND: Duration = Duration::from_secs(1);

fn pool() -> H1Pool {
    let tls = WorkerTls::load(&WorkerTlsConfig::default(), Default::default()).unwrap();
    H1Pool::new(SECOND, SECOND * 90, std::sync::Arc::new(tls))
}

/// The client's headers as forwarded for a client at 192.0.2.1.
fn forwarded(headers: HeaderMap) -> Forwarded {
    Forwarded::new(headers.into(), "192.0.2.1".parse().unwrap(), "http", 0)
}

fn request<'a>(headers: &'a Forwarded, body: &'static str) -> H1Request<'a> {
    H1Request {
        method: &Method::POST,
        path: "/v1/chat/completions?x=1",
        authority: "10.0.0.1:8000",
        tls: false,
        headers,
        authorization: Some("Basic dTpw"),
        body: Bytes::from_static(body.as_bytes()),
    }
}

#[test]
fn the_request_head_carries_host_length_and_the_forwarded_headers() {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("host", HeaderValue::from_static("gateway"));
    headers.insert("content-length", HeaderValue::from_static("99"));
    headers.insert("x-forwarded-for", HeaderValue::from_static("6.6.6.6"));
    let mut out = BytesMut::new();
    request(&forwarded(headers.clone()), "{}").encode(&mut out);
    assert_eq!(
        &out[..],
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: 10.0.0.1:8000\r\n\
          content-type: application/json\r\nx-forwarded-for: 192.0.2.1\r\n\
          x-forwarded-proto: http\r\nauthorization: Basic dTpw\r\n\
          content-length: 2\r\n\r\n"
    );
    // The client's own Authorization wins.
    headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
    let mut out = BytesMut::new();
    request(&forwarded(headers), "{}").encode(&mut out);
    let text = String::from_utf8_lossy(&out);
    assert!(
        text.contains("authorization: Bearer k\r\n") && !text.contains("Basic"),
        "{text}"
    );
}

#[test]
fn the_head_buffer_comes_back_empty_and_a_large_one_is_not_kept() {
    let mut head = Scratch::take();
    head.0.extend_from_slice(b"POST / HTTP/1.1\r\n");
    let capacity = head.0.capacity();
    drop(head);
    let again = Scratch::take();
    assert!(again.0.is_empty());
    assert_eq!(again.0.capacity(), capacity, "the buffer was not reused");
    // Taken while held: a fresh one.
    assert_eq!(Scratch::take().0.capacity(), 0);
    drop(again);
    let mut large = Scratch::take();
    large.0.reserve(SCRATCH_KEPT * 2);
    drop(large);
    assert_eq!(Scratch::take().0.capacity(), 0, "a grown buffer was kept");
}

#[test]
fn response_heads_are_parsed_with_their_framing() {
    let cases: [(&[u8], Option<Framing>); 11] = [
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
            Some(Framing::sized(5, false)),
        ),
        // Both framings: the coding frames it, and the connection is not
        // trusted again (RFC 9112 6.3, as Pingora and hyper hold it).
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n",
            Some(Framing::chunked(true)),
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            Some(Framing::chunked(false)),
        ),
        // A coding other than chunked last: read to the close, whatever
        // the length says.
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ncontent-length: 5\r\n\r\n",
            Some(Framing::until_close()),
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, identity\r\ncontent-length: 5\r\n\r\n",
            Some(Framing::until_close()),
        ),
        (
            b"HTTP/1.1 200 OK\r\nconnection: x-foo, close\r\ncontent-length: 1\r\n\r\n",
            Some(Framing::sized(1, true)),
        ),
        (
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1\r\n\r\n",
            Some(Framing::sized(1, false)),
        ),
        (
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1\r\n\r\n",
            Some(Framing::sized(1, true)),
        ),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
            Some(Framing::empty(false)),
        ),
        (b"HTTP/1.0 200 OK\r\n\r\n", Some(Framing::until_close())),
        (b"HTTP/1.1 200 OK\r\ncontent-le", None),
    ];
    for (head, expected) in cases {
        let mut buf = BytesMut::from(head);
        let parsed = parse_head(&mut buf, &Method::POST).unwrap();
        assert_eq!(
            parsed.map(|head| head.framing),
            expected,
            "{}",
            String::from_utf8_lossy(head)
        );
    }
    // The fields kept are the end-to-end ones, as they came; the framing
    // ones (and the worker's date) were read for this hop and left out, as
    // is a Content-Length beside chunked coding. The map stays empty.
    let mut buf = BytesMut::from(
        &b"HTTP/1.1 200 OK\r\nDate: x\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\
           Transfer-Encoding: chunked\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\
           X-Worker:  7 \r\n\r\n"[..],
    );
    let head = parse_head(&mut buf, &Method::POST).unwrap().unwrap();
    let fields: Vec<(&[u8], &[u8])> = head.fields.iter().collect();
    assert_eq!(
        fields,
        [
            (&b"Content-Type"[..], &b"text/plain"[..]),
            (b"X-Worker", b"7"),
        ]
    );
    assert_eq!(head.fields.get("x-worker"), Some(&b"7"[..]));
    assert_eq!(head.fields.get("content-length"), None);
    assert!(head.parts.headers.is_empty());
    for bad in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
        // HTTP/1.0 has no transfer coding: hyper's client refuses it too.
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
    ] {
        let mut buf = BytesMut::from(bad);
        assert!(parse_head(&mut buf, &Method::POST).is_err(), "{bad:?}");
    }
}

/// A one-connection server answering each request with the next of
/// `answers` (written in pieces of `piece` bytes), then closing.
async fn server(answers: Vec<Vec<u8>>, piece: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        for answer in answers {
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                if n == 0 {
                    return;
                }
                seen.extend_from_slice(&buf[..n]);
            }
            for part in answer.chunks(piece.max(1)) {
                socket.write_all(part).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    });
    addr
}

async fn body_of(response: Response<H1Body>) -> Bytes {
    tokio::time::timeout(SECOND * 5, response.into_body().collect())
        .await
        .expect("bounded")
        .expect("a whole body")
        .to_bytes()
}

#[tokio::test]
async fn sized_and_chunked_bodies_arrive_whole_and_the_connection_is_reused() {
    let answers = vec![
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello".to_vec(),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n".to_vec(),
        b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n".to_vec(),
    ];
    let addr = server(answers, 3).await;
    let pool = pool();
    let headers = forwarded(HeaderMap::new());
    let first = pool.send(addr, &request(&headers, "{}")).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(body_of(first).await, "hello");
    assert_eq!(pool.idle_count(), 1, "back in the pool");
    let second = pool.send(addr, &request(&headers, "{}")).await.unwrap();
    assert_eq!(body_of(second).await, "hello, world");
    let third = pool.send(addr, &request(&headers, "{}")).await.unwrap();
    assert_eq!(third.status(), 503);
    assert!(third.body().is_end_stream());
    assert_eq!(pool.idle_count(), 1, "one connection carried all three");
}

#[tokio::test]
async fn a_pooled_connection_the_worker_closed_is_replaced_unseen() {
    // The first connection answers once and closes; the second answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        for _ in 0..2 {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = socket.read(&mut buf).await;
            socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            // Keep-alive promised, then the worker's idle timeout: closed.
            drop(socket);
        }
    });
    let pool = pool();
    let headers = forwarded(HeaderMap::new());
    let first = pool.send(addr, &request(&headers, "{}")).await.unwrap();
    assert_eq!(body_of(first).await, "ok");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = pool.send(addr, &request(&headers, "{}")).await.unwrap();
    assert_eq!(body_of(second).await, "ok");
}

/// A worker that, on each connection, runs `script` for each request it
/// reads: the bytes to answer, and the stray bytes to write a moment
/// later (unasked). Counts connections and requests.
async fn scripted_worker(
    script: fn(usize) -> (Vec<u8>, Vec<u8>),
) -> (
    SocketAddr,
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (conns, requests) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, r) = (conns.clone(), requests.clone());
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            c.fetch_add(1, Ordering::SeqCst);
            let r = r.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    // A request: a head and its `content-length: 2` body.
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n")
                        || seen.len() < seen.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 6
                    {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let end = seen.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 6;
                    seen.drain(..end);
                    let n = r.fetch_add(1, Ordering::SeqCst);
                    let (answer, stray) = script(n);
                    if answer.is_empty() {
                        // Read in full, then closed without an answer.
                        return;
                    }
                    socket.write_all(&answer).await.unwrap();
                    if !stray.is_empty() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        let _ = socket.write_all(&stray).await;
                    }
                }
            });
        }
    });
    (addr, conns, requests)
}

#[tokio::test]
async fn unasked_bytes_from_a_worker_never_reach_the_next_request() {
    use std::sync::atomic::Ordering;
    // A second, unsolicited response on a kept-alive connection; a late
    // body after a 204.
    for stray in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecret"[..],
        b"late body",
    ] {
        let (addr, conns, requests) = scripted_worker(if stray.starts_with(b"HTTP") {
            |n| {
                let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nr{n:02}");
                let stray = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecret".to_vec();
                (answer.into_bytes(), if n == 0 { stray } else { Vec::new() })
            }
        } else {
            |n| {
                if n == 0 {
                    (
                        b"HTTP/1.1 204 No Content\r\n\r\n".to_vec(),
                        b"late body".to_vec(),
                    )
                } else {
                    (
                        format!("HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nr{n:02}").into_bytes(),
                        Vec::new(),
                    )
                }
            }
        })
        .await;
        let pool = pool();
        let headers = forwarded(HeaderMap::new());
        let first = pool.send(addr, &request(&headers, "{}")).await.unwrap();
        let _ = body_of(first).await;
        // The stray bytes arrive while the connection idles in the pool,
        // a moment before the next request (well within any idle check's
        // grace a pool might give itself).
        tokio::time::sleep(Duration::from_millis(60)).await;
        let second = pool.send(addr, &request(&headers, "{}")).await.unwrap();
        assert_eq!(second.status(), 200);
        assert_eq!(
            body_of(second).await,
            "r01",
            "{}",
            String::from_utf8_lossy(stray)
        );
        assert_eq!(
            conns.load(Ordering::SeqCst),
            2,
            "the tainted connection was reused"
        );
        assert_eq!(requests.load(Ordering::SeqCst), 2);
    }
}

#[tokio::test]
async fn a_request_the_worker_read_is_never_sent_again() {
    use std::sync::atomic::Ordering;
    // The second request on the connection is read in full, and the worker
    // closes without answering: the error is the retry loop's to judge.
    let (addr, conns, requests) = scripted_worker(|n| {
        if n == 1 {
            (Vec::new(), Vec::new())
        } else {
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
                Vec::new(),
            )
        }
    })
    .await;
    let pool = pool();
    let headers = forwarded(HeaderMap::new());
    let first = pool.send(addr, &request(&headers, "{}")).await.unwrap();
    assert_eq!(body_of(first).await, "ok");
    let second = pool.send(addr, &request(&headers, "{}")).await;
    assert!(
        matches!(second, Err(H1Error::Closed)),
        "{:?}",
        second.map(|r| r.status())
    );
    assert_eq!(
        requests.load(Ordering::SeqCst),
        2,
        "the request went to the worker twice"
    );
    assert_eq!(conns.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_cut_short_is_an_error_and_its_connection_is_not_reused() {
    let addr = server(
        vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf".to_vec()],
        64,
    )
    .await;
    let pool = pool();
    let headers = forwarded(HeaderMap::new());
    let response = pool.send(addr, &request(&headers, "{}")).await.unwrap();
    let collected = tokio::time::timeout(SECOND * 5, response.into_body().collect())
        .await
        .expect("bounded");
    assert!(collected.is_err(), "a short body passed as whole");
    assert_eq!(pool.idle_count(), 0);
}

#[tokio::test]
async fn a_refused_connection_is_a_connect_error() {
    let addr = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let pool = pool();
    let headers = forwarded(HeaderMap::new());
    let Err(error) = pool.send(addr, &request(&headers, "{}")).await else {
        panic!("connected to a closed port");
    };
    assert!(matches!(error, H1Error::Connect { .. }), "{error}");
}

fn chunked(pieces: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in pieces {
        out.extend_from_slice(format!("{:x}\r\n", p.len()).as_bytes());
        out.extend_from_slice(p);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

proptest! {
    /// However a chunked body is split across reads, the data is exactly
    /// the chunks', and the end is found.
    #[test]
    fn chunked_decoding_does_not_depend_on_read_boundaries(
        pieces in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 0..8),
        cuts in proptest::collection::vec(1usize..17, 1..64),
    ) {
        let wire = chunked(&pieces);
        let mut kind = Framing::chunked(false);
        let mut buf = BytesMut::new();
        let mut data = Vec::new();
        let mut fed = 0;
        let mut cut = cuts.iter().cycle();
        let mut ended = false;
        while !ended {
            match body::decode(&mut kind, &mut buf, true).unwrap() {
                body::Step::Data(d) => data.extend_from_slice(&d),
                body::Step::End => ended = true,
                body::Step::More => {
                    prop_assert!(fed < wire.len(), "more wanted past the end");
                    let n = (*cut.next().unwrap()).min(wire.len() - fed);
                    buf.extend_from_slice(&wire[fed..fed + n]);
                    fed += n;
                }
            }
        }
        prop_assert_eq!(data, pieces.concat());
        prop_assert_eq!(fed, wire.len());
        prop_assert!(buf.is_empty());
    }
}

#[test]
fn an_answer_is_read_as_the_fuzz_target_reads_it() {
    let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
    assert_eq!(
        read_answer(answer),
        Some(Answered {
            status: StatusCode::OK,
            body: b"abc".to_vec(),
            reusable: true
        })
    );
    let stray = b"HTTP/1.1 204 No Content\r\n\r\nlate";
    assert_eq!(read_answer(stray).map(|a| a.reusable), Some(false));
    let closing = b"HTTP/1.1 200 OK\r\n\r\nall of it";
    assert_eq!(
        read_answer(closing).map(|a| (a.body, a.reusable)),
        Some((b"all of it".to_vec(), false))
    );
    assert_eq!(
        read_answer(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n"),
        None
    );
}

#[test]
fn headers_the_workers_connection_names_are_not_relayed() {
    let mut buf = BytesMut::from(
        &b"HTTP/1.1 200 OK\r\nConnection: X-Secret, keep-alive\r\nX-Secret: hop\r\n\
           x-secret: hop2\r\nX-Kept: 1\r\ncontent-length: 0\r\n\r\n"[..],
    );
    let head = parse_head(&mut buf, &Method::POST).unwrap().unwrap();
    let names: Vec<&[u8]> = head.fields.iter().map(|(n, _)| n).collect();
    assert_eq!(names, [&b"X-Kept"[..], b"content-length"]);
}

#[test]
fn chunk_sizes_are_read_as_hyper_reads_them() {
    for (line, ok) in [
        (&b"5\r\nhello\r\n"[..], true),
        (b"5 \r\nhello\r\n", true),
        (b"5\t;ext=1\r\nhello\r\n", true),
        (b"00000000000000005\r\nhello\r\n", true),
        (b"+5\r\nhello\r\n", false),
        (b" 5\r\nhello\r\n", false),
        (b"0x5\r\nhello\r\n", false),
        (b"5 5\r\nhello\r\n", false),
        (b"\r\nhello\r\n", false),
        (b"5;a\rb\r\nhello\r\n", false),
        (b"10000000000000000\r\n", false),
    ] {
        let mut framing = Framing::chunked(false);
        let mut buf = BytesMut::from(line);
        let step = body::decode(&mut framing, &mut buf, true);
        match step {
            Ok(body::Step::Data(data)) => {
                assert!(ok, "{} accepted", String::from_utf8_lossy(line));
                assert_eq!(&data[..], b"hello");
            }
            Ok(_) => panic!("{}: no data", String::from_utf8_lossy(line)),
            Err(_) => assert!(!ok, "{} refused", String::from_utf8_lossy(line)),
        }
    }
}

#[test]
fn the_workers_date_is_left_for_the_gateways_own() {
    let mut buf = BytesMut::from(
        &b"HTTP/1.1 200 OK\r\nDate: Tue, 01 Dec 2026 06:00:00 GMT\r\n\
           content-type: text/plain\r\ncontent-length: 0\r\n\r\n"[..],
    );
    let head = parse_head(&mut buf, &Method::POST).unwrap().unwrap();
    assert!(!head.fields.contains("date"));
    assert_eq!(head.fields.get("content-type"), Some(&b"text/plain"[..]));
    assert_eq!(head.fields.len(), 2);
}

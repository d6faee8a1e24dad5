//! Spreading one listener's connections evenly over the serving threads.
//!
//! Owns the count of live connections per serving thread and the hand-over
//! of an accepted socket to the thread holding the fewest. Each serving
//! thread accepts on its own `SO_REUSEPORT` socket, and the kernel picks the
//! socket by a hash of the connection's addresses: a client's few long-lived
//! keep-alive connections can land 24 against 9 on two threads. The busier
//! thread then has more requests waiting for the same share of CPU, which is
//! the latency tail. So, like Envoy's exact connection balance, a thread
//! that accepts while it holds more connections than the least-loaded thread
//! passes the socket (with its connection permit) to that thread; only
//! connection set-up pays the hop between threads, never a request. What is
//! served on a connection is the server loop's business, not this module's.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::Accepted;

/// An accepted connection on its way to another serving thread, already
/// counted there. The permit of the connection cap goes with it, so the
/// hand-over queues hold at most `--max-connections` sockets: the channels
/// need no bound of their own.
#[derive(Debug)]
struct Handed {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
    seat: Seat,
}

/// What the serving threads of one listener share.
#[derive(Debug)]
struct Shared {
    /// Live connections per thread, handed-over ones counted from the
    /// moment they are sent.
    live: Box<[AtomicUsize]>,
    inboxes: Box<[UnboundedSender<Handed>]>,
}

/// One serving thread's part in the spread.
#[derive(Debug)]
pub struct Member {
    index: usize,
    shared: Arc<Shared>,
    inbox: UnboundedReceiver<Handed>,
}

/// A connection's place in its thread's count, taken when the connection is
/// placed and given back when dropped (when the connection's task ends,
/// however it ends).
#[derive(Debug)]
pub(super) struct Seat {
    index: usize,
    shared: Arc<Shared>,
}

impl Seat {
    fn take(shared: &Arc<Shared>, index: usize) -> Self {
        shared.live[index].fetch_add(1, Ordering::Relaxed);
        Self {
            index,
            shared: shared.clone(),
        }
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.shared.live[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

/// The members of a spread over `threads` serving threads, one per thread.
pub fn members(threads: usize) -> Vec<Member> {
    let (inboxes, receivers): (Vec<_>, Vec<_>) = (0..threads).map(|_| unbounded_channel()).unzip();
    let shared = Arc::new(Shared {
        live: (0..threads).map(|_| AtomicUsize::new(0)).collect(),
        inboxes: inboxes.into_boxed_slice(),
    });
    receivers
        .into_iter()
        .enumerate()
        .map(|(index, inbox)| Member {
            index,
            shared: shared.clone(),
            inbox,
        })
        .collect()
}

/// The thread that should serve a connection accepted by thread `me`, given
/// each thread's live connections: `me` itself unless another holds fewer.
/// Keeping it on a tie avoids a hop that would leave the counts as uneven.
fn pick(live: impl IntoIterator<Item = usize>, me: usize) -> usize {
    let mut best = (usize::MAX, me);
    for (i, n) in live.into_iter().enumerate() {
        if n < best.0 || (n == best.0 && i == me) {
            best = (n, i);
        }
    }
    best.1
}

impl Member {
    /// Places a connection this thread accepted: here (returned, with its
    /// seat), or with the thread holding the fewest (`None`).
    pub(super) fn place(&self, here: Accepted) -> io::Result<Option<Accepted>> {
        let shared = &self.shared;
        let live = shared.live.iter().map(|n| n.load(Ordering::Relaxed));
        let to = pick(live, self.index);
        if to == self.index {
            return Ok(Some(Accepted {
                seat: Some(Seat::take(shared, to)),
                ..here
            }));
        }
        let away = Handed {
            stream: here.stream.into_std()?,
            peer: here.peer,
            permit: here.permit,
            seat: Seat::take(shared, to),
        };
        match shared.inboxes[to].send(away) {
            Ok(()) => Ok(None),
            // That thread has stopped serving (shutdown): this one serves
            // the connection for the little time left.
            Err(back) => {
                let back = Handed {
                    seat: Seat::take(shared, self.index),
                    ..back.0
                };
                arrived(back).map(Some)
            }
        }
    }

    /// The next connection another thread handed to this one.
    pub(super) async fn handed(&mut self) -> io::Result<Accepted> {
        // Every member holds every sender, its own too: the channel never
        // closes while this member is receiving.
        let Some(handed) = self.inbox.recv().await else {
            return std::future::pending().await;
        };
        arrived(handed)
    }
}

/// A handed connection, registered with this thread's runtime.
fn arrived(handed: Handed) -> io::Result<Accepted> {
    Ok(Accepted {
        stream: TcpStream::from_std(handed.stream)?,
        peer: handed.peer,
        permit: handed.permit,
        seat: Some(handed.seat),
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Duration;

    use bytes::Bytes;
    use http::Response;
    use http_body_util::Full;
    use tokio::sync::watch;

    use super::*;
    use crate::bodies::ResponseBody;
    use crate::server::{ConnectionLimits, Listener, serve};

    /// One serving thread of a spread, answering every request with its
    /// index.
    fn serving(
        index: usize,
        socket: std::net::TcpListener,
        member: Member,
        stop: watch::Receiver<bool>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async move {
                socket.set_nonblocking(true).expect("non-blocking");
                let socket = tokio::net::TcpListener::from_std(socket).expect("a listener");
                let answer = move |_req, _peer| {
                    let body = Full::new(Bytes::from(index.to_string()));
                    std::future::ready(Response::new(ResponseBody::new(body)))
                };
                let second = Duration::from_secs(1);
                let limits = ConnectionLimits::new(second, second * 10, second, second, 64);
                let listener = Listener::spread(socket, member);
                serve(listener, answer, limits, None, stop, second).await;
            });
        })
    }

    /// Which thread answered a request sent on `client`.
    fn answered_by(client: &mut std::net::TcpStream) -> usize {
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: spread\r\n\r\n")
            .expect("the request is sent");
        let mut got = Vec::new();
        let mut chunk = [0; 512];
        while !got.windows(4).any(|w| w == b"\r\n\r\n")
            || !got.ends_with(b"0") && !got.ends_with(b"1")
        {
            let n = client
                .read(&mut chunk)
                .expect("an answer within the read timeout");
            assert!(
                n > 0,
                "the connection closed: {}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&chunk[..n]);
        }
        usize::from(got.last() == Some(&b'1'))
    }

    /// The kernel's hash can put every connection on one thread's socket;
    /// the threads still serve half each.
    #[test]
    fn connections_arriving_on_one_thread_are_served_evenly_by_all() {
        let (stop_tx, stop) = watch::channel(false);
        let sockets: Vec<_> = (0..2)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port"))
            .collect();
        let only = sockets[0].local_addr().expect("its address");
        let threads: Vec<_> = sockets
            .into_iter()
            .zip(members(2))
            .enumerate()
            .map(|(i, (socket, member))| serving(i, socket, member, stop.clone()))
            .collect();
        let mut clients = Vec::new();
        let mut served = [0; 2];
        for _ in 0..6 {
            let mut client = std::net::TcpStream::connect(only).expect("connected");
            client
                .set_read_timeout(Some(Duration::from_secs(5)))
                .expect("a read timeout");
            served[answered_by(&mut client)] += 1;
            // Kept open: a connection counts while it lives.
            clients.push(client);
        }
        assert_eq!(served, [3, 3]);
        drop(clients);
        stop_tx.send(true).expect("the threads listen");
        for t in threads {
            t.join().expect("a serving thread ends cleanly");
        }
    }

    #[test]
    fn a_seat_counts_while_it_lives() {
        let shared = members(3).swap_remove(0).shared;
        let live = || -> Vec<usize> {
            shared
                .live
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect()
        };
        let first = Seat::take(&shared, 1);
        let second = Seat::take(&shared, 1);
        let third = Seat::take(&shared, 2);
        assert_eq!(live(), [0, 2, 1]);
        drop(second);
        assert_eq!(live(), [0, 1, 1]);
        drop((first, third));
        assert_eq!(live(), [0, 0, 0]);
    }

    #[test]
    fn a_thread_keeps_a_connection_unless_another_holds_fewer() {
        assert_eq!(pick([0, 0], 0), 0);
        assert_eq!(pick([0, 0], 1), 1);
        assert_eq!(pick([3, 3, 3], 2), 2);
        assert_eq!(pick([4, 3], 0), 1);
        assert_eq!(pick([4, 3], 1), 1);
        assert_eq!(pick([5, 2, 1, 2], 0), 2);
        assert_eq!(pick([1, 2, 1], 1), 0);
        assert_eq!(pick([7], 0), 0);
    }
}

//! Connection tracking, shared by the XDP program (forward packets, and
//! replies in remote mode) and the TC egress program (replies in local
//! mode). It owns the three connection tables of each address family
//! ([`Family::syns`], [`Family::embryonic`], [`Family::conns`]) and the
//! rules of moving an entry between them; it never rewrites a packet or
//! picks a backend.
//!
//! - `SYNS` holds SYNs the backend has not answered: a set-associative
//!   array written in place (no LRU node, lock or eviction per SYN), so a
//!   SYN flood churns only its ways. The backend's SYN-ACK or reset moves
//!   the entry to `EMBRYONIC`.
//! - `EMBRYONIC` holds connections that have not proven themselves: an
//!   answered SYN until the client acknowledges the backend's SYN-ACK, a
//!   mid-flow packet of an unknown connection until the backend answers it
//!   with anything but a reset. A flood of stray ACKs only churns this
//!   table.
//! - `CONNS` holds established connections. Each direction has its entry,
//!   and every hit checks the other one and rebuilds it when the LRU
//!   evicted it, so the two directions never fall out of step for long.
//!
//! Each entry tracks what its sender last sent (sequence end, ACK, window),
//! which is what makes resets checkable: a reset closes the connection here
//! only if it carries the sender's own next sequence number or falls inside
//! the receiver's advertised window (RFC 5961's test, with the unscaled
//! window as a lower bound). Segments outside any plausible window change no
//! state at all; they are passed on, and the endpoint's stack decides.

// aya's map helpers take keys and values as `impl Borrow<_>`: passed by
// value, an IPv6 key or entry is copied into the caller's frame first,
// which the call chain's 512 bytes cannot spare; by reference it is not.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::helpers::generated::{bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns};
use aya_ebpf::maps::LruHashMap;
use core::mem::MaybeUninit;

use balancer_common::l4::{
    Addr, CLOSE_GRACE, CLOSED_SHIFT, FLAG_FIN_BACKEND, FLAG_FIN_CLIENT, FLAG_RECOVERED, FLAG_REPLY,
    FLAG_SEQ, Flow, FlowKey, Outcome, SYN_WAYS, SynSet,
};

use crate::atomic;
use crate::family::Family;
use crate::headers::{Segment, TcpHdr};
use crate::maps::{SYN_SET_MASK, backend_stats, outcome};

type Table<A> = LruHashMap<FlowKey<A>, Flow<A>>;

/// How far past the furthest byte seen a segment may start and still count:
/// everything between two packets of one sender passes through here, so
/// only reordering moves a real sender ahead.
const MAX_AHEAD: i32 = 1 << 18;
/// How far behind it may start (retransmissions: at most a window, and
/// windows scale to 1 GiB).
const MAX_BEHIND: i32 = 1 << 30;
/// How often (in jiffies, [`Flow::checked`]) a packet of an established
/// connection checks that the other direction's entry is still there: a
/// second at the usual HZ of 250 (a quarter of one at 1000, 2.5 at 100).
const PEER_CHECK: u32 = 250;

/// What the sender of an entry last sent, as tracking reads it: four
/// words copied rather than the whole entry (an IPv6 entry takes 52 bytes
/// of the stack frame a whole call chain shares, and every copy counts).
#[derive(Clone, Copy)]
struct Sent {
    flags: u32,
    seq: u32,
    ack: u32,
    window: u32,
}

impl Sent {
    /// What a missing entry counts as: nothing recorded (`FLAG_SEQ`
    /// clear), which every check treats as "unknown". (A plain value, not
    /// an `Option`: LLVM computes conditions on the payload of a `None`
    /// branch-free, reading a register the verifier calls uninitialised.)
    const NOTHING: Sent = Sent {
        flags: 0,
        seq: 0,
        ack: 0,
        window: 0,
    };

    /// # Safety
    /// `entry` points at a live map value.
    #[inline(always)]
    unsafe fn of<A: Addr>(entry: *const Flow<A>) -> Self {
        // SAFETY: the caller's promise.
        unsafe {
            Sent {
                flags: (*entry).flags,
                seq: (*entry).seq,
                ack: (*entry).ack,
                window: (*entry).window,
            }
        }
    }
}

/// The entry of `key` in either table, without tracking anything: a reply
/// entry if `reply`, else a forward one.
#[inline(always)]
fn find_entry<F: Family>(key: &FlowKey<F::Addr>, reply: bool) -> Option<Flow<F::Addr>> {
    let wanted = if reply { FLAG_REPLY } else { 0 };
    for table in [F::conns(), F::embryonic()] {
        if let Some(entry) = table.get_ptr(key) {
            // SAFETY: a successful lookup, copied at once.
            let flow = unsafe { *entry };
            if flow.flags & FLAG_REPLY == wanted {
                return Some(flow);
            }
        }
    }
    if !reply {
        return None;
    }
    // A SYN's handshake the backend has not answered yet.
    let (set, way) = waiting::<F>(key)?;
    // SAFETY: `waiting` found the set in the map.
    Some(unsafe { (*set).ways[way % SYN_WAYS].flow })
}

/// The set of `SYNS` that reply key `key` belongs to, and the way that
/// holds it whole, if one does (less than [`SYN_WAYS`]; callers index
/// with `way % SYN_WAYS`, which the compiler sees is in range).
#[inline(always)]
fn waiting<F: Family>(key: &FlowKey<F::Addr>) -> Option<(*mut SynSet<F::Addr>, usize)> {
    let hash = SynSet::hash(key);
    let tag = SynSet::<F::Addr>::tag(hash);
    let set = F::syns().get_ptr_mut(hash as u32 & SYN_SET_MASK.load())?;
    // SAFETY: a successful lookup of a shared array slot; a way another CPU
    // is writing fails its check.
    let whole = unsafe { &*set };
    // `SynSet::way_of`'s test, written out: called here, its loop took
    // the verifier past a million instructions.
    for w in 0..SYN_WAYS {
        if whole.tags[w] == tag
            && whole.ways[w].key == *key
            && whole.ways[w].check == SynSet::check(key, &whole.ways[w].flow)
        {
            return Some((set, w));
        }
    }
    None
}

// The public entry points fill `out` and say whether they found an entry,
// rather than return an `Option<Flow>`: kept across the calls that follow,
// the payload of a `None` becomes an undefined register that LLVM spills,
// and the verifier refuses to read it. `out` starts uninitialised: zeroing
// a `Flow` first costs a call to a byte-by-byte `memset` on this target.

/// A packet from client to service of an established connection: its
/// entry, after tracking the segment; `None` when `CONNS` has none. The
/// entry itself, not a copy, as Katran reads its connection entry: the
/// fields a known flow is sent by (backend, address, service) never change
/// while the entry lives, and tracking reads and writes the entry in place
/// anyway. (The copy of all of it cost an IPv6 known flow about 10 ns.)
#[inline(always)]
pub fn established<'a, F: Family>(
    key: &FlowKey<F::Addr>,
    seg: &Segment,
) -> Option<&'a Flow<F::Addr>> {
    let entry = F::conns().get_ptr_mut(key)?;
    // SAFETY: a successful lookup; map values outlive the program run.
    if unsafe { (*entry).flags } & FLAG_REPLY != 0 {
        return None;
    }
    track::<F>(F::conns(), key, entry, seg);
    // SAFETY: as above.
    Some(unsafe { &*entry })
}

/// A packet from client to service of a connection still proving itself:
/// its entry into `out`, after tracking (and promotion, if this packet
/// completes the handshake); false when `EMBRYONIC` has none.
#[inline(always)]
pub fn handshaking<F: Family>(
    key: &FlowKey<F::Addr>,
    seg: &Segment,
    out: &mut MaybeUninit<Flow<F::Addr>>,
) -> bool {
    let Some(entry) = F::embryonic().get_ptr_mut(key) else {
        return false;
    };
    let flow = copy_out(entry, out);
    if flow.flags & FLAG_REPLY != 0 {
        return false;
    }
    let peer = track::<F>(F::embryonic(), key, entry, seg);
    // The client acknowledging the backend's SYN-ACK completes the
    // handshake: only a client that received it knows the number.
    if flow.flags & FLAG_RECOVERED == 0
        && seg.has(TcpHdr::ACK)
        && !seg.has(TcpHdr::RST)
        && peer.flags & FLAG_SEQ != 0
        && seg.ack == peer.seq
    {
        promote::<F>(key, entry, &flow.peer_key(key));
    }
    true
}

/// A packet from a backend to a client of a connection a table knows: its
/// (reply) entry into `out`, after tracking; false when the packet is not
/// a reply of a steered connection, which then passes untouched.
///
/// The backend's first packet of a connection answers a SYN that waits in
/// `SYNS`, which moves to `EMBRYONIC` ([`answered`]): a SYN-ACK or a reset
/// before anything else (an established connection on the same four-tuple
/// gives way to it below), any other packet when neither table knows the
/// four-tuple. (That is the ACK a backend's stack sends a SYN that meets
/// the four-tuple's TIME-WAIT: restored, it tells the client's stack to
/// reset and send the SYN again at once; untranslated, the client waits a
/// whole retransmission timeout.)
#[inline(always)]
pub fn reply<F: Family>(
    key: &FlowKey<F::Addr>,
    seg: &Segment,
    out: &mut MaybeUninit<Flow<F::Addr>>,
) -> bool {
    let answer = seg.flags & (TcpHdr::SYN | TcpHdr::RST) != 0;
    if answer {
        answered::<F>(key);
    }
    if let Some(entry) = F::conns().get_ptr_mut(key) {
        let flow = copy_out(entry, out);
        if flow.flags & FLAG_REPLY != 0 {
            let syn_ack = seg.is_syn_ack();
            // A SYN-ACK on an open connection's four-tuple answers a new
            // SYN when that SYN's handshake waits for it: the client
            // reused the port, and the old entries go (see `forget`).
            if !(stale(flow, syn_ack) || syn_ack && handshake_waits::<F>(key)) {
                track::<F>(F::conns(), key, entry, seg);
                return true;
            }
            // A later connection on the same four-tuple, which did not come
            // through here (not ours to rewrite) or which did (its own
            // entries follow).
            let _ = F::conns().remove(key);
        }
    }
    let found = match F::embryonic().get_ptr_mut(key) {
        None if !answer && answered::<F>(key) => F::embryonic().get_ptr_mut(key),
        found => found,
    };
    let Some(entry) = found else {
        return false;
    };
    let flow = copy_out(entry, out);
    if flow.flags & FLAG_REPLY == 0 || stale(flow, seg.is_syn_ack()) {
        return false;
    }
    track::<F>(F::embryonic(), key, entry, seg);
    // A backend that answers a recovered connection with anything but a
    // reset has it: the connection is real. (Without the other entry,
    // `promote` does nothing.)
    if flow.flags & FLAG_RECOVERED != 0 && !seg.has(TcpHdr::RST) {
        promote::<F>(key, entry, &flow.peer_key(key));
    }
    true
}

/// Copies a map value into `out`, which may itself lie in a map (the
/// per-CPU scratch slot): as a copy LLVM knows does not overlap, which it
/// unrolls into word moves, where a plain assignment between two pointers
/// becomes a call to a byte-by-byte `memmove` loop that the verifier walks
/// byte by byte on every path.
#[inline(always)]
fn copy_out<A: Addr>(entry: *const Flow<A>, out: &mut MaybeUninit<Flow<A>>) -> &mut Flow<A> {
    // SAFETY: `entry` points at a live map value, and `out` is a different
    // object (a local or a scratch slot, never a connection table's value).
    unsafe {
        core::ptr::copy_nonoverlapping(entry, out.as_mut_ptr(), 1);
        out.assume_init_mut()
    }
}

/// [`find_entry`] into `out`; whether there was one.
#[inline(always)]
pub fn find<F: Family>(
    key: &FlowKey<F::Addr>,
    reply: bool,
    out: &mut MaybeUninit<Flow<F::Addr>>,
) -> bool {
    fill(find_entry::<F>(key, reply), out)
}

#[inline(always)]
fn fill<A: Addr>(found: Option<Flow<A>>, out: &mut MaybeUninit<Flow<A>>) -> bool {
    match found {
        Some(flow) => {
            out.write(flow);
            true
        }
        None => false,
    }
}

/// Stores the entry a SYN needs: the reply direction's, which the
/// backend's SYN-ACK must find to get the service back as its source. It
/// goes into a way of its set in `SYNS` (the oldest, or the one its
/// four-tuple already holds), not into `EMBRYONIC`: a slot write where an
/// LRU insert takes a node, a lock and, in a full table, an eviction. The
/// backend's answer moves it to `EMBRYONIC` ([`answered`]), and the forward
/// entry is made from it then (see [`track`]), so a SYN flood churns only
/// `SYNS`: the reply entry carries the client's next sequence number in its
/// `ack` (what the backend's SYN-ACK must acknowledge), which is what the
/// forward entry needs to start from.
///
/// A SYN that finds its own handshake still waiting (same initial sequence
/// number, same backend) is the client trying again: unanswered, the
/// backend's handshake timed out, which its counters record, and the way
/// stays as it is. What an earlier connection on the four-tuple left (a
/// forward entry of an abandoned handshake, an established connection's
/// entries) goes when the backend answers ([`track`]).
#[inline(always)]
pub fn open<F: Family>(key: &FlowKey<F::Addr>, flow: &Flow<F::Addr>) {
    let (peer_key, mut peer) = flow.peer(key);
    peer.ack = flow.seq;
    let hash = SynSet::hash(&peer_key);
    let tag = SynSet::<F::Addr>::tag(hash);
    let Some(set) = F::syns().get_ptr_mut(hash as u32 & SYN_SET_MASK.load()) else {
        return;
    };
    // SAFETY: a successful lookup of a shared array slot. SYNs on other
    // CPUs may write the same way: a reader checks it ([`SynSet::check`]).
    let set = unsafe { &mut *set };
    let now = now_jiffies();
    let mut way = SYN_WAYS;
    let mut oldest = 0;
    for w in 0..SYN_WAYS {
        if set.tags[w] == tag && set.ways[w].key == peer_key {
            if retransmitted::<F>(set, w, &peer_key, &peer) {
                return;
            }
            way = w;
            break;
        }
        let age = if set.tags[w] == 0 {
            u32::MAX
        } else {
            now.wrapping_sub(set.stamps[w])
        };
        if way == SYN_WAYS || age > oldest {
            (way, oldest) = (w, age);
        }
    }
    if way >= SYN_WAYS {
        return;
    }
    // Untagged while it is written: a reader between these stores finds
    // no tag, or (on another CPU, stores seen out of order) fails the check.
    set.tags[way] = 0;
    set.ways[way].key = peer_key;
    set.ways[way].flow = peer;
    set.ways[way].check = SynSet::check(&peer_key, &peer);
    set.stamps[way] = now;
    set.tags[way] = tag;
}

/// Stores both entries of a connection a mid-flow packet recovers (its
/// forward entry `flow` carries what the client sent). On failure neither
/// is left behind (a forward entry without its reply would send packets
/// whose answers nothing restores).
#[inline(always)]
pub fn recover<F: Family>(key: &FlowKey<F::Addr>, flow: &Flow<F::Addr>) {
    if F::embryonic().insert(key, flow, 0).is_err() {
        outcome(Outcome::ConntrackFull);
        return;
    }
    let (peer_key, peer) = flow.peer(key);
    if F::embryonic().insert(&peer_key, &peer, 0).is_err() {
        let _ = F::embryonic().remove(key);
        outcome(Outcome::ConntrackFull);
    }
}

/// Whether way `way` of `set` (reply key `key`) is the handshake of a
/// SYN that would make `fresh` there (the same backend and service, the
/// same client's next sequence number): the SYN was sent again. If the
/// backend has not answered it ([`answered`] marks the way), counts a
/// timeout of the backend. An answered one goes on in `EMBRYONIC`, unless
/// the backend refused it with a reset there: then this SYN starts it
/// again.
#[inline(always)]
fn retransmitted<F: Family>(
    set: &SynSet<F::Addr>,
    way: usize,
    key: &FlowKey<F::Addr>,
    fresh: &Flow<F::Addr>,
) -> bool {
    let waiting = &set.ways[way].flow;
    if waiting.ack != fresh.ack
        || waiting.backend != fresh.backend
        || waiting.addr != fresh.addr
        || waiting.port != fresh.port
        || set.ways[way].check != SynSet::check(key, waiting)
    {
        return false;
    }
    if waiting.flags & FLAG_SEQ != 0 {
        // SAFETY: a successful lookup.
        return F::embryonic()
            .get_ptr(key)
            .is_none_or(|entry| unsafe { (*entry).closed } == 0);
    }
    if let Some(stats) = backend_stats(waiting.backend) {
        stats.timeouts += 1;
        stats.last_signal_ns = now_ns();
    }
    true
}

/// A backend's packet answering a SYN whose handshake waits in `SYNS` under
/// the packet's four-tuple (see [`reply`]): moves its reply entry to
/// `EMBRYONIC`, where the rest of the handshake finds it, and marks the way
/// answered, so that the backend's answer sent again finds it there and a
/// SYN sent again is not taken for one unanswered. Whether it moved one.
#[inline(always)]
fn answered<F: Family>(key: &FlowKey<F::Addr>) -> bool {
    let Some((set, way)) = waiting::<F>(key) else {
        return false;
    };
    // SAFETY: as in `open`.
    let set = unsafe { &mut *set };
    let way = way % SYN_WAYS;
    let flow = set.ways[way].flow;
    if flow.flags & FLAG_SEQ != 0 {
        return false;
    }
    if F::embryonic().insert(key, &flow, 0).is_err() {
        outcome(Outcome::ConntrackFull);
        return false;
    }
    let (tag, mut marked) = (set.tags[way], flow);
    marked.flags |= FLAG_SEQ;
    set.tags[way] = 0;
    set.ways[way].flow = marked;
    set.ways[way].check = SynSet::check(key, &marked);
    set.tags[way] = tag;
    true
}

/// Forgets an established connection whose four-tuple a new handshake
/// reuses, so that the new connection's packets do not follow the old
/// entry: called when the backend answers the new SYN ([`track`]), not at
/// the SYN, so that a SYN (a SYN flood's packet) looks up one table, not
/// two. Until the answer the old entry stands, which changes nothing: the
/// client sends nothing but SYNs before it has the SYN-ACK, and every SYN
/// gets a fresh decision.
#[inline(always)]
pub fn forget<F: Family>(key: &FlowKey<F::Addr>) {
    if let Some(entry) = F::conns().get_ptr(key) {
        // SAFETY: a successful lookup, copied at once.
        let flow = unsafe { *entry };
        if flow.flags & FLAG_REPLY == 0 {
            let (peer_key, _) = flow.peer(key);
            let _ = F::conns().remove(key);
            let _ = F::conns().remove(&peer_key);
        }
    }
}

/// Tracks `seg` in `entry` (key `key` of `table`) and applies its FIN or
/// reset to both entries of the connection. Returns what the other entry's
/// sender last sent when it was looked at (rebuilding it first if it was
/// missing), else [`Sent::NOTHING`].
#[inline(always)]
fn track<F: Family>(
    table: &'static Table<F::Addr>,
    key: &FlowKey<F::Addr>,
    entry: *mut Flow<F::Addr>,
    seg: &Segment,
) -> Sent {
    // SAFETY (the reads of `entry` below): it comes from a successful
    // lookup in `table`; map values outlive the program run.
    let own = unsafe { Sent::of(entry) };
    let (checked, backend) = unsafe { ((*entry).checked, (*entry).backend) };
    // The other entry is looked at when this packet needs it (a FIN or a
    // reset closes both; a handshake completes against it) and otherwise
    // at most every PEER_CHECK: TCP sends packets both ways, so the LRU
    // keeps both entries of a live connection, and only one that sat idle
    // can have lost one of them, which its first packet after the pause
    // repairs. That keeps the steady state at one hash lookup per packet.
    let now = now_jiffies();
    let wanted = seg.flags & (TcpHdr::FIN | TcpHdr::RST) != 0
        || own.flags & FLAG_REPLY != 0 && seg.is_syn_ack()
        || core::ptr::eq(table, F::embryonic())
        || now.wrapping_sub(checked) > PEER_CHECK;
    let peer_entry = if !wanted {
        None
    } else {
        // SAFETY: as above.
        unsafe { (*entry).checked = now };
        // Only here: an IPv6 address copied out of a map value becomes a
        // byte-by-byte `memmove` call on this target (the known flow's
        // costliest instructions while every packet made this key).
        let peer_key = unsafe { (*entry).peer_key(key) };
        let awaited = awaits_forward::<F>(table, &own);
        let found = table.get_ptr_mut(&peer_key);
        let usable = match found {
            // SAFETY: a successful lookup.
            Some(peer) => !awaited || unsafe { starts_at(peer, own.ack, backend) },
            None => false,
        };
        if usable {
            found
        } else {
            // SAFETY: as above.
            let (_, mut fresh) = unsafe { (*entry).peer(key) };
            if awaited {
                // The backend answers a SYN: the forward entry starts at
                // the client's next sequence number, which the SYN left in
                // this entry (see `open`); one found there belongs to an
                // earlier connection on the four-tuple and is replaced, as
                // is an established one.
                forget::<F>(&peer_key);
                fresh.seq = own.ack;
                // An entry without the client's number (`ack` 0) was
                // written by an earlier build, which made the forward entry
                // at the SYN: this one learns it from the client's next
                // packet instead. (Kept out of `awaits_forward`, where the
                // condition cost the verifier 70,000 instructions a program.)
                fresh.flags |= FLAG_SEQ * u32::from(own.ack != 0);
            } else {
                outcome(Outcome::PeerRestored);
            }
            if table.insert(&peer_key, &fresh, 0).is_err() {
                outcome(Outcome::ConntrackFull);
            }
            table.get_ptr_mut(&peer_key)
        }
    };
    // SAFETY: as for `entry`.
    let found = match peer_entry {
        Some(p) => unsafe { Sent::of(p) },
        None => Sent::NOTHING,
    };
    let fin = if own.flags & FLAG_REPLY != 0 {
        FLAG_FIN_BACKEND
    } else {
        FLAG_FIN_CLIENT
    };

    let plausible = own.flags & FLAG_SEQ == 0 || {
        let ahead = seg.seq.wrapping_add(seg.len).wrapping_sub(own.seq) as i32;
        (-MAX_BEHIND..=MAX_AHEAD).contains(&ahead)
    };
    // What the backend's handshakes do, for the agent's breakers
    // (`--cb-l4-signals`): only reply entries speak for the backend.
    let backend_speaks = own.flags & FLAG_REPLY != 0;
    let handshaking =
        core::ptr::eq(table, F::embryonic()) && own.flags & (FLAG_SEQ | FLAG_RECOVERED) == 0;
    if seg.has(TcpHdr::RST) {
        if rst_valid(&own, &found, seg) {
            if backend_speaks && let Some(stats) = backend_stats(backend) {
                if handshaking {
                    stats.refused += 1;
                    stats.last_signal_ns = now_ns();
                } else if core::ptr::eq(table, F::conns()) {
                    stats.resets += 1;
                }
            }
            close(entry, peer_entry, 0, true);
        } else {
            outcome(Outcome::RstIgnored);
        }
    } else if !plausible {
        outcome(Outcome::RstIgnored);
    } else {
        if backend_speaks
            && handshaking
            && seg.is_syn_ack()
            && let Some(stats) = backend_stats(backend)
        {
            stats.established += 1;
            stats.last_signal_ns = now_ns();
        }
        note(entry, &own, &found, seg);
        if seg.has(TcpHdr::FIN) {
            close(entry, peer_entry, fin, false);
        }
    }
    found
}

/// Whether the embryonic table holds, at `key`, the reply entry of a SYN's
/// handshake the backend has not answered yet ([`awaits_forward`]).
#[inline(always)]
fn handshake_waits<F: Family>(key: &FlowKey<F::Addr>) -> bool {
    F::embryonic().get_ptr(key).is_some_and(|entry| {
        // SAFETY: a successful lookup.
        let own = unsafe { Sent::of(entry) };
        awaits_forward::<F>(F::embryonic(), &own)
    })
}

/// Whether `own` is a reply entry of a SYN's handshake the backend has not
/// answered yet, whose forward entry is made when it answers ([`open`]).
#[inline(always)]
fn awaits_forward<F: Family>(table: &'static Table<F::Addr>, own: &Sent) -> bool {
    core::ptr::eq(table, F::embryonic())
        && own.flags & (FLAG_REPLY | FLAG_SEQ | FLAG_RECOVERED) == FLAG_REPLY
}

/// Whether the forward entry `entry` is the one a handshake's SYN would
/// make: open, to `backend`, starting at the client's next sequence number
/// `next`.
///
/// # Safety
/// `entry` points at a live map value.
#[inline(always)]
unsafe fn starts_at<A: Addr>(entry: *const Flow<A>, next: u32, backend: u32) -> bool {
    let over = FLAG_REPLY | FLAG_RECOVERED | FLAG_FIN_CLIENT | FLAG_FIN_BACKEND;
    // SAFETY: the caller's promise.
    let own = unsafe { Sent::of(entry) };
    let (closed, to) = unsafe { ((*entry).closed, (*entry).backend) };
    own.flags & (over | FLAG_SEQ) == FLAG_SEQ && own.seq == next && closed == 0 && to == backend
}

/// Whether a reset is the connection's own: it carries exactly the next
/// sequence number its sender was at, or it falls inside the window the
/// receiver advertised from the byte the receiver expects next. A reset
/// answering a SYN (no sequence of the backend known yet) must acknowledge
/// the SYN instead.
#[inline(always)]
fn rst_valid(own: &Sent, peer: &Sent, seg: &Segment) -> bool {
    if own.flags & FLAG_SEQ != 0 && seg.seq == own.seq {
        return true;
    }
    if peer.flags & FLAG_SEQ == 0 {
        return false;
    }
    if own.flags & FLAG_SEQ == 0 {
        return seg.has(TcpHdr::ACK) && seg.ack == peer.seq;
    }
    peer.ack != 0 && seg.seq.wrapping_sub(peer.ack) < peer.window.max(1)
}

/// Records what the sender of a plausible segment is at. Only this
/// direction's packets write these fields, and they arrive on one CPU.
#[inline(always)]
fn note<A: Addr>(entry: *mut Flow<A>, own: &Sent, peer: &Sent, seg: &Segment) {
    // SAFETY: `entry` comes from a successful lookup.
    let e = unsafe { &mut *entry };
    let end = seg.seq.wrapping_add(seg.len);
    let known = own.flags & FLAG_SEQ != 0;
    if !known || end.wrapping_sub(own.seq) as i32 > 0 {
        e.seq = end;
    }
    if seg.has(TcpHdr::ACK) {
        // An acknowledgement moves forward, and never past what the peer
        // has sent: otherwise a forged ACK could move the window resets
        // are checked against.
        let forward = own.ack == 0 || seg.ack.wrapping_sub(own.ack) as i32 >= 0;
        let sent = peer.flags & FLAG_SEQ == 0 || peer.seq.wrapping_sub(seg.ack) as i32 >= 0;
        if forward && sent {
            e.ack = seg.ack;
            e.window = seg.window;
        }
    }
    if !known {
        // SAFETY: as above; `flags` is 4-aligned in the 4-aligned value.
        unsafe { atomic::or(&raw mut e.flags, FLAG_SEQ) };
    }
}

/// Records a FIN (`fin`, one side's bit) or a reset in both entries. The
/// two sides can close at once on two CPUs: each ORs its bit in atomically
/// (a full barrier) and then reads the word back, so at least the second
/// to set its bit sees both and marks the connection closed. Two CPUs
/// writing the close time at once write the same millisecond or so.
#[inline(always)]
fn close<A: Addr>(entry: *mut Flow<A>, peer: Option<*mut Flow<A>>, fin: u32, rst: bool) {
    let now = now_closed_units();
    let both = FLAG_FIN_CLIENT | FLAG_FIN_BACKEND;
    let mark = |target: *mut Flow<A>| {
        // SAFETY: `target` points at a live map value (a successful lookup;
        // map values outlive the program run), 4-aligned like its fields.
        unsafe {
            if fin != 0 {
                atomic::or(&raw mut (*target).flags, fin);
            }
            let flags = core::ptr::read_volatile(&raw const (*target).flags);
            let closed = &raw mut (*target).closed;
            if (rst || flags & both == both) && core::ptr::read_volatile(closed) == 0 {
                core::ptr::write_volatile(closed, now);
            }
        }
    };
    mark(entry);
    if let Some(peer) = peer {
        mark(peer);
    }
}

/// Moves a connection from `EMBRYONIC` to `CONNS`: both entries, as they
/// are now, or neither.
#[inline(always)]
fn promote<F: Family>(
    key: &FlowKey<F::Addr>,
    entry: *mut Flow<F::Addr>,
    peer_key: &FlowKey<F::Addr>,
) {
    // SAFETY: `entry` comes from a successful lookup.
    let mut own = unsafe { *entry };
    let Some(peer) = F::embryonic().get_ptr(peer_key) else {
        return;
    };
    // SAFETY: as above.
    let mut peer = unsafe { *peer };
    own.flags &= !FLAG_RECOVERED;
    peer.flags &= !FLAG_RECOVERED;
    if F::conns().insert(key, &own, 0).is_err() {
        outcome(Outcome::ConntrackFull);
        return;
    }
    if F::conns().insert(peer_key, &peer, 0).is_err() {
        let _ = F::conns().remove(key);
        outcome(Outcome::ConntrackFull);
        return;
    }
    let _ = F::embryonic().remove(key);
    let _ = F::embryonic().remove(peer_key);
    outcome(Outcome::Promoted);
}

/// The monotonic clock, for `BackendStats::last_signal_ns` (only on the
/// handshake paths that count a signal).
#[inline(always)]
fn now_ns() -> u64 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// The kernel's tick count, for [`Flow::checked`]: every packet of a
/// connection reads a clock, and this is the one the verifier inlines into a
/// load (`bpf_ktime_get_coarse_ns` is a helper call, about 10 ns here).
#[inline(always)]
fn now_jiffies() -> u32 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_jiffies64() as u32 }
}

/// The time in [`Flow::closed`] units; never 0, which means "open".
#[inline(always)]
fn now_closed_units() -> u32 {
    // SAFETY: a helper without arguments.
    let ns = unsafe { bpf_ktime_get_coarse_ns() };
    ((ns >> CLOSED_SHIFT) as u32).max(1)
}

/// Whether a reply entry belongs to a connection that has closed and must
/// no longer rewrite anything: its grace period is over, or the packet is
/// a SYN-ACK, which opens a new connection this balancer did not steer (a
/// SYN it steered would have replaced the entry).
#[inline(always)]
fn stale<A: Addr>(flow: &Flow<A>, syn_ack: bool) -> bool {
    flow.closed != 0 && (syn_ack || now_closed_units().wrapping_sub(flow.closed) > CLOSE_GRACE)
}

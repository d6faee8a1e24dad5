//! The quorum rules, one test each; time moves only through `ManualClock`.

use super::*;
use crate::clock::{Clock, ManualClock};

const W: &str = "http%3A%2F%2Fw%3A8000";
const LEASE: Duration = Duration::from_secs(10);

fn isolate(replicas: &[&str]) -> Decision {
    Decision::Isolate {
        worker: W.to_owned(),
        replicas: replicas.iter().map(|r| r.to_string()).collect(),
    }
}

fn release(replicas: &[&str]) -> Decision {
    Decision::Release {
        worker: W.to_owned(),
        replicas: replicas.iter().map(|r| r.to_string()).collect(),
    }
}

/// Replica `a` of a fleet `a`, `b`, `c`, `d`, loaded at time 0, quorum 2.
fn view() -> FleetView {
    let mut v = FleetView::new("a", 2, LEASE);
    let none = v.resync(
        ["a", "b", "c", "d"].map(String::from),
        Vec::<(String, String)>::new(),
        0,
    );
    assert!(none.is_empty());
    v
}

#[test]
fn the_worker_key_percent_encodes_every_byte_outside_the_unreserved_set() {
    assert_eq!(
        worker_key("http://10.0.0.11:8000"),
        "http%3A%2F%2F10.0.0.11%3A8000"
    );
    assert_eq!(worker_key("Az09._~-"), "Az09._~-");
    assert_eq!(worker_key("a/b c\u{e9}"), "a%2Fb%20c%C3%A9");
}

#[test]
fn a_quorum_of_other_replicas_isolates_and_its_end_releases() {
    let mut v = view();
    assert_eq!(
        v.verdict_put(W, "b"),
        vec![],
        "one verdict is below the quorum"
    );
    assert_eq!(v.holders(W), vec!["b"]);
    assert_eq!(v.verdict_put(W, "c"), vec![isolate(&["b", "c"])]);
    assert!(v.is_held(W));
    assert_eq!(v.verdict_put(W, "d"), vec![], "already held");
    assert_eq!(v.verdict_deleted(W, "b"), vec![], "c and d still hold it");
    assert_eq!(v.verdict_deleted(W, "c"), vec![release(&["b", "c"])]);
    assert!(!v.is_held(W));
    assert_eq!(v.verdict_deleted(W, "d"), vec![]);
    assert!(v.open_verdicts().is_empty());
}

#[test]
fn only_live_replicas_count() {
    let mut v = view();
    // A verdict may arrive before its replica's key; it counts from then.
    assert_eq!(v.verdict_put(W, "e"), vec![]);
    assert_eq!(v.verdict_put(W, "b"), vec![]);
    assert_eq!(v.replica_up("e"), vec![isolate(&["b", "e"])]);
    assert_eq!(v.live_replicas(), 5);
    // A replica whose lease expired loses its verdicts with it.
    assert_eq!(v.replica_down("e"), vec![release(&["b", "e"])]);
    assert_eq!(v.holders(W), vec!["b"]);
}

#[test]
fn this_replica_counts_once_from_its_own_verdict() {
    let mut v = view();
    // Its own key in the store is ignored: the local verdict is the truth.
    assert_eq!(v.verdict_put(W, "a"), vec![]);
    assert!(v.holders(W).is_empty());
    assert_eq!(v.own_opened(W), vec![]);
    assert_eq!(v.holders(W), vec!["a"], "counted once, not twice");
    assert_eq!(v.verdict_put(W, "b"), vec![isolate(&["a", "b"])]);
    // Its own verdict ends: b alone is below the quorum.
    assert_eq!(v.own_closed(W), vec![release(&["a", "b"])]);
    // A resync carrying its stale key does not bring it back.
    let decisions = v.resync(
        ["a", "b"].map(String::from),
        [(W, "a"), (W, "b")].map(|(w, r)| (w.to_owned(), r.to_owned())),
        1,
    );
    assert_eq!(decisions, vec![]);
    assert_eq!(v.holders(W), vec!["b"]);
}

#[test]
fn the_end_of_its_own_verdict_under_the_others_quorum_isolates_again() {
    let mut v = view();
    v.own_opened(W);
    v.verdict_put(W, "b");
    v.verdict_put(W, "c");
    assert!(v.is_held(W));
    // Its own breaker closed on its own trial, but b and c still say open:
    // the fleet opens it again.
    assert_eq!(v.own_closed(W), vec![isolate(&["a", "b"])]);
}

#[test]
fn out_of_touch_past_the_lease_releases_and_a_resync_restores() {
    let clock = ManualClock::new();
    let mut v = view();
    v.verdict_put(W, "b");
    v.verdict_put(W, "c");
    assert!(v.is_held(W));
    clock.advance(Duration::from_secs(6));
    v.contact(clock.now());
    clock.advance(Duration::from_secs(10));
    assert_eq!(
        v.tick(clock.now()),
        vec![],
        "within the lease of the last answer"
    );
    clock.advance(Duration::from_millis(1));
    assert_eq!(v.tick(clock.now()), vec![release(&["b", "c"])]);
    assert!(!v.in_touch());
    assert_eq!(v.live_replicas(), 0);
    // Answers before the resync prove nothing about the others' verdicts.
    v.contact(clock.now());
    assert!(!v.in_touch());
    let decisions = v.resync(
        ["a", "b", "c"].map(String::from),
        [(W, "b"), (W, "c")].map(|(w, r)| (w.to_owned(), r.to_owned())),
        clock.now(),
    );
    assert_eq!(decisions, vec![isolate(&["b", "c"])]);
    assert!(v.in_touch());
}

#[test]
fn own_verdicts_survive_losing_touch() {
    let mut v = view();
    v.own_opened(W);
    assert_eq!(v.tick(nanos(LEASE) + 1), vec![]);
    assert_eq!(v.holders(W), vec!["a"]);
    assert_eq!(v.open_verdicts().len(), 1);
}

#[test]
fn a_quorum_of_one_is_any_verdict() {
    let mut v = FleetView::new("a", 0, LEASE);
    v.resync(["a", "b"].map(String::from), Vec::new(), 0);
    assert_eq!(v.verdict_put(W, "b"), vec![isolate(&["b"])]);
}

//! L4 steering run on crafted frames through BPF_PROG_TEST_RUN, in both
//! forwarding modes: rewrites and their checksums, the choice of backends
//! (never an isolated one, evenly over the others), established flows kept,
//! replies restored, and everything else passed untouched and counted.
//!
//! Local mode needs no routes. Remote mode looks next hops up, so its tests
//! run inside a namespace they create, with two veths and permanent
//! neighbour entries standing in for the client's and backends' hosts.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use balancer_common::Verdict;
use balancer_common::l4::{
    Addr6, BackendState, FLAG_RECOVERED, FlowKey, Outcome, SYN_WAYS, SynSet, addr_be, port_be,
    sole_of,
};
use balancer_dataplane::maglev::{self, Member};
use balancer_dataplane::{Dataplane, LoadOptions, VerdictCounts, XdpAction};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4::{Router, Steered, TABLE_SIZE};
use balancer_tests::packet::{self, Ipv4};

const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 100), 80);
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 1, 2), 40_000);
const BACKENDS: [SocketAddrV4; 3] = [
    SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 11), 8000),
    SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 12), 8001),
    SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 13), 8002),
];
const FLOWS: usize = 10_000;

fn syn(client: SocketAddrV4) -> Vec<u8> {
    packet::tcp_frame(client, VIP, packet::TCP_SYN)
}

fn ack(client: SocketAddrV4) -> Vec<u8> {
    packet::tcp_frame(client, VIP, packet::TCP_ACK)
}

fn flow_key(src: SocketAddrV4, dst: SocketAddrV4) -> FlowKey {
    FlowKey::tcp(
        addr_be(src.ip().octets()),
        port_be(src.port()),
        addr_be(dst.ip().octets()),
        port_be(dst.port()),
    )
}

/// Deterministic pseudo-random clients (xorshift), spread over a /16.
struct Clients(u64);

impl Iterator for Clients {
    type Item = SocketAddrV4;
    fn next(&mut self) -> Option<SocketAddrV4> {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let [a, b, c, d, ..] = self.0.to_le_bytes();
        let port = 1024 + u16::from_le_bytes([c, d]) % 60_000;
        Some(SocketAddrV4::new(Ipv4Addr::new(10, 200, a, b), port))
    }
}

/// The backend's SYN-ACK to `CLIENT` through the TC egress program, which
/// restores the service as its source.
fn answer(steered: &Steered, backend: SocketAddrV4) {
    let syn_ack = packet::tcp_frame(backend, CLIENT, packet::TCP_SYN | packet::TCP_ACK);
    let run = steered.dataplane.test_run_egress(&syn_ack).unwrap();
    assert_eq!(
        packet::endpoints(&run.packet),
        (VIP, CLIENT),
        "SYN-ACK restored"
    );
}

/// Runs the XDP program once and returns its action and the frame after.
fn xdp(steered: &Steered, frame: &[u8], ifindex: Option<u32>) -> (XdpAction, Vec<u8>) {
    let run = steered
        .dataplane
        .test_run(frame, 1, ifindex)
        .expect("test run");
    (run.action, run.packet)
}

/// How many of `FLOWS` new connections each backend got.
fn spread(steered: &Steered, seed: u64, ifindex: Option<u32>) -> Vec<usize> {
    let mut got = vec![0; steered.backends.len()];
    for client in Clients(seed).take(FLOWS) {
        let (_, out) = xdp(steered, &syn(client), ifindex);
        let (src, dst) = packet::endpoints(&out);
        assert_eq!(src, client, "the source must stay the client");
        let backend = steered
            .backend_of(dst)
            .unwrap_or_else(|| panic!("{client} went to {dst}, not a backend"));
        got[backend] += 1;
    }
    got
}

/// Isolated backends got nothing; the others are within 10% of even.
fn assert_spread(got: &[usize], isolated: &[usize], what: &str) {
    check_spread(got, isolated, what).unwrap_or_else(|error| panic!("{error:#}"));
}

fn check_spread(got: &[usize], isolated: &[usize], what: &str) -> Result<()> {
    let routable = got.len() - isolated.len();
    let even = FLOWS as f64 / routable as f64;
    for (i, &n) in got.iter().enumerate() {
        if isolated.contains(&i) {
            ensure!(
                n == 0,
                "{what}: isolated backend {i} got {n} new flows: {got:?}"
            );
        } else {
            let off = (n as f64 - even).abs() / even;
            ensure!(
                off <= 0.10,
                "{what}: backend {i} got {n}, {off:.3} off even: {got:?}"
            );
        }
    }
    eprintln!("{what}: {got:?}");
    Ok(())
}

fn local() -> Option<Steered> {
    let object = ebpf_prerequisites()?;
    Some(Steered::load(&object, VIP, &BACKENDS, false).expect("programming the service"))
}

#[test]
fn syn_to_service_is_rewritten_to_a_routable_backend_with_valid_checksums() {
    let Some(steered) = local() else { return };
    let outcomes = steered.maps.outcomes().unwrap();
    let frame = syn(CLIENT);

    let (action, out) = xdp(&steered, &frame, None);

    assert_eq!(action, XdpAction::Pass, "local mode hands the packet up");
    assert_eq!(out.len(), frame.len());
    let (src, dst) = packet::endpoints(&out);
    assert_eq!(src, CLIENT);
    let backend = steered.backend_of(dst).expect("rewritten to a backend");
    assert!(
        packet::checksums_verify(&out),
        "IPv4 and TCP checksums must verify after the rewrite"
    );
    // Only the destination changed: MACs, TTL and the rest are as sent.
    let differing: Vec<usize> = (0..frame.len()).filter(|&i| frame[i] != out[i]).collect();
    assert!(
        differing
            .iter()
            .all(|&i| matches!(i - packet::IPV4_OFFSET, 10..=11 | 16..=19 | 22..=23 | 36..=37)),
        "bytes other than daddr, dport and checksums changed: {differing:?}"
    );

    let moved = steered.maps.outcomes().unwrap().since(&outcomes);
    assert_eq!(moved.get(Outcome::NewFlow), 1, "{moved:?}");
    let service = steered.maps.service_stats(0).unwrap();
    assert_eq!((service.connections, service.packets), (1, 1));
    assert_eq!(service.bytes, frame.len() as u64);
    let stats = steered.maps.backend_stats(backend as u32).unwrap();
    assert_eq!((stats.connections, stats.packets), (1, 1));

    // A SYN's entry waits in the handshake table (`SYNS`), not the
    // embryonic one: the reply direction's, which restores the service on
    // the backend's SYN-ACK and holds the client's next sequence number.
    // The backend's answer moves it to the embryonic table, and the
    // forward entry is made from it then.
    assert_eq!(steered.maps.flow(&flow_key(CLIENT, VIP)).unwrap(), None);
    for key in [flow_key(CLIENT, VIP), flow_key(dst, CLIENT)] {
        assert_eq!(steered.maps.embryonic_flow(&key).unwrap(), None);
    }
    let reply = steered
        .maps
        .handshake_flow(&flow_key(dst, CLIENT))
        .unwrap()
        .expect("reply entry");
    assert_eq!(
        (reply.addr, reply.port),
        (addr_be(VIP.ip().octets()), port_be(VIP.port())),
        "the reply entry restores the service"
    );
    let syn_seq = u32::from_be_bytes(frame[packet::IPV4_OFFSET + 24..][..4].try_into().unwrap());
    assert_eq!(reply.ack, syn_seq.wrapping_add(1));

    answer(&steered, dst);
    let moved_reply = steered
        .maps
        .embryonic_flow(&flow_key(dst, CLIENT))
        .unwrap()
        .expect("the reply entry, moved to the embryonic table by the answer");
    assert_eq!((moved_reply.addr, moved_reply.ack), (reply.addr, reply.ack));
    let forward = steered
        .maps
        .embryonic_flow(&flow_key(CLIENT, VIP))
        .unwrap()
        .expect("forward entry, once the backend answered");
    assert_eq!(forward.backend, backend as u32);
    assert_eq!(forward.seq, syn_seq.wrapping_add(1));
    let moved = steered.maps.outcomes().unwrap().since(&outcomes);
    assert_eq!(moved.get(Outcome::PeerRestored), 0, "{moved:?}");
}

#[test]
fn new_flows_never_pick_an_isolated_backend_and_spread_evenly() {
    let Some(mut steered) = local() else { return };
    assert_spread(&spread(&steered, 1, None), &[], "all routable");

    // The state bit flips first; the table and the routable list still
    // list the backend.
    steered.set_state(1, BackendState::Isolated).unwrap();
    assert_spread(&spread(&steered, 2, None), &[1], "isolated, stale list");
    let before = steered.maps.service_of(&steered.service).unwrap().unwrap();
    steered.rebuild().unwrap();
    let after = steered.maps.service_of(&steered.service).unwrap().unwrap();
    assert_ne!(
        before.table_offset, after.table_offset,
        "a rebuild switches to the other table"
    );
    // Live backends stay in the table (a connection the tables lost must
    // still find its backend); only the routable list drops it.
    assert!(steered.service.table().contains(&1));
    assert!(!steered.service.routable().contains(&1));
    assert_spread(&spread(&steered, 3, None), &[1], "isolated, rebuilt list");

    steered.set_state(2, BackendState::Draining).unwrap();
    assert_spread(
        &spread(&steered, 4, None),
        &[1, 2],
        "isolated + draining, stale list",
    );

    steered.set_state(1, BackendState::Routable).unwrap();
    steered.set_state(2, BackendState::Routable).unwrap();
    // Back in the bit but not yet in the list: found through the table.
    let got = spread(&steered, 5, None);
    assert_eq!(got.iter().sum::<usize>(), FLOWS);
    steered.rebuild().unwrap();
    assert_spread(&spread(&steered, 6, None), &[], "all routable again");
}

#[test]
fn established_flow_keeps_its_backend_after_isolation() {
    let Some(mut steered) = local() else { return };
    let (_, out) = xdp(&steered, &syn(CLIENT), None);
    let (_, first) = packet::endpoints(&out);
    let chosen = steered.backend_of(first).unwrap();
    answer(&steered, first);

    steered.set_state(chosen, BackendState::Isolated).unwrap();
    steered.rebuild().unwrap();
    let before = steered.maps.outcomes().unwrap();
    for _ in 0..3 {
        let (action, out) = xdp(&steered, &ack(CLIENT), None);
        assert_eq!(action, XdpAction::Pass);
        assert_eq!(packet::endpoints(&out).1, first, "established flow moved");
        assert!(packet::checksums_verify(&out));
    }
    let moved = steered.maps.outcomes().unwrap().since(&before);
    assert_eq!(moved.get(Outcome::Established), 3, "{moved:?}");

    // A new SYN on the same addresses and port is a new connection, which
    // must not go to the isolated backend.
    let (_, out) = xdp(&steered, &syn(CLIENT), None);
    let (_, again) = packet::endpoints(&out);
    assert_ne!(
        again, first,
        "a new connection went to the isolated backend"
    );
    // ... and from then on the flow follows its new backend.
    answer(&steered, again);
    let (_, out) = xdp(&steered, &ack(CLIENT), None);
    assert_eq!(packet::endpoints(&out).1, again);
}

/// A worker whose stack still holds the four-tuple in TIME-WAIT answers a
/// new SYN with a plain ACK of the old connection. It must reach the
/// client from the service, whose stack then resets it and sends the SYN
/// again at once (untranslated, the client waits a whole retransmission
/// timeout, a second).
#[test]
fn a_workers_time_wait_ack_to_a_syn_is_restored_to_the_service() {
    let Some(steered) = local() else { return };
    let (_, out) = xdp(&steered, &syn(CLIENT), None);
    let backend = packet::endpoints(&out).1;
    let stale_ack = packet::Tcp::new(backend, CLIENT, packet::TCP_ACK, 7_000, 12_345).frame();
    let run = steered.dataplane.test_run_egress(&stale_ack).unwrap();
    assert_eq!(packet::endpoints(&run.packet), (VIP, CLIENT));
    // The client's reset goes to the worker (its stack drops the
    // TIME-WAIT), and the SYN sent again gets the same worker.
    let reset = packet::Tcp::new(CLIENT, VIP, packet::TCP_RST, 12_345, 0).frame();
    let (_, out) = xdp(&steered, &reset, None);
    assert_eq!(packet::endpoints(&out), (CLIENT, backend));
    let (_, out) = xdp(&steered, &syn(CLIENT), None);
    assert_eq!(packet::endpoints(&out).1, backend);
}

#[test]
fn a_waiting_handshake_keeps_its_way_while_other_syns_fill_its_set() {
    let Some(steered) = local() else { return };
    // `local` loads the default tables of a 65,536-entry connection table.
    let sets = LoadOptions {
        conntrack_size: 1 << 16,
        ..LoadOptions::default()
    }
    .syn_sets();
    let set_of = |key: &FlowKey| SynSet::hash(key) as u32 & (sets - 1);
    let (_, out) = xdp(&steered, &syn(CLIENT), None);
    let backend = packet::endpoints(&out).1;
    let set = set_of(&flow_key(backend, CLIENT));
    // Other clients' SYNs (each its own four-tuple) until the set's other
    // ways are all taken: with one way to a set, the first would have
    // overwritten the waiting handshake.
    let mut others = 0;
    for client in Clients(0x5eed).take(1_000_000) {
        let (_, out) = xdp(&steered, &syn(client), None);
        if set_of(&flow_key(packet::endpoints(&out).1, client)) == set {
            others += 1;
            if others == SYN_WAYS - 1 {
                break;
            }
        }
    }
    assert_eq!(others, SYN_WAYS - 1, "no SYNs of the set found");
    assert!(
        steered
            .maps
            .handshake_flow(&flow_key(backend, CLIENT))
            .unwrap()
            .is_some(),
        "the first handshake still waits"
    );
    // Its backend's SYN-ACK still gets the service as its source.
    answer(&steered, backend);
    // A fourth SYN of the set takes the oldest way: the first handshake's
    // (now answered, its entry in the embryonic table).
    for client in Clients(0xface).take(1_000_000) {
        let (_, out) = xdp(&steered, &syn(client), None);
        if set_of(&flow_key(packet::endpoints(&out).1, client)) == set {
            break;
        }
    }
    assert!(
        steered
            .maps
            .handshake_flow(&flow_key(backend, CLIENT))
            .unwrap()
            .is_none(),
        "a fourth SYN of the set took the oldest way"
    );
}

#[test]
fn a_new_handshake_replaces_what_an_abandoned_one_left() {
    let Some(mut steered) = local() else { return };
    let tcp = |src, dst, flags, seq, ack| packet::Tcp::new(src, dst, flags, seq, ack).frame();
    let syn_ack = packet::TCP_SYN | packet::TCP_ACK;
    // A handshake the backend answered and the client abandoned: its
    // forward entry stays in the embryonic table.
    let (_, out) = xdp(&steered, &tcp(CLIENT, VIP, packet::TCP_SYN, 1_000, 0), None);
    let first = packet::endpoints(&out).1;
    steered
        .dataplane
        .test_run_egress(&tcp(first, CLIENT, syn_ack, 5_000, 1_001))
        .unwrap();
    // A new connection on the four-tuple goes elsewhere (the first backend
    // isolated since) and its backend answers: the client's ACK must
    // follow the new handshake, not the entry the old one left.
    steered
        .set_state(steered.backend_of(first).unwrap(), BackendState::Isolated)
        .unwrap();
    steered.rebuild().unwrap();
    let second = second_handshake(&steered);
    assert_ne!(
        second, first,
        "a new connection went to the isolated backend"
    );
}

/// The client's next handshake on the four-tuple (initial sequence number
/// 9,000): the backend its SYN goes to answers, the answer is restored to
/// the service, and the client's ACK completes that handshake on that
/// backend (rather than following what an earlier connection left).
/// Returns the backend.
fn second_handshake(steered: &Steered) -> SocketAddrV4 {
    let tcp = |src, dst, flags, seq, ack| packet::Tcp::new(src, dst, flags, seq, ack).frame();
    let (_, out) = xdp(steered, &tcp(CLIENT, VIP, packet::TCP_SYN, 9_000, 0), None);
    let backend = packet::endpoints(&out).1;
    let syn_ack = packet::TCP_SYN | packet::TCP_ACK;
    let run = steered
        .dataplane
        .test_run_egress(&tcp(backend, CLIENT, syn_ack, 7_000, 9_001))
        .unwrap();
    assert_eq!(packet::endpoints(&run.packet), (VIP, CLIENT));
    let before = steered.maps.outcomes().unwrap();
    let (_, out) = xdp(
        steered,
        &tcp(CLIENT, VIP, packet::TCP_ACK, 9_001, 7_001),
        None,
    );
    assert_eq!(
        packet::endpoints(&out).1,
        backend,
        "the ACK followed the old entry"
    );
    let moved = steered.maps.outcomes().unwrap().since(&before);
    assert_eq!(
        moved.get(Outcome::Promoted),
        1,
        "the new handshake did not complete: {moved:?}"
    );
    backend
}

#[test]
fn a_new_handshake_on_the_same_backend_replaces_an_open_connection() {
    let Some(mut steered) = local() else { return };
    let tcp = |src, dst, flags, seq, ack| packet::Tcp::new(src, dst, flags, seq, ack).frame();
    let syn_ack = packet::TCP_SYN | packet::TCP_ACK;
    // One routable backend, so that both connections go to it and their
    // reply entries share a key.
    for i in 1..BACKENDS.len() {
        steered.set_state(i, BackendState::Isolated).unwrap();
    }
    steered.rebuild().unwrap();
    let backend = BACKENDS[0];
    // A connection that never closed here (the client's host restarted).
    let (_, out) = xdp(&steered, &tcp(CLIENT, VIP, packet::TCP_SYN, 1_000, 0), None);
    assert_eq!(packet::endpoints(&out).1, backend);
    steered
        .dataplane
        .test_run_egress(&tcp(backend, CLIENT, syn_ack, 5_000, 1_001))
        .unwrap();
    xdp(
        &steered,
        &tcp(CLIENT, VIP, packet::TCP_ACK, 1_001, 5_001),
        None,
    );
    assert_eq!(steered.maps.outcomes().unwrap().get(Outcome::Promoted), 1);
    // The client opens a new connection on the same four-tuple. The
    // backend's answer is the new handshake's (restored, and it replaces
    // the open connection's entries), so the client's ACK completes it
    // rather than riding the old entry.
    assert_eq!(second_handshake(&steered), backend);
}

#[test]
fn unknown_flow_is_recovered_onto_its_live_backend() {
    let Some(steered) = local() else { return };
    // An ACK without a SYN seen first (the tables lost it, or the
    // connection started before the agent) gets the backend at its hash's
    // first table slot, and embryonic entries until the backend answers.
    let (action, out) = xdp(&steered, &ack(CLIENT), None);
    assert_eq!(action, XdpAction::Pass);
    let (_, dst) = packet::endpoints(&out);
    assert!(steered.backend_of(dst).is_some());
    let outcomes = steered.maps.outcomes().unwrap();
    assert_eq!(
        (
            outcomes.get(Outcome::Recovered),
            outcomes.get(Outcome::NewFlow)
        ),
        (1, 0)
    );
    assert_eq!(
        steered.maps.service_stats(0).unwrap().connections,
        0,
        "only SYNs count as new connections"
    );
    let forward = steered.maps.embryonic_flow(&flow_key(CLIENT, VIP)).unwrap();
    assert!(forward.is_some_and(|f| f.flags & FLAG_RECOVERED != 0));
}

#[test]
fn reply_is_restored_to_the_service_address_on_egress() {
    let Some(steered) = local() else { return };
    let (_, out) = xdp(&steered, &syn(CLIENT), None);
    let (_, backend) = packet::endpoints(&out);
    let index = steered.backend_of(backend).unwrap() as u32;

    let syn_ack = packet::tcp_frame(backend, CLIENT, packet::TCP_SYN | packet::TCP_ACK);
    let run = steered.dataplane.test_run_egress(&syn_ack).unwrap();
    assert_eq!(run.code, 0, "TC_ACT_OK");
    assert_eq!(packet::endpoints(&run.packet), (VIP, CLIENT));
    assert!(packet::checksums_verify(&run.packet));
    assert_eq!(steered.maps.outcomes().unwrap().get(Outcome::Reply), 1);
    assert_eq!(steered.maps.backend_stats(index).unwrap().reply_packets, 1);

    // Other traffic leaves untouched: the backend talking to someone else,
    // and someone else using a backend's port.
    let stranger = SocketAddrV4::new(Ipv4Addr::new(10, 99, 1, 3), 40_001);
    for frame in [
        packet::tcp_frame(backend, stranger, packet::TCP_ACK),
        packet::tcp_frame(
            SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 99), backend.port()),
            CLIENT,
            packet::TCP_ACK,
        ),
        packet::udp_frame(backend, CLIENT, b"x"),
    ] {
        let run = steered.dataplane.test_run_egress(&frame).unwrap();
        assert_eq!((run.code, &run.packet), (0, &frame));
    }
    assert_eq!(steered.maps.outcomes().unwrap().get(Outcome::Reply), 1);
}

#[test]
fn closed_connection_stops_restoring_replies() {
    let Some(steered) = local() else { return };
    let open = |steered: &Steered| {
        let (_, out) = xdp(steered, &syn(CLIENT), None);
        let backend = packet::endpoints(&out).1;
        answer(steered, backend);
        backend
    };
    let close = |steered: &Steered, backend: SocketAddrV4| {
        let fin_ack = packet::TCP_FIN | packet::TCP_ACK;
        let (_, out) = xdp(steered, &packet::tcp_frame(CLIENT, VIP, fin_ack), None);
        assert_eq!(
            packet::endpoints(&out).1,
            backend,
            "the client's FIN is steered"
        );
        let run = steered
            .dataplane
            .test_run_egress(&packet::tcp_frame(backend, CLIENT, fin_ack))
            .unwrap();
        assert_eq!(
            packet::endpoints(&run.packet).0,
            VIP,
            "the backend's FIN is restored"
        );
    };

    // Within the grace period the last ACKs still go through, but a SYN-ACK
    // from the backend opens a connection this balancer did not steer.
    let backend = open(&steered);
    close(&steered, backend);
    let (_, out) = xdp(&steered, &ack(CLIENT), None);
    assert_eq!(packet::endpoints(&out).1, backend, "the client's last ACK");
    let syn_ack = packet::tcp_frame(backend, CLIENT, packet::TCP_SYN | packet::TCP_ACK);
    let run = steered.dataplane.test_run_egress(&syn_ack).unwrap();
    assert_eq!(
        run.packet, syn_ack,
        "a SYN-ACK after the close was rewritten"
    );
    assert_eq!(steered.maps.flow(&flow_key(backend, CLIENT)).unwrap(), None);

    // Past the grace period nothing of the old connection is rewritten.
    let backend = open(&steered);
    close(&steered, backend);
    std::thread::sleep(Duration::from_millis(2_400));
    let late = packet::tcp_frame(backend, CLIENT, packet::TCP_ACK);
    let run = steered.dataplane.test_run_egress(&late).unwrap();
    assert_eq!(
        run.packet, late,
        "a reply long after the close was rewritten"
    );

    // A new connection on the same four-tuple starts afresh.
    let backend = open(&steered);
    let reply = packet::tcp_frame(backend, CLIENT, packet::TCP_SYN | packet::TCP_ACK);
    let run = steered.dataplane.test_run_egress(&reply).unwrap();
    assert_eq!(packet::endpoints(&run.packet), (VIP, CLIENT));
}

#[test]
fn no_routable_backend_passes_to_the_local_stack_and_counts() {
    let Some(mut steered) = local() else { return };
    for i in 0..BACKENDS.len() {
        steered.set_state(i, BackendState::Isolated).unwrap();
    }
    let frame = syn(CLIENT);
    let (action, out) = xdp(&steered, &frame, None);
    assert_eq!((action, &out), (XdpAction::Pass, &frame));
    steered.rebuild().unwrap();
    let entry = steered.maps.service_of(&steered.service).unwrap().unwrap();
    assert_eq!(
        (entry.table_size, entry.backend_count),
        (balancer_tests::l4::TABLE_SIZE, 0),
        "the table keeps the live backends, the routable list is empty"
    );
    let (action, out) = xdp(&steered, &frame, None);
    assert_eq!((action, &out), (XdpAction::Pass, &frame));
    assert_eq!(steered.maps.outcomes().unwrap().get(Outcome::NoBackend), 2);
    assert_eq!(steered.maps.service_stats(0).unwrap().no_backend, 2);
}

fn verdict_delta(after: &VerdictCounts, before: &VerdictCounts, verdict: Verdict) -> u64 {
    after.since(before).get(verdict)
}

#[test]
fn other_packets_pass_untouched_and_are_counted_by_reason() {
    let Some(steered) = local() else { return };
    let vip_tcp = Ipv4::new(*CLIENT.ip(), *VIP.ip(), packet::PROTO_TCP);
    let mut fragment = vip_tcp.clone();
    fragment.flags_fragment = packet::MORE_FRAGMENTS;
    let full = syn(CLIENT);
    let other_port = SocketAddrV4::new(*VIP.ip(), 81);
    let other_host = SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 101), VIP.port());

    let cases: Vec<(&str, Vec<u8>, Verdict, Option<Outcome>)> = vec![
        (
            "TCP to the service address on another port",
            packet::tcp_frame(CLIENT, other_port, packet::TCP_SYN),
            Verdict::TcpSyn,
            Some(Outcome::NotService),
        ),
        (
            "TCP to the service port on another address",
            packet::tcp_frame(CLIENT, other_host, packet::TCP_SYN),
            Verdict::TcpSyn,
            Some(Outcome::NotService),
        ),
        (
            "UDP to the service",
            packet::udp_frame(CLIENT, VIP, b"hello"),
            Verdict::PassNotTcp,
            None,
        ),
        (
            "fragment to the service",
            packet::ethernet(
                packet::ETHERTYPE_IPV4,
                &fragment.packet(&packet::tcp(CLIENT, VIP, packet::TCP_SYN)),
            ),
            Verdict::PassFragment,
            None,
        ),
        (
            "truncated TCP to the service",
            full[..full.len() - 4].to_vec(),
            Verdict::PassTruncated,
            None,
        ),
        (
            "ARP",
            packet::ethernet(packet::ETHERTYPE_ARP, &[0; 28]),
            Verdict::PassNotIpv4,
            None,
        ),
    ];
    for (name, frame, verdict, outcome) in cases {
        let verdicts = steered.dataplane.verdict_counts().unwrap();
        let outcomes = steered.maps.outcomes().unwrap();
        let (action, out) = xdp(&steered, &frame, None);
        assert_eq!(action, XdpAction::Pass, "{name}");
        assert_eq!(out, frame, "{name}: modified");
        let after = steered.dataplane.verdict_counts().unwrap();
        assert_eq!(verdict_delta(&after, &verdicts, verdict), 1, "{name}");
        assert_eq!(after.since(&verdicts).total(), 1, "{name}");
        let moved = steered.maps.outcomes().unwrap().since(&outcomes);
        let total: u64 = moved.iter().map(|(_, n)| n).sum();
        match outcome {
            Some(outcome) => assert_eq!((moved.get(outcome), total), (1, 1), "{name}: {moved:?}"),
            None => assert_eq!(total, 0, "{name}: {moved:?}"),
        }
    }
    assert_eq!(steered.maps.flow_count(), 0, "nothing may enter the table");
}

// ---- remote mode ------------------------------------------------------

const STEP: Duration = Duration::from_secs(30);

#[test]
fn remote_mode_redirects_rewritten_packets_and_restores_replies() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let backend_ips: Vec<Ipv4Addr> = BACKENDS.iter().map(|b| *b.ip()).collect();
    Router::run("bt-l4tr", *CLIENT.ip(), &backend_ips, STEP, move |net| {
        remote_checks(&object, &net)
    });
}

fn remote_checks(object: &std::path::Path, net: &Router) -> Result<()> {
    let mut steered = Steered::load(object, VIP, &BACKENDS, true)?;
    let from_client = Some(net.client_if);

    // A SYN: rewritten, TTL down by one, MACs of the next hop, redirected
    // to the backends' interface.
    let frame = syn(CLIENT);
    let (action, out) = xdp(&steered, &frame, from_client);
    ensure!(action == XdpAction::Redirect, "SYN: {action:?}");
    let (src, backend) = packet::endpoints(&out);
    let index = steered
        .backend_of(backend)
        .context("not rewritten to a backend")?;
    ensure!(src == CLIENT, "source changed to {src}");
    ensure!(
        packet::checksums_verify(&out),
        "checksums after the rewrite"
    );
    ensure!(
        packet::ttl(&out) == packet::ttl(&frame) - 1,
        "TTL not decremented"
    );
    ensure!(
        out[..6] == Router::BACKEND_MAC,
        "destination MAC {:02x?}",
        &out[..6]
    );
    ensure!(
        out[6..12] == net.backend_if_mac,
        "source MAC {:02x?}",
        &out[6..12]
    );
    let hop = steered.maps.next_hop(index as u32)?;
    ensure!(
        hop.ifindex == net.backend_if && hop.generation == 1,
        "next hop not cached: {hop:?}"
    );

    // The rest of the connection goes the same way, from the cache.
    let (action, out) = xdp(&steered, &ack(CLIENT), from_client);
    ensure!(action == XdpAction::Redirect && packet::endpoints(&out).1 == backend);
    ensure!(packet::checksums_verify(&out));

    // The backend's answer, arriving on its interface: the service address
    // back, and on to the client's interface.
    let syn_ack = packet::tcp_frame(backend, CLIENT, packet::TCP_SYN | packet::TCP_ACK);
    let (action, out) = xdp(&steered, &syn_ack, Some(net.backend_if));
    ensure!(action == XdpAction::Redirect, "reply: {action:?}");
    ensure!(
        packet::endpoints(&out) == (VIP, CLIENT),
        "reply not restored"
    );
    ensure!(packet::checksums_verify(&out), "reply checksums");
    ensure!(
        out[..6] == Router::CLIENT_MAC && out[6..12] == net.client_if_mac,
        "reply MACs"
    );

    // Isolation holds here too, and the established flow stays.
    steered.set_state(index, BackendState::Isolated)?;
    let (_, out) = xdp(&steered, &ack(CLIENT), from_client);
    ensure!(
        packet::endpoints(&out).1 == backend,
        "established flow moved"
    );
    check_spread(
        &spread(&steered, 7, from_client),
        &[index],
        "remote, isolated",
    )?;

    // A backend reachable back out of the interface the packet came in on
    // is sent with XDP_TX.
    let (action, _) = xdp(&steered, &syn(CLIENT), Some(net.backend_if));
    ensure!(action == XdpAction::Tx, "same interface: {action:?}");

    // No neighbour for the destination: rewritten, but left to the kernel.
    let lost = SocketAddrV4::new(Ipv4Addr::new(10, 99, 1, 77), 40_000);
    let reply_to_lost = {
        let (_, out) = xdp(&steered, &syn(lost), from_client);
        let (_, backend) = packet::endpoints(&out);
        packet::tcp_frame(backend, lost, packet::TCP_SYN | packet::TCP_ACK)
    };
    let before = steered.maps.outcomes()?;
    let (action, out) = xdp(&steered, &reply_to_lost, Some(net.backend_if));
    ensure!(action == XdpAction::Pass, "unresolved: {action:?}");
    ensure!(packet::endpoints(&out).0 == VIP && packet::checksums_verify(&out));
    let moved = steered.maps.outcomes()?.since(&before);
    ensure!(moved.get(Outcome::Unresolved) == 1, "{moved:?}");

    // A TTL that would expire is answered with ICMP time exceeded (the
    // fixture table checks the answer byte by byte).
    let mut dying = syn(CLIENT);
    dying[packet::IPV4_OFFSET + 8] = 1;
    let (action, _) = xdp(&steered, &dying, from_client);
    ensure!(action == XdpAction::Tx, "TTL 1: {action:?}");
    ensure!(steered.maps.outcomes()?.get(Outcome::TtlExpired) == 1);
    Ok(())
}

/// The agent's side of dual stack: an IPv6 service and backend go to their
/// family's maps, beside IPv4 ones in the shared slot spaces, and read back
/// by address (what adoption and `balancer l4 status` rely on).
#[test]
fn ipv6_services_and_backends_are_kept_in_their_family_maps() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let mut dataplane = Dataplane::load_with(
        &object,
        LoadOptions {
            table_size: TABLE_SIZE,
            services: 2,
            conntrack_size: 1024,
        },
    )
    .unwrap();
    let maps = dataplane.take_l4_maps().unwrap();
    let vip6: SocketAddr = "[fd77::100]:80".parse().unwrap();
    let backend6: SocketAddr = "[fd77:0:0:2::11]:8000".parse().unwrap();
    let mut v4 = maps.add_service(VIP, 0, 0).unwrap();
    let mut v6 = maps.add_service(vip6, 1, 0).unwrap();
    // One service of each family on port 80: each has it to itself.
    assert_eq!(maps.sole_service::<u32>(80).unwrap(), Some(0));
    assert_eq!(maps.sole_service::<Addr6>(80).unwrap(), Some(1));
    maps.set_backend_state(0, BACKENDS[0], BackendState::Routable)
        .unwrap();
    maps.set_backend_state(1, backend6, BackendState::Isolated)
        .unwrap();
    assert_eq!(
        maps.live_backends().unwrap(),
        [(0, SocketAddr::from(BACKENDS[0])), (1, backend6)]
    );
    assert_eq!(
        maps.backend_state(1, backend6).unwrap(),
        BackendState::Isolated
    );
    // Slot 1 is the IPv6 backend's: the IPv4 map has nothing there.
    assert_eq!(
        maps.backend_state(1, BACKENDS[1].into()).unwrap(),
        BackendState::Unused
    );

    let member = |index, addr| Member {
        index,
        key: maglev::member_key(addr),
    };
    let table4 = maglev::build(&[member(0, BACKENDS[0].into())], TABLE_SIZE);
    let table6 = maglev::build(&[member(1, backend6)], TABLE_SIZE);
    let slot = || sole_of::<u32>(maps.port_bits(80).unwrap());
    let before = slot();
    maps.update_service(&mut v4, &[0], Some(&table4)).unwrap();
    // The new copy went into the service's other slot, which the port now
    // names: packets that read the old one kept reading a whole copy.
    let after = slot();
    assert_ne!(before, after, "the copy was rewritten in place");
    assert_eq!((before - 1) / 2, (after - 1) / 2, "another service's slot");
    maps.update_service(&mut v6, &[], Some(&table6)).unwrap();
    let entry = maps.service_of(&v6).unwrap().expect("the IPv6 service");
    assert_eq!(
        (entry.index, entry.table_size, entry.backend_count),
        (1, TABLE_SIZE, 0)
    );
    assert_eq!(v6.table(), table6.as_slice());
    let entry = maps.service_of(&v4).unwrap().expect("the IPv4 service");
    assert_eq!((entry.index, entry.backend_count), (0, 1));
    assert_ne!(v4.table(), v6.table(), "each family has its own table");

    // Adoption's clean-up works per family too.
    maps.retain_services(std::slice::from_ref(&v6)).unwrap();
    assert!(maps.service_of(&v4).unwrap().is_none());
    assert!(maps.service_of(&v6).unwrap().is_some());
    assert_eq!(maps.sole_service::<u32>(80).unwrap(), None);
    assert_eq!(maps.sole_service::<Addr6>(80).unwrap(), Some(1));
}

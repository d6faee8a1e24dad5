//! IPv6 L4 steering (local mode) run on crafted frames through
//! BPF_PROG_TEST_RUN: the XDP program tail-calls its IPv6 program, which
//! sends a SYN to the backend Maglev gives its flow, keeps the connection
//! there through the handshake and its data (the TC program restoring the
//! service address on the backend's answer), with valid TCP checksums; and
//! what IPv6 steering leaves to the kernel (extension headers, ICMPv6
//! neighbour discovery, anything but TCP) passes untouched and counted.

use std::net::SocketAddrV6;

use balancer_common::Verdict;
use balancer_common::l4::{Addr6, BackendState, FlowKey, Outcome, addr6_be, flow_hash, port_be};
use balancer_dataplane::XdpAction;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4::{Steered, TABLE_SIZE};
use balancer_tests::packet::{self, IPV6_HEADER_LEN, IPV6_OFFSET, v6};

const VIP: SocketAddrV6 = v6([0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 0x100], 80);
const CLIENT: SocketAddrV6 = v6([0x2001, 0xdb8, 1, 0, 0, 0, 0, 2], 40_000);
const BACKENDS: [SocketAddrV6; 3] = [
    v6([0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x11], 8000),
    v6([0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x12], 8001),
    v6([0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x13], 8002),
];

fn local() -> Option<Steered<SocketAddrV6>> {
    let object = ebpf_prerequisites()?;
    Some(Steered::load(&object, VIP, &BACKENDS, false).expect("programming the service"))
}

fn key(src: SocketAddrV6, dst: SocketAddrV6) -> FlowKey<Addr6> {
    FlowKey::tcp(
        addr6_be(src.ip().octets()),
        port_be(src.port()),
        addr6_be(dst.ip().octets()),
        port_be(dst.port()),
    )
}

/// The backend a SYN from `client` gets while every backend is routable:
/// the table slot of its flow hash.
fn chosen(steered: &Steered<SocketAddrV6>, client: SocketAddrV6) -> SocketAddrV6 {
    let k = key(client, VIP);
    let hash = flow_hash(k.src_addr, k.src_port, k.dst_addr, k.dst_port);
    let index = steered.service.table()[(hash % u64::from(TABLE_SIZE)) as usize];
    steered.backends[index as usize]
}

fn xdp(steered: &Steered<SocketAddrV6>, frame: &[u8]) -> (XdpAction, Vec<u8>) {
    let run = steered
        .dataplane
        .test_run(frame, 1, None)
        .expect("test run");
    (run.action, run.packet)
}

#[test]
fn syn_to_an_ipv6_service_goes_to_its_maglev_backend_with_a_valid_checksum() {
    let Some(steered) = local() else { return };
    let outcomes = steered.maps.outcomes().unwrap();
    let frame = packet::tcp6_frame(CLIENT, VIP, packet::TCP_SYN, 1000, 0, &[]);

    let (action, out) = xdp(&steered, &frame);

    assert_eq!(action, XdpAction::Pass, "local mode hands the packet up");
    assert_eq!(out.len(), frame.len());
    let (src, dst) = packet::endpoints6(&out);
    assert_eq!(src, CLIENT);
    assert_eq!(dst, chosen(&steered, CLIENT), "the flow's Maglev backend");
    assert!(
        packet::checksum6_verifies(&out),
        "TCP checksum after rewrite"
    );
    // Only the destination address and port and the TCP checksum changed.
    let l4 = IPV6_OFFSET + IPV6_HEADER_LEN;
    let differing: Vec<usize> = (0..frame.len()).filter(|&i| frame[i] != out[i]).collect();
    assert!(
        differing
            .iter()
            .all(|&i| (IPV6_OFFSET + 24..IPV6_OFFSET + 40).contains(&i)
                || (l4 + 2..l4 + 4).contains(&i)
                || (l4 + 16..l4 + 18).contains(&i)),
        "bytes {differing:?} changed"
    );
    let after = steered.maps.outcomes().unwrap().since(&outcomes);
    assert_eq!(after.get(Outcome::NewFlow), 1);
}

/// An isolated IPv6 backend gets no new connection: SYNs whose slot is
/// its go to routable backends, and it is chosen again once routable.
#[test]
fn an_isolated_ipv6_backend_gets_no_new_connection() {
    let Some(mut steered) = local() else { return };
    let clients: Vec<SocketAddrV6> = (0..60u16)
        .map(|i| v6([0x2001, 0xdb8, 1, 0, 0, 0, 0, 2 + i], 40_000 + i))
        .collect();
    let isolated = chosen(&steered, clients[0]);
    let i = BACKENDS.iter().position(|b| *b == isolated).unwrap();
    steered.set_state(i, BackendState::Isolated).unwrap();
    steered.rebuild().unwrap();
    // clients[0]'s slot is the isolated backend's: at least one SYN is moved.
    for client in &clients {
        let syn = packet::tcp6_frame(*client, VIP, packet::TCP_SYN, 1000, 0, &[]);
        let (action, out) = xdp(&steered, &syn);
        assert_eq!(action, XdpAction::Pass);
        let to = packet::endpoints6(&out).1;
        assert_ne!(to, isolated, "a new connection from {client} reached it");
        assert!(BACKENDS.contains(&to));
    }
    steered.set_state(i, BackendState::Routable).unwrap();
    steered.rebuild().unwrap();
    let fresh = v6([0x2001, 0xdb8, 1, 0, 0, 0, 1, 2], 50_000);
    let syn = packet::tcp6_frame(fresh, VIP, packet::TCP_SYN, 1000, 0, &[]);
    let expected = chosen(&steered, fresh);
    assert_eq!(packet::endpoints6(&xdp(&steered, &syn).1).1, expected);
}

#[test]
fn an_ipv6_handshake_and_its_data_stay_on_one_backend() {
    let Some(steered) = local() else { return };
    let backend = chosen(&steered, CLIENT);
    let syn = packet::tcp6_frame(CLIENT, VIP, packet::TCP_SYN, 1000, 0, &[]);
    let (_, out) = xdp(&steered, &syn);
    assert_eq!(packet::endpoints6(&out).1, backend);

    // The backend answers from its own address; TC egress gives the
    // answer the service's back.
    let syn_ack = packet::tcp6_frame(
        backend,
        CLIENT,
        packet::TCP_SYN | packet::TCP_ACK,
        5000,
        1001,
        &[],
    );
    let reply = steered.dataplane.test_run_egress(&syn_ack).unwrap();
    assert_eq!(packet::endpoints6(&reply.packet), (VIP, CLIENT));
    assert!(packet::checksum6_verifies(&reply.packet));

    let outcomes = steered.maps.outcomes().unwrap();
    let ack = packet::tcp6_frame(CLIENT, VIP, packet::TCP_ACK, 1001, 5001, &[]);
    let (action, out) = xdp(&steered, &ack);
    assert_eq!(action, XdpAction::Pass);
    assert_eq!(packet::endpoints6(&out), (CLIENT, backend));
    assert!(packet::checksum6_verifies(&out));
    let after = steered.maps.outcomes().unwrap().since(&outcomes);
    assert_eq!(after.get(Outcome::Promoted), 1, "the ACK completes it");
    assert!(
        steered.maps.flow(&key(CLIENT, VIP)).unwrap().is_some(),
        "the connection is established"
    );

    let outcomes = steered.maps.outcomes().unwrap();
    let data = packet::tcp6_frame(CLIENT, VIP, packet::TCP_ACK, 1001, 5001, b"hello");
    let (_, out) = xdp(&steered, &data);
    assert_eq!(packet::endpoints6(&out), (CLIENT, backend));
    assert!(packet::checksum6_verifies(&out));
    let after = steered.maps.outcomes().unwrap().since(&outcomes);
    assert_eq!(
        after.get(Outcome::Established),
        1,
        "from the connection table"
    );
}

/// IPv6 next-header values of the extension headers below (RFC 8200).
const IPV6_ROUTING: u8 = 43;
const IPV6_FRAGMENT: u8 = 44;
const IPV6_DESTINATION_OPTIONS: u8 = 60;

#[test]
fn extension_headers_neighbour_discovery_and_non_tcp_pass_untouched() {
    let Some(steered) = local() else { return };
    let segment = packet::tcp6(CLIENT, VIP, packet::TCP_SYN, 1000, 0, &[]);
    // An 8-byte extension header before TCP: hop-by-hop and destination
    // options (one PadN of 4), a routing header (type 4, no segments
    // left), a fragment header (the first fragment, more to come).
    let before_tcp = |header: [u8; 7]| {
        let mut extended = vec![packet::PROTO_TCP];
        extended.extend_from_slice(&header);
        extended.extend_from_slice(&segment);
        extended
    };
    let options = before_tcp([0, 1, 4, 0, 0, 0, 0]);
    let routing = before_tcp([0, 4, 0, 0, 0, 0, 0]);
    let fragment = before_tcp([0, 0, 1, 0, 0, 0, 7]);
    // A neighbour solicitation for the service's address.
    let mut solicitation = vec![packet::ICMPV6_NEIGHBOR_SOLICITATION, 0, 0, 0, 0, 0, 0, 0];
    solicitation.extend_from_slice(&VIP.ip().octets());
    let udp = packet::udp(CLIENT, VIP, b"ping");
    let frame = |next_header: u8, payload: &[u8]| {
        packet::ethernet(
            packet::ETHERTYPE_IPV6,
            &packet::ipv6_packet(*CLIENT.ip(), *VIP.ip(), next_header, payload),
        )
    };
    for (what, input, verdict) in [
        (
            "hop-by-hop options",
            frame(packet::IPV6_HOP_BY_HOP, &options),
            Verdict::PassExtHeader,
        ),
        (
            "destination options",
            frame(IPV6_DESTINATION_OPTIONS, &options),
            Verdict::PassExtHeader,
        ),
        (
            "routing header",
            frame(IPV6_ROUTING, &routing),
            Verdict::PassExtHeader,
        ),
        (
            "fragment header",
            frame(IPV6_FRAGMENT, &fragment),
            Verdict::PassFragment,
        ),
        (
            "neighbour solicitation",
            frame(packet::PROTO_ICMPV6, &solicitation),
            Verdict::PassNotTcp,
        ),
        ("UDP", frame(packet::PROTO_UDP, &udp), Verdict::PassNotTcp),
    ] {
        let before = steered.dataplane.verdict_counts().unwrap();
        let outcomes = steered.maps.outcomes().unwrap();
        let (action, out) = xdp(&steered, &input);
        assert_eq!(action, XdpAction::Pass, "{what}");
        assert_eq!(out, input, "{what} must pass untouched");
        let counted = steered.dataplane.verdict_counts().unwrap().since(&before);
        assert_eq!(
            counted.iter().filter(|&(_, n)| n != 0).collect::<Vec<_>>(),
            [(verdict, 1)],
            "{what}"
        );
        let steered_any = steered.maps.outcomes().unwrap().since(&outcomes);
        assert!(
            steered_any.iter().all(|(_, n)| n == 0),
            "{what} reached steering: {steered_any:?}"
        );
    }
}

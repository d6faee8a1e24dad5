//! The XDP program run on crafted frames through BPF_PROG_TEST_RUN: each
//! frame must pass and move exactly one verdict counter.

use std::net::{Ipv4Addr, SocketAddrV4};

use balancer_common::Verdict;
use balancer_dataplane::{Dataplane, VerdictCounts, XdpAction};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::packet::{self, Ipv4};

const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 10), 40_000);
const SERVICE: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 8080);

fn tcp_with_ip(ip: &Ipv4, flags: u8) -> Vec<u8> {
    packet::ethernet(
        packet::ETHERTYPE_IPV4,
        &ip.packet(&packet::tcp(CLIENT, SERVICE, flags)),
    )
}

fn tcp_ip() -> Ipv4 {
    Ipv4::new(*CLIENT.ip(), *SERVICE.ip(), packet::PROTO_TCP)
}

/// Each case: a name, the frame, and the one verdict it must be counted as.
fn cases() -> Vec<(&'static str, Vec<u8>, Verdict)> {
    let syn = packet::tcp_frame(CLIENT, SERVICE, packet::TCP_SYN);

    let mut with_options = tcp_ip();
    // Two NOPs and an end-of-options list, padded: moves TCP to offset 38.
    with_options.options = vec![1, 1, 0, 0];

    let mut first_fragment = tcp_ip();
    first_fragment.flags_fragment = packet::MORE_FRAGMENTS;
    let mut later_fragment = tcp_ip();
    later_fragment.flags_fragment = 3; // offset 24 bytes, last fragment

    let mut bad_ihl = syn.clone();
    bad_ihl[packet::IPV4_OFFSET] = 0x44;
    let mut ipv6_version = syn.clone();
    ipv6_version[packet::IPV4_OFFSET] = 0x65;

    vec![
        ("TCP SYN", syn.clone(), Verdict::TcpSyn),
        (
            "TCP SYN behind IPv4 options",
            tcp_with_ip(&with_options, packet::TCP_SYN),
            Verdict::TcpSyn,
        ),
        (
            "TCP SYN-ACK",
            packet::tcp_frame(CLIENT, SERVICE, packet::TCP_SYN | packet::TCP_ACK),
            Verdict::TcpOther,
        ),
        (
            "TCP ACK",
            packet::tcp_frame(CLIENT, SERVICE, packet::TCP_ACK),
            Verdict::TcpOther,
        ),
        (
            "TCP FIN-ACK",
            packet::tcp_frame(CLIENT, SERVICE, packet::TCP_FIN | packet::TCP_ACK),
            Verdict::TcpOther,
        ),
        (
            "UDP",
            packet::udp_frame(CLIENT, SERVICE, b"hello"),
            Verdict::PassNotTcp,
        ),
        (
            "ARP",
            packet::ethernet(packet::ETHERTYPE_ARP, &[0; 28]),
            Verdict::PassNotIpv4,
        ),
        (
            // Next header 0x60: no protocol steering knows.
            "IPv6, unknown next header",
            packet::ethernet(packet::ETHERTYPE_IPV6, &[0x60; 40]),
            Verdict::PassNotTcp,
        ),
        (
            "first fragment",
            tcp_with_ip(&first_fragment, packet::TCP_SYN),
            Verdict::PassFragment,
        ),
        (
            "later fragment",
            packet::ethernet(packet::ETHERTYPE_IPV4, &later_fragment.packet(&[0; 8])),
            Verdict::PassFragment,
        ),
        ("IHL below 5", bad_ihl, Verdict::PassMalformed),
        (
            "IP version 6 in an IPv4 frame",
            ipv6_version,
            Verdict::PassMalformed,
        ),
        (
            // The kernel refuses test frames shorter than an Ethernet header,
            // so the shortest truncation it can be shown is a cut IPv4 header.
            "IPv4 header cut short",
            syn[..packet::IPV4_OFFSET + 10].to_vec(),
            Verdict::PassTruncated,
        ),
        (
            "TCP header cut short",
            syn[..syn.len() - 4].to_vec(),
            Verdict::PassTruncated,
        ),
        (
            "TCP header cut short behind IPv4 options",
            {
                let frame = tcp_with_ip(&with_options, packet::TCP_SYN);
                frame[..frame.len() - 1].to_vec()
            },
            Verdict::PassTruncated,
        ),
    ]
}

fn expect_only(verdict: Verdict, by: u64) -> Vec<(Verdict, u64)> {
    Verdict::ALL
        .into_iter()
        .map(|v| (v, if v == verdict { by } else { 0 }))
        .collect()
}

fn deltas(after: &VerdictCounts, before: &VerdictCounts) -> Vec<(Verdict, u64)> {
    after.since(before).iter().collect()
}

#[test]
fn every_frame_passes_and_counts_under_its_verdict() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let dataplane = Dataplane::load(&object).expect("loading the XDP program");

    for (name, frame, verdict) in cases() {
        let before = dataplane.verdict_counts().expect("reading counters");
        let run = dataplane
            .test_run(&frame, 1, None)
            .unwrap_or_else(|error| panic!("{name}: test run failed: {error:?}"));
        let after = dataplane.verdict_counts().expect("reading counters");

        assert_eq!(run.action, XdpAction::Pass, "{name}");
        assert_eq!(
            run.packet, frame,
            "{name}: the program must not modify the frame"
        );
        assert_eq!(
            deltas(&after, &before),
            expect_only(verdict, 1),
            "{name}: counter deltas"
        );
    }
}

#[test]
fn repeated_runs_count_every_run() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let dataplane = Dataplane::load(&object).expect("loading the XDP program");
    let syn = packet::tcp_frame(CLIENT, SERVICE, packet::TCP_SYN);

    let before = dataplane.verdict_counts().expect("reading counters");
    // Arriving on `lo` (ifindex 1) explicitly exercises the ctx_in path that
    // benchmarks use to pick the ingress device.
    let run = dataplane
        .test_run(&syn, 1000, Some(1))
        .expect("test run with repeat and ingress ifindex");
    let after = dataplane.verdict_counts().expect("reading counters");

    assert_eq!(run.action, XdpAction::Pass);
    assert_eq!(deltas(&after, &before), expect_only(Verdict::TcpSyn, 1000));
    assert_eq!(after.since(&before).total(), 1000);
}

/// Every program of the object loads, and says how much of the verifier's
/// budget (a million instructions walked per program) it took: printed,
/// for the record of what a change costs (`--nocapture`).
#[test]
fn every_program_reports_its_verified_instructions() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let dataplane = Dataplane::load(&object).expect("loading the programs");
    let counts = dataplane.verified_instructions();
    for (name, count) in &counts {
        eprintln!("{name}: {count:?} instructions verified");
        let count = count.unwrap_or_else(|| panic!("{name}: the kernel did not say"));
        assert!(count > 0 && count < 1_000_000, "{name}: {count}");
    }
    let names: Vec<&str> = counts.iter().map(|(name, _)| name.as_str()).collect();
    for program in [
        balancer_common::PROGRAM_NAME,
        balancer_common::l4::IPV6_PROGRAM_NAME,
        balancer_common::l4::ICMP6_PROGRAM_NAME,
        balancer_common::l4::EGRESS_PROGRAM_NAME,
    ] {
        assert!(names.contains(&program), "{program} missing from {names:?}");
    }
}

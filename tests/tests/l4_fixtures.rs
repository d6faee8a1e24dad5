//! The datapath's behaviour as a table of fixtures, in the style of
//! Katran's tests: each step is a packet in, the verdict expected, the
//! packet expected out (byte for byte, built independently with
//! `balancer_tests::packet`, whose checksums are computed from scratch, and
//! checked to verify on their own), and the L4 outcomes it must count.
//! Steps run in order through `BPF_PROG_TEST_RUN` against one set of maps,
//! so a table tells the story of a connection: handshake, eviction of one
//! direction, a draining backend, forged resets, ICMP errors, IPv4 options,
//! VLAN tags, TTL and MTU; and for IPv6 (the `*_ipv6` tables) the same
//! story with ICMPv6, neighbour discovery, hop limit and Packet Too Big.
//! The connection's part of the story is told once for both families
//! (`connection_steps`, with the family's frames); each family's table
//! adds only what is its own.
//!
//! Which backend a connection gets is computed here from the Maglev table
//! and the flow hash, not read back from the program. Remote-mode steps run
//! in a namespace the test creates (`Router`), where next hops are real.

use std::fmt::Debug;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use balancer_common::Verdict;
use balancer_common::l4::{
    Addr6, BackendState, Flow, FlowKey, Outcome, addr_be, addr6_be, flow_hash, port_be,
};
use balancer_dataplane::l4::Family;
use balancer_dataplane::{LoadOptions, XdpAction};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::l4::{Router, Steered, TABLE_SIZE};
use balancer_tests::netns;
use balancer_tests::packet::{self, IPV6_HEADER_LEN, IPV6_OFFSET, Ipv4, Ipv6, Tcp, v6};

const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 100), 80);
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 99, 1, 2), 40_000);
const BACKENDS: [SocketAddrV4; 3] = [
    SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 11), 8000),
    SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 12), 8001),
    SocketAddrV4::new(Ipv4Addr::new(10, 99, 2, 13), 8002),
];
/// A router on the client's side and one on the backends' side, the
/// sources of ICMP errors.
const CLIENT_ROUTER: Ipv4Addr = Ipv4Addr::new(10, 99, 1, 254);
const BACKEND_ROUTER: Ipv4Addr = Ipv4Addr::new(10, 99, 2, 254);

// The IPv6 twins of the addresses above, in `Router`'s networks.
const VIP6: SocketAddrV6 = v6([0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 0x100], 80);
const CLIENT6: SocketAddrV6 = v6([0x2001, 0xdb8, 0x99, 1, 0, 0, 0, 2], 40_000);
const BACKENDS6: [SocketAddrV6; 3] = [
    v6([0x2001, 0xdb8, 0x99, 2, 0, 0, 0, 0x11], 8000),
    v6([0x2001, 0xdb8, 0x99, 2, 0, 0, 0, 0x12], 8001),
    v6([0x2001, 0xdb8, 0x99, 2, 0, 0, 0, 0x13], 8002),
];
const CLIENT_ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x99, 1, 0, 0, 0, 0xfe);
const BACKEND_ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x99, 2, 0, 0, 0, 0xfe);

/// One address family's endpoints, as the tables use them.
trait Endpoint: Copy + PartialEq + Debug + Into<SocketAddr> + Send + 'static {
    type Addr: Family;
    /// The service the tables steer.
    const VIP: Self;
    fn key(src: Self, dst: Self) -> FlowKey<Self::Addr>;
    /// A TCP frame (no payload) from `src` to `dst`, its checksums checked
    /// on their own.
    fn frame(src: Self, dst: Self, flags: u8, seq: u32, ack: u32) -> Vec<u8>;
}

impl Endpoint for SocketAddrV4 {
    type Addr = u32;
    const VIP: Self = VIP;
    fn key(src: Self, dst: Self) -> FlowKey {
        FlowKey::tcp(
            addr_be(src.ip().octets()),
            port_be(src.port()),
            addr_be(dst.ip().octets()),
            port_be(dst.port()),
        )
    }
    fn frame(src: Self, dst: Self, flags: u8, seq: u32, ack: u32) -> Vec<u8> {
        let f = seg(src, dst, flags, seq, ack).frame();
        assert_verifies(&f, packet::IPV4_OFFSET, false);
        f
    }
}

impl Endpoint for SocketAddrV6 {
    type Addr = Addr6;
    const VIP: Self = VIP6;
    fn key(src: Self, dst: Self) -> FlowKey<Addr6> {
        FlowKey::tcp(
            addr6_be(src.ip().octets()),
            port_be(src.port()),
            addr6_be(dst.ip().octets()),
            port_be(dst.port()),
        )
    }
    fn frame(src: Self, dst: Self, flags: u8, seq: u32, ack: u32) -> Vec<u8> {
        seg6(src, dst, flags, seq, ack)
    }
}

const CLIENT_ISN: u32 = 1_000;
const BACKEND_ISN: u32 = 5_000;
const STEP: Duration = Duration::from_secs(30);

/// Which program a step runs.
#[derive(Clone, Copy, Debug)]
enum Hook {
    /// XDP, arriving on this interface (`None`: `lo`).
    Xdp(Option<u32>),
    /// TC egress (local mode's reply path).
    Egress,
}

/// What to do to the maps before a step's packet: what an LRU eviction or
/// the agent would do.
#[derive(Clone, Debug)]
enum Setup<A = u32> {
    Evict(FlowKey<A>),
    /// The established entry last checked its peer long ago (the program
    /// checks at most every second; a test does not wait for that).
    Age(FlowKey<A>),
    State(usize, BackendState),
    /// Rewrite the routable list (and table), as the agent's table thread.
    Rebuild,
}

/// What must hold of the tables after a step.
#[derive(Clone, Debug)]
enum Check<A = u32> {
    /// Both directions of the connection are in the established table,
    /// open (`true`) or closed.
    Established(FlowKey<A>, FlowKey<A>, bool),
    /// The embryonic table holds at most this many entries, and the
    /// established one exactly that many.
    Counts {
        embryonic_at_most: usize,
        established: usize,
    },
}

struct Step<A = u32> {
    name: &'static str,
    setup: Vec<Setup<A>>,
    hook: Hook,
    input: Vec<u8>,
    action: XdpAction,
    /// The frame out; `None`: unchanged.
    output: Option<Vec<u8>>,
    /// Outcomes the step must count (each exactly once; no others).
    outcomes: Vec<Outcome>,
    checks: Vec<Check<A>>,
}

impl<A> Step<A> {
    fn new(name: &'static str, hook: Hook, input: Vec<u8>, action: XdpAction) -> Self {
        Self {
            name,
            setup: Vec::new(),
            hook,
            input,
            action,
            output: None,
            outcomes: Vec::new(),
            checks: Vec::new(),
        }
    }

    fn out(mut self, frame: Vec<u8>) -> Self {
        self.output = Some(frame);
        self
    }

    fn counts(mut self, outcomes: &[Outcome]) -> Self {
        self.outcomes = outcomes.to_vec();
        self
    }

    fn before(mut self, setup: Setup<A>) -> Self {
        self.setup.push(setup);
        self
    }

    fn then(mut self, check: Check<A>) -> Self {
        self.checks.push(check);
        self
    }
}

fn key<S: Endpoint>(src: S, dst: S) -> FlowKey<S::Addr> {
    S::key(src, dst)
}

/// The backend a SYN from `client` gets while every backend is routable:
/// the table slot of its flow hash.
fn chosen<S: Endpoint>(steered: &Steered<S>, client: S) -> S {
    let k = key(client, S::VIP);
    let hash = flow_hash(k.src_addr, k.src_port, k.dst_addr, k.dst_port);
    let index = steered.service.table()[(hash % u64::from(TABLE_SIZE)) as usize];
    steered.backends[index as usize]
}

fn seg(src: SocketAddrV4, dst: SocketAddrV4, flags: u8, seq: u32, ack: u32) -> Tcp {
    Tcp::new(src, dst, flags, seq, ack)
}

/// Runs the steps in order; the first that does not hold fails the table.
fn run<S: Endpoint>(steered: &mut Steered<S>, steps: Vec<Step<S::Addr>>) -> Result<()> {
    for step in steps {
        let name = step.name;
        for setup in &step.setup {
            match setup {
                Setup::Evict(k) => {
                    ensure!(
                        steered.maps.evict_flow(k)?,
                        "{name}: nothing to evict at {k:?}"
                    );
                }
                Setup::Age(k) => {
                    let flow = steered
                        .maps
                        .flow(k)?
                        .with_context(|| format!("{name}: no {k:?}"))?;
                    steered.maps.set_flow(k, Flow { checked: 0, ..flow })?;
                }
                Setup::State(i, state) => steered.set_state(*i, *state)?,
                Setup::Rebuild => steered.rebuild()?,
            }
        }
        let before = steered.maps.outcomes()?;
        let (action, out) = match step.hook {
            Hook::Xdp(ifindex) => {
                let run = steered.dataplane.test_run(&step.input, 1, ifindex)?;
                (run.action, run.packet)
            }
            Hook::Egress => {
                let run = steered.dataplane.test_run_egress(&step.input)?;
                ensure!(run.code == 0, "{name}: TC returned {}", run.code);
                (XdpAction::Pass, run.packet)
            }
        };
        ensure!(
            action == step.action,
            "{name}: {action:?}, expected {:?}",
            step.action
        );
        let expected = step.output.as_ref().unwrap_or(&step.input);
        ensure!(
            &out == expected,
            "{name}: output differs\n   got {out:02x?}\nwanted {expected:02x?}"
        );
        let moved = steered.maps.outcomes()?.since(&before);
        for (outcome, count) in moved.iter() {
            let wanted = step.outcomes.iter().filter(|o| **o == outcome).count() as u64;
            ensure!(
                count == wanted,
                "{name}: outcomes {moved:?}, expected {:?}",
                step.outcomes
            );
        }
        for check in &step.checks {
            match check {
                Check::Established(forward, reply, open) => {
                    for k in [forward, reply] {
                        let flow = steered.maps.flow(k)?.with_context(|| {
                            format!("{name}: {k:?} not in the established table")
                        })?;
                        ensure!(
                            (flow.closed == 0) == *open,
                            "{name}: {k:?} closed = {}, expected open = {open}",
                            flow.closed
                        );
                    }
                }
                Check::Counts {
                    embryonic_at_most,
                    established,
                } => {
                    let (e, c) = (steered.maps.embryonic_count(), steered.maps.flow_count());
                    ensure!(
                        e <= *embryonic_at_most && c == *established,
                        "{name}: {e} embryonic (max {embryonic_at_most}), {c} established \
                         (expected {established})"
                    );
                }
            }
        }
        eprintln!("ok: {name}");
    }
    Ok(())
}

/// Every frame a step expects carries checksums that verify on their own.
fn assert_verifies(frame: &[u8], l3: usize, icmp: bool) {
    let ok = if icmp {
        packet::icmp_checksums_verify(frame, l3)
    } else {
        packet::checksums_verify_at(frame, l3)
    };
    assert!(
        ok,
        "an expected frame's checksums do not verify: {frame:02x?}"
    );
}

#[test]
fn local_mode_fixtures() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let mut steered =
        Steered::load_sized(&object, VIP, &BACKENDS, false, 1024).expect("programming the service");
    let steps = local_steps(&steered);
    run(&mut steered, steps).unwrap_or_else(|error| panic!("{error:#}"));
}

/// One connection's story in local mode, step for step the same in both
/// families (built with `S`'s frames): the handshake, each direction
/// evicted and restored by the other, a lost connection kept on its
/// draining backend, out-of-window resets that close nothing; then
/// `while_open`, the family's own steps about the open connection (its
/// ICMP errors), and last the client's own RST, which closes it. The
/// backend is left draining.
fn connection_steps<S: Endpoint>(
    steered: &Steered<S>,
    client: S,
    while_open: Vec<Step<S::Addr>>,
) -> Vec<Step<S::Addr>> {
    use Outcome::*;
    let (vip, xdp) = (S::VIP, Hook::Xdp(None));
    let b = chosen(steered, client);
    let bi = steered.backend_of(b).expect("a backend");
    let (fwd, rep) = (key(client, vip), key(b, client));
    let (c1, b1) = (CLIENT_ISN + 1, BACKEND_ISN + 1);
    let (syn, ack, rst) = (packet::TCP_SYN, packet::TCP_ACK, packet::TCP_RST);
    let tcp = S::frame;
    let ack_in = |seq| tcp(client, vip, ack, seq, b1);
    let ack_out = |seq| tcp(client, b, ack, seq, b1);
    let reply_in = || tcp(b, client, ack, b1, c1);
    let reply_out = || tcp(vip, client, ack, b1, c1);
    let far = c1.wrapping_add(1 << 31);
    let rst_in = |seq| tcp(client, vip, rst, seq, 0);
    let rst_out = |seq| tcp(client, b, rst, seq, 0);
    let backend_far = b1.wrapping_add(1 << 30);

    let mut steps = vec![
        Step::new(
            "SYN to the service",
            xdp,
            tcp(client, vip, syn, CLIENT_ISN, 0),
            XdpAction::Pass,
        )
        .out(tcp(client, b, syn, CLIENT_ISN, 0))
        .counts(&[NewFlow])
        .then(Check::Counts {
            embryonic_at_most: 2,
            established: 0,
        }),
        Step::new(
            "backend's SYN-ACK restored",
            Hook::Egress,
            tcp(b, client, syn | ack, BACKEND_ISN, c1),
            XdpAction::Pass,
        )
        .out(tcp(vip, client, syn | ack, BACKEND_ISN, c1))
        .counts(&[Reply]),
        Step::new(
            "client's ACK completes the handshake",
            xdp,
            ack_in(c1),
            XdpAction::Pass,
        )
        .out(ack_out(c1))
        .counts(&[Established, Promoted])
        .then(Check::Established(fwd, rep, true))
        .then(Check::Counts {
            embryonic_at_most: 0,
            established: 2,
        }),
        Step::new(
            "reply direction evicted: the next forward packet restores it",
            xdp,
            ack_in(c1),
            XdpAction::Pass,
        )
        .before(Setup::Evict(rep))
        .before(Setup::Age(fwd))
        .out(ack_out(c1))
        .counts(&[Established, PeerRestored])
        .then(Check::Established(fwd, rep, true)),
        Step::new(
            "reply after the restore",
            Hook::Egress,
            reply_in(),
            XdpAction::Pass,
        )
        .out(reply_out())
        .counts(&[Reply]),
        Step::new(
            "forward direction evicted: the next reply restores it",
            Hook::Egress,
            reply_in(),
            XdpAction::Pass,
        )
        .before(Setup::Evict(fwd))
        .before(Setup::Age(rep))
        .out(reply_out())
        .counts(&[Reply, PeerRestored])
        .then(Check::Established(fwd, rep, true)),
        Step::new(
            "ACK of a lost connection on a draining backend stays there",
            xdp,
            ack_in(c1),
            XdpAction::Pass,
        )
        .before(Setup::State(bi, BackendState::Draining))
        .before(Setup::Rebuild)
        .before(Setup::Evict(fwd))
        .before(Setup::Evict(rep))
        .out(ack_out(c1))
        .counts(&[Recovered]),
        Step::new(
            "the draining backend's answer confirms the connection",
            Hook::Egress,
            reply_in(),
            XdpAction::Pass,
        )
        .out(reply_out())
        .counts(&[Reply, Promoted])
        .then(Check::Established(fwd, rep, true)),
        Step::new(
            "out-of-window RST from the client: forwarded, closes nothing",
            xdp,
            rst_in(far),
            XdpAction::Pass,
        )
        .out(rst_out(far))
        .counts(&[Established, RstIgnored])
        .then(Check::Established(fwd, rep, true)),
        Step::new(
            "out-of-window RST from the backend: restored, closes nothing",
            Hook::Egress,
            tcp(b, client, rst, backend_far, 0),
            XdpAction::Pass,
        )
        .out(tcp(vip, client, rst, backend_far, 0))
        .counts(&[Reply, RstIgnored])
        .then(Check::Established(fwd, rep, true)),
    ];
    steps.extend(while_open);
    steps.push(
        Step::new(
            "the client's own RST (its next sequence number) closes",
            xdp,
            rst_in(c1),
            XdpAction::Pass,
        )
        .out(rst_out(c1))
        .counts(&[Established])
        .then(Check::Established(fwd, rep, false)),
    );
    steps
}

/// IPv4 local mode: [`connection_steps`] with ICMP errors about the open
/// connection, then new connections with IPv4 options and VLAN tags.
fn local_steps(steered: &Steered) -> Vec<Step> {
    use Outcome::*;
    let xdp = Hook::Xdp(None);
    let b = chosen(steered, CLIENT);
    let bi = steered.backend_of(b).expect("a backend");
    let (c1, b1) = (CLIENT_ISN + 1, BACKEND_ISN + 1);

    // An ICMP error from a router on the client's side about a reply
    // (quoting service -> client) goes to the backend, quoting it.
    let mtu = 1400u16.to_be_bytes();
    let icmp_about = |from: SocketAddrV4, to: Ipv4Addr| {
        let quoted = seg(from, CLIENT, packet::TCP_ACK, b1, c1).ip();
        let icmp = packet::icmp_error(3, 4, [0, 0, mtu[0], mtu[1]], &quoted[..28]);
        let f = packet::ethernet(
            packet::ETHERTYPE_IPV4,
            &Ipv4::new(CLIENT_ROUTER, to, packet::PROTO_ICMP).packet(&icmp),
        );
        assert_verifies(&f, packet::IPV4_OFFSET, true);
        f
    };

    // IPv4 options (NOP, NOP, NOP, end) move the TCP header.
    let c2 = SocketAddrV4::new(*CLIENT.ip(), 40_002);
    let b2 = chosen(steered, c2);
    let with_options = |dst: SocketAddrV4| {
        let mut ip = Ipv4::new(*c2.ip(), *dst.ip(), packet::PROTO_TCP);
        ip.options = vec![1, 1, 1, 0];
        let f = packet::ethernet(
            packet::ETHERTYPE_IPV4,
            &ip.packet(&seg(c2, dst, packet::TCP_SYN, CLIENT_ISN, 0).segment()),
        );
        assert_verifies(&f, packet::IPV4_OFFSET, false);
        f
    };

    // One 802.1Q tag is looked through and kept.
    let c3 = SocketAddrV4::new(*CLIENT.ip(), 40_003);
    let b3 = chosen(steered, c3);
    let tagged = |dst: SocketAddrV4| {
        let ip = seg(c3, dst, packet::TCP_SYN, CLIENT_ISN, 0).ip();
        let f = packet::vlan_ethernet(packet::ETHERTYPE_VLAN, 42, packet::ETHERTYPE_IPV4, &ip);
        assert_verifies(&f, packet::IPV4_OFFSET + 4, false);
        f
    };
    let qinq = packet::vlan_ethernet(
        packet::ETHERTYPE_QINQ,
        42,
        packet::ETHERTYPE_VLAN,
        &[0, 7, 8, 0],
    );

    let icmp = vec![
        Step::new(
            "ICMP fragmentation needed about a reply: to its backend",
            xdp,
            icmp_about(VIP, *VIP.ip()),
            XdpAction::Pass,
        )
        .out(icmp_about(b, *b.ip()))
        .counts(&[Icmp]),
        Step::new(
            "ICMP about a connection nobody steered: untouched",
            xdp,
            icmp_about(SocketAddrV4::new(*VIP.ip(), 81), *VIP.ip()),
            XdpAction::Pass,
        )
        .counts(&[]),
    ];
    let mut steps = connection_steps(steered, CLIENT, icmp);
    steps.extend([
        Step::new(
            "SYN with IPv4 options",
            xdp,
            with_options(VIP),
            XdpAction::Pass,
        )
        .before(Setup::State(bi, BackendState::Routable))
        .before(Setup::Rebuild)
        .out(with_options(b2))
        .counts(&[NewFlow]),
        Step::new("SYN with one VLAN tag", xdp, tagged(VIP), XdpAction::Pass)
            .out(tagged(b3))
            .counts(&[NewFlow]),
        Step::new(
            "stacked VLAN tags: the kernel's",
            xdp,
            qinq,
            XdpAction::Pass,
        )
        .counts(&[]),
    ]);
    steps
}

#[test]
fn a_syn_flood_churns_only_the_handshake_table() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    // 1024 established entries, and a flood of as many SYNs as the
    // embryonic table (at its floor) has entries: they take ways of the
    // handshake table (`SYNS`) and no entry of either LRU table, so the
    // established connection and its handshake's entries stay.
    const CONNTRACK: u32 = 1024;
    let embryonic = LoadOptions {
        conntrack_size: CONNTRACK,
        ..LoadOptions::default()
    }
    .embryonic_size();
    let mut steered = Steered::load_sized(&object, VIP, &BACKENDS, false, CONNTRACK)
        .expect("programming the service");
    let mut steps = local_steps(&steered);
    steps.truncate(3);
    let flood: Vec<Step> = (0..embryonic)
        .map(|i| {
            let client = SocketAddrV4::new(
                Ipv4Addr::new(10, 98, (i >> 8) as u8, i as u8),
                1024 + i as u16,
            );
            Step::new(
                "flood SYN",
                Hook::Xdp(None),
                seg(client, VIP, packet::TCP_SYN, i, 0).frame(),
                XdpAction::Pass,
            )
            .out(seg(client, chosen(&steered, client), packet::TCP_SYN, i, 0).frame())
            .counts(&[Outcome::NewFlow])
        })
        .collect();
    steps.extend(flood);
    let b = chosen(&steered, CLIENT);
    steps.push(
        Step::new(
            "the established connection is still there",
            Hook::Xdp(None),
            seg(
                CLIENT,
                VIP,
                packet::TCP_ACK,
                CLIENT_ISN + 1,
                BACKEND_ISN + 1,
            )
            .frame(),
            XdpAction::Pass,
        )
        .out(seg(CLIENT, b, packet::TCP_ACK, CLIENT_ISN + 1, BACKEND_ISN + 1).frame())
        .counts(&[Outcome::Established])
        .then(Check::Established(key(CLIENT, VIP), key(b, CLIENT), true))
        .then(Check::Counts {
            embryonic_at_most: 0,
            established: 2,
        }),
    );
    run(&mut steered, steps).unwrap_or_else(|error| panic!("{error:#}"));
}

#[test]
fn remote_mode_fixtures() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let backend_ips: Vec<Ipv4Addr> = BACKENDS.iter().map(|b| *b.ip()).collect();
    Router::run("bt-l4fx", *CLIENT.ip(), &backend_ips, STEP, move |net| {
        // A smaller MTU toward the backends than toward the client.
        netns::run("ip", &["link", "set", Router::BACKEND_IF, "mtu", "1000"])?;
        let mut steered = Steered::load(&object, VIP, &BACKENDS, true)?;
        let steps = remote_steps(&steered, &net);
        run(&mut steered, steps)
    });
}

fn remote_steps(steered: &Steered, net: &Router) -> Vec<Step> {
    use Outcome::*;
    let from_client = Hook::Xdp(Some(net.client_if));
    let from_backends = Hook::Xdp(Some(net.backend_if));
    let b = chosen(steered, CLIENT);
    let c1 = CLIENT_ISN + 1;
    let syn = |ttl: u8, flags_fragment: u16, payload: usize| {
        let mut s = seg(CLIENT, VIP, packet::TCP_SYN, CLIENT_ISN, 0);
        s.payload = vec![0x5a; payload];
        let mut ip = Ipv4::new(*CLIENT.ip(), *VIP.ip(), packet::PROTO_TCP);
        ip.ttl = ttl;
        ip.flags_fragment = flags_fragment;
        packet::ethernet(packet::ETHERTYPE_IPV4, &ip.packet(&s.segment()))
    };
    // What a router answers: back to the sender, from the address it was
    // sent to, quoting its IPv4 header and first eight bytes of TCP.
    let answer = |original: &[u8], kind: u8, code: u8, rest: [u8; 4]| {
        let l3 = &original[packet::IPV4_OFFSET..];
        let icmp = packet::icmp_error(kind, code, rest, &l3[..28]);
        let mut ip = Ipv4::new(*VIP.ip(), *CLIENT.ip(), packet::PROTO_ICMP);
        ip.tos = 0xc0;
        ip.id = 0;
        let mut f = packet::ethernet(packet::ETHERTYPE_IPV4, &ip.packet(&icmp));
        // Back where it came from: the MACs swapped.
        f[..6].copy_from_slice(&original[6..12]);
        f[6..12].copy_from_slice(&original[..6]);
        assert_verifies(&f, packet::IPV4_OFFSET, true);
        f
    };
    let dying = syn(1, 0, 0);
    let too_big = syn(64, packet::DONT_FRAGMENT, 1_200);
    let mtu = 1000u16.to_be_bytes();

    // An ICMP error from a router beyond the backends about a forwarded
    // packet (quoting client -> backend): on to the client, quoting the
    // service, one hop later.
    let icmp_toward_client =
        |quoted_dst: SocketAddrV4, ttl: u8, macs: Option<([u8; 6], [u8; 6])>| {
            let quoted = seg(CLIENT, quoted_dst, packet::TCP_SYN, CLIENT_ISN, 0).ip();
            let icmp = packet::icmp_error(3, 1, [0; 4], &quoted[..28]);
            let mut ip = Ipv4::new(BACKEND_ROUTER, *CLIENT.ip(), packet::PROTO_ICMP);
            ip.ttl = ttl;
            let mut f = packet::ethernet(packet::ETHERTYPE_IPV4, &ip.packet(&icmp));
            if let Some((dst, src)) = macs {
                f[..6].copy_from_slice(&dst);
                f[6..12].copy_from_slice(&src);
            }
            assert_verifies(&f, packet::IPV4_OFFSET, true);
            f
        };

    vec![
        Step::new(
            "TTL 1: ICMP time exceeded back to the client",
            from_client,
            dying.clone(),
            XdpAction::Tx,
        )
        .out(answer(&dying, 11, 0, [0; 4]))
        .counts(&[NewFlow, TtlExpired]),
        Step::new(
            "larger than the next hop's MTU with DF: fragmentation needed",
            from_client,
            too_big.clone(),
            XdpAction::Tx,
        )
        .out(answer(&too_big, 3, 4, [0, 0, mtu[0], mtu[1]]))
        .counts(&[NewFlow, FragNeeded]),
        Step::new(
            "ICMP unreachable about a forwarded packet: to the client, quoting the service",
            from_backends,
            icmp_toward_client(b, 64, None),
            XdpAction::Redirect,
        )
        .out(icmp_toward_client(
            VIP,
            63,
            Some((Router::CLIENT_MAC, net.client_if_mac)),
        ))
        .counts(&[Icmp]),
        Step::new(
            "the handshake's reply still goes through",
            from_backends,
            seg(
                b,
                CLIENT,
                packet::TCP_SYN | packet::TCP_ACK,
                BACKEND_ISN,
                c1,
            )
            .frame(),
            XdpAction::Redirect,
        )
        .out({
            let s = seg(
                VIP,
                CLIENT,
                packet::TCP_SYN | packet::TCP_ACK,
                BACKEND_ISN,
                c1,
            );
            let mut ip = Ipv4::new(*VIP.ip(), *CLIENT.ip(), packet::PROTO_TCP);
            ip.ttl = 63;
            let mut f = packet::ethernet(packet::ETHERTYPE_IPV4, &ip.packet(&s.segment()));
            f[..6].copy_from_slice(&Router::CLIENT_MAC);
            f[6..12].copy_from_slice(&net.client_if_mac);
            f
        })
        .counts(&[Reply]),
    ]
}

/// An IPv6 frame the tables expect checks out on its own: its TCP or
/// ICMPv6 checksum, over the pseudo-header of its outer addresses, computed
/// from scratch.
fn assert_verifies6(frame: &[u8]) {
    assert!(
        packet::checksum6_verifies(frame),
        "an expected IPv6 frame's checksum does not verify: {frame:02x?}"
    );
}

fn seg6(src: SocketAddrV6, dst: SocketAddrV6, flags: u8, seq: u32, ack: u32) -> Vec<u8> {
    let f = packet::tcp6_frame(src, dst, flags, seq, ack, &[]);
    assert_verifies6(&f);
    f
}

/// An IPv6 TCP packet (no payload) as a router's ICMPv6 error quotes it:
/// whole.
fn quote6(src: SocketAddrV6, dst: SocketAddrV6, flags: u8, seq: u32, ack: u32) -> Vec<u8> {
    let segment = packet::tcp6(src, dst, flags, seq, ack, &[]);
    packet::ipv6_packet(*src.ip(), *dst.ip(), packet::PROTO_TCP, &segment)
}

/// The quote `as_sent`, translated: the addresses and ports of
/// `rewritten`, the quoted TCP checksum as it was (the program leaves it:
/// receivers match quotes by addresses and ports).
fn translated(as_sent: &[u8], mut rewritten: Vec<u8>) -> Vec<u8> {
    let check = IPV6_HEADER_LEN + 16;
    rewritten[check..check + 2].copy_from_slice(&as_sent[check..check + 2]);
    rewritten
}

/// An ICMPv6 error from `from` to `to` (hop limit `hops`) quoting `quote`,
/// sent between the MACs `macs` (destination, source) if given.
fn icmp6_error(
    from: Ipv6Addr,
    to: Ipv6Addr,
    hops: u8,
    message: (u8, u8, [u8; 4]),
    quote: &[u8],
    macs: Option<([u8; 6], [u8; 6])>,
) -> Vec<u8> {
    let mut f = packet::icmp6_frame(from, to, hops, message, quote);
    if let Some((dst, src)) = macs {
        f[..6].copy_from_slice(&dst);
        f[6..12].copy_from_slice(&src);
    }
    assert_verifies6(&f);
    f
}

/// ICMPv6 that is none of the balancer's business, each from the client:
/// neighbour discovery (solicitation, advertisement, router solicitation
/// and advertisement, redirect) and echo.
fn informational6() -> Vec<(&'static str, Vec<u8>)> {
    let target = VIP6.ip().octets();
    let mut solicitation = vec![0; 4];
    solicitation.extend_from_slice(&target);
    let mut advertisement = vec![0; 4];
    advertisement.extend_from_slice(&target);
    let mut redirect = vec![0; 4];
    redirect.extend_from_slice(&target);
    redirect.extend_from_slice(&CLIENT6.ip().octets());
    let from = *CLIENT6.ip();
    let to = *VIP6.ip();
    let all_routers: Ipv6Addr = "ff02::2".parse().expect("an address");
    let all_nodes: Ipv6Addr = "ff02::1".parse().expect("an address");
    [
        ("neighbour solicitation", from, to, 135, solicitation),
        ("neighbour advertisement", from, to, 136, advertisement),
        ("router solicitation", from, all_routers, 133, vec![0; 4]),
        (
            "router advertisement",
            from,
            all_nodes,
            134,
            vec![64, 0, 0, 0],
        ),
        ("redirect", from, to, 137, redirect),
        ("echo request", from, to, 128, vec![0, 1, 0, 1]),
    ]
    .into_iter()
    .map(|(name, from, to, kind, body)| {
        // The first four bytes of `body` are the message's own word.
        let rest = [body[0], body[1], body[2], body[3]];
        (
            name,
            icmp6_error(from, to, 255, (kind, 0, rest), &body[4..], None),
        )
    })
    .collect()
}

#[test]
fn local_mode_fixtures_ipv6() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let mut steered = Steered::load_sized(&object, VIP6, &BACKENDS6, false, 1024)
        .expect("programming the service");
    let steps = local_steps6(&steered);
    run(&mut steered, steps).unwrap_or_else(|error| panic!("{error:#}"));
}

/// IPv6 local mode: [`connection_steps`] with ICMPv6 about the open
/// connection: errors about its replies, about a connection nobody
/// steered and quoting an extension header, and the informational
/// messages that are none of the balancer's business.
fn local_steps6(steered: &Steered<SocketAddrV6>) -> Vec<Step<Addr6>> {
    use Outcome::*;
    let xdp = Hook::Xdp(None);
    let b = chosen(steered, CLIENT6);
    let (c1, b1) = (CLIENT_ISN + 1, BACKEND_ISN + 1);
    let ack = packet::TCP_ACK;

    // Each ICMPv6 error from a router on the client's side about a reply
    // (quoting service -> client, whole): to the backend, the outer
    // destination and the quote's source its own.
    let mtu = 1400u32.to_be_bytes();
    let too_big = (packet::ICMPV6_PACKET_TOO_BIG, 0, mtu);
    let errors = [
        (
            "ICMPv6 packet too big about a reply: to its backend",
            too_big,
        ),
        (
            "ICMPv6 unreachable about a reply: to its backend",
            (packet::ICMPV6_DEST_UNREACHABLE, 3, [0; 4]),
        ),
        (
            "ICMPv6 time exceeded about a reply: to its backend",
            (packet::ICMPV6_TIME_EXCEEDED, 0, [0; 4]),
        ),
        (
            "ICMPv6 parameter problem about a reply: to its backend",
            (packet::ICMPV6_PARAMETER_PROBLEM, 0, [0, 0, 0, 7]),
        ),
    ];
    let sent = quote6(VIP6, CLIENT6, ack, b1, c1);
    let about_reply = |message| icmp6_error(CLIENT_ROUTER6, *VIP6.ip(), 64, message, &sent, None);
    let to_backend = |message| {
        icmp6_error(
            CLIENT_ROUTER6,
            *b.ip(),
            64,
            message,
            &translated(&sent, quote6(b, CLIENT6, ack, b1, c1)),
            None,
        )
    };
    // The same about a connection nobody steered (another port).
    let other = SocketAddrV6::new(*VIP6.ip(), 81, 0, 0);
    let not_steered = icmp6_error(
        CLIENT_ROUTER6,
        *VIP6.ip(),
        64,
        too_big,
        &quote6(other, CLIENT6, ack, b1, c1),
        None,
    );
    // The same with a destination-options header in the quote (next
    // header 60, one PadN): not walked, so untouched.
    let mut extended = sent.clone();
    extended[6] = 60;
    extended.splice(
        IPV6_HEADER_LEN..IPV6_HEADER_LEN,
        [packet::PROTO_TCP, 0, 1, 4, 0, 0, 0, 0],
    );
    let quoting_extension = icmp6_error(CLIENT_ROUTER6, *VIP6.ip(), 64, too_big, &extended, None);

    let mut icmp = vec![
        Step::new(
            "ICMPv6 about a connection nobody steered: untouched",
            xdp,
            not_steered,
            XdpAction::Pass,
        )
        .counts(&[]),
        Step::new(
            "ICMPv6 quoting an extension header: untouched",
            xdp,
            quoting_extension,
            XdpAction::Pass,
        )
        .counts(&[]),
    ];
    for (name, message) in errors {
        icmp.push(
            Step::new(name, xdp, about_reply(message), XdpAction::Pass)
                .out(to_backend(message))
                .counts(&[Icmp]),
        );
    }
    for (name, frame) in informational6() {
        icmp.push(Step::new(name, xdp, frame, XdpAction::Pass).counts(&[]));
    }
    connection_steps(steered, CLIENT6, icmp)
}

#[test]
fn remote_mode_fixtures_ipv6() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let backend_ips: Vec<Ipv6Addr> = BACKENDS6.iter().map(|b| *b.ip()).collect();
    Router::run("bt-l4fx6", *CLIENT6.ip(), &backend_ips, STEP, move |net| {
        // A smaller MTU toward the backends than toward the client (IPv6
        // needs at least 1280 on a link).
        netns::run("ip", &["link", "set", Router::BACKEND_IF, "mtu", "1300"])?;
        let mut steered = Steered::load(&object, VIP6, &BACKENDS6, true)?;
        let steps = remote_steps6(&steered, &net);
        run(&mut steered, steps)
    });
}

fn remote_steps6(steered: &Steered<SocketAddrV6>, net: &Router) -> Vec<Step<Addr6>> {
    use Outcome::*;
    let from_client = Hook::Xdp(Some(net.client_if));
    let from_backends = Hook::Xdp(Some(net.backend_if));
    let b = chosen(steered, CLIENT6);
    let c1 = CLIENT_ISN + 1;
    let (syn, ack) = (packet::TCP_SYN, packet::TCP_ACK);
    let syn_ip = |client: SocketAddrV6, hops: u8, payload: usize| {
        let segment = packet::tcp6(client, VIP6, syn, CLIENT_ISN, 0, &vec![0x5a; payload]);
        let mut ip = Ipv6::new(*client.ip(), *VIP6.ip(), packet::PROTO_TCP);
        ip.hop_limit = hops;
        ip.packet(&segment)
    };
    let syn_with = |hops: u8, payload: usize| {
        packet::ethernet(packet::ETHERTYPE_IPV6, &syn_ip(CLIENT6, hops, payload))
    };
    // What an IPv6 router answers: back to the sender, from the address it
    // was sent to, quoting as much of the packet as fits in 1280 bytes.
    let answer_ip = |l3: &[u8], kind: u8, rest: [u8; 4]| {
        let room = packet::IPV6_MIN_MTU - IPV6_HEADER_LEN - 8;
        let quote = &l3[..l3.len().min(room)];
        let mut ip = Ipv6::new(*VIP6.ip(), *CLIENT6.ip(), packet::PROTO_ICMPV6);
        ip.traffic_class = 0xc0;
        let answer = ip.packet(&packet::icmp6(
            *VIP6.ip(),
            *CLIENT6.ip(),
            kind,
            0,
            rest,
            quote,
        ));
        assert!(answer.len() <= packet::IPV6_MIN_MTU);
        answer
    };
    let back = |original: &[u8], mut f: Vec<u8>| {
        f[..6].copy_from_slice(&original[6..12]);
        f[6..12].copy_from_slice(&original[..6]);
        f
    };
    let answer = |original: &[u8], kind: u8, rest: [u8; 4]| {
        let l3 = &original[IPV6_OFFSET..];
        let f = packet::ethernet(packet::ETHERTYPE_IPV6, &answer_ip(l3, kind, rest));
        assert_verifies6(&f);
        back(original, f)
    };
    let dying = syn_with(1, 0);
    // The same on VLAN 42 (another connection): answered on VLAN 42.
    let tagged =
        |ip: &[u8]| packet::vlan_ethernet(packet::ETHERTYPE_VLAN, 42, packet::ETHERTYPE_IPV6, ip);
    let dying_tagged_ip = syn_ip(v6([0x2001, 0xdb8, 0x99, 1, 0, 0, 0, 2], 40_001), 1, 0);
    let dying_tagged = tagged(&dying_tagged_ip);
    let too_big = syn_with(64, 1_300);
    assert!(too_big.len() - IPV6_OFFSET > packet::IPV6_MIN_MTU);

    // Destination unreachable from a router beyond the backends about a
    // forwarded packet (quoting client -> backend): on to the client,
    // quoting the service, one hop later.
    let unreachable = (packet::ICMPV6_DEST_UNREACHABLE, 3, [0; 4]);
    let forwarded = quote6(CLIENT6, b, syn, CLIENT_ISN, 0);
    let to_client = Some((Router::CLIENT_MAC, net.client_if_mac));
    // Packet Too Big from a router on the client's side about a reply
    // (quoting service -> client): on to the backend, one hop later.
    let mtu = (packet::ICMPV6_PACKET_TOO_BIG, 0, 1280u32.to_be_bytes());
    let reply = quote6(VIP6, CLIENT6, syn | ack, BACKEND_ISN, c1);
    let to_backend = Some((Router::BACKEND_MAC, net.backend_if_mac));

    let mut steps = vec![
        Step::new(
            "hop limit 1: ICMPv6 time exceeded back to the client",
            from_client,
            dying.clone(),
            XdpAction::Tx,
        )
        .out(answer(&dying, packet::ICMPV6_TIME_EXCEEDED, [0; 4]))
        .counts(&[NewFlow, TtlExpired]),
        Step::new(
            "hop limit 1 on a VLAN: time exceeded on the same VLAN",
            from_client,
            dying_tagged.clone(),
            XdpAction::Tx,
        )
        .out(back(
            &dying_tagged,
            tagged(&answer_ip(
                &dying_tagged_ip,
                packet::ICMPV6_TIME_EXCEEDED,
                [0; 4],
            )),
        ))
        .counts(&[NewFlow, TtlExpired]),
        Step::new(
            "larger than the next hop's MTU: ICMPv6 packet too big, its MTU",
            from_client,
            too_big.clone(),
            XdpAction::Tx,
        )
        .out(answer(
            &too_big,
            packet::ICMPV6_PACKET_TOO_BIG,
            1300u32.to_be_bytes(),
        ))
        .counts(&[NewFlow, FragNeeded]),
        Step::new(
            "ICMPv6 unreachable about a forwarded packet: to the client, quoting the service",
            from_backends,
            icmp6_error(
                BACKEND_ROUTER6,
                *CLIENT6.ip(),
                64,
                unreachable,
                &forwarded,
                None,
            ),
            XdpAction::Redirect,
        )
        .out(icmp6_error(
            BACKEND_ROUTER6,
            *CLIENT6.ip(),
            63,
            unreachable,
            &translated(&forwarded, quote6(CLIENT6, VIP6, syn, CLIENT_ISN, 0)),
            to_client,
        ))
        .counts(&[Icmp]),
        Step::new(
            "the handshake's reply still goes through",
            from_backends,
            seg6(b, CLIENT6, syn | ack, BACKEND_ISN, c1),
            XdpAction::Redirect,
        )
        .out({
            let segment = packet::tcp6(VIP6, CLIENT6, syn | ack, BACKEND_ISN, c1, &[]);
            let mut ip = Ipv6::new(*VIP6.ip(), *CLIENT6.ip(), packet::PROTO_TCP);
            ip.hop_limit = 63;
            let mut f = packet::ethernet(packet::ETHERTYPE_IPV6, &ip.packet(&segment));
            f[..6].copy_from_slice(&Router::CLIENT_MAC);
            f[6..12].copy_from_slice(&net.client_if_mac);
            assert_verifies6(&f);
            f
        })
        .counts(&[Reply]),
        // After the reply it quotes went out through here, as a reply does
        // (the forward entry the error is translated with is made then).
        Step::new(
            "ICMPv6 packet too big about a reply: to its backend",
            from_client,
            icmp6_error(CLIENT_ROUTER6, *VIP6.ip(), 64, mtu, &reply, None),
            XdpAction::Redirect,
        )
        .out(icmp6_error(
            CLIENT_ROUTER6,
            *b.ip(),
            63,
            mtu,
            &translated(&reply, quote6(b, CLIENT6, syn | ack, BACKEND_ISN, c1)),
            to_backend,
        ))
        .counts(&[Icmp]),
    ];
    for (name, frame) in informational6() {
        steps.push(Step::new(name, from_client, frame, XdpAction::Pass).counts(&[]));
    }
    steps
}

#[test]
fn verdicts_of_the_fixture_frames() {
    // The parser's view of the frames the tables use, so a fixture that
    // passes untouched does so for the right reason.
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let steered = Steered::load(&object, VIP, &BACKENDS, false).expect("programming the service");
    let cases = [
        (
            packet::vlan_ethernet(
                packet::ETHERTYPE_VLAN,
                42,
                packet::ETHERTYPE_IPV4,
                &seg(CLIENT, VIP, packet::TCP_SYN, 1, 0).ip(),
            ),
            Verdict::TcpSyn,
        ),
        (
            packet::vlan_ethernet(packet::ETHERTYPE_QINQ, 42, packet::ETHERTYPE_VLAN, &[0; 24]),
            Verdict::PassNotIpv4,
        ),
        (
            packet::ethernet(
                packet::ETHERTYPE_IPV4,
                &Ipv4::new(CLIENT_ROUTER, *VIP.ip(), packet::PROTO_ICMP)
                    .packet(&packet::icmp_error(8, 0, [0; 4], &[0; 28])),
            ),
            Verdict::Icmp,
        ),
    ];
    // ICMPv6: an error is ICMP (and goes to the ICMPv6 program); every
    // informational message (neighbour discovery, echo) is decided before
    // that call and passes as not TCP; a header cut short is truncated.
    let error6 = icmp6_error(
        CLIENT_ROUTER6,
        *VIP6.ip(),
        64,
        (packet::ICMPV6_PACKET_TOO_BIG, 0, 1280u32.to_be_bytes()),
        &quote6(VIP6, CLIENT6, packet::TCP_ACK, 1, 1),
        None,
    );
    let cut = packet::ethernet(
        packet::ETHERTYPE_IPV6,
        &packet::ipv6_packet(
            *CLIENT6.ip(),
            *VIP6.ip(),
            packet::PROTO_ICMPV6,
            &[135, 0, 0],
        ),
    );
    // IPv6 TCP is counted once, whether its ports send it on into the IPv6
    // program (the service port) or decide before that (another port).
    let tcp6 = |dst: SocketAddrV6, flags| packet::tcp6_frame(CLIENT6, dst, flags, 1, 0, &[]);
    let other_port = SocketAddrV6::new(*VIP6.ip(), 9999, 0, 0);
    let tcp6_cut = tcp6(other_port, packet::TCP_ACK);
    let tcp6_cases = [
        (tcp6(VIP6, packet::TCP_SYN), Verdict::TcpSyn),
        (tcp6(VIP6, packet::TCP_ACK), Verdict::TcpOther),
        (tcp6(other_port, packet::TCP_SYN), Verdict::TcpSyn),
        (tcp6(other_port, packet::TCP_ACK), Verdict::TcpOther),
        (
            tcp6_cut[..tcp6_cut.len() - 1].to_vec(),
            Verdict::PassTruncated,
        ),
    ];
    let cases6 = [(error6, Verdict::Icmp), (cut, Verdict::PassTruncated)]
        .into_iter()
        .chain(tcp6_cases)
        .chain(
            informational6()
                .into_iter()
                .map(|(_, frame)| (frame, Verdict::PassNotTcp)),
        );
    for (frame, verdict) in cases.into_iter().chain(cases6) {
        let before = steered.dataplane.verdict_counts().unwrap();
        steered.dataplane.test_run(&frame, 1, None).unwrap();
        let moved = steered.dataplane.verdict_counts().unwrap().since(&before);
        assert_eq!(
            (moved.get(verdict), moved.total()),
            (1, 1),
            "{verdict:?}: {moved:?}"
        );
    }
}

/// What each backend's handshake counters say, for the breakers.
fn handshakes(steered: &Steered, backend: SocketAddrV4) -> [u64; 5] {
    let index = steered.backend_of(backend).expect("a backend") as u32;
    let s = steered.maps.backend_stats(index).unwrap();
    [
        s.connections,
        s.established,
        s.refused,
        s.timeouts,
        s.resets,
    ]
}

#[test]
fn handshake_outcomes_are_counted_per_backend() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let steered = Steered::load(&object, VIP, &BACKENDS, false).expect("programming the service");
    let xdp = |frame: Vec<u8>| steered.dataplane.test_run(&frame, 1, None).unwrap();
    let egress = |frame: Vec<u8>| steered.dataplane.test_run_egress(&frame).unwrap();
    let client = |port| SocketAddrV4::new(*CLIENT.ip(), port);

    // Established: the backend's SYN-ACK, counted once however often it
    // comes.
    let (c, b) = (client(41_000), chosen(&steered, client(41_000)));
    xdp(seg(c, VIP, packet::TCP_SYN, CLIENT_ISN, 0).frame());
    let syn_ack = seg(
        b,
        c,
        packet::TCP_SYN | packet::TCP_ACK,
        BACKEND_ISN,
        CLIENT_ISN + 1,
    );
    egress(syn_ack.frame());
    egress(syn_ack.frame());
    let mut expected = handshakes(&steered, b);
    assert_eq!(expected[..3], [1, 1, 0], "{expected:?}");
    // A reset from the backend on the established connection (its own next
    // sequence number) is a worker reset, not a refusal.
    xdp(seg(c, VIP, packet::TCP_ACK, CLIENT_ISN + 1, BACKEND_ISN + 1).frame());
    egress(seg(b, c, packet::TCP_RST, BACKEND_ISN + 1, 0).frame());
    expected[4] += 1;
    assert_eq!(handshakes(&steered, b), expected);

    // Refused: a reset acknowledging the SYN. A reset that does not is
    // forged and counts nothing.
    let (c, b) = (client(41_001), chosen(&steered, client(41_001)));
    let before = handshakes(&steered, b);
    xdp(seg(c, VIP, packet::TCP_SYN, CLIENT_ISN, 0).frame());
    egress(seg(b, c, packet::TCP_RST | packet::TCP_ACK, 0, CLIENT_ISN + 7).frame());
    assert_eq!(
        handshakes(&steered, b)[2],
        before[2],
        "a forged reset was counted"
    );
    egress(seg(b, c, packet::TCP_RST | packet::TCP_ACK, 0, CLIENT_ISN + 1).frame());
    assert_eq!(handshakes(&steered, b)[2], before[2] + 1);

    // Timeout: the client sends its SYN again (same initial sequence
    // number) before any SYN-ACK; a new connection on the same port (another
    // number) is not one.
    let (c, b) = (client(41_002), chosen(&steered, client(41_002)));
    let before = handshakes(&steered, b);
    for _ in 0..2 {
        xdp(seg(c, VIP, packet::TCP_SYN, CLIENT_ISN, 0).frame());
    }
    xdp(seg(c, VIP, packet::TCP_SYN, CLIENT_ISN + 100_000, 0).frame());
    assert_eq!(handshakes(&steered, b)[3], before[3] + 1);
    // Answered, a retransmission is no timeout.
    egress(
        seg(
            b,
            c,
            packet::TCP_SYN | packet::TCP_ACK,
            BACKEND_ISN,
            CLIENT_ISN + 100_001,
        )
        .frame(),
    );
    xdp(seg(c, VIP, packet::TCP_SYN, CLIENT_ISN + 100_000, 0).frame());
    assert_eq!(handshakes(&steered, b)[3], before[3] + 1);
}

#[test]
fn half_open_and_degraded_backends_get_a_share_of_new_connections() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let mut steered =
        Steered::load(&object, VIP, &BACKENDS, false).expect("programming the service");
    let admitted = |steered: &Steered, seed: u32, count: u32| -> u32 {
        let before = steered.maps.outcomes().unwrap().get(Outcome::NewFlow);
        for i in 0..count {
            let client = SocketAddrV4::new(
                Ipv4Addr::new(10, 97, (seed >> 8) as u8, seed as u8),
                1024 + i as u16,
            );
            let frame = seg(client, VIP, packet::TCP_SYN, i, 0).frame();
            steered.dataplane.test_run(&frame, 1, None).unwrap();
        }
        (steered.maps.outcomes().unwrap().get(Outcome::NewFlow) - before) as u32
    };
    // Only backend 0 takes connections, and only as a trial: 2 a second.
    for i in 1..BACKENDS.len() {
        steered.set_state(i, BackendState::Isolated).unwrap();
    }
    steered
        .maps
        .set_backend_share(0, BACKENDS[0], BackendState::Trial, 2)
        .unwrap();
    steered.rebuild().unwrap();
    let trials = admitted(&steered, 1, 50);
    // 50 SYNs take well under a second, but may straddle the turn of one.
    assert!(
        (1..=4).contains(&trials),
        "a half-open backend took {trials} of 50 new connections, at 2 a second"
    );

    // Degraded at 30%: about 30% of the connections that pick it.
    steered
        .maps
        .set_backend_share(0, BACKENDS[0], BackendState::Degraded, 30)
        .unwrap();
    let share = f64::from(admitted(&steered, 2, 2_000)) / 2_000.0;
    assert!(
        (0.25..=0.35).contains(&share),
        "a degraded backend at 30% took {:.1}% of new connections",
        share * 100.0
    );
}

//! The pinned state on its own, without interfaces: a second load adopts
//! the maps a first one left (the connection table carries over), a load
//! with other map sizes copies the connection table into its new maps and
//! retires the old ones, `detach_all` leaves nothing behind, and the
//! sole-service marks of `PORTS` follow the services across an adoption. Each test
//! pins under a folder of its own on bpffs and removes it on every way out.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};

use balancer_common::l4::{
    BackendState, FLAG_REPLY, Flow, FlowKey, Outcome, PORT_REPLY_EGRESS, PORT_SERVICE, addr_be,
    port_be,
};
use balancer_dataplane::l4::ServiceState;
use balancer_dataplane::maglev::{self, Member};
use balancer_dataplane::pin::{self, PinDir};
use balancer_dataplane::{Dataplane, L4Maps, LoadOptions, status};
use balancer_tests::{ebpf_prerequisites, packet};

/// A bpffs folder of the test's own, removed (with everything pinned in
/// it) when dropped.
struct Pins(PathBuf);

impl Pins {
    fn new(test: &str) -> Self {
        let dir = PathBuf::from(format!(
            "/sys/fs/bpf/balancer-test-{}-{test}",
            std::process::id()
        ));
        pin::ensure_bpffs(&dir).expect("bpffs");
        Self(dir)
    }

    fn state(&self) -> PinDir {
        PinDir::new(&self.0, "local", &["eth9".into()])
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = status::detach_all(&self.0);
    }
}

fn options(conntrack_size: u32) -> LoadOptions {
    LoadOptions {
        table_size: 1009,
        services: 1,
        conntrack_size,
    }
}

fn flow() -> (FlowKey, Flow) {
    let client = SocketAddrV4::new(Ipv4Addr::new(10, 1, 0, 2), 40_000);
    let vip = SocketAddrV4::new(Ipv4Addr::new(10, 1, 0, 100), 80);
    let key = FlowKey::tcp(
        addr_be(client.ip().octets()),
        port_be(client.port()),
        addr_be(vip.ip().octets()),
        port_be(vip.port()),
    );
    let flow = Flow {
        addr: addr_be([10, 1, 1, 11]),
        port: port_be(8000),
        service: 0,
        backend: 3,
        ..Flow::default()
    };
    (key, flow)
}

/// How many programs the pinned program array `array` holds.
fn programs_in(pins: &Pins, array: &str) -> usize {
    let path = pins.state().maps_dir(&options(1024)).join(array);
    let out = std::process::Command::new("bpftool")
        .args(["--json", "map", "dump", "pinned"])
        .arg(&path)
        .output()
        .expect("bpftool runs");
    assert!(
        out.status.success(),
        "bpftool map dump pinned {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let entries: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool's JSON");
    entries.as_array().expect("a list of entries").len()
}

fn load(object: &Path, pins: &Pins, conntrack_size: u32) -> Dataplane {
    Dataplane::load_pinned(object, options(conntrack_size), Some(pins.state()))
        .expect("loading with pinned maps")
}

#[test]
fn a_second_load_adopts_the_connection_table() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let pins = Pins::new("adopt");
    let (key, entry) = flow();
    {
        let mut first = load(&object, &pins, 1024);
        first.take_l4_maps().unwrap().set_flow(&key, entry).unwrap();
        // Dropped with the state kept (the default with pins).
    }
    assert!(
        pins.state().maps_dir(&options(1024)).join("CONNS").exists(),
        "the maps must stay pinned after the first load goes"
    );
    // The IPv6 and ICMPv6 programs stay where the pinned XDP programs
    // tail-call them: the pins hold the program arrays, which a kernel
    // would otherwise empty when the first load's process let go of them.
    for array in [
        balancer_common::l4::IPV6_PROGRAM,
        balancer_common::l4::ICMP6_PROGRAM,
    ] {
        assert_eq!(programs_in(&pins, array), 1, "{array}'s entry is gone");
    }
    let mut second = load(&object, &pins, 1024);
    let maps = second.take_l4_maps().unwrap();
    assert_eq!(
        maps.flow(&key).unwrap(),
        Some(entry),
        "the entry was not adopted"
    );

    // Detaching on exit removes the state.
    second.set_detach_on_exit(true);
    drop(maps);
    drop(second);
    assert!(
        !pins.state().root().exists(),
        "detach-on-exit left the pins"
    );
}

#[test]
fn other_map_sizes_carry_the_connection_table_over() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let pins = Pins::new("migrate");
    let (key, entry) = flow();
    let reply_key = FlowKey::tcp(entry.addr, entry.port, key.src_addr, key.src_port);
    let reply = Flow {
        addr: key.dst_addr,
        port: key.dst_port,
        flags: FLAG_REPLY,
        ..entry
    };
    {
        let mut first = load(&object, &pins, 1024);
        let maps = first.take_l4_maps().unwrap();
        maps.set_flow(&key, entry).unwrap();
        maps.set_flow(&reply_key, reply).unwrap();
    }
    let mut second = load(&object, &pins, 4096);
    let maps = second.take_l4_maps().unwrap();
    assert_eq!(maps.flow(&key).unwrap(), None, "new sizes, new maps");
    second.retire_other_layouts();
    assert_eq!(maps.flow(&key).unwrap(), Some(entry));
    assert_eq!(maps.flow(&reply_key).unwrap(), Some(reply));
    assert_eq!(
        pins.state().layouts(),
        vec![pins.state().maps_dir(&options(4096))],
        "the old layout's maps must be gone"
    );
}

#[test]
fn detach_all_removes_everything_pinned() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let pins = Pins::new("detach");
    drop(load(&object, &pins, 1024));
    let report = status::report(&pins.0);
    assert!(report.contains("local-eth9"), "{report}");
    assert!(report.contains("connections: 0 established"), "{report}");
    let removed = status::detach_all(&pins.0).unwrap();
    assert_eq!(removed, vec!["local-eth9".to_owned()]);
    assert!(!pins.0.exists(), "{} still exists", pins.0.display());
    assert!(status::report(&pins.0).starts_with("nothing attached: nothing pinned"));
}

/// A SYN's handshake waits in the pinned handshake table: a second load
/// adopts it (the worker's SYN-ACK after an agent restart still finds
/// it), and `balancer l4 status` counts it until the worker answers.
#[test]
fn a_waiting_handshake_is_pinned_adopted_and_counted() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let pins = Pins::new("syns");
    let vip = SocketAddrV4::new(Ipv4Addr::new(10, 1, 8, 100), 80);
    let backend = SocketAddrV4::new(Ipv4Addr::new(10, 1, 8, 11), 8000);
    let client = SocketAddrV4::new(Ipv4Addr::new(10, 1, 9, 2), 40_000);
    let reply_key = FlowKey::tcp(
        addr_be(backend.ip().octets()),
        port_be(backend.port()),
        addr_be(client.ip().octets()),
        port_be(client.port()),
    );
    {
        let mut first = load(&object, &pins, 1024);
        let maps = first.take_l4_maps().unwrap();
        serve(&maps, vip, 0, backend);
        // Local mode: the worker's replies leave through the TC program.
        maps.set_port_bits(backend.port(), PORT_REPLY_EGRESS)
            .unwrap();
        assert_eq!(syn_to(&first, &maps, vip), (backend, Outcome::NewFlow));
        assert!(maps.handshake_flow(&reply_key).unwrap().is_some());
    }
    let report = status::report(&pins.0);
    assert!(report.contains("unanswered SYNs: 1"), "{report}");
    let mut second = load(&object, &pins, 1024);
    let maps = second.take_l4_maps().unwrap();
    let waiting = maps
        .handshake_flow(&reply_key)
        .unwrap()
        .expect("the handshake, adopted");
    assert_eq!(
        (waiting.addr, waiting.port),
        (addr_be(vip.ip().octets()), port_be(vip.port()))
    );
    let syn_ack = packet::tcp_frame(backend, client, packet::TCP_SYN | packet::TCP_ACK);
    let answered = second.test_run_egress(&syn_ack).unwrap();
    assert_eq!(packet::endpoints(&answered.packet), (vip, client));
    let report = status::report(&pins.0);
    assert!(report.contains("unanswered SYNs: 0"), "{report}");
}

/// Runs a SYN from a fresh client to `vip` through `dataplane`'s XDP
/// program; returns where it went and what it was counted as.
fn syn_to(dataplane: &Dataplane, maps: &L4Maps, vip: SocketAddrV4) -> (SocketAddrV4, Outcome) {
    let client = SocketAddrV4::new(Ipv4Addr::new(10, 1, 9, 2), 40_000);
    let before = maps.outcomes().unwrap();
    let run = dataplane
        .test_run(&packet::tcp_frame(client, vip, packet::TCP_SYN), 1, None)
        .unwrap();
    let moved = maps.outcomes().unwrap().since(&before);
    let outcome = Outcome::ALL
        .into_iter()
        .find(|o| moved.get(*o) == 1)
        .expect("one outcome counted");
    (packet::endpoints(&run.packet).1, outcome)
}

/// Programs service `vip` in slot `index` over backend `backend` (slot
/// `index` too), as the agent would.
fn serve(maps: &L4Maps, vip: SocketAddrV4, index: u32, backend: SocketAddrV4) -> ServiceState {
    let mut service = maps.add_service(vip, index, 0).unwrap();
    maps.set_port_bits(vip.port(), PORT_SERVICE).unwrap();
    maps.set_backend_state(index, backend, BackendState::Routable)
        .unwrap();
    let member = Member {
        index,
        key: maglev::member_key(backend.into()),
    };
    let table = maglev::build(&[member], 1009);
    maps.update_service(&mut service, &[index], Some(&table))
        .unwrap();
    service
}

/// A port one service has to itself names it in `PORTS`, and its SYNs find
/// it in the service's copy without the hash lookup (proved here by
/// deleting the hash entry behind the agent's back); a second service on
/// the port clears that, so both are looked up; and when an adopting agent
/// removes one of them the other gets the port to itself again.
#[test]
fn a_port_one_service_has_to_itself_skips_the_service_lookup() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let pins = Pins::new("sole");
    let two = LoadOptions {
        services: 2,
        ..options(1024)
    };
    let vip = SocketAddrV4::new(Ipv4Addr::new(10, 1, 0, 100), 80);
    let other = SocketAddrV4::new(Ipv4Addr::new(10, 1, 0, 101), 80);
    let backends = [
        SocketAddrV4::new(Ipv4Addr::new(10, 1, 1, 11), 8000),
        SocketAddrV4::new(Ipv4Addr::new(10, 1, 1, 12), 8000),
    ];
    let load = || Dataplane::load_pinned(&object, two, Some(pins.state())).unwrap();
    {
        let mut dataplane = load();
        let maps = dataplane.take_l4_maps().unwrap();
        maps.set_generation(1).unwrap();
        let first = serve(&maps, vip, 0, backends[0]);
        assert_eq!(maps.sole_service::<u32>(80).unwrap(), Some(0));
        assert_eq!(maps.port_bits(80).unwrap() & PORT_SERVICE, PORT_SERVICE);

        // Without its hash entry the service is still steered: the SYN
        // never looked there.
        let services = pins
            .state()
            .maps_dir(&two)
            .join(balancer_common::l4::SERVICES);
        let deleted = std::process::Command::new("bpftool")
            .args(["map", "delete", "pinned"])
            .arg(&services)
            .args(["key", "10", "1", "0", "100", "0", "80", "6", "0"])
            .status()
            .expect("bpftool runs");
        assert!(deleted.success(), "bpftool map delete");
        assert!(maps.service_of(&first).unwrap().is_none());
        assert_eq!(
            syn_to(&dataplane, &maps, vip),
            (backends[0], Outcome::NewFlow)
        );
        // Another address on the port is no service, as after a hash miss.
        assert_eq!(
            syn_to(&dataplane, &maps, other),
            (other, Outcome::NotService)
        );

        // A second service on the port: both are looked up in the hash.
        let mut first = first;
        maps.update_service(&mut first, &[0], None).unwrap();
        serve(&maps, other, 1, backends[1]);
        assert_eq!(maps.sole_service::<u32>(80).unwrap(), None);
        assert_eq!(
            syn_to(&dataplane, &maps, vip),
            (backends[0], Outcome::NewFlow)
        );
        assert_eq!(
            syn_to(&dataplane, &maps, other),
            (backends[1], Outcome::NewFlow)
        );
        // Dropped with the state kept.
    }
    // An agent configured with the second service only adopts the maps
    // and removes the first: the port is the second's alone again.
    let mut dataplane = load();
    let maps = dataplane.take_l4_maps().unwrap();
    let kept = maps.add_service(other, 1, 0).unwrap();
    assert_eq!(maps.sole_service::<u32>(80).unwrap(), None);
    maps.retain_services(&[kept]).unwrap();
    assert_eq!(maps.sole_service::<u32>(80).unwrap(), Some(1));
    assert_eq!(maps.port_bits(80).unwrap() & PORT_SERVICE, PORT_SERVICE);
    assert_eq!(
        syn_to(&dataplane, &maps, other),
        (backends[1], Outcome::NewFlow)
    );
    assert_eq!(syn_to(&dataplane, &maps, vip), (vip, Outcome::NotService));
}

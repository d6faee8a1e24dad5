//! The pinned state on its own, without interfaces: a second load adopts
//! the maps a first one left (the connection table carries over), a load
//! with other map sizes copies the connection table into its new maps and
//! retires the old ones, and `detach_all` leaves nothing behind. Each test
//! pins under a folder of its own on bpffs and removes it on every way out.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};

use balancer_common::l4::{FLAG_REPLY, Flow, FlowKey, addr_be, port_be};
use balancer_dataplane::pin::{self, PinDir};
use balancer_dataplane::{Dataplane, LoadOptions, status};
use balancer_tests::ebpf_prerequisites;

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

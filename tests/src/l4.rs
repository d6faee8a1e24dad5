//! An L4 service programmed straight into the maps, the way the agent
//! would, for tests and benchmarks that drive the programs through
//! `BPF_PROG_TEST_RUN` without a registry.

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::Path;

use anyhow::{Context, Result};
use balancer_common::l4::{
    BackendState, FLAG_REMOTE, PORT_REPLY_EGRESS, PORT_REPLY_INGRESS, PORT_SERVICE,
};
use balancer_dataplane::l4::ServiceState;
use balancer_dataplane::maglev::{self, Member};
use balancer_dataplane::{Dataplane, L4Maps, LoadOptions};

use crate::netns::{self, Namespaces, run};

/// A small prime: tables stay quick to write, and Maglev's shares are
/// still within a few percent for a handful of backends.
pub const TABLE_SIZE: u32 = 1009;

/// One service at `vip` over `backends` (backend `i` in slot `i`), of
/// either family (`A` is `SocketAddrV4` or `SocketAddrV6`).
pub struct Steered<A = SocketAddrV4> {
    pub dataplane: Dataplane,
    pub maps: L4Maps,
    pub service: ServiceState,
    pub backends: Vec<A>,
    states: Vec<BackendState>,
}

impl<A: Copy + PartialEq + Into<SocketAddr>> Steered<A> {
    pub fn load(object: &Path, vip: A, backends: &[A], remote: bool) -> Result<Self> {
        Self::load_sized(object, vip, backends, remote, 1 << 16)
    }

    /// [`Steered::load`] with a connection table of `conntrack_size`.
    pub fn load_sized(
        object: &Path,
        vip: A,
        backends: &[A],
        remote: bool,
        conntrack_size: u32,
    ) -> Result<Self> {
        let mut dataplane = Dataplane::load_with(
            object,
            LoadOptions {
                table_size: TABLE_SIZE,
                services: 1,
                conntrack_size,
            },
        )
        .context("loading the programs")?;
        let maps = dataplane.take_l4_maps()?;
        maps.set_generation(1)?;
        let service = maps.add_service(vip, 0, if remote { FLAG_REMOTE } else { 0 })?;
        let port = |addr: A| addr.into().port();
        maps.set_port_bits(port(vip), PORT_SERVICE)?;
        let reply = if remote {
            PORT_REPLY_INGRESS
        } else {
            PORT_REPLY_EGRESS
        };
        for (i, backend) in backends.iter().enumerate() {
            // A backend on the service's port shares its bits.
            let bits = if port(*backend) == port(vip) {
                PORT_SERVICE | reply
            } else {
                reply
            };
            maps.set_port_bits(port(*backend), bits)?;
            maps.set_backend_state(i as u32, *backend, BackendState::Routable)?;
        }
        let mut steered = Self {
            dataplane,
            maps,
            service,
            backends: backends.to_vec(),
            states: vec![BackendState::Routable; backends.len()],
        };
        steered.rebuild()?;
        Ok(steered)
    }

    /// Flips backend `i`'s state bit only, leaving the routable list stale
    /// for [`Steered::rebuild`], as the agent does on a breaker transition.
    pub fn set_state(&mut self, i: usize, state: BackendState) -> Result<()> {
        self.states[i] = state;
        self.maps
            .set_backend_state(i as u32, self.backends[i], state)?;
        Ok(())
    }

    /// Rebuilds the table over the live backends (every state but
    /// `Unused`), as the agent's table thread does when membership changes.
    pub fn rebuild(&mut self) -> Result<()> {
        let members: Vec<Member> = (0..self.backends.len())
            .filter(|&i| self.states[i] != BackendState::Unused)
            .map(|i| Member {
                index: i as u32,
                key: maglev::member_key(self.backends[i].into()),
            })
            .collect();
        let table = maglev::build(&members, TABLE_SIZE);
        let routable: Vec<u32> = (0..self.backends.len())
            .filter(|&i| self.states[i] == BackendState::Routable)
            .map(|i| i as u32)
            .collect();
        self.maps
            .update_service(&mut self.service, &routable, Some(&table))?;
        Ok(())
    }

    /// Which backend `addr` is.
    pub fn backend_of(&self, addr: A) -> Option<usize> {
        self.backends.iter().position(|b| *b == addr)
    }
}

/// A namespace standing in for a balancer host in remote mode, for test
/// runs whose route lookups must be real: the client-facing veth `lbc`
/// (10.99.1.1/24, 2001:db8:99:1::1/64) and the backend-facing one `lbw`
/// (10.99.2.1/24, 2001:db8:99:2::1/64) are the two ends of one pair, and
/// the client and backends (of either family) exist only as permanent
/// neighbour entries. Forwarding is on for both families.
pub struct Router {
    pub client_if: u32,
    pub backend_if: u32,
    pub client_if_mac: [u8; 6],
    pub backend_if_mac: [u8; 6],
}

impl Router {
    pub const CLIENT_IF: &str = "lbc";
    pub const BACKEND_IF: &str = "lbw";
    pub const CLIENT_MAC: [u8; 6] = [0x02, 0xcc, 0, 0, 0, 0x02];
    pub const BACKEND_MAC: [u8; 6] = [0x02, 0xbb, 0, 0, 0, 0x0b];

    /// Runs `test` inside a new router namespace (test runs look routes up
    /// in the namespace of the thread that starts them), deletes the
    /// namespace whatever happened, and returns what `test` returned,
    /// panicking on any failure along the way.
    pub fn run<A: Into<IpAddr> + Copy, T: Send + 'static>(
        prefix: &str,
        client: A,
        backends: &[A],
        timeout: std::time::Duration,
        test: impl FnOnce(Router) -> Result<T> + Send + 'static,
    ) -> T {
        let (ns, router) = Self::create(prefix, client, backends).expect("creating the namespace");
        let outcome = netns::run_in(ns.name(0), timeout, move || test(router));
        let deleted = ns.delete();
        let value = outcome
            .and_then(|inner| inner)
            .unwrap_or_else(|error| panic!("{error:#}"));
        deleted.expect("deleting the namespace");
        value
    }

    /// The namespace (deleted when dropped) and its interfaces. `client`
    /// must be in 10.99.1.0/24 or 2001:db8:99:1::/64, `backends` in
    /// 10.99.2.0/24 or 2001:db8:99:2::/64.
    pub fn create<A: Into<IpAddr> + Copy>(
        prefix: &str,
        client: A,
        backends: &[A],
    ) -> Result<(Namespaces, Router)> {
        let ns = Namespaces::create(prefix, 1)?;
        let name = ns.name(0).to_owned();
        let ip = |args: &[&str]| {
            let mut all = vec!["-n", name.as_str()];
            all.extend_from_slice(args);
            run("ip", &all)
        };
        let mac = |bytes: [u8; 6]| bytes.map(|b| format!("{b:02x}")).join(":");
        let (client_if, backend_if) = (Self::CLIENT_IF, Self::BACKEND_IF);
        ip(&[
            "link", "add", client_if, "type", "veth", "peer", "name", backend_if,
        ])?;
        ip(&["addr", "add", "10.99.1.1/24", "dev", client_if])?;
        ip(&["addr", "add", "10.99.2.1/24", "dev", backend_if])?;
        // No duplicate address detection: usable (and routed) at once.
        ip(&[
            "addr",
            "add",
            "2001:db8:99:1::1/64",
            "dev",
            client_if,
            "nodad",
        ])?;
        ip(&[
            "addr",
            "add",
            "2001:db8:99:2::1/64",
            "dev",
            backend_if,
            "nodad",
        ])?;
        for iface in [client_if, backend_if] {
            ip(&["link", "set", iface, "up"])?;
        }
        let neighbour = |addr: IpAddr, lladdr: [u8; 6], dev: &str| {
            let (addr, lladdr) = (addr.to_string(), mac(lladdr));
            ip(&[
                "neigh",
                "replace",
                &addr,
                "lladdr",
                &lladdr,
                "dev",
                dev,
                "nud",
                "permanent",
            ])
        };
        neighbour(client.into(), Self::CLIENT_MAC, client_if)?;
        for backend in backends {
            neighbour((*backend).into(), Self::BACKEND_MAC, backend_if)?;
        }
        run(
            "ip",
            &[
                "netns",
                "exec",
                &name,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
            ],
        )?;
        let router = Router {
            client_if: ifindex(&name, client_if)?,
            backend_if: ifindex(&name, backend_if)?,
            client_if_mac: link_mac(&name, client_if)?,
            backend_if_mac: link_mac(&name, backend_if)?,
        };
        Ok((ns, router))
    }
}

/// The index of interface `iface` in namespace `ns`.
pub fn ifindex(ns: &str, iface: &str) -> Result<u32> {
    let text = run("ip", &["-n", ns, "-o", "link", "show", "dev", iface])?;
    text.split(':')
        .next()
        .and_then(|n| n.trim().parse().ok())
        .with_context(|| format!("no ifindex in {text:?}"))
}

/// The MAC address of interface `iface` in namespace `ns`.
pub fn link_mac(ns: &str, iface: &str) -> Result<[u8; 6]> {
    let text = run("ip", &["-n", ns, "-o", "link", "show", "dev", iface])?;
    let word = text
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .with_context(|| format!("no MAC in {text:?}"))?;
    let mut mac = [0; 6];
    for (slot, part) in mac.iter_mut().zip(word.split(':')) {
        *slot = u8::from_str_radix(part, 16)?;
    }
    Ok(mac)
}

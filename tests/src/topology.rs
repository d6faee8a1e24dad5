//! The network namespaces the L4 end-to-end tests run in, in either
//! forwarding mode and either address family, and the runtimes inside them.
//!
//! - **Local mode**: two namespaces, the client's and the balancer's (the
//!   gateway and every worker), joined by one veth.
//! - **Remote mode**: the client's, the balancer's (which routes) and one
//!   namespace per worker, each worker on a veth of its own to the
//!   balancer, with its default route through it (replies go back through
//!   the balancer, which restores the service address).
//!
//! Every link is dual-stack; the [`Family`] of a [`Layout`] says which
//! addresses its service and workers use. IPv4 addresses are in
//! `10.<net>.0.0/16`, IPv6 ones in `fd00:0:<net>::/48` (`net` chosen by the
//! test, its decimal digits in both), subnet `s`, host `h` being
//! `10.<net>.<s>.<h>/24` and `fd00:0:<net>:<s>::<h>/64`: the client's
//! link is subnet 0 (balancer host 1, client host 2), worker `i`'s link
//! (remote mode, from 1) subnet `i` (balancer host 1, worker host 2), and
//! the service address host 1 of subnet 100, port 80, routed by the client
//! to the balancer, which owns it only in the XDP program. Nothing is sent
//! outside the namespaces.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::{Context, Result, bail};
use balancer::gateway::Gateway;
use balancer_dataplane::steering::ForwardMode;
use balancer_mock_worker::MockWorker;

use crate::netns::{Namespaces, run};
use crate::ns_runtime::NsRuntime;

/// Workers of every topology.
pub const WORKERS: usize = 3;
/// The names the demo workers answer with (`x-mock-worker`), by index.
pub const NAMES: [&str; WORKERS] = ["a", "b", "c"];
/// The client's interface.
pub const CLIENT_IF: &str = "cl0";
/// The balancer's interface toward the client.
pub const FRONT_IF: &str = "lbc";
/// A worker's interface toward the balancer (remote mode).
pub const WORKER_IF: &str = "wk0";

/// The balancer's interface toward worker `i` (remote mode, from 1).
pub fn back_if(i: usize) -> String {
    format!("lbw{i}")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Gateway and workers in one namespace, the client in another.
    Local,
    /// Client, balancer (routing) and one namespace per worker.
    Remote,
}

impl Mode {
    pub fn forward(self) -> ForwardMode {
        match self {
            Self::Local => ForwardMode::Local,
            Self::Remote => ForwardMode::Remote,
        }
    }

    /// How many namespaces the topology has.
    pub fn namespaces(self) -> usize {
        match self {
            Self::Local => 2,
            Self::Remote => 2 + WORKERS,
        }
    }

    /// The balancer's interfaces the program is attached to.
    pub fn ifaces(self) -> Vec<String> {
        match self {
            Self::Local => vec![FRONT_IF.to_owned()],
            Self::Remote => std::iter::once(FRONT_IF.to_owned())
                .chain((1..=WORKERS).map(back_if))
                .collect(),
        }
    }
}

/// The address family a topology's service and workers use (every link
/// carries both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// The addresses of a topology: its mode, the family its service and
/// workers use, and the number all its addresses derive from. A plain
/// value, for threads in other namespaces.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub mode: Mode,
    pub family: Family,
    pub net: u8,
}

impl Layout {
    pub const fn new(mode: Mode, family: Family, net: u8) -> Self {
        Self { mode, family, net }
    }

    /// Host `host` of subnet `subnet`, in the layout's family.
    pub fn addr(self, subnet: u8, host: u8) -> IpAddr {
        match self.family {
            Family::V4 => v4(self.net, subnet, host).into(),
            Family::V6 => v6(self.net, subnet, host).into(),
        }
    }

    /// Host `host` of the client's subnet.
    pub fn host(self, host: u8) -> IpAddr {
        self.addr(0, host)
    }

    pub fn client_ip(self) -> IpAddr {
        self.host(2)
    }

    /// The balancer's address on the client's link.
    pub fn front_ip(self) -> IpAddr {
        self.host(1)
    }

    /// The service address.
    pub fn vip(self) -> SocketAddr {
        SocketAddr::new(self.addr(100, 1), 80)
    }

    /// Remote mode: worker `i`'s address (from 1).
    pub fn worker_ip(self, i: usize) -> IpAddr {
        self.addr(i as u8, 2)
    }

    /// Where worker `i` (from 0) listens, on a free port: the balancer's
    /// address in local mode, its own namespace's in remote mode.
    pub fn worker_listen(self, i: usize) -> SocketAddr {
        match self.mode {
            Mode::Local => SocketAddr::new(self.front_ip(), 0),
            Mode::Remote => SocketAddr::new(self.worker_ip(i + 1), 0),
        }
    }
}

fn v4(net: u8, subnet: u8, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, net, subnet, host)
}

/// The IPv6 twin of [`v4`]'s address, each number's decimal digits
/// written as its group's hex ones (`10.77.100.1` is `fd00:0:77:100::1`),
/// so that the two read alike in logs.
fn v6(net: u8, subnet: u8, host: u8) -> Ipv6Addr {
    let group = |n: u8| u16::from_str_radix(&n.to_string(), 16).expect("decimal digits");
    Ipv6Addr::new(0xfd00, 0, group(net), group(subnet), 0, 0, 0, group(host))
}

/// The namespaces of a [`Layout`], linked and routed; deleted by
/// [`Topology::delete`] (or, reporting failures only on stderr, when
/// dropped).
pub struct Topology {
    pub layout: Layout,
    namespaces: Namespaces,
    /// 0: client, 1: balancer, then the workers' (remote mode).
    names: Vec<String>,
}

impl Topology {
    /// Creates the namespaces (named after `prefix`, see
    /// [`Namespaces::create`]) and sets up their links and routes.
    pub fn create(prefix: &str, layout: Layout) -> Result<Self> {
        let count = layout.mode.namespaces();
        let namespaces = Namespaces::create(prefix, count).context("creating namespaces")?;
        let names = (0..count).map(|i| namespaces.name(i).to_owned()).collect();
        let topology = Self {
            layout,
            namespaces,
            names,
        };
        // On failure the namespaces go with `topology`.
        topology.connect().context("setting up the topology")?;
        Ok(topology)
    }

    /// Runs `test` in a topology created for it, which is deleted
    /// afterwards whatever happened; the test's error comes first.
    pub fn run<T>(
        prefix: &str,
        layout: Layout,
        test: impl FnOnce(&Self) -> Result<T>,
    ) -> Result<T> {
        let topology = Self::create(prefix, layout)?;
        let outcome = test(&topology);
        let deleted = topology.delete();
        let value = outcome?;
        deleted?;
        Ok(value)
    }

    pub fn client(&self) -> &str {
        &self.names[0]
    }

    pub fn balancer(&self) -> &str {
        &self.names[1]
    }

    /// The namespace worker `i` (from 0) listens in: the balancer's in
    /// local mode.
    pub fn worker_ns(&self, i: usize) -> &str {
        match self.layout.mode {
            Mode::Local => self.balancer(),
            Mode::Remote => &self.names[2 + i],
        }
    }

    /// Deletes the namespaces now, reporting failures.
    pub fn delete(self) -> Result<()> {
        self.namespaces.delete()
    }

    /// The runtimes of the balancer's namespace and of each worker's.
    pub fn runtimes(&self) -> Result<Runtimes> {
        let workers = (0..WORKERS)
            .map(|i| NsRuntime::new(self.worker_ns(i)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Runtimes {
            layout: self.layout,
            balancer: NsRuntime::new(self.balancer())?,
            workers,
        })
    }

    fn connect(&self) -> Result<()> {
        let net = self.layout.net;
        let (client, balancer) = (self.client(), self.balancer());
        if let Mode::Remote = self.layout.mode {
            // The balancer routes, and sees replies from the VIP, which it
            // does not own, arriving from the workers' side.
            for setting in [
                "net.ipv4.ip_forward=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
                "net.ipv6.conf.all.forwarding=1",
            ] {
                ns_exec(balancer, &["sysctl", "-qw", setting])?;
            }
        }
        link((client, CLIENT_IF, 0, 2), (balancer, FRONT_IF, 0, 1), net)?;
        // The service's address of each family, through the balancer.
        route(client, Some((100, 1)), (0, 1), net)?;
        if let Mode::Remote = self.layout.mode {
            for i in 1..=WORKERS {
                let (worker, subnet) = (self.worker_ns(i - 1), i as u8);
                link(
                    (balancer, &back_if(i), subnet, 1),
                    (worker, WORKER_IF, subnet, 2),
                    net,
                )?;
                // Replies go back through the balancer, which restores the
                // VIP.
                route(worker, None, (subnet, 1), net)?;
            }
        }
        Ok(())
    }
}

/// Runs a command inside namespace `ns` (`ip netns exec`).
pub fn ns_exec(ns: &str, args: &[&str]) -> Result<String> {
    let mut all = vec!["netns", "exec", ns];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// A veth between two namespaces (namespace, interface, and the subnet
/// and host of its addresses under `net`), addressed in both families
/// (IPv6 without duplicate address detection, so the addresses are usable
/// at once) and up, with full checksums on transmit (offloaded, partial
/// ones would let wrong checksum arithmetic go unnoticed) and GRO on
/// receive (a frame XDP redirects into a veth is only delivered when the
/// far end runs NAPI).
pub fn link(a: (&str, &str, u8, u8), b: (&str, &str, u8, u8), net: u8) -> Result<()> {
    run(
        "ip",
        &[
            "link", "add", a.1, "netns", a.0, "type", "veth", "peer", "name", b.1, "netns", b.0,
        ],
    )?;
    for (ns, iface, subnet, host) in [a, b] {
        let v4 = format!("{}/24", v4(net, subnet, host));
        let v6 = format!("{}/64", v6(net, subnet, host));
        run("ip", &["-n", ns, "addr", "add", &v4, "dev", iface])?;
        run("ip", &["-n", ns, "addr", "add", &v6, "dev", iface, "nodad"])?;
        run("ip", &["-n", ns, "link", "set", iface, "up"])?;
        ns_exec(ns, &["ethtool", "-K", iface, "tx", "off", "gro", "on"])?;
    }
    Ok(())
}

/// In `ns`, routes to host `to` (subnet, host; `None` for the default
/// route) via host `via`, in both families.
fn route(ns: &str, to: Option<(u8, u8)>, via: (u8, u8), net: u8) -> Result<()> {
    let (to4, to6) = match to {
        Some((subnet, host)) => (
            format!("{}/32", v4(net, subnet, host)),
            format!("{}/128", v6(net, subnet, host)),
        ),
        None => ("default".to_owned(), "default".to_owned()),
    };
    let (via4, via6) = (v4(net, via.0, via.1), v6(net, via.0, via.1));
    run(
        "ip",
        &[
            "-n",
            ns,
            "-4",
            "route",
            "add",
            &to4,
            "via",
            &via4.to_string(),
        ],
    )?;
    run(
        "ip",
        &[
            "-n",
            ns,
            "-6",
            "route",
            "add",
            &to6,
            "via",
            &via6.to_string(),
        ],
    )?;
    Ok(())
}

/// The runtimes in a topology's namespaces: the balancer's, which the
/// gateway runs on, and one per worker, in the worker's namespace (the
/// balancer's in local mode). Never the gateway's: starting it blocks its
/// runtime's thread for seconds (the verifier checks the programs), which
/// would hold back a worker's answers meanwhile.
pub struct Runtimes {
    layout: Layout,
    pub balancer: NsRuntime,
    workers: Vec<NsRuntime>,
}

impl Runtimes {
    /// The runtime worker `i` (from 0) runs on.
    pub fn worker(&self, i: usize) -> &NsRuntime {
        &self.workers[i]
    }

    /// Starts the demo workers, worker `i` named `NAMES[i]` on a free port
    /// of [`Layout::worker_listen`]; on a failure the ones started are
    /// stopped.
    pub fn start_workers(&self) -> Result<Vec<MockWorker>> {
        let mut workers = Vec::new();
        for (i, name) in NAMES.iter().enumerate() {
            match self.worker(i).worker(self.layout.worker_listen(i), name) {
                Ok(worker) => workers.push(worker),
                Err(error) => {
                    if let Err(stopping) = self.stop_workers(workers.into_iter().enumerate()) {
                        eprintln!("cleanup: {stopping:#}");
                    }
                    return Err(error);
                }
            }
        }
        Ok(workers)
    }

    /// After a test: stops the gateway, if one runs, then the workers (each
    /// with its index), all of them whatever fails; the first failure.
    pub fn shutdown(
        &self,
        gw: Option<Gateway>,
        workers: impl IntoIterator<Item = (usize, MockWorker)>,
    ) -> Result<()> {
        let stopped = gw.map_or(Ok(()), |gw| self.balancer.run(gw.shutdown()));
        let workers_stopped = self.stop_workers(workers);
        stopped.context("stopping the gateway")?;
        workers_stopped.context("stopping the workers")
    }

    /// Stops workers (each with its index), every one of them even when
    /// some fail.
    pub fn stop_workers(
        &self,
        workers: impl IntoIterator<Item = (usize, MockWorker)>,
    ) -> Result<()> {
        let mut failures = Vec::new();
        for (i, worker) in workers {
            if let Err(error) = self.worker(i).run(worker.shutdown()) {
                failures.push(format!("worker {i}: {error:#}"));
            }
        }
        if !failures.is_empty() {
            bail!("stopping workers: {}", failures.join("; "));
        }
        Ok(())
    }
}

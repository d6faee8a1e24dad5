//! The network namespaces the L4 end-to-end tests run in, in either
//! forwarding mode, and the runtimes inside them.
//!
//! - **Local mode**: two namespaces, the client's and the balancer's (the
//!   gateway and every worker), joined by one veth.
//! - **Remote mode**: the client's, the balancer's (which routes) and one
//!   namespace per worker, each worker on a veth of its own to the
//!   balancer, with its default route through it (replies go back through
//!   the balancer, which restores the service address).
//!
//! Every address is in `10.<net>.0.0/16`, `net` chosen by the test (tests
//! that may run at once use distinct ones): the client's link is
//! `10.<net>.0.0/24` (balancer `.1`, client `.2`), worker `i`'s link (remote
//! mode, from 1) `10.<net>.<i>.0/24` (balancer `.1`, worker `.2`), and the
//! service address `10.<net>.100.1:80`, routed by the client to the
//! balancer, which owns it only in the XDP program. Nothing is sent outside
//! the namespaces.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

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

/// The addresses of a topology: its mode and the second octet of all of
/// them. A plain value, for threads in other namespaces.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub mode: Mode,
    pub net: u8,
}

impl Layout {
    pub const fn new(mode: Mode, net: u8) -> Self {
        Self { mode, net }
    }

    /// Host `host` of the client's subnet.
    pub fn host(self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net, 0, host)
    }

    pub fn client_ip(self) -> Ipv4Addr {
        self.host(2)
    }

    /// The balancer's address on the client's link.
    pub fn front_ip(self) -> Ipv4Addr {
        self.host(1)
    }

    /// The service address.
    pub fn vip(self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, self.net, 100, 1), 80)
    }

    /// Remote mode: worker `i`'s address (from 1).
    pub fn worker_ip(self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net, i as u8, 2)
    }

    /// Remote mode: the balancer's side of worker `i`'s link (from 1).
    pub fn worker_gateway(self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.net, i as u8, 1)
    }

    /// Where worker `i` (from 0) listens, on a free port: the balancer's
    /// address in local mode, its own namespace's in remote mode.
    pub fn worker_listen(self, i: usize) -> SocketAddr {
        match self.mode {
            Mode::Local => SocketAddr::from((self.front_ip(), 0)),
            Mode::Remote => SocketAddr::from((self.worker_ip(i + 1), 0)),
        }
    }
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

    /// The runtimes of the balancer's namespace and (remote mode) of each
    /// worker's.
    pub fn runtimes(&self) -> Result<Runtimes> {
        let workers = self.names[2..]
            .iter()
            .map(|ns| NsRuntime::new(ns))
            .collect::<Result<Vec<_>>>()?;
        Ok(Runtimes {
            layout: self.layout,
            balancer: NsRuntime::new(self.balancer())?,
            workers,
        })
    }

    fn connect(&self) -> Result<()> {
        let layout = self.layout;
        let (client, balancer) = (self.client(), self.balancer());
        if let Mode::Remote = layout.mode {
            // The balancer routes, and sees replies from the VIP, which it
            // does not own, arriving from the workers' side.
            for setting in [
                "net.ipv4.ip_forward=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ] {
                ns_exec(balancer, &["sysctl", "-qw", setting])?;
            }
        }
        link(
            (client, CLIENT_IF, layout.client_ip()),
            (balancer, FRONT_IF, layout.front_ip()),
        )?;
        route(
            client,
            &format!("{}/32", layout.vip().ip()),
            layout.front_ip(),
        )?;
        if let Mode::Remote = layout.mode {
            for i in 1..=WORKERS {
                let worker = self.worker_ns(i - 1);
                link(
                    (balancer, &back_if(i), layout.worker_gateway(i)),
                    (worker, WORKER_IF, layout.worker_ip(i)),
                )?;
                // Replies go back through the balancer, which restores the
                // VIP.
                route(worker, "default", layout.worker_gateway(i))?;
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

/// A veth between two namespaces (namespace, interface, address on a
/// `/24`), addressed and up, with full checksums on transmit (offloaded,
/// partial ones would let wrong checksum arithmetic go unnoticed) and GRO
/// on receive (a frame XDP redirects into a veth is only delivered when the
/// far end runs NAPI).
pub fn link(a: (&str, &str, Ipv4Addr), b: (&str, &str, Ipv4Addr)) -> Result<()> {
    run(
        "ip",
        &[
            "link", "add", a.1, "netns", a.0, "type", "veth", "peer", "name", b.1, "netns", b.0,
        ],
    )?;
    for (ns, iface, ip) in [a, b] {
        run(
            "ip",
            &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", iface],
        )?;
        run("ip", &["-n", ns, "link", "set", iface, "up"])?;
        ns_exec(ns, &["ethtool", "-K", iface, "tx", "off", "gro", "on"])?;
    }
    Ok(())
}

fn route(ns: &str, to: &str, via: Ipv4Addr) -> Result<()> {
    run(
        "ip",
        &["-n", ns, "route", "add", to, "via", &via.to_string()],
    )?;
    Ok(())
}

/// The runtimes in a topology's namespaces: the balancer's, which the
/// gateway runs on (and in local mode the workers too), and in remote mode
/// one per worker namespace.
pub struct Runtimes {
    layout: Layout,
    pub balancer: NsRuntime,
    workers: Vec<NsRuntime>,
}

impl Runtimes {
    /// The runtime worker `i` (from 0) runs on.
    pub fn worker(&self, i: usize) -> &NsRuntime {
        match self.layout.mode {
            Mode::Local => &self.balancer,
            Mode::Remote => &self.workers[i],
        }
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

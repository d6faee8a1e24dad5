//! Fleet verdicts reach the XDP datapath: a worker the fleet isolates gets
//! no new L4 connection, in both modes and with workers of either family,
//! on the topology of the other XDP tests (`balancer_tests::topology`). The gateway runs with
//! `--fleet-verdicts` against a real etcd on the balancer namespace's
//! loopback; two other replicas exist only as keys under a lease (what
//! etcd holds of a live replica is exactly that), so the quorum forms and
//! clears when the test says. The gateway's own breaker threshold is out
//! of reach: nothing but the fleet can isolate B.
//!
//! Addresses are inside the namespaces the test creates; nothing is sent
//! anywhere else.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use balancer::config::GatewayConfig;
use balancer::discovery::etcd::EtcdConfig;
use balancer::fleet::FleetConfig;
use balancer_common::l4::BackendState;
use balancer_core::breaker::State;
use balancer_dataplane::steering::L4Config;
use balancer_tests::ebpf_prerequisites;
use balancer_tests::etcd::{Etcd, etcd_binary};
use balancer_tests::l4e2e::{self, B, Running, Scenario, wait};
use balancer_tests::topology::{Family, Layout, Mode, Topology};

/// How long the fleet may take to reach the kernel: the second for
/// the breaker, with room for the map sync on a loaded machine.
const BOUND: Duration = Duration::from_secs(5);

#[test]
fn local_mode_gives_a_fleet_isolated_ipv4_worker_no_new_connection() {
    fleet_isolation(Mode::Local, Family::V4);
}

#[test]
fn local_mode_gives_a_fleet_isolated_ipv6_worker_no_new_connection() {
    fleet_isolation(Mode::Local, Family::V6);
}

#[test]
fn remote_mode_gives_a_fleet_isolated_ipv4_worker_no_new_connection() {
    fleet_isolation(Mode::Remote, Family::V4);
}

#[test]
fn remote_mode_gives_a_fleet_isolated_ipv6_worker_no_new_connection() {
    fleet_isolation(Mode::Remote, Family::V6);
}

fn fleet_isolation(mode: Mode, family: Family) {
    if ebpf_prerequisites().is_none() || etcd_binary().is_none() {
        return;
    }
    let layout = Layout::new(mode, family, 95);
    Topology::run("bt-l4fl", layout, exercise).unwrap_or_else(|error| panic!("{error:#}"));
}

fn exercise(topology: &Topology) -> Result<()> {
    let etcd = Etcd::start_in(Some(topology.balancer())).context("etcd")?;
    let adjust = |config: &mut GatewayConfig, _: &mut L4Config| {
        config.breaker.settings.failure_threshold = u32::MAX;
        config.etcd = Some(EtcdConfig {
            endpoints: vec![etcd.url()],
            prefix: "/balancer/".into(),
        });
        config.fleet = Some(FleetConfig {
            replica_id: "gateway".into(),
            quorum: 2,
            lease: Duration::from_secs(10),
        });
    };
    // The gateway stops before etcd, dropped on return.
    l4e2e::run_gateway(topology, adjust, |gateway| {
        isolated_by_the_fleet(topology, gateway, &etcd)
    })
}

fn isolated_by_the_fleet(topology: &Topology, gateway: &Running, etcd: &Etcd) -> Result<()> {
    let (driver, urls) = (gateway.driver, gateway.driver.urls);
    let scenario = Scenario::new(topology, driver, gateway.workers, gateway.clock);
    driver.ready(BOUND).and_then(|()| {
        let leases = RefCell::new(Vec::new());
        scenario.breaker_holds_b_back(
            || {
                // One verdict is below the quorum: B stays routable.
                leases
                    .borrow_mut()
                    .push(etcd.key_only_replica("r1", &urls[B], 60));
                wait("r1's verdict seen", BOUND, || {
                    Ok(driver
                        .metrics()?
                        .get(&format!(
                            "balancer_fleet_open_verdicts{{worker=\"{}\"}}",
                            urls[B]
                        ))
                        .unwrap_or(0.0)
                        == 1.0)
                })?;
                let b = driver.worker(B)?;
                ensure!(b.breaker.state() == State::Closed, "one verdict opened B");
                ensure!(
                    driver.kernel_state(&b)? == Some(BackendState::Routable),
                    "one verdict changed B in the kernel"
                );
                // The second forms it.
                let formed = Instant::now();
                leases
                    .borrow_mut()
                    .push(etcd.key_only_replica("r2", &urls[B], 60));
                driver.wait_kernel_state(B, BackendState::Isolated, BOUND)?;
                let snapshot = b.breaker.snapshot();
                ensure!(
                    snapshot.fleet_opened && snapshot.failures_total() == 0,
                    "B isolated by something else than the fleet: {snapshot:?}"
                );
                eprintln!(
                    "kernel isolated B {:?} after the quorum's second verdict was put",
                    formed.elapsed()
                );
                Ok(())
            },
            || {
                // The quorum clears: B's breaker goes half-open, and its
                // trial (an L7 request) closes it.
                for lease in leases.borrow().iter() {
                    etcd.ctl(etcd.client_port, &["lease", "revoke", lease]);
                }
                wait("B half-open after the quorum cleared", BOUND, || {
                    Ok(driver.worker(B)?.breaker.state() == State::HalfOpen)
                })
            },
        )
    })
}

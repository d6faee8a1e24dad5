//! Fleet verdicts (`--fleet-verdicts`) through a real etcd on loopback:
//! three in-process replicas in front of one worker, and replicas that
//! exist only as keys under a lease (what etcd sees of a replica that was
//! killed is exactly that: keys whose lease nobody renews). Each test starts
//! its own etcd and stops it by PID; every wait is bounded.

use std::time::Duration;

use balancer::config::GatewayConfig;
use balancer::discovery::etcd::EtcdConfig;
use balancer::fleet::FleetConfig;
use balancer::gateway::Gateway;
use balancer_core::breaker::{Snapshot, State};
use balancer_core::clock::ManualClock;
use balancer_core::fleet::worker_key;
use balancer_mock_worker::{MockWorker, MockWorkerConfig};
use balancer_tests::etcd::Etcd;
use balancer_tests::gateway::{CHAT, Harness, always, harness_with_urls, quiet};
use http::Method;

const LEASE: Duration = Duration::from_secs(2);

async fn worker() -> MockWorker {
    MockWorker::spawn(([127, 0, 0, 1], 0).into(), MockWorkerConfig::named("a"))
        .await
        .unwrap()
}

fn fleet_config(c: &mut GatewayConfig, etcd: &Etcd, id: &str, threshold: u32) {
    quiet(c);
    c.breaker.settings.failure_threshold = threshold;
    c.breaker.settings.success_threshold = 1;
    c.breaker.settings.open_timeout = Duration::from_secs(30);
    c.etcd = Some(EtcdConfig {
        endpoints: vec![etcd.url()],
        prefix: "/balancer/".into(),
    });
    c.fleet = Some(FleetConfig {
        replica_id: id.into(),
        quorum: 2,
        lease: LEASE,
    });
}

/// A replica `id` in front of `url`, opening its own breaker after
/// `threshold` failed requests (`u32::MAX`: never on its own evidence).
async fn replica(etcd: &Etcd, url: &str, id: &str, threshold: u32) -> Harness {
    harness_with_urls(&[url.to_owned()], |c| fleet_config(c, etcd, id, threshold)).await
}

fn breaker(h: &Harness, url: &str) -> Snapshot {
    h.gw.registry
        .fleet()
        .get(url)
        .expect("worker registered")
        .breaker
        .snapshot()
}

/// Within `limit`, checked every 20 ms.
async fn within(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends chats through `h` until its own breaker on `url` opens.
async fn trip(h: &Harness, url: &str) {
    for _ in 0..20 {
        if breaker(h, url).state == State::Open {
            return;
        }
        h.chat(CHAT).await;
    }
    panic!("the breaker on {url} did not open");
}

/// A metric sample's value as the exposition writes it.
async fn sample(h: &Harness, series: &str) -> Option<f64> {
    let text = h.metrics().await;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// Waits (at most `limit`) until `series` reads `value` on `h`.
async fn reaches(h: &Harness, series: &str, value: f64, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let seen = sample(h, series).await;
        if seen == Some(value) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} is {seen:?}, not {value}, after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every key under the default prefix, one per line.
fn keys(etcd: &Etcd) -> String {
    etcd.ctl(
        etcd.client_port,
        &["get", "--prefix", "--keys-only", "/balancer/"],
    )
}

#[tokio::test]
async fn a_quorum_isolates_on_a_replica_that_saw_no_failure_and_recovery_follows_it() {
    let Some(etcd) = Etcd::start() else { return };
    let a = worker().await;
    let url = a.url();
    let r1 = replica(&etcd, &url, "r1", 1).await;
    let r2 = replica(&etcd, &url, "r2", 1).await;
    // Its own threshold is out of reach: only the fleet can isolate here.
    let r3 = replica(&etcd, &url, "r3", u32::MAX).await;
    let open_verdicts = format!("balancer_fleet_open_verdicts{{worker=\"{url}\"}}");
    for h in [&r1, &r2, &r3] {
        reaches(h, "balancer_fleet_replicas", 3.0, Duration::from_secs(2)).await;
    }

    a.set_fault(always(500));
    trip(&r1, &url).await;
    // Below the quorum: r3 sees the one verdict and changes nothing.
    reaches(&r3, &open_verdicts, 1.0, Duration::from_secs(1)).await;
    assert_eq!(breaker(&r3, &url).state, State::Closed);
    assert_eq!(breaker(&r2, &url).state, State::Closed);

    // The second verdict forms the quorum: r3 isolates within a second.
    trip(&r2, &url).await;
    within(Duration::from_secs(1), "r3 isolated by the fleet", || {
        let s = breaker(&r3, &url);
        s.state == State::Open && s.fleet_opened
    })
    .await;
    let snap = breaker(&r3, &url);
    assert_eq!(snap.failures_total(), 0, "r3 saw no failure");
    assert_eq!(
        snap.transitions[State::Closed as usize][State::Open as usize],
        1
    );
    let id = r3.gw.registry.fleet().get(&url).unwrap().id.clone();
    let view = r3
        .admin(Method::GET, &format!("/workers/{id}"), "")
        .await
        .json();
    assert_eq!(view["fleet_verdicts"], serde_json::json!(["r1", "r2"]));
    assert_eq!(view["breaker"]["state"], "open");
    let isolations = format!("balancer_fleet_isolations_total{{worker=\"{url}\"}}");
    assert_eq!(sample(&r3, &isolations).await, Some(1.0));
    assert_eq!(sample(&r3, &open_verdicts).await, Some(2.0));
    // No request reaches the worker through r3.
    let before = a.stats().inference_requests;
    assert_eq!(
        r3.chat(CHAT).await.status,
        http::StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(a.stats().inference_requests, before);
    // A fleet isolation writes no verdict of its own.
    let verdicts = etcd.ctl(
        etcd.client_port,
        &["get", "--prefix", "--keys-only", "/balancer/verdicts/"],
    );
    assert!(!verdicts.contains("/r3"), "{verdicts}");

    // Recovery follows the quorum: r1's trial succeeds, its verdict goes,
    // and r3's fleet isolation ends in half-open.
    a.clear_fault();
    r1.clock.advance(Duration::from_secs(30));
    r1.chat(CHAT).await;
    assert_eq!(breaker(&r1, &url).state, State::Closed);
    within(Duration::from_secs(1), "r3 half-open", || {
        breaker(&r3, &url).state == State::HalfOpen
    })
    .await;
    assert_eq!(
        breaker(&r2, &url).state,
        State::Open,
        "r2's own verdict stays"
    );
    assert_eq!(r3.chat(CHAT).await.status, http::StatusCode::OK);
    assert_eq!(breaker(&r3, &url).state, State::Closed);

    for h in [r1, r2, r3] {
        h.stop().await;
    }
    a.shutdown().await;
}

#[tokio::test]
async fn a_killed_replicas_verdicts_expire_with_its_lease() {
    let Some(etcd) = Etcd::start() else { return };
    let a = worker().await;
    let url = a.url();
    let h = replica(&etcd, &url, "r1", u32::MAX).await;
    etcd.key_only_replica("alive", &url, 60);
    etcd.key_only_replica("killed", &url, 2);
    within(Duration::from_secs(1), "isolated by the two", || {
        breaker(&h, &url).fleet_opened
    })
    .await;
    // Nobody renews "killed"'s lease: its keys go, the quorum with them.
    within(Duration::from_secs(5), "released to half-open", || {
        breaker(&h, &url).state == State::HalfOpen
    })
    .await;
    assert_eq!(sample(&h, "balancer_fleet_replicas").await, Some(2.0));
    h.stop().await;
    a.shutdown().await;
}

#[tokio::test]
async fn etcd_stopped_past_the_lease_lets_fleet_isolations_go_half_open() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let a = worker().await;
    let url = a.url();
    let h = replica(&etcd, &url, "r1", u32::MAX).await;
    etcd.key_only_replica("x", &url, 60);
    etcd.key_only_replica("y", &url, 60);
    within(Duration::from_secs(1), "isolated by the two", || {
        breaker(&h, &url).fleet_opened
    })
    .await;
    etcd.stop();
    // Within the lease nothing changes; past it, local evidence rules.
    h.clock.advance(LEASE);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(breaker(&h, &url).fleet_opened, "still within the lease");
    h.clock.advance(Duration::from_millis(1));
    within(Duration::from_secs(1), "half-open past the lease", || {
        breaker(&h, &url).state == State::HalfOpen
    })
    .await;
    // Back in touch, it re-reads the others' verdicts.
    etcd.run(etcd.client_port);
    reaches(&h, "balancer_fleet_replicas", 3.0, Duration::from_secs(6)).await;
    h.stop().await;
    a.shutdown().await;
}

#[tokio::test]
async fn a_replica_id_held_by_a_live_replica_is_refused() {
    let Some(etcd) = Etcd::start() else { return };
    let a = worker().await;
    let url = a.url();
    let first = replica(&etcd, &url, "same", 1).await;
    let mut config = GatewayConfig::with_worker_urls(std::slice::from_ref(&url));
    config.listen = ([127, 0, 0, 1], 0).into();
    config.metrics_listen = config.listen;
    config.admin_listen = config.listen;
    fleet_config(&mut config, &etcd, "same", 1);
    let clock = std::sync::Arc::new(ManualClock::new());
    let refused = Gateway::start_with_clock(config, clock).await;
    let error = format!("{:#}", refused.err().expect("refused"));
    assert!(error.contains("already holds this replica id"), "{error}");
    // The live one is untouched: its key still stands.
    let replicas = etcd.ctl(
        etcd.client_port,
        &["get", "--prefix", "--keys-only", "/balancer/replicas/"],
    );
    assert!(replicas.contains("/balancer/replicas/same"), "{replicas}");
    first.stop().await;
    a.shutdown().await;
}

#[tokio::test]
async fn without_fleet_verdicts_nothing_is_written_nor_published() {
    let Some(etcd) = Etcd::start() else { return };
    let a = worker().await;
    let url = a.url();
    let h = harness_with_urls(std::slice::from_ref(&url), |c| {
        fleet_config(c, &etcd, "unused", 1);
        c.fleet = None;
    })
    .await;
    a.set_fault(always(500));
    trip(&h, &url).await;
    let keys = etcd.ctl(etcd.client_port, &["get", "--prefix", "--keys-only", "/"]);
    assert!(keys.trim().is_empty(), "{keys}");
    assert!(!h.metrics().await.contains("fleet_"));
    h.stop().await;
    a.shutdown().await;
}

#[tokio::test]
async fn back_in_touch_a_replica_rewrites_its_verdicts() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let a = worker().await;
    let url = a.url();
    let h = replica(&etcd, &url, "r1", 1).await;
    a.set_fault(always(500));
    trip(&h, &url).await;
    let verdict = format!("/balancer/verdicts/{}/r1", worker_key(&url));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while !keys(&etcd).contains(&verdict) {
        assert!(tokio::time::Instant::now() < deadline, "verdict written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The store comes back empty (rebuilt): the replica registers again
    // and puts its verdict back, its breaker still open.
    etcd.stop();
    std::fs::remove_dir_all(&etcd.dir).unwrap();
    etcd.run(etcd.client_port);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    loop {
        let now = keys(&etcd);
        if now.contains(&verdict) && now.contains("/balancer/replicas/r1") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not rewritten: {now}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let value = etcd.ctl(etcd.client_port, &["get", "--print-value-only", &verdict]);
    let value: serde_json::Value = serde_json::from_str(value.trim()).unwrap();
    assert_eq!(value["state"], "open");
    assert_eq!(value["reason"], "failure_threshold");
    assert!(value["since"].as_u64().unwrap() > 0);
    h.stop().await;
    a.shutdown().await;
}

//! Worker discovery through a real etcd on loopback: workers at start, put,
//! update, delete, lease expiry, bad values, etcd down and back, and the
//! registration sidecar. Each test starts its own etcd and stops it by PID.

use std::time::Duration;

use balancer::discovery::etcd::{EtcdConfig, Registration, register};
use balancer_core::spec::WorkerSpec;
use balancer_mock_worker::{MockWorker, MockWorkerConfig};
use balancer_tests::agent::AgentProcess;
use balancer_tests::balancer_binary;
use balancer_tests::etcd::Etcd;
use balancer_tests::gateway::{CHAT, Harness, eventually, harness_with_urls, quiet};
use http::{Method, StatusCode};

const KEY: &str = "/balancer/workers/";

async fn demo(name: &str) -> MockWorker {
    MockWorker::spawn(([127, 0, 0, 1], 0).into(), MockWorkerConfig::named(name))
        .await
        .unwrap()
}

fn value(url: &str) -> String {
    format!(r#"{{"url":"{url}","model":"demo-model"}}"#)
}

async fn gateway(etcd: &Etcd, static_urls: &[String]) -> Harness {
    let url = etcd.url();
    harness_with_urls(static_urls, move |c| {
        quiet(c);
        c.etcd = Some(EtcdConfig {
            endpoints: vec![url],
            prefix: "/balancer/".into(),
        });
    })
    .await
}

fn served(h: &Harness, url: &str) -> bool {
    h.gw.registry.fleet().get(url).is_some()
}

/// Within `limit` (the contract's bound), checked every 20 ms.
async fn within(limit: Duration, what: &str, check: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn workers_in_etcd_at_start_are_served_beside_static_ones() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b) = (demo("a").await, demo("b").await);
    etcd.ctl(
        etcd.client_port,
        &["put", &format!("{KEY}a"), &value(&a.url())],
    );
    let h = gateway(&etcd, &[b.url()]).await;
    assert!(served(&h, &a.url()) && served(&h, &b.url()));
    assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
    h.stop().await;
}

#[tokio::test]
async fn a_put_adds_or_updates_and_a_delete_drains_and_removes_within_a_second() {
    let Some(etcd) = Etcd::start() else { return };
    let a = demo("a").await;
    let h = gateway(&etcd, &[]).await;
    let key = format!("{KEY}a");
    etcd.ctl(etcd.client_port, &["put", &key, &value(&a.url())]);
    within(Duration::from_secs(1), "added", || served(&h, &a.url())).await;
    let listed = h.admin(Method::GET, "/workers", "").await.json();
    assert_eq!(
        listed["workers"][0]["url"],
        a.url().as_str(),
        "shown like a static worker"
    );
    let updated = format!(
        r#"{{"url":"{}","model":"demo-model","resilience":{{"cb_failure_threshold":7}}}}"#,
        a.url()
    );
    etcd.ctl(etcd.client_port, &["put", &key, &updated]);
    within(Duration::from_secs(1), "updated", || {
        h.gw.registry
            .fleet()
            .get(&a.url())
            .is_some_and(|w| w.breaker.settings().failure_threshold == 7)
    })
    .await;
    let effective = h.admin(Method::GET, "/workers", "").await.json();
    assert_eq!(
        effective["workers"][0]["effective"]["cb_failure_threshold"],
        7
    );
    etcd.ctl(etcd.client_port, &["del", &key]);
    within(Duration::from_secs(1), "removed", || !served(&h, &a.url())).await;
    h.stop().await;
}

#[tokio::test]
async fn an_expired_lease_removes_its_worker() {
    let Some(etcd) = Etcd::start() else { return };
    let a = demo("a").await;
    let h = gateway(&etcd, &[]).await;
    let granted = etcd.ctl(etcd.client_port, &["lease", "grant", "2"]);
    let lease = granted
        .split_whitespace()
        .nth(1)
        .expect("lease id")
        .to_owned();
    etcd.ctl(
        etcd.client_port,
        &[
            "put",
            &format!("{KEY}a"),
            &value(&a.url()),
            &format!("--lease={lease}"),
        ],
    );
    within(Duration::from_secs(1), "added", || served(&h, &a.url())).await;
    // Nobody keeps the lease alive: etcd expires it after its 2 s.
    within(Duration::from_secs(5), "removed at expiry", || {
        !served(&h, &a.url())
    })
    .await;
    h.stop().await;
}

#[tokio::test]
async fn bad_values_are_ignored_and_the_other_workers_untouched() {
    let Some(etcd) = Etcd::start() else { return };
    let a = demo("a").await;
    let h = gateway(&etcd, &[]).await;
    etcd.ctl(
        etcd.client_port,
        &["put", &format!("{KEY}a"), &value(&a.url())],
    );
    within(Duration::from_secs(1), "added", || served(&h, &a.url())).await;
    for (key, bad) in [
        ("json", "{not json".to_owned()),
        ("scheme", r#"{"url":"ftp://127.0.0.1:1"}"#.to_owned()),
        (
            "resilience",
            r#"{"url":"http://127.0.0.1:2","resilience":{"cb_failure_threshold":0}}"#.to_owned(),
        ),
        (
            "field",
            r#"{"url":"http://127.0.0.1:3","colour":"blue"}"#.to_owned(),
        ),
        // What `register --model ""` used to write: no request names it.
        (
            "empty-model",
            r#"{"url":"http://127.0.0.1:4","model":""}"#.to_owned(),
        ),
    ] {
        etcd.ctl(etcd.client_port, &["put", &format!("{KEY}{key}"), &bad]);
    }
    // A later good put proves the bad ones were read (and skipped) first.
    let b = demo("b").await;
    etcd.ctl(
        etcd.client_port,
        &["put", &format!("{KEY}b"), &value(&b.url())],
    );
    within(Duration::from_secs(1), "b added", || served(&h, &b.url())).await;
    assert_eq!(h.gw.registry.fleet().workers.len(), 2, "only a and b");
    h.stop().await;
}

/// An etcd that is down at start (refusing: no wait; silent: at most the
/// 3 s start-up wait) leaves the static workers serving, and the balancer
/// catches up when it answers.
#[tokio::test]
async fn an_etcd_away_at_start_delays_the_start_by_at_most_three_seconds_then_is_caught_up() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let (a, b) = (demo("a").await, demo("b").await);
    etcd.ctl(
        etcd.client_port,
        &["put", &format!("{KEY}a"), &value(&a.url())],
    );
    let port = etcd.client_port;
    for silent in [false, true] {
        if silent {
            etcd.run(port);
            etcd.freeze(true);
        } else {
            etcd.stop();
        }
        let started = tokio::time::Instant::now();
        let h = gateway(&etcd, &[b.url()]).await;
        let took = started.elapsed();
        let limit = Duration::from_secs(if silent { 5 } else { 2 });
        assert!(took < limit, "silent {silent}: the start took {took:?}");
        assert!(served(&h, &b.url()) && !served(&h, &a.url()));
        assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);
        if silent {
            etcd.freeze(false);
        } else {
            etcd.run(port);
        }
        // Reconnection backs off at most 2 s; a frozen etcd's connection
        // answers once thawed.
        within(Duration::from_secs(5), "caught up", || served(&h, &a.url())).await;
        h.stop().await;
    }
}

#[tokio::test]
async fn with_etcd_away_the_last_set_serves_and_its_return_resyncs() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let (a, b, c) = (demo("a").await, demo("b").await, demo("c").await);
    etcd.ctl(
        etcd.client_port,
        &["put", &format!("{KEY}a"), &value(&a.url())],
    );
    etcd.ctl(
        etcd.client_port,
        &["put", &format!("{KEY}b"), &value(&b.url())],
    );
    let h = gateway(&etcd, &[]).await;
    let up = |m: &str| m.contains("balancer_discovery_up{source=\"etcd\"} 1");
    let down = |m: &str| m.contains("balancer_discovery_up{source=\"etcd\"} 0");
    eventually("discovery up", || async { up(&h.metrics().await) }).await;

    // etcd goes away: nothing is removed, the gauge drops within 10 s.
    etcd.stop();
    let started = tokio::time::Instant::now();
    eventually("discovery down", || async { down(&h.metrics().await) }).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        served(&h, &a.url()) && served(&h, &b.url()),
        "the last known set"
    );
    assert_eq!(h.chat(CHAT).await.status, StatusCode::OK);

    // Meanwhile the fleet changes where this balancer cannot see it: etcd
    // runs on another port, B is deleted and C added.
    let elsewhere = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    etcd.run(elsewhere);
    etcd.ctl(elsewhere, &["del", &format!("{KEY}b")]);
    etcd.ctl(elsewhere, &["put", &format!("{KEY}c"), &value(&c.url())]);
    etcd.stop();

    // Back where the balancer looks: resynced within 3 s.
    let port = etcd.client_port;
    etcd.run(port);
    within(Duration::from_secs(3), "resynced", || {
        served(&h, &a.url()) && !served(&h, &b.url()) && served(&h, &c.url())
    })
    .await;
    eventually("discovery up again", || async { up(&h.metrics().await) }).await;
    // And watching again from the resynced revision.
    etcd.ctl(port, &["del", &format!("{KEY}a")]);
    within(Duration::from_secs(1), "a removed", || {
        !served(&h, &a.url())
    })
    .await;
    h.stop().await;
}

#[tokio::test]
async fn the_register_sidecar_keeps_a_lease_and_deletes_its_key_on_stop() {
    let Some(etcd) = Etcd::start() else { return };
    let a = demo("a").await;
    let h = gateway(&etcd, &[]).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sidecar = tokio::spawn(register(
        Registration {
            etcd: EtcdConfig {
                endpoints: vec![etcd.url()],
                prefix: "/balancer/".into(),
            },
            id: "a".into(),
            spec: WorkerSpec {
                model: Some("demo-model".into()),
                ..WorkerSpec::from_url(&a.url())
            },
            ttl: Duration::from_secs(2),
        },
        async {
            let _ = stopped.await;
        },
    ));
    within(Duration::from_secs(2), "registered", || {
        served(&h, &a.url())
    })
    .await;
    // Past the 2 s TTL the lease is still kept alive.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(served(&h, &a.url()), "the lease is renewed");
    let _ = stop.send(());
    sidecar.await.unwrap().unwrap();
    within(Duration::from_secs(1), "deregistered", || {
        !served(&h, &a.url())
    })
    .await;
    let left = etcd.ctl(etcd.client_port, &["get", "--prefix", KEY]);
    assert!(left.trim().is_empty(), "{left}");
    h.stop().await;
}

#[tokio::test]
async fn a_key_that_changes_or_comes_back_while_draining_keeps_its_worker() {
    let Some(etcd) = Etcd::start() else { return };
    let a = demo("a").await;
    let h = gateway(&etcd, &[]).await;
    let key = format!("{KEY}a");
    let with = |model: &str, resilience: &str| {
        format!(r#"{{"url":"{}","model":"{model}"{resilience}}}"#, a.url())
    };
    etcd.ctl(
        etcd.client_port,
        &[
            "put",
            &key,
            &with("demo-model", r#","resilience":{"cb_timeout_secs":5}"#),
        ],
    );
    within(Duration::from_secs(1), "added", || served(&h, &a.url())).await;
    let timeout = |h: &Harness| {
        h.gw.registry
            .fleet()
            .get(&a.url())
            .map(|w| w.breaker.settings().open_timeout)
    };
    // A resilience block that is dropped falls back to the defaults.
    etcd.ctl(etcd.client_port, &["put", &key, &with("demo-model", "")]);
    within(Duration::from_secs(1), "default timeout", || {
        timeout(&h) == Some(Duration::from_secs(60))
    })
    .await;
    // A new model replaces the worker under the same URL.
    etcd.ctl(etcd.client_port, &["put", &key, &with("other-model", "")]);
    within(Duration::from_secs(1), "new model", || {
        h.gw.registry
            .fleet()
            .get(&a.url())
            .is_some_and(|w| w.serves("other-model") && !w.is_draining())
    })
    .await;
    // Deleted and put back before its drain ends: it stays.
    a.set_fault(balancer_mock_worker::Fault {
        latency_ms: Some(1500),
        ..Default::default()
    });
    let slow = {
        let addr = h.gw.addr;
        tokio::spawn(async move {
            let body = r#"{"model":"other-model","messages":[]}"#;
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            use tokio::io::AsyncWriteExt;
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(head.as_bytes()).await.unwrap();
            let mut buf = [0u8; 64];
            use tokio::io::AsyncReadExt;
            let _ = s.read(&mut buf).await;
        })
    };
    eventually("in flight", || {
        std::future::ready(
            h.gw.registry
                .fleet()
                .get(&a.url())
                .is_some_and(|w| w.inflight() > 0),
        )
    })
    .await;
    etcd.ctl(etcd.client_port, &["del", &key]);
    etcd.ctl(etcd.client_port, &["put", &key, &with("other-model", "")]);
    slow.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        h.gw.registry
            .fleet()
            .get(&a.url())
            .is_some_and(|w| !w.is_draining()),
        "served again, not removed by the old drain"
    );
    h.stop().await;
}

#[tokio::test]
async fn a_key_naming_a_url_another_key_serves_takes_it_when_that_key_goes() {
    let Some(etcd) = Etcd::start() else { return };
    let a = demo("a").await;
    let h = gateway(&etcd, &[]).await;
    etcd.ctl(
        etcd.client_port,
        &["put", &format!("{KEY}first"), &value(&a.url())],
    );
    within(Duration::from_secs(1), "added", || served(&h, &a.url())).await;
    let second = format!(
        r#"{{"url":"{}","model":"demo-model","resilience":{{"cb_failure_threshold":4}}}}"#,
        a.url()
    );
    etcd.ctl(etcd.client_port, &["put", &format!("{KEY}second"), &second]);
    etcd.ctl(etcd.client_port, &["del", &format!("{KEY}first")]);
    within(Duration::from_secs(1), "the second key's worker", || {
        h.gw.registry
            .fleet()
            .get(&a.url())
            .is_some_and(|w| !w.is_draining() && w.breaker.settings().failure_threshold == 4)
    })
    .await;
    h.stop().await;
}

/// etcd (3.4, stock settings) closes a connection that pings more often
/// than its `--grpc-keepalive-min-time` (5 s) after a few pings: a watch
/// held well past that window stays one connection, `discovery_up` reads 1
/// at every sample, and no session ends.
#[tokio::test]
async fn a_watch_held_past_etcds_keepalive_policy_stays_connected() {
    let Some(etcd) = Etcd::start() else { return };
    let binary = balancer_binary("--etcd-endpoints").unwrap();
    let agent = AgentProcess::launch(
        &binary,
        &[
            "--etcd-endpoints",
            &etcd.url(),
            // Session ends are logged at debug.
            "--log-level",
            "info,balancer::discovery=debug",
        ],
    )
    .unwrap();
    const UP: &str = "balancer_discovery_up{source=\"etcd\"} 1";
    within(Duration::from_secs(5), "discovery up", || {
        agent.metrics().is_ok_and(|m| m.contains(UP))
    })
    .await;
    // The old 2 s ping lost the connection after about 8 s.
    let hold = Duration::from_secs(13);
    let started = tokio::time::Instant::now();
    let mut samples = 0;
    while started.elapsed() < hold {
        let metrics = agent.metrics().unwrap();
        assert!(
            metrics.contains(UP),
            "discovery down after {:?}:\n{}",
            started.elapsed(),
            agent.lines().join("\n")
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(samples >= 40, "sampled throughout ({samples})");
    let lines = agent.lines();
    let count = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    assert_eq!(count("etcd discovery connected"), 1, "{lines:#?}");
    assert_eq!(count("etcd session ended"), 0, "{lines:#?}");
    assert_eq!(count("etcd discovery lost"), 0, "{lines:#?}");
}

/// An etcd that falls silent (a host gone or cut off; here the process is
/// frozen) is noticed within the stated 15 s (a 10 s ping, 5 s for its
/// answer), and followed again once it answers.
#[tokio::test]
async fn a_silent_etcd_is_noticed_within_15_seconds() {
    let Some(etcd) = Etcd::start() else { return };
    let h = gateway(&etcd, &[]).await;
    let up = |m: &str| m.contains("balancer_discovery_up{source=\"etcd\"} 1");
    eventually("discovery up", || async { up(&h.metrics().await) }).await;
    etcd.freeze(true);
    let frozen = tokio::time::Instant::now();
    // 15 s, and a scheduling margin for a crowded test machine.
    while up(&h.metrics().await) {
        assert!(
            frozen.elapsed() < Duration::from_millis(16_500),
            "a silent etcd still counts as up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    etcd.freeze(false);
    eventually("discovery up again", || async { up(&h.metrics().await) }).await;
    h.stop().await;
}

/// The model a registration wrote to etcd under `id`, once it is there.
async fn registered_model(etcd: &Etcd, id: &str, limit: Duration) -> serde_json::Value {
    let key = format!("{KEY}{id}");
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let got = etcd.ctl(etcd.client_port, &["get", &key, "--print-value-only"]);
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(got.trim()) {
            return value["model"].clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} not registered within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Without a model, the sidecar waits for its worker's `/v1/models` (a
/// worker loading its weights answers nothing yet) and registers the model
/// it names.
#[tokio::test]
async fn the_register_sidecar_without_a_model_registers_what_the_worker_serves() {
    let Some(etcd) = Etcd::start() else { return };
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sidecar = tokio::spawn(register(
        Registration {
            etcd: EtcdConfig {
                endpoints: vec![etcd.url()],
                prefix: "/balancer/".into(),
            },
            id: "a".into(),
            spec: WorkerSpec::from_url(&url),
            ttl: Duration::from_secs(10),
        },
        async {
            let _ = stopped.await;
        },
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let nothing = etcd.ctl(etcd.client_port, &["get", "--prefix", KEY]);
    assert!(
        nothing.trim().is_empty(),
        "registered before the worker answered: {nothing}"
    );
    // The worker comes up on its address.
    let worker = MockWorker::spawn(
        ([127, 0, 0, 1], port).into(),
        MockWorkerConfig {
            model: "served-model".into(),
            ..MockWorkerConfig::named("a")
        },
    )
    .await
    .unwrap();
    let model = registered_model(&etcd, "a", Duration::from_secs(5)).await;
    assert_eq!(model, "served-model");
    let _ = stop.send(());
    sidecar.await.unwrap().unwrap();
    worker.shutdown().await;
}

/// `deploy/balancer-register@.service` as systemd runs it, with its
/// environment file holding no model: the worker is registered with the
/// model it serves, and deregistered on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_register_unit_works_without_a_model() {
    let Some(etcd) = Etcd::start() else { return };
    let binary = balancer_binary("--worker-urls").unwrap();
    let worker = demo("a").await;
    let unit = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/balancer-register@.service"),
    )
    .unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart line");
    // systemd's substitutions, word by word, with an environment file of
    // ETCD and WORKER_URL only: `${VAR}` is one argument, empty when unset.
    let mut words = exec.split_whitespace().map(|word| {
        word.replace("%i", "gpu0")
            .replace("${ETCD}", &etcd.url())
            .replace("${WORKER_URL}", &worker.url())
            .replace("${MODEL}", "")
            .replace("${BALANCER_MODEL}", "")
    });
    assert_eq!(words.next().as_deref(), Some("/usr/bin/balancer"));
    let args: Vec<String> = words.collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sidecar = AgentProcess::spawn(&binary, &args).unwrap();
    let model = registered_model(&etcd, "gpu0", Duration::from_secs(5)).await;
    assert_eq!(model, "demo-model", "{:#?}", sidecar.lines());
    sidecar.signal("TERM").unwrap();
    let (status, lines) = sidecar.wait(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}: {lines:#?}");
    let left = etcd.ctl(etcd.client_port, &["get", "--prefix", KEY]);
    assert!(left.trim().is_empty(), "{left}");
}

/// A key naming an empty model (what `register --model ""` wrote) is
/// refused, and the agent's log names the key and the field.
#[tokio::test]
async fn an_empty_model_in_etcd_is_refused_with_a_log_line_naming_the_key() {
    let Some(etcd) = Etcd::start() else { return };
    let binary = balancer_binary("--etcd-endpoints").unwrap();
    let agent =
        AgentProcess::launch(&binary, &["--etcd-endpoints", &etcd.url(), "--log-json"]).unwrap();
    let key = format!("{KEY}empty");
    etcd.ctl(
        etcd.client_port,
        &["put", &key, r#"{"url":"http://127.0.0.1:4","model":""}"#],
    );
    within(Duration::from_secs(2), "the refusal logged", || {
        agent.lines().iter().any(|l| {
            serde_json::from_str::<serde_json::Value>(l).is_ok_and(|e| {
                e["fields"]["key"] == key.as_str()
                    && e["fields"]["error"]
                        .as_str()
                        .is_some_and(|m| m.contains("invalid model"))
            })
        })
    })
    .await;
    let workers = balancer_tests::agent::get(agent.admin_addr, "/workers").unwrap();
    assert!(!workers.contains("127.0.0.1:4"), "{workers}");
}

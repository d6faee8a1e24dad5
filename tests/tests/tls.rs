//! TLS end to end, with certificates each test makes (rcgen): HTTPS on the
//! public port over HTTP/1.1 and HTTP/2 (curl too), callers' certificates
//! checked, workers behind TLS and behind mutual TLS (sessions resumed), a
//! worker whose certificate is not trusted charged as a connect failure,
//! and the served certificate rotated by a file change and by SIGHUP while
//! a stream is open.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use balancer::tls::{ServingTlsConfig, WorkerTlsConfig};
use balancer_core::selection::Policy;
use balancer_mock_worker::{MockWorker, MockWorkerConfig};
use balancer_tests::balancer_binary;
use balancer_tests::gateway::{
    BOUND, CHAT, Harness, eventually, harness, harness_unprobed, harness_with_urls, quiet,
};
use balancer_tests::tls::{
    Ca, Leaf, Scratch, TlsFront, answered, client_config, open, post, sample,
};
use http::Method;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHAT_PATH: &str = "/v1/chat/completions";

fn serving(leaf: &Leaf, client_ca: Option<&Ca>, watch: Option<Duration>) -> ServingTlsConfig {
    ServingTlsConfig {
        cert_path: leaf.cert.clone(),
        key_path: leaf.key.clone(),
        client_ca_path: client_ca.map(|ca| ca.pem.clone()),
        watch_interval: watch,
    }
}

async fn metric(h: &Harness, series: &str) -> f64 {
    sample(&h.metrics().await, series)
}

#[tokio::test]
async fn https_speaks_http1_and_http2_by_alpn_and_refuses_what_is_not_tls() -> Result<()> {
    let dir = Scratch::new("serve")?;
    let ca = Ca::new(&dir, "edge")?;
    let leaf = ca.issue(&dir, "gateway", &["127.0.0.1", "localhost"])?;
    let h = harness(&["a"], |c| {
        quiet(c);
        c.tls = Some(serving(&leaf, None, None));
    })
    .await;
    let addr = h.gw.addr;

    let h2 = post(
        addr,
        client_config(&ca, &[b"h2", b"http/1.1"], None)?,
        CHAT_PATH,
        CHAT,
    )
    .await?;
    answered(&h2)?;
    assert_eq!(h2.alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(
        h2.certificate, leaf.der,
        "the configured certificate is served"
    );
    // rcgen's certificates are valid until 4096-01-01T00:00:00Z.
    let metrics = h.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l == "balancer_tls_certificate_expiry_timestamp_seconds 67090118400"),
        "{metrics}"
    );
    let h1 = post(
        addr,
        client_config(&ca, &[b"http/1.1"], None)?,
        CHAT_PATH,
        CHAT,
    )
    .await?;
    answered(&h1)?;
    assert_eq!(h1.alpn.as_deref(), Some(&b"http/1.1"[..]));
    // Without ALPN the connection is HTTP/1.1.
    answered(&post(addr, client_config(&ca, &[], None)?, CHAT_PATH, CHAT).await?)?;

    // curl, over HTTP/2, trusting only the test CA.
    let curl = tokio::process::Command::new("curl")
        .args(["-sS", "--http2", "--max-time", "10", "-o", "/dev/null"])
        .args([
            "-w",
            "%{http_version} %{http_code}",
            "-H",
            "content-type: application/json",
        ])
        .arg("--cacert")
        .arg(&ca.pem)
        .args(["-d", CHAT])
        .arg(format!("https://127.0.0.1:{}{CHAT_PATH}", addr.port()))
        .output()
        .await
        .context("running curl")?;
    assert_eq!(
        String::from_utf8_lossy(&curl.stdout),
        "2 200",
        "curl: {}",
        String::from_utf8_lossy(&curl.stderr)
    );

    // Plain HTTP on the TLS port gets no HTTP answer, and is counted.
    let mut plain = tokio::net::TcpStream::connect(addr).await?;
    plain
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(BOUND, plain.read_to_end(&mut answer)).await?;
    assert!(!answer.starts_with(b"HTTP/"), "{answer:?}");
    // A client that does not trust the gateway's CA fails its handshake.
    let other = Ca::new(&dir, "other")?;
    let refused = post(addr, client_config(&other, &[], None)?, CHAT_PATH, CHAT).await;
    assert!(refused.is_err(), "a client trusting another CA connected");

    let failures = r#"balancer_tls_handshake_failures_total{side="client",reason="#;
    eventually("the failed handshakes counted", || async {
        let text = h.metrics().await;
        sample(&text, &format!(r#"{failures}"not_tls"}}"#)) >= 1.0
            && sample(&text, &format!(r#"{failures}"alert"}}"#)) >= 1.0
    })
    .await;
    assert!(metric(&h, r#"balancer_tls_handshakes_total{side="client"}"#).await >= 4.0);
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn with_a_client_ca_only_callers_with_its_certificates_are_served() -> Result<()> {
    let dir = Scratch::new("callers")?;
    let ca = Ca::new(&dir, "edge")?;
    let leaf = ca.issue(&dir, "gateway", &["127.0.0.1"])?;
    let callers = Ca::new(&dir, "callers")?;
    let caller = callers.issue(&dir, "caller", &["caller.example"])?;
    let stranger = Ca::new(&dir, "strangers")?.issue(&dir, "stranger", &["stranger.example"])?;
    let h = harness(&["a"], |c| {
        quiet(c);
        c.tls = Some(serving(&leaf, Some(&callers), None));
    })
    .await;
    let addr = h.gw.addr;

    answered(
        &post(
            addr,
            client_config(&ca, &[], Some(&caller))?,
            CHAT_PATH,
            CHAT,
        )
        .await?,
    )?;
    // TLS 1.3 ends the client's side of the handshake before the server has
    // checked the client's certificate: the refusal arrives as the request
    // fails.
    for identity in [None, Some(&stranger)] {
        let refused = post(addr, client_config(&ca, &[], identity)?, CHAT_PATH, CHAT).await;
        assert!(
            refused.is_err(),
            "served a caller without a valid certificate"
        );
    }
    let failures = r#"balancer_tls_handshake_failures_total{side="client",reason="#;
    eventually("the refused callers counted", || async {
        let text = h.metrics().await;
        sample(&text, &format!(r#"{failures}"no_certificate"}}"#)) == 1.0
            && sample(&text, &format!(r#"{failures}"unknown_issuer"}}"#)) == 1.0
    })
    .await;
    h.stop().await;
    Ok(())
}

/// Two demo workers, `a` behind TLS and `b` behind mutual TLS.
struct TlsWorkers {
    _workers: Vec<MockWorker>,
    plain: TlsFront,
    mutual: TlsFront,
}

async fn tls_workers(dir: &Scratch, ca: &Ca) -> Result<TlsWorkers> {
    let mut workers = Vec::new();
    for name in ["a", "b"] {
        workers.push(
            MockWorker::spawn(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                MockWorkerConfig::named(name),
            )
            .await?,
        );
    }
    let plain = TlsFront::spawn(
        workers[0].addr(),
        &ca.issue(dir, "worker-a", &["127.0.0.1"])?,
        None,
    )
    .await?;
    let mutual = TlsFront::spawn(
        workers[1].addr(),
        &ca.issue(dir, "worker-b", &["127.0.0.1"])?,
        Some(ca),
    )
    .await?;
    Ok(TlsWorkers {
        _workers: workers,
        plain,
        mutual,
    })
}

#[tokio::test]
async fn workers_behind_tls_and_mutual_tls_are_probed_and_served_with_resumed_sessions()
-> Result<()> {
    let dir = Scratch::new("workers")?;
    let ca = Ca::new(&dir, "fleet")?;
    let identity = ca.issue(&dir, "gateway-client", &["gateway.example"])?;
    let fleet = tls_workers(&dir, &ca).await?;
    let worker_tls = WorkerTlsConfig {
        ca_path: Some(ca.pem.clone()),
        client_cert_path: Some(identity.cert.clone()),
        client_key_path: Some(identity.key.clone()),
    };
    // Models are learned over TLS (the harness waits for them): model
    // discovery shares the request path's TLS client.
    let h = harness_with_urls(&[fleet.plain.url()], |c| {
        quiet(c);
        // Both workers take requests.
        c.policy = Policy::RoundRobin;
        c.worker_tls = worker_tls;
    })
    .await;
    // An https:// worker added through the admin API.
    let mutual = fleet.mutual.url();
    let added = h
        .admin(
            Method::POST,
            "/workers",
            &format!(r#"{{"url":"{mutual}"}}"#),
        )
        .await;
    assert_eq!(added.status, 201, "{}", added.text());
    eventually("the added worker's models learned over mutual TLS", || {
        let known =
            h.gw.registry
                .fleet()
                .get(&mutual)
                .is_some_and(|w| !w.models().is_empty());
        std::future::ready(known)
    })
    .await;
    for _ in 0..20 {
        let reply = h.chat(CHAT).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    for (front, name) in [(&fleet.plain, "a"), (&fleet.mutual, "b")] {
        let (full, resumed) = front.handshakes();
        // The probe's connection was the first: the request path's pool
        // resumes its session instead of a full handshake.
        assert_eq!(full, 1, "worker {name}: {full} full handshakes");
        assert!(resumed >= 1, "worker {name}: no resumed session");
    }
    let presented = fleet
        .mutual
        .stats
        .with_client_certificate
        .load(std::sync::atomic::Ordering::Relaxed);
    let (full, resumed) = fleet.mutual.handshakes();
    assert_eq!(
        presented,
        full + resumed,
        "every handshake with b carried the client certificate"
    );
    let text = h.metrics().await;
    assert!(
        sample(&text, r#"balancer_tls_handshakes_total{side="worker"}"#) >= 4.0,
        "{text}"
    );
    assert!(
        sample(
            &text,
            r#"balancer_worker_connect_seconds_count{scheme="https"}"#
        ) >= 4.0
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_worker_the_gateway_cannot_verify_or_satisfy_is_charged_a_connect_failure() -> Result<()>
{
    let dir = Scratch::new("untrusted")?;
    let ca = Ca::new(&dir, "fleet")?;
    let rogue = Ca::new(&dir, "rogue")?;
    let fleet = tls_workers(&dir, &rogue).await?;
    // The gateway trusts `ca`, not the workers' `rogue` CA, and has no
    // client certificate for the mutual-TLS worker.
    let h = harness_unprobed(&[fleet.plain.url()], |c| {
        quiet(c);
        c.proxy.retry.max_attempts = 1;
        c.worker_tls.ca_path = Some(ca.pem.clone());
    })
    .await;
    let reply = h.chat(CHAT).await;
    assert_eq!(reply.status, 502, "{}", reply.text());
    assert_eq!(reply.code(), "upstream_unreachable");
    let url = fleet.plain.url();
    let text = h.metrics().await;
    assert_eq!(
        sample(
            &text,
            &format!(r#"balancer_worker_cb_failures_total{{worker="{url}",reason="connect"}}"#)
        ),
        1.0,
        "{text}"
    );
    assert!(
        sample(
            &text,
            r#"balancer_tls_handshake_failures_total{side="worker",reason="unknown_issuer"}"#
        ) >= 1.0,
        "{text}"
    );
    h.stop().await;

    // Trusted, but asked for a client certificate the gateway does not have.
    let trusted = tls_workers(&dir, &ca).await?;
    let url = trusted.mutual.url();
    let h = harness_unprobed(std::slice::from_ref(&url), |c| {
        quiet(c);
        c.proxy.retry.max_attempts = 1;
        c.worker_tls.ca_path = Some(ca.pem.clone());
    })
    .await;
    let reply = h.chat(CHAT).await;
    assert_eq!(reply.status, 502, "{}", reply.text());
    let text = h.metrics().await;
    assert_eq!(
        sample(
            &text,
            &format!(r#"balancer_worker_cb_failures_total{{worker="{url}",reason="connect"}}"#)
        ),
        1.0,
        "{text}"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_changed_certificate_file_is_served_and_a_broken_one_keeps_the_old() -> Result<()> {
    let dir = Scratch::new("files")?;
    let ca = Ca::new(&dir, "edge")?;
    let first = ca.issue(&dir, "gateway", &["127.0.0.1"])?;
    let second = ca.issue(&dir, "gateway-next", &["127.0.0.1"])?;
    let h = harness(&["a"], |c| {
        quiet(c);
        c.tls = Some(serving(&first, None, Some(Duration::from_millis(50))));
    })
    .await;
    // A new client each time: a resumed session would show the certificate
    // of the session, not the one served now.
    let served =
        || async { post(h.gw.addr, client_config(&ca, &[], None)?, CHAT_PATH, CHAT).await };
    assert_eq!(served().await?.certificate, first.der);

    std::fs::write(
        &first.key,
        "-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n",
    )?;
    let reloads = r#"balancer_tls_certificate_reloads_total{result="#;
    eventually("the broken key refused", || async {
        metric(&h, &format!(r#"{reloads}"error"}}"#)).await >= 1.0
    })
    .await;
    let kept = served().await?;
    answered(&kept)?;
    assert_eq!(
        kept.certificate, first.der,
        "a broken file replaced the certificate"
    );

    second.copy_to(&first)?;
    eventually("the new certificate loaded", || async {
        metric(&h, &format!(r#"{reloads}"ok"}}"#)).await >= 2.0
    })
    .await;
    let rotated = served().await?;
    answered(&rotated)?;
    assert_eq!(rotated.certificate, second.der);
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_bad_certificate_at_start_is_an_error_naming_the_file() -> Result<()> {
    let dir = Scratch::new("start")?;
    let ca = Ca::new(&dir, "edge")?;
    let leaf = ca.issue(&dir, "gateway", &["127.0.0.1"])?;
    let other = ca.issue(&dir, "other", &["127.0.0.1"])?;
    let mut config = balancer::config::GatewayConfig::default();
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.metrics_listen = config.listen;
    config.admin_listen = config.listen;
    let missing = dir.path("absent.pem");
    for (tls, named) in [
        (
            ServingTlsConfig {
                cert_path: missing.clone(),
                ..serving(&leaf, None, None)
            },
            missing.display().to_string(),
        ),
        (
            // A key of another certificate.
            ServingTlsConfig {
                key_path: other.key.clone(),
                ..serving(&leaf, None, None)
            },
            other.key.display().to_string(),
        ),
    ] {
        config.tls = Some(tls);
        let error = match balancer::gateway::Gateway::start(config.clone()).await {
            Ok(_) => panic!("started with a bad certificate"),
            Err(e) => format!("{e:#}"),
        };
        assert!(error.contains(&named), "{error}");
    }
    Ok(())
}

/// `balancer launch` serving HTTPS before one worker, ended on drop.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[tokio::test]
async fn sighup_rotates_the_certificate_while_a_stream_runs_to_its_end() -> Result<()> {
    let binary = balancer_binary("--tls-watch-interval-secs")?;
    let dir = Scratch::new("sighup")?;
    let ca = Ca::new(&dir, "edge")?;
    let first = ca.issue(&dir, "gateway", &["127.0.0.1"])?;
    let second = ca.issue(&dir, "gateway-next", &["127.0.0.1"])?;
    // Slow tokens: the stream spans the rotation.
    let worker = MockWorker::spawn(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        MockWorkerConfig {
            token_delay: Duration::from_millis(100),
            ..MockWorkerConfig::named("a")
        },
    )
    .await?;
    let (port, metrics_port, admin_port) = (free_port()?, free_port()?, free_port()?);
    let agent = Agent(
        Command::new(&binary)
            .args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--prometheus-port", &metrics_port.to_string()])
            .args(["--admin-port", &admin_port.to_string()])
            .args(["--worker-urls", &worker.url()])
            .arg("--tls-cert-path")
            .arg(&first.cert)
            .arg("--tls-key-path")
            .arg(&first.key)
            // Only SIGHUP reloads: the test tells the two apart.
            .args(["--tls-watch-interval-secs", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting balancer launch")?,
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let client = client_config(&ca, &[], None)?;
    let metrics = || async move {
        let text = tokio::process::Command::new("curl")
            .args(["-sS", "--max-time", "5"])
            .arg(format!("http://127.0.0.1:{metrics_port}/metrics"))
            .output()
            .await
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        sample(
            &text,
            r#"balancer_tls_certificate_reloads_total{result="ok"}"#,
        )
    };
    eventually("the agent serving HTTPS", || async {
        post(addr, client.clone(), CHAT_PATH, CHAT)
            .await
            .is_ok_and(|e| e.status == 200)
    })
    .await;

    let stream = r#"{"model":"demo-model","stream":true,"max_tokens":20,"messages":[{"role":"user","content":"hi"}]}"#;
    let opened = open(addr, client.clone(), CHAT_PATH, stream).await?;
    ensure!(
        opened.response.status() == 200,
        "stream answered {}",
        opened.response.status()
    );
    assert_eq!(opened.certificate, first.der);
    let mut body = opened.response.into_body();
    let first_chunk = tokio::time::timeout(BOUND, body.frame()).await?;
    ensure!(first_chunk.is_some(), "the stream ended at once");

    second.copy_to(&first)?;
    assert_eq!(metrics().await, 1.0, "reloaded without SIGHUP");
    let pid = agent.0.id();
    let hup = Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()?;
    ensure!(hup.success(), "kill -HUP {pid}: {hup}");
    eventually("the certificate reloaded on SIGHUP", || async {
        metrics().await >= 2.0
    })
    .await;
    // A new client: a resumed session would show the old certificate.
    let after = post(addr, client_config(&ca, &[], None)?, CHAT_PATH, CHAT).await?;
    answered(&after)?;
    assert_eq!(
        after.certificate, second.der,
        "a new connection got the old certificate"
    );

    let rest = tokio::time::timeout(BOUND, body.collect())
        .await??
        .to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.contains("[DONE]"),
        "the open stream did not complete: {text}"
    );
    drop(agent);
    Ok(())
}

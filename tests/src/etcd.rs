//! A real etcd (Debian's `etcd-server`) on loopback for the discovery
//! tests: its own temporary data directory and free ports, started and
//! stopped by PID, removed on every exit path. It runs on the host's
//! loopback, or on a test namespace's (for agents whose runtime lives in
//! that namespace, as the XDP tests' do).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use balancer_core::fleet::worker_key;

/// A running etcd; killed and its directory removed when dropped.
pub struct Etcd {
    child: Option<Child>,
    pub dir: PathBuf,
    pub client_port: u16,
    peer_port: u16,
    /// The network namespace etcd and `etcdctl` run in; `None`: the host's.
    ns: Option<String>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `/usr/bin/etcd`, or `None` after printing why the calling test is skipped.
pub fn etcd_binary() -> Option<&'static str> {
    const BINARY: &str = "/usr/bin/etcd";
    if std::path::Path::new(BINARY).exists() {
        return Some(BINARY);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set and etcd is missing: `cargo xtask setup` installs etcd-server"
    );
    eprintln!("\n*** SKIPPED: etcd is not installed (cargo xtask setup installs it as root) ***\n");
    None
}

impl Etcd {
    /// A fresh single-member etcd; `None` (skipped) without the binary.
    /// Its ports are found free and bound by etcd a moment later, when
    /// another test may have taken one: an etcd that exits at start is
    /// tried again on other ports, twice at most.
    pub fn start() -> Option<Self> {
        Self::start_in(None)
    }

    /// [`Etcd::start`] on the loopback of namespace `ns` (which the caller
    /// made, with `lo` up), where only that namespace reaches it.
    pub fn start_in(ns: Option<&str>) -> Option<Self> {
        etcd_binary()?;
        const TRIES: u32 = 3;
        for tried in 1..=TRIES {
            let mut etcd = Self {
                child: None,
                dir: std::env::temp_dir().join(format!(
                    "balancer-etcd-{}-{}",
                    std::process::id(),
                    free_port()
                )),
                client_port: free_port(),
                peer_port: free_port(),
                ns: ns.map(str::to_owned),
            };
            match etcd.try_run(etcd.client_port) {
                Ok(()) => return Some(etcd),
                Err(why) if tried < TRIES => eprintln!("etcd start {tried} of {TRIES}: {why}"),
                Err(why) => panic!("etcd did not start: {why}"),
            }
        }
        unreachable!("the last try returns or panics")
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Starts (again) on the same data directory, serving clients on `port`.
    pub fn run(&mut self, port: u16) {
        if let Err(why) = self.try_run(port) {
            panic!("etcd did not start: {why}");
        }
    }

    /// Where etcd's own log goes: beside its data, removed with it.
    fn log(&self) -> PathBuf {
        self.dir.with_extension("log")
    }

    fn try_run(&mut self, port: u16) -> Result<(), String> {
        self.stop();
        let client = format!("http://127.0.0.1:{port}");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.log()).map_err(|e| format!("its log: {e}"))?;
        let ns = self.ns.clone();
        let child = command(ns.as_deref(), "/usr/bin/etcd")
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.dir.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .arg("--initial-cluster-state=new")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot spawn it: {e}"))?;
        let child = self.child.insert(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let healthy = command(ns.as_deref(), "/usr/bin/etcdctl")
                .arg(format!("--endpoints={client}"))
                .args(["endpoint", "health", "--command-timeout=1s"])
                .env("ETCDCTL_API", "3")
                .output()
                .is_ok_and(|o| o.status.success());
            if healthy {
                return Ok(());
            }
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() >= deadline {
                let log = std::fs::read_to_string(self.log()).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = &lines[lines.len().saturating_sub(5)..];
                let state = exited.map_or("not healthy within 20 s".to_owned(), |s| {
                    format!("it exited ({s})")
                });
                return Err(format!("{state}; its log ends: {}", tail.join(" | ")));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills etcd (by its PID) and waits for it; the data stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) etcd by its PID: a frozen etcd
    /// keeps its connections open and answers nothing, as a host that is
    /// gone or cut off does.
    pub fn freeze(&self, frozen: bool) {
        let Some(child) = &self.child else { return };
        let signal = if frozen { "STOP" } else { "CONT" };
        let sent = Command::new("kill")
            .args(["-s", signal, &child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(sent, "kill -s {signal} etcd");
    }

    /// `etcdctl ARGS` against `port`; panics when it fails.
    pub fn ctl(&self, port: u16, args: &[&str]) -> String {
        let out = command(self.ns.as_deref(), "/usr/bin/etcdctl")
            .arg(format!("--endpoints=http://127.0.0.1:{port}"))
            .args(args)
            .env("ETCDCTL_API", "3")
            .output()
            .expect("etcdctl runs");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A replica that exists only as keys under the default prefix: its
    /// replica key and an open verdict on the worker at `url`, both under a
    /// lease of `ttl` seconds nobody renews (what etcd holds of a replica
    /// that was killed). Returns the lease's id, for `lease revoke`.
    pub fn key_only_replica(&self, id: &str, url: &str, ttl: u32) -> String {
        let granted = self.ctl(self.client_port, &["lease", "grant", &ttl.to_string()]);
        // "lease 694d8a1f7c1b2c04 granted with TTL(2s)"
        let lease = granted
            .split_whitespace()
            .nth(1)
            .expect("a lease id")
            .to_owned();
        let with_lease = format!("--lease={lease}");
        self.ctl(
            self.client_port,
            &[
                "put",
                &with_lease,
                &format!("/balancer/replicas/{id}"),
                "{}",
            ],
        );
        let verdict = format!("/balancer/verdicts/{}/{id}", worker_key(url));
        let value = r#"{"state":"open","reason":"failure_threshold","since":0}"#;
        self.ctl(self.client_port, &["put", &with_lease, &verdict, value]);
        lease
    }
}

/// `program`, run in namespace `ns` (the host's: `None`). `ip netns exec`
/// execs the program in place, so the child's PID is the program's own.
fn command(ns: Option<&str>, program: &str) -> Command {
    match ns {
        Some(ns) => {
            let mut command = Command::new("ip");
            command.args(["netns", "exec", ns, program]);
            command
        }
        None => Command::new(program),
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(self.log());
    }
}

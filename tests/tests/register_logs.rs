//! End-to-end test of what `balancer register` logs when etcd comes and
//! goes: not "lost" before it ever registered, and etcd's errors in one
//! readable line, a stop with etcd away included. The sidecar runs as a
//! process (its log is what is tested), is killed when the test ends
//! however it ends, and every wait is bounded.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use balancer_tests::balancer_binary;
use balancer_tests::etcd::Etcd;

const BOUND: Duration = Duration::from_secs(15);

/// The sidecar process, killed on drop.
struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The log so far, colours stripped.
fn log(path: &Path) -> String {
    let raw = std::fs::read_to_string(path).unwrap_or_default();
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ ... final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn wait_for(path: &Path, what: &str) {
    let deadline = Instant::now() + BOUND;
    while !log(path).contains(what) {
        assert!(
            Instant::now() < deadline,
            "no {what:?} in {BOUND:?}: {}",
            log(path)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn register_says_not_yet_before_it_registers_and_one_line_when_etcd_is_away_at_stop() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let binary = balancer_binary("--route-undeclared-models").expect("the balancer binary");
    let path = etcd.dir.with_extension("register.log");
    let port = etcd.client_port;
    // Away at the start.
    etcd.stop();
    let out = std::fs::File::create(&path).expect("the sidecar's log");
    let sidecar = Sidecar(
        Command::new(binary)
            .args(["register", "--etcd-endpoints", &etcd.url()])
            .args(["--id", "w1", "--url", "http://127.0.0.1:9", "--model", "m"])
            .args(["--ttl-secs", "2"])
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("the log, twice"))
            .stderr(out)
            .spawn()
            .expect("balancer register starts"),
    );
    wait_for(&path, "cannot register yet");
    etcd.run(port);
    wait_for(&path, "registered");
    etcd.stop();
    let pid = sidecar.0.id().to_string();
    let term = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(term.is_ok_and(|s| s.success()), "kill -TERM {pid}");
    let mut sidecar = sidecar;
    let deadline = Instant::now() + BOUND;
    let status = loop {
        if let Some(status) = sidecar.0.try_wait().expect("its status") {
            break status;
        }
        assert!(Instant::now() < deadline, "still running: {}", log(&path));
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = log(&path);
    let _ = std::fs::remove_file(&path);
    assert!(status.success(), "{status}: {text}");
    let first_registration = text.find(" registered ").expect("a registration");
    assert!(
        !text[..first_registration].contains("registration lost"),
        "lost before it was ever registered: {text}"
    );
    assert!(text.contains("could not deregister"), "{text}");
    for dump in [
        "tonic::",
        "MetadataMap",
        "ConnectError(",
        "Os {",
        "Error:",
        "backtrace",
    ] {
        assert!(!text.contains(dump), "{dump:?} in the log: {text}");
    }
    assert!(
        text.lines().all(|l| l.len() < 400),
        "a line too long to read: {text}"
    );
}

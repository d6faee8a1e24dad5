//! Network namespaces for tests: created with unique names, removed on
//! every exit path, with a bounded wait on everything that touches them.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How long a single `ip`/`ethtool` invocation may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Network namespaces that are deleted when the value is dropped.
pub struct Namespaces {
    names: Vec<String>,
}

impl Namespaces {
    /// Creates `count` namespaces named `<prefix>-<pid>-<n>-<i>`, with
    /// `lo` up in each.
    pub fn create(prefix: &str, count: usize) -> Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let batch = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut namespaces = Self { names: Vec::new() };
        for i in 0..count {
            let name = format!("{prefix}-{}-{batch}-{i}", std::process::id());
            run("ip", &["netns", "add", &name])?;
            // Pushed right away so a failure below still deletes it.
            namespaces.names.push(name.clone());
            run("ip", &["-n", &name, "link", "set", "lo", "up"])?;
        }
        Ok(namespaces)
    }

    pub fn name(&self, index: usize) -> &str {
        &self.names[index]
    }

    /// Deletes the namespaces now, reporting failures (dropping the
    /// value does the same but can only print them).
    pub fn delete(mut self) -> Result<()> {
        let names = std::mem::take(&mut self.names);
        let mut failures = Vec::new();
        for name in &names {
            if let Err(error) = run("ip", &["netns", "del", name]) {
                failures.push(format!("{error:#}"));
            }
        }
        if !failures.is_empty() {
            bail!("deleting namespaces: {}", failures.join("; "));
        }
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.names {
            if let Err(error) = run("ip", &["netns", "del", name]) {
                eprintln!("cleanup: {error:#}");
            }
        }
    }
}

/// Whether a namespace of that name is registered (`ip netns list`).
pub fn exists(name: &str) -> Result<bool> {
    let listing = run("ip", &["netns", "list"])?;
    Ok(listing
        .lines()
        .any(|line| line.split_whitespace().next() == Some(name)))
}

/// Runs `f` on a new thread that has joined namespace `name`, and
/// returns its result, or fails after `timeout`.
///
/// Sockets opened inside `f` stay in that namespace wherever they are
/// used afterwards, so `f` can hand them back.
pub fn run_in<T, F>(name: &str, timeout: Duration, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let path = format!("/var/run/netns/{name}");
    let namespace = File::open(&path).with_context(|| format!("opening {path}"))?;
    let (done, result) = mpsc::channel();
    std::thread::Builder::new()
        .name(format!("netns-{name}"))
        .spawn(move || {
            // SAFETY: setns on a valid namespace fd only changes this
            // thread's network namespace.
            #[allow(unsafe_code)]
            let entered = unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) };
            if entered != 0 {
                let _ = done.send(Err(std::io::Error::last_os_error()));
                return;
            }
            let _ = done.send(Ok(f()));
        })
        .context("spawning a namespace thread")?;
    match result.recv_timeout(timeout) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(error).with_context(|| format!("entering namespace {name}")),
        Err(_) => bail!("work in namespace {name} did not finish within {timeout:?}"),
    }
}

/// Runs a command to completion within a fixed timeout and returns its
/// stdout; a non-zero exit or a timeout is an error carrying stderr.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let shown = format!("{program} {}", args.join(" "));
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting `{shown}` (is it installed? `cargo xtask setup`)"))?;
    let deadline = Instant::now() + COMMAND_TIMEOUT;
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{shown}` did not finish within {COMMAND_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // The outputs of these commands are small enough to sit in the pipe
    // buffers until the process has exited.
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

//! A tokio runtime whose threads live in a network namespace: everything it
//! runs (listeners, connections) is inside it.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use balancer_mock_worker::{MockWorker, MockWorkerConfig};
use tokio::runtime::Runtime;

use crate::netns;

/// The longest a test waits for one task on a namespace's runtime.
pub const RUN_BOUND: Duration = Duration::from_secs(120);

pub struct NsRuntime {
    runtime: Option<Runtime>,
}

impl NsRuntime {
    /// Builds the runtime on a thread inside `ns`: its worker threads are
    /// started from there and stay in that namespace.
    pub fn new(ns: &str) -> Result<Self> {
        let runtime = netns::run_in(ns, Duration::from_secs(10), || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
        })??;
        Ok(Self {
            runtime: Some(runtime),
        })
    }

    /// Runs `future` on the runtime's threads (not the caller's, which
    /// may be in another namespace) and waits for it, for at most
    /// [`RUN_BOUND`].
    pub fn run<F>(&self, future: F) -> Result<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = self.runtime.as_ref().expect("runtime present until drop");
        let task = runtime.spawn(future);
        runtime
            .block_on(async { tokio::time::timeout(RUN_BOUND, task).await })
            .with_context(|| format!("task on the namespace's runtime took over {RUN_BOUND:?}"))?
            .context("task on the namespace's runtime")
    }

    /// A demo worker listening on `addr` inside the namespace.
    pub fn worker(&self, addr: SocketAddr, name: &str) -> Result<MockWorker> {
        let config = MockWorkerConfig::named(name);
        self.run(MockWorker::spawn(addr, config))?
            .with_context(|| format!("starting worker {name} on {addr}"))
    }
}

impl Drop for NsRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Bounded: a stuck task must not hang the test's cleanup.
            runtime.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

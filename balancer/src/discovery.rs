//! Where workers come from.
//!
//! Owns the [`Discovery`] trait the gateway asks for its workers at start,
//! and its first implementation, the static list of the configuration
//! (`--worker-urls`, `[[workers]]`). Sources that follow a changing fleet
//! (etcd, Kubernetes) implement the same trait. A source only describes
//! workers; it must not touch the registry, breakers or sockets of the
//! request path: the gateway applies what it says.

use std::future::Future;
use std::pin::Pin;

use balancer_core::spec::WorkerSpec;

/// A future a discovery source returns.
pub type DiscoveryFuture<'a, T> = Pin<Box<dyn Future<Output = anyhow::Result<T>> + Send + 'a>>;

/// A source of worker specs.
pub trait Discovery: Send + Sync {
    /// A short name for logs (`static`, `etcd`, ...).
    fn name(&self) -> &'static str;

    /// The workers the source knows now; the gateway adds them all (or, when
    /// any is invalid, none) before it serves.
    fn initial(&self) -> DiscoveryFuture<'_, Vec<WorkerSpec>>;
}

/// The workers the configuration names, fixed for the agent's life.
#[derive(Debug, Clone, Default)]
pub struct StaticList {
    workers: Vec<WorkerSpec>,
}

impl StaticList {
    pub fn new(workers: Vec<WorkerSpec>) -> Self {
        Self { workers }
    }
}

impl Discovery for StaticList {
    fn name(&self) -> &'static str {
        "static"
    }

    fn initial(&self) -> DiscoveryFuture<'_, Vec<WorkerSpec>> {
        Box::pin(std::future::ready(Ok(self.workers.clone())))
    }
}

//! Where workers come from.
//!
//! Owns the [`Discovery`] trait the gateway asks for its workers, its
//! implementations (the static list of the configuration, `--worker-urls`
//! and `[[workers]]`; [`etcd`]), and [`FleetUpdates`], the one place where a
//! source's view turns into registry changes: adds, overrides, and drains
//! before removal. A source only describes workers; it must not touch
//! breakers or the request path.

pub mod etcd;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use balancer_core::metrics::MetricsSource;
use balancer_core::registry::{Registry, RegistryError, Worker};
use balancer_core::spec::{WorkerSpec, redacted_url};

/// A future a discovery source returns.
pub type DiscoveryFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A source of worker specs.
pub trait Discovery: Send + Sync {
    /// A short name for logs (`static`, `etcd`, ...).
    fn name(&self) -> &'static str;

    /// The workers the source knows now, applied before the gateway serves.
    /// A source that cannot be reached yet returns what it has (nothing)
    /// and catches up in [`Discovery::follow`].
    fn initial(&self) -> DiscoveryFuture<'_, Vec<(String, WorkerSpec)>>;

    /// Follows the source for the agent's life, applying every change
    /// through `fleet`. A source that never changes returns at once.
    fn follow(self: Arc<Self>, fleet: Arc<FleetUpdates>) -> DiscoveryFuture<'static, ()>;

    /// The source's own series (its connection state), if it has any.
    fn series(self: Arc<Self>) -> Option<Arc<dyn MetricsSource>> {
        None
    }
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

    fn initial(&self) -> DiscoveryFuture<'_, Vec<(String, WorkerSpec)>> {
        // The key shows in logs: the URL without its credentials (two
        // entries differing only in credentials are refused at start).
        let listed = self
            .workers
            .iter()
            .map(|w| (redacted_url(&w.url), w.clone()))
            .collect();
        Box::pin(std::future::ready(listed))
    }

    fn follow(self: Arc<Self>, _fleet: Arc<FleetUpdates>) -> DiscoveryFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// Called for each worker a source adds (the gateway starts its prober).
pub type OnAdded = Arc<dyn Fn(&Arc<Worker>) + Send + Sync>;

/// Applies one source's view of its workers to the registry. Each worker is
/// known by the source's key for it (an etcd key); a key that changes its
/// URL, model or labels replaces its worker, one that changes only its
/// `resilience` patches it, and a key that goes away drains its worker
/// (in-flight requests finish, up to the drain timeout) before removal.
pub struct FleetUpdates {
    registry: Arc<Registry>,
    on_added: OnAdded,
    drain_timeout: Duration,
    /// Source key → the worker it made and the spec it made it from.
    known: Mutex<HashMap<String, (Arc<Worker>, WorkerSpec)>>,
    /// Keys whose URL another key of this source serves: applied when that
    /// key goes away.
    waiting: Mutex<HashMap<String, WorkerSpec>>,
}

impl FleetUpdates {
    pub fn new(registry: Arc<Registry>, on_added: OnAdded, drain_timeout: Duration) -> Self {
        Self {
            registry,
            on_added,
            drain_timeout,
            known: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
        }
    }

    /// Adds or updates the worker of `key`. Invalid specs and duplicates of
    /// a worker another source added are logged and change nothing.
    pub fn upsert(&self, key: &str, spec: WorkerSpec) {
        self.waiting.lock().unwrap().remove(key);
        let mut known = self.known.lock().unwrap();
        if let Some((worker, old)) = known.get(key) {
            if *old == spec {
                return;
            }
            let same_url = old.url == spec.url;
            let same_worker = same_url && old.model == spec.model && old.labels == spec.labels;
            if same_worker {
                match self.registry.set_resilience(&worker.id, &spec.resilience) {
                    Ok(w) => {
                        known.insert(key.to_owned(), (w, spec));
                    }
                    Err(error) => tracing::warn!(key, %error, "ignoring a worker update"),
                }
                return;
            }
            let (worker, _) = known.remove(key).expect("present");
            if same_url {
                // Same URL, new model or labels: the new worker takes its
                // place at once (requests in flight finish on the old one).
                self.registry.remove(&worker);
            } else {
                self.retire(worker);
            }
        }
        let mut added = self.registry.add(&spec);
        if let Err(RegistryError::Duplicate(url)) = &added {
            // Deleted and put back while it still drained: it comes back
            // now instead of vanishing when the drain ends.
            let draining = self
                .registry
                .fleet()
                .get(url)
                .filter(|w| w.is_draining())
                .cloned();
            if let Some(old) = draining {
                self.registry.remove(&old);
                added = self.registry.add(&spec);
            }
        }
        match added {
            Ok(worker) => {
                (self.on_added)(&worker);
                tracing::info!(key, worker = %worker.url, "discovered worker added");
                known.insert(key.to_owned(), (worker, spec));
            }
            Err(RegistryError::Duplicate(url)) => {
                tracing::warn!(key, worker = %url, "a discovered worker's URL is already served; it waits for that one to go");
                self.waiting.lock().unwrap().insert(key.to_owned(), spec);
            }
            Err(error) => tracing::warn!(key, %error, "ignoring an invalid discovered worker"),
        }
    }

    /// Drains and removes the worker of `key`, if there is one; a key that
    /// waited for its URL then takes it.
    pub fn remove(&self, key: &str) {
        self.waiting.lock().unwrap().remove(key);
        let removed = self.known.lock().unwrap().remove(key);
        if let Some((worker, spec)) = removed {
            tracing::info!(key, worker = %worker.url, "discovered worker gone: draining");
            self.retire(worker);
            let next = {
                let mut waiting = self.waiting.lock().unwrap();
                let key = waiting
                    .iter()
                    .find(|(_, s)| s.url == spec.url)
                    .map(|(k, _)| k.clone());
                key.and_then(|k| waiting.remove(&k).map(|s| (k, s)))
            };
            if let Some((key, spec)) = next {
                self.upsert(&key, spec);
            }
        }
    }

    /// Makes the source's workers `current` (after a reconnection): keys
    /// that are gone from `present` are removed, the others added or
    /// updated. A key still present whose value is now invalid keeps its
    /// worker, as a bad put does while watching.
    pub fn resync(&self, current: Vec<(String, WorkerSpec)>, present: &[String]) {
        let keys: Vec<String> = self.known.lock().unwrap().keys().cloned().collect();
        for key in keys {
            if !present.contains(&key) {
                self.remove(&key);
            }
        }
        for (key, spec) in current {
            self.upsert(&key, spec);
        }
    }

    fn retire(&self, worker: Arc<Worker>) {
        let Ok(worker) = self.registry.drain(&worker.id) else {
            return;
        };
        let (registry, timeout) = (self.registry.clone(), self.drain_timeout);
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            while worker.inflight() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            registry.remove(&worker);
        });
    }
}

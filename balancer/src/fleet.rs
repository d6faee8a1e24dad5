//! Fleet verdicts (`--fleet-verdicts`): balancer replicas share their
//! breakers' open verdicts through etcd, and a quorum of them isolates a
//! worker on every replica.
//!
//! Owns the etcd side: this replica's lease and its keys under
//! `<prefix>replicas/<id>` and `<prefix>verdicts/<worker>/<id>`, the watch of
//! the others', and the one background task that does all of it. The task
//! learns about this replica's breakers from the registry's event stream, so
//! the request path pays nothing and a slow or unreachable etcd never delays
//! a request. The quorum rule is `balancer_core::fleet`'s; this module only
//! feeds it and applies its decisions through `Breaker::fleet_open` and
//! `Breaker::fleet_release`. It must not touch discovery's keys
//! (`workers/`) nor decide anything a breaker decides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use serde_json::json;
use tokio::sync::broadcast::{self, error::RecvError};

use balancer_core::breaker::{State, TransitionReason};
use balancer_core::fleet::{Decision, FleetView, worker_key};
use balancer_core::metrics::{MetricsSource, Writer};
use balancer_core::registry::{Registry, Worker, WorkerEvent};

use crate::discovery::etcd::{EtcdConfig, connect};

/// How long one etcd call may take before the session is given up.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);
/// How long start-up waits for etcd before going on without it.
const INITIAL: Duration = Duration::from_secs(3);
/// How often the lease clock is checked: a lost lease releases within this.
const TICK: Duration = Duration::from_millis(250);
/// The longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// The longest replica id: it is part of every key this replica writes.
pub const MAX_REPLICA_ID: usize = 128;
/// The longest worker part of a verdict key read from etcd (a URL of up to
/// a third of it, percent-encoded); longer keys are not a worker's.
const MAX_WORKER_KEY: usize = 3 * 2048;

/// `--fleet-verdicts`, `--replica-id`, `--fleet-quorum`, `--fleet-lease-secs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetConfig {
    /// This replica's id in the keys (`A-Z a-z 0-9 . _ ~ -`, at most
    /// [`MAX_REPLICA_ID`] bytes).
    pub replica_id: String,
    /// Distinct live replicas whose open verdicts isolate a worker.
    pub quorum: usize,
    /// The lease of this replica's keys; etcd's minimum is 2 s.
    pub lease: Duration,
}

impl FleetConfig {
    /// Why `id` cannot be a replica id, if it cannot.
    pub fn check_replica_id(id: &str) -> Result<(), String> {
        if id.is_empty() || id.len() > MAX_REPLICA_ID {
            return Err(format!("{id:?}: 1 to {MAX_REPLICA_ID} bytes"));
        }
        if let Some(c) = id
            .chars()
            .find(|c| !c.is_ascii_alphanumeric() && !matches!(c, '.' | '_' | '~' | '-'))
        {
            return Err(format!(
                "{id:?}: {c:?} is not allowed (A-Z a-z 0-9 . _ ~ -)"
            ));
        }
        Ok(())
    }
}

/// The keys of one replica, under the etcd prefix.
struct Keys {
    replicas: String,
    verdicts: String,
    me: String,
}

impl Keys {
    fn new(etcd: &EtcdConfig, me: &str) -> Self {
        Self {
            replicas: format!("{}replicas/", etcd.prefix),
            verdicts: format!("{}verdicts/", etcd.prefix),
            me: format!("{}replicas/{me}", etcd.prefix),
        }
    }

    fn verdict(&self, worker: &str, replica: &str) -> String {
        format!("{}{worker}/{replica}", self.verdicts)
    }

    /// A key of the watched prefix, as what it says. Keys no replica
    /// writes (an id or a worker part out of bounds) are ignored, so a
    /// stray writer cannot grow this replica's view without bound.
    fn parse<'k>(&self, key: &'k str) -> Option<Key<'k>> {
        let valid = |id: &str| FleetConfig::check_replica_id(id).is_ok();
        if let Some(replica) = key.strip_prefix(self.replicas.as_str()) {
            return valid(replica).then_some(Key::Replica(replica));
        }
        let rest = key.strip_prefix(self.verdicts.as_str())?;
        let (worker, replica) = rest.split_once('/')?;
        (valid(replica) && !worker.is_empty() && worker.len() <= MAX_WORKER_KEY)
            .then_some(Key::Verdict { worker, replica })
    }
}

enum Key<'k> {
    Replica(&'k str),
    Verdict { worker: &'k str, replica: &'k str },
}

/// One connection to etcd with this replica's lease on it.
struct Session {
    client: Client,
    lease: i64,
}

/// The fleet side of one replica: its view of the others, its series, and
/// (in [`FleetVerdicts::start`]) the task that keeps both in step with etcd.
pub struct FleetVerdicts {
    etcd: EtcdConfig,
    config: FleetConfig,
    keys: Keys,
    registry: Arc<Registry>,
    view: Mutex<FleetView>,
    /// Worker URL → fleet isolations (`fleet_isolations_total`).
    isolations: Mutex<HashMap<Arc<str>, u64>>,
    /// Fleet key → why and when (unix ms) this replica's own breaker opened,
    /// the value of its verdict, kept to rewrite it after a reconnection.
    own: Mutex<HashMap<String, (&'static str, u64)>>,
    /// The lease of the last session, revoked at shutdown.
    lease: AtomicU64,
    started_ms: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

async fn call<T>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(result) => result.with_context(|| what.to_owned()),
        Err(_) => bail!("{what}: etcd did not answer within {CALL_TIMEOUT:?}"),
    }
}

impl FleetVerdicts {
    /// Registers this replica and starts following the fleet. Fails when a
    /// live replica already holds the id; an etcd unreachable at start
    /// delays nothing (the task registers when it answers).
    pub async fn start(
        etcd: EtcdConfig,
        config: FleetConfig,
        registry: Arc<Registry>,
    ) -> anyhow::Result<(Arc<Self>, FleetTask)> {
        let events = registry.subscribe();
        let keys = Keys::new(&etcd, &config.replica_id);
        let view = FleetView::new(config.replica_id.clone(), config.quorum, config.lease);
        let fleet = Arc::new(Self {
            etcd,
            keys,
            registry,
            view: Mutex::new(view),
            isolations: Mutex::new(HashMap::new()),
            own: Mutex::new(HashMap::new()),
            lease: AtomicU64::new(0),
            started_ms: unix_ms(),
            config,
        });
        let first = match tokio::time::timeout(INITIAL, fleet.register(None)).await {
            Ok(Ok(session)) => Some(session),
            Ok(Err(error)) if error.is::<IdTaken>() => return Err(error),
            Ok(Err(error)) => {
                tracing::warn!(error = %format!("{error:#}"), "etcd not reachable at start; fleet verdicts wait for it");
                None
            }
            Err(_) => {
                tracing::warn!("etcd did not answer at start; fleet verdicts wait for it");
                None
            }
        };
        let task = tokio::spawn(fleet.clone().run(first, events)).abort_handle();
        Ok((fleet, FleetTask(task)))
    }

    /// Deletes this replica's keys now (a clean stop) rather than when its
    /// lease runs out.
    pub async fn revoke(&self) {
        let lease = self.lease.load(Ordering::Acquire) as i64;
        if lease == 0 {
            return;
        }
        let revoked = async {
            let mut client = connect(&self.etcd.endpoints).await?;
            call("revoking the lease", client.lease_revoke(lease)).await
        };
        if let Err(error) = revoked.await {
            tracing::warn!(error = %format!("{error:#}"), "could not revoke the fleet lease; it will expire");
        }
    }

    /// The replicas holding an open verdict on `worker` (this one included),
    /// for the admin API.
    pub fn holders(&self, worker: &Worker) -> Vec<String> {
        self.view.lock().unwrap().holders(&worker_key(&worker.url))
    }

    /// Connects and puts this replica's key under a lease: the lease of
    /// `previous` when it is still alive, a new one otherwise. A new lease
    /// takes the key only if nobody holds it.
    async fn register(&self, previous: Option<i64>) -> anyhow::Result<Session> {
        let mut client = connect(&self.etcd.endpoints).await?;
        let value = json!({
            "started_at": self.started_ms,
            "version": env!("CARGO_PKG_VERSION"),
        })
        .to_string();
        if let Some(lease) = previous {
            let alive = call("renewing the lease", client.lease_time_to_live(lease, None))
                .await?
                .ttl()
                > 0;
            if alive {
                let put = PutOptions::new().with_lease(lease);
                call(
                    "putting the replica key",
                    client.put(self.keys.me.as_str(), value, Some(put)),
                )
                .await?;
                return Ok(Session { client, lease });
            }
        }
        let ttl = i64::try_from(self.config.lease.as_secs())
            .unwrap_or(i64::MAX)
            .max(2);
        let lease = call("granting a lease", client.lease_grant(ttl, None))
            .await?
            .id();
        let put = PutOptions::new().with_lease(lease);
        let txn = Txn::new()
            .when([Compare::version(self.keys.me.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(self.keys.me.as_str(), value, Some(put))]);
        if !call("putting the replica key", client.txn(txn))
            .await?
            .succeeded()
        {
            let _ = call("revoking the unused lease", client.lease_revoke(lease)).await;
            return Err(IdTaken(self.keys.me.clone()).into());
        }
        self.lease.store(lease as u64, Ordering::Release);
        tracing::info!(replica = %self.config.replica_id, lease, ttl, "fleet replica registered");
        Ok(Session { client, lease })
    }

    /// The task: sessions with etcd one after the other, and between them
    /// this replica's transitions and the lease clock still followed.
    async fn run(
        self: Arc<Self>,
        mut session: Option<Session>,
        mut events: broadcast::Receiver<WorkerEvent>,
    ) {
        let mut backoff = Duration::from_millis(100);
        let mut lease = None;
        loop {
            if let Some(s) = session.take() {
                lease = Some(s.lease);
                let started = tokio::time::Instant::now();
                if let Err(error) = self.session(s, &mut events).await {
                    tracing::warn!(error = %format!("{error:#}"), "fleet verdicts: etcd session ended");
                }
                if started.elapsed() > MAX_BACKOFF * 5 {
                    backoff = Duration::from_millis(100);
                }
            }
            // Out of touch: local transitions and the lease clock go on.
            let retry = tokio::time::sleep(backoff);
            tokio::pin!(retry);
            let mut tick = tokio::time::interval(TICK);
            loop {
                tokio::select! {
                    () = &mut retry => break,
                    event = events.recv() => self.local(event, None).await.unwrap_or(()),
                    _ = tick.tick() => self.tick(),
                }
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            // A silent etcd takes a few call timeouts to give up on: the
            // lease clock keeps running meanwhile.
            let register = self.register(lease);
            tokio::pin!(register);
            let registered = loop {
                tokio::select! {
                    result = &mut register => break result,
                    _ = tick.tick() => self.tick(),
                }
            };
            match registered {
                Ok(s) => session = Some(s),
                Err(error) if error.is::<IdTaken>() => {
                    tracing::error!(error = %format!("{error:#}"), "fleet verdicts: this replica cannot register");
                }
                Err(error) => {
                    tracing::debug!(error = %format!("{error:#}"), "fleet verdicts: etcd not back yet")
                }
            }
        }
    }

    /// One session: rewrite this replica's verdicts, load the others', and
    /// follow both until something fails.
    async fn session(
        &self,
        mut session: Session,
        events: &mut broadcast::Receiver<WorkerEvent>,
    ) -> anyhow::Result<()> {
        let (mut keeper, mut answers) = call(
            "keeping the lease alive",
            session.client.lease_keep_alive(session.lease),
        )
        .await?;
        let revision = self.resync(&mut session).await?;
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = call(
            "watching the fleet's keys",
            session
                .client
                .watch(self.etcd.prefix.as_str(), Some(options)),
        )
        .await?;
        let mut renew = tokio::time::interval((self.config.lease / 3).max(TICK));
        let mut tick = tokio::time::interval(TICK);
        loop {
            tokio::select! {
                message = stream.message() => {
                    let Some(response) = message.context("the watch broke")? else {
                        bail!("the watch ended");
                    };
                    if response.canceled() {
                        bail!("etcd cancelled the watch: {}", response.cancel_reason());
                    }
                    for event in response.events() {
                        let Some(kv) = event.kv() else { continue };
                        let key = String::from_utf8_lossy(kv.key());
                        self.remote(&key, event.event_type() == EventType::Put)?;
                    }
                }
                event = events.recv() => self.local(event, Some(&mut session)).await?,
                _ = renew.tick() => {
                    call("renewing the lease", keeper.keep_alive()).await?;
                    match call("renewing the lease", answers.message()).await? {
                        Some(answer) if answer.ttl() > 0 => {
                            let now = self.registry.clock().now();
                            self.view.lock().unwrap().contact(now);
                        }
                        _ => bail!("the lease expired"),
                    }
                }
                _ = tick.tick() => {
                    self.tick();
                    if !self.view.lock().unwrap().in_touch() {
                        bail!("no answer from etcd within the lease");
                    }
                }
            }
        }
    }

    /// Rewrites this replica's verdicts (its own breakers are the truth),
    /// reloads the others' and returns the revision they were read at.
    async fn resync(&self, session: &mut Session) -> anyhow::Result<i64> {
        let prefixed = || Some(GetOptions::new().with_prefix());
        let txn = Txn::new().and_then([
            TxnOp::get(self.keys.replicas.as_str(), prefixed()),
            TxnOp::get(self.keys.verdicts.as_str(), prefixed()),
        ]);
        let loaded = call("loading the fleet's keys", session.client.txn(txn)).await?;
        let revision = loaded.header().map_or(0, |h| h.revision());
        let mut replicas = Vec::new();
        let mut verdicts = Vec::new();
        for op in loaded.op_responses() {
            let TxnOpResponse::Get(get) = op else {
                continue;
            };
            for kv in get.kvs() {
                match self.keys.parse(&String::from_utf8_lossy(kv.key())) {
                    Some(Key::Replica(id)) => replicas.push(id.to_owned()),
                    Some(Key::Verdict { worker, replica }) => {
                        verdicts.push((worker.to_owned(), replica.to_owned()))
                    }
                    None => {}
                }
            }
        }
        let me = &self.config.replica_id;
        let own: Vec<_> = self
            .own
            .lock()
            .unwrap()
            .iter()
            .map(|(w, (reason, since))| (w.clone(), *reason, *since))
            .collect();
        for (worker, _) in verdicts
            .iter()
            .filter(|(w, r)| r == me && !own.iter().any(|(o, ..)| o == w))
        {
            let key = self.keys.verdict(worker, me);
            call(
                "deleting a stale verdict",
                session.client.delete(key.as_str(), None),
            )
            .await?;
        }
        for (worker, reason, since) in own {
            self.put_verdict(session, &worker, reason, since).await?;
        }
        let now = self.registry.clock().now();
        let decisions = self.view.lock().unwrap().resync(replicas, verdicts, now);
        self.apply(decisions);
        Ok(revision)
    }

    /// Records this replica's own verdict on `worker` (`Some`: opened,
    /// why and when; `None`: closed) and returns what the quorum decides.
    fn own_verdict(&self, worker: &str, opened: Option<(&'static str, u64)>) -> Vec<Decision> {
        let mut own = self.own.lock().unwrap();
        let mut view = self.view.lock().unwrap();
        match opened {
            Some(value) => {
                own.entry(worker.to_owned()).or_insert(value);
                view.own_opened(worker)
            }
            None => {
                own.remove(worker);
                view.own_closed(worker)
            }
        }
    }

    async fn put_verdict(
        &self,
        session: &mut Session,
        worker: &str,
        reason: &str,
        since: u64,
    ) -> anyhow::Result<()> {
        let key = self.keys.verdict(worker, &self.config.replica_id);
        let value = json!({"state": "open", "reason": reason, "since": since}).to_string();
        let put = PutOptions::new().with_lease(session.lease);
        call(
            "putting a verdict",
            session.client.put(key.as_str(), value, Some(put)),
        )
        .await?;
        Ok(())
    }

    /// A change of one of the fleet's keys, seen by the watch.
    fn remote(&self, key: &str, put: bool) -> anyhow::Result<()> {
        let Some(key) = self.keys.parse(key) else {
            return Ok(());
        };
        let mut view = self.view.lock().unwrap();
        view.contact(self.registry.clock().now());
        let decisions = match key {
            Key::Replica(id) if id == self.config.replica_id && !put => {
                bail!("this replica's key went away (its lease expired)")
            }
            Key::Replica(id) if put => view.replica_up(id),
            Key::Replica(id) => view.replica_down(id),
            Key::Verdict { worker, replica } if put => view.verdict_put(worker, replica),
            Key::Verdict { worker, replica } => view.verdict_deleted(worker, replica),
        };
        drop(view);
        self.apply(decisions);
        Ok(())
    }

    /// One of this replica's own events: its breakers' verdicts go to etcd
    /// (when in session), and a worker the quorum holds is isolated as soon
    /// as it is added.
    async fn local(
        &self,
        event: Result<WorkerEvent, RecvError>,
        session: Option<&mut Session>,
    ) -> anyhow::Result<()> {
        let (worker, change) = match event {
            Ok(WorkerEvent::Breaker(worker, t)) if t.to == State::Open => {
                if t.reason == TransitionReason::Fleet {
                    return Ok(());
                }
                (worker, Some((t.reason.as_str(), unix_ms())))
            }
            Ok(WorkerEvent::Breaker(worker, t)) if t.to == State::Closed => (worker, None),
            Ok(WorkerEvent::Removed(worker)) => (worker, None),
            Ok(WorkerEvent::Added(worker)) => {
                let key = worker_key(&worker.url);
                let held = {
                    let view = self.view.lock().unwrap();
                    view.is_held(&key).then(|| view.holders(&key))
                };
                if let Some(replicas) = held {
                    self.apply(vec![Decision::Isolate {
                        worker: key,
                        replicas,
                    }]);
                }
                return Ok(());
            }
            Ok(_) => return Ok(()),
            Err(RecvError::Lagged(missed)) => {
                // Transitions were missed: the breakers themselves say
                // which verdicts are this replica's now.
                tracing::warn!(
                    missed,
                    "fleet verdicts lagged behind the breakers; rereading them"
                );
                for worker in self.registry.fleet().workers.iter() {
                    let s = worker.breaker.snapshot();
                    let event = match s.state {
                        State::Open if !s.fleet_opened => Some((worker.clone(), true)),
                        State::Closed => Some((worker.clone(), false)),
                        _ => None,
                    };
                    if let Some((w, open)) = event {
                        let opened =
                            open.then(|| (TransitionReason::FailureThreshold.as_str(), unix_ms()));
                        let decisions = self.own_verdict(&worker_key(&w.url), opened);
                        self.apply(decisions);
                    }
                }
                // The next session rewrites them all.
                if session.is_some() {
                    bail!("lagged behind the breakers");
                }
                return Ok(());
            }
            Err(RecvError::Closed) => return Ok(()),
        };
        let key = worker_key(&worker.url);
        let decisions = self.own_verdict(&key, change);
        self.apply(decisions);
        let Some(session) = session else {
            return Ok(());
        };
        match change {
            Some((reason, since)) => self.put_verdict(session, &key, reason, since).await,
            None => {
                let key = self.keys.verdict(&key, &self.config.replica_id);
                call(
                    "deleting a verdict",
                    session.client.delete(key.as_str(), None),
                )
                .await?;
                Ok(())
            }
        }
    }

    /// Checks the lease clock.
    fn tick(&self) {
        let now = self.registry.clock().now();
        let decisions = self.view.lock().unwrap().tick(now);
        if !decisions.is_empty() {
            tracing::warn!(
                lease = ?self.config.lease,
                "fleet verdicts: out of touch with etcd past the lease; fleet isolations end"
            );
        }
        self.apply(decisions);
    }

    /// Acts on the quorum's decisions, on every worker with that fleet key.
    fn apply(&self, decisions: Vec<Decision>) {
        if decisions.is_empty() {
            return;
        }
        let fleet = self.registry.fleet();
        let clock = self.registry.clock();
        for decision in decisions {
            let (Decision::Isolate { worker, replicas } | Decision::Release { worker, replicas }) =
                &decision;
            for w in fleet
                .workers
                .iter()
                .filter(|w| worker_key(&w.url) == *worker)
            {
                match decision {
                    Decision::Isolate { .. } => {
                        if w.breaker.fleet_open(&**clock) {
                            *self
                                .isolations
                                .lock()
                                .unwrap()
                                .entry(w.url.clone())
                                .or_default() += 1;
                            tracing::warn!(worker = %w.url, ?replicas, "fleet isolation: a quorum of replicas holds the worker open");
                        }
                    }
                    Decision::Release { .. } => {
                        if w.breaker.snapshot().fleet_opened {
                            w.breaker.fleet_release(&**clock);
                            tracing::info!(worker = %w.url, ?replicas, "fleet isolation ended: the quorum cleared");
                        }
                    }
                }
            }
        }
    }
}

/// The fleet task, stopped when this is dropped: a gateway that fails to
/// start after registering leaves no task renewing its lease.
#[derive(Debug)]
pub struct FleetTask(tokio::task::AbortHandle);

impl Drop for FleetTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A live replica already holds this replica's id.
#[derive(Debug, thiserror::Error)]
#[error(
    "a live replica already holds this replica id (its key {0} exists); choose another --replica-id"
)]
pub struct IdTaken(String);

impl MetricsSource for FleetVerdicts {
    fn render(&self, w: &mut Writer<'_>) {
        let view = self.view.lock().unwrap();
        w.family(
            "fleet_replicas",
            "gauge",
            "Live balancer replicas seen through etcd (--fleet-verdicts).",
        );
        w.sample("fleet_replicas", &[], view.live_replicas() as f64);
        let fleet = self.registry.fleet();
        w.family(
            "fleet_open_verdicts",
            "gauge",
            "Live replicas holding an open verdict on the worker.",
        );
        for wk in &fleet.workers {
            let holders = view.holders(&worker_key(&wk.url)).len();
            w.sample(
                "fleet_open_verdicts",
                &[("worker", &wk.url)],
                holders as f64,
            );
        }
        drop(view);
        let isolations = self.isolations.lock().unwrap();
        w.family(
            "fleet_isolations_total",
            "counter",
            "Times a quorum of replicas opened this replica's breaker on the worker.",
        );
        for wk in &fleet.workers {
            let n = isolations.get(&wk.url).copied().unwrap_or(0);
            w.sample("fleet_isolations_total", &[("worker", &wk.url)], n as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_ids_are_bounded_and_safe_in_a_key() {
        assert!(FleetConfig::check_replica_id("gpu-lb-1.example_a~b").is_ok());
        assert!(FleetConfig::check_replica_id("").is_err());
        assert!(FleetConfig::check_replica_id("a/b").is_err());
        assert!(FleetConfig::check_replica_id(&"a".repeat(MAX_REPLICA_ID + 1)).is_err());
    }

    #[test]
    fn keys_parse_back_into_replicas_and_verdicts() {
        let etcd = EtcdConfig {
            endpoints: vec![],
            prefix: "/b/".into(),
        };
        let keys = Keys::new(&etcd, "r1");
        assert_eq!(keys.me, "/b/replicas/r1");
        let verdict = keys.verdict("http%3A%2F%2Fw%3A1", "r2");
        assert_eq!(verdict, "/b/verdicts/http%3A%2F%2Fw%3A1/r2");
        assert!(matches!(
            keys.parse(&verdict),
            Some(Key::Verdict {
                worker: "http%3A%2F%2Fw%3A1",
                replica: "r2"
            })
        ));
        assert!(matches!(
            keys.parse("/b/replicas/r3"),
            Some(Key::Replica("r3"))
        ));
        assert!(keys.parse("/b/workers/w1").is_none());
        assert!(keys.parse("/b/verdicts/no-replica").is_none());
        assert!(
            keys.parse("/b/verdicts/w/a/b").is_none(),
            "not a replica id"
        );
        assert!(keys.parse("/b/verdicts//r1").is_none());
        let long = format!("/b/verdicts/{}/r1", "w".repeat(MAX_WORKER_KEY + 1));
        assert!(keys.parse(&long).is_none());
        assert!(keys.parse("/b/replicas/").is_none());
    }
}

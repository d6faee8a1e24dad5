//! Fleet verdicts: which workers a quorum of balancer replicas holds open.
//!
//! Owns the pure bookkeeping of `--fleet-verdicts`: the live replicas, the
//! open verdicts each of them published per worker, this replica's own
//! verdicts, the quorum rule, and how long this replica may go without
//! hearing from the store before the others' verdicts stop counting (its
//! lease, on an injected [`Clock`] reading). Every change returns the
//! [`Decision`]s it causes. It does no I/O and touches no breaker: the
//! agent's `fleet` module reads and writes etcd, feeds this view, and applies
//! the decisions through [`Breaker::fleet_open`](crate::breaker::Breaker::fleet_open)
//! and [`Breaker::fleet_release`](crate::breaker::Breaker::fleet_release).
//!
//! Workers are named by their *fleet key* ([`worker_key`]): the URL
//! percent-encoded, so that replicas agree on it whatever local id they use.
//!
//! Rules: a worker is held when at least `quorum` distinct replicas hold an
//! open verdict on it, counting only live replicas (those whose replica key
//! exists) and counting this replica once, from its own local verdict (its
//! key in the store may lag behind it).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use crate::clock::{Nanos, nanos};

/// What the agent must do after a change of the view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The quorum holds `worker` open: a closed breaker opens with reason
    /// `fleet`. Also repeated when this replica's own verdict ends while the
    /// quorum of the others still holds.
    Isolate {
        /// The worker's fleet key.
        worker: String,
        /// The replicas that formed the quorum, sorted.
        replicas: Vec<String>,
    },
    /// The quorum on `worker` cleared (or this replica lost touch with the
    /// store): a fleet-opened breaker goes half-open.
    Release {
        /// The worker's fleet key.
        worker: String,
        /// The replicas that had formed the quorum, sorted.
        replicas: Vec<String>,
    },
}

/// The fleet as this replica knows it.
#[derive(Debug)]
pub struct FleetView {
    me: String,
    quorum: usize,
    lease: Nanos,
    /// Live replicas (their replica key exists), this one included once its
    /// key is seen.
    replicas: BTreeSet<String>,
    /// Worker key → the other replicas with an open verdict on it, live or
    /// not (a replica's verdict and its replica key may arrive in any order).
    verdicts: BTreeMap<String, BTreeSet<String>>,
    /// Workers on which this replica's own breaker holds an open verdict.
    own: BTreeSet<String>,
    /// Workers the quorum holds now, with the replicas that formed it.
    held: BTreeMap<String, Vec<String>>,
    /// When the store last answered; `None` while out of touch.
    contact: Option<Nanos>,
}

impl FleetView {
    /// An empty view for replica `me`: nothing is held until the store is
    /// loaded ([`FleetView::resync`]). `quorum` is at least 1.
    pub fn new(me: impl Into<String>, quorum: usize, lease: Duration) -> Self {
        Self {
            me: me.into(),
            quorum: quorum.max(1),
            lease: nanos(lease),
            replicas: BTreeSet::new(),
            verdicts: BTreeMap::new(),
            own: BTreeSet::new(),
            held: BTreeMap::new(),
            contact: None,
        }
    }

    /// Live replicas seen (`fleet_replicas`).
    pub fn live_replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Whether the store answered within the lease.
    pub fn in_touch(&self) -> bool {
        self.contact.is_some()
    }

    /// The live replicas holding an open verdict on `worker`, this one
    /// included when its own breaker holds one, sorted and each once.
    pub fn holders(&self, worker: &str) -> Vec<String> {
        let mut holders: Vec<String> = self
            .verdicts
            .get(worker)
            .into_iter()
            .flatten()
            .filter(|r| self.replicas.contains(*r))
            .cloned()
            .collect();
        if self.own.contains(worker) {
            holders.push(self.me.clone());
            holders.sort();
        }
        holders
    }

    /// Whether the quorum holds `worker` now.
    pub fn is_held(&self, worker: &str) -> bool {
        self.held.contains_key(worker)
    }

    /// Every worker some live replica holds a verdict on, with its holders.
    pub fn open_verdicts(&self) -> BTreeMap<String, Vec<String>> {
        self.verdicts
            .keys()
            .chain(self.own.iter())
            .map(|w| (w.clone(), self.holders(w)))
            .filter(|(_, holders)| !holders.is_empty())
            .collect()
    }

    /// The store was loaded whole at `now` (start, or back in touch):
    /// `replicas` are the live replica ids, `verdicts` the (worker key,
    /// replica id) pairs present. This replica's own keys among them are
    /// ignored: its local verdicts are the truth about itself.
    pub fn resync(
        &mut self,
        replicas: impl IntoIterator<Item = String>,
        verdicts: impl IntoIterator<Item = (String, String)>,
        now: Nanos,
    ) -> Vec<Decision> {
        self.replicas = replicas.into_iter().collect();
        self.verdicts.clear();
        for (worker, replica) in verdicts {
            if replica != self.me {
                self.verdicts.entry(worker).or_default().insert(replica);
            }
        }
        self.contact = Some(now);
        self.settle()
    }

    /// A replica key appeared.
    pub fn replica_up(&mut self, replica: &str) -> Vec<Decision> {
        self.replicas.insert(replica.to_owned());
        self.settle()
    }

    /// A replica key went away (stopped, or its lease expired): its
    /// verdicts stop counting.
    pub fn replica_down(&mut self, replica: &str) -> Vec<Decision> {
        self.replicas.remove(replica);
        self.settle()
    }

    /// Another replica put an open verdict on `worker`.
    pub fn verdict_put(&mut self, worker: &str, replica: &str) -> Vec<Decision> {
        if replica != self.me {
            self.verdicts
                .entry(worker.to_owned())
                .or_default()
                .insert(replica.to_owned());
        }
        self.settle()
    }

    /// Another replica's verdict on `worker` went away.
    pub fn verdict_deleted(&mut self, worker: &str, replica: &str) -> Vec<Decision> {
        if let Some(replicas) = self.verdicts.get_mut(worker) {
            replicas.remove(replica);
            if replicas.is_empty() {
                self.verdicts.remove(worker);
            }
        }
        self.settle()
    }

    /// This replica's own breaker on `worker` opened on its own evidence.
    pub fn own_opened(&mut self, worker: &str) -> Vec<Decision> {
        self.own.insert(worker.to_owned());
        self.settle()
    }

    /// This replica's own breaker on `worker` closed. When the others'
    /// verdicts still form a quorum, the worker is isolated again.
    pub fn own_closed(&mut self, worker: &str) -> Vec<Decision> {
        self.own.remove(worker);
        let mut decisions = self.settle();
        if let Some(replicas) = self.held.get(worker)
            && !decisions
                .iter()
                .any(|d| matches!(d, Decision::Isolate { worker: w, .. } if w == worker))
        {
            decisions.push(Decision::Isolate {
                worker: worker.to_owned(),
                replicas: replicas.clone(),
            });
        }
        decisions
    }

    /// The store answered at `now` (a lease renewal, a watch event).
    pub fn contact(&mut self, now: Nanos) {
        if self.contact.is_some() {
            self.contact = Some(now);
        }
    }

    /// Checks the lease at `now`: past it without an answer from the store,
    /// the others' verdicts stop counting and every fleet isolation ends
    /// (local evidence rules again) until the next [`FleetView::resync`].
    pub fn tick(&mut self, now: Nanos) -> Vec<Decision> {
        match self.contact {
            Some(at) if now.saturating_sub(at) > self.lease => {
                self.contact = None;
                self.replicas.clear();
                self.verdicts.clear();
                self.settle()
            }
            _ => Vec::new(),
        }
    }

    /// Compares the quorum now with the one held, and says what changed.
    fn settle(&mut self) -> Vec<Decision> {
        let now: BTreeMap<String, Vec<String>> = self
            .open_verdicts()
            .into_iter()
            .filter(|(_, holders)| holders.len() >= self.quorum)
            .collect();
        let mut decisions = Vec::new();
        for (worker, replicas) in &self.held {
            if !now.contains_key(worker) {
                decisions.push(Decision::Release {
                    worker: worker.clone(),
                    replicas: replicas.clone(),
                });
            }
        }
        for (worker, replicas) in &now {
            if !self.held.contains_key(worker) {
                decisions.push(Decision::Isolate {
                    worker: worker.clone(),
                    replicas: replicas.clone(),
                });
            }
        }
        // A held worker keeps the replicas that first formed its quorum for
        // the log of its end; a newcomer to it changes nothing to decide.
        self.held = now
            .into_iter()
            .map(|(w, r)| {
                let first = self.held.remove(&w).unwrap_or(r);
                (w, first)
            })
            .collect();
        decisions
    }
}

/// A worker's fleet key: its URL with every byte outside `A-Z a-z 0-9 . _ ~ -`
/// percent-encoded in upper-case hex (`http%3A%2F%2F10.0.0.11%3A8000`).
pub fn worker_key(url: &str) -> String {
    let mut key = String::with_capacity(url.len() * 3);
    for byte in url.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'~' | b'-') {
            key.push(char::from(byte));
        } else {
            let _ = write!(key, "%{byte:02X}");
        }
    }
    key
}

#[cfg(test)]
mod tests;

//! Picking a worker for one attempt.
//!
//! Owns the load-balancing policies and the consistent-hash ring. It reads
//! worker state (eligibility, in-flight counts) and changes none of it. Every
//! policy first looks for an eligible worker the request has not tried yet,
//! and falls back to a tried one only when no other is eligible.
//!
//! Cost: random probes find an eligible worker in O(1) expected time while
//! most of the fleet is eligible; a full scan happens only when the probes
//! miss, i.e. when most candidates are out. `least_load` is the exception by
//! nature (it compares every candidate).

use std::hash::{BuildHasher, Hasher};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

use crate::clock::Clock;
use crate::worker::Worker;

/// How many random probes a sampling policy makes before scanning.
const PROBES: usize = 8;
/// Virtual nodes per worker on the hash ring.
const VNODES: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    Random,
    PowerOfTwo,
    LeastLoad,
    ConsistentHash,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "round_robin" => Policy::RoundRobin,
            "random" => Policy::Random,
            "power_of_two" => Policy::PowerOfTwo,
            "least_load" => Policy::LeastLoad,
            "consistent_hash" => Policy::ConsistentHash,
            other => {
                return Err(format!(
                    "unknown policy {other:?} (round_robin, random, power_of_two, least_load, consistent_hash)"
                ));
            }
        })
    }
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::PowerOfTwo => "power_of_two",
            Policy::LeastLoad => "least_load",
            Policy::ConsistentHash => "consistent_hash",
        }
    }
}

/// A consistent-hash ring over a candidate list: sorted (point, index) pairs.
#[derive(Debug, Default)]
pub struct Ring {
    points: Vec<(u64, u32)>,
}

fn hash_bytes(bytes: &[u8]) -> u64 {
    // A fixed-key hasher: the ring must place a key on the same worker across
    // restarts and across gateway replicas.
    let mut h =
        std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
            .build_hasher();
    h.write(bytes);
    h.finish()
}

/// The ring position of a routing key (`X-Session-Id` or the configured header).
pub fn hash_key(key: &[u8]) -> u64 {
    hash_bytes(key)
}

impl Ring {
    pub fn build(workers: &[Arc<Worker>]) -> Self {
        let mut points = Vec::with_capacity(workers.len() * VNODES);
        for (i, w) in workers.iter().enumerate() {
            for v in 0..VNODES {
                let point = hash_bytes(format!("{}#{v}", w.url).as_bytes());
                points.push((point, i as u32));
            }
        }
        points.sort_unstable();
        Self { points }
    }

    /// Candidate indices clockwise from `key`: each worker once, the owner first.
    fn walk(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|&(p, _)| p < key);
        let (tail, head) = self.points.split_at(start);
        head.iter().chain(tail).map(|&(_, i)| i as usize)
    }
}

/// The policy plus the little state it keeps (the round-robin cursor).
#[derive(Debug)]
pub struct Selector {
    policy: Policy,
    cursor: AtomicUsize,
}

impl Selector {
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            cursor: AtomicUsize::new(0),
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Picks a worker among `candidates` for one attempt. `tried` lists the ids
    /// of workers this request already used (they are avoided while any other
    /// is eligible); `key` is the routing key's hash for consistent hashing.
    pub fn select(
        &self,
        candidates: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        tried: &[u64],
        clock: &dyn Clock,
    ) -> Option<Arc<Worker>> {
        let fresh = |w: &Worker| w.is_eligible(clock) && !tried.contains(&w.breaker.id());
        if let Some(i) = self.pick(candidates, ring, key, &fresh) {
            return Some(candidates[i].clone());
        }
        if tried.is_empty() {
            return None;
        }
        let any = |w: &Worker| w.is_eligible(clock);
        self.pick(candidates, ring, key, &any)
            .map(|i| candidates[i].clone())
    }

    fn pick(
        &self,
        ws: &[Arc<Worker>],
        ring: Option<&Ring>,
        key: Option<u64>,
        ok: &dyn Fn(&Worker) -> bool,
    ) -> Option<usize> {
        let n = ws.len();
        if n == 0 {
            return None;
        }
        match self.policy {
            Policy::RoundRobin => {
                let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
                scan_from(ws, start, ok)
            }
            Policy::Random => sample(ws, ok).or_else(|| scan_from(ws, random_index(n), ok)),
            Policy::PowerOfTwo => {
                let first = sample(ws, ok)?;
                match sample(ws, ok) {
                    Some(second) if ws[second].inflight() < ws[first].inflight() => Some(second),
                    _ => Some(first),
                }
                .or_else(|| scan_from(ws, random_index(n), ok))
            }
            Policy::LeastLoad => (0..n)
                .filter(|&i| ok(&ws[i]))
                .min_by_key(|&i| ws[i].inflight()),
            Policy::ConsistentHash => match (ring, key) {
                (Some(ring), Some(key)) => ring.walk(key).find(|&i| ok(&ws[i])),
                // No routing key: spread like round robin.
                _ => {
                    let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
                    scan_from(ws, start, ok)
                }
            },
        }
    }
}

fn random_index(n: usize) -> usize {
    rand::rng().random_range(0..n)
}

/// A few random probes; `None` when they all missed (the caller then scans).
fn sample(ws: &[Arc<Worker>], ok: &dyn Fn(&Worker) -> bool) -> Option<usize> {
    let mut rng = rand::rng();
    (0..PROBES)
        .map(|_| rng.random_range(0..ws.len()))
        .find(|&i| ok(&ws[i]))
}

fn scan_from(ws: &[Arc<Worker>], start: usize, ok: &dyn Fn(&Worker) -> bool) -> Option<usize> {
    (start..ws.len()).chain(0..start).find(|&i| ok(&ws[i]))
}

//! The consistent-hash ring, on plain ids.
//!
//! Owns how a routing key and a worker URL map to points on the ring and how
//! the ring walks from a key to its owner. A leaf: it knows no worker, breaker
//! or fleet, only the points it is given, so the selection policies and the
//! fleet snapshot can both use it without depending on each other.

use std::hash::{BuildHasher, Hasher};

/// Virtual nodes per worker on the hash ring.
const VNODES: usize = 64;

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

/// A worker's ring points: derived from its URL only, so every gateway
/// replica places it alike.
pub fn ring_points(url: &str) -> Box<[u64]> {
    (0..VNODES)
        .map(|v| hash_bytes(format!("{url}#{v}").as_bytes()))
        .collect()
}

impl Ring {
    /// The ring over candidates given by their points, in candidate order:
    /// the ring's indices are positions in that order.
    pub fn build<'a>(candidates: impl IntoIterator<Item = &'a [u64]>) -> Self {
        let mut points: Vec<(u64, u32)> = candidates
            .into_iter()
            .enumerate()
            .flat_map(|(i, ps)| ps.iter().map(move |&p| (p, i as u32)))
            .collect();
        points.sort_unstable();
        Self { points }
    }

    /// Candidate indices clockwise from `key`: each worker once, the owner first.
    pub(crate) fn walk(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|&(p, _)| p < key);
        let (tail, head) = self.points.split_at(start);
        head.iter().chain(tail).map(|&(_, i)| i as usize)
    }
}

//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): a lookup table
//! in which every backend owns an almost equal share of slots, and which
//! changes in few slots beyond the ones of a backend that comes or goes, so
//! that new connections of most clients keep landing where they did.

use std::net::{IpAddr, SocketAddr};

use balancer_common::l4::{addr_be, mix64, port_be};

/// A backend as the table sees it: its index in the `BACKENDS` map, and a
/// key that identifies it across rebuilds (its address and port), from which
/// its permutation of the slots is derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    pub index: u32,
    pub key: u64,
}

/// The key of a backend at `addr`: for IPv4 the address and port as they
/// sit in the maps, side by side; for IPv6 all 128 bits mixed, with the
/// port.
pub fn member_key(addr: SocketAddr) -> u64 {
    let port = u64::from(port_be(addr.port()));
    match addr.ip() {
        IpAddr::V4(ip) => (u64::from(addr_be(ip.octets())) << 16) | port,
        IpAddr::V6(ip) => {
            let words = u128::from_be_bytes(ip.octets());
            mix64((words >> 64) as u64 ^ mix64(words as u64)) ^ port
        }
    }
}

/// Whether `n` is prime: Maglev's table size must be, so that every skip
/// value walks through every slot.
pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let n = u64::from(n);
    let mut d = 2u64;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// The table of `size` slots (a prime) over `members`, as backend indices;
/// empty when there are no members.
///
/// Members are taken in key order, so the same set gives the same table
/// whatever order the caller lists it in.
pub fn build(members: &[Member], size: u32) -> Vec<u32> {
    debug_assert!(is_prime(size), "Maglev table size {size} is not prime");
    if members.is_empty() || size == 0 {
        return Vec::new();
    }
    let mut members = members.to_vec();
    members.sort_by_key(|m| m.key);
    members.dedup_by_key(|m| m.key);

    let m = u64::from(size);
    // (offset, skip) of each member's permutation: slot j is
    // (offset + j * skip) mod size.
    let perms: Vec<(u64, u64)> = members
        .iter()
        .map(|member| {
            let offset = mix64(member.key ^ 0x5851_f42d_4c95_7f2d) % m;
            let skip = mix64(member.key ^ 0x1405_7b7e_f767_814f) % (m - 1) + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; members.len()];
    let mut table = vec![u32::MAX; size as usize];
    let mut filled = 0u32;
    // Members take turns claiming their next preferred free slot, which is
    // what makes the shares even.
    loop {
        for (i, member) in members.iter().enumerate() {
            let (offset, skip) = perms[i];
            let mut slot = ((offset + next[i] * skip) % m) as usize;
            while table[slot] != u32::MAX {
                next[i] += 1;
                slot = ((offset + next[i] * skip) % m) as usize;
            }
            table[slot] = member.index;
            next[i] += 1;
            filled += 1;
            if filled == size {
                return table;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: u32) -> Vec<Member> {
        (0..n)
            .map(|i| Member {
                index: i,
                key: member_key(SocketAddr::from(([10, 0, 0, i as u8 + 1], 8000))),
            })
            .collect()
    }

    fn shares(table: &[u32], n: u32) -> Vec<usize> {
        (0..n)
            .map(|i| table.iter().filter(|&&b| b == i).count())
            .collect()
    }

    #[test]
    fn primes() {
        assert!(is_prime(65_537));
        assert!(is_prime(251));
        assert!(is_prime(2));
        assert!(!is_prime(65_536));
        assert!(!is_prime(1));
        assert!(!is_prime(0));
        assert!(!is_prime(7919 * 7));
    }

    #[test]
    fn every_slot_is_filled_and_shares_are_even() {
        for n in [1, 2, 3, 7, 50] {
            let table = build(&members(n), 65_537);
            assert_eq!(table.len(), 65_537);
            let even = 65_537.0 / f64::from(n);
            for (i, share) in shares(&table, n).into_iter().enumerate() {
                let off = (share as f64 - even).abs() / even;
                assert!(
                    off < 0.02,
                    "{n} backends: backend {i} has {share} slots, {off:.3} off even"
                );
            }
        }
    }

    #[test]
    fn removing_a_backend_moves_few_other_slots() {
        let all = members(5);
        let before = build(&all, 65_537);
        let after = build(&all[..4], 65_537);
        // Slots of the removed backend must move; of the others' slots only
        // a small fraction may (the paper measures a few percent).
        let moved = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| **b != 4 && b != a)
            .count();
        assert!(
            moved < 65_537 / 20,
            "{moved} slots of remaining backends moved"
        );
        assert!(!after.contains(&4));
    }

    #[test]
    fn order_of_members_does_not_matter() {
        let mut all = members(4);
        let a = build(&all, 251);
        all.reverse();
        assert_eq!(a, build(&all, 251));
    }

    #[test]
    fn no_members_no_table() {
        assert!(build(&[], 251).is_empty());
    }

    /// Two balancers that learned the same workers in different orders
    /// hold them in different backend slots; steering is identical when
    /// every table slot names the same worker, through adds, removals and
    /// isolations (an isolated worker leaves the routable set).
    #[test]
    fn two_balancers_steer_alike_whatever_order_they_learned_the_workers_in() {
        let workers: Vec<u64> = (1..=12u8)
            .map(|i| member_key(SocketAddr::from(([10, 0, 1, i], 8000))))
            .collect();
        // Balancer A learned them in order, B in reverse: slot indices differ.
        let slot_a = |k: u64| workers.iter().position(|&w| w == k).unwrap() as u32;
        let slot_b =
            |k: u64| (workers.len() - 1 - workers.iter().position(|&w| w == k).unwrap()) as u32;
        let steer = |set: &[u64], slot: &dyn Fn(u64) -> u32| -> Vec<u64> {
            let members: Vec<Member> = set
                .iter()
                .map(|&key| Member {
                    index: slot(key),
                    key,
                })
                .collect();
            let by_index = |i: u32| members.iter().find(|m| m.index == i).unwrap().key;
            build(&members, 1009).into_iter().map(by_index).collect()
        };
        let mut routable: Vec<u64> = workers[..8].to_vec();
        let mut reversed = routable.clone();
        reversed.reverse();
        assert_eq!(steer(&routable, &slot_a), steer(&reversed, &slot_b));
        for change in 0..6 {
            match change % 3 {
                // A worker joins.
                0 => routable.push(workers[8 + change / 3]),
                // One is isolated (its breaker opened) or removed.
                1 => {
                    routable.remove(change % routable.len());
                }
                _ => routable.rotate_left(3),
            }
            let mut other = routable.clone();
            other.reverse();
            assert_eq!(
                steer(&routable, &slot_a),
                steer(&other, &slot_b),
                "after change {change}"
            );
        }
    }
}

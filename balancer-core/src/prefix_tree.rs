//! An approximate prefix tree of prompts: which workers were last sent which
//! prompt prefixes, and when.
//!
//! Owns one edge-compressed radix tree over prompt bytes, each node holding
//! the workers (by their interned breaker id, never a URL) that were sent a
//! prompt through it and the epoch at which each last was. It is pure and
//! single-threaded: the caller brings the lock (the cache-aware selector
//! shards trees per model and per prompt head) and the epoch (a logical
//! clock, so tests and eviction are deterministic). It knows nothing of
//! breakers, loads or the request path.
//!
//! Invariant: a worker holding a node holds every ancestor of it (an insert
//! stamps the whole path), so a node nobody holds has no children and is
//! freed at once. The tree's size is the bytes of its nodes' text, each
//! counted once however many workers hold it; a worker's share is the bytes
//! of the nodes it holds. Eviction bounds the footprint: the size plus
//! [`NODE_COST`] per node, so prompts crafted to split the tree at every
//! byte cannot multiply its memory.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use foldhash::HashMap;
use smallvec::SmallVec;

/// A worker as the tree knows it: its breaker id.
pub type WorkerId = u64;

/// Each holding worker's matched bytes; inline for a typical model's fleet.
pub type Matches = SmallVec<[(WorkerId, usize); 16]>;

const ROOT: u32 = 0;

/// What a node costs beside its text: the node itself and its lists, about
/// this many bytes on a 64-bit target.
pub const NODE_COST: usize = 64;

#[derive(Debug, Default)]
struct Node {
    text: Box<[u8]>,
    parent: u32,
    /// `(first byte of the child's text, child)`, sorted by the byte.
    children: Vec<(u8, u32)>,
    /// `(worker, epoch of its last use)`.
    holders: Vec<(WorkerId, u64)>,
}

impl Node {
    fn holds(&self, w: WorkerId) -> Option<u64> {
        self.holders.iter().find(|h| h.0 == w).map(|h| h.1)
    }
}

/// One radix tree; see the module documentation.
#[derive(Debug)]
pub struct PrefixTree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    size: usize,
    /// Nodes in use, the root aside.
    live: usize,
    cached: HashMap<WorkerId, usize>,
}

impl Default for PrefixTree {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            size: 0,
            live: 0,
            cached: HashMap::default(),
        }
    }
}

/// Bytes `a` and `b` share at their start, compared eight at a time where
/// they differ: a byte loop over a 4 KiB prompt alone would cost
/// microseconds.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    // The usual case on a walk, a whole edge matching: one vectorised
    // memory comparison.
    if a[..n] == b[..n] {
        return n;
    }
    let mut i = 0;
    while i + 8 <= n {
        let word = |s: &[u8]| u64::from_le_bytes(s[i..i + 8].try_into().unwrap_or_default());
        let diff = word(a) ^ word(b);
        if diff != 0 {
            return i + (diff.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

impl PrefixTree {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of text the tree holds, shared prefixes counted once.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes the tree takes: its text plus [`NODE_COST`] per node.
    pub fn footprint(&self) -> usize {
        self.size + self.live * NODE_COST
    }

    /// Bytes of text `worker` holds here.
    pub fn cached(&self, worker: WorkerId) -> usize {
        self.cached.get(&worker).copied().unwrap_or(0)
    }

    /// Every worker holding text here, with its bytes.
    pub fn holders(&self) -> impl Iterator<Item = (WorkerId, usize)> + '_ {
        self.cached.iter().map(|(&w, &n)| (w, n))
    }

    fn child(&self, n: u32, byte: u8) -> Option<u32> {
        let children = &self.nodes[n as usize].children;
        children
            .binary_search_by_key(&byte, |c| c.0)
            .ok()
            .map(|i| children[i].1)
    }

    /// How many leading bytes of `text` each worker holds, into `out`
    /// (cleared first; one entry per worker holding at least one byte).
    pub fn match_prefix(&self, text: &[u8], out: &mut Matches) {
        out.clear();
        let (mut n, mut at) = (ROOT, 0);
        while at < text.len() {
            let Some(c) = self.child(n, text[at]) else {
                break;
            };
            let node = &self.nodes[c as usize];
            let common = common_prefix(&node.text, &text[at..]);
            at += common;
            // Holders of a deeper node hold every shallower one: each
            // worker's last value is its longest match.
            for &(w, _) in &node.holders {
                match out.iter_mut().find(|e| e.0 == w) {
                    Some(e) => e.1 = at,
                    None => out.push((w, at)),
                }
            }
            if common < node.text.len() {
                break;
            }
            n = c;
        }
    }

    fn alloc(&mut self, node: Node) -> u32 {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn stamp(&mut self, n: u32, worker: WorkerId, epoch: u64) {
        let node = &mut self.nodes[n as usize];
        match node.holders.iter_mut().find(|h| h.0 == worker) {
            Some(h) => h.1 = epoch,
            None => {
                node.holders.push((worker, epoch));
                *self.cached.entry(worker).or_default() += node.text.len();
            }
        }
    }

    /// Records that `worker` was sent `text` at `epoch`: the path is added
    /// where missing and every node on it stamped for the worker.
    pub fn insert(&mut self, text: &[u8], worker: WorkerId, epoch: u64) {
        let (mut n, mut at) = (ROOT, 0);
        while at < text.len() {
            let Some(c) = self.child(n, text[at]) else {
                let leaf = self.alloc(Node {
                    text: text[at..].into(),
                    parent: n,
                    children: Vec::new(),
                    holders: Vec::new(),
                });
                let children = &mut self.nodes[n as usize].children;
                let pos = children.partition_point(|e| e.0 < text[at]);
                children.insert(pos, (text[at], leaf));
                self.size += text.len() - at;
                self.stamp(leaf, worker, epoch);
                return;
            };
            let common = common_prefix(&self.nodes[c as usize].text, &text[at..]);
            let c = if common < self.nodes[c as usize].text.len() {
                self.split(c, common)
            } else {
                c
            };
            self.stamp(c, worker, epoch);
            at += common;
            n = c;
        }
    }

    /// Cuts `c`'s text at `k`: a new node with the first `k` bytes (and the
    /// same holders) takes `c`'s place and `c` becomes its only child.
    fn split(&mut self, c: u32, k: usize) -> u32 {
        let node = &self.nodes[c as usize];
        let (parent, head, tail) = (node.parent, &node.text[..k], &node.text[k..]);
        let (first, rest_first) = (head[0], tail[0]);
        let upper = Node {
            text: head.into(),
            parent,
            children: vec![(rest_first, c)],
            holders: node.holders.clone(),
        };
        let tail: Box<[u8]> = tail.into();
        let upper = self.alloc(upper);
        let node = &mut self.nodes[c as usize];
        node.text = tail;
        node.parent = upper;
        let siblings = &mut self.nodes[parent as usize].children;
        if let Ok(i) = siblings.binary_search_by_key(&first, |e| e.0) {
            siblings[i].1 = upper;
        }
        upper
    }

    /// Drops `worker` from `n` (which must be a leaf for it) and frees `n`
    /// when nobody holds it any more. Returns whether `n` was freed.
    fn drop_holder(&mut self, n: u32, worker: WorkerId) -> bool {
        let node = &mut self.nodes[n as usize];
        node.holders.retain(|h| h.0 != worker);
        let len = node.text.len();
        if let Some(c) = self.cached.get_mut(&worker) {
            *c -= len;
            if *c == 0 {
                self.cached.remove(&worker);
            }
        }
        if !self.nodes[n as usize].holders.is_empty() {
            return false;
        }
        let node = std::mem::take(&mut self.nodes[n as usize]);
        debug_assert!(node.children.is_empty(), "an unheld node has no children");
        let siblings = &mut self.nodes[node.parent as usize].children;
        if let Ok(i) = siblings.binary_search_by_key(&node.text[0], |e| e.0) {
            siblings.remove(i);
        }
        self.size -= len;
        self.live -= 1;
        self.free.push(n);
        true
    }

    fn is_leaf_for(&self, n: u32, worker: WorkerId) -> bool {
        self.nodes[n as usize]
            .children
            .iter()
            .all(|&(_, c)| self.nodes[c as usize].holds(worker).is_none())
    }

    /// Evicts the least recently used (worker, leaf) entries, oldest epoch
    /// first, until the tree's [`PrefixTree::footprint`] is at most
    /// `target` bytes. Returns the entries dropped.
    pub fn evict(&mut self, target: usize) -> usize {
        if self.footprint() <= target {
            return 0;
        }
        let mut heap = BinaryHeap::new();
        for n in 1..self.nodes.len() as u32 {
            for &(w, epoch) in &self.nodes[n as usize].holders {
                if self.is_leaf_for(n, w) {
                    heap.push(Reverse((epoch, n, w)));
                }
            }
        }
        let mut dropped = 0;
        while self.footprint() > target {
            let Some(Reverse((_, n, w))) = heap.pop() else {
                break;
            };
            let parent = self.nodes[n as usize].parent;
            self.drop_holder(n, w);
            dropped += 1;
            if parent != ROOT
                && let Some(epoch) = self.nodes[parent as usize].holds(w)
                && self.is_leaf_for(parent, w)
            {
                heap.push(Reverse((epoch, parent, w)));
            }
        }
        dropped
    }

    /// Drops every entry of `worker` (its breaker opened, or it left the
    /// fleet: its cache is presumed lost).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        if !self.cached.contains_key(&worker) {
            return;
        }
        // Deepest first, so each node is a leaf for the worker when dropped.
        let mut order = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            for &(_, c) in &self.nodes[n as usize].children {
                if self.nodes[c as usize].holds(worker).is_some() {
                    order.push(c);
                    stack.push(c);
                }
            }
        }
        for &n in order.iter().rev() {
            self.drop_holder(n, worker);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(t: &PrefixTree, text: &str) -> Vec<(WorkerId, usize)> {
        let mut out = Matches::new();
        t.match_prefix(text.as_bytes(), &mut out);
        out.sort();
        out.into_vec()
    }

    #[test]
    fn common_prefix_finds_the_first_difference_at_any_position() {
        let a: Vec<u8> = (0..40).collect();
        for at in 0..=40 {
            let mut b = a.clone();
            if at < 40 {
                b[at] ^= 0xff;
            }
            assert_eq!(common_prefix(&a, &b), at);
            assert_eq!(common_prefix(&a[..at], &a), at);
        }
    }

    #[test]
    fn a_match_is_each_workers_longest_shared_prefix() {
        let mut t = PrefixTree::new();
        t.insert(b"system: be brief. user: hello", 1, 1);
        t.insert(b"system: be brief. user: goodbye", 2, 2);
        t.insert(b"other", 3, 3);
        assert_eq!(
            matches(&t, "system: be brief. user: help"),
            [(1, 27), (2, 24)]
        );
        assert_eq!(
            matches(&t, "system: be brief. user: goodbye!"),
            [(1, 24), (2, 31)]
        );
        assert_eq!(matches(&t, "oth"), [(3, 3)]);
        assert_eq!(matches(&t, "nothing"), []);
        // Shared text counts once in the size, once per holder in the shares.
        assert_eq!(t.size(), 31 - 24 + 29 + 5);
        assert_eq!((t.cached(1), t.cached(2), t.cached(3)), (29, 31, 5));
    }

    #[test]
    fn inserting_the_same_prompt_again_refreshes_and_grows_nothing() {
        let mut t = PrefixTree::new();
        t.insert(b"abcdef", 1, 1);
        t.insert(b"abcdef", 1, 2);
        t.insert(b"abc", 1, 3);
        assert_eq!(t.size(), 6);
        assert_eq!(t.cached(1), 6);
        assert_eq!(matches(&t, "abcdef"), [(1, 6)]);
    }

    #[test]
    fn eviction_drops_the_least_recently_used_leaves_first() {
        let mut t = PrefixTree::new();
        t.insert(b"prefix-old-tail", 1, 1);
        t.insert(b"prefix-new-tail", 2, 2);
        t.insert(b"prefix-old-tail", 2, 3);
        // Worker 1's entries (epoch 1) go first but free nothing worker 2
        // still holds; then worker 2's oldest leaf, new-tail (epoch 2).
        assert_eq!(t.size(), 7 + 8 + 8);
        assert_eq!(t.footprint(), 7 + 8 + 8 + 3 * NODE_COST);
        t.evict(t.footprint() - 1);
        assert_eq!(t.size(), 15);
        assert_eq!(t.cached(1), 0);
        assert_eq!(matches(&t, "prefix-old-tail"), [(2, 15)]);
        assert_eq!(matches(&t, "prefix-new-tail"), [(2, 7)]);
        t.evict(0);
        assert_eq!((t.size(), t.footprint()), (0, 0));
        assert_eq!(t.cached(2), 0);
        assert_eq!(matches(&t, "prefix"), []);
    }

    #[test]
    fn unique_prompts_past_the_bound_stay_within_it_after_eviction() {
        let mut t = PrefixTree::new();
        let bound = 10_000;
        let prompt = |i: u64| format!("shared system prompt; user {i} asks {}", i * 7919);
        for i in 0..5_000u64 {
            let prompt = prompt(i);
            t.insert(prompt.as_bytes(), i % 4, i);
            if i % 100 == 99 {
                t.evict(bound);
                assert!(t.footprint() <= bound, "{} > {bound}", t.footprint());
            }
        }
        let shares: usize = t.holders().map(|(_, n)| n).sum();
        assert!(shares >= t.size());
        // Node storage is reused, not grown, once eviction runs.
        assert!(t.nodes.len() < bound, "{} nodes", t.nodes.len());
        // The most recent prompt survives; the first is gone.
        let last = prompt(4999);
        assert!(matches(&t, &last).contains(&(4999 % 4, last.len())));
        let first = prompt(0);
        assert!(matches(&t, &first).iter().all(|m| m.1 < first.len()));
    }

    #[test]
    fn prompts_splitting_the_tree_at_every_byte_are_bounded_by_their_nodes() {
        let mut t = PrefixTree::new();
        let long: Vec<u8> = (0..4000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for n in 1..=long.len() {
            t.insert(&long[..n], 1, n as u64);
        }
        t.insert(&long, 2, 0);
        // Every prefix a node: 4000 bytes of text, 4000 nodes.
        assert_eq!(t.size(), 4000);
        assert_eq!(t.footprint(), 4000 * (1 + NODE_COST));
        let bound = 20_000;
        t.evict(bound);
        assert!(t.footprint() <= bound);
        assert!(t.live * NODE_COST <= bound);
    }

    #[test]
    fn removing_a_worker_drops_its_entries_and_keeps_the_others() {
        let mut t = PrefixTree::new();
        t.insert(b"common head, then one", 1, 1);
        t.insert(b"common head, then two", 2, 2);
        t.insert(b"solo", 1, 3);
        t.remove_worker(1);
        assert_eq!(t.cached(1), 0);
        assert_eq!(matches(&t, "common head, then one"), [(2, 18)]);
        assert_eq!(matches(&t, "solo"), []);
        assert_eq!(t.size(), 21);
        t.remove_worker(2);
        assert_eq!(t.size(), 0);
        // Freed nodes are reused.
        t.insert(b"again", 3, 4);
        assert_eq!(matches(&t, "again"), [(3, 5)]);
        assert!(t.nodes.len() <= 6);
    }
}

//! S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO (10% of the capacity), a
//! main FIFO with lazy reinsertion of accessed blocks, and a ghost FIFO of keys recently
//! evicted from the small queue. A block read again while in the small queue, or
//! re-inserted while its key is a ghost, goes to main; one-hit blocks leave early.

use std::collections::VecDeque;

use hashbrown::HashMap;

use super::list::KeyList;
use super::{EvictionPolicy, Verdict};
use crate::hash::BlockHash;

const MAX_FREQ: u8 = 3;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

struct Meta {
    queue: Queue,
    node: u32,
    freq: u8,
}

pub struct S3Fifo {
    small: KeyList,
    main: KeyList,
    meta: HashMap<BlockHash, Meta>,
    /// Ghost keys with the sequence number they were added under (stale deque entries
    /// are skipped when their number no longer matches).
    ghost: HashMap<BlockHash, u64>,
    ghost_fifo: VecDeque<(BlockHash, u64)>,
    ghost_seq: u64,
    small_target: usize,
    ghost_cap: usize,
}

impl S3Fifo {
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        S3Fifo {
            small: KeyList::new(),
            main: KeyList::new(),
            meta: HashMap::new(),
            ghost: HashMap::new(),
            ghost_fifo: VecDeque::new(),
            ghost_seq: 0,
            small_target: (capacity / 10).max(1),
            ghost_cap: capacity - (capacity / 10).min(capacity - 1),
        }
    }

    fn list(&mut self, q: Queue) -> &mut KeyList {
        match q {
            Queue::Small => &mut self.small,
            Queue::Main => &mut self.main,
        }
    }

    fn add_ghost(&mut self, key: BlockHash) {
        self.ghost_seq += 1;
        self.ghost.insert(key, self.ghost_seq);
        self.ghost_fifo.push_back((key, self.ghost_seq));
        while self.ghost.len() > self.ghost_cap {
            let Some((k, s)) = self.ghost_fifo.pop_front() else { break };
            if self.ghost.get(&k) == Some(&s) {
                self.ghost.remove(&k);
            }
        }
        // Keep the deque from growing with stale entries.
        if self.ghost_fifo.len() > 2 * self.ghost_cap + 16 {
            let ghost = &self.ghost;
            self.ghost_fifo.retain(|(k, s)| ghost.get(k) == Some(s));
        }
    }

    /// Moves `key` (at `node` of `from`) to the front of `to` with frequency `freq`.
    fn requeue(&mut self, key: BlockHash, node: u32, from: Queue, to: Queue, freq: u8) {
        self.list(from).unlink(node);
        let id = self.list(to).push_front(key);
        self.meta.insert(key, Meta { queue: to, node: id, freq });
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn insert(&mut self, key: BlockHash, _position: u32) {
        if self.touch(key) {
            return;
        }
        let queue = if self.ghost.remove(&key).is_some() { Queue::Main } else { Queue::Small };
        let node = self.list(queue).push_front(key);
        self.meta.insert(key, Meta { queue, node, freq: 0 });
    }

    fn touch(&mut self, key: BlockHash) -> bool {
        match self.meta.get_mut(&key) {
            Some(m) => {
                m.freq = (m.freq + 1).min(MAX_FREQ);
                true
            }
            None => false,
        }
    }

    fn remove(&mut self, key: BlockHash) -> bool {
        match self.meta.remove(&key) {
            Some(m) => {
                self.list(m.queue).unlink(m.node);
                true
            }
            None => false,
        }
    }

    fn contains(&self, key: BlockHash) -> bool {
        self.meta.contains_key(&key)
    }

    fn len(&self) -> usize {
        self.meta.len()
    }

    fn evict(&mut self, judge: &mut dyn FnMut(BlockHash) -> Verdict) -> Option<BlockHash> {
        // Every step either removes a key or moves one to a queue front; a kept block is
        // re-queued as if accessed. Bound the walk so a store where everything is
        // leased ends with None instead of spinning.
        let mut budget = 2 * (self.len() + 1) * (MAX_FREQ as usize + 2);
        // Blocks kept (leased or pinned) in a row from each queue: once a queue has been
        // walked round without a victim, the other queue is tried, so a small queue full
        // of leased blocks cannot hide an evictable block in main (or the reverse).
        let (mut kept_small, mut kept_main) = (0usize, 0usize);
        while budget > 0 {
            budget -= 1;
            let small_done = kept_small >= self.small.len();
            let main_done = kept_main >= self.main.len();
            if small_done && main_done {
                return None;
            }
            let prefer_small = self.small.len() > self.small_target || self.main.len() == 0;
            let from_small = if prefer_small { !small_done } else { main_done };
            let queue = if from_small { Queue::Small } else { Queue::Main };
            let (node, key) = self.list(queue).back()?;
            let freq = self.meta.get(&key).map_or(0, |m| m.freq);
            if freq > 0 {
                // Accessed since it entered its queue: promote (small) or reinsert (main).
                let f = if queue == Queue::Small { 0 } else { freq - 1 };
                self.requeue(key, node, queue, Queue::Main, f);
                // Main changed (a newcomer, or a block that must be judged again): its
                // round of kept blocks starts over. The budget still bounds the walk.
                kept_main = 0;
                continue;
            }
            match judge(key) {
                Verdict::Keep => {
                    match queue {
                        Queue::Small => kept_small += 1,
                        Queue::Main => kept_main += 1,
                    }
                    self.requeue(key, node, queue, queue, 0)
                }
                v => {
                    self.list(queue).unlink(node);
                    self.meta.remove(&key);
                    if v == Verdict::Evicted {
                        if queue == Queue::Small {
                            self.add_ghost(key);
                        }
                        return Some(key);
                    }
                }
            }
        }
        None
    }
}

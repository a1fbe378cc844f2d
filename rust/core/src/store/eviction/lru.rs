//! Least recently used.

use hashbrown::HashMap;

use super::list::KeyList;
use super::{EvictionPolicy, Verdict};
use crate::hash::BlockHash;

pub struct Lru {
    list: KeyList,
    nodes: HashMap<BlockHash, u32>,
}

impl Lru {
    pub fn new() -> Self {
        Lru { list: KeyList::new(), nodes: HashMap::new() }
    }
}

impl Default for Lru {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn insert(&mut self, key: BlockHash, _position: u32) {
        if !self.touch(key) {
            let id = self.list.push_front(key);
            self.nodes.insert(key, id);
        }
    }

    fn touch(&mut self, key: BlockHash) -> bool {
        let Some(id) = self.nodes.get_mut(&key) else {
            return false;
        };
        self.list.unlink(*id);
        *id = self.list.push_front(key);
        true
    }

    fn remove(&mut self, key: BlockHash) -> bool {
        match self.nodes.remove(&key) {
            Some(id) => {
                self.list.unlink(id);
                true
            }
            None => false,
        }
    }

    fn contains(&self, key: BlockHash) -> bool {
        self.nodes.contains_key(&key)
    }

    fn len(&self) -> usize {
        self.nodes.len()
    }

    fn evict(&mut self, judge: &mut dyn FnMut(BlockHash) -> Verdict) -> Option<BlockHash> {
        let mut cur = self.list.back();
        while let Some((id, key)) = cur {
            let next = self.list.newer(id);
            match judge(key) {
                Verdict::Keep => {}
                v => {
                    self.list.unlink(id);
                    self.nodes.remove(&key);
                    if v == Verdict::Evicted {
                        return Some(key);
                    }
                }
            }
            cur = next;
        }
        None
    }
}

//! A doubly linked list of keys stored in a slab (indices, not pointers), so the
//! policies get O(1) unlink / push-front without `unsafe`.

use crate::hash::BlockHash;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node {
    key: BlockHash,
    prev: u32,
    next: u32,
}

/// Front = most recently pushed; back = oldest.
pub(crate) struct KeyList {
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl KeyList {
    pub fn new() -> Self {
        KeyList { nodes: Vec::new(), free: Vec::new(), head: NIL, tail: NIL, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Pushes `key` at the front; returns its node id.
    pub fn push_front(&mut self, key: BlockHash) -> u32 {
        let node = Node { key, prev: NIL, next: self.head };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if self.head != NIL {
            self.nodes[self.head as usize].prev = id;
        }
        self.head = id;
        if self.tail == NIL {
            self.tail = id;
        }
        self.len += 1;
        id
    }

    /// Unlinks node `id` (which must be live) and returns its key.
    pub fn unlink(&mut self, id: u32) -> BlockHash {
        let Node { key, prev, next } = self.nodes[id as usize];
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        self.free.push(id);
        self.len -= 1;
        key
    }

    /// The oldest node.
    pub fn back(&self) -> Option<(u32, BlockHash)> {
        (self.tail != NIL).then(|| (self.tail, self.nodes[self.tail as usize].key))
    }

    /// The node before `id` toward the front (one step newer).
    pub fn newer(&self, id: u32) -> Option<(u32, BlockHash)> {
        let p = self.nodes[id as usize].prev;
        (p != NIL).then(|| (p, self.nodes[p as usize].key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_unlink_order() {
        let mut l = KeyList::new();
        let a = l.push_front(1);
        let b = l.push_front(2);
        let _c = l.push_front(3);
        assert_eq!(l.back(), Some((a, 1)));
        assert_eq!(l.unlink(a), 1);
        assert_eq!(l.back(), Some((b, 2)));
        assert_eq!(l.newer(b).map(|x| x.1), Some(3));
        l.unlink(b);
        let d = l.push_front(4);
        assert_eq!(d, b, "slab reuse");
        assert_eq!(l.len(), 2);
    }
}

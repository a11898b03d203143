//! A bounded ring of numbered entries: the last few of something kept for
//! operators (the last refusals, the last raises), each with a sequence
//! number that only goes up, so that a reader asks for what came after the
//! last one it saw.

use std::collections::VecDeque;

/// The most entries a ring may be configured to keep.
pub const MAX_KEPT: usize = 100_000;

/// An entry that carries its sequence number.
pub trait Numbered {
    fn seq(&self) -> u64;
    fn set_seq(&mut self, seq: u64);
}

/// The last `kept` entries pushed, oldest first, numbered from 1 without
/// gaps.
#[derive(Debug)]
pub struct SeqRing<T> {
    kept: usize,
    entries: VecDeque<T>,
    next: u64,
}

impl<T: Numbered> SeqRing<T> {
    /// A ring of the last `kept` entries (at most [`MAX_KEPT`]; 0: none).
    pub fn new(kept: usize) -> Self {
        let kept = kept.min(MAX_KEPT);
        Self {
            kept,
            entries: VecDeque::with_capacity(kept.min(1024)),
            next: 1,
        }
    }

    /// How many it keeps.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// The sequence number of the newest entry so far (0: none yet).
    pub fn newest(&self) -> u64 {
        self.next - 1
    }

    /// Numbers `entry` next and adds it. Returns the oldest, dropped to make
    /// room, if one was. A ring that keeps nothing numbers nothing.
    pub fn push(&mut self, mut entry: T) -> Option<T> {
        if self.kept == 0 {
            return None;
        }
        entry.set_seq(self.next);
        self.next += 1;
        let dropped = if self.entries.len() == self.kept {
            self.entries.pop_front()
        } else {
            None
        };
        self.entries.push_back(entry);
        dropped
    }

    /// The entry numbered `seq`, if it is still kept.
    pub fn get(&self, seq: u64) -> Option<&T> {
        let front = self.entries.front()?.seq();
        self.entries
            .get(usize::try_from(seq.checked_sub(front)?).ok()?)
    }

    /// Oldest first.
    pub fn iter(&self) -> std::collections::vec_deque::Iter<'_, T> {
        self.entries.iter()
    }

    /// Forgets every entry; numbering goes on.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct E(u64, &'static str);

    impl Numbered for E {
        fn seq(&self) -> u64 {
            self.0
        }
        fn set_seq(&mut self, seq: u64) {
            self.0 = seq;
        }
    }

    #[test]
    fn the_oldest_goes_and_numbers_go_on() {
        let mut ring = SeqRing::new(2);
        assert_eq!(ring.push(E(0, "a")), None);
        assert_eq!(ring.push(E(0, "b")), None);
        assert_eq!(ring.push(E(0, "c")), Some(E(1, "a")));
        assert_eq!(ring.newest(), 3);
        assert_eq!(ring.get(2), Some(&E(2, "b")));
        assert_eq!(ring.get(1), None);
        ring.clear();
        assert_eq!(ring.get(3), None);
        ring.push(E(0, "d"));
        assert_eq!(ring.iter().collect::<Vec<_>>(), [&E(4, "d")]);
    }

    #[test]
    fn a_ring_that_keeps_nothing_numbers_nothing() {
        let mut ring = SeqRing::new(0);
        assert_eq!(ring.push(E(0, "a")), None);
        assert_eq!(ring.newest(), 0);
        assert_eq!(SeqRing::<E>::new(usize::MAX).kept(), MAX_KEPT);
    }
}

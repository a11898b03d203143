//! The bounded cache of highest tokens that answers the steady case (a
//! token equal to the highest) without a store call, when the store says
//! this process is its only writer.

use std::sync::Arc;

use dashmap::DashMap;

/// Bounded map of highest tokens, in entries and in bytes (keys can be
/// long). Entries only ever hold values that are durable in the store, so
/// an evicted entry just costs one store lookup.
pub(super) struct HighestCache {
    /// Key -> highest token, and the sequence number of the key's latest
    /// in-flight mark if known (so that a key written again soon after its
    /// gate was dropped needs no new mark).
    pub(super) map: DashMap<Arc<str>, (u64, Option<u64>)>,
    pub(super) capacity: usize,
    pub(super) max_bytes: usize,
    /// Bytes held, counted as key length plus [`ENTRY_OVERHEAD`] each.
    pub(super) bytes: std::sync::atomic::AtomicUsize,
}

/// What one cache entry costs besides its key: the map slot, the `Arc`
/// header and the token.
pub(super) const ENTRY_OVERHEAD: usize = 64;

/// What an entry for `key` counts against the byte budget.
pub(super) fn entry_cost(key: &str) -> usize {
    key.len() + ENTRY_OVERHEAD
}

/// The default byte budget of the highest-token cache.
pub const DEFAULT_CACHE_BYTES: usize = 96 << 20;

impl HighestCache {
    pub(super) fn get(&self, key: &str) -> Option<u64> {
        self.map.get(key).map(|v| v.0)
    }

    /// Records a key's newer mark, if the key is cached.
    pub(super) fn note_mark(&self, key: &str, seq: u64) {
        if let Some(mut v) = self.map.get_mut(key) {
            v.1 = v.1.max(Some(seq));
        }
    }

    /// Raises the key's cached highest to `value` and, with `mark`, its
    /// mark, in one lookup.
    pub(super) fn raise(&self, key: &Arc<str>, value: u64, mark: Option<u64>) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.capacity == 0 {
            return;
        }
        if let Some(mut v) = self.map.get_mut(&**key) {
            v.0 = v.0.max(value);
            v.1 = v.1.max(mark);
            return;
        }
        let cost = entry_cost(key);
        if self.map.len() >= self.capacity || self.bytes.load(Relaxed) + cost > self.max_bytes {
            // Evict an arbitrary eighth. Cheap, and correct whatever is
            // evicted: the store is the authority.
            let mut budget = (self.map.len() / 8).max(1);
            self.map.retain(|k, _| {
                if budget == 0 {
                    return true;
                }
                budget -= 1;
                self.bytes.fetch_sub(entry_cost(k), Relaxed);
                false
            });
        }
        let mut added = false;
        self.map
            .entry(key.clone())
            .and_modify(|v| {
                v.0 = v.0.max(value);
                v.1 = v.1.max(mark);
            })
            .or_insert_with(|| {
                added = true;
                (value, mark)
            });
        if added {
            self.bytes.fetch_add(cost, Relaxed);
        }
    }

    pub(super) fn remove(&self, key: &str) {
        if let Some((k, _)) = self.map.remove(key) {
            self.bytes
                .fetch_sub(entry_cost(&k), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

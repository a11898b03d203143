//! The last raises of the fence, kept in memory for the operator (issue
//! 46): who raised a key's highest token, and when. The admin lookup
//! (`GET /v1/fences?path=`) and the page answer "by which request was this
//! key last raised" from it.
//!
//! A bounded ring, as the refusals are, with an index from key to its
//! newest raise kept. Only writes that move a key's highest land here (one
//! entry per raise, beside a durable store write that costs far more); a
//! write of the key's current token writes nothing. What a process cannot
//! know, it does not claim: a raise made by another replica of a shared
//! store, or before this process started, or pushed out of the ring, is
//! absent, and the lookup says so.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

use crate::ring::{Numbered, SeqRing};

/// How the raise was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A write whose own store call raised the key's highest (the
    /// embedded store: this process is its only writer, so this is the
    /// raise).
    Raised,
    /// A shared store granted the token to a write of this replica that
    /// found no registration of it here: the first write of the token
    /// through this replica. The raise itself may have been another
    /// replica's, or a fence-ahead.
    FirstHere,
    /// The admin API's fence-ahead (`POST /v1/fences/{key}`).
    FenceAhead,
}

/// One raise, as the operator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Raise {
    /// Increases by one per raise kept by this process.
    pub seq: u64,
    /// When it was admitted: milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub kind: Kind,
    pub key: String,
    /// Tokens go out as strings: JSON readers (the page's JavaScript among
    /// them) lose precision on integers past 2^53.
    #[serde(serialize_with = "crate::token::serialize_as_text")]
    pub token: u64,
    /// The highest before it, when the store said (`None`: a new key, or
    /// not known).
    #[serde(serialize_with = "crate::token::serialize_maybe_as_text")]
    pub previous: Option<u64>,
    pub method: String,
    /// The request target, bounded and with credentials redacted, as a
    /// refusal's is.
    pub target: String,
    /// The client: the socket's peer, or the one a PROXY header or a
    /// trusted proxy names (`None` for a fence-ahead: the admin API's
    /// caller is its bearer token's holder).
    pub client: Option<IpAddr>,
    pub user_agent: Option<String>,
    pub request_id: String,
    pub trace_id: Option<String>,
}

impl Numbered for Raise {
    fn seq(&self) -> u64 {
        self.seq
    }
    fn set_seq(&mut self, seq: u64) {
        self.seq = seq;
    }
}

/// The ring of the last raises.
#[derive(Debug)]
pub struct Raises {
    kept: usize,
    state: Mutex<Ring>,
    /// Rises at each reset ([`Raises::forget`], [`Raises::clear`]), under
    /// the ring's lock; read without it by every write before it asks for
    /// a raise.
    generation: AtomicU64,
}

#[derive(Debug)]
struct Ring {
    entries: SeqRing<Raise>,
    /// Per key in `entries`: the sequence number of its entry with the
    /// highest token.
    newest: HashMap<String, (u64, u64)>,
    /// The generation of each key's last reset, and of the last clear: a
    /// raise made before it (pushed once its write stopped waiting, which
    /// may be after the reset) names nothing.
    resets: HashMap<String, u64>,
    cleared: u64,
}

/// Resets remembered per key; past it they are forgotten as one clear
/// (raises from before it are then not named, which is only less known).
const RESETS_KEPT: usize = 4096;

impl Raises {
    /// A ring of the last `kept` raises (0: none kept).
    pub fn new(kept: usize) -> Self {
        let entries = SeqRing::new(kept);
        Self {
            kept: entries.kept(),
            state: Mutex::new(Ring {
                entries,
                newest: HashMap::new(),
                resets: HashMap::new(),
                cleared: 0,
            }),
            generation: AtomicU64::new(0),
        }
    }

    /// How many it keeps.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// Adds `r` (its `seq` set here), dropping the oldest when full. A
    /// [`Kind::FirstHere`] at a token the ring already holds for its key is
    /// not added: the first kept write at a token is the one named (a
    /// shared store's replica registers a token again after each idle
    /// spell); a raise this process made itself at that token replaces it
    /// as the key's newest (a fence-ahead is answered after the write it
    /// let in may already have registered). One that lands after a higher
    /// one on its key (their answers crossed) is kept, but the key's newest
    /// stays the higher one.
    ///
    /// `since` is [`Raises::generation`] read before the raise was asked
    /// for: a raise that a reset of its key (or of every key) may have
    /// undone since is not kept.
    pub fn push(&self, r: Raise, since: u64) {
        if self.kept == 0 {
            return;
        }
        let mut ring = self.state.lock().expect("raise ring lock");
        if ring.cleared > since || ring.resets.get(&r.key).is_some_and(|g| *g > since) {
            return;
        }
        let newest = ring.newest.get(&r.key).copied();
        if r.kind == Kind::FirstHere && newest.is_some_and(|(_, token)| token == r.token) {
            return;
        }
        let (key, token) = (r.key.clone(), r.token);
        if let Some(old) = ring.entries.push(r) {
            if ring
                .newest
                .get(&old.key)
                .is_some_and(|(s, _)| *s == old.seq)
            {
                ring.newest.remove(&old.key);
            }
        }
        if newest.is_none_or(|(_, t)| t <= token) {
            let seq = ring.entries.newest();
            ring.newest.insert(key, (seq, token));
        }
    }

    /// Forgets `key`'s raises (an operator reset its fence: a raise from
    /// nothing to a token kept before must not be named by the old one).
    pub fn forget(&self, key: &str) {
        let mut ring = self.state.lock().expect("raise ring lock");
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        ring.newest.remove(key);
        if ring.resets.len() >= RESETS_KEPT {
            ring.resets.clear();
            ring.cleared = generation;
        } else {
            ring.resets.insert(key.to_string(), generation);
        }
    }

    /// Forgets every raise (the store was reset).
    pub fn clear(&self) {
        let mut ring = self.state.lock().expect("raise ring lock");
        ring.cleared = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        ring.resets.clear();
        ring.newest.clear();
        ring.entries.clear();
    }

    /// The reset generation now: read before a raise is asked for, and
    /// given to [`Raises::push`] with it.
    pub fn generation(&self) -> u64 {
        // Acquire: not moved after the store call it precedes. A value
        // older than the newest only drops a raise, never names a wrong one.
        self.generation.load(Ordering::Acquire)
    }

    /// The kept raise of `key` with the highest token, if any.
    pub fn last(&self, key: &str) -> Option<Raise> {
        let ring = self.state.lock().expect("raise ring lock");
        let (seq, _) = *ring.newest.get(key)?;
        ring.entries.get(seq).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raise(key: &str, token: u64) -> Raise {
        Raise {
            seq: 0,
            at_ms: token,
            kind: Kind::Raised,
            key: key.into(),
            token,
            previous: None,
            method: "PUT".into(),
            target: "/k".into(),
            client: Some("192.0.2.1".parse().unwrap()),
            user_agent: None,
            request_id: format!("r{token}"),
            trace_id: None,
        }
    }

    #[test]
    fn the_last_raise_of_a_key_is_its_highest_token_kept() {
        let ring = Raises::new(4);
        ring.push(raise("a", 1), 0);
        ring.push(raise("b", 5), 0);
        ring.push(raise("a", 3), 0);
        assert_eq!(ring.last("a").unwrap().request_id, "r3");
        assert_eq!(ring.last("b").unwrap().token, 5);
        assert_eq!(ring.last("c"), None);
        // Answers that crossed: 2 lands after 3, and 3 stays the newest.
        ring.push(raise("a", 2), 0);
        assert_eq!(ring.last("a").unwrap().token, 3);
    }

    #[test]
    fn the_first_write_at_a_token_is_kept_not_its_repeats() {
        let ring = Raises::new(4);
        let mut first = raise("a", 7);
        first.kind = Kind::FirstHere;
        ring.push(first, 0);
        let mut again = raise("a", 7);
        again.kind = Kind::FirstHere;
        again.request_id = "later".into();
        ring.push(again, 0);
        assert_eq!(ring.last("a").unwrap().request_id, "r7");
    }

    #[test]
    fn a_raise_made_here_names_a_token_over_a_first_write() {
        let ring = Raises::new(4);
        let mut first = raise("a", 7);
        first.kind = Kind::FirstHere;
        ring.push(first, 0);
        let mut ahead = raise("a", 7);
        ahead.kind = Kind::FenceAhead;
        ahead.request_id = "grant".into();
        ring.push(ahead, 0);
        assert_eq!(ring.last("a").unwrap().request_id, "grant");
    }

    #[test]
    fn a_reset_key_is_named_by_its_next_raise_only() {
        let ring = Raises::new(4);
        ring.push(raise("a", 9), 0);
        ring.forget("a");
        assert_eq!(ring.last("a"), None);
        let mut again = raise("a", 9);
        again.request_id = "after-reset".into();
        ring.push(again, ring.generation());
        assert_eq!(ring.last("a").unwrap().request_id, "after-reset");
        ring.push(raise("b", 1), ring.generation());
        ring.clear();
        assert_eq!(ring.last("a"), None);
        assert_eq!(ring.last("b"), None);
    }

    #[test]
    fn a_raise_from_before_a_reset_is_not_named_after_it() {
        let ring = Raises::new(4);
        let before = ring.generation();
        ring.forget("a");
        // The write that raised before the reset stops waiting after it.
        ring.push(raise("a", 10), before);
        assert_eq!(ring.last("a"), None);
        // Another key is not affected, nor a raise asked for after it.
        ring.push(raise("b", 1), before);
        assert_eq!(ring.last("b").unwrap().token, 1);
        ring.push(raise("a", 10), ring.generation());
        assert_eq!(ring.last("a").unwrap().token, 10);
        // A clear undoes every raise asked for before it.
        let before = ring.generation();
        ring.clear();
        ring.push(raise("b", 2), before);
        assert_eq!(ring.last("b"), None);
    }

    #[test]
    fn a_key_pushed_out_of_the_ring_is_forgotten() {
        let ring = Raises::new(2);
        ring.push(raise("a", 1), 0);
        ring.push(raise("b", 1), 0);
        ring.push(raise("c", 1), 0);
        assert_eq!(ring.last("a"), None);
        assert_eq!(ring.last("b").unwrap().seq, 2);
        assert_eq!(ring.last("c").unwrap().seq, 3);
        // A key whose newest left while an older entry stays: no answer
        // rather than a stale one.
        let ring = Raises::new(2);
        ring.push(raise("a", 2), 0);
        ring.push(raise("a", 1), 0);
        ring.push(raise("b", 1), 0);
        assert_eq!(ring.last("a"), None);
    }

    #[test]
    fn a_ring_of_none_keeps_none() {
        let ring = Raises::new(0);
        ring.push(raise("a", 1), 0);
        assert_eq!(ring.last("a"), None);
    }
}

//! The fence's unit tests, on the embedded store.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

use super::cache::*;
use super::gate::*;
use super::shared::lease_covers;
use super::state::*;
use super::*;
use crate::store::embedded::EmbeddedStore;
use crate::store::FenceStore;

mod recovery;

const T: Duration = Duration::from_secs(1);

/// A fence over `store` whose store calls are counted.
fn instrumented(
    store: EmbeddedStore,
    window: Duration,
) -> (Arc<Fence>, Arc<crate::metrics::Metrics>) {
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let store =
        crate::store::instrumented::InstrumentedStore::new(Arc::new(store), metrics.clone());
    (Fence::new(Arc::new(store), 10, window), metrics)
}

/// Store calls of kind `op` so far.
fn store_calls(metrics: &crate::metrics::Metrics, op: &str) -> u64 {
    metrics
        .store_latency
        .with_label_values(&[op])
        .get_sample_count()
}

fn fence(dir: &tempfile::TempDir) -> Arc<Fence> {
    let store =
        EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1)).unwrap();
    Fence::new(Arc::new(store), 1000, Duration::from_secs(1))
}

#[test]
fn older_writes_have_lower_tokens_and_the_latest_live_deadline_counts() {
    let now = Instant::now();
    let at = |s: u64| now + Duration::from_secs(s);
    let mut st = GateState::default();
    assert!(matches!(st.older(5, now), Older::None));
    // The same token is not older: equal tokens are not serialized.
    st.enter(5, at(9));
    assert!(matches!(st.older(5, now), Older::None));
    st.enter(3, at(2));
    st.enter(3, at(6));
    st.enter(4, at(4));
    // The latest deadline among the older writes, not the first or the
    // earliest.
    assert!(matches!(st.older(5, now), Older::Live(d) if d == at(6)));
    assert!(matches!(st.older(4, now), Older::Live(d) if d == at(6)));
    assert!(matches!(st.older(5, at(5)), Older::Live(d) if d == at(6)));
    // A deadline that has come is past: only expired ones are left.
    assert!(matches!(st.older(4, at(6)), Older::Expired));
    assert!(matches!(st.older(5, at(7)), Older::Expired));
    // Expired older writes do not hide a live one behind them.
    assert!(matches!(st.older(6, at(7)), Older::Live(d) if d == at(9)));
}

fn cache(capacity: usize, max_bytes: usize) -> HighestCache {
    HighestCache {
        map: DashMap::new(),
        capacity,
        max_bytes,
        bytes: Default::default(),
    }
}

#[test]
fn the_cache_keeps_its_entries_within_the_byte_budget() {
    use std::sync::atomic::Ordering::Relaxed;
    let per = 10 + ENTRY_OVERHEAD;
    let c = cache(1000, 3 * per);
    for k in ["key-000001", "key-000002", "key-000003"] {
        c.raise(&Arc::from(k), 7, None);
    }
    assert_eq!(c.get("key-000002"), Some(7));
    c.raise(&Arc::from("key-000002"), 6, None);
    assert_eq!(c.get("key-000002"), Some(7), "never lowered");
    assert_eq!(c.map.len(), 3, "three 10-byte keys fit a budget of three");
    assert_eq!(c.bytes.load(Relaxed), 3 * per);
    c.raise(&Arc::from("key-000004"), 7, None);
    assert_eq!(
        c.map.len(),
        3,
        "a fourth is over the byte budget: an eighth (at least one) goes"
    );
    assert_eq!(c.get("key-000004"), Some(7), "the new entry is kept");
    assert_eq!(c.bytes.load(Relaxed), c.map.len() * per);
    c.remove("key-000004");
    assert_eq!(c.get("key-000004"), None);
    assert_eq!(c.bytes.load(Relaxed), c.map.len() * per);
    // The entry bound holds as well, and a capacity of 0 caches nothing.
    let c = cache(2, usize::MAX);
    for k in ["a", "b", "c"] {
        c.raise(&Arc::from(k), 1, None);
    }
    assert!(c.map.len() <= 2, "{} entries in a cache of 2", c.map.len());
    assert_eq!(c.get("c"), Some(1), "the newest entry is kept");
    let c = cache(0, usize::MAX);
    c.raise(&Arc::from("a"), 1, None);
    assert_eq!(c.get("a"), None);
}

#[test]
fn the_default_byte_budget_holds_a_hundred_thousand_long_keys() {
    let c = cache(1_000_000, DEFAULT_CACHE_BYTES);
    for i in 0..100_000u64 {
        c.raise(&Arc::from(format!("{i:0>200}")), i, None);
    }
    assert_eq!(c.map.len(), 100_000);
    assert_eq!(c.get(&format!("{:0>200}", 99_999)), Some(99_999));
}

#[tokio::test]
async fn lower_is_stale_equal_and_higher_are_admitted() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    let w = Instant::now() + Duration::from_secs(1);
    drop(f.admit("k", 5, w, T).await.unwrap());
    drop(f.admit("k", 5, w, T).await.unwrap());
    drop(f.admit("k", 7, w, T).await.unwrap());
    match f.admit("k", 6, w, T).await {
        Err(FenceError::Stale {
            token: 6,
            highest: 7,
        }) => {}
        other => panic!("expected stale, got {:?}", other.err()),
    }
    assert_eq!(f.store().highest("k").await.unwrap(), Some(7));
    assert_eq!(f.active_keys(), 0, "idle gates are dropped");
}

// Real time: the store answers from its own thread, and paused time
// would jump to the wait deadline while the runtime waits for it.
#[tokio::test]
async fn newer_waits_for_older_in_flight_and_queued_older_turn_stale() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    let w = Instant::now() + Duration::from_secs(30);
    let old = f.admit("k", 1, w, T).await.unwrap();
    assert_eq!(f.active_keys(), 1, "a write in flight holds its key's gate");
    let f2 = f.clone();
    let mid = tokio::spawn(async move { f2.admit("k", 2, w, T).await.map(|p| p.token()) });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(
        !mid.is_finished(),
        "token 2 must wait for token 1 in flight"
    );
    // Counted once it waits (its own store commit comes first).
    for _ in 0..200 {
        if f.waiting().get() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(f.waiting().get(), 1, "the waiting write is counted");
    let f3 = f.clone();
    let new = tokio::spawn(async move { f3.admit("k", 3, w, T).await.map(|p| p.token()) });
    let mid = mid.await.unwrap();
    assert!(matches!(
        mid,
        Err(FenceError::Stale {
            token: 2,
            highest: 3
        })
    ));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(
        !new.is_finished(),
        "token 3 must wait for token 1 in flight"
    );
    drop(old);
    assert_eq!(new.await.unwrap().unwrap(), 3);
    assert_eq!(f.waiting().get(), 0, "no write is waiting any more");
}

/// The one rule for a lease and the write it admits: the write's
/// deadline plus the cut's grace ends by the lease's end, counted from
/// before its request was sent.
#[test]
fn a_lease_covers_a_write_that_ends_with_its_grace_inside_it() {
    let sent = Instant::now();
    let ttl = Duration::from_secs(4);
    let end = sent + ttl - CUT_GRACE;
    assert!(lease_covers(sent, ttl, end));
    assert!(lease_covers(sent, ttl, end - Duration::from_millis(1)));
    assert!(!lease_covers(sent, ttl, end + Duration::from_millis(1)));
}

/// Fence-ahead raises (and refuses to lower), the highest is read from
/// the gate, the cache or the store alike, a reset forgets, and a write
/// holding a key learns when a newer token took it over.
#[tokio::test]
async fn raise_highest_forget_and_overtaken() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1)).unwrap();
    let store: Arc<dyn FenceStore> = Arc::new(store);
    // No cache: the highest of an idle key comes from the store.
    let uncached = Fence::new(store.clone(), 0, T);
    let f = Fence::new(store, 10, T);
    assert_eq!(f.highest("k").await.unwrap(), None);
    let mut raised = None;
    assert_eq!(f.raise_noting("k", 5, &mut raised).await.unwrap(), 5);
    assert!(matches!(raised, Some(Raised::From { previous: None, .. })));
    let mut raised = None;
    assert_eq!(
        f.raise_noting("k", 5, &mut raised).await.unwrap(),
        5,
        "an equal raise is no error"
    );
    assert_eq!(raised, None, "and raises nothing");
    assert!(matches!(
        f.raise("k", 3).await,
        Err(FenceError::Stale {
            token: 3,
            highest: 5
        })
    ));
    assert_eq!(f.raise("k", 7).await.unwrap(), 7);
    assert_eq!(f.highest("k").await.unwrap(), Some(7), "from the cache");
    assert_eq!(
        uncached.highest("k").await.unwrap(),
        Some(7),
        "from the store"
    );
    let w = Instant::now() + T;
    let p = f.admit("k", 7, w, T).await.unwrap();
    assert_eq!(f.highest("k").await.unwrap(), Some(7), "from the gate");
    assert_eq!(f.overtaken(&p).await.unwrap(), None, "its own token");
    assert_eq!(f.raise("k", 9).await.unwrap(), 9);
    assert_eq!(f.overtaken(&p).await.unwrap(), Some(9));
    assert_eq!(f.highest("k").await.unwrap(), Some(9));
    drop(p);
    assert_eq!(f.forget("k").await.unwrap(), Some(9));
    assert_eq!(f.forget("k").await.unwrap(), None);
    assert_eq!(f.highest("k").await.unwrap(), None, "forgotten everywhere");
    drop(
        f.admit("k", 1, w, T)
            .await
            .expect("a reset key takes any token"),
    );
    assert_eq!(f.highest("k").await.unwrap(), Some(1));
}

/// An ended write no longer holds newer ones back, however many
/// writes shared its token and deadline.
#[tokio::test(start_paused = true)]
async fn ended_writes_release_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    let now = Instant::now();
    let a = f.admit("k", 1, now, T).await.unwrap();
    let b = f.admit("k", 1, now, T).await.unwrap();
    // Kept alive, so that what the ended writes leave behind stays in
    // view (an idle gate would be dropped, and its state with it).
    let _gate = f.gate(&Arc::from("k"));
    drop(a);
    assert!(
        matches!(
            f.admit("k", 2, Instant::now(), T).await,
            Err(FenceError::Busy { .. })
        ),
        "one of two writes of token 1 is still in flight"
    );
    drop(b);
    let p = f.admit("k", 2, Instant::now(), T).await.unwrap();
    assert!(!p.waited_out, "nothing older was left registered");
    drop(p);
    let p = f.admit("k", 3, Instant::now(), T).await.unwrap();
    assert!(!p.waited_out);
}

/// The steady path: once a key's highest is known, an equal or a stale
/// token is answered from memory, with no store call.
#[tokio::test]
async fn equal_and_stale_tokens_on_a_known_key_cost_no_store_call() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1)).unwrap();
    let (f, metrics) = instrumented(store, Duration::from_secs(1));
    let advances = || store_calls(&metrics, "advance");
    let w = Instant::now() + T;
    // Held, so that the key's gate (and its highest) stays in memory.
    let held = f.admit("k", 5, w, T).await.unwrap();
    assert_eq!(advances(), 1);
    drop(f.admit("k", 5, w, T).await.unwrap());
    assert!(matches!(
        f.admit("k", 4, w, T).await,
        Err(FenceError::Stale { .. })
    ));
    assert_eq!(advances(), 1, "equal and stale tokens went to the store");
    drop(held);
}

/// Shared-store leases outlive the write's own limit by the store's
/// latency margin: a lease that expired before the write's deadline
/// would let a newer write on another replica overtake it.
#[tokio::test]
async fn leases_live_the_recovery_window_plus_the_margin() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1)).unwrap();
    let f = Fence::with_lease_margin(
        Arc::new(store),
        10,
        Duration::from_secs(5),
        Duration::from_secs(2),
    );
    assert_eq!(f.lease_ttl, Duration::from_secs(7));
    assert_eq!(f.lease_margin, Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_newer_write_waits_out_the_older_writes_own_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    let start = Instant::now();
    let _old = f
        .admit("k", 1, start, Duration::from_secs(2))
        .await
        .unwrap();
    // Its own limit is later: it waits until the older write's deadline,
    // when the proxy has given up on it, and goes then.
    let p = f
        .admit(
            "k",
            2,
            start + Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert!(p.waited_out);
    assert!(Instant::now() >= start + Duration::from_secs(2) + CUT_GRACE);
    assert!(Instant::now() < start + Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn a_newer_write_whose_limit_comes_first_is_refused_not_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    let start = Instant::now();
    let old = f
        .admit("k", 1, start, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(old.deadline(), start + Duration::from_secs(10));
    match f
        .admit(
            "k",
            2,
            start + Duration::from_secs(2),
            Duration::from_secs(2),
        )
        .await
    {
        Err(FenceError::Busy { retry_after }) => {
            assert!(Instant::now() >= start + Duration::from_secs(2));
            assert_eq!(retry_after, old.deadline() + CUT_GRACE - Instant::now());
        }
        other => panic!("expected busy, got {:?}", other.map(|p| p.token())),
    }
    // The refused write left nothing in flight: once the older write
    // ends, a retry goes at once.
    drop(old);
    let p = f
        .admit("k", 2, Instant::now(), Duration::from_secs(2))
        .await
        .unwrap();
    assert!(!p.waited_out);
}

#[tokio::test]
async fn an_abandoned_admission_leaves_no_gate_behind() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    for i in 0..50u64 {
        let key = format!("k{i}");
        // Polled once, then dropped at its first pending point: while
        // its advance is with the store.
        tokio::select! {
            biased;
            _ = f.admit(&key, 1, Instant::now(), T) => panic!("admitted without waiting for the store"),
            _ = std::future::ready(()) => {}
        }
    }
    eventually_idle(&f).await;
}

async fn eventually_idle(f: &Arc<Fence>) {
    for _ in 0..500 {
        if f.active_keys() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} gates left behind", f.active_keys());
}

/// A write that raises its key and is then refused (it waited behind an
/// older write in flight past its own limit) still reports its raise: the
/// store holds its token as the key's highest whatever the write became.
#[tokio::test]
async fn a_raise_is_reported_even_when_its_write_is_then_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    let older = f.admit("k", 1, Instant::now() + T, T).await.unwrap();
    let mut raised = None;
    let newer = f.admit_noting("k", 2, Instant::now(), T, &mut raised).await;
    assert!(
        matches!(newer, Err(FenceError::Busy { .. })),
        "behind the older write"
    );
    assert!(
        matches!(
            raised,
            Some(Raised::From {
                previous: Some(1),
                ..
            })
        ),
        "{raised:?}"
    );
    assert_eq!(f.highest("k").await.unwrap(), Some(2));
    drop(older);
}

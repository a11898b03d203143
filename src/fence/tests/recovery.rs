//! Crash recovery: in-flight marks, their rotation, and the holds after
//! an unclean stop.

use super::*;

/// After an unclean stop only the keys with live marks are held: a
/// token above a held key's highest is refused for the recovery window
/// (the longer of this run's and the crashed run's), with the time
/// left; equal and stale tokens on it, and every other key, are
/// answered as in normal running.
#[tokio::test]
async fn after_an_unclean_stop_only_keys_marked_in_flight_are_held() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let open = |window| EmbeddedStore::open(&path, 1 << 20, window).unwrap();
    let f = Fence::new(Arc::new(open(Duration::from_secs(3))), 10, T);
    let w = Instant::now() + T;
    // "quiet" had a write that ended before a rotation; "busy" has one
    // in flight through it.
    let mut raised = None;
    drop(f.admit_noting("quiet", 1, w, T, &mut raised).await.unwrap());
    assert!(
        matches!(raised, Some(Raised::From { previous: None, .. })),
        "a new key: {raised:?}"
    );
    assert_eq!(f.store().in_flight_marks(), 1, "a written key is marked");
    let busy = f.admit("busy", 1, w, T).await.unwrap();
    let mut raised = None;
    let again = f.admit_noting("busy", 1, w, T, &mut raised).await.unwrap();
    assert_eq!(raised, None, "an equal token raises nothing");
    assert_eq!(f.activity("busy").in_flight, [(1, 2)]);
    drop(again);
    assert_eq!(f.activity("busy").in_flight, [(1, 1)]);
    assert_eq!(f.rotate_marks().await.unwrap(), 1, "the key in flight");
    assert_eq!(f.store().in_flight_marks(), 1, "the idle key's mark died");
    drop(busy);
    drop(f); // a crash before the next rotation
    let f = Fence::new(
        Arc::new(open(Duration::from_secs(5))),
        10,
        Duration::from_secs(5),
    );
    let left = f.recovering_for().expect("recovering after a crash");
    assert!(
        left > Duration::from_secs(4) && left <= Duration::from_secs(5),
        "{left:?}"
    );
    assert_eq!(f.held_keys(), Some(1));
    // The lookup sees the hold on the key, and none on the other.
    let held = f.activity("busy").held_for.expect("busy is held");
    assert!(held > Duration::from_secs(4), "{held:?}");
    assert_eq!(f.activity("quiet").held_for, None);
    let w = Instant::now() + T;
    match f.admit("busy", 2, w, T).await {
        Err(FenceError::Recovering { retry_after }) => {
            assert!(retry_after > Duration::from_secs(4), "{retry_after:?}")
        }
        other => panic!("expected recovering, got {:?}", other.map(|p| p.token())),
    }
    assert!(matches!(
        f.raise("busy", 9).await,
        Err(FenceError::Recovering { .. })
    ));
    // Rotations keep a held key's mark while the hold lasts.
    f.rotate_marks().await.unwrap();
    f.rotate_marks().await.unwrap();
    assert_eq!(f.store().in_flight_marks(), 1, "a held key keeps its mark");
    drop(f.admit("busy", 1, w, T).await.expect("equal, as usual"));
    assert!(matches!(
        f.admit("busy", 0, w, T).await,
        Err(FenceError::Stale { highest: 1, .. })
    ));
    drop(
        f.admit("quiet", 2, w, T)
            .await
            .expect("a quiet key is not held"),
    );
    drop(
        f.admit("new", 1, w, T)
            .await
            .expect("a new key is not held"),
    );
    assert_eq!(f.raise("quiet", 3).await.unwrap(), 3);
    drop(f); // a crash again, this run's window being 5 s
             // A restart with a shorter timeout still waits the crashed run's
             // window: its writes may run that long. The held key's mark was
             // kept, and the keys written since were marked.
    let f = Fence::new(Arc::new(open(Duration::from_secs(1))), 10, T);
    let left = f.recovering_for().expect("recovering after a crash");
    assert!(left > Duration::from_secs(4), "{left:?}");
    assert_eq!(f.held_keys(), Some(3));
    drop(f); // and a crash of that short run: the store kept the 5 s
    let f = Fence::new(Arc::new(open(Duration::ZERO)), 10, Duration::ZERO);
    let left = f.recovering_for().expect("recovering after a crash");
    assert!(left > Duration::from_secs(4), "{left:?}");
    f.store().close_clean().await.unwrap();
    drop(f);
    let f = Fence::new(Arc::new(open(Duration::ZERO)), 10, Duration::ZERO);
    assert_eq!(f.recovering_for(), None, "after a clean stop");
    assert_eq!(f.held_keys(), Some(0));
    let w = Instant::now() + T;
    drop(f.admit("busy", 2, w, T).await.unwrap());
    drop(f); // a crash with a zero window: nothing to wait for
    let f = Fence::new(Arc::new(open(Duration::ZERO)), 10, Duration::ZERO);
    assert_eq!(f.recovering_for(), None, "a zero window");
    assert_eq!(f.held_keys(), Some(0));
    let w = Instant::now() + T;
    assert_eq!(f.admit("busy", 3, w, T).await.unwrap().token(), 3);
}

/// A newer token that was admitted to the store while an older write
/// was still in flight (it queued behind it, or an operator raised the
/// fence) is the key's highest after the crash, yet the older write may
/// still be applied: that highest is held off too, as is a reset.
#[tokio::test]
async fn a_held_key_holds_off_every_token_above_the_oldest_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let open = || EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(5)).unwrap();
    let store = open();
    store.advance_marked("k", 5).await.unwrap(); // 5 forwarded
    store.advance("k", 6).await.unwrap(); // 6 raised, waiting behind it
    drop(store); // a crash
    let f = Fence::new(Arc::new(open()), 10, Duration::from_secs(5));
    let w = Instant::now() + T;
    for token in [6, 7] {
        assert!(
            matches!(
                f.admit("k", token, w, T).await,
                Err(FenceError::Recovering { .. })
            ),
            "token {token} could overtake the write of 5"
        );
    }
    assert!(matches!(
        f.admit("k", 5, w, T).await,
        Err(FenceError::Stale { highest: 6, .. })
    ));
    assert!(matches!(
        f.raise("k", 6).await,
        Err(FenceError::Recovering { .. })
    ));
    assert!(matches!(
        f.forget("k").await,
        Err(FenceError::Recovering { .. })
    ));
    assert_eq!(
        f.highest("k").await.unwrap(),
        Some(6),
        "the reset was refused"
    );
    assert_eq!(
        f.forget("other").await.unwrap(),
        None,
        "other keys reset as usual"
    );
}

/// A crash with nothing in flight holds nothing; a crashed run that
/// kept no marks (an older fencegate) holds every key.
#[tokio::test]
async fn a_crash_with_nothing_in_flight_holds_nothing_and_one_without_marks_holds_all() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let open = |window| EmbeddedStore::open(&path, 1 << 20, window).unwrap();
    let five = Duration::from_secs(5);
    let f = Fence::new(Arc::new(open(five)), 10, five);
    drop(f.admit("k", 1, Instant::now() + T, T).await.unwrap());
    f.rotate_marks().await.unwrap();
    drop(f);
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert_eq!(f.recovering_for(), None, "nothing was in flight");
    assert_eq!(f.held_keys(), Some(0));
    drop(f);
    crate::store::embedded::forget_marks_flag(&path);
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert!(f.recovering_for().is_some());
    assert_eq!(f.held_keys(), None, "every key is held");
    let w = Instant::now() + T;
    assert!(matches!(
        f.admit("other", 1, w, T).await,
        Err(FenceError::Recovering { .. })
    ));
    assert!(matches!(
        f.admit("k", 0, w, T).await,
        Err(FenceError::Stale { .. })
    ));
    // Which tokens were in flight is unknown: an equal one may overtake.
    assert!(matches!(
        f.admit("k", 1, w, T).await,
        Err(FenceError::Recovering { .. })
    ));
}

/// The crashed run's marks name keys under the key mapping it recorded:
/// a start under that mapping holds only the marked keys; under another
/// one (or a mixed record) every key, and it records itself as mixed
/// until the window ends. With nothing in flight the mapping does not
/// matter.
#[tokio::test]
async fn a_crash_under_another_key_mapping_holds_every_key() {
    use crate::store::KEY_MAPPING_MIXED;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let open = |window| EmbeddedStore::open(&path, 1 << 20, window).unwrap();
    let five = Duration::from_secs(5);
    let w = || Instant::now() + T;
    // Nothing in flight at the crash: whatever the mapping, no hold.
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert_eq!(f.adopt_key_mapping(7), 7);
    f.store().record_key_mapping(7).await.unwrap();
    drop(f);
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert_eq!(f.adopt_key_mapping(8), 8, "nothing was in flight");
    assert_eq!(f.held_keys(), Some(0));
    drop(f);
    // A write in flight at the crash, under mapping 7.
    let store = open(five);
    store.record_key_mapping(7).await.unwrap();
    store.advance_marked("k", 1).await.unwrap();
    drop(store);
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert_eq!(f.store().key_mapping_at_open(), Some(7));
    assert_eq!(f.adopt_key_mapping(7), 7, "the same mapping");
    assert_eq!(f.held_keys(), Some(1), "only the marked key");
    assert!(f.admit("other", 1, w(), T).await.is_ok());
    drop(f);
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert_eq!(f.adopt_key_mapping(8), KEY_MAPPING_MIXED, "another mapping");
    assert_eq!(f.held_keys(), None, "every key is held");
    assert!(matches!(
        f.admit("another", 1, w(), T).await,
        Err(FenceError::Recovering { .. })
    ));
    f.store()
        .record_key_mapping(KEY_MAPPING_MIXED)
        .await
        .unwrap();
    drop(f);
    // A mixed record holds every key under any mapping.
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert_eq!(f.adopt_key_mapping(7), KEY_MAPPING_MIXED);
    assert_eq!(f.held_keys(), None);
    drop(f);
    // A remapping reload while only the marked keys are held holds
    // every key from then on; with no window, it holds nothing.
    let store = open(five);
    store.record_key_mapping(7).await.unwrap();
    drop(store);
    let f = Fence::new(Arc::new(open(five)), 10, five);
    assert_eq!(f.adopt_key_mapping(7), 7);
    assert!(matches!(f.held_keys(), Some(n) if n > 0));
    assert!(f.admit("fresh", 1, w(), T).await.is_ok());
    f.hold_every_key_while_recovering();
    assert_eq!(f.held_keys(), None, "every key is held");
    assert!(matches!(
        f.admit("fresh2", 1, w(), T).await,
        Err(FenceError::Recovering { .. })
    ));
    let calm = Fence::new(
        Arc::new(EmbeddedStore::open(&dir.path().join("g.redb"), 1 << 20, five).unwrap()),
        10,
        five,
    );
    calm.hold_every_key_while_recovering();
    assert_eq!(calm.held_keys(), Some(0), "no window, nothing held");
    assert!(calm.admit("k", 1, w(), T).await.is_ok());
}

/// Marks cost a store write only when a key has no live mark: writes
/// while it is live (even after its gate was dropped) add none, a
/// rotation marks again the keys in flight (so their writers add none)
/// and lets the idle ones' marks die.
#[tokio::test]
async fn a_key_is_marked_once_per_rotation_while_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1)).unwrap();
    let (f, metrics) = instrumented(store, Duration::from_secs(1));
    let calls = |op| store_calls(&metrics, op);
    let w = Instant::now() + T;
    f.raise("k", 5).await.unwrap();
    assert_eq!(f.store().in_flight_marks(), 0, "a raise forwards nothing");
    assert_eq!(f.gates.len(), 0, "the gate is released");
    assert!(matches!(
        f.admit("k", 4, w, T).await,
        Err(FenceError::Stale { .. })
    ));
    assert_eq!(f.gates.len(), 0, "a refused write leaves no gate");
    let a = f.admit("k", 5, w, T).await.unwrap();
    assert_eq!(
        calls("mark_in_flight"),
        1,
        "an equal token on an unmarked key"
    );
    let b = f.admit("k", 5, w, T).await.unwrap();
    drop((a, b));
    assert_eq!(f.gates.len(), 0);
    drop(f.admit("k", 5, w, T).await.unwrap());
    assert_eq!(calls("mark_in_flight"), 1, "the cache knew the live mark");
    assert_eq!(f.rotate_marks().await.unwrap(), 0, "nothing in flight");
    assert_eq!(f.store().in_flight_marks(), 0);
    let held = f.admit("k", 5, w, T).await.unwrap();
    assert_eq!(calls("mark_in_flight"), 2, "its mark died: marked again");
    assert_eq!(f.rotate_marks().await.unwrap(), 1, "marked again in flight");
    drop(f.admit("k", 5, w, T).await.unwrap());
    assert_eq!(calls("mark_in_flight"), 2, "the rotation's mark serves");
    assert_eq!(f.store().in_flight_marks(), 1);
    drop(held);
    // A newer token marks in the advance's own commit.
    drop(f.admit("k2", 1, w, T).await.unwrap());
    assert_eq!(calls("mark_in_flight"), 2);
    assert_eq!(f.store().in_flight_marks(), 2);
}

/// Writers of one token on a key being marked wait for the mark, but
/// not past their own limit.
#[tokio::test]
async fn writers_wait_for_a_mark_in_progress_within_their_limit() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    f.raise("k", 5).await.unwrap();
    let later = Instant::now() + Duration::from_secs(30);
    // Polled once: it has set the mark pending and waits for the store
    // (on this one-thread runtime its task cannot run yet).
    let first = f.admit("k", 5, later, T);
    tokio::pin!(first);
    tokio::select! {
        biased;
        _ = &mut first => panic!("marked without waiting for the store"),
        _ = std::future::ready(()) => {}
    }
    match f.admit("k", 5, Instant::now(), T).await {
        Err(FenceError::Busy { .. }) => {}
        other => panic!("expected busy, got {:?}", other.map(|p| p.token())),
    }
    let second = f.admit("k", 5, later, T).await.expect("waits for the mark");
    let first = first.await.unwrap();
    assert_eq!((first.token(), second.token()), (5, 5));
    assert_eq!(f.store().in_flight_marks(), 1, "one mark for both");
}

/// The crash hold ends exactly at its instant, measured from the start;
/// rotations keep the held keys' marks until then, and not after.
#[tokio::test(start_paused = true)]
async fn the_hold_ends_on_its_instant() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let open = || EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(5)).unwrap();
    let store = open();
    store.advance_marked("k", 1).await.unwrap();
    drop(store); // a crash
    let (f, metrics) = instrumented(open(), Duration::from_secs(5));
    tokio::time::advance(Duration::from_secs(5) - Duration::from_millis(1)).await;
    let w = Instant::now() + T;
    // The held key's highest came with it from the store.
    assert!(matches!(
        f.admit("k", 0, w, T).await,
        Err(FenceError::Stale { highest: 1, .. })
    ));
    let lookups = store_calls(&metrics, "highest");
    assert_eq!(lookups, 0, "a held key's highest was looked up again");
    assert!(matches!(
        f.admit("k", 2, w, T).await,
        Err(FenceError::Recovering { .. })
    ));
    f.rotate_marks().await.unwrap();
    assert_eq!(f.store().in_flight_marks(), 1, "held: its mark is kept");
    let gate = f.gate(&Arc::from("k")); // made while held, kept past it
    tokio::time::advance(Duration::from_millis(1)).await;
    let w = Instant::now() + T;
    drop(
        f.admit("k", 2, w, T)
            .await
            .expect("the hold ended on its instant"),
    );
    drop(gate);
    f.release_gate("k");
    assert_eq!(f.gates.len(), 0);
    // Before a rotation forgets the held keys: a gate made now is not
    // held, and takes nothing from the crash (here: after a reset).
    assert_eq!(f.forget("k").await.unwrap(), Some(2));
    drop(f.admit("k", 1, w, T).await.unwrap());
    assert_eq!(
        f.store().highest("k").await.unwrap(),
        Some(1),
        "raised in the store"
    );
    f.rotate_marks().await.unwrap();
    assert_eq!(f.store().in_flight_marks(), 0, "the held mark is not kept");
    assert!(f.held.is_empty(), "the held keys are forgotten");
    assert_eq!(f.held_keys(), Some(0));
}

/// The server's rotator lets an idle key's mark die within two
/// rotations and keeps a busy one's; it stops when told to.
#[tokio::test]
async fn the_rotator_keeps_busy_marks_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let f = fence(&dir);
    let w = Instant::now() + Duration::from_secs(60);
    drop(f.admit("idle", 1, w, T).await.unwrap());
    let busy = f
        .admit("busy", 1, w, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(f.store().in_flight_marks(), 2);
    let stop = tokio_util::sync::CancellationToken::new();
    let rotator = tokio::spawn(f.clone().keep_marks(stop.clone()));
    let deadline = std::time::Instant::now() + ROTATE_EVERY * 5;
    while f.store().in_flight_marks() != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle mark never died"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(busy);
    stop.cancel();
    rotator.await.unwrap();
    drop(f.admit("later", 1, w, T).await.unwrap());
    tokio::time::sleep(ROTATE_EVERY * 2).await;
    assert_eq!(
        f.store().in_flight_marks(),
        2,
        "a stopped rotator rotates nothing"
    );
}

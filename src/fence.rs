//! Admission and ordering: the fence itself.
//!
//! For each write, [`Fence::admit`] decides from the key's highest token:
//! lower is stale; higher is raised durably in the store first; equal is
//! admitted. An admitted write gets a [`Permit`] that marks it in flight.
//! A write is not let through while an *older*-token write to the same key
//! is still in flight, so a backend that applies requests in arrival order
//! applies them in token order. Every admitted write carries its own
//! deadline (admission plus its route's upstream timeout), by which the proxy
//! has ended its exchange and its body; a newer write waits until each older
//! one has ended or passed *that* deadline. If the newer write's own wait
//! limit comes first it is refused ([`FenceError::Busy`]), never forwarded.
//! Once a newer token is admitted, every older write, queued or new, is
//! stale.
//!
//! In-memory state is per key ([`KeyGate`]), created on demand; a bounded
//! cache of highest tokens answers the steady case (token equal to the
//! highest) without touching the store, but only when the store says this
//! process is its only writer.
//!
//! Crash recovery (embedded store): before a write is forwarded, its key
//! must have a live *mark* in the store, written in the same commit as the
//! advance when there is one. Marks carry a rising sequence number and live
//! while they are at or above the fence's watermark; every
//! [`ROTATE_EVERY`], [`Fence::rotate_marks`] raises the watermark, marking
//! again only the keys with writes in flight, so a key in steady use costs
//! one mark per rotation and an idle key's mark dies within two. After an
//! unclean stop only the keys with live marks are *held*: a token above
//! their highest is refused (503, `Retry-After`) until the crashed run's
//! writes can no longer be in flight, an upstream timeout after the
//! restart. Every other key, and stale or equal tokens on a held key,
//! behave as in normal running.

mod active;
mod grant;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::{Advance, FenceStore, LeaseOutcome, StartState, StoreError, WriteLease};

pub use active::CHECK_EVERY;
use active::{Active, Granted, Local, Release};

/// Why a write was not admitted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FenceError {
    #[error("token {token} is lower than the highest token {highest} seen for this key")]
    Stale { token: u64, highest: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("recovering from an unclean stop: writes forwarded before it may still be in flight upstream")]
    Recovering { retry_after: Duration },
    /// An older write to the key is still in flight and may run past this
    /// write's wait limit: forwarding now could overtake it.
    #[error("an older write to this key is still in flight")]
    Busy { retry_after: Duration },
}

/// In-memory state of one key while it has writers.
struct KeyGate {
    state: Mutex<GateState>,
    /// Woken when an in-flight write ends or the highest token rises.
    changed: Notify,
}

/// What one pass of the admission loop decided.
enum Step {
    Stale(u64),
    Retry,
    /// The key has no in-flight mark: write it, then decide again.
    Mark,
    Go {
        waited_out: bool,
    },
    /// Older writes may outlive this one's wait limit: refuse, retry after.
    Busy(Duration),
    /// Wait for a change, or until this instant.
    Wait(Instant),
}

#[derive(Default)]
struct GateState {
    /// Highest token known durable for this key, if known.
    highest: Option<u64>,
    /// Admitted writes still in flight: per token, the deadline of each.
    /// (token, deadline) -> how many writes share both. Ordered by token,
    /// so the older writes are a prefix; no allocation per write beyond the
    /// map's own node.
    inflight: BTreeMap<(u64, Instant), u32>,
    /// Sequence number of the key's latest durable in-flight mark, if
    /// known: live while at or above the fence's watermark.
    mark: Option<u64>,
    /// A mark is being written (by an admission or a rotation); writers
    /// wait for it rather than write their own.
    marking: bool,
    /// The key was marked at a crash: until then, a token above the lowest
    /// one its marks were for (`held_lowest`) is refused.
    held_until: Option<Instant>,
    held_lowest: u64,
}

/// How often the server raises the mark watermark: a key in steady use
/// costs one mark per rotation, and a key idle for two rotations is not
/// held after a crash.
pub const ROTATE_EVERY: Duration = Duration::from_secs(1);

/// How long after a write's deadline newer writes still wait for it. The
/// proxy cuts the write at its deadline, but the cut runs when the write's
/// own tasks are next scheduled, and bytes handed over just before it may
/// still be on their way.
pub const CUT_GRACE: Duration = Duration::from_millis(250);

/// Whether a shared-store lease whose clock started no earlier than `sent`
/// and that lasts `ttl` covers a write that ends by `deadline`, its cut
/// included ([`CUT_GRACE`]): the one rule every admission on a shared
/// store follows (a registration's later writes too: `active.rs`).
pub(crate) fn lease_covers(sent: Instant, ttl: Duration, deadline: Instant) -> bool {
    deadline + CUT_GRACE <= sent + ttl
}

/// The pause between attempts at a lease release the store did not answer.
const RELEASE_RETRY: Duration = Duration::from_millis(200);

/// What the writes older than a token still in flight mean for it.
enum Older {
    /// None in flight.
    None,
    /// Some are registered, but every one is past its own deadline (the
    /// proxy has given up on them): going ahead cannot overtake them.
    Expired,
    /// The latest deadline among those still within theirs.
    Live(Instant),
}

impl GateState {
    fn older(&self, token: u64, now: Instant) -> Older {
        let mut any = false;
        let mut latest = None;
        let older = self.inflight.keys().take_while(|(t, _)| *t < token);
        for (_, d) in older {
            any = true;
            if *d > now {
                latest = latest.max(Some(*d));
            }
        }
        match (any, latest) {
            (_, Some(l)) => Older::Live(l),
            (true, None) => Older::Expired,
            (false, None) => Older::None,
        }
    }

    fn enter(&mut self, token: u64, deadline: Instant) {
        *self.inflight.entry((token, deadline)).or_default() += 1;
    }
}

/// Bounded map of highest tokens, in entries and in bytes (keys can be
/// long). Entries only ever hold values that are durable in the store, so
/// an evicted entry just costs one store lookup.
struct HighestCache {
    /// Key -> highest token, and the sequence number of the key's latest
    /// in-flight mark if known (so that a key written again soon after its
    /// gate was dropped needs no new mark).
    map: DashMap<Arc<str>, (u64, Option<u64>)>,
    capacity: usize,
    max_bytes: usize,
    /// Bytes held, counted as key length plus [`ENTRY_OVERHEAD`] each.
    bytes: std::sync::atomic::AtomicUsize,
}

/// What one cache entry costs besides its key: the map slot, the `Arc`
/// header and the token.
const ENTRY_OVERHEAD: usize = 64;

/// What an entry for `key` counts against the byte budget.
fn entry_cost(key: &str) -> usize {
    key.len() + ENTRY_OVERHEAD
}

/// The default byte budget of the highest-token cache.
pub const DEFAULT_CACHE_BYTES: usize = 96 << 20;

impl HighestCache {
    fn get(&self, key: &str) -> Option<u64> {
        self.map.get(key).map(|v| v.0)
    }

    /// Records a key's newer mark, if the key is cached.
    fn note_mark(&self, key: &str, seq: u64) {
        if let Some(mut v) = self.map.get_mut(key) {
            v.1 = v.1.max(Some(seq));
        }
    }

    /// Raises the key's cached highest to `value` and, with `mark`, its
    /// mark, in one lookup.
    fn raise(&self, key: &Arc<str>, value: u64, mark: Option<u64>) {
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

    fn remove(&self, key: &str) {
        if let Some((k, _)) = self.map.remove(key) {
            self.bytes
                .fetch_sub(entry_cost(&k), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// A registration whose last write ended, and when to release it if it is
/// still idle then.
type IdleRegistration = (Arc<str>, Arc<Active>, Instant);

/// The fence: admission decisions over one [`FenceStore`].
pub struct Fence {
    store: Arc<dyn FenceStore>,
    gates: DashMap<Arc<str>, Arc<KeyGate>>,
    /// Shared stores: this replica's registration per key in use (see
    /// [`active`]).
    actives: DashMap<Arc<str>, Arc<Active>>,
    /// Registrations whose last write ended, with when to release them
    /// if still idle (see [`Fence::keep_marks`]); `None` while no
    /// background task sweeps them (then they are released as their last
    /// write ends). One lock for the queue and that state, so that nothing
    /// is queued after the sweeper's last pass.
    idle: Mutex<Option<Vec<IdleRegistration>>>,
    /// Shared-store lease releases under way (they run on the runtime of
    /// the request that ended, a worker's): the stop waits for them
    /// briefly, so that a clean stop does not leave leases behind to
    /// expire.
    releases: tokio_util::task::TaskTracker,
    cache: HighestCache,
    /// After an unclean stop, held keys refuse newer tokens until this
    /// instant: a write forwarded before the crash may still be applied
    /// upstream until the upstream timeout has passed. `None` when nothing
    /// is held.
    recovering_until: Option<Instant>,
    /// The crashed run kept no in-flight marks (an older fencegate), or
    /// its marks name keys under another key mapping than this run's
    /// ([`Fence::adopt_key_mapping`]): every key is held.
    hold_all: std::sync::atomic::AtomicBool,
    /// Keys with live marks at the crash, with their highest token and the
    /// lowest token their marks were for: their gates are made held until
    /// `recovering_until`. Emptied after that.
    held: DashMap<Arc<str>, (Option<u64>, u64)>,
    /// Marks below this are dead (see [`Fence::rotate_marks`]).
    watermark: std::sync::atomic::AtomicU64,
    lease_ttl: Duration,
    /// The store's own latency bound (its timeout, plus a second): an
    /// acquire whose answer was lost may be applied up to this late.
    lease_margin: Duration,
    /// Writes waiting now behind an older write in flight on their key
    /// (registered by the server as `fencegate_writes_waiting`): a queue
    /// behind a slow backend shows here before it shows as 503s.
    waiting: prometheus::IntGauge,
}

/// Counts a write in [`Fence::waiting`] while it lives.
struct Waiting(prometheus::IntGauge);

impl Waiting {
    fn new(g: &prometheus::IntGauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What an admitted write holds while it is in flight. Dropping it ends the
/// write for ordering purposes; clone it (via `Arc`) to keep it alive until
/// both the request body and the response head are done.
pub struct Permit {
    fence: Arc<Fence>,
    /// Always `Some` until dropped; taken in `drop` so the gate can be
    /// released with no reference left here.
    gate: Option<Arc<KeyGate>>,
    key: Arc<str>,
    token: u64,
    lease: Option<WriteLease>,
    /// Shared stores: the key's registration this write was admitted on
    /// (which holds the lease instead of `lease`).
    active: Option<Arc<Active>>,
    /// By then the write must have ended (its exchange and its body): newer
    /// writes to the key wait for it no longer than this (plus
    /// [`CUT_GRACE`]).
    deadline: Instant,
    /// The lease was polled after the grant ([`Fence::overtaken`]): its
    /// release is sent twice, as for a lost acquire.
    repolled: std::sync::atomic::AtomicBool,
    /// The write went ahead while an older write was still registered in
    /// flight, past that write's own deadline.
    pub waited_out: bool,
}

impl Fence {
    /// `cache_capacity` bounds the number of cached highest tokens;
    /// `recovery_window` is the upstream timeout (how long a write forwarded
    /// before a crash may still be in flight).
    pub fn new(
        store: Arc<dyn FenceStore>,
        cache_capacity: usize,
        recovery_window: Duration,
    ) -> Arc<Self> {
        Self::with_lease_margin(
            store,
            cache_capacity,
            recovery_window,
            Duration::from_secs(1),
        )
    }

    /// Like [`new`](Self::new); shared-store leases live `recovery_window +
    /// lease_margin`, where the margin covers the store's own latency (a
    /// lease's clock starts on the store, before the grant reaches us).
    pub fn with_lease_margin(
        store: Arc<dyn FenceStore>,
        cache_capacity: usize,
        recovery_window: Duration,
        lease_margin: Duration,
    ) -> Arc<Self> {
        let now = Instant::now();
        let mut recovering_until = match store.start_state() {
            StartState::Unclean { previous_window } => {
                let window = recovery_window.max(previous_window.unwrap_or_default());
                (!window.is_zero()).then(|| now + window)
            }
            StartState::Clean => None,
        };
        let crashed = store.in_flight_at_crash();
        let hold_all = crashed.is_none();
        // Each key with a live mark is held until the window ends; its mark
        // is kept alive as long (a second crash must find it again).
        let held = DashMap::new();
        if recovering_until.is_some() {
            for k in crashed.unwrap_or_default() {
                held.insert(Arc::from(k.key), (k.highest, k.lowest));
            }
        }
        if held.is_empty() && !hold_all {
            recovering_until = None;
        }
        // Every mark from before this start is dead to this run's writers
        // (held keys are marked again by the rotations).
        let watermark = std::sync::atomic::AtomicU64::new(store.next_mark());
        Arc::new(Self {
            store,
            gates: DashMap::new(),
            actives: DashMap::new(),
            idle: Mutex::new(None),
            releases: tokio_util::task::TaskTracker::new(),
            hold_all: std::sync::atomic::AtomicBool::new(hold_all),
            held,
            watermark,
            cache: HighestCache {
                map: DashMap::new(),
                capacity: cache_capacity,
                max_bytes: DEFAULT_CACHE_BYTES,
                bytes: std::sync::atomic::AtomicUsize::new(0),
            },
            recovering_until,
            lease_ttl: recovery_window + lease_margin,
            lease_margin,
            waiting: prometheus::IntGauge::new(
                "fencegate_writes_waiting",
                "Writes waiting now behind an older in-flight write on their key.",
            )
            .expect("metric"),
        })
    }

    /// The gauge of writes waiting behind older ones, for the registry.
    pub fn waiting(&self) -> &prometheus::IntGauge {
        &self.waiting
    }

    pub fn store(&self) -> &Arc<dyn FenceStore> {
        &self.store
    }

    /// Every key is held while the crash-recovery window lasts.
    fn holds_all(&self) -> bool {
        self.hold_all.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Called once at start with the fingerprint of the key mapping this run
    /// admits writes under; returns the fingerprint to record in the store
    /// ([`FenceStore::record_key_mapping`]). The crashed run's marks name
    /// keys under the mapping it recorded: under another one (a reload or
    /// a changed config before the restart) a resource that had a write in
    /// flight has another key now, so every key is held until the window
    /// ends, and the record says so ([`KEY_MAPPING_MIXED`]) until then, in
    /// case this run crashes too.
    ///
    /// [`KEY_MAPPING_MIXED`]: crate::store::KEY_MAPPING_MIXED
    pub fn adopt_key_mapping(&self, fingerprint: u64) -> u64 {
        let recorded = self.store.key_mapping_at_open();
        if self.recovering_until.is_none() || recorded == Some(fingerprint) {
            return fingerprint;
        }
        self.hold_every_key("writes were in flight at the crash under another key mapping (a reload or a changed config)");
        crate::store::KEY_MAPPING_MIXED
    }

    /// A reload remapped keys while the crash-recovery window lasts: the
    /// held keys are named under the mapping the crashed run had, and a
    /// resource that had a write in flight has another key now, so every
    /// key is held for the rest of the window.
    pub fn hold_every_key_while_recovering(&self) {
        if self.recovering_for().is_some() {
            self.hold_every_key("the key mapping changed during the crash-recovery window");
        }
    }

    /// From now until the crash-recovery window ends, every key is held.
    fn hold_every_key(&self, why: &str) {
        tracing::warn!(
            held = self.held.len(),
            "{why}: holding every key until the recovery window ends"
        );
        self.hold_all
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Time left in the crash-recovery window, if any key is held.
    pub fn recovering_for(&self) -> Option<Duration> {
        let until = self.recovering_until?;
        let left = until.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// Keys held since the start by the crash-recovery window (0 once it
    /// has passed). `None`: every key is held (the crashed run kept no
    /// in-flight marks).
    pub fn held_keys(&self) -> Option<usize> {
        match (self.recovering_for(), self.holds_all()) {
            (None, _) => Some(0),
            (Some(_), true) => None,
            (Some(_), false) => Some(self.held.len()),
        }
    }

    /// Time left in the key's crash hold, if it is held.
    fn held_for(&self, st: &GateState, now: Instant) -> Option<Duration> {
        let until = match (self.holds_all(), st.held_until) {
            (true, _) => self.recovering_until,
            (false, held) => held,
        }?;
        (until > now).then(|| until - now)
    }

    /// While a key's crash hold lasts, refuses a token that is not stale
    /// and is above the lowest token the crashed run may still have had in
    /// flight on it (with every key held, that lowest is unknown: every
    /// token that is not stale). A stale token passes, to get its 409 from
    /// admission; a key whose highest is not in memory (every key is held)
    /// is looked up first for that.
    async fn check_held(
        &self,
        key: &Arc<str>,
        gate: &KeyGate,
        token: u64,
    ) -> Result<(), FenceError> {
        if self.recovering_until.is_none() {
            return Ok(());
        }
        let (known, held, lowest) = {
            let st = gate.state.lock().expect("gate lock");
            (
                st.highest,
                self.held_for(&st, Instant::now()),
                st.held_lowest,
            )
        };
        let Some(left) = held else { return Ok(()) };
        let highest = match known {
            Some(h) => Some(h),
            None => {
                let h = self.store.highest(key).await?;
                let mut st = gate.state.lock().expect("gate lock");
                st.highest = st.highest.max(h);
                st.highest
            }
        };
        if highest.is_some_and(|h| token < h) {
            return Ok(());
        }
        if self.holds_all() || token > lowest {
            return Err(FenceError::Recovering { retry_after: left });
        }
        Ok(())
    }

    /// Number of keys with in-memory gates (writes admitting or in flight).
    pub fn active_keys(&self) -> usize {
        self.gates.len()
    }

    /// Records a durable mark of the key in its gate and in the cache.
    fn record_mark(&self, key: &str, st: &mut GateState, seq: u64) {
        st.mark = st.mark.max(Some(seq));
        self.cache.note_mark(key, seq);
    }

    /// Whether the key has a live mark: at or above the watermark.
    fn live(&self, st: &GateState) -> bool {
        st.mark
            .is_some_and(|m| m >= self.watermark.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Raises the watermark to the store's next mark, marking again (in the
    /// same commit) every key with a write in flight and, while the crash
    /// hold lasts, every held key; the marks below die. Returns how many
    /// keys it marked again.
    ///
    /// Why this is safe: the watermark is raised in memory first, so an
    /// admission that decides after it needs a new mark. One that decided
    /// before it entered its write in flight under the gate's lock, which
    /// the scan takes next: the scan finds the write and marks its key
    /// again. Writers on those keys wait for the rotation's commit
    /// (`marking`) instead of writing marks of their own.
    pub async fn rotate_marks(&self) -> Result<usize, FenceError> {
        use std::sync::atomic::Ordering::AcqRel;
        let watermark = self.store.next_mark();
        self.watermark.fetch_max(watermark, AcqRel);
        let mut keys = Vec::new();
        let mut busy = Vec::new();
        for entry in self.gates.iter() {
            let mut st = entry.value().state.lock().expect("gate lock");
            // The oldest write in flight: a crash now must hold newer ones
            // off until it can no longer be in flight.
            if let Some(&(lowest, _)) = st.inflight.keys().next() {
                st.marking = true;
                keys.push((entry.key().to_string(), lowest));
                busy.push((entry.key().clone(), entry.value().clone()));
            }
        }
        if self.recovering_for().is_some() {
            keys.extend(self.held.iter().map(|h| (h.key().to_string(), h.value().1)));
        } else if !self.held.is_empty() {
            self.held.clear();
        }
        let answer = self.store.rotate_marks(keys, watermark).await;
        for (i, (key, gate)) in busy.iter().enumerate() {
            {
                let mut st = gate.state.lock().expect("gate lock");
                st.marking = false;
                if let Ok(seqs) = &answer {
                    self.record_mark(key, &mut st, seqs[i]);
                }
            }
            gate.changed.notify_waiters();
        }
        let marked = busy.len();
        for (key, gate) in busy {
            drop(gate);
            self.release_gate(&key);
        }
        answer?;
        Ok(marked)
    }

    /// Waits (at most `bound`) for the shared-store lease releases under
    /// way; a second release some take later, for an acquire that may
    /// still be applied, is left to expire if the bound ends first.
    pub async fn settle(&self, bound: Duration) {
        self.releases.close();
        let _ = tokio::time::timeout(bound, self.releases.wait()).await;
    }

    /// Rotates the marks every [`ROTATE_EVERY`] until `stop`; the server
    /// owns it.
    pub async fn keep_marks(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        if !self.store.exclusive() {
            return self.sweep_registrations(stop).await;
        }
        let mut tick = tokio::time::interval(ROTATE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {
                    if let Err(e) = self.rotate_marks().await {
                        tracing::warn!(error = %e, "could not rotate the in-flight marks; writes mark their keys anew");
                    }
                }
            }
        }
    }

    /// Shared stores: releases the registrations whose last write ended
    /// and that stayed idle for the rest of their check period, a batch
    /// every half period, until `stop`; then the rest at once.
    async fn sweep_registrations(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        *self.idle.lock().expect("idle lock") = Some(Vec::new());
        let mut tick = tokio::time::interval(CHECK_EVERY / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stopping = tokio::select! {
                _ = stop.cancelled() => true,
                _ = tick.tick() => false,
            };
            let now = Instant::now();
            let due: Vec<_> = {
                let mut idle = self.idle.lock().expect("idle lock");
                let queue = if stopping {
                    idle.take()
                } else {
                    idle.as_mut().map(std::mem::take)
                }
                .unwrap_or_default();
                let (due, later): (Vec<_>, Vec<_>) = queue
                    .into_iter()
                    .partition(|(_, _, at)| stopping || *at <= now);
                if let Some(q) = idle.as_mut() {
                    q.extend(later);
                }
                due
            };
            for (key, a, _) in due {
                let what = a.idle();
                self.release_active(&key, &a, what);
            }
            if stopping {
                return;
            }
        }
    }

    fn gate(&self, key: &Arc<str>) -> Arc<KeyGate> {
        self.gates
            .entry(key.clone())
            .or_insert_with(|| {
                // Gates are only made for the embedded store, whose only
                // writer is this process: the cache cannot be behind it.
                // One cache lookup for both.
                let (mut highest, mark) = self
                    .cache
                    .map
                    .get(&**key)
                    .map_or((None, None), |v| (Some(v.0), v.1));
                // A key with a write in flight at the crash is held while
                // the window lasts.
                let (held_until, held_lowest) = match self.held.get(&**key) {
                    Some(h) if self.recovering_for().is_some() => {
                        highest = highest.max(h.0);
                        (self.recovering_until, h.1)
                    }
                    _ => (None, 0),
                };
                Arc::new(KeyGate {
                    state: Mutex::new(GateState {
                        highest,
                        mark,
                        held_until,
                        held_lowest,
                        ..GateState::default()
                    }),
                    changed: Notify::new(),
                })
            })
            .clone()
    }

    fn release_gate(&self, key: &str) {
        self.gates.remove_if(key, |_, g| Arc::strong_count(g) == 1);
    }

    /// Raises the key's highest to `token` in the store (durably) and records
    /// the answer in memory. Runs as its own task so that a client hanging up
    /// cannot leave memory behind a raise that did reach the disk.
    /// With `mark`, the key's in-flight mark is written in the same commit.
    async fn advance(
        self: &Arc<Self>,
        key: &Arc<str>,
        gate: &Arc<KeyGate>,
        token: u64,
        mark: bool,
    ) -> Result<u64, FenceError> {
        let fence = self.clone();
        let key = key.clone();
        let gate = gate.clone();
        let task = tokio::spawn(async move {
            let answer = if mark {
                fence
                    .store
                    .advance_marked(&key, token)
                    .await
                    .map(|(a, seq)| (a, Some(seq)))
            } else {
                fence.store.advance(&key, token).await.map(|a| (a, None))
            };
            let highest = answer.map(|(answer, seq)| {
                let highest = match answer {
                    Advance::Raised { .. } | Advance::Equal => token,
                    Advance::Stale { highest } => highest,
                };
                {
                    // The cache is written under the gate lock with the
                    // gate's maximum, so two answers landing in either order
                    // (with an eviction in between) can never leave it below
                    // the store.
                    let mut st = gate.state.lock().expect("gate lock");
                    let max = st.highest.map_or(highest, |h| h.max(highest));
                    st.highest = Some(max);
                    st.mark = st.mark.max(seq);
                    fence.cache.raise(&key, max, seq);
                }
                // Queued older writes must now see that they are stale.
                gate.changed.notify_waiters();
                highest
            });
            // The admission that started this may be gone (client hung up):
            // then this task held the last reference, and the gate must not
            // outlive it, whatever the store answered.
            drop(gate);
            fence.release_gate(&key);
            highest
        });
        joined(task.await)
    }

    /// Writes a mark of the key (the gate is `marking`), as its own task
    /// for the same reason as [`advance`](Self::advance): a client hanging
    /// up must not leave the gate marking.
    async fn mark(
        self: &Arc<Self>,
        key: &Arc<str>,
        gate: &Arc<KeyGate>,
        token: u64,
    ) -> Result<(), FenceError> {
        let fence = self.clone();
        let key = key.clone();
        let gate = gate.clone();
        let task = tokio::spawn(async move {
            let answer = fence.store.mark_in_flight(&key, token).await;
            {
                let mut st = gate.state.lock().expect("gate lock");
                st.marking = false;
                if let Ok(seq) = answer {
                    fence.record_mark(&key, &mut st, seq);
                }
            }
            gate.changed.notify_waiters();
            drop(gate);
            fence.release_gate(&key);
            answer.map(|_| ())
        });
        joined(task.await)
    }

    /// Admits a write of `token` to `key`. While an older-token write to the
    /// key is in flight (and within its own deadline) this waits, but not
    /// past `wait_until`: then it fails with [`FenceError::Busy`]. The permit
    /// it returns carries the write's own deadline, `upstream_timeout` from
    /// now: the caller must have ended the write (exchange and body) by then.
    pub async fn admit(
        self: &Arc<Self>,
        key: &str,
        token: u64,
        wait_until: Instant,
        upstream_timeout: Duration,
    ) -> Result<Permit, FenceError> {
        let key: Arc<str> = Arc::from(key);
        if !self.store.exclusive() {
            return self
                .admit_shared(key, token, wait_until, upstream_timeout)
                .await;
        }
        // Removes the gate again if this admission fails or is abandoned
        // (the client hung up while waiting).
        let guard = GateGuard {
            fence: self,
            key: key.clone(),
            gate: Some(self.gate(&key)),
        };
        let gate = guard.gate.as_ref().expect("set above");
        self.admit_on(&key, gate, token, wait_until, upstream_timeout)
            .await
    }

    async fn admit_on(
        self: &Arc<Self>,
        key: &Arc<str>,
        gate: &Arc<KeyGate>,
        token: u64,
        wait_until: Instant,
        upstream_timeout: Duration,
    ) -> Result<Permit, FenceError> {
        // Only the embedded store gets here: this process is its one writer,
        // so the in-memory highest (written only after the store committed)
        // answers "equal" and "stale" without I/O.
        loop {
            self.check_held(key, gate, token).await?;
            let (known, marked) = {
                let st = gate.state.lock().expect("gate lock");
                (st.highest, self.live(&st))
            };
            if known.is_none_or(|h| h < token) {
                self.advance(key, gate, token, !marked).await?;
            }
            let notified = gate.changed.notified();
            tokio::pin!(notified);
            let now = Instant::now();
            let decision = {
                let mut st = gate.state.lock().expect("gate lock");
                let highest = st.highest.unwrap_or(token);
                match highest.cmp(&token) {
                    std::cmp::Ordering::Greater => Step::Stale(highest),
                    // Cannot follow an advance of this token (the highest
                    // is at least the token then); kept so that a missed
                    // raise asks the store again rather than admitting.
                    std::cmp::Ordering::Less => Step::Retry,
                    std::cmp::Ordering::Equal => match st.older(token, now) {
                        Older::Live(latest) if now >= wait_until => Step::Busy(latest - now),
                        Older::Live(latest) => {
                            notified.as_mut().enable();
                            Step::Wait(latest.min(wait_until))
                        }
                        // The mark is checked, and the write entered, under
                        // the gate's lock: a rotation's scan either finds
                        // the write or raised the watermark before this.
                        other => match (self.live(&st), st.marking) {
                            (true, _) => {
                                st.enter(token, now + upstream_timeout + CUT_GRACE);
                                Step::Go {
                                    waited_out: matches!(other, Older::Expired),
                                }
                            }
                            // Another writer, or a rotation, is marking it.
                            (false, true) if now >= wait_until => {
                                Step::Busy(Duration::from_secs(1))
                            }
                            (false, true) => {
                                notified.as_mut().enable();
                                Step::Wait(wait_until)
                            }
                            (false, false) => {
                                st.marking = true;
                                Step::Mark
                            }
                        },
                    },
                }
            };
            match decision {
                Step::Stale(highest) => return Err(FenceError::Stale { token, highest }),
                Step::Retry => continue,
                Step::Mark => self.mark(key, gate, token).await?,
                Step::Busy(retry_after) => return Err(FenceError::Busy { retry_after }),
                Step::Go { waited_out } => {
                    return Ok(Permit {
                        fence: self.clone(),
                        gate: Some(gate.clone()),
                        key: key.clone(),
                        token,
                        lease: None,
                        active: None,
                        deadline: now + upstream_timeout,
                        repolled: Default::default(),
                        waited_out,
                    })
                }
                Step::Wait(until) => {
                    // Woken by a write ending or the highest rising, or at
                    // the older writes' deadline or our own limit: decide
                    // again in every case.
                    let _waiting = Waiting::new(&self.waiting);
                    let _ = tokio::time::timeout_at(until, notified).await;
                }
            }
        }
    }

    /// Admission on a shared store: the store raises, registers a lease and
    /// checks for older leases atomically (see
    /// [`FenceStore::acquire_lease`]); this polls until older writes, on any
    /// replica, are released or their leases expired. A write of the token
    /// this replica already has registered on the key goes on that
    /// registration instead, without a store call while its confirmation is
    /// fresh (see [`active`]).
    async fn admit_shared(
        self: &Arc<Self>,
        key: Arc<str>,
        token: u64,
        wait_until: Instant,
        upstream_timeout: Duration,
    ) -> Result<Permit, FenceError> {
        let lasts = upstream_timeout + CUT_GRACE;
        let existing = self.actives.get(&key).map(|e| e.value().clone());
        if let Some(a) = existing {
            if token > a.token {
                // Newer here: the older token stops being admitted on its
                // registration now (the newer write waits for it below).
                let release = a.close();
                self.release_active(&key, &a, release);
            }
            // Writes that find a check under way wait for its answer (a
            // little) rather than each asking the store on its own.
            let mut waits = 0;
            loop {
                let (local, now) = a.try_admit(token, lasts);
                match local {
                    Local::Wait if waits < 2 => {
                        waits += 1;
                        let _ = tokio::time::timeout(CHECK_EVERY, a.changed.notified()).await;
                        continue;
                    }
                    Local::Admitted => {
                        return Ok(self.active_permit(key, token, a, now + upstream_timeout))
                    }
                    Local::AdmittedRefresh { renew } => {
                        let (fence, k, reg) = (self.clone(), key.clone(), a.clone());
                        self.releases.spawn(async move {
                            let granted = fence.confirm(&k, &reg, renew).await;
                            let release = reg.refreshed(granted.ok().flatten());
                            reg.changed.notify_waiters();
                            fence.release_active(&k, &reg, release);
                        });
                        return Ok(self.active_permit(key, token, a, now + upstream_timeout));
                    }
                    Local::Check { renew } => {
                        let mut check = Check {
                            fence: self,
                            key: key.clone(),
                            active: Some(a.clone()),
                        };
                        let confirmed = self.confirm(&key, &a, renew).await;
                        check.active = None;
                        let granted = confirmed.as_ref().ok().copied().flatten();
                        let (admitted, release, now) = a.checked(granted, lasts);
                        a.changed.notify_waiters();
                        self.release_active(&key, &a, release);
                        if admitted {
                            return Ok(self.active_permit(key, token, a, now + upstream_timeout));
                        }
                        // Taken by a newer token, or a store error: say so.
                        // Otherwise (the registration cannot cover this write,
                        // or its answer came too late) the store path decides.
                        confirmed?;
                    }
                    Local::No | Local::Wait => {}
                }
                break;
            }
        }
        // The lease's identity exists, and its release is armed, before the
        // acquire is sent: whatever ends this admission (a stale answer, an
        // error, a store timeout after the store applied it, the client
        // hanging up mid-call) releases it, so no orphan holds the key for a
        // whole lease TTL.
        let lease = WriteLease {
            id: crate::id::unique_id(),
            token,
        };
        let pending = PendingLease {
            releases: self.releases.clone(),
            store: self.store.clone(),
            key: key.clone(),
            lease: Some(lease.clone()),
            again_after: self.lease_margin,
        };
        let mut sent = Instant::now();
        let mut outcome = match self.store.acquire_lease(&key, &lease, self.lease_ttl).await {
            Ok(o) => o,
            // Refused before anything was sent: nothing to release. (Not
            // so for amnesia: it may be found in the acquire's answer.)
            Err(e @ StoreError::Uninitialised) => {
                pending.disarm();
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        // The wait ends by `wait_until`, at most an upstream timeout away:
        // shorter than any older lease's TTL, which is the longest upstream
        // timeout plus the store's margin.
        let mut pause = Duration::from_millis(2);
        let mut waiting = None;
        loop {
            match outcome {
                LeaseOutcome::Stale { highest } => {
                    // The store registered nothing (or removed it).
                    pending.disarm();
                    return Err(FenceError::Stale { token, highest });
                }
                LeaseOutcome::Granted(lease) => {
                    // The lease counts from before the acquire (or poll)
                    // was sent; a slow answer, or a marker check on a new
                    // connection after it, may have used up the slack:
                    // then it cannot cover the write, which is refused
                    // (and the lease released, as `pending` is armed).
                    let now = Instant::now();
                    if !lease_covers(sent, self.lease_ttl, now + upstream_timeout) {
                        return Err(FenceError::Store(StoreError::Unavailable(format!(
                            "the store took {:?} to grant the write: its lease could end before the write's deadline",
                            now - sent
                        ))));
                    }
                    pending.disarm();
                    // The key's registration here, if it has none (or a
                    // closed one): later writes of the token go on it.
                    let mut own = Some(lease);
                    let active = match self.actives.entry(key.clone()) {
                        dashmap::Entry::Occupied(o) if !o.get().is_closed() => None,
                        entry => {
                            let a = Active::new(
                                token,
                                own.take().expect("set above"),
                                sent,
                                self.lease_ttl,
                            );
                            entry.insert(a.clone());
                            Some(a)
                        }
                    };
                    return Ok(Permit {
                        fence: self.clone(),
                        gate: None,
                        key,
                        token,
                        lease: own,
                        active,
                        deadline: now + upstream_timeout,
                        repolled: Default::default(),
                        waited_out: false,
                    });
                }
                LeaseOutcome::Busy { lease, retry_after } => {
                    // Our own limit first: an older write on some replica
                    // may outlive it, and this one must not go ahead of it.
                    if Instant::now() >= wait_until {
                        return Err(FenceError::Busy {
                            retry_after: Duration::from_secs(1),
                        });
                    }
                    waiting.get_or_insert_with(|| Waiting::new(&self.waiting));
                    tokio::time::sleep_until(
                        (Instant::now() + retry_after.min(pause)).min(wait_until),
                    )
                    .await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                    sent = Instant::now();
                    outcome = self.store.poll_lease(&key, &lease).await?;
                }
            }
        }
    }

    /// Asks the store whether the registration `a` still holds: a read of
    /// the key's highest, or with `renew` a renewal of its lease (which
    /// leaves the lease in place if the key was taken). `Ok(None)`: it does
    /// not (the caller closes it); `Err(Stale)` when a higher token took
    /// the key.
    async fn confirm(
        &self,
        key: &str,
        a: &Active,
        renew: bool,
    ) -> Result<Option<Granted>, FenceError> {
        let sent = Instant::now();
        let token = a.token;
        if renew {
            let renewed = self.store.renew_lease(key, &a.lease, self.lease_ttl).await;
            if renewed.is_err() {
                a.renew_lost();
            }
            return match renewed? {
                LeaseOutcome::Granted(_) => Ok(Some(Granted {
                    sent,
                    ttl: Some(self.lease_ttl),
                })),
                LeaseOutcome::Stale { highest } => Err(FenceError::Stale { token, highest }),
                LeaseOutcome::Busy { .. } => Ok(None),
            };
        }
        match self.store.confirm_highest(key).await? {
            Some(h) if h == token => Ok(Some(Granted { sent, ttl: None })),
            Some(highest) if highest > token => Err(FenceError::Stale { token, highest }),
            _ => Ok(None),
        }
    }

    /// A permit for a write admitted on the key's registration `a` (already
    /// counted in it), to end by `deadline`.
    fn active_permit(
        self: &Arc<Self>,
        key: Arc<str>,
        token: u64,
        a: Arc<Active>,
        deadline: Instant,
    ) -> Permit {
        Permit {
            fence: self.clone(),
            gate: None,
            key,
            token,
            lease: None,
            active: Some(a),
            deadline,
            repolled: Default::default(),
            waited_out: false,
        }
    }

    /// Carries out what a registration said about its lease: release it now
    /// (and forget it here), or look again when it has been idle a while.
    fn release_active(self: &Arc<Self>, key: &Arc<str>, a: &Arc<Active>, what: Release) {
        let twice = match what {
            Release::Keep => return,
            Release::Now { twice } => twice,
            Release::At(at) => {
                if let Some(queue) = self.idle.lock().expect("idle lock").as_mut() {
                    queue.push((key.clone(), a.clone(), at));
                    return;
                }
                // Nobody sweeps (the fence is stopping, or runs without its
                // background task): no lingering.
                match a.idle() {
                    Release::Now { twice } => twice,
                    _ => return,
                }
            }
        };
        self.actives.remove_if(key, |_, v| Arc::ptr_eq(v, a));
        self.spawn_release(key.clone(), a.lease.clone(), twice);
    }

    /// Releases a lease in the background. A store that cannot answer (it
    /// is restarting, failing over, or its replicas cannot confirm) is
    /// asked again until the lease would have expired anyway: an
    /// unreleased lease holds newer writes to the key until then. `twice`: a poll or
    /// renewal of the lease may still be on its way and bring it back, so
    /// it is released once more after the store's margin.
    fn spawn_release(&self, key: Arc<str>, lease: WriteLease, twice: bool) {
        let store = self.store.clone();
        let again = twice.then_some(self.lease_margin);
        let retry_for = self.lease_ttl;
        self.releases.spawn(async move {
            let give_up = Instant::now() + retry_for;
            while let Err(e) = store.release_lease(&key, &lease).await {
                if Instant::now() + RELEASE_RETRY > give_up {
                    tracing::debug!(error = %e, "lease release failed; it will expire");
                    break;
                }
                tokio::time::sleep(RELEASE_RETRY).await;
            }
            if let Some(again) = again {
                tokio::time::sleep(again).await;
                let _ = store.release_lease(&key, &lease).await;
            }
        });
    }

    /// The key's highest token as far as this process can tell without
    /// taking part in admission: the in-memory copy (exclusive stores) or
    /// the store.
    pub async fn highest(&self, key: &str) -> Result<Option<u64>, FenceError> {
        if self.store.exclusive() {
            if let Some(h) = self.highest_known(key) {
                return Ok(Some(h));
            }
        }
        Ok(self.store.highest(key).await?)
    }

    /// A lower bound of the key's highest token known without I/O, if any:
    /// the in-memory copy (exclusive stores, where it is the highest), or
    /// the token of this replica's registration of the key (shared stores:
    /// the store granted it as the key's highest, and highests only rise).
    pub fn highest_known(&self, key: &str) -> Option<u64> {
        if !self.store.exclusive() {
            return self.actives.get(key).map(|a| a.token);
        }
        if let Some(g) = self.gates.get(key) {
            if let Some(h) = g.state.lock().expect("gate lock").highest {
                return Some(h);
            }
        }
        self.cache.get(key)
    }

    /// Fence-ahead: raises the key's highest to `token` (durably) without a
    /// write, so older holders are cut off at lock grant. Returns the
    /// highest afterwards; `Err(Stale)` if it was already above `token`.
    pub async fn raise(self: &Arc<Self>, key: &str, token: u64) -> Result<u64, FenceError> {
        let highest = if self.store.exclusive() {
            let key: Arc<str> = Arc::from(key);
            let guard = GateGuard {
                fence: self,
                key: key.clone(),
                gate: Some(self.gate(&key)),
            };
            let gate = guard.gate.as_ref().expect("set above");
            // A raise on a held key would let a write of the new token
            // overtake the crashed run's write as an equal one.
            self.check_held(&key, gate, token).await?;
            self.advance(&key, gate, token, false).await?
        } else {
            match self.store.advance(key, token).await? {
                Advance::Stale { highest } => highest,
                // Equal too: the raise that got there may be under 50 ms
                // old.
                Advance::Raised { .. } | Advance::Equal => {
                    self.follow_shared_raise(key, token).await;
                    token
                }
            }
        };
        if highest > token {
            return Err(FenceError::Stale { token, highest });
        }
        Ok(highest)
    }

    /// After a shared store raised `key` to `token` outside admission (a
    /// fence-ahead raise, a lease grant): this replica's registration of an
    /// older token is closed, and the answer waits out the time for which
    /// other replicas may still admit an older token on theirs (see
    /// [`active`]); from then on none does.
    async fn follow_shared_raise(self: &Arc<Self>, key: &str, token: u64) {
        let existing = self.actives.get(key).map(|e| e.value().clone());
        if let Some(a) = existing.filter(|a| a.token < token) {
            let release = a.close();
            self.release_active(&Arc::from(key), &a, release);
        }
        tokio::time::sleep(CHECK_EVERY).await;
    }

    /// Operator reset: forgets the key's fence in the store and in memory.
    /// Refused while the key is held after a crash: the crashed run's write
    /// may still be in flight, and the hold rests on the key's highest.
    pub async fn forget(&self, key: &str) -> Result<Option<u64>, FenceError> {
        if let Some(left) = self.recovering_for() {
            if self.holds_all() || self.held.contains_key(key) {
                return Err(FenceError::Recovering { retry_after: left });
            }
        }
        let old = self.store.forget(key).await?;
        self.cache.remove(key);
        if let Some(g) = self.gates.get(key) {
            g.state.lock().expect("gate lock").highest = None;
        }
        Ok(old)
    }

    /// For a write holding several keys: the highest token of a key if it
    /// rose above the permit's token after admission (the write must not go).
    pub async fn overtaken(&self, permit: &Permit) -> Result<Option<u64>, FenceError> {
        if let Some(gate) = &permit.gate {
            let st = gate.state.lock().expect("gate lock");
            return Ok(st.highest.filter(|h| *h > permit.token));
        }
        self.overtaken_shared(permit).await
    }

    /// [`overtaken`](Self::overtaken) on a shared store: asks the store.
    async fn overtaken_shared(&self, permit: &Permit) -> Result<Option<u64>, FenceError> {
        if permit.active.is_some() {
            // A read, not a poll: a poll that finds the key taken removes
            // the lease, which the registration's other writes still need.
            return Ok(self
                .store
                .highest(&permit.key)
                .await?
                .filter(|h| *h > permit.token));
        }
        let Some(lease) = &permit.lease else {
            return Ok(None);
        };
        // A poll re-registers the lease: one still on its way when the
        // permit's release lands would bring it back.
        permit
            .repolled
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(match self.store.poll_lease(&permit.key, lease).await? {
            LeaseOutcome::Stale { highest } => Some(highest),
            _ => None,
        })
    }
}

/// The answer of a store task ([`Fence::advance`], [`Fence::mark`]); a
/// task that failed (panicked) is a store error.
fn joined<T>(done: Result<Result<T, StoreError>, tokio::task::JoinError>) -> Result<T, FenceError> {
    match done {
        Ok(r) => Ok(r?),
        Err(e) => Err(StoreError::Unavailable(format!("store task failed: {e}")).into()),
    }
}

/// A lease that may be registered but is not granted yet; released on drop
/// unless disarmed.
struct PendingLease {
    releases: tokio_util::task::TaskTracker,
    store: Arc<dyn FenceStore>,
    key: Arc<str>,
    lease: Option<WriteLease>,
    /// An acquire whose answer never came may still be applied after a
    /// first release (it was queued on the server, or went over another
    /// pooled connection): release once more after this long.
    again_after: Duration,
}

impl PendingLease {
    fn disarm(mut self) {
        self.lease = None;
    }
}

impl Drop for PendingLease {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            let (store, key, again) = (self.store.clone(), self.key.clone(), self.again_after);
            self.releases.spawn(async move {
                let _ = store.release_lease(&key, &lease).await;
                tokio::time::sleep(again).await;
                let _ = store.release_lease(&key, &lease).await;
            });
        }
    }
}

/// A check of a registration under way ([`Local::Check`]); if the
/// admission is abandoned mid-call (the client hung up), the registration
/// is closed rather than left marked as checking.
struct Check<'a> {
    fence: &'a Arc<Fence>,
    key: Arc<str>,
    active: Option<Arc<Active>>,
}

impl Drop for Check<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.active.take() {
            let (_, release, _) = a.checked(None, Duration::ZERO);
            a.changed.notify_waiters();
            self.fence.release_active(&self.key, &a, release);
        }
    }
}

/// Drops an admission's gate reference and removes the gate if idle.
struct GateGuard<'a> {
    fence: &'a Fence,
    key: Arc<str>,
    gate: Option<Arc<KeyGate>>,
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        drop(self.gate.take());
        self.fence.release_gate(&self.key);
    }
}

impl Permit {
    pub fn token(&self) -> u64 {
        self.token
    }

    /// When the write must have ended: its exchange and body are cut then.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(a) = self.active.take() {
            let release = a.end();
            self.fence.release_active(&self.key, &a, release);
        }
        if let Some(lease) = self.lease.take() {
            let repolled = self.repolled.load(std::sync::atomic::Ordering::Relaxed);
            self.fence.spawn_release(self.key.clone(), lease, repolled);
        }
        let Some(gate) = self.gate.take() else { return };
        {
            let mut st = gate.state.lock().expect("gate lock");
            let entry = (self.token, self.deadline + CUT_GRACE);
            if let Some(n) = st.inflight.get_mut(&entry) {
                *n -= 1;
                if *n == 0 {
                    st.inflight.remove(&entry);
                }
            }
        }
        gate.changed.notify_waiters();
        drop(gate);
        self.fence.release_gate(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::embedded::EmbeddedStore;

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
            EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1))
                .unwrap();
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
        drop(f.admit("quiet", 1, w, T).await.unwrap());
        assert_eq!(f.store().in_flight_marks(), 1, "a written key is marked");
        let busy = f.admit("busy", 1, w, T).await.unwrap();
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

    /// Marks cost a store write only when a key has no live mark: writes
    /// while it is live (even after its gate was dropped) add none, a
    /// rotation marks again the keys in flight (so their writers add none)
    /// and lets the idle ones' marks die.
    #[tokio::test]
    async fn a_key_is_marked_once_per_rotation_while_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1))
                .unwrap();
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

    /// Fence-ahead raises (and refuses to lower), the highest is read from
    /// the gate, the cache or the store alike, a reset forgets, and a write
    /// holding a key learns when a newer token took it over.
    #[tokio::test]
    async fn raise_highest_forget_and_overtaken() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1))
                .unwrap();
        let store: Arc<dyn FenceStore> = Arc::new(store);
        // No cache: the highest of an idle key comes from the store.
        let uncached = Fence::new(store.clone(), 0, T);
        let f = Fence::new(store, 10, T);
        assert_eq!(f.highest("k").await.unwrap(), None);
        assert_eq!(f.raise("k", 5).await.unwrap(), 5);
        assert_eq!(
            f.raise("k", 5).await.unwrap(),
            5,
            "an equal raise is no error"
        );
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
            EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1))
                .unwrap();
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
            EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1))
                .unwrap();
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
}

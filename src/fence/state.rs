//! The fence's state: the [`Fence`] itself (its store, its gates, cache,
//! registrations and recovery state, each used by the file of its concern)
//! and the [`Permit`] an admitted write holds; construction and the gate
//! table.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::{FenceStore, StartState, WriteLease};

use super::active::Active;
use super::cache::*;
use super::gate::*;

/// A registration whose last write ended, and when to release it if it is
/// still idle then.
pub(super) type IdleRegistration = (Arc<str>, Arc<Active>, Instant);

/// The fence: admission decisions over one [`FenceStore`].
pub struct Fence {
    pub(super) store: Arc<dyn FenceStore>,
    pub(super) gates: DashMap<Arc<str>, Arc<KeyGate>>,
    /// Shared stores: this replica's registration per key in use (see
    /// [`active`]).
    pub(super) actives: DashMap<Arc<str>, Arc<Active>>,
    /// Registrations whose last write ended, with when to release them
    /// if still idle (see [`Fence::keep_marks`]); `None` while no
    /// background task sweeps them (then they are released as their last
    /// write ends). One lock for the queue and that state, so that nothing
    /// is queued after the sweeper's last pass.
    pub(super) idle: Mutex<Option<Vec<IdleRegistration>>>,
    /// Shared-store lease releases under way (they run on the runtime of
    /// the request that ended, a worker's): the stop waits for them
    /// briefly, so that a clean stop does not leave leases behind to
    /// expire.
    pub(super) releases: tokio_util::task::TaskTracker,
    pub(super) cache: HighestCache,
    /// After an unclean stop, held keys refuse newer tokens until this
    /// instant: a write forwarded before the crash may still be applied
    /// upstream until the upstream timeout has passed. `None` when nothing
    /// is held.
    pub(super) recovering_until: Option<Instant>,
    /// The crashed run kept no in-flight marks (an older fencegate), or
    /// its marks name keys under another key mapping than this run's
    /// ([`Fence::adopt_key_mapping`]): every key is held.
    pub(super) hold_all: std::sync::atomic::AtomicBool,
    /// Keys with live marks at the crash, with their highest token and the
    /// lowest token their marks were for: their gates are made held until
    /// `recovering_until`. Emptied after that.
    pub(super) held: DashMap<Arc<str>, (Option<u64>, u64)>,
    /// Marks below this are dead (see [`Fence::rotate_marks`]).
    pub(super) watermark: std::sync::atomic::AtomicU64,
    pub(super) lease_ttl: Duration,
    /// The store's own latency bound (its timeout, plus a second): an
    /// acquire whose answer was lost may be applied up to this late.
    pub(super) lease_margin: Duration,
    /// Writes waiting now behind an older write in flight on their key
    /// (registered by the server as `fencegate_writes_waiting`): a queue
    /// behind a slow backend shows here before it shows as 503s.
    pub(super) waiting: prometheus::IntGauge,
}

/// What an admitted write holds while it is in flight. Dropping it ends the
/// write for ordering purposes; clone it (via `Arc`) to keep it alive until
/// both the request body and the response head are done.
pub struct Permit {
    pub(super) fence: Arc<Fence>,
    /// Always `Some` until dropped; taken in `drop` so the gate can be
    /// released with no reference left here.
    pub(super) gate: Option<Arc<KeyGate>>,
    pub(super) key: Arc<str>,
    pub(super) token: u64,
    pub(super) lease: Option<WriteLease>,
    /// Shared stores: the key's registration this write was admitted on
    /// (which holds the lease instead of `lease`).
    pub(super) active: Option<Arc<Active>>,
    /// By then the write must have ended (its exchange and its body): newer
    /// writes to the key wait for it no longer than this (plus
    /// [`CUT_GRACE`]).
    pub(super) deadline: Instant,
    /// The lease was polled after the grant ([`Fence::overtaken`]): its
    /// release is sent twice, as for a lost acquire.
    pub(super) repolled: std::sync::atomic::AtomicBool,
    /// The write went ahead while an older write was still registered in
    /// flight, past that write's own deadline.
    pub waited_out: bool,
}

/// How an admission (or a fence-ahead) moved its key's highest token, as
/// far as this process can tell: what the admin lookup's "last raised by"
/// is made of. `at_ms` is when the store answered (Unix milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Raised {
    /// Its own store call raised the highest, from `previous` (`None`: the
    /// key was new). Exactly one call per raise gets this.
    From { previous: Option<u64>, at_ms: u64 },
    /// A shared store granted the token to a write of this replica that
    /// found no registration of it here: the first write of the token
    /// through this replica since the last one ended, which may have been
    /// raised by another replica (shared stores do not say who raised).
    Registered { at_ms: u64 },
}

impl Raised {
    pub fn at_ms(&self) -> u64 {
        match *self {
            Raised::From { at_ms, .. } | Raised::Registered { at_ms } => at_ms,
        }
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

    /// Number of keys with in-memory gates (writes admitting or in flight).
    pub fn active_keys(&self) -> usize {
        self.gates.len()
    }

    pub(super) fn gate(&self, key: &Arc<str>) -> Arc<KeyGate> {
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

    pub(super) fn release_gate(&self, key: &str) {
        self.gates.remove_if(key, |_, g| Arc::strong_count(g) == 1);
    }
}

/// Drops an admission's gate reference and removes the gate if idle.
pub(super) struct GateGuard<'a> {
    pub(super) fence: &'a Fence,
    pub(super) key: Arc<str>,
    pub(super) gate: Option<Arc<KeyGate>>,
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        drop(self.gate.take());
        self.fence.release_gate(&self.key);
    }
}

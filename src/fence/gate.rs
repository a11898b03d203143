//! Per-key ordering gates: a key's in-memory state while it has writers
//! (its highest token, its writes in flight with their deadlines, its mark
//! and hold), and what one pass of the admission loop decides from it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// In-memory state of one key while it has writers.
pub(super) struct KeyGate {
    pub(super) state: Mutex<GateState>,
    /// Woken when an in-flight write ends or the highest token rises.
    pub(super) changed: Notify,
}

/// What one pass of the admission loop decided.
pub(super) enum Step {
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
pub(super) struct GateState {
    /// Highest token known durable for this key, if known.
    pub(super) highest: Option<u64>,
    /// Admitted writes still in flight: per token, the deadline of each.
    /// (token, deadline) -> how many writes share both. Ordered by token,
    /// so the older writes are a prefix; no allocation per write beyond the
    /// map's own node.
    pub(super) inflight: BTreeMap<(u64, Instant), u32>,
    /// Sequence number of the key's latest durable in-flight mark, if
    /// known: live while at or above the fence's watermark.
    pub(super) mark: Option<u64>,
    /// A mark is being written (by an admission or a rotation); writers
    /// wait for it rather than write their own.
    pub(super) marking: bool,
    /// The key was marked at a crash: until then, a token above the lowest
    /// one its marks were for (`held_lowest`) is refused.
    pub(super) held_until: Option<Instant>,
    pub(super) held_lowest: u64,
}

/// How long after a write's deadline newer writes still wait for it. The
/// proxy cuts the write at its deadline, but the cut runs when the write's
/// own tasks are next scheduled, and bytes handed over just before it may
/// still be on their way.
pub const CUT_GRACE: Duration = Duration::from_millis(250);

/// What the writes older than a token still in flight mean for it.
pub(super) enum Older {
    /// None in flight.
    None,
    /// Some are registered, but every one is past its own deadline (the
    /// proxy has given up on them): going ahead cannot overtake them.
    Expired,
    /// The latest deadline among those still within theirs.
    Live(Instant),
}

impl GateState {
    pub(super) fn older(&self, token: u64, now: Instant) -> Older {
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

    pub(super) fn enter(&mut self, token: u64, deadline: Instant) {
        *self.inflight.entry((token, deadline)).or_default() += 1;
    }
}

/// Counts a write in [`Fence::waiting`] while it lives.
pub(super) struct Waiting(prometheus::IntGauge);

impl Waiting {
    pub(super) fn new(g: &prometheus::IntGauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

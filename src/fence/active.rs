//! Shared stores: one registration per key in use, not one per write.
//!
//! A replica that has writes of token T in flight on a key holds one lease
//! for them in the store (the *registration*), taken by the write that found
//! the key idle here. Further writes of T on the key are admitted on it
//! without a store round trip while both hold:
//! - the store confirmed, less than [`CHECK_EVERY`] ago, that T is the key's
//!   highest (the acquire, or a read of the key's highest token, sent less
//!   than that long ago; no older lease can appear after the grant, since
//!   it would be stale);
//! - the registration's lease lives in the store past the write's own
//!   deadline (its TTL counts from before the acquire, or the last renewal,
//!   was sent). The lease is renewed ahead of need while writes keep
//!   coming, by a renewal that, unlike a poll, leaves the lease in place
//!   when it finds the key taken.
//!
//! The checks never remove the lease: a poll of the lease that found the
//! key taken would, and the registration's writes in flight still need it.
//!
//! A newer token, on any replica, registers above T and waits for the
//! registration (the rule of every shared-store admission), so nothing
//! admitted on it can be overtaken. The registration is dropped when its
//! last write ends and no new one came for the rest of the check period, or
//! at once when a check found the key taken by a newer token. A replica
//! that stops stops admitting: a dead one's registration expires as any
//! lease does.
//!
//! So a key whose token changes keeps admitting the older token here for at
//! most [`CHECK_EVERY`] after the change reached the store; those writes
//! still reach the backend before any newer one. A fence raised without a
//! write (`Fence::raise`) waits that long before it answers, so
//! that from its answer on no replica admits an older token.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::WriteLease;

/// How long a store's answer lets a replica admit further writes of the
/// same token on its own.
pub const CHECK_EVERY: Duration = Duration::from_millis(50);

/// Renew a registration's lease when a write admitted on it would end
/// within this of the lease's end: writes keep coming on it meanwhile.
const RENEW_AHEAD: Duration = Duration::from_millis(250);

/// A store's answer that the registration still holds: the call was sent
/// at `sent`; `ttl` if it renewed the lease (for that long from `sent`).
#[derive(Clone, Copy)]
pub(super) struct Granted {
    pub(super) sent: Instant,
    pub(super) ttl: Option<Duration>,
}

impl ActiveState {
    fn renewed(&mut self, g: Granted) {
        self.fresh_until = g.sent + CHECK_EVERY;
        if let Some(ttl) = g.ttl {
            self.expires = self.expires.max(g.sent + ttl);
        }
    }
}

/// One key's registration on this replica.
pub(super) struct Active {
    pub(super) token: u64,
    pub(super) lease: WriteLease,
    pub(super) state: Mutex<ActiveState>,
    /// Woken when a check's answer is in.
    pub(super) changed: tokio::sync::Notify,
}

pub(super) struct ActiveState {
    /// Writes admitted on the registration and not ended.
    pub(super) inflight: usize,
    /// Local admissions stop at this instant (until a check renews it).
    pub(super) fresh_until: Instant,
    /// The registration lives in the store at least until this instant.
    pub(super) expires: Instant,
    /// A check is under way (writes that need it wait for its answer).
    pub(super) checking: bool,
    /// No more admissions: the key moved on, or the registration is being
    /// released.
    pub(super) closed: bool,
    /// The release was handed to a task: nobody else sends it.
    pub(super) released: bool,
    /// A renewal went unanswered: the store may still apply it after the
    /// release, so the release is sent twice, as for a lost acquire.
    pub(super) renew_lost: bool,
}

/// What [`Active::try_admit`] found.
pub(super) enum Local {
    /// Admitted here: the write counts in `inflight`.
    Admitted,
    /// Admitted here, and the confirmation is getting old (or the lease
    /// is, `renew`): the caller confirms (or renews the lease) in the
    /// background (it is marked as checking) and hands the answer to
    /// [`Active::refreshed`], so that writes that keep coming never wait
    /// for the store.
    AdmittedRefresh { renew: bool },
    /// The store's confirmation is due (or the lease must be renewed to
    /// cover this write, `renew`): the caller asks the store (the
    /// registration is marked as checking) and then calls
    /// [`Active::checked`].
    Check { renew: bool },
    /// A check is under way and the confirmation ran out: wait for
    /// [`Active::changed`], then try again.
    Wait,
    /// Not on this registration: go to the store.
    No,
}

/// What to do with a registration's lease now.
pub(super) enum Release {
    /// Nothing (writes still use it, or its release is someone else's).
    Keep,
    /// Release it when idle at this instant (the caller checks again then
    /// with [`Active::idle`]).
    At(Instant),
    /// Release it now; `twice`: once more after the store's margin (a
    /// renewal went unanswered).
    Now { twice: bool },
}

impl Active {
    pub(super) fn new(token: u64, lease: WriteLease, sent: Instant, ttl: Duration) -> Arc<Self> {
        Arc::new(Self {
            token,
            lease,
            changed: tokio::sync::Notify::new(),
            state: Mutex::new(ActiveState {
                inflight: 1,
                fresh_until: sent + CHECK_EVERY,
                expires: sent + ttl,
                checking: false,
                closed: false,
                released: false,
                renew_lost: false,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ActiveState> {
        self.state.lock().expect("active lock")
    }

    /// Admits a write of `token` that lasts `lasts` (its cut included) on
    /// this registration, if it may; also answers the instant it read
    /// (under the lock, so a stalled caller cannot use an old one).
    pub(super) fn try_admit(&self, token: u64, lasts: Duration) -> (Local, Instant) {
        let mut st = self.lock();
        let now = Instant::now();
        if st.closed || token != self.token {
            return (Local::No, now);
        }
        let deadline = now + lasts;
        if now < st.fresh_until && deadline <= st.expires {
            st.inflight += 1;
            if !st.checking {
                let renew = deadline + RENEW_AHEAD > st.expires;
                if renew || now + CHECK_EVERY / 2 >= st.fresh_until {
                    st.checking = true;
                    return (Local::AdmittedRefresh { renew }, now);
                }
            }
            return (Local::Admitted, now);
        }
        if st.checking {
            return (Local::Wait, now);
        }
        st.checking = true;
        (
            Local::Check {
                renew: deadline > st.expires,
            },
            now,
        )
    }

    /// The answer of the check [`Local::Check`] asked for: `Some(sent)`
    /// when the store granted the registration again (a poll sent at
    /// `sent`), which admits the caller's write (`true`); otherwise the
    /// registration is closed, and released if idle.
    pub(super) fn checked(
        &self,
        granted: Option<Granted>,
        lasts: Duration,
    ) -> (bool, Release, Instant) {
        let mut st = self.lock();
        st.checking = false;
        let now = Instant::now();
        if let Some(g) = granted.filter(|_| !st.closed) {
            st.renewed(g);
        }
        // The confirmation must still be fresh now: an answer that took
        // longer than the period says nothing about the present.
        match granted {
            Some(g) if !st.closed && now < g.sent + CHECK_EVERY && now + lasts <= st.expires => {
                st.inflight += 1;
                (true, Release::Keep, now)
            }
            _ => {
                st.closed = true;
                (false, Self::release_if_idle(&mut st), now)
            }
        }
    }

    /// The answer of the background poll [`Local::AdmittedRefresh`] asked
    /// for: `Some(sent)` renews the confirmation; otherwise the
    /// registration is closed (and released if idle).
    pub(super) fn refreshed(&self, granted: Option<Granted>) -> Release {
        let mut st = self.lock();
        st.checking = false;
        match granted {
            Some(g) if !st.closed => {
                st.renewed(g);
                // Its last write may have ended while the read was out
                // (`end` leaves the release to the check then).
                if st.inflight == 0 && !st.released {
                    Release::At(st.fresh_until)
                } else {
                    Release::Keep
                }
            }
            _ => {
                st.closed = true;
                Self::release_if_idle(&mut st)
            }
        }
    }

    /// A renewal of the lease went unanswered (a store error or timeout).
    pub(super) fn renew_lost(&self) {
        self.lock().renew_lost = true;
    }

    /// Stops admissions (a newer token was seen for the key).
    pub(super) fn close(&self) -> Release {
        let mut st = self.lock();
        st.closed = true;
        Self::release_if_idle(&mut st)
    }

    pub(super) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// A write on the registration ended.
    pub(super) fn end(&self) -> Release {
        let mut st = self.lock();
        st.inflight -= 1;
        if st.inflight > 0 || st.checking || st.released {
            return Release::Keep;
        }
        if st.closed {
            return Self::release_if_idle(&mut st);
        }
        // Lingers while its confirmation is fresh: the next write of the
        // token may come before then.
        Release::At(st.fresh_until)
    }

    /// At the instant [`Release::At`] named: releases the registration if
    /// no write uses it.
    pub(super) fn idle(&self) -> Release {
        let mut st = self.lock();
        if st.inflight > 0 || st.checking || st.released {
            return Release::Keep;
        }
        st.closed = true;
        Self::release_if_idle(&mut st)
    }

    fn release_if_idle(st: &mut ActiveState) -> Release {
        if st.inflight > 0 || st.checking || st.released {
            return Release::Keep;
        }
        st.released = true;
        Release::Now {
            twice: st.renew_lost,
        }
    }
}

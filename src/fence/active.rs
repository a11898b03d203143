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

/// One key's registration on this replica.
pub(super) struct Active {
    pub(super) token: u64,
    pub(super) lease: WriteLease,
    state: Mutex<ActiveState>,
    /// Woken when a check's answer is in (the transitions that take one
    /// wake it themselves).
    pub(super) changed: tokio::sync::Notify,
}

/// Where a registration is in its life; it only moves down this list.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Admitting writes of its token.
    Open,
    /// No more admissions (the key moved on, a check failed, or it sat
    /// idle past its confirmation); its lease is released once unused.
    Closed,
    /// Its release was handed out: nobody sends it again.
    Released,
}

struct ActiveState {
    phase: Phase,
    /// Writes admitted on the registration and not ended.
    inflight: usize,
    /// A check is under way (writes that need it wait for its answer).
    checking: bool,
    /// Local admissions stop at this instant (until a check renews it).
    fresh_until: Instant,
    /// The registration lives in the store at least until this instant.
    expires: Instant,
    /// A renewal went unanswered: the store may still apply it after the
    /// release, so the release is sent twice, as for a lost acquire.
    renew_lost: bool,
}

impl ActiveState {
    fn renewed(&mut self, g: Granted) {
        self.fresh_until = g.sent + CHECK_EVERY;
        if let Some(ttl) = g.ttl {
            self.expires = self.expires.max(g.sent + ttl);
        }
    }

    fn close(&mut self) {
        if self.phase == Phase::Open {
            self.phase = Phase::Closed;
        }
    }

    /// The release rule, kept here only, and applied after every change:
    /// the lease is kept while a write or a check uses it; once unused, a
    /// closed registration is released (exactly once), and an open one
    /// lingers while its confirmation is fresh, for the token's next write
    /// may come before then.
    fn settle(&mut self) -> Release {
        if self.inflight > 0 || self.checking {
            return Release::Keep;
        }
        match self.phase {
            Phase::Released => Release::Keep,
            Phase::Open => Release::At(self.fresh_until),
            Phase::Closed => {
                self.phase = Phase::Released;
                Release::Now {
                    twice: self.renew_lost,
                }
            }
        }
    }
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

/// What [`Active::checked`] decided for the write that asked.
#[must_use]
pub(super) enum Checked {
    /// Admitted on the registration, at this instant.
    Admitted(Instant),
    /// Not admitted; the registration is closed.
    Refused(Release),
}

/// What to do with a registration's lease now; only
/// `Fence::release_active` carries it out.
#[must_use = "a registration's release is carried out by Fence::release_active"]
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
                phase: Phase::Open,
                inflight: 1,
                checking: false,
                fresh_until: sent + CHECK_EVERY,
                expires: sent + ttl,
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
        if st.phase != Phase::Open || token != self.token {
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

    /// The answer of the check [`Local::Check`] asked for (`None`: the
    /// store did not grant it, or the check was abandoned). A grant admits
    /// the caller's write only if the confirmation is still fresh now (an
    /// answer that took longer than the period says nothing about the
    /// present) and the lease covers the write; otherwise the registration
    /// is closed.
    pub(super) fn checked(&self, granted: Option<Granted>, lasts: Duration) -> Checked {
        let checked = {
            let mut st = self.lock();
            st.checking = false;
            let now = Instant::now();
            match granted.filter(|_| st.phase == Phase::Open) {
                Some(g) => {
                    st.renewed(g);
                    if now < g.sent + CHECK_EVERY && now + lasts <= st.expires {
                        st.inflight += 1;
                        Checked::Admitted(now)
                    } else {
                        st.close();
                        Checked::Refused(st.settle())
                    }
                }
                None => {
                    st.close();
                    Checked::Refused(st.settle())
                }
            }
        };
        self.changed.notify_waiters();
        checked
    }

    /// The answer of the background check [`Local::AdmittedRefresh`] asked
    /// for: a grant renews the confirmation; otherwise the registration is
    /// closed.
    pub(super) fn refreshed(&self, granted: Option<Granted>) -> Release {
        let release = {
            let mut st = self.lock();
            st.checking = false;
            match granted.filter(|_| st.phase == Phase::Open) {
                Some(g) => st.renewed(g),
                None => st.close(),
            }
            st.settle()
        };
        self.changed.notify_waiters();
        release
    }

    /// A renewal of the lease went unanswered (a store error or timeout).
    pub(super) fn renew_lost(&self) {
        self.lock().renew_lost = true;
    }

    /// Stops admissions (a newer token was seen for the key).
    pub(super) fn close(&self) -> Release {
        let mut st = self.lock();
        st.close();
        st.settle()
    }

    pub(super) fn is_closed(&self) -> bool {
        self.lock().phase != Phase::Open
    }

    /// A write on the registration ended.
    pub(super) fn end(&self) -> Release {
        let mut st = self.lock();
        st.inflight -= 1;
        st.settle()
    }

    /// At the instant [`Release::At`] named: the registration is closed
    /// (and released) if nothing used it meanwhile.
    pub(super) fn idle(&self) -> Release {
        let mut st = self.lock();
        if st.inflight == 0 && !st.checking {
            st.close();
        }
        st.settle()
    }
}

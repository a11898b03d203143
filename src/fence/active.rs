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
    /// No more admissions: the key moved on, a check was refused,
    /// abandoned, answered too late or could not cover its write, or the
    /// registration was found unused when its linger ended. Its lease is
    /// released once unused.
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

    /// Whether a write admitted now that lasts `lasts` (its cut included,
    /// so this is `shared::lease_covers` on the registration's lease) may go
    /// on the registration alone: the store's confirmation is fresh and the
    /// lease outlives the write.
    fn admits(&self, now: Instant, lasts: Duration) -> bool {
        now < self.fresh_until && now + lasts <= self.expires
    }

    fn close(&mut self) {
        if self.phase == Phase::Open {
            self.phase = Phase::Closed;
        }
    }

    /// Whether a write or a check uses the registration now.
    fn in_use(&self) -> bool {
        self.inflight > 0 || self.checking
    }

    /// The release rule, kept here only, and applied after every change:
    /// the lease is kept while in use; once unused, a closed registration
    /// is released (exactly once), and an open one is looked at again
    /// ([`Active::idle`]) when its confirmation ages, for the token's next
    /// write may come before then.
    fn settle(&mut self) -> Release {
        if self.in_use() {
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
        if st.admits(now, lasts) {
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
                    if st.admits(now, lasts) {
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

    /// Writes admitted on it and not ended.
    pub(super) fn in_flight(&self) -> usize {
        self.lock().inflight
    }

    /// A write on the registration ended.
    pub(super) fn end(&self) -> Release {
        let mut st = self.lock();
        st.inflight -= 1;
        st.settle()
    }

    /// At the instant [`Release::At`] named: the registration is closed
    /// (and released) if nothing uses it now. One that was used since and
    /// is unused again closes early (its own linger is still queued): a
    /// later write of the token registers anew, which costs a store call,
    /// never safety.
    pub(super) fn idle(&self) -> Release {
        let mut st = self.lock();
        if !st.in_use() {
            st.close();
        }
        st.settle()
    }
}

#[cfg(test)]
mod tests {
    //! The registration's state machine alone, on a paused clock; its use
    //! against real stores is `tests/shared_stores.rs`.
    use super::*;

    const TTL: Duration = Duration::from_secs(10);
    const LASTS: Duration = Duration::from_secs(1);

    fn registration() -> Arc<Active> {
        let lease = WriteLease {
            id: "l".into(),
            token: 7,
        };
        Active::new(7, lease, Instant::now(), TTL)
    }

    fn admit(a: &Active, token: u64, lasts: Duration) -> Local {
        a.try_admit(token, lasts).0
    }

    fn is_now(r: &Release, twice_expected: bool) -> bool {
        matches!(r, Release::Now { twice } if *twice == twice_expected)
    }

    #[tokio::test(start_paused = true)]
    async fn admits_its_own_token_while_fresh_and_lingers_after_the_last_write() {
        let a = registration();
        let made = Instant::now();
        assert!(matches!(admit(&a, 7, LASTS), Local::Admitted));
        assert!(matches!(admit(&a, 8, LASTS), Local::No));
        assert!(matches!(admit(&a, 6, LASTS), Local::No));
        // The acquiring write and the admitted one.
        assert!(matches!(a.end(), Release::Keep));
        match a.end() {
            Release::At(at) => assert_eq!(at, made + CHECK_EVERY),
            _ => panic!("the last write's end must linger until the confirmation ages"),
        }
        assert!(!a.is_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn an_ageing_confirmation_is_refreshed_by_one_write_in_the_background() {
        let a = registration();
        tokio::time::advance(CHECK_EVERY / 2).await;
        assert!(matches!(
            admit(&a, 7, LASTS),
            Local::AdmittedRefresh { renew: false }
        ));
        // One check at a time: the next write is admitted without one.
        assert!(matches!(admit(&a, 7, LASTS), Local::Admitted));
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(5)).await;
        assert!(matches!(
            a.refreshed(Some(Granted { sent, ttl: None })),
            Release::Keep
        ));
        // Fresh until a period after the check was sent.
        tokio::time::advance(CHECK_EVERY / 2 - Duration::from_millis(6)).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::Admitted));
        tokio::time::advance(CHECK_EVERY).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::Check { renew: false }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refresh_the_store_refuses_closes_and_the_last_write_releases() {
        let a = registration();
        tokio::time::advance(CHECK_EVERY / 2).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::AdmittedRefresh { .. }));
        assert!(matches!(a.refreshed(None), Release::Keep));
        assert!(a.is_closed());
        assert!(matches!(admit(&a, 7, LASTS), Local::No));
        assert!(matches!(a.end(), Release::Keep));
        assert!(is_now(&a.end(), false));
        // Exactly once.
        assert!(matches!(a.close(), Release::Keep));
        assert!(matches!(a.idle(), Release::Keep));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refresh_that_lands_after_the_last_write_lingers_then_releases() {
        let a = registration();
        tokio::time::advance(CHECK_EVERY / 2).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::AdmittedRefresh { .. }));
        assert!(matches!(a.end(), Release::Keep));
        // The check is out: its answer settles the release.
        assert!(matches!(a.end(), Release::Keep));
        let sent = Instant::now();
        match a.refreshed(Some(Granted { sent, ttl: None })) {
            Release::At(at) => assert_eq!(at, sent + CHECK_EVERY),
            _ => panic!("an idle registration lingers after a granted refresh"),
        }
        tokio::time::advance(CHECK_EVERY).await;
        assert!(is_now(&a.idle(), false));
        assert!(a.is_closed());
        assert!(matches!(admit(&a, 7, LASTS), Local::No));
    }

    #[tokio::test(start_paused = true)]
    async fn past_its_confirmation_a_write_checks_and_others_wait_for_the_answer() {
        let a = registration();
        tokio::time::advance(CHECK_EVERY).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::Check { renew: false }));
        assert!(matches!(admit(&a, 7, LASTS), Local::Wait));
        let sent = Instant::now();
        tokio::time::advance(CHECK_EVERY - Duration::from_millis(1)).await;
        assert!(matches!(
            a.checked(Some(Granted { sent, ttl: None }), LASTS),
            Checked::Admitted(_)
        ));
        // That answer is nearly a period old: the next write refreshes it.
        assert!(matches!(
            admit(&a, 7, LASTS),
            Local::AdmittedRefresh { renew: false }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_that_comes_back_after_a_whole_period_says_nothing_and_closes() {
        let a = registration();
        assert!(matches!(a.end(), Release::At(_)));
        tokio::time::advance(CHECK_EVERY).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::Check { .. }));
        let sent = Instant::now();
        tokio::time::advance(CHECK_EVERY).await;
        match a.checked(Some(Granted { sent, ttl: None }), LASTS) {
            Checked::Refused(r) => assert!(is_now(&r, false)),
            Checked::Admitted(_) => panic!("a stale confirmation admitted a write"),
        }
        assert!(a.is_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_check_closes_and_releases_once_unused() {
        let a = registration();
        tokio::time::advance(CHECK_EVERY).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::Check { .. }));
        // The acquiring write is still in flight.
        match a.checked(None, Duration::ZERO) {
            Checked::Refused(r) => assert!(matches!(r, Release::Keep)),
            Checked::Admitted(_) => panic!("no grant admits nothing"),
        }
        assert!(is_now(&a.end(), false));
    }

    #[tokio::test(start_paused = true)]
    async fn the_lease_is_renewed_ahead_of_need_and_checked_when_it_cannot_cover() {
        let a = registration();
        // Ends within RENEW_AHEAD of the lease: admitted, renewed behind.
        let near = TTL - RENEW_AHEAD + Duration::from_millis(1);
        assert!(matches!(
            admit(&a, 7, near),
            Local::AdmittedRefresh { renew: true }
        ));
        let sent = Instant::now();
        assert!(matches!(
            a.refreshed(Some(Granted {
                sent,
                ttl: Some(TTL * 2)
            })),
            Release::Keep
        ));
        // The renewal moved the lease's end: the same write now fits
        // without one.
        assert!(matches!(admit(&a, 7, near), Local::Admitted));
        // Past the lease: a check that renews it first.
        assert!(matches!(
            admit(&a, 7, TTL * 2 + Duration::from_millis(1)),
            Local::Check { renew: true }
        ));
        match a.checked(Some(Granted { sent, ttl: None }), TTL * 3) {
            Checked::Refused(_) => {}
            Checked::Admitted(_) => panic!("a write the lease cannot cover was admitted"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_renewal_makes_the_release_go_twice() {
        let a = registration();
        a.renew_lost();
        assert!(matches!(a.close(), Release::Keep));
        assert!(is_now(&a.end(), true));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_keeps_a_registration_used_since_and_closes_an_unused_one() {
        let a = registration();
        assert!(matches!(a.end(), Release::At(_)));
        assert!(matches!(admit(&a, 7, LASTS), Local::Admitted));
        assert!(matches!(a.idle(), Release::Keep));
        assert!(!a.is_closed());
        assert!(matches!(a.end(), Release::At(_)));
        tokio::time::advance(CHECK_EVERY).await;
        assert!(matches!(admit(&a, 7, LASTS), Local::Check { .. }));
        // A check out keeps it too.
        assert!(matches!(a.idle(), Release::Keep));
        let sent = Instant::now();
        assert!(matches!(
            a.checked(Some(Granted { sent, ttl: None }), LASTS),
            Checked::Admitted(_)
        ));
        assert!(matches!(a.end(), Release::At(_)));
        assert!(is_now(&a.idle(), false));
    }

    #[tokio::test(start_paused = true)]
    async fn closing_with_writes_in_flight_releases_after_the_last() {
        let a = registration();
        assert!(matches!(admit(&a, 7, LASTS), Local::Admitted));
        assert!(matches!(a.close(), Release::Keep));
        assert!(matches!(admit(&a, 7, LASTS), Local::No));
        assert!(matches!(a.end(), Release::Keep));
        assert!(is_now(&a.end(), false));
    }
}

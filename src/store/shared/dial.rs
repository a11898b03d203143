//! A connection slot whose dial outlives the call that started it.
//!
//! Over a slow or lossy link a store's handshake (TCP, TLS, authentication,
//! the checks fencegate makes at connect) can take longer than one call's
//! `store_timeout` while a call on an open connection still fits in it.
//! Were each dial given up with its call, none would ever finish and every
//! write would be refused for as long as the link stays slow (the partition
//! suite's lossy PostgreSQL run refused all 80 writes once). So a dial runs
//! on in a task of its own, bounded by its own timeout ([`dial_bound`]), and
//! the slot's next call takes its connection.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::api::StoreError;

/// How long a dial may take, for calls bounded by `timeout`: long enough
/// for a handshake that lost a packet or two (a new socket's first
/// retransmission waits 1 s), short enough that a dial begun during a
/// partition is replaced soon after the heal (its SYNs back off 1 s, 2 s,
/// 4 s...).
pub fn dial_bound(timeout: Duration) -> Duration {
    timeout * 3
}

/// A pool slot: empty, dialing, or holding a connection.
#[derive(Default)]
pub enum Slot<C> {
    #[default]
    Empty,
    Dialing(Dial<C>),
    Ready(C),
}

/// A connect running in a task of its own. The slot owns it: dropping the
/// slot (or replacing the dial) aborts it.
pub struct Dial<C>(tokio::task::JoinHandle<Result<C, StoreError>>);

impl<C: Send + 'static> Dial<C> {
    fn start(
        kind: &str,
        dial: impl Future<Output = Result<C, StoreError>> + Send + 'static,
    ) -> Dial<C> {
        let kind = kind.to_string();
        Dial(tokio::spawn(async move {
            let started = std::time::Instant::now();
            let r = dial.await;
            match &r {
                Ok(_) => tracing::debug!(store = %kind, took = ?started.elapsed(), "dialed"),
                Err(e) => {
                    tracing::warn!(store = %kind, took = ?started.elapsed(), error = %e, "a dial failed")
                }
            }
            r
        }))
    }
}

impl<C> Drop for Dial<C> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<C: Send + 'static> Slot<C> {
    /// Whether the slot holds a connection `usable` accepts.
    pub fn is_ready(&self, usable: impl FnOnce(&C) -> bool) -> bool {
        matches!(self, Slot::Ready(c) if usable(c))
    }

    /// The slot's connection, taken out (the caller puts it back when it
    /// stays usable), and whether it is a new one: the one it holds if
    /// `usable` accepts it, else the one its dial makes, waited for until
    /// `deadline`. A dial is started with `dial` when none is going, or
    /// when the one going failed before this call came (its error is
    /// stale) or made a connection `usable` refuses. The dial is awaited
    /// where it lies, in the slot: a call cancelled by an outer bound, or
    /// timed out here, leaves it going for the slot's next call.
    pub async fn take<F>(
        &mut self,
        kind: &str,
        deadline: Instant,
        usable: impl Fn(&C) -> bool,
        dial: impl Fn() -> F,
    ) -> Result<(C, bool), StoreError>
    where
        F: Future<Output = Result<C, StoreError>> + Send + 'static,
    {
        let mut fresh = false;
        loop {
            if self.is_ready(&usable) {
                let Slot::Ready(c) = std::mem::take(self) else {
                    unreachable!("is_ready said so")
                };
                return Ok((c, false));
            }
            if !matches!(self, Slot::Dialing(_)) {
                *self = Slot::Dialing(Dial::start(kind, dial()));
                fresh = true;
            }
            let Slot::Dialing(going) = self else {
                unreachable!("set just above")
            };
            let Ok(done) = tokio::time::timeout_at(deadline, &mut going.0).await else {
                return Err(StoreError::Unavailable(format!(
                    "{kind}: connect timed out (the dial goes on for the next call)"
                )));
            };
            *self = Slot::Empty;
            match done {
                Ok(Ok(c)) if usable(&c) => return Ok((c, true)),
                Ok(Err(e)) if fresh => return Err(e),
                Err(e) if fresh => return Err(StoreError::Unavailable(format!("{kind}: {e}"))),
                // Stale, or closed while it waited: dial again, once.
                _ if !fresh => {}
                _ => {
                    return Err(StoreError::Unavailable(format!(
                        "{kind}: the new connection closed at once"
                    )))
                }
            }
        }
    }

    /// Forgets a held connection (a later call dials anew). A dial going on
    /// is kept: it may have begun before the failure this is about, but it
    /// asks anew whom to connect to, and checks what it reached (Redis: the
    /// role; PostgreSQL: `target_session_attrs`).
    pub fn forget(&mut self) {
        if let Slot::Ready(_) = self {
            *self = Slot::Empty;
        }
    }
}

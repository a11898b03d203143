//! The cap on one upstream's connections (HAProxy's `maxconn` per server):
//! at most `max` connections open or being dialled, all workers together,
//! and a FIFO queue in front of it whose wait is bounded.
//!
//! Why a cap at all (issue 42.6): a burst of N requests on new keys would
//! otherwise dial N connections at once. A small backend's listen queue
//! (Python's `http.server` asks for a backlog of 5) overflows; Linux then
//! drops the handshake's last ACK, or answers with SYN cookies, so the
//! dial *succeeds* on fencegate's side while the backend has no
//! connection: the request sits unacknowledged in fencegate's send queue
//! and its retransmissions back off for tens of seconds. Fewer connections
//! at once is most of the cure; `h1.rs` bounds what is left (a request the
//! upstream's kernel never acknowledges ends at the connect timeout).
//!
//! Every connection holds a [`Permit`] for as long as it is open (the
//! lane's keeps it beside its socket; hyper's connection driver task holds
//! it): an idle connection in a pool counts, because the upstream counts
//! it too. A request that finds no permit first closes an idle connection
//! of any worker, then waits its turn.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::UpstreamError;

/// The settings and metric handles of one upstream's cap.
#[derive(Clone)]
pub struct LimitSettings {
    /// Connections open or being dialled, all workers together; 0: no cap.
    pub max_connections: usize,
    /// Longest wait for a connection once all are taken.
    pub queue_timeout: Duration,
    /// The route's connect timeout: also how long a request on a new
    /// connection may stay unacknowledged by the upstream's kernel.
    pub connect_timeout: Duration,
    /// Requests waiting for a connection now.
    pub queued: prometheus::IntGauge,
    /// Requests that waited `queue_timeout` and were refused (503).
    pub queue_timeouts: prometheus::IntCounter,
    /// Connections open or being dialled now.
    pub open: prometheus::IntGauge,
}

impl LimitSettings {
    /// No cap, metrics that go nowhere (tests of the pool itself).
    pub fn unlimited() -> Self {
        let gauge = |name: &str| prometheus::IntGauge::new(name, "-").expect("metric");
        Self {
            max_connections: 0,
            queue_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            queued: gauge("queued"),
            queue_timeouts: prometheus::IntCounter::new("timeouts", "-").expect("metric"),
            open: gauge("open"),
        }
    }
}

pub(super) struct Limit {
    /// `None`: no cap.
    sem: Option<Arc<Semaphore>>,
    pub(super) settings: LimitSettings,
    /// Requests in the queue now: a connection given back while some wait
    /// is closed rather than kept idle, so that its permit goes to the
    /// oldest of them, whichever worker it is on.
    waiting: AtomicUsize,
}

/// One connection's right to be open. Dropped with the connection.
pub(super) struct Permit {
    _sem: Option<OwnedSemaphorePermit>,
    open: prometheus::IntGauge,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// Counts a request in the queue while it is there (also when its future
/// is dropped: the client went away, the deadline passed).
struct Queued<'a>(&'a Limit);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.settings.queued.dec();
    }
}

impl Limit {
    pub(super) fn new(settings: LimitSettings) -> Self {
        Self {
            sem: (settings.max_connections > 0)
                .then(|| Arc::new(Semaphore::new(settings.max_connections))),
            settings,
            waiting: AtomicUsize::new(0),
        }
    }

    fn permit(&self, sem: Option<OwnedSemaphorePermit>) -> Permit {
        self.settings.open.inc();
        Permit {
            _sem: sem,
            open: self.settings.open.clone(),
        }
    }

    /// A permit if one is free now (always, without a cap).
    pub(super) fn try_acquire(&self) -> Option<Permit> {
        match &self.sem {
            None => Some(self.permit(None)),
            Some(sem) => sem
                .clone()
                .try_acquire_owned()
                .ok()
                .map(|p| self.permit(Some(p))),
        }
    }

    /// Waits in the queue (FIFO: tokio's semaphore is fair) for a permit,
    /// at most the queue timeout.
    pub(super) async fn wait(&self) -> Result<Permit, UpstreamError> {
        let Some(sem) = &self.sem else {
            return Ok(self.permit(None));
        };
        self.waiting.fetch_add(1, Ordering::AcqRel);
        self.settings.queued.inc();
        let _queued = Queued(self);
        let timeout = self.settings.queue_timeout;
        match tokio::time::timeout(timeout, sem.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(self.permit(Some(p))),
            // The semaphore is never closed.
            Ok(Err(_)) | Err(_) => {
                self.settings.queue_timeouts.inc();
                Err(UpstreamError::Queue {
                    waited: timeout,
                    max: self.settings.max_connections,
                })
            }
        }
    }

    /// Whether requests wait for a connection now.
    pub(super) fn has_waiters(&self) -> bool {
        self.sem.is_some() && self.waiting.load(Ordering::Acquire) > 0
    }
}

//! What every shared store (Redis, PostgreSQL, etcd) has in common:
//! amnesia detection and the per-replica knowledge behind it.
//!
//! A backend ([`Backend`]) only speaks its server's protocol. [`SharedStore`]
//! wraps it into a [`FenceStore`] and refuses writes when the server may have
//! lost data: its marker record (written at first start) is missing, was
//! replaced, or carries a sequence number lower than this replica already
//! saw (a restored backup, a failover to a lagging replica); or a key's
//! highest token is lower than one the server acknowledged to this replica.
//! Writes stay refused until an operator confirms ([`FenceStore::confirm_reset`]),
//! which writes back every fence this replica knows and a new marker.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dashmap::DashMap;

use super::api::{
    Advance, Claim, FenceStore, LeaseOutcome, Lock, StartState, StoreError, WriteLease,
};
use super::batch::{Batcher, Run};

/// How often the marker is re-read even without a reconnect.
const MARKER_INTERVAL: Duration = Duration::from_secs(1);

/// The marker record: who created the store's fence data, and how many
/// (re)connections it has seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    pub epoch: String,
    pub seq: u64,
}

/// The epoch prefix of a marker that a replica replaced after it saw the
/// store go back ([`SharedStore::trip`]). Every replica reads the marker
/// before it admits anything, so a replica that restarted (and forgot what
/// it saw) or a new one is refused too, until an operator confirms, which
/// records a fresh epoch.
const TRIPPED: &str = "rolledback.";

impl Marker {
    /// The marker a replica records after it saw the store go back: the
    /// sequence it had seen and the one it found.
    fn tripped(seen: u64, found: u64) -> String {
        format!("{TRIPPED}{seen}.{found}.{}", &crate::id::unique_id()[..16])
    }

    /// Why writes are refused, if another replica saw this store go back.
    fn trip_reason(&self) -> Option<String> {
        let rest = self.epoch.strip_prefix(TRIPPED)?;
        let mut parts = rest.split('.');
        let (seen, found) = (parts.next().unwrap_or("?"), parts.next().unwrap_or("?"));
        Some(format!(
            "a replica found its marker gone back from sequence {seen} to {found} (restored backup or lagging failover) and recorded it in the store"
        ))
    }

    /// The local state file's form: `EPOCH SEQ`.
    fn parse_state(text: &str) -> Option<Marker> {
        let (epoch, seq) = text.trim().split_once(' ')?;
        let seq = seq.parse().ok()?;
        (!epoch.is_empty() && !epoch.contains(char::is_whitespace)).then(|| Marker {
            epoch: epoch.to_string(),
            seq,
        })
    }
}

/// A replica's own record, on its own disk, of the latest marker it saw
/// (`store_state_file`): a restarted replica compares the store's marker
/// with it, so a store rolled back while the replica was down is caught at
/// its first check, even if no running replica saw the rollback.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: std::path::PathBuf,
}

impl StateFile {
    pub fn new(path: std::path::PathBuf) -> Self {
        Self { path }
    }

    /// The marker recorded last; `None` if the file does not exist yet.
    pub fn load(&self) -> Result<Option<Marker>, StoreError> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => Marker::parse_state(&text).map(Some).ok_or_else(|| {
                StoreError::Unavailable(format!(
                    "store_state_file {} is not a marker record (`EPOCH SEQ`); remove it only if this replica's store was knowingly reset",
                    self.path.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::Unavailable(format!(
                "store_state_file {}: {e}",
                self.path.display()
            ))),
        }
    }

    /// Replaces the record (a new file renamed over the old one, so a crash
    /// leaves the old record or the new one, never half of either).
    async fn save(&self, m: &Marker) -> std::io::Result<()> {
        let path = self.path.clone();
        let text = format!("{} {}\n", m.epoch, m.seq);
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut tmp = path.clone().into_os_string();
            tmp.push(".tmp");
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_data()?;
            std::fs::rename(&tmp, &path)?;
            // The rename itself reaches the disk with its directory.
            match path.parent().filter(|d| !d.as_os_str().is_empty()) {
                Some(dir) => std::fs::File::open(dir)?.sync_all(),
                None => Ok(()),
            }
        })
        .await
        .map_err(std::io::Error::other)?
    }
}

/// One server protocol. Every method is one atomic operation on the server.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    fn kind(&self) -> &'static str;
    /// Changes every time a new connection (session) to the server is made,
    /// so the marker is checked again after each reconnect.
    fn session(&self) -> u64;
    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError>;
    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError>;
    /// Admits several writes in one round trip (keys distinct): each answer
    /// is what the acquire alone would have got, as if they ran one after
    /// another. The outer error fails them all (none, some or all may
    /// have been applied).
    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError>;
    async fn poll(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError>;
    /// Extends a granted lease to `ttl` from now, unless a higher token
    /// took the key (`Stale`: the lease is left as it is, since writes
    /// admitted on it may still be in flight). `Granted` otherwise.
    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError>;
    /// Removes several leases (by key and lease) in one round trip; a lease
    /// already gone is no error.
    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError>;
    async fn ping(&self) -> Result<(), StoreError>;
    /// One lock-service operation on `key`, atomically (see
    /// [`FenceStore::claim_lock`] and its kin). May run twice on a broken
    /// connection: a claim sent again finds its own lease and answers it
    /// granted.
    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError>;
    async fn read_marker(&self) -> Result<Option<Marker>, StoreError>;
    /// Creates the marker if none exists; returns the stored one.
    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError>;
    /// Adds one to the marker's sequence; returns the new marker (`None` if
    /// the marker is gone).
    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError>;
    /// Replaces the marker with a new epoch (after an operator confirmed a
    /// reset), but only if it is still `expected` (`None`: absent); returns
    /// the marker stored afterwards, ours or a concurrent confirmer's.
    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError>;
}

/// A lock-service operation ([`Backend::lock`]).
#[derive(Debug, Clone, Copy)]
pub enum LockCall<'a> {
    Claim {
        id: &'a str,
        holder: &'a str,
        ttl: Duration,
    },
    Read,
    Renew {
        id: &'a str,
        ttl: Duration,
    },
    Release {
        id: &'a str,
    },
}

impl LockCall<'_> {
    /// The operation's name, lease id, holder and TTL (ms) as scripts and
    /// functions take them.
    pub fn args(&self) -> (&'static str, &str, &str, u64) {
        let ms = |t: &Duration| crate::clock::millis(*t).max(1);
        match self {
            LockCall::Claim { id, holder, ttl } => ("claim", id, holder, ms(ttl)),
            LockCall::Read => ("read", "", "", 0),
            LockCall::Renew { id, ttl } => ("renew", id, "", ms(ttl)),
            LockCall::Release { id } => ("release", id, "", 0),
        }
    }
}

/// The answer to a [`LockCall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockReply {
    Claim(Claim),
    Lock(Option<Lock>),
    Released(bool),
}

/// A lock answer as Redis's script and PostgreSQL's function give it, a
/// list of text: `granted T R` (R: `1` if a write registration was held on
/// the key, else `0`), `held ID T HOLDER MS`, `exhausted`, `lock ID
/// T HOLDER MS`, `released` or `none`.
pub fn lock_reply(
    engine: &str,
    call: &LockCall<'_>,
    parts: &[String],
) -> Result<LockReply, StoreError> {
    let bad = || StoreError::Unavailable(format!("{engine}: unexpected lease answer {parts:?}"));
    let lock = || -> Result<Lock, StoreError> {
        match parts {
            [_, id, token, holder, left] => Ok(Lock {
                id: id.clone(),
                token: stored_token(engine, token)?,
                holder: holder.clone(),
                expires_in: Duration::from_millis(left.parse::<u64>().map_err(|_| bad())?),
            }),
            _ => Err(bad()),
        }
    };
    let status = parts.first().map(String::as_str).unwrap_or("");
    Ok(match (call, status) {
        (LockCall::Claim { .. }, "granted") => LockReply::Claim(Claim::Granted {
            token: stored_token(engine, parts.get(1).ok_or_else(bad)?)?,
            // Absent (an older answer): assume a registration.
            registered: parts.get(2).is_none_or(|r| r != "0"),
        }),
        (LockCall::Claim { .. }, "held") => LockReply::Claim(Claim::Held(lock()?)),
        (LockCall::Claim { .. }, "exhausted") => LockReply::Claim(Claim::Exhausted),
        (LockCall::Read | LockCall::Renew { .. }, "lock") => LockReply::Lock(Some(lock()?)),
        (LockCall::Read | LockCall::Renew { .. }, "none") => LockReply::Lock(None),
        (LockCall::Release { .. }, "released") => LockReply::Released(true),
        (LockCall::Release { .. }, "none") => LockReply::Released(false),
        _ => return Err(bad()),
    })
}

/// One admission in a batch ([`Backend::acquire_many`]).
#[derive(Debug, Clone)]
pub struct Acquire {
    pub key: String,
    pub lease: WriteLease,
    pub ttl: Duration,
}

/// A token as a store wrote it (decimal text); anything else is a store
/// fault, reported as unavailable.
pub fn stored_token(engine: &str, v: &str) -> Result<u64, StoreError> {
    v.parse().map_err(|_| {
        StoreError::Unavailable(format!(
            "{engine}: unexpected token value {v:?} in the store"
        ))
    })
}

/// The answer of an advance script or function as (status, value):
/// `stale` with the highest, `equal`, or `raised` with the previous highest
/// (absent, or empty text, for a new key).
pub fn advance_answer(
    engine: &str,
    status: &str,
    value: Option<&str>,
) -> Result<Advance, StoreError> {
    let value = value.filter(|v| !v.is_empty());
    Ok(match status {
        "stale" => Advance::Stale {
            highest: stored_token(engine, value.unwrap_or(""))?,
        },
        "equal" => Advance::Equal,
        _ => Advance::Raised {
            previous: value.map(|v| stored_token(engine, v)).transpose()?,
        },
    })
}

/// The admission answer scripts and functions return as (status, value):
/// `stale` with the highest, `busy`, `granted`, or `lost` (the fence
/// vanished while a write waited on it: lost data).
pub fn lease_answer(
    engine: &str,
    status: &str,
    value: &str,
    lease: WriteLease,
) -> Result<LeaseOutcome, StoreError> {
    match status {
        "stale" => Ok(LeaseOutcome::Stale {
            highest: stored_token(engine, value)?,
        }),
        "busy" => Ok(busy(lease)),
        "granted" => Ok(LeaseOutcome::Granted(lease)),
        "lost" => Err(StoreError::Amnesia(
            "a fence vanished while a write was waiting on it".into(),
        )),
        other => Err(StoreError::Unavailable(format!(
            "{engine}: unexpected answer {other}"
        ))),
    }
}

/// An older lease is held: poll again shortly.
pub fn busy(lease: WriteLease) -> LeaseOutcome {
    LeaseOutcome::Busy {
        lease,
        retry_after: Duration::from_millis(5),
    }
}

/// Why the store's marker `m` cannot follow `known`, the one this replica
/// saw last: another epoch (replaced), or a lower sequence (rolled back).
fn behind(known: &Marker, m: &Marker) -> Option<String> {
    if m.epoch != known.epoch {
        Some(format!(
            "its marker changed from epoch {} to {}",
            known.epoch, m.epoch
        ))
    } else if m.seq < known.seq {
        Some(format!(
            "its marker went back from sequence {} to {} (restored backup or lagging failover)",
            known.seq, m.seq
        ))
    } else {
        None
    }
}

#[derive(Default)]
struct GuardState {
    /// The marker as this replica last saw it.
    known: Option<Marker>,
    /// The backend session the marker was last checked on, and when.
    checked_session: Option<u64>,
    checked_at: Option<std::time::Instant>,
    /// Why writes are refused, if they are.
    amnesia: Option<String>,
    /// `known` came from the state file and no check ran yet.
    from_file: bool,
    /// The ticket counter at the last confirmation: an answer to a request
    /// sent before it is not recorded in the store as a loss (the operator
    /// accepted what the store held then).
    confirmed_ticket: u64,
    /// When the store's marker was last read to record a latched loss
    /// ([`SharedStore::trip_latched`]), to do that at most once a
    /// [`MARKER_INTERVAL`] from the heartbeat.
    trip_checked_at: Option<std::time::Instant>,
}

impl GuardState {
    /// Whether the marker was checked on `session` or a later one (sessions
    /// only go up, so a later check covers it).
    fn checked_on(&self, session: u64) -> bool {
        self.checked_session.is_some_and(|c| c >= session)
    }
}

/// Acquire batches out at once: one, so that writes gather while it is out
/// and the server commits (fsyncs, runs Raft) once per gathering. Two
/// measured no better and often worse (smaller batches, more commits on
/// a server that shares the proxy's core).
const ACQUIRE_PARALLEL: usize = 1;

/// Release batches out at once: releases are lazy, so they gather longer.
const RELEASE_PARALLEL: usize = 1;

/// How long closing waits for batches still out.
const SETTLE: Duration = Duration::from_secs(2);

/// A [`FenceStore`] over a shared [`Backend`].
pub struct SharedStore<B: Backend> {
    backend: Arc<B>,
    /// Admissions and releases go to the server in batches (group commit).
    acquires: Arc<Batcher<Acquire, LeaseOutcome>>,
    releases: Arc<Batcher<(String, WriteLease), ()>>,
    /// Shared with the acquire batcher, which checks it before each batch.
    guard: Arc<Mutex<GuardState>>,
    /// Serializes marker checks (one per reconnect, not one per request).
    check_lock: tokio::sync::Mutex<()>,
    /// Highest tokens this replica saw acknowledged, to catch a store whose
    /// answers go backwards. Bounded; eviction only loses detection power.
    /// Each value carries the ticket of its recording, so that an answer is
    /// only compared with values acknowledged before its request was sent
    /// (answers to concurrent requests arrive in any order).
    known_highest: DashMap<String, (u64, u64)>,
    /// Ticket counter for `known_highest`.
    tickets: AtomicU64,
    known_capacity: usize,
    /// Confirm a reset automatically, once, at the first marker check (the
    /// operator said so at start; later losses need a new confirmation).
    accept_reset: std::sync::atomic::AtomicBool,
    /// TTL of the latest lease, to re-register one that expired while its
    /// writer was waiting.
    lease_ttl_ms: AtomicU64,
    /// Where this replica keeps the latest marker it saw, if anywhere.
    state_file: Option<StateFile>,
    /// A state file write is under way (one at a time, off the checks).
    saving: Arc<std::sync::atomic::AtomicBool>,
}

impl<B: Backend> SharedStore<B> {
    /// `batch_sizes`: observes each batch's size, by operation
    /// (`fencegate_store_batch_size`). `state_file`: this replica's record
    /// of the latest marker it saw; its marker, read here, is what the
    /// store's is compared with at the first check.
    pub fn new(
        backend: B,
        accept_reset: bool,
        batch_sizes: Option<&prometheus::HistogramVec>,
        state_file: Option<StateFile>,
    ) -> Result<Self, StoreError> {
        let backend = Arc::new(backend);
        let sizes = |op: &str| batch_sizes.map(|h| h.with_label_values(&[op]));
        let known = match &state_file {
            Some(f) => f.load()?,
            None => None,
        };
        let guard = Arc::new(Mutex::new(GuardState {
            from_file: known.is_some(),
            known,
            ..GuardState::default()
        }));
        let acquires = {
            let (b, guard) = (backend.clone(), guard.clone());
            let run: Run<Acquire, LeaseOutcome> = Arc::new(move |reqs: Vec<Acquire>| {
                let b = b.clone();
                // Amnesia latched while the batch waited (the marker check
                // ran before it was queued): nothing is sent.
                let amnesia = guard.lock().expect("guard lock").amnesia.clone();
                Box::pin(async move {
                    match amnesia {
                        Some(why) => Err(StoreError::Amnesia(why)),
                        None => b.acquire_many(&reqs).await,
                    }
                })
            });
            Batcher::new(ACQUIRE_PARALLEL, run, sizes("acquire_lease"))
        };
        let releases = {
            let b = backend.clone();
            let run: Run<(String, WriteLease), ()> =
                Arc::new(move |leases: Vec<(String, WriteLease)>| {
                    let b = b.clone();
                    Box::pin(async move {
                        b.release_many(&leases).await?;
                        Ok(leases.iter().map(|_| Ok(())).collect())
                    })
                });
            Batcher::new(RELEASE_PARALLEL, run, sizes("release_lease"))
        };
        Ok(Self {
            backend,
            acquires,
            releases,
            guard,
            check_lock: tokio::sync::Mutex::new(()),
            known_highest: DashMap::new(),
            tickets: AtomicU64::new(0),
            known_capacity: 1_000_000,
            accept_reset: std::sync::atomic::AtomicBool::new(accept_reset),
            lease_ttl_ms: AtomicU64::new(60_000),
            state_file,
            saving: Arc::default(),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    fn set_amnesia(&self, why: String) -> StoreError {
        tracing::error!(store = self.backend.kind(), reason = %why, "fence store may have lost data: refusing writes until an operator confirms");
        let mut g = self.guard.lock().expect("guard lock");
        g.amnesia.get_or_insert(why.clone());
        StoreError::Amnesia(why)
    }

    /// (whether the marker was checked on this session, whether that check
    /// is recent); fails while in amnesia.
    fn check_due(&self, session: u64) -> Result<(bool, bool), StoreError> {
        let g = self.guard.lock().expect("guard lock");
        if let Some(why) = &g.amnesia {
            return Err(StoreError::Amnesia(why.clone()));
        }
        Ok((
            g.checked_on(session),
            g.checked_at.is_some_and(|t| t.elapsed() < MARKER_INTERVAL),
        ))
    }

    /// Checks the marker on a new session, and at least every
    /// [`MARKER_INTERVAL`] (a wipe does not always drop connections); fails
    /// while in amnesia.
    async fn ensure(&self) -> Result<(), StoreError> {
        let session = self.backend.session();
        let (same_session, fresh) = self.check_due(session)?;
        if same_session && fresh {
            return Ok(());
        }
        let _one = if same_session {
            // Only the periodic re-check is due: one caller does it, the
            // others go on.
            match self.check_lock.try_lock() {
                Ok(guard) => guard,
                Err(_) => return Ok(()),
            }
        } else {
            self.check_lock.lock().await
        };
        let (same_session, fresh) = self.check_due(session)?;
        if same_session && fresh {
            return Ok(());
        }
        let (known, first_from_file) = {
            let g = self.guard.lock().expect("guard lock");
            (g.known.clone(), g.from_file && g.checked_session.is_none())
        };
        // An error names why, and the marker to record the rollback on
        // when the store went back (not when another replica recorded a
        // new epoch: that may be an operator's confirmation).
        let verdict: Result<Marker, (String, Option<(u64, Marker)>)> =
            match (known, self.backend.read_marker().await?) {
                // Never initialised silently: a wiped store looks just like a
                // new one. `--accept-store-reset` is an operator's say-so.
                (None, None) if self.accept_reset.swap(false, Ordering::AcqRel) => {
                    tracing::warn!("--accept-store-reset: marking a store that has no marker");
                    self.confirm_reset_checked().await?;
                    return Ok(());
                }
                (None, None) => return Err(StoreError::Uninitialised),
                // Another replica saw this store go back: so does this one,
                // whatever it remembers.
                (_, Some(m)) if m.trip_reason().is_some() => {
                    Err((m.trip_reason().unwrap_or_default(), None))
                }
                // Adopted as bumped, unless it changed between the read and
                // the bump (another replica recorded a loss meanwhile).
                (None, Some(m)) => match self.backend.bump_marker().await? {
                    None => Err(("the marker vanished".to_string(), None)),
                    Some(b) if b.trip_reason().is_some() => {
                        Err((b.trip_reason().unwrap_or_default(), None))
                    }
                    Some(b) if b.epoch != m.epoch => Err((
                        format!(
                            "its marker changed from epoch {} to {} while it was checked",
                            m.epoch, b.epoch
                        ),
                        None,
                    )),
                    Some(b) => Ok(b),
                },
                // Remembered from the state file, the store has none: as
                // for a store that was never marked, the start is refused
                // and names `init-store` (which a replica with this file
                // then refuses until confirmed: another epoch).
                (Some(_), None) if first_from_file => return Err(StoreError::Uninitialised),
                (Some(k), None) => Err((
                    format!(
                        "its marker (epoch {}) is missing: the data was wiped or replaced",
                        k.epoch
                    ),
                    None,
                )),
                (Some(k), Some(m)) => match behind(&k, &m) {
                    Some(why) => {
                        let trip = (m.epoch == k.epoch).then_some((k.seq, m));
                        Err((why, trip))
                    }
                    // Advanced at every check, periodic ones too (every replica
                    // checks at least every MARKER_INTERVAL, idle or not: the
                    // server's heartbeat): a store rolled back to a state older
                    // than that is behind what every running replica saw. The
                    // marker as it was before the bump must still follow the
                    // known one: the data may have changed since the read.
                    None => match self.backend.bump_marker().await? {
                        None => Err(("the marker vanished".to_string(), None)),
                        Some(b) => {
                            let before = Marker {
                                epoch: b.epoch.clone(),
                                seq: b.seq - 1,
                            };
                            match behind(&k, &before) {
                                None => Ok(b),
                                Some(why) => {
                                    let trip = (b.epoch == k.epoch).then_some((k.seq, b));
                                    Err((why, trip))
                                }
                            }
                        }
                    },
                },
            };
        match verdict {
            Ok(m) => {
                self.accept_reset.store(false, Ordering::Release);
                self.save_state(&m);
                let mut g = self.guard.lock().expect("guard lock");
                g.known = Some(m);
                g.from_file = false;
                g.checked_session = Some(session);
                g.checked_at = Some(std::time::Instant::now());
                Ok(())
            }
            Err((why, trip)) => {
                {
                    let mut g = self.guard.lock().expect("guard lock");
                    g.from_file = false;
                    g.checked_session = Some(session);
                    g.checked_at = Some(std::time::Instant::now());
                }
                let err = self.set_amnesia(why);
                if self.accept_reset.swap(false, Ordering::AcqRel) {
                    tracing::warn!("--accept-store-reset: confirming the reset");
                    self.confirm_reset_checked().await?;
                    return Ok(());
                }
                if let Some((seen, found)) = trip {
                    self.trip(seen, found).await;
                }
                Err(err)
            }
        }
    }

    /// Records this replica's marker in its state file, if it keeps one,
    /// in a task of its own: a slow disk must not hold the marker check
    /// (or the requests waiting on it). One write at a time; a check while
    /// one is under way skips its own (the next check, about a second
    /// later, writes again). A failure is logged, not fatal: the file only
    /// narrows what a restart can miss.
    fn save_state(&self, m: &Marker) {
        let Some(f) = &self.state_file else { return };
        if self.saving.swap(true, Ordering::AcqRel) {
            return;
        }
        let (f, m, saving) = (f.clone(), m.clone(), self.saving.clone());
        tokio::spawn(async move {
            if let Err(e) = f.save(&m).await {
                tracing::warn!(path = %f.path.display(), error = %e, "store_state_file not written");
            }
            saving.store(false, Ordering::Release);
        });
    }

    /// Records in the store that it went back: replaces its marker `found`
    /// (which must still be the stored one, compare-and-set) with a tripped
    /// one that every replica refuses, restarted or new, until an operator
    /// confirms. `seen`: the sequence this replica saw before. Best effort:
    /// this replica refuses writes whatever the outcome.
    async fn trip(&self, seen: u64, mut found: Marker) {
        for _ in 0..5 {
            let tripped = Marker::tripped(seen, found.seq);
            match self.backend.replace_marker(Some(&found), &tripped).await {
                Ok(m) if m.epoch == tripped || m.trip_reason().is_some() => {
                    tracing::error!(store = self.backend.kind(), seen, found = found.seq, "recorded in the store that it went back: every replica refuses writes until an operator confirms");
                    return;
                }
                // Bumped meanwhile (a replica that has not seen it yet):
                // the same epoch still behind is tripped on the next try.
                Ok(m) if m.epoch == found.epoch && m.seq < seen => found = m,
                // Another epoch: an operator's confirmation, not ours to undo.
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(store = self.backend.kind(), error = %e, "could not record the rollback in the store");
                    return;
                }
            }
        }
    }

    /// With amnesia latched (by a key's answer, a highest that went down,
    /// or a record that did not land): records it in the store as
    /// [`trip`](Self::trip) does, unless the store says so already or an
    /// operator confirmed a new epoch meanwhile. From the heartbeat at
    /// most once a [`MARKER_INTERVAL`]; `now` for a loss just found.
    async fn trip_latched(&self, now: bool) {
        let known = {
            let mut g = self.guard.lock().expect("guard lock");
            if g.amnesia.is_none()
                || (!now
                    && g.trip_checked_at
                        .is_some_and(|t| t.elapsed() < MARKER_INTERVAL))
            {
                return;
            }
            g.trip_checked_at = Some(std::time::Instant::now());
            g.known.clone()
        };
        let Some(k) = known else { return };
        match self.backend.read_marker().await {
            Ok(Some(m)) if m.trip_reason().is_none() && m.epoch == k.epoch => {
                self.trip(k.seq.max(m.seq + 1), m).await
            }
            _ => {}
        }
    }

    /// The ticket to take before sending a request whose answer will be
    /// witnessed.
    fn ticket(&self) -> u64 {
        self.tickets.load(Ordering::Acquire)
    }

    /// Records an acknowledged token; a store answer that contradicts what
    /// it acknowledged before the request was sent means lost data.
    fn witness_now(
        &self,
        key: &str,
        sent: u64,
        outcome_highest: Option<u64>,
        admitted: Option<u64>,
    ) -> Result<(), StoreError> {
        let known = self.known_highest.get(key).map(|v| *v);
        if let Some((k, ack)) = known.filter(|(_, ack)| *ack <= sent) {
            let _ = ack;
            if let Some(t) = admitted {
                if t < k {
                    return Err(self.set_amnesia(format!(
                        "it admitted token {t} for {key} after acknowledging {k}"
                    )));
                }
            }
            if let Some(h) = outcome_highest {
                if h < k {
                    return Err(self.set_amnesia(format!(
                        "its highest token for {key} went down from {k} to {h}"
                    )));
                }
            }
        }
        let new = admitted.into_iter().chain(outcome_highest).max();
        if let Some(v) = new {
            if known.is_none() && self.known_highest.len() >= self.known_capacity {
                let mut budget = self.known_capacity / 8;
                self.known_highest.retain(|_, _| {
                    budget = budget.saturating_sub(1);
                    budget == 0
                });
            }
            let ack = self.tickets.fetch_add(1, Ordering::AcqRel) + 1;
            self.known_highest
                .entry(key.to_string())
                .and_modify(|x| {
                    if v > x.0 {
                        *x = (v, ack);
                    }
                })
                .or_insert((v, ack));
        }
        Ok(())
    }

    /// [`witness_now`](Self::witness_now), and a loss it finds recorded in
    /// the store's marker at once, so that a replica that starts next
    /// refuses too.
    async fn witness(
        &self,
        key: &str,
        sent: u64,
        outcome_highest: Option<u64>,
        admitted: Option<u64>,
    ) -> Result<(), StoreError> {
        let r = self.witness_now(key, sent, outcome_highest, admitted);
        // Not for an answer to a request sent before the last
        // confirmation: the operator accepted what the store held then.
        let before_confirm = sent < self.guard.lock().expect("guard lock").confirmed_ticket;
        if r.is_err() && !before_confirm {
            self.trip_latched(true).await;
        }
        r
    }

    async fn witness_lease(
        &self,
        key: &str,
        sent: u64,
        outcome: &LeaseOutcome,
    ) -> Result<(), StoreError> {
        match outcome {
            LeaseOutcome::Stale { highest } => self.witness(key, sent, Some(*highest), None).await,
            LeaseOutcome::Granted(l) | LeaseOutcome::Busy { lease: l, .. } => {
                self.witness(key, sent, None, Some(l.token)).await
            }
        }
    }

    /// A lease operation on the backend as admissions run it: refused while
    /// in amnesia (the marker checked first), its answer compared with what
    /// was acknowledged before it was sent. (`call` is lazy: nothing is
    /// sent before the marker check.)
    async fn guarded(
        &self,
        key: &str,
        call: impl std::future::Future<Output = Result<LeaseOutcome, StoreError>>,
    ) -> Result<LeaseOutcome, StoreError> {
        self.ensure().await?;
        let sent = self.ticket();
        let outcome = call.await.map_err(|e| self.latch(e))?;
        self.recheck().await?;
        self.witness_lease(key, sent, &outcome).await?;
        Ok(outcome)
    }

    /// After a call: if a new connection was made since the marker was last
    /// checked (this call's or another's), the marker is checked before the
    /// answer is used. The call may have gone to a server that restarted
    /// from a backup: its answer is from the rolled-back data.
    async fn recheck(&self) -> Result<(), StoreError> {
        let session = self.backend.session();
        if self.guard.lock().expect("guard lock").checked_on(session) {
            return Ok(());
        }
        self.ensure().await
    }

    /// A lock-service operation as admissions run theirs: refused while in
    /// amnesia, and a grant witnessed like an admitted token (a later
    /// answer below it means the store lost data).
    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        self.ensure().await?;
        let sent = self.ticket();
        let reply = self
            .backend
            .lock(key, call)
            .await
            .map_err(|e| self.latch(e))?;
        self.recheck().await?;
        if let LockReply::Claim(Claim::Granted { token, .. }) = &reply {
            self.witness(key, sent, None, Some(*token)).await?;
        }
        Ok(reply)
    }

    /// [`FenceStore::confirm_reset`], with the marker-check lock held.
    async fn confirm_reset_checked(&self) -> Result<(), StoreError> {
        // Write back every fence this replica knows, then a new marker.
        let known: Vec<(String, u64)> = self
            .known_highest
            .iter()
            .map(|e| (e.key().clone(), e.value().0))
            .collect();
        for (key, token) in &known {
            self.backend.advance(key, *token).await?;
        }
        // If another replica confirmed already, join its new marker instead
        // of replacing it (which would put that replica in amnesia).
        let known_marker = self.guard.lock().expect("guard lock").known.clone();
        let old_epoch = known_marker.as_ref().map(|k| &k.epoch);
        let mut recorded = None;
        for _ in 0..20 {
            let current = self.backend.read_marker().await?;
            // Join another replica's confirmation, never a record that the
            // store went back.
            if let Some(m) = current
                .as_ref()
                .filter(|m| Some(&m.epoch) != old_epoch && m.trip_reason().is_none())
            {
                recorded = Some(m.clone());
                break;
            }
            // Compare-and-set: if two replicas confirm at once, the second
            // joins the first's marker instead of overwriting it; if another
            // replica advanced the old marker meanwhile, read it again.
            let m = self
                .backend
                .replace_marker(current.as_ref(), &crate::id::unique_id())
                .await?;
            if Some(&m.epoch) != old_epoch && m.trip_reason().is_none() {
                recorded = Some(m);
                break;
            }
        }
        let m = recorded.ok_or_else(|| {
            StoreError::Unavailable(
                "the marker kept changing while the reset was confirmed".to_string(),
            )
        })?;
        tracing::warn!(store = self.backend.kind(), epoch = %m.epoch, restored = known.len(), "store reset confirmed: known fences written back, new marker recorded");
        self.save_state(&m);
        let mut g = self.guard.lock().expect("guard lock");
        g.known = Some(m);
        g.amnesia = None;
        g.from_file = false;
        g.confirmed_ticket = self.tickets.load(Ordering::Acquire);
        g.checked_session = Some(self.backend.session());
        g.checked_at = Some(std::time::Instant::now());
        Ok(())
    }

    /// A backend's own report of lost data latches amnesia like ours.
    fn latch(&self, e: StoreError) -> StoreError {
        match e {
            StoreError::Amnesia(why) => self.set_amnesia(why),
            other => other,
        }
    }
}

fn wrong_reply(r: LockReply) -> StoreError {
    StoreError::Unavailable(format!("unexpected lease answer {r:?}"))
}

fn no_marks() -> StoreError {
    StoreError::Unavailable("a shared store keeps leases, not in-flight marks".into())
}

#[async_trait]
impl<B: Backend> FenceStore for SharedStore<B> {
    fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    fn exclusive(&self) -> bool {
        false
    }

    fn start_state(&self) -> StartState {
        // In-flight writes of a crashed replica hold leases in the store
        // until they expire: no local recovery window is needed.
        StartState::Clean
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.backend.highest(key).await
    }

    async fn confirm_highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.ensure().await?;
        let sent = self.ticket();
        let h = self.backend.highest(key).await.map_err(|e| self.latch(e))?;
        self.recheck().await?;
        if let Some(h) = h {
            self.witness(key, sent, Some(h), None).await?;
        }
        Ok(h)
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        self.ensure().await?;
        let sent = self.ticket();
        let a = self
            .backend
            .advance(key, token)
            .await
            .map_err(|e| self.latch(e))?;
        self.recheck().await?;
        match a {
            Advance::Stale { highest } => self.witness(key, sent, Some(highest), None).await?,
            Advance::Raised { .. } | Advance::Equal => {
                self.witness(key, sent, None, Some(token)).await?
            }
        }
        Ok(a)
    }

    // In-flight marks are for exclusive stores; a shared store keeps
    // leases instead, and the fence never asks it for marks.
    async fn advance_marked(&self, key: &str, token: u64) -> Result<(Advance, u64), StoreError> {
        let _ = (key, token);
        Err(no_marks())
    }

    async fn mark_in_flight(&self, key: &str, token: u64) -> Result<u64, StoreError> {
        let _ = (key, token);
        Err(no_marks())
    }

    fn next_mark(&self) -> u64 {
        0
    }

    async fn rotate_marks(
        &self,
        keys: Vec<(String, u64)>,
        watermark: u64,
    ) -> Result<Vec<u64>, StoreError> {
        let _ = (keys, watermark);
        Err(no_marks())
    }

    fn in_flight_at_crash(&self) -> Option<Vec<super::api::CrashedKey>> {
        Some(Vec::new())
    }

    fn key_mapping_at_open(&self) -> Option<u64> {
        None
    }

    async fn record_key_mapping(&self, fingerprint: u64) -> Result<(), StoreError> {
        let _ = fingerprint;
        Ok(())
    }

    fn in_flight_marks(&self) -> u64 {
        0
    }

    async fn acquire_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_ttl_ms.store(
            u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let req = Acquire {
            key: key.to_string(),
            lease: lease.clone(),
            ttl,
        };
        // On a witness failure the caller's guard releases the lease.
        self.guarded(key, self.acquires.call(key, req)).await
    }

    async fn poll_lease(&self, key: &str, lease: &WriteLease) -> Result<LeaseOutcome, StoreError> {
        let ttl = Duration::from_millis(self.lease_ttl_ms.load(Ordering::Relaxed));
        self.guarded(key, self.backend.poll(key, lease, ttl)).await
    }

    async fn renew_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.guarded(key, self.backend.renew(key, lease, ttl)).await
    }

    async fn release_lease(&self, key: &str, lease: &WriteLease) -> Result<(), StoreError> {
        // Batched per lease (a lease released twice at once is sent once
        // per batch).
        self.releases
            .call(&lease.id, (key.to_string(), lease.clone()))
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.backend.ping().await?;
        self.ensure().await
    }

    async fn check_marker(&self) -> Result<(), StoreError> {
        let r = self.ensure().await;
        if let Err(StoreError::Amnesia(_)) = &r {
            self.trip_latched(false).await;
        }
        r
    }

    async fn claim_lock(
        &self,
        key: &str,
        id: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        match self.lock(key, LockCall::Claim { id, holder, ttl }).await? {
            LockReply::Claim(c) => Ok(c),
            other => Err(wrong_reply(other)),
        }
    }

    async fn read_lock(&self, key: &str) -> Result<Option<Lock>, StoreError> {
        match self.lock(key, LockCall::Read).await? {
            LockReply::Lock(l) => Ok(l),
            other => Err(wrong_reply(other)),
        }
    }

    async fn renew_lock(
        &self,
        key: &str,
        id: &str,
        ttl: Duration,
    ) -> Result<Option<Lock>, StoreError> {
        match self.lock(key, LockCall::Renew { id, ttl }).await? {
            LockReply::Lock(l) => Ok(l),
            other => Err(wrong_reply(other)),
        }
    }

    async fn release_lock(&self, key: &str, id: &str) -> Result<bool, StoreError> {
        match self.lock(key, LockCall::Release { id }).await? {
            LockReply::Released(r) => Ok(r),
            other => Err(wrong_reply(other)),
        }
    }

    async fn initialise(&self) -> Result<bool, StoreError> {
        self.backend.ping().await?;
        if self.backend.read_marker().await?.is_some() {
            return Ok(false);
        }
        let m = self.backend.create_marker(&crate::id::unique_id()).await?;
        tracing::info!(store = self.backend.kind(), epoch = %m.epoch, "fence store initialised");
        Ok(true)
    }

    async fn close_clean(&self) -> Result<(), StoreError> {
        self.acquires.settle(SETTLE).await;
        self.releases.settle(SETTLE).await;
        Ok(())
    }

    fn amnesia(&self) -> Option<String> {
        self.guard.lock().expect("guard lock").amnesia.clone()
    }

    async fn confirm_reset(&self) -> Result<(), StoreError> {
        // Not while a marker check runs: it would record the old marker
        // after the new one.
        let _one = self.check_lock.lock().await;
        self.confirm_reset_checked().await
    }
}

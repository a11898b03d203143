//! Redis Cluster (`redis+cluster://`, `rediss+cluster://`): the cluster's
//! topology found from the seeds and followed through `MOVED` and `ASK`
//! (redis-rs's cluster client), and the fence keys spread over
//! [`GROUPS`] groups.
//!
//! A group is one hash slot: every key of its fence keys carries its hash
//! tag ([`Keyspace::group`]), so one script may touch any of them (a
//! batch's admissions), and its amnesia marker lives in the same slot.
//! Resharding moves a group whole, marker and all: what detects a loss
//! moves with what it protects. Each group is a
//! [`SharedStore`](crate::store::shared::SharedStore) of its own (its
//! marker checked, its highest tokens witnessed, its batches, its latch
//! in amnesia), so a shard that comes back empty refuses only its groups'
//! writes until an operator confirms.
//!
//! The groups' slots are spread evenly over the slot range (group `g`'s
//! tag is the first `fg<g>.<n>` whose slot falls in the `g`th of
//! [`GROUPS`] equal ranges), so a cluster whose primaries own ranges of
//! slots (as `redis-cli --cluster create` makes them) gets its groups
//! evenly. A fence key belongs to the group whose range holds the key's
//! own slot. Neither mapping may ever change: it says where a key's fence
//! is.
//!
//! Each call runs on the primary of its group's slot, followed there (in
//! the same round trip) by `WAIT` for the replicas wanted: the replicas
//! of that primary, which is what a failover of that shard promotes.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, FromRedisValue, Script, Value};

use crate::store::api::{Replicas, StoreError};
use crate::store::shared::dial::{dial_bound, Slot};

use super::backend::{replicas_seen, Calls};
use super::conn::{connect_failed, replication};
use super::scripts::{Keyspace, Scripts};

/// How many groups the fence keys are spread over. Fixed: a key's group
/// is where its fence is.
pub const GROUPS: usize = 64;

/// Redis Cluster's slot count.
const SLOTS: usize = 16384;

/// The group a fence key belongs to.
pub fn group_of(key: &str) -> usize {
    usize::from(slot_of(key.as_bytes())) * GROUPS / SLOTS
}

/// Redis Cluster's slot of a key without a hash tag (CRC16/XMODEM, as the
/// cluster computes it).
fn slot_of(key: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key) % SLOTS as u16
}

/// Group `g`'s slot.
fn group_slot(g: usize) -> u16 {
    slot_of(group_tag(g).trim_matches(['{', '}']).as_bytes())
}

/// `CLUSTER SLOTS`'s answer: each range with its primary's `host:port`.
fn slot_ranges(v: Value) -> Option<Topology> {
    let Value::Array(ranges) = v else { return None };
    ranges
        .into_iter()
        .map(|r| {
            let Value::Array(f) = r else { return None };
            let mut f = f.into_iter();
            let start: u16 = parse(f.next()?).ok()?;
            let end: u16 = parse(f.next()?).ok()?;
            let Value::Array(primary) = f.next()? else {
                return None;
            };
            let mut primary = primary.into_iter();
            let host: String = parse(primary.next()?).ok()?;
            let port: u16 = parse(primary.next()?).ok()?;
            let host = match host.as_str() {
                // A node that announces no address: reached at the one
                // its peers know it by, which it does not say here.
                "" | "?" => "?".to_string(),
                h if h.contains(':') => format!("[{h}]"),
                h => h.to_string(),
            };
            Some((start, end, format!("{host}:{port}")))
        })
        .collect()
}

/// Group `g`'s hash tag, braces included.
pub fn group_tag(g: usize) -> String {
    let range = (g * SLOTS / GROUPS)..((g + 1) * SLOTS / GROUPS);
    (0u32..)
        .map(|n| format!("fg{g}.{n}"))
        .find(|t| range.contains(&usize::from(slot_of(t.as_bytes()))))
        .map(|t| format!("{{{t}}}"))
        .expect("every range holds some tag's slot")
}

/// How to reach the cluster.
pub struct ClusterOptions<'a> {
    pub cluster: &'a crate::config::RedisCluster,
    /// Replaces the URL's password.
    pub password: Option<&'a crate::config::Secret>,
    /// TLS (`rediss+cluster://`): the CA and client certificate, if given.
    pub pem: Option<crate::tls::StorePem>,
    /// Bounds connects and every command.
    pub timeout: Duration,
    /// Replicas a change must reach on its shard (`None`: one while the
    /// shard's primary has a replica online).
    pub replicas_to_wait: Option<u32>,
}

/// The connection to the cluster, shared by its groups.
pub struct Cluster {
    client: redis::cluster::ClusterClient,
    /// One connection per runtime (see [`crate::slot::slot`]), made at its
    /// first call: its driver task lives on the runtime that made it.
    conns: dashmap::DashMap<usize, (RuntimeSlot, Held)>,
    /// Connections made: part of every group's session, so that the
    /// first answer on a new connection is used only after the group's
    /// marker was checked.
    made: AtomicU64,
    born: std::time::Instant,
    timeout: Duration,
    replicas_to_wait: Option<u32>,
    /// INFO was refused (an ACL without it), and that was said.
    info_refused: AtomicBool,
    scripts: Scripts,
    /// Who serves each slot range, as last read (`CLUSTER SLOTS`; `None`:
    /// no node told), and when: kept a second, so that the groups asking
    /// at once share one read, or one failure.
    topology: tokio::sync::Mutex<Option<(std::time::Instant, Option<Arc<Topology>>)>>,
}

/// A runtime's connection, or its dial going on; a connection with when
/// its dial ended.
type RuntimeSlot = Arc<tokio::sync::Mutex<Slot<(std::time::Instant, ClusterConnection)>>>;

/// A runtime's connection as its calls use it: the slot holds the bare
/// connection, and this, its number and answers.
type Held = Arc<tokio::sync::Mutex<Option<Conn>>>;

/// A connection to the cluster, numbered (so that a failed call drops the
/// connection it used and never a newer one), with since when its calls
/// fail (ms since the cluster's `born`: its first failed call since its
/// last answer; `u64::MAX` while they do not).
#[derive(Clone)]
struct Conn {
    made: u64,
    conn: ClusterConnection,
    failing_since: Arc<AtomicU64>,
}

/// Slot ranges and the `host:port` of the primary serving each.
type Topology = Vec<(u16, u16, String)>;

impl Cluster {
    pub fn new(o: ClusterOptions<'_>) -> Result<Arc<Self>, String> {
        let scheme = if o.pem.is_some() { "rediss" } else { "redis" };
        let seeds: Vec<String> = o
            .cluster
            .seeds
            .iter()
            .map(|(h, p)| {
                if h.contains(':') {
                    format!("{scheme}://[{h}]:{p}")
                } else {
                    format!("{scheme}://{h}:{p}")
                }
            })
            .collect();
        let mut b = ClusterClientBuilder::new(seeds)
            .connection_timeout(o.timeout / 4)
            .response_timeout(o.timeout);
        if let Some(user) = &o.cluster.user {
            b = b.username(user);
        }
        if let Some(pw) = o.password.or(o.cluster.password.as_ref()) {
            b = b.password(pw.expose());
        }
        if let Some(pem) = o.pem {
            b = b.tls(redis::TlsMode::Secure).certs(redis::TlsCertificates {
                client_tls: pem
                    .client
                    .map(|(client_cert, client_key)| redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }),
                root_cert: pem.ca,
            });
        }
        Ok(Arc::new(Self {
            client: b.build().map_err(|e| e.to_string())?,
            conns: dashmap::DashMap::new(),
            made: AtomicU64::new(0),
            born: std::time::Instant::now(),
            timeout: o.timeout,
            replicas_to_wait: o.replicas_to_wait,
            info_refused: AtomicBool::new(false),
            scripts: Scripts::guarded(),
            topology: tokio::sync::Mutex::new(None),
        }))
    }

    /// Who serves each slot range, as a primary of the cluster says: asked
    /// of a few groups' primaries in turn (spread over the slot range), so
    /// that one shard down does not hide the others.
    async fn topology(&self) -> Option<Arc<Topology>> {
        let mut kept = self.topology.lock().await;
        if let Some((at, t)) = kept.as_ref() {
            if at.elapsed() < Duration::from_secs(1) {
                return t.clone();
            }
        }
        let read = async {
            let mut c = self.connection().await.ok()?.conn;
            for g in [0, GROUPS / 3, 2 * GROUPS / 3] {
                let mut p = redis::pipe();
                p.cmd("CLUSTER").arg("SLOTS");
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(
                    group_slot(g),
                    SlotAddr::Master,
                ));
                // A third of the budget each: a primary that hangs must not
                // keep the others from being asked.
                let asked =
                    tokio::time::timeout(self.timeout / 3, c.route_pipeline(p, 0, 1, route)).await;
                let Ok(Ok(v)) = asked else {
                    continue;
                };
                if let Some(t) = v.into_iter().next().and_then(slot_ranges) {
                    return Some(Arc::new(t));
                }
            }
            None
        };
        // One store timeout in all, so that a report never waits longer.
        let t = tokio::time::timeout(self.timeout, read)
            .await
            .ok()
            .flatten();
        *kept = Some((std::time::Instant::now(), t.clone()));
        t
    }

    /// This runtime's connection, made now if it has none.
    ///
    /// A new connection connects to every node of the cluster, and waits
    /// on one that hangs (its connect, then its `PING`, each up to the
    /// store timeout): the dial runs on in a task of its own
    /// ([`Slot`]), so that a call that gives up leaves it going for the
    /// next, and a replica started while a shard hangs gets a connection
    /// to the others.
    async fn connection(&self) -> Result<Conn, StoreError> {
        let (slot, held) = self.runtime_slot();
        let mut slot = slot.lock_owned().await;
        let mut held = held.lock_owned().await;
        if let (Some(c), true) = (held.as_ref(), slot.is_ready(|_| true)) {
            return Ok(c.clone());
        }
        let client = self.client.clone();
        let (bound, timeout) = (dial_bound(self.timeout), self.timeout);
        let ((at, c), _) = slot
            .take(
                "redis cluster",
                tokio::time::Instant::now() + self.timeout,
                // A dial that ended long before a call came for it holds
                // the cluster's view of then: made anew.
                |(at, _)| at.elapsed() < timeout,
                || {
                    let client = client.clone();
                    async move {
                        let c = tokio::time::timeout(bound, client.get_async_connection())
                            .await
                            .map_err(|_| unavailable("connect to the cluster timed out"))?
                            .map_err(|e| connect_failed(e, "redis cluster"))?;
                        Ok((std::time::Instant::now(), c))
                    }
                },
            )
            .await?;
        *slot = Slot::Ready((at, c.clone()));
        let made = Conn {
            made: self.made.fetch_add(1, Ordering::AcqRel) + 1,
            conn: c,
            failing_since: Arc::new(AtomicU64::new(u64::MAX)),
        };
        *held = Some(made.clone());
        Ok(made)
    }

    fn runtime_slot(&self) -> (RuntimeSlot, Held) {
        let slot = crate::slot::slot();
        match self.conns.get(&slot) {
            Some(s) => s.value().clone(),
            None => self.conns.entry(slot).or_default().value().clone(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// A call on `c` got an answer (any: a server's error is one).
    fn answered(&self, c: &Conn) {
        c.failing_since.store(u64::MAX, Ordering::Relaxed);
    }

    /// Drops `c` after a call on it failed other than by the server's own
    /// answer (a dropped or refused connection, a timeout), when
    /// [`stale`] says so: the next call on this runtime connects anew from
    /// the seeds. redis-rs's cluster client repairs its connections
    /// itself, but not always: after every node restarted at once it was
    /// seen to time out every call from then on.
    fn discard(&self, c: &Conn) {
        let now = self.now_ms();
        // Since its first failure, not its last answer: a connection idle
        // for long is not a stuck one.
        let since = c.failing_since.fetch_min(now, Ordering::Relaxed).min(now);
        if !stale(now - since, self.timeout.as_millis() as u64) {
            return;
        }
        let (slot, held) = self.runtime_slot();
        if let (Ok(mut slot), Ok(mut held)) = (slot.try_lock_owned(), held.try_lock_owned()) {
            if held.as_ref().is_some_and(|h| h.made == c.made) {
                *held = None;
                slot.forget();
            }
        }
    }

    /// `WAIT`'s own timeout: half the store timeout, so that the reply
    /// (too few replicas) arrives before the call itself times out.
    fn wait_ms(&self) -> u64 {
        (self.timeout.as_millis() as u64 / 2).max(1)
    }
}

/// Whether a connection whose calls have all failed for `failing` ms
/// (since the first failure after its last answer) is to be dropped
/// (`timeout`: the store timeout, in ms). Any answer on it resets the
/// count: a connection whose calls to one hung shard fail while its
/// others are answered is kept. One stuck alone is dropped whatever the
/// other runtimes' connections do: the heartbeat's, stuck after every
/// node restarted while a worker's answered, checked no group's marker.
fn stale(failing: u64, timeout: u64) -> bool {
    failing >= 2 * timeout
}

/// One group of a cluster: its keys, its slot, and what its shard's
/// primary last said of itself.
pub struct ClusterGroup {
    cluster: Arc<Cluster>,
    keys: Keyspace,
    slot: u16,
    route: Route,
    /// Bumped when the group's slot is found served by another primary
    /// (a failover, a reshard) or by the same one restarted: the marker is
    /// checked again before the next call's answer counts.
    session: AtomicU64,
    /// The serving primary's `run_id`, as last seen.
    run_id: Mutex<Option<String>>,
    /// Replicas online at that primary, as last seen (see
    /// [`ClusterGroup::replicas_wanted`]).
    online: AtomicU32,
    /// A wait failed: the next count read replaces the one kept, even if
    /// lower (a replica gone for good stops failing every call).
    recount: AtomicBool,
    /// The group's marker as the last answer carried it: an answer with
    /// none, another epoch or a lower sequence starts a new session, so
    /// that the marker is checked before that answer is used.
    /// `None` until the first answer; then the marker it carried, if any.
    marker_seen: Mutex<Option<Option<(String, String)>>>,
    last_wait: AtomicU64,
    failed_waits: AtomicU64,
}

impl ClusterGroup {
    pub fn new(cluster: Arc<Cluster>, g: usize) -> Self {
        let slot = group_slot(g);
        Self {
            route: Route::new(slot, SlotAddr::Master),
            slot,
            keys: Keyspace::group(group_tag(g)),
            cluster,
            session: AtomicU64::new(0),
            run_id: Mutex::new(None),
            online: AtomicU32::new(0),
            recount: AtomicBool::new(false),
            marker_seen: Mutex::new(None),
            last_wait: AtomicU64::new(u64::MAX),
            failed_waits: AtomicU64::new(0),
        }
    }

    fn to_primary(&self) -> SingleNodeRoutingInfo {
        SingleNodeRoutingInfo::SpecificNode(self.route)
    }

    /// Replicas a call waits for: the setting, or one while the shard's
    /// primary reports one online (read every second, with the marker).
    fn replicas_wanted(&self) -> u32 {
        self.cluster
            .replicas_to_wait
            .unwrap_or_else(|| self.online.load(Ordering::Relaxed).min(1))
    }

    /// A pipeline on the group's primary, once more after loading the
    /// scripts if that primary does not have them (a promoted replica, a
    /// node that joined by a reshard). A command's own error comes back
    /// as its value (`Value::ServerError`).
    async fn on_primary(
        &self,
        p: &redis::Pipeline,
        count: usize,
    ) -> Result<Vec<Value>, StoreError> {
        let conn = self.cluster.connection().await?;
        let mut c = conn.conn.clone();
        let (mut loaded, mut reconnected) = (false, false);
        loop {
            let no_script = |e: &redis::RedisError| {
                e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
            };
            // Bounded below the store timeout, so that a connection that
            // stopped answering is dropped here before the caller gives up.
            let bound = self.cluster.timeout.mul_f64(0.9);
            let answer = tokio::time::timeout(
                bound,
                c.route_pipeline(p.clone(), 0, count, self.to_primary()),
            )
            .await
            .unwrap_or_else(|_| {
                Err(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "no answer",
                    format!("within {bound:?}"),
                )))
            });
            match &answer {
                Err(e) if !matches!(e.kind(), redis::ErrorKind::Server(_)) => {
                    self.cluster.discard(&conn);
                    // A connection the server closed (a restart): made
                    // once more, as on a lone primary; the client connects
                    // to that node again. Its answer counts only after the
                    // marker check: a new session.
                    if e.is_connection_dropped() && !e.is_timeout() && !reconnected {
                        reconnected = true;
                        self.session.fetch_add(1, Ordering::AcqRel);
                        continue;
                    }
                }
                _ => self.cluster.answered(&conn),
            }
            let missing = match &answer {
                Ok(v) => {
                    matches!(v.first(), Some(Value::ServerError(e)) if no_script(&e.clone().into()))
                }
                Err(e) => no_script(e),
            };
            if !missing || loaded {
                return answer.map_err(|e| self.failed(e));
            }
            loaded = true;
            // SCRIPT LOAD goes to every primary.
            for s in self.cluster.scripts.all() {
                s.load_async(&mut c).await.map_err(|e| self.failed(e))?;
            }
        }
    }

    /// The marker an answer carried (`None`: the group has none there).
    /// Anything but the marker seen before, or a later sequence of it,
    /// starts a new session: the answer is used only once the marker was
    /// checked (`SharedStore::recheck`).
    fn saw_marker(&self, epoch: Option<String>, seq: Option<String>) {
        let now = epoch.zip(seq);
        let mut seen = self.marker_seen.lock().expect("marker seen");
        let same = match (&*seen, &now) {
            // The first answer: the session's own check covers it.
            (None, Some(_)) => true,
            (Some(Some((e0, s0))), Some((e1, s1))) => {
                e0 == e1 && s1.parse::<u64>().ok() >= s0.parse::<u64>().ok()
            }
            _ => false,
        };
        if !same {
            self.session.fetch_add(1, Ordering::AcqRel);
        }
        *seen = Some(now);
    }

    /// Runs `p` (its first `count` commands answered), then `WAIT` for the
    /// replicas wanted, in one round trip on the group's primary; the
    /// answers without the wait's.
    async fn waited(&self, mut p: redis::Pipeline, count: usize) -> Result<Vec<Value>, StoreError> {
        let wanted = self.replicas_wanted();
        let wait_ms = self.cluster.wait_ms();
        if wanted > 0 {
            p.cmd("WAIT").arg(wanted).arg(wait_ms);
        }
        let total = count + usize::from(wanted > 0);
        let answered = self.on_primary(&p, total).await;
        let mut values = match answered {
            Ok(v) if v.len() == total => v,
            Ok(v) => {
                self.last_wait.store(u64::MAX, Ordering::Relaxed);
                return Err(unavailable(format!(
                    "{} answers to {total} commands",
                    v.len()
                )));
            }
            Err(e) => {
                self.last_wait.store(u64::MAX, Ordering::Relaxed);
                return Err(e);
            }
        };
        // A command's own error fails the call (the lone primary's
        // pipeline fails on any).
        if let Some(Value::ServerError(e)) =
            values.iter().find(|v| matches!(v, Value::ServerError(_)))
        {
            return Err(self.failed(e.clone().into()));
        }
        if wanted > 0 {
            let confirmed: u32 = parse(values.pop().expect("counted"))?;
            self.last_wait.store(
                u64::from(wanted) << 32 | u64::from(confirmed),
                Ordering::Relaxed,
            );
            if confirmed < wanted {
                self.failed_waits.fetch_add(1, Ordering::Relaxed);
                self.recount.store(true, Ordering::Relaxed);
                self.session.fetch_add(1, Ordering::AcqRel);
                return Err(unavailable(format!(
                    "{confirmed} of {wanted} replicas of the shard confirmed the call within {wait_ms} ms (store_replicas_to_wait, docs/stores.md)"
                )));
            }
        }
        Ok(values)
    }

    fn failed(&self, e: redis::RedisError) -> StoreError {
        // Whatever broke, the marker is checked again before the next
        // answer counts: the slot may be served by another node now.
        self.session.fetch_add(1, Ordering::AcqRel);
        if e.code() == Some("NOPERM") {
            return StoreError::Refused(format!(
                "redis cluster: {e} (docs/stores.md lists the ACL fencegate needs)"
            ));
        }
        unavailable(e)
    }
}

/// The cluster's own prefix on a failure (the lone primary's says
/// `redis:`).
fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("redis cluster: {e}"))
}

fn parse<T: FromRedisValue>(v: Value) -> Result<T, StoreError> {
    T::from_redis_value(v).map_err(unavailable)
}

#[async_trait::async_trait]
impl Calls for ClusterGroup {
    fn kind(&self) -> &'static str {
        "redis-cluster"
    }

    fn timeout(&self) -> Duration {
        self.cluster.timeout
    }

    fn session(&self) -> u64 {
        // Both only go up: so does their sum.
        self.session.load(Ordering::Acquire) + self.cluster.made.load(Ordering::Acquire)
    }

    fn replicas(&self) -> Option<Replicas> {
        replicas_seen(&self.last_wait, &self.failed_waits)
    }

    fn keys(&self) -> &Keyspace {
        &self.keys
    }

    fn scripts(&self) -> &Scripts {
        &self.cluster.scripts
    }

    async fn serving(&self) -> Option<String> {
        let t = self.cluster.topology().await?;
        t.iter()
            .find(|(a, b, _)| (*a..=*b).contains(&self.slot))
            .map(|(_, _, node)| node.clone())
    }

    /// A command other than a script (a fence read, the marker read): the
    /// group's marker read with it, the sync key written and the replicas
    /// waited for, as a script's guard does.
    async fn query<T: FromRedisValue + Send>(&self, cmd: Cmd) -> Result<T, StoreError> {
        let mut p = redis::pipe();
        p.add_command(cmd)
            .cmd("HMGET")
            .arg(self.keys.marker())
            .arg("epoch")
            .arg("seq")
            .cmd("SET")
            .arg(self.keys.sync())
            .arg(1);
        let mut v = self.waited(p, 3).await?.into_iter();
        let (answer, marker) = (v.next().expect("counted"), v.next().expect("counted"));
        let marker: Vec<Option<String>> = parse(marker)?;
        let mut m = marker.into_iter();
        self.saw_marker(m.next().flatten(), m.next().flatten());
        parse(answer)
    }

    /// A script, in its guarded form (see `scripts::GUARD`): the group's
    /// marker and sync keys after the script's own, the marker carried
    /// back with the answer.
    async fn script<T: FromRedisValue + Send>(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
    ) -> Result<T, StoreError> {
        let mut p = redis::pipe();
        p.cmd("EVALSHA")
            .arg(script.get_hash())
            .arg(keys.len() + 2)
            .arg(keys)
            .arg(self.keys.marker())
            .arg(self.keys.sync())
            .arg(args);
        let v = self
            .waited(p, 1)
            .await?
            .into_iter()
            .next()
            .expect("counted");
        let (answer, epoch, seq): (Value, String, String) = parse(v)?;
        let given = |s: String| Some(s).filter(|s| !s.is_empty());
        self.saw_marker(given(epoch), given(seq));
        parse(answer)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        // A key, not PING: PING would go to any node with a connection.
        let mut p = redis::pipe();
        p.cmd("EXISTS").arg(self.keys.marker());
        let v = self.on_primary(&p, 1).await?;
        // The group's marker gone (a wipe, a node that came back empty):
        // a new session, so that the check that follows reads it now.
        if v.into_iter().next().map(parse::<i64>).transpose()? == Some(0) {
            self.session.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }

    async fn before_marker_read(&self) -> Result<(), StoreError> {
        // Who serves the slot now, and with how many replicas: a new
        // primary (a failover, a reshard, a restart) means a new session,
        // and its own count of replicas (never the old primary's).
        // INFO has no key: the EXISTS before it takes the pipeline to the
        // slot's primary (a MOVED sends it all there), never to whichever
        // node the client has a connection to. One section per INFO
        // (Redis 6 takes no more).
        let mut p = redis::pipe();
        p.cmd("EXISTS")
            .arg(self.keys.marker())
            .cmd("INFO")
            .arg("server")
            .cmd("INFO")
            .arg("replication");
        let mut v = self.on_primary(&p, 3).await?.into_iter().skip(1);
        let info = match (v.next().map(parse::<String>), v.next().map(parse::<String>)) {
            (Some(Ok(server)), Some(Ok(replication))) => format!("{server}\n{replication}"),
            // An ACL without INFO: the replicas are not known, and the
            // setting (or none) decides the wait. Said once, not at each
            // group's check every second.
            _ => {
                if self.cluster.replicas_to_wait.is_none()
                    && !self.cluster.info_refused.swap(true, Ordering::Relaxed)
                {
                    tracing::warn!("redis cluster refuses INFO to fencegate's user: the shards' replicas online are unknown, so changes are not waited for; allow +info or set store_replicas_to_wait (docs/stores.md)");
                }
                return Ok(());
            }
        };
        let run_id = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("run_id:"))
            .map(str::to_string);
        let (role, online) = replication(&info);
        if role != "master" {
            self.session.fetch_add(1, Ordering::AcqRel);
            return Err(unavailable(format!(
                "the node serving the slot of group {} is a {role}",
                self.keys.tag()
            )));
        }
        let mut seen = self.run_id.lock().expect("run id");
        let recount = self.recount.swap(false, Ordering::Relaxed);
        if *seen != run_id {
            if seen.is_some() {
                self.session.fetch_add(1, Ordering::AcqRel);
            }
            *seen = run_id;
            self.online.store(online, Ordering::Relaxed);
        } else if recount {
            self.online.store(online, Ordering::Relaxed);
        } else {
            // Never lower on the same primary: a primary that lost its
            // replica to a partition must not take writes unwaited that a
            // failover to that replica would lose (a failed wait recounts).
            self.online.fetch_max(online, Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "cluster_tests.rs"]
mod tests;

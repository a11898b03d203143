//! The history checker's parts, shared by `tests/history.rs` and the
//! `fencegate_check` example (which runs them against a deployment).

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::*;

pub const KEYS: usize = 3;
pub const CLIENTS: usize = 8;
pub const LEASE: Duration = Duration::from_millis(150);

/// xorshift64*: enough randomness for schedules, reproducible by seed.
pub struct Rng(pub u64);

/// A seed from the clock: odd, so never the generator's stuck state.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1
}

/// A run's length and seed: `HISTORY_SECS` (or `secs`) and `HISTORY_SEED`
/// (or one from the clock), so that a run can be made longer or repeated.
pub fn length_and_seed(secs: u64) -> (u64, u64) {
    let var = |name: &str| std::env::var(name).ok().and_then(|s| s.parse().ok());
    (
        var("HISTORY_SECS").unwrap_or(secs),
        var("HISTORY_SEED").unwrap_or_else(clock_seed),
    )
}
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The in-test lock service: one lock per key, increasing tokens, short
/// leases that expire whether or not the holder noticed.
pub struct InTestLocks {
    next_token: AtomicU64,
    lease: Duration,
    locks: Vec<Mutex<Option<(usize, u64, Instant)>>>,
}

/// etcd as the lock service: a lock is a key created with an etcd lease
/// (expiring on etcd's clock) only if absent; the token is the revision of
/// that creation, which only goes up.
pub struct EtcdLocks {
    pub endpoint: String,
    pub ttl_secs: u64,
    /// Newest token granted per key (for counting stale attempts).
    pub latest: Vec<AtomicU64>,
}

/// fencegate's own lease API as the lock service: a lock is a lease from
/// any live replica, its token the one fencegate granted (writes go to a
/// route with `tokens = "granted"`).
pub struct FencegateLocks {
    /// Lease API addresses of the live replicas (they change on restart).
    pub addrs: RwLock<Vec<SocketAddr>>,
    pub bearer: String,
    pub ttl: Duration,
    pub latest: Vec<AtomicU64>,
    /// Each grant's lease id, by key and token, for its release.
    pub ids: Mutex<HashMap<(usize, u64), String>>,
    /// Every grant, as the client saw it, for [`check_grants`].
    pub grants: Mutex<Vec<Grant>>,
    pub next: AtomicU64,
}

/// A lease as its holder saw it: from its 201 until the earlier of its
/// release being sent and its TTL counted from the acquire being sent.
/// The store held it at least that long (it committed after the acquire
/// was sent and before the 201), so the grants of one key must not
/// overlap if no two holders ever held the key at once.
#[derive(Debug, Clone)]
pub struct Grant {
    pub key: usize,
    pub token: u64,
    pub from: Instant,
    pub until: Instant,
    /// The host's wall clock less its monotonic clock at `from`, in µs:
    /// lock-service leases end on a wall clock (the embedded store's and
    /// PostgreSQL's on this host's), so a step of it between two grants
    /// moves their ends by as much.
    pub wall_offset_us: i128,
}

/// The wall clock less the monotonic clock (from a fixed origin), in µs
/// now: constant while the two run together, moved by a step of the wall
/// clock.
pub fn wall_less_monotonic_us() -> i128 {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    let mono = origin.elapsed().as_micros() as i128;
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i128;
    wall - mono
}

impl FencegateLocks {
    pub fn new(addrs: Vec<SocketAddr>, bearer: &str, ttl: Duration) -> Self {
        FencegateLocks {
            addrs: RwLock::new(addrs),
            bearer: bearer.into(),
            ttl,
            latest: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
            ids: Mutex::new(HashMap::new()),
            grants: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        }
    }

    /// A live replica's lease API, round robin.
    fn addr(&self) -> SocketAddr {
        let addrs = self.addrs.read().unwrap();
        addrs[self.next.fetch_add(1, Ordering::Relaxed) as usize % addrs.len()]
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: String,
    ) -> Option<(u16, serde_json::Value)> {
        let url = format!("http://{}{path}", self.addr());
        let auth = format!("Bearer {}", self.bearer);
        let req = http::Request::builder()
            .method(method)
            .uri(url)
            .header("authorization", auth)
            .body(full(body))
            .unwrap();
        // A replica killed mid-call: no answer, the grant's fate unknown
        // (a lease it made holds the key until it expires).
        let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
            .await
            .ok()?
            .ok()?;
        let status = resp.status().as_u16();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .ok()?
            .to_bytes();
        Some((status, serde_json::from_slice(&body).unwrap_or_default()))
    }
}

pub enum LockService {
    InTest(InTestLocks),
    Etcd(EtcdLocks),
    Fencegate(FencegateLocks),
}

pub fn b64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

impl LockService {
    /// Leases of [`LEASE`].
    pub fn in_test() -> Self {
        Self::in_test_with(LEASE)
    }

    pub fn in_test_with(lease: Duration) -> Self {
        LockService::InTest(InTestLocks {
            next_token: AtomicU64::new(1),
            lease,
            locks: (0..KEYS).map(|_| Mutex::new(None)).collect(),
        })
    }

    /// The lease length clients may outlive.
    fn lease(&self) -> Duration {
        match self {
            LockService::InTest(l) => l.lease,
            LockService::Etcd(e) => Duration::from_secs(e.ttl_secs),
            LockService::Fencegate(f) => f.ttl,
        }
    }

    async fn acquire(&self, key: usize, client: usize) -> Option<u64> {
        match self {
            LockService::InTest(l) => {
                let mut g = l.locks[key].lock().unwrap();
                match *g {
                    Some((_, _, expires)) if expires > Instant::now() => None,
                    _ => {
                        let token = l.next_token.fetch_add(1, Ordering::SeqCst);
                        *g = Some((client, token, Instant::now() + l.lease));
                        Some(token)
                    }
                }
            }
            LockService::Etcd(e) => {
                let grant = send(
                    "POST",
                    &format!("{}/v3/lease/grant", e.endpoint),
                    &[],
                    format!(r#"{{"TTL":"{}"}}"#, e.ttl_secs),
                )
                .await
                .json();
                let lease = grant["ID"].as_str()?.to_string();
                let k = b64(&format!("lock/k{key}"));
                let txn = format!(
                    r#"{{"compare":[{{"key":"{k}","target":"CREATE","result":"EQUAL","create_revision":"0"}}],"success":[{{"request_put":{{"key":"{k}","value":"{}","lease":"{lease}"}}}}]}}"#,
                    b64(&client.to_string())
                );
                let v = send("POST", &format!("{}/v3/kv/txn", e.endpoint), &[], txn)
                    .await
                    .json();
                if v["succeeded"].as_bool() != Some(true) {
                    let _ = send(
                        "POST",
                        &format!("{}/v3/lease/revoke", e.endpoint),
                        &[],
                        format!(r#"{{"ID":"{lease}"}}"#),
                    )
                    .await;
                    return None;
                }
                let token: u64 = v["header"]["revision"].as_str()?.parse().ok()?;
                e.latest[key].fetch_max(token, Ordering::SeqCst);
                Some(token)
            }
            LockService::Fencegate(f) => {
                let sent = Instant::now();
                let body = format!(
                    r#"{{"path":"/k{key}","ttl_ms":{},"holder":"client {client}"}}"#,
                    f.ttl.as_millis()
                );
                let (status, v) = f.call("POST", "/v1/leases", body).await?;
                if status != 201 {
                    return None;
                }
                let from = Instant::now();
                let token: u64 = v["token"].as_str()?.parse().ok()?;
                f.latest[key].fetch_max(token, Ordering::SeqCst);
                f.ids
                    .lock()
                    .unwrap()
                    .insert((key, token), v["lease"].as_str()?.to_string());
                f.grants.lock().unwrap().push(Grant {
                    key,
                    token,
                    from,
                    until: sent + f.ttl,
                    wall_offset_us: wall_less_monotonic_us(),
                });
                Some(token)
            }
        }
    }

    fn latest(&self, key: usize) -> u64 {
        match self {
            LockService::InTest(l) => l.locks[key].lock().unwrap().map_or(0, |(_, t, _)| t),
            LockService::Etcd(e) => e.latest[key].load(Ordering::SeqCst),
            LockService::Fencegate(f) => f.latest[key].load(Ordering::SeqCst),
        }
    }

    async fn release(&self, key: usize, token: u64) {
        match self {
            LockService::InTest(l) => {
                let mut g = l.locks[key].lock().unwrap();
                if matches!(*g, Some((_, t, _)) if t == token) {
                    *g = None;
                }
            }
            LockService::Etcd(e) => {
                // Delete the lock only if it is still ours (created at our
                // revision).
                let k = b64(&format!("lock/k{key}"));
                let txn = format!(
                    r#"{{"compare":[{{"key":"{k}","target":"CREATE","result":"EQUAL","create_revision":"{token}"}}],"success":[{{"request_delete_range":{{"key":"{k}"}}}}]}}"#
                );
                let _ = send("POST", &format!("{}/v3/kv/txn", e.endpoint), &[], txn).await;
            }
            LockService::Fencegate(f) => {
                let Some(id) = f.ids.lock().unwrap().remove(&(key, token)) else {
                    return;
                };
                let sent = Instant::now();
                if let Some(g) = f
                    .grants
                    .lock()
                    .unwrap()
                    .iter_mut()
                    .find(|g| g.key == key && g.token == token)
                {
                    g.until = g.until.min(sent);
                }
                let _ = f
                    .call("DELETE", &format!("/v1/leases/{id}"), String::new())
                    .await;
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct Attempt {
    pub id: String,
    /// The key written (`k<key>`).
    pub key: usize,
    pub token: u64,
    /// The lock service's newest token for the key when this was sent.
    pub latest_at_send: u64,
    /// HTTP status, or 0 when the outcome is unknown (connection lost in a
    /// crash): such a write may or may not have been applied.
    pub status: u16,
    /// Why the outcome is unknown (the client's error), when it is.
    pub lost: Option<String>,
    /// Sent by a client process stopped mid-body (SIGSTOP, SIGCONT).
    pub paused: bool,
    /// When it was sent, and when the answer (or the failure) came.
    pub sent: Instant,
    pub answered: Instant,
}

pub struct Run {
    pub attempts: Mutex<Vec<Attempt>>,
    /// Addresses of the live replicas (they change on restart).
    pub replicas: RwLock<Vec<SocketAddr>>,
    pub locks: LockService,
    pub seq: AtomicU64,
    pub deadline: Instant,
    /// Path prefix of the keys, so runs against a long-lived deployment
    /// use fresh keys.
    pub prefix: String,
    /// How often a client sleeps past its lease before a write.
    pub pause_percent: u64,
    /// Path prefixes of routes that fence the same keys (each write picks
    /// one), with the longest backend delay a write on it asks for: that
    /// must stay under the route's upstream timeout, since a write the
    /// proxy gives up on (504) may still be applied after a newer one.
    pub routes: Vec<(String, u64)>,
    /// How often a write asks for its route's longest delay.
    pub long_percent: u64,
}

/// The resource a write names, whatever route it took: its last segment.
fn resource(target: &str) -> &str {
    target.rsplit('/').next().unwrap_or(target)
}

pub async fn write(run: &Run, rng: &mut Rng, key: usize, token: u64) {
    let id = format!("w{}", run.seq.fetch_add(1, Ordering::Relaxed));
    let addrs = run.replicas.read().unwrap().clone();
    let addr = addrs[rng.below(addrs.len() as u64) as usize];
    let (route, long) = &run.routes[rng.below(run.routes.len() as u64) as usize];
    let delay = if rng.chance(run.long_percent) {
        *long
    } else {
        rng.below(20)
    };
    let latest_at_send = run.locks.latest(key);
    let sent = Instant::now();
    // Routes that share keys take them from this header (a path template
    // could not map /slow/k1 and /k1 to one key).
    let resource = format!("{}/k{key}", run.prefix);
    let url = format!("http://{addr}{route}{resource}");
    let paused = rng.chance(20);
    let outcome = if paused {
        // A real client process, stopped in the middle of its body for
        // longer than its lease, then continued.
        let pause = run.locks.lease().min(Duration::from_millis(600))
            + Duration::from_millis(rng.below(150));
        let cid = id.clone();
        tokio::task::spawn_blocking(move || curl_paused(&url, &cid, &resource, token, delay, pause))
            .await
            .unwrap()
    } else {
        let t = token.to_string();
        let d = delay.to_string();
        send_or_lost(
            "PUT",
            &url,
            &[
                ("x-fence-token", &t),
                ("x-write-id", &id),
                ("x-history-key", &resource),
                ("x-test-delay-ms", &d),
            ],
        )
        .await
    };
    let (status, lost) = match outcome {
        Ok(status) => (status, None),
        Err(why) => (0, Some(why)),
    };
    run.attempts.lock().unwrap().push(Attempt {
        id,
        key,
        token,
        latest_at_send,
        status,
        lost,
        paused,
        sent,
        answered: Instant::now(),
    });
}

/// The write outage a fault at `at` caused: the longest stretch, from the
/// fault on, in which no write sent was admitted (from the fault or an
/// admitted write's sending to the next admitted write's sending). Under
/// the runs' steady load the stretches between admitted writes are tens of
/// milliseconds, so the longest is the fault's. `None`: no write sent
/// after the fault was admitted.
pub fn outage(attempts: &[Attempt], at: Instant) -> Option<Duration> {
    outage_until(attempts, at, None)
}

/// [`outage`] counting only writes sent before `until` (the next fault).
pub fn outage_until(attempts: &[Attempt], at: Instant, until: Option<Instant>) -> Option<Duration> {
    let mut admitted: Vec<Instant> = attempts
        .iter()
        .filter(|a| a.sent >= at && until.is_none_or(|u| a.sent < u))
        .filter(|a| (200..300).contains(&a.status))
        .map(|a| a.sent)
        .collect();
    admitted.sort();
    let first = *admitted.first()?;
    Some(
        admitted
            .windows(2)
            .map(|w| w[1] - w[0])
            .fold(first - at, Duration::max),
    )
}

/// Marks a write that never reached fencegate (the replica was down): its
/// outcome is known, it cannot have been applied.
pub const NOT_CONNECTED: &str = "not connected";

/// Marks a paused-body write whose connection fencegate closed while the
/// client was still sending (it answered, 408 or 504, and closed before
/// the client read the answer): an outcome the proxy chose, not one a
/// fault lost. The checker still treats the write as maybe applied.
pub const CLOSED_MID_BODY: &str = "closed while the body was being sent";

impl Attempt {
    fn not_connected(&self) -> bool {
        self.lost
            .as_deref()
            .is_some_and(|l| l.starts_with(NOT_CONNECTED))
    }

    fn closed_mid_body(&self) -> bool {
        self.lost
            .as_deref()
            .is_some_and(|l| l.starts_with(CLOSED_MID_BODY))
    }
}

/// Sends with a bounded wait: the status, or why there is none (a lost
/// connection in a crash, a timeout).
pub async fn send_or_lost(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
) -> Result<u16, String> {
    let mut req = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(full("history")).unwrap();
    match tokio::time::timeout(Duration::from_secs(10), client().request(req)).await {
        Ok(Ok(resp)) => Ok(resp.status().as_u16()),
        Ok(Err(e)) if e.is_connect() => Err(format!("{NOT_CONNECTED}: {e}")),
        Ok(Err(e)) => Err(format!("client error: {e}")),
        Err(_) => Err("no answer within 10 s".into()),
    }
}

/// curl streaming its body from stdin; SIGSTOP after the first half,
/// SIGCONT after `pause`.
pub fn curl_paused(
    url: &str,
    id: &str,
    resource: &str,
    token: u64,
    delay: u64,
    pause: Duration,
) -> Result<u16, String> {
    let mut child = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-T",
            "-",
            "-X",
            "PUT",
            "--max-time",
            "10",
        ])
        .args([
            "-H",
            &format!("X-Fence-Token: {token}"),
            "-H",
            &format!("X-Write-Id: {id}"),
            "-H",
            &format!("X-History-Key: {resource}"),
        ])
        .args(["-H", &format!("X-Test-Delay-Ms: {delay}"), "-H", "Expect:"])
        .arg(url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("curl not found: install the Debian package `curl`");
    let mut stdin = child.stdin.take().unwrap();
    let _ = stdin.write_all(b"first half;");
    let _ = stdin.flush();
    std::thread::sleep(Duration::from_millis(20));
    signal(child.id(), "STOP");
    std::thread::sleep(pause);
    signal(child.id(), "CONT");
    let _ = stdin.write_all(b"second half");
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let code = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match code.parse::<u16>() {
        // An answer came (curl may still fail to send the rest of a body
        // the proxy no longer wanted).
        Ok(status) if status != 0 => Ok(status),
        // curl's exit code 7: it could not connect.
        _ if out.status.code() == Some(7) => Err(format!("{NOT_CONNECTED}: curl exit 7")),
        // curl's exit code 55: sending failed, the connection was closed.
        _ if out.status.code() == Some(55) => Err(format!("{CLOSED_MID_BODY}: curl exit 55")),
        _ => Err(format!("curl {} (http_code {code:?})", out.status)),
    }
}

pub async fn client_loop(run: Arc<Run>, client: usize, seed: u64) {
    let mut rng = Rng(seed ^ (client as u64 + 1).wrapping_mul(0x9E3779B97F4A7C15));
    while Instant::now() < run.deadline {
        let key = rng.below(KEYS as u64) as usize;
        let Some(token) = run.locks.acquire(key, client).await else {
            tokio::time::sleep(Duration::from_millis(2 + rng.below(10))).await;
            continue;
        };
        for _ in 0..1 + rng.below(3) {
            if rng.chance(run.pause_percent) {
                // A GC pause or VM freeze past the lease.
                tokio::time::sleep(run.locks.lease() + Duration::from_millis(rng.below(100))).await;
            }
            write(&run, &mut rng, key, token).await;
        }
        run.locks.release(key, token).await;
    }
}

/// What a run did, for its one-line report.
pub struct Report {
    pub attempts: usize,
    pub applied: usize,
    pub stale_attempts: usize,
    pub refused_409: usize,
    /// 503s: refused while recovering, an older write in flight, or the
    /// store unavailable.
    pub refused_503: usize,
    pub faults: usize,
    pub unknown: usize,
    /// Writes from a client stopped mid-body, and how many of them got an
    /// answer.
    pub paused: usize,
    pub paused_answered: usize,
}

impl Report {
    pub fn new(attempts: &[Attempt], records: &[Record], faults: usize) -> Report {
        Report {
            attempts: attempts.len(),
            applied: records.len(),
            stale_attempts: attempts
                .iter()
                .filter(|a| a.token < a.latest_at_send)
                .count(),
            refused_409: attempts.iter().filter(|a| a.status == 409).count(),
            refused_503: attempts.iter().filter(|a| a.status == 503).count(),
            faults,
            unknown: attempts
                .iter()
                .filter(|a| a.status == 0 && !a.not_connected() && !a.closed_mid_body())
                .count(),
            paused: attempts.iter().filter(|a| a.paused).count(),
            paused_answered: attempts
                .iter()
                .filter(|a| a.paused && a.status != 0)
                .count(),
        }
    }

    pub fn line(&self, name: &str, seed: u64) -> String {
        format!(
            "history {name} (seed {seed}): {} writes, {} applied, {} stale attempts, {} refused with 409, {} with 503, {} faults injected, {} with unknown outcome, {} of {} paused-body writes answered",
            self.attempts, self.applied, self.stale_attempts, self.refused_409, self.refused_503, self.faults, self.unknown, self.paused_answered, self.paused
        )
    }

    /// Unknown outcomes must come from the faults: each fault can cut at
    /// most the writes in flight then, one per client. And the paused-body
    /// path must work: most such writes get an answer.
    pub fn check_unknowns(&self, attempts: &[Attempt]) -> Result<(), String> {
        let bound = self.faults * CLIENTS;
        let mut why: Vec<String> = attempts
            .iter()
            .filter(|a| !a.not_connected() && !a.closed_mid_body())
            .filter_map(|a| a.lost.as_ref().map(|l| format!("{}: {l}", a.id)))
            .collect();
        why.truncate(10);
        if self.unknown > bound {
            return Err(format!(
                "{} writes with unknown outcome, more than the {bound} that {} faults can explain; first ones:\n{}",
                self.unknown,
                self.faults,
                why.join("\n")
            ));
        }
        if self.paused == 0 || self.paused_answered * 2 < self.paused {
            return Err(format!(
                "only {} of {} paused-body writes got an answer:\n{}",
                self.paused_answered,
                self.paused,
                why.join("\n")
            ));
        }
        Ok(())
    }
}

pub fn check(attempts: &[Attempt], records: &[Record]) -> Result<(), String> {
    let applied: HashMap<String, &Record> = records
        .iter()
        .filter_map(|r| {
            r.headers
                .get("x-write-id")
                .map(|v| (v.to_str().unwrap().to_string(), r))
        })
        .collect();
    let mut errors = Vec::new();
    for a in attempts {
        let was_applied = applied.contains_key(&a.id);
        match a.status {
            200..=299 if !was_applied => {
                errors.push(format!("{} answered {} but not applied", a.id, a.status))
            }
            400 | 403 | 409 | 428 | 503 if was_applied => {
                errors.push(format!("{} answered {} but applied", a.id, a.status))
            }
            0 if a.not_connected() && was_applied => {
                errors.push(format!("{} never connected but applied", a.id))
            }
            _ => {}
        }
    }
    // A write fencegate answered 504 ended for fencegate at its deadline:
    // newer writes may go from then on, whatever the backend still does
    // with it (contract.md: a 504 ends the write for fencegate, not for
    // the backend; this recording backend applies a request it has whole
    // even after its connection is gone). A partition that delays a body
    // until just before the deadline makes the backend's apply straddle it.
    let gave_up: HashMap<&str, Instant> = attempts
        .iter()
        .filter(|a| a.status == 504)
        .map(|a| (a.id.as_str(), a.answered))
        .collect();
    let until = |r: &Record| {
        let id = r.headers.get("x-write-id").and_then(|v| v.to_str().ok());
        match id.and_then(|id| gave_up.get(id)) {
            Some(answered) => r.completed.min(*answered),
            None => r.completed,
        }
    };
    let mut by_key: HashMap<String, Vec<&Record>> = HashMap::new();
    for r in records {
        by_key
            .entry(resource(&r.target).to_string())
            .or_default()
            .push(r);
    }
    for (key, mut rs) in by_key {
        rs.sort_by_key(|r| r.arrived);
        for w in rs.windows(2) {
            let (a, b) = (w[0], w[1]);
            let (ta, tb): (u64, u64) = (
                a.token.as_ref().unwrap().parse().unwrap(),
                b.token.as_ref().unwrap().parse().unwrap(),
            );
            if tb < ta {
                errors.push(format!("{key}: token {tb} applied after {ta}"));
            } else if tb > ta && b.arrived < until(a) {
                errors.push(format!(
                    "{key}: token {tb} arrived while {ta} was being applied"
                ));
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// The lock service's promise, from its holders' side: per key, no two
/// grants overlap, and each grant's token is above every earlier one's.
pub fn check_grants(grants: &[Grant]) -> Result<(), String> {
    let mut errors = Vec::new();
    for key in 0..KEYS {
        let mut gs: Vec<&Grant> = grants.iter().filter(|g| g.key == key).collect();
        gs.sort_by_key(|g| g.from);
        for (i, g) in gs.iter().enumerate() {
            for e in &gs[..i] {
                if g.from < e.until {
                    errors.push(format!(
                        "k{key}: token {} granted {:?} before token {}'s lease could end",
                        g.token,
                        e.until - g.from,
                        e.token
                    ));
                }
                if g.token <= e.token {
                    errors.push(format!(
                        "k{key}: token {} granted after token {}",
                        g.token, e.token
                    ));
                }
            }
        }
    }
    errors.truncate(20);
    if errors.is_empty() {
        return Ok(());
    }
    // A step of the host's wall clock ends wall-clock leases early: say
    // whether one happened, so that such a failure reads as what it is.
    let offsets = grants.iter().map(|g| g.wall_offset_us);
    let (lo, hi) = (
        offsets.clone().min().unwrap_or(0),
        offsets.max().unwrap_or(0),
    );
    errors.push(format!(
        "(this host's wall clock moved {} µs against its monotonic clock between the first and last grant)",
        hi - lo
    ));
    Err(errors.join("\n"))
}

pub fn keep_failure(
    name: &str,
    seed: u64,
    attempts: &[Attempt],
    records: &[Record],
    why: &str,
) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/history-failures");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}-{seed}.txt"));
    let mut f = std::fs::File::create(&path).unwrap();
    writeln!(f, "seed {seed}\n{why}\n\nattempts:").unwrap();
    for a in attempts {
        writeln!(f, "{a:?}").unwrap();
    }
    writeln!(f, "\napplied:").unwrap();
    for r in records {
        writeln!(
            f,
            "{} {:?} {:?} arrived {:?} completed {:?}",
            r.target,
            r.token,
            r.headers.get("x-write-id"),
            r.arrived,
            r.completed
        )
        .unwrap();
    }
    path.display().to_string()
}

//! History checker: clients take leases from a lock service, pause past
//! them (task sleeps, and SIGSTOP/SIGCONT of real curl processes in the
//! middle of a body), and write through fencegate to a recording backend
//! while faults are injected (fencegate kill -9 and restart; on a shared
//! store, a replica killed mid-request and the store restarted; slow
//! backend answers). The recorded history is then checked:
//!
//! - per key, applied tokens never decrease, and a newer token never
//!   reached the backend while an older write was still being applied;
//! - no write answered 409/428/400/503 was applied;
//! - every 2xx write was applied;
//! - the hazard was exercised: stale writes were attempted and refused.
//!
//! Short by default (CI); `HISTORY_SECS` and `HISTORY_SEED` make longer or
//! reproducible runs. A failing history is kept under
//! `target/history-failures/`.

mod common;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::servers::{StoreKind, StoreServer};
use common::*;

const KEYS: usize = 3;
const CLIENTS: usize = 8;
const LEASE: Duration = Duration::from_millis(150);

/// xorshift64*: enough randomness for schedules, reproducible by seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The in-test lock service: one lock per key, increasing tokens, short
/// leases that expire whether or not the holder noticed.
struct InTestLocks {
    next_token: AtomicU64,
    locks: Vec<Mutex<Option<(usize, u64, Instant)>>>,
}

/// etcd as the lock service: a lock is a key created with an etcd lease
/// (expiring on etcd's clock) only if absent; the token is the revision of
/// that creation, which only goes up.
struct EtcdLocks {
    endpoint: String,
    ttl_secs: u64,
    /// Newest token granted per key (for counting stale attempts).
    latest: Vec<AtomicU64>,
}

enum LockService {
    InTest(InTestLocks),
    Etcd(EtcdLocks),
}

fn b64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

impl LockService {
    fn in_test() -> Self {
        LockService::InTest(InTestLocks {
            next_token: AtomicU64::new(1),
            locks: (0..KEYS).map(|_| Mutex::new(None)).collect(),
        })
    }

    /// The lease length clients may outlive.
    fn lease(&self) -> Duration {
        match self {
            LockService::InTest(_) => LEASE,
            LockService::Etcd(e) => Duration::from_secs(e.ttl_secs),
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
                        *g = Some((client, token, Instant::now() + LEASE));
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
        }
    }

    fn latest(&self, key: usize) -> u64 {
        match self {
            LockService::InTest(l) => l.locks[key].lock().unwrap().map_or(0, |(_, t, _)| t),
            LockService::Etcd(e) => e.latest[key].load(Ordering::SeqCst),
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
        }
    }
}

#[derive(Debug, Clone)]
struct Attempt {
    id: String,
    token: u64,
    /// The lock service's newest token for the key when this was sent.
    latest_at_send: u64,
    /// HTTP status, or 0 when the outcome is unknown (connection lost in a
    /// crash): such a write may or may not have been applied.
    status: u16,
}

struct Run {
    attempts: Mutex<Vec<Attempt>>,
    /// Addresses of the live replicas (they change on restart).
    replicas: RwLock<Vec<SocketAddr>>,
    locks: LockService,
    seq: AtomicU64,
    deadline: Instant,
}

async fn write(run: &Run, rng: &mut Rng, key: usize, token: u64) {
    let id = format!("w{}", run.seq.fetch_add(1, Ordering::Relaxed));
    let addrs = run.replicas.read().unwrap().clone();
    let addr = addrs[rng.below(addrs.len() as u64) as usize];
    let delay = if rng.chance(10) { 200 } else { rng.below(20) };
    let latest_at_send = run.locks.latest(key);
    let url = format!("http://{addr}/k{key}");
    let status = if rng.chance(20) {
        // A real client process, stopped in the middle of its body for
        // longer than its lease, then continued.
        let pause = run.locks.lease().min(Duration::from_millis(600))
            + Duration::from_millis(rng.below(150));
        let cid = id.clone();
        tokio::task::spawn_blocking(move || curl_paused(&url, &cid, token, delay, pause))
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
                ("x-test-delay-ms", &d),
            ],
        )
        .await
    };
    run.attempts.lock().unwrap().push(Attempt {
        id,
        token,
        latest_at_send,
        status,
    });
}

/// Sends with a bounded wait; a lost connection (a crash) is status 0.
async fn send_or_lost(method: &str, url: &str, headers: &[(&str, &str)]) -> u16 {
    let mut req = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(full("history")).unwrap();
    match tokio::time::timeout(Duration::from_secs(10), client().request(req)).await {
        Ok(Ok(resp)) => resp.status().as_u16(),
        _ => 0,
    }
}

/// curl streaming its body from stdin; SIGSTOP after the first half,
/// SIGCONT after `pause`.
fn curl_paused(url: &str, id: &str, token: u64, delay: u64, pause: Duration) -> u16 {
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
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

async fn client_loop(run: Arc<Run>, client: usize, seed: u64) {
    let mut rng = Rng(seed ^ (client as u64 + 1).wrapping_mul(0x9E3779B97F4A7C15));
    while Instant::now() < run.deadline {
        let key = rng.below(KEYS as u64) as usize;
        let Some(token) = run.locks.acquire(key, client).await else {
            tokio::time::sleep(Duration::from_millis(2 + rng.below(10))).await;
            continue;
        };
        for _ in 0..1 + rng.below(3) {
            if rng.chance(25) {
                // A GC pause or VM freeze past the lease.
                tokio::time::sleep(run.locks.lease() + Duration::from_millis(rng.below(100))).await;
            }
            write(&run, &mut rng, key, token).await;
        }
        run.locks.release(key, token).await;
    }
}

struct Report {
    attempts: usize,
    applied: usize,
    stale_attempts: usize,
    refused_409: usize,
    faults: usize,
}

fn check(attempts: &[Attempt], records: &[Record]) -> Result<(), String> {
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
            400 | 409 | 428 | 503 if was_applied => {
                errors.push(format!("{} answered {} but applied", a.id, a.status))
            }
            _ => {}
        }
    }
    let mut by_key: HashMap<String, Vec<&Record>> = HashMap::new();
    for r in records {
        by_key.entry(r.target.clone()).or_default().push(r);
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
            } else if tb > ta && b.arrived < a.completed {
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

fn keep_failure(
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

/// One checked run. `faults` runs alongside the clients.
async fn history<F, Fut>(name: &str, store: StoreKind, lock_service: Option<StoreKind>, faults: F)
where
    F: FnOnce(Arc<Run>, Vec<Proxy>, Option<StoreServer>) -> Fut,
    Fut: std::future::Future<Output = (usize, Vec<Proxy>, Option<StoreServer>)>,
{
    let secs: u64 = std::env::var("HISTORY_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let seed: u64 = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    let up = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let lock_server = lock_service.map(StoreServer::start);
    let server = (store != StoreKind::Embedded).then(|| StoreServer::start(store));
    let replica = |i: usize| {
        let b = ProxyBuilder::new(&up.url(), &dir.path().join(format!("r{i}"))).args(&[
            "--upstream-timeout",
            "1s",
            "--store-timeout",
            "1s",
        ]);
        std::fs::create_dir_all(dir.path().join(format!("r{i}"))).unwrap();
        match &server {
            Some(s) => b.store_url(&s.url()).spawn(),
            None => b.spawn(),
        }
    };
    let proxies: Vec<Proxy> = (0..if server.is_some() { 2 } else { 1 })
        .map(replica)
        .collect();
    let run = Arc::new(Run {
        attempts: Mutex::new(Vec::new()),
        replicas: RwLock::new(proxies.iter().map(|p| p.addr).collect()),
        locks: match &lock_server {
            Some(etcd) => LockService::Etcd(EtcdLocks {
                endpoint: etcd.url().replace("etcd://", "http://"),
                ttl_secs: 2,
                latest: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
            }),
            None => LockService::in_test(),
        },
        seq: AtomicU64::new(0),
        deadline: Instant::now() + Duration::from_secs(secs),
    });
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(client_loop(run.clone(), c, seed)))
        .collect();
    let (fault_count, _proxies, _server) = faults(run.clone(), proxies, server).await;
    for c in clients {
        c.await.unwrap();
    }
    // Let detached applies finish (the backend's longest delay is 200 ms).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let attempts = run.attempts.lock().unwrap().clone();
    let records = up.records();
    let report = Report {
        attempts: attempts.len(),
        applied: records.len(),
        stale_attempts: attempts
            .iter()
            .filter(|a| a.token < a.latest_at_send)
            .count(),
        refused_409: attempts.iter().filter(|a| a.status == 409).count(),
        faults: fault_count,
    };
    eprintln!(
        "history {name} (seed {seed}): {} writes, {} applied, {} stale attempts, {} refused with 409, {} faults injected, {} with unknown outcome",
        report.attempts,
        report.applied,
        report.stale_attempts,
        report.refused_409,
        report.faults,
        attempts.iter().filter(|a| a.status == 0).count(),
    );
    if let Err(why) = check(&attempts, &records) {
        let kept = keep_failure(name, seed, &attempts, &records, &why);
        panic!("history {name} violated the fence (seed {seed}, kept in {kept}):\n{why}");
    }
    assert!(
        report.stale_attempts > 0 && report.refused_409 > 0,
        "the run never exercised a stale holder (seed {seed})"
    );
    assert!(report.applied > 0);
    let unknown: HashSet<_> = attempts
        .iter()
        .filter(|a| a.status == 0)
        .map(|a| a.id.clone())
        .collect();
    assert!(
        unknown.len() < attempts.len() / 2,
        "too many lost answers for a meaningful run"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn history_embedded_with_kill_9_restarts() {
    history(
        "embedded",
        StoreKind::Embedded,
        None,
        |run: Arc<Run>, mut proxies: Vec<Proxy>, server: Option<StoreServer>| async move {
            let mut faults = 0;
            while Instant::now() + Duration::from_secs(2) < run.deadline {
                tokio::time::sleep(Duration::from_millis(2500)).await;
                proxies[0].kill9();
                proxies[0].restart();
                *run.replicas.write().unwrap() = vec![proxies[0].addr];
                faults += 1;
            }
            (faults, proxies, server)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn history_redis_with_replica_kills_and_store_restarts() {
    history(
        "redis",
        StoreKind::Redis,
        None,
        |run: Arc<Run>, mut proxies: Vec<Proxy>, mut server: Option<StoreServer>| async move {
            let mut faults = 0;
            let mut round = 0;
            while Instant::now() + Duration::from_secs(2) < run.deadline {
                tokio::time::sleep(Duration::from_millis(2000)).await;
                if round % 2 == 0 {
                    // A replica killed mid-request, then back.
                    *run.replicas.write().unwrap() = vec![proxies[1].addr];
                    proxies[0].kill9();
                    proxies[0].restart();
                } else {
                    let s = server.as_mut().unwrap();
                    s.kill9();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    s.restart();
                }
                *run.replicas.write().unwrap() = proxies.iter().map(|p| p.addr).collect();
                round += 1;
                faults += 1;
            }
            (faults, proxies, server)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn history_with_etcd_leases_as_the_lock_service() {
    // Tokens are etcd revisions; leases (2 s) expire on etcd's clock while
    // holders pause past them.
    history(
        "etcd-locks",
        StoreKind::Embedded,
        Some(StoreKind::Etcd),
        |run: Arc<Run>, proxies: Vec<Proxy>, server: Option<StoreServer>| async move {
            while Instant::now() < run.deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (0, proxies, server)
        },
    )
    .await;
}

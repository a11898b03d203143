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

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::history::*;
use common::servers::{StoreKind, StoreServer};
use common::*;

/// One checked run. `faults` runs alongside the clients.
async fn history<F, Fut>(name: &str, store: StoreKind, lock_service: Option<StoreKind>, faults: F)
where
    F: FnOnce(Arc<Run>, Vec<Proxy>, Option<StoreServer>) -> Fut,
    Fut: std::future::Future<Output = (usize, Vec<Proxy>, Option<StoreServer>)>,
{
    // etcd's leases are 2 s long: its run needs more time to see expiries.
    let default_secs = if lock_service.is_some() { 12 } else { 8 };
    let secs: u64 = std::env::var("HISTORY_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_secs);
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
        prefix: String::new(),
        // With etcd's 2 s leases a run sees few expiries: pause more often
        // so that every run exercises stale holders.
        pause_percent: if lock_server.is_some() { 60 } else { 25 },
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
    let report = Report::new(&attempts, &records, fault_count);
    eprintln!("{}", report.line(name, seed));
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

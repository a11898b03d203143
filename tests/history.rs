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

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::cluster::*;
use common::history::*;
use common::servers::init_store;
use common::servers::{StoreKind, StoreServer};
use common::*;

/// What a run is made of besides its faults.
struct Setup {
    store: StoreKind,
    lock_service: Option<StoreKind>,
    /// Routes from this config (`{u}`: the upstream URL) instead of the
    /// quick start's one route with a 1 s upstream timeout.
    config: Option<&'static str>,
    /// See [`Run::routes`].
    routes: Vec<(String, u64)>,
    /// See [`Run::long_percent`].
    long_percent: u64,
    /// The in-test lock service's lease.
    lease: Duration,
    /// The run must see writes refused with 503 (the hazard it is about).
    expect_503: bool,
    /// Length of the run unless `HISTORY_SECS` says otherwise.
    secs: u64,
    /// fencegate's own lease API is the lock service, and writes go to a
    /// route that admits only granted tokens.
    fencegate_locks: bool,
    /// A store the test started itself (a replicated one), instead of a
    /// fresh server of `store`'s kind.
    store_url: Option<String>,
    /// More flags for both replicas.
    proxy_args: Vec<String>,
}

impl Setup {
    fn on(store: StoreKind) -> Self {
        Setup {
            store,
            lock_service: None,
            config: None,
            routes: vec![(String::new(), 200)],
            long_percent: 10,
            lease: LEASE,
            expect_503: false,
            secs: 8,
            fencegate_locks: false,
            store_url: None,
            proxy_args: Vec::new(),
        }
    }
}

/// One checked run. `faults` runs alongside the clients. Returns the
/// attempts, checked.
async fn history<F, Fut>(name: &str, setup: Setup, faults: F) -> Vec<Attempt>
where
    F: FnOnce(Arc<Run>, Vec<Proxy>, Option<StoreServer>) -> Fut,
    Fut: std::future::Future<Output = (usize, Vec<Proxy>, Option<StoreServer>)>,
{
    let Setup {
        store,
        lock_service,
        config,
        routes,
        long_percent,
        lease,
        expect_503,
        secs,
        fencegate_locks,
        store_url,
        proxy_args,
    } = setup;
    let config = if fencegate_locks {
        Some(GRANTED_ROUTE)
    } else {
        config
    };
    let (secs, seed) = length_and_seed(secs);
    let up = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let lock_server = lock_service.map(StoreServer::start);
    let server =
        (store != StoreKind::Embedded && store_url.is_none()).then(|| StoreServer::start(store));
    let store_url = store_url.or_else(|| server.as_ref().map(StoreServer::url));
    let config_file = dir.path().join("routes.toml");
    if let Some(text) = config {
        write_config(&config_file, &text.replace("{u}", &up.url()));
    }
    let lease_tokens = dir.path().join("lease-tokens");
    std::fs::write(&lease_tokens, LEASE_BEARER).unwrap();
    let replica = |i: usize| {
        let rdir = dir.path().join(format!("r{i}"));
        std::fs::create_dir_all(&rdir).unwrap();
        let mut b = match config {
            Some(_) => ProxyBuilder::with_config(&config_file, &rdir),
            None => ProxyBuilder::new(&up.url(), &rdir).args(&["--upstream-timeout", "1s"]),
        }
        .args(&["--store-timeout", "1s"]);
        for a in &proxy_args {
            b = b.arg(a);
        }
        if fencegate_locks {
            b = b.args(&[
                "--lease-listen",
                "127.0.0.1:0",
                "--lease-token-file",
                lease_tokens.to_str().unwrap(),
            ]);
        }
        match &store_url {
            Some(u) => b.store_url(u).spawn(),
            None => b.spawn(),
        }
    };
    let proxies: Vec<Proxy> = (0..if store_url.is_some() { 2 } else { 1 })
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
            None if fencegate_locks => LockService::Fencegate(FencegateLocks::new(
                proxies.iter().map(|p| p.lease.unwrap()).collect(),
                LEASE_BEARER,
                lease,
            )),
            None => LockService::in_test_with(lease),
        },
        seq: AtomicU64::new(0),
        deadline: Instant::now() + Duration::from_secs(secs),
        prefix: String::new(),
        // With etcd's 2 s leases a run sees few expiries: pause more often
        // so that every run exercises stale holders.
        pause_percent: if lock_server.is_some() { 60 } else { 25 },
        routes,
        long_percent,
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
    if let LockService::Fencegate(f) = &run.locks {
        let grants = f.grants.lock().unwrap().clone();
        eprintln!(
            "history {name}: {} leases granted by fencegate",
            grants.len()
        );
        assert!(grants.len() > 10, "too few grants to check (seed {seed})");
        if let Err(why) = check_grants(&grants) {
            panic!("history {name}: two holders at once (seed {seed}):\n{why}");
        }
    }
    if let Err(why) = check(&attempts, &records) {
        let kept = keep_failure(name, seed, &attempts, &records, &why);
        panic!("history {name} violated the fence (seed {seed}, kept in {kept}):\n{why}");
    }
    assert!(
        report.stale_attempts > 0 && report.refused_409 > 0,
        "the run never exercised a stale holder (seed {seed})"
    );
    assert!(report.applied > 0);
    assert!(
        !expect_503 || report.refused_503 > 0,
        "the run never had a write refused for an older one in flight (seed {seed})"
    );
    if let Err(why) = report.check_unknowns(&attempts) {
        panic!("history {name} (seed {seed}): {why}");
    }
    attempts
}

/// The lease API's bearer token in the fencegate-leases runs.
const LEASE_BEARER: &str = "history-lease-token-0123456789";

/// One route that admits only tokens fencegate granted (its key is the
/// path, as the lease requests name it).
const GRANTED_ROUTE: &str = r#"
[[routes]]
name = "granted"
upstream = "{u}"
tokens = "granted"
upstream_timeout = "1s"
"#;

/// The fencegate-leases runs' faults: replica after replica killed with
/// kill -9 while clients take leases from it and write through it, then
/// restarted (on a fresh port, which the clients learn).
async fn kill_granting_replicas(
    run: Arc<Run>,
    mut proxies: Vec<Proxy>,
    server: Option<StoreServer>,
) -> (usize, Vec<Proxy>, Option<StoreServer>) {
    let mut faults = 0;
    while Instant::now() + Duration::from_secs(2) < run.deadline {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let i = faults % proxies.len();
        let others = |ps: &[Proxy]| -> (Vec<_>, Vec<_>) {
            let live = ps
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i || ps.len() == 1);
            live.map(|(_, p)| (p.addr, p.lease.unwrap())).unzip()
        };
        if proxies.len() > 1 {
            let (addrs, leases) = others(&proxies);
            *run.replicas.write().unwrap() = addrs;
            if let LockService::Fencegate(f) = &run.locks {
                *f.addrs.write().unwrap() = leases;
            }
        }
        proxies[i].kill9();
        proxies[i].restart();
        *run.replicas.write().unwrap() = proxies.iter().map(|p| p.addr).collect();
        if let LockService::Fencegate(f) = &run.locks {
            *f.addrs.write().unwrap() = proxies.iter().map(|p| p.lease.unwrap()).collect();
        }
        faults += 1;
    }
    (faults, proxies, server)
}

fn with_fencegate_leases(store: StoreKind) -> Setup {
    Setup {
        fencegate_locks: true,
        lease: Duration::from_millis(300),
        ..Setup::on(store)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn history_fencegate_leases_embedded_with_kill_9_mid_grant() {
    history(
        "leases-embedded",
        with_fencegate_leases(StoreKind::Embedded),
        kill_granting_replicas,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn history_fencegate_leases_redis_two_replicas_granting() {
    history(
        "leases-redis",
        with_fencegate_leases(StoreKind::Redis),
        kill_granting_replicas,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn history_fencegate_leases_postgres_two_replicas_granting() {
    history(
        "leases-postgres",
        with_fencegate_leases(StoreKind::Postgres),
        kill_granting_replicas,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn history_fencegate_leases_etcd_two_replicas_granting() {
    history(
        "leases-etcd",
        with_fencegate_leases(StoreKind::Etcd),
        kill_granting_replicas,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn history_embedded_with_kill_9_restarts() {
    history(
        "embedded",
        Setup::on(StoreKind::Embedded),
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
        Setup::on(StoreKind::Redis),
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
        Setup {
            lock_service: Some(StoreKind::Etcd),
            // etcd's leases are 2 s long: the run needs more time to see
            // expiries.
            secs: 12,
            ..Setup::on(StoreKind::Embedded)
        },
        |run: Arc<Run>, proxies: Vec<Proxy>, server: Option<StoreServer>| async move {
            while Instant::now() < run.deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (0, proxies, server)
        },
    )
    .await;
}

/// Two routes fence the same keys with different upstream timeouts: writes
/// on the slow route take longer than the fast route's whole timeout, so a
/// newer write on the fast route must be refused rather than overtake one.
#[tokio::test(flavor = "multi_thread")]
async fn history_two_routes_sharing_keys_at_different_timeouts() {
    history(
        "two-routes",
        Setup {
            config: Some(
                r#"
[[routes]]
name = "slow"
path_prefix = "/slow"
upstream = "{u}"
key = "header:X-History-Key"
upstream_timeout = "5s"

[[routes]]
name = "fast"
upstream = "{u}"
key = "header:X-History-Key"
upstream_timeout = "1s"
"#,
            ),
            // A slow-route write may take longer than the fast route's whole
            // timeout; each stays well within its own (a paused body plus
            // the delay).
            // A slow write outlives its holder's lease by more than the fast
            // route's whole timeout; leases longer than that timeout mean
            // the next holder waits out its limit behind it instead of being
            // superseded by the holder after it first.
            routes: vec![("/slow".into(), 3500), (String::new(), 200)],
            long_percent: 40,
            lease: Duration::from_millis(1200),
            secs: 12,
            expect_503: true,
            ..Setup::on(StoreKind::Embedded)
        },
        |run: Arc<Run>, proxies: Vec<Proxy>, server: Option<StoreServer>| async move {
            while Instant::now() < run.deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (0, proxies, server)
        },
    )
    .await;
}

/// kill -9, then a clean stop while the restarted process is still within
/// its crash-recovery window, then a start: the crashed run's writes may
/// still be applied, so that start must wait too.
#[tokio::test(flavor = "multi_thread")]
async fn history_embedded_with_clean_stops_during_recovery() {
    history(
        "clean-stop-in-recovery",
        Setup::on(StoreKind::Embedded),
        |run: Arc<Run>, mut proxies: Vec<Proxy>, server: Option<StoreServer>| async move {
            let mut faults = 0;
            while Instant::now() + Duration::from_secs(2) < run.deadline {
                tokio::time::sleep(Duration::from_millis(2000)).await;
                proxies[0].kill9();
                proxies[0].restart();
                // How much of the recovery window is left (the routes' 1 s
                // timeout; on a busy machine the restart can outlast it,
                // or the kill can find no write in flight and leave none).
                let ready = send("GET", &proxies[0].admin_url("/readyz"), &[], "").await;
                let left = ready.json()["recovering_seconds"].as_f64();
                let exit = proxies[0].sigterm();
                match left {
                    Some(left) if left > 0.3 => assert!(
                        !exit.success(),
                        "a stop {left} s before recovery ends is not clean"
                    ),
                    None => assert!(exit.success(), "a stop with nothing to recover is clean"),
                    // Ending about now: either exit is right.
                    Some(_) => {}
                }
                proxies[0].restart();
                *run.replicas.write().unwrap() = vec![proxies[0].addr];
                // The kill and the stop: each may cut the writes in flight.
                faults += 2;
            }
            (faults, proxies, server)
        },
    )
    .await;
}

/// The grant checker itself: it sees an overlap and a token that went down.
#[test]
fn grant_checker_catches_overlaps_and_lower_tokens() {
    let t0 = Instant::now();
    let ms = |n| t0 + Duration::from_millis(n);
    let g = |key, token, from, until| Grant {
        key,
        token,
        from: ms(from),
        until: ms(until),
        wall_offset_us: from as i128 * 10,
    };
    assert!(check_grants(&[g(0, 1, 0, 100), g(0, 2, 100, 200), g(1, 1, 50, 150)]).is_ok());
    let e = check_grants(&[g(0, 1, 0, 100), g(0, 2, 90, 200)]).unwrap_err();
    assert!(e.contains("before token 1's lease could end"), "{e}");
    assert!(e.contains("wall clock moved 900 µs"), "{e}");
    let e = check_grants(&[g(0, 5, 0, 100), g(0, 4, 100, 200)]).unwrap_err();
    assert!(e.contains("token 4 granted after token 5"), "{e}");
}

/// What a failover run measured, printed with the run's own line.
fn report_failover(name: &str, attempts: &[Attempt], fault: Instant, recovered: Instant) {
    let outage = outage(attempts, fault);
    eprintln!(
        "history {name}: the store failed over {:?} after the fault; write outage (longest stretch with no write admitted): {}",
        recovered - fault,
        outage.map_or("writes never resumed".to_string(), |d| format!("{d:?}"))
    );
    assert!(outage.is_some(), "writes never resumed after the failover");
    assert!(
        attempts
            .iter()
            .any(|a| a.answered > recovered && (200..300).contains(&a.status)),
        "no write was admitted after the store failed over"
    );
}

/// Every replica still admits writes: none latched amnesia, so no
/// operator is needed after the failover.
async fn assert_no_amnesia(proxies: &[Proxy]) {
    for p in proxies {
        let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
        assert_series(&m, "fencegate_store_amnesia", 0.0);
    }
}

/// Waits out the run (the clients stop at its deadline).
async fn until_the_end(run: &Run) {
    while Instant::now() < run.deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A history run on a replicated store the test started (`cluster`, at
/// `url`): after 3 s, `fault` (blocking; it returns once the store has
/// failed over), then writes to the end of the run. No replica needs an
/// operator afterwards; the outage is reported.
async fn history_with_one_failover<C: Send + 'static>(
    name: &'static str,
    kind: StoreKind,
    secs: u64,
    url: String,
    cluster: C,
    fault: impl FnOnce(&mut C) + Send + 'static,
) {
    init_store(&url);
    // Held here until the run's checks are done.
    let cluster = Arc::new(Mutex::new(cluster));
    let times = Arc::new(Mutex::new(None));
    let (c, t) = (cluster.clone(), times.clone());
    let attempts = history(
        name,
        Setup {
            secs,
            store_url: Some(url),
            ..Setup::on(kind)
        },
        move |run: Arc<Run>, proxies: Vec<Proxy>, server: Option<StoreServer>| async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let at = Instant::now();
            tokio::task::spawn_blocking(move || fault(&mut c.lock().unwrap()))
                .await
                .unwrap();
            *t.lock().unwrap() = Some((at, Instant::now()));
            until_the_end(&run).await;
            assert_no_amnesia(&proxies).await;
            (1, proxies, server)
        },
    )
    .await;
    let (at, recovered) = times.lock().unwrap().unwrap();
    report_failover(name, &attempts, at, recovered);
}

/// Redis with a replica and three Sentinels, reached as
/// `redis+sentinel://` with the default wait (one replica while one is
/// online): the primary killed with kill -9 under writes through two
/// replicas. Sentinel promotes the replica, fencegate follows it, writes
/// resume without an operator, and no stale write reaches the backend.
#[tokio::test(flavor = "multi_thread")]
async fn history_redis_sentinel_failover_loses_nothing() {
    let cluster = tokio::task::spawn_blocking(RedisSentinels::start)
        .await
        .unwrap();
    let url = cluster.url();
    history_with_one_failover(
        "redis-sentinel-failover",
        StoreKind::Redis,
        12,
        url,
        cluster,
        |c| {
            let old = c.primary_port().expect("Sentinel names a primary");
            c.node(old).kill9();
            c.wait_promoted(old);
        },
    )
    .await;
}

/// The slot of the cluster group that holds the history runs' first key
/// (`/k0` on the default route), where the faults below strike.
fn first_key_slot(c: &RedisCluster) -> u16 {
    use fencegate::store::redis::cluster::{group_of, group_tag};
    c.slot_of(&group_tag(group_of("default:/k0")))
}

/// A Redis Cluster (three primaries, a replica each) reached as
/// `redis+cluster://` with the default wait (the shard's replica while it
/// is online): the primary serving the first key's group killed with
/// kill -9 under writes through two replicas. The cluster promotes its
/// replica, fencegate follows the slot to it, writes resume without an
/// operator, and no stale write reaches the backend.
#[tokio::test(flavor = "multi_thread")]
async fn history_redis_cluster_primary_kill_9_loses_nothing() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(Duration::from_millis(1000)))
        .await
        .unwrap();
    let url = cluster.url();
    history_with_one_failover(
        "redis-cluster-primary-kill",
        StoreKind::Redis,
        12,
        url,
        cluster,
        |c| {
            let slot = first_key_slot(c);
            let old = c.primary_of(slot).expect("a primary serves the slot");
            c.node(old).kill9();
            c.wait_promoted(old, slot);
        },
    )
    .await;
}

/// The same cluster resharded under writes: every slot of the primary
/// serving the first key's group (about 5,461) moved to another with
/// `redis-cli --cluster reshard`, keys and markers migrating while
/// clients write through two replicas, then `--cluster rebalance`, which
/// moves a third of the slots back to the emptied primary. No
/// stale write, no fence lost, no operator; the longest stretch with no
/// write admitted is reported.
#[tokio::test(flavor = "multi_thread")]
async fn history_redis_cluster_reshard_and_rebalance_under_load() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(Duration::from_millis(1000)))
        .await
        .unwrap();
    let url = cluster.url();
    history_with_one_failover(
        "redis-cluster-reshard",
        StoreKind::Redis,
        // The reshard and the rebalance take 6-11 s here, longer on a busy
        // machine: writes must go on past them.
        20,
        url,
        cluster,
        |c| {
            let slot = first_key_slot(c);
            let from = c.primary_of(slot).expect("a primary serves the slot");
            let to = c
                .nodes
                .iter()
                .map(|n| n.port)
                .find(|p| *p != from && c.primary_of_port_is_primary(*p))
                .expect("another primary");
            c.reshard(from, to, c.slots_of(from));
            assert_eq!(c.primary_of(slot), Some(to), "the slot moved");
            c.rebalance();
        },
    )
    .await;
}

/// PostgreSQL with a synchronous standby, reached through a two-host URL
/// with `target_session_attrs=read-write`: the primary killed with kill -9
/// under writes through two replicas, the standby promoted (`pg_ctl
/// promote`). fencegate moves to it with no configuration change, writes
/// resume without an operator, and no stale write reaches the backend.
#[tokio::test(flavor = "multi_thread")]
async fn history_postgres_standby_promotion_loses_nothing() {
    let cluster = tokio::task::spawn_blocking(PostgresStandby::start)
        .await
        .unwrap();
    let url = cluster.url();
    history_with_one_failover(
        "postgres-promotion",
        StoreKind::Postgres,
        10,
        url,
        cluster,
        |c| {
            c.primary.kill9();
            c.promote();
        },
    )
    .await;
}

/// A three-member etcd under writes through two replicas: the leader
/// killed with kill -9 and restarted, then a member stopped (SIGSTOP) for
/// longer than the store timeout. Calls move to the members that answer;
/// no stale write, no lost fence, no operator.
#[tokio::test(flavor = "multi_thread")]
async fn history_etcd_cluster_leader_kill_and_stopped_member() {
    let cluster = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .unwrap();
    let url = cluster.url();
    init_store(&url);
    let cluster = Arc::new(Mutex::new(cluster));
    let times = Arc::new(Mutex::new(Vec::new()));
    let (c, t) = (cluster.clone(), times.clone());
    let attempts = history(
        "etcd-cluster",
        Setup {
            secs: 14,
            store_url: Some(url),
            ..Setup::on(StoreKind::Etcd)
        },
        move |run: Arc<Run>, proxies: Vec<Proxy>, server: Option<StoreServer>| async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let c2 = c.clone();
            let fault = Instant::now();
            let (old, new) = tokio::task::spawn_blocking(move || {
                let mut c = c2.lock().unwrap();
                let old = c.leader().expect("a leader");
                c.members[old].kill9();
                (old, c.wait_leader(Some(old)))
            })
            .await
            .unwrap();
            t.lock()
                .unwrap()
                .push(("leader killed, new one elected", fault, Instant::now()));
            tokio::time::sleep(Duration::from_secs(2)).await;
            let c2 = c.clone();
            tokio::task::spawn_blocking(move || c2.lock().unwrap().members[old].restart())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
            // The new leader stopped for 2.5 s: longer than the store
            // timeout (1 s), shorter than the run.
            let fault = Instant::now();
            c.lock().unwrap().members[new].stop();
            tokio::time::sleep(Duration::from_millis(2500)).await;
            c.lock().unwrap().members[new].cont();
            t.lock()
                .unwrap()
                .push(("leader stopped (SIGSTOP)", fault, Instant::now()));
            until_the_end(&run).await;
            assert_no_amnesia(&proxies).await;
            (3, proxies, server)
        },
    )
    .await;
    let times = times.lock().unwrap().clone();
    for (i, (what, fault, recovered)) in times.iter().enumerate() {
        let next_fault = times.get(i + 1).map(|t| t.1);
        let outage = outage_until(&attempts, *fault, next_fault);
        eprintln!(
            "history etcd-cluster: {what} ({:?}); write outage (longest stretch with no write admitted): {outage:?}",
            *recovered - *fault
        );
        assert!(outage.is_some(), "writes never resumed after: {what}");
    }
    // While the member was stopped, the other two took the calls.
    let (_, stopped, resumed) = times[1];
    assert!(
        attempts
            .iter()
            .any(|a| a.sent >= stopped && a.answered <= resumed && (200..300).contains(&a.status)),
        "no write was admitted while one member of three was stopped"
    );
}

/// The history checker: a newer token reaching the backend while an older
/// write is still being applied is a violation, unless fencegate had
/// answered that older write 504 by then (it ended for fencegate at its
/// deadline, whatever the backend still does with it).
#[test]
fn history_checker_lets_a_504_end_a_write_for_fencegate() {
    let t0 = Instant::now();
    let ms = |n| t0 + Duration::from_millis(n);
    let record = |id: &str, token: &str, arrived, completed| {
        let mut headers = http::HeaderMap::new();
        headers.insert("x-write-id", id.parse().unwrap());
        Record {
            method: "PUT".into(),
            target: "/k0".into(),
            token: Some(token.into()),
            headers,
            body_len: 0,
            body_hash: 0,
            arrived: ms(arrived),
            completed: ms(completed),
        }
    };
    let attempt = |id: &str, token, status, answered| Attempt {
        id: id.into(),
        key: 0,
        token,
        latest_at_send: token,
        status,
        lost: None,
        paused: false,
        sent: ms(0),
        answered: ms(answered),
    };
    // The older write's apply outlasts its 504 at 100 ms; the newer one
    // arrives after that answer.
    let records = [record("a", "1", 0, 150), record("b", "2", 120, 130)];
    let given_up = [attempt("a", 1, 504, 100), attempt("b", 2, 200, 130)];
    assert!(check(&given_up, &records).is_ok());
    // The same with the older write answered 200: a violation.
    let answered = [attempt("a", 1, 200, 150), attempt("b", 2, 200, 130)];
    let e = check(&answered, &records).unwrap_err();
    assert!(
        e.contains("token 2 arrived while 1 was being applied"),
        "{e}"
    );
    // A newer write before the 504: a violation too.
    let early = [attempt("a", 1, 504, 125), attempt("b", 2, 200, 130)];
    assert!(check(&early, &records).is_err());
}

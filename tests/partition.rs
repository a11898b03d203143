//! Network faults (issue 43): fencegate replicas, their store and the
//! backend on test hosts of their own, each in a network namespace joined
//! by a switch (`tests/common/netns.rs`), and partitions made in the
//! switch. Needs root, iproute2 and nftables (scripts/test installs them).

mod common;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::history::*;
use common::netns::{EtcdOn, Host, Net, RedisSentinelOn, Relay, StoreOn};
use common::pg_on::PgStandbyOn;
use common::servers::StoreKind;
use common::writes::{applied, put, puts, puts_until_ok, queued_for};
use common::*;
use http::StatusCode;

/// Two replicas sharing a store, and the backend, each on a host of its
/// own; the test's clients on the switch.
struct Cluster {
    /// The relay's host and the relay, when the store is reached through it.
    relay: Option<(Host, Relay)>,
    net: Net,
    /// The store's host (its first member's, for etcd's three).
    store: Host,
    /// A three-member etcd's members, when the store is one.
    etcd: Option<EtcdOn>,
    /// Redis with Sentinel, when the store is that.
    sentinel: Option<RedisSentinelOn>,
    /// PostgreSQL with a synchronous standby, when the store is that.
    pg: Option<PgStandbyOn>,
    backend: Host,
    a: Host,
    b: Host,
    up: Upstream,
    pa: Proxy,
    pb: Proxy,
    _server: Option<StoreOn>,
    _dir: tempfile::TempDir,
}

/// Both replicas' settings: short bounds, so that a partition shows in
/// seconds.
const UPSTREAM_TIMEOUT: &str = "2s";
const STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// What the replicas' store is.
enum Store {
    /// One server of this kind.
    One(StoreKind),
    /// One server, reached through a relay that delays by the first
    /// duration plus up to the second.
    Slow(StoreKind, Duration, Duration),
    /// Three etcd members.
    EtcdCluster,
    /// Redis: a primary, a replica and three Sentinels on three hosts; with
    /// `min-replicas-to-write 1` on the data nodes if true.
    RedisSentinel(bool),
    /// PostgreSQL: a primary and its synchronous standby on two hosts.
    PgStandby,
}

impl Cluster {
    fn start(kind: StoreKind) -> Cluster {
        Self::start_with(Store::One(kind))
    }

    fn start_with(what: Store) -> Cluster {
        Self::start_full(what, &[], &[])
    }

    /// With environment variables for replica A and for replica B
    /// (libfaketime's, say).
    fn start_full(what: Store, env_a: &[(String, String)], env_b: &[(String, String)]) -> Cluster {
        let mut net = Net::new();
        let (store, backend, a, b) = (net.host(), net.host(), net.host(), net.host());
        let up = start_upstream_in(&backend, 8080);
        let dir = common::cluster::scratch_dir();
        let (mut server, mut etcd, mut relay, mut sentinel, mut pg) =
            (None, None, None, None, None);
        let store_url = match what {
            Store::One(kind) => {
                let s = StoreOn::start(kind, &store);
                let url = s.url.clone();
                server = Some(s);
                url
            }
            Store::Slow(kind, delay, jitter) => {
                let s = StoreOn::start(kind, &store);
                let host = net.host();
                let port = s.port();
                let r = Relay::start(&host, (store.addr, port).into(), delay, jitter);
                let url = s
                    .url
                    .replace(&format!("{}:{port}", store.addr), &r.addr.to_string());
                (server, relay) = (Some(s), Some((host, r)));
                url
            }
            Store::EtcdCluster => {
                let members = [store.clone(), net.host(), net.host()];
                let e = EtcdOn::start(&members);
                let url = e.url.clone();
                etcd = Some(e);
                url
            }
            Store::RedisSentinel(min_replicas) => {
                let hosts = [store.clone(), net.host(), net.host()];
                let extra: &[&str] = if min_replicas {
                    &[
                        "--min-replicas-to-write",
                        "1",
                        "--min-replicas-max-lag",
                        "2",
                    ]
                } else {
                    &[]
                };
                let r = RedisSentinelOn::start_with(&hosts, extra);
                let url = r.url.clone();
                sentinel = Some(r);
                url
            }
            Store::PgStandby => {
                let p = PgStandbyOn::start(&store, &net.host());
                let url = p.url.clone();
                pg = Some(p);
                url
            }
        };
        let replica = |host: &Host, env: &[(String, String)]| {
            let mut p = ProxyBuilder::new(&up.url(), dir.path())
                .store_url(&store_url)
                .netns(host)
                .args(&[
                    "--upstream-timeout",
                    UPSTREAM_TIMEOUT,
                    "--store-timeout",
                    "1s",
                ]);
            for (k, v) in env {
                p = p.env(k, v);
            }
            p.spawn()
        };
        let (pa, pb) = (replica(&a, env_a), replica(&b, env_b));
        Cluster {
            relay,
            net,
            store,
            etcd,
            sentinel,
            pg,
            backend,
            a,
            b,
            up,
            pa,
            pb,
            _server: server,
            _dir: dir,
        }
    }
}

/// Issue 43's critical finding. A replica cut from the backend with writes
/// in flight answers each 504 at its deadline; a newer token then goes
/// through another replica. When the partition heals, nothing of the
/// older writes may reach the backend: before the fix, their bytes waited
/// in the replica's kernel (FIN-WAIT-1, bytes unsent) and were delivered
/// after the heal, after the newer tokens.
async fn a_write_given_up_at_its_deadline_never_reaches_the_backend(kind: StoreKind) {
    let c = Cluster::start(kind);
    // Small bodies go on the lane's own path, large ones through hyper's.
    let keys: Vec<(String, usize)> = (0..4)
        .map(|k| (format!("/k{k}"), if k < 2 { 16 << 10 } else { 512 << 10 }))
        .collect();
    let small: Vec<(String, usize)> = keys.iter().map(|(p, _)| (p.clone(), 10)).collect();

    // Connections from A to the backend exist and are idle, on both paths
    // (a few rounds of concurrent writes, so that each worker's pool is
    // likely to hold one): a write given up on a connection that was
    // already open has its bytes in A's kernel, where a new connection's
    // dial sends none. (Before hyper's connections were aborted, this
    // found bytes left on one in three runs.)
    for token in 1..=3 {
        for status in puts(c.pa.addr, &keys, token).await {
            assert_eq!(status, Some(StatusCode::OK));
        }
    }
    c.net.cut(&c.a, &c.backend);
    let cut_at = Instant::now();
    for status in puts(c.pa.addr, &keys, 5).await {
        let status = status.expect("A answers at its deadline");
        assert!(
            status == StatusCode::GATEWAY_TIMEOUT || status == StatusCode::BAD_GATEWAY,
            "a write A cannot deliver is answered 504 or 502, got {status}"
        );
    }
    // Given up: nothing of those writes is left in A's kernel to deliver.
    let left = queued_for(&c.a, &c.backend);
    assert!(
        left.is_empty(),
        "A still holds bytes for the backend after giving up on its writes (delivered when the link heals):\n{}",
        left.join("\n")
    );
    for status in puts(c.pb.addr, &small, 6).await {
        assert_eq!(status, Some(StatusCode::OK), "B forwards the newer token");
    }
    c.net.heal();
    eprintln!("{kind:?}: partition lasted {:?}", cut_at.elapsed());

    // A resumes on its own, and the backend saw each key's tokens in order,
    // none of the given-up ones among them.
    for (p, _) in &keys {
        assert_eq!(put(c.pa.addr, p, 7, 10).await, Some(StatusCode::OK));
    }
    for (p, _) in &keys {
        assert_eq!(applied(&c.up, p), vec![1, 2, 3, 6, 7], "history of {p}");
    }
    assert!(queued_for(&c.a, &c.backend).is_empty());
}

/// Scenario 1 of issue 43: a replica cut from its store (but not from the
/// backend or its clients) refuses writes with 503 for as long as the cut
/// lasts, each within its bound on the store (`store_timeout` for the
/// whole wait, not per call), and forwards nothing; the other replica goes
/// on; after the heal the cut replica resumes without an operator.
async fn a_replica_cut_from_its_store_fails_closed_and_recovers(kind: StoreKind) {
    let c = Cluster::start(kind);
    let keys: Vec<(String, usize)> = (0..4).map(|k| (format!("/k{k}"), 10)).collect();
    for status in puts(c.pa.addr, &keys, 1).await {
        assert_eq!(status, Some(StatusCode::OK));
    }
    c.net.cut(&c.a, &c.store);
    let cut_at = Instant::now();
    // Newer tokens, then the equal one (the steady case) once the store's
    // last confirmation is older than its check period (the first
    // refusal took longer than that).
    let mut slowest = Duration::ZERO;
    for token in [2, 3, 1] {
        let sent = Instant::now();
        for status in puts(c.pa.addr, &keys, token).await {
            assert_eq!(
                status,
                Some(StatusCode::SERVICE_UNAVAILABLE),
                "token {token}"
            );
        }
        slowest = slowest.max(sent.elapsed());
    }
    eprintln!("{kind:?}: cut from its store, slowest refusal {slowest:?}");
    assert!(
        slowest <= STORE_TIMEOUT * 2 + Duration::from_millis(500),
        "a write waited {slowest:?} for a store it cannot reach (store_timeout {STORE_TIMEOUT:?})"
    );
    // B goes on; keys whose lease A could not release before the cut (a
    // write's registration lingers a check period, and releases are sent
    // in batches) wait until that lease expires: upstream timeout + store
    // timeout + 1 s.
    let waited = puts_until_ok(c.pb.addr, &keys, 4, Duration::from_secs(15)).await;
    eprintln!("{kind:?}: B's writes went through after {waited:?}");
    c.net.heal();
    eprintln!("{kind:?}: partition lasted {:?}", cut_at.elapsed());
    let resumed = puts_until_ok(c.pa.addr, &keys, 5, Duration::from_secs(30)).await;
    eprintln!("{kind:?}: A resumed {resumed:?} after the heal");
    for (p, _) in &keys {
        let applied = applied(&c.up, p);
        assert_eq!(applied, vec![1, 4, 5], "{p}: nothing A refused was applied");
    }
}

/// A write whose admission is abandoned (its client hangs up) while its
/// registration's check is out, the store unreachable, must not leave the
/// registration marked as checking: it would never be released, and its
/// lease would hold newer tokens on every replica until it expired. Here
/// the release lands once the partition heals, and a newer token through
/// the other replica goes through within its own wait.
async fn an_admission_abandoned_during_its_check_releases_the_registration(kind: StoreKind) {
    let c = Cluster::start(kind);
    // A long write keeps token 5's registration on A open.
    let url = format!("http://{}/k", c.pa.addr);
    let long = tokio::spawn(async move {
        let headers = [("x-fence-token", "5"), ("x-test-delay-ms", "1500")];
        send("PUT", &url, &headers, "long").await.status
    });
    eventually_async("the long write reached the backend", || async {
        c.up.arrivals() == 1
    })
    .await;
    // Past the registration's check period, the next write of token 5 is
    // admitted once the store confirms it, with its whole deadline.
    tokio::time::sleep(CHECK_PERIOD * 2).await;
    let headers = [("x-fence-token", "5"), ("x-test-delay-ms", "300")];
    let checked = send(
        "PUT",
        &format!("http://{}/k", c.pa.addr),
        &headers,
        "checked",
    )
    .await;
    assert_eq!(checked.status, StatusCode::OK, "{}", checked.text());
    // Again past it, the check cannot reach the store; the client gives up.
    tokio::time::sleep(CHECK_PERIOD * 2).await;
    c.net.cut(&c.a, &c.store);
    let abandoned = tokio::time::timeout(Duration::from_millis(300), put(c.pa.addr, "/k", 5, 10));
    assert!(abandoned.await.is_err(), "the check waits for the store");
    assert_eq!(long.await.unwrap(), StatusCode::OK);
    c.net.heal();
    let sent = Instant::now();
    let newer = put(c.pb.addr, "/k", 6, 10).await;
    assert_eq!(
        newer,
        Some(StatusCode::OK),
        "token 6 waited out A's registration for {:?}: it was never released",
        sent.elapsed()
    );
    assert_eq!(applied(&c.up, "/k"), vec![5, 5, 6]);
}

/// Split brains until `deadline`: etcd's leader cut from the other two
/// members and from replica B, replica A from the other two (A reaches
/// only the old leader, which cannot commit without a quorum; B reaches
/// the majority, which elects a new leader), for 3 s each, healed for 2 s
/// in between. Each one's start, named.
async fn split_brains(c: &Cluster, etcd: &EtcdOn, deadline: Instant) -> Vec<(String, Instant)> {
    let mut faults = Vec::new();
    while Instant::now() + Duration::from_secs(4) < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(l) = etcd.leader() else {
            continue;
        };
        let leader = &etcd.members[l];
        let others: Vec<&Host> = (0..3)
            .filter(|i| *i != l)
            .map(|i| &etcd.members[i])
            .collect();
        for o in &others {
            c.net.cut(leader, o);
            c.net.cut(&c.a, o);
        }
        c.net.cut(&c.b, leader);
        let at = Instant::now();
        faults.push((format!("etcd leader m{l} in a minority with A"), at));
        tokio::time::sleep(Duration::from_secs(3)).await;
        c.net.heal();
        let healed = Instant::now();
        let mut settled = None;
        while Instant::now() < healed + Duration::from_secs(10) {
            if etcd.leader().is_some() {
                settled = Some(healed.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!("split brain healed: a leader answers {settled:?} after the heal");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    faults
}

/// Split brains on Redis with Sentinel until `deadline`: the primary's host
/// cut from the replica's, from the third Sentinel's and from replica B;
/// replica A cut from all but the primary's host (A reaches only the old
/// primary and its Sentinel, which cannot fail it over alone). The other
/// two Sentinels promote the replica; B follows them. Held until they
/// have, healed until the old primary is a replica again.
async fn redis_split_brains(
    c: &Cluster,
    r: &RedisSentinelOn,
    deadline: Instant,
) -> Vec<(String, Instant)> {
    let mut faults = Vec::new();
    while Instant::now() + Duration::from_secs(9) < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let seen = r.primary_seen_by(2);
        let Some(p) = r.hosts.iter().position(|h| h.addr.to_string() == seen) else {
            continue;
        };
        let (old, other, third) = (&r.hosts[p], &r.hosts[1 - p], &r.hosts[2]);
        for far in [other, third, &c.b] {
            c.net.cut(old, far);
        }
        for far in [other, third] {
            c.net.cut(&c.a, far);
        }
        let at = Instant::now();
        faults.push((format!("Redis primary {} isolated with A", old.addr), at));
        let promoted = other.addr.to_string();
        let mut took = None;
        while at.elapsed() < Duration::from_secs(15) {
            if r.primary_seen_by(2) == promoted {
                took = Some(at.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("split brain: the replica promoted {took:?} after the cut");
        // A while on the two sides.
        tokio::time::sleep(Duration::from_secs(2)).await;
        c.net.heal();
        let healed = Instant::now();
        let mut rejoined = None;
        while healed.elapsed() < Duration::from_secs(20) {
            let info = common::netns::redis_cli(other, 6379, &["INFO", "replication"]);
            if info.contains("role:master") && info.contains("connected_slaves:1") {
                rejoined = Some(healed.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!(
            "split brain healed: the old primary a replica again {rejoined:?} after the heal"
        );
    }
    faults
}

/// Scenario 2 of issue 43 on PostgreSQL: the primary isolated with replica
/// A (cut from its synchronous standby and from replica B; A cut from the
/// standby), the standby promoted a second later as a failover manager
/// would, the partition healed two seconds after that, and the old primary
/// stopped two seconds after the heal (what Patroni does, or an operator
/// must). The primary cannot commit without its standby, so nothing A sends
/// it is admitted; after the heal both replicas may still reach it first
/// (it is first in the URL and still writable) until it is stopped.
async fn pg_split_brain(c: &Cluster, pg: &PgStandbyOn) -> Vec<(String, Instant)> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (old, new) = (&pg.primary, &pg.standby);
    c.net.cut(old, new);
    c.net.cut(old, &c.b);
    c.net.cut(&c.a, new);
    let at = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::block_in_place(|| pg.promote());
    eprintln!(
        "split brain: the standby promoted {:?} after the cut",
        at.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.net.heal();
    let healed = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    tokio::task::block_in_place(|| pg.stop_primary());
    eprintln!(
        "split brain healed; the old primary stopped {:?} after the heal",
        healed.elapsed()
    );
    vec![(
        format!(
            "PostgreSQL primary {} isolated with A, its standby promoted",
            old.addr
        ),
        at,
    )]
}

/// libfaketime under a replica, its clocks (wall and monotonic) running at
/// `rate` (`x2`, `x0.5`).
fn clock_rate(rate: &str) -> Vec<(String, String)> {
    let lib = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ]
    .iter()
    .map(|d| std::path::PathBuf::from(d).join("faketime/libfaketimeMT.so.1"))
    .find(|p| p.exists())
    .unwrap_or_else(|| {
        panic!("libfaketime not found: install the Debian package `faketime` (scripts/test does)")
    });
    vec![
        ("LD_PRELOAD".into(), lib.display().to_string()),
        ("FAKETIME".into(), format!("+0 {rate}")),
    ]
}

/// fencegate's check period of a registration (`fence::CHECK_EVERY`).
const CHECK_PERIOD: Duration = Duration::from_millis(50);

/// The longest stretch, from `from` to `until`, in which no write to one
/// key was admitted (from `from` or an admitted write's sending to the
/// next one's), over the keys: the slowest key's outage.
fn slowest_key(attempts: &[Attempt], from: Instant, until: Instant) -> Duration {
    (0..KEYS)
        .map(|k| {
            let mine: Vec<Attempt> = attempts.iter().filter(|a| a.key == k).cloned().collect();
            outage_until(&mine, from, Some(until)).unwrap_or(until - from)
        })
        .max()
        .unwrap_or_default()
}

/// The history checker's clients (stale holders, paused bodies, both
/// replicas) while partitions come and go: each replica cut from the store
/// and then from the backend in turn, for `CUT` each. The history must
/// hold (no stale write applied, none overtaking an older one, none lost);
/// each fault's write outage is printed, overall and for the slowest key.
async fn history_under_partitions(kind: StoreKind) {
    history(kind, Plan::Partitions).await;
}

/// Scenario 4 of issue 43: the replicas reach the store over a lossy, slow
/// link (7% of frames dropped each way, 20-70 ms of delay each way) for
/// the whole run, under the history checker's clients. No violation; the
/// refusals (503 when a call outlives `store_timeout`) are counted.
async fn history_over_a_lossy_slow_link_to_the_store(kind: StoreKind) {
    history(kind, Plan::Lossy { percent: 7 }).await;
}

/// What a history run does to the network.
enum Plan {
    /// Each replica cut from the store, then from the backend, in turn.
    Partitions,
    /// The replicas' links to the store (through a slow relay) drop this
    /// share of frames, the whole run.
    Lossy { percent: u8 },
    /// A three-member etcd whose leader is cut from the other members and
    /// from replica B, while replica A reaches only it, in turn with
    /// healed stretches.
    SplitBrain,
    /// Redis with Sentinel: the primary cut from its replica, from the
    /// third Sentinel's host and from replica B, replica A from all but the
    /// primary, until Sentinel promoted the replica; healed in between.
    /// With `min-replicas-to-write 1` if true.
    RedisSplitBrain(bool),
    /// Replica A's clocks (wall and monotonic) run at twice the real rate,
    /// replica B's at half, the whole run (libfaketime).
    ClockRates,
    /// PostgreSQL: the primary cut from its standby and from replica B,
    /// replica A from the standby; the standby promoted; healed, then the
    /// old primary stopped.
    PgSplitBrain,
}

async fn history(kind: StoreKind, plan: Plan) {
    const CUT: Duration = Duration::from_millis(1500);
    let c = match plan {
        Plan::Partitions => Cluster::start(kind),
        Plan::Lossy { .. } => Cluster::start_with(Store::Slow(
            kind,
            Duration::from_millis(20),
            Duration::from_millis(50),
        )),
        Plan::SplitBrain => Cluster::start_with(Store::EtcdCluster),
        Plan::RedisSplitBrain(min) => Cluster::start_with(Store::RedisSentinel(min)),
        Plan::PgSplitBrain => Cluster::start_with(Store::PgStandby),
        Plan::ClockRates => {
            Cluster::start_full(Store::One(kind), &clock_rate("x2"), &clock_rate("x0.5"))
        }
    };
    let (secs, seed) = length_and_seed(match plan {
        Plan::Partitions | Plan::SplitBrain | Plan::PgSplitBrain => 14,
        Plan::RedisSplitBrain(_) => 20,
        Plan::Lossy { .. } | Plan::ClockRates => 10,
    });
    let run = Arc::new(Run {
        attempts: Mutex::new(Vec::new()),
        replicas: RwLock::new(vec![c.pa.addr, c.pb.addr]),
        locks: LockService::in_test_with(LEASE),
        seq: AtomicU64::new(0),
        deadline: Instant::now() + Duration::from_secs(secs),
        prefix: String::new(),
        pause_percent: 25,
        routes: vec![(String::new(), 200)],
        long_percent: 10,
    });
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(client_loop(run.clone(), i, seed)))
        .collect();
    let replicas = [(&c.a, "A"), (&c.b, "B")];
    let mut faults = Vec::new();
    if let (Plan::Lossy { percent }, Some((relay, _))) = (&plan, &c.relay) {
        c.net.lossy(&c.a, relay, *percent);
        c.net.lossy(&c.b, relay, *percent);
        faults.push((
            format!("{percent}% loss and 20-70 ms each way to the store"),
            Instant::now(),
        ));
    }
    if let Plan::ClockRates = plan {
        faults.push(("A's clocks at 2x, B's at 0.5x".to_string(), Instant::now()));
    }
    if let (Plan::RedisSplitBrain(_), Some(r)) = (&plan, &c.sentinel) {
        faults.extend(redis_split_brains(&c, r, run.deadline).await);
    }
    if let (Plan::PgSplitBrain, Some(pg)) = (&plan, &c.pg) {
        faults.extend(pg_split_brain(&c, pg).await);
    }
    if let (Plan::SplitBrain, Some(etcd)) = (&plan, &c.etcd) {
        faults.extend(split_brains(&c, etcd, run.deadline).await);
    }
    let mut i = 0;
    while matches!(plan, Plan::Partitions) && Instant::now() + CUT * 2 < run.deadline {
        tokio::time::sleep(CUT / 2).await;
        let (host, name) = replicas[i % 2];
        let (from, what) = if i % 4 < 2 {
            (&c.store, "store")
        } else {
            (&c.backend, "backend")
        };
        c.net.cut(host, from);
        let at = Instant::now();
        tokio::time::sleep(CUT).await;
        c.net.heal();
        faults.push((format!("{name} cut from the {what}"), at));
        i += 1;
    }
    for client in clients {
        client.await.unwrap();
    }
    if let Plan::ClockRates = plan {
        // The rates took: A's clock is ahead by about the run's length, B's
        // behind by about half of it (the Date of an answer each made
        // itself, a write with no token).
        let ran = started.elapsed().as_secs() as i64;
        for (p, want) in [(&c.pa, ran), (&c.pb, -ran / 2)] {
            let a = send("PUT", &p.url("/probe"), &[], "").await;
            let date = httpdate::parse_http_date(a.header("date").expect("a Date")).unwrap();
            let off = match date.duration_since(std::time::SystemTime::now()) {
                Ok(d) => d.as_secs() as i64,
                Err(e) => -(e.duration().as_secs() as i64),
            };
            assert!(
                (off - want).abs() <= 3,
                "clock off by {off} s, not about {want}"
            );
        }
    }
    // Let detached applies finish (the backend's longest delay is 200 ms).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let attempts = run.attempts.lock().unwrap().clone();
    let records = c.up.records();
    let report = Report::new(&attempts, &records, faults.len());
    let name = match plan {
        Plan::Partitions => format!("partitions-{kind:?}"),
        Plan::Lossy { .. } => format!("lossy-{kind:?}"),
        Plan::SplitBrain => "split-brain-etcd".to_string(),
        Plan::RedisSplitBrain(false) => "split-brain-redis-sentinel".to_string(),
        Plan::RedisSplitBrain(true) => "split-brain-redis-sentinel-min-replicas".to_string(),
        Plan::ClockRates => format!("clock-rates-{kind:?}"),
        Plan::PgSplitBrain => "split-brain-postgres-standby".to_string(),
    };
    eprintln!("{}", report.line(&name, seed));
    let ends: Vec<Instant> = faults
        .iter()
        .skip(1)
        .map(|(_, at)| *at)
        .chain([Instant::now()])
        .collect();
    for ((what, at), until) in faults.iter().zip(ends) {
        eprintln!(
            "history {name}: {what} (window to the next fault {:?}): write outage {:?} overall, {:?} on the slowest key",
            until - *at,
            outage_until(&attempts, *at, Some(until)).unwrap_or(until - *at),
            slowest_key(&attempts, *at, until),
        );
    }
    if let Err(why) = check(&attempts, &records) {
        let kept = keep_failure(&name, seed, &attempts, &records, &why);
        panic!("history {name} violated the fence (seed {seed}, kept in {kept}):\n{why}");
    }
    assert!(
        report.stale_attempts > 0 && report.refused_409 > 0,
        "the run never exercised a stale holder (seed {seed}); A's log:\n{}\nB's log:\n{}",
        tail(&c.pa.stderr(), 40),
        tail(&c.pb.stderr(), 40),
    );
    assert!(report.applied > 0);
    if let Err(why) = report.check_unknowns(&attempts) {
        panic!("history {name} (seed {seed}): {why}");
    }
}

/// The last `n` lines of a replica's log, for a failure's message.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

macro_rules! on_each_store {
    ($($m:ident => $kind:expr),*) => {$(
        mod $m {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_write_given_up_at_its_deadline_never_reaches_the_backend_after_the_heal() {
                super::a_write_given_up_at_its_deadline_never_reaches_the_backend($kind).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_replica_cut_from_its_store_fails_closed_within_its_bound_and_recovers() {
                super::a_replica_cut_from_its_store_fails_closed_and_recovers($kind).await;
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn history_holds_while_partitions_come_and_go() {
                super::history_under_partitions($kind).await;
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn history_holds_over_a_lossy_slow_link_to_the_store() {
                super::history_over_a_lossy_slow_link_to_the_store($kind).await;
            }
        }
    )*};
}

on_each_store!(redis => StoreKind::Redis, postgres => StoreKind::Postgres, etcd => StoreKind::Etcd);

#[tokio::test(flavor = "multi_thread")]
async fn history_holds_while_a_postgres_primary_is_isolated_and_its_standby_promoted() {
    history(StoreKind::Postgres, Plan::PgSplitBrain).await;
}

/// Scenario 5 of issue 43, rates: one replica's clocks at twice the real
/// rate, the other's at half, under the history checker (Redis; the
/// stores' own clocks are stepped in tests/clocks.rs). Short writes are
/// not touched by either; contract.md says how slow a replica's clock may
/// run before a write that runs to its deadline outlives its lease.
#[tokio::test(flavor = "multi_thread")]
async fn history_holds_with_replica_clocks_at_twice_and_half_the_rate() {
    history(StoreKind::Redis, Plan::ClockRates).await;
}

/// Scenario 2 of issue 43 on Redis with Sentinel: the primary isolated
/// with one replica while Sentinel promotes its replica for the other,
/// under the history checker (fencegate's default replica wait).
#[tokio::test(flavor = "multi_thread")]
async fn history_holds_while_a_redis_primary_is_isolated_and_its_replica_promoted() {
    history(StoreKind::Redis, Plan::RedisSplitBrain(false)).await;
}

/// The same with `min-replicas-to-write 1` (and a lag of 2 s) on the data
/// nodes, Redis's own guard against an isolated primary taking writes.
#[tokio::test(flavor = "multi_thread")]
async fn history_holds_while_a_redis_primary_with_min_replicas_is_isolated() {
    history(StoreKind::Redis, Plan::RedisSplitBrain(true)).await;
}

/// Scenario 2 of issue 43 on etcd: the leader in a minority with one
/// replica, the majority with the other, under the history checker.
#[tokio::test(flavor = "multi_thread")]
async fn history_holds_while_etcds_leader_is_in_a_minority() {
    history(StoreKind::Etcd, Plan::SplitBrain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_abandoned_during_its_check_releases_the_registration_redis() {
    an_admission_abandoned_during_its_check_releases_the_registration(StoreKind::Redis).await;
}

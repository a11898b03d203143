//! One suite, run on every store: the embedded store (one process) and the
//! shared stores (Redis, PostgreSQL, etcd; two fencegate replicas on one real
//! server started by the test).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::servers::{StoreKind, StoreServer};
use common::*;

const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// Which store a case runs on, and whether over TLS with credentials.
#[derive(Clone, Copy, Debug)]
struct Spec {
    kind: StoreKind,
    secure: bool,
}

const fn plain(kind: StoreKind) -> Spec {
    Spec {
        kind,
        secure: false,
    }
}

const fn secure(kind: StoreKind) -> Spec {
    Spec { kind, secure: true }
}

impl Spec {
    fn start(self) -> StoreServer {
        if self.secure {
            StoreServer::start_secure(self.kind)
        } else {
            StoreServer::start(self.kind)
        }
    }
}

/// Replicas on one store, in front of one recording upstream.
struct Cluster {
    store: StoreServer,
    up: Upstream,
    a: Proxy,
    /// `None` for the embedded store: one process is the whole cluster.
    b: Option<Proxy>,
    _token_dir: tempfile::TempDir,
}

impl Cluster {
    async fn start(kind: Spec, upstream_timeout: &str) -> Cluster {
        Self::start_with(kind, upstream_timeout, false).await
    }

    /// With `state_files`, each replica keeps its own `--store-state-file`.
    async fn start_with(kind: Spec, upstream_timeout: &str, state_files: bool) -> Cluster {
        let store = kind.start();
        let up = start_upstream().await;
        let token_dir = tempfile::tempdir().unwrap();
        let token_file = token_dir.path().join("admin-token");
        std::fs::write(&token_file, ADMIN_TOKEN).unwrap();
        let replica = |name: &str| {
            let state = token_dir.path().join(format!("state-{name}"));
            let state = state.to_str().unwrap();
            let state: &[&str] = if state_files {
                &["--store-state-file", state]
            } else {
                &[]
            };
            ProxyBuilder::new(&up.url(), store.dir.path())
                .args(state)
                .store_url(&store.url())
                .args(&[
                    "--upstream-timeout",
                    upstream_timeout,
                    "--store-timeout",
                    "1s",
                ])
                .args(&["--admin-token-file", token_file.to_str().unwrap()])
                .args(
                    &store
                        .proxy_args()
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>(),
                )
                .spawn()
        };
        let a = replica("a");
        let b = (kind.kind != StoreKind::Embedded).then(|| replica("b"));
        Cluster {
            store,
            up,
            a,
            b,
            _token_dir: token_dir,
        }
    }

    fn b(&self) -> &Proxy {
        self.b.as_ref().unwrap_or(&self.a)
    }

    fn replicas(&mut self) -> Vec<&mut Proxy> {
        let mut v = vec![&mut self.a];
        if let Some(b) = self.b.as_mut() {
            v.push(b);
        }
        v
    }
}

async fn confirm_reset(p: &Proxy) -> Answer {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    send(
        "POST",
        &p.admin_url("/v1/store/confirm-reset"),
        &[("authorization", &auth)],
        "",
    )
    .await
}

/// Retries a write while it gets 503 (recovery window, store coming back),
/// bounded.
async fn put_when_ready(url: &str, token: &str, within: Duration) -> Answer {
    let deadline = Instant::now() + within;
    loop {
        let a = put(url, token).await;
        if a.status != 503 || Instant::now() > deadline {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn tokens_across_replicas(kind: Spec) {
    let c = Cluster::start(kind, "2s").await;
    assert_eq!(put(&c.a.url("/k"), "5").await.status, 200);
    assert_eq!(
        put(&c.b().url("/k"), "5").await.status,
        200,
        "equal on the other replica"
    );
    let a = put(&c.b().url("/k"), "4").await;
    assert_eq!(a.status, 409, "{}", a.text());
    assert_eq!(a.header("x-fence-token-highest"), Some("5"));
    assert_eq!(put(&c.a.url("/k"), "7").await.status, 200);
    let a = put(&c.b().url("/k"), "6").await;
    assert_eq!(a.status, 409);
    assert_eq!(a.header("x-fence-token-highest"), Some("7"));
    let f = send(
        "GET",
        &c.b().admin_url("/v1/fences/default%3A%2Fk"),
        &[],
        "",
    )
    .await;
    assert_eq!(f.json()["highest"], "7");
    let tokens: Vec<_> =
        c.up.records()
            .iter()
            .map(|r| r.token.clone().unwrap())
            .collect();
    assert_eq!(tokens, ["5", "5", "7"]);
    assert_eq!(c.up.arrivals(), 3, "a refused write reached the backend");
}

async fn full_u64_range(kind: Spec) {
    let c = Cluster::start(kind, "2s").await;
    let max = u64::MAX.to_string();
    assert_eq!(
        put(&c.a.url("/m"), "18446744073709551614").await.status,
        200
    );
    assert_eq!(put(&c.b().url("/m"), &max).await.status, 200);
    let a = put(&c.a.url("/m"), "18446744073709551614").await;
    assert_eq!(a.status, 409);
    assert_eq!(a.header("x-fence-token-highest"), Some(max.as_str()));
    assert_eq!(put(&c.a.url("/m"), &max).await.status, 200);
    assert_eq!(put(&c.a.url("/zero"), "0").await.status, 200);
    let f = send(
        "GET",
        &c.b().admin_url("/v1/fences/default%3A%2Fm"),
        &[],
        "",
    )
    .await;
    assert_eq!(f.json()["highest"], max);
    assert_eq!(c.up.arrivals(), 4, "the refused write reached the backend");
}

async fn ordering_across_replicas(kind: Spec) {
    let c = Cluster::start(kind, "5s").await;
    let url = c.a.url("/o");
    let old = tokio::spawn(async move {
        send(
            "PUT",
            &url,
            &[("x-fence-token", "1"), ("x-test-delay-ms", "700")],
            "x",
        )
        .await
    });
    eventually("old write in flight", Duration::from_secs(5), || {
        c.up.arrivals() == 1
    })
    .await;
    let new = put(&c.b().url("/o"), "2").await;
    assert_eq!(new.status, 200, "{}", new.text());
    assert_eq!(old.await.unwrap().status, 200);
    let r = c.up.records();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].token.as_deref(), Some("1"));
    assert!(
        r[1].arrived >= r[0].completed,
        "token 2 reached the backend while token 1 was in flight on the other replica"
    );
    // The wait polled the store with pauses (the store's 5 ms hint, or a
    // backoff to 50 ms: about 100 polls here), not back to back (several
    // hundred or more).
    if kind.kind != StoreKind::Embedded {
        let polls = metric(
            c.b(),
            "fencegate_store_latency_seconds_count{op=\"poll_lease\"}",
        )
        .await
        .unwrap_or(0.0);
        assert!(
            (1.0..=200.0).contains(&polls),
            "{polls} polls in a 700 ms wait"
        );
    }
    // An older token is now refused on both.
    assert_eq!(put(&c.a.url("/o"), "1").await.status, 409);
    assert_eq!(put(&c.b().url("/o"), "1").await.status, 409);
    assert_eq!(c.up.arrivals(), 2, "a refused write reached the backend");
}

/// A COPY holding its destination while it waits behind an older write on
/// its source is refused once a newer token takes the destination on the
/// other replica: it must not be sent after that newer write was let in.
async fn copy_overtaken_across_replicas(kind: Spec) {
    let c = Cluster::start(kind, "10s").await;
    let z = slow_put(c.a.url("/z"), "4", "3000");
    eventually("z in flight", Duration::from_secs(5), || {
        c.up.arrivals() == 1
    })
    .await;
    // COPY /z -> /a with token 5: takes /a, then waits behind /z.
    let url = c.a.url("/z");
    let copy = tokio::spawn(async move {
        send(
            "COPY",
            &url,
            &[("destination", "/a"), ("x-fence-token", "5")],
            "",
        )
        .await
    });
    queued(&c.a, 1).await;
    let newer = slow_put(c.b().url("/a"), "7", "0");
    let copied = copy.await.unwrap();
    assert_eq!(copied.status, 409, "{}", copied.text());
    assert_eq!(copied.header("x-fence-token-highest"), Some("7"));
    assert_eq!(newer.await.unwrap().status, 200);
    assert_eq!(z.await.unwrap().status, 200);
    assert!(
        c.up.records().iter().all(|r| r.method != "COPY"),
        "the overtaken COPY was applied"
    );
}

async fn concurrent_advances_then_kill_9(kind: Spec) {
    let mut c = Cluster::start(kind, "1s").await;
    let mut tasks = Vec::new();
    for i in 0..300u32 {
        let replica = if i % 2 == 0 { &c.a } else { c.b() };
        let url = replica.url(&format!("/c/{i}"));
        tasks.push(tokio::spawn(async move { put(&url, "100").await.status }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    for p in c.replicas() {
        p.kill9();
    }
    for p in c.replicas() {
        p.restart();
    }
    // No window for the whole replica after the crash: a stale token is
    // refused at once (the fence is durable), a new key and a newer token
    // on a key with nothing in flight go at once, on every replica.
    for i in (0..300u32).step_by(11) {
        let replica = if i % 3 == 0 { &c.a } else { c.b() };
        let a = put(&replica.url(&format!("/c/{i}")), "99").await;
        assert_eq!(a.status, 409, "key {i} lost its fence: {}", a.text());
        assert_eq!(a.header("x-fence-token-highest"), Some("100"));
    }
    assert_eq!(c.up.arrivals(), 300, "a refused write reached the backend");
    for (n, p) in [&c.a, c.b()].into_iter().enumerate() {
        let a = put(&p.url(&format!("/fresh/{n}")), "1").await;
        assert_eq!(
            a.status,
            200,
            "a new key waited after a crash: {}",
            a.text()
        );
    }
}

async fn racing_tokens_on_one_key(kind: Spec) {
    let c = Cluster::start(kind, "5s").await;
    // 60 writers race on one key with tokens 1..=60 over both replicas,
    // each write held 20 ms by the backend.
    let mut tasks = Vec::new();
    for t in 1..=60u64 {
        let replica = if t % 2 == 0 { &c.a } else { c.b() };
        let url = replica.url("/hot");
        tasks.push(tokio::spawn(async move {
            let a = send(
                "PUT",
                &url,
                &[("x-fence-token", &t.to_string()), ("x-test-delay-ms", "20")],
                "x",
            )
            .await;
            (t, a.status.as_u16(), a.text())
        }));
    }
    let mut admitted = Vec::new();
    for task in tasks {
        let (t, status, body) = task.await.unwrap();
        assert!(status == 200 || status == 409, "token {t}: {status} {body}");
        if status == 200 {
            admitted.push(t);
        }
    }
    assert!(!admitted.is_empty());
    let r = c.up.records();
    assert_eq!(
        r.len(),
        admitted.len(),
        "every admitted write was applied, no refused one"
    );
    // In arrival order, tokens never go down, and no write arrived while an
    // older one was still being applied.
    let mut by_arrival = r.clone();
    by_arrival.sort_by_key(|x| x.arrived);
    let tokens: Vec<u64> = by_arrival
        .iter()
        .map(|x| x.token.as_ref().unwrap().parse().unwrap())
        .collect();
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "applied out of order: {tokens:?}"
    );
    for w in by_arrival.windows(2) {
        if w[0].token != w[1].token {
            assert!(
                w[1].arrived >= w[0].completed,
                "a newer token overtook an older write in flight"
            );
        }
    }
    let max = admitted.iter().max().unwrap();
    let a = put(&c.a.url("/hot"), &(max - 1).to_string()).await;
    assert_eq!(a.status, 409);
    assert_eq!(
        c.up.arrivals(),
        admitted.len(),
        "a refused write reached the backend"
    );
}

/// A replica's batch size histogram: (batches, operations) of `op`.
async fn batches(p: &Proxy, op: &str) -> (u64, u64) {
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    let get = |what: &str| {
        let needle = format!("fencegate_store_batch_size_{what}{{op=\"{op}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&needle))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    (get("count") as u64, get("sum") as u64)
}

/// Group commit under concurrency: both replicas send a few hundred writes
/// at once, stale, equal and newer tokens on a few hot keys mixed with new
/// keys, so that admissions share round trips (the histogram proves they
/// did). Each write still gets its own exact answer: every stale token is
/// refused with the key's highest, nothing refused reaches the backend,
/// and on each key the backend sees tokens in order, none overtaking an
/// older write still being applied.
async fn batches_answer_each_write_right(kind: Spec) {
    let c = Cluster::start(kind, "5s").await;
    const HOT: u64 = 6;
    for k in 0..HOT {
        assert_eq!(put(&c.a.url(&format!("/hot/{k}")), "50").await.status, 200);
    }
    let mut tasks = Vec::new();
    for i in 0..360u64 {
        let replica = if i % 2 == 0 { &c.a } else { c.b() };
        let (path, token) = if i % 3 == 0 {
            (format!("/cold/{i}"), 1)
        } else {
            // 40 (stale), 50 (equal) or 51..=56 (newer), spread over the keys.
            let t = [40, 50, 51, 52, 53, 54, 55, 56][(i as usize / 3) % 8];
            (format!("/hot/{}", i % HOT), t)
        };
        let url = replica.url(&path);
        tasks.push(tokio::spawn(async move {
            let a = send(
                "PUT",
                &url,
                &[
                    ("x-fence-token", &token.to_string()),
                    ("x-test-delay-ms", "3"),
                ],
                "x",
            )
            .await;
            let highest = a.header("x-fence-token-highest").map(str::to_string);
            (path, token, a.status.as_u16(), highest, a.text())
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        let (path, token, status, highest, body) = t.await.unwrap();
        match status {
            200 => {
                assert!(
                    token >= 50 || path.starts_with("/cold"),
                    "{path}: stale {token} admitted"
                );
                admitted += 1;
            }
            409 => {
                let h: u64 = highest.expect("a 409 names the highest").parse().unwrap();
                assert!(h > token, "{path}: {token} refused with highest {h}");
            }
            other => panic!("{path} token {token}: {other} {body}"),
        }
    }
    let records = c.up.records();
    assert_eq!(
        records.len(),
        admitted + HOT as usize,
        "a refused write reached the backend"
    );
    for k in 0..HOT {
        let target = format!("/hot/{k}");
        let mut on_key: Vec<_> = records.iter().filter(|r| r.target == target).collect();
        on_key.sort_by_key(|r| r.arrived);
        for w in on_key.windows(2) {
            let (t0, t1) = (
                w[0].token.as_deref().unwrap(),
                w[1].token.as_deref().unwrap(),
            );
            let (n0, n1): (u64, u64) = (t0.parse().unwrap(), t1.parse().unwrap());
            assert!(n0 <= n1, "{target}: {n1} applied after {n0}");
            if n0 != n1 {
                assert!(
                    w[1].arrived >= w[0].completed,
                    "{target}: {n1} overtook {n0} in flight"
                );
            }
        }
    }
    let (mut batched, mut ops) = (0, 0);
    for p in [&c.a, c.b()] {
        let (b, o) = batches(p, "acquire_lease").await;
        batched += b;
        ops += o;
    }
    assert!(
        ops > batched,
        "no two admissions shared a round trip ({ops} in {batched} batches)"
    );
}

/// A replica killed with batches out loses nothing it acknowledged: every
/// write it answered 200 keeps its fence after the crash (an older token
/// is refused through the other replica), and the keys of writes it never
/// answered are free again within the lease (a newer token goes).
async fn kill_9_mid_batch_loses_nothing_acknowledged(kind: Spec) {
    let mut c = Cluster::start(kind, "1s").await;
    let mut tasks = Vec::new();
    // Half the writes are held 20 ms by the backend, half 700 ms (under the
    // 1 s upstream timeout): the kill comes once some of the quick ones were
    // answered, while the slow ones are surely still out.
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for i in 0..240u32 {
        let url = c.a.url(&format!("/k9/{i}"));
        let answered = answered.clone();
        tasks.push(tokio::spawn(async move {
            // The replica dies under some: no answer is not a test failure.
            let req = http::Request::put(&url)
                .header("x-fence-token", "7")
                .header("x-test-delay-ms", if i % 2 == 0 { "20" } else { "700" })
                .body(full("x"))
                .unwrap();
            let status =
                match tokio::time::timeout(Duration::from_secs(30), client().request(req)).await {
                    Ok(Ok(resp)) => resp.status().as_u16(),
                    _ => 0,
                };
            if status == 200 {
                answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            (i, status)
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while answered.load(std::sync::atomic::Ordering::SeqCst) < 20 {
        assert!(Instant::now() < deadline, "no write was answered");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    c.a.kill9();
    let mut acknowledged = Vec::new();
    let mut unanswered = Vec::new();
    for t in tasks {
        let (i, status) = t.await.unwrap();
        if status == 200 {
            acknowledged.push(i);
        } else {
            unanswered.push(i);
        }
    }
    assert!(
        !acknowledged.is_empty() && !unanswered.is_empty(),
        "the kill came too late or too early"
    );
    for i in &acknowledged {
        let a = put(&c.b().url(&format!("/k9/{i}")), "6").await;
        assert_eq!(
            a.status,
            409,
            "key {i}: an acknowledged fence was lost: {}",
            a.text()
        );
    }
    // A dead replica's leases last at most the lease (upstream timeout,
    // store timeout, margin): a newer token goes on every key within it.
    for i in unanswered.iter().chain(&acknowledged).step_by(7) {
        let a = put_when_ready(
            &c.b().url(&format!("/k9/{i}")),
            "8",
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(a.status, 200, "key {i} stayed held: {}", a.text());
    }
    c.a.restart();
    let a = put(&c.a.url(&format!("/k9/{}", acknowledged[0])), "6").await;
    assert_eq!(
        a.status, 409,
        "the restarted replica admitted a stale token"
    );
}

async fn store_outage_fails_closed_and_heals(kind: Spec) {
    let mut c = Cluster::start(kind, "2s").await;
    assert_eq!(put(&c.a.url("/s"), "5").await.status, 200);
    let before = c.up.arrivals();
    c.store.kill9();
    for p in [&c.a, c.b()] {
        let a = put(&p.url("/s/new"), "9").await;
        assert_eq!(a.status, 503, "{}", a.text());
        assert!(a.header("retry-after").is_some());
        assert_eq!(
            send("GET", &p.url("/s"), &[], "").await.status,
            200,
            "reads flow"
        );
        let r = send("GET", &p.admin_url("/readyz"), &[], "").await;
        assert_eq!(r.status, 503, "{}", r.text());
    }
    let m = send("GET", &c.a.admin_url("/metrics"), &[], "")
        .await
        .text();
    assert!(m.contains("decision=\"store_error\""), "{m}");
    assert_eq!(
        c.up.arrivals(),
        before + 2,
        "only the reads reached the backend"
    );
    c.store.restart();
    let a = put_when_ready(&c.b().url("/s/new"), "9", Duration::from_secs(10)).await;
    assert_eq!(
        a.status,
        200,
        "writes resume without a restart: {}",
        a.text()
    );
    let a = put_when_ready(&c.a.url("/s"), "4", Duration::from_secs(10)).await;
    assert_eq!(a.status, 409, "fence kept: {}", a.text());
    assert_eq!(
        send("GET", &c.a.admin_url("/readyz"), &[], "").await.status,
        200
    );
}

/// A store restarted with its data: the first write through every replica
/// afterwards succeeds (the broken connection it finds is replaced, and
/// the call made again), and the fence is kept.
async fn a_store_restart_fails_no_write(kind: Spec) {
    let mut c = Cluster::start(kind, "2s").await;
    for (i, p) in [&c.a, c.b()].into_iter().enumerate() {
        let a = put(&p.url(&format!("/restart/{i}")), "5").await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    c.store.kill9();
    c.store.restart();
    for (i, p) in [&c.a, c.b()].into_iter().enumerate() {
        let a = put(&p.url(&format!("/restart/{i}")), "6").await;
        assert_eq!(
            a.status,
            200,
            "the first write after the restart: {}",
            a.text()
        );
        let a = put(&p.url(&format!("/restart/{i}")), "5").await;
        assert_eq!(a.status, 409, "fence kept: {}", a.text());
    }
}

/// Retries a stale write on a store that was just rolled back: 503 while
/// the store is down, until the answer is the 503 for lost data; never 200.
async fn refused_until_lost_data(p: &Proxy, path: &str, token: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = put(&p.url(path), token).await;
        assert_ne!(a.status, 200, "a stale write passed a rolled-back store");
        assert_eq!(a.status, 503, "{}", a.text());
        if a.text().contains("lost data") {
            return;
        }
        assert!(Instant::now() < deadline, "never caught: {}", a.text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A store restored from a backup while the replicas run: its data rolls
/// back past a raise acknowledged by one replica. The other replica, which
/// never wrote that key, refuses the stale token too: every running replica
/// advances the store's marker every second, writes or not, and checks it
/// when a call goes over a new connection.
async fn a_restored_backup_is_caught_by_every_replica(kind: Spec) {
    let mut c = Cluster::start(kind, "2s").await;
    let a = put(&c.b().url("/rb"), "1000").await;
    assert_eq!(a.status, 200, "{}", a.text());
    let backup = c.store.backup();
    let a = put_when_ready(&c.b().url("/rb"), "2000", Duration::from_secs(15)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    // Idle replicas: only their heartbeats advance the marker now.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let applied = c.up.arrivals();
    c.store.restore(&backup);
    // Until the store answers, 503 for being down; then 503 for lost data.
    // Token 1500 passes the restored fence (1000): it must not pass.
    refused_until_lost_data(&c.a, "/rb", "1500").await;
    assert_eq!(c.up.arrivals(), applied, "nothing reached the backend");
}

/// Asserts that a write is refused for lost data, and that nothing more
/// reached the backend.
async fn refused_for_lost_data(p: &Proxy, path: &str, token: &str, up: &Upstream, applied: usize) {
    let a = put(&p.url(path), token).await;
    assert_ne!(a.status, 200, "a stale write passed a rolled-back store");
    assert_eq!(a.status, 503, "{}", a.text());
    assert!(a.text().contains("lost data"), "{}", a.text());
    assert_eq!(up.arrivals(), applied, "nothing reached the backend");
}

/// Once one replica saw the store go back, no replica admits a write on
/// it until an operator confirms: not one restarted with kill -9 or a
/// clean stop, not a new one. (The detection is recorded in the store's
/// marker, which every replica reads before it admits anything.)
async fn a_rollback_seen_once_survives_restarts(kind: Spec) {
    let mut c = Cluster::start(kind, "2s").await;
    assert_eq!(put(&c.a.url("/r/k"), "10").await.status, 200);
    let backup = c.store.backup();
    let a = put_when_ready(&c.a.url("/r/k"), "20", Duration::from_secs(15)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    tokio::time::sleep(Duration::from_millis(2500)).await;
    c.b.as_mut().unwrap().kill9();
    let applied = c.up.arrivals();
    c.store.restore(&backup);
    // Replica a, which kept running, sees the rollback.
    refused_until_lost_data(&c.a, "/r/k", "15").await;
    assert_eq!(c.up.arrivals(), applied, "nothing reached the backend");
    // b, started again normally, refuses too, now and a while later.
    c.b.as_mut().unwrap().restart();
    let b = c.b.as_ref().unwrap();
    refused_for_lost_data(b, "/r/k", "15", &c.up, applied).await;
    tokio::time::sleep(Duration::from_millis(3000)).await;
    refused_for_lost_data(b, "/r/k", "16", &c.up, applied).await;
    refused_for_lost_data(b, "/r/other", "1", &c.up, applied).await;
    // a, stopped cleanly and started again, as well.
    assert!(c.a.sigterm().success());
    c.a.restart();
    refused_for_lost_data(&c.a, "/r/k", "17", &c.up, applied).await;
    // The operator confirms (raising the lost fence first, as the docs
    // say): then writes go again, through both.
    let r = confirm_reset(&c.a).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let b = c.b.as_ref().unwrap();
    refused_for_lost_data(b, "/r/k", "30", &c.up, applied).await;
    let r = confirm_reset(b).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // (etcd restarts the TTL of leases restored with its data: a
    // registration in the backup holds the key a few seconds more.)
    let a = put_when_ready(&c.a.url("/r/k"), "30", Duration::from_secs(15)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let a = put(&b.url("/r/k"), "30").await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(put(&b.url("/r/k"), "29").await.status, 409);
}

/// A store rolled back while every replica was down: no running replica
/// sees it go back, but each replica's own state file remembers a later
/// marker, so the restarted replicas refuse it at their first check.
async fn a_rollback_while_every_replica_was_down_is_caught_by_state_files(kind: Spec) {
    let mut c = Cluster::start_with(kind, "2s", true).await;
    assert_eq!(put(&c.a.url("/r/k"), "10").await.status, 200);
    let backup = c.store.backup();
    let a = put_when_ready(&c.a.url("/r/k"), "20", Duration::from_secs(15)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    tokio::time::sleep(Duration::from_millis(2500)).await;
    c.a.kill9();
    assert!(c.b.as_mut().unwrap().sigterm().success());
    let applied = c.up.arrivals();
    c.store.restore(&backup);
    c.a.restart();
    c.b.as_mut().unwrap().restart();
    for p in [&c.a, c.b()] {
        refused_until_lost_data(p, "/r/k", "15").await;
    }
    assert_eq!(c.up.arrivals(), applied, "nothing reached the backend");
}

async fn replica_killed_mid_write(kind: Spec) {
    use tokio::io::AsyncWriteExt;
    let mut c = Cluster::start(kind, "2s").await;
    // Token 1 goes out through replica a, which dies while the backend is
    // still applying it.
    let sent = Instant::now();
    let mut s = tokio::net::TcpStream::connect(c.a.addr).await.unwrap();
    s.write_all(b"PUT /r HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-Test-Delay-Ms: 1500\r\nContent-Length: 1\r\n\r\nx")
        .await
        .unwrap();
    eventually("token 1 in flight", Duration::from_secs(5), || {
        c.up.arrivals() == 1
    })
    .await;
    c.a.kill9();
    if kind.kind == StoreKind::Embedded {
        c.a.restart();
    }
    // Token 2 is held (or refused with 503) until token 1 can no longer be
    // in flight, then goes: never before token 1 was applied.
    let a = put_when_ready(&c.b().url("/r"), "2", Duration::from_secs(15)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let r = c.up.records();
    let t1 = r
        .iter()
        .find(|x| x.token.as_deref() == Some("1"))
        .expect("token 1 was applied");
    let t2 = r.iter().find(|x| x.token.as_deref() == Some("2")).unwrap();
    assert!(
        t2.arrived >= t1.completed,
        "token 2 overtook the dead replica's write"
    );
    assert_eq!(c.up.arrivals(), 2, "a refused attempt reached the backend");
    if kind.kind != StoreKind::Embedded {
        // The dead replica's lease lives the write's limit plus the store
        // timeout and a second (2 + 1 + 1 s here); etcd rounds it up by at
        // most an eighth, to whole seconds (5 s). Past that, and etcd's
        // expiry tick and the retry pauses, the key is free.
        let waited = t2.arrived.duration_since(sent);
        assert!(
            waited < Duration::from_millis(6500),
            "the dead replica held the key {waited:?}"
        );
    }
}

async fn a_wiped_store_is_refused_until_confirmed(kind: Spec) {
    let c = Cluster::start(kind, "2s").await;
    assert_eq!(put(&c.a.url("/w"), "5").await.status, 200);
    assert_eq!(put(&c.b().url("/w"), "5").await.status, 200);
    let applied = c.up.arrivals();
    c.store.wipe().await;
    // A stale token would pass a store that forgot: it must not.
    let a = put(&c.b().url("/w"), "3").await;
    assert_eq!(a.status, 503, "{}", a.text());
    // Replica A learns it from its heartbeat (at most a second): its
    // amnesia gauge says when.
    eventually_async("replica A reports amnesia", || async {
        metric(&c.a, "fencegate_store_amnesia ").await == Some(1.0)
    })
    .await;
    // Keys this replica never saw are refused too, once the marker is checked.
    let a = put(&c.a.url("/w/other"), "1").await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert!(a.text().contains("lost data"), "{}", a.text());
    assert_eq!(c.up.arrivals(), applied, "nothing reached the backend");
    assert_eq!(
        send("GET", &c.a.admin_url("/readyz"), &[], "").await.status,
        503
    );
    let m = send("GET", &c.a.admin_url("/metrics"), &[], "")
        .await
        .text();
    assert_series(&m, "fencegate_store_amnesia", 1.0);
    // A plain restart must not take the wiped store for a new one: the
    // replica refuses to start and names the explicit step.
    let (status, stderr) = c.a.start_refused();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("init-store"), "{stderr}");
    assert_eq!(c.up.arrivals(), applied, "nothing reached the backend");
    // Without the admin token, no confirmation.
    assert_eq!(
        send("POST", &c.a.admin_url("/v1/store/confirm-reset"), &[], "")
            .await
            .status,
        401
    );
    // The operator confirms on each replica; known fences are written back.
    for p in [&c.a, c.b()] {
        let r = confirm_reset(p).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let a = put(&c.b().url("/w"), "3").await;
    assert_eq!(a.status, 409, "the fence was restored: {}", a.text());
    assert_eq!(put(&c.a.url("/w"), "6").await.status, 200);
    assert_eq!(put(&c.b().url("/w/other"), "1").await.status, 200);
    // Confirmed, the store is marked again: a restart starts.
    let mut c = c;
    c.a.restart();
    assert_eq!(put(&c.a.url("/w"), "5").await.status, 409);
}

/// A store nobody initialised is refused at start (it could be a wiped
/// one); `fencegate init-store` marks it once, and is idempotent.
async fn a_new_store_needs_init_store(kind: Spec) {
    let c = Cluster::start(kind, "2s").await;
    let fresh = StoreServer::start_with(kind.kind, kind.secure);
    let args = fresh.proxy_args();
    let on_fresh = || {
        ProxyBuilder::new(&c.up.url(), fresh.dir.path())
            .store_url(&fresh.url())
            .args(&["--store-timeout", "1s"])
            .args(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (status, stderr) = on_fresh().start_refused();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("init-store"), "{stderr}");
    fresh.initialise();
    fresh.initialise();
    let mut p = on_fresh().spawn();
    assert_eq!(put(&p.url("/n"), "4").await.status, 200);
    p.restart();
    assert_eq!(put(&p.url("/n"), "3").await.status, 409);
    assert_eq!(c.up.arrivals(), 1, "a refused write reached the backend");
}

/// An acquire whose answer never came (the client gave up, the store call
/// timed out, the store applied it late) must not leave its lease behind:
/// an orphan would hold every newer write to the key for a whole lease TTL.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_acquire_leaves_no_lease_behind() {
    let c = Cluster::start(plain(StoreKind::Redis), "10s").await;
    assert_eq!(put(&c.a.url("/o"), "1").await.status, 200);
    // Its lease is released right after the write (not left to expire).
    no_leases_within(&c.store, Duration::from_secs(2)).await;
    // Redis freezes with the token-2 acquire sent; the client gives up
    // after 0.5 s and the store call times out after 1 s.
    let freeze = c.store.freeze(Duration::from_secs(2));
    let write = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        tokio::time::timeout(Duration::from_millis(500), put(&c.a.url("/o"), "2")).await
    };
    let ((), gave_up) = tokio::join!(freeze, write);
    assert!(gave_up.is_err(), "the client gave up");
    // Redis applies the queued acquire as it wakes; the lease it registers
    // must be released (the TTL would keep it ~12 s).
    no_leases_within(&c.store, Duration::from_secs(6)).await;
    assert!(
        !c.up
            .records()
            .iter()
            .any(|r| r.token.as_deref() == Some("2")),
        "the abandoned write reached the backend"
    );
    // Nothing holds the key: a newer write goes, on either replica.
    let a = put(&c.b().url("/o"), "3").await;
    assert_eq!(a.status, 200, "{}", a.text());
}

/// On a shared store too, a newer write whose own route's timeout comes
/// before an older write's end is refused as older-write-in-flight, not
/// forwarded, and not taken for a store outage.
#[tokio::test(flavor = "multi_thread")]
async fn a_shorter_timeout_on_another_route_does_not_overtake_across_replicas() {
    let store = StoreServer::start(StoreKind::Redis);
    let up = start_upstream().await;
    let cfg = store.dir.path().join("routes.toml");
    write_config(&cfg, &two_routes_sharing_keys(&up.url()));
    let replica = || {
        ProxyBuilder::with_config(&cfg, store.dir.path())
            .store_url(&store.url())
            .spawn()
    };
    let (a, b) = (replica(), replica());
    let url = a.url("/d/slow/x");
    let old = tokio::spawn(async move {
        send(
            "PUT",
            &url,
            &[("x-fence-token", "1"), ("x-test-delay-ms", "3000")],
            "old",
        )
        .await
    });
    eventually("token 1 arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    let r = put(&b.url("/d/y"), "2").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.json()["type"],
        "urn:fencegate:problem:older-write-in-flight"
    );
    assert_eq!(up.arrivals(), 1, "token 2 reached the backend");
    assert_eq!(old.await.unwrap().status, 200);
    let r = put(&b.url("/d/y"), "2").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let rec = up.records();
    assert!(
        rec[1].arrived >= rec[0].completed,
        "token 2 overtook token 1"
    );
}

/// The admission calls (acquire, poll, registration check) a replica made
/// so far.
async fn admission_calls(p: &Proxy) -> u64 {
    store_calls(p, "acquire_lease").await
        + store_calls(p, "poll_lease").await
        + store_calls(p, "confirm_highest").await
}

/// Store calls of one kind a replica made so far (its latency histogram's
/// count).
async fn store_calls(p: &Proxy, op: &str) -> u64 {
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    let needle = format!("fencegate_store_latency_seconds_count{{op=\"{op}\"}} ");
    m.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Writes of the token a replica has registered on a key go on that
/// registration: steady traffic costs a store call per check period, not
/// per write. A newer token through the other replica is not starved by
/// it: it goes within the check period plus the writes in flight, and from
/// then on the older token is refused everywhere; the backend never sees
/// the older token after the newer one.
async fn steady_writes_share_a_registration(kind: Spec) {
    let c = Cluster::start(kind, "5s").await;
    assert_eq!(put(&c.a.url("/steady"), "5").await.status, 200);
    let before = admission_calls(&c.a).await;
    // 8 writers x 25 writes of token 5, each held 5 ms by the backend.
    let burst = |n: usize| {
        let url = c.a.url("/steady");
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let mut statuses = Vec::new();
                for _ in 0..n {
                    let a = send(
                        "PUT",
                        &url,
                        &[("x-fence-token", "5"), ("x-test-delay-ms", "5")],
                        "x",
                    )
                    .await;
                    statuses.push(a.status.as_u16());
                }
                statuses
            }));
        }
        tasks
    };
    let started = Instant::now();
    for t in burst(25) {
        assert!(t.await.unwrap().iter().all(|s| *s == 200));
    }
    let took = started.elapsed();
    let calls = admission_calls(&c.a).await - before;
    // One check per period at most, plus writes that came while a
    // registration was being taken or checked.
    let periods = (took.as_millis() / 50 + 1) as u64;
    assert!(
        calls <= 2 * periods + 16,
        "200 steady writes in {took:?} cost {calls} store calls"
    );
    // Token 5 keeps coming through a while token 6 goes through b.
    let writers = burst(60);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let newer = put(&c.b().url("/steady"), "6").await;
    assert_eq!(newer.status, 200, "{}", newer.text());
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "the newer token waited {:?}",
        t0.elapsed()
    );
    let mut refused = 0;
    for t in writers {
        let statuses = t.await.unwrap();
        assert!(
            statuses.iter().all(|s| *s == 200 || *s == 409),
            "{statuses:?}"
        );
        refused += statuses.iter().filter(|s| **s == 409).count();
    }
    assert!(refused > 0, "token 5 was never refused after token 6");
    let a = put(&c.a.url("/steady"), "5").await;
    assert_eq!(a.status, 409, "{}", a.text());
    let r = c.up.records();
    let six = r.iter().find(|x| x.token.as_deref() == Some("6")).unwrap();
    assert!(
        r.iter()
            .filter(|x| x.token.as_deref() == Some("5"))
            .all(|x| x.arrived <= six.arrived && x.completed <= six.arrived),
        "a token-5 write reached the backend after token 6"
    );
}

/// A fence raised through the admin API on one replica cuts off the older
/// token on the other from the raise's answer on, even while the other
/// admits that token on its registration.
async fn a_raise_cuts_off_registered_writes(kind: Spec) {
    let c = Cluster::start(kind, "5s").await;
    let url = c.a.url("/raised");
    let writer = tokio::spawn(async move {
        let mut last_ok = None;
        for _ in 0..400 {
            let a = send("PUT", &url, &[("x-fence-token", "5")], "x").await;
            if a.status == 200 {
                last_ok = Some(Instant::now());
            } else {
                assert_eq!(a.status, 409, "{}", a.text());
                break;
            }
        }
        last_ok
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = send(
        "POST",
        &c.b().admin_url("/v1/fences/default:%2Fraised"),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        r#"{"token": "9"}"#,
    )
    .await;
    let answered = Instant::now();
    assert!(r.status.is_success(), "{} {}", r.status, r.text());
    writer
        .await
        .unwrap()
        .expect("token 5 went before the raise");
    let r = c.up.records();
    assert!(
        r.iter()
            .filter(|x| x.token.as_deref() == Some("5"))
            .all(|x| x.arrived <= answered),
        "token 5 reached the backend after the raise answered"
    );
}

/// A replica refuses to start, naming the store and the cause, on a store
/// whose certificate its CA did not sign or that refuses its password; a
/// password never shows in what fencegate prints.
async fn wrong_ca_or_password_stops_the_start(kind: Spec) {
    assert!(kind.secure);
    let store = kind.start();
    let up = start_upstream().await;
    let sec = store.secure.as_ref().unwrap();
    let engine = match kind.kind {
        StoreKind::Redis => "redis",
        StoreKind::RedisCluster => "redis cluster",
        StoreKind::Postgres => "postgres",
        StoreKind::Etcd => "etcd",
        StoreKind::Embedded => unreachable!(),
    };
    let with = |flag: &str, value: &str| {
        let mut args = store.proxy_args();
        let i = args.iter().position(|a| a == flag).unwrap();
        args[i + 1] = value.to_string();
        args
    };
    let refused = |args: Vec<String>| {
        ProxyBuilder::new(&up.url(), store.dir.path())
            .store_url(&store.url())
            .args(&["--store-timeout", "2s"])
            .args(&args.iter().map(String::as_str).collect::<Vec<_>>())
            .start_refused()
    };
    let (status, stderr) = refused(with("--store-ca", sec.wrong_ca.to_str().unwrap()));
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("refused the connection") && stderr.contains(engine),
        "{stderr}"
    );
    assert!(stderr.contains("UnknownIssuer"), "{stderr}");
    let wrong = store.dir.path().join("wrong-password");
    std::fs::write(
        &wrong,
        "not-the-password
",
    )
    .unwrap();
    let (status, stderr) = refused(with("--store-password-file", wrong.to_str().unwrap()));
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("refused the connection") && stderr.contains(engine),
        "{stderr}"
    );
    assert!(!stderr.contains("not-the-password"), "{stderr}");
    assert_eq!(up.arrivals(), 0);
    // The right settings start, and a password given in the URL is shown
    // redacted.
    let mut url = store.url();
    url = url.replacen("fencegate@", &format!("fencegate:{}@", sec.password), 1);
    let mut args = store.proxy_args();
    args.truncate(args.len() - 2);
    let out = std::process::Command::new(bin())
        .args([
            "check-config",
            "/dev/null",
            "--upstream",
            &up.url(),
            "--store",
            &url,
        ])
        .args(&args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains(&sec.password), "{text}");
    assert!(text.contains("fencegate:****@"), "{text}");
    let p = ProxyBuilder::new(&up.url(), store.dir.path())
        .store_url(&url)
        .args(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .spawn();
    assert_eq!(put(&p.url("/tls"), "1").await.status, 200);
}

/// Redis holds no write lease within `d` (a lease TTL here is ~12 s).
async fn no_leases_within(store: &StoreServer, d: Duration) {
    let deadline = Instant::now() + d;
    while store.redis_leases().await > 0 {
        assert!(Instant::now() < deadline, "a lease is still held in Redis");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`suite!`] for each `(module, store)` with the same cases.
macro_rules! suites {
    ([$(($store:ident, $kind:expr)),* $(,)?], $cases:tt) => {
        $(suite!($store, $kind, $cases);)*
    };
}

macro_rules! suite {
    ($store:ident, $kind:expr, [$($case:ident),*]) => {
        mod $store {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case($kind).await
                }
            )*
        }
    };
}

suite!(
    embedded,
    plain(StoreKind::Embedded),
    [
        tokens_across_replicas,
        full_u64_range,
        ordering_across_replicas,
        copy_overtaken_across_replicas,
        racing_tokens_on_one_key,
        concurrent_advances_then_kill_9,
        replica_killed_mid_write
    ]
);
// Every shared store, the same cases. The cluster (three primaries) runs
// as a whole, as a lone Redis does: every fault hits every node (faults of
// one shard are in tests/redis_cluster.rs).
suites!(
    [
        (redis, plain(StoreKind::Redis)),
        (redis_cluster, plain(StoreKind::RedisCluster)),
        (postgres, plain(StoreKind::Postgres)),
        (etcd, plain(StoreKind::Etcd)),
    ],
    [
        a_rollback_seen_once_survives_restarts,
        a_rollback_while_every_replica_was_down_is_caught_by_state_files,
        batches_answer_each_write_right,
        kill_9_mid_batch_loses_nothing_acknowledged,
        steady_writes_share_a_registration,
        a_raise_cuts_off_registered_writes,
        tokens_across_replicas,
        full_u64_range,
        ordering_across_replicas,
        copy_overtaken_across_replicas,
        racing_tokens_on_one_key,
        concurrent_advances_then_kill_9,
        store_outage_fails_closed_and_heals,
        a_store_restart_fails_no_write,
        a_restored_backup_is_caught_by_every_replica,
        replica_killed_mid_write,
        a_wiped_store_is_refused_until_confirmed,
        a_new_store_needs_init_store
    ]
);

// The same cases over TLS with client certificates and a password-protected
// user, as these stores run in production.
suite!(
    redis_tls,
    secure(StoreKind::Redis),
    [
        tokens_across_replicas,
        a_restored_backup_is_caught_by_every_replica,
        ordering_across_replicas,
        racing_tokens_on_one_key,
        concurrent_advances_then_kill_9,
        store_outage_fails_closed_and_heals,
        a_store_restart_fails_no_write,
        replica_killed_mid_write,
        a_wiped_store_is_refused_until_confirmed,
        a_new_store_needs_init_store,
        wrong_ca_or_password_stops_the_start
    ]
);
suite!(
    redis_cluster_tls,
    secure(StoreKind::RedisCluster),
    [
        tokens_across_replicas,
        a_restored_backup_is_caught_by_every_replica,
        ordering_across_replicas,
        racing_tokens_on_one_key,
        store_outage_fails_closed_and_heals,
        a_wiped_store_is_refused_until_confirmed,
        a_new_store_needs_init_store,
        wrong_ca_or_password_stops_the_start
    ]
);
suite!(
    postgres_tls,
    secure(StoreKind::Postgres),
    [
        tokens_across_replicas,
        a_restored_backup_is_caught_by_every_replica,
        ordering_across_replicas,
        racing_tokens_on_one_key,
        concurrent_advances_then_kill_9,
        store_outage_fails_closed_and_heals,
        replica_killed_mid_write,
        a_wiped_store_is_refused_until_confirmed,
        a_new_store_needs_init_store,
        wrong_ca_or_password_stops_the_start
    ]
);
suite!(
    etcd_tls,
    secure(StoreKind::Etcd),
    [
        tokens_across_replicas,
        a_restored_backup_is_caught_by_every_replica,
        ordering_across_replicas,
        racing_tokens_on_one_key,
        concurrent_advances_then_kill_9,
        store_outage_fails_closed_and_heals,
        replica_killed_mid_write,
        a_wiped_store_is_refused_until_confirmed,
        a_new_store_needs_init_store,
        wrong_ca_or_password_stops_the_start
    ]
);

/// A TCP relay in front of a store server for one replica: while `slow`,
/// an answer to a call that named the marker is held back `delay` before
/// it is passed on (each call still inside the store timeout); `sever`
/// closes every connection, so the replica reconnects (a new session).
struct SlowRelay {
    addr: std::net::SocketAddr,
    slow: Arc<std::sync::atomic::AtomicBool>,
    conns: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    task: tokio::task::JoinHandle<()>,
}

impl SlowRelay {
    async fn start(to: std::net::SocketAddr, delay: Duration) -> SlowRelay {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let slow = Arc::new(AtomicBool::new(false));
        let conns: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (s, c) = (slow.clone(), conns.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                    continue;
                };
                let slow = s.clone();
                let relay = tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    // Answers still to hold back: one per chunk that named
                    // the marker.
                    let held = Arc::new(AtomicUsize::new(0));
                    let h = held.clone();
                    let up = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            let chunk = &buf[..n];
                            if slow.load(Ordering::Acquire)
                                && chunk.windows(16).any(|w| w == b"fencegate:marker")
                            {
                                h.fetch_add(1, Ordering::AcqRel);
                            }
                            if sw.write_all(chunk).await.is_err() {
                                return;
                            }
                        }
                    };
                    let down = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match sr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if held
                                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                                    v.checked_sub(1)
                                })
                                .is_ok()
                            {
                                tokio::time::sleep(delay).await;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                    }
                });
                c.lock().unwrap().push(relay.abort_handle());
            }
        });
        SlowRelay {
            addr,
            slow,
            conns,
            task,
        }
    }

    fn sever(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl Drop for SlowRelay {
    fn drop(&mut self) {
        self.sever();
        self.task.abort();
    }
}

/// A write's first admission on a shared store, after a slow store and a
/// new connection (whose marker check runs before the answer is used)
/// took longer than the lease's slack: the lease, counted from before the
/// acquire, could end before the write's deadline, and a newer token
/// through another replica would then find no older lease and go ahead of
/// it. The write must not be forwarded with a deadline its lease does not
/// cover.
#[tokio::test(flavor = "multi_thread")]
async fn a_first_write_never_outlives_its_lease_on_a_slow_store() {
    let store = StoreServer::start(StoreKind::Redis);
    let up = start_upstream().await;
    let to: std::net::SocketAddr = format!("127.0.0.1:{}", store.port).parse().unwrap();
    // Each marker call answers in 1.8 s, inside the 2 s store timeout; a
    // marker check (a read and a bump) takes 3.6 s, more than the lease's
    // slack (store timeout + 0.75 s).
    let relay = SlowRelay::start(to, Duration::from_millis(1800)).await;
    let replica = |url: &str| {
        ProxyBuilder::new(&up.url(), store.dir.path())
            .store_url(url)
            .args(&["--upstream-timeout", "2s", "--store-timeout", "2s"])
            .spawn()
    };
    let a = replica(&format!("redis://{}/0", relay.addr));
    let b = replica(&store.url());
    assert_eq!(put(&a.url("/warm"), "1").await.status, 200);
    relay.slow.store(true, std::sync::atomic::Ordering::Release);
    relay.sever();
    // Token 2 through a, slow to apply (1.9 s of its 2 s limit); token 3
    // through b, tried until it goes.
    let url = a.url("/k");
    let old = tokio::spawn(async move {
        let headers = [("x-fence-token", "2"), ("x-test-delay-ms", "1900")];
        send("PUT", &url, &headers, "old").await
    });
    // Token 2's lease is in the store before token 3 is tried.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.redis_leases().await == 0 {
        assert!(Instant::now() < deadline, "token 2 never registered");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = put(&b.url("/k"), "3").await;
        if r.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "token 3 never went: {}",
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let old = old.await.unwrap();
    let records = up.records();
    let at = |t: &str| records.iter().find(|r| r.token.as_deref() == Some(t));
    let three = at("3").expect("token 3 applied");
    if let Some(two) = at("2") {
        assert!(
            three.arrived >= two.completed,
            "token 3 reached the backend while token 2 was still being applied (token 2 answered {})",
            old.status
        );
    } else {
        // Refused (the lease could not cover it; on a slow machine perhaps
        // a store timeout first): never forwarded, which is what matters.
        assert_eq!(old.status, 503, "{}", old.text());
    }
}

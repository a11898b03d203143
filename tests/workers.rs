//! Several worker threads (`--workers`): connections land on all of them,
//! and the drain, a SIGHUP reload and per-key ordering reach every one.

mod common;

use std::time::Duration;

use common::*;

const WORKERS: usize = 4;

/// Connections accepted by each worker on the plain listener.
async fn per_worker(p: &Proxy) -> Vec<f64> {
    let mut counts = Vec::new();
    for w in 0..WORKERS {
        let line =
            format!("fencegate_worker_connections_total{{listener=\"proxy\",worker=\"{w}\"}}");
        counts.push(metric(p, &line).await.unwrap_or(0.0));
    }
    counts
}

fn workers(upstream: &str, dir: &std::path::Path) -> ProxyBuilder {
    ProxyBuilder::new(upstream, dir).args(&["--workers", &WORKERS.to_string()])
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_land_on_every_worker() {
    let up = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let p = workers(&up.url(), dir.path()).spawn();
    assert_eq!(metric(&p, "fencegate_workers ").await, Some(WORKERS as f64));
    // `send` opens a connection of its own each time; the kernel spreads
    // them over the workers' sockets by their source ports (64 over 4: all
    // get some unless the hash is badly broken, odds about 4e-8).
    for i in 0..64 {
        let a = put(&p.url(&format!("/spread/{i}")), "1").await;
        assert_eq!(a.status, 200);
    }
    let counts = per_worker(&p).await;
    assert_eq!(counts.iter().sum::<f64>(), 64.0, "{counts:?}");
    assert!(
        counts.iter().all(|&c| c > 0.0),
        "a worker got no connection: {counts:?}"
    );
    assert_eq!(up.count(), 64);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_fencegate_cannot_bind_beside_the_workers_and_leaves_no_store() {
    let up = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let p = workers(&up.url(), dir.path()).spawn();
    let other = tempfile::tempdir().unwrap();
    let (status, log) = workers(&up.url(), other.path())
        .listen(&p.addr.to_string())
        .start_refused();
    assert!(!status.success());
    assert!(
        log.contains("cannot listen on") && log.contains("`listen`"),
        "{log}"
    );
    // Listeners are bound before the store is opened: the failed start
    // left no new store file behind.
    assert!(
        !other.path().join("fences.redb").exists(),
        "a start that failed on its port created the store file"
    );
    // The running one still serves.
    assert_eq!(put(&p.url("/still"), "1").await.status, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_drain_waits_for_writes_on_every_worker() {
    let up = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let mut p = workers(&up.url(), dir.path()).spawn();
    // The kernel spreads connections over the workers by a hash of their
    // source ports, unevenly for a few dozen; keep opening slow writes (a
    // bounded number) until every worker holds at least one.
    let mut writes = Vec::new();
    let mut counts = per_worker(&p).await;
    while counts.contains(&0.0) && writes.len() < 128 {
        for _ in 0..8 {
            let url = p.url(&format!("/drain/{}", writes.len()));
            writes.push(slow_put(url, "1", "4000"));
        }
        let n = writes.len();
        eventually("every write upstream", Duration::from_secs(10), || {
            up.arrivals() == n
        })
        .await;
        counts = per_worker(&p).await;
    }
    assert!(
        counts.iter().all(|&c| c > 0.0),
        "a worker has no write in flight after {} writes: {counts:?}",
        writes.len()
    );
    let writes_sent = writes.len();
    let status = p.sigterm();
    for w in writes {
        assert_eq!(w.await.unwrap().status, 200, "a write was cut by the drain");
    }
    assert!(
        status.success(),
        "not a clean stop: {status:?}\n{}",
        p.stderr()
    );
    assert_eq!(up.count(), writes_sent);
    // Clean: the restart holds nothing, a newer token goes at once.
    p.restart();
    assert_eq!(put(&p.url("/drain/0"), "2").await.status, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reload_reaches_every_worker() {
    let first = start_upstream().await;
    let second = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.toml");
    let routes =
        |upstream: &str| format!("[[routes]]\nname = \"objects\"\nupstream = \"{upstream}\"\n");
    write_config(&config, &routes(&first.url()));
    let p = ProxyBuilder::with_config(&config, dir.path())
        .args(&["--workers", &WORKERS.to_string()])
        .spawn();
    // Every worker has a pooled connection to the first upstream.
    for i in 0..32 {
        assert_eq!(put(&p.url(&format!("/r/{i}")), "1").await.status, 200);
    }
    assert!(per_worker(&p).await.iter().all(|&c| c > 0.0));
    write_config(&config, &routes(&second.url()));
    signal(p.child.id(), "HUP");
    eventually_async("the reload", || async {
        metric(&p, "fencegate_reloads_total{result=\"ok\",what=\"config\"}").await == Some(1.0)
    })
    .await;
    let before = per_worker(&p).await;
    for i in 0..32 {
        assert_eq!(put(&p.url(&format!("/r/{i}")), "2").await.status, 200);
    }
    let after = per_worker(&p).await;
    assert!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "every worker served after the reload: {before:?} -> {after:?}"
    );
    assert_eq!((first.count(), second.count()), (32, 32));
}

#[tokio::test(flavor = "multi_thread")]
async fn ordering_holds_across_workers() {
    let up = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let p = workers(&up.url(), dir.path()).spawn();
    let older = slow_put(p.url("/ordered"), "5", "800");
    eventually("the older write upstream", Duration::from_secs(10), || {
        up.arrivals() == 1
    })
    .await;
    // Newer writes on connections of their own, so on several workers.
    let newer: Vec<_> = (0..8)
        .map(|_| {
            let url = p.url("/ordered");
            tokio::spawn(async move { put(&url, "6").await })
        })
        .collect();
    assert_eq!(put(&p.url("/ordered"), "4").await.status, 409);
    assert_eq!(older.await.unwrap().status, 200);
    for n in newer {
        assert_eq!(n.await.unwrap().status, 200);
    }
    let records = up.records();
    let first = records
        .iter()
        .find(|r| r.token.as_deref() == Some("5"))
        .unwrap();
    for r in records.iter().filter(|r| r.token.as_deref() == Some("6")) {
        assert!(
            r.arrived >= first.completed,
            "a newer write overtook the older one"
        );
    }
    assert_eq!(records.len(), 9);
    assert!(per_worker(&p).await.iter().filter(|&&c| c > 0.0).count() >= 2);
}

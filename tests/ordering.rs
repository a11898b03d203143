//! Ordering at the backend: a newer token is not forwarded while an older
//! write to the key is in flight; queued older writes turn stale.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_newer_token_waits_for_the_older_write_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let old = slow_put(p.url("/k"), "1", "700");
    eventually("old write arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    let new = slow_put(p.url("/k"), "2", "0");
    assert_eq!(old.await.unwrap().status, 200);
    assert_eq!(new.await.unwrap().status, 200);
    let r = up.records();
    let (r1, r2) = (&r[0], &r[1]);
    assert_eq!(
        (r1.token.as_deref(), r2.token.as_deref()),
        (Some("1"), Some("2"))
    );
    assert!(
        r2.arrived >= r1.completed,
        "token 2 reached the backend before token 1 was applied"
    );
    // A different key is not held up.
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(
        &m,
        "fencegate_admission_wait_seconds_count{route=\"default\"}",
        2.0,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn queued_older_writes_get_409_once_a_newer_token_is_admitted() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let t1 = slow_put(p.url("/q"), "1", "1000");
    eventually("token 1 arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    // Token 2 is admitted (raised) but must wait behind token 1.
    let t2 = slow_put(p.url("/q"), "2", "0");
    queued(&p, 1).await;
    assert_eq!(up.arrivals(), 1, "token 2 must not be forwarded yet");
    // Token 3 arrives: token 2, still queued, is now stale.
    let t3 = slow_put(p.url("/q"), "3", "0");
    let a2 = t2.await.unwrap();
    assert_eq!(a2.status, 409, "{}", a2.text());
    assert_eq!(a2.header("x-fence-token-highest"), Some("3"));
    assert_eq!(t1.await.unwrap().status, 200);
    assert_eq!(t3.await.unwrap().status, 200);
    let r = up.records();
    let tokens: Vec<_> = r.iter().map(|x| x.token.clone().unwrap()).collect();
    assert_eq!(tokens, ["1", "3"]);
    assert!(r[1].arrived >= r[0].completed);
}

#[tokio::test(flavor = "multi_thread")]
async fn equal_tokens_are_not_serialized_and_keys_are_independent() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let a = slow_put(p.url("/e"), "1", "600");
    let b = slow_put(p.url("/e"), "1", "600");
    let other = slow_put(p.url("/other"), "9", "600");
    eventually(
        "three writes in flight together",
        Duration::from_secs(5),
        || up.arrivals() == 3,
    )
    .await;
    assert_eq!(up.count(), 0, "all three arrived before any completed");
    for t in [a, b, other] {
        assert_eq!(t.await.unwrap().status, 200);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_wait_is_bounded_by_the_upstream_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    // Margins for a busy machine: the newer write must be queued within
    // the 2 s timeout of the older one, and forwarded well before the
    // backend's 5 s.
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "2s"])
        .spawn();
    // The old write outlives the timeout: the proxy answers 504 and stops
    // holding the key; the newer write then goes.
    let old = slow_put(p.url("/b"), "1", "5000");
    eventually("old arrived", Duration::from_secs(5), || up.arrivals() == 1).await;
    let new = slow_put(p.url("/b"), "2", "0");
    queued(&p, 1).await;
    assert_eq!(old.await.unwrap().status, 504);
    assert_eq!(new.await.unwrap().status, 200);
    // The backend finishes token 1 at 5 s: then both records are in.
    eventually("token 1 applied", Duration::from_secs(10), || {
        up.count() == 2
    })
    .await;
    let r = up.records();
    let older = r.iter().find(|r| r.token.as_deref() == Some("1")).unwrap();
    let newer = r.iter().find(|r| r.token.as_deref() == Some("2")).unwrap();
    // Token 1 was admitted before it arrived: its 2 s deadline came at
    // most a little before `arrived + 2 s`. Not before that...
    let gap = newer.arrived - older.arrived;
    assert!(
        gap >= Duration::from_millis(1900),
        "token 2 arrived {gap:?} after token 1, before its deadline"
    );
    // ...and not held until the backend finished it (5 s) either.
    assert!(
        newer.arrived < older.completed,
        "token 2 waited for the backend, not for the deadline"
    );
    // The old write ended at its deadline (504), so token 2 did not have
    // to go ahead of a write still registered in flight.
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(
        &m,
        "fencegate_admission_waited_out_total{route=\"default\"}",
        0.0,
    );
    assert_series(
        &m,
        "fencegate_writes_total{decision=\"admitted\",route=\"default\"}",
        2.0,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_hanging_up_does_not_end_its_write_early() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    // Token 1 is sent in full, then its client disconnects while the
    // backend is still applying it.
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    s.write_all(b"PUT /h HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-Test-Delay-Ms: 800\r\nContent-Length: 1\r\n\r\nx")
        .await
        .unwrap();
    eventually("token 1 arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    drop(s);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(slow_put(p.url("/h"), "2", "0").await.unwrap().status, 200);
    let r = up.records();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].token.as_deref(), Some("1"));
    assert!(
        r[1].arrived >= r[0].completed,
        "token 2 overtook token 1 in flight"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_copy_overtaken_on_one_key_while_waiting_on_another_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    // An older write to /z is in flight.
    let z = slow_put(p.url("/z"), "4", "3000");
    eventually("z in flight", Duration::from_secs(5), || up.arrivals() == 1).await;
    // COPY /z -> /a with token 5: takes /a, then waits behind /z.
    let url = p.url("/z");
    let copy = tokio::spawn(async move {
        send(
            "COPY",
            &url,
            &[("destination", "/a"), ("x-fence-token", "5")],
            "",
        )
        .await
    });
    queued(&p, 1).await;
    // A newer holder takes /a meanwhile.
    let newer = slow_put(p.url("/a"), "7", "0");
    let c = copy.await.unwrap();
    assert_eq!(c.status, 409, "{}", c.text());
    assert_eq!(c.header("x-fence-token-highest"), Some("7"));
    assert_eq!(newer.await.unwrap().status, 200);
    assert_eq!(z.await.unwrap().status, 200);
    assert!(
        up.records().iter().all(|r| r.method != "COPY"),
        "the overtaken COPY was applied"
    );
}

/// Two routes fence one key with different upstream timeouts. The newer
/// write's shorter limit must not let it overtake the older write, which is
/// still within its own (longer) timeout: it is refused (503), not sent.
#[tokio::test(flavor = "multi_thread")]
async fn a_shorter_timeout_on_another_route_does_not_overtake() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let cfg = dir.path().join("routes.toml");
    write_config(&cfg, &two_routes_sharing_keys(&up.url()));
    let p = ProxyBuilder::with_config(&cfg, dir.path()).spawn();
    let old = slow_put(p.url("/d/slow/x"), "1", "3000");
    eventually("token 1 arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    let started = std::time::Instant::now();
    let a = send("PUT", &p.url("/d/y"), &[("x-fence-token", "2")], "new").await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(
        a.json()["type"],
        "urn:fencegate:problem:older-write-in-flight"
    );
    // It waited its own limit for the older write first.
    assert!(started.elapsed() >= Duration::from_millis(900));
    let retry: u64 = a.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry), "{retry}");
    assert_eq!(up.arrivals(), 1, "token 2 reached the backend");
    assert_eq!(old.await.unwrap().status, 200);
    // Once token 1 is applied, the retry goes at once.
    let a = put(&p.url("/d/y"), "2").await;
    assert_eq!(a.status, 200, "{}", a.text());
    let r = up.records();
    assert_eq!(r.len(), 2);
    assert!(r[1].arrived >= r[0].completed, "token 2 overtook token 1");
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(
        &m,
        "fencegate_writes_total{decision=\"older_in_flight\",route=\"fast\"}",
        1.0,
    );
}

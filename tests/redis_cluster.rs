//! The Redis Cluster store (`redis+cluster://`) on a real cluster of three
//! primaries with a replica each (`redis-cli --cluster create`), with two
//! fencegate replicas: the fence holds in every group, a new cluster needs
//! `init-store`, and a shard that comes back empty has its groups refused
//! until an operator confirms while the other shards keep taking writes.
//! The failover and resharding runs under load are in tests/history.rs.

mod common;

use std::time::Duration;

use common::cluster::RedisCluster;
use common::servers::init_store;
use common::*;
use fencegate::store::redis::cluster::{group_of, group_tag, GROUPS};

/// One path per group (on the default route, whose fence key is
/// `default:PATH`): the first `/g<g>-<n>` that falls in group `g`.
fn path_in_group(g: usize) -> String {
    (0..)
        .map(|n| format!("/g{g}-{n}"))
        .find(|p| group_of(&format!("default:{p}")) == g)
        .unwrap()
}

struct Setup {
    cluster: RedisCluster,
    up: Upstream,
    dir: tempfile::TempDir,
}

impl Setup {
    async fn start(node_timeout: Duration) -> Setup {
        let cluster = tokio::task::spawn_blocking(move || RedisCluster::start(node_timeout))
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("admin-token"), ADMIN_TOKEN).unwrap();
        Setup {
            cluster,
            up: start_upstream().await,
            dir,
        }
    }

    fn replica(&self, name: &str) -> ProxyBuilder {
        let d = self.dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        ProxyBuilder::new(&self.up.url(), &d)
            .store_url(&self.cluster.url())
            .args(&["--store-timeout", "2s"])
            .args(&[
                "--admin-token-file",
                self.dir.path().join("admin-token").to_str().unwrap(),
            ])
    }
}

/// The primary's port serving group `g`.
fn primary_of_group(c: &RedisCluster, g: usize) -> u16 {
    c.primary_of(c.slot_of(&group_tag(g)))
        .expect("a primary serves the group")
}

#[tokio::test(flavor = "multi_thread")]
async fn every_group_fences_across_replicas() {
    let s = Setup::start(Duration::from_millis(2000)).await;
    init_store(&s.cluster.url());
    let (a, b) = (s.replica("a").spawn(), s.replica("b").spawn());
    for g in 0..GROUPS {
        let p = path_in_group(g);
        assert_eq!(put(&a.url(&p), "5").await.status, 200, "{p}");
        let r = put(&b.url(&p), "4").await;
        assert_eq!(r.status, 409, "{p}: {}", r.text());
        assert_eq!(put(&b.url(&p), "6").await.status, 200, "{p}");
        assert_eq!(put(&a.url(&p), "5").await.status, 409, "{p}");
        assert_eq!(put(&a.url(&p), "18446744073709551615").await.status, 200);
        assert_eq!(put(&b.url(&p), "18446744073709551614").await.status, 409);
    }
    assert_eq!(
        s.up.arrivals(),
        GROUPS * 3,
        "only the admitted writes arrived"
    );
    // Each group's fence is in its own slot, on the primary that serves it.
    let primaries: std::collections::HashSet<u16> = (0..GROUPS)
        .map(|g| primary_of_group(&s.cluster, g))
        .collect();
    assert_eq!(primaries.len(), 3, "the groups spread over every primary");
}

/// A cluster nobody initialised is refused at start; `init-store` marks
/// every group once.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_cluster_needs_init_store() {
    let s = Setup::start(Duration::from_millis(2000)).await;
    let (status, stderr) = s.replica("a").start_refused();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("init-store"), "{stderr}");
    init_store(&s.cluster.url());
    init_store(&s.cluster.url());
    let a = s.replica("a").spawn();
    assert_eq!(put(&a.url("/n"), "4").await.status, 200);
    assert_eq!(put(&a.url("/n"), "3").await.status, 409);
}

/// A primary killed and started again empty (its append-only file lost)
/// before the cluster fails it over: its groups come back with no fence
/// and no marker, and its replica copies the empty data set. Writes to
/// those groups are refused (a stale token would pass a store that
/// forgot) until an operator confirms; the other shards take writes all
/// along. Confirmed, the fences this replica saw are written back.
#[tokio::test(flavor = "multi_thread")]
async fn a_shard_restarted_empty_is_refused_alone_until_confirmed() {
    // Long enough that the restart is back before any failover.
    let mut s = Setup::start(Duration::from_secs(30)).await;
    init_store(&s.cluster.url());
    let a = s.replica("a").spawn();
    // B never sees the written keys: what stops its stale writes is the
    // marker, not a token it remembers.
    let b = s.replica("b").spawn();
    let paths: Vec<String> = (0..GROUPS).map(path_in_group).collect();
    for p in &paths {
        assert_eq!(put(&a.url(p), "5").await.status, 200, "{p}");
    }
    let victim = primary_of_group(&s.cluster, 0);
    let (lost, kept): (Vec<usize>, Vec<usize>) =
        (0..GROUPS).partition(|g| primary_of_group(&s.cluster, *g) == victim);
    assert!(!lost.is_empty() && !kept.is_empty());
    let applied = s.up.arrivals();
    {
        let node = s.cluster.node(victim);
        node.kill9();
        std::fs::remove_dir_all(node.dir.join("appendonlydir")).unwrap();
    }
    s.cluster.node(victim).restart();
    // Stale tokens on the emptied groups, at once (before any heartbeat
    // could have looked), through the replica that never saw them: never
    // admitted.
    let first = &paths[lost[0]];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = put(&b.url(first), "3").await;
        assert_ne!(
            r.status,
            200,
            "a stale write admitted on {first}: {}",
            r.text()
        );
        if r.text().contains("lost data") {
            break;
        }
        // The node coming back (connection refused, loading): unavailable.
        assert_eq!(r.status, 503, "{first}: {}", r.text());
        assert!(std::time::Instant::now() < deadline, "{}", r.text());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for g in &lost {
        let r = put(&b.url(&paths[*g]), "3").await;
        assert_eq!(r.status, 503, "{}: {}", paths[*g], r.text());
    }
    s.cluster.wait_settled();
    for g in &lost {
        let r = put(&a.url(&paths[*g]), "3").await;
        assert_eq!(r.status, 503, "{}: {}", paths[*g], r.text());
    }
    // The other shards take writes, now and after the heartbeat saw the loss.
    eventually_async("the replica reports amnesia", || async {
        metric(&a, "fencegate_store_amnesia ").await == Some(1.0)
    })
    .await;
    for g in &kept {
        assert_eq!(
            put(&a.url(&paths[*g]), "6").await.status,
            200,
            "{}",
            paths[*g]
        );
        assert_eq!(put(&a.url(&paths[*g]), "4").await.status, 409);
    }
    let r = put(&a.url(&paths[lost[0]]), "7").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("lost data"), "{}", r.text());
    // Readiness, the metrics and the probe name the shard that lost its
    // data, and say the others serve.
    let victim_name = format!("127.0.0.1:{victim}");
    assert_shards(&a, &victim_name, lost.len()).await;
    let probe = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["probe", &a.admin_url("/readyz")])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&probe.stderr);
    assert!(probe.status.success(), "{said}");
    assert!(
        said.contains("degraded") && said.contains(&victim_name),
        "{said}"
    );
    // A replica started now, having never seen the store whole, starts:
    // it finds the lost groups without their marker while the others have
    // theirs, and refuses only those.
    let c = s.replica("c").spawn();
    let r = put(&c.url(&paths[lost[0]]), "9").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("lost data"), "{}", r.text());
    assert_eq!(put(&c.url(&paths[kept[0]]), "5").await.status, 409);
    assert_shards(&c, &victim_name, lost.len()).await;
    // The status page names the groups in amnesia.
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let status = send(
        "GET",
        &a.admin_url("/v1/status"),
        &[("authorization", &auth)],
        "",
    )
    .await
    .text();
    assert!(
        status.contains(&format!("{} of {GROUPS} groups", lost.len())),
        "{status}"
    );
    assert_eq!(
        s.up.arrivals(),
        applied + kept.len(),
        "nothing else arrived"
    );
    // init-store will not mark the lost groups as new.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["init-store", "--store", &s.cluster.url()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("confirm-reset"), "{stderr}");
    assert!(
        stderr.contains(&victim_name),
        "the shard is named: {stderr}"
    );
    // The operator confirms on each replica; A writes back what it knew.
    for p in [&a, &b, &c] {
        let r = send(
            "POST",
            &p.admin_url("/v1/store/confirm-reset"),
            &[("authorization", &auth)],
            "",
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    for g in &lost {
        let r = put(&b.url(&paths[*g]), "4").await;
        assert_eq!(r.status, 409, "the fence was written back: {}", r.text());
        assert_eq!(put(&c.url(&paths[*g]), "8").await.status, 200);
        assert_eq!(put(&a.url(&paths[*g]), "7").await.status, 409);
    }
    let ready = send("GET", &c.admin_url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    assert!(
        ready.text().contains(r#""status":"ready""#),
        "{}",
        ready.text()
    );
}

/// `/readyz` answers 200 `degraded` with `victim`'s `lost` groups named
/// and the other shards whole; the per-shard gauges say the same.
async fn assert_shards(p: &Proxy, victim: &str, lost: usize) {
    // Every lost group is found within a heartbeat of its marker check.
    eventually_async("every lost group to be seen", || async {
        let t = send("GET", &p.admin_url("/readyz"), &[], "").await.text();
        serde_json::from_str::<serde_json::Value>(&t).is_ok_and(|v| {
            v["shards"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["shard"] == victim && s["lost"] == lost))
        })
    })
    .await;
    let ready = send("GET", &p.admin_url("/readyz"), &[], "").await;
    let text = ready.text();
    assert_eq!(ready.status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["status"], "degraded", "{text}");
    let shards = v["shards"].as_array().expect("shards");
    assert_eq!(shards.len(), 3, "{text}");
    assert_eq!(
        shards
            .iter()
            .map(|s| s["groups"].as_u64().unwrap())
            .sum::<u64>(),
        GROUPS as u64,
        "{text}"
    );
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    for s in shards {
        let name = s["shard"].as_str().unwrap();
        let up = |v: f64| {
            assert_series(
                &m,
                &format!("fencegate_store_shard_up{{shard=\"{name}\"}}"),
                v,
            )
        };
        let lost_series = format!("fencegate_store_shard_groups_lost{{shard=\"{name}\"}}");
        if name == victim {
            assert_eq!(s["lost"], lost, "{text}");
            assert_eq!(s["groups"], lost, "{text}");
            assert!(s["failing"].as_str().unwrap().contains("{fg"), "{text}");
            assert!(s["error"].as_str().unwrap().contains("marker"), "{text}");
            up(0.0);
            assert_series(&m, &lost_series, lost as f64);
        } else {
            assert_eq!(s["lost"], 0, "{text}");
            assert_eq!(s["unreachable"], 0, "{text}");
            assert!(s["failing"].is_null(), "{text}");
            up(1.0);
            assert_series(&m, &lost_series, 0.0);
        }
    }
}

/// A primary that stops answering (SIGSTOP: its connections stay open,
/// nothing comes back) before any failover: its groups' writes fail
/// closed, and the other shards' writes are admitted all along, through
/// the same connections; `/readyz` says `degraded` and names the shard.
/// Let go, its groups take writes again with no restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_shard_stops_only_its_groups() {
    // Long enough that the cluster fails nothing over meanwhile.
    let mut s = Setup::start(Duration::from_secs(30)).await;
    init_store(&s.cluster.url());
    let a = s.replica("a").spawn();
    let paths: Vec<String> = (0..GROUPS).map(path_in_group).collect();
    for p in &paths {
        assert_eq!(put(&a.url(p), "5").await.status, 200, "{p}");
    }
    let victim = primary_of_group(&s.cluster, 0);
    let (hung, kept): (Vec<usize>, Vec<usize>) =
        (0..GROUPS).partition(|g| primary_of_group(&s.cluster, *g) == victim);
    s.cluster.node(victim).stop();
    // Past two store timeouts (the connection's drop rule) and a few
    // heartbeats: the other shards' writes never stop.
    let until = std::time::Instant::now() + Duration::from_secs(8);
    let mut token = 6u64;
    while std::time::Instant::now() < until {
        for g in &kept {
            let r = put(&a.url(&paths[*g]), &token.to_string()).await;
            assert_eq!(r.status, 200, "{}: {}", paths[*g], r.text());
        }
        token += 1;
    }
    let r = put(&a.url(&paths[hung[0]]), &token.to_string()).await;
    assert_eq!(r.status, 503, "{}", r.text());
    let ready = send("GET", &a.admin_url("/readyz"), &[], "").await;
    let text = ready.text();
    assert_eq!(ready.status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["status"], "degraded", "{text}");
    let name = format!("127.0.0.1:{victim}");
    let shard = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["shard"] == name.as_str())
        .unwrap_or_else(|| panic!("{name} named: {text}"))
        .clone();
    assert_eq!(shard["unreachable"], hung.len(), "{text}");
    // A replica started while the shard hangs: its connection reaches
    // the other shards (the dial waits on the hung node for a while, and
    // goes on past the first calls that give up).
    let c = s.replica("c").spawn();
    // Each of the other shards' groups admits a write. Not every call:
    // each call to the hung shard makes the client refresh its view of
    // the cluster, which holds the others' calls meanwhile (docs/stores.md).
    let failed = admit_each(&c, &kept, &paths, token).await;
    eprintln!(
        "replica started during the hang: {} groups admitted, {failed} calls refused on the way",
        kept.len()
    );
    assert_eq!(
        put(&c.url(&paths[hung[0]]), &token.to_string())
            .await
            .status,
        503
    );
    s.cluster.node(victim).cont();
    // Resumed, the node first works through what queued up meanwhile
    // (the third replica's connects among it): each group takes writes
    // again, and fences as before.
    admit_each(&a, &hung, &paths, token + 1).await;
    for g in &hung {
        assert_eq!(put(&a.url(&paths[*g]), "5").await.status, 409);
    }
}

/// Puts `token` through `p` on each of `groups` until admitted (20 s in
/// all, else fails with its log); the calls refused on the way.
async fn admit_each(p: &Proxy, groups: &[usize], paths: &[String], token: u64) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut refused = 0;
    for g in groups {
        while put(&p.url(&paths[*g]), &token.to_string()).await.status != 200 {
            refused += 1;
            assert!(
                std::time::Instant::now() < deadline,
                "{} admitted no write:\n{}",
                paths[*g],
                p.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    refused
}

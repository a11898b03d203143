//! Shared stores failing over, step by step (the runs under load are in
//! `tests/history.rs`): what a failover may lose, and what fencegate does
//! about it, with the exact losing interleaving made to happen.
//!
//! Redis: the replica is cut off (stopped, and its link closed by the
//! primary) before a write, then the primary is killed and Sentinel
//! promotes the replica, which never got that write. Waiting for one
//! replica refuses the write instead of admitting it, so the failover
//! loses nothing acknowledged (and writes wait for a replica again: the old
//! primary back as one); not waiting admits it, and the loss is caught by
//! amnesia detection, until an operator confirms.

mod common;

use std::time::{Duration, Instant};

use common::cluster::*;
use common::servers::init_store;
use common::*;

const ADMIN_TOKEN: &str = "failover-admin-token-0123456789";

/// Two replicas on one Redis behind Sentinel, in front of one upstream.
struct Replicas {
    redis: RedisSentinels,
    up: Upstream,
    a: Proxy,
    b: Proxy,
    _dir: tempfile::TempDir,
}

impl Replicas {
    /// `replicas_to_wait`: `--store-replicas-to-wait`, or the default.
    async fn start(replicas_to_wait: Option<&str>) -> Replicas {
        let redis = tokio::task::spawn_blocking(RedisSentinels::start)
            .await
            .unwrap();
        init_store(&redis.url());
        let up = start_upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("admin-token");
        std::fs::write(&token_file, ADMIN_TOKEN).unwrap();
        let replica = |name: &str| {
            let d = dir.path().join(name);
            std::fs::create_dir_all(&d).unwrap();
            let wait: Vec<&str> = match replicas_to_wait {
                Some(n) => vec!["--store-replicas-to-wait", n],
                None => Vec::new(),
            };
            ProxyBuilder::new(&up.url(), &d)
                .args(&wait)
                .store_url(&redis.url())
                .args(&["--store-timeout", "1s"])
                // Leases live an upstream timeout plus a margin: a release
                // the failover lost holds newer writes that long.
                .args(&["--upstream-timeout", "2s"])
                .args(&["--admin-token-file", token_file.to_str().unwrap()])
                .spawn()
        };
        let (a, b) = (replica("a"), replica("b"));
        Replicas {
            redis,
            up,
            a,
            b,
            _dir: dir,
        }
    }

    /// Everything the primary has so far is on the replica too.
    fn replicated(&self) {
        let primary = self.redis.primary_port().expect("a primary");
        let mut set = redis::cmd("SET");
        set.arg("test:sync").arg(1);
        let _: Option<String> = redis_query(primary, &set);
        let confirmed: Option<u32> = redis_query(primary, redis::cmd("WAIT").arg(1).arg(5000));
        assert_eq!(confirmed, Some(1), "the replica did not catch up");
    }

    /// The replica stops receiving: stopped (SIGSTOP), and its link closed
    /// by the primary, so nothing more is in flight towards it.
    fn cut_off_the_replica(&mut self) -> u16 {
        let primary = self.redis.primary_port().expect("a primary");
        self.redis.other(primary).stop();
        let killed: Option<u32> = redis_query(
            primary,
            redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("replica"),
        );
        assert_eq!(killed, Some(1), "the replica link was not closed");
        primary
    }

    /// The primary killed, the replica let go on: Sentinel promotes it.
    /// Returns when the promoted replica says it is the primary.
    fn fail_over(&mut self, primary: u16) {
        self.redis.node(primary).kill9();
        self.redis.other(primary).cont();
        self.redis.wait_promoted(primary);
    }

    fn applied(&self, token: &str) -> bool {
        self.up
            .records()
            .iter()
            .any(|r| r.target == "/k" && r.token.as_deref() == Some(token))
    }
}

async fn amnesia(p: &Proxy) -> Option<f64> {
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    series_value(&m, "fencegate_store_amnesia")
}

/// A write retried while it gets a 503 that says to retry (the store
/// cannot answer, an older write's lease is still held), bounded: the
/// answer, and when it came. A refusal for lost data is an answer.
async fn put_through_503(url: &str, token: &str) -> (Answer, Instant) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let a = put(url, token).await;
        let unavailable = a.status == 503 && !a.text().contains("may have lost data");
        if !unavailable || Instant::now() > deadline {
            return (a, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_waiting_for_a_replica_refuses_what_a_failover_would_lose() {
    let mut r = Replicas::start(Some("1")).await;
    assert!(put(&r.a.url("/k"), "5").await.status.is_success());
    let primary = tokio::task::block_in_place(|| r.cut_off_the_replica());
    // No replica confirms it: refused, never forwarded.
    let refused = put(&r.a.url("/k"), "10").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(
        r.a.stderr().contains("0 of 1 replicas confirmed the call"),
        "{}",
        r.a.stderr()
    );
    assert!(!r.applied("10"));
    let fault = Instant::now();
    tokio::task::block_in_place(|| r.fail_over(primary));
    // The promoted replica is alone: nothing can be confirmed, nothing is
    // admitted, until the old primary is back as its replica (Sentinel
    // turns it into one).
    let alone = put(&r.a.url("/k"), "7").await;
    assert_eq!(alone.status, 503, "{}", alone.text());
    tokio::task::block_in_place(|| r.redis.rejoin(primary));
    // The promoted replica has every admitted raise (5), not the refused
    // one: 7 is the newest token the backend would see, and is admitted
    // on both replicas without an operator.
    let (a, resumed) = put_through_503(&r.a.url("/k"), "7").await;
    assert!(a.status.is_success(), "{} {}", a.status, a.text());
    eprintln!(
        "redis failover with store_replicas_to_wait = 1: write outage {:?} (kill -9 of the primary to the first admitted write, the old primary back as a replica), no operator",
        resumed - fault
    );
    let (b, _) = put_through_503(&r.b.url("/k"), "6").await;
    assert_eq!(b.status, 409, "{}", b.text());
    assert_eq!(amnesia(&r.a).await, Some(0.0));
    assert_eq!(amnesia(&r.b).await, Some(0.0));
    assert!(r.applied("7") && !r.applied("6"));
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_without_waiting_a_failover_loss_is_caught_by_amnesia_detection() {
    let mut r = Replicas::start(Some("0")).await;
    assert!(put(&r.a.url("/k"), "5").await.status.is_success());
    tokio::task::block_in_place(|| r.replicated());
    let primary = tokio::task::block_in_place(|| r.cut_off_the_replica());
    // Not waited for: admitted and forwarded, on the primary only.
    assert!(put(&r.a.url("/k"), "10").await.status.is_success());
    assert!(r.applied("10"));
    let fault = Instant::now();
    tokio::task::block_in_place(|| r.fail_over(primary));
    // The promoted replica's fence for /k is 5: the raise to 10 is lost.
    // Replica a saw 10 acknowledged, so a lower token is refused, not
    // forwarded, and a marks the store as having gone back.
    // (Which loss is found first depends on what else was lost: the raise
    // to 10 itself, or a marker bump of a connection made after the cut.)
    let (a, _) = put_through_503(&r.a.url("/k"), "7").await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert!(a.text().contains("may have lost data"), "{}", a.text());
    assert_eq!(amnesia(&r.a).await, Some(1.0));
    // Replica b never saw 10: it learns of the loss from the marker within
    // its next check (about a second), and refuses too.
    eventually_async("replica b to latch amnesia", || async {
        amnesia(&r.b).await == Some(1.0)
    })
    .await;
    assert_eq!(put(&r.b.url("/k"), "8").await.status, 503);
    assert!(!r.applied("7") && !r.applied("8"));
    // An operator confirms on each replica; a's fences are written back.
    for p in [&r.a, &r.b] {
        let auth = format!("Bearer {ADMIN_TOKEN}");
        let c = send(
            "POST",
            &p.admin_url("/v1/store/confirm-reset"),
            &[("authorization", &auth)],
            "",
        )
        .await;
        assert!(c.status.is_success(), "{} {}", c.status, c.text());
    }
    assert_eq!(put(&r.b.url("/k"), "9").await.status, 409);
    let (ok, resumed) = put_through_503(&r.b.url("/k"), "11").await;
    assert!(ok.status.is_success(), "{} {}", ok.status, ok.text());
    eprintln!(
        "redis failover with store_replicas_to_wait = 0: the lost raise was caught; writes refused until confirm-reset, {:?} after the kill -9 here",
        resumed - fault
    );
    assert!(!r.applied("7") && !r.applied("8") && !r.applied("9"));
}

/// The old primary restarted (with its old configuration: a primary) the
/// moment its replica is promoted, before Sentinel announces the switch:
/// Sentinel still names it, and it takes connections as a primary with no
/// replica of its own. Counting the replicas Sentinel sees up, fencegate
/// still waits for one there, so nothing it writes there (a marker bump on
/// a new connection, a raise) counts unconfirmed, and the resync that turns
/// it into a replica loses nothing fencegate relied on: no amnesia, no
/// operator, under writes through both replicas.
#[tokio::test(flavor = "multi_thread")]
async fn redis_an_old_primary_restarted_during_the_promotion_needs_no_operator() {
    let mut r = Replicas::start(None).await;
    let (a, b) = (r.a.url("/w"), r.b.url("/w"));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut token = 1u64;
            // Bounded: stopped below, and at most this many rounds.
            for _ in 0..3000 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                token += 1;
                let _ = put(&format!("{a}{token}"), &token.to_string()).await;
                let _ = put(&format!("{b}{token}"), &token.to_string()).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| {
        let primary = r.redis.primary_port().expect("a primary");
        let replica = r.redis.other(primary).port;
        r.redis.node(primary).kill9();
        let deadline = Instant::now() + Duration::from_secs(30);
        while r.redis.role(replica).as_deref() != Some("master") {
            assert!(Instant::now() < deadline, "the replica was never promoted");
            std::thread::sleep(Duration::from_millis(20));
        }
        r.redis.node(primary).restart();
        r.redis.wait_promoted(primary);
        r.redis.wait_replica_online();
    });
    let (ok, _) = put_through_503(&r.a.url("/after"), "1").await;
    if !ok.status.is_success() {
        // What each server did, for the failure's diagnosis.
        eprintln!("replica a:\n{}\nreplica b:\n{}", r.a.stderr(), r.b.stderr());
        for n in r.redis.nodes.iter().chain(r.redis.sentinels.iter()) {
            eprintln!("redis on {}:\n{}", n.port, n.log());
        }
    }
    assert!(ok.status.is_success(), "{} {}", ok.status, ok.text());
    let (ok, _) = put_through_503(&r.b.url("/after"), "2").await;
    assert!(ok.status.is_success(), "{} {}", ok.status, ok.text());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await.unwrap();
    assert_eq!(amnesia(&r.a).await, Some(0.0), "{}", r.a.stderr());
    assert_eq!(amnesia(&r.b).await, Some(0.0), "{}", r.b.stderr());
}

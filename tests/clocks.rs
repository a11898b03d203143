//! Clocks that jump (issue 43): a fencegate replica's or a store server's
//! wall clock stepped an hour either way while writes are in flight (a
//! preloaded shim, `tests/wallclock/wallclock.c`). docs/contract.md ("Clocks") says which clock each bound
//! rests on; each test here shows one of its sentences:
//! - a replica's deadlines and waits are on its monotonic clock: a step of
//!   its wall clock changes no decision;
//! - a shared store's lease expiry is on the store host's wall clock
//!   (Redis `TIME`, PostgreSQL `clock_timestamp()`): a forward step ends
//!   every lease in flight at once, and a newer token can then overtake an
//!   older write still being applied; a backward step only makes newer
//!   writes wait longer.
//!
//! Needs root, iproute2, nftables and a C compiler (scripts/test installs
//! them). etcd is a Go program, whose clocks no preloaded library reaches
//! (Go reads the time through the vDSO, not libc); its lease TTLs do not
//! rest on a wall clock.

mod common;

use std::path::PathBuf;
use std::time::{Instant, SystemTime};

use common::netns::{Host, Net, StoreOn};
use common::servers::StoreKind;
use common::*;
use http::StatusCode;

/// A wall clock to step: `tests/wallclock/wallclock.c` preloaded, adding
/// the seconds in a file to the wall clock at every read, the monotonic
/// clock left alone (as an NTP step, a VM resumed or an operator's
/// `date -s` leave it). libfaketime does the same but cannot run under
/// redis-server (jemalloc reads the clock while it initialises).
struct SteppedClock {
    file: PathBuf,
    shim: PathBuf,
    _dir: tempfile::TempDir,
}

impl SteppedClock {
    fn new() -> SteppedClock {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("offset");
        std::fs::write(&file, "0\n").unwrap();
        let src =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/wallclock/wallclock.c");
        let shim = dir.path().join("wallclock.so");
        let status = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&shim)
            .arg(&src)
            .status()
            .expect("cc not found: install a C compiler (Debian package `gcc`)");
        assert!(status.success(), "the wall-clock shim did not build");
        SteppedClock {
            file,
            shim,
            _dir: dir,
        }
    }

    fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), self.shim.display().to_string()),
            (
                "WALLCLOCK_OFFSET_FILE".into(),
                self.file.display().to_string(),
            ),
        ]
    }

    /// Steps the wall clock to `secs` from the real one.
    fn step(&self, secs: i64) {
        std::fs::write(&self.file, format!("{secs}\n")).unwrap();
    }

    /// From now on the wall clock runs `rate` times as fast as the real one.
    fn rate(&self, rate: f64) {
        std::fs::write(&self.file, format!("0 {rate}\n")).unwrap();
    }
}

/// How far `date` (an HTTP date) is from the real clock now, in seconds.
fn offset_of(date: &str) -> i64 {
    let at = httpdate::parse_http_date(date).expect("an HTTP date");
    let real = SystemTime::now();
    match at.duration_since(real) {
        Ok(ahead) => ahead.as_secs() as i64,
        Err(behind) => -(behind.duration().as_secs() as i64),
    }
}

/// Two replicas on Redis, each on a host of its own.
struct Setup {
    _net: Net,
    up: Upstream,
    a: Proxy,
    b: Proxy,
    _store: StoreOn,
    _dir: tempfile::TempDir,
}

fn setup(kind: StoreKind, store_env: &[(String, String)], a_env: &[(String, String)]) -> Setup {
    let mut net = Net::new();
    let (store, backend, ha, hb) = (net.host(), net.host(), net.host(), net.host());
    let server = StoreOn::start_env(kind, &store, store_env);
    let up = start_upstream_in(&backend, 8080);
    let dir = common::cluster::scratch_dir();
    let replica = |host: &Host, env: &[(String, String)]| {
        let mut b = ProxyBuilder::new(&up.url(), dir.path())
            .store_url(&server.url)
            .netns(host)
            .args(&["--upstream-timeout", "3s", "--store-timeout", "1s"]);
        for (k, v) in env {
            b = b.env(k, v);
        }
        b.spawn()
    };
    let (a, b) = (replica(&ha, a_env), replica(&hb, &[]));
    Setup {
        _net: net,
        up,
        a,
        b,
        _store: server,
        _dir: dir,
    }
}

/// A write of `token` to `path` through `p` that the backend takes
/// `delay_ms` to apply, started in the background; returns once the
/// backend has its head.
async fn long_write(
    s: &Setup,
    p: &Proxy,
    path: &str,
    token: &str,
    delay_ms: u64,
) -> tokio::task::JoinHandle<StatusCode> {
    let before = s.up.arrivals();
    let url = p.url(path);
    let (token, delay) = (token.to_string(), delay_ms.to_string());
    let task = tokio::spawn(async move {
        let headers = [
            ("x-fence-token", token.as_str()),
            ("x-test-delay-ms", delay.as_str()),
        ];
        send("PUT", &url, &headers, "long").await.status
    });
    eventually_async("the long write reached the backend", || async {
        s.up.arrivals() > before
    })
    .await;
    task
}

/// The backend's record of `token` on `path`.
fn record(up: &Upstream, path: &str, token: &str) -> Record {
    up.records()
        .into_iter()
        .find(|r| r.target == path && r.token.as_deref() == Some(token))
        .unwrap_or_else(|| panic!("token {token} on {path} was not applied"))
}

/// A replica's wall clock stepped an hour forward, then back, while it
/// has a write in flight: the newer token through the other replica still
/// waits for that write to end (deadlines and waits are on the monotonic
/// clock), and the stepped replica's own writes go on.
#[tokio::test(flavor = "multi_thread")]
async fn a_replicas_wall_clock_stepping_an_hour_either_way_changes_no_decision() {
    let clock = SteppedClock::new();
    let s = setup(StoreKind::Redis, &[], &clock.env());
    for (round, offset) in [3600i64, -3600].into_iter().enumerate() {
        let path = format!("/k{round}");
        let older = long_write(&s, &s.a, &path, "5", 1500).await;
        clock.step(offset);
        // The step took: the Date header of an answer the replica made
        // itself (a write with no token, 428) says so.
        let seen = send("PUT", &s.a.url("/probe"), &[], "").await;
        assert_eq!(seen.status, 428);
        let date = seen.header("date").expect("a Date header").to_string();
        let off = offset_of(&date);
        assert!(
            (off - offset).abs() < 120,
            "A's clock is {off} s off, not {offset}"
        );
        let newer = put(&s.b.url(&path), "6").await;
        assert_eq!(newer.status, 200, "{}", newer.text());
        assert_eq!(older.await.unwrap(), StatusCode::OK);
        let (five, six) = (record(&s.up, &path, "5"), record(&s.up, &path, "6"));
        assert!(
            six.arrived >= five.completed,
            "{offset}: token 6 reached the backend while token 5 was being applied"
        );
        let own = put(&s.a.url(&path), "7").await;
        assert_eq!(own.status, 200, "{offset}: {}", own.text());
    }
}

/// A store host's wall clock stepped forward by an hour ends every lease
/// in flight: a newer token through another replica is admitted at once,
/// and reaches the backend while the older write is still being applied.
/// This is the hazard contract.md names (run the store host with a clock
/// that slews, never steps); a backward step only makes newer writes wait
/// longer, never overtake.
async fn a_store_hosts_wall_clock_step(kind: StoreKind) {
    let clock = SteppedClock::new();
    let s = setup(kind, &clock.env(), &[]);

    // Backward: the older write's lease looks an hour longer; the newer
    // token waits until the older write ends and releases it.
    let older = long_write(&s, &s.a, "/back", "5", 1500).await;
    clock.step(-3600);
    let newer = put(&s.b.url("/back"), "6").await;
    assert_eq!(older.await.unwrap(), StatusCode::OK);
    if newer.status == 200 {
        let (five, six) = (record(&s.up, "/back", "5"), record(&s.up, "/back", "6"));
        assert!(
            six.arrived >= five.completed,
            "overtaken after a backward step"
        );
    } else {
        assert_eq!(newer.status, 503, "{}", newer.text());
    }

    // Forward: the lease ends at once.
    clock.step(0);
    let older = long_write(&s, &s.a, "/fwd", "5", 2500).await;
    clock.step(3600);
    let sent = Instant::now();
    let newer = put(&s.b.url("/fwd"), "6").await;
    assert_eq!(newer.status, 200, "{}", newer.text());
    let waited = sent.elapsed();
    assert_eq!(older.await.unwrap(), StatusCode::OK);
    let (five, six) = (record(&s.up, "/fwd", "5"), record(&s.up, "/fwd", "6"));
    eprintln!("{kind:?}: after a forward step, token 6 waited {waited:?}");
    assert!(
        six.arrived < five.completed,
        "{kind:?}: the forward step was expected to end token 5's lease (contract.md's clock hazard); token 6 waited {waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redis_hosts_wall_clock_step_forward_ends_the_leases_in_flight() {
    a_store_hosts_wall_clock_step(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_hosts_wall_clock_step_forward_ends_the_leases_in_flight() {
    a_store_hosts_wall_clock_step(StoreKind::Postgres).await;
}

/// A store host's wall clock running fast shortens every lease in real
/// time: at three times the real rate, a lease of `upstream_timeout` +
/// `store_timeout` + 1 s (5 s here) ends after 1.7 s, and a newer token is
/// admitted while an older write that takes 2.5 s is still being applied
/// (contract.md's arithmetic: a write that runs to its deadline outlives
/// its lease once the clock is (3 + 1 + 1) / (3 + 0.25) = 1.54 times as
/// fast here, 1.046 with the defaults). At half the rate a lease lasts
/// longer, and the newer token waits for the older write.
async fn a_store_hosts_wall_clock_at_another_rate(kind: StoreKind) {
    let clock = SteppedClock::new();
    let s = setup(kind, &clock.env(), &[]);

    clock.rate(0.5);
    let older = long_write(&s, &s.a, "/slow", "5", 1500).await;
    let newer = put(&s.b.url("/slow"), "6").await;
    assert_eq!(older.await.unwrap(), StatusCode::OK);
    if newer.status == 200 {
        let (five, six) = (record(&s.up, "/slow", "5"), record(&s.up, "/slow", "6"));
        assert!(six.arrived >= five.completed, "overtaken with a slow clock");
    } else {
        assert_eq!(newer.status, 503, "{}", newer.text());
    }

    clock.rate(3.0);
    let older = long_write(&s, &s.a, "/fast", "5", 2500).await;
    let sent = Instant::now();
    let newer = put(&s.b.url("/fast"), "6").await;
    let waited = sent.elapsed();
    assert_eq!(newer.status, 200, "{}", newer.text());
    assert_eq!(older.await.unwrap(), StatusCode::OK);
    let (five, six) = (record(&s.up, "/fast", "5"), record(&s.up, "/fast", "6"));
    eprintln!("{kind:?}: with the store's clock at 3x, token 6 waited {waited:?}");
    assert!(
        six.arrived < five.completed,
        "{kind:?}: a clock at 3x was expected to end token 5's lease early (contract.md's clock arithmetic); token 6 waited {waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redis_hosts_wall_clock_running_fast_ends_the_leases_early() {
    a_store_hosts_wall_clock_at_another_rate(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_hosts_wall_clock_running_fast_ends_the_leases_early() {
    a_store_hosts_wall_clock_at_another_rate(StoreKind::Postgres).await;
}

//! SIGHUP reload of the configuration: what is applied, what is refused,
//! and that writes stay ordered across a reload that remaps keys.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn sighup_reloads_routes_and_keeps_the_old_config_when_the_new_one_is_bad() {
    let dir = tempfile::tempdir().unwrap();
    let first = start_upstream().await;
    let second = start_upstream().await;
    let config = dir.path().join("fencegate.toml");
    let token_file = dir.path().join("admin-token");
    let routes = |upstream: &str, timeout: &str| {
        format!(
            "admin_token_file = \"{}\"\n[[routes]]\nname = \"objects\"\nupstream = \"{upstream}\"\nupstream_timeout = \"{timeout}\"\n",
            token_file.display()
        )
    };
    std::fs::write(&token_file, "first-admin-token-0001").unwrap();
    write_config(&config, &routes(&first.url(), "30s"));
    let mut p = ProxyBuilder::with_config(&config, dir.path()).spawn();
    let fence_ahead = |token: &'static str, value: &'static str| {
        let url = p.admin_url("/v1/fences/default%3A%2Fahead");
        async move {
            let auth = format!("Bearer {token}");
            send(
                "POST",
                &url,
                &[("authorization", &auth)],
                format!(r#"{{"token":"{value}"}}"#),
            )
            .await
            .status
        }
    };
    assert_eq!(fence_ahead("first-admin-token-0001", "1").await, 200);
    assert_eq!(put(&p.url("/x"), "3").await.status, 200);
    assert_eq!(first.count(), 1);
    // No TLS listener, no certificate expiry series (a 0 would alert).
    assert_eq!(
        metric(&p, "fencegate_tls_certificate_expiry_timestamp_seconds").await,
        None
    );

    // New routes and a rotated admin token.
    std::fs::write(&token_file, "second-admin-token-002").unwrap();
    write_config(&config, &routes(&second.url(), "10s"));
    signal(p.child.id(), "HUP");
    eventually_async("the reload", || async {
        metric(&p, "fencegate_reloads_total{result=\"ok\",what=\"config\"}").await == Some(1.0)
    })
    .await;
    assert_eq!(fence_ahead("first-admin-token-0001", "2").await, 401);
    assert_eq!(fence_ahead("second-admin-token-002", "2").await, 200);
    // Fences survive a reload: the key's highest is still 3.
    assert_eq!(put(&p.url("/x"), "2").await.status, 409);
    assert_eq!(put(&p.url("/x"), "3").await.status, 200);
    assert_eq!((first.count(), second.count()), (1, 1));

    // Bad configs: a syntax error, an invalid value, a longer upstream
    // timeout (the recovery window was sized at start). Each is refused and
    // the running routes stay.
    for (n, bad) in [
        "[[routes]\nupstream = 1".to_string(),
        routes("ftp://127.0.0.1:1", "10s"),
        routes(&first.url(), "5m"),
    ]
    .into_iter()
    .enumerate()
    {
        write_config(&config, &bad);
        signal(p.child.id(), "HUP");
        let want = (n + 1) as f64;
        eventually_async("the refused reload", || async {
            metric(
                &p,
                "fencegate_reloads_total{result=\"error\",what=\"config\"}",
            )
            .await
                == Some(want)
        })
        .await;
        assert_eq!(
            metric(&p, "fencegate_last_reload_successful{what=\"config\"}").await,
            Some(0.0)
        );
        assert_eq!(put(&p.url("/x"), "4").await.status, 200);
        assert_eq!(first.count(), 1, "still on the second upstream");
    }
    let log = p.stderr();
    assert!(log.contains("config not reloaded"), "{log}");
    assert!(
        log.contains("routes[0].upstream"),
        "the bad field is named: {log}"
    );
    assert!(log.contains("needs a restart"), "{log}");
    assert!(p.sigterm().success());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_remaps_keys_holds_new_writes_until_old_ones_finish() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let config = dir.path().join("fencegate.toml");
    let with_namespace = |ns: &str| {
        format!(
            "[[routes]]\nupstream = \"{}\"\nnamespace = \"{ns}\"\nupstream_timeout = \"20s\"\n",
            up.url()
        )
    };
    write_config(&config, &with_namespace("first"));
    let p = ProxyBuilder::with_config(&config, dir.path()).spawn();
    let slow_put = |path: &str, token: &'static str| {
        let url = p.url(path);
        tokio::spawn(async move {
            let headers = [("x-fence-token", token), ("x-test-delay-ms", "3000")];
            send("PUT", &url, &headers, "slow").await.status
        })
    };
    let reloads = |n: f64| {
        let p = &p;
        async move {
            signal(p.child.id(), "HUP");
            eventually_async("the reload", || async {
                metric(p, "fencegate_reloads_total{result=\"ok\",what=\"config\"}").await == Some(n)
            })
            .await;
        }
    };
    let record = |token: &str| {
        up.records()
            .into_iter()
            .find(|r| r.token.as_deref() == Some(token))
            .unwrap()
    };

    // A slow write in flight under the first mapping...
    let old = slow_put("/doc", "5");
    eventually("the slow write arrived", Duration::from_secs(10), || {
        up.arrivals() == 1
    })
    .await;
    // ...when the namespace changes twice: /doc is now another key, which
    // has no highest, so no fence gate would order the next write behind
    // it (and the mapping in between has no write of its own in flight).
    write_config(&config, &with_namespace("second"));
    reloads(1.0).await;
    write_config(&config, &with_namespace("third"));
    reloads(2.0).await;
    assert!(
        up.records().is_empty(),
        "the old write is still being applied when the new one is sent"
    );
    assert_eq!(put(&p.url("/doc"), "1").await.status, 200);
    assert_eq!(old.await.unwrap(), 200);
    assert!(
        record("1").arrived >= record("5").completed,
        "the write under the new mapping reached the backend only after the old one was applied"
    );

    // A reload that keeps the mapping holds nothing: a write to another key
    // goes while a slow one is in flight.
    let slow = slow_put("/slow", "7");
    eventually("the slow write arrived", Duration::from_secs(10), || {
        up.arrivals() == 3
    })
    .await;
    write_config(&config, &(with_namespace("third") + "# same mapping\n"));
    reloads(3.0).await;
    assert_eq!(put(&p.url("/quick"), "8").await.status, 200);
    assert_eq!(slow.await.unwrap(), 200);
    assert!(record("8").arrived < record("7").completed);
}

/// One route with a namespace, from a config file a test rewrites and
/// reloads: the fixture of the crash-after-remap cases.
struct Remapped {
    dir: tempfile::TempDir,
    up: Upstream,
    config: std::path::PathBuf,
    p: Proxy,
    reloads: f64,
}

impl Remapped {
    async fn start(namespace: &str) -> Remapped {
        let dir = tempfile::tempdir().unwrap();
        let up = start_upstream().await;
        let config = dir.path().join("fencegate.toml");
        write_config(&config, &Self::routes(&up, namespace));
        let p = ProxyBuilder::with_config(&config, dir.path()).spawn();
        Remapped {
            dir,
            up,
            config,
            p,
            reloads: 0.0,
        }
    }

    fn routes(up: &Upstream, namespace: &str) -> String {
        format!(
            "[[routes]]\nupstream = \"{}\"\nnamespace = \"{namespace}\"\nupstream_timeout = \"10s\"\n",
            up.url()
        )
    }

    /// Rewrites the config with another namespace and reloads it.
    async fn remap(&mut self, namespace: &str) {
        write_config(&self.config, &Self::routes(&self.up, namespace));
        signal(self.p.child.id(), "HUP");
        self.reloads += 1.0;
        let (p, n) = (&self.p, self.reloads);
        eventually_async("the reload", || async move {
            metric(p, "fencegate_reloads_total{result=\"ok\",what=\"config\"}").await == Some(n)
        })
        .await;
    }

    /// A write of `token` that the backend takes `ms` to apply, in flight
    /// once this returns (its head arrived, `arrivals` in all).
    async fn slow_write(
        &self,
        path: &str,
        token: &'static str,
        ms: &'static str,
        arrivals: usize,
    ) -> tokio::task::JoinHandle<hyper::StatusCode> {
        let url = self.p.url(path);
        let write = tokio::spawn(async move {
            let headers = [("x-fence-token", token), ("x-test-delay-ms", ms)];
            send("PUT", &url, &headers, "slow").await.status
        });
        eventually("the slow write arrived", Duration::from_secs(10), || {
            self.up.arrivals() >= arrivals
        })
        .await;
        write
    }

    /// Retries `token` on `path` while it is held (503), then asserts that
    /// it reached the backend only after `older` was applied.
    async fn admitted_after(&self, path: &str, token: &str, older: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let a = put(&self.p.url(path), token).await;
            if a.status == 200 {
                break;
            }
            assert_eq!(a.status, 503, "{}", a.text());
            assert!(std::time::Instant::now() < deadline, "never admitted");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eventually("the older write applied", Duration::from_secs(10), || {
            self.up
                .records()
                .iter()
                .any(|r| r.token.as_deref() == Some(older))
        })
        .await;
        let records = self.up.records();
        let at = |t: &str| {
            records
                .iter()
                .find(|r| r.token.as_deref() == Some(t))
                .unwrap()
        };
        assert!(
            at(token).arrived >= at(older).completed,
            "token {token} reached the backend before token {older}, in flight at the crash, was applied"
        );
    }
}

/// A crash while a write admitted under an older key mapping is in flight:
/// the restart, on the new mapping, holds the resource whatever key it has
/// now. (The crashed run's marks name the old key; the store also records
/// which mapping the marks were made under, and a start under another one
/// holds every key until the crashed run's writes can no longer be in
/// flight.) Once the old writes ended, a crash holds only the keys it
/// marked again.
#[tokio::test(flavor = "multi_thread")]
async fn a_crash_after_a_remapping_reload_still_holds_the_resource() {
    let mut r = Remapped::start("one").await;
    let old = r.slow_write("/r/x", "5", "4000", 1).await;
    r.remap("two").await;
    // kill -9, and a start on the new config.
    r.p.restart();
    r.admitted_after("/r/x", "6", "5").await;
    let _ = old.await;

    // With nothing in flight under an older mapping (and the window over),
    // the mapping is recorded again, and a crash holds only the keys it
    // marked: a write to another key goes at once.
    eventually("the key mapping recorded", Duration::from_secs(10), || {
        r.p.stderr().contains("key mapping recorded")
    })
    .await;
    let slow = r.slow_write("/r/y", "7", "3000", 3).await;
    r.p.restart();
    let a = put(&r.p.url("/r/z"), "1").await;
    assert_eq!(
        a.status,
        200,
        "an unmarked key was held: {}\n{}",
        a.text(),
        r.p.stderr()
    );
    let a = put(&r.p.url("/r/y"), "8").await;
    assert_eq!(a.status, 503, "the marked key is held: {}", a.text());
    let _ = slow.await;
    drop(r.dir);
}

/// A restart on the crashed run's own mapping holds only the keys it
/// marked; a reload that remaps keys during that window must not let a
/// resource that had a write in flight escape under its new key.
#[tokio::test(flavor = "multi_thread")]
async fn a_remapping_reload_during_crash_recovery_still_holds_the_resource() {
    let mut r = Remapped::start("one").await;
    let old = r.slow_write("/r/x", "5", "4000", 1).await;
    // kill -9, a start on the same config: only one:/r/x is held...
    r.p.restart();
    let a = put(&r.p.url("/r/other"), "1").await;
    assert_eq!(a.status, 200, "an unmarked key was held: {}", a.text());
    // ...then a reload that gives /r/x another key.
    r.remap("two").await;
    r.admitted_after("/r/x", "6", "5").await;
    let _ = old.await;
}

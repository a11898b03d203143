//! The lock service (`--lease-listen`), on every store: the embedded store
//! (one process) and the shared stores (two replicas on one real server,
//! each request sent to either): the API's answers, one winner among
//! concurrent claims, tokens strictly above everything the key had,
//! routes that admit only granted tokens, `wait_ms`, expiry, and
//! `fencegate lease` for scripts.

mod common;

use std::time::{Duration, Instant};

use common::servers::{StoreKind, StoreServer};
use common::*;

const BEARER: &str = "lease-test-token-0123456789";
/// May lease only keys under `g:/g/team/`.
const SCOPED: &str = "scoped-lease-token-0123456789";
/// May lease any key, like BEARER, but holds none of BEARER's leases.
const OTHER: &str = "other-lease-token-0123456789";

const ROUTES: &str = r#"
[[routes]]
name = "granted"
path_prefix = "/g"
upstream = "{u}"
namespace = "g"
tokens = "granted"
upstream_timeout = "2s"

[[routes]]
name = "any"
upstream = "{u}"
namespace = "a"
upstream_timeout = "2s"
"#;

/// Replicas with the lease API on one store, in front of one recording
/// upstream.
struct Service {
    store: StoreServer,
    up: Upstream,
    replicas: Vec<Proxy>,
    dir: tempfile::TempDir,
}

impl Service {
    async fn start(kind: StoreKind) -> Service {
        let store = StoreServer::start(kind);
        let up = start_upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let n = if kind == StoreKind::Embedded { 1 } else { 2 };
        let mut s = Service {
            store,
            up,
            replicas: Vec::new(),
            dir,
        };
        std::fs::write(
            s.dir.path().join("lease-tokens"),
            format!("# test tokens\n{BEARER}\n{SCOPED} g:/g/team/\n{OTHER}\n"),
        )
        .unwrap();
        write_config(
            &s.dir.path().join("routes.toml"),
            &ROUTES.replace("{u}", &s.up.url()),
        );
        for _ in 0..n {
            let p = s.replica();
            s.replicas.push(p);
        }
        s
    }

    fn replica(&self) -> Proxy {
        let d = self.dir.path();
        ProxyBuilder::with_config(&d.join("routes.toml"), self.store.dir.path())
            .store_url(&self.store.url())
            .args(&["--lease-listen", "127.0.0.1:0", "--max-lease-ttl", "20s"])
            .args(&[
                "--lease-token-file",
                d.join("lease-tokens").to_str().unwrap(),
            ])
            .args(&["--store-timeout", "1s"])
            .spawn()
    }

    /// The replica for the `i`th request: alternating on shared stores.
    fn at(&self, i: usize) -> &Proxy {
        &self.replicas[i % self.replicas.len()]
    }

    fn tokens(&self) -> Vec<String> {
        self.up
            .records()
            .iter()
            .map(|r| r.token.clone().unwrap_or_default())
            .collect()
    }
}

async fn call(p: &Proxy, method: &str, path: &str, bearer: Option<&str>, body: &str) -> Answer {
    let auth = bearer.map(|b| format!("Bearer {b}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("authorization", a.as_str()));
    }
    send(method, &p.lease_url(path), &headers, body.to_string()).await
}

async fn acquire(p: &Proxy, body: &str) -> Answer {
    call(p, "POST", "/v1/leases", Some(BEARER), body).await
}

/// Lease `id` answers 410 to a read on `get_on` and a renewal on
/// `renew_on`: gone, and never revived.
async fn assert_gone(get_on: &Proxy, renew_on: &Proxy, id: &str, what: &str) {
    let r = call(get_on, "GET", &format!("/v1/leases/{id}"), Some(BEARER), "").await;
    assert_eq!(r.status, 410, "{what}: {}", r.text());
    let renew = format!("/v1/leases/{id}/renew");
    let r = call(renew_on, "POST", &renew, Some(BEARER), r#"{"ttl_ms":5000}"#).await;
    assert_eq!(r.status, 410, "{what} is never revived: {}", r.text());
}

/// Releases the lease `granted` answered, with the bearer that took it.
async fn release(p: &Proxy, granted: &Answer) -> Answer {
    call(
        p,
        "DELETE",
        &format!("/v1/leases/{}", lease_of(granted)),
        Some(BEARER),
        "",
    )
    .await
}

fn token_of(a: &Answer) -> u64 {
    assert_eq!(a.status, 201, "{}", a.text());
    a.json()["token"].as_str().unwrap().parse().unwrap()
}

fn lease_of(a: &Answer) -> String {
    a.json()["lease"].as_str().unwrap().to_string()
}

async fn api_answers(kind: StoreKind) {
    let s = Service::start(kind).await;
    let (a, b) = (s.at(0), s.at(1));
    // Authentication and scope.
    let r = call(
        a,
        "POST",
        "/v1/leases",
        None,
        r#"{"key":"g:/g/x","ttl_ms":5000}"#,
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let r = call(
        a,
        "POST",
        "/v1/leases",
        Some("not-a-token-0123456789"),
        "{}",
    )
    .await;
    assert_eq!(r.status, 401);
    let r = call(
        a,
        "POST",
        "/v1/leases",
        Some(SCOPED),
        r#"{"key":"g:/g/x","ttl_ms":5000}"#,
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    let r = call(
        a,
        "POST",
        "/v1/leases",
        Some(SCOPED),
        r#"{"key":"g:/g/team/1","ttl_ms":5000}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let scoped_id = lease_of(&r);
    // Bad bodies name their field.
    for (body, field) in [
        (r#"{"key":"g:/g/x"}"#, "ttl_ms"),
        (r#"{"key":"g:/g/x","ttl_ms":0}"#, "ttl_ms"),
        (r#"{"key":"g:/g/x","ttl_ms":20001}"#, "ttl_ms"),
        (r#"{"key":"g:/g/x","ttl_ms":"5s"}"#, "ttl_ms"),
        (r#"{"key":"g:/g/x","ttl_ms":5000,"wait_ms":-1}"#, "wait_ms"),
        (r#"{"key":"g:/g/x","ttl_ms":5000,"holder":7}"#, "holder"),
        (
            r#"{"key":"g:/g/x","ttl_ms":5000,"holder":"a\nforged log line"}"#,
            "holder",
        ),
        (r#"{"ttl_ms":5000}"#, "key"),
        (r#"{"key":"","ttl_ms":5000}"#, "key"),
        (r#"{"key":"nocolon","ttl_ms":5000}"#, "key"),
        (r#"{"key":"g:/nul\u0000x","ttl_ms":5000}"#, "key"),
        (r#"{"path":"/g/a%zz","ttl_ms":5000}"#, "path"),
    ] {
        let r = acquire(a, body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["field"], field, "{body}: {}", r.text());
    }
    for body in [
        "not json",
        "[1]",
        r#"{"key":"g:/g/x","path":"/g/x","ttl_ms":5000}"#,
        r#"{"key":"g:/g/x","ttl_ms":5000,"tll_ms":1}"#,
    ] {
        let r = acquire(a, body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert!(r.json()["detail"].as_str().is_some());
    }
    // Granted; held while it lives, on either replica.
    let r = acquire(a, r#"{"key":"g:/g/x","ttl_ms":5000,"holder":"job-1"}"#).await;
    let t1 = token_of(&r);
    assert_eq!(t1, 1, "a new key's first token");
    let j = r.json();
    assert_eq!(j["key"], "g:/g/x");
    assert_eq!(j["holder"], "job-1");
    assert_eq!(j["ttl_ms"], 5000);
    let id = lease_of(&r);
    let r = acquire(b, r#"{"key":"g:/g/x","ttl_ms":5000,"holder":"job-2"}"#).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.json()["holder"], "job-1");
    assert_eq!(r.json()["key"], "g:/g/x");
    let left = r.json()["expires_in_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 5000, "{left}");
    // A path maps to the key a write to it takes.
    let r = acquire(b, r#"{"path":"/g/x","ttl_ms":5000}"#).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.json()["key"], "g:/g/x");
    // Get and renew from the other replica.
    let r = call(b, "GET", &format!("/v1/leases/{id}"), Some(BEARER), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["token"], "1");
    assert_eq!(r.json()["holder"], "job-1");
    let r = call(
        b,
        "POST",
        &format!("/v1/leases/{id}/renew"),
        Some(BEARER),
        r#"{"ttl_ms":8000}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["token"], "1");
    assert_eq!(r.json()["ttl_ms"], 8000);
    let r = call(a, "GET", &format!("/v1/leases/{id}"), Some(BEARER), "").await;
    assert!(
        r.json()["expires_in_ms"].as_u64().unwrap() > 5000,
        "{}",
        r.text()
    );
    // The scoped token cannot touch a lease outside its scope, nor another
    // token a lease it did not take.
    let r = call(a, "DELETE", &format!("/v1/leases/{id}"), Some(SCOPED), "").await;
    assert_eq!(r.status, 403);
    for (method, path) in [
        ("GET", format!("/v1/leases/{id}")),
        ("POST", format!("/v1/leases/{id}/renew")),
        ("DELETE", format!("/v1/leases/{id}")),
    ] {
        let r = call(b, method, &path, Some(OTHER), r#"{"ttl_ms":1000}"#).await;
        assert_eq!(r.status, 403, "{method} {path}: {}", r.text());
        assert_eq!(r.json()["type"], "urn:fencegate:problem:other-bearer");
    }
    let r = call(a, "GET", &format!("/v1/leases/{id}"), Some(BEARER), "").await;
    assert_eq!(r.status, 200, "still held: {}", r.text());
    // Released: gone for good, and the key is free at once.
    let r = call(b, "DELETE", &format!("/v1/leases/{id}"), Some(BEARER), "").await;
    assert_eq!(r.status, 204);
    assert_gone(a, b, &id, "a released lease").await;
    let r = acquire(b, r#"{"path":"/g/x","ttl_ms":5000}"#).await;
    assert_eq!(token_of(&r), 2, "above every earlier grant");
    // An admitted write raises the key; the next grant is above it.
    let r = acquire(a, r#"{"key":"a:/w","ttl_ms":5000}"#).await;
    assert_eq!(token_of(&r), 1);
    release(a, &r).await;
    assert_eq!(put(&a.url("/w"), "40").await.status, 200);
    let r = acquire(b, r#"{"key":"a:/w","ttl_ms":5000}"#).await;
    assert_eq!(token_of(&r), 41);
    assert_eq!(
        put(&b.url("/w"), "40").await.status,
        409,
        "cut off by the grant"
    );
    // Ids this API never made, and other endpoints.
    let r = call(a, "GET", "/v1/leases/nonsense", Some(BEARER), "").await;
    assert_eq!(r.status, 410);
    let r = call(a, "PUT", "/v1/leases", Some(BEARER), "").await;
    assert_eq!(r.status, 405);
    let r = call(a, "GET", "/v2/other", Some(BEARER), "").await;
    assert_eq!(r.status, 404);
    let r = call(a, "GET", "/v1/leasesX", Some(BEARER), "").await;
    assert_eq!(r.status, 404);
    // The scheme is case-insensitive.
    let r = send(
        "GET",
        &a.lease_url("/v1/leases/nonsense"),
        &[("authorization", &format!("bearer {BEARER}"))],
        "",
    )
    .await;
    assert_eq!(r.status, 410, "{}", r.text());
    let r = call(
        a,
        "DELETE",
        &format!("/v1/leases/{scoped_id}"),
        Some(SCOPED),
        "",
    )
    .await;
    assert_eq!(r.status, 204);
    // The API's answers are counted.
    let m = metric(
        a,
        "fencegate_lease_requests_total{op=\"acquire\",result=\"granted\"}",
    )
    .await;
    assert!(m.unwrap_or(0.0) >= 1.0, "{m:?}");
}

async fn concurrent_claims_have_one_winner(kind: StoreKind) {
    let s = Service::start(kind).await;
    let mut last = 0;
    for round in 0..3 {
        let answers = futures_join(
            (0..24)
                .map(|i| {
                    let url = s.at(i).lease_url("/v1/leases");
                    async move {
                        send(
                            "POST",
                            &url,
                            &[("authorization", &format!("Bearer {BEARER}"))],
                            format!(r#"{{"key":"g:/g/race","ttl_ms":10000,"holder":"c{i}"}}"#),
                        )
                        .await
                    }
                })
                .collect(),
        )
        .await;
        let won: Vec<&Answer> = answers.iter().filter(|a| a.status == 201).collect();
        assert_eq!(won.len(), 1, "round {round}: {} winners", won.len());
        assert!(answers.iter().all(|a| a.status == 201 || a.status == 409));
        let t = token_of(won[0]);
        assert!(t > last, "round {round}: token {t} after {last}");
        last = t;
        let r = release(s.at(round), won[0]).await;
        assert_eq!(r.status, 204);
    }
}

/// Runs the futures concurrently and returns their outputs in order.
async fn futures_join<F: std::future::Future<Output = Answer> + Send + 'static>(
    fs: Vec<F>,
) -> Vec<Answer> {
    let handles: Vec<_> = fs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

async fn granted_route_admits_only_grants(kind: StoreKind) {
    let s = Service::start(kind).await;
    let (a, b) = (s.at(0), s.at(1));
    // Never granted: any token is refused, and nothing is forwarded.
    let r = put(&a.url("/g/doc"), "1").await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["type"], "urn:fencegate:problem:not-granted");
    let r = acquire(a, r#"{"path":"/g/doc","ttl_ms":10000}"#).await;
    let t = token_of(&r);
    let id = lease_of(&r);
    assert_eq!(put(&b.url("/g/doc"), &t.to_string()).await.status, 200);
    assert_eq!(put(&a.url("/g/doc"), &t.to_string()).await.status, 200);
    // Above the grant, up to a forged u64::MAX: refused, never forwarded,
    // and the key is not locked by it.
    for forged in [t + 1, t + 1000, u64::MAX] {
        let r = put(&b.url("/g/doc"), &forged.to_string()).await;
        assert_eq!(r.status, 403, "{forged}: {}", r.text());
        assert!(
            r.header("x-fence-token-highest").is_none() && r.json().get("highest").is_none(),
            "the refusal names the grant: {}",
            r.text()
        );
    }
    assert_eq!(put(&a.url("/g/doc"), &t.to_string()).await.status, 200);
    // The next holder's grant cuts off the previous one.
    call(a, "DELETE", &format!("/v1/leases/{id}"), Some(BEARER), "").await;
    let t2 = token_of(&acquire(b, r#"{"path":"/g/doc","ttl_ms":10000}"#).await);
    assert_eq!(t2, t + 1);
    let r = put(&a.url("/g/doc"), &t.to_string()).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(put(&a.url("/g/doc"), &t2.to_string()).await.status, 200);
    let want: Vec<String> = [t, t, t, t2].iter().map(|t| t.to_string()).collect();
    assert_eq!(s.tokens(), want);
    // A route with tokens = "any" is unchanged.
    assert_eq!(put(&a.url("/free"), "9").await.status, 200);
}

/// A grant cuts off the previous holder's token on every replica from its
/// answer on, even where that token's writes are being admitted without a
/// store round trip (a replica's registration of the key).
async fn a_grant_cuts_off_registered_writes(kind: StoreKind) {
    let s = Service::start(kind).await;
    let (a, b) = (s.at(0), s.at(1));
    for round in 0..5 {
        let r = acquire(b, r#"{"key":"g:/g/hot","ttl_ms":10000}"#).await;
        let t = token_of(&r);
        // The holder writes on replica a, keeping its registration busy.
        let url = a.url("/g/hot");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 2000 {
                    put(&url, &t.to_string()).await;
                    n += 1;
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Taken over: released, and granted anew on the other replica.
        release(b, &r).await;
        let taken = acquire(b, r#"{"key":"g:/g/hot","ttl_ms":10000}"#).await;
        let next = token_of(&taken);
        let old = put(&url, &t.to_string()).await;
        assert_eq!(
            old.status,
            409,
            "round {round}: token {t} after {next} was granted: {}",
            old.text()
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.await.unwrap();
        let r = release(b, &taken).await;
        assert_eq!(r.status, 204);
    }
    // No write of an older token reached the backend after a newer one.
    let tokens: Vec<u64> = s.tokens().iter().map(|t| t.parse().unwrap()).collect();
    assert!(tokens.windows(2).all(|w| w[0] <= w[1]), "{tokens:?}");
}

async fn wait_and_expiry(kind: StoreKind) {
    let s = Service::start(kind).await;
    let (a, b) = (s.at(0), s.at(1));
    let first = acquire(a, r#"{"key":"g:/g/w","ttl_ms":10000}"#).await;
    let t1 = token_of(&first);
    // A waiting acquire is granted once the holder releases.
    let url = b.lease_url("/v1/leases");
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        let r = send(
            "POST",
            &url,
            &[("authorization", &format!("Bearer {BEARER}"))],
            r#"{"key":"g:/g/w","ttl_ms":300,"wait_ms":8000}"#,
        )
        .await;
        (r, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let r = release(a, &first).await;
    assert_eq!(r.status, 204);
    let (r, took) = waiter.await.unwrap();
    let t2 = token_of(&r);
    let id2 = lease_of(&r);
    assert!(t2 > t1);
    assert!(
        took >= Duration::from_millis(350),
        "granted before the release: {took:?}"
    );
    // The waiter's 300 ms lease expires: gone, not renewable, key free.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_gone(b, a, &id2, "an expired lease").await;
    let t3 = token_of(&acquire(a, r#"{"key":"g:/g/w","ttl_ms":5000}"#).await);
    assert!(t3 > t2);
    // A wait bounded by wait_ms ends in 409.
    let started = Instant::now();
    let r = acquire(b, r#"{"key":"g:/g/w","ttl_ms":5000,"wait_ms":300}"#).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(started.elapsed() >= Duration::from_millis(250));
}

/// `fencegate lease` for scripts: prints `LEASE TOKEN`, exit 3 while held,
/// 4 once gone.
async fn cli(kind: StoreKind) {
    let s = Service::start(kind).await;
    let tokens = s.dir.path().join("lease-tokens");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin())
            .arg("lease")
            .args(["--lease-url", &s.at(0).lease_url("")])
            .args(["--lease-token-file", tokens.to_str().unwrap()])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    };
    let (code, out) = run(&[
        "acquire", "--path", "/g/cli", "--ttl", "10s", "--holder", "cron",
    ]);
    assert_eq!(code, Some(0), "{out}");
    let (id, token) = out.split_once(' ').unwrap();
    assert_eq!(token, "1");
    assert_eq!(run(&["acquire", "g:/g/cli", "--ttl", "10s"]).0, Some(3));
    let (code, out) = run(&["renew", id, "--ttl", "15s"]);
    assert_eq!((code, out.as_str()), (Some(0), format!("{id} 1").as_str()));
    assert_eq!(put(&s.at(1).url("/g/cli"), token).await.status, 200);
    assert_eq!(run(&["release", id]).0, Some(0));
    assert_eq!(run(&["renew", id, "--ttl", "15s"]).0, Some(4));
    let (code, out) = run(&["acquire", "g:/g/cli", "--ttl", "10s", "--wait", "1s"]);
    assert_eq!(code, Some(0));
    assert!(out.ends_with(" 2"), "{out}");
}

/// Tokens stay strictly above every earlier grant across a kill -9 of the
/// granting process (embedded: the same file reopened; shared: the store
/// holds them).
async fn grants_survive_kill_9(kind: StoreKind) {
    let mut s = Service::start(kind).await;
    let mut last = 0;
    for i in 0..3 {
        let r = acquire(s.at(0), r#"{"key":"g:/g/k9","ttl_ms":300}"#).await;
        let t = token_of(&r);
        assert!(t > last, "{t} after {last}");
        last = t;
        if i == 1 {
            // Killed while holding: the lease outlives the process until it
            // expires.
            s.replicas[0].kill9();
            s.replicas[0].restart();
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let r = put(&s.at(0).url("/g/k9"), &last.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        put(&s.at(0).url("/g/k9"), &(last - 1).to_string())
            .await
            .status,
        409
    );
}

/// One `#[tokio::test]` per case, on the store `$kind`.
macro_rules! cases {
    ($kind:expr; $($case:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread")]
            async fn $case() {
                super::$case($kind).await
            }
        )*
    };
}

macro_rules! suite {
    ($store:ident, $kind:expr) => {
        mod $store {
            use super::*;
            cases!($kind;
                api_answers,
                concurrent_claims_have_one_winner,
                granted_route_admits_only_grants,
                a_grant_cuts_off_registered_writes,
                wait_and_expiry,
                cli,
                grants_survive_kill_9
            );
        }
    };
}

suite!(embedded, StoreKind::Embedded);
suite!(redis, StoreKind::Redis);
suite!(postgres, StoreKind::Postgres);
suite!(etcd, StoreKind::Etcd);

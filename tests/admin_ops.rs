//! Operator tools against token inflation and for lock grants: the
//! per-route maximum token step, fence-ahead and the audited reset.

mod common;

use common::*;

const TOKEN: &str = ADMIN_TOKEN;

async fn setup(extra: &[&str]) -> (tempfile::TempDir, Upstream, Proxy) {
    with_admin_token(extra).await
}

fn auth() -> String {
    format!("Bearer {TOKEN}")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_far_above_the_highest_is_refused() {
    let (_d, up, p) = setup(&["--max-token-step", "1000"]).await;
    // A new key has no highest to measure from: accepted.
    assert_eq!(put(&p.url("/k"), "500").await.status, 200);
    assert_eq!(
        put(&p.url("/k"), "1500").await.status,
        200,
        "exactly the step"
    );
    let a = put(&p.url("/k"), "18446744073709551615").await;
    assert_eq!(a.status, 400, "{}", a.text());
    assert_eq!(
        a.json()["type"],
        "urn:fencegate:problem:token-too-far-ahead"
    );
    assert_eq!(a.json()["highest"], "1500");
    assert_eq!(a.header("x-fence-token-highest"), Some("1500"));
    assert_eq!(put(&p.url("/k"), "2501").await.status, 400);
    assert_eq!(put(&p.url("/k"), "2500").await.status, 200);
    assert_eq!(up.count(), 3, "refused inflation never reached the backend");
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert!(m.contains("decision=\"too_far_ahead\""), "{m}");
}

#[tokio::test(flavor = "multi_thread")]
async fn fence_ahead_cuts_off_the_old_holder_before_the_new_one_writes() {
    let (_d, up, mut p) = setup(&["--upstream-timeout", "1s"]).await;
    assert_eq!(put(&p.url("/doc"), "33").await.status, 200);
    // The lock service grants token 34: fence ahead at grant time.
    let a = send(
        "POST",
        &p.admin_url("/v1/fences/default%3A%2Fdoc"),
        &[("authorization", &auth())],
        r#"{"token":"34"}"#,
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json()["highest"], "34");
    // The paused old holder wakes up: refused, though 34 never wrote.
    assert_eq!(put(&p.url("/doc"), "33").await.status, 409);
    assert_eq!(put(&p.url("/doc"), "34").await.status, 200);
    // Fencing ahead below the highest is refused; without the token, 401.
    let a = send(
        "POST",
        &p.admin_url("/v1/fences/default%3A%2Fdoc"),
        &[("authorization", &auth())],
        r#"{"token":"2"}"#,
    )
    .await;
    assert_eq!(a.status, 409);
    let a = send(
        "POST",
        &p.admin_url("/v1/fences/default%3A%2Fdoc"),
        &[],
        r#"{"token":"99"}"#,
    )
    .await;
    assert_eq!(a.status, 401);
    // A problem type of its own, as every refusal of fencegate's has.
    assert_eq!(a.json()["type"], "urn:fencegate:problem:admin-unauthorized");
    // Logs written to a file carry no terminal colour codes.
    assert!(!p.stderr().contains('\u{1b}'), "{}", p.stderr());
    // Near misses: the same length, a prefix, the token with more after it,
    // another scheme.
    let same_length = format!("Bearer {}", "x".repeat(TOKEN.len()));
    let prefix = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
    let longer = format!("Bearer {TOKEN}0");
    let basic = format!("Basic {TOKEN}");
    for wrong in [
        "Bearer wrong-token-000000000",
        &same_length,
        &prefix,
        &longer,
        &basic,
        "Bearer ",
    ] {
        let a = send(
            "POST",
            &p.admin_url("/v1/fences/default%3A%2Fdoc"),
            &[("authorization", wrong)],
            r#"{"token":"99"}"#,
        )
        .await;
        assert_eq!(a.status, 401, "{wrong}");
    }
    let a = send(
        "POST",
        &p.admin_url("/v1/fences/default%3A%2Fdoc"),
        &[("authorization", &auth())],
        r#"{"token":"-1"}"#,
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(up.arrivals(), 2, "a refused write reached the backend");
    // A fence raised ahead on a key no write has touched yet is as durable
    // as one raised by a write: it survives kill -9.
    let a = send(
        "POST",
        &p.admin_url("/v1/fences/default%3A%2Ffresh"),
        &[("authorization", &auth())],
        r#"{"token":"50"}"#,
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    p.kill9();
    p.restart();
    // Past the 1 s recovery window.
    tokio::time::sleep(std::time::Duration::from_millis(1300)).await;
    assert_eq!(put(&p.url("/fresh"), "49").await.status, 409);
    assert_eq!(put(&p.url("/doc"), "33").await.status, 409);
    assert_eq!(put(&p.url("/fresh"), "50").await.status, 200);
    assert_eq!(up.arrivals(), 3, "a refused write reached the backend");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_reset_unlocks_an_inflated_key_and_is_audited() {
    let (_d, up, p) = setup(&[]).await;
    assert_eq!(
        put(&p.url("/locked"), "18446744073709551615").await.status,
        200
    );
    assert_eq!(
        put(&p.url("/locked"), "7").await.status,
        409,
        "locked out by inflation"
    );
    let a = send(
        "DELETE",
        &p.admin_url("/v1/fences/default%3A%2Flocked"),
        &[],
        "",
    )
    .await;
    assert_eq!(a.status, 401, "reset needs the admin token");
    let a = send(
        "DELETE",
        &p.admin_url("/v1/fences/default%3A%2Flocked"),
        &[("authorization", &auth())],
        "",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json()["previous"], "18446744073709551615");
    assert_eq!(
        put(&p.url("/locked"), "7").await.status,
        200,
        "the key is usable again"
    );
    assert_eq!(put(&p.url("/locked"), "6").await.status, 409);
    let tokens: Vec<_> = up.records().into_iter().map(|r| r.token).collect();
    assert_eq!(
        tokens,
        [
            Some("18446744073709551615".to_string()),
            Some("7".to_string())
        ],
        "only the admitted writes reached the backend"
    );
    assert_eq!(up.arrivals(), 2);
    assert!(p.stderr().contains("AUDIT: fence reset"), "{}", p.stderr());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_probe_subcommand_checks_readiness() {
    let (_d, _up, p) = setup(&[]).await;
    let probe = |url: String| {
        std::process::Command::new(bin())
            .args(["probe", &url])
            .output()
            .unwrap()
            .status
    };
    assert!(probe(p.admin_url("/readyz")).success());
    assert!(!probe(p.admin_url("/no-such-endpoint")).success());
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    assert!(!probe(format!("http://{closed}/readyz")).success());
}

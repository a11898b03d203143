//! Asking in request terms: the admin lookup by path (`GET
//! /v1/fences?path=`) and `fencegate explain` answer which route, key
//! template and fence key a write to a path takes, as the proxy itself
//! decides them, or why such a write is refused.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Three routes as in config/api.toml: a pattern key on a path prefix, a
/// host route keyed by a header, and a catch-all keyed by its first segment.
fn api_config(dir: &Path, upstream: &str) -> PathBuf {
    let file = dir.join("api.toml");
    std::fs::write(
        &file,
        format!(
            r#"
store = "{store}"

[[routes]]
name = "orders"
path_prefix = "/orders"
upstream = "{upstream}"
key = "/orders/{{tenant}}/{{id}}"
namespace = "orders-locks"

[[routes]]
name = "ledger"
host = "ledger.internal"
upstream = "{upstream}"
key = "header:X-Account-Id"
namespace = "ledger-locks"

[[routes]]
name = "files"
upstream = "{upstream}"
key = "/{{share}}"
"#,
            store = dir.join("fences.redb").display()
        ),
    )
    .unwrap();
    file
}

async fn lookup(p: &Proxy, query: &str) -> Answer {
    send("GET", &p.admin_url(&format!("/v1/fences?{query}")), &[], "").await
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_lookup_answers_route_key_and_highest_for_a_path() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::with_config(&api_config(dir.path(), &up.url()), dir.path()).spawn();
    assert_eq!(put(&p.url("/orders/acme/42/items"), "7").await.status, 200);

    let a = lookup(&p, "path=/orders/acme/42/items/3&host=api.internal").await;
    assert_eq!(a.status, 200, "{}", a.text());
    let j = a.json();
    assert_eq!(j["route"], "orders");
    assert_eq!(j["key_template"], "/orders/{tenant}/{id}");
    assert_eq!(j["namespace"], "orders-locks");
    assert_eq!(j["key"], "orders-locks:/orders/acme/42");
    assert_eq!(j["highest"], "7", "the write above raised it");
    assert_eq!(
        j["upstream"],
        format!("{}/orders/acme/42/items/3", up.url())
    );
    // Another spelling of the same resource is the same fence.
    let j = lookup(&p, "path=/orders/acme/%2534%2532/x&host=api.internal")
        .await
        .json();
    assert_eq!(j["key"], "orders-locks:/orders/acme/42", "{j}");
    assert_eq!(j["highest"], "7");

    // A key never written: its route and key, no highest yet.
    let j = lookup(&p, "path=/reports/q3.csv&host=api.internal")
        .await
        .json();
    assert_eq!(j["route"], "files");
    assert_eq!(j["key"], "default:/reports");
    assert_eq!(j["highest"], serde_json::Value::Null);

    // A header-keyed route: the key comes from the header given.
    let a = send(
        "PUT",
        &p.url("/entries"),
        &[
            ("host", "ledger.internal"),
            ("x-fence-token", "11"),
            ("x-account-id", "acct-9"),
        ],
        "e",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let j = lookup(
        &p,
        "path=/entries&host=ledger.internal&header=X-Account-Id%3A%20acct-9",
    )
    .await
    .json();
    assert_eq!(j["route"], "ledger");
    assert_eq!(j["key"], "ledger-locks:acct-9");
    assert_eq!(j["highest"], "11");
    // Without the header, a write there is refused: the lookup says why.
    let j = lookup(&p, "path=/entries&host=ledger.internal")
        .await
        .json();
    assert_eq!(j["route"], "ledger");
    assert_eq!(j["key"], serde_json::Value::Null);
    assert_eq!(j["refused"]["status"], 400);
    assert!(
        j["refused"]["detail"]
            .as_str()
            .unwrap()
            .contains("x-account-id"),
        "{j}"
    );
    // A path the route's template does not match.
    let j = lookup(&p, "path=/orders/acme&host=api.internal")
        .await
        .json();
    assert_eq!(j["route"], "orders");
    assert_eq!(j["refused"]["status"], 400);
    assert!(j["refused"]["detail"]
        .as_str()
        .unwrap()
        .contains("template"));

    // Refusals before any route: problem+json, as for a request.
    for (query, status, says) in [
        ("path=/orders/acme/42", 400, "give the host"),
        ("host=api.internal", 400, "path=/bucket/report.csv"),
        ("path=orders&host=a", 400, "not a request target"),
        ("path=/o&host=a&path=/p", 400, "given twice"),
        ("path=http://h:1/x&host=h:2", 400, "names another host"),
        ("path=/orders/%2e%2e/x&host=a", 400, ""),
        (
            "path=/o&host=a&tenant=acme",
            400,
            "unknown parameter tenant",
        ),
        ("path=/o&host=a&header=no-colon", 400, "NAME:VALUE"),
        ("path=/entries&host=Ledger.internal", 400, "spell the host"),
        ("path=/entries&host=ledger.internal.", 400, "spell the host"),
        ("path=%ff&host=a", 400, "not percent-encoded UTF-8"),
    ] {
        let a = lookup(&p, query).await;
        assert_eq!(a.status, status, "{query}: {}", a.text());
        assert_eq!(
            a.header("content-type"),
            Some("application/problem+json"),
            "{query}"
        );
        assert!(a.text().contains(says), "{query}: {}", a.text());
    }
    let a = send("POST", &p.admin_url("/v1/fences?path=/x"), &[], "").await;
    assert_eq!(a.status, 405, "{}", a.text());
    assert_eq!(up.count(), 2, "the lookups forwarded nothing");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_lookup_on_the_quick_start_flags_and_with_no_route() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--literal-keys", "--namespace", "s3"])
        .spawn();
    assert_eq!(put(&p.url("/bucket/report.csv"), "34").await.status, 200);
    let j = lookup(&p, "path=/bucket/report.csv").await.json();
    assert_eq!(j["route"], "default");
    assert_eq!(j["key"], "s3:/bucket/report.csv");
    assert_eq!(j["highest"], "34");
    assert_eq!(j["literal_keys"], true);
    assert_eq!(j["target"], "/bucket/report.csv");
    // Values are decoded once: the target exactly as a client sends it
    // (`%2F` inside a name is sent as `%252F`), and `+` is a plus.
    assert_eq!(put(&p.url("/bucket/a+b%2Fc"), "3").await.status, 200);
    let j = lookup(&p, "path=/bucket/a+b%252Fc").await.json();
    assert_eq!(j["target"], "/bucket/a+b%2Fc");
    assert_eq!(j["key"], "s3:/bucket/a b/c", "{j}");
    assert_eq!(j["highest"], "3");
    // A URL names its host.
    let j = lookup(&p, "path=http%3A%2F%2Fs3.local%2Fbucket%2Freport.csv")
        .await
        .json();
    assert_eq!(j["key"], "s3:/bucket/report.csv", "{j}");

    let dir2 = tempfile::tempdir().unwrap();
    let config = dir2.path().join("one.toml");
    std::fs::write(
        &config,
        format!(
            "[[routes]]\nname = \"api\"\npath_prefix = \"/api\"\nupstream = \"{}\"\n",
            up.url()
        ),
    )
    .unwrap();
    let p = ProxyBuilder::with_config(&config, dir2.path()).spawn();
    let a = lookup(&p, "path=/other/x").await;
    assert_eq!(a.status, 404, "{}", a.text());
    assert!(a.text().contains("no route"), "{}", a.text());
}

fn explain(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin())
        .arg("explain")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn explain_prints_the_route_template_and_key_offline() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens here: explain starts and opens nothing.
    let config = api_config(dir.path(), "http://127.0.0.1:9");
    let config = config.to_str().unwrap();

    let (code, out, err) = explain(&[
        "--config",
        config,
        "--host",
        "api.internal",
        "/orders/acme/42/items",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("route     orders (host any, path prefix /orders)"),
        "{out}"
    );
    assert!(
        out.contains("template  /orders/{tenant}/{id} (namespace orders-locks, canonical keys)"),
        "{out}"
    );
    assert!(
        out.contains("key       orders-locks:/orders/acme/42\n"),
        "{out}"
    );
    assert!(
        out.contains("upstream  http://127.0.0.1:9/orders/acme/42/items"),
        "{out}"
    );
    assert!(!dir.path().join("fences.redb").exists(), "no store opened");

    let (code, out, _) = explain(&[
        "--config",
        config,
        "--json",
        "--header",
        "X-Account-Id: acct-9",
        "http://ledger.internal/entries",
    ]);
    assert_eq!(code, 0, "{out}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["route"], "ledger");
    assert_eq!(j["key"], "ledger-locks:acct-9");
    assert!(j.get("highest").is_none(), "no store was read: {j}");

    // Refused under a route: exit 1 and why.
    let (code, out, _) = explain(&["--config", config, "--host", "a", "/orders/acme"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("route     orders"), "{out}");
    assert!(
        out.contains(
            "refused   400: the path does not match the route's key template /orders/{tenant}/{id}"
        ),
        "{out}"
    );
    // Refused before any route: exit 1, on stderr.
    let (code, out, err) = explain(&["--config", config, "--host", "a", "/files/%2e%2e/x"]);
    assert_eq!(code, 1, "{out}");
    assert!(err.starts_with("fencegate explain: refused (400)"), "{err}");
    let (code, _, err) = explain(&["--config", config, "/files/x"]);
    assert_eq!(code, 1);
    assert!(err.contains("give the host"), "{err}");
    // Bad arguments: exit 2.
    let (code, _, err) = explain(&[
        "--config", config, "--header", "nocolon", "--host", "a", "/x",
    ]);
    assert_eq!(code, 2, "{err}");
    // The quick-start flags need no file.
    let store = dir.path().join("quick.redb");
    let (code, out, _) = explain(&[
        "--store",
        store.to_str().unwrap(),
        "--upstream",
        "http://127.0.0.1:9",
        "--literal-keys",
        "--namespace",
        "s3",
        "/bucket/report.csv",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("key       s3:/bucket/report.csv"), "{out}");
    assert!(!store.exists(), "no store opened");
}

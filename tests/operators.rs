//! What an operator reads to find a refused write and its writer: the
//! last refusals on the admin API (`GET /v1/refusals`), for the admin
//! token only; the access log's line with the method, the target and the
//! client's trace; and the lookup's answer to who raised a key last, and
//! what is in flight on it.

mod common;

use std::time::Duration;

use common::*;

const TOKEN: &str = ADMIN_TOKEN;
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

async fn setup(extra: &[&str]) -> (tempfile::TempDir, Upstream, Proxy) {
    with_admin_token(extra).await
}

async fn refusals(p: &Proxy, query: &str) -> Answer {
    admin_get(p, &format!("/v1/refusals?{query}")).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_write_is_found_with_its_writer_and_tokens() {
    let (_d, up, p) = setup(&[]).await;
    assert_eq!(put(&p.url("/bucket/obj"), "9").await.status, 200);
    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    let stale = send(
        "PUT",
        &p.url("/bucket/obj?versionId=3"),
        &[
            ("x-fence-token", "7"),
            ("user-agent", "writer/1.0"),
            ("traceparent", &traceparent),
            ("x-request-id", "req-stale-1"),
        ],
        "late",
    )
    .await;
    assert_eq!(stale.status, 409);
    // A write without a token, from the same client.
    let missing = send("PUT", &p.url("/bucket/other"), &[], "x").await;
    assert_eq!(missing.status, 428);

    let a = refusals(&p, "").await;
    assert_eq!(a.status, 200, "{}", a.text());
    let j = a.json();
    let list = j["refusals"].as_array().unwrap();
    assert_eq!(list.len(), 2, "{j}");
    let r = &list[0];
    assert_eq!(r["status"], 409);
    assert_eq!(r["decision"], "stale");
    assert_eq!(r["method"], "PUT");
    assert_eq!(r["target"], "/bucket/obj?versionId=3");
    assert_eq!(r["key"], "default:/bucket/obj");
    assert_eq!(r["token"], "7");
    assert_eq!(
        r["highest"], "9",
        "tokens are strings: JSON numbers lose precision past 2^53"
    );
    assert_eq!(r["client"], "127.0.0.1");
    assert_eq!(r["user_agent"], "writer/1.0");
    assert_eq!(r["request_id"], "req-stale-1");
    assert_eq!(r["trace_id"], TRACE);
    assert!(r["at_ms"].as_u64().unwrap() > 1_700_000_000_000, "{r}");
    assert_eq!(list[1]["status"], 428);
    assert_eq!(list[1]["decision"], "missing_token");
    assert!(list[1]["token"].is_null());
    // The stale body never reached the backend.
    assert!(!up.records().iter().any(|r| r.token.as_deref() == Some("7")));

    // Filters, and polling for what is newer.
    let newest = j["newest"].as_u64().unwrap();
    let j = refusals(&p, "key=%2Fbucket%2Fobj").await.json();
    assert_eq!(j["refusals"].as_array().unwrap().len(), 1, "{j}");
    let j = refusals(&p, "client=192.0.2.9").await.json();
    assert!(j["refusals"].as_array().unwrap().is_empty(), "{j}");
    let j = refusals(&p, &format!("since={newest}")).await.json();
    assert!(j["refusals"].as_array().unwrap().is_empty(), "{j}");
    assert_eq!(put(&p.url("/bucket/obj"), "8").await.status, 409);
    let j = refusals(&p, &format!("since={newest}")).await.json();
    let list = j["refusals"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{j}");
    assert_eq!(list[0]["token"], "8");

    // Bad parameters are named.
    let a = refusals(&p, "limit=0").await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("limit"), "{}", a.text());
    let a = refusals(&p, "colour=red").await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("colour"), "{}", a.text());
}

async fn lookup(p: &Proxy, path: &str) -> serde_json::Value {
    let a = admin_get(p, &format!("/v1/fences?path={path}")).await;
    assert_eq!(a.status, 200, "{}", a.text());
    a.json()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lookup_names_the_request_that_raised_a_key_and_its_writes_in_flight() {
    let (_d, up, p) = setup(&[]).await;
    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    let first = send(
        "PUT",
        &p.url("/bucket/obj?partNumber=1&X-Amz-Signature=secret"),
        &[
            ("x-fence-token", "7"),
            ("user-agent", "writer/1.0"),
            ("traceparent", &traceparent),
        ],
        "v",
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let first_id = first.headers["x-request-id"].to_str().unwrap().to_string();
    let j = lookup(&p, "/bucket/obj").await;
    assert_eq!(j["highest"], "7");
    let r = &j["last_raised"];
    assert_eq!(r["kind"], "raised", "{j}");
    assert_eq!(r["token"], "7");
    assert_eq!(r["previous"], serde_json::Value::Null, "a new key");
    assert_eq!(r["method"], "PUT");
    assert_eq!(
        r["target"], "/bucket/obj?partNumber=1&X-Amz-Signature=REDACTED",
        "credentials are never kept"
    );
    assert_eq!(r["client"], "127.0.0.1");
    assert_eq!(r["user_agent"], "writer/1.0");
    assert_eq!(r["request_id"], first_id.as_str());
    assert_eq!(r["trace_id"], TRACE);
    assert_eq!(j["in_flight"], serde_json::json!([]));
    assert_eq!(j["held_ms"], serde_json::Value::Null);
    assert_eq!(j["older_mapping_in_flight"], 0);

    // Without the admin token, the lookup names no client.
    let a = send("GET", &p.admin_url("/v1/fences?path=/bucket/obj"), &[], "").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["highest"], "7");
    assert!(a.json().get("last_raised").is_none(), "{}", a.text());

    // A write at the same token raises nothing: the first stays named.
    assert_eq!(put(&p.url("/bucket/obj"), "7").await.status, 200);
    assert_eq!(
        lookup(&p, "/bucket/obj").await["last_raised"]["request_id"],
        first_id.as_str()
    );

    // A newer write, held by the backend: it is the raiser, and in flight.
    let slow = slow_put(p.url("/bucket/obj"), "9", "3000");
    eventually(
        "the slow write reached the backend",
        Duration::from_secs(10),
        || up.arrivals() == 3,
    )
    .await;
    let j = lookup(&p, "/bucket/obj").await;
    assert_eq!(j["last_raised"]["token"], "9", "{j}");
    assert_eq!(j["last_raised"]["previous"], "7");
    assert_eq!(
        j["in_flight"],
        serde_json::json!([{"token": "9", "writes": 1}])
    );
    assert_eq!(slow.await.unwrap().status, 200);
    assert_eq!(
        lookup(&p, "/bucket/obj").await["in_flight"],
        serde_json::json!([])
    );

    // Fence-ahead is a raise too; its caller is the admin token's holder.
    let auth = format!("Bearer {TOKEN}");
    let ahead = send(
        "POST",
        &p.admin_url("/v1/fences/default%3A%2Fbucket%2Fobj"),
        &[("authorization", &auth), ("x-request-id", "grant-12")],
        r#"{"token": "12"}"#,
    )
    .await;
    assert_eq!(ahead.status, 200, "{}", ahead.text());
    let r = lookup(&p, "/bucket/obj").await["last_raised"].clone();
    assert_eq!(r["kind"], "fence_ahead", "{r}");
    assert_eq!(r["token"], "12");
    assert_eq!(r["request_id"], "grant-12");
    assert_eq!(r["client"], serde_json::Value::Null);
    assert_eq!(r["previous"], "9");

    // After a reset, the next raise to the same token is named, not the
    // fence-ahead from before it.
    let reset = send(
        "DELETE",
        &p.admin_url("/v1/fences/default%3A%2Fbucket%2Fobj"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(reset.status, 200, "{}", reset.text());
    let again = put(&p.url("/bucket/obj"), "12").await;
    assert_eq!(again.status, 200);
    let r = lookup(&p, "/bucket/obj").await["last_raised"].clone();
    assert_eq!(r["kind"], "raised", "{r}");
    assert_eq!(r["previous"], serde_json::Value::Null, "from nothing");
    assert_eq!(
        r["request_id"],
        again.headers["x-request-id"].to_str().unwrap()
    );

    // A key never raised through this process names nobody.
    assert_eq!(
        lookup(&p, "/bucket/other").await["last_raised"],
        serde_json::Value::Null
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_refusals_are_for_the_admin_token_only() {
    let (_d, _up, p) = setup(&[]).await;
    assert_eq!(put(&p.url("/k"), "5").await.status, 200);
    assert_eq!(put(&p.url("/k"), "4").await.status, 409);
    let url = p.admin_url("/v1/refusals");
    let a = send("GET", &url, &[], "").await;
    assert_eq!(a.status, 401, "{}", a.text());
    assert!(!a.text().contains("/k"), "{}", a.text());
    let a = send(
        "GET",
        &url,
        &[("authorization", "Bearer not-the-token")],
        "",
    )
    .await;
    assert_eq!(a.status, 401);
    // Without a token file, nobody reads them.
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let open = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    assert_eq!(put(&open.url("/k"), "4").await.status, 200);
    let a = send(
        "GET",
        &open.admin_url("/v1/refusals"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
    )
    .await;
    assert_eq!(a.status, 401);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ring_keeps_the_configured_number() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let config = dir.path().join("f.toml");
    std::fs::write(
        &config,
        format!(
            "store = \"{}\"\nrefusals_kept = 3\nadmin_token_file = \"{}\"\n\n[[routes]]\nname = \"default\"\nupstream = \"{}\"\n",
            dir.path().join("fences.redb").display(),
            token_file.display(),
            up.url()
        ),
    )
    .unwrap();
    let p = ProxyBuilder::with_config(&config, dir.path()).spawn();
    for i in 0..5 {
        assert_eq!(
            send("PUT", &p.url(&format!("/k{i}")), &[], "").await.status,
            428
        );
    }
    let j = refusals(&p, "").await.json();
    assert_eq!(j["kept"], 3);
    assert_eq!(j["newest"], 5);
    let seqs: Vec<u64> = j["refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [3, 4, 5]);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_access_log_names_the_target_and_the_trace() {
    let (_d, up, p) = setup(&["--access-log"]).await;
    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    let long = format!("/r?{}", "q".repeat(2000));
    assert_eq!(
        send(
            "GET",
            &p.url("/reads/a%20b?x=1"),
            &[("traceparent", &traceparent)],
            ""
        )
        .await
        .status,
        200
    );
    assert_eq!(send("GET", &p.url(&long), &[], "").await.status, 200);
    // The trace goes upstream as it came.
    let read = up
        .records()
        .into_iter()
        .find(|r| r.target.starts_with("/reads/"))
        .unwrap();
    assert_eq!(read.headers["traceparent"], traceparent.as_str());
    eventually(
        "the access log lines",
        std::time::Duration::from_secs(10),
        || p.stderr().matches("fencegate::access").count() >= 2,
    )
    .await;
    let log = p.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("fencegate::access") && l.contains("/reads/"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains(r#"target="/reads/a%20b?x=1""#), "{line}");
    assert!(line.contains(&format!(r#"trace_id="{TRACE}""#)), "{line}");
    assert!(line.contains("method=GET"), "{line}");
    // A long target is cut, not logged whole.
    let line = log
        .lines()
        .find(|l| l.contains("fencegate::access") && l.contains("/r?q"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("qqq...\""), "{line}");
    assert!(line.len() < 1500, "{}", line.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_is_served_whole_and_its_status_is_for_the_admin() {
    let (_d, _up, p) = setup(&[]).await;
    for (path, kind) in [
        ("/", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/style.css", "text/css"),
    ] {
        let a = send("GET", &p.admin_url(path), &[], "").await;
        assert_eq!(a.status, 200, "{path}");
        assert!(
            a.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with(kind),
            "{path}"
        );
        let csp = a.headers["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
            "{csp}"
        );
        // Nothing fetched from elsewhere: every URL in it is its own.
        assert!(
            !a.text().contains("http://") && !a.text().contains("https://"),
            "{path}"
        );
    }
    let url = p.admin_url("/v1/status");
    assert_eq!(send("GET", &url, &[], "").await.status, 401);
    assert_eq!(put(&p.url("/k"), "5").await.status, 200);
    assert_eq!(put(&p.url("/k"), "4").await.status, 409);
    let a = admin_get(&p, "/v1/status").await;
    assert_eq!(a.status, 200, "{}", a.text());
    let j = a.json();
    assert_eq!(j["store"]["engine"], "embedded", "{j}");
    assert_eq!(j["store"]["up"], true);
    assert!(j["store"]["amnesia"].is_null());
    assert_eq!(j["writes"]["admitted"], 1.0, "{j}");
    assert_eq!(j["writes"]["stale"], 1.0, "{j}");
    assert_eq!(j["refusals_newest"], 1);
    // The page's own traffic is counted, by endpoint and status.
    let metrics = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    for line in [
        r#"fencegate_admin_requests_total{code="200",endpoint="page"} 3"#,
        r#"fencegate_admin_requests_total{code="401",endpoint="status"} 1"#,
        r#"fencegate_admin_requests_total{code="200",endpoint="status"} 1"#,
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in\n{metrics}"
        );
    }
}

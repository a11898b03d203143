//! The subcommands that do not run the proxy: `init-store`, `explain`,
//! `probe` and `lease`.

use std::process::ExitCode;
use std::time::Duration;

use fencegate::config::Config;

use super::opts::*;

/// `fencegate init-store`: marks the shared store named by `--store` (or
/// the config file) as fencegate's. Exit 0 if it is marked afterwards.
pub(crate) fn init_store(opts: &Opts) -> ExitCode {
    use fencegate::config::StoreConfig;
    let store = raw_config(opts, opts.config.as_ref())
        .and_then(|raw| fencegate::config::store(&raw).map_err(anyhow::Error::from));
    let shared = match store {
        Ok(StoreConfig::Shared(s)) => s,
        Ok(StoreConfig::Embedded { path, .. }) => {
            println!(
                "{} is an embedded store: it is created at the first start, nothing to do",
                path.display()
            );
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("fencegate: {e:#}");
            return ExitCode::from(2);
        }
    };
    block_on(async {
        let result = async {
            let store = fencegate::store::connect_shared(&shared, None)?;
            Ok::<_, anyhow::Error>(store.initialise().await?)
        }
        .await;
        match result {
            Ok(true) => {
                println!("initialised {}", shared.redacted_url());
                ExitCode::SUCCESS
            }
            Ok(false) => {
                println!(
                    "{} is initialised already; nothing changed",
                    shared.redacted_url()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fencegate init-store: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}

/// `s` with control characters escaped: a decoded key may hold them, and
/// they are never sent to a terminal raw.
pub(crate) fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `fencegate explain PATH`: exit 0 when a write there has a fence key, 1
/// when it would be refused (and why), 2 on bad arguments.
pub(crate) fn explain(
    config: &Config,
    target: &str,
    host: Option<&str>,
    header_args: &[String],
    json: bool,
) -> ExitCode {
    let mut headers = http::HeaderMap::new();
    for h in header_args {
        let Some((n, v)) = fencegate::routing::parse_header(h) else {
            eprintln!("fencegate explain: --header {h:?} is not `NAME: VALUE`");
            return ExitCode::from(2);
        };
        headers.append(n, v);
    }
    let explained = match fencegate::routing::explain(
        &config.routes,
        host,
        target,
        &headers,
        config.limits.max_key_bytes,
    ) {
        Ok(e) => e,
        Err(e) => {
            eprintln!(
                "fencegate explain: refused ({}): {}",
                e.status().as_u16(),
                printable(&e.to_string())
            );
            return ExitCode::FAILURE;
        }
    };
    if json {
        println!("{}", explained.to_json());
    } else {
        let r = &explained.route;
        println!(
            "route     {} (host {}, path prefix {})",
            r.name,
            r.host.as_deref().unwrap_or("any"),
            r.path_prefix
        );
        println!(
            "template  {} (namespace {}, {} keys)",
            r.key,
            r.namespace,
            if r.literal_keys {
                "literal"
            } else {
                "canonical"
            }
        );
        println!(
            "upstream  {}{}",
            r.upstream,
            printable(&explained.upstream_target)
        );
        match &explained.key {
            Ok(k) => println!("key       {}", printable(k)),
            Err(e) => println!(
                "refused   {}: {}",
                e.status().as_u16(),
                printable(&e.to_string())
            ),
        }
    }
    if explained.key.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `fencegate probe URL`: exit 0 on 2xx within 5 s. A `/readyz` that
/// answers `degraded` (a Redis Cluster with some shards failing) passes,
/// and the failing shards are printed.
pub(crate) fn probe(url: &str) -> ExitCode {
    use http_body_util::Empty;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    block_on(async {
        let Ok(uri) = url.parse::<http::Uri>() else {
            eprintln!("fencegate probe: `{url}` is not a URL");
            return ExitCode::from(2);
        };
        let client: Client<_, Empty<bytes::Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let answer = async {
            let resp = client.get(uri).await?;
            let status = resp.status();
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Ok::<_, hyper_util::client::legacy::Error>((status, body))
        };
        match tokio::time::timeout(std::time::Duration::from_secs(5), answer).await {
            Ok(Ok((status, body))) if status.is_success() => {
                if let Some(note) = degraded(&body) {
                    eprintln!("fencegate probe: {note}");
                }
                ExitCode::SUCCESS
            }
            Ok(Ok((status, body))) => {
                eprintln!(
                    "fencegate probe: {status} {}",
                    String::from_utf8_lossy(&body)
                );
                ExitCode::FAILURE
            }
            Ok(Err(e)) => {
                eprintln!("fencegate probe: {}", fencegate::error::error_chain(&e));
                ExitCode::FAILURE
            }
            Err(_) => {
                eprintln!("fencegate probe: timed out");
                ExitCode::FAILURE
            }
        }
    })
}

/// What a `degraded` readiness answer says is failing: the error, and
/// each failing shard with its groups.
fn degraded(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    if v["status"] != "degraded" {
        return None;
    }
    let shards: Vec<String> = v["shards"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["failing"].is_string())
        .map(|s| {
            format!(
                "{} ({} of {} groups failing: {})",
                s["shard"].as_str().unwrap_or("?"),
                s["unreachable"].as_u64().unwrap_or(0) + s["lost"].as_u64().unwrap_or(0),
                s["groups"],
                s["failing"].as_str().unwrap_or("")
            )
        })
        .collect();
    Some(format!(
        "degraded: {}; failing shards: {}",
        v["error"].as_str().unwrap_or("?"),
        shards.join("; ")
    ))
}

/// `fencegate lease ...`: one request to the lease API.
pub(crate) fn lease(op: &LeaseOp, url: Option<&str>, opts: &Opts) -> ExitCode {
    use fencegate::lease::client::{call, read_token, ClientError};
    use serde_json::json;
    let fail = |e: ClientError| {
        eprintln!("fencegate lease: {e}");
        ExitCode::from(e.exit_code())
    };
    let Some(url) = url else {
        eprintln!("fencegate lease: give the lease API's URL (--lease-url or FENCEGATE_LEASE_URL)");
        return ExitCode::from(2);
    };
    let Some(file) = &opts.lease_token_file else {
        eprintln!("fencegate lease: give the bearer token's file (--lease-token-file or FENCEGATE_LEASE_TOKEN_FILE)");
        return ExitCode::from(2);
    };
    let token = match read_token(file) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let millis = |flag: &str, text: &str| {
        let d = fencegate::config::parse_duration(text).map_err(|e| format!("--{flag}: {e}"))?;
        if d.subsec_nanos() % 1_000_000 != 0 {
            return Err(format!(
                "--{flag}: `{text}` is not a whole number of milliseconds"
            ));
        }
        Ok(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    };
    let request = match op {
        LeaseOp::Acquire {
            key,
            path,
            request_host,
            ttl,
            holder,
            wait,
        } => {
            let holder = holder.clone().unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_default();
                format!("{host}:{}", std::process::id())
            });
            let mut body = json!({"holder": holder});
            match (key, path) {
                (Some(k), None) => body["key"] = json!(k),
                (None, Some(p)) => {
                    body["path"] = json!(p);
                    if let Some(h) = request_host {
                        body["host"] = json!(h);
                    }
                }
                _ => {
                    eprintln!("fencegate lease acquire: give a KEY or --path, one of them");
                    return ExitCode::from(2);
                }
            }
            let wait_ms = match wait.as_deref().map(|w| millis("wait", w)).transpose() {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("fencegate lease acquire: {e}");
                    return ExitCode::from(2);
                }
            };
            match millis("ttl", ttl) {
                Ok(t) => body["ttl_ms"] = json!(t),
                Err(e) => {
                    eprintln!("fencegate lease acquire: {e}");
                    return ExitCode::from(2);
                }
            }
            if let Some(w) = wait_ms {
                body["wait_ms"] = json!(w);
            }
            let limit = Duration::from_millis(wait_ms.unwrap_or(0)) + Duration::from_secs(10);
            (
                http::Method::POST,
                "/v1/leases".to_string(),
                Some(body),
                limit,
            )
        }
        LeaseOp::Renew { lease, ttl } => match millis("ttl", ttl) {
            Ok(t) => (
                http::Method::POST,
                format!("/v1/leases/{lease}/renew"),
                Some(json!({ "ttl_ms": t })),
                Duration::from_secs(10),
            ),
            Err(e) => {
                eprintln!("fencegate lease renew: {e}");
                return ExitCode::from(2);
            }
        },
        LeaseOp::Release { lease } => (
            http::Method::DELETE,
            format!("/v1/leases/{lease}"),
            None,
            Duration::from_secs(10),
        ),
    };
    let (method, path, body, limit) = request;
    block_on(async move {
        match call(url, &token, method, &path, body, limit).await {
            Ok(answer) => {
                let field = |f: &str| answer.get(f).and_then(|v| v.as_str()).unwrap_or("");
                if !matches!(op, LeaseOp::Release { .. }) {
                    println!("{} {}", field("lease"), field("token"));
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        }
    })
}

/// Runs a one-shot subcommand's future on a single-threaded runtime.
pub(crate) fn block_on(f: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(f),
        Err(e) => {
            eprintln!("fencegate: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

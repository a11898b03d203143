//! The admin listener: metrics, health, readiness and the fence API.
//!
//! It binds loopback by default and is separate from the proxy port, so the
//! data path never exposes it. Every mutation, and every read of what
//! clients sent (`/v1/refusals`: their addresses and targets), goes through
//! [`Admin::authorized`] (the bearer token of `--admin-token-file`).

use std::convert::Infallible;
use std::sync::Arc;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use tokio_util::sync::CancellationToken;

mod page;
mod status;

use crate::bearer::same_secret;
use crate::error::{full, json_response, problem_response, ProxyBody};
use crate::fence::Fence;
use crate::metrics::Metrics;
use crate::routing::Explain;

/// State the admin endpoints read.
pub struct Admin {
    pub fence: Arc<Fence>,
    /// The proxy's live routes answer the lookup by request (`GET /v1/fences?path=`).
    pub routes: Arc<dyn Explain>,
    pub metrics: Arc<Metrics>,
    /// Swapped by a reload (token rotation).
    pub admin_token: arc_swap::ArcSwapOption<String>,
    /// Cancelled when shutdown starts: `/readyz` turns 503 so load balancers
    /// stop sending new work while in-flight requests drain.
    pub draining: CancellationToken,
    /// The proxy's last refusals (`GET /v1/refusals`).
    pub refusals: Arc<crate::refusals::Refusals>,
    /// The last raises of keys' highest tokens (the lookup's `last_raised`).
    pub raises: Arc<crate::raises::Raises>,
}

/// An admin API problem; its type names the status (`admin-unauthorized`,
/// `admin-not-found`...), as every other problem of fencegate's has a type
/// of its own.
fn problem(status: StatusCode, detail: &str) -> Response<ProxyBody> {
    let kind = status
        .canonical_reason()
        .unwrap_or("error")
        .to_ascii_lowercase()
        .replace(' ', "-");
    problem_response(
        status,
        json!({
            "type": format!("urn:fencegate:problem:admin-{kind}"),
            "title": status.canonical_reason().unwrap_or(""),
            "status": status.as_u16(),
            "detail": detail,
        }),
    )
}

fn unauthorized() -> Response<ProxyBody> {
    let mut r = problem(
        StatusCode::UNAUTHORIZED,
        "this admin endpoint needs the admin bearer token (--admin-token-file)",
    );
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// Decodes one percent-encoded path segment into the key text.
fn decode_segment(seg: &str) -> Option<String> {
    String::from_utf8(crate::key::percent_decode(seg).ok()?).ok()
}

/// The endpoint a path names, as the admin request counter labels it (a
/// bounded set, whatever a client sends).
fn endpoint(path: &str) -> &'static str {
    match path {
        "/" | "/ui" | "/ui/" | "/ui/app.js" | "/ui/style.css" => "page",
        "/v1/status" => "status",
        "/v1/refusals" => "refusals",
        "/v1/fences" => "lookup",
        p if p.starts_with("/v1/fences/") => "fence",
        "/metrics" => "metrics",
        "/healthz" | "/readyz" => "health",
        "/v1/store/confirm-reset" => "confirm_reset",
        _ => "other",
    }
}

impl Admin {
    /// Whether a request carries the admin bearer token. Without a
    /// configured token, nothing is authorized.
    pub fn authorized<B>(&self, req: &Request<B>) -> bool {
        let expected = self.admin_token.load();
        let Some(expected) = expected.as_deref() else {
            return false;
        };
        let Some(got) = crate::bearer::bearer_credential(req) else {
            return false;
        };
        same_secret(got, expected)
    }

    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let path = req.uri().path().to_string();
        let get = req.method() == Method::GET || req.method() == Method::HEAD;
        let resp = match path.as_str() {
            "/metrics" if get => {
                let left = self.fence.recovering_for();
                self.metrics.recovering.set(i64::from(left.is_some()));
                self.metrics
                    .recovery_seconds_left
                    .set(left.map_or(0.0, |d| d.as_secs_f64()));
                self.metrics.recovery_held_keys.set(
                    self.fence
                        .held_keys()
                        .map_or(-1, |n| i64::try_from(n).unwrap_or(i64::MAX)),
                );
                self.metrics
                    .in_flight_marks
                    .set(i64::try_from(self.fence.store().in_flight_marks()).unwrap_or(i64::MAX));
                // Pinged first, so that the amnesia gauge agrees with the
                // shards' in the same scrape.
                let shards = self.fence.store().shards().await;
                self.metrics
                    .store_amnesia
                    .set(i64::from(self.fence.store().amnesia().is_some()));
                if let Some(shards) = shards {
                    let m = &self.metrics;
                    for g in [
                        &m.store_shard_up,
                        &m.store_shard_groups,
                        &m.store_shard_groups_lost,
                    ] {
                        g.reset();
                    }
                    for s in shards {
                        let at = [s.shard.as_str()];
                        m.store_shard_up
                            .with_label_values(&at)
                            .set(i64::from(s.up()));
                        m.store_shard_groups
                            .with_label_values(&at)
                            .set(i64::try_from(s.groups).unwrap_or(i64::MAX));
                        m.store_shard_groups_lost
                            .with_label_values(&at)
                            .set(i64::try_from(s.lost).unwrap_or(i64::MAX));
                    }
                }
                let replicas = self.fence.store().replicas();
                let last = replicas.and_then(|r| r.last);
                self.metrics
                    .store_replicas_wanted
                    .set(last.map_or(-1, |w| i64::from(w.wanted)));
                self.metrics
                    .store_replicas_confirmed
                    .set(last.map_or(-1, |w| i64::from(w.confirmed)));
                self.metrics
                    .replica_wait_failures_seen(replicas.map_or(0, |r| r.failed_waits));
                let mut r = Response::new(full(self.metrics.render()));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            "/healthz" if get => json_response(StatusCode::OK, json!({"status": "ok"})),
            "/readyz" if get => self.ready().await,
            // The page is static (no data in it): it asks for the token,
            // and every call it makes carries it.
            "/" | "/ui" | "/ui/" | "/ui/app.js" | "/ui/style.css" if get => page::asset(&path),
            "/v1/status" if get => match self.authorized(&req) {
                false => unauthorized(),
                true => {
                    let started = std::time::Instant::now();
                    let shards = self.fence.store().shards().await;
                    let store = match &shards {
                        Some(s) => crate::store::Shard::failing(s).map_or(Ok(()), Err),
                        None => self.fence.store().ping().await.map_err(|e| e.to_string()),
                    };
                    let pinged = started.elapsed();
                    json_response(
                        StatusCode::OK,
                        status::status(
                            &self.fence,
                            &self.metrics,
                            (store, pinged, shards),
                            self.draining.is_cancelled(),
                            self.refusals.newest(),
                        ),
                    )
                }
            },
            // Client addresses and request targets: for the admin only.
            "/v1/refusals" if get => match self.authorized(&req) {
                false => unauthorized(),
                true => self.refusals_answer(req.uri().query().unwrap_or("")),
            },
            "/v1/fences" if get => {
                let who = self.authorized(&req);
                self.lookup(req.uri().query().unwrap_or(""), who).await
            }
            p if p.starts_with("/v1/fences/") && get => {
                let seg = &p["/v1/fences/".len()..];
                match decode_segment(seg).filter(|k| !seg.is_empty() && !seg.contains('/') && !k.is_empty()) {
                    None => problem(StatusCode::BAD_REQUEST, "the key must be one percent-encoded path segment, e.g. /v1/fences/default%3A%2Fbucket%2Fobj"),
                    Some(key) => match self.fence.store().highest(&key).await {
                        Ok(Some(h)) => json_response(StatusCode::OK, json!({"key": key, "highest": h.to_string()})),
                        Ok(None) => problem(StatusCode::NOT_FOUND, "this key has never been fenced"),
                        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
                    },
                }
            }
            "/v1/store/confirm-reset" if req.method() == Method::POST => {
                if !self.authorized(&req) {
                    unauthorized()
                } else {
                    match self.fence.store().confirm_reset().await {
                        Ok(()) => {
                            self.raises.clear();
                            tracing::warn!("store reset confirmed through the admin API");
                            json_response(StatusCode::OK, json!({"status": "confirmed"}))
                        }
                        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
                    }
                }
            }
            "/metrics" | "/healthz" | "/readyz" | "/v1/fences" | "/v1/refusals" | "/v1/status" => {
                let mut r = problem(StatusCode::METHOD_NOT_ALLOWED, "use GET");
                r.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
                r
            }
            p if p.starts_with("/v1/fences/") => {
                if !self.authorized(&req) {
                    unauthorized()
                } else {
                    let seg = p["/v1/fences/".len()..].to_string();
                    match decode_segment(&seg).filter(|k| !seg.contains('/') && !k.is_empty()) {
                        None => problem(
                            StatusCode::BAD_REQUEST,
                            "the key must be one percent-encoded path segment",
                        ),
                        Some(key) => match *req.method() {
                            Method::POST => self.fence_ahead(&key, req).await,
                            Method::DELETE => self.reset(&key).await,
                            _ => {
                                let mut r = problem(
                                    StatusCode::METHOD_NOT_ALLOWED,
                                    "fences support GET, POST (fence-ahead) and DELETE (reset)",
                                );
                                r.headers_mut().insert(
                                    header::ALLOW,
                                    HeaderValue::from_static("GET, HEAD, POST, DELETE"),
                                );
                                r
                            }
                        },
                    }
                }
            }
            _ => problem(StatusCode::NOT_FOUND, "unknown admin endpoint"),
        };
        self.metrics
            .admin_requests
            .with_label_values(&[endpoint(&path), resp.status().as_str()])
            .inc();
        Ok(resp)
    }

    /// `GET /v1/refusals[?since=SEQ][&key=TEXT][&client=IP][&limit=N]`:
    /// the last refusals (oldest first; `limit`, 100 by default and at
    /// most 1000, keeps the newest), those after `since`, whose key
    /// contains `key`, or of `client`; and `newest`, the `since` of the
    /// next poll.
    fn refusals_answer(&self, query: &str) -> Response<ProxyBody> {
        let mut f = crate::refusals::Filter {
            limit: 100,
            ..Default::default()
        };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = crate::key::percent_decode(value)
                .ok()
                .and_then(|b| String::from_utf8(b).ok());
            let parsed = match (name, value) {
                ("since", Some(v)) => v.parse().map(|n| f.since = n).ok(),
                ("limit", Some(v)) => v
                    .parse()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .map(|n| f.limit = n),
                ("key", Some(v)) => {
                    f.key = Some(v).filter(|v| !v.is_empty());
                    Some(())
                }
                ("client", Some(v)) if v.is_empty() => Some(()),
                ("client", Some(v)) => v.parse().map(|ip| f.client = Some(ip)).ok(),
                (other, _) if !matches!(other, "since" | "limit" | "key" | "client") => {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        &format!("unknown parameter {other:?} (since, key, client, limit)"),
                    )
                }
                _ => None,
            };
            if parsed.is_none() {
                return problem(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "bad {name}: since is a sequence number, limit 1 to 1000, client an IP address"
                    ),
                );
            }
        }
        let (refusals, newest) = self.refusals.read(&f);
        json_response(
            StatusCode::OK,
            json!({
                "refusals": refusals,
                "newest": newest,
                "kept": self.refusals.kept(),
            }),
        )
    }

    /// `GET /v1/fences?path=P[&host=H][&header=NAME:VALUE...]`: the fence
    /// a write to `P` takes, in request terms (route, key template, key,
    /// highest token), so nobody has to spell keys by hand. Each value is
    /// percent-decoded once (`curl -G --data-urlencode path=...`), so `P`
    /// is the target exactly as a client sends it; `+` is a plus, not a
    /// space. `header` is only needed by `header:NAME` key templates.
    /// `last_raised` names a client: only with the admin token (`who`).
    async fn lookup(&self, query: &str, who: bool) -> Response<ProxyBody> {
        let (mut path, mut host) = (None, None);
        let mut headers = http::HeaderMap::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let Some(value) = crate::key::percent_decode(value)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
            else {
                return problem(
                    StatusCode::BAD_REQUEST,
                    &format!("the {name} parameter is not percent-encoded UTF-8"),
                );
            };
            let once = |slot: &mut Option<String>| match slot.replace(value.clone()) {
                None => Ok(()),
                Some(_) => Err(format!("the {name} parameter is given twice")),
            };
            let given = match name {
                "path" => once(&mut path),
                "host" => once(&mut host),
                "header" => match crate::routing::parse_header(&value) {
                    Some((n, v)) => {
                        headers.append(n, v);
                        Ok(())
                    }
                    None => Err("the header parameter must be NAME:VALUE".to_string()),
                },
                other => Err(format!(
                    "unknown parameter {other}: use path, host and header"
                )),
            };
            if let Err(why) = given {
                return problem(StatusCode::BAD_REQUEST, &why);
            }
        }
        let Some(path) = path else {
            return problem(
                StatusCode::BAD_REQUEST,
                "give the request's path: /v1/fences?path=/bucket/report.csv (and host=H when routes name hosts)",
            );
        };
        let explained = match self.routes.explain(host.as_deref(), &path, &headers) {
            Ok(e) => e,
            Err(e) => return problem(e.status(), &e.to_string()),
        };
        let mut answer = explained.to_json();
        if let Ok(key) = &explained.key {
            let highest = match self.fence.store().highest(key).await {
                Ok(h) => h,
                Err(e) => return problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
            };
            answer["highest"] = json!(highest.map(|h| h.to_string()));
            // Only a raise to the highest the store holds now answers "who
            // raised it": an older one kept here was overtaken elsewhere.
            if who {
                answer["last_raised"] = match self.raises.last(key) {
                    Some(r) if Some(r.token) == highest => json!(r),
                    _ => serde_json::Value::Null,
                };
            }
            let activity = self.fence.activity(key);
            answer["in_flight"] = activity
                .in_flight
                .iter()
                .map(|(token, writes)| json!({"token": token.to_string(), "writes": writes}))
                .collect();
            answer["held_ms"] = json!(activity.held_for.map(|d| d.as_millis() as u64));
        }
        answer["older_mapping_in_flight"] = json!(self.routes.older_mapping_in_flight());
        json_response(StatusCode::OK, answer)
    }

    /// `POST /v1/fences/{key}` with `{"token": "N"}`: raise the fence at
    /// lock grant, before the new holder's first write.
    async fn fence_ahead(&self, key: &str, req: Request<Incoming>) -> Response<ProxyBody> {
        use http_body_util::BodyExt;
        let (parts, body) = req.into_parts();
        let body = match http_body_util::Limited::new(body, 4096).collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return problem(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "the body must be a small JSON object",
                )
            }
        };
        let token = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| match &v["token"] {
                serde_json::Value::String(s) => crate::token::parse_token(s.as_bytes()).ok(),
                serde_json::Value::Number(n) => n.as_u64(),
                _ => None,
            });
        let Some(token) = token else {
            return problem(
                StatusCode::BAD_REQUEST,
                r#"expected {"token": "N"} with N an unsigned decimal integer"#,
            );
        };
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .map(|v| crate::refusals::bounded(&String::from_utf8_lossy(v.as_bytes()), 256))
        };
        let mut raised = None;
        let since = self.raises.generation();
        let answer = self.fence.raise_noting(key, token, &mut raised).await;
        // Kept only when this call raised the key (not a retry that found
        // it at the token already).
        if let Some(crate::fence::Raised::From { previous, at_ms }) = raised {
            self.raises.push(
                crate::raises::Raise {
                    seq: 0,
                    at_ms,
                    kind: crate::raises::Kind::FenceAhead,
                    key: key.into(),
                    token,
                    previous,
                    method: parts.method.to_string(),
                    target: crate::refusals::loggable_target(&parts.uri),
                    client: None,
                    user_agent: header("user-agent"),
                    request_id: header("x-request-id").unwrap_or_else(|| "-".into()),
                    trace_id: parts
                        .headers
                        .get("traceparent")
                        .and_then(|v| crate::refusals::trace_id(v.as_bytes())),
                },
                since,
            );
        }
        match answer {
            Ok(highest) => {
                tracing::info!(key, token, "fence-ahead: highest raised");
                json_response(
                    StatusCode::OK,
                    json!({"key": key, "highest": highest.to_string()}),
                )
            }
            Err(crate::fence::FenceError::Stale { highest, .. }) => {
                let mut r = problem(
                    StatusCode::CONFLICT,
                    &format!("token {token} is lower than the highest token {highest}"),
                );
                r.headers_mut().insert(
                    crate::token::FENCE_TOKEN_HIGHEST.clone(),
                    HeaderValue::from(highest),
                );
                r
            }
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        }
    }

    /// `DELETE /v1/fences/{key}`: forget a fence (after token inflation
    /// locked a key out). Audited in the log.
    async fn reset(&self, key: &str) -> Response<ProxyBody> {
        match self.fence.forget(key).await {
            Ok(previous) => {
                self.raises.forget(key);
                tracing::warn!(key, previous = ?previous, "AUDIT: fence reset by an operator through the admin API");
                json_response(
                    StatusCode::OK,
                    json!({"key": key, "previous": previous.map(|p| p.to_string())}),
                )
            }
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        }
    }

    async fn ready(&self) -> Response<ProxyBody> {
        if self.draining.is_cancelled() {
            return json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "draining"}),
            );
        }
        let recovering = self.fence.recovering_for().map(|d| d.as_secs_f64());
        let store = self.fence.store();
        // A store over shards pings each of its groups for the report.
        let shards = store.shards().await;
        let pinged = match &shards {
            Some(s) => match crate::store::Shard::failing(s) {
                None => Ok(()),
                Some(why) => Err(why),
            },
            None => store.ping().await.map_err(|e| e.to_string()),
        };
        // A store over shards is ready while some shard serves: a shard
        // down is down for every replica alike, and turning them all away
        // would stop the healthy shards' writes too. The failing ones are
        // named. (A replica cut off from some shards alone stays in
        // rotation too; its writes there fail closed.)
        let serving = shards
            .as_ref()
            .is_some_and(|s| s.iter().any(crate::store::Shard::serving));
        // The store answers only if every part does (a degraded store
        // counts as down in the metric operators alert on).
        self.metrics.store_up.set(i64::from(pinged.is_ok()));
        let (status, mut body) = match pinged {
            Ok(()) => (
                StatusCode::OK,
                json!({"status": "ready", "store": store.kind(), "recovering_seconds": recovering, "recovery_held_keys": self.fence.held_keys()}),
            ),
            Err(e) if serving => (
                StatusCode::OK,
                json!({"status": "degraded", "store": store.kind(), "error": e, "recovering_seconds": recovering, "recovery_held_keys": self.fence.held_keys()}),
            ),
            Err(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "store unavailable", "store": store.kind(), "error": e}),
            ),
        };
        if let Some(shards) = shards {
            body["shards"] = json!(shards);
        }
        json_response(status, body)
    }
}

//! The lock service: leases whose tokens come from the fence itself.
//!
//! A lease on a key is granted with a token one above every token the key
//! ever had (admitted or granted), and the key's highest is raised to it
//! durably before the answer leaves, so the previous holder's writes are
//! refused from that moment (Chubby's sequencers; fencing tokens). On a
//! route with `tokens = "granted"` a write must carry the key's last grant:
//! a token above it was never granted (403) and never reaches the backend.
//!
//! Leases live in the fence store ([`crate::store::FenceStore::claim_lock`]),
//! so any replica on a shared store may grant, renew or release them. A
//! lease id is `NONCE TAG.KEY` (the key in unpadded base64url), so every
//! operation on an id finds its key without an index; TAG is an HMAC of
//! the rest under the bearer token that took the lease, so only that token
//! (on any replica: they share the token file) can renew, read or release
//! it.
//!
//! The API (`lease_listen`), each request with `Authorization: Bearer T`:
//! `POST /v1/leases`, `GET /v1/leases/{id}`, `POST /v1/leases/{id}/renew`,
//! `DELETE /v1/leases/{id}`. docs/leases.md has the details.

pub mod client;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Map, Value};
use tokio::sync::Notify;

use crate::bearer::{same_secret, Bearer};
use crate::clock::millis as ms;
use crate::error::{full, json_response, LeaseError, ProxyBody};
use crate::fence::Fence;
use crate::metrics::Metrics;
use crate::routing::Explain;
use crate::store::{Claim, Lock};

/// Largest request body the API reads.
const MAX_BODY: usize = 16 * 1024;
/// Longest `holder` text.
const MAX_HOLDER: usize = 256;
/// A waiting acquire asks the store again after this, then after twice as
/// long each time up to [`WAIT_POLL_MAX`], and at the holder's expiry: a
/// release on this replica wakes it at once, one on another replica is
/// seen at the next poll. Many waiters must not load the store much.
const WAIT_POLL: Duration = Duration::from_millis(50);
const WAIT_POLL_MAX: Duration = Duration::from_millis(400);

/// Hex digits of the nonce ([`crate::id::unique_id`]) at the start of an id.
const NONCE_HEX: usize = 32;

/// Whether a key's resource, if it is a path (starts with `/`), has the
/// form every path a write maps to has, in either key mode: no dot
/// segments, no empty segments, no `\`, no trailing `/` (but `/` itself).
/// A lease on another spelling would be a fence no write ever meets.
fn path_key_is_canonical(key: &str) -> bool {
    let resource = key.split_once(':').map_or(key, |(_, r)| r);
    let Some(path) = resource.strip_prefix('/') else {
        return true;
    };
    path.is_empty()
        || (!path.contains('\\')
            && path
                .split('/')
                .all(|seg| !seg.is_empty() && seg != "." && seg != ".."))
}

/// HMAC-SHA256 of `nonce.KEY64` under `bearer`'s token.
fn tag(bearer: &Bearer, nonce: &str, key64: &str) -> ring::hmac::Tag {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bearer.token.as_bytes());
    ring::hmac::sign(&k, format!("{nonce}.{key64}").as_bytes())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The id of a new lease on `key`, taken with `bearer`.
fn new_id(bearer: &Bearer, key: &str) -> String {
    let k = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key);
    let nonce = crate::id::unique_id();
    let t = tag(bearer, &nonce, &k);
    format!("{nonce}{}.{k}", hex(t.as_ref()))
}

/// The parts of a lease id: nonce, tag, and the key (and its base64);
/// `None` for an id this API never made.
fn id_parts(id: &str) -> Option<(&str, Vec<u8>, &str, String)> {
    let (head, k) = id.split_once('.')?;
    if head.len() != NONCE_HEX + 64 || !head.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let (nonce, t) = head.split_at(NONCE_HEX);
    let t = (0..t.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&t[i..i + 2], 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(k)
        .ok()?;
    let key = String::from_utf8(bytes).ok().filter(|k| !k.is_empty())?;
    Some((nonce, t, k, key))
}

/// The lease API's state.
pub struct Leases {
    pub fence: Arc<Fence>,
    /// Maps a `path` to its key as a write to it would be.
    pub routes: Arc<dyn Explain>,
    pub metrics: Arc<Metrics>,
    pub bearers: arc_swap::ArcSwap<Vec<Bearer>>,
    pub max_ttl: Duration,
    pub max_key_bytes: usize,
    /// Woken by every release here, so a waiting acquire on this replica
    /// retries at once.
    pub released: Notify,
}

/// A lease as the API shows it.
fn shown(key: &str, lock: &Lock) -> Value {
    json!({
        "lease": lock.id,
        "key": key,
        "token": lock.token.to_string(),
        "holder": lock.holder,
        "expires_in_ms": ms(lock.expires_in),
    })
}

/// The answer to a grant or a renewal.
fn held(id: &str, key: &str, token: u64, ttl: Duration, holder: &str) -> Value {
    json!({
        "lease": id,
        "key": key,
        "token": token.to_string(),
        "ttl_ms": ms(ttl),
        "holder": holder,
    })
}

/// The acquire body, checked field by field so that a 400 names the field.
struct AcquireBody {
    key: Option<String>,
    path: Option<String>,
    host: Option<String>,
    ttl: Duration,
    holder: String,
    wait: Duration,
}

fn text(obj: &Map<String, Value>, field: &'static str) -> Result<Option<String>, LeaseError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(LeaseError::BadField(field, "must be a string".into())),
    }
}

/// A millisecond count in 1..=max (0 allowed for `wait_ms`).
fn millis(
    obj: &Map<String, Value>,
    field: &'static str,
    max: Duration,
    zero_ok: bool,
) -> Result<Option<Duration>, LeaseError> {
    let Some(v) = obj.get(field).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let low = u64::from(!zero_ok);
    let bound = || {
        LeaseError::BadField(
            field,
            format!(
                "must be a whole number of milliseconds from {low} to {} (max_lease_ttl)",
                ms(max)
            ),
        )
    };
    let n = v.as_u64().ok_or_else(bound)?;
    if n < low || n > ms(max) {
        return Err(bound());
    }
    Ok(Some(Duration::from_millis(n)))
}

impl Leases {
    /// Serves one request of the lease listener.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let started = Instant::now();
        let (op, answer) = self.route(req).await;
        let result = match &answer {
            Ok((_, r)) => *r,
            Err(e) => e.kind(),
        };
        self.metrics.leases.with_label_values(&[op, result]).inc();
        self.metrics
            .lease_latency
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        Ok(match answer {
            Ok((resp, _)) => resp,
            Err(e) => e.into_response(),
        })
    }

    /// The operation's name and its answer (with a result label).
    async fn route(
        &self,
        req: Request<Incoming>,
    ) -> (
        &'static str,
        Result<(Response<ProxyBody>, &'static str), LeaseError>,
    ) {
        let path = req.uri().path().to_string();
        let Some(rest) = path
            .strip_prefix("/v1/leases")
            .filter(|r| r.is_empty() || r.starts_with('/'))
        else {
            return ("other", Err(LeaseError::NotFound));
        };
        let bearer = match self.bearer(&req) {
            Some(b) => b,
            None => return ("other", Err(LeaseError::Unauthorized)),
        };
        let method = req.method().clone();
        let (id, action) = match rest.trim_start_matches('/').split_once('/') {
            Some((id, action)) => (id.to_string(), Some(action.to_string())),
            None => (rest.trim_start_matches('/').to_string(), None),
        };
        match (&method, id.as_str(), action.as_deref()) {
            (&Method::POST, "", None) => ("acquire", self.acquire(&bearer, req).await),
            (&Method::GET, id, None) if !id.is_empty() => ("get", self.get(&bearer, id).await),
            (&Method::DELETE, id, None) if !id.is_empty() => {
                ("release", self.release(&bearer, id).await)
            }
            (&Method::POST, id, Some("renew")) if !id.is_empty() => {
                ("renew", self.renew(&bearer, id, req).await)
            }
            (_, "", None) | (_, _, None) | (_, _, Some("renew")) => {
                ("other", Err(LeaseError::MethodNotAllowed))
            }
            _ => ("other", Err(LeaseError::NotFound)),
        }
    }

    /// The bearer token the request carries, if it is one of ours.
    fn bearer<B>(&self, req: &Request<B>) -> Option<Bearer> {
        let got = crate::bearer::bearer_credential(req)?;
        // Every token is compared in full, whatever matches: no timing leak
        // of how much of a token was right.
        let mut found = None;
        for b in self.bearers.load().iter() {
            if same_secret(got, &b.token) {
                found = Some(b.clone());
            }
        }
        found
    }

    /// The key a lease id names, if the bearer may lease it and took this
    /// lease.
    fn scoped(&self, bearer: &Bearer, id: &str) -> Result<String, LeaseError> {
        let (nonce, t, key64, key) = id_parts(id).ok_or(LeaseError::Gone)?;
        if !bearer.covers(&key) {
            return Err(LeaseError::OutOfScope(key));
        }
        let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bearer.token.as_bytes());
        // Constant time: the tag is the capability.
        ring::hmac::verify(&k, format!("{nonce}.{key64}").as_bytes(), &t)
            .map_err(|_| LeaseError::OtherBearer(key.clone()))?;
        Ok(key)
    }

    async fn body(req: Request<Incoming>) -> Result<Map<String, Value>, LeaseError> {
        let bytes = http_body_util::Limited::new(req.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|_| {
                LeaseError::BadBody(format!("the body must be JSON of at most {MAX_BODY} bytes"))
            })?
            .to_bytes();
        if bytes.is_empty() {
            return Ok(Map::new());
        }
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(m)) => Ok(m),
            Ok(_) => Err(LeaseError::BadBody("the body must be a JSON object".into())),
            Err(e) => Err(LeaseError::BadBody(format!("the body is not JSON: {e}"))),
        }
    }

    fn acquire_body(&self, obj: &Map<String, Value>) -> Result<AcquireBody, LeaseError> {
        const FIELDS: [&str; 6] = ["key", "path", "host", "ttl_ms", "holder", "wait_ms"];
        if let Some(f) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(LeaseError::BadBody(format!(
                "unknown field `{f}` (known: {})",
                FIELDS.join(", ")
            )));
        }
        let holder = text(obj, "holder")?.unwrap_or_default();
        if holder.len() > MAX_HOLDER || holder.chars().any(char::is_control) {
            return Err(LeaseError::BadField(
                "holder",
                format!("must be at most {MAX_HOLDER} bytes of text without control characters"),
            ));
        }
        Ok(AcquireBody {
            key: text(obj, "key")?,
            path: text(obj, "path")?,
            host: text(obj, "host")?,
            ttl: millis(obj, "ttl_ms", self.max_ttl, false)?
                .ok_or(LeaseError::BadField("ttl_ms", "is required".into()))?,
            holder,
            wait: millis(obj, "wait_ms", self.max_ttl, true)?.unwrap_or_default(),
        })
    }

    /// The key an acquire names: `key` as given, or `path` (and `host`)
    /// mapped as a write to it would be.
    fn acquire_key(&self, b: &AcquireBody) -> Result<String, LeaseError> {
        let key = match (&b.key, &b.path) {
            (Some(k), None) => {
                if b.host.is_some() {
                    return Err(LeaseError::BadField(
                        "host",
                        "goes with `path`, not with `key`".into(),
                    ));
                }
                // A route's keys are `namespace:resource`: any other key
                // could never meet a write.
                if !k
                    .split_once(':')
                    .is_some_and(|(ns, r)| !ns.is_empty() && !r.is_empty())
                {
                    return Err(LeaseError::BadField(
                        "key",
                        "must be namespace:resource, as writes take it (GET /v1/fences?path= on the admin listener shows a path's key), or give `path`".into(),
                    ));
                }
                if k.chars().any(char::is_control) {
                    return Err(LeaseError::BadField(
                        "key",
                        "must not hold control characters".into(),
                    ));
                }
                if !path_key_is_canonical(k) {
                    return Err(LeaseError::BadField(
                        "key",
                        "is not in the canonical form writes take (no `.` or `..` segments, `//`, `\\` or trailing `/` in a path): GET /v1/fences?path= on the admin listener shows a path's key".into(),
                    ));
                }
                k.clone()
            }
            (None, Some(p)) => {
                let explained = self
                    .routes
                    .explain(b.host.as_deref(), p, &http::HeaderMap::new())
                    .map_err(|e| LeaseError::BadField("path", e.to_string()))?;
                explained
                    .key
                    .map_err(|e| LeaseError::BadField("path", e.to_string()))?
            }
            (Some(_), Some(_)) => {
                return Err(LeaseError::BadBody("give `key` or `path`, not both".into()))
            }
            (None, None) => {
                return Err(LeaseError::BadField(
                    "key",
                    "is required (or `path`, mapped to its key as a write would be)".into(),
                ))
            }
        };
        if key.len() > self.max_key_bytes {
            return Err(LeaseError::BadField(
                "key",
                format!("is over the limit of {} bytes", self.max_key_bytes),
            ));
        }
        Ok(key)
    }

    async fn acquire(
        &self,
        bearer: &Bearer,
        req: Request<Incoming>,
    ) -> Result<(Response<ProxyBody>, &'static str), LeaseError> {
        let obj = Self::body(req).await?;
        let b = self.acquire_body(&obj)?;
        let key = self.acquire_key(&b)?;
        if !bearer.covers(&key) {
            return Err(LeaseError::OutOfScope(key));
        }
        let id = new_id(bearer, &key);
        let deadline = tokio::time::Instant::now() + b.wait;
        let mut poll = WAIT_POLL;
        loop {
            // Armed before the claim, so a release between the claim and
            // the wait is not missed.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            // A claim that failed may have been applied (a timeout, a lost
            // answer): asked again with the same id, the store answers it
            // granted, so the lease is not left held by nobody.
            let claim = match self.fence.claim(&key, &id, &b.holder, b.ttl).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(%key, error = %e, "lease claim failed; asking once more");
                    tokio::time::sleep(WAIT_POLL).await;
                    self.fence.claim(&key, &id, &b.holder, b.ttl).await?
                }
            };
            match claim {
                Claim::Granted { token, .. } => {
                    tracing::info!(%key, token, holder = %b.holder, ttl_ms = ms(b.ttl), "lease granted");
                    let body = held(&id, &key, token, b.ttl, &b.holder);
                    return Ok((json_response(StatusCode::CREATED, body), "granted"));
                }
                Claim::Exhausted => return Err(LeaseError::Exhausted(key)),
                Claim::Held(lock) => {
                    let now = tokio::time::Instant::now();
                    if now >= deadline {
                        return Err(LeaseError::Held {
                            key,
                            holder: lock.holder,
                            expires_in: lock.expires_in,
                        });
                    }
                    let nap = (lock.expires_in + Duration::from_millis(1))
                        .min(poll)
                        .min(deadline - now);
                    poll = (poll * 2).min(WAIT_POLL_MAX);
                    tokio::select! {
                        _ = tokio::time::sleep(nap) => {}
                        _ = released => {}
                    }
                }
            }
        }
    }

    async fn get(
        &self,
        bearer: &Bearer,
        id: &str,
    ) -> Result<(Response<ProxyBody>, &'static str), LeaseError> {
        let key = self.scoped(bearer, id)?;
        match self.fence.read_lock(&key).await? {
            Some(lock) if lock.id == id => {
                Ok((json_response(StatusCode::OK, shown(&key, &lock)), "ok"))
            }
            _ => Err(LeaseError::Gone),
        }
    }

    async fn renew(
        &self,
        bearer: &Bearer,
        id: &str,
        req: Request<Incoming>,
    ) -> Result<(Response<ProxyBody>, &'static str), LeaseError> {
        let key = self.scoped(bearer, id)?;
        let obj = Self::body(req).await?;
        if let Some(f) = obj.keys().find(|k| k.as_str() != "ttl_ms") {
            return Err(LeaseError::BadBody(format!(
                "unknown field `{f}` (known: ttl_ms)"
            )));
        }
        let ttl = millis(&obj, "ttl_ms", self.max_ttl, false)?
            .ok_or(LeaseError::BadField("ttl_ms", "is required".into()))?;
        match self.fence.renew_lock(&key, id, ttl).await? {
            Some(lock) => {
                let body = held(id, &key, lock.token, ttl, &lock.holder);
                Ok((json_response(StatusCode::OK, body), "ok"))
            }
            None => Err(LeaseError::Gone),
        }
    }

    async fn release(
        &self,
        bearer: &Bearer,
        id: &str,
    ) -> Result<(Response<ProxyBody>, &'static str), LeaseError> {
        let key = self.scoped(bearer, id)?;
        let released = self.fence.release_lock(&key, id).await?;
        if released {
            tracing::info!(%key, "lease released");
            self.released.notify_waiters();
        }
        let mut r = Response::new(full(""));
        *r.status_mut() = StatusCode::NO_CONTENT;
        Ok((r, if released { "ok" } else { "gone" }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_fields_are_typed_and_bounded() {
        let obj = |v: Value| v.as_object().unwrap().clone();
        let o = obj(serde_json::json!({
            "s": "x", "n": null, "num": 5, "ttl": 1000, "zero": 0, "big": 1001, "neg": -1, "f": 1.5
        }));
        assert_eq!(text(&o, "s").unwrap(), Some("x".into()));
        assert_eq!(text(&o, "n").unwrap(), None);
        assert_eq!(text(&o, "absent").unwrap(), None);
        assert!(text(&o, "num").is_err());
        let max = Duration::from_millis(1000);
        assert_eq!(millis(&o, "ttl", max, false).unwrap(), Some(max));
        assert_eq!(millis(&o, "n", max, false).unwrap(), None);
        assert_eq!(millis(&o, "absent", max, false).unwrap(), None);
        assert_eq!(
            millis(&o, "num", max, false).unwrap(),
            Some(Duration::from_millis(5))
        );
        // 0 only where allowed; above the maximum never; not a whole count.
        assert!(millis(&o, "zero", max, false).is_err());
        assert_eq!(millis(&o, "zero", max, true).unwrap(), Some(Duration::ZERO));
        for bad in ["big", "neg", "f", "s"] {
            assert!(millis(&o, bad, max, true).is_err(), "{bad}");
        }
        let e = millis(&o, "ttl", Duration::from_millis(999), true).unwrap_err();
        assert!(e.to_string().contains("from 0 to 999"), "{e}");
        let e = millis(&o, "zero", max, false).unwrap_err();
        assert!(e.to_string().contains("from 1 to 1000"), "{e}");
    }

    #[test]
    fn lease_keys_in_path_form_must_be_canonical() {
        for ok in [
            "default:/r/x",
            "default:/",
            "s3:/b/a b",
            "jobs:nightly",
            "h:a/../b",
        ] {
            assert!(path_key_is_canonical(ok), "{ok}");
        }
        for bad in [
            "default:/r/../g/x",
            "default:/r/./x",
            "default:/r//x",
            "default:/r/x/",
            "default:/r\\x",
            "default:/..",
        ] {
            assert!(!path_key_is_canonical(bad), "{bad}");
        }
    }

    #[test]
    fn lease_ids_name_their_key_and_their_bearer() {
        let b = crate::bearer::parse_bearers("abcdefghijklmnop\nqrstuvwxyz012345").unwrap();
        for key in ["ns:a", "ns:with.dots/and spaces", "ü:ñ"] {
            let id = new_id(&b[0], key);
            let (nonce, t, k64, k) = id_parts(&id).unwrap();
            assert_eq!(k, key);
            assert_eq!(t, tag(&b[0], nonce, k64).as_ref());
            assert_ne!(t, tag(&b[1], nonce, k64).as_ref());
        }
        let good = new_id(&b[0], "ns:a");
        for bad in [
            "nodot",
            "zz.bnM6YQ",
            &good[1..],
            &good.replace(".", ".!"),
            "ab.",
        ] {
            assert!(id_parts(bad).is_none(), "{bad}");
        }
    }
}

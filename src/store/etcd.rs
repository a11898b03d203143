//! The etcd store, over etcd's v3 JSON gateway (plain HTTP/1.1 with the
//! proxy's own client: no gRPC stack or protoc in the build).
//!
//! Keyspace (`HEX` is the fence key in hex, so keys never nest):
//! - `fencegate/f/HEX`: the highest token, zero-padded to 20 digits so that
//!   etcd's byte-wise compare is numeric order over the whole u64 range.
//! - `fencegate/l/HEX/TOKEN20/ID`: an in-flight lease, attached to an etcd
//!   lease of this replica (expires on etcd's clock if the replica dies).
//! - `fencegate/marker`: `EPOCH SEQ` (amnesia detection).
//!
//! Admission is one transaction: if the stored highest is greater, read it
//! (stale); otherwise write the token, register the lease and count older
//! leases, atomically. A raise is durable once etcd acknowledged it: etcd
//! commits through its Raft quorum and fsyncs its WAL.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use super::shared::{busy, stored_token, Backend, Marker};
use super::{Advance, LeaseOutcome, StoreError, WriteLease};

const MARKER: &str = "fencegate/marker";

/// Per-replica etcd lease that in-flight lease keys are attached to,
/// rotated so every key outlives the longest write it can belong to.
struct ReplicaLease {
    id: String,
    granted: Instant,
    ttl: Duration,
}

pub struct EtcdBackend {
    endpoints: Vec<String>,
    current: AtomicUsize,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    session: AtomicU64,
    failing: AtomicBool,
    lease: tokio::sync::Mutex<Option<ReplicaLease>>,
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("etcd: {e}"))
}

fn b64(s: &str) -> String {
    B64.encode(s.as_bytes())
}

fn unb64(v: &Value) -> String {
    v.as_str()
        .and_then(|s| B64.decode(s).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_default()
}

fn hex(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

fn pad(token: u64) -> String {
    format!("{token:020}")
}

fn fence_key(key: &str) -> String {
    format!("fencegate/f/{}", hex(key))
}

fn lease_prefix(key: &str) -> String {
    format!("fencegate/l/{}/", hex(key))
}

fn parse_token(v: &str) -> Result<u64, StoreError> {
    stored_token("etcd", v)
}

/// etcd's JSON omits zero values: a missing count is 0.
fn count(v: &Value) -> u64 {
    v["count"]
        .as_str()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

impl EtcdBackend {
    pub fn new(endpoints: Vec<String>, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        Self {
            endpoints,
            current: AtomicUsize::new(0),
            client: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
            session: AtomicU64::new(0),
            failing: AtomicBool::new(true),
            lease: tokio::sync::Mutex::new(None),
        }
    }

    /// POSTs to the current endpoint, moving to the next one on a
    /// connection failure.
    async fn post(&self, path: &str, body: Value) -> Result<Value, StoreError> {
        let body = Bytes::from(body.to_string());
        let mut last = None;
        for _ in 0..self.endpoints.len() {
            let i = self.current.load(Ordering::Relaxed) % self.endpoints.len();
            let url = format!("{}{path}", self.endpoints[i]);
            let req = http::Request::post(&url)
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))
                .map_err(unavailable)?;
            let result = tokio::time::timeout(self.timeout, async {
                let resp = self.client.request(req).await.map_err(unavailable)?;
                let status = resp.status();
                let bytes = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(unavailable)?
                    .to_bytes();
                let v: Value = serde_json::from_slice(&bytes).map_err(unavailable)?;
                if !status.is_success() {
                    return Err(unavailable(format!(
                        "{status}: {}",
                        v["message"].as_str().unwrap_or("")
                    )));
                }
                Ok(v)
            })
            .await
            .unwrap_or_else(|_| Err(unavailable("timed out")));
            match result {
                Ok(v) => {
                    if self.failing.swap(false, Ordering::AcqRel) {
                        // Back after a failure (or the first contact): the
                        // marker must be checked again.
                        self.session.fetch_add(1, Ordering::AcqRel);
                    }
                    return Ok(v);
                }
                Err(e) => {
                    self.failing.store(true, Ordering::Release);
                    self.current.store(i + 1, Ordering::Relaxed);
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| unavailable("no endpoint")))
    }

    /// The replica lease to attach a new in-flight key to. It is granted for
    /// twice `ttl` and used for new keys only during the first third of its
    /// life, so every key lives at least 4/3 of `ttl`: the write plus the
    /// store's own latency.
    async fn replica_lease(&self, ttl: Duration) -> Result<String, StoreError> {
        let mut slot = self.lease.lock().await;
        if let Some(l) = slot.as_ref() {
            if l.ttl >= ttl * 2 && l.granted.elapsed() < l.ttl / 3 {
                return Ok(l.id.clone());
            }
        }
        let secs = (ttl * 2).as_secs_f64().ceil().max(2.0) as u64;
        let grant_ttl = Duration::from_secs(secs);
        // Stamped before sending: the lease's clock may start any time after.
        let sent = Instant::now();
        let v = self
            .post("/v3/lease/grant", json!({"TTL": secs.to_string()}))
            .await?;
        let id = v["ID"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| unavailable("lease grant without an ID"))?;
        *slot = Some(ReplicaLease {
            id: id.clone(),
            granted: sent,
            ttl: grant_ttl,
        });
        Ok(id)
    }

    fn lease_key(key: &str, lease: &WriteLease) -> String {
        format!("{}{}/{}", lease_prefix(key), pad(lease.token), lease.id)
    }

    /// A txn: if the stored highest is above `token`, report it (stale);
    /// otherwise run `ops` (which end with a count of older leases).
    async fn guarded_txn(
        &self,
        key: &str,
        token: u64,
        stale_ops: Vec<Value>,
        ops: Vec<Value>,
    ) -> Result<LeaseStep, StoreError> {
        let fk = fence_key(key);
        let mut success = stale_ops;
        success.push(json!({"request_range": {"key": b64(&fk)}}));
        let (success_n, ops_n) = (success.len(), ops.len());
        let v = self
            .post(
                "/v3/kv/txn",
                json!({
                    "compare": [{"key": b64(&fk), "target": "VALUE", "result": "GREATER", "value": b64(&pad(token))}],
                    "success": success,
                    "failure": ops,
                }),
            )
            .await?;
        if v["header"]["revision"].as_str().is_none() {
            return Err(unavailable("transaction answer without a header"));
        }
        let responses = v["responses"].as_array().cloned().unwrap_or_default();
        let succeeded = v["succeeded"].as_bool().unwrap_or(false);
        let expected = if succeeded { success_n } else { ops_n };
        if responses.len() != expected {
            return Err(unavailable(format!(
                "transaction answered {} results for {expected} operations",
                responses.len()
            )));
        }
        if succeeded {
            let range = responses
                .last()
                .map(|r| r["response_range"].clone())
                .unwrap_or_default();
            return Ok(LeaseStep::Stale(decode_padded(&unb64(
                &range["kvs"][0]["value"],
            ))?));
        }
        Ok(LeaseStep::Ran(responses))
    }
}

enum LeaseStep {
    Stale(u64),
    Ran(Vec<Value>),
}

fn decode_padded(v: &str) -> Result<u64, StoreError> {
    let t = v.trim_start_matches('0');
    if t.is_empty() {
        Ok(0)
    } else {
        parse_token(t)
    }
}

/// Busy if the transaction's last result (the count of older leases) is
/// not zero, else granted.
fn older_leases(results: &[Value], lease: WriteLease) -> LeaseOutcome {
    if results
        .last()
        .map(|x| count(&x["response_range"]))
        .unwrap_or(0)
        > 0
    {
        busy(lease)
    } else {
        LeaseOutcome::Granted(lease)
    }
}

fn older_count(key: &str, token: u64) -> Value {
    json!({"request_range": {
        "key": b64(&lease_prefix(key)),
        "range_end": b64(&format!("{}{}", lease_prefix(key), pad(token))),
        "count_only": true
    }})
}

#[async_trait]
impl Backend for EtcdBackend {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire)
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let v = self
            .post("/v3/kv/range", json!({"key": b64(&fence_key(key))}))
            .await?;
        match v["kvs"].as_array().and_then(|a| a.first()) {
            None => Ok(None),
            Some(kv) => decode_padded(&unb64(&kv["value"])).map(Some),
        }
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let fk = fence_key(key);
        // The failure branch only runs when highest <= token (or none).
        let step = self
            .guarded_txn(
                key,
                token,
                vec![],
                vec![
                    json!({"request_range": {"key": b64(&fk)}}),
                    json!({"request_put": {"key": b64(&fk), "value": b64(&pad(token)), "prev_kv": true}}),
                ],
            )
            .await?;
        match step {
            LeaseStep::Stale(h) => Ok(Advance::Stale { highest: h }),
            LeaseStep::Ran(r) => {
                let prev = r
                    .first()
                    .and_then(|x| x["response_range"]["kvs"].as_array())
                    .and_then(|a| a.first())
                    .map(|kv| decode_padded(&unb64(&kv["value"])))
                    .transpose()?;
                Ok(match prev {
                    Some(p) if p == token => Advance::Equal,
                    previous => Advance::Raised { previous },
                })
            }
        }
    }

    async fn acquire(
        &self,
        key: &str,
        token: u64,
        lease_id: &str,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let etcd_lease = self.replica_lease(ttl).await?;
        let lease = WriteLease {
            id: lease_id.to_string(),
            token,
        };
        let fk = fence_key(key);
        let step = self
            .guarded_txn(
                key,
                token,
                vec![],
                vec![
                    json!({"request_put": {"key": b64(&fk), "value": b64(&pad(token))}}),
                    json!({"request_put": {"key": b64(&Self::lease_key(key, &lease)), "value": b64(""), "lease": etcd_lease}}),
                    older_count(key, token),
                ],
            )
            .await?;
        match step {
            LeaseStep::Stale(h) => Ok(LeaseOutcome::Stale { highest: h }),
            LeaseStep::Ran(r) => Ok(older_leases(&r, lease)),
        }
    }

    async fn poll(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let lk = Self::lease_key(key, lease);
        let etcd_lease = self.replica_lease(ttl).await?;
        let step = self
            .guarded_txn(
                key,
                lease.token,
                vec![json!({"request_delete_range": {"key": b64(&lk)}})],
                vec![
                    // Re-attach (a no-op if present) so a long wait cannot
                    // outlive its own key.
                    json!({"request_put": {"key": b64(&lk), "value": b64(""), "lease": etcd_lease}}),
                    older_count(key, lease.token),
                ],
            )
            .await?;
        match step {
            LeaseStep::Stale(h) => Ok(LeaseOutcome::Stale { highest: h }),
            LeaseStep::Ran(r) => Ok(older_leases(&r, lease.clone())),
        }
    }

    async fn release(&self, key: &str, lease: &WriteLease) -> Result<(), StoreError> {
        self.post(
            "/v3/kv/deleterange",
            json!({"key": b64(&Self::lease_key(key, lease))}),
        )
        .await?;
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.post(
            "/v3/kv/range",
            json!({"key": b64(MARKER), "count_only": true}),
        )
        .await?;
        Ok(())
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        Ok(self.read_marker_rev().await?.map(|(m, _)| m))
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        self.post(
            "/v3/kv/txn",
            json!({
                "compare": [{"key": b64(MARKER), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": {"key": b64(MARKER), "value": b64(&format!("{epoch} 1"))}}],
            }),
        )
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after creation"))
    }

    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError> {
        for _ in 0..20 {
            let Some((m, rev)) = self.read_marker_rev().await? else {
                return Ok(None);
            };
            let next = Marker {
                epoch: m.epoch.clone(),
                seq: m.seq + 1,
            };
            let v = self
                .post(
                    "/v3/kv/txn",
                    json!({
                        "compare": [{"key": b64(MARKER), "target": "MOD", "result": "EQUAL", "mod_revision": rev}],
                        "success": [{"request_put": {"key": b64(MARKER), "value": b64(&format!("{} {}", next.epoch, next.seq))}}],
                    }),
                )
                .await?;
            if v["succeeded"].as_bool().unwrap_or(false) {
                return Ok(Some(next));
            }
        }
        Err(unavailable("marker update kept conflicting"))
    }

    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError> {
        let compare = match expected {
            None => {
                json!({"key": b64(MARKER), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
            }
            Some(m) => {
                json!({"key": b64(MARKER), "target": "VALUE", "result": "EQUAL", "value": b64(&format!("{} {}", m.epoch, m.seq))})
            }
        };
        self.post(
            "/v3/kv/txn",
            json!({
                "compare": [compare],
                "success": [{"request_put": {"key": b64(MARKER), "value": b64(&format!("{epoch} 1"))}}],
            }),
        )
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}

impl EtcdBackend {
    async fn read_marker_rev(&self) -> Result<Option<(Marker, String)>, StoreError> {
        let v = self
            .post("/v3/kv/range", json!({"key": b64(MARKER)}))
            .await?;
        let Some(kv) = v["kvs"].as_array().and_then(|a| a.first()) else {
            return Ok(None);
        };
        let text = unb64(&kv["value"]);
        let (epoch, seq) = text
            .split_once(' ')
            .ok_or_else(|| unavailable("malformed marker"))?;
        Ok(Some((
            Marker {
                epoch: epoch.to_string(),
                seq: seq.parse().unwrap_or(0),
            },
            kv["mod_revision"].as_str().unwrap_or("0").to_string(),
        )))
    }
}

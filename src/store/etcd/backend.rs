//! What the shared-store admission asks of etcd ([`Backend`]): highest,
//! advance, write leases, locks and the marker, each as one transaction.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use prost::Message;
use serde_json::{json, Value};

use crate::clock::wall_ms;
use crate::store::api::{Advance, Claim, LeaseOutcome, Lock, StoreError, WriteLease};
use crate::store::shared::{Acquire, Backend, LockCall, LockReply, Marker};

use super::conn::*;
use super::keys::*;
use super::rpc::{self, RequestOp, ResponseOp, TxnRequest};

#[async_trait]
impl Backend for EtcdBackend {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn timeout(&self) -> std::time::Duration {
        self.timeout
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire) + self.dials.load(Ordering::Acquire)
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        match self.get(&fence_key(key)).await? {
            None => Ok(None),
            Some(kv) => decode_padded(&text(&kv.value)).map(Some),
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
                vec![rpc::range(&fk), rpc::put(&fk, &pad(token), 0)],
            )
            .await?;
        match step {
            LeaseStep::Stale(h) => Ok(Advance::Stale { highest: h }),
            LeaseStep::Ran(r) => {
                let prev = r
                    .first()
                    .and_then(range_kv)
                    .map(|(v, _)| decode_padded(&v))
                    .transpose()?;
                Ok(match prev {
                    Some(p) if p == token => Advance::Equal,
                    previous => Advance::Raised { previous },
                })
            }
        }
    }

    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError> {
        // One transaction of nested ones (etcd 3.3+), each guarded by its
        // key's fence as a lone acquire is: one Raft round for the batch.
        // Writes of one TTL share a transaction (under MAX_TXN_BYTES), and
        // its replica lease is chosen right before it is sent, as for a
        // lone acquire: the lease must outlive the writes from the moment
        // their grant is sent, whatever the transactions before took.
        let mut answers: Vec<Option<Result<LeaseOutcome, StoreError>>> = vec![None; reqs.len()];
        let mut ttls: Vec<Duration> = reqs.iter().map(|r| r.ttl).collect();
        ttls.sort();
        ttls.dedup();
        for ttl in ttls {
            let same: Vec<usize> = (0..reqs.len()).filter(|&i| reqs[i].ttl == ttl).collect();
            for chunk in by_size(same, |&i| txn_size(&reqs[i].key)) {
                let etcd_lease = self.replica_lease(ttl).await?;
                let mut txns: Vec<GuardedTxn> = chunk
                    .iter()
                    .map(|&i| Self::acquire_txn(&reqs[i].key, &reqs[i].lease, etcd_lease))
                    .collect();
                let success = txns
                    .iter_mut()
                    .map(|t| rpc::nested(std::mem::take(&mut t.body)))
                    .collect();
                let v = self
                    .txn(&TxnRequest {
                        success,
                        ..Default::default()
                    })
                    .await?;
                if v.responses.len() != chunk.len() {
                    return Err(unavailable(format!(
                        "a batch of {} answered {} results",
                        chunk.len(),
                        v.responses.len()
                    )));
                }
                for ((&i, t), resp) in chunk.iter().zip(&txns).zip(v.responses) {
                    let nested = match resp.response {
                        Some(rpc::response_op::Response::Txn(n)) => Ok(n),
                        _ => Err(unavailable("a batch item answered without its transaction")),
                    };
                    answers[i] = Some(
                        nested
                            .and_then(|n| t.answer(n))
                            .map(|step| step.admission(reqs[i].lease.clone())),
                    );
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.ok_or_else(|| unavailable("a batch item went unanswered")))
            .collect()
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
                vec![rpc::delete(&lk)],
                vec![
                    // Re-attach (a no-op if present) so a long wait cannot
                    // outlive its own key.
                    rpc::put(&lk, "", etcd_lease),
                    older_count(key, lease.token),
                ],
            )
            .await?;
        Ok(step.admission(lease.clone()))
    }

    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let lk = Self::lease_key(key, lease);
        let etcd_lease = self.replica_lease(ttl).await?;
        // No stale operations: a taken key leaves the lease as it is.
        let step = self
            .guarded_txn(
                key,
                lease.token,
                vec![],
                vec![rpc::put(&lk, "", etcd_lease)],
            )
            .await?;
        match step {
            LeaseStep::Stale(h) => Ok(LeaseOutcome::Stale { highest: h }),
            LeaseStep::Ran(_) => Ok(LeaseOutcome::Granted(lease.clone())),
        }
    }

    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError> {
        let ops: Vec<RequestOp> = leases
            .iter()
            .map(|(key, lease)| rpc::delete(&Self::lease_key(key, lease)))
            .collect();
        for success in by_size(ops, RequestOp::encoded_len) {
            self.txn(&TxnRequest {
                success,
                ..Default::default()
            })
            .await?;
        }
        Ok(())
    }

    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        let (fk, gk) = (fence_key(key), grant_key(key));
        let (_, _, _, ttl_ms) = call.args();
        for attempt in 0..LOCK_ATTEMPTS {
            if attempt > 0 {
                // Another replica changed the key: step aside a little
                // (spread by the clock's low bits), then read it again.
                let spread = u64::from(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos())
                        % 4,
                );
                tokio::time::sleep(Duration::from_millis(1 + spread + attempt as u64)).await;
            }
            // The fence and the lease at one revision.
            let v = self
                .txn(&TxnRequest {
                    success: vec![rpc::range(&fk), rpc::range(&gk)],
                    ..Default::default()
                })
                .await?;
            let (fence, grant) = match v.responses.as_slice() {
                [f, g] => (range_kv(f), range_kv(g)),
                _ => return Err(unavailable("lease read without its two answers")),
            };
            // The fence is compared by value: admissions of an equal token
            // rewrite it (a new revision) without changing it.
            let fence_same = match &fence {
                Some((v, _)) => rpc::value_equal(&fk, v),
                None => rpc::absent(&fk),
            };
            let gmr = grant.as_ref().map_or(0, |(_, r)| *r);
            let highest = fence.map(|(v, _)| decode_padded(&v)).transpose()?;
            let now = wall_ms();
            let lock = match grant {
                None => None,
                Some((text, _)) => {
                    let g: Value = serde_json::from_str(&text)
                        .map_err(|_| unavailable(format!("unexpected lease record {text:?}")))?;
                    let exp = g["exp"].as_u64().unwrap_or(0);
                    (exp > now)
                        .then(|| -> Result<Lock, StoreError> {
                            Ok(Lock {
                                id: g["id"].as_str().unwrap_or("").to_string(),
                                token: parse_token(g["token"].as_str().unwrap_or(""))?,
                                holder: g["holder"].as_str().unwrap_or("").to_string(),
                                expires_in: crate::clock::lease_left(exp, now),
                            })
                        })
                        .transpose()?
                }
            };
            let record = |id: &str, token: u64, holder: &str| {
                json!({
                    "id": id,
                    "token": token.to_string(),
                    "holder": holder,
                    "exp": crate::clock::lease_end(now, Duration::from_millis(ttl_ms)),
                })
                .to_string()
            };
            let (body, answer) = match call {
                LockCall::Read => return Ok(LockReply::Lock(lock)),
                LockCall::Claim { id, holder, .. } => {
                    if let Some(l) = lock {
                        // Sent again after a lost answer: already ours.
                        if l.id == id {
                            return Ok(LockReply::Claim(Claim::Granted {
                                token: l.token,
                                registered: true,
                            }));
                        }
                        return Ok(LockReply::Claim(Claim::Held(l)));
                    }
                    let Some(t) = highest.map_or(Some(1), |h| h.checked_add(1)) else {
                        return Ok(LockReply::Claim(Claim::Exhausted));
                    };
                    (
                        TxnRequest {
                            compare: vec![fence_same, rpc::unchanged(&gk, gmr)],
                            success: vec![
                                rpc::put(&fk, &pad(t), 0),
                                rpc::put(&gk, &record(id, t, holder), 0),
                                // Write registrations held as it commits
                                // (all older than t; they expire on etcd's
                                // clock).
                                older_count(key, t),
                            ],
                            ..Default::default()
                        },
                        LockReply::Claim(Claim::Granted {
                            token: t,
                            registered: true,
                        }),
                    )
                }
                LockCall::Renew { id, ttl } => {
                    let Some(mut l) = lock.filter(|l| l.id == id) else {
                        return Ok(LockReply::Lock(None));
                    };
                    let value = record(id, l.token, &l.holder);
                    l.expires_in = ttl;
                    (
                        TxnRequest {
                            compare: vec![rpc::unchanged(&gk, gmr)],
                            success: vec![rpc::put(&gk, &value, 0)],
                            ..Default::default()
                        },
                        LockReply::Lock(Some(l)),
                    )
                }
                LockCall::Release { id } => {
                    if lock.is_none_or(|l| l.id != id) {
                        return Ok(LockReply::Released(false));
                    }
                    (
                        TxnRequest {
                            compare: vec![rpc::unchanged(&gk, gmr)],
                            success: vec![rpc::delete(&gk)],
                            ..Default::default()
                        },
                        LockReply::Released(true),
                    )
                }
            };
            let v = self.txn(&body).await?;
            if v.succeeded {
                if let LockReply::Claim(Claim::Granted { token, .. }) = answer {
                    let held = v
                        .responses
                        .get(2)
                        .and_then(ResponseOp::range)
                        .map(|r| r.count);
                    return Ok(LockReply::Claim(Claim::Granted {
                        token,
                        registered: held != Some(0),
                    }));
                }
                return Ok(answer);
            }
        }
        Err(unavailable(
            "a lease operation lost its compare-and-swap too many times in a row",
        ))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let _: rpc::RangeResponse = self
            .call(
                RANGE,
                &rpc::RangeRequest {
                    key: MARKER.into(),
                    count_only: true,
                    ..Default::default()
                },
            )
            .await?;
        Ok(())
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        Ok(self.read_marker_rev().await?.map(|(m, _)| m))
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        self.txn(&TxnRequest {
            compare: vec![rpc::absent(MARKER)],
            success: vec![rpc::put(MARKER, &format!("{epoch} 1"), 0)],
            ..Default::default()
        })
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
                .txn(&TxnRequest {
                    compare: vec![rpc::unchanged(MARKER, rev)],
                    success: vec![rpc::put(MARKER, &format!("{} {}", next.epoch, next.seq), 0)],
                    ..Default::default()
                })
                .await?;
            if v.succeeded {
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
            None => rpc::absent(MARKER),
            Some(m) => rpc::value_equal(MARKER, &format!("{} {}", m.epoch, m.seq)),
        };
        self.txn(&TxnRequest {
            compare: vec![compare],
            success: vec![rpc::put(MARKER, &format!("{epoch} 1"), 0)],
            ..Default::default()
        })
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}

impl EtcdBackend {
    /// One key's value and revision, if it exists.
    pub(super) async fn get(&self, key: &str) -> Result<Option<rpc::KeyValue>, StoreError> {
        let answer: rpc::RangeResponse = self
            .call(
                RANGE,
                &rpc::RangeRequest {
                    key: key.into(),
                    ..Default::default()
                },
            )
            .await?;
        Ok(answer.kvs.into_iter().next())
    }

    pub(super) async fn read_marker_rev(&self) -> Result<Option<(Marker, i64)>, StoreError> {
        let Some(kv) = self.get(MARKER).await? else {
            return Ok(None);
        };
        let text = text(&kv.value);
        let (epoch, seq) = text
            .split_once(' ')
            .ok_or_else(|| unavailable("malformed marker"))?;
        Ok(Some((
            Marker {
                epoch: epoch.to_string(),
                seq: seq.parse().unwrap_or(0),
            },
            kv.mod_revision,
        )))
    }
}

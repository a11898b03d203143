//! What the shared-store admission asks of Redis ([`Backend`]): each
//! operation one script call, and how its answer is read.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::store::api::{Advance, LeaseOutcome, StoreError, WriteLease};
use crate::store::shared::{
    advance_answer, lock_reply, stored_token, Acquire, Backend, LockCall, LockReply, Marker,
};

use super::conn::*;
use super::scripts::*;

#[async_trait]
impl Backend for RedisBackend {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn timeout(&self) -> std::time::Duration {
        self.timeout
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire)
    }

    fn replicas(&self) -> Option<crate::store::api::Replicas> {
        let w = self.last_wait.load(Ordering::Relaxed);
        Some(crate::store::api::Replicas {
            last: (w != u64::MAX).then_some(crate::store::api::LastWait {
                wanted: (w >> 32) as u32,
                confirmed: w as u32,
            }),
            failed_waits: self.failed_waits.load(Ordering::Relaxed),
        })
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(fence_key(key));
        let v: Option<String> = self.query(cmd).await?;
        v.map(|v| parse_token(&v)).transpose()
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let (status, value): (String, String) = self
            .script(&self.advance, &[fence_key(key)], &[token.to_string()])
            .await?;
        advance_answer("redis", &status, Some(&value))
    }

    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError> {
        let mut keys = Vec::with_capacity(reqs.len() * 3);
        let mut args = Vec::with_capacity(reqs.len() * 3);
        for r in reqs {
            keys.extend([
                fence_key(&r.key),
                lease_key(&r.key),
                lease_order_key(&r.key),
            ]);
            args.extend([
                r.lease.token.to_string(),
                r.lease.id.clone(),
                ttl_ms(r.ttl).to_string(),
            ]);
        }
        let reply: Vec<String> = self.script(&self.acquire, &keys, &args).await?;
        if reply.len() != reqs.len() * 2 {
            return Err(unavailable(format!(
                "{} answers for a batch of {}",
                reply.len() / 2,
                reqs.len()
            )));
        }
        Ok(reqs
            .iter()
            .zip(reply.chunks(2))
            .map(|(r, a)| lease_outcome((a[0].clone(), a[1].clone()), r.lease.clone()))
            .collect())
    }

    async fn poll(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_script(&self.poll, key, lease, ttl).await
    }

    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_script(&self.renew, key, lease, ttl).await
    }

    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError> {
        let mut keys = Vec::with_capacity(leases.len() * 2);
        let mut args = Vec::with_capacity(leases.len() * 2);
        for (key, lease) in leases {
            keys.extend([lease_key(key), lease_order_key(key)]);
            args.extend([lease.token.to_string(), lease.id.clone()]);
        }
        let _: i64 = self.script(&self.release, &keys, &args).await?;
        Ok(())
    }

    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        let (op, id, holder, ttl) = call.args();
        let reply: Vec<String> = self
            .script(
                &self.lock,
                &[
                    fence_key(key),
                    grant_key(key),
                    lease_key(key),
                    lease_order_key(key),
                ],
                &[op.into(), id.into(), holder.into(), ttl.to_string()],
            )
            .await?;
        lock_reply("redis", &call, &reply)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        // Not waited for: it changes and reads nothing.
        let _: String = self
            .run(|mut c| async move { redis::cmd("PING").query_async(&mut c).await })
            .await?;
        Ok(())
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        if self.replicas_to_wait.is_none() {
            // The heartbeat reads the marker every second: a replica that
            // came online is waited for from then on. The count only goes
            // down at a connect (a wait that failed drops the connections):
            // a primary that lost its replica because it was cut off and
            // replaced (a failover while it was stopped or partitioned) must
            // not start taking writes unwaited on this connection, writes
            // that the promoted replica will never have.
            let info: Result<String, _> = self
                .run(|mut c| async move {
                    redis::cmd("INFO")
                        .arg("replication")
                        .query_async(&mut c)
                        .await
                })
                .await;
            if let Ok(info) = info {
                let (role, online) = replication(&info);
                if role != "master" {
                    // Demoted without its clients being cut (a REPLICAOF by
                    // hand or by a tool other than Sentinel): its answers
                    // are a copy that may lag.
                    self.drop_connections().await;
                    *self.last_failure.lock().expect("lock") = Some(Instant::now());
                    return Err(unavailable(format!(
                        "the server became a {role}: reconnecting to the primary"
                    )));
                }
                self.saw_replicas(online);
            }
        }
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(MARKER).arg("epoch").arg("seq");
        marker(self.query(cmd).await?)
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        let v = self
            .script(&self.create_marker, &[MARKER.into()], &[epoch.into()])
            .await?;
        marker(v)?.ok_or_else(|| unavailable("marker not readable after creation"))
    }

    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError> {
        // Only bump an existing marker: never recreate one by accident.
        marker(
            self.script(&self.bump_marker, &[MARKER.into()], &[])
                .await?,
        )
    }

    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError> {
        let (e, q) = match expected {
            Some(m) => (m.epoch.clone(), m.seq.to_string()),
            None => (String::new(), String::new()),
        };
        let v = self
            .script(
                &self.replace_marker,
                &[MARKER.into()],
                &[e, q, epoch.into()],
            )
            .await?;
        marker(v)?.ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}

/// The marker from `HMGET epoch seq` (a script's nil: none).
pub(super) fn marker(v: Option<Vec<Option<String>>>) -> Result<Option<Marker>, StoreError> {
    let v = v.unwrap_or_default();
    Ok(
        match (v.first().cloned().flatten(), v.get(1).cloned().flatten()) {
            (Some(epoch), Some(seq)) => Some(Marker {
                epoch,
                seq: seq
                    .parse()
                    .map_err(|_| unavailable(format!("marker sequence `{seq}` is not a number")))?,
            }),
            _ => None,
        },
    )
}

pub(super) fn parse_token(v: &str) -> Result<u64, StoreError> {
    stored_token("redis", v)
}

//! What the shared-store admission asks of Redis ([`Backend`]): each
//! operation one script call, and how its answer is read; the same over a
//! lone primary (`conn.rs`) and over one group of a cluster (`cluster.rs`),
//! through [`Calls`], which both implement.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use redis::{Cmd, FromRedisValue, Script};

use crate::store::api::{Advance, LeaseOutcome, Replicas, StoreError, WriteLease};
use crate::store::shared::{
    advance_answer, lock_reply, stored_token, Acquire, Backend, LockCall, LockReply, Marker,
};

use super::scripts::*;

/// A connection the operations run on: a lone primary's, or a cluster
/// group's. Each call is atomic on the server and counts once the replicas
/// wanted have it (`WAIT`, in the same round trip).
#[async_trait]
pub trait Calls: Send + Sync + 'static {
    fn kind(&self) -> &'static str;
    fn timeout(&self) -> Duration;
    /// See [`Backend::session`].
    fn session(&self) -> u64;
    fn replicas(&self) -> Option<Replicas>;
    /// See [`Backend::serving`].
    async fn serving(&self) -> Option<String> {
        None
    }
    /// Where this connection's keys are.
    fn keys(&self) -> &Keyspace;
    fn scripts(&self) -> &Scripts;
    /// Runs `cmd`, then waits for the replicas (see the module doc).
    async fn query<T: FromRedisValue + Send>(&self, cmd: Cmd) -> Result<T, StoreError>;
    /// Whether the server answers at all (not waited for: it changes and
    /// reads nothing).
    async fn ping(&self) -> Result<(), StoreError>;
    /// Checks made before each marker read (every second, by the
    /// heartbeat): the server still a primary, its replicas online.
    async fn before_marker_read(&self) -> Result<(), StoreError>;

    /// Runs one script (EVALSHA) with these keys and arguments.
    async fn script<T: FromRedisValue + Send>(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
    ) -> Result<T, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        self.query(cmd).await
    }

    /// Runs the poll or renew script: both take the fence, lease and
    /// lease-order keys and (token, lease id, TTL in ms).
    async fn lease_script(
        &self,
        script: &Script,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let k = self.keys();
        let reply = self
            .script(
                script,
                &[k.fence(key), k.lease(key), k.lease_order(key)],
                &[
                    lease.token.to_string(),
                    lease.id.clone(),
                    ttl_ms(ttl).to_string(),
                ],
            )
            .await?;
        lease_outcome(reply, lease.clone())
    }
}

#[async_trait]
impl<C: Calls> Backend for C {
    fn kind(&self) -> &'static str {
        Calls::kind(self)
    }

    fn timeout(&self) -> std::time::Duration {
        Calls::timeout(self)
    }

    fn session(&self) -> u64 {
        Calls::session(self)
    }

    fn replicas(&self) -> Option<Replicas> {
        Calls::replicas(self)
    }

    async fn serving(&self) -> Option<String> {
        Calls::serving(self).await
    }

    fn group(&self) -> Option<&str> {
        self.keys().group_tag()
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys().fence(key));
        let v: Option<String> = self.query(cmd).await?;
        v.map(|v| parse_token(&v)).transpose()
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let (status, value): (String, String) = self
            .script(
                &self.scripts().advance,
                &[self.keys().fence(key)],
                &[token.to_string()],
            )
            .await?;
        advance_answer("redis", &status, Some(&value))
    }

    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError> {
        let k = self.keys();
        let mut keys = Vec::with_capacity(reqs.len() * 3);
        let mut args = Vec::with_capacity(reqs.len() * 3);
        for r in reqs {
            keys.extend([k.fence(&r.key), k.lease(&r.key), k.lease_order(&r.key)]);
            args.extend([
                r.lease.token.to_string(),
                r.lease.id.clone(),
                ttl_ms(r.ttl).to_string(),
            ]);
        }
        let reply: Vec<String> = self.script(&self.scripts().acquire, &keys, &args).await?;
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
        self.lease_script(&self.scripts().poll, key, lease, ttl)
            .await
    }

    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_script(&self.scripts().renew, key, lease, ttl)
            .await
    }

    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError> {
        let k = self.keys();
        let mut keys = Vec::with_capacity(leases.len() * 2);
        let mut args = Vec::with_capacity(leases.len() * 2);
        for (key, lease) in leases {
            keys.extend([k.lease(key), k.lease_order(key)]);
            args.extend([lease.token.to_string(), lease.id.clone()]);
        }
        let _: i64 = self.script(&self.scripts().release, &keys, &args).await?;
        Ok(())
    }

    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        let (op, id, holder, ttl) = call.args();
        let k = self.keys();
        let reply: Vec<String> = self
            .script(
                &self.scripts().lock,
                &[k.fence(key), k.grant(key), k.lease(key), k.lease_order(key)],
                &[op.into(), id.into(), holder.into(), ttl.to_string()],
            )
            .await?;
        lock_reply("redis", &call, &reply)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Calls::ping(self).await
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        self.before_marker_read().await?;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.keys().marker()).arg("epoch").arg("seq");
        marker(self.query(cmd).await?)
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        let v = self
            .script(
                &self.scripts().create_marker,
                &[self.keys().marker()],
                &[epoch.into()],
            )
            .await?;
        marker(v)?.ok_or_else(|| unavailable("marker not readable after creation"))
    }

    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError> {
        // Only bump an existing marker: never recreate one by accident.
        marker(
            self.script(&self.scripts().bump_marker, &[self.keys().marker()], &[])
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
                &self.scripts().replace_marker,
                &[self.keys().marker()],
                &[e, q, epoch.into()],
            )
            .await?;
        marker(v)?.ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}

/// [`Backend::replicas`] from a connection's record: the last call's wait
/// packed in one word (wanted in the high half, confirmed in the low;
/// `u64::MAX`: none), and the waits that failed.
pub(super) fn replicas_seen(last_wait: &AtomicU64, failed_waits: &AtomicU64) -> Option<Replicas> {
    let w = last_wait.load(Ordering::Relaxed);
    Some(Replicas {
        last: (w != u64::MAX).then_some(crate::store::api::LastWait {
            wanted: (w >> 32) as u32,
            confirmed: w as u32,
        }),
        failed_waits: failed_waits.load(Ordering::Relaxed),
    })
}

pub(super) fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("redis: {e}"))
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

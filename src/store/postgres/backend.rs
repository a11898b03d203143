//! What the shared-store admission asks of PostgreSQL ([`Backend`]):
//! each operation one function call, and how its answer is read.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;

use crate::store::api::{Advance, LeaseOutcome, StoreError, WriteLease};
use crate::store::shared::{
    advance_answer, lock_reply, Acquire, Backend, LockCall, LockReply, Marker,
};

use super::conn::*;
use super::schema::*;

#[async_trait]
impl Backend for PostgresBackend {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn timeout(&self) -> std::time::Duration {
        self.dialer.timeout
    }

    fn session(&self) -> u64 {
        self.dialer.session.load(Ordering::Acquire)
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let k = key.to_string();
        let v: Option<String> = self
            .with_client(|mut c| async move {
                let r = c
                    .query_opt(
                        "SELECT highest::text FROM fencegate_fences WHERE key = $1",
                        &[&k],
                    )
                    .await
                    .and_then(|row| row.map(|r| r.try_get(0)).transpose());
                (c, r)
            })
            .await?;
        v.map(|v| parse_token(&v)).transpose()
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let (status, value) = self
            .call(
                "SELECT * FROM fencegate_advance($1, $2::text::numeric)",
                key,
                token,
                None,
            )
            .await?;
        advance_answer("postgres", &status, value.as_deref())
    }

    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError> {
        // Byte order (Rust's `str` order, PostgreSQL's "C" collation): the
        // order fence rows are locked in by every batch.
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by(|&a, &b| reqs[a].key.cmp(&reqs[b].key));
        let keys: Vec<String> = order.iter().map(|&i| reqs[i].key.clone()).collect();
        let tokens: Vec<String> = order
            .iter()
            .map(|&i| reqs[i].lease.token.to_string())
            .collect();
        let ids: Vec<String> = order.iter().map(|&i| reqs[i].lease.id.clone()).collect();
        let ttls: Vec<i64> = order
            .iter()
            .map(|&i| i64::try_from(reqs[i].ttl.as_millis()).unwrap_or(i64::MAX))
            .collect();
        let rows = self
            .with_client(|mut c| async move {
                let r = c
                    .query(
                        "SELECT i, status, value FROM fencegate_acquire_many($1, $2::text[]::numeric[], $3, $4)",
                        &[&keys, &tokens, &ids, &ttls],
                    )
                    .await;
                (c, r)
            })
            .await?;
        let mut answers: Vec<Option<Result<LeaseOutcome, StoreError>>> = vec![None; reqs.len()];
        for row in rows {
            let (j, status, value) = (|| {
                Ok::<_, tokio_postgres::Error>((
                    row.try_get::<_, i32>(0)?,
                    row.try_get::<_, String>(1)?,
                    row.try_get::<_, Option<String>>(2)?,
                ))
            })()
            .map_err(unavailable)?;
            let Some(&i) = usize::try_from(j - 1).ok().and_then(|j| order.get(j)) else {
                return Err(unavailable(format!("batch answer for unknown item {j}")));
            };
            answers[i] = Some(lease_outcome(
                &status,
                value.as_deref().unwrap_or(""),
                reqs[i].lease.clone(),
            ));
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
        self.lease_call(
            "SELECT * FROM fencegate_poll($1, $2::text::numeric, $3, $4)",
            key,
            lease,
            ttl,
        )
        .await
    }

    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_call(
            "SELECT * FROM fencegate_renew($1, $2::text::numeric, $3, $4)",
            key,
            lease,
            ttl,
        )
        .await
    }

    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        let (op, id, holder, ttl) = call.args();
        let args = (
            op.to_string(),
            key.to_string(),
            id.to_string(),
            holder.to_string(),
            i64::try_from(ttl).unwrap_or(i64::MAX),
        );
        let parts: Vec<String> = self
            .with_client(|mut c| async move {
                let (op, k, id, holder, ttl) = &args;
                let r = c
                    .query_one(
                        "SELECT fencegate_lock($1, $2, $3, $4, $5)",
                        &[op, k, id, holder, ttl],
                    )
                    .await
                    .and_then(|row| row.try_get::<_, Vec<String>>(0));
                (c, r)
            })
            .await?;
        lock_reply("postgres", &call, &parts)
    }

    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError> {
        // Byte order: the order every batch locks fence rows in.
        let mut sorted: Vec<&(String, WriteLease)> = leases.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let keys: Vec<String> = sorted.iter().map(|(k, _)| k.clone()).collect();
        let ids: Vec<String> = sorted.iter().map(|(_, l)| l.id.clone()).collect();
        self.with_client(|mut c| async move {
            let r = c
                .execute("SELECT fencegate_release_many($1, $2)", &[&keys, &ids])
                .await;
            (c, r)
        })
        .await?;
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.with_client(|c| async move {
            let r = c.simple_query("SELECT 1").await;
            (c, r)
        })
        .await?;
        Ok(())
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        self.with_client(|mut c| async move {
            let r = c
                .query_opt("SELECT epoch, seq FROM fencegate_marker WHERE id = 1", &[])
                .await
                .and_then(|row| row.map(marker_row).transpose());
            (c, r)
        })
        .await
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        let e = epoch.to_string();
        self.with_client(|mut c| async move {
            let r = c
                .execute(
                    "INSERT INTO fencegate_marker (id, epoch, seq) VALUES (1, $1, 1) ON CONFLICT (id) DO NOTHING",
                    &[&e],
                )
                .await;
            (c, r)
        })
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after creation"))
    }

    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError> {
        self.with_client(|mut c| async move {
            let r = c
                .query_opt(
                    "UPDATE fencegate_marker SET seq = seq + 1 WHERE id = 1 RETURNING epoch, seq",
                    &[],
                )
                .await
                .and_then(|row| row.map(marker_row).transpose());
            (c, r)
        })
        .await
    }

    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError> {
        let e = epoch.to_string();
        let expected =
            expected.map(|m| (m.epoch.clone(), i64::try_from(m.seq).unwrap_or(i64::MAX)));
        self.with_client(|mut c| async move {
            let r = match &expected {
                None => c
                    .execute(
                        "INSERT INTO fencegate_marker (id, epoch, seq) VALUES (1, $1, 1) ON CONFLICT (id) DO NOTHING",
                        &[&e],
                    )
                    .await,
                Some((old, seq)) => c
                    .execute(
                        "UPDATE fencegate_marker SET epoch = $1, seq = 1 WHERE id = 1 AND epoch = $2 AND seq = $3",
                        &[&e, old, seq],
                    )
                    .await,
            };
            (c, r)
        })
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}

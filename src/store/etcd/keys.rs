//! The keyspace (`fencegate/f/`, `/l/`, `/g/`, the marker) and the
//! transactions built on it: an admission's guarded transaction and how its
//! answer is read, batches cut to etcd's request size.

use std::time::Duration;

use crate::store::api::{LeaseOutcome, StoreError, WriteLease};
use crate::store::shared::{busy, stored_token};

use super::rpc::{self, RequestOp, ResponseOp, TxnRequest, TxnResponse};

pub(super) const MARKER: &str = "fencegate/marker";

pub(super) fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("etcd: {e}"))
}

pub(super) fn hex(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn pad(token: u64) -> String {
    format!("{token:020}")
}

pub(super) fn fence_key(key: &str) -> String {
    format!("fencegate/f/{}", hex(key))
}

pub(super) fn lease_prefix(key: &str) -> String {
    format!("fencegate/l/{}/", hex(key))
}

pub(super) fn grant_key(key: &str) -> String {
    format!("fencegate/g/{}", hex(key))
}

/// How many times a lock operation reads and tries its compare-and-swap
/// before it gives up (each retry means another replica changed the key
/// meanwhile).
pub(super) const LOCK_ATTEMPTS: usize = 16;

pub(super) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The first key-value of a range answer in a transaction, with its
/// modification revision.
pub(super) fn range_kv(resp: &ResponseOp) -> Option<(String, i64)> {
    let kv = resp.range()?.kvs.first()?;
    Some((text(&kv.value), kv.mod_revision))
}

pub(super) fn parse_token(v: &str) -> Result<u64, StoreError> {
    stored_token("etcd", v)
}

/// An etcd lease for keys that must live `ttl`: an eighth more, in whole
/// seconds (etcd's unit), so at least a second more and at least 2 s.
pub(super) fn grant_for(ttl: Duration) -> Duration {
    let ms = ttl.as_millis() as u64;
    let secs = (ms + ms / 8).div_ceil(1000).max(ms / 1000 + 1).max(2);
    Duration::from_secs(secs)
}

/// A transaction guarded by the key's fence: if the stored highest is above
/// the token, the stale operations run and the highest is read; otherwise
/// the operations run.
pub(super) struct GuardedTxn {
    pub(super) body: TxnRequest,
    pub(super) success_n: usize,
    pub(super) ops_n: usize,
}

impl GuardedTxn {
    pub(super) fn new(
        key: &str,
        token: u64,
        stale_ops: Vec<RequestOp>,
        ops: Vec<RequestOp>,
    ) -> Self {
        let fk = fence_key(key);
        let mut success = stale_ops;
        success.push(rpc::range(&fk));
        let (success_n, ops_n) = (success.len(), ops.len());
        Self {
            body: TxnRequest {
                compare: vec![rpc::value_greater(&fk, &pad(token))],
                success,
                failure: ops,
            },
            success_n,
            ops_n,
        }
    }

    /// The transaction's answer (top-level or nested).
    pub(super) fn answer(&self, v: TxnResponse) -> Result<LeaseStep, StoreError> {
        let expected = if v.succeeded {
            self.success_n
        } else {
            self.ops_n
        };
        if v.responses.len() != expected {
            return Err(unavailable(format!(
                "transaction answered {} results for {expected} operations",
                v.responses.len()
            )));
        }
        if v.succeeded {
            let highest = v.responses.last().and_then(range_kv).map(|(h, _)| h);
            return Ok(LeaseStep::Stale(decode_padded(
                &highest.unwrap_or_default(),
            )?));
        }
        Ok(LeaseStep::Ran(v.responses))
    }
}

/// The most a batch transaction carries: etcd refuses requests over
/// `--max-request-bytes` (1.5 MiB by default).
pub(super) const MAX_TXN_BYTES: usize = 512 * 1024;

/// What one acquire adds to a batch transaction, at most: its key appears
/// seven times in hex (unit-tested against the encoded size).
pub(super) fn txn_size(key: &str) -> usize {
    key.len() * 14 + 400
}

/// Splits a batch into transactions under [`MAX_TXN_BYTES`], by each item's
/// `size` (an item over it alone goes alone, as a lone write would). The
/// writes of a batch are independent: splitting changes no answer.
pub(super) fn by_size<T>(items: Vec<T>, size: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut chunks: Vec<Vec<T>> = Vec::new();
    let mut total = 0;
    for item in items {
        let n = size(&item);
        match chunks.last_mut() {
            Some(last) if total + n <= MAX_TXN_BYTES => {
                last.push(item);
                total += n;
            }
            _ => {
                chunks.push(vec![item]);
                total = n;
            }
        }
    }
    chunks
}

pub(super) enum LeaseStep {
    Stale(u64),
    Ran(Vec<ResponseOp>),
}

impl LeaseStep {
    /// The answer to an admission (an acquire, or a poll of a waiting
    /// lease): stale, or busy while an older lease is held, else granted.
    pub(super) fn admission(self, lease: WriteLease) -> LeaseOutcome {
        match self {
            LeaseStep::Stale(h) => LeaseOutcome::Stale { highest: h },
            LeaseStep::Ran(r) => older_leases(&r, lease),
        }
    }
}

pub(super) fn decode_padded(v: &str) -> Result<u64, StoreError> {
    let t = v.trim_start_matches('0');
    if t.is_empty() {
        Ok(0)
    } else {
        parse_token(t)
    }
}

/// Busy if the transaction's last result (the count of older leases) is
/// not zero, else granted.
pub(super) fn older_leases(results: &[ResponseOp], lease: WriteLease) -> LeaseOutcome {
    if results
        .last()
        .and_then(ResponseOp::range)
        .map_or(0, |r| r.count)
        > 0
    {
        busy(lease)
    } else {
        LeaseOutcome::Granted(lease)
    }
}

pub(super) fn older_count(key: &str, token: u64) -> RequestOp {
    let prefix = lease_prefix(key);
    rpc::count(&prefix, &format!("{prefix}{}", pad(token)))
}

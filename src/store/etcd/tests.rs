//! The etcd engine's unit tests: keys, padding, transaction sizes.

use prost::Message;

use super::conn::*;
use super::keys::*;
use super::rpc;
use crate::store::api::*;

#[test]
fn batches_split_by_size_keep_every_operation_in_order() {
    let op = |n: usize| "x".repeat(n);
    let ops: Vec<String> = (0..10).map(|i| op(MAX_TXN_BYTES / 4 + i)).collect();
    let chunks = by_size(ops.clone(), String::len);
    assert!(
        chunks.len() >= 3,
        "ten quarter-size operations need several transactions"
    );
    for c in &chunks {
        let size: usize = c.iter().map(String::len).sum();
        assert!(size <= MAX_TXN_BYTES || c.len() == 1);
    }
    assert_eq!(chunks.concat(), ops, "nothing lost or reordered");
    // One operation over the limit goes alone.
    let big = by_size(vec![op(10), op(MAX_TXN_BYTES * 2), op(10)], String::len);
    assert_eq!(big.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1, 1]);
    assert!(by_size(Vec::<String>::new(), String::len).is_empty());
    // Full batches of the longest default keys (1536 bytes) split, and
    // each part stays far under etcd's 1.5 MiB request limit.
    let parts = by_size((0..64).collect::<Vec<usize>>(), |_| {
        txn_size(&"k".repeat(1536))
    });
    assert!(
        parts.len() > 1
            && parts
                .iter()
                .all(|p| p.len() * txn_size(&"k".repeat(1536)) <= MAX_TXN_BYTES)
    );
}

/// The size a batch is split by bounds what an acquire really adds to
/// the encoded transaction, for short and long keys and the largest
/// tokens, lease ids and etcd lease ids.
#[test]
fn the_size_estimate_bounds_an_acquires_encoding() {
    for len in [0, 1, 40, 1536, 8192] {
        let key = "\u{7f}".repeat(len);
        let lease = WriteLease {
            token: u64::MAX,
            id: "f".repeat(32),
        };
        let txn = EtcdBackend::acquire_txn(&key, &lease, i64::MIN);
        let encoded = rpc::nested(txn.body).encoded_len() + 4;
        assert!(
            encoded <= txn_size(&key),
            "key of {len} bytes: {encoded} encoded > {} estimated",
            txn_size(&key)
        );
    }
}

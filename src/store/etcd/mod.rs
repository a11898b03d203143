//! The etcd store, over etcd's v3 gRPC API (`rpc.rs`: HTTP/2, cleartext
//! with prior knowledge for `etcd://`, TLS with ALPN for `etcds://`; one
//! connection carries every call). With a user, calls carry the token
//! etcd's auth gave for it.
//!
//! Keyspace (`HEX` is the fence key in hex, so keys never nest):
//! - `fencegate/f/HEX`: the highest token, zero-padded to 20 digits so that
//!   etcd's byte-wise compare is numeric order over the whole u64 range.
//! - `fencegate/l/HEX/TOKEN20/ID`: an in-flight lease, attached to an etcd
//!   lease of this replica (expires on etcd's clock if the replica dies, at
//!   most an eighth after the write's own lease would).
//! - `fencegate/g/HEX`: the lock service's lease on the key, JSON `{id,
//!   token, holder, exp}`; `exp` is in ms on the granting replica's wall
//!   clock (etcd has no clock to read), so replicas' clock skew shifts
//!   expiry. Changed by compare-and-swap on its and the fence's revisions.
//! - `fencegate/marker`: `EPOCH SEQ` (amnesia detection).
//!
//! Admission is one transaction: if the stored highest is greater, read it
//! (stale); otherwise write the token, register the lease and count older
//! leases, atomically. A raise is durable once etcd acknowledged it: etcd
//! commits through its Raft quorum and fsyncs its WAL.
//!
//! Files: `conn.rs` (the backend and its calls), `backend.rs` (the
//! admission's operations), `keys.rs` (keyspace and transactions),
//! `rpc.rs` (the gRPC messages and the unary call).

mod backend;
mod conn;
mod keys;
mod rpc;
#[cfg(test)]
mod tests;

pub use conn::EtcdBackend;
pub use rpc::Dialer;

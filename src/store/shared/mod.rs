//! What every shared store (Redis, PostgreSQL, etcd) has in common:
//! amnesia detection and the per-replica knowledge behind it.
//!
//! A backend ([`Backend`]) only speaks its server's protocol. [`SharedStore`]
//! wraps it into a [`FenceStore`](crate::store::api::FenceStore) and refuses writes when the server may have
//! lost data: its marker record (written at first start) is missing, was
//! replaced, or carries a sequence number lower than this replica already
//! saw (a restored backup, a failover to a lagging replica); or a key's
//! highest token is lower than one the server acknowledged to this replica.
//! Writes stay refused until an operator confirms ([`FenceStore::confirm_reset`](crate::store::api::FenceStore::confirm_reset)),
//! which writes back every fence this replica knows and a new marker.
//!
//! Files: `backend.rs` (what an engine implements), `store.rs` (the
//! `SharedStore` and its checks), `fence_store.rs` (the `FenceStore` over
//! it), `marker.rs` (the marker and its copy on disk), `dial.rs` (connection
//! slots whose dials outlive their calls).

mod backend;
pub mod dial;
mod fence_store;
mod groups;
mod marker;
mod store;

pub use backend::{
    advance_answer, busy, lease_answer, lock_reply, stored_token, Acquire, Backend, LockCall,
    LockReply,
};
pub use groups::Grouped;
pub use marker::{Marker, StateFile};
pub use store::SharedStore;

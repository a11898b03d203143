//! Admission and ordering: the fence itself.
//!
//! For each write, [`Fence::admit`] decides from the key's highest token:
//! lower is stale; higher is raised durably in the store first; equal is
//! admitted. An admitted write gets a [`Permit`] that marks it in flight.
//! A write is not let through while an *older*-token write to the same key
//! is still in flight, so a backend that applies requests in arrival order
//! applies them in token order. Every admitted write carries its own
//! deadline (admission plus its route's upstream timeout), by which the proxy
//! has ended its exchange and its body; a newer write waits until each older
//! one has ended or passed *that* deadline. If the newer write's own wait
//! limit comes first it is refused ([`FenceError::Busy`]), never forwarded.
//! Once a newer token is admitted, every older write, queued or new, is
//! stale.
//!
//! In-memory state is per key (`KeyGate` (`gate.rs`)), created on demand; a bounded
//! cache of highest tokens answers the steady case (token equal to the
//! highest) without touching the store, but only when the store says this
//! process is its only writer.
//!
//! Crash recovery (embedded store): before a write is forwarded, its key
//! must have a live *mark* in the store, written in the same commit as the
//! advance when there is one. Marks carry a rising sequence number and live
//! while they are at or above the fence's watermark; every
//! [`ROTATE_EVERY`], [`Fence::rotate_marks`] raises the watermark, marking
//! again only the keys with writes in flight, so a key in steady use costs
//! one mark per rotation and an idle key's mark dies within two. After an
//! unclean stop only the keys with live marks are *held*: a token above
//! their highest is refused (503, `Retry-After`) until the crashed run's
//! writes can no longer be in flight, an upstream timeout after the
//! restart. Every other key, and stale or equal tokens on a held key,
//! behave as in normal running.
//!
//! Files, by concern (each an `impl Fence` block or the types it uses):
//! `state.rs` (the `Fence` and `Permit`), `admit.rs` (admission and
//! ordering), `gate.rs` (per-key gates), `cache.rs` (highest tokens),
//! `recovery.rs` (marks and holds), `shared.rs` (shared-store leases) with
//! `active.rs` (registrations) and `grant.rs` (lock-service grants), and
//! `error.rs`.

mod active;
mod admit;
mod cache;
mod error;
mod gate;
mod grant;
mod recovery;
mod shared;
mod state;
#[cfg(test)]
mod tests;

pub use active::CHECK_EVERY;
pub use admit::Activity;
pub use cache::DEFAULT_CACHE_BYTES;
pub use error::FenceError;
pub use gate::CUT_GRACE;
pub use recovery::ROTATE_EVERY;
pub use state::{Fence, Permit, Raised};

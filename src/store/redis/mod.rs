//! The Redis store: fences as strings, in-flight leases as hashes, each
//! operation one Lua script (EVALSHA, reloaded on NOSCRIPT).
//!
//! Keyspace (the `{...}` hash tag keeps a key's fence and leases in one
//! cluster slot):
//! - `fencegate:f:{KEY}`: the highest token, as a decimal string (Lua numbers
//!   are doubles and cannot hold every u64; scripts compare the strings by
//!   length, then lexically, which is numeric order for canonical decimals).
//! - `fencegate:l:{KEY}`: hash of lease `TOKEN20:ID` -> expiry (ms, on the
//!   Redis server's clock, `TIME`).
//! - `fencegate:o:{KEY}`: the same leases in a sorted set (score 0, ordered
//!   by name, so by zero-padded token): the oldest lease is found in
//!   O(log n).
//! - `fencegate:g:{KEY}`: the lock service's lease on the key, a hash of
//!   `id`, `token`, `holder` and `exp` (ms, server clock), expiring with
//!   it (PEXPIRE).
//! - `fencegate:marker`: hash with `epoch` and `seq` (amnesia detection).
//!
//! - `fencegate:sync`: written after each call whose effects must reach
//!   replicas (see below).
//!
//! Durability is Redis's: only `appendonly yes` with `appendfsync always`
//! makes an acknowledged raise survive a Redis crash; fencegate warns at
//! connect when the server says otherwise.
//!
//! Replication is asynchronous, so a failover to a replica can lose what the
//! primary acknowledged. Each call is therefore followed, in the same round
//! trip, by a write to `fencegate:sync` and `WAIT N`: its answer counts only
//! once N replicas have everything up to that write, which covers what the
//! call changed and what it read (another replica's raise it saw). Too few
//! confirmations in time fail the call like a store timeout. The primary is
//! found directly (`redis://`) or asked of Sentinel (`redis+sentinel://`),
//! again after every connection failure, so a promoted replica is followed.
//!
//! Files: `conn.rs` (connections, the replica wait), `sentinel.rs` (the
//! primary as most Sentinels name it),
//! `backend.rs` (the admission's operations), `scripts.rs` (the Lua
//! scripts and the keyspace).

mod backend;
pub mod cluster;
mod conn;
mod scripts;
mod sentinel;
#[cfg(test)]
mod tests;

pub use conn::{Options, RedisBackend};

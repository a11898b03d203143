//! Time as fencegate counts it: whole milliseconds (what stores and the
//! lease API carry) and the wall-clock arithmetic of lock-service leases.
//! Plain functions, below every engine and service that uses them.

use std::time::Duration;

/// Whole milliseconds of `d`, saturating (TTLs and expiries as stores and
/// the lease API carry them).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds since the Unix epoch on this host's wall clock (lease
/// expiry where the store has no clock of its own to read).
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, millis)
}

/// When a lock-service lease taken or renewed at `now` (whole ms, rounded
/// down, as clocks are read) for `ttl` ends: one ms late rather than early,
/// so it lasts at least `ttl` from any moment before it was granted, which
/// is what its holder counts from.
pub fn lease_end(now: u64, ttl: Duration) -> u64 {
    now.saturating_add(millis(ttl)).saturating_add(1)
}

/// What is left at `now` of a lease ending at `end` ([`lease_end`]), as
/// told to clients: without the extra ms, so never more than its TTL.
pub fn lease_left(end: u64, now: u64) -> Duration {
    Duration::from_millis(end.saturating_sub(now).saturating_sub(1))
}

//! Identifiers that no two processes or calls share: request-id prefixes
//! (proxy), shared-store lease ids (fence) and store marker epochs (store).
//! Not secret and not a UUID: only distinct.

use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh random-enough identifier, 32 hex digits: no two processes or
/// calls share one.
pub fn unique_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    let a = h.finish();
    h.write_u64(a);
    format!("{a:016x}{:016x}", h.finish())
}

//! Why a write was not admitted, and the one conversion of a store task's
//! end into it.

use std::time::Duration;

use crate::store::StoreError;

/// Why a write was not admitted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FenceError {
    #[error("token {token} is lower than the highest token {highest} seen for this key")]
    Stale { token: u64, highest: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("recovering from an unclean stop: writes forwarded before it may still be in flight upstream")]
    Recovering { retry_after: Duration },
    /// An older write to the key is still in flight and may run past this
    /// write's wait limit: forwarding now could overtake it.
    #[error("an older write to this key is still in flight")]
    Busy { retry_after: Duration },
}

/// The answer of a store task ([`Fence::advance`], [`Fence::mark`]); a
/// task that failed (panicked) is a store error.
pub(super) fn joined<T>(
    done: Result<Result<T, StoreError>, tokio::task::JoinError>,
) -> Result<T, FenceError> {
    match done {
        Ok(r) => Ok(r?),
        Err(e) => Err(StoreError::Unavailable(format!("store task failed: {e}")).into()),
    }
}

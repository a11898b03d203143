//! The marker record (who created the store's fence data and how many
//! connections it has seen), its per-replica copy on disk, and how a
//! marker read now is judged against the last one this replica saw.

use crate::store::api::StoreError;

/// The marker record: who created the store's fence data, and how many
/// (re)connections it has seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    pub epoch: String,
    pub seq: u64,
}

/// The epoch prefix of a marker that a replica replaced after it saw the
/// store go back ([`SharedStore::trip`]). Every replica reads the marker
/// before it admits anything, so a replica that restarted (and forgot what
/// it saw) or a new one is refused too, until an operator confirms, which
/// records a fresh epoch.
pub(super) const TRIPPED: &str = "rolledback.";

impl Marker {
    /// The marker a replica records after it saw the store go back: the
    /// sequence it had seen and the one it found.
    pub(super) fn tripped(seen: u64, found: u64) -> String {
        format!("{TRIPPED}{seen}.{found}.{}", &crate::id::unique_id()[..16])
    }

    /// Why writes are refused, if another replica saw this store go back.
    pub(super) fn trip_reason(&self) -> Option<String> {
        let rest = self.epoch.strip_prefix(TRIPPED)?;
        let mut parts = rest.split('.');
        let (seen, found) = (parts.next().unwrap_or("?"), parts.next().unwrap_or("?"));
        Some(format!(
            "a replica found its marker gone back from sequence {seen} to {found} (restored backup or lagging failover) and recorded it in the store"
        ))
    }

    /// The local state file's form: `EPOCH SEQ`.
    pub(super) fn parse_state(text: &str) -> Option<Marker> {
        let (epoch, seq) = text.trim().split_once(' ')?;
        let seq = seq.parse().ok()?;
        (!epoch.is_empty() && !epoch.contains(char::is_whitespace)).then(|| Marker {
            epoch: epoch.to_string(),
            seq,
        })
    }
}

/// A replica's own record, on its own disk, of the latest marker it saw
/// (`store_state_file`): a restarted replica compares the store's marker
/// with it, so a store rolled back while the replica was down is caught at
/// its first check, even if no running replica saw the rollback.
#[derive(Debug, Clone)]
pub struct StateFile {
    pub(super) path: std::path::PathBuf,
}

impl StateFile {
    pub fn new(path: std::path::PathBuf) -> Self {
        Self { path }
    }

    /// The marker recorded last; `None` if the file does not exist yet.
    pub fn load(&self) -> Result<Option<Marker>, StoreError> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => Marker::parse_state(&text).map(Some).ok_or_else(|| {
                StoreError::Unavailable(format!(
                    "store_state_file {} is not a marker record (`EPOCH SEQ`); remove it only if this replica's store was knowingly reset",
                    self.path.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::Unavailable(format!(
                "store_state_file {}: {e}",
                self.path.display()
            ))),
        }
    }

    /// Replaces the record (a new file renamed over the old one, so a crash
    /// leaves the old record or the new one, never half of either).
    pub(super) async fn save(&self, m: &Marker) -> std::io::Result<()> {
        let path = self.path.clone();
        let text = format!("{} {}\n", m.epoch, m.seq);
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut tmp = path.clone().into_os_string();
            tmp.push(".tmp");
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_data()?;
            std::fs::rename(&tmp, &path)?;
            // The rename itself reaches the disk with its directory.
            match path.parent().filter(|d| !d.as_os_str().is_empty()) {
                Some(dir) => std::fs::File::open(dir)?.sync_all(),
                None => Ok(()),
            }
        })
        .await
        .map_err(std::io::Error::other)?
    }
}

/// Why the store's marker `m` cannot follow `known`, the one this replica
/// saw last: another epoch (replaced), or a lower sequence (rolled back).
pub(super) fn behind(known: &Marker, m: &Marker) -> Option<String> {
    if m.epoch != known.epoch {
        Some(format!(
            "its marker changed from epoch {} to {}",
            known.epoch, m.epoch
        ))
    } else if m.seq < known.seq {
        Some(format!(
            "its marker went back from sequence {} to {} (restored backup or lagging failover)",
            known.seq, m.seq
        ))
    } else {
        None
    }
}

//! Value parsers the settings share: durations (humantime's grammar,
//! bounded) and socket addresses.

use std::net::SocketAddr;
use std::time::Duration;

use super::error::*;

/// Parses `250ms`, `10s`, `2m`, `1h`.
/// The longest duration any setting takes. Durations become deadlines
/// (`Instant + d`), which must not overflow; and no timeout, grace period or
/// recovery window of fencegate's makes sense beyond a day.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// A duration such as `250ms`, `10s`, `2m` or `1h 30m` (humantime's
/// grammar), at most [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let d = humantime::parse_duration(t)
        .map_err(|e| format!("`{t}` is not a duration like 10s or 250ms ({e})"))?;
    if d > MAX_DURATION {
        return Err(format!("`{t}` is out of range (at most 24h)"));
    }
    Ok(d)
}

pub(super) fn format_duration(d: Duration) -> String {
    if d.subsec_millis() != 0 || d.as_secs() == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs())
    }
}

pub(super) fn duration(
    field: &str,
    raw: &Option<String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match raw {
        None => Ok(default),
        Some(t) => {
            let d = parse_duration(t).map_err(|r| invalid(field, r))?;
            if d.is_zero() {
                return Err(invalid(field, "must be greater than zero"));
            }
            Ok(d)
        }
    }
}

pub(super) fn socket(
    field: &str,
    raw: &Option<String>,
    default: &str,
) -> Result<SocketAddr, ConfigError> {
    let text = raw.as_deref().unwrap_or(default);
    text.parse()
        .map_err(|_| invalid(field, format!("`{text}` is not an IP:port address")))
}

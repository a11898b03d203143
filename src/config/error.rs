//! The configuration's one error type: every refusal names its field.

use std::path::PathBuf;

/// A configuration error, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("cannot read config file {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("config file {path}: {reason}")]
    Parse { path: PathBuf, reason: String },
}

pub(super) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

impl From<crate::tls::TlsError> for ConfigError {
    fn from(e: crate::tls::TlsError) -> Self {
        invalid(e.field, e.reason)
    }
}

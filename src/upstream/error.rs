//! How an exchange with an upstream fails, for the proxy to answer by
//! (`crate::error` maps each to its status).

use std::time::Duration;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made (refused, timed out, TLS handshake);
    /// the request was not sent.
    #[error("{0}")]
    Connect(String),
    /// The connection failed once the request may have been sent.
    #[error(transparent)]
    Exchange(#[from] hyper::Error),
    /// The own lane's exchange failed once the request may have been sent.
    #[error("{0}")]
    Wire(String),
    /// Every connection the cap allows was taken for `waited`: the request
    /// was not sent.
    #[error("all {max} connections to the upstream (upstream_max_connections) stayed taken for {waited:?} (upstream_queue_timeout)")]
    Queue { waited: Duration, max: usize },
}

impl UpstreamError {
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
}

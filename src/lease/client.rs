//! A client of the lease API for `fencegate lease acquire|renew|release`
//! (shell scripts): one request, its JSON answer, and an exit code by
//! outcome so that a script can tell "held by another" from "lost".

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// Why a lease command failed, with the exit code a script sees.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// 409: another holder has the key (exit 3).
    #[error("{0}")]
    Held(String),
    /// 410: the lease expired or was released (exit 4).
    #[error("{0}")]
    Gone(String),
    /// Anything else (exit 1).
    #[error("{0}")]
    Failed(String),
}

impl ClientError {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Held(_) => 3,
            Self::Gone(_) => 4,
            Self::Failed(_) => 1,
        }
    }
}

/// The first token of a lease token file (the server's format: `TOKEN
/// [PREFIX ...]` per line, `#` comments), so one file can serve both.
pub fn read_token(path: &std::path::Path) -> Result<String, ClientError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ClientError::Failed(format!("cannot read {}: {e}", path.display())))?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().next())
        .map(str::to_string)
        .ok_or_else(|| ClientError::Failed(format!("{} holds no token", path.display())))
}

/// Sends one request to the lease API at `base` (`http://host:port`) and
/// returns its JSON body (`Null` for 204). `timeout` bounds the whole call
/// (an acquire's `wait_ms` must fit in it).
pub async fn call(
    base: &str,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, ClientError> {
    let url = format!("{}{path}", base.trim_end_matches('/'));
    let req = Request::builder()
        .method(method)
        .uri(&url)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .map_err(|e| ClientError::Failed(format!("`{url}` is not a URL: {e}")))?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = tokio::time::timeout(timeout, async {
        let resp = client.request(req).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, bytes))
    })
    .await
    .map_err(|_| ClientError::Failed(format!("{url}: no answer within {timeout:?}")))?
    .map_err(|e| ClientError::Failed(format!("{url}: {}", crate::error::error_chain(&*e))))?;
    let (status, bytes) = resp;
    let json: Value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or(Value::Null)
    };
    if status.is_success() {
        return Ok(json);
    }
    let detail = json
        .get("detail")
        .and_then(Value::as_str)
        .map_or_else(|| status.to_string(), |d| format!("{status}: {d}"));
    let kind = json.get("type").and_then(Value::as_str).unwrap_or("");
    Err(match status {
        // No holder to wait for: retrying cannot help.
        StatusCode::CONFLICT if kind.ends_with(":tokens-exhausted") => ClientError::Failed(detail),
        StatusCode::CONFLICT => {
            let holder = json.get("holder").and_then(Value::as_str).unwrap_or("");
            let left = json.get("expires_in_ms").and_then(Value::as_u64);
            match left {
                Some(ms) => {
                    ClientError::Held(format!("{detail} (holder {holder:?}, expires in {ms} ms)"))
                }
                None => ClientError::Held(detail),
            }
        }
        StatusCode::GONE => ClientError::Gone(detail),
        _ => ClientError::Failed(detail),
    })
}

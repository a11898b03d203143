//! The raw shape: what a TOML file or the flags say, every field optional,
//! unknown fields refused; read from a file with its relative paths made
//! relative to the file's directory.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::error::*;
use super::secret::Secret;

/// The file format. Every field is optional; defaults are applied in
/// `Config::try_from`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    /// A file path, or `redb://PATH`.
    pub store: Option<String>,
    /// redb page cache, MiB.
    pub store_cache_mib: Option<u64>,
    /// Timeout of shared-store calls.
    pub store_timeout: Option<String>,
    /// Redis: replicas a change must reach before it counts as stored.
    pub store_replicas_to_wait: Option<u32>,
    /// Accept a shared store that lost data (after checking why).
    pub accept_store_reset: Option<bool>,
    /// Where a shared-store replica keeps the latest marker it saw.
    pub store_state_file: Option<PathBuf>,
    /// PEM CA certificates for a shared store's TLS, instead of the
    /// system's.
    pub store_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) and key presented to a shared store.
    pub store_client_cert: Option<PathBuf>,
    pub store_client_key: Option<PathBuf>,
    /// A file whose first line is the shared store's password.
    pub store_password_file: Option<PathBuf>,
    /// The password from the environment (`FENCEGATE_STORE_PASSWORD`); never
    /// read from or written to a file.
    #[serde(skip)]
    pub store_password: Option<Secret>,
    /// How many highest tokens to keep in memory.
    pub highest_cache_entries: Option<u64>,
    /// Worker threads, each with its own listeners and upstream pools;
    /// absent: the CPUs this process may use.
    pub workers: Option<u64>,
    pub admin_token_file: Option<PathBuf>,
    /// The lease API's listener (the lock service); absent: not served.
    pub lease_listen: Option<String>,
    /// Bearer tokens of the lease API, one per line: `TOKEN [PREFIX ...]`.
    pub lease_token_file: Option<PathBuf>,
    /// The longest TTL (and `wait_ms`) a lease may ask for.
    pub max_lease_ttl: Option<String>,
    pub shutdown_grace: Option<String>,
    /// One log line per request.
    pub access_log: Option<bool>,
    /// How many of the last refusals the admin API and page show (0:
    /// none kept).
    pub refusals_kept: Option<u64>,
    /// How many of the last raises of a key's highest token the admin
    /// lookup and page can name the writer of (0: none kept).
    pub raises_kept: Option<u64>,
    /// The plain listener reads a PROXY protocol header (v1 or v2) first
    /// on every connection.
    pub proxy_protocol: Option<bool>,
    /// Addresses (CIDR ranges) allowed to send PROXY headers and whose
    /// `X-Forwarded-For`/`Forwarded` items are believed.
    pub trusted_proxies: Option<Vec<String>>,
    #[serde(default)]
    pub limits: RawLimits,
    /// A TLS listener (`[tls]`), beside the plain one.
    pub tls: Option<RawTls>,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub listen: Option<String>,
    /// PEM certificate chain, leaf first.
    pub cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// Require client certificates signed by these CAs (mTLS).
    pub client_ca: Option<PathBuf>,
    /// How often the files are checked for changes.
    pub watch_interval: Option<String>,
    /// Every connection starts with a PROXY protocol header (before TLS).
    pub proxy_protocol: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_connections: Option<u64>,
    pub max_header_bytes: Option<u64>,
    pub max_key_bytes: Option<u64>,
    pub max_body_bytes: Option<u64>,
    pub header_read_timeout: Option<String>,
    pub body_read_timeout: Option<String>,
    pub response_idle_timeout: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<String>,
    pub host: Option<String>,
    pub path_prefix: Option<String>,
    pub upstream: Option<String>,
    pub key: Option<String>,
    pub namespace: Option<String>,
    pub write_methods: Option<Vec<String>>,
    pub literal_keys: Option<bool>,
    pub strip_token: Option<bool>,
    /// Refuse a token more than this far above the key's highest.
    pub max_token_step: Option<u64>,
    /// `any` (default) or `granted`: only tokens fencegate's lease API
    /// granted for the key are admitted.
    pub tokens: Option<String>,
    /// Add X-Forwarded-For / X-Forwarded-Proto upstream (default true).
    pub forwarded_headers: Option<bool>,
    /// Pass WebSocket upgrades through (default false: refused, 501).
    pub websocket: Option<bool>,
    /// Methods without body semantics (`GET`, `OPTIONS`, `DELETE`) whose
    /// requests may carry a body on this route (default none: refused,
    /// 400), for backends that read them (search APIs).
    pub allow_bodies_on: Option<Vec<String>>,
    /// `problem` (default) or `s3`: how fencegate's own refusals are
    /// written (S3 SDKs read S3's XML errors).
    pub error_format: Option<String>,
    pub connect_timeout: Option<String>,
    pub upstream_timeout: Option<String>,
    /// Connections to the upstream open or being dialled, all workers
    /// together (default 64; 0: no cap). Requests past it queue.
    pub upstream_max_connections: Option<u64>,
    /// Longest wait in that queue before a 503 (default: connect_timeout,
    /// at most half of upstream_timeout).
    pub upstream_queue_timeout: Option<String>,
    /// PEM CA certificates for an https upstream, instead of the system's.
    pub upstream_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) and key presented to the upstream.
    pub upstream_client_cert: Option<PathBuf>,
    pub upstream_client_key: Option<PathBuf>,
    /// Offer HTTP/2 to an https upstream (ALPN); default false.
    pub upstream_http2: Option<bool>,
}

impl RawConfig {
    /// Reads and parses a TOML file; unknown fields are errors. Relative
    /// file paths in it are relative to the file's directory, as a config
    /// file is read by a service whose working directory is not the
    /// operator's (flags and environment variables stay relative to the
    /// working directory).
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let mut raw = Self::from_toml(&text).map_err(|reason| ConfigError::Parse {
            path: path.to_path_buf(),
            reason,
        })?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Absolute, so that the printed config (`check-config`) names
            // the same files wherever it is read back.
            let dir = std::path::absolute(dir).map_err(|e| ConfigError::Read {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
            raw.resolve_paths(&dir)?;
        }
        Ok(raw)
    }

    /// Makes every relative file path `dir`-relative: the store file
    /// (`PATH` or `redb://PATH`, not a shared store's URL, whose query
    /// parameters are the driver's), key, certificate, token and state
    /// files.
    ///
    /// Before this rule such paths were the working directory's: a store
    /// (or state) file found there and not beside the config file refuses
    /// the start, naming both, instead of a new, empty store forgetting
    /// every fence.
    pub(super) fn resolve_paths(&mut self, dir: &std::path::Path) -> Result<(), ConfigError> {
        let join = |p: &mut Option<PathBuf>| {
            if let Some(p) = p.as_mut().filter(|p| p.is_relative()) {
                *p = dir.join(&*p);
            }
        };
        let moved = |field: &str, given: &std::path::Path| -> Result<PathBuf, ConfigError> {
            let resolved = dir.join(given);
            if !resolved.exists() && given.exists() {
                return Err(invalid(
                    field,
                    format!(
                        "`{}` is relative to the config file's directory: {}, which does not exist; {} (from the working directory, where fencegate looked before) does: move it beside the config file, or give an absolute path",
                        given.display(),
                        resolved.display(),
                        std::path::absolute(given).unwrap_or_else(|_| given.to_path_buf()).display()
                    ),
                ));
            }
            Ok(resolved)
        };
        if let Some(store) = &mut self.store {
            let (scheme, rest) = match store.strip_prefix("redb://") {
                Some(rest) => ("redb://", rest.to_string()),
                None if !store.contains("://") => ("", store.clone()),
                None => ("", String::new()),
            };
            if !rest.is_empty() && std::path::Path::new(&rest).is_relative() {
                let resolved = moved("store", std::path::Path::new(&rest))?;
                *store = format!("{scheme}{}", resolved.display());
            }
        }
        if let Some(p) = self.store_state_file.as_mut().filter(|p| p.is_relative()) {
            *p = moved("store_state_file", p)?;
        }
        for p in [
            &mut self.store_ca,
            &mut self.store_client_cert,
            &mut self.store_client_key,
            &mut self.store_password_file,
            &mut self.admin_token_file,
            &mut self.lease_token_file,
        ] {
            join(p);
        }
        if let Some(tls) = &mut self.tls {
            for p in [&mut tls.cert, &mut tls.key, &mut tls.client_ca] {
                join(p);
            }
        }
        for r in &mut self.routes {
            for p in [
                &mut r.upstream_ca,
                &mut r.upstream_client_cert,
                &mut r.upstream_client_key,
            ] {
                join(p);
            }
        }
        Ok(())
    }

    /// A value of the wrong type is named by its field (`limits.max_connections`,
    /// `routes[1].upstream_timeout`), not only shown in the quoted line.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e: toml::de::Error| {
            match e.span().and_then(|span| field_at(text, span.start)) {
                Some(field) if !e.message().contains(&field) => format!("`{field}`: {e}"),
                _ => e.to_string(),
            }
        })
    }
}

/// The dotted name of the field whose value starts at byte `at` of a TOML
/// document: the table headers above it (`[limits]`, the n-th `[[routes]]`)
/// and the key on its line. Only plain one-line `key = value` lines are
/// named; anything else gives `None` (the error is shown as it is).
fn field_at(text: &str, at: usize) -> Option<String> {
    let before = text.get(..at)?;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let key = text[line_start..].split_once('=')?.0.trim();
    if key.is_empty()
        || !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
    {
        return None;
    }
    let mut table = String::new();
    let mut arrays: std::collections::HashMap<String, usize> = Default::default();
    for line in text[..line_start].lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("[[").and_then(|l| l.split_once("]]")) {
            let name = name.0.trim().to_string();
            let n = arrays
                .entry(name.clone())
                .and_modify(|n| *n += 1)
                .or_insert(0);
            table = format!("{name}[{n}]");
        } else if let Some(name) = line.strip_prefix('[').and_then(|l| l.split_once(']')) {
            table = name.0.trim().to_string();
        }
    }
    Some(if table.is_empty() {
        key.to_string()
    } else {
        format!("{table}.{key}")
    })
}

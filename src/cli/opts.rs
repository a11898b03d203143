//! The command line: subcommands, flags (each also a `FENCEGATE_*`
//! variable), and the raw config they make when no file is given.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use fencegate::config::{RawConfig, RawRoute};

/// A fencing-token reverse proxy: writes must carry X-Fence-Token, stale
/// ones are refused before they reach the backend.
#[derive(Parser, Debug)]
#[command(version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    #[command(flatten)]
    pub(crate) opts: Opts,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Validate a config file (with any flags) and print the effective config.
    CheckConfig {
        /// The TOML file to check.
        file: PathBuf,
    },
    /// Print where a write to PATH goes under the config (file and flags):
    /// which route, key template and fence key, or why it would be refused.
    /// Offline: the config is read (and must be valid, `store` included),
    /// but no listener, store or upstream is opened. `fencegate explain
    /// --config config/api.toml --host api.internal /orders/acme/42/items`.
    Explain {
        /// The request target as a client sends it: a path
        /// (`/bucket/report.csv`, percent-encoding included) or a URL
        /// (`http://host/path`).
        path: String,
        /// The request's Host, needed when routes name hosts.
        #[arg(long = "host")]
        request_host: Option<String>,
        /// A request header, `NAME: VALUE`, for `header:NAME` key templates
        /// (repeatable).
        #[arg(long = "header", value_name = "NAME: VALUE")]
        headers: Vec<String>,
        /// Print the JSON the admin lookup (`GET /v1/fences?path=`) answers.
        #[arg(long)]
        json: bool,
    },
    /// GET a URL and exit 0 on a 2xx answer (container health checks, where
    /// the image has no curl): `fencegate probe http://127.0.0.1:9090/healthz`.
    Probe {
        /// The URL to GET (http only).
        url: String,
    },
    /// Mark a new shared store (Redis, PostgreSQL, etcd) as fencegate's,
    /// once, before the first replica starts: `fencegate init-store --store
    /// redis://...`. A replica refuses to start on a store without the mark,
    /// since a wiped store looks just like a new one. Does nothing to a
    /// store that is marked already.
    InitStore,
    /// A lease from fencegate's lock service (`--lease-listen`), for shell
    /// scripts: `T=$(fencegate lease acquire --lease-url URL
    /// --lease-token-file F --ttl 30s jobs:nightly)`. Prints `LEASE_ID
    /// TOKEN`. Exit 0 on success, 3 when another holder has the key, 4 when
    /// the lease expired or was released, 1 otherwise.
    Lease {
        #[command(subcommand)]
        op: LeaseOp,
        /// The lease API, e.g. http://127.0.0.1:9091.
        #[arg(long, env = "FENCEGATE_LEASE_URL", global = true)]
        lease_url: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
pub(crate) enum LeaseOp {
    /// Take a lease on a key (or on the key a write to --path takes).
    Acquire {
        /// The fence key (`namespace:resource`); or give --path.
        key: Option<String>,
        /// A request target, mapped to its key as a write to it would be.
        #[arg(long)]
        path: Option<String>,
        /// The Host of --path, when routes name hosts.
        #[arg(long = "host")]
        request_host: Option<String>,
        /// How long the lease lasts unless renewed, e.g. 30s.
        #[arg(long)]
        ttl: String,
        /// Who holds it (logged, shown to others); default host:pid.
        #[arg(long)]
        holder: Option<String>,
        /// Wait up to this long for a held key, e.g. 10s.
        #[arg(long)]
        wait: Option<String>,
    },
    /// Extend a lease; prints `LEASE_ID TOKEN` (the same token).
    Renew {
        lease: String,
        #[arg(long)]
        ttl: String,
    },
    /// End a lease.
    Release { lease: String },
}

#[derive(clap::Args, Debug, Default)]
pub(crate) struct Opts {
    /// TOML config file (routes and everything else); flags override it.
    #[arg(long, env = "FENCEGATE_CONFIG", global = true)]
    pub(crate) config: Option<PathBuf>,
    /// Proxy listen address (plain HTTP/1.1 and h2c); `off` for TLS only
    /// [default: 127.0.0.1:8080].
    #[arg(long, env = "FENCEGATE_LISTEN", global = true)]
    pub(crate) listen: Option<String>,
    /// Admin listen address (metrics, health, fence API) [default:
    /// 127.0.0.1:9090].
    #[arg(long, env = "FENCEGATE_ADMIN_LISTEN", global = true)]
    pub(crate) admin_listen: Option<String>,
    /// Upstream origin for a catch-all route, e.g. http://127.0.0.1:9000.
    #[arg(long, env = "FENCEGATE_UPSTREAM", global = true)]
    pub(crate) upstream: Option<String>,
    /// Fence store: a file path (or redb://PATH) for the embedded store, or
    /// a shared store's URL for several replicas: redis://, rediss:// or
    /// redis+sentinel://HOST:PORT[,...]/MASTER, redis+cluster:// or rediss+cluster://HOST:PORT[,...],
    /// postgres:// or postgresql://, etcd:// or etcds://HOST:PORT[,HOST:PORT...]
    /// (docs/stores.md).
    #[arg(long, env = "FENCEGATE_STORE", global = true)]
    pub(crate) store: Option<String>,
    /// Timeout of shared-store calls (redis://, postgres://, etcd://).
    #[arg(long, env = "FENCEGATE_STORE_TIMEOUT", global = true)]
    pub(crate) store_timeout: Option<String>,
    /// Redis: how many replicas must have a change before it counts as
    /// stored (WAIT after each call); 0 never waits. Default: one while the
    /// primary has a replica online, else none (docs/stores.md).
    #[arg(long, env = "FENCEGATE_STORE_REPLICAS_TO_WAIT", global = true)]
    pub(crate) store_replicas_to_wait: Option<u32>,
    /// PEM CA certificates for a shared store's TLS (rediss://, etcds://,
    /// PostgreSQL sslmode=verify-*), instead of the system's.
    #[arg(long, env = "FENCEGATE_STORE_CA", global = true)]
    pub(crate) store_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) presented to a shared store.
    #[arg(long, env = "FENCEGATE_STORE_CLIENT_CERT", global = true)]
    pub(crate) store_client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "FENCEGATE_STORE_CLIENT_KEY", global = true)]
    pub(crate) store_client_key: Option<PathBuf>,
    /// A file whose first line is the shared store's password (Redis ACL
    /// user, PostgreSQL role, etcd user). FENCEGATE_STORE_PASSWORD in the
    /// environment is the other way; a password in the URL the last.
    #[arg(long, env = "FENCEGATE_STORE_PASSWORD_FILE", global = true)]
    pub(crate) store_password_file: Option<PathBuf>,
    /// Accept a store that lost data. A shared store: write back the fences
    /// this replica knows and record a new marker. The embedded store: open
    /// a file whose write-ahead log is missing or not its own, setting the
    /// log aside and holding every key for the recovery window (see
    /// docs/stores.md).
    #[arg(long, env = "FENCEGATE_ACCEPT_STORE_RESET", global = true)]
    pub(crate) accept_store_reset: bool,
    /// A file of this replica's own where it keeps the latest shared-store
    /// marker it saw, so that after a restart it still refuses a store that
    /// went back while it was down (see docs/stores.md).
    #[arg(long, env = "FENCEGATE_STORE_STATE_FILE", global = true)]
    pub(crate) store_state_file: Option<PathBuf>,
    /// The lease API's listen address (fencegate as the lock service).
    #[arg(long, env = "FENCEGATE_LEASE_LISTEN", global = true)]
    pub(crate) lease_listen: Option<String>,
    /// Bearer tokens of the lease API, a `TOKEN [KEY-PREFIX ...]` per
    /// line; `fencegate lease` sends the first one.
    #[arg(long, env = "FENCEGATE_LEASE_TOKEN_FILE", global = true)]
    pub(crate) lease_token_file: Option<PathBuf>,
    /// The longest TTL (and wait) a lease may ask for, e.g. 60s.
    #[arg(long, env = "FENCEGATE_MAX_LEASE_TTL", global = true)]
    pub(crate) max_lease_ttl: Option<String>,
    /// File holding the bearer token for mutating admin endpoints.
    #[arg(long, env = "FENCEGATE_ADMIN_TOKEN_FILE", global = true)]
    pub(crate) admin_token_file: Option<PathBuf>,
    /// Key template of the --upstream route: path, /{bucket}, header:NAME...
    #[arg(long, env = "FENCEGATE_KEY", global = true)]
    pub(crate) key: Option<String>,
    /// Fence namespace of the --upstream route.
    #[arg(long, env = "FENCEGATE_NAMESPACE", global = true)]
    pub(crate) namespace: Option<String>,
    /// Literal keys on the --upstream route (forward the target byte for byte).
    #[arg(long, env = "FENCEGATE_LITERAL_KEYS", global = true)]
    pub(crate) literal_keys: bool,
    /// Do not forward X-Fence-Token upstream (--upstream route).
    #[arg(long, env = "FENCEGATE_STRIP_TOKEN", global = true)]
    pub(crate) strip_token: bool,
    /// Token inflation guard of the --upstream route: refuse tokens more
    /// than this above the key's highest.
    #[arg(long, env = "FENCEGATE_MAX_TOKEN_STEP", global = true)]
    pub(crate) max_token_step: Option<u64>,
    /// How the --upstream route writes fencegate's own refusals:
    /// `problem` (application/problem+json) or `s3` (S3's XML errors, which
    /// boto3, the aws CLI and the other S3 SDKs show as code and message).
    #[arg(long, env = "FENCEGATE_ERROR_FORMAT", global = true)]
    pub(crate) error_format: Option<String>,
    /// Upstream response timeout (every route), e.g. 60s.
    #[arg(long, env = "FENCEGATE_UPSTREAM_TIMEOUT", global = true)]
    pub(crate) upstream_timeout: Option<String>,
    /// Upstream connect timeout (every route), e.g. 5s.
    #[arg(long, env = "FENCEGATE_CONNECT_TIMEOUT", global = true)]
    pub(crate) connect_timeout: Option<String>,
    /// Connections to each route's upstream, open or being dialled, all
    /// workers together (every route) [default: 64; 0: no cap].
    #[arg(long, env = "FENCEGATE_UPSTREAM_MAX_CONNECTIONS", global = true)]
    pub(crate) upstream_max_connections: Option<u64>,
    /// Longest wait for an upstream connection once the cap is reached,
    /// then 503 (every route), e.g. 5s [default: the connect timeout].
    #[arg(long, env = "FENCEGATE_UPSTREAM_QUEUE_TIMEOUT", global = true)]
    pub(crate) upstream_queue_timeout: Option<String>,
    /// Time allowed to send a request head (and idle keep-alive time).
    #[arg(long, env = "FENCEGATE_HEADER_READ_TIMEOUT", global = true)]
    pub(crate) header_read_timeout: Option<String>,
    /// Longest pause between request body chunks.
    #[arg(long, env = "FENCEGATE_BODY_READ_TIMEOUT", global = true)]
    pub(crate) body_read_timeout: Option<String>,
    /// Longest pause in a response body, either way (no byte from the
    /// upstream, or none taken by the client), e.g. 60s.
    #[arg(long, env = "FENCEGATE_RESPONSE_IDLE_TIMEOUT", global = true)]
    pub(crate) response_idle_timeout: Option<String>,
    /// Largest request head, bytes (431 above).
    #[arg(long, env = "FENCEGATE_MAX_HEADER_BYTES", global = true)]
    pub(crate) max_header_bytes: Option<u64>,
    /// Open connections per listener; more are closed at once.
    #[arg(long, env = "FENCEGATE_MAX_CONNECTIONS", global = true)]
    pub(crate) max_connections: Option<u64>,
    /// Longest fence key (namespace:resource), bytes (414 above).
    #[arg(long, env = "FENCEGATE_MAX_KEY_BYTES", global = true)]
    pub(crate) max_key_bytes: Option<u64>,
    /// Largest request body, bytes (413 above); no limit by default.
    #[arg(long, env = "FENCEGATE_MAX_BODY_BYTES", global = true)]
    pub(crate) max_body_bytes: Option<u64>,
    /// Time allowed to drain in-flight requests on SIGTERM/SIGINT.
    #[arg(long, env = "FENCEGATE_SHUTDOWN_GRACE", global = true)]
    pub(crate) shutdown_grace: Option<String>,
    /// How many highest tokens to keep in memory.
    #[arg(long, env = "FENCEGATE_HIGHEST_CACHE_ENTRIES", global = true)]
    pub(crate) highest_cache_entries: Option<u64>,
    /// Worker threads, each with its own listeners (SO_REUSEPORT) and
    /// upstream pools [default: the CPUs this process may use: its affinity
    /// mask, capped by its cgroup CPU quota].
    #[arg(long, env = "FENCEGATE_WORKERS", global = true)]
    pub(crate) workers: Option<u64>,
    /// TLS listen address (HTTP/1.1 and HTTP/2 by ALPN); needs --tls-cert
    /// and --tls-key.
    #[arg(long, env = "FENCEGATE_TLS_LISTEN", global = true)]
    pub(crate) tls_listen: Option<String>,
    /// PEM certificate chain of the TLS listener (reloaded when it changes).
    #[arg(long, env = "FENCEGATE_TLS_CERT", global = true)]
    pub(crate) tls_cert: Option<PathBuf>,
    /// PEM private key of the TLS listener.
    #[arg(long, env = "FENCEGATE_TLS_KEY", global = true)]
    pub(crate) tls_key: Option<PathBuf>,
    /// Require client certificates signed by this PEM CA bundle (mTLS).
    #[arg(long, env = "FENCEGATE_TLS_CLIENT_CA", global = true)]
    pub(crate) tls_client_ca: Option<PathBuf>,
    /// PEM CA bundle for https upstreams, instead of the system's roots.
    #[arg(long, env = "FENCEGATE_UPSTREAM_CA", global = true)]
    pub(crate) upstream_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to https upstreams.
    #[arg(long, env = "FENCEGATE_UPSTREAM_CLIENT_CERT", global = true)]
    pub(crate) upstream_client_cert: Option<PathBuf>,
    /// Private key of --upstream-client-cert.
    #[arg(long, env = "FENCEGATE_UPSTREAM_CLIENT_KEY", global = true)]
    pub(crate) upstream_client_key: Option<PathBuf>,
    /// Log one line per request (target fencegate::access).
    #[arg(long, env = "FENCEGATE_ACCESS_LOG", global = true)]
    pub(crate) access_log: bool,
    /// Every connection to the plain listener starts with a PROXY protocol
    /// header (v1 or v2) from a load balancer in --trusted-proxies.
    #[arg(long, env = "FENCEGATE_PROXY_PROTOCOL", global = true)]
    pub(crate) proxy_protocol: bool,
    /// Load balancers and proxies trusted to name the client (PROXY
    /// headers, X-Forwarded-For): addresses or CIDR ranges, comma-separated.
    #[arg(
        long,
        env = "FENCEGATE_TRUSTED_PROXIES",
        value_delimiter = ',',
        global = true
    )]
    pub(crate) trusted_proxies: Option<Vec<String>>,
    /// Log format.
    #[arg(long, env = "FENCEGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub(crate) log_format: LogFormat,
}

#[derive(ValueEnum, Clone, Copy, Debug, Default)]
pub(crate) enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Merges flags over the file (or over nothing, for the quick start).
pub(crate) fn raw_config(opts: &Opts, file: Option<&PathBuf>) -> anyhow::Result<RawConfig> {
    let mut raw = match file {
        Some(p) => RawConfig::from_file(p)?,
        None => RawConfig::default(),
    };
    fn set<T: Clone>(dst: &mut Option<T>, src: &Option<T>) {
        if src.is_some() {
            dst.clone_from(src);
        }
    }
    set(&mut raw.listen, &opts.listen);
    set(&mut raw.admin_listen, &opts.admin_listen);
    set(&mut raw.store, &opts.store);
    set(&mut raw.shutdown_grace, &opts.shutdown_grace);
    set(&mut raw.store_timeout, &opts.store_timeout);
    set(
        &mut raw.store_replicas_to_wait,
        &opts.store_replicas_to_wait,
    );
    set(&mut raw.store_ca, &opts.store_ca);
    set(&mut raw.store_client_cert, &opts.store_client_cert);
    set(&mut raw.store_client_key, &opts.store_client_key);
    set(&mut raw.store_password_file, &opts.store_password_file);
    set(&mut raw.store_state_file, &opts.store_state_file);
    // Only from the environment: a flag would show in `ps`.
    if let Ok(pw) = std::env::var("FENCEGATE_STORE_PASSWORD") {
        if !pw.is_empty() {
            raw.store_password = Some(fencegate::config::Secret::new(pw));
        }
    }
    if opts.access_log {
        raw.access_log = Some(true);
    }
    if opts.proxy_protocol {
        raw.proxy_protocol = Some(true);
    }
    set(&mut raw.trusted_proxies, &opts.trusted_proxies);
    if opts.accept_store_reset {
        raw.accept_store_reset = Some(true);
    }
    set(
        &mut raw.limits.header_read_timeout,
        &opts.header_read_timeout,
    );
    set(&mut raw.limits.body_read_timeout, &opts.body_read_timeout);
    set(
        &mut raw.limits.response_idle_timeout,
        &opts.response_idle_timeout,
    );
    set(&mut raw.admin_token_file, &opts.admin_token_file);
    set(&mut raw.lease_listen, &opts.lease_listen);
    set(&mut raw.lease_token_file, &opts.lease_token_file);
    set(&mut raw.max_lease_ttl, &opts.max_lease_ttl);
    set(&mut raw.limits.max_header_bytes, &opts.max_header_bytes);
    set(&mut raw.limits.max_key_bytes, &opts.max_key_bytes);
    set(&mut raw.limits.max_connections, &opts.max_connections);
    set(&mut raw.limits.max_body_bytes, &opts.max_body_bytes);
    set(&mut raw.highest_cache_entries, &opts.highest_cache_entries);
    set(&mut raw.workers, &opts.workers);
    if let Some(upstream) = &opts.upstream {
        if !raw.routes.is_empty() {
            anyhow::bail!("invalid `upstream`: the config file defines routes; give routes there or --upstream, not both");
        }
        raw.routes.push(RawRoute {
            name: Some("default".into()),
            upstream: Some(upstream.clone()),
            ..RawRoute::default()
        });
        let r = &mut raw.routes[0];
        r.key.clone_from(&opts.key);
        r.namespace.clone_from(&opts.namespace);
        r.literal_keys = opts.literal_keys.then_some(true);
        r.strip_token = opts.strip_token.then_some(true);
        r.max_token_step = opts.max_token_step;
        r.error_format.clone_from(&opts.error_format);
    } else if opts.key.is_some()
        || opts.namespace.is_some()
        || opts.literal_keys
        || opts.strip_token
        || opts.max_token_step.is_some()
        || opts.error_format.is_some()
    {
        anyhow::bail!("--key, --namespace, --literal-keys, --strip-token, --max-token-step and --error-format configure the --upstream route; set them per route in the config file");
    }
    for r in &mut raw.routes {
        set(&mut r.upstream_timeout, &opts.upstream_timeout);
        set(&mut r.connect_timeout, &opts.connect_timeout);
        set(
            &mut r.upstream_max_connections,
            &opts.upstream_max_connections,
        );
        set(&mut r.upstream_queue_timeout, &opts.upstream_queue_timeout);
    }
    let upstream_tls = [
        (&opts.upstream_ca, "--upstream-ca"),
        (&opts.upstream_client_cert, "--upstream-client-cert"),
        (&opts.upstream_client_key, "--upstream-client-key"),
    ];
    if let Some((_, flag)) = upstream_tls.iter().find(|(v, _)| v.is_some()) {
        let https = |r: &RawRoute| {
            r.upstream.as_deref().is_some_and(|u| {
                u.get(..8)
                    .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
            })
        };
        if !raw.routes.iter().any(https) {
            anyhow::bail!("{flag} applies to https:// upstreams, and no route has one");
        }
        // Every https route that does not set its own.
        for r in raw.routes.iter_mut().filter(|r| https(r)) {
            r.upstream_ca = r.upstream_ca.take().or(opts.upstream_ca.clone());
            r.upstream_client_cert = r
                .upstream_client_cert
                .take()
                .or(opts.upstream_client_cert.clone());
            r.upstream_client_key = r
                .upstream_client_key
                .take()
                .or(opts.upstream_client_key.clone());
        }
    }
    if opts.tls_listen.is_some()
        || opts.tls_cert.is_some()
        || opts.tls_key.is_some()
        || opts.tls_client_ca.is_some()
    {
        let tls = raw.tls.get_or_insert_with(Default::default);
        set(&mut tls.listen, &opts.tls_listen);
        set(&mut tls.cert, &opts.tls_cert);
        set(&mut tls.key, &opts.tls_key);
        set(&mut tls.client_ca, &opts.tls_client_ca);
    }
    Ok(raw)
}

//! The `fencegate` binary: flags and config, logging, signals.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use fencegate::config::{Config, RawConfig, RawRoute};
use fencegate::server::Server;
use tokio_util::sync::CancellationToken;

/// mimalloc instead of glibc malloc: measured in docs/benchmarks.md (the
/// proxy allocates and frees per request; glibc's free path showed up in
/// profiles).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A fencing-token reverse proxy: writes must carry X-Fence-Token, stale
/// ones are refused before they reach the backend.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    opts: Opts,
}

#[derive(Subcommand, Debug)]
enum Command {
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
enum LeaseOp {
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
struct Opts {
    /// TOML config file (routes and everything else); flags override it.
    #[arg(long, env = "FENCEGATE_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Proxy listen address (plain HTTP/1.1 and h2c); `off` for TLS only
    /// [default: 127.0.0.1:8080].
    #[arg(long, env = "FENCEGATE_LISTEN", global = true)]
    listen: Option<String>,
    /// Admin listen address (metrics, health, fence API) [default:
    /// 127.0.0.1:9090].
    #[arg(long, env = "FENCEGATE_ADMIN_LISTEN", global = true)]
    admin_listen: Option<String>,
    /// Upstream origin for a catch-all route, e.g. http://127.0.0.1:9000.
    #[arg(long, env = "FENCEGATE_UPSTREAM", global = true)]
    upstream: Option<String>,
    /// Fence store: a file path (or redb://PATH) for the embedded store, or
    /// a shared store's URL for several replicas: redis://, rediss:// or
    /// redis+sentinel://HOST:PORT[,...]/MASTER, postgres:// or postgresql://, etcd:// or etcds://HOST:PORT[,HOST:PORT...]
    /// (docs/stores.md).
    #[arg(long, env = "FENCEGATE_STORE", global = true)]
    store: Option<String>,
    /// Timeout of shared-store calls (redis://, postgres://, etcd://).
    #[arg(long, env = "FENCEGATE_STORE_TIMEOUT", global = true)]
    store_timeout: Option<String>,
    /// Redis: how many replicas must have a change before it counts as
    /// stored (WAIT after each call); 0 never waits. Default: one while the
    /// primary has a replica online, else none (docs/stores.md).
    #[arg(long, env = "FENCEGATE_STORE_REPLICAS_TO_WAIT", global = true)]
    store_replicas_to_wait: Option<u32>,
    /// PEM CA certificates for a shared store's TLS (rediss://, etcds://,
    /// PostgreSQL sslmode=verify-*), instead of the system's.
    #[arg(long, env = "FENCEGATE_STORE_CA", global = true)]
    store_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) presented to a shared store.
    #[arg(long, env = "FENCEGATE_STORE_CLIENT_CERT", global = true)]
    store_client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "FENCEGATE_STORE_CLIENT_KEY", global = true)]
    store_client_key: Option<PathBuf>,
    /// A file whose first line is the shared store's password (Redis ACL
    /// user, PostgreSQL role, etcd user). FENCEGATE_STORE_PASSWORD in the
    /// environment is the other way; a password in the URL the last.
    #[arg(long, env = "FENCEGATE_STORE_PASSWORD_FILE", global = true)]
    store_password_file: Option<PathBuf>,
    /// Accept a shared store that lost data: write back the fences this
    /// replica knows and record a new marker (see docs/stores.md).
    #[arg(long, env = "FENCEGATE_ACCEPT_STORE_RESET", global = true)]
    accept_store_reset: bool,
    /// A file of this replica's own where it keeps the latest shared-store
    /// marker it saw, so that after a restart it still refuses a store that
    /// went back while it was down (see docs/stores.md).
    #[arg(long, env = "FENCEGATE_STORE_STATE_FILE", global = true)]
    store_state_file: Option<PathBuf>,
    /// The lease API's listen address (fencegate as the lock service).
    #[arg(long, env = "FENCEGATE_LEASE_LISTEN", global = true)]
    lease_listen: Option<String>,
    /// Bearer tokens of the lease API, a `TOKEN [KEY-PREFIX ...]` per
    /// line; `fencegate lease` sends the first one.
    #[arg(long, env = "FENCEGATE_LEASE_TOKEN_FILE", global = true)]
    lease_token_file: Option<PathBuf>,
    /// The longest TTL (and wait) a lease may ask for, e.g. 60s.
    #[arg(long, env = "FENCEGATE_MAX_LEASE_TTL", global = true)]
    max_lease_ttl: Option<String>,
    /// File holding the bearer token for mutating admin endpoints.
    #[arg(long, env = "FENCEGATE_ADMIN_TOKEN_FILE", global = true)]
    admin_token_file: Option<PathBuf>,
    /// Key template of the --upstream route: path, /{bucket}, header:NAME...
    #[arg(long, env = "FENCEGATE_KEY", global = true)]
    key: Option<String>,
    /// Fence namespace of the --upstream route.
    #[arg(long, env = "FENCEGATE_NAMESPACE", global = true)]
    namespace: Option<String>,
    /// Literal keys on the --upstream route (forward the target byte for byte).
    #[arg(long, env = "FENCEGATE_LITERAL_KEYS", global = true)]
    literal_keys: bool,
    /// Do not forward X-Fence-Token upstream (--upstream route).
    #[arg(long, env = "FENCEGATE_STRIP_TOKEN", global = true)]
    strip_token: bool,
    /// Token inflation guard of the --upstream route: refuse tokens more
    /// than this above the key's highest.
    #[arg(long, env = "FENCEGATE_MAX_TOKEN_STEP", global = true)]
    max_token_step: Option<u64>,
    /// How the --upstream route writes fencegate's own refusals:
    /// `problem` (application/problem+json) or `s3` (S3's XML errors, which
    /// boto3, the aws CLI and the other S3 SDKs show as code and message).
    #[arg(long, env = "FENCEGATE_ERROR_FORMAT", global = true)]
    error_format: Option<String>,
    /// Upstream response timeout (every route), e.g. 60s.
    #[arg(long, env = "FENCEGATE_UPSTREAM_TIMEOUT", global = true)]
    upstream_timeout: Option<String>,
    /// Upstream connect timeout (every route), e.g. 5s.
    #[arg(long, env = "FENCEGATE_CONNECT_TIMEOUT", global = true)]
    connect_timeout: Option<String>,
    /// Time allowed to send a request head (and idle keep-alive time).
    #[arg(long, env = "FENCEGATE_HEADER_READ_TIMEOUT", global = true)]
    header_read_timeout: Option<String>,
    /// Longest pause between request body chunks.
    #[arg(long, env = "FENCEGATE_BODY_READ_TIMEOUT", global = true)]
    body_read_timeout: Option<String>,
    /// Largest request head, bytes (431 above).
    #[arg(long, env = "FENCEGATE_MAX_HEADER_BYTES", global = true)]
    max_header_bytes: Option<u64>,
    /// Open connections per listener; more are closed at once.
    #[arg(long, env = "FENCEGATE_MAX_CONNECTIONS", global = true)]
    max_connections: Option<u64>,
    /// Longest fence key (namespace:resource), bytes (414 above).
    #[arg(long, env = "FENCEGATE_MAX_KEY_BYTES", global = true)]
    max_key_bytes: Option<u64>,
    /// Largest request body, bytes (413 above); no limit by default.
    #[arg(long, env = "FENCEGATE_MAX_BODY_BYTES", global = true)]
    max_body_bytes: Option<u64>,
    /// Time allowed to drain in-flight requests on SIGTERM/SIGINT.
    #[arg(long, env = "FENCEGATE_SHUTDOWN_GRACE", global = true)]
    shutdown_grace: Option<String>,
    /// How many highest tokens to keep in memory.
    #[arg(long, env = "FENCEGATE_HIGHEST_CACHE_ENTRIES", global = true)]
    highest_cache_entries: Option<u64>,
    /// Worker threads, each with its own listeners (SO_REUSEPORT) and
    /// upstream pools [default: the CPUs this process may use: its affinity
    /// mask, capped by its cgroup CPU quota].
    #[arg(long, env = "FENCEGATE_WORKERS", global = true)]
    workers: Option<u64>,
    /// TLS listen address (HTTP/1.1 and HTTP/2 by ALPN); needs --tls-cert
    /// and --tls-key.
    #[arg(long, env = "FENCEGATE_TLS_LISTEN", global = true)]
    tls_listen: Option<String>,
    /// PEM certificate chain of the TLS listener (reloaded when it changes).
    #[arg(long, env = "FENCEGATE_TLS_CERT", global = true)]
    tls_cert: Option<PathBuf>,
    /// PEM private key of the TLS listener.
    #[arg(long, env = "FENCEGATE_TLS_KEY", global = true)]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this PEM CA bundle (mTLS).
    #[arg(long, env = "FENCEGATE_TLS_CLIENT_CA", global = true)]
    tls_client_ca: Option<PathBuf>,
    /// PEM CA bundle for https upstreams, instead of the system's roots.
    #[arg(long, env = "FENCEGATE_UPSTREAM_CA", global = true)]
    upstream_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to https upstreams.
    #[arg(long, env = "FENCEGATE_UPSTREAM_CLIENT_CERT", global = true)]
    upstream_client_cert: Option<PathBuf>,
    /// Private key of --upstream-client-cert.
    #[arg(long, env = "FENCEGATE_UPSTREAM_CLIENT_KEY", global = true)]
    upstream_client_key: Option<PathBuf>,
    /// Log one line per request (target fencegate::access).
    #[arg(long, env = "FENCEGATE_ACCESS_LOG", global = true)]
    access_log: bool,
    /// Every connection to the plain listener starts with a PROXY protocol
    /// header (v1 or v2) from a load balancer in --trusted-proxies.
    #[arg(long, env = "FENCEGATE_PROXY_PROTOCOL", global = true)]
    proxy_protocol: bool,
    /// Load balancers and proxies trusted to name the client (PROXY
    /// headers, X-Forwarded-For): addresses or CIDR ranges, comma-separated.
    #[arg(
        long,
        env = "FENCEGATE_TRUSTED_PROXIES",
        value_delimiter = ',',
        global = true
    )]
    trusted_proxies: Option<Vec<String>>,
    /// Log format.
    #[arg(long, env = "FENCEGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
}

#[derive(ValueEnum, Clone, Copy, Debug, Default)]
enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Merges flags over the file (or over nothing, for the quick start).
fn raw_config(opts: &Opts, file: Option<&PathBuf>) -> anyhow::Result<RawConfig> {
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

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FENCEGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a terminal: a log file or journal gets no
        // escape codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Reads the config file again and applies the flags over it, as at start.
fn load_config(opts: &Opts, file: Option<&PathBuf>) -> anyhow::Result<Config> {
    raw_config(opts, file).and_then(|raw| Config::try_from(raw).map_err(anyhow::Error::from))
}

async fn run(
    config: Config,
    reload: Arc<dyn Fn() -> anyhow::Result<Config> + Send + Sync>,
) -> anyhow::Result<bool> {
    use tokio::signal::unix::{signal, SignalKind};
    // Handlers first: until a signal has one, its default action kills the
    // process, and a SIGHUP (systemd ExecReload, logrotate) during a slow
    // store open would be an unclean stop.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let shutdown = CancellationToken::new();
    let server = Server::start(config, shutdown.clone()).await?;
    // One machine-readable line on stdout with the bound addresses (useful
    // with port 0); logs go to stderr.
    let tls = server
        .tls_addr
        .map(|a| format!(" tls={a}"))
        .unwrap_or_default();
    let proxy = server
        .proxy_addr
        .map_or("off".to_string(), |a| a.to_string());
    let lease = server
        .lease_addr
        .map(|a| format!(" lease={a}"))
        .unwrap_or_default();
    println!(
        "listening proxy={proxy} admin={}{tls}{lease}",
        server.admin_addr
    );
    let signals = {
        let shutdown = shutdown.clone();
        let reloader = server.reloader();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received"),
                    _ = int.recv() => tracing::info!("SIGINT received"),
                    _ = hup.recv() => {
                        tracing::info!("SIGHUP received: reloading the config");
                        // Reading and checking files (certificates, CA
                        // bundles) blocks: keep it off the runtime threads.
                        let reload = reload.clone();
                        match tokio::task::spawn_blocking(move || reload()).await {
                            Ok(Ok(config)) => {
                                for warning in &config.warnings {
                                    tracing::warn!("{warning}");
                                }
                                let _ = reloader.reload(&config).await;
                            }
                            Ok(Err(e)) => reloader.refused(&format!("{e:#}")),
                            Err(e) => reloader.refused(&format!("reload task failed: {e}")),
                        }
                        continue;
                    }
                }
                break;
            }
            shutdown.cancel();
        })
    };
    let clean = server.wait().await;
    signals.abort();
    Ok(clean)
}

/// Runs a one-shot subcommand's future on a single-threaded runtime.
fn block_on(f: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(f),
        Err(e) => {
            eprintln!("fencegate: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `fencegate init-store`: marks the shared store named by `--store` (or
/// the config file) as fencegate's. Exit 0 if it is marked afterwards.
fn init_store(opts: &Opts) -> ExitCode {
    use fencegate::config::StoreConfig;
    let store = raw_config(opts, opts.config.as_ref())
        .and_then(|raw| fencegate::config::store(&raw).map_err(anyhow::Error::from));
    let shared = match store {
        Ok(StoreConfig::Shared(s)) => s,
        Ok(StoreConfig::Embedded { path, .. }) => {
            println!(
                "{} is an embedded store: it is created at the first start, nothing to do",
                path.display()
            );
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("fencegate: {e:#}");
            return ExitCode::from(2);
        }
    };
    block_on(async {
        let result = async {
            let store = fencegate::store::connect_shared(&shared, None)?;
            Ok::<_, anyhow::Error>(store.initialise().await?)
        }
        .await;
        match result {
            Ok(true) => {
                println!("initialised {}", shared.redacted_url());
                ExitCode::SUCCESS
            }
            Ok(false) => {
                println!(
                    "{} is initialised already; nothing changed",
                    shared.redacted_url()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fencegate init-store: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}

/// `s` with control characters escaped: a decoded key may hold them, and
/// they are never sent to a terminal raw.
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `fencegate explain PATH`: exit 0 when a write there has a fence key, 1
/// when it would be refused (and why), 2 on bad arguments.
fn explain(
    config: &Config,
    target: &str,
    host: Option<&str>,
    header_args: &[String],
    json: bool,
) -> ExitCode {
    let mut headers = http::HeaderMap::new();
    for h in header_args {
        let Some((n, v)) = fencegate::routing::parse_header(h) else {
            eprintln!("fencegate explain: --header {h:?} is not `NAME: VALUE`");
            return ExitCode::from(2);
        };
        headers.append(n, v);
    }
    let explained = match fencegate::routing::explain(
        &config.routes,
        host,
        target,
        &headers,
        config.limits.max_key_bytes,
    ) {
        Ok(e) => e,
        Err(e) => {
            eprintln!(
                "fencegate explain: refused ({}): {}",
                e.status().as_u16(),
                printable(&e.to_string())
            );
            return ExitCode::FAILURE;
        }
    };
    if json {
        println!("{}", explained.to_json());
    } else {
        let r = &explained.route;
        println!(
            "route     {} (host {}, path prefix {})",
            r.name,
            r.host.as_deref().unwrap_or("any"),
            r.path_prefix
        );
        println!(
            "template  {} (namespace {}, {} keys)",
            r.key,
            r.namespace,
            if r.literal_keys {
                "literal"
            } else {
                "canonical"
            }
        );
        println!(
            "upstream  {}{}",
            r.upstream,
            printable(&explained.upstream_target)
        );
        match &explained.key {
            Ok(k) => println!("key       {}", printable(k)),
            Err(e) => println!(
                "refused   {}: {}",
                e.status().as_u16(),
                printable(&e.to_string())
            ),
        }
    }
    if explained.key.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `fencegate probe URL`: exit 0 on 2xx within 5 s.
fn probe(url: &str) -> ExitCode {
    use http_body_util::Empty;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    block_on(async {
        let Ok(uri) = url.parse::<http::Uri>() else {
            eprintln!("fencegate probe: `{url}` is not a URL");
            return ExitCode::from(2);
        };
        let client: Client<_, Empty<bytes::Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        match tokio::time::timeout(std::time::Duration::from_secs(5), client.get(uri)).await {
            Ok(Ok(resp)) if resp.status().is_success() => ExitCode::SUCCESS,
            Ok(Ok(resp)) => {
                eprintln!("fencegate probe: {}", resp.status());
                ExitCode::FAILURE
            }
            Ok(Err(e)) => {
                eprintln!("fencegate probe: {}", fencegate::error::error_chain(&e));
                ExitCode::FAILURE
            }
            Err(_) => {
                eprintln!("fencegate probe: timed out");
                ExitCode::FAILURE
            }
        }
    })
}

/// `fencegate lease ...`: one request to the lease API.
fn lease(op: &LeaseOp, url: Option<&str>, opts: &Opts) -> ExitCode {
    use fencegate::lease::client::{call, read_token, ClientError};
    use serde_json::json;
    let fail = |e: ClientError| {
        eprintln!("fencegate lease: {e}");
        ExitCode::from(e.exit_code())
    };
    let Some(url) = url else {
        eprintln!("fencegate lease: give the lease API's URL (--lease-url or FENCEGATE_LEASE_URL)");
        return ExitCode::from(2);
    };
    let Some(file) = &opts.lease_token_file else {
        eprintln!("fencegate lease: give the bearer token's file (--lease-token-file or FENCEGATE_LEASE_TOKEN_FILE)");
        return ExitCode::from(2);
    };
    let token = match read_token(file) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let millis = |flag: &str, text: &str| {
        let d = fencegate::config::parse_duration(text).map_err(|e| format!("--{flag}: {e}"))?;
        if d.subsec_nanos() % 1_000_000 != 0 {
            return Err(format!(
                "--{flag}: `{text}` is not a whole number of milliseconds"
            ));
        }
        Ok(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    };
    let request = match op {
        LeaseOp::Acquire {
            key,
            path,
            request_host,
            ttl,
            holder,
            wait,
        } => {
            let holder = holder.clone().unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_default();
                format!("{host}:{}", std::process::id())
            });
            let mut body = json!({"holder": holder});
            match (key, path) {
                (Some(k), None) => body["key"] = json!(k),
                (None, Some(p)) => {
                    body["path"] = json!(p);
                    if let Some(h) = request_host {
                        body["host"] = json!(h);
                    }
                }
                _ => {
                    eprintln!("fencegate lease acquire: give a KEY or --path, one of them");
                    return ExitCode::from(2);
                }
            }
            let wait_ms = match wait.as_deref().map(|w| millis("wait", w)).transpose() {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("fencegate lease acquire: {e}");
                    return ExitCode::from(2);
                }
            };
            match millis("ttl", ttl) {
                Ok(t) => body["ttl_ms"] = json!(t),
                Err(e) => {
                    eprintln!("fencegate lease acquire: {e}");
                    return ExitCode::from(2);
                }
            }
            if let Some(w) = wait_ms {
                body["wait_ms"] = json!(w);
            }
            let limit = Duration::from_millis(wait_ms.unwrap_or(0)) + Duration::from_secs(10);
            (
                http::Method::POST,
                "/v1/leases".to_string(),
                Some(body),
                limit,
            )
        }
        LeaseOp::Renew { lease, ttl } => match millis("ttl", ttl) {
            Ok(t) => (
                http::Method::POST,
                format!("/v1/leases/{lease}/renew"),
                Some(json!({ "ttl_ms": t })),
                Duration::from_secs(10),
            ),
            Err(e) => {
                eprintln!("fencegate lease renew: {e}");
                return ExitCode::from(2);
            }
        },
        LeaseOp::Release { lease } => (
            http::Method::DELETE,
            format!("/v1/leases/{lease}"),
            None,
            Duration::from_secs(10),
        ),
    };
    let (method, path, body, limit) = request;
    block_on(async move {
        match call(url, &token, method, &path, body, limit).await {
            Ok(answer) => {
                let field = |f: &str| answer.get(f).and_then(|v| v.as_str()).unwrap_or("");
                if !matches!(op, LeaseOp::Release { .. }) {
                    println!("{} {}", field("lease"), field("token"));
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        }
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Probe { url }) = &cli.command {
        return probe(url);
    }
    if let Some(Command::Lease { op, lease_url }) = &cli.command {
        return lease(op, lease_url.as_deref(), &cli.opts);
    }
    init_logging(cli.opts.log_format);
    if let Some(Command::InitStore) = &cli.command {
        return init_store(&cli.opts);
    }
    let file = match &cli.command {
        Some(Command::CheckConfig { file }) => Some(file),
        _ => cli.opts.config.as_ref(),
    };
    let config = match load_config(&cli.opts, file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fencegate: {e:#}");
            return ExitCode::from(2);
        }
    };
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    if let Some(Command::CheckConfig { .. }) = cli.command {
        print!("{}", config.to_toml());
        return ExitCode::SUCCESS;
    }
    if let Some(Command::Explain {
        path,
        request_host,
        headers,
        json,
    }) = &cli.command
    {
        return explain(&config, path, request_host.as_deref(), headers, *json);
    }
    // A proxy holds two descriptors per request (client and upstream): a
    // soft limit of 1024 would cap it long before the hard limit does.
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => tracing::debug!(nofile = n, "file-descriptor limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the file-descriptor limit"),
    }
    // The proxy listeners run on worker threads of their own
    // (`fencegate::workers`); this runtime has the admin listener, signals
    // and background tasks.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fencegate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let file = file.cloned();
    let opts = cli.opts;
    let reload = Arc::new(move || {
        if file.is_none() {
            // Flags and environment were read once, at start.
            tracing::info!("no config file: the start-up flags apply again; certificate, CA and token files are reread");
        }
        load_config(&opts, file.as_ref())
    });
    match runtime.block_on(run(config, reload)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(3),
        Err(e) => {
            eprintln!("fencegate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

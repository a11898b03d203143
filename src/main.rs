//! The `fencegate` binary: flags and config, logging, signals.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use fencegate::config::Config;
use fencegate::server::Server;
use tokio_util::sync::CancellationToken;

mod cli;

use cli::commands::*;
use cli::opts::*;

/// mimalloc instead of glibc malloc: measured in docs/benchmarks.md (the
/// proxy allocates and frees per request; glibc's free path showed up in
/// profiles).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FENCEGATE_LOG")
        // The Redis Cluster client warns of every slot refresh, which
        // resharding and failover make routine; fencegate logs what
        // failed for a write itself.
        .unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new("info,redis::cluster_handling=error")
        });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A failed write of a log line is not reported on stderr again:
        // tracing-subscriber does that with eprintln!, which panics when
        // stderr is a closed pipe (a log reader restarted), and the panic
        // hook's own write then aborted the process.
        .log_internal_errors(false)
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

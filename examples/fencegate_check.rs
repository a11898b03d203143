//! Runs the history checker against your own fencegate deployment.
//!
//! ```sh
//! cargo run --release --example fencegate_check -- \
//!     --proxy http://127.0.0.1:8080,http://127.0.0.1:8081 \
//!     --backend 127.0.0.1:9999 --secs 60
//! ```
//!
//! It starts the recording backend on `--backend`: first point the route
//! your clients use at it (`upstream = "http://127.0.0.1:9999"`), with the
//! key template `path`. Then eight clients take leases from an in-process
//! lock service (150 ms leases) or from etcd (`--etcd http://host:2379`,
//! 2 s leases, revisions as tokens), pause past them, and write through the
//! replicas; the history is checked as in `tests/history.rs` (docs/reliability.md).
//! Keys live under a fresh prefix per run, so runs do not interfere with
//! each other or with the deployment's other keys. Inject your own faults
//! (restart replicas, the store) while it runs. Exit code 0: no violation.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::history::*;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() {
    let Some(proxies) = arg("--proxy") else {
        eprintln!("usage: fencegate_check --proxy URL[,URL...] [--backend ADDR] [--secs N] [--seed N] [--etcd URL]");
        std::process::exit(2);
    };
    let replicas = proxies
        .split(',')
        .map(|u| {
            u.trim()
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .parse()
                .unwrap_or_else(|_| panic!("`{u}` is not http://IP:PORT"))
        })
        .collect();
    let backend = arg("--backend").unwrap_or_else(|| "127.0.0.1:9999".into());
    let secs: u64 = arg("--secs").and_then(|s| s.parse().ok()).unwrap_or(60);
    let seed: u64 = arg("--seed")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(common::history::clock_seed);
    let up = common::start_upstream_on(&backend).await;
    eprintln!(
        "recording backend on {}; running {secs}s against {proxies}",
        up.addr
    );
    let locks = match arg("--etcd") {
        Some(endpoint) => LockService::Etcd(EtcdLocks {
            endpoint,
            ttl_secs: 2,
            latest: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
        }),
        None => LockService::in_test(),
    };
    let run = Arc::new(Run {
        attempts: Mutex::new(Vec::new()),
        replicas: RwLock::new(replicas),
        locks,
        seq: AtomicU64::new(0),
        deadline: Instant::now() + Duration::from_secs(secs),
        prefix: format!("/fencegate-check/{seed}"),
        pause_percent: 25,
        routes: vec![(String::new(), 200)],
        long_percent: 10,
    });
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(client_loop(run.clone(), c, seed)))
        .collect();
    for c in clients {
        c.await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let attempts = run.attempts.lock().unwrap().clone();
    let records = up.records();
    let report = Report::new(&attempts, &records, 0);
    println!("{}", report.line("deployment", seed));
    if let Err(why) = check(&attempts, &records) {
        let kept = keep_failure("deployment", seed, &attempts, &records, &why);
        eprintln!("VIOLATION (history kept in {kept}):\n{why}");
        std::process::exit(1);
    }
    if report.stale_attempts == 0 || report.refused_409 == 0 {
        eprintln!("no stale holder was exercised: run longer");
        std::process::exit(3);
    }
    println!("no violation");
}

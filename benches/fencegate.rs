//! Micro-benchmarks of the hot paths: token parsing, key canonicalization,
//! admission (steady token from the cache, new-key advance) and the embedded
//! store's advance with and without group commit.
//!
//! `cargo bench` runs them; speed is never asserted in tests.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use fencegate::fence::Fence;
use fencegate::key::canonicalize;
use fencegate::store::embedded::EmbeddedStore;
use fencegate::store::FenceStore;
use fencegate::token::parse_token;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn store(dir: &tempfile::TempDir) -> Arc<EmbeddedStore> {
    Arc::new(
        EmbeddedStore::open(
            &dir.path().join("bench.redb"),
            64 << 20,
            Duration::from_secs(1),
        )
        .unwrap(),
    )
}

fn token(c: &mut Criterion) {
    let mut g = c.benchmark_group("token");
    for (name, raw) in [
        ("small", &b"42"[..]),
        ("u64_max", b"18446744073709551615"),
        ("padded", b"  123456789 "),
    ] {
        g.bench_function(name, |b| b.iter(|| parse_token(black_box(raw))));
    }
    g.finish();
}

fn key(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    for (name, target) in [
        ("plain", "/bucket/reports/2026/11/summary.csv"),
        (
            "escaped",
            "/bucket/r%65ports/2026/caf%C3%A9%20menu.txt?versionId=3",
        ),
        ("refused", "/bucket/../etc/passwd"),
    ] {
        g.bench_function(name, |b| b.iter(|| canonicalize(black_box(target))));
    }
    g.finish();
}

fn admission(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let fence = Fence::new(store(&dir), 1_000_000, Duration::from_secs(1));
    let deadline = || tokio::time::Instant::now() + Duration::from_secs(5);
    rt.block_on(async {
        drop(
            fence
                .admit("bench:/steady", 7, deadline(), Duration::from_secs(60))
                .await
                .unwrap(),
        )
    });
    let mut g = c.benchmark_group("admission");
    g.bench_function("steady_token_cached", |b| {
        b.to_async(&rt).iter(|| async {
            drop(
                fence
                    .admit("bench:/steady", 7, deadline(), Duration::from_secs(60))
                    .await
                    .unwrap(),
            )
        })
    });
    let n = AtomicU64::new(0);
    g.bench_function("new_key_advance", |b| {
        b.to_async(&rt).iter(|| async {
            let key = format!("bench:/new/{}", n.fetch_add(1, Ordering::Relaxed));
            drop(
                fence
                    .admit(&key, 1, deadline(), Duration::from_secs(60))
                    .await
                    .unwrap(),
            )
        })
    });
    g.finish();
}

fn store_advance(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let s = store(&dir);
    let n = Arc::new(AtomicU64::new(0));
    let mut g = c.benchmark_group("embedded_store_advance");
    g.sample_size(20);
    // One advance at a time: every advance pays its own fsync.
    g.throughput(Throughput::Elements(1));
    g.bench_function("sequential", |b| {
        b.to_async(&rt).iter(|| async {
            let k = format!("s{}", n.fetch_add(1, Ordering::Relaxed));
            s.advance(&k, 1).await.unwrap()
        })
    });
    // 64 at once: group commit lets them share fsyncs.
    const BATCH: u64 = 64;
    g.throughput(Throughput::Elements(BATCH));
    g.bench_function("concurrent_64", |b| {
        b.iter_batched(
            || (),
            |()| {
                rt.block_on(async {
                    let tasks: Vec<_> = (0..BATCH)
                        .map(|_| {
                            let (s, n) = (s.clone(), n.clone());
                            tokio::spawn(async move {
                                let k = format!("c{}", n.fetch_add(1, Ordering::Relaxed));
                                s.advance(&k, 1).await.unwrap()
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.unwrap();
                    }
                })
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, token, key, admission, store_advance);
criterion_main!(benches);

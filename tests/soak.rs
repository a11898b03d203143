//! Soak: a bounded run (30 s by default, `SOAK_SECS` to change) of mixed
//! reads, writes, stale writes, clients that hang up mid-body and a slow
//! backend, through one fencegate. At the end its memory and open file
//! descriptors are back where they were after warm-up, and nothing was lost:
//! every 2xx write was applied, no refused write was.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn soak_keeps_memory_and_descriptors_flat_and_loses_nothing() {
    let secs: u64 = std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "2s"])
        .spawn();
    let pid = p.child.id();
    let addr = p.addr;
    let deadline = Instant::now() + Duration::from_secs(secs);
    let warm_at = Instant::now() + Duration::from_secs(secs / 5);
    let highest: Arc<Vec<AtomicU64>> = Arc::new((0..50).map(|_| AtomicU64::new(0)).collect());
    let outcomes: Arc<Mutex<Vec<(String, u16)>>> = Arc::new(Mutex::new(Vec::new()));
    let seq = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..16u64)
        .map(|w| {
            let (highest, outcomes, seq) = (highest.clone(), outcomes.clone(), seq.clone());
            tokio::spawn(async move {
                let mut n = w;
                while Instant::now() < deadline {
                    n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let key = (n >> 33) % 50;
                    let url = format!("http://{addr}/soak/{key}");
                    match (n >> 20) % 10 {
                        0..=2 => {
                            let _ = send("GET", &url, &[], "").await;
                        }
                        3 => {
                            // A client that hangs up in the middle of its body.
                            use tokio::io::AsyncWriteExt;
                            if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                                let h = highest[key as usize].load(Ordering::SeqCst) + 1;
                                let head = format!("PUT /soak/{key} HTTP/1.1\r\nHost: x\r\nX-Fence-Token: {h}\r\nX-Write-Id: cut\r\nContent-Length: 100\r\n\r\nhalf");
                                let _ = s.write_all(head.as_bytes()).await;
                            }
                        }
                        4 => {
                            // A stale holder.
                            let h = highest[key as usize].load(Ordering::SeqCst);
                            if h > 1 {
                                let id = format!("s{}", seq.fetch_add(1, Ordering::Relaxed));
                                let a = send("PUT", &url, &[("x-fence-token", &(h - 1).to_string()), ("x-write-id", &id)], "stale").await;
                                outcomes.lock().unwrap().push((id, a.status.as_u16()));
                            }
                        }
                        _ => {
                            let t = highest[key as usize].fetch_add((n >> 40) % 2, Ordering::SeqCst) + (n >> 40) % 2;
                            let id = format!("w{}", seq.fetch_add(1, Ordering::Relaxed));
                            let delay = if (n >> 50) % 20 == 0 { "300" } else { "0" };
                            let a = send(
                                "PUT",
                                &url,
                                &[("x-fence-token", &t.max(1).to_string()), ("x-write-id", &id), ("x-test-delay-ms", delay)],
                                "payload",
                            )
                            .await;
                            outcomes.lock().unwrap().push((id, a.status.as_u16()));
                        }
                    }
                }
            })
        })
        .collect();
    while Instant::now() < warm_at {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (warm_rss, warm_fds) = (rss_kib(pid), open_fds(pid));
    for w in workers {
        w.await.unwrap();
    }
    // Connections of the last requests close; the pool idles out.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (end_rss, end_fds) = (rss_kib(pid), open_fds(pid));
    let outcomes = outcomes.lock().unwrap().clone();
    let applied: std::collections::HashSet<String> = up
        .records()
        .iter()
        .filter_map(|r| {
            r.headers
                .get("x-write-id")
                .map(|v| v.to_str().unwrap().to_string())
        })
        .collect();
    let ok = outcomes
        .iter()
        .filter(|(_, s)| (200..300).contains(s))
        .count();
    let refused = outcomes.iter().filter(|(_, s)| *s == 409).count();
    eprintln!(
        "soak {secs}s: {} writes ({ok} 2xx, {refused} refused stale), RSS {} -> {} KiB, fds {warm_fds} -> {end_fds}",
        outcomes.len(),
        warm_rss,
        end_rss
    );
    for (id, status) in &outcomes {
        if (200..300).contains(status) {
            assert!(
                applied.contains(id),
                "{id} answered {status} but was not applied"
            );
        } else {
            assert!(
                !applied.contains(id),
                "{id} answered {status} but was applied"
            );
        }
    }
    assert!(!applied.contains("cut"), "a cut-off body was applied");
    assert!(
        ok > 100 && refused > 10,
        "the soak did too little to mean anything"
    );
    assert!(
        end_rss <= warm_rss * 3 / 2 + 8 * 1024,
        "RSS grew from {warm_rss} to {end_rss} KiB"
    );
    assert!(
        end_fds <= warm_fds + 8,
        "file descriptors grew from {warm_fds} to {end_fds}"
    );
}

//! Fills an embedded store file with N fenced keys, for the scale
//! measurements in scripts/scale.sh: `cargo run --release --example populate
//! -- FILE N`. Keys are `default:/scale/<i>` with token `i + 1`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::store::embedded::EmbeddedStore;
use fencegate::store::FenceStore;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(file), Some(n)) = (args.next(), args.next()) else {
        eprintln!("usage: populate FILE N");
        std::process::exit(2);
    };
    let n: u64 = n.parse().expect("N is a number");
    let store = Arc::new(
        EmbeddedStore::open(file.as_ref(), 64 << 20, Duration::from_secs(1)).expect("open store"),
    );
    let started = Instant::now();
    // 256 writers keep the group commit full.
    let writers: Vec<_> = (0..256u64)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut i = w;
                while i < n {
                    store
                        .advance(&format!("default:/scale/{i}"), i + 1)
                        .await
                        .expect("advance");
                    i += 256;
                }
            })
        })
        .collect();
    for w in writers {
        w.await.expect("writer");
    }
    store.close_clean().await.expect("clean close");
    println!("{n} keys in {:.1}s", started.elapsed().as_secs_f64());
}

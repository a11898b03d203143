//! Group commit at the client: concurrent operations of one replica share
//! one round trip to a shared store, as concurrent writes to the embedded
//! store share one fsync.
//!
//! No timer is involved. At most `parallel` batches are out at once; an
//! operation that finds a free slot goes out at once (a batch of one, so a
//! lone write pays no extra latency), and operations that arrive while every
//! slot is busy queue up and leave together as the next batch. Under load
//! the batches grow by themselves, and the server commits (fsyncs, runs
//! Raft, runs a script) once per batch instead of once per operation.
//!
//! A batch never holds two operations on one key (etcd refuses a
//! transaction that writes a key twice, and one answer per key keeps each
//! answer exactly what the operation alone would have got): the second
//! waits for the next batch. Each operation gets its own answer; a failed
//! round trip fails every operation of its batch with the same error.
//!
//! Batches run on tasks of their own, not in the caller's future: a caller
//! that gives up (a client hung up) must not cancel the others' round trip.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::api::StoreError;

/// The most operations in one batch (etcd's default `--max-txn-ops` is 128
/// per transaction level; a batch is one level).
pub const MAX_BATCH: usize = 64;

/// One queued operation: its key (distinct within a batch), its request,
/// and where its answer goes.
struct Pending<Req, Ans> {
    key: String,
    req: Req,
    answer: oneshot::Sender<Result<Ans, StoreError>>,
}

struct Queue<Req, Ans> {
    waiting: VecDeque<Pending<Req, Ans>>,
    /// Batches out now.
    running: usize,
}

type RunFuture<Ans> =
    Pin<Box<dyn Future<Output = Result<Vec<Result<Ans, StoreError>>, StoreError>> + Send>>;

/// Sends one batch: one answer per request, in order.
pub type Run<Req, Ans> = Arc<dyn Fn(Vec<Req>) -> RunFuture<Ans> + Send + Sync>;

/// Queues operations of one kind and sends them in batches.
pub struct Batcher<Req, Ans> {
    queue: Mutex<Queue<Req, Ans>>,
    parallel: usize,
    run: Run<Req, Ans>,
    /// Batch sizes, for the `fencegate_store_batch_size` histogram.
    sizes: Option<prometheus::Histogram>,
    /// The batch tasks: waited for when the store closes.
    tasks: tokio_util::task::TaskTracker,
}

impl<Req: Send + 'static, Ans: Send + 'static> Batcher<Req, Ans> {
    /// `parallel`: batches out at once (the connections the backend can use
    /// at once, or the depth it pipelines).
    pub fn new(
        parallel: usize,
        run: Run<Req, Ans>,
        sizes: Option<prometheus::Histogram>,
    ) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                running: 0,
            }),
            parallel: parallel.max(1),
            run,
            sizes,
            tasks: tokio_util::task::TaskTracker::new(),
        })
    }

    /// Sends `req` (an operation on `key`) with the next batch and waits for
    /// its answer.
    pub async fn call(self: &Arc<Self>, key: &str, req: Req) -> Result<Ans, StoreError> {
        let (answer, rx) = oneshot::channel();
        let batch = {
            let mut q = self.queue.lock().expect("batch queue");
            q.waiting.push_back(Pending {
                key: key.to_string(),
                req,
                answer,
            });
            if q.running < self.parallel {
                q.running += 1;
                Some(Self::take(&mut q))
            } else {
                None
            }
        };
        if let Some(batch) = batch {
            let me = self.clone();
            self.tasks.spawn(me.drive(batch));
        }
        rx.await.unwrap_or(Err(StoreError::Closed))
    }

    /// The next batch: queued operations in order, one per key, at most
    /// [`MAX_BATCH`].
    fn take(q: &mut Queue<Req, Ans>) -> Vec<Pending<Req, Ans>> {
        let mut keys = HashSet::new();
        let mut batch = Vec::new();
        let mut left = VecDeque::new();
        while let Some(p) = q.waiting.pop_front() {
            // Its caller gave up (a client hung up): not sent at all, so
            // that nothing lands after the release its caller sent.
            if p.answer.is_closed() {
                continue;
            }
            if batch.len() < MAX_BATCH && keys.insert(p.key.clone()) {
                batch.push(p);
            } else {
                left.push_back(p);
                if batch.len() >= MAX_BATCH {
                    break;
                }
            }
        }
        left.append(&mut q.waiting);
        q.waiting = left;
        batch
    }

    /// Sends batches until nothing is queued, then frees its slot.
    async fn drive(self: Arc<Self>, mut batch: Vec<Pending<Req, Ans>>) {
        // Frees the slot however the task ends (a panic in a backend, the
        // runtime stopping), so that later calls still get a batch out.
        struct Slot<'a, Req, Ans>(&'a Batcher<Req, Ans>, bool);
        impl<Req, Ans> Drop for Slot<'_, Req, Ans> {
            fn drop(&mut self) {
                if !self.1 {
                    if let Ok(mut q) = self.0.queue.lock() {
                        q.running -= 1;
                    }
                }
            }
        }
        let mut slot = Slot(&self, false);
        loop {
            if let Some(h) = &self.sizes {
                h.observe(batch.len() as f64);
            }
            let (reqs, answers): (Vec<Req>, Vec<_>) =
                batch.into_iter().map(|p| (p.req, p.answer)).unzip();
            let n = answers.len();
            let results = (self.run)(reqs).await.and_then(|r| {
                if r.len() == n {
                    Ok(r)
                } else {
                    Err(StoreError::Unavailable(format!(
                        "a batch of {n} operations got {} answers",
                        r.len()
                    )))
                }
            });
            match results {
                Ok(results) => {
                    for (tx, r) in answers.into_iter().zip(results) {
                        let _ = tx.send(r);
                    }
                }
                Err(e) => {
                    for tx in answers {
                        let _ = tx.send(Err(e.clone()));
                    }
                }
            }
            let mut q = self.queue.lock().expect("batch queue");
            batch = Self::take(&mut q);
            if batch.is_empty() {
                q.running -= 1;
                slot.1 = true;
                return;
            }
        }
    }

    /// Waits for the batches out now (at most `bound`).
    pub async fn settle(&self, bound: std::time::Duration) {
        self.tasks.close();
        let _ = tokio::time::timeout(bound, self.tasks.wait()).await;
        self.tasks.reopen();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A run that answers each request with itself doubled after a pause,
    /// and records the batches it saw.
    fn doubling(seen: Arc<Mutex<Vec<Vec<u32>>>>) -> Run<u32, u32> {
        Arc::new(move |reqs: Vec<u32>| {
            let seen = seen.clone();
            Box::pin(async move {
                seen.lock().unwrap().push(reqs.clone());
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok(reqs.into_iter().map(|r| Ok(r * 2)).collect())
            })
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_call_goes_at_once_and_queued_calls_share_the_next_batch() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let b = Batcher::new(1, doubling(seen.clone()), None);
        let first = tokio::spawn({
            let b = b.clone();
            async move { b.call("a", 1).await }
        });
        tokio::task::yield_now().await;
        let rest: Vec<_> = (2..=5u32)
            .map(|i| {
                let b = b.clone();
                tokio::spawn(async move { b.call(&format!("k{i}"), i).await })
            })
            .collect();
        assert_eq!(first.await.unwrap().unwrap(), 2);
        for (i, t) in (2..=5u32).zip(rest) {
            assert_eq!(t.await.unwrap().unwrap(), i * 2, "each gets its own answer");
        }
        assert_eq!(*seen.lock().unwrap(), vec![vec![1], vec![2, 3, 4, 5]]);
    }

    #[tokio::test(start_paused = true)]
    async fn one_key_appears_once_per_batch_and_batches_are_bounded() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let b = Batcher::new(1, doubling(seen.clone()), None);
        let blocker = tokio::spawn({
            let b = b.clone();
            async move { b.call("x", 0).await }
        });
        tokio::task::yield_now().await;
        let mut tasks = Vec::new();
        for i in 1..=3u32 {
            let b = b.clone();
            tasks.push(tokio::spawn(async move { b.call("same", i).await }));
        }
        for i in 0..(MAX_BATCH as u32 + 5) {
            let b = b.clone();
            tasks.push(tokio::spawn(async move {
                b.call(&format!("n{i}"), 100 + i).await
            }));
        }
        blocker.await.unwrap().unwrap();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let seen = seen.lock().unwrap();
        assert!(seen.iter().all(|b| b.len() <= MAX_BATCH));
        // A key met again is left for a later batch, and the batch still
        // fills up with the other keys.
        assert_eq!(
            seen[1].len(),
            MAX_BATCH,
            "the batch after the blocker is full"
        );
        for b in seen.iter() {
            let same = b.iter().filter(|r| (1..=3).contains(*r)).count();
            assert!(same <= 1, "a key twice in one batch: {b:?}");
        }
        // The key's operations keep their order across batches.
        let order: Vec<u32> = seen
            .iter()
            .flatten()
            .copied()
            .filter(|r| (1..=3).contains(r))
            .collect();
        assert_eq!(order, vec![1, 2, 3]);
    }

    /// Closing waits for the batch that is out (within its bound).
    #[tokio::test(start_paused = true)]
    async fn settle_waits_for_the_batch_out() {
        let done = Arc::new(AtomicUsize::new(0));
        let run: Run<u32, u32> = {
            let done = done.clone();
            Arc::new(move |reqs: Vec<u32>| {
                let done = done.clone();
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    done.fetch_add(1, Ordering::SeqCst);
                    Ok(reqs.into_iter().map(Ok).collect())
                })
            })
        };
        let b = Batcher::new(1, run, None);
        let out = tokio::spawn({
            let b = b.clone();
            async move { b.call("a", 1).await }
        });
        tokio::task::yield_now().await;
        b.settle(Duration::from_secs(5)).await;
        assert_eq!(
            done.load(Ordering::SeqCst),
            1,
            "settled before the batch ended"
        );
        assert_eq!(out.await.unwrap().unwrap(), 1);
    }

    /// A batch that ended frees its slot, whether its round trip returned
    /// or panicked: later calls, one at a time, each get a batch out.
    #[tokio::test(start_paused = true)]
    async fn the_slot_is_freed_after_every_batch_and_after_a_panic() {
        let calls = Arc::new(AtomicUsize::new(0));
        let run: Run<u32, u32> = {
            let calls = calls.clone();
            Arc::new(move |reqs: Vec<u32>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    assert_ne!(n, 2, "a backend that panics");
                    Ok(reqs.into_iter().map(Ok).collect())
                })
            })
        };
        let b = Batcher::new(1, run, None);
        for i in 0..2u32 {
            let answer = tokio::time::timeout(Duration::from_secs(5), b.call("a", i)).await;
            assert_eq!(answer.expect("a batch went out").unwrap(), i);
        }
        // The third round trip panics: its caller sees the store closed.
        let answer = tokio::time::timeout(Duration::from_secs(5), b.call("a", 2)).await;
        assert!(matches!(answer.expect("answered"), Err(StoreError::Closed)));
        for i in 3..5u32 {
            let answer = tokio::time::timeout(Duration::from_secs(5), b.call("a", i)).await;
            assert_eq!(
                answer.expect("a batch went out after the panic").unwrap(),
                i
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_round_trip_fails_its_batch_and_a_dropped_caller_cancels_nothing() {
        let calls = Arc::new(AtomicUsize::new(0));
        let run: Run<u32, u32> = {
            let calls = calls.clone();
            Arc::new(move |reqs: Vec<u32>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    if n == 0 {
                        Err(StoreError::Unavailable("down".into()))
                    } else {
                        Ok(reqs.into_iter().map(Ok).collect())
                    }
                })
            })
        };
        let b = Batcher::new(1, run, None);
        let failing = {
            let b = b.clone();
            tokio::spawn(async move { b.call("a", 1).await })
        };
        tokio::task::yield_now().await;
        // Queued behind the failing batch; its caller gives up at once.
        let dropped = {
            let b = b.clone();
            tokio::spawn(async move { b.call("b", 2).await })
        };
        let kept = {
            let b = b.clone();
            tokio::spawn(async move { b.call("c", 3).await })
        };
        tokio::task::yield_now().await;
        dropped.abort();
        assert!(matches!(
            failing.await.unwrap(),
            Err(StoreError::Unavailable(_))
        ));
        assert_eq!(kept.await.unwrap().unwrap(), 3);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

//! Which worker runtime this thread is. Engines that keep per-runtime
//! state (store connections, upstream pools) read it here; the worker
//! threads (`workers.rs`) set it. It sits below both so that a store engine
//! need not know about listeners or workers.

use std::cell::Cell;

thread_local! {
    /// 1 + the worker's index on a worker thread, 0 elsewhere.
    static WORKER: Cell<usize> = const { Cell::new(0) };
}

/// The worker running on this thread (0 off the worker threads).
pub fn current() -> usize {
    WORKER.with(Cell::get).saturating_sub(1)
}

/// Makes this thread worker `i` until the guard drops (tests of
/// per-worker state; the test harness reuses its threads).
#[cfg(test)]
pub(crate) fn become_worker(i: usize) -> impl Drop {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            WORKER.with(|w| w.set(0));
        }
    }
    enter(i);
    Reset
}

/// This thread's slot for per-runtime state such as store connections: 0
/// off the worker threads (the main runtime), 1 + the index on a worker.
/// A connection is best used from the runtime that drives it: no hop
/// between threads per call.
pub fn slot() -> usize {
    WORKER.with(Cell::get)
}

/// Makes this thread worker `i` for as long as it lives (the worker
/// threads, once, at start).
pub(crate) fn enter(i: usize) {
    WORKER.with(|w| w.set(i + 1));
}

//! Worker runtimes: one single-threaded tokio runtime per worker thread,
//! each with its own proxy listeners (`SO_REUSEPORT`, so the kernel spreads
//! new connections over them) and its own upstream connection pools. The
//! fence, the store and the metrics stay shared.
//!
//! Why: a connection, its request tasks and its upstream connections then
//! live on one thread, with no work stealing and no cross-thread wake-ups
//! on the request path, which is how nginx and HAProxy scale with cores.
//!
//! The default worker count is what this process may really use
//! ([`available_cpus`]): the CPUs of its affinity mask (what nginx's
//! `worker_processes auto` counts), capped by the cgroup CPU quota (v2
//! `cpu.max`, v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us`), so a
//! container limited to one CPU on a 64-core node runs one worker.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::config::MAX_WORKERS;

/// CPUs named by a kernel CPU list such as `0-3,8,10-11`
/// (`Cpus_allowed_list` in `/proc/self/status`). `None` if it does not
/// parse.
pub fn cpus_in_list(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.trim().parse::<usize>().ok()?, hi.trim().parse().ok()?),
            None => {
                let c = part.trim().parse::<usize>().ok()?;
                (c, c)
            }
        };
        if hi < lo {
            return None;
        }
        n += hi - lo + 1;
    }
    (n > 0).then_some(n)
}

/// CPUs allowed by a quota of `quota` µs per `period` µs, rounded up (a
/// quota of 1.5 CPUs can keep two threads busy half the time each), at
/// least 1. `None`: no limit.
fn quota_cpus(quota: i64, period: i64) -> Option<usize> {
    if quota <= 0 || period <= 0 {
        return None;
    }
    let cpus = (quota + period - 1) / period;
    Some(usize::try_from(cpus).unwrap_or(usize::MAX).max(1))
}

/// The CPU limit in a cgroup v2 `cpu.max` file (`max 100000` or
/// `150000 100000`). `None`: no limit, or unreadable.
pub fn cgroup_v2_cpus(cpu_max: &str) -> Option<usize> {
    let mut fields = cpu_max.split_whitespace();
    let quota = fields.next()?;
    let period = fields.next().map_or(Some(100_000), |p| p.parse().ok())?;
    if quota == "max" {
        return None;
    }
    quota_cpus(quota.parse().ok()?, period)
}

/// The CPU limit of cgroup v1 `cpu.cfs_quota_us` (-1: none) and
/// `cpu.cfs_period_us`.
pub fn cgroup_v1_cpus(quota: &str, period: &str) -> Option<usize> {
    quota_cpus(quota.trim().parse().ok()?, period.trim().parse().ok()?)
}

/// Where this process's CPU controller is, from `/proc/self/cgroup`: the
/// v2 path (`0::/path`) and the v1 `cpu` controller's path.
fn cgroup_paths(proc_cgroup: &str) -> (Option<String>, Option<String>) {
    let (mut v2, mut v1) = (None, None);
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "cpu") {
            v1 = Some(path.to_string());
        }
    }
    (v2, v1)
}

/// The CPU quota of the cgroup this process runs in, looked up under
/// `root` (normally `/sys/fs/cgroup`) with the contents of
/// `/proc/self/cgroup`. Inside a container the cgroup path is often `/`
/// (a cgroup namespace): the root of the mount is then this cgroup.
pub fn cgroup_cpus(root: &Path, proc_cgroup: &str) -> Option<usize> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let rel = |p: &str| root.join(p.trim_start_matches('/'));
    let (v2, v1) = cgroup_paths(proc_cgroup);
    if let Some(path) = v2 {
        // The nearest limit on the way up counts; the tightest one would
        // need every level, and a parent's is normally the same or looser.
        let mut dir = rel(&path);
        loop {
            if let Some(limit) = read(&dir.join("cpu.max")).and_then(|t| cgroup_v2_cpus(&t)) {
                return Some(limit);
            }
            if dir == root || !dir.pop() {
                break;
            }
        }
    }
    if let Some(path) = v1 {
        for base in ["cpu,cpuacct", "cpu", "cpuacct,cpu"] {
            for dir in [
                rel(&format!("{base}/{}", path.trim_start_matches('/'))),
                root.join(base),
            ] {
                if let (Some(q), Some(p)) = (
                    read(&dir.join("cpu.cfs_quota_us")),
                    read(&dir.join("cpu.cfs_period_us")),
                ) {
                    return cgroup_v1_cpus(&q, &p);
                }
            }
        }
    }
    None
}

/// The CPUs this process may use: its affinity mask, capped by its cgroup
/// CPU quota. Falls back to the standard library's count.
pub fn available_cpus() -> usize {
    let affinity = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(cpus_in_list)
        });
    let affinity = affinity.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let quota = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_cpus(Path::new("/sys/fs/cgroup"), &c));
    quota
        .map_or(affinity, |q| q.min(affinity))
        .clamp(1, MAX_WORKERS)
}

/// Sockets bound for the workers, and what keeps others off their port.
pub struct Bound {
    pub sockets: Vec<std::net::TcpListener>,
    /// To be held while the sockets are: see [`bind`].
    pub claim: Option<std::os::unix::net::UnixListener>,
}

/// Binds `n` listening sockets on `addr` for `n` workers. With more than
/// one, they share the port through `SO_REUSEPORT`. On a given port, a
/// plain bind first proves that nobody else holds it (a socket without
/// `SO_REUSEPORT` cannot join a group), and a claim on the address (an
/// abstract Unix socket named after it, held as long as the sockets) keeps
/// a second fencegate starting at the same moment from passing the same
/// check between that probe and the shared binds: a second fencegate fails
/// to bind, as it would without workers. On port 0 the first shared
/// socket takes a fresh port the kernel picked, and the rest join it.
pub fn bind(addr: SocketAddr, n: usize) -> std::io::Result<Bound> {
    use socket2::{Domain, Protocol, Socket, Type};
    let open = |addr: SocketAddr, shared: bool| -> std::io::Result<std::net::TcpListener> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        if shared {
            socket.set_reuse_port(true)?;
        }
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(4096)?;
        Ok(socket.into())
    };
    if n <= 1 {
        return Ok(Bound {
            sockets: vec![open(addr, false)?],
            claim: None,
        });
    }
    let mut claim = None;
    let first = if addr.port() == 0 {
        open(addr, true)?
    } else {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("fencegate-listen-{addr}");
        let unix = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        claim = Some(std::os::unix::net::UnixListener::bind_addr(&unix)?);
        drop(open(addr, false)?);
        open(addr, true)?
    };
    let addr = first.local_addr()?;
    let mut sockets = vec![first];
    for _ in 1..n {
        sockets.push(open(addr, true)?);
    }
    Ok(Bound { sockets, claim })
}

/// The running worker threads.
pub struct Workers {
    /// Cancelled when the server has drained: the worker runtimes (and the
    /// tasks still on them) end.
    finish: CancellationToken,
    exited: Vec<oneshot::Receiver<()>>,
}

/// How long a worker runtime's end waits for its blocking tasks (DNS
/// lookups of upstream connects): the drain is over by then.
const BLOCKING_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

impl Workers {
    /// Starts `n` worker threads, each running `work(i)` on a runtime of
    /// its own and then idling until [`Workers::stop`]: tasks the work
    /// spawned (connections, upstream exchanges still in flight) live on
    /// that runtime and must keep running through the drain.
    pub fn start<F, Fut>(n: usize, work: F) -> std::io::Result<Self>
    where
        F: Fn(usize) -> Fut + Send + Sync + Clone + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        // Built first, so that a failure below ends the threads already
        // started (its drop cancels `finish`).
        let mut workers = Self {
            finish: CancellationToken::new(),
            exited: Vec::with_capacity(n),
        };
        for i in 0..n {
            let (done, exit) = oneshot::channel();
            let (started, start) = std::sync::mpsc::channel();
            let (work, finish) = (work.clone(), workers.finish.clone());
            std::thread::Builder::new()
                .name(format!("fencegate-w{i}"))
                .spawn(move || {
                    // Built on its own thread: a runtime must not be
                    // dropped inside another one.
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(r) => {
                            let _ = started.send(Ok(()));
                            r
                        }
                        Err(e) => {
                            let _ = started.send(Err(e));
                            return;
                        }
                    };
                    crate::slot::enter(i);
                    runtime.block_on(async move {
                        work(i).await;
                        finish.cancelled().await;
                    });
                    // Whatever is left (idle connections) ends with it.
                    runtime.shutdown_timeout(BLOCKING_GRACE);
                    let _ = done.send(());
                })?;
            workers.exited.push(exit);
            start
                .recv()
                .map_err(|_| std::io::Error::other("a worker thread ended at start"))??;
        }
        Ok(workers)
    }

    /// Ends the worker runtimes and waits for their threads.
    pub async fn stop(mut self) {
        self.finish.cancel();
        for exit in self.exited.drain(..) {
            let _ = exit.await;
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.finish.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(cpus_in_list("0-3,8,10-11\n"), Some(7));
        assert_eq!(cpus_in_list("5"), Some(1));
        assert_eq!(cpus_in_list("0-63"), Some(64));
        assert_eq!(cpus_in_list(""), None);
        assert_eq!(cpus_in_list("3-1"), None);
        assert_eq!(cpus_in_list("x"), None);
    }

    #[test]
    fn cgroup_v2_quota() {
        assert_eq!(cgroup_v2_cpus("max 100000\n"), None);
        assert_eq!(cgroup_v2_cpus("100000 100000\n"), Some(1));
        assert_eq!(cgroup_v2_cpus("150000 100000"), Some(2));
        assert_eq!(cgroup_v2_cpus("50000 100000"), Some(1));
        assert_eq!(cgroup_v2_cpus("400000 100000"), Some(4));
        assert_eq!(cgroup_v2_cpus("200000"), Some(2));
        assert_eq!(cgroup_v2_cpus("junk 100000"), None);
    }

    #[test]
    fn cgroup_v1_quota() {
        assert_eq!(cgroup_v1_cpus("-1\n", "100000\n"), None);
        assert_eq!(cgroup_v1_cpus("200000\n", "100000\n"), Some(2));
        assert_eq!(cgroup_v1_cpus("250000", "100000"), Some(3));
        assert_eq!(cgroup_v1_cpus("1000", "100000"), Some(1));
    }

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn cgroup_files_found_from_proc_self_cgroup() {
        // v2, a nested cgroup whose limit is set on its parent.
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "kubepods/pod1/cpu.max", "200000 100000\n");
        write(d.path(), "kubepods/pod1/c1/cpu.max", "max 100000\n");
        assert_eq!(cgroup_cpus(d.path(), "0::/kubepods/pod1/c1\n"), Some(2));
        // v2 inside a cgroup namespace: the path is `/`.
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "cpu.max", "100000 100000\n");
        assert_eq!(cgroup_cpus(d.path(), "0::/\n"), Some(1));
        // No limit anywhere.
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "cpu.max", "max 100000\n");
        assert_eq!(cgroup_cpus(d.path(), "0::/a\n"), None);
        // v1, the cpu controller mounted with cpuacct.
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us",
            "300000\n",
        );
        write(
            d.path(),
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us",
            "100000\n",
        );
        let proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n";
        assert_eq!(cgroup_cpus(d.path(), proc), Some(3));
        // v1 without a quota.
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "cpu/cpu.cfs_quota_us", "-1\n");
        write(d.path(), "cpu/cpu.cfs_period_us", "100000\n");
        assert_eq!(cgroup_cpus(d.path(), "3:cpu:/\n"), None);
    }

    #[test]
    fn this_process_has_at_least_one_cpu() {
        let n = available_cpus();
        assert!((1..=MAX_WORKERS).contains(&n));
        // The affinity mask bounds it (the test runner may be pinned).
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .and_then(cpus_in_list)
            .unwrap();
        assert!(n <= allowed, "{n} workers for {allowed} allowed CPUs");
    }

    #[test]
    fn several_sockets_share_a_port_and_a_stranger_cannot_join() {
        let bound = bind("127.0.0.1:0".parse().unwrap(), 3).unwrap();
        let socks = &bound.sockets;
        assert_eq!(socks.len(), 3);
        let port = socks[0].local_addr().unwrap().port();
        assert!(socks.iter().all(|s| s.local_addr().unwrap().port() == port));
        // A second fencegate (which probes with a plain bind) is refused.
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let again = bind(addr, 3).err().expect("a second bind must fail");
        assert_eq!(again.kind(), std::io::ErrorKind::AddrInUse);
        assert!(bind(addr, 1).is_err());
        drop(bound);
        // On a named port: the claim is held while the sockets are, and
        // released with them.
        let named = bind(addr, 2).unwrap();
        let claimed = bind(addr, 2).err().expect("claimed");
        assert_eq!(claimed.kind(), std::io::ErrorKind::AddrInUse);
        drop(named);
        assert_eq!(bind(addr, 2).unwrap().sockets.len(), 2);
    }
}

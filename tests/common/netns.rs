//! Test hosts in network namespaces, for network faults (issue 43).
//!
//! A [`Net`] is a switch: a namespace of its own holding a bridge, and each
//! [`Host`] a namespace with one veth link to it and an address in a /24 of
//! 198.18.0.0/15 (the range set aside for testing network equipment), one
//! /24 per net. The test process itself is on the switch too
//! ([`Net::local`], the `.254` of the net, on a link whose other end is in
//! the switch), so every fixture that speaks HTTP from the test (clients,
//! the history checker, curl) reaches the hosts as it reaches loopback. No
//! host has a route out and the switch forwards nothing else: nothing a
//! test sends leaves the machine.
//!
//! Faults are made where a network makes them, in the switch: an
//! nftables `bridge` filter drops a link's frames (one direction or both).
//! The hosts' own stacks see nothing but silence, as across a real
//! partition: a sender's bytes wait in its kernel and are retransmitted
//! when the link heals.
//!
//! Processes run on a host with `ip netns exec` ([`Host::command`]); a
//! socket of the test's own (a client, a recording backend) is made inside
//! a host's namespace by [`Host::enter`] and used from anywhere.
//!
//! Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and nftables;
//! without them the test fails saying what is missing.

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A switch and the hosts on it; every namespace is removed on drop.
pub struct Net {
    /// Unique per net: names are `<tag>s` for the switch, `<tag>h<n>` for
    /// hosts (interface names have at most 15 bytes).
    tag: String,
    /// The net's /24 is 198.18.<subnet>.0 (198.19 past 255).
    subnet: u16,
    hosts: u8,
}

/// One host: its namespace and its address on the switch.
#[derive(Clone)]
pub struct Host {
    pub ns: String,
    pub addr: Ipv4Addr,
}

fn run(what: &str, cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?} ({e}); install iproute2 and nftables (Debian: apt-get install iproute2 nftables)"));
    assert!(
        out.status.success(),
        "{what}: {cmd:?} failed ({}): {}; network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ip(args: &[&str]) {
    run("ip", Command::new("ip").args(args));
}

impl Net {
    pub fn new() -> Net {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("fg{}n{n}", std::process::id() % 100_000);
        // Nets of one test binary never share a /24 (the test's own
        // namespace has a link on each); nor, unless 512 nets apart, do
        // those of binaries run one after another.
        let subnet = ((std::process::id() % 512 + n * 37) % 512) as u16;
        let net = Net {
            tag,
            subnet,
            hosts: 0,
        };
        let sw = net.switch();
        ip(&["netns", "add", &sw]);
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        // The test's own link: its far end in the switch, so that the
        // switch's removal takes it away.
        let (near, far) = (format!("{}r", net.tag), format!("{}rs", net.tag));
        ip(&["link", "add", &near, "type", "veth", "peer", "name", &far]);
        ip(&["link", "set", &far, "netns", &sw]);
        ip(&["-n", &sw, "link", "set", &far, "master", "br0"]);
        ip(&["-n", &sw, "link", "set", &far, "up"]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", net.addr(254)),
            "dev",
            &near,
        ]);
        ip(&["link", "set", &near, "up"]);
        // The filter every fault is a rule of.
        net.nft(&["add", "table", "bridge", "faults"]);
        net.nft(&[
            "add",
            "chain",
            "bridge",
            "faults",
            "links",
            "{ type filter hook forward priority 0; }",
        ]);
        net
    }

    fn switch(&self) -> String {
        format!("{}s", self.tag)
    }

    fn addr(&self, last: u8) -> Ipv4Addr {
        let [hi, lo] = (0x12_00u16 + self.subnet).to_be_bytes();
        Ipv4Addr::new(198, hi, lo, last)
    }

    /// The test process on the switch: its address, and its namespace for
    /// cuts (it cannot run commands as a host).
    pub fn local(&self) -> Host {
        Host {
            ns: String::new(),
            addr: self.addr(254),
        }
    }

    fn nft(&self, args: &[&str]) {
        run(
            "nft",
            Command::new("ip")
                .args(["netns", "exec", &self.switch(), "nft"])
                .args(args),
        );
    }

    /// A new host on the switch.
    pub fn host(&mut self) -> Host {
        self.hosts += 1;
        let n = self.hosts;
        assert!(n < 250, "at most 249 hosts on a test network");
        let ns = format!("{}h{n}", self.tag);
        let (inside, outside) = (format!("{}h{n}i", self.tag), format!("{}h{n}o", self.tag));
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &inside, "type", "veth", "peer", "name", &outside,
        ]);
        ip(&["link", "set", &inside, "netns", &ns]);
        ip(&["link", "set", &outside, "netns", &self.switch()]);
        ip(&[
            "-n",
            &self.switch(),
            "link",
            "set",
            &outside,
            "master",
            "br0",
        ]);
        ip(&["-n", &self.switch(), "link", "set", &outside, "up"]);
        let addr = self.addr(n + 1);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            &inside,
        ]);
        ip(&["-n", &ns, "link", "set", &inside, "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        Host { ns, addr }
    }

    /// Drops every frame from `from` to `to` (one direction).
    pub fn cut_one_way(&self, from: &Host, to: &Host) {
        let (f, t) = (from.addr.to_string(), to.addr.to_string());
        self.nft(&[
            "add", "rule", "bridge", "faults", "links", "ip", "saddr", &f, "ip", "daddr", &t,
            "drop",
        ]);
    }

    /// A partition between `a` and `b`: nothing passes either way.
    pub fn cut(&self, a: &Host, b: &Host) {
        self.cut_one_way(a, b);
        self.cut_one_way(b, a);
    }

    /// Drops `percent` of the frames between `a` and `b`, each direction
    /// drawn on its own (nftables' `numgen random`: this kernel has no
    /// netem).
    pub fn lossy(&self, a: &Host, b: &Host, percent: u8) {
        for (f, t) in [(a, b), (b, a)] {
            let (f, t) = (f.addr.to_string(), t.addr.to_string());
            let p = percent.to_string();
            self.nft(&[
                "add", "rule", "bridge", "faults", "links", "ip", "saddr", &f, "ip", "daddr", &t,
                "numgen", "random", "mod", "100", "<", &p, "drop",
            ]);
        }
    }

    /// Every cut healed.
    pub fn heal(&self) {
        self.nft(&["flush", "chain", "bridge", "faults", "links"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // A namespace's links go with it.
        for n in 1..=self.hosts {
            let _ = Command::new("ip")
                .args(["netns", "del", &format!("{}h{n}", self.tag)])
                .status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.switch()])
            .status();
    }
}

impl Host {
    /// A command that runs `program` on this host.
    pub fn command(&self, program: &str) -> Command {
        assert!(!self.ns.is_empty(), "the test's own link runs no commands");
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// Runs `f` with this thread in the host's namespace, and back: the
    /// sockets `f` makes belong to the host for their whole life, whichever
    /// thread then uses them. `f` must not block on the async runtime.
    pub fn enter<T>(&self, f: impl FnOnce() -> T) -> T {
        assert!(
            !self.ns.is_empty(),
            "the test's own link is no host to enter"
        );
        use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};
        let home = std::fs::File::open("/proc/thread-self/ns/net").expect("own namespace");
        let there = std::fs::File::open(format!("/run/netns/{}", self.ns))
            .unwrap_or_else(|e| panic!("namespace {}: {e}", self.ns));
        move_into_link_name_space(there.as_fd(), Some(LinkNameSpaceType::Network))
            .unwrap_or_else(|e| panic!("cannot enter namespace {} ({e}): needs root", self.ns));
        let out = f();
        move_into_link_name_space(home.as_fd(), Some(LinkNameSpaceType::Network))
            .expect("back to the test's namespace");
        out
    }

    /// A TCP connection from this host to `to`.
    pub async fn connect(
        &self,
        to: std::net::SocketAddr,
    ) -> std::io::Result<tokio::net::TcpStream> {
        if self.ns.is_empty() {
            return tokio::net::TcpStream::connect(to).await;
        }
        let socket = self.enter(tokio::net::TcpSocket::new_v4)?;
        socket.connect(to).await
    }

    /// What `ss -tn` prints on this host for connections to `peer`.
    pub fn sockets_to(&self, peer: Ipv4Addr) -> String {
        let out = self
            .command("ss")
            .args(["-tnH", "dst", &peer.to_string()])
            .output()
            .expect("ss (iproute2)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// A TCP relay on a host that delays what it forwards: each chunk read
/// goes out `delay` plus up to `jitter` later, in order (a link's latency
/// and jitter as a TCP stream sees them; the kernel has no netem).
pub struct Relay {
    pub addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub fn start(
        on: &Host,
        to: std::net::SocketAddr,
        delay: std::time::Duration,
        jitter: std::time::Duration,
    ) -> Relay {
        let listener = on
            .enter(|| {
                let s = tokio::net::TcpSocket::new_v4()?;
                s.bind((on.addr, 0).into())?;
                s.listen(128)
            })
            .expect("relay listener");
        let addr = listener.local_addr().unwrap();
        let on = on.clone();
        let task = tokio::spawn(async move {
            let mut seed = 0x9E37_79B9_7F4A_7C15u64;
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let Ok(outbound) = on.connect(to).await else {
                    continue;
                };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                tokio::spawn(pump(ri, wo, delay, jitter, seed));
                tokio::spawn(pump(ro, wi, delay, jitter, seed ^ 1));
            }
        });
        Relay { addr, task }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, each chunk held until its time.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: std::time::Duration,
    jitter: std::time::Duration,
    seed: u64,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, bytes)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut rng = super::history::Rng(seed | 1);
    let mut last = tokio::time::Instant::now();
    let mut buf = vec![0u8; 16 * 1024];
    let jitter_us = jitter.as_micros() as u64 + 1;
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let d = delay + std::time::Duration::from_micros(rng.below(jitter_us));
                // In order: never before the chunk ahead of it.
                last = last.max(tokio::time::Instant::now() + d);
                if tx.send((last, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// A store server on a test host, on its address, with a fresh data
/// directory, initialised with `fencegate init-store` as an operator does
/// (which also waits until it answers); killed on drop. Redis keeps no
/// persistence here: these tests are about the network, not the disk.
pub struct StoreOn {
    pub url: String,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl StoreOn {
    pub fn start(kind: super::servers::StoreKind, host: &Host) -> StoreOn {
        Self::start_env(kind, host, &[])
    }

    /// [`start`](Self::start), with these environment variables for the
    /// server (libfaketime's, say).
    pub fn start_env(
        kind: super::servers::StoreKind,
        host: &Host,
        env: &[(String, String)],
    ) -> StoreOn {
        use super::servers::{postgres_bin, require, StoreKind};
        let dir = super::cluster::scratch_dir();
        let a = host.addr.to_string();
        let log = |name: &str| std::fs::File::create(dir.path().join(name)).unwrap();
        let (url, child) = match kind {
            StoreKind::Redis => {
                let child = host
                    .command(&require("redis-server", "redis-server"))
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .args(["--port", "6379", "--bind", &a, "--protected-mode", "no"])
                    .args(["--save", "", "--appendonly", "no"])
                    .stdout(log("redis.log"))
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("start redis-server");
                (format!("redis://{a}:6379/0"), child)
            }
            StoreKind::Etcd => {
                let child = host
                    .command(&require("etcd", "etcd-server"))
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .args(["--name", "m", "--data-dir"])
                    .arg(dir.path().join("etcd"))
                    .args(["--listen-client-urls", &format!("http://{a}:2379")])
                    .args(["--advertise-client-urls", &format!("http://{a}:2379")])
                    .args(["--listen-peer-urls", &format!("http://{a}:2380")])
                    .args(["--initial-advertise-peer-urls", &format!("http://{a}:2380")])
                    .args(["--initial-cluster", &format!("m=http://{a}:2380")])
                    .stdout(std::process::Stdio::null())
                    .stderr(log("etcd.log"))
                    .spawn()
                    .expect("start etcd");
                (format!("etcd://{a}:2379"), child)
            }
            StoreKind::Postgres => {
                let data = super::servers::initdb(dir.path());
                // The test network's clients, on the host's address.
                let hba = data.join("pg_hba.conf");
                let mut rules = std::fs::read_to_string(&hba).unwrap();
                rules.push_str("host all all 198.18.0.0/15 trust\n");
                std::fs::write(&hba, rules).unwrap();
                let mut c = host.command("runuser");
                c.envs(env.iter().map(|(k, v)| (k, v)));
                c.args(["-u", "postgres", "--"])
                    .arg(postgres_bin("postgres"));
                let child = c
                    .arg("-D")
                    .arg(&data)
                    .args(["-p", "5432", "-c", &format!("listen_addresses={a}"), "-k"])
                    .arg(dir.path())
                    .stdout(std::process::Stdio::null())
                    .stderr(log("postgres.log"))
                    .spawn()
                    .expect("start postgres");
                (format!("postgres://postgres@{a}:5432/postgres"), child)
            }
            StoreKind::Embedded | StoreKind::RedisCluster => {
                panic!("{kind:?}: not a server on a test host")
            }
        };
        let store = StoreOn {
            url,
            child,
            _dir: dir,
        };
        super::servers::init_store(&store.url);
        store
    }
}

/// Three etcd members, each on a host of its own, with quick elections
/// (50 ms heartbeats, 250 ms election timeout); killed on drop.
pub struct EtcdOn {
    pub url: String,
    pub members: Vec<Host>,
    _children: Children,
    _dir: tempfile::TempDir,
}

impl EtcdOn {
    pub fn start(members: &[Host]) -> EtcdOn {
        let dir = super::cluster::scratch_dir();
        let bin = super::servers::require("etcd", "etcd-server");
        let cluster: Vec<String> = members
            .iter()
            .enumerate()
            .map(|(i, h)| format!("m{i}=http://{}:2380", h.addr))
            .collect();
        let children = members
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let a = h.addr;
                let log = std::fs::File::create(dir.path().join(format!("m{i}.log"))).unwrap();
                h.command(&bin)
                    .args(["--name", &format!("m{i}"), "--data-dir"])
                    .arg(dir.path().join(format!("m{i}")))
                    .args(["--listen-client-urls", &format!("http://{a}:2379")])
                    .args(["--advertise-client-urls", &format!("http://{a}:2379")])
                    .args(["--listen-peer-urls", &format!("http://{a}:2380")])
                    .args(["--initial-advertise-peer-urls", &format!("http://{a}:2380")])
                    .args(["--initial-cluster", &cluster.join(",")])
                    .args(["--initial-cluster-state", "new"])
                    .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .expect("start etcd")
            })
            .collect();
        let addrs: Vec<String> = members.iter().map(|h| format!("{}:2379", h.addr)).collect();
        let etcd = EtcdOn {
            url: format!("etcd://{}", addrs.join(",")),
            members: members.to_vec(),
            _children: Children(children),
            _dir: dir,
        };
        super::servers::init_store(&etcd.url);
        etcd
    }

    /// The member that is leader, as the first member that answers says.
    pub fn leader(&self) -> Option<usize> {
        let statuses: Vec<(String, String)> = self
            .members
            .iter()
            .map(|h| {
                let out = Command::new("curl")
                    .args(["-s", "-m", "1", "-X", "POST", "-d", "{}"])
                    .arg(format!("http://{}:2379/v3/maintenance/status", h.addr))
                    .output();
                let s = out
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                (
                    super::cluster::json_field(&s, "member_id"),
                    super::cluster::json_field(&s, "leader"),
                )
            })
            .collect();
        let leader = statuses.iter().find(|(_, l)| !l.is_empty())?.1.clone();
        statuses.iter().position(|(id, _)| *id == leader)
    }
}

/// Server processes, killed (and reaped) on drop.
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Redis with Sentinel on three hosts: a primary on the first and a
/// replica on the second, a Sentinel on each of the three (quorum 2,
/// failover 1 s after the primary stops answering); killed on drop.
pub struct RedisSentinelOn {
    pub url: String,
    pub hosts: Vec<Host>,
    _children: Children,
    _dir: tempfile::TempDir,
}

impl RedisSentinelOn {
    pub fn start(hosts: &[Host]) -> RedisSentinelOn {
        Self::start_with(hosts, &[])
    }

    /// With `extra` arguments for both data nodes (`min-replicas-to-write`,
    /// say).
    pub fn start_with(hosts: &[Host], extra: &[&str]) -> RedisSentinelOn {
        use std::process::Stdio;
        let dir = super::cluster::scratch_dir();
        let bin = super::servers::require("redis-server", "redis-server");
        let (p, r) = (&hosts[0], &hosts[1]);
        let mut children = Vec::new();
        for (i, h) in [p, r].into_iter().enumerate() {
            let d = dir.path().join(format!("n{i}"));
            std::fs::create_dir_all(&d).unwrap();
            let mut c = h.command(&bin);
            c.args(["--port", "6379", "--bind", &h.addr.to_string()])
                .args(["--protected-mode", "no", "--save", ""])
                .args(["--appendonly", "yes", "--appendfsync", "always"])
                .args(["--repl-diskless-sync-delay", "0", "--dir"])
                .arg(&d)
                .args(extra);
            if i == 1 {
                c.args(["--replicaof", &p.addr.to_string(), "6379"]);
            }
            children.push(
                c.stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start redis-server"),
            );
        }
        wait_until("the replica online", || {
            redis_cli(p, 6379, &["INFO", "replication"]).contains("connected_slaves:1")
        });
        for (i, h) in hosts.iter().enumerate() {
            let d = dir.path().join(format!("s{i}"));
            std::fs::create_dir_all(&d).unwrap();
            let conf = d.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port 26379\nbind {}\nprotected-mode no\ndir {}\n\
                     sentinel monitor fg {} 6379 2\n\
                     sentinel down-after-milliseconds fg 1000\n\
                     sentinel failover-timeout fg 2000\n\
                     sentinel parallel-syncs fg 1\n",
                    h.addr,
                    d.display(),
                    p.addr
                ),
            )
            .unwrap();
            children.push(
                h.command(&bin)
                    .arg(&conf)
                    .arg("--sentinel")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start redis-sentinel"),
            );
        }
        wait_until("the Sentinels to know the replica and each other", || {
            hosts.iter().all(|h| {
                let m = redis_cli(h, 26379, &["SENTINEL", "MASTER", "fg"]);
                let field = |name: &str| {
                    let mut lines = m.lines();
                    while let Some(l) = lines.next() {
                        if l == name {
                            return lines.next().unwrap_or("").to_string();
                        }
                    }
                    String::new()
                };
                field("num-slaves") == "1" && field("num-other-sentinels") == "2"
            })
        });
        let sentinels: Vec<String> = hosts.iter().map(|h| format!("{}:26379", h.addr)).collect();
        let redis = RedisSentinelOn {
            url: format!("redis+sentinel://{}/fg", sentinels.join(",")),
            hosts: hosts.to_vec(),
            _children: Children(children),
            _dir: dir,
        };
        super::servers::init_store(&redis.url);
        redis
    }

    /// The address of the primary, as the Sentinel on `host` sees it.
    pub fn primary_seen_by(&self, host: usize) -> String {
        redis_cli(
            &self.hosts[host],
            26379,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "fg"],
        )
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
    }
}

/// What `redis-cli` prints for a command to `host:port` (from the test's
/// own link), "" if it cannot.
pub fn redis_cli(host: &Host, port: u16, args: &[&str]) -> String {
    let cli = super::servers::require("redis-cli", "redis-tools");
    Command::new(cli)
        .args(["-h", &host.addr.to_string(), "-p", &port.to_string()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Polls `f` every 50 ms for up to 30 s.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

impl StoreOn {
    /// The port its clients connect to.
    pub fn port(&self) -> u16 {
        let rest = self.url.rsplit_once(':').expect("host:port").1;
        rest.split('/').next().unwrap().parse().expect("a port")
    }
}

impl Drop for StoreOn {
    fn drop(&mut self) {
        // runuser (PostgreSQL's) forwards nothing on SIGKILL: the server's
        // processes are found by their data directory.
        let _ = Command::new("pkill")
            .args(["-9", "-f", &format!("{}/pg", self._dir.path().display())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

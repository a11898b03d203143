//! Replicated store servers for the failover tests, on loopback ports:
//! a Redis primary with a replica and three Sentinels, a PostgreSQL
//! primary with a synchronous standby, a three-member etcd. Each node is a
//! real server process; faults are real signals (`kill -9`, `SIGSTOP`) and
//! the servers' own failover (Sentinel's promotion, `pg_ctl promote`,
//! Raft's election).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::servers::{as_postgres, free_port, postgres_bin, require};

/// One server process: how to start it, so that it can be started again.
pub struct Node {
    pub port: u16,
    pub dir: PathBuf,
    program: PathBuf,
    args: Vec<String>,
    /// Run as the `postgres` user (when the tests run as root).
    as_postgres: bool,
    child: Option<Child>,
}

impl Node {
    fn new(port: u16, dir: PathBuf, program: PathBuf, args: Vec<String>) -> Node {
        std::fs::create_dir_all(&dir).unwrap();
        Node {
            port,
            dir,
            program,
            args,
            as_postgres: false,
            child: None,
        }
    }

    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .unwrap();
        let mut c = if self.as_postgres {
            as_postgres(&self.program)
        } else {
            Command::new(&self.program)
        };
        let child = c
            .args(&self.args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.program.display()));
        self.child = Some(child);
        self.wait_listening();
    }

    fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "{} exited during start ({status}):\n{}",
                    self.program.display(),
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not listen on {}:\n{}",
                self.program.display(),
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// The server's own pid (not `runuser`'s).
    fn pid(&self) -> u32 {
        let child = self.child.as_ref().expect("running").id();
        if !self.as_postgres {
            return child;
        }
        // runuser's one child is the server.
        let out = Command::new("pgrep")
            .args(["-P", &child.to_string()])
            .output()
            .expect("run pgrep");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or(child)
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.as_postgres {
                // The postmaster's children go with the data directory.
                let _ = Command::new("pkill")
                    .args(["-9", "-f", &self.dir.display().to_string()])
                    .status();
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGSTOP: the process holds its sockets and answers nothing.
    pub fn stop(&self) {
        super::signal(self.pid(), "STOP");
    }

    pub fn cont(&self) {
        super::signal(self.pid(), "CONT");
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.start();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.kill9();
        }
    }
}

/// A temporary directory in memory (/dev/shm) where there is one: a busy
/// disk stalls Sentinel's timer and PostgreSQL's base backup for seconds.
pub fn scratch_dir() -> tempfile::TempDir {
    match std::path::Path::new("/dev/shm") {
        shm if shm.is_dir() => tempfile::tempdir_in(shm).unwrap(),
        _ => tempfile::tempdir().unwrap(),
    }
}

/// The nodes' loopback addresses, `127.0.0.1:PORT,...` (a store URL's
/// host list).
fn addresses(nodes: &[Node]) -> String {
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    addrs.join(",")
}

/// Polls `f` (a blocking check) for up to `within`.
fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A redis-server on loopback `port` with its data in `dir`, durable as
/// fencegate asks (every write fsynced to the append-only file).
fn durable_redis(port: u16, dir: &std::path::Path) -> Vec<String> {
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        // A new replica's full sync starts at once (Debian's default
        // waits 5 s, a window with an unsynced replica).
        "--repl-diskless-sync-delay",
        "0",
        "--dir",
        &dir.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The master name the Sentinels monitor.
pub const SENTINEL_MASTER: &str = "fg";

/// A Redis primary, one replica and three Sentinels (quorum 2) that fail
/// the primary over 1 s after it stops answering.
pub struct RedisSentinels {
    _dir: tempfile::TempDir,
    /// The two data nodes; which one is the primary changes on failover.
    pub nodes: Vec<Node>,
    pub sentinels: Vec<Node>,
}

impl RedisSentinels {
    pub fn start() -> RedisSentinels {
        let bin = PathBuf::from(require("redis-server", "redis-server"));
        let dir = scratch_dir();
        let primary = free_port();
        let data_node = |i: usize, port: u16, replica_of: Option<u16>| {
            let d = dir.path().join(format!("n{i}"));
            let mut args = durable_redis(port, &d);
            args.extend(["--protected-mode".into(), "no".into()]);
            if let Some(p) = replica_of {
                args.extend(["--replicaof".into(), "127.0.0.1".into(), p.to_string()]);
            }
            Node::new(port, d, bin.clone(), args)
        };
        let mut nodes = vec![
            data_node(0, primary, None),
            data_node(1, free_port(), Some(primary)),
        ];
        for n in &mut nodes {
            n.start();
        }
        let c = RedisSentinels {
            _dir: dir,
            nodes,
            sentinels: Vec::new(),
        };
        wait_for("the replica online", Duration::from_secs(20), || {
            c.online_replicas(primary) == Some(1)
        });
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let d = c._dir.path().join(format!("s{i}"));
            std::fs::create_dir_all(&d).unwrap();
            // Sentinel rewrites its config file: one each, writable.
            let conf = d.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n\
                     sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary} 2\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                     sentinel failover-timeout {SENTINEL_MASTER} 2000\n\
                     sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                    d.display()
                ),
            )
            .unwrap();
            let mut s = Node::new(
                port,
                d,
                bin.clone(),
                vec![conf.display().to_string(), "--sentinel".into()],
            );
            s.start();
            // Faster checks than the defaults (Redis 7's runtime-only
            // knobs): a new primary is pinged before `down-after` could
            // pass unanswered, and a stalled timer (a busy machine) costs
            // 5 s of TILT, not 30.
            let _: Option<String> = redis_query(
                port,
                redis::cmd("SENTINEL").arg("DEBUG").arg(&[
                    "ping-period",
                    "500",
                    "info-period",
                    "1000",
                    "publish-period",
                    "500",
                    "tilt-period",
                    "5000",
                ]),
            );
            sentinels.push(s);
        }
        let c = RedisSentinels { sentinels, ..c };
        // A failover needs the Sentinels to know the replica and each
        // other (hello messages, every 2 s).
        wait_for(
            "the Sentinels to know the replica and each other",
            Duration::from_secs(30),
            || {
                c.sentinels.iter().all(|s| {
                    let m = sentinel_master(s.port);
                    m.get("num-slaves").map(String::as_str) == Some("1")
                        && m.get("num-other-sentinels").map(String::as_str) == Some("2")
                })
            },
        );
        c
    }

    /// The `--store` URL.
    pub fn url(&self) -> String {
        format!(
            "redis+sentinel://{}/{SENTINEL_MASTER}",
            addresses(&self.sentinels)
        )
    }

    /// The port the Sentinels name as the primary (the first that answers).
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let v: Vec<String> = redis_query(
                s.port,
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(SENTINEL_MASTER),
            )?;
            v.get(1)?.parse().ok()
        })
    }

    /// The data node on `port`.
    pub fn node(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a data node on that port")
    }

    /// The data node that is not on `port`.
    pub fn other(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port != port)
            .expect("a second data node")
    }

    /// Replicas online at the server on `port` (`None`: no answer).
    pub fn online_replicas(&self, port: u16) -> Option<usize> {
        let info: String = redis_query(port, redis::cmd("INFO").arg("replication"))?;
        Some(
            info.lines()
                .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                .count(),
        )
    }

    /// The role the server on `port` reports.
    pub fn role(&self, port: u16) -> Option<String> {
        let info: String = redis_query(port, redis::cmd("INFO").arg("replication"))?;
        info.lines()
            .find_map(|l| l.trim().strip_prefix("role:").map(str::to_string))
    }

    /// Waits until the Sentinels name a primary other than `old` and it
    /// says it is one; returns its port.
    pub fn wait_promoted(&self, old: u16) -> u16 {
        let mut new = None;
        wait_for(
            "Sentinel to promote the replica",
            Duration::from_secs(30),
            || {
                new = self.primary_port().filter(|p| *p != old);
                new.is_some_and(|p| self.role(p).as_deref() == Some("master"))
            },
        );
        new.unwrap()
    }
}

impl RedisSentinels {
    /// Starts the data node on `port` again (after a kill) as a replica of
    /// the primary now, as an orchestrator that asks Sentinel at start
    /// does; waits until the primary has it online.
    pub fn rejoin(&mut self, port: u16) {
        let primary = self.primary_port().expect("a primary");
        let node = self.node(port);
        if let Some(i) = node.args.iter().position(|a| a == "--replicaof") {
            node.args.drain(i..i + 3);
        }
        node.args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.to_string(),
        ]);
        node.restart();
        self.wait_replica_online();
    }

    /// Waits until the primary has a replica online again.
    pub fn wait_replica_online(&self) {
        wait_for("a replica online", Duration::from_secs(60), || {
            self.primary_port()
                .and_then(|p| self.online_replicas(p))
                .is_some_and(|n| n >= 1)
        });
    }
}

/// `SENTINEL master NAME` as a map.
fn sentinel_master(port: u16) -> std::collections::HashMap<String, String> {
    let v: Option<Vec<String>> = redis_query(
        port,
        redis::cmd("SENTINEL").arg("master").arg(SENTINEL_MASTER),
    );
    v.unwrap_or_default()
        .chunks(2)
        .filter(|kv| kv.len() == 2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect()
}

/// One command to the Redis server (or Sentinel) on `port`; `None` if it
/// does not answer within a second.
pub fn redis_query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Option<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let mut c = client
        .get_connection_with_timeout(Duration::from_secs(1))
        .ok()?;
    c.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    cmd.query(&mut c).ok()
}

/// A PostgreSQL primary and a synchronous standby (a commit waits for the
/// standby's flush: `synchronous_standby_names` on the primary's command
/// line, so the standby, a base backup, does not inherit it).
pub struct PostgresStandby {
    dir: tempfile::TempDir,
    pub primary: Node,
    pub standby: Node,
}

/// The standby's name on the primary.
const STANDBY_NAME: &str = "fgstandby";

impl PostgresStandby {
    pub fn start() -> PostgresStandby {
        let dir = scratch_dir();
        if super::servers::is_root() {
            let ok = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap()
                .success();
            assert!(ok, "chown for postgres failed");
        }
        let (p1, p2) = (free_port(), free_port());
        let (data1, data2) = (dir.path().join("p"), dir.path().join("s"));
        let run = |bin: &str, args: &[&str]| {
            let out = as_postgres(&postgres_bin(bin))
                .args(args)
                .output()
                .unwrap_or_else(|e| panic!("run {bin}: {e}"));
            assert!(
                out.status.success(),
                "{bin}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let d1 = data1.display().to_string();
        run(
            "initdb",
            &["-D", &d1, "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        let node = |data: &PathBuf, port: u16, extra: &[&str]| {
            let mut args: Vec<String> = vec![
                "-D".into(),
                data.display().to_string(),
                "-p".into(),
                port.to_string(),
                "-k".into(),
                dir.path().display().to_string(),
                "-c".into(),
                "listen_addresses=127.0.0.1".into(),
            ];
            args.extend(extra.iter().map(|s| s.to_string()));
            let mut n = Node::new(port, data.clone(), postgres_bin("postgres"), args);
            n.as_postgres = true;
            n
        };
        let mut primary = node(
            &data1,
            p1,
            &["-c", &format!("synchronous_standby_names={STANDBY_NAME}")],
        );
        primary.start();
        wait_for(
            "the primary to accept connections",
            Duration::from_secs(30),
            || psql(p1, "SELECT 1").is_some(),
        );
        run(
            "pg_basebackup",
            &[
                "-D",
                &data2.display().to_string(),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "-d",
                &format!("host=127.0.0.1 port={p1} user=postgres application_name={STANDBY_NAME}"),
            ],
        );
        // The primary's log went along with the backup: start afresh.
        let _ = std::fs::remove_file(data2.join("server.log"));
        let mut standby = node(&data2, p2, &[]);
        standby.start();
        wait_for(
            "the standby to be synchronous",
            Duration::from_secs(30),
            || {
                psql(
                p1,
                &format!(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = '{STANDBY_NAME}'"
                ),
            )
            .as_deref()
                == Some("sync")
            },
        );
        PostgresStandby {
            dir,
            primary,
            standby,
        }
    }

    /// The `--store` URL: both hosts, the writable one chosen.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// `pg_ctl promote` of the standby; waits until it takes writes.
    pub fn promote(&self) {
        let out = as_postgres(&postgres_bin("pg_ctl"))
            .arg("-D")
            .arg(&self.standby.dir)
            .args(["-w", "promote"])
            .output()
            .expect("run pg_ctl promote");
        assert!(
            out.status.success(),
            "pg_ctl promote: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        wait_for(
            "the standby to leave recovery",
            Duration::from_secs(30),
            || psql(self.standby.port, "SELECT pg_is_in_recovery()").as_deref() == Some("f"),
        );
    }

    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}

/// One query through psql on the server at `port`: its one value, or
/// `None` if it fails.
fn psql(port: u16, sql: &str) -> Option<String> {
    let out = Command::new(postgres_bin("psql"))
        .args(["-XAtq", "-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-U", "postgres", "-d", "postgres", "-c", sql])
        .env("PGCONNECT_TIMEOUT", "2")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A three-member etcd on loopback, with quick elections (heartbeat 50 ms,
/// election timeout 250 ms).
pub struct EtcdCluster {
    _dir: tempfile::TempDir,
    pub members: Vec<Node>,
}

impl EtcdCluster {
    pub fn start() -> EtcdCluster {
        let bin = PathBuf::from(require("etcd", "etcd-server"));
        let dir = scratch_dir();
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let cluster: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut members: Vec<Node> = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let d = dir.path().join(format!("m{i}"));
                let args = [
                    "--name".to_string(),
                    format!("m{i}"),
                    "--data-dir".into(),
                    d.join("data").display().to_string(),
                    "--listen-client-urls".into(),
                    format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls".into(),
                    format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls".into(),
                    format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls".into(),
                    format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster".into(),
                    cluster.join(","),
                    "--initial-cluster-state".into(),
                    "new".into(),
                    "--initial-cluster-token".into(),
                    "fencegate-test".into(),
                    "--heartbeat-interval".into(),
                    "50".into(),
                    "--election-timeout".into(),
                    "250".into(),
                ];
                Node::new(*client, d, bin.clone(), args.to_vec())
            })
            .collect();
        // Each member waits for the others before it serves: start all,
        // then wait.
        for m in &mut members {
            let log = std::fs::File::create(m.dir.join("server.log")).unwrap();
            let child = Command::new(&m.program)
                .args(&m.args)
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("start etcd");
            m.child = Some(child);
        }
        for m in &mut members {
            m.wait_listening();
        }
        let c = EtcdCluster { _dir: dir, members };
        wait_for("an etcd leader", Duration::from_secs(30), || {
            c.leader().is_some()
        });
        c
    }

    /// The `--store` URL: every member.
    pub fn url(&self) -> String {
        format!("etcd://{}", addresses(&self.members))
    }

    /// The index of the member that is leader, as a live member reports.
    pub fn leader(&self) -> Option<usize> {
        let statuses: Vec<(String, String)> = self
            .members
            .iter()
            .map(|m| {
                let s = etcd_status(m.port).unwrap_or_default();
                (json_field(&s, "member_id"), json_field(&s, "leader"))
            })
            .collect();
        let leader = statuses.iter().find(|(_, l)| !l.is_empty())?.1.clone();
        statuses.iter().position(|(id, _)| *id == leader)
    }

    /// Waits until a leader other than `old` (or any, for `None`) is
    /// elected; returns it.
    pub fn wait_leader(&self, not: Option<usize>) -> usize {
        let mut found = None;
        wait_for("an etcd leader", Duration::from_secs(30), || {
            found = self.leader().filter(|l| Some(*l) != not);
            found.is_some()
        });
        found.unwrap()
    }
}

/// `/v3/maintenance/status` of the member on `port`.
fn etcd_status(port: u16) -> Option<String> {
    let out = Command::new(require("curl", "curl"))
        .args(["-s", "-m", "1", "-X", "POST", "-d", "{}"])
        .arg(format!("http://127.0.0.1:{port}/v3/maintenance/status"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).to_string())
}

/// A string field of a flat JSON answer (`"name":"value"`), or "".
pub fn json_field(json: &str, name: &str) -> String {
    let key = format!("\"{name}\":\"");
    json.find(&key)
        .map(|i| &json[i + key.len()..])
        .and_then(|rest| rest.split('"').next())
        .unwrap_or("")
        .to_string()
}

/// A Redis Cluster of three primaries with one replica each, made by
/// `redis-cli --cluster create` as an operator makes one: each primary
/// owns a third of the slots, in ranges. A primary that stops answering
/// for `node_timeout` is failed over to its replica.
pub struct RedisCluster {
    _dir: tempfile::TempDir,
    pub nodes: Vec<Node>,
    /// On a cluster over TLS with passwords: how the test reaches it.
    tls: Option<ClusterTls>,
}

/// A cluster's TLS files and passwords: the nodes serve (and speak to
/// each other, `tls-cluster`) with `cert`, which is good for both ends;
/// the test's own calls are the `default` user's.
pub struct ClusterTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub root_password: String,
    /// fencegate's user and its password (keys `fencegate:*` only).
    pub user: String,
    pub password: String,
}

impl RedisCluster {
    pub fn start(node_timeout: Duration) -> RedisCluster {
        Self::start_shaped(3, 1, node_timeout, None)
    }

    /// `primaries` primaries with `replicas` replicas each, over TLS if
    /// `tls` is given.
    pub fn start_shaped(
        primaries: usize,
        replicas: usize,
        node_timeout: Duration,
        tls: Option<ClusterTls>,
    ) -> RedisCluster {
        let bin = PathBuf::from(require("redis-server", "redis-server"));
        // Both binaries checked before any node starts.
        require("redis-cli", "redis-tools");
        let dir = scratch_dir();
        let nodes: Vec<Node> = (0..primaries * (1 + replicas))
            .map(|i| {
                let port = free_port();
                let d = dir.path().join(format!("n{i}"));
                let mut args = durable_redis(port, &d);
                // The cluster bus on a port of its own: the default (the
                // port + 10000) lands in the ephemeral range, where any
                // outgoing connection may hold it.
                for (k, v) in [
                    ("--cluster-enabled", "yes".to_string()),
                    ("--cluster-config-file", "nodes.conf".to_string()),
                    (
                        "--cluster-node-timeout",
                        node_timeout.as_millis().to_string(),
                    ),
                    ("--cluster-port", free_port().to_string()),
                ] {
                    args.extend([k.to_string(), v]);
                }
                if let Some(t) = &tls {
                    let at = args.iter().position(|a| a == "--port").unwrap();
                    args[at + 1] = "0".into();
                    let path = |p: &PathBuf| p.display().to_string();
                    args.extend(
                        [
                            "--tls-port",
                            &port.to_string(),
                            "--tls-cluster",
                            "yes",
                            "--tls-replication",
                            "yes",
                            "--tls-auth-clients",
                            "yes",
                            "--tls-cert-file",
                            &path(&t.cert),
                            "--tls-key-file",
                            &path(&t.key),
                            "--tls-ca-cert-file",
                            &path(&t.ca),
                            "--masterauth",
                            &t.root_password,
                            // As the lone secure Redis (tests/common/
                            // servers.rs): the default user keeps a
                            // password rather than being turned off.
                            "--user",
                            "default",
                            "on",
                            &format!(">{}", t.root_password),
                            "~*",
                            "+@all",
                            "--user",
                            &t.user,
                            "on",
                            &format!(">{}", t.password),
                            "~fencegate:*",
                            "+@all",
                        ]
                        .map(String::from),
                    );
                }
                Node::new(port, d, bin.clone(), args)
            })
            .collect();
        let mut c = RedisCluster {
            _dir: dir,
            nodes,
            tls,
        };
        c.start_all();
        let addrs: Vec<String> = c
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut create: Vec<&str> = vec!["create"];
        create.extend(addrs.iter().map(String::as_str));
        let replicas = replicas.to_string();
        create.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
        c.cli(&create);
        c.wait_settled();
        c
    }

    /// The `--store` URL (two seeds: any node will do).
    pub fn url(&self) -> String {
        let (scheme, user) = match &self.tls {
            None => ("redis", String::new()),
            Some(t) => ("rediss", format!("{}@", t.user)),
        };
        format!(
            "{scheme}+cluster://{user}127.0.0.1:{},127.0.0.1:{}",
            self.nodes[0].port, self.nodes[1].port
        )
    }

    /// One command to the node on `port` (as the `default` user over TLS
    /// on a secure cluster); `None` if it does not answer within a second.
    pub fn query<T: redis::FromRedisValue>(&self, port: u16, cmd: &redis::Cmd) -> Option<T> {
        let Some(t) = &self.tls else {
            return redis_query(port, cmd);
        };
        use redis::IntoConnectionInfo;
        let info = format!("rediss://127.0.0.1:{port}/")
            .into_connection_info()
            .ok()?;
        let settings = info.redis_settings().clone().set_password(&t.root_password);
        let client = redis::Client::build_with_tls(
            info.set_redis_settings(settings),
            redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: std::fs::read(&t.cert).ok()?,
                    client_key: std::fs::read(&t.key).ok()?,
                }),
                root_cert: Some(std::fs::read(&t.ca).ok()?),
            },
        )
        .ok()?;
        let mut c = client
            .get_connection_with_timeout(Duration::from_secs(1))
            .ok()?;
        c.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        cmd.query(&mut c).ok()
    }

    /// Every node started (again, on its data and `nodes.conf`).
    pub fn start_all(&mut self) {
        for n in &mut self.nodes {
            if n.child.is_none() {
                n.start();
            }
        }
    }

    /// Every node killed (`kill -9`; data stays).
    pub fn kill_all(&mut self) {
        for n in &mut self.nodes {
            n.kill9();
        }
    }

    /// Every node stopped (SIGSTOP) for `d`, then let go on.
    pub async fn freeze(&self, d: Duration) {
        for n in &self.nodes {
            n.stop();
        }
        tokio::time::sleep(d).await;
        for n in &self.nodes {
            n.cont();
        }
    }

    /// A copy of every node's data, taken with the nodes stopped; where.
    pub fn backup(&mut self, to: &std::path::Path) {
        self.kill_all();
        for n in &self.nodes {
            let ok = Command::new("cp")
                .arg("-a")
                .arg(n.dir.join("appendonlydir"))
                .arg(to.join(n.port.to_string()))
                .status()
                .unwrap();
            assert!(ok.success(), "cp -a of a node's data");
        }
        self.start_all();
        self.wait_settled();
    }

    /// Every node's data replaced by the copy [`Self::backup`] took (each
    /// keeps its identity, `nodes.conf`).
    pub fn restore(&mut self, from: &std::path::Path) {
        self.kill_all();
        for n in &self.nodes {
            let data = n.dir.join("appendonlydir");
            std::fs::remove_dir_all(&data).unwrap();
            let ok = Command::new("cp")
                .arg("-a")
                .arg(from.join(n.port.to_string()))
                .arg(&data)
                .status()
                .unwrap();
            assert!(ok.success(), "cp -a of a node's backup");
        }
        self.start_all();
        self.wait_settled();
    }

    /// Every primary's keys removed while it runs (`FLUSHALL`).
    pub fn wipe(&self) {
        for n in &self.nodes {
            // A replica refuses (read-only) and follows its primary.
            let _: Option<String> = self.query(n.port, &redis::cmd("FLUSHALL"));
        }
    }

    /// The write leases held, over every node.
    pub fn leases(&self) -> usize {
        let mut total = 0;
        for n in &self.nodes {
            let keys: Vec<String> = self
                .query(n.port, redis::cmd("KEYS").arg("fencegate:*:l:*"))
                .expect("KEYS of a node");
            for k in keys {
                total += self
                    .query::<usize>(n.port, redis::cmd("HLEN").arg(&k))
                    .expect("HLEN of a lease");
            }
        }
        total
    }

    /// `CLUSTER NODES` as one live node sees it.
    fn cluster_nodes(&self) -> Option<String> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .find_map(|n| self.query(n.port, redis::cmd("CLUSTER").arg("NODES")))
    }

    /// The port of the primary serving `slot`, as the cluster says.
    pub fn primary_of(&self, slot: u16) -> Option<u16> {
        let nodes = self.cluster_nodes()?;
        nodes.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = f.get(2)?;
            if !flags.contains("master") || flags.contains("fail") {
                return None;
            }
            let owns = f[8..].iter().any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                match (a.parse::<u16>(), b.parse::<u16>()) {
                    (Ok(a), Ok(b)) => (a..=b).contains(&slot),
                    _ => false,
                }
            });
            owns.then(|| f[1].split(['@', ':']).nth(1)?.parse().ok())?
        })
    }

    /// How many slots the primary on `port` serves.
    pub fn slots_of(&self, port: u16) -> usize {
        let nodes = self.cluster_nodes().expect("CLUSTER NODES");
        nodes
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|f| {
                f.len() > 8 && f[1].split(['@', ':']).nth(1) == Some(port.to_string().as_str())
            })
            .flat_map(|f| f[8..].iter().map(|r| r.to_string()).collect::<Vec<_>>())
            .filter_map(|r| {
                let (a, b) = r.split_once('-').unwrap_or((&r, &r));
                Some(b.parse::<usize>().ok()? - a.parse::<usize>().ok()? + 1)
            })
            .sum()
    }

    /// Whether the server on `port` is a primary that owns slots.
    pub fn primary_of_port_is_primary(&self, port: u16) -> bool {
        let Some(nodes) = self.cluster_nodes() else {
            return false;
        };
        nodes.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 8
                && f[2].contains("master")
                && f[1].split(['@', ':']).nth(1) == Some(port.to_string().as_str())
        })
    }

    /// The node id of the server on `port`.
    pub fn id_of(&self, port: u16) -> String {
        self.query(port, redis::cmd("CLUSTER").arg("MYID"))
            .expect("CLUSTER MYID")
    }

    /// The server on `port`.
    pub fn node(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node on that port")
    }

    /// The slot of a key (`CLUSTER KEYSLOT`).
    pub fn slot_of(&self, key: &str) -> u16 {
        self.query(
            self.nodes[0].port,
            redis::cmd("CLUSTER").arg("KEYSLOT").arg(key),
        )
        .expect("CLUSTER KEYSLOT")
    }

    /// Waits until every live node says the cluster is ok and agrees on
    /// who serves every slot.
    pub fn wait_settled(&self) {
        wait_for("the cluster to be ok", Duration::from_secs(60), || {
            self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                self.query::<String>(n.port, redis::cmd("CLUSTER").arg("INFO"))
                    .is_some_and(|i| i.contains("cluster_state:ok"))
            })
        });
    }

    /// Waits until `redis-cli --cluster check` passes: every node agrees
    /// on who serves each slot, none is left open (a tool refuses to
    /// reshard a cluster before that).
    pub fn wait_agreed(&self) {
        let seed = self
            .nodes
            .iter()
            .find(|n| n.child.is_some())
            .map(|n| format!("127.0.0.1:{}", n.port))
            .expect("a live node");
        wait_for("the nodes to agree", Duration::from_secs(60), || {
            self.cli_command(&["check", &seed])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    }

    /// Waits until a node other than `old` serves `slot` as a primary.
    pub fn wait_promoted(&self, old: u16, slot: u16) -> u16 {
        let mut new = None;
        wait_for(
            "the cluster to promote a replica",
            Duration::from_secs(60),
            || {
                new = self.primary_of(slot).filter(|p| *p != old);
                new.is_some()
            },
        );
        self.wait_settled();
        new.unwrap()
    }

    /// `redis-cli --cluster reshard`: `slots` slots moved from the primary
    /// on `from` to the one on `to`, keys and all, while clients work.
    pub fn reshard(&self, from: u16, to: u16, slots: usize) {
        self.cli(&[
            "reshard",
            &format!("127.0.0.1:{from}"),
            "--cluster-from",
            &self.id_of(from),
            "--cluster-to",
            &self.id_of(to),
            "--cluster-slots",
            &slots.to_string(),
            "--cluster-yes",
        ]);
        self.wait_settled();
        self.wait_agreed();
    }

    /// `redis-cli --cluster rebalance --cluster-use-empty-masters`: slots
    /// moved until the primaries own about as many each, those that own
    /// none included.
    pub fn rebalance(&self) {
        self.wait_agreed();
        self.cli(&[
            "rebalance",
            &format!("127.0.0.1:{}", self.nodes[0].port),
            "--cluster-use-empty-masters",
        ]);
        self.wait_settled();
    }

    /// `redis-cli [TLS] --cluster ARGS...`.
    fn cli_command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(require("redis-cli", "redis-tools"));
        if let Some(t) = &self.tls {
            c.arg("--tls")
                .arg("--cacert")
                .arg(&t.ca)
                .arg("--cert")
                .arg(&t.cert)
                .arg("--key")
                .arg(&t.key)
                .args(["--user", "default", "--pass", &t.root_password])
                .arg("--no-auth-warning");
        }
        c.arg("--cluster").args(args);
        c
    }

    /// `redis-cli --cluster ARGS...`, which must succeed.
    fn cli(&self, args: &[&str]) {
        let out = self
            .cli_command(args)
            .output()
            .expect("run redis-cli --cluster");
        assert!(
            out.status.success(),
            "redis-cli --cluster {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

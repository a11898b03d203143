//! Real store servers for the shared-store suite: redis-server, PostgreSQL
//! (initdb + postgres) and etcd, each in a temp dir on a free loopback port.
//! A missing binary fails the test with what to install.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Embedded,
    Redis,
    Postgres,
    Etcd,
}

/// A running store server (or, for the embedded store, a directory).
pub struct StoreServer {
    pub kind: StoreKind,
    pub dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn require(bin: &str, package: &str) -> String {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    assert!(
        !found.is_empty(),
        "{bin} not found: install the Debian package `{package}` (scripts/test does)"
    );
    found
}

fn postgres_bin(name: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    let bin = dirs.last().map(|d| d.join(name));
    match bin {
        Some(b) if b.exists() => b,
        _ => panic!("PostgreSQL's {name} not found under /usr/lib/postgresql: install the Debian package `postgresql` (scripts/test does)"),
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// PostgreSQL refuses to run as root: run it as the `postgres` user then.
fn as_postgres(bin: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

fn wait_port(port: u16, what: &str, child: &mut Child, dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let logs: String = ["redis.log", "postgres.log", "etcd.log"]
                .iter()
                .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
                .collect();
            panic!("{what} exited during start: {status}\n{logs}");
        }
        assert!(Instant::now() < deadline, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl StoreServer {
    /// A new server, initialised with `fencegate init-store` as an operator
    /// does before the first replica starts.
    pub fn start(kind: StoreKind) -> StoreServer {
        let s = Self::start_uninitialised(kind);
        if kind != StoreKind::Embedded {
            s.initialise();
        }
        s
    }

    /// A new server that no fencegate has marked yet.
    pub fn start_uninitialised(kind: StoreKind) -> StoreServer {
        let dir = tempfile::tempdir().unwrap();
        let mut s = StoreServer {
            kind,
            dir,
            port: free_port(),
            child: None,
        };
        if kind == StoreKind::Postgres {
            let data = s.dir.path().join("pg");
            std::fs::create_dir_all(&data).unwrap();
            if is_root() {
                let ok = Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(s.dir.path())
                    .status()
                    .unwrap()
                    .success();
                assert!(ok, "chown for postgres failed");
            }
            let out = as_postgres(&postgres_bin("initdb"))
                .args(["-D"])
                .arg(&data)
                .args(["-A", "trust", "-U", "postgres", "--no-sync"])
                .output()
                .expect("run initdb");
            assert!(
                out.status.success(),
                "initdb: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        s.run();
        s
    }

    /// `fencegate init-store`, as an operator runs it once on a new store
    /// (retried while the server is still starting up).
    pub fn initialise(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new(super::bin())
                .args(["init-store", "--store", &self.url()])
                .output()
                .expect("run fencegate init-store");
            if out.status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "fencegate init-store failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The `--store` value.
    pub fn url(&self) -> String {
        match self.kind {
            StoreKind::Embedded => self.dir.path().join("fences.redb").display().to_string(),
            StoreKind::Redis => format!("redis://127.0.0.1:{}/0", self.port),
            StoreKind::Postgres => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
            StoreKind::Etcd => format!("etcd://127.0.0.1:{}", self.port),
        }
    }

    fn run(&mut self) {
        let p = self.port;
        let dir = self.dir.path().to_path_buf();
        let log = |name: &str| std::fs::File::create(dir.join(name)).unwrap();
        let mut child = match self.kind {
            StoreKind::Embedded => return,
            StoreKind::Redis => Command::new(require("redis-server", "redis-server"))
                .args([
                    "--port",
                    &p.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                ])
                .args(["--appendfsync", "always", "--protected-mode", "no", "--dir"])
                .arg(&dir)
                .stdout(log("redis.log"))
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server"),
            StoreKind::Postgres => as_postgres(&postgres_bin("postgres"))
                .arg("-D")
                .arg(dir.join("pg"))
                .args([
                    "-p",
                    &p.to_string(),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-k",
                ])
                .arg(&dir)
                .stdout(Stdio::null())
                .stderr(log("postgres.log"))
                .spawn()
                .expect("start postgres"),
            StoreKind::Etcd => {
                let peer = free_port();
                Command::new(require("etcd", "etcd-server"))
                    .args(["--name", "default", "--data-dir"])
                    .arg(dir.join("etcd"))
                    .args(["--listen-client-urls", &format!("http://127.0.0.1:{p}")])
                    .args(["--advertise-client-urls", &format!("http://127.0.0.1:{p}")])
                    .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                    .args([
                        "--initial-advertise-peer-urls",
                        &format!("http://127.0.0.1:{peer}"),
                    ])
                    .args([
                        "--initial-cluster",
                        &format!("default=http://127.0.0.1:{peer}"),
                    ])
                    .stdout(Stdio::null())
                    .stderr(log("etcd.log"))
                    .spawn()
                    .expect("start etcd")
            }
        };
        wait_port(p, &format!("{:?}", self.kind), &mut child, &dir);
        if self.kind == StoreKind::Etcd {
            // Listening comes before serving: wait for a real answer.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !etcd_ready(p) {
                assert!(Instant::now() < deadline, "etcd never answered");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if self.kind == StoreKind::Postgres {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let ok = Command::new(postgres_bin("pg_isready"))
                    .args(["-h", "127.0.0.1", "-p", &p.to_string()])
                    .stdout(Stdio::null())
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false);
                if ok {
                    break;
                }
                assert!(Instant::now() < deadline, "postgres never became ready");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.child = Some(child);
    }

    /// `kill -9` of the server (data stays).
    /// Freezes the server (SIGSTOP) for `d`, then lets it go on: requests
    /// already sent are applied late, after their senders gave up.
    pub async fn freeze(&self, d: Duration) {
        let pid = self.child.as_ref().expect("running").id();
        super::signal(pid, "STOP");
        tokio::time::sleep(d).await;
        super::signal(pid, "CONT");
    }

    /// The number of write leases Redis holds, over every key.
    pub async fn redis_leases(&self) -> usize {
        assert_eq!(self.kind, StoreKind::Redis);
        let client = redis::Client::open(self.url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("fencegate:l:*")
            .query_async(&mut c)
            .await
            .unwrap();
        let mut n = 0;
        for k in keys {
            let len: usize = redis::cmd("HLEN")
                .arg(&k)
                .query_async(&mut c)
                .await
                .unwrap();
            n += len;
        }
        n
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            // runuser forwards nothing on SIGKILL: kill the whole group of
            // processes listening on the port instead.
            let _ = Command::new("pkill")
                .args(["-9", "-f", &format!("{}", self.dir.path().display())])
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the server again on the same port and data.
    pub fn restart(&mut self) {
        if self.kind == StoreKind::Postgres {
            // What a killed postmaster leaves behind (the "crash").
            let _ = std::fs::remove_file(self.dir.path().join("pg").join("postmaster.pid"));
            let _ =
                std::fs::remove_file(self.dir.path().join(format!(".s.PGSQL.{}.lock", self.port)));
            let _ = std::fs::remove_file(self.dir.path().join(format!(".s.PGSQL.{}", self.port)));
        }
        self.run();
    }

    /// Makes the store lose its data while it keeps running (a restart
    /// without persistence, a restored empty backup).
    pub async fn wipe(&self) {
        match self.kind {
            StoreKind::Embedded => panic!("the embedded store has no wipe"),
            StoreKind::Redis => {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                    .await
                    .unwrap();
                s.write_all(b"*1\r\n$8\r\nFLUSHALL\r\n").await.unwrap();
                let mut buf = [0u8; 5];
                s.read_exact(&mut buf).await.unwrap();
                assert_eq!(&buf, b"+OK\r\n");
            }
            StoreKind::Postgres => {
                let (client, conn) = tokio_postgres::connect(
                    &format!(
                        "host=127.0.0.1 port={} user=postgres dbname=postgres",
                        self.port
                    ),
                    tokio_postgres::NoTls,
                )
                .await
                .unwrap();
                tokio::spawn(conn);
                client
                    .batch_execute("TRUNCATE fencegate_fences, fencegate_leases, fencegate_marker")
                    .await
                    .unwrap();
            }
            StoreKind::Etcd => {
                let body = r#"{"key":"AA==","range_end":"AA=="}"#;
                let a = super::send(
                    "POST",
                    &format!("http://127.0.0.1:{}/v3/kv/deleterange", self.port),
                    &[("content-type", "application/json")],
                    body,
                )
                .await;
                assert!(a.status.is_success(), "{}", a.text());
            }
        }
    }
}

fn etcd_ready(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let body = r#"{"key":"AA=="}"#;
    let req = format!(
        "POST /v3/kv/range HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.kill9();
    }
}

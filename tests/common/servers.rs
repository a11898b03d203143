//! Real store servers for the shared-store suite: redis-server, PostgreSQL
//! (initdb + postgres) and etcd, each in a temp dir on a free loopback port.
//! A missing binary fails the test with what to install.
//!
//! [`StoreServer::start_secure`] runs them as production does: TLS only
//! (certificates from a CA made for the test), client certificates
//! required, and a password-protected user for fencegate (a Redis ACL user
//! with the default user off, a PostgreSQL role behind `hostssl ...
//! scram-sha-256 clientcert=verify-ca`, etcd with auth enabled).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Embedded,
    Redis,
    /// Three primaries without replicas (tests/common/cluster.rs): the
    /// store as a whole, as a lone server is.
    RedisCluster,
    Postgres,
    Etcd,
}

/// A running store server (or, for the embedded store, a directory).
pub struct StoreServer {
    pub kind: StoreKind,
    pub dir: tempfile::TempDir,
    pub port: u16,
    child: Option<Child>,
    pub secure: Option<Secure>,
    /// The nodes, for [`StoreKind::RedisCluster`].
    cluster: Option<super::cluster::RedisCluster>,
}

/// The files of a TLS store with credentials.
pub struct Secure {
    /// The CA that signed the server's and the client's certificates.
    pub ca: PathBuf,
    pub server: super::tls::Leaf,
    pub client: super::tls::Leaf,
    /// fencegate's password, and a file holding it.
    pub password: String,
    pub password_file: PathBuf,
    /// Another CA, which signed nothing here.
    pub wrong_ca: PathBuf,
    /// The password of etcd's root user and of Redis's default user (auth
    /// setup and test helpers).
    pub root_password: String,
}

/// The user fencegate connects as on secure stores.
pub const STORE_USER: &str = "fencegate";

impl Secure {
    fn new(dir: &Path, kind: StoreKind) -> Secure {
        let tls_dir = dir.join("tls");
        std::fs::create_dir_all(&tls_dir).unwrap();
        let ca = super::tls::TestCa::new(&tls_dir, "store-ca");
        let wrong = super::tls::TestCa::new(&tls_dir, "other-ca");
        let server = ca.peer("store-server");
        let client = if kind == StoreKind::Etcd {
            ca.client_without_name(STORE_USER)
        } else {
            ca.client(STORE_USER)
        };
        // PostgreSQL refuses a key that others can read.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&server.key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let password = format!("pw-{}", free_port());
        let password_file = tls_dir.join("password");
        std::fs::write(&password_file, format!("{password}\n")).unwrap();
        Secure {
            ca: ca.pem.clone(),
            server,
            client,
            password,
            password_file,
            wrong_ca: wrong.pem.clone(),
            root_password: format!("root-{}", free_port()),
        }
    }
}

/// `fencegate init-store` on `url`, as an operator runs it once on a new
/// store (retried while the server is still starting up or settling).
pub fn init_store(url: &str) {
    init_store_with(url, &[]);
}

/// [`init_store`] with the flags a secure store needs.
fn init_store_with(url: &str, args: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new(super::bin())
            .args(["init-store", "--store", url])
            .args(args)
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

/// A loopback port for a server started later (its binary binds it, after
/// an `initdb` that can take seconds). Below the ephemeral range: a port
/// the kernel hands out for `:0` can meanwhile become another test's
/// outgoing connection's source port, and the server then fails to bind
/// ("postgres never became ready", seen in CI). Never the same one twice
/// in a process.
pub fn free_port() -> u16 {
    use std::hash::BuildHasher;
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    if low > 11000 {
        let random = std::collections::hash_map::RandomState::new();
        for i in 0..1000u32 {
            let port = 10000 + (random.hash_one(i) % u64::from(low - 10000)) as u16;
            if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return port;
            }
        }
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    given.push(port);
    port
}

pub fn require(bin: &str, package: &str) -> String {
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

pub fn postgres_bin(name: &str) -> PathBuf {
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

/// A new PostgreSQL cluster in `dir/pg` (trust authentication, user
/// `postgres`), `dir` handed to the `postgres` user when run as root.
pub fn initdb(dir: &Path) -> PathBuf {
    let data = dir.join("pg");
    std::fs::create_dir_all(&data).unwrap();
    if is_root() {
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "chown for postgres failed");
    }
    let out = as_postgres(&postgres_bin("initdb"))
        .arg("-D")
        .arg(&data)
        .args(["-A", "trust", "-U", "postgres", "--no-sync"])
        .output()
        .expect("run initdb");
    assert!(
        out.status.success(),
        "initdb: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    data
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// PostgreSQL refuses to run as root: run it as the `postgres` user then.
pub fn as_postgres(bin: &Path) -> Command {
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

    /// A new server over TLS with credentials (see the module doc),
    /// initialised with `fencegate init-store`.
    pub fn start_secure(kind: StoreKind) -> StoreServer {
        let s = Self::start_with(kind, true);
        s.initialise();
        s
    }

    /// A new server that no fencegate has marked yet.
    pub fn start_uninitialised(kind: StoreKind) -> StoreServer {
        Self::start_with(kind, false)
    }

    /// A new server, secure or not, that no fencegate has marked yet.
    pub fn start_with(kind: StoreKind, secure: bool) -> StoreServer {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            !secure || kind != StoreKind::Embedded,
            "the embedded store has no TLS"
        );
        let secure = secure.then(|| Secure::new(dir.path(), kind));
        let mut s = StoreServer {
            kind,
            dir,
            port: free_port(),
            child: None,
            secure,
            cluster: None,
        };
        if kind == StoreKind::Postgres {
            initdb(s.dir.path());
        }
        s.run();
        if s.secure.is_some() {
            s.create_user();
        }
        s
    }

    /// The fencegate user, with its password, on a secure server.
    fn create_user(&self) {
        let sec = self.secure.as_ref().expect("secure");
        match self.kind {
            // On the command line (see `run`).
            StoreKind::Redis | StoreKind::RedisCluster | StoreKind::Embedded => {}
            StoreKind::Postgres => {
                let sql = format!(
                    "CREATE ROLE {STORE_USER} LOGIN PASSWORD '{}'; CREATE DATABASE {STORE_USER} OWNER {STORE_USER};",
                    sec.password
                );
                for stmt in sql.split_inclusive(';') {
                    let out = as_postgres(&postgres_bin("psql"))
                        .arg("-h")
                        .arg(self.dir.path())
                        .args([
                            "-p",
                            &self.port.to_string(),
                            "-U",
                            "postgres",
                            "-d",
                            "postgres",
                        ])
                        .args(["-v", "ON_ERROR_STOP=1", "-c", stmt.trim()])
                        .output()
                        .expect("run psql");
                    assert!(
                        out.status.success(),
                        "psql {stmt}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
            StoreKind::Etcd => {
                let rw = format!(
                    r#"{{"name":"fg","perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                    b64("fencegate/"),
                    b64("fencegate0")
                );
                for (path, body) in [
                    (
                        "user/add",
                        format!(r#"{{"name":"root","password":"{}"}}"#, sec.root_password),
                    ),
                    ("user/grant", r#"{"user":"root","role":"root"}"#.to_string()),
                    ("role/add", r#"{"name":"fg"}"#.to_string()),
                    ("role/grant", rw),
                    (
                        "user/add",
                        format!(r#"{{"name":"{STORE_USER}","password":"{}"}}"#, sec.password),
                    ),
                    (
                        "user/grant",
                        format!(r#"{{"user":"{STORE_USER}","role":"fg"}}"#),
                    ),
                    ("enable", "{}".to_string()),
                ] {
                    self.etcd_call(&format!("/v3/auth/{path}"), &body, None);
                }
            }
        }
    }

    /// A call to the secure etcd over curl (https with the client
    /// certificate); fails the test unless etcd answers 200.
    pub fn etcd_call(&self, path: &str, body: &str, token: Option<&str>) -> String {
        let sec = self.secure.as_ref().expect("secure");
        let mut c = Command::new(require("curl", "curl"));
        c.args(["-sS", "--fail-with-body", "--cacert"])
            .arg(&sec.ca)
            .arg("--cert")
            .arg(&sec.client.cert)
            .arg("--key")
            .arg(&sec.client.key)
            .args([
                "-X",
                "POST",
                "-H",
                "content-type: application/json",
                "-d",
                body,
            ]);
        if let Some(t) = token {
            c.args(["-H", &format!("authorization: {t}")]);
        }
        let out = c
            .arg(format!("https://127.0.0.1:{}{path}", self.port))
            .output()
            .expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "etcd {path}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    }

    /// An auth token of etcd's root user.
    fn etcd_root_token(&self) -> String {
        let sec = self.secure.as_ref().expect("secure");
        let v = self.etcd_call(
            "/v3/auth/authenticate",
            &format!(r#"{{"name":"root","password":"{}"}}"#, sec.root_password),
            None,
        );
        let start = v.find(r#""token":""#).expect("a token") + 9;
        v[start..start + v[start..].find('"').unwrap()].to_string()
    }

    /// The flags that give fencegate this server's CA, client certificate
    /// and password (none for a plain server).
    pub fn proxy_args(&self) -> Vec<String> {
        let Some(sec) = &self.secure else {
            return Vec::new();
        };
        let p = |p: &Path| p.display().to_string();
        vec![
            "--store-ca".into(),
            p(&sec.ca),
            "--store-client-cert".into(),
            p(&sec.client.cert),
            "--store-client-key".into(),
            p(&sec.client.key),
            "--store-password-file".into(),
            p(&sec.password_file),
        ]
    }

    /// `fencegate init-store`, as an operator runs it once on a new store
    /// (retried while the server is still starting up).
    pub fn initialise(&self) {
        init_store_with(&self.url(), &self.proxy_args());
    }

    /// The `--store` value.
    pub fn url(&self) -> String {
        if let Some(c) = &self.cluster {
            return c.url();
        }
        let p = self.port;
        match (self.kind, &self.secure) {
            (StoreKind::Embedded, _) => self.dir.path().join("fences.redb").display().to_string(),
            (StoreKind::Redis, None) => format!("redis://127.0.0.1:{p}/0"),
            (StoreKind::Postgres, None) => format!("postgres://postgres@127.0.0.1:{p}/postgres"),
            (StoreKind::Etcd, None) => format!("etcd://127.0.0.1:{p}"),
            (StoreKind::Redis, Some(_)) => format!("rediss://{STORE_USER}@127.0.0.1:{p}/0"),
            (StoreKind::Postgres, Some(_)) => {
                format!("postgres://{STORE_USER}@127.0.0.1:{p}/{STORE_USER}?sslmode=verify-full")
            }
            (StoreKind::Etcd, Some(_)) => format!("etcds://{STORE_USER}@127.0.0.1:{p}"),
            (StoreKind::RedisCluster, _) => unreachable!("a cluster's URL is its own"),
        }
    }

    /// A Redis client for the test's own calls (TLS and the password on a
    /// secure server).
    pub fn redis_client(&self) -> redis::Client {
        assert_eq!(self.kind, StoreKind::Redis);
        match &self.secure {
            None => redis::Client::open(self.url()).unwrap(),
            Some(sec) => {
                use redis::IntoConnectionInfo;
                let info = self.url().into_connection_info().unwrap();
                let settings = info.redis_settings().clone().set_password(&sec.password);
                redis::Client::build_with_tls(
                    info.set_redis_settings(settings),
                    redis::TlsCertificates {
                        client_tls: Some(redis::ClientTlsConfig {
                            client_cert: std::fs::read(&sec.client.cert).unwrap(),
                            client_key: std::fs::read(&sec.client.key).unwrap(),
                        }),
                        root_cert: Some(std::fs::read(&sec.ca).unwrap()),
                    },
                )
                .unwrap()
            }
        }
    }

    fn run(&mut self) {
        let p = self.port;
        let dir = self.dir.path().to_path_buf();
        let log = |name: &str| std::fs::File::create(dir.join(name)).unwrap();
        let sec = self.secure.as_ref();
        let path = |p: &Path| p.display().to_string();
        let mut child = match self.kind {
            StoreKind::Embedded => return,
            StoreKind::RedisCluster => {
                match &mut self.cluster {
                    Some(c) => {
                        c.start_all();
                        c.wait_settled();
                    }
                    None => {
                        let tls = sec.map(|sec| super::cluster::ClusterTls {
                            ca: sec.ca.clone(),
                            cert: sec.server.cert.clone(),
                            key: sec.server.key.clone(),
                            root_password: sec.root_password.clone(),
                            user: STORE_USER.into(),
                            password: sec.password.clone(),
                        });
                        let c = super::cluster::RedisCluster::start_shaped(
                            3,
                            0,
                            Duration::from_secs(5),
                            tls,
                        );
                        self.port = c.nodes[0].port;
                        self.cluster = Some(c);
                    }
                }
                return;
            }
            StoreKind::Redis => {
                let mut c = Command::new(require("redis-server", "redis-server"));
                match sec {
                    None => c.args(["--port", &p.to_string()]),
                    Some(sec) => c
                        .args(["--port", "0", "--tls-port", &p.to_string()])
                        .args(["--tls-cert-file", &path(&sec.server.cert)])
                        .args(["--tls-key-file", &path(&sec.server.key)])
                        .args(["--tls-ca-cert-file", &path(&sec.ca)])
                        .args(["--tls-auth-clients", "yes"])
                        // Not `user default off`: Redis (7.0.15 seen) replays
                        // its AOF as the default user and drops, at restart,
                        // every script write that user may not run (the
                        // fences; fencegate then refuses writes as amnesia).
                        // A password of its own keeps it closed.
                        .args(["--user", "default", "on"])
                        .arg(format!(">{}", sec.root_password))
                        .args(["~*", "+@all"])
                        .args(["--user", STORE_USER, "on"])
                        .arg(format!(">{}", sec.password))
                        .args(["~fencegate:*", "+@all"]),
                };
                c.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"])
                    .args(["--appendfsync", "always", "--protected-mode", "no", "--dir"])
                    .arg(&dir)
                    .stdout(log("redis.log"))
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start redis-server")
            }
            StoreKind::Postgres => {
                let mut c = as_postgres(&postgres_bin("postgres"));
                c.arg("-D")
                    .arg(dir.join("pg"))
                    .args([
                        "-p",
                        &p.to_string(),
                        "-c",
                        "listen_addresses=127.0.0.1",
                        "-k",
                    ])
                    .arg(&dir);
                if let Some(sec) = sec {
                    let hba = dir.join("tls").join("pg_hba.conf");
                    std::fs::write(
                        &hba,
                        "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256 clientcert=verify-ca\n",
                    )
                    .unwrap();
                    for setting in [
                        "ssl=on".to_string(),
                        format!("ssl_cert_file={}", path(&sec.server.cert)),
                        format!("ssl_key_file={}", path(&sec.server.key)),
                        format!("ssl_ca_file={}", path(&sec.ca)),
                        format!("hba_file={}", path(&hba)),
                    ] {
                        c.args(["-c", &setting]);
                    }
                    if is_root() {
                        let _ = Command::new("chown")
                            .args(["-R", "postgres:postgres"])
                            .arg(dir.join("tls"))
                            .status();
                    }
                }
                c.stdout(Stdio::null())
                    .stderr(log("postgres.log"))
                    .spawn()
                    .expect("start postgres")
            }
            StoreKind::Etcd => {
                let peer = free_port();
                let scheme = if sec.is_some() { "https" } else { "http" };
                let mut c = Command::new(require("etcd", "etcd-server"));
                c.args(["--name", "default", "--data-dir"])
                    .arg(dir.join("etcd"))
                    .args(["--listen-client-urls", &format!("{scheme}://127.0.0.1:{p}")])
                    .args([
                        "--advertise-client-urls",
                        &format!("{scheme}://127.0.0.1:{p}"),
                    ])
                    .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                    .args([
                        "--initial-advertise-peer-urls",
                        &format!("http://127.0.0.1:{peer}"),
                    ])
                    .args([
                        "--initial-cluster",
                        &format!("default=http://127.0.0.1:{peer}"),
                    ]);
                if let Some(sec) = sec {
                    c.args(["--cert-file", &path(&sec.server.cert)])
                        .args(["--key-file", &path(&sec.server.key)])
                        .args(["--trusted-ca-file", &path(&sec.ca)])
                        .arg("--client-cert-auth");
                }
                c.stdout(Stdio::null())
                    .stderr(log("etcd.log"))
                    .spawn()
                    .expect("start etcd")
            }
        };
        wait_port(p, &format!("{:?}", self.kind), &mut child, &dir);
        if self.kind == StoreKind::Etcd {
            // Listening comes before serving: wait for a real answer.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !self.etcd_ready() {
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
        if let Some(c) = &self.cluster {
            return c.freeze(d).await;
        }
        let pid = self.child.as_ref().expect("running").id();
        super::signal(pid, "STOP");
        tokio::time::sleep(d).await;
        super::signal(pid, "CONT");
    }

    /// The number of write leases Redis holds, over every key.
    pub async fn redis_leases(&self) -> usize {
        if let Some(c) = &self.cluster {
            return tokio::task::block_in_place(|| c.leases());
        }
        assert_eq!(self.kind, StoreKind::Redis);
        let client = self.redis_client();
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
        if let Some(c) = &mut self.cluster {
            return c.kill_all();
        }
        if let Some(mut c) = self.child.take() {
            if self.kind == StoreKind::Postgres {
                self.kill9_postgres_backends();
            }
            // runuser forwards nothing on SIGKILL: kill the whole group of
            // processes listening on the port instead.
            // (The data directories only: fencegate's own command line
            // names files of this directory too, its certificates.)
            let _ = Command::new("pkill")
                .args([
                    "-9",
                    "-f",
                    &format!("{}/(pg|etcd)", self.dir.path().display()),
                ])
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The backends of a killed postmaster live on until they notice, still
    /// attached to its shared memory, and a restart meanwhile is refused
    /// ("pre-existing shared memory block is still in use"). So they are
    /// killed first, with the postmaster stopped so that it forks no more,
    /// and awaited: a stopped parent leaves them zombies, which hold no
    /// shared memory.
    fn kill9_postgres_backends(&self) {
        let data = self.data();
        let Some(postmaster) = std::fs::read_to_string(data.join("postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
        else {
            return;
        };
        // Only that postmaster: a stale file's number may be another's now.
        let ours = std::fs::read(format!("/proc/{postmaster}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&*data.to_string_lossy()));
        if !ours {
            return;
        }
        let _ = Command::new("kill").args(["-STOP", &postmaster]).status();
        let backends: Vec<String> = Command::new("pgrep")
            .args(["-P", &postmaster])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        if !backends.is_empty() {
            let _ = Command::new("kill").arg("-9").args(&backends).status();
        }
        let gone = |pid: &String| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
                // The state follows the command's closing parenthesis.
                stat.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !backends.iter().all(gone) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
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

    /// The store's data, as its server keeps it on disk.
    fn data(&self) -> std::path::PathBuf {
        let dir = self.dir.path();
        match self.kind {
            StoreKind::Redis => dir.join("appendonlydir"),
            StoreKind::RedisCluster => panic!("a cluster's data is its nodes'"),
            StoreKind::Postgres => dir.join("pg"),
            StoreKind::Etcd => dir.join("etcd"),
            StoreKind::Embedded => panic!("the embedded store has no server"),
        }
    }

    /// Takes a backup of the data (the server stopped, its files copied,
    /// the server started again); returns where it is.
    pub fn backup(&mut self) -> std::path::PathBuf {
        let to = self.dir.path().join("backup");
        if let Some(c) = &mut self.cluster {
            std::fs::create_dir_all(&to).unwrap();
            c.backup(&to);
            return to;
        }
        self.kill9();
        let ok = Command::new("cp")
            .arg("-a")
            .arg(self.data())
            .arg(&to)
            .status()
            .unwrap();
        assert!(ok.success(), "cp -a of the store's data");
        self.restart();
        to
    }

    /// Restores a backup taken by [`Self::backup`]: the server stopped, its
    /// data replaced, started again. What was written since is lost.
    pub fn restore(&mut self, backup: &std::path::Path) {
        if let Some(c) = &mut self.cluster {
            return c.restore(backup);
        }
        self.kill9();
        std::fs::remove_dir_all(self.data()).unwrap();
        let ok = Command::new("cp")
            .arg("-a")
            .arg(backup)
            .arg(self.data())
            .status()
            .unwrap();
        assert!(ok.success(), "cp -a of the backup");
        self.restart();
    }

    /// Makes the store lose its data while it keeps running (a restart
    /// without persistence, a restored empty backup).
    pub async fn wipe(&self) {
        match self.kind {
            StoreKind::Embedded => panic!("the embedded store has no wipe"),
            StoreKind::RedisCluster => {
                let c = self.cluster.as_ref().expect("a cluster");
                tokio::task::block_in_place(|| c.wipe());
            }
            StoreKind::Redis => {
                let mut c = self
                    .redis_client()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap();
                let ok: String = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
                assert_eq!(ok, "OK");
            }
            StoreKind::Postgres => {
                // Over the Unix socket, as the superuser (trusted there).
                let db = if self.secure.is_some() {
                    STORE_USER
                } else {
                    "postgres"
                };
                let (client, conn) = tokio_postgres::connect(
                    &format!(
                        "host={} port={} user=postgres dbname={db}",
                        self.dir.path().display(),
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
            StoreKind::Etcd if self.secure.is_some() => {
                let token = self.etcd_root_token();
                self.etcd_call(
                    "/v3/kv/deleterange",
                    r#"{"key":"AA==","range_end":"AA=="}"#,
                    Some(&token),
                );
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

impl StoreServer {
    fn etcd_ready(&self) -> bool {
        match &self.secure {
            None => etcd_ready(self.port),
            // With auth on, an answer without a token is a refusal: any
            // answer from etcd itself shows it serves.
            Some(sec) => Command::new(require("curl", "curl"))
                .args(["-sS", "--cacert"])
                .arg(&sec.ca)
                .arg("--cert")
                .arg(&sec.client.cert)
                .arg("--key")
                .arg(&sec.client.key)
                .args(["-X", "POST", "-d", r#"{"key":"AA=="}"#])
                .arg(format!("https://127.0.0.1:{}/v3/kv/range", self.port))
                .stderr(Stdio::null())
                .output()
                .map(|o| {
                    let body = String::from_utf8_lossy(&o.stdout);
                    body.contains("\"header\"") || body.contains("user name is empty")
                })
                .unwrap_or(false),
        }
    }
}

fn b64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
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

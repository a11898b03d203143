//! Test fixtures: a recording upstream, the real fencegate binary, a client.
//!
//! Every server binds `127.0.0.1:0`; nothing leaves loopback.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};

pub mod cluster;
pub mod history;
pub mod netns;
pub mod pg_on;
pub mod servers;
pub mod tls;
pub mod writes;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = BoxBody<Bytes, BoxError>;

/// FNV-1a, enough to check that a streamed body arrived intact.
pub fn fnv1a(state: u64, data: &[u8]) -> u64 {
    let mut h = state;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}
pub const FNV_START: u64 = 0xcbf29ce484222325;

/// Request heads that arrived: target, token, when.
type Arrivals = Arc<Mutex<Vec<(String, Option<String>, Instant)>>>;

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Record {
    pub method: String,
    pub target: String,
    pub token: Option<String>,
    pub headers: HeaderMap,
    pub body_len: u64,
    pub body_hash: u64,
    /// When the request head arrived.
    pub arrived: Instant,
    /// When the upstream finished "applying" it (after any delay).
    pub completed: Instant,
}

/// A real HTTP server that records what reaches it. A request may carry
/// `x-test-delay-ms` (answer after that long), `x-test-status` (answer
/// with that status) and `x-test-early` (answer at once, then read the
/// body and apply it).
pub struct Upstream {
    pub addr: SocketAddr,
    records: Arc<Mutex<Vec<Record>>>,
    /// Requests whose head arrived (even if not completed yet).
    arrivals: Arrivals,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// The https URL (for an upstream behind TLS), by host name so SNI and
    /// name checks apply.
    pub fn https_url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }
    pub fn records(&self) -> Vec<Record> {
        self.records.lock().unwrap().clone()
    }
    pub fn arrivals(&self) -> usize {
        self.arrivals.lock().unwrap().len()
    }
    pub fn count(&self) -> usize {
        self.records.lock().unwrap().len()
    }
    pub fn clear(&self) {
        self.records.lock().unwrap().clear();
        self.arrivals.lock().unwrap().clear();
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn upstream_handle(
    req: Request<Incoming>,
    records: Arc<Mutex<Vec<Record>>>,
    arrivals: Arrivals,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let arrived = Instant::now();
    let (parts, body) = req.into_parts();
    let token = parts
        .headers
        .get("x-fence-token")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let target = parts
        .uri
        .path_and_query()
        .map_or("/".into(), |p| p.to_string());
    arrivals
        .lock()
        .unwrap()
        .push((target.clone(), token.clone(), arrived));
    // `x-test-early`: answer 200 at once, then read (and apply) the body,
    // as a backend that answers a write before it has read it.
    let early = parts.headers.contains_key("x-test-early");
    let apply = async move { apply_upload(parts, body, target, token, arrived, records).await };
    if early {
        tokio::spawn(apply);
        let mut resp = Response::new(Full::new(Bytes::new()));
        resp.headers_mut()
            .insert("x-upstream", "early".parse().unwrap());
        return Ok(resp);
    }
    apply.await
}

/// Reads a request's body and records it as applied (unless the body is
/// cut), after `x-test-delay-ms`; answers with `x-test-status`.
async fn apply_upload(
    parts: http::request::Parts,
    mut body: Incoming,
    target: String,
    token: Option<String>,
    arrived: Instant,
    records: Arc<Mutex<Vec<Record>>>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let mut len = 0u64;
    let mut hash = FNV_START;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(d) = f.data_ref() {
                    len += d.len() as u64;
                    hash = fnv1a(hash, d);
                }
            }
            Err(_) => {
                // A body cut short is never applied.
                return Ok(Response::new(Full::new(Bytes::new())));
            }
        }
    }
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let delay = header("x-test-delay-ms").and_then(|v| v.parse().ok());
    let status = header("x-test-status")
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    // Applying runs detached, like a backend that finishes a request whose
    // client (the proxy) went away.
    let record = Record {
        method: parts.method.to_string(),
        target,
        token,
        headers: parts.headers.clone(),
        body_len: len,
        body_hash: hash,
        arrived,
        completed: arrived,
    };
    let applied = tokio::spawn(async move {
        if let Some(ms) = delay {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let mut record = record;
        record.completed = Instant::now();
        records.lock().unwrap().push(record);
    });
    let _ = applied.await;
    let mut resp = Response::new(Full::new(Bytes::from(format!(
        "applied {} {} len={len}",
        parts.method,
        parts.uri.path()
    ))));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert("x-upstream", "recording".parse().unwrap());
    resp.headers_mut()
        .insert("x-body-hash", hash.to_string().parse().unwrap());
    Ok(resp)
}

/// Starts the recording upstream on a free loopback port.
pub async fn start_upstream() -> Upstream {
    start_upstream_on("127.0.0.1:0").await
}

/// Starts the recording upstream on `addr`.
pub async fn start_upstream_on(addr: &str) -> Upstream {
    let listener = listen(addr).unwrap_or_else(|e| panic!("cannot listen on {addr}: {e}"));
    serve_upstream(listener, |stream, service| {
        Box::pin(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        })
    })
}

/// Starts the recording upstream on `host`'s address, port `port` (0: a
/// free one): its socket lives in the host's network namespace.
pub fn start_upstream_in(host: &netns::Host, port: u16) -> Upstream {
    start_upstream_in_with(host, port, |stream, service| {
        Box::pin(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        })
    })
}

/// [`start_upstream_in`], each connection served by `serve` (HTTP/2, say).
pub fn start_upstream_in_with<F>(host: &netns::Host, port: u16, serve: F) -> Upstream
where
    F: Fn(tokio::net::TcpStream, Recording) -> ConnFuture + Send + 'static,
{
    let addr = format!("{}:{port}", host.addr);
    let listener = host
        .enter(|| listen(&addr))
        .unwrap_or_else(|e| panic!("cannot listen on {addr}: {e}"));
    serve_upstream(listener, serve)
}

/// Starts the recording upstream on a free loopback port, serving each
/// connection with `serve` (TLS, HTTP/2...).
pub async fn start_upstream_with<F>(serve: F) -> Upstream
where
    F: Fn(tokio::net::TcpStream, Recording) -> ConnFuture + Send + 'static,
{
    serve_upstream(listen("127.0.0.1:0").unwrap(), serve)
}

/// A listening socket with the accept backlog of a real server (nginx's
/// is 511): tokio's `bind` asks for 128, and a burst of more new
/// connections than that (a test's 250 concurrent writes, each on a new
/// upstream connection) sees SYNs dropped and retried a second later,
/// which reads as an upstream timeout.
fn listen(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

pub type ConnFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

fn serve_upstream<F>(listener: tokio::net::TcpListener, serve: F) -> Upstream
where
    F: Fn(tokio::net::TcpStream, Recording) -> ConnFuture + Send + 'static,
{
    let addr = listener.local_addr().unwrap();
    let recording = Recording {
        records: Arc::new(Mutex::new(Vec::new())),
        arrivals: Arc::new(Mutex::new(Vec::new())),
    };
    let service = recording.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(serve(stream, service.clone()));
        }
    });
    Upstream {
        addr,
        records: recording.records,
        arrivals: recording.arrivals,
        task,
    }
}

/// A backend that never reads the body of a `GET`, `HEAD`, `OPTIONS` or
/// `DELETE` request, as Python's `http.server` and many small internal APIs
/// do not: bytes sent after such a head are read as the next request on
/// the connection. It answers every head it reads with `200 ok` and
/// records its request line (`METHOD target`) and `Host`.
/// Request lines read, each with its `Host`.
type Heads = Arc<Mutex<Vec<(String, Option<String>)>>>;

pub struct BodyBlindUpstream {
    pub addr: SocketAddr,
    heads: Heads,
    task: tokio::task::JoinHandle<()>,
}

impl BodyBlindUpstream {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Request lines read, in order.
    pub fn lines(&self) -> Vec<String> {
        self.heads
            .lock()
            .unwrap()
            .iter()
            .map(|h| h.0.clone())
            .collect()
    }
    /// `Host` of each request read, in order.
    pub fn hosts(&self) -> Vec<Option<String>> {
        self.heads
            .lock()
            .unwrap()
            .iter()
            .map(|h| h.1.clone())
            .collect()
    }
}

impl Drop for BodyBlindUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn start_body_blind_upstream() -> BodyBlindUpstream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let heads: Heads = Arc::default();
    let seen = heads.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // One head, then the body only where a method has one.
                    let (len, method, line, host, body) = loop {
                        let mut slots = [httparse::EMPTY_HEADER; 64];
                        let mut req = httparse::Request::new(&mut slots);
                        match req.parse(&buf) {
                            Ok(httparse::Status::Complete(len)) => {
                                let method = req.method.unwrap_or("").to_string();
                                let line = format!("{method} {}", req.path.unwrap_or(""));
                                let header = |n: &str| {
                                    req.headers
                                        .iter()
                                        .find(|h| h.name.eq_ignore_ascii_case(n))
                                        .map(|h| String::from_utf8_lossy(h.value).into_owned())
                                };
                                let body = header("content-length")
                                    .and_then(|v| v.trim().parse::<usize>().ok())
                                    .unwrap_or(0);
                                break (len, method, line, header("host"), body);
                            }
                            Ok(httparse::Status::Partial) => {}
                            Err(_) => return,
                        }
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    seen.lock().unwrap().push((line, host));
                    buf.drain(..len);
                    if !matches!(method.as_str(), "GET" | "HEAD" | "OPTIONS" | "DELETE") {
                        while buf.len() < body {
                            let mut chunk = [0u8; 4096];
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..body);
                    }
                    let answer: &[u8] = if method == "HEAD" {
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"
                    } else {
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                    };
                    if s.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    BodyBlindUpstream { addr, heads, task }
}

/// The recording upstream's request handler, as a hyper service.
#[derive(Clone)]
pub struct Recording {
    records: Arc<Mutex<Vec<Record>>>,
    arrivals: Arrivals,
}

impl hyper::service::Service<Request<Incoming>> for Recording {
    type Response = Response<Full<Bytes>>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;
    fn call(&self, req: Request<Incoming>) -> Self::Future {
        Box::pin(upstream_handle(
            req,
            self.records.clone(),
            self.arrivals.clone(),
        ))
    }
}

/// A fencegate process started from the real binary.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// The TLS listener, if one was configured.
    pub tls: Option<SocketAddr>,
    /// The lease API's listener, if one was configured.
    pub lease: Option<SocketAddr>,
    /// Whether a plain listener runs (`listen = "off"` turns it off).
    pub plain: bool,
    pub child: Child,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log_dir: PathBuf,
    stderr_log: PathBuf,
}

/// Builder for a fencegate process: the quick-start flags plus extras.
pub struct ProxyBuilder {
    upstream: Option<String>,
    /// A file path or a shared-store URL.
    store: String,
    dir: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    listen: String,
    admin: String,
}

impl ProxyBuilder {
    pub fn new(upstream: &str, dir: &Path) -> Self {
        Self {
            upstream: Some(upstream.to_string()),
            store: dir.join("fences.redb").display().to_string(),
            dir: dir.to_path_buf(),
            args: Vec::new(),
            env: Vec::new(),
            listen: "127.0.0.1:0".into(),
            admin: "127.0.0.1:0".into(),
        }
    }
    /// Routes from a config file instead of `--upstream`.
    pub fn with_config(config: &Path, dir: &Path) -> Self {
        Self {
            upstream: None,
            store: dir.join("fences.redb").display().to_string(),
            dir: dir.to_path_buf(),
            args: vec!["--config".into(), config.display().to_string()],
            env: Vec::new(),
            listen: "127.0.0.1:0".into(),
            admin: "127.0.0.1:0".into(),
        }
    }
    pub fn store(mut self, path: &Path) -> Self {
        self.store = path.display().to_string();
        self
    }
    pub fn store_url(mut self, url: &str) -> Self {
        self.store = url.to_string();
        self
    }
    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_string());
        self
    }
    /// The plain listener's address (`off`: none).
    pub fn listen(mut self, addr: &str) -> Self {
        self.listen = addr.to_string();
        self
    }
    /// Runs the process under a file-descriptor limit (soft and hard), as
    /// `ulimit -n` would: via util-linux's `prlimit`.
    pub fn nofile(self, n: u32) -> Self {
        self.env(NOFILE, &n.to_string())
    }
    /// Runs the process on a test host ([`netns::Host`]), its proxy and
    /// admin listeners on the host's address.
    pub fn netns(mut self, host: &netns::Host) -> Self {
        self.listen = format!("{}:0", host.addr);
        self.admin = format!("{}:0", host.addr);
        self.env(NETNS, &host.ns)
    }
    /// An environment variable for the process.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }
    pub fn args(mut self, a: &[&str]) -> Self {
        self.args.extend(a.iter().map(|s| s.to_string()));
        self
    }
    pub fn spawn(self) -> Proxy {
        let (args, env, dir) = self.command();
        Proxy::spawn_with(args, env, dir)
    }

    /// Runs the command where it must refuse to start (see
    /// [`Proxy::start_refused`]).
    pub fn start_refused(self) -> (std::process::ExitStatus, String) {
        let (args, env, dir) = self.command();
        refused_start(&args, &env, &dir)
    }

    fn command(self) -> (Vec<String>, Vec<(String, String)>, PathBuf) {
        let mut args = vec![
            "--listen".to_string(),
            self.listen.clone(),
            "--admin-listen".into(),
            self.admin.clone(),
            "--store".into(),
            self.store.clone(),
        ];
        if let Some(u) = &self.upstream {
            args.push("--upstream".into());
            args.push(u.clone());
        }
        args.extend(self.args);
        (args, self.env, self.dir)
    }
}

pub fn bin() -> &'static str {
    // Set by cargo for integration tests (not for the example that shares
    // this module, which never starts fencegate itself).
    match option_env!("CARGO_BIN_EXE_fencegate") {
        Some(path) => path,
        None => panic!("only integration tests start the binary"),
    }
}

/// The builder's [`ProxyBuilder::nofile`] setting, carried with the
/// environment so that a restart keeps it.
const NOFILE: &str = "FENCEGATE_TEST_NOFILE";

/// The builder's [`ProxyBuilder::netns`] setting, carried likewise.
const NETNS: &str = "FENCEGATE_TEST_NETNS";

/// The command that starts fencegate: under `prlimit` if a descriptor limit
/// was asked for, on a test host if one was.
fn command(env: &[(String, String)]) -> Command {
    let setting = |key: &str| env.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    if let Some(ns) = setting(NETNS) {
        assert!(setting(NOFILE).is_none(), "netns and nofile do not combine");
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, bin()]);
        return c;
    }
    match setting(NOFILE) {
        Some(n) => {
            let mut c = Command::new(require_prlimit());
            c.arg(format!("--nofile={n}:{n}")).arg("--").arg(bin());
            c
        }
        None => Command::new(bin()),
    }
}

fn require_prlimit() -> &'static str {
    assert!(
        Command::new("prlimit").arg("--version").output().is_ok(),
        "prlimit not found: install the Debian package `util-linux`"
    );
    "prlimit"
}

impl Proxy {
    fn spawn_with(args: Vec<String>, env: Vec<(String, String)>, log_dir: PathBuf) -> Proxy {
        let stderr_log = log_dir.join(format!(
            "fencegate-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let mut child = command(&env)
            .args(&args)
            .env("FENCEGATE_LOG", "info")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).unwrap())
            .spawn()
            .expect("start fencegate");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let fields: HashMap<&str, &str> = line
            .split_whitespace()
            .filter_map(|f| f.split_once('='))
            .collect();
        let (Some(p), Some(a)) = (fields.get("proxy"), fields.get("admin")) else {
            let _ = child.wait();
            panic!(
                "fencegate did not start: stdout {line:?}, stderr: {}",
                std::fs::read_to_string(&stderr_log).unwrap_or_default()
            );
        };
        Proxy {
            // With `listen = "off"` the TLS listener is the proxy address.
            addr: match *p {
                "off" => fields["tls"].parse().unwrap(),
                p => p.parse().unwrap(),
            },
            plain: *p != "off",
            admin: a.parse().unwrap(),
            tls: fields.get("tls").map(|t| t.parse().unwrap()),
            lease: fields.get("lease").map(|t| t.parse().unwrap()),
            child,
            args,
            env,
            log_dir,
            stderr_log,
        }
    }

    pub fn url(&self, path: &str) -> String {
        assert!(
            self.plain,
            "no plain listener (listen = off): use the TLS address"
        );
        format!("http://{}{}", self.addr, path)
    }
    pub fn lease_url(&self, path: &str) -> String {
        format!(
            "http://{}{}",
            self.lease.expect("started without --lease-listen"),
            path
        )
    }
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// `kill -9`: no drain, no clean-stop mark.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM and wait for the exit status.
    pub fn sigterm(&mut self) -> std::process::ExitStatus {
        signal(self.child.id(), "TERM");
        self.child.wait().unwrap()
    }

    /// Runs the same command again in a new process that must refuse to
    /// start: its exit status and stderr. Fails if it is still running
    /// after 20 s.
    pub fn start_refused(&self) -> (std::process::ExitStatus, String) {
        refused_start(&self.args, &self.env, &self.log_dir)
    }

    /// Starts the same command again (same store, new ports).
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let again = Proxy::spawn_with(self.args.clone(), self.env.clone(), self.log_dir.clone());
        *self = again;
    }

    /// Peak resident set size of the process, bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .unwrap()
            * 1024
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs fencegate with `args` where it must refuse to start: its exit
/// status and stderr. Fails if it is still running after 20 s.
fn refused_start(
    args: &[String],
    env: &[(String, String)],
    log_dir: &Path,
) -> (std::process::ExitStatus, String) {
    let log = log_dir.join("refused-start.log");
    let mut child = Command::new(bin())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start fencegate");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "fencegate started where it must refuse: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(&log).unwrap_or_default())
}

/// Sends a signal with kill(1), so the tests need no unsafe code either.
pub fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill -{name} {pid} failed");
}

/// A plain HTTP/1.1 client (no retries).
pub fn client() -> Client<HttpConnector, Body> {
    Client::builder(TokioExecutor::new())
        .retry_canceled_requests(false)
        .build(HttpConnector::new())
}

/// What a test looks at in an answer.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|e| match e {}).boxed()
}

/// Sends one request and reads the whole answer.
pub async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    send_body(method, url, headers, full(body)).await
}

pub async fn send_body(method: &str, url: &str, headers: &[(&str, &str)], body: Body) -> Answer {
    let mut req = Request::builder()
        .method(http::Method::from_bytes(method.as_bytes()).unwrap())
        .uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(60),
        client().request(req.body(body).unwrap()),
    )
    .await
    .expect("answer within 60s")
    .expect("request failed");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// A PUT with `token` that the recording upstream holds for `delay_ms`
/// before applying it, in its own task.
pub fn slow_put(
    url: String,
    token: &'static str,
    delay_ms: &'static str,
) -> tokio::task::JoinHandle<Answer> {
    tokio::spawn(async move {
        send(
            "PUT",
            &url,
            &[("x-fence-token", token), ("x-test-delay-ms", delay_ms)],
            "x",
        )
        .await
    })
}

/// Shorthand: a PUT with a token.
pub async fn put(url: &str, token: &str) -> Answer {
    send("PUT", url, &[("x-fence-token", token)], "data").await
}

/// Polls until `f` is true or the deadline passes (bounded).
pub async fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Raw request over a socket; returns everything read until close or
/// `read_for` has passed.
pub async fn raw(addr: SocketAddr, bytes: &[u8], read_for: Duration) -> String {
    raw_until_closed(addr, bytes, read_for).await.0
}

/// Like [`raw`], and whether the proxy closed the connection within
/// `read_for`.
pub async fn raw_until_closed(
    addr: SocketAddr,
    bytes: &[u8],
    read_for: Duration,
) -> (String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + read_for;
    let closed = loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Err(_) => break false,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    };
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

/// A request body that yields prepared chunks one frame at a time (so the
/// client streams it; nothing is concatenated).
pub struct ChunkBody(std::collections::VecDeque<Bytes>);

impl ChunkBody {
    pub fn new(chunks: Vec<Bytes>) -> Self {
        Self(chunks.into())
    }
}

impl http_body::Body for ChunkBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        std::task::Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// Writes a config file the way config management tools do: write, then
/// rename.
/// Two routes in front of `upstream` that fence the same keys (`/d/slow/x`
/// and `/d/y` are both `/d`) with upstream timeouts of 10 s and 1 s.
pub fn two_routes_sharing_keys(upstream: &str) -> String {
    format!(
        r#"
[[routes]]
name = "slow"
path_prefix = "/d/slow"
upstream = "{upstream}"
key = "/{{s}}"
upstream_timeout = "10s"

[[routes]]
name = "fast"
path_prefix = "/d"
upstream = "{upstream}"
key = "/{{s}}"
upstream_timeout = "1s"
"#
    )
}

pub fn write_config(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Reads from `s` until `n` answers have come whole (their bodies
/// framed by Content-Length), or the connection ends; returns their status lines.
pub async fn answers<S: tokio::io::AsyncRead + Unpin>(s: &mut S, n: usize) -> Vec<String> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let read = async {
        loop {
            while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if buf.len() < end + 4 + len {
                    break;
                }
                out.push(head.lines().next().unwrap_or_default().to_string());
                buf.drain(..end + 4 + len);
                if out.len() == n {
                    return;
                }
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(10), read).await;
    out
}

/// The value of the first metric line starting with `line_prefix` (labels
/// included), from the admin listener.
pub async fn metric(p: &Proxy, line_prefix: &str) -> Option<f64> {
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    m.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The value of the series named exactly `series` (labels included, as
/// the exposition writes them) in a scrape `text`. Not a substring match:
/// `# HELP fencegate_store_amnesia 1 while ...` is no sample, and a
/// test that matched it could not fail.
pub fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok()).flatten()
    })
}

/// Asserts that the scrape `text` has `series` at exactly `value`.
#[track_caller]
pub fn assert_series(text: &str, series: &str, value: f64) {
    assert_eq!(
        series_value(text, series),
        Some(value),
        "{series} in:\n{text}"
    );
}

/// Polls an async condition for up to 15 s.
pub async fn eventually_async<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !f().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many addresses the process listens on (from /proc): the worker
/// threads' sockets sharing one port (`SO_REUSEPORT`) count once.
pub fn listening_sockets(pid: u32) -> usize {
    let distinct: std::collections::HashSet<_> = listening_addresses(pid).into_iter().collect();
    distinct.len()
}

/// The local addresses of the sockets the process `pid` listens on, as
/// /proc/net/tcp writes them (`0100007F:2382` is 127.0.0.1:9090).
pub fn listening_addresses(pid: u32) -> Vec<String> {
    let mut inodes = std::collections::HashSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        if let Ok(target) = std::fs::read_link(entry.path()) {
            let t = target.to_string_lossy();
            if let Some(inode) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                inodes.insert(inode.to_string());
            }
        }
    }
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        })
        // Column 1 is the local address, 3 the state (0A: LISTEN), 9 the
        // inode.
        .filter(|cols| cols.get(3).map(String::as_str) == Some("0A"))
        .filter(|cols| cols.get(9).is_some_and(|i| inodes.contains(i)))
        .map(|cols| cols[1].clone())
        .collect()
}

/// Waits until `n` writes are queued behind an older write on their key:
/// the proxy's own signal, not a guess at a sleep.
pub async fn queued(p: &Proxy, n: u32) {
    let line = format!("fencegate_writes_waiting {n}");
    eventually_async(&line.clone(), || {
        let line = line.clone();
        async move {
            let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
            m.lines().any(|l| l == line)
        }
    })
    .await;
}

/// The admin bearer token of [`with_admin_token`]'s proxies.
pub const ADMIN_TOKEN: &str = "operator-token-0123456789";

/// GET `path` on `p`'s admin listener with the operator's token
/// ([`ADMIN_TOKEN`]).
pub async fn admin_get(p: &Proxy, path: &str) -> Answer {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    send("GET", &p.admin_url(path), &[("authorization", &auth)], "").await
}

/// A proxy in front of a fresh upstream, its admin token [`ADMIN_TOKEN`]
/// (`--admin-token-file`), with `extra` flags.
pub async fn with_admin_token(extra: &[&str]) -> (tempfile::TempDir, Upstream, Proxy) {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{ADMIN_TOKEN}\n")).unwrap();
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--admin-token-file", token_file.to_str().unwrap()])
        .args(extra)
        .spawn();
    (dir, up, p)
}

"""Real servers for the token-source recipes: fencegate, a recording
upstream, etcd, redis-server, PostgreSQL and ZooKeeper, each on free
loopback ports in a temp dir, stopped at teardown. A missing server fails
the test with what to install (scripts/test installs everything).

FENCEGATE_BIN overrides the fencegate binary (default target/release).
"""

import http.server
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from fencegate_listening import read_listening  # noqa: E402

FENCEGATE_BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
START_TIMEOUT = 30.0
ZOOKEEPER_JAR = pathlib.Path("/usr/share/java/zookeeper.jar")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require(binary, package):
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} not found: install the Debian package `{package}` (scripts/test does)",
                    pytrace=False)
    return path


def newest_postgres_bin(name):
    found = sorted(pathlib.Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                   key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    if not found:
        pytest.fail(f"PostgreSQL's {name} not found under /usr/lib/postgresql: install the "
                    "Debian package `postgresql` (scripts/test does)", pytrace=False)
    return str(found[-1])


class Server:
    """A child process with its log file; `stop()` ends it (and only it)."""

    def __init__(self, name, args, log, **popen):
        self.name = name
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, **popen)

    def wait_ready(self, ready, timeout=START_TIMEOUT):
        """Polls `ready()` until it is true; fails on exit or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited during start ({self.proc.returncode}):\n"
                            f"{self.log_tail()}", pytrace=False)
            try:
                if ready():
                    return
            except Exception:
                pass  # not yet
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}",
                            pytrace=False)
            time.sleep(0.05)

    def log_tail(self):
        try:
            return pathlib.Path(self.log).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the resource: a recording HTTP server, and fencegate in front of it ---

class Upstream(http.server.ThreadingHTTPServer):
    """Stores PUT bodies by path and records every request that arrived."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)
        self.lock = threading.Lock()
        self.bodies = {}
        self.arrivals = []  # (method, path, X-Fence-Token)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def arrivals_for(self, path):
        with self.lock:
            return [a for a in self.arrivals if a[1] == path]

    def body(self, path):
        with self.lock:
            return self.bodies.get(path)


class _UpstreamHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.arrivals.append(("PUT", self.path, self.headers.get("X-Fence-Token")))
            self.server.bodies[self.path] = body
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def upstream():
    server = Upstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def fencegate(upstream, tmp_path_factory):
    """fencegate with the quick-start flags in front of `upstream`:
    {"url", "admin", "admin_token", "admin_token_file"}."""
    if not os.path.exists(FENCEGATE_BIN):
        pytest.fail(f"{FENCEGATE_BIN} missing: run cargo build --release first (or set FENCEGATE_BIN)",
                    pytrace=False)
    d = tmp_path_factory.mktemp("fencegate")
    token_file = d / "admin-token"
    token_file.write_text("recipes-admin-token-0123456789\n")
    proc = subprocess.Popen(
        [FENCEGATE_BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--upstream", upstream.url, "--store", str(d / "fences.redb"),
         "--admin-token-file", str(token_file)],
        stdout=subprocess.PIPE, stderr=open(d / "fencegate.log", "w"),
    )
    try:
        fields = read_listening(proc, d / "fencegate.log", timeout=START_TIMEOUT)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield {"url": "http://" + fields["proxy"], "admin": "http://" + fields["admin"],
           "admin_token": token_file.read_text().strip(), "admin_token_file": str(token_file)}
    proc.kill()
    proc.wait()


# --- lock services ---

@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory):
    binary = require("etcd", "etcd-server")
    d = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    server = Server("etcd", [
        binary, "--name", "default", "--data-dir", str(d / "data"),
        "--listen-client-urls", f"http://127.0.0.1:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"default=http://127.0.0.1:{peer}",
    ], d / "etcd.log")
    url = f"http://127.0.0.1:{client}"

    def serving():
        # Listening comes before serving: wait for a real answer.
        request = urllib.request.Request(url + "/v3/kv/range", data=b'{"key":"AA=="}')
        with urllib.request.urlopen(request, timeout=2) as r:
            return r.status == 200

    server.wait_ready(serving)
    yield url
    server.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    binary = require("redis-server", "redis-server")
    import redis

    d = tmp_path_factory.mktemp("redis")
    port = free_port()
    server = Server("redis-server", [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(d),
    ], d / "redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    server.wait_ready(lambda: redis.Redis.from_url(url, socket_timeout=2).ping())
    yield url
    server.stop()


@pytest.fixture(scope="session")
def postgres_dsn():
    import psycopg

    initdb, postgres = newest_postgres_bin("initdb"), newest_postgres_bin("postgres")
    # PostgreSQL refuses to run as root: run it as the postgres user then.
    run_as_root = os.geteuid() == 0
    as_postgres = [require("runuser", "util-linux"), "-u", "postgres", "--"] if run_as_root else []
    # Not under pytest's tmp dir, which the postgres user cannot reach.
    d = pathlib.Path(tempfile.mkdtemp(prefix="recipes-pg-"))
    if run_as_root:
        shutil.chown(d, "postgres", "postgres")
    data = d / "data"
    server = None
    try:
        init = subprocess.run(as_postgres + [initdb, "-D", str(data), "-A", "trust", "-U", "postgres",
                                             "--no-sync", "-E", "UTF8", "--locale", "C"],
                              capture_output=True, text=True, timeout=120)
        if init.returncode != 0:
            pytest.fail(f"initdb failed:\n{init.stdout}\n{init.stderr}", pytrace=False)
        port = free_port()
        server = Server("postgres", as_postgres + [
            postgres, "-D", str(data), "-p", str(port),
            "-c", "listen_addresses=127.0.0.1", "-k", str(d),
        ], d / "postgres.log")
        dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
        server.wait_ready(lambda: psycopg.connect(dsn, connect_timeout=2).close() or True)
        yield dsn
    finally:
        if server is not None:
            stop_postgres(server, data)
        shutil.rmtree(d, ignore_errors=True)


def stop_postgres(server, data):
    # runuser does not pass SIGKILL on, and SIGTERM is a "smart" shutdown
    # that waits for clients: send the postmaster (whose pid is the first
    # line of postmaster.pid) a fast shutdown, SIGINT, instead.
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGINT)
    except (OSError, ValueError, IndexError):
        pass
    try:
        server.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def zookeeper_hosts(tmp_path_factory):
    java = require("java", "default-jre-headless")  # the zookeeper package pulls one in
    if not ZOOKEEPER_JAR.exists():
        pytest.fail(f"{ZOOKEEPER_JAR} not found: install the Debian package `zookeeper` "
                    "(scripts/test does)", pytrace=False)
    d = tmp_path_factory.mktemp("zookeeper")
    port = free_port()
    config = d / "zoo.cfg"
    config.write_text("\n".join([
        "tickTime=500",
        f"dataDir={d / 'data'}",
        f"clientPort={port}",
        "clientPortAddress=127.0.0.1",
        "admin.enableServer=false",       # its Jetty would take port 8080
        "4lw.commands.whitelist=ruok",    # the readiness probe below
        "minSessionTimeout=1000",
        "maxSessionTimeout=30000",
        "",
    ]))
    # The Debian jar's manifest names its dependencies; slf4j-simple (if
    # present) makes the server log to our log file instead of nowhere.
    classpath = [str(ZOOKEEPER_JAR)]
    if pathlib.Path("/usr/share/java/slf4j-simple.jar").exists():
        classpath.append("/usr/share/java/slf4j-simple.jar")
    server = Server("zookeeper", [
        java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
        "-cp", ":".join(classpath), "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(config),
    ], d / "zookeeper.log")

    def imok():
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"ruok")
            return s.recv(4) == b"imok"

    server.wait_ready(imok)
    yield f"127.0.0.1:{port}"
    server.stop()

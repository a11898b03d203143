"""The token-source recipes (examples/recipes) against real lock services,
through a real fencegate to a real recording upstream.

For every backend: successive grants carry strictly increasing tokens;
while holder A holds the lock nobody else gets it; A writes, its lease ends
behind its back (the way it would after a pause or a partition), B takes
the lock with a higher token and writes, and A's late write is refused with
409 and never reaches the upstream. Each
recipe's command line is run once too, fencing ahead on the admin API.

Run by scripts/test: `python3 -m pytest -q tests/recipes` after
`cargo build --release`; FENCEGATE_BIN overrides the binary.
"""

import json
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable

import psycopg
import pytest
import redis
from kazoo.client import KazooClient

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "recipes"
sys.path.insert(0, str(RECIPES))

import etcd_lock  # noqa: E402
import fenced  # noqa: E402
import postgres_lock  # noqa: E402
import redis_lock  # noqa: E402
import zookeeper_lock  # noqa: E402

ZOOKEEPER_DOOMED_SESSION_S = 2.0


@dataclass
class Backend:
    name: str
    # A contender for the lock `name` (each call is a new process's worth
    # of lock state: its own lease, session or connection).
    contender: Callable[[str], fenced.FencingLock]
    # The holder whose lease the test will end: a short lease, or a
    # connection the test can cut.
    doomed_holder: Callable[[str], fenced.FencingLock]
    # Ends that holder's lease behind its back; returns when the lock is free.
    end_lease: Callable[[fenced.FencingLock], None]
    # The recipe's command line with its service flags.
    cli: list


def wait_until(condition, what, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout}s")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def etcd_backend(etcd_url):
    def revoke(holder):
        # What etcd does when a lease's TTL runs out: the lease goes and
        # the lock key with it.
        request = urllib.request.Request(etcd_url + "/v3/lease/revoke",
                                         data=json.dumps({"ID": holder.lease_id}).encode())
        urllib.request.urlopen(request, timeout=10).close()

    contender = lambda name: etcd_lock.EtcdLock(etcd_url, name, ttl=10)  # noqa: E731
    return Backend("etcd", contender, contender, revoke,
                   [str(RECIPES / "etcd_lock.py"), "--etcd", etcd_url])


@pytest.fixture(scope="session")
def redis_backend(redis_url):
    client = redis.Redis.from_url(redis_url, socket_timeout=10)

    def run_out(holder):
        # The lease really expires on the Redis server (nothing is deleted):
        # the test only brings its expiry forward, so however slow the
        # machine, A held the lock while B was checked to be shut out.
        client.pexpire(holder.lock_key, 1)
        wait_until(lambda: not client.exists(holder.lock_key), "the Redis lease expiry",
                   timeout=5)

    return Backend(
        "redis",
        lambda name: redis_lock.RedisLock(client, name, lease_ms=10000),
        lambda name: redis_lock.RedisLock(client, name, lease_ms=10000),
        run_out,
        [str(RECIPES / "redis_lock.py"), "--redis", redis_url],
    )


@pytest.fixture(scope="session")
def postgres_backend(postgres_dsn):
    postgres_lock.create_schema(postgres_dsn)

    def terminate(holder):
        # What an operator does to a stuck holder, and what the server does
        # when keepalives find its connection dead: the session ends and its
        # advisory locks with it. (The timeout makes it wait for the exit.)
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            pid = holder.conn.info.backend_pid
            assert admin.execute("SELECT pg_terminate_backend(%s, 5000)", [pid]).fetchone()[0]

    contender = lambda name: postgres_lock.PostgresLock(postgres_dsn, name)  # noqa: E731
    return Backend("postgres", contender, contender, terminate,
                   [str(RECIPES / "postgres_lock.py"), "--dsn", postgres_dsn])


class Link:
    """A TCP relay to a server that the test can cut: a network partition
    between one client and the server, while the server stays up."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.sockets = []
        self.lock = threading.Lock()
        self.cut_off = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # cut: the listener is closed
            server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            server.settimeout(None)
            client.settimeout(None)
            with self.lock:
                if self.cut_off:
                    client.close()
                    server.close()
                    return
                self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def cut(self):
        """Drops every relayed connection and refuses new ones."""
        with self.lock:
            self.cut_off = True
        self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.fixture(scope="session")
def zookeeper_backend(zookeeper_hosts):
    observer = KazooClient(hosts=zookeeper_hosts, timeout=10)
    observer.start(timeout=10)
    target_port = int(zookeeper_hosts.rsplit(":", 1)[1])
    links = {}

    def doomed_holder(name):
        # Connected through a link the test cuts; a short session timeout,
        # since after the cut the lock lasts until the session expires. (The
        # connect timeout also bounds its release, which waits for a
        # connection that the cut link will never give it.)
        link = Link(target_port)
        lock = zookeeper_lock.ZooKeeperLock(f"127.0.0.1:{link.port}", name,
                                            session_timeout=ZOOKEEPER_DOOMED_SESSION_S,
                                            connect_timeout=1)
        links[id(lock)] = link
        return lock

    def partition(holder):
        # The server expires the session once it has heard nothing for the
        # session timeout, and deletes its ephemeral lock node.
        links.pop(id(holder)).cut()
        wait_until(lambda: observer.exists(holder.node_path) is None, "the ZooKeeper session expiry",
                   timeout=ZOOKEEPER_DOOMED_SESSION_S + 10)

    yield Backend(
        "zookeeper",
        lambda name: zookeeper_lock.ZooKeeperLock(zookeeper_hosts, name),
        doomed_holder,
        partition,
        [str(RECIPES / "zookeeper_lock.py"), "--zookeeper", zookeeper_hosts],
    )
    observer.stop()
    observer.close()


@pytest.fixture(params=["etcd", "redis", "postgres", "zookeeper"])
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")


def strictly_increasing(tokens):
    return all(a < b for a, b in zip(tokens, tokens[1:]))


def test_tokens_increase_and_an_expired_holder_is_fenced_out(backend, fencegate, upstream):
    name = f"fencing-{backend.name}"
    path = f"/recipes/{backend.name}/report.txt"
    held = []  # released at the end whatever happens
    try:
        grants = []
        for _ in range(3):
            lock = backend.contender(name)
            grants.append(lock.acquire(timeout=10))
            assert lock.release(), "a lock released in time was still ours"
        assert strictly_increasing(grants), grants

        a = backend.doomed_holder(name)
        held.append(a)
        token_a = a.acquire(timeout=10)
        assert token_a > grants[-1]
        # It is a lock: nobody else gets it while A's lease lasts.
        with pytest.raises(fenced.LockNotAcquired):
            backend.contender(name).acquire(timeout=0.3)
        assert fenced.write(fencegate["url"], path, b"from A", token_a) == 200
        assert upstream.body(path) == b"from A"

        backend.end_lease(a)  # A is not told; it still has its token

        b = backend.contender(name)
        held.append(b)
        token_b = b.acquire(timeout=10)
        assert token_b > token_a
        assert fenced.write(fencegate["url"], path, b"from B", token_b) == 200

        arrived = len(upstream.arrivals_for(path))
        with pytest.raises(fenced.FencedOut) as refused:
            fenced.write(fencegate["url"], path, b"late write from A", token_a)
        assert refused.value.highest == token_b
        assert len(upstream.arrivals_for(path)) == arrived, "the refused write reached the upstream"
        assert upstream.body(path) == b"from B"
        assert [t for _, _, t in upstream.arrivals_for(path)] == [str(token_a), str(token_b)]

        assert b.release(), "B held the lock to the end"
        assert not a.release(), "A's lock had ended"
    finally:
        for lock in held:
            try:
                lock.release()
            except Exception:
                pass


def test_the_command_line_does_one_fenced_write(backend, fencegate, upstream):
    path = f"/recipes/{backend.name}/cli.txt"
    tokens = []
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, *backend.cli, "--lock-name", f"cli-{backend.name}",
             "--fencegate", fencegate["url"], "--path", path, "--timeout", "10",
             "--admin-url", fencegate["admin"], "--admin-token-file", fencegate["admin_token_file"]],
            capture_output=True, text=True, timeout=60,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "already expired" not in run.stderr, run.stderr
        token = int(re.search(r"^token=(\d+)$", run.stdout, re.M).group(1))
        assert f"PUT {path} -> 200" in run.stdout
        assert upstream.body(path) == f"written with fencing token {token}\n".encode()
        # Fenced ahead: the highest was raised at the grant.
        assert fenced.highest(fencegate["admin"], fenced.fence_key(path)) == token
        tokens.append(token)
    assert strictly_increasing(tokens), tokens


def test_fence_ahead_refuses_the_old_holder_before_the_new_one_writes(etcd_backend, fencegate, upstream):
    path = "/recipes/etcd/fence-ahead.txt"
    key = fenced.fence_key(path)
    a = etcd_backend.contender("fence-ahead")
    token_a = a.acquire(timeout=10)
    assert fenced.write(fencegate["url"], path, b"from A", token_a) == 200
    etcd_backend.end_lease(a)

    b = etcd_backend.contender("fence-ahead")
    token_b = b.acquire(timeout=10)
    try:
        assert fenced.fence_ahead(fencegate["admin"], key, token_b, fencegate["admin_token"]) == token_b
        # B has not written yet, and A is already refused.
        with pytest.raises(fenced.FencedOut):
            fenced.write(fencegate["url"], path, b"late write from A", token_a)
        assert len(upstream.arrivals_for(path)) == 1
        assert upstream.body(path) == b"from A"
        # A token source that went backwards is caught at the grant.
        with pytest.raises(fenced.FencedOut):
            fenced.fence_ahead(fencegate["admin"], key, token_a, fencegate["admin_token"])
        assert fenced.write(fencegate["url"], path, b"from B", token_b) == 200
        assert upstream.body(path) == b"from B"
    finally:
        assert b.release()
        assert not a.release()

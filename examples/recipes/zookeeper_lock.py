#!/usr/bin/env python3
"""ZooKeeper lock -> fencing token -> write through fencegate -> release.

The lock is ZooKeeper's standard recipe (kazoo's `Lock`): each contender
creates a sequential ephemeral znode under /fencegate-locks/NAME, and the
lowest sequence number holds the lock. Ephemeral nodes vanish when their
session ends, so the session timeout is the lease. The fencing token is
the `czxid` of our lock node: the zxid of the transaction that created it.

Why czxid and not the node's sequence number: every change in the
ensemble gets a zxid (epoch << 32 | counter) from the leader, in one total
order, persisted in the transaction log; a new leader starts a higher
epoch, so zxids never repeat or go back, across restarts and elections and
across all lock paths. Successive holders created their nodes in holding
order (a waiter's node exists until it holds the lock, and a later node
always gets a later zxid), so their czxids strictly increase. The sequence
number is only a counter of the parent node: it restarts at 0 if the
parent is deleted and re-created (a cleanup of empty lock directories),
it is unrelated between two lock paths guarding the same resource, and it
overflows to negative numbers after 2^31. (A leader election moves zxids
to the next epoch, their high 32 bits: a jump of up to 2^32. Mind that if a
route sets `max_token_step`.)

    python3 zookeeper_lock.py --zookeeper 127.0.0.1:2181 --fencegate http://127.0.0.1:8080 \\
        --path /reports/q4.csv
"""

import socket

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, LockTimeout

import fenced

LOCK_ROOT = "/fencegate-locks"


class ZooKeeperLock(fenced.FencingLock):
    """One ZooKeeper lock named `name`, on its own session.

    Each grant opens a session (`session_timeout` seconds, the lease) and
    closes it at release. kazoo keeps a live session alive in the
    background; a holder that is paused longer than the timeout loses its
    node, and with it the lock, without noticing until it next talks to
    ZooKeeper.
    """

    def __init__(self, hosts, name, session_timeout=10.0, connect_timeout=10.0):
        self.hosts = hosts
        self.path = f"{LOCK_ROOT}/{name}"
        self.session_timeout = session_timeout
        self.connect_timeout = connect_timeout
        self.client = None
        self.node_path = None

    def acquire(self, timeout=10.0):
        client = KazooClient(hosts=self.hosts, timeout=self.session_timeout)
        client.start(timeout=self.connect_timeout)
        try:
            lock = client.Lock(self.path, identifier=socket.gethostname())
            try:
                if not lock.acquire(timeout=timeout):
                    raise LockTimeout()
            except LockTimeout as e:
                raise fenced.LockNotAcquired(f"zookeeper lock {self.path} still held after {timeout}s") from e
            node_path = f"{self.path}/{lock.node}"
            # The node's stat holds its czxid. If the session ended since the
            # grant the node is gone and so is the lock.
            stat = self._stat(client, node_path)
            if stat is None or stat.ephemeralOwner != client.client_id[0]:
                raise fenced.LockLost(f"zookeeper lock {self.path}: the session ended during the grant")
        except BaseException:
            _close(client)
            raise
        self.client, self.node_path = client, node_path
        self.token = stat.czxid
        return self.token

    def release(self):
        if self.client is None:
            return False
        client, self.client = self.client, None
        try:
            # Still ours only if the node exists on our current session (kazoo
            # opens a new session after an expiry; the old node is gone).
            stat = self._stat(client, self.node_path)
            held = stat is not None and stat.ephemeralOwner == client.client_id[0]
            if held:
                client.delete_async(self.node_path).get(timeout=self.connect_timeout)
            return held
        except (KazooException, client.handler.timeout_exception):
            return False  # no session (or no server): the node goes with the session
        finally:
            # Closing the session would delete the node anyway.
            _close(client)

    def _stat(self, client, path):
        # kazoo queues requests while it reconnects: bound the wait, so a
        # holder cut off from ZooKeeper cannot hang here.
        return client.exists_async(path).get(timeout=self.connect_timeout)


def _close(client):
    client.stop()
    client.close()


def main(argv=None):
    def service_args(parser):
        parser.add_argument("--zookeeper", default="127.0.0.1:2181",
                            help="ZooKeeper connection string (default: 127.0.0.1:2181)")
        parser.add_argument("--session-timeout", type=float, default=10.0,
                            help="session timeout in seconds, the lock's lease (default: 10)")

    return fenced.run_cli(
        __doc__, service_args,
        lambda args: ZooKeeperLock(args.zookeeper, args.lock_name, session_timeout=args.session_timeout),
        argv)


if __name__ == "__main__":
    raise SystemExit(main())

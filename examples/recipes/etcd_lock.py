#!/usr/bin/env python3
"""etcd lock -> fencing token -> write through fencegate -> release.

The lock is etcd's own lock service (the v3 `Lock` API, the same mutex
`etcdctl lock` uses) bound to a lease; the fencing token is the
`create_revision` of the lock's key.

Why that revision is a safe token: etcd has one revision counter for the
whole cluster, raised by every change and agreed through Raft, so a key
created later always has a higher create_revision, it is persisted with
the data (a restart or a leader change never reuses one), and compaction
does not lower it. The lock goes to the waiter whose key has the lowest
create_revision, and a waiter's key exists from its request until it holds
the lock, so successive holders of one lock have strictly increasing
create_revisions. (They jump by the number of writes in between, on the
whole cluster: mind that if a route sets `max_token_step`.)

Only the JSON gateway over HTTP is used (urllib, no etcd client library):
/v3/lease/grant, /v3/lock/lock, /v3/kv/range, /v3/lock/unlock,
/v3/lease/revoke. Keys and values are base64 in that API.

    python3 etcd_lock.py --etcd http://127.0.0.1:2379 --fencegate http://127.0.0.1:8080 \\
        --path /reports/q4.csv
"""

import base64
import json
import urllib.error
import urllib.request

import fenced


class EtcdError(Exception):
    """etcd answered with an error (its gRPC message in the text)."""


class EtcdLock(fenced.FencingLock):
    """One etcd lock named `name` with a `ttl`-second lease.

    A holder whose work may outlast the TTL must keep the lease alive
    (/v3/lease/keepalive) and stop working when that fails; fencing makes
    a late write harmless, not the late work.
    """

    def __init__(self, endpoint, name, ttl=10, request_timeout=10.0):
        self.endpoint = endpoint.rstrip("/")
        self.name = name
        self.ttl = ttl
        self.request_timeout = request_timeout  # each call but the wait for the lock
        self.lease_id = None
        self.key = None  # the lock's key (bytes): NAME/<lease id in hex>

    def _call(self, method, body, timeout=None):
        request = urllib.request.Request(
            f"{self.endpoint}/v3/{method}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        timeout = self.request_timeout if timeout is None else max(timeout, 0.001)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as e:
            raise EtcdError(f"{method}: {e.read().decode(errors='replace')}") from None

    def acquire(self, timeout=10.0):
        # The lease is what ends the lock if this holder dies or pauses:
        # etcd deletes the lock key when it expires.
        self.lease_id = self._call("lease/grant", {"TTL": self.ttl})["ID"]
        try:
            key = self._wait_for_lock(timeout)
            # The grant names the key, not its create_revision: read it. If
            # the lease ended in between the key is gone and we hold nothing.
            kvs = self._call("kv/range", {"key": _b64(key)}).get("kvs", [])
            if not kvs or int(kvs[0].get("lease", 0)) != int(self.lease_id):
                raise fenced.LockLost(f"etcd lock {self.name!r}: the lease ended during the grant")
        except BaseException:
            # Revoking deletes our key even if it is still waiting, so we
            # cannot become the holder after giving up.
            self._revoke_after_failure()
            raise
        self.key = key
        self.token = int(kvs[0]["create_revision"])
        return self.token

    def _wait_for_lock(self, timeout):
        # Blocks in etcd until our key (NAME/<lease id>) is the oldest under
        # NAME/; the HTTP read timeout bounds the wait.
        try:
            grant = self._call("lock/lock", {"name": _b64(self.name), "lease": self.lease_id},
                               timeout)
        except TimeoutError as e:
            raise fenced.LockNotAcquired(f"etcd lock {self.name!r} still held after {timeout}s") from e
        return base64.b64decode(grant["key"])

    def release(self):
        if self.lease_id is None:
            return False
        # Unlock deletes our key (the next waiter gets the lock at once; the
        # key embeds our lease id, so it can never be the next holder's);
        # revoking the lease then frees the lease itself. Whether the lease
        # still existed tells us whether the lock was still ours.
        if self.key is not None:
            self._call("lock/unlock", {"key": _b64(self.key)})
        held = self._revoke()
        self.key = None
        return held

    def _revoke(self):
        lease_id, self.lease_id = self.lease_id, None
        try:
            self._call("lease/revoke", {"ID": lease_id})
            return True
        except EtcdError as e:
            if "lease not found" in str(e):
                return False  # it had expired (or was revoked) already
            raise

    def _revoke_after_failure(self):
        # Best effort while another error is on its way up; if etcd is
        # unreachable the lease (and any waiting key) expires with its TTL.
        try:
            self._revoke()
        except (EtcdError, OSError):
            pass


def _b64(data):
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def main(argv=None):
    def service_args(parser):
        parser.add_argument("--etcd", default="http://127.0.0.1:2379",
                            help="etcd client URL (default: http://127.0.0.1:2379)")
        parser.add_argument("--ttl", type=int, default=10, help="lease TTL in seconds (default: 10)")

    return fenced.run_cli(__doc__, service_args,
                          lambda args: EtcdLock(args.etcd, args.lock_name, ttl=args.ttl), argv)


if __name__ == "__main__":
    raise SystemExit(main())

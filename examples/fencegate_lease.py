#!/usr/bin/env python3
"""A client for fencegate's lease service (docs/leases.md), standard library only.

    client = LeaseClient("http://127.0.0.1:9091", read_token_file("lease-token"))
    with client.lease(key="default:/reports/q4.csv", ttl_ms=30000) as lease:
        for chunk in work():
            lease.check()                       # stop once the lease is lost
            put(url, chunk, headers=lease.headers())

The lease is for efficiency: while it is renewed nobody else is granted
the key, so two workers rarely do the same work. The token is for
correctness: fencegate refuses it once a newer lease was granted, however
late this holder's write arrives (a GC pause, a frozen VM). So `.lost` is
advice to stop early; a write that races with the loss is still refused.

    python3 examples/fencegate_lease.py LEASE_URL TOKEN_FILE KEY PROXY_URL [--path P]
"""

import argparse
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

TOKEN_HEADER = "X-Fence-Token"


class LeaseError(Exception):
    """The lease service refused or could not be reached; `status` is the
    HTTP status (None: no answer) and `problem` the problem+json body."""

    def __init__(self, message, status=None, problem=None):
        super().__init__(message)
        self.status = status
        self.problem = problem or {}


class LeaseHeld(LeaseError):
    """409: another unexpired lease holds the key. Not an error to retry at
    once: `expires_in_ms` says when it may be free (if its holder stops)."""

    def __init__(self, message, status=409, problem=None):
        super().__init__(message, status, problem)
        self.key = self.problem.get("key")
        self.holder = self.problem.get("holder")
        self.expires_in_ms = self.problem.get("expires_in_ms")


class LeaseLost(LeaseError):
    """410: it expired or was released, and it is never revived. Stop
    writing with its token; acquire a new lease to go on."""


def read_token_file(path):
    """The bearer token: the first field of the first line that is not blank
    or a `#` comment (so the server's `TOKEN [PREFIX ...]` file works too)."""
    with open(path) as f:
        for line in f:
            if line.split() and not line.lstrip().startswith("#"):
                return line.split()[0]
    raise LeaseError(f"{path}: no token in the file")


class LeaseClient:
    """Calls the lease listener (`--lease-listen`). Tokens stay strings:
    they span the full u64 range, past what a JSON double holds exactly."""

    def __init__(self, base_url, bearer_token, timeout=10.0):
        self.base_url = base_url.rstrip("/")
        self.bearer_token = bearer_token
        self.timeout = timeout

    def acquire(self, key=None, path=None, host=None, *, ttl_ms, holder=None, wait_ms=None,
                timeout=None):
        """Takes the lease on `key`, or on the key a write to `path` (on
        `host`) takes: the proxy maps it, so it cannot disagree with the
        write. Returns the 201 body: lease, key, token, ttl_ms, holder.
        `wait_ms` long-polls for a held key before LeaseHeld."""
        if (key is None) == (path is None):
            raise ValueError("give exactly one of key= and path=")
        if host is not None and path is None:
            raise ValueError("host= goes with path=")
        body = {"key": key} if key is not None else {"path": path}
        if host is not None:
            body["host"] = host
        body["ttl_ms"] = int(ttl_ms)
        body["holder"] = holder or f"{socket.gethostname()}:{os.getpid()}"
        if wait_ms is not None:
            body["wait_ms"] = int(wait_ms)
        # The server may hold the answer for wait_ms: the socket must not give up first.
        timeout = (timeout or self.timeout) + (wait_ms or 0) / 1000
        return self._call("POST", "/v1/leases", body, timeout)

    def renew(self, lease_id, ttl_ms, timeout=None):
        """Extends the lease to `ttl_ms` from now; same token. LeaseLost if gone."""
        return self._call("POST", f"/v1/leases/{_seg(lease_id)}/renew", {"ttl_ms": int(ttl_ms)},
                          timeout, lost_on=(410,))

    def release(self, lease_id, timeout=None):
        """Ends the lease; False if it had already ended (worth logging)."""
        try:
            self._call("DELETE", f"/v1/leases/{_seg(lease_id)}", None, timeout, lost_on=(410,))
            return True
        except LeaseLost:
            return False

    def get(self, lease_id, timeout=None):
        """The lease as the server sees it: lease, key, token, holder, expires_in_ms."""
        return self._call("GET", f"/v1/leases/{_seg(lease_id)}", None, timeout, lost_on=(410,))

    def lease(self, key=None, path=None, host=None, *, ttl_ms, holder=None, wait_ms=None):
        """A context manager that holds the lease for its block (see Lease)."""
        return Lease(self, dict(key=key, path=path, host=host, ttl_ms=ttl_ms, holder=holder,
                                wait_ms=wait_ms))

    def _call(self, method, path, body, timeout=None, lost_on=(410,)):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.bearer_token}", "Content-Type": "application/json"}
        request = urllib.request.Request(self.base_url + path, data=data, method=method,
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                text = response.read()
                return json.loads(text) if text else {}
        except urllib.error.HTTPError as e:
            problem = _problem(e)
            message = f"{method} {path}: {e.code} {problem.get('detail') or e.reason}"
            if e.code == 409:
                raise LeaseHeld(message, e.code, problem) from None
            if e.code in lost_on:
                raise LeaseLost(message, e.code, problem) from None
            raise LeaseError(message, e.code, problem) from None
        except (OSError, ValueError) as e:  # refused, reset, timed out, not JSON
            raise LeaseError(f"{method} {path}: {e}") from e


class Lease:
    """A held lease, renewed every ttl/3 on a background thread.

    `lost` (a threading.Event) is set when a renewal answers 410, or when
    renewals keep failing until the lease's local deadline passes. The
    deadline is counted from *before* each request was sent, so it comes no
    later than the server's expiry: a holder that stops at `lost` has
    stopped before anyone else could be granted the key (clock rates
    aside). `check()` also compares the deadline itself, so a renewal thread
    that never ran (the whole process was paused) is caught too.
    """

    def __init__(self, client, acquire_args):
        self.client, self._args = client, acquire_args
        self.lost, self._stop = threading.Event(), threading.Event()
        self.id = self.key = self.token = self.holder = self.lost_reason = None
        self._ttl, self._deadline, self._thread = None, 0.0, None  # check() before the grant: lost

    def __enter__(self):
        sent = time.monotonic()
        grant = self.client.acquire(**self._args)
        self.id, self.key, self.token, self.holder = (
            grant["lease"], grant["key"], grant["token"], grant.get("holder"))
        self._ttl = grant["ttl_ms"] / 1000  # the server's, in case it bounded ours
        self._deadline = sent + self._ttl
        if time.monotonic() - sent > self._ttl / 3:
            # A long poll: the grant came at an unknown point of the wait, so
            # that deadline may be gone already. A renewal says where we are.
            sent = time.monotonic()
            try:
                self._deadline = sent + self.client.renew(self.id, self._ttl * 1000)["ttl_ms"] / 1000
            except Exception:
                self.__exit__(None, None, None)
                raise
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"lease-renew-{self.id}")
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout)
        try:
            self.client.release(self.id)  # best effort: it expires anyway
        except Exception:
            pass
        return False

    def headers(self):
        """The fencing header for a write; raises LeaseLost once lost, so a
        write is not even started with a lease known to be gone."""
        self.check()
        return {TOKEN_HEADER: self.token}

    def check(self):
        """Raises LeaseLost if the lease is lost or past its local deadline."""
        if not self.lost.is_set() and time.monotonic() >= self._deadline:
            self._lose("not renewed before its deadline")
        if self.lost.is_set():
            raise LeaseLost(f"lease {self.id} on {self.key} lost: {self.lost_reason}")

    def _lose(self, reason):
        if self.lost_reason is None:
            self.lost_reason = reason
        self.lost.set()

    def _renew_loop(self):
        wait = self._ttl / 3
        while not self._stop.wait(wait) and not self.lost.is_set():
            sent = time.monotonic()
            left = self._deadline - sent
            if left <= 0:
                return self._lose("not renewed before its deadline")
            try:
                # Bounded by what is left: an answer after the deadline is no use.
                grant = self.client.renew(self.id, self._ttl * 1000, timeout=left)
            except LeaseLost as e:
                return self._lose(str(e))
            except Exception as e:  # a blip: retry often until the deadline
                if time.monotonic() >= self._deadline:
                    return self._lose(f"renewals failed until the deadline: {e}")
                wait = min(self._ttl / 10, max(0.0, self._deadline - time.monotonic()))
                continue
            if grant.get("token") != self.token:
                return self._lose(f"renewal answered token {grant.get('token')}, not {self.token}")
            self._deadline = sent + grant["ttl_ms"] / 1000
            wait = self._ttl / 3


def _seg(lease_id):
    return urllib.parse.quote(str(lease_id), safe="")


def _problem(error):
    try:
        problem = json.loads(error.read() or b"{}")
        return problem if isinstance(problem, dict) else {}
    except ValueError:
        return {}


def main(argv=None):
    """One fenced PUT under a lease. Exit codes as `fencegate lease`: 3 held, 4 lost."""
    p = argparse.ArgumentParser(description="Take a lease and do one fenced PUT through fencegate.")
    p.add_argument("lease_url", help="lease listener, e.g. http://127.0.0.1:9091")
    p.add_argument("token_file", help="file whose first line starts with the bearer token")
    p.add_argument("key", help="fence key, e.g. default:/reports/q4.csv")
    p.add_argument("proxy_url", help="fencegate proxy, e.g. http://127.0.0.1:8080")
    p.add_argument("--path", help="path to PUT (default: the key's resource, after the first ':')")
    p.add_argument("--ttl-ms", type=int, default=30000)
    args = p.parse_args(argv)
    path = args.path or args.key.split(":", 1)[-1]
    client = LeaseClient(args.lease_url, read_token_file(args.token_file))
    try:
        with client.lease(key=args.key, ttl_ms=args.ttl_ms) as lease:
            print(f"{lease.id} {lease.token}", flush=True)
            body = f"written under lease {lease.id} with token {lease.token}\n".encode()
            request = urllib.request.Request(args.proxy_url.rstrip("/") + path, data=body,
                                             method="PUT", headers=lease.headers())
            try:
                with urllib.request.urlopen(request, timeout=client.timeout) as response:
                    print(f"PUT {path} -> {response.status}")
            except urllib.error.HTTPError as e:  # 409: a newer lease exists
                print(f"PUT {path} -> {e.code} {_problem(e).get('detail', '')}", file=sys.stderr)
                return 1
    except LeaseHeld as e:
        print(f"held by {e.holder!r} for {e.expires_in_ms} ms more", file=sys.stderr)
        return 3
    except LeaseLost as e:
        print(f"lost: {e}", file=sys.stderr)
        return 4
    except LeaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

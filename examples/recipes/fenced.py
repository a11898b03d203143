"""What every token-source recipe shares: the fenced write through
fencegate, fence-ahead on its admin API, and the one-shot command line.

The lock recipes (etcd_lock.py, redis_lock.py, postgres_lock.py,
zookeeper_lock.py) only differ in how they take a lock and derive its
fencing token; they all hand back a `FencingLock`:

    lock = EtcdLock("http://127.0.0.1:2379", "reports")
    token = lock.acquire(timeout=10)
    try:
        fenced.write("http://fencegate:8080", "/reports/q4.csv", data, token)
    finally:
        lock.release()

Standard library only, so a recipe needs nothing but its lock client.
"""

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request

TOKEN_HEADER = "X-Fence-Token"
HIGHEST_HEADER = "X-Fence-Token-Highest"


class LockNotAcquired(Exception):
    """Someone else held the lock for the whole wait."""


class LockLost(Exception):
    """The lock was gone before its token could be read (the lease or the
    session ended during the grant). Nothing was written; try again."""


class FencedOut(Exception):
    """fencegate refused the write (409): a newer holder has a higher token.

    This is the lock telling a paused holder that its lease ended. The only
    right reaction is to stop the work, not to retry with the same token.
    """

    def __init__(self, token, highest, detail):
        super().__init__(f"token {token} is fenced out (highest {highest}): {detail}")
        self.token = token
        self.highest = highest


class FencingLock:
    """A lock whose every grant carries a fencing token.

    Subclasses implement `acquire(timeout) -> int` (blocks up to `timeout`
    seconds, raises LockNotAcquired or LockLost, sets `self.token`) and
    `release() -> bool` (True if the lock was still ours: False tells the
    holder its lease had already ended, which is worth logging).
    """

    token = None

    def acquire(self, timeout=10.0):
        raise NotImplementedError

    def release(self):
        raise NotImplementedError

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info):
        self.release()


def write(fencegate_url, path, body, token, method="PUT", timeout=10.0):
    """Sends one write through fencegate with the token; returns the status.

    Raises FencedOut on 409 and urllib.error.HTTPError on other refusals.
    """
    request = urllib.request.Request(
        fencegate_url.rstrip("/") + path, data=body, method=method,
        headers={TOKEN_HEADER: str(token)},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as e:
        if e.code == 409:
            raise FencedOut(token, _highest_of(e), _problem_detail(e)) from None
        raise


def fence_key(path, namespace="default"):
    """fencegate's key for `path` on a route with the default `key = "path"`
    template. Other templates (`/{bucket}`, `header:NAME`) fence a prefix or
    a header value: pass that key to fence_ahead instead."""
    return f"{namespace}:{path}"


def fence_ahead(admin_url, key, token, admin_token, timeout=10.0):
    """Raises the key's highest token to `token` on fencegate's admin API
    (POST /v1/fences/{key}, docs/gateway.md) and returns the new highest.

    Call it right after the lock grant: from then on a paused older holder
    is refused even if this holder is slow to make its first write. Raises
    FencedOut if fencegate has already seen a higher token, which means the
    token source went backwards (a Redis counter lost in a failover, a
    restored backup): do not write with this token.
    """
    request = urllib.request.Request(
        admin_url.rstrip("/") + "/v1/fences/" + urllib.parse.quote(key, safe=""),
        data=json.dumps({"token": str(token)}).encode(), method="POST",
        headers={"Authorization": f"Bearer {admin_token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(json.load(response)["highest"])
    except urllib.error.HTTPError as e:
        if e.code == 409:
            raise FencedOut(token, _highest_of(e), _problem_detail(e)) from None
        raise


def highest(admin_url, key, timeout=10.0):
    """The key's highest token on fencegate (GET /v1/fences/{key}), or None
    if the key was never fenced. Useful after restoring a lock service from
    a backup: its token source must restart above this."""
    url = admin_url.rstrip("/") + "/v1/fences/" + urllib.parse.quote(key, safe="")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(json.load(response)["highest"])
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def _highest_of(error):
    value = error.headers.get(HIGHEST_HEADER)
    return int(value) if value is not None else None


def _problem_detail(error):
    try:
        return json.loads(error.read()).get("detail", "")
    except ValueError:
        return ""


def run_cli(description, add_service_args, make_lock, argv=None):
    """One acquire -> (fence-ahead) -> write -> release, for a recipe's
    command line. `add_service_args(parser)` adds the lock service's flags;
    `make_lock(args)` builds the recipe's FencingLock from them."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_service_args(parser)
    parser.add_argument("--lock-name", default="demo", help="lock to take (default: demo)")
    parser.add_argument("--fencegate", default="http://127.0.0.1:8080",
                        help="fencegate proxy URL (default: http://127.0.0.1:8080)")
    parser.add_argument("--path", default="/recipes/demo.txt",
                        help="resource to write through fencegate (default: /recipes/demo.txt)")
    parser.add_argument("--body", default=None, help="what to write (default: a line naming the token)")
    parser.add_argument("--method", default="PUT", help="write method (default: PUT)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the lock, and for each call to fencegate (default: 10)")
    parser.add_argument("--admin-url", help="fencegate admin URL: fence ahead right after the grant")
    parser.add_argument("--admin-token-file", help="file holding fencegate's admin bearer token")
    parser.add_argument("--fence-key",
                        help="fencegate key to fence ahead (default: default:PATH, the key of a "
                             "route with the default key template and namespace)")
    args = parser.parse_args(argv)
    if args.admin_url and not args.admin_token_file:
        parser.error("--admin-url needs --admin-token-file")

    lock = make_lock(args)
    token = lock.acquire(timeout=args.timeout)
    try:
        print(f"token={token}", flush=True)
        if args.admin_url:
            with open(args.admin_token_file) as f:
                admin_token = f.read().strip()
            key = args.fence_key or fence_key(args.path)
            highest = fence_ahead(args.admin_url, key, token, admin_token, timeout=args.timeout)
            print(f"fenced ahead: {key} highest={highest}", flush=True)
        body = args.body if args.body is not None else f"written with fencing token {token}\n"
        status = write(args.fencegate, args.path, body.encode(), token,
                       method=args.method, timeout=args.timeout)
        print(f"{args.method} {args.path} -> {status}", flush=True)
    except FencedOut as e:
        print(f"fenced out: {e}", file=sys.stderr)
        return 3
    finally:
        if not lock.release():
            print("warning: the lock had already expired at release", file=sys.stderr)
    return 0

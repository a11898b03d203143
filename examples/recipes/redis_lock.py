#!/usr/bin/env python3
"""Redis lock -> fencing token -> write through fencegate -> release.

The lock is the single-instance Redis lock: `SET lock owner NX PX lease`,
released by compare-and-delete so a holder whose lease ended cannot delete
its successor's lock. Redis's lock value is random, not ordered, so the
fencing token comes from a counter: `INCR` on a second key, in the same Lua
script as the SET. A script runs atomically, so a token is issued exactly
when the lease is granted: no holder without a token, no token without
the lock.

The trap is the counter's durability. If Redis loses the last increments
(a restart with RDB snapshots or `appendfsync everysec`, a failover to an
asynchronous replica, an eviction of the counter key) it issues the same
numbers again. fencegate refuses those below its highest, but admits one
equal to it (the same holder writing again), so a repeat of the last
number lets two holders write. Run
the lock's Redis with `appendonly yes`, `appendfsync always`,
`maxmemory-policy noeviction` and no automatic failover; after restoring
Redis from a backup, set the counter above fencegate's highest
(GET /v1/fences/{key} on the admin API). Fencing ahead (--admin-url)
catches a counter that went below the highest (409), not one that repeats
it exactly. For correctness locks prefer etcd or ZooKeeper.

    python3 redis_lock.py --redis redis://127.0.0.1:6379/0 --fencegate http://127.0.0.1:8080 \\
        --path /reports/q4.csv
"""

import time
import uuid

import redis

import fenced

# KEYS[1]: the lock, KEYS[2]: its token counter.
# ARGV[1]: this holder's random id, ARGV[2]: the lease in milliseconds.
ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false
"""

# Delete the lock only if it is still ours: after our lease ended the key
# may be the next holder's.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLock(fenced.FencingLock):
    """One Redis lock named `name`, leased for `lease_ms` milliseconds.

    `client` is a redis.Redis. The lease runs on the Redis server whether
    or not this holder is alive: work that may outlast it must extend it
    (a compare-and-PEXPIRE script) and stop when that fails.
    """

    def __init__(self, client, name, lease_ms=10000):
        self.client = client
        self.lease_ms = lease_ms
        # The {name} hash tag puts both keys in one Redis Cluster slot,
        # which a script touching both needs.
        self.lock_key = f"fencelock:{{{name}}}"
        self.counter_key = f"fencelock:{{{name}}}:token"
        self.owner = None
        self._acquire = client.register_script(ACQUIRE)
        self._release = client.register_script(RELEASE)

    def acquire(self, timeout=10.0):
        owner = uuid.uuid4().hex
        deadline = time.monotonic() + timeout
        pause = 0.01
        # Redis has no blocking lock: poll, backing off up to 200 ms.
        while True:
            token = self._acquire(keys=[self.lock_key, self.counter_key],
                                  args=[owner, self.lease_ms])
            if token is not None:
                self.owner = owner
                self.token = int(token)
                return self.token
            left = deadline - time.monotonic()
            if left <= 0:
                raise fenced.LockNotAcquired(f"redis lock {self.lock_key} still held after {timeout}s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.2)

    def release(self):
        if self.owner is None:
            return False
        owner, self.owner = self.owner, None
        return self._release(keys=[self.lock_key], args=[owner]) == 1


def main(argv=None):
    def service_args(parser):
        parser.add_argument("--redis", default="redis://127.0.0.1:6379/0",
                            help="Redis URL (default: redis://127.0.0.1:6379/0)")
        parser.add_argument("--lease-ms", type=int, default=10000,
                            help="lease in milliseconds (default: 10000)")

    def make_lock(args):
        client = redis.Redis.from_url(args.redis, socket_timeout=args.timeout,
                                      socket_connect_timeout=args.timeout)
        return RedisLock(client, args.lock_name, lease_ms=args.lease_ms)

    return fenced.run_cli(__doc__, service_args, make_lock, argv)


if __name__ == "__main__":
    raise SystemExit(main())

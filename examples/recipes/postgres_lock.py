#!/usr/bin/env python3
"""PostgreSQL advisory lock -> fencing token -> write through fencegate -> release.

The lock is a session-level advisory lock, `pg_advisory_lock(key)`: held
until it is unlocked or the session ends, so a crashed holder's lock goes
away with its connection. The fencing token is a per-lock counter row,
`UPDATE ... SET token = token + 1 RETURNING token`, incremented in the same
transaction that takes the lock.

Why a counter row rather than a sequence's nextval: both only go up, but
the row is transactional and the sequence is not. The increment commits
together with the grant (if the session dies first, neither happened), it
is durable when COMMIT returns (with synchronous_commit on), and a
successor, who can only take the lock after this session committed or
ended, reads the committed value and adds one. A sequence has traps that
quietly break ordering: `CACHE n` makes each session pre-allocate a block,
so a later holder in another session can draw a lower number; `CYCLE`,
`setval` and `ALTER SEQUENCE RESTART` move it backwards; logical
replication does not carry sequence state. The row is also readable per
lock (`SELECT token FROM fencing_tokens`) when checking fencegate's fences.

Traps of the advisory lock itself: a session lock needs a real session, so
not through a transaction-mode pooler (PgBouncer `pool_mode=transaction`);
and a holder that vanished without closing its connection keeps the lock
until the server notices, so set the server's TCP keepalives for these
sessions (e.g. options='-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5
-c tcp_keepalives_count=3' in the connection string). A paused holder keeps
its lock for as long as its connection lives, which is safe but stalls
others; if an operator or a timeout ends its session, fencing refuses the
paused holder's late writes.

    python3 postgres_lock.py --dsn 'host=127.0.0.1 port=5432 user=app dbname=app' \\
        --fencegate http://127.0.0.1:8080 --path /reports/q4.csv
"""

import psycopg
import psycopg.errors

import fenced

SCHEMA = """
CREATE TABLE IF NOT EXISTS fencing_tokens (
    lock_name text PRIMARY KEY,
    token bigint NOT NULL
)
"""

# The first grant of a lock creates its row with token 1.
NEXT_TOKEN = """
INSERT INTO fencing_tokens (lock_name, token) VALUES (%s, 1)
ON CONFLICT (lock_name) DO UPDATE SET token = fencing_tokens.token + 1
RETURNING token
"""

# Advisory locks are keyed by a bigint: hash the lock name on the server.
# Two names hashing alike would share one lock, which costs concurrency,
# never exclusion.
LOCK_KEY = "hashtextextended(%s, 0)"


def create_schema(conninfo):
    """Creates the counter table once (deployment step; safe to repeat)."""
    with psycopg.connect(conninfo) as conn:
        # Concurrent CREATE TABLE IF NOT EXISTS can still collide on the
        # catalog: take a transaction lock around it.
        conn.execute(f"SELECT pg_advisory_xact_lock({LOCK_KEY})", ["fencing_tokens schema"])
        conn.execute(SCHEMA)


class PostgresLock(fenced.FencingLock):
    """One advisory lock named `name`, held on a dedicated connection.

    `conninfo` is a libpq connection string or URL; create_schema() must
    have run on that database.
    """

    def __init__(self, conninfo, name, connect_timeout=10):
        self.conninfo = conninfo
        self.name = name
        self.connect_timeout = connect_timeout
        self.conn = None

    def acquire(self, timeout=10.0):
        conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=self.connect_timeout)
        try:
            with conn.transaction():
                # Bounds the wait for the lock (local to this transaction).
                conn.execute("SELECT set_config('lock_timeout', %s, true)",
                             [f"{max(1, round(timeout * 1000))}ms"])
                conn.execute(f"SELECT pg_advisory_lock({LOCK_KEY})", [self.name])
                token = conn.execute(NEXT_TOKEN, [self.name]).fetchone()[0]
            # Committed: the token is durable, and the session lock stays
            # held past COMMIT, until release() or the end of the session.
        except psycopg.errors.LockNotAvailable as e:
            conn.close()
            raise fenced.LockNotAcquired(f"advisory lock {self.name!r} still held after {timeout}s") from e
        except BaseException:
            # A session lock outlives a rolled-back transaction; closing the
            # session is what surely drops it.
            conn.close()
            raise
        self.conn = conn
        self.token = token
        return token

    def release(self):
        if self.conn is None:
            return False
        conn, self.conn = self.conn, None
        try:
            # False (and a server WARNING) if this session no longer held it.
            return conn.execute(f"SELECT pg_advisory_unlock({LOCK_KEY})", [self.name]).fetchone()[0]
        except psycopg.OperationalError:
            return False  # the session is gone, and its lock with it
        finally:
            conn.close()


def main(argv=None):
    def service_args(parser):
        parser.add_argument("--dsn", default="host=127.0.0.1 port=5432 dbname=postgres",
                            help="libpq connection string or URL (default: host=127.0.0.1 "
                                 "port=5432 dbname=postgres)")

    def make_lock(args):
        create_schema(args.dsn)
        return PostgresLock(args.dsn, args.lock_name)

    return fenced.run_cli(__doc__, service_args, make_lock, argv)


if __name__ == "__main__":
    raise SystemExit(main())

//! The schema fencegate creates (tables and the functions every operation
//! calls, one statement per call) and how its rows are read.

use crate::store::api::{LeaseOutcome, StoreError, WriteLease};
use crate::store::shared::{lease_answer, stored_token, Marker};

/// Bumped with every change below; recorded in `fencegate_schema`.
pub(super) const SCHEMA_VERSION: i32 = 5;

pub(super) const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS fencegate_schema (version integer NOT NULL);
CREATE TABLE IF NOT EXISTS fencegate_fences (
    key text PRIMARY KEY,
    highest numeric(20,0) NOT NULL CHECK (highest >= 0 AND highest <= 18446744073709551615)
);
CREATE TABLE IF NOT EXISTS fencegate_leases (
    id text PRIMARY KEY,
    key text NOT NULL,
    token numeric(20,0) NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS fencegate_leases_key ON fencegate_leases (key, token);
-- The lock service's leases, one per key at most (expiry on the server's
-- clock).
CREATE TABLE IF NOT EXISTS fencegate_grants (
    key text PRIMARY KEY,
    id text NOT NULL,
    token numeric(20,0) NOT NULL,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS fencegate_marker (
    id integer PRIMARY KEY CHECK (id = 1),
    epoch text NOT NULL,
    seq bigint NOT NULL
);

-- Raise if higher; 'stale' | 'equal' | 'raised', with the previous highest.
CREATE OR REPLACE FUNCTION fencegate_advance(k text, t numeric)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO fencegate_fences AS f (key, highest) VALUES (k, t)
            ON CONFLICT (key) DO UPDATE SET highest = GREATEST(f.highest, EXCLUDED.highest)
            RETURNING f.highest INTO h;
        IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
        RETURN QUERY SELECT 'raised'::text, NULL::text; RETURN;
    END IF;
    IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
    IF h = t THEN RETURN QUERY SELECT 'equal'::text, h::text; RETURN; END IF;
    UPDATE fencegate_fences SET highest = t WHERE key = k;
    RETURN QUERY SELECT 'raised'::text, h::text;
END $$;

-- Shared by acquire and poll: with the fence row locked, drop expired
-- leases, (re)register this one, and say whether an older one remains.
CREATE OR REPLACE FUNCTION fencegate_register(k text, t numeric, lid text, ttl_ms bigint)
RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM fencegate_leases l WHERE l.key = k AND l.expires_at <= clock_timestamp();
    -- A lease polled again gets a fresh expiry: it must outlive its write.
    INSERT INTO fencegate_leases (id, key, token, expires_at)
        VALUES (lid, k, t, clock_timestamp() + ttl_ms * interval '1 millisecond')
        ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    IF EXISTS (SELECT 1 FROM fencegate_leases l WHERE l.key = k AND l.token < t) THEN
        RETURN 'busy';
    END IF;
    RETURN 'granted';
END $$;

CREATE OR REPLACE FUNCTION fencegate_acquire(k text, t numeric, lid text, ttl_ms bigint)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    INSERT INTO fencegate_fences AS f (key, highest) VALUES (k, t)
        ON CONFLICT (key) DO UPDATE SET highest = EXCLUDED.highest WHERE f.highest < EXCLUDED.highest;
    -- The row lock serializes every admission on this key until commit.
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
    RETURN QUERY SELECT fencegate_register(k, t, lid, ttl_ms), t::text;
END $$;

-- A batch of admissions in one transaction (one commit, one WAL flush),
-- each answered as fencegate_acquire alone would, set-based: one statement
-- per step for the whole batch, not one per write. Keys are distinct and
-- sorted in byte order by the caller; fence rows are locked in that order
-- by every batch, so batches of several replicas cannot deadlock. Plans are pinned to index lookups: the planner's estimates for
-- arrays of unknown size and for a lease table that churns pick hash joins
-- over whole tables.
CREATE OR REPLACE FUNCTION fencegate_acquire_many(ks text[], ts numeric[], lids text[], ttls bigint[])
RETURNS TABLE(i integer, status text, value text) LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE now timestamptz := clock_timestamp();
BEGIN
    -- One ordered pass takes every row lock: ON CONFLICT DO UPDATE locks
    -- an existing row even when its WHERE leaves it unchanged, and claims a
    -- new one (locking existing rows first, then inserting, would take new
    -- keys out of order).
    INSERT INTO fencegate_fences AS f (key, highest)
        SELECT u.k, u.t FROM unnest(ks, ts) WITH ORDINALITY AS u(k, t, n) ORDER BY u.n
        ON CONFLICT (key) DO UPDATE SET highest = EXCLUDED.highest WHERE f.highest < EXCLUDED.highest;
    DELETE FROM fencegate_leases l USING unnest(ks) AS u(k)
        WHERE l.key = u.k AND l.expires_at <= now;
    INSERT INTO fencegate_leases (id, key, token, expires_at)
        SELECT u.lid, u.k, u.t, now + u.ttl * interval '1 millisecond'
        FROM unnest(ks, ts, lids, ttls) AS u(k, t, lid, ttl)
        JOIN fencegate_fences f ON f.key = u.k WHERE f.highest <= u.t
        ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    RETURN QUERY
        SELECT u.n::integer,
            CASE WHEN f.highest > u.t THEN 'stale'
                 WHEN EXISTS (SELECT 1 FROM fencegate_leases l
                              WHERE l.key = u.k AND l.token < u.t AND l.expires_at > now) THEN 'busy'
                 ELSE 'granted' END,
            CASE WHEN f.highest > u.t THEN f.highest::text ELSE u.t::text END
        FROM unnest(ks, ts) WITH ORDINALITY AS u(k, t, n)
        JOIN fencegate_fences f ON f.key = u.k;
END $$;

-- A batch of releases. Lease rows of a key are only touched with its fence
-- row locked, and fence rows are locked in byte order (the caller sorts
-- the keys), as admissions do: otherwise a release and an admission that
-- drops expired leases could deadlock on two lease rows.
CREATE OR REPLACE FUNCTION fencegate_release_many(ks text[], lids text[])
RETURNS void LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
BEGIN
    PERFORM 1 FROM unnest(ks) WITH ORDINALITY AS u(k, n) JOIN fencegate_fences f ON f.key = u.k
        ORDER BY u.n FOR UPDATE OF f;
    DELETE FROM fencegate_leases l USING unnest(lids) AS u(id) WHERE l.id = u.id;
END $$;

-- Extend a granted lease, unless a higher token took the key: then the
-- lease stays (writes admitted on it may still be in flight).
CREATE OR REPLACE FUNCTION fencegate_renew(k text, t numeric, lid text, ttl_ms bigint)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF NOT FOUND THEN RETURN QUERY SELECT 'lost'::text, ''::text; RETURN; END IF;
    IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
    INSERT INTO fencegate_leases (id, key, token, expires_at)
        VALUES (lid, k, t, clock_timestamp() + ttl_ms * interval '1 millisecond')
        ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    RETURN QUERY SELECT 'granted'::text, t::text;
END $$;

-- One lock-service operation ('claim', 'read', 'renew', 'release'),
-- answered as text: granted T | held ID T HOLDER MS | exhausted | lock ID T
-- HOLDER MS | released | none. Operations on one key run one at a time (a
-- transaction-scoped advisory lock on the key; admissions never take
-- one, so no lock cycle with their fence-row locks). A claim raises the
-- fence row to one above its highest in the same transaction that records
-- the lease.
CREATE OR REPLACE FUNCTION fencegate_lock(op text, k text, lid text, who text, ttl_ms bigint)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    now timestamptz;
    g fencegate_grants%ROWTYPE;
    t numeric;
    live boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('fencegate:' || k, 0));
    -- After the wait for the lock: expiry is judged at the operation's turn.
    now := clock_timestamp();
    SELECT * INTO g FROM fencegate_grants x WHERE x.key = k;
    live := FOUND AND g.expires_at > now;
    IF op = 'claim' THEN
        -- Sent again after a broken connection: the lease is already ours.
        IF live AND g.id = lid THEN RETURN ARRAY['granted', g.token::text, '1']; END IF;
        IF live THEN
            RETURN ARRAY['held', g.id, g.token::text, g.holder,
                floor(extract(epoch FROM g.expires_at - now) * 1000)::bigint::text];
        END IF;
        INSERT INTO fencegate_fences AS f (key, highest) VALUES (k, 1)
            ON CONFLICT (key) DO UPDATE SET highest = f.highest + 1
            WHERE f.highest < 18446744073709551615
            RETURNING f.highest INTO t;
        IF t IS NULL THEN RETURN ARRAY['exhausted']; END IF;
        INSERT INTO fencegate_grants AS x (key, id, token, holder, expires_at)
            VALUES (k, lid, t, who, now + ttl_ms * interval '1 millisecond')
            ON CONFLICT (key) DO UPDATE SET id = EXCLUDED.id, token = EXCLUDED.token,
                holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at;
        -- Every write lease is older than t: is any still held?
        RETURN ARRAY['granted', t::text, CASE WHEN EXISTS (SELECT 1 FROM fencegate_leases l
            WHERE l.key = k AND l.expires_at > now) THEN '1' ELSE '0' END];
    END IF;
    IF NOT live OR (op <> 'read' AND g.id <> lid) THEN RETURN ARRAY['none']; END IF;
    IF op = 'release' THEN
        DELETE FROM fencegate_grants x WHERE x.key = k;
        RETURN ARRAY['released'];
    END IF;
    IF op = 'renew' THEN
        g.expires_at := now + ttl_ms * interval '1 millisecond';
        UPDATE fencegate_grants x SET expires_at = g.expires_at WHERE x.key = k;
    END IF;
    RETURN ARRAY['lock', g.id, g.token::text, g.holder,
        floor(extract(epoch FROM g.expires_at - now) * 1000)::bigint::text];
END $$;

CREATE OR REPLACE FUNCTION fencegate_poll(k text, t numeric, lid text, ttl_ms bigint)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF NOT FOUND THEN RETURN QUERY SELECT 'lost'::text, ''::text; RETURN; END IF;
    IF h > t THEN
        DELETE FROM fencegate_leases WHERE id = lid;
        RETURN QUERY SELECT 'stale'::text, h::text; RETURN;
    END IF;
    RETURN QUERY SELECT fencegate_register(k, t, lid, ttl_ms), t::text;
END $$;
"#;

pub(super) fn parse_token(v: &str) -> Result<u64, StoreError> {
    stored_token("postgres", v)
}

pub(super) fn lease_outcome(
    status: &str,
    value: &str,
    lease: WriteLease,
) -> Result<LeaseOutcome, StoreError> {
    lease_answer("postgres", status, value, lease)
}

pub(super) fn marker_row(r: tokio_postgres::Row) -> Result<Marker, tokio_postgres::Error> {
    Ok(Marker {
        epoch: r.try_get(0)?,
        seq: u64::try_from(r.try_get::<_, i64>(1)?).unwrap_or(0),
    })
}

//! The Lua scripts every operation runs (one script per call, so that a
//! call is atomic on the server), the keyspace they work on, and how their
//! arguments are given and their replies read.

use std::time::Duration;

use redis::Script;

use crate::store::api::{LeaseOutcome, StoreError, WriteLease};
use crate::store::shared::lease_answer;

pub(super) const LT: &str = r#"
local function lt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Leases of a key: lk, hash member -> expiry ms; ok, sorted set of the same
-- members, all with score 0, so they sort by name: "TOKEN20:ID". The oldest
-- lease is the first member: finding an older one costs O(log n), however
-- many writes of one token are in flight.
-- A whole number of ms as a command argument. Lua would format the number
-- with "%.17g" (floating-point printing, a few percent of Redis's CPU per
-- write); a batch's writes mostly share their values, formatted once.
local formatted = {}
local function ms(n)
  local s = formatted[n]
  if not s then
    s = string.format('%d', n)
    formatted[n] = s
  end
  return s
end
local function pad(token)
  return string.rep('0', 20 - #token) .. token
end
local function unregister(lk, ok, token, id)
  local member = pad(token) .. ':' .. id
  redis.call('ZREM', ok, member)
  redis.call('HDEL', lk, member)
end
-- Whether an unexpired lease older than token exists; expired ones met on
-- the way are dropped.
local function older_exists(lk, ok, token, now)
  local bound = '(' .. pad(token)
  while true do
    local m = redis.call('ZRANGEBYLEX', ok, '-', bound, 'LIMIT', 0, 1)
    if #m == 0 then return false end
    local exp = redis.call('HGET', lk, m[1])
    if exp and tonumber(exp) > now then return true end
    redis.call('ZREM', ok, m[1])
    redis.call('HDEL', lk, m[1])
  end
end
-- fresh: the key has no fence, so it has no leases either (leases are
-- registered only once the fence is set, and fencegate never deletes a
-- fence on Redis): both sets are created here, with no expiry to compare.
local function register(lk, ok, token, id, ttl, now, fresh)
  local member = pad(token) .. ':' .. id
  redis.call('ZADD', ok, 0, member)
  redis.call('HSET', lk, member, ms(now + ttl))
  -- Only ever lengthened: a replica with a shorter TTL must not cut short
  -- another's lease (PEXPIRE's GT needs Redis 7).
  for _, k in ipairs({lk, ok}) do
    if fresh or redis.call('PTTL', k) < ttl * 2 then redis.call('PEXPIRE', k, ms(ttl * 2)) end
  end
end
"#;

/// A batch of admissions in one script (one AOF fsync): per write, keys
/// (fence, leases, lease order) and arguments (token, lease id, TTL in ms);
/// answers (status, value) per write, each as the write alone would get.
pub(super) const ACQUIRE: &str = r#"
local now = now_ms()
local out = {}
for i = 1, #ARGV / 3 do
  local fk, lk, ok = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local token, id, ttl = ARGV[3 * i - 2], ARGV[3 * i - 1], tonumber(ARGV[3 * i])
  local h = redis.call('GET', fk)
  if h and lt(token, h) then
    -- Registered by an earlier run of this call (sent again after a broken
    -- connection) if at all: a stale answer leaves no lease behind.
    unregister(lk, ok, token, id)
    out[#out + 1] = 'stale'
    out[#out + 1] = h
  else
    if (not h) or lt(h, token) then redis.call('SET', fk, token) end
    -- A key without a fence has no leases (see register): nothing older.
    local older = h and older_exists(lk, ok, token, now)
    register(lk, ok, token, id, ttl, now, not h)
    out[#out + 1] = older and 'busy' or 'granted'
    out[#out + 1] = token
  end
end
return out
"#;

pub(super) const POLL: &str = r#"
local token, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local h = redis.call('GET', KEYS[1])
if h and lt(token, h) then
  unregister(KEYS[2], KEYS[3], token, id)
  return {'stale', h}
end
if not h then return {'lost', ''} end
local now = now_ms()
local older = older_exists(KEYS[2], KEYS[3], token, now)
-- (Re)register with a fresh expiry: a lease being waited on, or checked
-- again before its write goes, must outlive that write.
register(KEYS[2], KEYS[3], token, id, ttl, now)
if older then return {'busy', token} end
return {'granted', token}
"#;

pub(super) const RENEW: &str = r#"
local token, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local h = redis.call('GET', KEYS[1])
if not h then return {'lost', ''} end
-- Taken by a higher token: the lease stays (its writes may be in flight).
if lt(token, h) then return {'stale', h} end
register(KEYS[2], KEYS[3], token, id, ttl, now_ms())
return {'granted', token}
"#;

/// A batch of releases: per lease, keys (leases, lease order) and
/// arguments (token, lease id).
pub(super) const RELEASE: &str = r#"
for i = 1, #ARGV / 2 do
  unregister(KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1], ARGV[2 * i])
end
return 1
"#;

pub(super) const ADVANCE: &str = r#"
local token = ARGV[1]
local h = redis.call('GET', KEYS[1])
if h and lt(token, h) then return {'stale', h} end
if h == token then return {'equal', h} end
redis.call('SET', KEYS[1], token)
return {'raised', h or ''}
"#;

/// One lock-service operation (keys: fence, lease, write leases, their
/// order; arguments: operation,
/// lease id, holder, TTL in ms). A claim raises the fence to one above
/// its highest (decimal text, so incremented digit by digit) in the same
/// script that records the lease. Answers as [`lock_reply`] reads them.
pub(super) const LOCK: &str = r#"
local op, id, holder, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local g = redis.call('HMGET', KEYS[2], 'id', 'token', 'holder', 'exp')
local live = g[1] and tonumber(g[4]) > now
local function shown(tag)
  -- Without the extra ms of the lease's end: never more than its TTL.
  return {tag, g[1], g[2], g[3], string.format('%d', math.max(tonumber(g[4]) - now - 1, 0))}
end
if op == 'claim' then
  -- Sent again after a broken connection: the lease is already ours.
  if live and g[1] == id then return {'granted', g[2], '1'} end
  if live then return shown('held') end
  local h = redis.call('GET', KEYS[1])
  local t = '1'
  if h then
    if h == '18446744073709551615' then return {'exhausted'} end
    local i = #h
    while i > 0 and h:sub(i, i) == '9' do i = i - 1 end
    if i == 0 then
      t = '1' .. string.rep('0', #h)
    else
      t = h:sub(1, i - 1) .. string.char(h:byte(i) + 1) .. string.rep('0', #h - i)
    end
  end
  redis.call('SET', KEYS[1], t)
  redis.call('DEL', KEYS[2])
  -- One ms more (TIME is read in whole ms, rounded down): the lease lasts
  -- at least its TTL from any moment before it was granted.
  redis.call('HSET', KEYS[2], 'id', id, 'token', t, 'holder', holder, 'exp', string.format('%d', now + ttl + 1))
  redis.call('PEXPIRE', KEYS[2], ttl + 1)
  -- Every write lease is older than t: is any still held?
  return {'granted', t, older_exists(KEYS[3], KEYS[4], t, now) and '1' or '0'}
end
if not live or (op ~= 'read' and g[1] ~= id) then return {'none'} end
if op == 'release' then
  redis.call('DEL', KEYS[2])
  return {'released'}
end
if op == 'renew' then
  g[4] = string.format('%d', now + ttl + 1)
  redis.call('HSET', KEYS[2], 'exp', g[4])
  redis.call('PEXPIRE', KEYS[2], ttl + 1)
end
return shown('lock')
"#;

pub(super) const BUMP_MARKER: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return nil end
redis.call('HINCRBY', KEYS[1], 'seq', 1)
return redis.call('HMGET', KEYS[1], 'epoch', 'seq')
"#;

pub(super) const CREATE_MARKER: &str = r#"
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[1])
redis.call('HSETNX', KEYS[1], 'seq', 1)
return redis.call('HMGET', KEYS[1], 'epoch', 'seq')
"#;

pub(super) const REPLACE_MARKER: &str = r#"
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'seq')
local matches = (ARGV[1] == '' and not cur[1]) or (cur[1] == ARGV[1] and cur[2] == ARGV[2])
if matches then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'epoch', ARGV[3], 'seq', 1)
end
return redis.call('HMGET', KEYS[1], 'epoch', 'seq')
"#;

/// Where an operation's keys are. On a lone primary each fence key has
/// its own hash tag (`fencegate:f:{KEY}`: a key's fence and leases in one
/// slot). On a cluster, every key of a group carries the group's tag
/// (`fencegate:{TAG}:f:KEY`): a group is one slot, so that a batch's
/// script may touch any of its keys, and its marker moves with it when
/// the slot is resharded.
#[derive(Clone, Debug)]
pub struct Keyspace {
    /// The group's hash tag, braces included; `None` on a lone primary.
    tag: Option<String>,
}

impl Keyspace {
    pub(super) fn lone() -> Self {
        Self { tag: None }
    }

    pub(super) fn group(tag: String) -> Self {
        Self { tag: Some(tag) }
    }

    /// The group's hash tag (`-` on a lone primary), to name it.
    pub(super) fn tag(&self) -> &str {
        self.tag.as_deref().unwrap_or("-")
    }

    /// The group's hash tag, on a cluster.
    pub(super) fn group_tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    fn name(&self, kind: &str, key: &str) -> String {
        match &self.tag {
            None => format!("fencegate:{kind}:{{{key}}}"),
            Some(tag) => format!("fencegate:{tag}:{kind}:{key}"),
        }
    }

    pub(super) fn fence(&self, key: &str) -> String {
        self.name("f", key)
    }

    pub(super) fn lease(&self, key: &str) -> String {
        self.name("l", key)
    }

    pub(super) fn grant(&self, key: &str) -> String {
        self.name("g", key)
    }

    pub(super) fn lease_order(&self, key: &str) -> String {
        self.name("o", key)
    }

    /// The amnesia marker (a hash with `epoch` and `seq`).
    pub(super) fn marker(&self) -> String {
        match &self.tag {
            None => "fencegate:marker".into(),
            Some(tag) => format!("fencegate:{tag}:marker"),
        }
    }

    /// Written after a call so that `WAIT` covers it (see the module doc).
    pub(super) fn sync(&self) -> String {
        match &self.tag {
            None => "fencegate:sync".into(),
            Some(tag) => format!("fencegate:{tag}:sync"),
        }
    }
}

/// The scripts, each loaded once per server and run by its hash.
pub struct Scripts {
    pub(super) acquire: Script,
    pub(super) poll: Script,
    pub(super) renew: Script,
    pub(super) advance: Script,
    pub(super) release: Script,
    pub(super) lock: Script,
    pub(super) bump_marker: Script,
    pub(super) create_marker: Script,
    pub(super) replace_marker: Script,
}

/// A cluster group's wrapper around every script: the group's marker
/// key and sync key come last in KEYS. The script writes the sync key
/// (so that `WAIT`, next in the round trip, covers the call) and answers
/// `{reply, epoch, seq}`: the group's marker read in the same atomic
/// call, so that an answer from a node that lost the group's data (a
/// restart, a failover to a replica that missed writes) is never used
/// before the marker is checked.
const GUARD: &str = r#"
local r = call()
if r == nil then r = false end
redis.call('SET', KEYS[#KEYS], '1')
local m = redis.call('HMGET', KEYS[#KEYS - 1], 'epoch', 'seq')
return {r, m[1] or '', m[2] or ''}
"#;

impl Scripts {
    pub(super) fn new() -> Self {
        Self::made(|lib, body| match lib {
            "" => Script::new(body),
            lib => Script::new(&format!("{lib}\n{body}")),
        })
    }

    /// The scripts as a cluster group runs them (see [`GUARD`]).
    pub(super) fn guarded() -> Self {
        Self::made(|lib, body| {
            Script::new(&format!(
                "{lib}\nlocal function call()\n{body}\nend\n{GUARD}"
            ))
        })
    }

    fn made(make: impl Fn(&str, &str) -> Script) -> Self {
        let with_lib = |body: &str| make(LT, body);
        Self {
            acquire: with_lib(ACQUIRE),
            poll: with_lib(POLL),
            renew: with_lib(RENEW),
            advance: with_lib(ADVANCE),
            release: with_lib(RELEASE),
            lock: with_lib(LOCK),
            bump_marker: make("", BUMP_MARKER),
            create_marker: make("", CREATE_MARKER),
            replace_marker: make("", REPLACE_MARKER),
        }
    }

    pub(super) fn all(&self) -> [&Script; 9] {
        [
            &self.acquire,
            &self.poll,
            &self.renew,
            &self.advance,
            &self.release,
            &self.lock,
            &self.bump_marker,
            &self.create_marker,
            &self.replace_marker,
        ]
    }
}

/// A lease TTL as the scripts take it: whole milliseconds, at least one.
pub(super) fn ttl_ms(ttl: Duration) -> u64 {
    ttl.as_millis().max(1) as u64
}

pub(super) fn lease_outcome(
    reply: (String, String),
    lease: WriteLease,
) -> Result<LeaseOutcome, StoreError> {
    lease_answer("redis", &reply.0, &reply.1, lease)
}

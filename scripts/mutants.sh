#!/usr/bin/env bash
# Mutation testing of the fence's core with cargo-mutants: every mutant of
# token parsing, key canonicalisation, admission and ordering, and the
# request classification in the proxy, must make a test fail.
#
#   scripts/mutants.sh              the full run (figures: docs/reliability.md)
#   scripts/mutants.sh core         token, key and fence (unit tests);
#                                   CORE_FILES="src/fence/admit.rs" narrows it
#   scripts/mutants.sh shared       the fence's shared-store admission
#   scripts/mutants.sh proxy        the classification in src/proxy/ only
#   scripts/mutants.sh config       config validation (unit tests)
#   scripts/mutants.sh lease        the lock service's parsing, scopes
#                                   and ids (unit tests)
#   scripts/mutants.sh batch        the stores' group commit (unit tests)
#   scripts/mutants.sh wal          the embedded store's write-ahead log,
#                                   its logged path and checkpoints (unit
#                                   tests)
#   scripts/mutants.sh upstream     the upstream pool and the rule that a
#                                   write is never sent twice
#                                   (tests/upstream_pool.rs)
#   scripts/mutants.sh stores       the shared stores' lease and lock code
#                                   (Redis and PostgreSQL; STORE_ENGINES
#                                   picks the engines, e.g.
#                                   STORE_ENGINES=etcd)
#   scripts/mutants.sh --in-diff F  only mutants on lines a diff F changed
#
# Results land in target/mutants/<part>/mutants.out (missed.txt lists the
# survivors). Exits non-zero when a mutant survives.
#
# Scope, so that a run fits this 2-core machine: the core files are covered
# by their unit tests (`--lib`), which run in seconds; the fence's
# shared-store admission by its registrations' unit tests and the suites
# that run it against real Redis, PostgreSQL and etcd servers
# (tests/shared_stores.rs, and tests/partition.rs for what a partition
# does to an admission); the proxy's
# classification functions by the integration tests that exercise them
# against the real binary (contract, hostile, hostile_routes, and reload
# for the key-mapping barrier a request holds). A mutant
# costs one debug build plus its tests. The test selection is given as
# --cargo-arg, not after `--`, so that each mutant's build compiles only
# the test targets that run (after `--` it reaches `cargo test` alone, and
# every integration test would be rebuilt for each mutant).
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/mutants
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants@27.1.0

# No debug info: a mutant's build is mostly linking, and this halves it.
export CARGO_PROFILE_DEV_DEBUG=0
export CARGO_PROFILE_TEST_DEBUG=0

# The fence's files but its unit tests (fence/tests.rs), active.rs (the
# shared part's) and grant.rs (the lock service's grants, covered by
# tests/leases.rs).
FENCE_FILES='src/fence/mod.rs src/fence/state.rs src/fence/admit.rs src/fence/gate.rs src/fence/cache.rs src/fence/recovery.rs src/fence/shared.rs src/fence/error.rs'
SHARED='Fence::admit_shared|Fence::overtaken_shared|PendingLease|Fence::release_active|Fence::spawn_release|Fence::sweep_registrations|Active::|ActiveState::|Check'
CLASSIFY='resolve|route_key|match_order|host_sources_plain|Proxy::is_write|is_copy_or_move|check_framing|request_host|query_values|Proxy::fence_key|Proxy::destination_key|strip_hop_by_hop'

# The verdict comes from missed.txt, not from cargo-mutants' exit status:
# a mutant whose tests time out (an infinite loop) changed behaviour the
# tests observe, so it counts as caught; any other failure of the tool
# (baseline tests failing, a diff that does not apply) fails the run.
run() {
  local part=$1
  shift
  local out=target/mutants/$part status=0
  rm -rf "$out"
  cargo mutants --no-shuffle --output "$out" "$@" || status=$?
  case $status in
    0 | 2 | 3) ;;
    *) echo "mutants.sh: cargo-mutants failed ($status) on $part" >&2; return "$status" ;;
  esac
  local missed=$out/mutants.out/missed.txt
  if [[ -s $missed ]]; then
    echo "mutants.sh: $(wc -l <"$missed") mutants survived in $part:" >&2
    cat "$missed" >&2
    return 2
  fi
}

core() {
  local files=()
  for f in ${CORE_FILES:-src/token.rs src/key/mod.rs $FENCE_FILES}; do files+=(--file "$f"); done
  run core --timeout 30 "${files[@]}" --exclude-re "$SHARED" "$@" --cargo-arg=--lib
}

shared() {
  run shared --timeout 600 --file src/fence/shared.rs --file src/fence/active.rs --file src/fence/state.rs --re "$SHARED" "$@" --cargo-arg=--lib --cargo-arg=--test=shared_stores --cargo-arg=--test=partition
}

proxy() {
  run proxy --timeout 300 --file src/routing.rs --file src/proxy/classify.rs --file src/proxy/forward.rs --re "$CLASSIFY" "$@" \
    --cargo-arg=--test=contract --cargo-arg=--test=hostile --cargo-arg=--test=hostile_routes \
    --cargo-arg=--test=reload
}

config() {
  run config --timeout 30 --file src/config/raw.rs --file src/config/route.rs --file src/config/validated.rs --file src/config/parse.rs --file src/config/secret.rs --file src/config/error.rs --file src/config/store/mod.rs "$@" --cargo-arg=--lib
}

# The lease service's pure parts: bearer lines and scopes, lease ids, key
# forms, request bodies. Its HTTP handling is covered by tests/leases.rs on
# every store, too slow to mutate here.
lease() {
  run lease --timeout 30 --file src/lease.rs --file src/bearer.rs \
    --re 'parse_bearers|Bearer::|tag|new_id|id_parts|path_key_is_canonical|millis|text' "$@" --cargo-arg=--lib
}

batch() {
  run batch --timeout 60 --file src/store/batch.rs "$@" --cargo-arg=--lib
}

# The embedded store's write-ahead log (issue 33): its records, replay,
# the writer's logged path and the checkpoints, by the store's unit tests
# (src/store/embedded/tests.rs, wal.rs's own).
wal() {
  run wal --timeout 120 --file src/store/embedded/wal.rs --file src/store/embedded/logged.rs \
    --file src/store/embedded/checkpoint.rs --file src/store/embedded/identity.rs "$@" --cargo-arg=--lib
}

# The pool's unit tests (src/upstream.rs: idle expiry, the reaper, each
# worker's pool, request forms, body hints) with the suites that use the
# pool through the binary: keep-alive limits and closes, TLS and HTTP/2.
upstream() {
  run upstream --timeout 300 --file src/upstream.rs "$@" --cargo-arg=--lib --cargo-arg=--test=upstream_pool \
    --cargo-arg=--test=contract --cargo-arg=--test=h2c --cargo-arg=--test=tls \
    --cargo-arg=--test=streaming
}

# The shared stores' leases (the fence's write leases and the lock
# service's locks): what each engine sends and how it reads the answers,
# against real servers (tests/shared_stores.rs and tests/leases.rs). One
# run per engine, each running only its own engine's tests over plain
# connections (the test-name filter `redis::`; the TLS variants run the
# same lease code): a mutant of the Redis engine cannot be caught by a
# PostgreSQL test, and the filter cuts each mutant's test time to a
# sixth. etcd's engine builds its transactions in Rust (52 mutants, the
# others' are Lua and SQL): it is left out of the default,
# STORE_ENGINES=etcd runs it.
STORE_LEASES='acquire_many|::poll|::renew|release_many|::lock|lease_outcome|lock_reply|lease_script|ttl_ms|LockCall|lease_key|grant_key|lease_order_key'
stores() {
  local status=0 engine
  for engine in ${STORE_ENGINES:-redis postgres}; do
    local files=() f
    for f in "src/store/$engine.rs" "src/store/$engine"/*.rs; do
      # Not its unit tests, nor PostgreSQL's TLS stream (whose poll_*
      # functions `::poll` would match; no lease code there).
      [[ -f $f && $f != */tests.rs && $f != */tls.rs ]] && files+=(--file "$f")
    done
    run "stores-$engine" --timeout 900 "${files[@]}" --re "$STORE_LEASES" "$@" \
      --cargo-arg=--test=shared_stores --cargo-arg=--test=leases --cargo-test-arg="$engine::" || status=$?
  done
  return "$status"
}

# Redis's wait for its replicas and the count it waits for (issue 30):
# the step-by-step failover tests and the Redis history runs (the Sentinel
# failover among them) against real servers.
FAILOVER='replicas_wanted|sentinel_up|fn replication|RedisBackend::query|wait_ms|sentinel_replicas_up'
failover() {
  run failover --timeout 300 --file src/store/redis/conn.rs --re "$FAILOVER" "$@" \
    --cargo-arg=--lib --cargo-arg=--test=failover --cargo-arg=--test=history --cargo-test-arg=redis
}

case "${1:-all}" in
  core) shift; core "$@" ;;
  shared) shift; shared "$@" ;;
  proxy) shift; proxy "$@" ;;
  config) shift; config "$@" ;;
  lease) shift; lease "$@" ;;
  batch) shift; batch "$@" ;;
  wal) shift; wal "$@" ;;
  upstream) shift; upstream "$@" ;;
  stores) shift; stores "$@" ;;
  failover) shift; failover "$@" ;;
  --in-diff)
    # Each part on its own files: a diff that touches neither has no
    # mutant to test, which is a success.
    status=0
    core --in-diff "$2" || status=$?
    shared --in-diff "$2" || status=$?
    proxy --in-diff "$2" || status=$?
    exit "$status"
    ;;
  all)
    status=0
    core || status=$?
    shared || status=$?
    proxy || status=$?
    exit "$status"
    ;;
  *) echo "usage: $0 [core|shared|proxy|config|lease|batch|wal|upstream|stores|failover|--in-diff FILE]" >&2; exit 2 ;;
esac

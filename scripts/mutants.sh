#!/usr/bin/env bash
# Mutation testing of the fence's core with cargo-mutants: every mutant of
# token parsing, key canonicalisation, admission and ordering, and the
# request classification in the proxy, must make a test fail.
#
#   scripts/mutants.sh              the full run (figures: docs/reliability.md)
#   scripts/mutants.sh core         token, key and fence only (unit tests)
#   scripts/mutants.sh proxy        the classification in src/proxy.rs only
#   scripts/mutants.sh --in-diff F  only mutants on lines a diff F changed
#
# Results land in target/mutants/<part>/mutants.out (missed.txt lists the
# survivors). Exits non-zero when a mutant survives.
#
# Scope, so that a run fits this 2-core machine: the core files are covered
# by their unit tests (`--lib`), which run in seconds; the proxy's
# classification functions by the integration tests that exercise them
# against the real binary (contract, hostile, hostile_routes), one debug
# build per mutant.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/mutants
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants@27.1.0

# No debug info: a mutant's build is mostly linking, and this halves it.
export CARGO_PROFILE_DEV_DEBUG=0
export CARGO_PROFILE_TEST_DEBUG=0

CLASSIFY='Proxy::is_write|is_copy_or_move|check_framing|request_host|query_values|Proxy::fence_key|Proxy::destination_key|strip_hop_by_hop'

core() {
  cargo mutants --no-shuffle --timeout 120 --output target/mutants/core \
    --file src/token.rs --file src/key.rs --file src/fence.rs "$@" -- --lib
}

proxy() {
  cargo mutants --no-shuffle --timeout 300 --output target/mutants/proxy \
    --file src/proxy.rs --re "$CLASSIFY" "$@" \
    -- --test contract --test hostile --test hostile_routes
}

case "${1:-all}" in
  core) shift; core "$@" ;;
  proxy) shift; proxy "$@" ;;
  --in-diff)
    # Each part on its own files: a diff that touches neither finds no
    # mutant, which cargo-mutants reports as success.
    status=0
    core --in-diff "$2" || status=$?
    proxy --in-diff "$2" || status=$?
    exit "$status"
    ;;
  all)
    status=0
    core || status=$?
    proxy || status=$?
    exit "$status"
    ;;
  *) echo "usage: $0 [core|proxy|--in-diff FILE]" >&2; exit 2 ;;
esac

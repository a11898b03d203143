#!/usr/bin/env bash
# Latency of one durable advance (a PUT to a new key: raise + in-flight lease)
# per store, measured the same way for each: fencegate in front of an nginx
# answering 200, wrk with one connection (sequential writes: the latency of
# one advance) and with 64 connections (throughput), each for SECONDS.
# Servers are started here on loopback in temp dirs, with the durability
# settings docs/stores.md asks for.
#
# The second table is the lock service's (--lease-listen, docs/leases.md):
# grants of leases on new keys and renewals of held leases, latency with one
# connection and throughput with 64.
#
# Usage: scripts/store_latency.sh [SECONDS]   (needs wrk, nginx, redis-server,
# postgresql, etcd-server; run as root for PostgreSQL's runuser)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-5}
for t in wrk nginx redis-server etcd runuser; do
  command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }
done
PGBIN=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
[ -x "$PGBIN/initdb" ] || { echo "missing: postgresql" >&2; exit 1; }
cargo build --release --quiet
BIN=$PWD/target/release/fencegate
WORK=$(mktemp -d /tmp/fencegate-latency.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() { exec 2>/dev/null; for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; pkill -9 -f "$WORK" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }

NGINX_PORT=$(port)
mkdir -p "$WORK/nginx"
cat > "$WORK/nginx/conf" <<CONF
worker_processes 1; pid $WORK/nginx/pid; error_log $WORK/nginx/err;
events {} http { access_log off; client_body_temp_path $WORK/nginx/b; keepalive_requests 1000000;
  server { listen 127.0.0.1:$NGINX_PORT; location / { return 200 "ok\n"; } } }
CONF
nginx -c "$WORK/nginx/conf" -p "$WORK/nginx"; PIDS+=("$(cat "$WORK/nginx/pid")")

REDIS_PORT=$(port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync always --dir "$WORK" >/dev/null &
PIDS+=($!)
PG_PORT=$(port)
mkdir -p "$WORK/pg"; chown -R postgres "$WORK"
runuser -u postgres -- "$PGBIN/initdb" -D "$WORK/pg" -A trust -U postgres >/dev/null
runuser -u postgres -- "$PGBIN/postgres" -D "$WORK/pg" -p "$PG_PORT" -c listen_addresses=127.0.0.1 -k "$WORK" >/dev/null 2>&1 &
PIDS+=($!)
ETCD_PORT=$(port); ETCD_PEER=$(port)
etcd --name default --data-dir "$WORK/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-cluster "default=http://127.0.0.1:$ETCD_PEER" >/dev/null 2>&1 &
PIDS+=($!)
for p in $REDIS_PORT $PG_PORT $ETCD_PORT; do wait_port "$p"; done
sleep 1

# Each run writes under a path prefix of its own: wrk's Lua random numbers
# repeat from run to run, and a key written before is not a new key.
cat > "$WORK/newkey.lua" <<'LUA'
local n = 0
request = function()
  n = n + 1
  return wrk.format("PUT", wrk.path .. n, { ["X-Fence-Token"] = "1" }, "x")
end
LUA
cat > "$WORK/steady.lua" <<'LUA'
wrk.method = "PUT"; wrk.body = "x"; wrk.headers["X-Fence-Token"] = "1"
LUA
# Lease grants on new keys (the key prefix is the URL's query, so each
# run's keys are its own), and renewals over a list of held leases (ids.lua,
# written below), each lease renewed by one request at a time.
LEASE_BEARER=store-latency-lease-token-0123
echo "$LEASE_BEARER" > "$WORK/lease-tokens"
cat > "$WORK/grant.lua" <<LUA
local n = 0
wrk.headers["Authorization"] = "Bearer $LEASE_BEARER"
request = function()
  n = n + 1
  local prefix = wrk.path:match("%?(.*)") or "lat:k"
  return wrk.format("POST", "/v1/leases", nil, '{"key":"' .. prefix .. n .. '","ttl_ms":60000}')
end
LUA
cat > "$WORK/renew.lua" <<LUA
dofile("$WORK/ids.lua")
local n = 0
wrk.headers["Authorization"] = "Bearer $LEASE_BEARER"
request = function()
  n = n % #ids + 1
  return wrk.format("POST", "/v1/leases/" .. ids[n] .. "/renew", nil, '{"ttl_ms":60000}')
end
LUA
LEASES=()

echo "| store | advance p50 (1 conn) | advance p99 (1 conn) | advances/s (64 conns) | steady-token writes/s (64 conns) |"
echo "|---|---|---|---|---|"
for store in "embedded|$WORK/fences.redb" "redis|redis://127.0.0.1:$REDIS_PORT/0" \
             "postgres|postgres://postgres@127.0.0.1:$PG_PORT/postgres" "etcd|etcd://127.0.0.1:$ETCD_PORT"; do
  name=${store%%|*}; url=${store#*|}
  # A new shared store is marked once before replicas use it (docs/stores.md).
  if [ "$name" != embedded ]; then
    for _ in $(seq 100); do "$BIN" init-store --store "$url" >/dev/null 2>&1 && break; sleep 0.2; done
  fi
  # The quick start's catch-all route, and /g admitting only granted tokens.
  cat > "$WORK/$name.toml" <<TOML
[[routes]]
name = "granted"
path_prefix = "/g"
upstream = "http://127.0.0.1:$NGINX_PORT"
namespace = "g"
tokens = "granted"

[[routes]]
name = "default"
upstream = "http://127.0.0.1:$NGINX_PORT"
TOML
  "$BIN" --config "$WORK/$name.toml" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    --lease-listen 127.0.0.1:0 --lease-token-file "$WORK/lease-tokens" \
    --store "$url" > "$WORK/$name.out" 2> "$WORK/$name.err" &
  FG=$!; PIDS+=($FG)
  for _ in $(seq 100); do grep -q listening "$WORK/$name.out" 2>/dev/null && break; sleep 0.1; done
  PROXY=$(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' "$WORK/$name.out")
  curl -s -o /dev/null -X PUT -H 'X-Fence-Token: 1' "http://$PROXY/warmup"
  wrk -t1 -c1 -d"${SECS}s" --latency -s "$WORK/newkey.lua" "http://$PROXY/lat/$name-1/" > "$WORK/$name.1"
  wrk -t1 -c64 -d"${SECS}s" -s "$WORK/newkey.lua" "http://$PROXY/lat/$name-64/" > "$WORK/$name.64"
  wrk -t1 -c64 -d"${SECS}s" -s "$WORK/steady.lua" "http://$PROXY/steady" > "$WORK/$name.s"
  for f in 1 64 s; do
    if grep -q Non-2xx "$WORK/$name.$f"; then echo "$name: non-2xx answers" >&2; cat "$WORK/$name.$f" >&2; exit 1; fi
  done
  p50=$(awk '$1=="50%" {print $2}' "$WORK/$name.1"); p99=$(awk '$1=="99%" {print $2}' "$WORK/$name.1")
  rps=$(awk '/Requests\/sec/ {printf "%.0f", $2}' "$WORK/$name.64"); steady=$(awk '/Requests\/sec/ {printf "%.0f", $2}' "$WORK/$name.s")
  echo "| $name | $p50 | $p99 | $rps | $steady |"
  # The lock service on the same store.
  LEASE=$(sed -n 's/.*lease=\([^ ]*\).*/\1/p' "$WORK/$name.out")
  wrk -t1 -c1 -d"${SECS}s" --latency -s "$WORK/grant.lua" "http://$LEASE/?lat:$name-g1-" > "$WORK/$name.g1"
  wrk -t1 -c64 -d"${SECS}s" -s "$WORK/grant.lua" "http://$LEASE/?lat:$name-g64-" > "$WORK/$name.g64"
  echo "ids = {" > "$WORK/ids.lua"
  for i in $(seq 256); do
    curl -sf -H "Authorization: Bearer $LEASE_BEARER" -d "{\"key\":\"lat:$name-renew-$i\",\"ttl_ms\":60000}" \
      "http://$LEASE/v1/leases" | python3 -c 'import json,sys; print(repr(json.load(sys.stdin)["lease"]) + ",")' >> "$WORK/ids.lua"
  done
  echo "}" >> "$WORK/ids.lua"
  wrk -t1 -c1 -d"${SECS}s" --latency -s "$WORK/renew.lua" "http://$LEASE/" > "$WORK/$name.r1"
  wrk -t1 -c64 -d"${SECS}s" -s "$WORK/renew.lua" "http://$LEASE/" > "$WORK/$name.r64"
  # Steady writes of a granted token on the granted route (the same load
  # as the steady column above, on a route that checks the grant).
  T=$(curl -sf -H "Authorization: Bearer $LEASE_BEARER" -d '{"path":"/g/steady","ttl_ms":60000}' \
    "http://$LEASE/v1/leases" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
  sed "s/\"1\"/\"$T\"/" "$WORK/steady.lua" > "$WORK/steady-g.lua"
  wrk -t1 -c64 -d"${SECS}s" -s "$WORK/steady-g.lua" "http://$PROXY/g/steady" > "$WORK/$name.gs"
  for f in g1 g64 r1 r64 gs; do
    if grep -q Non-2xx "$WORK/$name.$f"; then echo "$name: non-2xx lease answers" >&2; cat "$WORK/$name.$f" >&2; exit 1; fi
  done
  q() { awk -v k="$1" '$1==k {print $2}' "$WORK/$name.$2"; }
  r() { awk '/Requests\/sec/ {printf "%.0f", $2}' "$WORK/$name.$1"; }
  LEASES+=("| $name | $(q 50% g1) | $(q 99% g1) | $(r g64) | $(q 50% r1) | $(q 99% r1) | $(r r64) | $(r gs) |")
  kill "$FG"; wait "$FG" 2>/dev/null || true
done
echo
echo "| store | lease grant p50 (1 conn) | grant p99 (1 conn) | grants/s, new keys (64 conns) | renew p50 (1 conn) | renew p99 (1 conn) | renews/s (64 conns) | steady writes/s on a granted route (64 conns) |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${LEASES[@]}"
echo
echo "machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%d); wrk -t1, ${SECS}s per cell; servers on the same host (loopback)"

#!/usr/bin/env bash
# Memory and scale, one run:
#  1. a store with 10M keys: time from start to ready, RSS after start;
#  2. 1M distinct keys written through fencegate (the highest-token cache
#     full at its default 1M entries): RSS;
#  3. 10M keys touched is bounded by the same cache: RSS after 1M more
#     distinct keys on the 10M store;
#  4. a 256 MiB upload through fencegate vs direct (nginx discarding the
#     body): throughput ratio and fencegate's peak RSS.
#  5. memory per client connection, fencegate against nginx proxying to
#     the same backend: N connections held idle, and between two
#     keep-alive requests, over HTTP/1.1 and HTTP/2, plain and TLS; a
#     fresh process per row (scripts/connmem.py reads the RSS growth).
# Usage: scripts/scale.sh [KEYS_BIG] [KEYS_TOUCHED]   (needs wrk, nginx, curl, openssl)
#        scripts/scale.sh --connections [N]   only the connection rows
#        (N defaults to what fencegate's descriptor budget allows under
#        this shell's `ulimit -n`, at most 15000)
set -euo pipefail
cd "$(dirname "$0")/.."
BIG=${1:-10000000}
TOUCH=${2:-1000000}
for t in wrk nginx curl python3 openssl; do command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }; done
cargo build --release --quiet --example populate
cargo build --release --quiet
BIN=$PWD/target/release/fencegate
WORK=$(mktemp -d "$PWD/target/scale.XXXXXX")
PIDS=()
# Children first (nginx's workers do not name $WORK on their command
# line), their parent stopped before (a live nginx master replaces a
# killed worker at once), and nginx's pid file read again: it is written after the command
# that started nginx returned.
cleanup() {
  exec 2>/dev/null
  [[ -s $WORK/nginx/pid ]] && PIDS+=("$(cat "$WORK/nginx/pid")")
  for p in "${PIDS[@]}"; do kill -STOP "$p" || true; pkill -9 -P "$p" || true; kill -9 "$p" || true; done
  pkill -9 -f "$WORK" || true
  rm -rf "$WORK"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# A free port below the ephemeral range: a port picked now and bound later
# must not be taken meanwhile as the source port of one of the thousands
# of connections the connection rows open.
lowport() {
  python3 - <<'PY'
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(1000):
    p = random.randrange(10000, low)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    print(p)
    break
PY
}
rss_mib() { awk '/VmRSS/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }
hwm_mib() { awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }

UP=$(port)
mkdir -p "$WORK/nginx"
cat > "$WORK/nginx/conf" <<CONF
worker_processes 1; pid $WORK/nginx/pid; error_log $WORK/nginx/err;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path $WORK/nginx/b; client_max_body_size 0; keepalive_requests 1000000;
  server { listen 127.0.0.1:$UP; location / { return 200 "ok\n"; } } }
CONF
nginx -c "$WORK/nginx/conf" -p "$WORK/nginx"; PIDS+=("$(cat "$WORK/nginx/pid")")

connection_rows() { # N
  local n=$1
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=localhost \
    -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>/dev/null
  local P1 P2 PT FP FT; P1=$(lowport); P2=$(lowport); PT=$(lowport); FP=$(lowport); FT=$(lowport)
  mkdir -p "$WORK/px"
  # nginx as a reverse proxy to the same backend, timeouts as long as
  # fencegate's below, one worker.
  cat > "$WORK/px/conf" <<CONF
worker_processes 1; pid $WORK/px/pid; error_log $WORK/px/err; worker_rlimit_nofile $((n * 2 + 1000));
events { worker_connections $((n * 2 + 500)); }
http { access_log off; client_body_temp_path $WORK/px/b; proxy_temp_path $WORK/px/p; keepalive_timeout 300s; keepalive_requests 1000000;
  client_header_timeout 300s;
  upstream up { server 127.0.0.1:$UP; keepalive 64; }
  server { listen 127.0.0.1:$P1; listen 127.0.0.1:$PT ssl http2; ssl_certificate $WORK/cert.pem; ssl_certificate_key $WORK/key.pem;
    location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; } }
  server { listen 127.0.0.1:$P2 http2; location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
CONF
  cat > "$WORK/fg.toml" <<TOML
listen = "127.0.0.1:$FP"
admin_listen = "127.0.0.1:0"
store = "$WORK/conn.redb"
[limits]
max_connections = $((n + 100))
header_read_timeout = "300s"
response_idle_timeout = "300s"
[tls]
listen = "127.0.0.1:$FT"
cert = "$WORK/cert.pem"
key = "$WORK/key.pem"
[[routes]]
name = "default"
upstream = "http://127.0.0.1:$UP"
TOML
  echo "| connections ($n each) | state | fencegate, bytes each | nginx, bytes each | ratio |"
  echo "|---|---|---|---|---|"
  local row
  for row in "http/1.1 plain:$FP:$P1:" "http/1.1 tls:$FT:$PT:--tls $WORK/cert.pem" \
             "h2c plain:$FP:$P2:--h2" "h2 tls:$FT:$PT:--h2 --tls $WORK/cert.pem"; do
    local name=${row%%:*} rest=${row#*:}; local fport=${rest%%:*}; rest=${rest#*:}
    local nport=${rest%%:*} opts=${rest#*:}
    local state
    for state in idle keepalive; do
      # A fresh process for each row: freed memory that an allocator
      # keeps would hide the next row's growth.
      rm -f "$WORK/conn.redb"*
      "$BIN" --config "$WORK/fg.toml" > "$WORK/c.out" 2> "$WORK/c.err" & local fpid=$!; PIDS+=("$fpid")
      for _ in $(seq 1000); do grep -q listening "$WORK/c.out" 2>/dev/null && break; sleep 0.01; done
      # shellcheck disable=SC2086
      local f; f=$(python3 scripts/connmem.py --addr "127.0.0.1:$fport" --pid "$fpid" --n "$n" --state "$state" $opts)
      kill "$fpid"; wait "$fpid" 2>/dev/null || true
      nginx -c "$WORK/px/conf" -p "$WORK/px"; sleep 0.2
      local npid; npid=$(pgrep -P "$(cat "$WORK/px/pid")" | head -1)
      # shellcheck disable=SC2086
      local g; g=$(python3 scripts/connmem.py --addr "127.0.0.1:$nport" --pid "$npid" --n "$n" --state "$state" $opts)
      nginx -c "$WORK/px/conf" -p "$WORK/px" -s stop 2>/dev/null; sleep 0.3
      python3 - "$name" "$state" "$f" "$g" <<'PY'
import json, sys
f, g = json.loads(sys.argv[3])["per_conn_bytes"], json.loads(sys.argv[4])["per_conn_bytes"]
print(f"| {sys.argv[1]} | {sys.argv[2]} | {f:,} | {g:,} | {f / max(g, 1):.1f}x |")
PY
    done
  done
}

if [[ ${1:-} == --connections ]]; then
  NOFILE=$(ulimit -n)
  # fencegate's data listeners hold nofile - 64 - 256 - the routes' upstream
  # caps (64 here) together (docs/operations.md, limits.max_connections);
  # the rows stay within it.
  BUDGET=$(( NOFILE - 64 - 256 - 64 ))
  N=${2:-$(( BUDGET < 15000 ? BUDGET - 100 : 15000 ))}
  connection_rows "$N"
  echo
  echo "machine: $(nproc) cores, $(uname -r), nofile $NOFILE, $(date -u +%Y-%m-%d)"
  exit 0
fi

start() { # store -> "pid addr admin ready_ms"
  local t0; t0=$(date +%s%N)
  "$BIN" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --upstream "http://127.0.0.1:$UP" --store "$1" > "$WORK/fg.out" 2> "$WORK/fg.err" &
  local pid=$!; PIDS+=("$pid")
  for _ in $(seq 1000); do grep -q listening "$WORK/fg.out" 2>/dev/null && break; sleep 0.005; done
  local admin; admin=$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$WORK/fg.out")
  until curl -sf "http://$admin/readyz" >/dev/null; do sleep 0.005; done
  local t1; t1=$(date +%s%N)
  echo "$pid $(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' "$WORK/fg.out") $admin $(( (t1 - t0) / 1000000 ))"
}
cat > "$WORK/newkey.lua" <<LUA
local n = 0
local limit = $TOUCH
request = function()
  n = n + 1
  if n > limit then n = 1 end
  return wrk.format("PUT", "/touch/" .. n, { ["X-Fence-Token"] = "1" }, "x")
end
LUA
touch_keys() { # addr
  # wrk is duration-bound: run until TOUCH distinct keys were written.
  local before; before=$(curl -s "http://$2/metrics" | awk '/^fencegate_writes_total\{decision="admitted"/ {print $2}')
  while :; do
    wrk -t1 -c64 -d10s -s "$WORK/newkey.lua" "http://$1/" >/dev/null
    local now; now=$(curl -s "http://$2/metrics" | awk '/^fencegate_writes_total\{decision="admitted"/ {print $2}')
    [ "$(python3 -c "print(int(float('$now') - float('${before:-0}') >= $TOUCH))")" = 1 ] && break
  done
}

echo "populating $BIG keys..." >&2
./target/release/examples/populate "$WORK/big.redb" "$BIG" >&2
SIZE=$(du -m "$WORK/big.redb" | cut -f1)
read -r PID ADDR ADMIN READY < <(start "$WORK/big.redb")
RSS_START=$(rss_mib "$PID")
echo "| store with $BIG keys ($SIZE MiB file): start to ready | ${READY} ms |"
echo "| RSS right after start on it | $RSS_START MiB |"
touch_keys "$ADDR" "$ADMIN"
echo "| RSS after $TOUCH more distinct keys written through it (cache full) | $(rss_mib "$PID") MiB |"
kill "$PID"; wait "$PID" 2>/dev/null || true

read -r PID ADDR ADMIN READY < <(start "$WORK/small.redb")
touch_keys "$ADDR" "$ADMIN"
echo "| RSS with $TOUCH keys written through a fresh store | $(rss_mib "$PID") MiB |"

# 256 MiB upload, direct vs through fencegate.
head -c $((256 << 20)) /dev/urandom > "$WORK/upload.bin"
up() { curl -s -o /dev/null -w '%{speed_upload}' -X PUT -H 'X-Fence-Token: 5' -H 'Expect:' --data-binary @"$WORK/upload.bin" "$1"; }
D1=$(up "http://127.0.0.1:$UP/u"); F1=$(up "http://$ADDR/u"); D2=$(up "http://127.0.0.1:$UP/u"); F2=$(up "http://$ADDR/u")
python3 - "$D1" "$D2" "$F1" "$F2" <<'PY'
import sys, statistics
d = statistics.mean(map(float, sys.argv[1:3])); f = statistics.mean(map(float, sys.argv[3:5]))
print(f"| 256 MiB upload, direct | {d/2**20:.0f} MiB/s |")
print(f"| 256 MiB upload, through fencegate | {f/2**20:.0f} MiB/s ({f/d:.2f}x direct) |")
PY
echo "| fencegate peak RSS (VmHWM) over the whole run on the fresh store | $(hwm_mib "$PID") MiB |"
echo
NOFILE=$(ulimit -n)
BUDGET=$(( (NOFILE - 64) / 6 ))
connection_rows $(( BUDGET < 15000 ? BUDGET - 100 : 15000 ))
echo
echo "machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%d)"

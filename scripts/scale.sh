#!/usr/bin/env bash
# Memory and scale, one run:
#  1. a store with 10M keys: time from start to ready, RSS after start;
#  2. 1M distinct keys written through fencegate (the highest-token cache
#     full at its default 1M entries): RSS;
#  3. 10M keys touched is bounded by the same cache: RSS after 1M more
#     distinct keys on the 10M store;
#  4. a 256 MiB upload through fencegate vs direct (nginx discarding the
#     body): throughput ratio and fencegate's peak RSS.
# Usage: scripts/scale.sh [KEYS_BIG] [KEYS_TOUCHED]   (needs wrk, nginx, curl)
set -euo pipefail
cd "$(dirname "$0")/.."
BIG=${1:-10000000}
TOUCH=${2:-1000000}
for t in wrk nginx curl python3; do command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }; done
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
echo "machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%d)"

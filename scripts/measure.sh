#!/usr/bin/env bash
# Side-by-side measurement, one run: small PUTs (1 KiB body, 64 connections)
#   direct   -> nginx answering 200 itself (the upstream)
#   steady   -> through fencegate, one key, the same token every time
#   new-key  -> through fencegate, a new key per request (a durable advance each)
# plus the disk's fsync rate. wrk and nginx run pinned to CPU 0, fencegate to
# CPU 1 (taskset). Rounds alternate; medians are printed.
#
# Usage: scripts/measure.sh [ROUNDS] [SECONDS]   (needs wrk, nginx, taskset)
# It installs nothing: it says what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-8}
missing=()
for t in wrk nginx taskset python3; do command -v "$t" >/dev/null || missing+=("$t"); done
if ((${#missing[@]})); then
  echo "missing: ${missing[*]} (Debian: apt-get install wrk nginx util-linux)" >&2
  exit 1
fi
cargo build --release --quiet
BIN=target/release/fencegate
WORK=$(mktemp -d "$PWD/target/measure.XXXXXX")
cleanup() { kill $(jobs -p) 2>/dev/null || true; [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
NGINX_PORT=$(free_port)
cat > "$WORK/nginx.conf" <<CONF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $WORK/body;
  proxy_temp_path $WORK/proxy; fastcgi_temp_path $WORK/fcgi; uwsgi_temp_path $WORK/uwsgi; scgi_temp_path $WORK/scgi;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:$NGINX_PORT; location / { return 200 "ok\n"; } }
}
CONF
taskset -c 0 nginx -c "$WORK/nginx.conf" -p "$WORK"

taskset -c 1 "$BIN" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
  --upstream "http://127.0.0.1:$NGINX_PORT" --store "$WORK/fences.redb" > "$WORK/fg.out" 2> "$WORK/fg.err" &
for _ in $(seq 100); do grep -q listening "$WORK/fg.out" 2>/dev/null && break; sleep 0.1; done
PROXY=$(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' "$WORK/fg.out")
ADMIN=$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$WORK/fg.out")

cat > "$WORK/steady.lua" <<'LUA'
wrk.method = "PUT"
wrk.body = string.rep("x", 1024)
wrk.headers["X-Fence-Token"] = "1"
LUA
cat > "$WORK/newkey.lua" <<'LUA'
local n = 0
local body = string.rep("x", 1024)
local round = os.time()
request = function()
  n = n + 1
  return wrk.format("PUT", "/new/" .. round .. "/" .. math.random(1, 1e9) .. "/" .. n,
    { ["X-Fence-Token"] = "1" }, body)
end
LUA

# One wrk run; prints "rps p50_ms p99_ms".
run() {
  local url=$1 script=$2
  taskset -c 0 wrk -t1 -c64 -d"${SECS}s" --latency -s "$script" "$url" > "$WORK/wrk.txt"
  local rps p50 p99
  rps=$(awk '/Requests\/sec/ {print $2}' "$WORK/wrk.txt")
  p50=$(awk '$1=="50%" {print $2}' "$WORK/wrk.txt")
  p99=$(awk '$1=="99%" {print $2}' "$WORK/wrk.txt")
  if grep -q "Non-2xx" "$WORK/wrk.txt"; then echo "non-2xx answers in $url" >&2; cat "$WORK/wrk.txt" >&2; exit 1; fi
  echo "$rps $(to_ms "$p50") $(to_ms "$p99")"
}
to_ms() { python3 -c 'import sys,re; v=sys.argv[1]; m=re.match(r"([\d.]+)(us|ms|s)",v); x=float(m.group(1)); print({"us":x/1000,"ms":x,"s":x*1000}[m.group(2)])' "$1"; }

# fencegate CPU seconds (user+sys) so far, from /proc.
FG_PID=$(pgrep -f "$WORK/fences.redb" | head -1)
cpu() { awk '{print ($14+$15)/100}' "/proc/$FG_PID/stat"; }

declare -A RES
for r in $(seq "$ROUNDS"); do
  for sys in direct steady newkey; do
    case $sys in
      direct) url="http://127.0.0.1:$NGINX_PORT/steady"; script="$WORK/steady.lua";;
      steady) url="http://$PROXY/steady"; script="$WORK/steady.lua";;
      newkey) url="http://$PROXY/"; script="$WORK/newkey.lua";;
    esac
    c0=$(cpu)
    out=$(run "$url" "$script")
    c1=$(cpu)
    rps=${out%% *}
    cpu_us=$(python3 -c "print(round(($c1-$c0)*1e6/($rps*$SECS),1))")
    RES[$sys]+="$out $cpu_us;"
    echo "round $r $sys: rps p50ms p99ms fencegate-cpu-us/req = $out $cpu_us" >&2
  done
done
FSYNC=$(python3 scripts/fsync_rate.py "$WORK" 3)

median() { python3 -c 'import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }
col() { echo "${RES[$1]}" | tr ';' '\n' | awk -v c="$2" 'NF {print $c}'; }
echo
echo "machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%d); rounds=$ROUNDS x ${SECS}s; wrk -t1 -c64, 1 KiB PUT"
echo
echo "| system | req/s | p50 ms | p99 ms | fencegate CPU us/req | vs direct |"
echo "|---|---|---|---|---|---|"
D=$(median $(col direct 1))
for sys in direct steady newkey; do
  rps=$(median $(col $sys 1)); p50=$(median $(col $sys 2)); p99=$(median $(col $sys 3)); c=$(median $(col $sys 4))
  [ "$sys" = direct ] && c="-"
  echo "| $sys | $rps | $p50 | $p99 | $c | $(python3 -c "print(f'{$rps/$D:.2f}x')") |"
done
NK=$(median $(col newkey 1))
echo
echo "disk fsync rate (write+fsync of 4 KiB, same directory): $FSYNC /s"
echo "new-key durable advances per fsync: $(python3 -c "print(f'{$NK/$FSYNC:.1f}x')")"
curl -s "http://$ADMIN/metrics" 2>/dev/null | grep -E '^fencegate_store_latency_seconds_(sum|count)\{op="advance"\}' || true

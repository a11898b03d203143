#!/usr/bin/env bash
# Side-by-side comparison, one run, same machine: small PUTs (1 KiB body,
# 64 connections, wrk) sent
#   direct      to a fast upstream (nginx answering 200 itself)
#   nginx       through nginx as a plain reverse proxy (1 worker)
#   haproxy     through HAProxy (1 thread)
#   steady      through fencegate, one key, the same token every time
#   newkey      through fencegate, a new key per request (a durable advance)
#   steady-redis, newkey-redis, newkey-postgres   the same on shared stores
#   nginx-tls   nginx terminating TLS (HTTP/1.1, keep-alive) in front of
#               the upstream
#   steady-tls  fencegate's TLS listener, steady token (same certificate)
# wrk and the upstream are pinned to CPU 0, each proxy (and store server) to
# CPU 1. Rounds alternate between systems; medians are reported, with
# ratios, the proxy's CPU per request, and the disk's fsync rate.
#
# Usage: scripts/compare.sh [ROUNDS] [SECONDS]
# With BASELINE_BIN=path/to/an/older/fencegate, two more rows (steady-base,
# newkey-base) run that binary in the same rounds: what a change costs on
# the request path, measured in one run.
# Needs: wrk nginx haproxy taskset python3 curl, and for the shared-store
# rows redis-server and postgresql (as root: PostgreSQL runs via runuser).
# It installs nothing: it says what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-8}
missing=()
for t in wrk nginx haproxy taskset python3 curl redis-server runuser openssl; do command -v "$t" >/dev/null || missing+=("$t"); done
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | tail -1)
[ -n "$PGBIN" ] && [ -x "$PGBIN/initdb" ] || missing+=(postgresql)
if ((${#missing[@]})); then
  echo "missing: ${missing[*]} (Debian: apt-get install wrk nginx haproxy util-linux curl redis-server postgresql openssl)" >&2
  exit 1
fi
cargo build --release --quiet
BIN=$PWD/target/release/fencegate
WORK=$(mktemp -d "$PWD/target/compare.XXXXXX")
chmod 755 "$WORK"
PIDS=()
# Children first: nginx's workers do not name $WORK on their command line.
cleanup() { exec 2>/dev/null; for p in "${PIDS[@]}"; do pkill -9 -P "$p" || true; kill -9 "$p" || true; done; pkill -9 -f "$WORK" || true; rm -rf "$WORK"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }
nginx_conf() { # name port body
  mkdir -p "$WORK/$1"
  cat > "$WORK/$1/conf" <<CONF
worker_processes 1; pid $WORK/$1/pid; error_log $WORK/$1/err;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $WORK/$1/b; proxy_temp_path $WORK/$1/p;
  keepalive_requests 1000000; client_max_body_size 0;
  upstream backend { server 127.0.0.1:$UP_PORT; keepalive 64; }
  server { listen 127.0.0.1:$2; $3 } }
CONF
}

UP_PORT=$(port)
nginx_conf upstream "$UP_PORT" 'location / { return 200 "ok\n"; }'
taskset -c 0 nginx -c "$WORK/upstream/conf" -p "$WORK/upstream"; PIDS+=("$(cat "$WORK/upstream/pid")")

NGINX_PORT=$(port)
nginx_conf proxy "$NGINX_PORT" 'location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_request_buffering off; }'
taskset -c 1 nginx -c "$WORK/proxy/conf" -p "$WORK/proxy"; NGINX_PID=$(cat "$WORK/proxy/pid"); PIDS+=("$NGINX_PID")
NGINX_WORKER=$(pgrep -P "$NGINX_PID" | head -1)

# One self-signed ECDSA P-256 certificate for both TLS terminators.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 \
  -keyout "$WORK/tls.key" -out "$WORK/tls.crt" 2>/dev/null
NGINX_TLS_PORT=$(port)
nginx_conf tls "$NGINX_TLS_PORT" "ssl_certificate $WORK/tls.crt; ssl_certificate_key $WORK/tls.key; location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_request_buffering off; }"
sed -i "s/listen 127.0.0.1:$NGINX_TLS_PORT;/listen 127.0.0.1:$NGINX_TLS_PORT ssl;/" "$WORK/tls/conf"
taskset -c 1 nginx -c "$WORK/tls/conf" -p "$WORK/tls"; NGINX_TLS_PID=$(cat "$WORK/tls/pid"); PIDS+=("$NGINX_TLS_PID")
NGINX_TLS_WORKER=$(pgrep -P "$NGINX_TLS_PID" | head -1)

HAPROXY_PORT=$(port)
cat > "$WORK/haproxy.cfg" <<CONF
global
  nbthread 1
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  option http-keep-alive
frontend fe
  bind 127.0.0.1:$HAPROXY_PORT
  default_backend be
backend be
  http-reuse always
  server up 127.0.0.1:$UP_PORT
CONF
taskset -c 1 haproxy -f "$WORK/haproxy.cfg" -D -p "$WORK/haproxy.pid"; HAPROXY_PID=$(cat "$WORK/haproxy.pid"); PIDS+=("$HAPROXY_PID")

REDIS_PORT=$(port)
taskset -c 1 redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync always --dir "$WORK" >/dev/null &
PIDS+=($!)
PG_PORT=$(port)
mkdir -p "$WORK/pg"; chown -R postgres "$WORK/pg"; chmod 777 "$WORK"
runuser -u postgres -- "$PGBIN/initdb" -D "$WORK/pg" -A trust -U postgres >/dev/null
taskset -c 1 runuser -u postgres -- "$PGBIN/postgres" -D "$WORK/pg" -p "$PG_PORT" -c listen_addresses=127.0.0.1 -k "$WORK/pg" >/dev/null 2>&1 &
PIDS+=($!)
for p in $UP_PORT $NGINX_PORT $HAPROXY_PORT $REDIS_PORT $PG_PORT; do wait_port "$p"; done

start_fencegate() { # name store [extra flags...]
  local name=$1 store=$2; shift 2
  taskset -c 1 "${FG_BIN:-$BIN}" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    --upstream "http://127.0.0.1:$UP_PORT" --store "$store" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err" &
  local pid=$!; PIDS+=("$pid")
  for _ in $(seq 100); do grep -q listening "$WORK/$name.out" 2>/dev/null && break; sleep 0.1; done
  echo "$pid $(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' "$WORK/$name.out") $(sed -n 's/.*tls=\([^ ]*\).*/\1/p' "$WORK/$name.out")"
}
read -r FG_PID FG_ADDR FG_TLS < <(start_fencegate embedded "$WORK/fences.redb" \
  --tls-listen 127.0.0.1:0 --tls-cert "$WORK/tls.crt" --tls-key "$WORK/tls.key")
# A new shared store is marked once before replicas use it (docs/stores.md).
init_store() { for _ in $(seq 100); do "$BIN" init-store --store "$1" >/dev/null 2>&1 && return; sleep 0.2; done; echo "fencegate init-store $1 failed" >&2; exit 1; }
init_store "redis://127.0.0.1:$REDIS_PORT/0"
init_store "postgres://postgres@127.0.0.1:$PG_PORT/postgres"
read -r FGR_PID FGR_ADDR < <(start_fencegate redis "redis://127.0.0.1:$REDIS_PORT/0")
read -r FGP_PID FGP_ADDR < <(start_fencegate postgres "postgres://postgres@127.0.0.1:$PG_PORT/postgres")
# start_fencegate runs in a subshell here: its PIDS+= never reached us.
PIDS+=("$FG_PID" "$FGR_PID" "$FGP_PID")
if [ -n "${BASELINE_BIN:-}" ]; then
  read -r FGB_PID FGB_ADDR < <(FG_BIN=$BASELINE_BIN start_fencegate baseline "$WORK/baseline.redb")
  PIDS+=("$FGB_PID")
fi
sleep 1

cat > "$WORK/steady.lua" <<'LUA'
wrk.method = "PUT"
wrk.body = string.rep("x", 1024)
wrk.headers["X-Fence-Token"] = "1"
LUA
# Each run's URL path is a prefix of its own (round and system): wrk's Lua
# random numbers repeat from run to run, and a key seen in an earlier round
# is not a new key (an equal token on a known key writes nothing).
cat > "$WORK/newkey.lua" <<'LUA'
local n = 0
local body = string.rep("x", 1024)
request = function()
  n = n + 1
  return wrk.format("PUT", wrk.path .. n, { ["X-Fence-Token"] = "1" }, body)
end
LUA

cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat"; }
to_ms() { python3 -c 'import sys,re; v=sys.argv[1]; m=re.match(r"([\d.]+)(us|ms|s)$",v); x=float(m.group(1)); print({"us":x/1000,"ms":x,"s":x*1000}[m.group(2)])' "$1"; }

SYSTEMS=(direct nginx haproxy steady newkey steady-redis newkey-redis newkey-postgres nginx-tls steady-tls)
[ -n "${BASELINE_BIN:-}" ] && SYSTEMS+=(steady-base newkey-base)
declare -A RES
for r in $(seq "$ROUNDS"); do
  for sys in "${SYSTEMS[@]}"; do
    case $sys in
      direct) url="http://127.0.0.1:$UP_PORT/k"; script=steady; pid="";;
      nginx) url="http://127.0.0.1:$NGINX_PORT/k"; script=steady; pid=$NGINX_WORKER;;
      haproxy) url="http://127.0.0.1:$HAPROXY_PORT/k"; script=steady; pid=$HAPROXY_PID;;
      steady) url="http://$FG_ADDR/k"; script=steady; pid=$FG_PID;;
      newkey) url="http://$FG_ADDR/new/$r-$sys/"; script=newkey; pid=$FG_PID;;
      steady-redis) url="http://$FGR_ADDR/k"; script=steady; pid=$FGR_PID;;
      newkey-redis) url="http://$FGR_ADDR/new/$r-$sys/"; script=newkey; pid=$FGR_PID;;
      newkey-postgres) url="http://$FGP_ADDR/new/$r-$sys/"; script=newkey; pid=$FGP_PID;;
      nginx-tls) url="https://127.0.0.1:$NGINX_TLS_PORT/k"; script=steady; pid=$NGINX_TLS_WORKER;;
      steady-tls) url="https://$FG_TLS/k"; script=steady; pid=$FG_PID;;
      steady-base) url="http://$FGB_ADDR/k"; script=steady; pid=$FGB_PID;;
      newkey-base) url="http://$FGB_ADDR/new/$r-$sys/"; script=newkey; pid=$FGB_PID;;
    esac
    c0=0; [ -n "$pid" ] && c0=$(cpu "$pid")
    taskset -c 0 wrk -t1 -c64 -d"${SECS}s" --latency -s "$WORK/$script.lua" "$url" > "$WORK/wrk.txt"
    c1=0; [ -n "$pid" ] && c1=$(cpu "$pid")
    if grep -q "Non-2xx" "$WORK/wrk.txt"; then echo "non-2xx answers from $sys" >&2; cat "$WORK/wrk.txt" >&2; exit 1; fi
    rps=$(awk '/Requests\/sec/ {print $2}' "$WORK/wrk.txt")
    p50=$(to_ms "$(awk '$1=="50%" {print $2}' "$WORK/wrk.txt")")
    p99=$(to_ms "$(awk '$1=="99%" {print $2}' "$WORK/wrk.txt")")
    cpu_us=$(python3 -c "print(round(($c1-$c0)*1e6/($rps*$SECS),1))")
    RES[$sys]+="$rps $p50 $p99 $cpu_us;"
    echo "round $r $sys: req/s=$rps p50=${p50}ms p99=${p99}ms cpu/req=${cpu_us}us" >&2
  done
done
FSYNC=$(python3 scripts/fsync_rate.py "$WORK" 3)

median() { python3 -c 'import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }
col() { echo "${RES[$1]}" | tr ';' '\n' | awk -v c="$2" 'NF {print $c}'; }
BEST=$(python3 -c "print(max($(median $(col nginx 1)), $(median $(col haproxy 1))))")
echo
echo "machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%d); $ROUNDS alternating rounds x ${SECS}s, medians; wrk -t1 -c64, 1 KiB PUT; wrk+upstream on CPU 0, proxy (and store) on CPU 1"
echo
echo "| system | req/s | p50 ms | p99 ms | proxy CPU us/req | vs direct | vs best plain proxy |"
echo "|---|---|---|---|---|---|---|"
D=$(median $(col direct 1))
for sys in "${SYSTEMS[@]}"; do
  rps=$(median $(col "$sys" 1)); p50=$(median $(col "$sys" 2)); p99=$(median $(col "$sys" 3)); c=$(median $(col "$sys" 4))
  [ "$sys" = direct ] && c="-"
  printf '| %s | %.0f | %s | %s | %s | %.2fx | %.2fx |\n' "$sys" "$rps" "$p50" "$p99" "$c" "$(python3 -c "print($rps/$D)")" "$(python3 -c "print($rps/$BEST)")"
done
NK=$(median $(col newkey 1)); STR=$(median $(col steady-redis 1)); ST=$(median $(col steady 1))
echo
echo "disk fsync rate (4 KiB write+fsync, same filesystem): $FSYNC/s"
echo "new-key durable advances per disk fsync: $(python3 -c "print(f'{$NK/$FSYNC:.2f}x')")"
echo "redis steady vs embedded steady: $(python3 -c "print(f'{$STR/$ST:.2f}x')")"
NT=$(median $(col nginx-tls 1)); FT=$(median $(col steady-tls 1))
echo "fencegate over TLS vs its plain listener: $(python3 -c "print(f'{$FT/$ST:.2f}x')"); vs nginx terminating TLS: $(python3 -c "print(f'{$FT/$NT:.2f}x')")"
if [ -n "${BASELINE_BIN:-}" ]; then
  SB=$(median $(col steady-base 1)); NB=$(median $(col newkey-base 1))
  echo "this build vs the baseline binary: steady $(python3 -c "print(f'{$ST/$SB:.2f}x')") (CPU/req $(median $(col steady 4)) vs $(median $(col steady-base 4)) us), new key $(python3 -c "print(f'{$NK/$NB:.2f}x')") (CPU/req $(median $(col newkey 4)) vs $(median $(col newkey-base 4)) us)"
fi

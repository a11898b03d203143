#!/usr/bin/env bash
# Side-by-side comparison, one run, same machine: small PUTs (1 KiB body,
# 64 connections, wrk) sent
#   direct      to a fast upstream (nginx answering 200 itself)
#   nginx       through nginx as a plain reverse proxy (1 worker)
#   haproxy     through HAProxy (1 thread)
#   steady      through fencegate, one key, the same token every time
#   newkey      through fencegate, a new key per request (a durable advance)
#   steady-redis, newkey-redis, steady-postgres, newkey-postgres,
#   steady-etcd, newkey-etcd   the same on shared stores
#   steady-redis-replica, newkey-redis-replica   on a second Redis with a
#               replica attached: every call waits for it (WAIT 1), what
#               a failover that loses nothing costs
#   steady-redis-cluster, newkey-redis-cluster   on a Redis Cluster of three
#               primaries (no replicas: beside the lone Redis), all on the
#               store's core
#   nginx-tls   nginx terminating TLS (HTTP/1.1, keep-alive) in front of
#               the upstream
#   steady-tls  fencegate's TLS listener, steady token (same certificate)
#   nginx-h2c, steady-h2c, nginx-h2, steady-h2   HTTP/2 (cleartext with
#               prior knowledge, and over TLS) with h2load: nginx's HTTP/2
#               and fencegate's, both relaying HTTP/1.1 upstream
# then 256 MiB uploads and downloads with curl, direct and through
# fencegate, with fencegate's RSS before and its peak after.
# The client and the upstream are pinned to CPU 0, each proxy (and store
# server) to CPU 1. Rounds alternate between systems; medians are reported,
# with ratios, the proxy's CPU per request, and the disk's fsync rate.
# The report goes to $OUT (default target/compare): results.md, the tables
# docs/benchmarks.md shows, and chart.svg (req/s and CPU per request).
#
# Usage: [ONLY="row row..."] scripts/compare.sh [ROUNDS] [SECONDS]
# With BASELINE_BIN=path/to/an/older/fencegate, two more rows (steady-base,
# newkey-base) run that binary in the same rounds: what a change costs on
# the request path, measured in one run; and when newkey-redis runs, a
# third (newkey-redis-base: that binary on the same Redis), for a change to
# the Redis store.
# Needs: wrk h2load nginx haproxy taskset python3 curl, and for the shared-store
# rows redis-server, postgresql (as root: PostgreSQL runs via runuser) and etcd.
# It installs nothing: it says what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-8}
missing=()
for t in wrk h2load nginx haproxy taskset python3 curl redis-server redis-cli runuser openssl etcd; do command -v "$t" >/dev/null || missing+=("$t"); done
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | tail -1)
[ -n "$PGBIN" ] && [ -x "$PGBIN/initdb" ] || missing+=(postgresql)
if ((${#missing[@]})); then
  echo "missing: ${missing[*]} (Debian: apt-get install wrk nghttp2-client nginx haproxy util-linux curl redis-server postgresql openssl etcd-server)" >&2
  exit 1
fi
cargo build --release --quiet
BIN=$PWD/target/release/fencegate
WORK=$(mktemp -d "$PWD/target/compare.XXXXXX")
chmod 755 "$WORK"
PIDS=()
# Children first: nginx's workers do not name $WORK on their command line.
# The parent is stopped before: a live nginx master replaces a killed
# worker at once. An nginx master writes its pid file after the command that started it
# returned, so PIDS may have missed one: every pid file is read again here,
# or its worker would be left running (and skew later measurements).
cleanup() {
  exec 2>/dev/null
  for f in "$WORK"/*/pid; do [[ -s $f ]] && PIDS+=("$(cat "$f")"); done
  for p in "${PIDS[@]}"; do kill -STOP "$p" || true; pkill -9 -P "$p" || true; kill -9 "$p" || true; done
  pkill -9 -f "$WORK" || true
  rm -rf "$WORK"
}
trap cleanup EXIT
. scripts/bench_lib.sh
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
# /big: a 256 MiB file for the download rows; a PUT to it is read and
# discarded (the upload rows).
mkdir -p "$WORK/files"
nginx_conf upstream "$UP_PORT" "root $WORK/files; location / { return 200 \"ok\\n\"; } location /big { error_page 405 = @put; } location @put { return 200 \"ok\\n\"; }"
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
# nginx's HTTP/2, cleartext with prior knowledge (h2c) and over TLS.
NGINX_H2C_PORT=$(port)
nginx_conf h2c "$NGINX_H2C_PORT" 'location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_request_buffering off; }'
sed -i "s/listen 127.0.0.1:$NGINX_H2C_PORT;/listen 127.0.0.1:$NGINX_H2C_PORT http2;/" "$WORK/h2c/conf"
taskset -c 1 nginx -c "$WORK/h2c/conf" -p "$WORK/h2c"; NGINX_H2C_PID=$(cat "$WORK/h2c/pid"); PIDS+=("$NGINX_H2C_PID")
NGINX_H2C_WORKER=$(pgrep -P "$NGINX_H2C_PID" | head -1)
NGINX_H2_PORT=$(port)
nginx_conf h2 "$NGINX_H2_PORT" "ssl_certificate $WORK/tls.crt; ssl_certificate_key $WORK/tls.key; location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_request_buffering off; }"
sed -i "s/listen 127.0.0.1:$NGINX_H2_PORT;/listen 127.0.0.1:$NGINX_H2_PORT ssl http2;/" "$WORK/h2/conf"
taskset -c 1 nginx -c "$WORK/h2/conf" -p "$WORK/h2"; NGINX_H2_PID=$(cat "$WORK/h2/pid"); PIDS+=("$NGINX_H2_PID")
NGINX_H2_WORKER=$(pgrep -P "$NGINX_H2_PID" | head -1)

HAPROXY_PORT=$(port)
write_haproxy_cfg "$WORK/haproxy.cfg" "$HAPROXY_PORT" "$UP_PORT"
taskset -c 1 haproxy -f "$WORK/haproxy.cfg" -D -p "$WORK/haproxy.pid"; HAPROXY_PID=$(cat "$WORK/haproxy.pid"); PIDS+=("$HAPROXY_PID")

REDIS_PORT=$(port)
taskset -c 1 redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync always --dir "$WORK" >/dev/null &
REDIS_PID=$!; PIDS+=($!)
# A second Redis with a replica (both on the store's core): fencegate waits
# for the replica after each call.
REDIS2_PORT=$(port); REDIS2_REPLICA_PORT=$(port)
mkdir -p "$WORK/redis2" "$WORK/redis2-replica"
taskset -c 1 redis-server --port "$REDIS2_PORT" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync always --repl-diskless-sync-delay 0 --dir "$WORK/redis2" >/dev/null &
REDIS2_PID=$!; PIDS+=($!)
taskset -c 1 redis-server --port "$REDIS2_REPLICA_PORT" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync always --replicaof 127.0.0.1 "$REDIS2_PORT" --dir "$WORK/redis2-replica" >/dev/null &
PIDS+=($!)
# A Redis Cluster of three primaries, on the store's core too.
RC_PORTS=(); RC_PIDS=()
for i in 1 2 3; do
  p=$(port); mkdir -p "$WORK/rc$i"
  taskset -c 1 redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync always \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-port "$(port)" --dir "$WORK/rc$i" >/dev/null &
  RC_PIDS+=($!); PIDS+=($!); RC_PORTS+=("$p")
done
PG_PORT=$(port)
mkdir -p "$WORK/pg"; chown -R postgres "$WORK/pg"; chmod 777 "$WORK"
runuser -u postgres -- "$PGBIN/initdb" -D "$WORK/pg" -A trust -U postgres >/dev/null
taskset -c 1 runuser -u postgres -- "$PGBIN/postgres" -D "$WORK/pg" -p "$PG_PORT" -c listen_addresses=127.0.0.1 -k "$WORK/pg" >/dev/null 2>&1 &
PG_PID=$!; PIDS+=($!)
ETCD_PORT=$(port); ETCD_PEER=$(port)
taskset -c 1 etcd --name compare --data-dir "$WORK/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
  --initial-cluster "compare=http://127.0.0.1:$ETCD_PEER" >/dev/null 2>&1 &
ETCD_PID=$!; PIDS+=($!)
for p in $UP_PORT $NGINX_PORT $HAPROXY_PORT $REDIS_PORT $REDIS2_PORT $REDIS2_REPLICA_PORT $PG_PORT $ETCD_PORT "${RC_PORTS[@]}"; do wait_port "$p"; done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${RC_PORTS[@]}") --cluster-replicas 0 --cluster-yes >/dev/null
for _ in $(seq 100); do
  redis-cli -p "${RC_PORTS[0]}" cluster info 2>/dev/null | grep -q 'cluster_state:ok' && break; sleep 0.1
done
redis-cli -p "${RC_PORTS[0]}" cluster info | grep -q 'cluster_state:ok' || { echo "the Redis Cluster never became ok" >&2; exit 1; }
for _ in $(seq 100); do
  redis-cli -p "$REDIS2_PORT" info replication 2>/dev/null | grep -q 'state=online' && break; sleep 0.1
done
redis-cli -p "$REDIS2_PORT" info replication | grep -q 'state=online' || { echo "the Redis replica never came online" >&2; exit 1; }

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
init_store "redis://127.0.0.1:$REDIS2_PORT/0"
read -r FGRR_PID FGRR_ADDR < <(start_fencegate redis-replica "redis://127.0.0.1:$REDIS2_PORT/0" --store-replicas-to-wait 1)
read -r FGP_PID FGP_ADDR < <(start_fencegate postgres "postgres://postgres@127.0.0.1:$PG_PORT/postgres")
RC_URL="redis+cluster://127.0.0.1:${RC_PORTS[0]},127.0.0.1:${RC_PORTS[1]}"
init_store "$RC_URL"
read -r FGC_PID FGC_ADDR < <(start_fencegate redis-cluster "$RC_URL")
init_store "etcd://127.0.0.1:$ETCD_PORT"
read -r FGE_PID FGE_ADDR < <(start_fencegate etcd "etcd://127.0.0.1:$ETCD_PORT")
# start_fencegate runs in a subshell here: its PIDS+= never reached us.
PIDS+=("$FG_PID" "$FGR_PID" "$FGRR_PID" "$FGC_PID" "$FGP_PID" "$FGE_PID")
if [ -n "${BASELINE_BIN:-}" ]; then
  read -r FGB_PID FGB_ADDR < <(FG_BIN=$BASELINE_BIN start_fencegate baseline "$WORK/baseline.redb")
  read -r FGRB_PID FGRB_ADDR < <(FG_BIN=$BASELINE_BIN start_fencegate redis-baseline "redis://127.0.0.1:$REDIS_PORT/0")
  PIDS+=("$FGB_PID" "$FGRB_PID")
fi
sleep 1

# Each run's URL path is a prefix of its own (round and system): see
# write_wrk_scripts.
write_wrk_scripts "$WORK"

cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat"; }
# A store server's CPU seconds: the process and its descendants (PostgreSQL
# runs a process per connection), with the children they reaped.
treecpu() {
  awk -v root="$1" '{ppid[$1] = $4; t[$1] = ($14 + $15 + $16 + $17) / 100}
    END {total = 0; for (p in t) {q = p; while ((q in ppid) && q != root && q > 1) q = ppid[q]; if (q == root) total += t[p]}; print total}' \
    /proc/[0-9]*/stat 2>/dev/null
}
# Redis servers' counters summed over ports: commands, reads (a read
# carrying several commands: they were sent together) and script calls.
rstats() {
  local p
  for p in "$@"; do redis-cli -p "$p" info all; done | tr -d '\r' | awk -F'[:=,]' '
    $1 == "total_commands_processed" {c += $2}
    $1 == "total_reads_processed" {r += $2}
    $1 == "cmdstat_evalsha" {e += $3}
    END {print c + 0, r + 0, e + 0}'
}
# The store's CPU seconds over its servers (a cluster has several).
storecpu() { local t=0; for p in "$@"; do t=$(python3 -c "print($t + $(treecpu "$p"))"); done; echo "$t"; }
to_ms() { python3 -c 'import sys,re; v=sys.argv[1]; m=re.match(r"([\d.]+)(us|ms|s)$",v); x=float(m.group(1)); print({"us":x/1000,"ms":x,"s":x*1000}[m.group(2)])' "$1"; }

SYSTEMS=(direct nginx haproxy steady newkey steady-redis newkey-redis steady-redis-replica newkey-redis-replica steady-redis-cluster newkey-redis-cluster steady-postgres newkey-postgres steady-etcd newkey-etcd nginx-tls steady-tls nginx-h2c steady-h2c nginx-h2 steady-h2)
# ONLY="steady steady-redis ...": just these rows (a quick look; the docs
# quote full runs).
[ -n "${ONLY:-}" ] && read -r -a SYSTEMS <<< "$ONLY"
if [ -n "${BASELINE_BIN:-}" ]; then
  SYSTEMS+=(steady-base newkey-base)
  [[ " ${SYSTEMS[*]} " == *" newkey-redis "* ]] && SYSTEMS+=(newkey-redis-base)
fi
ROWS=$WORK/rows.tsv
: > "$ROWS"
head -c 1024 /dev/zero | tr '\0' x > "$WORK/body.bin"
# HTTP/2 rows: h2load, 8 connections x 8 streams (the same 64 requests in
# flight as wrk's 64 connections), 1 KiB POSTs with the token.
h2() { # url -> req/s
  taskset -c 0 h2load -t1 -c8 -m8 -D "$SECS" -d "$WORK/body.bin" -H 'x-fence-token: 1' "$1" > "$WORK/h2.txt" 2>&1 || { cat "$WORK/h2.txt" >&2; exit 1; }
  if ! grep -Eq 'status codes: [0-9]+ 2xx, 0 3xx, 0 4xx, 0 5xx' "$WORK/h2.txt"; then echo "non-2xx answers from $1" >&2; cat "$WORK/h2.txt" >&2; exit 1; fi
  awk '/^finished in/ {gsub(",", "", $4); print $4}' "$WORK/h2.txt"
}
for r in $(seq "$ROUNDS"); do
  for sys in "${SYSTEMS[@]}"; do
    tool=wrk
    case $sys in
      direct) url="http://127.0.0.1:$UP_PORT/k"; script=steady; pid="";;
      nginx) url="http://127.0.0.1:$NGINX_PORT/k"; script=steady; pid=$NGINX_WORKER;;
      haproxy) url="http://127.0.0.1:$HAPROXY_PORT/k"; script=steady; pid=$HAPROXY_PID;;
      steady) url="http://$FG_ADDR/k"; script=steady; pid=$FG_PID;;
      newkey) url="http://$FG_ADDR/new/$r-$sys/"; script=newkey; pid=$FG_PID;;
      steady-redis) url="http://$FGR_ADDR/k"; script=steady; pid=$FGR_PID;;
      newkey-redis) url="http://$FGR_ADDR/new/$r-$sys/"; script=newkey; pid=$FGR_PID;;
      steady-redis-replica) url="http://$FGRR_ADDR/k"; script=steady; pid=$FGRR_PID;;
      newkey-redis-replica) url="http://$FGRR_ADDR/new/$r-$sys/"; script=newkey; pid=$FGRR_PID;;
      steady-redis-cluster) url="http://$FGC_ADDR/k"; script=steady; pid=$FGC_PID;;
      newkey-redis-cluster) url="http://$FGC_ADDR/new/$r-$sys/"; script=newkey; pid=$FGC_PID;;
      steady-postgres) url="http://$FGP_ADDR/k"; script=steady; pid=$FGP_PID;;
      newkey-postgres) url="http://$FGP_ADDR/new/$r-$sys/"; script=newkey; pid=$FGP_PID;;
      steady-etcd) url="http://$FGE_ADDR/k"; script=steady; pid=$FGE_PID;;
      newkey-etcd) url="http://$FGE_ADDR/new/$r-$sys/"; script=newkey; pid=$FGE_PID;;
      nginx-tls) url="https://127.0.0.1:$NGINX_TLS_PORT/k"; script=steady; pid=$NGINX_TLS_WORKER;;
      steady-tls) url="https://$FG_TLS/k"; script=steady; pid=$FG_PID;;
      steady-base) url="http://$FGB_ADDR/k"; script=steady; pid=$FGB_PID;;
      newkey-base) url="http://$FGB_ADDR/new/$r-$sys/"; script=newkey; pid=$FGB_PID;;
      newkey-redis-base) url="http://$FGRB_ADDR/new/$r-$sys/"; script=newkey; pid=$FGRB_PID;;
      nginx-h2c) tool=h2; url="http://127.0.0.1:$NGINX_H2C_PORT/k"; pid=$NGINX_H2C_WORKER;;
      steady-h2c) tool=h2; url="http://$FG_ADDR/k"; pid=$FG_PID;;
      nginx-h2) tool=h2; url="https://127.0.0.1:$NGINX_H2_PORT/k"; pid=$NGINX_H2_WORKER;;
      steady-h2) tool=h2; url="https://$FG_TLS/k"; pid=$FG_PID;;
    esac
    c0=0; [ -n "$pid" ] && c0=$(cpu "$pid")
    # The store server's own CPU on the shared-store rows (it runs on the
    # proxy's core: what it spends per write is what the proxy cannot).
    case $sys in *-redis|*-redis-base) spid=$REDIS_PID;; *-redis-replica) spid=$REDIS2_PID;; *-redis-cluster) spid="${RC_PIDS[*]}";; *-postgres) spid=$PG_PID;; *-etcd) spid=$ETCD_PID;; *) spid="";; esac
    s0=0; [ -n "$spid" ] && s0=$(storecpu $spid)
    # How the writes reach Redis on the new-key rows: commands per read
    # (the client's pipelining) and writes per script call (its batches).
    case $sys in newkey-redis) rports="$REDIS_PORT";; newkey-redis-cluster) rports="${RC_PORTS[*]}";; *) rports="";; esac
    [ -n "$rports" ] && read -r w_c0 w_r0 w_e0 < <(rstats $rports)
    # And how many writes share each fsync of the servers' append-only
    # files (perf's syscall tracepoints; "-" without perf).
    perf_pid=""
    if [ -n "$rports" ] && command -v perf >/dev/null; then
      perf stat -x, -e syscalls:sys_enter_fdatasync,syscalls:sys_enter_fsync -p "$(echo $spid | tr ' ' ,)" -- sleep "$SECS" 2> "$WORK/perf.txt" &
      perf_pid=$!
    fi
    if [ $tool = wrk ]; then
      taskset -c 0 wrk -t1 -c64 -d"${SECS}s" --latency -s "$WORK/$script.lua" "$url" > "$WORK/wrk.txt"
      if grep -q "Non-2xx" "$WORK/wrk.txt"; then echo "non-2xx answers from $sys" >&2; cat "$WORK/wrk.txt" >&2; exit 1; fi
      rps=$(awk '/Requests\/sec/ {print $2}' "$WORK/wrk.txt")
      p50=$(to_ms "$(awk '$1=="50%" {print $2}' "$WORK/wrk.txt")")
      p99=$(to_ms "$(awk '$1=="99%" {print $2}' "$WORK/wrk.txt")")
    else
      rps=$(h2 "$url")
      # h2load reports no percentiles (and its mean disagrees with
      # Little's law at this concurrency): no latency for these rows.
      p50=-; p99=-
    fi
    c1=0; [ -n "$pid" ] && c1=$(cpu "$pid")
    cpu_us=$(python3 -c "print(round(($c1-$c0)*1e6/($rps*$SECS),1))")
    printf 'rps\t%s\t%s\t%s\t%s\t%s\t%s\n' "$sys" "$r" "$rps" "$p50" "$p99" "$cpu_us" >> "$ROWS"
    if [ -n "$rports" ]; then
      read -r w_c1 w_r1 w_e1 < <(rstats $rports)
      per_fsync=-
      if [ -n "$perf_pid" ] && wait "$perf_pid"; then
        fsyncs=$(awk -F, '$1 ~ /^[0-9]+$/ {n += $1} END {print n + 0}' "$WORK/perf.txt")
        per_fsync=$(python3 -c "print(round($rps*$SECS/max(1,$fsyncs),2))")
      fi
      printf 'wire\t%s\t%s\t%s\t%s\t-\t%s\n' "$sys" "$r" \
        "$(python3 -c "print(round(($w_c1-$w_c0)/max(1,$w_r1-$w_r0),2))")" "$per_fsync" \
        "$(python3 -c "print(round($rps*$SECS/max(1,$w_e1-$w_e0),2))")" >> "$ROWS"
    fi
    if [ -n "$spid" ]; then
      s1=$(storecpu $spid)
      printf 'store\t%s\t%s\t%s\t-\t-\t-\n' "$sys" "$r" "$(python3 -c "print(round(($s1-$s0)*1e6/($rps*$SECS),1))")" >> "$ROWS"
    fi
    echo "round $r $sys: req/s=$rps p50=${p50}ms p99=${p99}ms cpu/req=${cpu_us}us" >&2
  done
done

# 256 MiB transfers with curl, direct and through fencegate, alternating.
# Memory must stay flat: bodies stream, never buffer.
RSS_BEFORE=$(awk '/VmRSS/ {printf "%.0f", $2/1024}' "/proc/$FG_PID/status")
head -c $((256 << 20)) /dev/urandom > "$WORK/files/big"
chmod a+r "$WORK/files/big"
transfer() { # up|down url
  if [ "$1" = up ]; then
    taskset -c 0 curl -sf -o /dev/null -w '%{speed_upload}' -X PUT -H 'X-Fence-Token: 5' -H 'Expect:' --data-binary @"$WORK/files/big" "$2"
  else
    taskset -c 0 curl -sf -o /dev/null -w '%{speed_download}' "$2"
  fi
}
for r in $(seq "$ROUNDS"); do
  for t in up down; do
    for via in direct fencegate; do
      url="http://127.0.0.1:$UP_PORT/big"; pid=""
      [ $via = fencegate ] && url="http://$FG_ADDR/big" && pid=$FG_PID
      c0=0; [ -n "$pid" ] && c0=$(cpu "$pid")
      bps=$(transfer $t "$url")
      c1=0; [ -n "$pid" ] && c1=$(cpu "$pid")
      mibs=$(python3 -c "print(round($bps / 2**20, 1))")
      cpu_mib=-; [ -n "$pid" ] && cpu_mib=$(python3 -c "print(round(($c1-$c0)*1e6/256, 1))")
      name=$([ $t = up ] && echo upload || echo download)-$via
      printf 'mibs\t%s\t%s\t%s\t-\t-\t%s\n' "$name" "$r" "$mibs" "$cpu_mib" >> "$ROWS"
      echo "round $r $name: ${mibs} MiB/s" >&2
    done
  done
done
RSS_PEAK=$(awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$FG_PID/status")
FSYNC=$(python3 scripts/fsync_rate.py "$WORK" 3)

OUT=${OUT:-$PWD/target/compare}
mkdir -p "$OUT"
MACHINE="$(nproc) cores, $(uname -r), $(date -u '+%Y-%m-%d %H:%M') UTC; $ROUNDS alternating rounds x ${SECS}s; wrk -t1 -c64 (h2load -c8 -m8), 1 KiB bodies; client and upstream on CPU 0, proxy (and store) on CPU 1"
echo
python3 scripts/compare_report.py "$ROWS" "$OUT" "$MACHINE" "$FSYNC"
echo "- fencegate RSS before the transfers: ${RSS_BEFORE} MiB; peak (VmHWM) after them: ${RSS_PEAK} MiB" | tee -a "$OUT/results.md"
echo
echo "written: $OUT/results.md, $OUT/chart.svg"

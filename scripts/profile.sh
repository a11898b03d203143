#!/bin/bash
# Where a steady-token request spends its time: system calls per request
# (perf stat tracepoints), user and system CPU per request (/proc), for
# HAProxy and for each fencegate binary given, under wrk (1 KiB PUTs, 64
# connections). REC=1 also records a 1 s perf profile with call graphs of
# each process into /tmp/perf.NAME.data (perf report -i ...);
# FREQ (Hz, default 2000) and REC_SECS (default 1, at most 3) set its size. TLS=1
# measures nginx terminating TLS instead of HAProxy, and fencegate's TLS
# listener (same self-signed ECDSA P-256 certificate, keep-alive: the
# handshakes are amortised, what is measured is the records).
# Same layout as compare.sh; needs perf (Debian linux-perf), wrk, nginx, haproxy.
#
# Usage: scripts/profile.sh BIN...
set -u
. "$(dirname "$0")/bench_lib.sh"
bench_init
UP=$(port)
PIDS+=("$(start_nginx_upstream $W/up $UP)")
HP=$(port)
write_haproxy_cfg $W/h.cfg $HP $UP
taskset -c 1 haproxy -f $W/h.cfg -D -p $W/h.pid; sleep 0.3; PIDS+=("$(cat $W/h.pid)")
write_wrk_scripts $W
EV=page-faults,raw_syscalls:sys_enter,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_read,syscalls:sys_enter_write,syscalls:sys_enter_recvfrom,syscalls:sys_enter_sendto,syscalls:sys_enter_writev,syscalls:sys_enter_futex,context-switches
run() { # name pid url
  local c0=$(awk '{print $14+$15}' /proc/$2/stat); local u0=$(awk '{print $14}' /proc/$2/stat)
  taskset -c 0 wrk -t1 -c64 -d8s -s $W/steady.lua "$3" > $W/wrk.txt &
  local wp=$!
  sleep 1; perf stat -x, -e $EV -p $2 -- sleep 4 2> $W/perf.txt
  [ -n "${REC:-}" ] && perf record -q --call-graph dwarf,8192 -F ${FREQ:-2000} -o /tmp/perf.$1.data -p $2 -- sleep ${REC_SECS:-1} >/dev/null 2>&1
  wait $wp
  local c1=$(awk '{print $14+$15}' /proc/$2/stat); local u1=$(awk '{print $14}' /proc/$2/stat)
  local rps=$(awk '/Requests\/sec/ {print $2}' $W/wrk.txt)
  python3 - "$1" "$rps" $W/perf.txt $((c1-c0)) $((u1-u0)) <<'P'
import sys
name, rps, f, ticks = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
reqs = rps*4
ut=int(sys.argv[5])
out = [f"{name}: {rps:.0f} req/s, cpu {ticks*10000/(rps*6):.1f} us/req, user {ut*10000/(rps*6):.1f} sys {(ticks-ut)*10000/(rps*6):.1f}"]
for line in open(f):
    p = line.strip().split(",")
    if len(p) > 3 and p[0].replace('.','').isdigit():
        out.append(f"  {p[2].split(':')[-1]:<24} {float(p[0])/reqs:6.2f}/req")
print("\n".join(out))
P
}
FLAGS=()
if [ -n "${TLS:-}" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 -keyout $W/tls.key -out $W/tls.crt 2>/dev/null
  NP=$(port); mkdir -p $W/nt
  cat > $W/nt/conf <<CONF
worker_processes 1; pid $W/nt/pid; error_log $W/nt/err;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $W/nt/b; proxy_temp_path $W/nt/p; keepalive_requests 1000000;
  upstream backend { server 127.0.0.1:$UP; keepalive 64; }
  server { listen 127.0.0.1:$NP ssl; ssl_certificate $W/tls.crt; ssl_certificate_key $W/tls.key;
    location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_request_buffering off; } } }
CONF
  taskset -c 1 nginx -c $W/nt/conf -p $W/nt; sleep 0.3; PIDS+=("$(cat $W/nt/pid)")
  run nginx-tls "$(pgrep -P "$(cat $W/nt/pid)" | head -1)" "https://127.0.0.1:$NP/k"
  FLAGS=(--tls-listen 127.0.0.1:0 --tls-cert $W/tls.crt --tls-key $W/tls.key)
else
  run haproxy "$(cat $W/h.pid)" "http://127.0.0.1:$HP/k"
fi
i=0
for b in "$@"; do
  i=$((i+1))
  taskset -c 1 $b --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --upstream http://127.0.0.1:$UP --store $W/f$i.redb "${FLAGS[@]}" > $W/fg$i.out 2>$W/fg$i.err &
  pid=$!; PIDS+=($pid)
  for _ in $(seq 100); do grep -q listening $W/fg$i.out 2>/dev/null && break; sleep 0.1; done
  if [ -n "${TLS:-}" ]; then
    run "fg$i-tls" $pid "https://$(sed -n 's/.*tls=\([^ ]*\).*/\1/p' $W/fg$i.out)/k"
  else
    run "fg$i" $pid "http://$(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' $W/fg$i.out)/k"
  fi
done

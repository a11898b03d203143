#!/bin/bash
# 256 MiB uploads and downloads with curl, direct to nginx and through
# each fencegate binary given, three rounds, medians (the transfer rows of
# compare.sh, for an A/B of builds). curl and nginx on CPU 0, fencegate on
# CPU 1.
#
# Usage: scripts/transfer_ab.sh BIN...
set -u
. "$(dirname "$0")/bench_lib.sh"
bench_init
UP=$(port)
mkdir -p $W/up/files; head -c $((256<<20)) /dev/urandom > $W/up/files/big; chmod -R a+rX $W/up; cp $W/up/files/big $W/upload.bin
cat > $W/up/conf <<C
worker_processes 1; pid $W/up/pid; error_log $W/up/err;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $W/up/b; keepalive_requests 1000000; client_max_body_size 0; sendfile on;
 server { listen 127.0.0.1:$UP; root $W/up/files; location /big { error_page 405 = @put; } location @put { return 200 "ok\n"; } } }
C
taskset -c 0 nginx -c $W/up/conf -p $W/up; sleep 0.3; PIDS+=("$(cat $W/up/pid)")
up() { taskset -c 0 curl -s -o /dev/null -w '%{speed_upload}' -X PUT -H 'X-Fence-Token: 5' -H 'Expect:' --data-binary @$W/upload.bin "$1"; }
down() { taskset -c 0 curl -s -o /dev/null -w '%{speed_download}' "$1" || echo 0; }
i=0; ADDRS=()
for b in "$@"; do
  i=$((i+1))
  taskset -c 1 $b --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --upstream http://127.0.0.1:$UP --store $W/f$i.redb > $W/fg$i.out 2>$W/fg$i.err &
  PIDS+=($!)
  for _ in $(seq 100); do grep -q listening $W/fg$i.out 2>/dev/null && break; sleep 0.1; done
  ADDRS+=("$(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' $W/fg$i.out)")
done
for r in 1 2 3; do
  echo "up direct $(up http://127.0.0.1:$UP/big)"; echo "down direct $(down http://127.0.0.1:$UP/big)"
  for j in $(seq 0 $((i-1))); do echo "up $j $(up http://${ADDRS[$j]}/big)"; echo "down $j $(down http://${ADDRS[$j]}/big)"; done
done > $W/res
python3 - $W/res "$@" <<'P'
import sys, statistics as st
rows=[l.split() for l in open(sys.argv[1])]
for kind in ("up","down"):
    d=st.median(float(r[2]) for r in rows if r[0]==kind and r[1]=="direct")
    print(f"{kind} direct {d/2**20:.0f} MiB/s")
    for j,b in enumerate(sys.argv[2:]):
        f=st.median(float(r[2]) for r in rows if r[0]==kind and r[1]==str(j))
        print(f"{kind} {b} {f/2**20:.0f} MiB/s {f/d:.2f}x")
P

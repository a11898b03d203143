#!/bin/bash
# A/B of fencegate binaries on the request path, in one run: alternating
# rounds of wrk (1 KiB PUTs, 64 connections) against each binary, medians
# of req/s and CPU per request, ratios to the first binary. Same layout as
# compare.sh: wrk and the upstream nginx on CPU 0, fencegate on CPU 1.
#
# Usage: scripts/ab.sh ROUNDS SECS OLD_BIN NEW_BIN...
#   SCRIPTS="steady newkey" adds the new-key case (default: steady only);
#   FGFLAGS passes extra flags to every fencegate.
set -u
. "$(dirname "$0")/bench_lib.sh"
bench_init
R=$1; S=$2; shift 2
UP=$(port)
PIDS+=("$(start_nginx_upstream $W/up $UP)")
write_wrk_scripts $W
i=0; ADDRS=(); FPIDS=()
for b in "$@"; do
  i=$((i+1))
  taskset -c 1 $b --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --upstream http://127.0.0.1:$UP --store $W/f$i.redb ${FGFLAGS:-} > $W/fg$i.out 2>$W/fg$i.err &
  pid=$!; PIDS+=($pid); FPIDS+=($pid)
  for _ in $(seq 100); do grep -q listening $W/fg$i.out 2>/dev/null && break; sleep 0.1; done
  ADDRS+=("$(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' $W/fg$i.out)")
done
for r in $(seq $R); do
  for sc in ${SCRIPTS:-steady}; do
    for j in $(seq 0 $((i-1))); do
      pid=${FPIDS[$j]}; c0=$(awk '{print $14+$15}' /proc/$pid/stat)
      url="http://${ADDRS[$j]}/k"; [ $sc = newkey ] && url="http://${ADDRS[$j]}/n/$r/"
      taskset -c 0 wrk -t1 -c64 -d${S}s -s $W/$sc.lua "$url" > $W/wrk.txt
      c1=$(awk '{print $14+$15}' /proc/$pid/stat)
      rps=$(awk '/Requests\/sec/ {print $2}' $W/wrk.txt)
      echo "$sc $j $rps $(python3 -c "print(f'{($c1-$c0)*10000/($rps*$S):.1f}')")" >> $W/res
    done
  done
done
python3 - "$W/res" "$@" <<'P'
import sys, statistics as st
rows=[l.split() for l in open(sys.argv[1])]
bins=sys.argv[2:]
for sc in sorted(set(r[0] for r in rows)):
    base=None
    for j,b in enumerate(bins):
        rs=[float(r[2]) for r in rows if r[0]==sc and r[1]==str(j)]
        cs=[float(r[3]) for r in rows if r[0]==sc and r[1]==str(j)]
        m=st.median(rs); base=base or m
        print(f"{sc:7} {b:40} {m:9.0f} req/s  {st.median(cs):5.1f} us/req  {m/base:.3f}x  {[int(x) for x in rs]}")
P

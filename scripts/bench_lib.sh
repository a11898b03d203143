# Shared by the benchmark scripts (sourced, not run): free ports, the wrk
# scripts, and HAProxy's configuration, so that every script measures the
# same workload against the same competitor.

# A free loopback port.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wrk scripts in DIR: steady.lua (1 KiB PUTs, one key, the same token) and
# newkey.lua (a new key per request under the URL's path). Each run's URL
# path should be a prefix of its own: wrk's Lua random numbers repeat from
# run to run, and a key seen in an earlier round is not a new key (an equal
# token on a known key writes nothing).
write_wrk_scripts() { # DIR
  cat > "$1/steady.lua" <<'LUA'
wrk.method = "PUT"
wrk.body = string.rep("x", 1024)
wrk.headers["X-Fence-Token"] = "1"
LUA
  cat > "$1/newkey.lua" <<'LUA'
local n = 0
local body = string.rep("x", 1024)
request = function()
  n = n + 1
  return wrk.format("PUT", wrk.path .. n, { ["X-Fence-Token"] = "1" }, body)
end
LUA
}

# HAProxy, one thread, keep-alive both ways, to FILE listening on PORT in
# front of 127.0.0.1:UPSTREAM_PORT.
write_haproxy_cfg() { # FILE PORT UPSTREAM_PORT
  cat > "$1" <<CONF
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
  bind 127.0.0.1:$2
  default_backend be
backend be
  http-reuse always
  server up 127.0.0.1:$3
CONF
}

# nginx on CPU 0 answering 200 itself (a PUT's body is read and dropped), in
# DIR, on PORT; prints its master's PID.
start_nginx_upstream() { # DIR PORT
  mkdir -p "$1"
  cat > "$1/conf" <<CONF
worker_processes 1; pid $1/pid; error_log $1/err;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $1/b; keepalive_requests 1000000; client_max_body_size 0;
 server { listen 127.0.0.1:$2; location / { return 200 "ok\n"; } } }
CONF
  taskset -c 0 nginx -c "$1/conf" -p "$1"
  for _ in $(seq 50); do [ -s "$1/pid" ] && break; sleep 0.1; done
  cat "$1/pid"
}

# A work directory $W (readable by nginx's workers) and the list $PIDS of
# what the script starts; everything in it is killed, children first, and
# $W removed when the script exits.
bench_init() {
  W=$(mktemp -d)
  chmod 755 "$W"
  PIDS=()
  trap bench_cleanup EXIT
}
bench_cleanup() {
  for p in "${PIDS[@]}"; do pkill -9 -P "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done
  pkill -9 -f "$W" 2>/dev/null
  rm -rf "$W"
}

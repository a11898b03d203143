#!/usr/bin/env python3
"""Memory per client connection of a running server, as its RSS grows.

Opens N connections to ADDR and holds them, in one of two states:

  idle        connected (and for TLS, handshaken; for HTTP/2, the preface
              and SETTINGS exchanged), no request sent
  keepalive   one request sent and its whole answer read, the connection
              kept open for the next (HTTP/1.1 keep-alive, or an HTTP/2
              connection whose stream ended)

then reads the RSS of the given processes (VmRSS, summed) before and after,
and prints one line of JSON: {"conns", "rss_before_kb", "rss_after_kb",
"per_conn_bytes"}. The RSS is read after it has settled (two reads 0.5 s
apart within 1 %), so a server still allocating is not caught half-way.

Used by scripts/scale.sh (the connection rows), and by hand:
  scripts/connmem.py --addr 127.0.0.1:8080 --pid 1234 --n 15000 --state idle
Options: --tls CA.pem (TLS with that CA, ALPN http/1.1 or h2), --h2
(HTTP/2: with prior knowledge in clear, by ALPN over TLS), --path
(the request target, GET), --host.
"""

import argparse
import json
import resource
import socket
import ssl
import struct
import sys
import time


def rss_kb(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def settled_rss(pids, timeout=20.0):
    deadline = time.monotonic() + timeout
    last = rss_kb(pids)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = rss_kb(pids)
        if abs(now - last) <= max(1, last // 100):
            return now
        last = now
    return last


def read_exact(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed by the server")
        out += chunk
    return out


def h1_request(s, host, path):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("closed before the answer's head")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    status = head.split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        raise ConnectionError(f"answer {status!r}")
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise ConnectionError("the answer has no Content-Length (needed here)")
    if len(rest) < length:
        read_exact(s, length - len(rest))


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def read_frame(s):
    head = read_exact(s, 9)
    length = int.from_bytes(head[:3], "big")
    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, read_exact(s, length)


def h2_open(s):
    # One write: two small ones would wait on Nagle and the server's delayed
    # ACK (40 ms a connection, most of the run's time at 15,000).
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))  # our SETTINGS, empty
    # The server's SETTINGS, then its ACK of ours (a WINDOW_UPDATE may come
    # between): acknowledge theirs.
    acked = got = False
    while not (acked and got):
        kind, flags, _, _ = read_frame(s)
        if kind == 4 and not flags & 1:
            got = True
            s.sendall(frame(4, 1, 0))
        elif kind == 4:
            acked = True


def h2_request(s, host, path, stream):
    def literal(index, value):  # literal without indexing, indexed name
        v = value.encode()
        return bytes([index]) + bytes([len(v)]) + v
    block = bytes([0x82, 0x86]) + literal(0x04, path) + literal(0x01, host)  # GET, http, :path, :authority
    s.sendall(frame(1, 0x05, stream, block))  # HEADERS, END_STREAM | END_HEADERS
    while True:
        kind, flags, sid, payload = read_frame(s)
        if kind == 7:
            raise ConnectionError(f"GOAWAY {payload!r}")
        if kind == 4 and not flags & 1:
            s.sendall(frame(4, 1, 0))
        if kind == 6 and not flags & 1:  # PING
            s.sendall(frame(6, 1, 0, payload))
        if sid == stream and kind in (0, 1) and flags & 1:
            return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--pid", type=int, action="append", required=True)
    ap.add_argument("--n", type=int, default=15000)
    ap.add_argument("--state", choices=["idle", "keepalive"], default="idle")
    ap.add_argument("--tls", metavar="CA")
    ap.add_argument("--h2", action="store_true")
    ap.add_argument("--path", default="/")
    ap.add_argument("--host", default="localhost")
    a = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < a.n + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, a.n + 1000), hard))
    host, port = a.addr.rsplit(":", 1)
    ctx = None
    if a.tls:
        ctx = ssl.create_default_context(cafile=a.tls)
        ctx.set_alpn_protocols(["h2"] if a.h2 else ["http/1.1"])
        # Tickets and resumption do not matter here; every connection
        # does a full handshake.
    before = settled_rss(a.pid)
    conns = []
    for _ in range(a.n):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx:
            s = ctx.wrap_socket(s, server_hostname=a.host)
        if a.h2:
            h2_open(s)
        if a.state == "keepalive":
            if a.h2:
                h2_request(s, a.host, a.path, 1)
            else:
                h1_request(s, a.host, a.path)
        conns.append(s)
    after = settled_rss(a.pid)
    # Every connection is still open: a server that closed some (a limit)
    # would read as cheaper than it is.
    for s in conns:
        s.setblocking(False)
        try:
            if s.recv(1) == b"":
                sys.exit(f"the server closed a connection: count {len(conns)} is not what it holds")
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
    print(json.dumps({"conns": a.n, "rss_before_kb": before, "rss_after_kb": after,
                      "per_conn_bytes": round((after - before) * 1024 / a.n)}))
    for s in conns:
        s.close()


if __name__ == "__main__":
    main()

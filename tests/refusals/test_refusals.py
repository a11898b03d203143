"""Refusals reach real clients while they are still uploading.

fencegate refuses a stale write before reading its body. Each client here
sends a body (1 B, 64 KiB, 10 MiB) with a stale token and must read the
409, every time: curl 7.88 (Debian 12's) over HTTP/2 with TLS, over h2c and
over HTTP/1.1 with TLS, each with and without `Expect: 100-continue`, and
Python `requests` over TLS with 10 MiB. Then the connection state: an
HTTP/1.1 refusal of a small body keeps the connection, of a large one says
`Connection: close`.

Run by scripts/test (`python -m pytest -q tests/refusals`) after `cargo
build --release`. FENCEGATE_BIN overrides the binary.
"""

import http.server
import os
import pathlib
import socket
import ssl
import subprocess
import sys
import threading

import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import throwaway_pki  # noqa: E402
from fencegate_listening import read_listening  # noqa: E402

BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
TRIES = 20
SIZES = {"1B": 1, "64KiB": 64 << 10, "10MiB": 10 << 20}


class Applying(http.server.BaseHTTPRequestHandler):
    """The backend: reads the body, answers 200, counts what it applied."""

    protocol_version = "HTTP/1.1"
    applied = []

    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        Applying.applied.append((self.path, self.headers.get("x-fence-token"), len(body)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fencegate(tmp_path_factory):
    d = tmp_path_factory.mktemp("refusals")
    pki = throwaway_pki.make(d)
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Applying)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    proc = subprocess.Popen(
        [BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--upstream", f"http://127.0.0.1:{backend.server_port}", "--store", str(d / "fences.redb"),
         "--tls-listen", "127.0.0.1:0", "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])],
        stdout=subprocess.PIPE, stderr=open(d / "fencegate.log", "w"))
    fields = read_listening(proc, d / "fencegate.log")
    files = {}
    for name, size in SIZES.items():
        files[name] = d / f"body-{name}"
        files[name].write_bytes(b"x" * size)
    fg = {"plain": "http://" + fields["proxy"], "tls": "https://localhost:" + fields["tls"].rsplit(":", 1)[1],
          "ca": str(pki["ca"]), "files": files}
    # The key's highest token is 10: every write below carries 5.
    r = requests.put(fg["plain"] + "/k", data=b"v", headers={"X-Fence-Token": "10"})
    assert r.status_code == 200, r.text
    yield fg
    proc.kill()
    proc.wait()
    backend.shutdown()


TRANSPORTS = {
    "h2-tls": lambda fg: ["--http2", "--cacert", fg["ca"], fg["tls"] + "/k"],
    "h2c": lambda fg: ["--http2-prior-knowledge", fg["plain"] + "/k"],
    "h1-tls": lambda fg: ["--http1.1", "--cacert", fg["ca"], fg["tls"] + "/k"],
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_curl_reads_every_refusal(fencegate, transport, expect, size):
    args = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT",
            "-H", "X-Fence-Token: 5", "--data-binary", "@" + str(fencegate["files"][size])]
    # Without the header curl sends none; with it, curl waits for 100 or
    # the final answer before the body.
    args += ["-H", "Expect: 100-continue"] if expect else ["-H", "Expect:"]
    args += TRANSPORTS[transport](fencegate)
    outcomes = []
    for _ in range(TRIES):
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
        outcomes.append(out.stdout if out.returncode == 0 else f"exit {out.returncode}: {out.stderr.strip()}")
    assert outcomes == ["409"] * TRIES, outcomes
    assert not [a for a in Applying.applied if a[1] == "5"], "a refused write reached the backend"


def test_requests_reads_every_refusal_of_a_large_upload(fencegate):
    body = fencegate["files"]["10MiB"].read_bytes()
    statuses = []
    for _ in range(10):
        try:
            r = requests.put(fencegate["tls"] + "/k", data=body, headers={"X-Fence-Token": "5"},
                             verify=fencegate["ca"], timeout=60)
            statuses.append(r.status_code)
            assert r.headers["x-fence-token-highest"] == "10"
        except requests.RequestException as e:
            statuses.append(repr(e))
    assert statuses == [409] * 10, statuses


def raw_exchange(fg, size, extra=b""):
    """One HTTP/1.1 refusal over a raw TLS socket: the answer's head, and
    whether the connection then takes another request."""
    ctx = ssl.create_default_context(cafile=fg["ca"])
    port = int(fg["tls"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw, ctx.wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(b"PUT /k HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 5\r\nContent-Length: %d\r\n" % size
                  + extra + b"\r\n" + b"x" * size)
        f = s.makefile("rb")
        head = []
        while (line := f.readline()) not in (b"\r\n", b""):
            head.append(line.decode().strip().lower())
        length = int(next(h for h in head if h.startswith("content-length:")).split(":")[1])
        f.read(length)
        s.sendall(b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n")
        again = f.readline().decode().strip()
        return head, again


def test_a_small_refused_body_keeps_the_connection(fencegate):
    head, again = raw_exchange(fencegate, 1000)
    assert head[0].startswith("http/1.1 409"), head
    assert "connection: close" not in head, head
    assert again.startswith("HTTP/1.1 200"), again


def test_a_large_refused_body_says_the_connection_closes(fencegate):
    head, again = raw_exchange(fencegate, 2 << 20)
    assert head[0].startswith("http/1.1 409"), head
    assert "connection: close" in head, head
    assert again == "", again

"""The Grafana board and the alert rules against a real Prometheus
(Debian's package) scraping a running fencegate under a little load.

fencegate runs on a real Redis primary with one replica, a real backend,
a dead route, and a TLS listener; the load is bounded and makes every
kind of event the board draws (admitted and refused writes, an upstream
that refuses connections, a TLS handshake that fails, HTTP/2 by ALPN, a
slow body the lane hands to hyper, a replica that stops confirming).
Then every query of every panel (deploy/grafana/fencegate.json) and
every alert (deploy/prometheus/alerts.yml) goes through Prometheus's
HTTP API:

- each panel query returns data (a typo returns none);
- every rule loads and evaluates with health "ok";
- each alert's expression, without its threshold, returns data, and the
  replica alert's whole expression holds once a stopped replica failed a
  write (and not before);
- the connection counters moved for the engines that served: the lane on
  both listeners, hyper for HTTP/2 by ALPN, and the lane's handoff;
- each alert's `dashboard` annotation names a panel that draws a metric
  the alert watches.

Run by scripts/test after `cargo build --release`. FENCEGATE_BIN overrides
the binary, PROMETHEUS the Prometheus server.
"""

import http.server
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import throwaway_pki  # noqa: E402
from fencegate_listening import read_listening  # noqa: E402

BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
PROMETHEUS = os.environ.get("PROMETHEUS", shutil.which("prometheus") or "/usr/bin/prometheus")
BOARD = json.loads((ROOT / "deploy" / "grafana" / "fencegate.json").read_text())
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"


class Backend(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_PUT(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # fencegate closing its pooled connections at the end


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, check, timeout=30.0):
    """Polls `check` until it returns something true; fails naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (requests.ConnectionError, redis.ConnectionError, OSError) as e:
            last = e
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}: last {last!r}")


def redis_server(d, port, *extra):
    server = shutil.which("redis-server")
    assert server, "redis-server is missing: apt-get install redis-server (scripts/test installs it)"
    (d / str(port)).mkdir()
    return subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(d / str(port)), *extra],
                            stdout=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("dashboard")
    assert os.path.exists(PROMETHEUS), f"{PROMETHEUS} is missing: apt-get install prometheus (scripts/test installs it)"
    procs = []
    primary_port, replica_port = free_port(), free_port()
    procs.append(redis_server(d, primary_port))
    procs.append(redis_server(d, replica_port, "--replicaof", "127.0.0.1", str(primary_port)))
    replica = procs[-1]
    wait_for("the replica's link to the primary",
             lambda: redis.Redis(port=replica_port).info("replication").get("master_link_status") == "up")
    url = f"redis://127.0.0.1:{primary_port}"
    subprocess.run([BIN, "init-store", "--store", url], check=True, capture_output=True)

    backend = Server(("127.0.0.1", 0), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    pki = throwaway_pki.make(d)
    (d / "fencegate.toml").write_text(f"""
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
store = "{url}"
store_timeout = "2s"

[[routes]]
name = "dead"
path_prefix = "/dead"
upstream = "http://127.0.0.1:{free_port()}"

[[routes]]
name = "files"
upstream = "http://127.0.0.1:{backend.server_port}"

[tls]
listen = "127.0.0.1:0"
cert = "{pki['cert']}"
key = "{pki['key']}"
""")
    log = d / "fencegate.log"
    fg = subprocess.Popen([BIN, "--config", str(d / "fencegate.toml")],
                          stdout=subprocess.PIPE, stderr=open(log, "w"))
    procs.append(fg)
    fields = read_listening(fg, log)

    prom_port = free_port()
    (d / "prometheus.yml").write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {RULES}
scrape_configs:
  - job_name: fencegate
    static_configs:
      - targets: ["{fields['admin']}"]
""")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(d / "prometheus.log", "w"))
    procs.append(prom)
    api = f"http://127.0.0.1:{prom_port}"
    wait_for("Prometheus to be ready", lambda: requests.get(api + "/-/ready").status_code == 200)
    yield {"proxy": fields["proxy"], "tls": fields["tls"], "admin": fields["admin"], "ca": pki["ca"], "api": api,
           "replica": replica, "log": log}
    for p in reversed(procs):
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            p.wait(timeout=30)


def query(stack, expr):
    r = requests.get(stack["api"] + "/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {r.status_code} {r.text}"
    return body["data"]["result"]


def metric(stack, name, **labels):
    """A sample's value in fencegate's own /metrics (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    text = requests.get(f"http://{stack['admin']}/metrics").text
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
            return float(m.group(3))
    return 0.0


def put(base, path, token=None, **kw):
    headers = {} if token is None else {"X-Fence-Token": str(token)}
    return requests.put(base + path, data=b"v", headers=headers, **kw)


def load(stack):
    """A bounded load with every event the board draws."""
    plain, tls = "http://" + stack["proxy"], "https://" + stack["tls"]
    for token in range(1, 41):
        assert put(plain, f"/files/k{token % 4}", token).status_code == 200
        assert requests.get(plain + f"/files/k{token % 4}").status_code == 200
    assert put(plain, "/files/k1", 2).status_code == 409  # stale
    assert put(plain, "/files/k1").status_code == 428  # missing token
    assert put(tls, "/files/k1", 100, verify=str(stack["ca"])).status_code == 200
    assert put(plain, "/dead/x", 1).status_code == 502  # the upstream refuses connections
    # HTTP/2 by ALPN: hyper's from the start.
    h2 = subprocess.run(["curl", "-sS", "--http2", "--cacert", str(stack["ca"]), "-o", "/dev/null",
                         "-w", "%{http_version}", f"{tls}/files/k2"], capture_output=True, text=True)
    assert h2.stdout == "2", h2
    # Plain HTTP on the TLS port: a failed handshake.
    host, port = stack["tls"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(10)
        try:
            while s.recv(4096):
                pass
        except (ConnectionResetError, socket.timeout):
            pass
    # A body that does not arrive at once: the lane hands the connection to
    # hyper (after its one-second wait), which reads the rest.
    handoffs = metric(stack, "fencegate_lane_handoffs_total", listener="proxy")
    host, port = stack["proxy"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"PUT /files/slow HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\n"
                  b"Content-Length: 4\r\nConnection: close\r\n\r\nab")
        wait_for("the lane to hand the slow body to hyper",
                 lambda: metric(stack, "fencegate_lane_handoffs_total", listener="proxy") > handoffs)
        s.sendall(b"cd")
        s.settimeout(10)
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer


def panel_queries():
    for p in BOARD["panels"]:
        for t in p.get("targets", []):
            yield p["id"], p["title"], t["expr"]


def rules(stack):
    return [r for g in requests.get(stack["api"] + "/api/v1/rules").json()["data"]["groups"] for r in g["rules"]]


def test_every_panel_and_alert_query_returns_data(stack):
    served = {(listener, engine): metric(stack, "fencegate_connections_served_total", listener=listener, engine=engine)
              for listener in ("proxy", "tls") for engine in ("lane", "hyper")}
    load(stack)
    # Each engine served what it should: the lane HTTP/1.1 on both
    # listeners, hyper the HTTP/2 connection by ALPN.
    for key in [("proxy", "lane"), ("tls", "lane"), ("tls", "hyper")]:
        after = metric(stack, "fencegate_connections_served_total", listener=key[0], engine=key[1])
        assert after > served[key], f"no new connection counted for {key}: {served[key]} -> {after}"

    # A replica that stops confirming: the write is refused (503), and
    # the replica alert's whole expression holds.
    replica_alert = next(r["query"] for r in rules(stack) if r["name"] == "FencegateReplicasNotConfirming")
    assert not query(stack, replica_alert), "the replica alert holds before any replica failed"
    os.kill(stack["replica"].pid, signal.SIGSTOP)
    try:
        r = put("http://" + stack["proxy"], "/files/k1", 200)
        assert r.status_code == 503, r.text
        wait_for("the replica alert's expression to hold", lambda: query(stack, replica_alert))
    finally:
        os.kill(stack["replica"].pid, signal.SIGCONT)
    wait_for("writes to be admitted again",
             lambda: put("http://" + stack["proxy"], "/files/k1", 201).status_code == 200)
    wait_for("the replica to confirm again",
             lambda: query(stack, "fencegate_store_replicas_confirmed >= 1"))

    # Every panel: data, once Prometheus has scraped what the load made.
    empty = {}
    deadline = time.monotonic() + 30
    while True:
        empty = {(pid, title, expr) for pid, title, expr in panel_queries() if not query(stack, expr)}
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, "panel queries without data (a typo, or a metric the load never made):\n" + \
        "\n".join(f"  panel {pid} {title!r}: {expr}" for pid, title, expr in sorted(empty))
    # Every rule loaded, evaluated, healthy.
    names = set(re.findall(r"^\s*- alert: (\w+)", RULES.read_text(), re.M))
    assert {r["name"] for r in rules(stack)} == names and names
    wait_for("every rule to be evaluated", lambda: all(
        not r.get("lastEvaluation", "0001").startswith("0001") for r in rules(stack)))
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules(stack) if r["health"] != "ok"]
    assert not bad, bad

    panels = {p["id"]: p for p in BOARD["panels"]}
    for r in rules(stack):
        # The expression without its threshold: what the alert watches.
        watched = re.split(r"\s(?:==|!=|>=|<=|>|<)\s", r["query"])[0]
        assert query(stack, watched), f"{r['name']}: no data for {watched!r}"
        link = r["annotations"].get("dashboard", "")
        m = re.fullmatch(r"/d/" + BOARD["uid"] + r"/fencegate\?viewPanel=(\d+)", link)
        assert m and int(m.group(1)) in panels, f"{r['name']}: dashboard {link!r} is no panel of the board"
        alert_metrics = {re.sub(r"_bucket$", "", x) for x in re.findall(r"fencegate_\w+", r["query"])}
        panel_metrics = {re.sub(r"_bucket$", "", x) for t in panels[int(m.group(1))]["targets"]
                         for x in re.findall(r"fencegate_\w+", t["expr"])}
        assert alert_metrics & panel_metrics, \
            f"{r['name']} watches {alert_metrics}, its panel {m.group(1)} draws {panel_metrics}"

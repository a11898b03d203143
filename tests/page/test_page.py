"""The admin page, as a person uses it: in a real browser (Debian's
chromium, driven headless by Playwright), against a running fencegate on a
real Redis store (a primary and a replica) with a real backend.

- Without the admin token the page shows nothing, and its API calls are
  refused.
- After a stale write, its refusal appears on the page within two seconds,
  with the client's address, its token and the key's highest.
- The health panel shows the Redis replica confirming the writes.
- The lookup box shows the key a path takes, its highest token and the
  request that last raised it, its writes in flight and holds.
- The health panel shows amnesia when the store is wiped, and clears after
  confirm-reset.

Run by scripts/test after `cargo build --release`. FENCEGATE_BIN overrides
the binary, CHROMIUM the browser. UPDATE_SCREENSHOT=1 writes the README's
screenshot (docs/admin-page.png); otherwise it goes to target/.
"""

import http.server
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
import redis
from playwright.sync_api import expect, sync_playwright

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from fencegate_listening import read_listening  # noqa: E402

BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
TOKEN = "page-admin-token-0123456789"


class Backend(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_PUT(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("page")
    server = shutil.which("redis-server")
    assert server, "redis-server is missing: apt-get install redis-server (scripts/test installs it)"
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: apt-get install chromium (scripts/test installs it)"
    port = free_port()
    store = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(d)], stdout=subprocess.DEVNULL)
    # A replica, as in production: the page shows how many confirm.
    replica_port = free_port()
    (d / "replica").mkdir()
    replica = subprocess.Popen([server, "--port", str(replica_port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(d / "replica"),
                                "--replicaof", "127.0.0.1", str(port)], stdout=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            if redis.Redis(port=replica_port).info("replication").get("master_link_status") == "up":
                break
        except redis.ConnectionError:
            pass
        assert time.monotonic() < deadline, "the replica did not link to the primary"
        time.sleep(0.05)
    url = f"redis://127.0.0.1:{port}"
    subprocess.run([BIN, "init-store", "--store", url], check=True, capture_output=True)
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    (d / "admin-token").write_text(TOKEN + "\n")
    log = d / "fencegate.log"
    proc = subprocess.Popen(
        [BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--upstream", f"http://127.0.0.1:{backend.server_port}", "--store", url,
         "--admin-token-file", str(d / "admin-token")],
        stdout=subprocess.PIPE, stderr=open(log, "w"))
    fields = read_listening(proc, log)
    yield {"proxy": "http://" + fields["proxy"], "admin": "http://" + fields["admin"], "redis": r, "log": log}
    proc.terminate()
    proc.wait(timeout=30)
    for p in (replica, store):
        p.terminate()
        p.wait()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


def put(stack, path, token, agent="nightly-export/2.3"):
    return requests.put(stack["proxy"] + path, data=b"v",
                        headers={"X-Fence-Token": str(token), "User-Agent": agent})


def test_without_the_token_the_page_shows_nothing(stack, browser):
    page = browser.new_page()
    page.goto(stack["admin"] + "/")
    expect(page.locator("#signin")).to_be_visible()
    expect(page.locator("#app")).to_be_hidden()
    for path in ["/v1/refusals", "/v1/status"]:
        assert requests.get(stack["admin"] + path).status_code == 401
        assert requests.get(stack["admin"] + path, headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code == 401
    # A wrong token signs nobody in.
    page.fill("#token", "wrong-token-0123456789")
    page.click("#signin button")
    expect(page.locator("#error")).to_contain_text("refused")
    expect(page.locator("#app")).to_be_hidden()
    page.close()


def test_a_stale_write_appears_with_its_writer_and_the_lookup_explains_it(stack, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(stack["admin"] + "/")
    page.fill("#token", TOKEN)
    page.click("#signin button")
    expect(page.locator("#health")).to_have_text("healthy")
    raised_by = {}
    for token in range(1, 13):
        r = put(stack, f"/reports/q{token % 3}.csv", token)
        assert r.status_code == 200
        raised_by[token] = r.headers["X-Request-Id"]
    # The store's health: its replica confirmed the writes.
    expect(page.locator("#status")).to_contain_text("1 of 1 waited for")
    expect(page.locator("#status")).to_contain_text("ms mean over the last")
    stale = put(stack, "/reports/q1.csv", 4, agent="nightly-export/2.2 (paused)")
    assert stale.status_code == 409, stale.text
    refused_at = time.monotonic()
    row = page.locator("#refusals tr", has_text="default:/reports/q1.csv")
    expect(row).to_be_visible(timeout=2000)
    print(f"the refusal appeared {time.monotonic() - refused_at:.2f} s after the write")
    cells = row.locator("td")
    expect(cells.nth(1)).to_have_text("409")
    expect(cells.nth(3)).to_have_text("4")
    expect(cells.nth(4)).to_have_text("10")
    expect(cells.nth(5)).to_have_text("127.0.0.1")
    expect(cells.nth(6)).to_have_text("nightly-export/2.2 (paused)")
    # The filter by client keeps it; another client's filter hides it.
    page.fill("#f-client", "192.0.2.9")
    expect(row).to_have_count(0)
    page.fill("#f-client", "127.0.0.1")
    expect(row).to_be_visible()
    page.fill("#f-client", "")
    # The lookup box: the key this path takes and its highest.
    page.fill("#l-path", "/reports/q1.csv")
    page.click("#lookup button")
    result = page.locator("#lookup-result")
    expect(result).to_contain_text("default:/reports/q1.csv")
    expect(result).to_contain_text("10")
    # Who raised it: on a shared store, the first write of token 10
    # through this fencegate, named by its request id and user agent.
    raised = result.locator("dd").nth(5)
    expect(raised).to_contain_text("first written here")
    expect(raised).to_contain_text("PUT /reports/q1.csv")
    expect(raised).to_contain_text("request " + raised_by[10])
    expect(raised).to_contain_text("client 127.0.0.1")
    expect(raised).to_contain_text("nightly-export/2.3")
    expect(result.locator("dd").nth(6)).to_have_text("none")
    expect(result.locator("dd").nth(7)).to_have_text("none")
    # The chart draws writes per second: a bounded burst (120 writes over
    # about 6 s, one in six stale) until it has several points.
    for i in range(120):
        put(stack, f"/reports/live{i % 4}.csv", 100 + i if i % 6 else 1)
        time.sleep(0.05)
    page.wait_for_function(
        "(document.querySelector('#chart polyline.admitted')?.getAttribute('points') || '').split(' ').length >= 3",
        timeout=15000)
    shot = ROOT / ("docs/admin-page.png" if os.environ.get("UPDATE_SCREENSHOT") else "target/admin-page.png")
    shot.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    page.close()


def test_the_health_panel_shows_amnesia_until_confirm_reset(stack, browser):
    page = browser.new_page()
    page.goto(stack["admin"] + "/")
    page.fill("#token", TOKEN)
    page.click("#signin button")
    expect(page.locator("#health")).to_have_text("healthy")
    assert put(stack, "/amnesia/k", 50).status_code == 200
    stack["redis"].flushall()
    # The next write finds the store's marker gone.
    deadline = time.monotonic() + 30
    while True:
        r = put(stack, "/amnesia/k", 51)
        if r.status_code == 503 and "lost data" in r.text:
            break
        assert time.monotonic() < deadline, f"no amnesia seen: {r.status_code} {r.text}"
        time.sleep(0.2)
    expect(page.locator("#health")).to_have_text("store lost data", timeout=10000)
    expect(page.locator("#amnesia")).to_be_visible()
    expect(page.locator("#amnesia")).to_contain_text("confirm-reset")
    c = requests.post(stack["admin"] + "/v1/store/confirm-reset", headers={"Authorization": "Bearer " + TOKEN})
    assert c.status_code == 200, c.text
    expect(page.locator("#health")).to_have_text("healthy", timeout=10000)
    expect(page.locator("#amnesia")).to_be_hidden()
    page.close()

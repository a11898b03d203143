"""fencegate's lease service (docs/leases.md) through the Python client
(examples/fencegate_lease.py), against the real binary and the recording
upstream of conftest.py.

One fencegate with the lease listener on, two routes: `/granted` with
`tokens = "granted"` (namespace `granted`), and the catch-all with the
default `tokens = "any"`. Checked: a grant carries a token and keeps every
other contender out (409 with the holder); release, then a new grant with a
higher token; the context manager keeps a 300 ms lease alive for a second;
bearer tokens and their key scopes (401, 403); on the granted route the
granted token reaches the upstream, one above it is refused with 403
(`not-granted`) and never forwarded, and the older holder's token gets 409.

Run by scripts/test with the other recipes: `python3 -m pytest -q
tests/recipes` after `cargo build --release`; FENCEGATE_BIN overrides the
binary.
"""

import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))

import fencegate_lease as fl  # noqa: E402
from fencegate_listening import read_listening  # noqa: E402

FENCEGATE_BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
START_TIMEOUT = 30.0
TOKEN = "lease-test-token-0123456789abcdef"
SCOPED_TOKEN = "lease-test-scoped-0123456789abcdef"  # only keys starting `scoped:`


@pytest.fixture(scope="module")
def lease_gate(upstream, tmp_path_factory):
    """fencegate with `--lease-listen` in front of `upstream`:
    {"url", "admin", "lease"}, each an http:// base URL."""
    if not os.path.exists(FENCEGATE_BIN):
        pytest.fail(f"{FENCEGATE_BIN} missing: run cargo build --release first (or set FENCEGATE_BIN)",
                    pytrace=False)
    d = tmp_path_factory.mktemp("fencegate-leases")
    tokens = d / "lease-tokens"
    tokens.write_text(f"{TOKEN}\n{SCOPED_TOKEN} scoped:\n")
    config = d / "leases.toml"
    config.write_text(f"""
store = "{d / 'fences.redb'}"

[[routes]]
name = "granted"
path_prefix = "/granted"
upstream = "{upstream.url}"
namespace = "granted"
tokens = "granted"

[[routes]]
name = "any"
upstream = "{upstream.url}"
""")
    log = d / "fencegate.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [FENCEGATE_BIN, "--config", str(config), "--listen", "127.0.0.1:0",
             "--admin-listen", "127.0.0.1:0", "--lease-listen", "127.0.0.1:0",
             "--lease-token-file", str(tokens)],
            stdout=subprocess.PIPE, stderr=stderr,
        )
    try:
        fields = read_listening(proc, log, timeout=START_TIMEOUT)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    if "lease" not in fields:
        proc.kill()
        proc.wait()
        pytest.fail(f"fencegate's listening line names no lease=ADDR (bound by --lease-listen): "
                    f"{fields}\n{log.read_text()[-3000:]}", pytrace=False)
    yield {"url": "http://" + fields["proxy"], "admin": "http://" + fields["admin"],
           "lease": "http://" + fields["lease"]}
    proc.kill()
    proc.wait()


@pytest.fixture
def client(lease_gate):
    return fl.LeaseClient(lease_gate["lease"], TOKEN)


def put(proxy_url, path, body, token):
    """A fenced PUT through the proxy: (status, problem+json body or {})."""
    request = urllib.request.Request(proxy_url + path, data=body, method="PUT",
                                     headers={"X-Fence-Token": str(token)})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status, {}
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text else {}


def assert_problem(problem, status):
    for member in ("type", "title", "status", "detail"):
        assert member in problem, problem
    assert problem["status"] == status, problem


def test_a_grant_keeps_others_out_and_the_next_grant_is_higher(client):
    key = "default:/leases/exclusive.txt"
    first = client.acquire(key=key, ttl_ms=10000, holder="worker A")
    assert first["key"] == key and first["holder"] == "worker A", first
    assert isinstance(first["token"], str) and first["token"].isdigit(), first
    assert first["ttl_ms"] == 10000, first

    with pytest.raises(fl.LeaseHeld) as held:
        client.acquire(key=key, ttl_ms=10000, holder="worker B")
    assert held.value.holder == "worker A"
    assert held.value.key == key
    assert 0 < held.value.expires_in_ms <= 10000
    assert_problem(held.value.problem, 409)

    assert client.release(first["lease"])
    with pytest.raises(fl.LeaseLost):
        client.get(first["lease"])
    with pytest.raises(fl.LeaseLost):  # a released lease is never revived
        client.renew(first["lease"], 10000)

    second = client.acquire(key=key, ttl_ms=10000, holder="worker B")
    try:
        assert int(second["token"]) > int(first["token"]), (first, second)
        assert second["lease"] != first["lease"]
    finally:
        assert client.release(second["lease"])


def test_the_context_manager_keeps_a_short_lease_alive(client):
    key = "default:/leases/renewed.txt"
    # A TTL short enough to need renewals within the test, long enough that
    # one renewal slowed down by a busy machine (CI, a laptop) is not a loss.
    with client.lease(key=key, ttl_ms=1000, holder="renewer") as lease:
        assert lease.headers() == {"X-Fence-Token": lease.token}
        time.sleep(3.2)  # over three TTLs: only the renewals keep it
        assert not lease.lost.is_set(), lease.lost_reason
        lease.check()
        seen = client.get(lease.id)
        assert seen["lease"] == lease.id and seen["key"] == key, seen
        assert seen["token"] == lease.token and seen["holder"] == "renewer", seen
        assert 0 < seen["expires_in_ms"] <= 1000, seen
        with pytest.raises(fl.LeaseHeld) as held:
            client.acquire(key=key, ttl_ms=1000, holder="contender")
        assert held.value.holder == "renewer"
        token = lease.token
    with pytest.raises(fl.LeaseLost):  # released on exit
        client.get(lease.id)
    after = client.acquire(key=key, ttl_ms=1000, holder="next")
    assert int(after["token"]) > int(token)
    assert client.release(after["lease"])


def test_bearer_tokens_and_their_scopes(lease_gate):
    for bearer in ("", "not-a-listed-token-0123456789"):
        with pytest.raises(fl.LeaseError) as refused:
            fl.LeaseClient(lease_gate["lease"], bearer).acquire(key="scoped:x", ttl_ms=1000)
        assert refused.value.status == 401, refused.value
        assert_problem(refused.value.problem, 401)

    scoped = fl.LeaseClient(lease_gate["lease"], SCOPED_TOKEN)
    grant = scoped.acquire(key="scoped:/leases/mine.txt", ttl_ms=1000)
    assert scoped.release(grant["lease"])
    with pytest.raises(fl.LeaseError) as refused:
        scoped.acquire(key="default:/leases/not-mine.txt", ttl_ms=1000)
    assert refused.value.status == 403, refused.value
    assert_problem(refused.value.problem, 403)


def test_a_granted_route_admits_the_granted_token_only(client, lease_gate, upstream):
    path = "/granted/report.txt"
    lookup = urllib.request.urlopen(
        lease_gate["admin"] + "/v1/fences?" + urllib.parse.urlencode({"path": path}), timeout=10)
    key = json.load(lookup)["key"]

    a = client.acquire(path=path, ttl_ms=10000, holder="A")
    assert a["key"] == key, (a, key)  # mapped as a write to the path is
    token_a = int(a["token"])
    assert put(lease_gate["url"], path, b"from A", token_a) == (200, {})
    assert upstream.body(path) == b"from A"

    arrived = len(upstream.arrivals_for(path))
    status, problem = put(lease_gate["url"], path, b"above the grant", token_a + 1)
    assert status == 403, problem
    assert_problem(problem, 403)
    assert problem["type"].endswith("not-granted"), problem
    assert len(upstream.arrivals_for(path)) == arrived, "a token above the grant reached the upstream"

    # A key nobody was granted: every token is above its (absent) grant.
    status, problem = put(lease_gate["url"], "/granted/never.txt", b"x", 1)
    assert status == 403 and problem["type"].endswith("not-granted"), (status, problem)
    assert upstream.arrivals_for("/granted/never.txt") == []

    assert client.release(a["lease"])
    b = client.acquire(path=path, ttl_ms=10000, holder="B")
    try:
        token_b = int(b["token"])
        assert token_b > token_a
        # Raised at the grant: A is refused before B writes anything.
        status, problem = put(lease_gate["url"], path, b"late write from A", token_a)
        assert status == 409, problem
        assert problem["highest"] == str(token_b), problem
        assert put(lease_gate["url"], path, b"from B", token_b) == (200, {})
        assert upstream.body(path) == b"from B"
        assert [t for _, _, t in upstream.arrivals_for(path)] == [str(token_a), str(token_b)]
    finally:
        assert client.release(b["lease"])

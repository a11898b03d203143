"""gRPC through fencegate with real grpcio servers and clients (PyPI
`grpcio`): a unary write `/fence.Writer/Write`, fenced per resource by the
`x-resource` metadata, and a server-streaming read `/fence.Writer/Watch` on
a read-only route. Every combination of the client speaking to fencegate
in h2c or over TLS, and fencegate speaking to the server in h2c
(`upstream_http2 = true` on an http:// upstream) or over TLS with ALPN h2.

The methods use raw bytes (no generated stubs): the request is the payload,
the server answers `ok:<token>:<payload>` and records what it applied.

Run by scripts/test (`python -m pytest -q tests/grpc`) after `cargo build
--release`. FENCEGATE_BIN overrides the binary.
"""

import os
import pathlib
import socket
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import throwaway_pki  # noqa: E402
from fencegate_listening import read_listening  # noqa: E402

BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))
WRITE = "/fence.Writer/Write"
WATCH = "/fence.Writer/Watch"


class Backend:
    """A grpcio server; `applied` lists (token, resource, payload) in the
    order the writes were applied."""

    def __init__(self, creds=None):
        self.applied = []
        self.lock = threading.Lock()

        def write(request, context):
            md = dict(context.invocation_metadata())
            with self.lock:
                self.applied.append((md.get("x-fence-token"), md.get("x-resource"), request))
            context.set_trailing_metadata((("x-applied", str(len(self.applied))),))
            return b"ok:" + md.get("x-fence-token", "").encode() + b":" + request

        def watch(request, context):
            for i in range(3):
                yield b"event %d of " % i + request
            context.set_trailing_metadata((("x-watched", "3"),))

        handler = grpc.method_handlers_generic_handler("fence.Writer", {
            "Write": grpc.unary_unary_rpc_method_handler(write),
            "Watch": grpc.unary_stream_rpc_method_handler(watch),
        })
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=(handler,))
        if creds:
            self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        else:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self):
        self.server.stop(None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return throwaway_pki.make(tmp_path_factory.mktemp("pki"))


def server_creds(pki):
    return grpc.ssl_server_credentials([(pki["key"].read_bytes(), pki["cert"].read_bytes())])


@pytest.fixture(scope="module", params=["h2c-upstream", "tls-upstream"])
def setup(request, pki, tmp_path_factory):
    """A backend and fencegate in front of it, with a TLS listener too."""
    tls_upstream = request.param == "tls-upstream"
    backend = Backend(server_creds(pki) if tls_upstream else None)
    d = tmp_path_factory.mktemp("fencegate")
    scheme = "https://localhost" if tls_upstream else "http://127.0.0.1"
    upstream = f'upstream = "{scheme}:{backend.port}"\nupstream_http2 = true\n'
    if tls_upstream:
        upstream += f'upstream_ca = "{pki["ca"]}"\n'
    (d / "fencegate.toml").write_text(f"""
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
store = "{d / 'fences.redb'}"

[tls]
listen = "127.0.0.1:0"
cert = "{pki['cert']}"
key = "{pki['key']}"

# The streaming read: a POST like every gRPC call, but no write.
[[routes]]
name = "watch"
path_prefix = "{WATCH}"
write_methods = []
{upstream}
# Every other method: a write fenced per resource, not per method.
[[routes]]
name = "grpc"
key = "header:x-resource"
{upstream}
""")
    proc = subprocess.Popen([BIN, "--config", str(d / "fencegate.toml")],
                            stdout=subprocess.PIPE, stderr=open(d / "fencegate.log", "w"))
    try:
        fields = read_listening(proc, d / "fencegate.log")
        yield {"backend": backend, "plain": fields["proxy"],
               "tls": "localhost:" + fields["tls"].rsplit(":", 1)[1], "log": d / "fencegate.log"}
    finally:
        proc.kill()
        proc.wait()
        backend.stop()


@pytest.fixture(params=["h2c-client", "tls-client"])
def channel(request, setup, pki):
    if request.param == "tls-client":
        creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        ch = grpc.secure_channel(setup["tls"], creds)
    else:
        ch = grpc.insecure_channel(setup["plain"])
    yield ch
    ch.close()


def write(channel, payload, token=None, resource="acct-1"):
    md = [("x-resource", resource)]
    if token is not None:
        md.append(("x-fence-token", str(token)))
    call = channel.unary_unary(WRITE)
    return call.with_call(payload, metadata=md, timeout=10)


def fresh_resource(request):
    """A resource of its own per test and combination: the fixtures' store
    lives for the whole module."""
    return "res-" + request.node.name


def test_a_write_is_admitted_and_its_trailers_arrive(channel, setup, request):
    res = fresh_resource(request)
    reply, call = write(channel, b"first", token=5, resource=res)
    assert reply == b"ok:5:first"
    assert call.code() == grpc.StatusCode.OK
    trailers = dict(call.trailing_metadata())
    assert "x-applied" in trailers, trailers
    assert ("5", res, b"first") in setup["backend"].applied


def test_a_stale_token_is_aborted_with_the_reason_and_the_highest_token(channel, setup, request):
    res = fresh_resource(request)
    write(channel, b"new", token=34, resource=res)
    with pytest.raises(grpc.RpcError) as err:
        write(channel, b"old", token=33, resource=res)
    e = err.value
    assert e.code() == grpc.StatusCode.ABORTED, e
    assert e.details() == "token 33 is lower than the highest token 34 for this key"
    assert dict(e.trailing_metadata())["x-fence-token-highest"] == "34"
    assert ("33", res, b"old") not in setup["backend"].applied


def test_a_missing_token_is_a_failed_precondition(channel, setup, request):
    res = fresh_resource(request)
    with pytest.raises(grpc.RpcError) as err:
        write(channel, b"none", resource=res)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert "X-Fence-Token" in err.value.details()
    assert all(r != res for _, r, _ in setup["backend"].applied)


def test_a_malformed_token_is_a_failed_precondition(channel, setup, request):
    with pytest.raises(grpc.RpcError) as err:
        write(channel, b"bad", token="-1", resource=fresh_resource(request))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value


def test_server_streaming_on_a_read_only_route(channel):
    call = channel.unary_stream(WATCH)(b"acct", timeout=10)
    assert list(call) == [b"event 0 of acct", b"event 1 of acct", b"event 2 of acct"]
    assert call.code() == grpc.StatusCode.OK
    assert dict(call.trailing_metadata())["x-watched"] == "3"


def test_an_unreachable_backend_is_unavailable(pki, tmp_path):
    """fencegate's own answer when the server is gone: UNAVAILABLE, which
    gRPC clients retry, not UNKNOWN."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "fencegate.toml").write_text(f"""
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
store = "{tmp_path / 'fences.redb'}"
[[routes]]
key = "header:x-resource"
upstream = "http://127.0.0.1:{port}"
upstream_http2 = true
""")
    proc = subprocess.Popen([BIN, "--config", str(tmp_path / "fencegate.toml")],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "fencegate.log", "w"))
    try:
        fields = read_listening(proc, tmp_path / "fencegate.log")
        with grpc.insecure_channel(fields["proxy"]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                write(ch, b"x", token=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    finally:
        proc.kill()
        proc.wait()


def test_the_example_runs_as_documented():
    """examples/grpc_writer.py, as docs/gateway.md tells a user to run it."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "grpc_writer.py")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "token 4: ABORTED: token 4 is lower than the highest token 5 for this key (highest 5)" in out.stdout


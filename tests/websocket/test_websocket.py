"""WebSocket through fencegate with the `websockets` library, both ends
real: an echo server behind a route with `websocket = true`, and the
refusal on a route without it.

The handshake is a GET: a read unless the route lists GET among its write
methods, when it needs a token like any write. Messages after the
handshake are not fenced.

Run by scripts/test (`python -m pytest -q tests/websocket`) after `cargo
build --release`. FENCEGATE_BIN overrides the binary.
"""

import asyncio
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import websockets
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from fencegate_listening import read_listening  # noqa: E402

BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))


class Echo:
    """A websockets echo server on its own thread and event loop; records
    the request path and token of each handshake it accepted."""

    def __init__(self):
        self.handshakes = []
        started = threading.Event()

        async def echo(ws):
            self.handshakes.append((ws.request.path, ws.request.headers.get("x-fence-token")))
            async for message in ws:
                await ws.send(message)

        async def main():
            async with serve(echo, "127.0.0.1", 0) as server:
                self.port = server.sockets[0].getsockname()[1]
                self.stop = asyncio.get_running_loop().create_future()
                self.loop = asyncio.get_running_loop()
                started.set()
                await self.stop

        threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
        assert started.wait(10)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set_result, None)


@pytest.fixture(scope="module")
def fencegate(tmp_path_factory):
    echo = Echo()
    d = tmp_path_factory.mktemp("websocket")
    up = f'upstream = "http://127.0.0.1:{echo.port}"'
    (d / "fencegate.toml").write_text(f"""
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
store = "{d / 'fences.redb'}"

[[routes]]
name = "live"
path_prefix = "/live"
{up}
websocket = true

[[routes]]
name = "fenced"
path_prefix = "/fenced"
{up}
websocket = true
write_methods = ["GET", "PUT"]

[[routes]]
name = "plain"
{up}
""")
    proc = subprocess.Popen([BIN, "--config", str(d / "fencegate.toml")],
                            stdout=subprocess.PIPE, stderr=open(d / "fencegate.log", "w"))
    fields = read_listening(proc, d / "fencegate.log")
    yield {"url": "ws://" + fields["proxy"], "echo": echo}
    proc.kill()
    proc.wait()
    echo.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_messages_go_both_ways_on_a_websocket_route(fencegate):
    async def talk():
        async with connect(fencegate["url"] + "/live/feed") as ws:
            replies = []
            for i in range(50):
                await ws.send(f"message {i}")
                replies.append(await ws.recv())
            await ws.send(b"\x00binary\xff")
            replies.append(await ws.recv())
            return replies

    replies = run(talk())
    assert replies == [f"message {i}" for i in range(50)] + [b"\x00binary\xff"]
    assert ("/live/feed", None) in fencegate["echo"].handshakes


def test_a_route_without_websocket_refuses_the_handshake(fencegate):
    with pytest.raises(websockets.exceptions.InvalidStatus) as err:
        run(connect(fencegate["url"] + "/other").__aenter__())
    resp = err.value.response
    assert resp.status_code == 501
    assert b"websocket = true" in resp.body
    assert all(path != "/other" for path, _ in fencegate["echo"].handshakes)


def test_a_handshake_that_is_a_write_is_fenced(fencegate):
    async def open_with(token):
        headers = {"X-Fence-Token": token} if token else {}
        async with connect(fencegate["url"] + "/fenced/doc", additional_headers=headers) as ws:
            await ws.send("hi")
            return await ws.recv()

    with pytest.raises(websockets.exceptions.InvalidStatus) as err:
        run(open_with(None))
    assert err.value.response.status_code == 428
    assert run(open_with("7")) == "hi"
    with pytest.raises(websockets.exceptions.InvalidStatus) as err:
        run(open_with("6"))
    assert err.value.response.status_code == 409
    assert [t for p, t in fencegate["echo"].handshakes if p == "/fenced/doc"] == ["7"]

"""gRPC through fencegate, end to end, with grpcio (`pip install grpcio`).

Starts a grpcio server with a unary write `/fence.Writer/Write` and a
server-streaming read `/fence.Writer/Watch` (raw bytes, no generated
stubs), starts fencegate in front of it (h2c both sides, the config of
docs/gateway.md's gRPC section), then:

1. writes with token 5: admitted;
2. writes with token 4: refused, ABORTED, with the highest token (5) in the
   trailing metadata, and never reaches the server;
3. reads the stream on the read-only route, with no token.

    cargo build --release
    python3 examples/grpc_writer.py      # FENCEGATE_BIN=... for another binary

Prints what each call got and exits non-zero if anything differs.
"""

import os
import pathlib
import subprocess
import sys
import tempfile
from concurrent import futures

import grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = os.environ.get("FENCEGATE_BIN", str(ROOT / "target" / "release" / "fencegate"))


def serve():
    """The gRPC server: what it applied, and its port."""
    applied = []

    def write(request, context):
        token = dict(context.invocation_metadata()).get("x-fence-token")
        applied.append((token, request))
        return b"applied " + request

    def watch(request, context):
        for i in range(3):
            yield b"event %d" % i

    handler = grpc.method_handlers_generic_handler("fence.Writer", {
        "Write": grpc.unary_unary_rpc_method_handler(write),
        "Watch": grpc.unary_stream_rpc_method_handler(watch),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=(handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, applied


def start_fencegate(d, upstream_port):
    config = d / "fencegate.toml"
    config.write_text(f"""
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
store = "{d / 'fences.redb'}"

[[routes]]
name = "watch"
path_prefix = "/fence.Writer/Watch"
upstream = "http://127.0.0.1:{upstream_port}"
upstream_http2 = true
write_methods = []

[[routes]]
name = "grpc"
upstream = "http://127.0.0.1:{upstream_port}"
upstream_http2 = true
key = "header:x-resource"
""")
    proc = subprocess.Popen([BIN, "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=open(d / "fencegate.log", "w"))
    # fencegate's first line: `listening proxy=ADDR admin=ADDR`.
    line = proc.stdout.readline().decode()
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    if "proxy" not in fields:
        proc.kill()
        sys.exit(f"fencegate did not start: {(d / 'fencegate.log').read_text()[-2000:]}")
    return proc, fields["proxy"]


def main():
    server, port, applied = serve()
    with tempfile.TemporaryDirectory() as tmp:
        proc, proxy = start_fencegate(pathlib.Path(tmp), port)
        try:
            with grpc.insecure_channel(proxy) as channel:
                write = channel.unary_unary("/fence.Writer/Write")
                reply = write(b"balance=10", metadata=[("x-resource", "acct-1"), ("x-fence-token", "5")],
                              timeout=10)
                print(f"token 5: {reply.decode()}")
                try:
                    write(b"balance=7", metadata=[("x-resource", "acct-1"), ("x-fence-token", "4")], timeout=10)
                    sys.exit("token 4 was admitted")
                except grpc.RpcError as e:
                    highest = dict(e.trailing_metadata()).get("x-fence-token-highest")
                    print(f"token 4: {e.code().name}: {e.details()} (highest {highest})")
                    if e.code() != grpc.StatusCode.ABORTED or highest != "5":
                        sys.exit("expected ABORTED with highest 5")
                events = list(channel.unary_stream("/fence.Writer/Watch")(b"", timeout=10))
                print(f"watch: {[ev.decode() for ev in events]}")
            print(f"the server applied: {applied}")
            if applied != [("5", b"balance=10")]:
                sys.exit("the server applied something else")
        finally:
            proc.kill()
            proc.wait()
            server.stop(None)


if __name__ == "__main__":
    main()

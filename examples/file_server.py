#!/usr/bin/env python3
"""A stand-in backend to try fencegate with: PUT stores the body as a file,
GET and HEAD serve it, DELETE removes it. Standard library only; no
authentication, no fencing of its own (that is fencegate's job).

    python3 examples/file_server.py 127.0.0.1:9000 ./uploads

Each request is logged on stderr with the `X-Fence-Token` it carried, so
you can watch which writes fencegate let through.
"""

import http.server
import pathlib
import sys
import urllib.parse


def handler(root):
    class Files(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def target(self):
            """The file a request path names, inside `root` (None outside)."""
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            file = (root / path.lstrip("/")).resolve()
            return file if file == root or root in file.parents else None

        def answer(self, status, body=b"", content_type="text/plain"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_PUT(self):  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            file = self.target()
            if file is None or file == root or file.is_dir():
                return self.answer(400, b"no file in that path\n")
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(body)
            self.answer(200, b"stored\n")

        def do_GET(self):  # noqa: N802
            file = self.target()
            if file is not None and file.is_dir():
                names = sorted(str(f.relative_to(file)) for f in file.rglob("*") if f.is_file())
                return self.answer(200, "".join(f"{n}\n" for n in names).encode())
            if file is None or not file.is_file():
                return self.answer(404, b"not found\n")
            self.answer(200, file.read_bytes(), "application/octet-stream")

        do_HEAD = do_GET

        def do_DELETE(self):  # noqa: N802
            file = self.target()
            if file is not None and file.is_file():
                file.unlink()
            self.answer(204)

        def log_message(self, fmt, *args):
            token = self.headers.get("X-Fence-Token", "-") if self.headers else "-"
            sys.stderr.write(f"{self.command} {self.path} token={token} {fmt % args}\n")

    return Files


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: file_server.py HOST:PORT DIRECTORY")
    host, _, port = sys.argv[1].rpartition(":")
    root = pathlib.Path(sys.argv[2]).resolve()
    root.mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer((host, int(port)), handler(root))
    print(f"serving {root} on http://{host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

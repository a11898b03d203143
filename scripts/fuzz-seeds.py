#!/usr/bin/env python3
"""Seeds the fuzz corpora (fuzz/corpus/TARGET) from the test suites' own
inputs: every string literal in the tests that is an HTTP request or
answer, a PROXY header, a request target or a token, and every TOML
configuration in the docs and examples. Run again after a suite grows;
files are named by their content's SHA-1, as libFuzzer names them, so a
seed already there is not written twice."""

import hashlib
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"

# A Rust string or byte-string literal (not raw strings).
LITERAL = re.compile(r'b?"((?:[^"\\]|\\.|\\\n)*)"', re.S)


def unescape(body):
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        n = body[i + 1]
        if n == "\n":  # a line continuation: the break and the indent go
            i += 2
            while i < len(body) and body[i] in " \t":
                i += 1
            continue
        simple = {"r": b"\r", "n": b"\n", "t": b"\t", "0": b"\0", "\\": b"\\", '"': b'"', "'": b"'"}
        if n in simple:
            out += simple[n]
            i += 2
        elif n == "x":
            out.append(int(body[i + 2 : i + 4], 16))
            i += 4
        elif n == "u":
            end = body.index("}", i)
            out += chr(int(body[i + 3 : end], 16)).encode()
            i = end + 1
        else:
            out += ("\\" + n).encode()
            i += 2
    return bytes(out)


def literals(paths):
    for p in paths:
        for m in LITERAL.finditer(p.read_text(errors="replace")):
            try:
                yield unescape(m.group(1))
            except (ValueError, IndexError):
                continue


def write(target, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    f = d / hashlib.sha1(data).hexdigest()
    if not f.exists():
        f.write_bytes(data)
        return 1
    return 0


def main():
    rs = sorted((ROOT / "tests").glob("*.rs")) + sorted((ROOT / "src").rglob("*.rs"))
    methods = re.compile(rb"^(GET|PUT|POST|DELETE|HEAD|PATCH|OPTIONS|CONNECT|MOVE|put) [^ ]+ HTTP/")
    counts = {}
    def add(t, data):
        counts[t] = counts.get(t, 0) + write(t, data)
    for lit in literals(rs):
        if methods.match(lit):
            add("request_head", lit)
        elif lit.startswith(b"HTTP/1."):
            # The response target takes a first byte: how many bytes each
            # read of the chunked decoder gets.
            add("response", b"\x07" + lit)
        elif lit.startswith(b"PROXY ") or lit.startswith(b"\r\n\r\n\0\r\nQUIT\n"):
            add("proxy_header", lit)
        elif lit.startswith(b"/") and b" " not in lit and len(lit) < 200:
            add("key", lit)
    # A version 2 header of each family, then a request after it.
    v2 = b"\r\n\r\n\0\r\nQUIT\n"
    after = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    add("proxy_header", v2 + b"\x21\x11\x00\x0c" + bytes([192, 0, 2, 1, 192, 0, 2, 2]) + b"\x30\x39\x01\xbb" + after)
    add("proxy_header", v2 + b"\x21\x21\x00\x24" + bytes(range(32)) + b"\x30\x39\x01\xbb" + after)
    add("proxy_header", v2 + b"\x20\x00\x00\x00" + after)
    add("proxy_header", b"PROXY TCP4 192.0.2.1 192.0.2.2 12345 443\r\n" + after)
    add("proxy_header", b"PROXY TCP6 2001:db8::1 2001:db8::2 12345 443\r\n" + after)
    add("proxy_header", b"PROXY UNKNOWN\r\n" + after)
    for tok in [b"0", b"7", b"18446744073709551615", b"18446744073709551616", b" 7\t", b"07", b"+7", b"7,8"]:
        add("credentials", tok)
    for toml in sorted(ROOT.glob("**/*.toml")):
        if "target" in toml.parts or toml.name in ("Cargo.toml",) or "fuzz" in toml.parts:
            continue
        add("config", toml.read_bytes())
    # The TOML blocks of the docs.
    for md in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for block in re.findall(r"```toml\n(.*?)```", md.read_text(), re.S):
            add("config", block.encode())
    for t, n in sorted(counts.items()):
        print(f"{t}: {n} new seeds", file=sys.stderr)


if __name__ == "__main__":
    main()

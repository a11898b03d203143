#!/usr/bin/env python3
"""Sums a perf profile's samples by kind of work: the kernel, the allocator,
http's header maps and values, its URIs, head parsing and writing, copies,
tokio, and the rest of fencegate's own code.

Usage: scripts/profile_kinds.py /tmp/perf.fg1.data
(from `REC=1 FREQ=4000 REC_SECS=3 scripts/profile.sh target/release/fencegate`).
Each sample is counted once, by the function it was taken in (no callers).
"""

import re
import subprocess
import sys
from collections import Counter

# First match wins.
KINDS = [
    ("kernel", lambda dso, sym: dso.startswith("[kernel")),
    ("allocator", lambda dso, sym: re.search(r"\bmi_|_mi_|malloc|free\b|__rust_(alloc|dealloc|realloc)", sym)),
    ("http header maps and values", lambda dso, sym: re.search(r"http::header|HeaderName|HeaderValue", sym)),
    ("http URIs", lambda dso, sym: re.search(r"http::uri|\bUri\b|PathAndQuery", sym)),
    ("http, other", lambda dso, sym: "http::" in sym),
    ("memory copies", lambda dso, sym: re.search(r"mem(move|cpy|set|cmp)", sym)),
    ("bytes (buffers)", lambda dso, sym: "bytes::" in sym),
    ("tokio", lambda dso, sym: "tokio" in sym),
    ("head parsing and writing", lambda dso, sym: "httparse" in sym or "fencegate::h1" in sym),
    ("metrics", lambda dso, sym: "prometheus" in sym),
    ("fencegate, other", lambda dso, sym: "fencegate::" in sym),
]


def main():
    report = subprocess.run(
        ["perf", "report", "-i", sys.argv[1], "--no-children", "--sort", "dso,symbol",
         "-g", "none", "--percent-limit", "0", "--stdio"],
        capture_output=True, text=True, check=True,
    ).stdout
    sums = Counter()
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)", line)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)), m.group(2), m.group(3).strip()
        kind = next((k for k, test in KINDS if test(dso, sym)), "other (libc, vdso, unnamed)")
        sums[kind] += pct
    for kind, pct in sums.most_common():
        print(f"{pct:6.2f} %  {kind}")


if __name__ == "__main__":
    main()

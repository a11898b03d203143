#!/usr/bin/env python3
"""Measures how many write+fsync cycles per second the disk under DIR does.

Usage: fsync_rate.py DIR [SECONDS]. Prints one number (fsyncs per second).
This is the ceiling for anything that makes every write durable on its own;
group commit is how fencegate's durable advances get past it.
"""
import os
import sys
import time

directory = sys.argv[1]
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
path = os.path.join(directory, "fsync-probe.tmp")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
block = b"x" * 4096
count = 0
deadline = time.monotonic() + seconds
try:
    while time.monotonic() < deadline:
        os.pwrite(fd, block, (count % 256) * 4096)
        os.fsync(fd)
        count += 1
finally:
    os.close(fd)
    os.unlink(path)
print(f"{count / seconds:.0f}")

"""The first stdout line of a starting fencegate, for the Python suites.

fencegate prints `listening proxy=ADDR admin=ADDR [tls=ADDR]` once every
listener is bound (`proxy=off` without a plain listener). Reading it in a
thread bounds the wait, so a fencegate that never prints cannot hang a
suite.
"""

import queue
import threading


def read_listening(proc, log_path, timeout=30):
    """The fields of the line (`proxy`, `admin`, maybe `tls`); kills `proc`
    and raises with the end of its log if it did not start."""
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline().decode()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        line = ""
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    if "admin" not in fields:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"fencegate did not start: {line!r}\n{open(log_path).read()[-3000:]}")
    return fields

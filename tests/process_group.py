"""Stopping a server the Python suites started in a process group of its
own (`start_new_session=True`), children included."""

import os
import signal
import subprocess


def stop_group(proc, grace=10):
    """Stops `proc` and everything left in its process group: SIGTERM,
    then SIGKILL if the leader is still there after `grace` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

"""The documentation's command blocks, run as written.

Every ```sh, ```bash and ```console block of README.md, docs/leases.md and
docs/gateway.md carries a marker on the line before it (an HTML comment,
invisible on GitHub):

    <!-- doc-test: SESSION [background] [ready=URL ...] -->
    <!-- doc-test: skip REASON -->

A block without one fails `test_every_command_block_is_run_or_says_why`,
so a new block cannot be left out silently.

A session's blocks run in document order, in a fresh directory that holds
the repository's tracked files (as a clone would, so `examples/...` and
`.ci/...` resolve), with `fencegate` on PATH as the release binary (the
docs say so) and `cargo run [-q] --release -- ARGS` running that binary:
building it is scripts/test's own first step, not the docs'.

- `background`: a server ("Terminal 1"): started on its own, stopped with
  its process group when the session ends; `ready=URL` waits (60 s at
  most) until a GET of URL answers 200, or else for the block's
  listening line / first port to accept.
- `sh` blocks run in one bash process per session, so variables and
  `export`s carry to later blocks; each runs under `set -eo pipefail`, so
  every command in it must succeed. A marked `python` block runs as
  `PYTHONPATH=examples python3 BLOCK`.
- `console` blocks: each `$ ` line (with `\\` continuations) is a command
  in that shell; the lines after it, up to the next `$ `, are its output
  (stdout and stderr), compared line by line. `...` in an expected line
  stands for any text (lease IDs, times). Their exit status is not
  checked (a refusal the docs show exits non-zero); their output is.

The ports are the docs' own (8080, 9090, 9091, 8333...): a session fails
at once, naming the port, if one is taken.
"""

import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from process_group import stop_group  # noqa: E402
DOCS = ["README.md", "docs/leases.md", "docs/gateway.md"]
FENCEGATE_BIN = pathlib.Path(os.environ.get("FENCEGATE_BIN", ROOT / "target" / "release" / "fencegate"))
COMMAND_LANGS = {"sh", "bash", "console"}
MARKER = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->")
COMMAND_TIMEOUT = 300


class Block:
    def __init__(self, doc, line, lang, text, marker):
        self.doc, self.line, self.lang, self.text, self.marker = doc, line, lang, text, marker
        words = shlex.split(marker) if marker else []
        self.skip = bool(words) and words[0] == "skip"
        self.session = None if self.skip or not words else words[0]
        self.background = "background" in words[1:]
        self.ready = [w[len("ready="):] for w in words[1:] if w.startswith("ready=")]
        unknown = [w for w in words[1:] if w != "background" and not w.startswith("ready=")]
        if not self.skip and unknown:
            raise ValueError(f"{self.where}: unknown marker words {unknown}")
        if self.background and not self.ready:
            raise ValueError(f"{self.where}: a background block needs ready=URL (what says it is up)")

    @property
    def where(self):
        return f"{self.doc}:{self.line}"


def blocks(doc):
    """The fenced blocks of `doc`, each with the marker on the last
    non-blank line before its opening fence."""
    out, fence, last = [], None, ""
    lines = (ROOT / doc).read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if fence is None:
            m = re.match(r"^(\s*)```(\w*)\s*$", line)
            if m:
                marker = MARKER.search(last)
                fence = (n, m.group(1), m.group(2), [], marker.group(1) if marker else None)
            elif line.strip():
                last = line
        elif line.strip() == "```":
            n0, indent, lang, body, marker = fence
            text = "\n".join(b[len(indent):] if b.startswith(indent) else b for b in body)
            out.append(Block(doc, n0, lang, text, marker))
            fence, last = None, ""
        else:
            fence[3].append(line)
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
SESSIONS = {}
for _b in ALL:
    if _b.session:
        SESSIONS.setdefault(_b.session, []).append(_b)


def test_every_command_block_is_run_or_says_why():
    unmarked = [b.where for b in ALL if b.lang in COMMAND_LANGS and b.marker is None]
    assert not unmarked, f"command blocks with no doc-test marker (run them, or `skip REASON`): {unmarked}"
    reasonless = [b.where for b in ALL if b.skip and len(b.marker.split()) < 3]
    assert not reasonless, f"skipped without a reason: {reasonless}"
    assert SESSIONS, "no block is run"


def join_continuations(text):
    return re.sub(r"\\\n\s*", " ", text)


def console_commands(text):
    """(command, expected output lines) for each `$ ` line of a console
    block."""
    out, cmd, expected, cont = [], None, [], False
    for line in text.splitlines():
        if cont:
            cmd += "\n" + line
            cont = line.endswith("\\")
        elif line.startswith("$ "):
            if cmd is not None:
                out.append((cmd, expected))
            cmd, expected, cont = line[2:], [], line.endswith("\\")
        elif cmd is not None:
            expected.append(line)
    if cmd is not None:
        out.append((cmd, expected))
    return out


def screen(output):
    """The lines a terminal shows: a carriage return (a progress line, as
    the aws CLI writes) is overwritten by what follows it."""
    return [line.rsplit("\r", 1)[-1] for line in output.split("\n")]


def matches(expected, actual):
    exp = [e.rstrip() for e in expected]
    act = [a.rstrip() for a in actual]
    while exp and not exp[-1]:
        exp.pop()
    while act and not act[-1]:
        act.pop()
    if len(exp) != len(act):
        return False
    for e, a in zip(exp, act):
        pattern = ".*".join(re.escape(part) for part in e.split("..."))
        if not re.fullmatch(pattern, a):
            return False
    return True


class Shell:
    """One bash for a session's blocks: variables and exports persist.
    Each command's output goes to a file; its status file says it ended."""

    def __init__(self, cwd, env, scratch):
        self.scratch, self.n = scratch, 0
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, cwd=cwd, env=env,
                                     text=True, start_new_session=True)

    def run(self, command, where):
        self.n += 1
        out, rc = self.scratch / f"out.{self.n}", self.scratch / f"rc.{self.n}"
        self.proc.stdin.write(f"{{\n{command}\n}} >{out} 2>&1 </dev/null\n"
                              f"echo $? >{rc}.tmp && mv {rc}.tmp {rc}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not rc.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"{where}: the shell exited ({self.proc.returncode}) during:\n{command}\n"
                            f"{out.read_text() if out.exists() else ''}")
            if time.monotonic() > deadline:
                pytest.fail(f"{where}: still running after {COMMAND_TIMEOUT} s:\n{command}")
            time.sleep(0.02)
        # newline="": a carriage return stays one (see `screen`).
        with open(out, newline="") as f:
            return int(rc.read_text()), f.read()

    def close(self):
        stop_group(self.proc)


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def wait_ready(block, proc, log, urls):
    deadline = time.monotonic() + 60
    for url in urls:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{block.where}: the background command exited ({proc.returncode}):\n"
                            f"{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{block.where}: {url} did not answer 200 within 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)


def prepare(work):
    """A directory with the repository's tracked files, and a bin dir with
    `fencegate` and the `cargo run` stand-in."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if not name:
            continue
        src, dst = ROOT / name, work / name
        if not src.is_file():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
        dst.chmod(src.stat().st_mode)
    bin_dir = work.parent / "bin"
    bin_dir.mkdir()
    (bin_dir / "fencegate").symlink_to(FENCEGATE_BIN)
    cargo = bin_dir / "cargo"
    cargo.write_text(
        "#!/usr/bin/env bash\n"
        "# `cargo run [-q] --release -- ARGS`: the release binary scripts/test built.\n"
        "args=(\"$@\")\n"
        "[[ ${args[0]} == run ]] || { echo \"doc-test cargo stand-in: only 'cargo run' ($*)\" >&2; exit 2; }\n"
        "i=1\n"
        "while [[ ${args[i]} == -q || ${args[i]} == --release ]]; do ((i++)); done\n"
        "[[ ${args[i]} == -- ]] && ((i++))\n"
        f"exec {FENCEGATE_BIN} \"${{args[@]:i}}\"\n")
    cargo.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("session", sorted(SESSIONS))
def test_session(session, tmp_path):
    assert FENCEGATE_BIN.exists(), f"no {FENCEGATE_BIN}: build it (cargo build --release), scripts/test does"
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = prepare(work)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    env.pop("FENCEGATE_CONFIG", None)
    ports = sorted({int(p) for b in SESSIONS[session] if b.background
                    for p in re.findall(r"(?:127\.0\.0\.1|0\.0\.0\.0):(\d+)", b.text + " ".join(b.ready))})
    taken = [p for p in ports if not port_free(p)]
    assert not taken, f"session {session} needs the docs' ports {taken}, which are in use on this machine"
    background, shell = [], Shell(work, env, scratch)
    try:
        for i, block in enumerate(SESSIONS[session]):
            if block.background:
                log = scratch / f"background.{i}.log"
                with open(log, "w") as f:
                    proc = subprocess.Popen(["bash", "-c", join_continuations(block.text)], cwd=work, env=env,
                                            stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                background.append(proc)
                wait_ready(block, proc, log, block.ready)
            elif block.lang == "console":
                for command, expected in console_commands(block.text):
                    _, output = shell.run(command, block.where)
                    assert matches(expected, screen(output)), (
                        f"{block.where}: `{command}` printed\n{output}\n--- the docs show ---\n"
                        + "\n".join(expected))
            else:
                if block.lang == "python":
                    # As the docs say to run it: examples on PYTHONPATH.
                    script = scratch / f"block.{i}.py"
                    script.write_text(block.text)
                    command = f"PYTHONPATH=examples python3 {script}"
                else:
                    # Every command must succeed, not only the last: a
                    # failing one ends the shell (and the session fails
                    # with its output).
                    script = scratch / f"block.{i}.sh"
                    script.write_text(block.text + "\n")
                    command = f"set -eo pipefail\n. {script}\nset +eo pipefail"
                rc, output = shell.run(command, block.where)
                assert rc == 0, f"{block.where}: exit status {rc}:\n{block.text}\n--- output ---\n{output}"
    finally:
        shell.close()
        for proc in background:
            stop_group(proc)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

#!/usr/bin/env python3
"""Keeps docs/contract.md honest: every test it names must exist.

Each row of the contract names the tests that check its promise, in
backticks. The forms understood:

  `hostile.rs::name`               tests/hostile.rs, `fn name`
  `src/key/tests.rs::name`         src/key/tests.rs, `fn name`
  `shared_stores.rs::*::name`      a test inside some module of the file
  `file.rs::module::name`          `mod module` (or a macro-made module
                                   `suite!(module, ...)`, or a pair
                                   `(module, ...)` in `suites!`) and
                                   `fn name`
  `src/token.rs`, `shared_stores.rs`   a whole file: it must exist
  `tests/s3/test_s3.py::test_x`    a pytest function, `def test_x`
  `test_s3.py::Class::test_x`      a pytest method: `class Class`, `def test_x`

A bare file name (no `/`) is looked up under tests/ (`hostile.rs` is
tests/hostile.rs); a bare Python file name may also live one directory
down (tests/s3, tests/recipes). src/ and tests/ paths are taken as given,
from the repository root; other paths from the root, else from tests/.
Placeholders such as `tests/<file>.rs::<test>` are not references.

Usage: scripts/check_contract.py [CONTRACT.md]   (default docs/contract.md)
Exits 1 listing each dangling reference with its line in the contract.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A backticked span that names a .rs or .py file, optionally followed by
# `::`-separated components (identifiers, or `*` for any module).
REF = re.compile(r"^(?P<file>[A-Za-z0-9_./-]+\.(?:rs|py))(?P<rest>(?:::(?:[A-Za-z_][A-Za-z0-9_]*|\*))*)$")
SPAN = re.compile(r"`([^`\n]+)`")


def references(text):
    """(line number, reference) for every test reference in the text."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for span in SPAN.findall(line):
            span = span.strip()
            if REF.match(span):
                out.append((lineno, span))
    return out


def resolve(path):
    """The file a reference names, or (None, why)."""
    if os.path.isabs(path) or ".." in path.split("/"):
        return None, "file path must be relative to the repository"
    if "/" not in path:
        candidates = [os.path.join("tests", path)]
    elif path.startswith(("src/", "tests/")):
        candidates = [path]
    else:
        candidates = [path, os.path.join("tests", path)]
    for c in candidates:
        if os.path.isfile(os.path.join(ROOT, c)):
            return c, None
    if "/" not in path and path.endswith(".py"):
        tests = os.path.join(ROOT, "tests")
        found = sorted(
            os.path.join("tests", d, path)
            for d in (os.listdir(tests) if os.path.isdir(tests) else [])
            if os.path.isfile(os.path.join(tests, d, path))
        )
        if len(found) == 1:
            return found[0], None
        if len(found) > 1:
            return None, "ambiguous file name: " + ", ".join(found)
    return None, "no such file (looked for %s)" % ", ".join(candidates)


def code_lines(source, comment):
    """The source without whole-line comments (a commented-out test does
    not count)."""
    return "\n".join(l for l in source.splitlines() if not l.lstrip().startswith(comment))


def check_rust(source, parts):
    src = code_lines(source, "//")
    *modules, name = parts
    for m in modules:
        if m == "*":
            continue
        mod_def = re.search(r"\bmod\s+%s\b" % re.escape(m), src)
        macro_mod = re.search(r"\w!\s*[({\[]\s*%s\s*," % re.escape(m), src)
        # `suites!([(module, store), ...], [cases])`: one module per pair.
        macro_mod = macro_mod or re.search(r"[\[,]\s*\(\s*%s\s*," % re.escape(m), src)
        if not (mod_def or macro_mod):
            return "no `mod %s` in the file" % m
    if not re.search(r"\bfn\s+%s\s*[(<]" % re.escape(name), src):
        return "no `fn %s` in the file" % name
    return None


def check_python(source, parts):
    src = code_lines(source, "#")
    *classes, name = parts
    for c in classes:
        if c == "*":
            continue
        if not re.search(r"^\s*class\s+%s\b" % re.escape(c), src, re.M):
            return "no `class %s` in the file" % c
    if not re.search(r"^\s*(?:async\s+)?def\s+%s\s*\(" % re.escape(name), src, re.M):
        return "no `def %s` in the file" % name
    return None


def check(ref):
    """None when the reference holds, else why it dangles."""
    m = REF.match(ref)
    path, rest = m.group("file"), m.group("rest")
    parts = [p for p in rest.split("::") if p]
    found, why = resolve(path)
    if found is None:
        return why
    if not parts:
        return None  # a whole file
    if parts[-1] == "*":
        return "a reference must end in a test name, not `*`"
    with open(os.path.join(ROOT, found), encoding="utf-8") as f:
        source = f.read()
    if path.endswith(".rs"):
        return check_rust(source, parts)
    return check_python(source, parts)


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1] in ("-h", "--help")):
        print(__doc__.strip())
        return 2
    contract = argv[1] if len(argv) == 2 else os.path.join(ROOT, "docs", "contract.md")
    try:
        with open(contract, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        print("check_contract: cannot read %s: %s" % (contract, e), file=sys.stderr)
        return 2
    shown = argv[1] if len(argv) == 2 else "docs/contract.md"
    refs = references(text)
    dangling = [(n, r, why) for n, r in refs for why in [check(r)] if why]
    for n, r, why in dangling:
        print("%s:%d: `%s`: %s" % (shown, n, r, why), file=sys.stderr)
    if not refs:
        print("check_contract: no test references found in %s" % shown, file=sys.stderr)
        return 1
    print(
        "check_contract: %d test references (%d distinct) checked in %s, %d dangling"
        % (len(refs), len({r for _, r in refs}), shown, len(dangling))
    )
    return 1 if dangling else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

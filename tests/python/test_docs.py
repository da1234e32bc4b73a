# SPDX-License-Identifier: MIT
"""The documents' examples run (issue 34): every C and Python code block of
README.md and docs/*.md marked runnable is compiled and run against a real
daemon, so an example that stops compiling, warns, fails or prints something
else fails here, naming the file and line. The convention is
docs/README.md's:

    <!-- runnable -->              the next fenced ```c or ```python block is a
    <!-- runnable ranks=N -->      whole program, run as N rank processes
                                   (default 1) with RANK, WORLD_SIZE,
                                   LOCAL_RANK, TORCHELASTIC_RUN_ID (the job) and
                                   SHARDD_SOCKET set, as torchrun would
    <!-- output -->                (after the block) the next fenced block is
                                   what rank 0 prints, exactly

C blocks compile with -Wall -Wextra -Werror against client/shardd.h and the
built libshardd; Python blocks run on this interpreter with the client
on PYTHONPATH. Each program runs twice in a row on the same daemon: a
program that leaves its job behind (no shardd_close) makes the second run's
registration fail, as it would for a user running it again."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, shardd_build

RUN_TIMEOUT_S = 120
MARKER = re.compile(r"^<!-- runnable(?: ranks=(\d+))? -->$")
OUTPUT = "<!-- output -->"


class Example:
    def __init__(self, path, line, lang, code, ranks, output):
        self.path, self.line, self.lang, self.code = path, line, lang, code
        self.ranks, self.output = ranks, output

    @property
    def where(self):
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def fenced(lines, i, path):
    """The fenced block starting at lines[i]: (language, text, index after it)."""
    m = re.match(r"^```(\w*)$", lines[i]) if i < len(lines) else None
    if not m:
        raise AssertionError(f"{path}:{i + 1}: a runnable or output marker must be followed "
                             f"by a fenced block, found {lines[i] if i < len(lines) else 'EOF'!r}")
    for j in range(i + 1, len(lines)):
        if lines[j] == "```":
            return m.group(1), "\n".join(lines[i + 1:j]) + "\n", j + 1
    raise AssertionError(f"{path}:{i + 1}: unterminated fenced block")


def examples_of(path):
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        marker_line = i + 1
        lang, code, i = fenced(lines, i + 1, path)
        assert lang in ("c", "python"), \
            f"{path}:{marker_line}: runnable block of language {lang!r}, not c or python"
        output = None
        if i < len(lines) and lines[i] == OUTPUT:
            _, output, i = fenced(lines, i + 1, path)
        found.append(Example(path, marker_line, lang, code, int(m.group(1) or 1), output))
    return found


def all_examples():
    docs = os.path.join(ROOT, "docs")
    paths = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))
    return [e for p in paths for e in examples_of(p)]


EXAMPLES = all_examples()


def test_the_readme_has_a_runnable_example_per_client():
    """C, the Python client and shardd.torch: without this the suite below
    could pass by having nothing to run."""
    readme = [e for e in EXAMPLES if os.path.basename(e.path) == "README.md"]
    assert any(e.lang == "c" for e in readme), "README.md has no runnable C example"
    assert any(e.lang == "python" and "shardd.torch" in e.code for e in readme), \
        "README.md has no runnable shardd.torch example"
    assert any(e.lang == "python" and "shardd.torch" not in e.code for e in readme), \
        "README.md has no runnable Python client example"


def build(example, tmp):
    """The command that runs the example (compiling a C one first)."""
    if example.lang == "python":
        src = os.path.join(tmp, "example.py")
        with open(src, "w") as f:
            f.write(example.code)
        return [sys.executable, src]
    src, exe = os.path.join(tmp, "example.c"), os.path.join(tmp, "example")
    with open(src, "w") as f:
        f.write(example.code)
    # The static library: the build tree has libshardd.so but not its soname link.
    build_dir = shardd_build()
    lib = os.path.join(build_dir, "libshardd.a")
    # A sanitizer build's library (make SANITIZE=1 test) needs its runtimes in the program.
    sanitize = ["-fsanitize=address,undefined"] if os.path.basename(os.path.abspath(build_dir)) \
        == "build-san" else []
    cc = subprocess.run(["cc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *sanitize,
                         "-I", os.path.join(ROOT, "client"), "-I", os.path.join(ROOT, "proto"),
                         src, "-o", exe, lib, "-lpthread", "-lm"],
                        capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert cc.returncode == 0, f"{example.where}: the example does not compile cleanly:\n{cc.stderr}"
    return [exe]


def run_ranks(example, cmd, daemon, job):
    env = {**os.environ, "SHARDD_SOCKET": daemon.socket, "WORLD_SIZE": str(example.ranks),
           "TORCHELASTIC_RUN_ID": job,
           "PYTHONPATH": os.path.join(ROOT, "client", "python")}
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(example.ranks)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{example.where}: rank {r} ran past {RUN_TIMEOUT_S} s")
        outs.append((p.returncode, out, err))
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"{example.where}: rank {r} exited {rc}:\nstdout:\n{out}\nstderr:\n{err}"
    return outs[0][1]


@pytest.mark.timeout_s(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_example_runs(example, daemon, tmp_path, request):
    cmd = build(example, str(tmp_path))
    job = f"docs-{os.getpid()}-{example.line}"
    for attempt in ("first", "second"):
        out = run_ranks(example, cmd, daemon, job)
        if example.output is not None:
            assert out == example.output, \
                f"{example.where}: the {attempt} run's rank 0 printed\n{out}\nnot the document's\n{example.output}"


def test_every_relative_link_of_the_documents_names_a_file_that_exists():
    """A guide moved or renamed leaves no link to nothing behind it."""
    docs = os.path.join(ROOT, "docs")
    paths = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))
    broken, checked = [], 0
    for p in paths:
        with open(p, encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            checked += 1
            if not os.path.exists(os.path.join(os.path.dirname(p), target.split("#")[0])):
                broken.append(f"{os.path.relpath(p, ROOT)}: {target}")
    assert checked > 20, f"only {checked} relative links found: the pattern misses them"
    assert broken == [], f"links to files that do not exist: {broken}"

# SPDX-License-Identifier: MIT
"""Fixtures for the Python client suites: a real shardd per test module, a
per-test timeout (signal.alarm: pytest-timeout is not in Debian's default
install), and a helper that runs one thread per rank with a join timeout."""

import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

DEFAULT_TIMEOUT_S = 60
READY_TIMEOUT_S = 15


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout_s(n): fail the test after n seconds")


def shardd_bin():
    path = os.environ.get("SHARDD_BIN") or os.path.join(ROOT, "build", "shardd")
    if not os.access(path, os.X_OK):
        pytest.fail(f"shardd binary {path} not found: build it (make) or set SHARDD_BIN")
    return path


def shardd_build():
    return os.environ.get("SHARDD_BUILD") or os.path.join(ROOT, "build")


class Daemon:
    """A shardd process on a temporary socket; stderr is collected."""

    def __init__(self, extra_args=()):
        self.dir = tempfile.TemporaryDirectory(prefix="shardd-py-")
        self.socket = os.path.join(self.dir.name, "shardd.sock")
        self.lines = []
        self.proc = subprocess.Popen(
            [shardd_bin(), "--socket", self.socket, "--foreground", "--log-level", "warn",
             "--collective-timeout", "20", *extra_args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        want = f"shardd: ready on {self.socket}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                pytest.fail(f"shardd did not print {want!r} within {READY_TIMEOUT_S} s; "
                            f"stderr: {buf.decode(errors='replace')!r}")
            r, _, _ = select.select([self.proc.stderr], [], [], left)
            if not r:
                continue
            chunk = os.read(self.proc.stderr.fileno(), 4096)
            if not chunk:
                rc = self.proc.wait(timeout=10)
                pytest.fail(f"shardd exited with {rc} before it was ready; "
                            f"stderr: {buf.decode(errors='replace')!r}")
            buf += chunk
            if want.encode() in buf:
                break
        self.lines.extend(buf.decode(errors="replace").splitlines())
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.dir.cleanup()


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    yield d
    d.stop()


class TestTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def _per_test_timeout(request):
    marker = request.node.get_closest_marker("timeout_s")
    seconds = marker.args[0] if marker else DEFAULT_TIMEOUT_S

    def expired(_sig, _frame):
        raise TestTimeout(f"{request.node.name} ran past its {seconds} s timeout")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def job_name(request):
    """A job name unique to the test."""
    return request.node.name[:48] + f"-{os.getpid() % 10000}"


def run_ranks(fn, n, timeout=40):
    """Run fn(rank) for rank in 0..n-1, one thread each; return the results in
    rank order, re-raising the first exception. Threads are joined with a
    timeout so a stuck rank fails the test instead of hanging it."""
    results = [None] * n
    errors = [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # reported to the caller below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for r, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise TimeoutError(f"rank {r} did not finish within {timeout} s")
    for e in errors:
        if e is not None:
            raise e
    return results

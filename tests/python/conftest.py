# SPDX-License-Identifier: MIT
"""Fixtures and helpers for the Python client suites: a real shardd per
test module (plain, or with a --state-dir), a per-test timeout
(signal.alarm: pytest-timeout is not in Debian's default install), a helper
that runs one thread per rank with a join timeout, a World of daemons under
mpirun for jobs across nodes, the clients of a test's job attached (on a
World, each to its node's daemon) and closed on the way out, and shardctl's
JSON views of a daemon."""

import contextlib
import json
import os
import re
import select
import shutil
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


class _Stderr:
    """A process whose stderr is read until it says it is ready, then
    collected in self.lines by a thread."""

    def _await_ready(self, ready, timeout, late, exited):
        """self.proc's stderr until ready(the bytes so far), within timeout s;
        then collected. Fails the test with `late` (after self.stop()) when the
        time runs out, or with `exited` (a format of rc) when the process ends
        first, each followed by the stderr read. Returns the text read."""
        deadline = time.monotonic() + timeout
        buf = b""
        while not ready(buf):
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                pytest.fail(f"{late}; stderr: {buf.decode(errors='replace')!r}")
            r, _, _ = select.select([self.proc.stderr], [], [], left)
            if not r:
                continue
            chunk = os.read(self.proc.stderr.fileno(), 65536)
            if not chunk:
                rc = self.proc.wait(timeout=10)
                pytest.fail(f"{exited.format(rc=rc)}; stderr: {buf.decode(errors='replace')!r}")
            buf += chunk
        text = buf.decode(errors="replace")
        self.lines.extend(text.splitlines())
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()
        return text

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def rank_exec_args():
    """exec=auto is the daemon's in these daemons, whatever shardd's default:
    `make test-python` runs the numerics suites a second time with their small
    groups rank-executed (SHARDD_TEST_RANK_EXEC_MAX=4M: shardd --rank-exec-max),
    as make test-c does with tests/lib/harness.c: both executors pass the same
    tests. Given before a test's own arguments, which win."""
    return ("--rank-exec-max", os.environ.get("SHARDD_TEST_RANK_EXEC_MAX", "0"))


class Daemon(_Stderr):
    """A shardd process on a temporary socket; stderr is collected."""

    def __init__(self, extra_args=()):
        self.dir = tempfile.TemporaryDirectory(prefix="shardd-py-")
        self.socket = os.path.join(self.dir.name, "shardd.sock")
        self.lines = []
        self.proc = subprocess.Popen(
            [shardd_bin(), "--socket", self.socket, "--foreground", "--log-level", "warn",
             "--collective-timeout", "20", *rank_exec_args(), *extra_args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "SHARDD_LOOP_WATCHDOG_MS": str(LOOP_WATCHDOG_MS)})
        want = f"shardd: ready on {self.socket}"
        self._await_ready(lambda buf: want.encode() in buf, READY_TIMEOUT_S,
                          f"shardd did not print {want!r} within {READY_TIMEOUT_S} s",
                          "shardd exited with {rc} before it was ready")

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


@pytest.fixture(scope="module")
def state_daemon():
    """A shardd with --state-dir (its path in .state), for checkpoints."""
    state = tempfile.TemporaryDirectory(prefix="shardd-py-state-")
    with Daemon(("--state-dir", state.name)) as d:
        d.state = state.name
        yield d
    state.cleanup()


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


WORLD_TIMEOUT_S = 4          # --collective-timeout of a World's daemons
WORLD_READY_TIMEOUT_S = 60   # mpirun's start on a loaded 2-core machine
# The event loop's watchdog (daemon/core/loop.c) in every daemon of the suite:
# a callback over this logs, naming it; in a World's daemons one that waited aborts.
LOOP_WATCHDOG_MS = 100

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="mpirun (openmpi-bin) is not installed: make deps")


class World(_Stderr):
    """`nodes` shardd daemons under one mpirun (`--world mpi`, docs/MULTINODE.md),
    node k on socket dir/node.k, with a collective timeout of timeout_s and the
    loop watchdog aborting on a wait; a context manager that stops them on exit."""

    def __init__(self, nodes, extra_args=(), timeout_s=WORLD_TIMEOUT_S):
        self.nodes = nodes
        self.dir = tempfile.TemporaryDirectory(prefix="shardd-world-")
        self.lines = []
        self.pids = {}
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        # Survivors keep running when a daemon dies (the failure tests kill one).
        cmd = ["mpirun", *root, "--oversubscribe", "--mca", "btl", "tcp,self",
               "--mca", "orte_enable_recovery", "1", "--mca", "orte_abort_on_non_zero_status", "0",
               "-x", f"SHARDD_LOOP_WATCHDOG_MS={LOOP_WATCHDOG_MS}", "-x", "SHARDD_LOOP_WATCHDOG_ABORT=1",
               "-np", str(nodes), "sh", "-c",
               'd="$1"; shift; exec "$0" --world mpi --socket "$d/node.$OMPI_COMM_WORLD_RANK" '
               f'--collective-timeout {timeout_s:g} --log-level info "$@"',
               shardd_bin(), self.dir.name, *extra_args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        text = self._await_ready(self._ready, WORLD_READY_TIMEOUT_S,
                                 f"{nodes} daemons were not ready within {WORLD_READY_TIMEOUT_S} s",
                                 "mpirun exited with {rc} before the daemons were ready")
        for m in re.finditer(r"shardd\[(\d+)\] info: world: node (\d+) of (\d+) nodes", text):
            assert int(m.group(3)) == nodes
            self.pids[int(m.group(2))] = int(m.group(1))
        assert sorted(self.pids) == list(range(nodes)), text

    def _ready(self, buf):
        return all(f"shardd: ready on {self.socket(k)}".encode() in buf for k in range(self.nodes))

    def wait_gone(self, node, timeout=10):
        """Until node's daemon has exited (a zombie of mpirun's counts): the
        kernel gives no other notice to a process that is not its parent."""
        pid = self.pids[node]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        return
            except FileNotFoundError:
                return
            time.sleep(0.01)
        pytest.fail(f"node {node}'s daemon (pid {pid}) did not exit within {timeout} s of SIGKILL")

    def socket(self, node):
        return os.path.join(self.dir.name, f"node.{node}")

    def stop(self):
        # captured by pytest, shown when the test failed: what the daemons said
        print("\n".join(self.lines[-60:]))
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.dir.cleanup()


def attach(server, request, rank, replicate, shard, suffix="", **kw):
    """Rank `rank` of mesh replicate x shard of the test's job (its name and
    `suffix`) on `server`: a World (the daemon of the rank's node) or a
    Daemon; kw to shardd.Client."""
    import shardd  # here, not at the top: conftest serves suites that run without the client
    if isinstance(server, World):
        socket = server.socket(rank // (replicate * shard // server.nodes))
    else:
        socket = server.socket
    return shardd.Client(job=job_name(request) + suffix, rank=rank, shard=shard, replicate=replicate,
                         socket_path=socket, **kw)


@contextlib.contextmanager
def attached(request, server, replicate, shard, ranks=None, suffix=""):
    """The clients of `ranks` (every rank of the mesh by default) attached as
    attach() does, in rank order; each one attached is closed on exit."""
    clients = []
    try:
        for r in range(replicate * shard) if ranks is None else ranks:
            clients.append(attach(server, request, r, replicate, shard, suffix))
        yield clients
    finally:
        for c in clients:
            c.close()


def run_shardctl(socket, *args):
    """shardctl --socket socket args..., its output captured as text."""
    return subprocess.run([os.path.join(shardd_build(), "shardctl"), "--socket", socket, *args],
                          capture_output=True, text=True, timeout=30)


def shardctl_json(socket, *args):
    """The parsed output of `shardctl --json args...` on socket, which must succeed."""
    out = run_shardctl(socket, "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)

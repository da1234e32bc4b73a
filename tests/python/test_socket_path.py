# SPDX-License-Identifier: MIT
"""One control-socket path everywhere: the daemon, shardctl (and libshardd)
resolve it with proto/shardd_socket.h, the Python client with its mirror
default_socket_path(). A real shardd started with only $XDG_RUNTIME_DIR
listens where shardctl and the Python client look; $SHARDD_SOCKET moves the
clients and not the daemon."""

import os
import select
import subprocess
import tempfile
import time

import pytest

from shardd.client import Client, default_socket_path

from conftest import job_name, shardd_bin, shardd_build

READY_TIMEOUT_S = 15


def start_daemon(env):
    """shardd with no --socket under env; returns (process, the path it printed)."""
    proc = subprocess.Popen([shardd_bin(), "--foreground", "--log-level", "warn"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    buf = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while b"shardd: ready on " not in buf or not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            stop(proc)
            pytest.fail(f"shardd did not print 'shardd: ready on PATH' within "
                        f"{READY_TIMEOUT_S} s: {buf.decode(errors='replace')!r}")
        r, _, _ = select.select([proc.stderr], [], [], left)
        if r:
            buf += os.read(proc.stderr.fileno(), 4096)
    line = [ln for ln in buf.decode().splitlines() if ln.startswith("shardd: ready on ")][0]
    return proc, line[len("shardd: ready on "):]


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def shardctl(env):
    return subprocess.run([os.path.join(shardd_build(), "shardctl"), "status"], env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
def xdg(monkeypatch):
    with tempfile.TemporaryDirectory(prefix="shardd-xdg-") as d:
        monkeypatch.setenv("XDG_RUNTIME_DIR", d)
        monkeypatch.delenv("SHARDD_SOCKET", raising=False)
        yield d


def test_daemon_shardctl_and_python_client_agree_on_the_xdg_default(xdg, request):
    want = os.path.join(xdg, "shardd", "shardd.sock")
    proc, path = start_daemon(dict(os.environ))
    try:
        assert path == want
        assert default_socket_path() == want
        ctl = shardctl(dict(os.environ))
        assert ctl.returncode == 0, ctl.stderr
        assert want in ctl.stdout
        c = Client(job_name(request), rank=0, shard=1)
        c.close()
    finally:
        stop(proc)


def test_shardd_socket_moves_the_clients_and_not_the_daemon(xdg, monkeypatch):
    moved = os.path.join(xdg, "elsewhere.sock")
    monkeypatch.setenv("SHARDD_SOCKET", moved)
    proc, path = start_daemon(dict(os.environ))
    try:
        assert path == os.path.join(xdg, "shardd", "shardd.sock")
        assert default_socket_path() == moved
        ctl = shardctl(dict(os.environ))
        assert ctl.returncode == 1
        assert f"no shardd at {moved} " in ctl.stderr
    finally:
        stop(proc)

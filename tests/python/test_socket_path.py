# SPDX-License-Identifier: MIT
"""One control-socket path everywhere: the daemon, shardctl (and libshardd)
resolve it with proto/shardd_socket.h, the Python client with its mirror
default_socket_path(). A real shardd started with only $XDG_RUNTIME_DIR
listens where shardctl and the Python client look; $SHARDD_SOCKET moves the
clients and not the daemon."""

import os
import subprocess
import tempfile

import pytest

from shardd import launch
from shardd.client import Client, default_socket_path
from shardd.launch import stop

from conftest import job_name, shardd_bin, shardd_build

READY_TIMEOUT_S = 15


def start_daemon(env):
    """shardd with no --socket under env; returns (process, the path it printed)."""
    try:
        proc, path, _text = launch.start_daemon([shardd_bin(), "--foreground", "--log-level", "warn"],
                                                env=env, timeout_s=READY_TIMEOUT_S)
    except launch.DaemonStartError as e:
        pytest.fail(str(e))
    return proc, path


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


def test_daemon_started_right_after_a_sigkill_takes_over_the_socket(tmp_path):
    """A daemon killed with SIGKILL leaves its socket behind, and for a moment
    the kernel's teardown of its io_uring keeps the socket listening, so a
    connect still succeeds. A daemon started at once on the same path (a
    supervisor's restart) must see that the listener's process is gone and
    take the path over, rather than refuse with 'another daemon already
    serves'. 20 rounds: the old check refused within them in every run here."""
    sock = str(tmp_path / "shardd.sock")
    argv = [shardd_bin(), "--foreground", "--log-level", "info", "--socket", sock]
    for rnd in range(20):
        try:
            proc, path, _text = launch.start_daemon(argv, timeout_s=READY_TIMEOUT_S, socket=sock)
        except launch.DaemonStartError as e:
            pytest.fail(f"round {rnd}: {e}")
        assert path == sock
        proc.kill()
        proc.wait(timeout=10)
        assert os.path.exists(sock), "a SIGKILLed daemon cannot unlink its socket"
    proc, _path, _text = launch.start_daemon(argv, timeout_s=READY_TIMEOUT_S, socket=sock)
    stop(proc)

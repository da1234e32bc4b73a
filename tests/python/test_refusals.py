# SPDX-License-Identifier: MIT
"""Refusals reach the Python client as the daemon's text, never as EPIPE or
ECONNRESET. Two races are staged exactly with a stand-in daemon (a plain
listening socket): the refusal and close before the client's HELLO is sent
(the send fails with EPIPE), and after it arrived but before it was read
(the kernel reports ECONNRESET before handing over the ERROR). Against the
real shardd, a client running as uid 65534 is refused at accept over and
over, and its connect() EACCES names the socket's owner and the flag that
fixes it (those need root to switch uid; skipped otherwise)."""

import os
import select
import socket
import subprocess
import sys
import threading

import pytest

import shardd.client as client_mod
from shardd import proto as P
from shardd.client import Client, ShardError

from conftest import ROOT

NOBODY = 65534
REFUSAL = "uid 4242 is not allowed: shardd runs as uid 0"


def _error_datagram(code, text):
    body = text.encode()
    return (P.MSG_HDR.pack(P.MAGIC, P.MSG_ERROR, 0, P.ERROR_MSG.size + len(body), 0)
            + P.ERROR_MSG.pack(code, len(body)) + body)


class StandIn:
    """A listening socket that refuses its one client with an ERROR and
    closes: before the client sends (refuse_before_send) or once the HELLO
    has arrived, leaving it unread."""

    def __init__(self, path, refuse_before_send):
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(1)
        self.refused = threading.Event()
        self.failure = None
        self.before = refuse_before_send
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            r, _, _ = select.select([self.listener], [], [], 10)
            if not r:
                self.failure = "no client connected within 10 s"
                return
            conn, _ = self.listener.accept()
            if not self.before:
                r, _, _ = select.select([conn], [], [], 10)
                if not r:
                    self.failure = "the client sent no HELLO within 10 s"
                    conn.close()
                    return
            conn.send(_error_datagram(-P.E_PERM, REFUSAL))
            conn.close()
        finally:
            self.refused.set()
            self.listener.close()


def _connect_after_refusal(stand_in):
    """A socket class whose connect() returns only once the stand-in has
    refused and closed: the client's HELLO then meets a closed peer."""
    real = socket.socket

    class Held(real):
        def connect(self, addr):
            super().connect(addr)
            assert stand_in.refused.wait(10), "the stand-in never refused"

    return Held


@pytest.mark.timeout_s(30)
def test_refusal_closed_before_the_hello_is_sent_raises_the_daemon_text(tmp_path, monkeypatch):
    stand_in = StandIn(str(tmp_path / "s.sock"), refuse_before_send=True)
    monkeypatch.setattr(client_mod.socket, "socket", _connect_after_refusal(stand_in))
    with pytest.raises(ShardError) as e:
        Client("j", 0, 1, socket_path=stand_in.path, timeout=5)
    assert stand_in.failure is None, stand_in.failure
    assert e.value.code == -P.E_PERM, e.value
    assert REFUSAL in e.value.text


@pytest.mark.timeout_s(30)
def test_refusal_with_the_hello_unread_raises_the_daemon_text(tmp_path):
    stand_in = StandIn(str(tmp_path / "s.sock"), refuse_before_send=False)
    with pytest.raises(ShardError) as e:
        Client("j", 0, 1, socket_path=stand_in.path, timeout=5)
    assert stand_in.failure is None, stand_in.failure
    assert e.value.code == -P.E_PERM, e.value
    assert REFUSAL in e.value.text


def _as_nobody(code):
    """Run `code` (Python) as uid/gid 65534 with the client importable; its output."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    r = subprocess.run([sys.executable, "-c", code], user=NOBODY, group=NOBODY,
                       extra_groups=[], env=env, capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as uid 65534")


@needs_root
@pytest.mark.timeout_s(90)
def test_uid_refusal_text_is_raised_every_time(daemon):
    os.chmod(daemon.dir.name, 0o711)
    os.chmod(daemon.socket, 0o777)
    rc, out = _as_nobody(f"""
from shardd import proto as P
from shardd.client import Client, ShardError
for i in range(100):
    try:
        Client("nobody", 0, 1, socket_path={daemon.socket!r}, timeout=5)
    except ShardError as e:
        assert e.code == -P.E_PERM and "uid 65534 is not allowed" in e.text, (i, e)
    else:
        raise AssertionError("attempt %d was not refused" % i)
print("refused 100 times")
""")
    assert rc == 0 and "refused 100 times" in out, out


@needs_root
@pytest.mark.timeout_s(60)
def test_eacces_names_the_socket_owner_and_the_flag(daemon):
    os.chmod(daemon.dir.name, 0o711)
    os.chmod(daemon.socket, 0o755)
    try:
        rc, out = _as_nobody(f"""
from shardd.client import Client, ShardError
try:
    Client("denied", 0, 1, socket_path={daemon.socket!r}, timeout=5)
except ShardError as e:
    print(e)
""")
    finally:
        os.chmod(daemon.socket, 0o777)
    assert rc == 0, out
    for needle in ("the socket belongs to uid 0 gid 0, mode 0755", "runs as uid 65534 gid 65534",
                   "--allow-gid 65534", "group-accessible", "EACCES"):
        assert needle in out, out

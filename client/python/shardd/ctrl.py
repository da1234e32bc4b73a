# SPDX-License-Identifier: MIT
"""Control-plane framing (proto/shardd_ctrl.h) over an AF_UNIX SOCK_SEQPACKET
socket: a message is a struct shardd_msg_hdr and `length` payload bytes split
into datagrams of at most SHARDD_CTRL_CHUNK bytes; fds ride on the first."""

import array
import errno
import os
import resource
import select
import socket
import time

from . import proto as P


class CtrlError(Exception):
    """Framing failure; .code is -errno or -SHARDD_E_*."""

    def __init__(self, code, text):
        super().__init__(text)
        self.code = code


def send_msg(sock, mtype, seq, payload=b"", fds=()):
    """shardd_ctrl_send."""
    payload = bytes(payload)
    if len(payload) > P.CTRL_MAX:
        raise CtrlError(-errno.EMSGSIZE, f"control payload of {len(payload)} bytes is over "
                                         f"the {P.CTRL_MAX}-byte limit")
    if len(fds) > P.CTRL_MAX_FDS:
        raise CtrlError(-errno.EINVAL, f"{len(fds)} fds, at most {P.CTRL_MAX_FDS}")
    hdr = P.MSG_HDR.pack(P.MAGIC, mtype, 0, len(payload), seq)
    first = P.CTRL_CHUNK - len(hdr)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    _sendmsg(sock, [hdr, payload[:first]], anc)
    pos = first
    while pos < len(payload):
        _sendmsg(sock, [payload[pos:pos + P.CTRL_CHUNK]], [])
        pos += P.CTRL_CHUNK


def _sendmsg(sock, bufs, anc):
    try:
        sock.sendmsg(bufs, anc, socket.MSG_NOSIGNAL)
    except OSError as e:
        raise CtrlError(-(e.errno or errno.EIO), f"send on the control socket: {e.strerror}") from None


def _close_all(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _recv_dgram(sock):
    """One datagram and its fds; b'' on EOF (shardd_ctrl_recv_dgram). No fd
    that came is left open when it raises."""
    fd_space = socket.CMSG_SPACE(P.CTRL_MAX_FDS * array.array("i").itemsize)
    for attempt in (0, 1):
        try:
            data, anc, flags, _ = sock.recvmsg(P.CTRL_CHUNK, fd_space, socket.MSG_CMSG_CLOEXEC)
            break
        except ConnectionResetError as e:
            # A peer that closed with our data unread: the kernel says so once,
            # then hands over what it sent before closing (a refusal's ERROR).
            if attempt:
                raise CtrlError(-errno.ECONNRESET, f"receive on the control socket: {e.strerror}") from None
        except OSError as e:
            raise CtrlError(-(e.errno or errno.EIO), f"receive on the control socket: {e.strerror}") from None
    fds = []
    for level, ctype, cdata in anc:
        if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[:len(cdata) - len(cdata) % a.itemsize])
            fds.extend(a)
    if flags & socket.MSG_TRUNC:
        _close_all(fds)
        raise CtrlError(-errno.EMSGSIZE, f"control datagram over {P.CTRL_CHUNK} bytes")
    if flags & socket.MSG_CTRUNC:
        _close_all(fds)
        if len(fds) == P.CTRL_MAX_FDS:
            raise CtrlError(-errno.ETOOMANYREFS, f"control datagram with more than "
                                                 f"{P.CTRL_MAX_FDS} fds (the kernel dropped the rest)")
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise CtrlError(-errno.EMFILE, "control data truncated: fds dropped by the kernel "
                                       f"(process at its fd limit? RLIMIT_NOFILE={soft}, "
                                       f"open fds={_open_fds()})")
    if not data:
        _close_all(fds)
        p = select.poll()
        p.register(sock, select.POLLRDHUP)
        hung_up = any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                      for _fd, ev in p.poll(0))
        if fds or not hung_up:
            raise CtrlError(-errno.EBADMSG, f"zero-length control datagram with {len(fds)} fds "
                                            "(a datagram carries a header or payload)")
        return b"", []
    return data, fds


def _open_fds():
    try:
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        return "unknown"


def recv_msg(sock, timeout_s, max_len=P.CTRL_MAX):
    """shardd_ctrl_recv: one whole message as (type, seq, payload, fds), each
    datagram waited for at most timeout_s (None: forever). The caller owns
    the fds. Raises CtrlError: -ECONNRESET on EOF, -ETIMEDOUT, -SHARDD_E_*."""
    hdr = None
    payload = bytearray()
    fds = []
    try:
        while True:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                r, _, _ = select.select([sock], [], [], left)
                if r:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise CtrlError(-errno.ETIMEDOUT, f"no control message from the daemon "
                                                      f"within {timeout_s:g} s")
            data, got = _recv_dgram(sock)
            if not data:
                raise CtrlError(-errno.ECONNRESET, "the daemon closed the control connection")
            if hdr is None:
                fds.extend(got)
                if len(data) < P.MSG_HDR.size:
                    raise CtrlError(-P.E_MALFORMED, f"control datagram of {len(data)} bytes is "
                                                    f"shorter than the {P.MSG_HDR.size}-byte header")
                hdr = P.MSG_HDR.unpack_from(data)
                if hdr[0] != P.MAGIC:
                    raise CtrlError(-P.E_MAGIC, f"control message magic {hdr[0]:#x}, "
                                                f"expected {P.MAGIC:#x}")
                if hdr[3] > max_len:
                    raise CtrlError(-errno.EMSGSIZE, f"control message length {hdr[3]} is over "
                                                     f"the {max_len}-byte limit")
                data = data[P.MSG_HDR.size:]
            elif got:
                _close_all(got)
                raise CtrlError(-P.E_MALFORMED, "fds on a continuation datagram")
            if len(data) > hdr[3] - len(payload):
                raise CtrlError(-P.E_MALFORMED, f"control message carries more than its "
                                                f"announced {hdr[3]} payload bytes")
            payload += data
            if len(payload) == hdr[3]:
                return hdr[1], hdr[4], bytes(payload), fds
    except BaseException:
        _close_all(fds)
        raise

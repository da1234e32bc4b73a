# SPDX-License-Identifier: MIT
"""A rank's attachment to shardd (Client) and its parameter groups (Group),
in pure Python: the same protocol libshardd speaks, no C extension."""

import collections
import errno
import fcntl
import mmap
import os
import select
import socket
import struct
import threading
import time

import numpy as np

from . import ctrl
from . import dtypes as D
from . import proto as P
from .ring import Ring, RingError

USER_DATA_RESERVED = 1 << 63   # user_data with this bit is reserved for the sync wrappers
CONNECT_TIMEOUT_S = 10.0       # handshake timeout when none is given
SPIN_ITERATIONS = 200          # cq_ready checks before sleeping; Python spins slowly
SPIN_YIELD_EVERY = 8           # checks between sched_yield()s, as libshardd's spin (PROTOCOL.md)
SLEEP_SLICE_S = 0.05           # longest futex sleep between daemon liveness checks
SYNC_GRACE_S = 10.0            # sync ops wait the collective timeout plus this
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # <linux/fcntl.h>; Python lacks it


class ShardError(Exception):
    """A failed shardd call.

    .code  0 > code: -errno or -SHARDD_E_* (as in the C API)
    .name  the code's name: 'SHARDD_E_TIMEOUT', 'ECONNRESET', ...
    .text  what failed, with the daemon's own message when it sent one
    .result  a failed completion's result words (cqe.result[0..1]): a barrier
           mismatch's [0] is the barrier number met; None for other errors
    """

    def __init__(self, code, text, result=None):
        self.code = code
        self.name = P.error_name(code)
        self.text = text
        self.result = result
        super().__init__(f"{text} [{self.name}]")


class DaemonGone(ShardError, ConnectionResetError):
    """The daemon died or dropped this client without saying why (code
    -ECONNRESET). A client it detached with a notice (a job ended by
    `shardctl end`) gets a ShardError with the notice's code instead."""


def _error(code, text, result=None):
    if code == -errno.ECONNRESET:
        return DaemonGone(code, text)
    return ShardError(code, text, result)


def default_socket_path():
    """$SHARDD_SOCKET, else $XDG_RUNTIME_DIR/shardd/shardd.sock, else /run/shardd/shardd.sock.

    Mirrors shardd_socket_path_resolve() of proto/shardd_socket.h, which the
    daemon, libshardd and shardctl share: change both together.
    """
    env = os.environ.get("SHARDD_SOCKET")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "shardd", "shardd.sock")
    return "/run/shardd/shardd.sock"


def _connect_denied(path, err):
    """Why connect() said EACCES: who owns the socket and its directory, who
    we are, and the flag that lets us in (as libshardd says it)."""
    uid, gid = os.geteuid(), os.getegid()
    d = os.path.dirname(path) or "."
    try:
        dst = os.stat(d)
    except OSError as e:
        return (f"connect: {err.strerror}: a directory on the way to {d} does not let uid {uid} "
                f"(gid {gid}) through ({e.strerror}); run as shardd's user, or start shardd with "
                f"--allow-gid {gid} and a socket path whose directories group {gid} may search")
    dinfo = f"uid {dst.st_uid} gid {dst.st_gid}, mode {dst.st_mode & 0o7777:04o}"
    try:
        st = os.stat(path)
    except OSError:
        return (f"connect: {err.strerror}: its directory {d} belongs to {dinfo}, and does not let "
                f"uid {uid} (gid {gid}) in; start shardd with --allow-gid {gid} (it then makes "
                f"the directory and the socket group-accessible) or run as uid {dst.st_uid}")
    return (f"connect: {err.strerror}: the socket belongs to uid {st.st_uid} gid {st.st_gid}, "
            f"mode {st.st_mode & 0o7777:04o} (its directory {d}: {dinfo}), and this process runs "
            f"as uid {uid} gid {gid}; start shardd with --allow-gid {gid} (it then makes the socket "
            f"and its directory group-accessible) or run as uid {st.st_uid}")


def _cstr(s, size, what):
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    if not b or len(b) >= size or b"\0" in b:
        raise ValueError(f"{what} {s!r} must be 1..{size - 1} bytes without NUL")
    return b


def _parse_error(payload):
    if len(payload) < P.ERROR_MSG.size:
        return -P.E_MALFORMED, f"ERROR message of {len(payload)} bytes is truncated"
    code, n = P.ERROR_MSG.unpack_from(payload)
    text = payload[P.ERROR_MSG.size:P.ERROR_MSG.size + n].decode("utf-8", "replace")
    if code >= 0:
        code = -P.E_MALFORMED
    return code, text


class Param:
    """A param spec: name, shardd dtype code, shape, shard_dim."""

    __slots__ = ("name", "dtype", "shape", "shard_dim")

    def __init__(self, name, dtype, shape, shard_dim=0):
        self.name = name
        self.dtype = D.dtype_code(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.shard_dim = int(shard_dim)
        if self.dtype == P.DTYPE_NONE:
            raise ValueError(f"param {name!r}: dtype must be fp32, bf16 or fp16")
        if len(self.shape) > P.MAX_DIMS:
            raise ValueError(f"param {name!r}: {len(self.shape)} dims, at most {P.MAX_DIMS}")
        if self.shape and not 0 <= self.shard_dim < len(self.shape):
            raise ValueError(f"param {name!r}: shard_dim {shard_dim} out of range for shape {self.shape}")
        # Zero-size dims are fine (a zero-numel param, as FSDP2 allows), but
        # must not hide other dims whose product wraps 64 bits in the daemon.
        extent = 1
        for d, n in enumerate(self.shape):
            if not 0 <= n < 1 << 64:
                raise ValueError(f"param {name!r}: shape[{d}] = {n} is not a size in [0, 2**64)")
            extent *= n or 1
            if extent * 8 >= 1 << 64:
                raise ValueError(f"param {name!r}: shape[{d}] = {n} takes the product of the "
                                 f"nonzero dims past 64 bits of bytes")

    @classmethod
    def unpack_from(cls, buf, offset):
        """A spec as the daemon echoes it in a GROUP reply."""
        name, dtype, ndim, shard_dim, _flags, *shape = P.PARAM_SPEC.unpack_from(buf, offset)
        if ndim > P.MAX_DIMS:
            raise ValueError(f"param spec at byte {offset}: ndim {ndim} > {P.MAX_DIMS}")
        return cls(name.split(b"\0", 1)[0].decode(), dtype, shape[:ndim], shard_dim)

    def pack(self):
        shape = list(self.shape) + [0] * (P.MAX_DIMS - len(self.shape))
        return P.PARAM_SPEC.pack(_cstr(self.name, P.PARAM_NAME_MAX, "param name"), self.dtype,
                                 len(self.shape), self.shard_dim if self.shape else 0, 0, *shape)


class Client:
    """One attachment of one rank to the daemon (shardd_connect).

    Thread-safe: calls are serialised by a lock. Use as a context manager or
    call close()."""

    def __init__(self, job, rank, shard, replicate=1, socket_path=None, device=P.HELLO_DEVICE_HOST,
                 ring_entries=0, timeout=CONNECT_TIMEOUT_S, _major=P.PROTO_MAJOR):
        self.job = job
        self.rank = rank
        self.shard = shard
        self.replicate = replicate
        self.socket_path = socket_path or default_socket_path()
        self._lock = threading.RLock()
        self._stash = collections.deque()
        self._sync_done = {}       # completions of sync/async wrapper ops, by user_data
        self._abandoned = set()    # user_data of wrapper ops whose wait timed out
        self._seq = 0
        self._next_sync = 0
        self._sock = None
        self._doorbell = -1
        self._ring_mem = None
        self.ring = None
        self.daemon_code = 0       # the daemon's notice before a close (seq-0 ERROR), 0: none
        self.daemon_text = ""      # and its text
        self.groups = []
        try:
            self._connect(device, ring_entries, timeout, _major)
        except BaseException:
            self._teardown()
            raise

    def _connect(self, device, ring_entries, timeout, major):
        where = f"attach job '{self.job}' rank {self.rank} to {self.socket_path}"
        job = _cstr(self.job, P.NAME_MAX, "job name")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.socket_path)
            self._sock.settimeout(None)
        except OSError as e:
            code = -(e.errno or errno.ETIMEDOUT)
            if e.errno in (errno.EACCES, errno.EPERM):
                raise _error(code, f"{where}: {_connect_denied(self.socket_path, e)}") from None
            raise _error(code, f"{where}: {e.strerror or 'connect timed out'}; is shardd running "
                               f"(--socket PATH, or set SHARDD_SOCKET)?") from None
        hello = P.HELLO.pack(major, P.PROTO_MINOR, os.getpid(), job, self.rank, self.replicate,
                             self.shard, device, ring_entries, 0, bytes(16))
        mtype, payload, fds = self._request(P.MSG_HELLO, hello, timeout, P.MSG_WELCOME, where)
        try:
            if len(payload) < P.WELCOME.size or len(fds) != 2:
                raise _error(-P.E_MALFORMED, f"{where}: WELCOME of {len(payload)} bytes with "
                                             f"{len(fds)} fds, expected {P.WELCOME.size} bytes and 2 fds")
            (w_major, self.daemon_minor, self.client_id, self.backend, self.sq_entries, self.cq_entries,
             self.daemon_pid, ring_size, self.collective_timeout_ms, _r0, _r) = P.WELCOME.unpack_from(payload)
            if w_major != P.PROTO_MAJOR:
                raise _error(-P.E_VERSION, f"{where}: daemon speaks protocol {w_major}.{self.daemon_minor}, "
                                           f"this client {P.PROTO_MAJOR}.{P.PROTO_MINOR}")
            st = os.fstat(fds[0])
            if st.st_size < ring_size or ring_size < P.RING_HDR_SIZE:
                raise _error(-errno.EBADMSG, f"{where}: ring memfd is {st.st_size} bytes, "
                                             f"WELCOME says {ring_size}")
            self._ring_mem = mmap.mmap(fds[0], ring_size, mmap.MAP_SHARED,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
            self._doorbell = fds[1]
            fds[1] = -1
            try:
                self.ring = Ring(self._ring_mem, ring_size)
            except RingError as e:
                raise _error(e.code, f"{where}: {e}") from None
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    # ------------------------------------------------------------ control
    def _request(self, mtype, payload, timeout, want, where):
        """Send one control request, return its reply (type, payload, fds)."""
        with self._lock:
            if self._sock is None:
                raise _error(-errno.ENOTCONN, f"{where}: client is closed")
            self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
            seq = self._seq
            send_error = None
            try:
                try:
                    ctrl.send_msg(self._sock, mtype, seq, payload)
                except ctrl.CtrlError as e:
                    # A daemon that refused us (at accept) and closed left its
                    # ERROR to read: read it before calling the connection broken.
                    if e.code not in (-errno.EPIPE, -errno.ECONNRESET):
                        raise
                    send_error = e
                while True:
                    rtype, rseq, rpayload, rfds = ctrl.recv_msg(self._sock, timeout)
                    if rtype == P.MSG_ERROR:
                        for fd in rfds:
                            os.close(fd)
                        code, text = _parse_error(rpayload)
                        if rseq == 0:
                            self.daemon_code, self.daemon_text = code, text
                        if rseq in (seq, 0):
                            raise _error(code, f"{where}: daemon: {text}")
                        continue
                    if rseq != seq or rtype != want:
                        for fd in rfds:
                            os.close(fd)
                        raise _error(-P.E_MALFORMED, f"{where}: daemon replied "
                                     f"{P.MSG_NAMES.get(rtype, rtype)} seq {rseq}, expected "
                                     f"{P.MSG_NAMES[want]} seq {seq}")
                    return rtype, rpayload, rfds
            except ctrl.CtrlError as e:
                if e.code == -errno.ECONNRESET and self.daemon_code:
                    raise _error(self.daemon_code, f"{where}: daemon: {self.daemon_text} (it closed "
                                                   "this client's connection)") from None
                if e.code == -errno.ECONNRESET and send_error is not None:
                    raise _error(send_error.code, f"{where}: {send_error}; the daemon closed "
                                                  "the connection without a reply") from None
                raise _error(e.code, f"{where}: {e}") from None

    def _sync_timeout(self):
        return None if not self.collective_timeout_ms else self.collective_timeout_ms / 1000 + SYNC_GRACE_S

    def register_group(self, name, params, param_dtype=None, reduce_dtype=None, optimizer=None,
                       restore=None):
        """Register a group (collective over the job's ranks) and map its buffers.
        params: list of Param or (name, dtype, shape[, shard_dim]) tuples.
        optimizer: None, or an Optimizer (SGD/AdamW config) the daemon's step
        op runs on each rank's shard (every rank gives the same).
        restore: None (zeroed shards); "" (the job's newest checkpoint in the
        daemon's --state-dir, zeroed when there is none); or a checkpoint
        directory, or a folder of step-N checkpoints (docs/CHECKPOINTS.md), at
        any mesh. Then Group.last_step is the step to resume after."""
        specs = [p if isinstance(p, Param) else Param(*p) for p in params]
        if not 1 <= len(specs) <= P.MAX_PARAMS:
            raise ValueError(f"group {name!r}: {len(specs)} params, 1..{P.MAX_PARAMS} allowed")
        pd, rd = D.dtype_code(param_dtype), D.dtype_code(reduce_dtype)
        tail = b""
        if restore is not None:
            path = os.path.abspath(restore).encode() if restore else b""
            if len(path) >= P.RESTORE_PATH_MAX or b"\0" in path:
                raise ValueError(f"group {name!r}: restore path of {len(path)} bytes (at most "
                                 f"{P.RESTORE_PATH_MAX - 1}, no NUL)")
            tail = P.RESTORE.pack(len(path), 0) + path
        payload = P.REGISTER_GROUP.pack(_cstr(name, P.NAME_MAX, "group name"), len(specs), pd, rd,
                                        P.INIT_RESTORE if restore is not None else P.INIT_ZERO,
                                        P.REGISTER_OPTIMIZER if optimizer else 0, 0) + \
            b"".join(p.pack() for p in specs) + (optimizer.pack() if optimizer else b"") + tail
        where = f"register group '{name}'"
        _t, reply, fds = self._request(P.MSG_REGISTER_GROUP, payload, self._sync_timeout(),
                                       P.MSG_GROUP, where)
        g = Group(self, name, reply, fds, specs, where)
        self.groups.append(g)
        return g

    def open_group(self, name):
        """Open a group some rank registered, by name (no param names or shapes)."""
        where = f"open group '{name}'"
        payload = P.OPEN_GROUP.pack(_cstr(name, P.NAME_MAX, "group name"))
        _t, reply, fds = self._request(P.MSG_OPEN_GROUP, payload, self._sync_timeout(),
                                       P.MSG_GROUP, where)
        g = Group(self, name, reply, fds, None, where)
        self.groups.append(g)
        return g

    # ------------------------------------------------------------ data plane
    def submit(self, op, group=0, step=0, flags=0, user_data=0):
        """Queue one op; its completion echoes user_data. Returns False when the
        SQ is full (reap completions, then retry)."""
        if op not in P.OP_NAMES:
            raise ValueError(f"op {op} is not a shardd op")
        if user_data & USER_DATA_RESERVED or not 0 <= user_data < 1 << 64:
            raise ValueError(f"user_data {user_data:#x}: bit 63 is reserved for the sync ops")
        with self._lock:
            return self._submit(op, group, step, flags, user_data)

    def _submit(self, op, group, step, flags, user_data, args=(0, 0)):
        if self.ring is None:
            raise _error(-errno.ENOTCONN, "submit: client is closed")
        if not self.ring.sq_push(op, group, step, user_data, flags, args):
            return False
        if self.ring.needs_wakeup():
            try:
                os.eventfd_write(self._doorbell, 1)
            except OSError as e:
                raise _error(-(e.errno or errno.EIO), f"ring the doorbell: {e.strerror}") from None
        return True

    def poll(self):
        """Reap one completion without waiting, or None."""
        with self._lock:
            while not self._stash:
                c = self._pop()
                if c is None:
                    return None
                self._file(c)
            return self._stash.popleft()

    def _pop(self):
        try:
            if self.ring.cq_ready():
                return self.ring.cq_pop()
        except RingError as e:
            raise _error(e.code, str(e)) from None
        return None

    def wait(self, timeout=None):
        """Reap one completion, waiting up to timeout seconds (None: while the
        daemon lives). Raises ShardError ETIMEDOUT, DaemonGone, or the
        daemon's notice when it detached this client (SHARDD_E_SHUTDOWN:
        `shardctl end` ended the job)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._stash:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._file(self._wait_one(left, "wait for a completion"))
            return self._stash.popleft()

    def _daemon_alive(self):
        """False when the control socket shows EOF/hangup or the ring says DEAD.
        A message waiting on the socket is read first, whatever the ring says:
        a notice sent before a detach says why (self.daemon_code, daemon_text)."""
        p = select.poll()
        p.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        for _fd, ev in p.poll(0):
            if ev & select.POLLIN:
                try:
                    _t, _s, payload, fds = ctrl.recv_msg(self._sock, 0)
                except ctrl.CtrlError:
                    return False
                for fd in fds:
                    os.close(fd)
                if _t == P.MSG_ERROR and _s == 0:
                    self.daemon_code, self.daemon_text = _parse_error(payload)
            if ev & (select.POLLHUP | select.POLLERR):
                return False
        return not self.ring.flags & P.RING_DEAD

    def _detached_error(self, what):
        """The error of a daemon that closed this client or marked its ring
        dead. Its notice, when it sent one, gives the code and the text: the
        daemon lives and detached this client ("job 'J' was ended by an admin
        request ..."). Without one the daemon is gone (DaemonGone)."""
        if self.daemon_code:
            return _error(self.daemon_code, f"{what}: daemon: {self.daemon_text} (it detached this "
                                            f"client: client id {self.client_id}, job '{self.job}' "
                                            f"rank {self.rank})")
        return _error(-errno.ECONNRESET, f"{what}: the daemon (pid {self.daemon_pid}) is gone or "
                                         "dropped this client")

    def _wait_one(self, timeout, what, total=None):
        if self.ring is None:
            raise _error(-errno.ENOTCONN, f"{what}: client is closed")
        for i in range(1, SPIN_ITERATIONS + 1):
            c = self._pop()
            if c:
                return c
            if i % SPIN_YIELD_EVERY == 0:
                # Give the CPU to the daemon or a rank woken onto it (more processes than cores).
                os.sched_yield()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self.ring.cq_tail()
            c = self._pop()
            if c:
                return c
            if not self._daemon_alive():
                raise self._detached_error(what)
            left = SLEEP_SLICE_S
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
                if left <= 0:
                    st = self.ring.status()
                    raise _error(-errno.ETIMEDOUT, f"{what}: no completion within "
                                 f"{total if total is not None else timeout:g} s "
                                 f"(daemon last took {P.OP_NAMES.get(st['daemon_last_op'], 'nothing')} "
                                 f"step {st['daemon_last_step']}, {st['sq_pending']} submissions "
                                 f"not yet taken)")
            r = self.ring.cq_wait(seen, left)
            if r not in (0, -errno.ETIMEDOUT, -errno.EINTR):
                raise _error(r, f"{what}: futex wait failed")

    def run(self, op, group=0, step=0, flags=0, where=None, timeout=None):
        """Submit one op, wait for its own completion (others are kept for
        poll/wait) and raise ShardError when it failed. timeout: seconds
        (None: the daemon's collective timeout plus 10 s)."""
        what = where or f"{P.OP_NAMES[op]}(step {step})"
        return self.run_many([(op, group, step, flags, what)], timeout)[0]

    def run_many(self, ops, timeout=None):
        """Submit several ops at once (the daemon runs ops on different groups
        concurrently), wait for all of them, then raise the first failure.
        ops: iterable of (op, group, step, flags, where[, args]), args the
        two words of sqe.arg[0..1] (a step's lr and clip bits)."""
        return self.start(ops).wait(timeout)

    def start(self, ops):
        """Submit ops (as run_many) without waiting: returns a Pending whose
        wait() reaps their completions and raises the first failure."""
        ops = list(ops)
        pending = {}
        with self._lock:
            for op, group, step, flags, where, *args in ops:
                self._next_sync += 1
                ud = USER_DATA_RESERVED | self._next_sync
                pending[ud] = where
                while not self._submit(op, group, step, flags, ud, *args):
                    self._reap_one(self._sync_timeout(), where)
        return Pending(self, pending)

    def _reap_one(self, timeout, what, total=None):
        """Wait for one completion and file it: a wrapper op's by its user_data,
        anything else on the stash for poll()/wait()."""
        self._file(self._wait_one(timeout, what, total))

    def _file(self, c):
        if c.user_data & USER_DATA_RESERVED:
            if c.user_data in self._abandoned:
                self._abandoned.discard(c.user_data)
            else:
                self._sync_done[c.user_data] = c
        else:
            self._stash.append(c)

    def _finish(self, pending, timeout):
        """Reap until every op of `pending` ({user_data: where}) completed."""
        if timeout is None:
            timeout = self._sync_timeout()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                while any(ud not in self._sync_done for ud in pending):
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    self._reap_one(left, ", ".join(w for u, w in pending.items()
                                                   if u not in self._sync_done), timeout)
            except ShardError:
                for ud in pending:
                    if self._sync_done.pop(ud, None) is None:
                        self._abandoned.add(ud)
                raise
            done = [self._sync_done.pop(ud) for ud in pending]
        for c, where in zip(done, pending.values()):
            if c.res < 0:
                raise _error(c.res, f"{where}: daemon: {c.msg}" if c.msg
                             else f"{where}: {P.error_text(c.res)}", c.result)
        return done

    def nop(self):
        self.run(P.OP_NOP, where="nop")

    def barrier(self, number):
        self.run(P.OP_BARRIER, step=number, where=f"barrier {number}")

    def ring_status(self):
        with self._lock:
            return self.ring.status()

    # ------------------------------------------------------------ teardown
    def close(self):
        """Say GOODBYE and release the ring and the connection. Group buffers
        stay mapped until their groups (and numpy views) are gone."""
        with self._lock:
            if self._sock is not None:
                try:
                    ctrl.send_msg(self._sock, P.MSG_GOODBYE, 0)
                except ctrl.CtrlError:
                    pass
            self._teardown()

    def _teardown(self):
        if self.ring is not None:
            self.ring.release()
            self.ring = None
        if self._ring_mem is not None:
            self._ring_mem.close()
            self._ring_mem = None
        if self._doorbell >= 0:
            os.close(self._doorbell)
            self._doorbell = -1
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._teardown()
        except Exception:
            pass

    def grad_norm(self, step, norm_type=2.0, timeout=None):
        """Job-wide: every rank calls it with the same step and norm_type
        (2.0 or math.inf). Returns (norm, nonfinite): the total norm of every
        group's sharded grads (each HSDP replica once, padding rows excluded,
        absent grads as zero) and whether some element is NaN or Inf. Call it
        after the step's reduces completed. Raises ShardError on a mismatch
        between ranks, a bad norm_type or a timeout."""
        norm_type = float(norm_type)
        if norm_type != 2.0 and norm_type != float("inf"):
            raise _error(-errno.EINVAL, f"grad_norm: norm_type {norm_type:g} is not supported: "
                         "use 2.0 or math.inf")
        where = f"grad_norm(step {step}, norm_type {norm_type:g})"
        c = self.run_many([(P.OP_GRAD_NORM, 0, step, 0, where, (_f64_bits(norm_type), 0))], timeout)[0]
        norm = struct.unpack("<d", struct.pack("<Q", c.result[0]))[0]
        return norm, bool(c.result[1])


    def checkpoint(self, step, timeout=None):
        """Job-wide: every rank calls it with the same step after the step's
        STEPs completed. The daemon writes every group's params and optimizer
        state to <--state-dir>/<job>/step-<step> (docs/CHECKPOINTS.md); returns
        once it is durable. Raises ShardError (no --state-dir, not at a step
        boundary, a mismatch between ranks, a write failure)."""
        self.run_many([(P.OP_CHECKPOINT, 0, step, 0, f"checkpoint(step {step})", (0, 0))], timeout)


def _f64_bits(x):
    return struct.unpack("<Q", struct.pack("<d", float(x)))[0]


class Optimizer:
    """A group's optimizer for register_group(): torch.optim's SGD or AdamW
    hyperparameters except lr, which travels with each step."""

    __slots__ = ("kind", "flags", "momentum", "dampening", "weight_decay", "beta1", "beta2", "eps")

    def __init__(self, kind, flags=0, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 beta1=0.0, beta2=0.0, eps=0.0):
        self.kind, self.flags = kind, flags
        self.momentum, self.dampening, self.weight_decay = momentum, dampening, weight_decay
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    @classmethod
    def sgd(cls, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
        return cls(P.OPTIM_SGD, (P.OPTIM_NESTEROV if nesterov else 0) | (P.OPTIM_MAXIMIZE if maximize else 0),
                   momentum=momentum, dampening=dampening, weight_decay=weight_decay)

    @classmethod
    def adamw(cls, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False):
        return cls(P.OPTIM_ADAMW, (P.OPTIM_AMSGRAD if amsgrad else 0) | (P.OPTIM_MAXIMIZE if maximize else 0),
                   weight_decay=weight_decay, beta1=betas[0], beta2=betas[1], eps=eps)

    def pack(self):
        return P.OPTIM_CONFIG.pack(self.kind, self.flags, self.momentum, self.dampening, self.weight_decay,
                                   self.beta1, self.beta2, self.eps, 0, 0)


class Pending:
    """Ops submitted by Client.start(): wait(timeout) reaps them."""

    __slots__ = ("client", "ops", "completions")

    def __init__(self, client, ops):
        self.client = client
        self.ops = ops
        self.completions = None

    def wait(self, timeout=None):
        """Wait for every op (timeout in seconds; None: the daemon's collective
        timeout plus 10 s) and raise the first failure; returns the
        completions in submission order. A second wait returns them again."""
        if self.completions is None:
            self.completions = self.client._finish(self.ops, timeout)
        return self.completions

    def done(self):
        return self.completions is not None


class Group:
    """A registered or opened group: its layout and its four buffer mappings.

    Views returned by unsharded()/grad()/shard()/shard_grad() are numpy arrays
    over the shared memory (no copy); they keep the mapping alive. bf16
    buffers are Bf16Array views (uint16 bits that convert numbers written into
    them); tensor() shows any buffer as a torch tensor of its real dtype."""

    UNSHARDED, GRAD, SHARD, SHARD_GRAD = range(4)

    def __init__(self, client, name, reply, fds, specs, where):
        self.client = client
        self.name = name
        self.maps = [None] * 4
        try:
            if client.backend != P.BACKEND_HOST:
                raise _error(-errno.ENOTSUP, f"{where}: the daemon runs the cuda backend, whose "
                                             f"buffers are device memory; the Python client maps "
                                             f"host buffers only (use --backend host)")
            # A daemon of minor < 4 sends no peer_last_step.
            head = P.GROUP_REPLY if client.daemon_minor >= 4 else P.GROUP_REPLY_V3
            if len(reply) < head.size:
                raise _error(-P.E_MALFORMED, f"{where}: GROUP reply of {len(reply)} bytes, "
                                             f"expected >= {head.size}")
            (self.id, self.nparams, self.param_dtype, self.reduce_dtype, self.grad_dtype,
             self.shard_world, self.unsharded_size, self.grad_size, self.shard_size,
             export_kind, self.optimizer, self.last_step, *peer) = head.unpack_from(reply)
            # The highest last_step of any rank of the group (0 from an older daemon).
            self.peer_last_step = peer[0] if peer else 0
            # Every buffer must be an fd (kind 0): a CUDA IPC handle is device memory.
            for i, kind in enumerate(export_kind):
                if kind != P.EXPORT_FD:
                    known = kind in P.EXPORT_NAMES
                    raise _error(-errno.ENOTSUP if known else -P.E_MALFORMED,
                                 f"{where}: GROUP reply: export_kind[{i}] = {kind} "
                                 f"({P.EXPORT_NAMES.get(kind, 'unknown kind')}): the Python client "
                                 f"maps buffers that travel as fds (kind 0) only"
                                 + (", not device memory (use --backend host)" if known else ""))
            if len(fds) != P.GROUP_BUFS:
                raise _error(-P.E_MALFORMED, f"{where}: GROUP reply carries {len(fds)} fds, "
                                             f"expected {P.GROUP_BUFS}")
            # reply header, nparams layouts, then the nparams specs as registered
            specs_at = head.size + self.nparams * P.PARAM_LAYOUT.size
            want = specs_at + self.nparams * P.PARAM_SPEC.size
            if len(reply) != want or (specs is not None and len(specs) != self.nparams):
                raise _error(-P.E_MALFORMED, f"{where}: GROUP reply of {len(reply)} bytes for "
                                             f"{self.nparams} params, expected {want}")
            self.layouts = [P.PARAM_LAYOUT.unpack_from(reply, head.size + i * P.PARAM_LAYOUT.size)
                            for i in range(self.nparams)]
            try:
                self.params = [Param.unpack_from(reply, specs_at + i * P.PARAM_SPEC.size)
                               for i in range(self.nparams)]
            except ValueError as e:
                raise _error(-P.E_MALFORMED, f"{where}: GROUP reply: {e}") from None
            if specs is not None and [(p.name, p.dtype, p.shape, p.shard_dim) for p in specs] != \
                    [(p.name, p.dtype, p.shape, p.shard_dim) for p in self.params]:
                raise _error(-P.E_MALFORMED, f"{where}: GROUP reply specs differ from the registered ones")
            sizes = (self.unsharded_size, self.grad_size, self.shard_size, self.shard_size)
            for i, (fd, size) in enumerate(zip(fds, sizes)):
                if size == 0:
                    continue
                if os.fstat(fd).st_size < size:
                    raise _error(-errno.EBADMSG, f"{where}: buffer {i} memfd is smaller than "
                                                 f"the {size} bytes the reply announces")
                # A read-only buffer that one rank could reopen O_RDWR would let it rewrite
                # every rank's params: the daemon seals it against writes.
                if i == self.UNSHARDED:
                    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                    if not seals & F_SEAL_FUTURE_WRITE:
                        raise _error(-P.E_MALFORMED, f"{where}: the unsharded memfd is lent "
                                                     f"read-only but is not sealed against writes "
                                                     f"(F_SEAL_FUTURE_WRITE missing from seals "
                                                     f"{seals:#x}): upgrade shardd")
                prot = mmap.PROT_READ if i == self.UNSHARDED else mmap.PROT_READ | mmap.PROT_WRITE
                self.maps[i] = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
            self._check_layouts(where)
        finally:
            for fd in fds:
                os.close(fd)

    def _check_layouts(self, where):
        """Every view must lie inside its mapping: the reply is daemon input."""
        sizes = (self.unsharded_size, self.grad_size, self.shard_size)
        for i, lay in enumerate(self.layouts):
            for (off, n), size in zip(((lay[0], lay[1]), (lay[2], lay[3]), (lay[4], lay[5])), sizes):
                if off + n > size:
                    raise _error(-P.E_MALFORMED, f"{where}: param {i} range [{off}, {off + n}) "
                                                 f"is outside its {size}-byte buffer")

    # ------------------------------------------------------------ params
    def index(self, name):
        for i, p in enumerate(self.params):
            if p.name == name:
                return i
        raise ShardError(-errno.ENOENT, f"group '{self.name}' has no param '{name}'")

    def _i(self, param):
        i = self.index(param) if isinstance(param, str) else int(param)
        if not 0 <= i < self.nparams:
            raise IndexError(f"group '{self.name}': param {param} out of range 0..{self.nparams - 1}")
        return i

    def _unsharded_dtype(self, i):
        if self.param_dtype != P.DTYPE_NONE:
            return self.param_dtype
        return self.params[i].dtype

    def _grad_dtype(self, i):
        return self._unsharded_dtype(i)

    def _view(self, buf, off, nbytes, code, shape):
        m = self.maps[buf]
        dt = D.numpy_dtype(code)
        if m is None:
            return np.zeros(0, dt)
        a = np.frombuffer(m, dtype=dt, count=nbytes // dt.itemsize, offset=off)
        if int(np.prod(shape, dtype=np.int64)) == a.size:
            a = a.reshape(shape)
        if code == P.DTYPE_BF16:
            a = a.view(D.Bf16Array)
        return a

    def unsharded(self, param):
        """Read-only view of the unsharded param (param_dtype; bf16: Bf16Array)."""
        i = self._i(param)
        lay = self.layouts[i]
        shape = self.params[i].shape
        return self._view(self.UNSHARDED, lay[0], lay[1], self._unsharded_dtype(i), shape)

    def grad(self, param):
        """Writable view of this rank's unsharded gradient of the param (grad dtype)."""
        i = self._i(param)
        lay = self.layouts[i]
        shape = self.params[i].shape
        return self._view(self.GRAD, lay[2], lay[3], self._grad_dtype(i), shape)

    def _shard_shape(self, i):
        p = self.params[i]
        item = P.DTYPE_SIZES[p.dtype]
        if not p.shape:
            return (self.layouts[i][5] // item,)
        other = int(np.prod([s for d, s in enumerate(p.shape) if d != p.shard_dim], dtype=np.int64))
        rows = self.layouts[i][5] // item // max(other, 1)
        return tuple(rows if d == p.shard_dim else s for d, s in enumerate(p.shape))

    def _orig_dtype(self, i):
        return self.params[i].dtype

    def _shard_view(self, buf, param, padded):
        i = self._i(param)
        lay = self.layouts[i]
        a = self._view(buf, lay[4], lay[5], self._orig_dtype(i), self._shard_shape(i))
        if padded or a.ndim == 0:
            return a
        p = self.params[i]
        dim = p.shard_dim if p.shape else 0
        index = [slice(None)] * a.ndim
        index[dim] = slice(0, lay[7])
        return a[tuple(index)]

    def shard(self, param, padded=False):
        """Writable view of this rank's shard of the param (original dtype): its
        real rows along shard_dim (shard_rows() says which), or with
        padded=True the whole padded chunk FSDP2 allocates (padding rows are
        zero and must stay zero)."""
        return self._shard_view(self.SHARD, param, padded)

    def shard_grad(self, param, padded=False):
        """View of this rank's sharded gradient (original dtype, the shape of shard())."""
        return self._shard_view(self.SHARD_GRAD, param, padded)

    def tensor(self, kind, param, padded=False):
        """A torch tensor over the same memory as the numpy view `kind`
        ('unsharded', 'grad', 'shard' or 'shard_grad') of the param, in the
        buffer's real dtype (torch.bfloat16 for bf16), no copy. The unsharded
        buffer is mapped read-only: never write its tensor."""
        import torch  # only this method needs torch
        if kind in ("shard", "shard_grad"):
            a = getattr(self, kind)(param, padded)
        elif kind in ("unsharded", "grad"):
            a = getattr(self, kind)(param)
        else:
            raise ValueError(f"buffer kind {kind!r} is not one of unsharded, grad, shard, shard_grad")
        return numpy_to_tensor(a)

    def shard_rows(self, param):
        """(first row along shard_dim, rows of real data) of this rank's shard."""
        lay = self.layouts[self._i(param)]
        return lay[6], lay[7]

    def load_full(self, param, full):
        """Copy this rank's rows of `full` (the whole param, its shape; numbers,
        or uint16 bit patterns for a bf16 param) into the flat shard; zero the padding."""
        i = self._i(param)
        p = self.params[i]
        full = np.asarray(full)
        if p.dtype == P.DTYPE_BF16:
            full = D._bf16_bits(full)
        elif full.dtype.kind not in "biuf":
            raise TypeError(f"param '{p.name}': load_full takes numbers, not {full.dtype}")
        full = full.astype(D.numpy_dtype(p.dtype), copy=False)
        if full.size != int(np.prod(p.shape, dtype=np.int64)):
            raise ValueError(f"param '{p.name}': {full.size} elements, shape {p.shape} expected")
        full = full.reshape(p.shape if p.shape else (1,))
        dim = p.shard_dim if p.shape else 0
        s = np.moveaxis(self.shard(i, padded=True), dim, 0)
        f = np.moveaxis(full, dim, 0)
        begin, valid = self.shard_rows(i)
        s[:valid] = f[begin:begin + valid]
        s[valid:] = 0

    # ------------------------------------------------------------ ops
    def _where(self, op, step):
        return f"{P.OP_NAMES[op]}(group '{self.name}', step {step})"

    def unshard(self, step, timeout=None):
        """All-gather (collective); timeout in seconds, None: the daemon's
        collective timeout plus 10 s."""
        self.client.run(P.OP_UNSHARD, self.id, step, 0, self._where(P.OP_UNSHARD, step), timeout)

    def reduce(self, step, flags=0, timeout=None):
        """Reduce-scatter the grad buffers (collective); timeout as unshard()."""
        self.client.run(P.OP_REDUCE, self.id, step, flags, self._where(P.OP_REDUCE, step), timeout)

    def reshard(self, step=0, timeout=None):
        self.client.run(P.OP_RESHARD, self.id, step, 0, self._where(P.OP_RESHARD, step), timeout)

    def zero_grad(self, timeout=None):
        self.client.run(P.OP_ZERO_GRAD, self.id, 0, 0, f"zero_grad(group '{self.name}')", timeout)

    def step(self, step, lr, skip_nonfinite=False, clip=None, timeout=None, *, max_norm=None,
             skip_job_nonfinite=False, replay=False):
        """The daemon's optimizer on this rank's shard for step number `step`
        (>= 1) with learning rate `lr`; clip: a coefficient multiplied into
        the grad (clip_grad_norm_'s), or None; max_norm: instead, the
        daemon computes clip_grad_norm_'s coefficient from the job's
        grad_norm of the same step number (P.STEP_CLIP_JOB);
        skip_job_nonfinite: skip on every rank when that grad_norm was
        non-finite; replay: apply the step as the group's other ranks
        submitted it (lr and the rest are then not sent: a restarted rank's
        catch-up to peer_last_step). Clears the sharded grad. Returns
        P.STEP_APPLIED, P.STEP_SKIPPED (a skip) or P.STEP_ALREADY (a step at
        or below the last one applied on this shard: nothing changed);
        raises ShardError on errors."""
        flags, args = step_flags_args(lr, skip_nonfinite, clip, max_norm, skip_job_nonfinite, replay)
        where = f"step(group '{self.name}', step {step})"
        return self.client.run_many([(P.OP_STEP, self.id, step, flags, where, args)], timeout)[0].res

    def submit(self, op, step=0, flags=0, user_data=0):
        """Asynchronous op on this group; reap with client.wait()/poll()."""
        return self.client.submit(op, self.id, step, flags, user_data)

    def close(self):
        """Unmap the buffers; mappings still viewed by numpy arrays stay until
        those arrays are gone."""
        for i, m in enumerate(self.maps):
            if m is None:
                continue
            try:
                m.close()
            except BufferError:
                pass
            self.maps[i] = None


def step_flags_args(lr, skip_nonfinite=False, clip=None, max_norm=None, skip_job_nonfinite=False,
                    replay=False):
    """(sqe.flags, (arg[0], arg[1])) of a STEP (PROTOCOL.md, SHARDD_OP_STEP)."""
    if replay:
        return P.STEP_REPLAY, (0, 0)
    if clip is not None and max_norm is not None:
        raise ValueError(f"step: clip = {clip} and max_norm = {max_norm}: give a coefficient or "
                         f"max_norm, not both")
    flags = (P.STEP_SKIP_NONFINITE if skip_nonfinite else 0) | \
        (P.STEP_SKIP_JOB_NONFINITE if skip_job_nonfinite else 0) | \
        (P.STEP_CLIP if clip is not None else 0) | (P.STEP_CLIP_JOB if max_norm is not None else 0)
    word = clip if clip is not None else max_norm
    return flags, (_f64_bits(lr), _f64_bits(word) if word is not None else 0)


def numpy_to_tensor(a):
    """A torch tensor sharing memory with numpy view `a` (a Bf16Array becomes
    torch.bfloat16). A read-only array (the unsharded buffer) gives a tensor
    that must not be written; torch's warning about that is silenced."""
    import warnings

    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if isinstance(a, D.Bf16Array):
            return torch.from_numpy(a.view(np.ndarray).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

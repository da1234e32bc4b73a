# SPDX-License-Identifier: MIT
"""A rank's attachment to shardd (Client), in pure Python, as the C client's
client/client.c and client/ops.c: the handshake, the ring, control
requests, ops through the ring and their synchronous wrappers. Groups are
group.py, errors error.py, ops in flight pending.py: the same protocol
libshardd speaks, no C extension."""

import atexit
import collections
import errno
import mmap
import os
import select
import socket
import struct
import threading
import time
import weakref

from . import ctrl
from . import dtypes as D
from . import exec as X
from . import proto as P
from . import stream as S
from .cuda_group import CudaGroup, ipc_gone_note
from .error import DaemonGone, ShardError, shard_error
from .group import F_SEAL_FUTURE_WRITE, Group, Optimizer, Param, numpy_to_tensor, step_flags_args
from .pending import Pending
from .ring import Ring, RingError

# What this module held before group.py, error.py and pending.py took their
# parts; `from shardd.client import Group` keeps working.
__all__ = ["Client", "default_socket_path", "USER_DATA_RESERVED", "CONNECT_TIMEOUT_S",
           "SPIN_ITERATIONS", "SPIN_YIELD_EVERY", "SLEEP_SLICE_S", "SYNC_GRACE_S",
           "ShardError", "DaemonGone", "Group", "Param", "Optimizer", "Pending",
           "step_flags_args", "numpy_to_tensor", "F_SEAL_FUTURE_WRITE"]

USER_DATA_RESERVED = 1 << 63   # user_data with this bit is reserved for the sync wrappers
CONNECT_TIMEOUT_S = 10.0       # handshake timeout when none is given
SPIN_ITERATIONS = 200          # cq_ready checks before sleeping; Python spins slowly
SPIN_YIELD_EVERY = 8           # checks between sched_yield()s, as libshardd's spin (PROTOCOL.md)
SLEEP_SLICE_S = 0.05           # longest futex sleep between daemon liveness checks
NOTICE_WAIT_MS = 1000          # a detached client waits this long for the notice saying why
SYNC_GRACE_S = 10.0            # sync ops wait the collective timeout plus this
EXIT_LOCK_TIMEOUT_S = 1.0      # at exit, how long GOODBYE waits for a Client's lock


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




def _exec_code(exec):
    """enum shardd_exec of "auto", "daemon", "ranks" (or the code)."""
    for code, name in P.EXEC_NAMES.items():
        if exec == name or (type(exec) is int and exec == code):
            return code
    raise ValueError(f"exec = {exec!r}: one of 'auto', 'daemon', 'ranks'")


def _parse_error(payload):
    if len(payload) < P.ERROR_MSG.size:
        return -P.E_MALFORMED, f"ERROR message of {len(payload)} bytes is truncated"
    code, n = P.ERROR_MSG.unpack_from(payload)
    text = payload[P.ERROR_MSG.size:P.ERROR_MSG.size + n].decode("utf-8", "replace")
    if code >= 0:
        code = -P.E_MALFORMED
    return code, text



# Every attached Client of this process: at exit each says GOODBYE (_close_at_exit).
_attached = weakref.WeakSet()


def _close_at_exit():
    """atexit: every Client still attached says GOODBYE for its rank, so a
    process that ends (normally, by sys.exit or by an uncaught exception)
    without close() leaves no job lingering in the daemon, and a rerun of
    the job starts fresh. A process killed by a signal or ended by os._exit
    runs no atexit handler: its ranks' job lingers (--job-linger) for a
    restarted rank to re-attach."""
    for c in list(_attached):
        # A thread left waiting in the daemon holds the lock: say GOODBYE anyway (one
        # SEQPACKET message does not interleave with its request) rather than hang the exit.
        locked = c._lock.acquire(timeout=EXIT_LOCK_TIMEOUT_S)
        try:
            c._goodbye()
        except Exception:
            pass
        finally:
            if locked:
                c._lock.release()


atexit.register(_close_at_exit)


class Client:
    """One attachment of one rank to the daemon (shardd_connect).

    Thread-safe: calls are serialised by a lock. Use as a context manager or
    call close(); a Client not closed says GOODBYE when it is collected or
    the process exits (not one killed by a signal or ended by os._exit)."""

    def __init__(self, job, rank, shard, replicate=1, socket_path=None, device=P.HELLO_DEVICE_HOST,
                 ring_entries=0, timeout=CONNECT_TIMEOUT_S, _major=P.PROTO_MAJOR):
        self.job = job
        self.rank = rank
        self.shard = shard
        self.replicate = replicate
        self.socket_path = socket_path or default_socket_path()
        self.device = device       # the CUDA device this rank named in its HELLO (-1: none)
        self._fences = None        # stream.setup's cuda.Fences once set_stream ran
        self._stream = None        # the CUstream ops are ordered on; None: ordered by the CPU
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
        self._exec_groups = {}     # group id -> the Group whose ops this client runs (rank-executed)
        self._xops = []            # ops of rank-executed groups not complete yet, in submission order
        self._xwait = None         # what the first of them waits for (exec.progress)
        self.mesh_state = None     # shardd.torch's per-mesh state when this client is a mesh
        self._pid = os.getpid()    # a forked child shares the socket: only this process says GOODBYE
        try:
            self._connect(device, ring_entries, timeout, _major)
        except BaseException:
            self._teardown()
            raise
        _attached.add(self)

    def _connect(self, device, ring_entries, timeout, major):
        where = f"attach job '{self.job}' rank {self.rank} to {self.socket_path}"
        job = P.cstr(self.job, P.NAME_MAX, "job name")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.socket_path)
            self._sock.settimeout(None)
        except OSError as e:
            code = -(e.errno or errno.ETIMEDOUT)
            if e.errno in (errno.EACCES, errno.EPERM):
                raise shard_error(code, f"{where}: {_connect_denied(self.socket_path, e)}") from None
            raise shard_error(code, f"{where}: {e.strerror or 'connect timed out'}; is shardd running "
                                    f"(--socket PATH, or set SHARDD_SOCKET)?") from None
        hello = P.HELLO.pack(major, P.PROTO_MINOR, os.getpid(), job, self.rank, self.replicate,
                             self.shard, device, ring_entries, 0, bytes(16))
        mtype, payload, fds = self._request(P.MSG_HELLO, hello, timeout, P.MSG_WELCOME, where)
        try:
            if len(payload) < P.WELCOME.size or len(fds) != 2:
                raise shard_error(-P.E_MALFORMED, f"{where}: WELCOME of {len(payload)} bytes with "
                                                  f"{len(fds)} fds, expected {P.WELCOME.size} bytes "
                                                  f"and 2 fds")
            (w_major, self.daemon_minor, self.client_id, self.backend, self.sq_entries, self.cq_entries,
             self.daemon_pid, ring_size, self.collective_timeout_ms, _r0, _r) = P.WELCOME.unpack_from(payload)
            if w_major != P.PROTO_MAJOR:
                raise shard_error(-P.E_VERSION, f"{where}: daemon speaks protocol "
                                                f"{w_major}.{self.daemon_minor}, this client "
                                                f"{P.PROTO_MAJOR}.{P.PROTO_MINOR}")
            st = os.fstat(fds[0])
            if st.st_size < ring_size or ring_size < P.RING_HDR_SIZE:
                raise shard_error(-errno.EBADMSG, f"{where}: ring memfd is {st.st_size} bytes, "
                                                  f"WELCOME says {ring_size}")
            self._ring_mem = mmap.mmap(fds[0], ring_size, mmap.MAP_SHARED,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
            self._doorbell = fds[1]
            fds[1] = -1
            try:
                self.ring = Ring(self._ring_mem, ring_size)
            except RingError as e:
                raise shard_error(e.code, f"{where}: {e}") from None
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    # ------------------------------------------------------------ control
    def _request(self, mtype, payload, timeout, want, where):
        """Send one control request, return its reply (type, payload, fds)."""
        with self._lock:
            if self._sock is None:
                raise shard_error(-errno.ENOTCONN, f"{where}: client is closed")
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
                            raise shard_error(code, f"{where}: daemon: {text}")
                        continue
                    if rseq != seq or rtype != want:
                        for fd in rfds:
                            os.close(fd)
                        raise shard_error(-P.E_MALFORMED, f"{where}: daemon replied "
                                          f"{P.MSG_NAMES.get(rtype, rtype)} seq {rseq}, expected "
                                          f"{P.MSG_NAMES[want]} seq {seq}")
                    return rtype, rpayload, rfds
            except ctrl.CtrlError as e:
                if e.code == -errno.ECONNRESET and self.daemon_code:
                    raise shard_error(self.daemon_code, f"{where}: daemon: {self.daemon_text} (it closed "
                                                   "this client's connection)") from None
                if e.code == -errno.ECONNRESET and send_error is not None:
                    raise shard_error(send_error.code, f"{where}: {send_error}; the daemon closed "
                                                       "the connection without a reply") from None
                raise shard_error(e.code, f"{where}: {e}") from None

    def _sync_timeout(self):
        return None if not self.collective_timeout_ms else self.collective_timeout_ms / 1000 + SYNC_GRACE_S

    def register_group(self, name, params, param_dtype=None, reduce_dtype=None, optimizer=None,
                       restore=None, exec="auto"):
        """Register a group (collective over the job's ranks) and map its buffers.
        params: list of Param or (name, dtype, shape[, shard_dim]) tuples.
        exec: who moves the group's bytes (docs/DESIGN.md "Who moves the
        bytes"): "daemon" (its worker pool), "ranks" (each rank runs unshard,
        reduce and reshard in its own process, on the job's shared buffers,
        when it waits or polls: exec.py), or "auto" (the daemon picks by
        size, shardd --rank-exec-max); every rank gives the same. Group.exec
        says what the group runs as.
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
        exec_code = _exec_code(exec)
        tail = b""
        if restore is not None:
            path = os.path.abspath(restore).encode() if restore else b""
            if len(path) >= P.RESTORE_PATH_MAX or b"\0" in path:
                raise ValueError(f"group {name!r}: restore path of {len(path)} bytes (at most "
                                 f"{P.RESTORE_PATH_MAX - 1}, no NUL)")
            tail = P.RESTORE.pack(len(path), 0) + path
        payload = P.REGISTER_GROUP.pack(P.cstr(name, P.NAME_MAX, "group name"), len(specs), pd, rd,
                                        P.INIT_RESTORE if restore is not None else P.INIT_ZERO,
                                        P.REGISTER_OPTIMIZER if optimizer else 0, exec_code) + \
            b"".join(p.pack() for p in specs) + (optimizer.pack() if optimizer else b"") + tail
        where = f"register group '{name}'"
        _t, reply, fds = self._request(P.MSG_REGISTER_GROUP, payload, self._sync_timeout(),
                                       P.MSG_GROUP, where)
        return self._add_group(self._group_class()(self, name, reply, fds, specs, where))

    def open_group(self, name):
        """Open a group some rank registered, by name (no param names or shapes)."""
        where = f"open group '{name}'"
        payload = P.OPEN_GROUP.pack(P.cstr(name, P.NAME_MAX, "group name"))
        _t, reply, fds = self._request(P.MSG_OPEN_GROUP, payload, self._sync_timeout(),
                                       P.MSG_GROUP, where)
        return self._add_group(self._group_class()(self, name, reply, fds, None, where))

    def _group_class(self):
        """The cuda backend's buffers are device memory (cuda_group.py)."""
        return CudaGroup if self.backend == P.BACKEND_CUDA else Group

    def set_stream(self, stream):
        """Cuda backend: order this client's ops with CUDA stream `stream` (a
        torch.cuda.Stream or a CUstream as an int, 0 the legacy default
        stream) instead of CPU waits, as libshardd's shardd_stream_set: each
        submission records an event on it that the daemon's work waits for,
        and reaping a completion makes it wait on the daemon's event
        (docs/CUDA.md, "Ops and ordering"). The first call sets up the
        events with the daemon (STREAM); later ones only switch streams."""
        handle = S.stream_handle(stream)
        with self._lock:
            if self.backend != P.BACKEND_CUDA:
                raise shard_error(-errno.ENOTSUP, f"set a stream: the daemon runs the "
                                  f"{'host' if self.backend == P.BACKEND_HOST else 'unknown'} "
                                  f"backend, whose completions already mean the results are in "
                                  f"memory")
            if self._fences is None:
                self._fences = S.setup(self)
            self._stream = handle

    def clear_stream(self):
        """Back to CPU ordering (shardd_stream_clear): a completion again means
        the results are in device memory."""
        with self._lock:
            self._stream = None

    def _add_group(self, g):
        self.groups.append(g)
        # A rank-executed group's ops run through the handle that published its buffers.
        if g.x is not None and not g.x.second:
            self._exec_groups.setdefault(g.id, g)
        return g

    def _exec_close(self, g):
        """Group g (rank-executed) is being closed: its pending ops fail, and ops
        on its id go to the daemon again (which refuses them)."""
        with self._lock:
            X.forget(self, g.x)
            if self._exec_groups.get(g.id) is g:
                del self._exec_groups[g.id]

    # ------------------------------------------------------------ data plane
    def submit(self, op, group=0, step=0, flags=0, user_data=0):
        """Queue one op; its completion echoes user_data. Returns False when the
        SQ is full (reap completions, then retry). The unshard, reduce or
        reshard of a rank-executed group is published to its peers at once and
        runs while this client waits or polls."""
        if op not in P.OP_NAMES:
            raise ValueError(f"op {op} is not a shardd op")
        if user_data & USER_DATA_RESERVED or not 0 <= user_data < 1 << 64:
            raise ValueError(f"user_data {user_data:#x}: bit 63 is reserved for the sync ops")
        with self._lock:
            return self._submit(op, group, step, flags, user_data)

    def _submit(self, op, group, step, flags, user_data, args=(0, 0)):
        if self.ring is None:
            raise shard_error(-errno.ENOTCONN, "submit: client is closed")
        if op in (P.OP_UNSHARD, P.OP_REDUCE, P.OP_RESHARD):
            g = self._exec_groups.get(group)
            if g is None:
                g = next((h for h in self.groups if h.id == group and h.x is not None), None)
            if g is not None:
                # Rank-executed: published to the peers now, run as this client waits or polls.
                o = g.x.submit(op, step, flags, args, user_data)
                if isinstance(o, X.Completion):
                    self._file(o)
                else:
                    self._xops.append(o)
                return True
        return self._submit_ring(op, group, step, flags, user_data, args)

    def _submit_ring(self, op, group, step, flags, user_data, args=(0, 0)):
        """Push one entry to the daemon's ring: False when the SQ is full.
        With a stream set, the event of the entry's slot is recorded on it first."""
        fence = 0
        if self._stream is not None:
            slot = self.ring.sq_next_slot()
            if slot is None:
                return False
            self._fences.record(slot, self._stream)
            fence = P.FENCE_WAIT | P.FENCE_SIGNAL
        if not self.ring.sq_push(op, group, step, user_data, flags, args, fence):
            return False
        if self.ring.needs_wakeup():
            try:
                os.eventfd_write(self._doorbell, 1)
            except OSError as e:
                raise shard_error(-(e.errno or errno.EIO), f"ring the doorbell: {e.strerror}") from None
        return True

    def poll(self):
        """Reap one completion without waiting, or None; rank-executed ops
        advance as far as they go without waiting."""
        with self._lock:
            if self._xops:
                X.progress(self)
            while not self._stash:
                c = self._pop()
                if c is None:
                    return None
                self._file(c)
            return self._stash.popleft()

    def _pop(self):
        try:
            if self.ring.cq_ready():
                return self.ring.cq_pop(lambda slot: S.reap(self, slot))
        except RingError as e:
            raise shard_error(e.code, str(e)) from None
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
        a notice sent before a detach says why (self.daemon_code, daemon_text).
        With the ring marked dead, that notice (or the close) follows on the
        socket if it is not there yet: waited for a bounded while, so the error
        names why."""
        p = select.poll()
        p.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        dead = self.ring.flags & P.RING_DEAD and not self.daemon_code
        for _fd, ev in p.poll(NOTICE_WAIT_MS if dead else 0):
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
            return shard_error(self.daemon_code, f"{what}: daemon: {self.daemon_text} (it detached this "
                                            f"client: client id {self.client_id}, job '{self.job}' "
                                            f"rank {self.rank})")
        return shard_error(-errno.ECONNRESET, f"{what}: the daemon (pid {self.daemon_pid}) is gone or "
                                         f"dropped this client{ipc_gone_note(self.groups)}")

    def _wait_one(self, timeout, what, total=None):
        """One completion from the ring, waiting up to timeout s; None when an op
        of a rank-executed group completed meanwhile (it is filed: the caller
        looks again). Waiting drives those ops: they run here."""
        if self.ring is None:
            raise shard_error(-errno.ENOTCONN, f"{what}: client is closed")
        for i in range(1, SPIN_ITERATIONS + 1):
            c = self._pop()
            if c:
                return c
            if self._xops and X.progress(self):
                return None
            if i % SPIN_YIELD_EVERY == 0:
                # Give the CPU to the daemon or a rank woken onto it (more processes than cores).
                os.sched_yield()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self.ring.cq_tail()
            c = self._pop()
            if c:
                return c
            if self._xops and X.progress(self):
                return None
            if not self._daemon_alive():
                err = self._detached_error(what)
                if not self._xops:
                    raise err
                # Rank-executed ops then fail with the reason, as completions, as the
                # daemon's would.
                X.fail_all(self, err.code, err.text)
                return None
            left = SLEEP_SLICE_S
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
                if left <= 0:
                    st = self.ring.status()
                    raise shard_error(-errno.ETIMEDOUT, f"{what}: no completion within "
                                      f"{total if total is not None else timeout:g} s "
                                      f"(daemon last took {P.OP_NAMES.get(st['daemon_last_op'], 'nothing')} "
                                      f"step {st['daemon_last_step']}, {st['sq_pending']} submissions "
                                      f"not yet taken)")
            if self._xops:
                # A rank-executed op waits for a peer: sleep on the peer's word (it wakes us
                # when it publishes) in short naps, so that the CQ is looked at too.
                X.nap(self, min(left, X.EXEC_NAP_S))
                continue
            r = self.ring.cq_wait(seen, left)
            if r not in (0, -errno.ETIMEDOUT, -errno.EINTR):
                raise shard_error(r, f"{what}: futex wait failed")

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
        if c is None:
            return
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
                raise shard_error(c.res, f"{where}: daemon: {c.msg}" if c.msg
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
            self._goodbye()
            self._teardown()

    def _goodbye(self):
        _attached.discard(self)
        if self._sock is not None and os.getpid() == self._pid:
            try:
                ctrl.send_msg(self._sock, P.MSG_GOODBYE, 0)
            except ctrl.CtrlError:
                pass

    def _teardown(self):
        if self._fences is not None:
            self._fences.close()
            self._fences = self._stream = None
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
            self._goodbye()
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
            raise shard_error(-errno.EINVAL, f"grad_norm: norm_type {norm_type:g} is not supported: "
                              "use 2.0 or math.inf")
        where = f"grad_norm(step {step}, norm_type {norm_type:g})"
        c = self.run_many([(P.OP_GRAD_NORM, 0, step, 0, where, (P.f64_bits(norm_type), 0))], timeout)[0]
        norm = struct.unpack("<d", struct.pack("<Q", c.result[0]))[0]
        return norm, bool(c.result[1])

    def checkpoint(self, step, timeout=None):
        """Job-wide: every rank calls it with the same step after the step's
        STEPs completed. The daemon writes every group's params and optimizer
        state to <--state-dir>/<job>/step-<step> (docs/CHECKPOINTS.md); returns
        once it is durable. Raises ShardError (no --state-dir, not at a step
        boundary, a mismatch between ranks, a write failure)."""
        self.run_many([(P.OP_CHECKPOINT, 0, step, 0, f"checkpoint(step {step})", (0, 0))], timeout)

# SPDX-License-Identifier: MIT
"""The shared ring region, as proto/shardd_ring.h defines it, in pure Python.

This mirrors the C accessors one for one (attach, sq_push, needs_wakeup,
cq_ready, cq_pop, cq_wait); read the C header for the protocol, this file for
how Python keeps its memory-ordering rules.

Memory ordering from Python
---------------------------
Counters are read and written through ``memoryview(mmap).cast('I')``: each
item access is one aligned 4-byte load or store in C (``*(unsigned *)p``),
never torn.  ``struct.unpack_from('<I')`` is NOT used for counters: its
little-endian path assembles the value byte by byte and could read half of a
concurrent update.

Every access is a separate call into the interpreter's C code, so the C
compiler cannot move one access across another; what remains is what the CPU
may reorder:

* x86-64 (TSO): loads are not reordered with loads, stores not with stores,
  and a store is not reordered with an earlier load.  So every acquire load
  and release store of shardd_ring.h is already what a plain access gives,
  and ``_acquire()``/``_release()`` are no-ops there.  The one reordering TSO
  allows is a later load passing an earlier store (the store buffer).  The
  ring has two places where that matters, both "store, full barrier, load"
  handshakes (Dekker):

  1. ``needs_wakeup``: store sq_tail, then load flags.  Without a full
     barrier the daemon may set NEED_WAKEUP, see the old tail and sleep while
     we see the old flags and skip the doorbell: a lost wake-up.
  2. ``cq_wait``: store cq_waiters, then load cq_tail (mirror of the daemon's
     "store cq_tail, barrier, load cq_waiters" in shardd_cq_push).

  Pure Python has no fence instruction, so ``_full_fence`` calls
  ``atomic_thread_fence(memory_order_seq_cst)`` from gcc's libatomic through
  ctypes (libatomic is a compiler runtime, not libshardd).  When libatomic
  cannot be loaded, (1) degrades safely to ringing the doorbell after every
  submission (a spurious doorbell only costs the daemon a loop turn), and
  (2) is still safe: FUTEX_WAIT re-reads cq_tail in the kernel after the
  kernel's own full barrier (it increments the hash bucket's waiter count
  with an atomic read-modify-write before loading the word), so a completion
  published before our sleep makes the syscall return EAGAIN at once; in any
  case the caller sleeps in slices of at most 50 ms.

* Other architectures (arm64, ...): plain accesses give no ordering, so
  ``_acquire``/``_release`` call libatomic's fence with acquire / release
  order, and attaching a ring without libatomic raises ShardError.
"""

import ctypes
import ctypes.util
import errno
import platform
import time

from . import proto as P

_SEQ_CST = 5
_ACQUIRE = 2
_RELEASE = 3
_U32 = 0xFFFFFFFF

_TSO = platform.machine() in ("x86_64", "AMD64", "i686", "i386")


def _load_libatomic():
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return fn
    return None


_atomic_fence = _load_libatomic()


def _full_fence():
    """seq_cst fence; False when none is available (callers then stay safe)."""
    if _atomic_fence is None:
        return False
    _atomic_fence(_SEQ_CST)
    return True


if _TSO:
    def _acquire():
        """x86-64: loads are not reordered with later loads or stores."""

    def _release():
        """x86-64: stores are not reordered with earlier loads or stores."""
else:
    def _acquire():
        _atomic_fence(_ACQUIRE)

    def _release():
        _atomic_fence(_RELEASE)


# futex(2) through libc's syscall(); the number is per architecture.
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
              "ppc64le": 221, "s390x": 238, "i686": 240, "i386": 240}.get(platform.machine())
_FUTEX_WAIT = 0  # shared, not FUTEX_PRIVATE_FLAG: the word lives in another process's memory too
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr, seen, timeout_s):
    """Sleep while the u32 at address `addr` (shared memory) holds `seen`, at
    most timeout_s: 0 (woken, or the word had moved: EAGAIN), -ETIMEDOUT or
    -EINTR. Without a futex number for this machine, a short polling sleep."""
    if _SYS_FUTEX is None:
        time.sleep(min(timeout_s, 0.0005))
        return 0
    ts = _Timespec(int(timeout_s), int((timeout_s - int(timeout_s)) * 1e9))
    r = _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
                      ctypes.c_uint32(seen), ctypes.byref(ts), None, ctypes.c_int(0))
    if r < 0:
        e = ctypes.get_errno()
        return 0 if e == errno.EAGAIN else -e
    return 0


def futex_wake(addr):
    """Wake every process sleeping on the u32 at address `addr` (shared memory)."""
    if _SYS_FUTEX is not None:
        _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                      ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))


class RingError(Exception):
    """The ring region is invalid or its counters are corrupt; .code is -errno/-SHARDD_E_*."""

    def __init__(self, code, text):
        super().__init__(text)
        self.code = code


class Completion:
    """One reaped completion (struct shardd_cqe plus its message text)."""

    __slots__ = ("user_data", "res", "op", "group", "step", "msg", "result")

    def __init__(self, user_data, res, op, group, step, msg, result=(0, 0)):
        self.user_data = user_data
        self.res = res
        self.op = op
        self.group = group
        self.step = step
        self.msg = msg
        self.result = result  # cqe.result[0..1]: grad_norm's norm bits and non-finite flag

    def __repr__(self):
        op = P.OP_NAMES.get(self.op, str(self.op))
        return (f"Completion(op={op}, group={self.group}, step={self.step}, "
                f"res={P.error_name(self.res)}, user_data={self.user_data:#x}, msg={self.msg!r})")


class Ring:
    """Client side of one mapped ring region (shardd_ring_attach + accessors).

    Not thread-safe: the owning Client serialises callers.
    """

    def __init__(self, mem, size):
        if size < P.RING_HDR_SIZE or len(mem) < size or size % 8:
            raise RingError(-errno.EBADMSG, f"ring region of {size} bytes is smaller than its header")
        self._mem = mem
        self._u32 = memoryview(mem).cast("B")[:size].cast("I")
        self._u64 = memoryview(mem).cast("B")[:size].cast("Q")
        version = self._u32[P.RH_VERSION // 4]
        _acquire()  # version is published last: layout reads come after it
        if self._u32[P.RH_MAGIC // 4] != P.RING_MAGIC:
            raise RingError(-P.E_MAGIC, f"ring magic {self._u32[0]:#x}, expected {P.RING_MAGIC:#x}")
        if version >> 16 != P.PROTO_MAJOR:
            raise RingError(-P.E_VERSION, f"ring protocol major {version >> 16}, "
                                          f"this client speaks {P.PROTO_MAJOR}")
        h = self._u32
        self.sq_entries = h[P.RH_SQ_ENTRIES // 4]
        self.cq_entries = h[P.RH_CQ_ENTRIES // 4]
        self.sq_off = h[P.RH_SQ_OFF // 4]
        self.cq_off = h[P.RH_CQ_OFF // 4]
        self.msg_off = h[P.RH_MSG_OFF // 4]
        self.msg_size = h[P.RH_MSG_SIZE // 4]

        def pow2(v):
            return v and not v & (v - 1)

        if (not pow2(self.sq_entries) or not pow2(self.cq_entries)
                or self.msg_size != P.RING_MSG_SIZE or self.sq_off != P.RING_HDR_SIZE
                or self.cq_off != self.sq_off + self.sq_entries * P.SQE.size
                or self.msg_off != self.cq_off + self.cq_entries * P.CQE.size
                or P.ring_region_size(self.sq_entries, self.cq_entries) > size):
            raise RingError(-errno.EBADMSG,
                            f"ring layout (sq {self.sq_entries}, cq {self.cq_entries}, "
                            f"msg_size {self.msg_size}) does not fit a {size}-byte mapping")
        if not _TSO and _atomic_fence is None:
            raise RingError(-errno.ENOSYS, f"{platform.machine()} needs libatomic's "
                                           "atomic_thread_fence for ring ordering; install libatomic1")
        self.sq_mask = self.sq_entries - 1
        self.cq_mask = self.cq_entries - 1
        self.daemon_pid = h[P.RH_DAEMON_PID // 4]
        self.client_id = h[P.RH_CLIENT_ID // 4]
        self._tail_word = ctypes.c_uint32.from_buffer(mem, P.RH_CQ_TAIL)
        self._tail_addr = ctypes.addressof(self._tail_word)

    def release(self):
        """Drop the buffer exports so the mmap can be closed."""
        if self._mem is None:
            return
        self._u32.release()
        self._u64.release()
        del self._tail_word
        self._mem = None

    # ---------------------------------------------------------- header
    @property
    def flags(self):
        return self._u32[P.RH_FLAGS // 4]

    def status(self):
        """Snapshot of the header's diagnostic fields (struct shardd_ring_status)."""
        h, q = self._u32, self._u64
        return {
            "sq_entries": self.sq_entries, "cq_entries": self.cq_entries,
            "sq_pending": (h[P.RH_SQ_TAIL // 4] - h[P.RH_SQ_HEAD // 4]) & _U32,
            "cq_ready": (h[P.RH_CQ_TAIL // 4] - h[P.RH_CQ_HEAD // 4]) & _U32,
            "flags": h[P.RH_FLAGS // 4],
            "daemon_last_op": h[P.RH_DAEMON_LAST_OP // 4],
            "daemon_last_step": q[P.RH_DAEMON_LAST_STEP // 8],
            "daemon_heartbeat_ns": q[P.RH_DAEMON_HEARTBEAT_NS // 8],
            "client_last_op": h[P.RH_CLIENT_LAST_OP // 4],
            "client_last_step": q[P.RH_CLIENT_LAST_STEP // 8],
        }

    # ---------------------------------------------------------- submission
    def sq_next_slot(self):
        """shardd_sq_next_slot: the SQ slot the next sq_push fills, or None
        when the SQ is full (a stream fence records that slot's event first)."""
        h = self._u32
        tail = h[P.RH_SQ_TAIL // 4]
        head = h[P.RH_SQ_HEAD // 4]
        _acquire()  # head before reusing its slot: the daemon copied the entry out first
        if (tail - head) & _U32 >= self.sq_entries:
            return None
        return tail & self.sq_mask

    def sq_push(self, op, group, step, user_data, flags, args=(0, 0), fence=0):
        """shardd_sq_push: returns True, or False when the SQ is full."""
        h = self._u32
        tail = h[P.RH_SQ_TAIL // 4]
        if self.sq_next_slot() is None:
            return False
        P.SQE.pack_into(self._mem, self.sq_off + (tail & self.sq_mask) * P.SQE.size,
                        op, fence, group, step, user_data, flags, 0, args[0], args[1], 0, 0)
        h[P.RH_CLIENT_LAST_OP // 4] = op
        self._u64[P.RH_CLIENT_LAST_STEP // 8] = step
        _release()  # entry before the tail: the daemon reads tail with acquire
        h[P.RH_SQ_TAIL // 4] = (tail + 1) & _U32
        return True

    def needs_wakeup(self):
        """shardd_ring_needs_wakeup: full barrier between the tail store and the
        flag load (see the module comment); without a fence, always True."""
        if not _full_fence():
            return True
        return bool(self._u32[P.RH_FLAGS // 4] & P.RING_NEED_WAKEUP)

    # ---------------------------------------------------------- completion
    def cq_ready(self):
        """shardd_cq_ready: completions waiting; RingError when the tail is corrupt."""
        tail = self._u32[P.RH_CQ_TAIL // 4]
        _acquire()
        head = self._u32[P.RH_CQ_HEAD // 4]
        n = (tail - head) & _U32
        if n > self.cq_entries:
            raise RingError(-errno.EBADMSG, f"daemon's cq_tail {tail} is {n} entries ahead of "
                                            f"cq_head {head}, capacity {self.cq_entries}")
        return n

    def cq_pop(self, on_fence=None):
        """shardd_cq_peek + shardd_cq_release: copy the next completion out,
        then release its slot. Call only when cq_ready() > 0. A fenced
        completion (cqe.fence) calls on_fence(slot) before the release (the
        daemon records that slot's event again only after it): it returns
        None, or (res, msg) that replace the completion's when the
        ordering failed; without on_fence such a completion fails EPROTO."""
        h = self._u32
        head = h[P.RH_CQ_HEAD // 4]
        slot = head & self.cq_mask
        user_data, res, op, has_msg, fence, group, _r1, step, w0, w1, *_ = P.CQE.unpack_from(
            self._mem, self.cq_off + slot * P.CQE.size)
        msg = ""
        if has_msg:
            off = self.msg_off + slot * self.msg_size
            raw = bytes(self._mem[off:off + self.msg_size - 1])
            msg = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        if fence:
            failed = on_fence(slot) if on_fence else (
                -errno.EPROTO, "the daemon fenced a completion of this client, which set up no stream")
            if failed is not None and res >= 0:
                res, msg = failed
        _release()  # entry and text copied before the slot goes back to the daemon
        h[P.RH_CQ_HEAD // 4] = (head + 1) & _U32
        return Completion(user_data, res, op, group, step, msg, (w0, w1))

    def cq_tail(self):
        return self._u32[P.RH_CQ_TAIL // 4]

    def cq_wait(self, seen, timeout_s):
        """shardd_cq_wait: sleep until cq_tail != seen or timeout_s passes.
        Returns 0 or -ETIMEDOUT / -EINTR."""
        h = self._u32
        # One waiting thread per Client (it holds the client lock), so a
        # plain increment of our own line is the fetch_add.
        h[P.RH_CQ_WAITERS // 4] = (h[P.RH_CQ_WAITERS // 4] + 1) & _U32
        try:
            _full_fence()  # waiter count before the tail re-check; pairs with shardd_cq_push
            if h[P.RH_CQ_TAIL // 4] != seen:
                return 0
            return futex_wait(self._tail_addr, seen, timeout_s)
        finally:
            h[P.RH_CQ_WAITERS // 4] = (h[P.RH_CQ_WAITERS // 4] - 1) & _U32

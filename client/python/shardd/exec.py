# SPDX-License-Identifier: MIT
"""The rank side of rank-executed groups (PROTOCOL.md 3.8 "Rank-executed
groups"), in numpy, as libshardd's client/exec.c does it: unshard, reduce
and reshard of such a group run in this process, on the job's shared
buffers, with the daemon's arithmetic (kernels/reduce.c, cast.c,
divide.c), so the bytes are the daemon's, bit for bit: ranks summed
0..N-1 in fp32, rounded once.

Order: each op of a group is numbered n within the group's epoch. A rank
publishes seq = (epoch, n) in its slot when its inputs are final (its flat
shard for an unshard, its grad buffer for a reduce), waits for every
peer's seq to reach n, then reads the peers' buffers. A reduce also
publishes done = (epoch, n) once it has read them, and completes only when
every peer's done reached n: the caller may then write its grad buffer
again. Submission only publishes; the op runs when the client polls or
waits (Client.poll/wait, Pending.wait, every sync call). Waits spin a
little, then sleep on the peer's word (a shared futex) in short naps,
bounded by the collective timeout; a new epoch (a rank left) fails them,
naming that rank. An op that fails before it read anything (or a reduce
whose peer left before finishing it) gives its number back, with the
group's ops queued behind it, so that the ranks number their next ops alike.

Memory ordering is ring.py's: the slot's and sync page's words are read
and written through ``memoryview.cast`` items (one aligned load or store
each), plain accesses are acquire loads and release stores on x86-64, and
the two "store, then load the other side's word" handshakes (publish, then
look at the peers' ``sleeping``; mark ``sleeping``, then re-read the peer's
word) take ring.py's full fence. Every value read from a peer is
untrusted: garbage there makes this rank's op wait or fail, nothing more.
"""

import errno
import fcntl
import mmap
import os
import struct
import time

import numpy as np

from . import proto as P
from . import ring as R
from .error import ShardError, shard_error
from .ring import Completion

EXEC_NAP_S = 0.001        # longest sleep on a peer's word between looks at the CQ and the deadline

_U32 = 0xFFFFFFFF
_RAW = {P.DTYPE_FP32: np.dtype(np.uint32), P.DTYPE_BF16: np.dtype(np.uint16),
        P.DTYPE_FP16: np.dtype(np.uint16)}


def _op_name(op):
    return P.OP_NAMES.get(op, "?")


# ---------------------------------------------------------------- the daemon's arithmetic

def to_f32(raw, dtype):
    """Elements of `dtype` (raw bits: uint32 / uint16 arrays) widened to a new
    float32 array: exact, a NaN comes back quiet (kernels/cast.c)."""
    if dtype == P.DTYPE_BF16:
        u = raw.astype(np.uint32) << 16
        u |= np.where((raw & 0x7FFF) > 0x7F80, np.uint32(0x00400000), np.uint32(0))
        return u.view(np.float32)
    if dtype == P.DTYPE_FP16:
        with np.errstate(all="ignore"):
            f = raw.view(np.float16).astype(np.float32)
        nan = ((raw & 0x7C00) == 0x7C00) & ((raw & 0x03FF) != 0)
        if nan.any():
            h = raw.astype(np.uint32)
            bits = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13) | 0x00400000
            f = np.where(nan, bits.astype(np.uint32).view(np.float32), f)
        return f
    return raw.view(np.float32).copy()


def from_f32(x, dtype):
    """float32 values rounded to `dtype` to nearest even, as raw bits (cast.c:
    Inf stays Inf, a NaN is truncated with its quiet bit set)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if dtype == P.DTYPE_BF16:
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
    if dtype == P.DTYPE_FP16:
        with np.errstate(all="ignore"):
            h = x.astype(np.float16).view(np.uint16)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        if nan.any():
            q = (((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)).astype(np.uint16)
            h = np.where(nan, q, h)
        return h
    return u.copy()


def round_to(x, dtype):
    """x rounded to `dtype` and widened back (shardd_k_round; fp32 and NONE: x)."""
    if dtype in (P.DTYPE_BF16, P.DTYPE_FP16):
        return to_f32(from_f32(x, dtype), dtype)
    return x


def cast(raw, src, dst):
    """Raw elements of dtype src as raw elements of dtype dst (shardd_k_cast:
    through fp32, which widens exactly, so one rounding)."""
    if src == dst:
        return raw
    return from_f32(to_f32(raw, src), dst)


def divide_factors(world, reduce_dtype):
    """(pre, avg, post) of FSDP2's reduce over `world` ranks (kernels/divide.c,
    as client/exec.c turns them into struct shardd_reduce_math): AVG for
    fp32 and bf16; fp16 divides by a power of two near sqrt(world) before
    the sum and by world over it after."""
    if reduce_dtype != P.DTYPE_FP16:
        return np.float32(1), np.float32(world), np.float32(1)
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return np.float32(factor), np.float32(1), np.float32(world / factor)


def reduce_values(inputs, in_dtype, reduce_dtype, pre, avg, post):
    """shardd_k_reduce's formula up to its cast to the output dtype: float32
    values of the inputs (raw, in_dtype) summed in input order."""
    round_in = reduce_dtype not in (P.DTYPE_FP32, P.DTYPE_NONE) and reduce_dtype != in_dtype
    acc = None
    with np.errstate(all="ignore"):
        for raw in inputs:
            x = to_f32(raw, in_dtype)
            if round_in:
                x = round_to(x, reduce_dtype)
            if pre > 1:
                x = round_to(x / pre, reduce_dtype)
            # The sum starts from x_0, not from +0: inputs that are all -0 sum to -0.
            acc = x if acc is None else acc + x
        if avg != 1:
            acc = acc / avg
        acc = round_to(acc, reduce_dtype)
        if post > 1:
            acc = round_to(acc / post, reduce_dtype)
    return acc


# ---------------------------------------------------------------- geometry

class _Geometry:
    """Where one param's shard sits in the full tensor (client/group.c's
    shardd_group_geometry): outer x dim x inner elements; this rank holds
    rows [begin, begin + rows) of dim, `valid` of them real."""

    __slots__ = ("numel", "outer", "dim", "inner", "rows", "begin", "valid", "shard_numel")

    def __init__(self, p, world, rank):
        shape = p.shape
        self.numel = int(np.prod(shape, dtype=object)) if shape else 1
        self.outer = self.inner = 1
        self.dim = 1  # a 0-d param is a 1-row tensor
        if shape:
            self.dim = shape[p.shard_dim]
            for d in shape[:p.shard_dim]:
                self.outer *= d
            for d in shape[p.shard_dim + 1:]:
                self.inner *= d
        if p.shard_dim == 0 or not shape:
            self.rows = -(-self.dim // world)
        else:
            if self.dim % world:
                raise ValueError(f"param '{p.name}': Shard({p.shard_dim}) of {self.dim} rows does not "
                                 f"split over {world} ranks")
            self.rows = self.dim // world
        self.begin = rank * self.rows
        self.valid = min(max(self.dim - self.begin, 0), self.rows)
        self.shard_numel = self.outer * self.rows * self.inner


# ---------------------------------------------------------------- mappings

def _addr(mem, offset):
    """The address of byte `offset` of a mapping (writable or not): a futex word."""
    return np.frombuffer(mem, np.uint8, count=1, offset=offset).ctypes.data


def _close(mem):
    """Unmap, or leave it to the collector while a numpy view still holds it."""
    try:
        mem.close()
    except BufferError:
        pass


def _map_ro(fd, size, what):
    """`size` bytes of memfd `fd`, read-only; the fd sealed against shrinking (a
    peer cannot pull the pages away)."""
    st = os.fstat(fd)
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if st.st_size < size:
        raise shard_error(-P.E_MALFORMED, f"{what}: fd of {st.st_size} bytes, reply says {size}")
    if not seals & fcntl.F_SEAL_SHRINK:
        raise shard_error(-P.E_MALFORMED, f"{what}: not a memfd sealed against shrinking "
                                          f"(seals {seals:#x})")
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)


class _Slot:
    """A rank's slot (struct shardd_exec_slot) in a mapping of its grad buffer."""

    __slots__ = ("q", "i", "seq_addr", "done_addr")

    def __init__(self, mem, off):
        view = memoryview(mem)[off:off + P.EXEC_PAGE]
        self.q = view.cast("Q")
        self.i = view.cast("I")
        self.seq_addr = _addr(mem, off + P.XL_SEQ)
        self.done_addr = _addr(mem, off + P.XL_DONE)

    def word(self, field):
        return self.q[field // 8]

    def set_word(self, field, value):
        self.q[field // 8] = value

    def u32(self, field):
        return self.i[field // 4]

    def set_u32(self, field, value):
        self.i[field // 4] = value

    def release(self):
        self.q.release()
        self.i.release()


class _Peer:
    """A rank's buffers as this rank sees them: its own mappings, or a peer's
    read-only ones (EXEC_MAP) of generation `gen`."""

    __slots__ = ("gen", "shard", "grad", "slot", "own")

    def __init__(self, gen, shard, grad, slot, own):
        self.gen, self.shard, self.grad, self.slot, self.own = gen, shard, grad, slot, own

    def drop(self):
        if self.slot is not None:
            self.slot.release()
        if not self.own:
            for m in (self.shard, self.grad):
                if m is not None:
                    _close(m)


class _Op:
    """One op submitted on a rank-executed group, not complete yet."""

    __slots__ = ("x", "op", "flags", "step", "user_data", "args", "epoch", "n", "read",
                 "deadline", "ran", "keep", "prev_seq", "prev_op", "prev_step", "prev_reduces",
                 "backup")

    def __init__(self, x, op, flags, step, user_data, args, deadline):
        self.x, self.op, self.flags, self.step = x, op, flags, step
        self.user_data, self.args, self.deadline = user_data, args, deadline
        self.epoch = self.n = 0
        self.read = False   # a reduce read its inputs and published done
        self.ran = False    # a reduce with REDUCE_STEP ran here: its step still goes to the daemon
        # Failed where a peer that gave up on it kept its number: keep it too.
        self.keep = False
        # This rank's slot before the op was published: put back if it fails unread (retract).
        self.prev_seq = self.prev_op = self.prev_step = 0
        self.prev_reduces = 0   # a reduce: the slot's count before it
        self.backup = None      # an accumulating reduce: the sharded grad before it


# ---------------------------------------------------------------- one group

class ExecState:
    """The rank side of one rank-executed group: the sync page, this rank's
    slot, its peers' mappings, and the order of its ops."""

    def __init__(self, group, sync_fd, second, where):
        self.g = group
        self.client = group.client
        self.world = group.shard_world
        self.rank = self.client.rank
        self.second = second
        self.epoch = self.n = 0
        self.held = False
        self.peers = [None] * self.world
        self.sync = None
        self._sync_u32 = None
        if self.client.backend != P.BACKEND_HOST or self.rank >= self.world:
            raise shard_error(-P.E_MALFORMED, f"{where}: group '{group.name}' is rank-executed, but "
                                              f"the backend is {self.client.backend} and rank "
                                              f"{self.rank} of a shard group of {self.world}")
        try:
            self.sync = _map_ro(sync_fd, P.exec_sync_size(self.world), f"{where}: the sync page")
            self._sync_u32 = memoryview(self.sync).cast("I")
            self.changes_addr = _addr(self.sync, P.XS_CHANGES)
            s = self._sync_u32
            magic = s[P.XS_MAGIC // 4]
            R._acquire()  # magic is stored last: the header's other fields after it
            head = (s[P.XS_VERSION // 4], s[P.XS_WORLD // 4], s[P.XS_GROUP_ID // 4])
            if magic != P.EXEC_MAGIC or head != (P.EXEC_VERSION, self.world, group.id):
                raise shard_error(-P.E_MALFORMED,
                                  f"{where}: sync page magic {magic:#x} version {head[0]} world "
                                  f"{head[1]} group {head[2]}, want {P.EXEC_MAGIC:#x}, "
                                  f"{P.EXEC_VERSION}, {self.world}, {group.id}")
            grad = group.maps[group.GRAD]
            self.mine = _Slot(grad, P.exec_slot_offset(group.grad_size))
            self.peers[self.rank] = _Peer(0, group.maps[group.SHARD], grad, self.mine, True)
            try:
                self.geo = [_Geometry(p, self.world, self.rank) for p in group.params]
            except ValueError as e:
                raise shard_error(-P.E_MALFORMED, f"{where}: {e}") from None
            # FSDP2's divide factors for one reduce-scatter over the shard group (the daemon's).
            self.reduce_dtype = group.reduce_dtype if group.reduce_dtype != P.DTYPE_NONE \
                else group.grad_dtype
            self.math = divide_factors(self.world, self.reduce_dtype)
            # A second handle: the first one published these buffers and runs the ops.
            if not second:
                self._map(self.rank, where)
        except BaseException:
            self.detach()
            raise

    def detach(self):
        for i, p in enumerate(self.peers):
            if p is not None:
                p.drop()
            self.peers[i] = None
        if self._sync_u32 is not None:
            self._sync_u32.release()
            self._sync_u32 = None
        if self.sync is not None:
            _close(self.sync)
            self.sync = None

    # ------------------------------------------------------------ the sync page
    def _epoch(self):
        return self._sync_u32[P.XS_EPOCH // 4]

    def _gen(self, r):
        return self._sync_u32[P.XS_GEN // 4 + r]

    def changes(self):
        return self._sync_u32[P.XS_CHANGES // 4]

    # ------------------------------------------------------------ EXEC_MAP
    def _map(self, peer, where):
        """EXEC_MAP for `peer`: this rank's own (publish it) or another's
        buffers, mapped read-only. ShardError SHARDD_E_STATE: the peer has
        not published them yet."""
        g = self.g
        grad_map = P.exec_grad_map_size(g.grad_size)
        what = f"{where}: EXEC_MAP for group {g.id} rank {peer}"
        _t, reply, fds = self.client._request(
            P.MSG_EXEC_MAP, P.EXEC_MAP.pack(g.id, peer), self.client._sync_timeout(),
            P.MSG_EXEC_MAP_REPLY, what)
        try:
            if len(reply) != P.EXEC_MAP_REPLY.size:
                raise shard_error(-P.E_MALFORMED, f"{what}: reply of {len(reply)} bytes, want "
                                                  f"{P.EXEC_MAP_REPLY.size}")
            gid, rpeer, gen, nfds, shard_size, grad_size = P.EXEC_MAP_REPLY.unpack(reply)
            own = peer == self.rank
            if gid != g.id or rpeer != peer or not gen or nfds != (0 if own else 2) or \
                    nfds != len(fds) or (nfds and (shard_size != g.shard_size or grad_size != grad_map)):
                raise shard_error(-P.E_MALFORMED,
                                  f"{what}: reply has group_id {gid}, peer {rpeer}, gen {gen}, {nfds} "
                                  f"fds ({len(fds)} sent), sizes {shard_size}/{grad_size} (want "
                                  f"{g.shard_size}/{grad_map})")
            if own:
                self.peers[peer].gen = gen
                return
            shard = _map_ro(fds[0], shard_size, f"{what}: its flat shard") if shard_size else None
            try:
                grad = _map_ro(fds[1], grad_size, f"{what}: its grad buffer")
            except BaseException:
                if shard is not None:
                    _close(shard)
                raise
            old = self.peers[peer]
            self.peers[peer] = _Peer(gen, shard, grad, _Slot(grad, P.exec_slot_offset(g.grad_size)),
                                     False)
            if old is not None:
                old.drop()
        finally:
            for fd in fds:
                os.close(fd)

    def other_slots(self):
        return [p.slot for r, p in enumerate(self.peers) if r != self.rank and p is not None]

    # ------------------------------------------------------------ publishing and sleeping
    def publish(self, field, value):
        """Release-store a sequence word of this rank's slot, then wake the peers
        that sleep on it (their slots say so)."""
        self.mine.set_word(field, value)
        fenced = R._full_fence()  # the word before the peers' `sleeping`: pairs with sleep()
        addr = self.mine.seq_addr if field == P.XL_SEQ else self.mine.done_addr
        for s in self.other_slots():
            # Without a fence the word and the flag may pass each other: always wake.
            if not fenced or s.u32(P.XL_SLEEPING):
                R.futex_wake(addr)
                return

    def sleep(self, slot, field, seen, timeout_s):
        """Sleep until peer `slot`'s word `field` may have moved from `seen`, or
        timeout_s: marks this rank's `sleeping` first, so that a publisher that
        stores after the mark sees it and wakes the futex."""
        self.mine.set_u32(P.XL_SLEEPING, 1)
        R._full_fence()
        try:
            if slot.word(field) == seen:
                R.futex_wait(slot.seq_addr if field == P.XL_SEQ else slot.done_addr,
                             seen & _U32, timeout_s)
        finally:
            self.mine.set_u32(P.XL_SLEEPING, 0)

    # ------------------------------------------------------------ submission
    def _write_op(self, word, op, step):
        """The op and step of this rank's op `word`, `what` first behind a
        release fence (a seqlock, shardd_exec_write_op): a peer that finds
        `what` unchanged around reading them read this op's."""
        self.mine.set_word(P.XL_WHAT, word)
        R._release()
        self.mine.set_u32(P.XL_OP, op)
        self.mine.set_word(P.XL_STEP, step)

    def submit(self, op, step, flags, args, user_data):
        """Publish op (unshard, reduce, reshard) as this rank's next: its inputs
        are final now. Returns the _Op, or a Completion when a reduce's step is
        refused before it gathers."""
        g = self.g
        if self.second:
            raise shard_error(-P.E_STATE, f"{_op_name(op)}(group '{g.name}'): this handle is this "
                                          f"client's second of the rank-executed group, which maps "
                                          f"its buffers read-only; submit through the first")
        if flags & ~(P.REDUCE_STEP if op == P.OP_REDUCE else 0):
            raise shard_error(-P.E_INVALID, f"{_op_name(op)}(group '{g.name}'): flags = {flags:#x}: "
                                            f"a rank-executed group takes none but "
                                            f"SHARDD_REDUCE_STEP on a reduce (it has no replicate dim)")
        if op == P.OP_REDUCE and flags & P.REDUCE_STEP:
            refused = self._step_refused(step, args, user_data)
            if refused is not None:
                return refused
        o = _Op(self, op, flags, step, user_data, args,
                time.monotonic_ns() + self.client.collective_timeout_ms * 1000000)
        if op != P.OP_RESHARD:
            # A rank left since this rank's last op: a new epoch, counted from 1 again.
            epoch = self._epoch()
            if epoch != self.epoch:
                self.epoch, self.n = epoch, 0
            self.n += 1
            o.epoch, o.n = self.epoch, self.n
            o.prev_seq, o.prev_op = self.mine.word(P.XL_SEQ), self.mine.u32(P.XL_OP)
            o.prev_step = self.mine.word(P.XL_STEP)
            # The inputs are final now (the caller's contract): op, step, then seq.
            self._write_op(P.exec_word(o.epoch, o.n), op, step)
            R._release()
            self.publish(P.XL_SEQ, P.exec_word(o.epoch, o.n))
        return o

    def _step_refused(self, step, args, user_data):
        """A reduce whose step the daemon will refuse is refused before it
        gathers, as the daemon refuses it before its rendezvous (same words)."""
        g = self.g
        lr = struct.unpack("<d", struct.pack("<Q", args[0]))[0]
        if g.optimizer == P.OPTIM_NONE:
            msg = (f"shardd: reduce(group '{g.name}'): the group was registered without an optimizer; "
                   f"register it with one (SHARDD_REGISTER_OPTIMIZER) or update its shards in the "
                   f"trainer")
        elif step == 0:
            msg = f"shardd: reduce(group '{g.name}'): step = 0; steps are numbered from 1"
        elif not lr >= 0 or lr > 1e300:
            msg = (f"shardd: reduce(group '{g.name}', step {step}): lr = {lr:g}; the learning rate "
                   f"must be finite and >= 0")
        else:
            return None
        res = -P.E_STATE if g.optimizer == P.OPTIM_NONE else -P.E_INVALID
        return Completion(user_data, res, P.OP_REDUCE, g.id, step, msg)

    # ------------------------------------------------------------ where the peers are
    def _missing(self, o, field):
        out = []
        for r, p in enumerate(self.peers):
            if r == self.rank or (p is not None and P.exec_reached(p.slot.word(field), o.epoch, o.n)):
                continue
            out.append(str(r))
        return ", ".join(out)

    def _peer_ready(self, o, r):
        """None when mapped peer r has not reached op o, else (0, "") or a
        MISMATCH (code, text) when it is exactly at o with another op or step."""
        s = self.peers[r].slot
        seen = s.word(P.XL_SEQ)
        if _gave_up(o, s):
            # The daemon's words for a late arrival at a rendezvous that timed out. A peer
            # that gave up before it read had given its number back, and so does this
            # rank; one that gave up waiting for the others to finish reading its grads
            # kept it, and so does this rank, so that their next ops are numbered alike.
            o.keep = P.exec_reached(s.word(P.XL_SEQ), o.epoch, o.n)
            return (-P.E_TIMEOUT,
                    f"shardd: {_op_name(o.op)}(group '{self.g.name}', step {o.step}): rank "
                    f"{self.rank} arrived after rank {r} gave up waiting for it (the collective "
                    f"timeout, {self.client.collective_timeout_ms / 1e3:g} s); failed at once: retry "
                    f"with the others")
        if not P.exec_reached(seen, o.epoch, o.n):
            return None
        # Exactly at this op (not past it, nor writing a later one): the same op and step,
        # read whole (shardd_exec_read_op).
        word = P.exec_word(o.epoch, o.n)
        before = s.word(P.XL_WHAT)
        R._acquire()
        pop, pstep = s.u32(P.XL_OP), s.word(P.XL_STEP)
        R._acquire()
        if before == word and s.word(P.XL_WHAT) == word and (pop != o.op or pstep != o.step):
            return (-P.E_MISMATCH,
                    f"shardd: group '{self.g.name}': ranks disagree on op {o.n} of the epoch: rank "
                    f"{self.rank} submitted {_op_name(o.op)} step {o.step}, rank {r} "
                    f"{_op_name(pop)} step {pstep}")
        return 0, ""

    def _reduce_abandoned(self, o, r, gen):
        """(1, "") for a peer r (now at generation gen) that reached op o, or
        SHARDD_E_PEER_DIED when o is a reduce that r left before it stored its
        done: r never wrote its own output, so the reduce fails on every rank
        alike (each sees the same final words in its mapping of the departed
        peer's slot) and is retried whole, at once: waiting for the done phase
        would leave a rank still reading waiting for a peer that has already
        failed and given its number back."""
        p = self.peers[r]
        if (o.op != P.OP_REDUCE or gen == p.gen or
                P.exec_reached(p.slot.word(P.XL_DONE), o.epoch, o.n)):
            return 1, ""
        return (-P.E_PEER_DIED,
                f"shardd: reduce(group '{self.g.name}', step {o.step}): rank {r} left (its client "
                f"is gone) before it finished this rank-executed reduce; retry it once the rank is "
                f"back")

    def _peer_at(self, o, r, done):
        """Whether peer r reached op o (its seq, or its done when `done`),
        mapping its buffers first when its generation changed: (1, ""), (0, ""),
        or (code, text). Sets self.wait_on to what to sleep on. A reduce whose
        peer left before it stored its done fails (_reduce_abandoned), whether
        this rank has written its output yet or not."""
        self.wait_on = None
        g = self.g
        gen = self._gen(r)
        p = self.peers[r]
        if done:
            seen = p.slot.word(P.XL_DONE)
            if not P.exec_reached(seen, o.epoch, o.n):
                if gen == p.gen:
                    self.wait_on = (p.slot, P.XL_DONE, seen)
                    return 0, ""
                return self._reduce_abandoned(o, r, gen)
            if _gave_up(o, p.slot):
                # It read this rank's grads, but too late: it has failed the reduce, and so
                # does this rank.
                return (-P.E_TIMEOUT,
                        f"shardd: reduce(group '{g.name}', step {o.step}): rank {self.rank} "
                        f"finished reading after rank {r} gave up waiting for it (the collective "
                        f"timeout, {self.client.collective_timeout_ms / 1e3:g} s); failed at once: "
                        f"retry with the others")
            return 1, ""
        # A peer that reached the op before it left counts: its buffers stay mapped here.
        if p is not None and p.gen:
            ready = self._peer_ready(o, r)
            if ready is not None:
                return ready if ready[0] else self._reduce_abandoned(o, r, gen)
        if gen == P.EXEC_GONE:
            # It may have reached the op in buffers this rank never mapped (it
            # attached again, ran, and left): the daemon still lends what it
            # published last.
            try:
                self._map(r, f"{_op_name(o.op)}(group '{g.name}')")
                ready = self._peer_ready(o, r)
                if ready is not None:
                    return ready if ready[0] else self._reduce_abandoned(o, r, gen)
            except ShardError:
                pass
            return (-P.E_PEER_DIED,
                    f"shardd: {_op_name(o.op)}(group '{g.name}', step {o.step}): rank {r} left (its "
                    f"client is gone) and has not attached again; retry once it is back")
        if self._epoch() != o.epoch:
            dead = self._sync_u32[P.XS_DEAD_RANK // 4]
            return (-P.E_PEER_DIED,
                    f"shardd: {_op_name(o.op)}(group '{g.name}', step {o.step}): rank "
                    f"{dead - 1 if dead else 0} left (its client is gone) and attached again during "
                    f"this rank-executed op; retry it")
        if gen and gen != (p.gen if p else 0):
            try:
                self._map(r, f"{_op_name(o.op)}(group '{g.name}')")
            except ShardError as e:
                # SHARDD_E_STATE: it left again since; wait for its next generation.
                if e.code != -P.E_STATE:
                    return e.code, (f"shardd: {_op_name(o.op)}(group '{g.name}'): mapping rank {r}'s "
                                    f"buffers: {e.text}")
            p = self.peers[r]
        if p is None or not p.gen or p.gen != gen:
            return 0, ""
        ready = self._peer_ready(o, r)
        if ready is not None:
            return ready if ready[0] else (1, "")
        self.wait_on = (p.slot, P.XL_SEQ, p.slot.word(P.XL_SEQ))
        return 0, ""

    def _peers_at(self, o, done):
        """Whether every peer reached op o: (1, ""), (0, "") with self.wait_on
        (the first one that has not), or (code, text), a timeout past the op's
        deadline naming the ranks missing."""
        # Every peer, not only up to the first that is not there: one that left fails
        # the op now.
        waiting, wait_on = False, None
        for r in range(self.world):
            if r == self.rank:
                continue
            ret, msg = self._peer_at(o, r, done)
            if ret < 0:
                return ret, msg
            if ret == 0 and not waiting:
                waiting, wait_on = True, self.wait_on
        if waiting:
            self.wait_on = wait_on
            if time.monotonic_ns() < o.deadline:
                return 0, ""
            who = self._missing(o, P.XL_DONE if done else P.XL_SEQ)
            to = "finish reading this rank's grads" if done else "submit it"
            # The daemon's words for a rendezvous that timed out.
            return (-P.E_TIMEOUT,
                    f"shardd: {_op_name(o.op)}(group '{self.g.name}', step {o.step}): rank(s) "
                    f"{who or '?'} did not {to} within {self.client.collective_timeout_ms / 1e3:g} s; "
                    f"rank {self.rank} is waiting")
        self.wait_on = None
        return 1, ""

    # ------------------------------------------------------------ the ops
    def _raw(self, mem, dtype, offset, count):
        return np.frombuffer(mem, _RAW[dtype], count=count, offset=offset)

    def run_unshard(self):
        """Every rank's flat shard rows into this rank's unsharded copy (FSDP2's
        all-gather + copy-out)."""
        g = self.g
        out = g.maps[g.UNSHARDED]
        for i, p in enumerate(g.params):
            geo = self.geo[i]
            if not geo.numel:
                continue
            lay = g.layouts[i]
            dt = p.dtype
            udt = g.param_dtype if g.param_dtype != P.DTYPE_NONE else dt
            chunk = geo.rows * geo.inner
            dst = np.frombuffer(out, _RAW[udt], count=geo.numel, offset=lay[0])
            srcs = [self._raw(self.peers[s].shard, dt, lay[4], geo.shard_numel)
                    for s in range(self.world)]
            if p.shard_dim == 0 or not p.shape:
                # Dim 0: shard s holds elements [s * chunk, s * chunk + its valid rows).
                for s, src in enumerate(srcs):
                    begin = s * chunk
                    n = min(chunk, max(geo.numel - begin, 0))
                    if n:
                        dst[begin:begin + n] = cast(src[:n], dt, udt)
            else:
                # Shard(i > 0): FSDP2's chunk-cat, dst[o][s][k] = src_s[o][k].
                d = dst.reshape(geo.outer, self.world, chunk)
                for s, src in enumerate(srcs):
                    d[:, s, :] = cast(src.reshape(geo.outer, chunk), dt, udt)

    def run_reduce(self, accumulate):
        """This rank's rows of every rank's grad, summed in rank order, into its
        sharded grad (FSDP2's reduce-scatter)."""
        g = self.g
        out_mem = g.maps[g.SHARD_GRAD]
        pre, avg, post = self.math
        for i, p in enumerate(g.params):
            geo = self.geo[i]
            if not geo.shard_numel:
                continue
            lay = g.layouts[i]
            odt = p.dtype
            gdt = g.param_dtype if g.param_dtype != P.DTYPE_NONE else odt
            block = geo.valid * geo.inner
            out = np.frombuffer(out_mem, _RAW[odt], count=geo.shard_numel, offset=lay[4]) \
                .reshape(geo.outer, geo.rows * geo.inner)
            if block:
                first = self.rank * geo.rows * geo.inner
                ins = [self._raw(self.peers[k].grad, gdt, lay[2], geo.numel)
                       .reshape(geo.outer, geo.dim * geo.inner)[:, first:first + block]
                       for k in range(self.world)]
                s = reduce_values(ins, gdt, self.reduce_dtype, pre, avg, post)
                if accumulate:
                    with np.errstate(all="ignore"):
                        s = round_to(s, odt) + to_f32(out[:, :block], odt)
                out[:, :block] = from_f32(s, odt)
            # Padding rows (dim 0, where outer is 1) read as zero.
            if geo.valid < geo.rows:
                out[:, block:] = 0

    def advance(self, o):
        """Advance op o as far as it goes now: None while it waits (self.wait_on:
        what on), else its (res, text)."""
        mine = self.mine
        self.wait_on = None
        if o.op == P.OP_RESHARD:
            if not self.held:
                return (-P.E_STATE, f"shardd: rank {self.rank} has no unsharded copy of group "
                                    f"'{self.g.name}' to reshard")
            self.held = False
            mine.set_word(P.XL_RESHARDS, mine.word(P.XL_RESHARDS) + 1)
            return 0, ""
        if not o.read:
            ret, msg = self._peers_at(o, False)
            if ret <= 0:
                return (ret, msg) if ret < 0 else None
            R._acquire()  # the peers' inputs after their seq
            if o.op == P.OP_UNSHARD:
                self.run_unshard()
                self.held = True
                R._release()
                mine.set_word(P.XL_UNSHARDS, mine.word(P.XL_UNSHARDS) + 1)
                return 0, ""
            accumulate = mine.word(P.XL_REDUCES) != mine.word(P.XL_CLEARED)
            # What an accumulating reduce adds to, kept until it completes (retract).
            if accumulate and self.g.shard_size:
                o.backup = bytes(self.g.maps[self.g.SHARD_GRAD])
            self.run_reduce(accumulate)
            # The sharded grad holds the sum: counted before done is stored, so a renewed
            # slot (this rank died past here) says so.
            R._release()
            o.prev_reduces = mine.word(P.XL_REDUCES)
            mine.set_word(P.XL_REDUCES, o.prev_reduces + 1)
            self.publish(P.XL_DONE, P.exec_word(o.epoch, o.n))
            o.read = True
        ret, msg = self._peers_at(o, True)
        if ret == 0:
            return None
        return (ret, msg) if ret < 0 else (0, "")

    def give_up(self, o):
        """Op o failed past its collective timeout: a peer that comes to it later
        fails it at once. Stored after any retraction, so that a peer that sees
        it sees whether the number was given back."""
        self.mine.set_word(P.XL_GAVE_UP_STEP, o.step)
        R._release()
        self.mine.set_word(P.XL_GAVE_UP, P.exec_word(o.epoch, o.n))

    def retract(self, o):
        """Op o failed where no rank can have completed it: before it read
        anything (a peer had not reached it), or a reduce whose peer left
        before finishing it. Its number is given back, so that this rank and
        its peers number the group's next ops alike, as a failed rendezvous
        of the daemon leaves no trace; a reduce's sharded grad and count are
        put back, then the slot as it was before o was published."""
        mine = self.mine
        if o.read:
            if o.backup is not None:
                self.g.maps[self.g.SHARD_GRAD][:] = o.backup
            R._release()
            mine.set_word(P.XL_REDUCES, o.prev_reduces)
        if o.epoch == self.epoch:
            self.n = o.n - 1
        self._write_op(o.prev_seq, o.prev_op, o.prev_step)
        R._release()
        self.publish(P.XL_SEQ, o.prev_seq)


def _gave_up(o, slot):
    """Whether the peer whose slot is `slot` gave up waiting on op o (its collective timeout)."""
    return (slot.word(P.XL_GAVE_UP) == P.exec_word(o.epoch, o.n) and
            slot.word(P.XL_GAVE_UP_STEP) == o.step)


def fail_all(client, code, text):
    """The daemon detached this client (its job ended, or it is gone): every
    pending op completes with code and text (no peer can finish it with this
    rank now), as the daemon's would."""
    for o in client._xops:
        if o is not None:
            client._file(Completion(o.user_data, code, o.op, o.x.g.id, o.step, text))
    client._xops = []


def progress(client):
    """Advance every pending op of the client's rank-executed groups as far as
    it goes without waiting, ops of one group in submission order: the
    number completed (filed by client._file). A reduce with REDUCE_STEP that
    ran then goes to the daemon's ring, whose completion is the op's; with
    the SQ full it waits here for a later pass. Sets client._xwait: what the
    first op that waits waits for (None: nothing)."""
    client._xwait = None
    done = 0
    busy = set()
    left = []
    ops = client._xops
    for i, o in enumerate(ops):
        if o is None:
            continue    # failed with an op of its group before it (retract)
        x = o.x
        res = None
        if id(x) not in busy:
            if o.ran:
                res = (0, "")
                x.wait_on = None
            else:
                res = x.advance(o)
                if res is not None and not res[0] and o.op == P.OP_REDUCE and o.flags & P.REDUCE_STEP:
                    o.ran = True
            # The reduce ran here; its step is the daemon's, whose completion is the op's.
            if res is not None and o.ran and not client._submit_ring(
                    P.OP_REDUCE, x.g.id, o.step, o.flags, o.user_data, o.args):
                res = None  # the SQ is full: the next pass tries again
        if res is None:
            busy.add(id(x))
            left.append(o)
            if client._xwait is None:
                client._xwait = (x, x.wait_on, x.changes())
            continue
        # A timeout after the reduce's output was written leaves it (and its number).
        # A mismatch keeps its number: the peers at that number see it too.
        if (res[0] < 0 and o.op != P.OP_RESHARD and res[0] != -P.E_MISMATCH and not o.keep and
                (not o.read or res[0] == -P.E_PEER_DIED)):
            # The group's ops queued after it fail with it: they were published after it,
            # and ops of a group run in order.
            for j in range(i + 1, len(ops)):
                p = ops[j]
                if p is None or p.x is not x:
                    continue
                ops[j] = None
                client._file(Completion(p.user_data, res[0], p.op, x.g.id, p.step,
                                        f"shardd: {_op_name(p.op)}(group '{x.g.name}', step "
                                        f"{p.step}): not run: {res[1][:180]}"))
                done += 1
            x.retract(o)
        if res[0] == -P.E_TIMEOUT and o.op != P.OP_RESHARD and not o.keep:
            x.give_up(o)
        if not o.ran:
            client._file(Completion(o.user_data, res[0], o.op, x.g.id, o.step, res[1]))
        done += 1
    client._xops = left
    return done


def nap(client, timeout_s):
    """Sleep up to timeout_s on what the first pending op waits for (after a
    progress pass): a peer's word, or the sync page's change counter."""
    if client._xwait is None:
        return
    x, on, changes = client._xwait
    if on is not None:
        x.sleep(on[0], on[1], on[2], timeout_s)
    else:
        R.futex_wait(x.changes_addr, changes, timeout_s)


def forget(client, x):
    """Drop the pending ops of group state x (its group is being closed): each
    completes with -ECANCELED, so a wait on it ends."""
    left = []
    for o in client._xops:
        if o.x is not x:
            left.append(o)
            continue
        client._file(Completion(o.user_data, -errno.ECANCELED, o.op, x.g.id, o.step,
                                f"{_op_name(o.op)}(group '{x.g.name}'): the group was closed with "
                                f"the op pending"))
    client._xops = left

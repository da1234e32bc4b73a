# SPDX-License-Identifier: MIT
"""A rank's parameter groups, as the C client's client/group.c: param specs
(Param), the optimizer config a group registers with (Optimizer), and a
registered or opened group (Group): checking the daemon's GROUP reply
against the fds it came with, mapping the four buffers, views of them, a
rank's rows of a full tensor, and the ops on one group."""

import errno
import fcntl
import mmap
import os

import numpy as np

from . import dtypes as D
from . import proto as P
from .error import ShardError, shard_error
from .exec import ExecState

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # <linux/fcntl.h>; Python lacks it


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
        return P.PARAM_SPEC.pack(P.cstr(self.name, P.PARAM_NAME_MAX, "param name"), self.dtype,
                                 len(self.shape), self.shard_dim if self.shape else 0, 0, *shape)


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
        self.x = None   # exec.ExecState of a rank-executed group
        try:
            self._check_backend(where)
            # An older daemon sends the reply without exec (< 5) or peer_last_step (< 4).
            head = P.GROUP_REPLY if client.daemon_minor >= 5 else \
                P.GROUP_REPLY_V4 if client.daemon_minor == 4 else P.GROUP_REPLY_V3
            if len(reply) < head.size:
                raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply of {len(reply)} bytes, "
                                                  f"expected >= {head.size}")
            (self.id, self.nparams, self.param_dtype, self.reduce_dtype, self.grad_dtype,
             self.shard_world, self.unsharded_size, self.grad_size, self.shard_size,
             export_kind, self.optimizer, self.last_step, *later) = head.unpack_from(reply)
            # The highest last_step of any rank of the group (0 from an older daemon).
            self.peer_last_step = later[0] if later else 0
            # Who moves the group's bytes: daemon-executed from a daemon older than 1.5.
            self.exec = later[1] if len(later) > 1 else P.EXEC_DAEMON
            if self.exec not in (P.EXEC_DAEMON, P.EXEC_RANKS):
                raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply has exec = {self.exec}, "
                                                  f"neither daemon ({P.EXEC_DAEMON}) nor ranks "
                                                  f"({P.EXEC_RANKS})")
            ranks = self.exec == P.EXEC_RANKS
            self._check_kinds(export_kind, ranks, where)
            nipc = sum(kind == P.EXPORT_CUDA_IPC for kind in export_kind)
            # A rank-executed group's sync page travels after the buffers' fds.
            want_fds = P.GROUP_BUFS - nipc + ranks
            if len(fds) != want_fds:
                raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply carries {len(fds)} fds, "
                                                  f"but its export_kind {list(export_kind)} "
                                                  f"{'and exec = ranks ' if ranks else ''}"
                                                  f"say {want_fds}")
            # reply header, nparams layouts, the nparams specs as registered, then an IPC handle
            # per CUDA_IPC buffer
            specs_at = head.size + self.nparams * P.PARAM_LAYOUT.size
            handles_at = specs_at + self.nparams * P.PARAM_SPEC.size
            want = handles_at + nipc * P.CUDA_IPC_HANDLE_SIZE
            if len(reply) != want or (specs is not None and len(specs) != self.nparams):
                raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply of {len(reply)} bytes for "
                                                  f"{self.nparams} params and {nipc} CUDA IPC "
                                                  f"handles, expected {want}")
            self.layouts = [P.PARAM_LAYOUT.unpack_from(reply, head.size + i * P.PARAM_LAYOUT.size)
                            for i in range(self.nparams)]
            try:
                self.params = [Param.unpack_from(reply, specs_at + i * P.PARAM_SPEC.size)
                               for i in range(self.nparams)]
            except ValueError as e:
                raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply: {e}") from None
            if specs is not None and [(p.name, p.dtype, p.shape, p.shard_dim) for p in specs] != \
                    [(p.name, p.dtype, p.shape, p.shard_dim) for p in self.params]:
                raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply specs differ from the "
                                                  f"registered ones")
            self._check_layouts(where)
            # Rank-executed: the grad buffer ends with this rank's slot (PROTOCOL.md 3.8).
            sizes = (self.unsharded_size,
                     P.exec_grad_map_size(self.grad_size) if ranks else self.grad_size,
                     self.shard_size, self.shard_size)
            second = self._map_buffers(fds, reply[handles_at:], export_kind, sizes, ranks, where)
            self.x = ExecState(self, fds[P.GROUP_BUFS], second, where) if ranks else None
        except BaseException:
            self._unmap()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _check_backend(self, where):
        """A Group maps the host backend's memfds; the Client makes a CudaGroup for the cuda one."""
        if self.client.backend != P.BACKEND_HOST:
            raise shard_error(-errno.ENOTSUP, f"{where}: the daemon runs backend "
                                              f"{self.client.backend}, whose buffers this client "
                                              f"cannot map (host = {P.BACKEND_HOST}, cuda = "
                                              f"{P.BACKEND_CUDA})")

    def _check_kinds(self, export_kind, ranks, where):
        """Every buffer of the host backend is an fd (kind 0): a CUDA IPC handle is device memory."""
        for i, kind in enumerate(export_kind):
            if kind != P.EXPORT_FD:
                known = kind in P.EXPORT_NAMES
                raise shard_error(-errno.ENOTSUP if known else -P.E_MALFORMED,
                                  f"{where}: GROUP reply: export_kind[{i}] = {kind} "
                                  f"({P.EXPORT_NAMES.get(kind, 'unknown kind')}): the host "
                                  f"backend's buffers travel as fds (kind 0) only"
                                  + (", not device memory (use --backend host)" if known else ""))

    def _map_buffers(self, fds, handles, export_kind, sizes, ranks, where):
        """mmap the four memfds; True when this handle is a rank-executed
        group's second opening (its shard and grad buffers come sealed)."""
        second = False
        for i, (fd, size) in enumerate(zip(fds, sizes)):
            if size == 0:
                continue
            if os.fstat(fd).st_size < size:
                raise shard_error(-errno.EBADMSG, f"{where}: buffer {i} memfd is smaller than "
                                                  f"the {size} bytes the reply announces")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            # Daemon-executed, the unsharded copy is the daemon's output, lent read-only: one
            # rank that could reopen it O_RDWR would rewrite every rank's params, so the daemon
            # seals it against writes. Rank-executed, it is this rank's own.
            lent_ro = i == self.UNSHARDED and not ranks
            if lent_ro and not seals & F_SEAL_FUTURE_WRITE:
                raise shard_error(-P.E_MALFORMED, f"{where}: the unsharded memfd is lent "
                                                  f"read-only but is not sealed against writes "
                                                  f"(F_SEAL_FUTURE_WRITE missing from seals "
                                                  f"{seals:#x}): upgrade shardd")
            if ranks and i in (self.GRAD, self.SHARD) and seals & F_SEAL_FUTURE_WRITE:
                second = True
            ro = lent_ro or (second and i in (self.GRAD, self.SHARD))
            prot = mmap.PROT_READ if ro else mmap.PROT_READ | mmap.PROT_WRITE
            self.maps[i] = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        return second

    def _check_layouts(self, where):
        """Every view must lie inside its mapping: the reply is daemon input."""
        sizes = (self.unsharded_size, self.grad_size, self.shard_size)
        for i, lay in enumerate(self.layouts):
            for (off, n), size in zip(((lay[0], lay[1]), (lay[2], lay[3]), (lay[4], lay[5])), sizes):
                if off + n > size:
                    raise shard_error(-P.E_MALFORMED, f"{where}: param {i} range [{off}, {off + n}) "
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
        """Read-only view of the unsharded param (param_dtype; bf16: Bf16Array):
        the unshard's output, whichever executor wrote it."""
        i = self._i(param)
        lay = self.layouts[i]
        shape = self.params[i].shape
        a = self._view(self.UNSHARDED, lay[0], lay[1], self._unsharded_dtype(i), shape)
        a.flags.writeable = False
        return a

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
        those arrays are gone. Ops of a rank-executed group still pending
        complete with -ECANCELED."""
        if self.x is not None:
            self.client._exec_close(self)
            self.x.detach()
            self.x = None
        self._unmap()

    def _unmap(self):
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
    return flags, (P.f64_bits(lr), P.f64_bits(word) if word is not None else 0)


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

# SPDX-License-Identifier: MIT
"""A group of a `shardd --backend cuda` daemon (CudaGroup): its four
buffers are device memory on the rank's device, imported through the
driver (cuda.py) from the fds or the legacy IPC handles of the GROUP
reply (PROTOCOL.md 3.7), and every view of them is a torch CUDA tensor
over that memory, no copy (numpy cannot hold device memory). Everything
else, the reply's checks and the ops, is Group's."""

import errno

from . import cuda
from . import dtypes as D
from . import proto as P
from .error import shard_error
from .group import Group


def _torch_dtype(code):
    import torch
    return {P.DTYPE_FP32: torch.float32, P.DTYPE_BF16: torch.bfloat16,
            P.DTYPE_FP16: torch.float16}[code]


def ipc_gone_note(groups):
    """What a daemon's death takes along: the ipc-kind buffers of `groups`
    (their memory was the daemon's), said after a DaemonGone's text; fd-kind
    buffers stay valid until closed."""
    names = [g.name for g in groups if isinstance(g, CudaGroup) and
             any(m is not None and m.kind == P.EXPORT_CUDA_IPC for m in g.maps)]
    if not names:
        return ""
    return (f"; the cuda ipc buffers of groups {names} were the daemon's memory and are no longer "
            f"valid: close those groups without touching their tensors (docs/CUDA.md)")


class CudaGroup(Group):
    """A registered or opened group of the cuda backend. unsharded(),
    grad(), shard(), shard_grad() and tensor() are torch tensors on
    `device` over the group's buffers (the unsharded one is read-only by
    convention only: docs/CUDA.md). close() unmaps every buffer, or each
    when the last tensor over it is gone. An fd-kind buffer stays valid
    after the daemon is gone until then; an ipc-kind one does not (the
    daemon's memory goes with it): close such a group before the job ends."""

    def _check_backend(self, where):
        self.device = self.client.device
        if self.device < 0:
            raise shard_error(-errno.EINVAL, f"{where}: the daemon runs the cuda backend, whose "
                                             f"buffers are device memory, and this client attached "
                                             f"without a device (hello.device = {self.device}): "
                                             f"pass device= to Client (or init_device_mesh)")

    def _check_kinds(self, export_kind, ranks, where):
        for i, kind in enumerate(export_kind):
            if kind not in P.EXPORT_NAMES:
                raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply: export_kind[{i}] = "
                                                  f"{kind} is not an export kind (fd = "
                                                  f"{P.EXPORT_FD}, cuda ipc = {P.EXPORT_CUDA_IPC})")
        if ranks:
            raise shard_error(-P.E_MALFORMED, f"{where}: GROUP reply has exec = ranks, which the "
                                              f"cuda backend does not lend (its buffers are no "
                                              f"sealable host memory)")

    def _map_buffers(self, fds, handles, export_kind, sizes, ranks, where):
        """Import each buffer, in buffer order: an fd per FD buffer, a handle per CUDA_IPC one."""
        nfd = nipc = 0
        for i, (kind, size) in enumerate(zip(export_kind, sizes)):
            if kind == P.EXPORT_FD:
                fd = fds[nfd]
                nfd += 1
            else:
                handle = handles[nipc * P.CUDA_IPC_HANDLE_SIZE:(nipc + 1) * P.CUDA_IPC_HANDLE_SIZE]
                nipc += 1
            if size == 0:
                continue
            try:
                if kind == P.EXPORT_FD:
                    self.maps[i] = cuda.import_fd(fd, self.device, size)
                else:
                    self.maps[i] = cuda.import_ipc(handle, self.device, size)
            except Exception as e:
                code = getattr(e, "code", -P.E_BACKEND)
                raise shard_error(code, f"{where}: buffer {i} ({P.EXPORT_NAMES[kind]}): "
                                        f"{getattr(e, 'text', e)}") from None
        return False

    def _view(self, buf, off, nbytes, code, shape):
        import torch
        dtype = _torch_dtype(code)
        m = self.maps[buf]
        if m is None:
            return torch.zeros(0, dtype=dtype, device=torch.device("cuda", self.device))
        numel = 1
        for s in shape:
            numel *= s
        if numel * P.DTYPE_SIZES[code] != nbytes:
            shape = (nbytes // P.DTYPE_SIZES[code],)
        return m.tensor(off, nbytes, dtype, tuple(shape))

    def unsharded(self, param):
        """The unsharded param (param_dtype), a torch CUDA tensor: the unshard's
        output, shared by the ranks of the replica on this device. Never
        write it (nothing stops a write on a device: docs/CUDA.md)."""
        i = self._i(param)
        lay = self.layouts[i]
        return self._view(self.UNSHARDED, lay[0], lay[1], self._unsharded_dtype(i),
                          self.params[i].shape)

    def tensor(self, kind, param, padded=False):
        """The view `kind` ('unsharded', 'grad', 'shard' or 'shard_grad') of the
        param: already a torch tensor on the device."""
        if kind in ("shard", "shard_grad"):
            return getattr(self, kind)(param, padded)
        if kind in ("unsharded", "grad"):
            return getattr(self, kind)(param)
        raise ValueError(f"buffer kind {kind!r} is not one of unsharded, grad, shard, shard_grad")

    def load_full(self, param, full):
        """Copy this rank's rows of `full` (the whole param: a torch tensor, or
        numbers, or uint16 bit patterns for a bf16 param) into the flat shard
        on the device, padding zeroed, and wait for the copy: the daemon's
        stream does not order after this process's."""
        import numpy as np
        import torch
        i = self._i(param)
        p = self.params[i]
        dtype = _torch_dtype(p.dtype)
        if isinstance(full, torch.Tensor):
            full = full.detach().to("cpu")
            if full.dtype != dtype:
                full = full.to(dtype)
        else:
            full = np.asarray(full)
            if p.dtype == P.DTYPE_BF16:
                bits = D._bf16_bits(full).astype(np.uint16)
                full = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
            elif full.dtype.kind not in "biuf":
                raise TypeError(f"param '{p.name}': load_full takes numbers, not {full.dtype}")
            else:
                full = torch.from_numpy(np.ascontiguousarray(full)).to(dtype)
        if full.numel() != int(np.prod(p.shape, dtype=np.int64)):
            raise ValueError(f"param '{p.name}': {full.numel()} elements, shape {p.shape} expected")
        full = full.reshape(p.shape if p.shape else (1,))
        dim = p.shard_dim if p.shape else 0
        begin, valid = self.shard_rows(i)
        shard = self.shard(i, padded=True)
        host = torch.zeros(shard.shape, dtype=dtype)
        host.movedim(dim, 0)[:valid] = full.movedim(dim, 0)[begin:begin + valid]
        with torch.cuda.device(self.device):
            shard.copy_(host)
            torch.cuda.current_stream().synchronize()

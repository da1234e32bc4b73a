# SPDX-License-Identifier: MIT
"""torch's own distributed types, where the installed torch has them
(>= 2.6): its DeviceMesh, DTensor and FSDPModule. On such a torch,
fully_shard over a torch DeviceMesh makes each sharded param a DTensor
whose local tensor is the daemon's zero-copy shard view, so torch's
clip_grad_norm_, full_tensor(), torch.optim state and
torch.distributed.checkpoint see the params as FSDP2's. On an older torch
(Debian's 1.13) every name here is None and the params stay plain
tensors."""

import os

import torch

from ._api import torch_version

__all__ = ["DeviceMesh", "DTensor", "TorchFSDPModule", "is_torch_mesh", "default_torch_mesh",
           "placements", "sharded", "local"]

DeviceMesh = DTensor = Replicate = Shard = TorchFSDPModule = None
if torch_version() >= (2, 6):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard


def is_torch_mesh(mesh):
    return DeviceMesh is not None and isinstance(mesh, DeviceMesh)


_default_mesh = {}   # {pid: the torch DeviceMesh fully_shard made, as FSDP2 does}


def default_torch_mesh():
    """FSDP2's default mesh when fully_shard is given none: 1-D over the
    default process group's world, on the CPU (shardd's ranks are CPU
    processes). None when this torch has no DTensor or no process group
    was initialized (then fully_shard attaches from torchrun's environment
    alone, with plain-tensor params)."""
    if DeviceMesh is None or not torch.distributed.is_initialized():
        return None
    mesh = _default_mesh.get(os.getpid())
    if mesh is None:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        _default_mesh[os.getpid()] = mesh
    return mesh


def placements(mesh, shard_dim):
    """FSDP2's placements on `mesh`: Shard(dim) on a 1-D mesh; (Replicate(),
    Shard(dim)) on a 2-D (replicate, shard) mesh, HSDP."""
    if mesh.ndim == 1:
        return (Shard(shard_dim),)
    return (Replicate(), Shard(shard_dim))


def sharded(local, mesh, shard_dim, shape):
    """A DTensor over `local` (this rank's real rows, not copied) of the full
    `shape`, sharded along shard_dim on `mesh` with torch.chunk's split (the
    daemon's: ceil(rows / shard ranks) a rank, the last ones short)."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements(mesh, shard_dim), run_check=False,
                              shape=torch.Size(shape), stride=stride)


def local(t):
    """The plain tensor under `t`: a DTensor's local tensor, else t."""
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t

# SPDX-License-Identifier: MIT
"""The mesh: init_device_mesh attaches a rank to shardd and returns the
shardd.Client that fully_shard takes as its mesh (FSDP2's 1-D or 2-D
DeviceMesh), and what shardd.torch keeps per mesh (MeshState), held by the
Client itself so that it lives and dies with it."""

import dataclasses
from typing import Optional

from ..client import Client


@dataclasses.dataclass
class MeshState:
    """shardd.torch's state of one mesh (Client.mesh_state)."""

    resume: bool = False            # init_device_mesh(resume=True): fully_shard opens its groups
    restore: Optional[str] = None   # init_device_mesh(restore=...): groups start from a checkpoint
    groups_named: int = 0           # fully_shard calls so far: the n of group names "<n>.<Class>"
    states: list = dataclasses.field(default_factory=list)   # FSDPParamGroups with a group
    norm_count: int = 0             # the last grad_norm key clip_grad_norm_ took itself


def mesh_state(mesh):
    """The MeshState of `mesh` (a shardd.Client); a Client that
    init_device_mesh did not attach gets its own on first use."""
    if mesh.mesh_state is None:
        mesh.mesh_state = MeshState()
    return mesh.mesh_state


def init_device_mesh(job, rank, mesh_shape, *, socket_path=None, timeout=None, resume=False,
                     restore=None):
    """Attach rank `rank` of job `job` to shardd and return the Client that
    fully_shard takes as its mesh. mesh_shape: (shard,) for FSDP or
    (replicate, shard) for HSDP, as FSDP2's 1-D and 2-D DeviceMesh; the
    global rank is replica * shard + shard rank.

    resume=True: a restarted rank re-attaches to the job it left: each
    fully_shard opens the group it would register (same name, checked
    against this rank's params, dtypes and optimizer kind) instead of
    registering it, and keeps the shards the daemon holds (the model's
    values are not loaded). Then call DaemonOptimizer.recover().

    restore: every fully_shard registers its group from a checkpoint
    (docs/CHECKPOINTS.md) instead of the model's values: a checkpoint
    directory saved at any mesh, or "" for the job's newest one in the
    daemon's --state-dir (zeros when it has none: give restore only to
    resume). A DaemonOptimizer then goes on from the checkpoint's step (its
    step_number)."""
    shape = tuple(mesh_shape)
    if len(shape) == 1:
        replicate, shard = 1, shape[0]
    elif len(shape) == 2:
        replicate, shard = shape
    else:
        raise ValueError(f"mesh_shape {mesh_shape!r}: give (shard,) or (replicate, shard)")
    kw = {} if timeout is None else {"timeout": timeout}
    client = Client(job=job, rank=rank, shard=shard, replicate=replicate, socket_path=socket_path,
                    **kw)
    client.mesh_state = MeshState(resume=bool(resume), restore=restore)
    return client

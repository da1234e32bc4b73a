# SPDX-License-Identifier: MIT
"""The mesh: init_device_mesh attaches a rank to shardd and returns the
shardd.Client that fully_shard takes as its mesh (FSDP2's 1-D or 2-D
DeviceMesh)."""

from ..client import Client


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
    client._shardd_resume = bool(resume)
    client._shardd_restore = restore
    return client

# SPDX-License-Identifier: MIT
"""The mesh: init_device_mesh attaches a rank to shardd and returns the
shardd.Client that fully_shard takes as its mesh (FSDP2's 1-D or 2-D
DeviceMesh), reading torchrun's environment for what it is not given;
the mesh fully_shard attaches by itself (resolve_mesh: none given, or
torch's own DeviceMesh, which it also returns for DTensor params); and
what shardd.torch keeps per mesh (MeshState), held by the Client itself
so that it lives and dies with it."""

import dataclasses
import os
from typing import Any, Optional

from .. import proto as P
from ..client import Client
from ._dtensor import default_torch_mesh, is_torch_mesh


@dataclasses.dataclass
class MeshState:
    """shardd.torch's state of one mesh (Client.mesh_state)."""

    resume: bool = False            # init_device_mesh(resume=True): fully_shard opens its groups
    restore: Optional[str] = None   # init_device_mesh(restore=...): groups start from a checkpoint
    groups_named: int = 0           # fully_shard calls so far: the n of group names "<n>.<Class>"
    states: list = dataclasses.field(default_factory=list)   # FSDPParamGroups with a group
    norm_count: int = 0             # the last grad_norm key clip_grad_norm_ took itself
    device: Any = None              # torch.device("cuda", i) of a cuda daemon's mesh; None: host


def mesh_state(mesh):
    """The MeshState of `mesh` (a shardd.Client); a Client that
    init_device_mesh did not attach gets its own on first use."""
    if mesh.mesh_state is None:
        mesh.mesh_state = MeshState()
    return mesh.mesh_state


def _from_env(name, what):
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"init_device_mesh: no {what} given and ${name} is not set (torchrun "
                         f"sets it): pass {what}, or launch the script with torchrun")
    return value


def _cuda_device(device):
    """torch.device("cuda", i) of `device` (a torch.device, "cuda", "cuda:1"
    or an ordinal; no index: the current device), None for the CPU."""
    if device is None:
        return None
    import torch
    d = torch.device(device)
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise ValueError(f"init_device_mesh: device {device!r}: shardd's buffers live in host "
                         f"memory (cpu) or on a CUDA device (cuda)")
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def on_current_stream(client):
    """A cuda mesh: order the ops submitted next on the trainer's current
    stream of the mesh's device (Client.set_stream: no CPU wait on either
    side), as FSDP2 orders its collectives with the compute stream."""
    if client.backend == P.BACKEND_CUDA and client.device >= 0:
        import torch
        client.set_stream(torch.cuda.current_stream(client.device))


def init_device_mesh(job=None, rank=None, mesh_shape=None, *, socket_path=None, timeout=None,
                     resume=False, restore=None, device=None):
    """Attach rank `rank` of job `job` to shardd and return the Client that
    fully_shard takes as its mesh. mesh_shape: (shard,) for FSDP or
    (replicate, shard) for HSDP, as FSDP2's 1-D and 2-D DeviceMesh; the
    global rank is replica * shard + shard rank.

    What is not given comes from torchrun's environment: job from
    $TORCHELASTIC_RUN_ID (torchrun's --rdzv-id), rank from $RANK,
    mesh_shape (world size,) from $WORLD_SIZE, and the daemon's socket from
    $SHARDD_SOCKET (then $XDG_RUNTIME_DIR/shardd/shardd.sock).

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
    step_number).

    device: where the rank computes: None or "cpu" for a host daemon
    (shardd --backend host); torch.device("cuda", i), "cuda:i" or "cuda"
    (the current device) for a `shardd --backend cuda` daemon, whose
    buffers are then imported on that device: the params are CUDA
    tensors, and every op is ordered on the current CUDA stream (stream
    fences, docs/CUDA.md), so prefetches and reduces run without the CPU
    waiting for the GPU."""
    if job is None:
        job = _from_env("TORCHELASTIC_RUN_ID", "job")
    if rank is None:
        rank = int(_from_env("RANK", "rank"))
    if mesh_shape is None:
        mesh_shape = (int(_from_env("WORLD_SIZE", "mesh_shape")),)
    shape = tuple(mesh_shape)
    if len(shape) == 1:
        replicate, shard = 1, shape[0]
    elif len(shape) == 2:
        replicate, shard = shape
    else:
        raise ValueError(f"mesh_shape {mesh_shape!r}: give (shard,) or (replicate, shard)")
    kw = {} if timeout is None else {"timeout": timeout}
    dev = _cuda_device(device)
    client = Client(job=job, rank=rank, shard=shard, replicate=replicate, socket_path=socket_path,
                    device=P.HELLO_DEVICE_HOST if dev is None else dev.index, **kw)
    try:
        where = f"init_device_mesh: job '{job}' rank {rank} on {client.socket_path}"
        if client.backend == P.BACKEND_CUDA and dev is None:
            raise ValueError(f"{where}: the daemon runs --backend cuda (device memory): give "
                             f"device=torch.device('cuda', i), the GPU this rank computes on")
        if client.backend != P.BACKEND_CUDA and dev is not None:
            raise ValueError(f"{where}: device {dev} asks for GPU buffers, but the daemon runs "
                             f"the host backend: start shardd --backend cuda, or give device=None")
        client.mesh_state = MeshState(resume=bool(resume), restore=restore, device=dev)
        on_current_stream(client)
    except BaseException:
        client.close()
        raise
    return client


_env_mesh = {}    # {pid: the Client fully_shard attached from torchrun's environment}


def resolve_mesh(mesh, where):
    """(the shardd.Client fully_shard works through, torch's DeviceMesh of
    its DTensor params or None) from fully_shard's mesh argument: a Client
    (init_device_mesh) as it is, plain-tensor params; torch's own
    DeviceMesh, 1-D or 2-D (replicate, shard): a Client of the same shape
    and rank, the job from $TORCHELASTIC_RUN_ID, attached once per mesh,
    and DTensor params on that mesh where torch has them (>= 2.6); None:
    FSDP2's default mesh (1-D over the world of the initialized process
    group) where torch has DTensor, else this process's Client from
    torchrun's environment alone, attached on first use (init_device_mesh())."""
    if isinstance(mesh, Client):
        return mesh, None
    if mesh is None:
        mesh = default_torch_mesh()
    if mesh is None:
        client = _env_mesh.get(os.getpid())
        if client is None or client.ring is None:
            client = _env_mesh[os.getpid()] = init_device_mesh()
        return client, None
    # torch < 2.6 has no DTensor, but a DeviceMesh from torch 2.2 on (duck-typed here).
    if all(callable(getattr(mesh, a, None)) for a in ("size", "get_rank")) and \
            isinstance(getattr(mesh, "ndim", None), int):
        if mesh.ndim not in (1, 2):
            raise ValueError(f"{where}: a DeviceMesh of {mesh.ndim} dims; shardd takes 1-D "
                             f"(shard) or 2-D (replicate, shard) meshes, as FSDP2")
        client = getattr(mesh, "_shardd_client", None)
        if client is None or client.ring is None:
            shape = tuple(mesh.size(d) for d in range(mesh.ndim))
            client = init_device_mesh(rank=mesh.get_rank(), mesh_shape=shape)
            mesh._shardd_client = client
        return client, (mesh if is_torch_mesh(mesh) else None)
    raise TypeError(f"{where}: mesh must be the shardd.Client of this rank "
                    f"(shardd.torch.init_device_mesh), torch's DeviceMesh or None (torchrun's "
                    f"environment), not {type(mesh).__name__}")

# SPDX-License-Identifier: MIT
"""PyTorch FSDP2 through shardd: ``fully_shard`` with FSDP2's names and meaning.

    import shardd.torch as st
    mesh = init_device_mesh("cpu", (world,))   # torch's (torch >= 2.6): DTensor params
    # or st.init_device_mesh("run1", rank, (replicate, shard)): a shardd.Client,
    # plain-tensor params, any torch (under torchrun: no arguments, or no mesh= at all)
    mp = st.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        st.fully_shard(block, mesh=mesh, mp_policy=mp)
    st.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's shards
    for x, y in data:
        loss_fn(model(x), y).backward()    # unshard, reduce, reshard: the daemon
        opt.step()
        opt.zero_grad()

What lives where:

* Each ``fully_shard`` call makes one shardd group of the module's parameters
  that no nested ``fully_shard`` manages (registered at once: every rank must
  call ``fully_shard`` on the same modules in the same order; the daemon
  checks each param's name, dtype and shape across ranks). Its name is
  ``"<n>.<ClassName>"``, n counting the mesh's groups; its params' names are
  their fully qualified names in the root model.
* Outside forward and backward the module's parameters are this rank's
  shards: views of the daemon's flat shard holding only the real rows
  along the shard dim (FSDP2's local tensor; no padding), with ``.grad`` a
  view of the sharded gradient, ``None`` until a gradient was reduced into
  it. Any ``torch.optim`` optimizer updates them in place. Over torch's
  DeviceMesh (torch >= 2.6) they are DTensors, Shard(dim) (HSDP:
  Replicate(), Shard(dim)) whose local tensors are those views, grads
  likewise, so torch's clip_grad_norm_, full_tensor() and
  torch.distributed.checkpoint work as on FSDP2's (their small collectives
  go through the mesh's process group); over a shardd.Client they are
  plain ``nn.Parameter`` views.
* A meta-device model: fully_shard registers its groups without values;
  ``to_empty()`` and the model's init functions then write the shards
  (FSDPModule._apply).
* Between unshard and reshard the module holds the unsharded parameters:
  ``nn.Parameter`` views of the group's unsharded buffer (``param_dtype``),
  mapped read-only (forward and backward only read parameters).
* Backward: a module's outputs carry hooks that unshard it again (after
  ``reshard_after_forward``) and prefetch the module that ran before it; when
  the gradients of its inputs are computed, its parameters' gradients are
  copied into its grad buffer and the reduce is submitted without waiting;
  the root waits for every reduce at the end of backward.
* Forward: the next module of the previous iteration's order is unsharded
  asynchronously while this one computes (implicit prefetch), or the
  modules named by ``set_modules_to_forward_prefetch``.

``reduce_dtype=None`` follows the installed torch: torch >= 2.15 reduces in
each parameter's original dtype (fp32 for fp32 params with bf16
``param_dtype``); older torch, and FSDP1, reduce in ``param_dtype``
(:func:`default_reduce_dtype`).

Where shardd.torch differs from FSDP2 on purpose (plain-tensor params over
a shardd.Client; the daemon's checkpoints and optimizer; one node's CPU
ranks; ...): the table in the repository's docs/TORCH.md, "Where
shardd.torch differs from FSDP2, on purpose". With DTensor params an FSDPModule's ``state_dict()`` is
torch's (DTensors); with plain params it holds full tensors (collective:
every rank calls it) and its ``load_state_dict()`` takes them.
:func:`local_shards` gives the rank's shards, and
:func:`full_state_dict`/:func:`load_full_state_dict`
the params alone. Checkpoints are the daemon's: :func:`checkpoint` saves
every group (full tensors, safetensors) and ``init_device_mesh(...,
restore=...)`` starts from one at any mesh.

The daemon's optimizer: :class:`DaemonSGD` / :class:`DaemonAdamW`, constructed
over the model before ``fully_shard``, are ``torch.optim.Optimizer`` objects
whose ``step()`` is the daemon's STEP of every group, exactly once per step
number (see :class:`DaemonOptimizer`)::

    opt = st.DaemonAdamW(model, lr=1e-3)      # before fully_shard
    st.fully_shard(model, mesh=mesh)
    ...; loss.backward(); opt.step(); opt.zero_grad()

:func:`clip_grad_norm_` is torch's over the daemon's job-wide grad norm; the
daemon optimizer's next step clips (and skips) by it, the daemon computing
the coefficient. A rank that died
comes back with ``init_device_mesh(..., resume=True)`` (fully_shard opens its
groups) and every rank calls :meth:`DaemonOptimizer.recover` (the survivors
when :func:`peer_failed` says an op failed for a dead peer): each step is
applied exactly once on every shard.
"""

from ._api import MixedPrecisionPolicy, default_reduce_dtype
from ._clip import clip_grad_norm_
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard
from ._mesh import init_device_mesh
from ._optim import DaemonAdamW, DaemonOptimizer, DaemonSGD, peer_failed
from ._state_dict import checkpoint, full_state_dict, load_full_state_dict, local_shards

__all__ = ["fully_shard", "MixedPrecisionPolicy", "FSDPModule", "UnshardHandle",
           "init_device_mesh", "default_reduce_dtype", "local_shards", "DaemonOptimizer",
           "DaemonSGD", "DaemonAdamW", "clip_grad_norm_", "peer_failed", "checkpoint",
           "full_state_dict", "load_full_state_dict"]

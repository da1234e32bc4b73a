# SPDX-License-Identifier: MIT
"""The model's state: this rank's shards (local_shards), full state dicts
gathered by the daemon and full tensors loaded into the shards (also
FSDPModule.state_dict and load_state_dict), and the daemon's checkpoints
of every group."""

import torch

from ._dtensor import local
from ._mesh import mesh_state
from ._state import module_state


def local_shards(module):
    """[(param name, shard tensor, shard dim, first row)] of this rank for
    every param fully_shard manages under `module` (shard tensor: the real
    rows, a view of the daemon's flat shard)."""
    out = []
    for name, t in module.named_parameters():
        for m in module.modules():
            st = getattr(m, "_shardd_state", None)
            hit = st and next((p for p in st.params if p.sharded is t), None)
            if hit:
                out.append((name, local(t), hit.shard_dim, st.group.shard_rows(hit.index)[0]))
                break
    return out


def _managed(model):
    """(name under `model`, state, FSDPParam) of every param fully_shard manages under it."""
    for prefix, m in model.named_modules():
        st = module_state(m)
        for p in (st.params if st is not None else []):
            yield (prefix + "." if prefix else "") + p.fqn, m, st, p


def managed_keys(model):
    """{state_dict key under `model`: (module, state, FSDPParam)} of every param
    fully_shard manages under it, tied params under each of their names."""
    owner = {}
    for _n, m in model.named_modules():
        st = module_state(m)
        for q in (st.params if st is not None else []):
            owner[id(q.sharded)] = owner[id(q.unsharded)] = (m, st, q)
    out = {}
    for mname, mod in model.named_modules():
        for attr, t in mod._parameters.items():
            if t is not None and id(t) in owner:
                out[(mname + "." if mname else "") + attr] = owner[id(t)]
    return out


def gather_full(m, st):
    """Collective: [full tensor of each param of group `st`] (module m), a
    copy gathered by the daemon's unshard; the module is left as it was."""
    pd = st.mp.param_dtype
    if pd is not None and any(q.sharded.dtype != pd for q in st.params):
        raise ValueError(f"full state dict: {st.where('gather')} casts its params to "
                         f"param_dtype {pd}, so the gathered tensors are not the params: "
                         f"use shardd.torch.checkpoint() (the daemon saves the masters)")
    held = st.unsharded
    m.unshard()
    out = [q.unsharded.detach().clone() for q in st.params]
    if not held:
        m.reshard()
    return out


def load_full_tensor(st, p, name, tensor, what):
    """Copy this rank's rows of the full `tensor` into param p's shard."""
    full = tensor.detach().cpu().contiguous()
    want = tuple(st.group.params[p.index].shape)
    if tuple(full.shape) != want:
        raise ValueError(f"{what}: param '{name}' has shape {want}, the state dict holds "
                         f"{tuple(full.shape)} (full tensors are loaded, not shards)")
    full = full.to(p.sharded.dtype)
    if full.dtype == torch.bfloat16:
        st.group.load_full(p.index, full.view(torch.int16).numpy().view("uint16"))
    else:
        st.group.load_full(p.index, full.numpy())


def full_state_dict(model):
    """Collective (every rank, on the same model): {name: full tensor} of
    every param fully_shard manages under `model` (model.state_dict() of an
    FSDPModule holds the same, with the buffers), each a copy of the whole
    tensor gathered by the daemon's unshard, in the param's dtype. The
    gather casts to MixedPrecisionPolicy.param_dtype: a group with another
    param_dtype than its params' dtype is refused (st.checkpoint saves its
    masters instead)."""
    out, done = {}, {}
    for name, m, st, p in _managed(model):
        if id(st) not in done:
            done[id(st)] = gather_full(m, st)
        out[name] = done[id(st)][p.index]
    return out


def load_full_state_dict(model, state_dict):
    """Every rank: copy its rows of each full tensor of `state_dict` (as
    full_state_dict returns it, or a safetensors file's tensors) into the
    shards of the params fully_shard manages under `model`, at any mesh.
    Every such param must be in it, and nothing else."""
    names = set()
    with torch.no_grad():
        for name, _m, st, p in _managed(model):
            if name not in state_dict:
                raise KeyError(f"load_full_state_dict: param '{name}' is not in the state dict")
            load_full_tensor(st, p, name, state_dict[name], "load_full_state_dict")
            names.add(name)
    extra = sorted(set(state_dict) - names)
    if extra:
        raise KeyError(f"load_full_state_dict: {extra} are no params fully_shard manages here")


def checkpoint(mesh, step=None, timeout=None):
    """Every rank of the job: the daemon writes every group's full params and
    optimizer state to <--state-dir>/<job>/step-<step> (safetensors; see
    docs/CHECKPOINTS.md), once they are durable. step: default the
    DaemonOptimizer's step_number (the last step() submitted), else 0."""
    if step is None:
        opts = {id(st.optimizer): st.optimizer for st in mesh_state(mesh).states
                if st.optimizer is not None}
        step = max((o.step_number for o in opts.values()), default=0)
    mesh.checkpoint(step, timeout)
    return step

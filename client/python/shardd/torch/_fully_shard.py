# SPDX-License-Identifier: MIT
"""fully_shard, the public call, and FSDPModule, the class it mixes into a
module (FSDP2's _fully_shard.py)."""

import functools
import gc
import sys

import torch

from .. import proto as P
from ._api import MixedPrecisionPolicy
from ._dtensor import TorchFSDPModule
from ._mesh import mesh_state, resolve_mesh
from ._param import FSDPParam
from ._param_group import FSDPParamGroup, register
from ._state import lazy_init, post_forward, pre_forward
from ._state_dict import gather_full, load_full_tensor, managed_keys


class UnshardHandle:
    """Returned by FSDPModule.unshard(async_op=True): wait() finishes it
    (the module's forward waits by itself)."""

    def __init__(self, state):
        self._state = state

    def wait(self):
        self._state.wait_unshard()


class FSDPModule(*((TorchFSDPModule,) if TorchFSDPModule is not None else ())):
    """Mixed into the class of every module fully_shard was applied to, as
    FSDP2 does (``isinstance(m, FSDPModule)``); on a torch with FSDP2 it
    derives from torch's FSDPModule, so torch's own isinstance checks hold."""

    # torch's FSDPModule.__new__ builds the original class, found at this index of
    # the MRO: [FSDP<Orig>, this class, torch's FSDPModule, Orig, ...].
    _orig_cls_mro_index = 3

    def _get_fsdp_state(self):
        """torch's FSDPModule methods that shardd does not override reach here."""
        caller = sys._getframe(1).f_code.co_name
        raise NotImplementedError(
            f"{type(self).__name__}.{caller}: shardd.torch's fully_shard does not implement this "
            f"FSDP2 call (docs/TORCH.md's table of differences lists what it has)")

    def _apply(self, fn, *args, **kwargs):   # torch >= 2.1 passes recurse
        """Module._apply (to_empty(), float(), ...) replaces the params'
        tensors, but the daemon holds the shards: the new values are copied
        into the shards and the shard params registered again (FSDP2's
        reset_sharded_param), so to_empty() and init functions after
        fully_shard on a meta-device model initialize what trains."""
        st = self._shardd_state
        if st.group is not None:
            self.reshard()
        # Past torch's FSDPModule._apply, which reads FSDP2's own state: the module's class.
        ret = super(TorchFSDPModule or FSDPModule, self)._apply(fn, *args, **kwargs)
        if st.group is not None:
            st.reset_sharded()
        return ret

    def _states(self, recurse):
        mods = self.modules() if recurse else [self]
        return [m._shardd_state for m in mods if isinstance(m, FSDPModule)]

    def unshard(self, async_op=False):
        """Gather this module's parameters (not recursive); with async_op the
        gather runs in the daemon while the caller goes on."""
        st = self._shardd_state
        st.start_unshard()
        if async_op:
            return UnshardHandle(st)
        st.wait_unshard()
        return None

    def reshard(self):
        """Release the unsharded parameters; the module holds its shards again."""
        st = self._shardd_state
        st.wait_reduce()
        st.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: backward accumulates gradients in the grad buffers without
        reducing them (gradient accumulation without communication)."""
        for st in self._states(recurse):
            st.requires_gradient_sync = requires_gradient_sync
            st.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP: False reduces within the shard group only and keeps the result
        as a partial; the next reduce with all-reduce adds it first."""
        for st in self._states(recurse):
            st.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward):
        """False: the end of backward does not wait for the reduces (the next
        unshard or backward of each module does)."""
        st = self._shardd_state
        lazy_init(st)
        st.ctx.is_last_backward = is_last_backward

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward).__name__}")
        for st in self._states(recurse):
            st.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """False keeps the unsharded parameters after backward (call reshard()
        on every module before the optimizer updates the shards)."""
        for st in self._states(recurse):
            st.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules):
        """Unshard these modules asynchronously when this module's forward starts."""
        self._shardd_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        """Unshard these modules asynchronously when this module's backward starts."""
        self._shardd_state.backward_prefetch = [_state_of(m) for m in modules]

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Collective (every rank, on the same module; like FSDP1's
        FULL_STATE_DICT or DCP's get_model_state_dict(full_state_dict=True)):
        torch's state_dict with the full tensor of every param fully_shard
        manages under this module, gathered by the daemon (a copy, in the
        param's dtype, every rank the same), under the keys and shapes an
        unsharded model's state_dict() has; buffers and unmanaged params as
        torch gives them. A group whose MixedPrecisionPolicy casts its params
        is refused (checkpoint() saves the fp32 masters). local_shards()
        gives this rank's shards instead. With DTensor params (fully_shard
        over torch's DeviceMesh): torch's own state_dict, the params as
        DTensors, as FSDP2's (no collective)."""
        if args:
            raise TypeError(f"{type(self).__name__}.state_dict: pass destination, prefix and "
                            f"keep_vars by keyword")
        sd = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        st = self._shardd_state
        if st.dmesh is not None:
            return sd    # DTensor params: torch's sharded state dict, as FSDP2's
        own = {k: q for k, (_m, s2, q) in managed_keys(self).items() if s2 is st}
        if own:
            full = gather_full(self, st)
            for k, q in own.items():
                sd[prefix + k] = full[q.index]
        return sd

    def load_state_dict(self, state_dict, strict=True, **kwargs):
        """Every rank: load a state dict of full tensors (as state_dict()
        returns it, an unsharded model's state_dict(), or a checkpoint's
        safetensors tensors): each rank copies its rows of every managed
        param's full tensor into its shard, at any mesh (a local copy, no
        collective); buffers and unmanaged params go through torch. strict
        as torch's: missing or unexpected keys raise after the load. Call it
        between steps, with the modules resharded; the DaemonOptimizer's
        state is the daemon's and not touched. With DTensor params: torch's
        own load_state_dict, which takes DTensors, as FSDP2's (with
        assign=True the loaded values are copied into the shards)."""
        if self._shardd_state.dmesh is not None:
            res = super().load_state_dict(state_dict, strict=strict, **kwargs)
            for st in self._states(recurse=True):
                if st.group is not None:
                    st.reset_sharded()
            return res
        keys = managed_keys(self)
        rest = {k: v for k, v in state_dict.items() if k not in keys}
        res = super().load_state_dict(rest, strict=False, **kwargs)
        missing = [k for k in res.missing_keys if k not in keys]
        missing += [k for k in keys if k not in state_dict]
        done = set()
        with torch.no_grad():
            for k, (_m, st, q) in keys.items():
                if k in state_dict and (id(st), q.index) not in done:
                    load_full_tensor(st, q, k, state_dict[k], f"{type(self).__name__}.load_state_dict")
                    done.add((id(st), q.index))
        if strict and (missing or res.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: "
                               f"missing keys {missing}, unexpected keys {res.unexpected_keys}")
        return torch.nn.modules.module._IncompatibleKeys(missing, res.unexpected_keys)


def _state_of(m):
    if not isinstance(m, FSDPModule):
        raise ValueError(f"{type(m).__name__} is not an FSDPModule: apply fully_shard to it first")
    return m._shardd_state


@functools.lru_cache(maxsize=None)
def _fsdp_class(cls):
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=None, exec="auto"):
    """Shard `module`'s parameters (those no nested fully_shard manages)
    through shardd; returns the module, now also an FSDPModule.

    mesh: the shardd.Client of this rank (init_device_mesh), torch's
    DeviceMesh (torch >= 2.2), or None: the process's mesh from torchrun's
    environment (see init_device_mesh), attached once. reshard_after_forward:
    True frees the unsharded params after forward and gathers them again in
    backward; False keeps them; None: True except for the root module.
    shard_placement_fn(param) -> Shard(dim) / int dim / None (dim 0).
    mp_policy: MixedPrecisionPolicy. Collective: every rank calls it on the
    same modules in the same order, with the same initial parameter values
    (each rank keeps its own rows of them). The daemon knows each param by
    its fully qualified name in the root model (``layers.3.attention_norm.weight``),
    the name checkpoints and shardctl use. exec: who moves the group's bytes
    (Client.register_group's): "auto" (the daemon picks by size, shardd
    --rank-exec-max), "daemon", or "ranks" (unshard, reduce and reshard run
    in this process, on the job's shared buffers, as it waits for them)."""
    mesh, dmesh = resolve_mesh(mesh, "fully_shard")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    mp = mp_policy or MixedPrecisionPolicy()
    managed = set()
    for m in module.modules():
        if m is not module and isinstance(m, FSDPModule):
            managed.update(id(p.sharded) for p in m._shardd_state.params)
    places, names, order = {}, {}, []
    for mname, m in module.named_modules():
        for attr, p in m._parameters.items():
            if p is None or id(p) in managed:
                continue
            if id(p) not in places:
                places[id(p)] = []
                names[id(p)] = (mname + "." if mname else "") + attr
                order.append(p)
            places[id(p)].append((m, attr))
    opt = _optimizer_of(module, places, names)
    prefix = "" if opt is not None else _root_prefix(module)
    ms = mesh_state(mesh)
    count = ms.groups_named
    ms.groups_named = count + 1
    name = f"{count}.{type(module).__name__}"[:P.NAME_MAX - 1]
    # The daemon knows each param by its fully qualified name in the root model (torch's
    # state_dict key): unique across the job's groups, as a checkpoint needs, and what an
    # unsharded model loads. Under a DaemonOptimizer the root is the model it was constructed
    # over; else the outermost module holding `module`.
    params = [FSDPParam(names[id(p)], i, places[id(p)],
                        opt._names.get(id(p)) if opt else prefix + names[id(p)])
              for i, p in enumerate(order)]
    state = FSDPParamGroup(module, mesh, dmesh, params, name, mp, reshard_after_forward)
    if params:
        register(state, order, shard_placement_fn, opt, exec)
        if opt is not None:
            opt._attach(state, order)
        state.optimizer = opt
        ms.states.append(state)
    module._shardd_state = state
    module.__class__ = _fsdp_class(type(module))
    try:
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: pre_forward(state, args, kwargs), with_kwargs=True)
    except TypeError:   # torch < 2.0: no kwargs in hooks
        module.register_forward_pre_hook(lambda _m, args: pre_forward(state, args, {})[0])
    module.register_forward_hook(lambda _m, _args, output: post_forward(state, output))
    return module


def _parents(child):
    """The modules that hold `child` in their _modules, as [(module, attr)]:
    child <- a _modules dict <- the parent's __dict__ <- the parent."""
    found = {}
    for d in gc.get_referrers(child):
        if not isinstance(d, dict):
            continue
        attrs = [a for a, c in list(d.items()) if c is child]
        if not attrs:
            continue
        for holder in gc.get_referrers(d):
            # type() and vars(): no __class__ property or __getattr__ runs.
            owners = [holder] if issubclass(type(holder), torch.nn.Module) else [
                o for o in gc.get_referrers(holder)
                if issubclass(type(o), torch.nn.Module) and vars(o) is holder]
            for o in owners:
                if vars(o).get("_modules") is d:
                    found.setdefault(id(o), (o, attrs[0]))
    return list(found.values())


def _root_prefix(module):
    """`module`'s name in the outermost module holding it, with a trailing
    dot ("layers.3."; "" for a module no other one holds): the prefix that
    makes its params' names the root model's fully qualified names. A
    module knows no parent, so its parents are found through what refers to
    it (fully_shard on blocks runs before fully_shard on the root, as FSDP2's
    scripts do, so the names cannot wait for the root's call). Only the
    referrers of the modules on the way up are looked at, never every live
    object: gc.get_objects() can hand out a tuple another thread is still
    building, which then fails to finish (CPython's "bad argument to internal
    function")."""
    parts, seen, m = [], {id(module)}, module
    while True:
        held = _parents(m)
        if not held:
            break
        if len(held) > 1:
            raise ValueError(
                f"fully_shard({type(module).__name__}): {type(m).__name__} is a submodule of "
                f"{len(held)} modules ({', '.join(type(o).__name__ for o, _ in held)}), so its "
                f"params have no single fully qualified name for the daemon and a checkpoint: "
                f"keep each module in one model")
        m, attr = held[0]
        if id(m) in seen:
            break
        seen.add(id(m))
        parts.append(attr)
    return "".join(a + "." for a in reversed(parts))


def _optimizer_of(module, places, names):
    """The DaemonOptimizer constructed over `module` (None: none); every param
    the new group takes must be under that same one."""
    opt = getattr(module, "_shardd_optimizer", None)
    for key, where in places.items():
        for m, _attr in where:
            if getattr(m, "_shardd_optimizer", None) is not opt:
                raise ValueError(
                    f"fully_shard({type(module).__name__}): param '{names[key]}' and this "
                    f"module are not under the same DaemonOptimizer, and one group steps with "
                    f"one optimizer: construct the DaemonOptimizer over the outermost module "
                    f"fully_shard is applied to")
    return opt

# SPDX-License-Identifier: MIT
"""One fully_shard call's parameters as one daemon group (FSDP2's
_fsdp_param_group.py): its registration (or re-opening, or restore), and
its collectives: unshard, reshard, the reduce of its gradients, and what
a failed collective leaves behind."""

import errno
import itertools

import torch

from .. import proto as P
from ..error import DaemonGone, ShardError
from ..group import Param
from ._api import TORCH_TO_SHARDD, default_reduce_dtype
from ._dtensor import local, sharded
from ._mesh import mesh_state, on_current_stream


class FSDPParamGroup:
    """The state of one fully_shard call: its module, its params, the daemon
    group holding them, its ops in flight, and the policies and flags its
    module's hooks read (module._shardd_state)."""

    def __init__(self, module, client, dmesh, params, name, mp_policy, reshard_after_forward):
        self.module = module
        self.client = client
        self.dmesh = dmesh               # torch's DeviceMesh of DTensor params, or None
        self.params = params
        self.name = name
        self.mp = mp_policy
        self.reshard_after_forward = reshard_after_forward    # None: resolved at lazy init
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.forward_prefetch = None     # explicit [FSDPParamGroup] or None: implicit
        self.backward_prefetch = None
        self.group = None
        self.ctx = None
        self.unshard_pending = None      # Pending of an asynchronous unshard
        self.reduce_pending = None       # Pending of the submitted reduce (and reshard)
        self.unsharded = False           # this rank holds the unsharded copy
        self.unshard_count = 0           # unshard step keys
        self.reduce_count = 0
        self.grads_accumulated = False   # grad buffer holds unreduced grads (no sync)
        self.forward_calls = 0           # forwards with post-backward hooks, this iteration
        self.needs_post_backward = False
        self.pre_backward_done = False
        self._reduce_lands = True        # the last reduce updates the sharded grads
        self.optimizer = None            # the DaemonOptimizer that steps the group, or None

    # ---------------------------------------------------------- naming
    def where(self, what):
        return (f"{what} of fully_shard({type(self.module).__name__}) group '{self.name}' on rank "
                f"{self.client.rank} of job '{self.client.job}'")

    def _wrap(self, what, err):
        return type(err)(err.code, f"{self.where(what)}: {err.text}", err.result) \
            if isinstance(err, ShardError) \
            else err

    # ---------------------------------------------------------- unshard / reshard
    def start_unshard(self):
        """Submit the unshard without waiting (a no-op when held or in flight)."""
        if self.group is None or self.unsharded or self.unshard_pending is not None:
            return
        self.wait_reduce()
        step = self.unshard_count
        self.unshard_count += 1
        on_current_stream(self.client)
        self.unshard_pending = self.client.start(
            [(P.OP_UNSHARD, self.group.id, step, 0, f"unshard(group '{self.name}', step {step})")])

    def wait_unshard(self):
        if self.group is None:
            return
        self.start_unshard()
        if self.unshard_pending is not None:
            pending, self.unshard_pending = self.unshard_pending, None
            try:
                pending.wait()
            except ShardError as e:
                raise self._wrap("unshard", e) from None
            self.unsharded = True
        self.use(unsharded=True)

    def use(self, unsharded):
        """Register the unsharded (or the sharded) Parameters on the modules."""
        for p in self.params:
            t = p.unsharded if unsharded else p.sharded
            for m, attr in p.places:
                m._parameters[attr] = t

    def reshard(self, wait=True):
        if self.unshard_pending is not None:
            self.wait_unshard()
        self.use(unsharded=False)
        if not self.unsharded:
            return None
        self.unsharded = False
        on_current_stream(self.client)
        pending = self.client.start([(P.OP_RESHARD, self.group.id, 0, 0,
                                      f"reshard(group '{self.name}')")])
        if not wait:
            return pending
        try:
            pending.wait()
        except ShardError as e:
            raise self._wrap("reshard", e) from None
        return None

    # ---------------------------------------------------------- gradients
    def collect_grads(self):
        """Move the unsharded params' grads into the grad buffer (autograd made
        them as new tensors); a param without one contributes zeros."""
        for p in self.params:
            g = p.unsharded.grad
            if g is None:
                if not self.grads_accumulated:
                    p.grad_view.zero_()
                continue
            p.unsharded.grad = None
            p.partial_has_grad = True
            if self.grads_accumulated:
                p.grad_view.add_(g)
            else:
                p.grad_view.copy_(g)
        self.grads_accumulated = True

    def post_backward(self):
        """Grads of this module are complete: submit its reduce (when synced)
        and its reshard, without waiting."""
        self.needs_post_backward = False
        self.forward_calls = 0
        if self.group is None:
            return
        if self.unshard_pending is not None:
            self.wait_unshard()
        self.wait_reduce()
        self.collect_grads()
        ops = []
        if self.requires_gradient_sync:
            for p in self.params:
                # The daemon adds into the sharded grad: an optimizer's
                # zero_grad(set_to_none=True) dropped it, so start from zero.
                if p.sharded.grad is None:
                    p.has_grad = False
                    p.shard_grad_view.zero_()
                elif local(p.sharded.grad).data_ptr() != p.shard_grad_view.data_ptr():
                    p.has_grad = True
                    p.shard_grad_view.copy_(local(p.sharded.grad))
            flags = P.REDUCE_ALL_REDUCE if self.client.replicate > 1 and self.requires_all_reduce else 0
            step = self.reduce_count
            self.reduce_count += 1
            ops.append((P.OP_REDUCE, self.group.id, step, flags,
                        f"reduce(group '{self.name}', step {step}"
                        f"{', all-reduce' if flags else ''})"))
            self._reduce_lands = self.client.replicate == 1 or bool(flags)
            self.grads_accumulated = False
        if self.reshard_after_backward and self.unsharded:
            self.use(unsharded=False)
            self.unsharded = False
            ops.append((P.OP_RESHARD, self.group.id, 0, 0, f"reshard(group '{self.name}')"))
        elif not self.reshard_after_backward:
            self.use(unsharded=True)
        if ops:
            # On a GPU the reduce waits for the grad copies above on this stream, not the CPU.
            on_current_stream(self.client)
            self.reduce_pending = (self.client.start(ops), self.requires_gradient_sync)

    def wait_reduce(self):
        """Wait for the submitted reduce; then the sharded grads hold it."""
        if self.reduce_pending is None:
            return
        (pending, reduced), self.reduce_pending = self.reduce_pending, None
        try:
            pending.wait()
        except ShardError as e:
            raise self._wrap("backward", e) from None
        if not reduced:
            return
        if not self._reduce_lands:
            return      # an HSDP partial: the sharded grads are untouched
        for p in self.params:
            if p.partial_has_grad:
                p.has_grad = True
            elif not p.has_grad and int(torch.count_nonzero(p.shard_grad_view)):
                raise ShardError(-P.E_MISMATCH, self.where("reduce") + f": param '{p.fqn}' got no "
                                 f"gradient on rank {self.client.rank}, but another rank of its "
                                 f"shard group gave it one: every rank must use the same "
                                 f"parameters in backward")
            p.partial_has_grad = False
            p.sharded.grad = p.shard_grad if p.has_grad else None

    def shard_param(self, p, requires_grad):
        """A new shard Parameter of p over its shard view: a DTensor on the
        torch DeviceMesh, else the view itself."""
        t = p.shard_view
        if self.dmesh is not None:
            t = sharded(t, self.dmesh, p.shard_dim, self.group.params[p.index].shape)
        param = torch.nn.Parameter(t, requires_grad=requires_grad)
        param._shardd_state = self
        return param

    def reset_sharded(self):
        """After Module._apply replaced the shard Parameters (or their
        tensors): copy their new values into the daemon's shards (not those
        of a meta tensor: to_empty() on a meta model leaves them to the init
        functions) and register shard Parameters over the shards again. A
        new dtype or device is refused, the shards registered as they were."""
        news = [p.places[0][0]._parameters[p.places[0][1]] for p in self.params]
        bad = next(((p, local(t)) for p, t in zip(self.params, news)
                    if local(t).dtype != p.shard_view.dtype
                    or (local(t).device != p.shard_view.device and not local(t).is_meta)), None)
        with torch.no_grad():
            for p, new in zip(self.params, news):
                values = local(new)
                if new is p.sharded and values.data_ptr() == p.shard_view.data_ptr():
                    continue
                if bad is None and not values.is_meta:
                    p.shard_view.copy_(values)
                p.sharded = self.shard_param(p, new.requires_grad)
                for mod, a in p.places:
                    mod._parameters[a] = p.sharded
        if bad is not None:
            p, values = bad
            raise ValueError(f"{self.where('Module._apply')}: param '{p.name}' would become "
                             f"{values.dtype} on {values.device}, but the daemon holds it as "
                             f"{p.shard_view.dtype} on {p.shard_view.device}: the params are left "
                             f"as they were (cast for compute with MixedPrecisionPolicy; the "
                             f"device is init_device_mesh's)")

    def abandon(self, key_base):
        """After a failed collective: finish (or fail) what is in flight,
        release a held unsharded copy, drop the iteration's gradients and
        restart the op keys at key_base (the same on every rank)."""
        pendings = [self.unshard_pending, self.reduce_pending and self.reduce_pending[0]]
        self.unshard_pending = self.reduce_pending = None
        for pend in pendings:
            if pend is not None:
                _quietly(pend.wait)
        if self.unsharded:
            self.unsharded = False
            _quietly(lambda: self.client.start([(P.OP_RESHARD, self.group.id, 0, 0,
                                                 f"reshard(group '{self.name}')")]).wait())
        self.use(unsharded=False)
        for p in self.params:
            p.unsharded.grad = None
            p.sharded.grad = None
            p.has_grad = p.partial_has_grad = False
        self.grads_accumulated = self.needs_post_backward = self.pre_backward_done = False
        self.forward_calls = 0
        self._reduce_lands = True
        self.unshard_count = self.reduce_count = key_base
        if self.ctx is not None:
            self.ctx.in_forward = self.ctx.backward_queued = False
            self.ctx.post_forward_order, self.ctx.prev_order = [], []


def _quietly(fn):
    """fn(), ignoring the daemon's refusal (a collective that failed with a
    dead peer, a reshard with nothing held); a lost daemon still raises."""
    try:
        fn()
    except DaemonGone:
        raise
    except ShardError:
        pass


def _placement_dim(result, name):
    if result is None:
        return 0
    dim = getattr(result, "dim", result)
    if not isinstance(dim, int):
        raise TypeError(f"shard_placement_fn returned {result!r} for param '{name}': give "
                        f"Shard(dim), an int dim or None")
    return dim


def register(state, tensors, shard_placement_fn, optimizer=None, exec="auto"):
    mp = state.mp
    specs = []
    for p, t in zip(state.params, tensors):
        if t.dtype not in TORCH_TO_SHARDD:
            raise TypeError(f"fully_shard({type(state.module).__name__}): param '{p.fqn}' has "
                            f"dtype {t.dtype}; shardd takes float32, bfloat16 and float16")
        if len(p.name.encode()) >= P.PARAM_NAME_MAX:
            raise ValueError(f"fully_shard({type(state.module).__name__}): param name '{p.name}' "
                             f"is longer than {P.PARAM_NAME_MAX - 1} bytes")
        dim = _placement_dim(shard_placement_fn(t) if shard_placement_fn else None, p.fqn)
        if t.dim() and not -t.dim() <= dim < t.dim():
            raise ValueError(f"shard_placement_fn: Shard({dim}) for param '{p.fqn}' of shape "
                             f"{tuple(t.shape)}")
        p.shard_dim = dim % t.dim() if t.dim() else 0
        specs.append(Param(p.name, TORCH_TO_SHARDD[t.dtype], tuple(t.shape), p.shard_dim))
    reduce_dtype = mp.reduce_dtype
    if reduce_dtype is None:
        reduce_dtype = default_reduce_dtype(mp.param_dtype, {t.dtype for t in tensors})
    pd = TORCH_TO_SHARDD[mp.param_dtype] if mp.param_dtype is not None else None
    rd = TORCH_TO_SHARDD[reduce_dtype] if reduce_dtype is not None else None
    ms = mesh_state(state.client)
    resume, restore = ms.resume, ms.restore
    try:
        if resume:
            g = state.client.open_group(state.name)
        else:
            g = state.client.register_group(state.name, specs, pd, rd,
                                            optimizer=optimizer.config if optimizer else None,
                                            restore=restore, exec=exec)
    except ShardError as e:
        fix = ""
        if e.code == -errno.EEXIST:
            job = state.client.job
            fix = (f": job '{job}' still holds this group from an earlier run, whose processes "
                   f"ended without saying goodbye (killed, or os._exit): such a job lingers in "
                   f"the daemon (shardd --job-linger; shardctl jobs shows it). To start this run "
                   f"fresh, end the old job with `shardctl end {job}` and run again (the job also "
                   f"ends once every rank of this run has said goodbye, as each does at exit), "
                   f"or give this run another job name. Only a rank restarted into a run whose "
                   f"other ranks are still attached re-attaches instead, with "
                   f"init_device_mesh(..., resume=True)")
        raise type(e)(e.code, f"{state.where('registration')}: {e.text}{fix}") from None
    state.group = g
    if resume:
        _check_reopened(state, g, specs, pd, rd, optimizer)
    # A restored group holds the checkpoint's values; a meta tensor has none (to_empty()
    # and the model's init functions write the shards after fully_shard, as in FSDP2).
    load = not resume and restore is None
    with torch.no_grad():
        for p, t in zip(state.params, tensors):
            if load and not t.is_meta:
                full = t.detach().cpu().contiguous()
                if full.dtype == torch.bfloat16:
                    g.load_full(p.index, full.view(torch.int16).numpy().view("uint16"))
                else:
                    g.load_full(p.index, full.numpy())
            p.shard_view = g.tensor("shard", p.index)
            p.sharded = state.shard_param(p, t.requires_grad)
            p.shard_grad_view = g.tensor("shard_grad", p.index)
            p.shard_grad = p.shard_grad_view
            if state.dmesh is not None:
                p.shard_grad = sharded(p.shard_grad_view, state.dmesh, p.shard_dim,
                                       g.params[p.index].shape)
            p.unsharded = torch.nn.Parameter(g.tensor("unsharded", p.index),
                                             requires_grad=t.requires_grad)
            p.grad_view = g.tensor("grad", p.index)
    state.use(unsharded=False)


def _check_reopened(state, g, specs, pd, rd, optimizer):
    """A re-attached rank builds its views from its own specs: the group the
    daemon kept must be the one this rank's model would register."""
    def refuse(what, have, want):
        g.close()
        raise ShardError(-P.E_MISMATCH, f"{state.where('re-attach')}: the daemon's group has "
                                        f"{what} {have} but this rank's model gives {want}: "
                                        f"build the same model, fully_shard calls and optimizer "
                                        f"as the run that registered it (or use a new job name)")
    mine = [(s.name, s.dtype, tuple(s.shape), s.shard_dim) for s in specs]
    theirs = [(s.name, s.dtype, tuple(s.shape), s.shard_dim) for s in g.params]
    if mine != theirs:
        diff = next((a, b) for a, b in itertools.zip_longest(theirs, mine) if a != b)
        refuse("param (name, dtype, shape, shard_dim)", diff[0], diff[1])
    for what, have, want in (("param_dtype", g.param_dtype, pd),
                             ("reduce_dtype", g.reduce_dtype, rd)):
        if have != (want or P.DTYPE_NONE):
            refuse(what, P.DTYPE_NAMES.get(have, have), P.DTYPE_NAMES.get(want or P.DTYPE_NONE))
    kind = optimizer.config.kind if optimizer else P.OPTIM_NONE
    if g.optimizer != kind:
        names = {P.OPTIM_NONE: "none", P.OPTIM_SGD: "SGD", P.OPTIM_ADAMW: "AdamW"}
        refuse("optimizer", names.get(g.optimizer, g.optimizer), names.get(kind, kind))

# SPDX-License-Identifier: MIT
"""PyTorch FSDP2 through shardd: ``fully_shard`` with FSDP2's names and meaning.

    import shardd.torch as st
    mesh = st.init_device_mesh("run1", rank, (replicate, shard))   # a shardd.Client
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
  ``"<n>.<ClassName>"``, n counting the mesh's groups.
* Outside forward and backward the module's parameters are this rank's
  shards: ``nn.Parameter`` views of the daemon's flat shard holding only the
  real rows along the shard dim (FSDP2's local tensor; no padding), with
  ``.grad`` a view of the sharded gradient, ``None`` until a gradient was
  reduced into it. Any ``torch.optim`` optimizer updates them in place.
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

Differences from FSDP2: parameters are plain tensors (no DTensor), every
rank is a CPU process of one node served by the daemon's host backend,
``set_requires_gradient_sync(False)`` accumulates unsynchronised gradients
in ``param_dtype`` (torch 2.15 uses the original dtype), and an
FSDPModule's ``state_dict()`` holds full tensors, gathered by the daemon
(collective: every rank calls it, as FSDP1's FULL_STATE_DICT; FSDP2's
default gives DTensor shards), and its ``load_state_dict()`` takes full
tensors, each rank loading its rows, so both work with an unsharded
model's state dicts; :func:`local_shards` gives the rank's shards, and
:func:`full_state_dict`/:func:`load_full_state_dict` the params alone.
Checkpoints are the
daemon's: :func:`checkpoint` saves every group (full tensors, safetensors)
and ``init_device_mesh(..., restore=...)`` starts from one at any mesh.

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

import errno
import functools
import itertools
import time

import torch

from . import proto as P
from .client import (Client, DaemonGone, Optimizer, Param, ShardError, numpy_to_tensor,
                     step_flags_args)

__all__ = ["fully_shard", "MixedPrecisionPolicy", "FSDPModule", "UnshardHandle",
           "init_device_mesh", "default_reduce_dtype", "local_shards", "DaemonOptimizer",
           "DaemonSGD", "DaemonAdamW", "clip_grad_norm_", "peer_failed", "checkpoint",
           "full_state_dict", "load_full_state_dict"]

_TORCH_TO_SHARDD = {torch.float32: P.DTYPE_FP32, torch.bfloat16: P.DTYPE_BF16,
                    torch.float16: P.DTYPE_FP16}
_SHARDD_TO_TORCH = {v: k for k, v in _TORCH_TO_SHARDD.items()}
# DaemonOptimizer.recover's barrier numbers: bit 62 set; the first barrier
# is that bit alone, the second adds bit 61 and the step every rank resumes after.
_RECOVER_BARRIER, _RECOVER_AGREE = 1 << 62, 1 << 61
_KEY_STEP_BITS = 60


def _torch_version(version=None):
    v = (version or torch.__version__).split("+")[0]
    parts = []
    for piece in v.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


def default_reduce_dtype(param_dtype, orig_dtypes, version=None):
    """The dtype FSDP2 of torch `version` (default: the installed one) reduces
    in when ``reduce_dtype`` is None; None means "the grad dtype" (param_dtype).

    torch >= 2.15: the params' original dtype (promoted over the group), so
    bf16 compute with fp32 params reduces in fp32. Older torch (FSDP2 from
    2.4 up to 2.14, and FSDP1): ``param_dtype`` when it is set."""
    if param_dtype is None or _torch_version(version) < (2, 15):
        return None
    return functools.reduce(torch.promote_types, orig_dtypes)


class MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy: param_dtype (unsharded params, all-gather
    and compute), reduce_dtype (gradient reduction; None: see
    default_reduce_dtype), output_dtype (cast floating-point forward outputs),
    cast_forward_inputs (cast floating-point forward inputs to param_dtype)."""

    __slots__ = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")

    def __init__(self, param_dtype=None, reduce_dtype=None, output_dtype=None,
                 cast_forward_inputs=True):
        for name, d in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if d is not None and d not in _TORCH_TO_SHARDD:
                raise ValueError(f"MixedPrecisionPolicy.{name} = {d}: shardd takes torch.float32, "
                                 f"torch.bfloat16, torch.float16 or None")
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.output_dtype = output_dtype
        self.cast_forward_inputs = cast_forward_inputs

    def __repr__(self):
        return (f"MixedPrecisionPolicy(param_dtype={self.param_dtype}, reduce_dtype="
                f"{self.reduce_dtype}, output_dtype={self.output_dtype}, "
                f"cast_forward_inputs={self.cast_forward_inputs})")


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


def checkpoint(mesh, step=None, timeout=None):
    """Every rank of the job: the daemon writes every group's full params and
    optimizer state to <--state-dir>/<job>/step-<step> (safetensors; see
    docs/CHECKPOINTS.md), once they are durable. step: default the
    DaemonOptimizer's step_number (the last step() submitted), else 0."""
    if step is None:
        opts = {id(st.optimizer): st.optimizer for st in getattr(mesh, "_shardd_states", [])
                if st.optimizer is not None}
        step = max((o.step_number for o in opts.values()), default=0)
    mesh.checkpoint(step, timeout)
    return step


# ---------------------------------------------------------------- state
class _Param:
    """One managed parameter: where it sits in the modules, its shard and
    unsharded Parameters, and the views of its grad buffers."""

    __slots__ = ("fqn", "name", "index", "places", "sharded", "unsharded", "grad_view",
                 "shard_grad_view", "shard_dim", "has_grad", "partial_has_grad")

    def __init__(self, fqn, index, places, name=None):
        self.fqn = fqn              # its name under the fully_shard'ed module
        self.name = name or fqn     # its name in the daemon's group (and a checkpoint's files)
        self.index = index          # param index in the group
        self.places = places        # [(module, attribute name)]: tied params sit in several
        self.sharded = None
        self.unsharded = None
        self.grad_view = None
        self.shard_grad_view = None
        self.shard_dim = 0
        self.has_grad = False       # the sharded grad holds a reduced gradient
        self.partial_has_grad = False   # the unreduced grad buffer or an HSDP partial has one


class _Ctx:
    """Per-root iteration state shared by the root and the modules under it."""

    def __init__(self, root):
        self.root = root
        self.states = [m._shardd_state for m in root.modules() if isinstance(m, FSDPModule)]
        self.post_forward_order = []    # states, this iteration
        self.prev_order = []            # the last iteration's, for implicit prefetch
        self.backward_queued = False
        self.is_last_backward = True
        self.in_forward = False


class _State:
    def __init__(self, module, client, params, name, mp_policy, reshard_after_forward):
        self.module = module
        self.client = client
        self.params = params
        self.name = name
        self.mp = mp_policy
        self.reshard_after_forward = reshard_after_forward    # None: resolved at lazy init
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.forward_prefetch = None     # explicit [_State] or None: implicit
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
                elif p.sharded.grad.data_ptr() != p.shard_grad_view.data_ptr():
                    p.has_grad = True
                    p.shard_grad_view.copy_(p.sharded.grad)
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
            p.sharded.grad = p.shard_grad_view if p.has_grad else None


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


def peer_failed(err):
    """True when `err` (an exception from forward, backward, clip_grad_norm_,
    step() or a barrier) says another rank died or did not come
    (SHARDD_E_PEER_DIED, SHARDD_E_TIMEOUT) or is recovering (a barrier
    mismatch against DaemonOptimizer.recover's barrier: the daemon puts the
    barrier number met in the completion, err.result[0]): every rank then
    calls DaemonOptimizer.recover()."""
    if not isinstance(err, ShardError) or isinstance(err, DaemonGone):
        return False
    if err.code == -P.E_MISMATCH:
        return bool(err.result and err.result[0] & _RECOVER_BARRIER)
    return err.code in (-P.E_PEER_DIED, -P.E_TIMEOUT)


def _quietly(fn):
    """fn(), ignoring the daemon's refusal (a collective that failed with a
    dead peer, a reshard with nothing held); a lost daemon still raises."""
    try:
        fn()
    except DaemonGone:
        raise
    except ShardError:
        pass


# ---------------------------------------------------------------- hooks
def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _map_tensors(fn, obj):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(fn, o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _cast_fp(dtype, obj):
    return _map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t,
                        obj)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the gradients of
    the module's parameters are accumulated (AccumulateGrad runs first)."""

    @staticmethod
    def forward(ctx, state, *inputs):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        st = ctx.state
        st.forward_calls -= 1
        if st.forward_calls == 0 and st.needs_post_backward:
            st.post_backward()
        return (None,) + grads


def _register_post_backward(state, args, kwargs):
    flat = [t for t in itertools.chain(_tensors(args), _tensors(kwargs)) if t.requires_grad]
    if not flat:
        return args, kwargs
    outs = iter(_PostBackward.apply(state, *flat))
    ids = {id(t) for t in flat}
    swap = {}
    for t in flat:
        swap.setdefault(id(t), next(outs))
    state.forward_calls += 1

    def sub(t):
        return swap[id(t)] if id(t) in ids else t
    return _map_tensors(sub, args), _map_tensors(sub, kwargs)


def _lazy_init(state):
    if state.ctx is not None:
        return
    ctx = _Ctx(state.module)
    for st in ctx.states:
        if st.ctx is None:
            st.ctx = ctx
            if st.reshard_after_forward is None:
                st.reshard_after_forward = st is not state
    if state.reshard_after_forward is None:
        state.reshard_after_forward = False


def _pre_forward(state, args, kwargs):
    if state.ctx is None:
        _lazy_init(state)
    ctx = state.ctx
    if state is ctx.states[0] and not ctx.in_forward:
        # The root's forward starts an iteration.
        ctx.in_forward = True
        if ctx.post_forward_order:
            ctx.prev_order = ctx.post_forward_order
        ctx.post_forward_order = []
        for st in ctx.states:
            st.pre_backward_done = False
            st.needs_post_backward = False
            st.forward_calls = 0
    state.wait_unshard()
    targets = state.forward_prefetch
    if targets is None and ctx.prev_order:
        try:
            i = ctx.prev_order.index(state)
            targets = ctx.prev_order[i + 1:i + 2]
        except ValueError:
            targets = []
    for st in targets or ():
        st.start_unshard()
    if state.mp.cast_forward_inputs and state.mp.param_dtype is not None:
        args, kwargs = _cast_fp(state.mp.param_dtype, args), _cast_fp(state.mp.param_dtype, kwargs)
    if torch.is_grad_enabled() and any(p.sharded.requires_grad for p in state.params):
        state.needs_post_backward = True
        args, kwargs = _register_post_backward(state, args, kwargs)
    return args, kwargs


def _post_forward(state, output):
    ctx = state.ctx
    if torch.is_grad_enabled():
        ctx.post_forward_order.append(state)
    if state.reshard_after_forward:
        state.reshard()
    if torch.is_grad_enabled():
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(_pre_backward, state))
    if state is ctx.states[0]:
        ctx.in_forward = False
    if state.mp.output_dtype is not None:
        output = _cast_fp(state.mp.output_dtype, output)
    return output


def _pre_backward(state, grad):
    ctx = state.ctx
    if not ctx.backward_queued:
        ctx.backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_finish_backward, ctx))
    if state.pre_backward_done:
        return grad
    state.pre_backward_done = True
    state.wait_unshard()
    targets = state.backward_prefetch
    if targets is None:
        order = ctx.post_forward_order
        try:
            i = order.index(state)
            targets = order[i - 1:i] if i > 0 else []
        except ValueError:
            targets = []
    for st in targets:
        if st.needs_post_backward:
            st.start_unshard()
    return grad


def _finish_backward(ctx):
    """End of backward (queued on the autograd engine): post-backward for the
    modules whose input gradients were not needed, then wait for every reduce."""
    ctx.backward_queued = False
    for st in reversed(ctx.states):
        if st.needs_post_backward:
            st.post_backward()
    for st in ctx.states:
        if st.unshard_pending is not None or (st.unsharded and st.reshard_after_backward):
            st.reshard()    # prefetched, but its forward did not run
        if ctx.is_last_backward:
            st.wait_reduce()
        st.pre_backward_done = False


# ---------------------------------------------------------------- FSDPModule
class UnshardHandle:
    """Returned by FSDPModule.unshard(async_op=True): wait() finishes it
    (the module's forward waits by itself)."""

    def __init__(self, state):
        self._state = state

    def wait(self):
        self._state.wait_unshard()


class FSDPModule:
    """Mixed into the class of every module fully_shard was applied to, as
    FSDP2 does (``isinstance(m, FSDPModule)``)."""

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
        _lazy_init(st)
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
        gives this rank's shards instead."""
        if args:
            raise TypeError(f"{type(self).__name__}.state_dict: pass destination, prefix and "
                            f"keep_vars by keyword")
        sd = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        st = self._shardd_state
        own = {k: q for k, (_m, s2, q) in _managed_keys(self).items() if s2 is st}
        if own:
            full = _gather(self, st)
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
        state is the daemon's and not touched."""
        keys = _managed_keys(self)
        rest = {k: v for k, v in state_dict.items() if k not in keys}
        res = super().load_state_dict(rest, strict=False, **kwargs)
        missing = [k for k in res.missing_keys if k not in keys]
        missing += [k for k in keys if k not in state_dict]
        done = set()
        with torch.no_grad():
            for k, (_m, st, q) in keys.items():
                if k in state_dict and (id(st), q.index) not in done:
                    _load_full(st, q, k, state_dict[k], f"{type(self).__name__}.load_state_dict")
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


def _placement_dim(result, name):
    if result is None:
        return 0
    dim = getattr(result, "dim", result)
    if not isinstance(dim, int):
        raise TypeError(f"shard_placement_fn returned {result!r} for param '{name}': give "
                        f"Shard(dim), an int dim or None")
    return dim


def fully_shard(module, *, mesh, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=None):
    """Shard `module`'s parameters (those no nested fully_shard manages)
    through shardd; returns the module, now also an FSDPModule.

    mesh: the shardd.Client of this rank (init_device_mesh). reshard_after_forward:
    True frees the unsharded params after forward and gathers them again in
    backward; False keeps them; None: True except for the root module.
    shard_placement_fn(param) -> Shard(dim) / int dim / None (dim 0).
    mp_policy: MixedPrecisionPolicy. Collective: every rank calls it on the
    same modules in the same order, with the same initial parameter values
    (each rank keeps its own rows of them)."""
    if not isinstance(mesh, Client):
        raise TypeError(f"fully_shard: mesh must be the shardd.Client of this rank "
                        f"(shardd.torch.init_device_mesh), not {type(mesh).__name__}")
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
    count = getattr(mesh, "_shardd_fsdp_groups", 0)
    mesh._shardd_fsdp_groups = count + 1
    name = f"{count}.{type(module).__name__}"[:P.NAME_MAX - 1]
    # Under a DaemonOptimizer the daemon knows each param by its name in the model the optimizer
    # was constructed over (torch's state_dict key): unique across the job's groups, as a
    # checkpoint needs, and what an unsharded model loads. Else by its name under `module`.
    params = [_Param(names[id(p)], i, places[id(p)], opt._names.get(id(p)) if opt else None)
              for i, p in enumerate(order)]
    state = _State(module, mesh, params, name, mp, reshard_after_forward)
    if params:
        _register(state, order, shard_placement_fn, opt)
        if opt is not None:
            opt._attach(state, order)
        state.optimizer = opt
        mesh._shardd_states = getattr(mesh, "_shardd_states", []) + [state]
        for p in params:
            p.sharded._shardd_state = state
    module._shardd_state = state
    module.__class__ = _fsdp_class(type(module))
    try:
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: _pre_forward(state, args, kwargs), with_kwargs=True)
    except TypeError:   # torch < 2.0: no kwargs in hooks
        module.register_forward_pre_hook(lambda _m, args: _pre_forward(state, args, {})[0])
    module.register_forward_hook(lambda _m, _args, output: _post_forward(state, output))
    return module


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


def _register(state, tensors, shard_placement_fn, optimizer=None):
    mp = state.mp
    specs = []
    for p, t in zip(state.params, tensors):
        if t.dtype not in _TORCH_TO_SHARDD:
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
        specs.append(Param(p.name, _TORCH_TO_SHARDD[t.dtype], tuple(t.shape), p.shard_dim))
    reduce_dtype = mp.reduce_dtype
    if reduce_dtype is None:
        reduce_dtype = default_reduce_dtype(mp.param_dtype, {t.dtype for t in tensors})
    pd = _TORCH_TO_SHARDD[mp.param_dtype] if mp.param_dtype is not None else None
    rd = _TORCH_TO_SHARDD[reduce_dtype] if reduce_dtype is not None else None
    resume = getattr(state.client, "_shardd_resume", False)
    restore = getattr(state.client, "_shardd_restore", None)
    try:
        if resume:
            g = state.client.open_group(state.name)
        else:
            g = state.client.register_group(state.name, specs, pd, rd,
                                            optimizer=optimizer.config if optimizer else None,
                                            restore=restore)
    except ShardError as e:
        fix = ""
        if e.code == -errno.EEXIST:
            fix = (": the group already exists in the daemon; a restarted rank re-attaches with "
                   "init_device_mesh(..., resume=True)")
        raise type(e)(e.code, f"{state.where('registration')}: {e.text}{fix}") from None
    state.group = g
    if resume:
        _check_reopened(state, g, specs, pd, rd, optimizer)
    load = not resume and restore is None   # a restored group holds the checkpoint's values
    with torch.no_grad():
        for p, t in zip(state.params, tensors):
            if load:
                full = t.detach().cpu().contiguous()
                if full.dtype == torch.bfloat16:
                    g.load_full(p.index, full.view(torch.int16).numpy().view("uint16"))
                else:
                    g.load_full(p.index, full.numpy())
            p.sharded = torch.nn.Parameter(g.tensor("shard", p.index), requires_grad=t.requires_grad)
            p.shard_grad_view = g.tensor("shard_grad", p.index)
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
                out.append((name, t, hit.shard_dim, st.group.shard_rows(hit.index)[0]))
                break
    return out


# ---------------------------------------------------------------- full state dicts
def _managed(model):
    """(name under `model`, state, _Param) of every param fully_shard manages under it."""
    for prefix, m in model.named_modules():
        st = getattr(m, "_shardd_state", None) if isinstance(m, FSDPModule) else None
        for p in (st.params if st is not None else []):
            yield (prefix + "." if prefix else "") + p.fqn, m, st, p


def _managed_keys(model):
    """{state_dict key under `model`: (module, state, _Param)} of every param
    fully_shard manages under it, tied params under each of their names."""
    owner = {}
    for _n, m in model.named_modules():
        st = getattr(m, "_shardd_state", None) if isinstance(m, FSDPModule) else None
        for q in (st.params if st is not None else []):
            owner[id(q.sharded)] = owner[id(q.unsharded)] = (m, st, q)
    out = {}
    for mname, mod in model.named_modules():
        for attr, t in mod._parameters.items():
            if t is not None and id(t) in owner:
                out[(mname + "." if mname else "") + attr] = owner[id(t)]
    return out


def _gather(m, st):
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


def _load_full(st, p, name, tensor, what):
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
            done[id(st)] = _gather(m, st)
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
            _load_full(st, p, name, state_dict[name], "load_full_state_dict")
            names.add(name)
    extra = sorted(set(state_dict) - names)
    if extra:
        raise KeyError(f"load_full_state_dict: {extra} are no params fully_shard manages here")


# ---------------------------------------------------------------- clip_grad_norm_
def _clip_states(model_or_params):
    """The fully_shard states whose grads clip_grad_norm_ covers, all of one
    mesh, and that mesh; refuses params the daemon does not hold."""
    if isinstance(model_or_params, torch.nn.Module):
        where = f"clip_grad_norm_({type(model_or_params).__name__})"
        params = list(model_or_params.parameters())
        states = [m._shardd_state for m in model_or_params.modules() if isinstance(m, FSDPModule)]
        states = [st for st in states if st.group is not None]
    else:
        where = "clip_grad_norm_"
        params = [model_or_params] if isinstance(model_or_params, torch.Tensor) \
            else list(model_or_params)
        states = []
    for t in params:
        st = getattr(t, "_shardd_state", None)
        if st is None:
            raise ValueError(f"{where}: a param of shape {tuple(t.shape)} is in no fully_shard "
                             f"group, so the daemon's grad_norm does not see its grad: apply "
                             f"fully_shard to every module whose params are clipped (the root "
                             f"last), or use torch.nn.utils.clip_grad_norm_ for local params")
        if st not in states:
            states.append(st)
    if not states:
        raise ValueError(f"{where}: no param of a fully_shard group given")
    mesh = states[0].client
    if any(st.client is not mesh for st in states):
        raise ValueError(f"{where}: the params belong to more than one shardd mesh (job); "
                         f"clip each job's params on its own")
    missing = [st.name for st in mesh._shardd_states if st not in states]
    if missing:
        raise ValueError(f"{where}: the daemon's grad_norm is job-wide, over every group of job "
                         f"'{mesh.job}', but groups {missing} are not among the params given: "
                         f"pass the whole model (or all of its params)")
    return states, mesh


def clip_grad_norm_(model_or_params, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_ over fully_shard groups, without an
    all-reduce by the trainer: the daemon's job-wide GRAD_NORM gives the total
    norm of every group's sharded grads (collective: every rank calls it once
    per step, after backward). Returns the total norm as a 0-d fp32 tensor.

    Groups stepped by a DaemonOptimizer: the grad_norm is keyed by the
    optimizer's next step number, and its next step() asks the daemon to
    clip by it (SHARDD_STEP_CLIP_JOB with max_norm: the daemon computes
    min(1, max_norm / (total_norm + 1e-6)) in fp32 as torch does and
    multiplies it into the grads as it steps them), so a restarted rank's
    catch-up step is clipped alike. Other groups (a trainer-side
    torch.optim optimizer): the sharded grads are multiplied here, as torch
    does. norm_type: 2.0 or inf (the daemon's). A non-finite norm raises
    with error_if_nonfinite, as torch; otherwise a
    DaemonOptimizer(skip_nonfinite=True) skips the step on every rank (the
    daemon decides by the job's grad_norm: SHARDD_STEP_SKIP_JOB_NONFINITE).
    foreach is accepted for torch's signature and unused (the daemon
    computes the norm)."""
    del foreach
    norm_type = float(norm_type)
    max_norm = float(max_norm)
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type:g} is not supported by the "
                         f"daemon's grad_norm: use 2.0 or inf")
    states, mesh = _clip_states(model_or_params)
    for st in mesh._shardd_states:
        st.wait_reduce()
    opts = {st.optimizer for st in states if st.optimizer is not None}
    numbers = {opt.step_number for opt in opts}
    if len(numbers) > 1:
        raise ValueError(f"clip_grad_norm_: the params' DaemonOptimizers are at different steps "
                         f"({sorted(numbers)}); clip the params of one optimizer at a time")
    if numbers:
        # The daemon's step of this number clips and skips by this grad_norm.
        key = numbers.pop() + 1
    else:
        key = getattr(mesh, "_shardd_norm_count", 0) + 1
        mesh._shardd_norm_count = key
    try:
        norm, nonfinite = mesh.grad_norm(key, norm_type)
    except ShardError as e:
        raise type(e)(e.code, f"clip_grad_norm_ on rank {mesh.rank} of job '{mesh.job}': "
                              f"{e.text}") from None
    total = torch.tensor(norm, dtype=torch.float32)
    if error_if_nonfinite and (nonfinite or not torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    if not max_norm > 0 or max_norm == float("inf"):
        raise ValueError(f"clip_grad_norm_: max_norm = {max_norm:g}; the daemon clips by a finite "
                         f"max_norm > 0")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for st in states:
        if st.optimizer is not None:
            continue
        for p in st.params:
            if p.sharded.grad is not None:
                p.sharded.grad.detach().mul_(coef)
    for opt in opts:
        opt._clip = (key, max_norm, float(norm), bool(nonfinite))
    return total


# ---------------------------------------------------------------- the daemon's optimizer
class DaemonOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step() is the daemon's: it submits one
    STEP per fully_shard group (the optimizer state lives in the daemon, fp32,
    per shard; this object holds only the lr and the step count).

    Construct it (DaemonSGD / DaemonAdamW) over the unsharded model BEFORE
    fully_shard: each fully_shard under it then registers its group with the
    optimizer's config. param_groups is one group (the model's parameters,
    replaced by their shards as fully_shard registers them) whose "lr" is
    read at every step, so torch.optim.lr_scheduler works; the other
    hyperparameters are fixed at registration. The n-th step() is the
    daemon's step number n (state_dict()/load_state_dict() carry it with the
    lr), applied at most once per group and rank shard: re-submitting an
    applied step changes nothing and reports P.STEP_ALREADY in last_results.
    last_step is the daemon's last applied step when the groups were
    registered.

    The daemon steps a whole shard: a param whose grad is None (no gradient
    this iteration) still gets momentum and weight decay, unlike torch.optim,
    which skips it."""

    def __init__(self, model, config, defaults, skip_nonfinite=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(self).__name__}: give the model (an nn.Module, before "
                            f"fully_shard), not {type(model).__name__}")
        for name, m in model.named_modules():
            if isinstance(m, FSDPModule):
                raise ValueError(
                    f"{type(self).__name__}: module '{name or type(m).__name__}' is already "
                    f"fully_shard'ed, so its group was registered without the daemon's "
                    f"optimizer: construct {type(self).__name__}(model, ...) before fully_shard")
            other = getattr(m, "_shardd_optimizer", None)
            if other is not None:
                raise ValueError(f"{type(self).__name__}: module '{name or type(m).__name__}' "
                                 f"is already under a {type(other).__name__}")
        for name, p in model.named_parameters():
            if p.dtype != torch.float32:
                raise TypeError(f"{type(self).__name__}: param '{name}' is {p.dtype}; the "
                                f"daemon's optimizer keeps fp32 master shards (keep the params "
                                f"fp32 and give MixedPrecisionPolicy(param_dtype=...))")
            if not p.requires_grad:
                raise ValueError(f"{type(self).__name__}: param '{name}' does not require grad; "
                                 f"the daemon steps every param of a group (weight decay and "
                                 f"momentum would move it): keep frozen params out of the model "
                                 f"given to it")
        if not 0.0 <= defaults["lr"] < float("inf"):
            raise ValueError(f"{type(self).__name__}: lr = {defaults['lr']}: give a finite "
                             f"lr >= 0")
        super().__init__(list(model.parameters()), defaults)
        self.config = config
        self.skip_nonfinite = skip_nonfinite
        self.step_number = 0        # daemon step numbers submitted so far
        self._clip = None           # (step number, max_norm, norm, nonfinite) from clip_grad_norm_
        self._resumed = False       # groups re-opened (resume=True), recover() not run yet
        self.last_results = {}      # group name -> P.STEP_* of the last step()
        self._states = []
        self._names = {id(p): n for n, p in model.named_parameters()}   # originals' names
        self._sharded = set()       # ids of the shards fully_shard registered with it
        for m in model.modules():
            m._shardd_optimizer = self

    def add_param_group(self, param_group):
        if self.param_groups:
            raise ValueError(f"{type(self).__name__}: one param group only (the daemon's "
                             f"hyperparameters are per fully_shard group, fixed at registration)")
        super().add_param_group(param_group)

    def _attach(self, state, originals):
        """fully_shard registered `state`'s group with this optimizer: step it,
        and hold its shards in param_groups instead of the originals."""
        self._states.append(state)
        if getattr(state.client, "_shardd_resume", False):
            self._resumed = True
            self.step_number = min(st.group.last_step for st in self._states)
        elif getattr(state.client, "_shardd_restore", None) is not None:
            self.step_number = min(st.group.last_step for st in self._states)
        shards = {id(t): p.sharded for t, p in zip(originals, state.params)}
        self._sharded.update(id(p.sharded) for p in state.params)
        group = self.param_groups[0]
        group["params"] = [shards.get(id(t), t) for t in group["params"]]

    @property
    def last_step(self):
        """The last step the daemon had applied on this rank's shards when the
        groups were registered (the smallest over the groups; 0: none)."""
        if not self._states:
            raise RuntimeError(self._unregistered())
        return min(st.group.last_step for st in self._states)

    def _unregistered(self):
        return (f"{type(self).__name__}: no fully_shard group is registered with it: apply "
                f"fully_shard to the model it was constructed over (after constructing it)")

    @torch.no_grad()
    def step(self, closure=None, *, clip=None):
        """Submit the daemon's step number step_number + 1 for every group and
        wait for it. clip: a coefficient multiplied into the grads, or None:
        clipping by the job's grad_norm of this step if
        shardd.torch.clip_grad_norm_ ran for it (the daemon computes the
        coefficient). With skip_nonfinite, a step whose job-wide grad norm
        (clip_grad_norm_) was non-finite is skipped on every rank; without
        clip_grad_norm_ each rank's shard decides (a NaN/Inf in it skips it).
        Returns closure's loss (None without closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._states:
            raise RuntimeError(self._unregistered())
        missed = [self._names.get(id(t), "?") for t in self.param_groups[0]["params"]
                  if id(t) not in self._sharded]
        if missed:
            raise RuntimeError(f"{type(self).__name__}.step: params {missed} are in no "
                               f"fully_shard group, so the daemon would not step them: apply "
                               f"fully_shard to the model it was constructed over (the root "
                               f"last), as to every module whose params it should own")
        lr = self.param_groups[0]["lr"]
        if not 0.0 <= lr < float("inf"):
            raise ValueError(f"{type(self).__name__}.step: lr = {lr}: the daemon takes a finite "
                             f"lr >= 0 (check the lr scheduler)")
        number = self.step_number + 1
        max_norm, norm = None, 0.0
        if clip is None and self._clip is not None and self._clip[0] == number:
            _n, max_norm, norm, _nonfinite = self._clip
        self._clip = None
        # Every reduce first: a rank that fails here has stepped no group.
        for st in self._states:
            st.wait_reduce()
            if st.unsharded or st.unshard_pending is not None:
                raise RuntimeError(f"{st.where('step')}: the module holds its unsharded params; "
                                   f"call reshard() on it before the optimizer step")
        skip = self.skip_nonfinite
        if (clip is not None and clip != clip) or (max_norm is not None and norm != norm and not skip):
            raise ValueError(f"{type(self).__name__}.step: clip_grad_norm_ found a NaN total "
                             f"norm, and the daemon takes no NaN clip coefficient (torch would "
                             f"turn every param into NaN): construct the optimizer with "
                             f"skip_nonfinite=True to skip such steps on every rank, or call "
                             f"clip_grad_norm_(..., error_if_nonfinite=True) to stop")
        # With clip_grad_norm_, the daemon clips and skips by the job's grad_norm of this step.
        flags, args = step_flags_args(lr, skip, clip, max_norm, skip and max_norm is not None)
        pending = []
        for st in self._states:
            where = f"step(group '{st.name}', step {number})"
            pending.append((st, st.client.start([(P.OP_STEP, st.group.id, number, flags, where,
                                                  args)])))
        results = {}
        for st, pend in pending:
            try:
                results[st.name] = pend.wait()[0].res
            except ShardError as e:
                raise st._wrap("step", e) from None
            for p in st.params:     # the daemon consumed and cleared the sharded grads
                p.has_grad = False
                p.sharded.grad = None
        self.step_number = number
        self.last_results = results
        return loss

    def recover(self, timeout=None):
        """Collective recovery after a rank died: every rank calls it, the
        survivors when an op failed with SHARDD_E_PEER_DIED or
        SHARDD_E_TIMEOUT (a ShardError from forward, backward or step()), the
        restarted rank after re-attaching (init_device_mesh(resume=True) and
        the same fully_shard calls). Returns the step number every rank
        resumes after (step_number): the training loop goes on with its
        iteration step_number + 1 (0-based: the iteration step_number).

        What it does: each rank drops its iteration in flight and the ranks
        meet at a first barrier (after it, no rank has a step in flight).
        Each then reads from the daemon, per group, the last step applied on
        its shard and the highest one applied on any shard of the group
        (the GROUP reply's last_step and peer_last_step). Ranks that lived
        through the failure agree on it; the restarted rank may be one step
        behind (it died after that step's reduces completed, before its own
        STEP of some group): it replays that step (SHARDD_STEP_REPLAY), so
        the daemon applies it with the lr, clip (max_norm against the job's
        grad_norm of the step) and skip the other ranks submitted, from the
        sharded grads it kept: every update is applied exactly once. The
        ranks confirm the step at a second barrier, every rank clears its
        sharded grads and the op keys restart from the agreed step. One dead
        rank at a time; timeout: seconds to wait for the other ranks
        (default: twice the daemon's collective timeout plus 30 s)."""
        if not self._states:
            raise RuntimeError(self._unregistered())
        mesh = self._states[0].client
        if timeout is None:
            timeout = 2 * mesh.collective_timeout_ms / 1000 + 30
        deadline = time.monotonic() + timeout
        resumed = self._resumed
        for st in self._states:
            st.abandon(0)
        if not resumed:
            self._zero_grads()
        where = f"{type(self).__name__}.recover on rank {mesh.rank} of job '{mesh.job}'"
        self._recover_barrier(mesh, _RECOVER_BARRIER, deadline, f"{where} (first barrier)")
        last = {st.name: self._daemon_steps(st) for st in self._states}
        step = min(own for own, _peer in last.values())
        ahead = max(peer for _own, peer in last.values())
        if not resumed and any(own != step for own, _peer in last.values()):
            raise RuntimeError(f"{where}: the daemon's last steps (own, highest of the group) "
                               f"differ between groups ({last}) on a rank that did not restart")
        if resumed and ahead == step + 1:
            # The others applied step + 1, so its reduces completed and the
            # daemon kept this rank's reduced grads (some groups may have
            # stepped before this rank died: they answer ALREADY).
            self._catch_up(ahead)
            step = ahead
        elif ahead != step:
            raise RuntimeError(f"{where}: this rank resumes after step {step} but a rank of the "
                               f"groups after step {ahead} ({last}); recovery handles one "
                               f"restarted rank at a time")
        if step >= 1 << _KEY_STEP_BITS:
            raise ValueError(f"{where}: step {step} is past the {_KEY_STEP_BITS}-bit step field "
                             f"of the recovery barrier")
        self._recover_barrier(mesh, _RECOVER_BARRIER | _RECOVER_AGREE | step, deadline,
                              f"{where} at step {step}", retry_mismatch=False)
        self._zero_grads()
        base = (step + 1) << 24
        for st in self._states:
            st.abandon(base)
        mesh._shardd_norm_count = base
        self.step_number = step
        self._resumed = False
        self._clip = None
        return step

    @staticmethod
    def _recover_barrier(mesh, number, deadline, where, retry_mismatch=True):
        """Barrier `number`, tried again until `deadline` while a rank is not
        attached yet or still in a barrier of its own (it fails that one and
        comes here)."""
        retry = (-P.E_PEER_DIED, -P.E_TIMEOUT) + ((-P.E_MISMATCH,) if retry_mismatch else ())
        while True:
            try:
                mesh.barrier(number)
                return
            except DaemonGone:
                raise
            except ShardError as e:
                left = deadline - time.monotonic()
                if left <= 0 or e.code not in retry:
                    raise type(e)(e.code, f"{where}: {e.text}") from None
                if e.code != -P.E_MISMATCH:
                    time.sleep(min(0.02, left))

    def _daemon_steps(self, st):
        """(last step applied on this rank's shard, highest on any shard) of
        the group, read from the daemon now."""
        g = st.client.open_group(st.name)
        try:
            return g.last_step, g.peer_last_step
        finally:
            g.close()
            st.client.groups.remove(g)

    def _catch_up(self, number):
        """Replay step `number` as the other ranks of each group submitted it
        (the daemon holds their lr, max_norm and flags); a group that already
        applied it answers ALREADY."""
        for st in self._states:
            flags, args = step_flags_args(0.0, replay=True)
            where = f"step(group '{st.name}', step {number}, replay)"
            try:
                st.client.start([(P.OP_STEP, st.group.id, number, flags, where, args)]).wait()
            except ShardError as e:
                raise st._wrap(f"recovery of step {number}", e) from None

    def _zero_grads(self):
        pend = [st.client.start([(P.OP_ZERO_GRAD, st.group.id, 0, 0,
                                  f"zero_grad(group '{st.name}')")]) for st in self._states]
        for st, p in zip(self._states, pend):
            try:
                p.wait()
            except ShardError as e:
                raise st._wrap("recovery zero_grad", e) from None

    def state_dict(self):
        """The lr (and any scheduler keys in the param group) and the step
        count; the optimizer state (momentum, exp_avg, ...) stays in the
        daemon and is not in it."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.param_groups[0]["params"])))
        return {"state": {}, "param_groups": [group], "step_number": self.step_number}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"{type(self).__name__}.load_state_dict: {len(groups)} param "
                             f"groups; this optimizer has 1")
        fixed = self.defaults.keys() - {"lr"}
        for k in fixed:
            if k in groups[0] and groups[0][k] != self.param_groups[0][k]:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {k} = {groups[0][k]} "
                                 f"but the daemon's optimizer was registered with "
                                 f"{self.param_groups[0][k]}")
        self.param_groups[0].update({k: v for k, v in groups[0].items() if k != "params"})
        self.step_number = int(state_dict["step_number"])


class DaemonSGD(DaemonOptimizer):
    """torch.optim.SGD in the daemon: DaemonSGD(model, lr, momentum=0,
    dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
    skip_nonfinite=False). See DaemonOptimizer."""

    def __init__(self, model, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, skip_nonfinite=False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        config = Optimizer.sgd(momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                               nesterov=nesterov, maximize=maximize)
        super().__init__(model, config, defaults, skip_nonfinite)


class DaemonAdamW(DaemonOptimizer):
    """torch.optim.AdamW in the daemon: DaemonAdamW(model, lr=1e-3,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
    maximize=False, skip_nonfinite=False). See DaemonOptimizer."""

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, skip_nonfinite=False):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        config = Optimizer.adamw(betas=betas, eps=eps, weight_decay=weight_decay,
                                 amsgrad=amsgrad, maximize=maximize)
        super().__init__(model, config, defaults, skip_nonfinite)

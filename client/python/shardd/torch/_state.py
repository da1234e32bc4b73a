# SPDX-License-Identifier: MIT
"""The hooks fully_shard puts on a module and the state they share (FSDP2's
_fsdp_state.py): forward pre- and post-hooks, the backward hooks on
outputs and inputs, the root's lazy init and end of backward, and the
iteration context a root shares with the modules under it."""

import functools
import itertools

import torch


def module_state(module):
    """The FSDPParamGroup fully_shard gave `module`, or None when it was not
    applied to it. fully_shard sets the state and the FSDPModule class
    together, so this answers isinstance(module, FSDPModule) for the files
    below _fully_shard.py, which cannot import FSDPModule (FSDP2's
    _get_module_fsdp_state)."""
    return getattr(module, "_shardd_state", None)


class _Ctx:
    """Per-root iteration state shared by the root and the modules under it."""

    def __init__(self, root):
        self.root = root
        self.states = [st for st in map(module_state, root.modules()) if st is not None]
        self.post_forward_order = []    # states, this iteration
        self.prev_order = []            # the last iteration's, for implicit prefetch
        self.backward_queued = False
        self.is_last_backward = True
        self.in_forward = False


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


def lazy_init(state):
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


def pre_forward(state, args, kwargs):
    if state.ctx is None:
        lazy_init(state)
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


def post_forward(state, output):
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

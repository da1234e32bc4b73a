# SPDX-License-Identifier: MIT
"""PyTorch integration: shard a module's parameters through shardd, FSDP2 style.

    fsdp = FullyShardedModule(client, model, [model.fc1, model.fc2])
    opt = torch.optim.SGD(fsdp.shard_parameters(), lr=0.1)
    for batch in data:
        loss = loss_fn(model(batch))   # forward pre-hooks unshard each group
        loss.backward()                # at its end: reduce every group, reshard
        opt.step()                     # updates this rank's shards in place
        fsdp.zero_grad()               # the zero_grad op

What lives where:

* Each listed submodule is one group (its parameters not owned by a deeper
  listed submodule); the root's remaining parameters form the group "root".
* A module parameter's ``.data`` is a read-only view of the group's unsharded
  buffer (param_dtype), valid between unshard and reshard.  Forward and
  backward only read parameters, so the read-only mapping is never written.
* A module parameter's ``.grad`` is a view of this rank's grad buffer, so
  autograd accumulates gradients in place in the shared memory (no copy); if
  something replaced ``.grad``, it is copied back before the reduce.
* shard_parameters() are leaf tensors over this rank's flat shard (original
  dtype, padding rows included) whose ``.grad`` is the sharded grad: a stock
  ``torch.optim`` optimizer updates the rank's shard in place.  Padding rows
  get zero gradients, so SGD (with weight decay or momentum) and Adam leave
  them zero.

Backward: with reshard_after_forward=True a group is resharded after its
forward and unsharded again when the gradient of its output arrives (a tensor
hook on the outputs, which works on torch 1.13 as on 2.x).  The reduce runs
in a callback queued on the autograd engine at the first such hook, i.e. once
backward is over; finish_backward() does the same explicitly.
"""

import warnings

import numpy as np
import torch

from . import proto as P
from .client import Param

_TORCH_TO_SHARDD = {torch.float32: P.DTYPE_FP32, torch.bfloat16: P.DTYPE_BF16,
                    torch.float16: P.DTYPE_FP16}
_SHARDD_TO_TORCH = {v: k for k, v in _TORCH_TO_SHARDD.items()}


def tensor_view(array, code):
    """A torch tensor sharing memory with numpy `array` (shardd dtype `code`;
    bf16 arrays are uint16 bits and come back as torch.bfloat16)."""
    with warnings.catch_warnings():
        # The unsharded buffer is mapped PROT_READ: torch warns that it may
        # not be written, which is exactly the contract (forward only reads).
        warnings.simplefilter("ignore", UserWarning)
        if code == P.DTYPE_BF16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def tensor_to_numpy(t):
    """Host numpy copy-free view of a CPU tensor; bf16 as uint16 bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _GroupState:
    def __init__(self, name, module, params):
        self.name = name
        self.module = module
        self.params = params          # [(qualified name, nn.Parameter)]
        self.group = None             # shardd Group
        self.unsharded_step = None    # step of the held unsharded copy, None if resharded
        self.grad_views = []
        self.shard_params = []


class FullyShardedModule:
    """Shards `module`'s parameters through a shardd Client (see the module doc)."""

    def __init__(self, client, module, submodules=(), param_dtype=None, reduce_dtype=None,
                 reshard_after_forward=False, group_prefix=""):
        self.client = client
        self.module = module
        self.reshard_after_forward = reshard_after_forward
        self.step = 0
        self._backward_queued = False
        self._hooks = []
        self._groups = self._assign(module, list(submodules), group_prefix)
        for gs in self._groups:
            self._register(gs, param_dtype, reduce_dtype)
        for gs in self._groups:
            self._hooks.append(gs.module.register_forward_pre_hook(self._make_pre_forward(gs)))
            self._hooks.append(gs.module.register_forward_hook(self._make_post_forward(gs)))

    # ------------------------------------------------------------ setup
    @staticmethod
    def _assign(module, submodules, prefix):
        qual = {id(p): n for n, p in module.named_parameters()}
        mod_names = {id(m): n for n, m in module.named_modules()}
        for m in submodules:
            if id(m) not in mod_names:
                raise ValueError(f"{type(m).__name__} is not a submodule of the wrapped module")
        owner = {}
        # A parameter belongs to the deepest listed submodule holding it
        # (FSDP2 applies fully_shard bottom-up): the one with fewest params.
        sized = sorted(submodules, key=lambda m: sum(1 for _ in m.parameters()))
        for m in sized:
            for p in m.parameters():
                owner.setdefault(id(p), m)
        groups = []
        for m in submodules + [module]:
            params = [(qual[id(p)], p) for p in module.parameters()
                      if owner.get(id(p), module) is m]
            if not params or (m is module and m in submodules):
                continue
            name = mod_names[id(m)] or "root"
            groups.append(_GroupState(prefix + name, m, params))
        return groups

    def _register(self, gs, param_dtype, reduce_dtype):
        specs = []
        for n, p in gs.params:
            if p.dtype not in _TORCH_TO_SHARDD:
                raise TypeError(f"param '{n}' has dtype {p.dtype}; shardd takes float32, "
                                "bfloat16 and float16")
            specs.append(Param(n, _TORCH_TO_SHARDD[p.dtype], tuple(p.shape)))
        pd = _TORCH_TO_SHARDD[param_dtype] if isinstance(param_dtype, torch.dtype) else param_dtype
        rd = _TORCH_TO_SHARDD[reduce_dtype] if isinstance(reduce_dtype, torch.dtype) else reduce_dtype
        g = self.client.register_group(gs.name, specs, pd, rd)
        gs.group = g
        for i, (n, p) in enumerate(gs.params):
            g.load_full(i, tensor_to_numpy(p))
            ucode = g._unsharded_dtype(i)
            p.data = tensor_view(g.unsharded(i), ucode)
            gv = tensor_view(g.grad(i), g._grad_dtype(i))
            gv.zero_()
            p.grad = gv
            gs.grad_views.append(gv)
            code = specs[i].dtype
            sp = torch.nn.Parameter(tensor_view(g.shard(i), code))
            sp.grad = tensor_view(g.shard_grad(i), code)
            gs.shard_params.append(sp)

    # ------------------------------------------------------------ access
    def shard_parameters(self):
        """This rank's shards as leaf tensors, .grad = sharded grad: give them
        to a torch.optim optimizer."""
        return [sp for gs in self._groups for sp in gs.shard_params]

    def named_shard_parameters(self):
        return [(n, sp) for gs in self._groups for (n, _p), sp in zip(gs.params, gs.shard_params)]

    @property
    def groups(self):
        """{group name: shardd Group}"""
        return {gs.name: gs.group for gs in self._groups}

    # ------------------------------------------------------------ ops
    def _unshard(self, groups):
        todo = [gs for gs in groups if gs.unsharded_step != self.step]
        if not todo:
            return
        self.client.run_many((P.OP_UNSHARD, gs.group.id, self.step, 0,
                              f"unshard(group '{gs.name}', step {self.step})") for gs in todo)
        for gs in todo:
            gs.unsharded_step = self.step

    def _reshard(self, groups):
        todo = [gs for gs in groups if gs.unsharded_step is not None]
        if not todo:
            return
        self.client.run_many((P.OP_RESHARD, gs.group.id, gs.unsharded_step, 0,
                              f"reshard(group '{gs.name}', step {gs.unsharded_step})") for gs in todo)
        for gs in todo:
            gs.unsharded_step = None

    def gather(self):
        """Unshard every group for the current step and return {param name:
        copy of the full tensor} (all ranks must call it, it is collective)."""
        self._unshard(self._groups)
        return {n: p.detach().clone() for gs in self._groups for n, p in gs.params}

    def finish_backward(self):
        """Reduce every group's grads (submitted together), reshard, clear the
        grad buffers, advance the step. Runs by itself at the end of backward;
        calling it again in the same step does nothing."""
        self._backward_queued = False
        if all(gs.unsharded_step is None for gs in self._groups):
            return
        for gs in self._groups:
            for (_n, p), gv in zip(gs.params, gs.grad_views):
                if p.grad is None:
                    gv.zero_()
                elif p.grad.data_ptr() != gv.data_ptr():
                    gv.copy_(p.grad)
        self.client.run_many((P.OP_REDUCE, gs.group.id, self.step, 0,
                              f"reduce(group '{gs.name}', step {self.step})")
                             for gs in reversed(self._groups))
        self._reshard(self._groups)
        for gs in self._groups:
            for i, ((_n, p), gv, sp) in enumerate(zip(gs.params, gs.grad_views, gs.shard_params)):
                gv.zero_()
                p.grad = gv
                if sp.grad is None:
                    # optimizer.zero_grad(set_to_none=True) dropped the view.
                    sp.grad = tensor_view(gs.group.shard_grad(i), gs.group.params[i].dtype)
        self.step += 1

    def zero_grad(self):
        """zero_grad op on every group: this rank's sharded grads become zero."""
        self.client.run_many((P.OP_ZERO_GRAD, gs.group.id, 0, 0, f"zero_grad(group '{gs.name}')")
                             for gs in self._groups)

    # ------------------------------------------------------------ hooks
    def _make_pre_forward(self, gs):
        def pre_forward(_module, _inputs):
            self._unshard([gs])
        return pre_forward

    def _make_post_forward(self, gs):
        def post_forward(_module, _inputs, output):
            if self.reshard_after_forward:
                self._reshard([gs])
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(gs))
            return output
        return post_forward

    def _make_pre_backward(self, gs):
        def pre_backward(grad):
            if not self._backward_queued:
                self._backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self._unshard([gs])
            return grad
        return pre_backward

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)

# SPDX-License-Identifier: MIT
"""One parameter fully_shard manages (FSDP2's _fsdp_param.py)."""


class FSDPParam:
    """One managed parameter: where it sits in the modules, its shard and
    unsharded Parameters, the views of its shard and grad buffers, and the
    tensor its shard Parameter's .grad is set to (a DTensor over
    shard_grad_view on a torch DeviceMesh, else that view)."""

    __slots__ = ("fqn", "name", "index", "places", "sharded", "unsharded", "grad_view",
                 "shard_view", "shard_grad_view", "shard_grad", "shard_dim", "has_grad",
                 "partial_has_grad")

    def __init__(self, fqn, index, places, name=None):
        self.fqn = fqn              # its name under the fully_shard'ed module
        self.name = name or fqn     # its name in the root model: the daemon's and a checkpoint's
        self.index = index          # param index in the group
        self.places = places        # [(module, attribute name)]: tied params sit in several
        self.sharded = None
        self.unsharded = None
        self.grad_view = None
        self.shard_view = None
        self.shard_grad_view = None
        self.shard_grad = None
        self.shard_dim = 0
        self.has_grad = False       # the sharded grad holds a reduced gradient
        self.partial_has_grad = False   # the unreduced grad buffer or an HSDP partial has one

# SPDX-License-Identifier: MIT
"""shardd: pure-Python client of the shardd per-node ZeRO-3 parameter server.

    import shardd
    with shardd.Client(job="run1", rank=0, shard=2, socket_path=path) as c:
        g = c.register_group("fc1", [("weight", "fp32", (8, 4)), ("bias", "fp32", (8,))])
        g.load_full("weight", w0)
        g.unshard(step=0)
        g.unsharded("weight")        # numpy view of the shared unsharded buffer

The protocol is proto/shardd_proto.h (see proto/PROTOCOL.md); no C extension
and no binding of libshardd is involved. ``shardd.torch`` wraps a PyTorch
module.
"""

from . import proto
from .client import USER_DATA_RESERVED, Client, default_socket_path
from .dtypes import Bf16Array, bf16_to_fp32, dtype_code, fp32_to_bf16, numpy_dtype
from .error import DaemonGone, ShardError
from .group import Group, Optimizer, Param
from .pending import Pending
from .proto import (DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_NONE, OP_BARRIER, OP_NOP,
                    OP_RESHARD, OP_REDUCE, OP_STEP, OP_UNSHARD, OP_ZERO_GRAD, REDUCE_ALL_REDUCE,
                    STEP_ALREADY, STEP_APPLIED, STEP_SKIPPED)
from .ring import Completion

__version__ = "0.1.0"

__all__ = [
    "Client", "Group", "Optimizer", "Param", "Pending", "Bf16Array", "Completion", "ShardError", "DaemonGone",
    "USER_DATA_RESERVED",
    "default_socket_path", "bf16_to_fp32", "fp32_to_bf16", "dtype_code", "numpy_dtype", "proto",
    "DTYPE_NONE", "DTYPE_FP32", "DTYPE_BF16", "DTYPE_FP16", "OP_NOP", "OP_BARRIER",
    "OP_UNSHARD", "OP_REDUCE", "OP_RESHARD", "OP_ZERO_GRAD", "OP_STEP", "REDUCE_ALL_REDUCE",
    "STEP_APPLIED", "STEP_SKIPPED", "STEP_ALREADY",
]

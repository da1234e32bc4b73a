# SPDX-License-Identifier: MIT
"""FSDP2's policy dataclasses and the dtype rules behind them (FSDP2's
_fsdp_api.py): MixedPrecisionPolicy, the dtype FSDP2 reduces in when its
reduce_dtype is None (default_reduce_dtype, by torch version), and the
torch dtypes shardd takes."""

import functools
import itertools

import torch

from .. import proto as P

TORCH_TO_SHARDD = {torch.float32: P.DTYPE_FP32, torch.bfloat16: P.DTYPE_BF16,
                   torch.float16: P.DTYPE_FP16}


def torch_version(version=None):
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
    if param_dtype is None or torch_version(version) < (2, 15):
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
            if d is not None and d not in TORCH_TO_SHARDD:
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

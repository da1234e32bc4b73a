# SPDX-License-Identifier: MIT
"""Element types of shardd buffers as numpy dtypes, and bf16 helpers.

numpy has no bfloat16, so bf16 buffers are exposed as ``uint16`` arrays of
the raw bits; :func:`bf16_to_fp32` and :func:`fp32_to_bf16` convert (round to
nearest even, NaN and Inf preserved, as the daemon's kernels do).
"""

import numpy as np

from . import proto as P

NUMPY_DTYPES = {P.DTYPE_FP32: np.dtype(np.float32), P.DTYPE_BF16: np.dtype(np.uint16),
                P.DTYPE_FP16: np.dtype(np.float16)}

_BY_NAME = {"fp32": P.DTYPE_FP32, "float32": P.DTYPE_FP32, "bf16": P.DTYPE_BF16,
            "bfloat16": P.DTYPE_BF16, "fp16": P.DTYPE_FP16, "float16": P.DTYPE_FP16,
            "none": P.DTYPE_NONE, None: P.DTYPE_NONE}


def dtype_code(d):
    """enum shardd_dtype for an int code, a name ('fp32', 'bf16', ...),
    a numpy float32/float16 dtype or None (= SHARDD_DTYPE_NONE)."""
    if isinstance(d, int):
        if not 0 <= d < P.DTYPE_COUNT:
            raise ValueError(f"dtype code {d} is not a shardd dtype (0..{P.DTYPE_COUNT - 1})")
        return d
    if isinstance(d, str) or d is None:
        key = d.lower() if isinstance(d, str) else d
        if key in _BY_NAME:
            return _BY_NAME[key]
        raise ValueError(f"dtype {d!r} is not one of fp32, bf16, fp16, none")
    nd = np.dtype(d)
    if nd == np.float32:
        return P.DTYPE_FP32
    if nd == np.float16:
        return P.DTYPE_FP16
    raise ValueError(f"numpy dtype {nd} has no shardd dtype; bf16 is given by name 'bf16'")


def numpy_dtype(code):
    """numpy dtype of a buffer element of shardd dtype `code` (bf16: uint16 bits)."""
    try:
        return NUMPY_DTYPES[code]
    except KeyError:
        raise ValueError(f"dtype code {code} has no buffer element type") from None


def fp32_to_bf16(x):
    """float32 array -> uint16 array of bf16 bits, round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    quiet = ((u >> 16) | 0x0040).astype(np.uint16)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_to_fp32(b):
    """uint16 array of bf16 bits -> float32 array (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

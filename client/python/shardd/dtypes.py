# SPDX-License-Identifier: MIT
"""Element types of shardd buffers as numpy dtypes, and bf16 helpers.

numpy has no bfloat16, so bf16 buffers are exposed as :class:`Bf16Array`:
``uint16`` arrays of the raw bits that convert numbers written into them
(``a[:] = [1.5, -2.0]`` stores the bf16 of 1.5 and -2.0, not the integers
1 and 65534) and read back as floats with :meth:`Bf16Array.to_float32`.
:func:`bf16_to_fp32` and :func:`fp32_to_bf16` convert (round to nearest even,
NaN and Inf preserved, as the daemon's kernels do). ``shardd.torch`` shows the
same memory as ``torch.bfloat16`` tensors.
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
    """numpy dtype of a buffer element of shardd dtype `code` (bf16: uint16 bits,
    viewed as :class:`Bf16Array`)."""
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


class Bf16Array(np.ndarray):
    """A view of bf16 memory: its elements are ``uint16`` bit patterns.

    Writing converts: numbers of any other dtype (Python floats and ints,
    float or int arrays) are rounded to bf16 (nearest even); only ``uint16``
    values are taken as bit patterns. In-place arithmetic (``a += 1.5``) and
    ``np.copyto`` from floats are refused by numpy's casting rules, so no
    float ever lands in the buffer as an integer. Read numbers with
    :meth:`to_float32` (exact)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, _bf16_bits(value))

    def fill(self, value):
        super().fill(_bf16_bits(value))

    def to_float32(self):
        """A float32 copy of the values (exact: every bf16 is a float32)."""
        return bf16_to_fp32(self.view(np.ndarray))


def _bf16_bits(value):
    if isinstance(value, Bf16Array):
        return value.view(np.ndarray)
    v = np.asarray(value)
    if v.dtype == np.uint16:
        return v
    if v.dtype.kind not in "biuf":
        raise TypeError(f"a bf16 buffer takes numbers or uint16 bit patterns, not {v.dtype}")
    return fp32_to_bf16(v.astype(np.float32))

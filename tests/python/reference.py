# SPDX-License-Identifier: MIT
"""Independent numpy reference of FSDP2's padded dim-i chunking, written from
docs/DESIGN.md ("Sharding of one param"), not from the client's code."""

import numpy as np


def shard_rows(d, world, rank):
    """(first row, valid rows, rows per shard) of rank's chunk of a dim of size d."""
    rows = -(-d // world)
    begin = min(rank * rows, d)
    end = min((rank + 1) * rows, d)
    return begin, end - begin, rows


def shard_of(full, world, rank, dim=0):
    """rank's shard of `full` along `dim`, zero-padded to the padded chunk size."""
    full = np.asarray(full)
    if full.ndim == 0:
        full = full.reshape(1)
        dim = 0
    f = np.moveaxis(full, dim, 0)
    begin, valid, rows = shard_rows(f.shape[0], world, rank)
    out = np.zeros((rows,) + f.shape[1:], dtype=full.dtype)
    out[:valid] = f[begin:begin + valid]
    return np.moveaxis(out, 0, dim)

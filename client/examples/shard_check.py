# SPDX-License-Identifier: MIT
"""The examples' --check: each rank saves the shards it holds (save_shards),
the launcher compares them with a single-process reference (shard_diffs).
A rank's file holds one array per param, keyed 'name@dim@first': the shard's
real rows, cut along dim from row `first` of the full tensor."""

import numpy as np

import shardd.torch as st


def save_shards(path, model):
    """Save this rank's shards of every param fully_shard manages under model."""
    np.savez(path, **{f"{n}@{dim}@{first}": t.detach().float().cpu().numpy()
                      for n, t, dim, first in st.local_shards(model)})


def shard_diffs(got, ref):
    """(param name, max |shard - reference rows|) of each shard in `got` (an
    np.load of a rank's file); ref maps names to full reference arrays."""
    for key in got.files:
        n, dim, first = key.split("@")
        shard = got[key]
        want = np.take(ref[n], range(int(first), int(first) + shard.shape[int(dim)]),
                       axis=int(dim))
        yield n, float(np.max(np.abs(shard - want))) if shard.size else 0.0

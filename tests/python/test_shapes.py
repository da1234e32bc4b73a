# SPDX-License-Identifier: MIT
"""Zero-numel params through the pure-Python client (issue 11, hole 1):
a zero-size dim on or off the shard dim goes through unshard, reduce and
zero_grad beside ordinary params, numbers checked against numpy; shapes whose
nonzero dims multiply past 64 bits are refused before anything is sent."""

import numpy as np
import pytest

import shardd
from conftest import attached, run_ranks
from reference import shard_of

SPECS = [shardd.Param("w", "fp32", (5, 3)),
         shardd.Param("e1", "fp32", (2, 0), shard_dim=1),
         shardd.Param("e0", "fp32", (0, 3)),
         shardd.Param("t", "fp32", (2, 4), shard_dim=1)]


def test_zero_numel_params_go_through_unshard_reduce_and_zero_grad(daemon, request):
    world = 2
    rng = np.random.default_rng(11)
    fulls = [(rng.integers(-64, 64, size=p.shape) / 8).astype(np.float32) for p in SPECS]
    with attached(request, daemon, 1, world) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", SPECS), world)
        for g in groups:
            for i, f in enumerate(fulls):
                g.load_full(i, f)
        run_ranks(lambda r: groups[r].unshard(1), world)
        for g in groups:
            for i, f in enumerate(fulls):
                np.testing.assert_array_equal(g.unsharded(i).reshape(f.shape), f, err_msg=f"param {i}")
        run_ranks(lambda r: groups[r].reshard(1), world)
        grads = [[(rng.integers(-64, 64, size=f.shape) / 8).astype(np.float32) for f in fulls]
                 for _ in range(world)]
        for r, g in enumerate(groups):
            for i in range(len(fulls)):
                g.grad(i)[...] = grads[r][i].reshape(g.grad(i).shape)
        for step in (1, 2):
            run_ranks(lambda r: groups[r].reduce(step), world)
            for r, g in enumerate(groups):
                for i, p in enumerate(SPECS):
                    want = shard_of((grads[0][i] + grads[1][i]) / np.float32(world), world, r, p.shard_dim)
                    np.testing.assert_array_equal(g.shard_grad(i, padded=True).reshape(want.shape), want,
                                                  err_msg=f"param {i} rank {r} step {step}")
            run_ranks(lambda r: groups[r].zero_grad(), world)
            for g in groups:
                for i in range(len(fulls)):
                    assert not g.shard_grad(i).any()


@pytest.mark.parametrize("shape, dim", [((3, 3, 0, 1 << 63, 8), 3), ((0, 1 << 32, 1 << 33), 2),
                                        ((2, -1), 1), ((1 << 64,), 0)])
def test_shapes_past_64_bits_are_refused_naming_param_and_dim(shape, dim):
    with pytest.raises(ValueError, match=rf"param 'p': shape\[{dim}\]"):
        shardd.Param("p", "fp32", shape)

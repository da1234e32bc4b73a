# SPDX-License-Identifier: MIT
"""The daemon's optimizer through the Python client: step and its
exactly-once rule against a numpy reference of plain SGD (p + (-lr) * g in
fp32: one product and one sum, rounded as the kernels round them, so the
comparison is exact), last_step on re-open, and a bad lr."""

import numpy as np
import pytest

import shardd
from shardd import proto as P
from conftest import attached, run_ranks

SPECS = [("w", "float32", (5, 3)), ("b", "float32", (7,))]
WORLD = 2


def reduce_all(groups, step, rng):
    for g in groups:
        for i in range(len(SPECS)):
            g.grad(i)[...] = rng.standard_normal(g.grad(i).shape).astype(np.float32)
    run_ranks(lambda r: groups[r].reduce(step), WORLD)


def test_sgd_step_matches_numpy_and_applies_once(daemon, request):
    rng = np.random.default_rng(7)
    with attached(request, daemon, 1, WORLD) as clients:
        opt = shardd.Optimizer.sgd()
        groups = run_ranks(lambda r: clients[r].register_group("g", SPECS, optimizer=opt), WORLD)
        assert groups[0].optimizer == P.OPTIM_SGD and groups[0].last_step == 0
        for g in groups:
            for i in range(len(SPECS)):
                g.shard(i)[...] = rng.standard_normal(g.shard(i).shape).astype(np.float32)
        lr = 0.05
        for step in (1, 2, 3):
            reduce_all(groups, step, rng)
            for g in groups:
                want = [g.shard(i) + np.float32(-lr) * g.shard_grad(i) for i in range(len(SPECS))]
                assert g.step(step, lr) == shardd.STEP_APPLIED
                for i in range(len(SPECS)):
                    np.testing.assert_array_equal(g.shard(i), want[i])
                    assert not g.shard_grad(i).any()
        before = [groups[0].shard(i).copy() for i in range(len(SPECS))]
        reduce_all(groups, 4, rng)
        assert groups[0].step(3, lr) == shardd.STEP_ALREADY
        for i in range(len(SPECS)):
            np.testing.assert_array_equal(groups[0].shard(i), before[i])
        # A second mapping of rank 1's group learns the last step from the daemon.
        again = clients[1].open_group("g")
        assert again.last_step == 3
        again.close()
        with pytest.raises(shardd.ShardError) as ei:
            groups[0].step(4, -1.0)
        assert ei.value.code == -P.E_INVALID
        assert "lr = -1" in str(ei.value)

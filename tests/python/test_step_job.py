# SPDX-License-Identifier: MIT
"""The step's job-wide clip (P.STEP_CLIP_JOB) against torch itself: the
daemon's coefficient from the job's grad_norm is bit for bit
torch.nn.utils.clip_grad_norm_'s (min(1, max_norm / (total_norm + 1e-6)) on
a 0-d fp32 norm) over many norms and max_norms, read back through a plain
SGD step with lr 1 from a zero param and a grad element of 1 (the param
becomes -coefficient exactly). Then the GROUP reply's peer_last_step and a
replayed step through the Python client."""

import numpy as np
import pytest
import torch

import shardd
from shardd import proto as P
from conftest import attach, attached, run_ranks

SPECS = [("w", "float32", (2,))]


def torch_coef(norm, max_norm):
    total = torch.tensor(norm, dtype=torch.float32)
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))


@pytest.mark.timeout_s(120)
def test_clip_job_coefficient_is_torch_clip_grad_norm_bit_for_bit(daemon, request):
    rng = np.random.default_rng(5)
    with attach(daemon, request, 0, 1, 1) as c:
        g = c.register_group("g", SPECS, optimizer=shardd.Optimizer.sgd())
        below = 0
        for step in range(1, 301):
            # Norms from 1 to ~1e4, max_norms from 1e-3 to 1e3: most clip, some do not.
            y = np.float32(10 ** rng.uniform(-1, 4))
            max_norm = float(10 ** rng.uniform(-3, 3))
            g.grad(0)[...] = np.array([1.0, y], dtype=np.float32)
            g.shard(0)[...] = 0
            g.reduce(step)
            norm, nonfinite = c.grad_norm(step)
            assert not nonfinite
            assert g.step(step, 1.0, max_norm=max_norm, skip_job_nonfinite=True) == shardd.STEP_APPLIED
            want = torch_coef(norm, max_norm)
            got = -float(g.shard(0)[0])
            assert got == want, (f"step {step}: norm {norm!r}, max_norm {max_norm!r}: the daemon's "
                                 f"coefficient {got!r}, torch's {want!r}")
            below += want < 1.0
        assert 50 < below < 300, f"{below} of 300 steps clipped: the draw misses a side"


@pytest.mark.timeout_s(60)
def test_lagging_rank_sees_peer_last_step_and_replays_the_step(daemon, request):
    with attached(request, daemon, 1, 2) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", [("w", "float32", (4,))],
                                                               optimizer=shardd.Optimizer.sgd()), 2)
        for r, g in enumerate(groups):
            g.grad(0)[...] = np.arange(4, dtype=np.float32) + r
            g.shard(0)[...] = 1
        run_ranks(lambda r: groups[r].reduce(1), 2)
        norms = run_ranks(lambda r: clients[r].grad_norm(1), 2)
        coef = torch_coef(norms[0][0], 0.5)
        grad1 = groups[1].shard_grad(0).copy()
        assert groups[0].step(1, 0.25, max_norm=0.5) == shardd.STEP_APPLIED
        again = clients[1].open_group("g")
        assert (again.last_step, again.peer_last_step) == (0, 1)
        again.close()
        with pytest.raises(shardd.ShardError) as ei:
            groups[1].step(2, 0.0, replay=True)
        assert ei.value.code == -P.E_STATE and "no rank of the group submitted step 2" in str(ei.value)
        assert groups[1].step(1, 0.0, replay=True) == shardd.STEP_APPLIED
        want = np.float32(1) + np.float32(-0.25) * (grad1 * np.float32(coef))
        np.testing.assert_array_equal(groups[1].shard(0), want)

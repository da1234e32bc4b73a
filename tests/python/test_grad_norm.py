# SPDX-License-Identifier: MIT
"""Client.grad_norm through a real daemon: the job-wide total norm of two
groups' sharded grads against a numpy fp64 reference computed from the
unsharded grads the ranks wrote (the reduce averages them), the inf-norm,
the non-finite flag, and a bad norm_type."""

import math

import numpy as np
import pytest

import shardd
from conftest import attach, attached, run_ranks

SPECS = [("w", "float32", (5, 3)), ("empty", "float32", (0, 4)), ("b", "float32", (7,))]
WORLD = 2


def test_grad_norm_matches_numpy_over_two_groups(daemon, request):
    rng = np.random.default_rng(11)
    with attached(request, daemon, 1, WORLD) as clients:
        groups = {name: run_ranks(lambda r, n=name: clients[r].register_group(n, SPECS), WORLD)
                  for name in ("enc", "dec")}
        means = []
        for gs in groups.values():
            for i in range(len(SPECS)):
                grads = [rng.standard_normal(gs[r].grad(i).shape).astype(np.float32) for r in range(WORLD)]
                for r in range(WORLD):
                    gs[r].grad(i)[...] = grads[r]
                means.append(np.mean(np.stack(grads).astype(np.float64), axis=0).ravel())
            run_ranks(lambda r, gs=gs: gs[r].reduce(1), WORLD)
        ref = np.concatenate(means)
        two = run_ranks(lambda r: clients[r].grad_norm(1), WORLD)
        inf = run_ranks(lambda r: clients[r].grad_norm(1, math.inf), WORLD)
        for r in range(WORLD):
            assert two[r][1] is False and inf[r][1] is False
            assert two[r][0] == pytest.approx(np.linalg.norm(ref), rel=1e-6)
            assert inf[r][0] == pytest.approx(np.abs(ref).max(), rel=1e-6)
        # A NaN in one rank's grad reaches the reduced grads: the flag is set.
        gs = groups["enc"]
        gs[0].grad(0)[0, 0] = np.nan
        run_ranks(lambda r: gs[r].reduce(2), WORLD)
        for norm, nonfinite in run_ranks(lambda r: clients[r].grad_norm(2), WORLD):
            assert nonfinite is True and math.isnan(norm)


def test_grad_norm_rejects_an_unsupported_norm_type(daemon, request):
    with attach(daemon, request, 0, 1, WORLD) as client:
        with pytest.raises(shardd.ShardError, match="norm_type 1 is not supported"):
            client.grad_norm(1, 1.0)

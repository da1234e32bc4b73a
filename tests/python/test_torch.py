# SPDX-License-Identifier: MIT
"""PyTorch through shardd: client/examples/train_torch.py trains an MLP with
several rank processes and checks parity with a single-process reference
(tolerance derived in the example's docstring)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, job_name

EXAMPLE = os.path.join(ROOT, "client", "examples", "train_torch.py")


def run_example(daemon, request, *args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    p = subprocess.run([sys.executable, EXAMPLE, "--socket", daemon.socket, "--job",
                        job_name(request), *args], env=env, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}\ndaemon:\n" + \
        "\n".join(daemon.lines[-20:])
    assert "match the single-process reference" in p.stdout
    return p.stdout


@pytest.mark.timeout_s(180)
def test_torch_mlp_with_three_ranks_matches_single_process_reference(daemon, request):
    run_example(daemon, request, "--ranks", "3", "--steps", "6")


@pytest.mark.timeout_s(180)
def test_torch_mlp_resharding_after_forward_matches_reference(daemon, request):
    run_example(daemon, request, "--ranks", "2", "--steps", "4", "--reshard-after-forward")


@pytest.mark.timeout_s(60)
def test_torch_module_params_are_views_of_the_shared_buffers(daemon, request):
    import numpy as np
    import torch
    import shardd
    from shardd.torch import FullyShardedModule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    w0 = model[0].weight.detach().clone()
    with shardd.Client(job=job_name(request), rank=0, shard=1, socket_path=daemon.socket) as c:
        fsdp = FullyShardedModule(c, model, [model[0], model[1]])
        g = fsdp.groups["0"]
        shard = g.shard("0.weight")
        np.testing.assert_array_equal(shard, w0.numpy())
        model(torch.ones(1, 3))        # forward unshards
        assert model[0].weight.data_ptr() == \
            torch.from_numpy(np.array(g.unsharded("0.weight"), copy=False)).data_ptr()
        np.testing.assert_array_equal(model[0].weight.detach().numpy(), w0.numpy())
        sp = fsdp.shard_parameters()
        assert len(sp) == 4 and all(p.grad is not None for p in sp)

# SPDX-License-Identifier: MIT
"""PyTorch through shardd: client/examples/train_torch.py trains an MLP with
several rank processes and checks parity with a single-process reference
(tolerance derived in the example's docstring), with the daemon's optimizer
(the default) and with torch.optim in the ranks (--torch-optim)."""

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
    out = run_example(daemon, request, "--ranks", "3", "--steps", "6")
    assert "(daemon SGD)" in out


@pytest.mark.timeout_s(180)
def test_torch_mlp_with_torch_optim_in_the_ranks_matches_reference(daemon, request):
    out = run_example(daemon, request, "--ranks", "2", "--steps", "4", "--torch-optim")
    assert "(torch.optim SGD)" in out


@pytest.mark.timeout_s(180)
def test_torch_mlp_resharding_after_forward_matches_reference(daemon, request):
    run_example(daemon, request, "--ranks", "2", "--steps", "4", "--reshard-after-forward")


@pytest.mark.timeout_s(180)
def test_torch_hsdp_two_replicas_of_two_shards_trains_like_single_process(daemon, request):
    out = run_example(daemon, request, "--ranks", "4", "--replicate", "2", "--steps", "4")
    assert "2x2 ranks" in out


@pytest.mark.timeout_s(60)
def test_torch_module_params_are_views_of_the_shared_buffers(daemon, request):
    import numpy as np
    import torch
    import shardd.torch as st

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    w0 = model[0].weight.detach().clone()
    with st.init_device_mesh(job_name(request), 0, (1,), socket_path=daemon.socket) as mesh:
        st.fully_shard(model[0], mesh=mesh)
        st.fully_shard(model, mesh=mesh)
        g = model[0]._shardd_state.group
        np.testing.assert_array_equal(g.shard("0.weight"), w0.numpy())
        sharded = model[0].weight
        assert sharded.data_ptr() == g.tensor("shard", "0.weight").data_ptr()
        model(torch.ones(1, 3))        # forward unshards, the root keeps model[1] unsharded
        assert model[0].weight is sharded      # resharded after forward (not the root)
        assert model[1].weight.data_ptr() == model._shardd_state.group.tensor(
            "unsharded", "1.weight").data_ptr()
        model.reshard()
        assert len(list(model.parameters())) == 4
        assert all(p.grad is None for p in model.parameters())

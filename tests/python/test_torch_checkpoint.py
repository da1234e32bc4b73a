# SPDX-License-Identifier: MIT
"""shardd.torch checkpoints: a 2-rank fully_shard model with DaemonAdamW
trains, st.checkpoint() saves it through the daemon, and the same model
(built from another seed) restored at 1 rank with
init_device_mesh(restore=...) continues from the saved step. Every rank
trains on the same batch, so the 2-rank mean of equal grads is the grad
itself, exactly: the reference is the 2-rank run continued, and the
restored run must end bit-identical to it (params and the optimizer's step
count)."""

import os

import pytest
import torch

import shardd.torch as st
from conftest import job_name, run_ranks
from torch_net import Net, shard, train

torch.set_num_threads(1)


def make(seed):
    torch.manual_seed(seed)
    return Net()


def data(n):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def full_params(models):
    """Each param's full tensor from the ranks' shards (concatenated along the shard dim)."""
    per = [st.local_shards(m) for m in models]
    out = {}
    for i, (name, _t, dim, _row) in enumerate(per[0]):
        out[name] = torch.cat([p[i][1].detach().clone() for p in per], dim=dim)
    return out


def test_checkpoint_then_restore_at_another_mesh_continues_bit_identical(state_daemon, request):
    job = job_name(request)
    batches = data(5)
    models = [make(0) for _ in range(2)]
    meshes = [st.init_device_mesh(job, r, (2,), socket_path=state_daemon.socket) for r in range(2)]
    try:
        opts = [st.DaemonAdamW(m, lr=1e-2) for m in models]
        run_ranks(lambda r: shard(models[r], meshes[r]), 2)
        run_ranks(lambda r: train(models[r], opts[r], batches[:3]), 2)
        assert run_ranks(lambda r: st.checkpoint(meshes[r]), 2) == [3, 3]
        run_ranks(lambda r: train(models[r], opts[r], batches[3:]), 2)
        want = full_params(models)
    finally:
        for m in meshes:
            m.close()

    ckpt = os.path.join(state_daemon.state, job, "step-000000000003")
    model = make(1)
    mesh = st.init_device_mesh(job + "-one", 0, (1,), socket_path=state_daemon.socket, restore=ckpt)
    try:
        opt = st.DaemonAdamW(model, lr=1e-2)
        shard(model, mesh)
        assert opt.step_number == 3
        train(model, opt, batches[3:])
        got = full_params([model])
        assert opt.step_number == 5
        for name, t in want.items():
            assert torch.equal(got[name], t), name
    finally:
        mesh.close()


def test_full_state_dict_gathers_and_loads_at_another_mesh(state_daemon, request):
    """full_state_dict() against the ranks' shards concatenated by the test;
    load_full_state_dict() of it into a 1-rank model built from another seed
    gives shards equal to the full tensors; a wrong shape and a missing
    param are refused by name."""
    job = job_name(request)
    models = [make(0) for _ in range(2)]
    meshes = [st.init_device_mesh(job, r, (2,), socket_path=state_daemon.socket) for r in range(2)]
    try:
        opts = [st.DaemonAdamW(m, lr=1e-2) for m in models]
        run_ranks(lambda r: shard(models[r], meshes[r]), 2)
        run_ranks(lambda r: train(models[r], opts[r], data(2)), 2)
        want = full_params(models)
        sds = run_ranks(lambda r: st.full_state_dict(models[r]), 2)
        for sd in sds:
            assert sorted(sd) == sorted(want)
            for name, t in want.items():
                assert torch.equal(sd[name], t), name
    finally:
        for m in meshes:
            m.close()
    model = make(1)
    mesh = st.init_device_mesh(job + "-one", 0, (1,), socket_path=state_daemon.socket)
    try:
        shard(model, mesh)
        st.load_full_state_dict(model, sds[0])
        got = full_params([model])
        for name, t in want.items():
            assert torch.equal(got[name], t), name
        bad = dict(sds[0])
        bad["fc2.weight"] = torch.zeros(4, 9)
        with pytest.raises(ValueError, match=r"param 'fc2.weight' has shape \(3, 9\), the state dict holds \(4, 9\)"):
            st.load_full_state_dict(model, bad)
        del bad["fc2.weight"]
        with pytest.raises(KeyError, match="param 'fc2.weight' is not in the state dict"):
            st.load_full_state_dict(model, bad)
    finally:
        mesh.close()

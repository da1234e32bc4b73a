# SPDX-License-Identifier: MIT
"""torchrun's environment (issue 29, item 1, the part torch 1.13 can run):
init_device_mesh() and fully_shard(module) without a mesh read the job
from $TORCHELASTIC_RUN_ID, the rank from $RANK, the world from
$WORLD_SIZE and the socket from $SHARDD_SOCKET; fully_shard takes a mesh
shaped as torch's DeviceMesh (ndim, size(dim), get_rank()), 1-D or 2-D,
and attaches a shardd client of that shape once per mesh; a missing
variable is named."""

import pytest
import torch

import shardd.torch as st
from shardd.torch import _mesh
from conftest import job_name, run_ranks


@pytest.fixture
def torchrun_env(daemon, request, monkeypatch):
    job = job_name(request)
    for k, v in (("TORCHELASTIC_RUN_ID", job), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_RANK", "0"), ("SHARDD_SOCKET", daemon.socket)):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(_mesh, "_env_mesh", {})
    yield job
    for c in _mesh._env_mesh.values():
        c.close()


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_init_device_mesh_reads_torchrun_environment(torchrun_env):
    with st.init_device_mesh() as mesh:
        assert (mesh.job, mesh.rank, mesh.replicate, mesh.shard) == (torchrun_env, 0, 1, 1)


def test_fully_shard_without_mesh_attaches_once_from_the_environment(torchrun_env):
    model = net()
    want = model(torch.ones(2, 3)).detach()
    st.fully_shard(model[0])
    st.fully_shard(model)
    a, b = model[0]._shardd_state.client, model._shardd_state.client
    assert a is b and a.job == torchrun_env and a.rank == 0
    torch.testing.assert_close(model(torch.ones(2, 3)).detach(), want)


def test_missing_variable_is_named(torchrun_env, monkeypatch):
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match=r"no rank given and \$RANK is not set \(torchrun sets it\)"):
        st.init_device_mesh()


class DeviceMesh:
    """The part of torch's DeviceMesh fully_shard reads (torch 1.13 has none)."""

    def __init__(self, shape, rank):
        self.shape, self.rank = shape, rank
        self.ndim = len(shape)

    def size(self, dim=None):
        return self.shape[dim]

    def get_rank(self):
        return self.rank

    def get_group(self, mesh_dim=None):
        raise NotImplementedError


@pytest.mark.parametrize("shape", [(2,), (1, 2)])
def test_fully_shard_takes_a_device_mesh_of_its_shape_and_rank(torchrun_env, shape):
    meshes = [DeviceMesh(shape, r) for r in range(2)]
    models = [net() for _ in range(2)]

    def rank(r):
        st.fully_shard(models[r][0], mesh=meshes[r])
        st.fully_shard(models[r], mesh=meshes[r])
        c = models[r]._shardd_state.client
        assert c is models[r][0]._shardd_state.client
        return c.job, c.rank, c.replicate, c.shard, [tuple(t.shape) for _n, t, _d, _f in
                                                     st.local_shards(models[r])]

    try:
        out = run_ranks(rank, 2)
    finally:
        for m in meshes:
            m._shardd_client.close()
    for r, (job, got_rank, replicate, shard, shapes) in enumerate(out):
        assert (job, got_rank, replicate, shard) == (torchrun_env, r, 1, 2)
        assert shapes == [(2, 3), (2,), (1, 4), (1,)]

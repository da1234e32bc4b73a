# SPDX-License-Identifier: MIT
"""fully_shard names params by their fully qualified names in the root model
(issue 29, item 4): a transformer-shaped model whose blocks all hold an
'attention_norm.weight', sharded per block in bf16 mixed precision with a
torch.optim optimizer in the ranks, registers 'layers.1.attention_norm.weight'
and so on, as torch's state_dict keys; shardctl shows those names; the
daemon's checkpoint of its groups is written (names unique across groups)
and restores at another mesh. A module held by two models has no single
name and is refused."""

import json
import os

import pytest
import torch

import shardd.torch as st
from conftest import job_name, run_ranks, shardctl_json

torch.set_num_threads(1)

MP = st.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(8)
        self.ffn = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.ffn(self.attention_norm(x))


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def make(seed):
    torch.manual_seed(seed)
    return Transformer()


def shard(model, mesh):
    for layer in model.layers:
        st.fully_shard(layer, mesh=mesh, mp_policy=MP)
    st.fully_shard(model, mesh=mesh, mp_policy=MP)


def train(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def full_params(models):
    """{name: full tensor} from the ranks' shards (concatenated along the shard dim)."""
    per = [st.local_shards(m) for m in models]
    return {name: torch.cat([p[i][1].detach().clone() for p in per], dim=dim)
            for i, (name, _t, dim, _row) in enumerate(per[0])}


def registered_names(model):
    """The daemon's param names of every group fully_shard made under `model`."""
    return [p.name for m in model.modules() if isinstance(m, st.FSDPModule)
            for p in m._shardd_state.group.params]


def test_per_block_bf16_model_registers_fqns_checkpoints_and_restores_at_another_mesh(
        state_daemon, request):
    job = job_name(request)
    models = [make(0) for _ in range(2)]
    want_names = sorted(n for n, _ in make(0).named_parameters())
    meshes = [st.init_device_mesh(job, r, (2,), socket_path=state_daemon.socket) for r in range(2)]
    try:
        run_ranks(lambda r: shard(models[r], meshes[r]), 2)
        assert sorted(registered_names(models[0])) == want_names
        block = models[0].layers[1]._shardd_state.name
        shown = shardctl_json(state_daemon.socket, "show", block, "--job", job)
        assert "layers.1.attention_norm.weight" in json.dumps(shown), shown
        run_ranks(lambda r: train(models[r], 2), 2)
        assert run_ranks(lambda r: st.checkpoint(meshes[r], step=2), 2) == [2, 2]
        want = full_params(models)
    finally:
        for m in meshes:
            m.close()

    ckpt = os.path.join(state_daemon.state, job, "step-000000000002")
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    assert sorted(p["name"] for g in manifest["groups"] for p in g["params"]) == want_names

    model = make(1)
    mesh = st.init_device_mesh(job + "-one", 0, (1,), socket_path=state_daemon.socket,
                               restore=ckpt)
    try:
        shard(model, mesh)
        got = full_params([model])
        assert sorted(got) == want_names
        for name, t in want.items():
            assert torch.equal(got[name], t), name
    finally:
        mesh.close()


def test_module_held_by_two_models_is_refused_by_name(daemon, request):
    model = make(0)
    other = torch.nn.Sequential(model.layers[0])
    mesh = st.init_device_mesh(job_name(request), 0, (1,), socket_path=daemon.socket)
    try:
        with pytest.raises(ValueError, match=r"Block is a submodule of 2 modules .*no single "
                                             r"fully qualified name"):
            st.fully_shard(model.layers[0], mesh=mesh)
    finally:
        mesh.close()
    del other

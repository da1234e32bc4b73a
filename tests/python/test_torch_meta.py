# SPDX-License-Identifier: MIT
"""Module._apply after fully_shard (issue 29, item 3). Meta-device init:
fully_shard on a model built on the meta device registers its groups
without values; to_empty() and the model's own init functions then write
the daemon's shards, and the model trains as one built on the CPU with the
same values. A dtype change is refused and leaves the params as they were. Plain-tensor params
(a shardd.Client mesh, any torch); tests/python/test_torch_dropin.py
checks the same against torch's FSDP2 with DTensor params."""

import pytest
import torch

import shardd.torch as st
from conftest import job_name, run_ranks

torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7, device=device)
        self.fc2 = torch.nn.Linear(7, 3, device=device)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def full_init(name, shape):
    """The init of param `name`, whole: deterministic (no RNG), so every
    rank and the single-process reference write the same values."""
    n = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
    return torch.sin(n + len(name)) / 4


def init_weights(model):
    """full_init's rows of each param (a shard after fully_shard: from its
    first row along its shard dim, as local_shards gives)."""
    shards = {n: (d, f) for n, _t, d, f in st.local_shards(model)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            dim, first = shards[n]
            p.copy_(full_init(n, FULL_SHAPES[n]).narrow(dim, first, p.shape[dim]))


FULL_SHAPES = {"fc1.weight": (7, 5), "fc1.bias": (7,), "fc2.weight": (3, 7), "fc2.bias": (3,)}


@pytest.mark.timeout_s(60)
def test_meta_model_trains_after_to_empty_and_init_like_a_cpu_model(daemon, request):
    world, steps = 2, 3
    job = job_name(request)
    models = [Net(device="meta") for _ in range(world)]
    assert all(p.is_meta for m in models for p in m.parameters())
    x = torch.randn(world * 4, 5, generator=torch.Generator().manual_seed(1))
    y = torch.randn(world * 4, 3, generator=torch.Generator().manual_seed(2))

    def rank(r):
        m = models[r]
        with st.init_device_mesh(job, r, (world,), socket_path=daemon.socket) as mesh:
            st.fully_shard(m.fc1, mesh=mesh)
            st.fully_shard(m, mesh=mesh)
            m.to_empty(device="cpu")
            init_weights(m)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            losses = []
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(m(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4])
                loss.backward()
                losses.append(loss.item())
                opt.step()
                opt.zero_grad()
            return losses, st.full_state_dict(m)

    results = run_ranks(rank, world)
    ref = Net()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(full_init(n, FULL_SHAPES[n]))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        want.append([torch.nn.functional.mse_loss(ref(x[r * 4:(r + 1) * 4]),
                                                  y[r * 4:(r + 1) * 4]).item()
                     for r in range(world)])
        opt.step()
        opt.zero_grad()
    for r, (losses, full) in enumerate(results):
        assert losses == pytest.approx([w[r] for w in want], rel=1e-6)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=1e-6)


@pytest.mark.timeout_s(60)
def test_a_dtype_change_after_fully_shard_is_refused_and_the_params_stay(daemon, request):
    torch.manual_seed(0)
    model = Net()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    with st.init_device_mesh(job_name(request), 0, (1,), socket_path=daemon.socket) as mesh:
        st.fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match=r"param 'fc1.weight' would become torch.float64 on "
                                             r"cpu, but the daemon holds it as torch.float32"):
            model.double()
        got = {n: p for n, p in model.named_parameters()}
        assert {n: p.dtype for n, p in got.items()} == {n: torch.float32 for n in want}
        for n, p in got.items():
            torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=0)
        shards = {n: t for n, t, _d, _f in st.local_shards(model)}
        assert all(shards[n].data_ptr() == got[n].data_ptr() for n in want)

# SPDX-License-Identifier: MIT
"""shardd.torch: an FSDPModule's state_dict() holds full tensors and its
load_state_dict() takes them, against torch's own state_dict of an unsharded
reference model.

The sharded model (fc1, fc2 and the root each a fully_shard group, 7 rows
over 3 ranks: shards of 3, 3 and 1 rows, plus a buffer) trains with the
daemon's SGD with momentum; the reference, the same model unsharded, with
torch.optim.SGD on the same batches. Every rank trains on the same batch, so
the mean of the ranks' grads is the grad up to one rounding of the divide,
and the params agree to 1e-6 (a missed update or a wrong row moves them by
~1e-2)."""

import pytest
import torch

import shardd.torch as st
from conftest import job_name, run_ranks
from torch_net import train

LR, MOMENTUM = 0.05, 0.9
ATOL = 1e-6

torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7)
        self.fc2 = torch.nn.Linear(7, 7)
        self.head = torch.nn.Linear(7, 2)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))) * self.scale


def make(seed):
    torch.manual_seed(seed)
    return Net()


def batches(n):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def reference(data):
    ref = make(0)
    train(ref, torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM), data)
    return ref


def sharded(job, socket, world, seed, optimizer=True):
    models = [make(seed) for _ in range(world)]
    meshes = [st.init_device_mesh(job, r, (world,), socket_path=socket) for r in range(world)]
    opts = [st.DaemonSGD(m, lr=LR, momentum=MOMENTUM) for m in models] if optimizer else None

    def shard(r):
        st.fully_shard(models[r].fc1, mesh=meshes[r])
        st.fully_shard(models[r].fc2, mesh=meshes[r])
        st.fully_shard(models[r], mesh=meshes[r])

    run_ranks(shard, world)
    return models, meshes, opts


@pytest.mark.timeout_s(60)
def test_state_dict_holds_full_tensors_equal_to_an_unsharded_torch_model(daemon, request):
    data = batches(3)
    models, meshes, opts = sharded(job_name(request), daemon.socket, 3, 0)
    try:
        run_ranks(lambda r: train(models[r], opts[r], data), 3)
        sds = run_ranks(lambda r: models[r].state_dict(), 3)
        after = run_ranks(lambda r: [t.shape for _n, t, _d, _f in st.local_shards(models[r])], 3)
    finally:
        for m in meshes:
            m.close()
    want = reference(data).state_dict()
    moved = make(0).state_dict()
    for r, sd in enumerate(sds):
        assert list(sd) == list(want), f"rank {r}"
        for name, t in want.items():
            assert sd[name].shape == t.shape, f"rank {r} {name}"
            torch.testing.assert_close(sd[name], t, rtol=0, atol=ATOL, msg=f"rank {r} {name}")
        assert float((sd["fc2.weight"] - moved["fc2.weight"]).abs().max()) > 100 * ATOL
    # The modules still hold their shards after the gather: 7 rows as 3, 3, 1.
    assert [s[2][0] for s in after] == [3, 3, 1]


@pytest.mark.timeout_s(60)
def test_load_state_dict_takes_an_unsharded_models_state_dict_at_any_mesh(daemon, request):
    data = batches(2)
    ref = reference(data)
    want = ref.state_dict()
    want["scale"] = torch.tensor([3.0, -1.0])
    models, meshes, _ = sharded(job_name(request), daemon.socket, 2, seed=9, optimizer=False)
    try:
        res = run_ranks(lambda r: models[r].load_state_dict(want), 2)
        assert all(not x.missing_keys and not x.unexpected_keys for x in res)
        sds = run_ranks(lambda r: models[r].state_dict(), 2)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
        outs = run_ranks(lambda r: models[r](x).detach(), 2)
    finally:
        for m in meshes:
            m.close()
    ref.scale.copy_(want["scale"])
    for r in range(2):
        for name, t in want.items():
            assert torch.equal(sds[r][name], t), f"rank {r} {name}"
        torch.testing.assert_close(outs[r], ref(x).detach(), rtol=0, atol=ATOL)


@pytest.mark.timeout_s(60)
def test_load_state_dict_names_missing_unexpected_and_shard_shaped_keys(daemon, request):
    want = make(0).state_dict()
    models, meshes, _ = sharded(job_name(request), daemon.socket, 1, seed=1, optimizer=False)
    m = models[0]
    try:
        partial = {k: v for k, v in want.items() if k != "fc2.bias"}
        with pytest.raises(RuntimeError, match=r"missing keys \['fc2.bias'\]"):
            m.load_state_dict(partial)
        res = m.load_state_dict(dict(partial, extra=torch.zeros(1)), strict=False)
        assert res.missing_keys == ["fc2.bias"] and res.unexpected_keys == ["extra"]
        with pytest.raises(ValueError, match=r"param 'fc1.weight' has shape \(7, 5\), the state "
                                             r"dict holds \(4, 5\) \(full tensors are loaded"):
            m.load_state_dict(dict(want, **{"fc1.weight": torch.zeros(4, 5)}))
    finally:
        for mesh in meshes:
            mesh.close()

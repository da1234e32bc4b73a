# SPDX-License-Identifier: MIT
"""shardd.torch.fully_shard in one process: ranks are threads with their own
shardd.Client (models are built before the threads start: torch's global
RNG is not per thread). References are single-process torch."""

import errno

import numpy as np
import pytest
import torch

import shardd
import shardd.torch as st
from conftest import Daemon, attached, job_name, run_ranks

torch.set_num_threads(1)


class Net(torch.nn.Module):
    """fc1 -> tanh -> fc2, plus `spare`, a param forward never uses."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 9)
        self.fc2 = torch.nn.Linear(9, 3)
        self.spare = torch.nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_net():
    torch.manual_seed(0)
    return Net()


def shard_of(ref, shard, dim, first):
    return ref.detach().narrow(dim, first, shard.shape[dim])


@pytest.mark.timeout_s(60)
def test_param_without_grad_keeps_grad_none_and_sgd_leaves_it(daemon, request):
    world, steps = 2, 3
    job = job_name(request)
    models = [make_net() for _ in range(world)]
    x = torch.randn(world * 4, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(world * 4, 3, generator=torch.Generator().manual_seed(2))

    def opt_for(params):
        # Weight decay moves a param whose grad is zero; one whose grad is None is skipped.
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)

    def rank(r):
        m = models[r]
        with st.init_device_mesh(job, r, (world,), socket_path=daemon.socket) as mesh:
            st.fully_shard(m.fc1, mesh=mesh)
            st.fully_shard(m, mesh=mesh)
            opt = opt_for(m.parameters())
            grads = []
            for _ in range(steps):
                torch.nn.functional.mse_loss(m(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
                grads.append(m.spare.grad is None and m.fc1.weight.grad is not None)
                opt.step()
                opt.zero_grad()
            return grads, [(n, t.detach().clone(), d, f) for n, t, d, f in st.local_shards(m)]

    results = run_ranks(rank, world)
    ref = make_net()
    opt = opt_for(ref.parameters())
    for _ in range(steps):
        torch.nn.functional.mse_loss(ref(x), y).backward()
        assert ref.spare.grad is None
        opt.step()
        opt.zero_grad()
    params = dict(ref.named_parameters())
    for grads, shards in results:
        assert all(grads)
        assert {n for n, *_ in shards} == set(params)
        for n, t, d, f in shards:
            torch.testing.assert_close(t, shard_of(params[n], t, d, f), rtol=0, atol=1e-6)
    assert torch.equal(params["spare"], torch.ones(5))


@pytest.mark.timeout_s(60)
def test_bf16_params_cast_inputs_and_outputs_and_reduce_in_fp32(daemon, request):
    """bf16 compute, fp32 reduce and fp32 master shards: the reference is the
    same model computed in bf16 from the same bf16-rounded parameters."""
    world = 2
    job = job_name(request)
    models = [make_net() for _ in range(world)]
    x = torch.randn(world * 4, 6, generator=torch.Generator().manual_seed(1))
    mp = st.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root_mp = st.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32)

    def rank(r):
        m = models[r]
        with st.init_device_mesh(job, r, (world,), socket_path=daemon.socket) as mesh:
            st.fully_shard(m.fc1, mesh=mesh, mp_policy=mp)
            st.fully_shard(m, mesh=mesh, mp_policy=root_mp)
            out = m(x[r * 4:(r + 1) * 4])         # fp32 input: cast to bf16 by the policy
            out.sum().backward()
            g = m.fc1._shardd_state.group
            assert g.tensor("unsharded", "fc1.weight").dtype == torch.bfloat16
            assert g.reduce_dtype == shardd.DTYPE_FP32
            return out.dtype, [(n, t.grad.clone(), d, f) for n, t, d, f in st.local_shards(m)
                               if t.grad is not None]

    results = run_ranks(rank, world)
    ref = make_net().to(torch.bfloat16)
    ref(x.to(torch.bfloat16)).float().sum().backward()
    grads = {n: p.grad.float() / world for n, p in ref.named_parameters() if p.grad is not None}
    for dtype, shard_grads in results:
        assert dtype == torch.float32
        assert {n for n, *_ in shard_grads} == set(grads)
        for n, g, d, f in shard_grads:
            assert g.dtype == torch.float32
            # bf16 grads of two ranks' halves summed in fp32 vs one bf16 backward
            # over the whole batch: both round each grad once in bf16 (2^-8 relative).
            torch.testing.assert_close(g, shard_of(grads[n], g, d, f), rtol=2 ** -7, atol=2e-3)


def test_reduce_dtype_none_follows_the_torch_versions_rule():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert st.default_reduce_dtype(bf16, {fp32}, "2.6.0") is None       # reduce in param_dtype
    assert st.default_reduce_dtype(bf16, {fp32}, "2.14.1+cpu") is None
    assert st.default_reduce_dtype(bf16, {fp32}, "2.15.0") == fp32      # the original dtype
    assert st.default_reduce_dtype(bf16, {fp32, bf16}, "2.16.0") == fp32
    assert st.default_reduce_dtype(None, {fp32}, "2.15.0") is None
    assert st.default_reduce_dtype(bf16, {fp32}, "1.13.0a0+gitunknown") is None


@pytest.mark.timeout_s(30)
def test_reduce_dtype_none_registers_the_installed_torchs_rule(daemon, request):
    m = make_net()
    with st.init_device_mesh(job_name(request), 0, (1,), socket_path=daemon.socket) as mesh:
        st.fully_shard(m, mesh=mesh, mp_policy=st.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        g = m._shardd_state.group
        want = st.default_reduce_dtype(torch.bfloat16, {torch.float32})
        assert g.reduce_dtype == (shardd.DTYPE_FP32 if want == torch.float32 else shardd.DTYPE_NONE)


@pytest.mark.timeout_s(30)
def test_bf16_views_are_bf16_tensors_and_convert_numbers(daemon, request):
    with shardd.Client(job=job_name(request), rank=0, shard=1, socket_path=daemon.socket) as c:
        g = c.register_group("g", [("w", "bf16", (3,))], param_dtype="bf16")
        shard = g.shard("w")
        shard[:] = [1.5, -2.0, 0.3]      # was stored as the integers 1, 65534, 0
        np.testing.assert_array_equal(shard.to_float32(), np.float32([1.5, -2.0, 0.30078125]))
        with pytest.raises(TypeError):
            shard[:] = np.array(["a", "b", "c"])
        with pytest.raises(TypeError):     # numpy refuses float -> uint16 in place
            shard += 1.5
        t = g.tensor("shard", "w")
        assert t.dtype == torch.bfloat16
        t.mul_(2)                        # same memory
        np.testing.assert_array_equal(shard.to_float32(), np.float32([3.0, -4.0, 0.6015625]))
        g.unshard(0, timeout=5)
        assert g.tensor("unsharded", "w").tolist() == [3.0, -4.0, 0.6015625]
        g.reshard(0)


@pytest.mark.timeout_s(30)
def test_shard_views_hold_only_real_rows(daemon, request):
    world = 4
    with attached(request, daemon, 1, world) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", [("w", "fp32", (5, 2))]), world)
        # ceil(5/4) = 2 rows per chunk: ranks hold 2, 2, 1, 0 real rows.
        assert [g.shard("w").shape for g in groups] == [(2, 2), (2, 2), (1, 2), (0, 2)]
        assert all(g.shard("w", padded=True).shape == (2, 2) for g in groups)


@pytest.mark.timeout_s(30)
def test_unshard_timeout_is_per_call_and_names_the_op(daemon, request):
    with attached(request, daemon, 1, 2) as clients:
        g0, _g1 = run_ranks(lambda r: clients[r].register_group("g", [("w", "fp32", (4,))]), 2)
        with pytest.raises(shardd.ShardError) as ei:
            g0.unshard(0, timeout=0.3)
        assert ei.value.code == -errno.ETIMEDOUT
        assert "unshard(group 'g', step 0)" in str(ei.value) and "0.3 s" in str(ei.value)


@pytest.mark.timeout_s(60)
def test_mismatched_module_structure_names_param_rank_and_field(daemon, request):
    job = job_name(request)
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)]

    def rank(r):
        with st.init_device_mesh(job, r, (2,), socket_path=daemon.socket) as mesh:
            with pytest.raises(shardd.ShardError) as ei:
                st.fully_shard(models[r], mesh=mesh)
            return str(ei.value)

    for r, text in enumerate(run_ranks(rank, 2)):
        assert "fully_shard(Linear)" in text and f"rank {r}" in text
        assert "'weight'" in text and "shape" in text, text


@pytest.mark.timeout_s(30)
def test_wrong_mesh_is_refused_naming_both_meshes(daemon, request):
    job = job_name(request)
    with st.init_device_mesh(job, 0, (2, 2), socket_path=daemon.socket):
        with pytest.raises(shardd.ShardError) as ei:
            st.init_device_mesh(job, 1, (4,), socket_path=daemon.socket)
    assert ei.value.name == "SHARDD_E_MESH" and "2x2" in str(ei.value) and "1x4" in str(ei.value)


@pytest.mark.timeout_s(60)
def test_daemon_gone_names_the_group_and_the_rank(request):
    d = Daemon()
    try:
        m = make_net()
        mesh = st.init_device_mesh(job_name(request), 0, (1,), socket_path=d.socket)
        # Daemon-executed: a rank-executed unshard of one rank needs no daemon.
        st.fully_shard(m.fc1, mesh=mesh, exec="daemon")
        st.fully_shard(m, mesh=mesh, exec="daemon")
        d.proc.kill()
        d.proc.wait(timeout=10)
        with pytest.raises(shardd.DaemonGone) as ei:
            m(torch.ones(1, 6))
        text = str(ei.value)
        assert "group '1.Net'" in text or "group '0.Linear'" in text
        assert "rank 0" in text and "gone" in text
        mesh.close()
    finally:
        d.stop()

# SPDX-License-Identifier: MIT
"""shardd.torch.DaemonSGD / DaemonAdamW: the daemon's optimizer behind a
torch.optim.Optimizer, with ranks as threads of one process (models built
before the threads start). References are single-process torch.optim on the
union of the ranks' batches.

Tolerance 1e-6 (absolute; params and grads are O(1)): the runs differ in the
order of the fp32 gradient sums (each rank sums its rows, the daemon the
ranks' partials; the reference one matmul over all rows), a few ulps of each
gradient (~1e-7 relative), and in the kernels' rounding of the update (fused
multiply-adds: an ulp or two of a param, 6e-8 at |p| < 1). Over K = 4 steps
SGD with momentum 0.9 carries a grad error into the params as at most
K * lr * (1 + momentum) * |g| * 1e-7 ~ 1e-8. AdamW's update m / (sqrt(v) +
eps) is bounded by lr per step and its relative error is the grads' (~1e-7),
so ~lr * 1e-7 = 1e-9 per step. Measured: at most 3e-8 (two ulps). A wrong
update (no momentum, the lr of another step, a step applied twice or on the
wrong shard) moves a param by about lr * |update| >= 1e-3 (each test checks
the params moved more than 100 * ATOL), three orders above the tolerance."""

import contextlib

import pytest
import torch

import shardd
import shardd.torch as st
import torch_net
from conftest import job_name, run_ranks
from torch_net import make_net, shard, shards_of

torch.set_num_threads(1)

WORLD, STEPS, BATCH = 2, 4, 4
ATOL = 1e-6


def batches():
    return torch_net.batches(WORLD, BATCH, STEPS)


@contextlib.contextmanager
def mesh(daemon, job, rank):
    with st.init_device_mesh(job, rank, (WORLD,), socket_path=daemon.socket) as m:
        yield m


def train(model, opt, data, rank=None, scheduler=None):
    for x, y in data:
        if rank is not None:
            x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def assert_shards_match(results, ref, atol=ATOL):
    params = dict(ref.named_parameters())
    for shards in results:
        assert {n for n, *_ in shards} == set(params)
        for n, t, d, f in shards:
            want = params[n].detach().narrow(d, f, t.shape[d])
            torch.testing.assert_close(t, want, rtol=0, atol=atol)


def run_parity(daemon, request, daemon_opt, torch_opt, scheduler=None):
    job = job_name(request)
    models = [make_net() for _ in range(WORLD)]
    data = batches()

    def rank(r):
        m = models[r]
        opt = daemon_opt(m)
        sched = scheduler(opt) if scheduler else None
        with mesh(daemon, job, r) as mesh_:
            shard(m, mesh_)
            train(m, opt, data, r, sched)
            assert opt.step_number == STEPS
            assert set(opt.last_results.values()) == {shardd.STEP_APPLIED}
            return shards_of(m), opt.param_groups[0]["lr"]

    results = run_ranks(rank, WORLD)
    ref = make_net()
    opt = torch_opt(ref.parameters())
    train(ref, opt, data, scheduler=scheduler(opt) if scheduler else None)
    assert_shards_match([s for s, _ in results], ref)
    assert all(lr == opt.param_groups[0]["lr"] for _, lr in results)
    moved = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), make_net().parameters()))
    assert moved > 100 * ATOL, f"params moved only {moved}: the comparison would prove nothing"
    return [s for s, _ in results], ref


@pytest.mark.timeout_s(60)
def test_daemon_sgd_with_momentum_matches_torch_sgd(daemon, request):
    run_parity(daemon, request,
               lambda m: st.DaemonSGD(m, lr=0.05, momentum=0.9, weight_decay=0.01),
               lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01))


@pytest.mark.timeout_s(60)
def test_daemon_adamw_matches_torch_adamw(daemon, request):
    run_parity(daemon, request,
               lambda m: st.DaemonAdamW(m, lr=0.01, betas=(0.8, 0.99), eps=1e-8,
                                        weight_decay=0.05),
               lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99), eps=1e-8,
                                           weight_decay=0.05))


@pytest.mark.timeout_s(60)
def test_lr_scheduler_changes_the_lr_the_daemon_applies(daemon, request):
    """LambdaLR halves the lr every step: the daemon follows it (parity with
    torch under the same scheduler), and the result is far from a run with
    the constant lr."""
    halve = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)   # noqa: E731
    results, _ref = run_parity(
        daemon, request,
        lambda m: st.DaemonSGD(m, lr=0.2, momentum=0.5),
        lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.5), scheduler=halve)
    const = make_net()
    opt = torch.optim.SGD(const.parameters(), lr=0.2, momentum=0.5)
    train(const, opt, batches())
    params = dict(const.named_parameters())
    far = max(float((t - params[n].detach().narrow(d, f, t.shape[d])).abs().max())
              for shards in results for n, t, d, f in shards)
    assert far > 100 * ATOL


@pytest.mark.timeout_s(60)
def test_resubmitted_step_is_already_applied_and_changes_nothing(daemon, request):
    """state_dict carries lr and step count; loading an older one makes the
    next step() re-submit an applied step: the daemon answers 'already
    applied' and the shards stay; the daemon's last_step is the last applied."""
    job = job_name(request)
    models = [make_net() for _ in range(WORLD)]
    data = batches()

    def rank(r):
        m = models[r]
        opt = st.DaemonSGD(m, lr=0.05, momentum=0.9)
        with mesh(daemon, job, r) as mesh_:
            shard(m, mesh_)
            assert opt.last_step == 0
            train(m, opt, data[:1], r)
            early = opt.state_dict()
            assert early["step_number"] == 1 and early["param_groups"][0]["lr"] == 0.05
            train(m, opt, data[1:2], r)
            before = shards_of(m)
            opt.param_groups[0]["lr"] = 0.3
            opt.load_state_dict(early)
            assert opt.param_groups[0]["lr"] == 0.05 and opt.step_number == 1
            train(m, opt, data[2:3], r)          # submits step 2 again
            again = dict(opt.last_results)
            after = shards_of(m)
            reopened = mesh_.open_group(m.fc1._shardd_state.name)
            daemon_last = reopened.last_step
            reopened.close()
            return before, after, again, daemon_last

    for before, after, again, daemon_last in run_ranks(rank, WORLD):
        assert set(again.values()) == {shardd.STEP_ALREADY}
        assert daemon_last == 2
        for (n, b, *_), (_n, a, *_) in zip(before, after):
            assert torch.equal(a, b), n


@pytest.mark.timeout_s(60)
def test_daemon_optimizer_misuse_is_refused_naming_the_fix(daemon, request):
    with st.init_device_mesh(job_name(request), 0, (1,), socket_path=daemon.socket) as mesh_:
        m = make_net()
        st.fully_shard(m, mesh=mesh_)
        with pytest.raises(ValueError, match=r"before fully_shard"):
            st.DaemonSGD(m, lr=0.1)
    unsharded = make_net()
    opt = st.DaemonAdamW(unsharded)
    with pytest.raises(RuntimeError, match=r"no fully_shard group is registered"):
        opt.step()
    with pytest.raises(ValueError, match=r"already under a DaemonAdamW"):
        st.DaemonSGD(unsharded.fc1, lr=0.1)
    with st.init_device_mesh(job_name(request) + "-b", 0, (1,), socket_path=daemon.socket) as m2:
        st.fully_shard(unsharded.fc1, mesh=m2)      # the root never: fc2's params stay local
        torch.nn.functional.mse_loss(unsharded(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
        with pytest.raises(RuntimeError, match=r"\['fc2.weight', 'fc2.bias'\] are in no fully_shard"):
            opt.step()

# SPDX-License-Identifier: MIT
"""shardd.torch.clip_grad_norm_: the daemon's job-wide grad_norm and the clip
coefficient carried by the daemon's step, against torch.nn.utils.clip_grad_norm_
and torch.optim on one process over the union of the ranks' batches (ranks are
threads of one process, as in test_torch_optim.py).

Tolerance: the returned norm within 1e-6 relative, the params within 1e-6
absolute (params and grads are O(1)). The daemon sums the squares in fp64
and torch in fp32 (per param, then over params), so the norms differ by a few
fp32 ulps (~1e-7 relative); the clip coefficient max_norm / (norm + 1e-6) is
rounded to fp32 by both, so it differs by at most an ulp or two; the grads
themselves differ by the order of the fp32 sums across ranks (~1e-7
relative, see test_torch_optim.py). An update is lr * coef * g (SGD) or
bounded by lr (AdamW), so each step moves the params apart by at most
~lr * 1e-7 (< 1e-8) and over K = 4 steps by < 1e-7. A missing clip changes a
step by lr * (1 - coef) * |g| >= 1e-3 here (each test checks the clipped run
is more than 100 * ATOL away from the unclipped one), far above it."""

import math
import os
import subprocess
import sys

import pytest
import torch

import shardd
import shardd.torch as st
import torch_net
from conftest import ROOT, job_name, run_ranks
from torch_net import make_net, shard, shards_of

torch.set_num_threads(1)

WORLD, STEPS, BATCH = 2, 4, 4
ATOL = 1e-6


def batches():
    return torch_net.batches(WORLD, BATCH, STEPS, scale=3.0)


def rows(t, r):
    return t if r is None else t[r * BATCH:(r + 1) * BATCH]


def train(model, opt, data, clip, max_norm, norm_type, rank=None):
    """K steps; returns the norms clip returned."""
    norms = []
    for x, y in data:
        torch.nn.functional.mse_loss(model(rows(x, rank)), rows(y, rank)).backward()
        norms.append(float(clip(model.parameters(), max_norm, norm_type)))
        opt.step()
        opt.zero_grad()
    return norms


def max_gap(shards, ref):
    params = dict(ref.named_parameters())
    gap = 0.0
    for n, t, d, f in shards:
        want = params[n].detach().narrow(d, f, t.shape[d])
        gap = max(gap, float((t - want).abs().max()))
    return gap


def run(daemon, request, daemon_opt, torch_opt, max_norm, norm_type=2.0, trainer_side=False):
    """The daemon run (WORLD thread ranks) and torch's; returns the ranks'
    (shards, norms, last results) and the reference model and norms."""
    job = job_name(request)
    models = [make_net() for _ in range(WORLD)]
    data = batches()

    def rank(r):
        m = models[r]
        opt = None if trainer_side else daemon_opt(m)
        with st.init_device_mesh(job, r, (WORLD,), socket_path=daemon.socket) as mesh:
            shard(m, mesh)
            if trainer_side:
                opt = torch_opt(m.parameters())
            norms = train(m, opt, data, st.clip_grad_norm_, max_norm, norm_type, r)
            return shards_of(m), norms, getattr(opt, "last_results", None)

    results = run_ranks(rank, WORLD)
    ref = make_net()
    ref_norms = train(ref, torch_opt(ref.parameters()), data, torch.nn.utils.clip_grad_norm_,
                      max_norm, norm_type)
    return results, ref, ref_norms


def check_parity(results, ref, ref_norms, unclipped):
    for shards, norms, _ in results:
        assert norms == pytest.approx(ref_norms, rel=1e-6)
        assert max_gap(shards, ref) <= ATOL
        assert max_gap(shards, unclipped) > 100 * ATOL, "the clip changed nothing"


def unclipped_run(torch_opt):
    ref = make_net()
    opt = torch_opt(ref.parameters())
    for x, y in batches():
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


@pytest.mark.timeout_s(60)
def test_clip_grad_norm_with_daemon_sgd_matches_torch_clip_and_sgd(daemon, request):
    sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)   # noqa: E731
    results, ref, ref_norms = run(
        daemon, request, lambda m: st.DaemonSGD(m, lr=0.05, momentum=0.9, weight_decay=0.01),
        sgd, max_norm=0.5)
    assert min(ref_norms) > 1.0, f"norms {ref_norms}: the clip would not be active"
    check_parity(results, ref, ref_norms, unclipped_run(sgd))
    for _, _, last in results:
        assert set(last.values()) == {shardd.STEP_APPLIED}


@pytest.mark.timeout_s(60)
def test_clip_grad_norm_inf_with_daemon_adamw_matches_torch(daemon, request):
    adamw = lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99),   # noqa: E731
                                        weight_decay=0.05)
    results, ref, ref_norms = run(
        daemon, request,
        lambda m: st.DaemonAdamW(m, lr=0.01, betas=(0.8, 0.99), weight_decay=0.05),
        adamw, max_norm=0.05, norm_type=math.inf)
    assert min(ref_norms) > 0.5
    # AdamW is invariant to one grad scale for all steps (up to eps), but the
    # coefficients differ per step, so the clipped run still ends elsewhere.
    check_parity(results, ref, ref_norms, unclipped_run(adamw))


@pytest.mark.timeout_s(60)
def test_clip_grad_norm_scales_shard_grads_for_a_trainer_side_optimizer(daemon, request):
    sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5)   # noqa: E731
    results, ref, ref_norms = run(daemon, request, None, sgd, max_norm=0.5, trainer_side=True)
    check_parity(results, ref, ref_norms, unclipped_run(sgd))


@pytest.mark.timeout_s(60)
def test_nonfinite_norm_skips_the_step_on_every_rank(daemon, request):
    """Rank 0's shard has the NaN, rank 1's is finite: the job-wide norm is
    NaN, both ranks skip step 2, and the run matches torch skipping it (the
    skipped step does not count for AdamW's bias correction)."""
    adamw = lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05)   # noqa: E731
    job = job_name(request)
    models = [make_net() for _ in range(WORLD)]
    data = batches()
    seen = {}

    def rank(r):
        m = models[r]
        opt = st.DaemonAdamW(m, lr=0.01, weight_decay=0.05, skip_nonfinite=True)
        with st.init_device_mesh(job, r, (WORLD,), socket_path=daemon.socket) as mesh:
            shard(m, mesh)
            norms = []
            for i, (x, y) in enumerate(data):
                torch.nn.functional.mse_loss(m(rows(x, r)), rows(y, r)).backward()
                if i == 1 and r == 0:
                    m.fc2.weight.grad.view(-1)[0] = float("nan")
                norms.append(float(st.clip_grad_norm_(m, 1e9)))
                opt.step()
                seen[(r, i)] = dict(opt.last_results)
                opt.zero_grad()
            return shards_of(m), norms

    results = run_ranks(rank, WORLD)
    ref = make_net()
    opt = adamw(ref.parameters())
    for i, (x, y) in enumerate(data):
        torch.nn.functional.mse_loss(ref(x), y).backward()
        if i != 1:
            opt.step()
        opt.zero_grad()
    for r, (shards, norms) in enumerate(results):
        assert math.isnan(norms[1]) and all(math.isfinite(n) for i, n in enumerate(norms) if i != 1)
        assert set(seen[(r, 1)].values()) == {shardd.STEP_SKIPPED}, seen[(r, 1)]
        assert set(seen[(r, 0)].values()) == {shardd.STEP_APPLIED}
        assert max_gap(shards, ref) <= ATOL


@pytest.mark.timeout_s(60)
def test_nonfinite_norm_raises_or_refuses_a_nan_clip(daemon, request):
    """error_if_nonfinite raises torch's RuntimeError on every rank; without
    it and without skip_nonfinite the step refuses the NaN coefficient,
    naming the fix, and nothing was applied."""
    job = job_name(request)
    models = [make_net() for _ in range(WORLD)]
    x, y = batches()[0]

    def rank(r):
        m = models[r]
        opt = st.DaemonSGD(m, lr=0.1)
        with st.init_device_mesh(job, r, (WORLD,), socket_path=daemon.socket) as mesh:
            shard(m, mesh)
            before = shards_of(m)
            torch.nn.functional.mse_loss(m(rows(x, r)), rows(y, r)).backward()
            if r == 1:
                m.fc1.bias.grad.view(-1)[0] = float("inf")
            with pytest.raises(RuntimeError, match=r"total norm of order 2.0 .* is non-finite"):
                st.clip_grad_norm_(m, 1.0, error_if_nonfinite=True)
            if r == 1:
                m.fc1.bias.grad.view(-1)[0] = float("nan")
            assert math.isnan(float(st.clip_grad_norm_(m.parameters(), 1.0)))
            with pytest.raises(ValueError, match=r"skip_nonfinite=True"):
                opt.step()
            return before, shards_of(m)

    for before, after in run_ranks(rank, WORLD):
        for (n, b, *_), (_n, a, *_) in zip(before, after):
            assert torch.equal(a, b), n


@pytest.mark.timeout_s(60)
def test_clip_grad_norm_refuses_a_partial_param_list_naming_the_groups(daemon, request):
    with st.init_device_mesh(job_name(request), 0, (1,), socket_path=daemon.socket) as mesh:
        m = make_net()
        shard(m, mesh)
        torch.nn.functional.mse_loss(m(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
        with pytest.raises(ValueError, match=r"job-wide.*groups \['0.Linear'\]"):
            st.clip_grad_norm_(m.fc2.parameters(), 1.0)
        with pytest.raises(ValueError, match=r"in no fully_shard group"):
            st.clip_grad_norm_([torch.nn.Parameter(torch.ones(3))], 1.0)
        with pytest.raises(ValueError, match=r"norm_type 1 is not supported"):
            st.clip_grad_norm_(m, 1.0, norm_type=1.0)


def run_example(daemon, request, *args):
    example = os.path.join(ROOT, "client", "examples", "train_torch.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    p = subprocess.run([sys.executable, example, "--socket", daemon.socket, "--job",
                        job_name(request), *args], env=env, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert "clipped to 0.05) match the single-process reference" in p.stdout
    return p.stdout


@pytest.mark.timeout_s(180)
def test_example_clipped_hsdp_training_matches_torch(daemon, request):
    """Processes, HSDP 2x2: the daemon's norm counts each replica once."""
    run_example(daemon, request, "--ranks", "4", "--replicate", "2", "--steps", "4",
                "--max-norm", "0.05")


@pytest.mark.timeout_s(180)
def test_example_clipped_with_torch_optim_in_the_ranks_matches_torch(daemon, request):
    run_example(daemon, request, "--ranks", "3", "--steps", "4", "--max-norm", "0.05",
                "--torch-optim")

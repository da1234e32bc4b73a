# SPDX-License-Identifier: MIT
"""The optimizer kernels (kernels/optim.c) against torch.optim itself:
SGD and AdamW, K steps with a learning rate that changes every step, on
random fp32 params and grads, for every option, through the small driver
tests/python/optim_step.c (built by make test-python).

Tolerance: both sides compute in fp32, in different orders (torch 1.13's
AdamW uses mul/add where the kernel follows torch 2's lerp, and torch's
vector loops use FMA where the kernel rounds each product), so each element
differs by a few fp32 roundings (2^-24 relative) of its magnitude per step.
Params and grads here are O(1) and there are K = 10 steps: at most ~60
roundings, ~4e-6 of the largest magnitude (measured: 3e-7). RTOL = 2e-5
relative plus ATOL = 2e-5 of the array's largest |value| leaves headroom,
while a formula error (bias correction, dampening, coupled
weight decay) moves params by >= 1e-4 (checked by the last test)."""

import os
import subprocess

import numpy as np
import pytest

from conftest import shardd_build

torch = pytest.importorskip("torch", reason="torch is not installed: python3-torch (Debian) is needed "
                                            "for the parity with torch.optim")

K = 10
RTOL = 2e-5
ATOL = 2e-5
LR_GROWTH = 0.25


def driver():
    path = os.path.join(shardd_build(), "tests", "python", "optim_step")
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} not found: build it with make test-python (or make {path})")
    return path


def run_kernel(tmp_path, kind, p0, grads, **hp):
    n = p0.size
    src, dst = tmp_path / "in.f32", tmp_path / "out.f32"
    np.concatenate([p0] + grads).astype(np.float32).tofile(src)
    args = [driver(), kind, str(n), str(len(grads)), str(src), str(dst), f"lr_growth={LR_GROWTH}"]
    args += [f"{k}={float(v)!r}" for k, v in hp.items()]
    res = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"optim_step failed: {res.stderr}"
    out = np.fromfile(dst, dtype=np.float32)
    return out.reshape(-1, n)


def run_torch(kind, p0, grads, grad_scale, **hp):
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    lr = hp.pop("lr")
    if kind == "sgd":
        opt = torch.optim.SGD([p], lr=lr, **hp)
    else:
        opt = torch.optim.AdamW([p], lr=lr, betas=(hp.pop("beta1"), hp.pop("beta2")), **hp)
    for k, g in enumerate(grads, start=1):
        opt.param_groups[0]["lr"] = lr * (1 + LR_GROWTH * (k - 1))
        p.grad = torch.from_numpy(g.copy())
        if grad_scale != 1.0:
            # clip_grad_norm_'s in-place multiply by the (fp32) clip coefficient.
            p.grad.mul_(torch.tensor(grad_scale, dtype=torch.float32))
        opt.step()
    st = opt.state[p]
    return p.detach().numpy(), st


def close(name, got, want):
    want = np.asarray(want, dtype=np.float64)
    atol = ATOL * max(np.max(np.abs(want)), 1e-30) if want.size else 0
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=f"{name} differs from torch.optim")


def inputs(n, seed):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(K)]
    return p0, grads


SGD_CASES = [
    dict(momentum=m, dampening=d, nesterov=nes, weight_decay=wd, maximize=mx)
    for m in (0.0, 0.9) for d in (0.0, 0.5) for nes in (False, True) for wd in (0.0, 0.01)
    for mx in (False, True)
    if not nes or (m > 0 and d == 0)
]


@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_sgd_matches_torch_optim_sgd(tmp_path, case, grad_scale):
    for n in (1, 17, 4097):
        p0, grads = inputs(n, n)
        out = run_kernel(tmp_path, "sgd", p0, grads, lr=0.05, grad_scale=grad_scale,
                         **{k: float(v) for k, v in case.items()})
        want_p, st = run_torch("sgd", p0, grads, np.float32(grad_scale), lr=0.05, **case)
        close(f"sgd n={n} param", out[0], want_p)
        if case["momentum"] != 0:
            close(f"sgd n={n} momentum_buffer", out[1], st["momentum_buffer"].numpy())


ADAMW_CASES = [
    dict(beta1=b1, beta2=b2, weight_decay=wd, amsgrad=ams, maximize=mx)
    for (b1, b2) in ((0.9, 0.999), (0.3, 0.95)) for wd in (0.0, 0.1) for ams in (False, True)
    for mx in (False, True)
]


@pytest.mark.parametrize("case", ADAMW_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_adamw_matches_torch_optim_adamw(tmp_path, case, grad_scale):
    for n in (1, 17, 4097):
        p0, grads = inputs(n, 1000 + n)
        out = run_kernel(tmp_path, "adamw", p0, grads, lr=0.01, eps=1e-8, grad_scale=grad_scale,
                         **{k: float(v) for k, v in case.items()})
        want_p, st = run_torch("adamw", p0, grads, np.float32(grad_scale), lr=0.01, eps=1e-8, **case)
        close(f"adamw n={n} param", out[0], want_p)
        close(f"adamw n={n} exp_avg", out[1], st["exp_avg"].numpy())
        close(f"adamw n={n} exp_avg_sq", out[2], st["exp_avg_sq"].numpy())
        if case["amsgrad"]:
            close(f"adamw n={n} max_exp_avg_sq", out[3], st["max_exp_avg_sq"].numpy())


def test_tolerance_catches_coupled_weight_decay(tmp_path):
    """The comparison can fail: torch.optim.Adam (L2 weight decay added to the
    grad) differs from AdamW (decoupled) by more than the tolerance."""
    p0, grads = inputs(4097, 7)
    out = run_kernel(tmp_path, "adamw", p0, grads, lr=0.01, weight_decay=0.1)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.Adam([p], lr=0.01, weight_decay=0.1)
    for k, g in enumerate(grads, start=1):
        opt.param_groups[0]["lr"] = 0.01 * (1 + LR_GROWTH * (k - 1))
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    with pytest.raises(AssertionError):
        close("adamw vs Adam(L2)", out[0], p.detach().numpy())

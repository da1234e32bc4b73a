# SPDX-License-Identifier: MIT
"""shardd.torch and the Python client on GPUs, against a real `shardd
--backend cuda` (make gpu-check runs this file on a GPU machine; without a
GPU every test skips, saying why). Ranks are processes (cuda_rank.py), one
fresh interpreter each, placed on the GPUs by the `placement` parameter:
every rank on cuda:0 ("one-gpu", the daemon's device copies) or rank r on
cuda:r mod the GPUs ("spread", the daemon's NCCL path; skipped on one GPU).

- Numerics against single-process torch on the same GPU: DaemonSGD with
  clip_grad_norm_, DaemonAdamW and a trainer-side torch.optim.SGD over
  K = 4 steps, on fd- and ipc-exported buffers, to ATOL
  (below); the first step's sharded grads with a bf16 param_dtype against
  a bf16 reference to bf16's precision; full_state_dict against the
  shards.
- Stream ordering (Client.set_stream): writes queued behind a delay on
  the trainer's stream are what the unshard gathers and the reduce sums,
  with no CPU wait anywhere (cuda_rank.py fences).
- Re-attach after a rank kill: a rank SIGKILLed after step 2 comes back
  with init_device_mesh(resume=True) + recover(), and every final shard is
  bit-identical to an uninterrupted run's.
- Checkpoints: st.checkpoint of a GPU job, restored by a fresh job at
  another mesh, gives the same params.

ATOL = 1e-5 (absolute; params O(1)): as test_torch_optim.py's 1e-6, the
runs differ in the order of fp32 gradient sums, and on the GPU cuBLAS
also picks its reduction order by problem size (4 rows a rank against 8
in the reference; TF32 is off on both sides), a few ulps of each gradient
(~1e-6 relative at worst); over 4 steps at lr 0.1 with momentum 0.9 that
is below 1e-6 of a param. A wrong update moves a param by ~lr * |g| >= 1e-3."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import shardd
import shardd.cuda
from conftest import Daemon, job_name

torch = pytest.importorskip("torch")
import torch_net  # noqa: E402  (needs torch)

HERE = os.path.dirname(os.path.abspath(__file__))
ATOL = 1e-5
STEPS, BATCH = 4, 4
RANK_TIMEOUT_S = 120


def _no_gpu_reason():
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    try:
        shardd.cuda.driver()
    except shardd.ShardError as e:
        return f"the Python client cannot load the driver: {e.text}"
    return None


NO_GPU = _no_gpu_reason()
pytestmark = pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU: {NO_GPU}")

PLACEMENTS = ["one-gpu", "spread"]


def devices(placement, world):
    if placement == "one-gpu":
        return ["cuda:0"] * world
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"placement 'spread' needs 2 GPUs, this machine has {n}")
    return [f"cuda:{r % n}" for r in range(world)]


def cuda_daemon(*extra):
    """A shardd --backend cuda, or a skip when this shardd has no cuda backend."""
    try:
        return Daemon(("--backend", "cuda", *extra))
    except pytest.fail.Exception as e:
        if "built without CUDA" in str(e):
            pytest.skip("this shardd was built without the cuda backend (make CUDA=1)")
        raise


@pytest.fixture(scope="module", params=["fd", "ipc"])
def gpu_daemon(request):
    d = cuda_daemon("--cuda-export", request.param)
    d.export = request.param
    yield d
    d.stop()


def rank_env():
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(shardd.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([pkg, HERE])}


def start_rank(mode, sock, job, rank, world, device, out, *opts):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "cuda_rank.py"), mode, sock, job,
                             str(rank), str(world), device, out, *opts],
                            env=rank_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(procs, what):
    """Wait for every rank process; fail naming the first that failed and its output."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    for r, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what}: rank {r} did not finish within {RANK_TIMEOUT_S} s")
        if p.returncode != 0:
            for q in procs:
                q.kill()
            pytest.fail(f"{what}: rank {r} exited with {p.returncode}:\n{text}")


def run_job(daemon, job, world, devs, tmp, *opts):
    outs = [os.path.join(tmp, f"{job}-r{r}.npz") for r in range(world)]
    procs = [start_rank("train", daemon.socket, job, r, world, devs[r], outs[r], *opts)
             for r in range(world)]
    finish(procs, f"job {job}")
    return [dict(np.load(o)) for o in outs]


def reference(opt, steps, world, clip=0.0, device="cuda:0"):
    """The same training in one process on the union of the ranks' rows, on the GPU."""
    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = torch_net.make_net().to(dev)
    if opt == "adamw":
        o = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    elif opt == "sgd":
        o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = None
    for x, y in torch_net.batches(world, BATCH, steps):
        torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        if grads is None:
            grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        o.step()
        o.zero_grad()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}, grads


def rows(full, shard, name, got):
    first = int(got[f"first:{name}"])
    return full[first:first + shard.shape[0]]


def assert_shards(results, ref, atol=ATOL, key="shard"):
    moved = 0.0
    init = dict(torch_net.make_net().named_parameters())
    for got in results:
        for k, v in got.items():
            if not k.startswith(key + ":"):
                continue
            n = k.split(":", 1)[1]
            want = rows(ref[n], torch.from_numpy(v), n, got)
            torch.testing.assert_close(torch.from_numpy(v), want, rtol=0, atol=atol, msg=n)
            moved = max(moved, float((want - rows(init[n].detach(), want, n, got)).abs().max()))
    assert moved > 100 * atol, "the params did not move: the check would not see a missed step"


@pytest.mark.timeout_s(240)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("opt, clip", [("sgd", 0.05), ("adamw", 0.0), ("torch-sgd", 0.0)])
def test_training_matches_single_process_torch_on_the_gpu(gpu_daemon, request, tmp_path, placement,
                                                          opt, clip):
    world = 2 if gpu_daemon.export == "fd" else 3
    results = run_job(gpu_daemon, job_name(request), world, devices(placement, world),
                      str(tmp_path), "--opt", opt, "--steps", str(STEPS), "--clip", str(clip))
    ref, grads = reference(opt, STEPS, world, clip)
    assert_shards(results, ref)
    for got in results:
        for k, v in got.items():
            if k.startswith("full:"):
                torch.testing.assert_close(torch.from_numpy(v), ref[k[5:]], rtol=0, atol=ATOL)
            if k.startswith("grad:") and opt != "torch-sgd":
                n = k[5:]
                torch.testing.assert_close(torch.from_numpy(v), rows(grads[n], torch.from_numpy(v),
                                                                     n, got),
                                           rtol=0, atol=ATOL)


@pytest.mark.timeout_s(180)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bf16_param_dtype_grads_match_a_bf16_reference(gpu_daemon, request, tmp_path, placement):
    """Compute in bf16 from the unsharded bf16 copies, reduce in fp32: the first
    step's sharded grads against the same model computed in bf16 in one
    process, to bf16's precision (rtol 2^-7, atol 2e-3, as test_torch_fsdp.py)."""
    world = 2
    results = run_job(gpu_daemon, job_name(request), world, devices(placement, world),
                      str(tmp_path), "--param-dtype", "bf16", "--steps", "1")
    dev = torch.device("cuda:0")
    model = torch_net.make_net().to(dev).to(torch.bfloat16)
    x, y = torch_net.batches(world, BATCH, 1)[0]
    losses = []
    for r in range(world):
        xr, yr = x[r * BATCH:(r + 1) * BATCH].to(dev), y[r * BATCH:(r + 1) * BATCH].to(dev)
        losses.append(torch.nn.functional.mse_loss(model(xr.to(torch.bfloat16)).float(), yr))
    (sum(losses) / world).backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    for got in results:
        for k, v in got.items():
            if k.startswith("grad:"):
                n = k[5:]
                torch.testing.assert_close(torch.from_numpy(v),
                                           rows(grads[n], torch.from_numpy(v), n, got),
                                           rtol=2 ** -7, atol=2e-3)


@pytest.mark.timeout_s(120)
def test_stream_fences_order_the_ops_after_the_writes_queued_on_the_stream(gpu_daemon, request,
                                                                         tmp_path):
    """No read before the unshard, no reduce before the grads: every value
    was written behind a ~0.1 s delay on the stream, and nothing waited on
    the CPU (a completion without fences would read the old values)."""
    world = 2
    job = job_name(request)
    outs = [os.path.join(str(tmp_path), f"r{r}.npz") for r in range(world)]
    procs = [start_rank("fences", gpu_daemon.socket, job, r, world, "cuda:0", outs[r])
             for r in range(world)]
    finish(procs, f"job {job}")
    n = 1 << 20
    full = np.arange(n, dtype=np.float32)
    for r in range(world):
        got = np.load(outs[r])
        b, v = int(got["begin"]), int(got["valid"])
        for step in range(3):
            np.testing.assert_array_equal(got[f"unshard{step}"], full * (step + 1))
            # The daemon averages: (1 + 2) / 2 of each rank's rows, times the step's factor.
            np.testing.assert_array_equal(got[f"reduce{step}"], full[b:b + v] * 1.5 * (step + 1))


@pytest.mark.timeout_s(240)
def test_a_killed_rank_reattaches_and_every_shard_matches_an_uninterrupted_run(request, tmp_path):
    world = 2
    with cuda_daemon("--cuda-export", "fd") as d:
        job = job_name(request)
        base = run_job(d, job + "-a", world, ["cuda:0"] * world, str(tmp_path), "--opt", "adamw",
                       "--steps", str(STEPS))
        job_b = job + "-b"
        outs = [os.path.join(str(tmp_path), f"{job_b}-r{r}.npz") for r in range(world)]
        procs = [start_rank("train", d.socket, job_b, r, world, "cuda:0", outs[r], "--opt",
                            "adamw", "--steps", str(STEPS), *(["--kill-after", "2"] if r else []))
                 for r in range(world)]
        try:
            procs[1].wait(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("rank 1 did not reach its kill point")
        assert procs[1].returncode == -signal.SIGKILL, procs[1].communicate()[0]
        procs[1] = start_rank("train", d.socket, job_b, 1, world, "cuda:0", outs[1], "--opt",
                              "adamw", "--steps", str(STEPS), "--resume")
        finish(procs, f"job {job_b} after the kill")
        for r in range(world):
            got = dict(np.load(outs[r]))
            for k, v in base[r].items():
                if k.startswith("shard:"):
                    np.testing.assert_array_equal(got[k], v, err_msg=f"rank {r} {k}")


@pytest.mark.timeout_s(240)
def test_a_gpu_checkpoint_restores_at_another_mesh(request, tmp_path):
    state = tempfile.mkdtemp(prefix="shardd-py-cuda-state-")
    try:
        with cuda_daemon("--state-dir", state) as d:
            job = job_name(request)
            first = run_job(d, job, 2, ["cuda:0"] * 2, str(tmp_path), "--opt", "sgd", "--steps",
                            "2", "--checkpoint")
            ckpt = os.path.join(state, job, f"step-{int(first[0]['checkpoint_step']):012d}")
            assert os.path.isdir(ckpt), sorted(os.listdir(os.path.join(state, job)))
            again = run_job(d, job + "-restored", 3, ["cuda:0"] * 3, str(tmp_path), "--opt", "sgd",
                            "--steps", "0", "--restore", ckpt)
        full = {k[5:]: v for k, v in first[0].items() if k.startswith("full:")}
        for got in again:
            for k, v in got.items():
                if k.startswith("full:"):
                    np.testing.assert_array_equal(v, full[k[5:]], err_msg=k)
    finally:
        shutil.rmtree(state, ignore_errors=True)

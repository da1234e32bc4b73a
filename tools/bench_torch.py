#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""shardd.torch side by side with torch's own FSDP2 (fully_shard over gloo,
CPU): the GPT of client/examples/train_gpt.py trained by N rank processes
with each, same seeds, same batches, same AdamW.

For each N in --ranks and each policy in --policies (fp32: fp32 params and
reduce; bf16: bf16 params, fp32 reduce) it runs both, prints ms/step (the
median over the timed steps of the slowest rank's step: forward, backward,
optimizer step) and the largest difference between the two runs' final
parameters, and checks the targets: shardd >= 3x faster per step than FSDP2,
parameters within 1e-6 of FSDP2's where the reduce's sums do not depend on
the order of their terms, else within CONTROL_FACTOR x what one ulp of
every grad at every step does to FSDP2 (the `ulp ctl` column). The `local` column is the floor of both:
N processes computing the same per-rank steps on unsharded parameters, with
no communication (for bf16, a bf16 model), under the same CPU contention.

FSDP2 needs torch >= 2.4 (torch.distributed.fsdp.fully_shard from 2.6,
torch.distributed._composable.fsdp before). With an older torch (Debian 12's
1.13) only shardd runs, and the comparison is reported as skipped.

usage: tools/bench_torch.py [--shardd build/shardd | --socket PATH] [--ranks 2,4]
                            [--policies fp32,bf16] [--steps 12] [--warmup 3] [model options]
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "client", "examples", "train_gpt.py")
SPEEDUP_TARGET = 3.0
PARAM_TARGET = 1e-6
# Where the daemon and gloo add the ranks' fp32 grads in different orders
# (fp32 reduce, N > 2: a two-term sum is the same either way), the sums can
# differ in their last bit, and training amplifies that: the tolerance is
# then CONTROL_FACTOR x the spread of FSDP2 against itself with every grad
# element moved one ulp at every step (the `ulp ctl` column, same run). One
# draw of that spread is a max over every parameter of a divergence that
# grows step by step; 4x covers its variation between draws (docs/BENCHMARKS.md).
CONTROL_FACTOR = 4.0
WORKER_TIMEOUT_S = 600


def load_example():
    # Its siblings (shard_check.py) import as they do when it runs as a script.
    if os.path.dirname(EXAMPLE) not in sys.path:
        sys.path.insert(0, os.path.dirname(EXAMPLE))
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fsdp2_api(torch):
    """(fully_shard, MixedPrecisionPolicy) of the installed torch, or (None, why)."""
    from shardd.torch._api import torch_version
    if torch_version(torch.__version__) < (2, 4):
        return None, (f"torch {torch.__version__} < 2.4 has no FSDP2 fully_shard; install a "
                      f"newer torch in a virtual environment (docs/TORCH.md, 'Side by side with FSDP2')")
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError as e:
            return None, f"torch {torch.__version__}: no FSDP2 fully_shard ({e})"
    return (fully_shard, MixedPrecisionPolicy), None


# ---------------------------------------------------------------- workers
def policy_dtypes(torch, policy):
    return {"fp32": (None, torch.float32), "bf16": (torch.bfloat16, torch.float32)}[policy]


def nudge_grads(torch, model, gen):
    """Move every grad element one ulp up or down (seeded signs): the control run's perturbation."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            up = torch.randint(0, 2, g.shape, generator=gen, dtype=torch.bool)
            inf = torch.full_like(g, float("inf"))
            g.copy_(torch.nextafter(g, torch.where(up, inf, -inf)))


def train(g, a, model, opt, data, rank, world):
    import torch
    times = []
    lo, hi = rank * a.batch, (rank + 1) * a.batch
    gen = torch.Generator().manual_seed(1000 + rank) if a.nudge else None
    for step in range(a.warmup + a.steps):
        x, y = g.global_batch(a, data, step, world)
        t0 = time.perf_counter()
        loss = g.loss_of(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        if gen is not None:
            nudge_grads(torch, model, gen)
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def worker_shardd(a):
    import numpy as np
    import torch
    import shardd.torch as st
    g = load_example()
    torch.set_num_threads(1)
    data, _ = g.load_corpus(a.text)
    model = g.make_model(a)
    pd, rd = policy_dtypes(torch, a.policy)
    mp = st.MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)
    root_mp = st.MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd, output_dtype=torch.float32)
    with st.init_device_mesh(a.job, a.rank, (a.world,), socket_path=a.socket) as mesh:
        for block in model.blocks:
            st.fully_shard(block, mesh=mesh, mp_policy=mp)
        st.fully_shard(model, mesh=mesh, mp_policy=root_mp)
        opt = g.make_optimizer(a, model.parameters())
        times = train(g, a, model, opt, data, a.rank, a.world)
        np.savez(a.out + ".npz", **{f"{n}@{dim}@{first}": t.detach().float().numpy()
                                    for n, t, dim, first in st.local_shards(model)})
    with open(a.out + ".json", "w") as f:
        json.dump(times, f)


def worker_local(a):
    """The floor: the same per-rank compute with no sharding and no communication."""
    import torch
    g = load_example()
    torch.set_num_threads(1)
    data, _ = g.load_corpus(a.text)
    model = g.make_model(a)
    pd, _ = policy_dtypes(torch, a.policy)
    if pd is not None:
        model = model.to(pd)
    opt = g.make_optimizer(a, model.parameters())
    times = train(g, a, model, opt, data, a.rank, a.world)
    with open(a.out + ".json", "w") as f:
        json.dump(times, f)


def worker_fsdp2(a):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    g = load_example()
    (fully_shard, MixedPrecisionPolicy), _ = fsdp2_api(torch)
    torch.set_num_threads(1)
    data, _ = g.load_corpus(a.text)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank,
                            world_size=a.world)
    try:
        mesh = init_device_mesh("cpu", (a.world,))
        model = g.make_model(a)
        pd, rd = policy_dtypes(torch, a.policy)
        mp = MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)
        root_mp = MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd, output_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp)
        opt = g.make_optimizer(a, model.parameters())
        times = train(g, a, model, opt, data, a.rank, a.world)
        full = {n: p.full_tensor().detach().float().numpy() for n, p in model.named_parameters()}
        if a.rank == 0:
            np.savez(a.out + ".npz", **{f"{n}@0@0": v for n, v in full.items()})
        with open(a.out + ".json", "w") as f:
            json.dump(times, f)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- launcher
def run_config(a, impl, world, policy, tmp, nudge=False):
    """Run one configuration; return (per-step slowest-rank ms after warm-up, {param: array})."""
    import numpy as np
    tag = f"{impl}-{world}-{policy}" + ("-nudge" if nudge else "")
    store = os.path.join(tmp, tag + ".store")
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--rank", str(r),
               "--world", str(world), "--policy", policy, "--out", os.path.join(tmp, f"{tag}-r{r}"),
               "--store", store, "--job", f"bench_torch-{os.getpid()}-{tag}", "--text", a.text]
        if a.socket:
            cmd += ["--socket", a.socket]
        if nudge:
            cmd += ["--nudge"]
        for k in ("steps", "warmup", "batch", "layers", "dim", "heads", "context", "lr", "seed"):
            cmd += ["--" + k, str(getattr(a, k))]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    failed = []
    for r, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = "killed after %d s" % WORKER_TIMEOUT_S
        if rc != 0:
            failed.append((r, rc))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    if failed:
        raise SystemExit(f"bench_torch: {tag}: ranks failed: {failed}")
    per_rank = []
    for r in range(world):
        with open(os.path.join(tmp, f"{tag}-r{r}.json")) as f:
            per_rank.append(json.load(f))
    slowest = [max(ts[i] for ts in per_rank) for i in range(a.warmup, a.warmup + a.steps)]
    params = {}
    for r in range({"shardd": world, "fsdp2": 1, "local": 0}[impl]):
        got = np.load(os.path.join(tmp, f"{tag}-r{r}.npz"))
        for key in got.files:
            n, dim, first = key.split("@")
            params.setdefault(n, []).append((int(first), int(dim), got[key]))
    full = {}
    for n, pieces in params.items():
        pieces.sort(key=lambda p: p[0])
        full[n] = np.concatenate([p[2] for p in pieces], axis=pieces[0][1])
    return slowest, full


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shardd", default=os.path.join(ROOT, "build", "shardd"),
                    help="shardd binary to start on a private socket (default build/shardd)")
    ap.add_argument("--socket", help="use this running shardd instead")
    ap.add_argument("--ranks", default="2,4", help="comma-separated N (default 2,4)")
    ap.add_argument("--policies", default="fp32,bf16", help="fp32 and/or bf16 (default both)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps (default 12)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    ap.add_argument("--batch", type=int, default=2, help="windows per rank and step (default 2)")
    ap.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    ap.add_argument("--dim", type=int, default=256, help="width (default 256)")
    ap.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    ap.add_argument("--context", type=int, default=64, help="window (default 64)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", help="corpus file (default: the Bible, as train_gpt.py)")
    ap.add_argument("--worker", choices=("shardd", "fsdp2", "local"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--nudge", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if importlib.util.find_spec("shardd") is None:     # not installed: the checkout's
        sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    if a.worker == "shardd":
        return worker_shardd(a)
    if a.worker == "fsdp2":
        return worker_fsdp2(a)
    if a.worker == "local":
        return worker_local(a)

    import numpy as np
    import torch
    g = load_example()
    ranks = [int(x) for x in a.ranks.split(",")]
    policies = a.policies.split(",")
    for p in policies:
        if p not in ("fp32", "bf16"):
            ap.error(f"--policies {a.policies}: {p!r} is neither fp32 nor bf16")
    api, why = fsdp2_api(torch)
    daemon = None
    with tempfile.TemporaryDirectory(prefix="bench_torch-") as tmp:
        try:
            if not a.socket:
                daemon, a.socket = g.start_daemon(a.shardd, tmp)
            data, where = g.load_corpus(a.text)
            a.text = os.path.join(tmp, "corpus.txt")
            with open(a.text, "wb") as f:
                f.write(data.numpy().tobytes())
            nparams = sum(p.numel() for p in g.make_model(a).parameters())
            load0 = os.getloadavg()
            print(f"# bench_torch: torch {torch.__version__}, {os.cpu_count()} cpus, load average "
                  f"{load0[0]:.2f} at start")
            print(f"# model: train_gpt GPT, {nparams / 1e6:.2f} M params ({a.layers} blocks, dim "
                  f"{a.dim}, {a.heads} heads, context {a.context}), batch {a.batch} per rank, "
                  f"AdamW lr {a.lr}, 1 torch thread per rank; corpus {where}")
            print(f"# ms/step: median over {a.steps} steps (after {a.warmup} warm-up) of the "
                  f"slowest rank's forward+backward+optimizer step")
            if api is None:
                print(f"# FSDP2 comparison skipped: {why}")
            print("# local: N processes computing the same per-rank steps on unsharded params "
                  "(bf16: a bf16 model), no communication: the floor of both")
            print(f"# ulp ctl: max|dparam| of FSDP2 against FSDP2 with every grad moved one ulp "
                  f"at every step, run where the sums' order matters (fp32, N > 2); the tolerance "
                  f"is then {CONTROL_FACTOR:g}x it, else {PARAM_TARGET:g}")
            print(f"# {'ranks':>5} {'policy':>10} {'local ms':>10} {'fsdp2 ms':>10} "
                  f"{'shardd ms':>10} {'speedup':>8} {'max|dparam|':>12} {'ulp ctl':>10}")
            misses = []
            for world in ranks:
                for policy in policies:
                    label = "fp32" if policy == "fp32" else "bf16/fp32"
                    l_med = statistics.median(run_config(a, "local", world, policy, tmp)[0])
                    s_ms, s_par = run_config(a, "shardd", world, policy, tmp)
                    s_med = statistics.median(s_ms)
                    if api is None:
                        print(f"  {world:>5} {label:>10} {l_med:>10.1f} {'skipped':>10} "
                              f"{s_med:>10.1f} {'-':>8} {'-':>12} {'-':>10}", flush=True)
                        continue
                    f_ms, f_par = run_config(a, "fsdp2", world, policy, tmp)
                    f_med = statistics.median(f_ms)
                    diff = max(float(np.max(np.abs(s_par[n] - f_par[n]))) for n in f_par)
                    ctl, tol = "-", PARAM_TARGET
                    if policy == "fp32" and world > 2:
                        c_par = run_config(a, "fsdp2", world, policy, tmp, nudge=True)[1]
                        spread = max(float(np.max(np.abs(c_par[n] - f_par[n]))) for n in f_par)
                        ctl, tol = f"{spread:.3g}", max(PARAM_TARGET, CONTROL_FACTOR * spread)
                    speedup = f_med / s_med
                    print(f"  {world:>5} {label:>10} {l_med:>10.1f} {f_med:>10.1f} {s_med:>10.1f} "
                          f"{speedup:>7.2f}x {diff:>12.3g} {ctl:>10}", flush=True)
                    if speedup < SPEEDUP_TARGET:
                        misses.append(f"N={world} {label}: {speedup:.2f}x < {SPEEDUP_TARGET:g}x")
                    if diff > tol:
                        misses.append(f"N={world} {label}: params differ by {diff:.3g} > "
                                      f"{tol:.3g}")
            load1 = os.getloadavg()
            print(f"# load average {load1[0]:.2f} at end")
            if api is not None:
                print("# targets (>= 3x per step, params within the tolerance of FSDP2's): " +
                      ("met" if not misses else "MISSED: " + "; ".join(misses)))
            return 0
        finally:
            if daemon is not None:
                g.stop(daemon)


if __name__ == "__main__":
    sys.exit(main())

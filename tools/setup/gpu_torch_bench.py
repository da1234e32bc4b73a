#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The GPU check's PyTorch benchmark (make gpu-check; docs/CUDA.md "Python
on the GPU"): train_gpt's model on one machine, step times of

  shardd   2 ranks on cuda:0, a shardd --backend cuda started here (the
           daemon uncapped), shardd.torch.fully_shard with bf16 compute
           and fp32 reduce, torch.optim.AdamW on the shards;
  fsdp2    PyTorch's own fully_shard over NCCL on the same model, batch
           and policy: 2 ranks on 2 GPUs where the machine has them, else
           1 rank on cuda:0 with both ranks' rows (NCCL refuses two ranks
           of one communicator on one GPU), which the table says.

    gpu_torch_bench.py --shardd BIN --train-gpt PATH --text FILE [--label L]
                       [--steps N] [--fsdp2] [--rank-env K=V ...]

Prints one '#'-headed table row per run: the median step time over the
steps after the first --warmup, the slowest rank's (each rank
synchronizes before it reads the clock), tokens per second of the
global batch, and the first and last loss (the runs must train: a last
loss not below the first is a failure, exit status 1). --rank-env sets
variables in the ranks only (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=90 under
MPS, the daemon staying uncapped). Timings are of whatever else the GPU
runs at the time: the run script runs it alone."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# train_gpt's shape for the benchmark: its defaults, 8 windows a rank.
MODEL = ["--layers", "6", "--dim", "384", "--heads", "6", "--context", "64", "--batch", "8",
         "--param-dtype", "bf16", "--reduce-dtype", "fp32"]
TIMEOUT_S = 150


def fsdp2_rank(a):
    """One rank of PyTorch's FSDP2 training on train_gpt's model (run by --fsdp2)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    sys.path.insert(0, os.path.dirname(os.path.abspath(a.train_gpt)))
    import train_gpt as tg

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    targs = tg.parse_args(MODEL + ["--steps", str(a.steps), "--ranks", str(a.ranks)])[1]
    data, _ = tg.load_corpus(a.text)
    model = tg.make_model(targs).to(dev)
    mesh = init_device_mesh("cuda", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = tg.make_optimizer(targs, model.parameters())
    # Each rank trains on its share of the a.ranks ranks' rows: all of them on one rank.
    per = a.ranks // world * targs.batch
    lo, hi = rank * per, (rank + 1) * per
    for step in range(a.steps):
        x, y = tg.global_batch(targs, data, step, a.ranks)
        x, y = x[lo:hi].to(dev), y[lo:hi].to(dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        loss = tg.loss_of(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t0) * 1e3
        if rank == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "ms": ms}), flush=True)
    dist.destroy_process_group()


def run_shardd(a, tmp):
    """train_gpt --device cuda, 2 ranks on cuda:0 against a daemon started here."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.train_gpt)))
    import shardd.launch
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    sock = os.path.join(tmp, "shardd.sock")
    proc, _path, _text = shardd.launch.start_daemon(
        [a.shardd, "--socket", sock, "--foreground", "--log-level", "warn", "--backend", "cuda",
         "--collective-timeout", "60"], env=env, socket=sock)
    try:
        renv = dict(os.environ)
        renv.update(dict(kv.split("=", 1) for kv in a.rank_env))
        # Every rank on cuda:0: train_gpt puts rank r on GPU r mod the visible GPUs.
        renv["CUDA_VISIBLE_DEVICES"] = renv.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        p = subprocess.run([sys.executable, a.train_gpt, "--device", "cuda", "--socket", sock,
                            "--ranks", str(a.ranks), "--steps", str(a.steps), "--text", a.text,
                            *MODEL], env=renv, capture_output=True, text=True, timeout=TIMEOUT_S)
    finally:
        shardd.launch.stop(proc)
        proc.stderr.close()
    if p.returncode != 0:
        raise SystemExit(f"gpu_torch_bench: train_gpt exited with {p.returncode}:\n"
                         f"{p.stdout[-3000:]}{p.stderr[-3000:]}")
    steps = []
    for line in p.stdout.splitlines():
        # The launcher's "step   3/30  loss 5.1234    12.3 ms (slowest rank)".
        f = line.split()
        if len(f) >= 6 and f[0] == "step" and f[2] == "loss":
            steps.append((float(f[3]), float(f[4])))
    return steps


def run_fsdp2(a, tmp):
    import torch
    ngpu = torch.cuda.device_count()
    world = 2 if ngpu >= 2 and a.ranks == 2 else 1
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               WORLD_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--fsdp2-rank",
                               "--train-gpt", a.train_gpt, "--text", a.text, "--steps",
                               str(a.steps), "--ranks", str(a.ranks)],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise SystemExit(f"gpu_torch_bench: an FSDP2 rank exited with {p.returncode}:\n"
                             f"{err[-3000:]}")
        outs.append(out)
    steps = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    return [(s["loss"], s["ms"]) for s in steps], world


def row(label, ranks, gpus, steps, a):
    times = [ms for _loss, ms in steps[a.warmup:]]
    med = statistics.median(times)
    tokens = a.ranks * 8 * 64
    print(f"{label:<40} {ranks:>5} {gpus:>4} {med:>10.2f} {min(times):>8.2f} "
          f"{tokens / med * 1e3:>11.0f} {steps[0][0]:>8.4f} {steps[-1][0]:>8.4f}", flush=True)
    return steps[-1][0] < steps[0][0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shardd", help="the shardd binary (a CUDA build)")
    ap.add_argument("--train-gpt", required=True, help="client/examples/train_gpt.py")
    ap.add_argument("--text", required=True, help="the corpus (any file)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--label", default="time-sliced")
    ap.add_argument("--fsdp2", action="store_true", help="also run PyTorch's FSDP2")
    ap.add_argument("--rank-env", action="append", default=[], metavar="K=V")
    ap.add_argument("--fsdp2-rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.fsdp2_rank:
        return fsdp2_rank(a)
    if not a.shardd:
        ap.error("--shardd BIN is required")
    print(f"# train_gpt: 6 blocks, dim 384, context 64, 8 windows a rank, {a.ranks} ranks' "
          f"rows a step, bf16 compute, fp32 reduce, AdamW; median of steps {a.warmup + 1}.."
          f"{a.steps}")
    print(f"# {'run':<38} {'ranks':>5} {'gpus':>4} {'step(ms)':>10} {'min(ms)':>8} "
          f"{'tokens/s':>11} {'loss0':>8} {'lossN':>8}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu-torch-bench-") as tmp:
        steps = run_shardd(a, tmp)
        ok &= row(f"shardd {a.ranks} ranks, 1 GPU, {a.label}", a.ranks, 1, steps, a)
        if a.fsdp2:
            steps, world = run_fsdp2(a, tmp)
            label = (f"fsdp2 (NCCL) {world} ranks, {world} GPUs" if world > 1 else
                     f"fsdp2 (NCCL) 1 rank, {a.ranks} ranks' rows")
            ok &= row(label, world, world, steps, a)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train a small MLP with N rank processes through shardd (PyTorch, the pure-
Python client) and check it against a single-process reference.

Each rank applies shardd.torch.fully_shard to fc1, fc2 and the model (FSDP2's
recipe), so model.parameters() are its shards; forward and backward unshard
them, backward reduces (averages) the gradients through the daemon, and the
daemon's optimizer (shardd.torch.DaemonSGD, constructed before fully_shard)
updates the shards in the daemon, each step exactly once; with --torch-optim
a stock torch.optim.SGD updates the shards in the rank instead (the
trainer-side path: a rank that dies between its last reduce and its update
loses that update, which the daemon's step cannot). --ranks N is the number of
rank processes, as in train_gpt.py; with --replicate R the mesh is R x N/R
(HSDP): each shard group reduce-scatters, then the replicas all-reduce. With --max-norm M the gradients are clipped to total norm M
(shardd.torch.clip_grad_norm_: the daemon's job-wide norm, its coefficient
applied by the daemon's step; torch.nn.utils.clip_grad_norm_ in the
reference). The reference trains the same model, from
the same initial values, in one process on the union of the ranks' batches.
Since every rank's loss is the mean over an equal-sized batch, the average of
the ranks' gradients is the gradient of the union's mean loss, so both runs
follow the same trajectory up to floating-point rounding.

Tolerance: the two runs differ only in the order of fp32 sums (a rank sums
its B samples then the daemon sums N partial results; the reference sums
N*B samples in one matmul). Each such gradient differs by a few ulps of its
terms (~1e-7 relative); over K SGD steps with momentum the parameter
difference stays below K * lr * (1 + momentum) * |grad| * 1e-6, i.e. well
under 1e-5 for this model (|w| < 1, |grad| < 1, K = 8). A wrong reduce (sum
instead of average, a stale shard, a missed rank) moves parameters by
lr * |grad| ~ 1e-2 in the first step, three orders of magnitude above it.
Clipping adds the difference of the clip coefficients: the daemon sums the
norm in fp64, torch in fp32, a few ulps (~1e-7 relative) of the update.

Each rank prints, per step, its wall time and its split into compute and
time blocked on shardd (every wait for a completion, Client._wait_one):
"rank R step N loss X time_us T compute_us C shardd_us S".

Checkpoints (docs/CHECKPOINTS.md; they need the daemon's optimizer and a
daemon with --state-dir, which --shardd gives its private daemon):
--checkpoint-every N makes every rank call shardd.torch.checkpoint(mesh)
after each step whose number (from 1) is a multiple of N; --resume makes
every fully_shard register from the job's newest checkpoint (restore=""):
the ranks print "rank R resume at step N" and train steps N to K - 1, with
the optimizer state (momentum) the checkpoint holds; without a checkpoint
they load the model's initial values and start at step 0. --restart-at T
(with --shardd) shows both in one run: the ranks train T steps, the daemon
is killed with SIGKILL, started again on the same --state-dir, and the ranks
resume from the newest checkpoint to step K; the parity check then compares
the resumed run with the uninterrupted reference.

usage: train_torch.py --socket PATH [--ranks N] [--replicate R] [--shard S] [--steps K]
                      [--reshard-after-forward]
                      [--torch-optim] [--max-norm M] [--checkpoint-every N] [--resume]
       train_torch.py --shardd BIN ... [--restart-at T]    start a private daemon
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

try:
    import shardd.torch as st
except ImportError:     # not installed: the checkout's client/python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import shardd.torch as st
import shardd.launch
from shard_check import save_shards, shard_diffs

IN, HIDDEN, OUT = 8, 33, 4
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4
ATOL = 1e-5
RANK_TIMEOUT_S = 120


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model():
    torch.manual_seed(0)
    return MLP()


def global_batch(step, ranks, batch):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ranks * batch, IN, generator=g)
    w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))
    return x, torch.sin(x @ w)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def make_daemon_optimizer(model):
    """The same SGD in the daemon; constructed over the model before fully_shard."""
    return st.DaemonSGD(model, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


class ShardWaitClock:
    """Time this process spends blocked on shardd completions: wraps the
    Python client's one waiting primitive, which every wait goes through."""

    def __init__(self):
        from shardd import client as sc
        self.ns = 0
        inner = sc.Client._wait_one

        def timed(client, *args, **kw):
            t0 = time.monotonic_ns()
            try:
                return inner(client, *args, **kw)
            finally:
                self.ns += time.monotonic_ns() - t0
        sc.Client._wait_one = timed


def run_rank(a):
    torch.set_num_threads(1)
    waits = ShardWaitClock()
    model = make_model()
    world = a.ranks
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = st.init_device_mesh(a.job, a.rank, (a.replicate, a.shard), socket_path=a.socket,
                               restore="" if a.resume else None)
    with mesh:
        opt = None if a.torch_optim else make_daemon_optimizer(model)
        raf = True if a.reshard_after_forward else None
        st.fully_shard(model.fc1, mesh=mesh, reshard_after_forward=raf)
        st.fully_shard(model.fc2, mesh=mesh, reshard_after_forward=raf)
        st.fully_shard(model, mesh=mesh)
        if opt is None:
            opt = make_optimizer(model.parameters())     # this rank's shards
        start = 0
        if a.resume:
            # The job's newest checkpoint (params and momentum), or none: then the initial values.
            start = opt.last_step
            if start == 0:
                st.load_full_state_dict(model, initial)
                os.write(1, f"rank {a.rank} start at step 0 (no checkpoint to resume from)\n".encode())
            else:
                os.write(1, f"rank {a.rank} resume at step {start}\n".encode())
        for step in range(start, a.steps):
            t0, w0 = time.monotonic_ns(), waits.ns
            x, y = global_batch(step, world, a.batch)
            lo, hi = a.rank * a.batch, (a.rank + 1) * a.batch
            loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
            loss.backward()          # reduces every group through the daemon
            if a.max_norm is not None:
                st.clip_grad_norm_(model, a.max_norm)    # the daemon's job-wide norm
            opt.step()               # this rank's shards: in the daemon, or here
            opt.zero_grad()
            if a.checkpoint_every and (step + 1) % a.checkpoint_every == 0:
                st.checkpoint(mesh)  # at the optimizer's step number, step + 1
            t, w = time.monotonic_ns() - t0, waits.ns - w0
            # One write per line: the ranks share stdout, and a short write is not interleaved.
            os.write(1, (f"rank {a.rank} step {step} loss {loss.item():.6f} time_us {t / 1e3:.1f} "
                         f"compute_us {(t - w) / 1e3:.1f} shardd_us {w / 1e3:.1f}\n").encode())
        save_shards(a.result, model)
    return 0


def reference(a):
    torch.set_num_threads(1)
    model = make_model()
    opt = make_optimizer(model.parameters())
    for step in range(a.steps):
        x, y = global_batch(step, a.ranks, a.batch)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if a.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_norm)
        opt.step()
    return {n: p.detach().numpy() for n, p in model.named_parameters()}


def start_daemon(binary, workdir, state):
    try:
        proc, sock = shardd.launch.start_private(binary, workdir, "--collective-timeout", "20",
                                                 "--state-dir", state)
    except shardd.launch.DaemonStartError as e:
        raise SystemExit(f"train_torch: shardd did not get ready: {e}") from None
    return proc, sock


def run_ranks(a, tmp, steps, resume):
    """Every rank process for `steps` steps; the ranks that failed."""
    procs = []
    for r in range(a.ranks):
        cmd = [sys.executable, os.path.abspath(__file__), "--socket", a.socket,
               "--ranks", str(a.ranks), "--replicate", str(a.replicate), "--shard", str(a.shard),
               "--steps", str(steps), "--batch", str(a.batch),
               "--job", a.job, "--rank", str(r), "--result", os.path.join(tmp, f"r{r}.npz")]
        if a.reshard_after_forward:
            cmd.append("--reshard-after-forward")
        if a.torch_optim:
            cmd.append("--torch-optim")
        if a.max_norm is not None:
            cmd += ["--max-norm", repr(a.max_norm)]
        if a.checkpoint_every:
            cmd += ["--checkpoint-every", str(a.checkpoint_every)]
        if resume:
            cmd.append("--resume")
        procs.append(subprocess.Popen(cmd))
    deadline = time.monotonic() + RANK_TIMEOUT_S
    failed = []
    for r, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait(timeout=10)
            print(f"train_torch: rank {r} ran past {RANK_TIMEOUT_S} s, killed", file=sys.stderr)
        if rc != 0:
            failed.append(r)
    if failed:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        print(f"train_torch: ranks {failed} failed", file=sys.stderr)
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=os.environ.get("SHARDD_SOCKET"))
    ap.add_argument("--shardd", help="start this daemon binary on a private socket")
    ap.add_argument("--ranks", type=int, default=2,
                    help="rank processes, replicate x shard, as in train_gpt.py (default 2)")
    ap.add_argument("--replicate", type=int, default=1, help="replicas: HSDP when > 1 (default 1)")
    ap.add_argument("--shard", type=int, help="shard group size (default ranks / replicate)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--job", default=f"train_torch-{os.getpid()}")
    ap.add_argument("--reshard-after-forward", action="store_true")
    ap.add_argument("--torch-optim", action="store_true",
                    help="update the shards with torch.optim.SGD in the ranks, not the daemon's step")
    ap.add_argument("--max-norm", type=float,
                    help="clip the gradients to this total 2-norm (shardd.torch.clip_grad_norm_)")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                    help="every rank checkpoints the job after each N-th step (the daemon needs "
                         "--state-dir)")
    ap.add_argument("--resume", action="store_true",
                    help="register from the job's newest checkpoint in the daemon's --state-dir")
    ap.add_argument("--restart-at", type=int, metavar="T",
                    help="with --shardd and --checkpoint-every: train T steps, kill the daemon "
                         "with SIGKILL, start it again and resume to --steps")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.shard = shardd.launch.mesh_shape(ap, a.ranks, a.replicate, a.shard)
    if a.torch_optim and (a.checkpoint_every or a.resume):
        ap.error("--checkpoint-every and --resume need the daemon's optimizer: drop --torch-optim")
    if a.restart_at is not None and not (a.shardd and a.checkpoint_every and
                                         0 < a.restart_at < a.steps):
        ap.error("--restart-at T needs --shardd BIN, --checkpoint-every N and 0 < T < --steps")
    if a.rank is not None:
        return run_rank(a)

    daemon = None
    with tempfile.TemporaryDirectory(prefix="train_torch-") as tmp:
        try:
            if a.shardd:
                daemon, a.socket = start_daemon(a.shardd, tmp, os.path.join(tmp, "state"))
            if not a.socket:
                ap.error("give --socket PATH (or SHARDD_SOCKET) or --shardd BIN")
            if a.restart_at is not None:
                if run_ranks(a, tmp, a.restart_at, resume=True):
                    return 1
                print(f"train_torch: killing shardd (pid {daemon.pid}) with SIGKILL after step "
                      f"{a.restart_at - 1}, starting it again on the same --state-dir", flush=True)
                daemon.send_signal(signal.SIGKILL)
                daemon.wait(timeout=10)
                # The same work directory: the new daemon takes over the killed one's socket.
                daemon, a.socket = start_daemon(a.shardd, tmp, os.path.join(tmp, "state"))
                a.resume = True
            if run_ranks(a, tmp, a.steps, a.resume):
                return 1
            ref = reference(a)
            worst = 0.0
            for r in range(a.ranks):
                got = np.load(os.path.join(tmp, f"r{r}.npz"))
                assert len(got.files) == len(ref)
                for n, d in shard_diffs(got, ref):
                    worst = max(worst, d)
                    if d > ATOL:
                        print(f"train_torch: rank {r} param {n}: max |shardd - reference| = "
                              f"{d:.3g} > {ATOL:g}", file=sys.stderr)
                        return 1
            moved = max(float(np.max(np.abs(w - v.detach().numpy())))
                        for (n, w), (_m, v) in zip(ref.items(), make_model().named_parameters()))
            print(f"train_torch: {a.replicate}x{a.shard} ranks x {a.steps} steps "
                  f"({'torch.optim' if a.torch_optim else 'daemon'} SGD"
                  f"{'' if a.max_norm is None else f', clipped to {a.max_norm:g}'}"
                  f"{'' if a.restart_at is None else f', daemon restarted after step {a.restart_at - 1}'}"
                  f") match the "
                  f"single-process "
                  f"reference: max |diff| = {worst:.3g} (tolerance {ATOL:g}; params moved "
                  f"{moved:.3g})")
            return 0
        finally:
            if daemon is not None:
                shardd.launch.stop(daemon)


if __name__ == "__main__":
    sys.exit(main())

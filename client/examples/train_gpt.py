#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train a small GPT (a decoder-only transformer) with N rank processes
through shardd, on the King James Bible, byte by byte.

The model: byte embeddings (256 tokens) plus learned position embeddings, L
pre-norm blocks (layer norm, causal multi-head self-attention, layer norm,
4x GELU MLP, residuals), a final layer norm and a linear head; the default
(6 blocks of width 384, context 64) has 10.9 M parameters. Each rank
applies shardd.torch.fully_shard to every block and then to the model
(FSDP2's recipe), with MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32) by default: forward and backward compute in bf16 from
unsharded bf16 copies, the daemon reduces (averages) the gradients in fp32
into the fp32 master shards, and a stock torch.optim.AdamW updates the
shards. With --replicate R the mesh is R x S (HSDP): each shard group
reduce-scatters, then the replicas all-reduce.

The corpus is the text of Debian's bible-kjv-text package, decoded by its
`bible` program (package bible-kjv; `make deps` installs both: the package's
data file is compressed); --text FILE trains on any other file. Every step
draws a global batch of ranks x batch windows at seeded random offsets; rank
r trains on rows [r*batch, (r+1)*batch). The launcher prints the mean of the
ranks' losses each step and the slowest rank's time.

--check (fp32 only) trains the same model in one process on the union of the
ranks' batches and compares the final parameters. Every rank's loss is the
mean over an equal number of tokens, so the average of the ranks' gradients
is the gradient of the union's mean loss and both runs follow the same
trajectory up to the order of fp32 sums: a gradient differs by a few ulps of
the terms it sums (~1e-7 of them). AdamW divides each step by sqrt(v) + eps,
so a component whose gradient nearly cancels (small against its terms) gets
a relative error far above 1e-7 on an update of up to lr: measured, the
parameters differ by 1e-6 after 5 steps and 3e-6 after 20 (lr 2e-3, the
tiny configuration of tests/python/test_train_gpt.py, 1 x 2 and 2 x 2
ranks), against the tolerance 1e-5 used here (lr / 200 at the default lr). A missed rank or a
stale shard changes updates by ~lr at the first step. (Adam is blind to a
uniform gradient scale, so sum-versus-average is checked by the SGD
examples and suites, train_torch.py and tests/python/test_torch*.py.)

--device cuda trains on GPUs against a `shardd --backend cuda` daemon
(--shardd starts one so): rank r computes on GPU r mod the visible GPUs
(several ranks share one GPU when there are fewer), its params are CUDA
tensors over the daemon's device buffers and every op is ordered on the
rank's current CUDA stream (docs/CUDA.md, "Python on the GPU"); --check
then runs the reference on GPU 0. Each step's time is taken after a
torch.cuda.synchronize().

Watching it: the launcher prints the daemon's socket; in another terminal
`build/shardctl --socket SOCKET watch` shows the job's ranks, their last op
and the per-op latencies while it trains.

Checkpoint and resume through the daemon wait for issue #14 (the daemon's
checkpoints); this example has no checkpoint or resume option yet.
"""

import argparse
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

try:
    import shardd.torch as st
except ImportError:     # not installed: the checkout's client/python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import shardd.torch as st
import shardd.launch
from shardd.launch import stop
from shard_check import save_shards, shard_diffs

VOCAB = 256                  # byte-level tokens
BIBLE_RANGE = "gen1:1-rev22:21"
CHECK_ATOL = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- the model
class Attention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        sdpa = getattr(F, "scaled_dot_product_attention", None)
        if sdpa is not None:
            y = sdpa(q, k, v, is_causal=True)
        else:   # torch < 2.0
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 4 * dim)
        self.out = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, layers, dim, heads, context):
        super().__init__()
        if dim % heads:
            raise ValueError(f"--dim {dim} is not a multiple of --heads {heads}")
        self.tok = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif p.dim() > 1:
                # GPT-2's init: N(0, 0.02), residual projections scaled by depth.
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) \
                    else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(a):
    torch.manual_seed(a.seed)
    return GPT(a.layers, a.dim, a.heads, a.context)


def rank_device(a, rank):
    """--device cuda: rank `rank`'s GPU (round-robin over the visible ones); None: the CPU."""
    if a.device != "cuda":
        return None
    if not torch.cuda.is_available():
        raise SystemExit("train_gpt: --device cuda, but torch sees no CUDA device "
                         "(torch.cuda.is_available() is False)")
    return torch.device("cuda", rank % torch.cuda.device_count())


def sync(device):
    """Wait for the GPU's work, so that a step's time counts it."""
    if device is not None:
        torch.cuda.synchronize(device)


def make_optimizer(a, params):
    return torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)


def loss_of(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


# ---------------------------------------------------------------- the data
def load_corpus(path=None):
    """The corpus as a uint8 tensor: `path`'s bytes, or the King James Bible
    printed by the `bible` program of Debian's bible-kjv."""
    if path:
        with open(path, "rb") as f:
            data = f.read()
        where = path
    else:
        exe = shutil.which("bible")
        if exe is None:
            raise SystemExit("train_gpt: no `bible` program: install the Debian packages bible-kjv "
                             "and bible-kjv-text (make deps), or give --text FILE")
        p = subprocess.run([exe, BIBLE_RANGE], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=60)
        if p.returncode != 0:
            raise SystemExit(f"train_gpt: `{exe} {BIBLE_RANGE}` exited with {p.returncode}: "
                             f"{p.stderr.decode(errors='replace').strip()} (is bible-kjv-text "
                             f"installed? make deps)")
        data, where = p.stdout, f"{exe} {BIBLE_RANGE}"
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), where


def global_batch(a, data, step, world):
    """Step `step`'s batch of world x batch windows (inputs, next-byte targets)."""
    g = torch.Generator().manual_seed(a.seed * 1000003 + step)
    starts = torch.randint(0, data.numel() - a.context - 1, (world * a.batch,), generator=g)
    rows = torch.stack([data[s:s + a.context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------- one rank
def run_rank(a):
    torch.set_num_threads(a.threads)
    data, _ = load_corpus(a.text)
    world = a.replicate * a.shard
    dev = rank_device(a, a.rank)
    if dev is not None:
        torch.cuda.set_device(dev)
    model = make_model(a).to(dev or "cpu")
    pd = DTYPES[a.param_dtype]
    mp = st.MixedPrecisionPolicy(param_dtype=None if pd == torch.float32 else pd,
                                 reduce_dtype=DTYPES[a.reduce_dtype])
    root_mp = st.MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                      output_dtype=torch.float32)
    with st.init_device_mesh(a.job, a.rank, (a.replicate, a.shard), socket_path=a.socket,
                             device=dev) as mesh:
        for block in model.blocks:
            st.fully_shard(block, mesh=mesh, mp_policy=mp)
        st.fully_shard(model, mesh=mesh, mp_policy=root_mp)
        opt = make_optimizer(a, model.parameters())     # this rank's shards
        lo, hi = a.rank * a.batch, (a.rank + 1) * a.batch
        for step in range(a.steps):
            x, y = global_batch(a, data, step, world)
            x, y = x[lo:hi].to(dev or "cpu"), y[lo:hi].to(dev or "cpu")
            sync(dev)
            t0 = time.perf_counter()
            loss = loss_of(model(x), y)
            loss.backward()          # unshard, reduce, reshard: the daemon
            opt.step()
            opt.zero_grad()
            sync(dev)
            ms = (time.perf_counter() - t0) * 1e3
            print(json.dumps({"step": step, "loss": loss.item(), "ms": ms}), flush=True)
        if a.result:
            save_shards(a.result, model)
    return 0


def reference(a, data):
    """The same training in one process on the union of the ranks' batches."""
    torch.set_num_threads(a.threads)
    dev = rank_device(a, 0) or torch.device("cpu")
    model = make_model(a).to(dev)
    opt = make_optimizer(a, model.parameters())
    losses = []
    for step in range(a.steps):
        x, y = global_batch(a, data, step, a.ranks)
        loss = loss_of(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}, losses


# ---------------------------------------------------------------- the launcher
def start_daemon(binary, workdir, device):
    backend = ("--backend", "cuda") if device == "cuda" else ()
    try:
        proc, sock = shardd.launch.start_private(binary, workdir, "--collective-timeout", "60",
                                                 *backend)
    except shardd.launch.DaemonStartError as e:
        raise SystemExit(f"train_gpt: {e}") from None
    # Keep draining its stderr so the daemon never blocks on a full pipe.
    threading.Thread(target=lambda: [sys.stderr.write(f"shardd: {line.decode(errors='replace')}")
                                     for line in proc.stderr], daemon=True).start()
    return proc, sock


def read_rank(r, stream, q):
    for line in stream:
        q.put((r, line))
    q.put((r, None))


def launch(a, tmp):
    data, where = load_corpus(a.text)
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "wb") as f:
        f.write(data.numpy().tobytes())
    nparams = sum(p.numel() for p in make_model(a).parameters())
    print(f"train_gpt: {nparams / 1e6:.2f} M params ({a.layers} blocks, dim {a.dim}, "
          f"{a.heads} heads, context {a.context}); corpus {data.numel()} bytes from {where}; "
          f"{a.replicate} x {a.shard} ranks, batch {a.batch} per rank; params {a.param_dtype}, "
          f"reduce {a.reduce_dtype}; on {a.device}")
    print(f"train_gpt: job '{a.job}' on {a.socket}; watch it: "
          f"shardctl --socket {a.socket} watch", flush=True)
    q = queue.Queue()
    procs = []
    for r in range(a.ranks):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(r), "--text", corpus,
               "--result", os.path.join(tmp, f"r{r}.npz")]
        for k in ("socket", "job", "ranks", "replicate", "shard", "steps", "batch", "layers",
                  "dim", "heads", "context", "lr", "seed", "threads", "param_dtype",
                  "reduce_dtype", "device"):
            cmd += ["--" + k.replace("_", "-"), str(getattr(a, k))]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        threading.Thread(target=read_rank, args=(r, p.stdout, q), daemon=True).start()
        procs.append(p)
    try:
        losses = follow(a, procs, q)
        if losses is None:
            return 1
        first, last = losses[0], losses[-1]
        print(f"train_gpt: loss {first:.4f} -> {last:.4f} over {a.steps} steps "
              f"({(first - last) / first * 100:.0f}% lower)")
        if a.check:
            return check(a, data, tmp, losses)
        return 0
    finally:
        for p in procs:
            stop(p)


def follow(a, procs, q):
    """Print each step once every rank reported it; None when a rank failed
    or went silent for --rank-timeout seconds (naming it)."""
    reports = {}
    count = [0] * a.ranks       # steps each rank reported
    losses = []
    step = 0
    while step < a.steps:
        try:
            r, line = q.get(timeout=a.rank_timeout)
        except queue.Empty:
            missing = sorted(set(range(a.ranks)) - set(reports.get(step, {})))
            print(f"train_gpt: ranks {missing} reported no step {step + 1} within "
                  f"{a.rank_timeout:g} s (--rank-timeout); `shardctl --socket {a.socket} ranks "
                  f"{a.job}` shows where they wait", file=sys.stderr)
            return None
        if line is None:
            if count[r] == a.steps:
                continue        # done; its exit status is checked below
            rc = procs[r].wait(timeout=30)
            print(f"train_gpt: rank {r} exited with status {rc} after {count[r]} of {a.steps} "
                  f"steps", file=sys.stderr)
            return None
        try:
            rep = json.loads(line)
        except ValueError:
            print(f"rank {r}: {line}", end="")
            continue
        reports.setdefault(rep["step"], {})[r] = rep
        count[r] += 1
        while len(reports.get(step, {})) == a.ranks:
            reps = reports.pop(step)
            loss = sum(rep["loss"] for rep in reps.values()) / a.ranks
            ms = max(rep["ms"] for rep in reps.values())
            losses.append(loss)
            print(f"step {step + 1:4d}/{a.steps}  loss {loss:.4f}  {ms:8.1f} ms (slowest rank)",
                  flush=True)
            step += 1
    for r, p in enumerate(procs):
        try:
            rc = p.wait(timeout=a.rank_timeout)
        except subprocess.TimeoutExpired:
            print(f"train_gpt: rank {r} did not exit within {a.rank_timeout} s after its last "
                  f"step", file=sys.stderr)
            return None
        if rc != 0:
            print(f"train_gpt: rank {r} exited with status {rc}", file=sys.stderr)
            return None
    return losses


def check(a, data, tmp, losses):
    ref, ref_losses = reference(a, data)
    worst = 0.0
    for r in range(a.ranks):
        got = np.load(os.path.join(tmp, f"r{r}.npz"))
        if len(got.files) != len(ref):
            print(f"train_gpt: rank {r} holds {len(got.files)} params, the reference "
                  f"{len(ref)}", file=sys.stderr)
            return 1
        for n, d in shard_diffs(got, ref):
            worst = max(worst, d)
            if d > CHECK_ATOL:
                print(f"train_gpt: rank {r} param {n}: max |shardd - reference| = {d:.3g} > "
                      f"{CHECK_ATOL:g}", file=sys.stderr)
                return 1
    moved = max(float(np.max(np.abs(w - v.detach().numpy())))
                for (_n, w), (_m, v) in zip(ref.items(), make_model(a).named_parameters()))
    dloss = max(abs(x - y) for x, y in zip(losses, ref_losses))
    print(f"train_gpt: {a.replicate}x{a.shard} ranks x {a.steps} steps match the single-process "
          f"reference: max |param diff| = {worst:.3g} (tolerance {CHECK_ATOL:g}; params moved "
          f"{moved:.3g}), max |loss diff| = {dloss:.3g}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Checkpoint and resume through the daemon wait for issue #14; there is no "
               "--resume yet. Watch a run with `shardctl --socket SOCKET watch` (the launcher "
               "prints the socket).")
    ap.add_argument("--socket", default=os.environ.get("SHARDD_SOCKET"),
                    help="a running shardd's socket (default $SHARDD_SOCKET)")
    ap.add_argument("--shardd", metavar="BIN", help="start this shardd binary on a private socket")
    ap.add_argument("--ranks", type=int, default=2, help="rank processes, replicate x shard, "
                    "as in train_torch.py (default 2)")
    ap.add_argument("--replicate", type=int, default=1, help="replicas: HSDP when > 1 (default 1)")
    ap.add_argument("--shard", type=int, help="shard group size (default ranks / replicate)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    ap.add_argument("--batch", type=int, default=2, help="windows per rank and step (default 2)")
    ap.add_argument("--context", type=int, default=64, help="window length in bytes (default 64)")
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    ap.add_argument("--dim", type=int, default=384, help="model width (default 384)")
    ap.add_argument("--heads", type=int, default=6, help="attention heads (default 6)")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    ap.add_argument("--seed", type=int, default=0, help="init and batch seed (default 0)")
    ap.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16",
                    help="compute dtype of the unsharded params (default bf16)")
    ap.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32",
                    help="gradient reduction dtype (default fp32)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the ranks compute: cpu (a host daemon) or cuda (a shardd "
                         "--backend cuda; rank r on GPU r mod the GPUs) (default cpu)")
    ap.add_argument("--text", metavar="FILE", help="train on FILE's bytes instead of the Bible")
    ap.add_argument("--job", default=f"train_gpt-{os.getpid()}", help="shardd job name")
    ap.add_argument("--check", action="store_true", help="compare the final params with a "
                    "single-process run (needs --param-dtype fp32 --reduce-dtype fp32)")
    ap.add_argument("--rank-timeout", type=float, default=600.0,
                    help="seconds a rank may go without finishing a step (default 600)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.shard = shardd.launch.mesh_shape(ap, a.ranks, a.replicate, a.shard)
    if a.check and (a.param_dtype != "fp32" or a.reduce_dtype != "fp32"):
        ap.error("--check compares with an fp32 single-process run: give --param-dtype fp32 "
                 "--reduce-dtype fp32")
    for k in ("steps", "batch", "context", "layers", "dim", "heads", "threads"):
        if getattr(a, k) < 1:
            ap.error(f"--{k} {getattr(a, k)}: must be >= 1")
    return ap, a


def main():
    ap, a = parse_args()
    if a.rank is not None:
        return run_rank(a)
    # SIGTERM stops the ranks and the private daemon as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    daemon = None
    with tempfile.TemporaryDirectory(prefix="train_gpt-") as tmp:
        try:
            if a.shardd:
                daemon, a.socket = start_daemon(a.shardd, tmp, a.device)
            if not a.socket:
                ap.error("give --socket PATH (or SHARDD_SOCKET) or --shardd BIN")
            return launch(a, tmp)
        finally:
            if daemon is not None:
                stop(daemon)


if __name__ == "__main__":
    sys.exit(main())

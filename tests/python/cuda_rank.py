# SPDX-License-Identifier: MIT
"""One rank process of the GPU suites (test_torch_cuda.py), started as a
fresh interpreter (a forked child must not inherit a CUDA context).

    cuda_rank.py train  SOCKET JOB RANK WORLD DEVICE OUT [options]
    cuda_rank.py fences SOCKET JOB RANK WORLD DEVICE OUT

train: torch_net's Net through shardd.torch on DEVICE (init_device_mesh
device=), STEPS steps of --opt on the rank's rows of torch_net.batches,
clip_grad_norm_ with --clip; writes OUT (npz): the rank's shards
('shard:<name>'), the first step's sharded grads ('grad:<name>'), the
full state dict ('full:<name>', collective) and the losses. --kill-after
K SIGKILLs the process after step K; --resume re-attaches and recovers
(DaemonOptimizer.recover), as a survivor does when a peer died;
--checkpoint saves the daemon's checkpoint at the end, --restore DIR
starts from one.

fences: the stream-ordering check of the Python client (Client.set_stream)
with raw groups: each rank delays its stream, writes its shard (then its
grad) on it, submits unshard (reduce) without any CPU wait, and copies the
result back on the same stream; OUT holds what it read."""

import os
import signal
import sys

import numpy as np
import torch

import shardd
import shardd.torch as st
import torch_net

BATCH = 4
FINAL_BARRIER = 9
SLEEP_CYCLES = 200_000_000       # torch.cuda._sleep: ~0.1 s of a spinning kernel on a 2 GHz GPU
FENCE_N = 1 << 20


def cpu(t):
    return t.detach().float().cpu().numpy().copy()


def make_opt(kind, model):
    if kind == "sgd":
        return st.DaemonSGD(model, lr=0.1, momentum=0.9, weight_decay=0.01)
    if kind == "adamw":
        return st.DaemonAdamW(model, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    return None


def train(sock, job, rank, world, device, out, opts):
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = torch_net.make_net().to(dev)
    opt = make_opt(opts["opt"], model)
    pd = {"fp32": None, "bf16": torch.bfloat16}[opts["param_dtype"]]
    mp = st.MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=torch.float32 if pd else None)
    resume = opts["resume"]
    data = torch_net.batches(world, BATCH, opts["steps"])
    saved = {}
    with st.init_device_mesh(job, rank, (world,), socket_path=sock, device=dev,
                             resume=resume, restore=opts["restore"]) as mesh:
        st.fully_shard(model.fc1, mesh=mesh, mp_policy=mp)
        st.fully_shard(model, mesh=mesh, mp_policy=mp)
        if opt is None:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        assert all(p.is_cuda and p.device == dev for p in model.parameters())
        t = opt.recover() if resume else 0
        losses = []
        while True:
            try:
                if t < opts["steps"]:
                    x, y = data[t]
                    x = x[rank * BATCH:(rank + 1) * BATCH].to(dev)
                    y = y[rank * BATCH:(rank + 1) * BATCH].to(dev)
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                    loss.backward()
                    if t == 0 and not resume:
                        saved.update({f"grad:{n}": cpu(p.grad) for n, p in model.named_parameters()})
                    if opts["clip"]:
                        st.clip_grad_norm_(model, opts["clip"])
                    opt.step()
                    opt.zero_grad()
                    losses.append(float(loss))
                    t += 1
                    if t == opts["kill_after"]:
                        torch.cuda.synchronize()
                        os.kill(os.getpid(), signal.SIGKILL)
                    continue
                mesh.barrier(FINAL_BARRIER)
                break
            except shardd.ShardError as e:
                if not st.peer_failed(e):
                    raise
                t = opt.recover()
        saved.update({f"shard:{n}": cpu(s) for n, s, _d, _f in st.local_shards(model)})
        saved.update({f"first:{n}": np.int64(f) for n, _s, _d, f in st.local_shards(model)})
        if pd is None:
            saved.update({f"full:{n}": cpu(v) for n, v in st.full_state_dict(model).items()})
        if opts["checkpoint"]:
            saved["checkpoint_step"] = np.int64(st.checkpoint(mesh))
    np.savez(out, losses=np.array(losses), **saved)


def fences(sock, job, rank, world, device, out):
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    n = FENCE_N
    with shardd.Client(job, rank, world, socket_path=sock, device=dev.index) as c:
        g = c.register_group("g", [("w", "fp32", (n,))])
        stream = torch.cuda.current_stream()
        c.set_stream(stream)
        rows = torch.arange(n, dtype=torch.float32, device=dev)
        begin, valid = g.shard_rows("w")
        got = {}
        for step in range(3):
            # The writes wait behind the delay on the stream; the unshard must wait for them.
            torch.cuda._sleep(SLEEP_CYCLES)
            g.shard("w").copy_(rows[begin:begin + valid] * (step + 1))
            g.unshard(step)
            got[f"unshard{step}"] = g.unsharded("w").clone()
            g.reshard(step)
            torch.cuda._sleep(SLEEP_CYCLES)
            g.grad("w").copy_(rows * (rank + 1) * (step + 1))
            g.reduce(step)
            got[f"reduce{step}"] = g.shard_grad("w").clone()
            g.zero_grad()
        torch.cuda.synchronize()
        np.savez(out, begin=begin, valid=valid, **{k: cpu(v) for k, v in got.items()})
        g.close()


def main(argv):
    mode, sock, job, rank, world, device, out = argv[:7]
    rank, world = int(rank), int(world)
    if mode == "fences":
        return fences(sock, job, rank, world, device, out)
    opts = {"opt": "sgd", "param_dtype": "fp32", "steps": 4, "clip": 0.0, "kill_after": -1,
            "resume": False, "checkpoint": False, "restore": None}
    rest = argv[7:]
    while rest:
        k = rest.pop(0)
        if k in ("--resume", "--checkpoint"):
            opts[k[2:]] = True
            continue
        key = k[2:].replace("-", "_")
        opts[key] = rest.pop(0) if key == "restore" else type(opts[key])(rest.pop(0))
    return train(sock, job, rank, world, device, out, opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

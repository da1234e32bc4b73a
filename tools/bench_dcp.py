#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""torch.distributed.checkpoint (DCP) saving and loading the state that
`shardbench checkpoint` saves through the daemon: an fp32 param of
ROWS x 1024 and AdamW's exp_avg and exp_avg_sq of the same shape, each a
DTensor sharded on dim 0 over N gloo ranks (CPU processes), written with
the default FileSystemWriter to a directory under --dir.

save: the slowest rank's time from a barrier to the end of dcp.save plus
fsyncs of the checkpoint directory and its parent by rank 0. DCP itself
fsyncs every data file and its .metadata.tmp (sync_files=True, the
default) and renames that to .metadata, but fsyncs no directory, so
without the extra fsyncs the files' names would not be durable; shardd
fsyncs its files and directories.

load: the slowest rank's dcp.load into tensors allocated beforehand,
after the files left the page cache (POSIX_FADV_DONTNEED). Both: the fastest of --iters after --warmup. wrong: loaded param elements
that differ from what was saved.

Prints one line per size, `dcp ASKED BYTES SAVE_NS LOAD_NS WRONG` (ASKED: the
size given, BYTES: the state's bytes, whole rows), after a line
`torch VERSION`; or `unavailable REASON` when torch is missing or older
than 2.4 (no DTensor DCP save/load of CPU shards over gloo).

usage: tools/bench_dcp.py --ranks N --dir DIR [--warmup 1] [--iters 5] BYTES...
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

LIMIT_S = 1800  # the ranks are killed after this
COLS = 1024  # fp32 elements per row, as in tools/shardbench/checkpoint.c
NAMES = ("w", "w.exp_avg", "w.exp_avg_sq")


def torch_or_reason():
    try:
        import torch
    except ImportError as e:
        return None, f"{sys.executable} has no torch ({e})"
    ver = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if ver < (2, 4):
        return None, (f"torch {torch.__version__} at {sys.executable} is older than 2.4 (DCP of "
                      f"DTensor shards); pass a newer torch's python (docs/TORCH.md, 'Side by side with FSDP2')")
    try:
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as e:
        return None, f"torch {torch.__version__}: no torch.distributed.checkpoint/DTensor ({e})"
    return torch, None


def drop_cache(path):
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker(rank, world, init, a, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for nbytes in a.bytes:
        rows = max(1, nbytes // 3 // (COLS * 4))
        chunk = -(-rows // world)  # torch.chunk's dim-0 split: ceil(rows / world) per rank
        begin, end = min(rows, rank * chunk), min(rows, (rank + 1) * chunk)
        first = begin * COLS
        src = {}
        for k, name in enumerate(NAMES):
            local = (torch.arange(first, end * COLS, dtype=torch.float64) * 1e-3 + k).float()
            src[name] = DTensor.from_local(local.view(end - begin, COLS), mesh, [Shard(0)], run_check=False,
                                           shape=torch.Size((rows, COLS)), stride=(COLS, 1))
        dst = {n: DTensor.from_local(torch.zeros(end - begin, COLS), mesh, [Shard(0)], run_check=False,
                                     shape=torch.Size((rows, COLS)), stride=(COLS, 1)) for n in NAMES}
        best_save = best_load = None
        wrong = 0
        for it in range(a.warmup + a.iters):
            path = os.path.join(a.dir, f"dcp-{nbytes}-{it}")
            dist.barrier()
            t0 = time.perf_counter_ns()
            dcp.save(src, checkpoint_id=path)
            if rank == 0:
                fsync_dir(path)
                fsync_dir(a.dir)
            dist.barrier()
            t_save = time.perf_counter_ns() - t0
            if rank == 0:
                drop_cache(path)
            dist.barrier()
            t0 = time.perf_counter_ns()
            dcp.load(dst, checkpoint_id=path)
            dist.barrier()
            t_load = time.perf_counter_ns() - t0
            wrong = sum(int((dst[n].to_local() != src[n].to_local()).sum()) for n in NAMES[:1])
            for n in NAMES:
                dst[n].to_local().zero_()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
            if it >= a.warmup:
                best_save = t_save if best_save is None else min(best_save, t_save)
                best_load = t_load if best_load is None else min(best_load, t_load)
        # Every rank's best; the row takes the slowest rank's (the job is done when it is).
        t = torch.tensor([best_save, best_load, wrong], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put((nbytes, 3 * rows * COLS * 4, int(t[0]), int(t[1]), int(t[2])))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("bytes", type=int, nargs="+", help="state sizes in bytes (param + exp_avg + exp_avg_sq)")
    a = ap.parse_args()
    torch, why = torch_or_reason()
    if torch is None:
        print("unavailable", why, flush=True)
        return 0
    print("torch", torch.__version__, flush=True)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-dcp.", dir=a.dir) as tmp:
        a.dir = tmp
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=worker, args=(r, a.ranks, init, a, out)) for r in range(a.ranks)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + LIMIT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        bad = [f"rank {r} exit {p.exitcode}" if p.exitcode is not None
               else f"rank {r} still running after {LIMIT_S} s, killed"
               for r, p in enumerate(procs) if p.exitcode != 0]
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
        while not out.empty():
            asked, nbytes, save_ns, load_ns, wrong = out.get()
            print("dcp", asked, nbytes, save_ns, load_ns, wrong, flush=True)
        if bad:
            print("unavailable", "a DCP rank failed:", ", ".join(bad), flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: MIT
"""One rank of the C/Python interop job, with the Python client: the same
sequence as client/examples/interop_rank.c (read its header comment).

usage: interop_py_rank.py SOCKET JOB RANK WORLD STEPS OUTDIR
"""

import os
import sys

import numpy as np

import shardd

PARAMS = [("w", "fp32", (5, 3)), ("b", "fp32", (7,))]


def init_value(k, n):
    i = np.arange(n)
    if k == 0:
        return ((i % 13) - 6).astype(np.float32) * np.float32(0.5)
    return ((i * 3) % 11).astype(np.float32) * np.float32(0.25) - np.float32(1.0)


def grad_value(rank, step, n):
    i = np.arange(n)
    return ((rank + 1) * ((i % 7) - 3) + step).astype(np.float32) * np.float32(0.125)


def main():
    sock, job, rank, world, steps, outdir = sys.argv[1:7]
    rank, world, steps = int(rank), int(world), int(steps)
    with shardd.Client(job=job, rank=rank, shard=world, socket_path=sock) as c:
        g = c.register_group("interop", PARAMS)
        # The daemon picked the executor (exec auto, as the C ranks register): the test checks it.
        print("exec", shardd.proto.EXEC_NAMES[g.exec], flush=True)
        for k, (_n, _d, shape) in enumerate(PARAMS):
            g.load_full(k, init_value(k, int(np.prod(shape))).reshape(shape))
        for s in range(steps):
            with open(os.path.join(outdir, f"r{rank}_s{s}.bin"), "wb") as f:
                g.unshard(s)
                for k, (_n, _d, shape) in enumerate(PARAMS):
                    f.write(g.unsharded(k).tobytes())
                    g.grad(k)[...] = grad_value(rank, s, int(np.prod(shape))).reshape(shape)
                g.reduce(s)
                for k, (_n, _d, shape) in enumerate(PARAMS):
                    sg = g.shard_grad(k)
                    f.write(sg.tobytes())
                    sh = g.shard(k)
                    sh -= np.float32(0.5) * sg
                g.reshard(s)
                g.zero_grad()
        g.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: MIT
"""One job, ranks from both clients: C ranks (client/examples/interop_rank.c,
libshardd) and Python ranks (interop_py_rank.py) run the same sequence; every
rank's dumps of unshard and reduce results are checked against numpy. The
job runs daemon-executed, and rank-executed (a daemon with --rank-exec-max:
each client runs its own rank's side of every op)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, Daemon, job_name, shardd_build
from reference import shard_rows

SHAPES = [(5, 3), (7,)]
STEPS = 3
PY_RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interop_py_rank.py")


def init_full(k):
    n = int(np.prod(SHAPES[k]))
    i = np.arange(n)
    if k == 0:
        v = ((i % 13) - 6).astype(np.float32) * np.float32(0.5)
    else:
        v = ((i * 3) % 11).astype(np.float32) * np.float32(0.25) - np.float32(1)
    return v.reshape(SHAPES[k])


def grad_full(k, rank, step):
    i = np.arange(int(np.prod(SHAPES[k])))
    g = ((rank + 1) * ((i % 7) - 3) + step).astype(np.float32) * np.float32(0.125)
    return g.reshape(SHAPES[k])


@pytest.fixture(scope="module")
def ranks_daemon():
    """A shardd that runs groups up to 4 MiB rank-executed (exec auto)."""
    with Daemon(("--rank-exec-max", "4M")) as d:
        yield d


@pytest.mark.timeout_s(90)
@pytest.mark.parametrize("executor", ["daemon", "ranks"])
@pytest.mark.parametrize("languages", ["CPC", "PCP"])
def test_c_and_python_ranks_share_one_job(daemon, ranks_daemon, request, tmp_path, languages,
                                          executor):
    if executor == "ranks":
        daemon = ranks_daemon
    binary = os.path.join(shardd_build(), "examples", "interop_rank")
    assert os.access(binary, os.X_OK), f"{binary} missing: build it with make"
    world = len(languages)
    job = job_name(request)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    procs = []
    for r, lang in enumerate(languages):
        args = [daemon.socket, job, str(r), str(world), str(STEPS), str(tmp_path)]
        cmd = [binary, *args] if lang == "C" else [sys.executable, PY_RANK, *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate(timeout=10)
        outs.append(out)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} ({languages[r]}) failed:\n{outs[r]}"
        if languages[r] == "P" and executor == "ranks":
            assert "exec ranks" in outs[r].splitlines(), outs[r]

    full = [init_full(k) for k in range(len(SHAPES))]
    for s in range(STEPS):
        avg = []
        for k in range(len(SHAPES)):
            total = np.zeros(SHAPES[k], np.float32)
            for r in range(world):
                total = total + grad_full(k, r, s)
            avg.append(total / np.float32(world))
        for r in range(world):
            data = np.fromfile(tmp_path / f"r{r}_s{s}.bin", dtype=np.float32)
            pos = 0
            for k, shape in enumerate(SHAPES):
                n = int(np.prod(shape))
                np.testing.assert_array_equal(data[pos:pos + n].reshape(shape), full[k],
                                              err_msg=f"unsharded param {k}, rank {r} "
                                                      f"({languages[r]}), step {s}")
                pos += n
            for k, shape in enumerate(SHAPES):
                begin, valid, _rows = shard_rows(shape[0], world, r)
                inner = n = int(np.prod(shape[1:]))
                got = data[pos:pos + valid * inner].reshape((valid,) + tuple(shape[1:]))
                np.testing.assert_array_equal(got, avg[k][begin:begin + valid],
                                              err_msg=f"sharded grad param {k}, rank {r} "
                                                      f"({languages[r]}), step {s}")
                pos += valid * inner
            assert pos == data.size
        full = [f - np.float32(0.5) * a for f, a in zip(full, avg)]

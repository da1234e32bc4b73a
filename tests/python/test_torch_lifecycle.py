# SPDX-License-Identifier: MIT
"""A shardd.torch script's job lives as long as its process (issue 29,
item 5): a process that ends without mesh.close(), normally or by an
uncaught exception, says goodbye for its ranks at exit, so the daemon holds
no job afterwards and the same script run again starts fresh. A process
ended by os._exit says no goodbye: its job lingers, and a rerun is told
exactly that and to end it with `shardctl end JOB`, which lets the rerun
in (as does the refused rerun's own goodbye at its exit, every rank of the
job having said it)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, job_name, run_shardctl, shardctl_json

SCRIPT = """
import os, sys, torch
import shardd.torch as st
job, sock, how = sys.argv[1:4]
meshes = [st.init_device_mesh(job, r, (1, 2), socket_path=sock) for r in range(2)]
models = [torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)) for _ in range(2)]
errors = []
def shard(r):
    try:
        st.fully_shard(models[r], mesh=meshes[r])
    except Exception as e:
        errors.append(e)
import threading
ts = [threading.Thread(target=shard, args=(r,)) for r in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
if errors:
    raise errors[0]
print("registered", flush=True)
if how == "raise":
    raise RuntimeError("the script fails after registering")
if how == "exit":
    os._exit(0)
"""


def run(job, sock, how):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    return subprocess.run([sys.executable, "-c", SCRIPT, job, sock, how], env=env,
                          capture_output=True, text=True, timeout=60)


def jobs(sock):
    return [j["name"] for j in shardctl_json(sock, "jobs")["jobs"]]


@pytest.mark.parametrize("how", ["return", "raise"])
def test_script_that_ends_without_close_leaves_no_job_and_reruns_fresh(daemon, request, how):
    job = job_name(request)
    for _ in range(2):
        p = run(job, daemon.socket, how)
        assert "registered" in p.stdout, p.stderr
        assert p.returncode == (1 if how == "raise" else 0), p.stderr
        assert job not in jobs(daemon.socket)


def test_rerun_over_a_lingering_job_says_so_and_shardctl_end_lets_it_in(daemon, request):
    job = job_name(request)
    p = run(job, daemon.socket, "exit")
    assert p.returncode == 0 and "registered" in p.stdout, p.stderr
    assert job in jobs(daemon.socket)

    p = run(job, daemon.socket, "return")
    assert p.returncode != 0
    assert f"job '{job}' still holds this group from an earlier run" in p.stderr, p.stderr
    assert f"end the old job with `shardctl end {job}` and run again" in p.stderr, p.stderr
    # resume=True is named only for a rank restarted into a live run, after the fix for a rerun.
    assert p.stderr.index("shardctl end") < p.stderr.index("Only a rank restarted into a run whose "
                                                           "other ranks are still attached"), p.stderr
    # The refused run's ranks said goodbye at its exit, every rank of the job: it ended.
    assert job not in jobs(daemon.socket)

    p = run(job, daemon.socket, "exit")
    assert job in jobs(daemon.socket)
    out = run_shardctl(daemon.socket, "end", job)
    assert out.returncode == 0, out.stderr
    p = run(job, daemon.socket, "return")
    assert p.returncode == 0 and "registered" in p.stdout, p.stderr
    assert job not in jobs(daemon.socket)

# SPDX-License-Identifier: MIT
"""shardctl ranks shows the training step a shardd.torch user is at (issue 34).

shardd.torch numbers a group's unshards in the order it submits them: one in
forward and, for a module that reshards after forward, one more in backward,
so after K training steps its op steps reach about 2K. The step a person
counts is the optimizer's: shardctl ranks shows, per rank (OPTIM) and for
the job ("optimizer step K"), the last step the daemon's optimizer applied
on the rank's shards, which DaemonSGD numbers 1, 2, ... K. The independent
reference is the loop's own count of opt.step() calls (and the optimizer's
step_number), not anything the daemon reports."""

import threading

import pytest
import torch

import shardd.torch as st
import torch_net
from conftest import job_name, run_ranks, run_shardctl, shardctl_json
from torch_net import make_net, shard

torch.set_num_threads(1)

WORLD, STEPS, BATCH = 2, 5, 4


def start_looking(daemon, job, trained, looked, views):
    """A thread that, once the ranks have trained (`trained`), puts `shardctl
    ranks JOB` (JSON and text) into views, then lets them go (`looked`)."""
    def look():
        trained.wait(timeout=30)
        try:
            views["json"] = shardctl_json(daemon.socket, "ranks", job)
            views["text"] = run_shardctl(daemon.socket, "ranks", job)
        finally:
            looked.wait(timeout=30)

    looker = threading.Thread(target=look)
    looker.start()
    return looker


@pytest.mark.timeout_s(90)
def test_ranks_show_the_optimizer_step_the_user_counts(daemon, request):
    job = job_name(request)
    models = [make_net() for _ in range(WORLD)]
    data = torch_net.batches(WORLD, BATCH, STEPS)
    trained = threading.Barrier(WORLD + 1)
    looked = threading.Barrier(WORLD + 1)
    views = {}

    def rank(r):
        m = models[r]
        opt = st.DaemonSGD(m, lr=0.05, momentum=0.9)
        with st.init_device_mesh(job, r, (WORLD,), socket_path=daemon.socket) as mesh:
            shard(m, mesh)
            steps = 0
            for x, y in data:
                x, y = x[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH]
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
                steps += 1
            # The ranks stay attached while the main thread looks at them.
            trained.wait(timeout=30)
            looked.wait(timeout=30)
            return steps, opt.step_number

    looker = start_looking(daemon, job, trained, looked, views)
    counted = run_ranks(rank, WORLD)
    looker.join(timeout=30)
    assert counted == [(STEPS, STEPS)] * WORLD, counted

    job_view = views["json"]["jobs"][0]
    assert job_view["max_optim_step"] == STEPS, job_view
    assert [r["optim_step"] for r in job_view["ranks"]] == [STEPS] * WORLD, job_view
    # The ops' own numbering runs ahead: the reason this column exists.
    assert job_view["max_step"] > STEPS, job_view

    text = views["text"]
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == (f"job '{job}': mesh 1x{WORLD}, {WORLD} of {WORLD} ranks attached, "
                        f"optimizer step {STEPS}, furthest op step {job_view['max_step']}"), lines
    header = lines[1].split()
    optim = header.index("OPTIM")
    assert [line.split()[optim] for line in lines[2:2 + WORLD]] == [str(STEPS)] * WORLD, lines


def test_ranks_without_the_daemons_optimizer_show_no_optimizer_step(daemon, request):
    """Groups updated by torch.optim in the ranks: the daemon cannot know the
    training step, and says so with "-" rather than a number."""
    job = job_name(request)
    models = [make_net() for _ in range(WORLD)]
    data = torch_net.batches(WORLD, BATCH, 2)
    trained = threading.Barrier(WORLD + 1)
    looked = threading.Barrier(WORLD + 1)
    views = {}

    def rank(r):
        m = models[r]
        with st.init_device_mesh(job, r, (WORLD,), socket_path=daemon.socket) as mesh:
            shard(m, mesh)
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            torch_net.train(m, opt, [(x[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH])
                                     for x, y in data])
            trained.wait(timeout=30)
            looked.wait(timeout=30)

    looker = start_looking(daemon, job, trained, looked, views)
    run_ranks(rank, WORLD)
    looker.join(timeout=30)

    job_view = views["json"]["jobs"][0]
    assert job_view["max_optim_step"] is None, job_view
    assert [r["optim_step"] for r in job_view["ranks"]] == [None] * WORLD, job_view
    lines = views["text"].stdout.splitlines()
    assert "optimizer step" not in lines[0], lines
    optim = lines[1].split().index("OPTIM")
    assert [line.split()[optim] for line in lines[2:2 + WORLD]] == ["-"] * WORLD, lines

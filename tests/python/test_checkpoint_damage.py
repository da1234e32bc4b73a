# SPDX-License-Identifier: MIT
"""Checkpoints an operator meets off the happy path (docs/CHECKPOINTS.md,
issue 30): a rank that skipped a step alone, a damaged or manifest-less
newest checkpoint (restore falls back and moves it aside), and a full disk
whose message reaches the ranks, the log and `shardctl checkpoints`."""

import json
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import shardd
import shardd.proto as P
from conftest import Daemon, attach, attached, job_name, run_ranks, shardctl_json

WORLD = 2
SPECS = [("w", "float32", (9, 5)), ("b", "float32", (7,))]


def step_dir(root, step):
    return os.path.join(root, f"step-{step:012d}")


def fill(gs, rng, what):
    for g in gs:
        for i in range(len(SPECS)):
            buf = getattr(g, what)(i)
            buf[...] = rng.standard_normal(buf.shape).astype(np.float32)


def train(clients, gs, steps, seed):
    """Steps `steps` of the group on every rank with grads from `seed`."""
    rng = np.random.default_rng(seed)
    for s in steps:
        fill(gs, rng, "grad")
        run_ranks(lambda r: gs[r].reduce(s), WORLD)
        run_ranks(lambda r: gs[r].step(s, 0.01), WORLD)


def test_a_rank_that_skipped_a_step_alone_stays_checkpointable(state_daemon, request):
    job = job_name(request)
    rng = np.random.default_rng(3)
    opt = shardd.Optimizer.adamw(weight_decay=0.0)
    with attached(request, state_daemon, 1, WORLD) as clients:
        gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt), WORLD)
        fill(gs, rng, "shard")
        train(clients, gs, [1], seed=4)
        fill(gs, rng, "grad")
        gs[0].grad(0)[8] = np.nan  # row 8 of w: in rank 1's shard (rows 5-8) only
        run_ranks(lambda r: gs[r].reduce(2), WORLD)
        outcomes = run_ranks(lambda r: gs[r].step(2, 0.01, skip_nonfinite=True), WORLD)
        assert outcomes == [P.STEP_APPLIED, P.STEP_SKIPPED]
        run_ranks(lambda r: clients[r].checkpoint(2), WORLD)
        ckpt = step_dir(os.path.join(state_daemon.state, job), 2)
        with open(os.path.join(ckpt, "manifest.json")) as f:
            g = json.load(f)["groups"][0]
        assert (g["last_step"], g["optim_steps"], g["shard_optim_steps"]) == (2, 2, [2, 1])
        train(clients, gs, [3, 4], seed=5)
        want = [[gs[r].shard(i).copy() for i in range(len(SPECS))] for r in range(WORLD)]
    # Each rank shard resumes at its own update count: AdamW's bias correction
    # of the next steps matches the run that went on, bit for bit.
    with attached(request, state_daemon, 1, WORLD, suffix="-back") as clients:
        gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt, restore=ckpt),
                       WORLD)
        assert [g.last_step for g in gs] == [2, 2]
        train(clients, gs, [3, 4], seed=5)
        for r in range(WORLD):
            for i in range(len(SPECS)):
                assert np.array_equal(gs[r].shard(i), want[r][i]), (r, SPECS[i][0])
    # At another mesh every rank shard takes the most updates, and the log says so.
    with attach(state_daemon, request, 0, 1, 1, suffix="-one") as one:
        g = one.register_group("layer", SPECS, optimizer=opt, restore=ckpt)
        assert g.last_step == 2
    assert any("applied different numbers of updates" in line for line in state_daemon.lines)

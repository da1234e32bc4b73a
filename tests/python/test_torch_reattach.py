# SPDX-License-Identifier: MIT
"""A rank of a shardd.torch training (DaemonAdamW, two fully_shard groups,
three rank processes) SIGKILLed at a random point and restarted with
init_device_mesh(resume=True) + DaemonOptimizer.recover(): every rank's final
shards are bit-identical to an uninterrupted run's (each step applied exactly
once on every shard), over many kill points drawn from seeds.

A kill point is the k-th op the rank submits to the daemon (killed with the op
in flight: in an unshard, a reduce, a step) or the k-th wait that returned
(killed between a completion and the next op: between the last reduce and
the step, between the step and the next forward), k drawn up to the ops of a
whole run. Ranks are processes forked from the test (torch imported once);
the test learns of a death from the process sentinel and of results from
pipes, never by sleeping."""

import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import time
import traceback

import numpy as np
import pytest
import torch

import shardd
import shardd.torch as st
from conftest import Daemon, job_name, run_ranks

torch.set_num_threads(1)

WORLD, STEPS, BATCH = 3, 6, 4
SEEDS = range(24)
RUN_TIMEOUT_S = 90
FINAL_BARRIER = 7
MAX_NORM = 0.1
SKIPPED_STEP = 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(t, rank):
    g = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def arm_kill(hook, k):
    """SIGKILL this process right after the k-th op submission or the k-th
    completed wait (counting from now)."""
    count = [0]

    def after(fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            count[0] += 1
            if count[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapped

    if hook == "submit":
        shardd.Client._submit = after(shardd.Client._submit)
    else:
        shardd.client.Pending.wait = after(shardd.client.Pending.wait)
    return count


def count_ops():
    """Count submissions and completed waits (the uninterrupted run's)."""
    counts = {"submit": 0, "complete": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            counts[name] += 1
            return out
        return wrapped

    shardd.Client._submit = counting("submit", shardd.Client._submit)
    shardd.client.Pending.wait = counting("complete", shardd.client.Pending.wait)
    return counts


def rank_body(sock, job, rank, resume, kill, mode):
    torch.manual_seed(0)
    model = Net()
    opt = st.DaemonAdamW(model, lr=0.02, betas=(0.8, 0.95), weight_decay=0.1,
                         skip_nonfinite=mode == "skip")
    norms = []
    counts = None
    with st.init_device_mesh(job, rank, (WORLD,), socket_path=sock, resume=resume) as mesh:
        st.fully_shard(model.fc1, mesh=mesh)
        st.fully_shard(model, mesh=mesh)
        attached_at = opt.step_number
        if kill:
            arm_kill(*kill)
        elif not resume:
            counts = count_ops()
        t = opt.recover() if resume else 0
        resumed_at = t
        recoveries = 0
        while True:
            try:
                if t < STEPS:
                    x, y = batch(t, rank)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    if mode == "skip" and t == SKIPPED_STEP and rank == 1:
                        model.fc2.weight.grad.view(-1)[0] = float("nan")
                    if mode != "plain":
                        norms.append(float(st.clip_grad_norm_(model, MAX_NORM)))
                    opt.step()
                    opt.zero_grad()
                    t += 1
                    continue
                if counts is not None:
                    counts = dict(counts)     # the kill points: every op before the end
                # The end is a collective too: a survivor does not leave
                # while the dead rank still has to come back.
                mesh.barrier(FINAL_BARRIER)
                break
            except shardd.ShardError as e:
                if not st.peer_failed(e):
                    raise
                recoveries += 1
                t = opt.recover()
        assert opt.step_number == STEPS
        shards = {n: s.detach().numpy().copy() for n, s, _d, _f in st.local_shards(model)}
        return {"shards": shards, "attached_at": attached_at, "resumed_at": resumed_at,
                "recoveries": recoveries, "counts": counts, "norms": norms,
                "last_results": opt.last_results}


def rank_proc(sock, job, rank, resume, kill, mode, conn):
    code = 1
    try:
        conn.send(("ok", rank_body(sock, job, rank, resume, kill, mode)))
        code = 0
    except BaseException:
        conn.send(("error", f"rank {rank}{' (restarted)' if resume else ''}: "
                            f"{traceback.format_exc()}"))
    finally:
        conn.close()
        os._exit(code)


def run_job(sock, job, mode, kill_rank=None, kill=None):
    """Run the WORLD ranks; restart kill_rank once when it dies of SIGKILL.
    Returns ({rank: result}, {rank: result of the restarted process})."""
    ctx = multiprocessing.get_context("fork")
    procs, conns = {}, {}

    def start(r, resume, k):
        rd, wr = ctx.Pipe(duplex=False)
        p = ctx.Process(target=rank_proc, args=(sock, job, r, resume, k, mode, wr), daemon=True)
        p.start()
        wr.close()
        procs[r], conns[r] = p, rd

    for r in range(WORLD):
        start(r, False, kill if r == kill_rank else None)
    results, restarted = {}, set()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while len(results) < WORLD:
            left = deadline - time.monotonic()
            waiting = [r for r in range(WORLD) if r not in results]
            if left <= 0:
                raise TimeoutError(f"job {job}: ranks {waiting} did not finish within "
                                   f"{RUN_TIMEOUT_S} s (kill {kill} on rank {kill_rank})")
            multiprocessing.connection.wait(
                [conns[r] for r in waiting] + [procs[r].sentinel for r in waiting], left)
            for r in waiting:
                if conns[r].poll():
                    try:
                        status, value = conns[r].recv()
                    except EOFError:
                        status, value = None, None
                    if status == "error":
                        raise AssertionError(value)
                    if status == "ok":
                        results[r] = value
                        procs[r].join(10)
                        continue
                if procs[r].exitcode is None:
                    continue
                procs[r].join(10)
                if procs[r].exitcode == -signal.SIGKILL and r == kill_rank and r not in restarted:
                    restarted.add(r)
                    start(r, True, None)
                    continue
                raise AssertionError(f"rank {r} exited with {procs[r].exitcode} and no result")
    finally:
        for p in procs.values():
            if p.exitcode is None:
                p.kill()
                p.join(10)
    return results, restarted


@pytest.fixture(scope="module")
def fast_daemon():
    """A collective timeout of 5 s: a survivor that waits in a collective
    for the restarted rank (which waits in recover's barrier) fails fast."""
    d = Daemon(extra_args=("--collective-timeout", "5"))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def references(fast_daemon):
    """The uninterrupted run of each mode, made once."""
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode], _ = run_job(fast_daemon.socket,
                                     f"reattach-ref-{mode}-{os.getpid() % 10000}", mode)
        return cache[mode]
    return get


def assert_bit_identical(results, ref, what):
    for r in range(WORLD):
        got, want = results[r]["shards"], ref[r]["shards"]
        assert got.keys() == want.keys()
        for n in want:
            assert np.array_equal(got[n].view(np.uint32), want[n].view(np.uint32)), \
                f"{what}: rank {r} param {n} differs from the uninterrupted run by " \
                f"{np.abs(got[n] - want[n]).max()}"


@pytest.mark.timeout_s(300)
@pytest.mark.parametrize("mode", ["plain", "clip", "skip"])
def test_rank_killed_at_random_points_and_restarted_ends_bit_identical(fast_daemon, request,
                                                                       references, mode):
    """plain: the optimizer alone; clip: clip_grad_norm_ before each step
    (the catch-up step needs the survivors' clip coefficient); skip: also a
    NaN in rank 1's grad at one step, skipped by every rank."""
    reference = references(mode)
    counts = reference[0]["counts"]
    if mode != "plain":
        norms = reference[0]["norms"]
        assert min(n for n in norms if n == n) > 2 * MAX_NORM, "the clip would not be active"
        assert (norms[SKIPPED_STEP] != norms[SKIPPED_STEP]) == (mode == "skip")
    assert counts["submit"] >= 8 * STEPS and counts["complete"] >= 6 * STEPS
    torch.manual_seed(0)
    initial = dict(Net().named_parameters())
    final = reference[0]["shards"]      # rank 0's rows are the first ones (shard dim 0)
    moved = max(float(np.abs(final[n] - initial[n].detach()[:len(final[n])].numpy()).max())
                for n in final)
    assert moved > 1e-3, "the run does not move the params: bit-identity would prove nothing"
    caught_up = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        kill_rank = rng.randrange(WORLD)
        hook = rng.choice(("submit", "complete"))
        k = rng.randrange(1, counts[hook] + 1)
        what = f"seed {seed}: rank {kill_rank} killed after {hook} #{k}"
        t0 = time.monotonic()
        results, restarted = run_job(fast_daemon.socket, f"{job_name(request)[:36]}-{mode}-s{seed}",
                                     mode, kill_rank, (hook, k))
        assert restarted == {kill_rank}, f"{what}: the rank was not killed"
        back = results[kill_rank]
        assert back["attached_at"] <= back["resumed_at"] <= back["attached_at"] + 1, what
        caught_up += back["resumed_at"] > back["attached_at"]
        assert all(results[r]["recoveries"] >= 1 for r in range(WORLD) if r != kill_rank), what
        assert_bit_identical(results, reference, what)
        print(f"{what}: restarted rank attached at step {back['attached_at']}, resumed after "
              f"{back['resumed_at']} ({time.monotonic() - t0:.2f} s)")
    assert caught_up >= 1, "no kill fell between a step's reduces and the dead rank's step"


@pytest.mark.timeout_s(60)
def test_resume_refuses_a_model_that_differs_from_the_registered_groups(daemon, request):
    """Rank 0 stays attached (the job lives on) while rank 1 comes back:
    registering again is refused naming resume=True, a model whose params
    differ is refused naming the first difference, the same model opens its
    groups with the daemon's last step."""
    job = job_name(request)
    meshes = [st.init_device_mesh(job, r, (2,), socket_path=daemon.socket) for r in range(2)]
    try:
        def register(r):
            torch.manual_seed(0)
            model = Net()
            opt = st.DaemonSGD(model, lr=0.1)
            st.fully_shard(model, mesh=meshes[r])
            return model, opt
        run_ranks(register, 2)
        meshes[1].close()
        with st.init_device_mesh(job, 1, (2,), socket_path=daemon.socket) as mesh:
            with pytest.raises(shardd.ShardError, match=r"resume=True"):
                st.fully_shard(Net(), mesh=mesh)
        wider = Net()       # the same group name ('0.Net'), another shape
        wider.fc1 = torch.nn.Linear(6, 11)
        with st.init_device_mesh(job, 1, (2,), socket_path=daemon.socket, resume=True) as mesh:
            with pytest.raises(shardd.ShardError,
                               match=r"param \(name, dtype, shape, shard_dim\) \('fc1.weight', 1, "
                                     r"\(10, 6\), 0\) but .* \('fc1.weight', 1, \(11, 6\)"):
                st.fully_shard(wider, mesh=mesh)
        with st.init_device_mesh(job, 1, (2,), socket_path=daemon.socket, resume=True) as mesh:
            model = Net()
            opt = st.DaemonAdamW(model)
            with pytest.raises(shardd.ShardError, match=r"optimizer SGD but .* AdamW"):
                st.fully_shard(model, mesh=mesh)
        with st.init_device_mesh(job, 1, (2,), socket_path=daemon.socket, resume=True) as mesh:
            model = Net()
            opt = st.DaemonSGD(model, lr=0.1)
            st.fully_shard(model, mesh=mesh)
            assert opt.step_number == 0 and opt.last_step == 0
    finally:
        meshes[0].close()

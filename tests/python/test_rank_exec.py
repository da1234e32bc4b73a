# SPDX-License-Identifier: MIT
"""Rank-executed groups in the pure-Python client (issue 27, PROTOCOL.md
3.8): the client's numpy unshard and reduce give the bytes the daemon's
kernels give (exec="daemon", the reference) for every shape and precision
policy, accumulation and zero_grad included; a reduce that asks for the step
hands it to the daemon; a peer that dies fails the op naming it (and the
ops queued behind it, giving their numbers back), and one that never comes
fails it at the collective timeout naming it."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shardd
from shardd import proto as P
from shardd.group import step_flags_args
from conftest import ROOT, Daemon, attached, job_name, run_ranks

WORLD = 3
# dim 0 uneven (rank 2 holds one row and padding), 1-d, 0-d, Shard(1) with
# outer > 1, zero-numel on and off the shard dim, a dim-0 param with no row for rank 2.
SPECS = [shardd.Param("w", "fp32", (5, 3)), shardd.Param("b", "fp32", (7,)),
         shardd.Param("s", "fp32", ()), shardd.Param("t", "fp32", (2, 6, 3), shard_dim=1),
         shardd.Param("e1", "fp32", (2, 0), shard_dim=1), shardd.Param("e0", "fp32", (0, 3)),
         shardd.Param("r", "fp32", (4, 2))]
# (param_dtype, reduce_dtype): FSDP2's MixedPrecisionPolicy cases.
POLICIES = {"fp32": (None, None), "bf16-params-fp32-reduce": ("bf16", "fp32"),
            "bf16": ("bf16", None), "fp16": ("fp16", None)}


def values(rng, shape, dtype_code):
    """Numbers that round in every dtype (normal draws at several scales),
    as the bits the grad buffer of that dtype holds."""
    v = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 300.0], size=shape)).astype(np.float32)
    if dtype_code == P.DTYPE_BF16:
        return shardd.fp32_to_bf16(v).reshape(shape)
    if dtype_code == P.DTYPE_FP16:
        return v.astype(np.float16)
    return v


def run_sequence(request, daemon, exec_, policy, seed):
    """Register, unshard, reduce twice (the second accumulates), zero_grad,
    reduce again; the bytes of every rank's unsharded copy and sharded grads
    after each, and the group's exec as the daemon reported it."""
    pd, rd = policy
    rng = np.random.default_rng(seed)
    out = []
    with attached(request, daemon, 1, WORLD, suffix=f"-{exec_}") as clients:
        groups = run_ranks(lambda r: clients[r].register_group(
            "g", SPECS, param_dtype=pd, reduce_dtype=rd, exec=exec_), WORLD)
        fulls = [(rng.standard_normal(p.shape) * 3).astype(np.float32) for p in SPECS]
        for g in groups:
            for i, f in enumerate(fulls):
                g.load_full(i, f)
        run_ranks(lambda r: groups[r].unshard(1), WORLD)
        out.append([bytes(g.maps[g.UNSHARDED]) for g in groups])
        run_ranks(lambda r: groups[r].reshard(1), WORLD)

        def reduce(step):
            for g in groups:
                for i in range(len(SPECS)):
                    grad = g.grad(i)
                    grad.view(np.ndarray)[...] = values(rng, grad.shape, g.grad_dtype)
            run_ranks(lambda r: groups[r].reduce(step), WORLD)
            out.append([bytes(g.maps[g.SHARD_GRAD]) for g in groups])

        reduce(1)
        reduce(2)
        run_ranks(lambda r: groups[r].zero_grad(), WORLD)
        assert not any(any(bytes(g.maps[g.SHARD_GRAD])) for g in groups)
        reduce(3)
        return out, [g.exec for g in groups]


@pytest.mark.timeout_s(120)
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_rank_executed_ops_give_the_daemons_bytes_for_every_shape_and_policy(daemon, request, policy):
    want, daemon_exec = run_sequence(request, daemon, "daemon", policy, 5)
    got, ranks_exec = run_sequence(request, daemon, "ranks", policy, 5)
    assert daemon_exec == [P.EXEC_DAEMON] * WORLD and ranks_exec == [P.EXEC_RANKS] * WORLD
    names = ["unshard 1", "reduce 1", "reduce 2 (accumulated)", "reduce 3 (after zero_grad)"]
    for what, w, g in zip(names, want, got):
        for r in range(WORLD):
            assert any(w[r]), f"{what} rank {r}: the daemon's output is all zero"
            assert g[r] == w[r], f"{what} rank {r}: rank-executed bytes differ from the daemon's"


@pytest.mark.timeout_s(60)
def test_nan_and_inf_grads_reduce_to_the_daemons_bits(daemon, request):
    """Non-finite grads take the kernels' NaN rules (quiet, the first operand's
    payload) in bf16 and fp16 as in fp32."""
    def run(exec_, pd):
        with attached(request, daemon, 1, 2, suffix=f"-{exec_[0]}{pd}") as clients:
            groups = run_ranks(lambda r: clients[r].register_group(
                "g", [("w", "fp32", (8,))], param_dtype=pd, exec=exec_), 2)
            for r, g in enumerate(groups):
                v = np.array([np.nan, 1, np.inf, -np.inf, 2, np.nan, 65504, -0.0], np.float32)
                g.grad(0)[...] = v if r == 0 else v[::-1]
            run_ranks(lambda r: groups[r].reduce(1), 2)
            return [bytes(g.maps[g.SHARD_GRAD]) for g in groups]

    for pd in ("fp32", "bf16", "fp16"):
        assert run("ranks", pd) == run("daemon", pd), pd


def sgd_steps(request, daemon, exec_):
    rng = np.random.default_rng(8)
    specs = [("w", "fp32", (5, 3)), ("b", "fp32", (7,))]
    with attached(request, daemon, 1, 2, suffix=f"-{exec_}") as clients:
        groups = run_ranks(lambda r: clients[r].register_group(
            "g", specs, optimizer=shardd.Optimizer.sgd(momentum=0.9), exec=exec_), 2)
        for g in groups:
            for i, (_n, _d, shape) in enumerate(specs):
                g.load_full(i, np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7)
        for step in (1, 2):
            for g in groups:
                for i in range(len(specs)):
                    g.grad(i)[...] = rng.standard_normal(g.grad(i).shape).astype(np.float32)
            _flags, args = step_flags_args(0.05)
            run_ranks(lambda r: clients[r].run_many(
                [(P.OP_REDUCE, groups[r].id, step, P.REDUCE_STEP, f"reduce+step {step}", args)]), 2)
        # The daemon ran both steps: step 2 again finds it applied.
        assert run_ranks(lambda r: groups[r].step(2, 0.05), 2) == [shardd.STEP_ALREADY] * 2
        return [bytes(g.maps[g.SHARD]) for g in groups]


@pytest.mark.timeout_s(60)
def test_reduce_with_step_runs_the_daemons_step_on_the_rank_executed_sum(daemon, request):
    want = sgd_steps(request, daemon, "daemon")
    got = sgd_steps(request, daemon, "ranks")
    assert got == want


# Rank 1 of a rank-executed job in its own process: registers, says ready, then waits to be killed.
PEER = textwrap.dedent("""
    import sys
    import shardd
    c = shardd.Client(job=sys.argv[2], rank=1, shard=2, socket_path=sys.argv[1])
    g = c.register_group("g", [("w", "fp32", (6, 2))], exec="ranks")
    print("ready", g.exec, flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout_s(60)
def test_a_peer_killed_mid_unshard_fails_it_and_the_next_op_with_peer_died_naming_it(daemon, request):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    job = job_name(request)
    peer = subprocess.Popen([sys.executable, "-c", PEER, daemon.socket, job], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with shardd.Client(job=job, rank=0, shard=2, socket_path=daemon.socket) as c:
            g = c.register_group("g", [("w", "fp32", (6, 2))], exec="ranks")
            assert peer.stdout.readline().split() == ["ready", str(P.EXEC_RANKS)]
            assert g.submit(P.OP_UNSHARD, step=4, user_data=7)
            assert g.submit(P.OP_REDUCE, step=4, user_data=8)
            assert c.poll() is None  # published; rank 1 never submits them
            assert g.x.mine.word(P.XL_SEQ) == P.exec_word(1, 2)
            peer.send_signal(signal.SIGKILL)
            peer.wait(timeout=10)
            comps = sorted((c.wait(timeout=15) for _ in range(2)), key=lambda cp: cp.user_data)
            got = [(cp.user_data, cp.res) for cp in comps]
            assert got == [(7, -P.E_PEER_DIED), (8, -P.E_PEER_DIED)], comps
            assert "rank 1 left" in comps[0].msg and "unshard(group 'g', step 4)" in comps[0].msg
            # The reduce queued behind it fails with it, and both numbers are given back.
            assert comps[1].msg.startswith("shardd: reduce(group 'g', step 4): not run: shardd: unshard")
            assert g.x.mine.word(P.XL_SEQ) == 0
    finally:
        peer.kill()
        peer.wait(timeout=10)


@pytest.mark.timeout_s(30)
def test_peers_that_never_submit_time_out_naming_them_and_the_next_op_pairs_up(request):
    with Daemon(("--collective-timeout", "1")) as d, attached(request, d, 1, 3) as clients:
        groups = run_ranks(lambda r: clients[r].register_group(
            "g", [("w", "fp32", (6,))], exec="ranks"), 3)

        with pytest.raises(shardd.ShardError) as ei:
            groups[0].reduce(2)
        assert ei.value.code == -P.E_TIMEOUT, ei.value
        assert "rank(s) 1, 2 did not submit it within 1 s; rank 0 is waiting" in ei.value.text
        # Its number was given back: the three ranks' next reduce pairs up.
        run_ranks(lambda r: groups[r].reduce(3), 3)


@pytest.mark.timeout_s(30)
def test_a_rank_that_reads_after_its_peer_gave_up_fails_too_and_keeps_the_number(request):
    """Rank 0 publishes a reduce but does not read until rank 1 timed out
    waiting for it to finish reading rank 1's grads. Rank 1 has written its
    output and keeps the op's number; rank 0 must fail the reduce as well
    (the daemon fails a late arrival at once), keeping the number too, so
    that their next reduce pairs up instead of mismatching."""
    with Daemon(("--collective-timeout", "1")) as d, attached(request, d, 1, 2) as clients:
        groups = run_ranks(lambda r: clients[r].register_group(
            "g", [("w", "fp32", (6,))], exec="ranks"), 2)
        assert groups[0].submit(P.OP_REDUCE, step=2, user_data=5)
        with pytest.raises(shardd.ShardError) as ei:
            groups[1].reduce(2)
        assert ei.value.code == -P.E_TIMEOUT, ei.value
        assert "rank(s) 0 did not finish reading this rank's grads within 1 s" in ei.value.text
        comp = clients[0].wait(timeout=10)
        assert comp.user_data == 5 and comp.res == -P.E_TIMEOUT, comp
        assert "rank 0 arrived after rank 1 gave up waiting for it" in comp.msg, comp.msg
        assert groups[0].x.mine.word(P.XL_SEQ) == groups[1].x.mine.word(P.XL_SEQ) == P.exec_word(1, 1)
        # The next reduce pairs up: one op number on both ranks, the sum of both ranks' grads.
        for r, g in enumerate(groups):
            g.maps[g.GRAD][:24] = np.full(6, r + 1, np.float32).tobytes()
            g.zero_grad()
        run_ranks(lambda r: groups[r].reduce(3), 2)
        for g in groups:
            got = np.frombuffer(g.maps[g.SHARD_GRAD], np.float32, count=3)
            assert (got == 1.5).all(), got

# SPDX-License-Identifier: MIT
"""Limits of jobs across nodes (docs/MULTINODE.md, "Memory"; docs/RELIABILITY.md).

Two real shardd daemons under mpirun over TCP, as in test_multinode.py.
The inter-node buffers of a group (the exchange buffer MPI sends from and
receives into, FSDP's reduce scratch) are counted at registration against
--max-memory / --max-job-memory, so a group that cannot fit is refused then,
naming its inter-node bytes, and one that fits exactly runs its ops with
exact results; a spanning job's ranks are named by their global numbers in
the node's own errors and in shardctl's views."""

import errno
import os
import signal
import time

import numpy as np
import pytest

import shardd
from shardd import proto as P
from conftest import (WORLD_TIMEOUT_S as TIMEOUT_S, World, attach, attached, job_name, needs_mpirun,
                      run_ranks, run_shardctl, shardctl_json)
from reference import shard_of

pytestmark = needs_mpirun

# FSDP across 2 nodes (mesh 1x4, 2 ranks per node) of one fp32 param of 64 x 16:
# shard Z = 16 rows * 16 * 4 B = 1024 B; the full param 4096 B.
ROWS, COLS, S, L, N = 64, 16, 4, 2, 2
SPEC = [("w", "fp32", (ROWS, COLS))]
Z = ROWS // S * COLS * 4
FULL = ROWS * COLS * 4
# The node's buffers without the inter-node ones: one unsharded copy, L shards,
# L sharded grads, L grad buffers.
LOCAL = FULL + L * Z + L * Z + L * FULL
# docs/MULTINODE.md, "Memory": FSDP's exchange buffer is the larger of the
# unshard's S shards and the reduce's 2 * S fp32 node sums of a shard (F = Z
# here: fp32 params, fp32 on the wire); its scratch the fp32 total of one
# shard (F, 64-byte aligned) and the node's ranks' grads of the largest
# param in the reduce dtype (L * numel * 4).
F = Z
INTERNODE = max(S * Z, 2 * S * F) + F + L * ROWS * COLS * 4


def kib(n):
    return f"{n / 1024:.1f} KiB"


def job_of(world, node, name):
    jobs = [j for j in shardctl_json(world.socket(node), "jobs")["jobs"] if j["name"] == name]
    assert len(jobs) == 1, jobs
    return jobs[0]


@pytest.mark.timeout_s(90)
def test_group_across_nodes_past_max_memory_is_refused_naming_its_internode_bytes(request):
    """The group's node-local buffers (16 KiB) fit a 24 KiB limit, but with
    its inter-node buffers (17 KiB) it does not: every rank's registration
    fails with the usual message, naming the inter-node part."""
    assert LOCAL == 16384 and INTERNODE == 17408
    limit = 24 * 1024
    with World(N, ["--max-memory", str(limit)]) as world, attached(request, world, 1, S) as clients:

        def refused(r):
            with pytest.raises(shardd.ShardError) as ei:
                clients[r].register_group("g", SPEC)
            return ei.value

        want = (f"shardd: register group 'g' of job '{job_name(request)}': its buffers need "
                f"{kib(LOCAL + INTERNODE)} ({LOCAL + INTERNODE} bytes, of which {kib(INTERNODE)} "
                f"({INTERNODE} bytes) inter-node buffers across 2 nodes), but the job holds 0 B "
                f"(0 bytes) of its limit of {kib(limit)} ({limit} bytes); raise --max-job-memory, "
                f"or end jobs or register smaller groups")
        for r, e in enumerate(run_ranks(refused, S)):
            assert e.code == -errno.ENOMEM, (r, e)
            assert e.text == f"register group 'g': daemon: {want}", (r, e.text)
        for node in range(N):
            job = job_of(world, node, job_name(request))
            assert job["groups"] == 0 and job["memory_committed"] == 0, job


@pytest.mark.timeout_s(90)
def test_group_across_nodes_fits_its_exact_bytes_and_reuses_its_buffers_exactly(request):
    """Under a --max-memory of exactly the group's bytes it registers, with
    its inter-node bytes held and committed on each node; a second group is
    refused; unshard and three reduces (the same buffers every op) give the
    exact results."""
    total = LOCAL + INTERNODE
    rng = np.random.default_rng(5)
    full = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    # multiples of 1/64: every sum over the 4 ranks and 3 reduces is exact in fp32, and so
    # is the divide by 4 (a power of two)
    grads = [[(rng.integers(-256, 256, size=(ROWS, COLS)) / 64).astype(np.float32) for _ in range(S)]
             for _ in range(3)]
    with World(N, ["--max-memory", str(total)]) as world, attached(request, world, 1, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", SPEC), S)
        for node in range(N):
            job = job_of(world, node, job_name(request))
            assert job["memory"]["internode"] == INTERNODE, job
            assert job["memory"]["total"] == total, job
            assert job["memory_committed"] == total, job

        def refused(r):
            with pytest.raises(shardd.ShardError) as ei:
                clients[r].register_group("h", [("v", "fp32", (4,))])
            return ei.value

        for e in run_ranks(refused, S):
            assert e.code == -errno.ENOMEM and f"but the job holds {kib(total)} ({total} bytes)" in e.text, e
        for g in groups:
            g.load_full(0, full)
        run_ranks(lambda r: groups[r].unshard(1), S)
        for r, g in enumerate(groups):
            np.testing.assert_array_equal(g.unsharded(0), full, err_msg=f"rank {r}")
        for mb in range(3):
            for r, g in enumerate(groups):
                g.grad(0)[...] = grads[mb][r]
            run_ranks(lambda r: groups[r].reduce(1), S)
        want = sum(sum(np.asarray(grads[mb][q], dtype=np.float64) for q in range(S)) / S for mb in range(3))
        for r, g in enumerate(groups):
            np.testing.assert_array_equal(np.array(g.shard_grad(0, padded=True)),
                                          want[r * ROWS // S:(r + 1) * ROWS // S].astype(np.float32),
                                          err_msg=f"rank {r}")
        # after the ops, what each node holds is what it committed at registration
        for node in range(N):
            assert job_of(world, node, job_name(request))["memory"]["total"] == total


def wait_pending(world, node, name, want_arrived):
    """shardctl's ranks view of `name` on `node` once its pending collective
    shows `want_arrived` (the op is taken asynchronously), bounded."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        view = shardctl_json(world.socket(node), "ranks", name)["jobs"][0]
        if any(p["arrived"] == want_arrived for p in view["pending"]) or time.monotonic() > deadline:
            return view
        time.sleep(0.02)


@pytest.mark.timeout_s(90)
def test_spanning_job_names_global_ranks_in_views_and_node_errors(request):
    """HSDP 2x2 over 2 nodes: node 1 holds global ranks 2 and 3. Its
    shardctl views name them 2 and 3 (with the node and the node-local
    rank), its inter-node buffer is the all-reduce's, and its own rendezvous
    timeout names rank 3 as missing and rank 2 as waiting."""
    R = 2
    with World(N) as world, attached(request, world, R, L) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", SPEC), R * L)
        name = job_name(request)
        job = job_of(world, 1, name)
        assert job["span"] == {"replicate": 2, "shard": 2, "nodes": 2, "node": 1,
                               "first_rank": 2, "last_rank": 3}, job
        # HSDP: the partials of the node's 2 ranks (2 x 2048 B fp32) cut into 2 slices of
        # C = 512 elements; fp32 reduce-scatter halves 2 * 2 * C * 4, all-gather 2 * C * 4
        C = L * (ROWS // L * COLS) // N
        assert job["memory"]["internode"] == 2 * N * C * 4 + N * C * 4, job
        assert groups[2].submit(P.OP_UNSHARD, step=5, user_data=31)
        view = wait_pending(world, 1, name, [2])
        assert [(r["rank"], r["node"], r["local_rank"]) for r in view["ranks"]] == [(2, 1, 0), (3, 1, 1)]
        assert view["span"]["first_rank"] == 2
        pend = [p for p in view["pending"] if p["op"] == "unshard"]
        assert len(pend) == 1 and pend[0]["arrived"] == [2] and pend[0]["missing"] == [3], view
        assert [p["op"] for p in view["ranks"][0]["waiting"]] == ["unshard"], view
        comp = clients[2].wait(timeout=TIMEOUT_S + 20)
        assert comp.user_data == 31 and comp.res == -P.E_TIMEOUT, comp
        assert comp.msg == ("shardd: rank 3 never submitted unshard(group 'g', step 5) within "
                            f"{TIMEOUT_S} s; rank 2 is waiting"), comp.msg
        text = run_shardctl(world.socket(1), "ranks", name).stdout.splitlines()
        assert text[0].startswith(f"job '{name}': mesh 2x2 over 2 nodes, node 1 holds ranks 2..3, 2 of 2 "
                                  "attached, furthest op step "), text
        assert [line.split()[0] for line in text[2:]] == ["2", "3"], text
        # node 0's views are its own ranks, 0 and 1
        view0 = shardctl_json(world.socket(0), "ranks", name)["jobs"][0]
        assert [(r["rank"], r["node"], r["local_rank"]) for r in view0["ranks"]] == [(0, 0, 0), (1, 0, 1)]


@pytest.mark.timeout_s(60)
def test_rank_attaching_with_another_whole_mesh_of_the_same_node_part_is_refused(request):
    """Meshes 2x2 and 1x4 over 2 nodes both put 1x2 on a node: a rank asking
    for the other whole mesh of an existing job is refused naming both."""
    with World(N) as world, attached(request, world, 2, 2, ranks=[0]):
        with pytest.raises(shardd.ShardError) as ei:
            attach(world, request, 1, 1, 4)
        assert ei.value.code == -P.E_MESH
        name = job_name(request)
        assert ei.value.text == (f"attach job '{name}' rank 1 to {world.socket(0)}: daemon: job '{name}' "
                                 "has mesh 2x2 over 2 nodes, hello asked for 1x4"), ei.value


@pytest.mark.timeout_s(90)
def test_buffer_mpi_still_holds_after_a_stall_is_counted_and_a_third_is_refused(request):
    """FSDP 1x4 over 2 nodes with 1 MiB node chunks (a payload MPI sends by
    rendezvous: the send ends only when the peer receives it), node 1
    stopped. Node 0's first unshard times out with its buffer still held by
    MPI; the second gets a fresh buffer, the held one counted in the
    daemon's committed bytes (--max-memory has room for one more); the
    third finds no room and fails at once, saying why, instead of
    allocating past the limit."""
    rows, cols = 1024, 512
    full, z = rows * cols * 4, rows // S * cols * 4
    local = full + L * z + L * z + L * full
    buf = max(S * z, 2 * S * z)
    internode = buf + z + L * rows * cols * 4
    limit = local + internode + buf
    with World(N, ["--max-memory", str(limit)]) as world, attached(request, world, 1, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", [("w", "fp32", (rows, cols))]), S)
        status = shardctl_json(world.socket(0), "status")
        assert status["memory_limits"]["committed"] == local + internode, status
        os.kill(world.pids[1], signal.SIGSTOP)
        try:
            def unshard(step):
                def one(r):
                    with pytest.raises(shardd.ShardError) as ei:
                        groups[r].unshard(step)
                    return ei.value
                return run_ranks(one, L, timeout=TIMEOUT_S + 20)

            for step in (1, 2):
                for e in unshard(step):
                    assert e.code == -P.E_TIMEOUT and e.text.endswith(
                        f"unshard(group 'g', step {step}): exchange among 2 nodes failed for ranks 0..1 "
                        f"(node 0): node 1 (ranks 2..3) did not answer within {TIMEOUT_S} s; check its "
                        "daemon (dead: relaunch the world)"), e
            # the first buffer, still held by MPI, counted on top of the group's
            assert shardctl_json(world.socket(0), "status")["memory_limits"]["committed"] == local + internode + buf
            t0 = time.monotonic()
            for e in unshard(3):
                assert e.code == -P.E_NOMEM and e.text.endswith(
                    "shardd: unshard(group 'g', step 3): MPI still holds this group's inter-node buffer "
                    f"({buf // (1 << 20)}.0 MiB), sent to a node that stopped answering, and another does "
                    f"not fit ({limit / (1 << 20):.1f} MiB of --max-memory {limit / (1 << 20):.1f} MiB held); "
                    "retry once that node answers, or raise --max-memory"), e
            assert time.monotonic() - t0 < TIMEOUT_S, "the refusal waited for the timeout"
            assert shardctl_json(world.socket(0), "status")["memory_limits"]["committed"] == local + internode + buf
        finally:
            os.kill(world.pids[1], signal.SIGCONT)


@pytest.mark.timeout_s(90)
def test_fsdp_bf16_node_sums_travel_in_bf16_from_the_scratch_exactly(request):
    """--internode-dtype reduce with bf16 grads: the fp32 node sums live in
    the group's scratch and travel cast to bf16 (the other path through the
    buffers). Multiples of 1/8 in [-2, 2] keep every node sum, total, divide
    by 4 and the fp32 accumulate of two reduces exact, so each rank's shard,
    padding rows included, is the exact average."""
    specs = [("w", "fp32", (7, 3)), ("b", "fp32", (6,))]
    rng = np.random.default_rng(41)
    grads = [[[(rng.integers(-16, 17, size=sh) / 8).astype(np.float32) for _, _, sh in specs]
              for _ in range(S)] for _ in range(2)]
    with World(N, ["--internode-dtype", "reduce"]) as world, attached(request, world, 1, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", specs, param_dtype="bf16"), S)
        for mb in range(2):
            for r, g in enumerate(groups):
                for i in range(len(specs)):
                    g.grad(i)[...] = shardd.fp32_to_bf16(grads[mb][r][i])
            run_ranks(lambda r: groups[r].reduce(4), S)
        for i in range(len(specs)):
            avg = sum((sum(np.asarray(grads[mb][q][i], dtype=np.float64) for q in range(S)) / S)
                      .astype(np.float32) for mb in range(2))
            for r, g in enumerate(groups):
                np.testing.assert_array_equal(np.array(g.shard_grad(i, padded=True), dtype=np.float32),
                                              shard_of(avg, S, r), err_msg=f"rank {r} param {i}")

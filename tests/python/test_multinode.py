# SPDX-License-Identifier: MIT
"""Daemons on several nodes form one job (`shardd --world mpi`, docs/MULTINODE.md).

Two and three real shardd processes on this machine under mpirun, forced
over TCP (--mca btl tcp,self), each with its own socket and its own ranks
(ranks n*L .. n*L+L-1 on node n): HSDP across nodes (replicate = nodes)
reduces against an independent numpy computation and against a
single-node daemon running the same mesh; unshard stays on each node; a
rank at the wrong node, or a layout that is not run across nodes, is
refused naming the node or the layouts; FSDP across nodes (one shard
group over every rank) unshards and reduces against the same references; a node's daemon killed
mid-collective fails the other node's ranks within the collective
timeout, naming the node and its ranks."""

import math
import os
import signal
import time

import numpy as np
import pytest

import shardd
from shardd import proto as P
from conftest import WORLD_TIMEOUT_S as TIMEOUT_S, Daemon, World, attached, job_name, needs_mpirun, run_ranks
from reference import shard_of

pytestmark = needs_mpirun


@pytest.fixture(scope="module")
def world2():
    with World(2) as w:
        yield w


def run_hsdp(clients, specs, grads, param_dtype=None):
    """Register, write two microbatches of grads (grads[mb][rank][param]),
    reduce the first without and the second with ALL_REDUCE; return each
    rank's sharded grads (padded) as fp32 copies."""
    n = len(clients)
    groups = run_ranks(lambda r: clients[r].register_group("g", specs, param_dtype=param_dtype), n)
    for mb, flags in enumerate((0, P.REDUCE_ALL_REDUCE)):
        for r, g in enumerate(groups):
            for i in range(len(specs)):
                g.grad(i)[...] = grads[mb][r][i]
        run_ranks(lambda r: groups[r].reduce(7, flags), n)
    return [[np.array(g.shard_grad(i, padded=True), dtype=np.float32) for i in range(len(specs))]
            for g in groups]


def hsdp_reference(specs, grads, R, S):
    """FSDP2's HSDP numbers from the grads alone: per microbatch the
    reduce-scatter over a replica's S ranks, averaged over the whole mesh
    (fp32 sums of exactly representable values: exact), accumulated, then
    summed over the R replicas. Returns [rank][param] padded shards."""
    out = []
    for r in range(R * S):
        s = r % S
        per = []
        for i, (_, _, shape) in enumerate(specs):
            total = sum(np.asarray(grads[mb][q][i], dtype=np.float64)
                        for mb in range(2) for q in range(R * S))
            per.append(shard_of((total / (R * S)).astype(np.float32), S, s))
        out.append(per)
    return out


def across_nodes_and_on_one_daemon(request, nodes, R, S, run, extra_args=()):
    """run(clients) on mesh R x S over `nodes` daemons (extra_args to each),
    then on one daemon running the same mesh: both results."""
    with World(nodes, extra_args) as world, attached(request, world, R, S) as clients:
        multi = run(clients)
    with Daemon() as single, attached(request, single, R, S) as clients:
        one = run(clients)
    return multi, one


SPECS = [("w", "fp32", (7, 3)), ("b", "fp32", (5,))]


def exact_grads(seed, n):
    rng = np.random.default_rng(seed)
    # multiples of 1/64 in [-4, 4]: every sum and the divide by 4 stay exact in fp32
    return [[[(rng.integers(-256, 256, size=shape) / 64).astype(np.float32) for _, _, shape in SPECS]
             for _ in range(n)] for _ in range(2)]


@pytest.mark.timeout_s(60)
def test_hsdp_reduce_across_two_nodes_matches_the_reference(world2, request):
    R, S = 2, 2
    grads = exact_grads(1, R * S)
    with attached(request, world2, R, S) as clients:
        got = run_hsdp(clients, SPECS, grads)
    want = hsdp_reference(SPECS, grads, R, S)
    for r in range(R * S):
        for i in range(len(SPECS)):
            np.testing.assert_array_equal(got[r][i], want[r][i], err_msg=f"rank {r} param {i}")


@pytest.mark.timeout_s(90)
@pytest.mark.parametrize("nodes,dtype", [(2, "fp32"), (3, "reduce")])
def test_hsdp_bf16_across_nodes_gives_the_bits_of_one_daemon(request, nodes, dtype):
    """bf16 grads reduced in bf16: the daemons across nodes and one daemon
    running the same mesh give the same bits (same inputs, same order, one
    rounding), and both are within bf16 rounding of the exact average."""
    R, S = nodes, 2
    rng = np.random.default_rng(nodes)
    grads = [[[shardd.fp32_to_bf16(rng.standard_normal(shape).astype(np.float32))
               for _, _, shape in SPECS] for _ in range(R * S)] for _ in range(2)]
    multi, one = across_nodes_and_on_one_daemon(
        request, nodes, R, S, lambda clients: run_hsdp(clients, SPECS, grads, param_dtype="bf16"),
        ["--internode-dtype", dtype])
    fgrads = [[[shardd.bf16_to_fp32(g) for g in rank] for rank in mb] for mb in grads]
    want = hsdp_reference(SPECS, fgrads, R, S)
    for r in range(R * S):
        for i in range(len(SPECS)):
            np.testing.assert_array_equal(multi[r][i], one[r][i], err_msg=f"rank {r} param {i}")
            # a few bf16 roundings (rs, the partial's add, the all-reduce): 2^-8 relative each
            np.testing.assert_allclose(multi[r][i], want[r][i], rtol=2 ** -6, atol=2 ** -6,
                                       err_msg=f"rank {r} param {i}")


# The HSDP all-reduce goes among the nodes in chunks of 1 MiB of a node's
# slice once a slice holds two (world_host.c, HSDP_CHUNK_BYTES): a slice is
# a node's shards' elements / nodes, so "w" gives slices of 7 fp32 chunks
# (2 nodes) and of 3 bf16 ones (3 nodes), the last one not whole either
# way; "e" has no elements and "b" is odd, so neither lands on a boundary.
CHUNK_SPECS = [("w", "fp32", (3300007,)), ("e", "fp32", (0, 4)), ("b", "fp32", (131,))]


@pytest.mark.timeout_s(240)
@pytest.mark.parametrize("nodes,dtype,param_dtype", [(2, "fp32", None), (3, "reduce", "bf16")])
def test_hsdp_all_reduce_in_chunks_gives_the_bits_of_one_daemon(request, nodes, dtype, param_dtype):
    """Chunks summed as they arrive add the same inputs in the same node
    order as one daemon: the same bits, and (fp32 grads, exact values) the
    reference's; bf16 within its roundings."""
    R, S = nodes, 2
    rng = np.random.default_rng(60 + nodes)

    def grad(shape):
        g = (rng.integers(-256, 256, size=shape) / 64).astype(np.float32)
        return shardd.fp32_to_bf16(g) if param_dtype else g

    grads = [[[grad(shape) for _, _, shape in CHUNK_SPECS] for _ in range(R * S)] for _ in range(2)]
    multi, one = across_nodes_and_on_one_daemon(
        request, nodes, R, S,
        lambda clients: run_hsdp(clients, CHUNK_SPECS, grads, param_dtype=param_dtype),
        ["--internode-dtype", dtype])
    fgrads = grads if not param_dtype else [[[shardd.bf16_to_fp32(g) for g in rank] for rank in mb]
                                            for mb in grads]
    want = hsdp_reference(CHUNK_SPECS, fgrads, R, S)
    for r in range(R * S):
        for i in range(len(CHUNK_SPECS)):
            np.testing.assert_array_equal(multi[r][i], one[r][i], err_msg=f"rank {r} param {i}")
            if param_dtype:
                # three bf16 roundings (rs, the partial's add, the all-reduce) of sums below 4
                # in magnitude, each off by at most half a bf16 ulp there (2^-6)
                np.testing.assert_allclose(multi[r][i], want[r][i], rtol=0, atol=3 * 2 ** -6,
                                           err_msg=f"rank {r} param {i}")
            else:
                np.testing.assert_array_equal(multi[r][i], want[r][i], err_msg=f"rank {r} param {i}")


@pytest.mark.timeout_s(60)
def test_hsdp_unshard_gathers_each_node_replica_on_its_node(world2, request):
    R, S = 2, 2
    rng = np.random.default_rng(5)
    # each replica (node) holds its own values, so a gather across nodes would show
    fulls = [[rng.standard_normal(shape).astype(np.float32) for _, _, shape in SPECS] for _ in range(R)]
    with attached(request, world2, R, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", SPECS), R * S)
        for r, g in enumerate(groups):
            for i in range(len(SPECS)):
                g.load_full(i, fulls[r // S][i])
        run_ranks(lambda r: groups[r].unshard(3), R * S)
        for r, g in enumerate(groups):
            for i in range(len(SPECS)):
                np.testing.assert_array_equal(g.unsharded(i), fulls[r // S][i])


def test_rank_at_another_node_daemon_is_refused_naming_its_node(world2, request):
    with pytest.raises(shardd.ShardError) as ei:
        shardd.Client(job=job_name(request), rank=3, shard=2, replicate=2,
                      socket_path=world2.socket(0))
    assert ei.value.code == -P.E_INVALID
    assert "hello.rank = 3 belongs to node 1 (ranks 2..3" in ei.value.text
    assert "this daemon is node 0" in ei.value.text


@pytest.mark.parametrize("replicate,shard,words", [
    (4, 2, ["mesh 4x2 spans 2 nodes", "HSDP with replicate = nodes", "mesh 2x4 here",
            "FSDP with one shard group over every rank (mesh 1x8)"]),
    (4, 1, ["mesh 4x1 spans 2 nodes", "HSDP with replicate = nodes"]),
    (1, 3, ["mesh 1x3 (3 ranks) does not split over the 2 nodes"]),
])
def test_mesh_across_nodes_in_an_unsupported_layout_is_refused(world2, request, replicate, shard,
                                                              words):
    with pytest.raises(shardd.ShardError) as ei:
        shardd.Client(job=job_name(request), rank=0, shard=shard, replicate=replicate,
                      socket_path=world2.socket(0))
    assert ei.value.code == -P.E_MESH
    for w in words:
        assert w in ei.value.text


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("R,S,op,flags", [(2, 2, P.OP_REDUCE, P.REDUCE_ALL_REDUCE),
                                         (1, 4, P.OP_UNSHARD, 0), (1, 4, P.OP_REDUCE, 0)])
def test_killed_node_fails_the_other_node_ranks_within_the_timeout(request, R, S, op, flags):
    # node 0's ranks only: node 1's never attach (registration is node-local, so node 0's completes)
    with World(2) as world, attached(request, world, R, S, ranks=range(2)) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", SPECS), 2)
        # Rank 0's op waits in the job's collective when node 1 dies; rank 1's completes the
        # node's half after it is gone, so node 0 sends nothing that is in flight at the
        # death (Open MPI 4.1 may end a sender whose transfer fails: docs/MULTINODE.md).
        assert groups[0].submit(op, step=1, flags=flags, user_data=11)
        os.kill(world.pids[1], signal.SIGKILL)
        world.wait_gone(1)
        t0 = time.monotonic()
        assert groups[1].submit(op, step=1, flags=flags, user_data=11)
        comps = run_ranks(lambda r: clients[r].wait(timeout=TIMEOUT_S + 20), 2,
                          timeout=TIMEOUT_S + 30)
        took = time.monotonic() - t0
        what, lost = ("all-reduce", "; sharded grads not reduced") if R > 1 else ("exchange", "")
        head = (f"shardd: {'reduce' if op == P.OP_REDUCE else 'unshard'}(group 'g', step 1): {what} "
                "among 2 nodes failed for ranks 0..1 (node 0): node 1 (ranks 2..3) ")
        tail = f"{lost}; check its daemon (dead: relaunch the world)"
        for comp in comps:
            assert comp.user_data == 11
            assert comp.res in (-P.E_TIMEOUT, -P.E_PEER_DIED), comp
            # who got the error, the dead node and its global ranks, MPI's words, what to do
            if comp.res == -P.E_TIMEOUT:
                assert comp.msg == f"{head}did not answer within {TIMEOUT_S} s{tail}", comp.msg
            else:
                assert comp.msg.startswith(f"{head}is lost: ") and comp.msg.endswith(tail), comp.msg
        assert took < TIMEOUT_S + 10, f"the errors took {took:.1f} s"
        # the surviving daemon keeps serving its ranks and their state
        for c in clients:
            c.nop()
        if R > 1:  # HSDP: a reduce without the all-reduce stays on the node
            run_ranks(lambda r: groups[r].reduce(2), 2)


@pytest.mark.timeout_s(60)
def test_stalled_node_fails_the_reduce_then_the_next_one_pairs_up_again(request):
    """A daemon stopped (SIGSTOP) past the timeout: the other node's reduce
    fails naming it; once it runs again, its queued reduce gets node 0's
    reduce-scatter half, which was on its way, but not the all-gather half
    node 0 never sent, so it fails naming node 0 within its timeout; its
    late message is dropped by node 0, and the next reduce of the group
    succeeds on both."""
    R, S = 2, 2
    with World(2) as world, attached(request, world, R, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", SPECS), R * S)
        os.kill(world.pids[1], signal.SIGSTOP)
        try:
            for r in (2, 3):  # queued in node 1's rings while it is stopped
                assert groups[r].submit(P.OP_REDUCE, step=1, flags=P.REDUCE_ALL_REDUCE, user_data=21)

            def failed(r):
                with pytest.raises(shardd.ShardError) as ei:
                    groups[r].reduce(1, P.REDUCE_ALL_REDUCE)
                return ei.value

            for e in run_ranks(failed, 2, timeout=TIMEOUT_S + 20):
                assert e.code == -P.E_TIMEOUT and e.text.endswith(
                    "reduce(group 'g', step 1): all-reduce among 2 nodes failed for ranks 0..1 (node 0): "
                    f"node 1 (ranks 2..3) did not answer within {TIMEOUT_S} s; sharded grads not reduced; "
                    "check its daemon (dead: relaunch the world)"), e
        finally:
            os.kill(world.pids[1], signal.SIGCONT)
        # node 1's step-1 reduce waits for node 0's all-gather half, which node 0 never sends
        for r in (2, 3):
            comp = clients[r].wait(timeout=TIMEOUT_S + 20)
            assert comp.user_data == 21 and comp.res == -P.E_TIMEOUT, comp
            assert comp.msg == (
                "shardd: reduce(group 'g', step 1): all-reduce among 2 nodes failed for ranks 2..3 (node 1): "
                f"node 0 (ranks 0..1) did not answer within {TIMEOUT_S} s; sharded grads not reduced; "
                "check its daemon (dead: relaunch the world)"), comp
        grads = exact_grads(9, R * S)
        for r, g in enumerate(groups):
            g.zero_grad()
            for i in range(len(SPECS)):
                g.grad(i)[...] = grads[0][r][i]
        run_ranks(lambda r: groups[r].reduce(2, P.REDUCE_ALL_REDUCE), R * S)
        total = [sum(grads[0][q][i] for q in range(R * S)) / np.float32(R * S) for i in range(len(SPECS))]
        for r, g in enumerate(groups):
            for i in range(len(SPECS)):
                np.testing.assert_array_equal(np.array(g.shard_grad(i, padded=True)),
                                              shard_of(total[i], S, r % S),
                                              err_msg=f"rank {r} param {i}")


def fsdp_specs():
    # dim-0 padding (7 rows over 4 or 6 shards), a 1-d param, a Shard(1) param
    return [("w", "fp32", (7, 3)), ("b", "fp32", (5,)), shardd.Param("t", "fp32", (2, 12), shard_dim=1)]


@pytest.mark.timeout_s(90)
@pytest.mark.parametrize("nodes,dtype", [(2, "fp32"), (3, "reduce")])
def test_fsdp_across_nodes_unshards_and_reduces_over_every_rank(request, nodes, dtype):
    """Mesh 1 x (nodes * 2): every rank's shard comes from the whole shard
    group. Unshard gives every rank the full params; reduce of exactly
    representable grads gives shard r of the average over every rank
    (the sums exact in fp32 whatever the order, one rounding of the divide),
    accumulated in fp32 over two reduces."""
    S = nodes * 2
    specs = fsdp_specs()
    shapes = [(7, 3), (5,), (2, 12)]
    dims = [0, 0, 1]
    rng = np.random.default_rng(20 + nodes)
    fulls = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    grads = [[[(rng.integers(-256, 256, size=sh) / 64).astype(np.float32) for sh in shapes]
              for _ in range(S)] for _ in range(2)]
    with World(nodes, ["--internode-dtype", dtype]) as world, attached(request, world, 1, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", specs), S)
        assert all(g.shard_world == S for g in groups)
        for g in groups:
            for i, f in enumerate(fulls):
                g.load_full(i, f)
        run_ranks(lambda r: groups[r].unshard(1), S)
        for r, g in enumerate(groups):
            for i, f in enumerate(fulls):
                np.testing.assert_array_equal(g.unsharded(i), f, err_msg=f"rank {r} param {i}")
        for mb in range(2):
            for r, g in enumerate(groups):
                for i in range(len(shapes)):
                    g.grad(i)[...] = grads[mb][r][i]
            run_ranks(lambda r: groups[r].reduce(1), S)
        for i, sh in enumerate(shapes):
            # per reduce: the exact sum divided once in fp32; the second accumulates in fp32
            avgs = [(sum(np.asarray(grads[mb][q][i], dtype=np.float64) for q in range(S)) / S)
                    .astype(np.float32) for mb in range(2)]
            avg = avgs[0] + avgs[1]
            for r, g in enumerate(groups):
                np.testing.assert_array_equal(np.array(g.shard_grad(i, padded=True)),
                                              shard_of(avg, S, r, dims[i]),
                                              err_msg=f"rank {r} param {i}")


@pytest.mark.timeout_s(120)
def test_fsdp_unshard_gathers_its_own_node_while_the_others_travel(request):
    """Mesh 1 x 6 over 3 nodes: each node gathers its own shards during the
    exchange and the others' after it (node 1 has shards on both sides of
    its own). Odd dim-0 rows whose last shards hold padding only, a param
    without elements, a Shard(1) param with several outer indices; a second
    unshard of new values rewrites every element of the copy."""
    nodes, S = 3, 6
    specs = [("w", "fp32", (13, 5)), ("e", "fp32", (0, 4)),
             shardd.Param("t", "fp32", (3, 18), shard_dim=1), ("b", "bf16", (5,))]
    rng = np.random.default_rng(33)
    with World(nodes) as world, attached(request, world, 1, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", specs), S)
        for step in (1, 2):
            fulls = [rng.standard_normal(sh).astype(np.float32) for sh in ((13, 5), (0, 4), (3, 18))]
            fulls.append(shardd.bf16_to_fp32(shardd.fp32_to_bf16(
                rng.standard_normal(5).astype(np.float32))))
            for g in groups:
                for i, f in enumerate(fulls):
                    g.load_full(i, f)
            run_ranks(lambda r: groups[r].unshard(step), S)
            for r, g in enumerate(groups):
                for i, f in enumerate(fulls):
                    got = g.unsharded(i)
                    got = shardd.bf16_to_fp32(got) if i == 3 else got  # "b" is bf16
                    np.testing.assert_array_equal(got, f, err_msg=f"step {step} rank {r} param {i}")
            run_ranks(lambda r: groups[r].reshard(step), S)


@pytest.mark.timeout_s(120)
def test_fsdp_bf16_across_nodes_matches_one_daemon_within_one_rounding(request):
    """bf16 grads reduced in bf16 over a 1x4 mesh on 2 nodes against one
    daemon with the same mesh: only the order of the fp32 additions differs,
    so each element is equal or one bf16 rounding step away."""
    S = 4
    specs = [("w", "fp32", (9, 5)), ("b", "fp32", (6,))]
    rng = np.random.default_rng(33)
    grads = [[[shardd.fp32_to_bf16(rng.standard_normal(sh).astype(np.float32))
               for _, _, sh in specs] for _ in range(S)] for _ in range(2)]

    def run(clients):
        groups = run_ranks(lambda r: clients[r].register_group("g", specs, param_dtype="bf16"), S)
        for mb in range(2):
            for r, g in enumerate(groups):
                for i in range(len(specs)):
                    g.grad(i)[...] = grads[mb][r][i]
            run_ranks(lambda r: groups[r].reduce(4), S)
        return [[np.array(g.shard_grad(i, padded=True), dtype=np.float32) for i in range(len(specs))]
                for g in groups]

    multi, one = across_nodes_and_on_one_daemon(request, 2, 1, S, run)
    for r in range(S):
        for i in range(len(specs)):
            a, b = multi[r][i], one[r][i]
            # one bf16 step of the value (8 bits of mantissa), per reduce: two reduces accumulate
            step = np.maximum(np.abs(b), 2.0 ** -126) * 2.0 ** -7
            assert np.all(np.abs(a - b) <= 2 * step), f"rank {r} param {i}: {np.max(np.abs(a - b))}"


def train(clients, R, S, steps=6):
    """A least-squares model trained through the daemons: each rank unshards
    W, computes its data's gradient in numpy, reduces (HSDP: all-reduce
    among replicas) and steps with the daemons' SGD with momentum. Returns
    the losses and every rank's final shard of W."""
    n = R * S
    rng = np.random.default_rng(42)
    w0 = (rng.standard_normal((8, 3)) * 0.1).astype(np.float32)
    data = [(rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32))
            for _ in range(n)]
    opt = shardd.Optimizer.sgd(momentum=0.9)
    groups = run_ranks(lambda r: clients[r].register_group("model", [("W", "fp32", (8, 3))], optimizer=opt), n)
    for g in groups:
        g.load_full(0, w0)
    flags = P.REDUCE_ALL_REDUCE if R > 1 else 0
    losses = []
    for step in range(1, steps + 1):
        run_ranks(lambda r: groups[r].unshard(step), n)
        loss = 0.0
        for r, g in enumerate(groups):
            X, Y = data[r]
            W = np.array(g.unsharded(0), dtype=np.float32)
            err = X @ W - Y
            loss += float(np.mean(err * err))
            g.grad(0)[...] = (np.float32(2.0 / len(X)) * (X.T @ err)).astype(np.float32)
        losses.append(loss / n)
        run_ranks(lambda r: groups[r].reduce(step, flags), n)
        run_ranks(lambda r: groups[r].step(step, 0.05), n)
    return losses, [np.array(g.shard(0, padded=True)) for g in groups]


@pytest.mark.timeout_s(120)
@pytest.mark.parametrize("R,S", [(2, 2), (1, 4)])
def test_training_on_two_nodes_matches_one_node_with_four_ranks(request, R, S):
    """2 nodes x 2 ranks against one daemon with 4 ranks, same mesh: HSDP
    gives the same bits; FSDP the same up to fp32 addition order."""
    (losses2, shards2), (losses1, shards1) = across_nodes_and_on_one_daemon(
        request, 2, R, S, lambda clients: train(clients, R, S))
    assert losses2[-1] < losses2[0], losses2
    for r in range(R * S):
        if R > 1:
            np.testing.assert_array_equal(shards2[r], shards1[r], err_msg=f"rank {r}")
        else:
            np.testing.assert_allclose(shards2[r], shards1[r], rtol=1e-5, atol=1e-6, err_msg=f"rank {r}")
    np.testing.assert_allclose(losses2, losses1, rtol=1e-5)


@pytest.mark.timeout_s(60)
def test_group_registered_differently_on_two_nodes_fails_the_all_reduce_naming_both(world2, request):
    """Node 0's ranks register 'g' with 7 rows, node 1's with 9 (the same
    bytes per shard once aligned): the exchange carries a digest of the
    params, so the all-reduce fails as a mismatch on both nodes instead of
    mixing bytes of different groups."""
    R, S = 2, 2
    with attached(request, world2, R, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group(
            "g", [("w", "fp32", (7 if r < S else 9, 3))]), R * S)

        def reduce(r):
            with pytest.raises(shardd.ShardError) as ei:
                groups[r].reduce(1, P.REDUCE_ALL_REDUCE)
            return ei.value

        for r, e in enumerate(run_ranks(reduce, R * S, timeout=TIMEOUT_S + 20)):
            assert e.code == -P.E_MISMATCH, e
            assert "disagree on the group's params" in e.text and f"node {1 - r // S} sent" in e.text, e.text


@pytest.mark.timeout_s(90)
@pytest.mark.parametrize("nodes", [2, 3])
def test_grad_norm_of_fsdp_across_nodes_is_the_total_over_every_node(request, nodes):
    """Mesh 1 x (nodes * 2): each node holds only its ranks' shards, so
    grad_norm sums the nodes' parts; every rank of every node gets the norm
    of the whole reduced grad (2-norm and inf-norm), padding rows excluded."""
    S = nodes * 2
    specs = fsdp_specs()
    shapes = [(7, 3), (5,), (2, 12)]
    rng = np.random.default_rng(40 + nodes)
    grads = [[(rng.integers(-256, 256, size=sh) / 64).astype(np.float32) for sh in shapes] for _ in range(S)]
    with World(nodes) as world, attached(request, world, 1, S) as clients:
        groups = run_ranks(lambda r: clients[r].register_group("g", specs), S)
        for r, g in enumerate(groups):
            for i in range(len(shapes)):
                g.grad(i)[...] = grads[r][i]
        run_ranks(lambda r: groups[r].reduce(1), S)
        # the reduced grad: the exact sum divided once in fp32
        avg = [(sum(np.asarray(grads[q][i], dtype=np.float64) for q in range(S)) / S).astype(np.float32)
               for i in range(len(shapes))]
        flat = np.concatenate([a.ravel().astype(np.float64) for a in avg])
        want2, wantinf = float(np.sqrt(np.sum(flat * flat))), float(np.max(np.abs(flat)))
        for norm_type, want in ((2.0, want2), (math.inf, wantinf)):
            got = run_ranks(lambda r: clients[r].grad_norm(1, norm_type), S)
            for r, (norm, nonfinite) in enumerate(got):
                assert not nonfinite
                assert norm == pytest.approx(want, rel=1e-6), (r, norm_type, norm, want)
                assert norm == got[0][0], "every rank of every node gets the same bits"


@pytest.mark.timeout_s(60)
def test_grad_norm_of_fsdp_across_nodes_fails_naming_a_killed_node(request):
    """Mesh 1 x 4 over 2 nodes, node 1's daemon killed: node 0's ranks'
    grad_norm fails within the timeout naming node 1, and the surviving
    daemon keeps serving them."""
    S = 4
    with World(2) as world, attached(request, world, 1, S, ranks=range(2)) as clients:  # node 0's ranks
        run_ranks(lambda r: clients[r].register_group("g", fsdp_specs()), 2)
        os.kill(world.pids[1], signal.SIGKILL)
        world.wait_gone(1)
        t0 = time.monotonic()

        def failed(r):
            with pytest.raises(shardd.ShardError) as ei:
                clients[r].grad_norm(1, timeout=TIMEOUT_S + 20)
            return ei.value

        for e in run_ranks(failed, 2, timeout=TIMEOUT_S + 30):
            assert e.code in (-P.E_TIMEOUT, -P.E_PEER_DIED), e
            assert "node 1 (ranks 2..3)" in e.text, e.text
        assert time.monotonic() - t0 < TIMEOUT_S + 10
        for c in clients:
            c.nop()

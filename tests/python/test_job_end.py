# SPDX-License-Identifier: MIT
"""`shardctl end JOB` as the Python client sees it: every rank of the ended
job gets an error that says the job was ended by an admin request, naming
the job (SHARDD_E_SHUTDOWN, not DaemonGone: the daemon lives), whatever call
it makes next, while the daemon goes on serving its other jobs."""

import pytest

import shardd
from shardd import proto as P
from conftest import attach, attached, job_name, run_ranks, run_shardctl

SPECS = [("w", "fp32", (4, 3))]


def ended_by_admin(text, job):
    return f"job '{job}' was ended by an admin request (shardctl end from pid" in text


def assert_ended(err, job):
    assert not isinstance(err, shardd.DaemonGone), f"a daemon-gone error: {err}"
    assert err.code == -P.E_SHUTDOWN, f"code {err.name}: {err}"
    assert ended_by_admin(str(err), job), str(err)


@pytest.mark.timeout_s(40)
@pytest.mark.parametrize("exec_", ["daemon", "ranks"])
def test_end_fails_every_rank_with_the_admin_end_not_daemon_gone(daemon, request, exec_):
    job = job_name(request)
    with attached(request, daemon, 1, 3) as clients, \
            attach(daemon, request, 0, 1, 1, suffix="-other") as other:
        groups = run_ranks(lambda r: clients[r].register_group("g", SPECS, exec=exec_), 3)
        # One op together first: every rank has mapped its peers' buffers (rank-executed).
        run_ranks(lambda r: (groups[r].unshard(0), groups[r].reshard(0)), 3)
        # Rank 0's unshard waits for ranks 1 and 2 when the job ends: in its rendezvous
        # (daemon-executed), or published to them (rank-executed: the daemon never sees it).
        assert groups[0].submit(shardd.OP_UNSHARD, step=1, user_data=7)
        while exec_ == "daemon" and clients[0].ring_status()["sq_pending"]:
            pass
        out = run_shardctl(daemon.socket, "end", job)
        assert out.returncode == 0, out.stderr
        assert f"ended job '{job}': 3 ranks were attached" in out.stdout, out.stdout

        comp = clients[0].wait(timeout=10)
        assert comp.user_data == 7 and comp.res == -P.E_SHUTDOWN, comp
        assert ended_by_admin(comp.msg, job), comp.msg
        # Each rank's next call says the same, be it a wait, an op or a control request.
        with pytest.raises(shardd.ShardError) as ei:
            clients[0].wait(timeout=10)
        assert_ended(ei.value, job)
        with pytest.raises(shardd.ShardError) as ei:
            clients[1].nop()
        assert_ended(ei.value, job)
        with pytest.raises(shardd.ShardError) as ei:
            clients[2].open_group("g")
        assert_ended(ei.value, job)
        # And again: the notice is kept, not consumed by the first error.
        for c in clients:
            with pytest.raises(shardd.ShardError) as ei:
                c.barrier(1)
            assert_ended(ei.value, job)

        # The daemon goes on serving its other jobs, and new ones.
        assert daemon.proc.poll() is None
        other.nop()
        other.barrier(1)
        with attach(daemon, request, 0, 1, 1, suffix="-after") as after:
            after.nop()

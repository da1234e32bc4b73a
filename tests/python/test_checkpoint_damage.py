# SPDX-License-Identifier: MIT
"""Checkpoints an operator meets off the happy path (docs/CHECKPOINTS.md,
issue 30): a rank that skipped a step alone, a damaged or manifest-less
newest checkpoint (restore falls back and moves it aside), and a full disk
whose message reaches the ranks, the log and `shardctl checkpoints`."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

import shardd
import shardd.proto as P
from conftest import Daemon, attach, attached, job_name, run_shardctl, run_ranks, shardctl_json

WORLD = 2
SPECS = [("w", "float32", (9, 5)), ("b", "float32", (7,))]


def step_dir(root, step):
    return os.path.join(root, f"step-{step:012d}")


def logged(daemon, pred, timeout=10):
    """Whether a line of the daemon's stderr satisfies pred within timeout s
    (it is read by a thread, so a line may come after the reply it precedes)."""
    deadline = time.monotonic() + timeout
    while not any(pred(line) for line in list(daemon.lines)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def metrics(daemon):
    """`shardctl metrics`: {series with its labels: value}."""
    out = run_shardctl(daemon.socket, "metrics")
    assert out.returncode == 0, out.stderr
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in out.stdout.splitlines() if line and not line.startswith("#")}


def restores(daemon, job):
    """The job's restores as `shardctl --json checkpoints` and its text show them."""
    text = run_shardctl(daemon.socket, "checkpoints", job)
    assert text.returncode == 0, text.stderr
    return shardctl_json(daemon.socket, "checkpoints", job)["restore"], text.stdout


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
    assert logged(state_daemon, lambda line: "applied different numbers of updates" in line)


def two_checkpoints(request, daemon, opt):
    """A job that checkpointed steps 1 and 2 into the state dir: its root and
    the full tensors of each rank's shards at step 1."""
    rng = np.random.default_rng(11)
    with attached(request, daemon, 1, WORLD) as clients:
        gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt), WORLD)
        fill(gs, rng, "shard")
        train(clients, gs, [1], seed=12)
        run_ranks(lambda r: clients[r].checkpoint(1), WORLD)
        at1 = [[gs[r].shard(i).copy() for i in range(len(SPECS))] for r in range(WORLD)]
        train(clients, gs, [2], seed=13)
        run_ranks(lambda r: clients[r].checkpoint(2), WORLD)
    return os.path.join(daemon.state, job_name(request)), at1


def resume_falls_back_to_step_1(request, daemon, opt, root, at1, damage, reason, why):
    """A copy of the job's checkpoints under another job name, its step 2
    damaged by `damage`, restored with restore="": step 1 comes back, step 2
    is moved aside (the log, `shardctl checkpoints` and the fallback counter
    of `reason` say which and `why`), and step 2 can be checkpointed again."""
    back = root + "-back"
    shutil.copytree(root, back)
    damage(step_dir(back, 2))
    series = f'shardd_restore_fallbacks_total{{reason="{reason}"}}'
    before = metrics(daemon)
    with attached(request, daemon, 1, WORLD, suffix="-back") as clients:
        gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt, restore=""), WORLD)
        assert [g.last_step for g in gs] == [1, 1]
        for r in range(WORLD):
            for i in range(len(SPECS)):
                assert np.array_equal(gs[r].shard(i), at1[r][i]), (r, SPECS[i][0])
        assert not os.path.exists(step_dir(back, 2))
        assert os.path.isdir(step_dir(back, 2) + ".damaged")
        said = (f"skipped damaged checkpoint {step_dir(back, 2)}: ", why,
                f"; moved it aside to {step_dir(back, 2)}.damaged (inspect or delete it)")
        assert logged(daemon, lambda line: all(w in line for w in said))
        seen, text = restores(daemon, job_name(request) + "-back")
        assert (seen["restored"], seen["failed"], seen["fallbacks"], seen["last_failed"]) == (1, 0, 1, None), seen
        assert (seen["last_fallback"]["group"], seen["last_fallback"]["reason"]) == ("layer", reason), seen
        assert all(w in seen["last_fallback"]["error"] for w in said), seen
        assert "  restores: 1 restored, 0 failed, 1 damaged checkpoints skipped\n" in text, text
        assert f"  last fallback: group 'layer' ({reason}): {seen['last_fallback']['error']}\n" in text, text
        after = metrics(daemon)
        assert after[series] == before[series] + 1
        assert after["shardd_restores_total"] == before["shardd_restores_total"] + 1
        train(clients, gs, [2], seed=13)
        run_ranks(lambda r: clients[r].checkpoint(2), WORLD)
    assert os.path.isfile(os.path.join(step_dir(back, 2), "manifest.json"))


def test_a_newest_checkpoint_without_manifest_is_damaged_not_imported(state_daemon, request):
    opt = shardd.Optimizer.adamw(weight_decay=0.0)
    root, at1 = two_checkpoints(request, state_daemon, opt)
    os.unlink(os.path.join(step_dir(root, 2), "manifest.json"))
    # Named, it is refused as damaged rather than imported as plain weights,
    # and the refusal is counted and shown with its whole message.
    failed = 'shardd_restores_failed_total{reason="damaged"}'
    before = metrics(state_daemon)
    with attached(request, state_daemon, 1, WORLD, suffix="-named") as clients:
        with pytest.raises(shardd.ShardError, match=r"is a damaged checkpoint: it has no manifest\.json"):
            run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt,
                                                          restore=step_dir(root, 2)), WORLD)
        seen, text = restores(state_daemon, job_name(request) + "-named")
        assert (seen["restored"], seen["failed"], seen["fallbacks"], seen["last_fallback"]) == (0, 1, 0, None)
        last = seen["last_failed"]
        assert (last["group"], last["reason"]) == ("layer", "damaged"), seen
        assert last["error"].startswith(f"shardd: register group 'layer': restore: '{step_dir(root, 2)}' is a "
                                        "damaged checkpoint: it has no manifest.json"), last
        assert "copy its model*.safetensors into a folder of their own" in last["error"], last
        assert f"  last failed restore: group 'layer' (damaged): {last['error']}\n" in text, text
        after = metrics(state_daemon)
        assert after[failed] == before[failed] + 1
        job = job_name(request) + "-named"
        assert any(k.startswith(f'shardd_restore_last_error{{job="{job}",group="layer",reason="damaged",'
                                f'error="shardd: register group \'layer\': restore: ') for k in after), after
        assert logged(state_daemon, lambda line: f"job '{job}': {last['error']}" in line)
    # The copy lacks the manifest already.
    resume_falls_back_to_step_1(request, state_daemon, opt, root, at1, lambda d: None, "missing",
                                f"cannot read {step_dir(root + '-back', 2)}/manifest.json: No such file or directory")


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(state_daemon, request):
    opt = shardd.Optimizer.adamw(weight_decay=0.0)
    root, at1 = two_checkpoints(request, state_daemon, opt)

    def truncate(d):
        os.truncate(os.path.join(d, "optim.safetensors"), 100)
    resume_falls_back_to_step_1(request, state_daemon, opt, root, at1, truncate, "damaged",
                                f"{step_dir(root + '-back', 2)}/optim.safetensors is 100 bytes, the manifest "
                                "records ")


def test_a_newest_checkpoint_failing_its_crc_is_moved_aside_and_the_next_restore_falls_back(state_daemon,
                                                                                             request):
    opt = shardd.Optimizer.adamw(weight_decay=0.0)
    root, at1 = two_checkpoints(request, state_daemon, opt)
    back = root + "-back"
    shutil.copytree(root, back)
    model = os.path.join(step_dir(back, 2), "model.safetensors")
    with open(model, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    failed = 'shardd_restores_failed_total{reason="damaged"}'
    before = metrics(state_daemon)
    with attached(request, state_daemon, 1, WORLD, suffix="-back") as clients:
        with pytest.raises(shardd.ShardError, match=r"CRC-32 .*moved it aside to .*step-000000000002\.damaged"):
            run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt, restore=""), WORLD)
        assert logged(state_daemon, lambda line: "CRC-32" in line and "register group 'layer'" in line)
        seen, text = restores(state_daemon, job_name(request) + "-back")
        last = seen["last_failed"]
        assert (seen["failed"], last["group"], last["reason"]) == (1, "layer", "damaged"), seen
        assert re.fullmatch(
            rf"shardd: register group 'layer': restore: {re.escape(model)}: CRC-32 [0-9a-f]{{8}}, the manifest "
            rf"records [0-9a-f]{{8}}: the file changed or is damaged; moved it aside to "
            rf"{re.escape(step_dir(back, 2))}\.damaged: register again \(restore \"\"\) to resume from the newest "
            r"complete one before it", last["error"]), last
        assert f"  last failed restore: group 'layer' (damaged): {last['error']}\n" in text, text
        assert metrics(state_daemon)[failed] == before[failed] + 1
        gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt, restore=""), WORLD)
        assert [g.last_step for g in gs] == [1, 1]
        seen, _ = restores(state_daemon, job_name(request) + "-back")
        assert (seen["restored"], seen["failed"], seen["fallbacks"]) == (1, 1, 0), seen
        for r in range(WORLD):
            for i in range(len(SPECS)):
                assert np.array_equal(gs[r].shard(i), at1[r][i]), (r, SPECS[i][0])


def test_a_restore_that_does_not_match_the_group_is_counted_and_says_what_to_do(state_daemon, request):
    opt = shardd.Optimizer.adamw(weight_decay=0.0)
    root, _ = two_checkpoints(request, state_daemon, opt)
    wider = [("w", "float32", (9, 6)), SPECS[1]]
    failed = 'shardd_restores_failed_total{reason="mismatch"}'
    before = metrics(state_daemon)
    with attached(request, state_daemon, 1, WORLD, suffix="-wide") as clients:
        with pytest.raises(shardd.ShardError, match="the group registers fp32 \\[9, 6\\], the file holds"):
            run_ranks(lambda r: clients[r].register_group("layer", wider, optimizer=opt, restore=root), WORLD)
        seen, text = restores(state_daemon, job_name(request) + "-wide")
    last = seen["last_failed"]
    assert (seen["restored"], seen["failed"], last["reason"]) == (0, 1, "mismatch"), seen
    assert last["error"] == (f"shardd: register group 'layer': restore: tensor 'w' in {step_dir(root, 2)}/"
                             "model.safetensors: the group registers fp32 [9, 6], the file holds fp32 [9, 5]; "
                             "register the group as it was saved (its names, dtypes and shapes), or restore a "
                             "checkpoint of this group"), last
    assert f"  last failed restore: group 'layer' (mismatch): {last['error']}\n" in text, text
    assert metrics(state_daemon)[failed] == before[failed] + 1


@pytest.fixture
def tiny_fs():
    """A 256 KiB tmpfs (root only: skipped where it cannot be mounted)."""
    with tempfile.TemporaryDirectory(prefix="shardd-py-tiny-") as mnt:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs to fill: {r.stderr.strip()}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", mnt], check=True)


@pytest.mark.parametrize("extra", [(), ("--max-memory", "2M")], ids=["snapshot", "in_place"])
def test_a_full_disk_fails_the_checkpoint_with_its_whole_message_everywhere(tiny_fs, request, extra):
    big = [("w", "float32", (300, 300))]  # 360 000 bytes: more than the filesystem holds
    with Daemon(("--state-dir", tiny_fs, "--log-level", "info", *extra)) as d:
        job = job_name(request)
        with attached(request, d, 1, WORLD) as clients:
            run_ranks(lambda r: clients[r].register_group("layer", big), WORLD)
            with pytest.raises(shardd.ShardError) as e:
                run_ranks(lambda r: clients[r].checkpoint(1), WORLD)
            # A rank's error text holds 256 bytes: what failed, where and what to do come first.
            msg = str(e.value)
            # The file's bytes are reserved before any is written: its tensor's and its header's.
            m = re.search(r"No space left on device allocating the (\d+) bytes of model\.safetensors of group "
                          r"'layer': ", msg)
            assert m and 360000 + 8 < int(m.group(1)) < 360000 + 4096, msg
            why = m.group(0)
            assert ": free space there or lower shardd --keep, then checkpoint again; earlier checkpoints " \
                   "are intact (checkpoint " in msg, msg
            last = shardctl_json(d.socket, "checkpoints", job)["last"]
            assert last["code"] != 0 and why in last["error"], last
            assert last["staged"] == (extra == ()), last
            metrics = subprocess.run([os.path.join(os.environ.get("SHARDD_BUILD", "build"), "shardctl"),
                                      "--socket", d.socket, "metrics"], capture_output=True, text=True,
                                     timeout=30).stdout
            assert f'shardd_checkpoint_last_error{{job="{job}",error="' in metrics, metrics
            assert logged(d, lambda line: f"job '{job}'" in line and why in line), d.lines
        assert os.listdir(os.path.join(tiny_fs, job)) == []


@pytest.mark.timeout_s(90)
def test_a_job_ended_during_a_bounded_write_does_not_wait_out_the_bound(request):
    """shardd --checkpoint-rate 1: an 8 MiB AdamW param's files (24 MiB) would
    take 25 s at the bound. `shardctl end` while they are written ends the job
    at once instead (the rest of the snapshot goes out at the disk's speed),
    the checkpoint fails naming the end, and no step folder is left."""
    spec = [("w", "float32", (2048, 1024))]
    opt = shardd.Optimizer.adamw(weight_decay=0.0)
    with tempfile.TemporaryDirectory(prefix="shardd-py-state-") as state, \
            Daemon(("--state-dir", state, "--checkpoint-rate", "1", "--log-level", "info")) as d:
        job = job_name(request)
        with attached(request, d, 1, WORLD) as clients:
            gs = run_ranks(lambda r: clients[r].register_group("layer", spec, optimizer=opt), WORLD)
            run_ranks(lambda r: gs[r].reduce(1), WORLD)
            run_ranks(lambda r: gs[r].step(1, 0.01), WORLD)
            for c in clients:
                assert c.submit(P.OP_CHECKPOINT, 0, 1, 0, 7)
            assert logged(d, lambda line: f"job '{job}': checkpoint of step 1 into" in line and
                          "started" in line), d.lines
            t0 = time.monotonic()
            out = run_shardctl(d.socket, "end", job)
            took = time.monotonic() - t0
            assert out.returncode == 0, out.stderr
            assert took < 10, took
            assert logged(d, lambda line: f"job '{job}'" in line and
                          "ended while its checkpoint was written" in line), d.lines
        assert not os.path.exists(step_dir(os.path.join(state, job), 1))

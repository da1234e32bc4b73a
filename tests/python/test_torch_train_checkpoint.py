# SPDX-License-Identifier: MIT
"""Checkpoints of shardd.torch models with several fully_shard groups.

client/examples/train_torch.py --checkpoint-every 3 --restart-at 7: the
ranks train 7 steps with a checkpoint every 3, the daemon is killed with
SIGKILL and started again on the same --state-dir, the ranks resume from
the step-6 checkpoint (params and the SGD momentum) and train to step 8;
the example compares the result with its uninterrupted single-process
reference (tolerance derived in its docstring).

And the names: under a DaemonOptimizer each fully_shard registers its params
by their names in the whole model (torch's state_dict keys), so a model
whose fc1 and fc2 are two groups (both with a 'weight') can be checkpointed,
and the checkpoint's safetensors files load into the unsharded torch model
with its own load_state_dict, equal to a torch reference trained alike."""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import shardd.torch as st
from conftest import ROOT, Daemon, job_name, run_ranks, shardd_bin
from torch_net import train

EXAMPLE = os.path.join(ROOT, "client", "examples", "train_torch.py")
LR, MOMENTUM = 0.05, 0.9

torch.set_num_threads(1)


@pytest.mark.timeout_s(180)
def test_train_torch_resumes_after_daemon_sigkill_and_matches_reference():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    p = subprocess.run([sys.executable, EXAMPLE, "--shardd", shardd_bin(), "--ranks", "2", "--steps", "8",
                        "--checkpoint-every", "3", "--restart-at", "7"], env=env,
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    for r in range(2):
        assert f"rank {r} start at step 0 (no checkpoint to resume from)" in p.stdout, p.stdout
        assert f"rank {r} resume at step 6\n" in p.stdout, p.stdout
    resumed = [ln for ln in p.stdout.splitlines() if ln.startswith("rank 0 step ")]
    # Steps 0-6 in the first run, 6-7 again after the restart.
    assert [int(ln.split()[3]) for ln in resumed] == [0, 1, 2, 3, 4, 5, 6, 6, 7], p.stdout
    assert "daemon restarted after step 6) match the single-process reference" in p.stdout, p.stdout


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7)
        self.fc2 = torch.nn.Linear(7, 7)
        self.head = torch.nn.Linear(7, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make():
    torch.manual_seed(3)
    return Net()


def batches(n):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def read_checkpoint(path, tmp):
    """{tensor name: tensor} of a checkpoint's model files (the HF index's weight_map), read by
    the safetensors package in the tests' virtual environment ($SHARDD_VENV, make deps)."""
    venv = os.environ.get("SHARDD_VENV") or os.path.join(ROOT, "build", "venv")
    py = os.path.join(venv, "bin", "python")
    if not os.access(py, os.X_OK):
        pytest.fail(f"no Python virtual environment at {venv} with the safetensors package: "
                    "run make deps (or set SHARDD_VENV)")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = os.path.join(tmp, "tensors.npz")
    code = ("import sys, numpy as np, safetensors.numpy as sf; d = {}\n"
            "for f in sys.argv[2:]: d.update(sf.load_file(f))\n"
            "np.savez(sys.argv[1], **d)")
    r = subprocess.run([py, "-c", code, out, *(os.path.join(path, n) for n in files)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    with np.load(out) as z:
        return {k: torch.from_numpy(z[k]) for k in z.files}


@pytest.mark.timeout_s(90)
def test_checkpoint_of_nested_groups_loads_into_the_unsharded_torch_model(request):
    job = job_name(request)
    data = batches(3)
    with tempfile.TemporaryDirectory(prefix="shardd-torch-names-") as state:
        d = Daemon(("--state-dir", state))
        try:
            models = [make() for _ in range(2)]
            meshes = [st.init_device_mesh(job, r, (2,), socket_path=d.socket) for r in range(2)]
            try:
                opts = [st.DaemonSGD(m, lr=LR, momentum=MOMENTUM) for m in models]

                def shard(r):
                    st.fully_shard(models[r].fc1, mesh=meshes[r])
                    st.fully_shard(models[r].fc2, mesh=meshes[r])
                    st.fully_shard(models[r], mesh=meshes[r])

                run_ranks(shard, 2)
                # Every rank trains on the same batches: the mean of equal grads is the grad itself.
                run_ranks(lambda r: train(models[r], opts[r], data), 2)
                assert run_ranks(lambda r: st.checkpoint(meshes[r]), 2) == [3, 3]
            finally:
                for m in meshes:
                    m.close()
        finally:
            d.stop()
        saved = read_checkpoint(os.path.join(state, job, "step-000000000003"), state)

    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    train(ref, opt, data)
    want = ref.state_dict()
    assert sorted(saved) == sorted(want)
    loaded = make()
    loaded.load_state_dict(saved)   # strict: every key of torch's own state_dict, its shapes
    for name, t in want.items():
        torch.testing.assert_close(loaded.state_dict()[name], t, rtol=0, atol=1e-6, msg=name)

# SPDX-License-Identifier: MIT
"""Checkpoints from the Python client, and interop with the `safetensors`
package from PyPI (installed by `make deps` into the virtual environment
$SHARDD_VENV, default build/venv, which sees Debian's numpy):

- Client.checkpoint writes files that safetensors.numpy.load_file reads
  into the same full tensors the ranks' shards assemble to (numpy concat
  along each param's shard dim);
- a model.safetensors written by safetensors.numpy.save_file, with a
  manifest the test writes (CRC-32 by zlib), restores into a 2-rank job,
  and register_group(restore=...) reports the saved step."""

import json
import os
import subprocess
import tempfile
import time
import zlib

import numpy as np
import pytest

import shardd
from conftest import ROOT, Daemon, attach, attached, job_name, run_ranks, shardd_bin

WORLD = 2
SPECS = [("w", "float32", (9, 5)), ("b", "float32", (7,)), ("c", "float32", (3, 4), 1)]


def venv_python():
    venv = os.environ.get("SHARDD_VENV") or os.path.join(ROOT, "build", "venv")
    py = os.path.join(venv, "bin", "python")
    if not os.access(py, os.X_OK):
        pytest.fail(f"no Python virtual environment at {venv} with the safetensors package: "
                    "run make deps (or set SHARDD_VENV)")
    return py


def in_venv(code, *args):
    """Run `code` with the venv's Python (which has safetensors); its stdout."""
    r = subprocess.run([venv_python(), "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def full(groups, i, spec):
    dim = spec[3] if len(spec) > 3 else 0
    return np.concatenate([g.shard(i) for g in groups], axis=dim)


def test_checkpoint_files_load_with_the_safetensors_package(state_daemon, request):
    job = job_name(request)
    rng = np.random.default_rng(5)
    with attached(request, state_daemon, 1, WORLD) as clients:
        opt = shardd.Optimizer.adamw(weight_decay=0.0)
        gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, optimizer=opt), WORLD)
        for r in range(WORLD):
            for i in range(len(SPECS)):
                gs[r].shard(i)[...] = rng.standard_normal(gs[r].shard(i).shape).astype(np.float32)
                gs[r].grad(i)[...] = rng.standard_normal(gs[r].grad(i).shape).astype(np.float32)
        run_ranks(lambda r: gs[r].reduce(1), WORLD)
        run_ranks(lambda r: gs[r].step(1, 0.01), WORLD)
        run_ranks(lambda r: clients[r].checkpoint(1), WORLD)
        ckpt = os.path.join(state_daemon.state, job, "step-000000000001")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "model.npz")
            in_venv("import sys, numpy as np, safetensors.numpy as st; "
                    "np.savez(sys.argv[2], **st.load_file(sys.argv[1]))",
                    os.path.join(ckpt, "model.safetensors"), out)
            loaded = np.load(out)
            assert sorted(loaded.files) == sorted(s[0] for s in SPECS)
            for i, spec in enumerate(SPECS):
                want = full(gs, i, spec)
                assert loaded[spec[0]].dtype == np.float32
                assert loaded[spec[0]].shape == spec[2]
                assert np.array_equal(loaded[spec[0]], want), spec[0]
            out = os.path.join(tmp, "optim.npz")
            in_venv("import sys, numpy as np, safetensors.numpy as st; "
                    "np.savez(sys.argv[2], **st.load_file(sys.argv[1]))",
                    os.path.join(ckpt, "optim.safetensors"), out)
            names = sorted(np.load(out).files)
            assert names == sorted(f"{s[0]}.{k}" for s in SPECS for k in ("exp_avg", "exp_avg_sq"))


def test_a_file_the_safetensors_package_wrote_restores_into_a_job(state_daemon, request):
    rng = np.random.default_rng(9)
    with tempfile.TemporaryDirectory() as ckpt:
        tensors = {s[0]: rng.standard_normal(s[2]).astype(np.float32) for s in SPECS}
        npz = os.path.join(ckpt, "in.npz")
        np.savez(npz, **tensors)
        model = os.path.join(ckpt, "model.safetensors")
        in_venv("import sys, numpy as np, safetensors.numpy as st; "
                "st.save_file(dict(np.load(sys.argv[1])), sys.argv[2])", npz, model)
        os.unlink(npz)
        data = open(model, "rb").read()
        manifest = {
            "format": "shardd-checkpoint", "version": 1, "job": "elsewhere", "step": 7,
            "mesh": {"replicate": 1, "shard": 3},
            "groups": [{"name": "layer", "param_dtype": "none", "reduce_dtype": "none",
                        "optimizer": None,
                        "params": [{"name": s[0], "dtype": "fp32", "shape": list(s[2]),
                                    "shard_dim": s[3] if len(s) > 3 else 0} for s in SPECS],
                        "last_step": 7, "optim_steps": 0, "file": "model.safetensors"}],
            "files": [{"name": "model.safetensors", "bytes": len(data),
                       "crc32": f"{zlib.crc32(data):08x}"}],
        }
        with open(os.path.join(ckpt, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        with attached(request, state_daemon, 1, WORLD) as clients:
            gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, restore=ckpt), WORLD)
            for r in range(WORLD):
                assert gs[r].last_step == 7
            for i, spec in enumerate(SPECS):
                assert np.array_equal(full(gs, i, spec), tensors[spec[0]]), spec[0]


def test_hugging_face_weights_import_with_bf16_to_fp32(state_daemon, request):
    """A model's plain bf16 weights, written by safetensors.torch in two
    files with a model.safetensors.index.json, import into an fp32 job by
    name; the reference is torch's own bf16 -> fp32 conversion."""
    with tempfile.TemporaryDirectory() as model:
        ref = os.path.join(model, "ref.npz")
        in_venv("""
import json, os, sys
import numpy as np, torch
from safetensors.torch import save_file
d, ref = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(3)
t = {"w": torch.randn(9, 5, generator=g).to(torch.bfloat16),
     "b": torch.randn(7, generator=g).to(torch.bfloat16),
     "c": torch.randn(3, 4, generator=g).to(torch.bfloat16),
     "unused": torch.zeros(2, dtype=torch.bfloat16)}
save_file({"w": t["w"], "unused": t["unused"]}, os.path.join(d, "model-00001-of-00002.safetensors"))
save_file({"b": t["b"], "c": t["c"]}, os.path.join(d, "model-00002-of-00002.safetensors"))
json.dump({"metadata": {"total_size": 0}, "weight_map": {
    "w": "model-00001-of-00002.safetensors", "unused": "model-00001-of-00002.safetensors",
    "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}},
    open(os.path.join(d, "model.safetensors.index.json"), "w"))
np.savez(ref, **{k: v.float().numpy() for k, v in t.items()})
""", model, ref)
        want = np.load(ref)
        with attached(request, state_daemon, 1, WORLD) as clients:
            gs = run_ranks(lambda r: clients[r].register_group("layer", SPECS, restore=model), WORLD)
            for i, spec in enumerate(SPECS):
                assert np.array_equal(full(gs, i, spec), want[spec[0]]), spec[0]
            assert gs[0].last_step == 0
        bad = [("w", "float32", (9, 6))] + SPECS[1:]
        with attached(request, state_daemon, 1, WORLD, suffix="-bad") as clients:
            with pytest.raises(shardd.ShardError, match=r"tensor 'w' in .*/model-00001-of-00002\.safetensors: "
                               r"the group registers fp32 \[9, 6\], the file holds bf16 \[9, 5\]"):
                run_ranks(lambda r: clients[r].register_group("layer", bad, restore=model), WORLD)


def test_two_groups_write_split_files_with_an_index_and_restore_at_one_rank(state_daemon, request):
    job = job_name(request)
    rng = np.random.default_rng(21)
    enc_specs = [("enc.w", "float32", (6, 3))]
    dec_specs = [("dec.w", "float32", (5, 2)), ("dec.b", "float32", (4,))]
    with attached(request, state_daemon, 1, WORLD) as clients:
        enc = run_ranks(lambda r: clients[r].register_group("enc", enc_specs), WORLD)
        dec = run_ranks(lambda r: clients[r].register_group("dec", dec_specs), WORLD)
        for gs, specs in ((enc, enc_specs), (dec, dec_specs)):
            for r in range(WORLD):
                for i in range(len(specs)):
                    gs[r].shard(i)[...] = rng.standard_normal(gs[r].shard(i).shape).astype(np.float32)
        want = {s[0]: full(gs, i, s) for gs, specs in ((enc, enc_specs), (dec, dec_specs))
                for i, s in enumerate(specs)}
        run_ranks(lambda r: clients[r].checkpoint(3), WORLD)
    ckpt = os.path.join(state_daemon.state, job, "step-000000000003")
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["weight_map"] == {"enc.w": "model-00001-of-00002.safetensors",
                                   "dec.w": "model-00002-of-00002.safetensors",
                                   "dec.b": "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    assert [g["name"] for g in manifest["groups"]] == ["enc", "dec"]
    assert all("optim_file" not in g or g["optim_file"] is None for g in manifest["groups"])
    for entry in manifest["files"]:
        data = open(os.path.join(ckpt, entry["name"]), "rb").read()
        assert entry["bytes"] == len(data) and entry["crc32"] == f"{zlib.crc32(data):08x}"
    # The same tensors at one rank: each shard is the whole tensor.
    with attach(state_daemon, request, 0, 1, 1, suffix="-one") as one:
        for name, specs in (("enc", enc_specs), ("dec", dec_specs)):
            g = one.register_group(name, specs, restore=ckpt)
            for i, s in enumerate(specs):
                assert np.array_equal(g.shard(i), want[s[0]]), s[0]


@pytest.mark.timeout_s(90)
def test_checkpoint_rate_bounds_the_snapshot_write_and_what_it_wrote_restores(request):
    """shardd --checkpoint-rate 8: a snapshot's whole 4 MiB chunks (2 of an
    8 MiB param's model.safetensors, 4 of its AdamW optim.safetensors) go out
    no faster than 8 MB/s over the checkpoint, so it completes no sooner than
    their bytes over the rate (unbounded, the disk writes them in well under
    a second); the files restore bit for bit (CRC-32 checked as read)."""
    rate, chunk = 8, 4 << 20
    spec = [("w", "float32", (2048, 1024))]
    opt = shardd.Optimizer.adamw(weight_decay=0.0)
    bad = subprocess.run([shardd_bin(), "--checkpoint-rate", "fast"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "--checkpoint-rate: 'fast' is not MB/s" in bad.stderr, bad.stderr
    with tempfile.TemporaryDirectory(prefix="shardd-py-state-") as state, \
            Daemon(("--state-dir", state, "--checkpoint-rate", str(rate))) as d:
        with attached(request, d, 1, WORLD) as clients:
            gs = run_ranks(lambda r: clients[r].register_group("layer", spec, optimizer=opt), WORLD)
            rng = np.random.default_rng(7)
            for g in gs:
                g.shard(0)[...] = rng.standard_normal(g.shard(0).shape).astype(np.float32)
                g.grad(0)[...] = rng.standard_normal(g.grad(0).shape).astype(np.float32)
            run_ranks(lambda r: gs[r].reduce(1), WORLD)
            run_ranks(lambda r: gs[r].step(1, 0.01), WORLD)
            want = [g.shard(0).copy() for g in gs]
            t0 = time.monotonic()
            run_ranks(lambda r: clients[r].checkpoint(1, timeout=60), WORLD)
            took = time.monotonic() - t0
        assert took >= 0.95 * 6 * chunk / (rate * 1e6), took
        ckpt = os.path.join(state, job_name(request), "step-000000000001")
        with attached(request, d, 1, WORLD, suffix="-back") as clients:
            gs = run_ranks(lambda r: clients[r].register_group("layer", spec, optimizer=opt, restore=ckpt),
                           WORLD)
            for r in range(WORLD):
                assert np.array_equal(gs[r].shard(0), want[r]), r

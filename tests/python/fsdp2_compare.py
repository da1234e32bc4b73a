# SPDX-License-Identifier: MIT
"""Compare two checkpoints of fsdp2_train.py, tensor by tensor, on the torch
that wrote them (test_torch_dropin.py runs it with build/venv-torch's python).

    fsdp2_compare.py A B

A and B: torch.save files, or torch.distributed.checkpoint folders (read
whole with dcp_to_torch_save). Prints one JSON object: the keys only A has
and only B has ("/"-joined paths into the nested state dicts), and for each
common tensor [shape in A, shape in B, dtype in A, dtype in B, max |a - b|,
max |b|]; a common non-tensor value that differs is listed with both values."""

import json
import os
import sys
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def load(path):
    if not os.path.isdir(path):
        return torch.load(path, weights_only=False)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "whole.pt")
        dcp_to_torch_save(path, out)
        return torch.load(out, weights_only=False)


def flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}/{k}" if prefix else str(k))
    else:
        yield prefix, obj


def main():
    a, b = (dict(flatten(load(p))) for p in sys.argv[1:3])
    report = {"only_a": sorted(set(a) - set(b)), "only_b": sorted(set(b) - set(a)),
              "tensors": {}, "values": {}}
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same_shape = x.shape == y.shape
            diff = (x.double() - y.double()).abs().max().item() if same_shape and x.numel() else 0.0
            scale = y.double().abs().max().item() if y.numel() else 0.0
            report["tensors"][k] = [list(x.shape), list(y.shape), str(x.dtype), str(y.dtype),
                                    diff, scale]
        elif x != y:
            report["values"][k] = [repr(x), repr(y)]
    print(json.dumps(report))


if __name__ == "__main__":
    main()

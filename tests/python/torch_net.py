# SPDX-License-Identifier: MIT
"""The model the shardd.torch parity suites train (test_torch_optim.py,
test_torch_clip.py, test_torch_checkpoint.py): fc1 -> tanh -> fc2, sharded
as two groups (fc1, and the rest), built with the same seed on every rank
and for the reference; and the training loop of the suites' models."""

import torch

import shardd.torch as st


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 9)
        self.fc2 = torch.nn.Linear(9, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_net():
    torch.manual_seed(0)
    return Net()


def batches(world, batch, steps, scale=1.0):
    """`steps` (x, y) batches of world * batch rows: every rank's rows of a step together."""
    g = torch.Generator().manual_seed(1)
    return [(scale * torch.randn(world * batch, 6, generator=g),
             scale * torch.randn(world * batch, 3, generator=g)) for _ in range(steps)]


def shard(model, mesh):
    st.fully_shard(model.fc1, mesh=mesh)
    st.fully_shard(model, mesh=mesh)


def shards_of(model):
    """(name, local shard copy, dim, first index) of each param of `model`."""
    return [(n, t.detach().clone(), d, f) for n, t, d, f in st.local_shards(model)]


def train(model, opt, batches):
    """One step of `opt` on each (x, y) of `batches`: mse loss, backward, step, zero_grad."""
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

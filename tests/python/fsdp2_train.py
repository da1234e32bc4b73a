# SPDX-License-Identifier: MIT
"""An FSDP2 training script in the shape of pytorch/examples'
distributed/FSDP2 (a small transformer, fully_shard per block and on the
root, meta-device init, explicit prefetch, mixed precision, torch's
clip_grad_norm_, a torch.distributed.checkpoint save at step k and a
resume from it), one rank of it. test_torch_dropin.py runs it as it is
(torch's FSDP2) and with only the import line marked below changed to
shardd.torch, under torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID; SHARDD_SOCKET for shardd).

    fsdp2_train.py PRECISION STEPS SAVE_AT RESUME CKPT_DIR OUT_DIR [REPLICATE]

PRECISION fp32 or bf16 (param_dtype bf16, reduce_dtype fp32). REPLICATE
(default 1): above 1, HSDP on a 2-D (replicate, shard) mesh. RESUME 0:
train steps 0..STEPS-1, saving a DCP checkpoint to CKPT_DIR before step
SAVE_AT; 1: load that checkpoint and train steps SAVE_AT..STEPS-1. Each
rank writes OUT_DIR/rank<r>.json (per step: its loss and the clipped
total grad norm; whether the params were DTensors and the modules
FSDPModules, and the module that made the model's FSDP class); rank 0
writes OUT_DIR/final.pt, the full model and optimizer state dicts after
the last step."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # drop-in line

# Odd sizes, so that dim-0 shards are uneven (131 rows: 66 and 65 on two ranks).
VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 131, 32, 4, 75, 3, 12, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, DIM))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            nn.init.trunc_normal_(w.weight, std=0.02)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))

    def reset_parameters(self):
        for w in (self.w1, self.w2):
            nn.init.trunc_normal_(w.weight, std=0.02)
            nn.init.zeros_(w.bias)


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))

    def reset_parameters(self):
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1])
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def reset_parameters(self):
        nn.init.normal_(self.tok_embeddings.weight)
        nn.init.normal_(self.pos_embeddings.weight)
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=DIM ** -0.5)
        nn.init.zeros_(self.output.bias)


def batch(step, rank):
    """Each rank's own tokens (data parallel), the same in every run."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def main():
    precision, steps, save_at, resume, ckpt, out = sys.argv[1:7]
    steps, save_at, resume = int(steps), int(save_at), resume == "1"
    replicate = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if replicate > 1:
        mesh = init_device_mesh("cpu", (replicate, world // replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = Transformer()
    mp = MixedPrecisionPolicy()
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    layers = list(model.layers)
    for a, b in zip(layers, layers[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = {"fsdp_modules": all(isinstance(m, FSDPModule) for m in [model] + layers),
              "fully_shard_from": type(model).__mro__[1].__module__,
              "dtensor_params": all(isinstance(p, DTensor) for p in model.parameters()),
              "steps": []}
    first = 0
    if resume:
        first = save_at
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=ckpt)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
    for step in range(first, steps):
        if step == save_at and not resume:
            dcp.save({"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
        tokens = batch(step, rank)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        record["steps"].append([step, loss.item(), norm.full_tensor().item()])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    final = {"model": get_model_state_dict(model, options=full),
             "optim": get_optimizer_state_dict(model, opt, options=full)}
    if rank == 0:
        torch.save(final, os.path.join(out, "final.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

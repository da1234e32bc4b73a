# SPDX-License-Identifier: MIT
"""clip_grad_norm_ over fully_shard groups, by the daemon's job-wide grad
norm (torch.nn.utils.clip_grad_norm_'s signature and meaning)."""

import torch

from ..error import ShardError
from ._dtensor import local
from ._fully_shard import FSDPModule
from ._mesh import mesh_state


def _clip_states(model_or_params):
    """The fully_shard states whose grads clip_grad_norm_ covers, all of one
    mesh, and that mesh; refuses params the daemon does not hold."""
    if isinstance(model_or_params, torch.nn.Module):
        where = f"clip_grad_norm_({type(model_or_params).__name__})"
        params = list(model_or_params.parameters())
        states = [m._shardd_state for m in model_or_params.modules() if isinstance(m, FSDPModule)]
        states = [st for st in states if st.group is not None]
    else:
        where = "clip_grad_norm_"
        params = [model_or_params] if isinstance(model_or_params, torch.Tensor) \
            else list(model_or_params)
        states = []
    for t in params:
        st = getattr(t, "_shardd_state", None)
        if st is None:
            raise ValueError(f"{where}: a param of shape {tuple(t.shape)} is in no fully_shard "
                             f"group, so the daemon's grad_norm does not see its grad: apply "
                             f"fully_shard to every module whose params are clipped (the root "
                             f"last), or use torch.nn.utils.clip_grad_norm_ for local params")
        if st not in states:
            states.append(st)
    if not states:
        raise ValueError(f"{where}: no param of a fully_shard group given")
    mesh = states[0].client
    if any(st.client is not mesh for st in states):
        raise ValueError(f"{where}: the params belong to more than one shardd mesh (job); "
                         f"clip each job's params on its own")
    missing = [st.name for st in mesh_state(mesh).states if st not in states]
    if missing:
        raise ValueError(f"{where}: the daemon's grad_norm is job-wide, over every group of job "
                         f"'{mesh.job}', but groups {missing} are not among the params given: "
                         f"pass the whole model (or all of its params)")
    return states, mesh


def clip_grad_norm_(model_or_params, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_ over fully_shard groups, without an
    all-reduce by the trainer: the daemon's job-wide GRAD_NORM gives the total
    norm of every group's sharded grads (collective: every rank calls it once
    per step, after backward). Returns the total norm as a 0-d fp32 tensor.

    Groups stepped by a DaemonOptimizer: the grad_norm is keyed by the
    optimizer's next step number, and its next step() asks the daemon to
    clip by it (SHARDD_STEP_CLIP_JOB with max_norm: the daemon computes
    min(1, max_norm / (total_norm + 1e-6)) in fp32 as torch does and
    multiplies it into the grads as it steps them), so a restarted rank's
    catch-up step is clipped alike. Other groups (a trainer-side
    torch.optim optimizer): the sharded grads are multiplied here, as torch
    does. norm_type: 2.0 or inf (the daemon's). A non-finite norm raises
    with error_if_nonfinite, as torch; otherwise a
    DaemonOptimizer(skip_nonfinite=True) skips the step on every rank (the
    daemon decides by the job's grad_norm: SHARDD_STEP_SKIP_JOB_NONFINITE).
    foreach is accepted for torch's signature and unused (the daemon
    computes the norm)."""
    del foreach
    norm_type = float(norm_type)
    max_norm = float(max_norm)
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type:g} is not supported by the "
                         f"daemon's grad_norm: use 2.0 or inf")
    states, mesh = _clip_states(model_or_params)
    for st in mesh_state(mesh).states:
        st.wait_reduce()
    opts = {st.optimizer for st in states if st.optimizer is not None}
    numbers = {opt.step_number for opt in opts}
    if len(numbers) > 1:
        raise ValueError(f"clip_grad_norm_: the params' DaemonOptimizers are at different steps "
                         f"({sorted(numbers)}); clip the params of one optimizer at a time")
    if numbers:
        # The daemon's step of this number clips and skips by this grad_norm.
        key = numbers.pop() + 1
    else:
        ms = mesh_state(mesh)
        ms.norm_count += 1
        key = ms.norm_count
    try:
        norm, nonfinite = mesh.grad_norm(key, norm_type)
    except ShardError as e:
        raise type(e)(e.code, f"clip_grad_norm_ on rank {mesh.rank} of job '{mesh.job}': "
                              f"{e.text}") from None
    # On the grads' device, as torch's clip_grad_norm_ returns it.
    total = torch.tensor(norm, dtype=torch.float32, device=mesh_state(mesh).device)
    if error_if_nonfinite and (nonfinite or not torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    if not max_norm > 0 or max_norm == float("inf"):
        raise ValueError(f"clip_grad_norm_: max_norm = {max_norm:g}; the daemon clips by a finite "
                         f"max_norm > 0")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for st in states:
        if st.optimizer is not None:
            continue
        for p in st.params:
            if p.sharded.grad is not None:
                local(p.sharded.grad).mul_(coef)
    for opt in opts:
        opt._clip = (key, max_norm, float(norm), bool(nonfinite))
    return total

# SPDX-License-Identifier: MIT
"""The daemon's optimizer as a torch.optim.Optimizer (DaemonOptimizer,
DaemonSGD, DaemonAdamW): one STEP per group, exactly once per step
number, and the collective recovery after a rank died (peer_failed,
DaemonOptimizer.recover)."""

import time

import torch

from .. import proto as P
from ..error import DaemonGone, ShardError
from ..group import Optimizer, step_flags_args
from ._fully_shard import FSDPModule
from ._mesh import mesh_state, on_current_stream

# DaemonOptimizer.recover's barrier numbers: bit 62 set; the first barrier
# is that bit alone, the second adds bit 61 and the step every rank resumes after.
_RECOVER_BARRIER, _RECOVER_AGREE = 1 << 62, 1 << 61
_KEY_STEP_BITS = 60


def peer_failed(err):
    """True when `err` (an exception from forward, backward, clip_grad_norm_,
    step() or a barrier) says another rank died or did not come
    (SHARDD_E_PEER_DIED, SHARDD_E_TIMEOUT) or is recovering (a barrier
    mismatch against DaemonOptimizer.recover's barrier: the daemon puts the
    barrier number met in the completion, err.result[0]): every rank then
    calls DaemonOptimizer.recover()."""
    if not isinstance(err, ShardError) or isinstance(err, DaemonGone):
        return False
    if err.code == -P.E_MISMATCH:
        return bool(err.result and err.result[0] & _RECOVER_BARRIER)
    return err.code in (-P.E_PEER_DIED, -P.E_TIMEOUT)


class DaemonOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step() is the daemon's: it submits one
    STEP per fully_shard group (the optimizer state lives in the daemon, fp32,
    per shard; this object holds only the lr and the step count).

    Construct it (DaemonSGD / DaemonAdamW) over the unsharded model BEFORE
    fully_shard: each fully_shard under it then registers its group with the
    optimizer's config. param_groups is one group (the model's parameters,
    replaced by their shards as fully_shard registers them) whose "lr" is
    read at every step, so torch.optim.lr_scheduler works; the other
    hyperparameters are fixed at registration. The n-th step() is the
    daemon's step number n (state_dict()/load_state_dict() carry it with the
    lr), applied at most once per group and rank shard: re-submitting an
    applied step changes nothing and reports P.STEP_ALREADY in last_results.
    last_step is the daemon's last applied step when the groups were
    registered.

    The daemon steps a whole shard: a param whose grad is None (no gradient
    this iteration) still gets momentum and weight decay, unlike torch.optim,
    which skips it."""

    def __init__(self, model, config, defaults, skip_nonfinite=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(self).__name__}: give the model (an nn.Module, before "
                            f"fully_shard), not {type(model).__name__}")
        for name, m in model.named_modules():
            if isinstance(m, FSDPModule):
                raise ValueError(
                    f"{type(self).__name__}: module '{name or type(m).__name__}' is already "
                    f"fully_shard'ed, so its group was registered without the daemon's "
                    f"optimizer: construct {type(self).__name__}(model, ...) before fully_shard")
            other = getattr(m, "_shardd_optimizer", None)
            if other is not None:
                raise ValueError(f"{type(self).__name__}: module '{name or type(m).__name__}' "
                                 f"is already under a {type(other).__name__}")
        for name, p in model.named_parameters():
            if p.dtype != torch.float32:
                raise TypeError(f"{type(self).__name__}: param '{name}' is {p.dtype}; the "
                                f"daemon's optimizer keeps fp32 master shards (keep the params "
                                f"fp32 and give MixedPrecisionPolicy(param_dtype=...))")
            if not p.requires_grad:
                raise ValueError(f"{type(self).__name__}: param '{name}' does not require grad; "
                                 f"the daemon steps every param of a group (weight decay and "
                                 f"momentum would move it): keep frozen params out of the model "
                                 f"given to it")
        if not 0.0 <= defaults["lr"] < float("inf"):
            raise ValueError(f"{type(self).__name__}: lr = {defaults['lr']}: give a finite "
                             f"lr >= 0")
        super().__init__(list(model.parameters()), defaults)
        self.config = config
        self.skip_nonfinite = skip_nonfinite
        self.step_number = 0        # daemon step numbers submitted so far
        self._clip = None           # (step number, max_norm, norm, nonfinite) from clip_grad_norm_
        self._resumed = False       # groups re-opened (resume=True), recover() not run yet
        self.last_results = {}      # group name -> P.STEP_* of the last step()
        self._states = []
        self._names = {id(p): n for n, p in model.named_parameters()}   # originals' names
        self._sharded = set()       # ids of the shards fully_shard registered with it
        for m in model.modules():
            m._shardd_optimizer = self

    def add_param_group(self, param_group):
        if self.param_groups:
            raise ValueError(f"{type(self).__name__}: one param group only (the daemon's "
                             f"hyperparameters are per fully_shard group, fixed at registration)")
        super().add_param_group(param_group)

    def _attach(self, state, originals):
        """fully_shard registered `state`'s group with this optimizer: step it,
        and hold its shards in param_groups instead of the originals."""
        self._states.append(state)
        if mesh_state(state.client).resume:
            self._resumed = True
            self.step_number = min(st.group.last_step for st in self._states)
        elif mesh_state(state.client).restore is not None:
            self.step_number = min(st.group.last_step for st in self._states)
        shards = {id(t): p.sharded for t, p in zip(originals, state.params)}
        self._sharded.update(id(p.sharded) for p in state.params)
        group = self.param_groups[0]
        group["params"] = [shards.get(id(t), t) for t in group["params"]]

    @property
    def last_step(self):
        """The last step the daemon had applied on this rank's shards when the
        groups were registered (the smallest over the groups; 0: none)."""
        if not self._states:
            raise RuntimeError(self._unregistered())
        return min(st.group.last_step for st in self._states)

    def _unregistered(self):
        return (f"{type(self).__name__}: no fully_shard group is registered with it: apply "
                f"fully_shard to the model it was constructed over (after constructing it)")

    @torch.no_grad()
    def step(self, closure=None, *, clip=None):
        """Submit the daemon's step number step_number + 1 for every group and
        wait for it. clip: a coefficient multiplied into the grads, or None:
        clipping by the job's grad_norm of this step if
        shardd.torch.clip_grad_norm_ ran for it (the daemon computes the
        coefficient). With skip_nonfinite, a step whose job-wide grad norm
        (clip_grad_norm_) was non-finite is skipped on every rank; without
        clip_grad_norm_ each rank's shard decides (a NaN/Inf in it skips it).
        Returns closure's loss (None without closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._states:
            raise RuntimeError(self._unregistered())
        missed = [self._names.get(id(t), "?") for t in self.param_groups[0]["params"]
                  if id(t) not in self._sharded]
        if missed:
            raise RuntimeError(f"{type(self).__name__}.step: params {missed} are in no "
                               f"fully_shard group, so the daemon would not step them: apply "
                               f"fully_shard to the model it was constructed over (the root "
                               f"last), as to every module whose params it should own")
        lr = self.param_groups[0]["lr"]
        if not 0.0 <= lr < float("inf"):
            raise ValueError(f"{type(self).__name__}.step: lr = {lr}: the daemon takes a finite "
                             f"lr >= 0 (check the lr scheduler)")
        number = self.step_number + 1
        max_norm, norm = None, 0.0
        if clip is None and self._clip is not None and self._clip[0] == number:
            _n, max_norm, norm, _nonfinite = self._clip
        self._clip = None
        # Every reduce first: a rank that fails here has stepped no group.
        for st in self._states:
            st.wait_reduce()
            if st.unsharded or st.unshard_pending is not None:
                raise RuntimeError(f"{st.where('step')}: the module holds its unsharded params; "
                                   f"call reshard() on it before the optimizer step")
        skip = self.skip_nonfinite
        if (clip is not None and clip != clip) or (max_norm is not None and norm != norm and not skip):
            raise ValueError(f"{type(self).__name__}.step: clip_grad_norm_ found a NaN total "
                             f"norm, and the daemon takes no NaN clip coefficient (torch would "
                             f"turn every param into NaN): construct the optimizer with "
                             f"skip_nonfinite=True to skip such steps on every rank, or call "
                             f"clip_grad_norm_(..., error_if_nonfinite=True) to stop")
        # With clip_grad_norm_, the daemon clips and skips by the job's grad_norm of this step.
        flags, args = step_flags_args(lr, skip, clip, max_norm, skip and max_norm is not None)
        pending = []
        for st in self._states:
            on_current_stream(st.client)
            where = f"step(group '{st.name}', step {number})"
            pending.append((st, st.client.start([(P.OP_STEP, st.group.id, number, flags, where,
                                                  args)])))
        results = {}
        for st, pend in pending:
            try:
                results[st.name] = pend.wait()[0].res
            except ShardError as e:
                raise st._wrap("step", e) from None
            for p in st.params:     # the daemon consumed and cleared the sharded grads
                p.has_grad = False
                p.sharded.grad = None
        self.step_number = number
        self.last_results = results
        return loss

    def recover(self, timeout=None):
        """Collective recovery after a rank died: every rank calls it, the
        survivors when an op failed with SHARDD_E_PEER_DIED or
        SHARDD_E_TIMEOUT (a ShardError from forward, backward or step()), the
        restarted rank after re-attaching (init_device_mesh(resume=True) and
        the same fully_shard calls). Returns the step number every rank
        resumes after (step_number): the training loop goes on with its
        iteration step_number + 1 (0-based: the iteration step_number).

        What it does: each rank drops its iteration in flight and the ranks
        meet at a first barrier (after it, no rank has a step in flight).
        Each then reads from the daemon, per group, the last step applied on
        its shard and the highest one applied on any shard of the group
        (the GROUP reply's last_step and peer_last_step). Ranks that lived
        through the failure agree on it; the restarted rank may be one step
        behind (it died after that step's reduces completed, before its own
        STEP of some group): it replays that step (SHARDD_STEP_REPLAY), so
        the daemon applies it with the lr, clip (max_norm against the job's
        grad_norm of the step) and skip the other ranks submitted, from the
        sharded grads it kept: every update is applied exactly once. The
        ranks confirm the step at a second barrier, every rank clears its
        sharded grads and the op keys restart from the agreed step. One dead
        rank at a time; timeout: seconds to wait for the other ranks
        (default: twice the daemon's collective timeout plus 30 s)."""
        if not self._states:
            raise RuntimeError(self._unregistered())
        mesh = self._states[0].client
        if timeout is None:
            timeout = 2 * mesh.collective_timeout_ms / 1000 + 30
        deadline = time.monotonic() + timeout
        resumed = self._resumed
        for st in self._states:
            st.abandon(0)
        if not resumed:
            self._zero_grads()
        where = f"{type(self).__name__}.recover on rank {mesh.rank} of job '{mesh.job}'"
        self._recover_barrier(mesh, _RECOVER_BARRIER, deadline, f"{where} (first barrier)")
        last = {st.name: self._daemon_steps(st) for st in self._states}
        step = min(own for own, _peer in last.values())
        ahead = max(peer for _own, peer in last.values())
        if not resumed and any(own != step for own, _peer in last.values()):
            raise RuntimeError(f"{where}: the daemon's last steps (own, highest of the group) "
                               f"differ between groups ({last}) on a rank that did not restart")
        if resumed and ahead == step + 1:
            # The others applied step + 1, so its reduces completed and the
            # daemon kept this rank's reduced grads (some groups may have
            # stepped before this rank died: they answer ALREADY).
            self._catch_up(ahead)
            step = ahead
        elif ahead != step:
            raise RuntimeError(f"{where}: this rank resumes after step {step} but a rank of the "
                               f"groups after step {ahead} ({last}); recovery handles one "
                               f"restarted rank at a time")
        if step >= 1 << _KEY_STEP_BITS:
            raise ValueError(f"{where}: step {step} is past the {_KEY_STEP_BITS}-bit step field "
                             f"of the recovery barrier")
        self._recover_barrier(mesh, _RECOVER_BARRIER | _RECOVER_AGREE | step, deadline,
                              f"{where} at step {step}", retry_mismatch=False)
        self._zero_grads()
        base = (step + 1) << 24
        for st in self._states:
            st.abandon(base)
        mesh_state(mesh).norm_count = base
        self.step_number = step
        self._resumed = False
        self._clip = None
        return step

    @staticmethod
    def _recover_barrier(mesh, number, deadline, where, retry_mismatch=True):
        """Barrier `number`, tried again until `deadline` while a rank is not
        attached yet or still in a barrier of its own (it fails that one and
        comes here)."""
        retry = (-P.E_PEER_DIED, -P.E_TIMEOUT) + ((-P.E_MISMATCH,) if retry_mismatch else ())
        while True:
            try:
                mesh.barrier(number)
                return
            except DaemonGone:
                raise
            except ShardError as e:
                left = deadline - time.monotonic()
                if left <= 0 or e.code not in retry:
                    raise type(e)(e.code, f"{where}: {e.text}") from None
                if e.code != -P.E_MISMATCH:
                    time.sleep(min(0.02, left))

    def _daemon_steps(self, st):
        """(last step applied on this rank's shard, highest on any shard) of
        the group, read from the daemon now."""
        g = st.client.open_group(st.name)
        try:
            return g.last_step, g.peer_last_step
        finally:
            g.close()
            st.client.groups.remove(g)

    def _catch_up(self, number):
        """Replay step `number` as the other ranks of each group submitted it
        (the daemon holds their lr, max_norm and flags); a group that already
        applied it answers ALREADY."""
        for st in self._states:
            flags, args = step_flags_args(0.0, replay=True)
            where = f"step(group '{st.name}', step {number}, replay)"
            try:
                st.client.start([(P.OP_STEP, st.group.id, number, flags, where, args)]).wait()
            except ShardError as e:
                raise st._wrap(f"recovery of step {number}", e) from None

    def _zero_grads(self):
        pend = [st.client.start([(P.OP_ZERO_GRAD, st.group.id, 0, 0,
                                  f"zero_grad(group '{st.name}')")]) for st in self._states]
        for st, p in zip(self._states, pend):
            try:
                p.wait()
            except ShardError as e:
                raise st._wrap("recovery zero_grad", e) from None

    def state_dict(self):
        """The lr (and any scheduler keys in the param group) and the step
        count; the optimizer state (momentum, exp_avg, ...) stays in the
        daemon and is not in it."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.param_groups[0]["params"])))
        return {"state": {}, "param_groups": [group], "step_number": self.step_number}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"{type(self).__name__}.load_state_dict: {len(groups)} param "
                             f"groups; this optimizer has 1")
        fixed = self.defaults.keys() - {"lr"}
        for k in fixed:
            if k in groups[0] and groups[0][k] != self.param_groups[0][k]:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {k} = {groups[0][k]} "
                                 f"but the daemon's optimizer was registered with "
                                 f"{self.param_groups[0][k]}")
        self.param_groups[0].update({k: v for k, v in groups[0].items() if k != "params"})
        self.step_number = int(state_dict["step_number"])


class DaemonSGD(DaemonOptimizer):
    """torch.optim.SGD in the daemon: DaemonSGD(model, lr, momentum=0,
    dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
    skip_nonfinite=False). See DaemonOptimizer."""

    def __init__(self, model, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, skip_nonfinite=False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        config = Optimizer.sgd(momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                               nesterov=nesterov, maximize=maximize)
        super().__init__(model, config, defaults, skip_nonfinite)


class DaemonAdamW(DaemonOptimizer):
    """torch.optim.AdamW in the daemon: DaemonAdamW(model, lr=1e-3,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
    maximize=False, skip_nonfinite=False). See DaemonOptimizer."""

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, skip_nonfinite=False):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        config = Optimizer.adamw(betas=betas, eps=eps, weight_decay=weight_decay,
                                 amsgrad=amsgrad, maximize=maximize)
        super().__init__(model, config, defaults, skip_nonfinite)

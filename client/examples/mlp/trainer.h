/* SPDX-License-Identifier: MIT */
/*
 * The trainer of train_mlp: one rank process attached to shardd, training
 * the model of model.h FSDP2-style (ZeRO-3). Each linear layer is one
 * parameter group ("fc0", "fc1", "fc2", params "fcN.weight" [out x in]
 * and "fcN.bias" [out], fp32, named like torch's state_dict keys), sharded by the daemon along dim 0. Every rank runs
 * FSDP2's schedule with reshard_after_forward=True:
 *
 *   forward,  layer l = 0..2:  unshard(l) (l+1 prefetched while l computes),
 *                              forward, reshard(l)
 *   backward, layer l = 2..0:  unshard(l) again (l-1 prefetched), backward
 *                              into the grad buffer, reshard(l), reduce(l)
 *   once every reduce of the step succeeded: the daemon's SGD on the
 *   rank's shard of each layer (shardd_step, step number t + 1, which
 *   also clears the sharded grad); with --trainer-sgd, the trainer's own
 *   SGD on its flat shard with its sharded grad, then zero_grad.
 *
 * unshard and reduce are keyed by step, and the forward and the backward
 * unshard of one training step are two different collectives, so each gets
 * its own key: op_key(t, attempt, phase) = 16 t + 2 attempt + phase, phase 0
 * for the forward unshard and 1 for the backward unshard and the reduce. The
 * attempt makes a retried step (after a rank died) use fresh keys, and the
 * keys grow monotonically over the run.
 *
 * A step that fails because a rank died (peer died, or timeout) is retried
 * once every rank is back: each survivor reports the step and attempt it
 * retries (struct loss_report) and waits at that attempt's barrier; the
 * dead rank's replacement re-attaches with that resume_step and attempt
 * (the launcher passes them on) and joins. A death after the last step's
 * reduces fails the final unshard, retried alike (resume_step = steps).
 * A rank stopped (SIGSTOP) past the collective timeout is handled alike,
 * without the restart: once continued, its late collective fails at once
 * (the daemon remembers that the others gave up on it) and it joins their
 * retry; a retry's barrier that times out is retried as the next attempt.
 * docs/RELIABILITY.md states the whole protocol. With the daemon's SGD the
 * replacement first asks the daemon which step it last applied to each of
 * its shards (shardd_group_last_step) and applies the step T update the
 * dead rank reduced but never stepped (its sharded grad is still in the
 * daemon). The trainer-side SGD cannot: a rank that dies after its step's
 * last reduce completed but before its SGD loses that update, and one that
 * dies in the middle of its SGD leaves a half-updated shard.
 *
 * Checkpoints (--checkpoint-every N, --resume; docs/CHECKPOINTS.md): after
 * training step t, when the daemon's step number t + 1 is a multiple of N,
 * every rank submits the job-wide checkpoint(t + 1) and waits until the
 * daemon wrote it to <--state-dir>/<job>/step-<t + 1>. With --resume every
 * rank registers its groups with restore "" (the job's newest checkpoint in
 * the daemon's --state-dir): when there is one, the ranks resume after its
 * step, whose update the checkpoint holds; else (last step 0) they load the
 * seeded init and start at step 0, so the same command line serves the
 * first run and every resume. Both need the daemon's SGD (the checkpoint
 * records the step it applied last), so not --trainer-sgd.
 *
 * HSDP (replicate > 1): the ranks attach as replicate x (world /
 * replicate), unshard within their replica and reduce with
 * SHARDD_REDUCE_ALL_REDUCE over the whole job.
 *
 * Backends: on the host backend the ranks compute on the group buffers'
 * mappings directly. On the cuda backend (device >= 0) those are device
 * memory; the model still runs on the CPU, so each rank copies an
 * unsharded layer to host memory after its unshard, its grads to the
 * device before its reduce, and its shard around the SGD update.
 */
#ifndef SHARDD_EXAMPLE_MLP_TRAINER_H
#define SHARDD_EXAMPLE_MLP_TRAINER_H

#include <stdint.h>

#include "model.h"

#define MLP_MAX_ATTEMPTS 4 /* tries of one step; attempt < 8 fits op_key */

/* What one rank needs to train (the launcher's flags of the same names). */
struct trainer_opts {
	uint32_t world;      /* --world N */
	uint64_t steps;      /* --steps K */
	const char *socket;  /* --socket PATH; NULL: library default */
	const char *job;     /* --job NAME */
	const char *dump;    /* --dump FILE */
	uint32_t replicate;  /* --replicate R: HSDP, R replicas of world / R shards; 1: FSDP */
	int64_t resume_step; /* --resume-step T; -1: fresh start; MLP_RESUME_OWN: see below */
	uint32_t attempt;    /* --attempt A: with --resume-step, the attempt to join */
	int32_t device;      /* --device N; SHARDD_HELLO_DEVICE_HOST: none */
	int trainer_sgd;     /* --trainer-sgd: SGD in the trainer, not the daemon's step */
	/* --checkpoint-every N: checkpoint after each step n % N == 0; 0: never */
	uint64_t checkpoint_every;
	int resume; /* --resume: register from the job's newest checkpoint, if any */
};

/*
 * resume_step for a rank with no other rank to learn the step from (world
 * 1): resume after the last step the daemon applied on its shards.
 */
#define MLP_RESUME_OWN (-2)

/*
 * Report from a rank to its launcher, one atomic pipe write. attempt 0: the
 * loss of step `step`, which the rank completed. attempt > 0: the rank
 * failed in step `step` (a rank died) and waits at the barrier of that
 * step's retry number `attempt`, where a restarted rank must join it
 * (step = o->steps: the final unshard). attempt MLP_REPORT_START: the rank
 * registered its groups and trains from step `step` on (0, or with --resume
 * the step of the checkpoint it restored); sent once, before any other.
 */
#define MLP_REPORT_START UINT32_MAX
struct loss_report {
	uint32_t rank;
	uint32_t attempt;
	uint64_t step;
	double loss;
	uint64_t step_ns;   /* the step's wall time on this rank, retries included */
	uint64_t shardd_ns; /* of which in shardd_submit and shardd_wait: the rest is compute */
};

/* One rank process; opaque outside trainer.c. */
struct rank;

/*
 * A point in the schedule where a caller may act in the rank's place: the
 * tests inject faults there (tests/integration/train_mlp_faults.c).
 */
struct rank_hooks {
	/*
	 * Called where the rank would submit the reduce of `layer` in attempt
	 * `attempt` of step t (`key`: that reduce's step key), after the
	 * layer's grads are in place and its reshard was submitted. 0: the
	 * trainer submits the reduce; 1: the hook took its place; negative:
	 * the attempt failed (the ops the hook ran recorded why).
	 */
	int (*before_reduce)(struct rank *rk, uint64_t t, uint32_t attempt, uint32_t layer,
			     uint64_t key, void *arg);
	/*
	 * Called at each point of enum rank_point in attempt `attempt` of step
	 * t, in schedule order, `layer` the layer concerned (MLP_LAYERS for
	 * RANK_AT_BEFORE_STEP). The tests kill the rank there.
	 */
	void (*at)(struct rank *rk, uint32_t point, uint64_t t, uint32_t attempt, uint32_t layer,
		   void *arg);
	void *arg;
};

/*
 * The points of a step where rank_hooks.at is called with the daemon's
 * step, RANK_POINTS_PER_STEP per attempt; in order: the forward unshards of
 * fc0, fc1, fc2 (0-2), the backward unshards of fc2, fc1 (3, 4), the reduce
 * of fc2 (5), the unshard of fc0 (6), the reduces of fc1, fc0 (7, 8), before
 * the step (9), the steps of fc0, fc1, fc2 (10-12), after them (13).
 */
enum rank_point {
	RANK_AT_UNSHARD, /* the unshard of `layer` (forward or backward) submitted, not reaped */
	RANK_AT_REDUCE,  /* the reduce of `layer` submitted, not reaped */
	RANK_AT_BEFORE_STEP, /* every reduce of the step completed, no step submitted */
	RANK_AT_STEP,        /* the daemon's step of `layer` submitted, not reaped */
	RANK_AT_STEP_DONE,   /* every step completed, the loss not yet reported */
};
#define RANK_POINTS_PER_STEP (2 * MLP_LAYERS + MLP_LAYERS + 1 + MLP_LAYERS + 1)

/*
 * Run rank `rank` of o->world: attach, register (or, with resume_step,
 * re-open) the groups, train o->steps steps, unshard the final params
 * (rank 0 writes them to o->dump). Each step's loss goes to report_fd as a
 * struct loss_report, or when report_fd < 0 to stdout as "rank R step N
 * loss X". `hooks` may be NULL. 0 or a negative error (already printed).
 */
int rank_main(const struct trainer_opts *o, uint32_t rank, int report_fd,
	      const struct rank_hooks *hooks);

/* For hooks. This rank's number. */
uint32_t rank_id(const struct rank *rk);
/* The flags of this rank's reduces: SHARDD_REDUCE_ALL_REDUCE under HSDP, else 0. */
uint32_t rank_reduce_flags(const struct rank *rk);
/*
 * Submit an op on layer `layer`'s group (MLP_LAYERS: no group, a barrier;
 * SHARDD_OP_STEP: the daemon's SGD with MLP_LR, `flags` SHARDD_STEP_*);
 * its slot (>= 0) or a negative error, recorded as the attempt's failure.
 */
int rank_submit(struct rank *rk, uint32_t op, uint32_t layer, uint64_t step, uint32_t flags);
/* Submit an op and wait for it: its result (0 or a negative error, recorded). */
int rank_sync_op(struct rank *rk, uint32_t op, uint32_t layer, uint64_t step);

#endif /* SHARDD_EXAMPLE_MLP_TRAINER_H */

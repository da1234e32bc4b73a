/* SPDX-License-Identifier: MIT */
/*
 * The optimizer step's exactly-once policy: the step of (group, rank
 * shard, step number) applies at most once, asked for by a STEP or by a
 * REDUCE with SHARDD_REDUCE_STEP.
 *
 * At submission (loop thread, engine.c): a step is admitted or refused
 * with its message: its own fields, SHARDD_STEP_REPLAY taking the entry
 * another rank of the group submitted, and the job-wide clip coefficient
 * and skip from the job's kept grad_norm of its step (the results kept
 * here, shd_engine_job_grad_norm_keep). In the group's task (task.c, one
 * at a time per group): whether it applies, was applied or skipped before
 * (SHARDD_STEP_ALREADY), is skipped for the job, or is refused (no grad);
 * then what is recorded (the rank's last step, its updates). The GROUP
 * reply reads that record (group.c). The callers keep the mechanics:
 * dispatch, the kernel through the backend, clearing the grad.
 */
#ifndef SHD_STEP_H
#define SHD_STEP_H

#include <stddef.h>
#include <stdint.h>

#include "group.h"
#include "shardd_proto.h"

struct eng_group;
struct eng_op;

/* 1 when `sqe` asks for an optimizer step: a STEP, or a REDUCE with SHARDD_REDUCE_STEP. */
int eng_step_asked(const struct shardd_sqe *sqe);

/*
 * Loop thread, at the submission of `op`, which asks for a step: resolve
 * SHARDD_STEP_REPLAY into the flags, lr and clip word another rank of the
 * group submitted; check the step's own fields (the group's optimizer,
 * step number, lr, clip); decide the job-wide clip coefficient and skip
 * into `op`; and remember the entry for later replays. 0, or the error
 * code with `err`. Whether the step was applied before and whether a grad
 * is there, eng_step_plan decides in the group's order.
 */
int eng_step_admit(struct eng_group *eg, struct eng_op *op, char *err, size_t errlen);

enum eng_step_verdict {
	ENG_STEP_APPLY = 1, /* run the optimizer on the shard as the plan says */
	ENG_STEP_SKIP_JOB, /* the job's grad_norm of the step was non-finite: no update, the grad cleared */
	ENG_STEP_ALREADY, /* a step at or above this one was applied or skipped: nothing changes */
};

/* What one rank's step does, decided in its group's task. */
struct eng_step_plan {
	enum eng_step_verdict verdict;
	double lr;
	float grad_scale; /* the clip coefficient: the rank's (SHARDD_STEP_CLIP), the job's, or 1 */
	int skip_nonfinite; /* SHARDD_STEP_SKIP_NONFINITE: the kernel skips on a non-finite grad */
	uint64_t update;    /* the number of the update it applies (torch's state['step']) */
};

/*
 * The group's running task: what the step of `op` does on its rank's
 * shard, `grad_present` whether its sharded grad holds a value
 * (shd_group_grad_present). 0 with *p, or -SHARDD_E_STATE with `err` (the
 * rank has no sharded grad). Reads the record only the group's running
 * task writes.
 */
int eng_step_plan(const struct shd_group *g, const struct eng_op *op, int grad_present,
		  struct eng_step_plan *p, char *err, size_t errlen);

/*
 * The group's running task, before the reduce of a REDUCE with
 * SHARDD_REDUCE_STEP: 1 when the step of `op` can take the reduce's sum
 * straight into its update (the backend's reduce_step), *p its plan: the
 * rank's sharded grad is absent, so the reduce would assign it rather than
 * add into it, and the step then applies (not SHARDD_STEP_ALREADY) and
 * reads exactly that sum. 0: the reduce, then eng_step_plan.
 */
int eng_step_plan_fused(const struct shd_group *g, const struct eng_op *op,
			struct eng_step_plan *p);

/*
 * The group's running task, after the step of `step` ran on `rank`'s
 * shard or was skipped: it is the rank's last step now, and `updated`
 * (the optimizer changed the shard) counts an update. Returns the op's
 * outcome, SHARDD_STEP_APPLIED or SHARDD_STEP_SKIPPED.
 */
int eng_step_record(struct shd_group *g, uint32_t rank, uint64_t step, int updated);

/*
 * Any thread: the last step applied or skipped on `rank`'s shard, and the
 * highest of every rank of the group (a GROUP reply's last_step and
 * peer_last_step).
 */
void eng_step_last(const struct shd_group *g, uint32_t rank, uint64_t *last, uint64_t *peer_last);

#endif /* SHD_STEP_H */

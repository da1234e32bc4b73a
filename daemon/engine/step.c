/* SPDX-License-Identifier: MIT */
/*
 * The optimizer step's exactly-once policy (step.h): admitting a step at
 * submission, the job's kept grad_norm results and the clip coefficient
 * from them, and in the group's task the plan of a rank's step and the
 * record it leaves.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine_int.h"
#include "shardd_step.h"
#include "step.h"

int eng_step_asked(const struct shardd_sqe *sqe)
{
	return sqe->op == SHARDD_OP_STEP ||
	       (sqe->op == SHARDD_OP_REDUCE && (sqe->flags & SHARDD_REDUCE_STEP));
}

/* ------------------------------------------------------------------ */
/* The job's grad_norm results, kept for its steps                     */
/* ------------------------------------------------------------------ */

void shd_engine_job_grad_norm_keep(struct shd_engine_job *j, uint64_t step, double norm,
				   int nonfinite)
{
	struct eng_gnorm_rec *slot = &j->gnorm[0];

	for (uint32_t i = 0; i < SHARDD_GRAD_NORM_KEPT; i++) {
		if (j->gnorm[i].step == step) {
			slot = &j->gnorm[i];
			break;
		}
		if (j->gnorm[i].step < slot->step)
			slot = &j->gnorm[i];
	}
	*slot = (struct eng_gnorm_rec){ .step = step, .nonfinite = nonfinite, .norm = norm };
}

/* The kept grad_norm result of `step`, or NULL. */
static const struct eng_gnorm_rec *gnorm_find(const struct shd_engine_job *j, uint64_t step)
{
	for (uint32_t i = 0; i < SHARDD_GRAD_NORM_KEPT; i++)
		if (step && j->gnorm[i].step == step)
			return &j->gnorm[i];
	return NULL;
}

float shd_clip_coefficient(double norm, double max_norm)
{
	/* Each operation rounds to fp32 (no FMA can form: a sum, a quotient, a product). */
	float denom = (float)norm + 1e-6f;
	float recip = 1.0f / denom;
	float coef = recip * (float)max_norm;

	return coef > 1.0f ? 1.0f : coef;
}

/* ------------------------------------------------------------------ */
/* At submission (loop thread)                                         */
/* ------------------------------------------------------------------ */

/*
 * A step's own fields (shardd_step_check: the group's optimizer, step
 * number, lr, clip; libshardd checks a rank-executed reduce's the same
 * way), and under HSDP that a REDUCE with SHARDD_REDUCE_STEP all-reduces,
 * checked at submission: 0, or the error code with `msg`. Whether the step
 * was applied before and whether a grad is there, its task decides, in
 * the group's order.
 */
static int step_check(const struct eng_group *eg, const struct shardd_sqe *sqe, char *err,
		      size_t errlen)
{
	int ret = shardd_step_check(sqe->op, eg->g->name, eg->g->optim.kind, sqe->step, sqe->flags,
				    sqe->arg, err, errlen);

	if (ret)
		return ret;
	if (sqe->op == SHARDD_OP_REDUCE && eng_mesh_replicate(eg->j) > 1 &&
	    !(sqe->flags & SHARDD_REDUCE_ALL_REDUCE)) {
		eng_fmt(err, errlen,
			"shardd: reduce(group '%s', step %llu): flags = 0x%x: SHARDD_REDUCE_STEP without "
			"SHARDD_REDUCE_ALL_REDUCE under HSDP (replicate %u): the grads are not final until the "
			"all-reduce; step with the reduce that all-reduces",
			eg->g->name, (unsigned long long)sqe->step, sqe->flags,
			eng_mesh_replicate(eg->j));
		return -SHARDD_E_INVALID;
	}
	return 0;
}

/*
 * SHARDD_STEP_REPLAY: take the flags, lr and clip word another rank of the
 * group submitted for this step (a REDUCE with SHARDD_REDUCE_STEP: its lr,
 * no flags) into `op`. 0, or the error code with `msg`.
 */
static int step_replay(const struct eng_group *eg, struct eng_op *op, char *err, size_t errlen)
{
	const struct shardd_sqe *sqe = &op->sqe, *rec = &eg->last_sub;

	if (sqe->flags != SHARDD_STEP_REPLAY || sqe->arg[SHARDD_SQE_STEP_LR] ||
	    sqe->arg[SHARDD_SQE_STEP_CLIP]) {
		eng_fmt(err, errlen,
			"shardd: step(group '%s', step %llu): flags = 0x%x, sqe.arg[%d] = 0x%llx, "
			"sqe.arg[%d] = 0x%llx: SHARDD_STEP_REPLAY takes no other flag, lr or clip word (it "
			"applies those another rank of the group submitted)",
			eg->g->name, (unsigned long long)sqe->step, sqe->flags, SHARDD_SQE_STEP_LR,
			(unsigned long long)sqe->arg[SHARDD_SQE_STEP_LR], SHARDD_SQE_STEP_CLIP,
			(unsigned long long)sqe->arg[SHARDD_SQE_STEP_CLIP]);
		return -SHARDD_E_INVALID;
	}
	if (rec->step != sqe->step) {
		eng_fmt(err, errlen,
			"shardd: step(group '%s', step %llu) with SHARDD_STEP_REPLAY on rank %u: no "
			"rank of the group submitted step %llu (the last step submitted to it is %llu); replay "
			"only the step the other ranks took (the GROUP reply's peer_last_step)",
			eg->g->name, (unsigned long long)sqe->step, op->rank,
			(unsigned long long)sqe->step, (unsigned long long)rec->step);
		return -SHARDD_E_STATE;
	}
	op->sqe.flags = rec->op == SHARDD_OP_STEP ? rec->flags : 0;
	op->sqe.arg[SHARDD_SQE_STEP_LR] = rec->arg[SHARDD_SQE_STEP_LR];
	op->sqe.arg[SHARDD_SQE_STEP_CLIP] =
		rec->op == SHARDD_OP_STEP ? rec->arg[SHARDD_SQE_STEP_CLIP] : 0;
	return 0;
}

/*
 * SHARDD_STEP_CLIP_JOB and SHARDD_STEP_SKIP_JOB_NONFINITE: the coefficient
 * and the skip from the job's kept grad_norm of the step, into `op`, so
 * that every rank (and a restarted rank's replay) applies the step alike.
 * 0, or the error code with `msg`.
 */
static int step_job(const struct eng_group *eg, struct eng_op *op, char *err, size_t errlen)
{
	const struct shardd_sqe *sqe = &op->sqe;
	const struct eng_gnorm_rec *rec;
	double max_norm;

	if (!(sqe->flags & (SHARDD_STEP_CLIP_JOB | SHARDD_STEP_SKIP_JOB_NONFINITE)))
		return 0;
	rec = gnorm_find(eg->j, sqe->step);
	if (!rec) {
		char kept[64] = "";
		size_t off = 0;

		for (uint32_t i = 0; i < SHARDD_GRAD_NORM_KEPT; i++)
			if (eg->j->gnorm[i].step && off < sizeof(kept))
				off += (size_t)snprintf(kept + off, sizeof(kept) - off, "%s%llu",
							off ? ", " : "",
							(unsigned long long)eg->j->gnorm[i].step);
		eng_fmt(err, errlen,
			"shardd: step(group '%s', step %llu): flags = 0x%x need the job's grad_norm of "
			"step %llu, and the daemon holds none (it keeps the last %d: %s); every rank calls "
			"grad_norm(step %llu) after the step's reduces, then steps",
			eg->g->name, (unsigned long long)sqe->step, sqe->flags,
			(unsigned long long)sqe->step, SHARDD_GRAD_NORM_KEPT, off ? kept : "none",
			(unsigned long long)sqe->step);
		return -SHARDD_E_STATE;
	}
	op->job_skip = (sqe->flags & SHARDD_STEP_SKIP_JOB_NONFINITE) && rec->nonfinite;
	if (!(sqe->flags & SHARDD_STEP_CLIP_JOB) || op->job_skip)
		return 0;
	memcpy(&max_norm, &sqe->arg[SHARDD_SQE_STEP_CLIP], sizeof(max_norm));
	op->job_clip = shd_clip_coefficient(rec->norm, max_norm);
	op->job_clip_set = 1;
	if (isnan(op->job_clip)) {
		eng_fmt(err, errlen,
			"shardd: step(group '%s', step %llu): the job's grad_norm of step %llu is %g, "
			"so the clip coefficient is NaN and would turn every param into NaN; add "
			"SHARDD_STEP_SKIP_JOB_NONFINITE to skip such a step on every rank",
			eg->g->name, (unsigned long long)sqe->step, (unsigned long long)sqe->step,
			rec->norm);
		return -SHARDD_E_INVALID;
	}
	return 0;
}

/* Keep the entry of the highest step submitted to the group, for SHARDD_STEP_REPLAY. */
static void step_remember(struct eng_group *eg, const struct shardd_sqe *sqe)
{
	if (sqe->step > eg->last_sub.step)
		eg->last_sub = *sqe;
}

int eng_step_admit(struct eng_group *eg, struct eng_op *op, char *err, size_t errlen)
{
	int step = op->sqe.op == SHARDD_OP_STEP;
	int ret =
		step && (op->sqe.flags & SHARDD_STEP_REPLAY) ? step_replay(eg, op, err, errlen) : 0;

	if (!ret)
		ret = step_check(eg, &op->sqe, err, errlen);
	if (!ret && step)
		ret = step_job(eg, op, err, errlen);
	if (!ret)
		step_remember(eg, &op->sqe);
	return ret;
}

/* ------------------------------------------------------------------ */
/* In the group's task                                                 */
/* ------------------------------------------------------------------ */

int eng_step_plan(const struct shd_group *g, const struct eng_op *op, int grad_present,
		  struct eng_step_plan *p, char *err, size_t errlen)
{
	const struct shardd_sqe *sqe = &op->sqe;
	uint32_t r = op->rank;
	double clip = 1;

	memset(p, 0, sizeof(*p));
	/* Tasks of a group run one at a time: last_step is read and advanced by one task at a time. */
	if (sqe->step <= g->last_step[r]) {
		p->verdict = ENG_STEP_ALREADY;
		return 0;
	}
	if (!grad_present) {
		eng_fmt(err, errlen,
			"shardd: step(group '%s', step %llu) on rank %u: the rank's sharded grad is absent (no "
			"reduce since its last step or zero_grad); reduce the step's grads before its step",
			g->name, (unsigned long long)sqe->step, r);
		return -SHARDD_E_STATE;
	}
	if (op->job_skip) {
		p->verdict = ENG_STEP_SKIP_JOB;
		return 0;
	}
	memcpy(&p->lr, &sqe->arg[SHARDD_SQE_STEP_LR], sizeof(p->lr));
	if (sqe->op == SHARDD_OP_STEP && (sqe->flags & SHARDD_STEP_CLIP))
		memcpy(&clip, &sqe->arg[SHARDD_SQE_STEP_CLIP], sizeof(clip));
	if (op->job_clip_set)
		clip = op->job_clip;
	p->verdict = ENG_STEP_APPLY;
	p->grad_scale = (float)clip;
	p->skip_nonfinite = sqe->op == SHARDD_OP_STEP && (sqe->flags & SHARDD_STEP_SKIP_NONFINITE);
	p->update = g->optim_steps[r] + 1;
	return 0;
}

int eng_step_plan_fused(const struct shd_group *g, const struct eng_op *op, struct eng_step_plan *p)
{
	/* The reduce assigns an absent grad, and the step that follows reads exactly that. */
	if (op->sqe.op != SHARDD_OP_REDUCE || !(op->sqe.flags & SHARDD_REDUCE_STEP) ||
	    g->grad_present[op->rank])
		return 0;
	return eng_step_plan(g, op, 1, p, NULL, 0) == 0 && p->verdict == ENG_STEP_APPLY;
}

int eng_step_record(struct shd_group *g, uint32_t rank, uint64_t step, int updated)
{
	if (updated)
		g->optim_steps[rank]++;
	/* GROUP replies read it on the loop thread while a pool thread runs the group's task. */
	__atomic_store_n(&g->last_step[rank], step, __ATOMIC_RELAXED);
	return updated ? SHARDD_STEP_APPLIED : SHARDD_STEP_SKIPPED;
}

void eng_step_last(const struct shd_group *g, uint32_t rank, uint64_t *last, uint64_t *peer_last)
{
	*last = __atomic_load_n(&g->last_step[rank], __ATOMIC_RELAXED);
	*peer_last = 0;
	for (uint32_t r = 0; r < g->world; r++) {
		uint64_t s = __atomic_load_n(&g->last_step[r], __ATOMIC_RELAXED);

		if (s > *peer_last)
			*peer_last = s;
	}
}

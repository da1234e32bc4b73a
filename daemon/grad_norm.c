/* SPDX-License-Identifier: MIT */
/*
 * The total norm of a job's sharded grads (SHARDD_OP_GRAD_NORM, job.c's
 * rendezvous): on the loop thread, through the backend's grad_norm where
 * it has one (cuda: on the device), else through its read and the CPU
 * kernel. Each HSDP replica holds the same reduced grad, so
 * only replica 0's shards count; padding rows past a param's valid rows are
 * skipped; an absent sharded grad counts as zero.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine_int.h"
#include "shardd_kernels.h"

/* fp32 elements read from the backend per kernel call. */
#define GRAD_NORM_CHUNK 65536u

/* Fold the valid rows of every param of shard rank `r` of group `g` into *acc. */
static int grad_norm_shard(struct shd_backend_ctx *b, const struct shd_group *g, uint32_t r,
			   float *tmp, struct shardd_grad_norm_part *acc)
{
	const struct shd_layout *l = &g->layout;

	for (uint32_t i = 0; i < l->nparams; i++) {
		const struct shd_layout_param *p = &l->params[i];
		uint64_t n = p->numel ? p->outer * shd_layout_rows_valid(p, shd_group_shard_rank(g, r)) * p->inner : 0;

		for (uint64_t done = 0; done < n; ) {
			uint64_t k = n - done < GRAD_NORM_CHUNK ? n - done : GRAD_NORM_CHUNK;
			struct shardd_grad_norm_part part;
			int ret = b->ops->read(b, &g->sharded_grads[r], p->shard_offset + done * sizeof(float),
					       k * sizeof(float), tmp);

			if (ret)
				return ret;
			shardd_k_grad_norm_part(tmp, SHARDD_DTYPE_FP32, 0, k, &part);
			shardd_k_grad_norm_merge(acc, &part);
			done += k;
		}
	}
	return 0;
}

int shd_engine_job_grad_norm(struct shd_engine_job *j, int inf, double *norm, int *nonfinite,
			     char *msg, size_t len)
{
	struct shd_backend_ctx *b = j->e->backend;
	struct shardd_grad_norm_part acc = { 0 };
	float *tmp;
	int ret = 0;

	if (j->span_nodes > 1 && j->span_replicate == 1) {
		eng_fmt(msg, len, "grad_norm of job '%s', sharded over %u nodes (mesh 1x%u): each node holds "
			"only its ranks' shards, and shardd does not sum norms across nodes yet; compute the "
			"norm in the trainer (all-reduce of the local squared norms)", j->name, j->span_nodes,
			j->span_shard);
		return -SHARDD_E_STATE;
	}
	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];

		if (eg && eg->complete && (eg->running || eg->qhead)) {
			eng_fmt(msg, len, "group '%s' still has a %s in flight; submit grad_norm after the "
				"completions of the step's reduces", eg->g->name,
				shardd_op_name((eg->running ? eg->running : eg->qhead)->ops[0].sqe.op));
			return -SHARDD_E_STATE;
		}
	}
	tmp = malloc(GRAD_NORM_CHUNK * sizeof(float));
	if (!tmp) {
		eng_fmt(msg, len, "out of memory for the %u-element read buffer", GRAD_NORM_CHUNK);
		return -SHARDD_E_NOMEM;
	}
	for (uint32_t i = 0; i < j->ngroups && !ret; i++) {
		struct eng_group *eg = j->groups[i];

		if (!eg || !eg->complete)
			continue;
		for (uint32_t r = 0; r < eg->g->shard && !ret; r++) {
			struct shardd_grad_norm_part part;
			char why[256] = "";

			if (!eg->g->grad_present[r])
				continue;
			if (!b->ops->grad_norm) {
				ret = grad_norm_shard(b, eg->g, r, tmp, &acc);
			} else {
				ret = b->ops->grad_norm(b, &eg->g->layout, r, &eg->g->sharded_grads[r], &part, why,
							sizeof(why));
				if (!ret)
					shardd_k_grad_norm_merge(&acc, &part);
			}
			if (ret)
				eng_fmt(msg, len, "reading rank %u's sharded grad of group '%s' failed in the %s "
					"backend (%d)%s%s", r, eg->g->name, b->ops->name, ret, why[0] ? ": " : "", why);
		}
	}
	free(tmp);
	if (ret)
		return ret < 0 ? ret : -SHARDD_E_BACKEND;
	*nonfinite = acc.nonfinite;
	*norm = inf ? (double)acc.max_abs : sqrt(acc.sumsq);
	/* max_abs skips NaN elements: a non-finite set without an Inf held a NaN, and torch says NaN. */
	if (inf && acc.nonfinite && !isinf(*norm))
		*norm = (double)NAN;
	return 0;
}

void shd_engine_job_grad_norm_keep(struct shd_engine_job *j, uint64_t step, double norm, int nonfinite)
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

const struct eng_gnorm_rec *eng_gnorm_find(const struct shd_engine_job *j, uint64_t step)
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

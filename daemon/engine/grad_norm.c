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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_int.h"
#include "clock.h"
#include "shardd_kernels.h"
#include "world.h"

/* fp32 elements read from the backend per kernel call. */
#define GRAD_NORM_CHUNK 65536u

/* Fold the valid rows of every param of shard rank `r` of group `g` into *acc. */
static int grad_norm_shard(struct shd_backend_ctx *b, const struct shd_group *g, uint32_t r,
			   float *tmp, struct shardd_grad_norm_part *acc)
{
	const struct shd_layout *l = &g->layout;

	for (uint32_t i = 0; i < l->nparams; i++) {
		const struct shd_layout_param *p = &l->params[i];
		uint64_t n =
			p->numel ? p->outer * shd_layout_rows_valid(p, shd_group_shard_rank(g, r)) *
					   p->inner
				 : 0;

		for (uint64_t done = 0; done < n;) {
			uint64_t k = n - done < GRAD_NORM_CHUNK ? n - done : GRAD_NORM_CHUNK;
			struct shardd_grad_norm_part part;
			int ret = b->ops->read(b, &g->sharded_grads[r],
					       p->shard_offset + done * sizeof(float),
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

/* The part of this node's sharded grads into *acc. 0, or a negative code with `err` saying why. */
static int grad_norm_local(struct shd_engine_job *j, struct shardd_grad_norm_part *acc, char *err,
			   size_t errlen)
{
	struct shd_backend_ctx *b = j->e->backend;
	float *tmp;
	int ret = 0;

	memset(acc, 0, sizeof(*acc));
	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];

		if (eg && eg->complete && (eg->running || eg->qhead)) {
			eng_fmt(err, errlen,
				"group '%s' still has a %s in flight; submit grad_norm after the "
				"completions of the step's reduces",
				eg->g->name,
				shd_op_info((eg->running ? eg->running : eg->qhead)->ops[0].sqe.op)
					->name);
			return -SHARDD_E_STATE;
		}
	}
	tmp = malloc(GRAD_NORM_CHUNK * sizeof(float));
	if (!tmp) {
		eng_fmt(err, errlen, "out of memory for the %u-element read buffer",
			GRAD_NORM_CHUNK);
		return -SHARDD_E_NOMEM;
	}
	for (uint32_t i = 0; i < j->ngroups && !ret; i++) {
		struct eng_group *eg = j->groups[i];

		if (!eg || !eg->complete)
			continue;
		for (uint32_t r = 0; r < eg->g->shard && !ret; r++) {
			struct shardd_grad_norm_part part;
			char why[256] = "";

			if (!shd_group_grad_present(eg->g, b, r))
				continue;
			if (!b->ops->grad_norm) {
				ret = grad_norm_shard(b, eg->g, r, tmp, acc);
			} else {
				ret = b->ops->grad_norm(
					b, &eg->g->layout, shd_group_shard_rank(eg->g, r),
					&eg->g->sharded_grads[r], &part, why, sizeof(why));
				if (!ret)
					shardd_k_grad_norm_merge(acc, &part);
			}
			if (ret)
				eng_fmt(err, errlen,
					"reading rank %u's sharded grad of group '%s' failed in the %s "
					"backend (%d)%s%s",
					r, eg->g->name, b->ops->name, ret, why[0] ? ": " : "", why);
		}
	}
	free(tmp);
	return ret ? (ret < 0 ? ret : -SHARDD_E_BACKEND) : 0;
}

static void grad_norm_final(const struct shardd_grad_norm_part *acc, int inf, double *norm,
			    int *nonfinite)
{
	*nonfinite = acc->nonfinite;
	*norm = inf ? (double)acc->max_abs : sqrt(acc->sumsq);
	/* max_abs skips NaN elements: a non-finite set without an Inf held a NaN, and torch says NaN. */
	if (inf && acc->nonfinite && !isinf(*norm))
		*norm = (double)NAN;
}

int shd_engine_job_grad_norm(struct shd_engine_job *j, int inf, double *norm, int *nonfinite,
			     char *err, size_t errlen)
{
	struct shardd_grad_norm_part acc;
	int ret;

	if (eng_world_fsdp(j)) {
		eng_fmt(err, errlen,
			"grad_norm of job '%s', sharded over %u nodes: use shd_engine_job_grad_norm_span",
			j->name, j->span_nodes);
		return -SHARDD_E_STATE;
	}
	ret = grad_norm_local(j, &acc, err, errlen);
	if (!ret)
		grad_norm_final(&acc, inf, norm, nonfinite);
	return ret;
}

/*
 * FSDP across nodes: each node holds only its ranks' shards, so each sends
 * its part (sum of squares, max, non-finite) to every node, and every node
 * merges the parts in node order: the same total, to the bit, everywhere.
 */
int shd_engine_job_spans_fsdp(const struct shd_engine_job *j)
{
	return eng_world_fsdp(j);
}

int shd_engine_job_grad_norm_span(struct shd_engine_job *j, int inf, uint64_t step, char *err,
				  size_t errlen)
{
	struct shardd_grad_norm_part acc;
	uint64_t key = 0xcbf29ce484222325ull, check = 0xcbf29ce484222325ull,
		 v[2] = { step, (uint64_t)inf };
	char why[256];
	int ret;

	ret = grad_norm_local(j, &acc, err, errlen);
	if (ret)
		return ret;
	/* The job's grad_norm stream: its name and a name no group can have (an empty one). */
	for (const char *c = j->name; *c; c++)
		key = (key ^ (uint8_t)*c) * 0x100000001b3ull;
	key = (key ^ 0xff) * 0x100000001b3ull;
	key = (key ^ 0xfe) * 0x100000001b3ull;
	for (size_t i = 0; i < sizeof(v); i++)
		check = (check ^ ((const uint8_t *)v)[i]) * 0x100000001b3ull;
	ret = shd_world_gather_start(key, j->gnorm_seq++, check, &acc, sizeof(acc),
				     shd_now_ns() + j->e->timeout_ns, j->e->efd, &j->gnorm_op, why,
				     sizeof(why));
	if (ret) {
		eng_fmt(err, errlen, "%s", why);
		return ret;
	}
	j->gnorm_inf = inf;
	j->gnorm_step = step;
	return 0;
}

int shd_engine_job_grad_norm_pending(const struct shd_engine_job *j)
{
	return j->gnorm_op != NULL;
}

int shd_engine_job_grad_norm_poll(struct shd_engine_job *j, double *norm, int *nonfinite, char *err,
				  size_t errlen)
{
	struct shardd_grad_norm_part parts[SHARDD_MAX_WORLD], acc = { 0 };
	uint8_t missing[SHARDD_MAX_WORLD];
	char why[384], who[256];
	size_t off = 0;
	int ret;

	if (!j->gnorm_op || !shd_world_op_done(j->gnorm_op))
		return 1;
	ret = shd_world_op_end(j->gnorm_op, parts, missing, why, sizeof(why));
	j->gnorm_op = NULL;
	if (ret) {
		who[0] = '\0';
		for (uint32_t k = 0; k < j->span_nodes && off < sizeof(who); k++)
			if (missing[k])
				off += (size_t)snprintf(who + off, sizeof(who) - off,
							"%snode %u (ranks %u..%u)", off ? ", " : "",
							k, k * j->world,
							k * j->world + j->world - 1);
		eng_fmt(err, errlen,
			"the sum of the norms among the %u nodes failed on node %u: %s%s%s",
			j->span_nodes, j->span_node, why, who[0] ? "; missing " : "", who);
		return ret;
	}
	for (uint32_t k = 0; k < j->span_nodes; k++)
		shardd_k_grad_norm_merge(&acc, &parts[k]);
	grad_norm_final(&acc, j->gnorm_inf, norm, nonfinite);
	return 0;
}

void shd_engine_job_grad_norm_abandon(struct shd_engine_job *j)
{
	if (j->gnorm_op)
		shd_world_op_abandon(j->gnorm_op);
	j->gnorm_op = NULL;
}

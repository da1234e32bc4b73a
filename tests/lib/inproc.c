/* SPDX-License-Identifier: MIT */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inproc.h"
#include "optim_isa.h"

void inproc_start(struct harness_daemon *hd, const char *const *extra, const char *job,
		  uint32_t replicate, uint32_t shard, int32_t device, struct shardd_client **c)
{
	memset(hd, 0, sizeof(*hd));
	cr_assert_eq(harness_daemon_start(hd, extra), 0, "shardd did not start");
	for (uint32_t r = 0; r < replicate * shard; r++) {
		struct shardd_attach_opts ao = {
			.socket_path = hd->socket,
			.job = job,
			.rank = r,
			.replicate = replicate,
			.shard = shard,
			.device = device,
			.timeout_ms = 10000,
		};

		cr_assert_eq(shardd_connect(&ao, &c[r]), 0, "%s", shardd_last_error());
	}
}

static void *register_main(void *p)
{
	struct inproc_reg *a = p;

	a->ret = shardd_group_register(a->c, a->name, a->params, a->nparams, &a->precision,
				       &a->opts, &a->g);
	if (a->ret)
		snprintf(a->err, sizeof(a->err), "%s", shardd_last_error());
	return NULL;
}

void inproc_register(struct inproc_reg *reg, uint32_t n)
{
	pthread_t th[SHARDD_MAX_WORLD];

	cr_assert_leq(n, SHARDD_MAX_WORLD);
	for (uint32_t r = 0; r < n; r++)
		cr_assert_eq(pthread_create(&th[r], NULL, register_main, &reg[r]), 0);
	for (uint32_t r = 0; r < n; r++)
		pthread_join(th[r], NULL);
}

void inproc_register_ok(struct shardd_client **c, uint32_t n, const char *name,
			const struct shardd_param_desc *params, uint32_t nparams,
			const struct shardd_precision *precision,
			const struct shardd_group_opts *opts, struct shardd_group **g)
{
	static const struct shardd_precision plain = { .param_dtype = SHARDD_DTYPE_NONE,
						       .reduce_dtype = SHARDD_DTYPE_NONE };
	static const struct shardd_group_opts none = { .optimizer = NULL };
	struct inproc_reg reg[SHARDD_MAX_WORLD];

	cr_assert_leq(n, SHARDD_MAX_WORLD);
	for (uint32_t r = 0; r < n; r++)
		reg[r] = (struct inproc_reg){ .c = c[r],
					      .name = name,
					      .params = params,
					      .nparams = nparams,
					      .precision = precision ? *precision : plain,
					      .opts = opts ? *opts : none };
	inproc_register(reg, n);
	for (uint32_t r = 0; r < n; r++) {
		cr_assert_eq(reg[r].ret, 0, "rank %u register: %s", r, reg[r].err);
		g[r] = reg[r].g;
	}
}

void inproc_wait_each(struct shardd_client **c, uint32_t n, struct shardd_completion *cps,
		      int timeout_ms)
{
	int64_t deadline = harness_now_ms() + timeout_ms;
	uint8_t got[SHARDD_MAX_WORLD] = { 0 };
	uint32_t left = n;

	cr_assert_leq(n, SHARDD_MAX_WORLD);
	while (left) {
		for (uint32_t r = 0; r < n; r++) {
			int ret;

			if (got[r])
				continue;
			ret = shardd_poll(c[r], &cps[r]);
			if (ret == -EAGAIN)
				continue;
			cr_assert_eq(ret, 0, "rank %u: %s", r, shardd_last_error());
			got[r] = 1;
			left--;
		}
		cr_assert_lt(harness_now_ms(), deadline, "%u ranks got no completion in %d ms",
			     left, timeout_ms);
	}
}

void inproc_reduce(struct shardd_client **c, struct shardd_group *const *g, uint32_t n,
		   uint64_t step, uint32_t flags)
{
	struct shardd_completion cp[SHARDD_MAX_WORLD];

	cr_assert_leq(n, SHARDD_MAX_WORLD);
	for (uint32_t r = 0; r < n; r++)
		cr_assert_eq(shardd_group_submit(g[r], SHARDD_OP_REDUCE, step, flags, 100 + r), 0,
			     "%s", shardd_last_error());
	inproc_wait_each(c, n, cp, 30000);
	for (uint32_t r = 0; r < n; r++)
		cr_assert_eq(cp[r].res, 0, "rank %u reduce %llu: %s", r, (unsigned long long)step,
			     cp[r].msg);
}

void inproc_checkpoint(struct shardd_client **c, uint32_t n, uint64_t step)
{
	struct shardd_completion cp;

	for (uint32_t r = 0; r < n; r++)
		cr_assert_eq(shardd_client_submit(c[r], SHARDD_OP_CHECKPOINT, step, 0, 200 + r), 0,
			     "%s", shardd_last_error());
	for (uint32_t r = 0; r < n; r++) {
		cr_assert_eq(shardd_wait(c[r], &cp, 30000), 0, "%s", shardd_last_error());
		cr_assert_eq(cp.op, SHARDD_OP_CHECKPOINT,
			     "rank %u: %s completed, not the checkpoint", r, shardd_op_name(cp.op));
		cr_assert_eq(cp.res, 0, "rank %u checkpoint %llu: %s", r, (unsigned long long)step,
			     cp.msg);
	}
}

void inproc_finish(struct harness_daemon *hd, struct shardd_client **c, struct shardd_group **g,
		   uint32_t n)
{
	for (uint32_t r = 0; r < n; r++) {
		shardd_group_close(g[r]);
		shardd_close(c[r]);
	}
	harness_daemon_stop_expect_clean(hd);
}

float inproc_rnd(uint64_t *state)
{
	*state ^= *state << 13;
	*state ^= *state >> 7;
	*state ^= *state << 17;
	return (float)((double)(*state >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
}

uint64_t inproc_numel(const struct shardd_param_desc *d)
{
	uint64_t n = 1;

	for (uint32_t k = 0; k < d->ndim; k++)
		n *= d->shape[k];
	return n;
}

uint64_t inproc_valid_numel(const struct shardd_group *g, const struct shardd_param_desc *params,
			    uint32_t i)
{
	const struct shardd_param_desc *d = &params[i];
	const struct shardd_param_layout *l = shardd_group_layout(g, i);
	uint64_t dim = d->ndim ? d->shape[d->shard_dim] : 1;

	return dim ? l->shard_rows_valid * (inproc_numel(d) / dim) : 0;
}

void inproc_ref_alloc(struct inproc_ref *ref, int r, uint32_t i, uint64_t n)
{
	cr_assert(r >= 0 && r < INPROC_REF_RANKS && i < INPROC_REF_PARAMS,
		  "reference of rank %d param %u", r, i);
	ref->p[r][i] = calloc(n + 1, sizeof(float));
	cr_assert_not_null(ref->p[r][i]);
	for (int k = 0; k < 3; k++) {
		ref->s[r][i][k] = calloc(n + 1, sizeof(float));
		cr_assert_not_null(ref->s[r][i][k]);
	}
}

void inproc_ref_free(struct inproc_ref *ref)
{
	for (int r = 0; r < INPROC_REF_RANKS; r++)
		for (uint32_t i = 0; i < INPROC_REF_PARAMS; i++) {
			free(ref->p[r][i]);
			for (int k = 0; k < 3; k++)
				free(ref->s[r][i][k]);
		}
}

void inproc_ref_step(const struct shardd_optim_config *o, float *param, const float *grad,
		     float *const state[3], uint64_t step, double lr, float scale, uint64_t n)
{
	if (o->kind == SHARDD_OPTIM_SGD) {
		struct shardd_sgd a = {
			.param = param,
			.grad = grad,
			.momentum_buffer = o->momentum ? state[0] : NULL,
			.grad_dtype = SHARDD_DTYPE_FP32,
			.step = step,
			.lr = lr,
			.momentum = o->momentum,
			.dampening = o->dampening,
			.weight_decay = o->weight_decay,
			.nesterov = !!(o->flags & SHARDD_OPTIM_NESTEROV),
			.maximize = !!(o->flags & SHARDD_OPTIM_MAXIMIZE),
			.grad_scale = scale,
		};
		shardd_k_sgd_isa(SHARDD_K_ISA_PORTABLE, &a, 0, n);
	} else {
		struct shardd_adamw a = {
			.param = param,
			.grad = grad,
			.exp_avg = state[0],
			.exp_avg_sq = state[1],
			.max_exp_avg_sq = (o->flags & SHARDD_OPTIM_AMSGRAD) ? state[2] : NULL,
			.grad_dtype = SHARDD_DTYPE_FP32,
			.step = step,
			.lr = lr,
			.beta1 = o->beta1,
			.beta2 = o->beta2,
			.eps = o->eps,
			.weight_decay = o->weight_decay,
			.amsgrad = !!(o->flags & SHARDD_OPTIM_AMSGRAD),
			.maximize = !!(o->flags & SHARDD_OPTIM_MAXIMIZE),
			.grad_scale = scale,
		};
		shardd_k_adamw_isa(SHARDD_K_ISA_PORTABLE, &a, 0, n);
	}
}

void inproc_expect_shard(const char *what, int rank, const char *name, const float *shard,
			 const float *ref, const float *grad, uint64_t n, uint64_t all)
{
	for (uint64_t e = 0; e < n; e++)
		cr_assert_eq(memcmp(&shard[e], &ref[e], sizeof(float)), 0,
			     "%s: rank %d param '%s'[%llu] = %.9g, reference %.9g", what, rank,
			     name, (unsigned long long)e, shard[e], ref[e]);
	for (uint64_t e = n; e < all; e++)
		cr_assert_eq(shard[e], 0.0f, "%s: rank %d param '%s' padding [%llu] = %g", what,
			     rank, name, (unsigned long long)e, shard[e]);
	for (uint64_t e = 0; e < all; e++)
		cr_assert_eq(grad[e], 0.0f,
			     "%s: rank %d param '%s' sharded grad [%llu] = %g after the step", what,
			     rank, name, (unsigned long long)e, grad[e]);
}

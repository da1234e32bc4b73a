/* SPDX-License-Identifier: MIT */
/*
 * The job-wide grad_norm op through a real shardd: the total norm of every
 * group's sharded grads against a reference computed here, in fp64, from
 * the unsharded grads the ranks wrote (the reduce averages them), so it
 * knows nothing of shards or padding. Padding rows of the sharded grads are
 * filled with large values after the reduce: a norm that counted them would
 * be far off. HSDP counts each replica once; a NaN sets the flag; a
 * mismatch of step or norm_type, a bad norm_type and a missing rank fail
 * with errors that name them.
 *
 * Every rank is a client of this one process: registration and the sync
 * calls run on threads, the rest is submitted on every ring before any is
 * reaped.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "inproc.h"
#include "shardd.h"

#define NP   4
#define NG   2
#define MAXW 4

/* Shard(0) params: padding rows (5 rows over 2 ranks), zero elements, a vector, a 0-d scalar. */
static const struct shardd_param_desc params[NP] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 } },
	{ .name = "empty", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 0, 4 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 7 } },
	{ .name = "s", .dtype = SHARDD_DTYPE_FP32, .ndim = 0 },
};

static const char *const group_names[NG] = { "enc", "dec" };

struct fixture {
	struct harness_daemon hd;
	uint32_t replicate, shard, world;
	struct shardd_client *c[MAXW];
	struct shardd_group *g[MAXW][NG];
};

static void start(struct fixture *f, uint32_t replicate, uint32_t shard, const char *timeout_s)
{
	const char *const extra[] = { "--collective-timeout", timeout_s, NULL };
	struct shardd_group *g[MAXW];

	memset(f, 0, sizeof(*f));
	f->replicate = replicate;
	f->shard = shard;
	f->world = replicate * shard;
	inproc_start(&f->hd, extra, "gnorm", replicate, shard, SHARDD_HELLO_DEVICE_HOST, f->c);
	for (int k = 0; k < NG; k++) {
		inproc_register_ok(f->c, f->world, group_names[k], params, NP, NULL, NULL, g);
		for (uint32_t r = 0; r < f->world; r++)
			f->g[r][k] = g[r];
	}
}

static void finish(struct fixture *f)
{
	for (uint32_t r = 0; r < f->world; r++) {
		if (!f->c[r])
			continue;
		for (int k = 0; k < NG; k++)
			shardd_group_close(f->g[r][k]);
		shardd_close(f->c[r]);
	}
	harness_daemon_stop_expect_clean(&f->hd);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float rnd(void)
{
	return inproc_rnd(&rng_state);
}

struct ref_norm {
	double sumsq, max_abs;
};

/*
 * Every rank writes random grads (rank 0's first element of group 0 NaN
 * when `poison`), every group is reduced (with the all-reduce under HSDP),
 * then the padding of every sharded grad is filled with 1000. *ref is the
 * norm of the reduced grads: per element the mean over all ranks, in fp64.
 */
static void reduce_all(struct fixture *f, uint64_t step, int poison, struct ref_norm *ref)
{
	uint32_t flags = f->replicate > 1 ? SHARDD_REDUCE_ALL_REDUCE : 0;
	struct shardd_completion cps[SHARDD_MAX_WORLD];

	memset(ref, 0, sizeof(*ref));
	for (int k = 0; k < NG; k++)
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = shardd_group_layout(f->g[0][k], i)->grad_bytes / sizeof(float);

			for (uint64_t e = 0; e < n; e++) {
				double mean = 0;

				for (uint32_t r = 0; r < f->world; r++) {
					float *gr = shardd_group_grad(f->g[r][k], i);

					gr[e] = rnd();
					mean += gr[e];
				}
				mean /= f->world;
				ref->sumsq += mean * mean;
				ref->max_abs = fmax(ref->max_abs, fabs(mean));
			}
		}
	if (poison)
		((float *)shardd_group_grad(f->g[0][0], 0))[0] = NAN;
	for (int k = 0; k < NG; k++) {
		for (uint32_t r = 0; r < f->world; r++)
			cr_assert_eq(shardd_group_submit(f->g[r][k], SHARDD_OP_REDUCE, step, flags,
							 100 + r),
				     0, "%s", shardd_last_error());
		inproc_wait_each(f->c, f->world, cps, 30000);
		for (uint32_t r = 0; r < f->world; r++)
			cr_assert_eq(cps[r].res, 0, "rank %u reduce of %s: %s", r, group_names[k],
				     cps[r].msg);
	}
	for (uint32_t r = 0; r < f->world; r++)
		for (int k = 0; k < NG; k++)
			for (uint32_t i = 0; i < NP; i++) {
				const struct shardd_param_layout *l =
					shardd_group_layout(f->g[r][k], i);
				float *sg = shardd_group_shard_grad(f->g[r][k], i);
				uint64_t per_row = 1;

				for (uint32_t d = 1; d < params[i].ndim; d++)
					per_row *= params[i].shape[d];
				for (uint64_t e = l->shard_rows_valid * per_row;
				     e < l->shard_bytes / sizeof(float); e++)
					sg[e] = 1000.0f;
			}
}

/* Submit grad_norm(step, type[r]) on every ring, then take every completion into cps. */
static void grad_norm_all(struct fixture *f, const uint64_t *step, const double *type,
			  struct shardd_completion *cps)
{
	for (uint32_t r = 0; r < f->world; r++)
		cr_assert_eq(shardd_grad_norm_submit(f->c[r], step[r], type[r], 200 + r), 0, "%s",
			     shardd_last_error());
	for (uint32_t r = 0; r < f->world; r++) {
		cr_assert_eq(shardd_wait(f->c[r], &cps[r], 30000), 0, "%s", shardd_last_error());
		cr_assert_eq(cps[r].user_data, 200 + r);
		cr_assert_eq(cps[r].op, SHARDD_OP_GRAD_NORM);
	}
}

/* Every rank's grad_norm(step, type) succeeds with the reference norm and no flag. */
static void expect_norm(struct fixture *f, uint64_t step, double type, double want)
{
	uint64_t steps[MAXW];
	double types[MAXW];
	struct shardd_completion cps[MAXW];

	for (uint32_t r = 0; r < f->world; r++) {
		steps[r] = step;
		types[r] = type;
	}
	grad_norm_all(f, steps, types, cps);
	for (uint32_t r = 0; r < f->world; r++) {
		double norm;
		int nonfinite;

		cr_assert_eq(cps[r].res, 0, "rank %u grad_norm: %s", r, cps[r].msg);
		shardd_grad_norm_result(&cps[r], &norm, &nonfinite);
		cr_assert_eq(nonfinite, 0, "rank %u", r);
		/* The reduce rounds each mean to fp32: a relative 2^-23 per element bounds the norm's error. */
		cr_assert(fabs(norm - want) <= 1e-6 * want,
			  "rank %u: norm_type %g: %.17g, reference %.17g", r, type, norm, want);
	}
}

Test(grad_norm, two_groups_count_valid_rows_only, .timeout = 60)
{
	struct fixture f;
	struct ref_norm ref;

	start(&f, 1, 2, "20");
	reduce_all(&f, 1, 0, &ref);
	cr_assert_gt(ref.sumsq, 0);
	expect_norm(&f, 1, 2.0, sqrt(ref.sumsq));
	expect_norm(&f, 1, INFINITY, ref.max_abs);
	finish(&f);
}

struct sync_arg {
	struct shardd_client *c;
	double norm;
	int nonfinite, ret;
};

static void *sync_main(void *p)
{
	struct sync_arg *a = p;

	a->ret = shardd_grad_norm(a->c, 7, 2.0, &a->norm, &a->nonfinite);
	return NULL;
}

Test(grad_norm, sync_call_returns_the_norm_and_absent_grads_count_zero, .timeout = 60)
{
	struct fixture f;
	struct ref_norm ref;
	struct sync_arg a[2];
	pthread_t th[2];

	start(&f, 1, 2, "20");
	/* Nothing reduced yet: every sharded grad is absent. */
	for (int r = 0; r < 2; r++) {
		a[r] = (struct sync_arg){ .c = f.c[r] };
		cr_assert_eq(pthread_create(&th[r], NULL, sync_main, &a[r]), 0);
	}
	for (int r = 0; r < 2; r++) {
		pthread_join(th[r], NULL);
		cr_assert_eq(a[r].ret, 0, "rank %d: %s", r, shardd_last_error());
		cr_assert_eq(a[r].norm, 0.0);
		cr_assert_eq(a[r].nonfinite, 0);
	}
	reduce_all(&f, 1, 0, &ref);
	for (int r = 0; r < 2; r++)
		cr_assert_eq(pthread_create(&th[r], NULL, sync_main, &a[r]), 0);
	for (int r = 0; r < 2; r++) {
		pthread_join(th[r], NULL);
		cr_assert_eq(a[r].ret, 0, "rank %d: %s", r, shardd_last_error());
		cr_assert(fabs(a[r].norm - sqrt(ref.sumsq)) <= 1e-6 * sqrt(ref.sumsq),
			  "rank %d: %.17g vs %.17g", r, a[r].norm, sqrt(ref.sumsq));
	}
	finish(&f);
}

Test(grad_norm, hsdp_counts_each_replica_once, .timeout = 60)
{
	struct fixture f;
	struct ref_norm ref;

	start(&f, 2, 2, "20");
	reduce_all(&f, 1, 0, &ref);
	expect_norm(&f, 1, 2.0, sqrt(ref.sumsq));
	expect_norm(&f, 1, INFINITY, ref.max_abs);
	finish(&f);
}

Test(grad_norm, nan_grad_sets_the_nonfinite_flag, .timeout = 60)
{
	struct fixture f;
	struct ref_norm ref;
	uint64_t steps[2] = { 3, 3 };
	double types[2] = { 2.0, 2.0 };
	struct shardd_completion cps[2];

	start(&f, 1, 2, "20");
	reduce_all(&f, 3, 1, &ref);
	grad_norm_all(&f, steps, types, cps);
	for (int r = 0; r < 2; r++) {
		double norm;
		int nonfinite;

		cr_assert_eq(cps[r].res, 0, "rank %d: %s", r, cps[r].msg);
		shardd_grad_norm_result(&cps[r], &norm, &nonfinite);
		cr_assert_eq(nonfinite, 1, "rank %d", r);
		cr_assert(isnan(norm), "rank %d: norm %g", r, norm);
	}
	finish(&f);
}

Test(grad_norm, mismatched_step_or_norm_type_fails_every_rank, .timeout = 60)
{
	struct fixture f;
	uint64_t steps[2] = { 5, 6 }, same[2] = { 5, 5 };
	double types[2] = { 2.0, 2.0 }, mixed[2] = { 2.0, INFINITY };
	struct shardd_completion cps[2];

	start(&f, 1, 2, "20");
	grad_norm_all(&f, steps, types, cps);
	for (int r = 0; r < 2; r++) {
		cr_assert_eq(cps[r].res, -SHARDD_E_MISMATCH, "rank %d: res %d %s", r, cps[r].res,
			     cps[r].msg);
		cr_assert(strstr(cps[r].msg, "rank 1 submitted grad_norm(step 6, norm_type 2)") &&
				  strstr(cps[r].msg,
					 "rank 0 submitted grad_norm(step 5, norm_type 2)") &&
				  strstr(cps[r].msg, "failing ranks 0,1"),
			  "rank %d: %s", r, cps[r].msg);
	}
	grad_norm_all(&f, same, mixed, cps);
	for (int r = 0; r < 2; r++) {
		cr_assert_eq(cps[r].res, -SHARDD_E_MISMATCH, "rank %d: res %d %s", r, cps[r].res,
			     cps[r].msg);
		cr_assert(strstr(cps[r].msg, "norm_type inf") && strstr(cps[r].msg, "norm_type 2"),
			  "rank %d: %s", r, cps[r].msg);
	}
	/* The rendezvous is free again: a matching call succeeds. */
	expect_norm(&f, 5, 2.0, 0.0);
	finish(&f);
}

Test(grad_norm, bad_norm_type_is_rejected_by_name, .timeout = 60)
{
	struct fixture f;
	struct shardd_completion cp;
	double norm;
	int nonfinite;

	start(&f, 1, 2, "20");
	/* The library refuses it before it reaches the daemon. */
	cr_assert_eq(shardd_grad_norm(f.c[0], 1, 1.0, &norm, &nonfinite), -EINVAL);
	cr_assert(strstr(shardd_last_error(), "norm_type 1 is not supported"), "%s",
		  shardd_last_error());
	/* The daemon refuses it too: a raw entry carries norm_type 0.0. */
	cr_assert_eq(shardd_client_submit(f.c[0], SHARDD_OP_GRAD_NORM, 1, 0, 9), 0, "%s",
		     shardd_last_error());
	cr_assert_eq(shardd_wait(f.c[0], &cp, 30000), 0, "%s", shardd_last_error());
	cr_assert_eq(cp.res, -SHARDD_E_INVALID, "res %d %s", cp.res, cp.msg);
	cr_assert(strstr(cp.msg, "norm_type 0") && strstr(cp.msg, "use 2.0 or inf"), "%s", cp.msg);
	finish(&f);
}

Test(grad_norm, timeout_names_the_missing_rank, .timeout = 60)
{
	struct fixture f;
	struct shardd_completion cp;

	start(&f, 1, 2, "1");
	cr_assert_eq(shardd_grad_norm_submit(f.c[0], 4, 2.0, 11), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_wait(f.c[0], &cp, 30000), 0, "%s", shardd_last_error());
	cr_assert_eq(cp.res, -SHARDD_E_TIMEOUT, "res %d %s", cp.res, cp.msg);
	cr_assert(
		strstr(cp.msg,
		       "grad_norm(step 4): rank 1 did not submit grad_norm within 1 s; rank 0 is waiting"),
		"%s", cp.msg);
	finish(&f);
}

Test(grad_norm, rank_leaving_fails_the_waiting_ranks_by_name, .timeout = 60)
{
	struct fixture f;
	struct shardd_completion cp;

	start(&f, 1, 2, "20");
	cr_assert_eq(shardd_grad_norm_submit(f.c[0], 2, 2.0, 12), 0, "%s", shardd_last_error());
	/* A nop round trip: the daemon has taken rank 0's entry before rank 1 leaves. */
	cr_assert_eq(shardd_nop(f.c[0]), 0, "%s", shardd_last_error());
	for (int k = 0; k < NG; k++)
		shardd_group_close(f.g[1][k]);
	shardd_close(f.c[1]);
	f.c[1] = NULL;
	cr_assert_eq(shardd_wait(f.c[0], &cp, 30000), 0, "%s", shardd_last_error());
	cr_assert_eq(cp.res, -SHARDD_E_PEER_DIED, "res %d %s", cp.res, cp.msg);
	cr_assert(strstr(cp.msg, "grad_norm(step 2): rank 1") &&
			  strstr(cp.msg, "rank 0 was waiting"),
		  "%s", cp.msg);
	finish(&f);
}

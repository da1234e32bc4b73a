/* SPDX-License-Identifier: MIT */
/*
 * The daemon's optimizer on `shardd --backend cuda`, through a real daemon
 * and two ranks (one process, two clients on device 0; registration on two
 * threads): K steps of AdamW amsgrad and of SGD with momentum against the
 * CPU kernels' portable path run on the sharded grads as the daemon holds
 * them (copied back from the device before each step), bit for bit, with a
 * clip coefficient and skip-on-non-finite on some steps; the sharded grad
 * cleared by the step; a re-submitted step applied once only; a NaN in a
 * valid row skips the step on that rank alone; the job's grad_norm
 * (2-norm within fp64 rounding of the CPU kernels' sum, inf-norm exactly);
 * a reduce with SHARDD_REDUCE_STEP applies its step once. Params cover the
 * shape classes of tests/integration/test_optim_daemon.c. Skips without a
 * GPU.
 */
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "inproc.h"
#include "optim_isa.h"
#include "shardd.h"

#define NP      5
#define K_STEPS 4
#define WORLD   2

static const struct shardd_param_desc params[NP] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 } },
	{ .name = "empty", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 0, 4 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 4099 } },
	{ .name = "s", .dtype = SHARDD_DTYPE_FP32, .ndim = 0 },
	{ .name = "c", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shard_dim = 1, .shape = { 4, 6 } },
};

struct fixture {
	struct harness_daemon hd;
	struct shardd_client *c[WORLD];
	struct shardd_group *g[WORLD];
};

static void start(struct fixture *f, const struct shardd_optim_config *o)
{
	static const char *const extra[] = { "--backend", "cuda", "--collective-timeout", "20",
					     NULL };
	const struct shardd_group_opts opts = { .optimizer = o };

	/* Counted in a child: the daemon must be forked before this process touches CUDA. */
	if (harness_cuda_devices() == 0)
		cr_skip_test("no CUDA device visible");
	signal(SIGPIPE, SIG_IGN);
	memset(f, 0, sizeof(*f));
	inproc_start(&f->hd, extra, "optim", 1, WORLD, 0, f->c);
	inproc_register_ok(f->c, WORLD, "layer", params, NP, NULL, &opts, f->g);
}

static void finish(struct fixture *f)
{
	inproc_finish(&f->hd, f->c, f->g, WORLD);
}

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static float rnd(void)
{
	return inproc_rnd(&rng_state);
}

/* Elements of real data in rank `r`'s shard of param i (a prefix of it). */
static uint64_t valid_numel(const struct shardd_group *g, uint32_t i)
{
	return inproc_valid_numel(g, params, i);
}

/* Device `bytes` at `dev` into a new host array. */
static float *from_device(const void *dev, uint64_t bytes)
{
	float *h = malloc(bytes + sizeof(float));

	cr_assert_not_null(h);
	if (bytes)
		CUDA_OK(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
	return h;
}

/* Every rank writes random grads (rank 0's 'b'[1] NaN with `poison`); the reduce of `step` runs on both. */
static void write_grads(struct fixture *f, int poison)
{
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = shardd_group_layout(f->g[r], i)->grad_bytes / sizeof(float);
			float *h = malloc((n + 1) * sizeof(float));

			cr_assert_not_null(h);
			for (uint64_t e = 0; e < n; e++)
				h[e] = rnd();
			if (poison && r == 0 && i == 2)
				h[1] = NAN;
			if (n)
				CUDA_OK(cudaMemcpy(shardd_group_grad(f->g[r], i), h,
						   n * sizeof(float), cudaMemcpyHostToDevice));
			free(h);
		}
}

static void reduce_step(struct fixture *f, uint64_t step, int poison)
{
	write_grads(f, poison);
	inproc_reduce(f->c, f->g, WORLD, step, 0);
}

/* The reference: each rank's params and state per param, updated by the portable kernels. */
_Static_assert(WORLD <= INPROC_REF_RANKS && NP <= INPROC_REF_PARAMS, "the reference holds the job");

static void ref_init(struct inproc_ref *ref, struct fixture *f)
{
	memset(ref, 0, sizeof(*ref));
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = valid_numel(f->g[r], i);

			inproc_ref_alloc(ref, r, i, n);
			for (uint64_t e = 0; e < n; e++)
				ref->p[r][i][e] = rnd();
			if (n)
				CUDA_OK(cudaMemcpy(shardd_group_shard(f->g[r], i), ref->p[r][i],
						   n * sizeof(float), cudaMemcpyHostToDevice));
		}
}

/* The reference step of rank r on the sharded grads as the daemon holds them now (read from the device). */
static void ref_step(struct inproc_ref *ref, struct fixture *f, int r,
		     const struct shardd_optim_config *o, double lr, float scale)
{
	ref->nsteps[r]++;
	for (uint32_t i = 0; i < NP; i++) {
		uint64_t n = valid_numel(f->g[r], i);
		float *g;

		if (!n)
			continue;
		g = from_device(shardd_group_shard_grad(f->g[r], i), n * sizeof(float));
		inproc_ref_step(o, ref->p[r][i], g, ref->s[r][i], ref->nsteps[r], lr, scale, n);
		free(g);
	}
}

/* Rank r's shard (read from the device) equals the reference bit for bit; padding and sharded grad zero. */
static void expect_shard(struct inproc_ref *ref, struct fixture *f, int r, const char *what)
{
	for (uint32_t i = 0; i < NP; i++) {
		const struct shardd_param_layout *l = shardd_group_layout(f->g[r], i);
		uint64_t n = valid_numel(f->g[r], i), all = l->shard_bytes / sizeof(float);
		float *sh = from_device(shardd_group_shard(f->g[r], i), l->shard_bytes);
		float *g = from_device(shardd_group_shard_grad(f->g[r], i), l->shard_bytes);

		inproc_expect_shard(what, r, params[i].name, sh, ref->p[r][i], g, n, all);
		free(sh);
		free(g);
	}
}

/* Rank r's whole shard buffer, from the device. */
static float *snapshot(struct fixture *f, int r)
{
	return from_device(shardd_group_shard(f->g[r], 0), shardd_group_info(f->g[r])->shard_size);
}

static void parity_run(const struct shardd_optim_config *o, const char *what)
{
	struct fixture f;
	struct inproc_ref ref;
	float *before, *after;
	size_t size;

	start(&f, o);
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= K_STEPS; step++) {
		double lr = 0.05 / (double)step;
		/* Step 2 clips (the grad times 0.25); odd steps ask to skip on non-finite grads (finite here). */
		uint32_t flags = (step == 2 ? SHARDD_STEP_CLIP : 0) |
				 (step % 2 ? SHARDD_STEP_SKIP_NONFINITE : 0);
		float scale = step == 2 ? 0.25f : 1.0f;

		reduce_step(&f, step, 0);
		for (int r = 0; r < WORLD; r++) {
			ref_step(&ref, &f, r, o, lr, scale);
			cr_assert_eq(shardd_step(f.g[r], step, lr, flags, 0.25, 0),
				     SHARDD_STEP_APPLIED, "%s step %llu: %s", what,
				     (unsigned long long)step, shardd_last_error());
			expect_shard(&ref, &f, r, what);
		}
	}
	/* Re-submitted, with a new grad there even: nothing changes. */
	reduce_step(&f, K_STEPS + 1, 0);
	size = shardd_group_info(f.g[0])->shard_size;
	before = snapshot(&f, 0);
	cr_assert_eq(shardd_step(f.g[0], K_STEPS, 0.5, 0, 0, 0), SHARDD_STEP_ALREADY, "%s",
		     shardd_last_error());
	after = snapshot(&f, 0);
	cr_assert_eq(memcmp(before, after, size), 0,
		     "%s: a step already applied changed rank 0's shard", what);
	free(before);
	free(after);
	/* Step K+1 goes on from the daemon's state. */
	for (int r = 0; r < WORLD; r++) {
		ref_step(&ref, &f, r, o, 0.01, 1.0f);
		cr_assert_eq(shardd_step(f.g[r], K_STEPS + 1, 0.01, 0, 0, 0), SHARDD_STEP_APPLIED,
			     "%s", shardd_last_error());
		expect_shard(&ref, &f, r, what);
	}
	/* A NaN in rank 0's valid rows: rank 0 skips, rank 1 applies. */
	reduce_step(&f, K_STEPS + 2, 1);
	before = snapshot(&f, 0);
	cr_assert_eq(shardd_step(f.g[0], K_STEPS + 2, 0.01, SHARDD_STEP_SKIP_NONFINITE, 0, 0),
		     SHARDD_STEP_SKIPPED, "%s: %s", what, shardd_last_error());
	after = snapshot(&f, 0);
	cr_assert_eq(memcmp(before, after, size), 0, "%s: a skipped step changed rank 0's shard",
		     what);
	free(before);
	free(after);
	ref_step(&ref, &f, 1, o, 0.01, 1.0f);
	cr_assert_eq(shardd_step(f.g[1], K_STEPS + 2, 0.01, SHARDD_STEP_SKIP_NONFINITE, 0, 0),
		     SHARDD_STEP_APPLIED, "%s: %s", what, shardd_last_error());
	expect_shard(&ref, &f, 0, "skipped");
	expect_shard(&ref, &f, 1, "finite");
	inproc_ref_free(&ref);
	finish(&f);
}

Test(cuda_step_daemon, adamw_amsgrad_matches_the_cpu_kernels_and_applies_once, .timeout = 120)
{
	struct shardd_optim_config o = { .kind = SHARDD_OPTIM_ADAMW,
					 .flags = SHARDD_OPTIM_AMSGRAD,
					 .beta1 = 0.9,
					 .beta2 = 0.999,
					 .eps = 1e-8,
					 .weight_decay = 0.01 };

	parity_run(&o, "adamw amsgrad");
}

Test(cuda_step_daemon, sgd_momentum_matches_the_cpu_kernels_and_applies_once, .timeout = 120)
{
	struct shardd_optim_config o = {
		.kind = SHARDD_OPTIM_SGD, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01
	};

	parity_run(&o, "sgd momentum dampening weight_decay");
}

struct norm_arg {
	struct shardd_client *c;
	double type, norm;
	int nonfinite, ret;
};

static void *norm_main(void *p)
{
	struct norm_arg *a = p;

	a->ret = shardd_grad_norm(a->c, 1, a->type, &a->norm, &a->nonfinite);
	return NULL;
}

Test(cuda_step_daemon, grad_norm_matches_the_cpu_kernels_and_reduce_step_applies_once,
     .timeout = 120)
{
	struct shardd_optim_config o = { .kind = SHARDD_OPTIM_SGD };
	struct shardd_grad_norm_part acc = { 0 };
	struct shardd_completion cp;
	struct fixture f;
	struct inproc_ref ref;

	start(&f, &o);
	ref_init(&ref, &f);
	reduce_step(&f, 1, 0);
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = valid_numel(f.g[r], i);
			float *g =
				from_device(shardd_group_shard_grad(f.g[r], i), n * sizeof(float));
			struct shardd_grad_norm_part part;

			shardd_k_grad_norm_part(g, SHARDD_DTYPE_FP32, 0, n, &part);
			shardd_k_grad_norm_merge(&acc, &part);
			free(g);
		}
	for (int t = 0; t < 2; t++) {
		struct norm_arg a[WORLD];
		pthread_t th[WORLD];
		double want = t ? (double)acc.max_abs : sqrt(acc.sumsq);

		for (int r = 0; r < WORLD; r++) {
			a[r] = (struct norm_arg){ .c = f.c[r], .type = t ? INFINITY : 2.0 };
			cr_assert_eq(pthread_create(&th[r], NULL, norm_main, &a[r]), 0);
		}
		for (int r = 0; r < WORLD; r++)
			pthread_join(th[r], NULL);
		for (int r = 0; r < WORLD; r++) {
			cr_assert_eq(a[r].ret, 0, "rank %d grad_norm: %s", r, shardd_last_error());
			cr_assert_eq(a[r].nonfinite, 0);
			if (t)
				cr_assert_eq(a[r].norm, want, "inf-norm %.17g, cpu %.17g",
					     a[r].norm, want);
			else /* ~4100 exact squares summed in two orders: n * 2^-52 < 1e-12 relative */
				cr_assert(fabs(a[r].norm - want) <= 1e-12 * want,
					  "2-norm %.17g, cpu %.17g", a[r].norm, want);
		}
	}
	/* The grads of step 1 were never stepped: step 1, then step 2 by the reduce's flag. */
	for (int r = 0; r < WORLD; r++) {
		ref_step(&ref, &f, r, &o, 0.1, 1.0f);
		cr_assert_eq(shardd_step(f.g[r], 1, 0.1, 0, 0, 0), SHARDD_STEP_APPLIED, "%s",
			     shardd_last_error());
		expect_shard(&ref, &f, r, "step 1");
	}
	write_grads(&f, 0);
	for (int r = 0; r < WORLD; r++)
		cr_assert_eq(shardd_reduce_step_submit(f.g[r], 2, 0, 0.1, 200 + r), 0, "%s",
			     shardd_last_error());
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(shardd_wait(f.c[r], &cp, 30000), 0, "%s", shardd_last_error());
		cr_assert_eq(cp.res, SHARDD_STEP_APPLIED, "rank %d reduce+step 2: %d %s", r, cp.res,
			     cp.msg);
	}
	for (int r = 0; r < WORLD; r++) {
		float *before = snapshot(&f, r), *after;

		cr_assert_eq(shardd_step(f.g[r], 2, 0.1, 0, 0, 0), SHARDD_STEP_ALREADY, "%s",
			     shardd_last_error());
		after = snapshot(&f, r);
		cr_assert_eq(
			memcmp(before, after, shardd_group_info(f.g[r])->shard_size), 0,
			"rank %d: re-submitting a step applied by REDUCE_STEP changed the shard",
			r);
		free(before);
		free(after);
	}
	inproc_ref_free(&ref);
	finish(&f);
}

/* SPDX-License-Identifier: MIT */
/*
 * The daemon's optimizer (the step op) through a real shardd: SGD and AdamW
 * over K steps against the kernels' scalar path (SHARDD_K_ISA_PORTABLE) run
 * on the same sharded grads, bit for bit (every path of the kernels gives
 * the same bits, kernels/shardd_kernels.h); exactly once; clip and skip on
 * non-finite; the last applied step learned on re-attach; bad input.
 *
 * The job is 1 x 2 (one process, two clients); registration runs on two
 * threads, reduces are submitted on both rings before either is reaped.
 * Params cover the shape classes: padding rows (5 rows over 2 ranks),
 * zero elements, a vector, a 0-d scalar (rank 1 holds only padding) and
 * Shard(1).
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "inproc.h"
#include "optim_isa.h"
#include "shardd.h"

#define NP      5
#define K_STEPS 5
#define WORLD   2

static const struct shardd_param_desc params[NP] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 } },
	{ .name = "empty", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 0, 4 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 7 } },
	{ .name = "s", .dtype = SHARDD_DTYPE_FP32, .ndim = 0 },
	{ .name = "c", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shard_dim = 1, .shape = { 4, 6 } },
};

struct fixture {
	struct harness_daemon hd;
	struct shardd_client *c[WORLD];
	struct inproc_reg reg[WORLD];
};

static void start(struct fixture *f)
{
	static const char *const extra[] = { "--collective-timeout", "20", NULL };

	memset(f, 0, sizeof(*f));
	inproc_start(&f->hd, extra, "optim", 1, WORLD, SHARDD_HELLO_DEVICE_HOST, f->c);
}

/* Register `name` on both ranks with optimizers o0 (rank 0) and o1; the ranks' results in f->reg. */
static void register_both(struct fixture *f, const char *name, const struct shardd_optim_config *o0,
			  const struct shardd_optim_config *o1)
{
	for (int r = 0; r < WORLD; r++)
		f->reg[r] = (struct inproc_reg){
			.c = f->c[r],
			.name = name,
			.params = params,
			.nparams = NP,
			.opts = { .optimizer = r ? o1 : o0 },
		};
	inproc_register(f->reg, WORLD);
}

static void register_ok(struct fixture *f, const char *name, const struct shardd_optim_config *o)
{
	register_both(f, name, o, o);
	for (int r = 0; r < WORLD; r++)
		cr_assert_eq(f->reg[r].ret, 0, "rank %d register: %s", r, f->reg[r].err);
}

static void finish(struct fixture *f)
{
	for (int r = 0; r < WORLD; r++) {
		shardd_group_close(f->reg[r].g);
		shardd_close(f->c[r]);
	}
	harness_daemon_stop_expect_clean(&f->hd);
}

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static float rnd(void)
{
	return inproc_rnd(&rng_state);
}

/* Elements of real data in `g`'s shard of param i (a prefix of it). */
static uint64_t valid_numel(const struct shardd_group *g, uint32_t i)
{
	return inproc_valid_numel(g, params, i);
}

/* Random grads in every rank's grad buffers; with `poison`, rank 0's first element of param 0 NaN. */
static void write_grads(struct fixture *f, int poison)
{
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			float *gr = shardd_group_grad(f->reg[r].g, i);
			uint64_t n =
				shardd_group_layout(f->reg[r].g, i)->grad_bytes / sizeof(float);

			for (uint64_t e = 0; e < n; e++)
				gr[e] = rnd();
			if (poison && r == 0 && i == 0)
				gr[0] = NAN;
		}
}

/* Every rank writes random grads and the reduce of `step` runs on both rings. */
static void reduce_step(struct fixture *f, uint64_t step, int poison)
{
	struct shardd_group *g[WORLD];

	write_grads(f, poison);
	for (int r = 0; r < WORLD; r++)
		g[r] = f->reg[r].g;
	inproc_reduce(f->c, g, WORLD, step, 0);
}

/* The reference: each rank's params and state per param, updated by the portable kernels. */
_Static_assert(WORLD <= INPROC_REF_RANKS && NP <= INPROC_REF_PARAMS, "the reference holds the job");

static void ref_init(struct inproc_ref *ref, struct fixture *f)
{
	memset(ref, 0, sizeof(*ref));
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = valid_numel(f->reg[r].g, i);
			float *sh = shardd_group_shard(f->reg[r].g, i);

			inproc_ref_alloc(ref, r, i, n);
			for (uint64_t e = 0; e < n; e++)
				sh[e] = ref->p[r][i][e] = rnd();
		}
}

/* The reference step of rank r on the sharded grads as the daemon holds them now. */
static void ref_step(struct inproc_ref *ref, struct fixture *f, int r,
		     const struct shardd_optim_config *o, double lr, float scale)
{
	ref->nsteps[r]++;
	for (uint32_t i = 0; i < NP; i++) {
		uint64_t n = valid_numel(f->reg[r].g, i);
		const float *g = shardd_group_shard_grad(f->reg[r].g, i);

		if (!n)
			continue;
		inproc_ref_step(o, ref->p[r][i], g, ref->s[r][i], ref->nsteps[r], lr, scale, n);
	}
}

/* Rank r's shard equals the reference bit for bit; padding and the sharded grad are zero. */
static void expect_shard(struct inproc_ref *ref, struct fixture *f, int r, const char *what)
{
	for (uint32_t i = 0; i < NP; i++) {
		const struct shardd_param_layout *l = shardd_group_layout(f->reg[r].g, i);
		uint64_t n = valid_numel(f->reg[r].g, i), all = l->shard_bytes / sizeof(float);
		const float *sh = shardd_group_shard(f->reg[r].g, i);
		const float *g = shardd_group_shard_grad(f->reg[r].g, i);

		inproc_expect_shard(what, r, params[i].name, sh, ref->p[r][i], g, n, all);
	}
}

/*
 * Every rank's step `step` (lr, flags and clip_coef as shardd_step), which
 * must apply, after the reference's on the same grads (scaled by clip_coef
 * under SHARDD_STEP_CLIP); then, when `what` names the check, each rank's
 * shard against the reference.
 */
static void step_every_rank(struct inproc_ref *ref, struct fixture *f,
			    const struct shardd_optim_config *o, uint64_t step, double lr,
			    uint32_t flags, double clip_coef, const char *what)
{
	for (int r = 0; r < WORLD; r++) {
		ref_step(ref, f, r, o, lr, flags & SHARDD_STEP_CLIP ? (float)clip_coef : 1.0f);
		cr_assert_eq(shardd_step(f->reg[r].g, step, lr, flags, clip_coef, 0),
			     SHARDD_STEP_APPLIED, "%s step %llu rank %d: %s", what ? what : "",
			     (unsigned long long)step, r, shardd_last_error());
		if (what)
			expect_shard(ref, f, r, what);
	}
}

static void parity_run(const struct shardd_optim_config *o, const char *what)
{
	struct fixture f;
	struct inproc_ref ref;

	start(&f);
	register_ok(&f, "layer", o);
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= K_STEPS; step++) {
		double lr = 0.05 / (double)step;

		reduce_step(&f, step, 0);
		step_every_rank(&ref, &f, o, step, lr, 0, 0, what);
	}
	inproc_ref_free(&ref);
	finish(&f);
}

Test(optim_daemon, sgd_matches_the_kernels_reference_over_k_steps, .timeout = 60)
{
	struct shardd_optim_config o = {
		.kind = SHARDD_OPTIM_SGD, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01
	};
	struct shardd_optim_config n = { .kind = SHARDD_OPTIM_SGD,
					 .flags = SHARDD_OPTIM_NESTEROV,
					 .momentum = 0.8 };
	struct shardd_optim_config plain = { .kind = SHARDD_OPTIM_SGD,
					     .flags = SHARDD_OPTIM_MAXIMIZE };

	parity_run(&o, "sgd momentum dampening weight_decay");
	parity_run(&n, "sgd nesterov");
	parity_run(&plain, "sgd plain maximize");
}

Test(optim_daemon, adamw_matches_the_kernels_reference_over_k_steps, .timeout = 60)
{
	struct shardd_optim_config o = { .kind = SHARDD_OPTIM_ADAMW,
					 .beta1 = 0.9,
					 .beta2 = 0.999,
					 .eps = 1e-8,
					 .weight_decay = 0.01 };
	struct shardd_optim_config ams = { .kind = SHARDD_OPTIM_ADAMW,
					   .flags = SHARDD_OPTIM_AMSGRAD,
					   .beta1 = 0.8,
					   .beta2 = 0.99,
					   .eps = 1e-6 };

	parity_run(&o, "adamw");
	parity_run(&ams, "adamw amsgrad");
}

static void snapshot(struct fixture *f, int r, float *out)
{
	memcpy(out, shardd_group_shard(f->reg[r].g, 0), shardd_group_info(f->reg[r].g)->shard_size);
}

Test(optim_daemon, a_step_is_applied_once_and_reattach_learns_the_last_step, .timeout = 60)
{
	struct shardd_optim_config o = {
		.kind = SHARDD_OPTIM_ADAMW, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8
	};
	struct fixture f;
	struct inproc_ref ref;
	size_t size;
	float *before, *after;

	start(&f);
	register_ok(&f, "layer", &o);
	cr_assert_eq(shardd_group_last_step(f.reg[0].g), 0);
	size = shardd_group_info(f.reg[0].g)->shard_size;
	before = malloc(size);
	after = malloc(size);
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= 3; step++) {
		reduce_step(&f, step, 0);
		step_every_rank(&ref, &f, &o, step, 0.01, 0, 0, NULL);
	}
	/* Re-submitted, with a new grad there even: nothing changes, the grad stays. */
	reduce_step(&f, 4, 0);
	snapshot(&f, 0, before);
	cr_assert_eq(shardd_step(f.reg[0].g, 3, 0.01, 0, 0, 0), SHARDD_STEP_ALREADY, "%s",
		     shardd_last_error());
	cr_assert_eq(shardd_step(f.reg[0].g, 1, 0.5, 0, 0, 0), SHARDD_STEP_ALREADY, "%s",
		     shardd_last_error());
	snapshot(&f, 0, after);
	cr_assert_eq(memcmp(before, after, size), 0,
		     "a step already applied changed rank 0's shard");

	/* Rank 0 leaves and comes back: the daemon says step 3 was its last. */
	shardd_group_close(f.reg[0].g);
	shardd_close(f.c[0]);
	cr_assert_eq(harness_attach(&f.hd, "optim", 0, 1, WORLD, &f.c[0]), 0, "%s",
		     shardd_last_error());
	cr_assert_eq(shardd_group_open(f.c[0], "layer", &f.reg[0].g), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_group_last_step(f.reg[0].g), 3);
	cr_assert_eq(shardd_group_info(f.reg[0].g)->optimizer, SHARDD_OPTIM_ADAMW);
	cr_assert_eq(shardd_group_last_step(f.reg[1].g), 0,
		     "rank 1's reply was taken at registration");
	/* Step 4 then goes on from the daemon's state. */
	step_every_rank(&ref, &f, &o, 4, 0.01, 0, 0, "after re-attach");
	free(before);
	free(after);
	inproc_ref_free(&ref);
	finish(&f);
}

Test(optim_daemon, clip_scales_the_grad_and_nonfinite_grads_skip_the_step, .timeout = 60)
{
	struct shardd_optim_config o = { .kind = SHARDD_OPTIM_SGD, .momentum = 0.9 };
	struct fixture f;
	struct inproc_ref ref;
	size_t size;
	float *before, *after;

	start(&f);
	register_ok(&f, "layer", &o);
	size = shardd_group_info(f.reg[0].g)->shard_size;
	before = malloc(size);
	after = malloc(size);
	ref_init(&ref, &f);
	reduce_step(&f, 1, 0);
	step_every_rank(&ref, &f, &o, 1, 0.1, SHARDD_STEP_CLIP | SHARDD_STEP_SKIP_NONFINITE, 0.25,
			"clip 0.25");
	/* Rank 0's grad of 'w' is NaN, so its reduced row 0 is NaN on rank 0 only. */
	reduce_step(&f, 2, 1);
	snapshot(&f, 0, before);
	cr_assert_eq(shardd_step(f.reg[0].g, 2, 0.1, SHARDD_STEP_SKIP_NONFINITE, 0, 0),
		     SHARDD_STEP_SKIPPED, "%s", shardd_last_error());
	snapshot(&f, 0, after);
	cr_assert_eq(memcmp(before, after, size), 0, "a skipped step changed rank 0's shard");
	cr_assert_eq(shardd_step(f.reg[0].g, 2, 0.1, 0, 0, 0), SHARDD_STEP_ALREADY, "%s",
		     shardd_last_error());
	ref_step(&ref, &f, 1, &o, 0.1, 1.0f);
	cr_assert_eq(shardd_step(f.reg[1].g, 2, 0.1, SHARDD_STEP_SKIP_NONFINITE, 0, 0),
		     SHARDD_STEP_APPLIED, "%s", shardd_last_error());
	expect_shard(&ref, &f, 0, "skipped");
	expect_shard(&ref, &f, 1, "finite");
	/* The skipped step is no update: rank 0's next one is its second (momentum buffer already set). */
	reduce_step(&f, 3, 0);
	step_every_rank(&ref, &f, &o, 3, 0.1, 0, 0, "after skip");
	free(before);
	free(after);
	inproc_ref_free(&ref);
	finish(&f);
}

static void expect_err(int ret, int want, const char *text, const char *what)
{
	cr_assert_eq(ret, want, "%s: got %d (%s), expected %d: %s", what, ret, shardd_strerror(ret),
		     want, shardd_last_error());
	cr_assert_not_null(strstr(shardd_last_error(), text), "%s: '%s' does not say '%s'", what,
			   shardd_last_error(), text);
}

Test(optim_daemon, bad_steps_fail_naming_the_field_and_value, .timeout = 60)
{
	struct shardd_optim_config o = { .kind = SHARDD_OPTIM_SGD };
	struct shardd_completion cp;
	struct fixture f;

	start(&f);
	register_ok(&f, "layer", &o);
	expect_err(shardd_step(f.reg[0].g, 1, 0.1, 0, 0, 0), -SHARDD_E_STATE,
		   "sharded grad is absent", "step before any reduce");
	reduce_step(&f, 1, 0);
	expect_err(shardd_step(f.reg[0].g, 1, -0.5, 0, 0, 0), -SHARDD_E_INVALID, "lr = -0.5",
		   "negative lr");
	expect_err(shardd_step(f.reg[0].g, 1, NAN, 0, 0, 0), -SHARDD_E_INVALID, "lr = nan",
		   "NaN lr");
	expect_err(shardd_step(f.reg[0].g, 0, 0.1, 0, 0, 0), -SHARDD_E_INVALID, "step = 0",
		   "step 0");
	expect_err(shardd_step(f.reg[0].g, 1, 0.1, SHARDD_STEP_CLIP, -1, 0), -SHARDD_E_INVALID,
		   "clip coefficient = -1", "negative clip");
	expect_err(shardd_step(f.reg[0].g, 1, 0.1, 0x80, 0, 0), -SHARDD_E_INVALID,
		   "unknown bits 0x80", "bad flags");
	/* Only the deprecated shardd_submit takes a raw group id: the daemon's check of it. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
	cr_assert_eq(shardd_submit(f.c[0], SHARDD_OP_STEP, 999, 1, 0, 7), 0, "%s",
		     shardd_last_error());
#pragma GCC diagnostic pop
	cr_assert_eq(shardd_wait(f.c[0], &cp, 10000), 0, "%s", shardd_last_error());
	cr_assert_eq(cp.res, -SHARDD_E_NOGROUP, "step on group 999: %d %s", cp.res, cp.msg);
	cr_assert_not_null(strstr(cp.msg, "group id 999"), "%s", cp.msg);
	/* The valid step still applies after the refusals. */
	cr_assert_eq(shardd_step(f.reg[0].g, 1, 0.1, 0, 0, 0), SHARDD_STEP_APPLIED, "%s",
		     shardd_last_error());

	/* A group without an optimizer refuses the step. */
	for (int r = 0; r < WORLD; r++)
		shardd_group_close(f.reg[r].g);
	register_ok(&f, "plain", NULL);
	reduce_step(&f, 1, 0);
	expect_err(shardd_step(f.reg[0].g, 1, 0.1, 0, 0, 0), -SHARDD_E_STATE,
		   "without an optimizer", "no optimizer");
	finish(&f);
}

Test(optim_daemon, bad_optimizer_configs_fail_registration, .timeout = 60)
{
	struct shardd_optim_config unknown = { .kind = 7 };
	struct shardd_optim_config badbeta = { .kind = SHARDD_OPTIM_ADAMW,
					       .beta1 = 1.5,
					       .beta2 = 0.999 };
	struct shardd_optim_config nest = { .kind = SHARDD_OPTIM_SGD,
					    .flags = SHARDD_OPTIM_NESTEROV };
	struct shardd_optim_config m9 = { .kind = SHARDD_OPTIM_SGD, .momentum = 0.9 };
	struct shardd_optim_config m8 = { .kind = SHARDD_OPTIM_SGD, .momentum = 0.8 };
	struct fixture f;

	start(&f);
	register_both(&f, "a", &unknown, &unknown);
	cr_assert_eq(f.reg[0].ret, -SHARDD_E_INVALID, "%s", f.reg[0].err);
	cr_assert_not_null(strstr(f.reg[0].err, "kind = 7"), "%s", f.reg[0].err);
	register_both(&f, "b", &badbeta, &badbeta);
	cr_assert_not_null(strstr(f.reg[0].err, "beta1 = 1.5"), "%s", f.reg[0].err);
	register_both(&f, "c", &nest, &nest);
	cr_assert_not_null(strstr(f.reg[0].err, "nesterov needs momentum > 0"), "%s", f.reg[0].err);
	/* The ranks disagree: the error names the field and both values. */
	register_both(&f, "d", &m9, &m8);
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(f.reg[r].ret, -SHARDD_E_MISMATCH, "rank %d: %s", r, f.reg[r].err);
		cr_assert_not_null(strstr(f.reg[r].err, "optimizer momentum differs"), "%s",
				   f.reg[r].err);
	}
	cr_assert(strstr(f.reg[0].err, "0.90000000000000002") ||
			  strstr(f.reg[1].err, "0.90000000000000002"),
		  "%s / %s", f.reg[0].err, f.reg[1].err);
	register_both(&f, "e", &m9, NULL);
	cr_assert_eq(f.reg[0].ret, -SHARDD_E_MISMATCH, "%s", f.reg[0].err);
	cr_assert_not_null(strstr(f.reg[0].err, "optimizer kind differs"), "%s", f.reg[0].err);
	for (int r = 0; r < WORLD; r++)
		f.reg[r].g = NULL;
	finish(&f);
}

/*
 * A rank killed between its reduce and its step. A one-rank job (1 x 1)
 * trains K_KILL steps of AdamW on one param whose grads depend on the
 * params (g = sin(step + i) + 0.5 * p): a step applied twice, or lost,
 * changes every later grad and the final params. The rank stops at three
 * checkpoints per step (its reduce completed; its step submitted, not yet
 * reaped; its step completed) and waits there for the test's go byte; at a
 * checkpoint drawn at random the test kills it instead (SIGKILL) and starts
 * a replacement, which re-attaches, opens the group, learns the last step
 * applied on its shard from the daemon, clears any grad of the interrupted
 * step (zero_grad) and goes on from the next one. The final params must be
 * bit-identical to an uninterrupted run's.
 */
#define K_KILL     6
#define KILL_NUMEL 37
#define KILL_RUNS  6

static const struct shardd_param_desc kill_param = {
	.name = "w",
	.dtype = SHARDD_DTYPE_FP32,
	.ndim = 2,
	.shape = { KILL_NUMEL, 1 },
};

struct kill_rank {
	const char *socket;
	char job[32];
	int recover;   /* open the group and resume, instead of registering it */
	int to_test;   /* checkpoints and, at the end, the final params */
	int from_test; /* go bytes */
};

static int checkpoint(const struct kill_rank *k, char what)
{
	char go;

	CHILD_CHECK(harness_signal(k->to_test, what) == 0, "signal %c", what);
	CHILD_CHECK(harness_read_full(k->from_test, &go, 1, 30000) == 0, "no go byte after %c",
		    what);
	return 0;
}

static int kill_rank_main(void *p)
{
	const struct kill_rank *k = p;
	struct shardd_optim_config o = { .kind = SHARDD_OPTIM_ADAMW,
					 .beta1 = 0.9,
					 .beta2 = 0.999,
					 .eps = 1e-8,
					 .weight_decay = 0.01 };
	struct shardd_group_opts opts = { .optimizer = &o };
	struct shardd_attach_opts ao = {
		.socket_path = k->socket,
		.job = k->job,
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
		.timeout_ms = 10000,
	};
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	struct shardd_completion cp;
	uint64_t first = 1;
	float *w, *gr;
	int ret;

	ret = shardd_connect(&ao, &c);
	CHILD_CHECK(ret == 0, "attach: %s", shardd_last_error());
	if (k->recover) {
		ret = shardd_group_open(c, "layer", &g);
		CHILD_CHECK(ret == 0, "open: %s", shardd_last_error());
		first = shardd_group_last_step(g) + 1;
		/* The interrupted step's grad, if its reduce ran: recomputed below from the same params. */
		ret = shardd_zero_grad(g);
		CHILD_CHECK(ret == 0, "zero_grad: %s", shardd_last_error());
	} else {
		ret = shardd_group_register(c, "layer", &kill_param, 1, NULL, &opts, &g);
		CHILD_CHECK(ret == 0, "register: %s", shardd_last_error());
		w = shardd_group_shard(g, 0);
		for (int i = 0; i < KILL_NUMEL; i++)
			w[i] = (float)i / KILL_NUMEL - 0.5f;
	}
	w = shardd_group_shard(g, 0);
	gr = shardd_group_grad(g, 0);
	for (uint64_t s = first; s <= K_KILL; s++) {
		for (int i = 0; i < KILL_NUMEL; i++)
			gr[i] = sinf((float)(s + (uint64_t)i)) + 0.5f * w[i];
		ret = shardd_reduce(g, s, 0);
		CHILD_CHECK(ret == 0, "reduce %llu: %s", (unsigned long long)s,
			    shardd_last_error());
		if (checkpoint(k, 'R'))
			return 1;
		ret = shardd_step_submit(g, s, 1e-2, 0, 0, 0, 500 + s);
		CHILD_CHECK(ret == 0, "submit step: %s", shardd_last_error());
		if (checkpoint(k, 'S'))
			return 1;
		ret = shardd_wait(c, &cp, 30000);
		CHILD_CHECK(ret == 0 && cp.user_data == 500 + s && cp.res == SHARDD_STEP_APPLIED,
			    "step %llu: %d %s", (unsigned long long)s, cp.res, cp.msg);
		if (checkpoint(k, 'D'))
			return 1;
	}
	CHILD_CHECK(harness_signal(k->to_test, 'F') == 0, "final");
	CHILD_CHECK(write(k->to_test, w, KILL_NUMEL * sizeof(float)) ==
			    (ssize_t)(KILL_NUMEL * sizeof(float)),
		    "write params");
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

struct kill_proc {
	struct kill_rank k;
	int to_test[2], from_test[2];
	pid_t pid;
};

static void kill_proc_start(struct kill_proc *kp, const char *socket, const char *job, int recover)
{
	kp->k = (struct kill_rank){ .socket = socket, .recover = recover };
	snprintf(kp->k.job, sizeof(kp->k.job), "%s", job);
	cr_assert_eq(pipe(kp->to_test), 0);
	cr_assert_eq(pipe(kp->from_test), 0);
	kp->k.to_test = kp->to_test[1];
	kp->k.from_test = kp->from_test[0];
	kp->pid = harness_fork(kill_rank_main, &kp->k);
	cr_assert_gt(kp->pid, 0);
	close(kp->to_test[1]);
	close(kp->from_test[0]);
}

static void kill_proc_close(struct kill_proc *kp)
{
	close(kp->to_test[0]);
	close(kp->from_test[1]);
}

/*
 * Train job `job` to the end, killing the rank at checkpoint `kill_at` (-1:
 * never); the final params into `out`. Returns the checkpoint killed at
 * ("R", "S", "D") for the message.
 */
static char kill_run(struct harness_daemon *hd, const char *job, int kill_at, float *out)
{
	struct kill_proc kp;
	char what, killed = '-';
	int n = 0, status;

	kill_proc_start(&kp, hd->socket, job, 0);
	for (;;) {
		cr_assert_eq(harness_read_full(kp.to_test[0], &what, 1, 30000), 0,
			     "job %s: the rank sent nothing after checkpoint %d; daemon log:\n%s",
			     job, n, hd->log);
		if (what == 'F')
			break;
		if (n++ == kill_at) {
			killed = what;
			kill(kp.pid, SIGKILL);
			cr_assert_eq(harness_wait_or_kill(kp.pid, 30000, &status), 0);
			kill_proc_close(&kp);
			kill_proc_start(&kp, hd->socket, job, 1);
			continue;
		}
		cr_assert_eq(harness_signal(kp.from_test[1], 'g'), 0);
	}
	cr_assert_eq(harness_read_full(kp.to_test[0], out, KILL_NUMEL * sizeof(float), 30000), 0);
	cr_assert_eq(harness_wait_or_kill(kp.pid, 30000, &status), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "job %s: rank %s; daemon log:\n%s",
		  job, harness_status_str(status), hd->log);
	kill_proc_close(&kp);
	return killed;
}

Test(optim_daemon, a_rank_killed_between_reduce_and_step_resumes_bit_identical, .timeout = 120)
{
	static const char *const extra[] = { "--collective-timeout", "20", NULL };
	struct harness_daemon hd = { 0 };
	float want[KILL_NUMEL], got[KILL_NUMEL];
	char job[32];

	cr_assert_eq(harness_daemon_start(&hd, extra), 0, "shardd did not start");
	kill_run(&hd, "uninterrupted", -1, want);
	/* Checkpoints 0 .. 3 * K_KILL - 1; a fixed seed picks KILL_RUNS of them, the first and last included. */
	rng_state = 0x9e3779b97f4a7c15ull;
	for (int run = 0; run < KILL_RUNS; run++) {
		int at = run == 0   ? 0
			 : run == 1 ? 3 * K_KILL - 1
				    : (int)((rnd() * 0.5f + 0.5f) * (float)(3 * K_KILL - 1));
		char killed;

		snprintf(job, sizeof(job), "kill%d", run);
		killed = kill_run(&hd, job, at, got);
		for (int i = 0; i < KILL_NUMEL; i++)
			cr_assert_eq(
				memcmp(&got[i], &want[i], sizeof(float)), 0,
				"killed at checkpoint %d (%c of step %d): w[%d] = %.9g, uninterrupted %.9g",
				at, killed, at / 3 + 1, i, got[i], want[i]);
	}
	harness_daemon_stop_expect_clean(&hd);
}

/*
 * Grads of every rank, then the reduce with SHARDD_REDUCE_STEP on both
 * rings; the results. With `held`, each rank's sharded grad is present
 * (an earlier reduce of the step's microbatches): the reduce adds into it
 * and the step reads the total (the separate path); without, it is absent
 * and the daemon fuses the two (backend reduce_step).
 */
static void reduce_and_step(struct fixture *f, struct inproc_ref *ref,
			    const struct shardd_optim_config *o, uint64_t step, double lr, int held,
			    int *res)
{
	struct shardd_completion cps[WORLD];
	float *sum[WORLD][NP];

	write_grads(f, 0);
	/* The reference's sharded grads: fp32 sum in rank order, divided by the world (fp32 AVG). */
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			const struct shardd_param_layout *l = shardd_group_layout(f->reg[r].g, i);
			uint64_t n = valid_numel(f->reg[r].g, i), rows = l->shard_rows_valid;
			uint64_t row = rows ? n / rows : 0;
			const struct shardd_param_desc *d = &params[i];

			sum[r][i] = calloc(n + 1, sizeof(float));
			for (uint64_t e = 0; e < n && d->shard_dim == 0; e++) {
				uint64_t at = l->shard_row_begin * row + e;
				float s = 0;

				for (int q = 0; q < WORLD; q++)
					s += ((const float *)shardd_group_grad(f->reg[q].g, i))[at];
				sum[r][i][e] = s / (float)WORLD;
			}
			for (uint64_t e = 0; e < n && d->shard_dim == 1; e++) {
				/* Shard(1) of [4, 6]: rank r holds columns 3r..3r+2 of every row, row-major. */
				uint64_t at = (e / 3) * 6 + l->shard_row_begin + e % 3;
				float s = 0;

				for (int q = 0; q < WORLD; q++)
					s += ((const float *)shardd_group_grad(f->reg[q].g, i))[at];
				sum[r][i][e] = s / (float)WORLD;
			}
			/* out = out + avg: the daemon accumulates into a present grad in fp32. */
			for (uint64_t e = 0; e < n && held; e++)
				sum[r][i][e] = ((const float *)shardd_group_shard_grad(f->reg[r].g,
										       i))[e] +
					       sum[r][i][e];
		}
	for (int r = 0; r < WORLD; r++)
		cr_assert_eq(shardd_reduce_step_submit(f->reg[r].g, step, 0, lr, 200 + r), 0, "%s",
			     shardd_last_error());
	inproc_wait_each(f->c, WORLD, cps, 30000);
	for (int r = 0; r < WORLD; r++) {
		res[cps[r].user_data - 200] = cps[r].res;
		cr_assert_geq(cps[r].res, 0, "rank %d reduce+step %llu: %s",
			      (int)(cps[r].user_data - 200), (unsigned long long)step, cps[r].msg);
	}
	/* The grads are cleared by now: the reference steps on the sums computed above. */
	for (int r = 0; r < WORLD; r++) {
		ref->nsteps[r]++;
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = valid_numel(f->reg[r].g, i);

			if (n)
				inproc_ref_step(o, ref->p[r][i], sum[r][i], ref->s[r][i],
						ref->nsteps[r], lr, 1.0f, n);
			free(sum[r][i]);
		}
	}
}

Test(optim_daemon, a_reduce_with_the_step_flag_steps_each_shard_after_reducing, .timeout = 60)
{
	struct shardd_optim_config o = { .kind = SHARDD_OPTIM_SGD, .momentum = 0.9 };
	struct shardd_completion cp;
	struct fixture f;
	struct inproc_ref ref;
	int res[WORLD];

	start(&f);
	register_ok(&f, "layer", &o);
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= 3; step++) {
		reduce_and_step(&f, &ref, &o, step, 0.1, 0, res);
		for (int r = 0; r < WORLD; r++) {
			cr_assert_eq(res[r], SHARDD_STEP_APPLIED, "rank %d step %llu: res %d", r,
				     (unsigned long long)step, res[r]);
			expect_shard(&ref, &f, r, "reduce with step");
			cr_assert_eq(shardd_step(f.reg[r].g, step, 0.1, 0, 0, 0),
				     SHARDD_STEP_ALREADY, "%s", shardd_last_error());
		}
	}
	inproc_ref_free(&ref);
	for (int r = 0; r < WORLD; r++)
		shardd_group_close(f.reg[r].g);
	/* Without an optimizer the reduce is refused before it gathers. */
	register_ok(&f, "plain", NULL);
	cr_assert_eq(shardd_reduce_step_submit(f.reg[0].g, 1, 0, 0.1, 9), 0, "%s",
		     shardd_last_error());
	cr_assert_eq(shardd_wait(f.c[0], &cp, 10000), 0, "%s", shardd_last_error());
	cr_assert_eq(cp.res, -SHARDD_E_STATE, "%d %s", cp.res, cp.msg);
	cr_assert_not_null(strstr(cp.msg, "without an optimizer"), "%s", cp.msg);
	finish(&f);
}

Test(optim_daemon, a_reduce_with_the_step_flag_adds_into_a_present_grad_then_steps_the_total,
     .timeout = 60)
{
	struct shardd_optim_config o = {
		.kind = SHARDD_OPTIM_ADAMW,
		.beta1 = 0.9,
		.beta2 = 0.999,
		.eps = 1e-8,
		.weight_decay = 0.01,
	};
	struct fixture f;
	struct inproc_ref ref;
	int res[WORLD];

	start(&f);
	register_ok(&f, "layer", &o);
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= 3; step++) {
		/* Step 2 fuses (no grad held); 1 and 3 reduce a first microbatch before. */
		int held = step != 2;

		if (held)
			reduce_step(&f, step, 0);
		reduce_and_step(&f, &ref, &o, step, 1e-2, held, res);
		for (int r = 0; r < WORLD; r++) {
			cr_assert_eq(res[r], SHARDD_STEP_APPLIED, "rank %d step %llu: res %d", r,
				     (unsigned long long)step, res[r]);
			expect_shard(&ref, &f, r,
				     held ? "reduce with step onto a held grad"
					  : "fused reduce with step");
		}
	}
	inproc_ref_free(&ref);
	finish(&f);
}

/* shardctl --json dump GROUP PARAM --rank R --what WHAT: the reply's values. */
static json_t *dump_json(struct fixture *f, const char *param, const char *rank, const char *what,
			 char *out, size_t len)
{
	const char *args[] = { "--json", "dump", "layer",   param, "--rank", rank,
			       "--what", what,   "--limit", "100", NULL };
	json_error_t jerr;
	json_t *j;

	if (harness_shardctl(f->hd.socket, args, 20000, out, len))
		return NULL;
	j = json_loads(out, 0, &jerr);
	cr_assert_not_null(j, "shardctl output does not parse (%s):\n%s", jerr.text, out);
	return j;
}

Test(optim_daemon, shardctl_dumps_the_optimizer_state_of_a_shard, .timeout = 60)
{
	struct shardd_optim_config o = {
		.kind = SHARDD_OPTIM_ADAMW, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8
	};
	static const char *const names[] = { "exp_avg", "exp_avg_sq" };
	static char out[1 << 16];
	struct fixture f;
	struct inproc_ref ref;
	json_t *j;

	start(&f);
	register_ok(&f, "layer", &o);
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= 2; step++) {
		reduce_step(&f, step, 0);
		step_every_rank(&ref, &f, &o, step, 0.01, 0, 0, NULL);
	}
	/* Rank 1's shard of 'w' (5 x 3 over 2 ranks): its 2 valid rows, padding excluded. */
	for (int k = 0; k < 2; k++) {
		const json_t *vals;

		j = dump_json(&f, "w", "1", names[k], out, sizeof(out));
		cr_assert_not_null(j, "dump --what %s failed:\n%s", names[k], out);
		vals = json_object_get(j, "values");
		cr_assert_eq(json_array_size(vals), valid_numel(f.reg[1].g, 0), "%s", out);
		for (size_t e = 0; e < json_array_size(vals); e++) {
			double got = json_number_value(json_array_get(vals, e)),
			       want = ref.s[1][0][k][e];

			cr_assert(fabs(got - want) <= 1e-6 * fmax(1e-30, fabs(want)),
				  "%s[%zu] = %.9g, reference %.9g", names[k], e, got, want);
		}
		json_decref(j);
	}
	j = dump_json(&f, "w", "0", "momentum", out, sizeof(out));
	cr_assert_null(j, "an AdamW group dumped a momentum buffer:\n%s", out);
	cr_assert_not_null(strstr(out, "exp_avg, exp_avg_sq"), "%s", out);

	/* The state is counted: two shard-sized fp32 buffers per rank (AdamW), in status's memory. */
	{
		uint64_t want = WORLD * 2 * shardd_group_info(f.reg[0].g)->shard_size;

		j = harness_shardctl_json(f.hd.socket, (const char *const[]){ "status", NULL },
					  20000, out, sizeof(out));
		cr_assert_eq((uint64_t)json_integer_value(
				     json_object_get(json_object_get(j, "memory"), "optimizer")),
			     want, "%s", out);
		json_decref(j);
	}
	inproc_ref_free(&ref);
	finish(&f);
}

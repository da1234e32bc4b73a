/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's optimizer against the host backend's (the CPU
 * kernels, kernels/optim.c) through the backend table: the step of every
 * shard rank of a group whose params cover the shape classes (padding rows,
 * zero elements, a vector, a 0-d scalar held by one rank, Shard(1), one
 * large enough for many blocks), K steps of SGD (plain, momentum with
 * dampening and weight decay, nesterov with maximize), AdamW (with weight
 * decay, maximize) and AdamW amsgrad, with a learning rate and a clip
 * coefficient that change per step: param and every state buffer the same
 * bits as the host backend's after every step, and padding rows never
 * written. Skip-on-non-finite: a NaN or Inf in a valid row skips the step
 * and changes nothing, one in a padding row does not. The grad-norm part:
 * against the CPU kernel over the valid rows (sum of squares within fp64
 * rounding, the max exactly, the non-finite flag exactly). Skips without a
 * CUDA device.
 */
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "backend_cuda.h"
#include "cudapair.h"
#include "harness.h"
#include "layout.h"
#include "pool.h"
#include "shardd_kernels.h"
#include "xorshift.h"

#define WORLD   3
#define K_STEPS 5
#define NPARAMS 6
/* The daemon's default collective timeout: bounds waits on NCCL, which these single-device tests never use. */
#define TIMEOUT_NS (30ull * 1000000000ull)

static struct shd_backend_ctx *cuda_be, *host_be;
static struct shd_pool *pool;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
	return xorshift64s(&rng_state);
}

static void setup(void)
{
	cudapair_backends(SHD_CUDA_EXPORT_AUTO, TIMEOUT_NS, &cuda_be, &host_be, &pool);
	cr_assert_not_null(cuda_be->ops->step, "the cuda backend has no step");
	cr_assert_not_null(cuda_be->ops->grad_norm, "the cuda backend has no grad_norm");
}

static void teardown(void)
{
	cudapair_backends_destroy(&cuda_be, &host_be, &pool);
}

TestSuite(cuda_step, .init = setup, .fini = teardown, .timeout = 120);

/* Device bytes equal to the host backend's, or the first differing 4-byte element is named. */
static void pair_expect_same(const struct cudapair *p, const char *what)
{
	const struct shd_buf *on = &p->d;
	uint8_t *got = malloc(p->bytes);

	cr_assert_not_null(got);
	/* The backend only queued the op: wait as the engine does before an unfenced completion. */
	cr_assert_eq(cuda_be->ops->sync(cuda_be, &on, 1, NULL, 0), 0);
	CUDA_OK(cudaMemcpy(got, shd_backend_cuda_ptr(&p->d), p->bytes, cudaMemcpyDeviceToHost));
	for (uint64_t i = 0; i + 4 <= p->bytes; i += 4)
		if (memcmp(got + i, p->host + i, 4) != 0) {
			float h, c;
			uint32_t hb, cb;

			memcpy(&h, p->host + i, 4);
			memcpy(&c, got + i, 4);
			memcpy(&hb, p->host + i, 4);
			memcpy(&cb, got + i, 4);
			cr_assert_fail(
				"%s: fp32 element %llu of %llu: cpu %.9g (0x%08x), cuda %.9g (0x%08x)",
				what, (unsigned long long)(i / 4),
				(unsigned long long)(p->bytes / 4), h, hb, c, cb);
		}
	free(got);
}

/* Finite fp32 values in [-1, 1) with varied exponents. */
static float rnd(void)
{
	return ldexpf((float)((int64_t)(rng() >> 40) - (1 << 23)) * 0x1p-23f, -(int)(rng() % 4));
}

static void fill_f32(uint8_t *dst, uint64_t bytes)
{
	for (uint64_t i = 0; i + 4 <= bytes; i += 4) {
		float v = rnd();

		memcpy(dst + i, &v, 4);
	}
}

/*
 * Params for a shard group of WORLD, all fp32 (the daemon's master shards):
 * padding rows (7 rows), zero elements, a vector, a 0-d scalar (ranks 1
 * and 2 hold only padding), Shard(1), and one of 2^18 + 5 elements.
 */
static void build_layout(struct shd_layout *l)
{
	static const struct {
		const char *name;
		uint32_t ndim, shard_dim;
		uint64_t shape[3];
	} p[NPARAMS] = {
		{ "w", 2, 0, { 7, 33 } },   { "empty", 2, 0, { 0, 4 } },
		{ "b", 1, 0, { 1001 } },    { "s", 0, 0, { 0 } },
		{ "c", 3, 1, { 4, 6, 5 } }, { "big", 1, 0, { (1u << 18) + 5 } },
	};
	struct shardd_param_spec specs[NPARAMS];
	char err[256];

	memset(specs, 0, sizeof(specs));
	for (int i = 0; i < NPARAMS; i++) {
		strcpy(specs[i].name, p[i].name);
		specs[i].dtype = SHARDD_DTYPE_FP32;
		specs[i].ndim = p[i].ndim;
		specs[i].shard_dim = p[i].shard_dim;
		memcpy(specs[i].shape, p[i].shape, sizeof(p[i].shape));
	}
	cr_assert_eq(
		shd_layout_build(specs, NPARAMS, WORLD, SHARDD_DTYPE_NONE, l, err, sizeof(err)), 0,
		"%s", err);
}

static uint64_t valid_numel(const struct shd_layout_param *p, uint32_t shard_rank)
{
	return p->numel ? p->outer * shd_layout_rows_valid(p, shard_rank) * p->inner : 0;
}

/* One optimizer configuration: the args' hyperparameters (step, lr and grad_scale set per step). */
struct optim_case {
	const char *name;
	uint32_t kind;
	uint32_t nstate;
	struct shardd_sgd sgd;
	struct shardd_adamw adamw;
};

static const struct optim_case cases[] = {
	{ "sgd plain", SHARDD_OPTIM_SGD, 0, .sgd = { .momentum = 0 } },
	{ "sgd momentum dampening weight_decay", SHARDD_OPTIM_SGD, 1,
	  .sgd = { .momentum = 0.9, .dampening = 0.25, .weight_decay = 0.01 } },
	{ "sgd nesterov maximize", SHARDD_OPTIM_SGD, 1,
	  .sgd = { .momentum = 0.8, .nesterov = 1, .maximize = 1 } },
	{ "adamw weight_decay", SHARDD_OPTIM_ADAMW, 2,
	  .adamw = { .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 } },
	{ "adamw beta1 0.3 maximize", SHARDD_OPTIM_ADAMW, 2,
	  .adamw = { .beta1 = 0.3, .beta2 = 0.99, .eps = 1e-6, .maximize = 1 } },
	{ "adamw amsgrad", SHARDD_OPTIM_ADAMW, 3,
	  .adamw = { .beta1 = 0.8,
		     .beta2 = 0.99,
		     .eps = 1e-6,
		     .weight_decay = 0.1,
		     .amsgrad = 1 } },
};

/* One shard rank's buffers on both backends. */
struct rank_bufs {
	struct cudapair shard, grad, state[3];
	uint8_t *initial; /* the shard before any step */
};

static void rank_alloc(struct rank_bufs *rb, const struct shd_layout *l, uint32_t nstate)
{
	memset(rb, 0, sizeof(*rb));
	cudapair_alloc(cuda_be, host_be, &rb->shard, l->shard_size, "shard");
	cudapair_alloc(cuda_be, host_be, &rb->grad, l->shard_size, "sharded grad");
	for (uint32_t k = 0; k < nstate; k++)
		cudapair_alloc(cuda_be, host_be, &rb->state[k], l->shard_size, "optimizer state");
	fill_f32(rb->shard.host, rb->shard.bytes);
	rb->initial = malloc(rb->shard.bytes);
	cr_assert_not_null(rb->initial);
	memcpy(rb->initial, rb->shard.host, rb->shard.bytes);
	cudapair_to_device(cuda_be, &rb->shard);
}

static void rank_free(struct rank_bufs *rb)
{
	cudapair_free(cuda_be, host_be, &rb->shard);
	cudapair_free(cuda_be, host_be, &rb->grad);
	for (int k = 0; k < 3; k++)
		cudapair_free(cuda_be, host_be, &rb->state[k]);
	free(rb->initial);
}

/* Args of step k (1-based) of case c on shard rank r; host or cuda buffers. */
static struct shd_step_args step_args(const struct shd_layout *l, const struct optim_case *c,
				      uint32_t r, struct rank_bufs *rb, int cuda, uint64_t k,
				      int *skipped)
{
	struct shd_step_args a = {
		.layout = l,
		.shard_rank = r,
		.kind = c->kind,
		.shard = cuda ? &rb->shard.d : &rb->shard.h,
		.grad = cuda ? &rb->grad.d : &rb->grad.h,
		.sgd = c->sgd,
		.adamw = c->adamw,
		.skip_nonfinite = (int)(k % 2),
		.skipped = skipped,
	};
	double lr = (c->kind == SHARDD_OPTIM_SGD ? 0.05 : 0.01) / (double)k;
	float scale = k % 3 == 2 ? 0.37f : 1.0f;

	for (uint32_t s = 0; s < c->nstate; s++)
		a.state[s] = cuda ? &rb->state[s].d : &rb->state[s].h;
	a.sgd.step = a.adamw.step = k;
	a.sgd.lr = a.adamw.lr = lr;
	a.sgd.grad_scale = a.adamw.grad_scale = scale;
	return a;
}

static void expect_rank_same(const struct rank_bufs *rb, uint32_t nstate, const char *what)
{
	char w[256];

	snprintf(w, sizeof(w), "%s: param", what);
	pair_expect_same(&rb->shard, w);
	for (uint32_t s = 0; s < nstate; s++) {
		snprintf(w, sizeof(w), "%s: state %u", what, s);
		pair_expect_same(&rb->state[s], w);
	}
}

/* Padding elements of every param of rank r's shard still hold their initial bytes. */
static void expect_padding_untouched(const struct shd_layout *l, uint32_t r,
				     const struct rank_bufs *rb, const char *what)
{
	for (uint32_t i = 0; i < l->nparams; i++) {
		const struct shd_layout_param *p = &l->params[i];
		uint64_t off = p->shard_offset, n = valid_numel(p, r);

		for (uint64_t e = n; e < p->shard_numel; e++)
			cr_assert_eq(
				memcmp(rb->shard.host + off + e * 4, rb->initial + off + e * 4, 4),
				0, "%s: rank %u param %u padding element %llu was written", what, r,
				i, (unsigned long long)e);
	}
}

Test(cuda_step, sgd_adamw_and_amsgrad_match_the_host_backend_bit_for_bit_over_k_steps)
{
	struct shd_layout l;

	build_layout(&l);
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		const struct optim_case *c = &cases[ci];

		for (uint32_t r = 0; r < WORLD; r++) {
			struct rank_bufs rb;
			char what[160];

			rank_alloc(&rb, &l, c->nstate);
			for (uint64_t k = 1; k <= K_STEPS; k++) {
				int hs = -1, ds = -1;
				struct shd_step_args ha = step_args(&l, c, r, &rb, 0, k, &hs);
				struct shd_step_args da = step_args(&l, c, r, &rb, 1, k, &ds);
				char err[256] = "";

				da.err = err;
				da.errlen = sizeof(err);
				fill_f32(rb.grad.host, rb.grad.bytes);
				cudapair_to_device(cuda_be, &rb.grad);
				cr_assert_eq(host_be->ops->step(host_be, &ha), 0);
				cr_assert_eq(cuda_be->ops->step(cuda_be, &da), 0,
					     "%s rank %u step %llu: %s", c->name, r,
					     (unsigned long long)k, err);
				cr_assert_eq(hs, 0);
				cr_assert_eq(ds, 0, "%s rank %u step %llu: skipped on finite grads",
					     c->name, r, (unsigned long long)k);
				snprintf(what, sizeof(what), "%s, rank %u, step %llu", c->name, r,
					 (unsigned long long)k);
				expect_rank_same(&rb, c->nstate, what);
			}
			expect_padding_untouched(&l, r, &rb, c->name);
			rank_free(&rb);
		}
	}
	shd_layout_free(&l);
}

/* Rank r's step k of case c with skip-on-non-finite; both backends' `skipped` must be `want`. */
static void skip_case(const struct shd_layout *l, const struct optim_case *c, uint32_t r,
		      struct rank_bufs *rb, uint64_t k, int want, const char *what)
{
	int hs = -1, ds = -1;
	struct shd_step_args ha = step_args(l, c, r, rb, 0, k, &hs);
	struct shd_step_args da = step_args(l, c, r, rb, 1, k, &ds);
	char err[256] = "";

	ha.skip_nonfinite = da.skip_nonfinite = 1;
	da.err = err;
	da.errlen = sizeof(err);
	cudapair_to_device(cuda_be, &rb->grad);
	cr_assert_eq(host_be->ops->step(host_be, &ha), 0);
	cr_assert_eq(cuda_be->ops->step(cuda_be, &da), 0, "%s: %s", what, err);
	cr_assert_eq(hs, want, "%s: host backend skipped = %d", what, hs);
	cr_assert_eq(ds, want, "%s: cuda backend skipped = %d, want %d", what, ds, want);
	expect_rank_same(rb, c->nstate, what);
}

/* The fp32 element e of param i in a buffer's host copy. */
static void put(struct cudapair *p, const struct shd_layout *l, uint32_t i, uint64_t e, float v)
{
	memcpy(p->host + l->params[i].shard_offset + e * 4, &v, 4);
}

Test(cuda_step, a_nonfinite_valid_grad_skips_the_step_and_padding_is_not_looked_at)
{
	const struct optim_case *c = &cases[5]; /* amsgrad: every state buffer */
	struct shd_layout l;
	struct rank_bufs rb;
	uint8_t *before;

	build_layout(&l);
	/* Rank 2: 'w' has 1 valid row of 3, 's' only padding. */
	rank_alloc(&rb, &l, c->nstate);
	before = malloc(rb.shard.bytes);
	cr_assert_not_null(before);
	fill_f32(rb.grad.host, rb.grad.bytes);
	skip_case(&l, c, 2, &rb, 1, 0, "finite grads");

	memcpy(before, rb.shard.host, rb.shard.bytes);
	fill_f32(rb.grad.host, rb.grad.bytes);
	put(&rb.grad, &l, 2, 5, NAN);
	skip_case(&l, c, 2, &rb, 2, 1, "NaN in 'b'");
	cr_assert_eq(memcmp(before, rb.shard.host, rb.shard.bytes), 0,
		     "the host backend changed a skipped shard");

	fill_f32(rb.grad.host, rb.grad.bytes);
	put(&rb.grad, &l, 5, valid_numel(&l.params[5], 2) - 1, -INFINITY);
	skip_case(&l, c, 2, &rb, 2, 1, "-Inf in the last valid element of 'big'");

	/* Padding: rows 1 and 2 of 'w' (elements 33..98) and the scalar's one element. */
	fill_f32(rb.grad.host, rb.grad.bytes);
	put(&rb.grad, &l, 0, 40, NAN);
	put(&rb.grad, &l, 0, 98, INFINITY);
	put(&rb.grad, &l, 3, 0, NAN);
	skip_case(&l, c, 2, &rb, 2, 0, "NaN and Inf in padding rows only");
	expect_padding_untouched(&l, 2, &rb, "skip");
	free(before);
	rank_free(&rb);
	shd_layout_free(&l);
}

/* The CPU kernel's part of the valid rows of rank r's grad in `host` (the reference). */
static void norm_ref(const struct shd_layout *l, uint32_t r, const uint8_t *host,
		     struct shardd_grad_norm_part *out, uint64_t *n_total)
{
	*out = (struct shardd_grad_norm_part){ 0 };
	*n_total = 0;
	for (uint32_t i = 0; i < l->nparams; i++) {
		struct shardd_grad_norm_part part;
		uint64_t n = valid_numel(&l->params[i], r);

		shardd_k_grad_norm_part(host + l->params[i].shard_offset, SHARDD_DTYPE_FP32, 0, n,
					&part);
		shardd_k_grad_norm_merge(out, &part);
		*n_total += n;
	}
}

static void norm_expect(const struct shd_layout *l, uint32_t r, struct cudapair *g,
			const char *what)
{
	struct shardd_grad_norm_part want, got = { .sumsq = -1 };
	uint64_t n;
	char err[256] = "";

	cudapair_to_device(cuda_be, g);
	norm_ref(l, r, g->host, &want, &n);
	cr_assert_eq(cuda_be->ops->grad_norm(cuda_be, l, r, &g->d, &got, err, sizeof(err)), 0,
		     "%s: %s", what, err);
	cr_assert_eq(got.nonfinite, want.nonfinite, "%s: nonfinite %d, cpu %d", what, got.nonfinite,
		     want.nonfinite);
	if (want.nonfinite) {
		cr_assert(!isfinite(got.sumsq), "%s: sumsq %.17g is finite", what, got.sumsq);
	} else {
		/* Exact squares summed in two orders: within n fp64 roundings of each other. */
		cr_assert(fabs(got.sumsq - want.sumsq) <= (double)n * 0x1p-52 * want.sumsq,
			  "%s: sumsq %.17g, cpu %.17g (%llu elements)", what, got.sumsq, want.sumsq,
			  (unsigned long long)n);
	}
	cr_assert(got.max_abs == want.max_abs, "%s: max_abs %.9g, cpu %.9g", what, got.max_abs,
		  want.max_abs);
}

Test(cuda_step, grad_norm_part_matches_the_cpu_kernel_over_valid_rows)
{
	struct shd_layout l;
	struct cudapair g;
	char what[96];

	build_layout(&l);
	cudapair_alloc(cuda_be, host_be, &g, l.shard_size, "sharded grad");
	for (uint32_t r = 0; r < WORLD; r++) {
		fill_f32(g.host, g.bytes);
		/* Padding rows hold values far above any valid one: counted, they would show in sum and max. */
		for (uint32_t i = 0; i < l.nparams; i++)
			for (uint64_t e = valid_numel(&l.params[i], r); e < l.params[i].shard_numel;
			     e++)
				put(&g, &l, i, e, 1e30f);
		snprintf(what, sizeof(what), "rank %u finite", r);
		norm_expect(&l, r, &g, what);

		put(&g, &l, 2, 3, NAN);
		snprintf(what, sizeof(what), "rank %u NaN", r);
		norm_expect(&l, r, &g, what);

		put(&g, &l, 5, 7, -INFINITY);
		snprintf(what, sizeof(what), "rank %u NaN and -Inf", r);
		norm_expect(&l, r, &g, what);
	}
	cudapair_free(cuda_be, host_be, &g);
	shd_layout_free(&l);
}

Test(cuda_step, grad_norm_of_a_rank_holding_only_padding_is_zero)
{
	struct shardd_param_spec spec = { .name = "s", .dtype = SHARDD_DTYPE_FP32, .ndim = 0 };
	struct shardd_grad_norm_part got = { .sumsq = -1, .max_abs = -1, .nonfinite = -1 };
	struct shd_layout l;
	struct cudapair g;
	char err[256] = "";

	cr_assert_eq(shd_layout_build(&spec, 1, WORLD, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0,
		     "%s", err);
	cudapair_alloc(cuda_be, host_be, &g, l.shard_size, "sharded grad");
	for (uint64_t i = 0; i < g.bytes / 4; i++)
		put(&g, &l, 0, i, NAN);
	cudapair_to_device(cuda_be, &g);
	cr_assert_eq(cuda_be->ops->grad_norm(cuda_be, &l, 1, &g.d, &got, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert(got.sumsq == 0.0 && got.max_abs == 0.0f && got.nonfinite == 0,
		  "rank 1 of a 0-d param: sumsq %g max_abs %g nonfinite %d", got.sumsq, got.max_abs,
		  got.nonfinite);
	cudapair_free(cuda_be, host_be, &g);
	shd_layout_free(&l);
}

/* SPDX-License-Identifier: MIT */
/*
 * daemon/backend/backend_host.c through the backend table, for what a collective
 * call says about its members: an unshard writes every distinct output
 * its ranks name (one shared buffer, or a buffer per rank), and a reduce
 * gives member k shard k's rows, with member k's own accumulate flag and
 * addend. Expected values are small integers worked out in the comments.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "pool.h"

static struct shd_pool *pool;
static struct shd_backend_ctx *be;
static struct shd_layout layout;

/* One fp32 param of 4 rows over 2 shards: shard s holds rows 2s, 2s + 1. */
static void setup(void)
{
	struct shardd_param_spec s;
	char err[256] = "";

	memset(&s, 0, sizeof(s));
	strcpy(s.name, "w");
	s.dtype = SHARDD_DTYPE_FP32;
	s.ndim = 1;
	s.shape[0] = 4;
	cr_assert_eq(shd_layout_build(&s, 1, 2, SHARDD_DTYPE_NONE, &layout, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(shd_pool_create(1, &pool), 0);
	cr_assert_eq(shd_backend_host_create(pool, &be), 0);
}

static void teardown(void)
{
	be->ops->destroy(be);
	shd_pool_destroy(pool);
	shd_layout_free(&layout);
}

TestSuite(backend_host, .init = setup, .fini = teardown, .timeout = 10);

static float *f32(struct shd_buf *b, uint64_t offset)
{
	/* A host buffer's priv is its mapping in the daemon (backend_host.c). */
	return (float *)((uint8_t *)b->priv + offset);
}

static void alloc(struct shd_buf *b, uint64_t bytes)
{
	cr_assert_eq(be->ops->alloc(be, bytes, SHARDD_HELLO_DEVICE_HOST, "test", b), 0);
}

Test(backend_host, unshard_writes_each_distinct_output_once_and_all_of_them)
{
	const struct shd_layout_param *p = &layout.params[0];
	struct shd_buf shards[2], mine, theirs;
	struct shd_buf *sp[2] = { &shards[0], &shards[1] };
	struct shd_buf *shared[2] = { &mine, &mine }, *own[2] = { &mine, &theirs };
	struct shd_unshard_args a = { .layout = &layout, .nshards = 2, .shards = sp };

	for (int s = 0; s < 2; s++) {
		alloc(&shards[s], layout.shard_size);
		f32(&shards[s], p->shard_offset)[0] = (float)(10 * s + 1);
		f32(&shards[s], p->shard_offset)[1] = (float)(10 * s + 2);
	}
	alloc(&mine, layout.unsharded_size);
	alloc(&theirs, layout.unsharded_size);

	/* Shared by both ranks: [1, 2, 11, 12]. */
	a.unsharded = shared;
	cr_assert_eq(be->ops->unshard(be, &a), 0);
	for (int i = 0; i < 4; i++)
		cr_assert_eq(f32(&mine, p->unsharded_offset)[i], (float)(10 * (i / 2) + i % 2 + 1));
	cr_assert_eq(f32(&theirs, p->unsharded_offset)[0], 0.0f,
		     "a buffer no rank names stays untouched");

	/* A buffer per rank: both get the whole gathered param. */
	memset(f32(&mine, p->unsharded_offset), 0, 4 * sizeof(float));
	a.unsharded = own;
	cr_assert_eq(be->ops->unshard(be, &a), 0);
	for (int i = 0; i < 4; i++) {
		cr_assert_eq(f32(&mine, p->unsharded_offset)[i], (float)(10 * (i / 2) + i % 2 + 1));
		cr_assert_eq(f32(&theirs, p->unsharded_offset)[i],
			     (float)(10 * (i / 2) + i % 2 + 1));
	}
	for (int s = 0; s < 2; s++)
		be->ops->free(be, &shards[s]);
	be->ops->free(be, &mine);
	be->ops->free(be, &theirs);
}

Test(backend_host, reduce_gives_member_k_shard_k_with_its_own_accumulate_and_addend)
{
	const struct shd_layout_param *p = &layout.params[0];
	struct shd_buf grads[2], outs[2], add;
	struct shd_buf *gp[2] = { &grads[0], &grads[1] };
	uint64_t off[1] = { p->shard_offset };
	struct shd_shard_view ov[2] = { { &outs[0], off, SHARDD_DTYPE_NONE },
					{ &outs[1], off, SHARDD_DTYPE_NONE } };
	struct shd_shard_view av[2] = { { NULL, NULL, SHARDD_DTYPE_NONE },
					{ &add, off, SHARDD_DTYPE_FP32 } };
	uint8_t accumulate[2] = { 0, 1 };
	struct shd_reduce_args a = {
		.layout = &layout,
		.src = SHD_REDUCE_SRC_GRAD,
		.n = 2,
		.grads = gp,
		.outs = ov,
		.adds = av,
		.accumulate = accumulate,
		.math = { .reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = 2, .post = 1 },
	};

	for (int r = 0; r < 2; r++) {
		alloc(&grads[r], layout.grad_size);
		alloc(&outs[r], layout.shard_size);
		/* Rank r's grad: (r + 1) * [2, 4, 6, 8]. */
		for (int i = 0; i < 4; i++)
			f32(&grads[r], p->grad_offset)[i] = (float)((r + 1) * 2 * (i + 1));
		f32(&outs[r], p->shard_offset)[0] = 100;
		f32(&outs[r], p->shard_offset)[1] = 100;
	}
	alloc(&add, layout.shard_size);
	f32(&add, p->shard_offset)[0] = 1000;
	f32(&add, p->shard_offset)[1] = 2000;

	cr_assert_eq(be->ops->reduce(be, &a), 0);
	/* The average is 3 * [1, 2, 3, 4] = [3, 6, 9, 12]. Member 0 assigns shard 0: [3, 6]. */
	cr_assert_eq(f32(&outs[0], p->shard_offset)[0], 3.0f);
	cr_assert_eq(f32(&outs[0], p->shard_offset)[1], 6.0f);
	/* Member 1 accumulates shard 1 plus its addend: 100 + (9 + 1000), 100 + (12 + 2000). */
	cr_assert_eq(f32(&outs[1], p->shard_offset)[0], 1109.0f);
	cr_assert_eq(f32(&outs[1], p->shard_offset)[1], 2112.0f);
	for (int r = 0; r < 2; r++) {
		be->ops->free(be, &grads[r]);
		be->ops->free(be, &outs[r]);
	}
	be->ops->free(be, &add);
}

/*
 * reduce_step against reduce then step: the same grads reduced and stepped
 * both ways from the same params and state must leave the same bytes, for
 * every optimizer variant (SGD without and with momentum, dampening,
 * nesterov, maximize; AdamW plain and with amsgrad and maximize), every
 * grad dtype and reduce dtype pair the daemon runs (fp16 with its pre- and
 * post-divide), 2 and 3 ranks (3: a dim-0 param with padding rows, and
 * shards with no rows), over two steps (SGD's first step sets the buffer,
 * the second reads it). The params: dim 0 with padding, Shard(1) of 3 rows,
 * and one large enough (300 000 elements) for many chunks, pieces and the
 * pool's threads.
 */
static struct shd_pool *fuse_pool;
static struct shd_backend_ctx *fuse_be;

static void fuse_setup(void)
{
	cr_assert_eq(shd_pool_create(2, &fuse_pool), 0);
	cr_assert_eq(shd_backend_host_create(fuse_pool, &fuse_be), 0);
}

static void fuse_teardown(void)
{
	fuse_be->ops->destroy(fuse_be);
	shd_pool_destroy(fuse_pool);
}

TestSuite(backend_host_fuse, .init = fuse_setup, .fini = fuse_teardown, .timeout = 60);

#define FUSE_MAX_RANKS 3

/* A deterministic value in [-1, 1) for element i of stream `seed`. */
static float fuse_value(uint64_t i, uint32_t seed)
{
	uint64_t h = (i + 1) * 0x9e3779b97f4a7c15ull ^ ((uint64_t)seed << 32);

	h ^= h >> 29;
	h *= 0xbf58476d1ce4e5b9ull;
	h ^= h >> 32;
	return (float)((int64_t)(h >> 40) - (1 << 23)) * 0x1p-23f;
}

/* Fill `n` fp32 elements with seeded values scaled by `scale`, |x| if `positive`. */
static void fuse_fill(float *dst, uint64_t n, uint32_t seed, float scale, int positive)
{
	for (uint64_t i = 0; i < n; i++) {
		float x = scale * fuse_value(i, seed);

		dst[i] = positive && x < 0 ? -x : x;
	}
}

static void fuse_alloc(struct shd_buf *b, uint64_t bytes)
{
	cr_assert_eq(fuse_be->ops->alloc(fuse_be, bytes, SHARDD_HELLO_DEVICE_HOST, "test", b), 0);
}

/* One rank's side of one path: its flat shard, sharded grad and optimizer states. */
struct fuse_side {
	struct shd_buf shard, grad, state[3];
};

static void fuse_side_alloc(struct fuse_side *s, const struct shd_layout *l, uint32_t nstates)
{
	/* The states it leaves out stay unallocated, which free takes as a no-op. */
	for (int k = 0; k < 3; k++)
		s->state[k] = (struct shd_buf){ .fd = -1 };
	fuse_alloc(&s->shard, l->shard_size);
	fuse_alloc(&s->grad, l->shard_size);
	for (uint32_t k = 0; k < nstates; k++)
		fuse_alloc(&s->state[k], l->shard_size);
}

static void fuse_side_free(struct fuse_side *s)
{
	fuse_be->ops->free(fuse_be, &s->shard);
	fuse_be->ops->free(fuse_be, &s->grad);
	for (int k = 0; k < 3; k++)
		fuse_be->ops->free(fuse_be, &s->state[k]);
}

struct fuse_optim {
	const char *name;
	uint32_t kind;
	struct shardd_sgd sgd;
	struct shardd_adamw adamw;
	uint32_t nstates;
};

static void fuse_step_args(const struct fuse_optim *o, const struct shd_layout *l, uint32_t rank,
			   struct fuse_side *s, uint64_t step, int *skipped,
			   struct shd_step_args *a)
{
	*a = (struct shd_step_args){
		.layout = l,
		.shard_rank = rank,
		.kind = o->kind,
		.shard = &s->shard,
		.grad = &s->grad,
		.sgd = o->sgd,
		.adamw = o->adamw,
		.skipped = skipped,
	};
	for (uint32_t k = 0; k < o->nstates; k++)
		a->state[k] = &s->state[k];
	a->sgd.step = a->adamw.step = step;
}

/* Both paths for `ranks` ranks, grads in grad_dtype reduced in reduce_dtype; bytes compared. */
static void fuse_compare(const struct fuse_optim *o, uint32_t ranks, uint32_t grad_dtype,
			 uint32_t reduce_dtype)
{
	struct shardd_param_spec specs[4];
	struct shd_layout l;
	struct shd_buf grads[FUSE_MAX_RANKS];
	struct shd_buf *gp[FUSE_MAX_RANKS];
	struct fuse_side sep[FUSE_MAX_RANKS], fused[FUSE_MAX_RANKS];
	struct shd_shard_view outs[FUSE_MAX_RANKS];
	struct shd_step_args steps[FUSE_MAX_RANKS];
	uint8_t assign[FUSE_MAX_RANKS] = { 0 };
	int skipped[FUSE_MAX_RANKS];
	char err[256] = "", what[160];
	double pre, post;
	struct shardd_reduce_math m = {
		.reduce_dtype = reduce_dtype, .pre = 1, .avg = 1, .post = 1
	};

	/* An early return, not only an assertion: the compiler then knows the arrays suffice. */
	if (ranks > FUSE_MAX_RANKS) {
		cr_assert_fail("%u ranks, at most %d", ranks, FUSE_MAX_RANKS);
		return;
	}
	memset(specs, 0, sizeof(specs));
	strcpy(specs[0].name, "padded");
	specs[0].ndim = 1;
	specs[0].shape[0] = 10;
	strcpy(specs[1].name, "columns");
	specs[1].ndim = 2;
	specs[1].shape[0] = 3;
	specs[1].shape[1] = 4104;
	specs[1].shard_dim = 1;
	strcpy(specs[2].name, "large");
	specs[2].ndim = 1;
	specs[2].shape[0] = 300000;
	strcpy(specs[3].name, "tiny");
	specs[3].ndim = 1;
	specs[3].shape[0] = 2;
	for (int i = 0; i < 4; i++)
		specs[i].dtype = SHARDD_DTYPE_FP32;
	cr_assert_eq(shd_layout_build(specs, 4, ranks, grad_dtype, &l, err, sizeof(err)), 0, "%s",
		     err);
	snprintf(what, sizeof(what), "%s, %u ranks, grads %s reduced in %s", o->name, ranks,
		 shardd_dtype_name(grad_dtype), shardd_dtype_name(reduce_dtype));
	shardd_divide_factors(ranks, reduce_dtype, &pre, &post);
	if (pre == 0) {
		m.avg = (float)ranks;
	} else {
		m.pre = (float)pre;
		m.post = (float)post;
	}
	for (uint32_t r = 0; r < ranks; r++) {
		fuse_alloc(&grads[r], l.grad_size);
		gp[r] = &grads[r];
		fuse_side_alloc(&sep[r], &l, o->nstates);
		fuse_side_alloc(&fused[r], &l, o->nstates);
		/* The same params and states on both sides; exp_avg_sq (and its max) >= 0. */
		for (struct fuse_side *s = &sep[r]; s; s = s == &sep[r] ? &fused[r] : NULL) {
			fuse_fill(f32(&s->shard, 0), l.shard_size / 4, 10 + r, 1.0f, 0);
			for (uint32_t k = 0; k < o->nstates; k++)
				fuse_fill(f32(&s->state[k], 0), l.shard_size / 4, 20 + r,
					  k ? 1e-3f * (float)k : 0.1f,
					  o->kind == SHARDD_OPTIM_ADAMW && k);
		}
	}
	for (uint64_t step = 1; step <= 2; step++) {
		for (uint32_t r = 0; r < ranks; r++) {
			uint64_t n = l.grad_size / shardd_dtype_size(grad_dtype);
			float *tmp = malloc(n * sizeof(float));

			cr_assert_not_null(tmp);
			fuse_fill(tmp, n, (uint32_t)(100 * step + r), 0.5f, 0);
			shardd_k_cast(f32(&grads[r], 0), grad_dtype, tmp, SHARDD_DTYPE_FP32, n);
			free(tmp);
		}
		/* The separate ops, as the engine runs them: reduce (assigning), step, grad cleared. */
		for (uint32_t r = 0; r < ranks; r++)
			outs[r] = (struct shd_shard_view){ &sep[r].grad, NULL, SHARDD_DTYPE_NONE };
		{
			uint64_t offs[4] = { l.params[0].shard_offset, l.params[1].shard_offset,
					     l.params[2].shard_offset, l.params[3].shard_offset };
			struct shd_reduce_args a = {
				.layout = &l,
				.src = SHD_REDUCE_SRC_GRAD,
				.n = ranks,
				.grads = gp,
				.outs = outs,
				.accumulate = assign,
				.math = m,
			};

			for (uint32_t r = 0; r < ranks; r++)
				outs[r].offsets = offs;
			cr_assert_eq(fuse_be->ops->reduce(fuse_be, &a), 0, "%s", what);
			for (uint32_t r = 0; r < ranks; r++) {
				fuse_step_args(o, &l, r, &sep[r], step, &skipped[r], &steps[r]);
				cr_assert_eq(fuse_be->ops->step(fuse_be, &steps[r]), 0, "%s", what);
				cr_assert_eq(fuse_be->ops->zero(fuse_be, &sep[r].grad, 0,
								sep[r].grad.bytes),
					     0);
			}
			for (uint32_t r = 0; r < ranks; r++) {
				outs[r].buf = &fused[r].grad;
				fuse_step_args(o, &l, r, &fused[r], step, &skipped[r], &steps[r]);
				skipped[r] = -1;
			}
			cr_assert_eq(fuse_be->ops->reduce_step(fuse_be, &a, steps), 0, "%s", what);
		}
		for (uint32_t r = 0; r < ranks; r++) {
			cr_assert_eq(skipped[r], 0, "%s: rank %u's step reported skipped", what, r);
			cr_assert_eq(memcmp(f32(&sep[r].shard, 0), f32(&fused[r].shard, 0),
					    l.shard_size),
				     0, "%s, step %llu: rank %u's params differ", what,
				     (unsigned long long)step, r);
			for (uint32_t k = 0; k < o->nstates; k++)
				cr_assert_eq(memcmp(f32(&sep[r].state[k], 0),
						    f32(&fused[r].state[k], 0), l.shard_size),
					     0, "%s, step %llu: rank %u's state %u differs", what,
					     (unsigned long long)step, r, k);
			/* Both sharded grads are zero: cleared by the step, never written by the fused op. */
			cr_assert_eq(
				memcmp(f32(&sep[r].grad, 0), f32(&fused[r].grad, 0), l.shard_size),
				0, "%s, step %llu: rank %u's sharded grads differ", what,
				(unsigned long long)step, r);
		}
	}
	/* The update happened: a step that changed nothing would pass the comparison above. */
	cr_assert_neq(f32(&fused[0].shard, 0)[l.params[2].shard_offset / 4 + 7],
		      fuse_value(l.params[2].shard_offset / 4 + 7, 10), "%s", what);
	for (uint32_t r = 0; r < ranks; r++) {
		fuse_be->ops->free(fuse_be, &grads[r]);
		fuse_side_free(&sep[r]);
		fuse_side_free(&fused[r]);
	}
	shd_layout_free(&l);
}

/* Every (grad dtype, reduce dtype) pair of FSDP2's policies the daemon reduces, on 2 and 3 ranks. */
static void fuse_compare_all(const struct fuse_optim *o)
{
	static const uint32_t pairs[][2] = {
		{ SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32 }, { SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP32 },
		{ SHARDD_DTYPE_BF16, SHARDD_DTYPE_BF16 }, { SHARDD_DTYPE_FP16, SHARDD_DTYPE_FP32 },
		{ SHARDD_DTYPE_FP16, SHARDD_DTYPE_FP16 },
	};

	for (uint32_t ranks = 2; ranks <= FUSE_MAX_RANKS; ranks++)
		for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++)
			fuse_compare(o, ranks, pairs[i][0], pairs[i][1]);
}

Test(backend_host_fuse, reduce_step_equals_reduce_then_step_for_sgd_bit_for_bit)
{
	const struct fuse_optim opts[] = {
		{ "sgd", SHARDD_OPTIM_SGD, .sgd = { .lr = 0.1, .grad_scale = 1 }, .nstates = 0 },
		{ "sgd momentum dampening wd", SHARDD_OPTIM_SGD,
		  .sgd = { .lr = 0.05,
			   .momentum = 0.9,
			   .dampening = 0.1,
			   .weight_decay = 1e-2,
			   .grad_scale = 1 },
		  .nstates = 1 },
		{ "sgd nesterov maximize", SHARDD_OPTIM_SGD,
		  .sgd = { .lr = 0.05,
			   .momentum = 0.8,
			   .nesterov = 1,
			   .maximize = 1,
			   .grad_scale = 1 },
		  .nstates = 1 },
	};

	for (size_t i = 0; i < sizeof(opts) / sizeof(opts[0]); i++)
		fuse_compare_all(&opts[i]);
}

Test(backend_host_fuse, reduce_step_equals_reduce_then_step_for_adamw_bit_for_bit)
{
	const struct fuse_optim opts[] = {
		{ "adamw", SHARDD_OPTIM_ADAMW,
		  .adamw = { .lr = 1e-3,
			     .beta1 = 0.9,
			     .beta2 = 0.999,
			     .eps = 1e-8,
			     .weight_decay = 0.01,
			     .grad_scale = 1 },
		  .nstates = 2 },
		{ "adamw amsgrad maximize", SHARDD_OPTIM_ADAMW,
		  .adamw = { .lr = 2e-3,
			     .beta1 = 0.3,
			     .beta2 = 0.99,
			     .eps = 1e-6,
			     .amsgrad = 1,
			     .maximize = 1,
			     .grad_scale = 1 },
		  .nstates = 3 },
	};

	for (size_t i = 0; i < sizeof(opts) / sizeof(opts[0]); i++)
		fuse_compare_all(&opts[i]);
}

Test(backend_host_fuse, reduce_step_refuses_what_it_cannot_fuse_before_writing)
{
	struct shardd_param_spec spec;
	struct shd_layout l;
	struct shd_buf grads[2];
	struct shd_buf *gp[2] = { &grads[0], &grads[1] };
	struct fuse_side side[2];
	struct shd_shard_view outs[2];
	struct shd_step_args steps[2];
	uint8_t assign[2] = { 0 }, accumulate[2] = { 0, 1 };
	int skipped[2];
	char err[256] = "";
	const struct fuse_optim o = { "sgd", SHARDD_OPTIM_SGD,
				      .sgd = { .lr = 0.1, .grad_scale = 1 } };
	struct shd_reduce_args a = {
		.layout = &l,
		.src = SHD_REDUCE_SRC_GRAD,
		.n = 2,
		.grads = gp,
		.outs = outs,
		.accumulate = assign,
		.math = { .reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = 2, .post = 1 },
	};

	memset(&spec, 0, sizeof(spec));
	strcpy(spec.name, "w");
	spec.dtype = SHARDD_DTYPE_FP32;
	spec.ndim = 1;
	spec.shape[0] = 8;
	cr_assert_eq(shd_layout_build(&spec, 1, 2, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0,
		     "%s", err);
	for (int r = 0; r < 2; r++) {
		fuse_alloc(&grads[r], l.grad_size);
		fuse_fill(f32(&grads[r], 0), 8, 3 + (uint32_t)r, 1.0f, 0);
		fuse_side_alloc(&side[r], &l, 0);
		fuse_fill(f32(&side[r].shard, 0), l.shard_size / 4, 7, 1.0f, 0);
		outs[r] = (struct shd_shard_view){ &side[r].grad, &l.params[0].shard_offset,
						   SHARDD_DTYPE_NONE };
		fuse_step_args(&o, &l, (uint32_t)r, &side[r], 1, &skipped[r], &steps[r]);
	}
	/* A grad to add into, a skip that needs the whole grad first, a non-fp32 output. */
	a.accumulate = accumulate;
	cr_assert_eq(fuse_be->ops->reduce_step(fuse_be, &a, steps), -EINVAL);
	a.accumulate = assign;
	steps[1].skip_nonfinite = 1;
	cr_assert_eq(fuse_be->ops->reduce_step(fuse_be, &a, steps), -EINVAL);
	steps[1].skip_nonfinite = 0;
	outs[1].dtype = SHARDD_DTYPE_BF16;
	cr_assert_eq(fuse_be->ops->reduce_step(fuse_be, &a, steps), -EINVAL);
	for (int r = 0; r < 2; r++)
		for (uint32_t i = 0; i < l.shard_size / 4; i++)
			cr_assert_eq(f32(&side[r].shard, 0)[i], fuse_value(i, 7),
				     "rank %d's param %u changed by a refused call", r, i);
	for (int r = 0; r < 2; r++) {
		fuse_be->ops->free(fuse_be, &grads[r]);
		fuse_side_free(&side[r]);
	}
	shd_layout_free(&l);
}

/* SPDX-License-Identifier: MIT */
/*
 * daemon/backend/backend_host.c through the backend table, for what a collective
 * call says about its members: an unshard writes every distinct output
 * its ranks name (one shared buffer, or a buffer per rank), and a reduce
 * gives member k shard k's rows, with member k's own accumulate flag and
 * addend. Expected values are small integers worked out in the comments.
 */
#include <criterion/criterion.h>
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

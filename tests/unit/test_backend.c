/* SPDX-License-Identifier: MIT */
/*
 * daemon/backend/backend_factory.c: the factory that turns --backend into a backend table,
 * and the table's inline threshold, which decides where the engine runs a
 * task (loop thread or worker pool).
 */
#include <criterion/criterion.h>
#include <string.h>

#include "backend_factory.h"
#include "pool.h"

Test(backend, factory_builds_the_host_backend_that_runs_small_tasks_inline, .timeout = 10)
{
	struct shd_backend_ctx *b = NULL;
	struct shd_pool *pool;
	struct shd_buf buf = { .fd = -1 };

	cr_assert_eq(shd_pool_create(1, &pool), 0);
	cr_assert_eq(shd_backend_create(SHARDD_BACKEND_HOST, 0, 1000000000ull, pool, &b), 0);
	cr_assert_not_null(b);
	cr_assert_str_eq(b->ops->name, "host");
	/* 16 MiB (docs/ARCHITECTURE.md, "Threads"): below it a pool round trip costs more than the loop's pause. */
	cr_assert_eq(b->ops->inline_max_bytes, (uint64_t)16 << 20);
	cr_assert_eq(b->ops->alloc(b, 4096, SHARDD_HELLO_DEVICE_HOST, "test buffer", &buf), 0);
	cr_assert(shd_buf_allocated(&buf));
	b->ops->free(b, &buf);
	b->ops->destroy(b);
	shd_pool_destroy(pool);
}

Test(backend, factory_refuses_a_kind_that_is_no_backend, .timeout = 10)
{
	struct shd_backend_ctx *b = NULL;
	struct shd_pool *pool;

	cr_assert_eq(shd_pool_create(1, &pool), 0);
	cr_assert_eq(shd_backend_create(0, 0, 1000000000ull, pool, &b), -SHARDD_E_BACKEND);
	cr_assert_eq(shd_backend_create(7, 0, 1000000000ull, pool, &b), -SHARDD_E_BACKEND);
	cr_assert_null(b);
	shd_pool_destroy(pool);
}

#ifndef SHARDD_HAVE_CUDA
Test(backend, factory_says_a_build_without_cuda_has_no_cuda_backend, .timeout = 10)
{
	struct shd_backend_ctx *b = NULL;
	struct shd_pool *pool;

	cr_assert_eq(shd_pool_create(1, &pool), 0);
	cr_assert_eq(shd_backend_create(SHARDD_BACKEND_CUDA, 0, 1000000000ull, pool, &b),
		     -SHARDD_E_BACKEND);
	cr_assert_null(b);
	shd_pool_destroy(pool);
}
#endif

/* SPDX-License-Identifier: MIT */
#ifdef SHARDD_HAVE_CUDA
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <string.h>
#include <sys/mman.h>

#include "backend_cuda.h"
#include "cudapair.h"
#include "harness.h"

void cudapair_backends(uint32_t mode, uint64_t timeout_ns, struct shd_backend_ctx **cuda,
		       struct shd_backend_ctx **host, struct shd_pool **pool)
{
	char err[256];
	int n = 0;

	if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
		cr_skip_test("no CUDA device visible");
	cr_assert_eq(shd_backend_cuda_create(mode, timeout_ns, cuda, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(shd_pool_create(2, pool), 0);
	cr_assert_eq(shd_backend_host_create(*pool, host), 0);
}

void cudapair_backends_destroy(struct shd_backend_ctx **cuda, struct shd_backend_ctx **host,
			       struct shd_pool **pool)
{
	if (*host)
		(*host)->ops->destroy(*host);
	if (*pool)
		shd_pool_destroy(*pool);
	if (*cuda)
		(*cuda)->ops->destroy(*cuda);
	*host = *cuda = NULL;
	*pool = NULL;
}

void cudapair_alloc(struct shd_backend_ctx *cuda, struct shd_backend_ctx *host, struct cudapair *p,
		    uint64_t bytes, const char *what)
{
	p->bytes = bytes;
	cr_assert_eq(host->ops->alloc(host, bytes, SHARDD_HELLO_DEVICE_HOST, what, &p->h), 0);
	cr_assert_eq(cuda->ops->alloc(cuda, bytes, 0, what, &p->d), 0, "cuda alloc of %s", what);
	p->host = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, p->h.fd, 0);
	cr_assert_neq(p->host, MAP_FAILED);
}

void cudapair_free(struct shd_backend_ctx *cuda, struct shd_backend_ctx *host, struct cudapair *p)
{
	if (!p->host)
		return;
	munmap(p->host, p->bytes);
	host->ops->free(host, &p->h);
	cuda->ops->free(cuda, &p->d);
	memset(p, 0, sizeof(*p));
}

void cudapair_to_device(struct shd_backend_ctx *cuda, struct cudapair *p)
{
	const struct shd_buf *on = &p->d;

	cr_assert_eq(cuda->ops->sync(cuda, &on, 1, NULL, 0), 0);
	CUDA_OK(cudaMemcpy(shd_backend_cuda_ptr(&p->d), p->host, p->bytes, cudaMemcpyHostToDevice));
	/* A pageable copy may still be in flight, and the backend's stream does not wait for it. */
	CUDA_OK(cudaDeviceSynchronize());
}
#endif

/* SPDX-License-Identifier: MIT */
/*
 * The backend factory (backend_factory.h): which backend --backend names, and
 * whether this build has it. Only here does the daemon know the kinds; the
 * engine talks to the table alone.
 */
#include "backend_factory.h"
#ifdef SHARDD_HAVE_CUDA
#include "backend_cuda.h"
#endif
#include "log.h"

#ifdef SHARDD_HAVE_CUDA
/* The cuda backend; its error is logged as it words it (which flag, why, the fix). */
static int backend_cuda(uint32_t cuda_export, uint64_t timeout_ns, struct shd_backend_ctx **out)
{
	char err[256];
	int ret = shd_backend_cuda_create(cuda_export, timeout_ns, out, err, sizeof(err));

	if (ret)
		shd_log_error("%s", err);
	return ret;
}
#endif

int shd_backend_create(uint32_t kind, uint32_t cuda_export, uint64_t timeout_ns,
		       struct shd_pool *pool, struct shd_backend_ctx **out)
{
	switch (kind) {
	case SHARDD_BACKEND_HOST:
		return shd_backend_host_create(pool, out);
	case SHARDD_BACKEND_CUDA:
#ifdef SHARDD_HAVE_CUDA
		return backend_cuda(cuda_export, timeout_ns, out);
#else
		(void)cuda_export;
		(void)timeout_ns;
		shd_log_error(
			"shardd: the cuda backend is not available in this build; use --backend host");
		return -SHARDD_E_BACKEND;
#endif
	default:
		shd_log_error("shardd: backend %u is not a backend (host = %d, cuda = %d)", kind,
			      SHARDD_BACKEND_HOST, SHARDD_BACKEND_CUDA);
		return -SHARDD_E_BACKEND;
	}
}

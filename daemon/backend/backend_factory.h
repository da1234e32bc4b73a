/* SPDX-License-Identifier: MIT */
/*
 * The backend factory: the one place that knows the kinds of backend and
 * builds the table --backend names. It sits above the backends
 * (backend_host.c, backend_cuda*.c); the types and helpers they share are
 * in backend.h, below them.
 */
#ifndef SHD_BACKEND_FACTORY_H
#define SHD_BACKEND_FACTORY_H

#include <stdint.h>

#include "backend.h"

/*
 * The backend of kind `kind` (enum shardd_backend: --backend): the host
 * backend on `pool`, or the cuda backend exporting buffers as
 * `cuda_export` says (enum shd_cuda_export) with `timeout_ns` bounding
 * its waits. 0, or -SHARDD_E_BACKEND (a kind this build lacks or that is no
 * kind, a cuda backend that cannot start) or -ENOMEM, logged in the
 * backend's own words (which flag, why, the fix).
 */
int shd_backend_create(uint32_t kind, uint32_t cuda_export, uint64_t timeout_ns,
		       struct shd_pool *pool, struct shd_backend_ctx **out);

#endif /* SHD_BACKEND_FACTORY_H */

/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend (backend_cuda.c): group buffers in device memory,
 * exported to clients as POSIX file descriptors of the driver's virtual
 * memory API, unshard/reduce/zero with the CUDA kernels. Built only with
 * SHARDD_HAVE_CUDA (make CUDA=auto|1).
 */
#ifndef SHARDD_BACKEND_CUDA_H
#define SHARDD_BACKEND_CUDA_H

#include <stddef.h>

#include "daemon/backend.h"

/*
 * 0, or -SHARDD_E_BACKEND with `err` saying why (no driver, no device, a
 * driver without the virtual memory API), or -ENOMEM. Touches no device:
 * a device is set up when its first buffer is allocated.
 */
int shardd_backend_cuda_create(struct shardd_backend_ctx **out, char *err, size_t errlen);

/* The daemon's device address of a buffer this backend allocated, or NULL (tools and tests). */
void *shardd_backend_cuda_ptr(const struct shardd_buf *buf);

#endif /* SHARDD_BACKEND_CUDA_H */

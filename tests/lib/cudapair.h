/* SPDX-License-Identifier: MIT */
/*
 * The GPU suites that hold the cuda backend to the host backend
 * (tests/gpu/test_cuda_backend.c, test_cuda_step.c): both backends on one
 * pool, and a buffer allocated on each with the host one mapped, so a test
 * fills the host bytes, copies them to the device and compares results.
 * CUDA builds only (SHARDD_HAVE_CUDA). Every call asserts (Criterion).
 */
#ifndef SHARDD_TEST_CUDAPAIR_H
#define SHARDD_TEST_CUDAPAIR_H

#include <stdint.h>

#include "backend.h"
#include "pool.h"

/*
 * The cuda backend (--cuda-export `mode`, collectives bounded by
 * `timeout_ns`) into *cuda, a pool of 2 workers and the host backend on it;
 * skips the test when no CUDA device is visible.
 */
void cudapair_backends(uint32_t mode, uint64_t timeout_ns, struct shd_backend_ctx **cuda,
		       struct shd_backend_ctx **host, struct shd_pool **pool);
/* Destroy what cudapair_backends made (any of them may be NULL) and clear the pointers. */
void cudapair_backends_destroy(struct shd_backend_ctx **cuda, struct shd_backend_ctx **host,
			       struct shd_pool **pool);

/* The same buffer on both backends; `host` maps the host one. */
struct cudapair {
	struct shd_buf h, d;
	uint8_t *host;
	uint64_t bytes;
};

/* Allocate `bytes` (`what` names it) on both backends (device 0) and map the host one. */
void cudapair_alloc(struct shd_backend_ctx *cuda, struct shd_backend_ctx *host, struct cudapair *p,
		    uint64_t bytes, const char *what);
/* Free both buffers and the mapping; nothing when `p` holds none. */
void cudapair_free(struct shd_backend_ctx *cuda, struct shd_backend_ctx *host, struct cudapair *p);
/*
 * Copy the host contents to the device, after the cuda backend's queued
 * work on it (which may still read it), and wait for the copy: both
 * backends then start from the same bytes.
 */
void cudapair_to_device(struct shd_backend_ctx *cuda, struct cudapair *p);

#endif /* SHARDD_TEST_CUDAPAIR_H */

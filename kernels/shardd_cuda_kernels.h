/* SPDX-License-Identifier: MIT */
/*
 * CUDA versions of the kernels of shardd_kernels.h: the same arguments and
 * the same numerics bit for bit (tests/gpu checks them against the CPU
 * kernels), on device memory, queued on `stream` (a cudaStream_t; NULL is
 * the legacy default stream). Pointer arrays (`in`, `src`) are host arrays
 * of device pointers; `m->add` is a device pointer. Calls return once the
 * work is queued: 0, -SHARDD_E_INVALID for arguments the kernels cannot
 * take, or -SHARDD_E_BACKEND when CUDA refuses the launch.
 */
#ifndef SHARDD_CUDA_KERNELS_H
#define SHARDD_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "shardd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Input pointers travel in the kernel's parameter block; a reduce takes at
 * most this many inputs. chunk_cat takes any number of chunks (it copies
 * them in batches of this size).
 */
#define SHARDD_CUDA_MAX_INPUTS 128

int shardd_cuda_cast(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype, size_t n,
		     void *stream);

int shardd_cuda_zero(void *dst, size_t bytes, void *stream);

int shardd_cuda_chunk_cat(void *dst, uint32_t dst_dtype, const void *const *src, uint32_t src_dtype,
			  uint32_t nchunks, size_t outer, size_t inner, void *stream);

int shardd_cuda_reduce(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
		       uint32_t nin, uint32_t in_dtype, size_t n, const struct shardd_reduce_math *m,
		       void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SHARDD_CUDA_KERNELS_H */

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
		       uint32_t nin, uint32_t in_dtype, size_t n,
		       const struct shardd_reduce_math *m, void *stream);

/*
 * The optimizer kernels of shardd_kernels.h on device memory: the pointers
 * in *a are device pointers, the struct itself is host memory (read before
 * the call returns). The same bits as shardd_k_sgd / shardd_k_adamw.
 * -SHARDD_E_INVALID for a grad dtype or missing state the kernels cannot
 * take (shardd_k_*_check is the full validation).
 */
int shardd_cuda_sgd(const struct shardd_sgd *a, size_t begin, size_t end, void *stream);
int shardd_cuda_adamw(const struct shardd_adamw *a, size_t begin, size_t end, void *stream);

/*
 * The grad-norm part of grad[begin, end) (device memory): ws is a device
 * buffer of SHARDD_CUDA_NORM_WS doubles; when the stream gets there,
 * ws[0] is the sum of squares and ws[1] the largest |grad| (NaNs skipped).
 * A non-finite ws[0] means a NaN or Inf element. Deterministic for a given
 * range; equal to shardd_k_grad_norm_part within fp64 rounding.
 */
#define SHARDD_CUDA_NORM_WS 514
int shardd_cuda_grad_norm_part(const void *grad, uint32_t dtype, size_t begin, size_t end,
			       double *ws, void *stream);

/*
 * The skip-on-non-finite check of a step: when the stream gets there,
 * *flag (a device uint32_t the caller zeroed) is 1 if some element of
 * grad[begin, end) is NaN or +-Inf, and untouched otherwise; several calls
 * may share one flag. The same answer as shardd_k_grad_norm_part's
 * `nonfinite`, without the sum.
 */
int shardd_cuda_nonfinite(const void *grad, uint32_t dtype, size_t begin, size_t end,
			  uint32_t *flag, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SHARDD_CUDA_KERNELS_H */

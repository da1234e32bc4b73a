/* SPDX-License-Identifier: MIT */
/*
 * The arithmetic of shardd: every byte the daemon moves for an op goes
 * through these calls. CPU versions (the .c files of kernels/) work on
 * host memory on the calling thread; the daemon splits large ranges across
 * its worker pool. CUDA versions (the .cu files, shardd_cuda_kernels.h)
 * take the same arguments on device memory plus a stream.
 *
 * Dtype codes are enum shardd_dtype from proto/shardd_proto.h. Casts round
 * to nearest even; NaN stays NaN (quiet) and Inf stays Inf. Pointers must
 * be aligned to their dtype's element size. The calls keep no state, so
 * threads may run them concurrently on disjoint ranges.
 */
#ifndef SHARDD_KERNELS_H
#define SHARDD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/*
 * Elements the CPU kernels process at a time: their fp32 stack buffers
 * (2 KiB each) stay in L1, and loops of this constant length vectorise.
 * Callers splitting work across threads should split on multiples of it.
 */
#define SHARDD_K_BLOCK 512

/* Scalar conversions (round to nearest even, NaN and Inf kept). */
uint16_t shardd_f32_to_bf16(float f);
float    shardd_bf16_to_f32(uint16_t h);
uint16_t shardd_f32_to_f16(float f);
float    shardd_f16_to_f32(uint16_t h);

/* Round an fp32 value to `dtype` and back (identity for fp32). */
float shardd_round_to(uint32_t dtype, float f);

/*
 * Block conversions through fp32, the working precision of every kernel:
 * dst[i] = src[i] widened (exact for every dtype), dst[i] = src[i] rounded
 * to dst_dtype, and x[i] = shardd_round_to(dtype, x[i]), for i < n. The
 * optimizer and the daemon's copy paths build on these; buffers must not
 * overlap.
 */
void shardd_k_to_f32(float *dst, const void *src, uint32_t src_dtype, size_t n);
void shardd_k_from_f32(void *dst, uint32_t dst_dtype, const float *src, size_t n);
void shardd_k_round(float *x, uint32_t dtype, size_t n);

/* dst[i] = cast(src[i]) for i < n. dst and src must not overlap unless equal dtypes and equal pointers. */
void shardd_k_cast(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype, size_t n);

/* Zero `bytes` bytes. */
void shardd_k_zero(void *dst, size_t bytes);

/*
 * Chunk-cat (all-gather copy-out of a Shard(i) param): for o < outer,
 * r < nchunks, k < inner:
 *   dst[(o * nchunks + r) * inner + k] = cast(src[r][o * inner + k]).
 */
void shardd_k_chunk_cat(void *dst, uint32_t dst_dtype, const void *const *src,
			uint32_t src_dtype, uint32_t nchunks, size_t outer, size_t inner);

/*
 * The arithmetic of one collective reduction, host numerics (docs/DESIGN.md):
 * per element j,
 *   x_k = round_rd(in_k[j]);  if pre > 1: x_k = round_rd(x_k / pre)
 *   s   = round_rd((sum_k x_k in fp32) / avg)       (avg 1: a plain sum)
 *   if add:      s = round_rd(s + add[j])           (add is in reduce_dtype)
 *   if post > 1: s = round_rd(s / post)
 *   v   = cast_out(s)
 *   out[j] = accumulate ? cast_out(out[j] + v) : v  (the add in fp32)
 * where round_rd rounds to reduce_dtype.
 */
struct shardd_reduce_math {
	uint32_t    reduce_dtype; /* dtype values travel and are rounded in */
	float       pre;          /* FSDP2 pre-divide factor, 1 = none */
	float       avg;          /* divide of the sum: group size for AVG, 1 for SUM */
	const void *add;          /* optional addend in reduce_dtype (HSDP partial), or NULL */
	float       post;         /* FSDP2 post-divide factor, 1 = none */
};

/*
 * out[j] (out_dtype, n elements) from nin inputs in_dtype, as above.
 * `accumulate` nonzero adds into out. `out` may alias `add`.
 */
void shardd_k_reduce(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
		     uint32_t nin, uint32_t in_dtype, size_t n, const struct shardd_reduce_math *m);

/*
 * shardd_k_cast and shardd_k_reduce with non-temporal (streaming) stores
 * where the CPU has them (AVX-512; elsewhere the plain call): the output
 * goes around the caches, which saves the read of every output line a
 * normal store causes and keeps the inputs cached. For outputs much larger
 * than the last-level cache that no one reads right away. The same bits
 * as the plain calls. Each call ends with a store fence, so its writes are
 * ordered before anything the caller publishes afterwards. CPU only.
 */
void shardd_k_cast_stream(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype, size_t n);
void shardd_k_reduce_stream(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
			    uint32_t nin, uint32_t in_dtype, size_t n, const struct shardd_reduce_math *m);

/*
 * FSDP2's _get_gradient_divide_factors for a data-parallel size n and a
 * reduce dtype: fp32/bf16 -> *pre = *post = 0 (meaning: AVG, no factors);
 * fp16 -> the power-of-two pre factor and post = n / pre, exactly as the
 * seed's loop computes them.
 */
void shardd_divide_factors(uint32_t n, uint32_t reduce_dtype, double *pre, double *post);

#endif /* SHARDD_KERNELS_H */

/* SPDX-License-Identifier: MIT */
/*
 * The arithmetic of one collective reduction (shardd_k_reduce in
 * shardd_kernels.h has the formula): cast to reduce_dtype, FSDP2 pre-divide,
 * sum in fp32, average, HSDP partial add, post-divide, cast to the param's
 * dtype, accumulate.
 *
 * One pass over memory: the range is walked in SHARDD_K_BLOCK-element
 * blocks; for each block every input is read once into an fp32 stack
 * buffer and summed into an fp32 accumulator, and the output is written
 * once. The fp32 loops are plain loops of constant length (full blocks)
 * that gcc -O2 vectorises.
 */
#include "shardd_kernels.h"
#include "shardd_proto.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void add_n(float *restrict acc, const float *restrict x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		acc[i] += x[i];
}

ALWAYS_INLINE void div_n(float *restrict x, float by, size_t n)
{
	for (size_t i = 0; i < n; i++)
		x[i] /= by;
}

static void add_block(float *restrict acc, const float *restrict x, size_t n)
{
	if (n == SHARDD_K_BLOCK)
		add_n(acc, x, SHARDD_K_BLOCK);
	else
		add_n(acc, x, n);
}

static void div_block(float *restrict x, float by, size_t n)
{
	if (n == SHARDD_K_BLOCK)
		div_n(x, by, SHARDD_K_BLOCK);
	else
		div_n(x, by, n);
}

/* x = round_rd(x / by), the divide applied only for a factor > 1. */
static void divide_round(float *x, float by, uint32_t rd, size_t n)
{
	if (by > 1.0f) {
		div_block(x, by, n);
		shardd_k_round(x, rd, n);
	}
}

void shardd_k_reduce(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
		     uint32_t nin, uint32_t in_dtype, size_t n, const struct shardd_reduce_math *m)
{
	size_t isz = shardd_dtype_size(in_dtype), osz = shardd_dtype_size(out_dtype);
	size_t rsz = shardd_dtype_size(m->reduce_dtype);
	uint32_t rd = m->reduce_dtype;
	/* Rounding inputs to reduce_dtype is the identity when they already fit. */
	int round_in = rd != SHARDD_DTYPE_FP32 && rd != in_dtype;
	float acc[SHARDD_K_BLOCK], x[SHARDD_K_BLOCK];

	for (size_t base = 0; base < n; base += SHARDD_K_BLOCK) {
		size_t len = n - base < SHARDD_K_BLOCK ? n - base : SHARDD_K_BLOCK;

		/*
		 * The sum starts from x_0, not from +0, so that inputs that are
		 * all -0 sum to -0 as the formula says.
		 */
		for (uint32_t k = 0; k < nin; k++) {
			const char *src = (const char *)in[k] + base * isz;
			float *dst = k == 0 ? acc : x;
			int direct = k > 0 && in_dtype == SHARDD_DTYPE_FP32 && !round_in &&
				     !(m->pre > 1.0f);

			if (direct) {
				/* fp32 that needs no rounding is added straight from the input. */
				add_block(acc, (const float *)(const void *)src, len);
				continue;
			}
			shardd_k_to_f32(dst, src, in_dtype, len);
			if (round_in)
				shardd_k_round(dst, rd, len);
			divide_round(dst, m->pre, rd, len);
			if (k > 0)
				add_block(acc, x, len);
		}
		if (m->avg != 1.0f)
			div_block(acc, m->avg, len);
		shardd_k_round(acc, rd, len);
		if (m->add) {
			shardd_k_to_f32(x, (const char *)m->add + base * rsz, rd, len);
			add_block(acc, x, len);
			shardd_k_round(acc, rd, len);
		}
		divide_round(acc, m->post, rd, len);

		if (accumulate) {
			shardd_k_round(acc, out_dtype, len);
			shardd_k_to_f32(x, (char *)out + base * osz, out_dtype, len);
			add_block(acc, x, len);
		}
		shardd_k_from_f32((char *)out + base * osz, out_dtype, acc, len);
	}
}

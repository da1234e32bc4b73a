/* SPDX-License-Identifier: MIT */
/*
 * The values benchmarks write and check. Small integers (and their means
 * over up to 8 ranks) are exact in fp32, bf16 and fp16, so every check is
 * an exact compare. The element codecs are written here on the bare
 * bit-casts of shardd_kernels.h, not taken from the kernels' casts, so a
 * cast bug in the kernels cannot hide itself by decoding its own output.
 */
#include "bench.h"
#include "shardd_kernels.h"

float bench_param_value(uint64_t i, uint32_t seed)
{
	return (float)((int)((i * 7 + seed * 13) & 127) - 64);
}

float bench_grad_value(uint64_t i, uint32_t rank, uint32_t seed)
{
	return (float)((int)((i * 5 + rank * 3 + seed * 11) & 15) - 8);
}

void bench_store_exact(void *buf, uint32_t dtype, uint64_t i, float v)
{
	uint32_t u = shardd_f32_bits(v);
	uint16_t h;

	switch (dtype) {
	case SHARDD_DTYPE_FP32:
		((float *)buf)[i] = v;
		return;
	case SHARDD_DTYPE_BF16:
		/* Exact values have no bits below the bf16 mantissa: truncation is the cast. */
		((uint16_t *)buf)[i] = shardd_bf16_truncate(v);
		return;
	default:
		if (v == 0.0f)
			h = (uint16_t)((u >> 16) & 0x8000u);
		else
			h = (uint16_t)(((u >> 16) & 0x8000u) |
				       ((((u >> 23) & 0xffu) - 127u + 15u) << 10) |
				       ((u >> 13) & 0x3ffu));
		((uint16_t *)buf)[i] = h;
		return;
	}
}

float bench_load_exact(const void *buf, uint32_t dtype, uint64_t i)
{
	uint16_t h;
	uint32_t e, m, s;

	switch (dtype) {
	case SHARDD_DTYPE_FP32:
		return ((const float *)buf)[i];
	case SHARDD_DTYPE_BF16:
		return shardd_bf16_widen(((const uint16_t *)buf)[i]);
	default:
		h = ((const uint16_t *)buf)[i];
		s = (uint32_t)(h & 0x8000u) << 16;
		e = (h >> 10) & 0x1fu;
		m = h & 0x3ffu;
		if (e == 0 && m == 0)
			return shardd_bits_f32(s);
		/* Subnormals, Inf and NaN never occur in the patterns: make them compare unequal. */
		if (e == 0 || e == 31)
			return shardd_bits_f32(0x7fc00000u);
		return shardd_bits_f32(s | ((e - 15u + 127u) << 23) | (m << 13));
	}
}

/* SPDX-License-Identifier: MIT */
/*
 * bf16 on 16 fp32 lanes in AVX-512, for cast.c and reduce.c: the integer
 * steps of cast.c's scalar bf16_from_bits and bf16_to_bits, so both files
 * round and widen bf16 one way. Not vcvtneps2bf16 (AVX512_BF16): it flushes
 * subnormals to zero. x86 only.
 */
#ifndef SHARDD_BF16_AVX512_H
#define SHARDD_BF16_AVX512_H

#include <immintrin.h>

#define BF16_AVX512_INLINE                                                 \
	__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline \
		__attribute__((always_inline))

/* Lanes that hold a NaN. */
BF16_AVX512_INLINE __mmask16 bf16_nan_lanes_512(__m512i u)
{
	return _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
				       _mm512_set1_epi32(0x7f800000));
}

/* fp32 bits rounded to bf16, to nearest even, in the top halves of the lanes (a NaN: truncated, quiet bit set). */
BF16_AVX512_INLINE __m512i bf16_round_bits_512(__m512i u)
{
	__m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
	__m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);

	r = _mm512_mask_or_epi32(r, bf16_nan_lanes_512(u), u, _mm512_set1_epi32(0x00400000));
	return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* 16 bf16 values widened to fp32 (exact); a NaN comes back quiet. */
BF16_AVX512_INLINE __m512 bf16_widen_512(__m256i h)
{
	__m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);

	return _mm512_castsi512_ps(
		_mm512_mask_or_epi32(u, bf16_nan_lanes_512(u), u, _mm512_set1_epi32(0x00400000)));
}

/* x rounded to bf16 and widened back (shardd_round_to on 16 lanes). */
BF16_AVX512_INLINE __m512 bf16_round_512(__m512 x)
{
	return _mm512_castsi512_ps(bf16_round_bits_512(_mm512_castps_si512(x)));
}

/* x rounded to bf16: the 16-bit values. */
BF16_AVX512_INLINE __m256i bf16_narrow_512(__m512 x)
{
	return _mm512_cvtepi32_epi16(
		_mm512_srli_epi32(bf16_round_bits_512(_mm512_castps_si512(x)), 16));
}

/*
 * 32 fp32 lanes (lo, then hi) rounded to bf16, as bf16_narrow_512 rounds
 * them, in one vcvtne2ps2bf16 where the CPU has AVX512_BF16: its rounding
 * (add 0x7fff plus the kept lowest bit) and its NaN (truncated, quiet bit
 * set) are bf16_from_bits' own, and a normal fp32 never rounds to a bf16
 * subnormal (same exponent range), but it reads subnormal inputs as zero.
 * A pair of vectors with a subnormal lane takes the integer steps instead.
 * Measured on the Xeon host (docs/BENCHMARKS.md, issue 33), a 2-thread
 * streaming fp32 -> bf16 cast of 32 Mi elements: 23 - 30 GB/s with the
 * integer steps (bound by the core: ~24 instructions per 32 elements),
 * 32 - 34 GB/s with this, as fast as a plain truncating copy.
 */
#define BF16_NE_INLINE                                                                \
	__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline \
		__attribute__((always_inline))

/* Lanes of fp32 bits u that are subnormal: exponent 0, mantissa not. */
BF16_AVX512_INLINE __mmask16 bf16_subnormal_lanes_512(__m512i u)
{
	return _mm512_mask_test_epi32_mask(
		_mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)), u,
		_mm512_set1_epi32(0x007fffff));
}

BF16_NE_INLINE __m512i bf16_narrow32_ne_512(__m512 lo, __m512 hi)
{
	if (__builtin_expect(bf16_subnormal_lanes_512(_mm512_castps_si512(lo)) |
				     bf16_subnormal_lanes_512(_mm512_castps_si512(hi)),
			     0))
		return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_narrow_512(lo)),
					  bf16_narrow_512(hi), 1);
	return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

#endif /* SHARDD_BF16_AVX512_H */

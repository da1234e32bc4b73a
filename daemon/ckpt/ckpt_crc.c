/* SPDX-License-Identifier: MIT */
/*
 * CRC-32 (ckpt_crc.h) by carry-less multiplication: four 128-bit lanes
 * folded 64 bytes at a time, then into one lane, then Barrett-reduced to 32
 * bits (Intel, "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ
 * Instruction", 2009; the constants are that paper's for the bit-reflected
 * gzip polynomial 0x104c11db7, as zlib's x86 code uses them). zlib's 1.2
 * tables run at about 1 GB/s, under a disk's 2 GB/s; this at memory speed.
 * Processors without PCLMULQDQ, other architectures, and the last bytes
 * below 16 go through zlib.
 */
#include <zlib.h>

#include "ckpt_crc.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define CRC_FOLD_MIN 64 /* bytes: the four lanes' first load */

/* The CRC register (not inverted) over n bytes, n >= CRC_FOLD_MIN and a multiple of 16. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_fold(uint32_t crc, const uint8_t *p,
								  size_t n)
{
	const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
	const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
	const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124);
	const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
	const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
	__m128i x1 = _mm_loadu_si128((const __m128i *)(p + 0x00));
	__m128i x2 = _mm_loadu_si128((const __m128i *)(p + 0x10));
	__m128i x3 = _mm_loadu_si128((const __m128i *)(p + 0x20));
	__m128i x4 = _mm_loadu_si128((const __m128i *)(p + 0x30));
	__m128i x5;

	x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
	p += 64;
	n -= 64;
	for (; n >= 64; p += 64, n -= 64) {
		__m128i a = _mm_clmulepi64_si128(x1, k1k2, 0x00);
		__m128i b = _mm_clmulepi64_si128(x2, k1k2, 0x00);
		__m128i c = _mm_clmulepi64_si128(x3, k1k2, 0x00);
		__m128i d = _mm_clmulepi64_si128(x4, k1k2, 0x00);

		x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, k1k2, 0x11), a);
		x2 = _mm_xor_si128(_mm_clmulepi64_si128(x2, k1k2, 0x11), b);
		x3 = _mm_xor_si128(_mm_clmulepi64_si128(x3, k1k2, 0x11), c);
		x4 = _mm_xor_si128(_mm_clmulepi64_si128(x4, k1k2, 0x11), d);
		x1 = _mm_xor_si128(x1, _mm_loadu_si128((const __m128i *)(p + 0x00)));
		x2 = _mm_xor_si128(x2, _mm_loadu_si128((const __m128i *)(p + 0x10)));
		x3 = _mm_xor_si128(x3, _mm_loadu_si128((const __m128i *)(p + 0x20)));
		x4 = _mm_xor_si128(x4, _mm_loadu_si128((const __m128i *)(p + 0x30)));
	}
	/* The four lanes into one, then the 16-byte blocks left. */
	x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
	x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), x2), x5);
	x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
	x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), x3), x5);
	x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
	x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), x4), x5);
	for (; n >= 16; p += 16, n -= 16) {
		x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
		x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11),
				   _mm_loadu_si128((const __m128i *)p));
		x1 = _mm_xor_si128(x1, x5);
	}
	/* 128 bits to 64, then Barrett's reduction to 32. */
	x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
	x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
	x2 = _mm_srli_si128(x1, 4);
	x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5k0, 0x00), x2);
	x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10);
	x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, low32), poly, 0x00);
	x1 = _mm_xor_si128(x1, x2);
	return (uint32_t)_mm_extract_epi32(x1, 1);
}

uint32_t ckpt_crc32(uint32_t crc, const uint8_t *p, size_t n)
{
	/* Pool threads may race to set it: each stores the same answer. */
	static int fast = -1;
	int f = __atomic_load_n(&fast, __ATOMIC_RELAXED);

	if (f < 0) {
		f = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
		__atomic_store_n(&fast, f, __ATOMIC_RELAXED);
	}
	if (f && n >= CRC_FOLD_MIN) {
		size_t k = n & ~(size_t)15;

		crc = ~crc_fold(~crc, p, k);
		p += k;
		n -= k;
	}
	return (uint32_t)crc32_z(crc, p, n);
}
#else
uint32_t ckpt_crc32(uint32_t crc, const uint8_t *p, size_t n)
{
	return (uint32_t)crc32_z(crc, p, n);
}
#endif

/* SPDX-License-Identifier: MIT */
/*
 * Casts between fp32, bf16 and fp16: scalar conversions and the block
 * conversions every other kernel is built from.
 *
 * Speed: the bf16 loops are AVX-512 intrinsics where the CPU has AVX-512
 * (picked at run time; fp32 -> bf16 in AVX512_BF16's conversion where the
 * CPU has that too, bf16_avx512.h), else plain integer loops over restrict pointers
 * that gcc -O2 vectorises, built for the baseline ISA and for AVX2; -O2's
 * "very cheap" cost model only vectorises loops whose trip count is a
 * known multiple of the vector width, so each loop is run over constant
 * SHARDD_K_BLOCK-element blocks (BLOCKED below) and a short tail.
 * fp16 uses the F16C instructions where the CPU has them
 * (checked at run time, so one binary runs everywhere) and a portable
 * integer conversion otherwise; both round to nearest even and give the same
 * bits, which test_kernels checks over every fp16 value.
 *
 * Pointers must be aligned to their dtype's size. Nothing here keeps state,
 * so concurrent calls on disjoint ranges are safe.
 */
#include <string.h>

#include "optim_isa.h"
#include "shardd_kernels.h"
#include "shardd_proto.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "bf16_avx512.h"
#define SHARDD_HAVE_X86 1
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/*
 * Run fn(dst + i, src + i, len) over n elements: whole blocks with a
 * constant length (vectorised), then the tail.
 */
#define BLOCKED(fn, dst, src, n)                                         \
	do {                                                             \
		size_t i_ = 0;                                           \
		for (; i_ + SHARDD_K_BLOCK <= (n); i_ += SHARDD_K_BLOCK) \
			fn((dst) + i_, (src) + i_, SHARDD_K_BLOCK);      \
		fn((dst) + i_, (src) + i_, (n)-i_);                      \
	} while (0)

/* BLOCKED for an in-place fn(x + i, len). */
#define BLOCKED_INPLACE(fn, x, n)                                        \
	do {                                                             \
		size_t i_ = 0;                                           \
		for (; i_ + SHARDD_K_BLOCK <= (n); i_ += SHARDD_K_BLOCK) \
			fn((x) + i_, SHARDD_K_BLOCK);                    \
		fn((x) + i_, (n)-i_);                                    \
	} while (0)

/* ------------------------------------------------------------- bf16 --- */

/*
 * bf16 is the top half of an fp32. Rounding to nearest even adds 0x7fff plus
 * the lowest kept bit, so a tie rounds toward the even neighbour and a
 * carry moves into the exponent (the largest finite values round to Inf,
 * as they must). A NaN is truncated with its quiet bit set, so a payload
 * that lives only in the low half cannot turn it into Inf.
 */
ALWAYS_INLINE uint16_t bf16_from_bits(uint32_t u)
{
	uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
	uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
	uint32_t quiet = (u >> 16) | 0x40u;

	return (uint16_t)(is_nan ? quiet : rounded);
}

/* Widening is exact; a NaN comes back quiet. */
ALWAYS_INLINE uint32_t bf16_to_bits(uint16_t h)
{
	uint32_t is_nan = (h & 0x7fffu) > 0x7f80u;

	return ((uint32_t)h << 16) | (is_nan ? 0x00400000u : 0u);
}

ALWAYS_INLINE void bf16_load_n(float *restrict d, const uint16_t *restrict s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		d[i] = shardd_bits_f32(bf16_to_bits(s[i]));
}

ALWAYS_INLINE void bf16_store_n(uint16_t *restrict d, const float *restrict s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		d[i] = bf16_from_bits(shardd_f32_bits(s[i]));
}

ALWAYS_INLINE void bf16_round_n(float *restrict x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		x[i] = shardd_bits_f32(bf16_to_bits(bf16_from_bits(shardd_f32_bits(x[i]))));
}

/*
 * The bf16 block loops, built twice: for the baseline ISA and for AVX2
 * (twice the vector width), picked at run time.
 */
#define BF16_BLOCKS(isa, attr)                                                                     \
	attr static void bf16_load_##isa(float *restrict d, const uint16_t *restrict s, size_t n)  \
	{                                                                                          \
		BLOCKED(bf16_load_n, d, s, n);                                                     \
	}                                                                                          \
	attr static void bf16_store_##isa(uint16_t *restrict d, const float *restrict s, size_t n) \
	{                                                                                          \
		BLOCKED(bf16_store_n, d, s, n);                                                    \
	}                                                                                          \
	attr static void bf16_round_##isa(float *x, size_t n)                                      \
	{                                                                                          \
		BLOCKED_INPLACE(bf16_round_n, x, n);                                               \
	}

BF16_BLOCKS(base, )
#ifdef SHARDD_HAVE_X86
BF16_BLOCKS(avx2, __attribute__((target("avx2"))))

/*
 * fp32 -> bf16 by hand in AVX2, 16 elements at a time: bf16_from_bits on
 * 8 lanes (round to nearest even; a NaN truncated with its quiet bit set),
 * then one pack of the two top halves. gcc's loop for bf16_store_n tests
 * NaN with an unsigned min and compare and packs before it blends (~30
 * instructions per 16 elements, ~1 cycle per element on Zen 3, most of an
 * unshard of 16 - 256 KiB); this one takes ~23. The tail is gcc's.
 */
#define AVX2_TARGET __attribute__((target("avx2")))

AVX2_TARGET static inline __m256i bf16_narrow_bits_256(__m256i u)
{
	__m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
					 _mm256_set1_epi32(0x7f800000));
	__m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
	__m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
	__m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));

	return _mm256_srli_epi32(_mm256_blendv_epi8(r, q, nan), 16);
}

/* s[0..16) narrowed to 16 bf16, in order. */
AVX2_TARGET static inline __m256i bf16_narrow16_avx2(const float *s)
{
	__m256i a = bf16_narrow_bits_256(_mm256_loadu_si256((const __m256i *)(const void *)s));
	__m256i b =
		bf16_narrow_bits_256(_mm256_loadu_si256((const __m256i *)(const void *)(s + 8)));

	/* packus works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, put back in order. */
	return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
}

AVX2_TARGET static void bf16_store_avx2_hand(uint16_t *restrict d, const float *restrict s,
					     size_t n)
{
	size_t i = 0;

	for (; i + 16 <= n; i += 16)
		_mm256_storeu_si256((__m256i *)(void *)(d + i), bf16_narrow16_avx2(s + i));
	if (i < n)
		bf16_store_avx2(d + i, s + i, n - i);
}

/*
 * The bf16 loops by hand in AVX-512 (16 lanes, masked tails, no blends of
 * 16-bit halves), on the lane helpers of bf16_avx512.h. gcc's AVX2 code for
 * bf16_store_n widens, blends and packs; this one converts 16 elements in a
 * handful of instructions, so a cast is bound by memory, not by the core.
 */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

/*
 * Whole vectors use plain loads and stores and only the tail a masked
 * one: measured on Zen 5, a cast that streams through masked stores runs
 * at less than half the memory bandwidth of plain ones.
 */
AVX512_TARGET static void bf16_load_avx512(float *restrict d, const uint16_t *restrict s, size_t n)
{
	size_t i = 0;
	__mmask16 k;

	for (; i + 16 <= n; i += 16)
		_mm512_storeu_ps(d + i, bf16_widen_512(_mm256_loadu_si256((const void *)(s + i))));
	if (i == n)
		return;
	k = (__mmask16)((1u << (n - i)) - 1u);
	_mm512_mask_storeu_ps(d + i, k, bf16_widen_512(_mm256_maskz_loadu_epi16(k, s + i)));
}

AVX512_TARGET static void bf16_store_avx512(uint16_t *restrict d, const float *restrict s, size_t n)
{
	size_t i = 0;
	__mmask16 k;

	for (; i + 16 <= n; i += 16)
		_mm256_storeu_si256((void *)(d + i), bf16_narrow_512(_mm512_loadu_ps(s + i)));
	if (i == n)
		return;
	k = (__mmask16)((1u << (n - i)) - 1u);
	_mm256_mask_storeu_epi16(d + i, k, bf16_narrow_512(_mm512_maskz_loadu_ps(k, s + i)));
}

/* bf16_store_avx512 on CPUs with AVX512_BF16 (bf16_narrow32_ne_512): the same bits. */
#define AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

AVX512_BF16_TARGET static void bf16_store_avx512bf16(uint16_t *restrict d, const float *restrict s,
						     size_t n)
{
	size_t i = 0;

	for (; i + 32 <= n; i += 32)
		_mm512_storeu_si512(
			(void *)(d + i),
			bf16_narrow32_ne_512(_mm512_loadu_ps(s + i), _mm512_loadu_ps(s + i + 16)));
	bf16_store_avx512(d + i, s + i, n - i);
}

AVX512_TARGET static void bf16_round_avx512(float *x, size_t n)
{
	size_t i = 0;
	__mmask16 k;

	for (; i + 16 <= n; i += 16)
		_mm512_storeu_ps(x + i, bf16_round_512(_mm512_loadu_ps(x + i)));
	if (i == n)
		return;
	k = (__mmask16)((1u << (n - i)) - 1u);
	_mm512_mask_storeu_ps(x + i, k, bf16_round_512(_mm512_maskz_loadu_ps(k, x + i)));
}

#endif

/* ------------------------------------------------------------- fp16 --- */

/*
 * Portable fp32 -> fp16, round to nearest even: fp16 keeps 10 of fp32's 23
 * mantissa bits and has exponents -14..15, so normal results are a rebias
 * and a rounded shift, values from 65520 up round to Inf (65520 is the tie
 * between 65504 and 2^16, and 65504's mantissa is odd), and values below
 * 2^-14 become subnormals: the value in units of 2^-24, rounded to even.
 */
ALWAYS_INLINE uint16_t f16_from_bits(uint32_t u)
{
	uint32_t sign = (u >> 16) & 0x8000u;
	uint32_t a = u & 0x7fffffffu;
	uint32_t e, m, shift, q, rem, half;

	if (a > 0x7f800000u)
		return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
	if (a >= 0x477ff000u)
		return (uint16_t)(sign | 0x7c00u);
	if (a >= 0x38800000u) {
		/* Exponent bias 127 -> 15: subtract 112 << 23. */
		uint32_t r = a - 0x38000000u;

		return (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
	}
	e = a >> 23;
	/* Below 2^-25 the result is zero; 2^-25 itself ties to the even zero. */
	if (e < 102)
		return (uint16_t)sign;
	m = (a & 0x7fffffu) | 0x800000u;
	shift = 126 - e; /* 14..24: value / 2^-24 = m >> shift */
	q = m >> shift;
	rem = m & ((1u << shift) - 1u);
	half = 1u << (shift - 1u);
	q += (rem > half) | ((rem == half) & q & 1u);
	return (uint16_t)(sign | q);
}

/* fp16 -> fp32 is exact; a NaN comes back quiet with its payload on top. */
ALWAYS_INLINE float f16_to_f32_portable(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t e = (h >> 10) & 0x1fu;
	uint32_t m = h & 0x3ffu;
	float f;

	if (e == 0x1f)
		return shardd_bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u));
	if (e != 0)
		return shardd_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
	/* Subnormal or zero: m * 2^-24, exact in fp32. */
	f = (float)m * 0x1p-24f;
	return sign ? -f : f;
}

static void f16_load_portable(float *restrict d, const uint16_t *restrict s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		d[i] = f16_to_f32_portable(s[i]);
}

static void f16_store_portable(uint16_t *restrict d, const float *restrict s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		d[i] = f16_from_bits(shardd_f32_bits(s[i]));
}

static void f16_round_portable(float *x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		x[i] = f16_to_f32_portable(f16_from_bits(shardd_f32_bits(x[i])));
}

#ifdef SHARDD_HAVE_X86
/*
 * F16C: vcvtps2ph with an explicit round-to-nearest-even immediate (so
 * MXCSR's rounding mode does not matter) handles subnormals, overflow to
 * Inf and NaN the way the portable code does; vcvtph2ps is exact and
 * quiets NaNs. Tails go through the portable code.
 */
#define F16C_TARGET __attribute__((target("avx,f16c")))
#define F16C_ROUND  (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

F16C_TARGET static void f16_load_f16c(float *restrict d, const uint16_t *restrict s, size_t n)
{
	size_t i = 0;

	for (; i + 8 <= n; i += 8) {
		__m128i h = _mm_loadu_si128((const __m128i *)(const void *)(s + i));

		_mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
	}
	f16_load_portable(d + i, s + i, n - i);
}

F16C_TARGET static void f16_store_f16c(uint16_t *restrict d, const float *restrict s, size_t n)
{
	size_t i = 0;

	for (; i + 8 <= n; i += 8) {
		__m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), F16C_ROUND);

		_mm_storeu_si128((__m128i *)(void *)(d + i), h);
	}
	f16_store_portable(d + i, s + i, n - i);
}

F16C_TARGET static void f16_round_f16c(float *x, size_t n)
{
	size_t i = 0;

	for (; i + 8 <= n; i += 8) {
		__m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), F16C_ROUND);

		_mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
	}
	f16_round_portable(x + i, n - i);
}

/*
 * __builtin_cpu_supports reads data set up by libgcc before main: no race.
 * Each path also within the limit of optim_isa.h (F16C counts as AVX2's).
 */
static int have_f16c(void)
{
	return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c") &&
	       shardd_k_isa_allows(SHARDD_K_ISA_AVX2);
}

static int have_avx2(void)
{
	return __builtin_cpu_supports("avx2") && shardd_k_isa_allows(SHARDD_K_ISA_AVX2);
}

static int have_avx512(void)
{
	return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	       __builtin_cpu_supports("avx512vl") && shardd_k_isa_allows(SHARDD_K_ISA_AVX512);
}

static int have_avx512_bf16(void)
{
	return have_avx512() && __builtin_cpu_supports("avx512bf16");
}
#endif

static void bf16_load(float *restrict d, const uint16_t *restrict s, size_t n)
{
#ifdef SHARDD_HAVE_X86
	if (have_avx512()) {
		bf16_load_avx512(d, s, n);
		return;
	}
	if (have_avx2()) {
		bf16_load_avx2(d, s, n);
		return;
	}
#endif
	bf16_load_base(d, s, n);
}

static void bf16_store(uint16_t *restrict d, const float *restrict s, size_t n)
{
#ifdef SHARDD_HAVE_X86
	if (have_avx512_bf16()) {
		bf16_store_avx512bf16(d, s, n);
		return;
	}
	if (have_avx512()) {
		bf16_store_avx512(d, s, n);
		return;
	}
	if (have_avx2()) {
		bf16_store_avx2_hand(d, s, n);
		return;
	}
#endif
	bf16_store_base(d, s, n);
}

static void bf16_round(float *x, size_t n)
{
#ifdef SHARDD_HAVE_X86
	if (have_avx512()) {
		bf16_round_avx512(x, n);
		return;
	}
	if (have_avx2()) {
		bf16_round_avx2(x, n);
		return;
	}
#endif
	bf16_round_base(x, n);
}

static void f16_load(float *restrict d, const uint16_t *restrict s, size_t n)
{
#ifdef SHARDD_HAVE_X86
	if (have_f16c()) {
		f16_load_f16c(d, s, n);
		return;
	}
#endif
	f16_load_portable(d, s, n);
}

static void f16_store(uint16_t *restrict d, const float *restrict s, size_t n)
{
#ifdef SHARDD_HAVE_X86
	if (have_f16c()) {
		f16_store_f16c(d, s, n);
		return;
	}
#endif
	f16_store_portable(d, s, n);
}

static void f16_round(float *x, size_t n)
{
#ifdef SHARDD_HAVE_X86
	if (have_f16c()) {
		f16_round_f16c(x, n);
		return;
	}
#endif
	f16_round_portable(x, n);
}

#ifdef SHARDD_HAVE_X86
/*
 * Streaming (non-temporal) casts for shardd_k_cast_stream: whole 64-byte
 * lines of dst go straight to memory through the write-combining buffers,
 * so the CPU never reads the old line (the write-allocate read a normal
 * store pays: a third of a memory-bound fp32 -> bf16 cast's traffic) and
 * the output does not evict the inputs from the caches. A streaming store
 * needs an aligned line: the elements before dst's first 64-byte boundary
 * and the tail after its last one go through the plain loops.
 */
#define STREAM_LINE 64

/*
 * Software prefetch of the source, STREAM_PREFETCH_AHEAD bytes past the
 * `bytes` (whole lines) a step is about to read: on the Xeon host (issue
 * 33) the hardware prefetcher alone left a 2-thread streaming fp32 ->
 * bf16 cast short of the roofline's best pass, which prefetches. A
 * prefetch never faults, so one past the end of src is harmless; its
 * address is formed as an integer, as it may lie outside the object.
 */
#define STREAM_PREFETCH_AHEAD 2048

ALWAYS_INLINE void stream_prefetch(const void *src, size_t bytes)
{
	for (size_t o = 0; o < bytes; o += STREAM_LINE)
		_mm_prefetch((const char *)((uintptr_t)src + STREAM_PREFETCH_AHEAD + o),
			     _MM_HINT_T0);
}

/* Elements of `size` bytes before p reaches a STREAM_LINE boundary, at most n. */
ALWAYS_INLINE size_t stream_head(const void *p, size_t size, size_t n)
{
	size_t head =
		((STREAM_LINE - ((uintptr_t)p & (STREAM_LINE - 1))) & (STREAM_LINE - 1)) / size;

	return head < n ? head : n;
}

AVX512_TARGET ALWAYS_INLINE __m512i join_256(__m256i lo, __m256i hi)
{
	return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

AVX512_TARGET static void bf16_store_stream_avx512(uint16_t *restrict d, const float *restrict s,
						   size_t n)
{
	size_t i = stream_head(d, sizeof(*d), n);

	bf16_store_avx512(d, s, i);
	for (; i + 32 <= n; i += 32) {
		stream_prefetch(s + i, 2 * STREAM_LINE);
		_mm512_stream_si512((void *)(d + i),
				    join_256(bf16_narrow_512(_mm512_loadu_ps(s + i)),
					     bf16_narrow_512(_mm512_loadu_ps(s + i + 16))));
	}
	bf16_store_avx512(d + i, s + i, n - i);
}

/* The same with AVX512_BF16's conversion (bf16_narrow32_ne_512): the same bits. */
AVX512_BF16_TARGET static void bf16_store_stream_avx512bf16(uint16_t *restrict d,
							    const float *restrict s, size_t n)
{
	size_t i = stream_head(d, sizeof(*d), n);

	bf16_store_avx512bf16(d, s, i);
	for (; i + 32 <= n; i += 32) {
		stream_prefetch(s + i, 2 * STREAM_LINE);
		_mm512_stream_si512(
			(void *)(d + i),
			bf16_narrow32_ne_512(_mm512_loadu_ps(s + i), _mm512_loadu_ps(s + i + 16)));
	}
	bf16_store_avx512bf16(d + i, s + i, n - i);
}

/* vcvtps2ph with the F16C loops' rounding immediate: the same bits. */
AVX512_TARGET static void f16_store_stream_avx512(uint16_t *restrict d, const float *restrict s,
						  size_t n)
{
	size_t i = stream_head(d, sizeof(*d), n);

	f16_store(d, s, i);
	for (; i + 32 <= n; i += 32) {
		stream_prefetch(s + i, 2 * STREAM_LINE);
		_mm512_stream_si512(
			(void *)(d + i),
			join_256(_mm512_cvtps_ph(_mm512_loadu_ps(s + i), F16C_ROUND),
				 _mm512_cvtps_ph(_mm512_loadu_ps(s + i + 16), F16C_ROUND)));
	}
	f16_store(d + i, s + i, n - i);
}

AVX512_TARGET static void copy_stream_avx512(char *restrict d, const char *restrict s, size_t bytes)
{
	size_t i = stream_head(d, 1, bytes);

	memcpy(d, s, i);
	for (; i + STREAM_LINE <= bytes; i += STREAM_LINE) {
		stream_prefetch(s + i, STREAM_LINE);
		_mm512_stream_si512((void *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
	}
	memcpy(d + i, s + i, bytes - i);
}

/*
 * The same three in AVX2, for CPUs without AVX-512 (the CI VM's Zen 3): a
 * line is two 32-byte streaming stores. Without them a large unshard
 * there wrote its output with plain stores (70 - 88 % of the copy
 * roofline at 64 - 256 MiB, docs/BENCHMARKS.md).
 */
#define AVX2_F16C_TARGET __attribute__((target("avx2,f16c")))

AVX2_TARGET static void bf16_store_stream_avx2(uint16_t *restrict d, const float *restrict s,
					       size_t n)
{
	size_t i = stream_head(d, sizeof(*d), n);

	bf16_store(d, s, i);
	for (; i + 32 <= n; i += 32) {
		stream_prefetch(s + i, 2 * STREAM_LINE);
		_mm256_stream_si256((__m256i *)(void *)(d + i), bf16_narrow16_avx2(s + i));
		_mm256_stream_si256((__m256i *)(void *)(d + i + 16),
				    bf16_narrow16_avx2(s + i + 16));
	}
	bf16_store(d + i, s + i, n - i);
}

/* s[0..16) to 16 fp16 with the F16C loops' rounding immediate, in order. */
AVX2_F16C_TARGET static inline __m256i f16_narrow16_f16c(const float *s)
{
	return _mm256_set_m128i(_mm256_cvtps_ph(_mm256_loadu_ps(s + 8), F16C_ROUND),
				_mm256_cvtps_ph(_mm256_loadu_ps(s), F16C_ROUND));
}

AVX2_F16C_TARGET static void f16_store_stream_f16c(uint16_t *restrict d, const float *restrict s,
						   size_t n)
{
	size_t i = stream_head(d, sizeof(*d), n);

	f16_store(d, s, i);
	for (; i + 32 <= n; i += 32) {
		stream_prefetch(s + i, 2 * STREAM_LINE);
		_mm256_stream_si256((__m256i *)(void *)(d + i), f16_narrow16_f16c(s + i));
		_mm256_stream_si256((__m256i *)(void *)(d + i + 16), f16_narrow16_f16c(s + i + 16));
	}
	f16_store(d + i, s + i, n - i);
}

AVX2_TARGET static void copy_stream_avx2(char *restrict d, const char *restrict s, size_t bytes)
{
	size_t i = stream_head(d, 1, bytes);

	memcpy(d, s, i);
	for (; i + STREAM_LINE <= bytes; i += STREAM_LINE) {
		stream_prefetch(s + i, STREAM_LINE);
		_mm256_stream_si256((__m256i *)(void *)(d + i),
				    _mm256_loadu_si256((const __m256i *)(const void *)(s + i)));
		_mm256_stream_si256(
			(__m256i *)(void *)(d + i + 32),
			_mm256_loadu_si256((const __m256i *)(const void *)(s + i + 32)));
	}
	memcpy(d + i, s + i, bytes - i);
}
#endif

/* ----------------------------------------------------------- scalars --- */

uint16_t shardd_f32_to_bf16(float f)
{
	return bf16_from_bits(shardd_f32_bits(f));
}

float shardd_bf16_to_f32(uint16_t h)
{
	return shardd_bits_f32(bf16_to_bits(h));
}

uint16_t shardd_f32_to_f16(float f)
{
	return f16_from_bits(shardd_f32_bits(f));
}

float shardd_f16_to_f32(uint16_t h)
{
	return f16_to_f32_portable(h);
}

float shardd_round_to(uint32_t dtype, float f)
{
	switch (dtype) {
	case SHARDD_DTYPE_BF16:
		return shardd_bf16_to_f32(shardd_f32_to_bf16(f));
	case SHARDD_DTYPE_FP16:
		return shardd_f16_to_f32(shardd_f32_to_f16(f));
	default:
		return f;
	}
}

/* ------------------------------------------------------------ blocks --- */

void shardd_k_to_f32(float *dst, const void *src, uint32_t src_dtype, size_t n)
{
	switch (src_dtype) {
	case SHARDD_DTYPE_BF16:
		bf16_load(dst, src, n);
		break;
	case SHARDD_DTYPE_FP16:
		f16_load(dst, src, n);
		break;
	default:
		memcpy(dst, src, n * sizeof(float));
		break;
	}
}

void shardd_k_from_f32(void *dst, uint32_t dst_dtype, const float *src, size_t n)
{
	switch (dst_dtype) {
	case SHARDD_DTYPE_BF16:
		bf16_store(dst, src, n);
		break;
	case SHARDD_DTYPE_FP16:
		f16_store(dst, src, n);
		break;
	default:
		memcpy(dst, src, n * sizeof(float));
		break;
	}
}

void shardd_k_round(float *x, uint32_t dtype, size_t n)
{
	switch (dtype) {
	case SHARDD_DTYPE_BF16:
		bf16_round(x, n);
		break;
	case SHARDD_DTYPE_FP16:
		f16_round(x, n);
		break;
	default:
		break;
	}
}

void shardd_k_cast(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype, size_t n)
{
	size_t dsz = shardd_dtype_size(dst_dtype), ssz = shardd_dtype_size(src_dtype);
	float buf[SHARDD_K_BLOCK];

	if (dst_dtype == src_dtype) {
		if (dst != src)
			memcpy(dst, src, n * dsz);
		return;
	}
	if (src_dtype == SHARDD_DTYPE_FP32) {
		shardd_k_from_f32(dst, dst_dtype, src, n);
		return;
	}
	if (dst_dtype == SHARDD_DTYPE_FP32) {
		shardd_k_to_f32(dst, src, src_dtype, n);
		return;
	}
	/* bf16 <-> fp16: widening is exact, so this rounds once. */
	for (size_t i = 0; i < n; i += SHARDD_K_BLOCK) {
		size_t len = n - i < SHARDD_K_BLOCK ? n - i : SHARDD_K_BLOCK;

		shardd_k_to_f32(buf, (const char *)src + i * ssz, src_dtype, len);
		shardd_k_from_f32((char *)dst + i * dsz, dst_dtype, buf, len);
	}
}

/*
 * The streaming casts: 1 when one did the cast (and fenced), 0 for a dtype
 * pair or CPU it leaves to the plain cast (the widening casts, whose output
 * is rarely the large side of an op; x86 without AVX2).
 */
#ifdef SHARDD_HAVE_X86
static int cast_stream_x86(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype,
			   size_t n)
{
	int wide = have_avx512();

	if (!wide && !have_avx2())
		return 0;
	if (dst_dtype == src_dtype) {
		if (dst != src)
			(wide ? copy_stream_avx512
			      : copy_stream_avx2)(dst, src, n * shardd_dtype_size(dst_dtype));
	} else if (src_dtype == SHARDD_DTYPE_FP32 && dst_dtype == SHARDD_DTYPE_BF16) {
		(have_avx512_bf16() ? bf16_store_stream_avx512bf16
		 : wide             ? bf16_store_stream_avx512
				    : bf16_store_stream_avx2)(dst, src, n);
	} else if (src_dtype == SHARDD_DTYPE_FP32 && dst_dtype == SHARDD_DTYPE_FP16 &&
		   (wide || have_f16c())) {
		(wide ? f16_store_stream_avx512 : f16_store_stream_f16c)(dst, src, n);
	} else {
		return 0;
	}
	/*
	 * Streaming stores are weakly ordered: without this fence they may
	 * become visible after a later store, such as the lock release or
	 * completion that tells another thread or process the output is ready.
	 */
	_mm_sfence();
	return 1;
}
#endif

void shardd_k_cast_stream(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype,
			  size_t n)
{
#ifdef SHARDD_HAVE_X86
	if (cast_stream_x86(dst, dst_dtype, src, src_dtype, n))
		return;
#endif
	shardd_k_cast(dst, dst_dtype, src, src_dtype, n);
}

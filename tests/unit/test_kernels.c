/* SPDX-License-Identifier: MIT */
/*
 * CPU kernels against independent references: rounding computed in double
 * precision with nearbyint (round to nearest even), fp16 decoded from its
 * fields with ldexp, hand-picked bit patterns, plain index loops for
 * chunk-cat, a double-precision loop for the reduce formula, and the
 * seed's loop for the divide factors.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "optim_isa.h"
#include "shardd_kernels.h"
#include "shardd_proto.h"
#include "xorshift.h"

static const uint32_t dtypes[] = { SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16 };

/* ------------------------------------------------------------ helpers --- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
	return xorshift64s(&rng_state);
}

/* Precision (significant bits), smallest normal exponent and overflow exponent, in frexp terms. */
static void dtype_format(uint32_t dtype, int *bits, int *emin, int *emax)
{
	switch (dtype) {
	case SHARDD_DTYPE_BF16:
		*bits = 8;
		*emin = -125;
		*emax = 128;
		break;
	case SHARDD_DTYPE_FP16:
		*bits = 11;
		*emin = -13;
		*emax = 16;
		break;
	default:
		*bits = 24;
		*emin = -125;
		*emax = 128;
		break;
	}
}

/* Round v to dtype, to nearest even, in double precision: the reference for every cast. */
static double ref_round(uint32_t dtype, double v)
{
	int bits, emin, emax, e;
	double ulp, q;

	if (v == 0 || isnan(v) || isinf(v))
		return v;
	dtype_format(dtype, &bits, &emin, &emax);
	frexp(v, &e);
	if (e < emin)
		e = emin;
	ulp = ldexp(1.0, e - bits);
	q = nearbyint(v / ulp) * ulp;
	if (fabs(q) >= ldexp(1.0, emax))
		return copysign(INFINITY, v);
	return q == 0 ? copysign(0.0, v) : q;
}

/* One unit in the last place of dtype at magnitude |v|. */
static double ref_ulp(uint32_t dtype, double v)
{
	int bits, emin, emax, e;

	dtype_format(dtype, &bits, &emin, &emax);
	frexp(v, &e);
	if (e < emin)
		e = emin;
	return ldexp(1.0, e - bits);
}

static double ref_f16_decode(uint16_t h)
{
	int e = (h >> 10) & 0x1f, m = h & 0x3ff;
	double v;

	if (e == 0x1f)
		v = m ? NAN : INFINITY;
	else if (e == 0)
		v = ldexp(m, -24);
	else
		v = ldexp(1024 + m, e - 25);
	return (h & 0x8000) ? -v : v;
}

/* fp16 bits of a value already representable in fp16 (or Inf). */
static uint16_t ref_f16_encode(double q)
{
	uint16_t sign = signbit(q) ? 0x8000 : 0;
	double a = fabs(q);
	int e;

	if (isinf(a))
		return sign | 0x7c00;
	if (a < ldexp(1.0, -14))
		return sign | (uint16_t)(a * ldexp(1.0, 24));
	frexp(a, &e);
	return sign | (uint16_t)((e + 14) << 10) | (uint16_t)(ldexp(a, 11 - e) - 1024);
}

/* Value of element i of a buffer of dtype. */
static double load(uint32_t dtype, const void *buf, size_t i)
{
	switch (dtype) {
	case SHARDD_DTYPE_BF16:
		return shardd_bf16_widen(((const uint16_t *)buf)[i]);
	case SHARDD_DTYPE_FP16:
		return ref_f16_decode(((const uint16_t *)buf)[i]);
	default:
		return ((const float *)buf)[i];
	}
}

/* Store a value already representable in dtype. */
static void store(uint32_t dtype, void *buf, size_t i, double v)
{
	switch (dtype) {
	case SHARDD_DTYPE_BF16:
		((uint16_t *)buf)[i] = shardd_bf16_truncate((float)v);
		break;
	case SHARDD_DTYPE_FP16:
		((uint16_t *)buf)[i] = ref_f16_encode(v);
		break;
	default:
		((float *)buf)[i] = (float)v;
		break;
	}
}

/* A random fp32 bit pattern, biased toward the interesting exponents. */
static float random_float(void)
{
	uint64_t r = rng();
	uint32_t u = (uint32_t)r;

	switch ((r >> 32) % 4) {
	case 0: /* anything, NaN and Inf included */
		break;
	case 1: /* around fp16's normal range and its subnormals */
		u = (u & 0x807fffffu) | ((uint32_t)(100 + (r >> 40) % 45) << 23);
		break;
	case 2: /* exactly on a rounding tie of bf16 or fp16 */
		u = (u & 0xffff0000u) | ((r >> 40) & 1 ? 0x8000u : 0x1000u);
		u = (u & 0x807fffffu) | ((uint32_t)(110 + (r >> 41) % 30) << 23);
		break;
	default: /* near the top of fp16 */
		u = (u & 0x807fffffu) | (142u << 23);
		break;
	}
	return shardd_bits_f32(u);
}

/* ------------------------------------------------------------ casts --- */

Test(cast, bf16_hand_picked_patterns_round_to_nearest_even, .timeout = 5)
{
	static const struct {
		uint32_t in;
		uint16_t out;
	} cases[] = {
		{ 0x3f800000u, 0x3f80 }, /* 1.0 */
		{ 0x3f808000u, 0x3f80 }, /* tie, even below */
		{ 0x3f818000u, 0x3f82 }, /* tie, even above */
		{ 0x3f808001u, 0x3f81 }, /* just past the tie */
		{ 0x3f807fffu, 0x3f80 }, /* just below the tie */
		{ 0x80000000u, 0x8000 }, /* -0 */
		{ 0x7f800000u, 0x7f80 }, /* Inf */
		{ 0xff800000u, 0xff80 }, /* -Inf */
		{ 0x7f7fffffu, 0x7f80 }, /* largest fp32 rounds up to Inf */
		{ 0x7f7f7fffu, 0x7f7f }, /* stays finite */
		{ 0x00000001u, 0x0000 }, /* smallest subnormal rounds to 0 */
		{ 0x00008000u, 0x0000 }, /* subnormal tie to even 0 */
		{ 0x00018000u, 0x0002 }, /* subnormal tie to even 2 */
		{ 0x7fc00000u, 0x7fc0 }, /* quiet NaN */
		{ 0x7f800001u, 0x7fc0 }, /* signalling NaN, payload only low: quiet NaN, not Inf */
		{ 0xffa00000u, 0xffe0 }, /* negative sNaN with payload: quieted */
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		cr_expect_eq(shardd_f32_to_bf16(shardd_bits_f32(cases[i].in)), cases[i].out,
			     "f32 0x%08x -> bf16 0x%04x, want 0x%04x", cases[i].in,
			     shardd_f32_to_bf16(shardd_bits_f32(cases[i].in)), cases[i].out);
}

Test(cast, f16_hand_picked_patterns_round_to_nearest_even, .timeout = 5)
{
	static const struct {
		float in;
		uint16_t out;
	} cases[] = {
		{ 1.0f, 0x3c00 },
		{ -2.0f, 0xc000 },
		{ 65504.0f, 0x7bff }, /* largest finite */
		{ 65519.0f, 0x7bff }, /* below the tie with 2^16 */
		{ 65520.0f, 0x7c00 }, /* the tie: odd mantissa, overflows to Inf */
		{ 1e10f, 0x7c00 },    /* overflow */
		{ -1e10f, 0xfc00 },
		{ 0x1p-14f, 0x0400 },        /* smallest normal */
		{ 0x1.ff8p-15f, 0x03ff },    /* largest subnormal, exact */
		{ 0x1.ffcp-15f, 0x0400 },    /* rounds up into the smallest normal */
		{ 0x1p-24f, 0x0001 },        /* smallest subnormal */
		{ 0x1p-25f, 0x0000 },        /* tie between 0 and 2^-24: even 0 */
		{ 0x1.8p-24f, 0x0002 },      /* tie between 1 and 2 ulps: even 2 */
		{ 0x1.000002p-25f, 0x0001 }, /* just past the tie */
		{ 0x1p-30f, 0x0000 },
		{ -0.0f, 0x8000 },
		{ 0x1.002p0f, 0x3c00 }, /* tie at 1 + 2^-11, even below */
		{ 0x1.006p0f, 0x3c02 }, /* tie at 1 + 3 * 2^-11, even above */
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		cr_expect_eq(shardd_f32_to_f16(cases[i].in), cases[i].out,
			     "%a -> fp16 0x%04x, want 0x%04x", (double)cases[i].in,
			     shardd_f32_to_f16(cases[i].in), cases[i].out);
	cr_expect_eq(shardd_f32_to_f16(INFINITY), 0x7c00);
	cr_expect_eq(shardd_f32_to_f16(-INFINITY), 0xfc00);
	cr_expect_eq(shardd_f32_to_f16(shardd_bits_f32(0x7f800001u)) & 0x7e00, 0x7e00,
		     "sNaN must become a quiet NaN");
	cr_expect_eq(shardd_f32_to_f16(shardd_bits_f32(0xffc00000u)), 0xfe00);
}

Test(cast, f16_to_f32_is_exact_for_every_pattern, .timeout = 10)
{
	uint16_t *h = malloc(65536 * sizeof(*h));
	float *blk = malloc(65536 * sizeof(*blk));

	for (uint32_t i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	/* The block path (F16C where the CPU has it) and the scalar path. */
	shardd_k_cast(blk, SHARDD_DTYPE_FP32, h, SHARDD_DTYPE_FP16, 65536);
	for (uint32_t i = 0; i < 65536; i++) {
		double want = ref_f16_decode((uint16_t)i);
		float s = shardd_f16_to_f32((uint16_t)i);

		if (isnan(want)) {
			cr_assert(isnan(s) && isnan(blk[i]), "fp16 0x%04x must decode to NaN", i);
			cr_assert(shardd_f32_bits(s) & 0x00400000u,
				  "fp16 0x%04x: NaN must come back quiet", i);
			cr_assert_eq(shardd_f32_bits(s), shardd_f32_bits(blk[i]),
				     "fp16 0x%04x: scalar 0x%08x, block 0x%08x", i,
				     shardd_f32_bits(s), shardd_f32_bits(blk[i]));
			continue;
		}
		cr_assert(s == want && !signbit(s) == !signbit(want), "fp16 0x%04x: %a, want %a", i,
			  (double)s, want);
		cr_assert_eq(shardd_f32_bits(s), shardd_f32_bits(blk[i]),
			     "fp16 0x%04x: block 0x%08x", i, shardd_f32_bits(blk[i]));
	}
	free(h);
	free(blk);
}

Test(cast, bf16_to_f32_is_exact_for_every_pattern, .timeout = 10)
{
	uint16_t *h = malloc(65536 * sizeof(*h));
	float *blk = malloc(65536 * sizeof(*blk));

	for (uint32_t i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	shardd_k_cast(blk, SHARDD_DTYPE_FP32, h, SHARDD_DTYPE_BF16, 65536);
	for (uint32_t i = 0; i < 65536; i++) {
		uint32_t want = i << 16;

		if ((i & 0x7fff) > 0x7f80) /* NaN: quiet bit set, rest kept */
			want |= 0x00400000u;
		cr_assert_eq(shardd_f32_bits(shardd_bf16_to_f32((uint16_t)i)), want, "bf16 0x%04x",
			     i);
		cr_assert_eq(shardd_f32_bits(blk[i]), want, "bf16 0x%04x (block)", i);
	}
	free(h);
	free(blk);
}

/* Expected 16-bit pattern of f rounded to dtype, from the double reference. */
static uint16_t ref_bits16(uint32_t dtype, float f)
{
	double q = ref_round(dtype, f);

	if (dtype == SHARDD_DTYPE_FP16)
		return ref_f16_encode(q);
	return shardd_bf16_truncate((float)q);
}

Test(cast, random_f32_round_like_the_double_reference, .timeout = 20)
{
	enum {
		N = 1 << 18
	};
	float *f = malloc(N * sizeof(*f));
	uint16_t *b = malloc(N * sizeof(*b)), *h = malloc(N * sizeof(*h));

	for (size_t i = 0; i < N; i++)
		f[i] = random_float();
	shardd_k_cast(b, SHARDD_DTYPE_BF16, f, SHARDD_DTYPE_FP32, N);
	shardd_k_cast(h, SHARDD_DTYPE_FP16, f, SHARDD_DTYPE_FP32, N);
	for (size_t i = 0; i < N; i++) {
		uint16_t sb = shardd_f32_to_bf16(f[i]), sh = shardd_f32_to_f16(f[i]);

		/* Block and scalar paths give the same bits, NaNs included. */
		cr_assert_eq(b[i], sb, "f32 0x%08x: bf16 block 0x%04x scalar 0x%04x",
			     shardd_f32_bits(f[i]), b[i], sb);
		cr_assert_eq(h[i], sh, "f32 0x%08x: fp16 block 0x%04x scalar 0x%04x",
			     shardd_f32_bits(f[i]), h[i], sh);
		if (isnan(f[i])) {
			cr_assert((sb & 0x7fc0) == 0x7fc0,
				  "f32 0x%08x: bf16 must be a quiet NaN, got 0x%04x",
				  shardd_f32_bits(f[i]), sb);
			cr_assert((sh & 0x7e00) == 0x7e00,
				  "f32 0x%08x: fp16 must be a quiet NaN, got 0x%04x",
				  shardd_f32_bits(f[i]), sh);
			continue;
		}
		cr_assert_eq(sb, ref_bits16(SHARDD_DTYPE_BF16, f[i]),
			     "f32 %a -> bf16 0x%04x, want 0x%04x", (double)f[i], sb,
			     ref_bits16(SHARDD_DTYPE_BF16, f[i]));
		cr_assert_eq(sh, ref_bits16(SHARDD_DTYPE_FP16, f[i]),
			     "f32 %a -> fp16 0x%04x, want 0x%04x", (double)f[i], sh,
			     ref_bits16(SHARDD_DTYPE_FP16, f[i]));
		cr_assert_eq(shardd_f32_bits(shardd_round_to(SHARDD_DTYPE_FP16, f[i])),
			     shardd_f32_bits((float)ref_round(SHARDD_DTYPE_FP16, f[i])));
		cr_assert_eq(shardd_f32_bits(shardd_round_to(SHARDD_DTYPE_BF16, f[i])),
			     shardd_f32_bits((float)ref_round(SHARDD_DTYPE_BF16, f[i])));
	}
	free(f);
	free(b);
	free(h);
}

Test(cast, every_dtype_pair_and_odd_lengths_match_the_reference, .timeout = 10)
{
	static const size_t lens[] = { 0, 1, 7, 8, 9, 511, 512, 513, 1500 };
	float src32[1500];
	uint8_t src[1500 * 4], dst[1500 * 4 + 8];

	for (size_t i = 0; i < 1500; i++)
		src32[i] = (float)((double)(int64_t)(rng() % 2000001) / 1000.0 - 1000.0);
	for (size_t a = 0; a < 3; a++) {
		for (size_t b = 0; b < 3; b++) {
			uint32_t sd = dtypes[a], dd = dtypes[b];

			for (size_t i = 0; i < 1500; i++)
				store(sd, src, i, ref_round(sd, src32[i]));
			for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++) {
				size_t n = lens[l], dsz = shardd_dtype_size(dd);

				memset(dst, 0xab, sizeof(dst));
				shardd_k_cast(dst, dd, src, sd, n);
				for (size_t i = 0; i < n; i++) {
					double want = ref_round(dd, load(sd, src, i));

					cr_assert_eq(load(dd, dst, i), want,
						     "%s -> %s n=%zu [%zu]: %a, want %a",
						     shardd_dtype_name(sd), shardd_dtype_name(dd),
						     n, i, load(dd, dst, i), want);
				}
				/* Nothing past n is written. */
				cr_assert_eq(dst[n * dsz], 0xab,
					     "%s -> %s n=%zu wrote past the end",
					     shardd_dtype_name(sd), shardd_dtype_name(dd), n);
			}
		}
	}
}

Test(cast, stream_equals_plain_cast_on_odd_lengths_and_misaligned_pointers, .timeout = 20)
{
	static const size_t lens[] = { 0, 1, 15, 31, 32, 33, 63, 64, 65, 1000, 4099 };
	enum {
		MAXN = 4099,
		GUARD = 64
	};
	uint8_t *src = malloc(MAXN * 4 + 64), *plain = malloc(MAXN * 4 + 2 * GUARD + 64);
	uint8_t *streamed = malloc(MAXN * 4 + 2 * GUARD + 64);

	for (size_t i = 0; i < MAXN * 4 + 64; i += 4) {
		uint32_t u = shardd_f32_bits(random_float());

		memcpy(src + i, &u, 4);
	}
	for (size_t a = 0; a < 3; a++)
		for (size_t b = 0; b < 3; b++)
			for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++)
				for (size_t off = 0; off < 64; off += 2) {
					uint32_t sd = dtypes[a], dd = dtypes[b];
					size_t n = lens[l], ssz = shardd_dtype_size(sd),
					       dsz = shardd_dtype_size(dd);
					/* Offsets of whole elements: dst from every alignment to a cache line, src shifted too. */
					size_t doff = off / dsz * dsz,
					       soff = (off * 3) % 64 / ssz * ssz;
					size_t bytes = n * dsz + 2 * GUARD;

					memset(plain, 0xab, bytes + doff);
					memset(streamed, 0xab, bytes + doff);
					shardd_k_cast(plain + GUARD + doff, dd, src + soff, sd, n);
					shardd_k_cast_stream(streamed + GUARD + doff, dd,
							     src + soff, sd, n);
					/* Guards included: nothing outside [0, n) is written. */
					cr_assert(
						memcmp(plain, streamed, bytes + doff) == 0,
						"%s -> %s n=%zu dst offset %zu src offset %zu: streamed bytes differ",
						shardd_dtype_name(sd), shardd_dtype_name(dd), n,
						doff, soff);
					for (size_t i = 0; i < GUARD + doff; i++)
						cr_assert_eq(streamed[i], 0xab,
							     "%s -> %s n=%zu wrote before dst",
							     shardd_dtype_name(sd),
							     shardd_dtype_name(dd), n);
					for (size_t i = GUARD + doff + n * dsz; i < bytes + doff;
					     i++)
						cr_assert_eq(streamed[i], 0xab,
							     "%s -> %s n=%zu wrote past the end",
							     shardd_dtype_name(sd),
							     shardd_dtype_name(dd), n);
				}
	free(src);
	free(plain);
	free(streamed);
}

Test(cast, zero_clears_exactly_the_range, .timeout = 5)
{
	uint8_t buf[300];

	memset(buf, 0x5a, sizeof(buf));
	shardd_k_zero(buf + 3, 290);
	for (size_t i = 0; i < sizeof(buf); i++)
		cr_assert_eq(buf[i], i >= 3 && i < 293 ? 0 : 0x5a, "byte %zu", i);
}

/* -------------------------------------------------------- chunk-cat --- */

Test(chunk_cat, interleaves_chunks_like_index_loops, .timeout = 10)
{
	static const uint32_t nchunks_list[] = { 1, 2, 3, 5 };
	static const size_t outer_list[] = { 1, 2, 4 };
	static const size_t inner_list[] = { 1, 7, 600 };

	for (size_t a = 0; a < 3; a++)
		for (size_t b = 0; b < 3; b++)
			for (size_t c = 0; c < 4; c++)
				for (size_t d = 0; d < 3; d++)
					for (size_t e = 0; e < 3; e++) {
						uint32_t sd = dtypes[a], dd = dtypes[b],
							 nch = nchunks_list[c];
						size_t outer = outer_list[d], inner = inner_list[e];
						size_t per = outer * inner;
						void *src[5];
						uint8_t *dst = malloc(nch * per * 4);

						for (uint32_t r = 0; r < nch; r++) {
							src[r] = malloc(per * 4);
							for (size_t i = 0; i < per; i++)
								store(sd, src[r], i,
								      ref_round(
									      sd,
									      (double)(rng() %
										       100000) /
											      64.0 -
										      700.0));
						}
						shardd_k_chunk_cat(dst, dd,
								   (const void *const *)src, sd,
								   nch, outer, inner);
						for (size_t o = 0; o < outer; o++)
							for (uint32_t r = 0; r < nch; r++)
								for (size_t k = 0; k < inner; k++) {
									double want = ref_round(
										dd,
										load(sd, src[r],
										     o * inner +
											     k));
									double got =
										load(dd, dst,
										     (o * nch +
										      r) * inner +
											     k);

									cr_assert_eq(
										got, want,
										"%s->%s nch=%u outer=%zu inner=%zu [%zu,%u,%zu]",
										shardd_dtype_name(
											sd),
										shardd_dtype_name(
											dd),
										nch, outer, inner,
										o, r, k);
								}
						for (uint32_t r = 0; r < nch; r++)
							free(src[r]);
						free(dst);
					}
}

/*
 * Every bit pattern of a dtype, NaN payloads (quiet and signalling, both
 * signs) included, wherever the element count reaches: the sources of the
 * same-dtype copies below.
 */
static void fill_every_pattern(uint32_t dtype, void *buf, size_t n)
{
	/* fp32's signalling and quiet NaNs, payload low and high, both signs; then any bits. */
	static const uint32_t nan32[] = { 0x7f800001u, 0xff800001u, 0x7fa00000u,
					  0x7fc00001u, 0xffffffffu, 0x7fbfffffu };

	for (size_t i = 0; i < n; i++) {
		if (dtype != SHARDD_DTYPE_FP32) {
			((uint16_t *)buf)[i] = (uint16_t)(i * 40503u);
		} else {
			uint32_t u =
				i < sizeof(nan32) / sizeof(nan32[0]) ? nan32[i] : (uint32_t)rng();

			memcpy((uint32_t *)buf + i, &u, sizeof(u));
		}
	}
}

/*
 * A same-dtype chunk_cat and cast (plain and streaming) are copies: every
 * bit survives, a NaN's payload and its signalling bit too. bf16 and fp16
 * run all 65536 patterns (i * 40503 mod 2^16 is a permutation); the GPU
 * test compares the CUDA kernels with these bits (tests/gpu/test_cuda_kernels.c).
 */
Test(chunk_cat, same_dtype_keeps_every_bit_including_nan_payloads, .timeout = 10)
{
	const size_t n = 65536 + 3, half = n / 2 + 1;

	for (size_t a = 0; a < 3; a++) {
		uint32_t dt = dtypes[a];
		size_t sz = shardd_dtype_size(dt);
		char *src = malloc(n * sz), *got = malloc(n * sz + 1), *want = malloc(n * sz);
		const void *chunks[2] = { src, src + half * sz };
		const void *one[1] = { src };

		fill_every_pattern(dt, src, n);
		/* Two chunks of `half` rows of one element: dst interleaves them. */
		for (size_t o = 0; o < n - half; o++) {
			memcpy(want + (2 * o) * sz, src + o * sz, sz);
			memcpy(want + (2 * o + 1) * sz, src + (half + o) * sz, sz);
		}
		shardd_k_chunk_cat(got, dt, chunks, dt, 2, n - half, 1);
		cr_assert_eq(memcmp(got, want, 2 * (n - half) * sz), 0,
			     "chunk_cat %s->%s, 2 chunks: bits changed", shardd_dtype_name(dt),
			     shardd_dtype_name(dt));
		shardd_k_chunk_cat(got, dt, one, dt, 1, 1, n);
		cr_assert_eq(memcmp(got, src, n * sz), 0, "chunk_cat %s->%s, 1 chunk: bits changed",
			     shardd_dtype_name(dt), shardd_dtype_name(dt));
		shardd_k_cast(got, dt, src, dt, n);
		cr_assert_eq(memcmp(got, src, n * sz), 0, "cast %s->%s: bits changed",
			     shardd_dtype_name(dt), shardd_dtype_name(dt));
		/* The streaming copy from a misaligned destination. */
		shardd_k_cast_stream(got + 1, dt, src, dt, n);
		cr_assert_eq(memcmp(got + 1, src, n * sz), 0, "cast_stream %s->%s: bits changed",
			     shardd_dtype_name(dt), shardd_dtype_name(dt));
		free(src);
		free(got);
		free(want);
	}
}

/* ------------------------------------------------------------ reduce --- */

/*
 * The formula of shardd_k_reduce, in double, rounding to a dtype wherever
 * the formula says round_rd or cast_out.
 */
static double ref_reduce(double *in, uint32_t nin, uint32_t rd, uint32_t od,
			 const struct shardd_reduce_math *m, int has_add, double add,
			 int accumulate, double out)
{
	double s = 0, v;

	for (uint32_t k = 0; k < nin; k++) {
		double x = ref_round(rd, in[k]);

		if (m->pre > 1)
			x = ref_round(rd, x / m->pre);
		s = k == 0 ? x : s + x;
	}
	s = ref_round(rd, s / m->avg);
	if (has_add)
		s = ref_round(rd, s + add);
	if (m->post > 1)
		s = ref_round(rd, s / m->post);
	v = ref_round(od, s);
	return accumulate ? ref_round(od, out + v) : v;
}

static int is_pow2(float f)
{
	int e;

	return frexp(f, &e) == 0.5;
}

/*
 * Inputs are multiples of 2^-8 below 16 in magnitude (13 bits) and
 * pre-divide factors are powers of two up to 64, so each x_k fits in 21
 * bits and the sum of up to 8 of them is exact in fp32 as in double; adds
 * of two values of a dtype are exact or far from a tie. What is left is a
 * divide by a factor that is not a power of two (avg, or post such as 1.5):
 * the kernel rounds the quotient to fp32 and then to reduce_dtype, the
 * reference rounds once, and the two can differ by one ulp of reduce_dtype
 * at a tie. That ulp can carry into the output as one ulp of the output
 * dtype, and an accumulate adds one more rounding. So: exact equality when
 * every divide is by a power of two, else this many ulps.
 */
static double reduce_tolerance(uint32_t rd, uint32_t od, const struct shardd_reduce_math *m,
			       int accumulate, double ref)
{
	int ndiv = (m->avg != 1 && !is_pow2(m->avg)) + (m->post > 1 && !is_pow2(m->post));
	double a = fabs(ref);

	if (!ndiv)
		return 0;
	return ndiv * (2 * ref_ulp(rd, a) + ref_ulp(od, a)) + (accumulate ? ref_ulp(od, a) : 0);
}

static void check_reduce(uint32_t idt, uint32_t rd, uint32_t od, uint32_t nin, size_t n, float pre,
			 float avg, float post, int with_add, int accumulate)
{
	size_t isz = shardd_dtype_size(idt), osz = shardd_dtype_size(od),
	       rsz = shardd_dtype_size(rd);
	void *in[8];
	uint8_t *add = with_add ? malloc(n * rsz) : NULL;
	uint8_t *out = malloc(n * osz + 4);
	double *before = malloc(n * sizeof(double));
	struct shardd_reduce_math m = {
		.reduce_dtype = rd, .pre = pre, .avg = avg, .add = add, .post = post
	};

	for (uint32_t k = 0; k < nin; k++) {
		in[k] = malloc(n * isz);
		for (size_t i = 0; i < n; i++)
			store(idt, in[k], i,
			      ref_round(idt, ldexp((double)((int64_t)(rng() % 8191) - 4095), -8)));
	}
	for (size_t i = 0; i < n; i++) {
		if (add)
			store(rd, add, i,
			      ref_round(rd, ldexp((double)((int64_t)(rng() % 8191) - 4095), -8)));
		store(od, out, i,
		      ref_round(od, ldexp((double)((int64_t)(rng() % 8191) - 4095), -8)));
		before[i] = load(od, out, i);
	}
	memset(out + n * osz, 0xcd, 4);

	shardd_k_reduce(out, od, accumulate, (const void *const *)in, nin, idt, n, &m);

	for (size_t i = 0; i < n; i++) {
		double x[8], want, got, tol;

		for (uint32_t k = 0; k < nin; k++)
			x[k] = load(idt, in[k], i);
		want = ref_reduce(x, nin, rd, od, &m, add != NULL, add ? load(rd, add, i) : 0,
				  accumulate, before[i]);
		got = load(od, out, i);
		tol = reduce_tolerance(rd, od, &m, accumulate, want);
		cr_assert(
			fabs(got - want) <= tol,
			"in %s rd %s out %s nin=%u n=%zu pre=%g avg=%g post=%g add=%d acc=%d [%zu]: %a, want %a (tol %a)",
			shardd_dtype_name(idt), shardd_dtype_name(rd), shardd_dtype_name(od), nin,
			n, (double)pre, (double)avg, (double)post, with_add, accumulate, i, got,
			want, tol);
	}
	for (int b = 0; b < 4; b++)
		cr_assert_eq(out[n * osz + b], 0xcd, "reduce wrote past n=%zu", n);
	for (uint32_t k = 0; k < nin; k++)
		free(in[k]);
	free(add);
	free(out);
	free(before);
}

Test(reduce, matches_double_reference_for_every_dtype_and_option, .timeout = 60)
{
	static const struct {
		float pre, avg, post;
	} maths[] = {
		{ 1, 1, 1 },    /* plain sum */
		{ 1, 4, 1 },    /* AVG over a power of two: exact */
		{ 1, 6, 1 },    /* AVG over 6 */
		{ 4, 1, 1.5f }, /* fp16 factors for N = 6 */
		{ 8, 1, 8 },    /* fp16 factors for N = 64 */
	};
	static const size_t lens[] = { 1, 37, 512, 1029 };

	for (uint32_t nin = 1; nin <= 8; nin++)
		for (size_t a = 0; a < 3; a++)
			for (size_t b = 0; b < 3; b++)
				for (size_t c = 0; c < 3; c++)
					for (size_t mi = 0; mi < sizeof(maths) / sizeof(maths[0]);
					     mi++)
						for (int opt = 0; opt < 4; opt++) {
							/* Lengths rotate so every combination still sees odd and multi-block sizes. */
							size_t n = lens[(nin + a + b + c + mi +
									 (size_t)opt) %
									4];

							check_reduce(dtypes[a], dtypes[b],
								     dtypes[c], nin, n,
								     maths[mi].pre, maths[mi].avg,
								     maths[mi].post, opt & 1,
								     (opt >> 1) & 1);
						}
}

Test(reduce, fp16_uses_runtime_divide_factors_to_stay_in_range, .timeout = 5)
{
	/* N = 6: pre 4, post 1.5. Six ranks of 30000 sum to 180000, past fp16's 65504. */
	uint16_t in[6][3], out[3];
	const void *ptrs[6];
	double pre, post;
	struct shardd_reduce_math m;

	shardd_divide_factors(6, SHARDD_DTYPE_FP16, &pre, &post);
	m = (struct shardd_reduce_math){
		.reduce_dtype = SHARDD_DTYPE_FP16, .pre = (float)pre, .avg = 1, .post = (float)post
	};
	for (int k = 0; k < 6; k++) {
		for (int i = 0; i < 3; i++)
			in[k][i] = ref_f16_encode(30000.0);
		ptrs[k] = in[k];
	}
	shardd_k_reduce(out, SHARDD_DTYPE_FP16, 0, ptrs, 6, SHARDD_DTYPE_FP16, 3, &m);
	for (int i = 0; i < 3; i++)
		cr_expect_eq(out[i], ref_f16_encode(30000.0), "[%d] 0x%04x, want 30000 (0x%04x)", i,
			     out[i], ref_f16_encode(30000.0));

	/* Without the factors the fp16 sum overflows, as it would on the wire. */
	m.pre = 1;
	m.post = 1;
	shardd_k_reduce(out, SHARDD_DTYPE_FP16, 0, ptrs, 6, SHARDD_DTYPE_FP16, 3, &m);
	cr_expect_eq(out[0], 0x7c00, "unscaled fp16 sum of 180000 must be Inf, got 0x%04x", out[0]);
}

Test(reduce, nan_inf_and_negative_zero_survive, .timeout = 5)
{
	float a[4] = { NAN, INFINITY, -0.0f, -INFINITY };
	float b[4] = { 1.0f, 1.0f, -0.0f, 2.0f };
	const void *ptrs[2] = { a, b };
	uint16_t bf[4];
	float f[4];
	struct shardd_reduce_math m = {
		.reduce_dtype = SHARDD_DTYPE_BF16, .pre = 1, .avg = 2, .post = 1
	};

	shardd_k_reduce(bf, SHARDD_DTYPE_BF16, 0, ptrs, 2, SHARDD_DTYPE_FP32, 4, &m);
	cr_expect((bf[0] & 0x7fc0) == 0x7fc0, "NaN in, quiet NaN out: 0x%04x", bf[0]);
	cr_expect_eq(bf[1], 0x7f80, "Inf stays Inf: 0x%04x", bf[1]);
	cr_expect_eq(bf[2], 0x8000, "-0 + -0 is -0: 0x%04x", bf[2]);
	cr_expect_eq(bf[3], 0xff80, "-Inf stays -Inf: 0x%04x", bf[3]);

	m.reduce_dtype = SHARDD_DTYPE_FP32;
	shardd_k_reduce(f, SHARDD_DTYPE_FP32, 0, ptrs, 2, SHARDD_DTYPE_FP32, 4, &m);
	cr_expect(isnan(f[0]));
	cr_expect(isinf(f[1]) && f[1] > 0);
	cr_expect(f[2] == 0 && signbit(f[2]));
}

Test(reduce, accumulate_adds_into_output_and_may_alias_add, .timeout = 5)
{
	float in0[5] = { 1, 2, 3, 4, 5 }, in1[5] = { 1, 1, 1, 1, 1 };
	float acc[5] = { 10, 20, 30, 40, 50 };
	const void *ptrs[2] = { in0, in1 };
	struct shardd_reduce_math m = {
		.reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = 2, .add = acc, .post = 1
	};

	/* out == add: s = (in0 + in1) / 2 + acc, then accumulated into acc: 2 acc + s. */
	shardd_k_reduce(acc, SHARDD_DTYPE_FP32, 1, ptrs, 2, SHARDD_DTYPE_FP32, 5, &m);
	for (int i = 0; i < 5; i++) {
		float want = 10.0f * (float)(i + 1) * 2 + ((float)(i + 1) + 1) / 2;

		cr_expect_eq(acc[i], want, "[%d] %g, want %g", i, (double)acc[i], (double)want);
	}
}

Test(reduce, stream_equals_plain_reduce_on_odd_lengths_and_misaligned_outputs, .timeout = 30)
{
	static const size_t lens[] = { 1, 15, 16, 17, 40, 1029 };
	static const struct {
		float pre, avg, post;
	} maths[] = { { 1, 4, 1 }, { 1, 6, 1 }, { 4, 1, 1.5f } };
	enum {
		MAXN = 1029,
		GUARD = 64,
		SLACK = 64
	};
	uint8_t *in[8], *add = malloc(MAXN * 4), *init = malloc(MAXN * 4 + SLACK);
	uint8_t *plain = malloc(MAXN * 4 + 2 * GUARD + SLACK),
		*streamed = malloc(MAXN * 4 + 2 * GUARD + SLACK);

	for (uint32_t k = 0; k < 8; k++) {
		in[k] = malloc(MAXN * 4);
		for (size_t i = 0; i < MAXN; i++)
			store(SHARDD_DTYPE_FP32, in[k], i,
			      ldexp((double)((int64_t)(rng() % 8191) - 4095), -6));
	}
	for (size_t i = 0; i < MAXN; i++)
		store(SHARDD_DTYPE_FP32, add, i,
		      ldexp((double)((int64_t)(rng() % 8191) - 4095), -6));
	for (size_t i = 0; i < MAXN * 4 + SLACK; i++)
		init[i] = (uint8_t)rng();

	for (uint32_t nin = 1; nin <= 8; nin += 1 + (nin >= 2)) /* 1, 2, 4, 6, 8 */
		for (size_t a = 0; a < 3; a++)
			for (size_t b = 0; b < 3; b++)
				for (size_t c = 0; c < 3; c++)
					for (int opt = 0; opt < 4; opt++) {
						uint32_t idt = dtypes[a], rd = dtypes[b],
							 od = dtypes[c];
						size_t osz = shardd_dtype_size(od);
						size_t n =
							lens[(nin + a + b + c + (size_t)opt) % 6];
						/* Output offset in elements: every alignment of a 64-byte vector, rotated. */
						size_t doff = ((nin * 7 + a * 5 + b * 3 + c +
								(size_t)opt) %
							       (64 / osz)) *
							      osz;
						size_t bytes = n * osz + 2 * GUARD + doff;
						const void *ins[8];
						uint8_t inb[8][MAXN * 4];
						uint8_t addb[MAXN * 4];
						struct shardd_reduce_math m = {
							.reduce_dtype = rd,
							.pre = maths[(a + c) % 3].pre,
							.avg = maths[(a + c) % 3].avg,
							.add = (opt & 2) ? addb : NULL,
							.post = maths[(a + c) % 3].post
						};

						/* Inputs in their dtype; the add in reduce_dtype; the old output from random bytes, rounded. */
						for (uint32_t k = 0; k < nin; k++) {
							for (size_t i = 0; i < n; i++)
								store(idt, inb[k], i,
								      ref_round(
									      idt,
									      load(SHARDD_DTYPE_FP32,
										   in[k], i)));
							ins[k] = inb[k];
						}
						for (size_t i = 0; i < n; i++)
							store(rd, addb, i,
							      ref_round(rd, load(SHARDD_DTYPE_FP32,
										 add, i)));
						memset(plain, 0xab, bytes);
						for (size_t i = 0; i < n; i++)
							store(od, plain + GUARD + doff, i,
							      ref_round(od,
									ldexp((double)((int64_t)init
											       [i] -
										       128),
									      -3)));
						memcpy(streamed, plain, bytes);

						shardd_k_reduce(plain + GUARD + doff, od, opt & 1,
								ins, nin, idt, n, &m);
						shardd_k_reduce_stream(streamed + GUARD + doff, od,
								       opt & 1, ins, nin, idt, n,
								       &m);
						cr_assert(
							memcmp(plain, streamed, bytes) == 0,
							"in %s rd %s out %s nin=%u n=%zu out offset %zu acc=%d add=%d: streamed bytes differ",
							shardd_dtype_name(idt),
							shardd_dtype_name(rd),
							shardd_dtype_name(od), nin, n, doff,
							opt & 1, (opt >> 1) & 1);
					}
	for (uint32_t k = 0; k < 8; k++)
		free(in[k]);
	free(add);
	free(init);
	free(plain);
	free(streamed);
}

/* ---------------------------------------------------- divide factors --- */

/* ---------------------------------------------------- isa limits --- */

/*
 * Casts of random fp32 patterns with a subnormal every `gap` elements (a
 * few vectors without one, most with one: AVX512_BF16's conversion reads
 * subnormals as zero, so those vectors take the integer steps), plain and
 * streaming, against the scalar conversions and the double reference.
 */
static void check_casts_against_scalar(const char *path, size_t gap)
{
	enum {
		N = 4099,
		OFF = 3 /* dst off its vector alignment: heads and tails too */
	};
	float *f = malloc(N * sizeof(*f));
	uint16_t *plain = malloc((N + OFF) * sizeof(*plain));
	uint16_t *streamed = malloc((N + OFF) * sizeof(*streamed));
	static const uint32_t narrow[] = { SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16 };

	for (size_t i = 0; i < N; i++)
		f[i] = i % gap == gap / 2 ? shardd_bits_f32((uint32_t)(rng() & 0x807fffffu) | 1u)
					  : random_float();
	for (size_t d = 0; d < 2; d++) {
		uint32_t dt = narrow[d];

		shardd_k_cast(plain + OFF, dt, f, SHARDD_DTYPE_FP32, N);
		shardd_k_cast_stream(streamed + OFF, dt, f, SHARDD_DTYPE_FP32, N);
		for (size_t i = 0; i < N; i++) {
			uint16_t want = dt == SHARDD_DTYPE_BF16 ? shardd_f32_to_bf16(f[i])
								: shardd_f32_to_f16(f[i]);

			cr_assert_eq(plain[OFF + i], want,
				     "%s: f32 0x%08x -> %s 0x%04x, scalar 0x%04x", path,
				     shardd_f32_bits(f[i]), shardd_dtype_name(dt), plain[OFF + i],
				     want);
			cr_assert_eq(streamed[OFF + i], want,
				     "%s: f32 0x%08x -> %s streamed 0x%04x, scalar 0x%04x", path,
				     shardd_f32_bits(f[i]), shardd_dtype_name(dt),
				     streamed[OFF + i], want);
			if (!isnan(f[i]))
				cr_assert_eq(want, ref_bits16(dt, f[i]),
					     "f32 %a -> %s 0x%04x, reference 0x%04x", (double)f[i],
					     shardd_dtype_name(dt), want, ref_bits16(dt, f[i]));
		}
	}
	free(f);
	free(plain);
	free(streamed);
}

Test(isa_limit, every_path_casts_and_reduces_like_the_references, .timeout = 120)
{
	static const size_t gaps[] = { 5, 61, 1000000 };
	static const struct {
		uint32_t idt, rd, od;
	} reduces[] = {
		{ SHARDD_DTYPE_BF16, SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP32 },
		{ SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32 },
		{ SHARDD_DTYPE_FP16, SHARDD_DTYPE_FP16, SHARDD_DTYPE_FP16 },
		{ SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16, SHARDD_DTYPE_BF16 },
	};

	for (int isa = 0; isa < SHARDD_K_ISA_COUNT; isa++) {
		if (!shardd_k_isa_available((enum shardd_k_isa)isa))
			continue;
		shardd_k_isa_set_limit((enum shardd_k_isa)isa);
		cr_assert_eq(shardd_k_isa_limit(), (enum shardd_k_isa)isa);
		cr_assert_eq(shardd_k_isa_best(), (enum shardd_k_isa)isa,
			     "the optimizer's path under limit %s",
			     shardd_k_isa_name((enum shardd_k_isa)isa));
		for (size_t g = 0; g < sizeof(gaps) / sizeof(gaps[0]); g++)
			check_casts_against_scalar(shardd_k_isa_name((enum shardd_k_isa)isa),
						   gaps[g]);
		/* The AVX2 reduce's cases (bf16 and fp32 into fp32, averaged), and two it leaves to the portable loop. */
		for (size_t r = 0; r < sizeof(reduces) / sizeof(reduces[0]); r++)
			for (uint32_t nin = 1; nin <= 8; nin++)
				for (int acc = 0; acc < 2; acc++)
					check_reduce(reduces[r].idt, reduces[r].rd, reduces[r].od,
						     nin, 1029 + nin, 1, (float)nin, 1, 0, acc);
	}
}

Test(isa_limit, the_environment_names_the_limit_at_the_first_call, .timeout = 5)
{
	/* Each test runs in a process of its own: no kernel has looked at the limit yet. */
	cr_assert_eq(setenv("SHARDD_KERNEL_ISA", "portable", 1), 0);
	cr_assert_eq(shardd_k_isa_limit(), SHARDD_K_ISA_PORTABLE);
	cr_assert_eq(shardd_k_isa_best(), SHARDD_K_ISA_PORTABLE);
	cr_assert(shardd_k_isa_allows(SHARDD_K_ISA_PORTABLE));
	cr_assert(!shardd_k_isa_allows(SHARDD_K_ISA_AVX2));
	/* Read once: a later change of the environment is not seen. */
	cr_assert_eq(setenv("SHARDD_KERNEL_ISA", "avx512", 1), 0);
	cr_assert_eq(shardd_k_isa_limit(), SHARDD_K_ISA_PORTABLE);
}

Test(isa_limit, an_unknown_name_leaves_the_kernels_unlimited, .timeout = 5)
{
	cr_assert_eq(setenv("SHARDD_KERNEL_ISA", "sse9", 1), 0);
	cr_assert_eq(shardd_k_isa_limit(), SHARDD_K_ISA_COUNT - 1);
	cr_assert(shardd_k_isa_allows(SHARDD_K_ISA_AVX512));
}

Test(divide, factors_match_the_seed_loop_for_n_1_to_64, .timeout = 5)
{
	for (uint32_t n = 1; n <= 64; n++) {
		double pre, post;
		int factor = 1;

		/* _get_gradient_divide_factors, restated. */
		while (n % factor == 0 && (double)n / factor > factor)
			factor *= 2;
		shardd_divide_factors(n, SHARDD_DTYPE_FP16, &pre, &post);
		cr_assert_eq(pre, (double)factor, "N=%u: pre %g, want %d", n, pre, factor);
		cr_assert_eq(post, (double)n / factor, "N=%u: post %g, want %g", n, post,
			     (double)n / factor);

		shardd_divide_factors(n, SHARDD_DTYPE_FP32, &pre, &post);
		cr_assert(pre == 0 && post == 0, "fp32 has no factors (AVG)");
		shardd_divide_factors(n, SHARDD_DTYPE_BF16, &pre, &post);
		cr_assert(pre == 0 && post == 0, "bf16 has no factors (AVG)");
	}
}

Test(divide, factors_hand_checked_values, .timeout = 5)
{
	static const struct {
		uint32_t n;
		double pre, post;
	} cases[] = {
		{ 1, 1, 1 },  { 2, 2, 1 },  { 4, 2, 2 },   { 6, 4, 1.5 }, { 8, 4, 2 },
		{ 12, 4, 3 }, { 16, 4, 4 }, { 3, 2, 1.5 }, { 64, 8, 8 },  { 7, 2, 3.5 },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		double pre, post;

		shardd_divide_factors(cases[i].n, SHARDD_DTYPE_FP16, &pre, &post);
		cr_expect(pre == cases[i].pre && post == cases[i].post, "N=%u: %g, %g; want %g, %g",
			  cases[i].n, pre, post, cases[i].pre, cases[i].post);
	}
}

/* SPDX-License-Identifier: MIT */
/*
 * The arithmetic of one collective reduction (shardd_k_reduce in
 * shardd_kernels.h has the formula): cast to reduce_dtype, FSDP2 pre-divide,
 * sum in fp32, average, HSDP partial add, post-divide, cast to the param's
 * dtype, accumulate.
 *
 * One pass over memory: every input element is read once and every output
 * element written once. Two implementations give the same bits:
 *
 * - AVX-512 (picked at run time): the whole formula runs on 16 elements in
 *   registers at a time, every step of it fused, so the only memory traffic
 *   is the inputs and the output. Measured on the Zen 5 CI machine, the
 *   block version below ran at ~1.7 G elements/s per core on 2 bf16
 *   inputs, L1-resident (it converts, rounds and adds in separate passes
 *   through L1 buffers), far short of what the memory can feed; fused, the
 *   reduce is bound by memory bandwidth.
 * - Portable: the range is walked in SHARDD_K_BLOCK-element blocks; for
 *   each block every input is read once into an fp32 stack buffer and
 *   summed into an fp32 accumulator, and the output is written once. The
 *   fp32 loops are plain loops of constant length (full blocks) that gcc
 *   -O2 vectorises.
 *
 * The AVX-512 version multiplies by the reciprocal where a divisor is a
 * power of two (a division costs several times a multiply): that
 * reciprocal is exact, so both are the same real number, rounded once to
 * the same fp32.
 */
#include <string.h>

#include "optim_isa.h"
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

static void reduce_portable(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
			    uint32_t nin, uint32_t in_dtype, size_t n,
			    const struct shardd_reduce_math *m)
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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "bf16_avx512.h"

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define AVX512_INLINE AVX512_TARGET ALWAYS_INLINE
/* Round to nearest even, exceptions suppressed, whatever MXCSR says. */
#define RNE_SAE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/*
 * Arithmetic through the explicit-rounding intrinsics: gcc may fuse a
 * plain _mm512_mul_ps and _mm512_add_ps into one FMA (-ffp-contract=fast
 * is its default in GNU C, and AVX-512F implies FMA), which rounds once
 * where the formula rounds twice. These builtins are never contracted.
 */
#define ADD_512(a, b) _mm512_add_round_ps((a), (b), RNE_SAE)
#define MUL_512(a, b) _mm512_mul_round_ps((a), (b), RNE_SAE)
#define DIV_512(a, b) _mm512_div_round_ps((a), (b), RNE_SAE)

/* What the formula does, decided once per call; the loop body tests these. */
enum {
	RV_ROUND_IN = 1 << 0, /* round inputs to reduce_dtype */
	RV_PRE = 1 << 1,      /* pre-divide */
	RV_AVG = 1 << 2,      /* divide the sum */
	RV_ADD = 1 << 3,      /* add the partial */
	RV_POST = 1 << 4,     /* post-divide */
	RV_ACC = 1 << 5,      /* accumulate into out */
	RV_PRE_MUL = 1 << 6,  /* the divisor is a power of two: multiply by its reciprocal */
	RV_AVG_MUL = 1 << 7,
	RV_POST_MUL = 1 << 8,
};

struct rv_args {
	void *out;
	const void *const *in;
	const void *add;
	size_t n;
	uint32_t nin;
	float pre, avg, post; /* divisors, or their reciprocals under RV_*_MUL */
};

/* A power of two whose reciprocal is a normal fp32 (so that it is exact). */
static int exact_reciprocal(float f)
{
	uint32_t u = shardd_f32_bits(f), e = (u >> 23) & 0xffu;

	return (u & 0x7fffffu) == 0 && e >= 1 && e <= 253;
}

AVX512_INLINE __m512 load_512(const void *p, uint32_t dt, __mmask16 k)
{
	switch (dt) {
	case SHARDD_DTYPE_BF16:
		return bf16_widen_512(_mm256_maskz_loadu_epi16(k, p));
	case SHARDD_DTYPE_FP16:
		return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
	default:
		return _mm512_maskz_loadu_ps(k, p);
	}
}

/* x rounded to dt and widened back (shardd_round_to on 16 lanes). */
AVX512_INLINE __m512 round_512(__m512 x, uint32_t dt)
{
	switch (dt) {
	case SHARDD_DTYPE_BF16:
		return bf16_round_512(x);
	case SHARDD_DTYPE_FP16:
		return _mm512_cvtph_ps(_mm512_cvtps_ph(x, RNE_SAE));
	default:
		return x;
	}
}

AVX512_INLINE void store_512(void *p, uint32_t dt, __m512 x, __mmask16 k)
{
	switch (dt) {
	case SHARDD_DTYPE_BF16:
		_mm256_mask_storeu_epi16(p, k, bf16_narrow_512(x));
		break;
	case SHARDD_DTYPE_FP16:
		_mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(x, RNE_SAE));
		break;
	default:
		_mm512_mask_storeu_ps(p, k, x);
		break;
	}
}

/*
 * A streaming store of 16 lanes (shardd_k_reduce_stream): a whole aligned
 * vector, 64 bytes of fp32 or 32 of a 16-bit dtype, that goes around the
 * caches, so the old output line is never read.
 */
AVX512_INLINE void store_stream_512(void *p, uint32_t dt, __m512 x)
{
	switch (dt) {
	case SHARDD_DTYPE_BF16:
		_mm256_stream_si256(p, bf16_narrow_512(x));
		break;
	case SHARDD_DTYPE_FP16:
		_mm256_stream_si256(p, _mm512_cvtps_ph(x, RNE_SAE));
		break;
	default:
		_mm512_stream_ps(p, x);
		break;
	}
}

AVX512_INLINE __m512 divide_512(__m512 x, float by, int mul)
{
	return mul ? MUL_512(x, _mm512_set1_ps(by)) : DIV_512(x, _mm512_set1_ps(by));
}

/* Input k's 16 lanes at element i, rounded and pre-divided as the formula says. */
AVX512_INLINE __m512 input_512(const struct rv_args *a, uint32_t k, size_t i, uint32_t idt,
			       uint32_t rd, unsigned f, __mmask16 mk)
{
	__m512 x = load_512((const char *)a->in[k] + i * shardd_dtype_size(idt), idt, mk);

	if (f & RV_ROUND_IN)
		x = round_512(x, rd);
	if (f & RV_PRE)
		x = round_512(divide_512(x, a->pre, f & RV_PRE_MUL), rd);
	return x;
}

/*
 * The formula on 16 elements at i (mk: the lanes that exist). Every step
 * of shardd_k_reduce's formula in its order, each rounding where the
 * portable code rounds. `stream`: a streaming store (mk all ones, out
 * aligned to the vector).
 */
AVX512_INLINE void reduce_16(const struct rv_args *a, size_t i, uint32_t idt, uint32_t rd,
			     uint32_t odt, unsigned f, uint32_t nin, __mmask16 mk, int stream)
{
	char *out = (char *)a->out + i * shardd_dtype_size(odt);
	/* The sum starts from x_0, not from +0, so that inputs that are all -0 sum to -0. */
	__m512 s = input_512(a, 0, i, idt, rd, f, mk);

	for (uint32_t k = 1; k < nin; k++)
		s = ADD_512(s, input_512(a, k, i, idt, rd, f, mk));
	if (f & RV_AVG)
		s = divide_512(s, a->avg, f & RV_AVG_MUL);
	s = round_512(s, rd);
	if (f & RV_ADD) {
		__m512 p = load_512((const char *)a->add + i * shardd_dtype_size(rd), rd, mk);

		s = round_512(ADD_512(s, p), rd);
	}
	if (f & RV_POST)
		s = round_512(divide_512(s, a->post, f & RV_POST_MUL), rd);
	if (f & RV_ACC)
		s = ADD_512(round_512(s, odt), load_512(out, odt, mk));
	if (stream)
		store_stream_512(out, odt, s);
	else
		store_512(out, odt, s, mk);
}

/*
 * Software prefetch of the inputs, PREFETCH_AHEAD bytes ahead of the loads,
 * when there are more than PREFETCH_MIN_INPUTS of them: the hardware
 * prefetcher keeps up with a few streams per core, but with 8 interleaved
 * input streams it fell behind (measured on Zen 5, 2 threads, 8 bf16
 * inputs: ~30 GB/s without, up to ~40 with; 1 and 2 KiB ahead did best).
 * On the Xeon host (issue 33) it fell behind with 2 already: a 2-thread
 * streaming reduce of 2 bf16 inputs of 32 Mi elements into fp32 ran at
 * 33 - 35 GB/s without, 42 - 44 with (the roofline's best, nt+pf, 45),
 * and its AVX2 path at 13 - 15 without, 18 - 34 with; 1, 2 and 4 KiB
 * ahead were alike there, 2 KiB the best for 2 inputs.
 * A prefetch never faults, so the one past the end of an input is harmless;
 * its address is formed as an integer, as it may lie outside the object.
 */
#define PREFETCH_AHEAD      2048
#define PREFETCH_MIN_INPUTS 1

AVX512_INLINE void prefetch_inputs(const struct rv_args *a, size_t byte, uint32_t nin)
{
	for (uint32_t k = 0; k < nin; k++)
		_mm_prefetch((const char *)((uintptr_t)a->in[k] + byte), _MM_HINT_T0);
}

/*
 * The loop, inlined into each caller below so that callers that pass
 * constants get a body with the dtype switches and flag tests folded away.
 * Streaming, the elements before out's first vector-aligned one go
 * through one masked plain store.
 */
AVX512_INLINE void reduce_loop_512(const struct rv_args *a, uint32_t idt, uint32_t rd, uint32_t odt,
				   unsigned f, uint32_t nin, int stream)
{
	size_t osz = shardd_dtype_size(odt), vec = 16 * osz;
	size_t i = 0;

	if (stream) {
		i = ((vec - ((uintptr_t)a->out & (vec - 1))) & (vec - 1)) / osz;
		i = i < a->n ? i : a->n;
		if (i)
			reduce_16(a, 0, idt, rd, odt, f, nin, (__mmask16)((1u << i) - 1u), 0);
	}
	for (; i + 16 <= a->n; i += 16) {
		if (nin > PREFETCH_MIN_INPUTS)
			prefetch_inputs(a, i * shardd_dtype_size(idt) + PREFETCH_AHEAD, nin);
		reduce_16(a, i, idt, rd, odt, f, nin, (__mmask16)0xffff, stream);
	}
	if (i < a->n)
		reduce_16(a, i, idt, rd, odt, f, nin, (__mmask16)((1u << (a->n - i)) - 1u), 0);
}

/* Both store modes of one specialisation. */
AVX512_INLINE void reduce_loop_2(const struct rv_args *a, uint32_t idt, uint32_t rd, uint32_t odt,
				 unsigned f, uint32_t nin, int stream)
{
	if (stream)
		reduce_loop_512(a, idt, rd, odt, f, nin, 1);
	else
		reduce_loop_512(a, idt, rd, odt, f, nin, 0);
}

/* FSDP2's common cases, specialised: bf16 grads reduced in bf16 into fp32 sharded grads, and fp32. */
AVX512_TARGET static void reduce_bf16_avg_f32(const struct rv_args *a, unsigned f, int stream)
{
	switch (f) {
	case RV_AVG | RV_AVG_MUL:
		reduce_loop_2(a, SHARDD_DTYPE_BF16, SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP32,
			      RV_AVG | RV_AVG_MUL, a->nin, stream);
		break;
	case RV_AVG | RV_AVG_MUL | RV_ACC:
		reduce_loop_2(a, SHARDD_DTYPE_BF16, SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP32,
			      RV_AVG | RV_AVG_MUL | RV_ACC, a->nin, stream);
		break;
	default:
		reduce_loop_2(a, SHARDD_DTYPE_BF16, SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP32, f, a->nin,
			      stream);
		break;
	}
}

AVX512_TARGET static void reduce_f32_avg_f32(const struct rv_args *a, unsigned f, int stream)
{
	switch (f) {
	case RV_AVG | RV_AVG_MUL:
		reduce_loop_2(a, SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32,
			      RV_AVG | RV_AVG_MUL, a->nin, stream);
		break;
	case RV_AVG | RV_AVG_MUL | RV_ACC:
		reduce_loop_2(a, SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32,
			      RV_AVG | RV_AVG_MUL | RV_ACC, a->nin, stream);
		break;
	default:
		reduce_loop_2(a, SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32, f, a->nin,
			      stream);
		break;
	}
}

/* Every other combination: the same body with the dtypes and flags tested in the loop. */
AVX512_TARGET static void reduce_any_512(const struct rv_args *a, uint32_t idt, uint32_t rd,
					 uint32_t odt, unsigned f, int stream)
{
	reduce_loop_2(a, idt, rd, odt, f, a->nin, stream);
}

/*
 * AVX2 (no AVX-512): the common FSDP2 reduce fused in registers, 8 lanes
 * at a time: inputs of bf16 or fp32 reduced in their own dtype into an
 * fp32 output, averaged, perhaps accumulated (no pre- or post-divide, no
 * HSDP partial). The same steps as reduce_portable in the same order
 * (sum from x_0, divide, round to reduce_dtype, add the output), so the
 * same bits; the tail of fewer than 8 elements is reduce_portable's.
 * Measured on the 2-core Zen 3 VM: the portable block loop made a 1 MiB
 * 2-rank bf16 reduce ~90 % kernel time in the daemon (six passes per block
 * through L1 buffers).
 */
#define AVX2_TARGET __attribute__((target("avx2")))
#define AVX2_INLINE AVX2_TARGET ALWAYS_INLINE

/* fp32 bits of lanes holding a NaN: all ones. */
AVX2_INLINE __m256i nan_lanes_256(__m256i u)
{
	return _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
				  _mm256_set1_epi32(0x7f800000));
}

/* 8 bf16 widened to fp32 (exact); a NaN comes back quiet (bf16_to_bits). */
AVX2_INLINE __m256 bf16_load_256(const void *p)
{
	__m256i u =
		_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);

	return _mm256_castsi256_ps(_mm256_or_si256(
		u, _mm256_and_si256(nan_lanes_256(u), _mm256_set1_epi32(0x00400000))));
}

/* x rounded to bf16 to nearest even and widened back (bf16_round_n: a NaN truncated, quiet). */
AVX2_INLINE __m256 bf16_round_256(__m256 x)
{
	__m256i u = _mm256_castps_si256(x), hi = _mm256_set1_epi32((int)0xffff0000u);
	__m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
	__m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
	__m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));

	r = _mm256_blendv_epi8(r, q, nan_lanes_256(u));
	return _mm256_castsi256_ps(_mm256_and_si256(r, hi));
}

AVX2_INLINE __m256 load_256(const void *base, size_t i, int bf16)
{
	if (bf16)
		return bf16_load_256((const uint16_t *)base + i);
	return _mm256_loadu_ps((const float *)base + i);
}

/* The fused loop over the first n & ~7 elements; `mul`: by the exact reciprocal `by`, else divide. */
AVX2_INLINE void reduce_loop_256(float *out, const void *const *in, uint32_t nin, size_t n,
				 int bf16, int avg, int mul, float by, int acc, int stream)
{
	__m256 vby = _mm256_set1_ps(by);

	for (size_t i = 0; i + 8 <= n; i += 8) {
		__m256 s;

		/*
		 * Once per 64-byte line of each input (PREFETCH_MIN_INPUTS): on the
		 * Zen 3 CI VM a 64 MiB reduce of 4 and 8 bf16 inputs was faster with
		 * it in 6 of 6 alternating pairs, by 9 - 57 % (docs/BENCHMARKS.md).
		 */
		if (nin > PREFETCH_MIN_INPUTS && !(i & (bf16 ? 31 : 15)))
			for (uint32_t k = 0; k < nin; k++)
				_mm_prefetch((const char *)((uintptr_t)in[k] + i * (bf16 ? 2 : 4) +
							    PREFETCH_AHEAD),
					     _MM_HINT_T0);
		s = load_256(in[0], i, bf16);

		for (uint32_t k = 1; k < nin; k++)
			s = _mm256_add_ps(s, load_256(in[k], i, bf16));
		if (avg)
			s = mul ? _mm256_mul_ps(s, vby) : _mm256_div_ps(s, vby);
		if (bf16)
			s = bf16_round_256(s);
		if (acc)
			s = _mm256_add_ps(s, _mm256_loadu_ps(out + i));
		if (stream)
			_mm256_stream_ps(out + i, s);
		else
			_mm256_storeu_ps(out + i, s);
	}
}

AVX2_TARGET static void reduce_avx2_bf16(float *out, const void *const *in, uint32_t nin, size_t n,
					 int avg, int mul, float by, int acc, int stream)
{
	reduce_loop_256(out, in, nin, n, 1, avg, mul, by, acc, stream);
}

AVX2_TARGET static void reduce_avx2_f32(float *out, const void *const *in, uint32_t nin, size_t n,
					int avg, int mul, float by, int acc, int stream)
{
	reduce_loop_256(out, in, nin, n, 0, avg, mul, by, acc, stream);
}

/* 1 when reduce_avx2 runs this reduce: AVX2 without AVX-512, and a formula it fuses. */
static int reduce_avx2_fits(uint32_t out_dtype, uint32_t nin, uint32_t in_dtype,
			    const struct shardd_reduce_math *m)
{
	return __builtin_cpu_supports("avx2") && shardd_k_isa_allows(SHARDD_K_ISA_AVX2) &&
	       nin >= 1 && nin <= SHARDD_MAX_WORLD && out_dtype == SHARDD_DTYPE_FP32 &&
	       m->reduce_dtype == in_dtype &&
	       (in_dtype == SHARDD_DTYPE_BF16 || in_dtype == SHARDD_DTYPE_FP32) &&
	       !(m->pre > 1.0f) && !(m->post > 1.0f) && !m->add;
}

static void reduce_avx2(void *out, int accumulate, const void *const *in, uint32_t nin,
			uint32_t in_dtype, size_t n, const struct shardd_reduce_math *m, int stream)
{
	size_t done = n & ~(size_t)7, isz = shardd_dtype_size(in_dtype);
	const void *tail[SHARDD_MAX_WORLD];
	int avg = m->avg != 1.0f, mul = avg && exact_reciprocal(m->avg);
	float by = mul ? 1.0f / m->avg : m->avg;

	/* Streaming stores need 32-byte alignment: an unaligned output takes plain ones. */
	stream = stream && ((uintptr_t)out & 31) == 0;
	if (in_dtype == SHARDD_DTYPE_BF16)
		reduce_avx2_bf16(out, in, nin, n, avg, mul, by, accumulate, stream);
	else
		reduce_avx2_f32(out, in, nin, n, avg, mul, by, accumulate, stream);
	if (stream)
		_mm_sfence();
	if (done == n)
		return;
	for (uint32_t k = 0; k < nin; k++)
		tail[k] = (const char *)in[k] + done * isz;
	reduce_portable((float *)out + done, SHARDD_DTYPE_FP32, accumulate, tail, nin, in_dtype,
			n - done, m);
}

static int have_avx512(void)
{
	/* __builtin_cpu_supports reads data set up by libgcc before main: no race. */
	return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
	       shardd_k_isa_allows(SHARDD_K_ISA_AVX512);
}

/* Set up and run the AVX-512 reduce; `stream`: with streaming stores, fenced. */
AVX512_TARGET static void reduce_avx512(void *out, uint32_t out_dtype, int accumulate,
					const void *const *in, uint32_t nin, uint32_t in_dtype,
					size_t n, const struct shardd_reduce_math *m, int stream)
{
	uint32_t rd = m->reduce_dtype;
	struct rv_args a = { .out = out,
			     .in = in,
			     .add = m->add,
			     .n = n,
			     .nin = nin,
			     .pre = m->pre,
			     .avg = m->avg,
			     .post = m->post };
	unsigned f = 0;

	if (rd != SHARDD_DTYPE_FP32 && rd != in_dtype)
		f |= RV_ROUND_IN;
	if (m->pre > 1.0f)
		f |= RV_PRE;
	if (m->avg != 1.0f)
		f |= RV_AVG;
	if (m->add)
		f |= RV_ADD;
	if (m->post > 1.0f)
		f |= RV_POST;
	if (accumulate)
		f |= RV_ACC;
	if ((f & RV_PRE) && exact_reciprocal(a.pre)) {
		f |= RV_PRE_MUL;
		a.pre = 1.0f / a.pre;
	}
	if ((f & RV_AVG) && exact_reciprocal(a.avg)) {
		f |= RV_AVG_MUL;
		a.avg = 1.0f / a.avg;
	}
	if ((f & RV_POST) && exact_reciprocal(a.post)) {
		f |= RV_POST_MUL;
		a.post = 1.0f / a.post;
	}

	if (in_dtype == SHARDD_DTYPE_BF16 && rd == SHARDD_DTYPE_BF16 &&
	    out_dtype == SHARDD_DTYPE_FP32)
		reduce_bf16_avg_f32(&a, f, stream);
	else if (in_dtype == SHARDD_DTYPE_FP32 && rd == SHARDD_DTYPE_FP32 &&
		 out_dtype == SHARDD_DTYPE_FP32)
		reduce_f32_avg_f32(&a, f, stream);
	else
		reduce_any_512(&a, in_dtype, rd, out_dtype, f, stream);
	/*
	 * Streaming stores are weakly ordered: without this fence they may
	 * become visible after a later store, such as the lock release or
	 * completion that tells another thread or process the output is ready.
	 */
	if (stream)
		_mm_sfence();
}
#endif

void shardd_k_reduce(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
		     uint32_t nin, uint32_t in_dtype, size_t n, const struct shardd_reduce_math *m)
{
#if defined(__x86_64__) || defined(__i386__)
	if (have_avx512()) {
		reduce_avx512(out, out_dtype, accumulate, in, nin, in_dtype, n, m, 0);
		return;
	}
	if (reduce_avx2_fits(out_dtype, nin, in_dtype, m)) {
		reduce_avx2(out, accumulate, in, nin, in_dtype, n, m, 0);
		return;
	}
#endif
	reduce_portable(out, out_dtype, accumulate, in, nin, in_dtype, n, m);
}

void shardd_k_reduce_stream(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
			    uint32_t nin, uint32_t in_dtype, size_t n,
			    const struct shardd_reduce_math *m)
{
#if defined(__x86_64__) || defined(__i386__)
	if (have_avx512()) {
		reduce_avx512(out, out_dtype, accumulate, in, nin, in_dtype, n, m, 1);
		return;
	}
	if (reduce_avx2_fits(out_dtype, nin, in_dtype, m)) {
		reduce_avx2(out, accumulate, in, nin, in_dtype, n, m, 1);
		return;
	}
#endif
	reduce_portable(out, out_dtype, accumulate, in, nin, in_dtype, n, m);
}

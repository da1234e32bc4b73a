/* SPDX-License-Identifier: MIT */
/*
 * The optimizer step (shardd_kernels.h has the contract): fused SGD and
 * AdamW with torch.optim's formulas, and the grad-norm part for
 * clip_grad_norm_.
 *
 * One pass over memory per step: each element's param, grad and state are
 * loaded once, the whole update runs in registers, and param and state are
 * stored once. The update is memory-bound (AdamW moves 28 bytes per
 * element for a few dozen flops), so the paths differ only in how many
 * elements one instruction handles: AVX-512 (16), AVX2 (8), portable C (1),
 * picked at run time by __builtin_cpu_supports as cast.c does.
 *
 * The numerics are defined by sgd_one and adamw_one: a fixed sequence of
 * correctly rounded fp32 operations (IEEE divide and square root, no fused
 * multiply-add: the pragma below keeps gcc from contracting a multiply and
 * an add where the target has FMA). The vector loops (optim_simd.h) apply
 * the same operations in the same order, so all paths give the same bits,
 * and the tests require exactly that. The order follows torch's CPU
 * kernels where it is visible (addcmul: (value * t1) * t2, addcdiv:
 * (value * t1) / t2, lerp's two forms); torch itself uses FMA in some
 * vector loops, so it agrees to rounding, not to the bit.
 *
 * A bf16 or fp16 grad is widened (exactly) one SHARDD_K_BLOCK at a time
 * into an L1-resident buffer, then runs through the fp32 loops.
 */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "optim_isa.h"
#include "shardd_kernels.h"
#include "shardd_proto.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHARDD_HAVE_X86 1
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Sixteen fp64 lanes for the grad-norm sums on every path. */
#define NORM_LANES 16

/* ------------------------------------------------------------ scalars --- */

void shardd_k_sgd_coefs(const struct shardd_sgd *a, struct shardd_sgd_coefs *c)
{
	c->grad_mul = a->maximize ? -a->grad_scale : a->grad_scale;
	c->weight_decay = (float)a->weight_decay;
	c->momentum = (float)a->momentum;
	c->damp_c = (float)(1.0 - a->dampening);
	c->neg_lr = (float)-a->lr;
	c->use_wd = a->weight_decay != 0.0;
	c->use_momentum = a->momentum != 0.0;
	c->first = a->step <= 1;
	c->nesterov = a->nesterov != 0;
}

void shardd_k_adamw_coefs(const struct shardd_adamw *a, struct shardd_adamw_coefs *c)
{
	double step = (double)a->step;
	double bc1 = 1.0 - pow(a->beta1, step);
	double bc2 = 1.0 - pow(a->beta2, step);

	c->grad_mul = a->maximize ? -a->grad_scale : a->grad_scale;
	c->decay = (float)(1.0 - a->lr * a->weight_decay);
	c->lerp_w = (float)(1.0 - a->beta1);
	c->lerp_wc = 1.0f - c->lerp_w;
	c->beta2 = (float)a->beta2;
	c->beta2c = (float)(1.0 - a->beta2);
	c->bc2_sqrt = (float)sqrt(bc2);
	c->eps = (float)a->eps;
	c->neg_step_size = (float)-(a->lr / bc1);
	c->lerp_small = c->lerp_w < 0.5f;
	c->amsgrad = a->amsgrad != 0;
}

/*
 * torch.optim.SGD for one element (grad already scaled and negated by
 * grad_mul, which is exact for the sign):
 *   d = g + wd * p;  buf = step 1 ? d : buf * momentum + (1 - dampening) * d
 *   d = nesterov ? d + momentum * buf : buf;  p = p + (-lr) * d
 */
ALWAYS_INLINE void sgd_one(const struct shardd_sgd_coefs *c, float *p, float g, float *b)
{
	float pi = *p, d = g * c->grad_mul;

	if (c->use_wd)
		d = d + c->weight_decay * pi;
	if (c->use_momentum) {
		float bi = c->first ? d : *b * c->momentum + c->damp_c * d;

		*b = bi;
		d = c->nesterov ? d + c->momentum * bi : bi;
	}
	*p = pi + c->neg_lr * d;
}

/*
 * torch.optim.AdamW for one element:
 *   p = p * (1 - lr * wd);  m = lerp(m, g, 1 - beta1)
 *   v = v * beta2 + ((1 - beta2) * g) * g;  amsgrad: vmax = max(vmax, v), v = vmax
 *   p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
 * The max is MAXPS's (old > v ? old : v): the vector loops' bits.
 */
ALWAYS_INLINE void adamw_one(const struct shardd_adamw_coefs *c, float *p, float g, float *m,
			     float *v, float *vmax_state)
{
	float gi = g * c->grad_mul, pi = *p * c->decay, mi = *m, vi = *v, den;

	mi = c->lerp_small ? mi + c->lerp_w * (gi - mi) : gi - (gi - mi) * c->lerp_wc;
	vi = vi * c->beta2 + (c->beta2c * gi) * gi;
	*m = mi;
	*v = vi;
	if (c->amsgrad) {
		vi = *vmax_state > vi ? *vmax_state : vi;
		*vmax_state = vi;
	}
	den = sqrtf(vi) / c->bc2_sqrt + c->eps;
	*p = pi + (c->neg_step_size * mi) / den;
}

static void sgd_f32_portable(const struct shardd_sgd_coefs *c, float *restrict p,
			     const float *restrict g, float *restrict b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		sgd_one(c, p + i, g[i], b ? b + i : NULL);
}

static void adamw_f32_portable(const struct shardd_adamw_coefs *c, float *restrict p,
			       const float *restrict g, float *restrict m, float *restrict v,
			       float *restrict vmax_state, size_t n)
{
	for (size_t i = 0; i < n; i++)
		adamw_one(c, p + i, g[i], m + i, v + i, vmax_state ? vmax_state + i : NULL);
}

/* Element k of a range goes to lane k % NORM_LANES; lanes sum in index order. */
static void norm_f32_portable(const float *g, size_t n, double lanes[NORM_LANES], float *max_abs)
{
	float mx = *max_abs;

	for (size_t i = 0; i < n; i++) {
		float a = fabsf(g[i]);

		lanes[i % NORM_LANES] += (double)g[i] * (double)g[i];
		mx = a > mx ? a : mx;
	}
	*max_abs = mx;
}

/* ------------------------------------------------------------ vectors --- */

#ifdef SHARDD_HAVE_X86
/* No "fma": without it gcc cannot contract, with or without the pragma. */
#define OPT_ISA    avx2
#define OPT_TARGET __attribute__((target("avx2")))
#define V          __m256
#define W          8
#define vload      _mm256_loadu_ps
#define vstore     _mm256_storeu_ps
#define vset1      _mm256_set1_ps
#define vadd       _mm256_add_ps
#define vsub       _mm256_sub_ps
#define vmul       _mm256_mul_ps
#define vdiv       _mm256_div_ps
#define vsqrt      _mm256_sqrt_ps
#define vmax       _mm256_max_ps
#include "optim_simd.h"

#define OPT_ISA    avx512
#define OPT_TARGET __attribute__((target("avx512f")))
#define V          __m512
#define W          16
#define vload      _mm512_loadu_ps
#define vstore     _mm512_storeu_ps
#define vset1      _mm512_set1_ps
#define vadd       _mm512_add_ps
#define vsub       _mm512_sub_ps
#define vmul       _mm512_mul_ps
#define vdiv       _mm512_div_ps
#define vsqrt      _mm512_sqrt_ps
#define vmax       _mm512_max_ps
#include "optim_simd.h"

/*
 * Grad-norm lanes: 16 elements per iteration, element k into lane k % 16
 * (AVX2: four 4-double accumulators; AVX-512: two of 8). A square of an
 * fp32 value is exact in fp64, so mul + add is the portable loop's sum.
 */
__attribute__((target("avx2"))) static void norm_f32_avx2(const float *g, size_t n,
							  double lanes[NORM_LANES], float *max_abs)
{
	const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
	__m256d a0 = _mm256_loadu_pd(lanes), a1 = _mm256_loadu_pd(lanes + 4);
	__m256d a2 = _mm256_loadu_pd(lanes + 8), a3 = _mm256_loadu_pd(lanes + 12);
	__m256 mx = _mm256_set1_ps(*max_abs);
	float m8[8], mx1;
	size_t i = 0;

	for (; i + NORM_LANES <= n; i += NORM_LANES) {
		__m256 x0 = _mm256_loadu_ps(g + i), x1 = _mm256_loadu_ps(g + i + 8);
		__m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x0));
		__m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1));
		__m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(x1));
		__m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(x1, 1));

		a0 = _mm256_add_pd(a0, _mm256_mul_pd(d0, d0));
		a1 = _mm256_add_pd(a1, _mm256_mul_pd(d1, d1));
		a2 = _mm256_add_pd(a2, _mm256_mul_pd(d2, d2));
		a3 = _mm256_add_pd(a3, _mm256_mul_pd(d3, d3));
		mx = _mm256_max_ps(_mm256_and_ps(x0, absmask), mx);
		mx = _mm256_max_ps(_mm256_and_ps(x1, absmask), mx);
	}
	_mm256_storeu_pd(lanes, a0);
	_mm256_storeu_pd(lanes + 4, a1);
	_mm256_storeu_pd(lanes + 8, a2);
	_mm256_storeu_pd(lanes + 12, a3);
	_mm256_storeu_ps(m8, mx);
	mx1 = m8[0];
	for (int k = 1; k < 8; k++)
		mx1 = m8[k] > mx1 ? m8[k] : mx1;
	*max_abs = mx1;
	norm_f32_portable(g + i, n - i, lanes, max_abs);
}

__attribute__((target("avx512f"))) static void
norm_f32_avx512(const float *g, size_t n, double lanes[NORM_LANES], float *max_abs)
{
	__m512d a0 = _mm512_loadu_pd(lanes), a1 = _mm512_loadu_pd(lanes + 8);
	__m512 mx = _mm512_set1_ps(*max_abs);
	size_t i = 0;

	for (; i + NORM_LANES <= n; i += NORM_LANES) {
		__m512 x = _mm512_loadu_ps(g + i);
		__m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
		__m512d d1 = _mm512_cvtps_pd(
			_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));

		a0 = _mm512_add_pd(a0, _mm512_mul_pd(d0, d0));
		a1 = _mm512_add_pd(a1, _mm512_mul_pd(d1, d1));
		mx = _mm512_max_ps(_mm512_abs_ps(x), mx);
	}
	_mm512_storeu_pd(lanes, a0);
	_mm512_storeu_pd(lanes + 8, a1);
	/* The max of non-NaN values is the same in any order (NaNs were skipped). */
	*max_abs = _mm512_reduce_max_ps(mx);
	norm_f32_portable(g + i, n - i, lanes, max_abs);
}

/* __builtin_cpu_supports reads data set up by libgcc before main: no race. */
static int have_avx2(void)
{
	return __builtin_cpu_supports("avx2");
}

static int have_avx512(void)
{
	return __builtin_cpu_supports("avx512f");
}
#endif

/* ----------------------------------------------------------- dispatch --- */

int shardd_k_isa_available(enum shardd_k_isa isa)
{
	switch (isa) {
	case SHARDD_K_ISA_PORTABLE:
		return 1;
#ifdef SHARDD_HAVE_X86
	case SHARDD_K_ISA_AVX2:
		return have_avx2();
	case SHARDD_K_ISA_AVX512:
		return have_avx512();
#endif
	default:
		return 0;
	}
}

enum shardd_k_isa shardd_k_isa_best(void)
{
	if (shardd_k_isa_allows(SHARDD_K_ISA_AVX512) && shardd_k_isa_available(SHARDD_K_ISA_AVX512))
		return SHARDD_K_ISA_AVX512;
	if (shardd_k_isa_allows(SHARDD_K_ISA_AVX2) && shardd_k_isa_available(SHARDD_K_ISA_AVX2))
		return SHARDD_K_ISA_AVX2;
	return SHARDD_K_ISA_PORTABLE;
}

static void sgd_f32(enum shardd_k_isa isa, const struct shardd_sgd_coefs *c, float *p,
		    const float *g, float *b, size_t n)
{
	switch (isa) {
#ifdef SHARDD_HAVE_X86
	case SHARDD_K_ISA_AVX512:
		sgd_f32_avx512(c, p, g, b, n);
		break;
	case SHARDD_K_ISA_AVX2:
		sgd_f32_avx2(c, p, g, b, n);
		break;
#endif
	default:
		sgd_f32_portable(c, p, g, b, n);
		break;
	}
}

static void adamw_f32(enum shardd_k_isa isa, const struct shardd_adamw_coefs *c, float *p,
		      const float *g, float *m, float *v, float *vmax_state, size_t n)
{
	switch (isa) {
#ifdef SHARDD_HAVE_X86
	case SHARDD_K_ISA_AVX512:
		adamw_f32_avx512(c, p, g, m, v, vmax_state, n);
		break;
	case SHARDD_K_ISA_AVX2:
		adamw_f32_avx2(c, p, g, m, v, vmax_state, n);
		break;
#endif
	default:
		adamw_f32_portable(c, p, g, m, v, vmax_state, n);
		break;
	}
}

static void norm_f32(enum shardd_k_isa isa, const float *g, size_t n, double lanes[NORM_LANES],
		     float *max_abs)
{
	switch (isa) {
#ifdef SHARDD_HAVE_X86
	case SHARDD_K_ISA_AVX512:
		norm_f32_avx512(g, n, lanes, max_abs);
		break;
	case SHARDD_K_ISA_AVX2:
		norm_f32_avx2(g, n, lanes, max_abs);
		break;
#endif
	default:
		norm_f32_portable(g, n, lanes, max_abs);
		break;
	}
}

/* Offset `p` (of dtype elements) by i elements. */
static const void *elem(const void *p, uint32_t dtype, size_t i)
{
	return (const char *)p + i * shardd_dtype_size(dtype);
}

void shardd_k_sgd_isa(enum shardd_k_isa isa, const struct shardd_sgd *a, size_t begin, size_t end)
{
	struct shardd_sgd_coefs c;
	float buf[SHARDD_K_BLOCK];
	float *b = a->momentum != 0.0 ? a->momentum_buffer : NULL;

	if (end <= begin)
		return;
	shardd_k_sgd_coefs(a, &c);
	if (a->grad_dtype == SHARDD_DTYPE_FP32) {
		sgd_f32(isa, &c, a->param + begin, (const float *)a->grad + begin,
			b ? b + begin : NULL, end - begin);
		return;
	}
	for (size_t i = begin; i < end; i += SHARDD_K_BLOCK) {
		size_t len = end - i < SHARDD_K_BLOCK ? end - i : SHARDD_K_BLOCK;

		shardd_k_to_f32(buf, elem(a->grad, a->grad_dtype, i), a->grad_dtype, len);
		sgd_f32(isa, &c, a->param + i, buf, b ? b + i : NULL, len);
	}
}

void shardd_k_adamw_isa(enum shardd_k_isa isa, const struct shardd_adamw *a, size_t begin,
			size_t end)
{
	struct shardd_adamw_coefs c;
	float buf[SHARDD_K_BLOCK];
	float *vmax_state = a->amsgrad ? a->max_exp_avg_sq : NULL;

	if (end <= begin)
		return;
	shardd_k_adamw_coefs(a, &c);
	if (a->grad_dtype == SHARDD_DTYPE_FP32) {
		adamw_f32(isa, &c, a->param + begin, (const float *)a->grad + begin,
			  a->exp_avg + begin, a->exp_avg_sq + begin,
			  vmax_state ? vmax_state + begin : NULL, end - begin);
		return;
	}
	for (size_t i = begin; i < end; i += SHARDD_K_BLOCK) {
		size_t len = end - i < SHARDD_K_BLOCK ? end - i : SHARDD_K_BLOCK;

		shardd_k_to_f32(buf, elem(a->grad, a->grad_dtype, i), a->grad_dtype, len);
		adamw_f32(isa, &c, a->param + i, buf, a->exp_avg + i, a->exp_avg_sq + i,
			  vmax_state ? vmax_state + i : NULL, len);
	}
}

void shardd_k_grad_norm_part_isa(enum shardd_k_isa isa, const void *grad, uint32_t dtype,
				 size_t begin, size_t end, struct shardd_grad_norm_part *out)
{
	double lanes[NORM_LANES] = { 0 }, sum = 0.0;
	float buf[SHARDD_K_BLOCK], max_abs = 0.0f;

	if (dtype == SHARDD_DTYPE_FP32) {
		if (end > begin)
			norm_f32(isa, (const float *)grad + begin, end - begin, lanes, &max_abs);
	} else {
		/* Whole blocks are multiples of NORM_LANES: each element keeps its lane. */
		for (size_t i = begin; i < end; i += SHARDD_K_BLOCK) {
			size_t len = end - i < SHARDD_K_BLOCK ? end - i : SHARDD_K_BLOCK;

			shardd_k_to_f32(buf, elem(grad, dtype, i), dtype, len);
			norm_f32(isa, buf, len, lanes, &max_abs);
		}
	}
	for (int k = 0; k < NORM_LANES; k++)
		sum += lanes[k];
	out->sumsq = sum;
	out->max_abs = max_abs;
	out->nonfinite = !isfinite(sum);
}

void shardd_k_sgd(const struct shardd_sgd *a, size_t begin, size_t end)
{
	shardd_k_sgd_isa(shardd_k_isa_best(), a, begin, end);
}

void shardd_k_adamw(const struct shardd_adamw *a, size_t begin, size_t end)
{
	shardd_k_adamw_isa(shardd_k_isa_best(), a, begin, end);
}

void shardd_k_grad_norm_part(const void *grad, uint32_t dtype, size_t begin, size_t end,
			     struct shardd_grad_norm_part *out)
{
	shardd_k_grad_norm_part_isa(shardd_k_isa_best(), grad, dtype, begin, end, out);
}

void shardd_k_grad_norm_merge(struct shardd_grad_norm_part *into,
			      const struct shardd_grad_norm_part *part)
{
	into->sumsq += part->sumsq;
	into->max_abs = part->max_abs > into->max_abs ? part->max_abs : into->max_abs;
	into->nonfinite |= part->nonfinite;
}

/* ---------------------------------------------------------- arguments --- */

/* -SHARDD_E_INVALID with "optimizer: field value: rule" in why. */
static int bad(char *why, size_t len, const char *opt, const char *field, double value,
	       const char *rule)
{
	snprintf(why, len, "%s: %s %g %s", opt, field, value, rule);
	return -SHARDD_E_INVALID;
}

static int grad_dtype_ok(uint32_t dtype)
{
	return dtype == SHARDD_DTYPE_FP32 || dtype == SHARDD_DTYPE_BF16 ||
	       dtype == SHARDD_DTYPE_FP16;
}

int shardd_k_sgd_check(const struct shardd_sgd *a, char *why, size_t len)
{
	if (!grad_dtype_ok(a->grad_dtype))
		return bad(why, len, "sgd", "grad_dtype", a->grad_dtype,
			   "is not fp32, bf16 or fp16 (codes 1-3)");
	if (!(a->lr >= 0.0) || isinf(a->lr))
		return bad(why, len, "sgd", "lr", a->lr,
			   "is invalid: use a finite value >= 0, as torch.optim.SGD");
	if (!(a->momentum >= 0.0) || isinf(a->momentum))
		return bad(why, len, "sgd", "momentum", a->momentum,
			   "is invalid: use a finite value >= 0");
	if (!isfinite(a->dampening))
		return bad(why, len, "sgd", "dampening", a->dampening,
			   "is invalid: use a finite value");
	if (!(a->weight_decay >= 0.0) || isinf(a->weight_decay))
		return bad(why, len, "sgd", "weight_decay", a->weight_decay,
			   "is invalid: use a finite value >= 0");
	if (a->nesterov && (a->momentum <= 0.0 || a->dampening != 0.0))
		return bad(why, len, "sgd", "nesterov with momentum", a->momentum,
			   "needs momentum > 0 and dampening 0 (torch.optim.SGD's rule)");
	if (!isfinite(a->grad_scale))
		return bad(why, len, "sgd", "grad_scale", a->grad_scale,
			   "is invalid: use a finite value (1 = none)");
	if (a->step < 1)
		return bad(why, len, "sgd", "step", 0, "is invalid: the first update is step 1");
	if (!a->param || !a->grad || (a->momentum != 0.0 && !a->momentum_buffer))
		return bad(why, len, "sgd", "momentum", a->momentum,
			   "needs param, grad and (momentum != 0) momentum_buffer, one is missing");
	return 0;
}

int shardd_k_adamw_check(const struct shardd_adamw *a, char *why, size_t len)
{
	if (!grad_dtype_ok(a->grad_dtype))
		return bad(why, len, "adamw", "grad_dtype", a->grad_dtype,
			   "is not fp32, bf16 or fp16 (codes 1-3)");
	if (!(a->lr >= 0.0) || isinf(a->lr))
		return bad(why, len, "adamw", "lr", a->lr,
			   "is invalid: use a finite value >= 0, as torch.optim.AdamW");
	if (!(a->beta1 >= 0.0 && a->beta1 < 1.0))
		return bad(why, len, "adamw", "betas[0]", a->beta1,
			   "is outside [0, 1): use a value such as 0.9");
	if (!(a->beta2 >= 0.0 && a->beta2 < 1.0))
		return bad(why, len, "adamw", "betas[1]", a->beta2,
			   "is outside [0, 1): use a value such as 0.999");
	if (!(a->eps >= 0.0) || isinf(a->eps))
		return bad(why, len, "adamw", "eps", a->eps,
			   "is invalid: use a finite value >= 0 such as 1e-8");
	if (!(a->weight_decay >= 0.0) || isinf(a->weight_decay))
		return bad(why, len, "adamw", "weight_decay", a->weight_decay,
			   "is invalid: use a finite value >= 0");
	if (!isfinite(a->grad_scale))
		return bad(why, len, "adamw", "grad_scale", a->grad_scale,
			   "is invalid: use a finite value (1 = none)");
	if (a->step < 1)
		return bad(why, len, "adamw", "step", 0, "is invalid: the first update is step 1");
	if (!a->param || !a->grad || !a->exp_avg || !a->exp_avg_sq ||
	    (a->amsgrad && !a->max_exp_avg_sq))
		return bad(
			why, len, "adamw", "amsgrad", a->amsgrad,
			"needs param, grad, exp_avg, exp_avg_sq and (amsgrad) max_exp_avg_sq, one is missing");
	return 0;
}

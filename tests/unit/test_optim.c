/* SPDX-License-Identifier: MIT */
/*
 * The optimizer kernels (kernels/optim.c) against an independent
 * reference: torch.optim's documented SGD and AdamW algorithms written out
 * here in double precision, run for K steps with a learning rate that
 * changes every step (a scheduler), on odd sizes and every option
 * combination. Each instruction-set path runs on its own (optim_isa.h) and
 * must give exactly the portable path's bits; the dispatching call runs on
 * a range split in two, which must not change a bit either.
 *
 * Tolerance against the double reference: the kernel rounds every fp32
 * operation (at most 2^-24 relative to the operands' magnitude) and its
 * fp32 hyperparameters, and does them in a different order from the
 * reference (torch's lerp and addcdiv forms). Each state's error is then
 * bounded by a count of roundings times 2^-24 times the *magnitude* of
 * that state: the same recurrence run on absolute values (|grad|,
 * |param|, ...), so cancellation does not hide a rounding. About 6
 * roundings feed each state per step; TOL_ULPS allows 8 per step plus 8,
 * i.e. 88 * 2^-24 ~ 5e-6 of the magnitude after 10 steps. A formula
 * error (a wrong bias correction, dampening on step 1, decay applied as
 * L2) changes an update by percents of lr * |update|, which is 1e-4 or
 * more of the magnitude here: far outside the tolerance.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "optim_isa.h"
#include "shardd_kernels.h"
#include "shardd_proto.h"
#include "xorshift.h"

#define K        10
#define TOL_ULPS (8.0 * (K + 1))
#define HALF_ULP 0x1p-24

static const size_t sizes[] = { 0, 1, 7, 15, 16, 17, 1000, 4097 };
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

/* ------------------------------------------------------------ helpers --- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
	return xorshift64s(&rng_state);
}

/* Uniform in [-1, 1) times 2^[-3, 0]: full fp32 mantissas, varied exponents. */
static float rand_f32(void)
{
	double u = (double)(rng() >> 11) * 0x1p-53 * 2.0 - 1.0;

	return (float)ldexp(u, -(int)(rng() % 4));
}

/* k * 2^-8 with |k| < 256: exact in bf16 and fp16. */
static float rand_grid(void)
{
	return (float)ldexp((double)((int64_t)(rng() % 511) - 255), -8);
}

/* fp32 -> fp16 bits for values exact in it (rand_grid's), decoded from the fields. */
static uint16_t exact_f16(float f)
{
	int e;
	double fr;
	uint16_t sign = signbit(f) ? 0x8000u : 0;

	if (f == 0.0f)
		return sign;
	fr = frexp(fabs((double)f), &e); /* |f| = fr * 2^e, fr in [0.5, 1) */
	return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) |
			  (uint16_t)((fr * 2.0 - 1.0) * 1024.0));
}

static void *alloc_zero(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);

	cr_assert_not_null(p);
	return p;
}

/* Grads for K steps: grads_f32[k][i] are the values, grads[k] the buffer in dtype. */
struct grads {
	float *vals[K];
	void *buf[K];
};

static void grads_make(struct grads *g, size_t n, uint32_t dtype)
{
	for (int k = 0; k < K; k++) {
		g->vals[k] = alloc_zero(n, sizeof(float));
		g->buf[k] = alloc_zero(n, shardd_dtype_size(dtype));
		for (size_t i = 0; i < n; i++) {
			float v = dtype == SHARDD_DTYPE_FP32 ? rand_f32() : rand_grid();

			g->vals[k][i] = v;
			if (dtype == SHARDD_DTYPE_FP32)
				((float *)g->buf[k])[i] = v;
			else if (dtype == SHARDD_DTYPE_BF16)
				((uint16_t *)g->buf[k])[i] = shardd_bf16_truncate(v);
			else
				((uint16_t *)g->buf[k])[i] = exact_f16(v);
		}
	}
}

static void grads_free(struct grads *g)
{
	for (int k = 0; k < K; k++) {
		free(g->vals[k]);
		free(g->buf[k]);
	}
}

/* The learning rate of step k (1-based): a schedule, so each step's lr must be used. */
static double lr_at(double lr, int k)
{
	return lr * (1.0 + 0.25 * (k - 1));
}

/* What variant 1 of a case is: the path, or the dispatching call on a split range. */
static const char *variant_name(enum shardd_k_isa isa)
{
	return isa == SHARDD_K_ISA_PORTABLE ? "dispatching call on a split range"
					    : shardd_k_isa_name(isa);
}

static void require_isa(enum shardd_k_isa isa)
{
	if (!shardd_k_isa_available(isa))
		cr_skip_test("this CPU has no %s: that path cannot run here",
			     shardd_k_isa_name(isa));
}

/* got within TOL_ULPS roundings of the magnitude mag from want. */
static void expect_close(const char *what, size_t i, size_t n, int step, double want, float got,
			 double mag)
{
	double tol = TOL_ULPS * HALF_ULP * mag;

	cr_assert(
		fabs((double)got - want) <= tol,
		"%s[%zu] of %zu after step %d: kernel %.9g, reference %.9g, |diff| %.3g > tolerance %.3g",
		what, i, n, step, (double)got, want, fabs((double)got - want), tol);
}

static void expect_same_bits(const char *what, const char *path, const float *want,
			     const float *got, size_t n, int step)
{
	for (size_t i = 0; i < n; i++)
		cr_assert(
			!memcmp(want + i, got + i, sizeof(float)),
			"%s[%zu] of %zu after step %d: %s %a, portable path %a (must be the same bits)",
			what, i, n, step, path, (double)got[i], (double)want[i]);
}

/* ---------------------------------------------------------------- SGD --- */

struct sgd_case {
	double momentum, dampening, weight_decay;
	int nesterov, maximize;
	float grad_scale;
};

/* One variant of the kernel under test: a path, or the dispatching call on a split range. */
struct sgd_run {
	float *p, *buf;
};

static void sgd_variant_step(int variant, struct shardd_sgd *a, size_t n)
{
	if (variant < SHARDD_K_ISA_COUNT) {
		shardd_k_sgd_isa((enum shardd_k_isa)variant, a, 0, n);
	} else {
		shardd_k_sgd(a, 0, n / 3);
		shardd_k_sgd(a, n / 3, n);
	}
}

/*
 * torch.optim.SGD's documented algorithm in double, with the magnitudes
 * (the same recurrences on absolute values) that bound the rounding error.
 */
struct sgd_ref {
	double *p, *b, *pmag, *bmag;
};

static void sgd_ref_step(const struct sgd_case *c, struct sgd_ref *r, const float *grad, size_t n,
			 double lr, int step)
{
	for (size_t i = 0; i < n; i++) {
		double g = (double)grad[i] * (double)c->grad_scale, gmag;

		if (c->maximize)
			g = -g;
		gmag = fabs(g);
		if (c->weight_decay != 0) {
			g += c->weight_decay * r->p[i];
			gmag += c->weight_decay * r->pmag[i];
		}
		if (c->momentum != 0) {
			if (step == 1) {
				r->b[i] = g;
				r->bmag[i] = gmag;
			} else {
				r->b[i] = c->momentum * r->b[i] + (1 - c->dampening) * g;
				r->bmag[i] =
					c->momentum * r->bmag[i] + fabs(1 - c->dampening) * gmag;
			}
			if (c->nesterov) {
				g += c->momentum * r->b[i];
				gmag += c->momentum * r->bmag[i];
			} else {
				g = r->b[i];
				gmag = r->bmag[i];
			}
		}
		r->p[i] -= lr * g;
		r->pmag[i] += lr * gmag;
	}
}

static void sgd_case_run(const struct sgd_case *c, enum shardd_k_isa isa, size_t n,
			 uint32_t grad_dtype)
{
	const double lr = 0.05;
	int variants[2] = { SHARDD_K_ISA_PORTABLE,
			    isa == SHARDD_K_ISA_PORTABLE ? SHARDD_K_ISA_COUNT : (int)isa };
	struct sgd_run run[2];
	struct sgd_ref r;
	struct grads g;
	float *p0 = alloc_zero(n, sizeof(float));

	for (size_t i = 0; i < n; i++)
		p0[i] = rand_f32();
	grads_make(&g, n, grad_dtype);
	r.p = alloc_zero(n, sizeof(double));
	r.b = alloc_zero(n, sizeof(double));
	r.pmag = alloc_zero(n, sizeof(double));
	r.bmag = alloc_zero(n, sizeof(double));
	for (size_t i = 0; i < n; i++) {
		r.p[i] = p0[i];
		r.pmag[i] = fabs((double)p0[i]);
	}
	for (int v = 0; v < 2; v++) {
		run[v].p = alloc_zero(n, sizeof(float));
		run[v].buf = alloc_zero(n, sizeof(float));
		memcpy(run[v].p, p0, n * sizeof(float));
		/* Garbage in the buffer: step 1 must not read it. */
		for (size_t i = 0; i < n; i++)
			run[v].buf[i] = 1e30f;
	}

	for (int k = 1; k <= K; k++) {
		double lrk = lr_at(lr, k);

		for (int v = 0; v < 2; v++) {
			struct shardd_sgd a = {
				.param = run[v].p,
				.grad = g.buf[k - 1],
				.grad_dtype = grad_dtype,
				.momentum_buffer = c->momentum != 0 ? run[v].buf : NULL,
				.step = (uint64_t)k,
				.lr = lrk,
				.momentum = c->momentum,
				.dampening = c->dampening,
				.weight_decay = c->weight_decay,
				.nesterov = c->nesterov,
				.maximize = c->maximize,
				.grad_scale = c->grad_scale,
			};
			char why[256];

			cr_assert_eq(shardd_k_sgd_check(&a, why, sizeof(why)), 0, "%s", why);
			sgd_variant_step(variants[v], &a, n);
		}
		sgd_ref_step(c, &r, g.vals[k - 1], n, lrk, k);
		expect_same_bits("param", variant_name(isa), run[0].p, run[1].p, n, k);
		if (c->momentum != 0)
			expect_same_bits("momentum_buffer", variant_name(isa), run[0].buf,
					 run[1].buf, n, k);
		for (size_t i = 0; i < n; i++) {
			expect_close("param", i, n, k, r.p[i], run[0].p[i], r.pmag[i]);
			if (c->momentum != 0)
				expect_close("momentum_buffer", i, n, k, r.b[i], run[0].buf[i],
					     r.bmag[i]);
		}
	}

	for (int v = 0; v < 2; v++) {
		free(run[v].p);
		free(run[v].buf);
	}
	free(r.p);
	free(r.b);
	free(r.pmag);
	free(r.bmag);
	free(p0);
	grads_free(&g);
}

/* Every valid combination (nesterov needs momentum > 0 and dampening 0), every size. */
static void sgd_all_cases(enum shardd_k_isa isa, uint32_t grad_dtype)
{
	static const double moms[] = { 0.0, 0.9 }, damps[] = { 0.0, 0.5 }, wds[] = { 0.0, 0.01 };
	static const float scales[] = { 1.0f, 0.37f };

	for (int mi = 0; mi < 2; mi++)
		for (int di = 0; di < 2; di++)
			for (int nest = 0; nest < 2; nest++)
				for (int wi = 0; wi < 2; wi++)
					for (int max = 0; max < 2; max++)
						for (int si = 0; si < 2; si++) {
							struct sgd_case c = {
								moms[mi], damps[di], wds[wi],
								nest,     max,       scales[si]
							};

							if (nest &&
							    (c.momentum == 0 || c.dampening != 0))
								continue;
							for (size_t s = 0; s < NSIZES; s++)
								sgd_case_run(&c, isa, sizes[s],
									     grad_dtype);
						}
}

Test(optim_sgd, portable_matches_torch_reference_for_every_option_and_size, .timeout = 60)
{
	sgd_all_cases(SHARDD_K_ISA_PORTABLE, SHARDD_DTYPE_FP32);
}

Test(optim_sgd, avx2_matches_portable_bits_and_reference, .timeout = 60)
{
	require_isa(SHARDD_K_ISA_AVX2);
	sgd_all_cases(SHARDD_K_ISA_AVX2, SHARDD_DTYPE_FP32);
}

Test(optim_sgd, avx512_matches_portable_bits_and_reference, .timeout = 60)
{
	require_isa(SHARDD_K_ISA_AVX512);
	sgd_all_cases(SHARDD_K_ISA_AVX512, SHARDD_DTYPE_FP32);
}

Test(optim_sgd, bf16_and_fp16_grads_are_widened_exactly, .timeout = 60)
{
	struct sgd_case c = { 0.9, 0.1, 0.01, 0, 0, 1.0f };

	for (int isa = 0; isa < SHARDD_K_ISA_COUNT; isa++) {
		if (!shardd_k_isa_available((enum shardd_k_isa)isa))
			continue;
		for (size_t s = 0; s < NSIZES; s++) {
			sgd_case_run(&c, (enum shardd_k_isa)isa, sizes[s], SHARDD_DTYPE_BF16);
			sgd_case_run(&c, (enum shardd_k_isa)isa, sizes[s], SHARDD_DTYPE_FP16);
		}
	}
}

/* -------------------------------------------------------------- AdamW --- */

struct adamw_case {
	double beta1, beta2, weight_decay;
	int amsgrad, maximize;
	float grad_scale;
};

struct adamw_run {
	float *p, *m, *v, *vmax;
};

static void adamw_variant_step(int variant, struct shardd_adamw *a, size_t n)
{
	if (variant < SHARDD_K_ISA_COUNT) {
		shardd_k_adamw_isa((enum shardd_k_isa)variant, a, 0, n);
	} else {
		shardd_k_adamw(a, 0, n / 3);
		shardd_k_adamw(a, n / 3, n);
	}
}

/* torch.optim.AdamW's documented algorithm in double, with magnitudes. */
struct adamw_ref {
	double *p, *m, *v, *vmax, *pmag, *mmag;
};

static void adamw_ref_step(const struct adamw_case *c, struct adamw_ref *r, const float *grad,
			   size_t n, double lr, double eps, int step)
{
	double bc1 = 1 - pow(c->beta1, step), bc2 = 1 - pow(c->beta2, step);

	for (size_t i = 0; i < n; i++) {
		double g = (double)grad[i] * (double)c->grad_scale, vv, den;

		if (c->maximize)
			g = -g;
		r->p[i] *= 1 - lr * c->weight_decay;
		r->pmag[i] *= 1 - lr * c->weight_decay;
		r->m[i] = c->beta1 * r->m[i] + (1 - c->beta1) * g;
		r->mmag[i] = c->beta1 * r->mmag[i] + (1 - c->beta1) * fabs(g);
		r->v[i] = c->beta2 * r->v[i] + (1 - c->beta2) * g * g;
		vv = r->v[i];
		if (c->amsgrad) {
			r->vmax[i] = fmax(r->vmax[i], r->v[i]);
			vv = r->vmax[i];
		}
		den = sqrt(vv) / sqrt(bc2) + eps;
		r->p[i] -= lr / bc1 * r->m[i] / den;
		r->pmag[i] += lr / bc1 * r->mmag[i] / den;
	}
}

static void adamw_case_run(const struct adamw_case *c, enum shardd_k_isa isa, size_t n,
			   uint32_t grad_dtype)
{
	const double lr = 0.01, eps = 1e-8;
	int variants[2] = { SHARDD_K_ISA_PORTABLE,
			    isa == SHARDD_K_ISA_PORTABLE ? SHARDD_K_ISA_COUNT : (int)isa };
	struct adamw_run run[2];
	struct adamw_ref r;
	struct grads g;
	float *p0 = alloc_zero(n, sizeof(float));

	for (size_t i = 0; i < n; i++)
		p0[i] = rand_f32();
	grads_make(&g, n, grad_dtype);
	r.p = alloc_zero(n, sizeof(double));
	r.m = alloc_zero(n, sizeof(double));
	r.v = alloc_zero(n, sizeof(double));
	r.vmax = alloc_zero(n, sizeof(double));
	r.pmag = alloc_zero(n, sizeof(double));
	r.mmag = alloc_zero(n, sizeof(double));
	for (size_t i = 0; i < n; i++) {
		r.p[i] = p0[i];
		r.pmag[i] = fabs((double)p0[i]);
	}
	for (int v = 0; v < 2; v++) {
		run[v].p = alloc_zero(n, sizeof(float));
		run[v].m = alloc_zero(n, sizeof(float));
		run[v].v = alloc_zero(n, sizeof(float));
		run[v].vmax = alloc_zero(n, sizeof(float));
		memcpy(run[v].p, p0, n * sizeof(float));
	}

	for (int k = 1; k <= K; k++) {
		double lrk = lr_at(lr, k);

		for (int v = 0; v < 2; v++) {
			struct shardd_adamw a = {
				.param = run[v].p,
				.grad = g.buf[k - 1],
				.grad_dtype = grad_dtype,
				.exp_avg = run[v].m,
				.exp_avg_sq = run[v].v,
				.max_exp_avg_sq = c->amsgrad ? run[v].vmax : NULL,
				.step = (uint64_t)k,
				.lr = lrk,
				.beta1 = c->beta1,
				.beta2 = c->beta2,
				.eps = eps,
				.weight_decay = c->weight_decay,
				.amsgrad = c->amsgrad,
				.maximize = c->maximize,
				.grad_scale = c->grad_scale,
			};
			char why[256];

			cr_assert_eq(shardd_k_adamw_check(&a, why, sizeof(why)), 0, "%s", why);
			adamw_variant_step(variants[v], &a, n);
		}
		adamw_ref_step(c, &r, g.vals[k - 1], n, lrk, eps, k);
		expect_same_bits("param", variant_name(isa), run[0].p, run[1].p, n, k);
		expect_same_bits("exp_avg", variant_name(isa), run[0].m, run[1].m, n, k);
		expect_same_bits("exp_avg_sq", variant_name(isa), run[0].v, run[1].v, n, k);
		if (c->amsgrad)
			expect_same_bits("max_exp_avg_sq", variant_name(isa), run[0].vmax,
					 run[1].vmax, n, k);
		for (size_t i = 0; i < n; i++) {
			expect_close("param", i, n, k, r.p[i], run[0].p[i], r.pmag[i]);
			expect_close("exp_avg", i, n, k, r.m[i], run[0].m[i], r.mmag[i]);
			expect_close("exp_avg_sq", i, n, k, r.v[i], run[0].v[i], r.v[i]);
			if (c->amsgrad)
				expect_close("max_exp_avg_sq", i, n, k, r.vmax[i], run[0].vmax[i],
					     r.vmax[i]);
		}
	}

	for (int v = 0; v < 2; v++) {
		free(run[v].p);
		free(run[v].m);
		free(run[v].v);
		free(run[v].vmax);
	}
	free(r.p);
	free(r.m);
	free(r.v);
	free(r.vmax);
	free(r.pmag);
	free(r.mmag);
	free(p0);
	grads_free(&g);
}

/* Every combination; betas (0.3, 0.95) take lerp's second form (weight 0.7 >= 0.5). */
static void adamw_all_cases(enum shardd_k_isa isa, uint32_t grad_dtype)
{
	static const double b1s[] = { 0.9, 0.3 }, b2s[] = { 0.999, 0.95 }, wds[] = { 0.0, 0.1 };
	static const float scales[] = { 1.0f, 0.37f };

	for (int bi = 0; bi < 2; bi++)
		for (int ams = 0; ams < 2; ams++)
			for (int wi = 0; wi < 2; wi++)
				for (int max = 0; max < 2; max++)
					for (int si = 0; si < 2; si++) {
						struct adamw_case c = {
							b1s[bi], b2s[bi], wds[wi],
							ams,     max,     scales[si]
						};

						for (size_t s = 0; s < NSIZES; s++)
							adamw_case_run(&c, isa, sizes[s],
								       grad_dtype);
					}
}

Test(optim_adamw, portable_matches_torch_reference_for_every_option_and_size, .timeout = 60)
{
	adamw_all_cases(SHARDD_K_ISA_PORTABLE, SHARDD_DTYPE_FP32);
}

Test(optim_adamw, avx2_matches_portable_bits_and_reference, .timeout = 60)
{
	require_isa(SHARDD_K_ISA_AVX2);
	adamw_all_cases(SHARDD_K_ISA_AVX2, SHARDD_DTYPE_FP32);
}

Test(optim_adamw, avx512_matches_portable_bits_and_reference, .timeout = 60)
{
	require_isa(SHARDD_K_ISA_AVX512);
	adamw_all_cases(SHARDD_K_ISA_AVX512, SHARDD_DTYPE_FP32);
}

Test(optim_adamw, bf16_and_fp16_grads_are_widened_exactly, .timeout = 60)
{
	struct adamw_case c = { 0.9, 0.999, 0.1, 1, 0, 1.0f };

	for (int isa = 0; isa < SHARDD_K_ISA_COUNT; isa++) {
		if (!shardd_k_isa_available((enum shardd_k_isa)isa))
			continue;
		for (size_t s = 0; s < NSIZES; s++) {
			adamw_case_run(&c, (enum shardd_k_isa)isa, sizes[s], SHARDD_DTYPE_BF16);
			adamw_case_run(&c, (enum shardd_k_isa)isa, sizes[s], SHARDD_DTYPE_FP16);
		}
	}
}

Test(optim_adamw, range_updates_only_its_elements, .timeout = 10)
{
	enum {
		N = 100
	};
	float p[N], gr[N], m[N], v[N];
	struct shardd_adamw a = {
		.param = p,
		.grad = gr,
		.grad_dtype = SHARDD_DTYPE_FP32,
		.exp_avg = m,
		.exp_avg_sq = v,
		.step = 1,
		.lr = 0.1,
		.beta1 = 0.9,
		.beta2 = 0.999,
		.eps = 1e-8,
		.weight_decay = 0.01,
		.grad_scale = 1.0f,
	};

	for (int i = 0; i < N; i++) {
		p[i] = 1.0f;
		gr[i] = 1.0f;
		m[i] = v[i] = 0.0f;
	}
	shardd_k_adamw(&a, 17, 83);
	for (int i = 0; i < N; i++) {
		int inside = i >= 17 && i < 83;

		/* Step 1 with grad 1: m = 0.1, v = 0.001, update = -lr * 1 (bias-corrected), decay 0.999. */
		cr_assert_float_eq(p[i], inside ? 0.999f - 0.1f : 1.0f, 1e-6, "param[%d]", i);
		cr_assert_float_eq(m[i], inside ? 0.1f : 0.0f, 1e-7, "exp_avg[%d]", i);
		cr_assert_float_eq(v[i], inside ? 0.001f : 0.0f, 1e-9, "exp_avg_sq[%d]", i);
	}
}

/* ---------------------------------------------------------- grad norm --- */

/* Double reference: sum of squares (exact products, n << 2^29 so the sum is within n ulps) and max |g|. */
static void norm_ref(const float *g, size_t n, double *sumsq, double *max_abs)
{
	*sumsq = 0;
	*max_abs = 0;
	for (size_t i = 0; i < n; i++) {
		*sumsq += (double)g[i] * (double)g[i];
		if (!isnan(g[i]) && fabs((double)g[i]) > *max_abs)
			*max_abs = fabs((double)g[i]);
	}
}

Test(optim_grad_norm, every_path_gives_the_same_bits_and_matches_double_sum, .timeout = 30)
{
	static const size_t more[] = { 31, 33, 512, 513, 100003 };

	for (int dt = 0; dt < 3; dt++) {
		uint32_t dtype = dt == 0   ? SHARDD_DTYPE_FP32
				 : dt == 1 ? SHARDD_DTYPE_BF16
					   : SHARDD_DTYPE_FP16;

		for (size_t s = 0; s < NSIZES + 5; s++) {
			size_t n = s < NSIZES ? sizes[s] : more[s - NSIZES];
			float *vals = alloc_zero(n, sizeof(float));
			void *buf = alloc_zero(n, shardd_dtype_size(dtype));
			struct shardd_grad_norm_part want, got;
			double sumsq, max_abs;

			for (size_t i = 0; i < n; i++) {
				vals[i] = dtype == SHARDD_DTYPE_FP32 ? rand_f32() * 1e3f
								     : rand_grid();
				if (dtype == SHARDD_DTYPE_FP32)
					((float *)buf)[i] = vals[i];
				else if (dtype == SHARDD_DTYPE_BF16)
					((uint16_t *)buf)[i] = shardd_bf16_truncate(vals[i]);
				else
					((uint16_t *)buf)[i] = exact_f16(vals[i]);
			}
			norm_ref(vals, n, &sumsq, &max_abs);
			shardd_k_grad_norm_part_isa(SHARDD_K_ISA_PORTABLE, buf, dtype, 0, n, &want);
			cr_assert(fabs(want.sumsq - sumsq) <= (double)n * DBL_EPSILON * sumsq,
				  "%s n %zu: sumsq %.17g, reference %.17g",
				  shardd_dtype_name(dtype), n, want.sumsq, sumsq);
			cr_assert_eq((double)want.max_abs, max_abs, "%s n %zu: max_abs",
				     shardd_dtype_name(dtype), n);
			cr_assert_eq(want.nonfinite, 0);
			for (int isa = 1; isa < SHARDD_K_ISA_COUNT; isa++) {
				if (!shardd_k_isa_available((enum shardd_k_isa)isa))
					continue;
				shardd_k_grad_norm_part_isa((enum shardd_k_isa)isa, buf, dtype, 0,
							    n, &got);
				cr_assert(!memcmp(&got.sumsq, &want.sumsq, sizeof(double)) &&
						  got.max_abs == want.max_abs,
					  "%s n %zu: %s path sumsq %a max %a, portable %a %a",
					  shardd_dtype_name(dtype), n,
					  shardd_k_isa_name((enum shardd_k_isa)isa), got.sumsq,
					  (double)got.max_abs, want.sumsq, (double)want.max_abs);
			}
			free(vals);
			free(buf);
		}
	}
}

Test(optim_grad_norm, parts_of_a_split_range_merge_to_the_whole, .timeout = 10)
{
	enum {
		N = 5000
	};
	float g[N];
	struct shardd_grad_norm_part total = { 0 }, part, whole;
	double sumsq, max_abs;

	for (int i = 0; i < N; i++)
		g[i] = rand_f32();
	norm_ref(g, N, &sumsq, &max_abs);
	for (size_t lo = 0; lo < N; lo += 1536) {
		shardd_k_grad_norm_part(g, SHARDD_DTYPE_FP32, lo, lo + 1536 < N ? lo + 1536 : N,
					&part);
		shardd_k_grad_norm_merge(&total, &part);
	}
	shardd_k_grad_norm_part(g, SHARDD_DTYPE_FP32, 0, N, &whole);
	cr_assert(fabs(total.sumsq - sumsq) <= N * DBL_EPSILON * sumsq);
	cr_assert(fabs(whole.sumsq - sumsq) <= N * DBL_EPSILON * sumsq);
	cr_assert_eq((double)total.max_abs, max_abs);
	cr_assert_eq(total.nonfinite, 0);
}

Test(optim_grad_norm, nan_or_inf_anywhere_sets_nonfinite_and_max_skips_nan, .timeout = 10)
{
	enum {
		N = 1000
	};
	static const size_t where[] = { 0, 15, 16, 511, 512, 999 };
	float g[N];

	for (size_t w = 0; w < sizeof(where) / sizeof(where[0]); w++) {
		for (int bad = 0; bad < 3; bad++) {
			struct shardd_grad_norm_part part;

			for (int i = 0; i < N; i++)
				g[i] = 0.5f;
			g[where[w]] = bad == 0 ? NAN : bad == 1 ? INFINITY : -INFINITY;
			for (int isa = 0; isa < SHARDD_K_ISA_COUNT; isa++) {
				if (!shardd_k_isa_available((enum shardd_k_isa)isa))
					continue;
				shardd_k_grad_norm_part_isa((enum shardd_k_isa)isa, g,
							    SHARDD_DTYPE_FP32, 0, N, &part);
				cr_assert_eq(part.nonfinite, 1, "%s: element %zu = %g not flagged",
					     shardd_k_isa_name((enum shardd_k_isa)isa), where[w],
					     (double)g[where[w]]);
				cr_assert_eq(part.max_abs, bad == 0 ? 0.5f : INFINITY,
					     "%s: max_abs %g with %g at %zu",
					     shardd_k_isa_name((enum shardd_k_isa)isa),
					     (double)part.max_abs, (double)g[where[w]], where[w]);
			}
		}
	}
}

/* ---------------------------------------------------------- arguments --- */

Test(optim_check, bad_hyperparameters_are_named_with_their_value, .timeout = 5)
{
	float p[1], g[1], m[1], v[1];
	struct shardd_adamw ok_adamw = {
		.param = p,
		.grad = g,
		.grad_dtype = SHARDD_DTYPE_FP32,
		.exp_avg = m,
		.exp_avg_sq = v,
		.step = 1,
		.lr = 1e-3,
		.beta1 = 0.9,
		.beta2 = 0.999,
		.eps = 1e-8,
		.grad_scale = 1.0f,
	};
	struct shardd_sgd ok_sgd = {
		.param = p,
		.grad = g,
		.grad_dtype = SHARDD_DTYPE_FP32,
		.momentum_buffer = m,
		.step = 1,
		.lr = 0.1,
		.momentum = 0.9,
		.grad_scale = 1.0f,
	};
	struct shardd_adamw a;
	struct shardd_sgd s;
	char why[256];

	cr_assert_eq(shardd_k_adamw_check(&ok_adamw, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(shardd_k_sgd_check(&ok_sgd, why, sizeof(why)), 0, "%s", why);

	a = ok_adamw;
	a.lr = -0.5;
	cr_assert_eq(shardd_k_adamw_check(&a, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "lr -0.5"), "%s", why);
	a = ok_adamw;
	a.beta2 = 1.0;
	cr_assert_eq(shardd_k_adamw_check(&a, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "betas[1] 1"), "%s", why);
	a = ok_adamw;
	a.eps = NAN;
	cr_assert_eq(shardd_k_adamw_check(&a, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "eps nan"), "%s", why);
	a = ok_adamw;
	a.amsgrad = 1;
	cr_assert_eq(shardd_k_adamw_check(&a, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "max_exp_avg_sq"), "%s", why);
	a = ok_adamw;
	a.step = 0;
	cr_assert_eq(shardd_k_adamw_check(&a, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "step 0"), "%s", why);

	s = ok_sgd;
	s.nesterov = 1;
	s.dampening = 0.1;
	cr_assert_eq(shardd_k_sgd_check(&s, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "nesterov"), "%s", why);
	s = ok_sgd;
	s.grad_dtype = 7;
	cr_assert_eq(shardd_k_sgd_check(&s, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "grad_dtype 7"), "%s", why);
	s = ok_sgd;
	s.momentum_buffer = NULL;
	cr_assert_eq(shardd_k_sgd_check(&s, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "momentum_buffer"), "%s", why);
	s = ok_sgd;
	s.weight_decay = -1;
	cr_assert_eq(shardd_k_sgd_check(&s, why, sizeof(why)), -SHARDD_E_INVALID);
	cr_assert(strstr(why, "weight_decay -1"), "%s", why);
}

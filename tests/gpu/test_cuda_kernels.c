/* SPDX-License-Identifier: MIT */
/*
 * CUDA kernels against the CPU kernels on fresh random data: every dtype
 * pair, several sizes (odd ones and ones that leave a tail after the 8-wide
 * vector steps), and offsets that break 16-byte alignment so the scalar
 * paths run too. The CUDA kernels promise the CPU's numerics bit for bit,
 * so results must be identical; the only exception is a NaN produced by
 * arithmetic (not by a cast), whose payload the hardware chooses, so two
 * NaNs compare equal there.
 */
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "shardd_cuda_kernels.h"
#include "shardd_kernels.h"
#include "shardd_proto.h"
#include "xorshift.h"

static const uint32_t dtypes[] = { SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16 };

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint64_t rng(void)
{
	return xorshift64s(&rng_state);
}

static void require_device(void)
{
	int n = 0;

	if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
		cr_skip_test("no CUDA device visible");
}

static void *dev_alloc(size_t bytes)
{
	void *p = NULL;

	CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
	return p;
}

/* Random contents: any bit pattern for 16-bit dtypes, varied fp32 values with specials. */
static void fill_random(void *buf, uint32_t dtype, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t r = rng();

		if (dtype == SHARDD_DTYPE_FP32) {
			uint32_t u = (uint32_t)r;

			if ((r >> 32) % 8 != 0) /* mostly finite, within fp16's range and below */
				u = (u & 0x807fffffu) | ((uint32_t)(100 + (r >> 40) % 45) << 23);
			memcpy((float *)buf + i, &u, sizeof(u));
		} else {
			((uint16_t *)buf)[i] = (uint16_t)r;
		}
	}
}

/* Finite values on a grid, with a sprinkling of NaN, Inf and -0: reduce inputs. */
static void fill_values(void *buf, uint32_t dtype, size_t n)
{
	float tmp[256];

	for (size_t i = 0; i < n; i += 256) {
		size_t len = n - i < 256 ? n - i : 256;

		for (size_t j = 0; j < len; j++) {
			uint64_t r = rng();

			switch (r % 64) {
			case 0:
				tmp[j] = NAN;
				break;
			case 1:
				tmp[j] = (r >> 8) & 1 ? INFINITY : -INFINITY;
				break;
			case 2:
				tmp[j] = -0.0f;
				break;
			default:
				tmp[j] = ldexpf((float)((int64_t)((r >> 8) % 20001) - 10000), -6);
				break;
			}
		}
		shardd_k_cast((char *)buf + i * shardd_dtype_size(dtype), dtype, tmp,
			      SHARDD_DTYPE_FP32, len);
	}
}

static double value(uint32_t dtype, const void *buf, size_t i)
{
	if (dtype == SHARDD_DTYPE_BF16)
		return shardd_bf16_to_f32(((const uint16_t *)buf)[i]);
	if (dtype == SHARDD_DTYPE_FP16)
		return shardd_f16_to_f32(((const uint16_t *)buf)[i]);
	return ((const float *)buf)[i];
}

/* Identical bits, or both NaN when `nan_any` (arithmetic NaNs). */
static void expect_same(uint32_t dtype, const void *want, const void *got, size_t n, int nan_any,
			const char *what)
{
	size_t sz = shardd_dtype_size(dtype);

	for (size_t i = 0; i < n; i++) {
		const char *w = (const char *)want + i * sz, *g = (const char *)got + i * sz;

		if (!memcmp(w, g, sz))
			continue;
		if (nan_any && isnan(value(dtype, want, i)) && isnan(value(dtype, got, i)))
			continue;
		cr_assert_fail("%s: element %zu of %zu: cpu %a, cuda %a", what, i, n,
			       value(dtype, want, i), value(dtype, got, i));
	}
}

Test(cuda, cast_matches_cpu_for_every_pair_size_and_offset, .timeout = 60, .init = require_device)
{
	static const size_t sizes[] = { 1, 7, 8, 9, 1000, 4099, (1u << 20) + 3 };
	static const size_t offsets[][2] = { { 0, 0 }, { 1, 0 }, { 0, 3 }, { 5, 5 } };
	size_t maxn = (1u << 20) + 3 + 8;
	void *src = malloc(maxn * 4), *want = malloc(maxn * 4), *got = malloc(maxn * 4);
	char *dsrc = dev_alloc(maxn * 4), *ddst = dev_alloc(maxn * 4);
	char what[128];

	for (size_t a = 0; a < 3; a++)
		for (size_t b = 0; b < 3; b++)
			for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++)
				for (size_t o = 0; o < sizeof(offsets) / sizeof(offsets[0]); o++) {
					uint32_t sd = dtypes[a], dd = dtypes[b];
					size_t n = sizes[s], ssz = shardd_dtype_size(sd),
					       dsz = shardd_dtype_size(dd);
					size_t so = offsets[o][0] * ssz, dof = offsets[o][1] * dsz;

					fill_random(src, sd, n);
					shardd_k_cast(want, dd, src, sd, n);
					CUDA_OK(cudaMemcpy(dsrc + so, src, n * ssz,
							   cudaMemcpyHostToDevice));
					cr_assert_eq(shardd_cuda_cast(ddst + dof, dd, dsrc + so, sd,
								      n, NULL),
						     0);
					CUDA_OK(cudaDeviceSynchronize());
					CUDA_OK(cudaMemcpy(got, ddst + dof, n * dsz,
							   cudaMemcpyDeviceToHost));
					snprintf(what, sizeof(what),
						 "cast %s->%s n=%zu offsets %zu,%zu",
						 shardd_dtype_name(sd), shardd_dtype_name(dd), n,
						 offsets[o][0], offsets[o][1]);
					expect_same(dd, want, got, n, 0, what);
				}
	cudaFree(dsrc);
	cudaFree(ddst);
	free(src);
	free(want);
	free(got);
}

Test(cuda, zero_clears_exactly_the_range, .timeout = 30, .init = require_device)
{
	enum {
		N = 4096
	};
	uint8_t *host = malloc(N);
	uint8_t *d = dev_alloc(N);

	CUDA_OK(cudaMemset(d, 0xa5, N));
	cr_assert_eq(shardd_cuda_zero(d + 3, 3001, NULL), 0);
	CUDA_OK(cudaDeviceSynchronize());
	CUDA_OK(cudaMemcpy(host, d, N, cudaMemcpyDeviceToHost));
	for (size_t i = 0; i < N; i++)
		cr_assert_eq(host[i], i >= 3 && i < 3004 ? 0 : 0xa5, "byte %zu", i);
	cudaFree(d);
	free(host);
}

Test(cuda, chunk_cat_matches_cpu_including_batches_of_chunks, .timeout = 120,
     .init = require_device)
{
	static const uint32_t nchunks_list[] = { 1, 3, 200 };
	static const size_t outer_list[] = { 1, 5 };
	static const size_t inner_list[] = { 1, 8, 24, 1001 };
	static const size_t offsets[] = { 0, 1 };
	char what[160];

	for (size_t a = 0; a < 3; a++)
		for (size_t b = 0; b < 3; b++)
			for (size_t c = 0; c < 3; c++)
				for (size_t d = 0; d < 2; d++)
					for (size_t e = 0; e < 4; e++)
						for (size_t f = 0; f < 2; f++) {
							uint32_t sd = dtypes[a], dd = dtypes[b],
								 nch = nchunks_list[c];
							size_t outer = outer_list[d],
							       inner = inner_list[e],
							       off = offsets[f];
							size_t ssz = shardd_dtype_size(sd),
							       dsz = shardd_dtype_size(dd),
							       per = outer * inner;
							size_t total = per * nch;
							char *hsrc = malloc(total * ssz),
							     *want = malloc(total * dsz),
							     *got = malloc(total * dsz);
							char *dsrc = dev_alloc((total + nch * 8) *
									       ssz),
							     *ddst = dev_alloc((total + 8) * dsz);
							const void **hptr = malloc(nch *
										   sizeof(*hptr)),
								   **dptr = malloc(nch *
										   sizeof(*dptr));

							fill_random(hsrc, sd, total);
							for (uint32_t r = 0; r < nch; r++) {
								/* Chunks live apart, each shifted by `off` elements. */
								char *p = dsrc + (r * (per + 8) +
										  off) * ssz;

								hptr[r] = hsrc + r * per * ssz;
								dptr[r] = p;
								CUDA_OK(cudaMemcpy(
									p, hptr[r], per * ssz,
									cudaMemcpyHostToDevice));
							}
							shardd_k_chunk_cat(want, dd, hptr, sd, nch,
									   outer, inner);
							cr_assert_eq(shardd_cuda_chunk_cat(
									     ddst + off * dsz, dd,
									     dptr, sd, nch, outer,
									     inner, NULL),
								     0);
							CUDA_OK(cudaDeviceSynchronize());
							CUDA_OK(cudaMemcpy(got, ddst + off * dsz,
									   total * dsz,
									   cudaMemcpyDeviceToHost));
							snprintf(
								what, sizeof(what),
								"chunk_cat %s->%s nchunks=%u outer=%zu inner=%zu offset %zu",
								shardd_dtype_name(sd),
								shardd_dtype_name(dd), nch, outer,
								inner, off);
							expect_same(dd, want, got, total, 0, what);
							cudaFree(dsrc);
							cudaFree(ddst);
							free(hsrc);
							free(want);
							free(got);
							free(hptr);
							free(dptr);
						}
}

static void check_reduce(uint32_t idt, uint32_t rd, uint32_t od, uint32_t nin, size_t n, size_t off,
			 const struct shardd_reduce_math *mm, int with_add, int accumulate)
{
	size_t isz = shardd_dtype_size(idt), osz = shardd_dtype_size(od),
	       rsz = shardd_dtype_size(rd);
	void *hin[8], *din[8];
	char *hadd = malloc(n * rsz), *hout = malloc(n * osz), *got = malloc(n * osz);
	char *dadd = dev_alloc((n + 8) * rsz), *dout = dev_alloc((n + 8) * osz);
	struct shardd_reduce_math m = *mm;
	char what[200];

	for (uint32_t k = 0; k < nin; k++) {
		hin[k] = malloc(n * isz);
		din[k] = (char *)dev_alloc((n + 8) * isz) + off * isz;
		fill_values(hin[k], idt, n);
		CUDA_OK(cudaMemcpy(din[k], hin[k], n * isz, cudaMemcpyHostToDevice));
	}
	fill_values(hadd, rd, n);
	fill_values(hout, od, n);
	CUDA_OK(cudaMemcpy(dadd + off * rsz, hadd, n * rsz, cudaMemcpyHostToDevice));
	CUDA_OK(cudaMemcpy(dout + off * osz, hout, n * osz, cudaMemcpyHostToDevice));

	m.add = with_add ? hadd : NULL;
	shardd_k_reduce(hout, od, accumulate, (const void *const *)hin, nin, idt, n, &m);
	m.add = with_add ? dadd + off * rsz : NULL;
	cr_assert_eq(shardd_cuda_reduce(dout + off * osz, od, accumulate, (const void *const *)din,
					nin, idt, n, &m, NULL),
		     0);
	CUDA_OK(cudaDeviceSynchronize());
	CUDA_OK(cudaMemcpy(got, dout + off * osz, n * osz, cudaMemcpyDeviceToHost));
	snprintf(
		what, sizeof(what),
		"reduce in %s rd %s out %s nin=%u n=%zu off=%zu pre=%g avg=%g post=%g add=%d acc=%d",
		shardd_dtype_name(idt), shardd_dtype_name(rd), shardd_dtype_name(od), nin, n, off,
		(double)mm->pre, (double)mm->avg, (double)mm->post, with_add, accumulate);
	expect_same(od, hout, got, n, 1, what);

	for (uint32_t k = 0; k < nin; k++) {
		cudaFree((char *)din[k] - off * isz);
		free(hin[k]);
	}
	cudaFree(dadd);
	cudaFree(dout);
	free(hadd);
	free(hout);
	free(got);
}

Test(cuda, reduce_matches_cpu_bit_for_bit, .timeout = 300, .init = require_device)
{
	static const struct shardd_reduce_math maths[] = {
		{ .reduce_dtype = 0, .pre = 1, .avg = 1, .post = 1 },
		{ .reduce_dtype = 0, .pre = 1, .avg = 6, .post = 1 },
		{ .reduce_dtype = 0, .pre = 4, .avg = 1, .post = 1.5f },
		{ .reduce_dtype = 0, .pre = 8, .avg = 1, .post = 8 },
	};
	static const size_t sizes[] = { 1, 13, 4103, (1u << 16) + 5 };

	for (uint32_t nin = 1; nin <= 8; nin++)
		for (size_t a = 0; a < 3; a++)
			for (size_t b = 0; b < 3; b++)
				for (size_t c = 0; c < 3; c++)
					for (size_t mi = 0; mi < 4; mi++)
						for (int opt = 0; opt < 4; opt++) {
							struct shardd_reduce_math m = maths[mi];
							size_t pick =
								nin + a + b + c + mi + (size_t)opt;

							m.reduce_dtype = dtypes[b];
							/* Sizes and alignment rotate so each combination sees vector, scalar and tail paths. */
							check_reduce(dtypes[a], dtypes[b],
								     dtypes[c], nin,
								     sizes[pick % 4],
								     (pick / 4) % 2, &m, opt & 1,
								     (opt >> 1) & 1);
						}
}

Test(cuda, reduce_refuses_more_inputs_than_it_can_carry, .timeout = 30, .init = require_device)
{
	const void *in[SHARDD_CUDA_MAX_INPUTS + 1];
	float *d = dev_alloc(64);
	struct shardd_reduce_math m = {
		.reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = 1, .post = 1
	};

	for (int k = 0; k <= SHARDD_CUDA_MAX_INPUTS; k++)
		in[k] = d;
	cr_expect_eq(shardd_cuda_reduce(d, SHARDD_DTYPE_FP32, 0, in, SHARDD_CUDA_MAX_INPUTS + 1,
					SHARDD_DTYPE_FP32, 4, &m, NULL),
		     -SHARDD_E_INVALID);
	cr_expect_eq(
		shardd_cuda_reduce(d, SHARDD_DTYPE_FP32, 0, in, 0, SHARDD_DTYPE_FP32, 4, &m, NULL),
		-SHARDD_E_INVALID);
	cudaFree(d);
}

/* ------------------------------------------------------------ optimizer --- */

/* Finite fp32 values in [-1, 1) with varied exponents (params and fp32 grads). */
static void fill_unit(float *x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		x[i] = ldexpf((float)((int64_t)(rng() >> 40) - (1 << 23)) * 0x1p-23f,
			      -(int)(rng() % 4));
}

/* An fp32 host array copied to a fresh device array. */
static float *dev_copy(const float *h, size_t n)
{
	float *d = dev_alloc(n * sizeof(float));

	CUDA_OK(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
	return d;
}

static void expect_same_f32(const float *want, const float *dev, size_t n, const char *what)
{
	float *got = malloc(n * sizeof(float) + 1);

	CUDA_OK(cudaMemcpy(got, dev, n * sizeof(float), cudaMemcpyDeviceToHost));
	expect_same(SHARDD_DTYPE_FP32, want, got, n, 1, what);
	free(got);
}

/*
 * K steps of SGD or AdamW on the CPU and on the GPU from the same state,
 * over [off, n) (so a range that starts inside the arrays runs too), with a
 * grad in `gdt`: every state array the same bits after every step.
 */
static void check_optim(int adamw, int opt, uint32_t gdt, size_t n, size_t off)
{
	enum {
		STEPS = 5
	};
	size_t gsz = shardd_dtype_size(gdt);
	float *hp = malloc(n * sizeof(float) + 1), *hs[3], *ds[3], *dp;
	void *hg = malloc(n * gsz + 1), *dg = dev_alloc(n * gsz);
	char what[160];

	fill_unit(hp, n);
	dp = dev_copy(hp, n);
	for (int s = 0; s < 3; s++) {
		hs[s] = calloc(n + 1, sizeof(float));
		ds[s] = dev_copy(hs[s], n);
	}
	for (int k = 1; k <= STEPS; k++) {
		fill_values(hg, gdt, n);
		CUDA_OK(cudaMemcpy(dg, hg, n * gsz, cudaMemcpyHostToDevice));
		if (adamw) {
			struct shardd_adamw a = {
				.grad_dtype = gdt,
				.step = (uint64_t)k,
				.lr = 1e-2 * k,
				.beta1 = opt & 1 ? 0.3 : 0.9,
				.beta2 = 0.999,
				.eps = 1e-8,
				.weight_decay = opt & 2 ? 0.1 : 0.0,
				.amsgrad = (opt >> 2) & 1,
				.maximize = (opt >> 3) & 1,
				.grad_scale = opt & 1 ? 0.37f : 1.0f,
			};

			a.param = hp, a.grad = hg, a.exp_avg = hs[0], a.exp_avg_sq = hs[1];
			a.max_exp_avg_sq = a.amsgrad ? hs[2] : NULL;
			shardd_k_adamw(&a, off, n);
			a.param = dp, a.grad = dg, a.exp_avg = ds[0], a.exp_avg_sq = ds[1];
			a.max_exp_avg_sq = a.amsgrad ? ds[2] : NULL;
			cr_assert_eq(shardd_cuda_adamw(&a, off, n, NULL), 0);
		} else {
			struct shardd_sgd a = {
				.grad_dtype = gdt,
				.step = (uint64_t)k,
				.lr = 0.05 * k,
				.momentum = opt & 1 ? 0.9 : 0.0,
				.dampening = opt & 2 ? 0.25 : 0.0,
				.weight_decay = opt & 4 ? 0.01 : 0.0,
				.nesterov = (opt & 3) == 1,
				.maximize = (opt >> 3) & 1,
				.grad_scale = opt & 4 ? 0.37f : 1.0f,
			};

			a.param = hp, a.grad = hg,
			a.momentum_buffer = a.momentum != 0 ? hs[0] : NULL;
			shardd_k_sgd(&a, off, n);
			a.param = dp, a.grad = dg,
			a.momentum_buffer = a.momentum != 0 ? ds[0] : NULL;
			cr_assert_eq(shardd_cuda_sgd(&a, off, n, NULL), 0);
		}
		CUDA_OK(cudaDeviceSynchronize());
		snprintf(what, sizeof(what), "%s opt %d grad %s n=%zu off=%zu step %d: param",
			 adamw ? "adamw" : "sgd", opt, shardd_dtype_name(gdt), n, off, k);
		expect_same_f32(hp, dp, n, what);
		for (int s = 0; s < 3; s++) {
			snprintf(what, sizeof(what),
				 "%s opt %d grad %s n=%zu off=%zu step %d: state %d",
				 adamw ? "adamw" : "sgd", opt, shardd_dtype_name(gdt), n, off, k,
				 s);
			expect_same_f32(hs[s], ds[s], n, what);
		}
	}
	for (int s = 0; s < 3; s++) {
		free(hs[s]);
		cudaFree(ds[s]);
	}
	free(hp);
	free(hg);
	cudaFree(dp);
	cudaFree(dg);
}

Test(cuda, sgd_and_adamw_match_cpu_bit_for_bit, .timeout = 300, .init = require_device)
{
	static const size_t sizes[] = { 1, 17, 4097, (1u << 16) + 3 };

	for (int adamw = 0; adamw < 2; adamw++)
		for (int opt = 0; opt < 16; opt++)
			for (size_t d = 0; d < 3; d++) {
				size_t n = sizes[(opt + d) % 4];

				check_optim(adamw, opt, dtypes[d], n, (opt & 8) && n > 5 ? 5 : 0);
			}
}

Test(cuda, grad_norm_part_matches_cpu, .timeout = 60, .init = require_device)
{
	static const size_t sizes[] = { 0, 1, 255, 4097, (1u << 20) + 7 };
	double *ws = dev_alloc(SHARDD_CUDA_NORM_WS * sizeof(double)), got[2];

	for (size_t d = 0; d < 3; d++) {
		for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
			size_t n = sizes[s], sz = shardd_dtype_size(dtypes[d]);
			void *h = malloc(n * sz + 1), *dg = dev_alloc(n * sz);
			float *tmp = malloc(n * sizeof(float) + 1);
			struct shardd_grad_norm_part want;

			fill_unit(tmp, n);
			shardd_k_cast(h, dtypes[d], tmp, SHARDD_DTYPE_FP32, n);
			CUDA_OK(cudaMemcpy(dg, h, n * sz, cudaMemcpyHostToDevice));
			shardd_k_grad_norm_part(h, dtypes[d], 0, n, &want);
			cr_assert_eq(shardd_cuda_grad_norm_part(dg, dtypes[d], 0, n, ws, NULL), 0);
			CUDA_OK(cudaMemcpy(got, ws, sizeof(got), cudaMemcpyDeviceToHost));
			/* Exact squares summed in two orders: within n fp64 roundings of each other. */
			cr_assert(fabs(got[0] - want.sumsq) <= (double)n * 0x1p-52 * want.sumsq,
				  "%s n=%zu: cuda sumsq %.17g, cpu %.17g",
				  shardd_dtype_name(dtypes[d]), n, got[0], want.sumsq);
			cr_assert_eq(got[1], (double)want.max_abs, "%s n=%zu: max_abs",
				     shardd_dtype_name(dtypes[d]), n);
			free(h);
			free(tmp);
			cudaFree(dg);
		}
	}
	cudaFree(ws);
}

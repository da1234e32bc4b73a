/* SPDX-License-Identifier: MIT */
/*
 * The reference (reference.h). Error bounds, per ref_val:
 *
 * - A rounding to dtype D of a value the implementation may hold with an
 *   error e > 0 (relative to the reference's exact value v) can land on the
 *   other side of a rounding boundary: afterwards the error is at most
 *   e + ulp_D(|v| + e). With e == 0 both round the same value: exact.
 * - An fp32 operation (sum step, divide) whose exact result is not an fp32
 *   value rounds in the implementation but not here: + one fp32 ulp. The
 *   implementation sums in rank order (shardd_k_reduce: sum_k); when every
 *   prefix sum is an fp32 value the sum is exact, else Higham's bound for a
 *   recursive sum, (n - 1) * 2^-24 * sum |x_k|, covers any order.
 * So fp32-exact paths (one rank, power-of-two divides, short bf16/fp16
 * sums) are checked bit for bit, and the others within a bound derived from
 * the arithmetic, not tuned to pass.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "reference.h"

struct fmt {
	int p;      /* significand bits, implicit bit included */
	int emin;   /* exponent of the smallest normal */
	double max; /* largest finite */
};

static struct fmt dtype_fmt(uint32_t dtype)
{
	switch (dtype) {
	case 2:
		return (struct fmt){ 8, -126, ldexp(255.0, 120) }; /* (2 - 2^-7) * 2^127 */
	case 3:
		return (struct fmt){ 11, -14, 65504.0 };
	default:
		return (struct fmt){ 24, -126, ldexp(16777215.0, 104) }; /* (2 - 2^-23) * 2^127 */
	}
}

size_t ref_dtype_size(uint32_t dtype)
{
	return dtype == 1 ? 4 : 2;
}

double ref_round(double x, uint32_t dtype)
{
	struct fmt f = dtype_fmt(dtype);
	int e, lead, q;
	double y;

	if (x == 0 || isnan(x) || isinf(x))
		return x;
	frexp(fabs(x), &e); /* |x| = m * 2^e, 0.5 <= m < 1: leading bit 2^(e-1) */
	lead = e - 1 < f.emin ? f.emin : e - 1;
	q = lead - (f.p - 1);
	/* Scaling by 2^-q is exact in double; nearbyint rounds half to even. */
	y = ldexp(nearbyint(ldexp(x, -q)), q);
	if (fabs(y) > f.max)
		return copysign(INFINITY, x);
	return y;
}

double ref_ulp(double x, uint32_t dtype)
{
	struct fmt f = dtype_fmt(dtype);
	int e, lead;

	if (isinf(x) || isnan(x))
		return INFINITY;
	if (x == 0)
		return ldexp(1.0, f.emin - (f.p - 1));
	frexp(fabs(x), &e);
	lead = e - 1 < f.emin ? f.emin : e - 1;
	return ldexp(1.0, lead - (f.p - 1));
}

void ref_store(void *dst, uint32_t dtype, double x)
{
	if (dtype == 1) {
		float v = (float)x;

		memcpy(dst, &v, 4);
	} else if (dtype == 2) {
		float v = (float)x;
		uint32_t bits;
		uint16_t h;

		memcpy(&bits, &v, 4);
		h = (uint16_t)(bits >> 16); /* exact: x has at most 8 significant bits */
		memcpy(dst, &h, 2);
	} else {
		uint16_t h = signbit(x) ? 0x8000 : 0;
		double a = fabs(x);
		int e;

		if (isinf(a)) {
			h |= 0x7c00;
		} else if (a != 0) {
			frexp(a, &e);
			if (e - 1 >= -14) /* normal: 1.m * 2^(e-1) */
				h |= (uint16_t)(((e - 1 + 15) << 10) |
						(uint16_t)(ldexp(a, -(e - 1)) * 1024.0 - 1024.0));
			else
				h |= (uint16_t)ldexp(a, 24); /* subnormal: m * 2^-24 */
		}
		memcpy(dst, &h, 2);
	}
}

double ref_load(const void *src, uint32_t dtype)
{
	if (dtype == 1) {
		float v;

		memcpy(&v, src, 4);
		return v;
	}
	if (dtype == 2) {
		uint16_t h;
		uint32_t bits;
		float v;

		memcpy(&h, src, 2);
		bits = (uint32_t)h << 16;
		memcpy(&v, &bits, 4);
		return v;
	} else {
		uint16_t h;
		int ex, man;
		double v;

		memcpy(&h, src, 2);
		ex = (h >> 10) & 0x1f;
		man = h & 0x3ff;
		if (ex == 0x1f)
			v = man ? NAN : INFINITY;
		else if (ex == 0)
			v = ldexp(man, -24);
		else
			v = ldexp(1024 + man, ex - 15 - 10);
		return (h & 0x8000) ? -v : v;
	}
}

void ref_divide_factors(uint32_t n, uint32_t reduce_dtype, double *pre, double *post)
{
	/* The seed: data_parallel_size / factor is true division in Python. */
	double factor = 1;

	if (reduce_dtype != 3) {
		*pre = *post = 0;
		return;
	}
	while (fmod((double)n, factor) == 0 && (double)n / factor > factor)
		factor *= 2;
	*pre = factor;
	*post = (double)n / factor;
}

void ref_dims(const struct ref_param *p, uint32_t S, struct ref_dims *d)
{
	d->outer = d->inner = d->dim = 1;
	d->numel = 1;
	for (uint32_t i = 0; i < p->ndim; i++) {
		d->numel *= p->shape[i];
		if (i < p->shard_dim)
			d->outer *= p->shape[i];
		else if (i == p->shard_dim)
			d->dim = p->shape[i];
		else
			d->inner *= p->shape[i];
	}
	d->rows = p->shard_dim == 0 ? (d->dim + S - 1) / S : d->dim / S;
	d->shard_numel = d->outer * d->rows * d->inner;
}

uint64_t ref_rows_valid(const struct ref_dims *d, uint32_t s)
{
	uint64_t begin = (uint64_t)s * d->rows;

	if (begin >= d->dim)
		return 0;
	return d->dim - begin < d->rows ? d->dim - begin : d->rows;
}

void ref_shard(const struct ref_dims *d, uint32_t s, const double *full, double *out)
{
	for (uint64_t o = 0; o < d->outer; o++)
		for (uint64_t r = 0; r < d->rows; r++)
			for (uint64_t i = 0; i < d->inner; i++) {
				uint64_t row = (uint64_t)s * d->rows + r;

				out[(o * d->rows + r) * d->inner + i] =
					row < d->dim ? full[(o * d->dim + row) * d->inner + i]
						     : 0.0;
			}
}

/* ---- numerics with error bounds ---- */

static int is_f32(double v)
{
	return (double)(float)v == v;
}

/* An fp32 operation whose exact result is v (the implementation's inputs off by err). */
static struct ref_val fp32_op(double v, double err)
{
	if (err > 0 || !is_f32(v))
		err += ref_ulp(fabs(v) + err, 1);
	return (struct ref_val){ v, err };
}

static struct ref_val round_to(struct ref_val x, uint32_t dtype)
{
	struct ref_val r = { ref_round(x.v, dtype), 0 };

	if (x.err > 0)
		r.err = x.err + ref_ulp(fabs(x.v) + x.err, dtype);
	return r;
}

/*
 * One collective in reduce dtype rd over n inputs already rounded (and
 * pre-divided): round(sum / avg), then + add, then / post, each rounded to rd.
 */
static struct ref_val collective(const struct ref_val *x, uint32_t n, uint32_t rd, double avg,
				 const struct ref_val *add, double post)
{
	double s = 0, abs_sum = 0, err = 0;
	int exact = 1;
	struct ref_val v;

	for (uint32_t k = 0; k < n; k++) {
		s += x[k].v;
		abs_sum += fabs(x[k].v);
		err += x[k].err;
		if (!is_f32(s))
			exact = 0;
	}
	if (!exact)
		err += (n > 1 ? n - 1 : 1) * ldexp(abs_sum, -24);
	v = (struct ref_val){ s, err };
	if (avg != 1)
		v = fp32_op(v.v / avg, v.err / avg);
	v = round_to(v, rd);
	if (add) {
		v = fp32_op(v.v + add->v, v.err + add->err);
		v = round_to(v, rd);
	}
	if (post > 1) {
		v = fp32_op(v.v / post, v.err / post);
		v = round_to(v, rd);
	}
	return v;
}

/* out = present ? round(out + cast(v)) : cast(v), in the param's dtype. */
static void finish(struct ref_val v, uint32_t dtype, struct ref_val *out, int present)
{
	v = round_to(v, dtype);
	if (present) {
		v = fp32_op(out->v + v.v, out->err + v.err);
		v = round_to(v, dtype);
	}
	*out = v;
}

/* Rank k's input to the reduce-scatter: round to rd, then FSDP2's pre-divide. */
static struct ref_val rs_input(double g, uint32_t rd, double pre)
{
	struct ref_val x = { ref_round(g, rd), 0 };

	if (pre > 1)
		x = round_to(fp32_op(x.v / pre, 0), rd);
	return x;
}

void ref_reduce(const struct ref_param *p, const struct ref_reduce_cfg *c,
		const double *const *grads, struct ref_grad_state *state)
{
	uint32_t R = c->R, S = c->S, W = R * S, rd = c->reduce_dtype;
	uint32_t n =
		R == 1 ? S : W; /* FSDP2 passes the replicate group whenever the mesh has one */
	struct ref_dims d;
	double pre, post;
	int sum_op;

	ref_dims(p, S, &d);
	ref_divide_factors(n, rd, &pre, &post);
	sum_op = pre != 0;

	for (uint32_t r = 0; r < W; r++) {
		uint32_t u = r / S, s = r % S;
		uint64_t valid = ref_rows_valid(&d, s);
		struct ref_grad_state *st = &state[r];

		for (uint64_t e = 0; e < d.shard_numel; e++) {
			uint64_t o = e / (d.rows * d.inner), row = e / d.inner % d.rows,
				 i = e % d.inner;
			struct ref_val x[64], y;

			if (row >= valid) {
				/* Padding: FSDP2's reduce-scatter input pads with zeros. */
				if (R == 1 || !c->all_reduce) {
					if (R == 1 && !st->present)
						st->sgrad[e] = (struct ref_val){ 0, 0 };
					if (R > 1 && !st->partial_present)
						st->partial[e] = (struct ref_val){ 0, 0 };
				}
				continue;
			}
			for (uint32_t k = 0; k < S; k++)
				x[k] = rs_input(grads[u * S + k]
						     [(o * d.dim + s * d.rows + row) * d.inner + i],
						rd, sum_op ? pre : 1);
			if (R == 1) {
				y = collective(x, S, rd, sum_op ? 1 : S, NULL, sum_op ? post : 1);
				finish(y, p->dtype, &st->sgrad[e], st->present);
				continue;
			}
			/* HSDP reduce-scatter: the partial is added before any all-reduce. */
			y = collective(x, S, rd, sum_op ? 1 : S,
				       st->partial_present ? &st->partial[e] : NULL, 1);
			st->partial[e] = y;
		}
	}
	if (R == 1) {
		for (uint32_t r = 0; r < W; r++)
			state[r].present = 1;
		return;
	}
	for (uint32_t r = 0; r < W; r++)
		state[r].partial_present = 1;
	if (!c->all_reduce)
		return;
	for (uint32_t r = 0; r < W; r++) {
		uint32_t s = r % S;
		uint64_t valid = ref_rows_valid(&d, s);
		struct ref_grad_state *st = &state[r];

		for (uint64_t e = 0; e < d.shard_numel; e++) {
			uint64_t row = e / d.inner % d.rows;
			struct ref_val x[64], y;

			if (row >= valid) {
				if (!st->present)
					st->sgrad[e] = (struct ref_val){ 0, 0 };
				continue;
			}
			for (uint32_t v = 0; v < R; v++)
				x[v] = state[v * S + s].partial[e];
			y = collective(x, R, rd, sum_op ? 1 : R, NULL, sum_op ? post : 1);
			finish(y, p->dtype, &st->sgrad[e], st->present);
		}
	}
	for (uint32_t r = 0; r < W; r++) {
		state[r].present = 1;
		state[r].partial_present = 0;
	}
}

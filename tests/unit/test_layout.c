/* SPDX-License-Identifier: MIT */
/*
 * Group layout: FSDP2 padded dim-0 chunking, Shard(i > 0), offsets and
 * validation of hostile specs. Expected numbers are worked out by hand in
 * the comments, or by a plain running sum in the test, never by layout code.
 */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "shardd_proto.h"

static struct shardd_param_spec spec(const char *name, uint32_t dtype, uint32_t ndim, ...)
{
	struct shardd_param_spec s;
	va_list ap;

	memset(&s, 0, sizeof(s));
	snprintf(s.name, sizeof(s.name), "%s", name);
	s.dtype = dtype;
	s.ndim = ndim;
	va_start(ap, ndim);
	for (uint32_t d = 0; d < ndim; d++)
		s.shape[d] = va_arg(ap, uint64_t);
	va_end(ap);
	return s;
}

/* Build a one-param layout that must succeed. */
static struct shd_layout build_one(struct shardd_param_spec s, uint32_t world)
{
	struct shd_layout l;
	char err[256] = "";
	int ret = shd_layout_build(&s, 1, world, SHARDD_DTYPE_NONE, &l, err, sizeof(err));

	cr_assert_eq(ret, 0, "build '%s' failed: %d %s", s.name, ret, err);
	return l;
}

/* Build that must fail with -SHARDD_E_INVALID and an error containing each of the given words. */
static void expect_invalid(const struct shardd_param_spec *specs, uint32_t n, uint32_t world,
			   uint32_t param_dtype, const char *want1, const char *want2)
{
	struct shd_layout l;
	char err[256] = "";
	int ret = shd_layout_build(specs, n, world, param_dtype, &l, err, sizeof(err));

	cr_assert_eq(ret, -SHARDD_E_INVALID, "want -SHARDD_E_INVALID, got %d (%s)", ret, err);
	cr_assert_null(l.params, "a failed build keeps no allocation");
	cr_assert(strstr(err, want1), "error '%s' must name '%s'", err, want1);
	if (want2)
		cr_assert(strstr(err, want2), "error '%s' must name '%s'", err, want2);
}

static uint64_t rows_valid_sum(const struct shd_layout_param *p, uint32_t world)
{
	uint64_t sum = 0;

	for (uint32_t r = 0; r < world; r++)
		sum += shd_layout_rows_valid(p, r);
	return sum;
}

Test(layout, dim0_smaller_than_world_pads_with_empty_shards, .timeout = 5)
{
	/* (3, 5) over 4 ranks: padded_d0 = 4, rows = 1; ranks 0..2 hold a row, rank 3 only padding. */
	struct shd_layout l = build_one(spec("w", SHARDD_DTYPE_FP32, 2, 3ull, 5ull), 4);
	const struct shd_layout_param *p = &l.params[0];

	cr_expect_eq(p->numel, 15);
	cr_expect_eq(p->outer, 1);
	cr_expect_eq(p->dim, 3);
	cr_expect_eq(p->inner, 5);
	cr_expect_eq(p->rows, 1);
	cr_expect_eq(p->shard_numel, 5);
	cr_expect_eq(shd_layout_rows_valid(p, 0), 1);
	cr_expect_eq(shd_layout_rows_valid(p, 2), 1);
	cr_expect_eq(shd_layout_rows_valid(p, 3), 0);
	cr_expect_eq(rows_valid_sum(p, 4), 3);
	cr_expect_eq(l.shard_size, 64, "20 bytes round up to one 64-byte unit");
	cr_expect_eq(l.unsharded_size, 64, "60 bytes round up to 64");
	shd_layout_free(&l);
}

Test(layout, dim0_not_divisible_pads_the_last_shard, .timeout = 5)
{
	/* (10, 3) over 4: ceil(10 / 4) = 3 rows each, shards hold 3, 3, 3, 1 real rows. */
	struct shd_layout l = build_one(spec("w", SHARDD_DTYPE_BF16, 2, 10ull, 3ull), 4);
	const struct shd_layout_param *p = &l.params[0];
	static const uint64_t want[4] = { 3, 3, 3, 1 };

	cr_expect_eq(p->rows, 3);
	cr_expect_eq(p->shard_numel, 9);
	for (uint32_t r = 0; r < 4; r++)
		cr_expect_eq(shd_layout_rows_valid(p, r), want[r], "rank %u", r);
	cr_expect_eq(rows_valid_sum(p, 4), 10);
	shd_layout_free(&l);
}

Test(layout, rows_valid_sums_to_d0_for_many_shapes, .timeout = 5)
{
	for (uint32_t world = 1; world <= 17; world++) {
		for (uint64_t d0 = 0; d0 <= 40; d0++) {
			struct shd_layout l =
				build_one(spec("w", SHARDD_DTYPE_FP16, 2, d0, 2ull), world);
			const struct shd_layout_param *p = &l.params[0];
			uint64_t rows = (d0 + world - 1) / world;

			cr_assert_eq(p->rows, rows, "d0=%llu world=%u", (unsigned long long)d0,
				     world);
			cr_assert_eq(p->shard_numel, rows * 2);
			cr_assert_eq(rows_valid_sum(p, world), d0, "d0=%llu world=%u",
				     (unsigned long long)d0, world);
			for (uint32_t r = 0; r < world; r++)
				cr_assert_leq(shd_layout_rows_valid(p, r), rows);
			shd_layout_free(&l);
		}
	}
}

Test(layout, one_element_and_0d_params_are_one_row, .timeout = 5)
{
	struct shd_layout l = build_one(spec("b", SHARDD_DTYPE_FP32, 1, 1ull), 8);
	const struct shd_layout_param *p = &l.params[0];

	cr_expect_eq(p->numel, 1);
	cr_expect_eq(p->rows, 1);
	cr_expect_eq(p->shard_numel, 1);
	cr_expect_eq(shd_layout_rows_valid(p, 0), 1);
	cr_expect_eq(rows_valid_sum(p, 8), 1);
	shd_layout_free(&l);

	l = build_one(spec("scale", SHARDD_DTYPE_FP16, 0), 8);
	p = &l.params[0];
	cr_expect_eq(p->numel, 1);
	cr_expect_eq(p->shard_dim, 0);
	cr_expect_eq(p->outer, 1);
	cr_expect_eq(p->dim, 1);
	cr_expect_eq(p->inner, 1);
	cr_expect_eq(p->rows, 1);
	cr_expect_eq(p->shard_numel, 1);
	cr_expect_eq(shd_layout_rows_valid(p, 0), 1);
	cr_expect_eq(shd_layout_rows_valid(p, 7), 0);
	shd_layout_free(&l);
}

Test(layout, empty_params_take_no_bytes_but_buffers_stay_mappable, .timeout = 5)
{
	struct shardd_param_spec s[2] = {
		spec("rows0", SHARDD_DTYPE_FP32, 2, 0ull, 4ull),
		spec("cols0", SHARDD_DTYPE_FP32, 2, 4ull, 0ull),
	};
	struct shd_layout l;
	char err[256];

	cr_assert_eq(shd_layout_build(s, 2, 2, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0, "%s",
		     err);
	cr_expect_eq(l.params[0].numel, 0);
	cr_expect_eq(l.params[0].rows, 0);
	cr_expect_eq(l.params[0].shard_numel, 0);
	cr_expect_eq(rows_valid_sum(&l.params[0], 2), 0);
	cr_expect_eq(l.params[1].numel, 0);
	cr_expect_eq(l.params[1].rows, 2);
	cr_expect_eq(l.params[1].shard_numel, 0);
	cr_expect_eq(l.unsharded_size, SHARDD_ALIGN);
	cr_expect_eq(l.grad_size, SHARDD_ALIGN);
	cr_expect_eq(l.shard_size, SHARDD_ALIGN);
	shd_layout_free(&l);
}

Test(layout, offsets_are_aligned_running_sums, .timeout = 5)
{
	/*
	 * World 4, param_dtype bf16:
	 *   a fp32 (3, 5):  unsharded 15 * 2 = 30 B at 0;  shard 1 * 5 fp32 = 20 B at 0
	 *   b bf16 (10, 3): unsharded 30 * 2 = 60 B at 64; shard 3 * 3 bf16 = 18 B at 64
	 *   c fp16 ():      unsharded 1 * 2 = 2 B at 128;  shard 1 fp16 = 2 B at 128
	 * Totals 130 -> 192 each. Grads follow param_dtype, like the unsharded buffer.
	 */
	struct shardd_param_spec s[3] = {
		spec("a", SHARDD_DTYPE_FP32, 2, 3ull, 5ull),
		spec("b", SHARDD_DTYPE_BF16, 2, 10ull, 3ull),
		spec("c", SHARDD_DTYPE_FP16, 0),
	};
	struct shd_layout l;
	char err[256];

	cr_assert_eq(shd_layout_build(s, 3, 4, SHARDD_DTYPE_BF16, &l, err, sizeof(err)), 0, "%s",
		     err);
	cr_expect_eq(l.nparams, 3);
	cr_expect_eq(l.world, 4);
	cr_expect_eq(l.params[0].unsharded_offset, 0);
	cr_expect_eq(l.params[1].unsharded_offset, 64);
	cr_expect_eq(l.params[2].unsharded_offset, 128);
	cr_expect_eq(l.params[0].grad_offset, 0);
	cr_expect_eq(l.params[1].grad_offset, 64);
	cr_expect_eq(l.params[2].grad_offset, 128);
	cr_expect_eq(l.params[0].shard_offset, 0);
	cr_expect_eq(l.params[1].shard_offset, 64);
	cr_expect_eq(l.params[2].shard_offset, 128);
	cr_expect_eq(l.unsharded_size, 192);
	cr_expect_eq(l.grad_size, 192);
	cr_expect_eq(l.shard_size, 192);
	for (int i = 0; i < 3; i++) {
		cr_expect_eq(l.params[i].unsharded_dtype, SHARDD_DTYPE_BF16);
		cr_expect_eq(l.params[i].grad_dtype, SHARDD_DTYPE_BF16);
		cr_expect_eq(l.params[i].dtype, s[i].dtype);
	}
	shd_layout_free(&l);

	/* Without a policy each param keeps its dtype: a fp32 60 B, b bf16 60 B, c fp16 2 B. */
	cr_assert_eq(shd_layout_build(s, 3, 4, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0, "%s",
		     err);
	cr_expect_eq(l.params[0].unsharded_dtype, SHARDD_DTYPE_FP32);
	cr_expect_eq(l.params[2].grad_dtype, SHARDD_DTYPE_FP16);
	cr_expect_eq(l.params[1].unsharded_offset, 64);
	cr_expect_eq(l.params[2].unsharded_offset, 128);
	cr_expect_eq(l.unsharded_size, 192);
	shd_layout_free(&l);
}

Test(layout, shard_on_dim1_even_is_a_chunk, .timeout = 5)
{
	/* (6, 8, 3) Shard(1) over 4: outer 6, dim 8, inner 3, rows 2; shard numel 6 * 2 * 3 = 36. */
	struct shardd_param_spec s = spec("w", SHARDD_DTYPE_FP32, 3, 6ull, 8ull, 3ull);
	struct shd_layout l;
	const struct shd_layout_param *p;

	s.shard_dim = 1;
	l = build_one(s, 4);
	p = &l.params[0];
	cr_expect_eq(p->shard_dim, 1);
	cr_expect_eq(p->outer, 6);
	cr_expect_eq(p->dim, 8);
	cr_expect_eq(p->inner, 3);
	cr_expect_eq(p->rows, 2);
	cr_expect_eq(p->shard_numel, 36);
	cr_expect_eq(p->numel, 144);
	for (uint32_t r = 0; r < 4; r++)
		cr_expect_eq(shd_layout_rows_valid(p, r), 2);
	cr_expect_eq(l.shard_size, 192, "36 * 4 = 144 bytes round up to 192");
	shd_layout_free(&l);
}

Test(layout, shard_on_dim1_uneven_is_refused, .timeout = 5)
{
	struct shardd_param_spec s = spec("w", SHARDD_DTYPE_FP32, 2, 6ull, 10ull);

	s.shard_dim = 1;
	expect_invalid(&s, 1, 4, SHARDD_DTYPE_NONE, "param 'w'", "shape[1] = 10");
}

Test(layout, byte_size_overflow_names_the_dim, .timeout = 5)
{
	struct shardd_param_spec s = spec("huge", SHARDD_DTYPE_FP32, 2, 1ull << 30, 1ull << 40);

	/* 2^70 elements wrap uint64: the second dim is the one that overflows. */
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'huge'", "shape[1] = 0x10000000000");
	/* 2^62 fp32 elements fit uint64 as a count but not as bytes. */
	s = spec("big", SHARDD_DTYPE_FP32, 1, 1ull << 62);
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'big'", "shape[0]");
	/* 2^38 fp32 elements are exactly 1 TiB: at the limit, refused. */
	s = spec("tib", SHARDD_DTYPE_FP32, 1, 1ull << 38);
	expect_invalid(&s, 1, 1, SHARDD_DTYPE_NONE, "param 'tib'", "shape[0]");
}

Test(layout, many_params_together_past_the_buffer_limit_are_refused, .timeout = 5)
{
	/* Each is 2^36 fp32 = 256 GiB; the fourth takes the buffer to 1 TiB. */
	struct shardd_param_spec s[4];
	char name[8];

	for (int i = 0; i < 4; i++) {
		snprintf(name, sizeof(name), "p%d", i);
		s[i] = spec(name, SHARDD_DTYPE_FP32, 1, 1ull << 36);
	}
	expect_invalid(s, 4, 1, SHARDD_DTYPE_NONE, "param 'p3'", "split the group");
}

Test(layout, duplicate_names_are_refused, .timeout = 5)
{
	struct shardd_param_spec s[3] = {
		spec("a", SHARDD_DTYPE_FP32, 1, 4ull),
		spec("b", SHARDD_DTYPE_FP32, 1, 4ull),
		spec("a", SHARDD_DTYPE_FP32, 1, 4ull),
	};

	expect_invalid(s, 3, 2, SHARDD_DTYPE_NONE, "param 'a'", "#0 and #2");
}

Test(layout, bad_fields_are_refused_with_their_value, .timeout = 5)
{
	struct shardd_param_spec s;

	s = spec("d", 7, 1, 4ull);
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'd'", "dtype = 7");
	s = spec("d0", SHARDD_DTYPE_NONE, 1, 4ull);
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'd0'", "dtype = 0");
	s = spec("n", SHARDD_DTYPE_FP32, 1, 4ull);
	s.ndim = 9;
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'n'", "ndim = 9");
	s = spec("sd", SHARDD_DTYPE_FP32, 2, 4ull, 4ull);
	s.shard_dim = 2;
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'sd'", "shard_dim = 2");
	s = spec("sd0", SHARDD_DTYPE_FP32, 0);
	s.shard_dim = 1;
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'sd0'", "shard_dim = 1");
	s = spec("f", SHARDD_DTYPE_FP32, 1, 4ull);
	s.flags = 2;
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'f'", "flags = 0x2");
	s = spec("u", SHARDD_DTYPE_FP32, 1, 4ull);
	s.shape[5] = 3;
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'u'", "shape[5] = 3");
	s = spec("", SHARDD_DTYPE_FP32, 1, 4ull);
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param #0", "empty");
	s = spec("x", SHARDD_DTYPE_FP32, 1, 4ull);
	memset(s.name, 'x', sizeof(s.name));
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param #0", "NUL");
	s = spec("ok", SHARDD_DTYPE_FP32, 1, 4ull);
	expect_invalid(&s, 1, 2, 9, "param_dtype = 9", NULL);
	expect_invalid(&s, 1, 0, SHARDD_DTYPE_NONE, "shard group size = 0", NULL);
	expect_invalid(&s, 1, SHARDD_MAX_WORLD + 1, SHARDD_DTYPE_NONE, "shard group size = 1025",
		       NULL);
	expect_invalid(&s, 0, 2, SHARDD_DTYPE_NONE, "nparams = 0", NULL);
}

Test(layout, ten_thousand_params_build_fast_with_aligned_offsets, .timeout = 5)
{
	enum {
		N = 10000,
		WORLD = 8
	};
	static const uint32_t dts[3] = { SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16 };
	struct shardd_param_spec *s = calloc(N, sizeof(*s));
	uint64_t un = 0, sh = 0;
	struct shd_layout l;
	char err[256];

	for (uint32_t i = 0; i < N; i++) {
		snprintf(s[i].name, sizeof(s[i].name), "layers.%u.weight", i);
		s[i].dtype = dts[i % 3];
		s[i].ndim = 2;
		s[i].shape[0] = i % 13 + 1;
		s[i].shape[1] = i % 5 + 1;
	}
	cr_assert_eq(shd_layout_build(s, N, WORLD, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0,
		     "%s", err);
	for (uint32_t i = 0; i < N; i++) {
		const struct shd_layout_param *p = &l.params[i];
		uint64_t esz = s[i].dtype == SHARDD_DTYPE_FP32 ? 4 : 2;
		uint64_t rows = (s[i].shape[0] + WORLD - 1) / WORLD;

		cr_assert_eq(p->unsharded_offset % SHARDD_ALIGN, 0);
		cr_assert_eq(p->grad_offset % SHARDD_ALIGN, 0);
		cr_assert_eq(p->shard_offset % SHARDD_ALIGN, 0);
		cr_assert_eq(p->unsharded_offset, un, "param %u", i);
		cr_assert_eq(p->grad_offset, un, "param %u", i);
		cr_assert_eq(p->shard_offset, sh, "param %u", i);
		cr_assert_eq(rows_valid_sum(p, WORLD), s[i].shape[0]);
		un += (s[i].shape[0] * s[i].shape[1] * esz + 63) / 64 * 64;
		sh += (rows * s[i].shape[1] * esz + 63) / 64 * 64;
	}
	cr_expect_eq(l.unsharded_size, un);
	cr_expect_eq(l.grad_size, un);
	cr_expect_eq(l.shard_size, sh);
	shd_layout_free(&l);

	/* A duplicate at the far end of 10 000 names is still found. */
	snprintf(s[N - 1].name, sizeof(s[N - 1].name), "layers.%u.weight", 17);
	expect_invalid(s, N, WORLD, SHARDD_DTYPE_NONE, "param 'layers.17.weight'", "#17 and #9999");
	free(s);
}

Test(layout, zero_dim_does_not_hide_dims_whose_product_wraps, .timeout = 5)
{
	/* Shard(1) of [3, 3, 0, 2^63, 8]: numel is 0, but inner = 0 * 2^63 * 8 would wrap. */
	struct shardd_param_spec s =
		spec("wrap", SHARDD_DTYPE_FP32, 5, 3ull, 3ull, 0ull, 1ull << 63, 8ull);

	s.shard_dim = 1;
	expect_invalid(&s, 1, 1, SHARDD_DTYPE_NONE, "param 'wrap'",
		       "shape[3] = 0x8000000000000000");
	/* [0, 2^32, 2^33]: inner of dim 0 would wrap to 0. */
	s = spec("inner", SHARDD_DTYPE_FP32, 3, 0ull, 1ull << 32, 1ull << 33);
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'inner'", "shape[2] = 0x200000000");
	/* [0, 2^20, 2^20] fits 64 bits, but 2^40 fp32 elements are past the 1 TiB per-buffer limit. */
	s = spec("wide", SHARDD_DTYPE_BF16, 3, 0ull, 1ull << 20, 1ull << 20);
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'wide'", "shape[2] = 0x100000");
	/* A zero dim after the large ones: shape[1] is where the product crosses the limit. */
	s = spec("late", SHARDD_DTYPE_FP32, 3, 1ull << 30, 1ull << 10, 0ull);
	expect_invalid(&s, 1, 2, SHARDD_DTYPE_NONE, "param 'late'", "shape[1] = 0x400");
}

Test(layout, zero_width_param_sharded_on_dim1_takes_no_bytes, .timeout = 5)
{
	struct shardd_param_spec s[3] = {
		spec("a", SHARDD_DTYPE_FP32, 1, 3ull),
		spec("e", SHARDD_DTYPE_FP32, 2, 2ull, 0ull),
		spec("b", SHARDD_DTYPE_FP32, 1, 5ull),
	};
	struct shd_layout l;
	char err[256];

	s[1].shard_dim = 1;
	cr_assert_eq(shd_layout_build(s, 3, 2, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0, "%s",
		     err);
	cr_expect_eq(l.params[1].numel, 0);
	cr_expect_eq(l.params[1].outer, 2);
	cr_expect_eq(l.params[1].dim, 0);
	cr_expect_eq(l.params[1].rows, 0);
	cr_expect_eq(l.params[1].shard_numel, 0);
	cr_expect_eq(rows_valid_sum(&l.params[1], 2), 0);
	/* "a" takes 12 bytes, aligned to 64; "e" takes none, so "b" starts where "e" does. */
	cr_expect_eq(l.params[1].unsharded_offset, SHARDD_ALIGN);
	cr_expect_eq(l.params[2].unsharded_offset, SHARDD_ALIGN);
	cr_expect_eq(l.params[2].shard_offset, l.params[1].shard_offset);
	shd_layout_free(&l);
}

Test(layout, zero_numel_param_with_huge_other_dims_is_accepted_with_exact_counts, .timeout = 5)
{
	/* 2^37 x 0 with Shard(1): 2^37 outer indices, each of no elements; below the limit of 2^38. */
	struct shd_layout l;
	struct shardd_param_spec s = spec("wide", SHARDD_DTYPE_FP32, 2, 1ull << 37, 0ull);

	s.shard_dim = 1;
	l = build_one(s, 4);
	cr_expect_eq(l.params[0].numel, 0);
	cr_expect_eq(l.params[0].outer, 1ull << 37);
	cr_expect_eq(l.params[0].inner, 1);
	cr_expect_eq(l.params[0].shard_numel, 0);
	cr_expect_eq(l.unsharded_size, SHARDD_ALIGN);
	shd_layout_free(&l);
	/* Dim 0 of 0 rows under 2^37 columns. */
	s = spec("tall", SHARDD_DTYPE_FP32, 2, 0ull, 1ull << 37);
	l = build_one(s, 4);
	cr_expect_eq(l.params[0].inner, 1ull << 37);
	cr_expect_eq(l.params[0].rows, 0);
	cr_expect_eq(l.params[0].shard_numel, 0);
	shd_layout_free(&l);
}

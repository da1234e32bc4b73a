/* SPDX-License-Identifier: MIT */
/*
 * proto/shardd_cuda.h, what the cuda backend and libshardd share without
 * a GPU: the granularity rounding both sides size an fd buffer with, and
 * the resolver that fills their tables of entry points. Expected sizes are
 * worked out by hand in the comments.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "shardd_cuda.h"

#define MIB (1024ull * 1024ull)

Test(proto_cuda, alloc_size_rounds_up_to_the_granularity, .timeout = 5)
{
	/* 2 MiB, the granularity of current GPUs. */
	cr_assert_eq(shardd_cuda_alloc_size(1, 2 * MIB), 2 * MIB);
	cr_assert_eq(shardd_cuda_alloc_size(2 * MIB, 2 * MIB), 2 * MIB,
		     "a multiple stays as it is");
	cr_assert_eq(shardd_cuda_alloc_size(2 * MIB + 1, 2 * MIB), 4 * MIB);
	/* 3 x 64 + 1 = 193 bytes at 64: 4 x 64. */
	cr_assert_eq(shardd_cuda_alloc_size(193, 64), 256);
	/* A granularity that is no power of two: 10 bytes at 3 is 4 x 3. */
	cr_assert_eq(shardd_cuda_alloc_size(10, 3), 12);
	/* The largest size either side accepts (SIZE_MAX / 2) at 2 MiB: 2^63 - 1 rounds to 2^63. */
	cr_assert_eq(shardd_cuda_alloc_size(UINT64_MAX / 2, 2 * MIB), 1ull << 63);
}

/* A table as the callers declare theirs: function pointers only. */
struct fake_table {
	int (*one)(void);
	int (*two)(void);
	int (*three)(void);
};

static int fn_one(void)
{
	return 1;
}

static int fn_two(void)
{
	return 2;
}

static int fn_three(void)
{
	return 3;
}

static const struct shardd_cuda_symbol fake_symbols[] = {
	SHARDD_CUDA_SYMBOL(struct fake_table, one, "one"),
	SHARDD_CUDA_SYMBOL(struct fake_table, two, "two"),
	SHARDD_CUDA_SYMBOL(struct fake_table, three, "three"),
};

/* The library: the names it has, and how many lookups it was asked. */
struct fake_lib {
	const char *missing; /* NULL: it has all three */
	int asked;
};

static int fake_lookup(void *ctx, const char *name, void **fn, char *err, size_t errlen)
{
	struct fake_lib *lib = ctx;
	int (*found)(void) = NULL;

	lib->asked++;
	if (lib->missing && !strcmp(name, lib->missing)) {
		snprintf(err, errlen, "fake has no %s", name);
		return -1;
	}
	found = !strcmp(name, "one") ? fn_one : !strcmp(name, "two") ? fn_two : fn_three;
	/* As dlsym hands them out: a function pointer as a void * (POSIX). */
	memcpy(fn, &found, sizeof(*fn));
	return 0;
}

Test(proto_cuda, resolve_puts_each_entry_point_in_its_field, .timeout = 5)
{
	struct fake_table t;
	struct fake_lib lib = { NULL, 0 };
	char err[128] = "";

	memset(&t, 0, sizeof(t));
	cr_assert_eq(shardd_cuda_resolve(&t, fake_symbols, 3, fake_lookup, &lib, err, sizeof(err)),
		     0, "%s", err);
	cr_assert_eq(lib.asked, 3);
	cr_assert(t.one && t.two && t.three);
	cr_assert_eq(t.one(), 1);
	cr_assert_eq(t.two(), 2);
	cr_assert_eq(t.three(), 3);
}

Test(proto_cuda, resolve_stops_at_the_first_missing_entry_point_with_its_lookups_reason,
     .timeout = 5)
{
	struct fake_table t;
	struct fake_lib lib = { "two", 0 };
	char err[128] = "";

	memset(&t, 0, sizeof(t));
	cr_assert_eq(shardd_cuda_resolve(&t, fake_symbols, 3, fake_lookup, &lib, err, sizeof(err)),
		     -SHARDD_E_BACKEND);
	cr_assert_str_eq(err, "fake has no two");
	cr_assert_eq(lib.asked, 2, "nothing is looked up after the missing one");
	cr_assert_eq(t.one(), 1);
	cr_assert_null(t.two);
	cr_assert_null(t.three);
}

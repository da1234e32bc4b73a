/* SPDX-License-Identifier: MIT */
/*
 * Memory limits (daemon/core/memlimit.c) and what a group counts against them
 * (shd_group_memory_need): byte counts with suffixes, the cgroup
 * limit read from a fake /proc/self/cgroup and cgroup tree, and every
 * buffer of an HSDP group, worked out by hand.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "group.h"
#include "memlimit.h"

Test(limits, byte_counts_take_binary_suffixes, .timeout = 5)
{
	static const struct {
		const char *s;
		uint64_t v;
	} ok[] = {
		{ "0", 0 },
		{ "4096", 4096 },
		{ "64K", 64ull << 10 },
		{ "64k", 64ull << 10 },
		{ "64M", 64ull << 20 },
		{ "64MiB", 64ull << 20 },
		{ "3G", 3ull << 30 },
		{ "2GB", 2ull << 30 },
		{ "1T", 1ull << 40 },
		{ "16777215T", 16777215ull << 40 },
		{ "18446744073709551615", UINT64_MAX },
	};
	static const char *const bad[] = {
		"",     "M",   "-1",  "+5",    " 5",        "5 ",
		"1.5G", "12Q", "5KK", "5KiBs", "16777216T", "18446744073709551616",
	};
	uint64_t v;

	for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
		cr_expect_eq(shd_memlimit_parse(ok[i].s, &v), 0, "'%s' must parse", ok[i].s);
		cr_expect_eq(v, ok[i].v, "'%s' = %llu, want %llu", ok[i].s, (unsigned long long)v,
			     (unsigned long long)ok[i].v);
	}
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_expect_eq(shd_memlimit_parse(bad[i], &v), -EINVAL, "'%s' must be refused",
			     bad[i]);
}

Test(limits, byte_counts_read_with_binary_units, .timeout = 5)
{
	char buf[32];

	cr_expect_str_eq(shd_memlimit_str(0, buf, sizeof(buf)), "0 B");
	cr_expect_str_eq(shd_memlimit_str(1023, buf, sizeof(buf)), "1023 B");
	cr_expect_str_eq(shd_memlimit_str(64ull << 20, buf, sizeof(buf)), "64.0 MiB");
	cr_expect_str_eq(shd_memlimit_str(3ull << 39, buf, sizeof(buf)), "1.5 TiB");
	cr_expect_str_eq(shd_memlimit_str(UINT64_MAX, buf, sizeof(buf)), "16.0 EiB");
}

static char tmp[64];

static void write_file(const char *rel, const char *text)
{
	char path[256];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", tmp, rel);
	f = fopen(path, "w");
	cr_assert_not_null(f, "create %s", path);
	fputs(text, f);
	fclose(f);
}

static void make_dir(const char *rel)
{
	char path[256];

	snprintf(path, sizeof(path), "%s/%s", tmp, rel);
	cr_assert_eq(mkdir(path, 0700), 0, "mkdir %s", path);
}

/* A cgroup tree: cg and each folder down to cg/`leaf`, and /proc/self/cgroup's text. */
static void make_cgroup(const char *leaf, const char *proc_cgroup)
{
	char rel[128];
	int n = snprintf(rel, sizeof(rel), "cg/%s", leaf);

	cr_assert(n > 0 && (size_t)n < sizeof(rel), "cgroup path too long: %s", leaf);
	for (char *p = rel; (p = strchr(p, '/')) != NULL; p++) {
		*p = '\0';
		make_dir(rel);
		*p = '/';
	}
	make_dir(rel);
	write_file("proc_cgroup", proc_cgroup);
}

static void make_tmp(void)
{
	snprintf(tmp, sizeof(tmp), "/tmp/shardd-limits-XXXXXX");
	cr_assert_not_null(mkdtemp(tmp));
}

static void remove_tmp(void)
{
	char cmd[128];

	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
	cr_expect_eq(system(cmd), 0);
}

static uint64_t cgroup_limit(void)
{
	char proc[256], root[256];

	snprintf(proc, sizeof(proc), "%s/proc_cgroup", tmp);
	snprintf(root, sizeof(root), "%s/cg", tmp);
	return shd_memlimit_cgroup_max(proc, root);
}

Test(limits, cgroup_v2_limit_is_the_lowest_memory_max_up_the_tree, .init = make_tmp,
     .fini = remove_tmp, .timeout = 5)
{
	make_cgroup("a/b", "0::/a/b\n");
	cr_expect_eq(cgroup_limit(), UINT64_MAX, "no memory.max anywhere: no limit");
	write_file("cg/a/b/memory.max", "max\n");
	cr_expect_eq(cgroup_limit(), UINT64_MAX, "\"max\" is no limit");
	write_file("cg/a/memory.max", "1073741824\n");
	cr_expect_eq(cgroup_limit(), 1ull << 30, "the parent's limit binds its children");
	write_file("cg/a/b/memory.max", "536870912\n");
	cr_expect_eq(cgroup_limit(), 1ull << 29, "the lower of the two binds");
	write_file("cg/memory.max", "4096\n");
	cr_expect_eq(cgroup_limit(), 1ull << 29, "the root's own file is not a cgroup limit");
}

Test(limits, cgroup_v1_memory_controller_limit_is_read_too, .init = make_tmp, .fini = remove_tmp,
     .timeout = 5)
{
	make_cgroup("memory/job", "5:cpu,cpuacct:/job\n4:memory:/job\n0::/\n");
	write_file("cg/memory/job/memory.limit_in_bytes", "9223372036854771712\n");
	cr_expect_eq(cgroup_limit(), 9223372036854771712ull,
		     "v1's 'unlimited' is just a large number");
	write_file("cg/memory/job/memory.limit_in_bytes", "2147483648\n");
	cr_expect_eq(cgroup_limit(), 2ull << 30);
	write_file("proc_cgroup", "garbage\n4:memory\n");
	cr_expect_eq(cgroup_limit(), UINT64_MAX, "lines without a path are skipped");
}

Test(limits, default_is_80_percent_of_physical_memory_at_most, .timeout = 5)
{
	uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGE_SIZE), v;
	char from[96];

	cr_assert_eq(shd_memlimit_default(&v, from, sizeof(from)), 0);
	cr_expect_leq(v, phys / 100 * 80 + phys % 100 * 80 / 100);
	cr_expect_gt(v, 0);
	cr_expect(strstr(from, "80% of "), "basis '%s'", from);
}

Test(limits, an_hsdp_group_counts_every_buffer_it_will_hold, .timeout = 5)
{
	/* Mesh 2 x 3: world 6. Params: fp32 [10, 4] (Shard(0): 4 rows of 4 per shard) and bf16 [7]. */
	struct shardd_register_group hdr = { .name = "g", .nparams = 2 };
	struct shardd_param_spec *specs = calloc(2, sizeof(*specs));
	struct shd_group_memory m;
	struct shd_group *g = NULL;
	char err[256] = "";

	cr_assert_not_null(specs);
	snprintf(specs[0].name, sizeof(specs[0].name), "w");
	specs[0].dtype = SHARDD_DTYPE_FP32;
	specs[0].ndim = 2;
	specs[0].shape[0] = 10;
	specs[0].shape[1] = 4;
	snprintf(specs[1].name, sizeof(specs[1].name), "b");
	specs[1].dtype = SHARDD_DTYPE_BF16;
	specs[1].ndim = 1;
	specs[1].shape[0] = 7;
	hdr.param_dtype = SHARDD_DTYPE_FP32; /* unsharded and grads all fp32: one reduce dtype */
	cr_assert_eq(shd_group_create(1, &hdr, specs, 2, 3, &g, err, sizeof(err)), 0, "%s", err);
	shd_group_memory_need(g, &m);
	/*
	 * Unsharded and grad: w 160 B -> 192 (aligned), b 7 x 4 = 28 -> 64: 256 bytes each.
	 * Flat shard: w 4 x 4 x 4 = 64, b 3 rows x 2 = 6 -> 64: 128 bytes.
	 * Partial (reduce dtype fp32): w 64, b 3 x 4 = 12 -> 64: 128 bytes.
	 */
	cr_expect_eq(m.unsharded, 2 * 256, "one unsharded copy per replica");
	cr_expect_eq(m.grads, 6 * 256);
	cr_expect_eq(m.shards, 6 * 128);
	cr_expect_eq(m.sharded_grads, 6 * 128);
	cr_expect_eq(m.partials, 6 * 128);
	cr_expect_eq(m.optimizer, 0);
	cr_expect_eq(m.total, 2 * 256 + 6 * 256 + 3 * 6 * 128);
	shd_group_destroy(g, NULL);
}

/* SPDX-License-Identifier: MIT */
/*
 * Forced into the kernels' sources by the fuzz build only (fuzz.mk): clang 14
 * knows no __builtin_cpu_supports("f16c"), which kernels/cast.c asks gcc
 * for. Features clang knows go to its builtin; f16c is read from CPUID.
 */
#ifndef SHARDD_FUZZ_CLANG_COMPAT_H
#define SHARDD_FUZZ_CLANG_COMPAT_H

#include <cpuid.h>
#include <string.h>

static inline int fuzz_cpu_supports(const char *feature)
{
	unsigned a, b, c, d;

	if (strcmp(feature, "f16c") == 0)
		return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
	if (strcmp(feature, "avx") == 0)
		return __builtin_cpu_supports("avx");
	if (strcmp(feature, "avx2") == 0)
		return __builtin_cpu_supports("avx2");
	if (strcmp(feature, "avx512f") == 0)
		return __builtin_cpu_supports("avx512f");
	if (strcmp(feature, "avx512bw") == 0)
		return __builtin_cpu_supports("avx512bw");
	if (strcmp(feature, "avx512vl") == 0)
		return __builtin_cpu_supports("avx512vl");
	return 0;
}

#define __builtin_cpu_supports(feature) fuzz_cpu_supports(feature)

#endif /* SHARDD_FUZZ_CLANG_COMPAT_H */

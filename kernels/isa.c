/* SPDX-License-Identifier: MIT */
/*
 * The widest instruction set the CPU kernels may use (optim_isa.h): every
 * kernel file's run-time dispatch asks shardd_k_isa_allows besides the
 * CPU, so that an AVX-512 machine can run (and measure, and test) the
 * paths an AVX2-only or a plain x86 CPU takes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optim_isa.h"

const char *shardd_k_isa_name(enum shardd_k_isa isa)
{
	switch (isa) {
	case SHARDD_K_ISA_PORTABLE:
		return "portable";
	case SHARDD_K_ISA_AVX2:
		return "avx2";
	case SHARDD_K_ISA_AVX512:
		return "avx512";
	default:
		return "unknown";
	}
}

/* -1 until the first look at SHARDD_KERNEL_ISA; then the limit. */
static int isa_limit = -1;

static int limit_from_env(void)
{
	const char *v = getenv("SHARDD_KERNEL_ISA");

	if (!v || !*v)
		return SHARDD_K_ISA_COUNT - 1;
	for (int i = 0; i < SHARDD_K_ISA_COUNT; i++)
		if (!strcmp(v, shardd_k_isa_name((enum shardd_k_isa)i)))
			return i;
	fprintf(stderr,
		"shardd: SHARDD_KERNEL_ISA='%s' is none of portable, avx2, avx512: ignored, the "
		"kernels use what the CPU has\n",
		v);
	return SHARDD_K_ISA_COUNT - 1;
}

enum shardd_k_isa shardd_k_isa_limit(void)
{
	/* Threads racing on the first call read the same environment: either store is the same. */
	int l = __atomic_load_n(&isa_limit, __ATOMIC_RELAXED);

	if (l < 0) {
		l = limit_from_env();
		__atomic_store_n(&isa_limit, l, __ATOMIC_RELAXED);
	}
	return (enum shardd_k_isa)l;
}

void shardd_k_isa_set_limit(enum shardd_k_isa max)
{
	__atomic_store_n(&isa_limit, (int)max, __ATOMIC_RELAXED);
}

int shardd_k_isa_allows(enum shardd_k_isa isa)
{
	return isa <= shardd_k_isa_limit();
}

/* SPDX-License-Identifier: MIT */
/*
 * The instruction-set paths of the CPU kernels: the optimizer's (optim.c)
 * one by one, for the tests, which check each path a CPU can run against
 * the others and a reference, and for shardbench, which says which path it
 * measured; and the limit every kernel's dispatch obeys (isa.c). The
 * daemon calls shardd_k_sgd / shardd_k_adamw, which pick the fastest path
 * the CPU has within the limit.
 */
#ifndef SHARDD_OPTIM_ISA_H
#define SHARDD_OPTIM_ISA_H

#include <stddef.h>

#include "shardd_kernels.h"

enum shardd_k_isa {
	SHARDD_K_ISA_PORTABLE = 0, /* plain C, any CPU */
	SHARDD_K_ISA_AVX2 = 1,     /* 8 lanes; x86 with AVX2 */
	SHARDD_K_ISA_AVX512 = 2,   /* 16 lanes; x86 with AVX-512F */
	SHARDD_K_ISA_COUNT
};

/* "portable", "avx2", "avx512". */
const char *shardd_k_isa_name(enum shardd_k_isa isa);
/* 1 when this CPU runs `isa` (and this build has it). */
int shardd_k_isa_available(enum shardd_k_isa isa);
/* The path shardd_k_sgd and shardd_k_adamw use on this CPU, within the limit below. */
enum shardd_k_isa shardd_k_isa_best(void);

/*
 * The widest path any kernel may take (casts, reduce, optimizer): what
 * $SHARDD_KERNEL_ISA names ("portable", "avx2" or "avx512"; unset: no
 * limit) at the first call, or the last shardd_k_isa_set_limit. Each
 * kernel still takes only what the CPU has. For benchmarks (an AVX-512
 * machine running the AVX2 paths as an AVX2-only CPU would) and tests;
 * set it before the kernels run concurrently, as a change is seen by each
 * thread at its next call. "portable" also leaves out F16C and the
 * AVX-512 BF16 conversion, "avx2" the latter.
 */
enum shardd_k_isa shardd_k_isa_limit(void);
void shardd_k_isa_set_limit(enum shardd_k_isa max);
/* 1 when `isa` is within the limit (not whether the CPU has it). */
int shardd_k_isa_allows(enum shardd_k_isa isa);

/* The kernels on one path; `isa` must be available. */
void shardd_k_sgd_isa(enum shardd_k_isa isa, const struct shardd_sgd *a, size_t begin, size_t end);
void shardd_k_adamw_isa(enum shardd_k_isa isa, const struct shardd_adamw *a, size_t begin,
			size_t end);
void shardd_k_grad_norm_part_isa(enum shardd_k_isa isa, const void *grad, uint32_t dtype,
				 size_t begin, size_t end, struct shardd_grad_norm_part *out);

#endif /* SHARDD_OPTIM_ISA_H */

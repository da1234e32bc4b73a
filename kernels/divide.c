/* SPDX-License-Identifier: MIT */
/*
 * FSDP2's gradient divide factors (_get_gradient_divide_factors in the
 * seed): fp32 and bf16 reduce with AVG, fp16 divides by a power of two near
 * sqrt(N) before the sum and by N over that after it, so neither the inputs
 * nor the sum leave fp16's range.
 */
#include "shardd_kernels.h"
#include "shardd_proto.h"

void shardd_divide_factors(uint32_t n, uint32_t reduce_dtype, double *pre, double *post)
{
	uint64_t factor = 1;

	if (reduce_dtype != SHARDD_DTYPE_FP16) {
		*pre = 0;
		*post = 0;
		return;
	}
	/* The seed's loop, with N / factor > factor in real division. */
	while (n % factor == 0 && (double)n / (double)factor > (double)factor)
		factor *= 2;
	*pre = (double)factor;
	*post = (double)n / (double)factor;
}

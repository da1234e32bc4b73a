/* SPDX-License-Identifier: MIT */
/*
 * Independent reference for the engine's numbers: PyTorch FSDP2's
 * unshard and reduce semantics written as plain double-precision loops,
 * with its own dtype rounding (frexp/ldexp, round-half-even via nearbyint)
 * and its own FSDP2 chunking and divide factors. Shares no code with
 * kernels/ or daemon/.
 *
 * Reduce values carry an error bound: the reference computes each
 * collective exactly in double and rounds to the reduce dtype where FSDP2
 * does; the kernels sum and divide in fp32 first. The bound says how far a
 * correct fp32 implementation may land from the exact reference (see
 * reference.c, ref_val).
 */
#ifndef SHARDD_TEST_REFERENCE_H
#define SHARDD_TEST_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

/* Round x to a dtype (1 fp32, 2 bf16, 3 fp16): nearest, ties to even, overflow to Inf. */
double ref_round(double x, uint32_t dtype);
/* Spacing of the dtype's values at magnitude |x|. */
double ref_ulp(double x, uint32_t dtype);
/* Encode x (representable in dtype) into 2 or 4 bytes; decode. */
void ref_store(void *dst, uint32_t dtype, double x);
double ref_load(const void *src, uint32_t dtype);
size_t ref_dtype_size(uint32_t dtype);

/* FSDP2 _get_gradient_divide_factors(N, dtype): fp32/bf16 -> 0, 0 (AVG); fp16 -> factor, N / factor. */
void ref_divide_factors(uint32_t n, uint32_t reduce_dtype, double *pre, double *post);

/* One param as registered. */
struct ref_param {
	uint32_t ndim, shard_dim, dtype;
	uint64_t shape[8];
};

/* FSDP2 chunking of a param over S ranks. */
struct ref_dims {
	uint64_t numel;             /* elements of the full param */
	uint64_t outer, dim, inner; /* the shape around shard_dim (a 0-d param is 1 x 1 x 1) */
	uint64_t rows; /* rows of shard_dim per shard: ceil(dim / S) (dim 0), dim / S (Shard(i)) */
	uint64_t shard_numel; /* outer * rows * inner, padding included */
};
void ref_dims(const struct ref_param *p, uint32_t S, struct ref_dims *d);
uint64_t ref_rows_valid(const struct ref_dims *d, uint32_t s);
/* Shard s of the full tensor `full` (numel values): shard_numel values, zero past the last row. */
void ref_shard(const struct ref_dims *d, uint32_t s, const double *full, double *out);

/* A value and how far a correct fp32-accumulating implementation may be from it. */
struct ref_val {
	double v;
	double err;
};

/* The sharded-grad state of one param on one rank. */
struct ref_grad_state {
	struct ref_val *sgrad;   /* [shard_numel], the param's dtype */
	int present;             /* FSDP2: sharded_param.grad is not None */
	struct ref_val *partial; /* [shard_numel], reduce dtype (HSDP partial_reduce_output) */
	int partial_present;
};

struct ref_reduce_cfg {
	uint32_t R, S;         /* mesh */
	uint32_t grad_dtype;   /* dtype of the unsharded grads */
	uint32_t reduce_dtype; /* resolved: policy or grad dtype */
	int all_reduce;        /* HSDP: all-reduce this call (FSDP2 all_reduce_grads) */
};

/*
 * One foreach_reduce call for one param: grads[r] is rank r's full
 * unsharded grad (values representable in grad_dtype), state[R * S] is
 * updated as FSDP2 updates sharded grads and HSDP partials.
 */
void ref_reduce(const struct ref_param *p, const struct ref_reduce_cfg *c,
		const double *const *grads, struct ref_grad_state *state);

#endif /* SHARDD_TEST_REFERENCE_H */

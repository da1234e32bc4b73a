/* SPDX-License-Identifier: MIT */
/*
 * The arithmetic of shardd: every byte the daemon moves for an op goes
 * through these calls. CPU versions (the .c files of kernels/) work on
 * host memory on the calling thread; the daemon splits large ranges across
 * its worker pool. CUDA versions (the .cu files, shardd_cuda_kernels.h)
 * take the same arguments on device memory plus a stream.
 *
 * Dtype codes are enum shardd_dtype from proto/shardd_proto.h. Casts round
 * to nearest even; NaN stays NaN (quiet) and Inf stays Inf. Pointers must
 * be aligned to their dtype's element size. The calls keep no state, so
 * threads may run them concurrently on disjoint ranges.
 */
#ifndef SHARDD_KERNELS_H
#define SHARDD_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/*
 * Elements the CPU kernels process at a time: their fp32 stack buffers
 * (2 KiB each) stay in L1, and loops of this constant length vectorise.
 * Callers splitting work across threads should split on multiples of it.
 */
#define SHARDD_K_BLOCK 512

/* Scalar conversions (round to nearest even, NaN and Inf kept). */
uint16_t shardd_f32_to_bf16(float f);
float shardd_bf16_to_f32(uint16_t h);
uint16_t shardd_f32_to_f16(float f);
float shardd_f16_to_f32(uint16_t h);

/*
 * Bit-casts, the terms bf16 is written in (bf16 is the top half of an
 * fp32's bits), for the kernels, shardbench and the tests alike: an fp32's
 * bits and back; the bf16 of a value exact in bf16 (at most 8 significant
 * bits), by truncation where shardd_f32_to_bf16 rounds; and a bf16 widened
 * with its bits as they are, where shardd_bf16_to_f32 quiets a NaN.
 */
static inline uint32_t shardd_f32_bits(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

static inline float shardd_bits_f32(uint32_t u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static inline uint16_t shardd_bf16_truncate(float f)
{
	return (uint16_t)(shardd_f32_bits(f) >> 16);
}

static inline float shardd_bf16_widen(uint16_t h)
{
	return shardd_bits_f32((uint32_t)h << 16);
}

/* Round an fp32 value to `dtype` and back (identity for fp32). */
float shardd_round_to(uint32_t dtype, float f);

/*
 * Block conversions through fp32, the working precision of every kernel:
 * dst[i] = src[i] widened (exact for every dtype), dst[i] = src[i] rounded
 * to dst_dtype, and x[i] = shardd_round_to(dtype, x[i]), for i < n. The
 * optimizer and the daemon's copy paths build on these; buffers must not
 * overlap.
 */
void shardd_k_to_f32(float *dst, const void *src, uint32_t src_dtype, size_t n);
void shardd_k_from_f32(void *dst, uint32_t dst_dtype, const float *src, size_t n);
void shardd_k_round(float *x, uint32_t dtype, size_t n);

/* dst[i] = cast(src[i]) for i < n. dst and src must not overlap unless equal dtypes and equal pointers. */
void shardd_k_cast(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype, size_t n);

/* Zero `bytes` bytes. */
void shardd_k_zero(void *dst, size_t bytes);

/*
 * Chunk-cat (all-gather copy-out of a Shard(i) param): for o < outer,
 * r < nchunks, k < inner:
 *   dst[(o * nchunks + r) * inner + k] = cast(src[r][o * inner + k]).
 */
void shardd_k_chunk_cat(void *dst, uint32_t dst_dtype, const void *const *src, uint32_t src_dtype,
			uint32_t nchunks, size_t outer, size_t inner);

/*
 * The arithmetic of one collective reduction, host numerics (docs/DESIGN.md):
 * per element j,
 *   x_k = round_rd(in_k[j]);  if pre > 1: x_k = round_rd(x_k / pre)
 *   s   = round_rd((sum_k x_k in fp32) / avg)       (avg 1: a plain sum)
 *   if add:      s = round_rd(s + add[j])           (add is in reduce_dtype)
 *   if post > 1: s = round_rd(s / post)
 *   v   = cast_out(s)
 *   out[j] = accumulate ? cast_out(out[j] + v) : v  (the add in fp32)
 * where round_rd rounds to reduce_dtype.
 */
struct shardd_reduce_math {
	uint32_t reduce_dtype; /* dtype values travel and are rounded in */
	float pre;             /* FSDP2 pre-divide factor, 1 = none */
	float avg;             /* divide of the sum: group size for AVG, 1 for SUM */
	const void *add;       /* optional addend in reduce_dtype (HSDP partial), or NULL */
	float post;            /* FSDP2 post-divide factor, 1 = none */
};

/*
 * out[j] (out_dtype, n elements) from nin inputs in_dtype, as above.
 * `accumulate` nonzero adds into out. `out` may alias `add`.
 */
void shardd_k_reduce(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
		     uint32_t nin, uint32_t in_dtype, size_t n, const struct shardd_reduce_math *m);

/*
 * shardd_k_cast and shardd_k_reduce with non-temporal (streaming) stores
 * where the CPU has them (x86 with AVX2 or AVX-512; elsewhere the plain call): the output
 * goes around the caches, which saves the read of every output line a
 * normal store causes and keeps the inputs cached. For outputs much larger
 * than the last-level cache that no one reads right away. The same bits
 * as the plain calls. Each call ends with a store fence, so its writes are
 * ordered before anything the caller publishes afterwards. CPU only.
 */
void shardd_k_cast_stream(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype,
			  size_t n);
void shardd_k_reduce_stream(void *out, uint32_t out_dtype, int accumulate, const void *const *in,
			    uint32_t nin, uint32_t in_dtype, size_t n,
			    const struct shardd_reduce_math *m);

/*
 * FSDP2's _get_gradient_divide_factors for a data-parallel size n and a
 * reduce dtype: fp32/bf16 -> *pre = *post = 0 (meaning: AVG, no factors);
 * fp16 -> the power-of-two pre factor and post = n / pre, exactly as the
 * seed's loop computes them.
 */
void shardd_divide_factors(uint32_t n, uint32_t reduce_dtype, double *pre, double *post);

/* ---------------------------------------------------------- optimizer --- */

/*
 * One optimizer step on elements [begin, end) of a shard, in one pass over
 * memory: param, grad and state read once, param and state written once.
 * The formulas and hyperparameter names are torch.optim's (SGD, AdamW with
 * decoupled weight decay); hyperparameters are doubles as in Python, and
 * every scalar derived from them (1 - lr*wd, lr / bias_correction1, ...)
 * is computed in double and rounded to fp32 once, as torch does. Per
 * element the arithmetic is a fixed sequence of fp32 operations without
 * fused multiply-adds, so the AVX-512, AVX2 and portable paths (picked at
 * run time) and the CUDA kernels give the same bits.
 *
 * param and state are fp32; the grad is fp32, bf16 or fp16 (the sharded
 * grad is in the param's dtype; widening is exact). A param whose dtype is
 * not fp32 needs an fp32 master copy: these kernels update fp32 only.
 * State starts zeroed (torch's zeros_like), except the momentum buffer,
 * which step 1 sets to the grad without reading it (torch's clone).
 *
 * grad_scale multiplies the grad first (clip_grad_norm_'s clip
 * coefficient, fp32 as torch's); 1 leaves it unchanged. Skipping a step
 * (a non-finite grad norm) is the caller's decision: it does not call.
 * The arguments must pass the matching shardd_k_*_check. Calls on
 * disjoint ranges may run concurrently; split on SHARDD_K_BLOCK multiples.
 */
struct shardd_sgd {
	float *param;           /* fp32 master shard */
	const void *grad;       /* sharded grad, grad_dtype */
	float *momentum_buffer; /* fp32; NULL when momentum == 0 */
	uint32_t grad_dtype;    /* SHARDD_DTYPE_FP32, _BF16 or _FP16 */
	uint64_t step; /* updates so far, this one included: 1 sets the buffer to the grad */
	double lr;
	double momentum;
	double dampening;
	double weight_decay; /* L2, added to the grad */
	int nesterov;
	int maximize;
	float grad_scale; /* multiplied into the grad; 1 = none */
};

struct shardd_adamw {
	float *param;          /* fp32 master shard */
	const void *grad;      /* sharded grad, grad_dtype */
	float *exp_avg;        /* fp32, zeroed before step 1 */
	float *exp_avg_sq;     /* fp32, zeroed before step 1 */
	float *max_exp_avg_sq; /* fp32, zeroed before step 1; NULL unless amsgrad */
	uint32_t grad_dtype;   /* SHARDD_DTYPE_FP32, _BF16 or _FP16 */
	uint64_t step;         /* torch's state['step'] after this update: 1 on the first */
	double lr;
	double beta1, beta2; /* torch's betas */
	double eps;
	double weight_decay; /* decoupled: param *= 1 - lr * weight_decay */
	int amsgrad;
	int maximize;
	float grad_scale; /* multiplied into the grad; 1 = none */
};

/*
 * 0, or -SHARDD_E_INVALID with a message in why (len bytes) that names
 * the field, its value and the rule, with torch.optim's limits: lr >= 0,
 * momentum >= 0, weight_decay >= 0, nesterov needs momentum > 0 and
 * dampening 0; 0 <= betas < 1, eps >= 0; step >= 1; the state the options
 * need present; grad_dtype fp32, bf16 or fp16; finite values.
 */
int shardd_k_sgd_check(const struct shardd_sgd *a, char *why, size_t len);
int shardd_k_adamw_check(const struct shardd_adamw *a, char *why, size_t len);

void shardd_k_sgd(const struct shardd_sgd *a, size_t begin, size_t end);
void shardd_k_adamw(const struct shardd_adamw *a, size_t begin, size_t end);

/*
 * The fp32 scalars one AdamW step uses, from its double hyperparameters:
 * what every path (and the CUDA kernel) multiplies by.
 */
struct shardd_adamw_coefs {
	float grad_mul; /* grad_scale, negated when maximize */
	float decay;    /* 1 - lr * weight_decay */
	float lerp_w;   /* 1 - beta1: exp_avg.lerp_(grad, lerp_w) */
	float lerp_wc;  /* 1 - lerp_w in fp32, lerp's form for lerp_w >= 0.5 */
	float beta2;
	float beta2c;   /* 1 - beta2 */
	float bc2_sqrt; /* sqrt(1 - beta2^step) */
	float eps;
	float neg_step_size; /* -lr / (1 - beta1^step) */
	int lerp_small;      /* lerp_w < 0.5 */
	int amsgrad;
};
void shardd_k_adamw_coefs(const struct shardd_adamw *a, struct shardd_adamw_coefs *c);

/* The same for SGD. */
struct shardd_sgd_coefs {
	float grad_mul; /* grad_scale, negated when maximize */
	float weight_decay;
	float momentum;
	float damp_c;     /* 1 - dampening */
	float neg_lr;     /* -lr */
	int use_wd;       /* weight_decay != 0 */
	int use_momentum; /* momentum != 0 */
	int first;        /* step == 1: the buffer becomes the grad */
	int nesterov;
};
void shardd_k_sgd_coefs(const struct shardd_sgd *a, struct shardd_sgd_coefs *c);

/*
 * The part of a gradient norm one range contributes, for clip_grad_norm_
 * (norm_type 2: sqrt of the summed sumsq; inf: the largest max_abs).
 * Squares of fp32 values are exact in fp64 and sixteen fp64 lanes sum
 * them in a fixed order, so a part is the same bits on every path and
 * depends only on the values and [begin, end); merging parts in a fixed
 * order makes the total deterministic. A finite grad cannot overflow the
 * fp64 sum, so nonfinite is exactly "some element is NaN or Inf".
 */
struct shardd_grad_norm_part {
	double sumsq;  /* sum of grad^2 */
	float max_abs; /* max |grad| (NaN elements skipped) */
	int nonfinite; /* some element is NaN or +-Inf */
};

/* *out = the part of grad[begin, end) (fp32, bf16 or fp16). */
void shardd_k_grad_norm_part(const void *grad, uint32_t dtype, size_t begin, size_t end,
			     struct shardd_grad_norm_part *out);
/* Fold `part` into `into` (sum, max, or). */
void shardd_k_grad_norm_merge(struct shardd_grad_norm_part *into,
			      const struct shardd_grad_norm_part *part);

#endif /* SHARDD_KERNELS_H */

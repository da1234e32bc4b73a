/* SPDX-License-Identifier: MIT */
/*
 * CUDA versions of the optimizer kernels (optim.c): SGD and AdamW on
 * elements [begin, end) of device arrays, and the grad-norm part.
 *
 * The update of one element is the CPU's sequence of fp32 operations,
 * written with the round-to-nearest intrinsics (__fmul_rn, __fadd_rn,
 * __fdiv_rn, __fsqrt_rn), which nvcc never contracts into a fused
 * multiply-add, so the bits equal the CPU kernels' (tests/gpu checks
 * them). The scalars come from the same host functions
 * (shardd_k_sgd_coefs, shardd_k_adamw_coefs). A grid-stride loop, one
 * element per thread and step: the loads coalesce, and the update is
 * bound by memory bandwidth.
 *
 * The grad norm sums squares in fp64 per thread over a fixed grid, then
 * in a fixed tree: deterministic for a given range, but summed in another
 * order than the CPU's lanes, so equal to it within rounding, not in bits.
 * The non-finite check (the step's skip-on-non-finite) needs no sum: each
 * thread that meets a NaN or Inf stores 1 into a flag, so its answer is
 * exactly the CPU's `nonfinite`.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "shardd_kernels.h"
}
#include "shardd_cuda_kernels.h"
#include "shardd_proto.h"

#define THREADS     256
#define MAX_BLOCKS  4096
#define NORM_BLOCKS 256 /* fixed: the sum's order must not depend on the range */

/* Exact widening of a grad element, as kernels/cast.c (a NaN stays NaN). */
__device__ __forceinline__ float grad_at(const void *g, uint32_t dtype, size_t i)
{
	if (dtype == SHARDD_DTYPE_BF16)
		return __uint_as_float((uint32_t)((const uint16_t *)g)[i] << 16);
	if (dtype == SHARDD_DTYPE_FP16)
		return __half2float(__ushort_as_half(((const uint16_t *)g)[i]));
	return ((const float *)g)[i];
}

static unsigned int grid_for(size_t n)
{
	size_t blocks = (n + THREADS - 1) / THREADS;

	return blocks > MAX_BLOCKS ? MAX_BLOCKS : (unsigned int)(blocks ? blocks : 1);
}

static bool grad_dtype_ok(uint32_t dtype)
{
	return dtype == SHARDD_DTYPE_FP32 || dtype == SHARDD_DTYPE_BF16 ||
	       dtype == SHARDD_DTYPE_FP16;
}

static int launch_result(void)
{
	return cudaGetLastError() == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
}

/* -------------------------------------------------------------- SGD --- */

struct sgd_dev_args {
	float *param, *buf;
	const void *grad;
	uint32_t grad_dtype;
	size_t begin, end;
	struct shardd_sgd_coefs c;
};

/* optim.c's sgd_one. */
__global__ void sgd_kernel(const __grid_constant__ struct sgd_dev_args a)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;

	for (size_t i = a.begin + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.end;
	     i += stride) {
		float p = a.param[i], d = __fmul_rn(grad_at(a.grad, a.grad_dtype, i), a.c.grad_mul);

		if (a.c.use_wd)
			d = __fadd_rn(d, __fmul_rn(a.c.weight_decay, p));
		if (a.c.use_momentum) {
			float b = a.c.first ? d
					    : __fadd_rn(__fmul_rn(a.buf[i], a.c.momentum),
							__fmul_rn(a.c.damp_c, d));

			a.buf[i] = b;
			d = a.c.nesterov ? __fadd_rn(d, __fmul_rn(a.c.momentum, b)) : b;
		}
		a.param[i] = __fadd_rn(p, __fmul_rn(a.c.neg_lr, d));
	}
}

extern "C" int shardd_cuda_sgd(const struct shardd_sgd *a, size_t begin, size_t end, void *stream)
{
	struct sgd_dev_args d;

	if (!grad_dtype_ok(a->grad_dtype) || a->step < 1 ||
	    (a->momentum != 0.0 && !a->momentum_buffer))
		return -SHARDD_E_INVALID;
	if (end <= begin)
		return 0;
	d.param = a->param;
	d.buf = a->momentum != 0.0 ? a->momentum_buffer : NULL;
	d.grad = a->grad;
	d.grad_dtype = a->grad_dtype;
	d.begin = begin;
	d.end = end;
	shardd_k_sgd_coefs(a, &d.c);
	sgd_kernel<<<grid_for(end - begin), THREADS, 0, (cudaStream_t)stream>>>(d);
	return launch_result();
}

/* ------------------------------------------------------------ AdamW --- */

struct adamw_dev_args {
	float *param, *m, *v, *vmax;
	const void *grad;
	uint32_t grad_dtype;
	size_t begin, end;
	struct shardd_adamw_coefs c;
};

/* optim.c's adamw_one. */
__global__ void adamw_kernel(const __grid_constant__ struct adamw_dev_args a)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;

	for (size_t i = a.begin + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.end;
	     i += stride) {
		float g = __fmul_rn(grad_at(a.grad, a.grad_dtype, i), a.c.grad_mul);
		float p = __fmul_rn(a.param[i], a.c.decay), m = a.m[i], v = a.v[i], den;

		m = a.c.lerp_small ? __fadd_rn(m, __fmul_rn(a.c.lerp_w, __fsub_rn(g, m)))
				   : __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), a.c.lerp_wc));
		v = __fadd_rn(__fmul_rn(v, a.c.beta2), __fmul_rn(__fmul_rn(a.c.beta2c, g), g));
		a.m[i] = m;
		a.v[i] = v;
		if (a.c.amsgrad) {
			float old = a.vmax[i];

			v = old > v ? old : v;
			a.vmax[i] = v;
		}
		den = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), a.c.bc2_sqrt), a.c.eps);
		a.param[i] = __fadd_rn(p, __fdiv_rn(__fmul_rn(a.c.neg_step_size, m), den));
	}
}

extern "C" int shardd_cuda_adamw(const struct shardd_adamw *a, size_t begin, size_t end,
				 void *stream)
{
	struct adamw_dev_args d;

	if (!grad_dtype_ok(a->grad_dtype) || a->step < 1 || !a->exp_avg || !a->exp_avg_sq ||
	    (a->amsgrad && !a->max_exp_avg_sq))
		return -SHARDD_E_INVALID;
	if (end <= begin)
		return 0;
	d.param = a->param;
	d.m = a->exp_avg;
	d.v = a->exp_avg_sq;
	d.vmax = a->amsgrad ? a->max_exp_avg_sq : NULL;
	d.grad = a->grad;
	d.grad_dtype = a->grad_dtype;
	d.begin = begin;
	d.end = end;
	shardd_k_adamw_coefs(a, &d.c);
	adamw_kernel<<<grid_for(end - begin), THREADS, 0, (cudaStream_t)stream>>>(d);
	return launch_result();
}

/* -------------------------------------------------------- grad norm --- */

/* Tree-reduce THREADS (sum, max) pairs in shared memory; thread 0 holds the result. */
__device__ __forceinline__ void block_reduce(double *sum, double *mx)
{
	for (unsigned int s = THREADS / 2; s > 0; s >>= 1) {
		if (threadIdx.x < s) {
			sum[threadIdx.x] += sum[threadIdx.x + s];
			mx[threadIdx.x] = mx[threadIdx.x + s] > mx[threadIdx.x]
						  ? mx[threadIdx.x + s]
						  : mx[threadIdx.x];
		}
		__syncthreads();
	}
}

/* Block b's (sum of squares, max |g|) into ws[2 + 2b], ws[3 + 2b]; NaNs skipped by the max. */
__global__ void norm_blocks_kernel(const void *grad, uint32_t dtype, size_t begin, size_t end,
				   double *ws)
{
	__shared__ double sum[THREADS], mx[THREADS];
	size_t stride = (size_t)gridDim.x * blockDim.x;
	double s = 0.0, m = 0.0;

	for (size_t i = begin + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < end;
	     i += stride) {
		double g = (double)grad_at(grad, dtype, i), a = fabs(g);

		s = __dadd_rn(s, __dmul_rn(g, g));
		m = a > m ? a : m;
	}
	sum[threadIdx.x] = s;
	mx[threadIdx.x] = m;
	__syncthreads();
	block_reduce(sum, mx);
	if (threadIdx.x == 0) {
		ws[2 + 2 * blockIdx.x] = sum[0];
		ws[3 + 2 * blockIdx.x] = mx[0];
	}
}

__global__ void norm_final_kernel(double *ws)
{
	__shared__ double sum[THREADS], mx[THREADS];

	sum[threadIdx.x] = threadIdx.x < NORM_BLOCKS ? ws[2 + 2 * threadIdx.x] : 0.0;
	mx[threadIdx.x] = threadIdx.x < NORM_BLOCKS ? ws[3 + 2 * threadIdx.x] : 0.0;
	__syncthreads();
	block_reduce(sum, mx);
	if (threadIdx.x == 0) {
		ws[0] = sum[0];
		ws[1] = mx[0];
	}
}

extern "C" int shardd_cuda_grad_norm_part(const void *grad, uint32_t dtype, size_t begin,
					  size_t end, double *ws, void *stream)
{
	cudaStream_t s = (cudaStream_t)stream;

	static_assert(NORM_BLOCKS <= THREADS, "the final kernel reduces one partial per thread");
	static_assert(SHARDD_CUDA_NORM_WS == 2 + 2 * NORM_BLOCKS, "workspace size");
	if (!grad_dtype_ok(dtype))
		return -SHARDD_E_INVALID;
	norm_blocks_kernel<<<NORM_BLOCKS, THREADS, 0, s>>>(grad, dtype, begin,
							   end > begin ? end : begin, ws);
	if (launch_result())
		return -SHARDD_E_BACKEND;
	norm_final_kernel<<<1, THREADS, 0, s>>>(ws);
	return launch_result();
}

/* ------------------------------------------------------- non-finite --- */

struct nonfinite_dev_args {
	const void *grad;
	uint32_t grad_dtype;
	size_t begin, end;
	uint32_t *flag;
};

/* *flag = 1 when some grad[i], begin <= i < end, is NaN or +-Inf; otherwise *flag is left alone. */
__global__ void nonfinite_kernel(const __grid_constant__ struct nonfinite_dev_args a)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	bool bad = false;

	for (size_t i = a.begin + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.end;
	     i += stride)
		bad |= !isfinite(grad_at(a.grad, a.grad_dtype, i));
	/* Every writer stores the same value: no atomic needed. */
	if (bad)
		*a.flag = 1;
}

extern "C" int shardd_cuda_nonfinite(const void *grad, uint32_t dtype, size_t begin, size_t end,
				     uint32_t *flag, void *stream)
{
	struct nonfinite_dev_args d;

	if (!grad_dtype_ok(dtype) || !flag)
		return -SHARDD_E_INVALID;
	if (end <= begin)
		return 0;
	d.grad = grad;
	d.grad_dtype = dtype;
	d.begin = begin;
	d.end = end;
	d.flag = flag;
	nonfinite_kernel<<<grid_for(end - begin), THREADS, 0, (cudaStream_t)stream>>>(d);
	return launch_result();
}

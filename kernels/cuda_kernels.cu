/* SPDX-License-Identifier: MIT */
/*
 * CUDA kernels (shardd_cuda_kernels.h): cast, zero, chunk-cat and the
 * reduce arithmetic, bit for bit the CPU kernels' numerics.
 *
 * Conversions are the CPU's: bf16 by the same integer rounding, fp16 by the
 * hardware's round-to-nearest-even convert with NaNs rewritten the way the
 * CPU writes them (quiet, top payload bits kept). Divides use IEEE '/' (no
 * fast math) so quotients round exactly like the CPU's.
 *
 * Each kernel is a grid-stride loop. When every pointer is 16-byte aligned
 * a thread moves 8 elements at a time with 16-byte loads and stores (two
 * for fp32); otherwise, or for the tail, one element at a time.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "shardd_cuda_kernels.h"
#include "shardd_proto.h"

#define VEC        8 /* elements per vector step */
#define THREADS    256
#define MAX_BLOCKS 4096 /* grid-stride loops cover the rest */

/* ------------------------------------------------------- conversions --- */

__device__ __forceinline__ uint16_t dev_f32_to_bf16(float f)
{
	uint32_t u = __float_as_uint(f);
	uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;

	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40u);
	return (uint16_t)rounded;
}

__device__ __forceinline__ float dev_bf16_to_f32(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;

	if ((h & 0x7fffu) > 0x7f80u)
		u |= 0x00400000u;
	return __uint_as_float(u);
}

__device__ __forceinline__ uint16_t dev_f32_to_f16(float f)
{
	uint32_t u = __float_as_uint(f);

	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
	return __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float dev_f16_to_f32(uint16_t h)
{
	if ((h & 0x7fffu) > 0x7c00u)
		return __uint_as_float(((uint32_t)(h & 0x8000u) << 16) | 0x7fc00000u |
				       ((uint32_t)(h & 0x3ffu) << 13));
	return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ float dev_round(uint32_t dtype, float f)
{
	if (dtype == SHARDD_DTYPE_BF16)
		return dev_bf16_to_f32(dev_f32_to_bf16(f));
	if (dtype == SHARDD_DTYPE_FP16)
		return dev_f16_to_f32(dev_f32_to_f16(f));
	return f;
}

__device__ __forceinline__ float dev_load1(const void *p, uint32_t dtype, size_t i)
{
	if (dtype == SHARDD_DTYPE_BF16)
		return dev_bf16_to_f32(((const uint16_t *)p)[i]);
	if (dtype == SHARDD_DTYPE_FP16)
		return dev_f16_to_f32(((const uint16_t *)p)[i]);
	return ((const float *)p)[i];
}

__device__ __forceinline__ void dev_store1(void *p, uint32_t dtype, size_t i, float v)
{
	if (dtype == SHARDD_DTYPE_BF16)
		((uint16_t *)p)[i] = dev_f32_to_bf16(v);
	else if (dtype == SHARDD_DTYPE_FP16)
		((uint16_t *)p)[i] = dev_f32_to_f16(v);
	else
		((float *)p)[i] = v;
}

/* Elements [i, i + VEC) with 16-byte loads; p + i must be 16-byte aligned. */
__device__ __forceinline__ void dev_load8(const void *p, uint32_t dtype, size_t i, float v[VEC])
{
	if (dtype == SHARDD_DTYPE_FP32) {
		const float4 *q = (const float4 *)((const float *)p + i);
		float4 a = q[0], b = q[1];

		v[0] = a.x;
		v[1] = a.y;
		v[2] = a.z;
		v[3] = a.w;
		v[4] = b.x;
		v[5] = b.y;
		v[6] = b.z;
		v[7] = b.w;
		return;
	}
	uint4 w = *(const uint4 *)((const uint16_t *)p + i);
	uint32_t words[4] = { w.x, w.y, w.z, w.w };

	for (int j = 0; j < VEC; j++) {
		uint16_t h = (uint16_t)(words[j / 2] >> (16 * (j % 2)));

		v[j] = dtype == SHARDD_DTYPE_BF16 ? dev_bf16_to_f32(h) : dev_f16_to_f32(h);
	}
}

__device__ __forceinline__ void dev_store8(void *p, uint32_t dtype, size_t i, const float v[VEC])
{
	if (dtype == SHARDD_DTYPE_FP32) {
		float4 *q = (float4 *)((float *)p + i);

		q[0] = make_float4(v[0], v[1], v[2], v[3]);
		q[1] = make_float4(v[4], v[5], v[6], v[7]);
		return;
	}
	uint32_t words[4];

	for (int j = 0; j < VEC / 2; j++) {
		uint16_t lo, hi;

		if (dtype == SHARDD_DTYPE_BF16) {
			lo = dev_f32_to_bf16(v[2 * j]);
			hi = dev_f32_to_bf16(v[2 * j + 1]);
		} else {
			lo = dev_f32_to_f16(v[2 * j]);
			hi = dev_f32_to_f16(v[2 * j + 1]);
		}
		words[j] = (uint32_t)lo | ((uint32_t)hi << 16);
	}
	*(uint4 *)((uint16_t *)p + i) = make_uint4(words[0], words[1], words[2], words[3]);
}

/* ----------------------------------------------------------- helpers --- */

static bool aligned16(const void *p)
{
	return ((uintptr_t)p & 15u) == 0;
}

static bool dtype_ok(uint32_t dtype)
{
	return dtype > SHARDD_DTYPE_NONE && dtype < SHARDD_DTYPE_COUNT;
}

static unsigned int grid_for(size_t work)
{
	size_t blocks = (work + THREADS - 1) / THREADS;

	if (blocks < 1)
		blocks = 1;
	return blocks > MAX_BLOCKS ? MAX_BLOCKS : (unsigned int)blocks;
}

static int launch_result(void)
{
	return cudaGetLastError() == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
}

/* -------------------------------------------------------------- cast --- */

__global__ void cast_kernel(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype,
			    size_t n, bool vec)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t nv = vec ? n / VEC : 0;

	for (size_t g = tid; g < nv; g += stride) {
		float v[VEC];

		dev_load8(src, src_dtype, g * VEC, v);
		dev_store8(dst, dst_dtype, g * VEC, v);
	}
	for (size_t i = nv * VEC + tid; i < n; i += stride)
		dev_store1(dst, dst_dtype, i, dev_load1(src, src_dtype, i));
}

extern "C" int shardd_cuda_cast(void *dst, uint32_t dst_dtype, const void *src, uint32_t src_dtype,
				size_t n, void *stream)
{
	cudaStream_t s = (cudaStream_t)stream;
	bool vec = aligned16(dst) && aligned16(src);

	if (!dtype_ok(dst_dtype) || !dtype_ok(src_dtype))
		return -SHARDD_E_INVALID;
	if (n == 0 || (dst == src && dst_dtype == src_dtype))
		return 0;
	if (dst_dtype == src_dtype)
		return cudaMemcpyAsync(dst, src, n * shardd_dtype_size(dst_dtype),
				       cudaMemcpyDeviceToDevice, s) == cudaSuccess
			       ? 0
			       : -SHARDD_E_BACKEND;
	cast_kernel<<<grid_for(vec ? n / VEC + n % VEC : n), THREADS, 0, s>>>(dst, dst_dtype, src,
									      src_dtype, n, vec);
	return launch_result();
}

extern "C" int shardd_cuda_zero(void *dst, size_t bytes, void *stream)
{
	if (bytes == 0)
		return 0;
	return cudaMemsetAsync(dst, 0, bytes, (cudaStream_t)stream) == cudaSuccess
		       ? 0
		       : -SHARDD_E_BACKEND;
}

/* --------------------------------------------------------- chunk-cat --- */

struct chunk_args {
	const void *src[SHARDD_CUDA_MAX_INPUTS];
	void *dst;
	size_t outer, inner;
	uint32_t nchunks; /* of the whole param: dst's stride */
	uint32_t first;   /* first chunk of this batch */
	uint32_t nbatch;  /* chunks in this batch */
	uint32_t dst_dtype, src_dtype;
};

/*
 * `count` (1 or VEC) elements of `dtype` from src[si] to dst[di], as bits:
 * a same-dtype copy never goes through fp32, whose widening quiets a
 * signalling NaN (bf16 0xff81 would come back 0xffc1) where the CPU
 * kernel's memcpy keeps every bit. VEC elements are 16-byte aligned.
 */
__device__ __forceinline__ void dev_copy_bits(void *dst, size_t di, const void *src, size_t si,
					      uint32_t dtype, size_t count)
{
	if (dtype == SHARDD_DTYPE_FP32 && count == VEC) {
		const uint4 *s = (const uint4 *)((const uint32_t *)src + si);
		uint4 *d = (uint4 *)((uint32_t *)dst + di);

		d[0] = s[0];
		d[1] = s[1];
	} else if (count == VEC) {
		*(uint4 *)((uint16_t *)dst + di) = *(const uint4 *)((const uint16_t *)src + si);
	} else if (dtype == SHARDD_DTYPE_FP32) {
		((uint32_t *)dst)[di] = ((const uint32_t *)src)[si];
	} else {
		((uint16_t *)dst)[di] = ((const uint16_t *)src)[si];
	}
}

/*
 * dst[(o * nchunks + first + r) * inner + k] = cast(src[r][o * inner + k]),
 * walked in steps of `step` elements (VEC when every row start is 16-byte
 * aligned, else 1); the same dtype on both sides copies the bits.
 */
__global__ void chunk_cat_kernel(const __grid_constant__ struct chunk_args a, size_t step)
{
	size_t per_row = a.inner / step;
	size_t total = a.outer * a.nbatch * per_row;
	size_t stride = (size_t)gridDim.x * blockDim.x;

	for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += stride) {
		size_t k = (t % per_row) * step;
		size_t row = t / per_row;
		uint32_t r = (uint32_t)(row % a.nbatch);
		size_t o = row / a.nbatch;
		size_t si = o * a.inner + k;
		size_t di = (o * a.nchunks + a.first + r) * a.inner + k;

		if (a.src_dtype == a.dst_dtype) {
			dev_copy_bits(a.dst, di, a.src[r], si, a.dst_dtype, step);
		} else if (step == VEC) {
			float v[VEC];

			dev_load8(a.src[r], a.src_dtype, si, v);
			dev_store8(a.dst, a.dst_dtype, di, v);
		} else {
			dev_store1(a.dst, a.dst_dtype, di, dev_load1(a.src[r], a.src_dtype, si));
		}
	}
}

extern "C" int shardd_cuda_chunk_cat(void *dst, uint32_t dst_dtype, const void *const *src,
				     uint32_t src_dtype, uint32_t nchunks, size_t outer,
				     size_t inner, void *stream)
{
	struct chunk_args a;
	bool vec = aligned16(dst) && inner % VEC == 0;
	size_t step;

	if (!dtype_ok(dst_dtype) || !dtype_ok(src_dtype))
		return -SHARDD_E_INVALID;
	if (outer == 0 || inner == 0 || nchunks == 0)
		return 0;
	for (uint32_t r = 0; r < nchunks; r++)
		vec = vec && aligned16(src[r]);
	step = vec ? VEC : 1;
	a.dst = dst;
	a.outer = outer;
	a.inner = inner;
	a.nchunks = nchunks;
	a.dst_dtype = dst_dtype;
	a.src_dtype = src_dtype;
	for (a.first = 0; a.first < nchunks; a.first += a.nbatch) {
		a.nbatch = nchunks - a.first < SHARDD_CUDA_MAX_INPUTS ? nchunks - a.first
								      : SHARDD_CUDA_MAX_INPUTS;
		for (uint32_t r = 0; r < a.nbatch; r++)
			a.src[r] = src[a.first + r];
		chunk_cat_kernel<<<grid_for(outer * a.nbatch * (inner / step)), THREADS, 0,
				   (cudaStream_t)stream>>>(a, step);
		if (launch_result())
			return -SHARDD_E_BACKEND;
	}
	return 0;
}

/* ------------------------------------------------------------ reduce --- */

struct reduce_args {
	const void *in[SHARDD_CUDA_MAX_INPUTS];
	const void *add;
	void *out;
	size_t n;
	uint32_t nin, in_dtype, rd, out_dtype;
	int accumulate, round_in;
	float pre, avg, post;
};

/* The formula of shardd_k_reduce for one element, given its inputs' values. */
__device__ __forceinline__ float reduce_one(const struct reduce_args &a, float acc, float addend,
					    float old)
{
	if (a.avg != 1.0f)
		acc = acc / a.avg;
	acc = dev_round(a.rd, acc);
	if (a.add)
		acc = dev_round(a.rd, acc + addend);
	if (a.post > 1.0f)
		acc = dev_round(a.rd, acc / a.post);
	if (a.accumulate)
		acc = old + dev_round(a.out_dtype, acc);
	return acc;
}

/* x_k = round_rd(in_k), pre-divided, as the CPU kernel does. */
__device__ __forceinline__ float reduce_input(const struct reduce_args &a, float x)
{
	if (a.round_in)
		x = dev_round(a.rd, x);
	if (a.pre > 1.0f)
		x = dev_round(a.rd, x / a.pre);
	return x;
}

__global__ void reduce_kernel(const __grid_constant__ struct reduce_args a, bool vec)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t nv = vec ? a.n / VEC : 0;

	for (size_t g = tid; g < nv; g += stride) {
		size_t i = g * VEC;
		float acc[VEC], x[VEC], addend[VEC] = { 0 }, old[VEC] = { 0 };

		/* The sum starts from x_0, not +0, so all -0 inputs sum to -0. */
		dev_load8(a.in[0], a.in_dtype, i, acc);
		for (int j = 0; j < VEC; j++)
			acc[j] = reduce_input(a, acc[j]);
		for (uint32_t k = 1; k < a.nin; k++) {
			dev_load8(a.in[k], a.in_dtype, i, x);
			for (int j = 0; j < VEC; j++)
				acc[j] += reduce_input(a, x[j]);
		}
		if (a.add)
			dev_load8(a.add, a.rd, i, addend);
		if (a.accumulate)
			dev_load8(a.out, a.out_dtype, i, old);
		for (int j = 0; j < VEC; j++)
			acc[j] = reduce_one(a, acc[j], addend[j], old[j]);
		dev_store8(a.out, a.out_dtype, i, acc);
	}
	for (size_t i = nv * VEC + tid; i < a.n; i += stride) {
		float acc = reduce_input(a, dev_load1(a.in[0], a.in_dtype, i));

		for (uint32_t k = 1; k < a.nin; k++)
			acc += reduce_input(a, dev_load1(a.in[k], a.in_dtype, i));
		dev_store1(a.out, a.out_dtype, i,
			   reduce_one(a, acc, a.add ? dev_load1(a.add, a.rd, i) : 0.0f,
				      a.accumulate ? dev_load1(a.out, a.out_dtype, i) : 0.0f));
	}
}

extern "C" int shardd_cuda_reduce(void *out, uint32_t out_dtype, int accumulate,
				  const void *const *in, uint32_t nin, uint32_t in_dtype, size_t n,
				  const struct shardd_reduce_math *m, void *stream)
{
	struct reduce_args a;
	bool vec;

	if (!dtype_ok(out_dtype) || !dtype_ok(in_dtype) || !dtype_ok(m->reduce_dtype) || nin == 0 ||
	    nin > SHARDD_CUDA_MAX_INPUTS)
		return -SHARDD_E_INVALID;
	if (n == 0)
		return 0;
	vec = aligned16(out) && (!m->add || aligned16(m->add));
	for (uint32_t k = 0; k < nin; k++) {
		a.in[k] = in[k];
		vec = vec && aligned16(in[k]);
	}
	a.add = m->add;
	a.out = out;
	a.n = n;
	a.nin = nin;
	a.in_dtype = in_dtype;
	a.rd = m->reduce_dtype;
	a.out_dtype = out_dtype;
	a.accumulate = accumulate;
	a.round_in = m->reduce_dtype != SHARDD_DTYPE_FP32 && m->reduce_dtype != in_dtype;
	a.pre = m->pre;
	a.avg = m->avg;
	a.post = m->post;
	reduce_kernel<<<grid_for(vec ? n / VEC + n % VEC : n), THREADS, 0, (cudaStream_t)stream>>>(
		a, vec);
	return launch_result();
}

/* SPDX-License-Identifier: MIT */
/*
 * `shardbench gpu`: the CUDA kernels of kernels/shardd_cuda_kernels.h
 * against cudaMemcpy device-to-device on the same device, same sizes.
 * Each row: bytes the kernel must read + write, over its time, as GB/s and
 * as a percentage of the device-to-device copy of the same size (which
 * reads and writes size bytes each). Built without CUDA, or run without a
 * GPU, it says so and succeeds.
 */
#include <stdio.h>

#include "bench.h"

#ifdef SHARDD_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "shardd_cuda_kernels.h"

enum {
	GPU_MEMCPY,
	GPU_CAST,
	GPU_CHUNK_CAT,
	GPU_REDUCE,
	GPU_NKERNELS
};

struct gpu_bufs {
	float *src;  /* n fp32: the shards, concatenated */
	void *dst;   /* n fp32 (every dtype fits) */
	void *in[8]; /* reduce inputs: ranks x n elements of dtype */
	void *host;  /* n fp32 staging for inputs and checks */
	uint32_t nin;
};

#define CUDA_TRY(call, what)                                                       \
	do {                                                                       \
		cudaError_t e_ = (call);                                           \
		if (e_ != cudaSuccess) {                                           \
			printf("# gpu: %s: %s\n", (what), cudaGetErrorString(e_)); \
			ret = -1;                                                  \
			goto out;                                                  \
		}                                                                  \
	} while (0)

/* Queue one kernel of the table for n elements of the benchmark dtype. */
static int gpu_launch(int k, const struct bench_opts *o, struct gpu_bufs *b, uint64_t n,
		      cudaStream_t s)
{
	const void *chunks[8];
	struct shardd_reduce_math m = {
		.reduce_dtype = o->dtype,
		.pre = 1.0f,
		.avg = (float)b->nin,
		.post = 1.0f,
	};
	uint32_t r;

	switch (k) {
	case GPU_MEMCPY:
		return cudaMemcpyAsync(b->dst, b->src, n * shardd_dtype_size(o->dtype),
				       cudaMemcpyDeviceToDevice, s) == cudaSuccess
			       ? 0
			       : -1;
	case GPU_CAST:
		return shardd_cuda_cast(b->dst, o->dtype, b->src, SHARDD_DTYPE_FP32, n, s);
	case GPU_CHUNK_CAT:
		/* The unshard of a dim-0 param: each rank's fp32 shard cast into its place. */
		for (r = 0; r < b->nin; r++)
			chunks[r] = b->src + n / b->nin * r;
		return shardd_cuda_chunk_cat(b->dst, o->dtype, chunks, SHARDD_DTYPE_FP32, b->nin, 1,
					     n / b->nin, s);
	default:
		return shardd_cuda_reduce(b->dst, SHARDD_DTYPE_FP32, 0, (const void *const *)b->in,
					  b->nin, o->dtype, n, &m, s);
	}
}

/* Bytes kernel k must read and write for n elements. */
static double gpu_moved(int k, const struct bench_opts *o, uint32_t nin, uint64_t n)
{
	double d = (double)shardd_dtype_size(o->dtype) * (double)n;

	switch (k) {
	case GPU_MEMCPY:
		return 2 * d;
	case GPU_CAST:
	case GPU_CHUNK_CAT:
		return 4.0 * (double)n + d;
	default:
		return (double)nin * d + 4.0 * (double)n;
	}
}

/* Elements of the last output that differ from the reference. */
static uint64_t gpu_check(int k, const struct bench_opts *o, struct gpu_bufs *b, uint64_t n)
{
	uint32_t out_dtype = k == GPU_REDUCE ? SHARDD_DTYPE_FP32 : o->dtype;
	uint64_t i, wrong = 0;
	uint32_t r;

	if (k == GPU_MEMCPY)
		return 0; /* the baseline: bytes of the fp32 source, not a dtype */
	if (cudaMemcpy(b->host, b->dst, n * shardd_dtype_size(out_dtype), cudaMemcpyDeviceToHost) !=
	    cudaSuccess)
		return n;
	for (i = 0; i < n; i++) {
		float want = 0.0f;

		if (k == GPU_REDUCE) {
			for (r = 0; r < b->nin; r++)
				want += bench_grad_value(i, r, 1);
			want /= (float)b->nin;
		} else {
			want = bench_param_value(i, 1);
		}
		wrong += bench_load_exact(b->host, out_dtype, i) != want;
	}
	return wrong;
}

static int gpu_fill(const struct bench_opts *o, struct gpu_bufs *b, uint64_t n)
{
	uint64_t i;
	uint32_t r;

	for (i = 0; i < n; i++)
		((float *)b->host)[i] = bench_param_value(i, 1);
	if (cudaMemcpy(b->src, b->host, n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
		return -1;
	for (r = 0; r < b->nin; r++) {
		for (i = 0; i < n; i++)
			bench_store_exact(b->host, o->dtype, i, bench_grad_value(i, r, 1));
		if (cudaMemcpy(b->in[r], b->host, n * shardd_dtype_size(o->dtype),
			       cudaMemcpyHostToDevice) != cudaSuccess)
			return -1;
	}
	return 0;
}

int bench_gpu_run(const struct bench_opts *o)
{
	static const char *const names[GPU_NKERNELS] = { "memcpy_d2d", "cast", "chunk_cat",
							 "reduce" };
	struct gpu_bufs b = { .nin = o->ranks };
	struct cudaDeviceProp prop;
	cudaEvent_t ev0 = NULL, ev1 = NULL;
	cudaStream_t s = NULL;
	uint64_t bytes, nmax = o->max_bytes / shardd_dtype_size(o->dtype);
	int ndev = 0, ret = 0, k, it;
	uint32_t r;

	if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
		printf("#\n# shardbench gpu: no GPU: skipped\n");
		return 0;
	}
	CUDA_TRY(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
	CUDA_TRY(cudaSetDevice(0), "cudaSetDevice(0)");
	CUDA_TRY(cudaStreamCreate(&s), "cudaStreamCreate");
	CUDA_TRY(cudaEventCreate(&ev0), "cudaEventCreate");
	CUDA_TRY(cudaEventCreate(&ev1), "cudaEventCreate");
	CUDA_TRY(cudaMalloc((void **)&b.src, nmax * sizeof(float)), "cudaMalloc source");
	CUDA_TRY(cudaMalloc(&b.dst, nmax * sizeof(float)), "cudaMalloc destination");
	for (r = 0; r < b.nin; r++)
		CUDA_TRY(cudaMalloc(&b.in[r], nmax * shardd_dtype_size(o->dtype)),
			 "cudaMalloc input");
	b.host = malloc(nmax * sizeof(float));
	if (!b.host) {
		ret = -1;
		goto out;
	}
	printf("#\n# shardbench gpu: %s, dtype %s, %u inputs (reduce) / chunks (chunk_cat),"
	       " warm-up %d, iterations %d\n",
	       prop.name, shardd_dtype_name(o->dtype), b.nin, o->warmup, o->iters);
	printf("# moves: memcpy_d2d 2*size; cast, chunk_cat count*(4+%zu); reduce count*(%u*%zu+4);"
	       " %%memcpy = GB/s over memcpy_d2d's at the same size\n",
	       shardd_dtype_size(o->dtype), b.nin, shardd_dtype_size(o->dtype));
	printf("# %10s %12s %10s %12s %10s %9s %7s\n", "size(B)", "count", "kernel", "time(us)",
	       "GB/s", "%memcpy", "#wrong");
	for (bytes = o->min_bytes; bytes <= o->max_bytes; bytes *= o->factor) {
		uint64_t n = bytes / shardd_dtype_size(o->dtype);
		double copy_gbs = 0;

		if (n % b.nin)
			continue;
		if (gpu_fill(o, &b, n)) {
			printf("# gpu: copying inputs of %llu bytes failed\n",
			       (unsigned long long)bytes);
			ret = -1;
			goto out;
		}
		for (k = 0; k < GPU_NKERNELS; k++) {
			float ms = 0;
			double us, gbs;
			uint64_t wrong = 0;

			for (it = 0; it < o->warmup && !ret; it++)
				ret = gpu_launch(k, o, &b, n, s);
			CUDA_TRY(cudaEventRecord(ev0, s), "cudaEventRecord");
			for (it = 0; it < o->iters && !ret; it++)
				ret = gpu_launch(k, o, &b, n, s);
			CUDA_TRY(cudaEventRecord(ev1, s), "cudaEventRecord");
			CUDA_TRY(cudaEventSynchronize(ev1), "cudaEventSynchronize");
			if (ret) {
				printf("# gpu: %s of %llu bytes failed to launch: %d\n", names[k],
				       (unsigned long long)bytes, ret);
				goto out;
			}
			CUDA_TRY(cudaEventElapsedTime(&ms, ev0, ev1), "cudaEventElapsedTime");
			us = (double)ms * 1000.0 / o->iters;
			gbs = gpu_moved(k, o, b.nin, n) / (us * 1000.0);
			if (k == GPU_MEMCPY)
				copy_gbs = gbs;
			if (o->check)
				wrong = gpu_check(k, o, &b, n);
			printf("%12llu %12llu %10s %12.1f %10.1f %9.1f %7llu\n",
			       (unsigned long long)bytes, (unsigned long long)n, names[k], us, gbs,
			       gbs / copy_gbs * 100.0, (unsigned long long)wrong);
			if (wrong)
				ret = -1;
		}
		fflush(stdout);
		if (bytes > UINT64_MAX / o->factor)
			break;
	}
out:
	free(b.host);
	for (r = 0; r < b.nin; r++)
		cudaFree(b.in[r]);
	cudaFree(b.dst);
	cudaFree(b.src);
	if (ev1)
		cudaEventDestroy(ev1);
	if (ev0)
		cudaEventDestroy(ev0);
	if (s)
		cudaStreamDestroy(s);
	return ret;
}

#else /* !SHARDD_HAVE_CUDA */

int bench_gpu_run(const struct bench_opts *o)
{
	(void)o;
	printf("#\n# shardbench gpu: built without CUDA (make CUDA=1 with nvcc and NCCL): skipped\n");
	return 0;
}

#endif

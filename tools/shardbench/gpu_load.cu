/* SPDX-License-Identifier: MIT */
/*
 * `shardbench gpu --load`: the trainer-like compute load (gpu_load.h).
 * Arithmetic, not a clock spin: a kernel that waits on clock64() would
 * finish on time however little of the GPU it got, where this one takes
 * longer when the daemon's work or an MPS cap takes SMs from it, which is
 * the cost the benchmark reports.
 */
#include "gpu_load.h"

#define LOAD_THREADS 256

__global__ void bench_load_kernel(uint64_t iters, float *sink)
{
	float v[8];

	for (int k = 0; k < 8; k++)
		v[k] = 1.0f + (float)(threadIdx.x + k) * 1e-6f;
	for (uint64_t i = 0; i < iters; i++) {
#pragma unroll
		for (int k = 0; k < 8; k++)
			v[k] = fmaf(v[k], 0.9999f, 1e-4f);
	}
	/* Converges to 1; never -1, but the compiler cannot know that. */
	if (v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7] == -1.0f)
		sink[threadIdx.x] = v[0];
}

extern "C" cudaError_t bench_load_shape(int *blocks, int *threads)
{
	int dev, sms, per_sm;
	cudaError_t e;

	if ((e = cudaGetDevice(&dev)) != cudaSuccess ||
	    (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) !=
		    cudaSuccess ||
	    (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bench_load_kernel,
							       LOAD_THREADS, 0)) != cudaSuccess)
		return e;
	*blocks = sms * (per_sm > 0 ? per_sm : 1);
	*threads = LOAD_THREADS;
	return cudaSuccess;
}

extern "C" cudaError_t bench_load_launch(int blocks, int threads, uint64_t iters, float *sink,
					 cudaStream_t s)
{
	bench_load_kernel<<<blocks, threads, 0, s>>>(iters, sink);
	return cudaGetLastError();
}

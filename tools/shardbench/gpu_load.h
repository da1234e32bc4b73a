/* SPDX-License-Identifier: MIT */
/*
 * The compute load of `shardbench gpu --load` (gpu_load.cu): a kernel that
 * keeps every SM of the device busy with fused multiply-adds for as long as
 * its iteration count says, as a trainer's GEMMs do. Host code in C calls
 * it; only tools/shardbench/gpu_ops.c uses it.
 */
#ifndef SHARDBENCH_GPU_LOAD_H
#define SHARDBENCH_GPU_LOAD_H

#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Blocks and threads per block that fill every SM of the current device
 * at the kernel's full occupancy. Returns cudaSuccess or the CUDA error.
 */
cudaError_t bench_load_shape(int *blocks, int *threads);

/*
 * Queue one launch on s: each thread runs iters rounds of 8 independent
 * fused multiply-add chains; sink (threads floats) is written only by a
 * result that never occurs, so nothing is optimised away.
 */
cudaError_t bench_load_launch(int blocks, int threads, uint64_t iters, float *sink, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif /* SHARDBENCH_GPU_LOAD_H */

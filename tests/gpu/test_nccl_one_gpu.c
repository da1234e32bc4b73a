/* SPDX-License-Identifier: MIT */
/*
 * The parts of the NCCL path that one GPU can run (docs/CUDA.md "NCCL"):
 * the GPU machines lent to us have one GPU and NCCL 2.28, which refuses two
 * ranks of a communicator on one GPU (several ranks per GPU needs NCCL
 * 2.30's experimental NCCL_MULTI_RANK_GPU_ENABLE), so test_nccl.c and
 * test_nccl_span.c skip there. What remains is exercised here, in process,
 * through backend_cuda_nccl.h: libnccl.so.2 loaded with dlopen, a unique
 * id, a one-rank communicator made non-blocking on device 0, an all-reduce
 * queued on a stream (a copy, with one rank), then the teardown of a job's
 * communicators (ncclCommFinalize, ncclCommDestroy) and the abort of one
 * never kept. The refusal of ranks that share a GPU among ranks that do
 * not is test_nccl.c's (it needs one GPU only). Skips without a GPU, and
 * where libnccl.so.2 does not load (naming why).
 */
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_nccl.h"
#include "clock.h"
#include "shardd_proto.h"
#include "world_boot.h"

#define NCCL_TIMEOUT_NS (60ull * 1000000000ull)
#define COUNT           4099

static struct shd_nccl *nc;
static char err[1024];

/* This process uses CUDA itself: count the GPUs here, not in a child. */
static void setup(void)
{
	int n = 0;

	if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
		cr_skip_test("no CUDA device visible");
	if (shd_nccl_load(err, sizeof(err)))
		cr_skip_test("NCCL does not load: %s", err);
	cr_assert_eq(cudaSetDevice(0), cudaSuccess);
	cr_assert_eq(shd_nccl_create(NCCL_TIMEOUT_NS, &nc), 0);
}

static void teardown(void)
{
	shd_nccl_destroy(nc);
	nc = NULL;
}

TestSuite(nccl_one_gpu, .init = setup, .fini = teardown, .timeout = 120);

/* A one-rank span clique of `job` on device 0, made from a fresh unique id. */
static struct shd_nccl_clique *make_one(const void *job)
{
	uint8_t id[SHD_WORLD_ID_BYTES];
	const int32_t devices[1] = { 0 };
	const uint32_t ranks[1] = { 0 };
	struct shd_nccl_clique *c = NULL;

	cr_assert_eq(shd_nccl_unique_ids(id, 1, err, sizeof(err)), 0, "ncclGetUniqueId: %s", err);
	cr_assert_eq(shd_nccl_span_make(job, "one-gpu", 1, 0, devices, 1, ranks, 1, id,
					shd_now_ns() + NCCL_TIMEOUT_NS, &c, err, sizeof(err)),
		     0, "a one-rank communicator on device 0: %s", err);
	cr_assert_not_null(c);
	return c;
}

Test(nccl_one_gpu, one_rank_communicator_is_made_runs_an_all_reduce_and_is_destroyed_with_its_job)
{
	static const char job = 'j';
	struct shd_nccl_clique *c = make_one(&job);
	float *host = malloc(COUNT * sizeof(float)), *send = NULL, *recv = NULL;
	cudaStream_t s;

	cr_assert_not_null(host);
	shd_nccl_span_add(nc, c);
	cr_assert_eq(shd_nccl_span_find(nc, &job, 1, 0), c, "the kept clique is not found");
	for (size_t i = 0; i < COUNT; i++)
		host[i] = (float)i * 0.5f - 7.0f;
	cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
	cr_assert_eq(cudaMalloc((void **)&send, COUNT * sizeof(float)), cudaSuccess);
	cr_assert_eq(cudaMalloc((void **)&recv, COUNT * sizeof(float)), cudaSuccess);
	cr_assert_eq(cudaMemcpy(send, host, COUNT * sizeof(float), cudaMemcpyHostToDevice),
		     cudaSuccess);
	cr_assert_eq(cudaMemset(recv, 0xff, COUNT * sizeof(float)), cudaSuccess);
	cr_assert_eq(shd_nccl_collective(nc, c, SHD_NCCL_ALL_REDUCE, (void *const[]){ send },
					 (void *const[]){ recv }, COUNT, SHARDD_DTYPE_FP32,
					 (void *const[]){ s }, err, sizeof(err)),
		     0, "all-reduce on one rank: %s", err);
	cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
	memset(host, 0, COUNT * sizeof(float));
	cr_assert_eq(cudaMemcpy(host, recv, COUNT * sizeof(float), cudaMemcpyDeviceToHost),
		     cudaSuccess);
	for (size_t i = 0; i < COUNT; i++)
		cr_assert_eq(host[i], (float)i * 0.5f - 7.0f, "element %zu: %g", i, host[i]);
	cr_expect_eq(shd_nccl_check_device(nc, 0, 0, err, sizeof(err)), 0,
		     "a healthy communicator was aborted: %s", err);
	shd_nccl_job_end(nc, &job);
	cr_expect_null(shd_nccl_span_find(nc, &job, 1, 0),
		       "the job ended but its communicator is kept");
	cudaFree(send);
	cudaFree(recv);
	cudaStreamDestroy(s);
	free(host);
}

Test(nccl_one_gpu, a_communicator_never_kept_is_aborted_and_the_next_is_made_again)
{
	static const char job = 'k';

	shd_nccl_span_abort(make_one(&job));
	cr_expect_null(shd_nccl_span_find(nc, &job, 1, 0));
	shd_nccl_span_add(nc, make_one(&job));
	cr_expect_not_null(shd_nccl_span_find(nc, &job, 1, 0));
	shd_nccl_job_end(nc, &job);
	cr_expect_null(shd_nccl_span_find(nc, &job, 1, 0));
}

/* SPDX-License-Identifier: MIT */
/*
 * Ordering between the trainer's stream and the daemon's device work,
 * through a real `shardd --backend cuda` and real rank processes on one GPU.
 *
 * Each rank queues a long delay on its stream, then writes its shard (or
 * its grad) on that stream, submits unshard (or reduce) without waiting for
 * the writes, reaps the completion, and copies the result back on the same
 * stream. With a stream set (shardd_stream_set) the fences make this
 * correct with no CPU wait: were the daemon's wait on the trainer's event
 * missing, it would read the shard before the delayed write lands; were
 * the trainer's wait on the daemon's event missing, the copy could run
 * before the daemon's kernels. A rank without a stream synchronises before
 * submitting and reads after the completion with a blocking copy: the
 * daemon must still finish its work before completing such an op, also
 * when the other rank of the same op is fenced. Skips without a GPU.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "shardd.h"

#define WORLD         2
#define NUMEL         (1u << 20)          /* fp32 elements of the param: 4 MiB */
#define DELAY_BYTES   ((size_t)256 << 20) /* each delay memset: ~0.1 ms at H100 bandwidth */
#define DELAYS        32                  /* a few ms in all: far longer than an op's round trip */
#define STEPS         4
#define CHILD_WAIT_MS 60000

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	const char *extra[] = { "--backend", "cuda", NULL };

	/* Counted in a child: this process forks the ranks, so it must not touch CUDA. */
	if (harness_cuda_devices() == 0)
		cr_skip_test("no CUDA device visible");
	signal(SIGPIPE, SIG_IGN);
	cr_assert_eq(harness_daemon_start(&daemon_, extra), 0,
		     "shardd --backend cuda did not start");
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(stream_fences, .init = start_daemon, .fini = stop_daemon, .timeout = 120);

struct rank_args {
	const char *job;
	uint32_t rank;
	int use_stream;
};

/* The first element of `got` (n floats) that is not `want`, or -1. */
static long first_bad(const float *got, uint64_t n, float want)
{
	for (uint64_t i = 0; i < n; i++)
		if (got[i] != want)
			return (long)i;
	return -1;
}

/* Queue DELAYS large memsets on `s`: what follows on the stream starts a few ms from now. */
static int delay(void *scratch, cudaStream_t s, int step)
{
	for (int i = 0; i < DELAYS; i++)
		CHILD_CHECK_CUDA(cudaMemsetAsync(scratch, step + i, DELAY_BYTES, s));
	return 0;
}

/* Fill `n` floats of `host` with v. */
static void fill(float *host, uint64_t n, float v)
{
	for (uint64_t i = 0; i < n; i++)
		host[i] = v;
}

static int rank_main(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_attach_opts o = {
		.socket_path = daemon_.socket,
		.job = a->job,
		.rank = a->rank,
		.replicate = 1,
		.shard = WORLD,
		.device = 0,
	};
	struct shardd_param_desc p = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { NUMEL }
	};
	const uint64_t half = NUMEL / WORLD;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	cudaStream_t s;
	void *scratch;
	float *host;

	CHILD_CHECK_CUDA(cudaSetDevice(0));
	CHILD_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	CHILD_CHECK_CUDA(cudaMalloc(&scratch, DELAY_BYTES));
	CHILD_CHECK_CUDA(cudaMallocHost((void **)&host, NUMEL * sizeof(float)));
	CHILD_CHECK_SHARDD(shardd_connect(&o, &c));
	CHILD_CHECK_SHARDD(shardd_group_register(c, "fenced", &p, 1, NULL, NULL, &g));
	if (a->use_stream)
		CHILD_CHECK_SHARDD(shardd_stream_set(c, s));

	for (int step = 1; step <= STEPS; step++) {
		float mine = (float)(100 * a->rank + step);
		long bad;

		/* unshard: our shard written late on the stream, the gathered tensor read on it. */
		if (delay(scratch, s, step))
			return 1;
		fill(host, half, mine);
		CHILD_CHECK_CUDA(cudaMemcpyAsync(shardd_group_shard(g, 0), host,
						 half * sizeof(float), cudaMemcpyHostToDevice, s));
		if (!a->use_stream)
			CHILD_CHECK_CUDA(cudaStreamSynchronize(s));
		CHILD_CHECK_SHARDD(shardd_unshard(g, (uint64_t)step));
		CHILD_CHECK_CUDA(cudaMemcpyAsync(host, shardd_group_unsharded(g, 0),
						 NUMEL * sizeof(float), cudaMemcpyDeviceToHost, s));
		CHILD_CHECK_CUDA(cudaStreamSynchronize(s));
		for (uint32_t r = 0; r < WORLD; r++) {
			bad = first_bad(host + r * half, half, (float)(100 * r + step));
			if (bad >= 0) {
				fprintf(stderr,
					"rank %u step %d: unsharded element %lu is %g, want %g "
					"(rank %u's shard)\n",
					a->rank, step, (unsigned long)(r * half + bad),
					host[r * half + bad], (double)(100 * r + step), r);
				return 1;
			}
		}

		/* reduce: our grad written late, our sharded grad (the average) read on the stream. */
		if (delay(scratch, s, step))
			return 1;
		fill(host, NUMEL, (float)((a->rank + 1) * step));
		CHILD_CHECK_CUDA(cudaMemcpyAsync(shardd_group_grad(g, 0), host,
						 NUMEL * sizeof(float), cudaMemcpyHostToDevice, s));
		if (!a->use_stream)
			CHILD_CHECK_CUDA(cudaStreamSynchronize(s));
		CHILD_CHECK_SHARDD(shardd_zero_grad(g));
		CHILD_CHECK_SHARDD(shardd_reduce(g, (uint64_t)step, 0));
		CHILD_CHECK_CUDA(cudaMemcpyAsync(host, shardd_group_shard_grad(g, 0),
						 half * sizeof(float), cudaMemcpyDeviceToHost, s));
		CHILD_CHECK_CUDA(cudaStreamSynchronize(s));
		/* (1 * step + 2 * step) / 2: exact in fp32. */
		bad = first_bad(host, half, 1.5f * (float)step);
		if (bad >= 0) {
			fprintf(stderr,
				"rank %u step %d: sharded grad element %ld is %g, want %g\n",
				a->rank, step, bad, host[bad], 1.5 * step);
			return 1;
		}
		CHILD_CHECK_SHARDD(shardd_reshard(g, (uint64_t)step));
	}
	shardd_group_close(g);
	shardd_close(c);
	cudaFreeHost(host);
	cudaFree(scratch);
	cudaStreamDestroy(s);
	return 0;
}

static void run_ranks(const char *job, int stream0, int stream1)
{
	struct rank_args args[WORLD] = {
		{ job, 0, stream0 },
		{ job, 1, stream1 },
	};

	harness_run_children(rank_main, args, sizeof(args[0]), WORLD, CHILD_WAIT_MS, &daemon_);
}

Test(stream_fences, fenced_ranks_read_gathered_and_reduced_values_without_cpu_waits)
{
	run_ranks("fenced", 1, 1);
}

Test(stream_fences, unfenced_ranks_see_results_in_memory_at_completion)
{
	run_ranks("unfenced", 0, 0);
}

Test(stream_fences, one_fenced_and_one_unfenced_rank_share_an_op)
{
	run_ranks("mixed", 1, 0);
}

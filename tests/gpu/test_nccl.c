/* SPDX-License-Identifier: MIT */
/*
 * Collectives across GPUs: a real `shardd --backend cuda` and rank
 * processes each on its own GPU, so the daemon runs unshard and reduce with
 * NCCL (docs/CUDA.md "NCCL").
 *
 * - 2 ranks on devices 0 and 1 (plain FSDP): every unsharded element is
 *   the registered value (a dim-0 param with a padding row, a Shard(1)
 *   param, a bf16 param_dtype), and the sharded grads are the average of
 *   both ranks' grads, then twice it after a second reduce accumulates.
 * - HSDP 2 x 2: a reduce without the all-reduce keeps a partial, the next
 *   one with it averages both microbatches over all 4 ranks; on 4 GPUs
 *   (every shard and replicate group through NCCL), and on 2 GPUs both
 *   ways (each replica across the GPUs: shard groups through NCCL, the
 *   replicate groups on one GPU each; or a GPU per replica: the reverse).
 * - Ranks of one shard group partly sharing a GPU: the registration fails
 *   for every rank, naming the ranks and devices (needs one GPU only: the
 *   refusal comes before any allocation).
 *
 * Tolerance: NCCL sums in the reduce dtype, rounding at every hop, where
 * the host sums in fp32 and rounds once. Against the exact average (in
 * double) an element may be off by N x steps ulps of the reduce dtype at
 * the magnitude of steps x the sum of |grads| (N ranks, steps reduces),
 * plus one fp32 ulp of the result per step for the cast and the
 * accumulation. Padding rows must be exactly zero, and gathered values
 * exact.
 *
 * The test process itself never touches CUDA (it counts GPUs in a child),
 * so that the rank processes it forks may. Skips with fewer GPUs than a
 * test needs.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "nccl_checks.h"
#include "shardd.h"

#define CHILD_WAIT_MS 180000
#define MAX_RANKS     4

static struct harness_daemon daemon_;

/* ------------------------------------------------------------------ */
/* Daemon and GPUs                                                     */
/* ------------------------------------------------------------------ */

static void start_daemon(int need)
{
	const char *extra[] = { "--backend", "cuda", NULL };
	int n = harness_cuda_devices();

	if (n < need)
		cr_skip_test("needs %d GPU%s, %d visible%s", need, need > 1 ? "s" : "", n,
			     need > 1 && n > 0 ? ": " NCCL_ONE_RANK_PER_GPU : "");
	signal(SIGPIPE, SIG_IGN);
	cr_assert_eq(harness_daemon_start(&daemon_, extra), 0,
		     "shardd --backend cuda did not start");
}

static void start_1(void)
{
	start_daemon(1);
}

static void start_2(void)
{
	start_daemon(2);
}

static void start_4(void)
{
	start_daemon(4);
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

/* ------------------------------------------------------------------ */
/* Values                                                              */
/* ------------------------------------------------------------------ */

/* A group of the test: its params and precision. */
struct tgroup {
	const char *name;
	const struct shardd_param_desc *params;
	uint32_t nparams;
	struct shardd_precision precision;
};

/* w: 1001 rows over 2 shards leaves a padding row; t: Shard(1), a chunk-cat. */
static const struct shardd_param_desc dense_params[] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 1001, 3 } },
	{ .name = "t", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 4, 6 }, .shard_dim = 1 },
};
/* fp32 params gathered as bf16, reduced in bf16 (grads in the param_dtype). */
static const struct shardd_param_desc half_params[] = {
	{ .name = "v", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 257 } },
};

static const struct tgroup dense = { "dense", dense_params, 2, { .param_dtype = 0 } };
static const struct tgroup half = { "half", half_params, 1, { .param_dtype = SHARDD_DTYPE_BF16 } };

/* ------------------------------------------------------------------ */
/* Rank processes                                                      */
/* ------------------------------------------------------------------ */

struct rank_args {
	const char *job;
	uint32_t rank, replicate, shard;
	int32_t device;
	int hsdp; /* reduce step 1 without the all-reduce, step 2 with it */
	const struct tgroup *groups[2];
	uint32_t ngroups;
};

/* Every element of every param of `g` as gathered: the registered values, cast to the unsharded dtype. */
static int check_unsharded(const struct rank_args *a, const struct tgroup *tg,
			   struct shardd_group *g)
{
	char who[96];

	snprintf(who, sizeof(who), "rank %u group '%s'", a->rank, tg->name);
	for (uint32_t pi = 0; pi < tg->nparams; pi++) {
		uint32_t udt = tg->precision.param_dtype ? tg->precision.param_dtype
							 : tg->params[pi].dtype;

		if (check_unsharded_param(who, pi, &tg->params[pi], udt, shardd_group_layout(g, pi),
					  shardd_group_unsharded(g, pi)))
			return 1;
	}
	return 0;
}

/* This rank's grads of every param of `g`, written to its grad buffer. */
static int write_grads(const struct rank_args *a, const struct tgroup *tg, struct shardd_group *g)
{
	for (uint32_t pi = 0; pi < tg->nparams; pi++) {
		uint32_t gdt = tg->precision.param_dtype ? tg->precision.param_dtype
							 : tg->params[pi].dtype;

		if (write_grad_param(a->rank, pi, &tg->params[pi], gdt, shardd_group_grad(g, pi)))
			return 1;
	}
	return 0;
}

/*
 * This rank's sharded grads after `steps` reduces of the same grads: steps
 * x the average over every rank, within the tolerance of the file comment;
 * padding rows zero.
 */
static int check_sharded_grads(const struct rank_args *a, const struct tgroup *tg,
			       struct shardd_group *g, uint32_t steps)
{
	char who[96];

	snprintf(who, sizeof(who), "rank %u group '%s'", a->rank, tg->name);
	for (uint32_t pi = 0; pi < tg->nparams; pi++) {
		uint32_t gdt = tg->precision.param_dtype ? tg->precision.param_dtype
							 : tg->params[pi].dtype;
		uint32_t rd = tg->precision.reduce_dtype ? tg->precision.reduce_dtype : gdt;

		if (check_shard_grad_param(who, pi, &tg->params[pi], gdt, rd, a->shard,
					   a->rank % a->shard, a->replicate * a->shard, steps,
					   shardd_group_layout(g, pi),
					   shardd_group_shard_grad(g, pi)))
			return 1;
	}
	return 0;
}

static int rank_main(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_attach_opts o = {
		.socket_path = daemon_.socket,
		.job = a->job,
		.rank = a->rank,
		.replicate = a->replicate,
		.shard = a->shard,
		.device = a->device,
	};
	struct shardd_group *g[2] = { NULL, NULL };
	struct shardd_client *c = NULL;

	CHILD_CHECK_CUDA(cudaSetDevice(a->device));
	CHILD_CHECK_SHARDD(shardd_connect(&o, &c));
	for (uint32_t k = 0; k < a->ngroups; k++) {
		const struct tgroup *tg = a->groups[k];

		if (register_loaded(c, tg->name, tg->params, tg->nparams, &tg->precision, &g[k]))
			return 1;
	}
	for (uint32_t k = 0; k < a->ngroups; k++) {
		CHILD_CHECK_SHARDD(shardd_unshard(g[k], 1));
		if (check_unsharded(a, a->groups[k], g[k]))
			return 1;
		CHILD_CHECK_SHARDD(shardd_reshard(g[k], 1));
		if (write_grads(a, a->groups[k], g[k]))
			return 1;
		if (a->hsdp) {
			/* Microbatch 1 stays a partial; microbatch 2 adds to it, then all-reduces. */
			CHILD_CHECK_SHARDD(shardd_reduce(g[k], 1, 0));
			CHILD_CHECK_SHARDD(shardd_reduce(g[k], 2, SHARDD_REDUCE_ALL_REDUCE));
			if (check_sharded_grads(a, a->groups[k], g[k], 2))
				return 1;
			continue;
		}
		CHILD_CHECK_SHARDD(shardd_reduce(g[k], 1, 0));
		if (check_sharded_grads(a, a->groups[k], g[k], 1))
			return 1;
		/* The sharded grad exists now: the next reduce accumulates into it. */
		CHILD_CHECK_SHARDD(shardd_reduce(g[k], 2, 0));
		if (check_sharded_grads(a, a->groups[k], g[k], 2))
			return 1;
	}
	for (uint32_t k = 0; k < a->ngroups; k++)
		shardd_group_close(g[k]);
	shardd_close(c);
	return 0;
}

/* Fork every rank, wait for all, dump the daemon's log if one failed. */
static void run_ranks(struct rank_args *args, uint32_t n)
{
	harness_run_children(rank_main, args, sizeof(*args), n, CHILD_WAIT_MS, &daemon_);
}

Test(nccl, two_ranks_on_two_gpus_gather_and_average_through_nccl, .init = start_2,
     .fini = stop_daemon, .timeout = 240)
{
	struct rank_args args[2];

	for (uint32_t r = 0; r < 2; r++)
		args[r] = (struct rank_args){ .job = "nccl2",
					      .rank = r,
					      .replicate = 1,
					      .shard = 2,
					      .device = (int32_t)r,
					      .groups = { &dense, &half },
					      .ngroups = 2 };
	run_ranks(args, 2);
}

/* HSDP 2 x 2, rank r on devices[r]. */
static void hsdp_case(const char *job, const int32_t *devices)
{
	struct rank_args args[4];

	for (uint32_t r = 0; r < 4; r++)
		args[r] = (struct rank_args){ .job = job,
					      .rank = r,
					      .replicate = 2,
					      .shard = 2,
					      .device = devices[r],
					      .hsdp = 1,
					      .groups = { &dense },
					      .ngroups = 1 };
	run_ranks(args, 4);
}

Test(nccl, hsdp_2x2_on_four_gpus_keeps_the_partial_then_all_reduces_across_replicas,
     .init = start_4, .fini = stop_daemon, .timeout = 240)
{
	const int32_t devices[4] = { 0, 1, 2, 3 };

	hsdp_case("hsdp4", devices);
}

Test(nccl, hsdp_2x2_with_each_replica_across_two_gpus_gathers_through_nccl, .init = start_2,
     .fini = stop_daemon, .timeout = 240)
{
	const int32_t devices[4] = { 0, 1, 0, 1 };

	hsdp_case("hsdp_across", devices);
}

Test(nccl, hsdp_2x2_with_a_gpu_per_replica_all_reduces_through_nccl, .init = start_2,
     .fini = stop_daemon, .timeout = 240)
{
	const int32_t devices[4] = { 0, 0, 1, 1 };

	hsdp_case("hsdp_per_gpu", devices);
}

/* ------------------------------------------------------------------ */
/* Refusal                                                             */
/* ------------------------------------------------------------------ */

/* Rank `rank` of 3 on device 0, 0 or 1: its registration must fail, naming who shares what. */
static int mixed_main(void *arg)
{
	uint32_t rank = *(const uint32_t *)arg;
	struct shardd_attach_opts o = {
		.socket_path = daemon_.socket,
		.job = "mixed",
		.rank = rank,
		.replicate = 1,
		.shard = 3,
		.device = rank == 2 ? 1 : 0,
	};
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	const char *why;
	int ret;

	CHILD_CHECK_SHARDD(shardd_connect(&o, &c));
	ret = shardd_group_register(c, dense.name, dense.params, dense.nparams, NULL, NULL, &g);
	why = shardd_last_error();
	CHILD_CHECK(ret < 0, "rank %u: a shard group on devices 0,0,1 was registered", rank);
	CHILD_CHECK(strstr(why, "ranks 0 and 1 share device 0") &&
			    strstr(why, "rank 2 is on device 1") && strstr(why, "opts.device"),
		    "rank %u: the refusal must name the ranks, their devices and the fix: %s", rank,
		    why);
	shardd_close(c);
	return 0;
}

Test(nccl, shard_group_partly_sharing_a_gpu_is_refused_at_registration, .init = start_1,
     .fini = stop_daemon, .timeout = 120)
{
	uint32_t ranks[3] = { 0, 1, 2 };

	harness_run_children(mixed_main, ranks, sizeof(ranks[0]), 3, CHILD_WAIT_MS, &daemon_);
}

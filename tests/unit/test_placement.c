/* SPDX-License-Identifier: MIT */
/*
 * daemon/layout/placement.c: which ranks of a group share which GPU, which shard
 * and replicate groups run NCCL, the refusal of groups that partly share
 * GPUs (every message names the ranks, the devices and the fix), and the
 * staging layouts of the NCCL path. Expected numbers are worked out by
 * hand in the comments.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "placement.h"

#define NONE SHARDD_HELLO_DEVICE_HOST

/* Plan that must succeed. */
static void plan_ok(const int32_t *hello, uint32_t replicate, uint32_t shard,
		    struct shd_placement *pl)
{
	char err[512] = "";

	cr_assert_eq(shd_placement_plan("blk", hello, replicate, shard, pl, err, sizeof(err)), 0,
		     "plan %ux%u refused: %s", replicate, shard, err);
}

/* Plan that must be refused with a message holding each non-NULL `want`. */
static void plan_refused(const int32_t *hello, uint32_t replicate, uint32_t shard,
			 const char *const *want)
{
	struct shd_placement pl;
	char err[1024] = "";

	cr_assert_eq(shd_placement_plan("blk", hello, replicate, shard, &pl, err, sizeof(err)),
		     -SHARDD_E_INVALID, "plan %ux%u must be refused", replicate, shard);
	for (; *want; want++)
		cr_assert(strstr(err, *want), "refusal '%s' must say '%s'", err, *want);
}

Test(placement, classify_tells_one_device_from_distinct_from_mixed, .timeout = 5)
{
	const int32_t one[] = { 3, 3, 3, 3 }, distinct[] = { 0, 1, 2, 3 }, mixed[] = { 0, 1, 1, 2 };
	const int32_t mixed_last[] = { 2, 0, 1, 2 };

	cr_assert_eq(shd_placement_classify(one, 4), SHD_PLACE_SHARED);
	cr_assert_eq(shd_placement_classify(distinct, 4), SHD_PLACE_NCCL);
	cr_assert_eq(shd_placement_classify(mixed, 4), SHD_PLACE_MIXED);
	/* The pair that shares may be the first and the last member. */
	cr_assert_eq(shd_placement_classify(mixed_last, 4), SHD_PLACE_MIXED);
	/* One member needs no collective across devices, whatever its device. */
	cr_assert_eq(shd_placement_classify(distinct + 2, 1), SHD_PLACE_SHARED);
	cr_assert_eq(shd_placement_classify(distinct, 2), SHD_PLACE_NCCL);
}

Test(placement, a_rank_that_named_no_device_sits_on_device_0, .timeout = 5)
{
	const int32_t with_zero[] = { NONE, 0 }, with_one[] = { NONE, 1 };
	struct shd_placement pl;

	cr_assert_eq(shd_placement_device(NONE), 0);
	cr_assert_eq(shd_placement_device(5), 5);
	plan_ok(with_zero, 1, 2, &pl);
	cr_assert_eq(pl.shard_nccl[0], 0,
		     "a rank with no device shares device 0 with one that named it");
	plan_ok(with_one, 1, 2, &pl);
	cr_assert_eq(pl.shard_nccl[0], 1);
}

Test(placement, single_gpu_job_runs_every_collective_on_kernels, .timeout = 5)
{
	const int32_t hello[] = { 0, 0, 0, 0 };
	struct shd_placement pl;

	plan_ok(hello, 1, 4, &pl);
	cr_assert_eq(pl.nccl, 0);
	cr_assert_eq(pl.shard_nccl[0], 0);
	/* HSDP 2x2 on one GPU: shard and replicate groups alike. */
	plan_ok(hello, 2, 2, &pl);
	cr_assert_eq(pl.nccl, 0);
	cr_assert_eq(pl.replicate, 2);
	cr_assert_eq(pl.shard, 2);
}

Test(placement, shard_group_on_distinct_gpus_runs_nccl, .timeout = 5)
{
	const int32_t hello[] = { 0, 1, 2, 3 };
	struct shd_placement pl;

	plan_ok(hello, 1, 4, &pl);
	cr_assert_eq(pl.shard_nccl[0], 1);
	cr_assert_eq(pl.nccl, 1);
}

Test(placement, hsdp_plans_shard_and_replicate_groups_apart, .timeout = 5)
{
	/* Each replica across GPUs 0,1: shard groups NCCL; ranks 0,2 share GPU 0, ranks 1,3 GPU 1. */
	const int32_t across[] = { 0, 1, 0, 1 };
	/* Each replica on its own GPU: shard groups on kernels, replicate groups {0,2}, {1,3} NCCL. */
	const int32_t per_replica[] = { 0, 0, 1, 1 };
	/* Four GPUs: all four groups NCCL. */
	const int32_t four[] = { 0, 1, 2, 3 };
	struct shd_placement pl;

	plan_ok(across, 2, 2, &pl);
	cr_assert(pl.shard_nccl[0] && pl.shard_nccl[1]);
	cr_assert(!pl.replicate_nccl[0] && !pl.replicate_nccl[1]);
	cr_assert_eq(pl.nccl, 2);

	plan_ok(per_replica, 2, 2, &pl);
	cr_assert(!pl.shard_nccl[0] && !pl.shard_nccl[1]);
	cr_assert(pl.replicate_nccl[0] && pl.replicate_nccl[1]);
	cr_assert_eq(pl.nccl, 2);

	plan_ok(four, 2, 2, &pl);
	cr_assert(pl.shard_nccl[0] && pl.shard_nccl[1] && pl.replicate_nccl[0] &&
		  pl.replicate_nccl[1]);
	cr_assert_eq(pl.nccl, 4);
}

Test(placement, shard_group_partly_sharing_a_gpu_is_refused_naming_ranks_and_devices, .timeout = 5)
{
	const int32_t hello[] = { 0, 0, 1, 2 };
	const char *want[] = {
		"register group 'blk'",
		"the shard group of replica 0 (ranks 0-3)",
		"ranks 0 and 1 share device 0",
		"rank 2 is on device 1",
		"rank 0 on 0, rank 1 on 0, rank 2 on 1, rank 3 on 2",
		"each sit on their own GPU (NCCL collectives) or all on one GPU (device copies)",
		"opts.device",
		NULL,
	};

	plan_refused(hello, 1, 4, want);
}

Test(placement, second_replica_partly_sharing_is_refused_with_its_own_ranks, .timeout = 5)
{
	/* Replica 0 fine (GPUs 0,1,2), replica 1 (ranks 3-5) has ranks 4 and 5 on GPU 5. */
	const int32_t hello[] = { 0, 1, 2, 3, 5, 5 };
	const char *want[] = {
		"the shard group of replica 1 (ranks 3-5)",
		"ranks 4 and 5 share device 5",
		"rank 3 is on device 3",
		"rank 3 on 3, rank 4 on 5, rank 5 on 5",
		NULL,
	};

	plan_refused(hello, 2, 3, want);
}

Test(placement, replicate_group_partly_sharing_a_gpu_is_refused, .timeout = 5)
{
	/* 3 x 1: each replica one rank; the replicate group of shard 0 is ranks 0,1,2 on GPUs 0,1,1. */
	const int32_t hello[] = { 0, 1, 1 };
	const char *want[] = {
		"the replicate group of shard index 0",
		"ranks 1 and 2 share device 1",
		"rank 0 is on device 0",
		"rank 0 on 0, rank 1 on 1, rank 2 on 1",
		NULL,
	};

	plan_refused(hello, 3, 1, want);
}

Test(placement, refusal_says_which_rank_named_no_device, .timeout = 5)
{
	const int32_t hello[] = { NONE, 0, 1 };
	const char *want[] = { "ranks 0 and 1 share device 0",
			       "rank 0 on 0 (it named none), rank 1 on 0,", NULL };

	plan_refused(hello, 1, 3, want);
}

Test(placement, mesh_outside_the_world_is_refused, .timeout = 5)
{
	const int32_t hello[] = { 0 };
	struct shd_placement pl;
	char err[256] = "";

	cr_assert_eq(shd_placement_plan("blk", hello, 0, 1, &pl, err, sizeof(err)),
		     -SHARDD_E_INVALID);
	cr_assert(strstr(err, "mesh 0 x 1"), "%s", err);
	cr_assert_eq(shd_placement_plan("blk", hello, 2, SHARDD_MAX_WORLD, &pl, err, sizeof(err)),
		     -SHARDD_E_INVALID);
}

/* Three params sharded over 4 ranks: a [10, 3] fp32 (3 rows: 9 elements), b [40] (10), c [100, 8] fp16 (200). */
static struct shd_layout three_params(void)
{
	struct shardd_param_spec s[3];
	struct shd_layout l;
	char err[256] = "";

	memset(s, 0, sizeof(s));
	snprintf(s[0].name, sizeof(s[0].name), "a");
	s[0].dtype = SHARDD_DTYPE_FP32;
	s[0].ndim = 2;
	s[0].shape[0] = 10;
	s[0].shape[1] = 3;
	snprintf(s[1].name, sizeof(s[1].name), "b");
	s[1].dtype = SHARDD_DTYPE_FP32;
	s[1].ndim = 1;
	s[1].shape[0] = 40;
	snprintf(s[2].name, sizeof(s[2].name), "c");
	s[2].dtype = SHARDD_DTYPE_FP16;
	s[2].ndim = 2;
	s[2].shape[0] = 100;
	s[2].shape[1] = 8;
	cr_assert_eq(shd_layout_build(s, 3, 4, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(l.params[0].shard_numel, 9);
	cr_assert_eq(l.params[1].shard_numel, 10);
	cr_assert_eq(l.params[2].shard_numel, 200);
	return l;
}

Test(placement, reduce_shard_lays_params_out_aligned_in_the_reduce_dtype, .timeout = 5)
{
	struct shd_layout l = three_params();
	uint64_t off[3];

	/* fp32: 36 -> 64, 40 -> 64, 800 -> 832 bytes: offsets 0, 64, 128, total 960. */
	cr_assert_eq(shd_placement_reduce_shard(&l, SHARDD_DTYPE_FP32, off), 960);
	cr_assert_eq(off[0], 0);
	cr_assert_eq(off[1], 64);
	cr_assert_eq(off[2], 128);
	/* bf16: 18 -> 64, 20 -> 64, 400 -> 448 bytes: offsets 0, 64, 128, total 576. */
	cr_assert_eq(shd_placement_reduce_shard(&l, SHARDD_DTYPE_BF16, off), 576);
	cr_assert_eq(off[2], 128);
	shd_layout_free(&l);
}

Test(placement, reduce_shard_of_empty_params_still_takes_one_alignment_unit, .timeout = 5)
{
	struct shardd_param_spec s;
	struct shd_layout l;
	uint64_t off[1];
	char err[256] = "";

	memset(&s, 0, sizeof(s));
	snprintf(s.name, sizeof(s.name), "empty");
	s.dtype = SHARDD_DTYPE_FP32;
	s.ndim = 1;
	s.shape[0] = 0;
	cr_assert_eq(shd_layout_build(&s, 1, 2, SHARDD_DTYPE_NONE, &l, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(shd_placement_reduce_shard(&l, SHARDD_DTYPE_FP32, off), SHARDD_ALIGN);
	cr_assert_eq(off[0], 0);
	shd_layout_free(&l);
}

Test(placement, staging_holds_the_larger_of_gather_and_scatter, .timeout = 5)
{
	/* 4 ranks: gather 4 x 1000, scatter 4 x 960. */
	cr_assert_eq(shd_placement_staging_bytes(4, 1000, 960), 4000);
	cr_assert_eq(shd_placement_staging_bytes(4, 0, 960), 3840);
	cr_assert_eq(shd_placement_staging_bytes(4, 1000, 0), 4000);
	/* A product past 64 bits is no size. */
	cr_assert_eq(shd_placement_staging_bytes(1024, UINT64_MAX / 512, 64), 0);
}

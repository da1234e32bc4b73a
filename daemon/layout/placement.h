/* SPDX-License-Identifier: MIT */
/*
 * Placement of a group's collectives on devices (the cuda backend; the
 * host backend ignores devices): which ranks share which GPU, whether a
 * shard group or a replicate group runs its collectives with NCCL (each
 * rank on its own device) or with device copies and kernels (all its ranks
 * on one device), the refusal of anything in between, and the layout of
 * the staging buffers the NCCL path moves bytes through.
 *
 * Pure logic, no CUDA: the engine plans a group at registration with it,
 * and backend_cuda.c classifies an op's buffers with the same rule.
 */
#ifndef SHD_PLACEMENT_H
#define SHD_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "shardd_proto.h"

/* The device of a rank that named none in its hello (SHARDD_HELLO_DEVICE_HOST). */
#define SHD_PLACEMENT_DEFAULT_DEVICE 0

/* How the members of one collective (a shard group or a replicate group) sit on devices. */
enum shd_placement_kind {
	SHD_PLACE_SHARED = 1, /* all on one device (or one member): device copies and kernels */
	SHD_PLACE_NCCL = 2,   /* two or more members, on pairwise distinct devices: NCCL */
	SHD_PLACE_MIXED = 3,  /* some share a device and some do not: refused */
};

/* A group's plan for a mesh R x S. */
struct shd_placement {
	uint32_t replicate, shard;
	uint8_t shard_nccl[SHARDD_MAX_WORLD]; /* [replicate]: replica u's shard group runs NCCL */
	/* [shard]: shard index s's replicate group runs NCCL */
	uint8_t replicate_nccl[SHARDD_MAX_WORLD];
	uint32_t nccl; /* how many of those groups run NCCL */
};

/* The device that holds a rank's buffers: the one its hello named, else the default. */
static inline int32_t shd_placement_device(int32_t hello_device)
{
	return hello_device == SHARDD_HELLO_DEVICE_HOST ? SHD_PLACEMENT_DEFAULT_DEVICE
							: hello_device;
}

/* enum shd_placement_kind of `n` members on `devices` (devices as buffers sit, already resolved). */
uint32_t shd_placement_classify(const int32_t *devices, uint32_t n);

/*
 * Plan group `group`'s collectives for mesh R x S (rank = replica * S +
 * shard index) from each rank's hello.device (`hello_devices`, [R * S]):
 * each replica's shard group and, with R > 1, each shard index's replicate
 * group is SHARED or NCCL. 0, or -SHARDD_E_INVALID with `err` naming the
 * group, the ranks, their devices and the fix when one of them is MIXED.
 */
int shd_placement_plan(const char *group, const int32_t *hello_devices, uint32_t replicate,
		       uint32_t shard, struct shd_placement *out, char *err, size_t errlen);

/*
 * One shard of every param of layout `l` in `reduce_dtype`: an HSDP
 * partial, and one block of a reduce-scatter's staging buffer. Param i
 * starts at offsets[i] (bytes, a multiple of SHARDD_ALIGN; `offsets` has
 * l->nparams entries) and holds its shard_numel elements, padding rows
 * included; the return value is the bytes of the whole shard, at least
 * SHARDD_ALIGN.
 */
uint64_t shd_placement_reduce_shard(const struct shd_layout *l, uint32_t reduce_dtype,
				    uint64_t *offsets);

/*
 * Bytes of a device's staging buffer for the NCCL collectives of a shard
 * group of S ranks: the all-gather receives S flat shards (S x shard_size,
 * shard s at s x shard_size), the reduce-scatter sends S shards in the
 * reduce dtype (S x reduce_shard_size, the block for shard s at
 * s x reduce_shard_size, rank-major: each rank's own buffer holds its
 * grad rows for every destination shard). The larger of the two; 0
 * when either product would not fit in 64 bits.
 */
uint64_t shd_placement_staging_bytes(uint32_t shard, uint64_t shard_size,
				     uint64_t reduce_shard_size);

#endif /* SHD_PLACEMENT_H */

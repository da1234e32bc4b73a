/* SPDX-License-Identifier: MIT */
#include <stdio.h>
#include <string.h>

#include "placement.h"

uint32_t shd_placement_classify(const int32_t *devices, uint32_t n)
{
	int shared = 0, distinct = 0;
	uint32_t same = 1;

	/* Every op on one GPU asks this: answer the common case in one pass. */
	while (same < n && devices[same] == devices[0])
		same++;
	if (same >= n)
		return SHD_PLACE_SHARED;
	for (uint32_t i = 1; i < n; i++) {
		for (uint32_t j = 0; j < i; j++) {
			if (devices[i] == devices[j])
				shared = 1;
			else
				distinct = 1;
		}
	}
	if (!distinct)
		return SHD_PLACE_SHARED;
	return shared ? SHD_PLACE_MIXED : SHD_PLACE_NCCL;
}

/*
 * The refusal of a MIXED group: the first two members that share a device
 * and a member elsewhere, the fix, then every member's device (the list
 * last, so a long one is what a short buffer cuts).
 */
static void plan_refusal(const char *group, const char *what, const uint32_t *ranks,
			 const int32_t *hello, const int32_t *devices, uint32_t n, char *err,
			 size_t errlen)
{
	uint32_t a = 0, b = 0, c = 0;
	size_t off;

	for (uint32_t i = 1; i < n && a == b; i++) {
		for (uint32_t j = 0; j < i; j++) {
			if (devices[i] == devices[j]) {
				a = j;
				b = i;
				break;
			}
		}
	}
	while (c < n && devices[c] == devices[a])
		c++;
	off = (size_t)snprintf(
		err, errlen,
		"register group '%s': %s mixes shared and separate GPUs: ranks %u and %u share "
		"device %d while rank %u is on device %d; its ranks must each sit on their own "
		"GPU (NCCL collectives) or all on one GPU (device copies): have them name "
		"distinct devices, or one device, in shardd_connect (opts.device); devices:",
		group, what, ranks[a], ranks[b], devices[a], ranks[c], devices[c]);
	for (uint32_t i = 0; i < n && off < errlen; i++)
		off += (size_t)snprintf(
			err + off, errlen - off, "%s rank %u on %d%s", i ? "," : "", ranks[i],
			devices[i], hello[i] == SHARDD_HELLO_DEVICE_HOST ? " (it named none)" : "");
}

/* Classify the members `ranks[0..n)`; 0, or the refusal of a MIXED group in `err`. */
static int plan_members(const char *group, const char *what, const int32_t *hello_devices,
			const uint32_t *ranks, uint32_t n, uint8_t *nccl, char *err, size_t errlen)
{
	int32_t hello[SHARDD_MAX_WORLD] = { 0 }, devices[SHARDD_MAX_WORLD] = { 0 };
	uint32_t kind;

	for (uint32_t i = 0; i < n; i++) {
		hello[i] = hello_devices[ranks[i]];
		devices[i] = shd_placement_device(hello[i]);
	}
	kind = shd_placement_classify(devices, n);
	if (kind == SHD_PLACE_MIXED) {
		plan_refusal(group, what, ranks, hello, devices, n, err, errlen);
		return -SHARDD_E_INVALID;
	}
	*nccl = kind == SHD_PLACE_NCCL;
	return 0;
}

int shd_placement_plan(const char *group, const int32_t *hello_devices, uint32_t replicate,
		       uint32_t shard, struct shd_placement *out, char *err, size_t errlen)
{
	uint32_t ranks[SHARDD_MAX_WORLD];
	char what[96];
	int ret;

	memset(out, 0, sizeof(*out));
	if (replicate == 0 || shard == 0 || replicate > SHARDD_MAX_WORLD ||
	    shard > SHARDD_MAX_WORLD / replicate) {
		snprintf(err, errlen, "register group '%s': mesh %u x %u is outside 1..%d ranks",
			 group, replicate, shard, SHARDD_MAX_WORLD);
		return -SHARDD_E_INVALID;
	}
	out->replicate = replicate;
	out->shard = shard;
	for (uint32_t u = 0; u < replicate; u++) {
		for (uint32_t s = 0; s < shard; s++)
			ranks[s] = u * shard + s;
		snprintf(what, sizeof(what), "the shard group of replica %u (ranks %u-%u)", u,
			 ranks[0], ranks[shard - 1]);
		ret = plan_members(group, what, hello_devices, ranks, shard, &out->shard_nccl[u],
				   err, errlen);
		if (ret)
			return ret;
		out->nccl += out->shard_nccl[u];
	}
	for (uint32_t s = 0; replicate > 1 && s < shard; s++) {
		for (uint32_t u = 0; u < replicate; u++)
			ranks[u] = u * shard + s;
		snprintf(what, sizeof(what),
			 "the replicate group of shard index %u (one rank per replica)", s);
		ret = plan_members(group, what, hello_devices, ranks, replicate,
				   &out->replicate_nccl[s], err, errlen);
		if (ret)
			return ret;
		out->nccl += out->replicate_nccl[s];
	}
	return 0;
}

uint64_t shd_placement_reduce_shard(const struct shd_layout *l, uint32_t reduce_dtype,
				    uint64_t *offsets)
{
	uint64_t bytes = 0;

	for (uint32_t i = 0; i < l->nparams; i++) {
		offsets[i] = bytes;
		bytes += l->params[i].shard_numel * shardd_dtype_size(reduce_dtype);
		bytes = (bytes + SHARDD_ALIGN - 1) & ~(uint64_t)(SHARDD_ALIGN - 1);
	}
	return bytes ? bytes : SHARDD_ALIGN;
}

uint64_t shd_placement_staging_bytes(uint32_t shard, uint64_t shard_size,
				     uint64_t reduce_shard_size)
{
	uint64_t gather, scatter;

	if (shard && (shard_size > UINT64_MAX / shard || reduce_shard_size > UINT64_MAX / shard))
		return 0;
	gather = shard * shard_size;
	scatter = shard * reduce_shard_size;
	return gather > scatter ? gather : scatter;
}

/* SPDX-License-Identifier: MIT */
/*
 * Where a param's shard sits in the full tensor (internal.h): what the
 * registration checks, the GROUP reply is checked against, and a
 * rank-executed group's ops address (exec.c).
 */
#include <errno.h>
#include <string.h>

#include "internal.h"

/*
 * The first dim (< ndim) at which the product of the nonzero dims of `p`
 * stops fitting 64 bits as a byte count of up to 8-byte elements, or -1
 * when it fits. Zero dims are left out: a zero-numel param (FSDP2 accepts
 * them) must not hide dims whose products of a few (outer, inner) wrap.
 */
int shardd_shape_overflow_dim(const struct shardd_param_spec *p)
{
	uint64_t extent = 1;

	for (uint32_t i = 0; i < p->ndim && i < SHARDD_MAX_DIMS; i++)
		if (p->shape[i] && (__builtin_mul_overflow(extent, p->shape[i], &extent) ||
				    extent > UINT64_MAX / 8))
			return (int)i;
	return -1;
}

int shardd_group_geometry(const struct shardd_param_spec *p, uint32_t world, uint32_t shard_rank,
			  struct shardd_shard_geometry *geo)
{
	memset(geo, 0, sizeof(*geo));
	/* Bounded so, no product of some of the dims below overflows. */
	if (shardd_shape_overflow_dim(p) >= 0)
		return -EOVERFLOW;
	geo->numel = 1;
	geo->outer = 1;
	geo->inner = 1;
	geo->dim = 1; /* a 0-d param is a 1-row tensor */
	for (uint32_t i = 0; i < p->ndim; i++)
		geo->numel *= p->shape[i];
	if (p->ndim) {
		geo->dim = p->shape[p->shard_dim];
		for (uint32_t i = 0; i < p->shard_dim; i++)
			geo->outer *= p->shape[i];
		for (uint32_t i = p->shard_dim + 1; i < p->ndim; i++)
			geo->inner *= p->shape[i];
	}
	if (p->shard_dim == 0) {
		geo->rows = geo->dim / world + (geo->dim % world != 0);
	} else {
		if (geo->dim % world)
			return -EINVAL;
		geo->rows = geo->dim / world;
	}
	geo->begin = (uint64_t)shard_rank * geo->rows;
	geo->valid = geo->dim > geo->begin ? geo->dim - geo->begin : 0;
	if (geo->valid > geo->rows)
		geo->valid = geo->rows;
	/* rows <= dim + world and outer * dim * inner did not overflow above. */
	if (__builtin_mul_overflow(geo->outer * geo->rows, geo->inner, &geo->shard_numel))
		return -EOVERFLOW;
	return 0;
}

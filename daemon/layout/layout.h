/* SPDX-License-Identifier: MIT */
/*
 * Layout of a group: where each param lives in the unsharded buffer, the
 * grad buffer and the flat shard (FSDP2 sharding math, docs/DESIGN.md "Ops").
 *
 * Dim-0 sharding (FSDP2's default) pads: padded_d0 = ceil(d0 / S) * S,
 * rows = padded_d0 / S, shard r holds rows [r * rows, (r + 1) * rows), zero
 * past d0. A 0-d param is a 1-row tensor. Shard(i > 0) needs d_i % S == 0:
 * shard r is torch.chunk(param, S, dim=i)[r] made contiguous, and the
 * unsharded tensor is the chunk-cat of the S shards along dim i.
 *
 * A param with a zero-size dim (FSDP2 accepts them) has numel and
 * shard_numel 0: it takes no bytes in any buffer, and every op does nothing
 * for it. Its other dims are bounded all the same (the nonzero dims must
 * multiply to less than the per-buffer limit), so no product of dims wraps.
 */
#ifndef SHD_LAYOUT_H
#define SHD_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "shardd_proto.h"

/* No buffer of a group may reach this many bytes. */
#define SHD_LAYOUT_MAX_BYTES (1ull << 40)

struct shd_layout_param {
	uint32_t dtype;           /* the param's original dtype */
	uint32_t unsharded_dtype; /* policy param_dtype if set, else dtype */
	uint32_t grad_dtype;      /* same rule as unsharded_dtype */
	uint32_t shard_dim;       /* 0 for 0-d params */
	uint64_t numel;           /* elements of the full param (1 for 0-d; 0 if a dim is 0) */
	uint64_t outer;           /* product of dims before shard_dim (1 when shard_dim == 0) */
	uint64_t dim;             /* size of shard_dim (1 for 0-d) */
	uint64_t inner;           /* product of dims after shard_dim (1 if none) */
	uint64_t rows; /* shard_dim rows per shard: ceil(dim/S) for dim 0; dim/S for Shard(i>0) */
	uint64_t shard_numel;      /* outer * rows * inner (padding included) */
	uint64_t unsharded_offset; /* bytes; multiples of SHARDD_ALIGN */
	uint64_t grad_offset;      /* bytes */
	uint64_t shard_offset; /* bytes, same for every rank (shards are padded to equal size) */
};

struct shd_layout {
	uint32_t nparams, world; /* world = shard group size S */
	/* bytes, each rounded up to SHARDD_ALIGN, at least SHARDD_ALIGN */
	uint64_t unsharded_size, grad_size, shard_size;
	struct shd_layout_param *params;
};

/*
 * Validate `nparams` specs for a shard group of `world` ranks and the
 * policy's `param_dtype` (SHARDD_DTYPE_NONE or a dtype), and compute every
 * param's place in every buffer into `out` (free with shd_layout_free).
 * Returns 0, -SHARDD_E_INVALID with `err` naming the param, the field and
 * the value, or -ENOMEM. On error `out` holds no allocation.
 */
int shd_layout_build(const struct shardd_param_spec *specs, uint32_t nparams, uint32_t world,
		     uint32_t param_dtype, struct shd_layout *out, char *err, size_t errlen);

/* Release what shd_layout_build allocated; safe on a zeroed layout. */
void shd_layout_free(struct shd_layout *l);

/*
 * Rows of real data (not padding) in shard `shard_rank`:
 * clamp(dim - r * rows, 0, rows) for dim 0; rows for Shard(i > 0).
 */
uint64_t shd_layout_rows_valid(const struct shd_layout_param *p, uint32_t shard_rank);

#endif /* SHD_LAYOUT_H */

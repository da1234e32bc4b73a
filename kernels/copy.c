/* SPDX-License-Identifier: MIT */
/*
 * Copies: zeroing and the chunk-cat copy-out of a param sharded on a dim
 * other than 0 (FSDP2 Shard(i)), where the unsharded tensor interleaves
 * one run of `inner` elements from each shard per outer index.
 */
#include <string.h>

#include "shardd_kernels.h"
#include "shardd_proto.h"

void shardd_k_zero(void *dst, size_t bytes)
{
	memset(dst, 0, bytes);
}

void shardd_k_chunk_cat(void *dst, uint32_t dst_dtype, const void *const *src, uint32_t src_dtype,
			uint32_t nchunks, size_t outer, size_t inner)
{
	size_t dsz = shardd_dtype_size(dst_dtype), ssz = shardd_dtype_size(src_dtype);
	char *d = dst;

	/* Walk dst in order so its writes stream; each run is one cast call. */
	for (size_t o = 0; o < outer; o++) {
		for (uint32_t r = 0; r < nchunks; r++) {
			const char *s = (const char *)src[r] + o * inner * ssz;

			shardd_k_cast(d, dst_dtype, s, src_dtype, inner);
			d += inner * dsz;
		}
	}
}

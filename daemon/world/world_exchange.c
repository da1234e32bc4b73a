/* SPDX-License-Identifier: MIT */
/*
 * One exchange among the nodes from and into the caller's own memory
 * (world.h: shd_world_exchange), built on shd_world_xchg and a buffer of
 * its own for what MPI sends and receives.
 */
#include <stdio.h>
#include <string.h>

#include "shardd_proto.h"
#include "world.h"

int shd_world_exchange(uint64_t key, uint64_t seq, uint64_t check, const void *const *send,
		       void *recv, size_t bytes, uint64_t deadline_ns, uint8_t *missing, char *err,
		       size_t errlen)
{
	uint32_t nodes = shd_world_nodes(), me = shd_world_node(), other = me ? 0 : 1;
	size_t nb = (size_t)nodes * bytes, stride = 0, sent;
	struct shd_world_buf *b;
	int ret;

	/*
	 * MPI sends from and receives into b, which outlives this call while
	 * MPI holds it; this node's own part never enters it. One copy of
	 * what goes out when every node gets the same (an unshard's chunk).
	 */
	for (uint32_t k = 0; k < nodes; k++)
		if (k != me && send[k] != send[other])
			stride = bytes;
	sent = stride ? nb : bytes;
	b = shd_world_buf_new(sent + nb);
	if (!b) {
		memset(missing, 0, nodes);
		snprintf(err, errlen, "out of memory for inter-node buffers of %zu bytes",
			 sent + nb);
		return -SHARDD_E_NOMEM;
	}
	for (uint32_t k = 0; k < nodes; k++)
		if (k != me && (stride || k == other))
			memcpy(shd_world_buf_data(b) + k * stride, send[k], bytes);
	ret = shd_world_xchg(key, seq, check, b, 0, stride, sent, bytes, deadline_ns, missing, err,
			     errlen);
	if (!ret) {
		for (uint32_t k = 0; k < nodes; k++)
			if (k != me)
				memcpy((uint8_t *)recv + k * bytes,
				       shd_world_buf_data(b) + sent + k * bytes, bytes);
		memmove((uint8_t *)recv + me * bytes, send[me], bytes);
	}
	shd_world_buf_put(b);
	return ret;
}

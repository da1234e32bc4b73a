/* SPDX-License-Identifier: MIT */
/*
 * The parts of a collective between nodes (engine_int.h), for a job whose
 * mesh spans the daemon world (world.h, docs/MULTINODE.md).
 *
 * HSDP across nodes (replicate = nodes, shard = the ranks of a node): each
 * node's ranks are one replica, so unshard and the reduce-scatter stay on
 * the node (task.c, as on one node, with the divide factors of the whole
 * mesh). A reduce with SHARDD_REDUCE_ALL_REDUCE then all-reduces each
 * shard over the nodes: every node sends its ranks' partials (the
 * reduce-scatter outputs, added to the partials of earlier reduces, in the
 * reduce dtype) to every other node, and each node sums the nodes'
 * partials in node order with the single-node all-reduce's kernel
 * (backend reduce, SHD_REDUCE_SRC_SHARD): the same inputs, the same order
 * and the same one rounding as one daemon holding every replica, so every
 * node gets the same bits, and the bits of a single-node run of the mesh.
 *
 * The partials are already in the reduce dtype, so sending them as fp32
 * (--internode-dtype fp32, the default) or in the reduce dtype
 * (--internode-dtype reduce: half the bytes for bf16/fp16) moves the same
 * numbers: no partial sum crosses the network, only partials.
 *
 * Runs on a pool thread (eng_span_task keeps these tasks off the loop),
 * which waits for the world's communication thread; host backend only
 * (hello.c refuses a spanning job on another).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "engine_int.h"
#include "shardd_kernels.h"
#include "world.h"

int shd_engine_job_span(struct shd_engine_job *j, uint32_t replicate, uint32_t shard,
			uint32_t nodes, uint32_t node)
{
	if (nodes < 2 || node >= nodes || (uint64_t)replicate * shard != (uint64_t)j->world * nodes)
		return -SHARDD_E_INVALID;
	j->span_nodes = nodes;
	j->span_node = node;
	j->span_replicate = replicate;
	j->span_shard = shard;
	return 0;
}

int eng_span_task(const struct eng_task *t)
{
	return t->eg->j->span_nodes > 1 && t->kind == TASK_REDUCE;
}

/* The stream of exchanges of one group of one job: FNV-1a of both names, equal on every node. */
static uint64_t span_key(const struct eng_group *eg)
{
	uint64_t h = 0xcbf29ce484222325ull;
	const char *parts[2] = { eg->j->name, eg->g->name };

	for (int p = 0; p < 2; p++) {
		for (const char *c = parts[p]; *c; c++)
			h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
		h = (h ^ 0xff) * 0x100000001b3ull;
	}
	return h;
}

/* "node 1 (ranks 2,3), node 2 (ranks 4,5)" of the nodes marked in `missing`. */
static void span_who(const struct shd_engine_job *j, const uint8_t *missing, char *buf, size_t len)
{
	uint32_t L = j->world;
	size_t off = 0;

	buf[0] = '\0';
	for (uint32_t k = 0; k < j->span_nodes && off < len; k++) {
		if (!missing[k])
			continue;
		off += (size_t)snprintf(buf + off, len - off, "%snode %u (ranks %u..%u)", off ? ", " : "", k,
					k * L, k * L + L - 1);
	}
}

int eng_span_allreduce(struct eng_task *t, const struct shardd_reduce_math *ar)
{
	struct eng_group *eg = t->eg;
	struct shd_engine_job *j = eg->j;
	struct shd_group *g = eg->g;
	struct shd_backend_ctx *b = j->e->backend;
	uint32_t N = j->span_nodes, L = g->shard, rdt = g->reduce_dtype;
	uint32_t wire = shd_world_internode_dtype() == SHD_INTERNODE_FP32 ? SHARDD_DTYPE_FP32 : rdt;
	size_t P = g->reduce_shard_size, E = P / shardd_dtype_size(rdt), wsz = E * shardd_dtype_size(wire);
	size_t bytes = (size_t)L * wsz;
	uint8_t *send = NULL, *recv = NULL, *parts = NULL, *scratch = NULL, missing[SHARDD_MAX_WORLD];
	const void **sends = NULL;
	struct shd_buf *bufs = NULL, out_scratch;
	char why[384], who[256];
	int ret = 0;

	send = malloc(bytes + 1);
	recv = malloc((size_t)N * bytes + 1);
	parts = wire == rdt ? recv : malloc((size_t)N * L * P + 1);
	scratch = calloc(1, g->layout.shard_size + 1);
	sends = malloc(N * sizeof(*sends));
	bufs = calloc((size_t)N * L, sizeof(*bufs));
	if (!send || !recv || !parts || !scratch || !sends || !bufs) {
		eng_fmt(t->msg, sizeof(t->msg),
			"shardd: reduce(group '%s', step %llu): out of memory for the all-reduce among %u nodes (%zu bytes per node)",
			g->name, (unsigned long long)t->ops[0].sqe.step, N, bytes);
		ret = -SHARDD_E_NOMEM;
		goto out;
	}
	/* This node's partials, one after another, in the wire dtype (a cast from the reduce dtype is exact). */
	for (uint32_t s = 0; s < L; s++) {
		const void *src = g->partials[s].priv;

		if (wire == rdt)
			memcpy(send + s * wsz, src, P);
		else
			shardd_k_cast(send + s * wsz, wire, src, rdt, E);
	}
	for (uint32_t k = 0; k < N; k++)
		sends[k] = send;
	ret = shd_world_exchange(span_key(eg), eg->span_seq++, sends, recv, bytes,
				 shd_now_ns() + j->e->timeout_ns, missing, why, sizeof(why));
	if (ret) {
		span_who(j, missing, who, sizeof(who));
		eng_fmt(t->msg, sizeof(t->msg),
			"shardd: reduce(group '%s', step %llu): the all-reduce among the %u nodes failed on node %u: %s%s%s%s",
			g->name, (unsigned long long)t->ops[0].sqe.step, N, j->span_node, why,
			who[0] ? "; missing " : "", who,
			ret == -SHARDD_E_TIMEOUT || ret == -SHARDD_E_PEER_DIED
				? "; the sharded grads of this step are not reduced: check that node's daemon and ranks" : "");
		goto out;
	}
	if (parts != recv)
		for (size_t i = 0; i < (size_t)N * L; i++)
			shardd_k_cast(parts + i * P, rdt, recv + i * wsz, wire, E);
	for (size_t i = 0; i < (size_t)N * L; i++)
		bufs[i] = (struct shd_buf){ .bytes = P, .fd = -1, .priv = parts + i * P };
	out_scratch = (struct shd_buf){ .bytes = g->layout.shard_size, .fd = -1, .priv = scratch };

	/*
	 * Shard s over the nodes: the backend writes every member's output; only
	 * this node's lands in a sharded grad, the others' in scratch.
	 */
	for (uint32_t s = 0; s < L && !ret; s++) {
		struct shd_shard_view views[SHARDD_MAX_WORLD], outs[SHARDD_MAX_WORLD];
		uint8_t accumulate[SHARDD_MAX_WORLD] = { 0 };
		struct shd_reduce_args a = {
			.job = j->bj, .layout = &g->layout, .src = SHD_REDUCE_SRC_SHARD, .n = N,
			.views = views, .shard_rank = s, .in_dtype = rdt, .outs = outs,
			.accumulate = accumulate, .reduce_offsets = g->reduce_offsets,
			.reduce_shard_size = g->reduce_shard_size, .math = *ar, .err = t->why,
			.errlen = sizeof(t->why),
		};

		for (uint32_t k = 0; k < N; k++) {
			views[k] = (struct shd_shard_view){ &bufs[(size_t)k * L + s], g->reduce_offsets, rdt };
			outs[k] = (struct shd_shard_view){ &out_scratch, g->shard_offsets, SHARDD_DTYPE_NONE };
		}
		outs[j->span_node] = (struct shd_shard_view){ &g->sharded_grads[s], g->shard_offsets,
							       SHARDD_DTYPE_NONE };
		accumulate[j->span_node] = g->grad_present[s];
		ret = b->ops->reduce(b, &a);
		if (!ret)
			g->grad_present[s] = 1;
	}
out:
	free(send);
	if (parts != recv)
		free(parts);
	free(recv);
	free(scratch);
	free(sends);
	free(bufs);
	return ret;
}

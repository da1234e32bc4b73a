/* SPDX-License-Identifier: MIT */
/*
 * Communicators across nodes: rank arithmetic and the bootstrap
 * (world_boot.h). Every decision here is taken from what every node sent,
 * so all nodes take the same one: keep the communicators, or drop them
 * and make new ones from node 0's ids, together.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "shardd_proto.h"
#include "world_boot.h"

uint32_t shd_world_boot_comms(const struct shd_world_boot *s)
{
	return s->layout == SHD_WORLD_HSDP ? s->local : 1;
}

int shd_world_boot_member(const struct shd_world_boot *s, uint32_t k, uint32_t *comm,
			  uint32_t *rank, uint32_t *nranks)
{
	if (s->nodes < 2 || s->node >= s->nodes || !s->local || k >= s->local ||
	    (uint64_t)s->nodes * s->local > SHARDD_MAX_WORLD)
		return -SHARDD_E_INVALID;
	if (s->layout == SHD_WORLD_HSDP) {
		/* Shard k's replicas: rank k of every node, in node order. */
		*comm = k;
		*rank = s->node;
		*nranks = s->nodes;
		return 0;
	}
	if (s->layout == SHD_WORLD_FSDP) {
		*comm = 0;
		*rank = s->node * s->local + k;
		*nranks = s->nodes * s->local;
		return 0;
	}
	return -SHARDD_E_INVALID;
}

void shd_world_boot_who(const struct shd_world_boot *s, const uint8_t *marked, char *buf,
			size_t len)
{
	size_t off = 0;

	if (len)
		buf[0] = '\0';
	for (uint32_t k = 0; k < s->nodes && off < len; k++) {
		if (!marked[k])
			continue;
		off += (size_t)snprintf(buf + off, len - off, "%snode %u (ranks %u..%u)",
					off ? ", " : "", k, k * s->local,
					k * s->local + s->local - 1);
	}
}

/* What a node sends in the first and last exchanges. */
struct boot_word {
	/* the agreement: its generation; the outcome: 1 when its set-up succeeded */
	uint32_t value;
	uint32_t pad;
};

/* Node 0's ids, and whether it could make them. */
struct boot_ids {
	uint32_t ok;
	uint32_t pad;
	uint8_t ids[]; /* comms * SHD_WORLD_ID_BYTES */
};

/* err = "<what>: <why>; missing <who>" of a failed exchange. */
static void boot_exchange_failed(const struct shd_world_boot *s, const char *what,
				 const uint8_t *missing, const char *why, char *err, size_t errlen)
{
	char who[256];

	shd_world_boot_who(s, missing, who, sizeof(who));
	snprintf(err, errlen, "%s among the %u nodes failed on node %u: %s%s%s", what, s->nodes,
		 s->node, why, who[0] ? "; missing " : "", who);
}

int shd_world_bootstrap(const struct shd_world_boot *s, const struct shd_world_boot_ops *ops,
			uint32_t *gen, char *err, size_t errlen)
{
	uint32_t N = s->nodes, comms = shd_world_boot_comms(s), maxgen = 0, same = 1;
	size_t idbytes = sizeof(struct boot_ids) + (size_t)comms * SHD_WORLD_ID_BYTES;
	struct boot_word mine = { *gen, 0 }, *words = calloc(N, sizeof(*words));
	struct boot_ids *ids = calloc(1, idbytes), *all = calloc(N, idbytes);
	uint8_t *missing = calloc(N, 1), *failed = calloc(N, 1);
	char why[320] = "", here[320] = "", who[256];
	int ret;

	if (!words || !ids || !all || !missing || !failed) {
		snprintf(err, errlen,
			 "out of memory for the bootstrap of NCCL communicators across %u nodes",
			 N);
		ret = -SHARDD_E_NOMEM;
		goto out_drop;
	}
	/* 1. Does every node hold the same live communicators? */
	ret = ops->exchange(ops->ctx, s->seq, &mine, words, sizeof(mine),
			    shd_now_ns() + s->timeout_ns, missing, why, sizeof(why));
	if (ret) {
		boot_exchange_failed(s, "agreeing on the NCCL communicators", missing, why, err,
				     errlen);
		goto out_drop;
	}
	for (uint32_t k = 0; k < N; k++) {
		same &= words[k].value == words[0].value;
		if (words[k].value > maxgen)
			maxgen = words[k].value;
	}
	if (same && words[0].value) {
		ret = 0;
		goto out;
	}
	/* 2. Make new ones everywhere, from node 0's ids. */
	ops->drop(ops->ctx);
	*gen = 0;
	if (s->node == 0) {
		ret = ops->make_ids(ops->ctx, ids->ids, comms, here, sizeof(here));
		ids->ok = ret == 0;
	}
	ret = ops->exchange(ops->ctx, s->seq + 1, ids, all, idbytes, shd_now_ns() + s->timeout_ns,
			    missing, why, sizeof(why));
	if (ret) {
		boot_exchange_failed(s, "handing out node 0's NCCL unique ids", missing, why, err,
				     errlen);
		goto out_drop;
	}
	if (!all->ok) {
		snprintf(
			err, errlen,
			"node 0 could not make the NCCL unique ids of the communicators across %u nodes%s%s",
			N, here[0] ? ": " : " (see its log)", here);
		ret = -SHARDD_E_BACKEND;
		goto out_drop;
	}
	ret = ops->init(ops->ctx, all->ids, shd_now_ns() + s->timeout_ns, here, sizeof(here));
	/* 3. Did every node's set-up succeed? One that failed leaves the others' useless. */
	mine = (struct boot_word){ ret == 0, 0 };
	ret = ops->exchange(ops->ctx, s->seq + 2, &mine, words, sizeof(mine),
			    shd_now_ns() + s->timeout_ns, missing, why, sizeof(why));
	if (ret) {
		boot_exchange_failed(s, "reporting the NCCL set-up", missing, why, err, errlen);
		goto out_drop;
	}
	for (uint32_t k = 0; k < N; k++)
		failed[k] = !words[k].value;
	shd_world_boot_who(s, failed, who, sizeof(who));
	if (who[0]) {
		snprintf(
			err, errlen,
			"the NCCL communicators across the %u nodes were not made: %s did not join "
			"within the collective timeout or failed to set up%s%s",
			N, who, here[0] ? "; on this node: " : "", here);
		ret = -SHARDD_E_BACKEND;
		goto out_drop;
	}
	*gen = maxgen + 1;
	ret = 0;
	goto out;
out_drop:
	ops->drop(ops->ctx);
	*gen = 0;
out:
	free(words);
	free(ids);
	free(all);
	free(missing);
	free(failed);
	return ret;
}

void shd_world_boot_probe(const struct shd_world_boot *s, const struct shd_world_boot_ops *ops,
			  char *who, size_t len)
{
	struct boot_word mine = { 1, 0 }, *words = calloc(s->nodes, sizeof(*words));
	uint8_t *missing = calloc(s->nodes, 1);
	char why[320];

	if (len)
		who[0] = '\0';
	if (words && missing &&
	    ops->exchange(ops->ctx, s->seq + 3, &mine, words, sizeof(mine),
			  shd_now_ns() + s->timeout_ns, missing, why, sizeof(why)))
		shd_world_boot_who(s, missing, who, len);
	free(words);
	free(missing);
}

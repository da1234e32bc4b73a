/* SPDX-License-Identifier: MIT */
/*
 * What internode_host.c (the host's exchanges over the world, the group
 * buffers they use, their errors) gives internode.c (a spanning job's
 * tasks, their threads, the hand-off to a backend that crosses nodes
 * itself). Engine-private, as engine_int.h.
 */
#ifndef SHD_INTERNODE_INT_H
#define SHD_INTERNODE_INT_H

#include <stdint.h>

#include "engine_int.h"
#include "world.h"

/* The stream of exchanges of one group of one job: equal on every node. */
uint64_t eng_span_key(const struct eng_group *eg);
/* A digest of what must be equal on every node for task t: the group's params, dtypes and the op. */
uint64_t eng_span_check(const struct eng_task *t);
/*
 * The error of task t's failed exchange (`what`: "all-reduce", "exchange")
 * into t->msg: this node's ranks that get it, the nodes missing, and why;
 * `lost` is appended when a node died or stalled.
 */
void eng_span_fail(struct eng_task *t, const char *what, int ret, const uint8_t *missing, const char *why,
		   const char *lost);
/* The error of an op that found no inter-node buffer into t->msg; -SHARDD_E_NOMEM. */
int eng_span_nobuf(struct eng_task *t);
/*
 * Loop thread, before a task of eg starts: when MPI still holds the group's
 * buffer, a fresh one within --max-memory, or eg->span_nobuf set.
 */
void eng_span_buf_ready(struct eng_group *eg);

/* The host's exchanges over the world; 0 or -SHARDD_E_*, t->msg set. */
int eng_span_world_allreduce(struct eng_task *t, const struct shardd_reduce_math *ar);
int eng_span_world_unshard(struct eng_task *t);
int eng_span_world_reduce_scatter(struct eng_task *t, const struct shardd_reduce_math *rs);

#endif /* SHD_INTERNODE_INT_H */

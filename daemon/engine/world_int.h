/* SPDX-License-Identifier: MIT */
/*
 * What world_host.c (the host's exchanges over the world, the group
 * buffers they use, their errors) gives world_collective.c (a spanning job's
 * tasks, their threads, the hand-off to a backend that crosses nodes
 * itself). Engine-private, as engine_int.h.
 */
#ifndef SHD_WORLD_INT_H
#define SHD_WORLD_INT_H

#include <stdint.h>

#include "engine_int.h"
#include "world.h"

/* The stream of exchanges of one group of one job: equal on every node. */
uint64_t eng_world_key(const struct eng_group *eg);
/* A digest of what must be equal on every node for task t: the group's params, dtypes and the op. */
uint64_t eng_world_check(const struct eng_task *t);
/*
 * The error of task t's failed exchange (`what`: "all-reduce", "exchange")
 * into t->msg: this node's ranks that get it, the nodes missing, and why;
 * `lost` is appended when a node died or stalled.
 */
void eng_world_fail(struct eng_task *t, const char *what, int ret, const uint8_t *missing,
		    const char *why, const char *lost);
/* The error of an op that found no inter-node buffer into t->msg; -SHARDD_E_NOMEM. */
int eng_world_nobuf(struct eng_task *t);
/*
 * Loop thread, before a task of eg starts: when MPI still holds the group's
 * buffer, a fresh one within --max-memory, or eg->span_nobuf set.
 */
void eng_world_buf_ready(struct eng_group *eg);

/* The host's exchanges over the world; 0 or -SHARDD_E_*, t->msg set. */
int eng_world_mpi_allreduce(struct eng_task *t, const struct shardd_reduce_math *ar);
int eng_world_mpi_unshard(struct eng_task *t);
int eng_world_mpi_reduce_scatter(struct eng_task *t, const struct shardd_reduce_math *rs);

#endif /* SHD_WORLD_INT_H */

/* SPDX-License-Identifier: MIT */
/*
 * The parts of a collective between nodes (engine_int.h), for a job whose
 * mesh spans the daemon world (world.h, docs/MULTINODE.md).
 *
 * HSDP across nodes (replicate = nodes, shard = the ranks of a node): each
 * node's ranks are one replica, so unshard and the reduce-scatter stay on
 * the node (task.c, as on one node, with the divide factors of the whole
 * mesh); a reduce with SHARDD_REDUCE_ALL_REDUCE then all-reduces each
 * shard over the nodes (eng_world_allreduce). FSDP across nodes (one shard
 * group over every rank): unshard and reduce exchange node chunks
 * (eng_world_unshard, eng_world_reduce_scatter). On the host backend the
 * exchanges, their arithmetic and the group buffers they use are
 * world_host.c's.
 *
 * A task that exchanges runs on a thread of its own (eng_world_spawn), which
 * waits for the world's communication thread: never on the loop, and never
 * on a pool thread, so that tasks waiting for other nodes cannot take every
 * worker from the node's other groups; its kernels still split across the
 * pool (shd_pool_for runs on the calling thread too).
 *
 * A backend that crosses nodes itself (ops->span_unshard, span_reduce: the
 * cuda backend, with NCCL communicators over the nodes) gets each op's
 * node-local members and the group's stream of exchanges instead
 * (span_backend_*), and moves the bytes between nodes its own way.
 */
#include <pthread.h>
#include <string.h>

#include "engine_int.h"
#include "world_int.h"
#include "world_boot.h"

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

int eng_world_task(const struct eng_task *t)
{
	return t->eg->j->span_nodes > 1 &&
	       (t->kind == TASK_REDUCE || (t->kind == TASK_UNSHARD && eng_world_fsdp(t->eg->j)));
}

static void *span_thread(void *arg)
{
	struct eng_task *t = arg;
	struct shd_engine *e = t->eg->j->e;

	/* task_run: computes t and hands it to the loop, which may free it at once. */
	t->pt.fn(&t->pt);
	pthread_mutex_lock(&e->lock);
	e->span_threads--;
	pthread_cond_broadcast(&e->finished);
	pthread_mutex_unlock(&e->lock);
	return NULL;
}

int eng_world_spawn(struct eng_task *t)
{
	struct shd_engine *e = t->eg->j->e;
	pthread_attr_t attr;
	pthread_t th;
	int ret;

	eng_world_buf_ready(t->eg);
	ret = pthread_attr_init(&attr);
	if (ret)
		return -ret;
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_mutex_lock(&e->lock);
	e->span_threads++;
	pthread_mutex_unlock(&e->lock);
	ret = pthread_create(&th, &attr, span_thread, t);
	pthread_attr_destroy(&attr);
	if (ret) {
		pthread_mutex_lock(&e->lock);
		e->span_threads--;
		pthread_mutex_unlock(&e->lock);
		return -ret;
	}
	return 0;
}

void eng_world_threads_wait(struct shd_engine *e)
{
	pthread_mutex_lock(&e->lock);
	while (e->span_threads)
		pthread_cond_wait(&e->finished, &e->lock);
	pthread_mutex_unlock(&e->lock);
}

/*
 * The op of task t for a backend that crosses nodes itself: the layout,
 * this node's ranks and the SHD_WORLD_SEQS exchange numbers of the group's
 * stream it owns, taken whatever happens so that the nodes stay paired.
 */
static struct shd_world_boot span_of(struct eng_task *t)
{
	struct eng_group *eg = t->eg;
	const struct shd_engine_job *j = eg->j;
	struct shd_world_boot s = {
		.layout = eng_world_fsdp(j) ? SHD_WORLD_FSDP : SHD_WORLD_HSDP,
		.nodes = j->span_nodes,
		.node = j->span_node,
		.local = j->world,
		.key = eng_world_key(eg),
		.seq = eg->span_seq,
		.check = eng_world_check(t),
		.timeout_ns = j->e->timeout_ns,
	};

	eg->span_seq += SHD_WORLD_SEQS;
	return s;
}

/* HSDP's all-reduce among the nodes by the backend: member s's partial of shard s into its sharded grad. */
static int span_backend_allreduce(struct eng_task *t, const struct shardd_reduce_math *ar)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shd_shard_view views[SHARDD_MAX_WORLD], outs[SHARDD_MAX_WORLD];
	uint8_t accumulate[SHARDD_MAX_WORLD];
	struct shd_world_boot span = span_of(t);
	struct shd_reduce_args a = {
		.job = t->eg->j->bj,
		.layout = &g->layout,
		.src = SHD_REDUCE_SRC_SHARD,
		.n = g->shard,
		.views = views,
		.in_dtype = g->reduce_dtype,
		.outs = outs,
		.accumulate = accumulate,
		.reduce_offsets = g->reduce_offsets,
		.reduce_shard_size = g->reduce_shard_size,
		.math = *ar,
		.err = t->why,
		.errlen = sizeof(t->why),
	};
	int ret;

	for (uint32_t s = 0; s < g->shard; s++) {
		views[s] = (struct shd_shard_view){ &g->partials[s], g->reduce_offsets,
						    g->reduce_dtype };
		outs[s] = (struct shd_shard_view){ &g->sharded_grads[s], g->shard_offsets,
						   SHARDD_DTYPE_NONE };
		accumulate[s] = g->grad_present[s];
	}
	ret = b->ops->span_reduce(b, &span, &a);
	if (!ret)
		memset(g->grad_present, 1, g->shard);
	return ret;
}

/* FSDP's unshard across nodes by the backend: every rank's shard into this node's unsharded buffers. */
static int span_backend_unshard(struct eng_task *t)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shd_buf *shards[SHARDD_MAX_WORLD], *unsharded[SHARDD_MAX_WORLD];
	struct shd_world_boot span = span_of(t);
	struct shd_unshard_args a = {
		.job = t->eg->j->bj,
		.layout = &g->layout,
		.nshards = g->shard,
		.shards = shards,
		.unsharded = unsharded,
		.err = t->why,
		.errlen = sizeof(t->why),
	};

	for (uint32_t s = 0; s < g->shard; s++) {
		shards[s] = &g->shards[s];
		unsharded[s] = shd_group_unsharded(g, s);
	}
	return b->ops->span_unshard(b, &span, &a);
}

/* FSDP's reduce-scatter across nodes by the backend: one collective over every rank. */
static int span_backend_reduce_scatter(struct eng_task *t, const struct shardd_reduce_math *rs)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shd_buf *grads[SHARDD_MAX_WORLD];
	struct shd_shard_view outs[SHARDD_MAX_WORLD];
	struct shd_world_boot span = span_of(t);
	struct shd_reduce_args a = {
		.job = t->eg->j->bj,
		.layout = &g->layout,
		.src = SHD_REDUCE_SRC_GRAD,
		.n = g->shard,
		.grads = grads,
		.outs = outs,
		.accumulate = g->grad_present,
		.reduce_offsets = g->reduce_offsets,
		.reduce_shard_size = g->reduce_shard_size,
		.math = *rs,
		.err = t->why,
		.errlen = sizeof(t->why),
	};

	for (uint32_t s = 0; s < g->shard; s++) {
		grads[s] = &g->grads[s];
		outs[s] = (struct shd_shard_view){ &g->sharded_grads[s], g->shard_offsets,
						   SHARDD_DTYPE_NONE };
	}
	return b->ops->span_reduce(b, &span, &a);
}

int eng_world_allreduce(struct eng_task *t, const struct shardd_reduce_math *ar)
{
	if (t->eg->j->e->backend->ops->span_reduce)
		return span_backend_allreduce(t, ar);
	return eng_world_mpi_allreduce(t, ar);
}

int eng_world_unshard(struct eng_task *t)
{
	if (t->eg->j->e->backend->ops->span_unshard)
		return span_backend_unshard(t);
	return eng_world_mpi_unshard(t);
}

int eng_world_reduce_scatter(struct eng_task *t, const struct shardd_reduce_math *rs)
{
	if (t->eg->j->e->backend->ops->span_reduce)
		return span_backend_reduce_scatter(t, rs);
	return eng_world_mpi_reduce_scatter(t, rs);
}

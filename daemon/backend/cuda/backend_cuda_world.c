/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend across nodes (backend.h span_unshard / span_reduce,
 * docs/CUDA.md "Across nodes"): the collectives of a job whose mesh spans
 * the daemon world, through NCCL communicators over every node.
 *
 *   HSDP (replicate = nodes): the node-local reduce-scatter runs as on one
 *   node (backend_cuda.c); the all-reduce of shard k among the nodes is an
 *   in-place ncclAllReduce of member k's partial on communicator k (the
 *   ranks with local index k on every node), then the post kernel into
 *   its sharded grad.
 *   FSDP (one shard group over every rank): one communicator over all
 *   N * L ranks (NCCL rank = global rank); unshard is ncclAllGather of the
 *   flat shards into a staging buffer, then the copy-out; reduce is the
 *   copy-in of every destination shard, ncclReduceScatter in place, then
 *   the post kernel.
 *
 * Bootstrap (world_boot.c): node 0 makes the ncclUniqueIds, which reach
 * every node through the world's exchange (world.c: no MPI call here);
 * each daemon makes its members inside one ncclGroupStart/End,
 * non-blocking, polled against the collective timeout; the nodes then
 * tell each other whether their set-up succeeded, so that all of them
 * keep the communicators or none does. Every op first checks (one small
 * exchange) that every node still holds the same communicators.
 *
 * Streams: each group has its own stream per member (struct cuda_span),
 * not the device's NCCL stream: two nodes may start two groups' ops in
 * different orders (a group's ranks arrive when they do), and collectives
 * of two groups queued on one stream in opposite orders on two nodes
 * would wait for each other forever. The device's stream hands over to
 * it and back through events, as backend_cuda_nccl_ops.c does, and the op
 * waits here (on the thread the engine gives inter-node tasks, never the
 * loop nor the pool) until its collective finished, polling the
 * communicators against the collective timeout. A collective that fails
 * or outlives it aborts the group's communicators, and the nodes that do
 * not answer a last exchange are named.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend_cuda_int.h"
#include "clock.h"
#include "log.h"
#include "placement.h"
#include "world_boot.h"
#include "world.h"

/* Between two looks at a collective's event, and between two asks of its communicators for errors. */
#define WORLD_COMM_POLL_NS  20000
#define WORLD_COMM_CHECK_NS 10000000ull

/* One of this node's ranks in a group's communicators. */
struct cuda_span_member {
	int32_t device;
	int ready;              /* stream and events made */
	cudaStream_t stream;    /* this group's collectives on the device */
	cudaEvent_t staged;     /* on the device's stream: the op's inputs are ready */
	cudaEvent_t collected;  /* on `stream`: the collective finished */
	struct shd_buf staging; /* FSDP: all-gather / reduce-scatter blocks */
};

/* A group's members across nodes: made at its first op, freed with its job. */
struct cuda_span {
	struct cuda_span *next;
	const struct shd_backend_job *job;
	uint64_t key;    /* the group's stream of exchanges (shd_world_boot.key) */
	uint32_t layout; /* enum shd_world_boot_layout */
	uint32_t n;      /* L members */
	uint32_t gen;    /* generation of its communicators (world_boot.h); 0: none */
	struct cuda_span_member m[];
};

/* One op across nodes. */
struct span_op {
	struct cuda_backend *cb;
	const struct shd_world_boot *s;
	struct shd_backend_job *job;
	struct cuda_span *sp;
	uint32_t coll;  /* enum shd_nccl_coll */
	const char *op; /* "unshard" or "reduce", for messages */
	const struct shd_unshard_args *u;
	const struct shd_reduce_args *r;
	uint32_t n;
	int32_t devices[SHARDD_MAX_WORLD];
	struct cuda_device *d[SHARDD_MAX_WORLD];
	/* the group's communicators, found at staging */
	struct shd_nccl_clique *cliques[SHARDD_MAX_WORLD];
	char *err;
	size_t errlen;
};

static const char *coll_what(uint32_t coll)
{
	return coll == SHD_NCCL_ALL_GATHER       ? "all-gather"
	       : coll == SHD_NCCL_REDUCE_SCATTER ? "reduce-scatter"
						 : "all-reduce";
}

/* ------------------------------------------------------------------ */
/* Records (under nccl_lock)                                           */
/* ------------------------------------------------------------------ */

static void member_free(struct cuda_backend *cb, struct cuda_span_member *m)
{
	cuda_free(&cb->base, &m->staging);
	if (!m->ready || cudaSetDevice(m->device) != cudaSuccess)
		return;
	/* Work still queued on the stream completes; its resources go after it. */
	cudaStreamDestroy(m->stream);
	cudaEventDestroy(m->staged);
	cudaEventDestroy(m->collected);
	m->ready = 0;
}

static void span_free(struct cuda_backend *cb, struct cuda_span *sp)
{
	for (uint32_t k = 0; k < sp->n; k++)
		member_free(cb, &sp->m[k]);
	free(sp);
}

/* Make member m's stream and events on its device (current). */
static int member_setup(struct cuda_span_member *m)
{
	cudaError_t e;

	if (m->ready)
		return 0;
	e = cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking);
	if (e != cudaSuccess)
		return cuda_rt_fail("make a stream for collectives across nodes", e);
	e = cudaEventCreateWithFlags(&m->staged, cudaEventDisableTiming);
	if (e == cudaSuccess) {
		e = cudaEventCreateWithFlags(&m->collected, cudaEventDisableTiming);
		if (e != cudaSuccess)
			cudaEventDestroy(m->staged);
	}
	if (e != cudaSuccess) {
		cudaStreamDestroy(m->stream);
		return cuda_rt_fail("make the events of collectives across nodes", e);
	}
	m->ready = 1;
	return 0;
}

/* Drop every communicator of `sp` this node holds. */
static void span_drop_comms(struct cuda_backend *cb, struct cuda_span *sp,
			    const struct shd_world_boot *s)
{
	for (uint32_t c = 0; c < shd_world_boot_comms(s); c++) {
		struct shd_nccl_clique *q = shd_nccl_span_find(cb->nccl, sp->job, sp->key, c);

		if (q)
			shd_nccl_drop(cb->nccl, q);
	}
	sp->gen = 0;
}

/*
 * The record of the op's group, made (or remade, when its ranks now sit on
 * other devices) here; its generation is 0 unless every communicator is
 * still held (one may have been aborted by a device's error).
 */
static int span_get(struct span_op *o)
{
	struct cuda_backend *cb = o->cb;
	struct cuda_span **pp = &cb->spans, *sp;

	for (; (sp = *pp); pp = &sp->next) {
		if (sp->job != o->job || sp->key != o->s->key)
			continue;
		if (sp->layout == o->s->layout && sp->n == o->n) {
			uint32_t k = 0;

			while (k < o->n && sp->m[k].device == o->devices[k])
				k++;
			if (k == o->n)
				break;
		}
		/* Its ranks moved: new streams on their devices, and new communicators on every node. */
		span_drop_comms(cb, sp, o->s);
		*pp = sp->next;
		span_free(cb, sp);
		sp = NULL;
		break;
	}
	if (!sp) {
		sp = calloc(1, sizeof(*sp) + o->n * sizeof(sp->m[0]));
		if (!sp)
			return cuda_op_fail(
				-SHARDD_E_NOMEM, o->err, o->errlen, o->op,
				"out of memory for the collectives across nodes of job '%s'",
				o->job->name);
		sp->job = o->job;
		sp->key = o->s->key;
		sp->layout = o->s->layout;
		sp->n = o->n;
		for (uint32_t k = 0; k < o->n; k++) {
			sp->m[k].device = o->devices[k];
			sp->m[k].staging.fd = -1;
		}
		sp->next = cb->spans;
		cb->spans = sp;
	}
	for (uint32_t c = 0; c < shd_world_boot_comms(o->s) && sp->gen; c++)
		if (!shd_nccl_span_find(cb->nccl, sp->job, sp->key, c))
			span_drop_comms(cb, sp, o->s);
	o->sp = sp;
	return 0;
}

void cuda_span_job_end(struct cuda_backend *cb, const struct shd_backend_job *job)
{
	struct cuda_span **pp = &cb->spans;

	while (*pp) {
		struct cuda_span *sp = *pp;

		if (job && sp->job != job) {
			pp = &sp->next;
			continue;
		}
		*pp = sp->next;
		span_free(cb, sp);
	}
}

/* ------------------------------------------------------------------ */
/* Bootstrap: world_boot.c over the world and NCCL                      */
/* ------------------------------------------------------------------ */

static int boot_exchange(void *ctx, uint64_t seq, const void *mine, void *all, size_t bytes,
			 uint64_t deadline_ns, uint8_t *missing, char *err, size_t errlen)
{
	struct span_op *o = ctx;
	const void **sends = malloc(o->s->nodes * sizeof(*sends));
	int ret;

	if (!sends) {
		snprintf(err, errlen, "out of memory");
		memset(missing, 0, o->s->nodes);
		return -SHARDD_E_NOMEM;
	}
	for (uint32_t k = 0; k < o->s->nodes; k++)
		sends[k] = mine;
	ret = shd_world_exchange(o->s->key, seq, o->s->check, sends, all, bytes, deadline_ns,
				 missing, err, errlen);
	free(sends);
	return ret;
}

static int boot_make_ids(void *ctx, uint8_t *ids, uint32_t n, char *err, size_t errlen)
{
	(void)ctx;
	return shd_nccl_unique_ids(ids, n, err, errlen);
}

static int boot_init(void *ctx, const uint8_t *ids, uint64_t deadline_ns, char *err, size_t errlen)
{
	struct span_op *o = ctx;
	uint32_t comms = shd_world_boot_comms(o->s), ranks[SHARDD_MAX_WORLD], nranks = 0, made = 0;
	int32_t devs[SHARDD_MAX_WORLD];
	struct shd_nccl_clique **c = calloc(comms, sizeof(*c));
	int ret = 0;

	if (!c) {
		snprintf(err, errlen, "out of memory for %u NCCL communicators", comms);
		return -SHARDD_E_NOMEM;
	}
	/*
	 * Without nccl_lock: the set-up waits for the other nodes, and holding
	 * the lock meanwhile would stall this node's collectives, or deadlock
	 * two groups whose set-ups two nodes started in opposite orders.
	 * Communicator by communicator, in the same order on every node.
	 */
	for (uint32_t q = 0; q < comms && !ret; q++) {
		uint32_t n = 0;

		for (uint32_t k = 0; k < o->n; k++) {
			uint32_t comm, rank;

			shd_world_boot_member(o->s, k, &comm, &rank, &nranks);
			if (comm != q)
				continue;
			devs[n] = o->devices[k];
			ranks[n++] = rank;
		}
		ret = shd_nccl_span_make(o->job, o->job->name, o->s->key, q, devs, n, ranks, nranks,
					 ids + (size_t)q * SHD_WORLD_ID_BYTES, deadline_ns, &c[q],
					 err, errlen);
		if (!ret)
			made++;
	}
	if (ret) {
		for (uint32_t q = 0; q < made; q++)
			shd_nccl_span_abort(c[q]);
	} else {
		cuda_nccl_lock(o->cb);
		for (uint32_t q = 0; q < comms; q++)
			shd_nccl_span_add(o->cb->nccl, c[q]);
		cuda_nccl_unlock(o->cb);
	}
	free(c);
	return ret;
}

static void boot_drop(void *ctx)
{
	struct span_op *o = ctx;

	cuda_nccl_lock(o->cb);
	span_drop_comms(o->cb, o->sp, o->s);
	cuda_nccl_unlock(o->cb);
}

static const struct shd_world_boot_ops *boot_ops(struct span_op *o, struct shd_world_boot_ops *ops)
{
	*ops = (struct shd_world_boot_ops){ o, boot_exchange, boot_make_ids, boot_init, boot_drop };
	return ops;
}

/* ------------------------------------------------------------------ */
/* The op                                                              */
/* ------------------------------------------------------------------ */

/* The op's checks before anything is queued: members, devices, sizes. */
static int span_check_args(struct span_op *o)
{
	const struct shd_world_boot *s = o->s;
	uint32_t comm, rank, nranks;
	int ret = 0;

	if (o->n != s->local || o->n > SHARDD_MAX_WORLD ||
	    shd_world_boot_member(s, 0, &comm, &rank, &nranks))
		return cuda_op_fail(
			-EINVAL, o->err, o->errlen, o->op,
			"%u members of a job across %u nodes with %u ranks each: each node's ranks are "
			"the members",
			o->n, s->nodes, s->local);
	if (!o->job)
		return cuda_op_fail(
			-EINVAL, o->err, o->errlen, o->op,
			"a collective across nodes needs the job its communicators belong to");
	/* One communicator over every rank: NCCL takes one rank per GPU. */
	for (uint32_t k = 0; k < o->n && s->layout == SHD_WORLD_FSDP; k++)
		for (uint32_t j = 0; j < k; j++)
			if (o->devices[j] == o->devices[k])
				return cuda_op_fail(
					-SHARDD_E_INVALID, o->err, o->errlen, o->op,
					"FSDP across nodes on --backend cuda runs one NCCL communicator "
					"over every rank, one rank per GPU: ranks %u and %u of node %u "
					"share device %d; have each rank of a node name its own GPU in "
					"shardd_connect (opts.device)",
					s->node * s->local + j, s->node * s->local + k, s->node,
					o->devices[k]);
	for (uint32_t k = 0; k < o->n && !ret; k++) {
		if (o->u) {
			ret = cuda_on_device(o->u->unsharded[k], o->devices[k], k,
					     "unsharded buffer", o->err, o->errlen, o->op);
			continue;
		}
		ret = cuda_on_device(o->r->outs[k].buf, o->devices[k], k, "output", o->err,
				     o->errlen, o->op);
		if (!ret && cuda_reduce_add(o->r, k))
			ret = cuda_on_device(o->r->adds[k].buf, o->devices[k], k, "addend", o->err,
					     o->errlen, o->op);
		if (!ret && o->coll == SHD_NCCL_ALL_REDUCE &&
		    o->r->views[k].buf->bytes < o->r->reduce_shard_size)
			ret = cuda_op_fail(
				-EINVAL, o->err, o->errlen, o->op,
				"member %u's partial holds %llu bytes, less than a shard's %llu", k,
				(unsigned long long)o->r->views[k].buf->bytes,
				(unsigned long long)o->r->reduce_shard_size);
	}
	if (!ret && o->r) {
		uint32_t rd = o->r->math.reduce_dtype;
		size_t rs = shardd_dtype_size(rd);
		uint64_t P = o->r->reduce_shard_size;

		if (!rs || !o->r->reduce_offsets || !P || P % rs ||
		    (o->coll == SHD_NCCL_ALL_REDUCE &&
		     (o->r->in_dtype != rd || o->r->math.pre > 1)))
			ret = cuda_op_fail(
				-EINVAL, o->err, o->errlen, o->op,
				"NCCL %s across nodes: reduce dtype %u, shard of %llu bytes, inputs in "
				"dtype %u with pre-divide %g: the shard must hold whole elements, and an "
				"all-reduce takes partials in the reduce dtype, divided before",
				coll_what(o->coll), rd, (unsigned long long)P, o->r->in_dtype,
				(double)o->r->math.pre);
	}
	return ret;
}

/* Hand member k's work to its span stream (to_span) or back to the device's stream. */
static int span_handover(struct span_op *o, uint32_t k, int to_span)
{
	struct cuda_span_member *m = &o->sp->m[k];
	cudaEvent_t ev = to_span ? m->staged : m->collected;
	cudaError_t e = cudaSetDevice(o->devices[k]);

	if (e == cudaSuccess)
		e = cudaEventRecord(ev, to_span ? o->d[k]->stream : m->stream);
	if (e == cudaSuccess)
		e = cudaStreamWaitEvent(to_span ? m->stream : o->d[k]->stream, ev, 0);
	return e == cudaSuccess
		       ? 0
		       : cuda_rt_fail("order a device's stream with its stream across nodes", e);
}

/*
 * Phase 1, under nccl_lock: every member's device ready, its stream,
 * events and staging; the group's communicators found; the copy-in on the
 * device's stream, and the span stream told to wait for it. 0, or an
 * error with `err`.
 */
static int span_stage(struct span_op *o, char *err, size_t errlen)
{
	struct cuda_backend *cb = o->cb;
	struct cuda_span *sp = o->sp;
	const struct shd_world_boot *s = o->s;
	uint32_t S = s->nodes * s->local;
	uint64_t Z = o->u ? o->u->layout->shard_size : 0, P = o->r ? o->r->reduce_shard_size : 0;
	uint64_t staging = o->coll == SHD_NCCL_ALL_GATHER ? shd_placement_staging_bytes(S, Z, 0)
			   : o->coll == SHD_NCCL_REDUCE_SCATTER
				   ? shd_placement_staging_bytes(S, 0, P)
				   : 0;
	int ret = 0;

	for (uint32_t c = 0; c < shd_world_boot_comms(s) && !ret; c++) {
		o->cliques[c] = shd_nccl_span_find(cb->nccl, o->job, s->key, c);
		if (!o->cliques[c]) {
			snprintf(err, errlen,
				 "communicator %u of the group was aborted on this node before its "
				 "collective (see the daemon's log)",
				 c);
			ret = -SHARDD_E_BACKEND;
		}
	}
	for (uint32_t k = 0; k < o->n && !ret; k++) {
		struct cuda_span_member *m = &sp->m[k];

		ret = cuda_device_get(cb, o->devices[k], &o->d[k]);
		/* Marks the device as running NCCL: every wait on it is then bounded by the collective timeout. */
		if (!ret)
			ret = cuda_device_nccl_setup(o->d[k]);
		if (!ret)
			ret = member_setup(m);
		if (!ret && m->staging.bytes < staging) {
			char what[96];

			/* Waits for the device's work, the last op's copy-out from the old buffer with it. */
			cuda_free(&cb->base, &m->staging);
			snprintf(what, sizeof(what), "the staging buffer across nodes of device %d",
				 o->devices[k]);
			ret = cuda_alloc(&cb->base, staging, o->devices[k], what, &m->staging);
		}
		if (!ret && o->coll == SHD_NCCL_REDUCE_SCATTER)
			ret = cuda_queued(cuda_reduce_copy_in(o->r, k, S, dptr(&m->staging, 0),
							      o->d[k]->stream),
					  "reduce across nodes");
		if (!ret)
			ret = span_handover(o, k, 1);
		if (ret)
			snprintf(
				err, errlen,
				"device %d could not stage its part of the %s (see the daemon's log)",
				o->devices[k], coll_what(o->coll));
	}
	return ret;
}

/*
 * Phase 2, without the lock (the group's communicators are this op's):
 * the collective queued on the span streams, each followed by its
 * `collected` event. Queueing the first collective of a communicator
 * connects it to its peers, which waits for the other nodes: the lock
 * held meanwhile would stall this node's other collectives, or deadlock
 * two groups that two nodes reach in opposite orders.
 */
static int span_collective(struct span_op *o, void **send, void **recv, char *err, size_t errlen)
{
	const struct shd_world_boot *s = o->s;
	uint32_t rd = o->r ? o->r->math.reduce_dtype : SHARDD_DTYPE_NONE, comm, rank, nranks;
	size_t rs = o->r ? shardd_dtype_size(rd) : 1;
	uint64_t Z = o->u ? o->u->layout->shard_size : 0, P = o->r ? o->r->reduce_shard_size : 0;
	uint64_t deadline = shd_now_ns() + s->timeout_ns;
	void *streams[SHARDD_MAX_WORLD];
	int ret = 0;

	for (uint32_t k = 0; k < o->n; k++) {
		shd_world_boot_member(s, k, &comm, &rank, &nranks);
		streams[k] = o->sp->m[k].stream;
		if (o->coll == SHD_NCCL_ALL_GATHER) {
			send[k] = dptr(o->u->shards[k], 0);
			recv[k] = dptr(&o->sp->m[k].staging, 0);
		} else if (o->coll == SHD_NCCL_REDUCE_SCATTER) {
			/* In place: NCCL rank `rank` receives the sum of block `rank`. */
			send[k] = dptr(&o->sp->m[k].staging, 0);
			recv[k] = (uint8_t *)send[k] + rank * P;
		} else {
			send[k] = recv[k] = dptr(o->r->views[k].buf, 0);
		}
	}
	if (o->coll == SHD_NCCL_ALL_REDUCE) {
		/* HSDP: member k alone in communicator k (shard k's replicas are on the other nodes). */
		for (uint32_t k = 0; k < o->n && !ret; k++)
			ret = shd_nccl_span_collective(o->cliques[k], o->coll, &send[k], &recv[k],
						       P / rs, rd, &streams[k], deadline, err,
						       errlen);
	} else if (o->coll == SHD_NCCL_ALL_GATHER) {
		ret = shd_nccl_span_collective(o->cliques[0], o->coll, send, recv, Z,
					       SHARDD_DTYPE_NONE, streams, deadline, err, errlen);
	} else {
		ret = shd_nccl_span_collective(o->cliques[0], o->coll, send, recv, P / rs, rd,
					       streams, deadline, err, errlen);
	}
	for (uint32_t k = 0; k < o->n && !ret; k++) {
		cudaError_t e = cudaSetDevice(o->devices[k]);

		if (e == cudaSuccess)
			e = cudaEventRecord(o->sp->m[k].collected, o->sp->m[k].stream);
		if (e != cudaSuccess) {
			snprintf(err, errlen, "recording the end of the %s on device %d: %s",
				 coll_what(o->coll), o->devices[k], cudaGetErrorString(e));
			ret = -SHARDD_E_BACKEND;
		}
	}
	return ret;
}

/*
 * Wait until every member's collective finished: its event, polled; its
 * communicators asked for asynchronous errors every WORLD_COMM_CHECK_NS; the
 * collective timeout. The device's stream is not handed the collective
 * before it finished: a device stream that waited for another node could
 * hold up this node's part of a collective that node waits for in turn.
 * 0, or an error with `err`.
 */
static int span_wait(struct span_op *o, char *err, size_t errlen)
{
	struct timespec pause = { 0, WORLD_COMM_POLL_NS };
	uint64_t now = shd_now_ns(), deadline = now + o->s->timeout_ns,
		 check = now + WORLD_COMM_CHECK_NS;

	for (;;) {
		uint32_t done = 0;

		for (uint32_t k = 0; k < o->n; k++) {
			cudaError_t e = cudaEventQuery(o->sp->m[k].collected);

			if (e == cudaSuccess) {
				done++;
				continue;
			}
			if (e != cudaErrorNotReady) {
				snprintf(err, errlen, "waiting for the %s on device %d: %s",
					 coll_what(o->coll), o->devices[k], cudaGetErrorString(e));
				return -SHARDD_E_BACKEND;
			}
			/* Not ready is no failure: leave no trace of it for the next launch check. */
			(void)cudaGetLastError();
		}
		if (done == o->n)
			return 0;
		now = shd_now_ns();
		if (now >= check) {
			for (uint32_t c = 0; c < shd_world_boot_comms(o->s); c++)
				if (shd_nccl_clique_failed(o->cliques[c], err, errlen))
					return -SHARDD_E_PEER_DIED;
			if (now >= deadline) {
				snprintf(
					err, errlen,
					"the %s did not finish within the collective timeout (%.3g s)",
					coll_what(o->coll), (double)o->s->timeout_ns / 1e9);
				return -SHARDD_E_TIMEOUT;
			}
			check = now + WORLD_COMM_CHECK_NS;
		}
		nanosleep(&pause, NULL);
	}
}

/* Phase 3, under nccl_lock: the device's streams take the results (copy-out, or the post kernel). */
static int span_finish(struct span_op *o, void *const *recv, char *err, size_t errlen)
{
	const struct shd_world_boot *s = o->s;
	uint32_t S = s->nodes * s->local, comm, rank, nranks;
	uint64_t Z = o->u ? o->u->layout->shard_size : 0;
	uint8_t *src[SHARDD_MAX_WORLD];
	int ret = 0;

	for (uint32_t k = 0; k < o->n && !ret; k++) {
		shd_world_boot_member(s, k, &comm, &rank, &nranks);
		/* The collective is done: the wait is ordering only, never a wait for another node. */
		ret = span_handover(o, k, 0);
		if (ret)
			break;
		if (o->coll == SHD_NCCL_ALL_GATHER) {
			/* Shard q of every rank in global order at q x shard_size of this member's staging. */
			for (uint32_t q = 0; q < S; q++)
				src[q] = (uint8_t *)recv[k] + (uint64_t)q * Z;
			ret = cuda_queued(cuda_copy_out(o->u->layout, S, src, o->u->unsharded[k],
							o->d[k]->stream),
					  "unshard across nodes");
		} else if (o->coll == SHD_NCCL_REDUCE_SCATTER) {
			ret = cuda_queued(cuda_reduce_post(o->r, k, recv[k], o->r->reduce_offsets,
							   rank, o->d[k]->stream),
					  "reduce across nodes");
		} else {
			/* Member k's partial is shard k's rows: its own shard under HSDP. */
			ret = cuda_queued(cuda_reduce_post(o->r, k, recv[k], o->r->views[k].offsets,
							   k, o->d[k]->stream),
					  "reduce across nodes");
		}
	}
	if (ret)
		snprintf(err, errlen, "a CUDA call failed after the %s (see the daemon's log)",
			 coll_what(o->coll));
	return ret;
}

static int span_run(struct span_op *o)
{
	struct shd_world_boot_ops ops;
	void *send[SHARDD_MAX_WORLD], *recv[SHARDD_MAX_WORLD];
	char why[512] = "", who[256];
	int ret, collective_failed;

	ret = span_check_args(o);
	if (ret)
		return ret;
	cuda_nccl_lock(o->cb);
	ret = span_get(o);
	cuda_nccl_unlock(o->cb);
	if (ret)
		return ret;
	/* No lock held across an exchange: it may wait for the other nodes up to the collective timeout. */
	ret = shd_world_bootstrap(o->s, boot_ops(o, &ops), &o->sp->gen, why, sizeof(why));
	if (ret)
		return cuda_op_fail(ret, o->err, o->errlen, o->op,
				    "%s across nodes of job '%s': %s", coll_what(o->coll),
				    o->job->name, why);
	cuda_nccl_lock(o->cb);
	ret = span_stage(o, why, sizeof(why));
	cuda_nccl_unlock(o->cb);
	if (!ret)
		ret = span_collective(o, send, recv, why, sizeof(why));
	if (!ret)
		ret = span_wait(o, why, sizeof(why));
	collective_failed = ret != 0;
	if (!ret) {
		cuda_nccl_lock(o->cb);
		ret = span_finish(o, recv, why, sizeof(why));
		cuda_nccl_unlock(o->cb);
	}
	if (!ret)
		return 0;
	/* Abort: NCCL stops the kernels still waiting, and the peers see the connections go. */
	cuda_nccl_lock(o->cb);
	span_drop_comms(o->cb, o->sp, o->s);
	cuda_nccl_unlock(o->cb);
	who[0] = '\0';
	/* Only a node whose collective failed asks who is still there: the others are past this op. */
	if (collective_failed)
		shd_world_boot_probe(o->s, &ops, who, sizeof(who));
	if (ret != -SHARDD_E_TIMEOUT && ret != -SHARDD_E_PEER_DIED)
		ret = -SHARDD_E_BACKEND;
	return cuda_op_fail(
		ret, o->err, o->errlen, o->op,
		"the %s among the %u nodes failed on node %u: %s%s%s; its communicators were aborted "
		"and the next op makes them again",
		coll_what(o->coll), o->s->nodes, o->s->node, why, who[0] ? "; no answer from " : "",
		who);
}

int cuda_span_unshard(struct shd_backend_ctx *b, const struct shd_world_boot *span,
		      const struct shd_unshard_args *a)
{
	struct span_op o = {
		.cb = (struct cuda_backend *)b,
		.s = span,
		.job = a->job,
		.coll = SHD_NCCL_ALL_GATHER,
		.op = "unshard",
		.u = a,
		.n = a->nshards,
		.err = a->err,
		.errlen = a->errlen,
	};

	if (span->layout != SHD_WORLD_FSDP || !a->nshards || a->nshards > SHARDD_MAX_WORLD)
		return cuda_op_fail(
			-EINVAL, a->err, a->errlen, "unshard",
			"an unshard across nodes runs under FSDP across nodes only (layout %u, %u shards)",
			span->layout, a->nshards);
	for (uint32_t k = 0; k < o.n; k++)
		o.devices[k] = cbuf(a->shards[k])->device;
	return span_run(&o);
}

int cuda_span_reduce(struct shd_backend_ctx *b, const struct shd_world_boot *span,
		     const struct shd_reduce_args *a)
{
	int grad = a->src == SHD_REDUCE_SRC_GRAD;
	struct span_op o = {
		.cb = (struct cuda_backend *)b,
		.s = span,
		.job = a->job,
		.coll = grad ? SHD_NCCL_REDUCE_SCATTER : SHD_NCCL_ALL_REDUCE,
		.op = "reduce",
		.r = a,
		.n = a->n,
		.err = a->err,
		.errlen = a->errlen,
	};

	if (!a->n || a->n > SHARDD_MAX_WORLD ||
	    (grad ? span->layout != SHD_WORLD_FSDP
		  : span->layout != SHD_WORLD_HSDP || a->src != SHD_REDUCE_SRC_SHARD))
		return cuda_op_fail(
			-EINVAL, a->err, a->errlen, "reduce",
			"a reduce across nodes is the reduce-scatter of FSDP across nodes or the "
			"all-reduce of HSDP across nodes (layout %u, source %u, %u members)",
			span->layout, a->src, a->n);
	for (uint32_t k = 0; k < o.n; k++)
		o.devices[k] = cbuf(grad ? a->grads[k] : a->views[k].buf)->device;
	return span_run(&o);
}

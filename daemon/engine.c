/* SPDX-License-Identifier: MIT */
/*
 * The op engine (engine.h): the state machine of every group of every job.
 *
 * Loop thread: registration and collective rendezvous, holds, validation,
 * group task queues, delivery of results, and the arithmetic of small host
 * tasks (task_inline). Pool threads: the other tasks (the arithmetic of an
 * op, through the backend table). A group runs one task at a time, so ops
 * on one group run in order; any number run across groups.
 *
 *   register --(all ranks, same spec)--> complete --+--> unshard rendezvous[replica] --> task
 *                                                   +--> reduce rendezvous[replica] / all-reduce rendezvous --> task
 *                                                   +--> zero_grad --> task;  reshard: at once
 *
 * A finished pool task is moved to the engine's finished list under `lock`
 * and the eventfd is written; shardd_engine_drain (loop thread) delivers its
 * completions and starts the group's next task. A small task runs where the
 * loop starts it, and its completions go out before that call returns.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon/backend.h"
#ifdef SHARDD_HAVE_CUDA
#include "daemon/backend_cuda.h"
#endif
#include "daemon/engine.h"
#include "daemon/group.h"
#include "daemon/memlimit.h"
#include "daemon/log.h"
#include "daemon/placement.h"
#include "daemon/pool.h"
#include "daemon/rendezvous.h"

#define ENGINE_TIMEOUT_DEFAULT_MS 30000
#define ENGINE_MSG_MAX 512
/*
 * A host task that reads and writes at most this many bytes runs on the
 * loop thread (task_inline). Measured on the 2-core CI VM: 256 KiB moved
 * is 3.3 us of fp32->bf16 cast and 4.8 us of a 2-input reduce, while
 * handing it to a sleeping worker and back costs two cross-core wake-ups
 * of 30-60 us each. Larger tasks go to the pool, so the loop never spends
 * more than a few us on one and a large op never delays another group's.
 */
#define ENGINE_INLINE_MAX_BYTES ((uint64_t)256 << 10)

/* One submitted op waiting for its completion. */
struct eng_op {
	uint32_t rank;
	uint64_t token;
	struct shardd_sqe sqe;
};

/* One rank's pending registration. */
struct eng_reg {
	uint64_t token;
	uint32_t seq;
};

enum eng_task_kind {
	TASK_UNSHARD = 1,     /* all-gather of one replica's shard group */
	TASK_REDUCE_PARTIAL,  /* HSDP, no all-reduce: one replica's reduce-scatter into partials */
	TASK_REDUCE,          /* reduce-scatter (+ HSDP all-reduce) into sharded grads */
	TASK_ZERO_GRAD,       /* one rank's sharded grads become absent */
};

struct eng_group;

struct eng_task {
	struct shardd_pool_task pt;  /* first member: the pool hands it back */
	struct eng_task *next;       /* group queue, then the engine's finished list */
	struct eng_group *eg;
	uint32_t kind;               /* enum eng_task_kind */
	uint32_t replica;            /* UNSHARD, REDUCE_PARTIAL */
	uint32_t rank;               /* ZERO_GRAD */
	int finished;                /* on the finished list; under engine lock */
	int res;
	char msg[ENGINE_MSG_MAX];
	char why[320];               /* the backend's reason of a failure, or empty */
	uint32_t nops;
	struct eng_op ops[];         /* completions to deliver */
};

/* An op of a rank kept back so that the rank's ops on a group apply in the order it submitted them. */
struct eng_deferred {
	struct eng_deferred *next;
	struct eng_op op;
};

/* A collective being gathered: a rendezvous over ranks base..base+n-1 and their ops. */
struct eng_coll {
	struct shardd_rdv rdv;
	uint32_t base;
	uint32_t op;                 /* SHARDD_OP_UNSHARD or SHARDD_OP_REDUCE */
	struct eng_op *ops;          /* [rdv.nexpected], valid where arrived */
};

struct eng_group {
	struct shardd_group *g;
	struct shardd_engine_job *j;
	int complete;                /* buffers allocated, every rank got its reply */
	uint64_t mem_committed;      /* bytes counted in its job's and the engine's mem_committed */
	struct shardd_rdv reg;       /* registration over all ranks */
	struct eng_reg *regs;        /* [world] */
	uint32_t first_rank;         /* whose spec defines the group */
	struct eng_coll *unshard;    /* [replicate]: over each shard group */
	struct eng_coll *rs;         /* [replicate]: reduce (R > 1: without ALL_REDUCE) */
	struct eng_coll ar;          /* R > 1: reduce with ALL_REDUCE, over all ranks */
	struct eng_task *running;    /* on the pool or finished, not yet drained */
	struct eng_task *qhead, *qtail;
	/*
	 * Per rank: ops submitted while the rank waits in a collective of this
	 * group and that must not overtake it (zero_grad, reshard), and any op
	 * it submits after them. Released in order by group_flush.
	 */
	struct eng_deferred **dhead, **dtail; /* [world] */
	int flushing;
};

struct shardd_engine_job {
	struct shardd_engine *e;
	void *ctx;
	char name[SHARDD_NAME_MAX];
	uint32_t replicate, shard, world;
	int32_t *devices;            /* [world]: each rank's hello.device, where its buffers go */
	struct shardd_backend_job *bj; /* the backend's state of the job (NCCL communicators), or NULL */
	uint8_t *gone;               /* [world]: the rank's client left and it has not attached again */
	struct eng_group **groups;   /* index = group id - 1; NULL once a registration failed */
	uint32_t ngroups, cap;
	uint64_t mem_committed;      /* its groups' eg->mem_committed, summed */
	struct shardd_engine_job *prev, *next;
};

struct shardd_engine {
	struct shardd_engine_config cfg;
	uint64_t timeout_ns;
	struct shardd_pool *pool;
	struct shardd_backend_ctx *backend;
	int efd;
	pthread_mutex_t lock;        /* the finished list */
	pthread_cond_t finished;     /* a task reached the finished list */
	struct eng_task *fin_head, *fin_tail;
	struct shardd_engine_job *jobs;
	uint64_t mem_committed;      /* its jobs' mem_committed, summed */
};

/* ------------------------------------------------------------------ */
/* Messages and delivery (loop thread)                                 */
/* ------------------------------------------------------------------ */

__attribute__((format(printf, 3, 4)))
static void fmt(char *buf, size_t len, const char *f, ...)
{
	va_list ap;

	va_start(ap, f);
	vsnprintf(buf, len, f, ap);
	va_end(ap);
}

static void reply_err(struct shardd_engine_job *j, uint32_t rank, uint64_t token, uint32_t seq,
		      int res, const char *msg)
{
	j->e->cfg.reply(j->ctx, rank, token, seq, res, msg, NULL, NULL, NULL, NULL, 0, NULL, 0);
}

static void complete(struct shardd_engine_job *j, const struct eng_op *op, int res, const char *msg)
{
	j->e->cfg.complete(j->ctx, op->rank, op->token, &op->sqe, res, res ? msg : NULL);
}

static void timeout_str(const struct shardd_engine *e, char *buf, size_t len)
{
	uint64_t ms = e->timeout_ns / 1000000u;

	if (ms % 1000 == 0)
		fmt(buf, len, "%llu s", (unsigned long long)(ms / 1000));
	else
		fmt(buf, len, "%.3g s", (double)ms / 1000.0);
}

static const char *plural_rank(const char *list)
{
	return strchr(list, ',') ? "ranks" : "rank";
}

/* ------------------------------------------------------------------ */
/* Collectives                                                         */
/* ------------------------------------------------------------------ */

static int coll_init(struct eng_coll *c, uint32_t base, uint32_t n, uint32_t op)
{
	uint32_t *ranks = malloc(n * sizeof(*ranks));
	int ret;

	if (!ranks)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++)
		ranks[i] = base + i;
	ret = shardd_rdv_init(&c->rdv, ranks, n);
	free(ranks);
	if (ret)
		return ret;
	c->base = base;
	c->op = op;
	c->ops = calloc(n, sizeof(*c->ops));
	if (!c->ops) {
		shardd_rdv_free(&c->rdv);
		return -ENOMEM;
	}
	return 0;
}

static void coll_free(struct eng_coll *c)
{
	if (c->ops)
		shardd_rdv_free(&c->rdv);
	free(c->ops);
	c->ops = NULL;
}

/*
 * Fail every op that arrived at `c` except `skip_rank`'s (UINT32_MAX: none), and reset it.
 *
 * A completion may drop its client (a corrupt CQ), and the rank's departure
 * fails this collective again from shardd_engine_rank_gone(): each op
 * therefore leaves the rendezvous before its completion is pushed (and the
 * rendezvous is reset once empty, before the last one), so the nested call
 * finds only the ops not yet completed and none is completed twice. An op
 * that arrived meanwhile (a released deferred op) is kept, not wiped.
 */
static void coll_fail(struct eng_group *eg, struct eng_coll *c, int res, const char *msg,
		      uint32_t skip_rank)
{
	for (uint32_t i = 0; i < c->rdv.nexpected; i++) {
		struct eng_op op;

		if (!c->rdv.arrived[i])
			continue;
		op = c->ops[i];
		shardd_rdv_leave(&c->rdv, c->base + i);
		if (c->rdv.narrived == 0)
			shardd_rdv_reset(&c->rdv);
		if (c->base + i != skip_rank)
			complete(eg->j, &op, res, msg);
	}
}

/* "unshard(group 'g', step 5)" of the collective's key */
static void coll_what(const struct eng_group *eg, const struct eng_coll *c, char *buf, size_t len)
{
	fmt(buf, len, "%s(group '%s', step %llu)", shardd_op_name(c->op), eg->g->name,
	    (unsigned long long)c->rdv.step);
}

/*
 * Arrival of `op` at `c`. Returns 1 when the collective is complete (its
 * ops are in c->ops; the caller takes them and resets c), else 0: waiting,
 * or failed (the ops concerned were completed with errors).
 */
static int coll_arrive(struct eng_group *eg, struct eng_coll *c, const struct eng_op *op)
{
	struct shardd_engine *e = eg->j->e;
	char why[256], ranks[160], msg[ENGINE_MSG_MAX];
	int ret;

	ret = shardd_rdv_arrive(&c->rdv, op->rank, op->sqe.step, op->sqe.flags, shardd_now_ns(),
				e->timeout_ns, why, sizeof(why));
	if (ret < 0) {
		fmt(msg, sizeof(msg), "shardd: %s(group '%s', step %llu): %s",
		    shardd_op_name(c->op), eg->g->name, (unsigned long long)op->sqe.step, why);
		complete(eg->j, op, -SHARDD_E_INVALID, msg);
		return 0;
	}
	if (ret == SHARDD_RDV_MISMATCH) {
		shardd_rdv_present(&c->rdv, ranks, sizeof(ranks));
		fmt(msg, sizeof(msg), "shardd: %s(group '%s'): %s; failed for ranks %s,%u",
		    shardd_op_name(c->op), eg->g->name, why, ranks, op->rank);
		coll_fail(eg, c, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
		complete(eg->j, op, -SHARDD_E_MISMATCH, msg);
		return 0;
	}
	c->ops[op->rank - c->base] = *op;
	if (ret == SHARDD_RDV_COMPLETE)
		return 1;
	/*
	 * A rank whose client left cannot arrive until it attaches again:
	 * waiting for it would only end at the collective timeout, so the ranks
	 * here learn at once who is missing and can retry once it is back.
	 */
	for (uint32_t i = 0; i < c->rdv.nexpected; i++) {
		uint32_t r = c->base + i;

		if (!c->rdv.arrived[i] && eg->j->gone[r]) {
			char what[160];

			coll_what(eg, c, what, sizeof(what));
			shardd_rdv_present(&c->rdv, ranks, sizeof(ranks));
			fmt(msg, sizeof(msg),
			    "shardd: rank %u left (its client is gone) before %s; failed for %s %s; retry once it attached again",
			    r, what, plural_rank(ranks), ranks);
			coll_fail(eg, c, -SHARDD_E_PEER_DIED, msg, UINT32_MAX);
			return 0;
		}
	}
	return 0;
}

/* ------------------------------------------------------------------ */
/* Tasks                                                               */
/* ------------------------------------------------------------------ */

static void task_run(struct shardd_pool_task *pt);

static struct eng_task *task_new(struct eng_group *eg, uint32_t kind, uint32_t nops)
{
	struct eng_task *t = calloc(1, sizeof(*t) + (size_t)nops * sizeof(struct eng_op));

	if (!t)
		return NULL;
	t->pt.fn = task_run;
	t->eg = eg;
	t->kind = kind;
	t->nops = nops;
	return t;
}

/* Bytes a task reads and writes; an output it adds into counts twice. */
static uint64_t task_bytes(const struct eng_task *t)
{
	const struct shardd_group *g = t->eg->g;
	const struct shardd_layout *l = &g->layout;

	switch (t->kind) {
	case TASK_UNSHARD:
		return g->shard * l->shard_size + l->unsharded_size;
	case TASK_REDUCE_PARTIAL:
		return g->shard * (l->grad_size + 2 * g->partial_size);
	case TASK_REDUCE:
		/* HSDP adds the all-reduce: R partials read per output shard. */
		return g->world * (l->grad_size + 2 * l->shard_size) +
		       (g->replicate > 1 ? g->world * (2 + g->replicate) * g->partial_size : 0);
	default:
		return g->sharded_grads[t->rank].bytes;
	}
}

/*
 * 1 when the task runs on the loop thread: a host task small enough that
 * the wake-ups of a pool round trip cost more than its arithmetic
 * (ENGINE_INLINE_MAX_BYTES). A device backend's calls stay on the pool,
 * whose threads it sets up.
 */
static int task_inline(const struct eng_task *t)
{
	return t->eg->j->e->cfg.backend == SHARDD_BACKEND_HOST && task_bytes(t) <= ENGINE_INLINE_MAX_BYTES;
}

static void task_exec(struct eng_task *t);
static void task_deliver(struct eng_task *t);

/*
 * Start the group's next task if none runs. A small one runs here and its
 * completions are delivered before the next is started, so the group's
 * tasks still run and complete one at a time, in queue order; the first
 * large one goes to the pool and ends the loop (drain starts the rest).
 * A completion callback may submit and kick this group again: running is
 * clear by then, so the nested call takes the next task and this loop
 * finds the queue as it left it.
 */
static void group_kick(struct eng_group *eg)
{
	struct eng_task *t;

	while (!eg->running && (t = eg->qhead)) {
		eg->qhead = t->next;
		if (!eg->qhead)
			eg->qtail = NULL;
		t->next = NULL;
		eg->running = t;
		if (!task_inline(t)) {
			shardd_pool_submit(eg->j->e->pool, &t->pt);
			return;
		}
		task_exec(t);
		eg->running = NULL;
		task_deliver(t);
		free(t);
	}
}

static void group_enqueue(struct eng_group *eg, struct eng_task *t)
{
	if (eg->qtail)
		eg->qtail->next = t;
	else
		eg->qhead = t;
	eg->qtail = t;
	group_kick(eg);
}

/* A task from a complete collective: takes c's ops and resets c. 0, or -ENOMEM (c's ops failed). */
static int coll_launch(struct eng_group *eg, struct eng_coll *c, uint32_t kind, uint32_t replica)
{
	struct eng_task *t = task_new(eg, kind, c->rdv.nexpected);
	char what[160], msg[ENGINE_MSG_MAX];

	if (!t) {
		coll_what(eg, c, what, sizeof(what));
		fmt(msg, sizeof(msg), "shardd: %s: the daemon is out of memory", what);
		coll_fail(eg, c, -SHARDD_E_NOMEM, msg, UINT32_MAX);
		return -ENOMEM;
	}
	t->replica = replica;
	memcpy(t->ops, c->ops, (size_t)c->rdv.nexpected * sizeof(*c->ops));
	shardd_rdv_reset(&c->rdv);
	group_enqueue(eg, t);
	return 0;
}

/*
 * FSDP2's _get_gradient_divide_factors at call time, for a data-parallel
 * size n: the math of the reduce-scatter (over the shard group) and of the
 * all-reduce (over replicas). fp32/bf16 average on each collective
 * (ReduceOp.AVG); fp16 sums, pre-dividing the reduce-scatter's inputs and
 * post-dividing after the last collective.
 */
static void reduce_math(const struct shardd_group *g, uint32_t n, struct shardd_reduce_math *rs,
			struct shardd_reduce_math *ar)
{
	double pre, post;

	shardd_divide_factors(n, g->reduce_dtype, &pre, &post);
	*rs = (struct shardd_reduce_math){ .reduce_dtype = g->reduce_dtype, .pre = 1, .avg = 1, .post = 1 };
	*ar = *rs;
	if (pre == 0) {
		rs->avg = (float)g->shard;
		ar->avg = (float)g->replicate;
		return;
	}
	rs->pre = (float)pre;
	ar->post = (float)post;
}

/*
 * Reduce-scatter of replica u's grads: shard s's output goes to outs[s] (+
 * adds[s] where given), accumulated where accumulate[s].
 */
static int task_reduce_scatter(struct eng_task *t, uint32_t u, const struct shardd_shard_view *outs,
			       const struct shardd_shard_view *adds, const uint8_t *accumulate,
			       const struct shardd_reduce_math *m)
{
	struct shardd_group *g = t->eg->g;
	struct shardd_backend_ctx *b = t->eg->j->e->backend;
	struct shardd_buf *grads[SHARDD_MAX_WORLD];
	struct shardd_reduce_args a = {
		.job = t->eg->j->bj, .layout = &g->layout, .src = SHARDD_REDUCE_SRC_GRAD, .n = g->shard,
		.grads = grads, .outs = outs, .adds = adds, .accumulate = accumulate,
		.reduce_offsets = g->reduce_offsets, .reduce_shard_size = g->reduce_shard_size, .math = *m,
		.err = t->why, .errlen = sizeof(t->why),
	};

	for (uint32_t k = 0; k < g->shard; k++)
		grads[k] = &g->grads[u * g->shard + k];
	return b->ops->reduce(b, &a);
}

/* HSDP: replica u's reduce-scatter output of every shard added into its partial. */
static int task_partials(struct eng_task *t, uint32_t u, const struct shardd_reduce_math *m)
{
	struct shardd_group *g = t->eg->g;
	struct shardd_shard_view outs[SHARDD_MAX_WORLD], adds[SHARDD_MAX_WORLD];
	uint8_t assign[SHARDD_MAX_WORLD] = { 0 };
	int ret;

	for (uint32_t s = 0; s < g->shard; s++) {
		uint32_t r = u * g->shard + s;

		outs[s] = (struct shardd_shard_view){ &g->partials[r], g->reduce_offsets, g->reduce_dtype };
		/* partial = round(rs + partial): FSDP2 accumulates in the reduce dtype before any all-reduce. */
		adds[s] = g->partial_present[r] ? outs[s] : (struct shardd_shard_view){ 0 };
	}
	ret = task_reduce_scatter(t, u, outs, adds, assign, m);
	if (!ret)
		memset(&g->partial_present[u * g->shard], 1, g->shard);
	return ret;
}

static int task_reduce(struct eng_task *t)
{
	struct shardd_group *g = t->eg->g;
	struct shardd_backend_ctx *b = t->eg->j->e->backend;
	struct shardd_shard_view views[SHARDD_MAX_WORLD], outs[SHARDD_MAX_WORLD];
	uint8_t accumulate[SHARDD_MAX_WORLD];
	struct shardd_reduce_math rs, ar;
	int ret = 0;

	if (g->replicate == 1) {
		/* No replicate dim: one collective, pre- and post-divided (fp16) alike. */
		reduce_math(g, g->shard, &rs, &ar);
		rs.post = ar.post;
		for (uint32_t s = 0; s < g->shard; s++)
			outs[s] = (struct shardd_shard_view){ &g->sharded_grads[s], g->shard_offsets, SHARDD_DTYPE_NONE };
		ret = task_reduce_scatter(t, 0, outs, NULL, g->grad_present, &rs);
		if (!ret)
			memset(g->grad_present, 1, g->shard);
		return ret;
	}

	/* HSDP: FSDP2 passes both groups, so n = S * R on every call. */
	reduce_math(g, g->world, &rs, &ar);
	for (uint32_t u = 0; u < g->replicate && !ret; u++)
		ret = task_partials(t, u, &rs);
	/* The all-reduce of each shard index over its replicate group: every replica gets the sum. */
	for (uint32_t s = 0; s < g->shard && !ret; s++) {
		struct shardd_reduce_args a = {
			.job = t->eg->j->bj, .layout = &g->layout, .src = SHARDD_REDUCE_SRC_SHARD,
			.n = g->replicate, .views = views, .shard_rank = s, .in_dtype = g->reduce_dtype,
			.outs = outs, .accumulate = accumulate, .reduce_offsets = g->reduce_offsets,
			.reduce_shard_size = g->reduce_shard_size, .math = ar, .err = t->why,
			.errlen = sizeof(t->why),
		};

		for (uint32_t u = 0; u < g->replicate; u++) {
			uint32_t r = u * g->shard + s;

			views[u] = (struct shardd_shard_view){ &g->partials[r], g->reduce_offsets, g->reduce_dtype };
			outs[u] = (struct shardd_shard_view){ &g->sharded_grads[r], g->shard_offsets, SHARDD_DTYPE_NONE };
			accumulate[u] = g->grad_present[r];
		}
		ret = b->ops->reduce(b, &a);
		for (uint32_t u = 0; u < g->replicate && !ret; u++)
			g->grad_present[u * g->shard + s] = 1;
	}
	/* The partials went into this all-reduce: the next microbatch starts afresh. */
	memset(g->partial_present, 0, g->world);
	return ret;
}

static int task_unshard(struct eng_task *t)
{
	struct shardd_group *g = t->eg->g;
	struct shardd_backend_ctx *b = t->eg->j->e->backend;
	struct shardd_buf *shards[SHARDD_MAX_WORLD], *unsharded[SHARDD_MAX_WORLD];
	struct shardd_unshard_args a = {
		.job = t->eg->j->bj, .layout = &g->layout, .nshards = g->shard, .shards = shards,
		.unsharded = unsharded, .err = t->why, .errlen = sizeof(t->why),
	};

	for (uint32_t s = 0; s < g->shard; s++) {
		uint32_t r = t->replica * g->shard + s;

		shards[s] = &g->shards[r];
		unsharded[s] = shardd_group_unsharded(g, r);
	}
	return b->ops->unshard(b, &a);
}

/*
 * 1 when every completion of the task goes to a client stream that waits on
 * the daemon's fence (SHARDD_FENCE_SIGNAL): queueing the work is enough.
 */
static int task_fenced(const struct eng_task *t)
{
	for (uint32_t i = 0; i < t->nops; i++)
		if (!(t->ops[i].sqe.fence & SHARDD_FENCE_SIGNAL))
			return 0;
	return 1;
}

/*
 * The buffers a task writes, into `bufs`; returns how many. The devices
 * that hold them are those that ran its work (NCCL: every rank's own).
 */
static uint32_t task_outputs(const struct eng_task *t, const struct shardd_buf **bufs)
{
	const struct shardd_group *g = t->eg->g;
	uint32_t n = 0;

	switch (t->kind) {
	case TASK_UNSHARD:
		for (uint32_t s = 0; s < g->shard; s++)
			bufs[n++] = shardd_group_unsharded(g, t->replica * g->shard + s);
		break;
	case TASK_REDUCE_PARTIAL:
		for (uint32_t s = 0; s < g->shard; s++)
			bufs[n++] = &g->partials[t->replica * g->shard + s];
		break;
	case TASK_REDUCE:
		for (uint32_t r = 0; r < g->world; r++)
			bufs[n++] = &g->sharded_grads[r];
		break;
	default:
		bufs[n++] = &g->sharded_grads[t->rank];
		break;
	}
	return n;
}

/* The arithmetic of one task, on a pool thread or (task_inline) the loop thread; sets res and msg. */
static void task_exec(struct eng_task *t)
{
	struct shardd_group *g = t->eg->g;
	struct shardd_backend_ctx *b = t->eg->j->e->backend;
	int ret;

	switch (t->kind) {
	case TASK_UNSHARD:
		ret = task_unshard(t);
		break;
	case TASK_REDUCE_PARTIAL: {
		struct shardd_reduce_math rs, ar;

		reduce_math(g, g->world, &rs, &ar);
		ret = task_partials(t, t->replica, &rs);
		break;
	}
	case TASK_REDUCE:
		ret = task_reduce(t);
		break;
	default:
		ret = b->ops->zero(b, &g->sharded_grads[t->rank], 0, g->sharded_grads[t->rank].bytes);
		if (!ret)
			g->grad_present[t->rank] = 0;
		break;
	}
	/* A completion without a fence promises the results are in memory. */
	if (!ret && b->ops->sync && !task_fenced(t)) {
		const struct shardd_buf *outs[SHARDD_MAX_WORLD];

		ret = b->ops->sync(b, outs, task_outputs(t, outs), t->why, sizeof(t->why));
	}
	t->res = ret;
	if (ret)
		fmt(t->msg, sizeof(t->msg), "shardd: %s(group '%s', step %llu): the %s backend failed: %s",
		    shardd_op_name(t->ops[0].sqe.op), g->name, (unsigned long long)t->ops[0].sqe.step,
		    b->ops->name, t->why[0] ? t->why : ret > -SHARDD_E_BASE ? strerror(-ret) : "backend error");
}

/* Pool thread: run one task, then hand it to the loop. */
static void task_run(struct shardd_pool_task *pt)
{
	struct eng_task *t = (struct eng_task *)pt;
	struct shardd_engine *e = t->eg->j->e;
	uint64_t one = 1;
	ssize_t w;

	task_exec(t);
	pthread_mutex_lock(&e->lock);
	t->finished = 1;
	if (e->fin_tail)
		e->fin_tail->next = t;
	else
		e->fin_head = t;
	e->fin_tail = t;
	pthread_cond_broadcast(&e->finished);
	pthread_mutex_unlock(&e->lock);
	/* An eventfd write only fails on counter overflow, which a read in drain resets. */
	w = write(e->efd, &one, sizeof(one));
	(void)w;
}

/* ------------------------------------------------------------------ */
/* Per-rank order                                                      */
/* ------------------------------------------------------------------ */

/* 1 when `rank` waits in a collective of the group. */
static int rank_busy(const struct eng_group *eg, uint32_t rank)
{
	const struct shardd_engine_job *j = eg->j;
	uint32_t u = rank / j->shard;

	return shardd_rdv_has_arrived(&eg->unshard[u].rdv, rank) ||
	       shardd_rdv_has_arrived(&eg->rs[u].rdv, rank) ||
	       (eg->ar.ops && shardd_rdv_has_arrived(&eg->ar.rdv, rank));
}

/* 1 when `op` (a zero_grad or reshard) must not overtake `rank`'s collective still gathering. */
static int op_must_wait(const struct eng_group *eg, uint32_t rank, uint32_t op)
{
	return (op == SHARDD_OP_ZERO_GRAD || op == SHARDD_OP_RESHARD) && rank_busy(eg, rank);
}

/* 0, or -ENOMEM (the op was not kept). */
static int deferred_push(struct eng_group *eg, const struct eng_op *op)
{
	struct eng_deferred *d = malloc(sizeof(*d));

	if (!d)
		return -ENOMEM;
	d->next = NULL;
	d->op = *op;
	if (eg->dtail[op->rank])
		eg->dtail[op->rank]->next = d;
	else
		eg->dhead[op->rank] = d;
	eg->dtail[op->rank] = d;
	return 0;
}

static void deferred_fail(struct eng_group *eg, uint32_t rank, int res, const char *msg)
{
	while (eg->dhead[rank]) {
		struct eng_deferred *d = eg->dhead[rank];

		eg->dhead[rank] = d->next;
		complete(eg->j, &d->op, res, msg);
		free(d);
	}
	eg->dtail[rank] = NULL;
}

/* ------------------------------------------------------------------ */
/* Engine                                                              */
/* ------------------------------------------------------------------ */

#ifdef SHARDD_HAVE_CUDA
/* The cuda backend; its error is logged as it words it (which flag, why, the fix). */
static int engine_backend_cuda(uint32_t cuda_export, uint64_t timeout_ns, struct shardd_backend_ctx **out)
{
	char err[256];
	int ret = shardd_backend_cuda_create(cuda_export, timeout_ns, out, err, sizeof(err));

	if (ret)
		shardd_log_error("%s", err);
	return ret;
}
#endif

int shardd_engine_create(const struct shardd_engine_config *cfg, struct shardd_engine **out)
{
	struct shardd_engine *e;
	int ret;

#ifndef SHARDD_HAVE_CUDA
	if (cfg->backend == SHARDD_BACKEND_CUDA) {
		shardd_log_error("shardd: the cuda backend is not available in this build; use --backend host");
		return -SHARDD_E_BACKEND;
	}
#endif
	if (cfg->backend != SHARDD_BACKEND_HOST && cfg->backend != SHARDD_BACKEND_CUDA) {
		shardd_log_error("shardd: backend %u is not a backend (host = %d, cuda = %d)",
				 cfg->backend, SHARDD_BACKEND_HOST, SHARDD_BACKEND_CUDA);
		return -SHARDD_E_BACKEND;
	}
	if (!cfg->complete || !cfg->reply)
		return -EINVAL;
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->cfg = *cfg;
	e->timeout_ns = (uint64_t)(cfg->collective_timeout_ms ? cfg->collective_timeout_ms
							      : ENGINE_TIMEOUT_DEFAULT_MS) * 1000000u;
	pthread_mutex_init(&e->lock, NULL);
	pthread_cond_init(&e->finished, NULL);
	e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (e->efd < 0) {
		ret = -errno;
		goto err_free;
	}
	ret = shardd_pool_create(cfg->workers, &e->pool);
	if (ret)
		goto err_efd;
#ifdef SHARDD_HAVE_CUDA
	if (cfg->backend == SHARDD_BACKEND_CUDA)
		ret = engine_backend_cuda(cfg->cuda_export, e->timeout_ns, &e->backend);
	else
#endif
		ret = shardd_backend_host_create(e->pool, &e->backend);
	if (ret)
		goto err_pool;
	*out = e;
	return 0;

err_pool:
	shardd_pool_destroy(e->pool);
err_efd:
	close(e->efd);
err_free:
	pthread_cond_destroy(&e->finished);
	pthread_mutex_destroy(&e->lock);
	free(e);
	/* A backend error was logged in the backend's own words. */
	if (ret != -SHARDD_E_BACKEND)
		shardd_log_error("shardd: cannot start the op engine: %s", strerror(-ret));
	return ret;
}

void shardd_engine_destroy(struct shardd_engine *e)
{
	if (!e)
		return;
	while (e->jobs)
		shardd_engine_job_destroy(e->jobs);
	shardd_pool_destroy(e->pool);
	e->backend->ops->destroy(e->backend);
	close(e->efd);
	pthread_cond_destroy(&e->finished);
	pthread_mutex_destroy(&e->lock);
	free(e);
}

struct shardd_backend_ctx *shardd_engine_backend(struct shardd_engine *e)
{
	return e->backend;
}

int shardd_engine_event_fd(struct shardd_engine *e)
{
	return e->efd;
}

static void task_deliver(struct eng_task *t)
{
	for (uint32_t i = 0; i < t->nops; i++)
		complete(t->eg->j, &t->ops[i], t->res, t->msg);
}

void shardd_engine_drain(struct shardd_engine *e)
{
	struct eng_task *t, *next;
	uint64_t v;
	ssize_t r;

	/* Reset the counter before taking the list: a task finishing later writes again. */
	r = read(e->efd, &v, sizeof(v));
	(void)r;
	pthread_mutex_lock(&e->lock);
	t = e->fin_head;
	e->fin_head = e->fin_tail = NULL;
	pthread_mutex_unlock(&e->lock);
	for (; t; t = next) {
		struct eng_group *eg = t->eg;

		next = t->next;
		eg->running = NULL;
		/*
		 * A next task for the pool starts before these completions go
		 * out, so it overlaps them; a small one runs after them, so the
		 * group's completions keep their order.
		 */
		if (eg->qhead && !task_inline(eg->qhead))
			group_kick(eg);
		task_deliver(t);
		free(t);
		group_kick(eg);
	}
}

/* ------------------------------------------------------------------ */
/* Jobs and groups                                                     */
/* ------------------------------------------------------------------ */

int shardd_engine_job_create(struct shardd_engine *e, void *job_ctx, const char *job_name,
			     uint32_t replicate, uint32_t shard, struct shardd_engine_job **out)
{
	struct shardd_backend_ctx *b = e->backend;
	struct shardd_engine_job *j;
	int ret;

	if (replicate == 0 || shard == 0 || replicate > SHARDD_MAX_WORLD ||
	    shard > SHARDD_MAX_WORLD / replicate) {
		shardd_log_error("shardd: job '%s': mesh %u x %u is outside 1..%d ranks",
				 job_name, replicate, shard, SHARDD_MAX_WORLD);
		return -SHARDD_E_INVALID;
	}
	j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	j->devices = malloc(sizeof(*j->devices) * replicate * shard);
	j->gone = calloc(replicate * shard, sizeof(*j->gone));
	ret = !j->devices || !j->gone ? -ENOMEM : 0;
	if (!ret && b->ops->job_open)
		ret = b->ops->job_open(b, job_name, &j->bj);
	if (ret) {
		free(j->devices);
		free(j->gone);
		free(j);
		return ret;
	}
	for (uint32_t r = 0; r < replicate * shard; r++)
		j->devices[r] = SHARDD_HELLO_DEVICE_HOST;
	j->e = e;
	j->ctx = job_ctx;
	snprintf(j->name, sizeof(j->name), "%s", job_name);
	j->replicate = replicate;
	j->shard = shard;
	j->world = replicate * shard;
	j->next = e->jobs;
	if (e->jobs)
		e->jobs->prev = j;
	e->jobs = j;
	*out = j;
	return 0;
}

/* Free a group's engine state and buffers; handles a partly built one. */
static void group_destroy(struct eng_group *eg, struct shardd_engine_job *j)
{
	for (uint32_t r = 0; eg->dhead && r < j->world; r++) {
		while (eg->dhead[r]) {
			struct eng_deferred *d = eg->dhead[r];

			eg->dhead[r] = d->next;
			free(d);
		}
	}
	free(eg->dhead);
	free(eg->dtail);
	shardd_rdv_free(&eg->reg);
	for (uint32_t u = 0; eg->unshard && u < j->replicate; u++)
		coll_free(&eg->unshard[u]);
	for (uint32_t u = 0; eg->rs && u < j->replicate; u++)
		coll_free(&eg->rs[u]);
	coll_free(&eg->ar);
	free(eg->unshard);
	free(eg->rs);
	free(eg->regs);
	shardd_group_destroy(eg->g, j->e->backend);
	j->mem_committed -= eg->mem_committed;
	j->e->mem_committed -= eg->mem_committed;
	free(eg);
}

/* Forget a group: its id is never reused, so a stale id finds nothing. */
static void group_free(struct eng_group *eg)
{
	eg->j->groups[eg->g->id - 1] = NULL;
	group_destroy(eg, eg->j);
}

/* Wait for the group's running task, take it off the finished list and deliver it. */
static void group_wait_running(struct eng_group *eg)
{
	struct shardd_engine *e = eg->j->e;
	struct eng_task *t = eg->running, **pp;

	if (!t)
		return;
	pthread_mutex_lock(&e->lock);
	while (!t->finished)
		pthread_cond_wait(&e->finished, &e->lock);
	e->fin_tail = NULL;
	for (pp = &e->fin_head; *pp; ) {
		if (*pp == t)
			*pp = t->next;
		else {
			e->fin_tail = *pp;
			pp = &(*pp)->next;
		}
	}
	pthread_mutex_unlock(&e->lock);
	eg->running = NULL;
	task_deliver(t);
	free(t);
}

/* `why`: how the job ended ("was ended by ..."), for every failure; NULL: "ended". */
static void group_shutdown(struct eng_group *eg, const char *why)
{
	struct shardd_engine_job *j = eg->j;
	char msg[ENGINE_MSG_MAX];

	fmt(msg, sizeof(msg), "shardd: job '%s' %s before this op on group '%s' ran", j->name,
	    why ? why : "ended", eg->g->name);
	if (!eg->complete) {
		for (uint32_t r = 0; r < j->world; r++)
			if (shardd_rdv_has_arrived(&eg->reg, r))
				reply_err(j, r, eg->regs[r].token, eg->regs[r].seq, -SHARDD_E_SHUTDOWN, msg);
		return;
	}
	group_wait_running(eg);
	while (eg->qhead) {
		struct eng_task *t = eg->qhead;

		eg->qhead = t->next;
		t->res = -SHARDD_E_SHUTDOWN;
		snprintf(t->msg, sizeof(t->msg), "%s", msg);
		task_deliver(t);
		free(t);
	}
	eg->qtail = NULL;
	for (uint32_t u = 0; u < j->replicate; u++) {
		coll_fail(eg, &eg->unshard[u], -SHARDD_E_SHUTDOWN, msg, UINT32_MAX);
		coll_fail(eg, &eg->rs[u], -SHARDD_E_SHUTDOWN, msg, UINT32_MAX);
	}
	if (eg->ar.ops)
		coll_fail(eg, &eg->ar, -SHARDD_E_SHUTDOWN, msg, UINT32_MAX);
	for (uint32_t r = 0; r < j->world; r++)
		deferred_fail(eg, r, -SHARDD_E_SHUTDOWN, msg);
}

void shardd_engine_job_destroy(struct shardd_engine_job *j)
{
	shardd_engine_job_end(j, NULL);
}

void shardd_engine_job_end(struct shardd_engine_job *j, const char *why)
{
	struct shardd_engine *e;

	if (!j)
		return;
	e = j->e;
	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];

		if (!eg)
			continue;
		group_shutdown(eg, why);
		group_free(eg);
	}
	if (j->prev)
		j->prev->next = j->next;
	else
		e->jobs = j->next;
	if (j->next)
		j->next->prev = j->prev;
	/* After the groups: their buffers are freed, so no collective of the job is queued any more. */
	if (j->bj)
		e->backend->ops->job_close(e->backend, j->bj);
	free(j->groups);
	free(j->devices);
	free(j->gone);
	free(j);
}

void shardd_engine_rank_attached(struct shardd_engine_job *j, uint32_t rank, int32_t device)
{
	if (rank >= j->world)
		return;
	j->devices[rank] = device;
	j->gone[rank] = 0;
}

/* The group with this id (a sqe's or an admin request's: any value), or NULL. */
static struct eng_group *group_by_id(const struct shardd_engine_job *j, uint32_t id)
{
	return id >= 1 && id <= j->ngroups ? j->groups[id - 1] : NULL;
}

static struct eng_group *group_by_name(const struct shardd_engine_job *j, const char *name)
{
	for (uint32_t i = 0; i < j->ngroups; i++) {
		if (j->groups[i] && !strcmp(j->groups[i]->g->name, name))
			return j->groups[i];
	}
	return NULL;
}

/*
 * Count every buffer the group will ever hold against the limits
 * (--max-job-memory for its job, --max-memory for all jobs) before any
 * exists: 0 with the bytes committed in eg, the job and the engine, or
 * -ENOMEM with `err` naming the job, the group, the bytes it needs, those
 * in use, the limit and the flag that raises it. The host backend commits
 * the pages themselves when it allocates (fallocate), so an op never finds
 * memory missing. Device memory (cuda) is not counted.
 */
static int group_commit_memory(struct shardd_engine_job *j, struct eng_group *eg, char *err, size_t errlen)
{
	struct shardd_engine *e = j->e;
	struct shardd_group_memory m;
	const char *flag = NULL, *holder = NULL;
	uint64_t used = 0, limit = 0;
	char need[32], held[32], max[32];

	if (e->cfg.backend != SHARDD_BACKEND_HOST)
		return 0;
	shardd_group_memory_need(eg->g, &m);
	if (e->cfg.max_job_memory && (m.total > e->cfg.max_job_memory ||
				      j->mem_committed > e->cfg.max_job_memory - m.total)) {
		flag = "--max-job-memory";
		holder = "the job";
		used = j->mem_committed;
		limit = e->cfg.max_job_memory;
	} else if (e->cfg.max_memory && (m.total > e->cfg.max_memory ||
					 e->mem_committed > e->cfg.max_memory - m.total)) {
		flag = "--max-memory";
		holder = "the daemon (all jobs)";
		used = e->mem_committed;
		limit = e->cfg.max_memory;
	}
	if (flag) {
		fmt(err, errlen,
		    "register group '%s' of job '%s': its buffers need %s (%llu bytes), but %s holds %s "
		    "(%llu bytes) of its limit of %s (%llu bytes); raise %s, or end jobs or register smaller groups",
		    eg->g->name, j->name, shardd_bytes_str(m.total, need, sizeof(need)),
		    (unsigned long long)m.total, holder,
		    shardd_bytes_str(used, held, sizeof(held)), (unsigned long long)used,
		    shardd_bytes_str(limit, max, sizeof(max)), (unsigned long long)limit, flag);
		return -ENOMEM;
	}
	eg->mem_committed = m.total;
	j->mem_committed += m.total;
	e->mem_committed += m.total;
	return 0;
}

/* A pending group for the first registration of `hdr`; takes `specs` on success. */
static int group_new(struct shardd_engine_job *j, const struct shardd_register_group *hdr,
		     struct shardd_param_spec *specs, uint32_t rank, struct eng_group **out,
		     char *err, size_t errlen)
{
	struct eng_group *eg;
	uint32_t *all = NULL;
	int ret = -ENOMEM;

	if (j->ngroups == j->cap) {
		uint32_t cap = j->cap ? j->cap * 2 : 16;
		struct eng_group **ng = cap > j->cap ? realloc(j->groups, cap * sizeof(*ng)) : NULL;

		if (!ng)
			goto err_msg;
		j->groups = ng;
		j->cap = cap;
	}
	eg = calloc(1, sizeof(*eg));
	if (!eg)
		goto err_msg;
	eg->j = j;
	eg->first_rank = rank;
	ret = shardd_group_create(j->ngroups + 1, hdr, specs, j->replicate, j->shard, &eg->g, err, errlen);
	if (ret) {
		free(eg);
		return ret;
	}
	ret = group_commit_memory(j, eg, err, errlen);
	if (ret) {
		eg->g->specs = NULL; /* still the caller's on failure */
		group_destroy(eg, j);
		return ret;
	}
	ret = -ENOMEM;
	all = malloc(j->world * sizeof(*all));
	eg->regs = calloc(j->world, sizeof(*eg->regs));
	eg->unshard = calloc(j->replicate, sizeof(*eg->unshard));
	eg->rs = calloc(j->replicate, sizeof(*eg->rs));
	eg->dhead = calloc(j->world, sizeof(*eg->dhead));
	eg->dtail = calloc(j->world, sizeof(*eg->dtail));
	if (!all || !eg->regs || !eg->unshard || !eg->rs || !eg->dhead || !eg->dtail)
		goto err_group;
	for (uint32_t r = 0; r < j->world; r++)
		all[r] = r;
	if (shardd_rdv_init(&eg->reg, all, j->world))
		goto err_group;
	for (uint32_t u = 0; u < j->replicate; u++) {
		if (coll_init(&eg->unshard[u], u * j->shard, j->shard, SHARDD_OP_UNSHARD) ||
		    coll_init(&eg->rs[u], u * j->shard, j->shard, SHARDD_OP_REDUCE))
			goto err_group;
	}
	if (j->replicate > 1 && coll_init(&eg->ar, 0, j->world, SHARDD_OP_REDUCE))
		goto err_group;
	free(all);
	j->groups[j->ngroups++] = eg;
	*out = eg;
	return 0;

err_group:
	eg->g->specs = NULL; /* still the caller's on failure */
	group_destroy(eg, j);
	free(all);
err_msg:
	fmt(err, errlen, "register group '%s': the daemon is out of memory", hdr->name);
	return ret;
}

/*
 * Fail a pending registration for every rank that arrived, and forget the group.
 *
 * The group leaves the job before any reply is sent: a reply that cannot be
 * sent drops its client, whose departure (shardd_engine_rank_gone) would
 * otherwise find this group still pending, fail it again and free it under
 * this loop.
 */
static void reg_fail(struct eng_group *eg, int res, const char *msg, uint32_t skip_rank)
{
	struct shardd_engine_job *j = eg->j;

	j->groups[eg->g->id - 1] = NULL;
	for (uint32_t r = 0; r < j->world; r++) {
		if (r != skip_rank && shardd_rdv_has_arrived(&eg->reg, r))
			reply_err(j, r, eg->regs[r].token, eg->regs[r].seq, res, msg);
	}
	group_destroy(eg, j);
}

static void reply_group(struct eng_group *eg, uint32_t rank, uint64_t token, uint32_t seq)
{
	struct shardd_engine_job *j = eg->j;
	struct shardd_group_reply reply;
	struct shardd_param_layout *layouts;
	struct shardd_group_export ex;
	char msg[ENGINE_MSG_MAX];
	int ret;

	layouts = malloc((size_t)eg->g->hdr.nparams * sizeof(*layouts));
	if (!layouts) {
		fmt(msg, sizeof(msg), "shardd: group '%s': the daemon is out of memory", eg->g->name);
		reply_err(j, rank, token, seq, -SHARDD_E_NOMEM, msg);
		return;
	}
	ret = shardd_group_reply(eg->g, j->e->backend, rank, &reply, layouts, &ex);
	if (ret) {
		fmt(msg, sizeof(msg), "shardd: group '%s': cannot export its buffers to rank %u: %s",
		    eg->g->name, rank, strerror(-ret));
		reply_err(j, rank, token, seq, ret, msg);
	} else {
		j->e->cfg.reply(j->ctx, rank, token, seq, 0, NULL, &reply, layouts, eg->g->specs,
				ex.fds, ex.nfds, ex.ipc, ex.nipc);
		shardd_group_export_close(&ex);
	}
	free(layouts);
}

/*
 * Where the group's collectives run (placement.h): refuse ranks of a shard
 * or replicate group that partly share devices, and collectives across
 * devices that the backend cannot run. 0 with *planned set when `pl`
 * holds the plan (0: the backend ignores devices, and every replica shares
 * one unsharded buffer), or an error with `err`.
 */
static int reg_place(struct eng_group *eg, struct shardd_placement *pl, int *planned, char *err,
		     size_t errlen)
{
	struct shardd_engine_job *j = eg->j;
	struct shardd_backend_ctx *b = j->e->backend;
	char why[320];
	int ret;

	*planned = 0;
	if (!b->ops->multi_device)
		return 0;
	ret = shardd_placement_plan(eg->g->name, j->devices, j->replicate, j->shard, pl, err, errlen);
	if (ret)
		return ret;
	*planned = 1;
	if (!pl->nccl)
		return 0;
	ret = b->ops->multi_device(b, why, sizeof(why));
	if (ret)
		fmt(err, errlen, "register group '%s': its ranks sit on different GPUs, where collectives need NCCL: %s",
		    eg->g->name, why);
	return ret;
}

static void reg_finish(struct eng_group *eg)
{
	struct shardd_engine_job *j = eg->j;
	struct shardd_placement *pl;
	char err[ENGINE_MSG_MAX], msg[ENGINE_MSG_MAX];
	int planned = 0, ret;

	pl = malloc(sizeof(*pl));
	if (!pl) {
		fmt(msg, sizeof(msg), "shardd: register group '%s': the daemon is out of memory", eg->g->name);
		reg_fail(eg, -SHARDD_E_NOMEM, msg, UINT32_MAX);
		return;
	}
	ret = reg_place(eg, pl, &planned, err, sizeof(err));
	if (!ret)
		ret = shardd_group_alloc(eg->g, j->e->backend, j->devices, planned ? pl : NULL, err, sizeof(err));
	free(pl);
	if (ret) {
		fmt(msg, sizeof(msg), "shardd: %s", err);
		reg_fail(eg, ret, msg, UINT32_MAX);
		return;
	}
	eg->complete = 1;
	for (uint32_t r = 0; r < j->world; r++)
		reply_group(eg, r, eg->regs[r].token, eg->regs[r].seq);
	shardd_rdv_reset(&eg->reg);
}

void shardd_engine_register_group(struct shardd_engine_job *j, uint32_t rank, uint64_t token,
				  uint32_t seq, const void *payload, size_t len)
{
	struct shardd_register_group hdr;
	struct shardd_param_spec *specs = NULL;
	struct eng_group *eg;
	char err[480], why[384], ranks[160], msg[ENGINE_MSG_MAX];
	int ret;

	if (rank >= j->world) {
		fmt(msg, sizeof(msg), "shardd: register group: rank %u is outside job '%s' of %u ranks",
		    rank, j->name, j->world);
		reply_err(j, rank, token, seq, -SHARDD_E_INVALID, msg);
		return;
	}
	ret = shardd_group_parse(payload, len, &hdr, &specs, err, sizeof(err));
	if (ret) {
		fmt(msg, sizeof(msg), "shardd: %s", ret == -ENOMEM ? "register group: out of memory" : err);
		reply_err(j, rank, token, seq, ret, msg);
		return;
	}
	eg = group_by_name(j, hdr.name);
	if (eg && eg->complete) {
		fmt(msg, sizeof(msg),
		    "shardd: group '%s' is already registered in job '%s' (id %u); use OPEN_GROUP to re-attach to it",
		    hdr.name, j->name, eg->g->id);
		reply_err(j, rank, token, seq, -EEXIST, msg);
		goto out;
	}
	if (!eg) {
		ret = group_new(j, &hdr, specs, rank, &eg, err, sizeof(err));
		if (ret) {
			fmt(msg, sizeof(msg), "shardd: %s", err);
			reply_err(j, rank, token, seq, ret, msg);
			goto out;
		}
		specs = NULL; /* the group owns them */
	} else if (shardd_rdv_has_arrived(&eg->reg, rank)) {
		shardd_rdv_missing(&eg->reg, ranks, sizeof(ranks));
		fmt(msg, sizeof(msg),
		    "shardd: rank %u already registered group '%s'; it waits for %s %s to register it",
		    rank, hdr.name, plural_rank(ranks), ranks);
		reply_err(j, rank, token, seq, -SHARDD_E_STATE, msg);
		goto out;
	} else if (shardd_group_compare(eg->g, &hdr, specs, rank, eg->first_rank, why, sizeof(why))) {
		shardd_rdv_present(&eg->reg, ranks, sizeof(ranks));
		fmt(msg, sizeof(msg), "shardd: %s; registration failed for ranks %s,%u", why, ranks, rank);
		/*
		 * The group is failed before this rank is answered: a reply that
		 * cannot be sent drops the rank, and its departure must not find
		 * (and free) the group we are still failing.
		 */
		reg_fail(eg, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
		reply_err(j, rank, token, seq, -SHARDD_E_MISMATCH, msg);
		goto out;
	}
	ret = shardd_rdv_arrive(&eg->reg, rank, 0, 0, shardd_now_ns(), j->e->timeout_ns, why, sizeof(why));
	eg->regs[rank] = (struct eng_reg){ .token = token, .seq = seq };
	if (ret == SHARDD_RDV_COMPLETE)
		reg_finish(eg);
out:
	free(specs);
}

void shardd_engine_open_group(struct shardd_engine_job *j, uint32_t rank, uint64_t token,
			      uint32_t seq, const void *payload, size_t len)
{
	struct shardd_open_group req;
	struct eng_group *eg;
	char msg[ENGINE_MSG_MAX], ranks[160];
	size_t off;

	if (rank >= j->world) {
		fmt(msg, sizeof(msg), "shardd: open group: rank %u is outside job '%s' of %u ranks",
		    rank, j->name, j->world);
		reply_err(j, rank, token, seq, -SHARDD_E_INVALID, msg);
		return;
	}
	if (!payload || len != sizeof(req)) {
		fmt(msg, sizeof(msg), "shardd: open group: payload is %zu bytes, expected %zu", len, sizeof(req));
		reply_err(j, rank, token, seq, -SHARDD_E_MALFORMED, msg);
		return;
	}
	memcpy(&req, payload, sizeof(req));
	if (!memchr(req.name, '\0', sizeof(req.name))) {
		fmt(msg, sizeof(msg), "shardd: open group: name is not NUL-terminated within %d bytes",
		    SHARDD_NAME_MAX);
		reply_err(j, rank, token, seq, -SHARDD_E_INVALID, msg);
		return;
	}
	eg = group_by_name(j, req.name);
	if (eg && eg->complete) {
		reply_group(eg, rank, token, seq);
		return;
	}
	if (eg) {
		shardd_rdv_missing(&eg->reg, ranks, sizeof(ranks));
		fmt(msg, sizeof(msg), "shardd: group '%s' of job '%s' is still being registered: %s %s have not registered it",
		    req.name, j->name, plural_rank(ranks), ranks);
		reply_err(j, rank, token, seq, -SHARDD_E_NOGROUP, msg);
		return;
	}
	off = (size_t)snprintf(msg, sizeof(msg), "shardd: no group '%s' in job '%s'; registered groups:",
			       req.name, j->name);
	for (uint32_t i = 0, n = 0; i < j->ngroups && off < sizeof(msg); i++) {
		if (j->groups[i] && j->groups[i]->complete)
			off += (size_t)snprintf(msg + off, sizeof(msg) - off, "%s '%s'", n++ ? "," : "",
						j->groups[i]->g->name);
	}
	if (off < sizeof(msg) && msg[off - 1] == ':')
		snprintf(msg + off, sizeof(msg) - off, " none");
	reply_err(j, rank, token, seq, -SHARDD_E_NOGROUP, msg);
}

/* ------------------------------------------------------------------ */
/* Data plane                                                          */
/* ------------------------------------------------------------------ */

static void submit_unshard(struct eng_group *eg, const struct eng_op *op)
{
	struct shardd_group *g = eg->g;
	uint32_t u = op->rank / g->shard;
	struct eng_coll *c = &eg->unshard[u];

	/* Submitting the next step releases this rank's hold on the previous copy. */
	g->holds[op->rank] = 0;
	if (!coll_arrive(eg, c, op))
		return;
	/*
	 * Every rank of the shard group submitted, so none holds the old copy
	 * and the task may overwrite it; each holds the new one. Set before the
	 * launch: a small task completes within it.
	 */
	for (uint32_t s = 0; s < g->shard; s++)
		g->holds[u * g->shard + s] = 1;
	if (coll_launch(eg, c, TASK_UNSHARD, u)) {
		for (uint32_t s = 0; s < g->shard; s++)
			g->holds[u * g->shard + s] = 0;
	}
}

static void submit_reshard(struct eng_group *eg, const struct eng_op *op)
{
	char msg[ENGINE_MSG_MAX];

	if (!eg->g->holds[op->rank]) {
		fmt(msg, sizeof(msg), "shardd: rank %u has no unsharded copy of group '%s' to reshard",
		    op->rank, eg->g->name);
		complete(eg->j, op, -SHARDD_E_STATE, msg);
		return;
	}
	eg->g->holds[op->rank] = 0;
	complete(eg->j, op, 0, NULL);
}

static void submit_zero_grad(struct eng_group *eg, const struct eng_op *op)
{
	struct eng_task *t = task_new(eg, TASK_ZERO_GRAD, 1);
	char msg[ENGINE_MSG_MAX];

	if (!t) {
		fmt(msg, sizeof(msg), "shardd: zero_grad(group '%s'): the daemon is out of memory", eg->g->name);
		complete(eg->j, op, -SHARDD_E_NOMEM, msg);
		return;
	}
	t->rank = op->rank;
	t->ops[0] = *op;
	group_enqueue(eg, t);
}

/*
 * HSDP: a rank's reduce goes to its replica's rendezvous or to the
 * all-reduce one by its flag. Ranks of one shard group that disagree on the
 * flag would wait in different rendezvous: that is a mismatch, found here.
 */
static int reduce_cross_check(struct eng_group *eg, const struct eng_op *op, struct eng_coll *mine,
			      struct eng_coll *other)
{
	struct shardd_group *g = eg->g;
	uint32_t u = op->rank / g->shard, first = UINT32_MAX;
	char ranks[160], ranks2[160], msg[ENGINE_MSG_MAX];

	if (!other->rdv.active)
		return 0;
	for (uint32_t s = 0; s < g->shard && first == UINT32_MAX; s++) {
		if (shardd_rdv_has_arrived(&other->rdv, u * g->shard + s))
			first = u * g->shard + s;
	}
	if (first == UINT32_MAX)
		return 0;
	if (first == op->rank || shardd_rdv_has_arrived(&other->rdv, op->rank)) {
		fmt(msg, sizeof(msg),
		    "shardd: reduce(group '%s', step %llu): rank %u submitted it while its reduce step %llu flags 0x%x is still waiting",
		    g->name, (unsigned long long)op->sqe.step, op->rank,
		    (unsigned long long)other->rdv.step, other->rdv.flags);
		complete(eg->j, op, -SHARDD_E_INVALID, msg);
		return 1;
	}
	shardd_rdv_present(&other->rdv, ranks, sizeof(ranks));
	shardd_rdv_present(&mine->rdv, ranks2, sizeof(ranks2));
	fmt(msg, sizeof(msg),
	    "shardd: reduce(group '%s'): rank %u submitted step %llu flags 0x%x but rank %u submitted step %llu flags 0x%x; failed for ranks %s%s%s,%u",
	    g->name, op->rank, (unsigned long long)op->sqe.step, op->sqe.flags, first,
	    (unsigned long long)other->rdv.step, other->rdv.flags, ranks, ranks2[0] ? "," : "", ranks2,
	    op->rank);
	coll_fail(eg, other, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
	coll_fail(eg, mine, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
	complete(eg->j, op, -SHARDD_E_MISMATCH, msg);
	return 1;
}

static void submit_reduce(struct eng_group *eg, const struct eng_op *op)
{
	struct shardd_group *g = eg->g;
	uint32_t u = op->rank / g->shard;
	char msg[ENGINE_MSG_MAX];

	if (g->grad_dtype == SHARDD_DTYPE_NONE) {
		fmt(msg, sizeof(msg),
		    "shardd: reduce(group '%s', step %llu): FSDP reduce-scatter expects uniform gradient dtype but got %s; set a param_dtype policy or register params of one dtype",
		    g->name, (unsigned long long)op->sqe.step, g->grad_dtypes);
		complete(eg->j, op, -SHARDD_E_INVALID, msg);
		return;
	}
	if (g->replicate == 1) {
		if (coll_arrive(eg, &eg->rs[0], op))
			coll_launch(eg, &eg->rs[0], TASK_REDUCE, 0);
		return;
	}
	if (op->sqe.flags & SHARDD_REDUCE_ALL_REDUCE) {
		if (reduce_cross_check(eg, op, &eg->ar, &eg->rs[u]))
			return;
		if (coll_arrive(eg, &eg->ar, op))
			coll_launch(eg, &eg->ar, TASK_REDUCE, 0);
		return;
	}
	if (reduce_cross_check(eg, op, &eg->rs[u], &eg->ar))
		return;
	if (coll_arrive(eg, &eg->rs[u], op))
		coll_launch(eg, &eg->rs[u], TASK_REDUCE_PARTIAL, u);
}

static void dispatch(struct eng_group *eg, const struct eng_op *op)
{
	switch (op->sqe.op) {
	case SHARDD_OP_UNSHARD:
		submit_unshard(eg, op);
		break;
	case SHARDD_OP_REDUCE:
		submit_reduce(eg, op);
		break;
	case SHARDD_OP_RESHARD:
		submit_reshard(eg, op);
		break;
	default:
		submit_zero_grad(eg, op);
		break;
	}
}

/*
 * Release deferred ops whose rank no longer waits in a collective, in
 * submission order; a released collective may complete one and release
 * more, hence the loop. Called after every event that ends a collective.
 */
static void group_flush(struct eng_group *eg)
{
	int progress = 1;

	if (eg->flushing)
		return;
	eg->flushing = 1;
	while (progress) {
		progress = 0;
		for (uint32_t r = 0; r < eg->j->world; r++) {
			struct eng_deferred *d;

			while ((d = eg->dhead[r])) {
				if (op_must_wait(eg, r, d->op.sqe.op))
					break;
				eg->dhead[r] = d->next;
				if (!eg->dhead[r])
					eg->dtail[r] = NULL;
				dispatch(eg, &d->op);
				free(d);
				progress = 1;
			}
		}
	}
	eg->flushing = 0;
}

static int sqe_reserved_zero(const struct shardd_sqe *sqe)
{
	for (size_t i = 0; i < sizeof(sqe->rsvd0); i++)
		if (sqe->rsvd0[i])
			return 0;
	for (size_t i = 0; i < sizeof(sqe->rsvd2) / sizeof(sqe->rsvd2[0]); i++)
		if (sqe->rsvd2[i])
			return 0;
	return sqe->rsvd1 == 0;
}

void shardd_engine_submit(struct shardd_engine_job *j, uint32_t rank, uint64_t token,
			  const struct shardd_sqe *sqe)
{
	struct eng_op op = { .rank = rank, .token = token, .sqe = *sqe };
	const char *name = shardd_op_name(sqe->op);
	struct eng_group *eg;
	uint32_t unknown;
	char msg[ENGINE_MSG_MAX];

	if (rank >= j->world) {
		fmt(msg, sizeof(msg), "shardd: rank %u is outside job '%s' of %u ranks", rank, j->name, j->world);
		complete(j, &op, -SHARDD_E_INVALID, msg);
		return;
	}
	if (sqe->op != SHARDD_OP_UNSHARD && sqe->op != SHARDD_OP_REDUCE &&
	    sqe->op != SHARDD_OP_RESHARD && sqe->op != SHARDD_OP_ZERO_GRAD) {
		fmt(msg, sizeof(msg), "shardd: op %u is not a group op (unshard = %d, reduce = %d, reshard = %d, zero_grad = %d)",
		    sqe->op, SHARDD_OP_UNSHARD, SHARDD_OP_REDUCE, SHARDD_OP_RESHARD, SHARDD_OP_ZERO_GRAD);
		complete(j, &op, -SHARDD_E_INVALID, msg);
		return;
	}
	if (!sqe_reserved_zero(sqe)) {
		fmt(msg, sizeof(msg), "shardd: %s: reserved fields of the ring entry are not zero", name);
		complete(j, &op, -SHARDD_E_INVALID, msg);
		return;
	}
	eg = group_by_id(j, sqe->group);
	if (!eg || !eg->complete) {
		fmt(msg, sizeof(msg), "shardd: %s: group id %u is not a registered group of job '%s'",
		    name, sqe->group, j->name);
		complete(j, &op, -SHARDD_E_NOGROUP, msg);
		return;
	}
	unknown = sqe->flags & ~(sqe->op == SHARDD_OP_REDUCE ? (uint32_t)SHARDD_REDUCE_FLAGS_MASK : 0u);
	if (unknown) {
		fmt(msg, sizeof(msg), "shardd: %s(group '%s'): flags = 0x%x has unknown bits 0x%x",
		    name, eg->g->name, sqe->flags, unknown);
		complete(j, &op, -SHARDD_E_INVALID, msg);
		return;
	}
	/* Kept back: a zero_grad or reshard behind its rank's collective, and any op behind a kept one. */
	if (eg->dhead[rank] || op_must_wait(eg, rank, sqe->op)) {
		if (deferred_push(eg, &op)) {
			fmt(msg, sizeof(msg), "shardd: %s(group '%s'): the daemon is out of memory", name, eg->g->name);
			complete(j, &op, -SHARDD_E_NOMEM, msg);
		}
		return;
	}
	dispatch(eg, &op);
	group_flush(eg);
}

/* ------------------------------------------------------------------ */
/* Failures: dead ranks, timeouts                                      */
/* ------------------------------------------------------------------ */

/* Rank gone: fail an active collective it belongs to, unless a newer attachment arrived there. */
static void coll_rank_gone(struct eng_group *eg, struct eng_coll *c, uint32_t rank, uint64_t token)
{
	char what[160], msg[ENGINE_MSG_MAX], ranks[160];

	if (!c->ops || !c->rdv.active || !shardd_rdv_expects(&c->rdv, rank))
		return;
	if (shardd_rdv_has_arrived(&c->rdv, rank) && c->ops[rank - c->base].token != token)
		return;
	coll_what(eg, c, what, sizeof(what));
	shardd_rdv_present(&c->rdv, ranks, sizeof(ranks));
	fmt(msg, sizeof(msg), "shardd: rank %u left (its client is gone) during %s; failed for %s %s",
	    rank, what, plural_rank(ranks), ranks);
	coll_fail(eg, c, -SHARDD_E_PEER_DIED, msg, rank);
}

void shardd_engine_rank_gone(struct shardd_engine_job *j, uint32_t rank, uint64_t token)
{
	char msg[ENGINE_MSG_MAX], ranks[160];

	if (rank >= j->world)
		return;
	j->gone[rank] = 1;
	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];

		if (!eg)
			continue;
		if (!eg->complete) {
			if (shardd_rdv_has_arrived(&eg->reg, rank) && eg->regs[rank].token != token)
				continue;
			shardd_rdv_present(&eg->reg, ranks, sizeof(ranks));
			fmt(msg, sizeof(msg),
			    "shardd: rank %u left (its client is gone) before group '%s' was registered by every rank; failed for %s %s",
			    rank, eg->g->name, plural_rank(ranks), ranks);
			reg_fail(eg, -SHARDD_E_PEER_DIED, msg, rank);
			continue;
		}
		eg->g->holds[rank] = 0;
		for (uint32_t u = 0; u < j->replicate; u++) {
			coll_rank_gone(eg, &eg->unshard[u], rank, token);
			coll_rank_gone(eg, &eg->rs[u], rank, token);
		}
		coll_rank_gone(eg, &eg->ar, rank, token);
		fmt(msg, sizeof(msg), "shardd: rank %u left (its client is gone) before this op on group '%s' ran",
		    rank, eg->g->name);
		deferred_fail(eg, rank, -SHARDD_E_PEER_DIED, msg);
		group_flush(eg);
	}
}

/* "shardd: ranks 2,3 never <did> within 30 s; rank 0 is waiting" for an expired rendezvous. */
static void expired_msg(const struct shardd_engine *e, const struct shardd_rdv *rdv, const char *did,
			char *msg, size_t len)
{
	char missing[160], present[160], within[32];

	shardd_rdv_missing(rdv, missing, sizeof(missing));
	shardd_rdv_present(rdv, present, sizeof(present));
	timeout_str(e, within, sizeof(within));
	fmt(msg, len, "shardd: %s %s never %s within %s; %s %s %s waiting", plural_rank(missing), missing,
	    did, within, plural_rank(present), present, strchr(present, ',') ? "are" : "is");
}

static void coll_cron(struct eng_group *eg, struct eng_coll *c, uint64_t now_ns)
{
	char what[160], did[192], msg[ENGINE_MSG_MAX];

	if (!c->ops || !shardd_rdv_expired(&c->rdv, now_ns))
		return;
	coll_what(eg, c, what, sizeof(what));
	fmt(did, sizeof(did), "submitted %s", what);
	expired_msg(eg->j->e, &c->rdv, did, msg, sizeof(msg));
	coll_fail(eg, c, -SHARDD_E_TIMEOUT, msg, UINT32_MAX);
}

void shardd_engine_cron(struct shardd_engine *e, uint64_t now_ns)
{
	char did[192], msg[ENGINE_MSG_MAX];

	for (struct shardd_engine_job *j = e->jobs; j; j = j->next) {
		for (uint32_t i = 0; i < j->ngroups; i++) {
			struct eng_group *eg = j->groups[i];

			if (!eg)
				continue;
			if (!eg->complete) {
				if (!shardd_rdv_expired(&eg->reg, now_ns))
					continue;
				fmt(did, sizeof(did), "registered group '%s'", eg->g->name);
				expired_msg(e, &eg->reg, did, msg, sizeof(msg));
				reg_fail(eg, -SHARDD_E_TIMEOUT, msg, UINT32_MAX);
				continue;
			}
			for (uint32_t u = 0; u < j->replicate; u++) {
				coll_cron(eg, &eg->unshard[u], now_ns);
				coll_cron(eg, &eg->rs[u], now_ns);
			}
			coll_cron(eg, &eg->ar, now_ns);
			group_flush(eg);
		}
	}
}

/* ------------------------------------------------------------------ */
/* Introspection                                                       */
/* ------------------------------------------------------------------ */

uint64_t shardd_engine_memory_committed(const struct shardd_engine *e)
{
	return e->mem_committed;
}

uint64_t shardd_engine_job_memory_committed(const struct shardd_engine_job *j)
{
	return j->mem_committed;
}

uint32_t shardd_engine_job_ngroups(const struct shardd_engine_job *j)
{
	return j->ngroups;
}

const struct shardd_group *shardd_engine_job_group(const struct shardd_engine_job *j, uint32_t id)
{
	const struct eng_group *eg = group_by_id(j, id);

	return eg ? eg->g : NULL;
}

const struct shardd_group *shardd_engine_job_group_named(const struct shardd_engine_job *j,
							  const char *name)
{
	const struct eng_group *eg = group_by_name(j, name);

	return eg ? eg->g : NULL;
}

int shardd_engine_group_complete(const struct shardd_engine_job *j, uint32_t id)
{
	const struct eng_group *eg = group_by_id(j, id);

	return eg && eg->complete;
}

int shardd_engine_group_pending(const struct shardd_engine_job *j, uint32_t id, uint32_t i,
				uint32_t *op, const struct shardd_rdv **rdv)
{
	const struct eng_group *eg = group_by_id(j, id);
	uint32_t seen = 0;

	if (!eg)
		return -ENOENT;
	if (!eg->complete) {
		if (i > 0 || !eg->reg.active)
			return -ENOENT;
		*op = 0;
		*rdv = &eg->reg;
		return 0;
	}
	/* Collectives in a fixed order: unshard and reduce per replica, then the all-reduce. */
	for (uint32_t k = 0; k < 2 * j->replicate + 1; k++) {
		const struct eng_coll *c = k == 2 * j->replicate ? &eg->ar
					 : k % 2 ? &eg->rs[k / 2] : &eg->unshard[k / 2];

		if (!c->ops || !c->rdv.active)
			continue;
		if (seen++ == i) {
			*op = c->op;
			*rdv = &c->rdv;
			return 0;
		}
	}
	return -ENOENT;
}

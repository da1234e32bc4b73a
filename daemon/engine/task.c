/* SPDX-License-Identifier: MIT */
/*
 * Tasks (engine_int.h): what each op computes, through the backend table,
 * and where it runs.
 *
 * A group runs one task at a time, in the order its ops were queued. A
 * task small enough for the backend's inline_max_bytes (backend.h) runs on
 * the loop thread where it is started, and its completions go out before
 * that call returns. Any other runs on a pool thread: finished, it is
 * moved to the engine's finished list under `lock` and the eventfd is
 * written; shd_engine_drain (loop thread) delivers its completions and
 * starts the group's next task.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_int.h"
#include "step.h"

static void task_run(struct shd_pool_task *pt);

struct eng_task *eng_task_new(struct eng_group *eg, uint32_t kind, uint32_t nops)
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

/* ------------------------------------------------------------------ */
/* Where a task runs (loop thread)                                     */
/* ------------------------------------------------------------------ */

/* Bytes a task reads and writes; an output it adds into counts twice. */
static uint64_t task_bytes(const struct eng_task *t)
{
	const struct shd_group *g = t->eg->g;
	const struct shd_layout *l = &g->layout;

	/* On the enum: a kind added without its case here is a warning. */
	switch ((enum eng_task_kind)t->kind) {
	case TASK_UNSHARD:
		return g->shard * l->shard_size + l->unsharded_size;
	case TASK_REDUCE_PARTIAL:
		return g->shard * (l->grad_size + 2 * g->partial_size);
	case TASK_REDUCE:
		/* HSDP adds the all-reduce: R partials read per output shard. */
		return g->world * (l->grad_size + 2 * l->shard_size) +
		       (g->replicate > 1 ? g->world * (2 + g->replicate) * g->partial_size : 0);
	case TASK_STEP:
		/* param and grad read, param written, each state read and written, grad zeroed. */
		return l->shard_size * (4 + 2 * (uint64_t)shd_group_optim_states(&g->optim));
	case TASK_ZERO_GRAD:
		return g->sharded_grads[t->rank].bytes;
	case TASK_SAVE:
	case TASK_SAVE_FINAL:
	case TASK_SAVE_WRITE:
	case TASK_RESTORE:
	case TASK_EXEC_RENEW:
		break;
	}
	/* File I/O, or a copy of a whole shard: always on the pool, never on the loop thread. */
	return UINT64_MAX;
}

/*
 * 1 when the task runs on the loop thread: small enough that the wake-ups
 * of a pool round trip cost more than the loop's pause for it, as the
 * backend says (inline_max_bytes; the host backend's kernels still split a
 * larger one of these across idle workers). A backend that says 0 (a device backend) keeps every
 * call on the pool, whose threads it sets up.
 */
static int task_inline(const struct eng_task *t)
{
	uint64_t max = t->eg->j->e->backend->ops->inline_max_bytes;

	return max && task_bytes(t) <= max && !eng_world_task(t);
}

static void task_exec(struct eng_task *t);

static void task_deliver(struct eng_task *t)
{
	/* Only eng_tasks_stop delivers a restore here: the job ends, and group_shutdown answers the ranks. */
	if (t->kind == TASK_RESTORE)
		return;
	if (t->hooks) {
		t->hooks->delivered(t);
		return;
	}
	for (uint32_t i = 0; i < t->nops; i++)
		eng_complete(t->eg->j, &t->ops[i], t->res ? t->res : t->ops[i].res, t->msg);
	if (t->eg->j->ckpt_armed || t->eg->j->e->cfg.checkpoint_every)
		t->eg->j->e->at_boundary(t->eg->j);
}

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
			/* One whose hooks say so (a checkpoint's snapshot) starts on a thread of its own. */
			if (t->hooks && t->hooks->spawn && !t->hooks->spawn(t))
				return;
			/* One that waits for other nodes gets a thread of its own (world_collective.c). */
			if (!eng_world_task(t) || eng_world_spawn(t))
				shd_pool_submit(eg->j->e->pool, &t->pt);
			return;
		}
		task_exec(t);
		eg->running = NULL;
		task_deliver(t);
		free(t);
	}
}

void eng_group_enqueue(struct eng_group *eg, struct eng_task *t)
{
	if (eg->qtail)
		eg->qtail->next = t;
	else
		eg->qhead = t;
	eg->qtail = t;
	group_kick(eg);
}

/* ------------------------------------------------------------------ */
/* What a task computes (pool thread, or the loop thread inline)       */
/* ------------------------------------------------------------------ */

/*
 * FSDP2's _get_gradient_divide_factors at call time, for a data-parallel
 * size n: the math of the reduce-scatter (over the shard group) and of the
 * all-reduce (over replicas). fp32/bf16 average on each collective
 * (ReduceOp.AVG); fp16 sums, pre-dividing the reduce-scatter's inputs and
 * post-dividing after the last collective.
 */
static void reduce_math(const struct eng_group *eg, uint32_t n, struct shardd_reduce_math *rs,
			struct shardd_reduce_math *ar)
{
	const struct shd_group *g = eg->g;
	double pre, post;

	shardd_divide_factors(n, g->reduce_dtype, &pre, &post);
	*rs = (struct shardd_reduce_math){
		.reduce_dtype = g->reduce_dtype, .pre = 1, .avg = 1, .post = 1
	};
	*ar = *rs;
	if (pre == 0) {
		rs->avg = (float)eng_mesh_shard(eg->j);
		ar->avg = (float)eng_mesh_replicate(eg->j);
		return;
	}
	rs->pre = (float)pre;
	ar->post = (float)post;
}

/*
 * Reduce-scatter of replica u's grads: shard s's output goes to outs[s] (+
 * adds[s] where given), accumulated where accumulate[s].
 */
static int task_reduce_scatter(struct eng_task *t, uint32_t u, const struct shd_shard_view *outs,
			       const struct shd_shard_view *adds, const uint8_t *accumulate,
			       const struct shardd_reduce_math *m)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shd_buf *grads[SHARDD_MAX_WORLD];
	struct shd_reduce_args a = {
		.job = t->eg->j->bj,
		.layout = &g->layout,
		.src = SHD_REDUCE_SRC_GRAD,
		.n = g->shard,
		.grads = grads,
		.outs = outs,
		.adds = adds,
		.accumulate = accumulate,
		.reduce_offsets = g->reduce_offsets,
		.reduce_shard_size = g->reduce_shard_size,
		.math = *m,
		.err = t->why,
		.errlen = sizeof(t->why),
	};

	for (uint32_t k = 0; k < g->shard; k++)
		grads[k] = &g->grads[u * g->shard + k];
	return b->ops->reduce(b, &a);
}

/* HSDP: replica u's reduce-scatter output of every shard added into its partial. */
static int task_partials(struct eng_task *t, uint32_t u, const struct shardd_reduce_math *m)
{
	struct shd_group *g = t->eg->g;
	struct shd_shard_view outs[SHARDD_MAX_WORLD], adds[SHARDD_MAX_WORLD];
	uint8_t assign[SHARDD_MAX_WORLD] = { 0 };
	int ret;

	for (uint32_t s = 0; s < g->shard; s++) {
		uint32_t r = u * g->shard + s;

		outs[s] = (struct shd_shard_view){ &g->partials[r], g->reduce_offsets,
						   g->reduce_dtype };
		/* partial = round(rs + partial): FSDP2 accumulates in the reduce dtype before any all-reduce. */
		adds[s] = g->partial_present[r] ? outs[s] : (struct shd_shard_view){ 0 };
	}
	ret = task_reduce_scatter(t, u, outs, adds, assign, m);
	if (!ret)
		memset(&g->partial_present[u * g->shard], 1, g->shard);
	return ret;
}

static int task_reduce(struct eng_task *t)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shd_shard_view views[SHARDD_MAX_WORLD], outs[SHARDD_MAX_WORLD];
	uint8_t accumulate[SHARDD_MAX_WORLD];
	struct shardd_reduce_math rs, ar;
	int ret = 0;

	if (eng_mesh_replicate(t->eg->j) == 1) {
		/* No replicate dim: one collective, pre- and post-divided (fp16) alike. */
		reduce_math(t->eg, eng_mesh_shard(t->eg->j), &rs, &ar);
		rs.post = ar.post;
		if (eng_world_fsdp(t->eg->j)) {
			ret = eng_world_reduce_scatter(t, &rs);
			if (!ret)
				memset(g->grad_present, 1, g->shard);
			return ret;
		}
		for (uint32_t s = 0; s < g->shard; s++)
			outs[s] = (struct shd_shard_view){ &g->sharded_grads[s], g->shard_offsets,
							   SHARDD_DTYPE_NONE };
		ret = task_reduce_scatter(t, 0, outs, NULL, g->grad_present, &rs);
		if (!ret)
			memset(g->grad_present, 1, g->shard);
		/*
		 * A reduce that failed part way may have assigned some: an absent
		 * grad's bytes stay zero, which task_reduce_step_fused relies on.
		 */
		for (uint32_t s = 0; s < g->shard && ret; s++)
			if (!g->grad_present[s])
				b->ops->zero(b, &g->sharded_grads[s], 0, g->sharded_grads[s].bytes);
		return ret;
	}

	/* HSDP: FSDP2 passes both groups, so n = S * R on every call (R of the whole mesh). */
	reduce_math(t->eg, g->shard * eng_mesh_replicate(t->eg->j), &rs, &ar);
	for (uint32_t u = 0; u < g->replicate && !ret; u++)
		ret = task_partials(t, u, &rs);
	if (t->eg->j->span_nodes > 1) {
		if (!ret)
			ret = eng_world_allreduce(t, &ar);
		/* As below: the partials went into this all-reduce, or are lost with it. */
		memset(g->partial_present, 0, g->world);
		return ret;
	}
	/* The all-reduce of each shard index over its replicate group: every replica gets the sum. */
	for (uint32_t s = 0; s < g->shard && !ret; s++) {
		struct shd_reduce_args a = {
			.job = t->eg->j->bj,
			.layout = &g->layout,
			.src = SHD_REDUCE_SRC_SHARD,
			.n = g->replicate,
			.views = views,
			.shard_rank = s,
			.in_dtype = g->reduce_dtype,
			.outs = outs,
			.accumulate = accumulate,
			.reduce_offsets = g->reduce_offsets,
			.reduce_shard_size = g->reduce_shard_size,
			.math = ar,
			.err = t->why,
			.errlen = sizeof(t->why),
		};

		for (uint32_t u = 0; u < g->replicate; u++) {
			uint32_t r = u * g->shard + s;

			views[u] = (struct shd_shard_view){ &g->partials[r], g->reduce_offsets,
							    g->reduce_dtype };
			outs[u] = (struct shd_shard_view){ &g->sharded_grads[r], g->shard_offsets,
							   SHARDD_DTYPE_NONE };
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
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shd_buf *shards[SHARDD_MAX_WORLD], *unsharded[SHARDD_MAX_WORLD];
	struct shd_unshard_args a = {
		.job = t->eg->j->bj,
		.layout = &g->layout,
		.nshards = g->shard,
		.shards = shards,
		.unsharded = unsharded,
		.err = t->why,
		.errlen = sizeof(t->why),
	};

	if (eng_world_fsdp(t->eg->j))
		return eng_world_unshard(t);
	for (uint32_t s = 0; s < g->shard; s++) {
		uint32_t r = t->replica * g->shard + s;

		shards[s] = &g->shards[r];
		unsharded[s] = shd_group_unsharded(g, r);
	}
	return b->ops->unshard(b, &a);
}

/*
 * The backend's step arguments for `op`'s rank as plan `p` (ENG_STEP_APPLY)
 * says: its shard, sharded grad and states, the group's hyperparameters.
 */
static void task_step_args(struct eng_task *t, const struct eng_op *op,
			   const struct eng_step_plan *p, int *skipped, struct shd_step_args *a)
{
	struct shd_group *g = t->eg->g;
	const struct shardd_optim_config *o = &g->optim;
	uint32_t r = op->rank;

	*a = (struct shd_step_args){
		.layout = &g->layout,
		.shard_rank = shd_group_shard_rank(g, r),
		.kind = o->kind,
		.shard = &g->shards[r],
		.grad = &g->sharded_grads[r],
		.skip_nonfinite = p->skip_nonfinite,
		.skipped = skipped,
		.err = t->why,
		.errlen = sizeof(t->why),
	};
	for (uint32_t k = 0; k < shd_group_optim_states(o); k++)
		a->state[k] = &g->optim_state[k][r];
	if (o->kind == SHARDD_OPTIM_SGD)
		a->sgd = (struct shardd_sgd){
			.step = p->update,
			.lr = p->lr,
			.momentum = o->momentum,
			.dampening = o->dampening,
			.weight_decay = o->weight_decay,
			.nesterov = !!(o->flags & SHARDD_OPTIM_NESTEROV),
			.maximize = !!(o->flags & SHARDD_OPTIM_MAXIMIZE),
			.grad_scale = p->grad_scale,
		};
	else
		a->adamw = (struct shardd_adamw){
			.step = p->update,
			.lr = p->lr,
			.beta1 = o->beta1,
			.beta2 = o->beta2,
			.eps = o->eps,
			.weight_decay = o->weight_decay,
			.amsgrad = !!(o->flags & SHARDD_OPTIM_AMSGRAD),
			.maximize = !!(o->flags & SHARDD_OPTIM_MAXIMIZE),
			.grad_scale = p->grad_scale,
		};
}

/*
 * The optimizer step of `op` (a STEP, or a REDUCE with SHARDD_REDUCE_STEP)
 * on its rank's shard, as the step's policy plans it (step.h): the kernel
 * through the backend, the sharded grad cleared, the record left. Returns
 * 0 with op->res the outcome, the backend's error, or an error with
 * t->msg written.
 */
static int task_step(struct eng_task *t, struct eng_op *op)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	uint32_t r = op->rank;
	struct eng_step_plan p;
	struct shd_step_args a;
	int skipped = 0, ret;

	ret = eng_step_plan(g, op, shd_group_grad_present(g, b, r), &p, t->msg, sizeof(t->msg));
	if (ret)
		return ret;
	if (p.verdict == ENG_STEP_ALREADY) {
		op->res = SHARDD_STEP_ALREADY;
		return 0;
	}
	if (p.verdict == ENG_STEP_APPLY) {
		task_step_args(t, op, &p, &skipped, &a);
		ret = b->ops->step(b, &a);
		if (ret)
			return ret;
	}
	/* Applied, or skipped for the job: the grad is cleared either way. */
	ret = b->ops->zero(b, &g->sharded_grads[r], 0, g->sharded_grads[r].bytes);
	if (ret)
		return ret;
	shd_group_grad_clear(g, b, r);
	op->res = eng_step_record(g, r, op->sqe.step, p.verdict == ENG_STEP_APPLY && !skipped);
	return 0;
}

/*
 * A REDUCE with SHARDD_REDUCE_STEP as one pass (the backend's reduce_step):
 * the sum of each block of the ranks' grads goes straight into the
 * update, so the sharded grads are neither written nor read back nor
 * cleared: 12 of the 44 bytes per element (fp32, 2 ranks, AdamW) that
 * reduce + step move. Only where that is exactly reduce + step: one
 * collective on this node (no replicate dim, no other nodes), every rank
 * of the shard group in the task, each rank's grad absent (the reduce
 * would assign it; an absent grad's bytes are zero, as the separate
 * step's clearing leaves them) and its step applying (eng_step_plan_fused).
 * Returns 1 with *ret the result when it ran, 0 when the caller runs
 * reduce, then the steps.
 */
static int task_reduce_step_fused(struct eng_task *t, int *ret)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shd_shard_view outs[SHARDD_MAX_WORLD];
	struct shd_buf *grads[SHARDD_MAX_WORLD];
	uint8_t assign[SHARDD_MAX_WORLD] = { 0 };
	struct shardd_reduce_math rs, ar;
	/* Per shard rank, on the heap: up to 1024 of them, ~300 bytes of args each. */
	struct fused {
		struct eng_op *op;
		int skipped;
	} * f;
	struct shd_step_args *steps;
	uint32_t n = g->shard;

	if (!b->ops->reduce_step || eng_mesh_replicate(t->eg->j) != 1 || eng_world_fsdp(t->eg->j) ||
	    t->nops != n)
		return 0;
	f = calloc(n, sizeof(*f));
	steps = calloc(n, sizeof(*steps));
	/* Out of memory: the separate path still runs. */
	if (!f || !steps)
		goto fallback;
	for (uint32_t i = 0; i < n; i++) {
		struct eng_op *op = &t->ops[i];
		uint32_t s = shd_group_shard_rank(g, op->rank);
		struct eng_step_plan p;

		if (s >= n || f[s].op || !eng_step_plan_fused(g, op, &p))
			goto fallback;
		f[s].op = op;
		task_step_args(t, op, &p, &f[s].skipped, &steps[s]);
	}
	reduce_math(t->eg, eng_mesh_shard(t->eg->j), &rs, &ar);
	rs.post = ar.post;
	for (uint32_t s = 0; s < n; s++) {
		grads[s] = &g->grads[s];
		outs[s] = (struct shd_shard_view){ &g->sharded_grads[s], g->shard_offsets,
						   SHARDD_DTYPE_NONE };
	}
	*ret = b->ops->reduce_step(b,
				   &(struct shd_reduce_args){
					   .job = t->eg->j->bj,
					   .layout = &g->layout,
					   .src = SHD_REDUCE_SRC_GRAD,
					   .n = n,
					   .grads = grads,
					   .outs = outs,
					   .accumulate = assign,
					   .reduce_offsets = g->reduce_offsets,
					   .reduce_shard_size = g->reduce_shard_size,
					   .math = rs,
					   .err = t->why,
					   .errlen = sizeof(t->why),
				   },
				   steps);
	for (uint32_t s = 0; s < n && !*ret; s++)
		f[s].op->res = eng_step_record(g, f[s].op->rank, f[s].op->sqe.step, !f[s].skipped);
	free(f);
	free(steps);
	return 1;

fallback:
	free(f);
	free(steps);
	return 0;
}

/* After a reduce: the steps its ranks asked for with SHARDD_REDUCE_STEP (the flag is the same on all). */
static int task_reduce_steps(struct eng_task *t)
{
	int ret = 0;

	for (uint32_t i = 0; i < t->nops && !ret; i++)
		if (eng_step_asked(&t->ops[i].sqe))
			ret = task_step(t, &t->ops[i]);
	return ret;
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
static uint32_t task_outputs(const struct eng_task *t, const struct shd_buf **bufs)
{
	const struct shd_group *g = t->eg->g;
	uint32_t n = 0;

	switch ((enum eng_task_kind)t->kind) {
	case TASK_UNSHARD:
		for (uint32_t s = 0; s < g->shard; s++)
			bufs[n++] = shd_group_unsharded(g, t->replica * g->shard + s);
		break;
	case TASK_REDUCE_PARTIAL:
		for (uint32_t s = 0; s < g->shard; s++)
			bufs[n++] = &g->partials[t->replica * g->shard + s];
		break;
	case TASK_REDUCE:
		for (uint32_t r = 0; r < g->world; r++)
			bufs[n++] = &g->sharded_grads[r];
		break;
	case TASK_ZERO_GRAD:
	case TASK_STEP:
		bufs[n++] = &g->sharded_grads[t->rank];
		break;
	case TASK_SAVE:
	case TASK_SAVE_FINAL:
	case TASK_SAVE_WRITE:
	case TASK_RESTORE:
	case TASK_EXEC_RENEW:
		/* Their hooks run them (task_exec), and they write files or new buffers, not these. */
		break;
	}
	return n;
}

/*
 * What a task of task.c's own kinds computes: 0, the backend's error (with
 * t->why), or an error with t->msg written (an exchange among nodes that
 * failed, world_collective.c; a step refused).
 */
static int task_compute(struct eng_task *t)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	struct shardd_reduce_math rs, ar;
	int ret;

	/* On the enum: a kind added without its case here is a warning. */
	switch ((enum eng_task_kind)t->kind) {
	case TASK_UNSHARD:
		return task_unshard(t);
	case TASK_REDUCE_PARTIAL:
		reduce_math(t->eg, g->shard * eng_mesh_replicate(t->eg->j), &rs, &ar);
		return task_partials(t, t->replica, &rs);
	case TASK_REDUCE:
		if (task_reduce_step_fused(t, &ret))
			return ret;
		ret = task_reduce(t);
		return ret ? ret : task_reduce_steps(t);
	case TASK_STEP:
		return task_step(t, &t->ops[0]);
	case TASK_ZERO_GRAD:
		ret = b->ops->zero(b, &g->sharded_grads[t->rank], 0,
				   g->sharded_grads[t->rank].bytes);
		if (!ret)
			shd_group_grad_clear(g, b, t->rank);
		return ret;
	case TASK_SAVE:
	case TASK_SAVE_FINAL:
	case TASK_SAVE_WRITE:
	case TASK_RESTORE:
	case TASK_EXEC_RENEW:
		break;
	}
	/* Those kinds always carry the hooks that compute them (task_exec runs those instead). */
	abort();
}

/* The arithmetic of one task, on a pool thread or (task_inline) the loop thread; sets res and msg. */
static void task_exec(struct eng_task *t)
{
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	int ret;

	if (t->hooks) {
		t->hooks->exec(t);
		return;
	}
	ret = task_compute(t);
	/* A failure that wrote its own message is the task's as written; a backend's is worded below. */
	if (ret < 0 && t->msg[0]) {
		t->res = ret;
		return;
	}
	/* A completion without a fence promises the results are in memory. */
	if (!ret && b->ops->sync && !task_fenced(t)) {
		const struct shd_buf *outs[SHARDD_MAX_WORLD];

		ret = b->ops->sync(b, outs, task_outputs(t, outs), t->why, sizeof(t->why));
	}
	t->res = ret;
	if (ret)
		eng_fmt(t->msg, sizeof(t->msg),
			"shardd: %s(group '%s', step %llu): the %s backend failed: %s",
			shd_op_info(t->ops[0].sqe.op)->name, g->name,
			(unsigned long long)t->ops[0].sqe.step, b->ops->name,
			t->why[0]              ? t->why
			: ret > -SHARDD_E_BASE ? strerror(-ret)
					       : "backend error");
}

/* ------------------------------------------------------------------ */
/* The pool's round trip                                               */
/* ------------------------------------------------------------------ */

/* Pool thread: run one task, then hand it to the loop. */
static void task_run(struct shd_pool_task *pt)
{
	struct eng_task *t = (struct eng_task *)pt;
	struct shd_engine *e = t->eg->j->e;
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

struct eng_task *eng_tasks_take_finished(struct shd_engine *e)
{
	struct eng_task *t;
	uint64_t v;
	ssize_t r;

	/* Reset the counter before taking the list: a task finishing later writes again. */
	r = read(e->efd, &v, sizeof(v));
	(void)r;
	pthread_mutex_lock(&e->lock);
	t = e->fin_head;
	e->fin_head = e->fin_tail = NULL;
	pthread_mutex_unlock(&e->lock);
	return t;
}

void eng_task_finished(struct eng_task *t)
{
	struct eng_group *eg = t->eg;

	/* Not its group's running task: a checkpoint's write off the group's queue. */
	if (t->kind == TASK_SAVE_WRITE) {
		t->hooks->delivered(t);
		free(t);
		return;
	}
	eg->running = NULL;
	/* A restore's end may fail the registration and free the group: nothing runs after it. */
	if (t->kind == TASK_RESTORE) {
		t->hooks->delivered(t);
		free(t);
		return;
	}
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

void eng_task_wait_finished(struct shd_engine *e, struct eng_task *t)
{
	struct eng_task **pp;

	pthread_mutex_lock(&e->lock);
	while (!t->finished)
		pthread_cond_wait(&e->finished, &e->lock);
	e->fin_tail = NULL;
	for (pp = &e->fin_head; *pp;) {
		if (*pp == t) {
			*pp = t->next;
		} else {
			e->fin_tail = *pp;
			pp = &(*pp)->next;
		}
	}
	pthread_mutex_unlock(&e->lock);
}

/*
 * Wait for the group's running task, take it off the finished list and
 * deliver it; or, when it waits for other nodes and has not finished, fail
 * its ops with (res, msg) and leave it running (returns 1): the job ends
 * now, not when the other nodes answer or the collective timeout passes.
 */
static int group_wait_running(struct eng_group *eg, int res, const char *msg)
{
	struct shd_engine *e = eg->j->e;
	struct eng_task *t = eg->running;
	int running;

	if (!t)
		return 0;
	pthread_mutex_lock(&e->lock);
	running = !t->finished;
	pthread_mutex_unlock(&e->lock);
	if (running && eng_world_task(t)) {
		t->abandoned = 1;
		for (uint32_t i = 0; i < t->nops; i++)
			eng_complete(eg->j, &t->ops[i], res, msg);
		return 1;
	}
	eng_task_wait_finished(e, t);
	eg->running = NULL;
	task_deliver(t);
	free(t);
	return 0;
}

int eng_tasks_stop(struct eng_group *eg, int res, const char *msg)
{
	int left = group_wait_running(eg, res, msg);

	while (eg->qhead) {
		struct eng_task *t = eg->qhead;

		eg->qhead = t->next;
		t->res = res;
		snprintf(t->msg, sizeof(t->msg), "%s", msg);
		task_deliver(t);
		free(t);
	}
	eg->qtail = NULL;
	return left;
}

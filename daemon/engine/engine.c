/* SPDX-License-Identifier: MIT */
/*
 * The op engine (engine.h): the state machine of every group of every job.
 * This file holds the engine and its jobs: create/destroy, the job's life,
 * submit and dispatch of ring entries, per-rank order, departures and the
 * cron; engine_int.h lists the files that hold the rest.
 *
 * Loop thread: registration and collective rendezvous, holds, validation,
 * group task queues, delivery of results, and the arithmetic of small
 * tasks (task.c). Pool threads: the other tasks (the arithmetic of an op,
 * through the backend table). A group runs one task at a time, so ops on
 * one group run in order; any number run across groups.
 *
 *   register --(all ranks, same spec)--> complete --+--> unshard rendezvous[replica] --> task
 *                                                   +--> reduce rendezvous[replica] / all-reduce rendezvous --> task
 *                                                   +--> zero_grad --> task;  reshard: at once
 *
 *   registry.c        registration                 collective.c  the rendezvous
 *   task.c            the task and where it runs   engine.c      the rest
 *   step.c            the step's exactly-once policy
 *   op_table.c        what an op is (its scope: the engine is given those of group scope)
 *   delivery.c        messages and delivery, below all of them
 */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "backend_factory.h"
#include "engine_int.h"
#include "log.h"
#include "step.h"

#define ENGINE_TIMEOUT_DEFAULT_MS 30000

/* ------------------------------------------------------------------ */
/* Engine                                                              */
/* ------------------------------------------------------------------ */

int shd_engine_create(const struct shd_engine_config *cfg, struct shd_engine **out)
{
	struct shd_engine *e;
	int ret;

	if (!cfg->complete || !cfg->reply)
		return -EINVAL;
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->cfg = *cfg;
	e->at_boundary = eng_ckpt_try_armed;
	e->timeout_ns = (uint64_t)(cfg->collective_timeout_ms ? cfg->collective_timeout_ms
							      : ENGINE_TIMEOUT_DEFAULT_MS) *
			1000000u;
	pthread_mutex_init(&e->lock, NULL);
	pthread_cond_init(&e->finished, NULL);
	e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (e->efd < 0) {
		ret = -errno;
		goto err_free;
	}
	ret = shd_pool_create(cfg->workers, &e->pool);
	if (ret)
		goto err_efd;
	ret = shd_backend_create(cfg->backend, cfg->cuda_export, e->timeout_ns, e->pool,
				 &e->backend);
	if (ret)
		goto err_pool;
	*out = e;
	return 0;

err_pool:
	shd_pool_destroy(e->pool);
err_efd:
	close(e->efd);
err_free:
	pthread_cond_destroy(&e->finished);
	pthread_mutex_destroy(&e->lock);
	free(e);
	/* A backend error was logged in the backend's own words. */
	if (ret != -SHARDD_E_BACKEND)
		shd_log_error("shardd: cannot start the op engine: %s", strerror(-ret));
	return ret;
}

void shd_engine_destroy(struct shd_engine *e)
{
	if (!e)
		return;
	while (e->jobs)
		shd_engine_job_destroy(e->jobs);
	eng_world_threads_wait(e);
	/* The groups of ended jobs whose task across nodes still ran go with it (job_reap). */
	shd_engine_drain(e);
	eng_world_orphans_free(e);
	shd_pool_destroy(e->pool);
	e->backend->ops->destroy(e->backend);
	close(e->efd);
	pthread_cond_destroy(&e->finished);
	pthread_mutex_destroy(&e->lock);
	free(e);
}

struct shd_backend_ctx *shd_engine_backend(struct shd_engine *e)
{
	return e->backend;
}

int shd_engine_event_fd(struct shd_engine *e)
{
	return e->efd;
}

/* ------------------------------------------------------------------ */
/* Jobs                                                                */
/* ------------------------------------------------------------------ */

int shd_engine_job_create(struct shd_engine *e, void *job_ctx, const char *job_name,
			  uint32_t replicate, uint32_t shard, struct shd_engine_job **out)
{
	struct shd_backend_ctx *b = e->backend;
	struct shd_engine_job *j;
	int ret;

	if (replicate == 0 || shard == 0 || replicate > SHARDD_MAX_WORLD ||
	    shard > SHARDD_MAX_WORLD / replicate) {
		shd_log_error("shardd: job '%s': mesh %u x %u is outside 1..%d ranks", job_name,
			      replicate, shard, SHARDD_MAX_WORLD);
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

static void deferred_fail(struct eng_group *eg, uint32_t rank, int res, const char *msg);

/*
 * `why`: how the job ended ("was ended by ..."), for every failure; NULL:
 * "ended". 1 when the group's task across nodes still runs (eng_tasks_stop):
 * the group lingers until it ends.
 */
static int group_shutdown(struct eng_group *eg, const char *why)
{
	struct shd_engine_job *j = eg->j;
	char msg[ENGINE_MSG_MAX];
	int lingers;

	eng_fmt(msg, sizeof(msg), "shardd: job '%s' %s before this op on group '%s' ran", j->name,
		why ? why : "ended", eg->g->name);
	if (!eg->complete) {
		/* A restore still reading into the buffers ends before they are freed. */
		eng_tasks_stop(eg, -SHARDD_E_SHUTDOWN, msg);
		for (uint32_t r = 0; r < j->world; r++)
			if (shd_rdv_has_arrived(&eg->reg, r))
				eng_reply_err(j, r, eg->regs[r].token, eg->regs[r].seq,
					      -SHARDD_E_SHUTDOWN, msg);
		return 0;
	}
	lingers = eng_tasks_stop(eg, -SHARDD_E_SHUTDOWN, msg);
	eng_colls_fail(eg, -SHARDD_E_SHUTDOWN, msg);
	for (uint32_t r = 0; r < j->world; r++)
		deferred_fail(eg, r, -SHARDD_E_SHUTDOWN, msg);
	return lingers;
}

/* The job's last state, once no group of it is left. */
static void job_free(struct shd_engine_job *j)
{
	/* After the groups: their buffers are freed, so no collective of the job is queued any more. */
	if (j->bj)
		j->e->backend->ops->job_close(j->e->backend, j->bj);
	free(j->groups);
	free(j->devices);
	free(j->gone);
	free(j);
}

/* The group of an ended job whose task across nodes ran on; the job's last state with its last such group. */
static void job_reap(struct eng_group *eg)
{
	struct shd_engine_job *j = eg->j;

	eng_group_free(eg);
	if (--j->lingering == 0)
		job_free(j);
}

void shd_engine_drain(struct shd_engine *e)
{
	struct eng_task *t = eng_tasks_take_finished(e), *next;

	for (; t; t = next) {
		next = t->next;
		/* Its job ended while it ran: nothing to deliver, and its group goes now. */
		if (t->abandoned) {
			struct eng_group *eg = t->eg;

			eg->running = NULL;
			free(t);
			job_reap(eg);
			continue;
		}
		eng_task_finished(t);
	}
}

void shd_engine_job_destroy(struct shd_engine_job *j)
{
	shd_engine_job_end(j, NULL);
}

void shd_engine_job_end(struct shd_engine_job *j, const char *why)
{
	struct shd_engine *e;

	if (!j)
		return;
	e = j->e;
	j->ending = 1;
	eng_ckpt_job_wait(j);
	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];

		if (!eg)
			continue;
		if (group_shutdown(eg, why))
			j->lingering++;
		else
			eng_group_free(eg);
	}
	eng_ckpt_job_end(j, why);
	if (j->prev)
		j->prev->next = j->next;
	else
		e->jobs = j->next;
	if (j->next)
		j->next->prev = j->prev;
	/* Its caller's context goes now; a lingering group only needs the job's own state. */
	j->ctx = NULL;
	if (!j->lingering)
		job_free(j);
}

void shd_engine_rank_attached(struct shd_engine_job *j, uint32_t rank, int32_t device)
{
	if (rank >= j->world)
		return;
	j->devices[rank] = device;
	j->gone[rank] = 0;
	for (uint32_t i = 0; i < j->ngroups; i++)
		if (j->groups[i] && j->groups[i]->complete)
			eng_exec_rank_attached(j->groups[i], rank);
}

/* The group with this id (a sqe's or an admin request's: any value), or NULL. */
static struct eng_group *group_by_id(const struct shd_engine_job *j, uint32_t id)
{
	return id >= 1 && id <= j->ngroups ? j->groups[id - 1] : NULL;
}

/* ------------------------------------------------------------------ */
/* Per-rank order                                                      */
/* ------------------------------------------------------------------ */

/*
 * 1 when `op`, not a rendezvous itself (zero_grad, reshard, step), must not
 * overtake `rank`'s collective still gathering.
 */
static int op_must_wait(const struct eng_group *eg, uint32_t rank, uint32_t op)
{
	return !shd_op_info(op)->rendezvous && eng_coll_rank_waits(eg, rank);
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
		eng_complete(eg->j, &d->op, res, msg);
		free(d);
	}
	eg->dtail[rank] = NULL;
}

/* ------------------------------------------------------------------ */
/* Data plane                                                          */
/* ------------------------------------------------------------------ */

static void submit_reshard(struct eng_group *eg, const struct eng_op *op)
{
	char msg[ENGINE_MSG_MAX];

	if (!eg->g->holds[op->rank]) {
		eng_fmt(msg, sizeof(msg),
			"shardd: rank %u has no unsharded copy of group '%s' to reshard",
			eng_rank_shown(eg->j, op->rank), eg->g->name);
		eng_complete(eg->j, op, -SHARDD_E_STATE, msg);
		return;
	}
	eg->g->holds[op->rank] = 0;
	eng_complete(eg->j, op, 0, NULL);
}

static void submit_zero_grad(struct eng_group *eg, const struct eng_op *op)
{
	struct eng_task *t = eng_task_new(eg, TASK_ZERO_GRAD, 1);
	char msg[ENGINE_MSG_MAX];

	if (!t) {
		eng_fmt(msg, sizeof(msg),
			"shardd: zero_grad(group '%s'): the daemon is out of memory", eg->g->name);
		eng_complete(eg->j, op, -SHARDD_E_NOMEM, msg);
		return;
	}
	t->rank = op->rank;
	t->ops[0] = *op;
	eng_group_enqueue(eg, t);
}

static void submit_step(struct eng_group *eg, const struct eng_op *in)
{
	struct eng_task *t;
	struct eng_op one = *in, *op = &one;
	char msg[ENGINE_MSG_MAX];
	int ret = eng_step_admit(eg, op, msg, sizeof(msg));

	if (ret) {
		eng_complete(eg->j, op, ret, msg);
		return;
	}
	t = eng_task_new(eg, TASK_STEP, 1);
	if (!t) {
		eng_fmt(msg, sizeof(msg), "shardd: step(group '%s'): the daemon is out of memory",
			eg->g->name);
		eng_complete(eg->j, op, -SHARDD_E_NOMEM, msg);
		return;
	}
	t->rank = op->rank;
	t->ops[0] = *op;
	eng_group_enqueue(eg, t);
}

/* A reduce's arrival at its rendezvous; one that also asks for a step is admitted first. */
static void submit_reduce(struct eng_group *eg, const struct eng_op *in)
{
	struct eng_op one = *in;
	char msg[ENGINE_MSG_MAX];
	int ret = eng_step_asked(&one.sqe) ? eng_step_admit(eg, &one, msg, sizeof(msg)) : 0;

	if (ret) {
		eng_complete(eg->j, &one, ret, msg);
		return;
	}
	eng_coll_reduce(eg, &one);
}

/*
 * A rank-executed group (exec.c): its ranks run unshard, reduce and reshard
 * themselves; what reaches the daemon is a reduce's step
 * (SHARDD_REDUCE_STEP, after the rank's reduce), and zero_grad and step.
 * 1 when the op was handled here.
 */
static int dispatch_ranks(struct eng_group *eg, const struct eng_op *op)
{
	char msg[ENGINE_MSG_MAX];

	if (eg->g->exec != SHARDD_EXEC_RANKS)
		return 0;
	if (op->sqe.op == SHARDD_OP_REDUCE && eng_step_asked(&op->sqe)) {
		submit_step(eg, op);
		return 1;
	}
	if (op->sqe.op != SHARDD_OP_UNSHARD && op->sqe.op != SHARDD_OP_REDUCE &&
	    op->sqe.op != SHARDD_OP_RESHARD)
		return 0;
	eng_fmt(msg, sizeof(msg),
		"shardd: %s(group '%s'): the group is rank-executed (%s): each rank runs its "
		"%s itself (libshardd and the Python client do); a client that cannot must "
		"register the group exec=daemon",
		shd_op_info(op->sqe.op)->name, eg->g->name, eg->g->exec_why,
		shd_op_info(op->sqe.op)->name);
	eng_complete(eg->j, op, -SHARDD_E_STATE, msg);
	return 1;
}

static void dispatch(struct eng_group *eg, const struct eng_op *op)
{
	if (dispatch_ranks(eg, op))
		return;
	switch (op->sqe.op) {
	case SHARDD_OP_UNSHARD:
		eng_coll_unshard(eg, op);
		break;
	case SHARDD_OP_REDUCE:
		submit_reduce(eg, op);
		break;
	case SHARDD_OP_RESHARD:
		submit_reshard(eg, op);
		break;
	case SHARDD_OP_ZERO_GRAD:
		submit_zero_grad(eg, op);
		break;
	case SHARDD_OP_STEP:
		submit_step(eg, op);
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

void shd_engine_submit(struct shd_engine_job *j, uint32_t rank, uint64_t token,
		       const struct shardd_sqe *sqe)
{
	struct eng_op op = { .rank = rank, .token = token, .sqe = *sqe };
	const struct shd_op_info *info = shd_op_info(sqe->op);
	const char *name;
	struct eng_group *eg;
	uint32_t unknown;
	char msg[ENGINE_MSG_MAX];

	/* The ring service checked the entry against the op table and routed it here by its scope. */
	assert(info && info->scope == SHD_OP_SCOPE_GROUP);
	name = info->name;
	if (rank >= j->world) {
		eng_fmt(msg, sizeof(msg), "shardd: rank %u is outside job '%s' of %u ranks", rank,
			j->name, j->world);
		eng_complete(j, &op, -SHARDD_E_INVALID, msg);
		return;
	}
	eg = group_by_id(j, sqe->group);
	if (!eg || !eg->complete) {
		eng_fmt(msg, sizeof(msg),
			"shardd: %s: group id %u is not a registered group of job '%s'", name,
			sqe->group, j->name);
		eng_complete(j, &op, -SHARDD_E_NOGROUP, msg);
		return;
	}
	unknown = sqe->flags & ~info->flags;
	if (unknown) {
		eng_fmt(msg, sizeof(msg),
			"shardd: %s(group '%s'): flags = 0x%x has unknown bits 0x%x", name,
			eg->g->name, sqe->flags, unknown);
		eng_complete(j, &op, -SHARDD_E_INVALID, msg);
		return;
	}
	/* Kept back: a zero_grad or reshard behind its rank's collective, and any op behind a kept one. */
	if (eg->dhead[rank] || op_must_wait(eg, rank, sqe->op)) {
		if (deferred_push(eg, &op)) {
			eng_fmt(msg, sizeof(msg),
				"shardd: %s(group '%s'): the daemon is out of memory", name,
				eg->g->name);
			eng_complete(j, &op, -SHARDD_E_NOMEM, msg);
		}
		return;
	}
	dispatch(eg, &op);
	group_flush(eg);
}

/* ------------------------------------------------------------------ */
/* Failures: dead ranks, timeouts                                      */
/* ------------------------------------------------------------------ */

void shd_engine_rank_gone(struct shd_engine_job *j, uint32_t rank, uint64_t token)
{
	char msg[ENGINE_MSG_MAX];

	if (rank >= j->world)
		return;
	j->gone[rank] = 1;
	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];

		if (!eg)
			continue;
		if (!eg->complete) {
			eng_reg_rank_gone(eg, rank, token);
			continue;
		}
		eg->g->holds[rank] = 0;
		eng_coll_rank_gone(eg, rank, token);
		eng_exec_rank_gone(eg, rank);
		eng_fmt(msg, sizeof(msg),
			"shardd: rank %u left (its client is gone) before this op on group '%s' ran",
			eng_rank_shown(j, rank), eg->g->name);
		deferred_fail(eg, rank, -SHARDD_E_PEER_DIED, msg);
		group_flush(eg);
	}
}

void shd_engine_cron(struct shd_engine *e, uint64_t now_ns)
{
	for (struct shd_engine_job *j = e->jobs; j; j = j->next) {
		for (uint32_t i = 0; i < j->ngroups; i++) {
			struct eng_group *eg = j->groups[i];

			if (!eg)
				continue;
			if (!eg->complete) {
				eng_reg_cron(eg, now_ns);
				continue;
			}
			eng_coll_cron(eg, now_ns);
			group_flush(eg);
		}
	}
}

/* ------------------------------------------------------------------ */
/* Introspection                                                       */
/* ------------------------------------------------------------------ */

uint64_t shd_engine_memory_committed(const struct shd_engine *e)
{
	return e->mem_committed;
}

uint64_t shd_engine_job_memory_committed(const struct shd_engine_job *j)
{
	return j->mem_committed;
}

uint32_t shd_engine_job_ngroups(const struct shd_engine_job *j)
{
	return j->ngroups;
}

const struct shd_group *shd_engine_job_group(const struct shd_engine_job *j, uint32_t id)
{
	const struct eng_group *eg = group_by_id(j, id);

	return eg ? eg->g : NULL;
}

const struct shd_group *shd_engine_job_group_named(const struct shd_engine_job *j, const char *name)
{
	const struct eng_group *eg = eng_group_by_name(j, name);

	return eg ? eg->g : NULL;
}

int shd_engine_group_complete(const struct shd_engine_job *j, uint32_t id)
{
	const struct eng_group *eg = group_by_id(j, id);

	return eg && eg->complete;
}

int shd_engine_group_pending(const struct shd_engine_job *j, uint32_t id, uint32_t i, uint32_t *op,
			     const struct shd_rdv **rdv)
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
					   : k % 2               ? &eg->rs[k / 2]
								 : &eg->unshard[k / 2];

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

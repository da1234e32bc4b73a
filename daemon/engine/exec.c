/* SPDX-License-Identifier: MIT */
/*
 * Rank-executed groups (engine_int.h; DESIGN.md "Who moves the bytes",
 * PROTOCOL.md "Rank-executed groups"): each rank runs its group's unshard,
 * reduce and reshard in its own process, on the job's buffers. The daemon
 * keeps the memory, the optimizer step, the checkpoints and liveness:
 *
 * - at registration it picks the executor (eng_exec_choose) and, for
 *   RANKS, gives every rank its own unsharded copy and a slot after its
 *   grad buffer, and the group a sync page (eng_exec_init);
 * - a rank that has mapped its GROUP reply asks EXEC_MAP for itself: its
 *   flat shard and grad buffer are sealed against every new writable
 *   mapping and published (gen), and from then on its peers get them
 *   read-only through EXEC_MAP (eng_exec_map);
 * - a rank that leaves is marked gone: ops that need it and that it had not
 *   reached fail, naming it (eng_exec_rank_gone); when it attaches again a
 *   new epoch begins, in which every rank numbers its ops from 1 again
 *   (eng_exec_rank_attached); when it opens the group again, its
 *   sealed buffers are renewed first: fresh memfds (the shard's contents
 *   copied) that it can map writable again (eng_exec_renew, a
 *   TASK_EXEC_RENEW in the group's queue, which the OPEN_GROUP reply waits
 *   for). The client that sealed them, opening the group a second time,
 *   gets them sealed: that handle reads, the first one runs the ops.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_int.h"
#include "log.h"
#include "memlimit.h"

/* Why the group cannot be rank-executed, or NULL when it can. */
static const char *exec_obstacle(const struct eng_group *eg)
{
	const struct shd_engine_job *j = eg->j;
	const struct shd_backend_ops *ops = j->e->backend->ops;

	if (!ops->seal_readonly || !ops->host_map)
		return "the backend's buffers are not host memory it can seal for the ranks (the "
		       "host backend's are)";
	if (j->span_nodes > 1)
		return "the job spans nodes";
	if (eng_mesh_replicate(j) > 1)
		return "HSDP (a replicate dim) runs daemon-executed only";
	return NULL;
}

int eng_exec_choose(struct eng_group *eg, uint32_t asked, char *err, size_t errlen)
{
	struct shd_group *g = eg->g;
	const char *no = exec_obstacle(eg);
	uint64_t max = eg->j->e->cfg.rank_exec_max;
	char size[32], limit[32];

	shd_memlimit_str(g->layout.unsharded_size, size, sizeof(size));
	shd_memlimit_str(max, limit, sizeof(limit));
	if (asked == SHARDD_EXEC_RANKS && no) {
		eng_fmt(err, errlen,
			"register group '%s': exec = ranks, but %s; register it exec = daemon or auto",
			g->name, no);
		return -SHARDD_E_INVALID;
	}
	if (asked == SHARDD_EXEC_RANKS) {
		g->exec = SHARDD_EXEC_RANKS;
		eng_fmt(g->exec_why, sizeof(g->exec_why), "registered exec=ranks");
	} else if (asked == SHARDD_EXEC_DAEMON) {
		g->exec = SHARDD_EXEC_DAEMON;
		eng_fmt(g->exec_why, sizeof(g->exec_why), "registered exec=daemon");
	} else if (no) {
		g->exec = SHARDD_EXEC_DAEMON;
		eng_fmt(g->exec_why, sizeof(g->exec_why), "auto: %s", no);
	} else if (g->layout.unsharded_size <= max) {
		g->exec = SHARDD_EXEC_RANKS;
		eng_fmt(g->exec_why, sizeof(g->exec_why),
			"auto: unsharded %s <= --rank-exec-max %s", size, limit);
	} else {
		g->exec = SHARDD_EXEC_DAEMON;
		eng_fmt(g->exec_why, sizeof(g->exec_why), "auto: unsharded %s > --rank-exec-max %s",
			size, limit);
	}
	return 0;
}

/* The daemon's own view of rank r's slot (exec RANKS, buffers allocated). */
static struct shardd_exec_slot *exec_slot(const struct eng_group *eg, uint32_t r)
{
	return shd_group_exec_slot(eg->g, eg->j->e->backend, r);
}

static struct shardd_exec_sync *exec_sync(const struct eng_group *eg)
{
	struct shd_backend_ctx *b = eg->j->e->backend;

	return b->ops->host_map(b, &eg->g->sync);
}

void eng_exec_init(struct eng_group *eg)
{
	struct shardd_exec_sync *s;

	if (eg->g->exec != SHARDD_EXEC_RANKS)
		return;
	s = exec_sync(eg);
	s->world = eg->g->world;
	s->group_id = eg->g->id;
	s->version = SHARDD_EXEC_VERSION;
	s->epoch = 1;
	shardd_store_release(&s->magic, SHARDD_EXEC_MAGIC);
}

int shd_engine_exec_rank(const struct shd_engine_job *j, uint32_t id, uint32_t rank,
			 struct shd_engine_exec_rank *out)
{
	const struct eng_group *eg = id >= 1 && id <= j->ngroups ? j->groups[id - 1] : NULL;
	const struct shardd_exec_slot *s;

	memset(out, 0, sizeof(*out));
	if (!eg || !eg->complete || eg->g->exec != SHARDD_EXEC_RANKS || rank >= eg->g->world)
		return -ENOENT;
	s = exec_slot(eg, rank);
	out->unshards = SHARDD_READ_ONCE(s->unshards);
	out->reduces = SHARDD_READ_ONCE(s->reduces);
	out->reshards = SHARDD_READ_ONCE(s->reshards);
	out->gen = SHARDD_READ_ONCE(exec_sync(eg)->gen[rank]);
	out->gen = out->gen == SHARDD_EXEC_GONE ? 0 : out->gen;
	out->epoch = SHARDD_READ_ONCE(exec_sync(eg)->epoch);
	out->wait_op = SHARDD_READ_ONCE(s->wait_op);
	out->wait_peer = SHARDD_READ_ONCE(s->wait_peer);
	out->wait_since_ns = SHARDD_READ_ONCE(s->wait_since_ns);
	out->grad_present = shd_group_grad_present(eg->g, eg->j->e->backend, rank);
	/* The rank's own words: a wait is shown only when it names an op and a rank of the job. */
	if (!out->wait_op || !shardd_op_name(out->wait_op) || !out->wait_peer ||
	    out->wait_peer > eg->g->world) {
		out->wait_op = out->wait_peer = 0;
		out->wait_since_ns = 0;
	} else {
		out->wait_peer = eng_rank_shown(j, out->wait_peer - 1) + 1;
	}
	return 0;
}

/* ------------------------------------------------------------------ */
/* EXEC_MAP                                                            */
/* ------------------------------------------------------------------ */

int shd_engine_exec_map(struct shd_engine_job *j, uint32_t rank, uint64_t token,
			const void *payload, size_t len, struct shardd_exec_map_reply *rep,
			int fds[2], char *err, size_t errlen)
{
	struct shd_backend_ctx *b = j->e->backend;
	struct shardd_exec_map req;
	struct shd_buf_export ex;
	struct eng_group *eg;
	struct shd_group *g;
	int ret;

	memset(rep, 0, sizeof(*rep));
	fds[0] = fds[1] = -1;
	if (!payload || len != sizeof(req)) {
		eng_fmt(err, errlen, "exec map: payload is %zu bytes, expected %zu", len,
			sizeof(req));
		return -SHARDD_E_MALFORMED;
	}
	memcpy(&req, payload, sizeof(req));
	eg = req.group_id >= 1 && req.group_id <= j->ngroups ? j->groups[req.group_id - 1] : NULL;
	if (!eg || !eg->complete) {
		eng_fmt(err, errlen,
			"exec map: group_id = %u is not a registered group of job '%s'",
			req.group_id, j->name);
		return -SHARDD_E_NOGROUP;
	}
	g = eg->g;
	if (g->exec != SHARDD_EXEC_RANKS) {
		eng_fmt(err, errlen, "exec map: group '%s' is daemon-executed (%s)", g->name,
			g->exec_why);
		return -SHARDD_E_STATE;
	}
	if (rank >= g->world || req.peer >= g->world) {
		eng_fmt(err, errlen, "exec map: peer = %u is outside job '%s' of %u ranks",
			req.peer, j->name, g->world);
		return -SHARDD_E_INVALID;
	}
	rep->group_id = req.group_id;
	rep->peer = req.peer;
	rep->shard_map_size = g->shards[req.peer].bytes;
	rep->grad_map_size = g->grads[req.peer].bytes;
	if (req.peer == rank) {
		if (!g->exec_sealed[rank]) {
			ret = b->ops->seal_readonly(b, &g->shards[rank]);
			if (!ret)
				ret = b->ops->seal_readonly(b, &g->grads[rank]);
			if (ret) {
				eng_fmt(err, errlen,
					"exec map: group '%s': rank %u's flat shard and grad buffer "
					"cannot be sealed read-only for its peers: %s (did the rank "
					"seal them itself?)",
					g->name, rank, strerror(-ret));
				return ret;
			}
			/* Never 0 (not published) nor SHARDD_EXEC_GONE. */
			g->exec_gen = g->exec_gen + 1 < SHARDD_EXEC_GONE ? g->exec_gen + 1 : 1;
			g->exec_sealed[rank] = g->exec_gen;
			eg->exec_sealer[rank] = token;
			shardd_store_release(&exec_sync(eg)->gen[rank], g->exec_gen);
			shardd_exec_changed(exec_sync(eg));
		}
		rep->gen = g->exec_sealed[rank];
		return 0;
	}
	if (!g->exec_sealed[req.peer]) {
		eng_fmt(err, errlen,
			"exec map: group '%s': rank %u has not published its buffers yet (it is "
			"not attached, or has not mapped the group); wait for its gen in the sync page",
			g->name, eng_rank_shown(j, req.peer));
		return -SHARDD_E_STATE;
	}
	ret = b->ops->export_buf(b, &g->shards[req.peer], SHD_EXPORT_RO, &ex);
	if (ret < 0)
		goto fail;
	fds[0] = ex.fd;
	ret = b->ops->export_buf(b, &g->grads[req.peer], SHD_EXPORT_RO, &ex);
	if (ret < 0)
		goto fail;
	fds[1] = ex.fd;
	rep->nfds = 2;
	/* Also a rank that left: what it published before is final, and may still count. */
	rep->gen = g->exec_sealed[req.peer];
	return 0;

fail:
	eng_fmt(err, errlen, "exec map: group '%s': cannot lend rank %u's buffers: %s", g->name,
		eng_rank_shown(j, req.peer), strerror(-ret));
	if (fds[0] >= 0)
		close(fds[0]);
	fds[0] = -1;
	return ret;
}

/* ------------------------------------------------------------------ */
/* A rank that left                                                    */
/* ------------------------------------------------------------------ */

/* The renewed buffers of a rank, made on the pool, swapped in on the loop thread. */
struct exec_renew {
	uint32_t rank;
	struct shd_buf shard, grad;
	void (*renewed)(struct eng_group *eg, uint32_t rank); /* the registry's, when done */
};

static struct exec_renew *renew_of(struct eng_task *t)
{
	return t->priv;
}

/*
 * Pool thread: fresh buffers for the rank, its shard's contents copied. The
 * old shard is only read: the rank that wrote it is gone, and the group's
 * tasks (steps, checkpoints) run one at a time.
 */
static void renew_exec(struct eng_task *t)
{
	struct exec_renew *rn = renew_of(t);
	struct shd_group *g = t->eg->g;
	struct shd_backend_ctx *b = t->eg->j->e->backend;
	char what[160];
	int ret;

	snprintf(what, sizeof(what), "%s.shard.%u", g->name, rn->rank);
	ret = b->ops->alloc(b, g->shards[rn->rank].bytes, SHARDD_HELLO_DEVICE_HOST, what,
			    &rn->shard);
	if (!ret) {
		snprintf(what, sizeof(what), "%s.grad.%u", g->name, rn->rank);
		ret = b->ops->alloc(b, g->grads[rn->rank].bytes, SHARDD_HELLO_DEVICE_HOST, what,
				    &rn->grad);
	}
	if (!ret) {
		uint64_t at = shardd_exec_slot_offset(g->layout.grad_size);
		const struct shardd_exec_slot *old =
			(const void *)((uint8_t *)b->ops->host_map(b, &g->grads[rn->rank]) + at);
		struct shardd_exec_slot *slot =
			(void *)((uint8_t *)b->ops->host_map(b, &rn->grad) + at);

		memcpy(b->ops->host_map(b, &rn->shard), b->ops->host_map(b, &g->shards[rn->rank]),
		       g->shards[rn->rank].bytes);
		/*
		 * The sharded grad stays, and so does whether it holds a reduce (a
		 * rank that died between its reduce and its step owes that step):
		 * the counts go to the new slot; the sequence words start afresh in
		 * the new epoch.
		 */
		slot->unshards = old->unshards;
		slot->reduces = old->reduces;
		slot->reshards = old->reshards;
		slot->cleared = old->cleared;
	}
	if (ret) {
		t->res = ret;
		eng_fmt(t->msg, sizeof(t->msg),
			"shardd: group '%s': cannot renew rank %u's buffers after it left: %s",
			g->name, eng_rank_shown(t->eg->j, rn->rank), strerror(-ret));
	}
}

/* Loop thread: swap the renewed buffers in, then the registry answers the OPEN_GROUP that waited. */
static void renew_delivered(struct eng_task *t)
{
	struct exec_renew *rn = renew_of(t);
	struct eng_group *eg = t->eg;
	struct shd_group *g = eg->g;
	struct shd_backend_ctx *b = eg->j->e->backend;
	uint32_t r = rn->rank;

	if (!t->res) {
		b->ops->free(b, &g->shards[r]);
		b->ops->free(b, &g->grads[r]);
		g->shards[r] = rn->shard;
		g->grads[r] = rn->grad;
		g->exec_sealed[r] = 0;
	} else {
		shd_log_warn("%s", t->msg);
		b->ops->free(b, &rn->shard);
		b->ops->free(b, &rn->grad);
	}
	eg->exec_renewing[r] = 0;
	rn->renewed(eg, r);
	free(rn);
	t->priv = NULL;
}

static const struct eng_task_ops renew_hooks = { .exec = renew_exec, .delivered = renew_delivered };

/* Wake every rank that sleeps on a peer's word of the group, to look at the sync page again. */
static void exec_wake_all(const struct eng_group *eg)
{
	for (uint32_t r = 0; r < eg->g->world; r++) {
		struct shardd_exec_slot *sl = exec_slot(eg, r);

		shardd_futex(shardd_exec_futex(&sl->seq), FUTEX_WAKE, INT32_MAX, NULL);
		shardd_futex(shardd_exec_futex(&sl->done), FUTEX_WAKE, INT32_MAX, NULL);
	}
}

void eng_exec_rank_gone(struct eng_group *eg, uint32_t rank)
{
	struct shd_group *g = eg->g;
	struct shardd_exec_sync *s;

	if (g->exec != SHARDD_EXEC_RANKS || !g->allocated)
		return;
	/*
	 * Ops that need it and that it had not reached fail (what it published
	 * is final: an op it reached still counts); sleepers wake to see it.
	 */
	s = exec_sync(eg);
	shardd_store_release(&s->gen[rank], SHARDD_EXEC_GONE);
	shardd_exec_changed(s);
	exec_wake_all(eg);
}

void eng_exec_rank_attached(struct eng_group *eg, uint32_t rank)
{
	struct shardd_exec_sync *s;

	if (eg->g->exec != SHARDD_EXEC_RANKS || !eg->g->allocated)
		return;
	s = exec_sync(eg);
	if (SHARDD_READ_ONCE(s->gen[rank]) != SHARDD_EXEC_GONE)
		return;
	/*
	 * It counts its ops from 1 again: a new epoch, in which every rank
	 * does, from its next op on; an op of the old one still waiting fails.
	 */
	SHARDD_WRITE_ONCE(s->dead_rank, eng_rank_shown(eg->j, rank) + 1);
	shardd_store_release(&s->gen[rank], 0u);
	shardd_store_release(&s->epoch, s->epoch + 1 ? s->epoch + 1 : 1);
	shardd_exec_changed(s);
	exec_wake_all(eg);
}

int eng_exec_renew(struct eng_group *eg, uint32_t rank,
		   void (*renewed)(struct eng_group *eg, uint32_t rank))
{
	struct exec_renew *rn = calloc(1, sizeof(*rn));
	struct eng_task *t = rn ? eng_task_new(eg, TASK_EXEC_RENEW, 1) : NULL;

	if (!t) {
		free(rn);
		return -SHARDD_E_NOMEM;
	}
	rn->rank = rank;
	rn->renewed = renewed;
	rn->shard.fd = rn->grad.fd = -1;
	t->hooks = &renew_hooks;
	t->priv = rn;
	t->rank = rank;
	t->ops[0].sqe.op = SHARDD_OP_NOP;
	eg->exec_renewing[rank] = 1;
	eng_group_enqueue(eg, t);
	return 0;
}

/* SPDX-License-Identifier: MIT */
/*
 * Collectives (engine_int.h): the unshard and reduce rendezvous of a
 * group, from the first arrival to the task that runs them, or to the
 * failure that ends them (a mismatch, a rank gone, the timeout). A rank
 * the timeout gave up on (paused past it) that arrives later with that
 * collective's key fails at once (rendezvous.h, SHD_RDV_LATE), so that it
 * can join the others' retry instead of waiting out a timeout of its own.
 *
 * An unshard gathers its replica's shard group; a reduce gathers its
 * replica's shard group too, or, under HSDP with SHARDD_REDUCE_ALL_REDUCE,
 * every rank of the job. A complete collective becomes one task (task.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "engine_int.h"

int eng_coll_init(struct eng_coll *c, uint32_t base, uint32_t n, uint32_t op)
{
	uint32_t *ranks = malloc(n * sizeof(*ranks));
	int ret;

	if (!ranks)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++)
		ranks[i] = base + i;
	ret = shd_rdv_init(&c->rdv, ranks, n);
	free(ranks);
	if (ret)
		return ret;
	c->base = base;
	c->op = op;
	c->ops = calloc(n, sizeof(*c->ops));
	if (!c->ops) {
		shd_rdv_free(&c->rdv);
		return -ENOMEM;
	}
	return 0;
}

void eng_coll_free(struct eng_coll *c)
{
	if (c->ops)
		shd_rdv_free(&c->rdv);
	free(c->ops);
	c->ops = NULL;
}

/*
 * Fail every op that arrived at `c` except `skip_rank`'s (UINT32_MAX: none), and reset it.
 *
 * A completion may drop its client (a corrupt CQ), and the rank's departure
 * fails this collective again from shd_engine_rank_gone(): each op
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
		shd_rdv_leave(&c->rdv, c->base + i);
		if (c->rdv.narrived == 0)
			shd_rdv_reset(&c->rdv);
		if (c->base + i != skip_rank)
			eng_complete(eg->j, &op, res, msg);
	}
}

void eng_colls_fail(struct eng_group *eg, int res, const char *msg)
{
	for (uint32_t u = 0; u < eg->j->replicate; u++) {
		coll_fail(eg, &eg->unshard[u], res, msg, UINT32_MAX);
		coll_fail(eg, &eg->rs[u], res, msg, UINT32_MAX);
	}
	if (eg->ar.ops)
		coll_fail(eg, &eg->ar, res, msg, UINT32_MAX);
}

/* "unshard(group 'g', step 5)" of the collective's key */
static void coll_what(const struct eng_group *eg, const struct eng_coll *c, char *buf, size_t len)
{
	eng_fmt(buf, len, "%s(group '%s', step %llu)", shd_op_info(c->op)->name, eg->g->name,
		(unsigned long long)c->rdv.step);
}

/*
 * Arrival of `op` at `c`. Returns 1 when the collective is complete (its
 * ops are in c->ops; the caller takes them and resets c), else 0: waiting,
 * or failed (the ops concerned were completed with errors).
 */
static int coll_arrive(struct eng_group *eg, struct eng_coll *c, const struct eng_op *op)
{
	struct shd_engine *e = eg->j->e;
	char why[256], ranks[160], msg[ENGINE_MSG_MAX];
	uint64_t now = shd_now_ns();
	int ret;

	ret = shd_rdv_arrive(&c->rdv, op->rank, op->sqe.step, op->sqe.flags, now, e->timeout_ns,
			     why, sizeof(why));
	if (ret == SHD_RDV_LATE) {
		char did[192];

		eng_fmt(did, sizeof(did), "submitted %s(group '%s', step %llu)",
			shd_op_info(c->op)->name, eg->g->name, (unsigned long long)op->sqe.step);
		eng_late_msg(e, &c->rdv, op->rank, did, now, msg, sizeof(msg));
		eng_complete(eg->j, op, -SHARDD_E_TIMEOUT, msg);
		return 0;
	}
	if (ret < 0) {
		eng_fmt(msg, sizeof(msg), "shardd: %s(group '%s', step %llu): %s",
			shd_op_info(c->op)->name, eg->g->name, (unsigned long long)op->sqe.step,
			why);
		eng_complete(eg->j, op, -SHARDD_E_INVALID, msg);
		return 0;
	}
	if (ret == SHD_RDV_MISMATCH) {
		shd_rdv_present(&c->rdv, ranks, sizeof(ranks));
		eng_fmt(msg, sizeof(msg), "shardd: %s(group '%s'): %s; failed for ranks %s,%u",
			shd_op_info(c->op)->name, eg->g->name, why, ranks,
			eng_rank_shown(eg->j, op->rank));
		coll_fail(eg, c, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
		eng_complete(eg->j, op, -SHARDD_E_MISMATCH, msg);
		return 0;
	}
	c->ops[op->rank - c->base] = *op;
	if (ret == SHD_RDV_COMPLETE)
		return 1;
	/*
	 * A rank whose client left cannot arrive until it attaches again:
	 * waiting for it would only end at the collective timeout, so the ranks
	 * here learn at once who is missing and can retry once it is back.
	 */
	for (uint32_t i = 0; i < c->rdv.nexpected; i++) {
		uint32_t r = c->base + i;

		if (!c->rdv.arrived[i] && eg->j->gone[r]) {
			char what[160], who[ENGINE_WHO_MAX];

			coll_what(eg, c, what, sizeof(what));
			shd_rdv_who_present(&c->rdv, who, sizeof(who));
			eng_fmt(msg, sizeof(msg),
				"shardd: rank %u left (its client is gone) before %s; failed for %s; retry once it attached again",
				eng_rank_shown(eg->j, r), what, who);
			coll_fail(eg, c, -SHARDD_E_PEER_DIED, msg, UINT32_MAX);
			return 0;
		}
	}
	return 0;
}

/* A task from a complete collective: takes c's ops and resets c. 0, or -ENOMEM (c's ops failed). */
static int coll_launch(struct eng_group *eg, struct eng_coll *c, uint32_t kind, uint32_t replica)
{
	struct eng_task *t = eng_task_new(eg, kind, c->rdv.nexpected);
	char what[160], msg[ENGINE_MSG_MAX];

	if (!t) {
		coll_what(eg, c, what, sizeof(what));
		eng_fmt(msg, sizeof(msg), "shardd: %s: the daemon is out of memory", what);
		coll_fail(eg, c, -SHARDD_E_NOMEM, msg, UINT32_MAX);
		return -ENOMEM;
	}
	t->replica = replica;
	memcpy(t->ops, c->ops, (size_t)c->rdv.nexpected * sizeof(*c->ops));
	shd_rdv_reset(&c->rdv);
	eng_group_enqueue(eg, t);
	return 0;
}

void eng_coll_unshard(struct eng_group *eg, const struct eng_op *op)
{
	struct shd_group *g = eg->g;
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

/*
 * HSDP: a rank's reduce goes to its replica's rendezvous or to the
 * all-reduce one by its flag. Ranks of one shard group that disagree on the
 * flag would wait in different rendezvous: that is a mismatch, found here.
 */
static int reduce_cross_check(struct eng_group *eg, const struct eng_op *op, struct eng_coll *mine,
			      struct eng_coll *other)
{
	struct shd_group *g = eg->g;
	uint32_t u = op->rank / g->shard, first = UINT32_MAX;
	char ranks[160], ranks2[160], msg[ENGINE_MSG_MAX];

	if (!other->rdv.active)
		return 0;
	for (uint32_t s = 0; s < g->shard && first == UINT32_MAX; s++) {
		if (shd_rdv_has_arrived(&other->rdv, u * g->shard + s))
			first = u * g->shard + s;
	}
	if (first == UINT32_MAX)
		return 0;
	if (first == op->rank || shd_rdv_has_arrived(&other->rdv, op->rank)) {
		eng_fmt(msg, sizeof(msg),
			"shardd: reduce(group '%s', step %llu): rank %u submitted it while its reduce step %llu flags 0x%x is still waiting",
			g->name, (unsigned long long)op->sqe.step, eng_rank_shown(eg->j, op->rank),
			(unsigned long long)other->rdv.step, other->rdv.flags);
		eng_complete(eg->j, op, -SHARDD_E_INVALID, msg);
		return 1;
	}
	shd_rdv_present(&other->rdv, ranks, sizeof(ranks));
	shd_rdv_present(&mine->rdv, ranks2, sizeof(ranks2));
	eng_fmt(msg, sizeof(msg),
		"shardd: reduce(group '%s'): rank %u submitted step %llu flags 0x%x but rank %u submitted step %llu flags 0x%x; failed for ranks %s%s%s,%u",
		g->name, eng_rank_shown(eg->j, op->rank), (unsigned long long)op->sqe.step,
		op->sqe.flags, eng_rank_shown(eg->j, first), (unsigned long long)other->rdv.step,
		other->rdv.flags, ranks, ranks2[0] ? "," : "", ranks2,
		eng_rank_shown(eg->j, op->rank));
	coll_fail(eg, other, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
	coll_fail(eg, mine, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
	eng_complete(eg->j, op, -SHARDD_E_MISMATCH, msg);
	return 1;
}

void eng_coll_reduce(struct eng_group *eg, const struct eng_op *op)
{
	struct shd_group *g = eg->g;
	uint32_t u = op->rank / g->shard;
	char msg[ENGINE_MSG_MAX];

	if (g->grad_dtype == SHARDD_DTYPE_NONE) {
		eng_fmt(msg, sizeof(msg),
			"shardd: reduce(group '%s', step %llu): FSDP reduce-scatter expects uniform gradient dtype but got %s; set a param_dtype policy or register params of one dtype",
			g->name, (unsigned long long)op->sqe.step, g->grad_dtypes);
		eng_complete(eg->j, op, -SHARDD_E_INVALID, msg);
		return;
	}
	if (g->replicate == 1) {
		/* HSDP across nodes: this node's ranks are one replica; ALL_REDUCE crosses nodes. */
		uint32_t kind =
			eng_mesh_replicate(eg->j) > 1 && !(op->sqe.flags & SHARDD_REDUCE_ALL_REDUCE)
				? TASK_REDUCE_PARTIAL
				: TASK_REDUCE;

		if (coll_arrive(eg, &eg->rs[0], op))
			coll_launch(eg, &eg->rs[0], kind, 0);
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

int eng_coll_rank_waits(const struct eng_group *eg, uint32_t rank)
{
	const struct shd_engine_job *j = eg->j;
	uint32_t u = rank / j->shard;

	return shd_rdv_has_arrived(&eg->unshard[u].rdv, rank) ||
	       shd_rdv_has_arrived(&eg->rs[u].rdv, rank) ||
	       (eg->ar.ops && shd_rdv_has_arrived(&eg->ar.rdv, rank));
}

/* Rank gone: fail an active collective it belongs to, unless a newer attachment arrived there. */
static void coll_rank_gone(struct eng_group *eg, struct eng_coll *c, uint32_t rank, uint64_t token)
{
	char what[160], msg[ENGINE_MSG_MAX], who[ENGINE_WHO_MAX];

	if (!c->ops || !c->rdv.active || !shd_rdv_expects(&c->rdv, rank))
		return;
	if (shd_rdv_has_arrived(&c->rdv, rank) && c->ops[rank - c->base].token != token)
		return;
	coll_what(eg, c, what, sizeof(what));
	shd_rdv_who_present_but(&c->rdv, rank, who, sizeof(who));
	eng_fmt(msg, sizeof(msg),
		"shardd: rank %u left (its client is gone) during %s; failed for %s",
		eng_rank_shown(eg->j, rank), what, who);
	coll_fail(eg, c, -SHARDD_E_PEER_DIED, msg, rank);
}

void eng_coll_rank_gone(struct eng_group *eg, uint32_t rank, uint64_t token)
{
	for (uint32_t u = 0; u < eg->j->replicate; u++) {
		coll_rank_gone(eg, &eg->unshard[u], rank, token);
		coll_rank_gone(eg, &eg->rs[u], rank, token);
	}
	coll_rank_gone(eg, &eg->ar, rank, token);
}

static void coll_cron(struct eng_group *eg, struct eng_coll *c, uint64_t now_ns)
{
	char what[160], did[192], msg[ENGINE_MSG_MAX];

	if (!c->ops || !shd_rdv_expired(&c->rdv, now_ns))
		return;
	coll_what(eg, c, what, sizeof(what));
	eng_fmt(did, sizeof(did), "never submitted %s", what);
	eng_expired_msg(eg->j->e, &c->rdv, did, msg, sizeof(msg));
	shd_rdv_expire(&c->rdv, now_ns);
	coll_fail(eg, c, -SHARDD_E_TIMEOUT, msg, UINT32_MAX);
}

void eng_coll_cron(struct eng_group *eg, uint64_t now_ns)
{
	for (uint32_t u = 0; u < eg->j->replicate; u++) {
		coll_cron(eg, &eg->unshard[u], now_ns);
		coll_cron(eg, &eg->rs[u], now_ns);
	}
	coll_cron(eg, &eg->ar, now_ns);
}

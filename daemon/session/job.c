/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "log.h"

static struct shd_jobs_env env;

void shd_jobs_init(const struct shd_jobs_env *e)
{
	env = *e;
}

struct shd_job *shd_job_find(const char *name)
{
	for (struct shd_job *j = *env.list; j; j = j->next)
		if (strcmp(j->name, name) == 0)
			return j;
	return NULL;
}

int shd_job_claim(const char *name, uint32_t replicate, uint32_t shard, uint32_t rank,
		  struct shd_job **out, char *err, size_t errlen)
{
	struct shd_job *job = shd_job_find(name);
	struct shd_job_rank *jr;

	*out = job;
	if (!job)
		return 0;
	if (job->replicate != replicate || job->shard != shard) {
		snprintf(err, errlen, "job '%s' has mesh %ux%u, hello asked for %ux%u", job->name,
			 job->replicate, job->shard, replicate, shard);
		return -SHARDD_E_MESH;
	}
	jr = &job->ranks[rank];
	/* A restarted trainer may be faster than the old one's EOF: look now. */
	if (jr->client.ops && jr->client.ops->gone(jr->client.ctx)) {
		jr->client.ops->close(jr->client.ctx,
				      "died (found gone when the rank re-attached)");
		/* A job that held no group ended with its last rank (shd_job_detach): a new one starts. */
		job = *out = shd_job_find(name);
		if (!job)
			return 0;
		jr = &job->ranks[rank];
	}
	if (jr->client.ops) {
		snprintf(err, errlen, "job '%s' rank %u is already attached (client %llu, pid %u)",
			 job->name, job->rank_base + rank, (unsigned long long)jr->client.token,
			 jr->pid);
		return -SHARDD_E_RANK_TAKEN;
	}
	return 0;
}

int shd_job_create(const char *name, uint32_t replicate, uint32_t shard, struct shd_job **out)
{
	uint32_t all[SHARDD_MAX_WORLD];
	struct shd_job *j;
	int ret = -ENOMEM;

	j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	snprintf(j->name, sizeof(j->name), "%s", name);
	j->replicate = replicate;
	j->shard = shard;
	j->world = replicate * shard;
	j->ranks = calloc(j->world, sizeof(*j->ranks));
	if (!j->ranks)
		goto err_free;
	for (uint32_t r = 0; r < j->world; r++)
		all[r] = r;
	for (int k = 0; k < SHD_JOB_NRDV; k++) {
		ret = shd_rdv_init(&j->rdv[k], all, j->world);
		if (ret < 0)
			goto err_rdv;
	}
	ret = shd_engine_job_create(env.engine, j, j->name, replicate, shard, &j->ejob);
	if (ret < 0)
		goto err_rdv;
	j->next = *env.list;
	if (*env.list)
		(*env.list)->prev = j;
	*env.list = j;
	shd_log_info("job '%s' created: mesh %ux%u", j->name, replicate, shard);
	*out = j;
	return 0;

err_rdv:
	for (int k = 0; k < SHD_JOB_NRDV; k++)
		shd_rdv_free(&j->rdv[k]);
err_free:
	free(j->ranks);
	free(j);
	return ret;
}

/* "rank 3" or "ranks 0,1,3" for a comma-separated list of `n` ranks. */
static void rank_phrase(char *buf, size_t len, const char *list, uint32_t n)
{
	snprintf(buf, len, "%s %s", n == 1 ? "rank" : "ranks", list);
}

/* How messages name op `k` at `step`: "barrier 5", "grad_norm(step 5)", "checkpoint(step 5)". */
static void rdv_label(char *buf, size_t len, enum shd_job_rdv_kind k, uint64_t step)
{
	if (k == SHD_JOB_BARRIER)
		snprintf(buf, len, "barrier %llu", (unsigned long long)step);
	else
		snprintf(buf, len, "%s(step %llu)", k == SHD_JOB_GNORM ? "grad_norm" : "checkpoint",
			 (unsigned long long)step);
}

/*
 * End rendezvous op `k` in progress: every arrived rank gets (res, msg),
 * and a grad_norm's completion, with res 0, the norm and the non-finite
 * flag in its arg. The rendezvous is reset before any completion is
 * pushed, so a client dropped while we complete it (corrupt ring) finds
 * no op to fail again.
 */
static void rdv_finish(struct shd_job *j, enum shd_job_rdv_kind k, int res, const char *msg,
		       double norm, int nonfinite)
{
	struct shd_rdv *rdv = &j->rdv[k];
	uint32_t done[SHARDD_MAX_WORLD];
	uint32_t n = 0;

	for (uint32_t i = 0; i < rdv->nexpected; i++)
		if (rdv->arrived[i])
			done[n++] = rdv->ranks[i];
	shd_rdv_reset(rdv);
	for (uint32_t i = 0; i < n; i++) {
		struct shd_job_wait *w = &j->ranks[done[i]].wait[k];
		struct shardd_sqe out = w->sqe;

		if (k == SHD_JOB_GNORM) {
			memset(out.arg, 0, sizeof(out.arg));
			if (res == 0) {
				memcpy(&out.arg[SHARDD_CQE_GRAD_NORM], &norm, sizeof(norm));
				out.arg[SHARDD_CQE_GRAD_NORM_NONFINITE] = nonfinite ? 1 : 0;
			}
		}
		shd_job_op_done(j, done[i], w->token, &out, res, msg);
	}
}

/*
 * The arrival of `rank`'s `sqe` in rendezvous op `k` with key (sqe->step,
 * flags). A rank that already waits in it, or (`busy`) still waits for its
 * last one to end, fails at once: -EINVAL, its completion pushed. So does
 * one that comes with the key the op's last timeout gave up on it for (a
 * paused rank): SHD_RDV_LATE, -SHARDD_E_TIMEOUT pushed. Else
 * shd_rdv_arrive's result: with SHD_RDV_WAIT or SHD_RDV_COMPLETE the rank
 * now waits; with SHD_RDV_MISMATCH the caller fails it (rdv_mismatch).
 */
static int rdv_arrive(struct shd_job *j, enum shd_job_rdv_kind k, uint32_t rank,
		      const struct shardd_sqe *sqe, uint32_t flags, int busy, char *err,
		      size_t errlen)
{
	struct shd_job_rank *jr = &j->ranks[rank];
	struct shd_job_wait *w = &jr->wait[k];
	struct shd_rdv *rdv = &j->rdv[k];
	static const char *const did[SHD_JOB_NRDV] = {
		[SHD_JOB_BARRIER] = "arrived",
		[SHD_JOB_GNORM] = "submitted grad_norm",
		[SHD_JOB_CKPT] = "submitted checkpoint",
	};
	char mine[64], theirs[64], within[32], late[1024], msg[1400];
	uint64_t now = shd_now_ns();
	int ret;

	ret = shd_rdv_arrive(rdv, rank, sqe->step, flags, now, env.collective_timeout_ns, err,
			     errlen);
	if (ret == SHD_RDV_LATE && !busy) {
		rdv_label(mine, sizeof(mine), k, sqe->step);
		snprintf(within, sizeof(within), "%g s", env.collective_timeout_s);
		shd_rdv_late_msg(rdv, rank, did[k], within, now, late, sizeof(late));
		snprintf(msg, sizeof(msg), "%s: %s", mine, late);
		shd_log_warn("job '%s': %s", j->name, msg);
		shd_job_op_done(j, rank, jr->client.token, sqe, -SHARDD_E_TIMEOUT, msg);
		return SHD_RDV_LATE;
	}
	if (ret == -EINVAL || busy) {
		rdv_label(mine, sizeof(mine), k, sqe->step);
		rdv_label(theirs, sizeof(theirs), k, busy ? w->sqe.step : rdv->step);
		snprintf(msg, sizeof(msg), "%s: rank %u already waits in %s", mine,
			 j->rank_base + rank, theirs);
		if (ret != -EINVAL)
			shd_rdv_leave(rdv, rank);
		shd_job_op_done(j, rank, jr->client.token, sqe, -SHARDD_E_STATE, msg);
		return -EINVAL;
	}
	if (ret != SHD_RDV_MISMATCH) {
		w->token = jr->client.token;
		w->sqe = *sqe;
	}
	return ret;
}

/* Fail rendezvous op `k` on a mismatch: every arrived rank, and `rank` with `sqe`, get `msg`. */
static void rdv_mismatch(struct shd_job *j, enum shd_job_rdv_kind k, uint32_t rank,
			 const struct shardd_sqe *sqe, const char *msg)
{
	uint64_t token = j->ranks[rank].client.token;

	shd_log_warn("job '%s': %s", j->name, msg);
	rdv_finish(j, k, -SHARDD_E_MISMATCH, msg, 0, 0);
	shd_job_op_done(j, rank, token, sqe, -SHARDD_E_MISMATCH, msg);
}

/*
 * How the failure of rendezvous `rdv` names the departure of `rank`
 * (process `pid`) for the reason `why`: "rank 2 (pid 7) died (connection
 * closed)". A goodbye (`goodbye`) did not break the rendezvous when another
 * rank of it died: one that left without a goodbye and has not come back,
 * or one whose client is gone though the loop has not seen it yet (a
 * goodbye and a death reach the loop in one turn, in either order). The
 * ranks left waiting hear of the death first: "rank 1 (pid 6) died
 * (connection closed); rank 2 (pid 7) said goodbye".
 */
static void rdv_departure(const struct shd_job *j, const struct shd_rdv *rdv, uint32_t rank,
			  uint32_t pid, int goodbye, const char *why, char *buf, size_t len)
{
	for (uint32_t i = 0; goodbye && i < rdv->nexpected; i++) {
		const struct shd_job_rank *d = &j->ranks[rdv->ranks[i]];
		const char *how;

		if (rdv->ranks[i] == rank)
			continue;
		if (d->client.ops && d->client.ops->gone(d->client.ctx))
			how = "died (its client is gone)";
		else if (!d->client.ops && d->attached_once && !d->goodbye)
			how = d->left_why;
		else
			continue;
		snprintf(buf, len, "rank %u (pid %u) %s; rank %u (pid %u) %s",
			 j->rank_base + rdv->ranks[i], d->pid, how, j->rank_base + rank, pid, why);
		return;
	}
	snprintf(buf, len, "rank %u (pid %u) %s", j->rank_base + rank, pid, why);
}

/*
 * `rank` (process `pid`) left for the reason `why` (`goodbye`: it said so):
 * rendezvous op `k` fails the ranks in it.
 */
static void rdv_rank_gone(struct shd_job *j, enum shd_job_rdv_kind k, uint32_t rank, uint32_t pid,
			  int goodbye, const char *why)
{
	struct shd_rdv *rdv = &j->rdv[k];
	char label[64], present[1024], who[1100], left[400], msg[1600];

	if (!rdv->active)
		return;
	rdv_label(label, sizeof(label), k, rdv->step);
	shd_rdv_leave(rdv, rank);
	if (!rdv->narrived) {
		shd_rdv_reset(rdv);
		return;
	}
	rdv_departure(j, rdv, rank, pid, goodbye, why, left, sizeof(left));
	shd_rdv_present(rdv, present, sizeof(present));
	rank_phrase(who, sizeof(who), present, rdv->narrived);
	snprintf(msg, sizeof(msg), "%s: %s; %s %s waiting", label, left, who,
		 rdv->narrived == 1 ? "was" : "were");
	shd_log_warn("job '%s': %s", j->name, msg);
	rdv_finish(j, k, -SHARDD_E_PEER_DIED, msg, 0, 0);
}

/* The engine's end of a checkpoint (shd_engine_ckpt_fn): every rank that waits for it completes. */
static void ckpt_written(void *ctx, int res, const char *msg, const char *dir, uint64_t bytes,
			 double seconds)
{
	struct shd_job *j = ctx;

	(void)dir;
	(void)bytes;
	(void)seconds;
	for (uint32_t r = 0; r < j->world; r++) {
		struct shd_job_rank *jr = &j->ranks[r];

		if (!jr->ckpt_waits)
			continue;
		jr->ckpt_waits = 0;
		shd_job_op_done(j, r, jr->wait[SHD_JOB_CKPT].token, &jr->wait[SHD_JOB_CKPT].sqe,
				res, msg);
	}
}

/* shd_job_destroy; `why` ("was ended by ...", NULL: shutdown) goes into every failure. */
static void job_destroy(struct shd_job *j, const char *why)
{
	shd_engine_job_grad_norm_abandon(j->ejob);
	for (int k = 0; k < SHD_JOB_NRDV; k++) {
		char msg[SHARDD_RING_MSG_SIZE];

		if (!j->rdv[k].active)
			continue;
		if (why)
			snprintf(msg, sizeof(msg), "job '%s' %s", j->name, why);
		else
			snprintf(msg, sizeof(msg), "shardd is shutting down");
		rdv_finish(j, k, -SHARDD_E_SHUTDOWN, msg, 0, 0);
	}
	/* The engine fails what it still holds through the callbacks, to live sessions. */
	shd_engine_job_end(j->ejob, why);
	for (uint32_t r = 0; r < j->world; r++)
		if (j->ranks[r].client.ops)
			j->ranks[r].client.ops->job_ended(j->ranks[r].client.ctx);
	if (j->prev)
		j->prev->next = j->next;
	else
		*env.list = j->next;
	if (j->next)
		j->next->prev = j->prev;
	shd_log_info("job '%s' ended", j->name);
	for (int k = 0; k < SHD_JOB_NRDV; k++)
		shd_rdv_free(&j->rdv[k]);
	free(j->ranks);
	free(j);
}

int shd_job_span(struct shd_job *j, uint32_t replicate, uint32_t shard, uint32_t nodes,
		 uint32_t node)
{
	int ret = shd_engine_job_span(j->ejob, replicate, shard, nodes, node);

	if (ret)
		return ret;
	j->span_nodes = nodes;
	j->span_node = node;
	j->span_replicate = replicate;
	j->span_shard = shard;
	j->rank_base = node * j->world;
	for (int k = 0; k < SHD_JOB_NRDV; k++)
		j->rdv[k].shown_base = j->rank_base;
	return 0;
}

void shd_job_destroy(struct shd_job *j)
{
	job_destroy(j, NULL);
}

uint64_t shd_job_end(struct shd_job *j, const char *why)
{
	struct shd_rank_sink attached[SHARDD_MAX_WORLD];
	struct shd_group_memory held = { 0 };
	uint64_t bytes;
	char name[SHARDD_NAME_MAX], notice[SHARDD_RING_MSG_SIZE];
	uint32_t n = 0;

	shd_job_memory_held(j, &held);
	bytes = held.total;
	snprintf(name, sizeof(name), "%s", j->name);
	snprintf(notice, sizeof(notice), "job '%s' %s", j->name, why);
	/* Told before the ops fail, closed after: a closing session takes no completion. */
	for (uint32_t r = 0; r < j->world; r++) {
		if (j->ranks[r].client.ops) {
			attached[n++] = j->ranks[r].client;
			j->ranks[r].client.ops->notify(j->ranks[r].client.ctx, -SHARDD_E_SHUTDOWN,
						       notice);
		}
	}
	job_destroy(j, why);
	for (uint32_t i = 0; i < n; i++)
		attached[i].ops->close_later(attached[i].ctx, notice);
	if (n)
		shd_log_warn("job '%s' %s: its %u attached rank%s told, %llu bytes of buffers "
			     "freed (%.1f MiB)",
			     name, why, n, n == 1 ? " was" : "s were", (unsigned long long)bytes,
			     (double)bytes / (1024.0 * 1024.0));
	else
		shd_log_warn("job '%s' %s: %llu bytes of buffers freed (%.1f MiB)", name, why,
			     (unsigned long long)bytes, (double)bytes / (1024.0 * 1024.0));
	return bytes;
}

double shd_job_ends_in_s(const struct shd_job *j, uint64_t now_ns)
{
	uint64_t linger = env.linger_ns, idle;

	if (j->nattached || !j->orphaned_ns || !linger)
		return -1;
	idle = now_ns > j->orphaned_ns ? now_ns - j->orphaned_ns : 0;
	return idle >= linger ? 0 : (double)(linger - idle) / 1e9;
}

void shd_job_attach(struct shd_job *j, uint32_t rank, uint32_t pid, int32_t device,
		    const struct shd_rank_sink *client)
{
	struct shd_job_rank *jr = &j->ranks[rank];

	jr->client = *client;
	jr->pid = pid;
	jr->attached_once = 1;
	jr->goodbye = 0;
	j->nattached++;
	if (j->orphaned_ns) {
		shd_log_info("job '%s': rank %u re-attached after %.1f s without ranks; the job "
			     "no longer ends (--job-linger)",
			     j->name, rank, (double)(shd_now_ns() - j->orphaned_ns) / 1e9);
		j->orphaned_ns = 0;
	}
	shd_engine_rank_attached(j->ejob, rank, device);
}

/* The sink of `rank` if its client is `token`, else NULL (a stale completion). */
static const struct shd_rank_sink *job_client(struct shd_job *j, uint32_t rank, uint64_t token)
{
	const struct shd_rank_sink *c;

	if (rank >= j->world)
		return NULL;
	c = &j->ranks[rank].client;
	return c->ops && c->token == token ? c : NULL;
}

void shd_job_op_done(void *job_ctx, uint32_t rank, uint64_t token, const struct shardd_sqe *sqe,
		     int res, const char *msg)
{
	struct shd_job *j = job_ctx;
	const struct shd_rank_sink *c = job_client(j, rank, token);

	if (!c) {
		shd_log_debug("job '%s' rank %u: dropping the completion of %s (step %llu): "
			      "its client %llu is gone",
			      j->name, rank,
			      shardd_op_name(sqe->op) ? shardd_op_name(sqe->op) : "?",
			      (unsigned long long)sqe->step, (unsigned long long)token);
		return;
	}
	c->ops->complete(c->ctx, sqe, res, msg);
}

void shd_job_group_reply(void *job_ctx, uint32_t rank, uint64_t token, uint32_t seq, int res,
			 const char *msg, const struct shardd_group_reply *reply,
			 const struct shardd_param_layout *layouts,
			 const struct shardd_param_spec *specs, const int *fds, int nfds,
			 const struct shardd_cuda_ipc_handle *ipc, int nipc)
{
	struct shd_job *j = job_ctx;
	const struct shd_rank_sink *c = job_client(j, rank, token);

	if (!c) {
		shd_log_debug("job '%s' rank %u: dropping a group reply: its client %llu is gone",
			      j->name, rank, (unsigned long long)token);
		return;
	}
	c->ops->group_reply(c->ctx, seq, res, msg, reply, layouts, specs, fds, nfds, ipc, nipc);
}

/* Some group of the job exists (registered, or being registered). */
static int job_holds_groups(const struct shd_job *j)
{
	for (uint32_t i = 1; i <= shd_engine_job_ngroups(j->ejob); i++)
		if (shd_engine_job_group(j->ejob, i))
			return 1;
	return 0;
}

void shd_job_detach(struct shd_job *j, uint32_t rank, int goodbye, const char *why)
{
	struct shd_job_rank *jr = &j->ranks[rank];
	uint64_t token;
	int all_goodbye = 1;

	if (!jr->client.ops)
		return;
	token = jr->client.token;
	/* Clear the slot first: completions for this client from here on are dropped. */
	memset(&jr->client, 0, sizeof(jr->client));
	jr->goodbye = goodbye;
	if (!goodbye)
		snprintf(jr->left_why, sizeof(jr->left_why), "%s", why);
	j->nattached--;
	for (int k = 0; k < SHD_JOB_NRDV; k++)
		rdv_rank_gone(j, k, rank, jr->pid, goodbye, why);
	shd_engine_rank_gone(j->ejob, rank, token);
	for (uint32_t r = 0; r < j->world; r++)
		if (!j->ranks[r].goodbye)
			all_goodbye = 0;
	if (all_goodbye) {
		shd_job_destroy(j);
		return;
	}
	/*
	 * A job that holds no group keeps nothing a rank could come back for:
	 * it ends now, not after --job-linger (a client attaching job after
	 * job and leaving would otherwise pile them up for the linger).
	 */
	if (!j->nattached && !job_holds_groups(j)) {
		job_destroy(j, "ended when its last rank left: it held no group");
		return;
	}
	if (!j->nattached) {
		j->orphaned_ns = shd_now_ns();
		if (env.linger_ns)
			shd_log_info("job '%s': no rank attached; it ends in %g s unless one "
				     "re-attaches (--job-linger)",
				     j->name, env.linger_s);
		else
			shd_log_info("job '%s': no rank attached; kept until one re-attaches "
				     "(--job-linger 0)",
				     j->name);
	}
}

/* A barrier: complete every rank once each has arrived with the same number. */
static void job_barrier(struct shd_job *j, uint32_t rank, const struct shardd_sqe *sqe)
{
	struct shd_rdv *rdv = &j->rdv[SHD_JOB_BARRIER];
	struct shardd_sqe mine;
	char why[256], failing[1024], msg[1400];
	int ret;

	ret = rdv_arrive(j, SHD_JOB_BARRIER, rank, sqe, 0, 0, why, sizeof(why));
	if (ret == SHD_RDV_MISMATCH) {
		shd_rdv_failing(rdv, rank, failing, sizeof(failing));
		snprintf(msg, sizeof(msg),
			 "barrier mismatch: rank %u submitted barrier %llu but rank %u submitted "
			 "barrier %llu; failing ranks %s",
			 j->rank_base + rank, (unsigned long long)sqe->step,
			 j->rank_base + rdv->first_rank, (unsigned long long)rdv->step, failing);
		/* Each failing rank's completion names the barrier number it met (cqe.result[0]). */
		mine = *sqe;
		mine.arg[SHARDD_CQE_BARRIER_OTHER] = rdv->step;
		for (uint32_t i = 0; i < rdv->nexpected; i++)
			if (rdv->arrived[i])
				j->ranks[rdv->ranks[i]]
					.wait[SHD_JOB_BARRIER]
					.sqe.arg[SHARDD_CQE_BARRIER_OTHER] = sqe->step;
		rdv_mismatch(j, SHD_JOB_BARRIER, rank, &mine, msg);
		return;
	}
	if (ret == SHD_RDV_COMPLETE)
		rdv_finish(j, SHD_JOB_BARRIER, 0, NULL, 0, 0);
}

/* "2" or "inf": norm type code `c` (0: 2-norm, 1: inf) as a person writes it. */
static const char *gnorm_type_name(uint32_t c)
{
	return c ? "inf" : "2";
}

/*
 * A grad_norm (the table checked its words but not the norm type): when
 * every rank of the job has arrived with the same step and norm type, each
 * gets the total norm of the job's sharded grads in its completion.
 */
static void job_grad_norm(struct shd_job *j, uint32_t rank, const struct shardd_sqe *sqe)
{
	struct shd_rdv *rdv = &j->rdv[SHD_JOB_GNORM];
	uint64_t token = j->ranks[rank].client.token;
	char why[256], failing[1024], msg[1400];
	double type, norm = 0;
	uint32_t code;
	int ret, nonfinite = 0;

	memcpy(&type, &sqe->arg[SHARDD_SQE_GRAD_NORM_TYPE], sizeof(type));
	if (type == 2.0) {
		code = 0;
	} else if (isinf(type) && type > 0) {
		code = 1;
	} else {
		snprintf(msg, sizeof(msg),
			 "grad_norm(step %llu): norm_type %g (sqe.arg[%d] = 0x%llx) is "
			 "not supported: use 2.0 or inf",
			 (unsigned long long)sqe->step, type, SHARDD_SQE_GRAD_NORM_TYPE,
			 (unsigned long long)sqe->arg[SHARDD_SQE_GRAD_NORM_TYPE]);
		shd_job_op_done(j, rank, token, sqe, -SHARDD_E_INVALID, msg);
		return;
	}
	ret = rdv_arrive(j, SHD_JOB_GNORM, rank, sqe, code, 0, why, sizeof(why));
	if (ret == SHD_RDV_MISMATCH) {
		shd_rdv_failing(rdv, rank, failing, sizeof(failing));
		snprintf(
			msg, sizeof(msg),
			"grad_norm mismatch: rank %u submitted grad_norm(step %llu, norm_type %s) but rank %u "
			"submitted grad_norm(step %llu, norm_type %s); failing ranks %s",
			j->rank_base + rank, (unsigned long long)sqe->step, gnorm_type_name(code),
			j->rank_base + rdv->first_rank, (unsigned long long)rdv->step,
			gnorm_type_name(rdv->flags), failing);
		rdv_mismatch(j, SHD_JOB_GNORM, rank, sqe, msg);
		return;
	}
	if (ret != SHD_RDV_COMPLETE)
		return;
	if (shd_engine_job_spans_fsdp(j->ejob)) {
		/* Each node holds its ranks' shards: the nodes' parts are summed off the loop (shd_job_gnorm_poll). */
		ret = shd_engine_job_grad_norm_span(j->ejob, (int)code, sqe->step, why,
						    sizeof(why));
		if (ret < 0) {
			snprintf(msg, sizeof(msg), "grad_norm(step %llu): %s",
				 (unsigned long long)sqe->step, why);
			rdv_finish(j, SHD_JOB_GNORM, ret, msg, 0, 0);
		}
		return;
	}
	ret = shd_engine_job_grad_norm(j->ejob, (int)code, &norm, &nonfinite, why, sizeof(why));
	if (ret < 0) {
		snprintf(msg, sizeof(msg), "grad_norm(step %llu): %s",
			 (unsigned long long)sqe->step, why);
		rdv_finish(j, SHD_JOB_GNORM, ret, msg, 0, 0);
		return;
	}
	shd_engine_job_grad_norm_keep(j->ejob, sqe->step, norm, nonfinite);
	rdv_finish(j, SHD_JOB_GNORM, 0, NULL, norm, nonfinite);
}

void shd_job_gnorm_poll(struct shd_job *j)
{
	uint64_t step = j->rdv[SHD_JOB_GNORM].step;
	char why[1024], msg[1400];
	double norm = 0;
	int ret, nonfinite = 0;

	ret = shd_engine_job_grad_norm_poll(j->ejob, &norm, &nonfinite, why, sizeof(why));
	if (ret > 0)
		return;
	if (ret < 0) {
		snprintf(msg, sizeof(msg), "grad_norm(step %llu): %s", (unsigned long long)step,
			 why);
		shd_log_warn("job '%s': %s", j->name, msg);
		rdv_finish(j, SHD_JOB_GNORM, ret, msg, 0, 0);
		return;
	}
	shd_engine_job_grad_norm_keep(j->ejob, step, norm, nonfinite);
	rdv_finish(j, SHD_JOB_GNORM, 0, NULL, norm, nonfinite);
}

/*
 * A checkpoint: when every rank of the job has arrived with the same step,
 * the job's groups are written to <--state-dir>/<job>/step-<step>
 * (shd_engine_job_checkpoint), and each rank's completion comes when that
 * is durable or has failed.
 */
static void job_checkpoint(struct shd_job *j, uint32_t rank, const struct shardd_sqe *sqe)
{
	struct shd_job_rank *jr = &j->ranks[rank];
	struct shd_rdv *rdv = &j->rdv[SHD_JOB_CKPT];
	uint64_t token = jr->client.token;
	struct shd_engine_ckpt_target t = { .keep = env.keep, .step = sqe->step };
	char why[512], msg[1400], *dir = NULL, *root = NULL;
	int ret;

	if (!env.state_dir) {
		snprintf(
			msg, sizeof(msg),
			"checkpoint(step %llu): shardd has no --state-dir to write it to; "
			"restart shardd with --state-dir DIR, or take it with `shardctl checkpoint %s DIR`",
			(unsigned long long)sqe->step, j->name);
		shd_job_op_done(j, rank, token, sqe, -SHARDD_E_INVALID, msg);
		return;
	}
	ret = rdv_arrive(j, SHD_JOB_CKPT, rank, sqe, 0, jr->ckpt_waits, why, sizeof(why));
	if (ret == SHD_RDV_MISMATCH) {
		snprintf(
			msg, sizeof(msg),
			"checkpoint mismatch: rank %u submitted checkpoint(step %llu) but rank %u submitted "
			"checkpoint(step %llu); every rank checkpoints the same step",
			j->rank_base + rank, (unsigned long long)sqe->step,
			j->rank_base + rdv->first_rank, (unsigned long long)rdv->step);
		rdv_mismatch(j, SHD_JOB_CKPT, rank, sqe, msg);
		return;
	}
	if (ret != SHD_RDV_COMPLETE)
		return;
	if (asprintf(&root, "%s/%s", env.state_dir, j->name) < 0 ||
	    asprintf(&dir, "%s/step-%012llu", root, (unsigned long long)sqe->step) < 0) {
		free(root);
		rdv_finish(j, SHD_JOB_CKPT, -SHARDD_E_NOMEM, "checkpoint: out of memory", 0, 0);
		return;
	}
	t.dir = dir;
	t.keep_root = root;
	ret = shd_engine_job_checkpoint(j->ejob, &t, ckpt_written, j, why, sizeof(why));
	free(dir);
	free(root);
	if (ret < 0) {
		snprintf(msg, sizeof(msg), "checkpoint(step %llu): %s",
			 (unsigned long long)sqe->step, why);
		rdv_finish(j, SHD_JOB_CKPT, ret, msg, 0, 0);
		return;
	}
	/* The ranks now wait for the write, not for each other. */
	for (uint32_t i = 0; i < rdv->nexpected; i++)
		if (rdv->arrived[i])
			j->ranks[rdv->ranks[i]].ckpt_waits = 1;
	shd_rdv_reset(rdv);
}

void shd_job_submit(struct shd_job *j, uint32_t rank, const struct shardd_sqe *sqe)
{
	switch (sqe->op) {
	case SHARDD_OP_BARRIER:
		job_barrier(j, rank, sqe);
		break;
	case SHARDD_OP_GRAD_NORM:
		job_grad_norm(j, rank, sqe);
		break;
	case SHARDD_OP_CHECKPOINT:
		job_checkpoint(j, rank, sqe);
		break;
	}
}

int shd_job_checkpoint_arm(struct shd_job *j, const char *dir, uint64_t *id, char *err,
			   size_t errlen)
{
	char *root = NULL;
	int ret;

	if (dir && dir[0] != '/') {
		snprintf(
			err, errlen,
			"checkpoint: directory '%s' is relative; the daemon needs an absolute path",
			dir);
		return -SHARDD_E_INVALID;
	}
	if (!dir && !env.state_dir) {
		snprintf(err, errlen,
			 "checkpoint: shardd has no --state-dir; name the directory (shardctl "
			 "checkpoint %s DIR) or restart shardd with --state-dir DIR",
			 j->name);
		return -SHARDD_E_INVALID;
	}
	if (env.state_dir && asprintf(&root, "%s/%s", env.state_dir, j->name) < 0) {
		snprintf(err, errlen, "checkpoint: out of memory");
		return -SHARDD_E_NOMEM;
	}
	ret = shd_engine_job_checkpoint_arm(j->ejob, dir, root, dir ? 0 : env.keep, id, err,
					    errlen);
	free(root);
	return ret;
}

void shd_job_cron(struct shd_job *j, uint64_t now_ns)
{
	static const enum shd_job_rdv_kind order[] = { SHD_JOB_GNORM, SHD_JOB_CKPT,
						       SHD_JOB_BARRIER };
	static const char *const did[SHD_JOB_NRDV] = {
		[SHD_JOB_BARRIER] = "did not arrive",
		[SHD_JOB_GNORM] = "did not submit grad_norm",
		[SHD_JOB_CKPT] = "did not submit checkpoint",
	};
	char within[32], label[64], late[2300], msg[2400];

	if (shd_job_ends_in_s(j, now_ns) == 0) {
		snprintf(msg, sizeof(msg),
			 "ended after %.1f s without an attached rank (--job-linger %g)",
			 (double)(now_ns - j->orphaned_ns) / 1e9, env.linger_s);
		shd_job_end(j, msg);
		return;
	}
	shd_job_gnorm_poll(j);
	for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++) {
		enum shd_job_rdv_kind k = order[i];
		struct shd_rdv *rdv = &j->rdv[k];

		/* A grad_norm summing across nodes has its own deadline. */
		if (!shd_rdv_expired(rdv, now_ns) ||
		    (k == SHD_JOB_GNORM && shd_engine_job_grad_norm_pending(j->ejob)))
			continue;
		snprintf(within, sizeof(within), "%g s", env.collective_timeout_s);
		shd_rdv_missing_msg(rdv, did[k], within, late, sizeof(late));
		rdv_label(label, sizeof(label), k, rdv->step);
		snprintf(msg, sizeof(msg), "%s: %s", label, late);
		shd_log_warn("job '%s': %s", j->name, msg);
		shd_rdv_expire(rdv, now_ns);
		rdv_finish(j, k, -SHARDD_E_TIMEOUT, msg, 0, 0);
	}
}

void shd_job_memory_held(const struct shd_job *j, struct shd_group_memory *m)
{
	for (uint32_t i = 1; i <= shd_engine_job_ngroups(j->ejob); i++) {
		const struct shd_group *g = shd_engine_job_group(j->ejob, i);

		if (g)
			shd_group_memory_held(g, m);
	}
}

void shd_jobs_memory_held(struct shd_group_memory *m)
{
	memset(m, 0, sizeof(*m));
	for (struct shd_job *j = *env.list; j; j = j->next)
		shd_job_memory_held(j, m);
}

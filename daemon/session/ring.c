/* SPDX-License-Identifier: MIT */
/*
 * The ring service: take a session's SQ entries while its CQ has room,
 * wait on each one's stream fence, check it against the op table
 * (op_table.h) and route it by its op's scope: complete it at once (nop),
 * hand it to the job (barrier, grad_norm, checkpoint) or to the engine
 * (group ops); push completions into the CQ; and arm NEED_WAKEUP before the loop sleeps. Every access to
 * the shared ring memory goes through proto/shardd_ring.h. At the end,
 * the sink through which a session's job reaches it.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "metrics.h"
#include "op_table.h"
#include "session_int.h"

/* A client that corrupted its own ring's indices: it is dropped, everyone else goes on. */
static void session_ring_corrupt(struct shd_session *s, const char *which)
{
	uint32_t sq_head, sq_tail, cq_head, cq_tail;
	char name[160], why[256];

	/* Snapshot for the message only; the client may be rewriting them as we read. */
	shardd_ring_indices(&s->ring, &sq_head, &sq_tail, &cq_head, &cq_tail);
	snprintf(
		why, sizeof(why),
		"was disconnected: ring %s index is corrupt (sq head %u tail %u, cq head %u tail %u)",
		which, sq_head, sq_tail, cq_head, cq_tail);
	shd_log_error("%s %s", shd_session_name(s, name, sizeof(name)), why);
	shd_session_close_later(s, why);
}

/*
 * CQ slots free for new reservations: >= 0, or -EBADMSG when the client's
 * CQ head is corrupt.
 */
static int64_t session_cq_room(struct shd_session *s)
{
	int64_t space = shardd_cq_space(&s->ring);

	if (space < 0)
		return space;
	/* A client that moved its head back shrinks the space under our reservations: no room. */
	return space > s->inflight ? space - s->inflight : 0;
}

void shd_session_complete(struct shd_session *s, const struct shardd_sqe *sqe, int res,
			  const char *msg)
{
	const struct shd_op_info *info = shd_op_info(sqe->op);
	struct shardd_cqe cqe;
	char name[160];

	/* A closing session's client is being dropped: its completions go nowhere. */
	if (s->state != SHD_SESSION_ATTACHED || s->closing)
		return;
	if (s->inflight == 0) {
		shd_log_error(
			"%s: completion of %s (step %llu) without a reserved CQ slot; dropped",
			shd_session_name(s, name, sizeof(name)), info ? info->name : "?",
			(unsigned long long)sqe->step);
		return;
	}
	if (shardd_cq_space(&s->ring) <= 0) {
		session_ring_corrupt(s, "CQ head");
		return;
	}
	memset(&cqe, 0, sizeof(cqe));
	cqe.user_data = sqe->user_data;
	cqe.res = res;
	cqe.op = sqe->op;
	cqe.group = sqe->group;
	cqe.step = sqe->step;
	/* grad_norm's result words travel in the arg words of the sqe the job completes with (job.c). */
	if (sqe->op == SHARDD_OP_GRAD_NORM && res >= 0)
		memcpy(cqe.result, sqe->arg, sizeof(cqe.result));
	/* A barrier mismatch names the barrier number met, the same way (job.c). */
	if (sqe->op == SHARDD_OP_BARRIER && res == -SHARDD_E_MISMATCH)
		memcpy(cqe.result, sqe->arg, sizeof(cqe.result));
	if ((sqe->fence & SHARDD_FENCE_SIGNAL) && s->fences) {
		struct shd_backend_ctx *b = shd_engine_backend(shd_session_env.engine);
		uint32_t slot = shardd_cq_next_slot(&s->ring);

		/* The client's stream waits on this record before it frees the slot for the next one. */
		if (b->ops->fence_signal(b, s->fences, slot) == 0) {
			cqe.fence = 1;
		} else if (res == 0) {
			res = -SHARDD_E_BACKEND;
			msg = "the op's work is queued, but signalling its stream event failed (see the "
			      "daemon's log): synchronise the device before reading the results";
		}
	}
	if (res < 0 && (!msg || !*msg))
		msg = res <= -SHARDD_E_BASE ? "shardd error" : strerror(-res);
	shardd_cq_push(&s->ring, &cqe, res < 0 ? msg : NULL);
	shd_metrics_op_done(sqe->op, res, shd_metrics_op_bytes(s->job, sqe),
			    shd_op_clock_stop(&s->clock, sqe, shd_now_ns()));
	s->inflight--;
	s->stats.ops_completed++;
	if (res < 0)
		s->stats.ops_failed++;
}

/* Fail an entry that does not validate; the message names the field and value. */
static void __attribute__((format(printf, 3, 4)))
session_fail_sqe(struct shd_session *s, const struct shardd_sqe *sqe, const char *fmt, ...)
{
	char msg[SHARDD_RING_MSG_SIZE];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	shd_session_complete(s, sqe, -SHARDD_E_INVALID, msg);
}

/*
 * The fence of the entry in SQ slot `slot`: with SHARDD_FENCE_WAIT, device
 * work queued from now on waits for the client's stream. Runs before the
 * slot goes back to the client, which re-records the slot's event only
 * after that. 0, or -SHARDD_E_INVALID (a bad fence field) or -SHARDD_E_BACKEND
 * (the backend's wait failed) with `err` naming the field and value.
 */
static int session_fence_wait(struct shd_session *s, const struct shardd_sqe *sqe, uint32_t slot,
			      char *err, size_t errlen)
{
	struct shd_backend_ctx *b;

	if (!sqe->fence)
		return 0;
	if (sqe->fence & ~SHARDD_FENCE_MASK) {
		snprintf(err, errlen, "sqe.fence = 0x%x has unknown bits 0x%x", sqe->fence,
			 sqe->fence & ~SHARDD_FENCE_MASK);
		return -SHARDD_E_INVALID;
	}
	if (!s->fences) {
		snprintf(err, errlen,
			 "sqe.fence = 0x%x, but this connection has no stream fences "
			 "(send SHARDD_MSG_STREAM first)",
			 sqe->fence);
		return -SHARDD_E_INVALID;
	}
	if (!(sqe->fence & SHARDD_FENCE_WAIT))
		return 0;
	b = shd_engine_backend(shd_session_env.engine);
	if (b->ops->fence_wait(b, s->fences, slot) < 0) {
		snprintf(err, errlen,
			 "sqe.fence: waiting on the stream event of SQ slot %u failed in "
			 "the %s backend (see the daemon's log)",
			 slot, b->ops->name);
		return -SHARDD_E_BACKEND;
	}
	return 0;
}

/* Check the entry against the op table, then route it by its op's scope. */
static void session_take(struct shd_session *s, const struct shardd_sqe *sqe)
{
	char why[SHARDD_RING_MSG_SIZE];

	if (shd_op_check(sqe, why, sizeof(why)) < 0) {
		session_fail_sqe(s, sqe, "%s", why);
		return;
	}
	switch (shd_op_info(sqe->op)->scope) {
	case SHD_OP_SCOPE_RING:
		shd_session_complete(s, sqe, 0, NULL);
		return;
	case SHD_OP_SCOPE_JOB:
		shd_job_submit(s->job, s->rank, sqe);
		return;
	case SHD_OP_SCOPE_GROUP:
		shd_engine_submit(s->job->ejob, s->rank, s->id, sqe);
		return;
	}
}

int shd_session_prepare_sleep(struct shd_session *s)
{
	if (s->state != SHD_SESSION_ATTACHED || s->closing)
		return 0;
	if (!shardd_ring_prepare_sleep(&s->ring))
		return 0;
	if (session_cq_room(s) > 0)
		return 1;
	/*
	 * Entries wait for CQ room that only the client can free by reaping:
	 * keep NEED_WAKEUP set so that its reap rings the doorbell (the
	 * accessor orders the flag before the cq_head load of the re-check).
	 */
	shardd_ring_arm_wakeup(&s->ring);
	return session_cq_room(s) > 0;
}

unsigned shd_session_service(struct shd_session *s)
{
	uint32_t budget = s->ring.sq_mask + 1; /* one SQ's worth per turn: fairness */
	unsigned taken = 0;

	while (s->state == SHD_SESSION_ATTACHED && !s->closing && s->job && taken < budget) {
		struct shardd_sqe sqe;
		int64_t ready = shardd_sq_ready(&s->ring);
		int64_t room;
		char why[SHARDD_RING_MSG_SIZE];
		int fenced;

		if (ready < 0) {
			session_ring_corrupt(s, "SQ tail");
			break;
		}
		if (ready == 0)
			break;
		room = session_cq_room(s);
		if (room < 0) {
			session_ring_corrupt(s, "CQ head");
			break;
		}
		if (room == 0)
			break;
		fenced = session_fence_wait(s, &sqe, shardd_sq_peek(&s->ring, &sqe), why,
					    sizeof(why));
		shardd_sq_release(&s->ring);
		shd_op_clock_start(&s->clock, &sqe, shd_now_ns());
		s->inflight++;
		s->stats.ops_taken++;
		s->stats.last_taken_op = sqe.op;
		s->stats.last_taken_step = sqe.step;
		/* Diagnostics only (shardctl, a stuck client): relaxed is enough. */
		shardd_ring_note_taken(&s->ring, sqe.op, sqe.step);
		if (fenced < 0)
			session_fail_sqe(s, &sqe, "%s", why);
		else
			session_take(s, &sqe);
		taken++;
	}
	return taken;
}

/* ------------------------------------------------------------------ */
/* The session as its job sees it                                      */
/* ------------------------------------------------------------------ */

static void sink_complete(void *ctx, const struct shardd_sqe *sqe, int res, const char *msg)
{
	shd_session_complete(ctx, sqe, res, msg);
}

static void sink_group_reply(void *ctx, uint32_t seq, int res, const char *msg,
			     const struct shardd_group_reply *reply,
			     const struct shardd_param_layout *layouts,
			     const struct shardd_param_spec *specs, const int *fds, int nfds,
			     const struct shardd_cuda_ipc_handle *ipc, int nipc)
{
	shd_session_send_group(ctx, seq, res, msg, reply, layouts, specs, fds, nfds, ipc, nipc);
}

static void sink_notify(void *ctx, int code, const char *text)
{
	shd_session_notify(ctx, code, text);
}

static int sink_gone(void *ctx)
{
	return shd_session_peer_gone(ctx);
}

static void sink_close(void *ctx, const char *why)
{
	shd_session_close(ctx, why);
}

static void sink_close_later(void *ctx, const char *why)
{
	shd_session_close_later(ctx, why);
}

static void sink_job_ended(void *ctx)
{
	struct shd_session *s = ctx;

	s->job = NULL;
}

const struct shd_rank_sink_ops shd_session_sink_ops = {
	.complete = sink_complete,
	.group_reply = sink_group_reply,
	.notify = sink_notify,
	.gone = sink_gone,
	.close = sink_close,
	.close_later = sink_close_later,
	.job_ended = sink_job_ended,
};

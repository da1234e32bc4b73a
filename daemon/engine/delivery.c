/* SPDX-License-Identifier: MIT */
/*
 * Messages and delivery of the engine (engine_int.h), loop thread: the
 * text of a failure, an op's completion and a register/open reply through
 * the engine's callbacks, the words of an expired rendezvous and of a
 * rank that arrives at it late. Below engine.c, registry.c, collective.c
 * and task.c, which all deliver through it; it calls none of them.
 */
#include <stdarg.h>
#include <stdio.h>

#include "engine_int.h"

void eng_fmt(char *buf, size_t len, const char *f, ...)
{
	va_list ap;

	va_start(ap, f);
	vsnprintf(buf, len, f, ap);
	va_end(ap);
}

void eng_reply_err(struct shd_engine_job *j, uint32_t rank, uint64_t token, uint32_t seq, int res,
		   const char *msg)
{
	j->e->cfg.reply(j->ctx, rank, token, seq, res, msg, NULL, NULL, NULL, NULL, 0, NULL, 0);
}

void eng_complete(struct shd_engine_job *j, const struct eng_op *op, int res, const char *msg)
{
	j->e->cfg.complete(j->ctx, op->rank, op->token, &op->sqe, res, res < 0 ? msg : NULL);
}

static void timeout_str(const struct shd_engine *e, char *buf, size_t len)
{
	uint64_t ms = e->timeout_ns / 1000000u;

	if (ms % 1000 == 0)
		eng_fmt(buf, len, "%llu s", (unsigned long long)(ms / 1000));
	else
		eng_fmt(buf, len, "%.3g s", (double)ms / 1000.0);
}

void eng_expired_msg(const struct shd_engine *e, const struct shd_rdv *rdv, const char *did,
		     char *err, size_t errlen)
{
	char within[32], late[ENGINE_MSG_MAX];

	timeout_str(e, within, sizeof(within));
	shd_rdv_missing_msg(rdv, did, within, late, sizeof(late));
	eng_fmt(err, errlen, "shardd: %s", late);
}

void eng_late_msg(const struct shd_engine *e, const struct shd_rdv *rdv, uint32_t rank,
		  const char *did, uint64_t now_ns, char *err, size_t errlen)
{
	char within[32], late[ENGINE_MSG_MAX];

	timeout_str(e, within, sizeof(within));
	shd_rdv_late_msg(rdv, rank, did, within, now_ns, late, sizeof(late));
	eng_fmt(err, errlen, "shardd: %s", late);
}

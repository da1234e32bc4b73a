/* SPDX-License-Identifier: MIT */
/*
 * Ops through the ring: submission with the doorbell, reaping of
 * completions (spin, then futex sleep in slices with a liveness check in
 * between), and the synchronous wrappers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/*
 * A ring round trip costs ~0.35 us spinning; waking a sleeping daemon on
 * another core costs 30-80 us on the VMs measured (docs/BENCHMARKS.md), so
 * a client that gives up sooner pays a second wake-up for its own futex.
 * The budget is time, not iterations: a pause instruction costs 10-140 ns
 * depending on the CPU. Every SHARDD_SPIN_CHECK iterations the spin also
 * yields the CPU: when processes outnumber cores the daemon (or another
 * rank) woken onto this CPU runs at once instead of waiting out the whole
 * budget (docs/BENCHMARKS.md, "where a 4 KiB collective's time goes"); on
 * an idle core sched_yield() returns at once.
 */
#define SHARDD_SPIN_NS       150000
#define SHARDD_SPIN_CHECK    8 /* iterations between clock reads and yields */
#define SHARDD_WAIT_SLICE_MS 50
/* Longest sleep on a peer's word while a rank-executed op waits, between looks at the CQ. */
#define SHARDD_EXEC_NAP_MS 1
/* Sync ops wait this much past the daemon's collective timeout, which fails them first. */
#define SHARDD_SYNC_GRACE_MS 10000

/*
 * Advance the pending ops of rank-executed groups (exec.c), then hand the
 * daemon the steps of the reduces among them that asked for one. The
 * number completed, or a negative code.
 */
static int exec_progress(struct shardd_client *c);

static const char *op_name(uint32_t op)
{
	const char *n = shardd_op_name(op);

	return n ? n : "unknown op";
}

/* --------------------------------------------------------------------- */
/* Ring                                                                  */
/* --------------------------------------------------------------------- */

static int ring_doorbell(struct shardd_client *c)
{
	uint64_t one = 1;
	ssize_t n;

	do
		n = write(c->doorbell, &one, sizeof(one));
	while (n < 0 && errno == EINTR);
	/* EAGAIN: the counter is saturated, so a wake-up is pending anyway. */
	if (n < 0 && errno != EAGAIN)
		return shardd_err_set(-errno, "write the doorbell eventfd: %s", strerror(errno));
	return 0;
}

static int corrupt_cq(struct shardd_client *c)
{
	uint32_t sq_head, sq_tail, cq_head, cq_tail;

	shardd_ring_indices(&c->ring, &sq_head, &sq_tail, &cq_head, &cq_tail);
	return shardd_err_set(-EBADMSG,
			      "completion queue corrupt: cq_tail %u runs more than %u entries "
			      "ahead of cq_head %u",
			      cq_tail, c->ring.cq_mask + 1, cq_head);
}

static int submit_sqe(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
		      uint32_t flags, const uint64_t *args, uint64_t user_data)
{
	struct shardd_sqe sqe = {
		.op = (uint8_t)op,
		.group = group,
		.step = step,
		.user_data = user_data,
		.flags = flags,
	};

	if (args) {
		sqe.arg[0] = args[0];
		sqe.arg[1] = args[1];
	}
	int64_t slot;
	int ret;

	if (op == 0 || op > UINT8_MAX)
		return shardd_err_set(-EINVAL, "op %u is out of range 1..%u", op, UINT8_MAX);
	slot = shardd_sq_next_slot(&c->ring);
	if (slot < 0)
		return shardd_err_set(-EAGAIN,
				      "submission queue full (%u entries waiting for the daemon); "
				      "reap completions, then submit again",
				      c->ring.sq_mask + 1);
	/* The slot is free, so the daemon is done with its event: record it for this entry. */
	ret = shardd_client_fence_submit(c, (uint32_t)slot, &sqe);
	if (ret < 0)
		return shardd_err_wrap(ret, "submit %s", op_name(op));
	/* Only this thread pushes: the slot is still the next one, and free. */
	shardd_sq_publish(&c->ring, (uint32_t)slot, &sqe);
	/* Line 6 is ours; the daemon and shardctl read it only to show who is behind. */
	shardd_ring_note_submitted(&c->ring, op, step);
	if (shardd_ring_needs_wakeup(&c->ring))
		return ring_doorbell(c);
	return 0;
}

/* Pop one CQ entry into *out: 1, 0 when there is none, or -EBADMSG. */
static int cq_take(struct shardd_client *c, struct shardd_completion *out)
{
	int64_t n = shardd_cq_ready(&c->ring);
	struct shardd_cqe cqe;
	uint32_t slot;

	if (n < 0)
		return corrupt_cq(c);
	if (n == 0)
		return 0;
	slot = shardd_cq_peek(&c->ring, &cqe, out->msg, sizeof(out->msg));
	out->user_data = cqe.user_data;
	out->res = cqe.res;
	out->op = cqe.op;
	out->group = cqe.group;
	out->step = cqe.step;
	out->result[0] = cqe.result[0];
	out->result[1] = cqe.result[1];
	/* Before the release: the daemon records this slot's event again once it is free. */
	if (cqe.fence)
		shardd_client_fence_reap(c, slot, out);
	shardd_cq_release(&c->ring);
	/*
	 * A daemon that stopped taking SQ entries because our CQ was full may
	 * sleep on the doorbell: the slot we just freed is news for it.
	 */
	if (shardd_sq_ready(&c->ring) != 0 && shardd_ring_needs_wakeup(&c->ring)) {
		int ret = ring_doorbell(c);

		if (ret < 0)
			return ret;
	}
	return 1;
}

/* Spin a bounded while for a completion: >0 ready, 0 none, -EBADMSG. */
static int spin_cq(struct shardd_client *c)
{
	int64_t until = shardd_client_now_ns() + SHARDD_SPIN_NS;

	for (unsigned i = 1;; i++) {
		int64_t n = shardd_cq_ready(&c->ring);

		if (n < 0)
			return corrupt_cq(c);
		if (n > 0)
			return 1;
		/* A rank-executed op that completed here counts as one that came. */
		if (shardd_exec_pending(c) && exec_progress(c) != 0)
			return 1;
		if (i % SHARDD_SPIN_CHECK == 0) {
			if (shardd_client_now_ns() >= until)
				return 0;
			sched_yield();
			continue;
		}
		shardd_cpu_relax();
	}
}

/*
 * Sleep on the CQ tail for one slice (at most SHARDD_WAIT_SLICE_MS and the
 * deadline, -1 = none), then check that the daemon lives. Returns 0 (a
 * completion came or the slice ended), -ETIMEDOUT (deadline passed),
 * -ECONNRESET, or another negative code.
 */
static int sleep_cq(struct shardd_client *c, int64_t deadline)
{
	int64_t slice = SHARDD_WAIT_SLICE_MS;
	struct timespec ts;
	uint32_t seen;
	int64_t n;
	int ret;

	if (deadline >= 0) {
		int64_t left = deadline - shardd_client_now_ms();

		if (left <= 0)
			return -ETIMEDOUT;
		if (left < slice)
			slice = left;
	}
	/* The value we sleep on must be read before the re-check, or a push is missed. */
	seen = shardd_cq_tail_seen(&c->ring);
	n = shardd_cq_ready(&c->ring);
	if (n < 0)
		return corrupt_cq(c);
	if (n > 0)
		return 0;
	ts.tv_sec = slice / 1000;
	ts.tv_nsec = slice % 1000 * 1000000;
	if (shardd_exec_pending(c)) {
		/*
		 * A rank-executed op waits for a peer: sleep on the peer's word (it
		 * wakes us when it publishes) in short naps, so the CQ is looked at too.
		 */
		shardd_exec_nap(c, slice < SHARDD_EXEC_NAP_MS ? slice * 1000000
							      : SHARDD_EXEC_NAP_MS * 1000000);
		ret = 0;
	} else {
		ret = shardd_cq_wait(&c->ring, seen, &ts);
	}
	if (ret < 0 && ret != -ETIMEDOUT && ret != -EINTR)
		return shardd_err_set(ret, "futex wait on the completion queue: %s",
				      shardd_strerror(ret));
	n = shardd_cq_ready(&c->ring);
	if (n < 0)
		return corrupt_cq(c);
	/* Completions pushed before a daemon died are still delivered first. */
	if (n > 0)
		return 0;
	ret = shardd_client_check_alive(c);
	/* Rank-executed ops then fail with the reason, as completions, as the daemon's would. */
	if (ret < 0 && shardd_exec_pending(c)) {
		int failed = shardd_exec_fail_all(c, ret, shardd_last_error());

		return failed < 0 ? failed : 0;
	}
	return ret;
}

/* Describe where the ring stands, for timeout messages. */
static void ring_where(struct shardd_client *c, char *buf, size_t len)
{
	struct shardd_ring_status st;

	if (shardd_client_ring_status(c, &st) < 0) {
		snprintf(buf, len, "ring counters corrupt");
		return;
	}
	snprintf(buf, len,
		 "the daemon last took %s step %llu from this ring; %u submissions "
		 "not taken yet",
		 st.daemon_last_op ? op_name(st.daemon_last_op) : "nothing",
		 (unsigned long long)st.daemon_last_step, st.sq_pending);
}

/* --------------------------------------------------------------------- */
/* Public: asynchronous ops                                              */
/* --------------------------------------------------------------------- */

/* The public submissions' check: user_data's reserved bit belongs to the sync calls. */
static int check_user_data(uint32_t op, uint64_t user_data)
{
	shardd_err_clear();
	if (user_data & SHARDD_USER_DATA_RESERVED)
		return shardd_err_set(-EINVAL,
				      "submit %s: user_data %#llx has bit 63 set, which libshardd "
				      "reserves for its sync calls",
				      op_name(op), (unsigned long long)user_data);
	return 0;
}

static int submit_user(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
		       uint32_t flags, uint64_t user_data)
{
	int ret = check_user_data(op, user_data);

	return ret ? ret : submit_sqe(c, op, group, step, flags, NULL, user_data);
}

/* The ops a rank-executed group runs in this process (exec.c), not in the daemon. */
static int exec_op(const struct shardd_group *g, uint32_t op)
{
	return g->x &&
	       (op == SHARDD_OP_UNSHARD || op == SHARDD_OP_REDUCE || op == SHARDD_OP_RESHARD);
}

int shardd_group_submit(struct shardd_group *g, uint32_t op, uint64_t step, uint32_t flags,
			uint64_t user_data)
{
	int ret;

	if (!exec_op(g, op))
		return submit_user(g->client, op, g->info.group_id, step, flags, user_data);
	ret = check_user_data(op, user_data);
	return ret ? ret : shardd_exec_submit(g, op, step, flags, NULL, user_data, NULL, NULL);
}

int shardd_client_submit(struct shardd_client *c, uint32_t op, uint64_t step, uint32_t flags,
			 uint64_t user_data)
{
	return submit_user(c, op, 0, step, flags, user_data);
}

int shardd_submit(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
		  uint32_t flags, uint64_t user_data)
{
	return submit_user(c, op, group, step, flags, user_data);
}

static int poll_one(struct shardd_client *c, struct shardd_completion *out)
{
	if (shardd_exec_pending(c)) {
		int ret = exec_progress(c);

		if (ret < 0)
			return ret;
	}
	for (;;) {
		int ret;

		if (shardd_stash_pop(&c->stash, out))
			return 0;
		ret = cq_take(c, out);
		if (ret <= 0)
			return ret ? ret : -EAGAIN;
		/* A sync call that gave up (timeout, reset) left its completion: not the caller's. */
		if (!(out->user_data & SHARDD_USER_DATA_RESERVED))
			return 0;
	}
}

int shardd_poll(struct shardd_client *c, struct shardd_completion *out)
{
	shardd_err_clear();
	return poll_one(c, out);
}

int shardd_wait(struct shardd_client *c, struct shardd_completion *out, int timeout_ms)
{
	int64_t deadline = timeout_ms < 0 ? -1 : shardd_client_now_ms() + timeout_ms;
	char where[160];
	int ret;

	shardd_err_clear();
	ret = poll_one(c, out);
	if (ret != -EAGAIN)
		return ret;
	ret = timeout_ms == 0 ? 0 : spin_cq(c);
	while (ret == 0 || ret == 1) {
		ret = poll_one(c, out);
		if (ret != -EAGAIN)
			return ret;
		ret = sleep_cq(c, deadline);
	}
	if (ret == -ETIMEDOUT) {
		ring_where(c, where, sizeof(where));
		/* Nothing came: tell the caller whether the daemon at least lives. */
		ret = shardd_client_check_alive(c);
		if (ret == 0)
			ret = shardd_err_set(-ETIMEDOUT, "no completion within %d ms; %s",
					     timeout_ms, where);
	}
	return ret;
}

/* --------------------------------------------------------------------- */
/* Public: synchronous ops                                               */
/* --------------------------------------------------------------------- */

/* Move completions to the stash until `want` arrives (1, in *cp) or the CQ is empty (0). */
static int reap_until(struct shardd_client *c, uint64_t want, struct shardd_completion *cp)
{
	for (;;) {
		int ret = cq_take(c, cp);

		if (ret <= 0)
			return ret;
		if (cp->user_data == want)
			return 1;
		if (cp->user_data & SHARDD_USER_DATA_RESERVED)
			continue;
		ret = shardd_stash_push(&c->stash, cp);
		if (ret < 0)
			return ret;
	}
}

/*
 * The daemon's REDUCE entry of a rank-executed reduce with
 * SHARDD_REDUCE_STEP that ran here (the step only; its completion is the
 * op's), waiting out a full SQ: the reduce is done, so it is never retried
 * from the top. 0 or a code.
 */
static int submit_exec_step(struct shardd_client *c, const struct shardd_exec_step *s)
{
	uint32_t ct = c->welcome.collective_timeout_ms;
	int64_t deadline = ct ? shardd_client_now_ms() + ct + SHARDD_SYNC_GRACE_MS : -1;
	struct shardd_completion cp;
	int ret;

	while ((ret = submit_sqe(c, SHARDD_OP_REDUCE, s->group_id, s->step, s->flags, s->args,
				 s->user_data)) == -EAGAIN) {
		ret = reap_until(c, SHARDD_USER_DATA_RESERVED, &cp);
		if (ret == 0)
			ret = sleep_cq(c, deadline);
		if (ret < 0)
			return ret;
	}
	return ret;
}

static int exec_progress(struct shardd_client *c)
{
	struct shardd_exec_step s;
	int done = shardd_exec_progress(c), ret;

	while (done >= 0 && shardd_exec_next_step(c, &s)) {
		ret = submit_exec_step(c, &s);
		if (ret < 0)
			return ret;
	}
	return done;
}

/*
 * A rank-executed group's op as a sync call: submitted, then advanced here
 * (and any other pending op with it) until it completes; completions of
 * other ops meanwhile go to the stash. Returns its res, with context.
 */
static int exec_sync(struct shardd_group *g, uint32_t op, uint64_t step, uint32_t flags,
		     const char *what)
{
	struct shardd_client *c = g->client;
	struct shardd_completion cp, other;
	int finished = 0, ret;

	ret = shardd_exec_submit(g, op, step, flags, NULL, 0, &cp, &finished);
	while (!ret && !finished) {
		ret = exec_progress(c);
		if (ret >= 0 && !finished)
			ret = reap_until(c, SHARDD_USER_DATA_RESERVED, &other);
		if (ret >= 0 && !finished && spin_cq(c) == 0 && !finished)
			ret = sleep_cq(c, -1);
		ret = ret > 0 ? 0 : ret;
	}
	if (ret < 0)
		return shardd_err_wrap(ret, "%s", what);
	if (cp.res < 0) {
		shardd_err_set(cp.res, "%s", cp.msg);
		return shardd_err_wrap(cp.res, "%s", what);
	}
	/* The step a reduce asks for is the daemon's. */
	if (op == SHARDD_OP_REDUCE && (flags & SHARDD_REDUCE_STEP))
		return shardd_client_op_sync(c, op, g->info.group_id, step, flags, what);
	return 0;
}

int shardd_client_op_sync(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
			  uint32_t flags, const char *what)
{
	return shardd_client_op_sync_args(c, op, group, step, flags, NULL, what);
}

static int op_sync_cp(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
		      uint32_t flags, const uint64_t *args, const char *what,
		      struct shardd_completion *out);

int shardd_client_op_sync_args(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
			       uint32_t flags, const uint64_t *args, const char *what)
{
	struct shardd_completion cp;

	return op_sync_cp(c, op, group, step, flags, args, what, &cp);
}

/* shardd_client_op_sync_args, with the op's completion in *out when it came. */
static int op_sync_cp(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
		      uint32_t flags, const uint64_t *args, const char *what,
		      struct shardd_completion *out)
{
	uint32_t ct = c->welcome.collective_timeout_ms;
	int64_t deadline = ct ? shardd_client_now_ms() + ct + SHARDD_SYNC_GRACE_MS : -1;
	uint64_t ud = SHARDD_USER_DATA_RESERVED | (++c->next_sync & ~SHARDD_USER_DATA_RESERVED);
	struct shardd_completion *cp = out;
	char where[160];
	int ret;

	shardd_err_clear();
	/* A full SQ drains as the daemon works; reap meanwhile so its CQ never fills. */
	while ((ret = submit_sqe(c, op, group, step, flags, args, ud)) == -EAGAIN) {
		ret = reap_until(c, ud, cp);
		if (ret == 0)
			ret = sleep_cq(c, deadline);
		if (ret < 0)
			goto err;
	}
	if (ret < 0)
		goto err;
	for (;;) {
		ret = reap_until(c, ud, cp);
		if (ret < 0)
			goto err;
		if (ret == 1)
			break;
		ret = spin_cq(c);
		if (ret == 0)
			ret = sleep_cq(c, deadline);
		if (ret < 0)
			goto err;
	}
	if (cp->res < 0) {
		if (cp->msg[0])
			shardd_err_set(cp->res, "daemon: %s", cp->msg);
		else
			shardd_err_set(cp->res, "daemon: %s", shardd_strerror(cp->res));
		return shardd_err_wrap(cp->res, "%s", what);
	}
	return cp->res;
err:
	if (ret == -ETIMEDOUT) {
		ring_where(c, where, sizeof(where));
		shardd_err_set(ret,
			       "no completion within %u ms (the daemon's collective timeout "
			       "+ %d s); %s",
			       ct + SHARDD_SYNC_GRACE_MS, SHARDD_SYNC_GRACE_MS / 1000, where);
	}
	return shardd_err_wrap(ret, "%s", what);
}

int shardd_nop(struct shardd_client *c)
{
	return shardd_client_op_sync(c, SHARDD_OP_NOP, 0, 0, 0, "nop");
}

int shardd_barrier(struct shardd_client *c, uint64_t barrier_number)
{
	char what[64];

	snprintf(what, sizeof(what), "barrier %llu", (unsigned long long)barrier_number);
	return shardd_client_op_sync(c, SHARDD_OP_BARRIER, 0, barrier_number, 0, what);
}

int shardd_checkpoint(struct shardd_client *c, uint64_t step)
{
	char what[64];

	snprintf(what, sizeof(what), "checkpoint step %llu", (unsigned long long)step);
	return shardd_client_op_sync(c, SHARDD_OP_CHECKPOINT, 0, step, 0, what);
}

static int group_op(struct shardd_group *g, uint32_t op, uint64_t step, uint32_t flags)
{
	char what[SHARDD_NAME_MAX + 96];

	snprintf(what, sizeof(what), "%s group '%s' (id %u) step %llu", op_name(op), g->name,
		 g->info.group_id, (unsigned long long)step);
	if (!exec_op(g, op))
		return shardd_client_op_sync(g->client, op, g->info.group_id, step, flags, what);
	shardd_err_clear();
	return exec_sync(g, op, step, flags, what);
}

int shardd_unshard(struct shardd_group *g, uint64_t step)
{
	return group_op(g, SHARDD_OP_UNSHARD, step, 0);
}

int shardd_reduce(struct shardd_group *g, uint64_t step, uint32_t flags)
{
	return group_op(g, SHARDD_OP_REDUCE, step, flags);
}

int shardd_reshard(struct shardd_group *g, uint64_t step)
{
	return group_op(g, SHARDD_OP_RESHARD, step, 0);
}

int shardd_zero_grad(struct shardd_group *g)
{
	return group_op(g, SHARDD_OP_ZERO_GRAD, 0, 0);
}

static void step_args(uint64_t args[2], double lr, uint32_t flags, double clip_coef,
		      double max_norm)
{
	args[0] = args[1] = 0;
	if (flags & SHARDD_STEP_REPLAY)
		return; /* the daemon takes both from the step the other ranks submitted */
	memcpy(&args[SHARDD_SQE_STEP_LR], &lr, sizeof(lr));
	/* One word on the wire for either: the flag tells the daemon which it holds. */
	if (flags & SHARDD_STEP_CLIP)
		memcpy(&args[SHARDD_SQE_STEP_CLIP], &clip_coef, sizeof(clip_coef));
	else if (flags & SHARDD_STEP_CLIP_JOB)
		memcpy(&args[SHARDD_SQE_STEP_CLIP], &max_norm, sizeof(max_norm));
}

int shardd_step_submit(struct shardd_group *g, uint64_t step, double lr, uint32_t flags,
		       double clip_coef, double max_norm, uint64_t user_data)
{
	uint64_t args[2];

	if (user_data & SHARDD_USER_DATA_RESERVED)
		return shardd_err_set(-EINVAL, "user_data 0x%llx has SHARDD_USER_DATA_RESERVED set",
				      (unsigned long long)user_data);
	step_args(args, lr, flags, clip_coef, max_norm);
	return submit_sqe(g->client, SHARDD_OP_STEP, g->info.group_id, step, flags, args,
			  user_data);
}

int shardd_reduce_step_submit(struct shardd_group *g, uint64_t step, uint32_t flags, double lr,
			      uint64_t user_data)
{
	uint64_t args[2];

	if (user_data & SHARDD_USER_DATA_RESERVED)
		return shardd_err_set(-EINVAL, "user_data 0x%llx has SHARDD_USER_DATA_RESERVED set",
				      (unsigned long long)user_data);
	step_args(args, lr, 0, 0, 0);
	if (g->x)
		return shardd_exec_submit(g, SHARDD_OP_REDUCE, step, flags | SHARDD_REDUCE_STEP,
					  args, user_data, NULL, NULL);
	return submit_sqe(g->client, SHARDD_OP_REDUCE, g->info.group_id, step,
			  flags | SHARDD_REDUCE_STEP, args, user_data);
}

int shardd_step(struct shardd_group *g, uint64_t step, double lr, uint32_t flags, double clip_coef,
		double max_norm)
{
	uint64_t args[2];
	char what[SHARDD_NAME_MAX + 96];

	step_args(args, lr, flags, clip_coef, max_norm);
	snprintf(what, sizeof(what), "step group '%s' (id %u) step %llu", g->name, g->info.group_id,
		 (unsigned long long)step);
	return shardd_client_op_sync_args(g->client, SHARDD_OP_STEP, g->info.group_id, step, flags,
					  args, what);
}

static int grad_norm_args(uint64_t args[1], double norm_type)
{
	if (norm_type != 2.0 && !(isinf(norm_type) && norm_type > 0))
		return shardd_err_set(
			-EINVAL, "grad_norm: norm_type %g is not supported: use 2.0 or INFINITY",
			norm_type);
	memcpy(&args[SHARDD_SQE_GRAD_NORM_TYPE], &norm_type, sizeof(norm_type));
	return 0;
}

int shardd_grad_norm_submit(struct shardd_client *c, uint64_t step, double norm_type,
			    uint64_t user_data)
{
	uint64_t args[2] = { 0 };
	int ret;

	if (user_data & SHARDD_USER_DATA_RESERVED)
		return shardd_err_set(-EINVAL, "user_data 0x%llx has SHARDD_USER_DATA_RESERVED set",
				      (unsigned long long)user_data);
	ret = grad_norm_args(args, norm_type);
	if (ret < 0)
		return ret;
	return submit_sqe(c, SHARDD_OP_GRAD_NORM, 0, step, 0, args, user_data);
}

void shardd_grad_norm_result(const struct shardd_completion *cp, double *norm, int *nonfinite)
{
	memcpy(norm, &cp->result[0], sizeof(*norm));
	*nonfinite = cp->result[1] != 0;
}

int shardd_grad_norm(struct shardd_client *c, uint64_t step, double norm_type, double *norm,
		     int *nonfinite)
{
	uint64_t args[2] = { 0 };
	struct shardd_completion cp;
	char what[96];
	int ret;

	shardd_err_clear();
	ret = grad_norm_args(args, norm_type);
	if (ret < 0)
		return ret;
	snprintf(what, sizeof(what), "grad_norm step %llu norm_type %g", (unsigned long long)step,
		 norm_type);
	ret = op_sync_cp(c, SHARDD_OP_GRAD_NORM, 0, step, 0, args, what, &cp);
	if (ret < 0)
		return ret;
	shardd_grad_norm_result(&cp, norm, nonfinite);
	return 0;
}

/* --------------------------------------------------------------------- */
/* Public: diagnostics                                                   */
/* --------------------------------------------------------------------- */

int shardd_client_ring_status(const struct shardd_client *c, struct shardd_ring_status *st)
{
	/* The ring's own checks, against our copies of the capacities. */
	int64_t sq_pending = shardd_sq_ready(&c->ring);
	int64_t cq_ready = shardd_cq_ready(&c->ring);

	memset(st, 0, sizeof(*st));
	st->sq_entries = c->ring.sq_mask + 1;
	st->cq_entries = c->ring.cq_mask + 1;
	if (sq_pending < 0 || cq_ready < 0)
		return -EBADMSG;
	st->sq_pending = (uint32_t)sq_pending;
	st->cq_ready = (uint32_t)cq_ready;
	st->flags = shardd_ring_flags(&c->ring);
	shardd_ring_daemon_last(&c->ring, &st->daemon_last_op, &st->daemon_last_step,
				&st->daemon_heartbeat_ns);
	shardd_ring_client_last(&c->ring, &st->client_last_op, &st->client_last_step);
	return 0;
}

int shardd_ring_status(const struct shardd_client *c, struct shardd_ring_status *st)
{
	return shardd_client_ring_status(c, st);
}

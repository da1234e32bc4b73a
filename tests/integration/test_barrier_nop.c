/* SPDX-License-Identifier: MIT */
/*
 * Barriers and nops between real client processes and a real shardd:
 * streams of async nops matched by user_data, a rank killed inside a
 * barrier (the others fail fast, naming it, and the rank can come back),
 * a barrier that times out naming the missing rank, and a daemon stopped
 * or killed while clients wait (they never hang).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define NOPS_PER_RANK 100000u
#define CHILD_WAIT_MS 30000
#define COLLECTIVE_S  "5"
/* Death is seen through socket EOF / pidfd: far below the 5 s collective timeout. */
#define DEATH_BOUND_MS 2500

static struct harness_daemon daemon_;

/* Tests that stopped the daemon themselves leave nothing to stop: status 0. */
static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(barrier_nop, .fini = stop_daemon, .timeout = 60);

static void start_daemon(const char *collective_timeout_s)
{
	const char *extra[] = { "--collective-timeout", collective_timeout_s, NULL };

	signal(SIGPIPE, SIG_IGN);
	cr_assert_eq(harness_daemon_start(&daemon_, extra), 0, "shardd did not start");
}

struct rank_args {
	const char *job;
	uint32_t rank;
	uint32_t world;
	int report_fd; /* write end: the child says where it is */
	int hold_fd;   /* read end: the child blocks on it until killed */
};

static void wait_children(const pid_t *pids, int n, const char *what)
{
	for (int i = 0; i < n; i++) {
		int status = 0, ret = harness_wait_or_kill(pids[i], CHILD_WAIT_MS, &status);

		if (ret < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
			harness_daemon_dump_log(&daemon_);
		cr_assert_eq(ret, 0, "%s child %d did not finish: %s", what, i, strerror(-ret));
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s child %d %s", what, i,
			  harness_status_str(status));
	}
}

/* Wait, without sleeping, until the daemon has taken op `op` (step) from our SQ. */
static int wait_taken(struct shardd_client *c, uint32_t op, uint64_t step, int timeout_ms)
{
	int64_t deadline = harness_now_ms() + timeout_ms;
	struct shardd_ring_status st;

	do {
		if (shardd_client_ring_status(c, &st) < 0)
			return -EBADMSG;
		if (st.sq_pending == 0 && st.daemon_last_op == op && st.daemon_last_step == step)
			return 0;
		sched_yield();
	} while (harness_now_ms() < deadline);
	return -ETIMEDOUT;
}

/* ------------------------------------------------------------------ */
/* 4 ranks x 100 000 async nops                                        */
/* ------------------------------------------------------------------ */

static int nop_stream_rank(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_completion cp;
	uint64_t submitted = 0, done = 0, inflight = 0, cap;
	unsigned char *seen = calloc(NOPS_PER_RANK, 1);
	int ret;

	CHILD_CHECK(seen, "out of memory");
	ret = harness_attach(&daemon_, a->job, a->rank, 1, a->world, &c);
	CHILD_CHECK(ret == 0, "attach: %s", shardd_last_error());
	ret = shardd_barrier(c, 1);
	CHILD_CHECK(ret == 0, "first barrier: %s", shardd_last_error());
	cap = shardd_client_ring_entries(c);
	while (done < NOPS_PER_RANK) {
		uint64_t idx;

		/* Keep the ring full: the daemon must keep up with a full SQ. */
		while (submitted < NOPS_PER_RANK && inflight < cap) {
			ret = shardd_client_submit(c, SHARDD_OP_NOP, submitted, 0,
						   (uint64_t)a->rank << 32 | submitted);
			if (ret == -EAGAIN)
				break;
			CHILD_CHECK(ret == 0, "submit %llu: %s", (unsigned long long)submitted,
				    shardd_last_error());
			submitted++;
			inflight++;
		}
		/* Now and then a sync nop overtakes the stream; the stream's completions wait for us. */
		if (submitted % 25000 == 0 && submitted < NOPS_PER_RANK && inflight == cap) {
			ret = shardd_nop(c);
			CHILD_CHECK(ret == 0, "sync nop amid the stream: %s", shardd_last_error());
		}
		ret = shardd_wait(c, &cp, 10000);
		CHILD_CHECK(ret == 0, "wait after %llu of %u: %s", (unsigned long long)done,
			    NOPS_PER_RANK, shardd_last_error());
		idx = cp.user_data & 0xffffffffu;
		CHILD_CHECK(cp.res == 0, "nop %llu failed: %d %s", (unsigned long long)idx, cp.res,
			    cp.msg);
		CHILD_CHECK(cp.op == SHARDD_OP_NOP, "completion op %u", cp.op);
		CHILD_CHECK(cp.user_data >> 32 == a->rank, "user_data %#llx is not ours",
			    (unsigned long long)cp.user_data);
		CHILD_CHECK(idx < submitted, "completion %llu was never submitted",
			    (unsigned long long)idx);
		CHILD_CHECK(!seen[idx], "completion %llu arrived twice", (unsigned long long)idx);
		CHILD_CHECK(cp.step == idx, "completion %llu has step %llu",
			    (unsigned long long)idx, (unsigned long long)cp.step);
		seen[idx] = 1;
		done++;
		inflight--;
	}
	CHILD_CHECK(shardd_poll(c, &cp) == -EAGAIN, "a completion beyond the %u submitted",
		    NOPS_PER_RANK);
	ret = shardd_barrier(c, 2);
	CHILD_CHECK(ret == 0, "last barrier: %s", shardd_last_error());
	shardd_close(c);
	free(seen);
	return 0;
}

Test(barrier_nop, four_ranks_stream_100k_nops_each_every_completion_matched, .timeout = 120)
{
	struct rank_args args[4];
	pid_t pids[4];

	start_daemon(COLLECTIVE_S);
	for (uint32_t r = 0; r < 4; r++) {
		args[r] = (struct rank_args){ .job = "nops", .rank = r, .world = 4 };
		pids[r] = harness_fork(nop_stream_rank, &args[r]);
		cr_assert_gt(pids[r], 0);
	}
	wait_children(pids, 4, "nop stream");
}

/* ------------------------------------------------------------------ */
/* A rank dies in a barrier                                            */
/* ------------------------------------------------------------------ */

static int victim_rank(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	char b;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, a->world, &c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(harness_signal(a->report_fd, 'a') == 0, "report");
	/* Never written: the parent kills us while we hold the rank. */
	harness_read_full(a->hold_fd, &b, 1, CHILD_WAIT_MS);
	return 2;
}

static int survivor_rank(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_completion cp;
	int64_t t0;
	int ret;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, a->world, &c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(shardd_client_submit(c, SHARDD_OP_BARRIER, 1, 0, 77) == 0, "%s",
		    shardd_last_error());
	ret = wait_taken(c, SHARDD_OP_BARRIER, 1, 5000);
	CHILD_CHECK(ret == 0, "the daemon never took barrier 1 from the SQ");
	CHILD_CHECK(harness_signal(a->report_fd, 't') == 0, "report");
	t0 = harness_now_ms();
	ret = shardd_wait(c, &cp, 10000);
	CHILD_CHECK(ret == 0, "waiting in the barrier: %s", shardd_last_error());
	CHILD_CHECK(harness_now_ms() - t0 < DEATH_BOUND_MS, "the barrier failed only after %lld ms",
		    (long long)(harness_now_ms() - t0));
	CHILD_CHECK(cp.user_data == 77 && cp.op == SHARDD_OP_BARRIER && cp.step == 1,
		    "completion user_data %llu op %u step %llu", (unsigned long long)cp.user_data,
		    cp.op, (unsigned long long)cp.step);
	CHILD_CHECK(cp.res == -SHARDD_E_PEER_DIED, "barrier res %d (%s): %s", cp.res,
		    shardd_strerror(cp.res), cp.msg);
	CHILD_CHECK(strstr(cp.msg, "rank 3"), "the error does not name rank 3: %s", cp.msg);
	shardd_close(c);
	return 0;
}

static int barrier_rank(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	int ret;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, a->world, &c) == 0, "attach: %s",
		    shardd_last_error());
	ret = shardd_barrier(c, 2);
	CHILD_CHECK(ret == 0, "barrier 2: %s", shardd_last_error());
	shardd_close(c);
	return 0;
}

Test(barrier_nop, rank_killed_in_a_barrier_fails_the_others_fast_and_can_come_back, .timeout = 60)
{
	int report[2], hold[2], status = 0;
	struct rank_args args[4];
	struct shardd_client *c = NULL;
	pid_t pids[4], victim;
	int64_t t_kill;
	char b;

	start_daemon(COLLECTIVE_S);
	cr_assert_eq(pipe(report), 0);
	cr_assert_eq(pipe(hold), 0);
	for (uint32_t r = 0; r < 4; r++)
		args[r] = (struct rank_args){ .job = "dies",
					      .rank = r,
					      .world = 4,
					      .report_fd = report[1],
					      .hold_fd = hold[0] };
	victim = harness_fork(victim_rank, &args[3]);
	cr_assert_gt(victim, 0);
	cr_assert_eq(harness_read_full(report[0], &b, 1, 10000), 0, "rank 3 did not attach");
	cr_assert_eq(b, 'a');
	for (int r = 0; r < 3; r++) {
		pids[r] = harness_fork(survivor_rank, &args[r]);
		cr_assert_gt(pids[r], 0);
	}
	for (int r = 0; r < 3; r++) {
		cr_assert_eq(harness_read_full(report[0], &b, 1, 10000), 0,
			     "ranks 0-2 did not all enter barrier 1");
		cr_assert_eq(b, 't');
	}
	t_kill = harness_now_ms();
	cr_assert_eq(kill(victim, SIGKILL), 0);
	cr_assert_eq(harness_wait_pid(victim, 5000, &status), 0);
	cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
	wait_children(pids, 3, "survivor");
	cr_assert_lt(harness_now_ms() - t_kill, DEATH_BOUND_MS,
		     "survivors took %lld ms to learn of the death",
		     (long long)(harness_now_ms() - t_kill));

	/* The job survived its rank: a new process takes rank 3 and the barrier works again. */
	cr_assert_eq(harness_attach(&daemon_, "dies", 3, 1, 4, &c), 0, "%s", shardd_last_error());
	for (int r = 0; r < 3; r++) {
		pids[r] = harness_fork(barrier_rank, &args[r]);
		cr_assert_gt(pids[r], 0);
	}
	cr_assert_eq(shardd_barrier(c, 2), 0, "%s", shardd_last_error());
	wait_children(pids, 3, "barrier 2");
	shardd_close(c);
	close(report[0]);
	close(report[1]);
	close(hold[0]);
	close(hold[1]);
}

Test(barrier_nop, barrier_missing_a_rank_times_out_naming_it, .timeout = 30)
{
	struct shardd_client *c = NULL;
	int64_t t0;
	int ret;

	start_daemon("1");
	cr_assert_eq(harness_attach(&daemon_, "lonely", 0, 1, 2, &c), 0);
	t0 = harness_now_ms();
	ret = shardd_barrier(c, 5);
	cr_assert_eq(ret, -SHARDD_E_TIMEOUT, "barrier gave %d (%s): %s", ret, shardd_strerror(ret),
		     shardd_last_error());
	cr_assert_geq(harness_now_ms() - t0, 900, "timed out before the collective timeout");
	cr_assert_not_null(strstr(shardd_last_error(), "barrier 5: daemon: "), "%s",
			   shardd_last_error());
	cr_assert_not_null(strstr(shardd_last_error(), "rank 1"), "%s", shardd_last_error());
	/* The client is still good after a failed op. */
	cr_assert_eq(shardd_nop(c), 0, "%s", shardd_last_error());
	shardd_close(c);
}

/* ------------------------------------------------------------------ */
/* The daemon goes away while clients wait                             */
/* ------------------------------------------------------------------ */

static int waiter_rank(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_completion cp;
	int ret;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, a->world, &c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(shardd_client_submit(c, SHARDD_OP_BARRIER, 1, 0, 5) == 0, "%s",
		    shardd_last_error());
	CHILD_CHECK(wait_taken(c, SHARDD_OP_BARRIER, 1, 5000) == 0, "barrier 1 never taken");
	CHILD_CHECK(harness_signal(a->report_fd, 't') == 0, "report");
	ret = shardd_wait(c, &cp, 10000);
	CHILD_CHECK(ret == -ECONNRESET || (ret == 0 && cp.user_data == 5 && cp.res < 0),
		    "wait while the daemon stops: ret %d (%s), res %d: %s %s", ret,
		    shardd_strerror(ret), ret == 0 ? cp.res : 0, ret == 0 ? cp.msg : "",
		    shardd_last_error());
	if (ret == 0)
		CHILD_CHECK(cp.res == -SHARDD_E_SHUTDOWN, "barrier res %d (%s): %s", cp.res,
			    shardd_strerror(cp.res), cp.msg);
	/* Whatever came first, the daemon is gone now and every call says so. */
	ret = shardd_wait(c, &cp, 10000);
	CHILD_CHECK(ret == -ECONNRESET, "wait on a stopped daemon gave %d: %s", ret,
		    shardd_last_error());
	ret = shardd_nop(c);
	CHILD_CHECK(ret == -ECONNRESET, "nop on a stopped daemon gave %d: %s", ret,
		    shardd_last_error());
	CHILD_CHECK(strstr(shardd_last_error(), "daemon closed the connection") ||
			    strstr(shardd_last_error(), "daemon detached this client"),
		    "%s", shardd_last_error());
	shardd_close(c);
	return 0;
}

Test(barrier_nop, sigterm_while_clients_wait_ends_their_waits, .timeout = 60)
{
	struct rank_args args[3];
	int report[2], status;
	pid_t pids[3];
	char b;

	start_daemon(COLLECTIVE_S);
	cr_assert_eq(pipe(report), 0);
	for (uint32_t r = 0; r < 3; r++) {
		args[r] = (struct rank_args){
			.job = "term", .rank = r, .world = 4, .report_fd = report[1]
		};
		pids[r] = harness_fork(waiter_rank, &args[r]);
		cr_assert_gt(pids[r], 0);
	}
	for (int r = 0; r < 3; r++) {
		cr_assert_eq(harness_read_full(report[0], &b, 1, 10000), 0,
			     "ranks did not all enter the barrier");
		cr_assert_eq(b, 't');
	}
	status = harness_daemon_stop(&daemon_);
	cr_assert_geq(status, 0, "shardd ignored SIGTERM: %s", strerror(-status));
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "shardd %s",
		  harness_status_str(status));
	wait_children(pids, 3, "waiter");
	close(report[0]);
	close(report[1]);
}

Test(barrier_nop, killed_daemon_gives_econnreset_not_a_hang, .timeout = 30)
{
	struct shardd_client *c = NULL;
	struct shardd_completion cp;
	int64_t t0;
	int status;

	start_daemon(COLLECTIVE_S);
	cr_assert_eq(harness_attach(&daemon_, "crash", 0, 1, 2, &c), 0);
	cr_assert_eq(shardd_client_submit(c, SHARDD_OP_BARRIER, 1, 0, 9), 0);
	cr_assert_eq(wait_taken(c, SHARDD_OP_BARRIER, 1, 5000), 0);
	status = harness_daemon_stop_sig(&daemon_, SIGKILL, 5000);
	cr_assert(status >= 0 && WIFSIGNALED(status), "shardd %s", harness_status_str(status));
	t0 = harness_now_ms();
	cr_assert_eq(shardd_wait(c, &cp, -1), -ECONNRESET, "%s", shardd_last_error());
	cr_assert_lt(harness_now_ms() - t0, 1000);
	cr_assert_not_null(strstr(shardd_last_error(), "daemon closed the connection"), "%s",
			   shardd_last_error());
	cr_assert_eq(shardd_barrier(c, 2), -ECONNRESET, "%s", shardd_last_error());
	shardd_close(c);
}

/* SPDX-License-Identifier: MIT */
/*
 * Where a collective runs (issue 17): the host backend runs a task of up
 * to 16 MiB moved on the daemon's loop thread (alone up to 128 Ki elements
 * of work, else with the pool's idle workers joining in) and a larger one
 * on the pool. Through every one of the three paths, unshard and reduce
 * give exact values and exactly one completion per rank; a rank that left
 * before a loop-thread-sized reduce fails the other fast, naming it, and
 * the same reduce works once the rank is back.
 *
 * Values are small multiples of 1/8 so the 2-rank fp32 average is exact:
 * the reference is the arithmetic itself.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define CHILD_WAIT_MS  60000
#define WORLD          2
#define DEATH_BOUND_MS 2500

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	static const char *const extra[] = { "--collective-timeout", "10", NULL };

	harness_daemon_start_or_fail(&daemon_, extra);
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(loop_ops, .init = start_daemon, .fini = stop_daemon, .timeout = 120);

struct rank_args {
	const char *job;
	uint64_t numel; /* of the one 1-D fp32 param */
	uint32_t rank;
	int report_fd; /* write end: the child says where it is */
	int go_fd;     /* read end: the survivor waits here for the test's go */
};

static float param_value(uint64_t e)
{
	return (float)((int)(e % 29) - 14) / 4.0f;
}

static float grad_value(uint32_t rank, uint64_t e)
{
	return (float)((int)((e * 7 + rank * 13) % 31) - 15) / 8.0f;
}

static int open_group(const struct rank_args *a, struct shardd_client **c, struct shardd_group **g)
{
	struct shardd_param_desc d = { .name = "w",
				       .dtype = SHARDD_DTYPE_FP32,
				       .ndim = 1,
				       .shard_dim = 0,
				       .shape = { a->numel } };

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, WORLD, c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(shardd_group_register(*c, "loop", &d, 1, NULL, NULL, g) == 0, "register: %s",
		    shardd_last_error());
	return 0;
}

/* No completion beyond the one each sync call reaped. */
static int no_extra_completion(struct shardd_client *c, const char *after)
{
	struct shardd_completion cp;
	int ret = shardd_poll(c, &cp);

	CHILD_CHECK(ret == -EAGAIN,
		    "after %s: a second completion (poll %d, op %u step %llu res %d)", after, ret,
		    cp.op, (unsigned long long)cp.step, cp.res);
	return 0;
}

/* The 2-rank average of every rank's grads over this rank's shard, exact. */
static int check_reduced(const struct rank_args *a, struct shardd_group *g)
{
	const struct shardd_param_layout *l = shardd_group_layout(g, 0);
	const float *sg = shardd_group_shard_grad(g, 0);
	uint64_t n = l->shard_bytes / sizeof(float), base = a->rank * n;

	CHILD_CHECK(n * WORLD == a->numel, "shard of %llu elements for %llu", (unsigned long long)n,
		    (unsigned long long)a->numel);
	for (uint64_t e = 0; e < n; e++) {
		float want = (grad_value(0, base + e) + grad_value(1, base + e)) / 2.0f;

		CHILD_CHECK(sg[e] == want, "rank %u numel %llu: sharded grad %llu is %g, want %g",
			    a->rank, (unsigned long long)a->numel, (unsigned long long)e,
			    (double)sg[e], (double)want);
	}
	return 0;
}

static int fill_grads(const struct rank_args *a, struct shardd_group *g)
{
	float *grad = shardd_group_grad(g, 0);

	CHILD_CHECK(shardd_group_layout(g, 0)->grad_bytes == a->numel * sizeof(float),
		    "grad bytes");
	for (uint64_t e = 0; e < a->numel; e++)
		grad[e] = grad_value(a->rank, e);
	return 0;
}

static int rank_ops(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float *full = malloc(a->numel * sizeof(float));

	CHILD_CHECK(full, "out of memory");
	if (open_group(a, &c, &g))
		return 1;
	for (uint64_t e = 0; e < a->numel; e++)
		full[e] = param_value(e);
	CHILD_CHECK(shardd_group_load_full(g, 0, full) == 0, "load: %s", shardd_last_error());
	free(full);
	for (uint64_t step = 1; step <= 3; step++) {
		const float *u;

		CHILD_CHECK(shardd_unshard(g, step) == 0, "unshard %llu: %s",
			    (unsigned long long)step, shardd_last_error());
		if (no_extra_completion(c, "unshard"))
			return 1;
		u = shardd_group_unsharded(g, 0);
		for (uint64_t e = 0; e < a->numel; e++)
			CHILD_CHECK(u[e] == param_value(e),
				    "numel %llu step %llu: unsharded %llu is %g, want %g",
				    (unsigned long long)a->numel, (unsigned long long)step,
				    (unsigned long long)e, (double)u[e], (double)param_value(e));
		CHILD_CHECK(shardd_reshard(g, step) == 0, "reshard: %s", shardd_last_error());
		if (fill_grads(a, g))
			return 1;
		CHILD_CHECK(shardd_zero_grad(g) == 0, "zero_grad: %s", shardd_last_error());
		CHILD_CHECK(shardd_reduce(g, step, 0) == 0, "reduce %llu: %s",
			    (unsigned long long)step, shardd_last_error());
		if (no_extra_completion(c, "reduce") || check_reduced(a, g))
			return 1;
	}
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static void run_size(const char *job, uint64_t numel)
{
	struct rank_args args[WORLD];

	for (uint32_t r = 0; r < WORLD; r++)
		args[r] = (struct rank_args){ .job = job, .numel = numel, .rank = r };
	harness_run_children(rank_ops, args, sizeof(args[0]), WORLD, CHILD_WAIT_MS, &daemon_);
}

/*
 * With 2 ranks and fp32 grads, unshard moves 2x and reduce 4x the param's
 * bytes: 16 Ki elements stay under 128 Ki elements of work (loop thread
 * alone), 512 Ki elements move 4 / 8 MiB (loop thread with the pool's
 * help), 3 Mi elements move 24 / 48 MiB (the pool).
 */
Test(loop_ops, unshard_and_reduce_on_every_path_give_exact_values_and_one_completion_each)
{
	run_size("solo", (uint64_t)16 << 10);
	run_size("helped", (uint64_t)512 << 10);
	run_size("pooled", (uint64_t)3 << 20);
}

static int rank_leaves(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;

	if (open_group(a, &c, &g))
		return 1;
	/* Exit without closing: the daemon learns of it from the socket and the pidfd. */
	return 0;
}

static int rank_survives(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	struct shardd_completion cp;
	char go = 0;
	int64_t t0;
	int ret;

	if (open_group(a, &c, &g) || fill_grads(a, g))
		return 1;
	CHILD_CHECK(harness_signal(a->report_fd, 'r') == 0, "report");
	CHILD_CHECK(harness_read_full(a->go_fd, &go, 1, 20000) == 0 && go == 'g', "no go");
	t0 = harness_now_ms();
	CHILD_CHECK(shardd_group_submit(g, SHARDD_OP_REDUCE, 1, 0, 9) == 0, "submit: %s",
		    shardd_last_error());
	ret = shardd_wait(c, &cp, 10000);
	CHILD_CHECK(ret == 0, "wait: %s", shardd_last_error());
	CHILD_CHECK(harness_now_ms() - t0 < DEATH_BOUND_MS, "the reduce failed only after %lld ms",
		    (long long)(harness_now_ms() - t0));
	CHILD_CHECK(cp.user_data == 9 && cp.op == SHARDD_OP_REDUCE,
		    "completion user_data %llu op %u", (unsigned long long)cp.user_data, cp.op);
	CHILD_CHECK(cp.res == -SHARDD_E_PEER_DIED, "reduce res %d (%s): %s", cp.res,
		    shardd_strerror(cp.res), cp.msg);
	CHILD_CHECK(strstr(cp.msg, "rank 1"), "the error does not name rank 1: %s", cp.msg);
	if (no_extra_completion(c, "the failed reduce"))
		return 1;
	CHILD_CHECK(harness_signal(a->report_fd, 'f') == 0, "report");
	CHILD_CHECK(harness_read_full(a->go_fd, &go, 1, 20000) == 0 && go == 'g', "no second go");
	/* Rank 1 came back: the same step works, with exact values, once. */
	CHILD_CHECK(shardd_reduce(g, 1, 0) == 0, "reduce after the return: %s",
		    shardd_last_error());
	if (no_extra_completion(c, "reduce") || check_reduced(a, g))
		return 1;
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static int rank_returns(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, WORLD, &c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(shardd_group_open(c, "loop", &g) == 0, "open: %s", shardd_last_error());
	if (fill_grads(a, g))
		return 1;
	CHILD_CHECK(harness_signal(a->report_fd, 'a') == 0, "report");
	CHILD_CHECK(shardd_reduce(g, 1, 0) == 0, "reduce: %s", shardd_last_error());
	if (no_extra_completion(c, "reduce") || check_reduced(a, g))
		return 1;
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static void wait_ok(pid_t pid, const char *what)
{
	int status = 0, ret = harness_wait_or_kill(pid, CHILD_WAIT_MS, &status);

	if (ret < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		harness_daemon_dump_log(&daemon_);
	cr_assert_eq(ret, 0, "%s did not finish: %s", what, strerror(-ret));
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s %s", what,
		  harness_status_str(status));
}

/* 512 Ki elements: the reduce (8 MiB moved) runs on the loop thread with the pool's help. */
Test(loop_ops, rank_gone_before_a_loop_thread_reduce_fails_the_other_naming_it_then_it_works_again)
{
	int report[2], go[2];
	struct rank_args args[WORLD];
	pid_t survivor, leaver, returner;
	char b = 0;

	cr_assert_eq(pipe(report), 0);
	cr_assert_eq(pipe(go), 0);
	for (uint32_t r = 0; r < WORLD; r++)
		args[r] = (struct rank_args){ .job = "leaves",
					      .numel = (uint64_t)512 << 10,
					      .rank = r,
					      .report_fd = report[1],
					      .go_fd = go[0] };
	survivor = harness_fork(rank_survives, &args[0]);
	cr_assert_gt(survivor, 0);
	leaver = harness_fork(rank_leaves, &args[1]);
	cr_assert_gt(leaver, 0);
	wait_ok(leaver, "rank 1 (leaving)");
	cr_assert_eq(harness_read_full(report[0], &b, 1, 20000), 0, "rank 0 did not register");
	cr_assert_eq(b, 'r');
	cr_assert_eq(harness_signal(go[1], 'g'), 0);
	cr_assert_eq(harness_read_full(report[0], &b, 1, 20000), 0,
		     "rank 0 never saw its reduce fail");
	cr_assert_eq(b, 'f');
	returner = harness_fork(rank_returns, &args[1]);
	cr_assert_gt(returner, 0);
	cr_assert_eq(harness_read_full(report[0], &b, 1, 20000), 0, "rank 1 did not come back");
	cr_assert_eq(b, 'a');
	cr_assert_eq(harness_signal(go[1], 'g'), 0);
	wait_ok(returner, "rank 1 (back)");
	wait_ok(survivor, "rank 0");
	close(report[0]);
	close(report[1]);
	close(go[0]);
	close(go[1]);
}

/* SPDX-License-Identifier: MIT */
/*
 * Abandoned jobs are reclaimed: a real shardd with --job-linger, real rank
 * processes killed with SIGKILL (no goodbye), and shardctl as a subprocess.
 * A job without ranks ends after --job-linger seconds and its memfds leave
 * the daemon (counted in /proc/<daemon>/fd); a rank that re-attaches before
 * then finds its params intact (checked against tests/lib/reference.c);
 * --job-linger 0 keeps the job; `shardctl end` ends a job at once, failing
 * its live ranks' ops with an error that names the end, while the daemon
 * goes on serving other jobs. Every wait polls the daemon's state (admin
 * replies, its log) against a deadline.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "reference.h"
#include "shardd.h"

#define OUT_MAX      (1 << 16)
#define CTL_TIMEOUT  10000
#define STEP_TIMEOUT 20000
#define STATE_WAIT   20000 /* ms a poll of the daemon's state may take */

static struct harness_daemon daemon_;

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(job_linger, .fini = stop_daemon, .timeout = 60);

/* shardd with `--job-linger linger` (and the collective timeout tests do not reach). */
static void start_daemon(const char *linger)
{
	const char *const extra[] = {
		"--job-linger", linger, "--collective-timeout", "60", "--log-level", "info", NULL
	};

	signal(SIGPIPE, SIG_IGN);
	cr_assert_eq(harness_daemon_start(&daemon_, extra), 0, "shardd did not start");
}

/* ------------------------------------------------------------------ */
/* shardctl and the daemon's state                                     */
/* ------------------------------------------------------------------ */

static char ctl_out[OUT_MAX];

/* shardctl --socket SOCK args... (NULL-terminated): its exit code, output in ctl_out. */
static int ctl(const char *first, ...)
{
	const char *args[13] = { first };
	va_list ap;
	int n = 1;

	va_start(ap, first);
	while (n < 12 && (args[n] = va_arg(ap, const char *)) != NULL)
		n++;
	va_end(ap);
	args[n] = NULL;
	return harness_shardctl(daemon_.socket, args, CTL_TIMEOUT, ctl_out, sizeof(ctl_out));
}

/* The entry of job `name` in a `shardctl --json jobs` reply (NULL: no such job); *reply to decref. */
static const json_t *job_entry(const char *name, json_t **reply)
{
	json_error_t err;
	const json_t *jobs, *j;
	size_t i;

	cr_assert_eq(ctl("--json", "jobs", NULL), 0, "shardctl jobs failed:\n%s", ctl_out);
	*reply = json_loads(ctl_out, 0, &err);
	cr_assert(*reply, "shardctl --json jobs does not parse (%s):\n%s", err.text, ctl_out);
	jobs = json_object_get(*reply, "jobs");
	json_array_foreach(jobs, i, j) if (strcmp(json_string_value(json_object_get(j, "name")),
						  name) == 0) return j;
	return NULL;
}

/* Poll `shardctl --json jobs` until job `name` has `attached` ranks (-1: until it is gone). */
static void wait_job(const char *name, int attached)
{
	int64_t deadline = harness_now_ms() + STATE_WAIT;

	while (harness_now_ms() < deadline) {
		json_t *r;
		const json_t *j = job_entry(name, &r);
		int done = attached < 0 ? !j
					: j && json_integer_value(json_object_get(j, "attached")) ==
							  attached;

		json_decref(r);
		if (done)
			return;
	}
	harness_daemon_dump_log(&daemon_);
	if (attached < 0)
		cr_assert_fail("job '%s' still exists %d ms later", name, STATE_WAIT);
	cr_assert_fail("job '%s' never had %d ranks attached within %d ms", name, attached,
		       STATE_WAIT);
}

/* Wait until the daemon's log holds `needle`; 1 if it did within timeout_ms. */
static int log_has(const char *needle, int timeout_ms)
{
	int64_t end = harness_now_ms() + timeout_ms;
	struct timespec until;
	int found;

	clock_gettime(CLOCK_MONOTONIC, &until);
	until.tv_sec += timeout_ms / 1000 + 1;
	pthread_mutex_lock(&daemon_.lock);
	while (!(found = daemon_.log && strstr(daemon_.log, needle)) && !daemon_.eof &&
	       harness_now_ms() < end)
		pthread_cond_timedwait(&daemon_.cond, &daemon_.lock, &until);
	pthread_mutex_unlock(&daemon_.lock);
	return found;
}

/* Descriptors the daemon holds whose target contains `needle` (NULL: all of them). */
static int daemon_fds(const char *needle)
{
	char dir[64], path[PATH_MAX], target[PATH_MAX];
	struct dirent *e;
	int n = 0;
	DIR *d;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)daemon_.pid);
	d = opendir(dir);
	cr_assert_not_null(d, "%s: %s", dir, strerror(errno));
	while ((e = readdir(d)) != NULL) {
		ssize_t len;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		len = readlink(path, target, sizeof(target) - 1);
		if (len < 0)
			continue;
		target[len] = 0;
		if (!needle || strstr(target, needle))
			n++;
	}
	closedir(d);
	return n;
}

/*
 * Poll until the daemon holds exactly `want` fds: the connection of the
 * last shardctl closes on the daemon's side a moment after shardctl exits.
 */
static void wait_fds(int want)
{
	int64_t deadline = harness_now_ms() + STATE_WAIT;
	int n;

	while ((n = daemon_fds(NULL)) != want && harness_now_ms() < deadline)
		sched_yield();
	cr_assert_eq(n, want, "the daemon holds %d fds, %d before the job", n, want);
}

/* ------------------------------------------------------------------ */
/* Rank processes                                                      */
/* ------------------------------------------------------------------ */

/* One fp32 param [5, 3] over WORLD ranks (3 rows each, one padding row on rank 1). */
#define WORLD 2
#define D0    5
#define D1    3

static const struct ref_param ref_w = {
	.ndim = 2, .shard_dim = 0, .dtype = SHARDD_DTYPE_FP32, .shape = { D0, D1 }
};

static double w_value(uint64_t i, uint64_t step)
{
	return ref_round((double)step * 1.5 + (double)i * 0.125 - 2.0, SHARDD_DTYPE_FP32);
}

struct rank_arg {
	const char *job, *group;
	uint32_t rank, world;
	uint64_t step; /* the values the rank loads (and, re-attached, expects) */
	int ready_fd;  /* the rank writes one byte when it reached its point */
	int go_fd;     /* and reads one before it goes on */
};

static int attach(const struct rank_arg *a, struct shardd_client **c)
{
	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, a->world, c) == 0, "attach %s/%u",
		    a->job, a->rank);
	return 0;
}

static int register_w(struct shardd_client *c, const struct rank_arg *a, struct shardd_group **g)
{
	struct shardd_param_desc p = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { D0, D1 }
	};

	CHILD_CHECK(shardd_group_register(c, a->group, &p, 1, NULL, NULL, g) == 0, "register: %s",
		    shardd_last_error());
	return 0;
}

/* The unsharded w equals the step's full tensor. */
static int check_unsharded(struct shardd_group *g, uint64_t step)
{
	const float *u = shardd_group_unsharded(g, 0);

	for (uint64_t i = 0; i < D0 * D1; i++)
		CHILD_CHECK(u[i] == (float)w_value(i, step), "unsharded w[%llu] = %g, want %g",
			    (unsigned long long)i, u[i], w_value(i, step));
	return 0;
}

/* This rank's shard equals the reference's shard of the step's tensor (padding rows zero). */
static int check_shard(struct shardd_group *g, uint32_t rank, uint64_t step)
{
	double full[D0 * D1], want[D0 * D1];
	const float *s = shardd_group_shard(g, 0);
	struct ref_dims d;

	ref_dims(&ref_w, WORLD, &d);
	for (uint64_t i = 0; i < D0 * D1; i++)
		full[i] = w_value(i, step);
	ref_shard(&d, rank, full, want);
	for (uint64_t i = 0; i < d.shard_numel; i++)
		CHILD_CHECK(s[i] == (float)want[i], "rank %u shard w[%llu] = %g, reference %g",
			    rank, (unsigned long long)i, s[i], want[i]);
	return 0;
}

/* Register, load the step's values, unshard, tell the parent, then wait to be killed. */
static int rank_hold(void *p)
{
	const struct rank_arg *a = p;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float full[D0 * D1];
	char byte;

	if (attach(a, &c) || register_w(c, a, &g))
		return 1;
	for (uint64_t i = 0; i < D0 * D1; i++)
		full[i] = (float)w_value(i, a->step);
	CHILD_CHECK(shardd_group_load_full(g, 0, full) == 0, "load: %s", shardd_last_error());
	CHILD_CHECK(shardd_unshard(g, a->step) == 0, "unshard: %s", shardd_last_error());
	if (check_unsharded(g, a->step))
		return 1;
	CHILD_CHECK(harness_signal(a->ready_fd, 'R') == 0, "signal");
	/* The parent kills this process; EOF on go (the parent died) ends it too. */
	CHILD_CHECK(harness_read_full(a->go_fd, &byte, 1, 60000) == 0, "no go");
	return 0;
}

/* Re-attach, open the group, find the shard as it was, unshard the next step, say goodbye. */
static int rank_reattach(void *p)
{
	const struct rank_arg *a = p;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	char byte;

	if (attach(a, &c))
		return 1;
	CHILD_CHECK(shardd_group_open(c, a->group, &g) == 0, "open: %s", shardd_last_error());
	if (check_shard(g, a->rank, a->step))
		return 1;
	/* A collective fails at once while a member has not re-attached: wait for every rank. */
	CHILD_CHECK(shardd_barrier(c, 1) == 0, "barrier: %s", shardd_last_error());
	CHILD_CHECK(shardd_unshard(g, a->step + 1) == 0, "unshard: %s", shardd_last_error());
	if (check_unsharded(g, a->step))
		return 1;
	CHILD_CHECK(harness_signal(a->ready_fd, 'A') == 0, "signal");
	CHILD_CHECK(harness_read_full(a->go_fd, &byte, 1, STEP_TIMEOUT) == 0, "no go");
	CHILD_CHECK(shardd_reshard(g, a->step + 1) == 0, "reshard: %s", shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

struct ranks {
	pid_t pid[WORLD];
	struct rank_arg arg[WORLD];
	int ready[2], go[2];
};

/* Fork the WORLD ranks of `job` running fn and wait until each signalled ready. */
static void ranks_start(struct ranks *r, const char *job, const char *group, uint64_t step,
			int (*fn)(void *))
{
	char byte;

	cr_assert_eq(pipe2(r->ready, O_CLOEXEC), 0);
	cr_assert_eq(pipe2(r->go, O_CLOEXEC), 0);
	for (uint32_t i = 0; i < WORLD; i++) {
		r->arg[i] = (struct rank_arg){ .job = job,
					       .group = group,
					       .rank = i,
					       .world = WORLD,
					       .step = step,
					       .ready_fd = r->ready[1],
					       .go_fd = r->go[0] };
		r->pid[i] = harness_fork(fn, &r->arg[i]);
		cr_assert_gt(r->pid[i], 0, "fork rank %u", i);
	}
	for (uint32_t i = 0; i < WORLD; i++) {
		if (harness_read_full(r->ready[0], &byte, 1, STEP_TIMEOUT) != 0) {
			harness_daemon_dump_log(&daemon_);
			cr_assert_fail("the ranks of job '%s' did not reach their point", job);
		}
	}
}

static void ranks_close_pipes(struct ranks *r)
{
	close(r->ready[0]);
	close(r->ready[1]);
	close(r->go[0]);
	close(r->go[1]);
}

/* SIGKILL every rank (no goodbye) and reap it. */
static void ranks_kill(struct ranks *r)
{
	for (uint32_t i = 0; i < WORLD; i++) {
		int status;

		cr_assert_eq(kill(r->pid[i], SIGKILL), 0);
		cr_assert_eq(harness_wait_pid(r->pid[i], STEP_TIMEOUT, &status), 0);
	}
	ranks_close_pipes(r);
}

/*
 * A daemon lingering jobs `linger` seconds, and a job whose ranks (holding
 * group `group` at step `step`) were killed: it has no rank attached.
 */
static void job_without_ranks(struct ranks *r, const char *linger, const char *job,
			      const char *group, uint64_t step)
{
	start_daemon(linger);
	ranks_start(r, job, group, step, rank_hold);
	ranks_kill(r);
	wait_job(job, 0);
}

/* Let every rank go on and check that each exits 0. */
static void ranks_finish(struct ranks *r)
{
	for (uint32_t i = 0; i < WORLD; i++)
		cr_assert_eq(harness_signal(r->go[1], 'G'), 0);
	for (uint32_t i = 0; i < WORLD; i++) {
		int status;

		cr_assert_eq(harness_wait_or_kill(r->pid[i], STEP_TIMEOUT, &status), 0);
		if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			harness_daemon_dump_log(&daemon_);
			cr_assert_fail("rank %u %s", i, harness_status_str(status));
		}
	}
	ranks_close_pipes(r);
}

/* ------------------------------------------------------------------ */
/* Linger                                                              */
/* ------------------------------------------------------------------ */

Test(job_linger, killed_ranks_job_ends_after_linger_and_its_memfds_leave_the_daemon)
{
	struct ranks r;
	int before, memfds;

	start_daemon("1");
	before = daemon_fds(NULL);
	ranks_start(&r, "abandoned", "abandoned_g", 1, rank_hold);
	/* One unsharded copy, and per rank a shard, a sharded grad and a grad buffer. */
	memfds = daemon_fds("shardd:abandoned_g.");
	cr_assert_eq(memfds, 1 + 3 * WORLD, "the daemon holds %d memfds of the group", memfds);
	ranks_kill(&r);
	wait_job("abandoned", -1);
	cr_assert_eq(daemon_fds("shardd:abandoned_g."), 0, "the ended job's memfds are still open");
	wait_fds(before);
	cr_assert(log_has("job 'abandoned' ended after", STATE_WAIT), "no log line for the end");
	cr_assert(log_has("without an attached rank (--job-linger 1)", STATE_WAIT),
		  "the log does not say how long it lingered");
	cr_assert(log_has("bytes of buffers freed", STATE_WAIT),
		  "the log does not say what was freed");
}

Test(job_linger, rank_reattaching_before_expiry_keeps_the_job_and_its_params)
{
	struct ranks r;
	json_t *reply;
	const json_t *j;
	double ends;

	job_without_ranks(&r, "30", "comeback", "comeback_g", 3);
	/* No ranks: the job waits, and says for how long. */
	j = job_entry("comeback", &reply);
	cr_assert_not_null(j);
	ends = json_number_value(json_object_get(j, "ends_in_s"));
	cr_assert(json_is_number(json_object_get(j, "ends_in_s")) && ends > 0 && ends <= 30,
		  "ends_in_s = %g, want in (0, 30]", ends);
	cr_assert(json_is_number(json_object_get(j, "no_ranks_s")));
	json_decref(reply);
	cr_assert_eq(ctl("jobs", NULL), 0);
	cr_assert_not_null(strstr(ctl_out, "no ranks, ends in "), "shardctl jobs:\n%s", ctl_out);
	/* Re-attached ranks find their shards and unshard the next step. */
	ranks_start(&r, "comeback", "comeback_g", 3, rank_reattach);
	j = job_entry("comeback", &reply);
	cr_assert_not_null(j, "the job ended while its ranks re-attached");
	cr_assert(json_is_null(json_object_get(j, "ends_in_s")),
		  "re-attach did not cancel the end");
	cr_assert(json_is_null(json_object_get(j, "no_ranks_s")));
	json_decref(reply);
	cr_assert_eq(ctl("jobs", NULL), 0);
	cr_assert_not_null(strstr(ctl_out, "running"), "shardctl jobs:\n%s", ctl_out);
	ranks_finish(&r);
	/* Every rank said goodbye: the job ends as before. */
	wait_job("comeback", -1);
}

Test(job_linger, linger_zero_keeps_a_job_without_ranks)
{
	int64_t deadline;
	struct ranks r;
	json_t *reply;
	const json_t *j;

	job_without_ranks(&r, "0", "kept", "kept_g", 1);
	/* Many cron turns (every 100 ms) pass while the job has no rank; it stays. */
	deadline = harness_now_ms() + STATE_WAIT;
	for (;;) {
		j = job_entry("kept", &reply);
		cr_assert_not_null(j, "--job-linger 0 ended the job");
		cr_assert(json_is_null(json_object_get(j, "ends_in_s")));
		if (json_number_value(json_object_get(j, "no_ranks_s")) >= 1.5)
			break;
		json_decref(reply);
		cr_assert_lt(harness_now_ms(), deadline, "no_ranks_s never reached 1.5");
	}
	json_decref(reply);
	cr_assert_eq(daemon_fds("shardd:kept_g."), 1 + 3 * WORLD, "the kept job lost memfds");
	cr_assert_eq(ctl("jobs", NULL), 0);
	cr_assert_not_null(strstr(ctl_out, "no ranks, kept (--job-linger 0)"), "shardctl jobs:\n%s",
			   ctl_out);
}

/* ------------------------------------------------------------------ */
/* shardctl end                                                        */
/* ------------------------------------------------------------------ */

#define END_NEEDLE "was ended by an admin request (shardctl end"

/*
 * A call of a rank after its job was ended: it fails with
 * -SHARDD_E_SHUTDOWN and the end's text, naming the job; never -ECONNRESET,
 * which says the daemon is gone.
 */
#define CHECK_ENDED(ret, what)                                                            \
	CHILD_CHECK((ret) == -SHARDD_E_SHUTDOWN &&                                        \
			    strstr(shardd_last_error(), "job 'ended' " END_NEEDLE),       \
		    "%s after the end gave %d (%s): %s", what, ret, shardd_strerror(ret), \
		    shardd_last_error())

/*
 * Rank 0 has an unshard in flight that waits for rank 1; rank 1 waits for
 * go. After the end, rank 0's completion names it, and every later call of
 * either rank (a wait, an op, a control request) fails with it.
 */
static int rank_ended(void *p)
{
	const struct rank_arg *a = p;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL, *g2 = NULL;
	struct shardd_completion comp;
	char byte;
	int ret;

	if (attach(a, &c) || register_w(c, a, &g))
		return 1;
	if (a->rank == 0) {
		CHILD_CHECK(shardd_group_submit(g, SHARDD_OP_UNSHARD, 1, 0, 5) == 0, "submit: %s",
			    shardd_last_error());
		CHILD_CHECK(harness_signal(a->ready_fd, 'S') == 0, "signal");
		CHILD_CHECK(shardd_wait(c, &comp, STEP_TIMEOUT) == 0, "wait: %s",
			    shardd_last_error());
		CHILD_CHECK(comp.user_data == 5 && comp.res == -SHARDD_E_SHUTDOWN,
			    "in-flight unshard completed with %d (%s)", comp.res, comp.msg);
		CHILD_CHECK(strstr(comp.msg, END_NEEDLE) && strstr(comp.msg, "'ended'"),
			    "the completion does not name the end: %s", comp.msg);
		ret = shardd_nop(c);
		CHECK_ENDED(ret, "a nop");
		ret = shardd_wait(c, &comp, STEP_TIMEOUT);
		CHECK_ENDED(ret, "a wait");
	} else {
		CHILD_CHECK(harness_signal(a->ready_fd, 'W') == 0, "signal");
		CHILD_CHECK(harness_read_full(a->go_fd, &byte, 1, STEP_TIMEOUT) == 0, "no go");
		ret = shardd_unshard(g, 1);
		CHECK_ENDED(ret, "an unshard");
		ret = shardd_group_open(c, a->group, &g2);
		CHECK_ENDED(ret, "a group open");
		ret = shardd_barrier(c, 1);
		CHECK_ENDED(ret, "a barrier");
	}
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

/* Poll `shardctl --json ranks JOB` until rank 0's unshard waits in its rendezvous. */
static void wait_unshard_pending(const char *job)
{
	int64_t deadline = harness_now_ms() + STATE_WAIT;

	while (harness_now_ms() < deadline) {
		json_error_t err;
		json_t *r;
		const json_t *pending;
		int found;

		cr_assert_eq(ctl("--json", "ranks", job, NULL), 0, "%s", ctl_out);
		r = json_loads(ctl_out, 0, &err);
		cr_assert(r, "shardctl --json ranks does not parse:\n%s", ctl_out);
		pending = json_object_get(json_array_get(json_object_get(r, "jobs"), 0), "pending");
		found = json_array_size(pending) == 1 &&
			strcmp(json_string_value(json_object_get(json_array_get(pending, 0), "op")),
			       "unshard") == 0;
		json_decref(r);
		if (found)
			return;
	}
	cr_assert_fail("rank 0's unshard never reached its rendezvous");
}

Test(job_linger, end_fails_every_call_of_its_ranks_naming_it_not_a_gone_daemon_and_others_go_on)
{
	struct ranks r;
	struct shardd_client *other = NULL, *bystander = NULL;
	int before;

	start_daemon("3600");
	before = daemon_fds(NULL);
	cr_assert_eq(harness_attach(&daemon_, "bystander", 0, 1, 1, &bystander), 0);
	ranks_start(&r, "ended", "ended_g", 1, rank_ended);
	wait_unshard_pending("ended");
	cr_assert_eq(ctl("end", "ended", NULL), 0, "shardctl end:\n%s", ctl_out);
	cr_assert_not_null(strstr(ctl_out, "ended job 'ended': 2 ranks were attached"), "%s",
			   ctl_out);
	ranks_finish(&r);
	wait_job("ended", -1);
	cr_assert_eq(daemon_fds("shardd:ended_g."), 0, "the ended job's memfds are still open");
	/* The job attached all along goes on. */
	cr_assert_eq(shardd_nop(bystander), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_barrier(bystander, 1), 0, "%s", shardd_last_error());
	shardd_close(bystander);
	wait_fds(before);
	cr_assert(log_has("job 'ended' " END_NEEDLE, STATE_WAIT), "no log line for the end");
	/* The daemon goes on: a new client of a new job is served. */
	cr_assert_eq(harness_attach(&daemon_, "after", 0, 1, 1, &other), 0);
	cr_assert_eq(shardd_nop(other), 0, "%s", shardd_last_error());
	shardd_close(other);
}

Test(job_linger, end_of_a_job_without_ranks_frees_it_at_once)
{
	struct ranks r;
	json_t *reply;
	const json_t *j;
	long long held;

	job_without_ranks(&r, "3600", "idle", "idle_g", 1);
	j = job_entry("idle", &reply);
	cr_assert_not_null(j);
	held = json_integer_value(json_object_get(json_object_get(j, "memory"), "total"));
	json_decref(reply);
	cr_assert_gt(held, 0);
	cr_assert_eq(ctl("--json", "end", "idle", NULL), 0, "%s", ctl_out);
	reply = json_loads(ctl_out, 0, NULL);
	cr_assert_not_null(reply, "%s", ctl_out);
	cr_assert_eq(json_integer_value(json_object_get(reply, "ranks_attached")), 0);
	cr_assert_eq(json_integer_value(json_object_get(reply, "memory_freed")), held,
		     "memory_freed %lld, the job held %lld",
		     (long long)json_integer_value(json_object_get(reply, "memory_freed")), held);
	json_decref(reply);
	cr_assert_eq(daemon_fds("shardd:idle_g."), 0);
	wait_job("idle", -1);
}

Test(job_linger, end_of_an_unknown_job_lists_the_jobs_that_exist)
{
	struct ranks r;

	start_daemon("3600");
	ranks_start(&r, "present", "present_g", 1, rank_hold);
	cr_assert_eq(ctl("end", "nosuch", NULL), 1, "%s", ctl_out);
	cr_assert_not_null(strstr(ctl_out, "no job 'nosuch'; jobs: 'present'"), "%s", ctl_out);
	cr_assert_eq(ctl("end", NULL), 2, "end without a job is a usage error:\n%s", ctl_out);
	/* Nothing was ended. */
	cr_assert_eq(daemon_fds("shardd:present_g."), 1 + 3 * WORLD);
	ranks_kill(&r);
}

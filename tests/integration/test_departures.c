/* SPDX-License-Identifier: MIT */
/*
 * Whom a barrier's failure names when ranks leave together: a rank says
 * goodbye (and exits) while another dies. Rank 0 waits in a barrier of a
 * 1x3 job; rank 2 says goodbye and exits, rank 1 is killed. Driven into the
 * race: the daemon is stopped (SIGSTOP) while both happen, so they reach one
 * turn of its loop, with the goodbye first on the wire and each process's
 * exit (pidfd) and socket events in whatever order the loop sees them; many
 * times. And driven past it: rank 1's death seen first, the goodbye after.
 * Either way rank 0 hears of the death of rank 1, never only of the goodbye,
 * and never of a death of rank 2.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "shardd.h"

#define WORLD         3
#define VICTIM        1
#define LEAVER        2
#define ROUNDS        20
#define CHILD_WAIT_MS 20000
#define ERR_WAIT_MS   10000

static struct harness_daemon daemon_;

static void stop_daemon(void)
{
	/* A test that failed with the daemon stopped must not leave it so. */
	if (daemon_.pid > 0)
		kill(daemon_.pid, SIGCONT);
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(departures, .fini = stop_daemon, .timeout = 120);

struct rank_arg {
	char job[32];
	uint32_t rank;
	int ready_fd; /* the child writes one byte once attached */
	int go_fd;    /* the leaver says goodbye on a byte; the victim waits to be killed */
};

/* Rank 1: attach, then hold the rank until killed. */
static int victim(void *p)
{
	const struct rank_arg *a = p;
	struct shardd_client *c = NULL;
	char b;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, WORLD, &c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(harness_signal(a->ready_fd, 'a') == 0, "signal");
	harness_read_full(a->go_fd, &b, 1, CHILD_WAIT_MS);
	return 2;
}

/* Rank 2: attach, then on go say goodbye and exit at once. */
static int leaver(void *p)
{
	const struct rank_arg *a = p;
	struct shardd_client *c = NULL;
	char b;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, WORLD, &c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(harness_signal(a->ready_fd, 'a') == 0, "signal");
	CHILD_CHECK(harness_read_full(a->go_fd, &b, 1, CHILD_WAIT_MS) == 0, "no go");
	shardd_close(c);
	return 0;
}

struct round {
	int ready[2], go_victim[2], go_leaver[2];
	pid_t victim, leaver;
	struct rank_arg va, la;
	struct shardd_client *c; /* rank 0, this process */
};

/* Ranks 1 and 2 forked and attached, rank 0 attached here, all of job `job`. */
static void round_start(struct round *r, const char *job)
{
	char b;

	memset(r, 0, sizeof(*r));
	cr_assert_eq(pipe(r->ready), 0);
	cr_assert_eq(pipe(r->go_victim), 0);
	cr_assert_eq(pipe(r->go_leaver), 0);
	r->va = (struct rank_arg){ .rank = VICTIM,
				   .ready_fd = r->ready[1],
				   .go_fd = r->go_victim[0] };
	r->la = (struct rank_arg){ .rank = LEAVER,
				   .ready_fd = r->ready[1],
				   .go_fd = r->go_leaver[0] };
	snprintf(r->va.job, sizeof(r->va.job), "%s", job);
	snprintf(r->la.job, sizeof(r->la.job), "%s", job);
	r->victim = harness_fork(victim, &r->va);
	r->leaver = harness_fork(leaver, &r->la);
	cr_assert_gt(r->victim, 0);
	cr_assert_gt(r->leaver, 0);
	for (int i = 0; i < 2; i++)
		cr_assert_eq(harness_read_full(r->ready[0], &b, 1, CHILD_WAIT_MS), 0,
			     "ranks 1 and 2 did not attach");
	cr_assert_eq(harness_attach(&daemon_, job, 0, 1, WORLD, &r->c), 0, "%s",
		     shardd_last_error());
}

/* Submit barrier 1 as rank 0 and wait, without sleeping, until the daemon took it. */
static void barrier_taken(struct round *r)
{
	int64_t deadline = harness_now_ms() + ERR_WAIT_MS;
	struct shardd_ring_status st;

	cr_assert_eq(shardd_client_submit(r->c, SHARDD_OP_BARRIER, 1, 0, 11), 0, "%s",
		     shardd_last_error());
	do {
		cr_assert_eq(shardd_client_ring_status(r->c, &st), 0);
		if (st.sq_pending == 0 && st.daemon_last_op == SHARDD_OP_BARRIER)
			return;
		sched_yield();
	} while (harness_now_ms() < deadline);
	cr_assert_fail("the daemon never took barrier 1");
}

static void leaver_goes(struct round *r)
{
	int status = 0;

	cr_assert_eq(harness_signal(r->go_leaver[1], 'g'), 0);
	cr_assert_eq(harness_wait_pid(r->leaver, CHILD_WAIT_MS, &status), 0, "rank 2 did not exit");
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank 2 %s",
		  harness_status_str(status));
}

static void victim_dies(struct round *r)
{
	int status = 0;

	cr_assert_eq(kill(r->victim, SIGKILL), 0);
	cr_assert_eq(harness_wait_pid(r->victim, CHILD_WAIT_MS, &status), 0);
	cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

/* Rank 0's barrier fails naming rank 1's death, not rank 2 as dead or as the only cause. */
static void barrier_names_the_dead_rank(struct round *r, int round)
{
	struct shardd_completion cp;
	char died[64], leaver_died[64];

	snprintf(died, sizeof(died), "rank %u (pid %d) died", VICTIM, (int)r->victim);
	snprintf(leaver_died, sizeof(leaver_died), "rank %u (pid %d) died", LEAVER, (int)r->leaver);
	cr_assert_eq(shardd_wait(r->c, &cp, ERR_WAIT_MS), 0, "round %d: %s", round,
		     shardd_last_error());
	cr_assert(cp.user_data == 11 && cp.res == -SHARDD_E_PEER_DIED,
		  "round %d: barrier completed with %d (%s): %s", round, cp.res,
		  shardd_strerror(cp.res), cp.msg);
	cr_assert_not_null(strstr(cp.msg, died),
			   "round %d: the error does not name the death of "
			   "rank 1 (pid %d): %s",
			   round, (int)r->victim, cp.msg);
	cr_assert_null(strstr(cp.msg, leaver_died), "round %d: rank 2 said goodbye, yet: %s", round,
		       cp.msg);
}

static void round_end(struct round *r)
{
	shardd_close(r->c);
	for (int i = 0; i < 2; i++) {
		close(r->ready[i]);
		close(r->go_victim[i]);
		close(r->go_leaver[i]);
	}
}

Test(departures, goodbye_and_death_in_one_loop_turn_name_the_rank_that_died)
{
	cr_assert_eq(harness_daemon_start(&daemon_, NULL), 0, "shardd did not start");
	for (int i = 0; i < ROUNDS; i++) {
		struct round r;
		char job[32];

		snprintf(job, sizeof(job), "race-%d", i);
		round_start(&r, job);
		barrier_taken(&r);
		cr_assert_eq(kill(daemon_.pid, SIGSTOP), 0);
		leaver_goes(&r);
		victim_dies(&r);
		cr_assert_eq(kill(daemon_.pid, SIGCONT), 0);
		barrier_names_the_dead_rank(&r, i);
		round_end(&r);
	}
}

/* Poll `shardctl --json jobs` until job `name` has `attached` ranks. */
static void wait_attached(const char *name, int attached)
{
	const char *const args[] = { "--json", "jobs", NULL };
	int64_t deadline = harness_now_ms() + ERR_WAIT_MS;
	char out[4096];

	while (harness_now_ms() < deadline) {
		json_t *reply =
			harness_shardctl_json(daemon_.socket, args, ERR_WAIT_MS, out, sizeof(out));
		const json_t *j;
		size_t i;
		int done = 0;

		cr_assert_not_null(reply, "shardctl --json jobs: %s", out);
		json_array_foreach(
			json_object_get(reply, "jobs"), i,
			j) if (strcmp(json_string_value(json_object_get(j, "name")), name) == 0)
			done = json_integer_value(json_object_get(j, "attached")) == attached;
		json_decref(reply);
		if (done)
			return;
	}
	cr_assert_fail("job '%s' never had %d ranks attached", name, attached);
}

Test(departures, goodbye_after_a_seen_death_names_the_rank_that_died)
{
	struct round r;

	cr_assert_eq(harness_daemon_start(&daemon_, NULL), 0, "shardd did not start");
	round_start(&r, "seen");
	victim_dies(&r);
	wait_attached("seen", 2);
	barrier_taken(&r);
	leaver_goes(&r);
	barrier_names_the_dead_rank(&r, 0);
	round_end(&r);
}

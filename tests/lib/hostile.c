/* SPDX-License-Identifier: MIT */
/* The daemon of the hostile suites (hostile.h). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include <criterion/criterion.h>

#include "hostile.h"

struct harness_daemon hostile_daemon;

int log_contains(const char *needle)
{
	return harness_log_contains(&hostile_daemon, needle);
}

/* Wait up to REPLY_MS for `d` to have logged `needle` (harness_wait_log). */
void wait_log(struct harness_daemon *d, const char *needle)
{
	harness_wait_log(d, needle, REPLY_MS);
}

void start_daemon(void)
{
	const char *extra[] = { "--collective-timeout", COLLECTIVE_S, NULL };

	harness_daemon_start_or_fail(&hostile_daemon, extra);
	rawproto_use(&hostile_daemon);
}

/* The harness fails the suite on a sanitizer report in the daemon's log. */
void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&hostile_daemon);
}

/* The daemon process has not exited (looked at without reaping it). */
void assert_daemon_alive(void)
{
	siginfo_t si = { 0 };
	const char *report;

	cr_assert_eq(waitid(P_PID, (id_t)hostile_daemon.pid, &si, WEXITED | WNOHANG | WNOWAIT), 0);
	if (si.si_pid != 0)
		harness_daemon_dump_log(&hostile_daemon);
	cr_assert_eq(si.si_pid, 0, "shardd (pid %d) died: code %d status %d",
		     (int)hostile_daemon.pid, si.si_code, si.si_status);
	report = harness_daemon_sanitizer_report(&hostile_daemon);
	if (report)
		harness_daemon_dump_log(&hostile_daemon);
	cr_assert_null(report, "the daemon's log holds a sanitizer report ('%s')", report);
}

/*
 * A well-behaved client of a fresh 1x1 job: nop, barrier, a registered
 * group whose unshard gives back exactly what the rank wrote, reshard.
 */
void assert_others_served(void)
{
	static int n;
	struct shardd_param_desc p = {
		.name = "w",
		.dtype = SHARDD_DTYPE_FP32,
		.ndim = 2,
		.shape = { 5, 3 },
	};
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float full[15];
	char job[32];

	assert_daemon_alive();
	snprintf(job, sizeof(job), "bystander-%d", n++);
	for (int i = 0; i < 15; i++)
		full[i] = (float)i * 0.5f - 3.0f;
	cr_assert_eq(harness_attach(&hostile_daemon, job, 0, 1, 1, &c), 0,
		     "a good client cannot attach any more: %s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0, "nop: %s", shardd_last_error());
	cr_assert_eq(shardd_barrier(c, 1), 0, "barrier: %s", shardd_last_error());
	cr_assert_eq(shardd_group_register(c, "w", &p, 1, NULL, NULL, &g), 0, "register: %s",
		     shardd_last_error());
	cr_assert_eq(shardd_group_load_full(g, 0, full), 0);
	cr_assert_eq(shardd_unshard(g, 1), 0, "unshard: %s", shardd_last_error());
	cr_assert_eq(memcmp(shardd_group_unsharded(g, 0), full, sizeof(full)), 0,
		     "the unsharded copy differs from what the rank wrote");
	cr_assert_eq(shardd_reshard(g, 1), 0, "reshard: %s", shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	assert_daemon_alive();
}

/* Open descriptors of the daemon process. */
int daemon_fd_count(void)
{
	return harness_daemon_fds(&hostile_daemon, 0, NULL);
}

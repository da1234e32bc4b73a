/* SPDX-License-Identifier: MIT */
/*
 * shardd raises its soft RLIMIT_NOFILE to the hard limit at start (every
 * buffer of every group is a descriptor it holds, counted against that
 * limit at registration), so a daemon started from a shell with the usual
 * soft 1024 does not refuse a model of a few dozen groups.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>
#include <sys/resource.h>

#include "harness.h"

TestSuite(fd_limit, .timeout = 60);

Test(fd_limit, daemon_started_with_a_low_soft_limit_runs_with_the_hard_one)
{
	struct harness_daemon hd = { 0 };
	struct rlimit mine, low, theirs;
	int ret;

	cr_assert_eq(getrlimit(RLIMIT_NOFILE, &mine), 0, "getrlimit: %s", strerror(errno));
	if (mine.rlim_max != RLIM_INFINITY && mine.rlim_max <= 256)
		cr_skip_test("the hard RLIMIT_NOFILE is %llu: no lower soft limit to start from",
			     (unsigned long long)mine.rlim_max);
	/* The daemon inherits the soft limit of 256; the test gets its own back at once. */
	low = (struct rlimit){ .rlim_cur = 256, .rlim_max = mine.rlim_max };
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0, "setrlimit: %s", strerror(errno));
	ret = harness_daemon_start(&hd, NULL);
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &mine), 0, "setrlimit back: %s", strerror(errno));
	cr_assert_eq(ret, 0, "shardd did not start");
	cr_assert_eq(prlimit(hd.pid, RLIMIT_NOFILE, NULL, &theirs), 0, "prlimit: %s",
		     strerror(errno));
	cr_expect_eq(
		theirs.rlim_cur, mine.rlim_max,
		"shardd's soft RLIMIT_NOFILE is %llu, started from 256: want the hard limit %llu",
		(unsigned long long)theirs.rlim_cur, (unsigned long long)mine.rlim_max);
	harness_daemon_stop_expect_clean(&hd);
}

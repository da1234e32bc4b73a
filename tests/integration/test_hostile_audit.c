/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against a real shardd, 5: the holes of the adversarial
 * audit (docs/RELIABILITY.md, "Bad input"), each driven from a client
 * through the protocol itself (tests/lib/rawproto.h: proto/ only, nothing
 * in libshardd filters what reaches the daemon). Each test ends with the
 * daemon alive, free of sanitizer reports, and serving a well-behaved
 * client. The other hostile suites: test_hostile_{ring,control,death,replies}.c.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hostile.h"

TestSuite(hostile, .init = start_daemon, .fini = stop_daemon, .timeout = 30);

/* The daemon answers `fd` with the ERROR (expect_error), then closes it; fd is closed. */
static void expect_refused(int fd, uint32_t seq, int32_t code, const char *const *needles,
			   const char *what)
{
	expect_error(fd, seq, code, needles, what);
	expect_eof(fd, what);
	close(fd);
}

/*
 * A job's name becomes a directory under --state-dir (its checkpoints, and
 * the --keep retention that deletes old ones): a name that is a path
 * ("..", "a/b", "../x") would reach outside it, or into another job's.
 */
Test(hostile, job_name_that_is_a_path_is_refused_at_hello)
{
	static const char *const names[] = { ".", "..", "../escaped", "a/b", "/abs", "x/..",
					      "job/" };

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		struct shardd_hello h = make_hello(names[i], 0, 1, 1, 0);
		char quoted[80];
		int fd = raw_connect();

		snprintf(quoted, sizeof(quoted), "'%s'", names[i]);
		send_msg(fd, SHARDD_MSG_HELLO, 7, &h, sizeof(h));
		expect_refused(fd, 7, -SHARDD_E_INVALID, NEEDLES("hello.job", quoted), names[i]);
	}
	/* Dots and slashes elsewhere stay allowed: only a name that is a path is refused. */
	{
		struct raw r;

		raw_attach(&r, "run.1..v2", 0, 1, 1, 0);
		raw_nop_ok(&r, 1);
		raw_close(&r);
	}
	assert_others_served();
}

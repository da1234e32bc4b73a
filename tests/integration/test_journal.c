/* SPDX-License-Identifier: MIT */
/*
 * Journal-style logging when stderr is the journal (JOURNAL_STREAM names
 * it): syslog priorities, no timestamps; timestamps otherwise.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"
#include "opsd.h"

TestSuite(operations, .timeout = 60);

/* ------------------------------------------------------------------ */
/* Logging                                                             */
/* ------------------------------------------------------------------ */

/*
 * Every log line of d (all but the readiness line) starts "<N>" with N a
 * syslog priority and carries no timestamp. Returns how many lines had prefix `pri`.
 */
static int journal_lines(const struct opd *d, const char *pri)
{
	const char *line = d->log;
	int n = 0;

	while (*line) {
		const char *nl = strchr(line, '\n');
		size_t len = nl ? (size_t)(nl - line) : strlen(line);

		if (strncmp(line, "shardd: ", 8) != 0) {
			cr_assert(len > 3 && line[0] == '<' && strchr("3467", line[1]) &&
					  line[2] == '>',
				  "not a journal line: '%.*s'", (int)len, line);
			cr_assert(!(len > 7 && line[7] == '-' && line[3] >= '0' && line[3] <= '9'),
				  "a timestamp in a journal line: '%.*s'", (int)len, line);
			if (strncmp(line, pri, 3) == 0)
				n++;
		}
		line += nl ? len + 1 : len;
	}
	return n;
}

Test(operations, journal_stderr_gets_syslog_priorities_and_no_timestamps)
{
	char base[64], dir[96], sock[128], gid[16];
	struct opd d;

	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	snprintf(gid, sizeof(gid), "%u", ALLOWED_GID);
	cr_assert_eq(mkdir(dir, 0700), 0);
	{
		/* The kept private directory gives a warning; start-up gives info lines. */
		const char *args[] = { "--socket",    sock,   "--allow-gid", gid,
				       "--log-level", "info", NULL };

		cr_assert_eq(opd_start(&d, args, -1, 1, sock), 0, "shardd did not start:\n%s",
			     d.log);
	}
	opd_stop_clean(&d);
	cr_assert_geq(journal_lines(&d, "<4>"), 1, "no warning at priority 4:\n%s", d.log);
	cr_assert_geq(journal_lines(&d, "<6>"), 2, "no info lines at priority 6:\n%s", d.log);
	cr_assert_not_null(strstr(d.log, "<6>shardd " SHARDD_VERSION " (protocol"), "%s", d.log);
	remove_tree(base);
}

Test(operations, stderr_that_is_not_the_journal_keeps_timestamps)
{
	char base[64], sock[128];
	struct opd d;

	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/shardd.sock", base);
	/* JOURNAL_STREAM naming another stream (a child inherited it) must not count. */
	setenv("JOURNAL_STREAM", "1:1", 1);
	opd_start_or_fail(
		&d, (const char *const[]){ "--socket", sock, "--log-level", "info", NULL }, sock);
	unsetenv("JOURNAL_STREAM");
	opd_stop_clean(&d);
	cr_assert_not_null(strstr(d.log, " info: shardd " SHARDD_VERSION " (protocol"), "%s",
			   d.log);
	cr_assert_null(strstr(d.log, "<6>"), "%s", d.log);
	/* "YYYY-MM-DD hh:mm:ss.mmm shardd[pid] info: " */
	cr_assert(d.log[4] == '-' && d.log[7] == '-' && d.log[13] == ':', "%s", d.log);
	remove_tree(base);
}

/* SPDX-License-Identifier: MIT */
/*
 * The daemon of the hostile suites (tests/integration/test_hostile_*.c):
 * one shardd per test with a short collective timeout, and the checks each
 * test ends with: the daemon is alive, its log holds no sanitizer report,
 * and a well-behaved client on it is still served. Every suite declares
 *
 *   TestSuite(hostile, .init = start_daemon, .fini = stop_daemon, .timeout = 30);
 *
 * and talks to hostile_daemon through tests/lib/rawproto.h.
 */
#ifndef SHARDD_TEST_HOSTILE_H
#define SHARDD_TEST_HOSTILE_H

#include "harness.h"
#include "rawproto.h"

#define COLLECTIVE_S "5"

extern struct harness_daemon hostile_daemon;

/* Start hostile_daemon (--collective-timeout COLLECTIVE_S), SIGPIPE ignored; rawproto talks to it. */
void start_daemon(void);
/* The harness fails the suite on a sanitizer report in the daemon's log. */
void stop_daemon(void);
/* hostile_daemon's log holds `needle` now. */
int log_contains(const char *needle);
/* Wait up to REPLY_MS for `d` to have logged `needle`. */
void wait_log(struct harness_daemon *d, const char *needle);
/* The daemon process has not exited (looked at without reaping it) and logged no sanitizer report. */
void assert_daemon_alive(void);
/*
 * A well-behaved client of a fresh 1x1 job: nop, barrier, a registered
 * group whose unshard gives back exactly what the rank wrote, reshard.
 */
void assert_others_served(void);
/* Open descriptors of the daemon process. */
int daemon_fd_count(void);

#endif /* SHARDD_TEST_HOSTILE_H */

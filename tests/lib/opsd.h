/* SPDX-License-Identifier: MIT */
/*
 * A shardd started by the test itself, for the suites of operating shardd
 * as a system daemon (tests/integration/test_socket_access.c,
 * test_socket_activation.c, test_journal.c, test_metrics_http.c): the
 * harness starts the daemon on a socket in a private 0700 directory; these
 * tests need to choose the socket's path, pass it a listening socket or make
 * its stderr "the journal". Plus the one-rank client they all run on it.
 */
#ifndef SHARDD_TEST_OPSD_H
#define SHARDD_TEST_OPSD_H

#include <stddef.h>
#include <sys/types.h>

#define OPD_LOG_MAX  (1 << 16)
#define OPD_READY_MS 10000
#define OPD_STOP_MS  10000
#define CTL_MS       10000
#define ALLOWED_GID  4242u /* a group no other test uses; needs no /etc/group entry */

struct opd {
	pid_t pid;
	int out_fd;            /* read end of the daemon's stdout and stderr */
	char log[OPD_LOG_MAX]; /* everything it printed, NUL-terminated */
	size_t len;
};

/*
 * Start $SHARDD_BIN with args (NULL-terminated). listen_fd >= 0 is passed
 * as fd 3 with LISTEN_FDS=1 and LISTEN_PID set, as systemd does; journal
 * sets JOURNAL_STREAM to the DEV:INODE of the daemon's stderr. Waits for
 * "shardd: ready on <ready_path>". 0, -EPIPE (it exited: its output is in
 * d->log), -ETIMEDOUT.
 */
int opd_start(struct opd *d, const char *const *args, int listen_fd, int journal,
	      const char *ready_path);
/* SIGTERM, then read its output to EOF; the wait status, or -ETIMEDOUT (then killed). */
int opd_stop(struct opd *d);
/* opd_start, asserting the daemon started (its log in the message when not). */
void opd_start_or_fail(struct opd *d, const char *const *args, const char *sock);
/* opd_stop, expecting exit 0 (its log in the message when not). */
void opd_stop_clean(struct opd *d);
/* A fresh 0755 directory (so other uids may search it): /tmp/shardd-ops-XXXXXX. */
void make_base(char *dir, size_t len);
/* rm -rf dir. */
void remove_tree(const char *dir);
/* Skip the test unless it runs as root. */
void require_root(void);
/*
 * A client of a one-rank job: nop, then register a 5x3 fp32 param, write
 * its shard, unshard step 1 and read the unsharded copy back. Runs in a
 * child (CHILD_CHECK); 0 when all of it worked.
 */
int client_run_ops(const char *socket, const char *job);
/* `shardd FLAG VALUE` exits 2 (usage) and its output holds `needle`. */
void expect_usage_error(const char *flag, const char *value, const char *needle);

#endif /* SHARDD_TEST_OPSD_H */

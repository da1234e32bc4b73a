/* SPDX-License-Identifier: MIT */
/* A shardd started by the test itself, and the one-rank client run on it (opsd.h). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "opsd.h"
#include "shardd.h"

/* Read what is there (waiting up to timeout_ms for the first byte). 0, -EPIPE at EOF, -ETIMEDOUT. */
static int opd_read(struct opd *d, int timeout_ms)
{
	struct pollfd p = { .fd = d->out_fd, .events = POLLIN };
	ssize_t n;
	char junk[4096];
	int r = poll(&p, 1, timeout_ms);

	if (r < 0)
		return errno == EINTR ? 0 : -errno;
	if (r == 0)
		return -ETIMEDOUT;
	if (d->len + 1 < sizeof(d->log))
		n = read(d->out_fd, d->log + d->len, sizeof(d->log) - 1 - d->len);
	else
		n = read(d->out_fd, junk, sizeof(junk)); /* keep the daemon from blocking */
	if (n < 0)
		return errno == EINTR ? 0 : -errno;
	if (n == 0)
		return -EPIPE;
	if (d->len + 1 < sizeof(d->log))
		d->len += (size_t)n;
	d->log[d->len] = '\0';
	return 0;
}

/*
 * Start $SHARDD_BIN with args (NULL-terminated). listen_fd >= 0 is passed
 * as fd 3 with LISTEN_FDS=1 and LISTEN_PID set, as systemd does; journal
 * sets JOURNAL_STREAM to the DEV:INODE of the daemon's stderr. Waits for
 * "shardd: ready on <ready_path>". 0, -EPIPE (it exited: its output is in
 * d->log), -ETIMEDOUT.
 */
int opd_start(struct opd *d, const char *const *args, int listen_fd, int journal,
	      const char *ready_path)
{
	const char *bin = getenv("SHARDD_BIN");
	const char *argv[32];
	char want[256];
	int64_t deadline = harness_now_ms() + OPD_READY_MS;
	int out[2], argc = 0, ret = 0;

	cr_assert(bin && bin[0] == '/', "SHARDD_BIN must be shardd's absolute path");
	argv[argc++] = bin;
	argv[argc++] = "--rank-exec-max";
	argv[argc++] = harness_rank_exec_max();
	for (int i = 0; args && args[i] && argc < 31; i++)
		argv[argc++] = args[i];
	argv[argc] = NULL;
	memset(d, 0, sizeof(*d));
	cr_assert_eq(pipe2(out, O_CLOEXEC), 0);
	fflush(stdout);
	fflush(stderr);
	d->pid = fork();
	cr_assert_geq(d->pid, 0, "fork: %s", strerror(errno));
	if (d->pid == 0) {
		char buf[64];

		prctl(PR_SET_PDEATHSIG, SIGKILL);
		dup2(out[1], STDOUT_FILENO);
		dup2(out[1], STDERR_FILENO);
		signal(SIGPIPE, SIG_DFL);
		unsetenv("LISTEN_PID");
		unsetenv("LISTEN_FDS");
		unsetenv("JOURNAL_STREAM");
		if (listen_fd >= 0) {
			/* dup2 clears FD_CLOEXEC on fd 3: it survives the exec. */
			if (listen_fd != 3 && dup2(listen_fd, 3) < 0)
				_exit(126);
			if (listen_fd == 3)
				fcntl(3, F_SETFD, 0);
			snprintf(buf, sizeof(buf), "%d", (int)getpid());
			setenv("LISTEN_PID", buf, 1);
			setenv("LISTEN_FDS", "1", 1);
		}
		if (journal) {
			struct stat st;

			if (fstat(STDERR_FILENO, &st) < 0)
				_exit(126);
			snprintf(buf, sizeof(buf), "%llu:%llu", (unsigned long long)st.st_dev,
				 (unsigned long long)st.st_ino);
			setenv("JOURNAL_STREAM", buf, 1);
		}
		execv(bin, (char *const *)argv);
		fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
		_exit(127);
	}
	close(out[1]);
	d->out_fd = out[0];
	snprintf(want, sizeof(want), "shardd: ready on %s\n", ready_path);
	while (!strstr(d->log, want)) {
		int64_t left = deadline - harness_now_ms();

		if (left <= 0)
			return -ETIMEDOUT;
		ret = opd_read(d, (int)left);
		if (ret == -EPIPE)
			return ret;
	}
	return 0;
}

/* SIGTERM, then read its output to EOF; the wait status, or -ETIMEDOUT (then killed). */
int opd_stop(struct opd *d)
{
	int64_t deadline = harness_now_ms() + OPD_STOP_MS;
	int status = 0, ret;

	if (d->pid <= 0)
		return 0;
	kill(d->pid, SIGTERM);
	while (harness_now_ms() < deadline && opd_read(d, 100) != -EPIPE)
		;
	ret = harness_wait_or_kill(
		d->pid, (int)(deadline > harness_now_ms() ? deadline - harness_now_ms() : 0),
		&status);
	close(d->out_fd);
	d->pid = 0;
	return ret < 0 ? ret : status;
}

/* opd_start, asserting the daemon started (its log in the message when not). */
void opd_start_or_fail(struct opd *d, const char *const *args, const char *sock)
{
	cr_assert_eq(opd_start(d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d->log);
}

void opd_stop_clean(struct opd *d)
{
	int status = opd_stop(d);

	cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "shardd did not exit cleanly (%s); its output:\n%s",
		  status < 0 ? strerror(-status) : harness_status_str(status), d->log);
}

/* A fresh 0755 directory (so other uids may search it): /tmp/shardd-ops-XXXXXX. */
void make_base(char *dir, size_t len)
{
	snprintf(dir, len, "/tmp/shardd-ops-XXXXXX");
	cr_assert_not_null(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
	cr_assert_eq(chmod(dir, 0755), 0);
}

void remove_tree(const char *dir)
{
	char cmd[256];

	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_expect_eq(system(cmd), 0, "%s", cmd);
}

void require_root(void)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to run a client as another uid");
}

/*
 * A client of a one-rank job: nop, then register a 5x3 fp32 param, write
 * its shard, unshard step 1 and read the unsharded copy back.
 */
int client_run_ops(const char *socket, const char *job)
{
	struct shardd_attach_opts o = {
		.socket_path = socket,
		.job = job,
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_param_desc p = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 }
	};
	struct shardd_precision prec = { .param_dtype = SHARDD_DTYPE_NONE,
					 .reduce_dtype = SHARDD_DTYPE_NONE };
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float full[15];
	const float *u;
	int ret;

	ret = shardd_connect(&o, &c);
	CHILD_CHECK(ret == 0, "attach: %s", shardd_last_error());
	ret = shardd_nop(c);
	CHILD_CHECK(ret == 0, "nop: %s", shardd_last_error());
	ret = shardd_group_register(c, "layer", &p, 1, &prec, NULL, &g);
	CHILD_CHECK(ret == 0, "register: %s", shardd_last_error());
	for (int i = 0; i < 15; i++)
		full[i] = (float)i * 0.5f - 3.0f;
	ret = shardd_group_load_full(g, 0, full);
	CHILD_CHECK(ret == 0, "load_full: %s", shardd_last_error());
	ret = shardd_unshard(g, 1);
	CHILD_CHECK(ret == 0, "unshard: %s", shardd_last_error());
	u = shardd_group_unsharded(g, 0);
	for (int i = 0; i < 15; i++)
		CHILD_CHECK(u[i] == full[i], "unsharded[%d] = %g, wrote %g", i, u[i], full[i]);
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

/* `shardd FLAG VALUE` exits 2 (usage) and its output holds `needle`. */
void expect_usage_error(const char *flag, const char *value, const char *needle)
{
	const char *argv[] = { getenv("SHARDD_BIN"), flag, value, NULL };
	char out[4096];
	int status = 0;

	cr_assert_eq(harness_run(argv, CTL_MS, &status, out, sizeof(out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 2, "%s: %s",
		  harness_status_str(status), out);
	cr_assert_not_null(strstr(out, needle), "%s", out);
}

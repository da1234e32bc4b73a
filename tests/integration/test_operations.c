/* SPDX-License-Identifier: MIT */
/*
 * Operating shardd as a system daemon, against the real binary: the socket
 * and its directory under --allow-gid / --socket-mode / --socket-group (a
 * client of another uid in the allowed group attaches and runs ops; without
 * the flag it is refused), socket activation (the LISTEN_FDS protocol, as
 * systemd and systemd-socket-activate speak it), journal-style logging when
 * stderr is the journal, socket_path "" meaning the default, the stuck-rank
 * view of shardctl (zero_grad, nop and barriers carry no step; COMPLETED is
 * never behind TAKEN with nothing in flight) and --version on every binary.
 *
 * Tests that change uids need root (they skip otherwise), as the rest of
 * the integration suites do.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "shardd.h"

#define OPD_LOG_MAX     (1 << 16)
#define OPD_READY_MS    10000
#define OPD_STOP_MS     10000
#define CHILD_MS        20000
#define CTL_MS          10000
#define ALLOWED_GID     4242u   /* a group no other test uses; needs no /etc/group entry */
#define OTHER_GID       4343u
#define NOBODY          65534u  /* the unprivileged uid the clients switch to */

/* ------------------------------------------------------------------ */
/* A shardd started by the test itself                                 */
/* ------------------------------------------------------------------ */

/*
 * The harness starts the daemon on a socket in a private 0700 directory;
 * these tests need to choose the socket's path, pass it a listening socket
 * or make its stderr "the journal", so they start it here.
 */
struct opd {
	pid_t  pid;
	int    out_fd;              /* read end of the daemon's stdout and stderr */
	char   log[OPD_LOG_MAX];    /* everything it printed, NUL-terminated */
	size_t len;
};

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
static int opd_start(struct opd *d, const char *const *args, int listen_fd, int journal,
		     const char *ready_path)
{
	const char *bin = getenv("SHARDD_BIN");
	const char *argv[32];
	char want[256];
	int64_t deadline = harness_now_ms() + OPD_READY_MS;
	int out[2], argc = 0, ret = 0;

	cr_assert(bin && bin[0] == '/', "SHARDD_BIN must be shardd's absolute path");
	argv[argc++] = bin;
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
static int opd_stop(struct opd *d)
{
	int64_t deadline = harness_now_ms() + OPD_STOP_MS;
	int status = 0, ret;

	if (d->pid <= 0)
		return 0;
	kill(d->pid, SIGTERM);
	while (harness_now_ms() < deadline && opd_read(d, 100) != -EPIPE)
		;
	ret = harness_wait_or_kill(d->pid, (int)(deadline > harness_now_ms() ?
						 deadline - harness_now_ms() : 0), &status);
	close(d->out_fd);
	d->pid = 0;
	return ret < 0 ? ret : status;
}

/* opd_start, asserting the daemon started (its log in the message when not). */
static void opd_start_or_fail(struct opd *d, const char *const *args, const char *sock)
{
	cr_assert_eq(opd_start(d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d->log);
}

static void opd_stop_clean(struct opd *d)
{
	int status = opd_stop(d);

	cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "shardd did not exit cleanly (%s); its output:\n%s",
		  status < 0 ? strerror(-status) : harness_status_str(status), d->log);
}

/* A fresh 0755 directory (so other uids may search it): /tmp/shardd-ops-XXXXXX. */
static void make_base(char *dir, size_t len)
{
	snprintf(dir, len, "/tmp/shardd-ops-XXXXXX");
	cr_assert_not_null(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
	cr_assert_eq(chmod(dir, 0755), 0);
}

static void remove_tree(const char *dir)
{
	char cmd[256];

	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_expect_eq(system(cmd), 0, "%s", cmd);
}

static void require_root(void)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to run a client as another uid");
}

/* ------------------------------------------------------------------ */
/* Clients                                                             */
/* ------------------------------------------------------------------ */

struct client_arg {
	const char *socket;
	gid_t       group;       /* supplementary group of the client */
	int         want;        /* 0: attach and run ops; else the attach error expected */
	const char *want_text;   /* with want != 0: a string the error must hold */
};

/*
 * A client of a one-rank job: nop, then register a 5x3 fp32 param, write
 * its shard, unshard step 1 and read the unsharded copy back.
 */
static int client_run_ops(const char *socket, const char *job)
{
	struct shardd_attach_opts o = {
		.socket_path = socket, .job = job, .rank = 0, .replicate = 1, .shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_param_desc p = { .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2,
				       .shape = { 5, 3 } };
	struct shardd_policy pol = { .param_dtype = SHARDD_DTYPE_NONE, .reduce_dtype = SHARDD_DTYPE_NONE };
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float full[15];
	const float *u;
	int ret;

	ret = shardd_connect(&o, &c);
	CHILD_CHECK(ret == 0, "attach: %s", shardd_last_error());
	ret = shardd_nop(c);
	CHILD_CHECK(ret == 0, "nop: %s", shardd_last_error());
	ret = shardd_group_register(c, "layer", &p, 1, &pol, &g);
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

/* Become uid NOBODY with `group` as its only supplementary group, then attach. */
static int other_uid_client_main(void *p)
{
	const struct client_arg *a = p;
	struct shardd_attach_opts o = {
		.socket_path = a->socket, .job = "othr", .rank = 0, .replicate = 1, .shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_client *c = NULL;
	gid_t groups[1] = { a->group };
	int ret;

	CHILD_CHECK(setgroups(1, groups) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0,
		    "become uid %u with group %u: %s", NOBODY, (unsigned)a->group, strerror(errno));
	if (a->want == 0)
		return client_run_ops(a->socket, "othr");
	ret = shardd_connect(&o, &c);
	CHILD_CHECK(ret == a->want, "attach gave %d (%s), expected %d: %s", ret,
		    shardd_strerror(ret), a->want, shardd_last_error());
	CHILD_CHECK(strstr(shardd_last_error(), a->want_text), "'%s' does not say '%s'",
		    shardd_last_error(), a->want_text);
	return 0;
}

static void run_other_uid_client(struct client_arg *a, struct opd *d)
{
	int status = 0;
	pid_t pid = harness_fork(other_uid_client_main, a);

	cr_assert_gt(pid, 0);
	cr_assert_eq(harness_wait_or_kill(pid, CHILD_MS, &status), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "the uid %u client %s; shardd's output:\n%s", NOBODY,
		  harness_status_str(status), d->log);
}

/* run_other_uid_client, then the daemon stopped (exit 0) and the base directory removed. */
static void other_uid_client_then_stop(struct client_arg *a, struct opd *d, const char *base)
{
	run_other_uid_client(a, d);
	opd_stop_clean(d);
	remove_tree(base);
}

static void assert_mode(const char *path, unsigned mode, gid_t gid)
{
	struct stat st;

	cr_assert_eq(stat(path, &st), 0, "stat %s: %s", path, strerror(errno));
	cr_assert_eq(st.st_mode & 07777, mode, "%s has mode %04o, expected %04o", path,
		     st.st_mode & 07777, mode);
	cr_assert_eq(st.st_gid, gid, "%s has group %u, expected %u", path, (unsigned)st.st_gid,
		     (unsigned)gid);
}

TestSuite(operations, .timeout = 60);

/* ------------------------------------------------------------------ */
/* --allow-gid, --socket-mode, --socket-group (issue 11, hole 7)        */
/* ------------------------------------------------------------------ */

Test(operations, allowed_group_client_of_another_uid_attaches_and_runs_ops)
{
	char base[64], dir[96], sock[128], gid[16];
	struct client_arg a = { .socket = sock, .group = ALLOWED_GID };
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	snprintf(gid, sizeof(gid), "%u", ALLOWED_GID);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, "--allow-gid", gid,
						NULL }, sock);
	/* The directory shardd created lets the group search it; the socket lets it connect. */
	assert_mode(dir, 0750, ALLOWED_GID);
	assert_mode(sock, 0660, ALLOWED_GID);
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, other_uid_without_allow_gid_cannot_reach_the_socket)
{
	char base[64], dir[96], sock[128];
	struct client_arg a = { .socket = sock, .group = ALLOWED_GID, .want = -EACCES,
				.want_text = sock };
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, NULL }, sock);
	/* Without --allow-gid only shardd's own uid reaches the socket. */
	assert_mode(dir, 0700, getgid());
	assert_mode(sock, 0600, getgid());
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, open_socket_mode_still_refuses_a_uid_not_allowed_naming_the_flag)
{
	char base[64], sock[128];
	struct client_arg a = { .socket = sock, .group = OTHER_GID, .want = -SHARDD_E_PERM,
				.want_text = "--allow-gid" };
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/run/shardd.sock", base);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, "--socket-mode", "0666",
						NULL }, sock);
	/* The socket is open to all, so the daemon's own check answers, in words. */
	assert_mode(sock, 0666, getgid());
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, socket_group_flag_picks_the_group_among_several_allowed)
{
	char base[64], dir[96], sock[128], g1[16], g2[16];
	struct client_arg a = { .socket = sock, .group = OTHER_GID };
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	snprintf(g1, sizeof(g1), "%u", ALLOWED_GID);
	snprintf(g2, sizeof(g2), "%u", OTHER_GID);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, "--allow-gid", g1,
						"--allow-gid", g2, "--socket-group", g2,
						NULL }, sock);
	assert_mode(dir, 0750, OTHER_GID);
	assert_mode(sock, 0660, OTHER_GID);
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, existing_private_directory_is_kept_and_warned_about)
{
	char base[64], dir[96], sock[128], gid[16];
	struct opd d;

	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	snprintf(gid, sizeof(gid), "%u", ALLOWED_GID);
	cr_assert_eq(mkdir(dir, 0700), 0);
	cr_assert_eq(chmod(dir, 0700), 0);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, "--allow-gid", gid,
						NULL }, sock);
	/* Not shardd's to change (it may be a home or /tmp), but the log says why clients fail. */
	assert_mode(dir, 0700, getgid());
	cr_assert_not_null(strstr(d.log, "cannot be searched by group 4242"), "%s", d.log);
	cr_assert_not_null(strstr(d.log, dir), "%s", d.log);
	opd_stop_clean(&d);
	remove_tree(base);
}

/* `shardd FLAG VALUE` exits 2 (usage) and its output holds `needle`. */
static void expect_usage_error(const char *flag, const char *value, const char *needle)
{
	const char *argv[] = { getenv("SHARDD_BIN"), flag, value, NULL };
	char out[4096];
	int status = 0;

	cr_assert_eq(harness_run(argv, CTL_MS, &status, out, sizeof(out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 2, "%s: %s",
		  harness_status_str(status), out);
	cr_assert_not_null(strstr(out, needle), "%s", out);
}

Test(operations, bad_socket_mode_is_a_usage_error)
{
	expect_usage_error("--socket-mode", "0066", "--socket-mode: '0066'");
}

/* ------------------------------------------------------------------ */
/* Socket activation                                                   */
/* ------------------------------------------------------------------ */

/* A listening socket of `type` at path, as systemd's .socket unit makes it. */
static int listening_socket(const char *path, int type)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);

	cr_assert_geq(fd, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind %s: %s", path,
		     strerror(errno));
	cr_assert_eq(listen(fd, 16), 0);
	return fd;
}

Test(operations, socket_activated_daemon_serves_the_passed_socket)
{
	char base[64], sock[128];
	struct stat st;
	struct opd d;
	int fd;

	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/activated.sock", base);
	fd = listening_socket(sock, SOCK_SEQPACKET);
	{
		/* No --socket: the passed socket's own path is the one served and announced. */
		const char *args[] = { "--log-level", "info", NULL };

		cr_assert_eq(opd_start(&d, args, fd, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
	cr_assert_eq(client_run_ops(sock, "act"), 0, "a client of the activated daemon failed");
	opd_stop_clean(&d);
	/* systemd owns the socket: it outlives the daemon, and still accepts for the next one. */
	cr_assert_eq(lstat(sock, &st), 0, "shardd removed the socket systemd passed: %s\n%s",
		     strerror(errno), d.log);
	cr_assert(S_ISSOCK(st.st_mode));
	{
		const char *args[] = { NULL };

		cr_assert_eq(opd_start(&d, args, fd, 0, sock), 0, "second start:\n%s", d.log);
	}
	cr_assert_eq(client_run_ops(sock, "act2"), 0, "a client of the restarted daemon failed");
	opd_stop_clean(&d);
	close(fd);
	remove_tree(base);
}

Test(operations, socket_activation_with_a_stream_socket_is_refused)
{
	char base[64], sock[128];
	struct opd d;
	int fd, status;

	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/stream.sock", base);
	fd = listening_socket(sock, SOCK_STREAM);
	cr_assert_eq(opd_start(&d, NULL, fd, 0, sock), -EPIPE, "shardd served a stream socket:\n%s",
		     d.log);
	status = opd_stop(&d);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "%s", harness_status_str(status));
	cr_assert_not_null(strstr(d.log, "ListenSequentialPacket"), "%s", d.log);
	close(fd);
	remove_tree(base);
}

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
			cr_assert(len > 3 && line[0] == '<' && strchr("3467", line[1]) && line[2] == '>',
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
		const char *args[] = { "--socket", sock, "--allow-gid", gid, "--log-level", "info",
				       NULL };

		cr_assert_eq(opd_start(&d, args, -1, 1, sock), 0, "shardd did not start:\n%s", d.log);
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
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, "--log-level", "info",
						NULL }, sock);
	unsetenv("JOURNAL_STREAM");
	opd_stop_clean(&d);
	cr_assert_not_null(strstr(d.log, " info: shardd " SHARDD_VERSION " (protocol"), "%s", d.log);
	cr_assert_null(strstr(d.log, "<6>"), "%s", d.log);
	/* "YYYY-MM-DD hh:mm:ss.mmm shardd[pid] info: " */
	cr_assert(d.log[4] == '-' && d.log[7] == '-' && d.log[13] == ':', "%s", d.log);
	remove_tree(base);
}

/* ------------------------------------------------------------------ */
/* socket_path "" is the default                                        */
/* ------------------------------------------------------------------ */

Test(operations, empty_socket_path_means_the_default)
{
	struct harness_daemon hd = { 0 };
	struct shardd_attach_opts o = {
		.socket_path = "", .job = "empty", .rank = 0, .replicate = 1, .shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_client *c = NULL;
	int ret;

	cr_assert_eq(harness_daemon_start(&hd, NULL), 0, "shardd did not start");
	setenv("SHARDD_SOCKET", hd.socket, 1);
	ret = shardd_connect(&o, &c);
	unsetenv("SHARDD_SOCKET");
	cr_assert_eq(ret, 0, "socket_path \"\" did not mean $SHARDD_SOCKET: %s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0, "%s", shardd_last_error());
	shardd_close(c);
	harness_daemon_stop_expect_clean(&hd);
}

/* ------------------------------------------------------------------ */
/* shardctl ranks: the stuck-rank view                                 */
/* ------------------------------------------------------------------ */

static char ctl_out[1 << 18];

/* shardctl --socket SOCK --json ranks, parsed; the job's object. */
static json_t *ranks_json(const char *sock, json_t **root)
{
	static char path[4096];
	const char *build = getenv("SHARDD_BUILD");
	const char *argv[] = { path, "--socket", sock, "--json", "ranks", NULL };
	json_error_t err;
	int status = 0;
	json_t *job;

	cr_assert(build, "SHARDD_BUILD is not set: run through make test");
	snprintf(path, sizeof(path), "%s/shardctl", build);
	cr_assert_eq(harness_run(argv, CTL_MS, &status, ctl_out, sizeof(ctl_out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "shardctl ranks %s:\n%s",
		  harness_status_str(status), ctl_out);
	*root = json_loads(ctl_out, 0, &err);
	cr_assert_not_null(*root, "shardctl --json ranks: %s:\n%s", err.text, ctl_out);
	job = json_array_get(json_object_get(*root, "jobs"), 0);
	cr_assert_not_null(job, "no job in:\n%s", ctl_out);
	return job;
}

/* Run shardctl --socket SOCK ranks (text) into ctl_out. */
static void ranks_text(const char *sock)
{
	static char path[4096];
	const char *argv[] = { path, "--socket", sock, "ranks", NULL };
	int status = 0;

	snprintf(path, sizeof(path), "%s/shardctl", getenv("SHARDD_BUILD"));
	cr_assert_eq(harness_run(argv, CTL_MS, &status, ctl_out, sizeof(ctl_out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s", ctl_out);
}

static const json_t *rank_obj(const json_t *job, uint32_t r)
{
	const json_t *o = json_array_get(json_object_get(job, "ranks"), r);

	cr_assert_not_null(o);
	return o;
}

static long long jint(const json_t *o, const char *key)
{
	const json_t *v = json_object_get(o, key);

	cr_assert(json_is_integer(v), "'%s' is not an integer:\n%s", key, ctl_out);
	return json_integer_value(v);
}

static const char *jop(const json_t *o, const char *key)
{
	const char *s = json_string_value(json_object_get(json_object_get(o, key), "op"));

	cr_assert_not_null(s, "'%s' has no op:\n%s", key, ctl_out);
	return s;
}

struct reg_arg {
	struct shardd_client *c;
	struct shardd_group  *g;
	int                   ret;
	char                  err[512];
};

/* Registration is collective and blocks until both ranks registered: one thread per rank. */
static void *register_main(void *p)
{
	struct reg_arg *a = p;
	struct shardd_param_desc d = { .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1,
				       .shape = { 8 } };
	struct shardd_policy pol = { .param_dtype = SHARDD_DTYPE_NONE, .reduce_dtype = SHARDD_DTYPE_NONE };

	a->ret = shardd_group_register(a->c, "layer", &d, 1, &pol, &a->g);
	if (a->ret < 0)
		snprintf(a->err, sizeof(a->err), "%s", shardd_last_error());
	return NULL;
}

/* Submit op on rank 0 without waiting. */
static void submit0(struct shardd_client *c, uint32_t op, const struct shardd_group *g,
		    uint64_t step, uint64_t ud)
{
	cr_assert_eq(shardd_submit(c, op, g ? shardd_group_id(g) : 0, step, 0, ud), 0, "%s",
		     shardd_last_error());
}

/* Reap rank 0's completion of user_data ud (others arriving first are checked too). */
static void reap0(struct shardd_client *c, uint64_t ud)
{
	struct shardd_completion cqe;

	do {
		cr_assert_eq(shardd_wait(c, &cqe, 10000), 0, "%s", shardd_last_error());
		cr_assert_eq(cqe.res, 0, "op %u step %llu failed: %s", cqe.op,
			     (unsigned long long)cqe.step, cqe.msg);
	} while (cqe.user_data != ud);
}

/* With nothing in flight, a rank's latest-taken completed op is the last one it took. */
static void assert_completed_matches_taken(const json_t *rk)
{
	if (jint(rk, "inflight") != 0)
		return;
	cr_assert_str_eq(jop(rk, "completed"), jop(rk, "taken"), "rank %lld:\n%s",
			 jint(rk, "rank"), ctl_out);
	cr_assert_eq(jint(json_object_get(rk, "completed"), "step"),
		     jint(json_object_get(rk, "taken"), "step"), "rank %lld:\n%s",
		     jint(rk, "rank"), ctl_out);
}

Test(operations, ranks_view_counts_only_step_carrying_ops)
{
	static const char *const extra[] = { "--collective-timeout", "30", NULL };
	struct harness_daemon hd = { 0 };
	struct shardd_client *c[2];
	struct reg_arg reg[2] = { { 0 } };
	pthread_t th[2];
	json_t *root;
	const json_t *job, *r0, *r1;

	cr_assert_eq(harness_daemon_start(&hd, extra), 0, "shardd did not start");
	for (uint32_t r = 0; r < 2; r++) {
		cr_assert_eq(harness_attach(&hd, "steps", r, 1, 2, &c[r]), 0, "%s",
			     shardd_last_error());
		reg[r].c = c[r];
	}
	for (int r = 0; r < 2; r++)
		cr_assert_eq(pthread_create(&th[r], NULL, register_main, &reg[r]), 0);
	for (int r = 0; r < 2; r++) {
		pthread_join(th[r], NULL);
		cr_assert_eq(reg[r].ret, 0, "rank %d register: %s", r, reg[r].err);
	}

	/* Step 3 on both ranks: unshard (collective), then reshard. */
	submit0(c[0], SHARDD_OP_UNSHARD, reg[0].g, 3, 10);
	cr_assert_eq(shardd_unshard(reg[1].g, 3), 0, "%s", shardd_last_error());
	reap0(c[0], 10);
	cr_assert_eq(shardd_reshard(reg[0].g, 3), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_reshard(reg[1].g, 3), 0, "%s", shardd_last_error());
	/* Rank 1 then zeroes its grads and probes: ops that carry step 0. */
	cr_assert_eq(shardd_zero_grad(reg[1].g), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_nop(c[1]), 0, "%s", shardd_last_error());

	job = ranks_json(hd.socket, &root);
	r0 = rank_obj(job, 0);
	r1 = rank_obj(job, 1);
	cr_assert_eq(jint(job, "max_step"), 3, "%s", ctl_out);
	cr_assert_str_eq(jop(r1, "submitted"), "nop", "%s", ctl_out);
	cr_assert_eq(jint(r1, "behind"), 0, "rank 1 shown behind after zero_grad:\n%s", ctl_out);
	cr_assert_eq(jint(r1, "step"), 3, "zero_grad/nop moved rank 1's step:\n%s", ctl_out);
	cr_assert_eq(jint(r0, "step"), 3, "%s", ctl_out);
	cr_assert_eq(jint(r0, "behind"), 0, "%s", ctl_out);
	assert_completed_matches_taken(r0);
	assert_completed_matches_taken(r1);
	json_decref(root);
	ranks_text(hd.socket);
	cr_assert_not_null(strstr(ctl_out, "STEP"), "%s", ctl_out);
	cr_assert_null(strstr(ctl_out, "nop@"), "nop shown with a step:\n%s", ctl_out);
	cr_assert_null(strstr(ctl_out, "zero_grad@"), "zero_grad shown with a step:\n%s", ctl_out);
	cr_assert_not_null(strstr(ctl_out, "furthest step 3"), "%s", ctl_out);

	/*
	 * Rank 0 enters barrier 7, then a nop that completes first; rank 1's
	 * barrier completes rank 0's barrier last. With nothing in flight,
	 * COMPLETED is rank 0's last op taken, and barrier 7 is no step 7.
	 */
	submit0(c[0], SHARDD_OP_BARRIER, NULL, 7, 20);
	submit0(c[0], SHARDD_OP_NOP, NULL, 0, 21);
	cr_assert_eq(shardd_barrier(c[1], 7), 0, "%s", shardd_last_error());
	reap0(c[0], 20);
	job = ranks_json(hd.socket, &root);
	r0 = rank_obj(job, 0);
	if (jint(r0, "inflight") != 0)
		reap0(c[0], 21);
	json_decref(root);
	{
		struct shardd_completion cqe;

		/* Whichever came first, both are reaped now: nothing of rank 0 is in flight. */
		while (shardd_poll(c[0], &cqe) == 0)
			cr_assert_eq(cqe.res, 0, "%s", cqe.msg);
	}
	job = ranks_json(hd.socket, &root);
	r0 = rank_obj(job, 0);
	cr_assert_eq(jint(r0, "inflight"), 0, "%s", ctl_out);
	cr_assert_str_eq(jop(r0, "taken"), "nop", "%s", ctl_out);
	assert_completed_matches_taken(r0);
	assert_completed_matches_taken(rank_obj(job, 1));
	cr_assert_eq(jint(job, "max_step"), 3, "barrier 7 counted as step 7:\n%s", ctl_out);
	json_decref(root);

	/* Rank 0 goes on to step 4 and waits in it; rank 1 zeroes grads: it is 1 step behind, not 4. */
	submit0(c[0], SHARDD_OP_UNSHARD, reg[0].g, 4, 30);
	cr_assert_eq(shardd_zero_grad(reg[1].g), 0, "%s", shardd_last_error());
	job = ranks_json(hd.socket, &root);
	cr_assert_eq(jint(job, "max_step"), 4, "%s", ctl_out);
	cr_assert_eq(jint(rank_obj(job, 0), "behind"), 0, "%s", ctl_out);
	cr_assert_eq(jint(rank_obj(job, 1), "behind"), 1, "%s", ctl_out);
	cr_assert_eq(jint(rank_obj(job, 1), "step"), 3, "%s", ctl_out);
	json_decref(root);
	cr_assert_eq(shardd_unshard(reg[1].g, 4), 0, "%s", shardd_last_error());
	reap0(c[0], 30);

	for (int r = 0; r < 2; r++) {
		shardd_group_close(reg[r].g);
		shardd_close(c[r]);
	}
	harness_daemon_stop_expect_clean(&hd);
}

/* ------------------------------------------------------------------ */
/* --metrics-listen: Prometheus over HTTP                              */
/* ------------------------------------------------------------------ */

/*
 * A strict check of the Prometheus text exposition format 0.0.4
 * (prometheus.io/docs/instrumenting/exposition_formats), the rules that
 * `promtool check metrics` enforces: valid metric and label names, escapes
 * in label values and HELP text, at most one HELP and one TYPE per family,
 * TYPE before its samples, families contiguous, no duplicate series, float
 * values, counters >= 0, and histograms with increasing le, cumulative
 * buckets, a +Inf bucket equal to _count, and a _sum.
 */
#define EXPO_FAMILIES 64
#define EXPO_SERIES   1024

struct expo_family {
	char name[128];
	char type[16];
	int  help, typed, closed; /* seen HELP, TYPE; its samples ended (another family came) */
};

struct expo_series {
	char   key[512];   /* name{labels without le} */
	double le_last;    /* histogram: last le seen */
	double cum_last;   /* histogram: last bucket count */
	int    buckets, inf, sum, count;
	double inf_value, count_value;
};

struct expo {
	struct expo_family fam[EXPO_FAMILIES];
	int    nfam;
	struct expo_series ser[EXPO_SERIES];
	int    nser;
	char   seen[EXPO_SERIES][512]; /* every full series key, for duplicates */
	int    nseen;
	int    current;                /* family of the samples being read, -1 none */
	char   why[512];
};

static int expo_fail(struct expo *e, int lineno, const char *fmt, ...)
{
	va_list ap;
	int n = snprintf(e->why, sizeof(e->why), "line %d: ", lineno);

	va_start(ap, fmt);
	vsnprintf(e->why + n, sizeof(e->why) - (size_t)n, fmt, ap);
	va_end(ap);
	return -1;
}

static int name_char(char c, int first, int colon)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
	       (colon && c == ':') || (!first && c >= '0' && c <= '9');
}

/* Length of a metric (colon = 1) or label name at p; 0 when none. */
static size_t name_len(const char *p, int colon)
{
	size_t n = 0;

	while (name_char(p[n], n == 0, colon))
		n++;
	return n;
}

static int expo_float(const char *s, size_t len, double *out)
{
	char buf[64], *end;

	if (len == 0 || len >= sizeof(buf))
		return -1;
	memcpy(buf, s, len);
	buf[len] = '\0';
	if (strcmp(buf, "+Inf") == 0 || strcmp(buf, "Inf") == 0) {
		*out = INFINITY;
		return 0;
	}
	if (strcmp(buf, "-Inf") == 0) {
		*out = -INFINITY;
		return 0;
	}
	if (strcmp(buf, "NaN") == 0) {
		*out = NAN;
		return 0;
	}
	errno = 0;
	*out = strtod(buf, &end);
	return errno || *end || isinf(*out) || isnan(*out) ? -1 : 0;
}

static int expo_family_of(struct expo *e, const char *name, size_t len)
{
	for (int i = 0; i < e->nfam; i++)
		if (strlen(e->fam[i].name) == len && memcmp(e->fam[i].name, name, len) == 0)
			return i;
	return -1;
}

static int expo_family_new(struct expo *e, const char *name, size_t len)
{
	int i = expo_family_of(e, name, len);

	if (i >= 0 || e->nfam == EXPO_FAMILIES || len >= sizeof(e->fam[0].name))
		return i >= 0 ? i : -1;
	i = e->nfam++;
	memset(&e->fam[i], 0, sizeof(e->fam[i]));
	memcpy(e->fam[i].name, name, len);
	return i;
}

/* Switch to family f for a sample or a TYPE: families must be contiguous. */
static int expo_enter(struct expo *e, int f, int lineno)
{
	if (e->current == f)
		return 0;
	if (e->fam[f].closed)
		return expo_fail(e, lineno, "family %s is not contiguous", e->fam[f].name);
	if (e->current >= 0)
		e->fam[e->current].closed = 1;
	e->current = f;
	return 0;
}

static int expo_comment(struct expo *e, const char *line, int lineno)
{
	const char *p = line + 2;
	int help = strncmp(line, "# HELP ", 7) == 0, type = strncmp(line, "# TYPE ", 7) == 0;
	size_t n;
	int f;

	if (!help && !type)
		return 0; /* a plain comment */
	p = line + 7;
	n = name_len(p, 1);
	if (n == 0 || p[n] != ' ')
		return expo_fail(e, lineno, "bad metric name in '%s'", line);
	f = expo_family_new(e, p, n);
	if (f < 0)
		return expo_fail(e, lineno, "too many families");
	p += n + 1;
	if (help) {
		if (e->fam[f].help++)
			return expo_fail(e, lineno, "second HELP for %s", e->fam[f].name);
		for (; *p; p++)
			if (*p == '\\' && p[1] != '\\' && p[1] != 'n')
				return expo_fail(e, lineno, "bad escape in HELP of %s", e->fam[f].name);
			else if (*p == '\\')
				p++;
		return 0;
	}
	if (e->fam[f].typed++)
		return expo_fail(e, lineno, "second TYPE for %s", e->fam[f].name);
	if (strcmp(p, "counter") && strcmp(p, "gauge") && strcmp(p, "histogram") &&
	    strcmp(p, "summary") && strcmp(p, "untyped"))
		return expo_fail(e, lineno, "unknown type '%s'", p);
	if (e->fam[f].closed || e->current == f)
		return expo_fail(e, lineno, "TYPE of %s after its samples", e->fam[f].name);
	snprintf(e->fam[f].type, sizeof(e->fam[f].type), "%s", p);
	return expo_enter(e, f, lineno);
}

static struct expo_series *expo_series(struct expo *e, const char *key)
{
	for (int i = 0; i < e->nser; i++)
		if (strcmp(e->ser[i].key, key) == 0)
			return &e->ser[i];
	if (e->nser == EXPO_SERIES)
		return NULL;
	memset(&e->ser[e->nser], 0, sizeof(e->ser[0]));
	snprintf(e->ser[e->nser].key, sizeof(e->ser[0].key), "%s", key);
	e->ser[e->nser].le_last = -INFINITY;
	return &e->ser[e->nser++];
}

static int expo_sample(struct expo *e, const char *line, int lineno)
{
	const char *p = line, *suffix = "";
	char labels[384] = "", full[512], key[512], le[64] = "";
	size_t n = name_len(p, 1), base_len, ll = 0;
	double v;
	int f;

	if (n == 0)
		return expo_fail(e, lineno, "bad metric name in '%s'", line);
	/* A histogram's samples are NAME_bucket, NAME_sum and NAME_count of family NAME. */
	base_len = n;
	f = expo_family_of(e, p, n);
	if (f < 0) {
		static const char *const sfx[] = { "_bucket", "_sum", "_count" };

		for (int i = 0; i < 3 && f < 0; i++) {
			size_t sl = strlen(sfx[i]);

			if (n > sl && memcmp(p + n - sl, sfx[i], sl) == 0) {
				f = expo_family_of(e, p, n - sl);
				if (f >= 0 && strcmp(e->fam[f].type, "histogram") &&
				    strcmp(e->fam[f].type, "summary"))
					f = -1;
				if (f >= 0) {
					suffix = sfx[i];
					base_len = n - sl;
				}
			}
		}
	}
	if (f < 0 || !e->fam[f].typed)
		return expo_fail(e, lineno, "sample '%.*s' has no TYPE before it", (int)n, p);
	if (strcmp(e->fam[f].type, "histogram") == 0 && !*suffix)
		return expo_fail(e, lineno, "histogram sample '%.*s' without _bucket/_sum/_count",
				 (int)n, p);
	if (expo_enter(e, f, lineno) < 0)
		return -1;
	p += n;
	if (*p == '{') {
		char names[16][64];
		int nl = 0;

		p++;
		while (*p != '}') {
			size_t ln = name_len(p, 0);
			const char *lstart = p, *vstart;

			if (ln == 0 || ln >= 64 || p[ln] != '=' || p[ln + 1] != '"')
				return expo_fail(e, lineno, "bad label in '%s'", line);
			for (int i = 0; i < nl; i++)
				if (strlen(names[i]) == ln && memcmp(names[i], p, ln) == 0)
					return expo_fail(e, lineno, "label %.*s twice", (int)ln, p);
			if (nl == 16)
				return expo_fail(e, lineno, "too many labels");
			memcpy(names[nl], p, ln);
			names[nl++][ln] = '\0';
			vstart = p + ln + 2;
			for (p = vstart; *p && *p != '"'; p++)
				if (*p == '\\') {
					if (p[1] != '\\' && p[1] != '"' && p[1] != 'n')
						return expo_fail(e, lineno, "bad escape in '%s'", line);
					p++;
				} else if (*p == '\n') {
					return expo_fail(e, lineno, "raw newline in a label value");
				}
			if (*p != '"')
				return expo_fail(e, lineno, "unterminated label value in '%s'", line);
			if (strcmp(names[nl - 1], "le") == 0) {
				snprintf(le, sizeof(le), "%.*s", (int)(p - vstart), vstart);
			} else {
				/* name="value" as written, closing quote included. */
				int w = snprintf(labels + ll, sizeof(labels) - ll, "%s%.*s", ll ? "," : "",
						 (int)(p + 1 - lstart), lstart);

				if (w < 0 || (size_t)w >= sizeof(labels) - ll)
					return expo_fail(e, lineno, "labels too long");
				ll += (size_t)w;
			}
			p++;
			if (*p == ',')
				p++;
			else if (*p != '}')
				return expo_fail(e, lineno, "expected , or } in '%s'", line);
		}
		p++;
	}
	if (*p != ' ')
		return expo_fail(e, lineno, "no value in '%s'", line);
	p++;
	{
		const char *sp = strchr(p, ' ');
		size_t vl = sp ? (size_t)(sp - p) : strlen(p);

		if (expo_float(p, vl, &v) < 0)
			return expo_fail(e, lineno, "value '%.*s' is not a float", (int)vl, p);
		if (sp) {
			double ts;

			if (expo_float(sp + 1, strlen(sp + 1), &ts) < 0 || strchr(sp + 1, '.'))
				return expo_fail(e, lineno, "bad timestamp in '%s'", line);
		}
	}
	snprintf(full, sizeof(full), "%.*s{%s%sle=%s}", (int)n, line, labels, ll ? "," : "", le);
	for (int i = 0; i < e->nseen; i++)
		if (strcmp(e->seen[i], full) == 0)
			return expo_fail(e, lineno, "duplicate series %s", full);
	if (e->nseen < EXPO_SERIES)
		snprintf(e->seen[e->nseen++], sizeof(e->seen[0]), "%s", full);
	if (strcmp(e->fam[f].type, "counter") == 0 && !(v >= 0))
		return expo_fail(e, lineno, "counter %s is %g", full, v);
	if (strcmp(e->fam[f].type, "histogram") == 0) {
		struct expo_series *s;

		snprintf(key, sizeof(key), "%.*s{%s}", (int)base_len, line, labels);
		s = expo_series(e, key);
		if (!s)
			return expo_fail(e, lineno, "too many series");
		if (strcmp(suffix, "_bucket") == 0) {
			double lev;

			if (!*le || expo_float(le, strlen(le), &lev) < 0)
				return expo_fail(e, lineno, "bucket without a float le: %s", full);
			if (s->inf || !(lev > s->le_last))
				return expo_fail(e, lineno, "le %s not increasing in %s", le, key);
			if (v < s->cum_last)
				return expo_fail(e, lineno, "bucket counts not cumulative in %s", key);
			s->le_last = lev;
			s->cum_last = v;
			s->buckets++;
			if (isinf(lev)) {
				s->inf = 1;
				s->inf_value = v;
			}
		} else if (*le) {
			return expo_fail(e, lineno, "le on %s", full);
		} else if (strcmp(suffix, "_sum") == 0) {
			s->sum++;
		} else {
			s->count++;
			s->count_value = v;
		}
	}
	return 0;
}

/* 0 when `text` is a valid exposition, else -1 with e->why. */
static int expo_check(struct expo *e, const char *text)
{
	const char *line = text;
	int lineno = 0;

	memset(e, 0, sizeof(*e));
	e->current = -1;
	if (!*text || text[strlen(text) - 1] != '\n')
		return expo_fail(e, 0, "the exposition does not end with a newline");
	while (*line) {
		const char *nl = strchr(line, '\n');
		char buf[1024];
		size_t len = (size_t)(nl - line);

		lineno++;
		if (len == 0 || len >= sizeof(buf))
			return expo_fail(e, lineno, "empty or overlong line");
		memcpy(buf, line, len);
		buf[len] = '\0';
		if (buf[0] == '#' ? expo_comment(e, buf, lineno) : expo_sample(e, buf, lineno))
			return -1;
		line = nl + 1;
	}
	for (int i = 0; i < e->nser; i++) {
		const struct expo_series *s = &e->ser[i];

		if (!s->inf || !s->count || !s->sum || s->count != 1 || s->sum != 1)
			return expo_fail(e, lineno, "histogram %s lacks a +Inf bucket, _sum or _count",
					 s->key);
		if (s->inf_value != s->count_value)
			return expo_fail(e, lineno, "histogram %s: +Inf bucket %g != _count %g", s->key,
					 s->inf_value, s->count_value);
	}
	return 0;
}

/* The value of the sample line starting with `series` (e.g. 'shardd_ops_total{op="nop"} '). */
static double expo_value(const char *text, const char *series)
{
	const char *p = text;

	/* A sample line, not a HELP or TYPE line that names the metric. */
	while ((p = strstr(p, series)) != NULL && p != text && p[-1] != '\n')
		p++;
	cr_assert_not_null(p, "no %s in:\n%s", series, text);
	return strtod(p + strlen(series), NULL);
}

static struct expo expo_;

Test(operations, exposition_check_rejects_what_promtool_rejects)
{
	static const char *const bad[] = {
		"x 1",                                              /* no final newline */
		"x 1\n",                                            /* no TYPE */
		"# TYPE x counter\nx -1\n",                          /* negative counter */
		"# TYPE x gauge\nx{a=\"1\",a=\"2\"} 1\n",            /* label twice */
		"# TYPE x gauge\nx{a=\"\\q\"} 1\n",                  /* bad escape */
		"# TYPE x gauge\nx abc\n",                           /* value */
		"# TYPE x gauge\n# TYPE x gauge\nx 1\n",             /* second TYPE */
		"# TYPE x gauge\nx 1\n# TYPE y gauge\ny 1\nx{a=\"b\"} 2\n", /* not contiguous */
		"# TYPE x gauge\nx 1\nx 2\n",                        /* duplicate series */
		"# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
		"h_sum 1\nh_count 1\n",                              /* not cumulative */
		"# TYPE h histogram\nh_bucket{le=\"+Inf\"} 3\nh_sum 1\nh_count 2\n", /* count */
		"# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",    /* no +Inf */
	};
	const char *good = "# HELP h A \\\\ help.\n# TYPE h histogram\n"
			   "h_bucket{op=\"a\\\"b\",le=\"0.5\"} 1\nh_bucket{op=\"a\\\"b\",le=\"+Inf\"} 2\n"
			   "h_sum{op=\"a\\\"b\"} 0.75\nh_count{op=\"a\\\"b\"} 2\n# TYPE g gauge\ng 1e3\n";

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_assert_eq(expo_check(&expo_, bad[i]), -1, "accepted bad exposition %zu:\n%s", i,
			     bad[i]);
	cr_assert_eq(expo_check(&expo_, good), 0, "rejected a good exposition: %s", expo_.why);
}

/* GET path from 127.0.0.1:port; the whole response (headers and body) into out. */
static void http_get(int port, const char *path, char *out, size_t len)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				  .sin_addr = { htonl(INADDR_LOOPBACK) } };
	int64_t deadline = harness_now_ms() + CTL_MS;
	char req[256];
	size_t have = 0;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	cr_assert_geq(fd, 0);
	cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "connect to port %d: %s",
		     port, strerror(errno));
	snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
		 path);
	cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		int64_t left = deadline - harness_now_ms();
		ssize_t n;

		cr_assert_gt(left, 0, "no complete HTTP response within %d ms:\n%.*s", CTL_MS,
			     (int)have, out);
		cr_assert_geq(poll(&p, 1, (int)left), 0);
		n = read(fd, out + have, len - 1 - have);
		cr_assert_geq(n, 0, "read: %s", strerror(errno));
		if (n == 0)
			break;
		have += (size_t)n;
		cr_assert_lt(have, len - 1, "response too large");
	}
	out[have] = '\0';
	close(fd);
}

/* The port of "serving Prometheus metrics on http://127.0.0.1:PORT/metrics" in the log. */
static int metrics_port(const struct opd *d)
{
	const char *p = strstr(d->log, "metrics on http://127.0.0.1:");

	cr_assert_not_null(p, "no metrics URL in the log:\n%s", d->log);
	return atoi(p + strlen("metrics on http://127.0.0.1:"));
}

Test(operations, metrics_listen_serves_a_valid_exposition_with_the_ops_run)
{
	static char resp[1 << 17];
	char base[64], sock[128];
	struct shardd_client *live = NULL;
	const char *body;
	struct opd d;
	int port, idle;

	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/shardd.sock", base);
	{
		/* Port 0: the kernel picks a free one, and the log names it. */
		const char *args[] = { "--socket", sock, "--metrics-listen", "0", "--log-level",
				       "info", NULL };

		cr_assert_eq(opd_start(&d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
	port = metrics_port(&d);
	/* A scraper that connects and says nothing must hold up neither clients nor scrapes. */
	{
		struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
					  .sin_addr = { htonl(INADDR_LOOPBACK) } };

		idle = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		cr_assert_eq(connect(idle, (struct sockaddr *)&sa, sizeof(sa)), 0);
	}
	cr_assert_eq(client_run_ops(sock, "scraped"), 0, "a client failed");
	{
		struct shardd_attach_opts o = {
			.socket_path = sock, .job = "live", .rank = 0, .replicate = 1, .shard = 2,
			.device = SHARDD_HELLO_DEVICE_HOST,
		};

		/* A job still held: one of its two ranks attached. */
		cr_assert_eq(shardd_connect(&o, &live), 0, "%s", shardd_last_error());
	}
	http_get(port, "/metrics", resp, sizeof(resp));
	cr_assert_not_null(strstr(resp, "HTTP/1.1 200"), "%.300s", resp);
	cr_assert_not_null(strstr(resp, "Content-Type: text/plain; version=0.0.4"), "%.300s", resp);
	body = strstr(resp, "\r\n\r\n");
	cr_assert_not_null(body);
	body += 4;
	cr_assert_eq(expo_check(&expo_, body), 0, "invalid exposition: %s\n%s", expo_.why, body);
	/* The first client ran exactly one nop and one unshard, and its job ended with it. */
	cr_assert_eq(expo_value(body, "shardd_ops_total{op=\"nop\"} "), 1.0);
	cr_assert_eq(expo_value(body, "shardd_ops_total{op=\"unshard\"} "), 1.0);
	cr_assert_eq(expo_value(body, "shardd_op_latency_seconds_count{op=\"unshard\"} "), 1.0);
	cr_assert_eq(expo_value(body, "shardd_jobs "), 1.0);
	cr_assert_eq(expo_value(body, "shardd_ranks{job=\"live\"} "), 2.0);
	cr_assert_eq(expo_value(body, "shardd_ranks_attached{job=\"live\"} "), 1.0);
	/* 5x3 fp32 is 60 bytes; the unsharded buffer rounds params up to 64-byte alignment. */
	cr_assert_eq(expo_value(body, "shardd_op_bytes_total{op=\"unshard\"} "),
		     (double)((5 * 3 * 4 + 63) / 64 * 64), "%s", body);
	http_get(port, "/other", resp, sizeof(resp));
	cr_assert_not_null(strstr(resp, "HTTP/1.1 404"), "%.300s", resp);
	close(idle);
	shardd_close(live);
	opd_stop_clean(&d);
	remove_tree(base);
}

Test(operations, metrics_listen_rejects_a_bad_address)
{
	expect_usage_error("--metrics-listen", "::1:80", "[::1]:9464");
}

/* ------------------------------------------------------------------ */
/* --version                                                           */
/* ------------------------------------------------------------------ */

Test(operations, every_binary_prints_its_version)
{
	static const char *const bins[] = {
		"shardd", "shardctl", "shardbench", "examples/train_mlp", "examples/interop_rank",
	};
	const char *build = getenv("SHARDD_BUILD");

	cr_assert(build, "SHARDD_BUILD is not set: run through make test");
	for (size_t i = 0; i < sizeof(bins) / sizeof(bins[0]); i++) {
		char path[4096], out[1024];
		const char *argv[] = { path, "--version", NULL };
		int status = 0;

		snprintf(path, sizeof(path), "%s/%s", build, bins[i]);
		cr_assert_eq(harness_run(argv, CTL_MS, &status, out, sizeof(out)), 0, "%s", path);
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s --version %s: %s",
			  bins[i], harness_status_str(status), out);
		cr_assert_not_null(strstr(out, SHARDD_VERSION), "%s --version: %s", bins[i], out);
	}
}

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
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/lib/harness.h"
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
	struct shardd_policy pol = { SHARDD_DTYPE_NONE, SHARDD_DTYPE_NONE };
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
	{
		const char *args[] = { "--socket", sock, "--allow-gid", gid, NULL };

		cr_assert_eq(opd_start(&d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
	/* The directory shardd created lets the group search it; the socket lets it connect. */
	assert_mode(dir, 0750, ALLOWED_GID);
	assert_mode(sock, 0660, ALLOWED_GID);
	run_other_uid_client(&a, &d);
	opd_stop_clean(&d);
	remove_tree(base);
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
	{
		const char *args[] = { "--socket", sock, NULL };

		cr_assert_eq(opd_start(&d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
	/* Without --allow-gid only shardd's own uid reaches the socket. */
	assert_mode(dir, 0700, getgid());
	assert_mode(sock, 0600, getgid());
	run_other_uid_client(&a, &d);
	opd_stop_clean(&d);
	remove_tree(base);
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
	{
		const char *args[] = { "--socket", sock, "--socket-mode", "0666", NULL };

		cr_assert_eq(opd_start(&d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
	/* The socket is open to all, so the daemon's own check answers, in words. */
	assert_mode(sock, 0666, getgid());
	run_other_uid_client(&a, &d);
	opd_stop_clean(&d);
	remove_tree(base);
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
	{
		const char *args[] = { "--socket", sock, "--allow-gid", g1, "--allow-gid", g2,
				       "--socket-group", g2, NULL };

		cr_assert_eq(opd_start(&d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
	assert_mode(dir, 0750, OTHER_GID);
	assert_mode(sock, 0660, OTHER_GID);
	run_other_uid_client(&a, &d);
	opd_stop_clean(&d);
	remove_tree(base);
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
	{
		const char *args[] = { "--socket", sock, "--allow-gid", gid, NULL };

		cr_assert_eq(opd_start(&d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
	/* Not shardd's to change (it may be a home or /tmp), but the log says why clients fail. */
	assert_mode(dir, 0700, getgid());
	cr_assert_not_null(strstr(d.log, "cannot be searched by group 4242"), "%s", d.log);
	cr_assert_not_null(strstr(d.log, dir), "%s", d.log);
	opd_stop_clean(&d);
	remove_tree(base);
}

Test(operations, bad_socket_mode_is_a_usage_error)
{
	const char *argv[] = { getenv("SHARDD_BIN"), "--socket-mode", "0066", NULL };
	char out[4096];
	int status = 0;

	cr_assert_eq(harness_run(argv, CTL_MS, &status, out, sizeof(out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 2, "%s: %s",
		  harness_status_str(status), out);
	cr_assert_not_null(strstr(out, "--socket-mode: '0066'"), "%s", out);
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
	{
		const char *args[] = { "--socket", sock, "--log-level", "info", NULL };

		cr_assert_eq(opd_start(&d, args, -1, 0, sock), 0, "shardd did not start:\n%s", d.log);
	}
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
	struct shardd_policy pol = { SHARDD_DTYPE_NONE, SHARDD_DTYPE_NONE };

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

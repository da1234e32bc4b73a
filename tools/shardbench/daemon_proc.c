/* SPDX-License-Identifier: MIT */
/*
 * The daemon shardbench measures when no --socket is given: the real
 * `shardd` binary, started on a socket in a fresh temporary directory with
 * its output in a log there, stopped (SIGTERM, then SIGKILL) at the end.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

#define DAEMON_START_TIMEOUT_MS 10000
#define DAEMON_STOP_TIMEOUT_MS  10000

/* Print the end of the daemon's log, so a failed start explains itself. */
static void print_log_tail(const struct bench_daemon *d)
{
	char buf[2048];
	ssize_t n;
	off_t size;
	int fd = open(d->log_path, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return;
	size = lseek(fd, 0, SEEK_END);
	lseek(fd, size > (off_t)sizeof(buf) - 1 ? size - (off_t)sizeof(buf) + 1 : 0, SEEK_SET);
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return;
	buf[n] = '\0';
	fprintf(stderr, "shardbench: last lines of %s:\n%s", d->log_path, buf);
}

/* 1 when the daemon accepts a connection on its socket, 0 while it does not yet. */
static int daemon_accepts(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd, ok;

	if (strlen(path) >= sizeof(sa.sun_path))
		return 0;
	memcpy(sa.sun_path, path, strlen(path) + 1);
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return 0;
	ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
	close(fd);
	return ok;
}

static int daemon_start(const char *shardd_path, const char *backend, const char *state_dir,
			unsigned rate, struct bench_daemon *d);

int bench_daemon_start(const char *shardd_path, const char *backend, struct bench_daemon *d)
{
	return daemon_start(shardd_path, backend, NULL, 0, d);
}

int bench_daemon_start_state(const char *shardd_path, const char *state_dir, unsigned rate,
			     struct bench_daemon *d)
{
	return daemon_start(shardd_path, NULL, state_dir, rate, d);
}

static int daemon_start(const char *shardd_path, const char *backend, const char *state_dir,
			unsigned rate, struct bench_daemon *d)
{
	char rate_arg[16];

	uint64_t deadline;
	int logfd, ret, status;
	pid_t parent, pid;

	memset(d, 0, sizeof(*d));
	snprintf(d->dir, sizeof(d->dir), "/tmp/shardbench.XXXXXX");
	if (!mkdtemp(d->dir)) {
		ret = -errno;
		fprintf(stderr, "shardbench: mkdtemp %s: %s\n", d->dir, strerror(errno));
		return ret;
	}
	snprintf(d->socket_path, sizeof(d->socket_path), "%s/shardd.sock", d->dir);
	snprintf(d->log_path, sizeof(d->log_path), "%s/shardd.log", d->dir);
	if (access(shardd_path, X_OK) != 0) {
		ret = -errno;
		fprintf(stderr,
			"shardbench: daemon binary %s: %s; build it (make) or pass "
			"--shardd PATH or --socket PATH of a running daemon\n",
			shardd_path, strerror(errno));
		goto err_dir;
	}
	logfd = open(d->log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (logfd < 0) {
		ret = -errno;
		fprintf(stderr, "shardbench: %s: %s\n", d->log_path, strerror(errno));
		goto err_dir;
	}
	fflush(NULL);
	parent = getpid();
	pid = fork();
	if (pid < 0) {
		ret = -errno;
		close(logfd);
		goto err_dir;
	}
	if (pid == 0) {
		/* A shardbench killed mid-run must not leave its daemon behind. */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (getppid() != parent)
			_exit(127);
		dup2(logfd, STDOUT_FILENO);
		dup2(logfd, STDERR_FILENO);
		snprintf(rate_arg, sizeof(rate_arg), "%u", rate);
		if (state_dir && rate)
			execl(shardd_path, shardd_path, "--socket", d->socket_path, "--backend",
			      backend ? backend : "host", "--state-dir", state_dir,
			      "--checkpoint-rate", rate_arg, (char *)NULL);
		else if (state_dir)
			execl(shardd_path, shardd_path, "--socket", d->socket_path, "--backend",
			      backend ? backend : "host", "--state-dir", state_dir, (char *)NULL);
		else
			execl(shardd_path, shardd_path, "--socket", d->socket_path, "--backend",
			      backend ? backend : "host", (char *)NULL);
		fprintf(stderr, "shardbench: exec %s: %s\n", shardd_path, strerror(errno));
		_exit(127);
	}
	close(logfd);
	d->pid = pid;

	/* Ready = accepts a connection; a daemon that exits instead is reported at once. */
	deadline = bench_now_ns() + DAEMON_START_TIMEOUT_MS * 1000000ull;
	while (!daemon_accepts(d->socket_path)) {
		const struct timespec tick = { 0, 5 * 1000 * 1000 };

		if (waitpid(pid, &status, WNOHANG) == pid) {
			d->pid = 0;
			fprintf(stderr,
				"shardbench: %s exited (status %d) before accepting on %s\n",
				shardd_path,
				WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status),
				d->socket_path);
			print_log_tail(d);
			ret = -ECHILD;
			goto err_dir;
		}
		if (bench_now_ns() > deadline) {
			fprintf(stderr, "shardbench: %s did not accept on %s within %d s\n",
				shardd_path, d->socket_path, DAEMON_START_TIMEOUT_MS / 1000);
			print_log_tail(d);
			bench_daemon_stop(d);
			return -ETIMEDOUT;
		}
		nanosleep(&tick, NULL);
	}
	return 0;

err_dir:
	unlink(d->log_path);
	rmdir(d->dir);
	d->dir[0] = '\0';
	return ret;
}

void bench_daemon_stop(struct bench_daemon *d)
{
	int status;

	if (d->pid > 0) {
		kill(d->pid, SIGTERM);
		status = bench_wait_pid(d->pid, DAEMON_STOP_TIMEOUT_MS);
		if (status == -ETIMEDOUT) {
			fprintf(stderr,
				"shardbench: daemon pid %d ignored SIGTERM for %d s; killing it\n",
				(int)d->pid, DAEMON_STOP_TIMEOUT_MS / 1000);
			kill(d->pid, SIGKILL);
			status = bench_wait_pid(d->pid, DAEMON_STOP_TIMEOUT_MS);
		}
		if (status >= 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0) &&
		    !(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM)) {
			fprintf(stderr, "shardbench: daemon pid %d ended with status 0x%x\n",
				(int)d->pid, (unsigned)status);
			print_log_tail(d);
		}
		d->pid = 0;
	}
	if (d->dir[0]) {
		unlink(d->socket_path);
		unlink(d->log_path);
		rmdir(d->dir);
		d->dir[0] = '\0';
	}
}

/* SPDX-License-Identifier: MIT */
/*
 * Integration-test harness (harness.h): the real daemon, forked clients,
 * and bounded waits on pipes and pidfds.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <jansson.h>
#ifdef SHARDD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "harness.h"
#include "shardd_ctrl.h"

#define READY_PREFIX "shardd: ready on "

const char *harness_rank_exec_max(void)
{
	const char *v = getenv("SHARDD_TEST_RANK_EXEC_MAX");

	return v ? v : "0";
}

int64_t harness_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static struct timespec abs_deadline(int timeout_ms)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	ts.tv_sec += timeout_ms / 1000;
	ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	return ts;
}

static int left_ms(int64_t deadline)
{
	int64_t d = deadline - harness_now_ms();

	return d > 0 ? (int)d : 0;
}

/* ------------------------------------------------------------------ */
/* Processes                                                           */
/* ------------------------------------------------------------------ */

/*
 * In a child of `parent`: die with it. A test that fails an assertion exits
 * at once; its daemon and client children must not outlive it.
 */
static void die_with_parent(pid_t parent)
{
	prctl(PR_SET_PDEATHSIG, SIGTERM);
	/* The parent may have exited before prctl: then nobody will signal us. */
	if (getppid() != parent)
		_exit(127);
}

pid_t harness_fork(int (*fn)(void *), void *arg)
{
	pid_t parent = getpid(), pid;

	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		die_with_parent(parent);
		_exit(fn(arg));
	}
	return pid;
}

int harness_wait_pid(pid_t pid, int timeout_ms, int *status)
{
	int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
	struct pollfd p;
	int ret;

	if (pidfd < 0) {
		ret = -errno;
		fprintf(stderr, "harness: pidfd_open(%d): %s\n", (int)pid, strerror(errno));
		return ret;
	}
	p = (struct pollfd){ .fd = pidfd, .events = POLLIN };
	do
		ret = poll(&p, 1, timeout_ms);
	while (ret < 0 && errno == EINTR);
	close(pidfd);
	if (ret == 0)
		return -ETIMEDOUT;
	if (ret < 0)
		return -errno;
	if (waitpid(pid, status, 0) != pid)
		return -errno;
	return 0;
}

int harness_wait_or_kill(pid_t pid, int timeout_ms, int *status)
{
	int ret = harness_wait_pid(pid, timeout_ms, status);

	if (ret == -ETIMEDOUT) {
		fprintf(stderr, "harness: pid %d still running after %d ms: killing it\n", (int)pid,
			timeout_ms);
		kill(pid, SIGKILL);
		waitpid(pid, status, 0);
	}
	return ret;
}

const char *harness_status_str(int status)
{
	static __thread char buf[48];

	if (WIFEXITED(status))
		snprintf(buf, sizeof(buf), "exited with %d", WEXITSTATUS(status));
	else if (WIFSIGNALED(status))
		snprintf(buf, sizeof(buf), "killed by signal %d (%s)", WTERMSIG(status),
			 strsignal(WTERMSIG(status)));
	else
		snprintf(buf, sizeof(buf), "wait status %#x", status);
	return buf;
}

/* Read whatever fd has until EOF or the deadline into out. */
static void read_until_eof(int fd, int64_t deadline, char *out, size_t len)
{
	size_t have = 0;

	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		char buf[512];
		ssize_t n;

		if (poll(&p, 1, left_ms(deadline)) <= 0)
			break;
		n = read(fd, buf, sizeof(buf));
		if (n <= 0)
			break;
		if (len && have < len - 1) {
			size_t k = (size_t)n < len - 1 - have ? (size_t)n : len - 1 - have;

			memcpy(out + have, buf, k);
			have += k;
		}
	}
	if (len)
		out[have] = '\0';
}

int harness_run(const char *const *argv, int timeout_ms, int *status, char *out, size_t len)
{
	int64_t deadline = harness_now_ms() + timeout_ms;
	pid_t parent = getpid(), pid;
	int fds[2];
	int ret;

	if (pipe2(fds, O_CLOEXEC) < 0)
		return -errno;
	pid = fork();
	if (pid < 0) {
		ret = -errno;
		close(fds[0]);
		close(fds[1]);
		return ret;
	}
	if (pid == 0) {
		die_with_parent(parent);
		dup2(fds[1], STDOUT_FILENO);
		dup2(fds[1], STDERR_FILENO);
		execv(argv[0], (char *const *)argv);
		fprintf(stderr, "harness: exec %s: %s\n", argv[0], strerror(errno));
		_exit(127);
	}
	close(fds[1]);
	read_until_eof(fds[0], deadline, out, len);
	close(fds[0]);
	return harness_wait_or_kill(pid, left_ms(deadline), status);
}

/* ------------------------------------------------------------------ */
/* Pipes between processes                                             */
/* ------------------------------------------------------------------ */

int harness_read_full(int fd, void *buf, size_t len, int timeout_ms)
{
	int64_t deadline = harness_now_ms() + timeout_ms;
	size_t have = 0;

	while (have < len) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		ssize_t n;
		int r = poll(&p, 1, left_ms(deadline));

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (r == 0)
			return -ETIMEDOUT;
		n = read(fd, (char *)buf + have, len - have);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -EPIPE;
		have += (size_t)n;
	}
	return 0;
}

int harness_signal(int fd, char byte)
{
	ssize_t n;

	do
		n = write(fd, &byte, 1);
	while (n < 0 && errno == EINTR);
	return n == 1 ? 0 : -errno;
}

/* ------------------------------------------------------------------ */
/* The daemon                                                          */
/* ------------------------------------------------------------------ */

static void log_append(struct harness_daemon *d, const char *buf, size_t n)
{
	if (d->log_len + n + 1 > d->log_cap) {
		size_t cap = (d->log_len + n + 1) * 2;
		char *p = realloc(d->log, cap);

		if (!p)
			return;
		d->log = p;
		d->log_cap = cap;
	}
	memcpy(d->log + d->log_len, buf, n);
	d->log_len += n;
	d->log[d->log_len] = '\0';
}

/* Copy the daemon's output into its log until EOF, so its pipe never fills. */
static void *drain_main(void *arg)
{
	struct harness_daemon *d = arg;
	char want[sizeof(READY_PREFIX) + sizeof(d->socket) + 1];
	char buf[4096];
	ssize_t n;

	snprintf(want, sizeof(want), READY_PREFIX "%s\n", d->socket);
	for (;;) {
		n = read(d->out_fd, buf, sizeof(buf));
		if (n < 0 && errno == EINTR)
			continue;
		pthread_mutex_lock(&d->lock);
		if (n <= 0) {
			d->eof = 1;
			pthread_cond_broadcast(&d->cond);
			pthread_mutex_unlock(&d->lock);
			return NULL;
		}
		log_append(d, buf, (size_t)n);
		if (!d->ready && d->log && strstr(d->log, want))
			d->ready = 1;
		pthread_cond_broadcast(&d->cond);
		pthread_mutex_unlock(&d->lock);
	}
}

void harness_daemon_dump_log(struct harness_daemon *d)
{
	if (!d->started)
		return;
	pthread_mutex_lock(&d->lock);
	fprintf(stderr, "---- shardd (pid %d) log ----\n%s---- end of shardd log ----\n",
		(int)d->pid, d->log ? d->log : "");
	pthread_mutex_unlock(&d->lock);
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)ftw;
	if (flag == FTW_DP)
		return rmdir(path);
	return unlink(path);
}

int harness_daemon_start(struct harness_daemon *d, const char *const *extra)
{
	const char *bin = getenv("SHARDD_BIN");
	const char *argv[32];
	struct timespec until;
	int argc = 0, out[2], ret = 0;
	pid_t parent;

	if (d->started) {
		harness_daemon_stop_sig(d, SIGKILL, HARNESS_STOP_TIMEOUT_MS);
		free(d->log);
		pthread_cond_destroy(&d->cond);
		pthread_mutex_destroy(&d->lock);
	}
	memset(d, 0, sizeof(*d));
	d->started = 1;
	d->pid = -1;
	d->out_fd = -1;
	pthread_mutex_init(&d->lock, NULL);
	{
		pthread_condattr_t ca;

		pthread_condattr_init(&ca);
		pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
		pthread_cond_init(&d->cond, &ca);
		pthread_condattr_destroy(&ca);
	}
	if (!bin || bin[0] != '/') {
		fprintf(stderr,
			"harness: SHARDD_BIN must be the daemon's absolute path (got '%s'); "
			"run the suite through 'make test'\n",
			bin ? bin : "");
		return -ENOENT;
	}
	snprintf(d->dir, sizeof(d->dir), "/tmp/shardd-test-XXXXXX");
	if (!mkdtemp(d->dir)) {
		ret = -errno;
		fprintf(stderr, "harness: mkdtemp: %s\n", strerror(errno));
		d->dir[0] = '\0';
		return ret;
	}
	snprintf(d->socket, sizeof(d->socket), "%s/shardd.sock", d->dir);
	argv[argc++] = bin;
	argv[argc++] = "--socket";
	argv[argc++] = d->socket;
	argv[argc++] = "--foreground";
	argv[argc++] = "--log-level";
	argv[argc++] = "warn";
	argv[argc++] = "--rank-exec-max";
	argv[argc++] = harness_rank_exec_max();
	for (int i = 0; extra && extra[i] && argc < 29; i++)
		argv[argc++] = extra[i];
	argv[argc] = NULL;

	if (pipe2(out, O_CLOEXEC) < 0) {
		ret = -errno;
		harness_daemon_stop_sig(d, SIGKILL, 0);
		return ret;
	}
	fflush(stdout);
	fflush(stderr);
	parent = getpid();
	d->pid = fork();
	if (d->pid < 0) {
		ret = -errno;
		close(out[0]);
		close(out[1]);
		harness_daemon_stop_sig(d, SIGKILL, 0);
		return ret;
	}
	if (d->pid == 0) {
		die_with_parent(parent);
		dup2(out[1], STDOUT_FILENO);
		dup2(out[1], STDERR_FILENO);
		/* Clients are other processes: a SIGPIPE-ignoring test must not change the daemon. */
		signal(SIGPIPE, SIG_DFL);
		execv(bin, (char *const *)argv);
		fprintf(stderr, "harness: exec %s: %s\n", bin, strerror(errno));
		_exit(127);
	}
	close(out[1]);
	d->out_fd = out[0];
	if (pthread_create(&d->drain, NULL, drain_main, d) != 0) {
		fprintf(stderr, "harness: cannot start the log drain thread\n");
		harness_daemon_stop_sig(d, SIGKILL, 1000);
		return -EAGAIN;
	}
	d->drain_live = 1;

	until = abs_deadline(HARNESS_START_TIMEOUT_MS);
	pthread_mutex_lock(&d->lock);
	while (!d->ready && !d->eof && ret == 0)
		ret = pthread_cond_timedwait(&d->cond, &d->lock, &until);
	ret = d->ready ? 0 : d->eof ? -EPIPE : -ETIMEDOUT;
	pthread_mutex_unlock(&d->lock);
	if (ret < 0) {
		fprintf(stderr, "harness: %s did not print '" READY_PREFIX "%s' (%s)\n", bin,
			d->socket, ret == -EPIPE ? "it exited" : "timed out");
		harness_daemon_dump_log(d);
		harness_daemon_stop_sig(d, SIGKILL, 1000);
	}
	return ret;
}

const char *harness_daemon_sanitizer_report(struct harness_daemon *d)
{
	static const char *const marks[] = {
		"ERROR: AddressSanitizer",
		"ERROR: LeakSanitizer",
		"runtime error:",
		NULL,
	};
	const char *hit = NULL;

	if (!d->started)
		return NULL;
	pthread_mutex_lock(&d->lock);
	for (int i = 0; d->log && marks[i] && !hit; i++)
		if (strstr(d->log, marks[i]))
			hit = marks[i];
	pthread_mutex_unlock(&d->lock);
	return hit;
}

static int exited_zero(int status)
{
	return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* harness_daemon_stop_sig; with expect_clean also cr_expect exit status 0. */
static int daemon_stop(struct harness_daemon *d, int sig, int timeout_ms, int expect_clean)
{
	pid_t pid = d->pid;
	int status = 0, ret = 0, dumped = 0;
	const char *report;

	if (!d->started)
		return 0;
	if (d->pid > 0) {
		kill(d->pid, sig);
		ret = harness_wait_or_kill(d->pid, timeout_ms, &status);
		d->pid = -1;
		if (ret == 0)
			ret = status;
	}
	if (d->drain_live) {
		/* The daemon is gone, so its output ends: the drain sees EOF. */
		pthread_join(d->drain, NULL);
		d->drain_live = 0;
	}
	if (d->out_fd >= 0) {
		close(d->out_fd);
		d->out_fd = -1;
	}
	if (d->dir[0]) {
		nftw(d->dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
		d->dir[0] = '\0';
	}
	if (expect_clean && !exited_zero(ret)) {
		harness_daemon_dump_log(d);
		dumped = 1;
		cr_expect_fail("shardd (pid %d) did not exit cleanly on signal %d: %s", (int)pid,
			       sig, ret < 0 ? strerror(-ret) : harness_status_str(ret));
	}
	/*
	 * Under SANITIZE=1 the daemon reports memory errors and leaks on its
	 * stderr, which only the harness sees: every suite that stops a daemon
	 * fails on such a report.
	 */
	report = harness_daemon_sanitizer_report(d);
	if (report) {
		if (!dumped)
			harness_daemon_dump_log(d);
		cr_assert_fail(
			"shardd (pid %d) reported a sanitizer error ('%s'): its log is above",
			(int)pid, report);
	}
	free(d->log);
	d->log = NULL;
	d->log_len = d->log_cap = 0;
	return ret;
}

int harness_daemon_stop_sig(struct harness_daemon *d, int sig, int timeout_ms)
{
	return daemon_stop(d, sig, timeout_ms, 0);
}

int harness_daemon_stop(struct harness_daemon *d)
{
	return daemon_stop(d, SIGTERM, HARNESS_STOP_TIMEOUT_MS, 0);
}

void harness_daemon_stop_expect_clean(struct harness_daemon *d)
{
	daemon_stop(d, SIGTERM, HARNESS_STOP_TIMEOUT_MS, 1);
}

void harness_daemon_start_or_fail(struct harness_daemon *d, const char *const *extra)
{
	signal(SIGPIPE, SIG_IGN);
	cr_assert_eq(harness_daemon_start(d, extra), 0, "shardd did not start");
}

int harness_log_contains(struct harness_daemon *d, const char *needle)
{
	int found;

	pthread_mutex_lock(&d->lock);
	found = d->log && strstr(d->log, needle) != NULL;
	pthread_mutex_unlock(&d->lock);
	return found;
}

void harness_wait_log(struct harness_daemon *d, const char *needle, int timeout_ms)
{
	struct timespec until = abs_deadline(timeout_ms);
	int found;

	pthread_mutex_lock(&d->lock);
	while (!(found = d->log && strstr(d->log, needle) != NULL) && !d->eof &&
	       pthread_cond_timedwait(&d->cond, &d->lock, &until) == 0)
		;
	found = d->log && strstr(d->log, needle) != NULL;
	pthread_mutex_unlock(&d->lock);
	if (!found)
		harness_daemon_dump_log(d);
	cr_assert(found, "the daemon did not log '%s'", needle);
}

int harness_daemon_fds(const struct harness_daemon *dm, int nth_free, int *free_no)
{
	char path[64], present[65536] = { 0 };
	struct dirent *e;
	DIR *d;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)dm->pid);
	d = opendir(path);
	cr_assert_not_null(d, "%s: %s", path, strerror(errno));
	while ((e = readdir(d))) {
		long no;

		if (e->d_name[0] == '.')
			continue;
		n++;
		no = strtol(e->d_name, NULL, 10);
		if (no >= 0 && no < (long)sizeof(present))
			present[no] = 1;
	}
	closedir(d);
	if (free_no) {
		*free_no = -1;
		for (int i = 0; i < (int)sizeof(present); i++)
			if (!present[i] && nth_free-- == 0) {
				*free_no = i;
				break;
			}
		cr_assert_geq(*free_no, 0, "no free descriptor number found in %s", path);
	}
	return n;
}

int harness_attach(const struct harness_daemon *d, const char *job, uint32_t rank,
		   uint32_t replicate, uint32_t shard, struct shardd_client **out)
{
	struct shardd_attach_opts o = {
		.socket_path = d->socket,
		.job = job,
		.rank = rank,
		.replicate = replicate,
		.shard = shard,
		.device = SHARDD_HELLO_DEVICE_HOST,
		.timeout_ms = 10000,
	};
	int ret = shardd_connect(&o, out);

	if (ret < 0)
		fprintf(stderr, "harness: pid %d: %s\n", (int)getpid(), shardd_last_error());
	return ret;
}

/* ------------------------------------------------------------------ */
/* Raw control connections                                             */
/* ------------------------------------------------------------------ */

int harness_raw_connect(const char *socket_path)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -errno;
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket_path);
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
		int ret = -errno;

		close(fd);
		return ret;
	}
	return fd;
}

ssize_t harness_send_fds(int sock, const void *buf, size_t len, const int *fds, int nfds)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * 16)];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = { (void *)buf, len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	struct cmsghdr *c;

	if (nfds <= SHARDD_CTRL_MAX_FDS)
		return shardd_ctrl_send_dgram(sock, &iov, 1, fds, nfds, 0);
	/* Past the protocol's limit: shardd_ctrl_send_dgram would refuse it. */
	if (nfds > 16) {
		errno = EINVAL;
		return -EINVAL;
	}
	memset(&ctl, 0, sizeof(ctl));
	mh.msg_control = ctl.buf;
	mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
	c = CMSG_FIRSTHDR(&mh);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
	memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
	return sendmsg(sock, &mh, MSG_NOSIGNAL) < 0 ? -errno : (ssize_t)len;
}

int harness_recv_error(int fd, int timeout_ms, uint16_t *type, int32_t *code, char *text,
		       size_t len)
{
	struct shardd_ctrl_rx rx = { 0 };
	struct shardd_error_msg em;
	int ret = shardd_ctrl_recv(fd, &rx, timeout_ms);

	if (ret < 0)
		return ret;
	*type = rx.hdr.type;
	if (rx.hdr.type != SHARDD_MSG_ERROR) {
		shardd_ctrl_rx_reset(&rx);
		return -ENOMSG;
	}
	ret = -EBADMSG;
	if (rx.hdr.length >= sizeof(em)) {
		memcpy(&em, rx.payload, sizeof(em));
		if (em.msg_len == rx.hdr.length - sizeof(em)) {
			size_t n = em.msg_len < len - 1 ? em.msg_len : len - 1;

			*code = em.code;
			memcpy(text, rx.payload + sizeof(em), n);
			text[n] = '\0';
			ret = 0;
		}
	}
	shardd_ctrl_rx_reset(&rx);
	return ret;
}

int harness_expect_eof(int fd, int timeout_ms)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	char buf[64];
	int r = poll(&p, 1, timeout_ms);

	if (r < 0)
		return -errno;
	if (r == 0)
		return -ETIMEDOUT;
	r = (int)recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
	if (r == 0 || (r < 0 && errno == ECONNRESET))
		return 0;
	return -EPROTO;
}

void harness_run_children(int (*fn)(void *), void *args, size_t stride, uint32_t n, int timeout_ms,
			  struct harness_daemon *d)
{
	pid_t *pids = calloc(n, sizeof(*pids));

	cr_assert_not_null(pids);
	for (uint32_t i = 0; i < n; i++) {
		pids[i] = harness_fork(fn, (char *)args + i * stride);
		cr_assert_gt(pids[i], 0, "fork child %u: %s", i, strerror(-pids[i]));
	}
	for (uint32_t i = 0; i < n; i++) {
		int status = 0, ret = harness_wait_or_kill(pids[i], timeout_ms, &status);

		if ((ret < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) && d)
			harness_daemon_dump_log(d);
		cr_assert_eq(ret, 0, "child %u did not finish: %s", i, strerror(-ret));
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child %u %s", i,
			  harness_status_str(status));
	}
	free(pids);
}

#ifdef SHARDD_HAVE_CUDA
/* Exit status: the number of GPUs visible (0 when CUDA fails). */
static int cuda_count_main(void *arg)
{
	int n = 0;

	(void)arg;
	if (cudaGetDeviceCount(&n) != cudaSuccess)
		n = 0;
	return n > 64 ? 64 : n;
}

int harness_cuda_devices(void)
{
	int status = 0;
	pid_t pid = harness_fork(cuda_count_main, NULL);

	if (pid < 0 || harness_wait_or_kill(pid, 60000, &status) < 0 || !WIFEXITED(status))
		return 0;
	return WEXITSTATUS(status);
}
#endif

void harness_rm_tree(const char *path)
{
	nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int harness_shardctl(const char *socket, const char *const *args, int timeout_ms, char *out,
		     size_t len)
{
	const char *argv[32], *build = getenv("SHARDD_BUILD");
	static char path[4096];
	int n = 0, status, ret;

	cr_assert(build, "SHARDD_BUILD is not set: run through make test");
	snprintf(path, sizeof(path), "%s/shardctl", build);
	argv[n++] = path;
	argv[n++] = "--socket";
	argv[n++] = socket;
	for (; *args; args++) {
		cr_assert_lt(n, 31, "shardctl with more than 28 arguments");
		argv[n++] = *args;
	}
	argv[n] = NULL;
	ret = harness_run(argv, timeout_ms, &status, out, len);
	cr_assert_eq(ret, 0, "running %s: %s", path, strerror(-ret));
	cr_assert(WIFEXITED(status), "shardctl %s: %s", argv[3] ? argv[3] : "",
		  harness_status_str(status));
	return WEXITSTATUS(status);
}

struct json_t *harness_shardctl_json(const char *socket, const char *const *args, int timeout_ms,
				     char *out, size_t len)
{
	const char *argv[32] = { "--json" };
	json_error_t err;
	json_t *j;
	int n = 1, rc;

	for (; *args; args++) {
		cr_assert_lt(n, 28, "shardctl --json with more than 27 arguments");
		argv[n++] = *args;
	}
	argv[n] = NULL;
	rc = harness_shardctl(socket, argv, timeout_ms, out, len);
	cr_assert_eq(rc, 0, "shardctl --json %s exited with %d:\n%s", argv[1] ? argv[1] : "", rc,
		     out);
	j = json_loads(out, 0, &err);
	cr_assert_not_null(j, "shardctl --json %s: output does not parse (%s):\n%s",
			   argv[1] ? argv[1] : "", err.text, out);
	return j;
}

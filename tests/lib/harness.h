/* SPDX-License-Identifier: MIT */
/*
 * Integration-test harness: a real shardd ($SHARDD_BIN) on a socket in a
 * temporary directory, client processes forked from the test, and bounded
 * waits on real events (the daemon's readiness line, pidfds, pipes). No
 * call here sleeps to synchronise; every wait has a deadline.
 *
 * Calls return 0 or a negative errno and print what went wrong to stderr
 * (with the daemon's log when the daemon is involved), so a test asserts
 * on the code and the reason is in its output.
 */
#ifndef SHARDD_TEST_HARNESS_H
#define SHARDD_TEST_HARNESS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

#include "shardd.h"

#define HARNESS_START_TIMEOUT_MS 10000
#define HARNESS_STOP_TIMEOUT_MS  10000

struct harness_daemon {
	int started; /* start ran: lock, cond and log are initialised */
	pid_t pid;
	char dir[64];    /* temporary directory, removed by stop */
	char socket[96]; /* dir/shardd.sock */
	int out_fd;      /* read end of the daemon's stdout and stderr */
	pthread_t drain; /* copies out_fd into log until EOF */
	int drain_live;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	char *log; /* everything the daemon printed, NUL-terminated */
	size_t log_len;
	size_t log_cap;
	int ready; /* the readiness line was seen */
	int eof;   /* the daemon closed its output */
};

/*
 * Start $SHARDD_BIN --socket DIR/shardd.sock --foreground --log-level warn,
 * then the NULL-terminated `extra` arguments (may be NULL), and wait up to
 * HARNESS_START_TIMEOUT_MS for its "shardd: ready on PATH" line. `d` is
 * zeroed (static, or `= { 0 }`) or holds a daemon started before, which is
 * stopped first: a stack struct left uninitialised reads as started.
 */
int harness_daemon_start(struct harness_daemon *d, const char *const *extra);

/*
 * Send `sig` to the daemon and wait up to timeout_ms for it to exit; on
 * timeout kill it with SIGKILL and return -ETIMEDOUT. Returns the wait
 * status (>= 0) otherwise. Then reads the rest of its output, fails the
 * calling Criterion test if it holds a sanitizer report (printing it),
 * frees it (dump the log before stopping) and removes the directory. Safe
 * to call on a daemon already stopped, or never started: 0.
 */
int harness_daemon_stop_sig(struct harness_daemon *d, int sig, int timeout_ms);

/* SIGTERM, HARNESS_STOP_TIMEOUT_MS. */
int harness_daemon_stop(struct harness_daemon *d);

/*
 * harness_daemon_stop, expecting (cr_expect) exit status 0 (or a daemon
 * the test already stopped); prints the daemon's log first when not.
 */
void harness_daemon_stop_expect_clean(struct harness_daemon *d);

/* The first sanitizer report marker in the daemon's log so far, or NULL. */
const char *harness_daemon_sanitizer_report(struct harness_daemon *d);

/* Print the daemon's log so far to stderr, under a banner. */
void harness_daemon_dump_log(struct harness_daemon *d);

/*
 * A suite's .init: ignore SIGPIPE (a connection the daemon closed must not
 * kill the test), then harness_daemon_start, asserting (Criterion) it started.
 */
void harness_daemon_start_or_fail(struct harness_daemon *d, const char *const *extra);

/*
 * The daemon's open descriptors (/proc/PID/fd): how many; with free_no,
 * also the `nth_free` (0-based) descriptor number it has free (asserted found).
 */
int harness_daemon_fds(const struct harness_daemon *d, int nth_free, int *free_no);

/* The daemon has logged `needle` so far. */
int harness_log_contains(struct harness_daemon *d, const char *needle);

/*
 * Wait up to timeout_ms for the daemon to have logged `needle` (a line
 * written before an event the test saw reaches the log through the drain
 * thread, which signals d->cond on every read); assert (Criterion) it did,
 * printing the log first when not.
 */
void harness_wait_log(struct harness_daemon *d, const char *needle, int timeout_ms);

/* Attach (job, rank) of a replicate x shard mesh to the daemon. */
int harness_attach(const struct harness_daemon *d, const char *job, uint32_t rank,
		   uint32_t replicate, uint32_t shard, struct shardd_client **out);

/*
 * Fork a child that runs fn(arg) and _exit()s with its return value (no
 * atexit handlers of the test framework run in it). Returns the pid or -errno.
 */
pid_t harness_fork(int (*fn)(void *), void *arg);

/*
 * Fork n children, child i running fn(args + i * stride), and wait up to
 * timeout_ms for each; assert (Criterion) that each exited 0, printing the
 * log of daemon `d` (may be NULL) first when one did not.
 */
void harness_run_children(int (*fn)(void *), void *args, size_t stride, uint32_t n, int timeout_ms,
			  struct harness_daemon *d);

/*
 * Wait up to timeout_ms for `pid` (a child) to exit, through a pidfd.
 * Returns 0 and *status, -ETIMEDOUT (the child is left running), -errno.
 */
int harness_wait_pid(pid_t pid, int timeout_ms, int *status);

/* harness_wait_pid, then SIGKILL and reap when it timed out. */
int harness_wait_or_kill(pid_t pid, int timeout_ms, int *status);

/* "exited with 3", "killed by signal 9": for assertion messages. */
const char *harness_status_str(int status);

/*
 * Run argv (argv[0] a path) with stdout and stderr into `out` (NUL-
 * terminated, truncated to len), waiting up to timeout_ms. Returns 0 and
 * the wait status in *status, or a negative errno.
 */
int harness_run(const char *const *argv, int timeout_ms, int *status, char *out, size_t len);

/* Read exactly len bytes from fd within timeout_ms: 0, -ETIMEDOUT, -EPIPE (EOF), -errno. */
int harness_read_full(int fd, void *buf, size_t len, int timeout_ms);

/* Write one byte: a go/ready signal between processes. 0 or -errno. */
int harness_signal(int fd, char byte);

/* Raw control connection (no handshake): fd or -errno. */
int harness_raw_connect(const char *socket_path);

/*
 * One datagram of `len` bytes (may be 0) carrying `nfds` fds (at most 16)
 * by SCM_RIGHTS: the bytes sent or -errno (errno set too). Up to
 * SHARDD_CTRL_MAX_FDS fds it is proto's shardd_ctrl_send_dgram; more is a
 * message the protocol forbids, which that helper refuses to send, so the
 * control data is built here for the tests that must send it.
 */
ssize_t harness_send_fds(int sock, const void *buf, size_t len, const int *fds, int nfds);

/*
 * Receive one whole control message on a raw connection within timeout_ms.
 * For an ERROR, *code and text (NUL-terminated, truncated to len) are
 * filled and 0 is returned; another type gives -ENOMSG with *type set;
 * EOF gives -ECONNRESET.
 */
int harness_recv_error(int fd, int timeout_ms, uint16_t *type, int32_t *code, char *text,
		       size_t len);

/* Wait up to timeout_ms for the peer to close a raw connection: 0, -ETIMEDOUT, -EPROTO (data came). */
int harness_expect_eof(int fd, int timeout_ms);

/*
 * The --rank-exec-max every daemon a test starts gets before the test's own
 * flags (which win): exec=auto is the daemon's there, whatever shardd's
 * default, except when make test runs the numerics and recovery suites
 * again with their small groups rank-executed (SHARDD_TEST_RANK_EXEC_MAX).
 */
const char *harness_rank_exec_max(void);

/* Milliseconds on CLOCK_MONOTONIC. */
int64_t harness_now_ms(void);

/* Remove `path` and everything below it (a test's temporary directory); links are not followed. */
void harness_rm_tree(const char *path);

/*
 * Run $SHARDD_BUILD/shardctl --socket `socket` args... (args NULL-terminated)
 * with stdout and stderr into `out` (as harness_run), waiting up to
 * timeout_ms. Asserts that it ran and exited; returns its exit code.
 */
int harness_shardctl(const char *socket, const char *const *args, int timeout_ms, char *out,
		     size_t len);

struct json_t;
/*
 * harness_shardctl of `shardctl --socket socket --json args...`, asserting
 * exit code 0 and output that parses: the parsed reply (json_decref it).
 */
struct json_t *harness_shardctl_json(const char *socket, const char *const *args, int timeout_ms,
				     char *out, size_t len);

/*
 * In a forked child: report a failed check on stderr and return 1 from
 * the child's function (its exit status).
 */
#define CHILD_CHECK(cond, ...)                                                                \
	do {                                                                                  \
		if (!(cond)) {                                                                \
			fprintf(stderr, "child %d: %s:%d: check failed: %s: ", (int)getpid(), \
				__FILE__, __LINE__, #cond);                                   \
			fprintf(stderr, __VA_ARGS__);                                         \
			fputc('\n', stderr);                                                  \
			return 1;                                                             \
		}                                                                             \
	} while (0)

/* CHILD_CHECK of a libshardd call (>= 0), naming the call and shardd_last_error(). */
#define CHILD_CHECK_SHARDD(call)                                                   \
	do {                                                                       \
		int r_ = (call);                                                   \
		CHILD_CHECK(r_ >= 0, "%s: %d %s", #call, r_, shardd_last_error()); \
	} while (0)

#ifdef SHARDD_HAVE_CUDA
/* CHILD_CHECK of a CUDA runtime call, naming the call and its error (cuda_runtime_api.h). */
#define CHILD_CHECK_CUDA(call)                                                           \
	do {                                                                             \
		cudaError_t e_ = (call);                                                 \
		CHILD_CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
	} while (0)

/* cr_assert of a CUDA runtime call in the test process, naming the call. */
#define CUDA_OK(call) cr_assert_eq((call), cudaSuccess, "%s failed", #call)

/*
 * GPUs visible to CUDA, counted in a child process: a process that
 * initialises CUDA cannot hand it to the children it forks, so tests that
 * fork rank processes using CUDA must never touch it themselves. 0 when
 * CUDA fails.
 */
int harness_cuda_devices(void);
#endif

#endif /* SHARDD_TEST_HARNESS_H */

/* SPDX-License-Identifier: MIT */
/*
 * The in-process daemon of the fuzz targets (fuzz_harness.h): failing a check,
 * the process-wide checks (fds, heap, buffers) and the daemon's loop, driven
 * a turn at a time from the fuzzer's thread.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <linux/sockios.h>

#include <jansson.h>
#include <sanitizer/allocator_interface.h>

#include "clock.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "metrics.h"
#include "server.h"
#include "session.h"
#include "shardd_ctrl.h"
#include "shardd_proto.h"
#include "shardd_ring.h"

#include "fuzz_daemon.h"
#include "fuzz_harness.h"

/* ------------------------------------------------------------------ */
/* Failing a check                                                     */
/* ------------------------------------------------------------------ */

const char *target_name = "?";

void fail(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "\nshardd fuzz (%s): invariant violated: ", target_name);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
	abort();
}

struct fz_state st;

int trace;        /* SHARDD_FUZZ_TRACE: print replies and completions */
int stop_fd = -1; /* written before each loop turn: ends it */
char sock_dir[64];
uint8_t dgram[SHARDD_CTRL_CHUNK];

/* ------------------------------------------------------------------ */
/* Process-wide checks                                                 */
/* ------------------------------------------------------------------ */

int fd_count(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;

	if (!d)
		fail("cannot open /proc/self/fd: %s", strerror(errno));
	while ((e = readdir(d)))
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n - 1; /* the directory's own fd */
}

void fd_list(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;

	if (!d)
		return;
	while ((e = readdir(d))) {
		char path[300], target[256];
		ssize_t n;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
		n = readlink(path, target, sizeof(target) - 1);
		target[n > 0 ? n : 0] = '\0';
		fprintf(stderr, "  fd %s -> %s\n", e->d_name, target);
	}
	closedir(d);
}

uint64_t buf_bytes(void)
{
	struct shd_group_memory m;

	shd_jobs_memory_held(&m);
	return m.total;
}

void check_memory(void)
{
	size_t heap = __sanitizer_get_current_allocated_bytes();
	uint64_t bufs = buf_bytes();

	if (heap > st.heap0 && heap - st.heap0 > FUZZ_HEAP_CAP)
		fail("the heap grew by %zu bytes within one input (cap %zu)", heap - st.heap0,
		     FUZZ_HEAP_CAP);
	if (bufs > FUZZ_MAX_MEMORY)
		fail("the daemon holds %" PRIu64
		     " bytes of buffers, past its --max-memory of %" PRIu64,
		     bufs, FUZZ_MAX_MEMORY);
}

/* ------------------------------------------------------------------ */
/* The daemon's loop                                                   */
/* ------------------------------------------------------------------ */

static void stop_readable(void *arg, int fd, uint32_t revents)
{
	uint64_t v;

	(void)arg;
	(void)revents;
	if (read(fd, &v, sizeof(v)) != sizeof(v))
		fail("reading the stop eventfd: %s", strerror(errno));
	shd_loop_stop(server.loop);
}

/*
 * One turn of the daemon's own loop: its before-sleep hook (backlogs, rings,
 * closes, reaps), then every event that is ready, the stop eventfd's among
 * them; the loop returns after dispatching that batch.
 */
void daemon_turn(void)
{
	uint64_t one = 1;

	if (write(stop_fd, &one, sizeof(one)) != sizeof(one))
		fail("writing the stop eventfd: %s", strerror(errno));
	if (shd_loop_run(server.loop) < 0)
		fail("the daemon's loop failed");
}

/* The daemon is never shut down (the process just exits): remove its socket and directory. */
static void fuzz_cleanup(void)
{
	unlink(server.cfg.socket_path);
	rmdir(sock_dir);
}

int fuzz_init(void)
{
	struct shd_config cfg;
	const char *lvl = getenv("SHARDD_FUZZ_LOG");
	sigset_t set;

	snprintf(sock_dir, sizeof(sock_dir), "/tmp/shardd-fuzz-XXXXXX");
	if (!mkdtemp(sock_dir)) {
		perror("shardd fuzz: mkdtemp");
		exit(1);
	}
	shd_config_defaults(&cfg);
	snprintf(cfg.socket_path, sizeof(cfg.socket_path), "%s/shardd.sock", sock_dir);
	cfg.workers = 1;
	cfg.max_memory = FUZZ_MAX_MEMORY;
	cfg.max_job_memory = FUZZ_MAX_JOB_MEMORY;
	trace = getenv("SHARDD_FUZZ_TRACE") != NULL;
	/* Silent unless asked: a line per refused input would slow the fuzzer down. */
	cfg.log_level = lvl ? shd_log_level_parse(lvl) : -1;
	if (shd_server_init(&cfg) < 0) {
		fprintf(stderr, "shardd fuzz: the daemon did not start\n");
		exit(1);
	}
	/* The daemon blocked them for its signalfd; libFuzzer handles them itself. */
	sigemptyset(&set);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigprocmask(SIG_UNBLOCK, &set, NULL);
	stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (stop_fd < 0 ||
	    shd_loop_add_fd(server.loop, stop_fd, POLLIN, stop_readable, NULL, NULL) < 0) {
		fprintf(stderr, "shardd fuzz: cannot register the stop eventfd\n");
		exit(1);
	}
	atexit(fuzz_cleanup);
	daemon_turn();
	return 0;
}

/* SPDX-License-Identifier: MIT */
/*
 * The Open MPI comparator: runs `mpirun -np N shardbench_mpi <op> <sweep>`
 * as a child, with the same process count and sizes as the shardd sweep,
 * and parses its "<size(B)> <time(us)> <#wrong>" lines (format in
 * tools/shardbench/mpi/shardbench_mpi.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

#define MPI_RUN_TIMEOUT_MS (300 * 1000)

/* 1 when `name` is an executable in $PATH. */
static int in_path(const char *name)
{
	const char *path = getenv("PATH");
	char buf[4096];

	while (path && *path) {
		const char *colon = strchr(path, ':');
		size_t len = colon ? (size_t)(colon - path) : strlen(path);

		if (len && len < sizeof(buf) - strlen(name) - 2) {
			snprintf(buf, sizeof(buf), "%.*s/%s", (int)len, path, name);
			if (access(buf, X_OK) == 0)
				return 1;
		}
		path = colon ? colon + 1 : NULL;
	}
	return 0;
}

static int add_row(struct bench_mpi_table *t, const struct bench_mpi_row *row)
{
	struct bench_mpi_row *v = realloc(t->rows, (t->nrows + 1) * sizeof(*v));

	if (!v)
		return -ENOMEM;
	t->rows = v;
	t->rows[t->nrows++] = *row;
	return 0;
}

/* One line of the comparator's output: a row, its datatype, or noise to quote on failure. */
static void parse_line(struct bench_mpi_table *t, char *line, char *noise, size_t noiselen)
{
	struct bench_mpi_row row;
	unsigned long long bytes, wrong;
	const char *dt;

	if (line[0] == '#') {
		dt = strstr(line, "MPI datatype ");
		if (dt)
			snprintf(t->dtype, sizeof(t->dtype), "%.7s", dt + strlen("MPI datatype "));
		return;
	}
	if (sscanf(line, "%llu %lf %llu", &bytes, &row.time_us, &wrong) == 3) {
		row.bytes = bytes;
		row.wrong = wrong;
		if (add_row(t, &row) == 0)
			return;
	}
	if (line[0])
		snprintf(noise, noiselen, "%.199s", line);
}

void bench_mpi_run(const struct bench_opts *o, const char *op, struct bench_mpi_table *t)
{
	char path[512], b[32], e[32], f[32], w[16], n[16], c[8], np[16];
	char buf[8192], noise[200] = "";
	size_t used = 0;
	uint64_t deadline;
	int fds[2], status, timed_out = 0;
	pid_t pid;

	memset(t, 0, sizeof(*t));
	if (o->mpi_path)
		snprintf(path, sizeof(path), "%s", o->mpi_path);
	else
		snprintf(path, sizeof(path), "%s/shardbench_mpi", o->self_dir);
	if (access(path, X_OK) != 0) {
		snprintf(t->why, sizeof(t->why),
			 "%.160s: %s; install Open MPI (tools/setup/deps.sh) "
			 "and rebuild",
			 path, strerror(errno));
		return;
	}
	if (!in_path("mpirun")) {
		snprintf(t->why, sizeof(t->why), "mpirun not in PATH; install openmpi-bin");
		return;
	}
	snprintf(b, sizeof(b), "%llu", (unsigned long long)o->min_bytes);
	snprintf(e, sizeof(e), "%llu", (unsigned long long)o->max_bytes);
	snprintf(f, sizeof(f), "%llu", (unsigned long long)o->factor);
	snprintf(w, sizeof(w), "%d", o->warmup);
	snprintf(n, sizeof(n), "%d", o->iters);
	snprintf(c, sizeof(c), "%d", o->check);
	snprintf(np, sizeof(np), "%u", o->ranks);
	if (pipe2(fds, O_CLOEXEC)) {
		snprintf(t->why, sizeof(t->why), "pipe: %s", strerror(errno));
		return;
	}
	fflush(NULL);
	pid = fork();
	if (pid < 0) {
		snprintf(t->why, sizeof(t->why), "fork: %s", strerror(errno));
		close(fds[0]);
		close(fds[1]);
		return;
	}
	if (pid == 0) {
		int devnull = open("/dev/null", O_RDONLY);

		if (devnull >= 0)
			dup2(devnull, STDIN_FILENO);
		dup2(fds[1], STDOUT_FILENO);
		dup2(fds[1], STDERR_FILENO);
		execlp("mpirun", "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", np,
		       path, op, "-b", b, "-e", e, "-f", f, "-w", w, "-n", n, "-c", c, "-d",
		       shardd_dtype_name(o->dtype), (char *)NULL);
		fprintf(stderr, "exec mpirun: %s\n", strerror(errno));
		_exit(127);
	}
	close(fds[1]);

	deadline = bench_now_ns() + MPI_RUN_TIMEOUT_MS * 1000000ull;
	for (;;) {
		struct pollfd pfd = { .fd = fds[0], .events = POLLIN };
		uint64_t now = bench_now_ns();
		char *nl, *line;
		ssize_t got;
		int rc;

		if (now >= deadline) {
			timed_out = 1;
			break;
		}
		rc = poll(&pfd, 1, (int)((deadline - now) / 1000000ull) + 1);
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc <= 0)
			continue;
		got = read(fds[0], buf + used, sizeof(buf) - 1 - used);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			break;
		used += (size_t)got;
		buf[used] = '\0';
		line = buf;
		while ((nl = strchr(line, '\n'))) {
			*nl = '\0';
			parse_line(t, line, noise, sizeof(noise));
			line = nl + 1;
		}
		used -= (size_t)(line - buf);
		memmove(buf, line, used);
		/* A line longer than the buffer is noise: drop it rather than stall. */
		if (used == sizeof(buf) - 1)
			used = 0;
	}
	close(fds[0]);
	if (timed_out)
		kill(pid, SIGKILL);
	status = bench_reap_pid(pid, 30000);
	if (timed_out)
		snprintf(t->why, sizeof(t->why), "mpirun took more than %d s; killed",
			 MPI_RUN_TIMEOUT_MS / 1000);
	else if (status < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		snprintf(t->why, sizeof(t->why),
			 "mpirun -np %u %.80s %s failed (status 0x%x): %.100s", o->ranks, path, op,
			 (unsigned)status, noise[0] ? noise : "no output");
	else if (t->nrows == 0)
		snprintf(t->why, sizeof(t->why), "mpirun printed no rows: %.200s", noise);
	t->available = t->why[0] == '\0';
	if (!t->available) {
		free(t->rows);
		t->rows = NULL;
		t->nrows = 0;
	}
}

const struct bench_mpi_row *bench_mpi_find(const struct bench_mpi_table *t, uint64_t bytes)
{
	size_t i;

	for (i = 0; t->available && i < t->nrows; i++)
		if (t->rows[i].bytes == bytes)
			return &t->rows[i];
	return NULL;
}

void bench_mpi_free(struct bench_mpi_table *t)
{
	free(t->rows);
	t->rows = NULL;
	t->nrows = 0;
}

/* SPDX-License-Identifier: MIT */
/*
 * What every benchmark measures with: percentiles, sizes as people write
 * them, and bounded waits for the processes shardbench starts.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

void bench_sort_u64(uint64_t *v, size_t n)
{
	qsort(v, n, sizeof(*v), cmp_u64);
}

uint64_t bench_percentile(const uint64_t *sorted, size_t n, double p)
{
	size_t rank;

	if (n == 0)
		return 0;
	/* Nearest rank: the smallest value with at least p % of samples at or below it. */
	rank = (size_t)((p / 100.0) * (double)n + 0.999999);
	if (rank < 1)
		rank = 1;
	if (rank > n)
		rank = n;
	return sorted[rank - 1];
}

int bench_parse_size(const char *s, uint64_t *out)
{
	char *end;
	unsigned long long v;
	uint64_t mult = 1;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -EINVAL;
	switch (*end) {
	case '\0':
		break;
	case 'k':
	case 'K':
		mult = 1024ull;
		end++;
		break;
	case 'm':
	case 'M':
		mult = BENCH_MIB;
		end++;
		break;
	case 'g':
	case 'G':
		mult = BENCH_GIB;
		end++;
		break;
	default:
		return -EINVAL;
	}
	if (*end == 'i' || *end == 'B')
		end += (*end == 'i' && end[1] == 'B') ? 2 : 1;
	if (*end != '\0' || v == 0 || v > UINT64_MAX / mult)
		return -EINVAL;
	*out = v * mult;
	return 0;
}

void bench_format_size(uint64_t bytes, char *buf, size_t len)
{
	if (bytes >= BENCH_GIB && bytes % BENCH_GIB == 0)
		snprintf(buf, len, "%llu GiB", (unsigned long long)(bytes / BENCH_GIB));
	else if (bytes >= BENCH_MIB && bytes % BENCH_MIB == 0)
		snprintf(buf, len, "%llu MiB", (unsigned long long)(bytes / BENCH_MIB));
	else if (bytes >= 1024 && bytes % 1024 == 0)
		snprintf(buf, len, "%llu KiB", (unsigned long long)(bytes / 1024));
	else
		snprintf(buf, len, "%llu B", (unsigned long long)bytes);
}

int bench_wait_pid(pid_t pid, int timeout_ms)
{
	int status, pidfd, rc;
	struct pollfd pfd;

	/* A pidfd turns "wait with a deadline" into one poll, with no sleep loop. */
	pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (pidfd < 0)
		return -errno;
	pfd.fd = pidfd;
	pfd.events = POLLIN;
	do
		rc = poll(&pfd, 1, timeout_ms);
	while (rc < 0 && errno == EINTR);
	close(pidfd);
	if (rc == 0)
		return -ETIMEDOUT;
	do
		rc = waitpid(pid, &status, 0);
	while (rc < 0 && errno == EINTR);
	if (rc < 0)
		return -errno;
	return status;
}

int bench_reap_pid(pid_t pid, int timeout_ms)
{
	int status = bench_wait_pid(pid, timeout_ms);

	if (status == -ETIMEDOUT) {
		kill(pid, SIGKILL);
		status = bench_wait_pid(pid, timeout_ms);
	}
	return status;
}

/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

int shd_log_threshold = SHD_LOG_INFO;

static const char *const level_names[] = { "error", "warn", "info", "debug" };
/* syslog(3) priorities of the levels: LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG. */
static const int level_priorities[] = { 3, 4, 6, 7 };

static pthread_once_t journal_once = PTHREAD_ONCE_INIT;
static int journal_stderr; /* stderr is connected to the journal */

/*
 * systemd sets JOURNAL_STREAM to "DEV:INODE" of the stream it connects to
 * stderr; stderr is the journal only when that still names our fd 2 (a
 * child of the service may have redirected it). See systemd.exec(5).
 */
static void journal_detect(void)
{
	const char *env = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	struct stat st;
	char tail;

	if (!env || sscanf(env, "%llu:%llu%c", &dev, &ino, &tail) != 2 ||
	    fstat(STDERR_FILENO, &st) < 0)
		return;
	journal_stderr =
		(unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

int shd_log_to_journal(void)
{
	pthread_once(&journal_once, journal_detect);
	return journal_stderr;
}

int shd_log_level_parse(const char *name)
{
	for (int i = 0; i < (int)(sizeof(level_names) / sizeof(level_names[0])); i++)
		if (strcmp(name, level_names[i]) == 0)
			return i;
	return -EINVAL;
}

const char *shd_log_level_name(int level)
{
	if (level < 0 || level > SHD_LOG_DEBUG)
		return "?";
	return level_names[level];
}

void shd_vlog(int level, const char *fmt, va_list ap)
{
	char line[1024];
	struct timeval tv;
	struct tm tm;
	size_t off;
	int n;

	if (level > shd_log_threshold)
		return;
	if (shd_log_to_journal()) {
		/* The journal stamps time and pid; "<N>" sets the line's priority (sd-daemon(3)). */
		off = (size_t)snprintf(line, sizeof(line), "<%d>",
				       level_priorities[level < 0               ? 0
							: level > SHD_LOG_DEBUG ? SHD_LOG_DEBUG
										: level]);
	} else {
		gettimeofday(&tv, NULL);
		localtime_r(&tv.tv_sec, &tm);
		off = strftime(line, sizeof(line), "%Y-%m-%d %H:%M:%S", &tm);
		n = snprintf(line + off, sizeof(line) - off,
			     ".%03ld shardd[%d] %s: ", (long)(tv.tv_usec / 1000), (int)getpid(),
			     shd_log_level_name(level));
		if (n > 0)
			off += (size_t)n;
	}
	n = vsnprintf(line + off, sizeof(line) - off, fmt, ap);
	if (n > 0)
		off += (size_t)n;
	if (off > sizeof(line) - 2)
		off = sizeof(line) - 2;
	line[off++] = '\n';
	/* One write per line so lines from worker threads never interleave. */
	if (write(STDERR_FILENO, line, off) < 0)
		return;
}

void shd_log(int level, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	shd_vlog(level, fmt, ap);
	va_end(ap);
}

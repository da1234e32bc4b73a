/* SPDX-License-Identifier: MIT */
/*
 * Daemon log: one line per event on stderr, with a wall-clock timestamp, the
 * pid and the level. Safe from any thread (each line is one write()). When
 * stderr is systemd's journal (JOURNAL_STREAM names it), a line is instead
 * "<PRIORITY>message": the journal adds time and pid, and `journalctl -p
 * warning` filters on the syslog priority (error 3, warn 4, info 6, debug 7).
 */
#ifndef SHARDD_LOG_H
#define SHARDD_LOG_H

#include <stdarg.h>

enum shardd_log_level {
	SHARDD_LOG_ERROR = 0,
	SHARDD_LOG_WARN  = 1,
	SHARDD_LOG_INFO  = 2, /* default */
	SHARDD_LOG_DEBUG = 3,
};

/* Lines above this level are dropped; set once at start-up. */
extern int shardd_log_threshold;

/* "error", "warn", "info", "debug" -> level; -1 for anything else. */
int shardd_log_level_parse(const char *name);
const char *shardd_log_level_name(int level);
/* 1 when stderr is the journal (checked once, from JOURNAL_STREAM). */
int shardd_log_to_journal(void);

void shardd_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void shardd_vlog(int level, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

#define shardd_log_error(...) shardd_log(SHARDD_LOG_ERROR, __VA_ARGS__)
#define shardd_log_warn(...)  shardd_log(SHARDD_LOG_WARN, __VA_ARGS__)
#define shardd_log_info(...)  shardd_log(SHARDD_LOG_INFO, __VA_ARGS__)
#define shardd_log_debug(...) shardd_log(SHARDD_LOG_DEBUG, __VA_ARGS__)

#endif /* SHARDD_LOG_H */

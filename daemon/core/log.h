/* SPDX-License-Identifier: MIT */
/*
 * Daemon log: one line per event on stderr, with a wall-clock timestamp, the
 * pid and the level. Safe from any thread (each line is one write()). When
 * stderr is systemd's journal (JOURNAL_STREAM names it), a line is instead
 * "<PRIORITY>message": the journal adds time and pid, and `journalctl -p
 * warning` filters on the syslog priority (error 3, warn 4, info 6, debug 7).
 */
#ifndef SHD_LOG_H
#define SHD_LOG_H

#include <stdarg.h>

enum shd_log_level {
	SHD_LOG_ERROR = 0,
	SHD_LOG_WARN = 1,
	SHD_LOG_INFO = 2, /* default */
	SHD_LOG_DEBUG = 3,
};

/* Lines above this level are dropped; set once at start-up. */
extern int shd_log_threshold;

/* "error", "warn", "info", "debug" -> level; -EINVAL for anything else. */
int shd_log_level_parse(const char *name);
const char *shd_log_level_name(int level);
/* 1 when stderr is the journal (checked once, from JOURNAL_STREAM). */
int shd_log_to_journal(void);

void shd_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void shd_vlog(int level, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

#define shd_log_error(...) shd_log(SHD_LOG_ERROR, __VA_ARGS__)
#define shd_log_warn(...)  shd_log(SHD_LOG_WARN, __VA_ARGS__)
#define shd_log_info(...)  shd_log(SHD_LOG_INFO, __VA_ARGS__)
#define shd_log_debug(...) shd_log(SHD_LOG_DEBUG, __VA_ARGS__)

#endif /* SHD_LOG_H */

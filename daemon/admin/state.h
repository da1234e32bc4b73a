/* SPDX-License-Identifier: MIT */
/*
 * The daemon's state as its reports read it (admin requests, the Prometheus
 * exposition): read-only accessors over what the server lends them at
 * start (struct shd_state_source). The server calls the reports, so a
 * report reads the daemon through here and never includes server.h.
 *
 * Loop thread only, like everything they read.
 */
#ifndef SHD_STATE_H
#define SHD_STATE_H

#include <stdint.h>
#include <sys/types.h>

#include "config.h"

struct shd_engine;
struct shd_job;
struct shd_session;

/*
 * What the server lends the reports, given once by shd_server_init
 * (server.c) before the first request. The pointers are the server's own
 * fields, read at each call, so the reports see what is current.
 */
struct shd_state_source {
	const struct shd_config *cfg;
	pid_t pid;
	uid_t uid;
	uint64_t start_ns; /* CLOCK_MONOTONIC at the daemon's start */
	uint64_t collective_timeout_ns;
	struct shd_engine *const *engine;
	struct shd_job *const *jobs;         /* head of the daemon's list of jobs */
	struct shd_session *const *sessions; /* head of the daemon's list of sessions */
};

void shd_state_init(const struct shd_state_source *src);

/* The flags the daemon runs with (--max-memory's default filled in). */
const struct shd_config *shd_state_config(void);
/* Who the daemon runs as: its pid, and the uid its admin clients must have. */
pid_t shd_state_pid(void);
uid_t shd_state_uid(void);
/* Seconds since the daemon started, at now_ns (CLOCK_MONOTONIC). */
double shd_state_uptime_s(uint64_t now_ns);
/* --collective-timeout in ns. */
uint64_t shd_state_collective_timeout_ns(void);
/* The op engine (groups, memory committed, the backend). */
struct shd_engine *shd_state_engine(void);
/* The first job of the daemon's list (j->next walks the rest), or NULL. */
struct shd_job *shd_state_jobs(void);
/* Open control connections (ranks and admin clients), dead ones not counted. */
uint32_t shd_state_connections(void);

#endif /* SHD_STATE_H */

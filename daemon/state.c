/* SPDX-License-Identifier: MIT */
/* The daemon's state for its reports (state.h). */
#include "server.h"
#include "session.h"
#include "state.h"

const struct shd_config *shd_state_config(void)
{
	return &server.cfg;
}

pid_t shd_state_pid(void)
{
	return server.pid;
}

uid_t shd_state_uid(void)
{
	return server.uid;
}

double shd_state_uptime_s(uint64_t now_ns)
{
	return (double)(now_ns - server.start_ns) / 1e9;
}

uint64_t shd_state_collective_timeout_ns(void)
{
	return server.collective_timeout_ns;
}

struct shd_engine *shd_state_engine(void)
{
	return server.engine;
}

struct shd_job *shd_state_jobs(void)
{
	return server.jobs;
}

uint32_t shd_state_connections(void)
{
	uint32_t n = 0;

	for (const struct shd_session *s = server.sessions; s; s = s->next)
		n += s->state != SHD_SESSION_DEAD;
	return n;
}

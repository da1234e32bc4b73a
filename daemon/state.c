/* SPDX-License-Identifier: MIT */
/* The daemon's state for its reports (state.h). */
#include "server.h"
#include "session.h"
#include "state.h"

const struct shardd_config *shardd_state_config(void)
{
	return &server.cfg;
}

pid_t shardd_state_pid(void)
{
	return server.pid;
}

uid_t shardd_state_uid(void)
{
	return server.uid;
}

double shardd_state_uptime_s(uint64_t now_ns)
{
	return (double)(now_ns - server.start_ns) / 1e9;
}

uint64_t shardd_state_collective_timeout_ns(void)
{
	return server.collective_timeout_ns;
}

struct shardd_engine *shardd_state_engine(void)
{
	return server.engine;
}

struct shardd_job *shardd_state_jobs(void)
{
	return server.jobs;
}

uint32_t shardd_state_connections(void)
{
	uint32_t n = 0;

	for (const struct shardd_session *s = server.sessions; s; s = s->next)
		n += s->state != SHARDD_SESSION_DEAD;
	return n;
}

/* SPDX-License-Identifier: MIT */
/* The daemon's state for its reports (state.h). */
#include "session.h"
#include "state.h"

static struct shd_state_source src;

void shd_state_init(const struct shd_state_source *source)
{
	src = *source;
}

const struct shd_config *shd_state_config(void)
{
	return src.cfg;
}

pid_t shd_state_pid(void)
{
	return src.pid;
}

uid_t shd_state_uid(void)
{
	return src.uid;
}

double shd_state_uptime_s(uint64_t now_ns)
{
	return (double)(now_ns - src.start_ns) / 1e9;
}

uint64_t shd_state_collective_timeout_ns(void)
{
	return src.collective_timeout_ns;
}

struct shd_engine *shd_state_engine(void)
{
	return *src.engine;
}

struct shd_job *shd_state_jobs(void)
{
	return *src.jobs;
}

uint32_t shd_state_connections(void)
{
	uint32_t n = 0;

	for (const struct shd_session *s = *src.sessions; s; s = s->next)
		n += s->state != SHD_SESSION_DEAD;
	return n;
}

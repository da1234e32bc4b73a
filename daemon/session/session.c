/* SPDX-License-Identifier: MIT */
/*
 * The session object, lowest of the session files: what the daemon gave
 * at start (shd_sessions_init), the list of sessions and their ids, a
 * session's name in logs, and its end (detach from its job, close, mark for
 * a later close, reap). It calls none of the files above it: session_out.c
 * (what a session sends, refusals), ring.c (the ring service, the job's
 * sink), hello.c (the handshake) and control.c (accept, reading and
 * dispatching control messages).
 */
#define _GNU_SOURCE

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "backend.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "metrics.h"
#include "session_int.h"

struct shd_sessions_env shd_session_env;
uint64_t shd_session_rings_bytes;
/* Client ids start at 1; 0 is never used. */
static uint32_t session_next_id = 1;

void shd_sessions_init(const struct shd_sessions_env *e)
{
	shd_session_env = *e;
}

/* ------------------------------------------------------------------ */
/* Naming a session in logs                                            */
/* ------------------------------------------------------------------ */

/* "client 3 (pid 1234)" or "client 3 (job 'j' rank 1, pid 1234)". */
const char *shd_session_name(const struct shd_session *s, char *buf, size_t len)
{
	if (s->job)
		snprintf(buf, len, "client %u (job '%s' rank %u, pid %d)", s->id, s->job->name,
			 s->job->rank_base + s->rank, (int)s->cred.pid);
	else
		snprintf(buf, len, "client %u (pid %d)", s->id, (int)s->cred.pid);
	return buf;
}

/*
 * "RLIMIT_NOFILE=1024, open fds=1024": what a shortage of descriptors is
 * measured against. At the limit /proc/self/fd cannot be opened, and then
 * every slot below the limit is taken.
 */
const char *shd_fd_limit_describe(char *buf, size_t len)
{
	unsigned long long open_fds = 0;
	struct rlimit rl;
	struct dirent *e;
	DIR *d;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0) {
		snprintf(buf, len, "RLIMIT_NOFILE unknown: %s", strerror(errno));
		return buf;
	}
	d = opendir("/proc/self/fd");
	if (!d) {
		snprintf(buf, len, "RLIMIT_NOFILE=%llu, open fds=%s",
			 (unsigned long long)rl.rlim_cur,
			 errno == EMFILE ? "all of them" : "unknown");
		return buf;
	}
	while ((e = readdir(d)))
		open_fds += e->d_name[0] != '.';
	closedir(d);
	/* The directory's own descriptor was counted. */
	snprintf(buf, len, "RLIMIT_NOFILE=%llu, open fds=%llu", (unsigned long long)rl.rlim_cur,
		 open_fds - 1);
	return buf;
}

/* ------------------------------------------------------------------ */
/* Lifetime                                                            */
/* ------------------------------------------------------------------ */

struct shd_session *shd_session_new(int fd)
{
	struct shd_session *s;

	s = calloc(1, sizeof(*s));
	if (!s) {
		shd_log_error("out of memory accepting a client; closing its connection");
		close(fd);
		return NULL;
	}
	s->fd = fd;
	s->pidfd = -1;
	s->doorbell_fd = -1;
	s->connected_ns = shd_now_ns();
	s->id = session_next_id++;
	if (session_next_id == 0)
		session_next_id = 1;
	s->next = *shd_session_env.list;
	if (*shd_session_env.list)
		(*shd_session_env.list)->prev = s;
	*shd_session_env.list = s;
	return s;
}

/*
 * Everything of a session but its socket: detach it from its job (the
 * engine and the barrier learn that the rank is gone), mark its ring dead,
 * close its pidfd and doorbell, drop the message being read and its fds.
 */
void shd_session_release(struct shd_session *s, int goodbye, const char *why)
{
	if (s->job) {
		struct shd_job *j = s->job;

		s->job = NULL;
		shd_job_detach(j, s->rank, goodbye, why);
	}
	if (s->ring_mem) {
		/* Tell a client that looks at the ring rather than the socket; wake its waiters. */
		shardd_ring_mark_dead(&s->ring);
	}
	shd_loop_del(shd_session_env.loop, s->pidfd_ev);
	shd_loop_del(shd_session_env.loop, s->doorbell_ev);
	s->pidfd_ev = s->doorbell_ev = NULL;
	if (s->pidfd >= 0)
		close(s->pidfd);
	if (s->doorbell_fd >= 0)
		close(s->doorbell_fd);
	s->pidfd = s->doorbell_fd = -1;
	shardd_ctrl_rx_reset(&s->rx);
	s->read_backlog = 0;
	if (s->fences) {
		struct shd_backend_ctx *b = shd_engine_backend(shd_session_env.engine);

		b->ops->fences_close(b, s->fences);
		s->fences = NULL;
	}
}

void shd_session_end(struct shd_session *s, int goodbye, const char *why)
{
	char name[160];

	if (s->state == SHD_SESSION_DEAD)
		return;
	if (s->state == SHD_SESSION_ATTACHED)
		shd_log_info("%s detached: %s", shd_session_name(s, name, sizeof(name)), why);
	else
		shd_log_debug("%s closed: %s", shd_session_name(s, name, sizeof(name)), why);
	shd_session_release(s, goodbye, why);
	s->state = SHD_SESSION_DEAD;
	shd_loop_del(shd_session_env.loop, s->sock_ev);
	s->sock_ev = NULL;
	if (s->fd >= 0)
		close(s->fd);
	s->fd = -1;
	shd_session_out_clear(s);
	shd_session_env.schedule_reap();
}

void shd_session_close(struct shd_session *s, const char *why)
{
	shd_session_end(s, 0, why);
}

void shd_session_close_later(struct shd_session *s, const char *why)
{
	if (s->state == SHD_SESSION_DEAD || s->closing)
		return;
	s->closing = 1;
	snprintf(s->closing_why, sizeof(s->closing_why), "%s", why);
	shd_session_env.schedule_close();
}

void shd_session_close_marked(void)
{
	/* Closing never frees (that is the reap), so the list stays walkable. */
	for (struct shd_session *s = *shd_session_env.list; s; s = s->next)
		if (s->closing && s->state != SHD_SESSION_DEAD)
			shd_session_end(s, 0, s->closing_why);
}

void shd_session_reap(void)
{
	struct shd_session *s;

	if (!shd_session_env.list)
		return; /* a start that failed before shd_sessions_init: no sessions */
	s = *shd_session_env.list;
	while (s) {
		struct shd_session *next = s->next;

		if (s->state == SHD_SESSION_DEAD) {
			if (s->prev)
				s->prev->next = s->next;
			else
				*shd_session_env.list = s->next;
			if (s->next)
				s->next->prev = s->prev;
			if (s->ring_mem) {
				munmap(s->ring_mem, s->ring_size);
				shd_session_rings_bytes -= s->ring_size;
			}
			shd_op_clock_free(&s->clock);
			free(s);
		}
		s = next;
	}
}

/*
 * Is the client behind this session gone (socket hung up, process exited)?
 * Checked without waiting, so a rank can re-attach even when the loop has
 * not yet seen its old client's EOF.
 */
int shd_session_peer_gone(struct shd_session *s)
{
	struct pollfd p[2] = {
		{ .fd = s->fd, .events = POLLRDHUP },
		{ .fd = s->pidfd, .events = POLLIN },
	};

	if (s->state == SHD_SESSION_DEAD || s->closing)
		return 1;
	if (poll(p, s->pidfd >= 0 ? 2 : 1, 0) < 0)
		return 0;
	return (p[0].revents & (POLLHUP | POLLRDHUP | POLLERR)) || (p[1].revents & POLLIN);
}

struct shd_session *shd_session_of_rank(const struct shd_job *j, uint32_t rank)
{
	const struct shd_rank_sink *c = &j->ranks[rank].client;

	/* The rank's sink is a session's when its context is one of ours. */
	for (struct shd_session *s = *shd_session_env.list; s; s = s->next)
		if (c->ops && c->ctx == s)
			return s;
	return NULL;
}

void shd_session_out_free(struct shd_session_out *m)
{
	for (int i = 0; i < m->nfds; i++)
		close(m->fds[i]);
	free(m);
}

void shd_session_out_clear(struct shd_session *s)
{
	while (s->out_head) {
		struct shd_session_out *m = s->out_head;

		s->out_head = m->next;
		shd_session_out_free(m);
	}
	s->out_tail = NULL;
	s->out_bytes = 0;
	s->out_fds = 0;
	shd_loop_del(shd_session_env.loop, s->out_ev);
	s->out_ev = NULL;
}

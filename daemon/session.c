/* SPDX-License-Identifier: MIT */
/*
 * A session's lifetime: accept (credentials, the reserve descriptor at the
 * fd limit), reading and reassembling control messages, dispatching them,
 * refusals that linger until the client has read why, and the end of a
 * session (detach from its job, close, reap). What a session sends lives
 * in session_out.c, the handshake in hello.c, the ring service in ring.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "admin.h"
#include "backend.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "metrics.h"
#include "session_int.h"

#define SHARDD_HANDSHAKE_MSG_MAX (1u << 20) /* payload limit before the WELCOME */

/* One datagram at a time, loop thread only. */
static uint8_t dgram_buf[SHARDD_CTRL_CHUNK];

struct shardd_sessions_env shardd_session_env;
/* Client ids start at 1; 0 is never used. */
static uint32_t session_next_id = 1;

void shardd_sessions_init(const struct shardd_sessions_env *e)
{
	shardd_session_env = *e;
}

/* ------------------------------------------------------------------ */
/* Naming a session in logs                                            */
/* ------------------------------------------------------------------ */

/* "client 3 (pid 1234)" or "client 3 (job 'j' rank 1, pid 1234)". */
const char *shardd_session_name(const struct shardd_session *s, char *buf, size_t len)
{
	if (s->job)
		snprintf(buf, len, "client %u (job '%s' rank %u, pid %d)", s->id, s->job->name,
			 s->rank, (int)s->cred.pid);
	else
		snprintf(buf, len, "client %u (pid %d)", s->id, (int)s->cred.pid);
	return buf;
}

/*
 * "RLIMIT_NOFILE=1024, open fds=1024": what a shortage of descriptors is
 * measured against. At the limit /proc/self/fd cannot be opened, and then
 * every slot below the limit is taken.
 */
const char *shardd_fd_limit_describe(char *buf, size_t len)
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
/* Refusals                                                            */
/* ------------------------------------------------------------------ */

static void session_linger(struct shardd_session *s, const char *why);

/*
 * Reply an error, then end the session (credentials, handshake and framing
 * errors): it lingers until the client has read the error (session_linger).
 */
void __attribute__((format(printf, 4, 5)))
shardd_session_reject(struct shardd_session *s, uint32_t seq, int code, const char *fmt, ...)
{
	char text[1024], name[160];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	shardd_log_warn("%s rejected: %s", shardd_session_name(s, name, sizeof(name)), text);
	shardd_session_send_error(s, seq, code, text);
	session_linger(s, text);
}

/* ------------------------------------------------------------------ */
/* Lifetime                                                            */
/* ------------------------------------------------------------------ */

static void session_readable(void *arg, int fd, uint32_t revents);

/* May a client with these credentials attach? */
static int cred_allowed(const struct shardd_session *s)
{
	gid_t groups[64];
	socklen_t len = sizeof(groups);

	if (s->cred.uid == shardd_session_env.uid)
		return 1;
	for (unsigned i = 0; i < shardd_session_env.nallow_gids; i++)
		if (s->cred.gid == shardd_session_env.allow_gids[i])
			return 1;
	/* Supplementary groups count too, where the kernel reports them. */
	if (shardd_session_env.nallow_gids &&
	    getsockopt(s->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
		for (size_t g = 0; g < len / sizeof(gid_t); g++)
			for (unsigned i = 0; i < shardd_session_env.nallow_gids; i++)
				if (groups[g] == shardd_session_env.allow_gids[i])
					return 1;
	}
	return 0;
}

static void session_new(int fd)
{
	struct ucred cred;
	socklen_t len = sizeof(cred);
	struct shardd_session *s;

	s = calloc(1, sizeof(*s));
	if (!s) {
		shardd_log_error("out of memory accepting a client; closing its connection");
		close(fd);
		return;
	}
	s->fd = fd;
	s->pidfd = -1;
	s->doorbell_fd = -1;
	s->connected_ns = shardd_now_ns();
	s->id = session_next_id++;
	if (session_next_id == 0)
		session_next_id = 1;
	s->next = *shardd_session_env.list;
	if (*shardd_session_env.list)
		(*shardd_session_env.list)->prev = s;
	*shardd_session_env.list = s;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
		shardd_log_error("client %u: SO_PEERCRED: %s; closing its connection", s->id,
				 strerror(errno));
		shardd_session_close(s, "has no peer credentials");
		return;
	}
	s->cred.pid = cred.pid;
	s->cred.uid = cred.uid;
	s->cred.gid = cred.gid;
	if (!cred_allowed(s)) {
		shardd_session_reject(s, 0, -SHARDD_E_PERM,
			       "uid %u is not allowed: shardd runs as uid %u; start the client as "
			       "uid %u or run shardd with --allow-gid %u",
			       (unsigned)s->cred.uid, (unsigned)shardd_session_env.uid, (unsigned)shardd_session_env.uid,
			       (unsigned)s->cred.gid);
		return;
	}
	if (shardd_loop_add_fd(shardd_session_env.loop, fd, POLLIN | POLLRDHUP, session_readable, s,
			       &s->sock_ev) < 0) {
		shardd_session_close(s, "could not be registered with the event loop");
		return;
	}
	shardd_log_debug("client %u connected: pid %d uid %u", s->id, (int)s->cred.pid,
			 (unsigned)s->cred.uid);
}

/*
 * accept() failed with EMFILE or ENFILE (`err`): shardd is out of
 * descriptors, and the connection would wait in the backlog, unanswered,
 * until its client gave up. Spend the reserve descriptor to take it, tell
 * the client why in an ERROR, close it and take the reserve back. Returns 1
 * when a connection was answered (accept on), 0 when none is pending or no
 * reserve is left (shardd_session_cron tries again).
 */
static int accept_at_fd_limit(int listen_fd, int err)
{
	static uint64_t logged_ns;
	static unsigned refused;
	struct {
		struct shardd_msg_hdr hdr;
		struct shardd_error_msg em;
		char text[512];
	} m;
	uint64_t now = shardd_now_ns();
	char lim[96];
	int c, answered = 0;

	shardd_fd_limit_describe(lim, sizeof(lim));
	if (*shardd_session_env.accept_reserve_fd >= 0) {
		close(*shardd_session_env.accept_reserve_fd);
		*shardd_session_env.accept_reserve_fd = -1;
		c = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
		if (c >= 0) {
			struct iovec iov = { &m, 0 };
			int n = snprintf(m.text, sizeof(m.text),
					 "shardd (pid %d) is out of file descriptors (%s: %s) and "
					 "cannot take this connection; raise its limit (ulimit -n, or "
					 "LimitNOFILE= in its service) or end the jobs that hold them",
					 (int)shardd_session_env.pid, strerror(err), lim);

			m.em.code = -err;
			m.em.msg_len = (uint32_t)(n < (int)sizeof(m.text) ? n : (int)sizeof(m.text) - 1);
			m.hdr = (struct shardd_msg_hdr){ .magic = SHARDD_MAGIC, .type = SHARDD_MSG_ERROR,
							 .length = (uint32_t)sizeof(m.em) + m.em.msg_len };
			iov.iov_len = sizeof(m.hdr) + sizeof(m.em) + m.em.msg_len;
			/* Best effort and never waiting: the client's buffer is empty. */
			shardd_ctrl_send_dgram(c, &iov, 1, NULL, 0, MSG_DONTWAIT);
			/*
			 * Drop what the client sent already (its HELLO): closing with it
			 * unread would make the client's first read fail with ECONNRESET.
			 * No linger here: that would hold the reserve.
			 */
			for (int i = 0; i < SHARDD_SESSION_READ_BUDGET; i++) {
				int fds[SHARDD_CTRL_MAX_FDS], nfds;
				ssize_t n = shardd_ctrl_recv_dgram(c, dgram_buf, fds, &nfds,
								   MSG_DONTWAIT);

				for (int k = 0; k < nfds; k++)
					close(fds[k]);
				if (n == 0 || n == -EAGAIN || n == -EWOULDBLOCK)
					break;
			}
			close(c);
			refused++;
			answered = 1;
		}
		*shardd_session_env.accept_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	}
	if (now - logged_ns >= 1000000000ull || !logged_ns) {
		logged_ns = now;
		shardd_log_error("accept on %s: %s: shardd is at its fd limit (%s); %u connection(s) "
				 "refused with an error since the last report%s; raise the limit "
				 "(ulimit -n, LimitNOFILE=)", shardd_session_env.socket_path, strerror(err), lim,
				 refused, *shardd_session_env.accept_reserve_fd < 0 ?
				 ", others wait in the backlog (no reserve descriptor)" : "");
		refused = 0;
	}
	return answered;
}

void shardd_session_accept(void *arg, int fd, uint32_t revents)
{
	(void)arg;
	(void)revents;
	for (;;) {
		int c = accept4(fd, NULL, NULL, SOCK_CLOEXEC);

		if (c < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			if ((errno == EMFILE || errno == ENFILE) && accept_at_fd_limit(fd, errno))
				continue;
			if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EMFILE &&
			    errno != ENFILE)
				shardd_log_error("accept on %s: %s", shardd_session_env.socket_path,
						 strerror(errno));
			return;
		}
		session_new(c);
	}
}

/*
 * Everything of a session but its socket: detach it from its job (the
 * engine and the barrier learn that the rank is gone), mark its ring dead,
 * close its pidfd and doorbell, drop the message being read and its fds.
 */
static void session_release(struct shardd_session *s, int goodbye, const char *why)
{
	if (s->job) {
		struct shardd_job *j = s->job;

		s->job = NULL;
		shardd_job_detach(j, s->rank, goodbye, why);
	}
	if (s->ring_mem) {
		/* Tell a client that looks at the ring rather than the socket; wake its waiters. */
		shardd_ring_mark_dead(&s->ring);
	}
	shardd_loop_del(shardd_session_env.loop, s->pidfd_ev);
	shardd_loop_del(shardd_session_env.loop, s->doorbell_ev);
	s->pidfd_ev = s->doorbell_ev = NULL;
	if (s->pidfd >= 0)
		close(s->pidfd);
	if (s->doorbell_fd >= 0)
		close(s->doorbell_fd);
	s->pidfd = s->doorbell_fd = -1;
	shardd_ctrl_rx_reset(&s->rx);
	s->read_backlog = 0;
	if (s->fences) {
		struct shardd_backend_ctx *b = shardd_engine_backend(shardd_session_env.engine);

		b->ops->fences_close(b, s->fences);
		s->fences = NULL;
	}
}

static void session_end(struct shardd_session *s, int goodbye, const char *why)
{
	char name[160];

	if (s->state == SHARDD_SESSION_DEAD)
		return;
	if (s->state == SHARDD_SESSION_ATTACHED)
		shardd_log_info("%s detached: %s", shardd_session_name(s, name, sizeof(name)), why);
	else
		shardd_log_debug("%s closed: %s", shardd_session_name(s, name, sizeof(name)), why);
	session_release(s, goodbye, why);
	s->state = SHARDD_SESSION_DEAD;
	shardd_loop_del(shardd_session_env.loop, s->sock_ev);
	s->sock_ev = NULL;
	if (s->fd >= 0)
		close(s->fd);
	s->fd = -1;
	shardd_session_out_clear(s);
	shardd_session_env.schedule_reap();
}

/*
 * A refused client (shardd_session_reject): its ERROR is queued, usually sent
 * already. Closing now would lose it whenever the client's own request was
 * still unread, because the kernel then answers the client's next read with
 * ECONNRESET; and a client that sends after our close gets EPIPE. So the
 * session is released at once (no job, no ring), but its socket stays open:
 * shut for writing once the reply is out (the client reads the ERROR, then
 * EOF), what the client still sends is read and dropped (session_linger_drain),
 * and the socket is closed at the client's EOF or after
 * SHARDD_SESSION_LINGER_MS (shardd_session_cron). Nothing here waits.
 */
static void session_linger(struct shardd_session *s, const char *why)
{
	if (s->state == SHARDD_SESSION_DEAD || s->state == SHARDD_SESSION_LINGER)
		return;
	/* The reply could not be sent: nothing is left to deliver. */
	if (s->closing) {
		session_end(s, 0, s->closing_why);
		return;
	}
	session_release(s, 0, why);
	s->state = SHARDD_SESSION_LINGER;
	s->linger_until_ns = shardd_now_ns() + SHARDD_SESSION_LINGER_MS * 1000000ull;
	/* Refused at accept, before its socket was watched. */
	if (!s->sock_ev && shardd_loop_add_fd(shardd_session_env.loop, s->fd, POLLIN | POLLRDHUP,
					      session_readable, s, &s->sock_ev) < 0) {
		session_end(s, 0, why);
		return;
	}
	if (!s->out_head)
		shutdown(s->fd, SHUT_WR);
}

/*
 * Read and drop what a refused client still sends (closing any fds), at
 * most SHARDD_SESSION_READ_BUDGET datagrams a turn; its EOF closes the
 * session.
 */
static void session_linger_drain(struct shardd_session *s)
{
	unsigned budget = SHARDD_SESSION_READ_BUDGET;

	s->read_backlog = 0;
	while (s->state == SHARDD_SESSION_LINGER && !s->closing) {
		int fds[SHARDD_CTRL_MAX_FDS], nfds;
		char why[96];
		ssize_t n;

		if (budget-- == 0) {
			s->read_backlog = 1;
			return;
		}
		n = shardd_ctrl_recv_dgram(s->fd, dgram_buf, fds, &nfds, MSG_DONTWAIT);
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		if (n == -EAGAIN || n == -EWOULDBLOCK)
			return;
		if (n > 0 || n == -EBADMSG || n == -EMSGSIZE || n == -ETOOMANYREFS || n == -EMFILE)
			continue;
		if (n == 0)
			snprintf(why, sizeof(why), "closed its connection after the refusal");
		else
			snprintf(why, sizeof(why), "connection error after the refusal: %s",
				 strerror((int)-n));
		session_end(s, 0, why);
		return;
	}
}

void shardd_session_close(struct shardd_session *s, const char *why)
{
	session_end(s, 0, why);
}

void shardd_session_close_later(struct shardd_session *s, const char *why)
{
	if (s->state == SHARDD_SESSION_DEAD || s->closing)
		return;
	s->closing = 1;
	snprintf(s->closing_why, sizeof(s->closing_why), "%s", why);
	shardd_session_env.schedule_close();
}

void shardd_session_close_marked(void)
{
	/* Closing never frees (that is the reap), so the list stays walkable. */
	for (struct shardd_session *s = *shardd_session_env.list; s; s = s->next)
		if (s->closing && s->state != SHARDD_SESSION_DEAD)
			session_end(s, 0, s->closing_why);
}

void shardd_session_reap(void)
{
	struct shardd_session *s;

	if (!shardd_session_env.list)
		return; /* a start that failed before shardd_sessions_init: no sessions */
	s = *shardd_session_env.list;
	while (s) {
		struct shardd_session *next = s->next;

		if (s->state == SHARDD_SESSION_DEAD) {
			if (s->prev)
				s->prev->next = s->next;
			else
				*shardd_session_env.list = s->next;
			if (s->next)
				s->next->prev = s->prev;
			if (s->ring_mem)
				munmap(s->ring_mem, s->ring_size);
			shardd_op_clock_free(&s->clock);
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
int shardd_session_peer_gone(struct shardd_session *s)
{
	struct pollfd p[2] = {
		{ .fd = s->fd, .events = POLLRDHUP },
		{ .fd = s->pidfd, .events = POLLIN },
	};

	if (s->state == SHARDD_SESSION_DEAD || s->closing)
		return 1;
	if (poll(p, s->pidfd >= 0 ? 2 : 1, 0) < 0)
		return 0;
	return (p[0].revents & (POLLHUP | POLLRDHUP | POLLERR)) || (p[1].revents & POLLIN);
}

/* ------------------------------------------------------------------ */
/* The session as its job sees it                                      */
/* ------------------------------------------------------------------ */

static void sink_complete(void *ctx, const struct shardd_sqe *sqe, int res, const char *msg)
{
	shardd_session_complete(ctx, sqe, res, msg);
}

static void sink_group_reply(void *ctx, uint32_t seq, int res, const char *msg,
			     const struct shardd_group_reply *reply,
			     const struct shardd_param_layout *layouts,
			     const struct shardd_param_spec *specs, const int *fds, int nfds,
			     const struct shardd_cuda_ipc_handle *ipc, int nipc)
{
	shardd_session_send_group(ctx, seq, res, msg, reply, layouts, specs, fds, nfds, ipc, nipc);
}

static void sink_notify(void *ctx, int code, const char *text)
{
	shardd_session_notify(ctx, code, text);
}

static int sink_gone(void *ctx)
{
	return shardd_session_peer_gone(ctx);
}

static void sink_close(void *ctx, const char *why)
{
	shardd_session_close(ctx, why);
}

static void sink_close_later(void *ctx, const char *why)
{
	shardd_session_close_later(ctx, why);
}

static void sink_job_ended(void *ctx)
{
	struct shardd_session *s = ctx;

	s->job = NULL;
}

const struct shardd_rank_sink_ops shardd_session_sink_ops = {
	.complete = sink_complete,
	.group_reply = sink_group_reply,
	.notify = sink_notify,
	.gone = sink_gone,
	.close = sink_close,
	.close_later = sink_close_later,
	.job_ended = sink_job_ended,
};

struct shardd_session *shardd_session_of_rank(const struct shardd_job *j, uint32_t rank)
{
	const struct shardd_rank_sink *c = &j->ranks[rank].client;

	return c->ops == &shardd_session_sink_ops ? c->ctx : NULL;
}

static void session_dispatch(struct shardd_session *s, const struct shardd_msg_hdr *hdr,
			     const uint8_t *payload, uint32_t len, int nfds)
{
	int attached = s->state == SHARDD_SESSION_ATTACHED;

	if (hdr->flags) {
		shardd_session_reject(s, hdr->seq, -SHARDD_E_MALFORMED,
			       "message header flags = 0x%x: reserved, must be 0", hdr->flags);
		return;
	}
	if (nfds) {
		shardd_session_reject(s, hdr->seq, -SHARDD_E_MALFORMED,
			       "message type %u carries %d file descriptor(s); clients send none",
			       hdr->type, nfds);
		return;
	}
	if (hdr->type == SHARDD_MSG_ADMIN) {
		struct shardd_admin_reply reply;

		shardd_admin_handle(payload, len, s->cred.uid, s->cred.pid, &reply);
		/* Queued when the socket is full; a client that never reads is dropped (session.h). */
		shardd_session_send(s, SHARDD_MSG_ADMIN_REPLY, hdr->seq, reply.text,
				    (uint32_t)reply.len, NULL, 0);
		shardd_admin_reply_free(&reply);
		return;
	}
	if (!attached && hdr->type != SHARDD_MSG_HELLO) {
		shardd_session_reject(s, hdr->seq, -SHARDD_E_STATE,
			       "message type %u before HELLO: send HELLO (type %d) first", hdr->type,
			       SHARDD_MSG_HELLO);
		return;
	}
	switch (hdr->type) {
	case SHARDD_MSG_HELLO:
		if (attached)
			shardd_session_reply_error(s, hdr->seq, -SHARDD_E_STATE,
					    "already attached as job '%s' rank %u; HELLO is sent once",
					    s->job ? s->job->name : "?", s->rank);
		else
			shardd_session_hello(s, hdr, payload, len);
		return;
	case SHARDD_MSG_REGISTER_GROUP:
		if (s->job)
			shardd_engine_register_group(s->job->ejob, s->rank, s->id, hdr->seq,
						     payload, len);
		return;
	case SHARDD_MSG_OPEN_GROUP:
		if (s->job)
			shardd_engine_open_group(s->job->ejob, s->rank, s->id, hdr->seq, payload, len);
		return;
	case SHARDD_MSG_STREAM:
		shardd_session_stream(s, hdr->seq, payload, len);
		return;
	case SHARDD_MSG_GOODBYE:
		session_end(s, 1, "said goodbye");
		return;
	default:
		shardd_session_reply_error(s, hdr->seq, -SHARDD_E_INVALID,
				    "message type %u is not a request a client can send", hdr->type);
		return;
	}
}

/*
 * Why shardd_ctrl_rx_feed() refused a datagram of `n` bytes with `nfds` fds,
 * given whether a message had `started` and how much of it was missing.
 */
static void feed_error(char *buf, size_t len, int err, int started, uint32_t missing,
		       uint32_t max_len, const struct shardd_ctrl_rx *rx, size_t n, int nfds)
{
	if (err == -SHARDD_E_MAGIC)
		snprintf(buf, len, "message magic 0x%08x is not SHARDD_MAGIC 0x%08x", rx->hdr.magic,
			 SHARDD_MAGIC);
	else if (err == -EMSGSIZE)
		snprintf(buf, len, "hdr.length = %u exceeds the limit of %u bytes (1 MiB before "
			 "the WELCOME, 64 MiB after)", rx->hdr.length, max_len);
	else if (err == -ENOMEM)
		snprintf(buf, len, "shardd is out of memory for a %u-byte message", rx->hdr.length);
	else if (!started && n < sizeof(struct shardd_msg_hdr))
		snprintf(buf, len, "datagram of %zu bytes is shorter than the %zu-byte header", n,
			 sizeof(struct shardd_msg_hdr));
	else if (started && nfds)
		snprintf(buf, len, "%d file descriptor(s) on a continuation datagram", nfds);
	else
		snprintf(buf, len, "datagram carries more payload than hdr.length announced "
			 "(%u bytes were still missing)", started ? missing : rx->hdr.length);
}

/*
 * Read and serve the datagrams waiting on the session's socket, at most
 * SHARDD_SESSION_READ_BUDGET of them; past it, read_backlog asks the
 * server to read on next turn (the poll may not fire again for data that
 * is already there).
 */
static void session_read(struct shardd_session *s)
{
	unsigned budget = SHARDD_SESSION_READ_BUDGET;

	if (s->state == SHARDD_SESSION_LINGER) {
		session_linger_drain(s);
		return;
	}
	s->read_backlog = 0;
	/* A session marked closing takes no more requests; the loop closes it next. */
	while ((s->state == SHARDD_SESSION_HANDSHAKE || s->state == SHARDD_SESSION_ATTACHED) &&
	       !s->closing) {
		int fds[SHARDD_CTRL_MAX_FDS], nfds, ret, started;
		struct shardd_msg_hdr hdr;
		uint8_t *payload;
		uint32_t len, missing, max_len;
		ssize_t n;

		if (budget-- == 0) {
			s->read_backlog = 1;
			return;
		}
		/* Receive only what is there: the loop never waits for a client. */
		/* Every fd that came is ours from here, or already closed on an error. */
		n = shardd_ctrl_recv_dgram(s->fd, dgram_buf, fds, &nfds, MSG_DONTWAIT);
		if (n == 0) {
			shardd_session_close(s, "died (connection closed)");
			return;
		}
		if (n == -EAGAIN || n == -EWOULDBLOCK)
			return;
		if (n == -EBADMSG) {
			shardd_session_reject(s, 0, -SHARDD_E_MALFORMED,
				       "zero-length datagram: a datagram carries a message header "
				       "or a continuation of its payload (any file descriptors on it "
				       "were closed)");
			break;
		}
		if (n == -EMSGSIZE) {
			shardd_session_reject(s, 0, -SHARDD_E_MALFORMED,
				       "datagram larger than %u bytes (SHARDD_CTRL_CHUNK)",
				       SHARDD_CTRL_CHUNK);
			break;
		}
		if (n == -ETOOMANYREFS) {
			shardd_session_reject(s, 0, -SHARDD_E_MALFORMED,
				       "datagram carries more than %d file descriptors (the kernel "
				       "dropped the rest; they were closed); clients send none",
				       SHARDD_CTRL_MAX_FDS);
			break;
		}
		if (n == -EMFILE) {
			char lim[96], name[160];

			shardd_fd_limit_describe(lim, sizeof(lim));
			shardd_log_error("%s: control data truncated: file descriptors dropped by the "
					 "kernel (process at its fd limit? %s); raise the limit "
					 "(ulimit -n, LimitNOFILE=)", shardd_session_name(s, name, sizeof(name)),
					 lim);
			shardd_session_reject(s, 0, -SHARDD_E_MALFORMED,
				       "control data truncated: shardd could not take the file "
				       "descriptors of a datagram (at its fd limit? %s); clients "
				       "send none", lim);
			break;
		}
		if (n < 0) {
			char why[96];

			snprintf(why, sizeof(why), "connection error: %s", strerror((int)-n));
			shardd_session_close(s, why);
			return;
		}
		started = s->rx.started;
		missing = s->rx.hdr.length - s->rx.have;
		/* Before the handshake only HELLO and small ADMIN requests make sense. */
		max_len = s->state == SHARDD_SESSION_ATTACHED ? SHARDD_CTRL_MAX :
			  SHARDD_HANDSHAKE_MSG_MAX;
		ret = shardd_ctrl_rx_feed(&s->rx, dgram_buf, (size_t)n, fds, nfds, max_len);
		if (ret < 0) {
			char why[256];

			feed_error(why, sizeof(why), ret, started, missing, max_len, &s->rx, (size_t)n,
				   nfds);
			shardd_session_reject(s, s->rx.started ? s->rx.hdr.seq : 0,
				       ret == -ENOMEM ? -SHARDD_E_NOMEM :
				       ret == -SHARDD_E_MAGIC ? ret : -SHARDD_E_MALFORMED,
				       "bad control message: %s", why);
			break;
		}
		if (ret == 0 && s->rx.nfds) {
			/*
			 * Clients never send fds: refuse them now, not when the message
			 * completes. Kept while we wait for the rest, a client's own
			 * socket passed to us would hold its connection open, and its
			 * hang-up would never reach us.
			 */
			shardd_session_reject(s, s->rx.hdr.seq, -SHARDD_E_MALFORMED,
				       "message type %u carries %d file descriptor(s); clients send none",
				       s->rx.hdr.type, s->rx.nfds);
			break;
		}
		if (ret == 0)
			continue;
		/* Take the message out of the reassembly state; its fds are closed with it. */
		s->spoke = 1;
		hdr = s->rx.hdr;
		payload = s->rx.payload;
		len = s->rx.have;
		nfds = s->rx.nfds;
		s->rx.payload = NULL;
		session_dispatch(s, &hdr, payload, len, nfds);
		free(payload);
		shardd_ctrl_rx_reset(&s->rx);
	}
	/* Refused just now: what the client sent after the refused datagram is already here. */
	if (s->state == SHARDD_SESSION_LINGER)
		session_linger_drain(s);
}

static void session_readable(void *arg, int fd, uint32_t revents)
{
	(void)fd;
	(void)revents;
	session_read(arg);
}

int shardd_session_read_backlog(struct shardd_session *s)
{
	session_read(s);
	return s->read_backlog;
}

void shardd_session_cron(uint64_t now_ns)
{
	for (struct shardd_session *s = *shardd_session_env.list; s; s = s->next) {
		char name[160], why[128];

		if (s->state == SHARDD_SESSION_LINGER && !s->closing && now_ns >= s->linger_until_ns) {
			snprintf(why, sizeof(why), "kept its connection open %d ms after its refusal",
				 SHARDD_SESSION_LINGER_MS);
			shardd_session_close(s, why);
			continue;
		}
		if (s->state != SHARDD_SESSION_HANDSHAKE || s->closing || s->spoke ||
		    now_ns - s->connected_ns < shardd_session_env.handshake_timeout_ns)
			continue;
		snprintf(why, sizeof(why), "sent no complete message (HELLO or an admin request) "
			 "within %g s of connecting", shardd_session_env.handshake_timeout_s);
		shardd_log_warn("%s %s: closing it (see --handshake-timeout)",
				shardd_session_name(s, name, sizeof(name)), why);
		/* Closing never frees (that is the reap), so the list stays walkable. */
		shardd_session_close(s, why);
	}
	/* Out of descriptors earlier with no reserve left: answer who waits in the backlog. */
	if (*shardd_session_env.accept_reserve_fd < 0 && shardd_session_env.listen_fd >= 0) {
		*shardd_session_env.accept_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (*shardd_session_env.accept_reserve_fd >= 0)
			shardd_session_accept(NULL, shardd_session_env.listen_fd, 0);
	}
}


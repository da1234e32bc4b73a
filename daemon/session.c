/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "admin.h"
#include "backend.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "metrics.h"
#include "server.h"
#include "session.h"

#define SQ_ENTRIES_MIN 8
#define SQ_ENTRIES_MAX 65536
#define CQ_PER_SQ      2 /* CQ twice the SQ: a client that reaps late rarely stalls intake */
#define SHARDD_HANDSHAKE_MSG_MAX (1u << 20) /* payload limit before the WELCOME */

/* One datagram at a time, loop thread only. */
static uint8_t dgram_buf[SHARDD_CTRL_CHUNK];

/* ------------------------------------------------------------------ */
/* Naming a session in logs                                            */
/* ------------------------------------------------------------------ */

/* "client 3 (pid 1234)" or "client 3 (job 'j' rank 1, pid 1234)". */
static const char *session_name(const struct shardd_session *s, char *buf, size_t len)
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
static const char *fd_limit_describe(char *buf, size_t len)
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
/* Output queue                                                        */
/* ------------------------------------------------------------------ */

/*
 * One message not yet sent: header and payload framed in one buffer, so
 * that its datagrams are its SHARDD_CTRL_CHUNK-sized slices in order.
 */
struct shardd_session_out {
	struct shardd_session_out *next;
	uint32_t len;                      /* framed bytes: header + payload */
	uint32_t off;                      /* bytes sent so far, at a datagram boundary */
	int      fds[SHARDD_CTRL_MAX_FDS]; /* ours (duplicated); ride on the first datagram */
	int      nfds;                     /* 0 once the first datagram is sent */
	uint8_t  buf[];
};

static void session_out_free(struct shardd_session_out *m)
{
	for (int i = 0; i < m->nfds; i++)
		close(m->fds[i]);
	free(m);
}

/* Drop every queued reply and stop watching for POLLOUT (the session is ending). */
static void session_out_clear(struct shardd_session *s)
{
	while (s->out_head) {
		struct shardd_session_out *m = s->out_head;

		s->out_head = m->next;
		session_out_free(m);
	}
	s->out_tail = NULL;
	s->out_bytes = 0;
	shardd_loop_del(server.loop, s->out_ev);
	s->out_ev = NULL;
}

static void session_writable(void *arg, int fd, uint32_t revents);

/*
 * Send queued datagrams until the socket is full (MSG_DONTWAIT: the loop
 * never waits for a client), and watch for POLLOUT only while some remain.
 * A client that hung up or is gone is marked closing.
 */
static void session_flush(struct shardd_session *s)
{
	char why[128];

	while (s->out_head) {
		struct shardd_session_out *m = s->out_head;
		uint32_t left = m->len - m->off;
		struct iovec iov = { m->buf + m->off,
				     left < SHARDD_CTRL_CHUNK ? left : SHARDD_CTRL_CHUNK };
		ssize_t r = shardd_ctrl_send_dgram(s->fd, &iov, 1, m->fds, m->nfds, MSG_DONTWAIT);

		if (r == -EAGAIN || r == -EWOULDBLOCK)
			break;
		if (r < 0) {
			snprintf(why, sizeof(why), "could not be sent its replies: %s",
				 strerror((int)-r));
			shardd_session_close_later(s, why);
			return;
		}
		/* The kernel holds its own references to the fds now. */
		for (int i = 0; i < m->nfds; i++)
			close(m->fds[i]);
		m->nfds = 0;
		m->off += (uint32_t)iov.iov_len;
		s->out_bytes -= iov.iov_len;
		if (m->off == m->len) {
			s->out_head = m->next;
			if (!s->out_head)
				s->out_tail = NULL;
			free(m);
		}
	}
	if (s->out_head && !s->out_ev) {
		if (shardd_loop_add_fd(server.loop, s->fd, POLLOUT, session_writable, s,
				       &s->out_ev) < 0)
			shardd_session_close_later(s, "could not be registered with the event loop "
						   "for its replies");
	} else if (!s->out_head && s->out_ev) {
		shardd_loop_del(server.loop, s->out_ev);
		s->out_ev = NULL;
	}
	/* A refused client has its ERROR now: EOF follows it. */
	if (!s->out_head && s->state == SHARDD_SESSION_LINGER)
		shutdown(s->fd, SHUT_WR);
}

static void session_writable(void *arg, int fd, uint32_t revents)
{
	struct shardd_session *s = arg;

	(void)fd;
	(void)revents;
	/* A hang-up (POLLHUP, POLLERR) shows as a send error, which closes the session. */
	if (s->state != SHARDD_SESSION_DEAD && !s->closing)
		session_flush(s);
}

int shardd_session_send(struct shardd_session *s, uint16_t type, uint32_t seq,
			const void *payload, uint32_t len, const int *fds, int nfds)
{
	struct shardd_msg_hdr hdr = {
		.magic = SHARDD_MAGIC, .type = type, .flags = 0, .length = len, .seq = seq,
	};
	uint64_t total = sizeof(hdr) + (uint64_t)len;
	struct shardd_session_out *m;
	char name[160], why[256];
	int ret;

	/* A refused session has had its last reply. */
	if (s->state == SHARDD_SESSION_DEAD || s->state == SHARDD_SESSION_LINGER || s->closing)
		return -ECONNRESET;
	if (len > SHARDD_CTRL_MAX || nfds < 0 || nfds > SHARDD_CTRL_MAX_FDS)
		return -EINVAL;
	if (s->out_bytes + total > SHARDD_SESSION_OUT_MAX) {
		snprintf(why, sizeof(why), "does not read its replies: %llu bytes wait to be sent "
			 "and a %llu-byte reply would pass the limit of %llu",
			 (unsigned long long)s->out_bytes, (unsigned long long)total,
			 SHARDD_SESSION_OUT_MAX);
		shardd_log_warn("%s %s; dropping it", session_name(s, name, sizeof(name)), why);
		shardd_session_close_later(s, why);
		return -ENOBUFS;
	}
	m = malloc(sizeof(*m) + total);
	if (!m) {
		ret = -ENOMEM;
		goto err;
	}
	m->next = NULL;
	m->len = (uint32_t)total;
	m->off = 0;
	m->nfds = 0;
	memcpy(m->buf, &hdr, sizeof(hdr));
	if (len)
		memcpy(m->buf + sizeof(hdr), payload, len);
	/* Duplicates: the caller keeps its fds, the queue may outlive them. */
	for (int i = 0; i < nfds; i++) {
		m->fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
		if (m->fds[i] < 0) {
			ret = -errno;
			session_out_free(m);
			goto err;
		}
		m->nfds++;
	}
	if (s->out_tail)
		s->out_tail->next = m;
	else
		s->out_head = m;
	s->out_tail = m;
	s->out_bytes += total;
	session_flush(s);
	return s->closing ? -ECONNRESET : 0;

err:
	snprintf(why, sizeof(why), "could not be queued a %llu-byte reply: %s",
		 (unsigned long long)total, strerror(-ret));
	shardd_log_error("%s %s", session_name(s, name, sizeof(name)), why);
	shardd_session_close_later(s, why);
	return ret;
}

/* ------------------------------------------------------------------ */
/* Control replies                                                     */
/* ------------------------------------------------------------------ */

/* Send SHARDD_MSG_ERROR (code, text) through the output queue. */
static void session_send_error(struct shardd_session *s, uint32_t seq, int code, const char *text)
{
	struct {
		struct shardd_error_msg hdr;
		char text[1024];
	} m;
	size_t n = strnlen(text, sizeof(m.text));

	m.hdr.code = code;
	m.hdr.msg_len = (uint32_t)n;
	memcpy(m.text, text, n);
	shardd_session_send(s, SHARDD_MSG_ERROR, seq, &m, (uint32_t)(sizeof(m.hdr) + n), NULL, 0);
}

void shardd_session_notify(struct shardd_session *s, int code, const char *text)
{
	session_send_error(s, 0, code, text);
}

/* Reply an error to a request and keep serving the session. */
static void __attribute__((format(printf, 4, 5)))
session_reply_error(struct shardd_session *s, uint32_t seq, int code, const char *fmt, ...)
{
	char text[1024], name[160];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	shardd_log_info("%s: request failed: %s", session_name(s, name, sizeof(name)), text);
	session_send_error(s, seq, code, text);
}

static void session_linger(struct shardd_session *s, const char *why);

/*
 * Reply an error, then end the session (credentials, handshake and framing
 * errors): it lingers until the client has read the error (session_linger).
 */
static void __attribute__((format(printf, 4, 5)))
session_reject(struct shardd_session *s, uint32_t seq, int code, const char *fmt, ...)
{
	char text[1024], name[160];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	shardd_log_warn("%s rejected: %s", session_name(s, name, sizeof(name)), text);
	session_send_error(s, seq, code, text);
	session_linger(s, text);
}

void shardd_session_send_group(struct shardd_session *s, uint32_t seq, int res, const char *msg,
			       const struct shardd_group_reply *reply,
			       const struct shardd_param_layout *layouts,
			       const struct shardd_param_spec *specs, const int *fds, int nfds,
			       const struct shardd_cuda_ipc_handle *ipc, int nipc)
{
	uint64_t len;
	uint8_t *buf;

	if (s->state != SHARDD_SESSION_ATTACHED || s->closing)
		return;
	if (res < 0) {
		session_reply_error(s, seq, res, "%s", msg && *msg ? msg : "group request failed");
		return;
	}
	len = sizeof(*reply) + (uint64_t)reply->nparams * (sizeof(*layouts) + sizeof(*specs)) +
	      (uint64_t)nipc * sizeof(*ipc);
	if (len > SHARDD_CTRL_MAX) {
		session_reply_error(s, seq, -SHARDD_E_INVALID,
				    "group reply of %u params is %llu bytes, over the %u-byte message limit",
				    reply->nparams, (unsigned long long)len, SHARDD_CTRL_MAX);
		return;
	}
	buf = malloc(len);
	if (!buf) {
		session_reply_error(s, seq, -SHARDD_E_NOMEM, "shardd is out of memory (%llu bytes)",
				    (unsigned long long)len);
		return;
	}
	memcpy(buf, reply, sizeof(*reply));
	memcpy(buf + sizeof(*reply), layouts, (size_t)reply->nparams * sizeof(*layouts));
	memcpy(buf + sizeof(*reply) + (size_t)reply->nparams * sizeof(*layouts), specs,
	       (size_t)reply->nparams * sizeof(*specs));
	/* The CUDA IPC handles end the payload, after the specs, in buffer order (PROTOCOL.md 3.7). */
	if (nipc)
		memcpy(buf + len - (size_t)nipc * sizeof(*ipc), ipc, (size_t)nipc * sizeof(*ipc));
	shardd_session_send(s, SHARDD_MSG_GROUP, seq, buf, (uint32_t)len, fds, nfds);
	free(buf);
}

/* ------------------------------------------------------------------ */
/* Lifetime                                                            */
/* ------------------------------------------------------------------ */

static void session_readable(void *arg, int fd, uint32_t revents);

static int pidfd_open_pid(pid_t pid)
{
#ifdef SYS_pidfd_open
	return (int)syscall(SYS_pidfd_open, pid, 0);
#else
	(void)pid;
	errno = ENOSYS;
	return -1;
#endif
}

/* May a client with these credentials attach? */
static int cred_allowed(const struct shardd_session *s)
{
	gid_t groups[64];
	socklen_t len = sizeof(groups);

	if (s->cred.uid == server.uid)
		return 1;
	for (unsigned i = 0; i < server.cfg.nallow_gids; i++)
		if (s->cred.gid == server.cfg.allow_gids[i])
			return 1;
	/* Supplementary groups count too, where the kernel reports them. */
	if (server.cfg.nallow_gids &&
	    getsockopt(s->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
		for (size_t g = 0; g < len / sizeof(gid_t); g++)
			for (unsigned i = 0; i < server.cfg.nallow_gids; i++)
				if (groups[g] == server.cfg.allow_gids[i])
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
	s->id = server.next_client_id++;
	if (server.next_client_id == 0)
		server.next_client_id = 1;
	s->next = server.sessions;
	if (server.sessions)
		server.sessions->prev = s;
	server.sessions = s;
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
		session_reject(s, 0, -SHARDD_E_PERM,
			       "uid %u is not allowed: shardd runs as uid %u; start the client as "
			       "uid %u or run shardd with --allow-gid %u",
			       (unsigned)s->cred.uid, (unsigned)server.uid, (unsigned)server.uid,
			       (unsigned)s->cred.gid);
		return;
	}
	if (shardd_loop_add_fd(server.loop, fd, POLLIN | POLLRDHUP, session_readable, s,
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

	fd_limit_describe(lim, sizeof(lim));
	if (server.accept_reserve_fd >= 0) {
		close(server.accept_reserve_fd);
		server.accept_reserve_fd = -1;
		c = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
		if (c >= 0) {
			struct iovec iov = { &m, 0 };
			int n = snprintf(m.text, sizeof(m.text),
					 "shardd (pid %d) is out of file descriptors (%s: %s) and "
					 "cannot take this connection; raise its limit (ulimit -n, or "
					 "LimitNOFILE= in its service) or end the jobs that hold them",
					 (int)server.pid, strerror(err), lim);

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
		server.accept_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	}
	if (now - logged_ns >= 1000000000ull || !logged_ns) {
		logged_ns = now;
		shardd_log_error("accept on %s: %s: shardd is at its fd limit (%s); %u connection(s) "
				 "refused with an error since the last report%s; raise the limit "
				 "(ulimit -n, LimitNOFILE=)", server.cfg.socket_path, strerror(err), lim,
				 refused, server.accept_reserve_fd < 0 ?
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
				shardd_log_error("accept on %s: %s", server.cfg.socket_path,
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
		atomic_fetch_or_explicit(SHARDD_ATOMIC32(&s->ring.hdr->flags), SHARDD_RING_DEAD,
					 memory_order_release);
		shardd_futex(&s->ring.hdr->cq_tail, FUTEX_WAKE, INT_MAX, NULL);
	}
	shardd_loop_del(server.loop, s->pidfd_ev);
	shardd_loop_del(server.loop, s->doorbell_ev);
	s->pidfd_ev = s->doorbell_ev = NULL;
	if (s->pidfd >= 0)
		close(s->pidfd);
	if (s->doorbell_fd >= 0)
		close(s->doorbell_fd);
	s->pidfd = s->doorbell_fd = -1;
	shardd_ctrl_rx_reset(&s->rx);
	s->read_backlog = 0;
	if (s->fences) {
		struct shardd_backend_ctx *b = shardd_engine_backend(server.engine);

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
		shardd_log_info("%s detached: %s", session_name(s, name, sizeof(name)), why);
	else
		shardd_log_debug("%s closed: %s", session_name(s, name, sizeof(name)), why);
	session_release(s, goodbye, why);
	s->state = SHARDD_SESSION_DEAD;
	shardd_loop_del(server.loop, s->sock_ev);
	s->sock_ev = NULL;
	if (s->fd >= 0)
		close(s->fd);
	s->fd = -1;
	session_out_clear(s);
	shardd_server_schedule_reap();
}

/*
 * A refused client (session_reject): its ERROR is queued, usually sent
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
	if (!s->sock_ev && shardd_loop_add_fd(server.loop, s->fd, POLLIN | POLLRDHUP,
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
	shardd_server_schedule_close();
}

void shardd_session_close_marked(void)
{
	/* Closing never frees (that is the reap), so the list stays walkable. */
	for (struct shardd_session *s = server.sessions; s; s = s->next)
		if (s->closing && s->state != SHARDD_SESSION_DEAD)
			session_end(s, 0, s->closing_why);
}

void shardd_session_reap(void)
{
	struct shardd_session *s = server.sessions;

	while (s) {
		struct shardd_session *next = s->next;

		if (s->state == SHARDD_SESSION_DEAD) {
			if (s->prev)
				s->prev->next = s->next;
			else
				server.sessions = s->next;
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
static int session_peer_gone(struct shardd_session *s)
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

static void session_pidfd_readable(void *arg, int fd, uint32_t revents)
{
	(void)fd;
	(void)revents;
	shardd_session_close(arg, "died (process exited)");
}

static void session_doorbell(void *arg, int fd, uint32_t revents)
{
	uint64_t count;

	(void)arg;
	(void)revents;
	/* Reset the eventfd; the ring itself is served before the loop sleeps again. */
	if (read(fd, &count, sizeof(count)) == sizeof(count))
		shardd_server_note_work(shardd_now_ns());
}

/* ------------------------------------------------------------------ */
/* Handshake                                                           */
/* ------------------------------------------------------------------ */

/* Validate the job name of a hello: NUL-terminated, non-empty, printable ASCII. */
static int hello_job_ok(struct shardd_session *s, uint32_t seq, const struct shardd_hello *h)
{
	size_t n = strnlen(h->job, sizeof(h->job));

	if (n == sizeof(h->job)) {
		session_reject(s, seq, -SHARDD_E_INVALID,
			       "hello.job is not NUL-terminated within %d bytes", SHARDD_NAME_MAX);
		return 0;
	}
	if (n == 0) {
		session_reject(s, seq, -SHARDD_E_INVALID, "hello.job is empty: name the job");
		return 0;
	}
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)h->job[i];

		if (c < 0x20 || c > 0x7e) {
			session_reject(s, seq, -SHARDD_E_INVALID,
				       "hello.job byte %zu = 0x%02x: job names are printable ASCII",
				       i, c);
			return 0;
		}
	}
	return 1;
}

/* Validate every field of a hello that does not depend on existing jobs. */
static int hello_fields_ok(struct shardd_session *s, uint32_t seq, const struct shardd_hello *h)
{
	uint64_t world = (uint64_t)h->replicate * h->shard;

	if (!hello_job_ok(s, seq, h))
		return 0;
	if (h->pid != (uint32_t)s->cred.pid) {
		session_reject(s, seq, -SHARDD_E_INVALID,
			       "hello.pid = %u but the socket's peer is pid %d", h->pid,
			       (int)s->cred.pid);
		return 0;
	}
	if (h->replicate == 0 || h->shard == 0) {
		session_reject(s, seq, -SHARDD_E_INVALID, "hello.%s = 0: must be at least 1",
			       h->replicate == 0 ? "replicate" : "shard");
		return 0;
	}
	if (world > SHARDD_MAX_WORLD) {
		session_reject(s, seq, -SHARDD_E_INVALID,
			       "hello mesh %ux%u = %llu ranks exceeds the limit of %d", h->replicate,
			       h->shard, (unsigned long long)world, SHARDD_MAX_WORLD);
		return 0;
	}
	if (h->rank >= world) {
		session_reject(s, seq, -SHARDD_E_INVALID,
			       "hello.rank = %u: mesh %ux%u has ranks 0..%llu", h->rank, h->replicate,
			       h->shard, (unsigned long long)world - 1);
		return 0;
	}
	if (h->sq_entries != 0 && (!shardd_is_pow2(h->sq_entries) ||
				   h->sq_entries < SQ_ENTRIES_MIN || h->sq_entries > SQ_ENTRIES_MAX)) {
		session_reject(s, seq, -SHARDD_E_INVALID,
			       "hello.sq_entries = %u: must be 0 (default %d) or a power of two in "
			       "[%d, %d]", h->sq_entries, SHARDD_RING_ENTRIES_DEFAULT, SQ_ENTRIES_MIN,
			       SQ_ENTRIES_MAX);
		return 0;
	}
	if (h->device < SHARDD_HELLO_DEVICE_HOST) {
		session_reject(s, seq, -SHARDD_E_INVALID,
			       "hello.device = %d: must be %d (host) or a CUDA device ordinal",
			       h->device, SHARDD_HELLO_DEVICE_HOST);
		return 0;
	}
	if (h->flags) {
		session_reject(s, seq, -SHARDD_E_INVALID, "hello.flags = 0x%x: reserved, must be 0",
			       h->flags);
		return 0;
	}
	for (size_t i = 0; i < sizeof(h->rsvd); i++) {
		if (h->rsvd[i]) {
			session_reject(s, seq, -SHARDD_E_INVALID,
				       "hello.rsvd[%zu] = 0x%x: reserved, must be 0", i, h->rsvd[i]);
			return 0;
		}
	}
	return 1;
}

/*
 * The ring region: a sealed memfd (the client can neither shrink nor grow
 * it under our mapping), formatted and mapped. Returns the memfd or -errno.
 */
static int session_ring_create(struct shardd_session *s, uint32_t sq_entries, uint32_t cq_entries)
{
	uint64_t size = shardd_ring_region_size(sq_entries, cq_entries);
	int fd, ret;

	fd = memfd_create("shardd-ring", MFD_ALLOW_SEALING | MFD_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)size) < 0 ||
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		ret = -errno;
		goto err_close;
	}
	s->ring_mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (s->ring_mem == MAP_FAILED) {
		s->ring_mem = NULL;
		ret = -errno;
		goto err_close;
	}
	s->ring_size = size;
	ret = shardd_ring_format(s->ring_mem, size, sq_entries, cq_entries,
				 (uint32_t)server.pid, s->id);
	if (ret == 0)
		ret = shardd_ring_attach(&s->ring, s->ring_mem, size);
	if (ret < 0)
		goto err_close;
	return fd;

err_close:
	close(fd);
	return ret;
}

static void session_hello(struct shardd_session *s, const struct shardd_msg_hdr *hdr,
			  const uint8_t *payload, uint32_t len)
{
	struct shardd_hello h;
	struct shardd_welcome w;
	struct shardd_job *job;
	uint32_t sq_entries;
	int created = 0, ringfd = -1, ret;
	char name[160];
	int fds[2];

	/* The version comes first: a newer client may send a longer hello. */
	if (len >= 4) {
		uint16_t major, minor;

		memcpy(&major, payload, sizeof(major));
		memcpy(&minor, payload + 2, sizeof(minor));
		if (major != SHARDD_PROTO_MAJOR) {
			session_reject(s, hdr->seq, -SHARDD_E_VERSION,
				       "client speaks protocol %u.%u, shardd speaks %d.%d", major,
				       minor, SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
			return;
		}
	}
	if (len != sizeof(h)) {
		session_reject(s, hdr->seq, -SHARDD_E_MALFORMED,
			       "hello is %u bytes, expected %zu", len, sizeof(h));
		return;
	}
	memcpy(&h, payload, sizeof(h));
	if (!hello_fields_ok(s, hdr->seq, &h))
		return;

	job = shardd_job_find(h.job);
	if (job) {
		struct shardd_session *old;

		if (job->replicate != h.replicate || job->shard != h.shard) {
			session_reject(s, hdr->seq, -SHARDD_E_MESH,
				       "job '%s' has mesh %ux%u, hello asked for %ux%u", job->name,
				       job->replicate, job->shard, h.replicate, h.shard);
			return;
		}
		old = job->ranks[h.rank].session;
		/* A restarted trainer may be faster than the old one's EOF: look now. */
		if (old && session_peer_gone(old))
			shardd_session_close(old, "died (found gone when the rank re-attached)");
		/* Closing the old client never ends the job: it did not say goodbye. */
		old = job->ranks[h.rank].session;
		if (old) {
			session_reject(s, hdr->seq, -SHARDD_E_RANK_TAKEN,
				       "job '%s' rank %u is already attached (client %u, pid %d)",
				       job->name, h.rank, old->id, (int)old->cred.pid);
			return;
		}
	}

	s->pidfd = pidfd_open_pid(s->cred.pid);
	if (s->pidfd < 0 && errno != ENOSYS) {
		session_reject(s, hdr->seq, -errno, "pidfd_open(%d): %s", (int)s->cred.pid,
			       strerror(errno));
		return;
	}
	sq_entries = h.sq_entries ? h.sq_entries : SHARDD_RING_ENTRIES_DEFAULT;
	ringfd = session_ring_create(s, sq_entries, sq_entries * CQ_PER_SQ);
	if (ringfd < 0) {
		char lim[96] = "";

		if (ringfd == -EMFILE || ringfd == -ENFILE)
			fd_limit_describe(lim, sizeof(lim));
		session_reject(s, hdr->seq, -SHARDD_E_NOMEM, "cannot create the ring (%u entries): %s%s%s%s",
			       sq_entries, strerror(-ringfd), lim[0] ? " (shardd is at its fd limit: " : "",
			       lim, lim[0] ? "; raise it with ulimit -n or LimitNOFILE=)" : "");
		return;
	}
	/* Every taken entry holds a CQ slot, so at most cq_entries are timed at once. */
	if (shardd_op_clock_init(&s->clock, sq_entries * CQ_PER_SQ) < 0) {
		session_reject(s, hdr->seq, -SHARDD_E_NOMEM, "out of memory for the op clock of "
			       "%u entries", sq_entries * CQ_PER_SQ);
		goto out;
	}
	s->doorbell_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (s->doorbell_fd < 0) {
		ret = -errno;
		session_reject(s, hdr->seq, ret, "cannot create the doorbell eventfd: %s",
			       strerror(-ret));
		goto out;
	}
	if (!job) {
		ret = shardd_job_create(h.job, h.replicate, h.shard, &job);
		if (ret < 0) {
			session_reject(s, hdr->seq, ret == -ENOMEM ? -SHARDD_E_NOMEM : ret,
				       "cannot create job '%s': %s", h.job,
				       ret == -ENOMEM ? "out of memory" : "the engine refused it");
			goto out;
		}
		created = 1;
	}

	memset(&w, 0, sizeof(w));
	w.major = SHARDD_PROTO_MAJOR;
	w.minor = SHARDD_PROTO_MINOR;
	w.client_id = s->id;
	w.backend = server.cfg.backend;
	w.sq_entries = sq_entries;
	w.cq_entries = sq_entries * CQ_PER_SQ;
	w.daemon_pid = (uint32_t)server.pid;
	w.ring_size = s->ring_size;
	w.collective_timeout_ms = (uint32_t)(server.collective_timeout_ns / 1000000u);
	fds[0] = ringfd;
	fds[1] = s->doorbell_fd;
	if (shardd_session_send(s, SHARDD_MSG_WELCOME, hdr->seq, &w, sizeof(w), fds, 2) < 0) {
		/* The session is marked closing; the job it would have created goes. */
		if (created)
			shardd_job_destroy(job);
		goto out;
	}

	s->state = SHARDD_SESSION_ATTACHED;
	s->job = job;
	s->rank = h.rank;
	s->device = h.device;
	s->stats.attached_ns = shardd_now_ns();
	shardd_job_attach(job, h.rank, s);
	shardd_engine_rank_attached(job->ejob, h.rank, h.device);
	if (shardd_loop_add_fd(server.loop, s->doorbell_fd, POLLIN, session_doorbell, s,
			       &s->doorbell_ev) < 0 ||
	    (s->pidfd >= 0 && shardd_loop_add_fd(server.loop, s->pidfd, POLLIN,
						 session_pidfd_readable, s, &s->pidfd_ev) < 0)) {
		shardd_session_close(s, "could not be registered with the event loop");
		goto out;
	}
	shardd_log_info("%s attached: mesh %ux%u, ring %u/%u entries, device %d",
			session_name(s, name, sizeof(name)), h.replicate, h.shard, sq_entries,
			sq_entries * CQ_PER_SQ, h.device);
	/* The client may have submitted already; serve its ring before sleeping. */
	shardd_server_note_work(shardd_now_ns());
out:
	/* The client holds its own copy of the ring fd now; our mapping stays. */
	close(ringfd);
}

/* ------------------------------------------------------------------ */
/* Control messages                                                    */
/* ------------------------------------------------------------------ */

/*
 * SHARDD_MSG_STREAM: import the client's per-SQ-slot events and answer
 * with ours, one per CQ slot (shardd_proto.h). Once per connection.
 */
static void session_stream(struct shardd_session *s, uint32_t seq, const uint8_t *payload,
			   uint32_t len)
{
	struct shardd_backend_ctx *b = shardd_engine_backend(server.engine);
	uint32_t nsq = s->ring.sq_mask + 1, ncq = s->ring.cq_mask + 1;
	size_t hsz = sizeof(struct shardd_cuda_ipc_handle);
	struct shardd_stream_reply *rep;
	struct shardd_stream_req req;
	char err[512];
	size_t rlen;

	if (!b->ops->fences_open) {
		session_reply_error(s, seq, -ENOTSUP,
				    "stream fences need --backend cuda; this shardd runs --backend %s, "
				    "whose completions already mean the results are in memory",
				    b->ops->name);
		return;
	}
	if (s->fences) {
		session_reply_error(s, seq, -SHARDD_E_STATE,
				    "this connection set up its stream fences already; STREAM is sent once");
		return;
	}
	if (s->device < 0) {
		session_reply_error(s, seq, -SHARDD_E_INVALID,
				    "stream fences: this rank attached with hello.device = %d; attach "
				    "with the CUDA device its stream runs on", s->device);
		return;
	}
	if (len < sizeof(req)) {
		session_reply_error(s, seq, -SHARDD_E_MALFORMED,
				    "STREAM payload of %u bytes is shorter than its %zu-byte header", len,
				    sizeof(req));
		return;
	}
	memcpy(&req, payload, sizeof(req));
	if (req.rsvd) {
		session_reply_error(s, seq, -SHARDD_E_INVALID,
				    "stream.rsvd = 0x%x: reserved, must be 0", req.rsvd);
		return;
	}
	if (req.nevents != nsq) {
		session_reply_error(s, seq, -SHARDD_E_INVALID,
				    "stream.nevents = %u: must be %u, one event per SQ slot", req.nevents,
				    nsq);
		return;
	}
	if (len != sizeof(req) + (uint64_t)nsq * hsz) {
		session_reply_error(s, seq, -SHARDD_E_MALFORMED,
				    "STREAM payload of %u bytes: a header and %u event handles take %zu",
				    len, nsq, sizeof(req) + nsq * hsz);
		return;
	}
	rlen = sizeof(*rep) + ncq * hsz;
	rep = calloc(1, rlen);
	if (!rep) {
		session_reply_error(s, seq, -SHARDD_E_NOMEM,
				    "stream fences: out of memory for %u event handles", ncq);
		return;
	}
	err[0] = '\0';
	if (b->ops->fences_open(b, s->device, nsq,
				(const struct shardd_cuda_ipc_handle *)(payload + sizeof(req)), ncq,
				(struct shardd_cuda_ipc_handle *)(rep + 1), &s->fences, err,
				sizeof(err)) < 0) {
		session_reply_error(s, seq, -SHARDD_E_BACKEND, "stream fences on device %d: %s",
				    s->device, err[0] ? err : "the backend failed");
		free(rep);
		return;
	}
	rep->nevents = ncq;
	shardd_session_send(s, SHARDD_MSG_STREAM_REPLY, seq, rep, (uint32_t)rlen, NULL, 0);
	free(rep);
}

static void session_dispatch(struct shardd_session *s, const struct shardd_msg_hdr *hdr,
			     const uint8_t *payload, uint32_t len, int nfds)
{
	int attached = s->state == SHARDD_SESSION_ATTACHED;

	if (hdr->flags) {
		session_reject(s, hdr->seq, -SHARDD_E_MALFORMED,
			       "message header flags = 0x%x: reserved, must be 0", hdr->flags);
		return;
	}
	if (nfds) {
		session_reject(s, hdr->seq, -SHARDD_E_MALFORMED,
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
		session_reject(s, hdr->seq, -SHARDD_E_STATE,
			       "message type %u before HELLO: send HELLO (type %d) first", hdr->type,
			       SHARDD_MSG_HELLO);
		return;
	}
	switch (hdr->type) {
	case SHARDD_MSG_HELLO:
		if (attached)
			session_reply_error(s, hdr->seq, -SHARDD_E_STATE,
					    "already attached as job '%s' rank %u; HELLO is sent once",
					    s->job ? s->job->name : "?", s->rank);
		else
			session_hello(s, hdr, payload, len);
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
		session_stream(s, hdr->seq, payload, len);
		return;
	case SHARDD_MSG_GOODBYE:
		session_end(s, 1, "said goodbye");
		return;
	default:
		session_reply_error(s, hdr->seq, -SHARDD_E_INVALID,
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
			session_reject(s, 0, -SHARDD_E_MALFORMED,
				       "zero-length datagram: a datagram carries a message header "
				       "or a continuation of its payload (any file descriptors on it "
				       "were closed)");
			break;
		}
		if (n == -EMSGSIZE) {
			session_reject(s, 0, -SHARDD_E_MALFORMED,
				       "datagram larger than %u bytes (SHARDD_CTRL_CHUNK)",
				       SHARDD_CTRL_CHUNK);
			break;
		}
		if (n == -ETOOMANYREFS) {
			session_reject(s, 0, -SHARDD_E_MALFORMED,
				       "datagram carries more than %d file descriptors (the kernel "
				       "dropped the rest; they were closed); clients send none",
				       SHARDD_CTRL_MAX_FDS);
			break;
		}
		if (n == -EMFILE) {
			char lim[96], name[160];

			fd_limit_describe(lim, sizeof(lim));
			shardd_log_error("%s: control data truncated: file descriptors dropped by the "
					 "kernel (process at its fd limit? %s); raise the limit "
					 "(ulimit -n, LimitNOFILE=)", session_name(s, name, sizeof(name)),
					 lim);
			session_reject(s, 0, -SHARDD_E_MALFORMED,
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
			session_reject(s, s->rx.started ? s->rx.hdr.seq : 0,
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
			session_reject(s, s->rx.hdr.seq, -SHARDD_E_MALFORMED,
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
	for (struct shardd_session *s = server.sessions; s; s = s->next) {
		char name[160], why[128];

		if (s->state == SHARDD_SESSION_LINGER && !s->closing && now_ns >= s->linger_until_ns) {
			snprintf(why, sizeof(why), "kept its connection open %d ms after its refusal",
				 SHARDD_SESSION_LINGER_MS);
			shardd_session_close(s, why);
			continue;
		}
		if (s->state != SHARDD_SESSION_HANDSHAKE || s->closing || s->spoke ||
		    now_ns - s->connected_ns < server.handshake_timeout_ns)
			continue;
		snprintf(why, sizeof(why), "sent no complete message (HELLO or an admin request) "
			 "within %g s of connecting", server.cfg.handshake_timeout_s);
		shardd_log_warn("%s %s: closing it (see --handshake-timeout)",
				session_name(s, name, sizeof(name)), why);
		/* Closing never frees (that is the reap), so the list stays walkable. */
		shardd_session_close(s, why);
	}
	/* Out of descriptors earlier with no reserve left: answer who waits in the backlog. */
	if (server.accept_reserve_fd < 0 && server.listen_fd >= 0) {
		server.accept_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (server.accept_reserve_fd >= 0)
			shardd_session_accept(NULL, server.listen_fd, 0);
	}
}

/* ------------------------------------------------------------------ */
/* Data plane                                                          */
/* ------------------------------------------------------------------ */

/* A client that corrupted its own ring's indices: it is dropped, everyone else goes on. */
static void session_ring_corrupt(struct shardd_session *s, const char *which)
{
	struct shardd_ring_hdr *h = s->ring.hdr;
	char name[160], why[256];

	/* Snapshot for the message only; the client may be rewriting them as we read. */
	snprintf(why, sizeof(why),
		 "was disconnected: ring %s index is corrupt (sq head %u tail %u, cq head %u tail %u)",
		 which,
		 atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_head), memory_order_relaxed),
		 atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_tail), memory_order_relaxed),
		 atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_head), memory_order_relaxed),
		 atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_tail), memory_order_relaxed));
	shardd_log_error("%s %s", session_name(s, name, sizeof(name)), why);
	shardd_session_close_later(s, why);
}

/*
 * CQ slots free for new reservations: >= 0, or -EBADMSG when the client's
 * CQ head is corrupt.
 */
static int64_t session_cq_room(struct shardd_session *s)
{
	int64_t space = shardd_cq_space(&s->ring);

	if (space < 0)
		return space;
	/* A client that moved its head back shrinks the space under our reservations: no room. */
	return space > s->inflight ? space - s->inflight : 0;
}

void shardd_session_complete(struct shardd_session *s, const struct shardd_sqe *sqe, int res,
			     const char *msg)
{
	struct shardd_cqe cqe;
	char name[160];

	/* A closing session's client is being dropped: its completions go nowhere. */
	if (s->state != SHARDD_SESSION_ATTACHED || s->closing)
		return;
	if (s->inflight == 0) {
		shardd_log_error("%s: completion of %s (step %llu) without a reserved CQ slot; dropped",
				 session_name(s, name, sizeof(name)),
				 shardd_op_name(sqe->op) ? shardd_op_name(sqe->op) : "?",
				 (unsigned long long)sqe->step);
		return;
	}
	if (shardd_cq_space(&s->ring) <= 0) {
		session_ring_corrupt(s, "CQ head");
		return;
	}
	memset(&cqe, 0, sizeof(cqe));
	cqe.user_data = sqe->user_data;
	cqe.res = res;
	cqe.op = sqe->op;
	cqe.group = sqe->group;
	cqe.step = sqe->step;
	if ((sqe->fence & SHARDD_FENCE_SIGNAL) && s->fences) {
		struct shardd_backend_ctx *b = shardd_engine_backend(server.engine);
		uint32_t slot = shardd_cq_next_slot(&s->ring);

		/* The client's stream waits on this record before it frees the slot for the next one. */
		if (b->ops->fence_signal(b, s->fences, slot) == 0) {
			cqe.fence = 1;
		} else if (res == 0) {
			res = -SHARDD_E_BACKEND;
			msg = "the op's work is queued, but signalling its stream event failed (see the "
			      "daemon's log): synchronise the device before reading the results";
		}
	}
	if (res < 0 && (!msg || !*msg))
		msg = res <= -SHARDD_E_BASE ? "shardd error" : strerror(-res);
	shardd_cq_push(&s->ring, &cqe, res < 0 ? msg : NULL);
	shardd_metrics_op_done(sqe->op, res, shardd_metrics_op_bytes(s->job, sqe),
			       shardd_op_clock_stop(&s->clock, sqe, shardd_now_ns()));
	s->inflight--;
	s->stats.ops_completed++;
	if (res < 0)
		s->stats.ops_failed++;
}

/* Fail an entry that does not validate; the message names the field and value. */
static void __attribute__((format(printf, 3, 4)))
session_fail_sqe(struct shardd_session *s, const struct shardd_sqe *sqe, const char *fmt, ...)
{
	char msg[SHARDD_RING_MSG_SIZE];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	shardd_session_complete(s, sqe, -SHARDD_E_INVALID, msg);
}

/* Reserved fields are zero; nop and barrier carry no group and no flags. Returns 1 if valid. */
static int sqe_valid(struct shardd_session *s, const struct shardd_sqe *sqe)
{
	if (sqe->op == 0 || sqe->op >= SHARDD_OP_COUNT) {
		session_fail_sqe(s, sqe, "op %u is not a shardd op", sqe->op);
		return 0;
	}
	for (int i = 0; i < (int)sizeof(sqe->rsvd0); i++) {
		if (sqe->rsvd0[i]) {
			session_fail_sqe(s, sqe, "sqe.rsvd0[%d] = 0x%x: reserved, must be 0", i,
					 sqe->rsvd0[i]);
			return 0;
		}
	}
	if (sqe->rsvd1) {
		session_fail_sqe(s, sqe, "sqe.rsvd1 = 0x%x: reserved, must be 0", sqe->rsvd1);
		return 0;
	}
	for (int i = 0; i < 4; i++) {
		if (sqe->rsvd2[i]) {
			session_fail_sqe(s, sqe, "sqe.rsvd2[%d] = 0x%llx: reserved, must be 0", i,
					 (unsigned long long)sqe->rsvd2[i]);
			return 0;
		}
	}
	if (sqe->op == SHARDD_OP_NOP || sqe->op == SHARDD_OP_BARRIER) {
		if (sqe->group) {
			session_fail_sqe(s, sqe, "sqe.group = %u: must be 0 for %s", sqe->group,
					 shardd_op_name(sqe->op));
			return 0;
		}
		if (sqe->flags) {
			session_fail_sqe(s, sqe, "sqe.flags = 0x%x: %s takes no flags", sqe->flags,
					 shardd_op_name(sqe->op));
			return 0;
		}
	}
	return 1;
}

/*
 * The fence of the entry in SQ slot `slot`: with SHARDD_FENCE_WAIT, device
 * work queued from now on waits for the client's stream. Runs before the
 * slot goes back to the client, which re-records the slot's event only
 * after that. 0, or -1 with `why` naming the field and value.
 */
static int session_fence_wait(struct shardd_session *s, const struct shardd_sqe *sqe,
			      uint32_t slot, char *why, size_t len)
{
	struct shardd_backend_ctx *b;

	if (!sqe->fence)
		return 0;
	if (sqe->fence & ~SHARDD_FENCE_MASK) {
		snprintf(why, len, "sqe.fence = 0x%x has unknown bits 0x%x", sqe->fence,
			 sqe->fence & ~SHARDD_FENCE_MASK);
		return -1;
	}
	if (!s->fences) {
		snprintf(why, len, "sqe.fence = 0x%x, but this connection has no stream fences "
			 "(send SHARDD_MSG_STREAM first)", sqe->fence);
		return -1;
	}
	if (!(sqe->fence & SHARDD_FENCE_WAIT))
		return 0;
	b = shardd_engine_backend(server.engine);
	if (b->ops->fence_wait(b, s->fences, slot) < 0) {
		snprintf(why, len, "sqe.fence: waiting on the stream event of SQ slot %u failed in "
			 "the %s backend (see the daemon's log)", slot, b->ops->name);
		return -1;
	}
	return 0;
}

static void session_take(struct shardd_session *s, const struct shardd_sqe *sqe)
{
	if (!sqe_valid(s, sqe))
		return;
	switch (sqe->op) {
	case SHARDD_OP_NOP:
		shardd_session_complete(s, sqe, 0, NULL);
		return;
	case SHARDD_OP_BARRIER:
		shardd_job_barrier(s->job, s->rank, sqe);
		return;
	default:
		shardd_engine_submit(s->job->ejob, s->rank, s->id, sqe);
		return;
	}
}

int shardd_session_prepare_sleep(struct shardd_session *s)
{
	if (s->state != SHARDD_SESSION_ATTACHED || s->closing)
		return 0;
	if (!shardd_ring_prepare_sleep(&s->ring))
		return 0;
	if (session_cq_room(s) > 0)
		return 1;
	/*
	 * Entries wait for CQ room that only the client can free by reaping:
	 * keep NEED_WAKEUP set so that its reap rings the doorbell.
	 */
	atomic_fetch_or_explicit(SHARDD_ATOMIC32(&s->ring.hdr->flags), SHARDD_RING_NEED_WAKEUP,
				 memory_order_relaxed);
	/*
	 * Flag store before the cq_head load; pairs with the client's reap
	 * (cq_head store, full fence, flag load): one of us sees the other.
	 */
	atomic_thread_fence(memory_order_seq_cst);
	return session_cq_room(s) > 0;
}

unsigned shardd_session_service(struct shardd_session *s)
{
	uint32_t budget = s->ring.sq_mask + 1; /* one SQ's worth per turn: fairness */
	unsigned taken = 0;

	while (s->state == SHARDD_SESSION_ATTACHED && !s->closing && s->job && taken < budget) {
		struct shardd_sqe sqe;
		int64_t ready = shardd_sq_ready(&s->ring);
		int64_t room;
		char why[SHARDD_RING_MSG_SIZE];
		int fenced;

		if (ready < 0) {
			session_ring_corrupt(s, "SQ tail");
			break;
		}
		if (ready == 0)
			break;
		room = session_cq_room(s);
		if (room < 0) {
			session_ring_corrupt(s, "CQ head");
			break;
		}
		if (room == 0)
			break;
		fenced = session_fence_wait(s, &sqe, shardd_sq_peek(&s->ring, &sqe), why, sizeof(why));
		shardd_sq_release(&s->ring);
		shardd_op_clock_start(&s->clock, &sqe, shardd_now_ns());
		s->inflight++;
		s->stats.ops_taken++;
		s->stats.last_taken_op = sqe.op;
		s->stats.last_taken_step = sqe.step;
		/* Diagnostics only (shardctl, a stuck client): relaxed is enough. */
		atomic_store_explicit(SHARDD_ATOMIC32(&s->ring.hdr->daemon_last_op), sqe.op,
				      memory_order_relaxed);
		atomic_store_explicit((_Atomic uint64_t *)(void *)&s->ring.hdr->daemon_last_step,
				      sqe.step, memory_order_relaxed);
		if (fenced < 0)
			session_fail_sqe(s, &sqe, "%s", why);
		else
			session_take(s, &sqe);
		taken++;
	}
	return taken;
}

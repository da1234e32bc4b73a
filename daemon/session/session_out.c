/* SPDX-License-Identifier: MIT */
/*
 * What a session sends its client: the output queue, which never blocks
 * the loop (what the socket does not take now waits, in order, for
 * POLLOUT), and the framing of replies on top of it: ERROR replies and
 * notices, and the GROUP reply with its fds and CUDA IPC handles. And
 * refusals: an ERROR, then a linger until the client has read it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "loop.h"
#include "session_int.h"

/* ------------------------------------------------------------------ */
/* Output queue                                                        */
/* ------------------------------------------------------------------ */

static void session_writable(void *arg, int fd, uint32_t revents);

/*
 * Send queued datagrams until the socket is full (MSG_DONTWAIT: the loop
 * never waits for a client), and watch for POLLOUT only while some remain.
 * A client that hung up or is gone is marked closing.
 */
static void session_flush(struct shd_session *s)
{
	char why[128];

	while (s->out_head) {
		struct shd_session_out *m = s->out_head;
		uint32_t left = m->len - m->off;
		struct iovec iov = { m->buf + m->off,
				     left < SHARDD_CTRL_CHUNK ? left : SHARDD_CTRL_CHUNK };
		ssize_t r = shardd_ctrl_send_dgram(s->fd, &iov, 1, m->fds, m->nfds, MSG_DONTWAIT);

		if (r == -EAGAIN || r == -EWOULDBLOCK)
			break;
		if (r < 0) {
			snprintf(why, sizeof(why), "could not be sent its replies: %s",
				 strerror((int)-r));
			shd_session_close_later(s, why);
			return;
		}
		/* The kernel holds its own references to the fds now. */
		for (int i = 0; i < m->nfds; i++)
			close(m->fds[i]);
		s->out_fds -= m->nfds;
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
		if (shd_loop_add_fd(shd_session_env.loop, s->fd, POLLOUT, session_writable, s,
				    &s->out_ev) < 0)
			shd_session_close_later(s, "could not be registered with the event loop "
						   "for its replies");
	} else if (!s->out_head && s->out_ev) {
		shd_loop_del(shd_session_env.loop, s->out_ev);
		s->out_ev = NULL;
	}
	/* A refused client has its ERROR now: EOF follows it. */
	if (!s->out_head && s->state == SHD_SESSION_LINGER)
		shutdown(s->fd, SHUT_WR);
}

static void session_writable(void *arg, int fd, uint32_t revents)
{
	struct shd_session *s = arg;

	(void)fd;
	(void)revents;
	/* A hang-up (POLLHUP, POLLERR) shows as a send error, which closes the session. */
	if (s->state != SHD_SESSION_DEAD && !s->closing)
		session_flush(s);
}

int shd_session_send(struct shd_session *s, uint16_t type, uint32_t seq, const void *payload,
		     uint32_t len, const int *fds, int nfds)
{
	struct shardd_msg_hdr hdr = {
		.magic = SHARDD_MAGIC,
		.type = type,
		.flags = 0,
		.length = len,
		.seq = seq,
	};
	uint64_t total = sizeof(hdr) + (uint64_t)len;
	struct shd_session_out *m;
	char name[160], why[256];
	int ret;

	/* A refused session has had its last reply. */
	if (s->state == SHD_SESSION_DEAD || s->state == SHD_SESSION_LINGER || s->closing)
		return -ECONNRESET;
	if (len > SHARDD_CTRL_MAX || nfds < 0 || nfds > SHARDD_CTRL_MAX_FDS)
		return -EINVAL;
	if (s->out_bytes + total > SHD_SESSION_OUT_MAX) {
		snprintf(why, sizeof(why),
			 "does not read its replies: %llu bytes wait to be sent "
			 "and a %llu-byte reply would pass the limit of %llu",
			 (unsigned long long)s->out_bytes, (unsigned long long)total,
			 SHD_SESSION_OUT_MAX);
		shd_log_warn("%s %s; dropping it", shd_session_name(s, name, sizeof(name)), why);
		shd_session_close_later(s, why);
		return -ENOBUFS;
	}
	if (s->out_fds + nfds > SHD_SESSION_OUT_MAX_FDS) {
		snprintf(why, sizeof(why),
			 "does not read its replies: %d file descriptors wait to be "
			 "sent and a reply with %d more would pass the limit of %d",
			 s->out_fds, nfds, SHD_SESSION_OUT_MAX_FDS);
		shd_log_warn("%s %s; dropping it", shd_session_name(s, name, sizeof(name)), why);
		shd_session_close_later(s, why);
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
			shd_session_out_free(m);
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
	s->out_fds += m->nfds;
	session_flush(s);
	return s->closing ? -ECONNRESET : 0;

err:
	snprintf(why, sizeof(why), "could not be queued a %llu-byte reply: %s",
		 (unsigned long long)total, strerror(-ret));
	shd_log_error("%s %s", shd_session_name(s, name, sizeof(name)), why);
	shd_session_close_later(s, why);
	return ret;
}

/* ------------------------------------------------------------------ */
/* Reply framing                                                     */
/* ------------------------------------------------------------------ */

/* Send SHARDD_MSG_ERROR (code, text) through the output queue. */
void shd_session_send_error(struct shd_session *s, uint32_t seq, int code, const char *text)
{
	struct {
		struct shardd_error_msg hdr;
		char text[1024];
	} m;
	size_t n = strnlen(text, sizeof(m.text));

	m.hdr.code = code;
	m.hdr.msg_len = (uint32_t)n;
	memcpy(m.text, text, n);
	shd_session_send(s, SHARDD_MSG_ERROR, seq, &m, (uint32_t)(sizeof(m.hdr) + n), NULL, 0);
}

void shd_session_notify(struct shd_session *s, int code, const char *text)
{
	shd_session_send_error(s, 0, code, text);
}

static void session_linger(struct shd_session *s, const char *why);

/*
 * The one path of an error reply to request `seq`: logged, sent, and then
 * either the session goes on serving, or (`reject`) it ends, lingering
 * until the client has read the error (session_linger).
 */
static void __attribute__((format(printf, 5, 0)))
session_error(struct shd_session *s, uint32_t seq, int code, int reject, const char *fmt,
	      va_list ap)
{
	char text[1024], name[160];

	vsnprintf(text, sizeof(text), fmt, ap);
	shd_session_name(s, name, sizeof(name));
	if (reject)
		shd_log_warn("%s rejected: %s", name, text);
	else
		shd_log_info("%s: request failed: %s", name, text);
	shd_session_send_error(s, seq, code, text);
	if (reject)
		session_linger(s, text);
}

/* Reply an error to a request and keep serving the session. */
void __attribute__((format(printf, 4, 5)))
shd_session_reply_error(struct shd_session *s, uint32_t seq, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	session_error(s, seq, code, 0, fmt, ap);
	va_end(ap);
}

void shd_session_send_group(struct shd_session *s, uint32_t seq, int res, const char *msg,
			    const struct shardd_group_reply *reply,
			    const struct shardd_param_layout *layouts,
			    const struct shardd_param_spec *specs, const int *fds, int nfds,
			    const struct shardd_cuda_ipc_handle *ipc, int nipc)
{
	/* An older client reads the reply without exec (< 5) or peer_last_step (< 4): PROTOCOL.md 3.7. */
	size_t rsize = s->minor >= 5   ? sizeof(*reply)
		       : s->minor == 4 ? SHARDD_GROUP_REPLY_SIZE_V4
				       : SHARDD_GROUP_REPLY_SIZE_V3;
	uint64_t len;
	uint8_t *buf;

	if (s->state != SHD_SESSION_ATTACHED || s->closing)
		return;
	if (res < 0) {
		shd_session_reply_error(s, seq, res, "%s",
					msg && *msg ? msg : "group request failed");
		return;
	}
	len = rsize + (uint64_t)reply->nparams * (sizeof(*layouts) + sizeof(*specs)) +
	      (uint64_t)nipc * sizeof(*ipc);
	if (len > SHARDD_CTRL_MAX) {
		shd_session_reply_error(
			s, seq, -SHARDD_E_INVALID,
			"group reply of %u params is %llu bytes, over the %u-byte message limit",
			reply->nparams, (unsigned long long)len, SHARDD_CTRL_MAX);
		return;
	}
	buf = malloc(len);
	if (!buf) {
		shd_session_reply_error(s, seq, -SHARDD_E_NOMEM,
					"shardd is out of memory (%llu bytes)",
					(unsigned long long)len);
		return;
	}
	memcpy(buf, reply, rsize);
	memcpy(buf + rsize, layouts, (size_t)reply->nparams * sizeof(*layouts));
	memcpy(buf + rsize + (size_t)reply->nparams * sizeof(*layouts), specs,
	       (size_t)reply->nparams * sizeof(*specs));
	/* The CUDA IPC handles end the payload, after the specs, in buffer order (PROTOCOL.md 3.7). */
	if (nipc)
		memcpy(buf + len - (size_t)nipc * sizeof(*ipc), ipc, (size_t)nipc * sizeof(*ipc));
	shd_session_send(s, SHARDD_MSG_GROUP, seq, buf, (uint32_t)len, fds, nfds);
	free(buf);
}

/* ------------------------------------------------------------------ */
/* Refusals                                                            */
/* ------------------------------------------------------------------ */

/* One datagram at a time, loop thread only. */
static uint8_t dgram_buf[SHARDD_CTRL_CHUNK];

/*
 * Reply an error, then end the session (credentials, handshake and framing
 * errors): it lingers until the client has read the error (session_linger).
 */
void __attribute__((format(printf, 4, 5)))
shd_session_reject(struct shd_session *s, uint32_t seq, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	session_error(s, seq, code, 1, fmt, ap);
	va_end(ap);
}

/* A refused client that was not watched yet: what it still sends is dropped. */
static void session_linger_readable(void *arg, int fd, uint32_t revents)
{
	(void)fd;
	(void)revents;
	shd_session_linger_drain(arg);
}

/*
 * A refused client (shd_session_reject): its ERROR is queued, usually sent
 * already. Closing now would lose it whenever the client's own request was
 * still unread, because the kernel then answers the client's next read with
 * ECONNRESET; and a client that sends after our close gets EPIPE. So the
 * session is released at once (no job, no ring), but its socket stays open:
 * shut for writing once the reply is out (the client reads the ERROR, then
 * EOF), what the client still sends is read and dropped (session_linger_drain),
 * and the socket is closed at the client's EOF or after
 * SHD_SESSION_LINGER_MS (shd_session_cron). Nothing here waits.
 */
static void session_linger(struct shd_session *s, const char *why)
{
	if (s->state == SHD_SESSION_DEAD || s->state == SHD_SESSION_LINGER)
		return;
	/* The reply could not be sent: nothing is left to deliver. */
	if (s->closing) {
		shd_session_end(s, 0, s->closing_why);
		return;
	}
	shd_session_release(s, 0, why);
	s->state = SHD_SESSION_LINGER;
	s->linger_until_ns = shd_now_ns() + SHD_SESSION_LINGER_MS * 1000000ull;
	/* Refused at accept, before its socket was watched. */
	if (!s->sock_ev && shd_loop_add_fd(shd_session_env.loop, s->fd, POLLIN | POLLRDHUP,
					   session_linger_readable, s, &s->sock_ev) < 0) {
		shd_session_end(s, 0, why);
		return;
	}
	if (!s->out_head)
		shutdown(s->fd, SHUT_WR);
}

/*
 * Read and drop what a refused client still sends (closing any fds), at
 * most SHD_SESSION_READ_BUDGET datagrams a turn; its EOF closes the
 * session.
 */
void shd_session_linger_drain(struct shd_session *s)
{
	unsigned budget = SHD_SESSION_READ_BUDGET;

	s->read_backlog = 0;
	while (s->state == SHD_SESSION_LINGER && !s->closing) {
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
		shd_session_end(s, 0, why);
		return;
	}
}

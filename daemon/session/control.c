/* SPDX-License-Identifier: MIT */
/*
 * The top of the session files: accept (credentials, the reserve
 * descriptor at the fd limit), reading and reassembling control messages
 * and dispatching them (to hello.c, the admin requests, session_out.c), the
 * handshake timeout. server.c calls it; it calls the files below it.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "session_int.h"

#define SHD_HANDSHAKE_MSG_MAX (1u << 20) /* payload limit before the WELCOME */

/* One datagram at a time, loop thread only. */
static uint8_t dgram_buf[SHARDD_CTRL_CHUNK];

static void session_readable(void *arg, int fd, uint32_t revents);

/* May a client with these credentials attach? */
static int cred_allowed(const struct shd_session *s)
{
	gid_t groups[64];
	socklen_t len = sizeof(groups);

	if (s->cred.uid == shd_session_env.uid)
		return 1;
	for (unsigned i = 0; i < shd_session_env.nallow_gids; i++)
		if (s->cred.gid == shd_session_env.allow_gids[i])
			return 1;
	/* Supplementary groups count too, where the kernel reports them. */
	if (shd_session_env.nallow_gids &&
	    getsockopt(s->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
		for (size_t g = 0; g < len / sizeof(gid_t); g++)
			for (unsigned i = 0; i < shd_session_env.nallow_gids; i++)
				if (groups[g] == shd_session_env.allow_gids[i])
					return 1;
	}
	return 0;
}

static void session_new(int fd)
{
	struct ucred cred;
	socklen_t len = sizeof(cred);
	struct shd_session *s;

	s = shd_session_new(fd);
	if (!s)
		return;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
		shd_log_error("client %u: SO_PEERCRED: %s; closing its connection", s->id,
			      strerror(errno));
		shd_session_close(s, "has no peer credentials");
		return;
	}
	s->cred.pid = cred.pid;
	s->cred.uid = cred.uid;
	s->cred.gid = cred.gid;
	if (!cred_allowed(s)) {
		shd_session_reject(
			s, 0, -SHARDD_E_PERM,
			"uid %u is not allowed: shardd runs as uid %u; start the client as "
			"uid %u or run shardd with --allow-gid %u",
			(unsigned)s->cred.uid, (unsigned)shd_session_env.uid,
			(unsigned)shd_session_env.uid, (unsigned)s->cred.gid);
		return;
	}
	if (shd_loop_add_fd(shd_session_env.loop, fd, POLLIN | POLLRDHUP, session_readable, s,
			    &s->sock_ev) < 0) {
		shd_session_close(s, "could not be registered with the event loop");
		return;
	}
	shd_log_debug("client %u connected: pid %d uid %u", s->id, (int)s->cred.pid,
		      (unsigned)s->cred.uid);
}

/*
 * accept() failed with EMFILE or ENFILE (`err`): shardd is out of
 * descriptors, and the connection would wait in the backlog, unanswered,
 * until its client gave up. Spend the reserve descriptor to take it, tell
 * the client why in an ERROR, close it and take the reserve back. Returns 1
 * when a connection was answered (accept on), 0 when none is pending or no
 * reserve is left (shd_session_cron tries again).
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
	uint64_t now = shd_now_ns();
	char lim[96];
	int c, answered = 0;

	shd_fd_limit_describe(lim, sizeof(lim));
	if (*shd_session_env.accept_reserve_fd >= 0) {
		close(*shd_session_env.accept_reserve_fd);
		*shd_session_env.accept_reserve_fd = -1;
		c = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
		if (c >= 0) {
			struct iovec iov = { &m, 0 };
			int n = snprintf(
				m.text, sizeof(m.text),
				"shardd (pid %d) is out of file descriptors (%s: %s) and "
				"cannot take this connection; raise its limit (ulimit -n, or "
				"LimitNOFILE= in its service) or end the jobs that hold them",
				(int)shd_session_env.pid, strerror(err), lim);

			m.em.code = -err;
			m.em.msg_len =
				(uint32_t)(n < (int)sizeof(m.text) ? n : (int)sizeof(m.text) - 1);
			m.hdr = (struct shardd_msg_hdr){ .magic = SHARDD_MAGIC,
							 .type = SHARDD_MSG_ERROR,
							 .length = (uint32_t)sizeof(m.em) +
								   m.em.msg_len };
			iov.iov_len = sizeof(m.hdr) + sizeof(m.em) + m.em.msg_len;
			/* Best effort and never waiting: the client's buffer is empty. */
			shardd_ctrl_send_dgram(c, &iov, 1, NULL, 0, MSG_DONTWAIT);
			/*
			 * Drop what the client sent already (its HELLO): closing with it
			 * unread would make the client's first read fail with ECONNRESET.
			 * No linger here: that would hold the reserve.
			 */
			for (int i = 0; i < SHD_SESSION_READ_BUDGET; i++) {
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
		*shd_session_env.accept_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	}
	if (now - logged_ns >= 1000000000ull || !logged_ns) {
		logged_ns = now;
		shd_log_error("accept on %s: %s: shardd is at its fd limit (%s); %u connection(s) "
			      "refused with an error since the last report%s; raise the limit "
			      "(ulimit -n, LimitNOFILE=)",
			      shd_session_env.socket_path, strerror(err), lim, refused,
			      *shd_session_env.accept_reserve_fd < 0
				      ? ", others wait in the backlog (no reserve descriptor)"
				      : "");
		refused = 0;
	}
	return answered;
}

void shd_session_accept(void *arg, int fd, uint32_t revents)
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
				shd_log_error("accept on %s: %s", shd_session_env.socket_path,
					      strerror(errno));
			return;
		}
		session_new(c);
	}
}

/* SHARDD_MSG_EXEC_MAP: answered at once, with a peer's buffers or an error. */
static void control_exec_map(struct shd_session *s, uint32_t seq, const void *payload, uint32_t len)
{
	struct shardd_exec_map_reply rep;
	char err[512];
	int fds[2], ret;

	ret = shd_engine_exec_map(s->job->ejob, s->rank, s->id, payload, len, &rep, fds, err,
				  sizeof(err));
	if (ret) {
		shd_session_reply_error(s, seq, ret, "%s", err);
		return;
	}
	shd_session_send(s, SHARDD_MSG_EXEC_MAP_REPLY, seq, &rep, sizeof(rep), fds, (int)rep.nfds);
	for (uint32_t i = 0; i < rep.nfds; i++)
		close(fds[i]);
}

static void session_dispatch(struct shd_session *s, const struct shardd_msg_hdr *hdr,
			     const uint8_t *payload, uint32_t len, int nfds)
{
	int attached = s->state == SHD_SESSION_ATTACHED;

	if (hdr->flags) {
		shd_session_reject(s, hdr->seq, -SHARDD_E_MALFORMED,
				   "message header flags = 0x%x: reserved, must be 0", hdr->flags);
		return;
	}
	if (nfds) {
		shd_session_reject(
			s, hdr->seq, -SHARDD_E_MALFORMED,
			"message type %u carries %d file descriptor(s); clients send none",
			hdr->type, nfds);
		return;
	}
	if (hdr->type == SHARDD_MSG_ADMIN) {
		shd_session_env.admin_request(s, hdr->seq, payload, len);
		return;
	}
	if (!attached && hdr->type != SHARDD_MSG_HELLO) {
		shd_session_reject(s, hdr->seq, -SHARDD_E_STATE,
				   "message type %u before HELLO: send HELLO (type %d) first",
				   hdr->type, SHARDD_MSG_HELLO);
		return;
	}
	switch (hdr->type) {
	case SHARDD_MSG_HELLO:
		if (attached)
			shd_session_reply_error(
				s, hdr->seq, -SHARDD_E_STATE,
				"already attached as job '%s' rank %u; HELLO is sent once",
				s->job ? s->job->name : "?", s->rank);
		else
			shd_session_hello(s, hdr, payload, len);
		return;
	case SHARDD_MSG_REGISTER_GROUP:
		if (s->job)
			shd_engine_register_group(s->job->ejob, s->rank, s->id, hdr->seq, payload,
						  len, s->cred.uid, s->minor);
		return;
	case SHARDD_MSG_OPEN_GROUP:
		if (s->job)
			shd_engine_open_group(s->job->ejob, s->rank, s->id, hdr->seq, payload, len,
					      s->minor);
		return;
	case SHARDD_MSG_EXEC_MAP:
		if (s->job)
			control_exec_map(s, hdr->seq, payload, len);
		return;
	case SHARDD_MSG_STREAM:
		shd_session_stream(s, hdr->seq, payload, len);
		return;
	case SHARDD_MSG_GOODBYE:
		shd_session_end(s, 1, "said goodbye");
		return;
	default:
		shd_session_reply_error(s, hdr->seq, -SHARDD_E_INVALID,
					"message type %u is not a request a client can send",
					hdr->type);
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
		snprintf(buf, len,
			 "hdr.length = %u exceeds the limit of %u bytes (1 MiB before "
			 "the WELCOME, 64 MiB after)",
			 rx->hdr.length, max_len);
	else if (err == -ENOMEM)
		snprintf(buf, len, "shardd is out of memory for a %u-byte message", rx->hdr.length);
	else if (!started && n < sizeof(struct shardd_msg_hdr))
		snprintf(buf, len, "datagram of %zu bytes is shorter than the %zu-byte header", n,
			 sizeof(struct shardd_msg_hdr));
	else if (started && nfds)
		snprintf(buf, len, "%d file descriptor(s) on a continuation datagram", nfds);
	else
		snprintf(buf, len,
			 "datagram carries more payload than hdr.length announced "
			 "(%u bytes were still missing)",
			 started ? missing : rx->hdr.length);
}

/*
 * Read and serve the datagrams waiting on the session's socket, at most
 * SHD_SESSION_READ_BUDGET of them; past it, read_backlog asks the
 * server to read on next turn (the poll may not fire again for data that
 * is already there).
 */
static void session_read(struct shd_session *s)
{
	unsigned budget = SHD_SESSION_READ_BUDGET;

	if (s->state == SHD_SESSION_LINGER) {
		shd_session_linger_drain(s);
		return;
	}
	s->read_backlog = 0;
	/* A session marked closing takes no more requests; the loop closes it next. */
	while ((s->state == SHD_SESSION_HANDSHAKE || s->state == SHD_SESSION_ATTACHED) &&
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
			shd_session_close(s, "died (connection closed)");
			return;
		}
		if (n == -EAGAIN || n == -EWOULDBLOCK)
			return;
		if (n == -EBADMSG) {
			shd_session_reject(
				s, 0, -SHARDD_E_MALFORMED,
				"zero-length datagram: a datagram carries a message header "
				"or a continuation of its payload (any file descriptors on it "
				"were closed)");
			break;
		}
		if (n == -EMSGSIZE) {
			shd_session_reject(s, 0, -SHARDD_E_MALFORMED,
					   "datagram larger than %u bytes (SHARDD_CTRL_CHUNK)",
					   SHARDD_CTRL_CHUNK);
			break;
		}
		if (n == -ETOOMANYREFS) {
			shd_session_reject(
				s, 0, -SHARDD_E_MALFORMED,
				"datagram carries more than %d file descriptors (the kernel "
				"dropped the rest; they were closed); clients send none",
				SHARDD_CTRL_MAX_FDS);
			break;
		}
		if (n == -EMFILE) {
			char lim[96], name[160];

			shd_fd_limit_describe(lim, sizeof(lim));
			shd_log_error("%s: control data truncated: file descriptors dropped by the "
				      "kernel (process at its fd limit? %s); raise the limit "
				      "(ulimit -n, LimitNOFILE=)",
				      shd_session_name(s, name, sizeof(name)), lim);
			shd_session_reject(
				s, 0, -SHARDD_E_MALFORMED,
				"control data truncated: shardd could not take the file "
				"descriptors of a datagram (at its fd limit? %s); clients "
				"send none",
				lim);
			break;
		}
		if (n < 0) {
			char why[96];

			snprintf(why, sizeof(why), "connection error: %s", strerror((int)-n));
			shd_session_close(s, why);
			return;
		}
		started = s->rx.started;
		missing = s->rx.hdr.length - s->rx.have;
		/* Before the handshake only HELLO and small ADMIN requests make sense. */
		max_len =
			s->state == SHD_SESSION_ATTACHED ? SHARDD_CTRL_MAX : SHD_HANDSHAKE_MSG_MAX;
		ret = shardd_ctrl_rx_feed(&s->rx, dgram_buf, (size_t)n, fds, nfds, max_len);
		if (ret < 0) {
			char why[256];

			feed_error(why, sizeof(why), ret, started, missing, max_len, &s->rx,
				   (size_t)n, nfds);
			shd_session_reject(s, s->rx.started ? s->rx.hdr.seq : 0,
					   ret == -ENOMEM           ? -SHARDD_E_NOMEM
					   : ret == -SHARDD_E_MAGIC ? ret
								    : -SHARDD_E_MALFORMED,
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
			shd_session_reject(
				s, s->rx.hdr.seq, -SHARDD_E_MALFORMED,
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
	if (s->state == SHD_SESSION_LINGER)
		shd_session_linger_drain(s);
}

static void session_readable(void *arg, int fd, uint32_t revents)
{
	(void)fd;
	(void)revents;
	session_read(arg);
}

int shd_session_read_backlog(struct shd_session *s)
{
	session_read(s);
	return s->read_backlog;
}

void shd_session_cron(uint64_t now_ns)
{
	for (struct shd_session *s = *shd_session_env.list; s; s = s->next) {
		char name[160], why[128];

		if (s->state == SHD_SESSION_LINGER && !s->closing && now_ns >= s->linger_until_ns) {
			snprintf(why, sizeof(why),
				 "kept its connection open %d ms after its refusal",
				 SHD_SESSION_LINGER_MS);
			shd_session_close(s, why);
			continue;
		}
		if (s->state != SHD_SESSION_HANDSHAKE || s->closing || s->spoke ||
		    now_ns - s->connected_ns < shd_session_env.handshake_timeout_ns)
			continue;
		snprintf(why, sizeof(why),
			 "sent no complete message (HELLO or an admin request) "
			 "within %g s of connecting",
			 shd_session_env.handshake_timeout_s);
		shd_log_warn("%s %s: closing it (see --handshake-timeout)",
			     shd_session_name(s, name, sizeof(name)), why);
		/* Closing never frees (that is the reap), so the list stays walkable. */
		shd_session_close(s, why);
	}
	/* Out of descriptors earlier with no reserve left: answer who waits in the backlog. */
	if (*shd_session_env.accept_reserve_fd < 0 && shd_session_env.listen_fd >= 0) {
		*shd_session_env.accept_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (*shd_session_env.accept_reserve_fd >= 0)
			shd_session_accept(NULL, shd_session_env.listen_fd, 0);
	}
}

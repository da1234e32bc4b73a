/* SPDX-License-Identifier: MIT */
/*
 * Attaching to the daemon: socket path, HELLO/WELCOME handshake, ring
 * mapping, control requests, liveness of the connection, GOODBYE.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_import.h"
#include "internal.h"
#include "shardd_socket.h"

static const char *msg_type_name(uint32_t type)
{
	switch (type) {
	case SHARDD_MSG_HELLO:
		return "HELLO";
	case SHARDD_MSG_WELCOME:
		return "WELCOME";
	case SHARDD_MSG_ERROR:
		return "ERROR";
	case SHARDD_MSG_GOODBYE:
		return "GOODBYE";
	case SHARDD_MSG_REGISTER_GROUP:
		return "REGISTER_GROUP";
	case SHARDD_MSG_OPEN_GROUP:
		return "OPEN_GROUP";
	case SHARDD_MSG_GROUP:
		return "GROUP";
	case SHARDD_MSG_ADMIN:
		return "ADMIN";
	case SHARDD_MSG_ADMIN_REPLY:
		return "ADMIN_REPLY";
	default:
		return "unknown";
	}
}

/* --------------------------------------------------------------------- */
/* Control messages                                                      */
/* --------------------------------------------------------------------- */

/* The text of an ERROR message, or -SHARDD_E_MALFORMED. */
static int parse_error_msg(const struct shardd_ctrl_rx *rx, struct shardd_error_msg *em,
			   const char **text)
{
	if (rx->hdr.length < sizeof(*em))
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"daemon sent an ERROR of %u bytes, shorter than its %zu-byte header",
			rx->hdr.length, sizeof(*em));
	memcpy(em, rx->payload, sizeof(*em));
	if (em->msg_len != rx->hdr.length - sizeof(*em))
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "daemon's ERROR announces %u bytes of text but carries %zu",
				      em->msg_len, rx->hdr.length - sizeof(*em));
	if (em->code >= 0 || em->code == INT32_MIN)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "daemon's ERROR carries code %d, not a negative error code",
				      em->code);
	*text = (const char *)rx->payload + sizeof(*em);
	return 0;
}

/*
 * Keep a notice, an ERROR with seq 0: it explains a close. A late answer to
 * an abandoned request (its own seq) explains nothing now.
 */
static void remember_daemon_text(struct shardd_client *c, const struct shardd_ctrl_rx *rx)
{
	struct shardd_error_msg em;
	const char *text = NULL;

	if (rx->hdr.seq == 0 && parse_error_msg(rx, &em, &text) == 0) {
		c->daemon_code = em.code;
		snprintf(c->daemon_text, sizeof(c->daemon_text), "%.*s", (int)em.msg_len, text);
	}
}

/*
 * The error of a connection the daemon closed. A notice it sent before the
 * close (an ERROR that answered no request: "job 'J' was ended by an admin
 * request ...") says why, with its own code: the daemon lives and detached
 * this client, which -ECONNRESET (the daemon is gone) would deny.
 */
static int connection_closed(struct shardd_client *c)
{
	if (c->daemon_code)
		return shardd_err_set(c->daemon_code,
				      "daemon: %s (it closed this client's connection)",
				      c->daemon_text);
	return shardd_err_set(-ECONNRESET,
			      "daemon closed the connection (stopped or crashed; see its log)");
}

int shardd_client_request(struct shardd_client *c, uint16_t type, const void *payload, uint32_t len,
			  int timeout_ms, uint16_t want, struct shardd_ctrl_rx *rx)
{
	int64_t deadline = timeout_ms < 0 ? -1 : shardd_client_now_ms() + timeout_ms;
	uint32_t seq = ++c->seq;
	int ret;

	ret = shardd_ctrl_send(c->sock, type, seq, payload, len, NULL, 0);
	/*
	 * A daemon that refused us (e.g. at accept) and closed left its ERROR
	 * to read: read it before calling the connection broken.
	 */
	if (ret == -EPIPE || ret == -ECONNRESET)
		ret = 0;
	if (ret == -EAGAIN)
		return shardd_err_set(-ETIMEDOUT,
				      "send %s: the daemon took no data for %d ms (is it stuck?)",
				      msg_type_name(type), c->send_timeout_ms);
	if (ret < 0)
		return shardd_err_set(ret, "send %s: %s", msg_type_name(type),
				      shardd_strerror(ret));
	for (;;) {
		int left = -1;
		struct shardd_error_msg em;
		const char *text = NULL;

		if (deadline >= 0) {
			int64_t d = deadline - shardd_client_now_ms();

			left = d > 0 ? (int)d : 0;
		}
		memset(rx, 0, sizeof(*rx));
		/* Replies a daemon sent before closing are read first (shardd_ctrl_recv_dgram). */
		ret = shardd_ctrl_recv(c->sock, rx, left);
		/* Refused before our request was read (credentials), or detached: its ERROR says why. */
		if (ret == -ECONNRESET)
			return connection_closed(c);
		if (ret == -ETIMEDOUT)
			return shardd_err_set(-ETIMEDOUT,
					      "no reply to %s from the daemon within %d ms",
					      msg_type_name(type), timeout_ms);
		if (ret < 0)
			return shardd_err_set(ret, "receive the reply to %s: %s",
					      msg_type_name(type), shardd_strerror(ret));
		if (rx->hdr.seq != seq) {
			/* A late answer to an abandoned request, or a notice before a close. */
			if (rx->hdr.type == SHARDD_MSG_ERROR)
				remember_daemon_text(c, rx);
			shardd_ctrl_rx_reset(rx);
			continue;
		}
		if (rx->hdr.type == SHARDD_MSG_ERROR) {
			ret = parse_error_msg(rx, &em, &text);
			if (ret == 0)
				ret = shardd_err_set(em.code, "daemon: %.*s", (int)em.msg_len,
						     text);
			shardd_ctrl_rx_reset(rx);
			return ret;
		}
		if (rx->hdr.type != want) {
			ret = shardd_err_set(
				-SHARDD_E_MALFORMED,
				"daemon answered %s with message type %u (%s), want %s",
				msg_type_name(type), rx->hdr.type, msg_type_name(rx->hdr.type),
				msg_type_name(want));
			shardd_ctrl_rx_reset(rx);
			return ret;
		}
		return 0;
	}
}

/* How long a detached client waits for the daemon's notice of why (it is sent as the ring is marked dead). */
#define NOTICE_WAIT_MS 1000

int shardd_client_check_alive(struct shardd_client *c)
{
	uint32_t flags = shardd_ring_flags(&c->ring);
	struct pollfd p = { .fd = c->sock, .events = POLLIN };
	/*
	 * A ring marked dead: the daemon detached this client, and its notice
	 * (why) or the close follows on the socket, if not there yet. Waited
	 * for a bounded while, so the error names why.
	 */
	int ready = poll(&p, 1, (flags & SHARDD_RING_DEAD) && !c->daemon_code ? NOTICE_WAIT_MS : 0);

	/* A closed socket first: it tells a stopped daemon from a detached ring. */
	if (ready > 0 && (p.revents & POLLIN)) {
		struct shardd_ctrl_rx rx = { 0 };
		int ret = shardd_ctrl_recv(c->sock, &rx, 100);

		if (ret == -ECONNRESET)
			return connection_closed(c);
		if (ret == 0) {
			/* No request is outstanding: only a notice before a close can come. */
			if (rx.hdr.type == SHARDD_MSG_ERROR)
				remember_daemon_text(c, &rx);
			shardd_ctrl_rx_reset(&rx);
		}
	}
	if (ready > 0 && (p.revents & (POLLHUP | POLLERR)))
		return connection_closed(c);
	/* The notice sent before the detach (e.g. the job was ended) says why, with its code. */
	if ((flags & SHARDD_RING_DEAD) && c->daemon_code)
		return shardd_err_set(
			c->daemon_code,
			"daemon: %s (it detached this client: client id %u, job '%s' rank %u)",
			c->daemon_text, c->welcome.client_id, c->job, c->rank);
	if (flags & SHARDD_RING_DEAD)
		return shardd_err_set(
			-ECONNRESET, "daemon detached this client (client id %u, job '%s' rank %u)",
			c->welcome.client_id, c->job, c->rank);
	return 0;
}

/* --------------------------------------------------------------------- */
/* Attach                                                                */
/* --------------------------------------------------------------------- */

static int resolve_socket_path(const char *given, char *out, size_t len)
{
	int n = shardd_socket_path_resolve(given, out, len);

	if (n < 0 || (size_t)n >= len)
		return shardd_err_set(
			-ENAMETOOLONG,
			"socket path '%s' is %d bytes, the limit is %zu; use a shorter path", out,
			n, len - 1);
	return 0;
}

/*
 * connect() said EACCES or EPERM: name who owns the socket and its
 * directory, who we are, and the flag that lets us in.
 */
static int connect_denied(const struct shardd_client *c, int err)
{
	char dir[sizeof(c->socket_path)];
	struct stat st, dst;
	char *slash;
	unsigned uid = (unsigned)geteuid(), gid = (unsigned)getegid();

	snprintf(dir, sizeof(dir), "%s", c->socket_path);
	slash = strrchr(dir, '/');
	if (!slash)
		snprintf(dir, sizeof(dir), ".");
	else if (slash == dir)
		dir[1] = '\0';
	else
		*slash = '\0';
	if (stat(dir, &dst) < 0)
		return shardd_err_set(
			err,
			"connect to %s: %s: a directory on the way to %s does "
			"not let uid %u (gid %u) through (%s); run as shardd's user, or "
			"start shardd with --allow-gid %u and a socket path whose "
			"directories group %u may search",
			c->socket_path, strerror(-err), dir, uid, gid, strerror(errno), gid, gid);
	if (stat(c->socket_path, &st) < 0)
		return shardd_err_set(
			err,
			"connect to %s: %s: its directory %s belongs to uid %u "
			"gid %u, mode %04o, and does not let uid %u (gid %u) in; start "
			"shardd with --allow-gid %u (it then makes the directory and "
			"the socket group-accessible) or run as uid %u",
			c->socket_path, strerror(-err), dir, (unsigned)dst.st_uid,
			(unsigned)dst.st_gid, (unsigned)(dst.st_mode & 07777), uid, gid, gid,
			(unsigned)dst.st_uid);
	return shardd_err_set(
		err,
		"connect to %s: %s: the socket belongs to uid %u gid %u, mode "
		"%04o (its directory %s: uid %u gid %u, mode %04o), and this process "
		"runs as uid %u gid %u; start shardd with --allow-gid %u (it then makes "
		"the socket and its directory group-accessible) or run as uid %u",
		c->socket_path, strerror(-err), (unsigned)st.st_uid, (unsigned)st.st_gid,
		(unsigned)(st.st_mode & 07777), dir, (unsigned)dst.st_uid, (unsigned)dst.st_gid,
		(unsigned)(dst.st_mode & 07777), uid, gid, gid, (unsigned)st.st_uid);
}

static int open_socket(struct shardd_client *c, int timeout_ms)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	struct timeval tv = { .tv_sec = timeout_ms / 1000, .tv_usec = timeout_ms % 1000 * 1000 };
	int ret;

	c->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (c->sock < 0)
		return shardd_err_set(-errno, "socket: %s", strerror(errno));
	/* Bounds connect() on a full backlog and every later send. */
	if (setsockopt(c->sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0)
		return shardd_err_set(-errno, "setsockopt SO_SNDTIMEO: %s", strerror(errno));
	c->send_timeout_ms = timeout_ms;
	memcpy(addr.sun_path, c->socket_path, sizeof(addr.sun_path));
	if (connect(c->sock, (struct sockaddr *)&addr, sizeof(addr)) == 0)
		return 0;
	ret = errno == EAGAIN || errno == EINPROGRESS ? -ETIMEDOUT : -errno;
	if (ret == -ENOENT || ret == -ECONNREFUSED)
		return shardd_err_set(ret,
				      "connect to %s: %s (is shardd running? start it, or point "
				      "SHARDD_SOCKET at its socket)",
				      c->socket_path, strerror(-ret));
	if (ret == -EACCES || ret == -EPERM)
		return connect_denied(c, ret);
	return shardd_err_set(ret, "connect to %s: %s", c->socket_path, shardd_strerror(ret));
}

/* Check a WELCOME and its two fds, then map and attach the ring. */
static int map_ring(struct shardd_client *c, struct shardd_ctrl_rx *rx)
{
	struct shardd_welcome *w = &c->welcome;
	uint32_t sq_entries, cq_entries;
	struct stat st;
	int seals, ret;
	void *mem;

	if (rx->hdr.length < sizeof(*w))
		return shardd_err_set(-SHARDD_E_MALFORMED, "WELCOME of %u bytes, want at least %zu",
				      rx->hdr.length, sizeof(*w));
	memcpy(w, rx->payload, sizeof(*w));
	if (rx->nfds != 2)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "WELCOME carries %d fds, want 2 (ring, doorbell)", rx->nfds);
	if (w->major != SHARDD_PROTO_MAJOR)
		return shardd_err_set(-SHARDD_E_VERSION,
				      "daemon speaks protocol %u.%u, this libshardd %u.%u; "
				      "use a matching libshardd",
				      w->major, w->minor, SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
	if (!shardd_is_pow2(w->sq_entries) || !shardd_is_pow2(w->cq_entries) ||
	    w->cq_entries < w->sq_entries)
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"WELCOME sq_entries %u cq_entries %u: want powers of two, cq >= sq",
			w->sq_entries, w->cq_entries);
	if (fstat(rx->fds[0], &st) < 0)
		return shardd_err_set(-errno, "fstat ring fd: %s", strerror(errno));
	if (w->ring_size < shardd_ring_region_size(w->sq_entries, w->cq_entries) ||
	    w->ring_size > (uint64_t)st.st_size || w->ring_size > SIZE_MAX)
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"WELCOME ring_size %llu: the ring fd has %lld bytes and %u/%u "
			"entries need %llu",
			(unsigned long long)w->ring_size, (long long)st.st_size, w->sq_entries,
			w->cq_entries,
			(unsigned long long)shardd_ring_region_size(w->sq_entries, w->cq_entries));
	/* Without the shrink seal the daemon could truncate the ring under us (SIGBUS). */
	seals = fcntl(rx->fds[0], F_GET_SEALS);
	if (seals < 0 || !(seals & F_SEAL_SHRINK))
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "ring fd is not a memfd sealed against shrinking (seals %d)",
				      seals);
	mem = mmap(NULL, (size_t)w->ring_size, PROT_READ | PROT_WRITE, MAP_SHARED, rx->fds[0], 0);
	if (mem == MAP_FAILED)
		return shardd_err_set(-errno, "mmap ring of %llu bytes: %s",
				      (unsigned long long)w->ring_size, strerror(errno));
	c->ring_mem = mem;
	ret = shardd_ring_attach(&c->ring, mem, w->ring_size);
	if (ret < 0)
		return shardd_err_set(ret, "attach ring: %s", shardd_strerror(ret));
	shardd_ring_capacity(&c->ring, &sq_entries, &cq_entries);
	if (sq_entries != w->sq_entries || cq_entries != w->cq_entries)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "ring header has %u/%u entries, WELCOME said %u/%u",
				      sq_entries, cq_entries, w->sq_entries, w->cq_entries);
	/* Take the doorbell out of rx; the ring fd is closed with it, the mapping stays. */
	c->doorbell = rx->fds[1];
	rx->nfds = 1;
	return 0;
}

static void client_free(struct shardd_client *c)
{
	shardd_cuda_fences_free(c->fences);
	if (c->ring_mem)
		munmap(c->ring_mem, (size_t)c->welcome.ring_size);
	if (c->doorbell >= 0)
		close(c->doorbell);
	if (c->sock >= 0)
		close(c->sock);
	free(c->stash.v);
	free(c);
}

int shardd_connect(const struct shardd_attach_opts *o, struct shardd_client **out)
{
	struct shardd_hello hello = { 0 };
	struct shardd_ctrl_rx rx = { 0 };
	struct shardd_client *c;
	int timeout_ms, ret;

	shardd_err_clear();
	if (!o || !out)
		return shardd_err_set(-EINVAL, "connect: NULL %s", o ? "out" : "opts");
	if (!o->job || strnlen(o->job, SHARDD_NAME_MAX) >= SHARDD_NAME_MAX)
		return shardd_err_set(-EINVAL,
				      "connect: job name %s; give a name shorter than %d bytes",
				      o->job ? "too long" : "missing", SHARDD_NAME_MAX);
	if (o->timeout_ms < 0)
		return shardd_err_set(-EINVAL, "connect: timeout_ms %d is negative", o->timeout_ms);
	timeout_ms = o->timeout_ms ? o->timeout_ms : SHARDD_CONNECT_TIMEOUT_MS;
	c = calloc(1, sizeof(*c));
	if (!c)
		return shardd_err_set(-ENOMEM, "connect: out of memory");
	c->sock = -1;
	c->doorbell = -1;
	snprintf(c->job, sizeof(c->job), "%s", o->job);
	c->rank = o->rank;
	c->shard = o->shard;
	c->device = o->device;
	ret = resolve_socket_path(o->socket_path, c->socket_path, sizeof(c->socket_path));
	if (ret < 0)
		goto err;
	ret = open_socket(c, timeout_ms);
	if (ret < 0)
		goto err;
	hello.major = SHARDD_PROTO_MAJOR;
	hello.minor = SHARDD_PROTO_MINOR;
	hello.pid = (uint32_t)getpid();
	memcpy(hello.job, c->job, sizeof(hello.job));
	hello.rank = o->rank;
	hello.replicate = o->replicate;
	hello.shard = o->shard;
	hello.device = o->device;
	hello.sq_entries = o->ring_entries;
	ret = shardd_client_request(c, SHARDD_MSG_HELLO, &hello, sizeof(hello), timeout_ms,
				    SHARDD_MSG_WELCOME, &rx);
	if (ret < 0)
		goto err;
	ret = map_ring(c, &rx);
	shardd_ctrl_rx_reset(&rx);
	if (ret < 0)
		goto err;
	*out = c;
	return 0;
err:
	shardd_err_wrap(ret, "attach job '%s' rank %u (mesh %ux%u) at %s", o->job, o->rank,
			o->replicate, o->shard, c->socket_path[0] ? c->socket_path : "(no path)");
	client_free(c);
	return ret;
}

void shardd_close(struct shardd_client *c)
{
	if (!c)
		return;
	/* Best effort: a daemon that is already gone needs no goodbye. */
	shardd_ctrl_send(c->sock, SHARDD_MSG_GOODBYE, ++c->seq, NULL, 0, NULL, 0);
	client_free(c);
}

/* SHARDD_VERSION comes from the Makefile (-DSHARDD_VERSION), as for the daemon and the tools. */
const char *shardd_version(void)
{
	return SHARDD_VERSION;
}

int shardd_client_id(const struct shardd_client *c)
{
	return (int)c->welcome.client_id;
}

uint32_t shardd_client_collective_timeout_ms(const struct shardd_client *c)
{
	return c->welcome.collective_timeout_ms;
}

uint32_t shardd_client_ring_entries(const struct shardd_client *c)
{
	return c->welcome.sq_entries;
}

uint32_t shardd_client_backend(const struct shardd_client *c)
{
	return c->welcome.backend;
}

uint32_t shardd_collective_timeout_ms(const struct shardd_client *c)
{
	return shardd_client_collective_timeout_ms(c);
}

uint32_t shardd_ring_entries(const struct shardd_client *c)
{
	return shardd_client_ring_entries(c);
}

uint32_t shardd_backend(const struct shardd_client *c)
{
	return shardd_client_backend(c);
}

/* SPDX-License-Identifier: MIT */
/*
 * --metrics-listen (metrics_http.h): libmicrohttpd run from the loop.
 *
 * Any local process may connect, so no connection may hold a slot for
 * long: each must deliver its request and take its response within
 * METRICS_HTTP_EXCHANGE_MS of connecting (or of its previous response, on
 * a kept-alive connection), whether it sits idle, trickles bytes, or does
 * not read. A connection past its deadline is shut down, which MHD sees
 * as the peer's end and closes. The daemon accepts connections itself
 * (MHD_add_connection), all that are pending at each event, so none waits
 * in the listen backlog behind a flood. Above METRICS_HTTP_CONNECTIONS
 * open, each tick shuts down the oldest whose request bytes are not waiting
 * unread in the kernel (not served, and not about to be) until that many
 * are left; only at twice as many is a new connection closed at once. A
 * scraper, which sends its request as soon as it connects, has its bytes
 * read before any tick can take it for an idle one, so it is answered
 * however many others keep connecting.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "admin.h"
#include "clock.h"
#include "log.h"
#include "loop.h"
#include "metrics_http.h"

#define METRICS_HTTP_CONNECTIONS 256 /* kept open past a tick; the oldest idle ones above go */
#define METRICS_HTTP_EXCHANGE_MS \
	500                      /* a request in and its response out, from the connection's
					 start or its previous response; past it: shut down */
#define METRICS_HTTP_TICK_MS 100 /* deadlines are checked this often */
#define METRICS_HTTP_RUNS    64  /* MHD_runs at most per event, while MHD has more to do at once */
/*
 * libmicrohttpd's messages are mostly about one connection (one closed by
 * its peer or at its deadline): a flood of connections must not become a
 * flood of log lines, whose writes would hold the loop once stderr's pipe
 * is full. At most this many a window; the count of the rest follows.
 */
#define METRICS_HTTP_LOG_BURST     10
#define METRICS_HTTP_LOG_WINDOW_NS (10ull * 1000 * 1000 * 1000)
#define METRICS_CONTENT_TYPE       "text/plain; version=0.0.4; charset=utf-8"

/* One TCP connection MHD holds: its socket context. */
struct metrics_conn {
	struct metrics_conn *next, *prev;
	int fd;
	uint64_t deadline_ns; /* its request must be in and answered by then */
	int shut;             /* shut down at its deadline; MHD closes it next */
};

struct shd_metrics_http {
	struct MHD_Daemon *mhd;
	int listen_fd;
	struct shd_loop_event *listen_ev; /* a connection to accept */
	struct shd_loop_event *fd_ev;     /* MHD's epoll fd: a connection is ready */
	struct shd_loop_event *tick_ev;   /* connection deadlines */
	struct metrics_conn conns;        /* the open connections, newest first */
	uint64_t log_window_ns;           /* start of the current log window */
	unsigned log_lines;               /* logged in it */
	unsigned long log_dropped;        /* not logged in it */
	char url[128];
};

int shd_metrics_http_parse(const char *spec, char *host, size_t host_len, char *port,
			   size_t port_len, char *err, size_t errlen)
{
	const char *colon, *p;
	size_t hl;
	char *end;
	unsigned long v;

	if (spec[0] == '[') {
		const char *close = strchr(spec, ']');

		if (!close || close[1] != ':') {
			snprintf(err, errlen, "'%s': an IPv6 address goes as [ADDR]:PORT", spec);
			return -EINVAL;
		}
		hl = (size_t)(close - spec - 1);
		if (hl == 0 || hl >= host_len) {
			snprintf(err, errlen, "'%s': the address is empty or too long", spec);
			return -EINVAL;
		}
		memcpy(host, spec + 1, hl);
		host[hl] = '\0';
		p = close + 2;
	} else if ((colon = strrchr(spec, ':')) != NULL) {
		hl = (size_t)(colon - spec);
		if (hl == 0 || hl >= host_len || memchr(spec, ':', hl)) {
			snprintf(err, errlen,
				 "'%s' is not [ADDR:]PORT (an IPv6 address goes in "
				 "brackets: [::1]:9464)",
				 spec);
			return -EINVAL;
		}
		memcpy(host, spec, hl);
		host[hl] = '\0';
		p = colon + 1;
	} else {
		/* Only a port: loopback, so nothing is exposed off the machine unless asked. */
		snprintf(host, host_len, "127.0.0.1");
		p = spec;
	}
	errno = 0;
	v = strtoul(p, &end, 10);
	if (!*p || *p == '-' || *p == '+' || errno || *end || v > 65535) {
		snprintf(err, errlen, "'%s': the port '%s' is not a number in [0, 65535]", spec, p);
		return -EINVAL;
	}
	snprintf(port, port_len, "%lu", v);
	return 0;
}

/* ------------------------------------------------------------------ */
/* The log                                                             */
/* ------------------------------------------------------------------ */

/* Log one line, unless the window's METRICS_HTTP_LOG_BURST are spent: then count it. */
static void metrics_vlog(struct shd_metrics_http *h, const char *fmt, va_list ap)
{
	uint64_t now = shd_now_ns();
	char line[512];
	size_t n;

	if (now - h->log_window_ns >= METRICS_HTTP_LOG_WINDOW_NS) {
		if (h->log_dropped)
			shd_log_warn(
				"metrics http: %lu more messages in %.0f s not logged (at most %d "
				"a window)",
				h->log_dropped, (double)(now - h->log_window_ns) / 1e9,
				METRICS_HTTP_LOG_BURST);
		h->log_window_ns = now;
		h->log_lines = 0;
		h->log_dropped = 0;
	}
	if (h->log_lines >= METRICS_HTTP_LOG_BURST) {
		h->log_dropped++;
		return;
	}
	h->log_lines++;
	vsnprintf(line, sizeof(line), fmt, ap);
	n = strlen(line);
	while (n && line[n - 1] == '\n')
		line[--n] = '\0';
	shd_log_warn("metrics http: %s", line);
}

static void __attribute__((format(printf, 2, 3)))
metrics_warn(struct shd_metrics_http *h, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	metrics_vlog(h, fmt, ap);
	va_end(ap);
}

/* libmicrohttpd's messages (MHD_OPTION_EXTERNAL_LOGGER). */
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
	metrics_vlog(cls, fmt, ap);
}

/* ------------------------------------------------------------------ */
/* Requests                                                            */
/* ------------------------------------------------------------------ */

static enum MHD_Result respond_text(struct MHD_Connection *conn, unsigned status, const char *text)
{
	struct MHD_Response *r =
		MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
	enum MHD_Result ret;

	if (!r)
		return MHD_NO;
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
	ret = MHD_queue_response(conn, status, r);
	MHD_destroy_response(r);
	return ret;
}

/* Runs inside MHD_run, on the loop thread: reading the daemon's state is safe. */
static enum MHD_Result metrics_request(void *cls, struct MHD_Connection *conn, const char *url,
				       const char *method, const char *version,
				       const char *upload_data, size_t *upload_data_size,
				       void **con_cls)
{
	struct MHD_Response *r;
	enum MHD_Result ret;
	char *text;

	(void)cls;
	(void)version;
	(void)upload_data;
	(void)upload_data_size;
	(void)con_cls;
	/* Answered at the first call, with the headers: a body sent along is discarded. */
	if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
		return respond_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED,
				    "shardd serves GET /metrics only\n");
	if (strcmp(url, "/metrics") != 0)
		return respond_text(
			conn, MHD_HTTP_NOT_FOUND,
			"not found: shardd serves its Prometheus metrics at /metrics\n");
	text = shd_admin_metrics_render();
	if (!text)
		return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR,
				    "shardd is out of memory rendering its metrics\n");
	r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
	if (!r) {
		free(text);
		return MHD_NO;
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, METRICS_CONTENT_TYPE);
	ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
	MHD_destroy_response(r);
	return ret;
}

/* MHD_OPTION_NOTIFY_CONNECTION: every connection is listed with its deadline while open. */
static void metrics_conn_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
				enum MHD_ConnectionNotificationCode toe)
{
	struct shd_metrics_http *h = cls;
	struct metrics_conn *c = *socket_context;
	const union MHD_ConnectionInfo *info;

	if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
		if (c) {
			c->prev->next = c->next;
			c->next->prev = c->prev;
			free(c);
			*socket_context = NULL;
		}
		return;
	}
	info = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
	c = calloc(1, sizeof(*c));
	if (!c || !info) {
		/* Untracked, it could hold its slot: refuse it at once instead. */
		metrics_warn(h, "%s: connection refused",
			     c ? "libmicrohttpd gave no socket" : "out of memory");
		free(c);
		if (info)
			shutdown(info->connect_fd, SHUT_RDWR);
		return;
	}
	c->fd = info->connect_fd;
	c->deadline_ns = shd_now_ns() + METRICS_HTTP_EXCHANGE_MS * 1000000ull;
	c->next = h->conns.next;
	c->prev = &h->conns;
	h->conns.next->prev = c;
	h->conns.next = c;
	*socket_context = c;
}

/* MHD_OPTION_NOTIFY_COMPLETED: a response went out; a kept-alive connection's next request is due. */
static void metrics_request_done(void *cls, struct MHD_Connection *conn, void **con_cls,
				 enum MHD_RequestTerminationCode toe)
{
	const union MHD_ConnectionInfo *info;
	struct metrics_conn *c;

	(void)cls;
	(void)con_cls;
	(void)toe;
	info = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
	c = info ? info->socket_context : NULL;
	if (c && !c->shut)
		c->deadline_ns = shd_now_ns() + METRICS_HTTP_EXCHANGE_MS * 1000000ull;
}

/* Shut down c: MHD reads the end and closes it. */
static void metrics_conn_shut(struct metrics_conn *c)
{
	c->shut = 1;
	shutdown(c->fd, SHUT_RDWR);
}

/* Connections not shut down yet. */
static unsigned metrics_conns_open(const struct shd_metrics_http *h)
{
	unsigned open = 0;

	for (const struct metrics_conn *c = h->conns.next; c != &h->conns; c = c->next)
		open += !c->shut;
	return open;
}

/*
 * Each tick, before MHD runs: shut down every connection past its
 * deadline, then, while more than METRICS_HTTP_CONNECTIONS are open, the
 * oldest with no request bytes waiting unread (FIONREAD): idle, or
 * trickling bytes MHD took already. One whose request is in is kept, and
 * MHD serves it next.
 */
static void metrics_conns_trim(struct shd_metrics_http *h, uint64_t now_ns)
{
	unsigned open;

	for (struct metrics_conn *c = h->conns.next; c != &h->conns; c = c->next)
		if (!c->shut && now_ns >= c->deadline_ns)
			metrics_conn_shut(c);
	open = metrics_conns_open(h);
	for (struct metrics_conn *c = h->conns.prev;
	     c != &h->conns && open > METRICS_HTTP_CONNECTIONS; c = c->prev) {
		int unread = 0;

		if (c->shut || (ioctl(c->fd, FIONREAD, &unread) == 0 && unread > 0))
			continue;
		metrics_conn_shut(c);
		open--;
	}
}

static void metrics_http_run(struct shd_metrics_http *h);

/* The listening socket is ready: hand every pending connection to MHD. */
static void metrics_http_accept(void *arg, int fd, uint32_t revents)
{
	struct shd_metrics_http *h = arg;

	(void)revents;
	for (;;) {
		struct sockaddr_storage ss;
		socklen_t sl = sizeof(ss);
		int c = accept4(fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);

		if (c < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			/* EAGAIN: all taken. EMFILE and the like: the next event tries again. */
			if (errno != EAGAIN)
				metrics_warn(h, "accept: %s", strerror(errno));
			break;
		}
		/* Twice the limit open: the ticks have not kept up with the flood; refuse. */
		if (metrics_conns_open(h) >= 2 * METRICS_HTTP_CONNECTIONS) {
			close(c);
			continue;
		}
		/* MHD owns c from here, and closes it itself when it cannot take it. */
		if (MHD_add_connection(h->mhd, c, (struct sockaddr *)&ss, sl) != MHD_YES)
			metrics_warn(h, "a connection was refused: %s", strerror(errno));
	}
	metrics_http_run(h);
}

/* ------------------------------------------------------------------ */
/* Loop events                                                         */
/* ------------------------------------------------------------------ */

/*
 * MHD_run until MHD has nothing left to do at once (MHD_get_timeout above
 * 0): MHD's epoll is edge-triggered, so a connection it could not finish
 * in one run (a request line past its buffer, to be answered 414) gets no
 * new event, and would wait for the next tick, or for ever. Bounded, so a
 * busy scraper cannot hold the loop.
 */
static void metrics_http_run(struct shd_metrics_http *h)
{
	MHD_UNSIGNED_LONG_LONG timeout;

	for (int i = 0; i < METRICS_HTTP_RUNS; i++) {
		if (MHD_run(h->mhd) != MHD_YES) {
			shd_log_warn("metrics http: MHD_run failed");
			return;
		}
		if (MHD_get_timeout(h->mhd, &timeout) != MHD_YES || timeout > 0)
			return;
	}
}

static void metrics_http_ready(void *arg, int fd, uint32_t revents)
{
	(void)fd;
	(void)revents;
	metrics_http_run(arg);
}

static void metrics_http_tick(void *arg)
{
	struct shd_metrics_http *h = arg;

	metrics_conns_trim(h, shd_now_ns());
	metrics_http_run(h);
}

/* ------------------------------------------------------------------ */
/* Start and stop                                                      */
/* ------------------------------------------------------------------ */

/*
 * A listening TCP socket on host:port. fd, or after printing why -EINVAL (the
 * host does not resolve) or the negative errno of the call that failed.
 */
static int listen_tcp(const char *spec, const char *host, const char *port, int *family)
{
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM,
				  .ai_flags = AI_NUMERICSERV | AI_PASSIVE };
	struct addrinfo *res = NULL;
	int fd = -1, err, one = 1, ret;

	err = getaddrinfo(host, port, &hints, &res);
	if (err) {
		shd_log_error("shardd: --metrics-listen %s: cannot resolve '%s': %s", spec, host,
			      gai_strerror(err));
		return -EINVAL;
	}
	fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
		    res->ai_protocol);
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
	    bind(fd, res->ai_addr, res->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0) {
		ret = -errno;
		shd_log_error("shardd: --metrics-listen %s: cannot listen on %s port %s: %s%s",
			      spec, host, port, strerror(-ret),
			      ret == -EADDRINUSE ? " (pick another port)" : "");
		if (fd >= 0)
			close(fd);
		freeaddrinfo(res);
		return ret;
	}
	*family = res->ai_family;
	freeaddrinfo(res);
	return fd;
}

/* "http://HOST:PORT/metrics" from the bound address (the real port when 0 was asked). */
static void url_of(int fd, char *url, size_t len)
{
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	char host[NI_MAXHOST], port[NI_MAXSERV];

	if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0 ||
	    getnameinfo((struct sockaddr *)&ss, sl, host, sizeof(host), port, sizeof(port),
			NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
		snprintf(url, len, "(unknown address)");
		return;
	}
	snprintf(url, len,
		 ss.ss_family == AF_INET6 ? "http://[%s]:%s/metrics" : "http://%s:%s/metrics", host,
		 port);
}

int shd_metrics_http_start(const char *spec, struct shd_loop *loop, struct shd_metrics_http **out)
{
	char host[NI_MAXHOST], port[16], why[256];
	struct shd_metrics_http *h;
	const union MHD_DaemonInfo *info;
	int fd, family = AF_INET, ret;

	*out = NULL;
	if (shd_metrics_http_parse(spec, host, sizeof(host), port, sizeof(port), why, sizeof(why)) <
	    0) {
		shd_log_error("shardd: --metrics-listen %s", why);
		return -EINVAL;
	}
	h = calloc(1, sizeof(*h));
	if (!h)
		return -ENOMEM;
	h->conns.next = h->conns.prev = &h->conns;
	fd = listen_tcp(spec, host, port, &family);
	if (fd < 0) {
		free(h);
		return fd;
	}
	h->listen_fd = fd;
	url_of(fd, h->url, sizeof(h->url));
	/*
	 * No MHD_USE_INTERNAL_POLLING_THREAD: MHD only runs when the loop calls
	 * MHD_run. No listening socket of its own: metrics_http_accept hands it
	 * each connection. Its limit leaves room for the connections shut down
	 * but not yet closed.
	 */
	h->mhd = MHD_start_daemon(
		MHD_USE_EPOLL | MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET |
			(family == AF_INET6 ? MHD_USE_IPv6 : 0),
		0, NULL, NULL, metrics_request, h, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, h,
		MHD_OPTION_CONNECTION_LIMIT, (unsigned)(2 * METRICS_HTTP_CONNECTIONS),
		MHD_OPTION_NOTIFY_CONNECTION, metrics_conn_notify, h, MHD_OPTION_NOTIFY_COMPLETED,
		metrics_request_done, h, MHD_OPTION_END);
	if (!h->mhd) {
		shd_log_error("shardd: --metrics-listen %s: libmicrohttpd did not start (see "
			      "the line above)",
			      spec);
		close(fd);
		free(h);
		return -EIO;
	}
	info = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_EPOLL_FD);
	if (!info) {
		shd_log_error("shardd: --metrics-listen %s: libmicrohttpd has no epoll fd", spec);
		shd_metrics_http_stop(h, loop);
		return -EIO;
	}
	ret = shd_loop_add_fd(loop, info->epoll_fd, POLLIN, metrics_http_ready, h, &h->fd_ev);
	if (ret == 0)
		ret = shd_loop_add_fd(loop, fd, POLLIN, metrics_http_accept, h, &h->listen_ev);
	if (ret == 0)
		ret = shd_loop_add_timer(loop, METRICS_HTTP_TICK_MS, metrics_http_tick, h,
					 &h->tick_ev);
	if (ret < 0) {
		shd_log_error("shardd: --metrics-listen %s: cannot register with the event loop: "
			      "%s",
			      spec, strerror(-ret));
		shd_metrics_http_stop(h, loop);
		return ret;
	}
	*out = h;
	return 0;
}

const char *shd_metrics_http_url(const struct shd_metrics_http *h)
{
	return h->url;
}

void shd_metrics_http_stop(struct shd_metrics_http *h, struct shd_loop *loop)
{
	if (!h)
		return;
	/* Off the loop first: no callback may run on a stopped daemon. */
	if (h->listen_ev)
		shd_loop_del(loop, h->listen_ev);
	if (h->fd_ev)
		shd_loop_del(loop, h->fd_ev);
	if (h->tick_ev)
		shd_loop_del(loop, h->tick_ev);
	/* Closes every connection. */
	MHD_stop_daemon(h->mhd);
	close(h->listen_fd);
	free(h);
}

/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against a real shardd. Every input from another process
 * is hostile until validated: ring entries written straight into a ring
 * (unknown ops, reserved bits, bad group ids, extreme steps, thousands of
 * random entries), corrupt ring indices, a client that never reaps, broken
 * control framing, bad registrations and admin requests, clients that die
 * mid-message or holding an unsharded copy, connection churn, clients that
 * never read their replies, announce messages they never send, or never
 * say anything. Each bad
 * input must get an error naming the field and the value (or an admin
 * {"ok": false}), exactly one completion per ring entry, and afterwards a
 * well-behaved client on the same daemon must still get a barrier, a nop
 * and a correct unshard. The daemon's log must stay free of sanitizer
 * reports (the SANITIZE=1 build).
 *
 * The raw clients here speak the protocol through proto/ only: HELLO by
 * hand, the ring mapped with shardd_ring_attach, entries pushed with
 * shardd_sq_push, so nothing in libshardd filters what reaches the daemon.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/lib/harness.h"
#include "shardd_ctrl.h"
#include "shardd_ring.h"

#define REPLY_MS      5000
#define COLLECTIVE_S  "5"
#define NEEDLES(...)  ((const char *const[]){ __VA_ARGS__, NULL })

static struct harness_daemon daemon_;

/* ------------------------------------------------------------------ */
/* The daemon                                                          */
/* ------------------------------------------------------------------ */

static int log_contains(const char *needle)
{
	int found;

	pthread_mutex_lock(&daemon_.lock);
	found = daemon_.log && strstr(daemon_.log, needle) != NULL;
	pthread_mutex_unlock(&daemon_.lock);
	return found;
}

/*
 * Wait up to REPLY_MS for `d` to have logged `needle`: a line written
 * before an event the test saw (a close) reaches the log through the
 * harness's drain thread, which signals d->cond on every read.
 */
static void wait_log(struct harness_daemon *d, const char *needle)
{
	struct timespec until;
	int found;

	clock_gettime(CLOCK_MONOTONIC, &until);
	until.tv_sec += REPLY_MS / 1000;
	pthread_mutex_lock(&d->lock);
	while (!(found = d->log && strstr(d->log, needle) != NULL) && !d->eof &&
	       pthread_cond_timedwait(&d->cond, &d->lock, &until) == 0)
		;
	found = d->log && strstr(d->log, needle) != NULL;
	pthread_mutex_unlock(&d->lock);
	if (!found)
		harness_daemon_dump_log(d);
	cr_assert(found, "the daemon did not log '%s'", needle);
}

static void start_daemon(void)
{
	const char *extra[] = { "--collective-timeout", COLLECTIVE_S, NULL };

	/* Closed connections must not kill the test with SIGPIPE. */
	signal(SIGPIPE, SIG_IGN);
	cr_assert_eq(harness_daemon_start(&daemon_, extra), 0, "shardd did not start");
}

/* The harness fails the suite on a sanitizer report in the daemon's log. */
static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(hostile, .init = start_daemon, .fini = stop_daemon, .timeout = 30);

/* The daemon process has not exited (looked at without reaping it). */
static void assert_daemon_alive(void)
{
	siginfo_t si = { 0 };
	const char *report;

	cr_assert_eq(waitid(P_PID, (id_t)daemon_.pid, &si, WEXITED | WNOHANG | WNOWAIT), 0);
	if (si.si_pid != 0)
		harness_daemon_dump_log(&daemon_);
	cr_assert_eq(si.si_pid, 0, "shardd (pid %d) died: code %d status %d", (int)daemon_.pid,
		     si.si_code, si.si_status);
	report = harness_daemon_sanitizer_report(&daemon_);
	if (report)
		harness_daemon_dump_log(&daemon_);
	cr_assert_null(report, "the daemon's log holds a sanitizer report ('%s')", report);
}

/*
 * A well-behaved client of a fresh 1x1 job: nop, barrier, a registered
 * group whose unshard gives back exactly what the rank wrote, reshard.
 */
static void assert_others_served(void)
{
	static int n;
	struct shardd_param_desc p = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 },
	};
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float full[15];
	char job[32];

	assert_daemon_alive();
	snprintf(job, sizeof(job), "bystander-%d", n++);
	for (int i = 0; i < 15; i++)
		full[i] = (float)i * 0.5f - 3.0f;
	cr_assert_eq(harness_attach(&daemon_, job, 0, 1, 1, &c), 0,
		     "a good client cannot attach any more: %s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0, "nop: %s", shardd_last_error());
	cr_assert_eq(shardd_barrier(c, 1), 0, "barrier: %s", shardd_last_error());
	cr_assert_eq(shardd_group_register(c, "w", &p, 1, NULL, &g), 0, "register: %s",
		     shardd_last_error());
	cr_assert_eq(shardd_group_load_full(g, 0, full), 0);
	cr_assert_eq(shardd_unshard(g, 1), 0, "unshard: %s", shardd_last_error());
	cr_assert_eq(memcmp(shardd_group_unsharded(g, 0), full, sizeof(full)), 0,
		     "the unsharded copy differs from what the rank wrote");
	cr_assert_eq(shardd_reshard(g, 1), 0, "reshard: %s", shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	assert_daemon_alive();
}

/* Open descriptors of the daemon process. */
static int daemon_fd_count(void)
{
	char path[64];
	struct dirent *e;
	DIR *d;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)daemon_.pid);
	d = opendir(path);
	cr_assert_not_null(d, "%s: %s", path, strerror(errno));
	while ((e = readdir(d)))
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

/* ------------------------------------------------------------------ */
/* Raw control connections                                             */
/* ------------------------------------------------------------------ */

static int raw_connect(void)
{
	int fd = harness_raw_connect(daemon_.socket);

	cr_assert_geq(fd, 0, "connect %s: %s", daemon_.socket, strerror(-fd));
	return fd;
}

/* One datagram of raw bytes, with `passfd` (>= 0) attached by SCM_RIGHTS. */
static void send_dgram(int sock, const void *buf, size_t len, int passfd)
{
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = { (void *)buf, len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	ssize_t n;

	if (passfd >= 0) {
		struct cmsghdr *c;

		memset(&ctl, 0, sizeof(ctl));
		mh.msg_control = ctl.buf;
		mh.msg_controllen = sizeof(ctl.buf);
		c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &passfd, sizeof(int));
	}
	n = sendmsg(sock, &mh, MSG_NOSIGNAL);
	cr_assert_eq(n, (ssize_t)len, "sendmsg of %zu bytes: %s", len, strerror(errno));
}

/* A header (and `len` payload bytes of `payload`) as one datagram. */
static void send_hdr(int sock, uint32_t magic, uint16_t type, uint16_t flags, uint32_t length,
		     uint32_t seq, const void *payload, size_t len, int passfd)
{
	uint8_t *buf = malloc(sizeof(struct shardd_msg_hdr) + len);
	struct shardd_msg_hdr h = {
		.magic = magic, .type = type, .flags = flags, .length = length, .seq = seq,
	};

	cr_assert_not_null(buf);
	memcpy(buf, &h, sizeof(h));
	if (len)
		memcpy(buf + sizeof(h), payload, len);
	send_dgram(sock, buf, sizeof(h) + len, passfd);
	free(buf);
}

static void send_msg(int sock, uint16_t type, uint32_t seq, const void *payload, uint32_t len)
{
	int ret = shardd_ctrl_send(sock, type, seq, payload, len, NULL, 0);

	cr_assert_eq(ret, 0, "send of message type %u: %s", type, strerror(-ret));
}

static void recv_msg(int sock, struct shardd_ctrl_rx *rx)
{
	int ret;

	memset(rx, 0, sizeof(*rx));
	ret = shardd_ctrl_recv(sock, rx, REPLY_MS);
	if (ret < 0)
		harness_daemon_dump_log(&daemon_);
	cr_assert_eq(ret, 0, "no reply from the daemon: %s", strerror(-ret));
}

/* rx is an ERROR with `code` whose text holds every needle; rx is reset. */
static void check_error(struct shardd_ctrl_rx *rx, uint32_t seq, int32_t code,
			const char *const *needles, const char *what)
{
	struct shardd_error_msg em;
	char text[1100];
	size_t n;

	cr_assert_eq(rx->hdr.type, SHARDD_MSG_ERROR, "%s: reply type %u, want ERROR", what,
		     rx->hdr.type);
	cr_assert_geq(rx->hdr.length, sizeof(em), "%s: ERROR of %u bytes", what, rx->hdr.length);
	memcpy(&em, rx->payload, sizeof(em));
	cr_assert_eq(em.msg_len, rx->hdr.length - sizeof(em), "%s: msg_len %u in %u bytes", what,
		     em.msg_len, rx->hdr.length);
	n = em.msg_len < sizeof(text) - 1 ? em.msg_len : sizeof(text) - 1;
	memcpy(text, rx->payload + sizeof(em), n);
	text[n] = '\0';
	cr_assert_eq(rx->hdr.seq, seq, "%s: ERROR seq %u, want %u (%s)", what, rx->hdr.seq, seq,
		     text);
	cr_assert_eq(em.code, code, "%s: ERROR code %d (%s), want %d (%s); text: %s", what,
		     em.code, shardd_strerror(em.code), code, shardd_strerror(code), text);
	for (int i = 0; needles && needles[i]; i++)
		cr_assert_not_null(strstr(text, needles[i]), "%s: ERROR text '%s' lacks '%s'", what,
				   text, needles[i]);
	shardd_ctrl_rx_reset(rx);
}

static void expect_error(int sock, uint32_t seq, int32_t code, const char *const *needles,
			 const char *what)
{
	struct shardd_ctrl_rx rx;

	recv_msg(sock, &rx);
	check_error(&rx, seq, code, needles, what);
}

static void expect_eof(int sock, const char *what)
{
	int ret = harness_expect_eof(sock, REPLY_MS);

	cr_assert_eq(ret, 0, "%s: the daemon must close the connection (%s)", what,
		     strerror(-ret));
}

/* One admin request on `sock`: the parsed reply (an object), checked for seq. */
static json_t *admin_call(int sock, uint32_t seq, const char *req, size_t len)
{
	struct shardd_ctrl_rx rx;
	json_error_t jerr;
	json_t *r;

	send_msg(sock, SHARDD_MSG_ADMIN, seq, req, (uint32_t)len);
	recv_msg(sock, &rx);
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_ADMIN_REPLY, "admin reply type %u", rx.hdr.type);
	cr_assert_eq(rx.hdr.seq, seq, "admin reply seq %u, want %u", rx.hdr.seq, seq);
	r = json_loadb((const char *)rx.payload, rx.hdr.length, 0, &jerr);
	cr_assert_not_null(r, "admin reply is not JSON: %s", jerr.text);
	cr_assert(json_is_object(r));
	shardd_ctrl_rx_reset(&rx);
	return r;
}

/* An admin reply {"ok": false, "code": code, "error": "...needle..."}. */
static void expect_admin_error(int sock, const char *req, int32_t code, const char *needle)
{
	json_t *r = admin_call(sock, 77, req, strlen(req));
	const char *err = json_string_value(json_object_get(r, "error"));

	cr_assert(json_is_false(json_object_get(r, "ok")), "request %.80s: ok is not false", req);
	cr_assert_not_null(err, "request %.80s: no error text", req);
	cr_assert_eq(json_integer_value(json_object_get(r, "code")), code,
		     "request %.80s: code %lld, want %d; error: %s", req,
		     (long long)json_integer_value(json_object_get(r, "code")), code, err);
	cr_assert_not_null(strstr(err, needle), "request %.80s: error '%s' lacks '%s'", req, err,
			   needle);
	json_decref(r);
}

/* The daemon's count of open connections, through `status`. */
static int64_t admin_connections(int sock)
{
	json_t *r = admin_call(sock, 1, "{\"cmd\":\"status\"}", 16);
	int64_t n = json_integer_value(json_object_get(r, "connections"));

	json_decref(r);
	return n;
}

/*
 * Wait (request after request, no sleeping) until the daemon counts `want`
 * connections: it has processed every EOF of the connections we closed.
 */
static void wait_connections(int sock, int64_t want)
{
	int64_t deadline = harness_now_ms() + REPLY_MS, n;

	while ((n = admin_connections(sock)) != want && harness_now_ms() < deadline)
		sched_yield();
	cr_assert_eq(n, want, "the daemon still counts %lld connections, want %lld",
		     (long long)n, (long long)want);
}

/* ------------------------------------------------------------------ */
/* Raw attached clients: HELLO by hand, the ring mapped directly       */
/* ------------------------------------------------------------------ */

struct raw {
	int fd;                  /* control socket */
	int doorbell;            /* eventfd */
	void *mem;               /* ring mapping */
	size_t size;
	struct shardd_ring ring;
	uint32_t seq;
};

static struct shardd_hello make_hello(const char *job, uint32_t rank, uint32_t replicate,
				      uint32_t shard, uint32_t sq_entries)
{
	struct shardd_hello h = {
		.major = SHARDD_PROTO_MAJOR, .minor = SHARDD_PROTO_MINOR,
		.pid = (uint32_t)getpid(), .rank = rank, .replicate = replicate, .shard = shard,
		.device = SHARDD_HELLO_DEVICE_HOST, .sq_entries = sq_entries,
	};

	snprintf(h.job, sizeof(h.job), "%s", job);
	return h;
}

static void raw_attach(struct raw *r, const char *job, uint32_t rank, uint32_t replicate,
		       uint32_t shard, uint32_t sq_entries)
{
	struct shardd_hello h = make_hello(job, rank, replicate, shard, sq_entries);
	struct shardd_welcome w;
	struct shardd_ctrl_rx rx;
	int ret;

	memset(r, 0, sizeof(*r));
	r->fd = raw_connect();
	r->seq = 1;
	send_msg(r->fd, SHARDD_MSG_HELLO, r->seq, &h, sizeof(h));
	recv_msg(r->fd, &rx);
	if (rx.hdr.type == SHARDD_MSG_ERROR)
		check_error(&rx, 1, 0, NULL, "hello");
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_WELCOME, "hello answered with type %u", rx.hdr.type);
	cr_assert_eq(rx.hdr.length, sizeof(w));
	cr_assert_eq(rx.nfds, 2, "WELCOME carries %d fds", rx.nfds);
	memcpy(&w, rx.payload, sizeof(w));
	r->size = w.ring_size;
	r->mem = mmap(NULL, r->size, PROT_READ | PROT_WRITE, MAP_SHARED, rx.fds[0], 0);
	cr_assert_neq(r->mem, MAP_FAILED, "mmap ring: %s", strerror(errno));
	r->doorbell = rx.fds[1];
	close(rx.fds[0]);
	rx.nfds = 0;
	shardd_ctrl_rx_reset(&rx);
	ret = shardd_ring_attach(&r->ring, r->mem, r->size);
	cr_assert_eq(ret, 0, "ring attach: %d", ret);
}

static void raw_close(struct raw *r)
{
	if (r->mem)
		munmap(r->mem, r->size);
	if (r->doorbell >= 0)
		close(r->doorbell);
	if (r->fd >= 0)
		close(r->fd);
	r->mem = NULL;
	r->doorbell = r->fd = -1;
}

/* Ring the doorbell when the daemon sleeps (the protocol's rule). */
static void raw_kick(struct raw *r)
{
	uint64_t one = 1;

	if (shardd_ring_needs_wakeup(&r->ring))
		cr_assert_eq(write(r->doorbell, &one, sizeof(one)), (ssize_t)sizeof(one));
}

static void raw_push(struct raw *r, const struct shardd_sqe *sqe)
{
	cr_assert_eq(shardd_sq_push(&r->ring, sqe), 0, "SQ full");
	raw_kick(r);
}

static uint32_t ring_load(const uint32_t *p)
{
	return atomic_load_explicit(SHARDD_ATOMIC32(p), memory_order_acquire);
}

/* The daemon closed this client: socket hung up or ring marked dead. */
static int raw_gone(struct raw *r)
{
	struct pollfd p = { .fd = r->fd, .events = POLLRDHUP };

	if (ring_load(&r->ring.hdr->flags) & SHARDD_RING_DEAD)
		return 1;
	return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR));
}

/*
 * Reap one completion within timeout_ms: 0, -ETIMEDOUT, -ECONNRESET (the
 * daemon dropped us) or -EBADMSG. Spins, then futex-waits in short slices.
 */
static int raw_reap(struct raw *r, struct shardd_cqe *cqe, char *msg, int timeout_ms)
{
	int64_t deadline = harness_now_ms() + timeout_ms;

	for (int spin = 0;; spin++) {
		int64_t n = shardd_cq_ready(&r->ring);
		struct timespec slice = { 0, 20 * 1000 * 1000 };
		uint32_t seen;

		if (n < 0)
			return -EBADMSG;
		if (n > 0) {
			shardd_cq_peek(&r->ring, cqe, msg, SHARDD_RING_MSG_SIZE);
			shardd_cq_release(&r->ring);
			/* The daemon may wait for CQ room: our reap must wake it. */
			raw_kick(r);
			return 0;
		}
		if (raw_gone(r))
			return -ECONNRESET;
		if (harness_now_ms() >= deadline)
			return -ETIMEDOUT;
		if (spin < 1000)
			continue;
		seen = ring_load(&r->ring.hdr->cq_tail);
		if (seen == ring_load(&r->ring.hdr->cq_head))
			shardd_cq_wait(&r->ring, seen, &slice);
	}
}

static void raw_reap_ok(struct raw *r, struct shardd_cqe *cqe, char *msg, const char *what)
{
	int ret = raw_reap(r, cqe, msg, REPLY_MS);

	if (ret < 0)
		harness_daemon_dump_log(&daemon_);
	cr_assert_eq(ret, 0, "%s: no completion: %s", what, strerror(-ret));
}

static struct shardd_sqe sqe_of(uint8_t op, uint32_t group, uint64_t step, uint32_t flags,
				uint64_t user_data)
{
	struct shardd_sqe s = {
		.op = op, .group = group, .step = step, .flags = flags, .user_data = user_data,
	};

	return s;
}

/* Push one entry, reap its completion (the only one in flight). */
static struct shardd_cqe raw_op(struct raw *r, struct shardd_sqe sqe, char *msg)
{
	struct shardd_cqe cqe;

	raw_push(r, &sqe);
	raw_reap_ok(r, &cqe, msg, "op");
	cr_assert_eq(cqe.user_data, sqe.user_data, "completion of user_data %llu, want %llu",
		     (unsigned long long)cqe.user_data, (unsigned long long)sqe.user_data);
	return cqe;
}

/* A nop round trip: the daemon is still serving this ring. */
static void raw_nop_ok(struct raw *r, uint64_t user_data)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct shardd_cqe c = raw_op(r, sqe_of(SHARDD_OP_NOP, 0, 0, 0, user_data), msg);

	cr_assert_eq(c.res, 0, "nop: %d %s", c.res, msg);
}

/* ------------------------------------------------------------------ */
/* Registration payloads                                               */
/* ------------------------------------------------------------------ */

static struct shardd_param_spec pspec(const char *name, uint32_t dtype, uint32_t ndim,
				      const uint64_t *shape)
{
	struct shardd_param_spec s = { .dtype = dtype, .ndim = ndim };

	snprintf(s.name, sizeof(s.name), "%s", name);
	for (uint32_t d = 0; d < ndim && d < SHARDD_MAX_DIMS; d++)
		s.shape[d] = shape[d];
	return s;
}

static struct shardd_register_group reg_hdr(const char *name, uint32_t nparams)
{
	struct shardd_register_group h = { .nparams = nparams };

	snprintf(h.name, sizeof(h.name), "%s", name);
	return h;
}

/* hdr then nspecs specs; *len its size. */
static uint8_t *reg_payload(const struct shardd_register_group *hdr,
			    const struct shardd_param_spec *specs, uint32_t nspecs, uint32_t *len)
{
	uint8_t *p;

	*len = (uint32_t)(sizeof(*hdr) + (size_t)nspecs * sizeof(*specs));
	p = malloc(*len);
	cr_assert_not_null(p);
	memcpy(p, hdr, sizeof(*hdr));
	if (nspecs)
		memcpy(p + sizeof(*hdr), specs, (size_t)nspecs * sizeof(*specs));
	return p;
}

static void raw_send_register(struct raw *r, const struct shardd_register_group *hdr,
			      const struct shardd_param_spec *specs, uint32_t nspecs)
{
	uint32_t len;
	uint8_t *p = reg_payload(hdr, specs, nspecs, &len);

	send_msg(r->fd, SHARDD_MSG_REGISTER_GROUP, ++r->seq, p, len);
	free(p);
}

/* The GROUP reply to our last request: its group id (the 4 fds are closed). */
static uint32_t raw_recv_group(struct raw *r)
{
	struct shardd_group_reply g;
	struct shardd_ctrl_rx rx;

	recv_msg(r->fd, &rx);
	if (rx.hdr.type == SHARDD_MSG_ERROR)
		check_error(&rx, r->seq, 0, NULL, "register");
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_GROUP, "reply type %u, want GROUP", rx.hdr.type);
	cr_assert_eq(rx.hdr.seq, r->seq);
	cr_assert_eq(rx.nfds, 4, "GROUP carries %d fds", rx.nfds);
	memcpy(&g, rx.payload, sizeof(g));
	shardd_ctrl_rx_reset(&rx);
	cr_assert_neq(g.group_id, 0);
	return g.group_id;
}

/* A one-param fp32 [4, 2] group: its id. */
static uint32_t raw_register_small(struct raw *r, const char *name)
{
	struct shardd_register_group h = reg_hdr(name, 1);
	struct shardd_param_spec s = pspec("w", SHARDD_DTYPE_FP32, 2, (uint64_t[]){ 4, 2 });

	raw_send_register(r, &h, &s, 1);
	return raw_recv_group(r);
}

/* ------------------------------------------------------------------ */
/* Deterministic randomness                                            */
/* ------------------------------------------------------------------ */

static uint64_t rng_state;

static uint64_t rnd(void)
{
	/* xorshift64*: a fixed seed gives the same entries on every run. */
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545f4914f6cdd1dull;
}

static void rnd_bytes(void *buf, size_t len)
{
	uint8_t *p = buf;

	for (size_t i = 0; i < len; i++)
		p[i] = (uint8_t)(rnd() >> 56);
}

/* ------------------------------------------------------------------ */
/* 1. Ring entries                                                     */
/* ------------------------------------------------------------------ */

struct sqe_case {
	struct shardd_sqe sqe;
	int32_t res;
	const char *needle;
};

Test(hostile, bad_ring_entries_each_get_one_error_completion_naming_field_and_value)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw r;
	uint32_t gid;

	raw_attach(&r, "entries", 0, 1, 1, 64);
	gid = raw_register_small(&r, "g");

	struct sqe_case cases[] = {
		{ sqe_of(0, 0, 0, 0, 0), -SHARDD_E_INVALID, "op 0" },
		{ sqe_of(7, 0, 0, 0, 0), -SHARDD_E_INVALID, "op 7" },
		{ sqe_of(255, gid, 1, 0, 0), -SHARDD_E_INVALID, "op 255" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 0), -SHARDD_E_INVALID, "rsvd0[1] = 0x5" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 0), -SHARDD_E_INVALID, "rsvd1 = 0x77" },
		{ sqe_of(SHARDD_OP_BARRIER, 0, 0, 0, 0), -SHARDD_E_INVALID, "rsvd2[3] = 0xdead" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0x10, 0), -SHARDD_E_INVALID, "flags = 0x10" },
		{ sqe_of(SHARDD_OP_BARRIER, 0, 1, 0x1, 0), -SHARDD_E_INVALID, "flags = 0x1" },
		{ sqe_of(SHARDD_OP_NOP, 3, 0, 0, 0), -SHARDD_E_INVALID, "group = 3" },
		{ sqe_of(SHARDD_OP_BARRIER, UINT32_MAX, 1, 0, 0), -SHARDD_E_INVALID,
		  "group = 4294967295" },
		{ sqe_of(SHARDD_OP_UNSHARD, gid, 1, 0x1, 0), -SHARDD_E_INVALID, "flags = 0x1" },
		{ sqe_of(SHARDD_OP_REDUCE, gid, 1, 0x6, 0), -SHARDD_E_INVALID, "unknown bits 0x6" },
		{ sqe_of(SHARDD_OP_RESHARD, gid, 1, 0x80000000u, 0), -SHARDD_E_INVALID,
		  "flags = 0x80000000" },
		{ sqe_of(SHARDD_OP_ZERO_GRAD, gid, 0, 0, 0), -SHARDD_E_INVALID, "rsvd2[0] = 0x1" },
		{ sqe_of(SHARDD_OP_UNSHARD, 0, 1, 0, 0), -SHARDD_E_NOGROUP, "group id 0" },
		{ sqe_of(SHARDD_OP_REDUCE, 999, 1, 0, 0), -SHARDD_E_NOGROUP, "group id 999" },
		{ sqe_of(SHARDD_OP_ZERO_GRAD, UINT32_MAX, 0, 0, 0), -SHARDD_E_NOGROUP,
		  "group id 4294967295" },
		{ sqe_of(SHARDD_OP_RESHARD, gid + 1, 0, 0, 0), -SHARDD_E_NOGROUP, "group id" },
		{ sqe_of(SHARDD_OP_RESHARD, gid, 0, 0, 0), -SHARDD_E_STATE, "no unsharded copy" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 0), -SHARDD_E_INVALID, "sqe.fence = 0x3, but" },
		{ sqe_of(SHARDD_OP_UNSHARD, gid, 1, 0, 0), -SHARDD_E_INVALID, "unknown bits 0x80" },
	};
	size_t n = sizeof(cases) / sizeof(cases[0]);
	uint8_t seen[64] = { 0 };

	cases[3].sqe.rsvd0[1] = 0x5;
	cases[4].sqe.rsvd1 = 0x77;
	cases[5].sqe.rsvd2[3] = 0xdead;
	cases[13].sqe.rsvd2[0] = 0x1;
	cases[19].sqe.fence = SHARDD_FENCE_WAIT | SHARDD_FENCE_SIGNAL; /* no STREAM sent */
	cases[20].sqe.fence = 0x81;
	/* All at once: a batch of bad entries, completions matched by user_data. */
	for (size_t i = 0; i < n; i++) {
		cases[i].sqe.user_data = 1000 + i;
		cr_assert_eq(shardd_sq_push(&r.ring, &cases[i].sqe), 0);
	}
	raw_kick(&r);
	for (size_t k = 0; k < n; k++) {
		struct shardd_cqe c;
		size_t i;

		raw_reap_ok(&r, &c, msg, "bad entry");
		i = (size_t)(c.user_data - 1000);
		cr_assert_lt(i, n, "completion with unknown user_data %llu",
			     (unsigned long long)c.user_data);
		cr_assert_eq(seen[i]++, 0, "entry %zu completed twice", i);
		cr_assert_eq(c.op, cases[i].sqe.op, "entry %zu: op not echoed", i);
		cr_assert_eq(c.step, cases[i].sqe.step, "entry %zu: step not echoed", i);
		cr_assert_eq(c.res, cases[i].res, "entry %zu: res %d (%s), want %d; text '%s'", i,
			     c.res, shardd_strerror(c.res), cases[i].res, msg);
		cr_assert_eq(c.has_msg, 1, "entry %zu: error without text", i);
		cr_assert_not_null(strstr(msg, cases[i].needle), "entry %zu: text '%s' lacks '%s'",
				   i, msg, cases[i].needle);
	}
	cr_assert_eq(shardd_cq_ready(&r.ring), 0, "more completions than entries");
	raw_nop_ok(&r, 1);
	raw_close(&r);
	assert_others_served();
}

Test(hostile, extreme_step_values_round_trip_and_mismatches_name_both_steps)
{
	char msg[SHARDD_RING_MSG_SIZE], max[32];
	struct raw a, b;
	struct shardd_cqe c;
	uint32_t gid;
	uint64_t steps[] = { 0, UINT64_MAX, 1, UINT64_MAX - 1 };

	raw_attach(&a, "steps", 0, 1, 1, 0);
	gid = raw_register_small(&a, "g");
	for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
		uint8_t ops[] = { SHARDD_OP_BARRIER, SHARDD_OP_UNSHARD, SHARDD_OP_RESHARD,
				  SHARDD_OP_REDUCE, SHARDD_OP_ZERO_GRAD };

		for (size_t k = 0; k < sizeof(ops); k++) {
			uint32_t group = ops[k] == SHARDD_OP_BARRIER ? 0 : gid;

			c = raw_op(&a, sqe_of(ops[k], group, steps[i], 0, i * 10 + k), msg);
			cr_assert_eq(c.res, 0, "%s step %llu: %s", shardd_strerror(c.res),
				     (unsigned long long)steps[i], msg);
			cr_assert_eq(c.step, steps[i], "step not echoed exactly");
		}
	}
	raw_close(&a);

	/* Two ranks that disagree on a step at the extremes: both fail, both steps named. */
	snprintf(max, sizeof(max), "%llu", (unsigned long long)UINT64_MAX);
	raw_attach(&a, "steps2", 0, 1, 2, 0);
	raw_attach(&b, "steps2", 1, 1, 2, 0);
	raw_push(&a, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_BARRIER, 0, 0, 0, 1) });
	raw_nop_ok(&a, 2); /* the barrier was taken before b's arrives */
	c = raw_op(&b, sqe_of(SHARDD_OP_BARRIER, 0, UINT64_MAX, 0, 3), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "barrier mismatch: %d %s", c.res, msg);
	cr_assert(strstr(msg, max) && strstr(msg, "barrier 0"), "text '%s' lacks both steps", msg);
	raw_reap_ok(&a, &c, msg, "barrier of rank 0");
	cr_assert_eq(c.user_data, 1);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "rank 0's barrier: %d %s", c.res, msg);

	raw_send_register(&a, (struct shardd_register_group[]){ reg_hdr("g", 1) },
			  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_BF16, 1,
							      (uint64_t[]){ 6 }) }, 1);
	raw_send_register(&b, (struct shardd_register_group[]){ reg_hdr("g", 1) },
			  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_BF16, 1,
							      (uint64_t[]){ 6 }) }, 1);
	gid = raw_recv_group(&a);
	cr_assert_eq(raw_recv_group(&b), gid);
	raw_push(&a, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, gid, UINT64_MAX, 0, 4) });
	raw_nop_ok(&a, 5);
	c = raw_op(&b, sqe_of(SHARDD_OP_UNSHARD, gid, 0, 0, 6), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "unshard mismatch: %d %s", c.res, msg);
	cr_assert(strstr(msg, max) && strstr(msg, "step 0"), "text '%s' lacks both steps", msg);
	raw_reap_ok(&a, &c, msg, "unshard of rank 0");
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH);
	raw_close(&a);
	raw_close(&b);
	assert_others_served();
}

Test(hostile, all_reduce_flag_on_a_1xW_mesh_is_accepted_alike_and_mismatches_fail_both)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw a, b;
	struct shardd_cqe c;
	uint32_t gid;
	struct shardd_register_group h = reg_hdr("g", 1);
	struct shardd_param_spec s = pspec("w", SHARDD_DTYPE_FP32, 2, (uint64_t[]){ 3, 4 });

	raw_attach(&a, "hsdp-flags", 0, 1, 2, 0);
	raw_attach(&b, "hsdp-flags", 1, 1, 2, 0);
	raw_send_register(&a, &h, &s, 1);
	raw_send_register(&b, &h, &s, 1);
	gid = raw_recv_group(&a);
	cr_assert_eq(raw_recv_group(&b), gid);

	/* No replicate dim: the all-reduce is across one replica; both ranks asking is fine. */
	raw_push(&a, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_REDUCE, gid, 1,
						     SHARDD_REDUCE_ALL_REDUCE, 1) });
	c = raw_op(&b, sqe_of(SHARDD_OP_REDUCE, gid, 1, SHARDD_REDUCE_ALL_REDUCE, 2), msg);
	cr_assert_eq(c.res, 0, "rank 1 reduce with ALL_REDUCE: %s", msg);
	raw_reap_ok(&a, &c, msg, "rank 0 reduce");
	cr_assert_eq(c.res, 0, "rank 0 reduce with ALL_REDUCE: %s", msg);

	/* Ranks of the shard group disagreeing on the flag: both fail, both flags named. */
	raw_push(&a, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_REDUCE, gid, 2,
						     SHARDD_REDUCE_ALL_REDUCE, 3) });
	raw_nop_ok(&a, 4);
	c = raw_op(&b, sqe_of(SHARDD_OP_REDUCE, gid, 2, 0, 5), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "flag mismatch: %d %s", c.res, msg);
	cr_assert(strstr(msg, "flags 0x1") && strstr(msg, "flags 0x0"), "text '%s'", msg);
	raw_reap_ok(&a, &c, msg, "rank 0 reduce");
	cr_assert_eq(c.user_data, 3);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "rank 0: %d %s", c.res, msg);

	/* A flag bit HSDP does not define. */
	c = raw_op(&a, sqe_of(SHARDD_OP_REDUCE, gid, 3, 0x2, 6), msg);
	cr_assert_eq(c.res, -SHARDD_E_INVALID);
	cr_assert_not_null(strstr(msg, "flags = 0x2"), "text '%s'", msg);
	raw_close(&a);
	raw_close(&b);
	assert_others_served();
}

#define RANDOM_ENTRIES 20000u

Test(hostile, thousands_of_random_entries_each_get_exactly_one_completion)
{
	struct shardd_sqe *sent = calloc(RANDOM_ENTRIES, sizeof(*sent));
	uint8_t *seen = calloc(RANDOM_ENTRIES, 1);
	char msg[SHARDD_RING_MSG_SIZE];
	uint32_t submitted = 0, done = 0, failed = 0, gid, gid2;
	int64_t deadline = harness_now_ms() + 20000;
	struct raw r;

	cr_assert(sent && seen);
	raw_attach(&r, "random", 0, 1, 1, 256);
	gid = raw_register_small(&r, "a");
	gid2 = raw_register_small(&r, "b");
	rng_state = 0x5eed5eed12345678ull;
	while (done < RANDOM_ENTRIES) {
		struct shardd_cqe c;
		int ret;

		while (submitted < RANDOM_ENTRIES) {
			struct shardd_sqe *s = &sent[submitted];
			uint32_t groups[] = { 0, gid, gid2, gid2 + 1, (uint32_t)rnd() };

			if (rnd() % 4 == 0) {
				/* Pure noise. */
				rnd_bytes(s, sizeof(*s));
			} else {
				/* Plausible entries: real ops and groups, odd steps and flags. */
				memset(s, 0, sizeof(*s));
				s->op = (uint8_t)(rnd() % 9);
				s->group = groups[rnd() % 5];
				s->step = rnd() % 3 ? rnd() % 8 : rnd();
				s->flags = rnd() % 4 ? 0 : rnd() % 2 ? 1 : (uint32_t)rnd();
				if (rnd() % 16 == 0)
					s->rsvd2[rnd() % 4] = 1ull << (rnd() % 64);
			}
			s->user_data = submitted;
			if (shardd_sq_push(&r.ring, s) == -EAGAIN)
				break;
			submitted++;
		}
		raw_kick(&r);
		ret = raw_reap(&r, &c, msg, (int)(deadline - harness_now_ms()));
		if (ret < 0)
			harness_daemon_dump_log(&daemon_);
		cr_assert_eq(ret, 0, "after %u of %u completions: %s", done, RANDOM_ENTRIES,
			     strerror(-ret));
		cr_assert_lt(c.user_data, submitted, "completion of an entry never submitted: %llu",
			     (unsigned long long)c.user_data);
		cr_assert_eq(seen[c.user_data]++, 0, "entry %llu completed twice",
			     (unsigned long long)c.user_data);
		cr_assert_eq(c.op, sent[c.user_data].op, "entry %llu: op not echoed",
			     (unsigned long long)c.user_data);
		cr_assert_eq(c.step, sent[c.user_data].step);
		cr_assert_eq(c.group, sent[c.user_data].group);
		if (c.res < 0) {
			failed++;
			cr_assert(c.has_msg && msg[0], "entry %llu failed with %d but no text",
				  (unsigned long long)c.user_data, c.res);
		}
		done++;
	}
	cr_assert_eq(shardd_cq_ready(&r.ring), 0, "more completions than entries");
	/* Most are garbage; the plausible ones include some that succeed. */
	cr_assert(failed > RANDOM_ENTRIES / 4 && failed < RANDOM_ENTRIES,
		  "%u of %u random entries failed", failed, RANDOM_ENTRIES);
	raw_nop_ok(&r, 1);
	raw_close(&r);
	free(sent);
	free(seen);
	assert_others_served();
}

/* A client whose ring indices went bad is dropped, with a logged error. */
static void expect_dropped_for_corrupt_ring(struct raw *r, const char *which)
{
	char needle[64];

	expect_eof(r->fd, which);
	cr_assert(ring_load(&r->ring.hdr->flags) & SHARDD_RING_DEAD, "%s: ring not marked DEAD",
		  which);
	snprintf(needle, sizeof(needle), "ring %s index is corrupt", which);
	wait_log(&daemon_, needle);
}

Test(hostile, corrupt_ring_indices_drop_only_that_client)
{
	struct raw bad, bystander;
	uint32_t head;

	raw_attach(&bystander, "innocent", 0, 1, 1, 0);

	/* A tail more than one ring ahead of the head. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	head = ring_load(&bad.ring.hdr->sq_head);
	atomic_store_explicit(SHARDD_ATOMIC32(&bad.ring.hdr->sq_tail), head + 16 + 5,
			      memory_order_release);
	cr_assert_eq(write(bad.doorbell, &(uint64_t){ 1 }, 8), 8);
	expect_dropped_for_corrupt_ring(&bad, "SQ tail");
	raw_close(&bad);
	raw_nop_ok(&bystander, 1);

	/* The same, with the capacity in the shared header rewritten to hide it. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	head = ring_load(&bad.ring.hdr->sq_head);
	bad.ring.hdr->sq_entries = UINT32_MAX;
	bad.ring.hdr->cq_entries = UINT32_MAX;
	atomic_store_explicit(SHARDD_ATOMIC32(&bad.ring.hdr->sq_tail), head + 100000,
			      memory_order_release);
	cr_assert_eq(write(bad.doorbell, &(uint64_t){ 1 }, 8), 8);
	expect_dropped_for_corrupt_ring(&bad, "SQ tail");
	raw_close(&bad);
	raw_nop_ok(&bystander, 2);

	/* A CQ head run past the CQ tail, then a submission. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	raw_nop_ok(&bad, 1);
	atomic_store_explicit(SHARDD_ATOMIC32(&bad.ring.hdr->cq_head),
			      ring_load(&bad.ring.hdr->cq_tail) + 7, memory_order_release);
	raw_push(&bad, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 2) });
	cr_assert_eq(write(bad.doorbell, &(uint64_t){ 1 }, 8), 8);
	expect_dropped_for_corrupt_ring(&bad, "CQ head");
	raw_close(&bad);

	/* The rank is free again, and everyone else was never disturbed. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	raw_nop_ok(&bad, 3);
	raw_close(&bad);
	raw_nop_ok(&bystander, 3);
	raw_close(&bystander);
	assert_others_served();
}

Test(hostile, client_that_never_reaps_stalls_only_itself_and_its_cq_never_overflows)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw r;
	uint32_t cq_cap, sq_cap, pushed = 0, reaped = 0;
	uint8_t seen[64] = { 0 };
	int64_t deadline;

	raw_attach(&r, "no-reap", 0, 1, 1, 8);
	sq_cap = r.ring.sq_mask + 1;
	cq_cap = r.ring.cq_mask + 1;
	cr_assert_eq(sq_cap, 8);
	cr_assert_eq(cq_cap, 16);

	/* Keep the SQ full until the daemon stops taking: every CQ slot is used. */
	deadline = harness_now_ms() + REPLY_MS;
	while (pushed < cq_cap + sq_cap && harness_now_ms() < deadline) {
		struct shardd_sqe s = sqe_of(SHARDD_OP_NOP, 0, 0, 0, pushed);

		if (shardd_sq_push(&r.ring, &s) == 0)
			pushed++;
		raw_kick(&r);
	}
	cr_assert_eq(pushed, cq_cap + sq_cap, "the daemon took only %u entries",
		     pushed - sq_cap);
	deadline = harness_now_ms() + REPLY_MS;
	while (shardd_cq_ready(&r.ring) < cq_cap && harness_now_ms() < deadline)
		sched_yield();
	cr_assert_eq(shardd_cq_ready(&r.ring), cq_cap);

	/* The daemon serves others meanwhile; that proves its loop turned many times. */
	assert_others_served();
	cr_assert_eq(shardd_cq_ready(&r.ring), cq_cap, "the CQ overflowed its %u slots", cq_cap);
	cr_assert_eq(ring_load(&r.ring.hdr->sq_tail) - ring_load(&r.ring.hdr->sq_head), sq_cap,
		     "the daemon took entries it had no CQ room for");

	/* Reaping lets the stalled entries through, each completed once. */
	while (reaped < pushed) {
		struct shardd_cqe c;

		raw_reap_ok(&r, &c, msg, "stalled nops");
		cr_assert_lt(c.user_data, pushed);
		cr_assert_eq(seen[c.user_data]++, 0, "nop %llu completed twice",
			     (unsigned long long)c.user_data);
		cr_assert_eq(c.res, 0);
		reaped++;
	}
	raw_nop_ok(&r, 100);
	raw_close(&r);
}

/*
 * Three ranks; rank 1 corrupts its CQ while it waits in an unshard, and
 * rank 2's mismatching step fails that unshard. Completing rank 1's op
 * drops rank 1, whose departure fails the same collective again: rank 0
 * must still get each of its completions exactly once.
 */
Test(hostile, collective_failing_while_a_member_is_dropped_completes_each_op_once)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw r[3];
	struct shardd_cqe c;
	uint32_t g1, g2;
	int got101 = 0, got104 = 0;

	for (uint32_t k = 0; k < 3; k++)
		raw_attach(&r[k], "trio", k, 1, 3, 0);
	for (uint32_t k = 0; k < 3; k++)
		raw_send_register(&r[k], (struct shardd_register_group[]){ reg_hdr("g1", 1) },
				  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_FP32, 1,
								      (uint64_t[]){ 6 }) }, 1);
	g1 = raw_recv_group(&r[0]);
	cr_assert_eq(raw_recv_group(&r[1]), g1);
	cr_assert_eq(raw_recv_group(&r[2]), g1);
	for (uint32_t k = 0; k < 3; k++)
		raw_send_register(&r[k], (struct shardd_register_group[]){ reg_hdr("g2", 1) },
				  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_FP32, 1,
								      (uint64_t[]){ 6 }) }, 1);
	g2 = raw_recv_group(&r[0]);
	cr_assert_eq(raw_recv_group(&r[1]), g2);
	cr_assert_eq(raw_recv_group(&r[2]), g2);

	/* Rank 0 waits in two collectives; rank 1 in one. Nops prove they were taken. */
	raw_push(&r[0], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g1, 1, 0, 101) });
	raw_push(&r[0], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g2, 1, 0, 104) });
	raw_nop_ok(&r[0], 102);
	raw_push(&r[1], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g1, 1, 0, 201) });
	raw_nop_ok(&r[1], 202);
	atomic_store_explicit(SHARDD_ATOMIC32(&r[1].ring.hdr->cq_head),
			      ring_load(&r[1].ring.hdr->cq_tail) + 7, memory_order_release);

	c = raw_op(&r[2], sqe_of(SHARDD_OP_UNSHARD, g1, 2, 0, 301), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "rank 2: %d %s", c.res, msg);
	expect_eof(r[1].fd, "rank 1 with a corrupt CQ");

	/* Rank 0: its g1 unshard failed once, its g2 unshard failed once (rank 1 left). */
	for (int k = 0; k < 2; k++) {
		raw_reap_ok(&r[0], &c, msg, "rank 0");
		cr_assert(c.user_data == 101 || c.user_data == 104, "unexpected completion %llu (%s)",
			  (unsigned long long)c.user_data, msg);
		cr_assert_lt(c.res, 0, "completion %llu succeeded", (unsigned long long)c.user_data);
		/* Dropped after the push that found it broken, rank 1 is still named as gone. */
		if (c.user_data == 104) {
			cr_assert_eq(c.res, -SHARDD_E_PEER_DIED, "unshard(g2): %d %s", c.res, msg);
			cr_assert(strstr(msg, "rank 1 left"), "unshard(g2) does not name rank 1: %s",
				  msg);
		}
		got101 += c.user_data == 101;
		got104 += c.user_data == 104;
	}
	cr_assert_eq(got101, 1, "unshard(g1) completed %d times", got101);
	cr_assert_eq(got104, 1, "unshard(g2) completed %d times", got104);
	raw_nop_ok(&r[0], 103);
	cr_assert_eq(shardd_cq_ready(&r[0].ring), 0, "rank 0 got an extra completion");
	cr_assert(!log_contains("without a reserved CQ slot"),
		  "the daemon completed an op twice (see its log)");
	for (int k = 0; k < 3; k++)
		raw_close(&r[k]);
	assert_others_served();
}

/* ------------------------------------------------------------------ */
/* 2. Control messages                                                 */
/* ------------------------------------------------------------------ */

Test(hostile, framing_errors_before_hello_are_named_and_close_only_that_connection)
{
	struct shardd_hello h = make_hello("pre", 0, 1, 1, 0);
	uint8_t big[70000] = { 0 };
	int pipefd[2], fd;

	cr_assert_eq(pipe(pipefd), 0);

	fd = raw_connect();
	send_hdr(fd, 0x12345678u, SHARDD_MSG_HELLO, 0, sizeof(h), 9, &h, sizeof(h), -1);
	expect_error(fd, 9, -SHARDD_E_MAGIC, NEEDLES("0x12345678"), "wrong magic");
	expect_eof(fd, "wrong magic");
	close(fd);

	fd = raw_connect();
	send_dgram(fd, "SHRD\1", 5, -1);
	expect_error(fd, 0, -SHARDD_E_MALFORMED, NEEDLES("5 bytes"), "truncated header");
	expect_eof(fd, "truncated header");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, 2u << 20, 3, &h, sizeof(h), -1);
	expect_error(fd, 3, -SHARDD_E_MALFORMED, NEEDLES("hdr.length = 2097152"),
		     "over the handshake limit");
	expect_eof(fd, "over the handshake limit");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, UINT32_MAX, 4, NULL, 0, -1);
	expect_error(fd, 4, -SHARDD_E_MALFORMED, NEEDLES("4294967295"), "length 2^32-1");
	expect_eof(fd, "length 2^32-1");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, sizeof(h), 5, &h, sizeof(h), pipefd[0]);
	expect_error(fd, 5, -SHARDD_E_MALFORMED, NEEDLES("file descriptor"), "fd on a HELLO");
	expect_eof(fd, "fd on a HELLO");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0x8, sizeof(h), 6, &h, sizeof(h), -1);
	expect_error(fd, 6, -SHARDD_E_MALFORMED, NEEDLES("flags = 0x8"), "header flags");
	expect_eof(fd, "header flags");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, 77, 0, 0, 7, NULL, 0, -1);
	expect_error(fd, 7, -SHARDD_E_STATE, NEEDLES("type 77"), "unknown type before HELLO");
	expect_eof(fd, "unknown type before HELLO");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, 0, 8, NULL, 0, -1);
	expect_error(fd, 8, -SHARDD_E_STATE, NEEDLES("type 5"), "REGISTER_GROUP before HELLO");
	expect_eof(fd, "REGISTER_GROUP before HELLO");
	close(fd);

	fd = raw_connect();
	send_dgram(fd, big, sizeof(big), -1);
	expect_error(fd, 0, -SHARDD_E_MALFORMED, NEEDLES("larger than"), "oversized datagram");
	expect_eof(fd, "oversized datagram");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 4, 10, big, 10, -1);
	expect_error(fd, 10, -SHARDD_E_MALFORMED, NEEDLES("more payload"), "overlong payload");
	expect_eof(fd, "overlong payload");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 100, 11, big, 10, -1);
	send_dgram(fd, big, 10, pipefd[1]);
	expect_error(fd, 11, -SHARDD_E_MALFORMED, NEEDLES("continuation"), "fd on a continuation");
	expect_eof(fd, "fd on a continuation");
	close(fd);

	/* Half a message carrying the sender's own socket: refused at once, not kept. */
	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 100, 13, big, 10, fd);
	expect_error(fd, 13, -SHARDD_E_MALFORMED, NEEDLES("1 file descriptor"),
		     "fd on half a message");
	expect_eof(fd, "fd on half a message");
	close(fd);

	/* A message announcing more than ever comes, then the sender hangs up. */
	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, 1000, 12, &h, sizeof(h), -1);
	close(fd);

	close(pipefd[0]);
	close(pipefd[1]);
	assert_others_served();
}

Test(hostile, bad_requests_after_hello_get_errors_and_the_session_goes_on)
{
	struct shardd_hello h = make_hello("post", 0, 1, 1, 0);
	struct shardd_open_group og;
	struct raw r;

	raw_attach(&r, "post", 0, 1, 1, 0);
	raw_register_small(&r, "real");

	send_hdr(r.fd, SHARDD_MAGIC, 77, 0, 0, 20, NULL, 0, -1);
	expect_error(r.fd, 20, -SHARDD_E_INVALID, NEEDLES("type 77"), "unknown type");
	send_msg(r.fd, SHARDD_MSG_WELCOME, 21, &h, 64);
	expect_error(r.fd, 21, -SHARDD_E_INVALID, NEEDLES("type 2"), "WELCOME from a client");
	send_msg(r.fd, SHARDD_MSG_HELLO, 22, &h, sizeof(h));
	expect_error(r.fd, 22, -SHARDD_E_STATE, NEEDLES("already attached", "'post'"),
		     "second HELLO");

	memset(og.name, 'x', sizeof(og.name));
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 23, &og, sizeof(og));
	expect_error(r.fd, 23, -SHARDD_E_INVALID, NEEDLES("NUL-terminated"), "open: no NUL");
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 24, &og, 10);
	expect_error(r.fd, 24, -SHARDD_E_MALFORMED, NEEDLES("10 bytes", "64"), "open: short");
	memset(&og, 0, sizeof(og));
	memcpy(og.name, "no\x01such\xff", 9);
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 25, &og, sizeof(og));
	expect_error(r.fd, 25, -SHARDD_E_NOGROUP, NEEDLES("no group", "'real'"),
		     "open: unknown name lists the groups");
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 26, NULL, 0);
	expect_error(r.fd, 26, -SHARDD_E_MALFORMED, NEEDLES("0 bytes"), "open: empty");
	send_msg(r.fd, SHARDD_MSG_STREAM, 27, NULL, 0);
	expect_error(r.fd, 27, -ENOTSUP, NEEDLES("--backend cuda", "--backend host"),
		     "stream fences on the host backend");

	/* After all that the session still serves ring and control requests. */
	raw_nop_ok(&r, 1);
	snprintf(og.name, sizeof(og.name), "real");
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, ++r.seq, &og, sizeof(og));
	raw_recv_group(&r);
	raw_close(&r);
	assert_others_served();
}

/* Attach, send something fatal, expect an ERROR and the close; the rank is free again. */
static void expect_fatal_after_hello(void (*send_bad)(int fd), uint32_t seq, int32_t code,
				     const char *const *needles, const char *what)
{
	struct raw r;

	raw_attach(&r, "fatal", 0, 1, 1, 0);
	send_bad(r.fd);
	if (needles)
		expect_error(r.fd, seq, code, needles, what);
	expect_eof(r.fd, what);
	raw_close(&r);
	raw_attach(&r, "fatal", 0, 1, 1, 0);
	raw_nop_ok(&r, 1);
	raw_close(&r);
}

static void bad_magic(int fd)
{
	send_hdr(fd, 0xdeadbeefu, SHARDD_MSG_ADMIN, 0, 0, 30, NULL, 0, -1);
}

static void over_ctrl_max(int fd)
{
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, SHARDD_CTRL_MAX + 1, 31, NULL, 0,
		 -1);
}

static void fd_on_register(int fd)
{
	struct shardd_register_group h = reg_hdr("g", 0);
	int null = open("/dev/null", O_RDONLY | O_CLOEXEC);

	cr_assert_geq(null, 0);
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, sizeof(h), 32, &h, sizeof(h),
		 null);
	close(null);
}

static void half_then_eof(int fd)
{
	struct shardd_register_group h = reg_hdr("g", 1);

	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, 5000, 33, &h, sizeof(h), -1);
	shutdown(fd, SHUT_WR);
}

Test(hostile, fatal_framing_errors_after_hello_close_that_client_only)
{
	expect_fatal_after_hello(bad_magic, 30, -SHARDD_E_MAGIC, NEEDLES("0xdeadbeef"),
				 "wrong magic after HELLO");
	expect_fatal_after_hello(over_ctrl_max, 31, -SHARDD_E_MALFORMED, NEEDLES("67108865"),
				 "length over SHARDD_CTRL_MAX");
	expect_fatal_after_hello(fd_on_register, 32, -SHARDD_E_MALFORMED,
				 NEEDLES("file descriptor"), "fd on REGISTER_GROUP");
	expect_fatal_after_hello(half_then_eof, 0, 0, NULL, "half a message, then EOF");
	assert_others_served();
}

/* One REGISTER_GROUP that must fail with code and needles; the session goes on. */
static void expect_register_error(struct raw *r, const void *payload, uint32_t len, int32_t code,
				  const char *const *needles, const char *what)
{
	send_msg(r->fd, SHARDD_MSG_REGISTER_GROUP, ++r->seq, payload, len);
	expect_error(r->fd, r->seq, code, needles, what);
}

static void expect_spec_error(struct raw *r, const struct shardd_register_group *h,
			      const struct shardd_param_spec *specs, uint32_t n, int32_t code,
			      const char *const *needles, const char *what)
{
	uint32_t len;
	uint8_t *p = reg_payload(h, specs, n, &len);

	expect_register_error(r, p, len, code, needles, what);
	free(p);
}

Test(hostile, bad_registrations_are_refused_naming_the_field_and_value)
{
	struct shardd_param_spec ok = pspec("w", SHARDD_DTYPE_FP32, 2, (uint64_t[]){ 4, 3 });
	struct shardd_param_spec two[2], s, *many;
	struct shardd_register_group h;
	struct raw r;
	uint32_t len;
	uint8_t *p;

	raw_attach(&r, "reg", 0, 1, 1, 0);

	h = reg_hdr("g", 0);
	expect_spec_error(&r, &h, NULL, 0, -SHARDD_E_INVALID, NEEDLES("nparams = 0"), "nparams 0");
	h = reg_hdr("g", UINT32_MAX);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("nparams = 4294967295"),
			  "nparams huge");
	h = reg_hdr("g", SHARDD_MAX_PARAMS);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_MALFORMED, NEEDLES("nparams = 65536"),
			  "nparams 65536 with one spec");
	h = reg_hdr("g", 2);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_MALFORMED, NEEDLES("248 bytes", "408"),
			  "nparams 2 with one spec");
	expect_register_error(&r, "short", 5, -SHARDD_E_MALFORMED, NEEDLES("5 bytes"),
			      "payload shorter than the header");
	h = reg_hdr("g", 1);
	memset(h.name, 'G', sizeof(h.name));
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("name", "NUL"),
			  "group name without NUL");
	h = reg_hdr("", 1);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("empty"), "empty group name");
	h = reg_hdr("g", 1);
	h.param_dtype = 9;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("param_dtype = 9"),
			  "param_dtype 9");
	h = reg_hdr("g", 1);
	h.reduce_dtype = 77;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("reduce_dtype = 77"),
			  "reduce_dtype 77");
	h = reg_hdr("g", 1);
	h.rsvd = 3;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("rsvd = 3"), "rsvd");
	h = reg_hdr("g", 1);
	h.init = 5;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("init = 5"), "init");

	h = reg_hdr("g", 1);
	s = ok;
	memset(s.name, 'p', sizeof(s.name));
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("param #0", "NUL"),
			  "param name without NUL");
	s = ok;
	s.ndim = 9;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("ndim = 9"), "ndim 9");
	s = ok;
	s.shard_dim = 2;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shard_dim = 2"),
			  "shard_dim == ndim");
	s = ok;
	s.shard_dim = UINT32_MAX;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shard_dim = 4294967295"),
			  "shard_dim huge");
	s = ok;
	s.dtype = 77;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("dtype = 77"), "dtype 77");
	s = ok;
	s.dtype = SHARDD_DTYPE_NONE;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("dtype = 0"), "dtype none");
	s = ok;
	s.flags = 0x40;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("flags = 0x40"), "param flags");
	s = ok;
	s.shape[5] = 7;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shape[5] = 7"),
			  "shape past ndim");
	s = pspec("w", SHARDD_DTYPE_FP32, 3, (uint64_t[]){ 1ull << 32, 1ull << 32, 4 });
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shape[1] = 0x100000000"),
			  "shape product over 2^64");
	s = pspec("w", SHARDD_DTYPE_FP16, 1, (uint64_t[]){ UINT64_MAX });
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("0xffffffffffffffff"),
			  "shape 2^64-1");
	s = pspec("w", SHARDD_DTYPE_BF16, 2, (uint64_t[]){ 1ull << 20, 1ull << 20 });
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("overflows"),
			  "a 2 TiB param");
	h = reg_hdr("g", 2);
	two[0] = ok;
	two[1] = ok;
	expect_spec_error(&r, &h, two, 2, -SHARDD_E_INVALID,
			  NEEDLES("'w'", "params #0 and #1"), "duplicate param names");

	/* A large registration over many datagrams whose last param is bad. */
	many = calloc(2000, sizeof(*many));
	cr_assert_not_null(many);
	for (uint32_t i = 0; i < 2000; i++) {
		char name[32];

		snprintf(name, sizeof(name), "layer.%u.w", i);
		many[i] = pspec(name, SHARDD_DTYPE_BF16, 1, (uint64_t[]){ 3 + i % 5 });
	}
	many[1999].ndim = 12;
	h = reg_hdr("many", 2000);
	expect_spec_error(&r, &h, many, 2000, -SHARDD_E_INVALID, NEEDLES("layer.1999.w", "ndim = 12"),
			  "bad last param of 2000");
	many[1999].ndim = 1;
	p = reg_payload(&h, many, 2000, &len);
	send_msg(r.fd, SHARDD_MSG_REGISTER_GROUP, ++r.seq, p, len);
	raw_recv_group(&r);
	free(p);
	free(many);

	/* A good registration works after all the refusals; a second one is refused. */
	raw_register_small(&r, "g");
	h = reg_hdr("g", 1);
	expect_spec_error(&r, &h, &ok, 1, -EEXIST, NEEDLES("'g'", "already registered"),
			  "duplicate group");
	raw_nop_ok(&r, 1);
	raw_close(&r);
	assert_others_served();
}

Test(hostile, bad_admin_requests_get_ok_false_naming_the_field)
{
	struct raw r;
	char *huge;
	size_t n;
	int fd = raw_connect();
	struct shardd_register_group h;
	struct shardd_param_spec s = pspec("w\xc3", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 4 });
	json_t *reply;

	/* Before any HELLO, on a connection that stays open through every error. */
	expect_admin_error(fd, "not json{", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "[1,2]", -SHARDD_E_MALFORMED, "object");
	expect_admin_error(fd, "\"status\"", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "42", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "{\"cmd\":5}", -SHARDD_E_MALFORMED, "\"cmd\"");
	expect_admin_error(fd, "{\"cmd\":\"status\",\"cmd\":\"jobs\"}", -SHARDD_E_MALFORMED,
			   "not JSON");
	expect_admin_error(fd, "{\"cmd\":\"frobnicate\"}", -SHARDD_E_INVALID, "'frobnicate'");
	expect_admin_error(fd, "{\"cmd\":\"ranks\",\"job\":5}", -SHARDD_E_INVALID, "\"job\"");
	expect_admin_error(fd, "{\"cmd\":\"ranks\",\"job\":\"nope\"}", -SHARDD_E_NOJOB,
			   "no job 'nope'");

	/* Deep nesting and a huge multi-byte command name (cut mid-character in the text). */
	n = 200000;
	huge = malloc(2 * n + 64);
	cr_assert_not_null(huge);
	memset(huge, '[', n);
	memset(huge + n, ']', n);
	huge[2 * n] = '\0';
	expect_admin_error(fd, huge, -SHARDD_E_MALFORMED, "not JSON");
	n = (size_t)sprintf(huge, "{\"cmd\":\"a");
	for (int i = 0; i < 150000; i++) {
		huge[n++] = (char)0xc3;
		huge[n++] = (char)0xa9;
	}
	n += (size_t)sprintf(huge + n, "\"}");
	expect_admin_error(fd, huge, -SHARDD_E_INVALID, "unknown admin command");
	n = (size_t)sprintf(huge, "{\"cmd\":\"ranks\",\"job\":\"");
	memset(huge + n, 'j', 300000);
	n += 300000;
	n += (size_t)sprintf(huge + n, "\"}");
	expect_admin_error(fd, huge, -SHARDD_E_NOJOB, "no job");
	free(huge);

	/* A group whose name and param name are not UTF-8, registered by a client. */
	raw_attach(&r, "adm", 0, 1, 2, 0);
	h = reg_hdr("g\xff\xfe", 1);
	raw_send_register(&r, &h, &s, 1); /* rank 1 never comes: it stays pending */
	/* Asked on the same socket, so the registration was taken first. */
	reply = admin_call(r.fd, 50, "{\"cmd\":\"groups\"}", 16);
	cr_assert(json_is_true(json_object_get(reply, "ok")), "groups with a non-UTF-8 name: %s",
		  json_string_value(json_object_get(reply, "error")));
	json_decref(reply);
	reply = admin_call(r.fd, 51, "{\"cmd\":\"ranks\"}", 15);
	cr_assert(json_is_true(json_object_get(reply, "ok")), "ranks with a non-UTF-8 name: %s",
		  json_string_value(json_object_get(reply, "error")));
	json_decref(reply);
	expect_admin_error(fd, "{\"cmd\":\"show\",\"group\":\"zz\"}", -SHARDD_E_NOGROUP,
			   "no group 'zz'");
	expect_admin_error(fd, "{\"cmd\":\"show\",\"group\":[]}", -SHARDD_E_INVALID,
			   "\"group\"");

	/* Argument types of dump, on the attached connection. */
	expect_admin_error(r.fd, "{\"cmd\":\"dump\",\"group\":\"zz\",\"param\":\"w\"}",
			   -SHARDD_E_NOGROUP, "'zz'");
	raw_close(&r);
	raw_attach(&r, "adm1", 0, 1, 1, 0);
	raw_register_small(&r, "d");
#define DUMP(extra) "{\"cmd\":\"dump\",\"group\":\"d\",\"param\":\"w\"" extra "}"
	expect_admin_error(r.fd, DUMP(",\"rank\":\"x\""),
			   -SHARDD_E_INVALID, "\"rank\"");
	expect_admin_error(r.fd, DUMP(",\"rank\":99"),
			   -SHARDD_E_INVALID, "\"rank\" = 99");
	expect_admin_error(r.fd, DUMP(",\"limit\":-1"),
			   -SHARDD_E_INVALID, "\"limit\"");
	expect_admin_error(r.fd, DUMP(",\"limit\":1e300"),
			   -SHARDD_E_INVALID, "\"limit\"");
	expect_admin_error(r.fd, DUMP(",\"rows\":\"a\""),
			   -SHARDD_E_INVALID, "\"rows\"");
	expect_admin_error(r.fd, DUMP(",\"rows\":[3,1]"),
			   -SHARDD_E_INVALID, "\"rows\" = 3:1");
	expect_admin_error(r.fd, DUMP(",\"rows\":[0,9999999999]"), -SHARDD_E_INVALID,
			   "\"rows\"");
	expect_admin_error(r.fd, DUMP(",\"what\":\"secrets\""), -SHARDD_E_INVALID, "'secrets'");
	expect_admin_error(r.fd, DUMP(",\"what\":7"),
			   -SHARDD_E_INVALID, "\"what\"");
	expect_admin_error(r.fd, "{\"cmd\":\"dump\",\"group\":\"d\",\"param\":\"nope\"}",
			   -SHARDD_E_INVALID, "no param 'nope'");
#undef DUMP
	raw_nop_ok(&r, 1);
	raw_close(&r);
	close(fd);
	assert_others_served();
}

#define FUZZ_CONNECTIONS 300

/* One datagram of fuzz: noise, or a header with odd fields and some payload. */
static size_t fuzz_dgram(uint8_t *buf, size_t cap)
{
	size_t len;

	if (rnd() % 3 == 0) {
		len = rnd() % 120;
		rnd_bytes(buf, len);
		return len;
	}
	struct shardd_msg_hdr h = {
		.magic = rnd() % 8 ? SHARDD_MAGIC : (uint32_t)rnd(),
		.type = (uint16_t)(rnd() % 12),
		.flags = rnd() % 8 ? 0 : (uint16_t)rnd(),
		.length = rnd() % 4 ? (uint32_t)(rnd() % 300) : (uint32_t)rnd(),
		.seq = (uint32_t)rnd(),
	};
	len = sizeof(h) + rnd() % 300;
	if (len > cap)
		len = cap;
	memcpy(buf, &h, sizeof(h));
	rnd_bytes(buf + sizeof(h), len - sizeof(h));
	return len;
}

Test(hostile, random_datagrams_before_and_after_hello_never_hurt_the_daemon)
{
	uint8_t buf[512];
	int admin = raw_connect();
	int64_t base = admin_connections(admin);

	rng_state = 0xf0220f0220f02201ull;
	for (int i = 0; i < FUZZ_CONNECTIONS; i++) {
		struct raw r = { .fd = -1, .doorbell = -1 };
		int ndgrams = 1 + (int)(rnd() % 3);

		if (i % 2)
			raw_attach(&r, "fuzz", 0, 1, 1, 0);
		else
			r.fd = raw_connect();
		for (int k = 0; k < ndgrams; k++) {
			size_t len = fuzz_dgram(buf, sizeof(buf));

			/* The daemon may have closed us already: a failed send is fine. */
			if (send(r.fd, buf, len, MSG_NOSIGNAL) < 0)
				break;
		}
		raw_close(&r);
	}
	/* Every connection was processed to its EOF; none is left behind. */
	wait_connections(admin, base);
	close(admin);
	assert_others_served();
}

/* ------------------------------------------------------------------ */
/* A reply that cannot be sent in the middle of a failing registration */
/* ------------------------------------------------------------------ */

/* Send REGISTER_GROUP, then prove with an admin round trip that the daemon took it. */
static void raw_register_arrived(struct raw *r, const char *name, uint64_t d0)
{
	struct shardd_register_group h = reg_hdr(name, 1);
	struct shardd_param_spec s = pspec("w", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ d0 });

	raw_send_register(r, &h, &s, 1);
	/* Control messages of one socket are served in order: the reply means it arrived. */
	json_decref(admin_call(r->fd, 900, "{\"cmd\":\"jobs\"}", 14));
}

/*
 * A client that shut down its reading side: the daemon's next send to it
 * fails at once (EPIPE) and drops it, here while a registration fails.
 */
Test(hostile, registration_failing_while_a_reply_cannot_be_sent_keeps_the_daemon_sound)
{
	struct raw a, b;

	/* The mismatching rank cannot be answered. */
	raw_attach(&a, "reg-epipe", 0, 1, 2, 0);
	raw_attach(&b, "reg-epipe", 1, 1, 2, 0);
	raw_register_arrived(&a, "g", 6);
	cr_assert_eq(shutdown(b.fd, SHUT_RD), 0);
	raw_send_register(&b, (struct shardd_register_group[]){ reg_hdr("g", 1) },
			  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_FP32, 1,
							      (uint64_t[]){ 7 }) }, 1);
	expect_error(a.fd, a.seq, -SHARDD_E_MISMATCH, NEEDLES("shape", "[6]", "[7]"),
		     "rank 0 of a failed registration");
	/* Exactly one reply: the next message on rank 0's socket answers the next request. */
	json_decref(admin_call(a.fd, 901, "{\"cmd\":\"status\"}", 16));
	assert_daemon_alive();
	raw_close(&b);
	raw_attach(&b, "reg-epipe", 1, 1, 2, 0);
	raw_register_arrived(&a, "g", 6);
	raw_send_register(&b, (struct shardd_register_group[]){ reg_hdr("g", 1) },
			  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_FP32, 1,
							      (uint64_t[]){ 6 }) }, 1);
	cr_assert_eq(raw_recv_group(&a), raw_recv_group(&b));
	raw_close(&a);
	raw_close(&b);

	/* The rank that arrived first cannot be answered. */
	raw_attach(&a, "reg-epipe2", 0, 1, 2, 0);
	raw_attach(&b, "reg-epipe2", 1, 1, 2, 0);
	raw_register_arrived(&a, "g", 6);
	cr_assert_eq(shutdown(a.fd, SHUT_RD), 0);
	raw_send_register(&b, (struct shardd_register_group[]){ reg_hdr("g", 1) },
			  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_FP32, 1,
							      (uint64_t[]){ 7 }) }, 1);
	expect_error(b.fd, b.seq, -SHARDD_E_MISMATCH, NEEDLES("shape"),
		     "rank 1 of a failed registration");
	json_decref(admin_call(b.fd, 902, "{\"cmd\":\"status\"}", 16));
	assert_daemon_alive();
	raw_close(&a);
	raw_attach(&a, "reg-epipe2", 0, 1, 2, 0);
	raw_register_arrived(&a, "g", 6);
	raw_send_register(&b, (struct shardd_register_group[]){ reg_hdr("g", 1) },
			  (struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_FP32, 1,
							      (uint64_t[]){ 6 }) }, 1);
	cr_assert_eq(raw_recv_group(&a), raw_recv_group(&b));
	raw_close(&a);
	raw_close(&b);
	assert_others_served();
}

/* ------------------------------------------------------------------ */
/* 3. Mid-stream death                                                 */
/* ------------------------------------------------------------------ */

struct child_args {
	int report_fd; /* write end: the child says it is in place */
	int hold_fd;   /* read end: the child blocks here until killed */
};

#define HALF_PARAMS 1000u

/* Attach rank 0 of "half", send the first datagram of a 3-datagram registration, wait to die. */
static int half_register_child(void *arg)
{
	const struct child_args *a = arg;
	struct shardd_hello h = make_hello("half", 0, 1, 2, 0);
	struct shardd_register_group rg = reg_hdr("big", HALF_PARAMS);
	struct shardd_ctrl_rx rx = { 0 };
	struct shardd_msg_hdr mh = {
		.magic = SHARDD_MAGIC, .type = SHARDD_MSG_REGISTER_GROUP,
		.length = (uint32_t)(sizeof(rg) + HALF_PARAMS * sizeof(struct shardd_param_spec)),
		.seq = 2,
	};
	uint8_t *first = calloc(1, SHARDD_CTRL_CHUNK);
	char c;
	int fd = harness_raw_connect(daemon_.socket);

	CHILD_CHECK(fd >= 0 && first, "connect");
	CHILD_CHECK(shardd_ctrl_send(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), NULL, 0) == 0, "hello");
	CHILD_CHECK(shardd_ctrl_recv(fd, &rx, REPLY_MS) == 0 && rx.hdr.type == SHARDD_MSG_WELCOME,
		    "no welcome");
	shardd_ctrl_rx_reset(&rx);
	memcpy(first, &mh, sizeof(mh));
	memcpy(first + sizeof(mh), &rg, sizeof(rg));
	CHILD_CHECK(send(fd, first, SHARDD_CTRL_CHUNK, MSG_NOSIGNAL) == SHARDD_CTRL_CHUNK,
		    "first datagram");
	CHILD_CHECK(harness_signal(a->report_fd, 'h') == 0, "report");
	(void)!read(a->hold_fd, &c, 1);
	return 0;
}

/* Fork `fn`, wait for its report byte, SIGKILL it, reap it. */
static void run_child_and_kill(int (*fn)(void *))
{
	struct child_args a;
	int rep[2], hold[2], status;
	char c;
	pid_t pid;
	int ret;

	cr_assert_eq(pipe(rep), 0);
	cr_assert_eq(pipe(hold), 0);
	a = (struct child_args){ .report_fd = rep[1], .hold_fd = hold[0] };
	pid = harness_fork(fn, &a);
	cr_assert_gt(pid, 0);
	close(rep[1]);
	close(hold[0]);
	ret = harness_read_full(rep[0], &c, 1, REPLY_MS * 2);
	if (ret < 0) {
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
		harness_daemon_dump_log(&daemon_);
	}
	cr_assert_eq(ret, 0, "the child never reported: %s", strerror(-ret));
	kill(pid, SIGKILL);
	cr_assert_eq(harness_wait_pid(pid, REPLY_MS, &status), 0);
	cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child %s",
		  harness_status_str(status));
	close(rep[0]);
	close(hold[1]);
}

Test(hostile, client_dying_in_the_middle_of_a_multi_datagram_registration)
{
	struct shardd_param_spec *specs = calloc(HALF_PARAMS, sizeof(*specs));
	struct shardd_register_group h = reg_hdr("big", HALF_PARAMS);
	int admin = raw_connect();
	int64_t base = admin_connections(admin);
	int fds = daemon_fd_count();
	struct raw a, b;

	cr_assert_not_null(specs);
	run_child_and_kill(half_register_child);
	wait_connections(admin, base);
	cr_assert_eq(daemon_fd_count(), fds, "the daemon holds %d fds, %d before",
		     daemon_fd_count(), fds);

	/* Rank 0 comes back and both ranks register the whole group. */
	for (uint32_t i = 0; i < HALF_PARAMS; i++) {
		char name[32];

		snprintf(name, sizeof(name), "p%u", i);
		specs[i] = pspec(name, SHARDD_DTYPE_FP16, 2, (uint64_t[]){ 1 + i % 3, 2 });
	}
	raw_attach(&a, "half", 0, 1, 2, 0);
	raw_attach(&b, "half", 1, 1, 2, 0);
	raw_send_register(&a, &h, specs, HALF_PARAMS);
	raw_send_register(&b, &h, specs, HALF_PARAMS);
	cr_assert_eq(raw_recv_group(&a), raw_recv_group(&b));
	raw_close(&a);
	raw_close(&b);
	free(specs);
	close(admin);
	assert_others_served();
}

/* The test's shard values: full[i] of a [6, 2] fp32 param, rank r writes its rows. */
static void hold_full(float *full)
{
	for (int i = 0; i < 12; i++)
		full[i] = 100.0f + (float)i;
}

static const struct shardd_param_desc hold_param = {
	.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 6, 2 },
};

/* Rank 0 of "hold": register, write its shard, unshard step 1, report, hold it until killed. */
static int holder_child(void *arg)
{
	const struct child_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float full[12];
	char ch;

	hold_full(full);
	CHILD_CHECK(harness_attach(&daemon_, "hold", 0, 1, 2, &c) == 0, "attach");
	CHILD_CHECK(shardd_group_register(c, "g", &hold_param, 1, NULL, &g) == 0, "register: %s",
		    shardd_last_error());
	CHILD_CHECK(shardd_group_load_full(g, 0, full) == 0, "load");
	CHILD_CHECK(shardd_unshard(g, 1) == 0, "unshard: %s", shardd_last_error());
	CHILD_CHECK(memcmp(shardd_group_unsharded(g, 0), full, sizeof(full)) == 0, "values");
	CHILD_CHECK(harness_signal(a->report_fd, 'u') == 0, "report");
	(void)!read(a->hold_fd, &ch, 1);
	return 0;
}

static struct shardd_client *hold_parent;
static struct shardd_group *hold_group;

/* Rank 1's failure, copied out of its thread's thread-local error. */
static char hold_err[512];

/* Rank 1 registers alongside the child and unshards step 1 with it. */
static void *hold_rank1(void *arg)
{
	float full[12];

	(void)arg;
	hold_full(full);
	if (harness_attach(&daemon_, "hold", 1, 1, 2, &hold_parent) ||
	    shardd_group_register(hold_parent, "g", &hold_param, 1, NULL, &hold_group) ||
	    shardd_group_load_full(hold_group, 0, full) || shardd_unshard(hold_group, 1)) {
		snprintf(hold_err, sizeof(hold_err), "%s", shardd_last_error());
		return hold_err;
	}
	return NULL;
}

static json_t *show_hold_group(int admin)
{
	static const char req[] = "{\"cmd\":\"show\",\"job\":\"hold\",\"group\":\"g\"}";
	json_t *r = admin_call(admin, 3, req, sizeof(req) - 1);

	cr_assert(json_is_true(json_object_get(r, "ok")), "show: %s",
		  json_string_value(json_object_get(r, "error")));
	return r;
}

/* While the child holds its copy: both ranks are holders. */
static int hold_admin = -1;

static void holders_are_both(void)
{
	json_t *r = show_hold_group(hold_admin);

	cr_assert_eq(json_integer_value(json_object_get(r, "unsharded_refcount")), 2);
	json_decref(r);
}

Test(hostile, client_dying_while_holding_the_unsharded_copy_releases_its_hold)
{
	struct child_args a;
	float full[12];
	pthread_t t;
	void *err = NULL;
	json_t *r;
	int rep[2], hold[2], status;
	char ch;
	pid_t pid;

	hold_full(full);
	hold_admin = raw_connect();
	cr_assert_eq(pipe(rep), 0);
	cr_assert_eq(pipe(hold), 0);
	a = (struct child_args){ .report_fd = rep[1], .hold_fd = hold[0] };
	pid = harness_fork(holder_child, &a);
	cr_assert_gt(pid, 0);
	close(rep[1]);
	close(hold[0]);
	/* Rank 1 in a thread: registration and unshard are collectives with the child. */
	cr_assert_eq(pthread_create(&t, NULL, hold_rank1, NULL), 0);
	pthread_join(t, &err);
	cr_assert_null(err, "rank 1: %s", (const char *)err);
	cr_assert_eq(harness_read_full(rep[0], &ch, 1, REPLY_MS * 2), 0, "rank 0 never unsharded");
	cr_assert_eq(memcmp(shardd_group_unsharded(hold_group, 0), full, sizeof(full)), 0);
	holders_are_both();

	kill(pid, SIGKILL);
	cr_assert_eq(harness_wait_pid(pid, REPLY_MS, &status), 0);
	close(rep[0]);
	close(hold[1]);

	/* Rank 1 reshards; the dead rank's hold is gone with it. */
	cr_assert_eq(shardd_reshard(hold_group, 1), 0, "%s", shardd_last_error());
	wait_connections(hold_admin, 2); /* rank 1 and the admin connection */
	r = show_hold_group(hold_admin);
	cr_assert_eq(json_integer_value(json_object_get(r, "unsharded_refcount")), 0,
		     "a dead rank still holds the unsharded copy");
	json_decref(r);
	/* Rank 0 is gone: rank 1's next unshard fails at once, naming it. */
	cr_assert_eq(shardd_unshard(hold_group, 2), -SHARDD_E_PEER_DIED, "%s", shardd_last_error());
	cr_assert_not_null(strstr(shardd_last_error(), "rank 0"), "%s", shardd_last_error());

	/* A restarted rank 0 opens the group and both unshard the values kept by the daemon. */
	{
		struct shardd_client *c0 = NULL;
		struct shardd_group *g0 = NULL;
		struct shardd_completion cp;

		cr_assert_eq(harness_attach(&daemon_, "hold", 0, 1, 2, &c0), 0);
		cr_assert_eq(shardd_group_open(c0, "g", &g0), 0, "%s", shardd_last_error());
		cr_assert_eq(shardd_submit(c0, SHARDD_OP_UNSHARD, shardd_group_id(g0), 2, 0, 7), 0);
		cr_assert_eq(shardd_unshard(hold_group, 2), 0, "%s", shardd_last_error());
		cr_assert_eq(shardd_wait(c0, &cp, REPLY_MS), 0);
		cr_assert_eq(cp.res, 0, "%s", cp.msg);
		cr_assert_eq(memcmp(shardd_group_unsharded(hold_group, 0), full, sizeof(full)), 0,
			     "the unsharded copy after the restart differs");
		cr_assert_eq(memcmp(shardd_group_unsharded(g0, 0), full, sizeof(full)), 0);
		shardd_group_close(g0);
		shardd_close(c0);
	}
	shardd_group_close(hold_group);
	shardd_close(hold_parent);
	close(hold_admin);
	assert_others_served();
}

#define CHURN 50

Test(hostile, fifty_clients_connecting_and_leaving_leak_no_descriptors)
{
	int admin = raw_connect();
	int64_t base = admin_connections(admin);
	int fds = daemon_fd_count(), now;

	for (int i = 0; i < CHURN; i++) {
		struct shardd_client *c = NULL;
		struct shardd_group *g = NULL;
		struct raw r;
		int fd;

		switch (i % 4) {
		case 0: /* a full life: register a group (memfds), unshard, goodbye */
			cr_assert_eq(harness_attach(&daemon_, "churn", 0, 1, 1, &c), 0);
			cr_assert_eq(shardd_group_register(c, "g", &hold_param, 1, NULL, &g), 0,
				     "%s", shardd_last_error());
			cr_assert_eq(shardd_unshard(g, 1), 0, "%s", shardd_last_error());
			shardd_group_close(g);
			shardd_close(c);
			break;
		case 1: /* attach and vanish without goodbye; the job stays for it */
			raw_attach(&r, "churn-vanish", 0, 1, 1, 0);
			raw_nop_ok(&r, 1);
			raw_close(&r);
			break;
		case 2: /* connect and hang up */
			close(raw_connect());
			break;
		default: /* half a message with an fd, then hang up */
			fd = raw_connect();
			send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 100, 1, "{", 1, fd);
			close(fd);
			break;
		}
	}
	/* The vanished rank's job ends when it comes back and says goodbye. */
	{
		struct shardd_client *c = NULL;

		cr_assert_eq(harness_attach(&daemon_, "churn-vanish", 0, 1, 1, &c), 0);
		shardd_close(c);
	}
	wait_connections(admin, base);
	now = daemon_fd_count();
	cr_assert_eq(now, fds, "the daemon holds %d fds after %d clients came and went, %d before",
		     now, CHURN, fds);
	close(admin);
	assert_others_served();
}

/* ------------------------------------------------------------------ */
/* 4. Replies nobody reads, memory never sent, connections that are silent */
/* ------------------------------------------------------------------ */

#define BIG_PARAMS 10000u /* a GROUP reply of this many params is about 2.2 MB */

/* Register a BIG_PARAMS-param group on a 1x1 raw client and read its reply. */
static void raw_register_big(struct raw *r, const char *name)
{
	struct shardd_register_group h = reg_hdr(name, BIG_PARAMS);
	struct shardd_param_spec *specs = calloc(BIG_PARAMS, sizeof(*specs));

	cr_assert_not_null(specs);
	for (uint32_t i = 0; i < BIG_PARAMS; i++) {
		char pname[32];

		snprintf(pname, sizeof(pname), "p%u", i);
		specs[i] = pspec(pname, SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 3 });
	}
	raw_send_register(r, &h, specs, BIG_PARAMS);
	free(specs);
	raw_recv_group(r);
}

/* Send OPEN_GROUP `name` `n` times without reading a reply. */
static void raw_open_unread(struct raw *r, const char *name, int n)
{
	struct shardd_open_group o = { .name = { 0 } };

	snprintf(o.name, sizeof(o.name), "%s", name);
	for (int i = 0; i < n; i++)
		send_msg(r->fd, SHARDD_MSG_OPEN_GROUP, ++r->seq, &o, sizeof(o));
}

#define UNREAD_OPENS 12 /* about 27 MB of GROUP replies: far past any socket buffer */

/*
 * The daemon never waits for a client to read: replies that do not fit in
 * its socket are queued while everyone else is served, and the client,
 * once it reads, gets every one of them, whole and in order.
 */
Test(hostile, replies_a_client_does_not_read_are_queued_while_others_are_served)
{
	uint32_t first_seq, gid = 0;
	struct raw a;

	raw_attach(&a, "unread", 0, 1, 1, 0);
	raw_register_big(&a, "big");
	first_seq = a.seq + 1;
	raw_open_unread(&a, "big", UNREAD_OPENS);
	assert_others_served();
	for (int i = 0; i < UNREAD_OPENS; i++) {
		struct shardd_group_reply g;
		struct shardd_ctrl_rx rx;

		recv_msg(a.fd, &rx);
		cr_assert_eq(rx.hdr.type, SHARDD_MSG_GROUP, "reply %d: type %u, want GROUP", i,
			     rx.hdr.type);
		cr_assert_eq(rx.hdr.seq, first_seq + (uint32_t)i, "reply %d: seq %u, want %u", i,
			     rx.hdr.seq, first_seq + (uint32_t)i);
		cr_assert_eq(rx.nfds, 4, "reply %d carries %d fds", i, rx.nfds);
		cr_assert_eq(rx.hdr.length, sizeof(g) + (size_t)BIG_PARAMS *
			     (sizeof(struct shardd_param_layout) + sizeof(struct shardd_param_spec)));
		memcpy(&g, rx.payload, sizeof(g));
		cr_assert_eq(g.nparams, BIG_PARAMS);
		if (i)
			cr_assert_eq(g.group_id, gid, "reply %d names group %u, not %u", i,
				     g.group_id, gid);
		gid = g.group_id;
		shardd_ctrl_rx_reset(&rx);
	}
	raw_nop_ok(&a, 1);
	raw_close(&a);
	assert_others_served();
}

#define BURST 1000 /* requests sent at once: many loop turns' read budget */

/*
 * A burst of requests larger than one loop turn's read budget is read on
 * over the next turns: every request gets its reply, in order.
 */
Test(hostile, a_burst_of_requests_past_one_turns_read_budget_is_served_whole_and_in_order)
{
	struct raw a;

	raw_attach(&a, "burst", 0, 1, 1, 0);
	for (uint32_t i = 0; i < BURST; i++)
		send_msg(a.fd, 200, 100 + i, NULL, 0);
	for (uint32_t i = 0; i < BURST; i++)
		expect_error(a.fd, 100 + i, -SHARDD_E_INVALID, NEEDLES("message type 200"),
			     "a request of the burst");
	raw_nop_ok(&a, 1);
	raw_close(&a);
	assert_others_served();
}

#define OVERFLOW_OPENS 40 /* about 90 MB of GROUP replies: past SHARDD_SESSION_OUT_MAX */

/* A client that lets more than the queue's bound of replies pile up is dropped, named. */
Test(hostile, client_letting_replies_pile_past_the_bound_is_dropped_and_named)
{
	struct pollfd p;
	char needle[64];
	struct raw a;

	raw_attach(&a, "pileup", 0, 1, 1, 0);
	raw_register_big(&a, "big");
	raw_open_unread(&a, "big", OVERFLOW_OPENS);
	p = (struct pollfd){ .fd = a.fd, .events = POLLRDHUP };
	cr_assert_eq(poll(&p, 1, REPLY_MS), 1, "the daemon kept a client with %d unread 2 MB "
		     "replies", OVERFLOW_OPENS);
	cr_assert(p.revents & (POLLHUP | POLLRDHUP), "revents 0x%x", p.revents);
	snprintf(needle, sizeof(needle), "pid %d) does not read its replies", (int)getpid());
	wait_log(&daemon_, needle);
	raw_close(&a);
	assert_others_served();
}

/* The daemon's VmSize or VmRSS, in bytes. */
static uint64_t daemon_vm(const char *field)
{
	char path[64], line[128];
	unsigned long long kb = 0;
	size_t n = strlen(field);
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)daemon_.pid);
	f = fopen(path, "r");
	cr_assert_not_null(f, "%s: %s", path, strerror(errno));
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, field, n) == 0 && line[n] == ':')
			cr_assert_eq(sscanf(line + n + 1, "%llu", &kb), 1, "%s", line);
	fclose(f);
	cr_assert_gt(kb, 0, "%s has no %s", path, field);
	return kb * 1024;
}

#define ANNOUNCED_BYTES (60u << 20)
#define VM_SLACK        (16u << 20) /* well under the announced 60 MiB */

/*
 * A message's buffer grows with what arrives: announcing 60 MiB and
 * sending one datagram makes the daemon map (VmSize) and touch (VmRSS)
 * about that datagram, not the announced length.
 */
Test(hostile, announced_length_is_not_allocated_before_the_bytes_arrive)
{
	uint8_t *chunk = calloc(1, SHARDD_CTRL_CHUNK - sizeof(struct shardd_msg_hdr));
	uint64_t size0, rss0, size1, rss1;
	int admin = raw_connect();
	struct raw a;

	cr_assert_not_null(chunk);
	raw_attach(&a, "announce", 0, 1, 1, 0);
	json_decref(admin_call(admin, 1, "{\"cmd\":\"status\"}", 16));
	size0 = daemon_vm("VmSize");
	rss0 = daemon_vm("VmRSS");
	send_hdr(a.fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, ANNOUNCED_BYTES, ++a.seq, chunk,
		 SHARDD_CTRL_CHUNK - sizeof(struct shardd_msg_hdr), -1);
	/* The loop takes events in arrival order: this reply comes after the datagram was read. */
	json_decref(admin_call(admin, 2, "{\"cmd\":\"status\"}", 16));
	size1 = daemon_vm("VmSize");
	rss1 = daemon_vm("VmRSS");
	cr_assert_lt(size1, size0 + VM_SLACK, "VmSize grew by %llu bytes for one %u-byte datagram "
		     "of a message announcing %u", (unsigned long long)(size1 - size0),
		     SHARDD_CTRL_CHUNK, ANNOUNCED_BYTES);
	cr_assert_lt(rss1, rss0 + VM_SLACK, "VmRSS grew by %llu bytes for one %u-byte datagram",
		     (unsigned long long)(rss1 - rss0), SHARDD_CTRL_CHUNK);
	assert_daemon_alive();
	free(chunk);
	raw_close(&a);
	close(admin);
	assert_others_served();
}

#define HANDSHAKE_S "0.5" /* --handshake-timeout of the daemon below */
#define STATUS_REQ  "{\"cmd\":\"status\"}"

/* The next message on `fd` is an {"ok": true} ADMIN_REPLY numbered `seq`. */
static void recv_admin_ok(int fd, uint32_t seq)
{
	struct shardd_ctrl_rx rx = { 0 };
	json_t *r;

	cr_assert_eq(shardd_ctrl_recv(fd, &rx, REPLY_MS), 0, "no admin reply %u", seq);
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_ADMIN_REPLY, "reply type %u", rx.hdr.type);
	cr_assert_eq(rx.hdr.seq, seq, "admin reply seq %u, want %u", rx.hdr.seq, seq);
	r = json_loadb((const char *)rx.payload, rx.hdr.length, 0, NULL);
	cr_assert(json_is_true(json_object_get(r, "ok")), "admin reply %u: %.*s", seq,
		  (int)rx.hdr.length, (const char *)rx.payload);
	json_decref(r);
	shardd_ctrl_rx_reset(&rx);
}

/*
 * Connections that never complete a message (silent, or half a HELLO) are
 * closed after the handshake timeout, naming their pid; an admin connection
 * that spoke and an attached rank stay.
 */
Test(hostile, connections_that_never_complete_a_message_are_closed_after_the_timeout)
{
	const char *extra[] = { "--handshake-timeout", HANDSHAKE_S, NULL };
	struct harness_daemon d = { 0 };
	struct shardd_client *c = NULL;
	struct shardd_hello h = make_hello("silent", 0, 1, 1, 0);
	int admin, silent, half;
	char needle[96];

	cr_assert_eq(harness_daemon_start(&d, extra), 0, "shardd did not start");
	admin = harness_raw_connect(d.socket);
	cr_assert_geq(admin, 0);
	cr_assert_eq(shardd_ctrl_send(admin, SHARDD_MSG_ADMIN, 1, STATUS_REQ, 16, NULL, 0), 0);
	cr_assert_eq(harness_attach(&d, "silent", 0, 1, 1, &c), 0, "attach: %s",
		     shardd_last_error());
	silent = harness_raw_connect(d.socket);
	half = harness_raw_connect(d.socket);
	cr_assert(silent >= 0 && half >= 0);
	send_hdr(half, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, sizeof(h), 1, &h, sizeof(h) / 2, -1);

	cr_assert_eq(harness_expect_eof(silent, REPLY_MS), 0,
		     "a silent connection stayed open past --handshake-timeout " HANDSHAKE_S);
	cr_assert_eq(harness_expect_eof(half, REPLY_MS), 0,
		     "a connection with half a HELLO stayed open past --handshake-timeout "
		     HANDSHAKE_S);
	snprintf(needle, sizeof(needle), "pid %d) sent no complete message", (int)getpid());
	wait_log(&d, needle);

	/* Past the timeout, the admin connection that spoke and the attached rank are served. */
	recv_admin_ok(admin, 1);
	cr_assert_eq(shardd_ctrl_send(admin, SHARDD_MSG_ADMIN, 2, STATUS_REQ, 16, NULL, 0), 0,
		     "the admin connection was closed");
	recv_admin_ok(admin, 2);
	cr_assert_eq(shardd_nop(c), 0, "the attached rank was dropped: %s", shardd_last_error());
	shardd_close(c);
	close(silent);
	close(half);
	close(admin);
	harness_daemon_stop_expect_clean(&d);
}

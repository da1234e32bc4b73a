/* SPDX-License-Identifier: MIT */
/* The raw protocol from tests, past libshardd's checks (rawproto.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "rawproto.h"

static struct harness_daemon *rp_daemon;

void rawproto_use(struct harness_daemon *d)
{
	rp_daemon = d;
}

/* ------------------------------------------------------------------ */
/* Raw control connections                                             */
/* ------------------------------------------------------------------ */

int raw_connect(void)
{
	int fd = harness_raw_connect(rp_daemon->socket);

	cr_assert_geq(fd, 0, "connect %s: %s", rp_daemon->socket, strerror(-fd));
	return fd;
}

/* One datagram of raw bytes, with `passfd` (>= 0) attached by SCM_RIGHTS. */
void send_dgram(int sock, const void *buf, size_t len, int passfd)
{
	ssize_t n = harness_send_fds(sock, buf, len, passfd >= 0 ? &passfd : NULL, passfd >= 0);

	cr_assert_eq(n, (ssize_t)len, "sendmsg of %zu bytes: %s", len,
		     strerror(n < 0 ? (int)-n : 0));
}

/* A header (and `len` payload bytes of `payload`) as one datagram. */
void send_hdr(int sock, uint32_t magic, uint16_t type, uint16_t flags, uint32_t length,
	      uint32_t seq, const void *payload, size_t len, int passfd)
{
	uint8_t *buf = malloc(sizeof(struct shardd_msg_hdr) + len);
	struct shardd_msg_hdr h = {
		.magic = magic,
		.type = type,
		.flags = flags,
		.length = length,
		.seq = seq,
	};

	cr_assert_not_null(buf);
	memcpy(buf, &h, sizeof(h));
	if (len)
		memcpy(buf + sizeof(h), payload, len);
	send_dgram(sock, buf, sizeof(h) + len, passfd);
	free(buf);
}

void send_msg(int sock, uint16_t type, uint32_t seq, const void *payload, uint32_t len)
{
	int ret = shardd_ctrl_send(sock, type, seq, payload, len, NULL, 0);

	cr_assert_eq(ret, 0, "send of message type %u: %s", type, strerror(-ret));
}

void recv_msg(int sock, struct shardd_ctrl_rx *rx)
{
	int ret;

	memset(rx, 0, sizeof(*rx));
	ret = shardd_ctrl_recv(sock, rx, REPLY_MS);
	if (ret < 0)
		harness_daemon_dump_log(rp_daemon);
	cr_assert_eq(ret, 0, "no reply from the daemon: %s", strerror(-ret));
}

/* rx is an ERROR with `code` whose text holds every needle; rx is reset. */
void check_error(struct shardd_ctrl_rx *rx, uint32_t seq, int32_t code, const char *const *needles,
		 const char *what)
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
	cr_assert_eq(em.code, code, "%s: ERROR code %d (%s), want %d (%s); text: %s", what, em.code,
		     shardd_strerror(em.code), code, shardd_strerror(code), text);
	for (int i = 0; needles && needles[i]; i++)
		cr_assert_not_null(strstr(text, needles[i]), "%s: ERROR text '%s' lacks '%s'", what,
				   text, needles[i]);
	shardd_ctrl_rx_reset(rx);
}

void expect_error(int sock, uint32_t seq, int32_t code, const char *const *needles,
		  const char *what)
{
	struct shardd_ctrl_rx rx;

	recv_msg(sock, &rx);
	check_error(&rx, seq, code, needles, what);
}

void expect_eof(int sock, const char *what)
{
	int ret = harness_expect_eof(sock, REPLY_MS);

	cr_assert_eq(ret, 0, "%s: the daemon must close the connection (%s)", what, strerror(-ret));
}

void expect_refused(int sock, uint32_t seq, int32_t code, const char *const *needles,
		    const char *what)
{
	expect_error(sock, seq, code, needles, what);
	expect_eof(sock, what);
	close(sock);
}

/* One admin request on `sock`: the parsed reply (an object), checked for seq. */
json_t *admin_call(int sock, uint32_t seq, const char *req, size_t len)
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
void expect_admin_error(int sock, const char *req, int32_t code, const char *needle)
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
int64_t admin_connections(int sock)
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
void wait_connections(int sock, int64_t want)
{
	int64_t deadline = harness_now_ms() + REPLY_MS, n;

	while ((n = admin_connections(sock)) != want && harness_now_ms() < deadline)
		sched_yield();
	cr_assert_eq(n, want, "the daemon still counts %lld connections, want %lld", (long long)n,
		     (long long)want);
}

/* ------------------------------------------------------------------ */
/* Raw attached clients: HELLO by hand, the ring mapped directly       */
/* ------------------------------------------------------------------ */

struct shardd_hello make_hello(const char *job, uint32_t rank, uint32_t replicate, uint32_t shard,
			       uint32_t sq_entries)
{
	struct shardd_hello h = {
		.major = SHARDD_PROTO_MAJOR,
		.minor = SHARDD_PROTO_MINOR,
		.pid = (uint32_t)getpid(),
		.rank = rank,
		.replicate = replicate,
		.shard = shard,
		.device = SHARDD_HELLO_DEVICE_HOST,
		.sq_entries = sq_entries,
	};

	snprintf(h.job, sizeof(h.job), "%s", job);
	return h;
}

void raw_attach(struct raw *r, const char *job, uint32_t rank, uint32_t replicate, uint32_t shard,
		uint32_t sq_entries)
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

void raw_close(struct raw *r)
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
void raw_kick(struct raw *r)
{
	uint64_t one = 1;

	if (shardd_ring_needs_wakeup(&r->ring))
		cr_assert_eq(write(r->doorbell, &one, sizeof(one)), (ssize_t)sizeof(one));
}

void raw_push(struct raw *r, const struct shardd_sqe *sqe)
{
	cr_assert_eq(shardd_sq_push(&r->ring, sqe), 0, "SQ full");
	raw_kick(r);
}

uint32_t ring_load(const uint32_t *p)
{
	return shardd_load_acquire(p);
}

/* The daemon closed this client: socket hung up or ring marked dead. */
int raw_gone(struct raw *r)
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
int raw_reap(struct raw *r, struct shardd_cqe *cqe, char *msg, int timeout_ms)
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

void raw_reap_ok(struct raw *r, struct shardd_cqe *cqe, char *msg, const char *what)
{
	int ret = raw_reap(r, cqe, msg, REPLY_MS);

	if (ret < 0)
		harness_daemon_dump_log(rp_daemon);
	cr_assert_eq(ret, 0, "%s: no completion: %s", what, strerror(-ret));
}

struct shardd_sqe sqe_of(uint8_t op, uint32_t group, uint64_t step, uint32_t flags,
			 uint64_t user_data)
{
	struct shardd_sqe s = {
		.op = op,
		.group = group,
		.step = step,
		.flags = flags,
		.user_data = user_data,
	};

	return s;
}

/* Push one entry, reap its completion (the only one in flight). */
struct shardd_cqe raw_op(struct raw *r, struct shardd_sqe sqe, char *msg)
{
	struct shardd_cqe cqe;

	raw_push(r, &sqe);
	raw_reap_ok(r, &cqe, msg, "op");
	cr_assert_eq(cqe.user_data, sqe.user_data, "completion of user_data %llu, want %llu",
		     (unsigned long long)cqe.user_data, (unsigned long long)sqe.user_data);
	return cqe;
}

/* A nop round trip: the daemon is still serving this ring. */
void raw_nop_ok(struct raw *r, uint64_t user_data)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct shardd_cqe c = raw_op(r, sqe_of(SHARDD_OP_NOP, 0, 0, 0, user_data), msg);

	cr_assert_eq(c.res, 0, "nop: %d %s", c.res, msg);
}

/* ------------------------------------------------------------------ */
/* Registration payloads                                               */
/* ------------------------------------------------------------------ */

struct shardd_param_spec pspec(const char *name, uint32_t dtype, uint32_t ndim,
			       const uint64_t *shape)
{
	struct shardd_param_spec s = { .dtype = dtype, .ndim = ndim };

	snprintf(s.name, sizeof(s.name), "%s", name);
	for (uint32_t d = 0; d < ndim && d < SHARDD_MAX_DIMS; d++)
		s.shape[d] = shape[d];
	return s;
}

struct shardd_register_group reg_hdr(const char *name, uint32_t nparams)
{
	/* These clients drive the daemon's ring: their groups are daemon-executed. */
	struct shardd_register_group h = { .nparams = nparams, .exec = SHARDD_EXEC_DAEMON };

	snprintf(h.name, sizeof(h.name), "%s", name);
	return h;
}

/* hdr then nspecs specs; *len its size. */
uint8_t *reg_payload(const struct shardd_register_group *hdr, const struct shardd_param_spec *specs,
		     uint32_t nspecs, uint32_t *len)
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

void raw_send_register(struct raw *r, const struct shardd_register_group *hdr,
		       const struct shardd_param_spec *specs, uint32_t nspecs)
{
	uint32_t len;
	uint8_t *p = reg_payload(hdr, specs, nspecs, &len);

	send_msg(r->fd, SHARDD_MSG_REGISTER_GROUP, ++r->seq, p, len);
	free(p);
}

/* The GROUP reply to our last request: its group id (the 4 fds are closed). */
uint32_t raw_recv_group(struct raw *r)
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
uint32_t raw_register_small(struct raw *r, const char *name)
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

void rnd_seed(uint64_t seed)
{
	rng_state = seed;
}

uint64_t rnd(void)
{
	/* xorshift64*: a fixed seed gives the same entries on every run. */
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545f4914f6cdd1dull;
}

void rnd_bytes(void *buf, size_t len)
{
	uint8_t *p = buf;

	for (size_t i = 0; i < len; i++)
		p[i] = (uint8_t)(rnd() >> 56);
}

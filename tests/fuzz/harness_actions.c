/* SPDX-License-Identifier: MIT */
/*
 * The program interpreter's actions (fuzz_harness.h): reading the input and
 * each action an input's program may run.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <linux/sockios.h>

#include <jansson.h>
#include <sanitizer/allocator_interface.h>

#include "clock.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "metrics.h"
#include "server.h"
#include "session.h"
#include "shardd_ctrl.h"
#include "shardd_proto.h"
#include "shardd_ring.h"

#include "fuzz_daemon.h"
#include "fuzz_harness.h"

/* ------------------------------------------------------------------ */
/* Reading the input                                                   */
/* ------------------------------------------------------------------ */

uint8_t in_u8(struct fz_in *in)
{
	if (!in->n)
		return 0;
	in->n--;
	return *in->p++;
}

static uint16_t in_u16(struct fz_in *in)
{
	uint16_t lo = in_u8(in);

	return (uint16_t)(lo | (uint16_t)in_u8(in) << 8);
}

static uint32_t in_u32(struct fz_in *in)
{
	uint32_t lo = in_u16(in);

	return lo | (uint32_t)in_u16(in) << 16;
}

static uint64_t in_u64(struct fz_in *in)
{
	uint64_t lo = in_u32(in);

	return lo | (uint64_t)in_u32(in) << 32;
}

/* Copy up to `len` input bytes into `dst`; the rest of `dst` is zeroed. */
static void in_bytes(struct fz_in *in, void *dst, size_t len)
{
	size_t k = len < in->n ? len : in->n;

	memcpy(dst, in->p, k);
	memset((uint8_t *)dst + k, 0, len - k);
	in->p += k;
	in->n -= k;
}

/* ------------------------------------------------------------------ */
/* Actions                                                             */
/* ------------------------------------------------------------------ */

const char *const job_names[FZ_JOBS] = { "fz0", "fz1", "fz2" };

static void hello_fill(struct shardd_hello *h, int job, uint32_t rank, uint32_t replicate,
		       uint32_t shard, uint32_t sq_entries)
{
	memset(h, 0, sizeof(*h));
	h->major = SHARDD_PROTO_MAJOR;
	h->minor = SHARDD_PROTO_MINOR;
	h->pid = (uint32_t)getpid();
	snprintf(h->job, sizeof(h->job), "%s", job_names[job]);
	h->rank = rank;
	h->replicate = replicate;
	h->shard = shard;
	h->device = SHARDD_HELLO_DEVICE_HOST;
	h->sq_entries = sq_entries;
}

void act_hello(struct fz_in *in)
{
	static const uint32_t sq[] = { 8, 16, 8, 0, 4, 12, 65536, 131072 };
	struct fz_client *c = client_pick(in);
	struct shardd_hello h;
	uint32_t len = sizeof(h);
	int job = in_u8(in) % FZ_JOBS;
	uint32_t rank = in_u8(in) % 8, replicate = 1 + in_u8(in) % 2, shard = 1 + in_u8(in) % 4;
	uint32_t sq_entries = sq[in_u8(in) % 8];

	hello_fill(&h, job, rank, replicate, shard, sq_entries);
	switch (in_u8(in) % 16) {
	case 0:
		h.major = in_u16(in);
		break;
	case 1:
		h.pid = in_u32(in);
		break;
	case 2:
		in_bytes(in, h.job, in_u8(in) % (sizeof(h.job) + 1));
		break;
	case 3:
		h.rank = in_u32(in);
		break;
	case 4:
		h.replicate = in_u32(in);
		break;
	case 5:
		h.shard = in_u32(in);
		break;
	case 6:
		h.device = (int32_t)in_u32(in);
		break;
	case 7:
		h.sq_entries = in_u32(in);
		break;
	case 8:
		h.flags = in_u32(in);
		break;
	case 9: {
		uint8_t at = in_u8(in) % sizeof(h.rsvd);

		h.rsvd[at] = in_u8(in);
		break;
	}
	case 10:
		len = in_u8(in) % (sizeof(h) + 16);
		break;
	default:
		break;
	}
	if (!c)
		return;
	if (len > sizeof(h)) {
		uint8_t big[sizeof(h) + 16] = { 0 };

		memcpy(big, &h, sizeof(h));
		client_send(c, SHARDD_MSG_HELLO, 0, big, len);
	} else {
		client_send(c, SHARDD_MSG_HELLO, 0, &h, len);
	}
	if (c->job < 0)
		c->job = job;
	c->rank = h.rank;
	turn();
}

void act_msg(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);
	uint16_t type = in_u8(in) % (SHARDD_MSG_COUNT + 2);
	uint16_t flags = in_u8(in) < 8 ? in_u16(in) : 0;
	uint32_t len = in_u16(in) % 1024;
	uint8_t payload[1024];

	in_bytes(in, payload, len);
	if (!c)
		return;
	client_send(c, type, flags, payload, len);
	turn();
}

void act_raw(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);
	uint8_t mode = in_u8(in);
	uint32_t len = mode & 0x80 ? SHARDD_CTRL_CHUNK + 1 + in_u8(in) : in_u16(in) % 2048;
	int nfds = in_u8(in) % 4, fds[4];
	uint8_t kinds[4];
	struct iovec iov;
	uint8_t *buf;

	in_bytes(in, kinds, sizeof(kinds));
	if (!c || c->eof)
		return;
	buf = calloc(1, len ? len : 1);
	if (!buf)
		fail("out of memory");
	/* The first bytes: often a valid header, so the payload checks are reached. */
	if (len >= sizeof(struct shardd_msg_hdr) && (mode & 1)) {
		struct shardd_msg_hdr h = { SHARDD_MAGIC, (uint16_t)(mode >> 1 & 15), 0,
					    (uint32_t)(len - sizeof(h)), ++st.seq };

		memcpy(buf, &h, sizeof(h));
		in_bytes(in, buf + sizeof(h), (len - sizeof(h)) < 256 ? len - sizeof(h) : 256);
	} else {
		in_bytes(in, buf, len < 256 ? len : 256);
	}
	for (int i = 0; i < nfds; i++)
		if ((fds[i] = some_fd(c, kinds[i])) < 0)
			fail("creating an fd to send: %s", strerror(errno));
	iov = (struct iovec){ buf, len };
	c->loose = 1;
	shardd_ctrl_send_dgram(c->fd, &iov, 1, fds, nfds, MSG_DONTWAIT);
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
	free(buf);
	turn();
}

void act_split(struct fz_in *in)
{
	static const uint32_t lengths[] = { 100, SHARDD_CTRL_CHUNK, 70000, 140000 };
	struct fz_client *c = client_pick(in);
	uint16_t type = in_u8(in) % SHARDD_MSG_COUNT;
	uint32_t len = lengths[in_u8(in) % 4];
	uint8_t fault = in_u8(in) % 6, fill[64];
	struct shardd_msg_hdr h = { SHARDD_MAGIC, type, 0, len, 0 };
	uint32_t sent = 0, total;
	uint8_t *buf;
	int ok = 1;

	in_bytes(in, fill, sizeof(fill));
	if (!c || c->eof)
		return;
	if (fault == 4)
		h.length = (c->attached ? SHARDD_CTRL_MAX : 1u << 20) + 1;
	total = len + (fault == 2);
	buf = malloc(total);
	if (!buf)
		fail("out of memory");
	for (uint32_t i = 0; i < total; i++)
		buf[i] = fill[i % sizeof(fill)];
	h.seq = ++st.seq;
	do {
		uint32_t room = SHARDD_CTRL_CHUNK - (sent ? 0 : sizeof(h));
		uint32_t n = total - sent < room ? total - sent : room;
		struct iovec iov[2];
		int k = 0, fd = -1;

		if (!sent)
			iov[k++] = (struct iovec){ &h, sizeof(h) };
		if (n)
			iov[k++] = (struct iovec){ buf + sent, n };
		if (fault == 1 && sent)
			fd = some_fd(c, fill[0]);
		if (shardd_ctrl_send_dgram(c->fd, iov, k, fd >= 0 ? &fd : NULL, fd >= 0,
					   MSG_DONTWAIT) < 0)
			ok = 0;
		if (fd >= 0)
			close(fd);
		sent += n;
		/* The daemon reads as we go, or the socket would fill up. */
		daemon_turn();
	} while (ok && sent < total && !(fault == 3 && sent >= SHARDD_CTRL_CHUNK));
	free(buf);
	if (fault == 0 && ok && (type != SHARDD_MSG_GOODBYE || !c->attached))
		expect_reply(c, h.seq, type);
	else if (fault != 0 || !ok)
		c->loose = 1;
	turn();
}

static const uint64_t dims[16] = {
	0, 1, 2, 3, 4, 5, 7, 8, 16, 17, 63, 64, 100, 1000, (uint64_t)1 << 40, UINT64_MAX,
};

/*
 * A REGISTER_GROUP payload from the input into `buf`: 1..4 params with
 * shapes from `dims`, and now and then one field mutated. Returns its length.
 */
static uint32_t register_build(struct fz_in *in, uint8_t *buf)
{
	struct shardd_register_group g;
	uint32_t n = 1 + in_u8(in) % 4, len;
	uint8_t mut = in_u8(in);

	memset(&g, 0, sizeof(g));
	snprintf(g.name, sizeof(g.name), "g%u", in_u8(in) % 4);
	g.nparams = n;
	g.param_dtype = in_u8(in) % 5;
	g.reduce_dtype = in_u8(in) % 5;
	if (mut == 1)
		g.init = in_u32(in);
	if (mut == 2)
		g.flags = in_u32(in);
	if (mut == 3)
		g.nparams = in_u32(in);
	if (mut == 4)
		in_bytes(in, g.name, sizeof(g.name));
	/* Rank-executed now and then (asked; the daemon's auto is the daemon's), or junk. */
	g.exec = mut == 6 ? in_u32(in) : mut & 0x10 ? SHARDD_EXEC_RANKS : SHARDD_EXEC_AUTO;
	memcpy(buf, &g, sizeof(g));
	for (uint32_t i = 0; i < n; i++) {
		struct shardd_param_spec s;
		uint8_t sel = in_u8(in);

		memset(&s, 0, sizeof(s));
		snprintf(s.name, sizeof(s.name), "p%u", sel & 0x80 ? 0 : i);
		s.dtype = 1 + in_u8(in) % 3;
		s.ndim = in_u8(in) % 4;
		s.shard_dim = sel & 0x40 ? in_u8(in) % 3 : 0;
		for (uint32_t d = 0; d < s.ndim; d++)
			s.shape[d] = dims[in_u8(in) % 16];
		switch (sel & 7) {
		case 1:
			s.dtype = in_u32(in);
			break;
		case 2:
			s.ndim = in_u32(in);
			break;
		case 3:
			s.flags = in_u32(in);
			break;
		case 4: {
			uint8_t at = in_u8(in) % SHARDD_MAX_DIMS;

			s.shape[at] = in_u64(in);
			break;
		}
		case 5:
			in_bytes(in, s.name, sizeof(s.name));
			break;
		default:
			break;
		}
		memcpy(buf + sizeof(g) + i * sizeof(s), &s, sizeof(s));
	}
	len = (uint32_t)(sizeof(g) + n * sizeof(struct shardd_param_spec));
	if (mut == 5)
		len -= in_u8(in) % len;
	return len;
}

#define REGISTER_BUF (sizeof(struct shardd_register_group) + 4 * sizeof(struct shardd_param_spec))

void act_register(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);
	uint8_t buf[REGISTER_BUF];
	uint32_t len = register_build(in, buf);

	if (!c)
		return;
	client_send(c, SHARDD_MSG_REGISTER_GROUP, 0, buf, len);
	turn();
}

/* The same registration from every live rank of a job, one of them maybe altered. */
void act_register_all(struct fz_in *in)
{
	int job = in_u8(in) % FZ_JOBS;
	uint8_t odd = in_u8(in), pos = in_u8(in), val = in_u8(in);
	uint8_t buf[REGISTER_BUF];
	uint32_t len = register_build(in, buf);

	for (unsigned i = 0; i < st.nclients; i++) {
		struct fz_client *c = &st.c[i];
		uint8_t copy[REGISTER_BUF];

		if (c->job != job || !c->attached || c->fd < 0)
			continue;
		memcpy(copy, buf, len);
		/* One rank disagrees on one byte: a mismatch every rank must hear of. */
		if (odd == i)
			copy[pos % len] ^= val | 1;
		client_send(c, SHARDD_MSG_REGISTER_GROUP, 0, copy, len);
	}
	settle();
}

void act_open(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);
	struct shardd_open_group o;
	uint8_t sel = in_u8(in);
	uint32_t len = sizeof(o);

	memset(&o, 0, sizeof(o));
	snprintf(o.name, sizeof(o.name), "g%u", sel % 4);
	if (sel & 0x40)
		in_bytes(in, o.name, sizeof(o.name));
	if (sel & 0x80)
		len = in_u8(in) % sizeof(o);
	if (!c)
		return;
	client_send(c, SHARDD_MSG_OPEN_GROUP, 0, &o, len);
	turn();
}

void act_admin(struct fz_in *in)
{
	static const char *const whats[] = { "param", "grad", "unsharded", "bogus" };
	struct fz_client *c = client_pick(in);
	char text[512];
	uint8_t sel = in_u8(in) % 10;
	const char *job = in_u8(in) & 0x80 ? "nojob" : job_names[in_u8(in) % FZ_JOBS];
	unsigned group = in_u8(in) % 5, param = in_u8(in) % 5;
	int len;

	switch (sel) {
	case 0:
		len = snprintf(text, sizeof(text), "{\"cmd\":\"status\"}");
		break;
	case 1:
		len = snprintf(text, sizeof(text), "{\"cmd\":\"jobs\"}");
		break;
	case 2:
		len = snprintf(text, sizeof(text), "{\"cmd\":\"ranks\",\"job\":\"%s\"}", job);
		break;
	case 3:
		len = snprintf(text, sizeof(text), "{\"cmd\":\"groups\",\"job\":\"%s\"}", job);
		break;
	case 4:
		len = snprintf(text, sizeof(text),
			       "{\"cmd\":\"show\",\"job\":\"%s\",\"group\":\"g%u\"}", job, group);
		break;
	case 5: {
		int64_t a = (int8_t)in_u8(in), b = in_u16(in), lim = (int16_t)in_u16(in);
		const char *what = whats[in_u8(in) % 4];
		unsigned rank = in_u8(in) % 9;

		len = snprintf(
			text, sizeof(text),
			"{\"cmd\":\"dump\",\"job\":\"%s\",\"group\":\"g%u\",\"param\":\"p%u\","
			"\"what\":\"%s\",\"rank\":%u,\"rows\":[%" PRId64 ",%" PRId64 "],"
			"\"limit\":%" PRId64 "}",
			job, group, param, what, rank, a, b, lim);
		break;
	}
	case 6:
		len = snprintf(text, sizeof(text), "{\"cmd\":\"stats\"}");
		break;
	case 7:
		len = snprintf(text, sizeof(text), "{\"cmd\":\"metrics\"}");
		break;
	default:
		len = in_u8(in);
		in_bytes(in, text, (size_t)len);
		break;
	}
	if (!c)
		return;
	client_send(c, SHARDD_MSG_ADMIN, 0, text, (uint32_t)len);
	turn();
}

void act_goodbye(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);

	if (!c)
		return;
	client_send(c, SHARDD_MSG_GOODBYE, 0, NULL, 0);
	turn();
}

void act_close(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);

	if (!c)
		return;
	client_close(c);
	turn();
}

void act_shut_wr(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);

	if (!c)
		return;
	shutdown(c->fd, SHUT_WR);
	/* Whatever it had asked is no longer owed once the daemon sees the hang-up. */
	c->loose = 1;
	turn();
}

/* Push one entry from client `c`; the harness owns user_data's low half. */
static void push_sqe(struct fz_client *c, struct shardd_sqe *sqe, uint32_t tag)
{
	if (!c->ring_mem || c->eof || st.nops == FZ_OPS || shardd_sq_next_slot(&c->ring) < 0)
		return;
	sqe->user_data = (uint64_t)tag << 32 | (st.nops + 1);
	st.ops[st.nops++] = (struct fz_op){ .client = (int)(c - st.c), .sqe = *sqe };
	shardd_sq_push(&c->ring, sqe);
	if (shardd_ring_needs_wakeup(&c->ring)) {
		uint64_t one = 1;

		if (write(c->doorbell, &one, sizeof(one)) != sizeof(one))
			fail("ringing the doorbell: %s", strerror(errno));
	}
}

static uint32_t pick_group(struct fz_in *in, const struct fz_client *c)
{
	uint8_t sel = in_u8(in);

	if (sel < 16 && c->ngroups)
		return c->groups[sel % c->ngroups];
	if (sel < 200)
		return c->ngroups ? c->groups[sel % c->ngroups] : 1 + sel % 4;
	return sel < 230 ? 0 : in_u32(in);
}

void act_sqe(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);
	struct shardd_sqe sqe;
	uint8_t mut = in_u8(in);
	uint32_t tag = in_u32(in);

	memset(&sqe, 0, sizeof(sqe));
	sqe.op = in_u8(in) % (SHARDD_OP_COUNT + 1);
	if (!c)
		return;
	sqe.group = sqe.op > SHARDD_OP_BARRIER ? pick_group(in, c) : 0;
	sqe.step = mut & 0x80 ? in_u64(in) : in_u8(in) % 4;
	sqe.flags = mut & 0x40 ? in_u32(in) : in_u8(in) % 2 && sqe.op == SHARDD_OP_REDUCE;
	switch (mut & 15) {
	case 1:
		sqe.fence = in_u8(in);
		break;
	case 2: {
		uint8_t at = in_u8(in) % 2;

		sqe.rsvd0[at] = in_u8(in);
		break;
	}
	case 3:
		sqe.rsvd1 = in_u32(in);
		break;
	case 4: {
		uint8_t at = in_u8(in) % 4;

		sqe.arg[at] = in_u64(in);
		break;
	}
	case 5:
		sqe.group = in_u32(in);
		break;
	default:
		break;
	}
	push_sqe(c, &sqe, tag);
	turn();
}

/* The same op from every live rank of one job: collectives that complete. */
void act_sqe_burst(struct fz_in *in)
{
	static const uint8_t ops[] = {
		SHARDD_OP_UNSHARD, SHARDD_OP_REDUCE,  SHARDD_OP_RESHARD, SHARDD_OP_ZERO_GRAD,
		SHARDD_OP_BARRIER, SHARDD_OP_UNSHARD, SHARDD_OP_REDUCE,  SHARDD_OP_NOP,
	};
	int job = in_u8(in) % FZ_JOBS;
	uint8_t op = ops[in_u8(in) % 8], gsel = in_u8(in), skip = in_u8(in);
	uint64_t step = in_u8(in) % 4;
	uint32_t flags = op == SHARDD_OP_REDUCE ? in_u8(in) % 2 : 0;

	for (unsigned i = 0; i < st.nclients; i++) {
		struct fz_client *c = &st.c[i];
		struct shardd_sqe sqe;

		/* One rank may stay out (skip < nclients): a rendezvous left waiting. */
		if (c->job != job || !c->attached || c->fd < 0 || i == skip)
			continue;
		memset(&sqe, 0, sizeof(sqe));
		sqe.op = op;
		sqe.group = op > SHARDD_OP_BARRIER && c->ngroups ? c->groups[gsel % c->ngroups] : 0;
		if (op > SHARDD_OP_BARRIER && !sqe.group)
			sqe.group = 1 + gsel % 4;
		sqe.step = step;
		sqe.flags = flags;
		push_sqe(c, &sqe, (uint32_t)i);
	}
	settle();
}

/* A client (new connection) HELLOs as `rank` of `job` with the job's mesh. */
struct fz_client *attach_rank(int job, uint32_t rank)
{
	struct fz_client *c = client_connect();
	struct shardd_hello h;

	if (!c)
		return NULL;
	hello_fill(&h, job, rank, st.jobs[job].replicate, st.jobs[job].shard, 8);
	client_send(c, SHARDD_MSG_HELLO, 0, &h, sizeof(h));
	c->job = job;
	c->rank = rank;
	settle();
	return c;
}

void act_reattach(struct fz_in *in)
{
	int job = in_u8(in) % FZ_JOBS;
	uint32_t rank = in_u8(in);
	struct fz_job *fj = &st.jobs[job];

	if (!fj->replicate)
		return;
	rank %= fj->replicate * fj->shard;
	attach_rank(job, rank);
}

void act_write_buf(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);
	int which = in_u8(in) % 2;
	uint16_t off = in_u16(in);
	uint8_t len = in_u8(in), bytes[255];

	in_bytes(in, bytes, len);
	if (!c || c->buf_fd[which] < 0 || !c->buf_size[which])
		return;
	off %= c->buf_size[which];
	if (len > c->buf_size[which] - off)
		len = (uint8_t)(c->buf_size[which] - off);
	/*
	 * NaN, Inf and denormal patterns come as they are: the kernels must take
	 * any bits. A rank-executed group's buffer refuses writes once sealed
	 * for its peers (EXEC_MAP): what the seal is for.
	 */
	if (pwrite(c->buf_fd[which], bytes, len, off) < 0 && errno != EPERM)
		fail("writing a buffer the daemon lent: %s", strerror(errno));
}

/*
 * EXEC_MAP: of the client's own rank (its buffers get sealed), of a peer,
 * of a rank or group out of range, or a payload of the wrong length; the
 * reply (a peer's fds included) is read and dropped by turn().
 */
void act_exec_map(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);
	uint8_t sel = in_u8(in);
	struct shardd_exec_map m = { .group_id = in_u8(in) % 6, .peer = in_u8(in) % 5 };
	uint32_t len = sizeof(m);

	if (sel & 0x40)
		m.peer = in_u32(in);
	if (sel & 0x80)
		len = in_u8(in) % sizeof(m);
	if (!c)
		return;
	client_send(c, SHARDD_MSG_EXEC_MAP, 0, &m, len);
	turn();
}

void act_turn(struct fz_in *in)
{
	for (int i = in_u8(in) % 3; i >= 0; i--)
		turn();
}

/* The crons run as if time had jumped: handshake and collective timeouts fire. */
void act_cron(struct fz_in *in)
{
	static const double jumps[] = { 0.2, SHD_HANDSHAKE_TIMEOUT_DEFAULT_S + 1,
					SHD_TIMEOUT_DEFAULT_S + 1, 0 };
	uint64_t now = shd_now_ns() + (uint64_t)(jumps[in_u8(in) % 4] * 1e9);

	for (struct shd_job *j = server.jobs, *next; j; j = next) {
		next = j->next;
		shd_job_cron(j, now);
	}
	shd_engine_cron(server.engine, now);
	shd_session_cron(now);
	turn();
}

/* SPDX-License-Identifier: MIT */
/*
 * The fake clients of the fuzz targets (fuzz_harness.h): what they receive
 * (replies, GROUP buffers, completions, matched against what they sent) and
 * what they send.
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
#include "shardd_exec.h"
#include "shardd_proto.h"
#include "shardd_ring.h"

#include "fuzz_daemon.h"
#include "fuzz_harness.h"

/* ------------------------------------------------------------------ */
/* Clients: what they receive                                          */
/* ------------------------------------------------------------------ */

static void client_drop_bufs(struct fz_client *c)
{
	for (int i = 0; i < 2; i++) {
		if (c->buf_fd[i] >= 0)
			close(c->buf_fd[i]);
		c->buf_fd[i] = -1;
	}
}

/* The reply to `seq`: take it off the pending list. */
static void client_answered(struct fz_client *c, uint32_t seq, uint16_t reply_type,
			    uint16_t *req_type)
{
	for (unsigned i = 0; i < c->npending; i++) {
		if (c->pending[i].seq == seq) {
			*req_type = c->pending[i].type;
			c->pending[i] = c->pending[--c->npending];
			return;
		}
	}
	*req_type = 0;
	if (!c->loose)
		fail("client %td got a reply (type %u) to seq %u, which it never sent or which "
		     "was answered already",
		     c - st.c, reply_type, seq);
}

static void client_welcome(struct fz_client *c, const uint8_t *p, uint32_t len)
{
	struct shardd_welcome w;
	void *mem;
	int ret;

	if (len != sizeof(w) || c->rx.nfds != 2)
		fail("WELCOME of %u bytes with %d fds", len, c->rx.nfds);
	if (c->attached)
		fail("client %td was welcomed twice", c - st.c);
	memcpy(&w, p, sizeof(w));
	mem = mmap(NULL, w.ring_size, PROT_READ | PROT_WRITE, MAP_SHARED, c->rx.fds[0], 0);
	if (mem == MAP_FAILED)
		fail("mapping the ring of %" PRIu64 " bytes: %s", w.ring_size, strerror(errno));
	ret = shardd_ring_attach(&c->ring, mem, w.ring_size);
	if (ret < 0)
		fail("the daemon's ring does not attach: %d", ret);
	c->ring_mem = mem;
	c->ring_size = w.ring_size;
	c->doorbell = c->rx.fds[1];
	c->rx.fds[1] = -1;
	c->attached = 1;
}

static void client_group(struct fz_client *c, const uint8_t *p, uint32_t len)
{
	struct shardd_group_reply r;
	int nfd = 0;

	if (len < sizeof(r))
		fail("GROUP reply of %u bytes", len);
	memcpy(&r, p, sizeof(r));
	for (int i = 0; i < SHARDD_GROUP_BUFS; i++)
		nfd += r.export_kind[i] == SHARDD_EXPORT_FD;
	if (r.exec != SHARDD_EXEC_DAEMON && r.exec != SHARDD_EXEC_RANKS)
		fail("GROUP reply with exec %u", r.exec);
	/* A rank-executed group's sync page comes after the buffers; rx's reset closes it. */
	if (nfd + (r.exec == SHARDD_EXEC_RANKS) != c->rx.nfds || nfd != SHARDD_GROUP_BUFS)
		fail("GROUP reply with %d fds, export kinds say %d (host backend: 4) and exec %u",
		     c->rx.nfds, nfd, r.exec);
	if (r.group_id == 0)
		fail("GROUP reply with group id 0");
	if (c->ngroups < FZ_GROUPS)
		c->groups[c->ngroups++] = r.group_id;
	client_drop_bufs(c);
	/* Buffers in order: unsharded, grad, flat shard, sharded grad. */
	c->buf_fd[0] = c->rx.fds[1];
	c->buf_size[0] = r.grad_size;
	c->buf_fd[1] = c->rx.fds[2];
	c->buf_size[1] = r.shard_size;
	c->rx.fds[1] = c->rx.fds[2] = -1;
}

static void client_message(struct fz_client *c)
{
	const struct shardd_msg_hdr *h = &c->rx.hdr;
	const uint8_t *p = c->rx.payload;
	uint32_t len = c->rx.have;
	uint16_t req = 0;

	if (trace)
		fprintf(stderr, "shardd fuzz: client %td: reply type %u seq %u, %u bytes%s%.*s\n",
			c - st.c, h->type, h->seq, len, h->type == SHARDD_MSG_ERROR ? ": " : "",
			h->type == SHARDD_MSG_ERROR && len > 8 ? (int)len - 8 : 0, p + 8);

	if (h->flags)
		fail("daemon message with flags 0x%x", h->flags);
	switch (h->type) {
	case SHARDD_MSG_WELCOME:
		client_answered(c, h->seq, h->type, &req);
		client_welcome(c, p, len);
		break;
	case SHARDD_MSG_ERROR: {
		struct shardd_error_msg e;

		client_answered(c, h->seq, h->type, &req);
		if (len < sizeof(e))
			fail("ERROR reply of %u bytes", len);
		memcpy(&e, p, sizeof(e));
		if (e.code >= 0 || e.msg_len != len - sizeof(e) || e.msg_len == 0)
			fail("ERROR reply with code %d and %u bytes of text in %u bytes", e.code,
			     e.msg_len, len);
		if (c->rx.nfds)
			fail("ERROR reply with %d fds", c->rx.nfds);
		break;
	}
	case SHARDD_MSG_GROUP:
		client_answered(c, h->seq, h->type, &req);
		client_group(c, p, len);
		break;
	case SHARDD_MSG_EXEC_MAP_REPLY: {
		struct shardd_exec_map_reply m;

		client_answered(c, h->seq, h->type, &req);
		if (len != sizeof(m))
			fail("EXEC_MAP_REPLY of %u bytes", len);
		memcpy(&m, p, sizeof(m));
		if ((m.nfds != 0 && m.nfds != 2) || (int)m.nfds != c->rx.nfds || !m.gen ||
		    m.gen == SHARDD_EXEC_GONE)
			fail("EXEC_MAP_REPLY with %u fds (%d came), gen %u", m.nfds, c->rx.nfds,
			     m.gen);
		break;
	}
	case SHARDD_MSG_ADMIN_REPLY: {
		json_t *j = json_loadb((const char *)p, len, 0, NULL);

		client_answered(c, h->seq, h->type, &req);
		if (!j || !json_is_boolean(json_object_get(j, "ok")))
			fail("admin reply is not a JSON object with \"ok\": %.*s", (int)len, p);
		json_decref(j);
		break;
	}
	default:
		fail("daemon message of type %u (%u bytes) to a client of the host backend",
		     h->type, len);
	}
	if (req && !c->loose && req != SHARDD_MSG_ADMIN && h->type == SHARDD_MSG_ADMIN_REPLY)
		fail("an ADMIN_REPLY answered a request of type %u", req);
}

static void op_done(struct fz_client *c, const struct shardd_cqe *cqe, const char *msg)
{
	uint64_t i = (cqe->user_data & 0xffffffffu) - 1;
	struct fz_op *op = i < st.nops ? &st.ops[i] : NULL;

	if (!op || op->sqe.user_data != cqe->user_data || op->client != c - st.c)
		fail("client %td got a completion for user_data 0x%" PRIx64 ", which it never "
		     "submitted",
		     c - st.c, cqe->user_data);
	if (op->done)
		fail("client %td got a second completion for user_data 0x%" PRIx64
		     " (%s, step %" PRIu64 ")",
		     c - st.c, cqe->user_data,
		     shardd_op_name(cqe->op) ? shardd_op_name(cqe->op) : "?", cqe->step);
	if (cqe->op != op->sqe.op || cqe->group != op->sqe.group || cqe->step != op->sqe.step)
		fail("completion echoes op %u group %u step %" PRIu64 " for an entry of op %u "
		     "group %u step %" PRIu64,
		     cqe->op, cqe->group, cqe->step, op->sqe.op, op->sqe.group, op->sqe.step);
	if (cqe->res < 0 && (!cqe->has_msg || !msg[0]))
		fail("error completion %d of op %u without a message", cqe->res, cqe->op);
	op->done = 1;
	op->res = cqe->res;
	if (trace)
		fprintf(stderr, "shardd fuzz: client %td: %s group %u step %" PRIu64 " -> %d %s\n",
			c - st.c, shardd_op_name(cqe->op) ? shardd_op_name(cqe->op) : "?",
			cqe->group, cqe->step, cqe->res, cqe->res < 0 ? msg : "");
}

/* Read every reply and completion waiting for the client. */
static void client_poll(struct fz_client *c)
{
	while (c->fd >= 0 && !c->eof) {
		int fds[SHARDD_CTRL_MAX_FDS], nfds, ret;
		ssize_t n = shardd_ctrl_recv_dgram(c->fd, dgram, fds, &nfds, MSG_DONTWAIT);

		if (n == -EAGAIN)
			break;
		if (n <= 0) {
			c->eof = 1;
			break;
		}
		ret = shardd_ctrl_rx_feed(&c->rx, dgram, (size_t)n, fds, nfds, SHARDD_CTRL_MAX);
		if (ret < 0)
			fail("client %td: the daemon sent a malformed message (%d)", c - st.c, ret);
		if (ret == 1) {
			client_message(c);
			/* Fds the message handlers kept were replaced by -1; close the rest. */
			for (int i = 0; i < c->rx.nfds; i++)
				if (c->rx.fds[i] >= 0)
					close(c->rx.fds[i]);
			c->rx.nfds = 0;
			shardd_ctrl_rx_reset(&c->rx);
		}
	}
	if (c->ring_mem) {
		int64_t ready = shardd_cq_ready(&c->ring);

		if (ready < 0)
			fail("client %td: the daemon's CQ tail is corrupt", c - st.c);
		while (ready-- > 0) {
			struct shardd_cqe cqe;
			char msg[SHARDD_RING_MSG_SIZE];

			shardd_cq_peek(&c->ring, &cqe, msg, sizeof(msg));
			shardd_cq_release(&c->ring);
			op_done(c, &cqe, msg);
		}
	}
}

static void clients_poll(void)
{
	for (unsigned i = 0; i < st.nclients; i++)
		client_poll(&st.c[i]);
}

void turn(void)
{
	daemon_turn();
	clients_poll();
	check_memory();
}

/* Is everything a live client sent taken by the daemon? */
static int clients_settled(void)
{
	for (unsigned i = 0; i < st.nclients; i++) {
		struct fz_client *c = &st.c[i];
		int outq = 0;

		if (c->fd < 0 || c->eof)
			continue;
		if (ioctl(c->fd, SIOCOUTQ, &outq) == 0 && outq > 0)
			return 0;
		if (c->ring_mem && shardd_sq_ready(&c->ring) > 0)
			return 0;
	}
	return 1;
}

void settle(void)
{
	for (int i = 0; i < FZ_SETTLE; i++) {
		turn();
		if (clients_settled())
			break;
	}
	turn();
}

/* ------------------------------------------------------------------ */
/* Clients: what they send                                             */
/* ------------------------------------------------------------------ */

struct fz_client *client_pick(struct fz_in *in)
{
	struct fz_client *c;

	if (!st.nclients)
		return NULL;
	c = &st.c[in_u8(in) % st.nclients];
	return c->fd >= 0 ? c : NULL;
}

struct fz_client *client_connect(void)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct fz_client *c;
	int fd;

	if (st.nclients == FZ_CLIENTS)
		return NULL;
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0)
		fail("socket: %s", strerror(errno));
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", server.cfg.socket_path);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
		fail("connect to the daemon: %s", strerror(errno));
	c = &st.c[st.nclients++];
	memset(c, 0, sizeof(*c));
	c->fd = fd;
	c->job = -1;
	c->doorbell = -1;
	c->buf_fd[0] = c->buf_fd[1] = -1;
	/* The daemon accepts it in its loop. */
	daemon_turn();
	return c;
}

void client_close(struct fz_client *c)
{
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
	if (c->ring_mem)
		munmap(c->ring_mem, c->ring_size);
	c->ring_mem = NULL;
	if (c->doorbell >= 0)
		close(c->doorbell);
	c->doorbell = -1;
	client_drop_bufs(c);
	shardd_ctrl_rx_reset(&c->rx);
}

void expect_reply(struct fz_client *c, uint32_t seq, uint16_t type)
{
	if (c->npending == FZ_PENDING) {
		c->loose = 1;
		return;
	}
	c->pending[c->npending++] = (struct fz_request){ .seq = seq, .type = type };
}

/* Send a framed message; a reply is expected unless it is GOODBYE. */
void client_send(struct fz_client *c, uint16_t type, uint16_t flags, const void *payload,
		 uint32_t len)
{
	uint32_t seq = ++st.seq;
	int ret;

	if (c->eof)
		return;
	if (flags) {
		/* shardd_ctrl_send writes flags 0: frame it by hand, one datagram. */
		struct shardd_msg_hdr h = { SHARDD_MAGIC, type, flags, len, seq };
		struct iovec iov[2] = { { &h, sizeof(h) }, { (void *)payload, len } };

		if (len > SHARDD_CTRL_CHUNK - sizeof(h))
			return;
		ret = (int)shardd_ctrl_send_dgram(c->fd, iov, len ? 2 : 1, NULL, 0, MSG_DONTWAIT);
	} else {
		ret = shardd_ctrl_send(c->fd, type, seq, payload, len, NULL, 0);
	}
	if (ret < 0) {
		/* The daemon closed it (EPIPE) or the socket is full: nothing is owed. */
		c->loose = 1;
		return;
	}
	/* An attached client's GOODBYE has no reply; anything else before HELLO is refused. */
	if (type != SHARDD_MSG_GOODBYE || !c->attached || flags)
		expect_reply(c, seq, type);
}

/* A descriptor of some kind, for SCM_RIGHTS. */
int some_fd(struct fz_client *c, uint8_t kind)
{
	switch (kind % 4) {
	case 0:
		return memfd_create("fuzz", MFD_CLOEXEC);
	case 1:
		return eventfd(0, EFD_CLOEXEC);
	case 2:
		/* The client's own socket: held by the daemon, it would keep the connection open. */
		return fcntl(c->fd, F_DUPFD_CLOEXEC, 0);
	default:
		return open("/dev/null", O_RDONLY | O_CLOEXEC);
	}
}

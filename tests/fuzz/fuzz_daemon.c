/* SPDX-License-Identifier: MIT */
/*
 * The in-process daemon and the fake clients of the fuzz targets
 * (fuzz_daemon.h). Loop thread = the fuzzer's thread: every daemon call
 * below runs on it, as the daemon's own loop would.
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

/*
 * The daemon runs with small memory limits, so that the fuzzer reaches its
 * own refusal (registry.c group_commit_memory) rather than a harness filter,
 * and an input never makes it commit more than FUZZ_MAX_MEMORY of buffers.
 */
#define FUZZ_MAX_MEMORY     ((uint64_t)32 << 20) /* --max-memory */
#define FUZZ_MAX_JOB_MEMORY ((uint64_t)16 << 20) /* --max-job-memory */
/* Heap the process may hold above its level at the start of an input. */
#define FUZZ_HEAP_CAP     ((size_t)256 << 20)

#define FZ_CLIENTS   32  /* connections per input: 3 jobs of 6 ranks and re-attaches */
#define FZ_PENDING   256 /* requests awaiting a reply, per client */
#define FZ_OPS       4096 /* ring entries per input */
#define FZ_GROUPS    16  /* group ids a client remembers */
#define FZ_JOBS      3   /* job names "fz0".."fz2" */
#define FZ_SETTLE    64  /* loop turns to let the daemon take everything sent */

/* ------------------------------------------------------------------ */
/* Failing a check                                                     */
/* ------------------------------------------------------------------ */

static const char *target_name = "?";

static void __attribute__((noreturn, format(printf, 1, 2))) fail(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "\nshardd fuzz (%s): invariant violated: ", target_name);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
	abort();
}

/* ------------------------------------------------------------------ */
/* Reading the input                                                   */
/* ------------------------------------------------------------------ */

struct fz_in {
	const uint8_t *p;
	size_t n;
};

static uint8_t in_u8(struct fz_in *in)
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
/* State of one input                                                  */
/* ------------------------------------------------------------------ */

struct fz_request {
	uint32_t seq;
	uint16_t type;
};

struct fz_client {
	int      fd;             /* our end of the connection; -1 once we closed it */
	int      eof;            /* the daemon closed the connection */
	int      loose;          /* sent unframed or malformed bytes: replies are not matched */
	int      attached;       /* welcomed */
	int      job;            /* index of the job named in its HELLO, -1 before */
	uint32_t rank;
	struct shardd_ctrl_rx rx;
	void    *ring_mem;
	uint64_t ring_size;
	struct shardd_ring ring;
	int      doorbell;
	struct fz_request pending[FZ_PENDING];
	unsigned npending;
	uint32_t groups[FZ_GROUPS];
	unsigned ngroups;
	int      buf_fd[2];      /* grad and flat shard of its last GROUP reply, or -1 */
	uint64_t buf_size[2];
};

struct fz_op {
	int      client;
	int      done;
	int      res;            /* the completion's */
	struct shardd_sqe sqe;
};

struct fz_job {
	uint32_t replicate, shard; /* the mesh the setup attached, 0 when none */
};

static struct {
	struct fz_client c[FZ_CLIENTS];
	unsigned nclients;
	struct fz_op ops[FZ_OPS];
	unsigned nops;
	struct fz_job jobs[FZ_JOBS];
	uint32_t seq;
	size_t   heap0;
} st;

static int trace;                      /* SHARDD_FUZZ_TRACE: print replies and completions */
static int stop_fd = -1;               /* written before each loop turn: ends it */
static char sock_dir[64];
static uint8_t dgram[SHARDD_CTRL_CHUNK];

/* ------------------------------------------------------------------ */
/* Process-wide checks                                                 */
/* ------------------------------------------------------------------ */

static int fd_count(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;

	if (!d)
		fail("cannot open /proc/self/fd: %s", strerror(errno));
	while ((e = readdir(d)))
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n - 1; /* the directory's own fd */
}

static void fd_list(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;

	if (!d)
		return;
	while ((e = readdir(d))) {
		char path[300], target[256];
		ssize_t n;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
		n = readlink(path, target, sizeof(target) - 1);
		target[n > 0 ? n : 0] = '\0';
		fprintf(stderr, "  fd %s -> %s\n", e->d_name, target);
	}
	closedir(d);
}

static uint64_t buf_bytes(void)
{
	struct shd_group_memory m;

	shd_jobs_memory_held(&m);
	return m.total;
}

static void check_memory(void)
{
	size_t heap = __sanitizer_get_current_allocated_bytes();
	uint64_t bufs = buf_bytes();

	if (heap > st.heap0 && heap - st.heap0 > FUZZ_HEAP_CAP)
		fail("the heap grew by %zu bytes within one input (cap %zu)", heap - st.heap0,
		     FUZZ_HEAP_CAP);
	if (bufs > FUZZ_MAX_MEMORY)
		fail("the daemon holds %" PRIu64 " bytes of buffers, past its --max-memory of %" PRIu64,
		     bufs, FUZZ_MAX_MEMORY);
}

/* ------------------------------------------------------------------ */
/* The daemon's loop                                                   */
/* ------------------------------------------------------------------ */

static void stop_readable(void *arg, int fd, uint32_t revents)
{
	uint64_t v;

	(void)arg;
	(void)revents;
	if (read(fd, &v, sizeof(v)) != sizeof(v))
		fail("reading the stop eventfd: %s", strerror(errno));
	shd_loop_stop(server.loop);
}

/*
 * One turn of the daemon's own loop: its before-sleep hook (backlogs, rings,
 * closes, reaps), then every event that is ready, the stop eventfd's among
 * them; the loop returns after dispatching that batch.
 */
static void daemon_turn(void)
{
	uint64_t one = 1;

	if (write(stop_fd, &one, sizeof(one)) != sizeof(one))
		fail("writing the stop eventfd: %s", strerror(errno));
	if (shd_loop_run(server.loop) < 0)
		fail("the daemon's loop failed");
}

/* The daemon is never shut down (the process just exits): remove its socket and directory. */
static void fuzz_cleanup(void)
{
	unlink(server.cfg.socket_path);
	rmdir(sock_dir);
}

static int fuzz_init(void)
{
	struct shd_config cfg;
	const char *lvl = getenv("SHARDD_FUZZ_LOG");
	sigset_t set;

	snprintf(sock_dir, sizeof(sock_dir), "/tmp/shardd-fuzz-XXXXXX");
	if (!mkdtemp(sock_dir)) {
		perror("shardd fuzz: mkdtemp");
		exit(1);
	}
	shd_config_defaults(&cfg);
	snprintf(cfg.socket_path, sizeof(cfg.socket_path), "%s/shardd.sock", sock_dir);
	cfg.workers = 1;
	cfg.max_memory = FUZZ_MAX_MEMORY;
	cfg.max_job_memory = FUZZ_MAX_JOB_MEMORY;
	trace = getenv("SHARDD_FUZZ_TRACE") != NULL;
	/* Silent unless asked: a line per refused input would slow the fuzzer down. */
	cfg.log_level = lvl ? shd_log_level_parse(lvl) : -1;
	if (shd_server_init(&cfg) < 0) {
		fprintf(stderr, "shardd fuzz: the daemon did not start\n");
		exit(1);
	}
	/* The daemon blocked them for its signalfd; libFuzzer handles them itself. */
	sigemptyset(&set);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigprocmask(SIG_UNBLOCK, &set, NULL);
	stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (stop_fd < 0 ||
	    shd_loop_add_fd(server.loop, stop_fd, POLLIN, stop_readable, NULL, NULL) < 0) {
		fprintf(stderr, "shardd fuzz: cannot register the stop eventfd\n");
		exit(1);
	}
	atexit(fuzz_cleanup);
	daemon_turn();
	return 0;
}

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
		     "was answered already", c - st.c, reply_type, seq);
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
	if (nfd != c->rx.nfds || nfd != SHARDD_GROUP_BUFS)
		fail("GROUP reply with %d fds, export kinds say %d (host backend: 4)", c->rx.nfds,
		     nfd);
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
	case SHARDD_MSG_ADMIN_REPLY: {
		json_t *j = json_loadb((const char *)p, len, 0, NULL);

		client_answered(c, h->seq, h->type, &req);
		if (!j || !json_is_boolean(json_object_get(j, "ok")))
			fail("admin reply is not a JSON object with \"ok\": %.*s", (int)len, p);
		json_decref(j);
		break;
	}
	default:
		fail("daemon message of type %u (%u bytes) to a client of the host backend", h->type,
		     len);
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
		     "submitted", c - st.c, cqe->user_data);
	if (op->done)
		fail("client %td got a second completion for user_data 0x%" PRIx64 " (%s, step %"
		     PRIu64 ")", c - st.c, cqe->user_data,
		     shardd_op_name(cqe->op) ? shardd_op_name(cqe->op) : "?", cqe->step);
	if (cqe->op != op->sqe.op || cqe->group != op->sqe.group || cqe->step != op->sqe.step)
		fail("completion echoes op %u group %u step %" PRIu64 " for an entry of op %u "
		     "group %u step %" PRIu64, cqe->op, cqe->group, cqe->step, op->sqe.op,
		     op->sqe.group, op->sqe.step);
	if (cqe->res < 0 && (!cqe->has_msg || !msg[0]))
		fail("error completion %d of op %u without a message", cqe->res, cqe->op);
	op->done = 1;
	op->res = cqe->res;
	if (trace)
		fprintf(stderr, "shardd fuzz: client %td: %s group %u step %" PRIu64 " -> %d %s\n",
			c - st.c, shardd_op_name(cqe->op) ? shardd_op_name(cqe->op) : "?", cqe->group,
			cqe->step, cqe->res, cqe->res < 0 ? msg : "");
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

static void turn(void)
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

static void settle(void)
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

static struct fz_client *client_pick(struct fz_in *in)
{
	struct fz_client *c;

	if (!st.nclients)
		return NULL;
	c = &st.c[in_u8(in) % st.nclients];
	return c->fd >= 0 ? c : NULL;
}

static struct fz_client *client_connect(void)
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

static void client_close(struct fz_client *c)
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

static void expect_reply(struct fz_client *c, uint32_t seq, uint16_t type)
{
	if (c->npending == FZ_PENDING) {
		c->loose = 1;
		return;
	}
	c->pending[c->npending++] = (struct fz_request){ .seq = seq, .type = type };
}

/* Send a framed message; a reply is expected unless it is GOODBYE. */
static void client_send(struct fz_client *c, uint16_t type, uint16_t flags, const void *payload,
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
static int some_fd(struct fz_client *c, uint8_t kind)
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

/* ------------------------------------------------------------------ */
/* Actions                                                             */
/* ------------------------------------------------------------------ */

static const char *const job_names[FZ_JOBS] = { "fz0", "fz1", "fz2" };

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

static void act_hello(struct fz_in *in)
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
	case 0: h.major = in_u16(in); break;
	case 1: h.pid = in_u32(in); break;
	case 2: in_bytes(in, h.job, in_u8(in) % (sizeof(h.job) + 1)); break;
	case 3: h.rank = in_u32(in); break;
	case 4: h.replicate = in_u32(in); break;
	case 5: h.shard = in_u32(in); break;
	case 6: h.device = (int32_t)in_u32(in); break;
	case 7: h.sq_entries = in_u32(in); break;
	case 8: h.flags = in_u32(in); break;
	case 9: {
		uint8_t at = in_u8(in) % sizeof(h.rsvd);

		h.rsvd[at] = in_u8(in);
		break;
	}
	case 10: len = in_u8(in) % (sizeof(h) + 16); break;
	default: break;
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

static void act_msg(struct fz_in *in)
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

static void act_raw(struct fz_in *in)
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

static void act_split(struct fz_in *in)
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
		if (shardd_ctrl_send_dgram(c->fd, iov, k, fd >= 0 ? &fd : NULL, fd >= 0, MSG_DONTWAIT) < 0)
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
		case 1: s.dtype = in_u32(in); break;
		case 2: s.ndim = in_u32(in); break;
		case 3: s.flags = in_u32(in); break;
		case 4: {
			uint8_t at = in_u8(in) % SHARDD_MAX_DIMS;

			s.shape[at] = in_u64(in);
			break;
		}
		case 5: in_bytes(in, s.name, sizeof(s.name)); break;
		default: break;
		}
		memcpy(buf + sizeof(g) + i * sizeof(s), &s, sizeof(s));
	}
	len = (uint32_t)(sizeof(g) + n * sizeof(struct shardd_param_spec));
	if (mut == 5)
		len -= in_u8(in) % len;
	return len;
}

#define REGISTER_BUF (sizeof(struct shardd_register_group) + 4 * sizeof(struct shardd_param_spec))

static void act_register(struct fz_in *in)
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
static void act_register_all(struct fz_in *in)
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

static void act_open(struct fz_in *in)
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

static void act_admin(struct fz_in *in)
{
	static const char *const whats[] = { "param", "grad", "unsharded", "bogus" };
	struct fz_client *c = client_pick(in);
	char text[512];
	uint8_t sel = in_u8(in) % 10;
	const char *job = in_u8(in) & 0x80 ? "nojob" : job_names[in_u8(in) % FZ_JOBS];
	unsigned group = in_u8(in) % 5, param = in_u8(in) % 5;
	int len;

	switch (sel) {
	case 0: len = snprintf(text, sizeof(text), "{\"cmd\":\"status\"}"); break;
	case 1: len = snprintf(text, sizeof(text), "{\"cmd\":\"jobs\"}"); break;
	case 2: len = snprintf(text, sizeof(text), "{\"cmd\":\"ranks\",\"job\":\"%s\"}", job); break;
	case 3: len = snprintf(text, sizeof(text), "{\"cmd\":\"groups\",\"job\":\"%s\"}", job); break;
	case 4:
		len = snprintf(text, sizeof(text), "{\"cmd\":\"show\",\"job\":\"%s\",\"group\":\"g%u\"}",
			       job, group);
		break;
	case 5: {
		int64_t a = (int8_t)in_u8(in), b = in_u16(in), lim = (int16_t)in_u16(in);
		const char *what = whats[in_u8(in) % 4];
		unsigned rank = in_u8(in) % 9;

		len = snprintf(text, sizeof(text),
			       "{\"cmd\":\"dump\",\"job\":\"%s\",\"group\":\"g%u\",\"param\":\"p%u\","
			       "\"what\":\"%s\",\"rank\":%u,\"rows\":[%" PRId64 ",%" PRId64 "],"
			       "\"limit\":%" PRId64 "}", job, group, param, what, rank, a, b, lim);
		break;
	}
	case 6: len = snprintf(text, sizeof(text), "{\"cmd\":\"stats\"}"); break;
	case 7: len = snprintf(text, sizeof(text), "{\"cmd\":\"metrics\"}"); break;
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

static void act_goodbye(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);

	if (!c)
		return;
	client_send(c, SHARDD_MSG_GOODBYE, 0, NULL, 0);
	turn();
}

static void act_close(struct fz_in *in)
{
	struct fz_client *c = client_pick(in);

	if (!c)
		return;
	client_close(c);
	turn();
}

static void act_shut_wr(struct fz_in *in)
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

static void act_sqe(struct fz_in *in)
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
	case 1: sqe.fence = in_u8(in); break;
	case 2: {
		uint8_t at = in_u8(in) % 2;

		sqe.rsvd0[at] = in_u8(in);
		break;
	}
	case 3: sqe.rsvd1 = in_u32(in); break;
	case 4: {
		uint8_t at = in_u8(in) % 4;

		sqe.rsvd2[at] = in_u64(in);
		break;
	}
	case 5: sqe.group = in_u32(in); break;
	default: break;
	}
	push_sqe(c, &sqe, tag);
	turn();
}

/* The same op from every live rank of one job: collectives that complete. */
static void act_sqe_burst(struct fz_in *in)
{
	static const uint8_t ops[] = {
		SHARDD_OP_UNSHARD, SHARDD_OP_REDUCE, SHARDD_OP_RESHARD, SHARDD_OP_ZERO_GRAD,
		SHARDD_OP_BARRIER, SHARDD_OP_UNSHARD, SHARDD_OP_REDUCE, SHARDD_OP_NOP,
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
static struct fz_client *attach_rank(int job, uint32_t rank)
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

static void act_reattach(struct fz_in *in)
{
	int job = in_u8(in) % FZ_JOBS;
	uint32_t rank = in_u8(in);
	struct fz_job *fj = &st.jobs[job];

	if (!fj->replicate)
		return;
	rank %= fj->replicate * fj->shard;
	attach_rank(job, rank);
}

static void act_write_buf(struct fz_in *in)
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
	/* NaN, Inf and denormal patterns come as they are: the kernels must take any bits. */
	if (pwrite(c->buf_fd[which], bytes, len, off) < 0)
		fail("writing a buffer the daemon lent: %s", strerror(errno));
}

static void act_turn(struct fz_in *in)
{
	for (int i = in_u8(in) % 3; i >= 0; i--)
		turn();
}

/* The crons run as if time had jumped: handshake and collective timeouts fire. */
static void act_cron(struct fz_in *in)
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

/* ------------------------------------------------------------------ */
/* One input                                                           */
/* ------------------------------------------------------------------ */

static void setup_jobs(struct fz_in *in, int njobs)
{
	njobs = 1 + in_u8(in) % njobs;
	for (int j = 0; j < njobs; j++) {
		st.jobs[j].replicate = 1 + in_u8(in) % 2;
		st.jobs[j].shard = 1 + in_u8(in) % 3;
		for (uint32_t r = 0; r < st.jobs[j].replicate * st.jobs[j].shard; r++) {
			struct fz_client *c = attach_rank(j, r);

			if (!c || !c->attached)
				fail("setup: job %s rank %u was not welcomed", job_names[j], r);
		}
	}
}

/* End every job and session as shardd's shutdown does, then check what is owed. */
/*
 * Every session is closed: every client still connected must reach EOF
 * within a few turns, or something of the daemon (a poll, a queue) still
 * holds its socket (finding F2 of docs/RELIABILITY.md).
 */
static void check_closed(void)
{
	for (int k = 0; k < FZ_SETTLE; k++) {
		unsigned open = 0;

		turn();
		for (unsigned i = 0; i < st.nclients; i++)
			open += st.c[i].fd >= 0 && !st.c[i].eof;
		if (!open)
			return;
	}
	for (unsigned i = 0; i < st.nclients; i++)
		if (st.c[i].fd >= 0 && !st.c[i].eof)
			fail("client %u: its session is closed, but the connection never reached EOF "
			     "after %d loop turns: the daemon still holds the socket", i, FZ_SETTLE);
}

static void input_end(void)
{
	int live[FZ_CLIENTS];

	settle();
	for (unsigned i = 0; i < st.nclients; i++)
		live[i] = st.c[i].fd >= 0 && !st.c[i].eof;
	/* Jobs first: collectives, barriers and registrations still waiting fail into live rings. */
	while (server.jobs)
		shd_job_destroy(server.jobs);
	turn();
	for (unsigned i = 0; i < st.nclients; i++) {
		struct fz_client *c = &st.c[i];

		if (!live[i])
			continue;
		if (!c->loose && c->npending)
			fail("client %u: %u request(s) never answered, the first seq %u type %u", i,
			     c->npending, c->pending[0].seq, c->pending[0].type);
		for (unsigned k = 0; k < st.nops; k++)
			if (st.ops[k].client == (int)i && !st.ops[k].done)
				fail("client %u: %s (group %u step %" PRIu64 ", user_data 0x%" PRIx64
				     ") never completed", i,
				     shardd_op_name(st.ops[k].sqe.op) ? shardd_op_name(st.ops[k].sqe.op)
								      : "?",
				     st.ops[k].sqe.group, st.ops[k].sqe.step, st.ops[k].sqe.user_data);
	}
	for (struct shd_session *s = server.sessions; s; s = s->next)
		shd_session_close(s, "the fuzz input ended");
	check_closed();
	for (unsigned i = 0; i < st.nclients; i++)
		client_close(&st.c[i]);
	/* Reap the sessions, and let the loop take back the events they cancelled. */
	daemon_turn();
	daemon_turn();
	if (server.sessions || server.jobs)
		fail("sessions or jobs outlive the input's end");
}

static int fuzz_run(const struct fuzz_target *t, const uint8_t *data, size_t size)
{
	struct fz_in in = { data, size };
	int fds0, fds1;

	target_name = t->name;
	memset(&st, 0, sizeof(st));
	fds0 = fd_count();
	st.heap0 = __sanitizer_get_current_allocated_bytes();
	if (t->attach_jobs)
		setup_jobs(&in, t->attach_jobs);
	while (in.n) {
		switch (t->actions[in_u8(&in) % t->nactions]) {
		case FZ_CONNECT: client_connect(); break;
		case FZ_HELLO: act_hello(&in); break;
		case FZ_MSG: act_msg(&in); break;
		case FZ_RAW: act_raw(&in); break;
		case FZ_SPLIT: act_split(&in); break;
		case FZ_REGISTER: act_register(&in); break;
		case FZ_REGISTER_ALL: act_register_all(&in); break;
		case FZ_OPEN: act_open(&in); break;
		case FZ_ADMIN: act_admin(&in); break;
		case FZ_GOODBYE: act_goodbye(&in); break;
		case FZ_CLOSE: act_close(&in); break;
		case FZ_SHUT_WR: act_shut_wr(&in); break;
		case FZ_SQE: act_sqe(&in); break;
		case FZ_SQE_BURST: act_sqe_burst(&in); break;
		case FZ_REATTACH: act_reattach(&in); break;
		case FZ_WRITE_BUF: act_write_buf(&in); break;
		case FZ_TURN: act_turn(&in); break;
		case FZ_CRON: act_cron(&in); break;
		case FZ_ACTION_COUNT: break;
		}
	}
	input_end();
	if (buf_bytes())
		fail("%" PRIu64 " bytes of buffers remain after every job ended", buf_bytes());
	fds1 = fd_count();
	if (fds1 != fds0) {
		fprintf(stderr, "shardd fuzz: open fds now:\n");
		fd_list();
		fail("the input leaked fds: %d open before it, %d after", fds0, fds1);
	}
	return 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	return fuzz_init();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	return fuzz_run(&fuzz_target, data, size);
}

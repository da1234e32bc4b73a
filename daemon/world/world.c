/* SPDX-License-Identifier: MIT */
/*
 * The daemon world (world.h): MPI on one communication thread.
 *
 * An exchange is a non-blocking send to and receive from every other node
 * on a private duplicate of MPI_COMM_WORLD, tagged by its key. Point-to-
 * point messages rather than MPI's collectives: a collective must be
 * started in the same order on every node of its communicator, and the
 * groups of a daemon's jobs finish their node-local halves in whatever
 * order their ranks arrive, which differs from node to node; tagged
 * messages match by (node, tag) whatever the order, and messages of one
 * key between two nodes never overtake each other (MPI's ordering rule),
 * so the exchanges of one group, which run one at a time, pair up.
 *
 * Each message is a header (key, seq, check, bytes) on the stream's even
 * tag and the payload on the odd tag after it, sent from and received into
 * the caller's shd_world_buf without a copy; a payload's receive is posted
 * only once its header is checked, so a late message of an exchange this
 * node gave up on never lands in the next one. The buffer is counted: a
 * caller that gave up at its deadline drops its reference while MPI may
 * still hold the memory: requests that cannot be cancelled (a send whose
 * peer is gone) are kept, with their reference, on a list tested on every
 * turn until MPI lets go of them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "clock.h"
#include "log.h"
#include "shardd_proto.h"
#include "world.h"

/* Seconds shd_world_stop waits for the communication thread to finalise MPI. */
#define WORLD_STOP_WAIT_S 10
/* Nanoseconds the communication thread sleeps between turns while an exchange waits for a peer. */
#define WORLD_POLL_NS 5000
/*
 * While payloads stream (see world_thread), turns follow each other
 * without sleeping, until no request of the streaming exchanges has
 * completed for this long: a peer that stops mid-payload costs a core for
 * at most this, then the 5 us polls again until the collective timeout.
 */
#define WORLD_STREAM_IDLE_NS (200ull * 1000 * 1000)
/*
 * Turns also follow each other for this long after an exchange was posted
 * or one of its requests completed, and the thread stays up this long
 * after its last exchange ended before it sleeps on the condition
 * variable: the nodes of an op arrive within about this of each other, and
 * an op's next exchange (the HSDP all-gather after its sum) follows within
 * it, so neither waits for a timer or a wake-up (tens of us each on a VM).
 */
#define WORLD_LINGER_NS (500ull * 1000)
/*
 * An exchange still open this long past its deadline, while the
 * communication thread has not finished a turn for as long, means that
 * thread is stuck inside MPI (Open MPI spins in MPI_Test after a peer's
 * socket broke, and never returns): the watch thread then declares the
 * world dead (world_die).
 */
#define WORLD_GRACE_NS (1000ull * 1000 * 1000)
/* Milliseconds world_die waits for the communication thread to park. */
#define WORLD_PARK_WAIT_MS 2000

struct world_hdr {
	uint64_t key, seq, check, bytes;
};

/*
 * The memory of an exchange (world.h): the payload and the headers, freed
 * when its caller and every request MPI still holds on it let go.
 */
struct shd_world_buf {
	int refs; /* atomic */
	size_t cap;
	uint8_t *data;
	struct world_hdr *hdr; /* [nodes + 1]: node k's received header at k, ours at nodes */
};

/* One exchange: the caller's part (first block) and the thread's (second). */
struct world_xfer {
	struct world_xfer *next;
	uint64_t key, seq, check, deadline_ns;
	size_t bytes, send_off, send_stride, recv_off;
	struct shd_world_buf *b;
	uint8_t *missing;
	char *err;
	size_t errlen;
	int done, res;
	/* an async exchange's: woken through its fd, or freed when abandoned */
	struct shd_world_op *op;
	struct world_xfer *inext, **iprev; /* W.inflight, under W.lock, until done */

	int streaming;          /* a peer's header is in and payloads are still open */
	uint64_t last_event_ns; /* a request of x completed (or x was posted) */

	/*
	 * [4 * nodes]: header recv, payload recv, header send, payload send of
	 * node k at 4k..; allocated and freed by the caller, so that world_die
	 * can read which are still open once the communication thread is parked.
	 */
	MPI_Request *req;
};

/* A request MPI still holds after its exchange ended, and the memory it uses. */
struct world_held {
	struct world_held *next;
	MPI_Request req;
	struct shd_world_buf *b; /* a reference, or NULL */
	void *raw;               /* freed, or NULL */
};

static struct {
	pthread_t thread;
	int started; /* the thread runs */
	pthread_mutex_t lock;
	pthread_cond_t cv; /* ready, new work, an exchange done */
	int ready;         /* MPI initialised (or failed: init_err) */
	char init_err[256];
	int stop;
	uint32_t nodes, node, dtype;
	int tag_ub;
	int peer_failed;          /* some exchange failed: MPI_Finalize could wait forever */
	struct world_xfer *queue; /* handed over, not posted yet */
	/* every exchange handed over and not done (queued or posted) */
	struct world_xfer *inflight;
	int dead; /* world_die ran: every exchange fails at once with dead_why */
	char dead_why[320];
	pthread_t watch;         /* world_watch */
	int watching;            /* the watch thread runs */
	pthread_cond_t watch_cv; /* CLOCK_MONOTONIC: an exchange handed over, or stop */
	uint64_t turn_ns;        /* atomic: when the communication thread last began a turn */
	int parked;              /* atomic: the communication thread is parked (world_park) */
	/* communication thread only */
	MPI_Comm comm;
	struct world_xfer *active;
	struct world_held *held;
} W = { .lock = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };

/* The signal that parks the communication thread (world_die); it is blocked by no thread. */
#define WORLD_PARK_SIG (SIGRTMIN + 3)

uint32_t shd_world_nodes(void)
{
	return W.started ? W.nodes : 0;
}

uint32_t shd_world_node(void)
{
	return W.node;
}

uint32_t shd_world_internode_dtype(void)
{
	return W.dtype;
}

static void mpi_errstr(int code, char *buf, size_t len)
{
	char s[MPI_MAX_ERROR_STRING];
	int n = 0;

	if (MPI_Error_string(code, s, &n) != MPI_SUCCESS)
		snprintf(s, sizeof(s), "MPI error %d", code);
	n = (int)strnlen(s, sizeof(s));
	if ((size_t)n >= len)
		n = (int)len - 1;
	memcpy(buf, s, (size_t)n);
	buf[n] = '\0';
}

/* ------------------------------------------------------------------ */
/* Communication thread                                                */
/* ------------------------------------------------------------------ */

static void buf_free(struct shd_world_buf *b)
{
	free(b->data);
	free(b->hdr);
	free(b);
}

struct shd_world_buf *shd_world_buf_new(size_t bytes)
{
	struct shd_world_buf *b = calloc(1, sizeof(*b));

	if (!b)
		return NULL;
	b->refs = 1;
	b->cap = bytes;
	b->hdr = calloc((size_t)W.nodes + 1, sizeof(*b->hdr));
	if (posix_memalign((void **)&b->data, 64, bytes ? bytes : 64) || !b->hdr) {
		free(b->hdr);
		free(b);
		return NULL;
	}
	return b;
}

uint8_t *shd_world_buf_data(struct shd_world_buf *b)
{
	return b->data;
}

static void buf_get(struct shd_world_buf *b)
{
	__atomic_add_fetch(&b->refs, 1, __ATOMIC_RELAXED);
}

int shd_world_buf_busy(struct shd_world_buf *b)
{
	return __atomic_load_n(&b->refs, __ATOMIC_ACQUIRE) > 1;
}

void shd_world_buf_put(struct shd_world_buf *b)
{
	if (b && __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) == 0)
		buf_free(b);
}

static void held_add(MPI_Request req, struct shd_world_buf *b, void *raw)
{
	struct world_held *h = malloc(sizeof(*h));

	if (!h) {
		/* Without a record the memory must outlive MPI's use of it: leak it. */
		MPI_Request_free(&req);
		return;
	}
	h->req = req;
	h->b = b;
	h->raw = raw;
	h->next = W.held;
	W.held = h;
}

static void held_poll(void)
{
	for (struct world_held **pp = &W.held; *pp;) {
		struct world_held *h = *pp;
		int flag = 0;

		if (MPI_Test(&h->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
			*pp = h->next;
			shd_world_buf_put(h->b);
			free(h->raw);
			free(h);
		} else {
			pp = &h->next;
		}
	}
}

/* Drop x's requests: those still in flight go to the held list with their reference. */
static void xfer_release(struct world_xfer *x)
{
	for (uint32_t i = 0; i < 4 * W.nodes; i++) {
		if (x->req[i] == MPI_REQUEST_NULL)
			continue;
		if (i % 4 < 2)
			MPI_Cancel(&x->req[i]);
		held_add(x->req[i], x->b, NULL);
		x->req[i] = MPI_REQUEST_NULL;
	}
}

/* An exchange started by shd_world_gather_start. */
struct shd_world_op {
	struct world_xfer x;
	struct shd_world_buf *b;
	int wake_fd;
	int abandoned; /* under W.lock */
	uint8_t missing[SHARDD_MAX_WORLD];
	char err[384];
};

static void op_free(struct shd_world_op *op)
{
	shd_world_buf_put(op->b);
	free(op->x.req);
	free(op);
}

/* Under W.lock: op's exchange ended; frees it when its caller gave it up, else wakes the caller. */
static void op_finished(struct shd_world_op *op)
{
	uint64_t one = 1;
	ssize_t r;

	if (op->abandoned) {
		op_free(op);
		return;
	}
	r = write(op->wake_fd, &one, sizeof(one));
	(void)r;
}

/* Under W.lock: x is done with `res` (its err written); wake its caller. */
static void xfer_done_locked(struct world_xfer *x, int res)
{
	*x->iprev = x->inext;
	if (x->inext)
		x->inext->iprev = x->iprev;
	x->res = res;
	x->done = 1;
	pthread_cond_broadcast(&W.cv);
	if (x->op)
		op_finished(x->op);
}

/* End x with (res, its err already written) and wake its caller. */
static void xfer_finish(struct world_xfer *x, int res)
{
	xfer_release(x);
	if (res == -SHARDD_E_TIMEOUT || res == -SHARDD_E_PEER_DIED)
		W.peer_failed = 1;
	pthread_mutex_lock(&W.lock);
	xfer_done_locked(x, res);
	pthread_mutex_unlock(&W.lock);
}

/* Headers travel on an even tag of the stream, payloads on the odd one after it. */
static int xfer_tag(const struct world_xfer *x)
{
	return (int)(x->key % (uint64_t)(W.tag_ub / 2)) * 2;
}

/* Post request i of x (4k + 0..3: see struct world_xfer); one more reference on x->b. */
static int xfer_post_one(struct world_xfer *x, uint32_t k, int i)
{
	int tag = xfer_tag(x), rc;
	MPI_Request *r = &x->req[4 * k + i];

	switch (i) {
	case 0:
		rc = MPI_Irecv(&x->b->hdr[k], (int)sizeof(struct world_hdr), MPI_BYTE, (int)k, tag,
			       W.comm, r);
		break;
	case 1:
		rc = MPI_Irecv(x->b->data + x->recv_off + k * x->bytes, (int)x->bytes, MPI_BYTE,
			       (int)k, tag + 1, W.comm, r);
		break;
	case 2:
		rc = MPI_Isend(&x->b->hdr[W.nodes], (int)sizeof(struct world_hdr), MPI_BYTE, (int)k,
			       tag, W.comm, r);
		break;
	default:
		rc = MPI_Isend(x->b->data + x->send_off + k * x->send_stride, (int)x->bytes,
			       MPI_BYTE, (int)k, tag + 1, W.comm, r);
		break;
	}
	if (rc == MPI_SUCCESS) {
		buf_get(x->b);
	} else {
		char s[160];

		*r = MPI_REQUEST_NULL;
		mpi_errstr(rc, s, sizeof(s));
		x->missing[k] = 1;
		snprintf(x->err, x->errlen, "%s node %u failed: %s",
			 i < 2 ? "receiving from" : "sending to", k, s);
	}
	return rc == MPI_SUCCESS ? 0 : -SHARDD_E_PEER_DIED;
}

/* Post every header receive and every send of x. 0, or an error with x->err written. */
static int xfer_post(struct world_xfer *x)
{
	int rc;

	if (x->bytes > (size_t)INT32_MAX) {
		snprintf(x->err, x->errlen,
			 "an inter-node message of %zu bytes exceeds MPI's count limit of %d",
			 x->bytes, INT32_MAX);
		return -SHARDD_E_INVALID;
	}
	x->b->hdr[W.nodes] = (struct world_hdr){ x->key, x->seq, x->check, x->bytes };
	for (uint32_t k = 0; k < W.nodes; k++) {
		if (k == W.node)
			continue;
		rc = xfer_post_one(x, k, 0);
		if (!rc)
			rc = xfer_post_one(x, k, 2);
		if (!rc && x->bytes)
			rc = xfer_post_one(x, k, 3);
		if (rc)
			return rc;
	}
	return 0;
}

#define XFER_STALE 1

/*
 * Check node k's header of x. 0; XFER_STALE for a header of an earlier
 * exchange of the stream, one this node gave up on at its deadline (the
 * peer was stalled, not dead); or -SHARDD_E_MISMATCH with x->err written.
 */
static int xfer_check(struct world_xfer *x, uint32_t k, const MPI_Status *st)
{
	struct world_hdr h = x->b->hdr[k];
	int count = 0;

	MPI_Get_count(st, MPI_BYTE, &count);
	if ((size_t)count != sizeof(h)) {
		snprintf(x->err, x->errlen,
			 "node %u sent a header of %d bytes where %zu are expected", k, count,
			 sizeof(h));
		return -SHARDD_E_MISMATCH;
	}
	if (h.key == x->key && h.seq < x->seq)
		return XFER_STALE;
	if (h.key == x->key && h.seq == x->seq && (h.check != x->check || h.bytes != x->bytes)) {
		snprintf(
			x->err, x->errlen,
			"node %u sent exchange %llu of this group as %llu bytes, digest %016llx (here %zu, %016llx): the nodes disagree on the group's params or the op's step; register the same params and submit the same ops on every node",
			k, (unsigned long long)h.seq, (unsigned long long)h.bytes,
			(unsigned long long)h.check, x->bytes, (unsigned long long)x->check);
		return -SHARDD_E_MISMATCH;
	}
	if (h.key != x->key || h.seq != x->seq) {
		snprintf(
			x->err, x->errlen,
			"node %u sent exchange %llu of stream %016llx with %llu bytes where this node expects exchange %llu of stream %016llx with %zu bytes: the nodes ran different ops (register the same groups and submit the same ops on every node)",
			k, (unsigned long long)h.seq, (unsigned long long)h.key,
			(unsigned long long)h.bytes, (unsigned long long)x->seq,
			(unsigned long long)x->key, x->bytes);
		return -SHARDD_E_MISMATCH;
	}
	return 0;
}

/*
 * A stale header of node k: its payload (on the payload tag, never matched
 * by this exchange's receive, posted only after a current header) is
 * received into memory of its own and dropped; the header receive is posted again.
 */
static int xfer_drop_stale(struct world_xfer *x, uint32_t k)
{
	uint64_t n = x->b->hdr[k].bytes;
	MPI_Request r;

	shd_log_warn("world: dropped node %u's message of an exchange this node gave up on", k);
	if (n && n <= (uint64_t)INT32_MAX) {
		void *raw = malloc(n);

		if (raw && MPI_Irecv(raw, (int)n, MPI_BYTE, (int)k, xfer_tag(x) + 1, W.comm, &r) ==
				   MPI_SUCCESS)
			held_add(r, NULL, raw);
		else
			free(raw);
	}
	return xfer_post_one(x, k, 0);
}

/*
 * Test x's requests. 1 when x ended (finished), else 0, with x->streaming
 * set when some peer's header is in and a payload to or from that peer is
 * still open: bytes are moving, and move only while MPI is called.
 */
static int xfer_poll(struct world_xfer *x, uint64_t now)
{
	int pending = 0;

	x->streaming = 0;

	for (uint32_t k = 0; k < W.nodes; k++) {
		for (int i = 0; i < 4; i++) {
			MPI_Request *r = &x->req[4 * k + i];
			MPI_Status st;
			int flag = 0, rc, chk = 0;

			if (*r == MPI_REQUEST_NULL)
				continue;
			rc = MPI_Test(r, &flag, &st);
			if (rc != MPI_SUCCESS) {
				char s[160];

				mpi_errstr(rc, s, sizeof(s));
				x->missing[k] = 1;
				snprintf(x->err, x->errlen, "%s node %u failed: %s",
					 i < 2 ? "receiving from" : "sending to", k, s);
				xfer_finish(x, -SHARDD_E_PEER_DIED);
				return 1;
			}
			if (!flag) {
				pending++;
				/* Payload requests: 1 (posted once k's header was checked) and 3. */
				if (i == 1 || (i == 3 && x->req[4 * k] == MPI_REQUEST_NULL))
					x->streaming = 1;
				continue;
			}
			x->last_event_ns = now;
			shd_world_buf_put(x->b);
			if (i == 0) {
				chk = xfer_check(x, k, &st);
				if (chk == XFER_STALE)
					chk = xfer_drop_stale(x, k);
				else if (!chk && x->bytes)
					chk = xfer_post_one(x, k, 1);
				pending += *r != MPI_REQUEST_NULL;
			}
			if (chk) {
				x->missing[k] = 1;
				xfer_finish(x, chk);
				return 1;
			}
		}
	}
	if (!pending) {
		xfer_finish(x, 0);
		return 1;
	}
	if (now >= x->deadline_ns) {
		int n = 0, off;

		off = snprintf(x->err, x->errlen,
			       "no answer within the collective timeout from node");
		for (uint32_t k = 0; k < W.nodes; k++) {
			int open = 0;

			for (int i = 0; i < 4; i++)
				open |= x->req[4 * k + i] != MPI_REQUEST_NULL;
			if (k == W.node || !open)
				continue;
			x->missing[k] = 1;
			if (off >= 0 && (size_t)off < x->errlen)
				off += snprintf(x->err + off, x->errlen - off, "%s %u",
						n++ ? "," : "", k);
		}
		xfer_finish(x, -SHARDD_E_TIMEOUT);
		return 1;
	}
	return 0;
}

/* ------------------------------------------------------------------ */
/* A communication thread stuck inside MPI                             */
/* ------------------------------------------------------------------ */

/*
 * WORLD_PARK_SIG's handler, on the communication thread: it stays here for
 * good, so that a thread spinning inside MPI stops taking a core. Only an
 * atomic store and pause(), both async-signal-safe. world_die holds W.lock
 * while it sends the signal, so the thread never parks holding it.
 */
static void world_park(int sig)
{
	(void)sig;
	__atomic_store_n(&W.parked, 1, __ATOMIC_RELEASE);
	for (;;)
		pause();
}

/* The communication thread takes WORLD_PARK_SIG whatever mask it inherited. */
static void world_park_unblock(void)
{
	sigset_t set;

	sigemptyset(&set);
	sigaddset(&set, WORLD_PARK_SIG);
	pthread_sigmask(SIG_UNBLOCK, &set, NULL);
}

/*
 * Under W.lock: nodes[k] = 1 for each node k other than this one with a
 * request of an exchange in flight still open (the communication thread is
 * parked: the arrays stand still); those are the nodes it was waiting for.
 */
static void world_open_nodes(const struct world_xfer *x, uint8_t *nodes)
{
	for (uint32_t k = 0; x->req && k < W.nodes; k++)
		for (int i = 0; i < 4; i++)
			if (k != W.node && x->req[4 * k + i] != MPI_REQUEST_NULL)
				nodes[k] = 1;
}

/*
 * Under W.lock, on the watch thread: the communication thread is stuck in
 * MPI (stuck_ns without a turn, an exchange past its deadline). Park it,
 * keep why in W.dead_why, and fail every exchange in flight, naming the
 * nodes it still waited for; from then on every exchange fails at once.
 * The requests stay with MPI, and so does the memory they use (never
 * freed: MPI may still write into it).
 */
static void world_die(uint64_t stuck_ns)
{
	uint8_t any[SHARDD_MAX_WORLD] = { 0 };
	char who[160];
	size_t off = 0;
	int ret;

	W.dead = 1;
	W.peer_failed = 1;
	ret = pthread_kill(W.thread, WORLD_PARK_SIG);
	for (int ms = 0;
	     !ret && ms < WORLD_PARK_WAIT_MS && !__atomic_load_n(&W.parked, __ATOMIC_ACQUIRE);
	     ms++) {
		struct timespec ts = { 0, 1000000 };

		nanosleep(&ts, NULL);
	}
	if (!__atomic_load_n(&W.parked, __ATOMIC_ACQUIRE))
		shd_log_error("world: the MPI communication thread did not park within %d ms (%s); "
			      "failing its exchanges anyway",
			      WORLD_PARK_WAIT_MS, ret ? strerror(ret) : "no signal taken");
	for (struct world_xfer *x = W.inflight; x; x = x->inext)
		world_open_nodes(x, any);
	who[0] = '\0';
	for (uint32_t k = 0; k < W.nodes && k < SHARDD_MAX_WORLD && off < sizeof(who); k++)
		if (any[k])
			off += (size_t)snprintf(who + off, sizeof(who) - off, "%s%u",
						off ? "," : "", k);
	snprintf(
		W.dead_why, sizeof(W.dead_why),
		"the daemon world of this node is dead: its MPI communication thread has not returned from MPI "
		"for %.1f s after node%s %s stopped answering (Open MPI's own words are in this daemon's log); "
		"ops that stay on this node go on, exchanges among nodes need a new world (relaunch the daemons)",
		(double)stuck_ns / 1e9, strchr(who, ',') ? "s" : "", who[0] ? who : "?");
	shd_log_error("world: %s", W.dead_why);
	while (W.inflight) {
		struct world_xfer *x = W.inflight;

		memset(x->missing, 0, W.nodes);
		world_open_nodes(x, x->missing);
		snprintf(x->err, x->errlen, "%s", W.dead_why);
		xfer_done_locked(x, -SHARDD_E_PEER_DIED);
	}
}

/*
 * The watch thread: wakes at the earliest deadline (plus WORLD_GRACE_NS)
 * of the exchanges in flight and calls world_die when the communication
 * thread has let one pass it without a turn for as long.
 */
static void *world_watch(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&W.lock);
	while (!W.stop && !W.dead) {
		uint64_t first = UINT64_MAX, now = shd_now_ns(), turn;
		struct timespec until;

		for (struct world_xfer *x = W.inflight; x; x = x->inext)
			if (x->deadline_ns < first)
				first = x->deadline_ns;
		if (first == UINT64_MAX) {
			pthread_cond_wait(&W.watch_cv, &W.lock);
			continue;
		}
		turn = __atomic_load_n(&W.turn_ns, __ATOMIC_RELAXED);
		if (now >= first + WORLD_GRACE_NS && now - turn >= WORLD_GRACE_NS) {
			world_die(now - turn);
			break;
		}
		/* Again at the deadline's grace, or a grace after the last turn, whichever is later. */
		first += WORLD_GRACE_NS;
		if (first < turn + WORLD_GRACE_NS)
			first = turn + WORLD_GRACE_NS;
		until.tv_sec = (time_t)(first / 1000000000ull);
		until.tv_nsec = (long)(first % 1000000000ull);
		pthread_cond_timedwait(&W.watch_cv, &W.lock, &until);
	}
	pthread_mutex_unlock(&W.lock);
	return NULL;
}

/* Under W.lock: hand x over (queue and in flight) and wake both threads. */
static void xfer_hand_over(struct world_xfer *x)
{
	x->next = W.queue;
	W.queue = x;
	x->inext = W.inflight;
	x->iprev = &W.inflight;
	if (W.inflight)
		W.inflight->iprev = &x->inext;
	W.inflight = x;
	pthread_cond_broadcast(&W.cv);
	pthread_cond_signal(&W.watch_cv);
}

/* x's request array, every entry MPI_REQUEST_NULL; NULL when out of memory. */
static MPI_Request *xfer_reqs(void)
{
	MPI_Request *req = malloc(4 * (size_t)W.nodes * sizeof(*req));

	for (uint32_t i = 0; req && i < 4 * W.nodes; i++)
		req[i] = MPI_REQUEST_NULL;
	return req;
}

int shd_world_dead(char *why, size_t len)
{
	int dead;

	pthread_mutex_lock(&W.lock);
	dead = W.dead;
	if (dead && why)
		snprintf(why, len, "%s", W.dead_why);
	pthread_mutex_unlock(&W.lock);
	return dead;
}

static void *world_thread(void *arg)
{
	int provided = 0, rank = 0, size = 0, flag = 0, rc;
	uint64_t busy_ns = 0; /* the last turn with an exchange in flight */
	void *ub = NULL;

	(void)arg;
	world_park_unblock();
	/* Sleep what is asked between polls, not the default 50 us slack on top. */
	prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
	rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
	if (rc == MPI_SUCCESS)
		rc = MPI_Comm_dup(MPI_COMM_WORLD, &W.comm);
	if (rc == MPI_SUCCESS)
		rc = MPI_Comm_set_errhandler(W.comm, MPI_ERRORS_RETURN);
	if (rc == MPI_SUCCESS)
		rc = MPI_Comm_rank(W.comm, &rank);
	if (rc == MPI_SUCCESS)
		rc = MPI_Comm_size(W.comm, &size);
	if (rc == MPI_SUCCESS)
		rc = MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
	pthread_mutex_lock(&W.lock);
	if (rc != MPI_SUCCESS) {
		char s[160];

		mpi_errstr(rc, s, sizeof(s));
		snprintf(W.init_err, sizeof(W.init_err), "MPI initialisation failed: %s", s);
	} else if (provided < MPI_THREAD_FUNNELED) {
		snprintf(W.init_err, sizeof(W.init_err),
			 "MPI provides thread level %d, below MPI_THREAD_FUNNELED", provided);
	}
	W.node = (uint32_t)rank;
	W.nodes = (uint32_t)size;
	W.tag_ub = flag && ub ? *(int *)ub : 32767;
	W.ready = 1;
	pthread_cond_broadcast(&W.cv);
	pthread_mutex_unlock(&W.lock);
	if (W.init_err[0])
		return NULL;

	for (;;) {
		struct world_xfer *fresh;
		uint64_t now;
		int stream;

		__atomic_store_n(&W.turn_ns, shd_now_ns(), __ATOMIC_RELAXED);
		pthread_mutex_lock(&W.lock);
		while (!W.stop && !W.queue && !W.active && !W.held) {
			if (shd_now_ns() - busy_ns < WORLD_LINGER_NS) {
				pthread_mutex_unlock(&W.lock);
				sched_yield();
				pthread_mutex_lock(&W.lock);
				continue;
			}
			pthread_cond_wait(&W.cv, &W.lock);
		}
		fresh = W.queue;
		W.queue = NULL;
		if (W.stop && !fresh && !W.active) {
			pthread_mutex_unlock(&W.lock);
			break;
		}
		pthread_mutex_unlock(&W.lock);
		while (fresh) {
			struct world_xfer *x = fresh;

			fresh = x->next;
			rc = W.stop ? -SHARDD_E_SHUTDOWN : xfer_post(x);
			if (rc) {
				if (rc == -SHARDD_E_SHUTDOWN)
					snprintf(x->err, x->errlen, "the daemon is shutting down");
				xfer_finish(x, rc);
				continue;
			}
			x->last_event_ns = shd_now_ns();
			x->next = W.active;
			W.active = x;
		}
		now = shd_now_ns();
		if (W.active)
			busy_ns = now;
		stream = 0;
		for (struct world_xfer **pp = &W.active; *pp;) {
			/* x lives on its caller's stack: once finished it may be gone. */
			struct world_xfer *x = *pp, *next = x->next;

			if (W.stop) {
				snprintf(x->err, x->errlen, "the daemon is shutting down");
				*pp = next;
				xfer_finish(x, -SHARDD_E_SHUTDOWN);
			} else if (xfer_poll(x, now)) {
				*pp = next;
			} else {
				stream |= (x->streaming &&
					   now - x->last_event_ns < WORLD_STREAM_IDLE_NS) ||
					  now - x->last_event_ns < WORLD_LINGER_NS;
				pp = &x->next;
			}
		}
		held_poll();
		if (stream) {
			/*
			 * Payloads stream (or the peers are about to arrive): Open
			 * MPI's TCP transport moves bytes only inside MPI_Test, and
			 * each turn moves what the sockets take, so the next turn
			 * follows at once (a sleep, however short, costs a timer
			 * wake-up, tens of us on a VM, in which the socket buffers run
			 * dry). The yield leaves the core to any other runnable
			 * thread first.
			 */
			sched_yield();
		} else if (W.active || W.held) {
			/*
			 * Poll, but leave the core to the loop and the workers: 5 us
			 * per turn while an exchange waits longer for its peers'
			 * headers, 10 ms when only requests of ended exchanges (a
			 * failed peer's) are left.
			 */
			struct timespec ts = { 0, W.active ? WORLD_POLL_NS : 10000000 };

			nanosleep(&ts, NULL);
		}
	}
	/*
	 * MPI_Finalize synchronises with every node, so after a peer failed it
	 * could wait forever: then the process ends without it (mpirun reports
	 * that, which is the truth).
	 */
	if (!W.peer_failed && !W.held)
		MPI_Finalize();
	return NULL;
}

/* ------------------------------------------------------------------ */
/* Callers                                                             */
/* ------------------------------------------------------------------ */

int shd_world_start(uint32_t internode_dtype, char *err, size_t errlen)
{
	struct sigaction sa = { .sa_handler = world_park };
	pthread_condattr_t ca;
	int ret;

	W.dtype = internode_dtype;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&W.watch_cv, &ca);
	pthread_condattr_destroy(&ca);
	sigemptyset(&sa.sa_mask);
	sigaction(WORLD_PARK_SIG, &sa, NULL);
	ret = pthread_create(&W.thread, NULL, world_thread, NULL);
	if (ret) {
		snprintf(err, errlen, "cannot start the MPI communication thread: %s",
			 strerror(ret));
		return -ret;
	}
	pthread_mutex_lock(&W.lock);
	while (!W.ready)
		pthread_cond_wait(&W.cv, &W.lock);
	pthread_mutex_unlock(&W.lock);
	if (W.init_err[0]) {
		pthread_join(W.thread, NULL);
		snprintf(err, errlen, "%s", W.init_err);
		return -EIO;
	}
	W.started = 1;
	ret = pthread_create(&W.watch, NULL, world_watch, NULL);
	if (ret)
		shd_log_warn(
			"world: cannot start the watch thread (%s): an exchange is bounded only while "
			"MPI returns",
			strerror(ret));
	W.watching = !ret;
	shd_log_info("world: node %u of %u nodes (MPI_THREAD_FUNNELED, inter-node dtype %s)",
		     W.node, W.nodes, W.dtype == SHD_INTERNODE_REDUCE ? "reduce" : "fp32");
	return 0;
}

void shd_world_stop(void)
{
	if (!W.started)
		return;
	struct timespec until;
	int dead;

	pthread_mutex_lock(&W.lock);
	W.stop = 1;
	dead = W.dead;
	pthread_cond_broadcast(&W.cv);
	pthread_cond_broadcast(&W.watch_cv);
	pthread_mutex_unlock(&W.lock);
	if (W.watching)
		pthread_join(W.watch, NULL);
	W.watching = 0;
	/* A parked communication thread never returns (world_die). */
	if (dead)
		return;
	/* MPI_Finalize may wait for nodes that are not stopping: bounded, the daemon still exits. */
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += WORLD_STOP_WAIT_S;
	if (pthread_timedjoin_np(W.thread, NULL, &until)) {
		shd_log_warn(
			"world: MPI_Finalize did not return within %d s (other nodes still run); "
			"exiting without it",
			WORLD_STOP_WAIT_S);
		return;
	}
	W.started = 0;
}

/* An exchange handed to the communication thread, waited for later (shd_world_xchg_start). */
struct shd_world_xchg {
	struct world_xfer x;
};

int shd_world_xchg_start(uint64_t key, uint64_t seq, uint64_t check, struct shd_world_buf *b,
			 size_t send_off, size_t send_stride, size_t recv_off, size_t bytes,
			 uint64_t deadline_ns, uint8_t *missing, char *err, size_t errlen,
			 struct shd_world_xchg **out)
{
	struct shd_world_xchg *h;

	*out = NULL;
	memset(missing, 0, W.nodes);
	err[0] = '\0';
	h = calloc(1, sizeof(*h));
	if (!h) {
		snprintf(err, errlen, "out of memory for an inter-node exchange");
		return -SHARDD_E_NOMEM;
	}
	h->x = (struct world_xfer){
		.key = key,
		.seq = seq,
		.check = check,
		.deadline_ns = deadline_ns,
		.bytes = bytes,
		.send_off = send_off,
		.send_stride = send_stride,
		.recv_off = recv_off,
		.b = b,
		.missing = missing,
		.err = err,
		.errlen = errlen,
	};
	*out = h;
	if (W.nodes == 1) {
		h->x.done = 1;
		return 0;
	}
	h->x.req = xfer_reqs();
	if (!h->x.req) {
		free(h);
		*out = NULL;
		snprintf(err, errlen, "out of memory for the requests of an inter-node exchange");
		return -SHARDD_E_NOMEM;
	}
	pthread_mutex_lock(&W.lock);
	if (W.dead) {
		/* Every other node: this one cannot reach any of them any more. */
		for (uint32_t k = 0; k < W.nodes; k++)
			missing[k] = k != W.node;
		snprintf(err, errlen, "%s", W.dead_why);
		h->x.res = -SHARDD_E_PEER_DIED;
		h->x.done = 1;
	} else {
		xfer_hand_over(&h->x);
	}
	pthread_mutex_unlock(&W.lock);
	return 0;
}

int shd_world_xchg_wait(struct shd_world_xchg *h)
{
	int res;

	pthread_mutex_lock(&W.lock);
	/* Bounded: the communication thread ends x by its deadline, or world_watch does. */
	while (!h->x.done)
		pthread_cond_wait(&W.cv, &W.lock);
	pthread_mutex_unlock(&W.lock);
	/* A request of x MPI still holds is on the held list by now, or stays MPI's (world_die). */
	free(h->x.req);
	res = h->x.res;
	free(h);
	return res;
}

int shd_world_xchg(uint64_t key, uint64_t seq, uint64_t check, struct shd_world_buf *b,
		   size_t send_off, size_t send_stride, size_t recv_off, size_t bytes,
		   uint64_t deadline_ns, uint8_t *missing, char *err, size_t errlen)
{
	struct shd_world_xchg *h;
	int ret = shd_world_xchg_start(key, seq, check, b, send_off, send_stride, recv_off, bytes,
				       deadline_ns, missing, err, errlen, &h);

	return ret ? ret : shd_world_xchg_wait(h);
}

int shd_world_gather_start(uint64_t key, uint64_t seq, uint64_t check, const void *mine,
			   size_t bytes, uint64_t deadline_ns, int wake_fd,
			   struct shd_world_op **out, char *err, size_t errlen)
{
	struct shd_world_op *op;

	if (W.nodes > SHARDD_MAX_WORLD) {
		snprintf(err, errlen, "a world of %u nodes exceeds the %d an op can name", W.nodes,
			 SHARDD_MAX_WORLD);
		return -SHARDD_E_INVALID;
	}
	op = calloc(1, sizeof(*op));
	if (op)
		op->b = shd_world_buf_new((size_t)(W.nodes + 1) * bytes);
	if (!op || !op->b) {
		free(op);
		snprintf(err, errlen,
			 "out of memory for an inter-node gather of %zu bytes per node", bytes);
		return -SHARDD_E_NOMEM;
	}
	op->wake_fd = wake_fd;
	op->x = (struct world_xfer){
		.key = key,
		.seq = seq,
		.check = check,
		.deadline_ns = deadline_ns,
		.bytes = bytes,
		.send_off = 0,
		.send_stride = 0,
		.recv_off = bytes,
		.b = op->b,
		.missing = op->missing,
		.err = op->err,
		.errlen = sizeof(op->err),
		.op = op,
	};
	memcpy(op->b->data, mine, bytes);
	memcpy(op->b->data + bytes + (size_t)W.node * bytes, mine, bytes);
	op->x.req = xfer_reqs();
	if (!op->x.req) {
		op_free(op);
		snprintf(err, errlen, "out of memory for the requests of an inter-node gather");
		return -SHARDD_E_NOMEM;
	}
	pthread_mutex_lock(&W.lock);
	if (W.dead) {
		pthread_mutex_unlock(&W.lock);
		op_free(op);
		snprintf(err, errlen, "%s", W.dead_why);
		return -SHARDD_E_PEER_DIED;
	}
	xfer_hand_over(&op->x);
	pthread_mutex_unlock(&W.lock);
	*out = op;
	return 0;
}

int shd_world_op_done(struct shd_world_op *op)
{
	int done;

	pthread_mutex_lock(&W.lock);
	done = op->x.done;
	pthread_mutex_unlock(&W.lock);
	return done;
}

int shd_world_op_end(struct shd_world_op *op, void *recv, uint8_t *missing, char *err,
		     size_t errlen)
{
	int ret = op->x.res;

	memcpy(missing, op->missing, W.nodes);
	snprintf(err, errlen, "%s", op->err);
	if (!ret)
		memcpy(recv, op->b->data + op->x.bytes, (size_t)W.nodes * op->x.bytes);
	op_free(op);
	return ret;
}

void shd_world_op_abandon(struct shd_world_op *op)
{
	int done;

	pthread_mutex_lock(&W.lock);
	op->abandoned = 1;
	done = op->x.done;
	pthread_mutex_unlock(&W.lock);
	if (done)
		op_free(op);
}

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
 * Each message is a header (key, seq, bytes) and the payload, copied into
 * memory this thread owns, so a caller that gave up at its deadline may
 * free its buffers while MPI still holds ours: requests that cannot be
 * cancelled (a send whose peer is gone) are kept, with their buffer, on a
 * list tested on every turn until MPI lets go of them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mpi.h>

#include "clock.h"
#include "log.h"
#include "shardd_proto.h"
#include "world.h"

/* Seconds shd_world_stop waits for the communication thread to finalise MPI. */
#define WORLD_STOP_WAIT_S 10

struct world_hdr {
	uint64_t key, seq, check, bytes;
};

/* One exchange: the caller's part (first block) and the thread's (second). */
struct world_xfer {
	struct world_xfer *next;
	uint64_t key, seq, check, deadline_ns;
	size_t bytes;
	const void *const *send;
	void *recv;
	uint8_t *missing;
	char *err;
	size_t errlen;
	int done, res;

	uint8_t **sbuf, **rbuf;      /* [nodes]: header + payload; NULL for this node */
	MPI_Request *sreq, *rreq;    /* [nodes]; MPI_REQUEST_NULL once complete */
};

/* A request MPI still holds after its exchange ended, and the buffer it uses. */
struct world_held {
	struct world_held *next;
	MPI_Request req;
	void *buf;
};

static struct {
	pthread_t thread;
	int started;                 /* the thread runs */
	pthread_mutex_t lock;
	pthread_cond_t cv;           /* ready, new work, an exchange done */
	int ready;                   /* MPI initialised (or failed: init_err) */
	char init_err[256];
	int stop;
	uint32_t nodes, node, dtype;
	int tag_ub;
	int peer_failed;             /* some exchange failed: MPI_Finalize could wait forever */
	struct world_xfer *queue;    /* handed over, not posted yet */
	/* communication thread only */
	MPI_Comm comm;
	struct world_xfer *active;
	struct world_held *held;
} W = { .lock = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };

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

static void held_add(MPI_Request req, void *buf)
{
	struct world_held *h = malloc(sizeof(*h));

	if (!h) {
		/* Without a record the buffer must outlive MPI's use of it: leak it. */
		MPI_Request_free(&req);
		return;
	}
	h->req = req;
	h->buf = buf;
	h->next = W.held;
	W.held = h;
}

static void held_poll(void)
{
	for (struct world_held **pp = &W.held; *pp; ) {
		struct world_held *h = *pp;
		int flag = 0;

		if (MPI_Test(&h->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
			*pp = h->next;
			free(h->buf);
			free(h);
		} else {
			pp = &h->next;
		}
	}
}

/* Free the thread's part of x; requests still in flight go to the held list. */
static void xfer_release(struct world_xfer *x)
{
	for (uint32_t k = 0; k < W.nodes; k++) {
		if (x->rreq && x->rreq[k] != MPI_REQUEST_NULL) {
			MPI_Cancel(&x->rreq[k]);
			held_add(x->rreq[k], x->rbuf[k]);
		} else if (x->rbuf) {
			free(x->rbuf[k]);
		}
		if (x->sreq && x->sreq[k] != MPI_REQUEST_NULL)
			held_add(x->sreq[k], x->sbuf[k]);
		else if (x->sbuf)
			free(x->sbuf[k]);
	}
	free(x->sbuf);
	free(x->rbuf);
	free(x->sreq);
	free(x->rreq);
	x->sbuf = x->rbuf = NULL;
	x->sreq = x->rreq = NULL;
}

/* End x with (res, its err already written) and wake its caller. */
static void xfer_finish(struct world_xfer *x, int res)
{
	xfer_release(x);
	if (res == -SHARDD_E_TIMEOUT || res == -SHARDD_E_PEER_DIED)
		W.peer_failed = 1;
	pthread_mutex_lock(&W.lock);
	x->res = res;
	x->done = 1;
	pthread_cond_broadcast(&W.cv);
	pthread_mutex_unlock(&W.lock);
}

static int xfer_tag(const struct world_xfer *x)
{
	return (int)(x->key % (uint64_t)W.tag_ub);
}

/* Post every receive and send of x. 0, or an error with x->err written. */
static int xfer_post(struct world_xfer *x)
{
	size_t total = sizeof(struct world_hdr) + x->bytes;
	struct world_hdr h = { x->key, x->seq, x->check, x->bytes };
	int tag = xfer_tag(x), rc;

	x->sbuf = calloc(W.nodes, sizeof(*x->sbuf));
	x->rbuf = calloc(W.nodes, sizeof(*x->rbuf));
	x->sreq = malloc(W.nodes * sizeof(*x->sreq));
	x->rreq = malloc(W.nodes * sizeof(*x->rreq));
	if (!x->sbuf || !x->rbuf || !x->sreq || !x->rreq)
		goto nomem;
	for (uint32_t k = 0; k < W.nodes; k++)
		x->sreq[k] = x->rreq[k] = MPI_REQUEST_NULL;
	if (total > (size_t)INT32_MAX) {
		snprintf(x->err, x->errlen, "an inter-node message of %zu bytes exceeds MPI's count limit of %d",
			 total, INT32_MAX);
		return -SHARDD_E_INVALID;
	}
	for (uint32_t k = 0; k < W.nodes; k++) {
		if (k == W.node)
			continue;
		x->sbuf[k] = malloc(total);
		x->rbuf[k] = malloc(total);
		if (!x->sbuf[k] || !x->rbuf[k])
			goto nomem;
		memcpy(x->sbuf[k], &h, sizeof(h));
		memcpy(x->sbuf[k] + sizeof(h), x->send[k], x->bytes);
	}
	for (uint32_t k = 0; k < W.nodes; k++) {
		if (k == W.node)
			continue;
		rc = MPI_Irecv(x->rbuf[k], (int)total, MPI_BYTE, (int)k, tag, W.comm, &x->rreq[k]);
		if (rc == MPI_SUCCESS)
			rc = MPI_Isend(x->sbuf[k], (int)total, MPI_BYTE, (int)k, tag, W.comm, &x->sreq[k]);
		if (rc != MPI_SUCCESS) {
			char s[160];

			mpi_errstr(rc, s, sizeof(s));
			x->missing[k] = 1;
			snprintf(x->err, x->errlen, "posting the exchange with node %u failed: %s", k, s);
			return -SHARDD_E_PEER_DIED;
		}
	}
	return 0;
nomem:
	snprintf(x->err, x->errlen, "out of memory for inter-node buffers of %zu bytes per node", total);
	return -SHARDD_E_NOMEM;
}

#define XFER_STALE 1

/*
 * Check node k's message of x. 0; XFER_STALE for a message of an earlier
 * exchange of the stream, one this node gave up on at its deadline (the
 * peer was stalled, not dead): dropped, and the receive posted again; or
 * -SHARDD_E_MISMATCH with x->err written.
 */
static int xfer_check(struct world_xfer *x, uint32_t k, const MPI_Status *st)
{
	struct world_hdr h;
	int count = 0;

	MPI_Get_count(st, MPI_BYTE, &count);
	if ((size_t)count < sizeof(h)) {
		snprintf(x->err, x->errlen, "node %u sent a message of %d bytes, shorter than its header", k,
			 count);
		return -SHARDD_E_MISMATCH;
	}
	memcpy(&h, x->rbuf[k], sizeof(h));
	if (h.key == x->key && h.seq < x->seq)
		return XFER_STALE;
	if (h.key == x->key && h.seq == x->seq && (h.check != x->check || h.bytes != x->bytes)) {
		snprintf(x->err, x->errlen,
			 "node %u sent exchange %llu of this group as %llu bytes, digest %016llx (here %zu, %016llx): the nodes disagree on the group's params or the op's step; register the same params and submit the same ops on every node",
			 k, (unsigned long long)h.seq, (unsigned long long)h.bytes,
			 (unsigned long long)h.check, x->bytes, (unsigned long long)x->check);
		return -SHARDD_E_MISMATCH;
	}
	if (h.key != x->key || h.seq != x->seq || (size_t)count != sizeof(h) + x->bytes) {
		snprintf(x->err, x->errlen,
			 "node %u sent exchange %llu of stream %016llx with %llu bytes where this node expects exchange %llu of stream %016llx with %zu bytes: the nodes ran different ops (register the same groups and submit the same ops on every node)",
			 k, (unsigned long long)h.seq, (unsigned long long)h.key,
			 (unsigned long long)h.bytes, (unsigned long long)x->seq,
			 (unsigned long long)x->key, x->bytes);
		return -SHARDD_E_MISMATCH;
	}
	return 0;
}

/* Test x's requests. 1 when x ended (finished), else 0. */
static int xfer_poll(struct world_xfer *x, uint64_t now)
{
	int pending = 0;

	for (uint32_t k = 0; k < W.nodes; k++) {
		MPI_Status st;
		int flag = 0, rc;

		if (x->rreq[k] != MPI_REQUEST_NULL) {
			rc = MPI_Test(&x->rreq[k], &flag, &st);
			if (rc == MPI_SUCCESS && flag) {
				int chk = xfer_check(x, k, &st);

				if (chk == XFER_STALE) {
					shd_log_warn("world: dropped node %u's message of an exchange this node gave up on",
						     k);
					rc = MPI_Irecv(x->rbuf[k], (int)(sizeof(struct world_hdr) + x->bytes),
						       MPI_BYTE, (int)k, xfer_tag(x), W.comm, &x->rreq[k]);
					flag = 0;
				} else if (chk) {
					x->missing[k] = 1;
					xfer_finish(x, chk);
					return 1;
				}
			}
			if (rc != MPI_SUCCESS) {
				char s[160];

				mpi_errstr(rc, s, sizeof(s));
				x->missing[k] = 1;
				snprintf(x->err, x->errlen, "receiving from node %u failed: %s", k, s);
				xfer_finish(x, -SHARDD_E_PEER_DIED);
				return 1;
			}
			pending += !flag;
		}
		if (x->sreq[k] != MPI_REQUEST_NULL) {
			rc = MPI_Test(&x->sreq[k], &flag, MPI_STATUS_IGNORE);
			if (rc != MPI_SUCCESS) {
				char s[160];

				mpi_errstr(rc, s, sizeof(s));
				x->missing[k] = 1;
				snprintf(x->err, x->errlen, "sending to node %u failed: %s", k, s);
				xfer_finish(x, -SHARDD_E_PEER_DIED);
				return 1;
			}
			pending += !flag;
		}
	}
	if (!pending) {
		for (uint32_t k = 0; k < W.nodes; k++)
			if (k != W.node)
				memcpy((uint8_t *)x->recv + k * x->bytes,
				       x->rbuf[k] + sizeof(struct world_hdr), x->bytes);
		xfer_finish(x, 0);
		return 1;
	}
	if (now >= x->deadline_ns) {
		int n = 0, off;

		off = snprintf(x->err, x->errlen, "no answer within the collective timeout from node");
		for (uint32_t k = 0; k < W.nodes; k++) {
			if (k == W.node || (x->rreq[k] == MPI_REQUEST_NULL && x->sreq[k] == MPI_REQUEST_NULL))
				continue;
			x->missing[k] = 1;
			if (off >= 0 && (size_t)off < x->errlen)
				off += snprintf(x->err + off, x->errlen - off, "%s %u", n++ ? "," : "", k);
		}
		xfer_finish(x, -SHARDD_E_TIMEOUT);
		return 1;
	}
	return 0;
}

static void *world_thread(void *arg)
{
	int provided = 0, rank = 0, size = 0, flag = 0, rc;
	void *ub = NULL;

	(void)arg;
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

		pthread_mutex_lock(&W.lock);
		while (!W.stop && !W.queue && !W.active && !W.held)
			pthread_cond_wait(&W.cv, &W.lock);
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
			x->next = W.active;
			W.active = x;
		}
		now = shd_now_ns();
		for (struct world_xfer **pp = &W.active; *pp; ) {
			/* x lives on its caller's stack: once finished it may be gone. */
			struct world_xfer *x = *pp, *next = x->next;

			if (W.stop) {
				snprintf(x->err, x->errlen, "the daemon is shutting down");
				*pp = next;
				xfer_finish(x, -SHARDD_E_SHUTDOWN);
			} else if (xfer_poll(x, now)) {
				*pp = next;
			} else {
				pp = &x->next;
			}
		}
		held_poll();
		if (W.active || W.held) {
			/*
			 * Poll, but leave the core to the loop and the workers: 20 us
			 * per turn while an exchange waits, 10 ms when only requests
			 * of ended exchanges (a failed peer's) are left.
			 */
			struct timespec ts = { 0, W.active ? 20000 : 10000000 };

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

int shd_world_start(uint32_t internode_dtype, char *err, size_t len)
{
	int ret;

	W.dtype = internode_dtype;
	ret = pthread_create(&W.thread, NULL, world_thread, NULL);
	if (ret) {
		snprintf(err, len, "cannot start the MPI communication thread: %s", strerror(ret));
		return -1;
	}
	pthread_mutex_lock(&W.lock);
	while (!W.ready)
		pthread_cond_wait(&W.cv, &W.lock);
	pthread_mutex_unlock(&W.lock);
	if (W.init_err[0]) {
		pthread_join(W.thread, NULL);
		snprintf(err, len, "%s", W.init_err);
		return -1;
	}
	W.started = 1;
	shd_log_info("world: node %u of %u nodes (MPI_THREAD_FUNNELED, inter-node dtype %s)", W.node,
		     W.nodes, W.dtype == SHD_INTERNODE_REDUCE ? "reduce" : "fp32");
	return 0;
}

void shd_world_stop(void)
{
	if (!W.started)
		return;
	struct timespec until;

	pthread_mutex_lock(&W.lock);
	W.stop = 1;
	pthread_cond_broadcast(&W.cv);
	pthread_mutex_unlock(&W.lock);
	/* MPI_Finalize may wait for nodes that are not stopping: bounded, the daemon still exits. */
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += WORLD_STOP_WAIT_S;
	if (pthread_timedjoin_np(W.thread, NULL, &until)) {
		shd_log_warn("world: MPI_Finalize did not return within %d s (other nodes still run); "
			     "exiting without it", WORLD_STOP_WAIT_S);
		return;
	}
	W.started = 0;
}

int shd_world_exchange(uint64_t key, uint64_t seq, uint64_t check, const void *const *send,
		       void *recv, size_t bytes, uint64_t deadline_ns, uint8_t *missing, char *err,
		       size_t len)
{
	struct world_xfer x = {
		.key = key, .seq = seq, .check = check, .deadline_ns = deadline_ns, .bytes = bytes, .send = send,
		.recv = recv, .missing = missing, .err = err, .errlen = len,
	};

	memset(missing, 0, W.nodes);
	err[0] = '\0';
	memcpy((uint8_t *)recv + (size_t)W.node * bytes, send[W.node], bytes);
	if (W.nodes == 1)
		return 0;
	pthread_mutex_lock(&W.lock);
	x.next = W.queue;
	W.queue = &x;
	pthread_cond_broadcast(&W.cv);
	while (!x.done)
		pthread_cond_wait(&W.cv, &W.lock);
	pthread_mutex_unlock(&W.lock);
	return x.res;
}

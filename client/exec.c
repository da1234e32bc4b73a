/* SPDX-License-Identifier: MIT */
/*
 * The rank side of rank-executed groups (PROTOCOL.md "Rank-executed
 * groups"): unshard, reduce and reshard run in the calling thread, on the
 * job's buffers, with the daemon's kernels (libshardd_kernels), so the
 * numbers are the daemon's bit for bit: ranks summed 0..N-1 in fp32,
 * rounded once.
 *
 * Order: each op of a group is numbered n within the group's epoch.
 * Submitting publishes seq = (epoch, n): the rank's inputs are final (its
 * flat shard for an unshard, its grad buffer for a reduce). The op then
 * runs when the client polls or waits (shardd_exec_progress, called by every
 * wait loop of ops.c) and every peer's seq has reached n: it reads the
 * peers' buffers and writes this rank's own. A reduce also publishes done =
 * (epoch, n) and completes when every peer has stored its done: the caller
 * may then write its grad buffer again. Each op is bounded by the
 * collective timeout; a rank that leaves fails the ops waiting for it,
 * naming it, and a failed op gives its number back (xop_retract).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "shardd_step.h"
#include "shardd_exec.h"
#include "shardd_kernels.h"

struct exec_peer {
	uint32_t gen;                   /* of the mappings below; 0: none */
	const uint8_t *shard;           /* its flat shard (read-only), or this rank's own */
	const uint8_t *grad;            /* its grad buffer (read-only), or this rank's own */
	struct shardd_exec_slot *slot;  /* at the end of grad */
	uint64_t shard_size, grad_size; /* mapped bytes; 0 for this rank's own */
};

struct shardd_exec_state {
	struct shardd_exec_sync *sync; /* read-only */
	uint64_t sync_size;
	struct shardd_exec_slot *mine;
	uint32_t world, rank;              /* shard group size, this rank (replicate is 1) */
	uint32_t epoch, n;                 /* the epoch of the last op, and its number in it */
	int held;                          /* an unsharded copy is held (unshard, no reshard yet) */
	struct exec_peer *peer;            /* [world] */
	struct shardd_exec_slot **others;  /* [world]: the peers' slots (NULL: own, unmapped) */
	struct shardd_shard_geometry *geo; /* [nparams] for this rank's shard */
	struct shardd_reduce_math math;
};

static void msgf(char *msg, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void msgf(char *msg, size_t len, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, len, fmt, ap);
	va_end(ap);
}

static void peer_unmap(struct exec_peer *p)
{
	if (p->shard_size)
		munmap((void *)p->shard, (size_t)p->shard_size);
	if (p->grad_size)
		munmap((void *)p->grad, (size_t)p->grad_size);
	memset(p, 0, sizeof(*p));
}

void shardd_exec_detach(struct shardd_group *g)
{
	struct shardd_exec_state *x = g->x;

	if (!x)
		return;
	shardd_exec_forget(g->client, g);
	for (uint32_t r = 0; x->peer && r < x->world; r++)
		if (r != x->rank)
			peer_unmap(&x->peer[r]);
	if (x->sync)
		munmap(x->sync, (size_t)x->sync_size);
	free(x->peer);
	free(x->others);
	free(x->geo);
	free(x);
	g->x = NULL;
}

/*
 * Map `fd` read-only: `size` bytes of a memfd sealed against shrinking
 * (no SIGBUS under us) and against new writable mappings (no rank but its
 * owner writes it).
 */
static int map_ro(int fd, uint64_t size, const char *what, void **out)
{
	struct stat st;
	int seals = fcntl(fd, F_GET_SEALS);
	void *p;

	if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < size || size > SIZE_MAX)
		return shardd_err_set(-SHARDD_E_MALFORMED, "%s: fd of %lld bytes, reply says %llu",
				      what, (long long)st.st_size, (unsigned long long)size);
	if (seals < 0 || !(seals & F_SEAL_SHRINK) || !(seals & F_SEAL_FUTURE_WRITE))
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "%s: not a memfd sealed against shrinking and writes "
				      "(seals 0x%x)",
				      what, (unsigned)seals);
	p = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return shardd_err_set(-errno, "%s: mmap of %llu bytes: %s", what,
				      (unsigned long long)size, strerror(errno));
	*out = p;
	return 0;
}

/*
 * EXEC_MAP for `peer`: this rank's own (publish it) or another's buffers,
 * mapped read-only. 0, -SHARDD_E_STATE (the peer has not published them
 * yet), or another code with context.
 */
static int exec_map(struct shardd_group *g, uint32_t peer)
{
	struct shardd_exec_state *x = g->x;
	struct shardd_exec_map req = { .group_id = g->info.group_id, .peer = peer };
	struct shardd_exec_map_reply rep;
	struct shardd_ctrl_rx rx = { 0 };
	struct exec_peer p = { 0 };
	uint64_t grad_map = shardd_exec_grad_map_size(g->info.grad_size);
	void *shard = NULL, *grad = NULL;
	int ret;

	ret = shardd_client_request(g->client, SHARDD_MSG_EXEC_MAP, &req, sizeof(req),
				    (int)g->client->welcome.collective_timeout_ms,
				    SHARDD_MSG_EXEC_MAP_REPLY, &rx);
	if (ret < 0)
		return ret;
	ret = -SHARDD_E_MALFORMED;
	if (rx.hdr.length != sizeof(rep)) {
		shardd_err_set(ret, "EXEC_MAP reply of %u bytes, want %zu", rx.hdr.length,
			       sizeof(rep));
		goto out;
	}
	memcpy(&rep, rx.payload, sizeof(rep));
	if (rep.group_id != req.group_id || rep.peer != peer || !rep.gen ||
	    rep.nfds != (peer == x->rank ? 0u : 2u) || (int)rep.nfds != rx.nfds ||
	    (rep.nfds &&
	     (rep.shard_map_size != g->info.shard_size || rep.grad_map_size != grad_map))) {
		shardd_err_set(ret,
			       "EXEC_MAP reply for group %u rank %u: group_id %u, peer %u, gen %u, "
			       "%u fds (%d sent), sizes %llu/%llu (want %llu/%llu)",
			       req.group_id, peer, rep.group_id, rep.peer, rep.gen, rep.nfds,
			       rx.nfds, (unsigned long long)rep.shard_map_size,
			       (unsigned long long)rep.grad_map_size,
			       (unsigned long long)g->info.shard_size,
			       (unsigned long long)grad_map);
		goto out;
	}
	if (peer == x->rank) {
		x->peer[peer].gen = rep.gen;
		ret = 0;
		goto out;
	}
	if (rep.shard_map_size)
		ret = map_ro(rx.fds[0], rep.shard_map_size, "a peer's flat shard", &shard);
	else
		ret = 0;
	if (!ret)
		ret = map_ro(rx.fds[1], rep.grad_map_size, "a peer's grad buffer", &grad);
	if (ret) {
		if (shard)
			munmap(shard, (size_t)rep.shard_map_size);
		goto out;
	}
	p.gen = rep.gen;
	p.shard = shard;
	p.shard_size = rep.shard_map_size;
	p.grad = grad;
	p.grad_size = rep.grad_map_size;
	p.slot = (struct shardd_exec_slot *)(void *)((uint8_t *)grad +
						     shardd_exec_slot_offset(g->info.grad_size));
	peer_unmap(&x->peer[peer]);
	x->peer[peer] = p;
	x->others[peer] = p.slot;
out:
	shardd_ctrl_rx_reset(&rx);
	return ret;
}

int shardd_exec_attach(struct shardd_group *g, int sync_fd)
{
	uint32_t world = g->info.shard_world, rank = g->client->rank;
	uint64_t sync_size = shardd_exec_sync_size(world);
	struct shardd_exec_state *x;
	double pre, post;
	void *sync = NULL;
	int ret;

	if (g->client->welcome.backend != SHARDD_BACKEND_HOST || rank >= world)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "group '%s' is rank-executed, but the backend is %u and rank "
				      "%u of a shard group of %u",
				      g->name, g->client->welcome.backend, rank, world);
	if (g->buf[SHARDD_BUF_GRAD].size < shardd_exec_grad_map_size(g->info.grad_size))
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "group '%s': grad buffer of %llu bytes has no slot after its "
				      "%llu bytes of grads",
				      g->name, (unsigned long long)g->buf[SHARDD_BUF_GRAD].size,
				      (unsigned long long)g->info.grad_size);
	ret = map_ro(sync_fd, sync_size, "the sync page", &sync);
	if (ret)
		return ret;
	x = calloc(1, sizeof(*x));
	if (x) {
		x->peer = calloc(world, sizeof(*x->peer));
		x->others = calloc(world, sizeof(*x->others));
		x->geo = calloc(g->info.nparams, sizeof(*x->geo));
	}
	g->x = x;
	if (!x || !x->peer || !x->others || !x->geo) {
		munmap(sync, (size_t)sync_size);
		if (x)
			x->sync = NULL;
		shardd_exec_detach(g);
		return shardd_err_set(-ENOMEM, "group '%s': out of memory", g->name);
	}
	x->sync = sync;
	x->sync_size = sync_size;
	x->world = world;
	x->rank = rank;
	if (shardd_load_acquire(&x->sync->magic) != SHARDD_EXEC_MAGIC ||
	    x->sync->version != SHARDD_EXEC_VERSION || x->sync->world != world ||
	    x->sync->group_id != g->info.group_id) {
		ret = shardd_err_set(
			-SHARDD_E_MALFORMED,
			"group '%s': sync page magic 0x%x version %u world %u group %u, "
			"want 0x%x, %d, %u, %u",
			g->name, x->sync->magic, x->sync->version, x->sync->world,
			x->sync->group_id, SHARDD_EXEC_MAGIC, SHARDD_EXEC_VERSION, world,
			g->info.group_id);
		goto err;
	}
	x->mine = (struct shardd_exec_slot *)(void *)((uint8_t *)g->buf[SHARDD_BUF_GRAD].addr +
						      shardd_exec_slot_offset(g->info.grad_size));
	x->peer[rank].shard = g->buf[SHARDD_BUF_SHARD].addr;
	x->peer[rank].grad = g->buf[SHARDD_BUF_GRAD].addr;
	x->peer[rank].slot = x->mine;
	for (uint32_t i = 0; i < g->info.nparams; i++) {
		if (shardd_group_geometry(&g->specs[i], world, rank, &x->geo[i])) {
			ret = shardd_err_set(-SHARDD_E_MALFORMED, "param %u: bad geometry", i);
			goto err;
		}
	}
	/* FSDP2's divide factors for one reduce-scatter over the shard group (the daemon's). */
	x->math.reduce_dtype = g->info.reduce_dtype != SHARDD_DTYPE_NONE ? g->info.reduce_dtype
									 : g->info.grad_dtype;
	shardd_divide_factors(world, x->math.reduce_dtype, &pre, &post);
	x->math.pre = pre == 0 ? 1.0f : (float)pre;
	x->math.avg = pre == 0 ? (float)world : 1.0f;
	x->math.post = pre == 0 ? 1.0f : (float)post;
	/* A second handle: the first one published these buffers and runs the ops. */
	ret = g->exec_second ? 0 : exec_map(g, rank);
	if (ret)
		goto err;
	return 0;
err:
	shardd_exec_detach(g);
	return ret;
}

/* ------------------------------------------------------------------ */
/* Where the peers are                                                 */
/* ------------------------------------------------------------------ */

/* One op submitted on a rank-executed group, not yet complete (a FIFO per client). */
struct shardd_xop {
	struct shardd_xop *next;
	struct shardd_group *g;
	uint32_t op, flags;
	uint64_t step, user_data;
	uint64_t args[2]; /* a reduce's step: what the daemon's REDUCE entry carries */
	uint32_t epoch, n;
	/* this rank's slot before the op was published: put back if it fails unread (xop_retract) */
	uint64_t prev_seq, prev_step;
	uint32_t prev_op;
	uint64_t prev_reduces; /* a reduce: the slot's count before it */
	void *backup;          /* an accumulating reduce: the sharded grad before it, or NULL */
	int read;              /* a reduce read its inputs and published done */
	int keep;         /* failed where a peer that gave up on it kept its number: keep it too */
	int64_t deadline; /* CLOCK_MONOTONIC ns: the collective timeout from its submission */
	struct shardd_completion *out; /* a sync call's: filled here instead of the stash */
	int *finished;                 /* and set to 1 */
};

/* The ranks not yet at the op (their `done` words when `done`), as "1, 3", into buf. */
static void missing(const struct shardd_exec_state *x, const struct shardd_xop *o, int done,
		    char *buf, size_t len)
{
	size_t off = 0;

	buf[0] = '\0';
	for (uint32_t r = 0; r < x->world && off < len; r++) {
		const struct shardd_exec_slot *s = x->peer[r].slot;

		if (r == x->rank ||
		    (s && shardd_exec_reached(shardd_load_acquire(done ? &s->done : &s->seq),
					      o->epoch, o->n)))
			continue;
		off += (size_t)snprintf(buf + off, len - off, "%s%u", off ? ", " : "", r);
	}
}

/*
 * A reduce whose peer r (now at generation `gen`) left before it stored
 * its done for op `o`: that peer never wrote its own output, so the reduce
 * fails on every rank alike, -SHARDD_E_PEER_DIED with msg (each sees the
 * same final words in its mapping of the departed peer's slot), and is
 * retried whole, at once: waiting for the done phase would leave a rank
 * still reading waiting for a peer that has already failed and given its
 * number back. 0 when r is still the generation mapped here, the op is not
 * a reduce, or r stored its done before it left.
 */
static int reduce_abandoned(const struct shardd_xop *o, uint32_t r, uint32_t gen, char *msg,
			    size_t len)
{
	const struct shardd_exec_state *x = o->g->x;

	if (o->op != SHARDD_OP_REDUCE || gen == x->peer[r].gen ||
	    shardd_exec_reached(shardd_load_acquire(&x->peer[r].slot->done), o->epoch, o->n))
		return 0;
	msgf(msg, len,
	     "shardd: reduce(group '%s', step %llu): rank %u left (its client is gone) before it "
	     "finished this rank-executed reduce; retry it once the rank is back",
	     o->g->name, (unsigned long long)o->step, r);
	return -SHARDD_E_PEER_DIED;
}

/* Whether the peer whose slot is `s` gave up waiting on op `o` (its collective timeout). */
static int peer_gave_up(const struct shardd_xop *o, const struct shardd_exec_slot *s)
{
	return shardd_load_acquire(&s->gave_up) == shardd_exec_word(o->epoch, o->n) &&
	       SHARDD_READ_ONCE(s->gave_up_step) == o->step;
}

/*
 * 1 when mapped peer r's seq says it reached op `o`, with *res 1, or
 * -SHARDD_E_MISMATCH (and msg) when it is exactly at this op but submitted
 * another op or step; 0 when it has not reached it.
 */
static int peer_ready(struct shardd_xop *o, uint32_t r, int *res, char *msg, size_t len)
{
	const struct shardd_exec_state *x = o->g->x;
	const struct shardd_exec_slot *s = x->peer[r].slot;
	uint64_t seen = shardd_load_acquire(&s->seq), pstep;
	uint32_t pop;

	if (peer_gave_up(o, s)) {
		/*
		 * The daemon's words for a late arrival at a rendezvous that timed
		 * out. A peer that gave up before it read had given its number
		 * back, and so does this rank; one that gave up waiting for the
		 * others to finish reading its grads kept it (shardd_exec_progress), and so
		 * does this rank, so that their next ops are numbered alike.
		 */
		o->keep = shardd_exec_reached(shardd_load_acquire(&s->seq), o->epoch, o->n);
		msgf(msg, len,
		     "shardd: %s(group '%s', step %llu): rank %u arrived after rank %u gave up "
		     "waiting for it (the collective timeout, %g s); failed at once: retry with the "
		     "others",
		     shardd_op_name(o->op), o->g->name, (unsigned long long)o->step, x->rank, r,
		     o->g->client->welcome.collective_timeout_ms / 1e3);
		*res = -SHARDD_E_TIMEOUT;
		return 1;
	}
	if (!shardd_exec_reached(seen, o->epoch, o->n))
		return 0;
	*res = 1;
	/* Exactly at this op (not past it, nor writing a later one): the same op and step. */
	if (shardd_exec_read_op(s, shardd_exec_word(o->epoch, o->n), &pop, &pstep) &&
	    (pop != o->op || pstep != o->step)) {
		msgf(msg, len,
		     "shardd: group '%s': ranks disagree on op %u of the epoch: rank %u submitted "
		     "%s step %llu, rank %u %s step %llu",
		     o->g->name, o->n, x->rank, shardd_op_name(o->op), (unsigned long long)o->step,
		     r, shardd_op_name(pop) ? shardd_op_name(pop) : "?", (unsigned long long)pstep);
		*res = -SHARDD_E_MISMATCH;
	}
	return 1;
}

/* Peer r reached op `o`: 1, or the error of a reduce it abandoned. */
static int reached(const struct shardd_xop *o, uint32_t r, uint32_t gen, char *msg, size_t len)
{
	int ret = reduce_abandoned(o, r, gen, msg, len);

	return ret < 0 ? ret : 1;
}

/*
 * Whether peer r reached op `o` (its seq, or its done when `done`),
 * mapping its buffers first when its generation changed: 1, 0 (not yet;
 * *word and *seen say what to sleep on, *word NULL: the sync page), or an
 * error with msg.
 *
 * A reduce whose peer left before it stored its done fails (see
 * reduce_abandoned), whether this rank has written its output yet or not.
 */
static int peer_at(struct shardd_xop *o, uint32_t r, int done, uint64_t **word, uint64_t *seen,
		   char *msg, size_t len)
{
	struct shardd_group *g = o->g;
	struct shardd_exec_state *x = g->x;
	uint32_t gen = shardd_exec_gen(x->sync, r), dead;
	int ret;

	*word = NULL;
	if (done) {
		*word = &x->peer[r].slot->done;
		*seen = shardd_load_acquire(*word);
		if (!shardd_exec_reached(*seen, o->epoch, o->n))
			return reduce_abandoned(o, r, gen, msg, len);
		/* It read this rank's grads, but too late: it has failed the reduce, and so does this rank. */
		if (peer_gave_up(o, x->peer[r].slot)) {
			msgf(msg, len,
			     "shardd: reduce(group '%s', step %llu): rank %u finished reading after rank "
			     "%u gave up waiting for it (the collective timeout, %g s); failed at once: "
			     "retry with the others",
			     g->name, (unsigned long long)o->step, x->rank, r,
			     g->client->welcome.collective_timeout_ms / 1e3);
			return -SHARDD_E_TIMEOUT;
		}
		return 1;
	}
	/*
	 * A peer that reached the op before it left counts: its buffers stay
	 * mapped here, and what it published cannot change any more.
	 */
	if (x->peer[r].gen && peer_ready(o, r, &ret, msg, len))
		return ret < 0 ? ret : reached(o, r, gen, msg, len);
	/*
	 * A peer that left may have reached the op in buffers this rank never
	 * mapped (it attached again, ran, and left): the daemon still lends
	 * what it published last.
	 */
	if (gen == SHARDD_EXEC_GONE && exec_map(g, r) == 0 && peer_ready(o, r, &ret, msg, len))
		return ret < 0 ? ret : reached(o, r, gen, msg, len);
	if (gen == SHARDD_EXEC_GONE) {
		msgf(msg, len,
		     "shardd: %s(group '%s', step %llu): rank %u left (its client is gone) and has "
		     "not attached again; retry once it is back",
		     shardd_op_name(o->op), g->name, (unsigned long long)o->step, r);
		return -SHARDD_E_PEER_DIED;
	}
	if (shardd_exec_epoch(x->sync) != o->epoch) {
		dead = shardd_exec_dead_rank(x->sync);
		msgf(msg, len,
		     "shardd: %s(group '%s', step %llu): rank %u left (its client is gone) and "
		     "attached again during this rank-executed op; retry it",
		     shardd_op_name(o->op), g->name, (unsigned long long)o->step,
		     dead ? dead - 1 : 0);
		return -SHARDD_E_PEER_DIED;
	}
	if (gen && gen != x->peer[r].gen) {
		ret = exec_map(g, r);
		/* -SHARDD_E_STATE: it left again since; wait for its next generation. */
		if (ret && ret != -SHARDD_E_STATE) {
			msgf(msg, len, "shardd: %s(group '%s'): mapping rank %u's buffers: %s",
			     shardd_op_name(o->op), g->name, r, shardd_last_error());
			return ret;
		}
	}
	if (!x->peer[r].gen || x->peer[r].gen != gen)
		return 0;
	if (peer_ready(o, r, &ret, msg, len))
		return ret;
	*word = &x->peer[r].slot->seq;
	*seen = shardd_load_acquire(*word);
	return 0;
}

/*
 * Whether every peer reached op `o`: 1, 0 (the first one that has not:
 * *word, *seen to sleep on), or an error with msg, a timeout past the
 * op's deadline naming the ranks missing.
 */
static int peers_at(struct shardd_xop *o, int done, uint64_t **word, uint64_t *seen, char *msg,
		    size_t len)
{
	struct shardd_exec_state *x = o->g->x;
	uint64_t *w = NULL, sn = 0;
	int waiting = 0;
	char who[256];

	/* Every peer, not only up to the first that is not there: one that left fails the op now. */
	for (uint32_t r = 0; r < x->world; r++) {
		int ret = r == x->rank ? 1 : peer_at(o, r, done, &w, &sn, msg, len);

		if (ret < 0)
			return ret;
		if (ret == 0 && !waiting) {
			waiting = 1;
			*word = w;
			*seen = sn;
			/* For shardctl: this op waits for rank r, since now (cleared when it ends). */
			if (!SHARDD_READ_ONCE(x->mine->wait_op)) {
				SHARDD_WRITE_ONCE(x->mine->wait_peer, r + 1);
				SHARDD_WRITE_ONCE(x->mine->wait_since_ns,
						  (uint64_t)shardd_client_now_ns());
				shardd_store_release(&x->mine->wait_op, o->op);
			}
		}
	}
	if (waiting) {
		if (shardd_client_now_ns() < o->deadline)
			return 0;
		missing(x, o, done, who, sizeof(who));
		/* The daemon's words for a rendezvous that timed out. */
		msgf(msg, len,
		     "shardd: %s(group '%s', step %llu): rank(s) %s did not %s within %g s; rank %u "
		     "is waiting",
		     shardd_op_name(o->op), o->g->name, (unsigned long long)o->step,
		     who[0] ? who : "?", done ? "finish reading this rank's grads" : "submit it",
		     o->g->client->welcome.collective_timeout_ms / 1e3, x->rank);
		return -SHARDD_E_TIMEOUT;
	}
	return 1;
}

/* ------------------------------------------------------------------ */
/* The ops                                                             */
/* ------------------------------------------------------------------ */

/* Every peer's flat shard rows into this rank's unsharded copy (FSDP2's all-gather + copy-out). */
static void run_unshard(struct shardd_group *g)
{
	struct shardd_exec_state *x = g->x;
	uint8_t *out = g->buf[SHARDD_BUF_UNSHARDED].addr;

	for (uint32_t i = 0; i < g->info.nparams; i++) {
		const struct shardd_shard_geometry *geo = &x->geo[i];
		const struct shardd_param_layout *l = &g->layouts[i];
		uint32_t dt = g->specs[i].dtype;
		uint32_t udt = g->info.param_dtype != SHARDD_DTYPE_NONE ? g->info.param_dtype : dt;
		uint64_t chunk = geo->rows * geo->inner;
		uint8_t *dst = out + l->unsharded_offset;

		if (!geo->numel)
			continue;
		if (g->specs[i].shard_dim == 0 || g->specs[i].ndim == 0) {
			/* Dim 0: shard s holds elements [s * chunk, s * chunk + its valid rows). */
			for (uint32_t s = 0; s < x->world; s++) {
				uint64_t begin = s * chunk;
				uint64_t n = geo->numel > begin ? geo->numel - begin : 0;

				if (n > chunk)
					n = chunk;
				if (n)
					shardd_k_cast(dst + begin * shardd_dtype_size(udt), udt,
						      x->peer[s].shard + l->shard_offset, dt, n);
			}
		} else {
			const void *src[SHARDD_MAX_WORLD];

			for (uint32_t s = 0; s < x->world; s++)
				src[s] = x->peer[s].shard + l->shard_offset;
			shardd_k_chunk_cat(dst, udt, src, dt, x->world, geo->outer, chunk);
		}
	}
}

/* This rank's rows of every rank's grad, summed, into its sharded grad (FSDP2's reduce-scatter). */
static void run_reduce(struct shardd_group *g, int accumulate)
{
	struct shardd_exec_state *x = g->x;
	uint8_t *out = g->buf[SHARDD_BUF_SHARD_GRAD].addr;

	for (uint32_t i = 0; i < g->info.nparams; i++) {
		const struct shardd_shard_geometry *geo = &x->geo[i];
		const struct shardd_param_layout *l = &g->layouts[i];
		uint32_t odt = g->specs[i].dtype;
		uint32_t gdt = g->info.param_dtype != SHARDD_DTYPE_NONE ? g->info.param_dtype : odt;
		size_t os = shardd_dtype_size(odt), gs = shardd_dtype_size(gdt);
		uint64_t block = geo->valid * geo->inner;
		const void *in[SHARDD_MAX_WORLD];

		if (!geo->shard_numel)
			continue;
		for (uint64_t o = 0; o < geo->outer && block; o++) {
			uint64_t e = (o * geo->dim + (uint64_t)x->rank * geo->rows) * geo->inner;

			for (uint32_t k = 0; k < x->world; k++)
				in[k] = x->peer[k].grad + l->grad_offset + e * gs;
			shardd_k_reduce(out + l->shard_offset + o * geo->rows * geo->inner * os,
					odt, accumulate, in, x->world, gdt, block, &x->math);
		}
		/* Padding rows (dim 0, where outer is 1) read as zero. */
		if (geo->valid < geo->rows)
			shardd_k_zero(out + l->shard_offset + block * os,
				      (geo->rows - geo->valid) * geo->inner * os);
	}
}

/* ------------------------------------------------------------------ */
/* Submission and progress                                             */
/* ------------------------------------------------------------------ */

/*
 * A reduce that asks for a step the daemon will refuse is refused before it
 * gathers, as the daemon refuses it before its rendezvous (the same
 * shardd_step_check): its completion is queued now, with nothing
 * published. Returns 1 when refused so, else 0 (or -ENOMEM).
 */
static int step_refused(struct shardd_group *g, uint64_t step, const uint64_t *args,
			uint64_t user_data, struct shardd_completion *out, int *finished)
{
	struct shardd_completion cp = { .user_data = user_data,
					.op = SHARDD_OP_REDUCE,
					.group = g->info.group_id,
					.step = step };
	const uint64_t none[2] = { 0, 0 };

	cp.res = shardd_step_check(SHARDD_OP_REDUCE, g->name, g->info.optimizer, step,
				   SHARDD_REDUCE_STEP, args ? args : none, cp.msg, sizeof(cp.msg));
	if (!cp.res)
		return 0;
	if (out) {
		*out = cp;
		*finished = 1;
		return 1;
	}
	return shardd_stash_push(&g->client->stash, &cp) < 0 ? -ENOMEM : 1;
}

int shardd_exec_submit(struct shardd_group *g, uint32_t op, uint64_t step, uint32_t flags,
		       const uint64_t *args, uint64_t user_data, struct shardd_completion *out,
		       int *finished)
{
	struct shardd_client *c = g->client;
	struct shardd_exec_state *x = g->x;
	struct shardd_exec_slot *mine = x->mine;
	struct shardd_xop *o;
	uint32_t epoch;

	if (g->exec_second)
		return shardd_err_set(
			-SHARDD_E_STATE,
			"%s(group '%s'): this handle is this client's second of the "
			"rank-executed group, which maps its buffers read-only; submit "
			"through the first",
			shardd_op_name(op), g->name);
	if (flags & ~(uint32_t)(op == SHARDD_OP_REDUCE ? SHARDD_REDUCE_STEP : 0))
		return shardd_err_set(-SHARDD_E_INVALID,
				      "%s(group '%s'): flags = 0x%x: a rank-executed group takes "
				      "none but SHARDD_REDUCE_STEP on a reduce (it has no "
				      "replicate dim)",
				      shardd_op_name(op), g->name, flags);
	if (op == SHARDD_OP_REDUCE && (flags & SHARDD_REDUCE_STEP)) {
		int ret = step_refused(g, step, args, user_data, out, finished);

		if (ret)
			return ret < 0 ? shardd_err_set(ret, "%s(group '%s'): out of memory",
							shardd_op_name(op), g->name)
				       : 0;
	}
	o = calloc(1, sizeof(*o));
	if (!o)
		return shardd_err_set(-ENOMEM, "%s(group '%s'): out of memory", shardd_op_name(op),
				      g->name);
	*o = (struct shardd_xop){ .g = g,
				  .op = op,
				  .flags = flags,
				  .step = step,
				  .user_data = user_data,
				  .out = out,
				  .finished = finished };
	if (args)
		memcpy(o->args, args, sizeof(o->args));
	o->deadline = shardd_client_now_ns() + (int64_t)c->welcome.collective_timeout_ms * 1000000;
	if (op != SHARDD_OP_RESHARD) {
		/* A rank left since this rank's last op: a new epoch, counted from 1 again. */
		epoch = shardd_exec_epoch(x->sync);
		if (epoch != x->epoch) {
			x->epoch = epoch;
			x->n = 0;
		}
		o->epoch = x->epoch;
		o->n = ++x->n;
		o->prev_seq = SHARDD_READ_ONCE(mine->seq);
		o->prev_op = SHARDD_READ_ONCE(mine->op);
		o->prev_step = SHARDD_READ_ONCE(mine->step);
		/* The inputs are final now (the caller's contract): publish op, step, then seq. */
		shardd_exec_write_op(mine, shardd_exec_word(o->epoch, o->n), op, step);
		shardd_exec_publish(&mine->seq, shardd_exec_word(o->epoch, o->n), x->others,
				    x->world);
	}
	if (c->xtail)
		c->xtail->next = o;
	else
		c->xhead = o;
	c->xtail = o;
	return 0;
}

/*
 * Advance op `o` as far as it goes now: 1 complete (res in *res, text in
 * msg), 0 waiting (*word, *seen: what to sleep on).
 */
static int xop_advance(struct shardd_xop *o, int *res, uint64_t **word, uint64_t *seen, char *msg,
		       size_t len)
{
	struct shardd_group *g = o->g;
	struct shardd_exec_state *x = g->x;
	struct shardd_exec_slot *mine = x->mine;
	int accumulate, ret;

	*res = 0;
	if (o->op == SHARDD_OP_RESHARD) {
		if (!x->held) {
			msgf(msg, len,
			     "shardd: rank %u has no unsharded copy of group '%s' to reshard",
			     x->rank, g->name);
			*res = -SHARDD_E_STATE;
			return 1;
		}
		x->held = 0;
		shardd_store_release(&mine->reshards, mine->reshards + 1);
		return 1;
	}
	if (!o->read) {
		ret = peers_at(o, 0, word, seen, msg, len);
		if (ret <= 0) {
			*res = ret;
			return ret < 0;
		}
		if (o->op == SHARDD_OP_UNSHARD) {
			run_unshard(g);
			x->held = 1;
			shardd_store_release(&mine->unshards, mine->unshards + 1);
			return 1;
		}
		accumulate = shardd_load_acquire(&mine->reduces) != SHARDD_READ_ONCE(mine->cleared);
		/* What an accumulating reduce adds to, kept until it completes (xop_retract). */
		if (accumulate) {
			o->backup = malloc(g->info.shard_size ? g->info.shard_size : 1);
			if (!o->backup) {
				msgf(msg, len, "shardd: reduce(group '%s'): out of memory",
				     g->name);
				*res = -SHARDD_E_NOMEM;
				return 1;
			}
			memcpy(o->backup, g->buf[SHARDD_BUF_SHARD_GRAD].addr, g->info.shard_size);
		}
		run_reduce(g, accumulate);
		/*
		 * The sharded grad holds the sum: counted before done is stored, so
		 * a renewed slot (this rank died past here) says so.
		 */
		o->prev_reduces = mine->reduces;
		shardd_store_release(&mine->reduces, mine->reduces + 1);
		shardd_exec_publish(&mine->done, shardd_exec_word(o->epoch, o->n), x->others,
				    x->world);
		o->read = 1;
	}
	ret = peers_at(o, 1, word, seen, msg, len);
	*res = ret < 0 ? ret : 0;
	return ret != 0;
}

/* A group's op ahead of `o` in the queue is still pending: `o` waits its turn. */
static int xop_blocked(const struct shardd_client *c, const struct shardd_xop *o)
{
	for (const struct shardd_xop *p = c->xhead; p != o; p = p->next)
		if (p->g == o->g)
			return 1;
	return 0;
}

int shardd_exec_pending(const struct shardd_client *c)
{
	return c->xhead != NULL;
}

static void xop_free(struct shardd_xop *o)
{
	free(o->backup);
	free(o);
}

/* Deliver a finished op's completion `cp` (its step to the daemon, a sync call's, or the stash) and free it. */
static int xop_deliver(struct shardd_client *c, struct shardd_xop *o,
		       const struct shardd_completion *cp)
{
	int ret = 0;

	if (!cp->res && o->op == SHARDD_OP_REDUCE && (o->flags & SHARDD_REDUCE_STEP) && !o->out) {
		/* The reduce ran here; its step is the daemon's (ops.c submits it), whose
		   completion is the op's. */
		o->next = NULL;
		if (c->xsteps_tail)
			c->xsteps_tail->next = o;
		else
			c->xsteps = o;
		c->xsteps_tail = o;
		return 0;
	}
	if (o->out)
		*o->out = *cp;
	else
		ret = shardd_stash_push(&c->stash, cp);
	if (o->finished)
		*o->finished = 1;
	xop_free(o);
	return ret;
}

/*
 * Op `o` (unlinked, after `prev`) failed where no rank can have completed
 * it: before it read anything (a peer had not reached it), or a reduce
 * whose peer left before finishing it (peer_at). Its number is given back,
 * so that this rank and its peers number the group's next ops alike, as a
 * failed rendezvous of the daemon leaves no trace; a reduce's sharded grad
 * and count are put back. The group's ops queued after it fail with it
 * (they were published after it, and ops of a group run in order), then
 * the slot is put back as it was before `o` was published. *next: the op
 * after `o` that is still queued. 0, or the first delivery's error.
 */
static int xop_retract(struct shardd_client *c, struct shardd_xop *o, struct shardd_xop *prev,
		       struct shardd_xop **next, const struct shardd_completion *cp)
{
	struct shardd_exec_state *x = o->g->x;
	struct shardd_exec_slot *mine = x->mine;
	struct shardd_xop *p = *next, *after;
	int ret = 0;

	for (; p; p = after) {
		struct shardd_completion f = { .user_data = p->user_data,
					       .op = p->op,
					       .group = p->g->info.group_id,
					       .step = p->step,
					       .res = cp->res };

		after = p->next;
		if (p->g != o->g) {
			prev = p;
			continue;
		}
		if (prev)
			prev->next = after;
		else
			c->xhead = after;
		if (c->xtail == p)
			c->xtail = prev;
		if (*next == p)
			*next = after;
		msgf(f.msg, sizeof(f.msg), "shardd: %s(group '%s', step %llu): not run: %.180s",
		     shardd_op_name(p->op), p->g->name, (unsigned long long)p->step, cp->msg);
		if (!ret) {
			ret = xop_deliver(c, p, &f);
		} else {
			xop_free(p);
		}
	}
	if (o->read) {
		if (o->backup)
			memcpy(o->g->buf[SHARDD_BUF_SHARD_GRAD].addr, o->backup,
			       o->g->info.shard_size);
		shardd_store_release(&mine->reduces, o->prev_reduces);
	}
	if (o->epoch == x->epoch)
		x->n = o->n - 1;
	shardd_exec_write_op(mine, o->prev_seq, o->prev_op, o->prev_step);
	shardd_exec_publish(&mine->seq, o->prev_seq, x->others, x->world);
	return ret;
}

int shardd_exec_progress(struct shardd_client *c)
{
	struct shardd_xop *prev = NULL, *o = c->xhead, *next;
	int done = 0;

	c->xwait.word = NULL;
	c->xwait.mine = NULL;
	for (; o; o = next) {
		struct shardd_completion cp = { .user_data = o->user_data,
						.op = o->op,
						.group = o->g->info.group_id,
						.step = o->step };
		uint64_t *w = NULL, sn = 0;
		int ret;

		next = o->next;
		if (xop_blocked(c, o) ||
		    !xop_advance(o, &cp.res, &w, &sn, cp.msg, sizeof(cp.msg))) {
			/* What the first op that waits waits for: shardd_exec_nap sleeps on it. */
			if (!c->xwait.mine) {
				c->xwait.mine = o->g->x->mine;
				c->xwait.word = w;
				c->xwait.seen = sn;
				c->xwait.sync = o->g->x->sync;
				c->xwait.changes = shardd_load_acquire(&o->g->x->sync->changes);
			}
			prev = o;
			continue;
		}
		if (prev)
			prev->next = next;
		else
			c->xhead = next;
		if (c->xtail == o)
			c->xtail = prev;
		if (SHARDD_READ_ONCE(o->g->x->mine->wait_op))
			shardd_store_release(&o->g->x->mine->wait_op, 0u);
		/*
		 * A timeout after the reduce's output was written leaves it (and its
		 * number), and so does a mismatch: every rank at this number fails
		 * it alike, which it can only see while the others' words stay.
		 */
		ret = cp.res < 0 && o->op != SHARDD_OP_RESHARD && cp.res != -SHARDD_E_MISMATCH &&
				      !o->keep && (!o->read || cp.res == -SHARDD_E_PEER_DIED)
			      ? xop_retract(c, o, prev, &next, &cp)
			      : 0;
		/*
		 * Given up on: a peer that comes to this op later fails it at once
		 * (peer_ready, peer_at). Stored after the retraction, so that a
		 * peer that sees it sees whether the number was given back.
		 */
		if (cp.res == -SHARDD_E_TIMEOUT && o->op != SHARDD_OP_RESHARD && !o->keep) {
			SHARDD_WRITE_ONCE(o->g->x->mine->gave_up_step, o->step);
			shardd_store_release(&o->g->x->mine->gave_up,
					     shardd_exec_word(o->epoch, o->n));
		}
		if (!ret) {
			ret = xop_deliver(c, o, &cp);
		} else {
			xop_free(o);
		}
		if (ret < 0)
			return ret;
		done++;
	}
	return done;
}

int shardd_exec_next_step(struct shardd_client *c, struct shardd_exec_step *out)
{
	struct shardd_xop *o = c->xsteps;

	if (!o)
		return 0;
	c->xsteps = o->next;
	if (!c->xsteps)
		c->xsteps_tail = NULL;
	*out = (struct shardd_exec_step){ .group_id = o->g->info.group_id,
					  .flags = o->flags,
					  .step = o->step,
					  .user_data = o->user_data };
	memcpy(out->args, o->args, sizeof(out->args));
	xop_free(o);
	return 1;
}

void shardd_exec_nap(struct shardd_client *c, int64_t max_ns)
{
	struct timespec ts = { max_ns / 1000000000, max_ns % 1000000000 };

	if (!c->xwait.mine)
		return;
	if (c->xwait.word)
		shardd_exec_sleep(c->xwait.mine, c->xwait.word, c->xwait.seen, &ts);
	else
		shardd_futex(&c->xwait.sync->changes, FUTEX_WAIT, c->xwait.changes, &ts);
}

/* Fail every op of the list at *head with `res` and `msg`: the number failed, or the first delivery's error. */
static int xops_fail(struct shardd_client *c, struct shardd_xop **head, int res, const char *msg)
{
	struct shardd_xop *o;
	int n = 0, ret = 0;

	while ((o = *head)) {
		struct shardd_completion cp = { .user_data = o->user_data,
						.op = o->op,
						.group = o->g->info.group_id,
						.step = o->step,
						.res = res };

		*head = o->next;
		if (SHARDD_READ_ONCE(o->g->x->mine->wait_op))
			shardd_store_release(&o->g->x->mine->wait_op, 0u);
		msgf(cp.msg, sizeof(cp.msg), "%s", msg);
		if (!ret) {
			ret = xop_deliver(c, o, &cp);
		} else {
			xop_free(o);
		}
		n++;
	}
	return ret < 0 ? ret : n;
}

int shardd_exec_fail_all(struct shardd_client *c, int res, const char *msg)
{
	/* The pending ops, and the reduces whose step the daemon was to run. */
	int pending = xops_fail(c, &c->xhead, res, msg);
	int steps = xops_fail(c, &c->xsteps, res, msg);

	c->xtail = c->xsteps_tail = NULL;
	return pending < 0 ? pending : steps < 0 ? steps : pending + steps;
}

/* Drop the ops of group `g` from the list at *head (and *tail). */
static void xops_drop(struct shardd_xop **head, struct shardd_xop **tail,
		      const struct shardd_group *g)
{
	struct shardd_xop **at = head, *o;

	*tail = NULL;
	while ((o = *at)) {
		if (o->g != g) {
			*tail = o;
			at = &o->next;
			continue;
		}
		*at = o->next;
		if (o->finished)
			*o->finished = 1;
		xop_free(o);
	}
}

void shardd_exec_forget(struct shardd_client *c, const struct shardd_group *g)
{
	xops_drop(&c->xhead, &c->xtail, g);
	xops_drop(&c->xsteps, &c->xsteps_tail, g);
}

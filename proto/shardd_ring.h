/* SPDX-License-Identifier: MIT */
/*
 * Accessors for the shared ring region (layout in shardd_proto.h, rules in
 * PROTOCOL.md "Ring"). Both the daemon and libshardd use these, so the
 * memory-ordering rules live in exactly one place. libc only.
 *
 * Roles: the client produces SQ entries and consumes CQ entries; the daemon
 * consumes SQ entries and produces CQ entries. Each index is a free-running
 * uint32_t counter; slot = counter & (entries - 1).
 *
 * Every value read from the other side is untrusted: a tail that runs more
 * than a ring's capacity ahead of its head is reported as -EBADMSG.
 */
#ifndef SHARDD_RING_H
#define SHARDD_RING_H

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shardd_proto.h"

/* Process-local view of a mapped ring region. */
struct shardd_ring {
	struct shardd_ring_hdr *hdr;
	struct shardd_sqe *sq;
	struct shardd_cqe *cq;
	char *msg; /* cq_entries slots of msg_size bytes */
	uint32_t sq_mask;
	uint32_t cq_mask;
	uint32_t msg_size;
};

/*
 * Barrier primitives, modelled on liburing's barrier.h. The header's fields
 * are plain uint32_t/uint64_t for a fixed layout; these reach them
 * atomically, whatever their type (gnu11 __typeof__). Only this file uses
 * them: every other file reaches the shared header through the accessors
 * below, so that the memory-ordering rules live in one place.
 *
 * SHARDD_READ_ONCE / SHARDD_WRITE_ONCE: a relaxed load or store of `var`
 * (no tearing, no ordering). shardd_load_acquire / shardd_store_release:
 * through pointer `p`, ordering what follows / what precedes. shardd_smp_mb:
 * a full barrier. shardd_fetch_or / _and / _add / _sub: relaxed
 * read-modify-writes of `var`.
 */
#define SHARDD_ATOMIC_OF(p)   ((_Atomic __typeof__(*(p)) *)(void *)(p))
#define SHARDD_READ_ONCE(var) atomic_load_explicit(SHARDD_ATOMIC_OF(&(var)), memory_order_relaxed)
#define SHARDD_WRITE_ONCE(var, val) \
	atomic_store_explicit(SHARDD_ATOMIC_OF(&(var)), (val), memory_order_relaxed)
#define shardd_load_acquire(p) atomic_load_explicit(SHARDD_ATOMIC_OF(p), memory_order_acquire)
#define shardd_store_release(p, v) \
	atomic_store_explicit(SHARDD_ATOMIC_OF(p), (v), memory_order_release)
#define shardd_smp_mb() atomic_thread_fence(memory_order_seq_cst)
#define shardd_fetch_or(var, v) \
	atomic_fetch_or_explicit(SHARDD_ATOMIC_OF(&(var)), (v), memory_order_relaxed)
#define shardd_fetch_and(var, v) \
	atomic_fetch_and_explicit(SHARDD_ATOMIC_OF(&(var)), (v), memory_order_relaxed)
#define shardd_fetch_add(var, v) \
	atomic_fetch_add_explicit(SHARDD_ATOMIC_OF(&(var)), (v), memory_order_relaxed)
#define shardd_fetch_sub(var, v) \
	atomic_fetch_sub_explicit(SHARDD_ATOMIC_OF(&(var)), (v), memory_order_relaxed)

static inline int shardd_is_pow2(uint32_t v)
{
	return v && !(v & (v - 1));
}

/* Bytes needed for a region with the given capacities. */
static inline uint64_t shardd_ring_region_size(uint32_t sq_entries, uint32_t cq_entries)
{
	return sizeof(struct shardd_ring_hdr) + (uint64_t)sq_entries * sizeof(struct shardd_sqe) +
	       (uint64_t)cq_entries * sizeof(struct shardd_cqe) +
	       (uint64_t)cq_entries * SHARDD_RING_MSG_SIZE;
}

/*
 * Daemon side: lay out a zeroed region of `size` bytes and publish it.
 * Returns 0 or -EINVAL (capacities not powers of two, or size too small).
 */
static inline int shardd_ring_format(void *region, uint64_t size, uint32_t sq_entries,
				     uint32_t cq_entries, uint32_t daemon_pid, uint32_t client_id)
{
	struct shardd_ring_hdr *h = region;

	if (!shardd_is_pow2(sq_entries) || !shardd_is_pow2(cq_entries) ||
	    size < shardd_ring_region_size(sq_entries, cq_entries))
		return -EINVAL;
	h->magic = SHARDD_RING_MAGIC;
	h->sq_entries = sq_entries;
	h->cq_entries = cq_entries;
	h->sq_off = sizeof(*h);
	h->cq_off = h->sq_off + sq_entries * (uint32_t)sizeof(struct shardd_sqe);
	h->msg_off = h->cq_off + cq_entries * (uint32_t)sizeof(struct shardd_cqe);
	h->msg_size = SHARDD_RING_MSG_SIZE;
	h->region_size = size;
	h->daemon_pid = daemon_pid;
	h->client_id = client_id;
	/* Publish the layout before the version: attach reads version with acquire. */
	shardd_store_release(&h->version, (uint32_t)SHARDD_PROTO_MAJOR << 16 | SHARDD_PROTO_MINOR);
	return 0;
}

/*
 * Either side: validate a mapped region of `size` bytes and fill `r`.
 * Returns 0, -SHARDD_E_MAGIC, -SHARDD_E_VERSION or -EBADMSG (layout does not
 * fit in the mapping).
 */
static inline int shardd_ring_attach(struct shardd_ring *r, void *region, uint64_t size)
{
	struct shardd_ring_hdr *h = region;
	uint32_t version;

	if (size < sizeof(*h))
		return -EBADMSG;
	version = shardd_load_acquire(&h->version);
	if (h->magic != SHARDD_RING_MAGIC)
		return -SHARDD_E_MAGIC;
	if (version >> 16 != SHARDD_PROTO_MAJOR)
		return -SHARDD_E_VERSION;
	if (!shardd_is_pow2(h->sq_entries) || !shardd_is_pow2(h->cq_entries) ||
	    h->msg_size != SHARDD_RING_MSG_SIZE || h->sq_off != sizeof(*h) ||
	    h->cq_off != h->sq_off + (uint64_t)h->sq_entries * sizeof(struct shardd_sqe) ||
	    h->msg_off != h->cq_off + (uint64_t)h->cq_entries * sizeof(struct shardd_cqe) ||
	    shardd_ring_region_size(h->sq_entries, h->cq_entries) > size)
		return -EBADMSG;
	r->hdr = h;
	r->sq = (struct shardd_sqe *)((char *)region + h->sq_off);
	r->cq = (struct shardd_cqe *)((char *)region + h->cq_off);
	r->msg = (char *)region + h->msg_off;
	r->sq_mask = h->sq_entries - 1;
	r->cq_mask = h->cq_entries - 1;
	r->msg_size = h->msg_size;
	return 0;
}

/* ---------------- client: submission ---------------- */

/*
 * The SQ slot the next push fills, or -EAGAIN when the SQ is
 * full. Only the client pushes, so the answer holds until its next push.
 */
static inline int64_t shardd_sq_next_slot(const struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = SHARDD_READ_ONCE(h->sq_tail);
	uint32_t head = shardd_load_acquire(&h->sq_head);

	/* Capacities come from our own copy: the shared header is writable by the peer. */
	if (tail - head >= r->sq_mask + 1)
		return -EAGAIN;
	return tail & r->sq_mask;
}

/*
 * Copy `sqe` into `slot`, which shardd_sq_next_slot() returned with no push
 * since, and publish it. For a client that must act on the slot first
 * (record its fence event); shardd_sq_push() does both steps.
 */
static inline void shardd_sq_publish(struct shardd_ring *r, uint32_t slot,
				     const struct shardd_sqe *sqe)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = SHARDD_READ_ONCE(h->sq_tail);

	r->sq[slot] = *sqe;
	/* Publish the entry before the tail: the daemon reads tail with acquire. */
	shardd_store_release(&h->sq_tail, tail + 1);
}

/*
 * Copy `sqe` into the SQ and publish it. Returns 0, or -EAGAIN when the SQ
 * is full. Does not ring the doorbell: see shardd_ring_needs_wakeup().
 */
static inline int shardd_sq_push(struct shardd_ring *r, const struct shardd_sqe *sqe)
{
	int64_t slot = shardd_sq_next_slot(r);

	if (slot < 0)
		return (int)slot;
	shardd_sq_publish(r, (uint32_t)slot, sqe);
	return 0;
}

/*
 * After publishing SQ entries: does the daemon sleep, so that the client must
 * write the doorbell eventfd? The full barrier orders our tail store before
 * the flag load; the daemon does the mirror image (flag store, barrier, tail
 * load) before it sleeps, so at least one side sees the other and no
 * wake-up is lost.
 */
static inline int shardd_ring_needs_wakeup(struct shardd_ring *r)
{
	shardd_smp_mb();
	return SHARDD_READ_ONCE(r->hdr->flags) & SHARDD_RING_NEED_WAKEUP;
}

/* ---------------- daemon: consumption of the SQ ---------------- */

/*
 * Entries waiting in the SQ: >= 0, or -EBADMSG when the client's tail is
 * more than a ring ahead of the daemon's head (a corrupt or hostile client).
 * Read-only, so the client may ask too (diagnostics, doorbell decisions).
 */
static inline int64_t shardd_sq_ready(const struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = shardd_load_acquire(&h->sq_tail);
	uint32_t head = SHARDD_READ_ONCE(h->sq_head);

	/*
	 * The capacity is our own copy, never the header's: a client could
	 * rewrite hdr->sq_entries to hide a corrupt tail.
	 */
	if (tail - head > r->sq_mask + 1)
		return -EBADMSG;
	return tail - head;
}

/*
 * Copy the next SQ entry into `out` (daemon memory, validated afterwards)
 * and return its slot index; the slot stays the daemon's until
 * shardd_sq_release(). Call only when shardd_sq_ready() > 0.
 */
static inline uint32_t shardd_sq_peek(const struct shardd_ring *r, struct shardd_sqe *out)
{
	uint32_t head = SHARDD_READ_ONCE(r->hdr->sq_head);

	memcpy(out, &r->sq[head & r->sq_mask], sizeof(*out));
	return head & r->sq_mask;
}

/*
 * Hand the peeked slot back to the client. Whatever the daemon must do
 * before the client may reuse the slot (wait on the slot's fence event)
 * comes first.
 */
static inline void shardd_sq_release(struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t head = SHARDD_READ_ONCE(h->sq_head);

	/* The copy is done before the slot is handed back to the client. */
	shardd_store_release(&h->sq_head, head + 1);
}

/*
 * Daemon about to sleep: set NEED_WAKEUP, then re-check the SQ. Returns 1
 * when entries arrived meanwhile (flag cleared again, do not sleep), else 0.
 */
static inline int shardd_ring_prepare_sleep(struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;

	shardd_fetch_or(h->flags, SHARDD_RING_NEED_WAKEUP);
	/* Flag store before tail load; pairs with shardd_ring_needs_wakeup(). */
	shardd_smp_mb();
	if (shardd_sq_ready(r) != 0) {
		shardd_fetch_and(h->flags, ~SHARDD_RING_NEED_WAKEUP);
		return 1;
	}
	return 0;
}

/* Daemon awake again: clear NEED_WAKEUP so clients stop ringing. */
static inline void shardd_ring_clear_wakeup(struct shardd_ring *r)
{
	shardd_fetch_and(r->hdr->flags, ~SHARDD_RING_NEED_WAKEUP);
}

/* ---------------- daemon: production of the CQ ---------------- */

/* Free CQ slots: >= 0, or -EBADMSG when the client's head is corrupt. */
static inline int64_t shardd_cq_space(struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = SHARDD_READ_ONCE(h->cq_tail);
	uint32_t head = shardd_load_acquire(&h->cq_head);

	/* Our own copy of the capacity: the client can rewrite hdr->cq_entries. */
	if (tail - head > r->cq_mask + 1)
		return -EBADMSG;
	return (int64_t)r->cq_mask + 1 - (tail - head);
}

static inline long shardd_futex(uint32_t *word, int op, uint32_t val,
				const struct timespec *timeout)
{
	return syscall(SYS_futex, word, op, val, timeout, NULL, 0);
}

/* The CQ slot the daemon's next shardd_cq_push() fills (only the daemon pushes). */
static inline uint32_t shardd_cq_next_slot(const struct shardd_ring *r)
{
	return SHARDD_READ_ONCE(r->hdr->cq_tail) & r->cq_mask;
}

/*
 * Publish one completion; `msg` (may be NULL) is copied into the message
 * slot of the same index, truncated to msg_size - 1 bytes. The caller has
 * checked shardd_cq_space() > 0. Wakes futex waiters when there are any.
 */
static inline void shardd_cq_push(struct shardd_ring *r, const struct shardd_cqe *cqe,
				  const char *msg)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = SHARDD_READ_ONCE(h->cq_tail);
	struct shardd_cqe *slot = &r->cq[tail & r->cq_mask];

	*slot = *cqe;
	slot->has_msg = 0;
	if (msg && *msg) {
		char *text = r->msg + (size_t)(tail & r->cq_mask) * r->msg_size;
		size_t n = strnlen(msg, r->msg_size - 1);

		memcpy(text, msg, n);
		text[n] = '\0';
		slot->has_msg = 1;
	}
	/* Entry and text before the tail: the client reads tail with acquire. */
	shardd_store_release(&h->cq_tail, tail + 1);
	/* Tail store before the waiter count load; pairs with shardd_cq_wait(). */
	shardd_smp_mb();
	if (SHARDD_READ_ONCE(h->cq_waiters))
		shardd_futex(&h->cq_tail, FUTEX_WAKE, INT32_MAX, NULL);
}

/* ---------------- client: consumption of the CQ ---------------- */

/* Completions waiting: >= 0, or -EBADMSG when the daemon's tail is corrupt. */
static inline int64_t shardd_cq_ready(const struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = shardd_load_acquire(&h->cq_tail);
	uint32_t head = SHARDD_READ_ONCE(h->cq_head);

	/* Our own copy of the capacity, as the daemon's header fields are not re-read. */
	if (tail - head > r->cq_mask + 1)
		return -EBADMSG;
	return tail - head;
}

/*
 * Copy the next completion into `out` and its text (if any) into `msg`
 * (`msg_len` bytes, may be 0) and return its slot index; the slot stays the
 * client's until shardd_cq_release(). Call only when shardd_cq_ready() > 0.
 */
static inline uint32_t shardd_cq_peek(const struct shardd_ring *r, struct shardd_cqe *out,
				      char *msg, size_t msg_len)
{
	uint32_t head = SHARDD_READ_ONCE(r->hdr->cq_head);
	uint32_t slot = head & r->cq_mask;

	memcpy(out, &r->cq[slot], sizeof(*out));
	if (msg_len) {
		msg[0] = '\0';
		if (out->has_msg) {
			size_t n = strnlen(r->msg + (size_t)slot * r->msg_size, r->msg_size - 1);

			if (n >= msg_len)
				n = msg_len - 1;
			memcpy(msg, r->msg + (size_t)slot * r->msg_size, n);
			msg[n] = '\0';
		}
	}
	return slot;
}

/*
 * Hand the peeked completion's slot back to the daemon. Whatever the client
 * must do before the daemon may reuse the slot (queue its stream's wait on
 * the slot's fence event) comes first.
 */
static inline void shardd_cq_release(struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t head = SHARDD_READ_ONCE(h->cq_head);

	/* Entry and text copied before the slot goes back to the daemon. */
	shardd_store_release(&h->cq_head, head + 1);
}

/*
 * Block until cq_tail differs from `seen` or `timeout` (relative, NULL =
 * forever) passes. Returns 0 (woken or changed), -ETIMEDOUT or -EINTR.
 * The caller spins first; this is the sleeping half.
 */
static inline int shardd_cq_wait(struct shardd_ring *r, uint32_t seen,
				 const struct timespec *timeout)
{
	struct shardd_ring_hdr *h = r->hdr;
	int ret = 0;

	shardd_fetch_add(h->cq_waiters, 1);
	/* Waiter count before the tail re-check; pairs with shardd_cq_push(). */
	shardd_smp_mb();
	if (shardd_load_acquire(&h->cq_tail) == seen &&
	    shardd_futex(&h->cq_tail, FUTEX_WAIT, seen, timeout) < 0 && errno != EAGAIN)
		ret = -errno;
	shardd_fetch_sub(h->cq_waiters, 1);
	return ret;
}

/* ---------------- either side: the rest of the header ---------------- */

/*
 * The capacities the header states (client: checked against the WELCOME
 * once at attach; the daemon never re-reads them, a client can rewrite them).
 */
static inline void shardd_ring_capacity(const struct shardd_ring *r, uint32_t *sq_entries,
					uint32_t *cq_entries)
{
	*sq_entries = SHARDD_READ_ONCE(r->hdr->sq_entries);
	*cq_entries = SHARDD_READ_ONCE(r->hdr->cq_entries);
}

/* The four indices as they are now: for error messages only, the peer may be moving them. */
static inline void shardd_ring_indices(const struct shardd_ring *r, uint32_t *sq_head,
				       uint32_t *sq_tail, uint32_t *cq_head, uint32_t *cq_tail)
{
	*sq_head = SHARDD_READ_ONCE(r->hdr->sq_head);
	*sq_tail = SHARDD_READ_ONCE(r->hdr->sq_tail);
	*cq_head = SHARDD_READ_ONCE(r->hdr->cq_head);
	*cq_tail = SHARDD_READ_ONCE(r->hdr->cq_tail);
}

/*
 * Client: the CQ tail to sleep on (shardd_cq_wait's `seen`). Read with
 * acquire before the caller's last shardd_cq_ready() re-check, or a push is
 * missed.
 */
static inline uint32_t shardd_cq_tail_seen(const struct shardd_ring *r)
{
	return shardd_load_acquire(&r->hdr->cq_tail);
}

/* SHARDD_RING_* flags (NEED_WAKEUP, DEAD) as they are now. */
static inline uint32_t shardd_ring_flags(const struct shardd_ring *r)
{
	return SHARDD_READ_ONCE(r->hdr->flags);
}

/*
 * Daemon: the client is gone. Set DEAD for a client that looks at the ring
 * rather than the socket, and wake its futex waiters.
 */
static inline void shardd_ring_mark_dead(struct shardd_ring *r)
{
	atomic_fetch_or_explicit(SHARDD_ATOMIC_OF(&r->hdr->flags), SHARDD_RING_DEAD,
				 memory_order_release);
	shardd_futex(&r->hdr->cq_tail, FUTEX_WAKE, INT32_MAX, NULL);
}

/*
 * Daemon: entries wait for CQ room that only the client can free by
 * reaping: set NEED_WAKEUP so that its reap rings the doorbell. The full
 * barrier orders the flag store before the caller's cq_head load; it pairs
 * with the client's reap (cq_head store, full barrier, flag load): one of
 * the two sees the other.
 */
static inline void shardd_ring_arm_wakeup(struct shardd_ring *r)
{
	shardd_fetch_or(r->hdr->flags, SHARDD_RING_NEED_WAKEUP);
	shardd_smp_mb();
}

/*
 * Diagnostics (line 5 is the daemon's, line 6 the client's): who took or
 * submitted what last, and when the daemon's loop last turned. Relaxed:
 * shown by shardctl and the client's status, never trusted or ordered.
 */
static inline void shardd_ring_note_taken(struct shardd_ring *r, uint32_t op, uint64_t step)
{
	SHARDD_WRITE_ONCE(r->hdr->daemon_last_op, op);
	SHARDD_WRITE_ONCE(r->hdr->daemon_last_step, step);
}

static inline void shardd_ring_note_heartbeat(struct shardd_ring *r, uint64_t now_ns)
{
	SHARDD_WRITE_ONCE(r->hdr->daemon_heartbeat_ns, now_ns);
}

static inline void shardd_ring_note_submitted(struct shardd_ring *r, uint32_t op, uint64_t step)
{
	SHARDD_WRITE_ONCE(r->hdr->client_last_op, op);
	SHARDD_WRITE_ONCE(r->hdr->client_last_step, step);
}

static inline void shardd_ring_daemon_last(const struct shardd_ring *r, uint32_t *op,
					   uint64_t *step, uint64_t *heartbeat_ns)
{
	*op = SHARDD_READ_ONCE(r->hdr->daemon_last_op);
	*step = SHARDD_READ_ONCE(r->hdr->daemon_last_step);
	*heartbeat_ns = SHARDD_READ_ONCE(r->hdr->daemon_heartbeat_ns);
}

static inline void shardd_ring_client_last(const struct shardd_ring *r, uint32_t *op,
					   uint64_t *step)
{
	*op = SHARDD_READ_ONCE(r->hdr->client_last_op);
	*step = SHARDD_READ_ONCE(r->hdr->client_last_step);
}

#endif /* SHARDD_RING_H */

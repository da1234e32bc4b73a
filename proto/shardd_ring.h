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
#include <limits.h>
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
	struct shardd_sqe      *sq;
	struct shardd_cqe      *cq;
	char                   *msg;     /* cq_entries slots of msg_size bytes */
	uint32_t                sq_mask;
	uint32_t                cq_mask;
	uint32_t                msg_size;
};

/* The header's counters are plain uint32_t for a fixed layout; access them atomically. */
#define SHARDD_ATOMIC32(p) ((_Atomic uint32_t *)(void *)(p))

static inline int shardd_is_pow2(uint32_t v)
{
	return v && !(v & (v - 1));
}

/* Bytes needed for a region with the given capacities. */
static inline uint64_t shardd_ring_region_size(uint32_t sq_entries, uint32_t cq_entries)
{
	return sizeof(struct shardd_ring_hdr)
		+ (uint64_t)sq_entries * sizeof(struct shardd_sqe)
		+ (uint64_t)cq_entries * sizeof(struct shardd_cqe)
		+ (uint64_t)cq_entries * SHARDD_RING_MSG_SIZE;
}

/*
 * Daemon side: lay out a zeroed region of `size` bytes and publish it.
 * Returns 0 or -EINVAL (capacities not powers of two, or size too small).
 */
static inline int shardd_ring_format(void *region, uint64_t size, uint32_t sq_entries,
				     uint32_t cq_entries, uint32_t daemon_pid,
				     uint32_t client_id)
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
	atomic_store_explicit(SHARDD_ATOMIC32(&h->version),
			      (uint32_t)SHARDD_PROTO_MAJOR << 16 | SHARDD_PROTO_MINOR,
			      memory_order_release);
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
	version = atomic_load_explicit(SHARDD_ATOMIC32(&h->version), memory_order_acquire);
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
	uint32_t tail = atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_tail), memory_order_relaxed);
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_head), memory_order_acquire);

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
static inline void shardd_sq_publish(struct shardd_ring *r, uint32_t slot, const struct shardd_sqe *sqe)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_tail), memory_order_relaxed);

	r->sq[slot] = *sqe;
	/* Publish the entry before the tail: the daemon reads tail with acquire. */
	atomic_store_explicit(SHARDD_ATOMIC32(&h->sq_tail), tail + 1, memory_order_release);
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
	atomic_thread_fence(memory_order_seq_cst);
	return atomic_load_explicit(SHARDD_ATOMIC32(&r->hdr->flags), memory_order_relaxed) &
	       SHARDD_RING_NEED_WAKEUP;
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
	uint32_t tail = atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_tail), memory_order_acquire);
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_head), memory_order_relaxed);

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
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&r->hdr->sq_head), memory_order_relaxed);

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
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&h->sq_head), memory_order_relaxed);

	/* The copy is done before the slot is handed back to the client. */
	atomic_store_explicit(SHARDD_ATOMIC32(&h->sq_head), head + 1, memory_order_release);
}

/*
 * Daemon about to sleep: set NEED_WAKEUP, then re-check the SQ. Returns 1
 * when entries arrived meanwhile (flag cleared again, do not sleep), else 0.
 */
static inline int shardd_ring_prepare_sleep(struct shardd_ring *r)
{
	_Atomic uint32_t *flags = SHARDD_ATOMIC32(&r->hdr->flags);

	atomic_fetch_or_explicit(flags, SHARDD_RING_NEED_WAKEUP, memory_order_relaxed);
	/* Flag store before tail load; pairs with shardd_ring_needs_wakeup(). */
	atomic_thread_fence(memory_order_seq_cst);
	if (shardd_sq_ready(r) != 0) {
		atomic_fetch_and_explicit(flags, ~SHARDD_RING_NEED_WAKEUP, memory_order_relaxed);
		return 1;
	}
	return 0;
}

/* Daemon awake again: clear NEED_WAKEUP so clients stop ringing. */
static inline void shardd_ring_clear_wakeup(struct shardd_ring *r)
{
	atomic_fetch_and_explicit(SHARDD_ATOMIC32(&r->hdr->flags), ~SHARDD_RING_NEED_WAKEUP,
				  memory_order_relaxed);
}

/* ---------------- daemon: production of the CQ ---------------- */

/* Free CQ slots: >= 0, or -EBADMSG when the client's head is corrupt. */
static inline int64_t shardd_cq_space(struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_tail), memory_order_relaxed);
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_head), memory_order_acquire);

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
	return atomic_load_explicit(SHARDD_ATOMIC32(&r->hdr->cq_tail), memory_order_relaxed) &
	       r->cq_mask;
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
	uint32_t tail = atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_tail), memory_order_relaxed);
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
	atomic_store_explicit(SHARDD_ATOMIC32(&h->cq_tail), tail + 1, memory_order_release);
	/* Tail store before the waiter count load; pairs with shardd_cq_wait(). */
	atomic_thread_fence(memory_order_seq_cst);
	if (atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_waiters), memory_order_relaxed))
		shardd_futex(&h->cq_tail, FUTEX_WAKE, INT_MAX, NULL);
}

/* ---------------- client: consumption of the CQ ---------------- */

/* Completions waiting: >= 0, or -EBADMSG when the daemon's tail is corrupt. */
static inline int64_t shardd_cq_ready(const struct shardd_ring *r)
{
	struct shardd_ring_hdr *h = r->hdr;
	uint32_t tail = atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_tail), memory_order_acquire);
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_head), memory_order_relaxed);

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
static inline uint32_t shardd_cq_peek(const struct shardd_ring *r, struct shardd_cqe *out, char *msg,
				      size_t msg_len)
{
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&r->hdr->cq_head), memory_order_relaxed);
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
	uint32_t head = atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_head), memory_order_relaxed);

	/* Entry and text copied before the slot goes back to the daemon. */
	atomic_store_explicit(SHARDD_ATOMIC32(&h->cq_head), head + 1, memory_order_release);
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
	_Atomic uint32_t *waiters = SHARDD_ATOMIC32(&h->cq_waiters);
	int ret = 0;

	atomic_fetch_add_explicit(waiters, 1, memory_order_relaxed);
	/* Waiter count before the tail re-check; pairs with shardd_cq_push(). */
	atomic_thread_fence(memory_order_seq_cst);
	if (atomic_load_explicit(SHARDD_ATOMIC32(&h->cq_tail), memory_order_acquire) == seen &&
	    shardd_futex(&h->cq_tail, FUTEX_WAIT, seen, timeout) < 0 &&
	    errno != EAGAIN)
		ret = -errno;
	atomic_fetch_sub_explicit(waiters, 1, memory_order_relaxed);
	return ret;
}

#endif /* SHARDD_RING_H */

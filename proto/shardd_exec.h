/* SPDX-License-Identifier: MIT */
/*
 * Rank-executed groups (PROTOCOL.md "Rank-executed groups"): the memory the
 * ranks of a job order their collectives through, and its accessors. Both
 * the daemon and the clients use these, so the ordering rules live in one
 * place. libc only.
 *
 * Two regions, each written by one side only:
 *
 * - the group's sync page, written by the daemon, mapped read-only by every
 *   rank: the epoch (bumped when a rank dies: every op of the old epoch
 *   fails), the rank that died, a change counter the ranks sleep on, and
 *   per rank the generation of its published buffers (0: none yet);
 * - each rank's slot, the page after its grad buffer (same memfd, sealed
 *   read-only for its peers): its sequence words `seq` (ready: my inputs
 *   are final) and `done` (I finished reading my peers' buffers), each an
 *   epoch in the high and an op count in the low 32 bits, its op counters,
 *   and `cleared`, which only the daemon writes (the `reduces` count at which
 *   it last zeroed the rank's sharded grad).
 *
 * Every value read from the other side is untrusted: a rank's garbage can
 * make its peers wait until their timeout or fail, nothing more.
 */
#ifndef SHARDD_EXEC_H
#define SHARDD_EXEC_H

#include <stdint.h>

#include "shardd_ring.h"

#define SHARDD_EXEC_MAGIC   0x43455853u /* "SXEC" as little-endian bytes */
#define SHARDD_EXEC_VERSION 2
#define SHARDD_EXEC_PAGE    4096 /* slot size and alignment; sync page granule */
/* gen[r] of a rank that left and has not attached again (0: not published yet) */
#define SHARDD_EXEC_GONE 0xffffffffu

/* The daemon's sync page of a rank-executed group. */
struct shardd_exec_sync {
	/* line 0: fixed at creation */
	uint32_t magic;   /* SHARDD_EXEC_MAGIC */
	uint32_t version; /* SHARDD_EXEC_VERSION */
	uint32_t world;   /* ranks: gen[] has this many entries */
	uint32_t group_id;
	uint8_t pad0[SHARDD_CACHELINE - 16];
	/* line 1: changed when a rank dies or publishes its buffers */
	uint32_t epoch;     /* ops carry it in their sequence words; a new one fails the old ops */
	uint32_t dead_rank; /* rank + 1 of the last rank whose death began the epoch; 0: none */
	uint32_t changes;   /* futex word: bumped, and woken, on every change of this page */
	uint32_t rsvd;
	uint8_t pad1[SHARDD_CACHELINE - 16];
	/* [world] (line 2 on): the generation of each rank's published buffers; 0: not yet;
	   SHARDD_EXEC_GONE: the rank left */
	uint32_t gen[];
};

/* A rank's slot: the SHARDD_EXEC_PAGE bytes after its grad buffer's own. */
struct shardd_exec_slot {
	/* line 0: ready for op (epoch << 32 | n), published after the op and step it is */
	uint64_t seq;
	uint64_t step; /* the op's step, as submitted */
	uint32_t op;   /* enum shardd_op */
	uint32_t rsvd0;
	/* the sequence word that op and step belong to: stored before them (a seqlock:
	   shardd_exec_write_op, shardd_exec_read_op) */
	uint64_t what;
	uint8_t pad0[SHARDD_CACHELINE - 32];
	uint64_t done; /* line 1: finished reading the peers' buffers for op (epoch << 32 | n) */
	uint8_t pad1[SHARDD_CACHELINE - 8];
	/* line 2: what the rank ran, for shardctl and the metrics (free-running counts) */
	uint64_t unshards;
	uint64_t reduces;
	uint64_t reshards;
	/* the op (epoch << 32 | n) this rank gave up waiting for (the collective timeout), and
	   its step: a peer that comes to it later fails it at once, as the daemon's late
	   rendezvous does (a retry, another step at the same number, does not) */
	uint64_t gave_up;
	uint64_t gave_up_step;
	uint8_t pad2[SHARDD_CACHELINE - 40];
	/* line 3: written by the daemon only */
	uint64_t cleared; /* `reduces` when the daemon last zeroed the sharded grad */
	uint8_t pad3[SHARDD_CACHELINE - 8];
	/* line 4: the op the rank waits in, for naming a stuck collective */
	uint32_t wait_op;       /* enum shardd_op; 0: not waiting */
	uint32_t wait_peer;     /* rank + 1 it waits for */
	uint64_t wait_since_ns; /* CLOCK_MONOTONIC */
	uint32_t sleeping;      /* 1 while it sleeps on a peer's word: a publisher wakes it */
	uint8_t pad4[SHARDD_CACHELINE - 20];
};

_Static_assert(sizeof(struct shardd_exec_sync) == 2 * SHARDD_CACHELINE, "exec_sync");
_Static_assert(sizeof(struct shardd_exec_slot) == 5 * SHARDD_CACHELINE, "exec_slot");
_Static_assert(sizeof(struct shardd_exec_slot) <= SHARDD_EXEC_PAGE, "exec_slot fits its page");

/* Bytes of a group's sync page for `world` ranks: whole pages. */
static inline uint64_t shardd_exec_sync_size(uint32_t world)
{
	uint64_t b = sizeof(struct shardd_exec_sync) + (uint64_t)world * sizeof(uint32_t);

	return (b + SHARDD_EXEC_PAGE - 1) / SHARDD_EXEC_PAGE * SHARDD_EXEC_PAGE;
}

/* Where a rank's slot begins in its grad buffer of grad_size bytes. */
static inline uint64_t shardd_exec_slot_offset(uint64_t grad_size)
{
	return (grad_size + SHARDD_EXEC_PAGE - 1) / SHARDD_EXEC_PAGE * SHARDD_EXEC_PAGE;
}

/* Bytes of a rank-executed group's grad buffer: its grads, then its slot. */
static inline uint64_t shardd_exec_grad_map_size(uint64_t grad_size)
{
	return shardd_exec_slot_offset(grad_size) + SHARDD_EXEC_PAGE;
}

/* A sequence word: op `n` of `epoch`. */
static inline uint64_t shardd_exec_word(uint32_t epoch, uint32_t n)
{
	return (uint64_t)epoch << 32 | n;
}

/* The futex word of a sequence word: its low half, which changes with every op. */
static inline uint32_t *shardd_exec_futex(uint64_t *word)
{
	return (uint32_t *)(void *)word;
}

/*
 * 1 when a peer's sequence word `seen` says it reached op `n` of `epoch`:
 * same epoch and an op count at least n (it may run ahead by one op, never
 * more: the next op needs this rank too).
 */
static inline int shardd_exec_reached(uint64_t seen, uint32_t epoch, uint32_t n)
{
	return (uint32_t)(seen >> 32) == epoch && (uint32_t)seen >= n;
}

/*
 * Publish a sequence word of the caller's own slot: release-store it, then
 * wake the peers that sleep on it (their slots say so: `sleeping`).
 * `peers` are the other ranks' slots (NULL entries: not mapped; skipped).
 */
static inline void shardd_exec_publish(uint64_t *word, uint64_t value,
				       struct shardd_exec_slot *const *peers, uint32_t npeers)
{
	atomic_store_explicit(SHARDD_ATOMIC_OF(word), value, memory_order_seq_cst);
	for (uint32_t i = 0; i < npeers; i++) {
		if (peers[i] && atomic_load_explicit(SHARDD_ATOMIC_OF(&peers[i]->sleeping),
						     memory_order_seq_cst)) {
			shardd_futex(shardd_exec_futex(word), FUTEX_WAKE, INT32_MAX, NULL);
			return;
		}
	}
}

/*
 * Writer: the op and step of this rank's op `word` (published with seq
 * after, or put back by a retraction). `what` is stored first, behind a
 * release fence, so that a reader that finds it unchanged around its
 * reads of op and step read those of op `word`, not halves of a later
 * op's being written (shardd_exec_read_op).
 */
static inline void shardd_exec_write_op(struct shardd_exec_slot *s, uint64_t word, uint32_t op,
					uint64_t step)
{
	SHARDD_WRITE_ONCE(s->what, word);
	atomic_thread_fence(memory_order_release);
	SHARDD_WRITE_ONCE(s->op, op);
	SHARDD_WRITE_ONCE(s->step, step);
}

/*
 * Reader: 1 with *op and *step when slot `s` holds those of op `word`,
 * read whole; 0 when it holds another op's or is being rewritten for one
 * (its rank has moved past `word`).
 */
static inline int shardd_exec_read_op(const struct shardd_exec_slot *s, uint64_t word, uint32_t *op,
				      uint64_t *step)
{
	uint64_t before = atomic_load_explicit(SHARDD_ATOMIC_OF(&s->what), memory_order_acquire);

	*op = SHARDD_READ_ONCE(s->op);
	*step = SHARDD_READ_ONCE(s->step);
	atomic_thread_fence(memory_order_acquire);
	return before == word && SHARDD_READ_ONCE(s->what) == word;
}

/*
 * Sleep until `*word` (a peer's sequence word) may have changed from
 * `seen`, the sync page's `changes` moved, or `timeout` passed: marks the
 * caller's own slot `sleeping` first, so that a publisher that stores after
 * the mark sees it and wakes the futex. Spurious returns are fine: the
 * caller re-reads everything. The daemon wakes every sequence word of a
 * group when its epoch changes.
 */
static inline void shardd_exec_sleep(struct shardd_exec_slot *mine, uint64_t *word, uint64_t seen,
				     const struct timespec *timeout)
{
	atomic_store_explicit(SHARDD_ATOMIC_OF(&mine->sleeping), 1u, memory_order_seq_cst);
	if (atomic_load_explicit(SHARDD_ATOMIC_OF(word), memory_order_seq_cst) == seen)
		shardd_futex(shardd_exec_futex(word), FUTEX_WAIT, (uint32_t)seen, timeout);
	atomic_store_explicit(SHARDD_ATOMIC_OF(&mine->sleeping), 0u, memory_order_relaxed);
}

/* The sync page's epoch and the rank that died last (rank + 1, 0: none). */
static inline uint32_t shardd_exec_epoch(const struct shardd_exec_sync *s)
{
	return shardd_load_acquire(&s->epoch);
}

static inline uint32_t shardd_exec_dead_rank(const struct shardd_exec_sync *s)
{
	return SHARDD_READ_ONCE(s->dead_rank);
}

static inline uint32_t shardd_exec_gen(const struct shardd_exec_sync *s, uint32_t rank)
{
	return shardd_load_acquire(&s->gen[rank]);
}

/* Daemon: a change of the page is visible; wake the ranks that sleep on it. */
static inline void shardd_exec_changed(struct shardd_exec_sync *s)
{
	atomic_fetch_add_explicit(SHARDD_ATOMIC_OF(&s->changes), 1u, memory_order_seq_cst);
	shardd_futex(&s->changes, FUTEX_WAKE, INT32_MAX, NULL);
}

#endif /* SHARDD_EXEC_H */

/* SPDX-License-Identifier: MIT */
/*
 * Rendezvous: "these ranks must all arrive with the same key" (step, flags).
 * Plain data, no threads, no callbacks: the owner (job barrier, engine
 * collectives) calls arrive/expired and acts on the result. Used from the
 * loop thread only.
 *
 * A rendezvous also remembers its last expiry (shd_rdv_expire): the key the
 * waiting ranks gave up on and the ranks that never came. A rank that was
 * only paused (SIGSTOP, a debugger) past the timeout arrives with that key
 * once it runs again; it is told at once (SHD_RDV_LATE) that the others gave
 * up, rather than starting a wait that no one joins, so it can follow them
 * into their retry. The record is one per rendezvous, replaced by the next
 * expiry, and a rank's mark goes with its next arrival, whatever its key.
 */
#ifndef SHD_RENDEZVOUS_H
#define SHD_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

/* Deadlines are on the daemon's clock: callers pass shd_now_ns(). */
#include "clock.h"

struct shd_rdv {
	uint32_t nexpected; /* ranks expected */
	uint32_t *ranks;    /* expected ranks, ascending (owned) */
	uint8_t *arrived;   /* per expected index: 1 if arrived */
	uint32_t narrived;
	uint64_t step;        /* key of the first arrival */
	uint32_t flags;       /* flags of the first arrival */
	uint32_t first_rank;  /* who set the key */
	uint64_t deadline_ns; /* first arrival + timeout (CLOCK_MONOTONIC) */
	int active;           /* at least one arrival */
	/*
	 * added to every rank its messages name: a job across nodes shows global ranks (its node's
	 * first rank; 0 on one node)
	 */
	uint32_t shown_base;
	/* The last expiry (shd_rdv_expire). */
	uint8_t *gave_up;      /* per expected index: SHD_RDV_GAVE_UP_* */
	uint64_t gave_up_step; /* its key */
	uint32_t gave_up_flags;
	uint64_t gave_up_ns; /* when it expired (CLOCK_MONOTONIC) */
};

/* A rank's part in the last expiry (shd_rdv.gave_up). */
enum {
	SHD_RDV_GAVE_UP_NONE = 0,   /* not there, or arrived again since */
	SHD_RDV_GAVE_UP_WAITED = 1, /* waited and gave up */
	SHD_RDV_GAVE_UP_LATE = 2,   /* never came, and has not arrived since */
};

enum {
	SHD_RDV_WAIT = 0,     /* arrival recorded, others still missing */
	SHD_RDV_COMPLETE = 1, /* every expected rank arrived with the key */
	SHD_RDV_MISMATCH = 2, /* key differs from the first arrival's */
	SHD_RDV_LATE = 3,     /* the rank comes with the key the last expiry gave up on it for */
};

/*
 * Expect `n` ranks (copied, sorted ascending, must be distinct).
 * Returns 0, -EINVAL (n == 0 or duplicates) or -ENOMEM.
 */
int shd_rdv_init(struct shd_rdv *r, const uint32_t *ranks, uint32_t n);
void shd_rdv_free(struct shd_rdv *r);
/* Forget arrivals, keep the expected set. */
void shd_rdv_reset(struct shd_rdv *r);

/*
 * Arrival of `rank` with key (step, flags) at `now_ns`; the first arrival
 * sets the key and the deadline now_ns + timeout_ns. Returns SHD_RDV_WAIT,
 * SHD_RDV_COMPLETE, SHD_RDV_MISMATCH (arrival not recorded; `err` names
 * both ranks and keys), SHD_RDV_LATE (arrival not recorded: the last expiry
 * gave up on `rank` with this key, and the others have not come back with
 * it; the owner fails the op at once, shd_rdv_late_msg) or -EINVAL (rank
 * not expected, or arrived twice; `err` says which). The owner resets the
 * rendezvous after COMPLETE or MISMATCH.
 */
int shd_rdv_arrive(struct shd_rdv *r, uint32_t rank, uint64_t step, uint32_t flags, uint64_t now_ns,
		   uint64_t timeout_ns, char *err, size_t errlen);
/*
 * Forget the arrival of `rank` (its client is gone), so that present/missing
 * lists no longer count it. Returns 1 when it had arrived, else 0.
 */
int shd_rdv_leave(struct shd_rdv *r, uint32_t rank);
/* 1 when active and past its deadline, else 0. */
int shd_rdv_expired(const struct shd_rdv *r, uint64_t now_ns);
/*
 * The owner gives up on an expired rendezvous at `now_ns`: remember its key
 * and who waited and who never came (replacing the last record), before it
 * fails the waiting ranks and resets it.
 */
void shd_rdv_expire(struct shd_rdv *r, uint64_t now_ns);
/* 1 when `rank` is expected and has arrived, else 0. */
int shd_rdv_has_arrived(const struct shd_rdv *r, uint32_t rank);
/* 1 when `rank` is in the expected set, else 0. */
int shd_rdv_expects(const struct shd_rdv *r, uint32_t rank);

/* "3,5": ranks not yet arrived / arrived, comma separated; "" when none. */
void shd_rdv_missing(const struct shd_rdv *r, char *buf, size_t len);
void shd_rdv_present(const struct shd_rdv *r, char *buf, size_t len);
/*
 * "0,2,5": the ranks a mismatch fails, every arrived rank and the newcomer
 * `rank`, ascending, comma separated (cut short where `len` ends).
 */
void shd_rdv_failing(const struct shd_rdv *r, uint32_t rank, char *buf, size_t len);
/* "rank 3" or "ranks 3,5": the same lists as the subject of a sentence. */
void shd_rdv_who_missing(const struct shd_rdv *r, char *buf, size_t len);
void shd_rdv_who_present(const struct shd_rdv *r, char *buf, size_t len);
/* The arrived ranks but `rank` (one that left): "ranks 0,1", "rank 0" or "no rank". */
void shd_rdv_who_present_but(const struct shd_rdv *r, uint32_t rank, char *buf, size_t len);
/*
 * The one description of the ranks a rendezvous still misses, for the
 * error of one that expired: "ranks 2,3 <did> within <within>; rank 0 is
 * waiting". `did` is what the missing ranks failed to do ("never
 * submitted reduce(group 'g', step 5)", "did not arrive"), `within` the
 * timeout as its owner words it ("30 s"). Each list takes at most a third
 * of `len` (ending in "..." when cut), so the sentence keeps its end.
 */
void shd_rdv_missing_msg(const struct shd_rdv *r, const char *did, const char *within, char *buf,
			 size_t len);
/*
 * The error of `rank`'s arrival that returned SHD_RDV_LATE, at `now_ns`:
 * "rank 2 <did> 0.84 s after rank 0 gave up waiting for it (the collective
 * timeout, <within>); failed at once: retry with the others". `did` is what
 * the rank did late ("submitted unshard(group 'g', step 5)").
 */
void shd_rdv_late_msg(const struct shd_rdv *r, uint32_t rank, const char *did, const char *within,
		      uint64_t now_ns, char *buf, size_t len);

#endif /* SHD_RENDEZVOUS_H */

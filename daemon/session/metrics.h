/* SPDX-License-Identifier: MIT */
/*
 * Op metrics for shardctl: per op, how many were completed (and failed), how
 * many bytes they moved, and how long each took from the moment the daemon
 * took its SQ entry to the moment its completion was pushed.
 *
 * Latency goes into a fixed histogram of log2 buckets: bucket i counts
 * latencies in [2^i, 2^(i+1)) ns, the last bucket everything above. A quantile is reported as the upper edge of the bucket
 * holding it, clamped to the largest latency seen, so p50/p99 are exact to
 * within a factor of two and cost nothing on the hot path.
 *
 * Everything here is touched by the loop thread only.
 */
#ifndef SHD_METRICS_H
#define SHD_METRICS_H

#include <stdint.h>

#include "shardd_proto.h"

#define SHD_LAT_BUCKETS 40 /* 2^39 ns = 9 minutes: past any collective timeout we allow */

struct shd_op_metrics {
	uint64_t count;  /* completions pushed */
	uint64_t failed; /* of those, with res < 0 */
	uint64_t bytes;  /* bytes moved by the successful ones */
	uint64_t lat_sum_ns;
	uint64_t lat_max_ns;
	uint64_t lat_buckets[SHD_LAT_BUCKETS];
};

/* Indexed by enum shardd_op; entry 0 is unused. */
extern struct shd_op_metrics shd_op_metrics[SHARDD_OP_COUNT];

/* One taken SQ entry whose completion is not pushed yet. */
struct shd_op_timing {
	uint64_t user_data;
	uint64_t step;
	uint64_t taken_ns;
	uint64_t seq; /* take order within the session, from 1 */
	uint32_t op;
	uint32_t group;
};

/* One op of a session's progress (shardctl ranks); op 0 = none yet. */
struct shd_op_progress {
	uint32_t op;
	uint64_t step;
};

/*
 * The take times of a session's in-flight entries. At most `cap` entries
 * are in flight (the session never takes more than its CQ has room for),
 * so the array never grows after init.
 */
struct shd_op_clock {
	struct shd_op_timing *v;
	uint32_t n, cap;
	uint64_t taken;              /* entries taken: the last one's seq */
	uint64_t done_seq;           /* seq of `done` */
	struct shd_op_progress done; /* the latest-taken entry whose completion is pushed */
	int has_step;                /* some step-carrying entry was taken */
	uint64_t step;               /* the furthest step of those */
};

/* 0 or -ENOMEM. */
int shd_op_clock_init(struct shd_op_clock *c, uint32_t cap);
void shd_op_clock_free(struct shd_op_clock *c);
/* The entry was taken at now_ns. */
void shd_op_clock_start(struct shd_op_clock *c, const struct shardd_sqe *sqe, uint64_t now_ns);
/*
 * The entry's completion is being pushed: forget it and return how long it
 * was in flight, or 0 when it was never started (then it is not timed).
 */
uint64_t shd_op_clock_stop(struct shd_op_clock *c, const struct shardd_sqe *sqe, uint64_t now_ns);

struct shd_job;
/*
 * Bytes op `sqe` of job `j` moves: unshard the gathered unsharded buffer,
 * reduce the rank's unsharded grads; 0 for every other op.
 */
uint64_t shd_metrics_op_bytes(const struct shd_job *j, const struct shardd_sqe *sqe);

/* Count one pushed completion of `op` (ignored when op is out of range). */
void shd_metrics_op_done(uint32_t op, int res, uint64_t bytes, uint64_t latency_ns);

/* Latency of quantile q (0..1) of `m` in ns, as described above; 0 when empty. */
uint64_t shd_metrics_quantile(const struct shd_op_metrics *m, double q);

/* Upper edge of bucket i in ns (2^(i+1)); UINT64_MAX for the last bucket. */
uint64_t shd_metrics_bucket_le_ns(unsigned i);

#endif /* SHD_METRICS_H */

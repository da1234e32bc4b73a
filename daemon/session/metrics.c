/* SPDX-License-Identifier: MIT */
/*
 * Op metrics (metrics.h): the counters the hot path keeps. Their
 * Prometheus exposition is a view (admin_views.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "group.h"
#include "job.h"
#include "metrics.h"
#include "op_table.h"

struct shd_op_metrics shd_op_metrics[SHARDD_OP_COUNT];

/* ------------------------------------------------------------------ */
/* In-flight clocks                                                    */
/* ------------------------------------------------------------------ */

int shd_op_clock_init(struct shd_op_clock *c, uint32_t cap)
{
	memset(c, 0, sizeof(*c));
	c->v = calloc(cap ? cap : 1, sizeof(*c->v));
	c->cap = cap;
	return c->v ? 0 : -ENOMEM;
}

void shd_op_clock_free(struct shd_op_clock *c)
{
	free(c->v);
	memset(c, 0, sizeof(*c));
}

void shd_op_clock_start(struct shd_op_clock *c, const struct shardd_sqe *sqe, uint64_t now_ns)
{
	c->taken++;
	if (shd_op_carries_step(sqe->op) && (!c->has_step || sqe->step > c->step)) {
		c->has_step = 1;
		c->step = sqe->step;
	}
	if (c->n >= c->cap)
		return;
	c->v[c->n++] = (struct shd_op_timing){
		.user_data = sqe->user_data,
		.step = sqe->step,
		.taken_ns = now_ns,
		.seq = c->taken,
		.op = sqe->op,
		.group = sqe->group,
	};
}

uint64_t shd_op_clock_stop(struct shd_op_clock *c, const struct shardd_sqe *sqe, uint64_t now_ns)
{
	/*
	 * Completions of one session come out of order across groups, and a
	 * client may reuse user_data, so match the whole key; among equal keys
	 * the oldest is the one completing (ops of one group run in order).
	 * In-flight entries are few (a client waits on its collectives), so a
	 * scan is cheaper than any index.
	 */
	uint32_t best = c->n;

	for (uint32_t i = 0; i < c->n; i++) {
		const struct shd_op_timing *t = &c->v[i];

		if (t->user_data == sqe->user_data && t->step == sqe->step && t->op == sqe->op &&
		    t->group == sqe->group && (best == c->n || t->seq < c->v[best].seq))
			best = i;
	}
	if (best == c->n)
		return 0;
	{
		uint64_t taken = c->v[best].taken_ns;

		/* Completions come out of take order: keep the latest-taken, so with
		 * nothing in flight it is the last entry taken. */
		if (c->v[best].seq > c->done_seq) {
			c->done_seq = c->v[best].seq;
			c->done = (struct shd_op_progress){ .op = c->v[best].op,
							    .step = c->v[best].step };
		}
		c->v[best] = c->v[--c->n];
		return now_ns > taken ? now_ns - taken : 1;
	}
}

/* ------------------------------------------------------------------ */
/* Counters and the histogram                                          */
/* ------------------------------------------------------------------ */

void shd_metrics_op_done(uint32_t op, int res, uint64_t bytes, uint64_t latency_ns)
{
	struct shd_op_metrics *m;
	unsigned b;

	if (op == 0 || op >= SHARDD_OP_COUNT)
		return;
	m = &shd_op_metrics[op];
	m->count++;
	if (res < 0)
		m->failed++;
	else
		m->bytes += bytes;
	if (latency_ns == 0)
		return;
	b = 63u - (unsigned)__builtin_clzll(latency_ns);
	if (b >= SHD_LAT_BUCKETS)
		b = SHD_LAT_BUCKETS - 1;
	m->lat_buckets[b]++;
	m->lat_sum_ns += latency_ns;
	if (latency_ns > m->lat_max_ns)
		m->lat_max_ns = latency_ns;
}

uint64_t shd_metrics_op_bytes(const struct shd_job *j, const struct shardd_sqe *sqe)
{
	const struct shd_group *g;

	if (!j || (sqe->op != SHARDD_OP_UNSHARD && sqe->op != SHARDD_OP_REDUCE))
		return 0;
	g = shd_engine_job_group(j->ejob, sqe->group);
	if (!g)
		return 0;
	return sqe->op == SHARDD_OP_UNSHARD ? g->layout.unsharded_size : g->layout.grad_size;
}

uint64_t shd_metrics_bucket_le_ns(unsigned i)
{
	return i + 1 >= SHD_LAT_BUCKETS ? UINT64_MAX : 1ull << (i + 1);
}

uint64_t shd_metrics_quantile(const struct shd_op_metrics *m, double q)
{
	uint64_t total = 0, seen = 0, rank;

	for (unsigned i = 0; i < SHD_LAT_BUCKETS; i++)
		total += m->lat_buckets[i];
	if (total == 0)
		return 0;
	/* The smallest latency with at least q of the samples at or below it. */
	rank = (uint64_t)(q * (double)total + 0.999999);
	if (rank == 0)
		rank = 1;
	for (unsigned i = 0; i < SHD_LAT_BUCKETS; i++) {
		seen += m->lat_buckets[i];
		if (seen >= rank) {
			uint64_t le = shd_metrics_bucket_le_ns(i);

			return le < m->lat_max_ns ? le : m->lat_max_ns;
		}
	}
	return m->lat_max_ns;
}

/* SPDX-License-Identifier: MIT */
/*
 * Op metrics (metrics.h) and their Prometheus text exposition
 * (https://prometheus.io/docs/instrumenting/exposition_formats/).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admin.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "metrics.h"
#include "server.h"
#include "session.h"

struct shardd_op_metrics shardd_op_metrics[SHARDD_OP_COUNT];

/* ------------------------------------------------------------------ */
/* In-flight clocks                                                    */
/* ------------------------------------------------------------------ */

int shardd_op_clock_init(struct shardd_op_clock *c, uint32_t cap)
{
	memset(c, 0, sizeof(*c));
	c->v = calloc(cap ? cap : 1, sizeof(*c->v));
	c->cap = cap;
	return c->v ? 0 : -ENOMEM;
}

void shardd_op_clock_free(struct shardd_op_clock *c)
{
	free(c->v);
	memset(c, 0, sizeof(*c));
}

void shardd_op_clock_start(struct shardd_op_clock *c, const struct shardd_sqe *sqe,
			   uint64_t now_ns)
{
	c->taken++;
	if (shardd_op_carries_step(sqe->op) && (!c->has_step || sqe->step > c->step)) {
		c->has_step = 1;
		c->step = sqe->step;
	}
	if (c->n >= c->cap)
		return;
	c->v[c->n++] = (struct shardd_op_timing){
		.user_data = sqe->user_data, .step = sqe->step, .taken_ns = now_ns,
		.seq = c->taken, .op = sqe->op, .group = sqe->group,
	};
}

uint64_t shardd_op_clock_stop(struct shardd_op_clock *c, const struct shardd_sqe *sqe,
			      uint64_t now_ns)
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
		const struct shardd_op_timing *t = &c->v[i];

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
			c->done = (struct shardd_op_progress){ .op = c->v[best].op,
							       .step = c->v[best].step };
		}
		c->v[best] = c->v[--c->n];
		return now_ns > taken ? now_ns - taken : 1;
	}
}

/* ------------------------------------------------------------------ */
/* Counters and the histogram                                          */
/* ------------------------------------------------------------------ */

void shardd_metrics_op_done(uint32_t op, int res, uint64_t bytes, uint64_t latency_ns)
{
	struct shardd_op_metrics *m;
	unsigned b;

	if (op == 0 || op >= SHARDD_OP_COUNT)
		return;
	m = &shardd_op_metrics[op];
	m->count++;
	if (res < 0)
		m->failed++;
	else
		m->bytes += bytes;
	if (latency_ns == 0)
		return;
	b = 63u - (unsigned)__builtin_clzll(latency_ns);
	if (b >= SHARDD_LAT_BUCKETS)
		b = SHARDD_LAT_BUCKETS - 1;
	m->lat_buckets[b]++;
	m->lat_sum_ns += latency_ns;
	if (latency_ns > m->lat_max_ns)
		m->lat_max_ns = latency_ns;
}

uint64_t shardd_metrics_op_bytes(const struct shardd_job *j, const struct shardd_sqe *sqe)
{
	const struct shardd_group *g;

	if (!j || (sqe->op != SHARDD_OP_UNSHARD && sqe->op != SHARDD_OP_REDUCE))
		return 0;
	g = shardd_engine_job_group(j->ejob, sqe->group);
	if (!g)
		return 0;
	return sqe->op == SHARDD_OP_UNSHARD ? g->layout.unsharded_size : g->layout.grad_size;
}

uint64_t shardd_metrics_bucket_le_ns(unsigned i)
{
	return i + 1 >= SHARDD_LAT_BUCKETS ? UINT64_MAX : 1ull << (i + 1);
}

uint64_t shardd_metrics_quantile(const struct shardd_op_metrics *m, double q)
{
	uint64_t total = 0, seen = 0, rank;

	for (unsigned i = 0; i < SHARDD_LAT_BUCKETS; i++)
		total += m->lat_buckets[i];
	if (total == 0)
		return 0;
	/* The smallest latency with at least q of the samples at or below it. */
	rank = (uint64_t)(q * (double)total + 0.999999);
	if (rank == 0)
		rank = 1;
	for (unsigned i = 0; i < SHARDD_LAT_BUCKETS; i++) {
		seen += m->lat_buckets[i];
		if (seen >= rank) {
			uint64_t le = shardd_metrics_bucket_le_ns(i);

			return le < m->lat_max_ns ? le : m->lat_max_ns;
		}
	}
	return m->lat_max_ns;
}

/* ------------------------------------------------------------------ */
/* Prometheus text                                                     */
/* ------------------------------------------------------------------ */

struct text {
	char *buf;
	size_t len, cap;
	int oom;
};

static void __attribute__((format(printf, 2, 3))) emit(struct text *t, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (t->oom)
		return;
	for (;;) {
		va_start(ap, fmt);
		n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
		va_end(ap);
		if (n < 0) {
			t->oom = 1;
			return;
		}
		if ((size_t)n < t->cap - t->len) {
			t->len += (size_t)n;
			return;
		}
		{
			size_t cap = (t->cap + (size_t)n + 1) * 2;
			char *b = realloc(t->buf, cap);

			if (!b) {
				t->oom = 1;
				return;
			}
			t->buf = b;
			t->cap = cap;
		}
	}
}

static void header(struct text *t, const char *name, const char *type, const char *help)
{
	emit(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A job name inside a label value: backslash, quote and newline escaped. */
static void label_escape(const char *in, char *out, size_t len)
{
	size_t o = 0;

	for (; *in && o + 3 < len; in++) {
		if (*in == '\\' || *in == '"') {
			out[o++] = '\\';
			out[o++] = *in;
		} else if (*in == '\n') {
			out[o++] = '\\';
			out[o++] = 'n';
		} else {
			out[o++] = *in;
		}
	}
	out[o] = 0;
}

static void render_ops(struct text *t)
{
	header(t, "shardd_ops_total", "counter", "Ops completed, by op (failed ones included).");
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++)
		emit(t, "shardd_ops_total{op=\"%s\"} %llu\n", shardd_op_name(op),
		     (unsigned long long)shardd_op_metrics[op].count);
	header(t, "shardd_ops_failed_total", "counter", "Ops completed with an error, by op.");
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++)
		emit(t, "shardd_ops_failed_total{op=\"%s\"} %llu\n", shardd_op_name(op),
		     (unsigned long long)shardd_op_metrics[op].failed);
	header(t, "shardd_op_bytes_total", "counter",
	       "Bytes moved by successful ops: unshard the gathered unsharded bytes, reduce the "
	       "rank's grad bytes.");
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++)
		emit(t, "shardd_op_bytes_total{op=\"%s\"} %llu\n", shardd_op_name(op),
		     (unsigned long long)shardd_op_metrics[op].bytes);
	header(t, "shardd_op_latency_seconds", "histogram",
	       "Time from the daemon taking an op's SQ entry to pushing its completion "
	       "(log2 buckets).");
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++) {
		const struct shardd_op_metrics *m = &shardd_op_metrics[op];
		uint64_t cum = 0, timed = 0;
		unsigned top = 0;

		for (unsigned i = 0; i < SHARDD_LAT_BUCKETS; i++) {
			timed += m->lat_buckets[i];
			if (m->lat_buckets[i])
				top = i;
		}
		/* Buckets up to the highest one used; +Inf carries the rest. */
		for (unsigned i = 0; timed && i <= top && i + 1 < SHARDD_LAT_BUCKETS; i++) {
			cum += m->lat_buckets[i];
			emit(t, "shardd_op_latency_seconds_bucket{op=\"%s\",le=\"%.9g\"} %llu\n",
			     shardd_op_name(op), (double)shardd_metrics_bucket_le_ns(i) / 1e9,
			     (unsigned long long)cum);
		}
		emit(t, "shardd_op_latency_seconds_bucket{op=\"%s\",le=\"+Inf\"} %llu\n",
		     shardd_op_name(op), (unsigned long long)timed);
		emit(t, "shardd_op_latency_seconds_sum{op=\"%s\"} %.9g\n", shardd_op_name(op),
		     (double)m->lat_sum_ns / 1e9);
		emit(t, "shardd_op_latency_seconds_count{op=\"%s\"} %llu\n", shardd_op_name(op),
		     (unsigned long long)timed);
	}
}

static void render_state(struct text *t)
{
	struct shardd_memory_use m;
	uint32_t njobs = 0, nsessions = 0;

	shardd_memory_use_all(&m);
	header(t, "shardd_memory_bytes", "gauge", "Bytes of group buffers held, by kind.");
	emit(t, "shardd_memory_bytes{kind=\"shards\"} %llu\n", (unsigned long long)m.shards);
	emit(t, "shardd_memory_bytes{kind=\"sharded_grads\"} %llu\n",
	     (unsigned long long)m.sharded_grads);
	emit(t, "shardd_memory_bytes{kind=\"unsharded\"} %llu\n", (unsigned long long)m.unsharded);
	emit(t, "shardd_memory_bytes{kind=\"grads\"} %llu\n", (unsigned long long)m.grads);
	emit(t, "shardd_memory_bytes{kind=\"partials\"} %llu\n", (unsigned long long)m.partials);
	for (struct shardd_job *j = server.jobs; j; j = j->next)
		njobs++;
	for (struct shardd_session *s = server.sessions; s; s = s->next)
		nsessions += s->state != SHARDD_SESSION_DEAD;
	header(t, "shardd_jobs", "gauge", "Jobs the daemon holds.");
	emit(t, "shardd_jobs %u\n", njobs);
	header(t, "shardd_connections", "gauge", "Open control connections (ranks and admin).");
	emit(t, "shardd_connections %u\n", nsessions);
	header(t, "shardd_ranks_attached", "gauge", "Ranks with a live client, by job.");
	for (struct shardd_job *j = server.jobs; j; j = j->next) {
		char name[2 * SHARDD_NAME_MAX + 1];

		label_escape(j->name, name, sizeof(name));
		emit(t, "shardd_ranks_attached{job=\"%s\"} %u\n", name, j->nattached);
	}
	header(t, "shardd_ranks", "gauge", "Ranks of the job's mesh, by job.");
	for (struct shardd_job *j = server.jobs; j; j = j->next) {
		char name[2 * SHARDD_NAME_MAX + 1];

		label_escape(j->name, name, sizeof(name));
		emit(t, "shardd_ranks{job=\"%s\"} %u\n", name, j->world);
	}
}

char *shardd_metrics_render(void)
{
	struct text t = { .cap = 16384 };

	t.buf = malloc(t.cap);
	if (!t.buf)
		return NULL;
	render_ops(&t);
	render_state(&t);
	if (t.oom) {
		free(t.buf);
		return NULL;
	}
	return t.buf;
}

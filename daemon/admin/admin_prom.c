/* SPDX-License-Identifier: MIT */
/*
 * The loop's state as the Prometheus text exposition (admin.h:
 * shd_admin_metrics_render,
 * https://prometheus.io/docs/instrumenting/exposition_formats/), served by
 * `shardctl metrics` (admin_views.c) and the HTTP listener (metrics_http.c).
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "admin.h"
#include "admin_int.h"
#include "backend.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "metrics.h"
#include "state.h"

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
		     (unsigned long long)shd_op_metrics[op].count);
	header(t, "shardd_ops_failed_total", "counter", "Ops completed with an error, by op.");
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++)
		emit(t, "shardd_ops_failed_total{op=\"%s\"} %llu\n", shardd_op_name(op),
		     (unsigned long long)shd_op_metrics[op].failed);
	header(t, "shardd_op_bytes_total", "counter",
	       "Bytes moved by successful ops: unshard the gathered unsharded bytes, reduce the "
	       "rank's grad bytes.");
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++)
		emit(t, "shardd_op_bytes_total{op=\"%s\"} %llu\n", shardd_op_name(op),
		     (unsigned long long)shd_op_metrics[op].bytes);
	header(t, "shardd_op_latency_seconds", "histogram",
	       "Time from the daemon taking an op's SQ entry to pushing its completion "
	       "(log2 buckets).");
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++) {
		const struct shd_op_metrics *m = &shd_op_metrics[op];
		uint64_t cum = 0, timed = 0;
		unsigned top = 0;

		for (unsigned i = 0; i < SHD_LAT_BUCKETS; i++) {
			timed += m->lat_buckets[i];
			if (m->lat_buckets[i])
				top = i;
		}
		/* Buckets up to the highest one used; +Inf carries the rest. */
		for (unsigned i = 0; timed && i <= top && i + 1 < SHD_LAT_BUCKETS; i++) {
			cum += m->lat_buckets[i];
			emit(t, "shardd_op_latency_seconds_bucket{op=\"%s\",le=\"%.9g\"} %llu\n",
			     shardd_op_name(op), (double)shd_metrics_bucket_le_ns(i) / 1e9,
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
	struct shd_group_memory m;
	uint32_t njobs = 0;

	shd_jobs_memory_held(&m);
	header(t, "shardd_memory_bytes", "gauge", "Bytes of group buffers held, by kind.");
	emit(t, "shardd_memory_bytes{kind=\"shards\"} %llu\n", (unsigned long long)m.shards);
	emit(t, "shardd_memory_bytes{kind=\"sharded_grads\"} %llu\n",
	     (unsigned long long)m.sharded_grads);
	emit(t, "shardd_memory_bytes{kind=\"unsharded\"} %llu\n", (unsigned long long)m.unsharded);
	emit(t, "shardd_memory_bytes{kind=\"grads\"} %llu\n", (unsigned long long)m.grads);
	emit(t, "shardd_memory_bytes{kind=\"partials\"} %llu\n", (unsigned long long)m.partials);
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next)
		njobs++;
	header(t, "shardd_jobs", "gauge", "Jobs the daemon holds.");
	emit(t, "shardd_jobs %u\n", njobs);
	header(t, "shardd_connections", "gauge", "Open control connections (ranks and admin).");
	emit(t, "shardd_connections %u\n", shd_state_connections());
	header(t, "shardd_ranks_attached", "gauge", "Ranks with a live client, by job.");
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		char name[2 * SHARDD_NAME_MAX + 1];

		label_escape(j->name, name, sizeof(name));
		emit(t, "shardd_ranks_attached{job=\"%s\"} %u\n", name, j->nattached);
	}
	header(t, "shardd_rank_executed_ops_total", "counter",
	       "Unshards, reduces and reshards the ranks of the job's rank-executed groups ran "
	       "themselves (their slots' counts), by job and op; ops through the daemon are in "
	       "shardd_ops_total.");
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		static const uint32_t ops[3] = { SHARDD_OP_UNSHARD, SHARDD_OP_REDUCE,
						 SHARDD_OP_RESHARD };
		char name[2 * SHARDD_NAME_MAX + 1];
		uint64_t c[3];

		label_escape(j->name, name, sizeof(name));
		admin_exec_counts(j, c);
		for (int k = 0; k < 3; k++)
			emit(t, "shardd_rank_executed_ops_total{job=\"%s\",op=\"%s\"} %llu\n", name,
			     shardd_op_name(ops[k]), (unsigned long long)c[k]);
	}
	header(t, "shardd_ranks", "gauge", "Ranks of the job's mesh, by job.");
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		char name[2 * SHARDD_NAME_MAX + 1];

		label_escape(j->name, name, sizeof(name));
		emit(t, "shardd_ranks{job=\"%s\"} %u\n", name, j->world);
	}
}

/* A GPU backend's sharing of the GPUs with the trainers (docs/CUDA.md, "MPS"); nothing for host. */
static void render_gpu(struct text *t)
{
	const struct shd_backend_ctx *b = shd_engine_backend(shd_state_engine());

	if (!b->gpu_sharing)
		return;
	header(t, "shardd_cuda_mps", "gauge",
	       "1 when the daemon's CUDA contexts are MPS clients (ops run beside the trainers' compute), "
	       "0 when time-sliced (ops wait for it).");
	emit(t, "shardd_cuda_mps %d\n", b->gpu_mps);
	header(t, "shardd_cuda_mps_sm_percent", "gauge",
	       "Under MPS, the percentage of SMs the daemon's kernels may use (100: uncapped).");
	emit(t, "shardd_cuda_mps_sm_percent %d\n", b->gpu_sm_percent);
}

static void render_checkpoints(struct text *t)
{
	static const struct {
		const char *name, *help;
	} gauges[] = {
		{ "shardd_checkpoint_writing_bytes",
		  "Bytes written so far of the checkpoint being written, by job (0: none)." },
		{ "shardd_checkpoint_writing_total_bytes",
		  "Bytes of the tensors of the checkpoint being written, by job." },
		{ "shardd_checkpoint_last_step", "Step of the job's last checkpoint that ended." },
		{ "shardd_checkpoint_last_bytes", "Bytes the job's last checkpoint wrote." },
		{ "shardd_checkpoint_last_seconds", "Seconds the job's last checkpoint took." },
		{ "shardd_checkpoint_last_failed", "1 when the job's last checkpoint failed." },
	};

	for (size_t k = 0; k < sizeof(gauges) / sizeof(gauges[0]); k++) {
		header(t, gauges[k].name, "gauge", gauges[k].help);
		for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
			struct shd_engine_ckpt_status st;
			char name[2 * SHARDD_NAME_MAX + 1];
			double v[6];

			shd_engine_job_checkpoint_status(j->ejob, &st);
			v[0] = (double)st.writing_bytes;
			v[1] = (double)st.writing_total;
			v[2] = (double)st.last_step;
			v[3] = (double)st.last_bytes;
			v[4] = st.last_s;
			v[5] = st.last_id && st.last_res ? 1 : 0;
			label_escape(j->name, name, sizeof(name));
			emit(t, "%s{job=\"%s\"} %.17g\n", gauges[k].name, name, v[k]);
		}
	}
	/* The failure's text, so an alert can say what to do without a shell on the node. */
	header(t, "shardd_checkpoint_last_error", "gauge",
	       "1 with the job's last failed checkpoint's message in the error label; absent when it succeeded.");
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		struct shd_engine_ckpt_status st;
		char name[2 * SHARDD_NAME_MAX + 1], msg[2 * sizeof(st.last_msg) + 1];

		shd_engine_job_checkpoint_status(j->ejob, &st);
		if (!st.last_id || !st.last_res)
			continue;
		label_escape(j->name, name, sizeof(name));
		label_escape(st.last_msg, msg, sizeof(msg));
		emit(t, "shardd_checkpoint_last_error{job=\"%s\",error=\"%s\"} 1\n", name, msg);
	}
}

/*
 * Restores since the daemon started, by reason: counters that outlive the
 * job (one whose registration failed holds no group and ends with its
 * ranks); the last failure's text while the job lives.
 */
static void render_restores(struct text *t)
{
	struct shd_engine_restore_counts c;

	shd_engine_restore_counts(shd_state_engine(), &c);
	header(t, "shardd_restores_total", "counter",
	       "Group registrations filled from a checkpoint or plain weights.");
	emit(t, "shardd_restores_total %llu\n", (unsigned long long)c.restored);
	header(t, "shardd_restores_failed_total", "counter",
	       "Group registrations whose restore failed, by reason.");
	for (uint32_t r = 0; r < SHD_RESTORE_REASONS; r++)
		emit(t, "shardd_restores_failed_total{reason=\"%s\"} %llu\n",
		     shd_engine_restore_reason_name(r), (unsigned long long)c.failed[r]);
	header(t, "shardd_restore_fallbacks_total", "counter",
	       "Damaged checkpoints a restore skipped for an older one, by reason.");
	for (uint32_t r = 0; r < SHD_RESTORE_REASONS; r++)
		emit(t, "shardd_restore_fallbacks_total{reason=\"%s\"} %llu\n",
		     shd_engine_restore_reason_name(r), (unsigned long long)c.fallbacks[r]);
	header(t, "shardd_restore_last_error", "gauge",
	       "1 with the job's last failed restore's group, reason and message in labels; absent when none failed.");
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		struct shd_engine_ckpt_status st;
		char name[2 * SHARDD_NAME_MAX + 1], group[2 * SHARDD_NAME_MAX + 1],
			msg[2 * sizeof(st.restore_failed_msg) + 1];

		shd_engine_job_checkpoint_status(j->ejob, &st);
		if (!st.restore_failed_group[0])
			continue;
		label_escape(j->name, name, sizeof(name));
		label_escape(st.restore_failed_group, group, sizeof(group));
		label_escape(st.restore_failed_msg, msg, sizeof(msg));
		emit(t,
		     "shardd_restore_last_error{job=\"%s\",group=\"%s\",reason=\"%s\",error=\"%s\"} 1\n",
		     name, group, shd_engine_restore_reason_name(st.restore_failed_reason), msg);
	}
}

char *shd_admin_metrics_render(void)
{
	struct text t = { .cap = 16384 };

	t.buf = malloc(t.cap);
	if (!t.buf)
		return NULL;
	render_ops(&t);
	render_state(&t);
	render_gpu(&t);
	render_checkpoints(&t);
	render_restores(&t);
	if (t.oom) {
		free(t.buf);
		return NULL;
	}
	return t.buf;
}

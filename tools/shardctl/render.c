/* SPDX-License-Identifier: MIT */
/*
 * Human output of admin replies: aligned tables with a header line, bytes
 * in binary units, durations in s/us. The field names are those of
 * PROTOCOL.md "Admin requests"; a field the daemon did not send prints "-".
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "shardctl.h"

static const char *str(const json_t *o, const char *key)
{
	const char *s = json_string_value(json_object_get(o, key));

	return s ? s : "-";
}

static long long num(const json_t *o, const char *key)
{
	return (long long)json_integer_value(json_object_get(o, key));
}

static double real(const json_t *o, const char *key)
{
	return json_number_value(json_object_get(o, key));
}

static const char *bytes_str(long long b, char *buf, size_t len)
{
	static const char *unit[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	double v = (double)b;
	int u = 0;

	while (v >= 1024 && u < 4) {
		v /= 1024;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%lld B", b);
	else
		snprintf(buf, len, "%.1f %s", v, unit[u]);
	return buf;
}

static const char *duration_str(double s, char *buf, size_t len)
{
	long long t = (long long)s;

	if (t >= 3600)
		snprintf(buf, len, "%lldh%02lldm%02llds", t / 3600, t / 60 % 60, t % 60);
	else if (t >= 60)
		snprintf(buf, len, "%lldm%02llds", t / 60, t % 60);
	else
		snprintf(buf, len, "%.1fs", s);
	return buf;
}

/*
 * "reduce@4"; "barrier#3" (its number is no step); "zero_grad", "nop" (they
 * carry none); "-" before any op.
 */
static const char *opstep(const json_t *o, char *buf, size_t len)
{
	const char *op = json_string_value(json_object_get(o, "op"));

	if (!op || strcmp(op, "none") == 0)
		snprintf(buf, len, "-");
	else if (strcmp(op, "barrier") == 0)
		snprintf(buf, len, "%s#%lld", op, num(o, "step"));
	else if (strcmp(op, "zero_grad") == 0 || strcmp(op, "nop") == 0)
		snprintf(buf, len, "%s", op);
	else
		snprintf(buf, len, "%s@%lld", op, num(o, "step"));
	return buf;
}

/* "0,1,3" */
static const char *rank_list(const json_t *arr, char *buf, size_t len)
{
	size_t i, n = 0;
	json_t *v;

	buf[0] = 0;
	json_array_foreach(arr, i, v)
	{
		if (n >= len)
			break;
		n += (size_t)snprintf(buf + n, len - n, "%s%lld", i ? "," : "",
				      (long long)json_integer_value(v));
	}
	if (!json_array_size(arr))
		snprintf(buf, len, "-");
	return buf;
}

/* "reduce 'g' step 4: waiting for 2" */
static const char *pending_str(const json_t *p, char *buf, size_t len)
{
	char missing[256];
	const char *group = json_string_value(json_object_get(p, "group"));

	rank_list(json_object_get(p, "missing"), missing, sizeof(missing));
	if (group)
		snprintf(buf, len, "%s '%s' step %lld: waiting %.1fs for rank(s) %s", str(p, "op"),
			 group, num(p, "step"), real(p, "waiting_s"), missing);
	else
		snprintf(buf, len, "%s %lld: waiting %.1fs for rank(s) %s", str(p, "op"),
			 num(p, "step"), real(p, "waiting_s"), missing);
	return buf;
}

static void memory_line(FILE *f, const json_t *m)
{
	char a[32], b[32], c[32], d[32], e[32], t[32];

	fprintf(f, "shards %s, sharded grads %s, unsharded %s, grads %s, partials %s (total %s)",
		bytes_str(num(m, "shards"), a, sizeof(a)),
		bytes_str(num(m, "sharded_grads"), b, sizeof(b)),
		bytes_str(num(m, "unsharded"), c, sizeof(c)),
		bytes_str(num(m, "grads"), d, sizeof(d)),
		bytes_str(num(m, "partials"), e, sizeof(e)),
		bytes_str(num(m, "total"), t, sizeof(t)));
}

/* "limits   committed 96.0 MiB of 18.8 GiB (80% of physical memory (23.5 GiB)), per job 18.8 GiB" */
static void limits_line(FILE *f, const json_t *l)
{
	char used[32], all[32], job[32];

	if (!json_is_object(l))
		return;
	fprintf(f, "limits   committed %s of %s (%s), per job %s%s\n",
		bytes_str(num(l, "committed"), used, sizeof(used)),
		bytes_str(num(l, "max_memory"), all, sizeof(all)), str(l, "max_memory_from"),
		bytes_str(num(l, "max_job_memory"), job, sizeof(job)),
		json_is_false(json_object_get(l, "counted")) ? " (not counted: device memory)"
							     : "");
}

/* "running", "no ranks, ends in 12 s" (--job-linger), "no ranks, kept" (--job-linger 0). */
static const char *job_state(const json_t *j, char *buf, size_t len)
{
	const json_t *ends = json_object_get(j, "ends_in_s");

	if (json_is_number(ends))
		snprintf(buf, len, "no ranks, ends in %.0f s", ceil(json_number_value(ends)));
	else if (json_is_number(json_object_get(j, "no_ranks_s")))
		snprintf(buf, len, "no ranks, kept (--job-linger 0)");
	else
		snprintf(buf, len, "running");
	return buf;
}

void shardctl_render_status(FILE *f, const json_t *r)
{
	char up[32];

	fprintf(f, "shardd %s (protocol %s), pid %lld, uid %lld, backend %s\n", str(r, "version"),
		str(r, "protocol"), num(r, "pid"), num(r, "uid"), str(r, "backend"));
	fprintf(f, "socket   %s\n", str(r, "socket"));
	fprintf(f, "uptime   %s\n", duration_str(real(r, "uptime_s"), up, sizeof(up)));
	fprintf(f, "jobs     %lld, ranks attached %lld, connections %lld, collective timeout %gs\n",
		num(r, "jobs"), num(r, "ranks_attached"), num(r, "connections"),
		real(r, "collective_timeout_s"));
	fprintf(f, "memory   ");
	memory_line(f, json_object_get(r, "memory"));
	fputc('\n', f);
	limits_line(f, json_object_get(r, "memory_limits"));
	/* A daemon whose backend has no GPU, or one older than the field, leaves it out. */
	if (json_is_string(json_object_get(r, "gpu_sharing")))
		fprintf(f, "gpu      %s\n", str(r, "gpu_sharing"));
}

void shardctl_render_jobs(FILE *f, const json_t *r)
{
	const json_t *jobs = json_object_get(r, "jobs");
	size_t i;
	json_t *j;

	if (!json_array_size(jobs)) {
		fprintf(f, "no jobs\n");
		return;
	}
	fprintf(f, "%-24s %-9s %-9s %-7s %-11s %-21s %s\n", "JOB", "MESH", "ATTACHED", "GROUPS",
		"MEMORY", "COMMITTED/LIMIT", "STATE");
	json_array_foreach(jobs, i, j)
	{
		char mesh[32], att[32], mem[32], used[32], lim[32], cl[72], state[64];

		snprintf(mesh, sizeof(mesh), "%lldx%lld", num(j, "replicate"), num(j, "shard"));
		snprintf(att, sizeof(att), "%lld/%lld", num(j, "attached"), num(j, "world"));
		snprintf(cl, sizeof(cl), "%s/%s",
			 bytes_str(num(j, "memory_committed"), used, sizeof(used)),
			 bytes_str(num(j, "memory_limit"), lim, sizeof(lim)));
		fprintf(f, "%-24s %-9s %-9s %-7lld %-11s %-21s %s\n", str(j, "name"), mesh, att,
			num(j, "groups"),
			bytes_str(num(json_object_get(j, "memory"), "total"), mem, sizeof(mem)), cl,
			job_state(j, state, sizeof(state)));
	}
}

void shardctl_render_end(FILE *f, const json_t *r)
{
	char mem[32];
	long long n = num(r, "ranks_attached");

	fprintf(f, "ended job '%s': %lld rank%s attached (%s), %s freed\n", str(r, "job"), n,
		n == 1 ? " was" : "s were", n ? "their ops fail naming this end" : "none to tell",
		bytes_str(num(r, "memory_freed"), mem, sizeof(mem)));
}

void shardctl_render_ranks(FILE *f, const json_t *r)
{
	const json_t *jobs = json_object_get(r, "jobs");
	size_t i, k;
	json_t *j, *rk, *p;

	if (!json_array_size(jobs)) {
		fprintf(f, "no jobs\n");
		return;
	}
	json_array_foreach(jobs, i, j)
	{
		if (i)
			fputc('\n', f);
		const json_t *span = json_object_get(j, "span");
		char optim[64] = "";

		/* The optimizer's step is the training step; the ops' steps are however
		   the trainer numbers them (shardd.torch: two unshards a step). */
		if (json_is_integer(json_object_get(j, "max_optim_step")))
			snprintf(optim, sizeof(optim), ", optimizer step %lld",
				 num(j, "max_optim_step"));
		if (span)
			/* A job across nodes: this daemon holds one node's ranks; RANK is global. */
			fprintf(f,
				"job '%s': mesh %lldx%lld over %lld nodes, node %lld holds ranks %lld..%lld, "
				"%lld of %lld attached%s, furthest op step %lld\n",
				str(j, "name"), num(span, "replicate"), num(span, "shard"),
				num(span, "nodes"), num(span, "node"), num(span, "first_rank"),
				num(span, "last_rank"), num(j, "attached"), num(j, "world"), optim,
				num(j, "max_step"));
		else
			fprintf(f,
				"job '%s': mesh %lldx%lld, %lld of %lld ranks attached%s, furthest op step "
				"%lld\n",
				str(j, "name"), num(j, "replicate"), num(j, "shard"),
				num(j, "attached"), num(j, "world"), optim, num(j, "max_step"));
		fprintf(f, "%-5s %-8s %-9s %-16s %-16s %-16s %-8s %-6s %-7s %-7s %s\n", "RANK",
			"PID", "ATTACHED", "SUBMITTED", "TAKEN", "COMPLETED", "INFLIGHT", "OPTIM",
			"OP_STEP", "BEHIND", "WAITING IN");
		json_array_foreach(json_object_get(j, "ranks"), k, rk)
		{
			char a[32], b[32], c[32], d[32], w[512], pid[24], st[24], os[24];
			const json_t *waiting = json_object_get(rk, "waiting");

			if (json_is_integer(json_object_get(rk, "pid")))
				snprintf(pid, sizeof(pid), "%lld", num(rk, "pid"));
			else
				snprintf(pid, sizeof(pid), "-");
			if (!json_is_true(json_object_get(rk, "attached"))) {
				fprintf(f, "%-5lld %-8s %s\n", num(rk, "rank"), pid,
					json_is_true(json_object_get(rk, "goodbye"))
						? "detached (said goodbye)"
					: json_is_integer(json_object_get(rk, "pid"))
						? "detached (client gone; the rank may re-attach)"
						: "never attached");
				continue;
			}
			if (json_array_size(waiting))
				pending_str(json_array_get(waiting, 0), w, sizeof(w));
			else
				snprintf(w, sizeof(w), "-");
			if (json_is_integer(json_object_get(rk, "step")))
				snprintf(st, sizeof(st), "%lld", num(rk, "step"));
			else
				snprintf(st, sizeof(st), "-");
			if (json_is_integer(json_object_get(rk, "optim_step")))
				snprintf(os, sizeof(os), "%lld", num(rk, "optim_step"));
			else
				snprintf(os, sizeof(os), "-");
			fprintf(f,
				"%-5lld %-8s %-9s %-16s %-16s %-16s %-8lld %-6s %-7s %-7lld %s\n",
				num(rk, "rank"), pid,
				duration_str(real(rk, "attached_s"), a, sizeof(a)),
				opstep(json_object_get(rk, "submitted"), b, sizeof(b)),
				opstep(json_object_get(rk, "taken"), c, sizeof(c)),
				opstep(json_object_get(rk, "completed"), d, sizeof(d)),
				num(rk, "inflight"), os, st, num(rk, "behind"), w);
		}
		json_array_foreach(json_object_get(j, "pending"), k, p)
		{
			char w[512];

			fprintf(f, "pending: %s\n", pending_str(p, w, sizeof(w)));
		}
	}
}

void shardctl_render_groups(FILE *f, const json_t *r)
{
	const json_t *jobs = json_object_get(r, "jobs");
	size_t i, k, n;
	json_t *j, *g, *p;

	if (!json_array_size(jobs)) {
		fprintf(f, "no jobs\n");
		return;
	}
	json_array_foreach(jobs, i, j)
	{
		if (i)
			fputc('\n', f);
		fprintf(f, "job '%s': mesh %lldx%lld\n", str(j, "name"), num(j, "replicate"),
			num(j, "shard"));
		if (!json_array_size(json_object_get(j, "groups"))) {
			fprintf(f, "no groups registered\n");
			continue;
		}
		fprintf(f, "%-4s %-20s %-7s %-11s %-7s %-11s %-11s %-11s %-10s %s\n", "ID", "GROUP",
			"PARAMS", "STATE", "EXEC", "SHARD", "UNSHARDED", "GRAD", "HOLDERS",
			"PARTIALS");
		json_array_foreach(json_object_get(j, "groups"), k, g)
		{
			const json_t *b = json_object_get(g, "bytes");
			char s1[32], s2[32], s3[32], h[128], pa[128];

			fprintf(f, "%-4lld %-20s %-7lld %-11s %-7s %-11s %-11s %-11s %-10s %s\n",
				num(g, "id"), str(g, "name"), num(g, "nparams"),
				json_is_true(json_object_get(g, "complete")) ? "ready"
									     : "registering",
				str(g, "exec"), bytes_str(num(b, "shard"), s1, sizeof(s1)),
				bytes_str(num(b, "unsharded"), s2, sizeof(s2)),
				bytes_str(num(b, "grad"), s3, sizeof(s3)),
				rank_list(json_object_get(g, "unsharded_holders"), h, sizeof(h)),
				rank_list(json_object_get(g, "partials_present"), pa, sizeof(pa)));
			fprintf(f, "     exec: %s\n", str(g, "exec_why"));
			json_array_foreach(json_object_get(g, "exec_ranks"), n, p)
			{
				const json_t *w = json_object_get(p, "waiting");

				fprintf(f,
					"     rank %lld: %lld unshards, %lld reduces, %lld reshards%s",
					num(p, "rank"), num(p, "unshards"), num(p, "reduces"),
					num(p, "reshards"),
					json_is_true(json_object_get(p, "published"))
						? ""
						: ", buffers not published");
				if (w)
					fprintf(f, "; waits in %s for rank %lld since %.1f s",
						str(w, "op"), num(w, "for_rank"),
						json_number_value(json_object_get(w, "for_s")));
				fputc('\n', f);
			}
			json_array_foreach(json_object_get(g, "pending"), n, p)
			{
				char w[512];

				fprintf(f, "     pending: %s\n", pending_str(p, w, sizeof(w)));
			}
		}
	}
}

static const char *shape_str(const json_t *shape, char *buf, size_t len)
{
	size_t i, n = 0;
	json_t *v;

	n += (size_t)snprintf(buf, len, "[");
	json_array_foreach(shape, i, v)
	{
		if (n >= len)
			break;
		n += (size_t)snprintf(buf + n, len - n, "%s%lld", i ? ", " : "",
				      (long long)json_integer_value(v));
	}
	if (n < len)
		snprintf(buf + n, len - n, "]");
	return buf;
}

void shardctl_render_show(FILE *f, const json_t *r)
{
	size_t i;
	json_t *p;

	fprintf(f,
		"group '%s' (id %lld) of job '%s': %lld params, param_dtype %s, reduce_dtype %s, "
		"shard group of %lld, %s\n",
		str(r, "name"), num(r, "id"), str(r, "job"), num(r, "nparams"),
		str(r, "param_dtype"), str(r, "reduce_dtype"), num(r, "shard_world"),
		json_is_true(json_object_get(r, "complete")) ? "ready" : "registering");
	fprintf(f, "%-4s %-28s %-6s %-18s %-4s %-8s %-12s %-12s %-12s %s\n", "#", "PARAM", "DTYPE",
		"SHAPE", "DIM", "ROWS", "UNSH_OFF", "GRAD_OFF", "SHARD_OFF", "VALID ROWS/SHARD");
	json_array_foreach(json_object_get(r, "params"), i, p)
	{
		char shape[128], valid[256];

		fprintf(f, "%-4lld %-28s %-6s %-18s %-4lld %-8lld %-12lld %-12lld %-12lld %s\n",
			num(p, "index"), str(p, "name"), str(p, "dtype"),
			shape_str(json_object_get(p, "shape"), shape, sizeof(shape)),
			num(p, "shard_dim"), num(p, "shard_rows"), num(p, "unsharded_offset"),
			num(p, "grad_offset"), num(p, "shard_offset"),
			rank_list(json_object_get(p, "rows_valid"), valid, sizeof(valid)));
	}
}

/* A statistic that may be a number, a "nan"/"inf" string or null. */
static void stat_val(FILE *f, const json_t *v)
{
	if (json_is_number(v))
		fprintf(f, "%.9g", json_number_value(v));
	else if (json_is_string(v))
		fputs(json_string_value(v), f);
	else
		fputs("-", f);
}

void shardctl_render_dump(FILE *f, const json_t *r)
{
	const json_t *st = json_object_get(r, "stats"), *rows = json_object_get(r, "rows");
	char shape[128];
	size_t i;
	json_t *v;

	fprintf(f,
		"job '%s' group '%s' param '%s': %s of rank %lld, %s %s, rows %lld:%lld "
		"(%lld elements a row)%s\n",
		str(r, "job"), str(r, "group"), str(r, "param"), str(r, "what"), num(r, "rank"),
		str(r, "dtype"), shape_str(json_object_get(r, "shape"), shape, sizeof(shape)),
		(long long)json_integer_value(json_array_get(rows, 0)),
		(long long)json_integer_value(json_array_get(rows, 1)), num(r, "row_elems"),
		json_is_false(json_object_get(r, "grad_present")) ? " [no grad yet: zeros]" : "");
	fprintf(f, "count %lld  finite %lld  nan %lld  inf %lld\nmin ", num(st, "count"),
		num(st, "finite"), num(st, "nan"), num(st, "inf"));
	stat_val(f, json_object_get(st, "min"));
	fputs("  max ", f);
	stat_val(f, json_object_get(st, "max"));
	fputs("  mean ", f);
	stat_val(f, json_object_get(st, "mean"));
	fputs("  l2 ", f);
	stat_val(f, json_object_get(st, "l2"));
	fputs("\nvalues:", f);
	json_array_foreach(json_object_get(r, "values"), i, v)
	{
		fputs(i % 8 ? " " : "\n ", f);
		stat_val(f, v);
	}
	if (json_is_true(json_object_get(r, "truncated")))
		fprintf(f, "\n ... (%lld values in all; --limit shows more)", num(st, "count"));
	fputc('\n', f);
}

void shardctl_render_stats(FILE *f, const json_t *r)
{
	size_t i;
	json_t *o;

	fprintf(f, "%-10s %-10s %-8s %-12s %-10s %-10s %-10s %s\n", "OP", "COUNT", "FAILED",
		"BYTES", "MEAN(us)", "P50(us)", "P99(us)", "MAX(us)");
	json_array_foreach(json_object_get(r, "ops"), i, o)
	{
		char b[32];

		fprintf(f, "%-10s %-10lld %-8lld %-12s %-10.1f %-10.1f %-10.1f %.1f\n",
			str(o, "op"), num(o, "count"), num(o, "failed"),
			bytes_str(num(o, "bytes"), b, sizeof(b)), real(o, "mean_us"),
			real(o, "p50_us"), real(o, "p99_us"), real(o, "max_us"));
	}
	fprintf(f, "latency: %s\n", str(r, "latency"));
	{
		const json_t *x = json_object_get(r, "rank_executed");

		if (x && (num(x, "unshard") || num(x, "reduce") || num(x, "reshard")))
			fprintf(f,
				"rank-executed (run in the ranks, not counted above): %lld unshard, "
				"%lld reduce, %lld reshard\n",
				num(x, "unshard"), num(x, "reduce"), num(x, "reshard"));
	}
}

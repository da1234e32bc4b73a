/* SPDX-License-Identifier: MIT */
/*
 * Admin requests (admin.h): each command builds its reply from the loop's
 * own state. Replies are JSON built with jansson; numbers that JSON cannot
 * hold (NaN, Inf) travel as the strings "nan", "inf", "-inf".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "admin.h"
#include "backend.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "log.h"
#include "metrics.h"
#include "rendezvous.h"
#include "server.h"
#include "session.h"
#include "shardd_kernels.h"

#define NAMES_MAX 1024 /* bytes of a "jobs: a, b, c" list in an error */

/* The pid of the client whose request runs now (shardd_admin_handle); 0 when unknown. */
static pid_t admin_peer_pid;

/* ------------------------------------------------------------------ */
/* Replies                                                             */
/* ------------------------------------------------------------------ */

static json_t *reply_ok(void)
{
	return json_pack("{s:b}", "ok", 1);
}

/*
 * Replace, in place, each byte that does not begin a well-formed UTF-8
 * sequence with '?'. jansson refuses strings that are not UTF-8, and ours
 * may not be: group and param names are whatever bytes a client registered,
 * and a long text cut at its buffer's end may end inside a character.
 */
static void utf8_scrub(char *s)
{
	unsigned char *p = (unsigned char *)s;

	while (*p) {
		unsigned c = *p, n = 0, lo = 0x80, hi = 0xbf, k;
		int ok;

		if (c < 0x80) {
			p++;
			continue;
		}
		if (c >= 0xc2 && c <= 0xdf) {
			n = 1;
		} else if (c >= 0xe0 && c <= 0xef) {
			n = 2;
			lo = c == 0xe0 ? 0xa0 : 0x80; /* no overlong forms */
			hi = c == 0xed ? 0x9f : 0xbf; /* no surrogates */
		} else if (c >= 0xf0 && c <= 0xf4) {
			n = 3;
			lo = c == 0xf0 ? 0x90 : 0x80;
			hi = c == 0xf4 ? 0x8f : 0xbf; /* nothing above U+10FFFF */
		}
		/* A NUL fails the first check, so nothing past the string is read. */
		ok = n > 0;
		for (k = 1; ok && k <= n; k++)
			ok = k == 1 ? p[k] >= lo && p[k] <= hi : p[k] >= 0x80 && p[k] <= 0xbf;
		if (!ok) {
			*p++ = '?';
			continue;
		}
		p += n + 1;
	}
}

/* A name a client chose (group, param), as a JSON string whatever its bytes. */
static json_t *json_name(const char *name)
{
	char buf[SHARDD_PARAM_NAME_MAX];

	snprintf(buf, sizeof(buf), "%s", name);
	utf8_scrub(buf);
	return json_string(buf);
}

static json_t *__attribute__((format(printf, 2, 3))) reply_err(int code, const char *fmt, ...)
{
	char text[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	utf8_scrub(text);
	return json_pack("{s:b, s:s, s:i}", "ok", 0, "error", text, "code", code);
}

/* obj[key] = v, taking v's reference. -ENOMEM when either is NULL or the set fails. */
static int put(json_t *obj, const char *key, json_t *v)
{
	if (!obj || !v) {
		json_decref(v);
		return -ENOMEM;
	}
	return json_object_set_new(obj, key, v) ? -ENOMEM : 0;
}

static int append(json_t *arr, json_t *v)
{
	if (!arr || !v) {
		json_decref(v);
		return -ENOMEM;
	}
	return json_array_append_new(arr, v) ? -ENOMEM : 0;
}

static json_t *json_u64(uint64_t v)
{
	return json_integer((json_int_t)(v > INT64_MAX ? INT64_MAX : v));
}

/* A float in JSON: a number when finite, else "nan", "inf" or "-inf". */
static json_t *json_float(double v)
{
	if (isnan(v))
		return json_string("nan");
	if (isinf(v))
		return json_string(v > 0 ? "inf" : "-inf");
	return json_real(v);
}

/* "op 77" for codes a client wrote that are no op of ours. */
static json_t *json_op(uint32_t op)
{
	char buf[32];
	const char *name = shardd_op_name(op);

	if (op == 0)
		return json_string("none");
	if (name)
		return json_string(name);
	snprintf(buf, sizeof(buf), "op %u", op);
	return json_string(buf);
}

static json_t *json_op_step(uint32_t op, uint64_t step)
{
	json_t *o = json_object();

	if (put(o, "op", json_op(op)) || put(o, "step", json_u64(step))) {
		json_decref(o);
		return NULL;
	}
	return o;
}

/* ------------------------------------------------------------------ */
/* Lookup with errors that list what exists                            */
/* ------------------------------------------------------------------ */

static void job_names(char *buf, size_t len)
{
	size_t n = 0;

	buf[0] = 0;
	for (struct shardd_job *j = server.jobs; j && n < len; j = j->next)
		n += (size_t)snprintf(buf + n, len - n, "%s'%s'", n ? ", " : "", j->name);
}

static json_t *no_job(const char *name)
{
	char names[NAMES_MAX];

	if (!server.jobs)
		return reply_err(-SHARDD_E_NOJOB, "no job '%s': shardd has no jobs (no rank attached yet)",
				 name);
	job_names(names, sizeof(names));
	return reply_err(-SHARDD_E_NOJOB, "no job '%s'; jobs: %s", name, names);
}

static const struct shardd_group *group_by_id(const struct shardd_job *j, uint32_t id)
{
	return shardd_engine_job_group(j->ejob, id);
}

static uint32_t job_ngroups(const struct shardd_job *j)
{
	return shardd_engine_job_ngroups(j->ejob);
}

static const struct shardd_group *group_by_name(const struct shardd_job *j, const char *name,
						uint32_t *id)
{
	for (uint32_t i = 1; i <= job_ngroups(j); i++) {
		const struct shardd_group *g = group_by_id(j, i);

		if (g && strcmp(g->name, name) == 0) {
			*id = i;
			return g;
		}
	}
	return NULL;
}

static void group_names(const struct shardd_job *j, char *buf, size_t len)
{
	size_t n = 0;

	buf[0] = 0;
	for (uint32_t i = 1; i <= job_ngroups(j) && n < len; i++) {
		const struct shardd_group *g = group_by_id(j, i);

		if (g)
			n += (size_t)snprintf(buf + n, len - n, "%s'%s'", n ? ", " : "", g->name);
	}
}

/* The job named by req's optional "job"; NULL when absent, or with *err when none fits. */
static struct shardd_job *arg_job(const json_t *req, json_t **err)
{
	const json_t *v = json_object_get(req, "job");
	struct shardd_job *j;

	*err = NULL;
	if (v && !json_is_null(v)) {
		if (!json_is_string(v)) {
			*err = reply_err(-SHARDD_E_INVALID, "\"job\" must be a string");
			return NULL;
		}
		j = shardd_job_find(json_string_value(v));
		if (!j)
			*err = no_job(json_string_value(v));
		return j;
	}
	return NULL;
}

/*
 * The group named `name` in job `j`, or in the only job that has one by that
 * name when `j` is NULL. NULL with *err otherwise.
 */
static struct shardd_job *find_group(struct shardd_job *j, const char *name,
				     const struct shardd_group **g, uint32_t *id, json_t **err)
{
	char names[NAMES_MAX];
	struct shardd_job *found = NULL;
	size_t n = 0;

	*err = NULL;
	if (j) {
		*g = group_by_name(j, name, id);
		if (*g)
			return j;
		group_names(j, names, sizeof(names));
		*err = reply_err(-SHARDD_E_NOGROUP, "job '%s' has no group '%s'; groups: %s", j->name,
				 name, *names ? names : "none registered yet");
		return NULL;
	}
	names[0] = 0;
	for (struct shardd_job *k = server.jobs; k; k = k->next) {
		uint32_t kid;
		const struct shardd_group *kg = group_by_name(k, name, &kid);

		if (!kg)
			continue;
		if (found) {
			*err = reply_err(-SHARDD_E_INVALID,
					 "group '%s' exists in jobs '%s' and '%s': pass --job NAME",
					 name, found->name, k->name);
			return NULL;
		}
		found = k;
		*g = kg;
		*id = kid;
	}
	if (found)
		return found;
	for (struct shardd_job *k = server.jobs; k && n < sizeof(names); k = k->next) {
		for (uint32_t i = 1; i <= job_ngroups(k) && n < sizeof(names); i++) {
			const struct shardd_group *kg = group_by_id(k, i);

			if (kg)
				n += (size_t)snprintf(names + n, sizeof(names) - n, "%s'%s' (job '%s')",
						      n ? ", " : "", kg->name, k->name);
		}
	}
	*err = reply_err(-SHARDD_E_NOGROUP, "no group '%s'; groups: %s", name,
			 *names ? names : "none registered yet");
	return NULL;
}

/* ------------------------------------------------------------------ */
/* Memory                                                              */
/* ------------------------------------------------------------------ */

static uint64_t bufs_bytes(const struct shardd_buf *b, uint32_t n)
{
	uint64_t sum = 0;

	for (uint32_t i = 0; b && i < n; i++)
		if (shardd_buf_allocated(&b[i]))
			sum += b[i].bytes;
	return sum;
}

static void group_memory(const struct shardd_group *g, struct shardd_memory_use *m)
{
	if (!g->allocated)
		return;
	m->shards += bufs_bytes(g->shards, g->world);
	m->sharded_grads += bufs_bytes(g->sharded_grads, g->world);
	m->unsharded += bufs_bytes(g->unsharded, g->world);
	m->grads += bufs_bytes(g->grads, g->world);
	m->partials += bufs_bytes(g->partials, g->world);
}

static void job_memory(const struct shardd_job *j, struct shardd_memory_use *m)
{
	for (uint32_t i = 1; i <= job_ngroups(j); i++) {
		const struct shardd_group *g = group_by_id(j, i);

		if (g)
			group_memory(g, m);
	}
}

void shardd_memory_use_all(struct shardd_memory_use *out)
{
	memset(out, 0, sizeof(*out));
	for (struct shardd_job *j = server.jobs; j; j = j->next)
		job_memory(j, out);
}

uint64_t shardd_memory_job_bytes(const struct shardd_job *j)
{
	struct shardd_memory_use m = { 0 };

	job_memory(j, &m);
	return m.shards + m.sharded_grads + m.unsharded + m.grads + m.partials;
}

static json_t *json_memory(const struct shardd_memory_use *m)
{
	return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}",
			 "shards", (json_int_t)m->shards,
			 "sharded_grads", (json_int_t)m->sharded_grads,
			 "unsharded", (json_int_t)m->unsharded,
			 "grads", (json_int_t)m->grads,
			 "partials", (json_int_t)m->partials,
			 "total", (json_int_t)(m->shards + m->sharded_grads + m->unsharded +
					       m->grads + m->partials));
}

/* --max-memory, --max-job-memory, and the bytes committed against them. */
static json_t *json_memory_limits(void)
{
	return json_pack("{s:o, s:s, s:o, s:o, s:b}",
			 "max_memory", json_u64(server.cfg.max_memory),
			 "max_memory_from", server.cfg.max_memory_from,
			 "max_job_memory", json_u64(server.cfg.max_job_memory),
			 "committed", json_u64(shardd_engine_memory_committed(server.engine)),
			 "counted", server.cfg.backend == SHARDD_BACKEND_HOST);
}

/* ------------------------------------------------------------------ */
/* status, jobs                                                        */
/* ------------------------------------------------------------------ */

static json_t *cmd_status(const json_t *req)
{
	struct shardd_memory_use m;
	uint32_t njobs = 0, nattached = 0, nsessions = 0;
	json_t *r = reply_ok();
	char proto[16];

	(void)req;
	shardd_memory_use_all(&m);
	for (struct shardd_job *j = server.jobs; j; j = j->next) {
		njobs++;
		nattached += j->nattached;
	}
	for (struct shardd_session *s = server.sessions; s; s = s->next)
		nsessions += s->state != SHARDD_SESSION_DEAD;
	snprintf(proto, sizeof(proto), "%d.%d", SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
	if (put(r, "version", json_string(SHARDD_VERSION)) ||
	    put(r, "protocol", json_string(proto)) ||
	    put(r, "pid", json_integer(server.pid)) ||
	    put(r, "uid", json_integer(server.uid)) ||
	    put(r, "backend", json_string(shardd_backend_name(server.cfg.backend))) ||
	    put(r, "socket", json_string(server.cfg.socket_path)) ||
	    put(r, "uptime_s", json_real((double)(shardd_now_ns() - server.start_ns) / 1e9)) ||
	    put(r, "collective_timeout_s", json_real(server.cfg.collective_timeout_s)) ||
	    put(r, "jobs", json_integer(njobs)) ||
	    put(r, "ranks_attached", json_integer(nattached)) ||
	    put(r, "connections", json_integer(nsessions)) ||
	    put(r, "memory", json_memory(&m)) ||
	    put(r, "memory_limits", json_memory_limits())) {
		json_decref(r);
		return NULL;
	}
	return r;
}

/* no_ranks_s: how long the job has had no attached rank; ends_in_s: when --job-linger ends it. */
static int put_linger(json_t *o, const struct shardd_job *j, uint64_t now_ns)
{
	double ends = shardd_job_ends_in_s(j, now_ns);
	int orphaned = !j->nattached && j->orphaned_ns;

	return put(o, "no_ranks_s", orphaned ? json_real((double)(now_ns - j->orphaned_ns) / 1e9)
					     : json_null()) ||
	       put(o, "ends_in_s", ends < 0 ? json_null() : json_real(ends));
}

static json_t *cmd_jobs(const json_t *req)
{
	json_t *r = reply_ok(), *arr = json_array();
	uint64_t now = shardd_now_ns();

	(void)req;
	for (struct shardd_job *j = server.jobs; j; j = j->next) {
		struct shardd_memory_use m = { 0 };
		json_t *o;

		job_memory(j, &m);
		o = json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:o*, s:o, s:o}", "name", j->name,
			      "replicate", (int)j->replicate, "shard", (int)j->shard,
			      "world", (int)j->world, "attached", (int)j->nattached,
			      "groups", (int)job_ngroups(j), "memory", json_memory(&m),
			      "memory_committed", json_u64(shardd_engine_job_memory_committed(j->ejob)),
			      "memory_limit", json_u64(server.cfg.max_job_memory));
		if (o && put_linger(o, j, now)) {
			json_decref(o);
			o = NULL;
		}
		if (append(arr, o)) {
			json_decref(arr);
			json_decref(r);
			return NULL;
		}
	}
	if (put(r, "jobs", arr)) {
		json_decref(r);
		return NULL;
	}
	return r;
}

/* ------------------------------------------------------------------ */
/* Rendezvous in progress                                              */
/* ------------------------------------------------------------------ */

/* {"op", "group", "step", "flags", "arrived": [..], "missing": [..], "waiting_s"} */
static json_t *json_rdv(const char *what, const char *group, const struct shardd_rdv *rdv,
			uint64_t now_ns)
{
	json_t *o = json_object(), *arrived = json_array(), *missing = json_array();

	for (uint32_t i = 0; i < rdv->nexpected; i++)
		if (append(rdv->arrived[i] ? arrived : missing, json_integer(rdv->ranks[i])))
			goto err;
	if (put(o, "op", json_string(what)) ||
	    (group && put(o, "group", json_name(group))) ||
	    put(o, "step", json_u64(rdv->step)) ||
	    put(o, "flags", json_integer(rdv->flags)) ||
	    put(o, "arrived", json_incref(arrived)) ||
	    put(o, "missing", json_incref(missing)))
		goto err;
	/* deadline = first arrival + timeout: how long the first rank has waited. */
	if (put(o, "waiting_s", json_real(rdv->deadline_ns > now_ns + server.collective_timeout_ns ? 0 :
			(double)(now_ns + server.collective_timeout_ns - rdv->deadline_ns) / 1e9)))
		goto err;
	json_decref(arrived);
	json_decref(missing);
	return o;
err:
	json_decref(arrived);
	json_decref(missing);
	json_decref(o);
	return NULL;
}

static const char *pending_what(uint32_t op)
{
	return op == 0 ? "register" : shardd_op_name(op) ? shardd_op_name(op) : "?";
}

/* Every rendezvous of job `j` some rank has arrived at: the job's barrier and its groups'. */
static json_t *job_pending(const struct shardd_job *j, uint64_t now_ns)
{
	json_t *arr = json_array();

	if (j->barrier.active && append(arr, json_rdv("barrier", NULL, &j->barrier, now_ns)))
		goto err;
	for (uint32_t id = 1; id <= job_ngroups(j); id++) {
		const struct shardd_group *g = group_by_id(j, id);
		const struct shardd_rdv *rdv;
		uint32_t op;

		for (uint32_t i = 0; g && shardd_engine_group_pending(j->ejob, id, i, &op, &rdv) == 0; i++)
			if (append(arr, json_rdv(pending_what(op), g->name, rdv, now_ns)))
				goto err;
	}
	return arr;
err:
	json_decref(arr);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* ranks                                                               */
/* ------------------------------------------------------------------ */

/* The rendezvous of `pending` that rank `rank` has arrived at: what it waits in. */
static json_t *rank_waiting(const json_t *pending, uint32_t rank)
{
	json_t *arr = json_array();
	size_t i;
	json_t *p;

	json_array_foreach(pending, i, p) {
		size_t k;
		json_t *a;

		json_array_foreach(json_object_get(p, "arrived"), k, a) {
			if ((uint32_t)json_integer_value(a) == rank && append(arr, json_incref(p))) {
				json_decref(arr);
				return NULL;
			}
		}
	}
	return arr;
}

/*
 * The furthest training step session `s` has reached: the furthest
 * step-carrying op it had taken, or the one its client submitted last when
 * that carries a step (written by the client: shown, never trusted). 0 and
 * *has = 0 before any.
 */
static uint64_t session_step(const struct shardd_session *s, int *has)
{
	uint64_t step = s->clock.has_step ? s->clock.step : 0;
	uint64_t cstep;
	uint32_t cop;

	shardd_ring_client_last(&s->ring, &cop, &cstep);
	*has = s->clock.has_step;
	if (shardd_op_carries_step(cop) && (!*has || cstep > step)) {
		step = cstep;
		*has = 1;
	}
	return step;
}

static json_t *json_rank(const struct shardd_job *j, uint32_t r, const json_t *pending,
			 uint64_t max_step, uint64_t now_ns)
{
	const struct shardd_job_rank *jr = &j->ranks[r];
	const struct shardd_session *s = shardd_session_of_rank(j, r);
	json_t *o = json_object();
	struct timespec wall;

	if (put(o, "rank", json_integer(r)) ||
	    put(o, "attached", json_boolean(s != NULL)) ||
	    put(o, "pid", jr->attached_once ? json_integer(jr->pid) : json_null()) ||
	    put(o, "goodbye", json_boolean(jr->goodbye)))
		goto err;
	if (!s)
		return o;
	{
		uint32_t cop;
		uint64_t cstep;
		int64_t sq_pending = shardd_sq_ready((struct shardd_ring *)&s->ring);
		double since = (double)(now_ns - s->stats.attached_ns) / 1e9;
		int has_step;
		uint64_t step = session_step(s, &has_step);

		/* Written by the client: shown as-is, never trusted. */
		shardd_ring_client_last(&s->ring, &cop, &cstep);
		clock_gettime(CLOCK_REALTIME, &wall);
		if (put(o, "client_id", json_integer(s->id)) ||
		    put(o, "attached_s", json_real(since)) ||
		    put(o, "attached_at", json_real((double)wall.tv_sec + wall.tv_nsec / 1e9 - since)) ||
		    put(o, "submitted", json_op_step(cop, cstep)) ||
		    put(o, "taken", json_op_step(s->stats.last_taken_op, s->stats.last_taken_step)) ||
		    put(o, "completed", json_op_step(s->clock.done.op, s->clock.done.step)) ||
		    put(o, "step", has_step ? json_u64(step) : json_null()) ||
		    put(o, "ops_taken", json_u64(s->stats.ops_taken)) ||
		    put(o, "ops_completed", json_u64(s->stats.ops_completed)) ||
		    put(o, "ops_failed", json_u64(s->stats.ops_failed)) ||
		    put(o, "inflight", json_integer(s->inflight)) ||
		    put(o, "sq_pending", sq_pending < 0 ? json_string("corrupt") :
			json_integer(sq_pending)) ||
		    put(o, "behind", json_u64(max_step > step ? max_step - step : 0)) ||
		    put(o, "waiting", rank_waiting(pending, r)))
			goto err;
	}
	return o;
err:
	json_decref(o);
	return NULL;
}

static json_t *json_job_ranks(const struct shardd_job *j, uint64_t now_ns)
{
	json_t *o = json_object(), *arr = json_array(), *pending = job_pending(j, now_ns);
	uint64_t max_step = 0;
	int ok;

	/* "Behind" is against the rank that has submitted the furthest step. */
	for (uint32_t r = 0; r < j->world; r++) {
		const struct shardd_session *s = shardd_session_of_rank(j, r);

		if (s) {
			int has;
			uint64_t step = session_step(s, &has);

			if (step > max_step)
				max_step = step;
		}
	}
	ok = pending != NULL;
	for (uint32_t r = 0; ok && r < j->world; r++)
		ok = append(arr, json_rank(j, r, pending, max_step, now_ns)) == 0;
	if (!ok || put(o, "name", json_string(j->name)) ||
	    put(o, "replicate", json_integer(j->replicate)) ||
	    put(o, "shard", json_integer(j->shard)) ||
	    put(o, "world", json_integer(j->world)) ||
	    put(o, "attached", json_integer(j->nattached)) ||
	    put(o, "max_step", json_u64(max_step)) ||
	    put(o, "ranks", json_incref(arr)) ||
	    put(o, "pending", json_incref(pending))) {
		json_decref(o);
		o = NULL;
	}
	json_decref(arr);
	json_decref(pending);
	return o;
}

/* ------------------------------------------------------------------ */
/* groups, show                                                        */
/* ------------------------------------------------------------------ */

static json_t *json_dtype(uint32_t d)
{
	const char *n = shardd_dtype_name(d);

	return n ? json_string(n) : json_integer(d);
}

static json_t *json_group(const struct shardd_job *j, uint32_t id, const struct shardd_group *g,
			  uint64_t now_ns)
{
	json_t *o = json_object(), *holders = json_array(), *partials = json_array();
	json_t *pending = json_array(), *bytes = NULL;
	struct shardd_memory_use m = { 0 };
	const struct shardd_rdv *rdv;
	uint32_t op;

	group_memory(g, &m);
	for (uint32_t r = 0; r < g->world; r++) {
		if (g->holds && g->holds[r] && append(holders, json_integer(r)))
			goto err;
		/* Written by pool threads: a snapshot. */
		if (g->partial_present &&
		    __atomic_load_n(&g->partial_present[r], __ATOMIC_RELAXED) &&
		    append(partials, json_integer(r)))
			goto err;
	}
	for (uint32_t i = 0; shardd_engine_group_pending(j->ejob, id, i, &op, &rdv) == 0; i++)
		if (append(pending, json_rdv(pending_what(op), g->name, rdv, now_ns)))
			goto err;
	bytes = json_pack("{s:I, s:I, s:I}", "unsharded", (json_int_t)g->layout.unsharded_size,
			  "grad", (json_int_t)g->layout.grad_size,
			  "shard", (json_int_t)g->layout.shard_size);
	if (put(o, "id", json_integer(id)) ||
	    put(o, "name", json_name(g->name)) ||
	    put(o, "job", json_string(j->name)) ||
	    put(o, "nparams", json_integer(g->hdr.nparams)) ||
	    put(o, "complete", json_boolean(shardd_engine_group_complete(j->ejob, id))) ||
	    put(o, "param_dtype", json_dtype(g->hdr.param_dtype)) ||
	    put(o, "reduce_dtype", json_dtype(g->reduce_dtype)) ||
	    put(o, "grad_dtype", json_dtype(g->grad_dtype)) ||
	    put(o, "shard_world", json_integer(g->shard)) ||
	    put(o, "bytes", bytes) ||
	    put(o, "memory", json_memory(&m)) ||
	    put(o, "unsharded_refcount", json_integer((json_int_t)json_array_size(holders))) ||
	    put(o, "unsharded_holders", json_incref(holders)) ||
	    put(o, "partials_present", json_incref(partials)) ||
	    put(o, "pending", json_incref(pending)))
		goto err;
	json_decref(holders);
	json_decref(partials);
	json_decref(pending);
	return o;
err:
	json_decref(holders);
	json_decref(partials);
	json_decref(pending);
	json_decref(o);
	return NULL;
}

/* Jobs selected by req's optional "job": all of them, or that one. */
static json_t *per_job(const json_t *req, json_t *(*fn)(const struct shardd_job *, uint64_t))
{
	uint64_t now = shardd_now_ns();
	json_t *r, *arr, *err;
	struct shardd_job *only = arg_job(req, &err);

	if (err)
		return err;
	r = reply_ok();
	arr = json_array();
	for (struct shardd_job *j = server.jobs; j; j = j->next) {
		if (only && j != only)
			continue;
		if (append(arr, fn(j, now))) {
			json_decref(arr);
			json_decref(r);
			return NULL;
		}
	}
	if (put(r, "jobs", arr)) {
		json_decref(r);
		return NULL;
	}
	return r;
}

static json_t *json_job_groups(const struct shardd_job *j, uint64_t now_ns)
{
	json_t *arr = json_array();

	for (uint32_t id = 1; id <= job_ngroups(j); id++) {
		const struct shardd_group *g = group_by_id(j, id);

		if (g && append(arr, json_group(j, id, g, now_ns))) {
			json_decref(arr);
			return NULL;
		}
	}
	return json_pack("{s:s, s:i, s:i, s:o}", "name", j->name, "replicate", (int)j->replicate,
			 "shard", (int)j->shard, "groups", arr);
}

static json_t *cmd_ranks(const json_t *req)
{
	return per_job(req, json_job_ranks);
}

static json_t *cmd_groups(const json_t *req)
{
	return per_job(req, json_job_groups);
}

static json_t *json_shape(const struct shardd_param_spec *sp)
{
	json_t *a = json_array();

	for (uint32_t d = 0; d < sp->ndim && d < SHARDD_MAX_DIMS; d++)
		if (append(a, json_u64(sp->shape[d]))) {
			json_decref(a);
			return NULL;
		}
	return a;
}

static json_t *json_param(const struct shardd_group *g, uint32_t i)
{
	const struct shardd_param_spec *sp = &g->specs[i];
	const struct shardd_layout_param *lp = &g->layout.params[i];
	json_t *o = json_object(), *valid = json_array();

	for (uint32_t r = 0; r < g->shard; r++)
		if (append(valid, json_u64(shardd_layout_rows_valid(lp, r))))
			goto err;
	if (put(o, "index", json_integer(i)) ||
	    put(o, "name", json_name(sp->name)) ||
	    put(o, "dtype", json_dtype(lp->dtype)) ||
	    put(o, "unsharded_dtype", json_dtype(lp->unsharded_dtype)) ||
	    put(o, "grad_dtype", json_dtype(lp->grad_dtype)) ||
	    put(o, "shape", json_shape(sp)) ||
	    put(o, "shard_dim", json_integer(lp->shard_dim)) ||
	    put(o, "numel", json_u64(lp->numel)) ||
	    put(o, "shard_rows", json_u64(lp->rows)) ||
	    put(o, "shard_numel", json_u64(lp->shard_numel)) ||
	    put(o, "rows_valid", json_incref(valid)) ||
	    put(o, "unsharded_offset", json_u64(lp->unsharded_offset)) ||
	    put(o, "grad_offset", json_u64(lp->grad_offset)) ||
	    put(o, "shard_offset", json_u64(lp->shard_offset)))
		goto err;
	json_decref(valid);
	return o;
err:
	json_decref(valid);
	json_decref(o);
	return NULL;
}

/* The group of req's "group" (and optional "job"). */
static struct shardd_job *arg_group(const json_t *req, const struct shardd_group **g,
				    uint32_t *id, json_t **err)
{
	const json_t *v = json_object_get(req, "group");
	struct shardd_job *j = arg_job(req, err);

	if (*err)
		return NULL;
	if (!json_is_string(v)) {
		*err = reply_err(-SHARDD_E_INVALID, "\"group\" (a group name string) is required");
		return NULL;
	}
	return find_group(j, json_string_value(v), g, id, err);
}

static json_t *cmd_show(const json_t *req)
{
	const struct shardd_group *g;
	json_t *r, *params, *err;
	struct shardd_job *j;
	uint32_t id;

	j = arg_group(req, &g, &id, &err);
	if (!j)
		return err;
	params = json_array();
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		if (append(params, json_param(g, i))) {
			json_decref(params);
			return NULL;
		}
	}
	r = json_group(j, id, g, shardd_now_ns());
	if (put(r, "params", params) || put(r, "ok", json_true())) {
		json_decref(r);
		return NULL;
	}
	return r;
}

/* ------------------------------------------------------------------ */
/* dump                                                                */
/* ------------------------------------------------------------------ */

struct dump_stats {
	double min, max, sum, sumsq;
	uint64_t n, finite, nan, inf;
};

static void stats_add(struct dump_stats *st, const float *x, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		double v = x[i];

		st->n++;
		if (isnan(v)) {
			st->nan++;
			continue;
		}
		if (isinf(v)) {
			st->inf++;
			continue;
		}
		if (st->finite == 0 || v < st->min)
			st->min = v;
		if (st->finite == 0 || v > st->max)
			st->max = v;
		st->finite++;
		st->sum += v;
		st->sumsq += v * v;
	}
}

static json_t *json_stats(const struct dump_stats *st)
{
	json_t *o = json_object();

	if (put(o, "count", json_u64(st->n)) ||
	    put(o, "finite", json_u64(st->finite)) ||
	    put(o, "nan", json_u64(st->nan)) ||
	    put(o, "inf", json_u64(st->inf)) ||
	    put(o, "min", st->finite ? json_float(st->min) : json_null()) ||
	    put(o, "max", st->finite ? json_float(st->max) : json_null()) ||
	    put(o, "mean", st->finite ? json_float(st->sum / (double)st->finite) : json_null()) ||
	    put(o, "l2", json_float(sqrt(st->sumsq)))) {
		json_decref(o);
		return NULL;
	}
	return o;
}

/* What a dump reads: one param's elements in one buffer, seen as rows. */
struct dump_view {
	const char *what;
	const struct shardd_buf *buf;
	uint64_t offset;      /* bytes into buf */
	uint32_t dtype;
	uint64_t nrows;       /* leading-dim rows readable (padding included) */
	uint64_t valid_rows;  /* default range: rows of real data */
	uint64_t row_elems;   /* elements per row */
	json_t  *shape;       /* shape of the tensor the rows belong to */
};

static int dump_view(const struct shardd_group *g, uint32_t pi, uint32_t rank, const char *what,
		     struct dump_view *v, json_t **err)
{
	const struct shardd_param_spec *sp = &g->specs[pi];
	const struct shardd_layout_param *lp = &g->layout.params[pi];
	uint64_t shape[SHARDD_MAX_DIMS];
	uint64_t numel;

	memset(v, 0, sizeof(*v));
	memcpy(shape, sp->shape, sizeof(shape));
	v->what = what;
	if (strcmp(what, "unsharded") == 0) {
		v->buf = shardd_group_unsharded(g, rank);
		v->offset = lp->unsharded_offset;
		v->dtype = lp->unsharded_dtype;
		numel = lp->numel;
	} else if (strcmp(what, "param") == 0 || strcmp(what, "grad") == 0) {
		v->buf = what[0] == 'p' ? &g->shards[rank] : &g->sharded_grads[rank];
		v->offset = lp->shard_offset;
		v->dtype = lp->dtype;
		numel = lp->shard_numel;
		if (sp->ndim)
			shape[lp->shard_dim] = lp->rows;
	} else {
		*err = reply_err(-SHARDD_E_INVALID,
				 "\"what\" = '%s': one of param (the rank's shard), grad (its sharded "
				 "grad), unsharded (the unsharded copy it reads)", what);
		return -1;
	}
	v->nrows = sp->ndim ? shape[0] : 1;
	v->row_elems = v->nrows ? numel / v->nrows : 0;
	v->valid_rows = v->nrows;
	if (what[0] != 'u' && lp->shard_dim == 0 && sp->ndim)
		v->valid_rows = shardd_layout_rows_valid(lp, rank % g->shard);
	v->shape = json_array();
	for (uint32_t d = 0; d < sp->ndim; d++)
		append(v->shape, json_u64(shape[d]));
	if (!v->shape || json_array_size(v->shape) != sp->ndim) {
		json_decref(v->shape);
		v->shape = NULL;
		return -ENOMEM;
	}
	return 0;
}

/* Read rows [a, b) of `v`: statistics over all of them, the first `limit` values into `vals`. */
static int dump_read(const struct dump_view *v, uint64_t a, uint64_t b, uint64_t limit,
		     struct dump_stats *st, json_t *vals, json_t **err)
{
	size_t esz = shardd_dtype_size(v->dtype);
	uint8_t raw[SHARDD_K_BLOCK * 4];
	float f[SHARDD_K_BLOCK];
	uint64_t first = a * v->row_elems, n = (b - a) * v->row_elems, done = 0;

	if (!shardd_buf_allocated(v->buf)) {
		*err = reply_err(-SHARDD_E_STATE, "the %s buffer is not allocated yet: every rank must "
				 "register the group first", v->what);
		return -1;
	}
	if (v->buf->fd < 0) {
		*err = reply_err(-SHARDD_E_BACKEND, "the %s buffer has no fd to read: the %s backend "
				 "exports it as a CUDA IPC handle (dump reads host-readable buffers)",
				 v->what, shardd_backend_name(server.cfg.backend));
		return -1;
	}
	while (done < n) {
		size_t k = n - done < SHARDD_K_BLOCK ? (size_t)(n - done) : SHARDD_K_BLOCK;
		uint64_t off = v->offset + (first + done) * esz;
		ssize_t got = pread(v->buf->fd, raw, k * esz, (off_t)off);

		if (got != (ssize_t)(k * esz)) {
			*err = reply_err(got < 0 ? -errno : -SHARDD_E_BACKEND,
					 "cannot read the %s buffer at byte %" PRIu64 ": %s (a %s "
					 "backend buffer is read through its fd)", v->what, off,
					 got < 0 ? strerror(errno) : "short read",
					 shardd_backend_name(server.cfg.backend));
			return -1;
		}
		shardd_k_to_f32(f, raw, v->dtype, k);
		stats_add(st, f, k);
		for (size_t i = 0; i < k && done + i < limit; i++)
			if (append(vals, json_float(f[i])))
				return -ENOMEM;
		done += k;
	}
	return 0;
}

static int arg_u64(const json_t *req, const char *key, uint64_t def, uint64_t *out, json_t **err)
{
	const json_t *v = json_object_get(req, key);

	*out = def;
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_integer(v) || json_integer_value(v) < 0) {
		*err = reply_err(-SHARDD_E_INVALID, "\"%s\" must be a non-negative integer", key);
		return -1;
	}
	*out = (uint64_t)json_integer_value(v);
	return 0;
}

static json_t *cmd_dump(const json_t *req)
{
	const struct shardd_group *g;
	const json_t *pv = json_object_get(req, "param"), *wv = json_object_get(req, "what");
	const json_t *rows = json_object_get(req, "rows");
	struct dump_stats st = { 0 };
	struct dump_view v = { 0 };
	uint64_t rank, limit, a, b;
	json_t *r = NULL, *vals = NULL, *err = NULL;
	const char *what = "param", *pname;
	struct shardd_job *j;
	uint32_t id, pi;
	char names[NAMES_MAX];
	size_t n = 0;

	j = arg_group(req, &g, &id, &err);
	if (!j)
		return err;
	if (!json_is_string(pv))
		return reply_err(-SHARDD_E_INVALID, "\"param\" (a param name string) is required");
	pname = json_string_value(pv);
	for (pi = 0; pi < g->hdr.nparams; pi++)
		if (strcmp(g->specs[pi].name, pname) == 0)
			break;
	if (pi == g->hdr.nparams) {
		names[0] = 0;
		for (uint32_t i = 0; i < g->hdr.nparams && n < sizeof(names); i++)
			n += (size_t)snprintf(names + n, sizeof(names) - n, "%s'%s'", i ? ", " : "",
					      g->specs[i].name);
		return reply_err(-SHARDD_E_INVALID, "group '%s' has no param '%s'; params: %s",
				 g->name, pname, names);
	}
	if (wv && !json_is_null(wv)) {
		if (!json_is_string(wv))
			return reply_err(-SHARDD_E_INVALID, "\"what\" must be a string");
		what = json_string_value(wv);
	}
	if (arg_u64(req, "rank", 0, &rank, &err) ||
	    arg_u64(req, "limit", SHARDD_ADMIN_DUMP_LIMIT_DEFAULT, &limit, &err))
		return err;
	if (rank >= g->world)
		return reply_err(-SHARDD_E_INVALID, "\"rank\" = %" PRIu64 ": job '%s' has ranks 0..%u",
				 rank, j->name, g->world - 1);
	if (limit > SHARDD_ADMIN_DUMP_LIMIT_MAX)
		return reply_err(-SHARDD_E_INVALID, "\"limit\" = %" PRIu64 ": at most %d values",
				 limit, SHARDD_ADMIN_DUMP_LIMIT_MAX);
	if (!g->allocated)
		return reply_err(-SHARDD_E_STATE, "group '%s' has no buffers yet: not every rank has "
				 "registered it", g->name);
	if (dump_view(g, pi, (uint32_t)rank, what, &v, &err))
		return err;
	a = 0;
	b = v.valid_rows;
	if (rows && !json_is_null(rows)) {
		if (!json_is_array(rows) || json_array_size(rows) != 2 ||
		    !json_is_integer(json_array_get(rows, 0)) ||
		    !json_is_integer(json_array_get(rows, 1)) ||
		    json_integer_value(json_array_get(rows, 0)) < 0 ||
		    json_integer_value(json_array_get(rows, 1)) < 0) {
			err = reply_err(-SHARDD_E_INVALID, "\"rows\" must be [first, end] (integers)");
			goto out;
		}
		a = (uint64_t)json_integer_value(json_array_get(rows, 0));
		b = (uint64_t)json_integer_value(json_array_get(rows, 1));
		if (a > b || b > v.nrows) {
			err = reply_err(-SHARDD_E_INVALID, "\"rows\" = %" PRIu64 ":%" PRIu64 ": the %s of "
					"'%s' has rows 0:%" PRIu64 " (A <= B)", a, b, what, pname,
					v.nrows);
			goto out;
		}
	}
	vals = json_array();
	if (!vals || dump_read(&v, a, b, limit, &st, vals, &err))
		goto out;
	r = reply_ok();
	if (put(r, "job", json_string(j->name)) ||
	    put(r, "group", json_name(g->name)) ||
	    put(r, "param", json_string(pname)) ||
	    put(r, "rank", json_u64(rank)) ||
	    put(r, "what", json_string(what)) ||
	    put(r, "dtype", json_dtype(v.dtype)) ||
	    put(r, "shape", json_incref(v.shape)) ||
	    put(r, "rows", json_pack("[I, I]", (json_int_t)a, (json_int_t)b)) ||
	    put(r, "row_elems", json_u64(v.row_elems)) ||
	    put(r, "grad_present", json_boolean(what[0] != 'g' || !g->grad_present ||
						__atomic_load_n(&g->grad_present[rank],
								__ATOMIC_RELAXED))) ||
	    put(r, "stats", json_stats(&st)) ||
	    put(r, "values", json_incref(vals)) ||
	    put(r, "truncated", json_boolean(st.n > limit))) {
		json_decref(r);
		r = NULL;
	}
out:
	json_decref(vals);
	json_decref(v.shape);
	return err ? err : r;
}

/* ------------------------------------------------------------------ */
/* stats, metrics                                                      */
/* ------------------------------------------------------------------ */

static json_t *cmd_stats(const json_t *req)
{
	json_t *r = reply_ok(), *arr = json_array();

	(void)req;
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++) {
		const struct shardd_op_metrics *m = &shardd_op_metrics[op];

		if (append(arr, json_pack("{s:s, s:I, s:I, s:I, s:f, s:f, s:f, s:f}",
					  "op", shardd_op_name(op),
					  "count", (json_int_t)m->count,
					  "failed", (json_int_t)m->failed,
					  "bytes", (json_int_t)m->bytes,
					  "mean_us", m->count ? (double)m->lat_sum_ns / m->count / 1e3 : 0.0,
					  "p50_us", shardd_metrics_quantile(m, 0.50) / 1e3,
					  "p99_us", shardd_metrics_quantile(m, 0.99) / 1e3,
					  "max_us", m->lat_max_ns / 1e3))) {
			json_decref(arr);
			json_decref(r);
			return NULL;
		}
	}
	if (put(r, "latency", json_string("SQE taken to completion pushed, in a log2 histogram; "
					  "p50/p99 are the upper edge of their bucket")) ||
	    put(r, "ops", arr)) {
		json_decref(r);
		return NULL;
	}
	return r;
}

static json_t *cmd_metrics(const json_t *req)
{
	char *text = shardd_metrics_render();
	json_t *r;

	(void)req;
	if (!text)
		return NULL;
	r = reply_ok();
	if (put(r, "text", json_string(text))) {
		json_decref(r);
		r = NULL;
	}
	free(text);
	return r;
}

/* ------------------------------------------------------------------ */
/* end: the one command that changes the daemon                        */
/* ------------------------------------------------------------------ */

static json_t *cmd_end(const json_t *req)
{
	const json_t *v = json_object_get(req, "job");
	char name[SHARDD_NAME_MAX], why[160], names[NAMES_MAX];
	struct shardd_job *j;
	uint32_t nattached;
	uint64_t bytes;

	if (!json_is_string(v)) {
		job_names(names, sizeof(names));
		return reply_err(-SHARDD_E_INVALID, "end: \"job\" must name the job to end; jobs: %s",
				 server.jobs ? names : "none");
	}
	j = shardd_job_find(json_string_value(v));
	if (!j)
		return no_job(json_string_value(v));
	snprintf(name, sizeof(name), "%s", j->name);
	nattached = j->nattached;
	if (admin_peer_pid > 0)
		snprintf(why, sizeof(why), "was ended by an admin request (shardctl end from pid %d)",
			 (int)admin_peer_pid);
	else
		snprintf(why, sizeof(why), "was ended by an admin request (shardctl end)");
	bytes = shardd_job_end(j, why);
	return json_pack("{s:b, s:s, s:i, s:I}", "ok", 1, "job", name, "ranks_attached",
			 (int)nattached, "memory_freed", (json_int_t)bytes);
}

/* ------------------------------------------------------------------ */
/* Dispatch                                                            */
/* ------------------------------------------------------------------ */

static const struct {
	const char *name;
	json_t *(*fn)(const json_t *req);
} commands[] = {
	{ "status", cmd_status },
	{ "jobs", cmd_jobs },
	{ "ranks", cmd_ranks },
	{ "groups", cmd_groups },
	{ "show", cmd_show },
	{ "dump", cmd_dump },
	{ "stats", cmd_stats },
	{ "metrics", cmd_metrics },
	{ "end", cmd_end },
};

json_t *shardd_admin_exec(const void *payload, size_t len, uid_t peer_uid)
{
	json_error_t jerr;
	const char *cmd;
	json_t *req, *r = NULL;

	if (peer_uid != server.uid)
		return reply_err(-SHARDD_E_PERM, "admin requests need shardd's uid %u; this client "
				 "runs as uid %u (--allow-gid lets ranks attach, not inspect): run "
				 "shardctl as uid %u", (unsigned)server.uid, (unsigned)peer_uid,
				 (unsigned)server.uid);
	req = json_loadb(payload, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!req)
		return reply_err(-SHARDD_E_MALFORMED, "admin request is not JSON: %s at byte %d",
				 jerr.text, jerr.position);
	if (!json_is_object(req) || !json_is_string(json_object_get(req, "cmd"))) {
		r = reply_err(-SHARDD_E_MALFORMED, "admin request must be an object with a \"cmd\" "
			      "string");
		goto out;
	}
	cmd = json_string_value(json_object_get(req, "cmd"));
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
		if (strcmp(cmd, commands[i].name) == 0) {
			r = commands[i].fn(req);
			goto out;
		}
	}
	r = reply_err(-SHARDD_E_INVALID, "unknown admin command '%s'; commands: status, jobs, "
		      "ranks, groups, show, dump, stats, metrics, end", cmd);
out:
	json_decref(req);
	return r;
}

void shardd_admin_handle(struct shardd_session *s, uint32_t seq, const void *payload,
			 uint32_t len)
{
	char fallback[160], *text;
	const char *out;
	size_t n;
	json_t *r;

	admin_peer_pid = s->cred.pid;
	r = shardd_admin_exec(payload, len, s->cred.uid);
	admin_peer_pid = 0;
	text = r ? json_dumps(r, JSON_COMPACT) : NULL;
	n = text ? strlen(text) : 0;
	out = text;
	json_decref(r);
	if (!text || n > SHARDD_CTRL_MAX) {
		/* Built without jansson: no memory was left for the reply, or it is too big to send. */
		n = (size_t)snprintf(fallback, sizeof(fallback),
				     "{\"ok\":false,\"error\":\"%s\",\"code\":%d}",
				     text ? "reply exceeds the 64 MiB message limit: ask for fewer values"
					  : "shardd is out of memory for the reply",
				     text ? -SHARDD_E_INVALID : -SHARDD_E_NOMEM);
		out = fallback;
	}
	/* Queued when the socket is full; a client that never reads is dropped (session.h). */
	shardd_session_send(s, SHARDD_MSG_ADMIN_REPLY, seq, out, (uint32_t)n, NULL, 0);
	free(text);
}

/* SPDX-License-Identifier: MIT */
/*
 * The admin views (admin_int.h): status, jobs, ranks, groups, show,
 * stats and metrics (the text of admin_prom.c), each built from the loop's
 * own state.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "admin.h"
#include "admin_int.h"
#include "backend.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "metrics.h"
#include "op_table.h"
#include "rendezvous.h"
#include "session.h"
#include "state.h"

/* ------------------------------------------------------------------ */
/* Ops and memory                                                      */
/* ------------------------------------------------------------------ */

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

	if (admin_put(o, "op", json_op(op)) || admin_put(o, "step", admin_json_u64(step))) {
		json_decref(o);
		return NULL;
	}
	return o;
}

static json_t *json_memory(const struct shd_group_memory *m)
{
	return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "shards",
			 (json_int_t)m->shards, "sharded_grads", (json_int_t)m->sharded_grads,
			 "unsharded", (json_int_t)m->unsharded, "grads", (json_int_t)m->grads,
			 "partials", (json_int_t)m->partials, "optimizer", (json_int_t)m->optimizer,
			 "internode", (json_int_t)m->internode, "exec", (json_int_t)m->exec,
			 "total", (json_int_t)m->total);
}

/* --max-memory, --max-job-memory, and the bytes committed against them. */
static json_t *json_memory_limits(void)
{
	const struct shd_config *cfg = shd_state_config();

	return json_pack("{s:o, s:s, s:o, s:o, s:b}", "max_memory", admin_json_u64(cfg->max_memory),
			 "max_memory_from", cfg->max_memory_from, "max_job_memory",
			 admin_json_u64(cfg->max_job_memory), "committed",
			 admin_json_u64(shd_engine_memory_committed(shd_state_engine())), "counted",
			 cfg->backend == SHARDD_BACKEND_HOST);
}

/* ------------------------------------------------------------------ */
/* status, jobs                                                       */
/* ------------------------------------------------------------------ */

json_t *admin_cmd_status(const json_t *req)
{
	const struct shd_config *cfg = shd_state_config();
	const struct shd_backend_ctx *b = shd_engine_backend(shd_state_engine());
	struct shd_group_memory m;
	uint32_t njobs = 0, nattached = 0;
	json_t *r = admin_reply_ok();
	char proto[16];

	(void)req;
	shd_jobs_memory_held(&m);
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		njobs++;
		nattached += j->nattached;
	}
	snprintf(proto, sizeof(proto), "%d.%d", SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
	if (admin_put(r, "version", json_string(SHARDD_VERSION)) ||
	    admin_put(r, "protocol", json_string(proto)) ||
	    admin_put(r, "pid", json_integer(shd_state_pid())) ||
	    admin_put(r, "uid", json_integer(shd_state_uid())) ||
	    admin_put(r, "backend", json_string(b->ops->name)) ||
	    admin_put(r, "socket", json_string(cfg->socket_path)) ||
	    admin_put(r, "uptime_s", json_real(shd_state_uptime_s(shd_now_ns()))) ||
	    admin_put(r, "collective_timeout_s", json_real(cfg->collective_timeout_s)) ||
	    admin_put(r, "jobs", json_integer(njobs)) ||
	    admin_put(r, "ranks_attached", json_integer(nattached)) ||
	    admin_put(r, "connections", json_integer(shd_state_connections())) ||
	    admin_put(r, "memory", json_memory(&m)) ||
	    admin_put(r, "memory_limits", json_memory_limits()) ||
	    (b->gpu_sharing && admin_put(r, "gpu_sharing", json_string(b->gpu_sharing)))) {
		json_decref(r);
		return NULL;
	}
	return r;
}

/*
 * A job across nodes: "span": the whole mesh, the nodes, this node and its
 * global ranks (the job's replicate/shard/world are this node's part, and
 * every rank it names is global). Absent for a job on one node.
 */
static int put_span(json_t *o, const struct shd_job *j)
{
	if (!j->span_nodes)
		return 0;
	return admin_put(o, "span",
			 json_pack("{s:i, s:i, s:i, s:i, s:i, s:i}", "replicate",
				   (int)j->span_replicate, "shard", (int)j->span_shard, "nodes",
				   (int)j->span_nodes, "node", (int)j->span_node, "first_rank",
				   (int)j->rank_base, "last_rank",
				   (int)(j->rank_base + j->world - 1)));
}

/* no_ranks_s: how long the job has had no attached rank; ends_in_s: when --job-linger ends it. */
static int put_linger(json_t *o, const struct shd_job *j, uint64_t now_ns)
{
	double ends = shd_job_ends_in_s(j, now_ns);
	int orphaned = !j->nattached && j->orphaned_ns;

	return admin_put(o, "no_ranks_s",
			 orphaned ? json_real((double)(now_ns - j->orphaned_ns) / 1e9)
				  : json_null()) ||
	       admin_put(o, "ends_in_s", ends < 0 ? json_null() : json_real(ends));
}

/*
 * The reply {"jobs": [fn(j) for every job, or for `only`]}, read at one
 * `now`; NULL when out of memory.
 */
static json_t *jobs_reply(const struct shd_job *only,
			  json_t *(*fn)(const struct shd_job *, uint64_t now_ns))
{
	uint64_t now = shd_now_ns();
	json_t *r = admin_reply_ok(), *arr = json_array();

	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		if (only && j != only)
			continue;
		if (admin_append(arr, fn(j, now))) {
			json_decref(arr);
			json_decref(r);
			return NULL;
		}
	}
	if (admin_put(r, "jobs", arr)) {
		json_decref(r);
		return NULL;
	}
	return r;
}

/* One job's row of `jobs`. */
static json_t *json_job(const struct shd_job *j, uint64_t now_ns)
{
	struct shd_group_memory m = { 0 };
	json_t *o;

	shd_job_memory_held(j, &m);
	o = json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:o*, s:o, s:o}", "name", j->name,
		      "replicate", (int)j->replicate, "shard", (int)j->shard, "world",
		      (int)j->world, "attached", (int)j->nattached, "groups",
		      (int)shd_engine_job_ngroups(j->ejob), "memory", json_memory(&m),
		      "memory_committed", admin_json_u64(shd_engine_job_memory_committed(j->ejob)),
		      "memory_limit", admin_json_u64(shd_state_config()->max_job_memory));
	if (o && (put_linger(o, j, now_ns) || put_span(o, j))) {
		json_decref(o);
		return NULL;
	}
	return o;
}

/* Every job: `jobs` takes no argument. */
json_t *admin_cmd_jobs(const json_t *req)
{
	(void)req;
	return jobs_reply(NULL, json_job);
}

/* ------------------------------------------------------------------ */
/* Rendezvous in progress                                             */
/* ------------------------------------------------------------------ */

/* {"op", "group", "step", "flags", "arrived": [..], "missing": [..], "waiting_s"} */
static json_t *json_rdv(const char *what, const char *group, const struct shd_rdv *rdv,
			uint64_t now_ns)
{
	json_t *o = json_object(), *arrived = json_array(), *missing = json_array();
	uint64_t timeout_ns = shd_state_collective_timeout_ns();

	for (uint32_t i = 0; i < rdv->nexpected; i++)
		if (admin_append(rdv->arrived[i] ? arrived : missing,
				 json_integer(rdv->shown_base + rdv->ranks[i])))
			goto err;
	if (admin_put(o, "op", json_string(what)) ||
	    (group && admin_put(o, "group", admin_json_name(group))) ||
	    admin_put(o, "step", admin_json_u64(rdv->step)) ||
	    admin_put(o, "flags", json_integer(rdv->flags)) ||
	    admin_put(o, "arrived", json_incref(arrived)) ||
	    admin_put(o, "missing", json_incref(missing)))
		goto err;
	/* deadline = first arrival + timeout: how long the first rank has waited. */
	if (admin_put(o, "waiting_s",
		      json_real(rdv->deadline_ns > now_ns + timeout_ns
					? 0
					: (double)(now_ns + timeout_ns - rdv->deadline_ns) / 1e9)))
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
static json_t *job_pending(const struct shd_job *j, uint64_t now_ns)
{
	json_t *arr = json_array();
	const struct shd_rdv *barrier = &j->rdv[SHD_JOB_BARRIER];

	if (barrier->active && admin_append(arr, json_rdv("barrier", NULL, barrier, now_ns)))
		goto err;
	for (uint32_t id = 1; id <= shd_engine_job_ngroups(j->ejob); id++) {
		const struct shd_group *g = shd_engine_job_group(j->ejob, id);
		const struct shd_rdv *rdv;
		uint32_t op;

		for (uint32_t i = 0; g && shd_engine_group_pending(j->ejob, id, i, &op, &rdv) == 0;
		     i++)
			if (admin_append(arr, json_rdv(pending_what(op), g->name, rdv, now_ns)))
				goto err;
	}
	return arr;
err:
	json_decref(arr);
	return NULL;
}

/* ------------------------------------------------------------------ */
/* ranks                                                              */
/* ------------------------------------------------------------------ */

/* The rendezvous of `pending` that rank `rank` has arrived at: what it waits in. */
static json_t *rank_waiting(const json_t *pending, uint32_t rank)
{
	json_t *arr = json_array();
	size_t i;
	json_t *p;

	json_array_foreach(pending, i, p)
	{
		size_t k;
		json_t *a;

		json_array_foreach(json_object_get(p, "arrived"), k, a)
		{
			if ((uint32_t)json_integer_value(a) == rank &&
			    admin_append(arr, json_incref(p))) {
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
static uint64_t session_step(const struct shd_session *s, int *has)
{
	uint64_t step = s->clock.has_step ? s->clock.step : 0;
	uint64_t cstep;
	uint32_t cop;

	shardd_ring_client_last(&s->ring, &cop, &cstep);
	*has = s->clock.has_step;
	if (shd_op_carries_step(cop) && (!*has || cstep > step)) {
		step = cstep;
		*has = 1;
	}
	return step;
}

/*
 * The optimizer step rank `r` of job `j` is at: the highest step number the
 * daemon's optimizer applied or skipped on its shards, over the job's groups
 * that have one. A trainer numbers its unshards and reduces as it likes
 * (shardd.torch: one unshard in forward and one in backward), but a STEP is
 * numbered by the training step it applies, what a person calls the step.
 * 0 and *has = 0 when no group has the daemon's optimizer or none stepped.
 */
static uint64_t rank_optim_step(const struct shd_job *j, uint32_t r, int *has)
{
	uint64_t step = 0;

	*has = 0;
	for (uint32_t id = 1; id <= shd_engine_job_ngroups(j->ejob); id++) {
		const struct shd_group *g = shd_engine_job_group(j->ejob, id);
		uint64_t s;

		if (!g || g->optim.kind == SHARDD_OPTIM_NONE || r >= g->world)
			continue;
		/* A pool thread's step advances it while the loop thread reads. */
		s = __atomic_load_n(&g->last_step[r], __ATOMIC_RELAXED);
		if (s > step)
			step = s;
		*has = *has || s > 0;
	}
	return step;
}

static json_t *json_rank(const struct shd_job *j, uint32_t r, const json_t *pending,
			 uint64_t max_step, uint64_t now_ns)
{
	const struct shd_job_rank *jr = &j->ranks[r];
	const struct shd_session *s = shd_session_of_rank(j, r);
	json_t *o = json_object();
	struct timespec wall;

	if (admin_put(o, "rank", json_integer(j->rank_base + r)) ||
	    (j->span_nodes && (admin_put(o, "node", json_integer(j->span_node)) ||
			       admin_put(o, "local_rank", json_integer(r)))) ||
	    admin_put(o, "attached", json_boolean(s != NULL)) ||
	    admin_put(o, "pid", jr->attached_once ? json_integer(jr->pid) : json_null()) ||
	    admin_put(o, "goodbye", json_boolean(jr->goodbye)))
		goto err;
	if (!s)
		return o;
	{
		uint32_t cop;
		uint64_t cstep;
		int64_t sq_pending = shardd_sq_ready((struct shardd_ring *)&s->ring);
		double since = (double)(now_ns - s->stats.attached_ns) / 1e9;
		int has_step, has_optim;
		uint64_t step = session_step(s, &has_step);
		uint64_t optim_step = rank_optim_step(j, r, &has_optim);

		/* Written by the client: shown as-is, never trusted. */
		shardd_ring_client_last(&s->ring, &cop, &cstep);
		clock_gettime(CLOCK_REALTIME, &wall);
		if (admin_put(o, "client_id", json_integer(s->id)) ||
		    admin_put(o, "attached_s", json_real(since)) ||
		    admin_put(o, "attached_at",
			      json_real((double)wall.tv_sec + wall.tv_nsec / 1e9 - since)) ||
		    admin_put(o, "submitted", json_op_step(cop, cstep)) ||
		    admin_put(o, "taken",
			      json_op_step(s->stats.last_taken_op, s->stats.last_taken_step)) ||
		    admin_put(o, "completed", json_op_step(s->clock.done.op, s->clock.done.step)) ||
		    admin_put(o, "step", has_step ? admin_json_u64(step) : json_null()) ||
		    admin_put(o, "optim_step",
			      has_optim ? admin_json_u64(optim_step) : json_null()) ||
		    admin_put(o, "ops_taken", admin_json_u64(s->stats.ops_taken)) ||
		    admin_put(o, "ops_completed", admin_json_u64(s->stats.ops_completed)) ||
		    admin_put(o, "ops_failed", admin_json_u64(s->stats.ops_failed)) ||
		    admin_put(o, "inflight", json_integer(s->inflight)) ||
		    admin_put(o, "sq_pending",
			      sq_pending < 0 ? json_string("corrupt") : json_integer(sq_pending)) ||
		    admin_put(o, "behind", admin_json_u64(max_step > step ? max_step - step : 0)) ||
		    admin_put(o, "waiting", rank_waiting(pending, j->rank_base + r)))
			goto err;
	}
	return o;
err:
	json_decref(o);
	return NULL;
}

static json_t *json_job_ranks(const struct shd_job *j, uint64_t now_ns)
{
	json_t *o = json_object(), *arr = json_array(), *pending = job_pending(j, now_ns);
	uint64_t max_step = 0, max_optim = 0;
	int ok, has_optim = 0;

	/* "Behind" is against the rank that has submitted the furthest step. */
	for (uint32_t r = 0; r < j->world; r++) {
		const struct shd_session *s = shd_session_of_rank(j, r);
		int has;
		uint64_t optim = rank_optim_step(j, r, &has);

		if (has && optim > max_optim)
			max_optim = optim;
		has_optim = has_optim || has;
		if (s) {
			uint64_t step = session_step(s, &has);

			if (step > max_step)
				max_step = step;
		}
	}
	ok = pending != NULL;
	for (uint32_t r = 0; ok && r < j->world; r++)
		ok = admin_append(arr, json_rank(j, r, pending, max_step, now_ns)) == 0;
	if (!ok || admin_put(o, "name", json_string(j->name)) ||
	    admin_put(o, "replicate", json_integer(j->replicate)) ||
	    admin_put(o, "shard", json_integer(j->shard)) ||
	    admin_put(o, "world", json_integer(j->world)) ||
	    admin_put(o, "attached", json_integer(j->nattached)) ||
	    admin_put(o, "max_step", admin_json_u64(max_step)) ||
	    admin_put(o, "max_optim_step", has_optim ? admin_json_u64(max_optim) : json_null()) ||
	    admin_put(o, "ranks", json_incref(arr)) ||
	    admin_put(o, "pending", json_incref(pending)) || put_span(o, j)) {
		json_decref(o);
		o = NULL;
	}
	json_decref(arr);
	json_decref(pending);
	return o;
}

/* ------------------------------------------------------------------ */
/* groups, show                                                       */
/* ------------------------------------------------------------------ */

/*
 * A rank-executed group's ranks as their slots say: the ops each ran, and
 * the one it waits in (which rank it waits for, since when): how a stuck
 * collective is named without the daemon in its path.
 */
static json_t *json_exec_ranks(const struct shd_job *j, uint32_t id, const struct shd_group *g,
			       uint64_t now_ns)
{
	json_t *arr = json_array();
	struct shd_engine_exec_rank er;

	for (uint32_t r = 0; arr && r < g->world; r++) {
		json_t *o;

		if (shd_engine_exec_rank(j->ejob, id, r, &er))
			continue;
		o = json_pack("{s:I, s:b, s:I, s:I, s:I, s:b}", "rank",
			      (json_int_t)(j->rank_base + r), "published", er.gen != 0, "unshards",
			      (json_int_t)er.unshards, "reduces", (json_int_t)er.reduces,
			      "reshards", (json_int_t)er.reshards, "grad_present", er.grad_present);
		if (o && er.wait_op &&
		    admin_put(o, "waiting",
			      json_pack("{s:s, s:I, s:f}", "op", shardd_op_name(er.wait_op),
					"for_rank", (json_int_t)(er.wait_peer - 1), "for_s",
					now_ns > er.wait_since_ns
						? (double)(now_ns - er.wait_since_ns) / 1e9
						: 0.0))) {
			json_decref(o);
			o = NULL;
		}
		if (admin_append(arr, o)) {
			json_decref(arr);
			return NULL;
		}
	}
	return arr;
}

static json_t *json_group(const struct shd_job *j, uint32_t id, const struct shd_group *g,
			  uint64_t now_ns)
{
	json_t *o = json_object(), *holders = json_array(), *partials = json_array();
	json_t *pending = json_array(), *bytes = NULL;
	struct shd_group_memory m = { 0 };
	const struct shd_rdv *rdv;
	uint32_t op;

	shd_group_memory_held(g, &m);
	for (uint32_t r = 0; r < g->world; r++) {
		if (g->holds && g->holds[r] &&
		    admin_append(holders, json_integer(j->rank_base + r)))
			goto err;
		/* Written by pool threads: a snapshot. */
		if (g->partial_present &&
		    __atomic_load_n(&g->partial_present[r], __ATOMIC_RELAXED) &&
		    admin_append(partials, json_integer(j->rank_base + r)))
			goto err;
	}
	for (uint32_t i = 0; shd_engine_group_pending(j->ejob, id, i, &op, &rdv) == 0; i++)
		if (admin_append(pending, json_rdv(pending_what(op), g->name, rdv, now_ns)))
			goto err;
	bytes = json_pack("{s:I, s:I, s:I}", "unsharded", (json_int_t)g->layout.unsharded_size,
			  "grad", (json_int_t)g->layout.grad_size, "shard",
			  (json_int_t)g->layout.shard_size);
	if (admin_put(o, "id", json_integer(id)) ||
	    admin_put(o, "name", admin_json_name(g->name)) ||
	    admin_put(o, "job", json_string(j->name)) ||
	    admin_put(o, "nparams", json_integer(g->hdr.nparams)) ||
	    admin_put(o, "complete", json_boolean(shd_engine_group_complete(j->ejob, id))) ||
	    admin_put(o, "param_dtype", admin_json_dtype(g->hdr.param_dtype)) ||
	    admin_put(o, "reduce_dtype", admin_json_dtype(g->reduce_dtype)) ||
	    admin_put(o, "grad_dtype", admin_json_dtype(g->grad_dtype)) ||
	    admin_put(o, "shard_world", json_integer(g->shard)) || admin_put(o, "bytes", bytes) ||
	    admin_put(o, "memory", json_memory(&m)) ||
	    admin_put(o, "unsharded_refcount",
		      json_integer((json_int_t)json_array_size(holders))) ||
	    admin_put(o, "unsharded_holders", json_incref(holders)) ||
	    admin_put(o, "partials_present", json_incref(partials)) ||
	    admin_put(o, "pending", json_incref(pending)) ||
	    admin_put(o, "exec", json_string(shardd_exec_name(g->exec))) ||
	    admin_put(o, "exec_why", json_string(g->exec_why)) ||
	    (g->exec == SHARDD_EXEC_RANKS &&
	     admin_put(o, "exec_ranks", json_exec_ranks(j, id, g, now_ns))))
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
static json_t *per_job(const json_t *req, json_t *(*fn)(const struct shd_job *, uint64_t))
{
	json_t *err;
	struct shd_job *only = admin_arg_job(req, &err);

	return err ? err : jobs_reply(only, fn);
}

static json_t *json_job_groups(const struct shd_job *j, uint64_t now_ns)
{
	json_t *arr = json_array();

	for (uint32_t id = 1; id <= shd_engine_job_ngroups(j->ejob); id++) {
		const struct shd_group *g = shd_engine_job_group(j->ejob, id);

		if (g && admin_append(arr, json_group(j, id, g, now_ns))) {
			json_decref(arr);
			return NULL;
		}
	}
	return json_pack("{s:s, s:i, s:i, s:o}", "name", j->name, "replicate", (int)j->replicate,
			 "shard", (int)j->shard, "groups", arr);
}

json_t *admin_cmd_ranks(const json_t *req)
{
	return per_job(req, json_job_ranks);
}

json_t *admin_cmd_groups(const json_t *req)
{
	return per_job(req, json_job_groups);
}

static json_t *json_shape(const struct shardd_param_spec *sp)
{
	json_t *a = json_array();

	for (uint32_t d = 0; d < sp->ndim && d < SHARDD_MAX_DIMS; d++)
		if (admin_append(a, admin_json_u64(sp->shape[d]))) {
			json_decref(a);
			return NULL;
		}
	return a;
}

static json_t *json_param(const struct shd_group *g, uint32_t i)
{
	const struct shardd_param_spec *sp = &g->specs[i];
	const struct shd_layout_param *lp = &g->layout.params[i];
	json_t *o = json_object(), *valid = json_array();

	for (uint32_t r = 0; r < g->shard; r++)
		if (admin_append(valid, admin_json_u64(shd_layout_rows_valid(
						lp, shd_group_shard_rank(g, r)))))
			goto err;
	if (admin_put(o, "index", json_integer(i)) ||
	    admin_put(o, "name", admin_json_name(sp->name)) ||
	    admin_put(o, "dtype", admin_json_dtype(lp->dtype)) ||
	    admin_put(o, "unsharded_dtype", admin_json_dtype(lp->unsharded_dtype)) ||
	    admin_put(o, "grad_dtype", admin_json_dtype(lp->grad_dtype)) ||
	    admin_put(o, "shape", json_shape(sp)) ||
	    admin_put(o, "shard_dim", json_integer(lp->shard_dim)) ||
	    admin_put(o, "numel", admin_json_u64(lp->numel)) ||
	    admin_put(o, "shard_rows", admin_json_u64(lp->rows)) ||
	    admin_put(o, "shard_numel", admin_json_u64(lp->shard_numel)) ||
	    admin_put(o, "rows_valid", json_incref(valid)) ||
	    admin_put(o, "unsharded_offset", admin_json_u64(lp->unsharded_offset)) ||
	    admin_put(o, "grad_offset", admin_json_u64(lp->grad_offset)) ||
	    admin_put(o, "shard_offset", admin_json_u64(lp->shard_offset)))
		goto err;
	json_decref(valid);
	return o;
err:
	json_decref(valid);
	json_decref(o);
	return NULL;
}

json_t *admin_cmd_show(const json_t *req)
{
	const struct shd_group *g;
	json_t *r, *params, *err;
	struct shd_job *j;
	uint32_t id;

	j = admin_arg_group(req, &g, &id, &err);
	if (!j)
		return err;
	params = json_array();
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		if (admin_append(params, json_param(g, i))) {
			json_decref(params);
			return NULL;
		}
	}
	r = json_group(j, id, g, shd_now_ns());
	if (admin_put(r, "params", params) || admin_put(r, "ok", json_true())) {
		json_decref(r);
		return NULL;
	}
	return r;
}

/* ------------------------------------------------------------------ */
/* stats, metrics                                                     */
/* ------------------------------------------------------------------ */

json_t *admin_cmd_stats(const json_t *req)
{
	json_t *r = admin_reply_ok(), *arr = json_array();
	uint64_t exec[3] = { 0, 0, 0 };

	(void)req;
	for (struct shd_job *j = shd_state_jobs(); j; j = j->next) {
		uint64_t c[3];

		admin_exec_counts(j, c);
		for (int k = 0; k < 3; k++)
			exec[k] += c[k];
	}
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++) {
		const struct shd_op_metrics *m = &shd_op_metrics[op];

		if (admin_append(arr,
				 json_pack("{s:s, s:I, s:I, s:I, s:f, s:f, s:f, s:f}", "op",
					   shardd_op_name(op), "count", (json_int_t)m->count,
					   "failed", (json_int_t)m->failed, "bytes",
					   (json_int_t)m->bytes, "mean_us",
					   m->count ? (double)m->lat_sum_ns / m->count / 1e3 : 0.0,
					   "p50_us", shd_metrics_quantile(m, 0.50) / 1e3, "p99_us",
					   shd_metrics_quantile(m, 0.99) / 1e3, "max_us",
					   m->lat_max_ns / 1e3))) {
			json_decref(arr);
			json_decref(r);
			return NULL;
		}
	}
	if (admin_put(r, "latency",
		      json_string("SQE taken to completion pushed, in a log2 histogram; "
				  "p50/p99 are the upper edge of their bucket")) ||
	    admin_put(r, "ops", arr) ||
	    admin_put(r, "rank_executed",
		      json_pack("{s:I, s:I, s:I}", "unshard", (json_int_t)exec[0], "reduce",
				(json_int_t)exec[1], "reshard", (json_int_t)exec[2]))) {
		json_decref(r);
		return NULL;
	}
	return r;
}

json_t *admin_cmd_metrics(const json_t *req)
{
	char *text = shd_admin_metrics_render();
	json_t *r;

	(void)req;
	if (!text)
		return NULL;
	r = admin_reply_ok();
	if (admin_put(r, "text", json_string(text))) {
		json_decref(r);
		r = NULL;
	}
	free(text);
	return r;
}

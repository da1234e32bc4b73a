/* SPDX-License-Identifier: MIT */
/*
 * shardctl dump (admin_int.h): one param's values in one buffer of one
 * rank, read through the backend table's `read` (backend.h) wherever the
 * buffer lives, with statistics over the rows asked for. A racy snapshot:
 * ops may be writing the buffer meanwhile (admin.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "admin.h"
#include "admin_int.h"
#include "backend.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "shardd_kernels.h"
#include "state.h"

/* A float in JSON: a number when finite, else "nan", "inf" or "-inf". */
static json_t *json_float(double v)
{
	if (isnan(v))
		return json_string("nan");
	if (isinf(v))
		return json_string(v > 0 ? "inf" : "-inf");
	return json_real(v);
}

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

	if (admin_put(o, "count", admin_json_u64(st->n)) ||
	    admin_put(o, "finite", admin_json_u64(st->finite)) ||
	    admin_put(o, "nan", admin_json_u64(st->nan)) ||
	    admin_put(o, "inf", admin_json_u64(st->inf)) ||
	    admin_put(o, "min", st->finite ? json_float(st->min) : json_null()) ||
	    admin_put(o, "max", st->finite ? json_float(st->max) : json_null()) ||
	    admin_put(o, "mean",
		      st->finite ? json_float(st->sum / (double)st->finite) : json_null()) ||
	    admin_put(o, "l2", json_float(sqrt(st->sumsq)))) {
		json_decref(o);
		return NULL;
	}
	return o;
}

/* What a dump reads: one param's elements in one buffer, seen as rows. */
struct dump_view {
	const char *what;
	const struct shd_buf *buf;
	uint64_t offset; /* bytes into buf */
	uint32_t dtype;
	uint64_t nrows;      /* leading-dim rows readable (padding included) */
	uint64_t valid_rows; /* default range: rows of real data */
	uint64_t row_elems;  /* elements per row */
	json_t *shape;       /* shape of the tensor the rows belong to */
};

/* Which optimizer state buffer `what` names (momentum, exp_avg, ...): its index, or -ENOENT. */
static int dump_optim_state(const struct shd_group *g, const char *what)
{
	for (uint32_t k = 0; k < shd_group_optim_states(&g->optim); k++)
		if (strcmp(what, shd_group_optim_state_name(&g->optim, k)) == 0)
			return (int)k;
	return -ENOENT;
}

/*
 * The buffer, offset and shape that `what` of param pi names on `rank`. 0;
 * -SHARDD_E_INVALID with *err (an unknown `what`); -ENOMEM.
 */
static int dump_view(const struct shd_group *g, uint32_t pi, uint32_t rank, const char *what,
		     struct dump_view *v, json_t **err)
{
	const struct shardd_param_spec *sp = &g->specs[pi];
	const struct shd_layout_param *lp = &g->layout.params[pi];
	uint64_t shape[SHARDD_MAX_DIMS];
	uint64_t numel;

	memset(v, 0, sizeof(*v));
	memcpy(shape, sp->shape, sizeof(shape));
	v->what = what;
	if (strcmp(what, "unsharded") == 0) {
		v->buf = shd_group_unsharded(g, rank);
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
	} else if (dump_optim_state(g, what) >= 0) {
		v->buf = &g->optim_state[dump_optim_state(g, what)][rank];
		v->offset = lp->shard_offset;
		v->dtype = SHARDD_DTYPE_FP32;
		numel = lp->shard_numel;
		if (sp->ndim)
			shape[lp->shard_dim] = lp->rows;
	} else {
		*err = admin_reply_err(
			-SHARDD_E_INVALID,
			"\"what\" = '%s': one of param (the rank's shard), grad (its "
			"sharded grad), unsharded (the unsharded copy it reads), or a state of "
			"the group's optimizer (%s: %s)",
			what,
			g->optim.kind == SHARDD_OPTIM_SGD     ? "sgd"
			: g->optim.kind == SHARDD_OPTIM_ADAMW ? "adamw"
							      : "none",
			g->optim.kind == SHARDD_OPTIM_SGD
				? (g->optim.momentum != 0 ? "momentum"
							  : "no state without momentum")
			: g->optim.kind == SHARDD_OPTIM_ADAMW
				? ((g->optim.flags & SHARDD_OPTIM_AMSGRAD)
					   ? "exp_avg, exp_avg_sq, max_exp_avg_sq"
					   : "exp_avg, exp_avg_sq")
				: "no state");
		return -SHARDD_E_INVALID;
	}
	v->nrows = sp->ndim ? shape[0] : 1;
	v->row_elems = v->nrows ? numel / v->nrows : 0;
	v->valid_rows = v->nrows;
	if (what[0] != 'u' && lp->shard_dim == 0 && sp->ndim)
		v->valid_rows = shd_layout_rows_valid(lp, shd_group_shard_rank(g, rank));
	v->shape = json_array();
	for (uint32_t d = 0; d < sp->ndim; d++)
		admin_append(v->shape, admin_json_u64(shape[d]));
	if (!v->shape || json_array_size(v->shape) != sp->ndim) {
		json_decref(v->shape);
		v->shape = NULL;
		return -ENOMEM;
	}
	return 0;
}

/*
 * Read rows [a, end) of `v`: statistics over all of them, the first `limit`
 * values into `vals`. 0; -SHARDD_E_STATE or the backend's negative code with
 * *err; -ENOMEM.
 */
/*
 * Whether a dump of `what` shows a present value: the sharded grad only
 * after a reduce (the daemon's flag, or a rank-executed group's slot).
 */
static int dump_grad_present(const struct shd_engine_job *ej, const struct shd_group *g,
			     const char *what, uint32_t rank)
{
	struct shd_engine_exec_rank er;

	if (what[0] != 'g' || !g->grad_present)
		return 1;
	if (g->exec == SHARDD_EXEC_RANKS)
		return !shd_engine_exec_rank(ej, g->id, rank, &er) && er.grad_present;
	return __atomic_load_n(&g->grad_present[rank], __ATOMIC_RELAXED);
}

static int dump_read(const struct dump_view *v, uint64_t a, uint64_t end, uint64_t limit,
		     struct dump_stats *st, json_t *vals, json_t **err)
{
	size_t esz = shardd_dtype_size(v->dtype);
	uint8_t raw[SHARDD_K_BLOCK * 4];
	float f[SHARDD_K_BLOCK];
	uint64_t first = a * v->row_elems, n = (end - a) * v->row_elems, done = 0;
	struct shd_backend_ctx *b = shd_engine_backend(shd_state_engine());

	if (!shd_buf_allocated(v->buf)) {
		*err = admin_reply_err(-SHARDD_E_STATE,
				       "the %s buffer is not allocated yet: every "
				       "rank must register the group first",
				       v->what);
		return -SHARDD_E_STATE;
	}
	while (done < n) {
		size_t k = n - done < SHARDD_K_BLOCK ? (size_t)(n - done) : SHARDD_K_BLOCK;
		uint64_t off = v->offset + (first + done) * esz;
		int ret = b->ops->read(b, v->buf, off, k * esz, raw);

		if (ret) {
			*err = admin_reply_err(ret,
					       "cannot read the %s buffer at byte %" PRIu64 ": %s "
					       "(%s backend)",
					       v->what, off,
					       ret > -SHARDD_E_BASE
						       ? strerror(-ret)
						       : "the backend failed: see shardd's log",
					       b->ops->name);
			return ret;
		}
		shardd_k_to_f32(f, raw, v->dtype, k);
		stats_add(st, f, k);
		for (size_t i = 0; i < k && done + i < limit; i++)
			if (admin_append(vals, json_float(f[i])))
				return -ENOMEM;
		done += k;
	}
	return 0;
}

json_t *admin_cmd_dump(const json_t *req)
{
	const struct shd_group *g;
	const json_t *pv = json_object_get(req, "param"), *wv = json_object_get(req, "what");
	const json_t *rows = json_object_get(req, "rows");
	struct dump_stats st = { 0 };
	struct dump_view v = { 0 };
	uint64_t rank, limit, a, b;
	json_t *r = NULL, *vals = NULL, *err = NULL;
	const char *what = "param", *pname;
	struct shd_job *j;
	uint32_t id, pi;
	char names[ADMIN_NAMES_MAX];
	size_t n = 0;

	j = admin_arg_group(req, &g, &id, &err);
	if (!j)
		return err;
	if (!json_is_string(pv))
		return admin_reply_err(-SHARDD_E_INVALID,
				       "\"param\" (a param name string) is required");
	pname = json_string_value(pv);
	for (pi = 0; pi < g->hdr.nparams; pi++)
		if (strcmp(g->specs[pi].name, pname) == 0)
			break;
	if (pi == g->hdr.nparams) {
		names[0] = 0;
		for (uint32_t i = 0; i < g->hdr.nparams && n < sizeof(names); i++)
			n += (size_t)snprintf(names + n, sizeof(names) - n, "%s'%s'", i ? ", " : "",
					      g->specs[i].name);
		return admin_reply_err(-SHARDD_E_INVALID,
				       "group '%s' has no param '%s'; params: %s", g->name, pname,
				       names);
	}
	if (wv && !json_is_null(wv)) {
		if (!json_is_string(wv))
			return admin_reply_err(-SHARDD_E_INVALID, "\"what\" must be a string");
		what = json_string_value(wv);
	}
	if (admin_arg_u64(req, "rank", 0, &rank, &err) ||
	    admin_arg_u64(req, "limit", SHD_ADMIN_DUMP_LIMIT_DEFAULT, &limit, &err))
		return err;
	if (rank >= g->world)
		return admin_reply_err(-SHARDD_E_INVALID,
				       "\"rank\" = %" PRIu64 ": job '%s' has ranks 0..%u", rank,
				       j->name, g->world - 1);
	if (limit > SHD_ADMIN_DUMP_LIMIT_MAX)
		return admin_reply_err(-SHARDD_E_INVALID,
				       "\"limit\" = %" PRIu64 ": at most %d values", limit,
				       SHD_ADMIN_DUMP_LIMIT_MAX);
	if (!g->allocated)
		return admin_reply_err(-SHARDD_E_STATE,
				       "group '%s' has no buffers yet: not every "
				       "rank has registered it",
				       g->name);
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
			err = admin_reply_err(-SHARDD_E_INVALID,
					      "\"rows\" must be [first, end] (integers)");
			goto out;
		}
		a = (uint64_t)json_integer_value(json_array_get(rows, 0));
		b = (uint64_t)json_integer_value(json_array_get(rows, 1));
		if (a > b || b > v.nrows) {
			err = admin_reply_err(-SHARDD_E_INVALID,
					      "\"rows\" = %" PRIu64 ":%" PRIu64
					      ": the %s of '%s' has rows 0:%" PRIu64 " (A <= B)",
					      a, b, what, pname, v.nrows);
			goto out;
		}
	}
	vals = json_array();
	if (!vals || dump_read(&v, a, b, limit, &st, vals, &err))
		goto out;
	r = admin_reply_ok();
	if (admin_put(r, "job", json_string(j->name)) ||
	    admin_put(r, "group", admin_json_name(g->name)) ||
	    admin_put(r, "param", json_string(pname)) ||
	    admin_put(r, "rank", admin_json_u64(rank)) || admin_put(r, "what", json_string(what)) ||
	    admin_put(r, "dtype", admin_json_dtype(v.dtype)) ||
	    admin_put(r, "shape", json_incref(v.shape)) ||
	    admin_put(r, "rows", json_pack("[I, I]", (json_int_t)a, (json_int_t)b)) ||
	    admin_put(r, "row_elems", admin_json_u64(v.row_elems)) ||
	    admin_put(r, "grad_present", json_boolean(dump_grad_present(j->ejob, g, what, rank))) ||
	    admin_put(r, "stats", json_stats(&st)) || admin_put(r, "values", json_incref(vals)) ||
	    admin_put(r, "truncated", json_boolean(st.n > limit))) {
		json_decref(r);
		r = NULL;
	}
out:
	json_decref(vals);
	json_decref(v.shape);
	return err ? err : r;
}

/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "group.h"
#include "step.h"

__attribute__((format(printf, 4, 5))) static int group_error(int code, char *err, size_t errlen,
							     const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return code;
}

static const char *dtype_str(uint32_t dtype)
{
	const char *n = shardd_dtype_name(dtype);

	return n ? n : "unknown";
}

static const char *optim_str(uint32_t kind)
{
	switch (kind) {
	case SHARDD_OPTIM_NONE:
		return "none";
	case SHARDD_OPTIM_SGD:
		return "sgd";
	case SHARDD_OPTIM_ADAMW:
		return "adamw";
	default:
		return "unknown";
	}
}

/* A double field of the config that must lie in [lo, hi) (hi_open) or [lo, hi]. */
static int optim_range(const char *group, const char *opt, const char *field, double v, double lo,
		       double hi, int hi_open, char *err, size_t errlen)
{
	if (v == v && v >= lo && (hi_open ? v < hi : v <= hi))
		return 0;
	return group_error(-SHARDD_E_INVALID, err, errlen,
			   "register group '%s': optimizer %s: %s = %g must lie in [%g, %g%s",
			   group, opt, field, v, lo, hi, hi_open ? ")" : "]");
}

static int optim_zero(const char *group, const char *opt, const char *field, double v, char *err,
		      size_t errlen)
{
	if (v == 0)
		return 0;
	return group_error(
		-SHARDD_E_INVALID, err, errlen,
		"register group '%s': optimizer %s: %s = %g is not one of its hyperparameters; "
		"leave it 0",
		group, opt, field, v);
}

int shd_group_optim_check(const char *group, const struct shardd_optim_config *o, char *err,
			  size_t errlen)
{
	const char *n = optim_str(o->kind);
	uint32_t bad_flags;
	int ret = 0;

	if (o->kind != SHARDD_OPTIM_SGD && o->kind != SHARDD_OPTIM_ADAMW)
		return group_error(
			-SHARDD_E_INVALID, err, errlen,
			"register group '%s': optimizer kind = %u is not an optimizer (sgd = %d, adamw = %d)",
			group, o->kind, SHARDD_OPTIM_SGD, SHARDD_OPTIM_ADAMW);
	bad_flags = o->flags & ~(uint32_t)(SHARDD_OPTIM_MAXIMIZE |
					   (o->kind == SHARDD_OPTIM_SGD ? SHARDD_OPTIM_NESTEROV
									: SHARDD_OPTIM_AMSGRAD));
	if (bad_flags)
		return group_error(
			-SHARDD_E_INVALID, err, errlen,
			"register group '%s': optimizer %s: flags = 0x%x has bits 0x%x it does not take "
			"(nesterov = 0x%x: sgd, maximize = 0x%x, amsgrad = 0x%x: adamw)",
			group, n, o->flags, bad_flags, SHARDD_OPTIM_NESTEROV, SHARDD_OPTIM_MAXIMIZE,
			SHARDD_OPTIM_AMSGRAD);
	if (o->rsvd[0] || o->rsvd[1])
		return group_error(
			-SHARDD_E_INVALID, err, errlen,
			"register group '%s': optimizer rsvd = {0x%llx, 0x%llx}: reserved, must be 0",
			group, (unsigned long long)o->rsvd[0], (unsigned long long)o->rsvd[1]);
	ret = optim_range(group, n, "weight_decay", o->weight_decay, 0, 1e300, 0, err, errlen);
	if (o->kind == SHARDD_OPTIM_SGD) {
		if (!ret)
			ret = optim_range(group, n, "momentum", o->momentum, 0, 1e300, 0, err,
					  errlen);
		if (!ret)
			ret = optim_range(group, n, "dampening", o->dampening, -1e300, 1e300, 0,
					  err, errlen);
		if (!ret && (o->flags & SHARDD_OPTIM_NESTEROV) &&
		    (o->momentum <= 0 || o->dampening != 0))
			ret = group_error(
				-SHARDD_E_INVALID, err, errlen,
				"register group '%s': optimizer sgd: nesterov needs momentum > 0 and "
				"dampening 0, got momentum = %g, dampening = %g",
				group, o->momentum, o->dampening);
		if (!ret)
			ret = optim_zero(group, n, "beta1", o->beta1, err, errlen);
		if (!ret)
			ret = optim_zero(group, n, "beta2", o->beta2, err, errlen);
		if (!ret)
			ret = optim_zero(group, n, "eps", o->eps, err, errlen);
		return ret;
	}
	if (!ret)
		ret = optim_range(group, n, "beta1", o->beta1, 0, 1, 1, err, errlen);
	if (!ret)
		ret = optim_range(group, n, "beta2", o->beta2, 0, 1, 1, err, errlen);
	if (!ret)
		ret = optim_range(group, n, "eps", o->eps, 0, 1e300, 0, err, errlen);
	if (!ret)
		ret = optim_zero(group, n, "momentum", o->momentum, err, errlen);
	if (!ret)
		ret = optim_zero(group, n, "dampening", o->dampening, err, errlen);
	return ret;
}

int shd_group_parse(const void *payload, size_t len, struct shardd_register_group *hdr,
		    struct shardd_param_spec **specs, struct shardd_optim_config *optim,
		    char restore[SHARDD_RESTORE_PATH_MAX], char *err, size_t errlen)
{
	struct shardd_param_spec *s;
	struct shardd_restore rs = { 0 };
	size_t want;
	int ret;

	*specs = NULL;
	restore[0] = '\0';
	memset(optim, 0, sizeof(*optim));
	if (!payload || len < sizeof(*hdr))
		return group_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"register group: payload is %zu bytes, shorter than its %zu-byte header",
			len, sizeof(*hdr));
	/* The payload may sit at any alignment: copy before reading fields. */
	memcpy(hdr, payload, sizeof(*hdr));
	if (!memchr(hdr->name, '\0', sizeof(hdr->name)))
		return group_error(-SHARDD_E_INVALID, err, errlen,
				   "register group: name is not NUL-terminated within %d bytes",
				   SHARDD_NAME_MAX);
	if (!hdr->name[0])
		return group_error(-SHARDD_E_INVALID, err, errlen, "register group: name is empty");
	if (hdr->nparams == 0 || hdr->nparams > SHARDD_MAX_PARAMS)
		return group_error(-SHARDD_E_INVALID, err, errlen,
				   "register group '%s': nparams = %u; a group holds 1..%d params",
				   hdr->name, hdr->nparams, SHARDD_MAX_PARAMS);
	if (hdr->flags & ~(uint32_t)SHARDD_REGISTER_FLAGS_MASK)
		return group_error(-SHARDD_E_INVALID, err, errlen,
				   "register group '%s': flags = 0x%x (known: optimizer = 0x%x); "
				   "unknown bits must be 0",
				   hdr->name, hdr->flags, SHARDD_REGISTER_OPTIMIZER);
	if (hdr->exec >= SHARDD_EXEC_COUNT)
		return group_error(-SHARDD_E_INVALID, err, errlen,
				   "register group '%s': exec = %u; known: auto = %d, daemon = %d, "
				   "ranks = %d",
				   hdr->name, hdr->exec, SHARDD_EXEC_AUTO, SHARDD_EXEC_DAEMON,
				   SHARDD_EXEC_RANKS);
	want = sizeof(*hdr) + (size_t)hdr->nparams * sizeof(struct shardd_param_spec);
	if (hdr->flags & SHARDD_REGISTER_OPTIMIZER)
		want += sizeof(*optim);
	if (hdr->init == SHARDD_INIT_RESTORE) {
		if (len < want + sizeof(rs))
			return group_error(
				-SHARDD_E_MALFORMED, err, errlen,
				"register group '%s': init = restore, but the payload of %zu bytes ends "
				"before its %zu-byte struct shardd_restore at byte %zu",
				hdr->name, len, sizeof(rs), want);
		memcpy(&rs, (const uint8_t *)payload + want, sizeof(rs));
		if (rs.path_len >= SHARDD_RESTORE_PATH_MAX || rs.rsvd)
			return group_error(
				-SHARDD_E_INVALID, err, errlen,
				"register group '%s': restore path_len = %u (at most %d), rsvd = %u (must be 0)",
				hdr->name, rs.path_len, SHARDD_RESTORE_PATH_MAX - 1, rs.rsvd);
		memcpy(restore, (const uint8_t *)payload + want + sizeof(rs),
		       len >= want + sizeof(rs) + rs.path_len ? rs.path_len : 0);
		restore[len >= want + sizeof(rs) + rs.path_len ? rs.path_len : 0] = '\0';
		want += sizeof(rs) + rs.path_len;
		if (len == want && strlen(restore) != rs.path_len)
			return group_error(-SHARDD_E_INVALID, err, errlen,
					   "register group '%s': the restore path holds a NUL byte",
					   hdr->name);
	}
	if (len != want)
		return group_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"register group '%s': payload is %zu bytes but nparams = %u%s needs %zu",
			hdr->name, len, hdr->nparams,
			hdr->flags & SHARDD_REGISTER_OPTIMIZER ? " and an optimizer config" : "",
			want);
	if (hdr->flags & SHARDD_REGISTER_OPTIMIZER) {
		memcpy(optim,
		       (const uint8_t *)payload + sizeof(*hdr) +
			       (size_t)hdr->nparams * sizeof(struct shardd_param_spec),
		       sizeof(*optim));
		ret = shd_group_optim_check(hdr->name, optim, err, errlen);
		if (ret)
			return ret;
	}
	if (hdr->param_dtype >= SHARDD_DTYPE_COUNT)
		return group_error(
			-SHARDD_E_INVALID, err, errlen,
			"register group '%s': param_dtype = %u is not a dtype (none = 0, fp32 = 1, bf16 = 2, fp16 = 3)",
			hdr->name, hdr->param_dtype);
	if (hdr->reduce_dtype >= SHARDD_DTYPE_COUNT)
		return group_error(
			-SHARDD_E_INVALID, err, errlen,
			"register group '%s': reduce_dtype = %u is not a dtype (none = 0, fp32 = 1, bf16 = 2, fp16 = 3)",
			hdr->name, hdr->reduce_dtype);
	if (hdr->init != SHARDD_INIT_ZERO && hdr->init != SHARDD_INIT_RESTORE)
		return group_error(
			-SHARDD_E_INVALID, err, errlen,
			"register group '%s': init = %u; known: SHARDD_INIT_ZERO (0), SHARDD_INIT_RESTORE (1)",
			hdr->name, hdr->init);
	s = malloc((size_t)hdr->nparams * sizeof(*s));
	if (!s)
		return -ENOMEM;
	memcpy(s, (const uint8_t *)payload + sizeof(*hdr), (size_t)hdr->nparams * sizeof(*s));
	*specs = s;
	return 0;
}

/* Grad dtypes: uniform or not, and the set FSDP2 names in its error. */
static void group_grad_dtypes(struct shd_group *g)
{
	uint8_t seen[SHARDD_DTYPE_COUNT] = { 0 };
	size_t off = 0;
	int n = 0;

	g->grad_dtype = g->layout.params[0].grad_dtype;
	off += (size_t)snprintf(g->grad_dtypes, sizeof(g->grad_dtypes), "{");
	for (uint32_t i = 0; i < g->layout.nparams; i++) {
		uint32_t d = g->layout.params[i].grad_dtype;

		if (d != g->grad_dtype)
			g->grad_dtype = SHARDD_DTYPE_NONE;
		if (seen[d])
			continue;
		seen[d] = 1;
		off += (size_t)snprintf(g->grad_dtypes + off, sizeof(g->grad_dtypes) - off, "%s%s",
					n++ ? ", " : "", dtype_str(d));
	}
	snprintf(g->grad_dtypes + off, sizeof(g->grad_dtypes) - off, "}");
}

int shd_group_create(uint32_t id, const struct shardd_register_group *hdr,
		     struct shardd_param_spec *specs, uint32_t replicate, uint32_t shard,
		     struct shd_group **out, char *err, size_t errlen)
{
	struct shd_group *g;
	uint32_t world = replicate * shard;
	char lerr[384];
	int ret;

	g = calloc(1, sizeof(*g));
	if (!g)
		return -ENOMEM;
	ret = shd_layout_build(specs, hdr->nparams, shard, hdr->param_dtype, &g->layout, lerr,
			       sizeof(lerr));
	if (ret) {
		if (ret == -ENOMEM)
			snprintf(lerr, sizeof(lerr), "out of memory");
		group_error(ret, err, errlen, "register group '%s': %s", hdr->name, lerr);
		free(g);
		return ret;
	}
	g->id = id;
	memcpy(g->name, hdr->name, sizeof(g->name));
	g->hdr = *hdr;
	g->replicate = replicate;
	g->shard = shard;
	g->world = world;
	group_grad_dtypes(g);
	g->reduce_dtype =
		hdr->reduce_dtype != SHARDD_DTYPE_NONE ? hdr->reduce_dtype : g->grad_dtype;

	g->shard_offsets = calloc(hdr->nparams, sizeof(*g->shard_offsets));
	g->reduce_offsets = calloc(hdr->nparams, sizeof(*g->reduce_offsets));
	g->unsharded_own = calloc(replicate, 1);
	g->unsharded = calloc(world, sizeof(*g->unsharded));
	g->shards = calloc(world, sizeof(*g->shards));
	g->sharded_grads = calloc(world, sizeof(*g->sharded_grads));
	g->grads = calloc(world, sizeof(*g->grads));
	g->partials = calloc(world, sizeof(*g->partials));
	g->grad_present = calloc(world, 1);
	g->partial_present = calloc(world, 1);
	g->holds = calloc(world, 1);
	g->exec_sealed = calloc(world, sizeof(*g->exec_sealed));
	g->last_step = calloc(world, sizeof(*g->last_step));
	g->optim_steps = calloc(world, sizeof(*g->optim_steps));
	if (!g->shard_offsets || !g->reduce_offsets || !g->unsharded_own || !g->unsharded ||
	    !g->shards || !g->sharded_grads || !g->grads || !g->partials || !g->grad_present ||
	    !g->partial_present || !g->holds || !g->exec_sealed || !g->last_step ||
	    !g->optim_steps) {
		g->specs = NULL;
		shd_group_destroy(g, NULL);
		return -ENOMEM;
	}
	/* Unallocated (priv NULL from calloc) and no fd for shd_buf_forget to close. */
	for (uint32_t r = 0; r < world; r++)
		g->unsharded[r].fd = g->shards[r].fd = g->sharded_grads[r].fd = g->grads[r].fd =
			g->partials[r].fd = -1;
	g->sync.fd = -1;
	g->exec = SHARDD_EXEC_DAEMON;
	for (uint32_t i = 0; i < hdr->nparams; i++)
		g->shard_offsets[i] = g->layout.params[i].shard_offset;
	/* One shard in the reduce dtype: the layout of HSDP partials and of reduce-scatter staging. */
	if (g->reduce_dtype != SHARDD_DTYPE_NONE)
		g->reduce_shard_size =
			shd_placement_reduce_shard(&g->layout, g->reduce_dtype, g->reduce_offsets);
	/* Partials exist only with a replicate dim and a uniform grad dtype (else reduce fails). */
	if (replicate > 1)
		g->partial_size = g->reduce_shard_size;
	g->specs = specs;
	*out = g;
	return 0;
}

const char *shd_group_optim_state_name(const struct shardd_optim_config *o, uint32_t k)
{
	if (o->kind == SHARDD_OPTIM_SGD)
		return "momentum";
	return k == 0 ? "exp_avg" : k == 1 ? "exp_avg_sq" : "max_exp_avg_sq";
}

uint32_t shd_group_optim_states(const struct shardd_optim_config *o)
{
	switch (o->kind) {
	case SHARDD_OPTIM_SGD:
		return o->momentum != 0;
	case SHARDD_OPTIM_ADAMW:
		return o->flags & SHARDD_OPTIM_AMSGRAD ? 3 : 2;
	default:
		return 0;
	}
}

int shd_group_set_optim(struct shd_group *g, const struct shardd_optim_config *o, char *err,
			size_t errlen)
{
	uint32_t n = shd_group_optim_states(o);

	if (o->kind == SHARDD_OPTIM_NONE)
		return 0;
	for (uint32_t i = 0; i < g->layout.nparams; i++)
		if (g->layout.params[i].dtype != SHARDD_DTYPE_FP32)
			return group_error(
				-SHARDD_E_INVALID, err, errlen,
				"register group '%s': param '%s' is %s, but the daemon's optimizer "
				"updates fp32 master params only: register it as fp32 (param_dtype "
				"bf16 keeps the unsharded copy in bf16), or register no optimizer",
				g->name, g->specs[i].name, dtype_str(g->layout.params[i].dtype));
	for (uint32_t k = 0; k < n; k++) {
		g->optim_state[k] = calloc(g->world, sizeof(*g->optim_state[k]));
		if (!g->optim_state[k])
			return -ENOMEM;
		for (uint32_t r = 0; r < g->world; r++)
			g->optim_state[k][r].fd = -1;
	}
	g->optim = *o;
	return 0;
}

static void shape_str(const struct shardd_param_spec *s, char *buf, size_t len)
{
	size_t off = (size_t)snprintf(buf, len, "[");

	for (uint32_t d = 0; d < s->ndim && d < SHARDD_MAX_DIMS && off < len; d++)
		off += (size_t)snprintf(buf + off, len - off, "%s%llu", d ? ", " : "",
					(unsigned long long)s->shape[d]);
	if (off < len)
		snprintf(buf + off, len - off, "]");
}

int shd_group_compare(const struct shd_group *g, const struct shardd_register_group *hdr,
		      const struct shardd_param_spec *specs,
		      const struct shardd_optim_config *optim, uint32_t rank, uint32_t first_rank,
		      char *err, size_t errlen)
{
	const char *field = NULL;
	char mine[128], theirs[128];
	uint32_t i;

/*
 * The first field `f` of this rank's `a` that differs from the first
 * rank's `b`: its name (after `prefix`) and both values, through `conv`.
 */
#define FIELD_DIFF(prefix, a, b, f, fmt, conv)                       \
	if (!field && (a)->f != (b)->f) {                            \
		field = prefix #f;                                   \
		snprintf(mine, sizeof(mine), fmt, conv((a)->f));     \
		snprintf(theirs, sizeof(theirs), fmt, conv((b)->f)); \
	}
#define AS_IS(x) (x)
	FIELD_DIFF("", hdr, &g->hdr, nparams, "%u", AS_IS)
	FIELD_DIFF("", hdr, &g->hdr, param_dtype, "%s", dtype_str)
	FIELD_DIFF("", hdr, &g->hdr, reduce_dtype, "%s", dtype_str)
	FIELD_DIFF("", hdr, &g->hdr, init, "%u", AS_IS)
	FIELD_DIFF("optimizer ", optim, &g->optim, kind, "%s", optim_str)
	FIELD_DIFF("optimizer ", optim, &g->optim, flags, "0x%x", AS_IS)
	FIELD_DIFF("optimizer ", optim, &g->optim, momentum, "%.17g", AS_IS)
	FIELD_DIFF("optimizer ", optim, &g->optim, dampening, "%.17g", AS_IS)
	FIELD_DIFF("optimizer ", optim, &g->optim, weight_decay, "%.17g", AS_IS)
	FIELD_DIFF("optimizer ", optim, &g->optim, beta1, "%.17g", AS_IS)
	FIELD_DIFF("optimizer ", optim, &g->optim, beta2, "%.17g", AS_IS)
	FIELD_DIFF("optimizer ", optim, &g->optim, eps, "%.17g", AS_IS)
#undef FIELD_DIFF
#undef AS_IS
	if (field) {
		snprintf(err, errlen,
			 "register group '%s': %s differs: %s from rank %u but %s from rank %u",
			 g->name, field, mine, rank, theirs, first_rank);
		return 1;
	}
	for (i = 0; i < hdr->nparams; i++) {
		const struct shardd_param_spec *a = &specs[i], *b = &g->specs[i];

		if (strncmp(a->name, b->name, sizeof(a->name))) {
			field = "name";
			snprintf(mine, sizeof(mine), "'%.*s'", (int)sizeof(a->name), a->name);
			snprintf(theirs, sizeof(theirs), "'%s'", b->name);
		} else if (a->dtype != b->dtype) {
			field = "dtype";
			snprintf(mine, sizeof(mine), "%s", dtype_str(a->dtype));
			snprintf(theirs, sizeof(theirs), "%s", dtype_str(b->dtype));
		} else if (a->ndim != b->ndim || memcmp(a->shape, b->shape, sizeof(a->shape))) {
			field = "shape";
			shape_str(a, mine, sizeof(mine));
			shape_str(b, theirs, sizeof(theirs));
		} else if (a->shard_dim != b->shard_dim) {
			field = "shard_dim";
			snprintf(mine, sizeof(mine), "%u", a->shard_dim);
			snprintf(theirs, sizeof(theirs), "%u", b->shard_dim);
		} else if (a->flags != b->flags) {
			field = "flags";
			snprintf(mine, sizeof(mine), "0x%x", a->flags);
			snprintf(theirs, sizeof(theirs), "0x%x", b->flags);
		}
		if (field) {
			snprintf(
				err, errlen,
				"register group '%s': param #%u '%s' differs in %s: %s from rank %u but %s from rank %u",
				g->name, i, b->name, field, mine, rank, theirs, first_rank);
			return 1;
		}
	}
	return 0;
}

void shd_group_memory_need(const struct shd_group *g, struct shd_group_memory *m)
{
	const struct shd_layout *l = &g->layout;

	/* Each size is below 2^40 (layout.h) and world at most 2^10: no product or sum overflows. */
	memset(m, 0, sizeof(*m));
	/* A rank-executed group: one unsharded copy per rank, and a slot after each grad buffer. */
	m->unsharded = (uint64_t)(g->exec == SHARDD_EXEC_RANKS ? g->world : g->replicate) *
		       l->unsharded_size;
	m->shards = (uint64_t)g->world * l->shard_size;
	m->sharded_grads = (uint64_t)g->world * l->shard_size;
	m->grads = (uint64_t)g->world * l->grad_size;
	if (g->exec == SHARDD_EXEC_RANKS)
		m->exec = (uint64_t)g->world * (shd_group_grad_map_size(g) - l->grad_size) +
			  shardd_exec_sync_size(g->world);
	m->partials = (uint64_t)g->world * g->partial_size;
	m->optimizer = (uint64_t)g->world * shd_group_optim_states(&g->optim) * l->shard_size;
	m->internode = g->internode_size;
	m->total = m->unsharded + m->shards + m->sharded_grads + m->grads + m->partials +
		   m->optimizer + m->internode + m->exec;
}

static uint64_t bufs_bytes(const struct shd_buf *b, uint32_t n)
{
	uint64_t sum = 0;

	for (uint32_t i = 0; b && i < n; i++)
		if (shd_buf_allocated(&b[i]))
			sum += b[i].bytes;
	return sum;
}

void shd_group_memory_held(const struct shd_group *g, struct shd_group_memory *m)
{
	struct shd_group_memory h = { 0 };

	if (!g->allocated)
		return;
	h.shards = bufs_bytes(g->shards, g->world);
	h.sharded_grads = bufs_bytes(g->sharded_grads, g->world);
	h.unsharded = bufs_bytes(g->unsharded, g->world);
	h.grads = bufs_bytes(g->grads, g->world);
	if (g->exec == SHARDD_EXEC_RANKS && h.grads) {
		/* The grads' slots, counted apart as memory_need does. */
		uint64_t slots =
			(uint64_t)g->world * (shd_group_grad_map_size(g) - g->layout.grad_size);

		h.grads -= slots;
		h.exec = slots + bufs_bytes(&g->sync, 1);
	}
	h.partials = bufs_bytes(g->partials, g->world);
	for (uint32_t k = 0; k < SHD_OPTIM_STATES; k++)
		h.optimizer += bufs_bytes(g->optim_state[k], g->world);
	m->shards += h.shards;
	m->sharded_grads += h.sharded_grads;
	m->unsharded += h.unsharded;
	m->grads += h.grads;
	m->partials += h.partials;
	m->optimizer += h.optimizer;
	m->internode += g->internode_held;
	m->exec += h.exec;
	m->total += h.shards + h.sharded_grads + h.unsharded + h.grads + h.partials + h.optimizer +
		    g->internode_held + h.exec;
}

int shd_group_alloc(struct shd_group *g, struct shd_backend_ctx *b, const int32_t *devices,
		    const struct shd_placement *pl, char *err, size_t errlen)
{
	const struct shd_backend_ops *ops = b->ops;
	char what[160];
	int ret = 0;

	for (uint32_t u = 0; u < g->replicate; u++)
		g->unsharded_own[u] = (pl && pl->shard_nccl[u]) || g->exec == SHARDD_EXEC_RANKS;
	for (uint32_t r = 0; r < g->world && !ret; r++) {
		uint32_t u = r / g->shard;

		if (shd_group_unsharded(g, r) != &g->unsharded[r])
			continue;
		if (g->unsharded_own[u])
			snprintf(what, sizeof(what), "%s.unsharded.rank%u", g->name, r);
		else
			snprintf(what, sizeof(what), "%s.unsharded.%u", g->name, u);
		ret = ops->alloc(b, g->layout.unsharded_size, devices[r], what, &g->unsharded[r]);
	}
	for (uint32_t r = 0; r < g->world && !ret; r++) {
		snprintf(what, sizeof(what), "%s.shard.%u", g->name, r);
		ret = ops->alloc(b, g->layout.shard_size, devices[r], what, &g->shards[r]);
		if (ret)
			break;
		snprintf(what, sizeof(what), "%s.sharded_grad.%u", g->name, r);
		ret = ops->alloc(b, g->layout.shard_size, devices[r], what, &g->sharded_grads[r]);
		if (ret)
			break;
		snprintf(what, sizeof(what), "%s.grad.%u", g->name, r);
		ret = ops->alloc(b, shd_group_grad_map_size(g), devices[r], what, &g->grads[r]);
		for (uint32_t k = 0; k < shd_group_optim_states(&g->optim) && !ret; k++) {
			snprintf(what, sizeof(what), "%s.%s.%u", g->name,
				 shd_group_optim_state_name(&g->optim, k), r);
			ret = ops->alloc(b, g->layout.shard_size, devices[r], what,
					 &g->optim_state[k][r]);
		}
		if (ret || !g->partial_size)
			continue;
		snprintf(what, sizeof(what), "%s.partial.%u", g->name, r);
		ret = ops->alloc(b, g->partial_size, devices[r], what, &g->partials[r]);
	}
	if (!ret && g->exec == SHARDD_EXEC_RANKS) {
		snprintf(what, sizeof(what), "%s.sync", g->name);
		ret = ops->alloc(b, shardd_exec_sync_size(g->world), devices[0], what, &g->sync);
	}
	g->allocated = 1;
	if ((ret == -ENOMEM || ret == -ENOSPC) && strcmp(ops->name, "host") == 0) {
		/* Within the limits, but the node has less memory free than they allow. */
		ret = group_error(
			-ENOMEM, err, errlen,
			"register group '%s': the %s backend could not commit the memory of buffer %s: %s; "
			"the node has less memory free than --max-memory allows: free memory, or lower "
			"--max-memory",
			g->name, ops->name, what, strerror(-ret));
	} else if (ret) {
		group_error(ret, err, errlen,
			    "register group '%s': the %s backend could not allocate buffer %s: %s",
			    g->name, ops->name, what,
			    ret > -SHARDD_E_BASE ? strerror(-ret) : "backend error");
	}
	return ret;
}

int shd_group_reply(const struct shd_group *g, struct shd_backend_ctx *b, uint32_t rank,
		    struct shardd_group_reply *reply, struct shardd_param_layout *layouts,
		    struct shd_group_export *ex)
{
	const struct shd_buf *bufs[SHARDD_GROUP_BUFS] = {
		shd_group_unsharded(g, rank),
		&g->grads[rank],
		&g->shards[rank],
		&g->sharded_grads[rank],
	};
	/*
	 * Daemon-executed: the unsharded copy is the daemon's output, lent
	 * read-only. Rank-executed: it is the rank's own output, and its flat
	 * shard and grad buffer stay open for the seal its peers need.
	 */
	static const int daemon_modes[SHARDD_GROUP_BUFS] = { SHD_EXPORT_RO, SHD_EXPORT_RW,
							     SHD_EXPORT_RW, SHD_EXPORT_RW };
	static const int owner_modes[SHARDD_GROUP_BUFS] = { SHD_EXPORT_RW, SHD_EXPORT_OWNER,
							    SHD_EXPORT_OWNER, SHD_EXPORT_RW };
	int ranks = g->exec == SHARDD_EXEC_RANKS;
	uint32_t shard_rank = shd_group_shard_rank(g, rank);
	struct shd_buf_export one;
	int ret;

	memset(ex, 0, sizeof(*ex));
	memset(reply, 0, sizeof(*reply));
	reply->group_id = g->id;
	reply->nparams = g->hdr.nparams;
	reply->param_dtype = g->hdr.param_dtype;
	reply->reduce_dtype = g->hdr.reduce_dtype;
	reply->grad_dtype = g->grad_dtype;
	reply->shard_world = g->layout.world;
	reply->unsharded_size = g->layout.unsharded_size;
	reply->grad_size = g->layout.grad_size;
	reply->shard_size = g->layout.shard_size;
	reply->optimizer = g->optim.kind;
	eng_step_last(g, rank, &reply->last_step, &reply->peer_last_step);
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		const struct shd_layout_param *p = &g->layout.params[i];

		layouts[i] = (struct shardd_param_layout){
			.unsharded_offset = p->unsharded_offset,
			.unsharded_bytes = p->numel * shardd_dtype_size(p->unsharded_dtype),
			.grad_offset = p->grad_offset,
			.grad_bytes = p->numel * shardd_dtype_size(p->grad_dtype),
			.shard_offset = p->shard_offset,
			.shard_bytes = p->shard_numel * shardd_dtype_size(p->dtype),
			.shard_row_begin = (uint64_t)shard_rank * p->rows,
			.shard_rows_valid = shd_layout_rows_valid(p, shard_rank),
		};
	}
	reply->exec = g->exec;
	for (int k = 0; k < SHARDD_GROUP_BUFS; k++) {
		/* Sealed already: its owner opens it a second time, read-only (registry.c). */
		int mode = !ranks                                       ? daemon_modes[k]
			   : g->exec_sealed[rank] && (k == 1 || k == 2) ? SHD_EXPORT_RO
									: owner_modes[k];

		ret = b->ops->export_buf(b, bufs[k], mode, &one);
		if (ret < 0)
			goto err_close;
		reply->export_kind[k] = (uint8_t)one.kind;
		if (one.kind == SHARDD_EXPORT_FD)
			ex->fds[ex->nfds++] = one.fd;
		else
			ex->ipc[ex->nipc++] = one.ipc;
	}
	if (ranks) {
		/* The sync page travels after the buffers (PROTOCOL.md "Rank-executed groups"). */
		ret = b->ops->export_buf(b, &g->sync, SHD_EXPORT_RO, &one);
		if (ret < 0)
			goto err_close;
		ex->fds[ex->nfds++] = one.fd;
	}
	return 0;

err_close:
	shd_group_export_close(ex);
	return ret;
}

void shd_group_export_close(struct shd_group_export *ex)
{
	for (int i = 0; i < ex->nfds; i++)
		close(ex->fds[i]);
	ex->nfds = 0;
}

void shd_group_destroy(struct shd_group *g, struct shd_backend_ctx *b)
{
	if (!g)
		return;
	if (g->allocated) {
		for (uint32_t r = 0; r < g->world; r++) {
			b->ops->free(b, &g->unsharded[r]);
			b->ops->free(b, &g->shards[r]);
			b->ops->free(b, &g->sharded_grads[r]);
			b->ops->free(b, &g->grads[r]);
			b->ops->free(b, &g->partials[r]);
			for (uint32_t k = 0; k < SHD_OPTIM_STATES; k++)
				if (g->optim_state[k])
					b->ops->free(b, &g->optim_state[k][r]);
		}
		b->ops->free(b, &g->sync);
	}
	for (uint32_t k = 0; k < SHD_OPTIM_STATES; k++)
		free(g->optim_state[k]);
	free(g->last_step);
	free(g->optim_steps);
	shd_layout_free(&g->layout);
	free(g->specs);
	free(g->shard_offsets);
	free(g->reduce_offsets);
	free(g->unsharded_own);
	free(g->unsharded);
	free(g->shards);
	free(g->sharded_grads);
	free(g->grads);
	free(g->partials);
	free(g->grad_present);
	free(g->partial_present);
	free(g->holds);
	free(g->exec_sealed);
	free(g);
}

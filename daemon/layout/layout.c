/* SPDX-License-Identifier: MIT */
/*
 * Layout of a group (layout.h): validates the registered param specs, which
 * come from another process and are hostile until checked, and computes
 * every offset with overflow-checked arithmetic.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"

struct name_ref {
	const char *name;
	uint32_t index;
};

__attribute__((format(printf, 3, 4))) static int layout_error(char *err, size_t errlen,
							      const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return -SHARDD_E_INVALID;
}

static int name_ref_cmp(const void *a, const void *b)
{
	const struct name_ref *x = a, *y = b;
	int c = strcmp(x->name, y->name);

	if (c)
		return c;
	return (x->index > y->index) - (x->index < y->index);
}

/* n rounded up to SHARDD_ALIGN; false if that overflows. */
static int align_up(uint64_t n, uint64_t *out)
{
	if (__builtin_add_overflow(n, (uint64_t)SHARDD_ALIGN - 1, out))
		return 0;
	*out &= ~((uint64_t)SHARDD_ALIGN - 1);
	return 1;
}

/*
 * Append `bytes` to a buffer whose used size is *size: the param starts at
 * *offset (aligned) and *size moves past it. False when the buffer would
 * reach SHD_LAYOUT_MAX_BYTES.
 */
static int place(uint64_t *size, uint64_t bytes, uint64_t *offset)
{
	uint64_t end;

	*offset = *size;
	if (__builtin_add_overflow(*size, bytes, &end) || !align_up(end, &end) ||
	    end >= SHD_LAYOUT_MAX_BYTES)
		return 0;
	*size = end;
	return 1;
}

/* Field checks of one spec that need no arithmetic; sets p's dtypes. */
static int check_spec(const struct shardd_param_spec *s, uint32_t i, uint32_t world,
		      uint32_t param_dtype, struct shd_layout_param *p, char *err, size_t errlen)
{
	const char *name = s->name;

	if (!memchr(s->name, '\0', sizeof(s->name)))
		return layout_error(
			err, errlen,
			"param #%u: name is not NUL-terminated within %d bytes; names are at most %d characters",
			i, SHARDD_PARAM_NAME_MAX, SHARDD_PARAM_NAME_MAX - 1);
	if (!name[0])
		return layout_error(err, errlen,
				    "param #%u: name is empty; every param needs a unique name", i);
	if (s->dtype == SHARDD_DTYPE_NONE || s->dtype >= SHARDD_DTYPE_COUNT)
		return layout_error(
			err, errlen,
			"param '%s': dtype = %u is not a dtype (fp32 = 1, bf16 = 2, fp16 = 3)",
			name, s->dtype);
	if (s->ndim > SHARDD_MAX_DIMS)
		return layout_error(err, errlen,
				    "param '%s': ndim = %u is above the limit of %d dims", name,
				    s->ndim, SHARDD_MAX_DIMS);
	if (s->ndim == 0 ? s->shard_dim != 0 : s->shard_dim >= s->ndim)
		return layout_error(err, errlen,
				    "param '%s': shard_dim = %u is not a dim of a %u-d param", name,
				    s->shard_dim, s->ndim);
	if (s->flags)
		return layout_error(err, errlen,
				    "param '%s': flags = 0x%x; no flags are defined, send 0", name,
				    s->flags);
	for (uint32_t d = s->ndim; d < SHARDD_MAX_DIMS; d++) {
		if (s->shape[d])
			return layout_error(
				err, errlen,
				"param '%s': shape[%u] = %llu past ndim = %u; unused dims must be 0",
				name, d, (unsigned long long)s->shape[d], s->ndim);
	}
	if (s->shard_dim > 0 && s->shape[s->shard_dim] % world)
		return layout_error(
			err, errlen,
			"param '%s': shape[%u] = %llu is not divisible by the shard group size %u; Shard(%u) needs even sharding",
			name, s->shard_dim, (unsigned long long)s->shape[s->shard_dim], world,
			s->shard_dim);
	p->dtype = s->dtype;
	p->unsharded_dtype = param_dtype != SHARDD_DTYPE_NONE ? param_dtype : s->dtype;
	p->grad_dtype = p->unsharded_dtype;
	p->shard_dim = s->shard_dim;
	return 0;
}

/*
 * Element counts of one param. Every byte count derived from them must stay
 * below SHD_LAYOUT_MAX_BYTES; the dim whose product crosses it is named.
 *
 * The product of the nonzero dims is bounded too, not only numel: a zero
 * dim makes numel 0 (FSDP2 accepts zero-numel params: they take no bytes
 * and every op does nothing for them), but must not hide dims whose
 * product wraps 64 bits, as outer or inner would ([3, 3, 0, 2^63, 8]:
 * inner of shard_dim 1 wraps to 0). Bounded so, every partial product
 * below (outer, dim, inner, numel, shard_numel) fits without a check.
 */
static int count_elements(const struct shardd_param_spec *s, uint32_t world,
			  struct shd_layout_param *p, char *err, size_t errlen)
{
	/* fp32 is the widest dtype: a count whose fp32 bytes fit fits all. */
	const uint64_t max_numel = SHD_LAYOUT_MAX_BYTES / sizeof(float);
	uint64_t numel = 1, extent = 1;

	p->outer = 1;
	p->dim = 1;
	p->inner = 1;
	for (uint32_t d = 0; d < s->ndim; d++) {
		uint64_t n = s->shape[d];

		if (n && (__builtin_mul_overflow(extent, n, &extent) || extent >= max_numel))
			return layout_error(
				err, errlen,
				"param '%s': shape[%u] = 0x%llx overflows the buffer size (limit %llu bytes per buffer: the nonzero dims must multiply to less than %llu)",
				s->name, d, (unsigned long long)n,
				(unsigned long long)SHD_LAYOUT_MAX_BYTES,
				(unsigned long long)max_numel);
		numel *= n;
		if (d < s->shard_dim)
			p->outer *= n;
		else if (d == s->shard_dim)
			p->dim = n;
		else
			p->inner *= n;
	}
	p->numel = numel;
	/* Padding rows can make a dim-0 shard larger than its share; bound it too. */
	p->rows = s->shard_dim == 0 ? p->dim / world + (p->dim % world != 0) : p->dim / world;
	if (__builtin_mul_overflow(p->outer, p->rows, &p->shard_numel) ||
	    __builtin_mul_overflow(p->shard_numel, p->inner, &p->shard_numel) ||
	    p->shard_numel >= max_numel)
		return layout_error(
			err, errlen,
			"param '%s': shape[%u] = 0x%llx overflows the shard size (limit %llu bytes per buffer)",
			s->name, s->shard_dim, (unsigned long long)p->dim,
			(unsigned long long)SHD_LAYOUT_MAX_BYTES);
	return 0;
}

static int check_unique_names(const struct shardd_param_spec *specs, uint32_t nparams, char *err,
			      size_t errlen)
{
	struct name_ref *refs = malloc((size_t)nparams * sizeof(*refs));
	int ret = 0;

	if (!refs)
		return -ENOMEM;
	for (uint32_t i = 0; i < nparams; i++) {
		refs[i].name = specs[i].name;
		refs[i].index = i;
	}
	/* Sorting keeps 65 536 names at n log n rather than n^2 compares. */
	qsort(refs, nparams, sizeof(*refs), name_ref_cmp);
	for (uint32_t i = 1; i < nparams; i++) {
		if (!strcmp(refs[i - 1].name, refs[i].name)) {
			ret = layout_error(
				err, errlen,
				"param '%s': name is used by params #%u and #%u; names must be unique in a group",
				refs[i].name, refs[i - 1].index, refs[i].index);
			break;
		}
	}
	free(refs);
	return ret;
}

int shd_layout_build(const struct shardd_param_spec *specs, uint32_t nparams, uint32_t world,
		     uint32_t param_dtype, struct shd_layout *out, char *err, size_t errlen)
{
	struct shd_layout l = { .nparams = nparams, .world = world };
	int ret;

	memset(out, 0, sizeof(*out));
	if (world == 0 || world > SHARDD_MAX_WORLD)
		return layout_error(err, errlen, "shard group size = %u; it must be 1..%d", world,
				    SHARDD_MAX_WORLD);
	if (nparams == 0 || nparams > SHARDD_MAX_PARAMS)
		return layout_error(err, errlen, "nparams = %u; a group holds 1..%d params",
				    nparams, SHARDD_MAX_PARAMS);
	if (param_dtype >= SHARDD_DTYPE_COUNT)
		return layout_error(
			err, errlen,
			"param_dtype = %u is not a dtype (none = 0, fp32 = 1, bf16 = 2, fp16 = 3)",
			param_dtype);

	l.params = calloc(nparams, sizeof(*l.params));
	if (!l.params)
		return -ENOMEM;
	for (uint32_t i = 0; i < nparams; i++) {
		const struct shardd_param_spec *s = &specs[i];
		struct shd_layout_param *p = &l.params[i];

		ret = check_spec(s, i, world, param_dtype, p, err, errlen);
		if (ret)
			goto err;
		ret = count_elements(s, world, p, err, errlen);
		if (ret)
			goto err;
		/* Counts are below 2^38 and sizes at most 4: no product overflows. */
		if (!place(&l.unsharded_size, p->numel * shardd_dtype_size(p->unsharded_dtype),
			   &p->unsharded_offset) ||
		    !place(&l.grad_size, p->numel * shardd_dtype_size(p->grad_dtype),
			   &p->grad_offset) ||
		    !place(&l.shard_size, p->shard_numel * shardd_dtype_size(p->dtype),
			   &p->shard_offset)) {
			ret = layout_error(
				err, errlen,
				"param '%s': adding it takes a buffer of the group past the limit of %llu bytes; split the group",
				s->name, (unsigned long long)SHD_LAYOUT_MAX_BYTES);
			goto err;
		}
	}
	ret = check_unique_names(specs, nparams, err, errlen);
	if (ret)
		goto err;

	/* Empty groups still get a mappable buffer. */
	if (l.unsharded_size == 0)
		l.unsharded_size = SHARDD_ALIGN;
	if (l.grad_size == 0)
		l.grad_size = SHARDD_ALIGN;
	if (l.shard_size == 0)
		l.shard_size = SHARDD_ALIGN;
	*out = l;
	return 0;
err:
	free(l.params);
	return ret;
}

void shd_layout_free(struct shd_layout *l)
{
	free(l->params);
	memset(l, 0, sizeof(*l));
}

uint64_t shd_layout_rows_valid(const struct shd_layout_param *p, uint32_t shard_rank)
{
	uint64_t begin;

	if (p->shard_dim != 0)
		return p->rows;
	if (__builtin_mul_overflow((uint64_t)shard_rank, p->rows, &begin) || begin >= p->dim)
		return 0;
	return p->dim - begin < p->rows ? p->dim - begin : p->rows;
}

/* SPDX-License-Identifier: MIT */
/*
 * The checkpoint format (safetensors.h), parsed: safetensors headers and
 * the manifest. Parsing treats its input as hostile.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "safetensors.h"
#include "safetensors_int.h"
#include "layout.h"

static uint32_t st_dtype_code(const char *s)
{
	for (uint32_t d = SHARDD_DTYPE_FP32; d < SHARDD_DTYPE_COUNT; d++)
		if (!strcmp(s, shd_safetensors_dtype_name(d)))
			return d;
	return SHARDD_DTYPE_NONE;
}

/* "[2, 3]" into buf. */
static const char *shape_str(const struct shd_safetensors_tensor *t, char *buf, size_t len)
{
	size_t o = 0;

	o += snprintf(buf + o, len - o, "[");
	for (uint32_t d = 0; d < t->ndim && o < len; d++)
		o += snprintf(buf + o, len - o, "%s%llu", d ? ", " : "",
			      (unsigned long long)t->shape[d]);
	if (o < len)
		snprintf(buf + o, len - o, "]");
	return buf;
}

/* ------------------------------------------------------------------ */
/* safetensors: parsing                                                */
/* ------------------------------------------------------------------ */

static const struct shd_safetensors_file *sort_file;

static int cmp_begin(const void *a, const void *b)
{
	const struct shd_safetensors_tensor *x = a, *y = b;

	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	return x->end < y->end ? -1 : x->end > y->end;
}

static int cmp_name_idx(const void *a, const void *b)
{
	return strcmp(sort_file->tensors[*(const uint32_t *)a].name,
		      sort_file->tensors[*(const uint32_t *)b].name);
}

/* A JSON integer in [0, max] into *out: 0, else -EINVAL. */
static int json_u64(const json_t *v, uint64_t max, uint64_t *out)
{
	json_int_t x;

	if (!json_is_integer(v))
		return -EINVAL;
	x = json_integer_value(v);
	if (x < 0 || (uint64_t)x > max)
		return -EINVAL;
	*out = (uint64_t)x;
	return 0;
}

/* Parse one tensor's entry {dtype, shape, data_offsets} into *t. */
static int st_parse_tensor(const char *name, json_t *v, uint64_t data_size,
			   struct shd_safetensors_tensor *t, char *err, size_t errlen)
{
	json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
	json_t *offs = json_object_get(v, "data_offsets");
	char sbuf[256];
	uint64_t b;

	if (strlen(name) >= sizeof(t->name) || !name[0])
		return ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				      "tensor name '%.40s...' of %zu bytes: names are 1..%d bytes",
				      name, strlen(name), SHD_CKPT_NAME_MAX - 1);
	strcpy(t->name, name);
	if (!json_is_object(v) || json_object_size(v) != 3 || !dt || !shape || !offs)
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"tensor '%s': entry must be an object of exactly \"dtype\", \"shape\", "
			"\"data_offsets\"",
			name);
	if (!json_is_string(dt))
		return ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				      "tensor '%s': dtype is not a string", name);
	t->dtype = st_dtype_code(json_string_value(dt));
	if (t->dtype == SHARDD_DTYPE_NONE)
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"tensor '%s': dtype \"%.16s\" is not one shardd reads (F32, BF16, F16)",
			name, json_string_value(dt));
	if (!json_is_array(shape) || json_array_size(shape) > SHARDD_MAX_DIMS)
		return ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				      "tensor '%s': shape must be an array of at most %d dims",
				      name, SHARDD_MAX_DIMS);
	t->ndim = (uint32_t)json_array_size(shape);
	for (uint32_t d = 0; d < t->ndim; d++)
		if (json_u64(json_array_get(shape, d), INT64_MAX, &t->shape[d]))
			return ckpt_fmt_error(
				-SHARDD_E_MALFORMED, err, errlen,
				"tensor '%s': shape[%u] is not a non-negative integer", name, d);
	if (!json_is_array(offs) || json_array_size(offs) != 2 ||
	    json_u64(json_array_get(offs, 0), INT64_MAX, &t->begin) ||
	    json_u64(json_array_get(offs, 1), INT64_MAX, &t->end))
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"tensor '%s': data_offsets must be [begin, end] of non-negative integers",
			name);
	if (t->begin > t->end || t->end > data_size)
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"tensor '%s': data_offsets [%llu, %llu] out of range: need begin <= end <= %llu "
			"(the data's bytes)",
			name, (unsigned long long)t->begin, (unsigned long long)t->end,
			(unsigned long long)data_size);
	b = ckpt_st_bytes(t);
	if (b != t->end - t->begin)
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but %s shape %s needs %s%llu",
			name, (unsigned long long)t->begin, (unsigned long long)t->end,
			(unsigned long long)(t->end - t->begin),
			shd_safetensors_dtype_name(t->dtype), shape_str(t, sbuf, sizeof(sbuf)),
			b == UINT64_MAX ? "more than " : "",
			(unsigned long long)(b == UINT64_MAX ? INT64_MAX : b));
	return 0;
}

static int st_parse_metadata(json_t *v, char *err, size_t errlen)
{
	const char *k;
	json_t *s;

	if (!json_is_object(v))
		return ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				      "__metadata__ is not an object");
	json_object_foreach(v, k, s) if (!json_is_string(s)) return ckpt_fmt_error(
		-SHARDD_E_MALFORMED, err, errlen,
		"__metadata__ \"%.64s\" is not a string; metadata values are strings", k);
	return 0;
}

int shd_safetensors_parse(const uint8_t *buf, size_t len, uint64_t file_size,
			  struct shd_safetensors_file *out, char *err, size_t errlen)
{
	uint64_t hlen = 0, data_size, at = 0;
	json_t *root = NULL, *v;
	json_error_t jerr;
	const char *k;
	uint32_t i = 0;
	int rc;

	memset(out, 0, sizeof(*out));
	if (len < 8 || file_size < 8)
		return ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				      "file of %llu bytes is shorter than the 8-byte header length",
				      (unsigned long long)file_size);
	for (int b = 0; b < 8; b++)
		hlen |= (uint64_t)buf[b] << (8 * b);
	if (hlen < 2 || hlen > SHD_SAFETENSORS_HEADER_MAX || hlen > file_size - 8 || hlen > len - 8)
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"header length %llu out of range: need 2..%u and at most the file's %llu bytes "
			"after the length",
			(unsigned long long)hlen, SHD_SAFETENSORS_HEADER_MAX,
			(unsigned long long)(file_size - 8));
	if (buf[8] != '{')
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"header does not start with '{' (byte 0x%02x): not a safetensors file",
			buf[8]);
	out->data_start = 8 + hlen;
	data_size = file_size - out->data_start;
	root = json_loadb((const char *)buf + 8, hlen, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen, "header JSON, byte %d: %s",
				      jerr.position, jerr.text);
	if (!json_is_object(root)) {
		rc = ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				    "header JSON is not an object");
		goto fail;
	}
	out->ntensors =
		(uint32_t)json_object_size(root) - (json_object_get(root, "__metadata__") != NULL);
	if (json_object_size(root) > SHD_SAFETENSORS_TENSORS_MAX + 1) {
		rc = ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				    "%zu tensors; at most %u per file", json_object_size(root),
				    SHD_SAFETENSORS_TENSORS_MAX);
		goto fail;
	}
	rc = -ENOMEM;
	out->tensors = calloc(out->ntensors ? out->ntensors : 1, sizeof(*out->tensors));
	out->by_name = calloc(out->ntensors ? out->ntensors : 1, sizeof(*out->by_name));
	if (!out->tensors || !out->by_name)
		goto fail;
	json_object_foreach(root, k, v)
	{
		if (!strcmp(k, "__metadata__"))
			rc = st_parse_metadata(v, err, errlen);
		else
			rc = st_parse_tensor(k, v, data_size, &out->tensors[i++], err, errlen);
		if (rc)
			goto fail;
	}
	/* The tensors must tile [0, data_size): no overlap, no hole, nothing after. */
	qsort(out->tensors, out->ntensors, sizeof(*out->tensors), cmp_begin);
	for (i = 0; i < out->ntensors; i++) {
		const struct shd_safetensors_tensor *t = &out->tensors[i];

		if (t->begin != at) {
			rc = ckpt_fmt_error(
				-SHARDD_E_MALFORMED, err, errlen,
				"tensor '%s': data_offsets begin %llu, but the previous tensor ends at %llu: "
				"tensors must be back to back, without overlap or hole",
				t->name, (unsigned long long)t->begin, (unsigned long long)at);
			goto fail;
		}
		at = t->end;
	}
	if (at != data_size) {
		rc = ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"tensors end at data byte %llu, but the file holds %llu data bytes: the file is "
			"truncated or has trailing bytes",
			(unsigned long long)at, (unsigned long long)data_size);
		goto fail;
	}
	out->data_size = data_size;
	for (i = 0; i < out->ntensors; i++)
		out->by_name[i] = i;
	sort_file = out;
	qsort(out->by_name, out->ntensors, sizeof(*out->by_name), cmp_name_idx);
	sort_file = NULL;
	json_decref(root);
	return 0;
fail:
	json_decref(root);
	shd_safetensors_free(out);
	return rc;
}

int shd_safetensors_read(int fd, const char *path, struct shd_safetensors_file *out, char *err,
			 size_t errlen)
{
	uint8_t lenbuf[8], *buf;
	uint64_t hlen = 0, size;
	off_t end = lseek(fd, 0, SEEK_END);
	ssize_t n;
	int rc;

	memset(out, 0, sizeof(*out));
	if (end < 0)
		return ckpt_fmt_error(-errno, err, errlen, "%s: %s", path, strerror(errno));
	size = (uint64_t)end;
	n = pread(fd, lenbuf, 8, 0);
	if (n != 8)
		return ckpt_fmt_error(
			n < 0 ? -errno : -SHARDD_E_MALFORMED, err, errlen,
			"%s: file of %llu bytes is shorter than the 8-byte header length", path,
			(unsigned long long)size);
	for (int b = 0; b < 8; b++)
		hlen |= (uint64_t)lenbuf[b] << (8 * b);
	if (hlen > SHD_SAFETENSORS_HEADER_MAX || hlen > size - 8)
		return ckpt_fmt_error(
			-SHARDD_E_MALFORMED, err, errlen,
			"%s: header length %llu out of range: need 2..%u and at most the file's %llu bytes "
			"after the length",
			path, (unsigned long long)hlen, SHD_SAFETENSORS_HEADER_MAX,
			(unsigned long long)(size - 8));
	buf = malloc(8 + hlen);
	if (!buf)
		return -ENOMEM;
	for (uint64_t got = 0; got < 8 + hlen; got += (uint64_t)n) {
		n = pread(fd, buf + got, 8 + hlen - got, (off_t)got);
		if (n <= 0) {
			rc = ckpt_fmt_error(n < 0 ? -errno : -SHARDD_E_MALFORMED, err, errlen,
					    "%s: read: %s", path,
					    n < 0 ? strerror(errno) : "file shrank while read");
			free(buf);
			return rc;
		}
	}
	rc = shd_safetensors_parse(buf, 8 + hlen, size, out, err, errlen);
	free(buf);
	if (rc && err && errlen) {
		char tmp[512];

		snprintf(tmp, sizeof(tmp), "%s: %s", path, err);
		snprintf(err, errlen, "%s", tmp);
	}
	return rc;
}

const struct shd_safetensors_tensor *shd_safetensors_find(const struct shd_safetensors_file *f,
							  const char *name)
{
	uint32_t lo = 0, hi = f->ntensors;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;
		int c = strcmp(name, f->tensors[f->by_name[mid]].name);

		if (!c)
			return &f->tensors[f->by_name[mid]];
		if (c < 0)
			hi = mid;
		else
			lo = mid + 1;
	}
	return NULL;
}

void shd_safetensors_free(struct shd_safetensors_file *f)
{
	free(f->tensors);
	free(f->by_name);
	memset(f, 0, sizeof(*f));
}

/* ------------------------------------------------------------------ */
/* Manifest                                                            */
/* ------------------------------------------------------------------ */

/* A plain file name: 1..SHD_CKPT_FILE_NAME_MAX-1 bytes, no '/', no leading '.'. */
static int file_name_ok(const char *s)
{
	size_t n = strlen(s);

	return n > 0 && n < SHD_CKPT_FILE_NAME_MAX && !strchr(s, '/') && s[0] != '.';
}

static uint32_t dtype_by_name(const char *s, int allow_none)
{
	for (uint32_t d = allow_none ? SHARDD_DTYPE_NONE : SHARDD_DTYPE_FP32;
	     d < SHARDD_DTYPE_COUNT; d++)
		if (!strcmp(s, shardd_dtype_name(d)))
			return d;
	return UINT32_MAX;
}

#define MF_ERR(...) ckpt_fmt_error(-SHARDD_E_MALFORMED, err, errlen, "manifest: " __VA_ARGS__)

static int parse_optim(json_t *o, const char *path, struct shardd_optim_config *c, char *err,
		       size_t errlen)
{
	static const char *const keys[] = { "momentum", "dampening", "weight_decay",
					    "beta1",    "beta2",     "eps" };
	double *vals[] = { &c->momentum, &c->dampening, &c->weight_decay,
			   &c->beta1,    &c->beta2,     &c->eps };
	static const char *const flags[] = { "nesterov", "maximize", "amsgrad" };
	static const uint32_t bits[] = { SHARDD_OPTIM_NESTEROV, SHARDD_OPTIM_MAXIMIZE,
					 SHARDD_OPTIM_AMSGRAD };
	json_t *kind = json_object_get(o, "kind");

	memset(c, 0, sizeof(*c));
	if (json_is_null(o))
		return 0;
	if (!json_is_object(o) || !json_is_string(kind))
		return MF_ERR("%s.optimizer must be null or an object with a string \"kind\"",
			      path);
	if (!strcmp(json_string_value(kind), "sgd"))
		c->kind = SHARDD_OPTIM_SGD;
	else if (!strcmp(json_string_value(kind), "adamw"))
		c->kind = SHARDD_OPTIM_ADAMW;
	else
		return MF_ERR("%s.optimizer.kind \"%.16s\" is not \"sgd\" or \"adamw\"", path,
			      json_string_value(kind));
	for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++) {
		json_t *f = json_object_get(o, flags[i]);

		if (!json_is_boolean(f))
			return MF_ERR("%s.optimizer.%s must be true or false", path, flags[i]);
		if (json_is_true(f))
			c->flags |= bits[i];
	}
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		json_t *v = json_object_get(o, keys[i]);

		if (!json_is_number(v))
			return MF_ERR("%s.optimizer.%s must be a number", path, keys[i]);
		*vals[i] = json_number_value(v);
	}
	return 0;
}

static int parse_spec(json_t *p, const char *path, uint32_t i, struct shardd_param_spec *s,
		      char *err, size_t errlen)
{
	json_t *name = json_object_get(p, "name"), *dt = json_object_get(p, "dtype");
	json_t *shape = json_object_get(p, "shape");
	uint64_t sd;

	if (!json_is_object(p) || !json_is_string(name) || !json_is_string(dt) ||
	    !json_is_array(shape))
		return MF_ERR(
			"%s.params[%u] must be an object with string name and dtype and array shape",
			path, i);
	if (strlen(json_string_value(name)) >= sizeof(s->name))
		return MF_ERR("%s.params[%u].name of %zu bytes: param names are at most %d bytes",
			      path, i, strlen(json_string_value(name)), SHARDD_PARAM_NAME_MAX - 1);
	strcpy(s->name, json_string_value(name));
	s->dtype = dtype_by_name(json_string_value(dt), 0);
	if (s->dtype == UINT32_MAX)
		return MF_ERR("%s.params[%u].dtype \"%.16s\" is not fp32, bf16 or fp16", path, i,
			      json_string_value(dt));
	if (json_array_size(shape) > SHARDD_MAX_DIMS)
		return MF_ERR("%s.params[%u].shape has %zu dims; at most %d", path, i,
			      json_array_size(shape), SHARDD_MAX_DIMS);
	s->ndim = (uint32_t)json_array_size(shape);
	for (uint32_t d = 0; d < s->ndim; d++)
		if (json_u64(json_array_get(shape, d), SHD_LAYOUT_MAX_BYTES, &s->shape[d]))
			return MF_ERR("%s.params[%u].shape[%u] is not an integer in 0..%llu", path,
				      i, d, (unsigned long long)SHD_LAYOUT_MAX_BYTES);
	if (json_u64(json_object_get(p, "shard_dim"), SHARDD_MAX_DIMS, &sd))
		return MF_ERR("%s.params[%u].shard_dim is not an integer in 0..%d", path, i,
			      SHARDD_MAX_DIMS);
	s->shard_dim = (uint32_t)sd;
	return 0;
}

static int parse_file_field(json_t *g, const char *key, const char *path, char *dst, int optional,
			    char *err, size_t errlen)
{
	json_t *v = json_object_get(g, key);

	dst[0] = '\0';
	if (optional && (!v || json_is_null(v)))
		return 0;
	if (!json_is_string(v) || !file_name_ok(json_string_value(v)))
		return MF_ERR(
			"%s.%s must be a plain file name (1..%d bytes, no '/', no leading '.')",
			path, key, SHD_CKPT_FILE_NAME_MAX - 1);
	strcpy(dst, json_string_value(v));
	return 0;
}

/*
 * "shard_optim_steps" (optional): each rank shard's update count, `shard`
 * of them, none above optim_steps and the highest equal to it.
 */
static int parse_shard_steps(json_t *v, const char *path, uint32_t shard, struct shd_ckpt_group *g,
			     char *err, size_t errlen)
{
	uint64_t hi = 0;

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_array(v) || json_array_size(v) != shard)
		return MF_ERR(
			"%s.shard_optim_steps must be an array of %u integers, one per rank shard of the mesh",
			path, shard);
	g->shard_optim_steps = calloc(shard, sizeof(*g->shard_optim_steps));
	if (!g->shard_optim_steps)
		return -ENOMEM;
	for (uint32_t s = 0; s < shard; s++) {
		if (json_u64(json_array_get(v, s), g->optim_steps, &g->shard_optim_steps[s]))
			return MF_ERR(
				"%s.shard_optim_steps[%u] is not an integer in 0..optim_steps (%llu)",
				path, s, (unsigned long long)g->optim_steps);
		hi = g->shard_optim_steps[s] > hi ? g->shard_optim_steps[s] : hi;
	}
	if (hi != g->optim_steps)
		return MF_ERR("%s: optim_steps %llu is not the highest of shard_optim_steps (%llu)",
			      path, (unsigned long long)g->optim_steps, (unsigned long long)hi);
	return 0;
}

static int parse_group(json_t *jg, uint32_t gi, uint32_t shard, struct shd_ckpt_group *g, char *err,
		       size_t errlen)
{
	json_t *name = json_object_get(jg, "name"), *params = json_object_get(jg, "params");
	json_t *pdt = json_object_get(jg, "param_dtype"),
	       *rdt = json_object_get(jg, "reduce_dtype");
	struct shd_layout l;
	char path[32], lerr[256];
	int rc;

	snprintf(path, sizeof(path), "groups[%u]", gi);
	if (!json_is_object(jg) || !json_is_string(name) || !json_is_array(params) ||
	    !json_is_string(pdt) || !json_is_string(rdt))
		return MF_ERR(
			"%s must be an object with string name, param_dtype, reduce_dtype and array params",
			path);
	if (!json_string_value(name)[0] || strlen(json_string_value(name)) >= sizeof(g->hdr.name))
		return MF_ERR("%s.name of %zu bytes: group names are 1..%d bytes", path,
			      strlen(json_string_value(name)), SHARDD_NAME_MAX - 1);
	strcpy(g->hdr.name, json_string_value(name));
	g->hdr.param_dtype = dtype_by_name(json_string_value(pdt), 1);
	g->hdr.reduce_dtype = dtype_by_name(json_string_value(rdt), 1);
	if (g->hdr.param_dtype == UINT32_MAX || g->hdr.reduce_dtype == UINT32_MAX)
		return MF_ERR(
			"%s: param_dtype \"%.16s\" or reduce_dtype \"%.16s\" is not none, fp32, bf16 or "
			"fp16",
			path, json_string_value(pdt), json_string_value(rdt));
	if (json_array_size(params) < 1 || json_array_size(params) > SHARDD_MAX_PARAMS)
		return MF_ERR("%s.params has %zu entries; a group has 1..%d", path,
			      json_array_size(params), SHARDD_MAX_PARAMS);
	g->hdr.nparams = (uint32_t)json_array_size(params);
	g->specs = calloc(g->hdr.nparams, sizeof(*g->specs));
	if (!g->specs)
		return -ENOMEM;
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		rc = parse_spec(json_array_get(params, i), path, i, &g->specs[i], err, errlen);
		if (rc)
			return rc;
	}
	/* Every spec rule the daemon enforces at registration, for a shard group of 1. */
	rc = shd_layout_build(g->specs, g->hdr.nparams, 1, g->hdr.param_dtype, &l, lerr,
			      sizeof(lerr));
	if (rc == -ENOMEM)
		return rc;
	if (rc)
		return MF_ERR("%s '%s': %s", path, g->hdr.name, lerr);
	shd_layout_free(&l);
	rc = parse_optim(json_object_get(jg, "optimizer"), path, &g->optim, err, errlen);
	if (rc)
		return rc;
	if (g->optim.kind != SHARDD_OPTIM_NONE)
		g->hdr.flags = SHARDD_REGISTER_OPTIMIZER;
	if (json_u64(json_object_get(jg, "last_step"), INT64_MAX, &g->last_step) ||
	    json_u64(json_object_get(jg, "optim_steps"), INT64_MAX, &g->optim_steps))
		return MF_ERR("%s: last_step and optim_steps must be non-negative integers", path);
	if (g->optim_steps > g->last_step)
		return MF_ERR(
			"%s: optim_steps %llu > last_step %llu: a step applies at most one update",
			path, (unsigned long long)g->optim_steps, (unsigned long long)g->last_step);
	rc = parse_shard_steps(json_object_get(jg, "shard_optim_steps"), path, shard, g, err,
			       errlen);
	if (!rc)
		rc = parse_file_field(jg, "file", path, g->file, 0, err, errlen);
	if (!rc)
		rc = parse_file_field(jg, "optim_file", path, g->optim_file, 1, err, errlen);
	return rc;
}

static int parse_files(json_t *files, struct shd_ckpt_manifest *m, char *err, size_t errlen)
{
	const char **names;

	if (!json_is_array(files) || json_array_size(files) > 2u * SHD_CKPT_GROUPS_MAX)
		return MF_ERR("files must be an array of at most %u entries",
			      2u * SHD_CKPT_GROUPS_MAX);
	m->nfiles = (uint32_t)json_array_size(files);
	m->files = calloc(m->nfiles ? m->nfiles : 1, sizeof(*m->files));
	names = calloc(m->nfiles ? m->nfiles : 1, sizeof(*names));
	if (!m->files || !names) {
		free(names);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < m->nfiles; i++) {
		json_t *f = json_array_get(files, i), *crc = json_object_get(f, "crc32");
		char path[32], *end;
		unsigned long v = 0;
		int rc;

		snprintf(path, sizeof(path), "files[%u]", i);
		rc = parse_file_field(f, "name", path, m->files[i].name, 0, err, errlen);
		if (!rc && json_u64(json_object_get(f, "bytes"), INT64_MAX, &m->files[i].bytes))
			rc = MF_ERR("%s.bytes must be a non-negative integer", path);
		if (!rc && (!json_is_string(crc) || strlen(json_string_value(crc)) != 8 ||
			    (v = strtoul(json_string_value(crc), &end, 16), *end) ||
			    strspn(json_string_value(crc), "0123456789abcdef") != 8))
			rc = MF_ERR("%s.crc32 must be 8 lower-case hex digits", path);
		if (rc) {
			free(names);
			return rc;
		}
		m->files[i].crc32 = (uint32_t)v;
		names[i] = m->files[i].name;
	}
	qsort(names, m->nfiles, sizeof(*names), ckpt_cmp_str);
	for (uint32_t i = 1; i < m->nfiles; i++)
		if (!strcmp(names[i - 1], names[i])) {
			int rc = MF_ERR("file \"%s\" is listed twice in files", names[i]);

			free(names);
			return rc;
		}
	free(names);
	return 0;
}

int shd_ckpt_manifest_parse(const char *buf, size_t len, struct shd_ckpt_manifest *out, char *err,
			    size_t errlen)
{
	json_t *root, *fmt, *job, *mesh, *groups;
	const char **gnames = NULL;
	json_error_t jerr;
	uint64_t v, r, s;
	int rc;

	memset(out, 0, sizeof(*out));
	if (len > SHD_CKPT_MANIFEST_MAX)
		return MF_ERR("%zu bytes; at most %u", len, SHD_CKPT_MANIFEST_MAX);
	root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return MF_ERR("JSON, byte %d: %s", jerr.position, jerr.text);
	fmt = json_object_get(root, "format");
	job = json_object_get(root, "job");
	mesh = json_object_get(root, "mesh");
	groups = json_object_get(root, "groups");
	if (!json_is_object(root) || !json_is_string(fmt) ||
	    strcmp(json_string_value(fmt), "shardd-checkpoint")) {
		rc = MF_ERR("\"format\" is not \"shardd-checkpoint\": not a shardd checkpoint");
		goto fail;
	}
	if (json_u64(json_object_get(root, "version"), UINT32_MAX, &v) || v != SHD_CKPT_VERSION) {
		rc = MF_ERR("version is not %d, the only one this shardd reads", SHD_CKPT_VERSION);
		goto fail;
	}
	out->version = (uint32_t)v;
	if (!json_is_string(job) || !json_string_value(job)[0] ||
	    strlen(json_string_value(job)) >= sizeof(out->job)) {
		rc = MF_ERR("job must be a string of 1..%d bytes", SHARDD_NAME_MAX - 1);
		goto fail;
	}
	strcpy(out->job, json_string_value(job));
	if (json_u64(json_object_get(root, "step"), INT64_MAX, &out->step)) {
		rc = MF_ERR("step must be a non-negative integer");
		goto fail;
	}
	if (!json_is_object(mesh) ||
	    json_u64(json_object_get(mesh, "replicate"), SHARDD_MAX_WORLD, &r) ||
	    json_u64(json_object_get(mesh, "shard"), SHARDD_MAX_WORLD, &s) || !r || !s ||
	    r * s > SHARDD_MAX_WORLD) {
		rc = MF_ERR("mesh must be {replicate, shard}, each >= 1, their product at most %d",
			    SHARDD_MAX_WORLD);
		goto fail;
	}
	out->replicate = (uint32_t)r;
	out->shard = (uint32_t)s;
	rc = parse_files(json_object_get(root, "files"), out, err, errlen);
	if (rc)
		goto fail;
	if (!json_is_array(groups) || json_array_size(groups) < 1 ||
	    json_array_size(groups) > SHD_CKPT_GROUPS_MAX) {
		rc = MF_ERR("groups must be an array of 1..%d groups", SHD_CKPT_GROUPS_MAX);
		goto fail;
	}
	out->ngroups = (uint32_t)json_array_size(groups);
	out->groups = calloc(out->ngroups, sizeof(*out->groups));
	gnames = calloc(out->ngroups, sizeof(*gnames));
	rc = -ENOMEM;
	if (!out->groups || !gnames)
		goto fail;
	for (uint32_t i = 0; i < out->ngroups; i++) {
		struct shd_ckpt_group *g = &out->groups[i];

		rc = parse_group(json_array_get(groups, i), i, out->shard, g, err, errlen);
		if (rc)
			goto fail;
		if (!shd_ckpt_manifest_file(out, g->file) ||
		    (g->optim_file[0] && !shd_ckpt_manifest_file(out, g->optim_file))) {
			rc = MF_ERR(
				"groups[%u] '%s': file \"%s\" or optim_file \"%s\" is not listed in files",
				i, g->hdr.name, g->file, g->optim_file);
			goto fail;
		}
		gnames[i] = g->hdr.name;
	}
	qsort(gnames, out->ngroups, sizeof(*gnames), ckpt_cmp_str);
	for (uint32_t i = 1; i < out->ngroups; i++)
		if (!strcmp(gnames[i - 1], gnames[i])) {
			rc = MF_ERR("group '%s' appears twice; group names are unique in a job",
				    gnames[i]);
			goto fail;
		}
	free(gnames);
	json_decref(root);
	return 0;
fail:
	free(gnames);
	json_decref(root);
	shd_ckpt_manifest_free(out);
	return rc;
}

void shd_ckpt_manifest_free(struct shd_ckpt_manifest *m)
{
	for (uint32_t i = 0; m->groups && i < m->ngroups; i++) {
		free(m->groups[i].specs);
		free(m->groups[i].shard_optim_steps);
	}
	free(m->groups);
	free(m->files);
	memset(m, 0, sizeof(*m));
}

const struct shd_ckpt_file *shd_ckpt_manifest_file(const struct shd_ckpt_manifest *m,
						   const char *name)
{
	for (uint32_t i = 0; i < m->nfiles; i++)
		if (!strcmp(m->files[i].name, name))
			return &m->files[i];
	return NULL;
}

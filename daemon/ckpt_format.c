/* SPDX-License-Identifier: MIT */
/*
 * The checkpoint format (ckpt_format.h): safetensors headers and the
 * manifest, written and parsed. Parsing treats its input as hostile.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "ckpt_format.h"
#include "layout.h"

static int fmt_error(int rc, char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int fmt_error(int rc, char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return rc;
}

const char *shd_st_dtype_name(uint32_t dtype)
{
	switch (dtype) {
	case SHARDD_DTYPE_FP32: return "F32";
	case SHARDD_DTYPE_BF16: return "BF16";
	case SHARDD_DTYPE_FP16: return "F16";
	default: return NULL;
	}
}

static uint32_t st_dtype_code(const char *s)
{
	for (uint32_t d = SHARDD_DTYPE_FP32; d < SHARDD_DTYPE_COUNT; d++)
		if (!strcmp(s, shd_st_dtype_name(d)))
			return d;
	return SHARDD_DTYPE_NONE;
}

uint64_t shd_st_numel(const struct shd_st_tensor *t)
{
	uint64_t n = 1;

	for (uint32_t d = 0; d < t->ndim; d++)
		if (__builtin_mul_overflow(n, t->shape[d], &n))
			return UINT64_MAX;
	return n;
}

/* Bytes of a tensor, or UINT64_MAX on overflow. */
static uint64_t st_bytes(const struct shd_st_tensor *t)
{
	uint64_t n = shd_st_numel(t), b;

	if (n == UINT64_MAX || __builtin_mul_overflow(n, shardd_dtype_size(t->dtype), &b))
		return UINT64_MAX;
	return b;
}

/* "[2, 3]" into buf. */
static const char *shape_str(const struct shd_st_tensor *t, char *buf, size_t len)
{
	size_t o = 0;

	o += snprintf(buf + o, len - o, "[");
	for (uint32_t d = 0; d < t->ndim && o < len; d++)
		o += snprintf(buf + o, len - o, "%s%llu", d ? ", " : "", (unsigned long long)t->shape[d]);
	if (o < len)
		snprintf(buf + o, len - o, "]");
	return buf;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* ------------------------------------------------------------------ */
/* safetensors: writing                                                */
/* ------------------------------------------------------------------ */

int shd_st_build(struct shd_st_tensor *t, uint32_t n, uint8_t **hdr, size_t *hdrlen,
		 uint64_t *data_size, char *err, size_t errlen)
{
	json_t *root = NULL, *meta;
	const char **names = NULL;
	char *text = NULL;
	uint64_t off = 0;
	size_t tlen, padded;
	int rc = -ENOMEM;

	*hdr = NULL;
	if (n > SHD_ST_TENSORS_MAX)
		return fmt_error(-SHARDD_E_INVALID, err, errlen, "safetensors: %u tensors; at most %u per file",
				 n, SHD_ST_TENSORS_MAX);
	names = calloc(n ? n : 1, sizeof(*names));
	root = json_object();
	meta = json_pack("{s:s}", "format", "pt");
	if (!names || !root || !meta || json_object_set_new(root, "__metadata__", meta))
		goto out;
	for (uint32_t i = 0; i < n; i++) {
		const char *dt = shd_st_dtype_name(t[i].dtype);
		json_t *shape, *e;
		uint64_t b = st_bytes(&t[i]);

		if (!memchr(t[i].name, '\0', sizeof(t[i].name)) || !t[i].name[0] ||
		    !strcmp(t[i].name, "__metadata__")) {
			rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
				       "safetensors: tensor #%u: name is empty, too long or \"__metadata__\"", i);
			goto out;
		}
		if (!dt || t[i].ndim > SHARDD_MAX_DIMS || b == UINT64_MAX ||
		    __builtin_add_overflow(off, b, &t[i].end)) {
			rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
				       "safetensors: tensor '%s': dtype %u or ndim %u invalid, or its bytes overflow",
				       t[i].name, t[i].dtype, t[i].ndim);
			goto out;
		}
		t[i].begin = off;
		off = t[i].end;
		names[i] = t[i].name;
		shape = json_array();
		if (!shape)
			goto out;
		for (uint32_t d = 0; d < t[i].ndim; d++)
			if (json_array_append_new(shape, json_integer((json_int_t)t[i].shape[d]))) {
				json_decref(shape);
				goto out;
			}
		e = json_pack("{s:s,s:o,s:[I,I]}", "dtype", dt, "shape", shape, "data_offsets",
			      (json_int_t)t[i].begin, (json_int_t)t[i].end);
		if (!e)
			goto out;
		if (json_object_set_new(root, t[i].name, e)) {
			rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
				       "safetensors: tensor '%s': name is not UTF-8; names must be UTF-8",
				       t[i].name);
			goto out;
		}
	}
	qsort(names, n, sizeof(*names), cmp_str);
	for (uint32_t i = 1; i < n; i++)
		if (!strcmp(names[i - 1], names[i])) {
			rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
				       "safetensors: tensor '%s' appears twice; names must be unique in a file",
				       names[i]);
			goto out;
		}
	text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
	if (!text)
		goto out;
	tlen = strlen(text);
	padded = (tlen + 7) & ~(size_t)7;
	if (padded > SHD_ST_HEADER_MAX) {
		rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
			       "safetensors: header of %zu bytes; at most %u", padded, SHD_ST_HEADER_MAX);
		goto out;
	}
	*hdr = malloc(8 + padded);
	if (!*hdr)
		goto out;
	for (int i = 0; i < 8; i++)
		(*hdr)[i] = (uint8_t)((uint64_t)padded >> (8 * i));
	memcpy(*hdr + 8, text, tlen);
	memset(*hdr + 8 + tlen, ' ', padded - tlen);
	*hdrlen = 8 + padded;
	*data_size = off;
	rc = 0;
out:
	free(text);
	free(names);
	json_decref(root);
	return rc;
}

/* ------------------------------------------------------------------ */
/* safetensors: parsing                                                */
/* ------------------------------------------------------------------ */

static const struct shd_st_file *sort_file;

static int cmp_begin(const void *a, const void *b)
{
	const struct shd_st_tensor *x = a, *y = b;

	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	return x->end < y->end ? -1 : x->end > y->end;
}

static int cmp_name_idx(const void *a, const void *b)
{
	return strcmp(sort_file->tensors[*(const uint32_t *)a].name,
		      sort_file->tensors[*(const uint32_t *)b].name);
}

/* A JSON integer in [0, max], else -1. */
static int json_u64(const json_t *v, uint64_t max, uint64_t *out)
{
	json_int_t x;

	if (!json_is_integer(v))
		return -1;
	x = json_integer_value(v);
	if (x < 0 || (uint64_t)x > max)
		return -1;
	*out = (uint64_t)x;
	return 0;
}

/* Parse one tensor's entry {dtype, shape, data_offsets} into *t. */
static int st_parse_tensor(const char *name, json_t *v, uint64_t data_size, struct shd_st_tensor *t,
			   char *err, size_t errlen)
{
	json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
	json_t *offs = json_object_get(v, "data_offsets");
	char sbuf[256];
	uint64_t b;

	if (strlen(name) >= sizeof(t->name) || !name[0])
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "tensor name '%.40s...' of %zu bytes: names are 1..%d bytes", name,
				 strlen(name), SHD_CKPT_NAME_MAX - 1);
	strcpy(t->name, name);
	if (!json_is_object(v) || json_object_size(v) != 3 || !dt || !shape || !offs)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "tensor '%s': entry must be an object of exactly \"dtype\", \"shape\", "
				 "\"data_offsets\"", name);
	if (!json_is_string(dt))
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen, "tensor '%s': dtype is not a string", name);
	t->dtype = st_dtype_code(json_string_value(dt));
	if (t->dtype == SHARDD_DTYPE_NONE)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "tensor '%s': dtype \"%.16s\" is not one shardd reads (F32, BF16, F16)", name,
				 json_string_value(dt));
	if (!json_is_array(shape) || json_array_size(shape) > SHARDD_MAX_DIMS)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "tensor '%s': shape must be an array of at most %d dims", name, SHARDD_MAX_DIMS);
	t->ndim = (uint32_t)json_array_size(shape);
	for (uint32_t d = 0; d < t->ndim; d++)
		if (json_u64(json_array_get(shape, d), INT64_MAX, &t->shape[d]))
			return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
					 "tensor '%s': shape[%u] is not a non-negative integer", name, d);
	if (!json_is_array(offs) || json_array_size(offs) != 2 ||
	    json_u64(json_array_get(offs, 0), INT64_MAX, &t->begin) ||
	    json_u64(json_array_get(offs, 1), INT64_MAX, &t->end))
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "tensor '%s': data_offsets must be [begin, end] of non-negative integers", name);
	if (t->begin > t->end || t->end > data_size)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "tensor '%s': data_offsets [%llu, %llu] out of range: need begin <= end <= %llu "
				 "(the data's bytes)", name, (unsigned long long)t->begin,
				 (unsigned long long)t->end, (unsigned long long)data_size);
	b = st_bytes(t);
	if (b != t->end - t->begin)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but %s shape %s needs %s%llu",
				 name, (unsigned long long)t->begin, (unsigned long long)t->end,
				 (unsigned long long)(t->end - t->begin), shd_st_dtype_name(t->dtype),
				 shape_str(t, sbuf, sizeof(sbuf)), b == UINT64_MAX ? "more than " : "",
				 (unsigned long long)(b == UINT64_MAX ? INT64_MAX : b));
	return 0;
}

static int st_parse_metadata(json_t *v, char *err, size_t errlen)
{
	const char *k;
	json_t *s;

	if (!json_is_object(v))
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen, "__metadata__ is not an object");
	json_object_foreach(v, k, s)
		if (!json_is_string(s))
			return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
					 "__metadata__ \"%.64s\" is not a string; metadata values are strings", k);
	return 0;
}

int shd_st_parse(const uint8_t *buf, size_t len, uint64_t file_size, struct shd_st_file *out,
		 char *err, size_t errlen)
{
	uint64_t hlen = 0, data_size, at = 0;
	json_t *root = NULL, *v;
	json_error_t jerr;
	const char *k;
	uint32_t i = 0;
	int rc;

	memset(out, 0, sizeof(*out));
	if (len < 8 || file_size < 8)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "file of %llu bytes is shorter than the 8-byte header length",
				 (unsigned long long)file_size);
	for (int b = 0; b < 8; b++)
		hlen |= (uint64_t)buf[b] << (8 * b);
	if (hlen < 2 || hlen > SHD_ST_HEADER_MAX || hlen > file_size - 8 || hlen > len - 8)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "header length %llu out of range: need 2..%u and at most the file's %llu bytes "
				 "after the length", (unsigned long long)hlen, SHD_ST_HEADER_MAX,
				 (unsigned long long)(file_size - 8));
	if (buf[8] != '{')
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "header does not start with '{' (byte 0x%02x): not a safetensors file", buf[8]);
	out->data_start = 8 + hlen;
	data_size = file_size - out->data_start;
	root = json_loadb((const char *)buf + 8, hlen, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen, "header JSON, byte %d: %s", jerr.position,
				 jerr.text);
	if (!json_is_object(root)) {
		rc = fmt_error(-SHARDD_E_MALFORMED, err, errlen, "header JSON is not an object");
		goto fail;
	}
	out->ntensors = (uint32_t)json_object_size(root) - (json_object_get(root, "__metadata__") != NULL);
	if (json_object_size(root) > SHD_ST_TENSORS_MAX + 1) {
		rc = fmt_error(-SHARDD_E_MALFORMED, err, errlen, "%zu tensors; at most %u per file",
			       json_object_size(root), SHD_ST_TENSORS_MAX);
		goto fail;
	}
	rc = -ENOMEM;
	out->tensors = calloc(out->ntensors ? out->ntensors : 1, sizeof(*out->tensors));
	out->by_name = calloc(out->ntensors ? out->ntensors : 1, sizeof(*out->by_name));
	if (!out->tensors || !out->by_name)
		goto fail;
	json_object_foreach(root, k, v) {
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
		const struct shd_st_tensor *t = &out->tensors[i];

		if (t->begin != at) {
			rc = fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				       "tensor '%s': data_offsets begin %llu, but the previous tensor ends at %llu: "
				       "tensors must be back to back, without overlap or hole", t->name,
				       (unsigned long long)t->begin, (unsigned long long)at);
			goto fail;
		}
		at = t->end;
	}
	if (at != data_size) {
		rc = fmt_error(-SHARDD_E_MALFORMED, err, errlen,
			       "tensors end at data byte %llu, but the file holds %llu data bytes: the file is "
			       "truncated or has trailing bytes", (unsigned long long)at,
			       (unsigned long long)data_size);
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
	shd_st_free(out);
	return rc;
}

int shd_st_read(int fd, const char *path, struct shd_st_file *out, char *err, size_t errlen)
{
	uint8_t lenbuf[8], *buf;
	uint64_t hlen = 0, size;
	off_t end = lseek(fd, 0, SEEK_END);
	ssize_t n;
	int rc;

	memset(out, 0, sizeof(*out));
	if (end < 0)
		return fmt_error(-errno, err, errlen, "%s: %s", path, strerror(errno));
	size = (uint64_t)end;
	n = pread(fd, lenbuf, 8, 0);
	if (n != 8)
		return fmt_error(n < 0 ? -errno : -SHARDD_E_MALFORMED, err, errlen,
				 "%s: file of %llu bytes is shorter than the 8-byte header length", path,
				 (unsigned long long)size);
	for (int b = 0; b < 8; b++)
		hlen |= (uint64_t)lenbuf[b] << (8 * b);
	if (hlen > SHD_ST_HEADER_MAX || hlen > size - 8)
		return fmt_error(-SHARDD_E_MALFORMED, err, errlen,
				 "%s: header length %llu out of range: need 2..%u and at most the file's %llu bytes "
				 "after the length", path, (unsigned long long)hlen, SHD_ST_HEADER_MAX,
				 (unsigned long long)(size - 8));
	buf = malloc(8 + hlen);
	if (!buf)
		return -ENOMEM;
	for (uint64_t got = 0; got < 8 + hlen; got += (uint64_t)n) {
		n = pread(fd, buf + got, 8 + hlen - got, (off_t)got);
		if (n <= 0) {
			rc = fmt_error(n < 0 ? -errno : -SHARDD_E_MALFORMED, err, errlen, "%s: read: %s", path,
				       n < 0 ? strerror(errno) : "file shrank while read");
			free(buf);
			return rc;
		}
	}
	rc = shd_st_parse(buf, 8 + hlen, size, out, err, errlen);
	free(buf);
	if (rc && err && errlen) {
		char tmp[512];

		snprintf(tmp, sizeof(tmp), "%s: %s", path, err);
		snprintf(err, errlen, "%s", tmp);
	}
	return rc;
}

const struct shd_st_tensor *shd_st_find(const struct shd_st_file *f, const char *name)
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

void shd_st_free(struct shd_st_file *f)
{
	free(f->tensors);
	free(f->by_name);
	memset(f, 0, sizeof(*f));
}

/* ------------------------------------------------------------------ */
/* Manifest                                                            */
/* ------------------------------------------------------------------ */

static const char *optim_kind_name(uint32_t kind)
{
	switch (kind) {
	case SHARDD_OPTIM_NONE: return "none";
	case SHARDD_OPTIM_SGD: return "sgd";
	case SHARDD_OPTIM_ADAMW: return "adamw";
	default: return NULL;
	}
}

static json_t *dump_group(const struct shd_ckpt_group *g)
{
	json_t *params = json_array(), *jg = NULL, *opt = NULL;

	if (!params)
		return NULL;
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		const struct shardd_param_spec *s = &g->specs[i];
		json_t *shape = json_array(), *p;

		for (uint32_t d = 0; shape && d < s->ndim; d++)
			if (json_array_append_new(shape, json_integer((json_int_t)s->shape[d]))) {
				json_decref(shape);
				shape = NULL;
			}
		p = shape ? json_pack("{s:s,s:s,s:o,s:I}", "name", s->name, "dtype",
				      shardd_dtype_name(s->dtype), "shape", shape, "shard_dim",
				      (json_int_t)s->shard_dim) : NULL;
		if (!p || json_array_append_new(params, p))
			goto fail;
	}
	if (g->optim.kind != SHARDD_OPTIM_NONE) {
		opt = json_pack("{s:s,s:b,s:b,s:b,s:f,s:f,s:f,s:f,s:f,s:f}", "kind",
				optim_kind_name(g->optim.kind), "nesterov",
				!!(g->optim.flags & SHARDD_OPTIM_NESTEROV), "maximize",
				!!(g->optim.flags & SHARDD_OPTIM_MAXIMIZE), "amsgrad",
				!!(g->optim.flags & SHARDD_OPTIM_AMSGRAD), "momentum", g->optim.momentum,
				"dampening", g->optim.dampening, "weight_decay", g->optim.weight_decay,
				"beta1", g->optim.beta1, "beta2", g->optim.beta2, "eps", g->optim.eps);
		if (!opt)
			goto fail;
	} else {
		opt = json_null();
	}
	jg = json_pack("{s:s,s:s,s:s,s:o,s:o,s:I,s:I,s:s,s:s?}", "name", g->hdr.name, "param_dtype",
		       shardd_dtype_name(g->hdr.param_dtype), "reduce_dtype",
		       shardd_dtype_name(g->hdr.reduce_dtype), "optimizer", opt, "params", params,
		       "last_step", (json_int_t)g->last_step, "optim_steps", (json_int_t)g->optim_steps,
		       "file", g->file, "optim_file", g->optim_file[0] ? g->optim_file : NULL);
	return jg;
fail:
	json_decref(params);
	return NULL;
}

int shd_ckpt_manifest_dump(const struct shd_ckpt_manifest *m, char **json, char *err, size_t errlen)
{
	json_t *groups = json_array(), *files = json_array(), *root = NULL;
	int rc = -ENOMEM;

	*json = NULL;
	if (!groups || !files)
		goto out;
	for (uint32_t i = 0; i < m->ngroups; i++) {
		json_t *g = dump_group(&m->groups[i]);

		if (!g) {
			rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
				       "manifest: group '%s': a group or param name is not UTF-8; names must be "
				       "UTF-8 to be saved", m->groups[i].hdr.name);
			goto out;
		}
		if (json_array_append_new(groups, g))
			goto out;
	}
	for (uint32_t i = 0; i < m->nfiles; i++) {
		char crc[16];

		snprintf(crc, sizeof(crc), "%08x", m->files[i].crc32);
		if (json_array_append_new(files, json_pack("{s:s,s:I,s:s}", "name", m->files[i].name, "bytes",
							   (json_int_t)m->files[i].bytes, "crc32", crc)))
			goto out;
	}
	root = json_pack("{s:s,s:i,s:s,s:I,s:{s:i,s:i},s:O,s:O}", "format", "shardd-checkpoint",
			 "version", (int)m->version, "job", m->job, "step", (json_int_t)m->step, "mesh",
			 "replicate", (int)m->replicate, "shard", (int)m->shard, "groups", groups, "files",
			 files);
	if (!root) {
		rc = fmt_error(-SHARDD_E_INVALID, err, errlen, "manifest: job name '%s' is not UTF-8", m->job);
		goto out;
	}
	*json = json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
	rc = *json ? 0 : -ENOMEM;
out:
	json_decref(root);
	json_decref(groups);
	json_decref(files);
	return rc;
}

/* A plain file name: 1..SHD_CKPT_FILE_NAME_MAX-1 bytes, no '/', no leading '.'. */
static int file_name_ok(const char *s)
{
	size_t n = strlen(s);

	return n > 0 && n < SHD_CKPT_FILE_NAME_MAX && !strchr(s, '/') && s[0] != '.';
}

static uint32_t dtype_by_name(const char *s, int allow_none)
{
	for (uint32_t d = allow_none ? SHARDD_DTYPE_NONE : SHARDD_DTYPE_FP32; d < SHARDD_DTYPE_COUNT; d++)
		if (!strcmp(s, shardd_dtype_name(d)))
			return d;
	return UINT32_MAX;
}

#define MF_ERR(...) fmt_error(-SHARDD_E_MALFORMED, err, errlen, "manifest: " __VA_ARGS__)

static int parse_optim(json_t *o, const char *path, struct shardd_optim_config *c, char *err, size_t errlen)
{
	static const char *const keys[] = { "momentum", "dampening", "weight_decay", "beta1", "beta2", "eps" };
	double *vals[] = { &c->momentum, &c->dampening, &c->weight_decay, &c->beta1, &c->beta2, &c->eps };
	static const char *const flags[] = { "nesterov", "maximize", "amsgrad" };
	static const uint32_t bits[] = { SHARDD_OPTIM_NESTEROV, SHARDD_OPTIM_MAXIMIZE, SHARDD_OPTIM_AMSGRAD };
	json_t *kind = json_object_get(o, "kind");

	memset(c, 0, sizeof(*c));
	if (json_is_null(o))
		return 0;
	if (!json_is_object(o) || !json_is_string(kind))
		return MF_ERR("%s.optimizer must be null or an object with a string \"kind\"", path);
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

static int parse_spec(json_t *p, const char *path, uint32_t i, struct shardd_param_spec *s, char *err,
		      size_t errlen)
{
	json_t *name = json_object_get(p, "name"), *dt = json_object_get(p, "dtype");
	json_t *shape = json_object_get(p, "shape");
	uint64_t sd;

	if (!json_is_object(p) || !json_is_string(name) || !json_is_string(dt) || !json_is_array(shape))
		return MF_ERR("%s.params[%u] must be an object with string name and dtype and array shape",
			      path, i);
	if (strlen(json_string_value(name)) >= sizeof(s->name))
		return MF_ERR("%s.params[%u].name of %zu bytes: param names are at most %d bytes", path, i,
			      strlen(json_string_value(name)), SHARDD_PARAM_NAME_MAX - 1);
	strcpy(s->name, json_string_value(name));
	s->dtype = dtype_by_name(json_string_value(dt), 0);
	if (s->dtype == UINT32_MAX)
		return MF_ERR("%s.params[%u].dtype \"%.16s\" is not fp32, bf16 or fp16", path, i,
			      json_string_value(dt));
	if (json_array_size(shape) > SHARDD_MAX_DIMS)
		return MF_ERR("%s.params[%u].shape has %zu dims; at most %d", path, i, json_array_size(shape),
			      SHARDD_MAX_DIMS);
	s->ndim = (uint32_t)json_array_size(shape);
	for (uint32_t d = 0; d < s->ndim; d++)
		if (json_u64(json_array_get(shape, d), SHD_LAYOUT_MAX_BYTES, &s->shape[d]))
			return MF_ERR("%s.params[%u].shape[%u] is not an integer in 0..%llu", path, i, d,
				      (unsigned long long)SHD_LAYOUT_MAX_BYTES);
	if (json_u64(json_object_get(p, "shard_dim"), SHARDD_MAX_DIMS, &sd))
		return MF_ERR("%s.params[%u].shard_dim is not an integer in 0..%d", path, i, SHARDD_MAX_DIMS);
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
		return MF_ERR("%s.%s must be a plain file name (1..%d bytes, no '/', no leading '.')", path,
			      key, SHD_CKPT_FILE_NAME_MAX - 1);
	strcpy(dst, json_string_value(v));
	return 0;
}

static int parse_group(json_t *jg, uint32_t gi, struct shd_ckpt_group *g, char *err, size_t errlen)
{
	json_t *name = json_object_get(jg, "name"), *params = json_object_get(jg, "params");
	json_t *pdt = json_object_get(jg, "param_dtype"), *rdt = json_object_get(jg, "reduce_dtype");
	struct shd_layout l;
	char path[32], lerr[256];
	int rc;

	snprintf(path, sizeof(path), "groups[%u]", gi);
	if (!json_is_object(jg) || !json_is_string(name) || !json_is_array(params) || !json_is_string(pdt) ||
	    !json_is_string(rdt))
		return MF_ERR("%s must be an object with string name, param_dtype, reduce_dtype and array params",
			      path);
	if (!json_string_value(name)[0] || strlen(json_string_value(name)) >= sizeof(g->hdr.name))
		return MF_ERR("%s.name of %zu bytes: group names are 1..%d bytes", path,
			      strlen(json_string_value(name)), SHARDD_NAME_MAX - 1);
	strcpy(g->hdr.name, json_string_value(name));
	g->hdr.param_dtype = dtype_by_name(json_string_value(pdt), 1);
	g->hdr.reduce_dtype = dtype_by_name(json_string_value(rdt), 1);
	if (g->hdr.param_dtype == UINT32_MAX || g->hdr.reduce_dtype == UINT32_MAX)
		return MF_ERR("%s: param_dtype \"%.16s\" or reduce_dtype \"%.16s\" is not none, fp32, bf16 or "
			      "fp16", path, json_string_value(pdt), json_string_value(rdt));
	if (json_array_size(params) < 1 || json_array_size(params) > SHARDD_MAX_PARAMS)
		return MF_ERR("%s.params has %zu entries; a group has 1..%d", path, json_array_size(params),
			      SHARDD_MAX_PARAMS);
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
	rc = shd_layout_build(g->specs, g->hdr.nparams, 1, g->hdr.param_dtype, &l, lerr, sizeof(lerr));
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
		return MF_ERR("%s: optim_steps %llu > last_step %llu: a step applies at most one update", path,
			      (unsigned long long)g->optim_steps, (unsigned long long)g->last_step);
	rc = parse_file_field(jg, "file", path, g->file, 0, err, errlen);
	if (!rc)
		rc = parse_file_field(jg, "optim_file", path, g->optim_file, 1, err, errlen);
	return rc;
}

static int parse_files(json_t *files, struct shd_ckpt_manifest *m, char *err, size_t errlen)
{
	const char **names;

	if (!json_is_array(files) || json_array_size(files) > 2u * SHD_CKPT_GROUPS_MAX)
		return MF_ERR("files must be an array of at most %u entries", 2u * SHD_CKPT_GROUPS_MAX);
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
	qsort(names, m->nfiles, sizeof(*names), cmp_str);
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
	if (!json_is_object(root) || !json_is_string(fmt) || strcmp(json_string_value(fmt), "shardd-checkpoint")) {
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
	if (!json_is_object(mesh) || json_u64(json_object_get(mesh, "replicate"), SHARDD_MAX_WORLD, &r) ||
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

		rc = parse_group(json_array_get(groups, i), i, g, err, errlen);
		if (rc)
			goto fail;
		if (!shd_ckpt_manifest_file(out, g->file) ||
		    (g->optim_file[0] && !shd_ckpt_manifest_file(out, g->optim_file))) {
			rc = MF_ERR("groups[%u] '%s': file \"%s\" or optim_file \"%s\" is not listed in files", i,
				    g->hdr.name, g->file, g->optim_file);
			goto fail;
		}
		gnames[i] = g->hdr.name;
	}
	qsort(gnames, out->ngroups, sizeof(*gnames), cmp_str);
	for (uint32_t i = 1; i < out->ngroups; i++)
		if (!strcmp(gnames[i - 1], gnames[i])) {
			rc = MF_ERR("group '%s' appears twice; group names are unique in a job", gnames[i]);
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
	for (uint32_t i = 0; m->groups && i < m->ngroups; i++)
		free(m->groups[i].specs);
	free(m->groups);
	free(m->files);
	memset(m, 0, sizeof(*m));
}

const struct shd_ckpt_file *shd_ckpt_manifest_file(const struct shd_ckpt_manifest *m, const char *name)
{
	for (uint32_t i = 0; i < m->nfiles; i++)
		if (!strcmp(m->files[i].name, name))
			return &m->files[i];
	return NULL;
}

void shd_ckpt_file_names(uint32_t i, uint32_t n, char model[SHD_CKPT_FILE_NAME_MAX],
			 char optim[SHD_CKPT_FILE_NAME_MAX])
{
	if (n == 1) {
		snprintf(model, SHD_CKPT_FILE_NAME_MAX, "model.safetensors");
		snprintf(optim, SHD_CKPT_FILE_NAME_MAX, "optim.safetensors");
	} else {
		snprintf(model, SHD_CKPT_FILE_NAME_MAX, "model-%05u-of-%05u.safetensors", i + 1, n);
		snprintf(optim, SHD_CKPT_FILE_NAME_MAX, "optim-%05u-of-%05u.safetensors", i + 1, n);
	}
}

int shd_ckpt_group_tensors(const struct shd_ckpt_group *g, int optim, uint32_t nstates,
			   const char *const *states, struct shd_st_tensor **out, uint32_t *n)
{
	uint32_t per = optim ? nstates : 1, k = 0;
	struct shd_st_tensor *t;

	*n = g->hdr.nparams * per;
	t = calloc(*n ? *n : 1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		const struct shardd_param_spec *s = &g->specs[i];

		for (uint32_t j = 0; j < per; j++, k++) {
			if (optim)
				snprintf(t[k].name, sizeof(t[k].name), "%s.%s", s->name, states[j]);
			else
				snprintf(t[k].name, sizeof(t[k].name), "%s", s->name);
			t[k].dtype = optim ? SHARDD_DTYPE_FP32 : s->dtype;
			t[k].ndim = s->ndim;
			memcpy(t[k].shape, s->shape, sizeof(t[k].shape));
		}
	}
	*out = t;
	return 0;
}

int shd_ckpt_index_dump(const struct shd_ckpt_manifest *m, uint64_t total_size, char **json,
			char *err, size_t errlen)
{
	json_t *map = json_object(), *root = NULL;
	int rc = -ENOMEM;

	*json = NULL;
	if (!map)
		return -ENOMEM;
	for (uint32_t i = 0; i < m->ngroups; i++) {
		const struct shd_ckpt_group *g = &m->groups[i];

		for (uint32_t p = 0; p < g->hdr.nparams; p++) {
			json_t *prev = json_object_get(map, g->specs[p].name);

			if (prev) {
				rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
					       "param '%s' is in file %s and in group '%s': a checkpoint needs "
					       "param names unique across the job's groups",
					       g->specs[p].name, json_string_value(prev), g->hdr.name);
				goto out;
			}
			if (json_object_set_new(map, g->specs[p].name, json_string(g->file))) {
				rc = fmt_error(-SHARDD_E_INVALID, err, errlen,
					       "param '%s' of group '%s': name is not UTF-8", g->specs[p].name,
					       g->hdr.name);
				goto out;
			}
		}
	}
	root = json_pack("{s:{s:I},s:O}", "metadata", "total_size", (json_int_t)total_size, "weight_map", map);
	if (root)
		*json = json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
	rc = *json ? 0 : -ENOMEM;
out:
	json_decref(root);
	json_decref(map);
	return rc;
}

int shd_ckpt_file_crc(int fd, uint32_t *crc, uint64_t *bytes)
{
	static const size_t chunk = 1u << 20;
	uint8_t *buf = malloc(chunk);
	uLong c = crc32(0L, Z_NULL, 0);
	uint64_t off = 0;

	if (!buf)
		return -ENOMEM;
	for (;;) {
		ssize_t n = pread(fd, buf, chunk, (off_t)off);

		if (n < 0) {
			int e = errno;

			if (e == EINTR)
				continue;
			free(buf);
			return -e;
		}
		if (!n)
			break;
		c = crc32(c, buf, (uInt)n);
		off += (uint64_t)n;
	}
	free(buf);
	*crc = (uint32_t)c;
	*bytes = off;
	return 0;
}

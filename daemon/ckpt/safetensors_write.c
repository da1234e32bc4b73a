/* SPDX-License-Identifier: MIT */
/*
 * The checkpoint format (safetensors.h), written: safetensors headers, the
 * manifest, the Hugging Face index, and the names and tensors of a group's
 * files.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"
#include "safetensors_int.h"

/* ------------------------------------------------------------------ */
/* safetensors: writing                                                */
/* ------------------------------------------------------------------ */

int shd_safetensors_build(struct shd_safetensors_tensor *t, uint32_t n, uint8_t **hdr,
			  size_t *hdrlen, uint64_t *data_size, char *err, size_t errlen)
{
	json_t *root = NULL, *meta;
	const char **names = NULL;
	char *text = NULL;
	uint64_t off = 0;
	size_t tlen, padded;
	int rc = -ENOMEM;

	*hdr = NULL;
	if (n > SHD_SAFETENSORS_TENSORS_MAX)
		return ckpt_fmt_error(-SHARDD_E_INVALID, err, errlen,
				      "safetensors: %u tensors; at most %u per file", n,
				      SHD_SAFETENSORS_TENSORS_MAX);
	names = calloc(n ? n : 1, sizeof(*names));
	root = json_object();
	meta = json_pack("{s:s}", "format", "pt");
	if (!names || !root || !meta || json_object_set_new(root, "__metadata__", meta))
		goto out;
	for (uint32_t i = 0; i < n; i++) {
		const char *dt = shd_safetensors_dtype_name(t[i].dtype);
		json_t *shape, *e;
		uint64_t b = ckpt_st_bytes(&t[i]);

		if (!memchr(t[i].name, '\0', sizeof(t[i].name)) || !t[i].name[0] ||
		    !strcmp(t[i].name, "__metadata__")) {
			rc = ckpt_fmt_error(
				-SHARDD_E_INVALID, err, errlen,
				"safetensors: tensor #%u: name is empty, too long or \"__metadata__\"",
				i);
			goto out;
		}
		if (!dt || t[i].ndim > SHARDD_MAX_DIMS || b == UINT64_MAX ||
		    __builtin_add_overflow(off, b, &t[i].end)) {
			rc = ckpt_fmt_error(
				-SHARDD_E_INVALID, err, errlen,
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
			rc = ckpt_fmt_error(
				-SHARDD_E_INVALID, err, errlen,
				"safetensors: tensor '%s': name is not UTF-8; names must be UTF-8",
				t[i].name);
			goto out;
		}
	}
	qsort(names, n, sizeof(*names), ckpt_cmp_str);
	for (uint32_t i = 1; i < n; i++)
		if (!strcmp(names[i - 1], names[i])) {
			rc = ckpt_fmt_error(
				-SHARDD_E_INVALID, err, errlen,
				"safetensors: tensor '%s' appears twice; names must be unique in a file",
				names[i]);
			goto out;
		}
	text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
	if (!text)
		goto out;
	tlen = strlen(text);
	padded = (tlen + 7) & ~(size_t)7;
	if (padded > SHD_SAFETENSORS_HEADER_MAX) {
		rc = ckpt_fmt_error(-SHARDD_E_INVALID, err, errlen,
				    "safetensors: header of %zu bytes; at most %u", padded,
				    SHD_SAFETENSORS_HEADER_MAX);
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
/* Manifest                                                            */
/* ------------------------------------------------------------------ */

static const char *optim_kind_name(uint32_t kind)
{
	switch (kind) {
	case SHARDD_OPTIM_NONE:
		return "none";
	case SHARDD_OPTIM_SGD:
		return "sgd";
	case SHARDD_OPTIM_ADAMW:
		return "adamw";
	default:
		return NULL;
	}
}

/* A group's entry; `shard` rank shards in the mesh (the length of shard_optim_steps). */
static json_t *dump_group(const struct shd_ckpt_group *g, uint32_t shard)
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
				      (json_int_t)s->shard_dim)
			  : NULL;
		if (!p || json_array_append_new(params, p))
			goto fail;
	}
	if (g->optim.kind != SHARDD_OPTIM_NONE) {
		opt = json_pack("{s:s,s:b,s:b,s:b,s:f,s:f,s:f,s:f,s:f,s:f}", "kind",
				optim_kind_name(g->optim.kind), "nesterov",
				!!(g->optim.flags & SHARDD_OPTIM_NESTEROV), "maximize",
				!!(g->optim.flags & SHARDD_OPTIM_MAXIMIZE), "amsgrad",
				!!(g->optim.flags & SHARDD_OPTIM_AMSGRAD), "momentum",
				g->optim.momentum, "dampening", g->optim.dampening, "weight_decay",
				g->optim.weight_decay, "beta1", g->optim.beta1, "beta2",
				g->optim.beta2, "eps", g->optim.eps);
		if (!opt)
			goto fail;
	} else {
		opt = json_null();
	}
	jg = json_pack("{s:s,s:s,s:s,s:o,s:o,s:I,s:I,s:s,s:s?}", "name", g->hdr.name, "param_dtype",
		       shardd_dtype_name(g->hdr.param_dtype), "reduce_dtype",
		       shardd_dtype_name(g->hdr.reduce_dtype), "optimizer", opt, "params", params,
		       "last_step", (json_int_t)g->last_step, "optim_steps",
		       (json_int_t)g->optim_steps, "file", g->file, "optim_file",
		       g->optim_file[0] ? g->optim_file : NULL);
	if (jg && g->shard_optim_steps) {
		json_t *steps = json_array();

		for (uint32_t s = 0; steps && s < shard; s++)
			if (json_array_append_new(
				    steps, json_integer((json_int_t)g->shard_optim_steps[s]))) {
				json_decref(steps);
				steps = NULL;
			}
		if (!steps || json_object_set_new(jg, "shard_optim_steps", steps)) {
			json_decref(jg);
			return NULL;
		}
	}
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
		json_t *g = dump_group(&m->groups[i], m->shard);

		if (!g) {
			rc = ckpt_fmt_error(
				-SHARDD_E_INVALID, err, errlen,
				"manifest: group '%s': a group or param name is not UTF-8; names must be "
				"UTF-8 to be saved",
				m->groups[i].hdr.name);
			goto out;
		}
		if (json_array_append_new(groups, g))
			goto out;
	}
	for (uint32_t i = 0; i < m->nfiles; i++) {
		char crc[16];

		snprintf(crc, sizeof(crc), "%08x", m->files[i].crc32);
		if (json_array_append_new(
			    files, json_pack("{s:s,s:I,s:s}", "name", m->files[i].name, "bytes",
					     (json_int_t)m->files[i].bytes, "crc32", crc)))
			goto out;
	}
	root = json_pack("{s:s,s:i,s:s,s:I,s:{s:i,s:i},s:O,s:O}", "format", "shardd-checkpoint",
			 "version", (int)m->version, "job", m->job, "step", (json_int_t)m->step,
			 "mesh", "replicate", (int)m->replicate, "shard", (int)m->shard, "groups",
			 groups, "files", files);
	if (!root) {
		rc = ckpt_fmt_error(-SHARDD_E_INVALID, err, errlen,
				    "manifest: job name '%s' is not UTF-8", m->job);
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
			   const char *const *states, struct shd_safetensors_tensor **out,
			   uint32_t *n)
{
	uint32_t per = optim ? nstates : 1, k = 0;
	struct shd_safetensors_tensor *t;

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
				rc = ckpt_fmt_error(
					-SHARDD_E_INVALID, err, errlen,
					"param '%s' is in file %s and in group '%s': a checkpoint needs "
					"param names unique across the job's groups",
					g->specs[p].name, json_string_value(prev), g->hdr.name);
				goto out;
			}
			if (json_object_set_new(map, g->specs[p].name, json_string(g->file))) {
				rc = ckpt_fmt_error(-SHARDD_E_INVALID, err, errlen,
						    "param '%s' of group '%s': name is not UTF-8",
						    g->specs[p].name, g->hdr.name);
				goto out;
			}
		}
	}
	root = json_pack("{s:{s:I},s:O}", "metadata", "total_size", (json_int_t)total_size,
			 "weight_map", map);
	if (root)
		*json = json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
	rc = *json ? 0 : -ENOMEM;
out:
	json_decref(root);
	json_decref(map);
	return rc;
}

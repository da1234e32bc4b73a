/* SPDX-License-Identifier: MIT */
/*
 * fuzz_ckpt: the checkpoint parsers (daemon/ckpt/safetensors_parse.c) on hostile
 * files. The first byte picks the parser: even, a safetensors file (the
 * rest of the input is the whole file); odd, a manifest. Invariants: a
 * parse never reads past the input and never leaks; a safetensors header
 * it accepts tiles the data exactly, and the writer lays the same tensors
 * out the same way; a manifest it accepts dumps to JSON it accepts again,
 * equal field for field.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

static void check_safetensors(const uint8_t *data, size_t size)
{
	struct shd_safetensors_file f, again;
	char err[512];
	uint8_t *hdr = NULL, *file;
	size_t hdrlen;
	uint64_t bytes, at = 0;

	if (shd_safetensors_parse(data, size, size, &f, err, sizeof(err)))
		return;
	for (uint32_t i = 0; i < f.ntensors; i++) {
		if (f.tensors[i].begin != at || !shd_safetensors_find(&f, f.tensors[i].name))
			abort();
		at = f.tensors[i].end;
	}
	if (at != f.data_size || f.data_start + f.data_size != size)
		abort();
	/* The writer, given the tensors in file order, puts each at the same offsets. */
	if (shd_safetensors_build(f.tensors, f.ntensors, &hdr, &hdrlen, &bytes, err, sizeof(err)) ||
	    bytes != at)
		abort();
	file = calloc(1, hdrlen);
	if (!file)
		abort();
	memcpy(file, hdr, hdrlen);
	if (shd_safetensors_parse(file, hdrlen, hdrlen + bytes, &again, err, sizeof(err)) ||
	    again.ntensors != f.ntensors)
		abort();
	for (uint32_t i = 0; i < f.ntensors; i++)
		if (memcmp(&again.tensors[i], &f.tensors[i], sizeof(f.tensors[i])))
			abort();
	shd_safetensors_free(&again);
	shd_safetensors_free(&f);
	free(file);
	free(hdr);
}

static void check_manifest(const uint8_t *data, size_t size)
{
	struct shd_ckpt_manifest m, again;
	char err[512], *json;

	if (shd_ckpt_manifest_parse((const char *)data, size, &m, err, sizeof(err)))
		return;
	if (shd_ckpt_manifest_dump(&m, &json, err, sizeof(err)))
		abort();
	if (shd_ckpt_manifest_parse(json, strlen(json), &again, err, sizeof(err)))
		abort();
	if (again.ngroups != m.ngroups || again.nfiles != m.nfiles || again.step != m.step ||
	    memcmp(again.files, m.files, m.nfiles * sizeof(*m.files)))
		abort();
	for (uint32_t i = 0; i < m.ngroups; i++) {
		const struct shd_ckpt_group *a = &again.groups[i], *b = &m.groups[i];

		if (memcmp(&a->hdr, &b->hdr, sizeof(a->hdr)) ||
		    memcmp(a->specs, b->specs, b->hdr.nparams * sizeof(*b->specs)) ||
		    a->last_step != b->last_step || a->optim_steps != b->optim_steps ||
		    strcmp(a->file, b->file) || strcmp(a->optim_file, b->optim_file))
			abort();
	}
	shd_ckpt_manifest_free(&again);
	shd_ckpt_manifest_free(&m);
	free(json);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (!size)
		return 0;
	if (data[0] & 1)
		check_manifest(data + 1, size - 1);
	else
		check_safetensors(data + 1, size - 1);
	return 0;
}

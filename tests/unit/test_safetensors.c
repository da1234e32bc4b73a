/* SPDX-License-Identifier: MIT */
/*
 * The checkpoint format (daemon/safetensors*.c): safetensors headers written
 * and parsed, every rejection of a hostile header, the manifest's round trip
 * and rejections, the Hugging Face index and the file CRC. References are
 * hand-written headers and byte counts worked out in the comments, jansson
 * reading the writer's JSON, and CRC-32's published check value.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "safetensors.h"

/* A safetensors file image: the 8-byte length, `json`, then `data` zero bytes. */
static uint8_t *image(const char *json, size_t data, size_t *len)
{
	size_t h = strlen(json);
	uint8_t *b = calloc(1, 8 + h + data);

	cr_assert(b);
	for (int i = 0; i < 8; i++)
		b[i] = (uint8_t)((uint64_t)h >> (8 * i));
	memcpy(b + 8, json, h);
	*len = 8 + h + data;
	return b;
}

/* Parse an image that must be rejected; its error must contain `want`. */
static void rejects(const char *json, size_t data, const char *want)
{
	struct shd_safetensors_file f;
	char err[512] = "";
	size_t len;
	uint8_t *b = image(json, data, &len);
	int rc = shd_safetensors_parse(b, len, len, &f, err, sizeof(err));

	cr_assert_eq(rc, -SHARDD_E_MALFORMED, "%s: rc %d (%s)", json, rc, err);
	cr_assert(strstr(err, want), "%s: error '%s' does not name '%s'", json, err, want);
	cr_assert_null(f.tensors);
	free(b);
}

static struct shd_safetensors_tensor tensor(const char *name, uint32_t dtype, uint32_t ndim,
					    uint64_t d0, uint64_t d1)
{
	struct shd_safetensors_tensor t;

	memset(&t, 0, sizeof(t));
	snprintf(t.name, sizeof(t.name), "%s", name);
	t.dtype = dtype;
	t.ndim = ndim;
	t.shape[0] = d0;
	t.shape[1] = d1;
	return t;
}

Test(ckpt_format, build_packs_tensors_back_to_back_after_a_padded_header, .timeout = 10)
{
	struct shd_safetensors_tensor t[3] = {
		tensor("layer.w", SHARDD_DTYPE_FP32, 2, 2, 3), /* 6 * 4 = 24 bytes */
		tensor("layer.b", SHARDD_DTYPE_BF16, 1, 5, 0), /* 5 * 2 = 10 bytes */
		tensor("scale", SHARDD_DTYPE_FP16, 0, 0, 0),   /* 0-d: 1 element, 2 bytes */
	};
	uint8_t *hdr;
	size_t hdrlen;
	uint64_t data, hl = 0;
	char err[256] = "";
	json_t *root, *e;
	json_error_t jerr;

	cr_assert_eq(shd_safetensors_build(t, 3, &hdr, &hdrlen, &data, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(data, 36);
	cr_assert_eq(hdrlen % 8, 0, "data must start 8-byte aligned, header is %zu bytes", hdrlen);
	for (int i = 0; i < 8; i++)
		hl |= (uint64_t)hdr[i] << (8 * i);
	cr_assert_eq(hl, hdrlen - 8);
	root = json_loadb((const char *)hdr + 8, hl, 0, &jerr);
	cr_assert(root, "%s", jerr.text);
	e = json_object_get(root, "layer.b");
	cr_assert_str_eq(json_string_value(json_object_get(e, "dtype")), "BF16");
	cr_assert_eq(json_integer_value(json_array_get(json_object_get(e, "data_offsets"), 0)), 24);
	cr_assert_eq(json_integer_value(json_array_get(json_object_get(e, "data_offsets"), 1)), 34);
	cr_assert_eq(json_integer_value(json_array_get(json_object_get(e, "shape"), 0)), 5);
	e = json_object_get(root, "scale");
	cr_assert_eq(json_array_size(json_object_get(e, "shape")), 0);
	cr_assert_str_eq(
		json_string_value(json_object_get(json_object_get(root, "__metadata__"), "format")),
		"pt");
	cr_assert_eq(t[2].begin, 34);
	cr_assert_eq(t[2].end, 36);
	json_decref(root);
	free(hdr);
}

Test(ckpt_format, parse_reads_back_what_build_wrote, .timeout = 10)
{
	struct shd_safetensors_tensor t[3] = {
		tensor("b", SHARDD_DTYPE_FP32, 1, 7, 0),
		tensor("a", SHARDD_DTYPE_BF16, 2, 3, 0), /* a zero-size dim: no bytes */
		tensor("c", SHARDD_DTYPE_FP16, 2, 4, 2),
	};
	struct shd_safetensors_file f;
	const struct shd_safetensors_tensor *a, *c;
	uint8_t *hdr, *file;
	size_t hdrlen;
	uint64_t data;
	char err[256] = "";

	cr_assert_eq(shd_safetensors_build(t, 3, &hdr, &hdrlen, &data, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(data, 28 + 0 + 16);
	file = calloc(1, hdrlen + data);
	memcpy(file, hdr, hdrlen);
	cr_assert_eq(
		shd_safetensors_parse(file, hdrlen + data, hdrlen + data, &f, err, sizeof(err)), 0,
		"%s", err);
	cr_assert_eq(f.ntensors, 3);
	cr_assert_eq(f.data_start, hdrlen);
	cr_assert_eq(f.data_size, 44);
	a = shd_safetensors_find(&f, "a");
	c = shd_safetensors_find(&f, "c");
	cr_assert(a && c);
	cr_assert_null(shd_safetensors_find(&f, "d"));
	cr_assert_eq(a->dtype, SHARDD_DTYPE_BF16);
	cr_assert_eq(a->ndim, 2);
	cr_assert_eq(a->shape[0], 3);
	cr_assert_eq(a->shape[1], 0);
	cr_assert_eq(a->begin, 28);
	cr_assert_eq(a->end, 28);
	cr_assert_eq(c->begin, 28);
	cr_assert_eq(c->end, 44);
	cr_assert_eq(c->shape[1], 2);
	shd_safetensors_free(&f);
	free(file);
	free(hdr);
}

Test(ckpt_format, parse_accepts_a_hand_written_file_with_trailing_spaces, .timeout = 10)
{
	/* x: F32 [2] = 8 bytes; y: 0-d BF16 = 2 bytes. Out of order on purpose. */
	const char *json = "{\"y\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[8,10]},"
			   "\"__metadata__\":{\"format\":\"pt\"},"
			   "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}   ";
	struct shd_safetensors_file f;
	char err[256] = "";
	size_t len;
	uint8_t *b = image(json, 10, &len);

	cr_assert_eq(shd_safetensors_parse(b, len, len, &f, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(f.ntensors, 2);
	cr_assert_str_eq(f.tensors[0].name, "x");
	cr_assert_str_eq(f.tensors[1].name, "y");
	cr_assert_eq(shd_safetensors_find(&f, "y")->ndim, 0);
	shd_safetensors_free(&f);
	free(b);
}

#define T(name, dt, shape, b, e) \
	"\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

Test(ckpt_format, parse_rejects_a_header_length_past_the_file, .timeout = 10)
{
	struct shd_safetensors_file f;
	uint8_t b[16] = { 0xe8, 0x03 }; /* 1000 */
	char err[256] = "";

	cr_assert_eq(shd_safetensors_parse(b, sizeof(b), sizeof(b), &f, err, sizeof(err)),
		     -SHARDD_E_MALFORMED);
	cr_assert(strstr(err, "header length 1000 out of range"), "%s", err);
}

Test(ckpt_format, parse_rejects_a_header_length_past_the_limit, .timeout = 10)
{
	struct shd_safetensors_file f;
	uint8_t b[16] = { 0, 0, 0, 0, 0, 0, 0, 0x80 };
	char err[256] = "";

	cr_assert_eq(shd_safetensors_parse(b, sizeof(b), UINT64_MAX, &f, err, sizeof(err)),
		     -SHARDD_E_MALFORMED);
	cr_assert(strstr(err, "header length 9223372036854775808 out of range"), "%s", err);
}

Test(ckpt_format, parse_rejects_a_file_shorter_than_the_length, .timeout = 10)
{
	struct shd_safetensors_file f;
	uint8_t b[4] = { 0 };
	char err[256] = "";

	cr_assert_eq(shd_safetensors_parse(b, sizeof(b), sizeof(b), &f, err, sizeof(err)),
		     -SHARDD_E_MALFORMED);
	cr_assert(strstr(err, "file of 4 bytes"), "%s", err);
}

Test(ckpt_format, parse_rejects_each_malformed_header, .timeout = 10)
{
	rejects("[1,2]", 0, "does not start with '{'");
	rejects("{\"x\":", 0, "header JSON");
	rejects("{" T("x", "F64", "[1]", 0, 8) "}", 8, "dtype \"F64\" is not one shardd reads");
	rejects("{\"x\":{\"dtype\":1,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
		"tensor 'x': dtype is not a string");
	rejects("{" T("x", "F32", "[1,1,1,1,1,1,1,1,1]", 0, 4) "}", 4,
		"tensor 'x': shape must be an array of at most 8");
	rejects("{" T("x", "F32", "[-1]", 0, 4) "}", 4,
		"tensor 'x': shape[0] is not a non-negative integer");
	rejects("{" T("x", "F32", "[1.5]", 0, 4) "}", 4, "shape[0]");
	rejects("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4,
		"data_offsets must be [begin, end]");
	rejects("{" T("x", "F32", "[25]", 0, 100) "}", 8,
		"tensor 'x': data_offsets [0, 100] out of range: need begin <= end <= 8");
	rejects("{" T("x", "F32", "[0]", 4, 0) "}", 8, "data_offsets [4, 0] out of range");
	rejects("{" T("x", "F32", "[3]", 0, 8) "}", 8,
		"tensor 'x': data_offsets [0, 8] hold 8 bytes, but F32 shape [3] needs 12");
	rejects("{" T("x", "BF16", "[4294967296,4294967296]", 0, 8) "}", 8, "needs more than");
	rejects("{" T("x", "F32", "[2]", 0, 8) "," T("y", "F32", "[2]", 4, 12) "}", 12,
		"tensor 'y': data_offsets begin 4, but the previous tensor ends at 8");
	rejects("{" T("x", "F32", "[1]", 0, 4) "," T("y", "F32", "[1]", 8, 12) "}", 12,
		"tensor 'y': data_offsets begin 8, but the previous tensor ends at 4");
	rejects("{" T("x", "F32", "[1]", 0, 4) "}", 12,
		"tensors end at data byte 4, but the file holds 12 data bytes");
	rejects("{" T("x", "F32", "[1]", 0, 4) "," T("x", "F32", "[1]", 4, 8) "}", 8,
		"duplicate object key");
	rejects("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"extra\":1}}", 4,
		"tensor 'x': entry must be an object of exactly");
	rejects("{\"x\":[1]}", 0, "tensor 'x': entry must be an object");
	rejects("{\"__metadata__\":{\"format\":1}}", 0, "__metadata__ \"format\" is not a string");
	rejects("{\"__metadata__\":[]}", 0, "__metadata__ is not an object");
	rejects("{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
		"names are 1..127 bytes");
	rejects("{\""
		"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
		"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\":{\"dtype\":\"F32\",\"shape\":[1],"
		"\"data_offsets\":[0,4]}}",
		4, "of 143 bytes");
}

Test(ckpt_format, read_parses_the_header_of_a_file, .timeout = 10)
{
	struct shd_safetensors_tensor t[1] = { tensor("w", SHARDD_DTYPE_FP32, 1, 3, 0) };
	float vals[3] = { 1, 2, 3 }, back[3];
	struct shd_safetensors_file f;
	uint8_t *hdr;
	size_t hdrlen;
	uint64_t data;
	char err[256] = "";
	int fd = memfd_create("st", 0);

	cr_assert_eq(shd_safetensors_build(t, 1, &hdr, &hdrlen, &data, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(write(fd, hdr, hdrlen), (ssize_t)hdrlen);
	cr_assert_eq(write(fd, vals, sizeof(vals)), (ssize_t)sizeof(vals));
	cr_assert_eq(shd_safetensors_read(fd, "w.safetensors", &f, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(pread(fd, back, sizeof(back),
			   (off_t)(f.data_start + shd_safetensors_find(&f, "w")->begin)),
		     (ssize_t)sizeof(back));
	cr_assert_eq(memcmp(back, vals, sizeof(vals)), 0);
	shd_safetensors_free(&f);
	/* One byte short: the error names the file and the byte counts. */
	cr_assert_eq(ftruncate(fd, (off_t)(hdrlen + data - 1)), 0);
	cr_assert_eq(shd_safetensors_read(fd, "w.safetensors", &f, err, sizeof(err)),
		     -SHARDD_E_MALFORMED);
	cr_assert(
		strstr(err,
		       "w.safetensors: tensor 'w': data_offsets [0, 12] out of range: need begin <= end <= 11"),
		"%s", err);
	close(fd);
	free(hdr);
}

Test(ckpt_format, build_rejects_duplicate_and_bad_names, .timeout = 10)
{
	struct shd_safetensors_tensor t[2] = { tensor("w", SHARDD_DTYPE_FP32, 1, 1, 0),
					       tensor("w", SHARDD_DTYPE_FP32, 1, 1, 0) };
	uint8_t *hdr;
	size_t hdrlen;
	uint64_t data;
	char err[256] = "";

	cr_assert_eq(shd_safetensors_build(t, 2, &hdr, &hdrlen, &data, err, sizeof(err)),
		     -SHARDD_E_INVALID);
	cr_assert(strstr(err, "tensor 'w' appears twice"), "%s", err);
	snprintf(t[1].name, sizeof(t[1].name), "bad\xff");
	cr_assert_eq(shd_safetensors_build(t, 2, &hdr, &hdrlen, &data, err, sizeof(err)),
		     -SHARDD_E_INVALID);
	cr_assert(strstr(err, "is not UTF-8"), "%s", err);
	t[1] = tensor("v", SHARDD_DTYPE_NONE, 1, 1, 0);
	cr_assert_eq(shd_safetensors_build(t, 2, &hdr, &hdrlen, &data, err, sizeof(err)),
		     -SHARDD_E_INVALID);
	cr_assert(strstr(err, "tensor 'v': dtype 0"), "%s", err);
}

/* ------------------------------------------------------------------ */
/* Manifest                                                            */
/* ------------------------------------------------------------------ */

static struct shardd_param_spec pspec(const char *name, uint32_t dtype, uint32_t ndim, uint64_t d0,
				      uint64_t d1)
{
	struct shardd_param_spec s;

	memset(&s, 0, sizeof(s));
	snprintf(s.name, sizeof(s.name), "%s", name);
	s.dtype = dtype;
	s.ndim = ndim;
	s.shape[0] = d0;
	s.shape[1] = d1;
	return s;
}

/* A two-group manifest: "blocks" with AdamW (amsgrad), "head" without an optimizer. */
static void sample(struct shd_ckpt_manifest *m, struct shd_ckpt_group g[2],
		   struct shardd_param_spec s[3], struct shd_ckpt_file f[3])
{
	memset(m, 0, sizeof(*m));
	memset(g, 0, 2 * sizeof(*g));
	memset(f, 0, 3 * sizeof(*f));
	m->version = SHD_CKPT_VERSION;
	snprintf(m->job, sizeof(m->job), "train");
	m->step = 12;
	m->replicate = 2;
	m->shard = 2;
	s[0] = pspec("blocks.0.w", SHARDD_DTYPE_FP32, 2, 5, 3);
	s[1] = pspec("blocks.0.b", SHARDD_DTYPE_FP32, 1, 3, 0);
	s[2] = pspec("head.w", SHARDD_DTYPE_BF16, 2, 4, 4);
	s[2].shard_dim = 1;
	snprintf(g[0].hdr.name, sizeof(g[0].hdr.name), "blocks");
	g[0].hdr.nparams = 2;
	g[0].hdr.param_dtype = SHARDD_DTYPE_BF16;
	g[0].hdr.flags = SHARDD_REGISTER_OPTIMIZER;
	g[0].specs = &s[0];
	g[0].optim = (struct shardd_optim_config){ .kind = SHARDD_OPTIM_ADAMW,
						   .flags = SHARDD_OPTIM_AMSGRAD,
						   .weight_decay = 0.1,
						   .beta1 = 0.9,
						   .beta2 = 0.999,
						   .eps = 1e-8 };
	g[0].last_step = 12;
	g[0].optim_steps = 11;
	shd_ckpt_file_names(0, 2, g[0].file, g[0].optim_file);
	snprintf(g[1].hdr.name, sizeof(g[1].hdr.name), "head");
	g[1].hdr.nparams = 1;
	g[1].hdr.reduce_dtype = SHARDD_DTYPE_FP32;
	g[1].specs = &s[2];
	g[1].last_step = 12;
	shd_ckpt_file_names(1, 2, g[1].file, g[1].optim_file);
	g[1].optim_file[0] = '\0';
	m->ngroups = 2;
	m->groups = g;
	snprintf(f[0].name, sizeof(f[0].name), "%s", g[0].file);
	f[0].bytes = 1234;
	f[0].crc32 = 0xdeadbeef;
	snprintf(f[1].name, sizeof(f[1].name), "%s", g[0].optim_file);
	f[1].bytes = 99;
	f[1].crc32 = 0x0000000a;
	snprintf(f[2].name, sizeof(f[2].name), "%s", g[1].file);
	m->nfiles = 3;
	m->files = f;
}

Test(ckpt_format, manifest_round_trips_every_field, .timeout = 10)
{
	struct shd_ckpt_manifest m, back;
	struct shd_ckpt_group g[2];
	struct shardd_param_spec s[3];
	struct shd_ckpt_file f[3];
	char err[256] = "", *json;

	sample(&m, g, s, f);
	cr_assert_eq(shd_ckpt_manifest_dump(&m, &json, err, sizeof(err)), 0, "%s", err);
	cr_assert(strstr(json, "\"crc32\": \"deadbeef\""), "%s", json);
	cr_assert_eq(shd_ckpt_manifest_parse(json, strlen(json), &back, err, sizeof(err)), 0,
		     "%s\n%s", err, json);
	cr_assert_str_eq(back.job, "train");
	cr_assert_eq(back.step, 12);
	cr_assert_eq(back.replicate, 2);
	cr_assert_eq(back.shard, 2);
	cr_assert_eq(back.ngroups, 2);
	for (uint32_t i = 0; i < 2; i++) {
		cr_assert_eq(memcmp(&back.groups[i].hdr, &g[i].hdr, sizeof(g[i].hdr)), 0,
			     "group %u header", i);
		cr_assert_eq(
			memcmp(back.groups[i].specs, g[i].specs, g[i].hdr.nparams * sizeof(*s)), 0,
			"group %u specs", i);
		/* Bit-exact doubles: 0.1, 0.999 and 1e-8 survive the text. */
		cr_assert_eq(memcmp(&back.groups[i].optim, &g[i].optim, sizeof(g[i].optim)), 0,
			     "group %u optimizer", i);
		cr_assert_eq(back.groups[i].last_step, g[i].last_step);
		cr_assert_eq(back.groups[i].optim_steps, g[i].optim_steps);
		cr_assert_str_eq(back.groups[i].file, g[i].file);
		cr_assert_str_eq(back.groups[i].optim_file, g[i].optim_file);
	}
	cr_assert_str_eq(back.groups[0].file, "model-00001-of-00002.safetensors");
	cr_assert_str_eq(back.groups[0].optim_file, "optim-00001-of-00002.safetensors");
	cr_assert_eq(back.nfiles, 3);
	cr_assert_eq(memcmp(back.files, f, sizeof(f)), 0);
	cr_assert_eq(shd_ckpt_manifest_file(&back, "model-00002-of-00002.safetensors"),
		     &back.files[2]);
	shd_ckpt_manifest_free(&back);
	free(json);
}

/* Dump the sample, replace `from` by `to` in its text, and expect the parse to fail naming `want`. */
static void manifest_rejects(const char *from, const char *to, const char *want)
{
	struct shd_ckpt_manifest m, back;
	struct shd_ckpt_group g[2];
	struct shardd_param_spec s[3];
	struct shd_ckpt_file f[3];
	char err[512] = "", *json, *at, *edited;
	int rc;

	sample(&m, g, s, f);
	cr_assert_eq(shd_ckpt_manifest_dump(&m, &json, err, sizeof(err)), 0, "%s", err);
	at = strstr(json, from);
	cr_assert(at, "'%s' not in %s", from, json);
	cr_assert(asprintf(&edited, "%.*s%s%s", (int)(at - json), json, to, at + strlen(from)) > 0);
	rc = shd_ckpt_manifest_parse(edited, strlen(edited), &back, err, sizeof(err));
	cr_assert_eq(rc, -SHARDD_E_MALFORMED, "%s -> %s: rc %d", from, to, rc);
	cr_assert(strstr(err, want), "%s -> %s: error '%s' does not name '%s'", from, to, err,
		  want);
	cr_assert_null(back.groups);
	free(edited);
	free(json);
}

Test(ckpt_format, manifest_rejects_each_bad_field, .timeout = 10)
{
	manifest_rejects("\"version\": 1", "\"version\": 2", "version is not 1");
	manifest_rejects("\"shardd-checkpoint\"", "\"other\"", "not a shardd checkpoint");
	manifest_rejects("\"job\": \"train\"", "\"job\": \"\"", "job must be a string");
	manifest_rejects("\"step\": 12", "\"step\": -1", "step must be a non-negative integer");
	manifest_rejects("\"replicate\": 2", "\"replicate\": 0", "mesh must be {replicate, shard}");
	manifest_rejects("\"replicate\": 2", "\"replicate\": 1024", "their product at most 1024");
	manifest_rejects("\"name\": \"head\"", "\"name\": \"blocks\"",
			 "group 'blocks' appears twice");
	manifest_rejects("\"name\": \"blocks.0.b\"", "\"name\": \"blocks.0.w\"",
			 "groups[0] 'blocks': param 'blocks.0.w'");
	manifest_rejects("\"dtype\": \"bf16\"", "\"dtype\": \"int8\"",
			 "groups[1].params[0].dtype \"int8\"");
	manifest_rejects("\"shard_dim\": 1", "\"shard_dim\": 2",
			 "groups[1] 'head': param 'head.w'");
	manifest_rejects("\"param_dtype\": \"bf16\"", "\"param_dtype\": \"x\"",
			 "groups[0]: param_dtype \"x\"");
	manifest_rejects("\"kind\": \"adamw\"", "\"kind\": \"lion\"",
			 "groups[0].optimizer.kind \"lion\"");
	manifest_rejects("\"amsgrad\": true", "\"amsgrad\": 1",
			 "groups[0].optimizer.amsgrad must be true or false");
	manifest_rejects("\"eps\": 1e-8", "\"eps\": \"x\"",
			 "groups[0].optimizer.eps must be a number");
	manifest_rejects("\"optim_steps\": 11", "\"optim_steps\": 13",
			 "optim_steps 13 > last_step 12");
	manifest_rejects("\"file\": \"model-00001-of-00002.safetensors\"",
			 "\"file\": \"../etc/passwd\"", "groups[0].file must be a plain file name");
	manifest_rejects("\"file\": \"model-00001-of-00002.safetensors\"",
			 "\"file\": \"other.safetensors\"",
			 "file \"other.safetensors\" or optim_file");
	manifest_rejects("\"crc32\": \"deadbeef\"", "\"crc32\": \"DEADBEEF\"",
			 "files[0].crc32 must be 8 lower-case hex digits");
	manifest_rejects("\"crc32\": \"deadbeef\"", "\"crc32\": \"+eadbeef\"", "files[0].crc32");
	manifest_rejects("\"name\": \"optim-00001-of-00002.safetensors\"",
			 "\"name\": \"model-00001-of-00002.safetensors\"",
			 "is listed twice in files");
	manifest_rejects("\"bytes\": 99", "\"bytes\": 9.5",
			 "files[1].bytes must be a non-negative integer");
	manifest_rejects("{", "[", "JSON, byte");
	manifest_rejects("\"optim_steps\": 11", "\"optim_steps\": 11, \"shard_optim_steps\": [11]",
			 "groups[0].shard_optim_steps must be an array of 2 integers");
	manifest_rejects("\"optim_steps\": 11",
			 "\"optim_steps\": 11, \"shard_optim_steps\": [12, 11]",
			 "groups[0].shard_optim_steps[0] is not an integer in 0..optim_steps (11)");
	manifest_rejects("\"optim_steps\": 11",
			 "\"optim_steps\": 11, \"shard_optim_steps\": [10, 9]",
			 "groups[0]: optim_steps 11 is not the highest of shard_optim_steps (10)");
}

Test(ckpt_format, manifest_keeps_each_rank_shards_update_count_when_they_differ, .timeout = 10)
{
	struct shd_ckpt_manifest m, back;
	struct shd_ckpt_group g[2];
	struct shardd_param_spec s[3];
	struct shd_ckpt_file f[3];
	uint64_t counts[2] = { 11, 10 };
	char err[256] = "", *json;

	sample(&m, g, s, f);
	g[0].shard_optim_steps = counts;
	cr_assert_eq(shd_ckpt_manifest_dump(&m, &json, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(shd_ckpt_manifest_parse(json, strlen(json), &back, err, sizeof(err)), 0,
		     "%s\n%s", err, json);
	cr_assert_not_null(back.groups[0].shard_optim_steps, "%s", json);
	cr_assert_eq(back.groups[0].shard_optim_steps[0], 11);
	cr_assert_eq(back.groups[0].shard_optim_steps[1], 10);
	/* Equal counts write no list: the manifest of every other checkpoint is unchanged. */
	cr_assert_null(back.groups[1].shard_optim_steps);
	cr_assert(!strstr(strstr(json, "shard_optim_steps") + 1, "shard_optim_steps"), "%s", json);
	shd_ckpt_manifest_free(&back);
	free(json);
}

Test(ckpt_format, group_tensors_name_optimizer_state_after_the_param, .timeout = 10)
{
	struct shd_ckpt_manifest m;
	struct shd_ckpt_group g[2];
	struct shardd_param_spec s[3];
	struct shd_ckpt_file f[3];
	static const char *const states[] = { "exp_avg", "exp_avg_sq" };
	struct shd_safetensors_tensor *t;
	uint32_t n;

	sample(&m, g, s, f);
	cr_assert_eq(shd_ckpt_group_tensors(&g[0], 1, 2, states, &t, &n), 0);
	cr_assert_eq(n, 4);
	cr_assert_str_eq(t[0].name, "blocks.0.w.exp_avg");
	cr_assert_str_eq(t[1].name, "blocks.0.w.exp_avg_sq");
	cr_assert_str_eq(t[3].name, "blocks.0.b.exp_avg_sq");
	cr_assert_eq(t[3].ndim, 1);
	cr_assert_eq(t[3].shape[0], 3);
	free(t);
	cr_assert_eq(shd_ckpt_group_tensors(&g[1], 0, 0, NULL, &t, &n), 0);
	cr_assert_eq(n, 1);
	cr_assert_str_eq(t[0].name, "head.w");
	cr_assert_eq(t[0].dtype, SHARDD_DTYPE_BF16);
	free(t);
}

Test(ckpt_format, index_maps_every_param_to_its_file, .timeout = 10)
{
	struct shd_ckpt_manifest m;
	struct shd_ckpt_group g[2];
	struct shardd_param_spec s[3];
	struct shd_ckpt_file f[3];
	char err[256] = "", *json;
	json_t *root, *map;

	sample(&m, g, s, f);
	cr_assert_eq(shd_ckpt_index_dump(&m, 100, &json, err, sizeof(err)), 0, "%s", err);
	root = json_loads(json, 0, NULL);
	cr_assert(root);
	cr_assert_eq(json_integer_value(
			     json_object_get(json_object_get(root, "metadata"), "total_size")),
		     100);
	map = json_object_get(root, "weight_map");
	cr_assert_eq(json_object_size(map), 3);
	cr_assert_str_eq(json_string_value(json_object_get(map, "blocks.0.b")),
			 "model-00001-of-00002.safetensors");
	cr_assert_str_eq(json_string_value(json_object_get(map, "head.w")),
			 "model-00002-of-00002.safetensors");
	json_decref(root);
	free(json);
	snprintf(s[2].name, sizeof(s[2].name), "blocks.0.w");
	cr_assert_eq(shd_ckpt_index_dump(&m, 100, &json, err, sizeof(err)), -SHARDD_E_INVALID);
	cr_assert(
		strstr(err,
		       "param 'blocks.0.w' is in file model-00001-of-00002.safetensors and in group 'head'"),
		"%s", err);
}

Test(ckpt_format, file_names_follow_the_hugging_face_split_convention, .timeout = 10)
{
	char model[SHD_CKPT_FILE_NAME_MAX], optim[SHD_CKPT_FILE_NAME_MAX];

	shd_ckpt_file_names(0, 1, model, optim);
	cr_assert_str_eq(model, "model.safetensors");
	cr_assert_str_eq(optim, "optim.safetensors");
	shd_ckpt_file_names(2, 3, model, optim);
	cr_assert_str_eq(model, "model-00003-of-00003.safetensors");
	cr_assert_str_eq(optim, "optim-00003-of-00003.safetensors");
}

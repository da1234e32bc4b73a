/* SPDX-License-Identifier: MIT */
/*
 * Restore and reshard (SHARDD_INIT_RESTORE) through a real shardd: a 1 x 4
 * job with AdamW trains two steps and checkpoints; jobs of 1 x 3 (with
 * Shard(0) where the saved job had Shard(1)) and 2 x 2 restore from it.
 * References: the full params in the checkpoint's model.safetensors, read
 * by the test's own reader, against the restored ranks' shards as their
 * own mappings show them (assembled for the new mesh by the test); the
 * optimizer state by a checkpoint of the restored job, whose files must
 * equal the first's byte for byte (same tensors, same order, same bytes);
 * the last step each restored rank learns. Errors: a shape that differs,
 * a damaged file, a missing group.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "inproc.h"
#include "shardd.h"

#define NP   5
#define MAXW 4

static const struct shardd_param_desc saved[NP] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 10, 3 } },
	{ .name = "empty", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 0, 4 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 7 } },
	{ .name = "s", .dtype = SHARDD_DTYPE_FP32, .ndim = 0 },
	{ .name = "c", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shard_dim = 1, .shape = { 4, 8 } },
};

static const struct shardd_optim_config adamw = {
	.kind = SHARDD_OPTIM_ADAMW,
	.beta1 = 0.9,
	.beta2 = 0.999,
	.eps = 1e-8,
	.weight_decay = 0.01,
};

struct job {
	const char *name;
	uint32_t replicate, shard, world;
	const struct shardd_param_desc *params;
	struct shardd_client *c[MAXW];
	struct shardd_group *g[MAXW];
	int ret[MAXW];
	char err[MAXW][1024];
};

/* Attach every rank of `j` and register its group on one thread per rank; results in j->ret. */
static void job_start(struct harness_daemon *hd, struct job *j, const char *restore)
{
	struct inproc_reg reg[MAXW];

	j->world = j->replicate * j->shard;
	for (uint32_t r = 0; r < j->world; r++)
		cr_assert_eq(harness_attach(hd, j->name, r, j->replicate, j->shard, &j->c[r]), 0,
			     "%s", shardd_last_error());
	for (uint32_t r = 0; r < j->world; r++)
		reg[r] = (struct inproc_reg){ .c = j->c[r],
					      .name = "layer",
					      .params = j->params,
					      .nparams = NP,
					      .opts = { .optimizer = &adamw, .restore = restore } };
	inproc_register(reg, j->world);
	for (uint32_t r = 0; r < j->world; r++) {
		j->g[r] = reg[r].g;
		j->ret[r] = reg[r].ret;
		snprintf(j->err[r], sizeof(j->err[r]), "%s", reg[r].err);
	}
}

static void job_stop(struct job *j)
{
	for (uint32_t r = 0; r < j->world; r++) {
		if (!j->ret[r])
			shardd_group_close(j->g[r]);
		shardd_close(j->c[r]);
	}
}

static uint64_t rng_state = 0x1234567887654321ull;

static uint64_t valid_numel(const struct job *j, uint32_t r, uint32_t i)
{
	return inproc_valid_numel(j->g[r], j->params, i);
}

/* Random params, then two steps of random grads, every rank; then checkpoint(2). */
static void train_and_save(struct job *j)
{
	for (uint32_t r = 0; r < j->world; r++)
		for (uint32_t i = 0; i < NP; i++) {
			float *sh = shardd_group_shard(j->g[r], i);

			for (uint64_t e = 0; e < valid_numel(j, r, i); e++)
				sh[e] = inproc_rnd(&rng_state);
		}
	for (uint64_t step = 1; step <= 2; step++) {
		for (uint32_t r = 0; r < j->world; r++)
			for (uint32_t i = 0; i < NP; i++) {
				float *gr = shardd_group_grad(j->g[r], i);

				for (uint64_t e = 0;
				     e < shardd_group_layout(j->g[r], i)->grad_bytes / 4; e++)
					gr[e] = inproc_rnd(&rng_state);
			}
		inproc_reduce(j->c, j->g, j->world, step, 0);
		for (uint32_t r = 0; r < j->world; r++)
			cr_assert_eq(shardd_step(j->g[r], step, 0.01, 0, 0, 0), SHARDD_STEP_APPLIED,
				     "%s", shardd_last_error());
	}
	inproc_checkpoint(j->c, j->world, 2);
}

static uint8_t *slurp(const char *path, size_t *len)
{
	FILE *fp = fopen(path, "rb");
	uint8_t *b;

	cr_assert(fp, "cannot open %s", path);
	fseek(fp, 0, SEEK_END);
	*len = (size_t)ftell(fp);
	fseek(fp, 0, SEEK_SET);
	b = malloc(*len ? *len : 1);
	cr_assert_eq(fread(b, 1, *len, fp), *len);
	fclose(fp);
	return b;
}

/* The data of tensor `name` in the safetensors image `b`, read with jansson. */
static const float *tensor_data(const uint8_t *b, size_t len, const char *name)
{
	uint64_t hl = 0, begin;
	json_t *h, *e;

	for (int i = 0; i < 8; i++)
		hl |= (uint64_t)b[i] << (8 * i);
	cr_assert(8 + hl <= len);
	h = json_loadb((const char *)b + 8, hl, 0, NULL);
	cr_assert(h);
	e = json_object_get(h, name);
	cr_assert(e, "tensor '%s' missing", name);
	begin = (uint64_t)json_integer_value(json_array_get(json_object_get(e, "data_offsets"), 0));
	json_decref(h);
	return (const float *)(b + 8 + hl + begin);
}

/* Full element e of param i from the ranks of replica u of job j (their own mappings). */
static float full_elem(const struct job *j, uint32_t u, uint32_t i, uint64_t e)
{
	const struct shardd_param_desc *d = &j->params[i];

	if (d->ndim && d->shard_dim == 1) {
		uint64_t cols = d->shape[1] / j->shard, row = e / d->shape[1],
			 col = e % d->shape[1];

		return ((float *)shardd_group_shard(j->g[u * j->shard + col / cols],
						    i))[row * cols + col % cols];
	}
	for (uint32_t s = 0; s < j->shard; s++) {
		uint64_t n = valid_numel(j, u * j->shard + s, i);

		if (e < n)
			return ((float *)shardd_group_shard(j->g[u * j->shard + s], i))[e];
		e -= n;
	}
	cr_assert_fail("element past the param");
	return 0;
}

/* Every replica of restored job j holds the params of checkpoint `dir`, and every rank learned step 2. */
static void expect_restored(const struct job *j, const char *dir)
{
	char path[512];
	size_t len;
	uint8_t *model;
	uint64_t nonzero = 0;

	snprintf(path, sizeof(path), "%s/model.safetensors", dir);
	model = slurp(path, &len);
	for (uint32_t r = 0; r < j->world; r++)
		cr_assert_eq(shardd_group_last_step(j->g[r]), 2, "rank %u", r);
	/* The saved params are random: a checkpoint of zeros restored as zeros does not pass. */
	for (uint32_t u = 0; u < j->replicate; u++)
		for (uint32_t i = 0; i < NP; i++) {
			const float *t = tensor_data(model, len, j->params[i].name);

			for (uint64_t e = 0; e < inproc_numel(&j->params[i]); e++) {
				float got = full_elem(j, u, i, e);

				nonzero += got != 0.0f;

				cr_assert_eq(memcmp(&got, &t[e], 4), 0,
					     "job %ux%u replica %u param '%s'[%llu]: %.9g, "
					     "checkpoint %.9g",
					     j->replicate, j->shard, u, j->params[i].name,
					     (unsigned long long)e, got, t[e]);
			}
		}
	cr_assert_gt(nonzero, 40 * j->replicate, "only %llu nonzero elements restored",
		     (unsigned long long)nonzero);
	free(model);
}

static void expect_same_file(const char *a, const char *b)
{
	size_t la, lb;
	uint8_t *x = slurp(a, &la), *y = slurp(b, &lb);

	cr_assert_eq(la, lb, "%s is %zu bytes, %s %zu", a, la, b, lb);
	cr_assert_eq(memcmp(x, y, la), 0, "%s and %s differ", a, b);
	free(x);
	free(y);
}

struct fixture {
	struct harness_daemon hd;
	char state[64], saved_dir[160];
	struct job src;
};

/* A daemon with a state dir, and job "src" (1 x 4) trained and saved at step 2. */
static void setup(struct fixture *f)
{
	const char *extra[] = { "--collective-timeout", "20", "--state-dir", f->state, NULL };

	memset(f, 0, sizeof(*f));
	snprintf(f->state, sizeof(f->state), "/tmp/shardd-restore-XXXXXX");
	cr_assert(mkdtemp(f->state));
	cr_assert_eq(harness_daemon_start(&f->hd, extra), 0, "shardd did not start");
	f->src = (struct job){ .name = "src", .replicate = 1, .shard = 4, .params = saved };
	job_start(&f->hd, &f->src, NULL);
	for (uint32_t r = 0; r < 4; r++)
		cr_assert_eq(f->src.ret[r], 0, "rank %u: %s", r, f->src.err[r]);
	train_and_save(&f->src);
	snprintf(f->saved_dir, sizeof(f->saved_dir), "%s/src/step-000000000002", f->state);
}

static void teardown(struct fixture *f)
{
	job_stop(&f->src);
	harness_daemon_stop_expect_clean(&f->hd);
	harness_rm_tree(f->state);
}

/* Restore into job `name` at mesh R x S with `params`; then save it and compare its files with the source's. */
static void restore_and_compare(struct fixture *f, const char *name, uint32_t rep, uint32_t shard,
				const struct shardd_param_desc *params)
{
	struct job j = { .name = name, .replicate = rep, .shard = shard, .params = params };
	char a[256], b[256];

	job_start(&f->hd, &j, f->saved_dir);
	for (uint32_t r = 0; r < j.world; r++)
		cr_assert_eq(j.ret[r], 0, "%s rank %u: %s", name, r, j.err[r]);
	expect_restored(&j, f->saved_dir);
	inproc_checkpoint(j.c, j.world, 2);
	snprintf(a, sizeof(a), "%s/model.safetensors", f->saved_dir);
	snprintf(b, sizeof(b), "%s/%s/step-000000000002/model.safetensors", f->state, name);
	expect_same_file(a, b);
	snprintf(a, sizeof(a), "%s/optim.safetensors", f->saved_dir);
	snprintf(b, sizeof(b), "%s/%s/step-000000000002/optim.safetensors", f->state, name);
	expect_same_file(a, b);
	job_stop(&j);
}

Test(restore, four_ranks_saved_restore_at_three_ranks_with_another_shard_dim, .timeout = 90)
{
	struct fixture f;
	struct shardd_param_desc p3[NP];

	setup(&f);
	memcpy(p3, saved, sizeof(p3));
	p3[4].shard_dim = 0; /* 8 columns do not split over 3 ranks: Shard(0) instead */
	restore_and_compare(&f, "r3", 1, 3, p3);
	teardown(&f);
}

Test(restore, four_ranks_saved_restore_at_two_by_two, .timeout = 90)
{
	struct fixture f;

	setup(&f);
	restore_and_compare(&f, "r22", 2, 2, saved);
	teardown(&f);
}

/* Register job `name` (1 x 2) restoring from `dir` with `params`; every rank must fail naming `want`. */
static void restore_fails(struct fixture *f, const char *name, const char *dir,
			  const struct shardd_param_desc *params, const char *want)
{
	struct job j = { .name = name, .replicate = 1, .shard = 2, .params = params };

	job_start(&f->hd, &j, dir);
	for (uint32_t r = 0; r < j.world; r++) {
		cr_assert_lt(j.ret[r], 0, "%s rank %u registered", name, r);
		cr_assert(strstr(j.err[r], want), "%s rank %u: '%s' does not say '%s'", name, r,
			  j.err[r], want);
	}
	job_stop(&j);
}

Test(restore, errors_name_the_tensor_the_file_and_both_shapes, .timeout = 90)
{
	struct fixture f;
	struct shardd_param_desc bad[NP];
	char want[512], copy[200], cmd[600];
	int fd;

	setup(&f);
	memcpy(bad, saved, sizeof(bad));
	bad[0].shape[1] = 4;
	snprintf(want, sizeof(want),
		 "tensor 'w' in %s/model.safetensors: the group registers fp32 [10, 4], "
		 "the file holds fp32 [10, 3]",
		 f.saved_dir);
	restore_fails(&f, "shape", f.saved_dir, bad, want);
	/* A damaged copy: one data byte flipped, the size kept. */
	snprintf(copy, sizeof(copy), "%s/damaged", f.state);
	snprintf(cmd, sizeof(cmd), "cp -r %s %s", f.saved_dir, copy);
	cr_assert_eq(system(cmd), 0);
	snprintf(cmd, sizeof(cmd), "%s/model.safetensors", copy);
	fd = open(cmd, O_RDWR);
	cr_assert_geq(fd, 0);
	{
		struct stat st;
		uint8_t byte;

		cr_assert_eq(fstat(fd, &st), 0);
		cr_assert_eq(pread(fd, &byte, 1, st.st_size - 1), 1);
		byte ^= 0x40;
		cr_assert_eq(pwrite(fd, &byte, 1, st.st_size - 1), 1);
	}
	close(fd);
	snprintf(want, sizeof(want), "%s/model.safetensors: CRC-32", copy);
	restore_fails(&f, "damaged", copy, saved, want);
	snprintf(want, sizeof(want),
		 "holds no manifest.json, no step-N checkpoint, "
		 "no model.safetensors.index.json and no model.safetensors");
	restore_fails(&f, "nowhere", "/nonexistent-shardd-checkpoint", saved, want);
	teardown(&f);
}

Test(restore, from_the_state_dir_starts_a_new_job_from_zero, .timeout = 90)
{
	struct fixture f;
	struct job j = { .name = "fresh", .replicate = 1, .shard = 2, .params = saved };

	setup(&f);
	job_start(&f.hd, &j, "");
	for (uint32_t r = 0; r < j.world; r++) {
		cr_assert_eq(j.ret[r], 0, "rank %u: %s", r, j.err[r]);
		cr_assert_eq(shardd_group_last_step(j.g[r]), 0);
		cr_assert_eq(((float *)shardd_group_shard(j.g[r], 0))[0], 0.0f);
	}
	job_stop(&j);
	teardown(&f);
}

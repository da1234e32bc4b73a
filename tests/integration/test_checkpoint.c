/* SPDX-License-Identifier: MIT */
/*
 * Checkpoints written by a real shardd (the checkpoint op, --state-dir,
 * --keep): a 1 x 4 job with AdamW (amsgrad) steps twice, checkpoints, and
 * the test reads the directory back with its own reader (8-byte length,
 * jansson for the header, the data at its offsets; zlib for the CRCs).
 * References: full params assembled by the test from the shards the ranks
 * see in their own mappings, and the optimizer state from the kernels'
 * scalar path run on the same sharded grads (as test_optim_daemon.c).
 * Params cover padding rows (10 rows over 4 ranks), no elements, a 0-d
 * scalar and Shard(1).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "harness.h"
#include "inproc.h"
#include "shardd.h"

#define NP    5
#define WORLD 4

static const struct shardd_param_desc params[NP] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 10, 3 } },
	{ .name = "empty", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 0, 4 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 7 } },
	{ .name = "s", .dtype = SHARDD_DTYPE_FP32, .ndim = 0 },
	{ .name = "c", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shard_dim = 1, .shape = { 4, 8 } },
};

static const struct shardd_optim_config adamw = {
	.kind = SHARDD_OPTIM_ADAMW,
	.flags = SHARDD_OPTIM_AMSGRAD,
	.beta1 = 0.9,
	.beta2 = 0.999,
	.eps = 1e-8,
	.weight_decay = 0.01,
};

struct fixture {
	struct harness_daemon hd;
	char state[64];
	struct shardd_client *c[WORLD];
	struct shardd_group *g[WORLD];
};

/* A daemon (with --state-dir, --keep and --checkpoint-every as given) and the 1 x 4 job registered. */
static void start(struct fixture *f, const char *keep, int with_state_dir, const char *every)
{
	const char *extra[10] = { "--collective-timeout", "20" };
	const struct shardd_group_opts opts = { .optimizer = &adamw };
	int n = 2;

	memset(f, 0, sizeof(*f));
	snprintf(f->state, sizeof(f->state), "/tmp/shardd-ckpt-XXXXXX");
	cr_assert(mkdtemp(f->state));
	if (with_state_dir) {
		extra[n++] = "--state-dir";
		extra[n++] = f->state;
	}
	if (keep) {
		extra[n++] = "--keep";
		extra[n++] = keep;
	}
	if (every) {
		extra[n++] = "--checkpoint-every";
		extra[n++] = every;
	}
	inproc_start(&f->hd, extra, "ck", 1, WORLD, SHARDD_HELLO_DEVICE_HOST, f->c);
	inproc_register_ok(f->c, WORLD, "layer", params, NP, NULL, &opts, f->g);
}

static void finish(struct fixture *f)
{
	inproc_finish(&f->hd, f->c, f->g, WORLD);
	harness_rm_tree(f->state);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

/* Elements of real data in the rank's shard of param i (a prefix of it). */
static uint64_t valid_numel(const struct shardd_group *g, uint32_t i)
{
	return inproc_valid_numel(g, params, i);
}

/* Each rank's params and reference optimizer state (random params, zero state), per param and state. */
static void ref_init(struct inproc_ref *ref, struct fixture *f)
{
	memset(ref, 0, sizeof(*ref));
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = valid_numel(f->g[r], i);
			float *sh = shardd_group_shard(f->g[r], i);

			inproc_ref_alloc(ref, r, i, n);
			for (uint64_t e = 0; e < n; e++)
				sh[e] = ref->p[r][i][e] = inproc_rnd(&rng_state);
		}
}

/* The reference of every rank's AdamW step (the ranks' next) on its sharded grads, lr 0.01. */
static void ref_step(struct inproc_ref *ref, struct fixture *f)
{
	for (int r = 0; r < WORLD; r++) {
		ref->nsteps[r]++;
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = valid_numel(f->g[r], i);

			if (n)
				inproc_ref_step(&adamw, ref->p[r][i],
						shardd_group_shard_grad(f->g[r], i), ref->s[r][i],
						ref->nsteps[r], 0.01, 1.0f, n);
		}
	}
}

/* Random grads, the reduce of `step` on every ring, the reference step, then every rank's step. */
static void train_step(struct fixture *f, struct inproc_ref *ref, uint64_t step)
{
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			float *gr = shardd_group_grad(f->g[r], i);
			uint64_t n = shardd_group_layout(f->g[r], i)->grad_bytes / sizeof(float);

			for (uint64_t e = 0; e < n; e++)
				gr[e] = inproc_rnd(&rng_state);
		}
	inproc_reduce(f->c, f->g, WORLD, step, 0);
	ref_step(ref, f);
	for (int r = 0; r < WORLD; r++)
		cr_assert_eq(shardd_step(f->g[r], step, 0.01, 0, 0, 0), SHARDD_STEP_APPLIED,
			     "step %llu: %s", (unsigned long long)step, shardd_last_error());
}

/* Every rank submits checkpoint(step); each completion's res into res[]. */
static void checkpoint_all(struct fixture *f, uint64_t step, int res[WORLD], char msg[WORLD][256])
{
	struct shardd_completion cp;

	for (int r = 0; r < WORLD; r++)
		cr_assert_eq(shardd_client_submit(f->c[r], SHARDD_OP_CHECKPOINT, step, 0, 7), 0,
			     "%s", shardd_last_error());
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(shardd_wait(f->c[r], &cp, 30000), 0, "rank %d: %s", r,
			     shardd_last_error());
		cr_assert_eq(cp.op, SHARDD_OP_CHECKPOINT);
		res[r] = cp.res;
		snprintf(msg[r], 256, "%s", cp.msg);
	}
}

static json_t *ctl_checkpoints(const struct fixture *f);

/* ---- the test's own safetensors reader ---- */

struct st {
	uint8_t *bytes;
	size_t len;
	json_t *hdr;
	uint64_t data;
};

static void st_open(struct st *s, const char *path)
{
	FILE *fp = fopen(path, "rb");
	uint64_t hl = 0;
	json_error_t jerr;

	cr_assert(fp, "cannot open %s", path);
	fseek(fp, 0, SEEK_END);
	s->len = (size_t)ftell(fp);
	fseek(fp, 0, SEEK_SET);
	s->bytes = malloc(s->len);
	cr_assert_eq(fread(s->bytes, 1, s->len, fp), s->len);
	fclose(fp);
	for (int i = 0; i < 8; i++)
		hl |= (uint64_t)s->bytes[i] << (8 * i);
	cr_assert(8 + hl <= s->len);
	s->hdr = json_loadb((const char *)s->bytes + 8, hl, 0, &jerr);
	cr_assert(s->hdr, "%s: %s", path, jerr.text);
	s->data = 8 + hl;
}

/* Tensor `name`: checks its dtype F32 and shape, returns its data. */
static const float *st_tensor(struct st *s, const char *name, const struct shardd_param_desc *d)
{
	json_t *e = json_object_get(s->hdr, name), *shape, *off;
	uint64_t b, en;

	cr_assert(e, "tensor '%s' missing", name);
	cr_assert_str_eq(json_string_value(json_object_get(e, "dtype")), "F32", "%s", name);
	shape = json_object_get(e, "shape");
	cr_assert_eq(json_array_size(shape), d->ndim, "%s", name);
	for (uint32_t k = 0; k < d->ndim; k++)
		cr_assert_eq((uint64_t)json_integer_value(json_array_get(shape, k)), d->shape[k],
			     "%s dim %u", name, k);
	off = json_object_get(e, "data_offsets");
	b = (uint64_t)json_integer_value(json_array_get(off, 0));
	en = (uint64_t)json_integer_value(json_array_get(off, 1));
	cr_assert_eq(en - b, inproc_numel(d) * sizeof(float), "%s bytes", name);
	cr_assert(s->data + en <= s->len);
	return (const float *)(s->bytes + s->data + b);
}

static void st_close(struct st *s)
{
	json_decref(s->hdr);
	free(s->bytes);
}

/*
 * Full tensor element `e` of param i from per-rank shard data `sh[r]`:
 * dim 0: the ranks' valid rows back to back; Shard(1) of [4, 8]: rank
 * r holds columns 2r, 2r+1 of every row.
 */
static float full_elem(uint32_t i, float *const sh[WORLD], uint64_t e, const struct fixture *f)
{
	const struct shardd_param_desc *d = &params[i];

	if (d->shard_dim == 1) {
		uint64_t cols = d->shape[1] / WORLD, row = e / d->shape[1], col = e % d->shape[1];

		return sh[col / cols][row * cols + col % cols];
	}
	for (int r = 0; r < WORLD; r++) {
		uint64_t n = valid_numel(f->g[r], i);

		if (e < n)
			return sh[r][e];
		e -= n;
	}
	cr_assert_fail("element past the param");
	return 0;
}

static void expect_checkpoint(struct fixture *f, struct inproc_ref *ref, const char *dir,
			      uint64_t step)
{
	static const char *const states[3] = { "exp_avg", "exp_avg_sq", "max_exp_avg_sq" };
	char path[512];
	struct st model, optim;
	json_t *man, *g, *files;
	json_error_t jerr;

	snprintf(path, sizeof(path), "%s/manifest.json", dir);
	man = json_load_file(path, 0, &jerr);
	cr_assert(man, "%s: %s", path, jerr.text);
	cr_assert_eq(json_integer_value(json_object_get(man, "step")), (json_int_t)step);
	cr_assert_eq(json_integer_value(json_object_get(json_object_get(man, "mesh"), "shard")),
		     WORLD);
	g = json_array_get(json_object_get(man, "groups"), 0);
	cr_assert_str_eq(json_string_value(json_object_get(g, "name")), "layer");
	cr_assert_eq(json_integer_value(json_object_get(g, "last_step")), (json_int_t)step);
	cr_assert_eq(json_integer_value(json_object_get(g, "optim_steps")), (json_int_t)step);
	cr_assert_str_eq(
		json_string_value(json_object_get(json_object_get(g, "optimizer"), "kind")),
		"adamw");
	cr_assert_eq(json_real_value(json_object_get(json_object_get(g, "optimizer"), "beta2")),
		     0.999);
	/* Each file's size and CRC-32 as the manifest says, computed here with zlib. */
	files = json_object_get(man, "files");
	cr_assert_eq(json_array_size(files), 2);
	for (size_t k = 0; k < 2; k++) {
		json_t *fe = json_array_get(files, k);
		struct st s;
		char crc[16];

		snprintf(path, sizeof(path), "%s/%s", dir,
			 json_string_value(json_object_get(fe, "name")));
		st_open(&s, path);
		cr_assert_eq((uint64_t)json_integer_value(json_object_get(fe, "bytes")), s.len,
			     "%s", path);
		snprintf(crc, sizeof(crc), "%08lx",
			 crc32(crc32(0L, Z_NULL, 0), s.bytes, (uInt)s.len));
		cr_assert_str_eq(json_string_value(json_object_get(fe, "crc32")), crc, "%s", path);
		st_close(&s);
	}
	json_decref(man);
	snprintf(path, sizeof(path), "%s/model.safetensors", dir);
	st_open(&model, path);
	snprintf(path, sizeof(path), "%s/optim.safetensors", dir);
	st_open(&optim, path);
	for (uint32_t i = 0; i < NP; i++) {
		float *sh[WORLD];
		const float *t = st_tensor(&model, params[i].name, &params[i]);

		for (int r = 0; r < WORLD; r++)
			sh[r] = shardd_group_shard(f->g[r], i);
		for (uint64_t e = 0; e < inproc_numel(&params[i]); e++)
			cr_assert_eq(
				memcmp(&t[e], &(float){ full_elem(i, sh, e, f) }, 4), 0,
				"param '%s'[%llu] = %.9g in the file, %.9g in the ranks' shards",
				params[i].name, (unsigned long long)e, t[e],
				full_elem(i, sh, e, f));
		for (int k = 0; k < 3; k++) {
			char name[128];

			snprintf(name, sizeof(name), "%s.%s", params[i].name, states[k]);
			t = st_tensor(&optim, name, &params[i]);
			for (int r = 0; r < WORLD; r++)
				sh[r] = ref->s[r][i][k];
			for (uint64_t e = 0; e < inproc_numel(&params[i]); e++)
				cr_assert_eq(memcmp(&t[e], &(float){ full_elem(i, sh, e, f) }, 4),
					     0, "'%s'[%llu] = %.9g in the file, reference %.9g",
					     name, (unsigned long long)e, t[e],
					     full_elem(i, sh, e, f));
		}
	}
	cr_assert_eq(json_object_size(model.hdr), NP + 1, "params and __metadata__");
	cr_assert_eq(json_object_size(optim.hdr), 3 * NP + 1);
	st_close(&model);
	st_close(&optim);
}

Test(checkpoint, writes_full_params_and_optimizer_state_as_safetensors, .timeout = 60)
{
	struct fixture f;
	struct inproc_ref ref;
	int res[WORLD];
	char msg[WORLD][256], dir[128];
	struct stat st;

	start(&f, NULL, 1, NULL);
	ref_init(&ref, &f);
	train_step(&f, &ref, 1);
	train_step(&f, &ref, 2);
	checkpoint_all(&f, 2, res, msg);
	for (int r = 0; r < WORLD; r++)
		cr_assert_eq(res[r], 0, "rank %d: %s", r, msg[r]);
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000002", f.state);
	expect_checkpoint(&f, &ref, dir, 2);
	/* Nothing but the checkpoint: the temporary directory was renamed. */
	snprintf(dir, sizeof(dir), "%s/ck", f.state);
	{
		DIR *d = opendir(dir);
		struct dirent *e;
		int n = 0;

		cr_assert(d);
		while ((e = readdir(d)))
			if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
				n++;
		closedir(d);
		cr_assert_eq(n, 1, "%s holds more than step-000000000002", dir);
	}
	/* The metrics report it: its step, and every byte of its two files. */
	{
		char path[512], out[65536], want[160];
		struct stat a, b;

		cr_assert_eq(harness_shardctl(f.hd.socket, (const char *const[]){ "metrics", NULL },
					      10000, out, sizeof(out)),
			     0, "shardctl metrics: %s", out);
		cr_assert(strstr(out, "shardd_checkpoint_last_step{job=\"ck\"} 2\n"), "%s", out);
		cr_assert(strstr(out, "shardd_checkpoint_last_failed{job=\"ck\"} 0\n"), "%s", out);
		snprintf(path, sizeof(path), "%s/ck/step-000000000002/model.safetensors", f.state);
		cr_assert_eq(stat(path, &a), 0);
		snprintf(path, sizeof(path), "%s/ck/step-000000000002/optim.safetensors", f.state);
		cr_assert_eq(stat(path, &b), 0);
		snprintf(want, sizeof(want), "shardd_checkpoint_last_bytes{job=\"ck\"} %lld\n",
			 (long long)(a.st_size + b.st_size));
		cr_assert(strstr(out, want), "no '%s' in:\n%s", want, out);
	}
	/* Training goes on after it; a second checkpoint of the same step is refused. */
	train_step(&f, &ref, 3);
	checkpoint_all(&f, 2, res, msg);
	cr_assert_eq(res[0], -SHARDD_E_INVALID, "%s", msg[0]);
	cr_assert(strstr(msg[0], "step-000000000002 exists"), "%s", msg[0]);
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000002/manifest.json", f.state);
	cr_assert_eq(stat(dir, &st), 0);
	inproc_ref_free(&ref);
	finish(&f);
}

Test(checkpoint, keep_removes_the_oldest_checkpoints, .timeout = 60)
{
	struct fixture f;
	struct inproc_ref ref;
	int res[WORLD];
	char msg[WORLD][256], dir[160];
	struct stat st;

	start(&f, "2", 1, NULL);
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= 3; step++) {
		train_step(&f, &ref, step);
		checkpoint_all(&f, step, res, msg);
		for (int r = 0; r < WORLD; r++)
			cr_assert_eq(res[r], 0, "step %llu rank %d: %s", (unsigned long long)step,
				     r, msg[r]);
	}
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000001", f.state);
	cr_assert_neq(stat(dir, &st), 0, "%s survived --keep 2", dir);
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000002/manifest.json", f.state);
	cr_assert_eq(stat(dir, &st), 0);
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000003", f.state);
	expect_checkpoint(&f, &ref, dir, 3);
	inproc_ref_free(&ref);
	finish(&f);
}

Test(checkpoint, without_state_dir_fails_naming_the_flag, .timeout = 60)
{
	struct fixture f;
	int res[WORLD];
	char msg[WORLD][256];

	start(&f, NULL, 0, NULL);
	for (int r = 0; r < WORLD; r++) {
		struct shardd_completion cp;

		cr_assert_eq(shardd_client_submit(f.c[r], SHARDD_OP_CHECKPOINT, 1, 0, 7), 0, "%s",
			     shardd_last_error());
		cr_assert_eq(shardd_wait(f.c[r], &cp, 30000), 0, "%s", shardd_last_error());
		res[r] = cp.res;
		snprintf(msg[r], 256, "%s", cp.msg);
		cr_assert_eq(res[r], -SHARDD_E_INVALID, "rank %d: %s", r, msg[r]);
		cr_assert(strstr(msg[r], "no --state-dir"), "%s", msg[r]);
	}
	finish(&f);
}

Test(checkpoint, refuses_a_cut_between_ranks_steps, .timeout = 60)
{
	struct fixture f;
	struct inproc_ref ref;
	int res[WORLD];
	char msg[WORLD][256];

	start(&f, NULL, 1, NULL);
	ref_init(&ref, &f);
	train_step(&f, &ref, 1);
	/* Step 2's reduce on every rank, then only rank 0 steps. */
	inproc_reduce(f.c, f.g, WORLD, 2, 0);
	cr_assert_eq(shardd_step(f.g[0], 2, 0.01, 0, 0, 0), SHARDD_STEP_APPLIED, "%s",
		     shardd_last_error());
	checkpoint_all(&f, 2, res, msg);
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(res[r], -SHARDD_E_STATE, "rank %d: %s", r, msg[r]);
		cr_assert(
			strstr(msg[r],
			       "group 'layer' is not at a step boundary: rank 0 applied step 2, rank 1 "
			       "only step 1; submit checkpoint after the completions of every rank's step 2"),
			"%s", msg[r]);
	}
	inproc_ref_free(&ref);
	finish(&f);
}

/* ---- shardctl checkpoint ---- */

struct ctl_arg {
	const char *socket, *job, *dir;
	int out_fd;
};

/* Child: exec shardctl --socket S checkpoint JOB DIR, its stdout and stderr into out_fd. */
static int ctl_checkpoint_main(void *p)
{
	struct ctl_arg *a = p;
	char path[512];

	snprintf(path, sizeof(path), "%s/shardctl", getenv("SHARDD_BUILD"));
	dup2(a->out_fd, 1);
	dup2(a->out_fd, 2);
	execl(path, path, "--socket", a->socket, "checkpoint", a->job, a->dir, (char *)NULL);
	return 127;
}

/* shardctl --json checkpoints ck: the parsed reply. */
static json_t *ctl_checkpoints(const struct fixture *f)
{
	char out[8192];

	return harness_shardctl_json(f->hd.socket,
				     (const char *const[]){ "checkpoints", "ck", NULL }, 10000, out,
				     sizeof(out));
}

Test(checkpoint, shardctl_checkpoint_waits_for_the_next_step_boundary, .timeout = 60)
{
	struct fixture f;
	struct inproc_ref ref;
	struct ctl_arg a;
	char dir[160], out[4096] = "";
	int pipefd[2], status;
	struct stat st;
	pid_t pid;
	json_t *r;
	ssize_t n;

	cr_assert(getenv("SHARDD_BUILD"), "SHARDD_BUILD is not set: run through make test");
	start(&f, NULL, 0, NULL);
	ref_init(&ref, &f);
	train_step(&f, &ref, 1);
	/* Step 2 half done: reduced everywhere, applied on rank 0 only. */
	inproc_reduce(f.c, f.g, WORLD, 2, 0);
	ref_step(&ref, &f);
	cr_assert_eq(shardd_step(f.g[0], 2, 0.01, 0, 0, 0), SHARDD_STEP_APPLIED, "%s",
		     shardd_last_error());

	snprintf(dir, sizeof(dir), "%s/by-shardctl", f.state);
	cr_assert_eq(pipe(pipefd), 0);
	a = (struct ctl_arg){ .socket = f.hd.socket, .job = "ck", .dir = dir, .out_fd = pipefd[1] };
	pid = harness_fork(ctl_checkpoint_main, &a);
	close(pipefd[1]);
	/* Armed, not taken: the ranks are between step 1 and step 2. */
	for (int64_t until = harness_now_ms() + 20000;;) {
		int armed;

		r = ctl_checkpoints(&f);
		armed = json_integer_value(json_object_get(json_object_get(r, "armed"), "id")) == 1;
		json_decref(r);
		if (armed)
			break;
		cr_assert(harness_now_ms() < until, "the checkpoint was never armed");
	}
	cr_assert_neq(stat(dir, &st), 0, "%s was written before the step boundary", dir);
	for (int r2 = 1; r2 < WORLD; r2++)
		cr_assert_eq(shardd_step(f.g[r2], 2, 0.01, 0, 0, 0), SHARDD_STEP_APPLIED, "%s",
			     shardd_last_error());
	cr_assert_eq(harness_wait_pid(pid, 30000, &status), 0, "shardctl checkpoint did not end");
	n = read(pipefd[0], out, sizeof(out) - 1);
	out[n > 0 ? n : 0] = '\0';
	close(pipefd[0]);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "shardctl checkpoint: %s: %s",
		  harness_status_str(status), out);
	cr_assert(strstr(out, "checkpoint of job 'ck' at step 2 written to"), "%s", out);
	expect_checkpoint(&f, &ref, dir, 2);
	r = ctl_checkpoints(&f);
	cr_assert_str_eq(json_string_value(json_object_get(json_object_get(r, "last"), "dir")),
			 dir);
	json_decref(r);
	inproc_ref_free(&ref);
	finish(&f);
}

Test(checkpoint, checkpoint_every_saves_each_multiple_step_boundary, .timeout = 60)
{
	struct fixture f;
	struct inproc_ref ref;
	char dir[160];
	struct stat st;

	cr_assert(getenv("SHARDD_BUILD"), "SHARDD_BUILD is not set: run through make test");
	start(&f, NULL, 1, "2");
	ref_init(&ref, &f);
	for (uint64_t step = 1; step <= 4; step++) {
		train_step(&f, &ref, step);
		if (step % 2)
			continue;
		/* Taken at the step's boundary, written on the pool: wait until it is reported. */
		for (int64_t until = harness_now_ms() + 20000;;) {
			json_t *r = ctl_checkpoints(&f);
			json_int_t last = json_integer_value(
				json_object_get(json_object_get(r, "last"), "step"));

			json_decref(r);
			if (last == (json_int_t)step)
				break;
			cr_assert(harness_now_ms() < until, "no checkpoint of step %llu reported",
				  (unsigned long long)step);
		}
	}
	for (int s = 1; s <= 3; s += 2) {
		snprintf(dir, sizeof(dir), "%s/ck/step-%012d", f.state, s);
		cr_assert_neq(stat(dir, &st), 0, "%s: not a multiple of --checkpoint-every 2", dir);
	}
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000002/manifest.json", f.state);
	cr_assert_eq(stat(dir, &st), 0);
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000004", f.state);
	expect_checkpoint(&f, &ref, dir, 4);
	inproc_ref_free(&ref);
	finish(&f);
}

Test(checkpoint, snapshot_holds_the_boundary_while_the_next_step_runs, .timeout = 60)
{
	struct fixture f;
	struct inproc_ref ref;
	struct shardd_completion cps[WORLD];
	char dir[160], path[512];
	float *before[WORLD][NP];
	struct st model;
	json_t *r;

	cr_assert(getenv("SHARDD_BUILD"), "SHARDD_BUILD is not set: run through make test");
	start(&f, NULL, 1, NULL);
	ref_init(&ref, &f);
	train_step(&f, &ref, 1);
	train_step(&f, &ref, 2);
	for (int rk = 0; rk < WORLD; rk++)
		for (uint32_t i = 0; i < NP; i++) {
			uint64_t n = valid_numel(f.g[rk], i);

			before[rk][i] = malloc((n + 1) * sizeof(float));
			memcpy(before[rk][i], shardd_group_shard(f.g[rk], i), n * sizeof(float));
		}
	/* checkpoint(2), and without waiting for it step 3's reduce and step. */
	for (int rk = 0; rk < WORLD; rk++)
		cr_assert_eq(shardd_client_submit(f.c[rk], SHARDD_OP_CHECKPOINT, 2, 0, 7), 0);
	for (int rk = 0; rk < WORLD; rk++)
		cr_assert_eq(shardd_group_submit(f.g[rk], SHARDD_OP_REDUCE, 3, 0, 8), 0);
	for (int k = 0; k < 2; k++) {
		inproc_wait_each(f.c, WORLD, cps, 30000);
		for (int rk = 0; rk < WORLD; rk++)
			cr_assert_eq(cps[rk].res, 0, "rank %d %s: %s", rk,
				     shardd_op_name(cps[rk].op), cps[rk].msg);
	}
	for (int rk = 0; rk < WORLD; rk++)
		cr_assert_eq(shardd_step(f.g[rk], 3, 0.01, 0, 0, 0), SHARDD_STEP_APPLIED, "%s",
			     shardd_last_error());
	/* The files hold step 2's params, which step 3 has moved since. */
	snprintf(dir, sizeof(dir), "%s/ck/step-000000000002", f.state);
	snprintf(path, sizeof(path), "%s/model.safetensors", dir);
	st_open(&model, path);
	for (uint32_t i = 0; i < NP; i++) {
		const float *t = st_tensor(&model, params[i].name, &params[i]);
		float *sh[WORLD];
		int moved = 0;

		for (int rk = 0; rk < WORLD; rk++)
			sh[rk] = before[rk][i];
		for (uint64_t e = 0; e < inproc_numel(&params[i]); e++) {
			float want = full_elem(i, sh, e, &f);

			cr_assert_eq(memcmp(&t[e], &want, 4), 0,
				     "param '%s'[%llu] = %.9g, at step 2 %.9g", params[i].name,
				     (unsigned long long)e, t[e], want);
		}
		for (int rk = 0; rk < WORLD; rk++)
			for (uint64_t e = 0; e < valid_numel(f.g[rk], i); e++)
				moved |= ((float *)shardd_group_shard(f.g[rk], i))[e] !=
					 before[rk][i][e];
		cr_assert(moved || !inproc_numel(&params[i]), "step 3 did not move param '%s'",
			  params[i].name);
	}
	st_close(&model);
	r = ctl_checkpoints(&f);
	cr_assert(json_is_true(json_object_get(json_object_get(r, "last"), "staged")),
		  "the checkpoint was not written from a snapshot");
	json_decref(r);
	for (int rk = 0; rk < WORLD; rk++)
		for (uint32_t i = 0; i < NP; i++)
			free(before[rk][i]);
	inproc_ref_free(&ref);
	finish(&f);
}

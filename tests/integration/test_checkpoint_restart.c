/* SPDX-License-Identifier: MIT */
/*
 * shardd --state-dir restart: a daemon killed with SIGKILL in the middle of
 * training is started again on the same --state-dir; the ranks attach
 * again, register with restore "" (the job's newest checkpoint) and learn
 * the step to resume after; training finishes with params bit-identical to
 * an uninterrupted run that took the same checkpoints. The grads are a
 * function of (step, rank, param, element), so both runs see the same
 * ones; the reference is the uninterrupted run's params as its ranks'
 * mappings show them. A temporary directory left by a checkpoint cut short
 * is emulated beside the checkpoints and must be ignored, then removed;
 * and a daemon killed while `shardctl checkpoints` reports a 192 MiB
 * checkpoint being written resumes from the previous, complete one.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "inproc.h"
#include "shardd.h"

#define NP    3
#define WORLD 2
#define STEPS 6
#define EVERY 2

static const struct shardd_param_desc params[NP] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 9, 5 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 5 } },
	{ .name = "c", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shard_dim = 1, .shape = { 3, 4 } },
};

static const struct shardd_optim_config adamw = {
	.kind = SHARDD_OPTIM_ADAMW,
	.beta1 = 0.9,
	.beta2 = 0.999,
	.eps = 1e-8,
	.weight_decay = 0.01,
};

struct run {
	struct harness_daemon hd;
	const char *state;
	const struct shardd_param_desc *params;
	uint32_t np;
	const char *max_memory; /* --max-memory, or NULL */
	struct shardd_client *c[WORLD];
	struct shardd_group *g[WORLD];
};

static void daemon_start(struct run *run)
{
	const char *extra[] = { "--collective-timeout",
				"20",
				"--state-dir",
				run->state,
				"--keep",
				"2",
				run->max_memory ? "--max-memory" : NULL,
				run->max_memory,
				NULL };

	cr_assert_eq(harness_daemon_start(&run->hd, extra), 0, "shardd did not start");
}

/* Attach both ranks and register with restore "": returns the step to resume after. */
static uint64_t attach(struct run *run)
{
	const struct shardd_group_opts opts = { .optimizer = &adamw, .restore = "" };

	for (uint32_t r = 0; r < WORLD; r++)
		cr_assert_eq(harness_attach(&run->hd, "train", r, 1, WORLD, &run->c[r]), 0, "%s",
			     shardd_last_error());
	inproc_register_ok(run->c, WORLD, "layer", run->params, run->np, NULL, &opts, run->g);
	cr_assert_eq(shardd_group_last_step(run->g[0]), shardd_group_last_step(run->g[1]));
	return shardd_group_last_step(run->g[0]);
}

static void detach(struct run *run)
{
	for (uint32_t r = 0; r < WORLD; r++) {
		shardd_group_close(run->g[r]);
		shardd_close(run->c[r]);
	}
}

/* A value in [-1, 1) from its coordinates: the same in every run. */
static float value(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
	uint64_t x = a * 0x9e3779b97f4a7c15ull ^ b * 0xc2b2ae3d27d4eb4full ^
		     c * 0x165667b19e3779f9ull ^ (d + 1) * 0xd6e8feb86659fd93ull;

	x ^= x >> 31;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 29;
	return (float)((double)(x >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
}

/* Elements of real data in rank r's shard of param i (a prefix of it; the rest is padding). */
static uint64_t valid_numel(const struct run *run, uint32_t r, uint32_t i)
{
	return inproc_valid_numel(run->g[r], run->params, i);
}

/* Fresh params: each rank writes its shard's valid elements. */
static void init_params(struct run *run)
{
	for (uint32_t r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < run->np; i++) {
			float *sh = shardd_group_shard(run->g[r], i);
			uint64_t n = valid_numel(run, r, i);

			for (uint64_t e = 0; e < n; e++)
				sh[e] = value(0, r, i, e);
		}
}

/* Every rank's checkpoint(step), not waited for. */
static void checkpoint_submit(struct run *run, uint64_t step)
{
	for (uint32_t r = 0; r < WORLD; r++)
		cr_assert_eq(shardd_client_submit(run->c[r], SHARDD_OP_CHECKPOINT, step, 0, 2), 0);
}

/* One step; then, when step is a multiple of `every` (0: never), a checkpoint waited for. */
static void train_step_every(struct run *run, uint64_t step, uint64_t every)
{
	for (uint32_t r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < run->np; i++) {
			float *gr = shardd_group_grad(run->g[r], i);

			for (uint64_t e = 0; e < shardd_group_layout(run->g[r], i)->grad_bytes / 4;
			     e++)
				gr[e] = value(step, r, i, e);
		}
	inproc_reduce(run->c, run->g, WORLD, step, 0);
	for (uint32_t r = 0; r < WORLD; r++)
		cr_assert_eq(shardd_step(run->g[r], step, 0.01 / (double)step, 0, 0, 0),
			     SHARDD_STEP_APPLIED, "%s", shardd_last_error());
	if (!every || step % every)
		return;
	inproc_checkpoint(run->c, WORLD, step);
}

static void train_step(struct run *run, uint64_t step)
{
	train_step_every(run, step, EVERY);
}

/* Every rank's valid elements of every param, concatenated. */
static float *snapshot(struct run *run, size_t *n)
{
	size_t total = 0, at = 0;
	float *out;

	for (uint32_t r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < run->np; i++)
			total += valid_numel(run, r, i);
	out = malloc(total * sizeof(float));
	for (uint32_t r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < run->np; i++) {
			size_t k = valid_numel(run, r, i);

			memcpy(out + at, shardd_group_shard(run->g[r], i), k * sizeof(float));
			at += k;
		}
	*n = total;
	return out;
}

Test(restart, killed_daemon_resumes_from_its_last_checkpoint_bit_identical, .timeout = 120)
{
	char sa[64], sb[64], junk[200];
	struct run a = { .state = sa, .params = params, .np = NP },
		   b = { .state = sb, .params = params, .np = NP };
	float *want, *got;
	size_t nw, ng;
	struct stat st;
	FILE *fp;

	snprintf(sa, sizeof(sa), "/tmp/shardd-restart-a-XXXXXX");
	snprintf(sb, sizeof(sb), "/tmp/shardd-restart-b-XXXXXX");
	cr_assert(mkdtemp(sa) && mkdtemp(sb));

	/* The uninterrupted run. */
	daemon_start(&a);
	cr_assert_eq(attach(&a), 0);
	init_params(&a);
	for (uint64_t s = 1; s <= STEPS; s++)
		train_step(&a, s);
	want = snapshot(&a, &nw);
	detach(&a);
	harness_daemon_stop_expect_clean(&a.hd);

	/* The same, killed after step 3 (its last checkpoint: step 2). */
	daemon_start(&b);
	cr_assert_eq(attach(&b), 0);
	init_params(&b);
	for (uint64_t s = 1; s <= 3; s++)
		train_step(&b, s);
	{
		int st9 = harness_daemon_stop_sig(&b.hd, SIGKILL, 10000);

		cr_assert(st9 >= 0 && WIFSIGNALED(st9) && WTERMSIG(st9) == SIGKILL,
			  "SIGKILL did not end shardd");
	}
	detach(&b);
	/* What a kill during the checkpoint of step 4 leaves: a temporary directory, no step-4. */
	snprintf(junk, sizeof(junk), "%s/train/.tmp-step-000000000004-XXXXXX", sb);
	cr_assert(mkdtemp(junk));
	strcat(junk, "/model.safetensors");
	fp = fopen(junk, "w");
	cr_assert(fp);
	fputs("half a file", fp);
	fclose(fp);

	memset(&b.hd, 0, sizeof(b.hd));
	daemon_start(&b);
	cr_assert_eq(attach(&b), 2, "the ranks resume after the last checkpoint's step");
	for (uint64_t s = 3; s <= STEPS; s++)
		train_step(&b, s);
	got = snapshot(&b, &ng);
	cr_assert_eq(ng, nw);
	for (size_t e = 0; e < nw; e++)
		cr_assert_eq(memcmp(&got[e], &want[e], sizeof(float)), 0,
			     "element %zu: %.9g after the restart, %.9g uninterrupted", e, got[e],
			     want[e]);
	/* --keep 2 and the cleanup of the cut-short checkpoint's directory. */
	junk[strlen(junk) - strlen("/model.safetensors")] = '\0';
	cr_assert_neq(stat(junk, &st), 0, "%s survived the next checkpoint", junk);
	snprintf(junk, sizeof(junk), "%s/train/step-000000000002", sb);
	cr_assert_neq(stat(junk, &st), 0, "%s survived --keep 2", junk);
	snprintf(junk, sizeof(junk), "%s/train/step-000000000006/manifest.json", sb);
	cr_assert_eq(stat(junk, &st), 0);
	free(want);
	free(got);
	detach(&b);
	harness_daemon_stop_expect_clean(&b.hd);
	harness_rm_tree(sa);
	harness_rm_tree(sb);
}

/* 64 MiB of params: the state (with AdamW's two) takes a while to write. */
static const struct shardd_param_desc big[2] = {
	{ .name = "big", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 4096, 4096 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 5 } },
};

/* shardctl --json checkpoints train: the id being written (0: none) and the last step that ended. */
static void ctl_status(struct run *run, json_int_t *writing, json_int_t *last_step, int *staged)
{
	char out[8192];
	json_t *r = harness_shardctl_json(run->hd.socket,
					  (const char *const[]){ "checkpoints", "train", NULL },
					  10000, out, sizeof(out));

	*writing = json_integer_value(json_object_get(json_object_get(r, "writing"), "id"));
	*last_step = json_integer_value(json_object_get(json_object_get(r, "last"), "step"));
	*staged = json_is_true(json_object_get(json_object_get(r, "last"), "staged"));
	json_decref(r);
}

Test(restart, killed_while_a_checkpoint_is_written_resumes_from_the_last_complete_one,
     .timeout = 240)
{
	char sa[64], sb[64], dir[200];
	/*
	 * Run b's groups need 448 MiB (shards, sharded grads, unsharded copy, two
	 * grads, AdamW's two states) and a snapshot 192 MiB more: 560 MiB of
	 * --max-memory leaves no room for it, so b writes in place (its ops wait).
	 */
	struct run a = { .state = sa, .params = big, .np = 2 },
		   b = { .state = sb, .params = big, .np = 2, .max_memory = "560M" };
	json_int_t writing = 0, last = 0;
	int staged = 1;
	uint64_t resume;
	float *want, *got;
	size_t nw, ng;
	struct stat st;

	cr_assert(getenv("SHARDD_BUILD"), "SHARDD_BUILD is not set: run through make test");
	snprintf(sa, sizeof(sa), "/tmp/shardd-restart-a-XXXXXX");
	snprintf(sb, sizeof(sb), "/tmp/shardd-restart-b-XXXXXX");
	cr_assert(mkdtemp(sa) && mkdtemp(sb));

	/* Uninterrupted: 3 steps, a checkpoint after each. */
	daemon_start(&a);
	cr_assert_eq(attach(&a), 0);
	init_params(&a);
	for (uint64_t s = 1; s <= 3; s++)
		train_step_every(&a, s, 1);
	want = snapshot(&a, &nw);
	detach(&a);
	harness_daemon_stop_expect_clean(&a.hd);

	/* Killed while the checkpoint of step 2 is being written (as shardctl reports it). */
	daemon_start(&b);
	cr_assert_eq(attach(&b), 0);
	init_params(&b);
	train_step_every(&b, 1, 1);
	ctl_status(&b, &writing, &last, &staged);
	cr_assert(last == 1 && !staged, "the checkpoint of step 1 (last %lld) was %s",
		  (long long)last, staged ? "staged in memory past --max-memory" : "not reported");
	writing = 0;
	train_step_every(&b, 2, 0);
	checkpoint_submit(&b, 2);
	for (int64_t until = harness_now_ms() + 20000;;) {
		ctl_status(&b, &writing, &last, &staged);
		if (writing || last == 2)
			break;
		cr_assert(harness_now_ms() < until, "the checkpoint of step 2 never started");
	}
	{
		int st9 = harness_daemon_stop_sig(&b.hd, SIGKILL, 10000);

		cr_assert(st9 >= 0 && WIFSIGNALED(st9) && WTERMSIG(st9) == SIGKILL,
			  "SIGKILL did not end shardd");
	}
	detach(&b);
	snprintf(dir, sizeof(dir), "%s/train/step-000000000002", sb);
	if (writing && stat(dir, &st)) {
		/* Cut short: no step-2 checkpoint, and step 1's is whole. */
		snprintf(dir, sizeof(dir), "%s/train/step-000000000001/manifest.json", sb);
		cr_assert_eq(stat(dir, &st), 0);
	}
	memset(&b.hd, 0, sizeof(b.hd));
	daemon_start(&b);
	resume = attach(&b);
	cr_assert(resume == 1 || resume == 2, "resumed after step %llu",
		  (unsigned long long)resume);
	cr_assert(!writing || resume == 1 || stat(dir, &st) == 0,
		  "resumed after step 2 although its checkpoint was cut short");
	cr_log_info(
		"shardd killed %s the checkpoint of step 2 was written; resumed after step %llu",
		writing ? "while" : "after", (unsigned long long)resume);
	for (uint64_t s = resume + 1; s <= 3; s++)
		train_step_every(&b, s, 1);
	got = snapshot(&b, &ng);
	cr_assert_eq(ng, nw);
	for (size_t e = 0; e < nw; e++)
		cr_assert_eq(
			memcmp(&got[e], &want[e], sizeof(float)), 0,
			"element %zu: %.9g after the restart (resumed after step %llu), %.9g uninterrupted",
			e, got[e], (unsigned long long)resume, want[e]);
	free(want);
	free(got);
	detach(&b);
	harness_daemon_stop_expect_clean(&b.hd);
	harness_rm_tree(sa);
	harness_rm_tree(sb);
}

/* SPDX-License-Identifier: MIT */
/*
 * The step's job-wide flags and the GROUP reply's peer_last_step through a
 * real shardd: SHARDD_STEP_CLIP_JOB clips by clip_grad_norm_'s coefficient
 * of the job's grad_norm (reference: the kernels' portable SGD with the
 * coefficient computed here in fp32 from the norm the grad_norm completion
 * returned), SHARDD_STEP_SKIP_JOB_NONFINITE skips on every rank when one
 * rank's grad is NaN, SHARDD_STEP_REPLAY applies a step as the other rank
 * submitted it (a restarted rank's catch-up), and bad input (no grad_norm
 * for the step, max_norm <= 0 or non-finite, both clip flags, a replay with
 * another flag or of a step nobody took) fails naming the field and the
 * value. A client of protocol minor 3 still gets the 64-byte GROUP reply.
 *
 * The job is 1 x 2 (one process, two clients); registration runs on two
 * threads, collectives are submitted on both rings before either is reaped.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "inproc.h"
#include "optim_isa.h"
#include "rawproto.h"
#include "shardd.h"

#define WORLD 2
#define NP    2

/* Padding rows (5 over 2 ranks) and a vector. */
static const struct shardd_param_desc params[NP] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 7 } },
};

/* Plain SGD: p + (-lr) * (scale * g), nothing else. */
static const struct shardd_optim_config sgd = { .kind = SHARDD_OPTIM_SGD };

struct fixture {
	struct harness_daemon hd;
	struct shardd_client *c[WORLD];
	struct shardd_group *g[WORLD];
};

static void start(struct fixture *f)
{
	static const char *const extra[] = { "--collective-timeout", "20", NULL };
	const struct shardd_group_opts opts = { .optimizer = &sgd };

	memset(f, 0, sizeof(*f));
	inproc_start(&f->hd, extra, "stepjob", 1, WORLD, SHARDD_HELLO_DEVICE_HOST, f->c);
	inproc_register_ok(f->c, WORLD, "g", params, NP, NULL, &opts, f->g);
}

static void finish(struct fixture *f)
{
	inproc_finish(&f->hd, f->c, f->g, WORLD);
}

static uint64_t rng_state = 0x853c49e6748fea9bull;

static float next_rnd(void)
{
	return inproc_rnd(&rng_state);
}

/* Elements of real data in the rank's shard of param i. */
static uint64_t valid_numel(const struct shardd_group *g, uint32_t i)
{
	return inproc_valid_numel(g, params, i);
}

/* Every rank writes grads scaled by `scale` (rank `nan_rank`'s first real element NaN; -1: none), then reduces. */
static void reduce_step(struct fixture *f, uint64_t step, float scale, int nan_rank)
{
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			float *gr = shardd_group_grad(f->g[r], i);
			uint64_t n = shardd_group_layout(f->g[r], i)->grad_bytes / sizeof(float);

			for (uint64_t e = 0; e < n; e++)
				gr[e] = scale * next_rnd();
		}
	inproc_reduce(f->c, f->g, WORLD, step, 0);
	/* The reduce averages: a NaN put in one rank's sharded grad reaches the job's norm alone. */
	if (nan_rank >= 0)
		((float *)shardd_group_shard_grad(f->g[nan_rank], 0))[0] = NAN;
}

/* The job's grad_norm of `step` (2-norm) on both rings; returns the norm rank 0 got. */
static double grad_norm(struct fixture *f, uint64_t step, int *nonfinite)
{
	struct shardd_completion cp;
	double norm[WORLD];
	int nf[WORLD];

	for (int r = 0; r < WORLD; r++)
		cr_assert_eq(shardd_grad_norm_submit(f->c[r], step, 2.0, 200 + r), 0, "%s",
			     shardd_last_error());
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(shardd_wait(f->c[r], &cp, 30000), 0, "%s", shardd_last_error());
		cr_assert_eq(cp.res, 0, "rank %d grad_norm %llu: %s", r, (unsigned long long)step,
			     cp.msg);
		shardd_grad_norm_result(&cp, &norm[r], &nf[r]);
	}
	cr_assert_eq(memcmp(&norm[0], &norm[1], sizeof(double)), 0,
		     "the ranks got norms %.17g and %.17g", norm[0], norm[1]);
	*nonfinite = nf[0];
	return norm[0];
}

/* torch.nn.utils.clip_grad_norm_'s coefficient on a 0-d fp32 norm, written out step by step. */
static float torch_coef(double norm, double max_norm)
{
	float total = (float)norm;
	float denom = total + (float)1e-6;
	float recip = 1.0f / denom;
	float coef = recip * (float)max_norm;

	return coef < 1.0f ? coef : 1.0f;
}

/* Rank r's params: the reference copy; its SGD step with lr and grad scale on the sharded grads now. */
struct ref {
	float p[WORLD][NP][16];
};

static void ref_take(struct ref *ref, struct fixture *f)
{
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++)
			memcpy(ref->p[r][i], shardd_group_shard(f->g[r], i),
			       valid_numel(f->g[r], i) * sizeof(float));
}

static void ref_step(struct ref *ref, struct fixture *f, int r, double lr, float scale)
{
	for (uint32_t i = 0; i < NP; i++) {
		struct shardd_sgd a = {
			.param = ref->p[r][i],
			.grad = shardd_group_shard_grad(f->g[r], i),
			.grad_dtype = SHARDD_DTYPE_FP32,
			.step = 1,
			.lr = lr,
			.grad_scale = scale,
		};

		shardd_k_sgd_isa(SHARDD_K_ISA_PORTABLE, &a, 0, valid_numel(f->g[r], i));
	}
}

static void expect_shard(const struct ref *ref, struct fixture *f, int r, const char *what)
{
	for (uint32_t i = 0; i < NP; i++) {
		const float *sh = shardd_group_shard(f->g[r], i);

		for (uint64_t e = 0; e < valid_numel(f->g[r], i); e++)
			cr_assert_eq(memcmp(&sh[e], &ref->p[r][i][e], sizeof(float)), 0,
				     "%s: rank %d param '%s'[%llu] = %.9g, reference %.9g", what, r,
				     params[i].name, (unsigned long long)e, sh[e], ref->p[r][i][e]);
	}
}

static void expect_err(int ret, int code, const char *needle, const char *what)
{
	cr_assert_eq(ret, code, "%s: returned %d, want %d (%s)", what, ret, code,
		     shardd_last_error());
	cr_assert(strstr(shardd_last_error(), needle), "%s: error '%s' does not say '%s'", what,
		  shardd_last_error(), needle);
}

static void init_shards(struct fixture *f)
{
	for (int r = 0; r < WORLD; r++)
		for (uint32_t i = 0; i < NP; i++) {
			float *sh = shardd_group_shard(f->g[r], i);

			for (uint64_t e = 0; e < valid_numel(f->g[r], i); e++)
				sh[e] = next_rnd();
		}
}

Test(step_job, clip_job_applies_clip_grad_norm_coefficient_of_the_job_norm, .timeout = 60)
{
	static const double max_norms[] = { 0.1, 0.37, 2.5, 1e3 };
	struct fixture f;
	struct ref ref;

	start(&f);
	init_shards(&f);
	for (uint64_t step = 1; step <= 4; step++) {
		double max_norm = max_norms[step - 1], norm;
		int nonfinite;
		float coef;

		reduce_step(&f, step, (float)step, -1);
		norm = grad_norm(&f, step, &nonfinite);
		cr_assert_eq(nonfinite, 0);
		coef = torch_coef(norm, max_norm);
		ref_take(&ref, &f);
		for (int r = 0; r < WORLD; r++) {
			ref_step(&ref, &f, r, 0.5, coef);
			cr_assert_eq(
				shardd_step(f.g[r], step, 0.5,
					    SHARDD_STEP_CLIP_JOB | SHARDD_STEP_SKIP_JOB_NONFINITE,
					    0, max_norm),
				SHARDD_STEP_APPLIED, "rank %d step %llu: %s", r,
				(unsigned long long)step, shardd_last_error());
			expect_shard(&ref, &f, r, "clip by the job's norm");
		}
		/* The last max_norm leaves the grads as they are: coefficient 1. */
		if (step == 4)
			cr_assert_eq(coef, 1.0f, "norm %g, max_norm %g: coefficient %.9g", norm,
				     max_norm, coef);
		else
			cr_assert_lt(coef, 1.0f, "norm %g, max_norm %g: coefficient %.9g", norm,
				     max_norm, coef);
	}
	finish(&f);
}

Test(step_job, skip_job_nonfinite_skips_every_rank_when_one_grad_is_nan, .timeout = 60)
{
	struct fixture f;
	struct ref ref;
	int nonfinite;
	double norm;

	start(&f);
	init_shards(&f);
	reduce_step(&f, 1, 1.0f, 1);
	norm = grad_norm(&f, 1, &nonfinite);
	cr_assert(nonfinite && isnan(norm), "norm %g, nonfinite %d", norm, nonfinite);
	ref_take(&ref, &f);
	/* Without the skip, the NaN coefficient is refused before anything moves. */
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB, 0, 1.0), -SHARDD_E_INVALID,
		   "clip coefficient is NaN", "clip by a NaN norm");
	expect_shard(&ref, &f, 0, "refused step");
	/* Rank 0's own shard is finite: the job-wide flag skips it all the same. */
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(shardd_step(f.g[r], 1, 0.5,
					 SHARDD_STEP_CLIP_JOB | SHARDD_STEP_SKIP_JOB_NONFINITE, 0,
					 1.0),
			     SHARDD_STEP_SKIPPED, "rank %d: %s", r, shardd_last_error());
		expect_shard(&ref, &f, r, "skipped step");
		for (uint32_t i = 0; i < NP; i++)
			for (uint64_t e = 0; e < valid_numel(f.g[r], i); e++)
				cr_assert_eq(((float *)shardd_group_shard_grad(f.g[r], i))[e], 0.0f,
					     "rank %d: the skipped step left its sharded grad", r);
	}
	finish(&f);
}

/* Rank 1 re-opens the group: its own last step and the group's highest. */
static void expect_steps(struct fixture *f, uint64_t own, uint64_t peer)
{
	struct shardd_group *again;

	cr_assert_eq(shardd_group_open(f->c[1], "g", &again), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_group_last_step(again), own);
	cr_assert_eq(shardd_group_peer_last_step(again), peer);
	shardd_group_close(again);
}

Test(step_job, replay_applies_the_step_as_the_other_rank_submitted_it, .timeout = 60)
{
	struct fixture f;
	struct ref ref;
	int nonfinite;
	double norm;
	float coef;

	start(&f);
	init_shards(&f);
	expect_steps(&f, 0, 0);
	reduce_step(&f, 1, 3.0f, -1);
	norm = grad_norm(&f, 1, &nonfinite);
	coef = torch_coef(norm, 0.25);
	ref_take(&ref, &f);
	/* Nobody took step 1 yet: nothing to replay. */
	expect_err(shardd_step(f.g[1], 1, 0, SHARDD_STEP_REPLAY, 0, 0), -SHARDD_E_STATE,
		   "no rank of the group submitted step 1", "replay before any step");
	ref_step(&ref, &f, 0, 0.75, coef);
	cr_assert_eq(shardd_step(f.g[0], 1, 0.75, SHARDD_STEP_CLIP_JOB, 0, 0.25),
		     SHARDD_STEP_APPLIED, "%s", shardd_last_error());
	expect_shard(&ref, &f, 0, "rank 0's step");
	/* Rank 1 lags: it learns so from the GROUP reply and replays with rank 0's lr and max_norm. */
	expect_steps(&f, 0, 1);
	expect_err(shardd_step(f.g[1], 2, 0, SHARDD_STEP_REPLAY, 0, 0), -SHARDD_E_STATE,
		   "the last step submitted to it is 1", "replay of a step ahead");
	ref_step(&ref, &f, 1, 0.75, coef);
	cr_assert_eq(shardd_step(f.g[1], 1, 0, SHARDD_STEP_REPLAY, 0, 0), SHARDD_STEP_APPLIED, "%s",
		     shardd_last_error());
	expect_shard(&ref, &f, 1, "rank 1's replay");
	expect_steps(&f, 1, 1);
	/* Exactly once: a second replay changes nothing. */
	cr_assert_eq(shardd_step(f.g[1], 1, 0, SHARDD_STEP_REPLAY, 0, 0), SHARDD_STEP_ALREADY, "%s",
		     shardd_last_error());
	expect_shard(&ref, &f, 1, "replayed twice");
	finish(&f);
}

Test(step_job, bad_job_step_input_fails_naming_field_and_value, .timeout = 60)
{
	struct fixture f;
	int nonfinite;

	start(&f);
	reduce_step(&f, 1, 1.0f, -1);
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB, 0, 1.0), -SHARDD_E_STATE,
		   "need the job's grad_norm of step 1, and the daemon holds none", "no grad_norm");
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_SKIP_JOB_NONFINITE, 0, 0),
		   -SHARDD_E_STATE, "grad_norm(step 1)", "skip without grad_norm");
	grad_norm(&f, 1, &nonfinite);
	expect_err(shardd_step(f.g[0], 2, 0.5, SHARDD_STEP_CLIP_JOB, 0, 1.0), -SHARDD_E_STATE,
		   "it keeps the last 2: 1", "grad_norm of another step");
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB, 0, 0), -SHARDD_E_INVALID,
		   "max_norm = 0", "max_norm 0");
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB, 0, -2), -SHARDD_E_INVALID,
		   "max_norm = -2", "negative max_norm");
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB, 0, INFINITY),
		   -SHARDD_E_INVALID, "max_norm = inf", "infinite max_norm");
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB, 0, NAN), -SHARDD_E_INVALID,
		   "max_norm = nan", "NaN max_norm");
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB | SHARDD_STEP_CLIP, 1.0, 1.0),
		   -SHARDD_E_INVALID, "flags = 0x6 has both SHARDD_STEP_CLIP", "both clip flags");
	expect_err(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_REPLAY | SHARDD_STEP_CLIP_JOB, 0, 1.0),
		   -SHARDD_E_INVALID, "flags = 0x14", "replay with another flag");
	expect_err(shardd_step(f.g[0], 1, 0.5, 1u << 5, 0, 0), -SHARDD_E_INVALID,
		   "unknown bits 0x20", "unknown step flag");
	/* None of it moved anything: the step still applies, once. */
	cr_assert_eq(shardd_step(f.g[0], 1, 0.5, SHARDD_STEP_CLIP_JOB, 0, 1.0), SHARDD_STEP_APPLIED,
		     "%s", shardd_last_error());
	finish(&f);
}

/* A raw client speaking protocol minor `minor` registers a one-param group: the GROUP reply's bytes. */
static uint32_t raw_group_reply_len(uint16_t minor, const char *job, struct shardd_group_reply *out)
{
	struct shardd_hello h = make_hello(job, 0, 1, 1, 0);
	struct shardd_register_group hdr = reg_hdr("g", 1);
	struct shardd_param_spec spec = pspec("w", SHARDD_DTYPE_FP32, 2, (uint64_t[]){ 4, 2 });
	struct shardd_ctrl_rx rx;
	uint8_t *payload;
	uint32_t len;
	int fd = raw_connect();

	h.minor = minor;
	send_msg(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h));
	recv_msg(fd, &rx);
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_WELCOME, "hello of minor %u answered with type %u",
		     minor, rx.hdr.type);
	shardd_ctrl_rx_reset(&rx);
	payload = reg_payload(&hdr, &spec, 1, &len);
	send_msg(fd, SHARDD_MSG_REGISTER_GROUP, 2, payload, len);
	free(payload);
	recv_msg(fd, &rx);
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_GROUP, "register answered with type %u", rx.hdr.type);
	len = rx.hdr.length;
	memset(out, 0, sizeof(*out));
	memcpy(out, rx.payload, len < sizeof(*out) ? len : sizeof(*out));
	shardd_ctrl_rx_reset(&rx);
	close(fd);
	return len;
}

Test(step_job, group_reply_of_a_minor_3_client_has_no_peer_last_step, .timeout = 30)
{
	const size_t per_param =
		sizeof(struct shardd_param_layout) + sizeof(struct shardd_param_spec);
	struct harness_daemon hd = { 0 };
	struct shardd_group_reply reply;
	uint32_t len;

	harness_daemon_start_or_fail(&hd, NULL);
	rawproto_use(&hd);
	len = raw_group_reply_len(3, "old", &reply);
	cr_assert_eq(len, SHARDD_GROUP_REPLY_SIZE_V3 + per_param,
		     "minor 3: GROUP reply of %u bytes", len);
	cr_assert_eq(reply.nparams, 1);
	len = raw_group_reply_len(SHARDD_PROTO_MINOR, "new", &reply);
	cr_assert_eq(len, sizeof(reply) + per_param, "minor %d: GROUP reply of %u bytes",
		     SHARDD_PROTO_MINOR, len);
	cr_assert_eq(reply.nparams, 1);
	cr_assert_eq(reply.peer_last_step, 0);
	harness_daemon_stop_expect_clean(&hd);
}

Test(step_job, barrier_mismatch_completion_names_the_barrier_met, .timeout = 30)
{
	static const uint64_t number[WORLD] = { 5, 1ull << 62 };
	struct shardd_completion cp;
	struct fixture f;

	start(&f);
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(shardd_client_submit(f.c[r], SHARDD_OP_BARRIER, number[r], 0, 300 + r),
			     0, "%s", shardd_last_error());
		/* Rank 0 waits in its barrier before rank 1 arrives with another number. */
		if (r == 0)
			cr_assert_eq(shardd_nop(f.c[0]), 0, "%s", shardd_last_error());
	}
	for (int r = 0; r < WORLD; r++) {
		cr_assert_eq(shardd_wait(f.c[r], &cp, 30000), 0, "%s", shardd_last_error());
		cr_assert_eq(cp.res, -SHARDD_E_MISMATCH, "rank %d: res %d (%s)", r, cp.res, cp.msg);
		cr_assert_eq(cp.result[0], number[1 - r], "rank %d met barrier 0x%llx, want 0x%llx",
			     r, (unsigned long long)cp.result[0],
			     (unsigned long long)number[1 - r]);
	}
	finish(&f);
}

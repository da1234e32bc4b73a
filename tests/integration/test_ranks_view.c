/* SPDX-License-Identifier: MIT */
/*
 * The stuck-rank view of shardctl: zero_grad, nop and barriers carry no
 * step; COMPLETED is never behind TAKEN with nothing in flight.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "shardd.h"

#define CTL_MS 10000

TestSuite(operations, .timeout = 60);

/* ------------------------------------------------------------------ */
/* shardctl ranks: the stuck-rank view                                 */
/* ------------------------------------------------------------------ */

static char ctl_out[1 << 18];

/* shardctl --socket SOCK --json ranks, parsed; the job's object. */
static json_t *ranks_json(const char *sock, json_t **root)
{
	json_t *job;

	*root = harness_shardctl_json(sock, (const char *const[]){ "ranks", NULL }, CTL_MS, ctl_out,
				      sizeof(ctl_out));
	job = json_array_get(json_object_get(*root, "jobs"), 0);
	cr_assert_not_null(job, "no job in:\n%s", ctl_out);
	return job;
}

/* Run shardctl --socket SOCK ranks (text) into ctl_out. */
static void ranks_text(const char *sock)
{
	int rc = harness_shardctl(sock, (const char *const[]){ "ranks", NULL }, CTL_MS, ctl_out,
				  sizeof(ctl_out));

	cr_assert_eq(rc, 0, "shardctl ranks exited with %d:\n%s", rc, ctl_out);
}

static const json_t *rank_obj(const json_t *job, uint32_t r)
{
	const json_t *o = json_array_get(json_object_get(job, "ranks"), r);

	cr_assert_not_null(o);
	return o;
}

static long long jint(const json_t *o, const char *key)
{
	const json_t *v = json_object_get(o, key);

	cr_assert(json_is_integer(v), "'%s' is not an integer:\n%s", key, ctl_out);
	return json_integer_value(v);
}

static const char *jop(const json_t *o, const char *key)
{
	const char *s = json_string_value(json_object_get(json_object_get(o, key), "op"));

	cr_assert_not_null(s, "'%s' has no op:\n%s", key, ctl_out);
	return s;
}

struct reg_arg {
	struct shardd_client *c;
	struct shardd_group *g;
	int ret;
	char err[512];
};

/* Registration is collective and blocks until both ranks registered: one thread per rank. */
static void *register_main(void *p)
{
	struct reg_arg *a = p;
	struct shardd_param_desc d = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 8 }
	};

	a->ret = shardd_group_register(a->c, "layer", &d, 1, NULL, NULL, &a->g);
	if (a->ret < 0)
		snprintf(a->err, sizeof(a->err), "%s", shardd_last_error());
	return NULL;
}

/* Submit op on rank 0 without waiting. */
static void submit0(struct shardd_client *c, uint32_t op, struct shardd_group *g, uint64_t step,
		    uint64_t ud)
{
	int ret = g ? shardd_group_submit(g, op, step, 0, ud)
		    : shardd_client_submit(c, op, step, 0, ud);

	cr_assert_eq(ret, 0, "%s", shardd_last_error());
}

/* Reap rank 0's completion of user_data ud (others arriving first are checked too). */
static void reap0(struct shardd_client *c, uint64_t ud)
{
	struct shardd_completion cqe;

	do {
		cr_assert_eq(shardd_wait(c, &cqe, 10000), 0, "%s", shardd_last_error());
		cr_assert_eq(cqe.res, 0, "op %u step %llu failed: %s", cqe.op,
			     (unsigned long long)cqe.step, cqe.msg);
	} while (cqe.user_data != ud);
}

/* With nothing in flight, a rank's latest-taken completed op is the last one it took. */
static void assert_completed_matches_taken(const json_t *rk)
{
	if (jint(rk, "inflight") != 0)
		return;
	cr_assert_str_eq(jop(rk, "completed"), jop(rk, "taken"), "rank %lld:\n%s", jint(rk, "rank"),
			 ctl_out);
	cr_assert_eq(jint(json_object_get(rk, "completed"), "step"),
		     jint(json_object_get(rk, "taken"), "step"), "rank %lld:\n%s", jint(rk, "rank"),
		     ctl_out);
}

Test(operations, ranks_view_counts_only_step_carrying_ops)
{
	static const char *const extra[] = { "--collective-timeout", "30", NULL };
	struct harness_daemon hd = { 0 };
	struct shardd_client *c[2];
	struct reg_arg reg[2] = { { 0 } };
	pthread_t th[2];
	json_t *root;
	const json_t *job, *r0, *r1;

	cr_assert_eq(harness_daemon_start(&hd, extra), 0, "shardd did not start");
	for (uint32_t r = 0; r < 2; r++) {
		cr_assert_eq(harness_attach(&hd, "steps", r, 1, 2, &c[r]), 0, "%s",
			     shardd_last_error());
		reg[r].c = c[r];
	}
	for (int r = 0; r < 2; r++)
		cr_assert_eq(pthread_create(&th[r], NULL, register_main, &reg[r]), 0);
	for (int r = 0; r < 2; r++) {
		pthread_join(th[r], NULL);
		cr_assert_eq(reg[r].ret, 0, "rank %d register: %s", r, reg[r].err);
	}

	/* Step 3 on both ranks: unshard (collective), then reshard. */
	submit0(c[0], SHARDD_OP_UNSHARD, reg[0].g, 3, 10);
	cr_assert_eq(shardd_unshard(reg[1].g, 3), 0, "%s", shardd_last_error());
	reap0(c[0], 10);
	cr_assert_eq(shardd_reshard(reg[0].g, 3), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_reshard(reg[1].g, 3), 0, "%s", shardd_last_error());
	/* Rank 1 then zeroes its grads and probes: ops that carry step 0. */
	cr_assert_eq(shardd_zero_grad(reg[1].g), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_nop(c[1]), 0, "%s", shardd_last_error());

	job = ranks_json(hd.socket, &root);
	r0 = rank_obj(job, 0);
	r1 = rank_obj(job, 1);
	cr_assert_eq(jint(job, "max_step"), 3, "%s", ctl_out);
	cr_assert_str_eq(jop(r1, "submitted"), "nop", "%s", ctl_out);
	cr_assert_eq(jint(r1, "behind"), 0, "rank 1 shown behind after zero_grad:\n%s", ctl_out);
	cr_assert_eq(jint(r1, "step"), 3, "zero_grad/nop moved rank 1's step:\n%s", ctl_out);
	cr_assert_eq(jint(r0, "step"), 3, "%s", ctl_out);
	cr_assert_eq(jint(r0, "behind"), 0, "%s", ctl_out);
	assert_completed_matches_taken(r0);
	assert_completed_matches_taken(r1);
	json_decref(root);
	ranks_text(hd.socket);
	cr_assert_not_null(strstr(ctl_out, "STEP"), "%s", ctl_out);
	cr_assert_null(strstr(ctl_out, "nop@"), "nop shown with a step:\n%s", ctl_out);
	cr_assert_null(strstr(ctl_out, "zero_grad@"), "zero_grad shown with a step:\n%s", ctl_out);
	cr_assert_not_null(strstr(ctl_out, "furthest op step 3"), "%s", ctl_out);

	/*
	 * Rank 0 enters barrier 7, then a nop that completes first; rank 1's
	 * barrier completes rank 0's barrier last. With nothing in flight,
	 * COMPLETED is rank 0's last op taken, and barrier 7 is no step 7.
	 */
	submit0(c[0], SHARDD_OP_BARRIER, NULL, 7, 20);
	submit0(c[0], SHARDD_OP_NOP, NULL, 0, 21);
	cr_assert_eq(shardd_barrier(c[1], 7), 0, "%s", shardd_last_error());
	reap0(c[0], 20);
	job = ranks_json(hd.socket, &root);
	r0 = rank_obj(job, 0);
	if (jint(r0, "inflight") != 0)
		reap0(c[0], 21);
	json_decref(root);
	{
		struct shardd_completion cqe;

		/* Whichever came first, both are reaped now: nothing of rank 0 is in flight. */
		while (shardd_poll(c[0], &cqe) == 0)
			cr_assert_eq(cqe.res, 0, "%s", cqe.msg);
	}
	job = ranks_json(hd.socket, &root);
	r0 = rank_obj(job, 0);
	cr_assert_eq(jint(r0, "inflight"), 0, "%s", ctl_out);
	cr_assert_str_eq(jop(r0, "taken"), "nop", "%s", ctl_out);
	assert_completed_matches_taken(r0);
	assert_completed_matches_taken(rank_obj(job, 1));
	cr_assert_eq(jint(job, "max_step"), 3, "barrier 7 counted as step 7:\n%s", ctl_out);
	json_decref(root);

	/* Rank 0 goes on to step 4 and waits in it; rank 1 zeroes grads: it is 1 step behind, not 4. */
	submit0(c[0], SHARDD_OP_UNSHARD, reg[0].g, 4, 30);
	cr_assert_eq(shardd_zero_grad(reg[1].g), 0, "%s", shardd_last_error());
	job = ranks_json(hd.socket, &root);
	cr_assert_eq(jint(job, "max_step"), 4, "%s", ctl_out);
	cr_assert_eq(jint(rank_obj(job, 0), "behind"), 0, "%s", ctl_out);
	cr_assert_eq(jint(rank_obj(job, 1), "behind"), 1, "%s", ctl_out);
	cr_assert_eq(jint(rank_obj(job, 1), "step"), 3, "%s", ctl_out);
	json_decref(root);
	cr_assert_eq(shardd_unshard(reg[1].g, 4), 0, "%s", shardd_last_error());
	reap0(c[0], 30);

	for (int r = 0; r < 2; r++) {
		shardd_group_close(reg[r].g);
		shardd_close(c[r]);
	}
	harness_daemon_stop_expect_clean(&hd);
}

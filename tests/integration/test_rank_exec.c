/* SPDX-License-Identifier: MIT */
/*
 * Rank-executed groups against a real shardd (PROTOCOL.md 3.8): real rank
 * processes (forked, each its own libshardd client) run the same ops on a
 * group registered exec=daemon and on one registered exec=ranks with the
 * same spec and the same inputs, and every output byte must agree (the
 * daemon's path is checked against the FSDP2 reference by test_shapes and
 * test_train); the executor is chosen and refused as documented; a rank
 * missing, dead, or writing garbage into its own slot fails its peers'
 * ops with an error naming it, and the daemon keeps serving.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "internal.h"
#include "shardd_exec.h"
#include "shardd_kernels.h"

#define CHILD_MS  40000
#define MAX_RANKS 3

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	static const char *const extra[] = { "--collective-timeout", "3", "--rank-exec-max", "4M",
					     NULL };

	harness_daemon_start_or_fail(&daemon_, extra);
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(rank_exec, .init = start_daemon, .fini = stop_daemon, .timeout = 90);

/*
 * Every shape the layout has: dim 0 uneven over 3 ranks (rows 3, 3, 1),
 * Shard(1), a zero-numel param beside them, a 1-D one.
 */
static const struct shardd_param_desc params[] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 7, 5 } },
	{ .name = "v", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 4, 6 }, .shard_dim = 1 },
	{ .name = "z", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 0, 3 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 5 } },
};
#define NPARAMS 4

/* The mixed-precision policies FSDP2 allows, each run on both executors. */
static const struct shardd_precision policies[] = {
	{ .param_dtype = SHARDD_DTYPE_NONE, .reduce_dtype = SHARDD_DTYPE_NONE },
	{ .param_dtype = SHARDD_DTYPE_BF16, .reduce_dtype = SHARDD_DTYPE_FP32 },
	{ .param_dtype = SHARDD_DTYPE_BF16, .reduce_dtype = SHARDD_DTYPE_NONE },
	/* fp16 reduces pre- and post-divide by FSDP2's factors */
	{ .param_dtype = SHARDD_DTYPE_FP16, .reduce_dtype = SHARDD_DTYPE_NONE },
};
#define NPOLICIES 4

struct rank_arg {
	uint32_t rank, world;
	const char *job;
};

/* Inexact values (so every rounding shows), different per rank, param, element and round. */
static float value(uint32_t rank, uint32_t param, uint64_t e, uint32_t round)
{
	return (float)(rank + 1) * 0.3183099f + (float)param * 1.7f - (float)e * 0.0731f +
	       (float)round * 0.577f;
}

/* Write this rank's shard rows and its whole grad buffer, the same into both groups. */
static void fill(struct shardd_group *g, uint32_t rank, uint32_t round)
{
	const struct shardd_group_reply *info = shardd_group_info(g);

	for (uint32_t p = 0; p < NPARAMS; p++) {
		const struct shardd_param_layout *l = shardd_group_layout(g, p);
		float *shard = shardd_group_shard(g, p);
		uint64_t n = l->shard_bytes / sizeof(float), gn = l->grad_bytes;
		uint8_t *grad = shardd_group_grad(g, p);

		for (uint64_t e = 0; e < n; e++)
			shard[e] = value(rank, p, e, round + 7);
		gn /= shardd_dtype_size(info->grad_dtype);
		for (uint64_t e = 0; e < gn; e++) {
			float v = value(rank, p, e, round);

			if (info->grad_dtype == SHARDD_DTYPE_FP32)
				((float *)grad)[e] = v;
			else if (info->grad_dtype == SHARDD_DTYPE_BF16)
				((uint16_t *)grad)[e] = shardd_f32_to_bf16(v);
			else
				((uint16_t *)grad)[e] = shardd_f32_to_f16(v / 64);
		}
	}
}

/* The same bytes in both groups' buffer of this param, or a message naming where not. */
static int same(const void *a, const void *b, uint64_t bytes, const char *what, uint32_t policy,
		uint32_t p, uint32_t rank)
{
	CHILD_CHECK(memcmp(a, b, bytes) == 0,
		    "policy %u param %u rank %u: %s differs between exec=daemon and exec=ranks",
		    policy, p, rank, what);
	return 0;
}

static int compare(struct shardd_group *d, struct shardd_group *r, uint32_t policy, uint32_t rank,
		   int unsharded)
{
	for (uint32_t p = 0; p < NPARAMS; p++) {
		const struct shardd_param_layout *l = shardd_group_layout(d, p);

		if (unsharded && same(shardd_group_unsharded(d, p), shardd_group_unsharded(r, p),
				      l->unsharded_bytes, "unsharded", policy, p, rank))
			return 1;
		if (!unsharded && same(shardd_group_shard_grad(d, p), shardd_group_shard_grad(r, p),
				       l->shard_bytes, "sharded grad", policy, p, rank))
			return 1;
	}
	return 0;
}

static int both_rank(void *arg)
{
	const struct rank_arg *a = arg;
	struct shardd_client *c = NULL;
	const struct shardd_group_opts daemon_opts = { .exec = SHARDD_EXEC_DAEMON };
	const struct shardd_group_opts ranks_opts = { .exec = SHARDD_EXEC_RANKS };

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, a->world, &c) == 0, "attach");
	for (uint32_t k = 0; k < NPOLICIES; k++) {
		struct shardd_group *d = NULL, *r = NULL;
		char dn[16], rn[16];

		snprintf(dn, sizeof(dn), "d%u", k);
		snprintf(rn, sizeof(rn), "r%u", k);
		CHILD_CHECK_SHARDD(shardd_group_register(c, dn, params, NPARAMS, &policies[k],
							 &daemon_opts, &d));
		CHILD_CHECK_SHARDD(shardd_group_register(c, rn, params, NPARAMS, &policies[k],
							 &ranks_opts, &r));
		CHILD_CHECK(shardd_group_info(d)->exec == SHARDD_EXEC_DAEMON &&
				    shardd_group_info(r)->exec == SHARDD_EXEC_RANKS,
			    "executors %u and %u", shardd_group_info(d)->exec,
			    shardd_group_info(r)->exec);
		/* Two rounds: the second reduce accumulates into the first's sharded grad. */
		for (uint32_t round = 0; round < 2; round++) {
			fill(d, a->rank, round);
			fill(r, a->rank, round);
			CHILD_CHECK_SHARDD(shardd_unshard(d, round + 1));
			CHILD_CHECK_SHARDD(shardd_unshard(r, round + 1));
			if (compare(d, r, k, a->rank, 1))
				return 1;
			CHILD_CHECK_SHARDD(shardd_reshard(d, round + 1));
			CHILD_CHECK_SHARDD(shardd_reshard(r, round + 1));
			CHILD_CHECK_SHARDD(shardd_reduce(d, round + 1, 0));
			CHILD_CHECK_SHARDD(shardd_reduce(r, round + 1, 0));
			if (compare(d, r, k, a->rank, 0))
				return 1;
		}
		/* A zero_grad is the daemon's on both: the next reduce assigns again. */
		CHILD_CHECK_SHARDD(shardd_zero_grad(d));
		CHILD_CHECK_SHARDD(shardd_zero_grad(r));
		fill(d, a->rank, 5);
		fill(r, a->rank, 5);
		CHILD_CHECK_SHARDD(shardd_reduce(d, 3, 0));
		CHILD_CHECK_SHARDD(shardd_reduce(r, 3, 0));
		if (compare(d, r, k, a->rank, 0))
			return 1;
		shardd_group_close(d);
		shardd_group_close(r);
	}
	shardd_close(c);
	return 0;
}

Test(rank_exec, every_op_and_policy_gives_the_daemons_bytes)
{
	struct rank_arg args[MAX_RANKS];

	for (uint32_t r = 0; r < MAX_RANKS; r++)
		args[r] = (struct rank_arg){ .rank = r, .world = MAX_RANKS, .job = "both" };
	harness_run_children(both_rank, args, sizeof(args[0]), MAX_RANKS, CHILD_MS, &daemon_);
}

/* ------------------------------------------------------------------ */
/* The choice                                                          */
/* ------------------------------------------------------------------ */

/* An UNSHARD entry for group `id` straight onto the ring, as another client library could send. */
static int submit_raw(struct shardd_client *c, uint32_t id)
{
	struct shardd_sqe sqe = { .op = SHARDD_OP_UNSHARD, .group = id, .step = 1, .user_data = 9 };

	if (shardd_sq_push(&c->ring, &sqe) < 0)
		return -EAGAIN;
	return eventfd_write(c->doorbell, 1);
}

static int choice_rank(void *arg)
{
	const struct rank_arg *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *small = NULL, *big = NULL;
	const struct shardd_param_desc big_param = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 2u << 20 }
	};
	struct shardd_completion cp;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, a->world, &c) == 0, "attach");
	CHILD_CHECK_SHARDD(shardd_group_register(c, "small", params, NPARAMS, NULL, NULL, &small));
	CHILD_CHECK_SHARDD(shardd_group_register(c, "big", &big_param, 1, NULL, NULL, &big));
	CHILD_CHECK(shardd_group_info(small)->exec == SHARDD_EXEC_RANKS,
		    "a small auto group is rank-executed, got %u", shardd_group_info(small)->exec);
	CHILD_CHECK(shardd_group_info(big)->exec == SHARDD_EXEC_DAEMON,
		    "an 8 MiB auto group is daemon-executed, got %u", shardd_group_info(big)->exec);
	/* The ring refuses what the ranks run themselves (sent as a client without the group would). */
	CHILD_CHECK(submit_raw(c, shardd_group_id(small)) == 0, "submit: %s", shardd_last_error());
	CHILD_CHECK_SHARDD(shardd_wait(c, &cp, 10000));
	CHILD_CHECK(cp.user_data == 9 && cp.res == -SHARDD_E_STATE &&
			    strstr(cp.msg, "rank-executed"),
		    "unshard of a rank-executed group through the ring: %d '%s'", cp.res, cp.msg);
	CHILD_CHECK_SHARDD(shardd_barrier(c, 1));
	if (a->rank == 0) {
		const char *argv[] = { "groups", a->job, NULL };
		char out[8192];
		json_t *r = harness_shardctl_json(daemon_.socket, argv, 10000, out, sizeof(out));
		json_t *groups =
			json_object_get(json_array_get(json_object_get(r, "jobs"), 0), "groups");
		const char *ex0 =
			json_string_value(json_object_get(json_array_get(groups, 0), "exec_why"));
		const char *ex1 =
			json_string_value(json_object_get(json_array_get(groups, 1), "exec_why"));

		CHILD_CHECK(ex0 && strstr(ex0, "auto: unsharded") && strstr(ex0, "<="),
			    "small group's exec_why: %s", ex0 ? ex0 : "(none)");
		CHILD_CHECK(ex1 && strstr(ex1, "auto: unsharded 8.0 MiB >"),
			    "big group's exec_why: %s", ex1 ? ex1 : "(none)");
		CHILD_CHECK(json_array_size(json_object_get(json_array_get(groups, 0),
							    "exec_ranks")) == a->world,
			    "the rank-executed group lists its ranks");
		json_decref(r);
	}
	CHILD_CHECK_SHARDD(shardd_barrier(c, 2));
	shardd_group_close(small);
	shardd_group_close(big);
	shardd_close(c);
	return 0;
}

Test(rank_exec, auto_picks_by_size_and_shardctl_says_why)
{
	struct rank_arg args[2];

	for (uint32_t r = 0; r < 2; r++)
		args[r] = (struct rank_arg){ .rank = r, .world = 2, .job = "both-choice" };
	harness_run_children(choice_rank, args, sizeof(args[0]), 2, CHILD_MS, &daemon_);
}

static int hsdp_rank(void *arg)
{
	const struct rank_arg *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	const struct shardd_group_opts ranks = { .exec = SHARDD_EXEC_RANKS };
	const struct shardd_group_opts bad = { .exec = 7 };
	int ret;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 2, 1, &c) == 0, "attach");
	ret = shardd_group_register(c, "g", params, NPARAMS, NULL, &ranks, &g);
	CHILD_CHECK(ret == -SHARDD_E_INVALID && strstr(shardd_last_error(), "exec = ranks") &&
			    strstr(shardd_last_error(), "HSDP"),
		    "exec=ranks on an HSDP mesh: %d %s", ret, shardd_last_error());
	ret = shardd_group_register(c, "g", params, NPARAMS, NULL, &bad, &g);
	CHILD_CHECK(ret == -EINVAL && strstr(shardd_last_error(), "exec = 7"), "exec 7: %d %s", ret,
		    shardd_last_error());
	/* Both refusals left nothing behind; auto is the daemon's there. */
	CHILD_CHECK_SHARDD(shardd_barrier(c, 1));
	CHILD_CHECK_SHARDD(shardd_group_register(c, "g", params, NPARAMS, NULL, NULL, &g));
	CHILD_CHECK(shardd_group_info(g)->exec == SHARDD_EXEC_DAEMON, "exec %u",
		    shardd_group_info(g)->exec);
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

Test(rank_exec, ranks_is_refused_where_it_cannot_run)
{
	struct rank_arg args[2];

	for (uint32_t r = 0; r < 2; r++)
		args[r] = (struct rank_arg){ .rank = r, .world = 2, .job = "hsdp" };
	harness_run_children(hsdp_rank, args, sizeof(args[0]), 2, CHILD_MS, &daemon_);
}

/* ------------------------------------------------------------------ */
/* Failures                                                            */
/* ------------------------------------------------------------------ */

struct fault_arg {
	uint32_t rank;
	const char *job;
	int go[2]; /* rank 1 -> rank 0: "registered, about to fail" */
	int mode;  /* FAULT_* */
};

enum {
	FAULT_ABSENT,
	FAULT_DEAD,
	FAULT_GARBAGE,
	FAULT_ENDED
};

#define END_NEEDLE "was ended by an admin request (shardctl end"

/* Whether `shardctl groups JOB` shows rank 0 of group g waiting in an unshard for rank 1. */
static int rank0_waits(const char *job)
{
	const char *argv[] = { "groups", job, NULL };
	char out[8192];
	json_t *r = harness_shardctl_json(daemon_.socket, argv, 10000, out, sizeof(out));
	const json_t *g = json_array_get(
		json_object_get(json_array_get(json_object_get(r, "jobs"), 0), "groups"), 0);
	const json_t *w =
		json_object_get(json_array_get(json_object_get(g, "exec_ranks"), 0), "waiting");
	int found = w && strcmp(json_string_value(json_object_get(w, "op")), "unshard") == 0 &&
		    json_integer_value(json_object_get(w, "for_rank")) == 1;

	json_decref(r);
	return found;
}

/*
 * Rank 1 of FAULT_ENDED: once shardctl shows rank 0 waiting for it, end
 * the job; its own next op fails naming the end.
 */
static int end_the_job(const struct fault_arg *a, struct shardd_group *g)
{
	const char *argv[] = { "end", a->job, NULL };
	int64_t deadline = harness_now_ms() + CHILD_MS / 2;
	char out[4096];
	int ret;

	while (!rank0_waits(a->job))
		CHILD_CHECK(harness_now_ms() < deadline, "rank 0 never showed waiting for rank 1");
	CHILD_CHECK(harness_shardctl(daemon_.socket, argv, 10000, out, sizeof(out)) == 0,
		    "shardctl end: %s", out);
	ret = shardd_unshard(g, 1);
	CHILD_CHECK(ret == -SHARDD_E_SHUTDOWN && strstr(shardd_last_error(), END_NEEDLE),
		    "rank 1's op after the end: %d %s", ret, shardd_last_error());
	return 0;
}

/*
 * Rank 0 of FAULT_ENDED: its unshard in flight, waiting for rank 1, when
 * the job is ended completes with the daemon's words for it (not a
 * timeout, not a bare "detached"), as a daemon-executed op's would; every
 * later wait fails with them.
 */
static int ended_rank0(struct shardd_group *g, struct shardd_client *c)
{
	struct shardd_completion cp;
	int ret;

	CHILD_CHECK_SHARDD(shardd_group_submit(g, SHARDD_OP_UNSHARD, 1, 0, 5));
	CHILD_CHECK_SHARDD(shardd_wait(c, &cp, CHILD_MS));
	CHILD_CHECK(cp.user_data == 5 && cp.res == -SHARDD_E_SHUTDOWN &&
			    strstr(cp.msg, END_NEEDLE) && strstr(cp.msg, "'ended'"),
		    "the unshard in flight when the job ended: %d %s", cp.res, cp.msg);
	ret = shardd_wait(c, &cp, CHILD_MS);
	CHILD_CHECK(ret == -SHARDD_E_SHUTDOWN && strstr(shardd_last_error(), END_NEEDLE),
		    "a wait after the end: %d %s", ret, shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static int fault_rank(void *arg)
{
	struct fault_arg *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	const struct shardd_group_opts ranks = { .exec = SHARDD_EXEC_RANKS };
	int64_t t0;
	char byte;
	int ret;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, 2, &c) == 0, "attach");
	CHILD_CHECK_SHARDD(shardd_group_register(c, "g", params, NPARAMS, NULL, &ranks, &g));
	if (a->rank == 1) {
		if (a->mode == FAULT_GARBAGE) {
			/* Its own slot: op 77 at op 1 of the epoch (said whole), as if it ran another op. */
			struct shardd_exec_slot *s =
				(void *)((uint8_t *)g->buf[SHARDD_BUF_GRAD].addr +
					 shardd_exec_slot_offset(shardd_group_info(g)->grad_size));

			s->what = shardd_exec_word(1, 1);
			s->op = 77;
			s->step = 123456;
			__atomic_store_n(&s->seq, shardd_exec_word(1, 1), __ATOMIC_RELEASE);
		}
		CHILD_CHECK(harness_signal(a->go[1], 'g') == 0, "signal rank 0");
		if (a->mode == FAULT_DEAD)
			raise(SIGKILL);
		if (a->mode == FAULT_ENDED) {
			ret = end_the_job(a, g);
			shardd_group_close(g);
			shardd_close(c);
			return ret;
		}
		/* Absent or lying: it stays attached until rank 0 is done. */
		CHILD_CHECK(harness_read_full(a->go[0], &byte, 1, CHILD_MS) == 0, "rank 0's end");
		shardd_group_close(g);
		shardd_close(c);
		return 0;
	}
	CHILD_CHECK(harness_read_full(a->go[0], &byte, 1, CHILD_MS) == 0, "rank 1 never came");
	t0 = harness_now_ms();
	if (a->mode == FAULT_ENDED)
		return ended_rank0(g, c);
	ret = shardd_unshard(g, 1);
	if (a->mode == FAULT_ABSENT)
		CHILD_CHECK(ret == -SHARDD_E_TIMEOUT && strstr(shardd_last_error(), "rank(s) 1"),
			    "a missing rank times out, named: %d %s", ret, shardd_last_error());
	else if (a->mode == FAULT_DEAD)
		CHILD_CHECK(ret == -SHARDD_E_PEER_DIED &&
				    strstr(shardd_last_error(), "rank 1 left") &&
				    harness_now_ms() - t0 < 2500,
			    "a dead rank fails the op at once, named: %d %s (%lld ms)", ret,
			    shardd_last_error(), (long long)(harness_now_ms() - t0));
	else
		CHILD_CHECK(ret == -SHARDD_E_MISMATCH && strstr(shardd_last_error(), "rank 1") &&
				    strstr(shardd_last_error(), "step 123456"),
			    "garbage in rank 1's slot is rank 1's mismatch: %d %s", ret,
			    shardd_last_error());
	CHILD_CHECK(harness_signal(a->go[1], 'e') == 0, "signal rank 1");
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static void run_fault(const char *job, int mode)
{
	struct fault_arg args[2];
	int to0[2], to1[2];
	pid_t pids[2];

	cr_assert_eq(pipe2(to0, O_CLOEXEC), 0);
	cr_assert_eq(pipe2(to1, O_CLOEXEC), 0);
	/* Each reads its own pipe and writes the other's. */
	args[0] =
		(struct fault_arg){ .rank = 0, .job = job, .go = { to0[0], to1[1] }, .mode = mode };
	args[1] =
		(struct fault_arg){ .rank = 1, .job = job, .go = { to1[0], to0[1] }, .mode = mode };
	for (int r = 0; r < 2; r++) {
		pids[r] = harness_fork(fault_rank, &args[r]);
		cr_assert(pids[r] > 0);
	}
	for (int r = 0; r < 2; r++) {
		int status = 0;

		cr_assert_eq(harness_wait_or_kill(pids[r], CHILD_MS, &status), 0);
		if (r == 1 && mode == FAULT_DEAD)
			cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "rank 1 %s",
				  harness_status_str(status));
		else
			cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d %s", r,
				  harness_status_str(status));
	}
	for (int i = 0; i < 2; i++) {
		close(to0[i]);
		close(to1[i]);
	}
}

Test(rank_exec, a_missing_rank_times_out_named)
{
	run_fault("absent", FAULT_ABSENT);
}

Test(rank_exec, a_dead_rank_fails_its_peers_at_once_named)
{
	run_fault("dead", FAULT_DEAD);
}

Test(rank_exec, a_job_ended_under_a_waiting_op_fails_it_naming_the_end)
{
	run_fault("ended", FAULT_ENDED);
}

/* The daemon and other jobs go on: a fresh job runs its ops after the lying one. */
Test(rank_exec, garbage_in_a_slot_fails_only_its_own_job)
{
	struct rank_arg args[2];

	run_fault("liar", FAULT_GARBAGE);
	for (uint32_t r = 0; r < 2; r++)
		args[r] = (struct rank_arg){ .rank = r, .world = 2, .job = "after-liar" };
	harness_run_children(choice_rank, args, sizeof(args[0]), 2, CHILD_MS, &daemon_);
}

/* ------------------------------------------------------------------ */
/* EXEC_MAP from a hostile client                                      */
/* ------------------------------------------------------------------ */

/* EXEC_MAP with `len` bytes of `m`: its error code, with the daemon's text in `text`. */
static int exec_map_err(struct shardd_client *c, const struct shardd_exec_map *m, uint32_t len,
			char *text, size_t textlen)
{
	struct shardd_ctrl_rx rx = { 0 };
	int ret = shardd_client_request(c, SHARDD_MSG_EXEC_MAP, m, len, 10000,
					SHARDD_MSG_EXEC_MAP_REPLY, &rx);

	snprintf(text, textlen, "%s", shardd_last_error());
	shardd_ctrl_rx_reset(&rx);
	return ret;
}

static int hostile_rank(void *arg)
{
	const struct rank_arg *a = arg;
	const struct shardd_group_opts ranks = { .exec = SHARDD_EXEC_RANKS };
	const struct shardd_group_opts daemon_opts = { .exec = SHARDD_EXEC_DAEMON };
	struct shardd_client *c = NULL;
	struct shardd_group *r = NULL, *d = NULL;
	struct shardd_exec_map m;
	char text[512];
	int ret;

	CHILD_CHECK(harness_attach(&daemon_, a->job, 0, 1, 1, &c) == 0, "attach");
	CHILD_CHECK_SHARDD(shardd_group_register(c, "r", params, NPARAMS, NULL, &ranks, &r));
	CHILD_CHECK_SHARDD(shardd_group_register(c, "d", params, NPARAMS, NULL, &daemon_opts, &d));
	m = (struct shardd_exec_map){ .group_id = shardd_group_id(r), .peer = 0 };
	ret = exec_map_err(c, &m, 5, text, sizeof(text));
	CHILD_CHECK(ret == -SHARDD_E_MALFORMED && strstr(text, "payload is 5 bytes"),
		    "a short payload: %d %s", ret, text);
	m.group_id = 99;
	ret = exec_map_err(c, &m, sizeof(m), text, sizeof(text));
	CHILD_CHECK(ret == -SHARDD_E_NOGROUP && strstr(text, "group_id = 99"),
		    "an unknown group: %d %s", ret, text);
	m.group_id = shardd_group_id(d);
	ret = exec_map_err(c, &m, sizeof(m), text, sizeof(text));
	CHILD_CHECK(ret == -SHARDD_E_STATE && strstr(text, "daemon-executed"),
		    "a daemon-executed group: %d %s", ret, text);
	m = (struct shardd_exec_map){ .group_id = shardd_group_id(r), .peer = 7 };
	ret = exec_map_err(c, &m, sizeof(m), text, sizeof(text));
	CHILD_CHECK(ret == -SHARDD_E_INVALID && strstr(text, "peer = 7"),
		    "a peer outside the job: %d %s", ret, text);
	/* Its own again: already sealed, the same generation, no harm. */
	m.peer = 0;
	CHILD_CHECK(exec_map_err(c, &m, sizeof(m), text, sizeof(text)) == 0, "own again: %s", text);
	/* The session and the group go on, and the metrics count what the rank ran. */
	CHILD_CHECK_SHARDD(shardd_unshard(r, 1));
	CHILD_CHECK_SHARDD(shardd_reshard(r, 1));
	{
		const char *argv[] = { "metrics", NULL };
		char out[65536];
		json_t *m = harness_shardctl_json(daemon_.socket, argv, 10000, out, sizeof(out));
		const char *t = json_string_value(json_object_get(m, "text"));

		CHILD_CHECK(t &&
				    strstr(t, "shardd_rank_executed_ops_total{job=\"hostile-map\","
					      "op=\"unshard\"} 1\n") &&
				    strstr(t, "shardd_rank_executed_ops_total{job=\"hostile-map\","
					      "op=\"reshard\"} 1\n"),
			    "metrics count the rank's own ops:\n%s", t ? t : "(none)");
		json_decref(m);
	}
	shardd_group_close(r);
	shardd_group_close(d);
	shardd_close(c);
	return 0;
}

Test(rank_exec, bad_exec_map_requests_get_errors_naming_the_field)
{
	struct rank_arg arg = { .rank = 0, .world = 1, .job = "hostile-map" };

	harness_run_children(hostile_rank, &arg, sizeof(arg), 1, CHILD_MS, &daemon_);
}

/* The first registration decides: auto joins it, an explicit other ask is a mismatch. */
static int mixed_rank(void *arg)
{
	const struct rank_arg *a = arg;
	const struct shardd_group_opts ranks = { .exec = SHARDD_EXEC_RANKS };
	const struct shardd_group_opts daemon_opts = { .exec = SHARDD_EXEC_DAEMON };
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	int ret;

	CHILD_CHECK(harness_attach(&daemon_, a->job, a->rank, 1, 2, &c) == 0, "attach");
	/* Whichever registers first, the small group runs rank-executed (--rank-exec-max 4M). */
	CHILD_CHECK_SHARDD(
		shardd_group_register(c, "a", params, NPARAMS, NULL, a->rank ? NULL : &ranks, &g));
	CHILD_CHECK(shardd_group_info(g)->exec == SHARDD_EXEC_RANKS, "rank %u: exec %u", a->rank,
		    shardd_group_info(g)->exec);
	CHILD_CHECK_SHARDD(shardd_unshard(g, 1));
	shardd_group_close(g);
	ret = shardd_group_register(c, "b", params, NPARAMS, NULL, a->rank ? &daemon_opts : &ranks,
				    &g);
	CHILD_CHECK(ret == -SHARDD_E_MISMATCH && strstr(shardd_last_error(), "exec differs"),
		    "ranks against daemon: %d %s", ret, shardd_last_error());
	shardd_close(c);
	return 0;
}

Test(rank_exec, the_first_registration_decides_and_auto_follows_it)
{
	struct rank_arg args[2];

	for (uint32_t r = 0; r < 2; r++)
		args[r] = (struct rank_arg){ .rank = r, .world = 2, .job = "mixed" };
	harness_run_children(mixed_rank, args, sizeof(args[0]), 2, CHILD_MS, &daemon_);
}

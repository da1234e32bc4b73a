/* SPDX-License-Identifier: MIT */
/*
 * shardctl against a real shardd ($SHARDD_BIN) with real rank processes in
 * the middle of training: the numbers it reports are checked against what
 * the test itself wrote (dump statistics, layouts), against what the ranks
 * did (op counts, the rank held back), and every --json output is parsed.
 * shardctl runs as a subprocess ($SHARDD_BUILD/shardctl).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <jansson.h>

#include "harness.h"
#include "shardd.h"
#include "shardd_ctrl.h"
#include "shardd_kernels.h"

#define OUT_MAX      (1 << 20)
#define CTL_TIMEOUT  10000
#define STEP_TIMEOUT 20000

/* ------------------------------------------------------------------ */
/* Running shardctl                                                    */
/* ------------------------------------------------------------------ */

static char ctl_out[OUT_MAX];

/* Run shardctl --socket SOCK args... (NULL-terminated); its exit code, output in ctl_out. */
static int ctl_v(const char *sock, va_list ap)
{
	const char *args[29];
	int n = 0;

	while (n < 28 && (args[n] = va_arg(ap, const char *)) != NULL)
		n++;
	args[n] = NULL;
	return harness_shardctl(sock, args, CTL_TIMEOUT, ctl_out, sizeof(ctl_out));
}

static int ctl(const char *sock, ...)
{
	va_list ap;
	int rc;

	va_start(ap, sock);
	rc = ctl_v(sock, ap);
	va_end(ap);
	return rc;
}

/* shardctl --json ...: the parsed reply; asserts exit code `want_rc`. */
static json_t *ctl_json(int want_rc, const char *sock, ...)
{
	json_error_t err;
	va_list ap;
	json_t *j;
	int rc;

	va_start(ap, sock);
	rc = ctl_v(sock, ap);
	va_end(ap);
	cr_assert_eq(rc, want_rc, "shardctl exited %d, expected %d; output:\n%s", rc, want_rc,
		     ctl_out);
	/* On failure stderr comes first in the merged output; the JSON is the last line. */
	{
		char *start = ctl_out, *nl;

		if (want_rc && ctl_out[0] != '{') {
			nl = strstr(ctl_out, "\n{");
			start = nl ? nl + 1 : ctl_out;
		}
		j = json_loads(start, 0, &err);
	}
	cr_assert(j, "shardctl --json output does not parse (%s at %d):\n%s", err.text,
		  err.position, ctl_out);
	cr_assert(json_is_object(j), "reply is not an object:\n%s", ctl_out);
	cr_assert_eq(json_is_true(json_object_get(j, "ok")), want_rc == 0, "ok != %d:\n%s",
		     want_rc == 0, ctl_out);
	return j;
}

static double jnum(const json_t *o, const char *key)
{
	const json_t *v = json_object_get(o, key);

	cr_assert(json_is_number(v), "field '%s' is not a number", key);
	return json_number_value(v);
}

static void assert_close(double got, double want, const char *what)
{
	cr_assert(fabs(got - want) <= 1e-6 * fmax(1.0, fabs(want)), "%s = %.9g, reference %.9g",
		  what, got, want);
}

/* The harness's log thread keeps a pointer to `d`: it must not move. */
static void daemon_start(struct harness_daemon *d)
{
	static const char *const extra[] = { "--collective-timeout", "30", NULL };

	cr_assert_eq(harness_daemon_start(d, extra), 0, "shardd did not start");
}

/* ------------------------------------------------------------------ */
/* Rank processes                                                      */
/* ------------------------------------------------------------------ */

/* Group "blocks.0": w fp32 [5, 3] and b bf16 [7], sharded over 2 ranks. */
#define W_D0 5
#define W_D1 3
#define B_D0 7

static float w_value(uint32_t rank, uint32_t i)
{
	if (rank == 1 && i == 1)
		return NAN;
	if (rank == 1 && i == 2)
		return INFINITY;
	return (float)(rank + 1) * 0.25f * ((float)i - 4.0f);
}

/* Multiples of 1/8 below 2: exact in bf16, whose bits are the fp32's top half. */
static float b_value(uint32_t rank, uint32_t i)
{
	return (float)(rank * 4 + i) / 8.0f;
}

static uint64_t rows_valid(uint64_t d0, uint32_t world, uint32_t rank)
{
	uint64_t rows = (d0 + world - 1) / world;
	uint64_t begin = rank * rows;

	return begin >= d0 ? 0 : d0 - begin < rows ? d0 - begin : rows;
}

struct rank_arg {
	const struct harness_daemon *d;
	const char *job;
	uint32_t rank, world;
	int ready_fd;  /* child writes one byte when it has reached its point */
	int go_fd;     /* child reads one byte to go on */
	int hold_back; /* ranks test: this rank stops after step 1 until told to go */
};

/* param_dtype: NONE keeps each param's dtype; FP32 makes the grads uniform for reduce. */
static int register_blocks(struct shardd_client *c, uint32_t param_dtype, struct shardd_group **g)
{
	struct shardd_param_desc p[2] = {
		{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { W_D0, W_D1 } },
		{ .name = "b", .dtype = SHARDD_DTYPE_BF16, .ndim = 1, .shape = { B_D0 } },
	};
	struct shardd_precision prec = { .param_dtype = param_dtype,
					 .reduce_dtype = SHARDD_DTYPE_NONE };

	return shardd_group_register(c, "blocks.0", p, 2, &prec, NULL, g);
}

/* Write this rank's shards of w and b (valid rows only; padding stays zero). */
static void write_shards(struct shardd_group *g, uint32_t rank, uint32_t world)
{
	float *w = shardd_group_shard(g, 0);
	uint16_t *b = shardd_group_shard(g, 1);
	uint64_t nw = rows_valid(W_D0, world, rank) * W_D1, nb = rows_valid(B_D0, world, rank);

	for (uint32_t i = 0; i < nw; i++)
		w[i] = w_value(rank, i);
	for (uint32_t i = 0; i < nb; i++)
		b[i] = shardd_bf16_truncate(b_value(rank, i));
}

/* Register, write the shards, unshard step 1, report ready, wait for go, reshard. */
static int rank_data_main(void *p)
{
	struct rank_arg *a = p;
	struct shardd_client *c;
	struct shardd_group *g;
	char go;

	CHILD_CHECK(harness_attach(a->d, a->job, a->rank, 1, a->world, &c) == 0, "attach");
	CHILD_CHECK(register_blocks(c, SHARDD_DTYPE_NONE, &g) == 0, "register: %s",
		    shardd_last_error());
	write_shards(g, a->rank, a->world);
	CHILD_CHECK(shardd_unshard(g, 1) == 0, "unshard: %s", shardd_last_error());
	CHILD_CHECK(harness_signal(a->ready_fd, 'R') == 0, "signal");
	CHILD_CHECK(harness_read_full(a->go_fd, &go, 1, STEP_TIMEOUT) == 0, "go");
	CHILD_CHECK(shardd_reshard(g, 1) == 0, "reshard: %s", shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

/*
 * Step 1 in full (unshard, reshard, reduce). Then the held-back rank reports
 * and waits for go before its unshard of step 2; the others submit unshard
 * step 2, report, and wait in it for the held-back rank.
 */
static int rank_step_main(void *p)
{
	struct rank_arg *a = p;
	struct shardd_completion comp;
	struct shardd_client *c;
	struct shardd_group *g;
	char go;

	CHILD_CHECK(harness_attach(a->d, a->job, a->rank, 1, a->world, &c) == 0, "attach");
	CHILD_CHECK(register_blocks(c, SHARDD_DTYPE_FP32, &g) == 0, "register: %s",
		    shardd_last_error());
	CHILD_CHECK(shardd_unshard(g, 1) == 0, "unshard 1: %s", shardd_last_error());
	CHILD_CHECK(shardd_reshard(g, 1) == 0, "reshard 1: %s", shardd_last_error());
	CHILD_CHECK(shardd_reduce(g, 1, 0) == 0, "reduce 1: %s", shardd_last_error());
	if (a->hold_back) {
		CHILD_CHECK(harness_signal(a->ready_fd, 'P') == 0, "signal");
		CHILD_CHECK(harness_read_full(a->go_fd, &go, 1, STEP_TIMEOUT) == 0, "go");
		CHILD_CHECK(shardd_unshard(g, 2) == 0, "unshard 2: %s", shardd_last_error());
	} else {
		CHILD_CHECK(shardd_group_submit(g, SHARDD_OP_UNSHARD, 2, 0, 7) == 0, "submit");
		CHILD_CHECK(harness_signal(a->ready_fd, 'W') == 0, "signal");
		CHILD_CHECK(shardd_wait(c, &comp, STEP_TIMEOUT) == 0, "wait");
		CHILD_CHECK(comp.res == 0 && comp.user_data == 7, "unshard 2: %d %s", comp.res,
			    comp.msg);
	}
	CHILD_CHECK(shardd_reshard(g, 2) == 0, "reshard 2: %s", shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

struct ranks {
	pid_t pid[4];
	struct rank_arg arg[4];
	int ready[2], go[2];
	uint32_t world;
};

static void ranks_start(struct ranks *r, const struct harness_daemon *d, uint32_t world,
			int (*fn)(void *), int hold_back_rank)
{
	cr_assert_eq(pipe(r->ready), 0);
	cr_assert_eq(pipe(r->go), 0);
	r->world = world;
	for (uint32_t i = 0; i < world; i++) {
		r->arg[i] = (struct rank_arg){ .d = d,
					       .job = "train",
					       .rank = i,
					       .world = world,
					       .ready_fd = r->ready[1],
					       .go_fd = r->go[0],
					       .hold_back = (int)i == hold_back_rank };
		r->pid[i] = harness_fork(fn, &r->arg[i]);
		cr_assert_gt(r->pid[i], 0, "fork rank %u", i);
	}
}

/* Wait for n ready bytes; return them in `got`. */
static void ranks_wait_ready(struct ranks *r, uint32_t n, char *got)
{
	for (uint32_t i = 0; i < n; i++)
		cr_assert_eq(harness_read_full(r->ready[0], &got[i], 1, STEP_TIMEOUT), 0,
			     "rank processes did not reach their point");
}

/* Let every rank go on and check that each exits 0. */
static void ranks_finish(struct ranks *r)
{
	for (uint32_t i = 0; i < r->world; i++)
		cr_assert_eq(harness_signal(r->go[1], 'G'), 0);
	for (uint32_t i = 0; i < r->world; i++) {
		int status;

		cr_assert_eq(harness_wait_or_kill(r->pid[i], STEP_TIMEOUT, &status), 0);
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %u %s", i,
			  harness_status_str(status));
	}
	close(r->ready[0]);
	close(r->ready[1]);
	close(r->go[0]);
	close(r->go[1]);
}

/* Two ranks with blocks.0 written and unsharded, waiting for go. */
static void data_job(struct ranks *r, const struct harness_daemon *d)
{
	char got[2];

	ranks_start(r, d, 2, rank_data_main, -1);
	ranks_wait_ready(r, 2, got);
}

/* ------------------------------------------------------------------ */
/* Reference statistics                                                */
/* ------------------------------------------------------------------ */

struct ref {
	double min, max, sum, sumsq;
	long finite, nan, inf, n;
};

static void ref_add(struct ref *s, float v)
{
	s->n++;
	if (isnan(v)) {
		s->nan++;
	} else if (isinf(v)) {
		s->inf++;
	} else {
		if (!s->finite || v < s->min)
			s->min = v;
		if (!s->finite || v > s->max)
			s->max = v;
		s->finite++;
		s->sum += v;
		s->sumsq += (double)v * v;
	}
}

static void assert_stats(const json_t *reply, const struct ref *s)
{
	const json_t *st = json_object_get(reply, "stats");

	cr_assert(st, "dump reply has no stats");
	cr_assert_eq((long)jnum(st, "count"), s->n);
	cr_assert_eq((long)jnum(st, "finite"), s->finite);
	cr_assert_eq((long)jnum(st, "nan"), s->nan);
	cr_assert_eq((long)jnum(st, "inf"), s->inf);
	assert_close(jnum(st, "min"), s->min, "min");
	assert_close(jnum(st, "max"), s->max, "max");
	assert_close(jnum(st, "mean"), s->sum / (double)s->finite, "mean");
	assert_close(jnum(st, "l2"), sqrt(s->sumsq), "l2");
}

/* ------------------------------------------------------------------ */
/* Tests                                                               */
/* ------------------------------------------------------------------ */

Test(shardctl, no_daemon_at_socket_says_how_to_start_one, .timeout = 15)
{
	int rc = ctl("/tmp/shardctl-test-no-such-dir/shardd.sock", "status", NULL);

	cr_assert_eq(rc, 1, "exit %d:\n%s", rc, ctl_out);
	cr_assert(strstr(ctl_out,
			 "shardctl: no shardd at /tmp/shardctl-test-no-such-dir/shardd.sock "
			 "(connect: No such file or directory); start one with `shardd --socket "),
		  "message:\n%s", ctl_out);
	json_decref(
		ctl_json(1, "/tmp/shardctl-test-no-such-dir/shardd.sock", "--json", "jobs", NULL));
}

Test(shardctl, dump_statistics_equal_the_values_the_ranks_wrote, .timeout = 60)
{
	struct harness_daemon d = { 0 };
	struct ranks r;
	struct ref w1 = { 0 }, wall = { 0 }, b0 = { 0 }, b0_rows = { 0 };
	json_t *j, *vals;

	daemon_start(&d);
	data_job(&r, &d);
	for (uint32_t i = 0; i < rows_valid(W_D0, 2, 1) * W_D1; i++)
		ref_add(&w1, w_value(1, i));
	for (uint32_t rk = 0; rk < 2; rk++)
		for (uint32_t i = 0; i < rows_valid(W_D0, 2, rk) * W_D1; i++)
			ref_add(&wall, w_value(rk, i));
	for (uint32_t i = 0; i < rows_valid(B_D0, 2, 0); i++) {
		ref_add(&b0, b_value(0, i));
		if (i >= 1 && i < 3)
			ref_add(&b0_rows, b_value(0, i));
	}

	/* Rank 1's shard of w: its two valid rows, with the NaN and Inf it wrote. */
	j = ctl_json(0, d.socket, "--json", "dump", "blocks.0", "w", "--rank", "1", NULL);
	assert_stats(j, &w1);
	cr_assert_str_eq(json_string_value(json_object_get(j, "dtype")), "fp32");
	vals = json_object_get(j, "values");
	cr_assert_eq(json_array_size(vals), (size_t)w1.n);
	assert_close(json_number_value(json_array_get(vals, 0)), w_value(1, 0), "values[0]");
	cr_assert_str_eq(json_string_value(json_array_get(vals, 1)), "nan");
	cr_assert_str_eq(json_string_value(json_array_get(vals, 2)), "inf");
	assert_close(json_number_value(json_array_get(vals, 5)), w_value(1, 5), "values[5]");
	json_decref(j);

	/* The unsharded copy after unshard(1): both ranks' rows, in order. */
	j = ctl_json(0, d.socket, "--json", "dump", "blocks.0", "w", "--what", "unsharded",
		     "--limit", "100", NULL);
	assert_stats(j, &wall);
	vals = json_object_get(j, "values");
	cr_assert_eq(json_array_size(vals), (size_t)(W_D0 * W_D1));
	assert_close(json_number_value(json_array_get(vals, 9)), w_value(1, 0), "unsharded[9]");
	json_decref(j);

	/* bf16 shard, widened by the daemon; then a row range and a limit. */
	j = ctl_json(0, d.socket, "--json", "dump", "blocks.0", "b", NULL);
	assert_stats(j, &b0);
	cr_assert_str_eq(json_string_value(json_object_get(j, "dtype")), "bf16");
	json_decref(j);
	j = ctl_json(0, d.socket, "--json", "dump", "blocks.0", "b", "--rows", "1:3", "--limit",
		     "1", NULL);
	assert_stats(j, &b0_rows);
	cr_assert_eq(json_array_size(json_object_get(j, "values")), 1);
	cr_assert(json_is_true(json_object_get(j, "truncated")));
	json_decref(j);

	/* The human form shows the same statistics. */
	cr_assert_eq(ctl(d.socket, "dump", "blocks.0", "w", "--rank", "1", NULL), 0, "%s", ctl_out);
	cr_assert(strstr(ctl_out, "count 6  finite 4  nan 1  inf 1"), "dump output:\n%s", ctl_out);

	ranks_finish(&r);
	harness_daemon_stop(&d);
}

static long long jint_at(const json_t *arr, size_t i)
{
	cr_assert(json_is_integer(json_array_get(arr, i)), "element %zu is not an integer", i);
	return (long long)json_integer_value(json_array_get(arr, i));
}

Test(shardctl, show_and_groups_report_the_registered_layout, .timeout = 60)
{
	struct harness_daemon d = { 0 };
	const json_t *params, *w, *b, *g;
	struct ranks r;
	json_t *j;

	daemon_start(&d);
	data_job(&r, &d);
	j = ctl_json(0, d.socket, "--json", "show", "blocks.0", NULL);
	params = json_object_get(j, "params");
	cr_assert_eq(json_array_size(params), 2);
	w = json_array_get(params, 0);
	b = json_array_get(params, 1);
	cr_assert_str_eq(json_string_value(json_object_get(w, "name")), "w");
	cr_assert_str_eq(json_string_value(json_object_get(w, "dtype")), "fp32");
	cr_assert_eq(jint_at(json_object_get(w, "shape"), 0), W_D0);
	cr_assert_eq(jint_at(json_object_get(w, "shape"), 1), W_D1);
	/* FSDP2 padded chunking: ceil(5 / 2) = 3 rows a shard; rank 1 holds 2 of data. */
	cr_assert_eq((long long)jnum(w, "shard_rows"), 3);
	cr_assert_eq(jint_at(json_object_get(w, "rows_valid"), 0), 3);
	cr_assert_eq(jint_at(json_object_get(w, "rows_valid"), 1), 2);
	cr_assert_eq((long long)jnum(w, "shard_offset"), 0);
	cr_assert_str_eq(json_string_value(json_object_get(b, "dtype")), "bf16");
	cr_assert_eq((long long)jnum(b, "shard_rows"), 4);
	cr_assert_eq(jint_at(json_object_get(b, "rows_valid"), 1), 3);
	/* Every offset is a multiple of SHARDD_ALIGN; b's shard follows w's 3 x 3 fp32. */
	cr_assert_eq((long long)jnum(b, "shard_offset"), 64);
	cr_assert_eq((long long)jnum(b, "unsharded_offset") % 64, 0);
	cr_assert_geq((long long)jnum(b, "unsharded_offset"), W_D0 * W_D1 * 4);
	json_decref(j);

	/* Both ranks unsharded step 1 and hold the copy; no reduce is pending. */
	j = ctl_json(0, d.socket, "--json", "groups", NULL);
	g = json_array_get(json_object_get(json_array_get(json_object_get(j, "jobs"), 0), "groups"),
			   0);
	cr_assert_str_eq(json_string_value(json_object_get(g, "name")), "blocks.0");
	cr_assert(json_is_true(json_object_get(g, "complete")));
	cr_assert_eq((long long)jnum(g, "nparams"), 2);
	cr_assert_eq((long long)jnum(g, "unsharded_refcount"), 2);
	cr_assert_eq(json_array_size(json_object_get(g, "pending")), 0);
	cr_assert_eq(json_array_size(json_object_get(g, "partials_present")), 0);
	json_decref(j);

	cr_assert_eq(ctl(d.socket, "show", "blocks.0", NULL), 0, "%s", ctl_out);
	cr_assert(strstr(ctl_out, "[5, 3]"), "show output:\n%s", ctl_out);
	ranks_finish(&r);
	harness_daemon_stop(&d);
}

/* The ranks reply of job `train` once ranks 0 and 1 wait in unshard(2); NULL on deadline. */
static json_t *ranks_when_waiting(const char *sock)
{
	int64_t deadline = harness_now_ms() + STEP_TIMEOUT;

	/* The daemon takes the submitted entries on its own loop turn: watch the state. */
	while (harness_now_ms() < deadline) {
		json_t *j = ctl_json(0, sock, "--json", "ranks", "train", NULL);
		const json_t *job = json_array_get(json_object_get(j, "jobs"), 0);
		const json_t *pending = json_object_get(job, "pending");

		if (json_array_size(pending) == 1 &&
		    json_array_size(json_object_get(json_array_get(pending, 0), "arrived")) == 2)
			return j;
		json_decref(j);
	}
	return NULL;
}

Test(shardctl, ranks_shows_the_rank_held_back, .timeout = 60)
{
	struct harness_daemon d = { 0 };
	const json_t *job, *rk, *p;
	struct ranks r;
	char got[3];
	int parked = 0;
	json_t *j;

	daemon_start(&d);
	ranks_start(&r, &d, 3, rank_step_main, 2);
	ranks_wait_ready(&r, 3, got);
	for (int i = 0; i < 3; i++)
		parked += got[i] == 'P';
	cr_assert_eq(parked, 1);

	j = ranks_when_waiting(d.socket);
	cr_assert(j, "ranks 0 and 1 never showed up waiting in unshard(2)");
	job = json_array_get(json_object_get(j, "jobs"), 0);
	cr_assert_eq((long long)jnum(job, "max_step"), 2);
	p = json_array_get(json_object_get(job, "pending"), 0);
	cr_assert_str_eq(json_string_value(json_object_get(p, "op")), "unshard");
	cr_assert_str_eq(json_string_value(json_object_get(p, "group")), "blocks.0");
	cr_assert_eq((long long)jnum(p, "step"), 2);
	cr_assert_eq(json_array_size(json_object_get(p, "missing")), 1);
	cr_assert_eq(jint_at(json_object_get(p, "missing"), 0), 2);
	for (uint32_t i = 0; i < 3; i++) {
		rk = json_array_get(json_object_get(job, "ranks"), i);
		cr_assert_eq((long long)jnum(rk, "rank"), i);
		cr_assert(json_is_true(json_object_get(rk, "attached")));
		cr_assert_eq((pid_t)jnum(rk, "pid"), r.pid[i]);
		if (i == 2) {
			/* Its last submission was step 1's reduce; it waits in nothing. */
			cr_assert_eq((long long)jnum(rk, "behind"), 1);
			cr_assert_str_eq(json_string_value(json_object_get(
						 json_object_get(rk, "submitted"), "op")),
					 "reduce");
			cr_assert_eq((long long)jnum(rk, "inflight"), 0);
			cr_assert_eq(json_array_size(json_object_get(rk, "waiting")), 0);
		} else {
			cr_assert_eq((long long)jnum(rk, "behind"), 0);
			cr_assert_str_eq(json_string_value(json_object_get(
						 json_object_get(rk, "submitted"), "op")),
					 "unshard");
			cr_assert_eq((long long)jnum(rk, "inflight"), 1);
			cr_assert_eq(json_array_size(json_object_get(rk, "waiting")), 1);
		}
	}
	json_decref(j);

	cr_assert_eq(ctl(d.socket, "ranks", NULL), 0, "%s", ctl_out);
	cr_assert(strstr(ctl_out, "unshard 'blocks.0' step 2: waiting"), "ranks output:\n%s",
		  ctl_out);
	cr_assert(strstr(ctl_out, "for rank(s) 2"), "ranks output:\n%s", ctl_out);

	ranks_finish(&r);
	harness_daemon_stop(&d);
}

Test(shardctl, unknown_names_list_the_existing_ones, .timeout = 60)
{
	struct harness_daemon d = { 0 };
	struct ranks r;
	json_t *j;

	daemon_start(&d);
	data_job(&r, &d);
	j = ctl_json(1, d.socket, "--json", "ranks", "nosuchjob", NULL);
	cr_assert_str_eq(json_string_value(json_object_get(j, "error")),
			 "no job 'nosuchjob'; jobs: 'train'");
	cr_assert_eq((long long)jnum(j, "code"), -SHARDD_E_NOJOB);
	json_decref(j);
	j = ctl_json(1, d.socket, "--json", "show", "blocks.9", NULL);
	cr_assert_str_eq(json_string_value(json_object_get(j, "error")),
			 "no group 'blocks.9'; groups: 'blocks.0' (job 'train')");
	json_decref(j);
	j = ctl_json(1, d.socket, "--json", "dump", "blocks.0", "v", NULL);
	cr_assert_str_eq(json_string_value(json_object_get(j, "error")),
			 "group 'blocks.0' has no param 'v'; params: 'w', 'b'");
	json_decref(j);
	cr_assert_eq(ctl(d.socket, "dump", "blocks.0", "w", "--rank", "5", NULL), 1);
	cr_assert(strstr(ctl_out, "\"rank\" = 5: job 'train' has ranks 0..1"), "%s", ctl_out);
	cr_assert_eq(ctl(d.socket, "groups", "--job", "x", NULL), 1);
	cr_assert(strstr(ctl_out, "shardctl: no job 'x'; jobs: 'train'"), "%s", ctl_out);
	ranks_finish(&r);
	harness_daemon_stop(&d);
}

Test(shardctl, json_output_parses_for_every_command, .timeout = 60)
{
	static const char *const cmds[][4] = {
		{ "status" },
		{ "jobs" },
		{ "ranks" },
		{ "ranks", "train" },
		{ "groups" },
		{ "groups", "train" },
		{ "show", "blocks.0" },
		{ "dump", "blocks.0", "b" },
		{ "stats" },
		{ "metrics" },
	};
	struct harness_daemon d = { 0 };
	struct ranks r;
	json_t *j;

	daemon_start(&d);
	data_job(&r, &d);
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
		j = ctl_json(0, d.socket, "--json", cmds[i][0], cmds[i][1], cmds[i][2], NULL);
		json_decref(j);
		/* The human form of the same command succeeds too. */
		cr_assert_eq(ctl(d.socket, cmds[i][0], cmds[i][1], cmds[i][2], NULL), 0,
			     "shardctl %s:\n%s", cmds[i][0], ctl_out);
	}
	j = ctl_json(0, d.socket, "--json", "status", NULL);
	cr_assert_str_eq(json_string_value(json_object_get(j, "backend")), "host");
	cr_assert_str_eq(json_string_value(json_object_get(j, "socket")), d.socket);
	cr_assert_eq((long long)jnum(j, "ranks_attached"), 2);
	/* Memory by kind, from the layout: 2 ranks x (w 3x3 fp32 -> 64, b 4 bf16 -> 64) = 256. */
	cr_assert_eq((long long)jnum(json_object_get(j, "memory"), "shards"), 2 * 128);
	cr_assert_eq((long long)jnum(json_object_get(j, "memory"), "sharded_grads"), 2 * 128);
	json_decref(j);

	/* watch: plain frames (no terminal control codes) on a pipe, one JSON object a line. */
	cr_assert_eq(ctl(d.socket, "watch", "--count", "2", "--interval", "0.01", NULL), 0, "%s",
		     ctl_out);
	cr_assert_null(strchr(ctl_out, '\033'), "escape codes on a pipe:\n%s", ctl_out);
	cr_assert(strstr(ctl_out, "job 'train'"), "%s", ctl_out);
	cr_assert_eq(ctl(d.socket, "--json", "watch", "--count", "2", "--interval", "0.01", NULL),
		     0);
	{
		char *nl = strchr(ctl_out, '\n');
		json_error_t err;

		cr_assert(nl);
		*nl = 0;
		j = json_loads(ctl_out, 0, &err);
		cr_assert(j && json_object_get(j, "ranks"), "watch --json line: %s", ctl_out);
		json_decref(j);
		j = json_loads(nl + 1, 0, &err);
		cr_assert(j && json_object_get(j, "stats"), "watch --json line 2: %s", nl + 1);
		json_decref(j);
	}
	ranks_finish(&r);
	harness_daemon_stop(&d);
}

Test(shardctl, stats_and_metrics_count_the_ops_a_rank_ran, .timeout = 60)
{
	struct harness_daemon d = { 0 };
	struct shardd_param_desc p = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 100 }
	};
	struct shardd_client *c;
	struct shardd_group *g;
	const json_t *op;
	char line[160];
	size_t i;
	json_t *j;

	daemon_start(&d);
	cr_assert_eq(harness_attach(&d, "metrics", 0, 1, 1, &c), 0);
	cr_assert_eq(shardd_group_register(c, "g", &p, 1, NULL, NULL, &g), 0, "%s",
		     shardd_last_error());
	for (int k = 0; k < 10; k++)
		cr_assert_eq(shardd_nop(c), 0);
	cr_assert_eq(shardd_unshard(g, 1), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_reshard(g, 1), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_reduce(g, 1, 0), 0, "%s", shardd_last_error());

	j = ctl_json(0, d.socket, "--json", "stats", NULL);
	json_array_foreach(json_object_get(j, "ops"), i, op)
	{
		const char *name = json_string_value(json_object_get(op, "op"));
		long long want = strcmp(name, "nop") == 0 ? 10
				 : strcmp(name, "unshard") == 0 || strcmp(name, "reshard") == 0 ||
						 strcmp(name, "reduce") == 0
					 ? 1
					 : 0;

		cr_assert_eq((long long)jnum(op, "count"), want, "op %s", name);
		cr_assert_eq((long long)jnum(op, "failed"), 0, "op %s", name);
		if (want) {
			cr_assert_gt(jnum(op, "max_us"), 0, "op %s", name);
			cr_assert_leq(jnum(op, "p50_us"), jnum(op, "max_us"), "op %s", name);
			cr_assert_leq(jnum(op, "p50_us"), jnum(op, "p99_us"), "op %s", name);
		}
		/* unshard moves the gathered unsharded buffer: 100 fp32 = 400 bytes, padded to 448. */
		if (strcmp(name, "unshard") == 0)
			cr_assert_eq((long long)jnum(op, "bytes"), 448);
	}
	json_decref(j);

	cr_assert_eq(ctl(d.socket, "metrics", NULL), 0, "%s", ctl_out);
	cr_assert(strstr(ctl_out, "# TYPE shardd_ops_total counter\n"), "%s", ctl_out);
	cr_assert(strstr(ctl_out, "\nshardd_ops_total{op=\"nop\"} 10\n"), "%s", ctl_out);
	cr_assert(strstr(ctl_out, "\nshardd_ops_total{op=\"reduce\"} 1\n"), "%s", ctl_out);
	cr_assert(strstr(ctl_out, "# TYPE shardd_op_latency_seconds histogram\n"), "%s", ctl_out);
	cr_assert(strstr(ctl_out, "\nshardd_op_latency_seconds_count{op=\"nop\"} 10\n"), "%s",
		  ctl_out);
	cr_assert(strstr(ctl_out, "shardd_op_latency_seconds_bucket{op=\"nop\",le=\"+Inf\"} 10\n"),
		  "%s", ctl_out);
	cr_assert(strstr(ctl_out, "\nshardd_ranks_attached{job=\"metrics\"} 1\n"), "%s", ctl_out);
	snprintf(line, sizeof(line), "\nshardd_memory_bytes{kind=\"unsharded\"} %d\n", 448);
	cr_assert(strstr(ctl_out, line), "%s", ctl_out);

	shardd_group_close(g);
	shardd_close(c);
	harness_daemon_stop(&d);
}

/* An admin request on a raw connection: reply type and parsed JSON. */
static json_t *raw_admin(int fd, const char *text, uint16_t *type)
{
	struct shardd_ctrl_rx rx = { 0 };
	json_t *j;

	cr_assert_eq(
		shardd_ctrl_send(fd, SHARDD_MSG_ADMIN, 9, text, (uint32_t)strlen(text), NULL, 0),
		0);
	cr_assert_eq(shardd_ctrl_recv(fd, &rx, CTL_TIMEOUT), 0, "no reply to %s", text);
	*type = rx.hdr.type;
	cr_assert_eq(rx.hdr.seq, 9);
	j = json_loadb((const char *)rx.payload, rx.have, 0, NULL);
	shardd_ctrl_rx_reset(&rx);
	cr_assert(j, "reply to %s is not JSON", text);
	return j;
}

Test(shardctl, malformed_admin_requests_get_errors_and_the_connection_goes_on, .timeout = 30)
{
	struct harness_daemon d = { 0 };
	uint16_t type;
	json_t *j;
	int fd;

	daemon_start(&d);
	fd = harness_raw_connect(d.socket);
	cr_assert_geq(fd, 0);
	j = raw_admin(fd, "{\"cmd\": ", &type);
	cr_assert_eq(type, SHARDD_MSG_ADMIN_REPLY);
	cr_assert(json_is_false(json_object_get(j, "ok")));
	cr_assert_eq((long long)jnum(j, "code"), -SHARDD_E_MALFORMED);
	json_decref(j);
	j = raw_admin(fd, "[1, 2]", &type);
	cr_assert_eq((long long)jnum(j, "code"), -SHARDD_E_MALFORMED);
	json_decref(j);
	j = raw_admin(fd, "{\"cmd\": \"format-disk\"}", &type);
	cr_assert_eq((long long)jnum(j, "code"), -SHARDD_E_INVALID);
	cr_assert(strstr(json_string_value(json_object_get(j, "error")), "commands: status"));
	json_decref(j);
	j = raw_admin(fd, "{\"cmd\": \"dump\", \"group\": 7}", &type);
	cr_assert_eq((long long)jnum(j, "code"), -SHARDD_E_INVALID);
	json_decref(j);
	/* Same connection, a good request. */
	j = raw_admin(fd, "{\"cmd\": \"status\"}", &type);
	cr_assert(json_is_true(json_object_get(j, "ok")));
	cr_assert_eq((long long)jnum(j, "jobs"), 0);
	json_decref(j);
	close(fd);
	harness_daemon_stop(&d);
}

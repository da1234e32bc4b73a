/* SPDX-License-Identifier: MIT */
/*
 * Memory limits against a real shardd (issue 11, hole 4): with
 * --max-memory 64 MiB and --max-job-memory 40 MiB, a registration whose
 * buffers would pass either limit is refused with -ENOMEM and a message
 * naming the job, the group, the bytes it needs, those in use, the limit
 * and the flag that raises it; the bytes of a job come back when it ends;
 * a 1 TiB param is refused and the daemon goes on serving others; the
 * admin status shows the limits and what is committed. Before the fix
 * every such registration was accepted (sparse memfds), and the first op
 * that touched the pages could get the daemon OOM-killed.
 *
 * A group of one fp32 param of N elements on a 1x1 mesh holds four
 * buffers of 4N bytes (unsharded, grad, flat shard, sharded grad): 16N.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "harness.h"
#include "shardd_ctrl.h"

#define MIB        (1ull << 20)
#define MAX_MEMORY (64 * MIB)
#define MAX_JOB    (40 * MIB)
#define WAIT_MS    5000

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	const char *extra[] = { "--collective-timeout",
				"5",
				"--max-memory",
				"64M",
				"--max-job-memory",
				"40MiB",
				NULL };

	signal(SIGPIPE, SIG_IGN);
	cr_assert_eq(harness_daemon_start(&daemon_, extra), 0, "shardd did not start");
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(limits, .init = start_daemon, .fini = stop_daemon, .timeout = 60);

/* One admin request's reply object (the caller decrefs). */
static json_t *admin(const char *cmd)
{
	char req[128];
	struct shardd_ctrl_rx rx;
	json_error_t jerr;
	json_t *j;
	int fd = harness_raw_connect(daemon_.socket);

	cr_assert_geq(fd, 0, "connect: %s", strerror(-fd));
	snprintf(req, sizeof(req), "{\"cmd\": \"%s\"}", cmd);
	cr_assert_eq(shardd_ctrl_send(fd, SHARDD_MSG_ADMIN, 1, req, (uint32_t)strlen(req), NULL, 0),
		     0);
	memset(&rx, 0, sizeof(rx));
	cr_assert_eq(shardd_ctrl_recv(fd, &rx, WAIT_MS), 0, "no reply to admin '%s'", cmd);
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_ADMIN_REPLY, "admin '%s' answered with type %u", cmd,
		     rx.hdr.type);
	j = json_loadb((const char *)rx.payload, rx.hdr.length, 0, &jerr);
	cr_assert_not_null(j, "admin reply does not parse: %s", jerr.text);
	shardd_ctrl_rx_reset(&rx);
	close(fd);
	return j;
}

static uint64_t committed(void)
{
	json_t *j = admin("status");
	json_t *l = json_object_get(j, "memory_limits");
	uint64_t v;

	cr_assert(json_is_object(l), "status has no memory_limits");
	cr_assert_eq(json_integer_value(json_object_get(l, "max_memory")), (json_int_t)MAX_MEMORY);
	cr_assert_eq(json_integer_value(json_object_get(l, "max_job_memory")), (json_int_t)MAX_JOB);
	cr_assert_str_eq(json_string_value(json_object_get(l, "max_memory_from")), "--max-memory");
	v = (uint64_t)json_integer_value(json_object_get(l, "committed"));
	json_decref(j);
	return v;
}

/* The job's memory_committed in the jobs reply, or -1 when the job does not exist. */
static long long job_committed(const char *job)
{
	json_t *j = admin("jobs"), *o;
	long long v = -1;
	size_t i;

	json_array_foreach(json_object_get(j, "jobs"), i, o)
	{
		if (!strcmp(json_string_value(json_object_get(o, "name")), job)) {
			v = json_integer_value(json_object_get(o, "memory_committed"));
			cr_assert_eq(json_integer_value(json_object_get(o, "memory_limit")),
				     (json_int_t)MAX_JOB);
		}
	}
	json_decref(j);
	return v;
}

/* A 1x1 job's client, its group of one fp32 param of `n` elements (16n bytes of buffers). */
struct rank1 {
	struct shardd_client *c;
	struct shardd_group *g;      /* the last group registered */
	struct shardd_group *all[4]; /* every group registered, closed by rank1_close */
	int nall;
};

static void rank1_close(struct rank1 *r)
{
	for (int i = 0; i < r->nall; i++)
		shardd_group_close(r->all[i]);
	shardd_close(r->c);
	memset(r, 0, sizeof(*r));
}

static int try_register(struct rank1 *r, const char *job, const char *group, uint64_t n)
{
	struct shardd_param_desc p = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { n }
	};

	if (!r->c)
		cr_assert_eq(harness_attach(&daemon_, job, 0, 1, 1, &r->c), 0, "attach '%s': %s",
			     job, shardd_last_error());
	return shardd_group_register(r->c, group, &p, 1, NULL, NULL, &r->g);
}

static void must_register(struct rank1 *r, const char *job, const char *group, uint64_t n)
{
	int ret = try_register(r, job, group, n);

	cr_assert_eq(ret, 0, "register '%s' of job '%s' (%llu bytes): %s", group, job,
		     (unsigned long long)(16 * n), shardd_last_error());
	cr_assert_lt(r->nall, 4);
	r->all[r->nall++] = r->g;
}

/* The group can be used: an unshard gives back what the rank loaded. */
static void expect_usable(struct rank1 *r, uint64_t n)
{
	float *full = malloc(n * sizeof(float));
	const float *u;

	cr_assert_not_null(full);
	for (uint64_t i = 0; i < n; i++)
		full[i] = (float)(i % 1000) - 500.0f;
	cr_assert_eq(shardd_group_load_full(r->g, 0, full), 0, "load: %s", shardd_last_error());
	cr_assert_eq(shardd_unshard(r->g, 1), 0, "unshard: %s", shardd_last_error());
	u = shardd_group_unsharded(r->g, 0);
	for (uint64_t i = 0; i < n; i++)
		cr_assert_eq(u[i], full[i], "unsharded element %llu: %g, want %g",
			     (unsigned long long)i, (double)u[i], (double)full[i]);
	cr_assert_eq(shardd_reshard(r->g, 1), 0, "reshard: %s", shardd_last_error());
	cr_assert_eq(shardd_zero_grad(r->g), 0, "zero_grad: %s", shardd_last_error());
	free(full);
}

static void expect_text(const char *err, const char *const *needles)
{
	for (int i = 0; needles[i]; i++)
		cr_expect(strstr(err, needles[i]), "error '%s' must name '%s'", err, needles[i]);
}

#define NEEDLES(...) ((const char *const[]){ __VA_ARGS__, NULL })

Test(limits, group_past_max_job_memory_is_refused_naming_job_group_bytes_limit_and_flag)
{
	struct rank1 a = { 0 };
	struct shardd_group *g1;
	int ret;

	/* 2 Mi elements: 32 MiB of the job's 40. */
	must_register(&a, "a", "g1", 2 * MIB);
	g1 = a.g;
	cr_assert_eq(committed(), 32 * MIB);
	cr_assert_eq(job_committed("a"), (long long)(32 * MIB));
	/* 1 Mi elements more would take the job to 48 MiB. */
	ret = try_register(&a, "a", "g2", MIB);
	cr_assert_eq(ret, -ENOMEM, "register past --max-job-memory: %d (%s)", ret,
		     shardd_last_error());
	expect_text(shardd_last_error(),
		    NEEDLES("group 'g2'", "job 'a'", "16.0 MiB (16777216 bytes)",
			    "holds 32.0 MiB (33554432 bytes)", "limit of 40.0 MiB (41943040 bytes)",
			    "--max-job-memory"));
	/* Nothing of the refused group stays counted, and exactly the rest of the limit fits. */
	cr_assert_eq(committed(), 32 * MIB);
	must_register(&a, "a", "g3", MIB / 2);
	cr_assert_eq(job_committed("a"), (long long)MAX_JOB);
	expect_usable(&a, MIB / 2);
	a.g = g1;
	expect_usable(&a, 2 * MIB);
	rank1_close(&a);
}

/* Wait up to WAIT_MS for the daemon's committed bytes to be `want` (a job ending is asynchronous). */
static void wait_committed(uint64_t want)
{
	int64_t until = harness_now_ms() + WAIT_MS;
	uint64_t have;
	struct timespec pause = { 0, 10 * 1000 * 1000 };

	while ((have = committed()) != want && harness_now_ms() < until)
		nanosleep(&pause, NULL);
	cr_assert_eq(have, want, "committed %llu bytes, want %llu", (unsigned long long)have,
		     (unsigned long long)want);
}

Test(limits, jobs_together_past_max_memory_are_refused_and_an_ended_job_frees_its_bytes)
{
	struct rank1 a = { 0 }, b = { 0 }, c = { 0 };
	int ret;

	must_register(&a, "a", "g", 2 * MIB);     /* 32 MiB */
	must_register(&b, "b", "g", 3 * MIB / 2); /* 24 MiB: 56 of 64 */
	/* 16 MiB is within job c's own 40, but takes the daemon to 72. */
	ret = try_register(&c, "c", "g", MIB);
	cr_assert_eq(ret, -ENOMEM, "register past --max-memory: %d (%s)", ret, shardd_last_error());
	expect_text(shardd_last_error(),
		    NEEDLES("group 'g'", "job 'c'", "16.0 MiB (16777216 bytes)",
			    "the daemon (all jobs) holds 56.0 MiB (58720256 bytes)",
			    "limit of 64.0 MiB (67108864 bytes)", "--max-memory"));
	cr_assert_eq(job_committed("c"), 0);
	/* Job a ends (its only rank says goodbye): its 32 MiB come back. */
	rank1_close(&a);
	wait_committed(24 * MIB);
	cr_assert_eq(job_committed("a"), -1, "job 'a' should have ended");
	must_register(&c, "c", "g", MIB);
	cr_assert_eq(committed(), 40 * MIB);
	expect_usable(&c, MIB);
	expect_usable(&b, 3 * MIB / 2);
	rank1_close(&b);
	rank1_close(&c);
	wait_committed(0);
}

Test(limits, a_1_tib_param_is_refused_and_the_daemon_serves_another_client)
{
	/* 2^38 - 16 fp32 elements: 64 bytes short of 1 TiB, within the per-buffer limit; 4 TiB of buffers. */
	const uint64_t n = (1ull << 38) - 16;
	struct rank1 big = { 0 }, other = { 0 };
	int ret;

	ret = try_register(&big, "big", "huge", n);
	cr_assert_eq(ret, -ENOMEM, "a 1 TiB param: %d (%s)", ret, shardd_last_error());
	expect_text(shardd_last_error(),
		    NEEDLES("group 'huge'", "job 'big'", "4.0 TiB (4398046510848 bytes)",
			    "--max-job-memory"));
	cr_assert_eq(committed(), 0);
	/* The daemon is alive, and the refused rank and another job go on. */
	must_register(&big, "big", "small", 1024);
	expect_usable(&big, 1024);
	must_register(&other, "other", "g", 4096);
	expect_usable(&other, 4096);
	rank1_close(&big);
	rank1_close(&other);
}

Test(limits, status_shows_the_limits_and_what_is_committed)
{
	char out[8192];
	struct rank1 a = { 0 };

	must_register(&a, "a", "g", MIB);
	cr_assert_eq(harness_shardctl(daemon_.socket, (const char *const[]){ "status", NULL },
				      WAIT_MS, out, sizeof(out)),
		     0, "shardctl status: %s", out);
	cr_expect(
		strstr(out,
		       "limits   committed 16.0 MiB of 64.0 MiB (--max-memory), per job 40.0 MiB"),
		"shardctl status must show the limits:\n%s", out);
	harness_shardctl(daemon_.socket, (const char *const[]){ "jobs", NULL }, WAIT_MS, out,
			 sizeof(out));
	cr_expect(strstr(out, "16.0 MiB/40.0 MiB"), "shardctl jobs must show committed/limit:\n%s",
		  out);
	rank1_close(&a);
}

Test(limits, memory_flags_take_suffixes_and_refuse_bad_values)
{
	const char *bin = getenv("SHARDD_BIN");
	static const char *const bad[] = { "0", "12Q", "-5", "1.5G", "", "99999999999T" };
	char out[4096];
	int status;

	cr_assert_not_null(bin, "SHARDD_BIN must name the shardd binary");
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		const char *argv[] = { bin, "--max-memory", bad[i], NULL };

		cr_assert_eq(harness_run(argv, WAIT_MS, &status, out, sizeof(out)), 0);
		cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 2, "--max-memory '%s': %s",
			  bad[i], harness_status_str(status));
		cr_expect(strstr(out, "--max-memory") && strstr(out, "byte count"),
			  "--max-memory '%s': %s", bad[i], out);
	}
}

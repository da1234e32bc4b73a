/* SPDX-License-Identifier: MIT */
/*
 * A rank SIGKILLed at random points of a multi-rank training run, then
 * restarted, ends with params bit-identical to an uninterrupted run
 * (issue #13, item 6).
 *
 * train_mlp_faults (train_mlp's launcher with fault hooks) trains the MLP
 * with the daemon's SGD; rank R raises SIGKILL at the P-th point of its
 * schedule (trainer.h, enum rank_point: in an unshard or a reduce it
 * submitted, between the step's last reduce and its step, in a step, after
 * the steps). The other ranks fail wherever the death finds them (in a
 * collective: PEER_DIED naming rank R), report the step they retry, and
 * wait; the launcher restarts rank R into that retry; it re-attaches,
 * applies the step its predecessor reduced but never applied (learned from
 * shardd_group_last_step per group) and joins. The final params (rank 0's
 * dump after the final unshard) must equal the uninterrupted run's byte for
 * byte: an update lost or applied twice anywhere changes them.
 *
 * Each test draws KILL_RUNS (rank, point) pairs from one seed: the
 * environment's SHARDD_KILL_SEED, else the clock; every failure names the
 * seed, so `SHARDD_KILL_SEED=S build/tests/integration/test_step_kill`
 * replays it.
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include "train.h"
#include "trainer.h"

#define KILL_STEPS 6  /* steps of every run: 6 x RANK_POINTS_PER_STEP points per rank */
#define KILL_RUNS  40 /* random kills per test; measured ~0.03 s per run (1x4, host backend) */

/* Daemon flags: a lost rendezvous fails in seconds, well inside the test's timeout. */
static const char *const daemon_args[] = { "--collective-timeout", "10", NULL };

struct kill_cfg {
	unsigned world;
	unsigned replicate;
};

struct kill_env {
	struct harness_daemon d;
	struct kill_cfg cfg;
	char ref[160]; /* the uninterrupted run's dump */
	char got[160];
	char world[16], replicate[16], steps[16];
};

/* Start the daemon and train the uninterrupted run of cfg. */
static void kill_env_start(struct kill_env *e, struct kill_cfg cfg)
{
	static struct train_run r;

	memset(e, 0, sizeof(*e));
	e->cfg = cfg;
	snprintf(e->world, sizeof(e->world), "%u", cfg.world);
	snprintf(e->replicate, sizeof(e->replicate), "%u", cfg.replicate);
	snprintf(e->steps, sizeof(e->steps), "%d", KILL_STEPS);
	cr_assert_eq(harness_daemon_start(&e->d, daemon_args), 0,
		     "shardd did not start (log above)");
	snprintf(e->ref, sizeof(e->ref), "%s/uninterrupted.bin", e->d.dir);
	snprintf(e->got, sizeof(e->got), "%s/killed.bin", e->d.dir);
	train_run(&r, (const char *const[]){ "--spawn", e->world, "--replicate", e->replicate,
					     "--steps", e->steps, "--socket", e->d.socket, "--job",
					     "uninterrupted", "--dump", e->ref, NULL });
	if (!train_run_ok(&r))
		harness_daemon_dump_log(&e->d);
	cr_assert(train_run_ok(&r), "uninterrupted %ux%u run %s:\n%s", cfg.replicate,
		  cfg.world / cfg.replicate, harness_status_str(r.status), r.out);
}

/*
 * Train job `job` with rank `rank` killed at point `point`; its output in
 * *r. Asserts the run succeeded, the kill happened and the params equal the
 * uninterrupted run's. `what` names the case in messages (the seed).
 */
static void kill_run(struct kill_env *e, struct train_run *r, const char *job, unsigned rank,
		     unsigned point, const char *what)
{
	static float want[TRAIN_NPARAMS], got[TRAIN_NPARAMS];
	char rk[16], pt[16], said[64];

	snprintf(rk, sizeof(rk), "%u", rank);
	snprintf(pt, sizeof(pt), "%u", point);
	unlink(e->got);
	train_run_faults(r, (const char *const[]){ "--spawn", e->world, "--replicate", e->replicate,
						   "--steps", e->steps, "--socket", e->d.socket,
						   "--job", job, "--dump", e->got, "--kill-rank",
						   rk, "--kill-point", pt, NULL });
	if (!train_run_ok(r))
		harness_daemon_dump_log(&e->d);
	cr_assert(train_run_ok(r),
		  "%s: %ux%u, rank %u killed at point %u: train_mlp_faults %s; its output:\n%s",
		  what, e->cfg.replicate, e->cfg.world / e->cfg.replicate, rank, point,
		  harness_status_str(r->status), r->out);
	snprintf(said, sizeof(said), "rank %u: raising SIGKILL at point %u:", rank, point);
	cr_assert(strstr(r->out, said), "%s: rank %u was not killed at point %u:\n%s", what, rank,
		  point, r->out);
	train_read_dump(e->ref, want);
	train_read_dump(e->got, got);
	for (int i = 0; i < TRAIN_NPARAMS; i++)
		cr_assert_eq(
			memcmp(&got[i], &want[i], sizeof(float)), 0,
			"%s: %ux%u, rank %u killed at point %u: param %d is %.9g, uninterrupted %.9g; output:\n%s",
			what, e->cfg.replicate, e->cfg.world / e->cfg.replicate, rank, point, i,
			(double)got[i], (double)want[i], r->out);
}

/* KILL_RUNS runs of cfg, each killing a random rank at a random point of the whole run. */
static void random_kills(struct kill_cfg cfg)
{
	static struct train_run r;
	struct kill_env e;
	uint64_t seed = train_seed("SHARDD_KILL_SEED"), rng = seed;
	char what[64], job[32];

	snprintf(what, sizeof(what), "SHARDD_KILL_SEED=%" PRIu64, seed);
	cr_log_info("%s", what);
	kill_env_start(&e, cfg);
	for (int run = 0; run < KILL_RUNS; run++) {
		unsigned rank = (unsigned)(train_draw(&rng) % cfg.world);
		unsigned point = (unsigned)(train_draw(&rng) % (KILL_STEPS * RANK_POINTS_PER_STEP));

		snprintf(job, sizeof(job), "kill%d", run);
		kill_run(&e, &r, job, rank, point, what);
	}
	harness_daemon_stop_expect_clean(&e.d);
}

Test(step_kill, fsdp_1x2_random_kills_end_bit_identical, .timeout = 60)
{
	random_kills((struct kill_cfg){ .world = 2, .replicate = 1 });
}

Test(step_kill, fsdp_1x4_random_kills_end_bit_identical, .timeout = 60)
{
	random_kills((struct kill_cfg){ .world = 4, .replicate = 1 });
}

Test(step_kill, hsdp_2x2_random_kills_end_bit_identical, .timeout = 60)
{
	random_kills((struct kill_cfg){ .world = 4, .replicate = 2 });
}

Test(step_kill, single_rank_random_kills_end_bit_identical, .timeout = 60)
{
	random_kills((struct kill_cfg){ .world = 1, .replicate = 1 });
}

/*
 * One kill of each kind at planned points of a 1 x 2 job, with the step the
 * restarted rank must join. A rank killed once every reduce of step t
 * completed (between the last reduce and the step, in or after the step)
 * leaves its shards at step t - 1 or t while the other rank goes on to step
 * t + 1: its own last step cannot tell it where to resume, the other
 * rank's retry report does.
 */
Test(step_kill, each_kind_of_kill_point_resumes_where_the_others_retry, .timeout = 60)
{
	static struct train_run r;
	static const struct {
		unsigned step, at;    /* at: index within the step (trainer.h, schedule order) */
		unsigned resume, alt; /* the step the others retry; alt: or that one */
	} cases[] = {
		{ 2, 0, 2, 2 }, /* the forward unshard of fc0 */
		{ 2, 3, 2, 2 }, /* the backward unshard of fc2 */
		{ 2, 5, 2, 2 }, /* the reduce of fc2 */
		/* The reduce of fc0, the step's last: the daemon may have taken it before the death. */
		{ 2, 8, 2, 3 },
		{ 2, 9, 3, 3 },  /* between the last reduce and the step */
		{ 2, 11, 3, 3 }, /* in the step of fc1 */
		{ 2, 13, 3, 3 }, /* after the steps, before the loss report */
		/* The last step: the others retry the final unshard. */
		{ KILL_STEPS - 1, 9, KILL_STEPS, KILL_STEPS },
	};
	struct kill_env e;
	char job[32], said[96], alt[96];

	kill_env_start(&e, (struct kill_cfg){ .world = 2, .replicate = 1 });
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		unsigned point = cases[i].step * RANK_POINTS_PER_STEP + cases[i].at;

		snprintf(job, sizeof(job), "planned%zu", i);
		kill_run(&e, &r, job, 1, point, "planned");
		snprintf(said, sizeof(said), "restarting rank 1 into attempt 1 of step %u\n",
			 cases[i].resume);
		snprintf(alt, sizeof(alt), "restarting rank 1 into attempt 1 of step %u\n",
			 cases[i].alt);
		cr_expect(strstr(r.out, said) || strstr(r.out, alt),
			  "killed at point %u: expected '%s' in:\n%s", point, said, r.out);
	}
	harness_daemon_stop_expect_clean(&e.d);
}

/*
 * HSDP: rank 3 (replica 1) killed between the last step's last reduce and
 * its step. Replica 0 finished every step and would leave after its final
 * unshard, which gathers replica 0 only; the job-wide reduce that starts
 * the final fails on every rank instead, so all of them retry the final
 * with the restarted rank 3.
 */
Test(step_kill, hsdp_kill_after_the_last_reduce_retries_the_final_on_every_rank, .timeout = 60)
{
	static struct train_run r;
	struct kill_env e;
	unsigned point = (KILL_STEPS - 1) * RANK_POINTS_PER_STEP + 9;
	char said[96];

	kill_env_start(&e, (struct kill_cfg){ .world = 4, .replicate = 2 });
	kill_run(&e, &r, "last", 3, point, "planned");
	snprintf(said, sizeof(said), "restarting rank 3 into attempt 1 of step %d\n", KILL_STEPS);
	cr_expect(strstr(r.out, said), "expected '%s' in:\n%s", said, r.out);
	harness_daemon_stop_expect_clean(&e.d);
}

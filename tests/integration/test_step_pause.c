/* SPDX-License-Identifier: MIT */
/*
 * A rank stopped (SIGSTOP) past the collective timeout at random points of
 * a multi-rank training run, then continued (SIGCONT), rejoins the others,
 * and the run ends with params bit-identical to an uninterrupted run
 * (issue 26, item 3).
 *
 * train_mlp_faults (train_mlp's launcher with fault hooks) trains the MLP
 * with the daemon's SGD against a daemon whose collective timeout is 1 s;
 * at the P-th point of its schedule (trainer.h, enum rank_point) rank R is
 * stopped for M ms, M drawn past the timeout. The others fail the
 * collective it misses (-SHARDD_E_TIMEOUT naming it) and wait at their
 * retry's barrier (or, when M is past that barrier's timeout too, at the
 * next attempt's). Once continued, rank R's late collective fails at once,
 * naming the ranks that gave up on it (docs/RELIABILITY.md), and it
 * follows them into their retry: no rank waits out a timeout of its own,
 * so the run takes about M more than an uninterrupted one.
 *
 * Each test draws PAUSE_RUNS (rank, point, M) from one seed: the
 * environment's SHARDD_PAUSE_SEED, else the clock; every failure names the
 * seed, so `SHARDD_PAUSE_SEED=S build/tests/integration/test_step_pause`
 * replays it. Each run prints its figures (the pause, the run's wall time
 * and the rest of it beyond the pause).
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

#define PAUSE_STEPS 6    /* steps of every run: 6 x RANK_POINTS_PER_STEP points per rank */
#define PAUSE_RUNS  4    /* random pauses per test; each takes about its pause (1.5 to 2.9 s) */
#define TIMEOUT_MS  1000 /* the daemon's --collective-timeout */
#define PAUSE_MIN_MS \
	1500 /* past the timeout, with room for the others' lag behind the stopped rank */
#define PAUSE_SPAN_MS \
	1400 /* to 2.9 s: the continued rank meets the first retry's barrier or the next one's */
/* Beyond the pause, a run may take the uninterrupted run's time and load; a timeout of its own is a fault. */
#define PAUSE_EXTRA_MS TIMEOUT_MS

static const char *const daemon_args[] = { "--collective-timeout", "1", NULL };

/* PAUSE_RUNS runs of a world x replicate job, each pausing a random rank at a random point. */
static void random_pauses(unsigned world, unsigned replicate)
{
	static struct train_run r;
	static float want[TRAIN_NPARAMS], got[TRAIN_NPARAMS];
	struct harness_daemon d = { 0 };
	uint64_t seed = train_seed("SHARDD_PAUSE_SEED"), rng = seed;
	char what[64], ref[160], dump[160], w[16], rep[16], steps[16];
	int64_t t0, base_ms;

	snprintf(what, sizeof(what), "SHARDD_PAUSE_SEED=%" PRIu64, seed);
	cr_log_info("%s", what);
	snprintf(w, sizeof(w), "%u", world);
	snprintf(rep, sizeof(rep), "%u", replicate);
	snprintf(steps, sizeof(steps), "%d", PAUSE_STEPS);
	cr_assert_eq(harness_daemon_start(&d, daemon_args), 0, "shardd did not start (log above)");
	snprintf(ref, sizeof(ref), "%s/uninterrupted.bin", d.dir);
	snprintf(dump, sizeof(dump), "%s/paused.bin", d.dir);
	t0 = harness_now_ms();
	train_run(&r, (const char *const[]){ "--spawn", w, "--replicate", rep, "--steps", steps,
					     "--socket", d.socket, "--job", "uninterrupted",
					     "--dump", ref, NULL });
	base_ms = harness_now_ms() - t0;
	if (!train_run_ok(&r))
		harness_daemon_dump_log(&d);
	cr_assert(train_run_ok(&r), "uninterrupted %ux%u run %s:\n%s", replicate, world / replicate,
		  harness_status_str(r.status), r.out);
	train_read_dump(ref, want);
	for (int run = 0; run < PAUSE_RUNS; run++) {
		unsigned rank = (unsigned)(train_draw(&rng) % world);
		unsigned point =
			(unsigned)(train_draw(&rng) % (PAUSE_STEPS * RANK_POINTS_PER_STEP));
		unsigned ms = PAUSE_MIN_MS + (unsigned)(train_draw(&rng) % PAUSE_SPAN_MS);
		char job[32], rk[16], pt[16], pms[16], said[96], late[96];
		int64_t took;

		snprintf(job, sizeof(job), "pause%d", run);
		snprintf(rk, sizeof(rk), "%u", rank);
		snprintf(pt, sizeof(pt), "%u", point);
		snprintf(pms, sizeof(pms), "%u", ms);
		unlink(dump);
		t0 = harness_now_ms();
		train_run_faults(&r, (const char *const[]){ "--spawn", w, "--replicate", rep,
							    "--steps", steps, "--socket", d.socket,
							    "--job", job, "--dump", dump,
							    "--pause-rank", rk, "--pause-point", pt,
							    "--pause-ms", pms, NULL });
		took = harness_now_ms() - t0;
		if (!train_run_ok(&r))
			harness_daemon_dump_log(&d);
		cr_assert(train_run_ok(&r),
			  "%s: %ux%u, rank %u stopped %u ms at point %u: train_mlp_faults %s; "
			  "its output:\n%s",
			  what, replicate, world / replicate, rank, ms, point,
			  harness_status_str(r.status), r.out);
		snprintf(said, sizeof(said), "rank %u: SIGSTOP for %u ms at point %u:", rank, ms,
			 point);
		cr_assert(strstr(r.out, said), "%s: rank %u was not stopped at point %u:\n%s", what,
			  rank, point, r.out);
		/* The others gave up on it; it learned so from the daemon at once, not from a timeout of its own. */
		cr_assert(strstr(r.out, "within 1 s;"), "%s: no rank timed out on rank %u:\n%s",
			  what, rank, r.out);
		snprintf(said, sizeof(said), "rank %u submitted ", rank);
		snprintf(late, sizeof(late), "rank %u arrived ", rank);
		cr_assert(
			(strstr(r.out, said) || strstr(r.out, late)) &&
				strstr(r.out,
				       " gave up waiting for it (the collective timeout, 1 s); failed at once"),
			"%s: rank %u was never told the others gave up on it:\n%s", what, rank,
			r.out);
		cr_assert_lt(took, (int64_t)ms + base_ms + PAUSE_EXTRA_MS,
			     "%s: %ux%u, rank %u stopped %u ms at point %u: the run took %" PRId64
			     " ms:\n%s",
			     what, replicate, world / replicate, rank, ms, point, took, r.out);
		train_read_dump(dump, got);
		for (int i = 0; i < TRAIN_NPARAMS; i++)
			cr_assert_eq(
				memcmp(&got[i], &want[i], sizeof(float)), 0,
				"%s: %ux%u, rank %u stopped %u ms at point %u: param %d is %.9g, uninterrupted "
				"%.9g; output:\n%s",
				what, replicate, world / replicate, rank, ms, point, i,
				(double)got[i], (double)want[i], r.out);
		fprintf(stderr,
			"# pause %ux%u rank %u point %u: stopped %u ms, run %" PRId64
			" ms (uninterrupted %" PRId64 " ms), %" PRId64
			" ms beyond the pause; params bit-identical\n",
			replicate, world / replicate, rank, point, ms, took, base_ms, took - ms);
	}
	harness_daemon_stop_expect_clean(&d);
}

Test(step_pause, fsdp_1x2_rank_stopped_past_the_timeout_rejoins_bit_identical, .timeout = 60)
{
	random_pauses(2, 1);
}

Test(step_pause, fsdp_1x4_rank_stopped_past_the_timeout_rejoins_bit_identical, .timeout = 60)
{
	random_pauses(4, 1);
}

Test(step_pause, hsdp_2x2_rank_stopped_past_the_timeout_rejoins_bit_identical, .timeout = 60)
{
	random_pauses(4, 2);
}

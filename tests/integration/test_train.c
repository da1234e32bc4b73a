/* SPDX-License-Identifier: MIT */
/*
 * A real training run through a real shardd: train_mlp's FSDP2 ranks
 * against its single-process reference (same seeds, union of the ranks'
 * batches, no daemon), for world sizes 1 to 4, and with a rank killed in
 * the middle of a reduce and restarted.
 *
 * Tolerance. Both sides run the same fp32 forward/backward code on the
 * same batches, so each rank's gradients are bit-identical to the
 * reference's for that rank as long as the params are. The reference sums
 * the ranks' gradients in fp32 in rank order and divides the sum by the
 * world size, which is the host reduce's specified numerics (fp32 sum and
 * divide, one rounding per collective); SGD is the same fp32 expression on
 * both sides. DESIGN.md does not fix the order in which the daemon adds
 * the ranks' contributions: another order changes one reduce's result by
 * at most (N-1) roundings, ~2.4e-7 relative for N = 4, and the later steps
 * carry that difference. PARITY_RTOL is 1e-5 relative to the param's size
 * (|ref| floored at PARITY_FLOOR, since params pass through zero): room
 * for such reordering over 20 steps of lr 0.1, while one missing or extra
 * SGD step moves the params by ~1e-1 relative and a wrong divide factor by
 * more. Measured with the host backend: 0, every param bit-identical for
 * worlds 1 to 4 and for the crash run; each test logs its measurement.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include "tests/lib/harness.h"

#define PARITY_RTOL  1e-5
#define PARITY_FLOOR 0.1
#define TRAIN_STEPS  20
#define MLP_NPARAMS  (32 * 64 + 64 + 64 * 64 + 64 + 64 * 1 + 1) /* dump floats */
#define RUN_TIMEOUT_MS 25000 /* one train_mlp run; measured under 0.2 s */

/* ------------------------------------------------------------------ */
/* Running train_mlp                                                   */
/* ------------------------------------------------------------------ */

struct run {
	int status;
	char out[1 << 16]; /* stdout and stderr together */
};

/* SHARDD_BUILD/examples/train_mlp with args; its output and exit status. */
static void run_train(struct run *r, const char *const *args)
{
	const char *build = getenv("SHARDD_BUILD");
	const char *argv[32];
	char bin[512];
	int n = 0, ret;

	cr_assert(build && *build, "SHARDD_BUILD must name the build directory (make test sets it)");
	snprintf(bin, sizeof(bin), "%s/examples/train_mlp", build);
	argv[n++] = bin;
	for (int i = 0; args[i] && n < 31; i++)
		argv[n++] = args[i];
	argv[n] = NULL;
	memset(r, 0, sizeof(*r));
	ret = harness_run(argv, RUN_TIMEOUT_MS, &r->status, r->out, sizeof(r->out));
	cr_assert_eq(ret, 0, "running %s: %s\n%s", bin, strerror(-ret), r->out);
}

static int run_ok(const struct run *r)
{
	return WIFEXITED(r->status) && WEXITSTATUS(r->status) == 0;
}

static void start_daemon(struct harness_daemon *d)
{
	cr_assert_eq(harness_daemon_start(d, NULL), 0, "shardd did not start (log above)");
}

/* The "step N loss X" lines of a run, in order; how many. */
static int parse_losses(const char *out, double *loss, int max)
{
	int n = 0;

	for (const char *p = out; p && *p && n < max; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
		unsigned long step;
		double v;

		if (sscanf(p, "step %lu loss %lf", &step, &v) == 2) {
			cr_assert_eq(step, (unsigned long)n, "loss lines out of order at step %lu:\n%s", step, out);
			loss[n++] = v;
		}
	}
	return n;
}

static void read_dump(const char *path, float *v)
{
	FILE *f = fopen(path, "rb");
	size_t n;

	cr_assert(f, "dump '%s' missing: %s", path, strerror(errno));
	n = fread(v, sizeof(float), MLP_NPARAMS + 1, f);
	fclose(f);
	cr_assert_eq(n, (size_t)MLP_NPARAMS, "dump '%s' holds %zu floats, expected %d", path, n, MLP_NPARAMS);
}

/* Largest |a-b| / max(|b|, PARITY_FLOOR) over every param; asserts it is within PARITY_RTOL. */
static void expect_params_match(const char *got_path, const char *ref_path, const char *what)
{
	static float got[MLP_NPARAMS], ref[MLP_NPARAMS];
	double worst = 0.0;
	int at = 0, exact = 0;

	read_dump(got_path, got);
	read_dump(ref_path, ref);
	for (int i = 0; i < MLP_NPARAMS; i++) {
		double scale = fabs((double)ref[i]) > PARITY_FLOOR ? fabs((double)ref[i]) : PARITY_FLOOR;
		double d = fabs((double)got[i] - (double)ref[i]) / scale;

		cr_assert(isfinite(got[i]), "%s: param %d is %f", what, i, (double)got[i]);
		exact += got[i] == ref[i];
		if (d > worst) {
			worst = d;
			at = i;
		}
	}
	cr_log_info("%s: max relative difference to the reference %.3g at param %d (%.9g vs %.9g), "
		    "%d of %d params bit-identical", what, worst, at, (double)got[at], (double)ref[at],
		    exact, MLP_NPARAMS);
	cr_expect(worst <= PARITY_RTOL, "%s: param %d is %.9g, the reference has %.9g: relative difference "
		  "%.3g > %.1g", what, at, (double)got[at], (double)ref[at], worst, PARITY_RTOL);
}

struct paths {
	char got[160];
	char ref[160];
};

static void paths_make(struct paths *p, const struct harness_daemon *d)
{
	snprintf(p->got, sizeof(p->got), "%s/fsdp.bin", d->dir);
	snprintf(p->ref, sizeof(p->ref), "%s/reference.bin", d->dir);
}

static void paths_remove(const struct paths *p)
{
	unlink(p->got);
	unlink(p->ref);
}

/* Train with `world` ranks through the daemon and in the reference; compare. */
static void parity(unsigned world, double *fsdp_loss, double *ref_loss)
{
	static struct run r;
	struct harness_daemon d = { 0 };
	struct paths p;
	char w[16], steps[16];

	snprintf(w, sizeof(w), "%u", world);
	snprintf(steps, sizeof(steps), "%d", TRAIN_STEPS);
	start_daemon(&d);
	paths_make(&p, &d);

	run_train(&r, (const char *const[]){ "--spawn", w, "--steps", steps, "--socket", d.socket,
					     "--dump", p.got, NULL });
	if (!run_ok(&r))
		harness_daemon_dump_log(&d);
	cr_assert(run_ok(&r), "train_mlp --spawn %u %s; its output:\n%s", world,
		  harness_status_str(r.status), r.out);
	cr_assert_eq(parse_losses(r.out, fsdp_loss, TRAIN_STEPS), TRAIN_STEPS, "stdout:\n%s", r.out);

	run_train(&r, (const char *const[]){ "--reference", "--world", w, "--steps", steps,
					     "--dump", p.ref, NULL });
	cr_assert(run_ok(&r), "train_mlp --reference %s:\n%s", harness_status_str(r.status), r.out);
	cr_assert_eq(parse_losses(r.out, ref_loss, TRAIN_STEPS), TRAIN_STEPS, "stdout:\n%s", r.out);

	char what[64];

	snprintf(what, sizeof(what), "world %u, %d steps", world, TRAIN_STEPS);
	expect_params_match(p.got, p.ref, what);
	paths_remove(&p);
	harness_daemon_stop_expect_clean(&d);
}

/* The per-step mean losses agree too: they are computed from the same params. */
static void expect_losses_match(const double *a, const double *b, const char *what)
{
	for (int t = 0; t < TRAIN_STEPS; t++)
		cr_expect(fabs(a[t] - b[t]) <= PARITY_RTOL * fabs(b[t]) + 1e-6,
			  "%s: step %d loss %.6f, reference %.6f", what, t, a[t], b[t]);
}

/* ------------------------------------------------------------------ */
/* Tests                                                               */
/* ------------------------------------------------------------------ */

Test(train, four_ranks_match_single_process_reference, .timeout = 60)
{
	double a[TRAIN_STEPS], b[TRAIN_STEPS];

	parity(4, a, b);
	expect_losses_match(a, b, "world 4");
}

Test(train, loss_falls_below_half_in_20_steps, .timeout = 60)
{
	double a[TRAIN_STEPS], b[TRAIN_STEPS];

	parity(4, a, b);
	/* Measured: 2.32 -> 0.14 with this seed; half is a wide margin, a broken update fails it. */
	cr_expect(a[TRAIN_STEPS - 1] < a[0] / 2, "loss went from %.6f to %.6f", a[0], a[TRAIN_STEPS - 1]);
}

Test(train, one_rank_matches_reference, .timeout = 60)
{
	double a[TRAIN_STEPS], b[TRAIN_STEPS];

	parity(1, a, b);
	expect_losses_match(a, b, "world 1");
}

Test(train, two_ranks_match_reference, .timeout = 60)
{
	double a[TRAIN_STEPS], b[TRAIN_STEPS];

	parity(2, a, b);
	expect_losses_match(a, b, "world 2");
}

Test(train, three_ranks_uneven_shards_match_reference, .timeout = 60)
{
	double a[TRAIN_STEPS], b[TRAIN_STEPS];

	/* 64 rows over 3 ranks: 22, 22, 20 (2 padding rows); the 1-row layer pads 2 of 3 ranks. */
	parity(3, a, b);
	expect_losses_match(a, b, "world 3");
}

Test(train, rank_killed_mid_reduce_restarts_and_run_matches_reference, .timeout = 90)
{
	static struct run r;
	struct harness_daemon d = { 0 };
	struct paths p;
	double loss[TRAIN_STEPS], ref_loss[TRAIN_STEPS];
	const char *line;
	int named = 0;

	start_daemon(&d);
	paths_make(&p, &d);
	run_train(&r, (const char *const[]){ "--spawn", "4", "--steps", "20", "--socket", d.socket,
					     "--kill-rank", "2", "--kill-step", "7", "--dump", p.got, NULL });
	if (!run_ok(&r))
		harness_daemon_dump_log(&d);
	cr_assert(run_ok(&r), "train_mlp with rank 2 killed at step 7 %s; its output:\n%s",
		  harness_status_str(r.status), r.out);
	cr_assert_eq(parse_losses(r.out, loss, TRAIN_STEPS), TRAIN_STEPS, "stdout:\n%s", r.out);
	cr_expect(strstr(r.out, "rank 2 killed itself (SIGKILL) at step 7"), "output:\n%s", r.out);
	cr_expect(strstr(r.out, "rank 2: re-attached; joining attempt 1 of step 7"), "output:\n%s", r.out);
	/* A survivor's failed op carries the daemon's text, which must name the dead rank. */
	for (line = r.out; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
		const char *f = strstr(line, ") failed: ");
		const char *eol = strchr(line, '\n');
		const char *who = f ? strstr(f, "rank 2") : NULL;

		if (strncmp(line, "train_mlp: rank 2:", 18) != 0 && who && (!eol || who < eol))
			named++;
	}
	cr_expect(named >= 1, "no survivor printed an error completion naming rank 2:\n%s", r.out);

	run_train(&r, (const char *const[]){ "--reference", "--world", "4", "--steps", "20",
					     "--dump", p.ref, NULL });
	cr_assert(run_ok(&r), "train_mlp --reference %s:\n%s", harness_status_str(r.status), r.out);
	cr_assert_eq(parse_losses(r.out, ref_loss, TRAIN_STEPS), TRAIN_STEPS);
	expect_params_match(p.got, p.ref, "world 4, rank 2 killed at step 7");
	expect_losses_match(loss, ref_loss, "world 4, rank 2 killed at step 7");
	paths_remove(&p);
	harness_daemon_stop_expect_clean(&d);
}

/* SPDX-License-Identifier: MIT */
/* Running train_mlp from tests (train.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include "train.h"

/* SHARDD_BUILD/rel with args. */
static void run_built(struct train_run *r, const char *rel, const char *const *args)
{
	const char *build = getenv("SHARDD_BUILD");
	const char *argv[32];
	char bin[512];
	int n = 0, ret;

	cr_assert(build && *build,
		  "SHARDD_BUILD must name the build directory (make test sets it)");
	snprintf(bin, sizeof(bin), "%s/%s", build, rel);
	argv[n++] = bin;
	for (int i = 0; args[i] && n < 31; i++)
		argv[n++] = args[i];
	argv[n] = NULL;
	memset(r, 0, sizeof(*r));
	ret = harness_run(argv, TRAIN_RUN_TIMEOUT_MS, &r->status, r->out, sizeof(r->out));
	cr_assert_eq(ret, 0, "running %s: %s\n%s", bin, strerror(-ret), r->out);
}

void train_run(struct train_run *r, const char *const *args)
{
	run_built(r, "examples/train_mlp", args);
}

void train_run_faults(struct train_run *r, const char *const *args)
{
	run_built(r, "tests/integration/train_mlp_faults", args);
}

int train_run_ok(const struct train_run *r)
{
	return WIFEXITED(r->status) && WEXITSTATUS(r->status) == 0;
}

int train_parse_losses(const char *out, double *loss, int max)
{
	int n = 0;

	for (const char *p = out; p && *p && n < max;
	     p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
		unsigned long step;
		double v;

		if (sscanf(p, "step %lu loss %lf", &step, &v) == 2) {
			cr_assert_eq(step, (unsigned long)n,
				     "loss lines out of order at step %lu:\n%s", step, out);
			loss[n++] = v;
		}
	}
	return n;
}

uint64_t train_seed(const char *env)
{
	const char *v = getenv(env);
	struct timespec ts;

	if (v && *v)
		return strtoull(v, NULL, 0);
	clock_gettime(CLOCK_REALTIME, &ts);
	return ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
	       ((uint64_t)getpid() << 32);
}

uint64_t train_draw(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

void train_read_dump(const char *path, float *v)
{
	FILE *f = fopen(path, "rb");
	size_t n;

	cr_assert(f, "dump '%s' missing: %s", path, strerror(errno));
	n = fread(v, sizeof(float), TRAIN_NPARAMS + 1, f);
	fclose(f);
	cr_assert_eq(n, (size_t)TRAIN_NPARAMS, "dump '%s' holds %zu floats, expected %d", path, n,
		     TRAIN_NPARAMS);
}

void train_expect_params_match(const char *got_path, const char *ref_path, const char *what)
{
	static float got[TRAIN_NPARAMS], ref[TRAIN_NPARAMS];
	double worst = 0.0;
	int at = 0, exact = 0;

	train_read_dump(got_path, got);
	train_read_dump(ref_path, ref);
	for (int i = 0; i < TRAIN_NPARAMS; i++) {
		double scale = fabs((double)ref[i]) > TRAIN_PARITY_FLOOR ? fabs((double)ref[i])
									 : TRAIN_PARITY_FLOOR;
		double d = fabs((double)got[i] - (double)ref[i]) / scale;

		cr_assert(isfinite(got[i]), "%s: param %d is %f", what, i, (double)got[i]);
		exact += got[i] == ref[i];
		if (d > worst) {
			worst = d;
			at = i;
		}
	}
	cr_log_info("%s: max relative difference to the reference %.3g at param %d (%.9g vs %.9g), "
		    "%d of %d params bit-identical",
		    what, worst, at, (double)got[at], (double)ref[at], exact, TRAIN_NPARAMS);
	cr_expect(worst <= TRAIN_PARITY_RTOL,
		  "%s: param %d is %.9g, the reference has %.9g: relative "
		  "difference %.3g > %.1g",
		  what, at, (double)got[at], (double)ref[at], worst, TRAIN_PARITY_RTOL);
}

void train_expect_losses_match(const double *a, const double *b, const char *what)
{
	for (int t = 0; t < TRAIN_STEPS; t++)
		cr_expect(fabs(a[t] - b[t]) <= TRAIN_PARITY_RTOL * fabs(b[t]) + 1e-6,
			  "%s: step %d loss %.6f, reference %.6f", what, t, a[t], b[t]);
}

void train_paths_make(struct train_paths *p, const struct harness_daemon *d)
{
	snprintf(p->got, sizeof(p->got), "%s/fsdp.bin", d->dir);
	snprintf(p->ref, sizeof(p->ref), "%s/reference.bin", d->dir);
}

void train_paths_remove(const struct train_paths *p)
{
	unlink(p->got);
	unlink(p->ref);
}

void train_parity(unsigned world, unsigned replicate, const char *const *daemon_args,
		  const char *device, double *fsdp_loss, double *ref_loss)
{
	static struct train_run r;
	struct harness_daemon d = { 0 };
	struct train_paths p;
	char w[16], rep[16], steps[16], what[112];

	snprintf(w, sizeof(w), "%u", world);
	snprintf(rep, sizeof(rep), "%u", replicate);
	snprintf(steps, sizeof(steps), "%d", TRAIN_STEPS);
	cr_assert_eq(harness_daemon_start(&d, daemon_args), 0, "shardd did not start (log above)");
	train_paths_make(&p, &d);

	train_run(&r, (const char *const[]){ "--spawn", w, "--replicate", rep, "--steps", steps,
					     "--socket", d.socket, "--dump", p.got,
					     device ? "--device" : NULL, device, NULL });
	if (!train_run_ok(&r))
		harness_daemon_dump_log(&d);
	cr_assert(train_run_ok(&r), "train_mlp --spawn %u --replicate %u %s; its output:\n%s",
		  world, replicate, harness_status_str(r.status), r.out);
	cr_assert_eq(train_parse_losses(r.out, fsdp_loss, TRAIN_STEPS), TRAIN_STEPS, "stdout:\n%s",
		     r.out);

	train_run(&r, (const char *const[]){ "--reference", "--world", w, "--steps", steps,
					     "--dump", p.ref, NULL });
	cr_assert(train_run_ok(&r), "train_mlp --reference %s:\n%s", harness_status_str(r.status),
		  r.out);
	cr_assert_eq(train_parse_losses(r.out, ref_loss, TRAIN_STEPS), TRAIN_STEPS, "stdout:\n%s",
		     r.out);

	snprintf(what, sizeof(what), "world %u, replicate %u, %d steps%s%s", world, replicate,
		 TRAIN_STEPS, device ? ", device " : "", device ? device : "");
	train_expect_params_match(p.got, p.ref, what);
	train_paths_remove(&p);
	harness_daemon_stop_expect_clean(&d);
}
